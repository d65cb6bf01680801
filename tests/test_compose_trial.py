"""Composing the five stages by hand, found wrong by a black-box trial (docs/pipeline.md).

A graph is ``ReadPlanNode → AsyncChunkFetchNode → ChunkPoolNode → GatherNode → PrefetcherNode``
sharing one ``StageContext``. A graph wired wrong (stages out of order, a stage of another
graph, a stage read by two graphs, a store that is not the plan's) must be refused where it is
built, with a message saying what to do: before, each of these ran and failed later with an
``AttributeError`` or ``KeyError`` from inside the engine, or delivered wrong rows silently.
The graph composed right is held against zarr's own read through torchdata's own nodes.
"""

from __future__ import annotations

import gc
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torchdata.nodes import (
    BaseNode,
    Batcher,
    Mapper,
    MultiNodeWeightedSampler,
    Prefetcher,
    Unbatcher,
)

from insitubatch_nodes import Loader, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan import PlanConfig, choose_schedule, schedule_floors
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode,
    ChunkPoolNode,
    GatherNode,
    PrefetcherNode,
    ReadPlanNode,
    StageContext,
)
from insitubatch_nodes.synthetic import make_era5_like

ORDER = "ReadPlanNode → AsyncChunkFetchNode → ChunkPoolNode → GatherNode → PrefetcherNode"


def _write(path: Path, n_time: int, seed: int) -> Path:
    make_era5_like(path, n_time=n_time, n_lat=4, n_lon=8, samples_per_chunk=8,
                   variables=["t2m"], seed=seed)  # fmt: skip
    return path


# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = pytest.mark.xdist_group("compose_trial")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("compose_trial")
    return {
        "a": _write(tmp / "a.zarr", 64, 0),
        "b": _write(tmp / "b.zarr", 48, 5),
        "short": _write(tmp / "short.zarr", 32, 9),
        "long": _write(tmp / "long.zarr", 128, 2),  # 16 chunks: more than the budget floor
    }


def _plan(path: Path, batch_size: int = 5) -> tuple[Any, ReadPlanNode]:
    store = open_store(path)
    t2m = open_geometries(store, ["t2m"])["t2m"]
    config = PlanConfig(batch_size=batch_size, block_chunks=2, seed=1)
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    return store, ReadPlanNode(manifest, {"x": t2m, "y": t2m.shift(1)}, config=config)


def _graph(path: Path) -> PrefetcherNode[Any]:
    store, plan = _plan(path)
    ctx = StageContext.create(plan, ChunkPool(None), options=FetchOptions(prefetch_depth=2))
    fetch = AsyncChunkFetchNode(plan, store, context=ctx)
    return PrefetcherNode(GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx), context=ctx)


def test_stages_wired_out_of_order_are_refused_where_built_naming_the_order(
    stores: dict[str, Path],
) -> None:
    # before: AttributeError ('FetchedBatch' has no 'slots', 'BatchPlan' has no 'entries') at
    # the first batch, or - a PrefetcherNode over the fetch stage - FetchedBatch items whose
    # pins nobody released
    store, plan = _plan(stores["a"])
    ctx = StageContext.create(plan, ChunkPool(None))
    fetch = AsyncChunkFetchNode(plan, store, context=ctx)
    wrong = {
        "GatherNode over AsyncChunkFetchNode": lambda: GatherNode(fetch, context=ctx),
        "ChunkPoolNode over ReadPlanNode": lambda: ChunkPoolNode(plan, context=ctx),
        "PrefetcherNode over AsyncChunkFetchNode": lambda: PrefetcherNode(fetch, context=ctx),
        "AsyncChunkFetchNode over a Mapper over AsyncChunkFetchNode": lambda: AsyncChunkFetchNode(
            Mapper(fetch, lambda item: item), store, context=ctx
        ),
    }
    for case, build in wrong.items():
        with pytest.raises(ValueError, match=f"(?s){case.split()[0]} is built over .*{ORDER}"):
            build()
    resident = ChunkPoolNode(fetch, context=ctx)
    with pytest.raises(ValueError, match="PrefetcherNode is built over a ChunkPoolNode"):
        PrefetcherNode(resident, context=ctx)
    gather = GatherNode(resident, context=ctx)
    with pytest.raises(ValueError, match="PrefetcherNode is built over a PrefetcherNode"):
        PrefetcherNode(Mapper(PrefetcherNode(gather, context=ctx), len), context=ctx)
    gc.collect()  # (the refused one's source, the inner PrefetcherNode, is gone)
    root = PrefetcherNode(gather, context=ctx)  # the right order
    with root:
        assert len(list(Loader(root))) == len(plan)


