"""A graph composed by hand is the builder's graph.

``recipes/compose_nodes.py`` spells out the five stages; ``insitu_pipeline`` builds them in one
call. With the same arguments the two deliver identical batches (indices, bytes, coordinates),
identical epoch reports (every count; timings aside) and the same teardown. The stages share
what they need through one ``StageContext``, which also closes and interrupts every stage
through a plain torchdata node placed between two stages.
"""

from __future__ import annotations

import fcntl
import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import resume_helpers as rh
import zarr
from torchdata.nodes import IterableWrapper, Mapper

from insitubatch_nodes import (
    Coarsen,
    Loader,
    applies,
    as_dataset,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.cache.lock import LOCK_NAME
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.pipeline import PipelineStages
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.schedule import choose_schedule
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import NULL_RECORDER
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode,
    ChunkPoolNode,
    GatherNode,
    PrefetcherNode,
    ReadPlanNode,
    StageContext,
)

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "compose_nodes.py"
ARGV = ["--batch-size", "12", "--block-chunks", "3", "--seed", "7", "--max-inflight", "8"]
COUNTS = (
    "epoch", "complete", "batches", "samples", "gets", "decodes", "hits", "misses", "in_place",
    "re_reads", "evictions", "bytes_fetched", "bytes_delivered", "transforms", "bad_chunks",
    "corrupt", "max_inflight", "decode_threads", "budget_bytes", "auto_budget", "direct",
    "batch_transforms", "split_bytes",
)  # fmt: skip


