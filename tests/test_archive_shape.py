"""The archive shape: one sample per chunk, many arrays (WeatherBench2, ARCO-ERA5, OME Z planes).

At one sample per chunk a stored object *is* a batch row: the fetch stage decodes it straight
into the batch (no slot, no pin, no gather copy) where the plan says the chunk is read by one row
of one label this epoch. Every claim of the engine still holds there — batches equal zarr's own
read, each stored object is fetched once per epoch, each valid sample lands in exactly one
batch, kept batches are never overwritten, teardown leaves nothing pinned — checked here on a
real store on disk (read on the decode threads), through a store wrapper (GETs on the IO loop)
and over a real S3 endpoint (moto), with zarr's read as the oracle.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import (
    Oracle,
    View,
    assert_batch_matches,
    chunk_keys_on_disk,
    counting_store,
    expected_anchors,
    run_epoch,
)
from resume_helpers import pipe_config, reference_run, run_fresh, take_state, write_store

from insitubatch_nodes import insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.lending import BufferPool
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.schedule import schedule_floors
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.gather import GatherNode
from insitubatch_nodes.stages.prefetch import PrefetcherNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ChunkPoolNode
from insitubatch_nodes.synthetic import make_weatherbench_like

pytestmark = pytest.mark.timeout(120)

SURFACE, LEVELED = (
    ["2m_temperature", "mean_sea_level_pressure", "surface_pressure"],
    [
        "geopotential",
        "temperature",
    ],
)
NAMES = SURFACE + LEVELED
N_TIME = 96
N_TRAIN = 72  # samples of the (0.75, 0.125, 0.125) split's train part


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("archive") / "wb.zarr"
    make_weatherbench_like(
        root, n_time=N_TIME, n_lat=6, n_lon=8, n_level=3, surface=SURFACE, levels=LEVELED
    )
    return root


@pytest.fixture(scope="module")
def archive_for_s3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The archive's arrays at 48 steps, for the test over moto: its upload and epoch asked
    moto 1,734 requests at 96 steps (about 2 ms of moto's CPU each), 894 at 48; 32 steps leave
    a train split (24 samples) under the budget's working-set floor."""
    root = tmp_path_factory.mktemp("archive_s3") / "wb.zarr"
    make_weatherbench_like(
        root, n_time=48, n_lat=6, n_lon=8, n_level=3, surface=SURFACE, levels=LEVELED
    )
    return root


def _labels(store: Any) -> dict[str, Any]:
    geoms = open_geometries(store, NAMES)
    return {name: geoms[name] for name in NAMES}


def _short_of_split(geoms: Any, n_samples: int) -> int:
    """A budget one sample short of ``n_samples`` samples of every array of ``geoms`` (label ->
    view; ``n_samples``: those an epoch reads): too small to keep the split for the next
    epoch, so the schedule decodes rows of one-sample chunks straight into the batches
    (``kept_bytes``)."""
    return sum(g.sample_nbytes for g in geoms.values()) * (n_samples - 1)


def _oracle_views() -> dict[str, View]:
    return {name: View(name) for name in NAMES}


def _objects(root: Path) -> set[str]:
    return {key for name in NAMES for key in chunk_keys_on_disk(root, name)}


def _delivered(records: list[dict[str, Any]], label: str) -> np.ndarray:
    return np.sort(np.concatenate([r["sample_indices"][label] for r in records]))