def test_a_stage_given_another_graphs_context_or_plan_is_refused_where_built(
    stores: dict[str, Path],
) -> None:
    # before: a fetch stage over plan A with the context of plan B (batch size 7) ran, its
    # length, state and batch buffers B's while A's plans were read; stages of two contexts
    # in one graph ran, each closing only its own context's stages
    store, plan = _plan(stores["a"])
    _, other_plan = _plan(stores["a"], batch_size=7)
    ctx = StageContext.create(plan, ChunkPool(None))
    other = StageContext.create(other_plan, ChunkPool(None))
    with pytest.raises(ValueError, match=r"(?s)another graph.*StageContext.create"):
        AsyncChunkFetchNode(plan, store, context=other)
    fetch = AsyncChunkFetchNode(plan, store, context=ctx)
    with pytest.raises(ValueError, match=r"(?s)another graph.*one StageContext"):
        ChunkPoolNode(fetch, context=other)
    gather = GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx)
    with pytest.raises(ValueError, match="another graph"):
        PrefetcherNode(Mapper(gather, lambda b: b), context=other)


def test_a_stage_that_feeds_one_graph_is_refused_as_the_source_of_a_second(
    stores: dict[str, Path],
) -> None:
    # before: one ReadPlanNode (or fetch stage) under two graphs failed with KeyError
    # ('t2m', 3) from inside the pool once both ran; one GatherNode under two roots ran, each
    # root silently getting every other batch of one epoch
    store, plan = _plan(stores["a"])
    ctx = StageContext.create(plan, ChunkPool(None))
    fetch = AsyncChunkFetchNode(plan, store, context=ctx)
    second = StageContext.create(plan, ChunkPool(None))
    with pytest.raises(ValueError, match=r"(?s)ReadPlanNode already feeds .*second graph"):
        AsyncChunkFetchNode(plan, store, context=second)
    resident = ChunkPoolNode(fetch, context=ctx)
    with pytest.raises(ValueError, match="AsyncChunkFetchNode already feeds a ChunkPoolNode"):
        ChunkPoolNode(Mapper(fetch, lambda item: item), context=ctx)
    with pytest.raises(ValueError, match="coords"):  # refused for its own arguments: it
        GatherNode(resident, context=ctx, coords={"q": {}})  # takes nothing from the graph
    first = GatherNode(resident, context=ctx)
    with pytest.raises(ValueError, match="ChunkPoolNode already feeds a GatherNode"):
        GatherNode(resident, context=ctx)
    del first
    gc.collect()  # the first GatherNode is gone: nothing reads the residency stage now
    gather = GatherNode(resident, context=ctx)
    root = PrefetcherNode(gather, context=ctx)
    with pytest.raises(ValueError, match="GatherNode already feeds a PrefetcherNode"):
        PrefetcherNode(Mapper(gather, lambda b: b), context=ctx)
    with root:
        rows = [int(s) for b in Loader(root) for s in b.sample_indices["x"]]
    assert sorted(rows) == list(range(63))  # every valid anchor once