def _recipe() -> Any:
    spec = importlib.util.spec_from_file_location("compose_nodes_recipe", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rh.write_store(tmp_path_factory.mktemp("compose") / "era5.zarr", n_time=96)


def _views(store: Path) -> dict[str, Any]:
    geoms = open_geometries(open_store(store), ["t2m", "z"])
    return {"x": geoms["t2m"], "y": geoms["t2m"].shift(1), "z": geoms["z"]}


def _hand(store: Path) -> PipelineStages:
    recipe = _recipe()
    stages: PipelineStages = recipe.build_nodes(
        open_store(store), _views(store), recipe.parse_args(ARGV)
    )
    return stages


def _built(store: Path, **kw: Any) -> Any:
    views = _views(store)
    manifest = split_by_chunk(views["x"].base, (0.8, 0.1, 0.1))
    return insitu_pipeline(
        open_store(store), manifest, views, batch_size=12, block_chunks=3, seed=7,
        max_inflight=8, **kw,
    )  # fmt: skip


def _record(batch: Any) -> dict[str, Any]:
    out = rh.record(batch)
    out["coords"] = {
        label: {name: np.asarray(v).tobytes() for name, v in sorted(named.items())}
        for label, named in sorted(batch.coords.items())
    }
    return out


def _run(root: Any, epochs: int = 2) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records, reports = [], []
    loader = Loader(root)
    for _ in range(epochs):
        records += [_record(b) for b in loader]
        report = root.report().as_dict()
        reports.append({k: report[k] for k in COUNTS})
    return records, reports


def test_a_graph_composed_by_hand_delivers_the_builders_batches_reports_and_teardown(
    store: Path,
) -> None:
    hand_stages, built = _hand(store), _built(store)
    hand = hand_stages.prefetch
    try:
        hand_records, hand_reports = _run(hand)
        built_records, built_reports = _run(built)
        assert len(hand_records) == len(built_records) > 10
        assert hand_records == built_records
        assert hand_reports == built_reports
        assert len(hand) == len(built)
        t2m = np.asarray(zarr.open_group(str(store), mode="r")["t2m"][...])
        last = next(iter(Loader(hand)))
        np.testing.assert_array_equal(last.arrays["y"], t2m[last.sample_indices["y"]])
    finally:
        hand.close()
        built.close()
    for stages in (hand_stages, built.stages):
        assert stages.fetch.pinned == 0
        assert stages.fetch.pool.pinned_count() == 0
        assert not stages.prefetch.threads


def test_every_stage_measures_into_the_contexts_recorder_and_none_measures_without_one(
    store: Path,
) -> None:
    stages = _hand(store)
    hand = stages.prefetch
    try:
        recorder = stages.fetch.recorder
        assert recorder.enabled and hand.context.recorder is recorder
        assert stages.resident.recorder is recorder
        assert stages.gather.recorder is recorder and hand.recorder is recorder
    finally:
        hand.close()
    quiet = _built(store, report=False)
    try:
        list(Loader(quiet))
        assert quiet.report() is None and quiet.recorder is NULL_RECORDER
    finally:
        quiet.close()


def _under_a_mapper(store: Path) -> tuple[PrefetcherNode[Any], ChunkPoolNode, ReadPlanNode]:
    """The recipe's graph with a torchdata ``Mapper`` between the gather and prefetch stages:
    ``(root, residency stage, read plan)``."""
    views = _views(store)
    manifest = split_by_chunk(views["x"].base, (0.8, 0.1, 0.1))
    config = PlanConfig(batch_size=12, block_chunks=3, seed=7)
    plan = ReadPlanNode(manifest, views, schedule=choose_schedule(manifest, views, None, config),
                        config=config)  # fmt: skip
    context = StageContext.create(plan, ChunkPool(None), options=FetchOptions(max_inflight=8))
    resident = ChunkPoolNode(AsyncChunkFetchNode(plan, open_store(store), context=context),
                             context=context)  # fmt: skip
    gather = GatherNode(resident, context=context)
    return PrefetcherNode(Mapper(gather, lambda batch: batch), context=context), resident, plan


def test_a_torchdata_node_between_two_stages_keeps_the_report_close_and_interrupt(
    store: Path,
) -> None:
    root, resident, plan = _under_a_mapper(store)
    woken = threading.Event()
    original = resident.interrupt

    def interrupt() -> None:
        woken.set()
        original()

    resident.interrupt = interrupt  # type: ignore[method-assign]
    try:
        records = [_record(b) for b in Loader(root)]
        assert records and root.report() is not None and root.report().batches == len(records)
        assert len(root) == len(records) == len(plan)
        it = iter(Loader(root))
        next(it)  # mid-epoch: the prefetch thread is running when close() comes
        assert not woken.is_set()
    finally:
        root.close()
    assert woken.is_set()  # close interrupted the pool stage through the Mapper
    fetch = resident.source
    assert fetch.pinned == 0 and fetch.pool.pinned_count() == 0 and not root.threads


def test_closing_a_hand_built_graph_lets_go_of_its_cache_directory(
    store: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    donor = _built(store, cache_dir=cache_dir, persist=True)  # for its pool with a cache
    pool = donor.stages.pool
    views = _views(store)
    plan = ReadPlanNode(
        split_by_chunk(views["x"].base, (0.8, 0.1, 0.1)),
        views,
        config=PlanConfig(batch_size=12, block_chunks=3),
    )
    context = StageContext.create(plan, pool)
    fetch = AsyncChunkFetchNode(plan, open_store(store), context=context)
    gather = GatherNode(ChunkPoolNode(fetch, context=context), context=context)
    root: PrefetcherNode[Any] = PrefetcherNode(Mapper(gather, len), context=context)
    try:
        assert sum(Loader(root)) > 0
        assert pool.stats.disk_writes > 0
    finally:
        root.close()
    with open(cache_dir / LOCK_NAME, "rb") as fh:  # a second open file: flock conflicts if held
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fh, fcntl.LOCK_UN)
    donor.close()


def test_as_dataset_takes_any_root_stage_of_a_graph_made_with_a_stage_context(
    store: Path,
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    root, _, plan = _under_a_mapper(store)
    try:
        dataset = as_dataset(root, transform=rh.indexed_transform)
        dl = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
        assert len(dataset) == len(plan)
        it = iter(dl)
        first = [rh.record_item(next(it)) for _ in range(3)]
        state = dl.state_dict()
        after = rh.record_item(next(it))
        assert [r["index"] for r in first] == [0, 1, 2]
        resumed = StatefulDataLoader(
            as_dataset(root, transform=rh.indexed_transform), batch_size=None, num_workers=0
        )
        resumed.load_state_dict(state)
        assert rh.record_item(next(iter(resumed))) == after
    finally:
        root.close()
    with pytest.raises(TypeError, match="ReadPlanNode"):
        as_dataset(IterableWrapper(range(3)))  # type: ignore[arg-type]


def test_a_context_made_with_chunk_transforms_gives_every_stage_the_transformed_views(
    store: Path,
) -> None:
    views = _views(store)
    manifest = split_by_chunk(views["x"].base, (0.8, 0.1, 0.1))
    coarse = [applies("t2m", Coarsen(2))]
    plan = ReadPlanNode(manifest, views, config=PlanConfig(batch_size=12, block_chunks=3, seed=7))
    context = StageContext.create(plan, ChunkPool(), chunk_transforms=coarse)
    assert context.views["x"].inner_shape == tuple(n // 2 for n in views["x"].inner_shape)
    assert context.views["z"] == views["z"]  # an array no transform reads keeps its view
    fetch = AsyncChunkFetchNode(plan, open_store(store), context=context)
    gather = GatherNode(ChunkPoolNode(fetch, context=context), context=context)
    hand: PrefetcherNode[Any] = PrefetcherNode(gather, context=context)
    built = _built(store, chunk_transforms=coarse, coords=())
    try:
        hand_records = [rh.record(b) for b in Loader(hand)]
        assert hand_records == [rh.record(b) for b in Loader(built)]
        assert hand_records and fetch.slot_geoms["t2m"] == context.views["x"].base
    finally:
        hand.close()
        built.close()


@pytest.mark.parametrize("given", ["path", "str"])
def test_the_fetch_stage_takes_a_store_by_path_as_the_builder_does(store: Path, given: str) -> None:
    # a path string failed at the first read with "'str' object has no attribute 'get'"
    views = _views(store)
    plan = ReadPlanNode(
        split_by_chunk(views["x"].base, (0.8, 0.1, 0.1)), views, config=PlanConfig(batch_size=12)
    )
    context = StageContext.create(plan, ChunkPool(None))
    where = store if given == "path" else str(store)
    fetch = AsyncChunkFetchNode(plan, where, context=context)
    root = PrefetcherNode(GatherNode(ChunkPoolNode(fetch, context=context), context=context),
                          context=context)  # fmt: skip
    try:
        batch = next(iter(Loader(root)))
        t2m = np.asarray(zarr.open_group(str(store), mode="r")["t2m"][...])
        np.testing.assert_array_equal(batch.arrays["x"], t2m[batch.sample_indices["x"]])
    finally:
        root.close()