# ---------------------------------------------------------------------------------------------
# rows decoded in place equal zarr's read; read-once; sample-once
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reads", ["local", "get"])
def test_rows_of_one_sample_chunks_are_decoded_straight_into_the_batch_as_zarr_reads_them(
    archive: Path, reads: str
) -> None:
    store = archive if reads == "local" else counting_store(archive)
    labels = _labels(store)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    # (coords=(): the time coordinate's own read would count as a GET)
    budget = _short_of_split(labels, N_TRAIN)
    pipe = insitu_pipeline(
        store, manifest, labels, batch_size=8, block_chunks=4, coords=(), cache_budget_bytes=budget
    )
    oracle = Oracle(archive)
    for epoch in range(2):
        records = run_epoch(pipe, oracle, _oracle_views())
        want = expected_anchors(manifest, "train", [0])
        for name in NAMES:  # each valid sample lands in exactly one batch
            np.testing.assert_array_equal(_delivered(records, name), want)
        stats = pipe.stats()
        # no chunk went through the pool: rows were decoded into the batches themselves
        assert stats["resident_peak_bytes"] == 0 and stats["misses"] == 0, stats
        assert stats["gets"] == (epoch + 1) * len(want) * len(NAMES)
        if reads == "get":  # each stored object fetched once per epoch
            counts = store.chunk_counts()
            assert set(counts) == {
                key for key in _objects(archive) if int(key.split("/")[2]) in set(want.tolist())
            }
            assert set(counts.values()) == {epoch + 1}, Counter(counts.values())
        report = pipe.report()
        assert report is not None and report.decodes == len(want) * len(NAMES)
        pipe.reset()
    pipe.close()


def test_a_shifted_target_at_one_sample_per_chunk_reads_each_object_once_through_the_pool(
    archive: Path,
) -> None:
    store = counting_store(archive)
    g = open_geometries(store, ["geopotential"])["geopotential"]
    labels = {"x": g, "y": g.shift(1)}
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, labels, batch_size=8, block_chunks=4, coords=())
    views = {"x": View("geopotential"), "y": View("geopotential", 0, 1)}
    records = run_epoch(pipe, Oracle(archive), views)
    assert set(store.chunk_counts().values()) == {1}  # chunk t serves y of t-1 and x of t
    assert len(store.chunk_counts()) == N_TIME
    np.testing.assert_array_equal(_delivered(records, "x"), np.arange(N_TIME - 1))
    pipe.close()