def test_a_context_pool_or_source_that_is_not_one_is_refused_saying_what_to_pass(
    stores: dict[str, Path],
) -> None:
    # before: AttributeError ('NoneType' object has no attribute 'options' / 'cache'), a list
    # accepted as the fetch stage's source, a budget of "1GB" accepted by the pool
    store, plan = _plan(stores["a"])
    with pytest.raises(TypeError, match=r"StageContext\.create\(plan, pool\)"):
        AsyncChunkFetchNode(plan, store, context=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ChunkPool"):
        StageContext.create(plan, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReadPlanNode"):
        StageContext.create("plan", ChunkPool(None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="budget_bytes"):
        ChunkPool("1GB")  # type: ignore[arg-type]
    ctx = StageContext.create(plan, ChunkPool(None))
    with pytest.raises(TypeError, match=r"torchdata.nodes.BaseNode"):
        AsyncChunkFetchNode([plan], store, context=ctx)  # type: ignore[arg-type]


def test_a_fetch_stage_over_a_store_whose_arrays_differ_from_the_plan_is_refused(
    stores: dict[str, Path],
) -> None:
    # before: over a store whose t2m has 32 steps where the plan's has 64, every epoch ran and
    # the rows past step 31 came back as the fill value (the builder refused it already)
    _, plan = _plan(stores["a"])
    ctx = StageContext.create(plan, ChunkPool(None))
    with pytest.raises(ValueError, match=r"(?s)shape \(32, 4, 8\) in the store.*open_geometries"):
        AsyncChunkFetchNode(plan, stores["short"], context=ctx)


def test_two_hand_built_graphs_mixed_by_torchdata_resume_bit_exact_in_fresh_graphs(
    stores: dict[str, Path],
) -> None:
    """Holds (no fix): MultiNodeWeightedSampler over two graphs, each under a Mapper, under a
    Prefetcher; a state mid-epoch through torch.save/load restores into freshly built graphs
    and continues with the same rows, each equal to zarr's read."""
    oracle = {k: zarr.open_array(stores[k], path="t2m", mode="r")[...] for k in ("a", "b")}

    def mixed() -> tuple[BaseNode[Any], list[PrefetcherNode[Any]]]:
        roots = [_graph(stores["a"]), _graph(stores["b"])]
        sources = {
            k: Mapper(r, lambda b, k=k: (k, b.epoch, b.index, {**b.sample_indices}, b["x"].copy()))
            for k, r in zip("ab", roots, strict=True)
        }
        return Prefetcher(MultiNodeWeightedSampler(sources, {"a": 0.6, "b": 0.4}, seed=3), 2), roots

    def key(item: Any) -> tuple[Any, ...]:
        k, epoch, index, rows, x = item
        assert np.array_equal(x, oracle[k][rows["x"]]) and (rows["y"] == rows["x"] + 1).all()
        return k, epoch, index, rows["x"].tolist()

    node, roots = mixed()
    loader = Loader(node)
    it = iter(loader)
    [key(next(it)) for _ in range(6)]
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    expected = [key(item) for item in it] + [key(item) for item in loader]
    node2, roots2 = mixed()
    resumed = Loader(node2)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    got = [key(item) for item in resumed] + [key(item) for item in resumed]
    assert got == expected and len(got) > 20
    for root in roots + roots2:
        root.close()


def _tight(path: Path, between: Any, at: str) -> PrefetcherNode[Any]:
    """A graph over ``path`` at its budget floor, ``between(node)`` placed over the ``at``
    stage (``"fetch"`` or ``"resident"``)."""
    store, plan = _plan(path, batch_size=4)
    config = plan.plan_config.replace(block_chunks=1)
    floors = schedule_floors(plan.manifest, plan.views, config)
    schedule = choose_schedule(plan.manifest, plan.views, floors.bounded, config)
    plan = ReadPlanNode(plan.manifest, plan.views, schedule=schedule, config=config)
    ctx = StageContext.create(plan, ChunkPool(floors.bounded), options=FetchOptions(direct=False))
    fetch: BaseNode[Any] = AsyncChunkFetchNode(plan, store, context=ctx)
    resident: BaseNode[Any] = ChunkPoolNode(between(fetch) if at == "fetch" else fetch, context=ctx)
    gather = GatherNode(between(resident) if at == "resident" else resident, context=ctx)
    return PrefetcherNode(gather, context=ctx)


def test_a_node_that_pulls_ahead_between_residency_and_gather_is_refused_not_read_stale(
    stores: dict[str, Path],
) -> None:
    # before: such a graph ran, its batches read slots the residency stage had released when
    # the node pulled the next batch (the trial, 128 steps at the budget floor: 33 of 60
    # batches held other chunks' rows behind a Batcher(20), 1 in 96 behind a Prefetcher(4))
    oracle = zarr.open_array(stores["long"], path="t2m", mode="r")[...]
    for between in (lambda n: Unbatcher(Batcher(n, 20)), lambda n: Prefetcher(n, 4)):
        root = _tight(stores["long"], between, "resident")
        with root, pytest.raises(RuntimeError, match=r"(?s)released before the GatherNode.*Mapper"):
            for batch in Loader(root):  # any batch delivered is right
                assert np.array_equal(batch["x"], oracle[batch.sample_indices["x"]])
    root = _tight(stores["long"], lambda n: Mapper(n, lambda item: item), "resident")
    with root:  # one item at a time: fine
        assert sum(len(b) for b in Loader(root)) == 127


def test_a_node_holding_fetched_batches_past_the_budget_says_so_instead_of_reporting_a_bug(
    stores: dict[str, Path],
) -> None:
    # before: "... no room for the chunks of batch 10 even after releasing everything older;
    # this is a bug in insitubatch_nodes, please report it"
    root = _tight(stores["long"], lambda n: Unbatcher(Batcher(n, 20)), "fetch")
    with root, pytest.raises(RuntimeError, match=r"(?s)not released yet.*Batcher.*budget"):
        list(Loader(root))


def test_a_state_saved_by_a_graph_of_another_shape_is_refused_saying_to_build_the_same_graph(
    stores: dict[str, Path],
) -> None:
    # before: KeyError: 'source' from inside the PrefetcherNode's reset
    saved = Loader(Mapper(_graph(stores["a"]), lambda b: b))
    it = iter(saved)
    next(it)
    state = saved.state_dict()  # root: the Mapper's state, {"it_state": ...}
    saved.root.source.close()  # type: ignore[attr-defined]
    root = _graph(stores["a"])
    loader = Loader(root)
    loader.load_state_dict(state)
    with root, pytest.raises(ValueError, match=r"(?s)'it_state'.*graph built as the one"):
        next(iter(loader))


def test_closing_a_middle_stage_mid_epoch_then_going_on_delivers_every_sample_once(
    stores: dict[str, Path],
) -> None:
    # before: close() on the fetch, residency or gather stage dropped the fetch stage's plans
    # pulled ahead, and the epoch went on without them: 33 of 63 samples, no error (or
    # FillCancelled, when the prefetch thread was waiting on a fill)
    oracle = zarr.open_array(stores["a"], path="t2m", mode="r")[...]

    def rows(batches: Any) -> list[int]:
        out = []
        for batch in batches:
            assert np.array_equal(batch["x"], oracle[batch.sample_indices["x"]])
            out += batch.sample_indices["x"].tolist()
        return out

    for which in ("fetch", "resident", "gather"):
        for rooted in (True, False):
            root = _graph(stores["a"])
            gather = root.source
            stage = {"gather": gather, "resident": gather.source}.get(which, gather.source.source)
            loader = Loader(root if rooted else gather)
            it = iter(loader)
            seen = rows([next(it), next(it)])
            stage.close()
            seen += rows(it)
            assert sorted(seen) == list(range(63)), (which, rooted, len(seen))
            root.close()