def test_a_shifted_target_under_the_bounded_schedule_decodes_each_use_into_its_row(
    archive: Path,
) -> None:
    store = counting_store(archive)
    g = open_geometries(store, ["temperature"])["temperature"]
    labels = {"x": g, "y": g.shift(1)}
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    floors = schedule_floors(manifest, labels, PlanConfig(batch_size=8, block_chunks=2))
    assert floors.bounded < floors.read_once  # a budget between them: the bounded schedule
    pipe = insitu_pipeline(
        store, manifest, labels, batch_size=8, block_chunks=2, coords=(),
        cache_budget_bytes=floors.bounded,
    )  # fmt: skip
    views = {"x": View("temperature"), "y": View("temperature", 0, 1)}
    run_epoch(pipe, Oracle(archive), views)
    plan = pipe.stages.plan.epoch_plan(0)
    assert plan.pin_gap is not None and plan.n_fetches > N_TIME  # chunks read once per use
    # every use read once: as many GETs as the schedule's fetches, and fewer pool slots than
    # chunks fetched (uses by one row were decoded into that row)
    assert sum(store.chunk_counts().values()) == plan.n_fetches
    assert pipe.stats()["misses"] < plan.n_fetches
    pipe.close()


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_ranks_read_disjoint_rows_at_one_sample_per_chunk_and_padded_repeats_are_exact(
    archive: Path, remainder: str
) -> None:
    labels = _labels(archive)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    world = 3
    got: list[np.ndarray] = []
    for rank in range(world):
        pipe = insitu_pipeline(
            archive, manifest, labels, batch_size=5, block_chunks=4, rank=rank,
            world_size=world, remainder=remainder, seed=4,
        )  # fmt: skip
        records = run_epoch(pipe, Oracle(archive), _oracle_views())
        got.append(_delivered(records, NAMES[0]))
        pipe.close()
    assert len({len(g) for g in got}) == 1  # every rank delivers the same number of samples
    valid = expected_anchors(manifest, "train", [0])
    everything = np.concatenate(got)
    if remainder == "drop":
        assert len(np.unique(everything)) == len(everything)  # disjoint
        assert len(everything) == len(valid) - len(valid) % world
    else:
        np.testing.assert_array_equal(np.unique(everything), valid)  # none sits out
        assert len(everything) == -(-len(valid) // world) * world  # a few delivered twice


def test_a_rank_keeps_every_chunk_it_read_and_reads_only_chunks_no_earlier_share_held(
    archive: Path,
) -> None:
    # each epoch deals the rank another share. The automatic budget held one share: the
    # chunks of earlier shares were evicted for the new ones, and at 4 ranks an epoch read 3
    # of 4 of its chunks again, for good. Where the split fits the automatic cap, it now holds
    # every chunk the rank has read (and LRU order no longer evicts the kept chunks the next
    # share reads again: 12 of 18 reads were re-reads)
    store = counting_store(archive)
    labels = _labels(store)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    pipe = insitu_pipeline(
        store, manifest, labels, batch_size=4, block_chunks=4, rank=0, world_size=2, coords=()
    )
    oracle = Oracle(archive)
    shares: list[set[int]] = []
    with pipe:
        for epoch in range(3):
            records = run_epoch(pipe, oracle, _oracle_views())
            shares.append(set(_delivered(records, NAMES[0]).tolist()))
            report = pipe.report()
            assert report is not None and report.epoch == epoch
            if epoch:
                new = shares[-1] - set().union(*shares[:-1])
                assert len(shares[-1] - shares[-2]) > 0  # the deal changed
                assert report.gets == report.misses == len(new) * len(NAMES), report
                assert report.hits == (len(shares[-1]) - len(new)) * len(NAMES)
            pipe.reset()
    assert len(new) < len(shares[-1] - shares[-2])  # epoch 2 hits chunks epoch 0 read


def test_tiled_fields_and_edge_tiles_are_decoded_into_their_rows_tile_by_tile(
    tmp_path: Path,
) -> None:
    root = tmp_path / "tiled.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    rng = np.random.default_rng(3)
    for name, shape, chunks in (
        ("a", (40, 7, 10), (1, 3, 4)),  # 3 x 3 tiles, ragged at both edges
        ("b", (40, 2, 7, 10), (1, 2, 7, 10)),  # whole
    ):
        arr = group.create_array(name, shape=shape, chunks=chunks, dtype="f4", fill_value=0)
        arr[...] = rng.random(shape).astype("f4") + 1
    labels = {n: g for n, g in open_geometries(root, ["a", "b"]).items()}
    manifest = split_by_chunk(labels["a"], (1.0, 0.0, 0.0))
    budget = _short_of_split(labels, 40)
    pipe = insitu_pipeline(
        root, manifest, labels, batch_size=6, block_chunks=3, cache_budget_bytes=budget
    )
    run_epoch(pipe, Oracle(root), {"a": View("a"), "b": View("b")})
    assert pipe.stats()["resident_peak_bytes"] == 0
    assert pipe.stats()["gets"] == 40 * (9 + 1)
    pipe.close()


def test_objects_missing_from_the_store_read_as_the_fill_value_in_their_rows(
    tmp_path: Path,
) -> None:
    root = tmp_path / "sparse.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    arr = group.create_array("p", shape=(48, 4, 5), chunks=(1, 4, 5), dtype="f4", fill_value=-1)
    data = np.random.default_rng(0).random((48, 4, 5)).astype("f4")
    data[::3] = -1  # chunks of only the fill value: zarr writes no object for them
    arr[...] = data
    assert len(chunk_keys_on_disk(root, "p")) == 32
    g = open_geometries(root, ["p"])["p"]
    pipe = insitu_pipeline(
        root,
        split_by_chunk(g, (1.0, 0.0, 0.0)),
        {"p": g},
        batch_size=7,
        cache_budget_bytes=_short_of_split({"p": g}, 48),
    )
    records = run_epoch(pipe, Oracle(root), {"p": View("p")}, keep_arrays=True)
    assert sum(len(r["sample_indices"]["p"]) for r in records) == 48
    pipe.close()


@pytest.mark.parametrize("policy", ["raise", "nan"])
def test_a_corrupt_object_decoded_into_a_row_fails_the_batch_or_fills_the_row(
    archive: Path, tmp_path: Path, policy: str
) -> None:
    root = tmp_path / "copy.zarr"
    shutil.copytree(archive, root)
    bad = root / "temperature" / "c" / "10" / "0" / "0" / "0"
    bad.write_bytes(b"\x00not a blosc stream\x00" * 4)
    labels = _labels(root)
    manifest = split_by_chunk(labels[NAMES[0]], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        root,
        manifest,
        labels,
        batch_size=8,
        on_bad_chunk=policy,
        cache_budget_bytes=_short_of_split(labels, len(manifest.samples("train"))),
    )
    if policy == "raise":
        with pytest.raises(ChunkReadError, match=r"temperature.*chunk 10") as info:
            run_epoch(pipe)
        assert info.value.__cause__ is not None
    else:
        records = run_epoch(pipe, keep_arrays=True)
        assert pipe.bad_chunks == [("temperature", 10, (0, 0, 0))]
        oracle = Oracle(root)
        for r in records:
            idx = r["sample_indices"]["temperature"]
            got = r["arrays"]["temperature"]
            for i, t in enumerate(idx.tolist()):
                if t == 10:
                    assert np.isnan(got[i]).all()
                else:
                    np.testing.assert_array_equal(got[i], oracle("temperature", np.array([t]))[0])
    pipe.close()


# ---------------------------------------------------------------------------------------------
# when rows go through the pool instead; hand-built graphs; kept batches; teardown
# ---------------------------------------------------------------------------------------------


def test_a_budget_that_holds_the_split_keeps_one_sample_chunks_for_the_next_epoch(
    archive: Path,
) -> None:
    labels = _labels(archive)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    split_bytes = sum(g.chunk_nbytes for g in labels.values()) * N_TIME
    pipe = insitu_pipeline(
        archive, manifest, labels, batch_size=8, cache_budget_bytes=2 * split_bytes
    )
    run_epoch(pipe, Oracle(archive), _oracle_views())
    gets = pipe.stats()["gets"]
    pipe.reset()
    run_epoch(pipe, Oracle(archive), _oracle_views())
    assert pipe.stats()["gets"] == gets  # the second epoch is pool hits: nothing read again
    report = pipe.report()
    assert report is not None and report.misses == 0 and report.hits > 0
    pipe.close()


@pytest.mark.parametrize(
    ("budget", "direct"),
    [("automatic", None), ("explicit", None), ("automatic", False)],
    ids=["automatic", "explicit", "automatic-through-slots"],
)
def test_a_split_that_fits_the_budget_is_decoded_once_and_later_epochs_read_nothing(
    archive: Path, budget: str, direct: bool | None
) -> None:
    # direct=False (every row through a slot) kept nothing with the automatic budget: its
    # floor held one epoch's working set, and epoch 1 read 135 of 150 objects again
    store = counting_store(archive)
    labels = _labels(store)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    split = sum(g.sample_nbytes for g in labels.values()) * N_TIME  # more than the train split
    pipe = insitu_pipeline(
        store,
        manifest,
        labels,
        batch_size=8,
        block_chunks=4,
        coords=(),
        cache_budget_bytes=None if budget == "automatic" else split,
        fetch=FetchOptions(direct=direct),
    )
    want = expected_anchors(manifest, "train", [0])
    oracle = Oracle(archive)
    for epoch in range(3):
        records = run_epoch(pipe, oracle, _oracle_views())
        for name in NAMES:  # each valid sample lands in exactly one batch, as zarr reads it
            np.testing.assert_array_equal(_delivered(records, name), want)
        report = pipe.report()
        assert report is not None and report.epoch == epoch
        if epoch == 0:  # decoded once, into slots of the pool
            assert report.gets == report.decodes == report.misses == len(want) * len(NAMES)
        else:  # served from the pool: no GET, no decode
            assert (report.gets, report.decodes, report.misses) == (0, 0, 0), report
            assert report.hits == len(want) * len(NAMES)
        pipe.reset()
    counts = store.chunk_counts()  # every stored object of the split fetched once, in all
    assert len(counts) == len(want) * len(NAMES) and set(counts.values()) == {1}
    pipe.close()


def test_an_automatic_budget_keeps_one_sample_chunks_when_the_anchor_array_has_larger_chunks(
    tmp_path: Path,
) -> None:
    # the manifest's array holds 4 samples per chunk, the other one sample per chunk: the
    # schedule keeps the small split (no row decoded straight in), so the automatic budget must
    # grow to hold it, or epoch 1 reads it again (it did: 54 of 60 chunks)
    root = tmp_path / "mixed.zarr"
    group = zarr.open_group(str(root), mode="w")
    values = np.arange(64 * 6 * 8, dtype="float32").reshape(64, 6, 8)
    group.create_array("coarse", shape=values.shape, chunks=(4, 6, 8), dtype="f4")[:] = values
    group.create_array("fine", shape=values.shape, chunks=(1, 6, 8), dtype="f4")[:] = -values
    store = counting_store(root)
    geoms = open_geometries(store, ["coarse", "fine"])
    manifest = split_by_chunk(geoms["coarse"], (0.75, 0.25, 0.0))
    pipe = insitu_pipeline(store, manifest, geoms, batch_size=4, block_chunks=4, coords=())
    oracle = Oracle(root)
    with pipe:
        for epoch in range(2):
            run_epoch(pipe, oracle, {"coarse": View("coarse"), "fine": View("fine")})
            report = pipe.report()
            assert report is not None and report.epoch == epoch
            if epoch == 1:  # served from the pool: no GET
                assert (report.gets, report.misses) == (0, 0), report
            pipe.reset()
    assert set(store.chunk_counts().values()) == {1}  # every object of the split read once


def test_an_automatic_budget_decodes_rows_in_place_when_the_split_exceeds_a_16th_of_ram(
    archive: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from insitubatch_nodes.plan import schedule

    labels = _labels(archive)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    # a machine whose 16th of RAM is one sample short of the split
    monkeypatch.setattr(schedule, "_auto_keep_bytes", lambda: _short_of_split(labels, N_TRAIN))
    pipe = insitu_pipeline(archive, manifest, labels, batch_size=8, block_chunks=4, coords=())
    want = expected_anchors(manifest, "train", [0])
    for _ in range(2):  # every epoch reads and decodes each object into its row again
        run_epoch(pipe, Oracle(archive), _oracle_views())
        report = pipe.report()
        assert report is not None
        assert report.gets == report.decodes == report.misses == len(want) * len(NAMES)
        assert report.hits == 0
        pipe.reset()
    assert pipe.stats()["resident_peak_bytes"] == 0 and pipe.stats()["misses"] == 0
    pipe.close()


def test_a_hand_composed_graph_decodes_rows_in_place_like_the_builders(archive: Path) -> None:
    labels = _labels(archive)
    manifest = split_by_chunk(labels[NAMES[0]], (1.0, 0.0, 0.0))
    budget = _short_of_split(labels, N_TIME)
    pool = ChunkPool(budget)
    plan = ReadPlanNode(manifest, labels, config=PlanConfig(batch_size=8, block_chunks=4))
    ctx = StageContext.create(plan, pool)
    fetch = AsyncChunkFetchNode(plan, open_store(archive), context=ctx)
    graph = PrefetcherNode(GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx), context=ctx)
    hand = run_epoch(graph, Oracle(archive), _oracle_views(), keep_arrays=True)
    assert pool.stats.resident_peak_bytes == 0 and pool.stats.gets == N_TIME * len(NAMES)
    graph.close()
    pipe = insitu_pipeline(
        archive,
        manifest,
        labels,
        batch_size=8,
        block_chunks=4,
        coords=(),
        cache_budget_bytes=budget,
    )
    built = run_epoch(pipe, keep_arrays=True)
    pipe.close()
    assert [r["index"] for r in hand] == [r["index"] for r in built]
    for h, b in zip(hand, built, strict=True):
        for name in NAMES:
            np.testing.assert_array_equal(h["arrays"][name], b["arrays"][name])


def test_one_sample_chunks_another_pipeline_left_in_a_shared_pool_are_hits_and_are_released(
    archive: Path,
) -> None:
    labels = _labels(archive)
    manifest = split_by_chunk(labels[NAMES[0]], (1.0, 0.0, 0.0))
    pool = ChunkPool(budget_bytes=2**30)
    store = open_store(archive)

    def graph(direct: bool) -> PrefetcherNode[Any]:
        config = PlanConfig(batch_size=8, block_chunks=4, seed=2)
        plan = ReadPlanNode(manifest, labels, config=config)
        ctx = StageContext.create(plan, pool, options=FetchOptions(direct=direct))
        fetch = AsyncChunkFetchNode(plan, store, context=ctx)
        resident = ChunkPoolNode(fetch, context=ctx)
        return PrefetcherNode(GatherNode(resident, context=ctx), context=ctx)

    first = graph(direct=False)  # through slots: every chunk stays resident afterwards
    run_epoch(first)
    first.close()
    gets = pool.stats.gets
    second = graph(direct=True)  # the same chunks, now pool hits instead of reads
    run_epoch(second, Oracle(archive), _oracle_views())
    assert pool.stats.gets == gets and pool.stats.hits >= N_TIME * len(NAMES)
    assert pool.pinned_count() == 0  # every hit was released after its batch
    second.close()


def test_batches_kept_by_the_consumer_are_never_overwritten_by_rows_decoded_later(
    archive: Path,
) -> None:
    labels = _labels(archive)
    manifest = split_by_chunk(labels[NAMES[0]], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        archive,
        manifest,
        labels,
        batch_size=8,
        prefetch_depth=1,
        cache_budget_bytes=_short_of_split(labels, N_TIME),
    )
    kept = []
    for _ in range(3):
        kept.extend(pipe)  # the batches themselves, not copies
        pipe.reset()
    oracle = Oracle(archive)
    for batch in kept:
        assert_batch_matches(batch, oracle, _oracle_views())
    pipe.close()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_stopping_mid_epoch_with_rows_in_flight_leaves_nothing_pinned_and_the_next_epoch_exact(
    archive: Path, how: str
) -> None:
    store = counting_store(archive, delay=0.01)  # GETs in flight when it stops
    labels = _labels(store)
    manifest = split_by_chunk(labels[NAMES[0]], (1.0, 0.0, 0.0))
    budget = _short_of_split(labels, N_TIME)
    pipe = insitu_pipeline(
        store, manifest, labels, batch_size=8, block_chunks=8, cache_budget_bytes=budget
    )
    it = iter(pipe)
    next(it)
    getattr(pipe, how)()
    assert pipe.stages.pool.pinned_count() == 0
    assert pipe.stages.fetch.pinned == 0
    pipe.reset()
    records = run_epoch(pipe, Oracle(archive), _oracle_views())
    assert len(records) == len(pipe)
    pipe.close()


# ---------------------------------------------------------------------------------------------
# exact resume, and plans whose size is the sample axis
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh process
@pytest.mark.parametrize("path", ["rows in place", "kept in the pool"])
def test_a_state_taken_mid_epoch_at_one_sample_per_chunk_resumes_bit_identically_elsewhere(
    tmp_path: Path, path: str
) -> None:
    root = write_store(tmp_path / "c1.zarr", samples_per_chunk=1)
    g = open_geometries(root, ["t2m"])["t2m"]
    # one label per array: rows decoded in place, unless the budget keeps the split (automatic)
    train = len(split_by_chunk(g, (0.75, 0.125, 0.125)).samples("train"))
    budget = _short_of_split({"x": g}, train) if path == "rows in place" else None
    cfg = pipe_config(root, windowed=False, cache_budget_bytes=budget)
    full = reference_run(cfg, epochs=2)
    k = 4
    _, state = take_state(cfg, k)
    wire = json.loads(json.dumps(state))
    resp = run_fresh("loader-restore", {"config": cfg, "state": wire, "passes": 2}, tmp_path)
    got = resp["records"]
    want = [{key: v for key, v in r.items() if key != "state"} for r in full[k:]]
    assert [(r["epoch"], r["index"]) for r in got] == [(r["epoch"], r["index"]) for r in want]
    assert [r["idx"] for r in got] == [r["idx"] for r in want]
    assert [r["hash"] for r in got] == [r["hash"] for r in want]


def test_arrays_that_share_the_anchor_grid_share_one_ledger_whatever_their_number() -> None:
    from insitubatch_nodes import ArrayGeometry

    def geoms(n: int) -> dict[str, ArrayGeometry]:
        return {
            f"v{i}": ArrayGeometry(f"v{i}", (10_000, 4, 4), (1, 4, 4), np.dtype("f4"), 0.0)
            for i in range(n)
        }

    one, sixty = geoms(1), geoms(60)
    manifest = split_by_chunk(one["v0"], (1.0, 0.0, 0.0))
    a = plan_epoch(manifest, one, PlanConfig(batch_size=32, seed=1))
    b = plan_epoch(manifest, sixty, PlanConfig(batch_size=32, seed=1))
    assert len(b.ledgers) == 1 and b.ledgers[0].paths == tuple(sixty)
    # the plan's arrays are the sample axis's, not samples x arrays
    for x, y in zip(a.ledgers[0].__dict__.values(), b.ledgers[0].__dict__.values(), strict=True):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.order, b.order)
    assert b.n_fetches == 60 * a.n_fetches
    assert b.batch_fetches(3) == tuple(
        (f"v{i}", c) for _, c in a.batch_fetches(3) for i in range(60)
    )


def test_views_at_another_offset_or_chunking_get_a_ledger_of_their_own() -> None:
    from insitubatch_nodes import ArrayGeometry

    a = ArrayGeometry("a", (64, 2), (1, 2), np.dtype("f4"), 0.0)
    b = ArrayGeometry("b", (64, 2), (1, 2), np.dtype("f4"), 0.0)
    c = ArrayGeometry("c", (64, 2), (4, 2), np.dtype("f4"), 0.0)
    plan = plan_epoch(
        split_by_chunk(a, (1.0, 0.0, 0.0)),
        {"a": a, "b": b, "b1": b.shift(1), "c": c},
        PlanConfig(batch_size=8),
    )
    assert sorted(ledger.paths for ledger in plan.ledgers) == [("a",), ("b",), ("c",)]


# ---------------------------------------------------------------------------------------------
# over a real S3 endpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.xdist_group("s3")
def test_rows_decoded_in_place_over_s3_equal_zarrs_read_and_each_object_is_one_get(
    archive_for_s3: Path,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # and their batch buffers are taken off the IO event loop: a take may wait for a buffer
    # the reserve is still making, and on the loop that wait would stall every GET in flight
    taken_on_loop: list[str] = []
    take = BufferPool.take

    def spy(pool: BufferPool) -> np.ndarray:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            taken_on_loop.append(threading.current_thread().name)
        return take(pool)

    monkeypatch.setattr(BufferPool, "take", spy)
    url = s3_upload(archive_for_s3, "archive/wb.zarr")
    store = open_store(url, **s3_options)
    labels = _labels(store)
    manifest = split_by_chunk(labels[NAMES[0]], (0.75, 0.125, 0.125))
    want = expected_anchors(manifest, "train", [0])
    budget = _short_of_split(labels, len(want))
    pipe = insitu_pipeline(
        store, manifest, labels, batch_size=8, coords=(), cache_budget_bytes=budget
    )
    records = run_epoch(pipe, Oracle(archive_for_s3), _oracle_views())
    np.testing.assert_array_equal(_delivered(records, NAMES[0]), want)
    stats = pipe.stats()
    assert stats["gets"] == len(want) * len(NAMES) and stats["resident_peak_bytes"] == 0
    assert stats["inflight_peak"] <= 32
    pipe.close()
    assert taken_on_loop == []
