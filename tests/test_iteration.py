"""Iteration and epoch semantics match torchdata's, and a batch a user keeps is never touched.

* ``iter(pipe)`` is the pipeline itself (``BaseNode``'s contract): ``next(iter(pipe))`` again and
  again continues one epoch, reading each stored object once.
* The epoch advances on batches *delivered*: ``iter()`` with nothing consumed starts the same
  epoch again. A state taken after the last batch of an epoch resumes with the whole next one.
* :class:`insitubatch_nodes.Loader` resumes whatever the order of ``state_dict`` and
  ``load_state_dict`` calls.
* Our nodes compose with torchdata's own (a ``Mapper`` or ``Batcher`` in between).
* Batch buffers are reused only when nothing made from a batch is alive (weak references, not
  reference counts).
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    Oracle,
    View,
    assert_batch_matches,
    assert_same_records,
    counting_store,
    run_epoch,
    write_era5,
)
from torchdata.nodes import BaseNode, Batcher, Mapper
from torchdata.nodes import Loader as TorchdataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from insitubatch_nodes import (
    Loader,
    as_dataset,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    to_torch,
)
from insitubatch_nodes.lending import BufferPool
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import prefetch
from insitubatch_nodes.stages.buffers import LentBatch
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.gather import GatherNode
from insitubatch_nodes.stages.prefetch import PrefetcherNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ChunkPoolNode

pytestmark = pytest.mark.timeout(120)
OVIEWS = {"x": View("t2m"), "y": View("t2m", 0, 1)}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("iteration") / "store.zarr"
    write_era5(path, n_time=96, n_lat=8, n_lon=16, inner_chunks=(4, 8), variables=("t2m",))
    return path


def make(store: Any, **kwargs: Any) -> Any:
    g = open_geometries(store, ["t2m"])["t2m"]
    kwargs = {"batch_size": 8, "block_chunks": 3, "seed": 2, **kwargs}
    return insitu_pipeline(store, split_by_chunk(g), {"x": g, "y": g.shift(1)}, **kwargs)


# ---------------------------------------------------------------------------------------------
# iter() is the node
# ---------------------------------------------------------------------------------------------


def test_next_of_a_fresh_iter_again_and_again_continues_one_epoch_reading_each_object_once(
    root: Path,
) -> None:
    store = counting_store(root, delay=0.02)  # read-ahead GETs are in flight between calls
    pipe = make(store)
    got = [next(iter(pipe)).index for _ in range(3)]
    assert got == [0, 1, 2]
    assert max(store.chunk_counts().values()) == 1, "a stored object was fetched twice"
    pipe.close()


def test_a_for_loop_over_the_pipeline_after_an_epoch_ended_runs_the_next_epoch(
    root: Path,
) -> None:
    # `for epoch in range(3): for batch in pipe:` without a Loader: before, every epoch but
    # the first was silently empty (the node stayed exhausted), and training looked done
    pipe = make(root)
    epochs = [[(b.epoch, b.index) for b in pipe] for _ in range(3)]
    n = len(pipe)
    assert epochs == [[(e, i) for i in range(n)] for e in range(3)]
    it = iter(pipe)  # an iterator taken once still ends at its epoch's end
    assert [b.epoch for b in it] == [3] * n
    with pytest.raises(StopIteration):
        next(it)
    pipe.close()


def test_a_for_loop_broken_off_mid_epoch_is_continued_by_the_next_one(root: Path) -> None:
    pipe = make(root)
    first = []
    for b in pipe:
        first.append(b.index)
        if len(first) == 2:
            break
    rest = [b.index for b in pipe]
    assert first + rest == list(range(len(pipe)))
    pipe.close()


# ---------------------------------------------------------------------------------------------
# Epochs advance on delivered batches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader_cls", [Loader, TorchdataLoader], ids=["ours", "torchdata"])
def test_iter_of_a_loader_twice_with_nothing_consumed_does_not_skip_an_epoch(
    root: Path, loader_cls: Any
) -> None:
    pipe = make(root)
    loader = loader_cls(pipe)
    iter(loader)
    iter(loader)
    assert next(iter(loader)).epoch == 0
    first = [next(iter(loader))]  # the epoch started: a new iter() moves on to epoch 1
    assert first[0].epoch == 1
    pipe.close()


def test_reset_twice_with_nothing_consumed_starts_the_same_epoch(root: Path) -> None:
    pipe = make(root)
    pipe.reset()
    pipe.reset()
    assert [b.epoch for b in pipe] == [0] * len(pipe)
    pipe.reset()
    assert next(pipe).epoch == 1
    pipe.close()


@pytest.mark.parametrize("via", ["loader", "stateful_dataloader"])
def test_a_state_taken_after_the_last_batch_resumes_with_the_whole_next_epoch(
    root: Path, via: str
) -> None:
    reference = make(root)
    want = [run_epoch(reference)]
    reference.reset()
    want.append(run_epoch(reference))
    reference.close()

    if via == "loader":
        loader: Any = Loader(make(root))
        assert_same_records(run_epoch(loader), want[0])
        state = loader.state_dict()
        resumed: Any = Loader(make(root))
        resumed.load_state_dict(state)
        got = run_epoch(resumed)
    else:
        sdl = StatefulDataLoader(as_dataset(make(root), transform=lambda b: b), batch_size=None)
        assert_same_records(run_epoch(sdl), want[0])
        state = sdl.state_dict()
        fresh = StatefulDataLoader(as_dataset(make(root), transform=lambda b: b), batch_size=None)
        fresh.load_state_dict(state)
        got = run_epoch(fresh)
    assert_same_records(got, want[1])  # epoch 1, every batch of it


@pytest.mark.parametrize("k", [0, 3])
def test_our_loader_resumes_even_when_state_dict_was_called_before_load_state_dict(
    root: Path, k: int
) -> None:
    reference = run_epoch(make(root))
    source = Loader(make(root))
    it = iter(source)
    for _ in range(k):
        next(it)
    state = source.state_dict()

    loader = Loader(make(root))
    loader.state_dict()  # torchdata 0.11 would now ignore the state loaded next
    loader.load_state_dict(state)
    assert_same_records(run_epoch(loader), reference[k:])
    assert len(loader) == len(reference)


# ---------------------------------------------------------------------------------------------
# Composition with torchdata's own nodes
# ---------------------------------------------------------------------------------------------


def compose(root: Path, between: Any) -> PrefetcherNode[Any]:
    g = open_geometries(root, ["t2m"])["t2m"]
    labels = {"x": g, "y": g.shift(1)}
    plan = ReadPlanNode(split_by_chunk(g), labels, config=PlanConfig(batch_size=8, seed=4))
    ctx = StageContext.create(plan, ChunkPool())
    fetch = AsyncChunkFetchNode(plan, counting_store(root), context=ctx)
    gather = GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx)
    return PrefetcherNode(between(gather), context=ctx)


def test_a_torchdata_mapper_between_gather_and_prefetch_sees_correct_batches(
    root: Path,
) -> None:
    def tag(batch: Any) -> Any:
        batch.meta["seen"] = True
        return batch

    pipe = compose(root, lambda gather: Mapper(gather, tag))
    records = run_epoch(pipe, Oracle(root), OVIEWS, each=lambda b: b.meta["seen"])
    assert len(records) == 10  # 80 train anchors with a shift(1) view, batch 8
    pipe.reset()
    assert {r["epoch"] for r in run_epoch(pipe, Oracle(root), OVIEWS)} == {1}


class _Stalls(BaseNode[Any]):
    """Hands its source's items on; its ``n``-th ``next()`` waits for ``go`` before it pulls
    (as a producer slower to stop than the halt's join does: a node or transform still
    running, or a thread the machine's load kept waiting), and sets ``pulled`` after."""

    def __init__(self, source: BaseNode[Any], n: int) -> None:
        super().__init__()
        self.source, self.n, self.calls = source, n, 0
        self.stalled, self.go, self.pulled = threading.Event(), threading.Event(), threading.Event()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> Any:
        self.calls += 1
        if self.calls != self.n:
            return next(self.source)
        self.stalled.set()
        self.go.wait(10)
        try:
            return next(self.source)
        finally:
            self.pulled.set()

    def get_state(self) -> dict[str, Any]:
        return self.source.state_dict()


def test_a_reset_while_the_producer_is_slow_to_stop_resumes_at_the_next_batch(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the reset gave up waiting for the producer after 2 s and reset the source under
    # it; the old producer then pulled the first batch of the new position and dropped it (seen
    # as a skipped batch in a loaded test run: a Ctrl-C'd first next(), reset, batch 1 first)
    ref = compose(root, lambda gather: gather)
    want = [b.sample_indices["x"].copy() for b in itertools.islice(ref, 4)]
    ref.close()
    monkeypatch.setattr(prefetch, "_JOIN_S", 0.05)  # a producer slower to stop than the join
    stalls: list[_Stalls] = []
    pipe = compose(root, lambda gather: stalls.append(_Stalls(gather, 3)) or stalls[0])
    first = next(pipe)
    state = pipe.state_dict()
    assert stalls[0].stalled.wait(10)  # the producer is about to pull its third batch
    go = threading.Timer(0.3, stalls[0].go.set)
    go.start()
    pipe.reset(state)
    assert stalls[0].pulled.wait(10)  # the old producer pulled (before the source's reset)
    got = [first, *itertools.islice(pipe, 3)]
    pipe.close()
    go.join()
    assert [b.index for b in got] == [0, 1, 2, 3]
    assert all(np.array_equal(b.sample_indices["x"], w) for b, w in zip(got, want, strict=True))


def test_batches_held_together_by_a_torchdata_batcher_are_all_intact(root: Path) -> None:
    pipe = compose(root, lambda gather: Batcher(gather, batch_size=3, drop_last=False))
    oracle = Oracle(root)
    groups = list(pipe)  # every group (and every batch in it) held until the end
    assert sum(len(g) for g in groups) == 10
    for group in groups:
        for batch in group:
            assert_batch_matches(batch, oracle, OVIEWS)


# ---------------------------------------------------------------------------------------------
# A batch a user keeps is never overwritten
# ---------------------------------------------------------------------------------------------


def test_a_whole_epoch_kept_in_a_list_equals_zarrs_reads(root: Path) -> None:
    batches = list(Loader(make(root, prefetch_depth=1)))
    oracle = Oracle(root)
    for batch in batches:
        assert_batch_matches(batch, oracle, OVIEWS)


def test_a_tensor_from_to_torch_held_across_ten_more_batches_is_unchanged(root: Path) -> None:
    pipe = make(root, batch_size=4, prefetch_depth=1)
    batch = next(pipe)
    rows = np.array(batch.sample_indices["y"])
    tensor = to_torch(batch)["y"]
    del batch
    for _ in range(10):
        next(pipe)
    np.testing.assert_array_equal(tensor.numpy(), Oracle(root)("t2m", rows))
    pipe.close()


def test_a_buffer_is_lent_again_only_when_nothing_made_from_its_batch_is_alive() -> None:
    pool = BufferPool((4, 3), np.dtype("f4"))
    arr = pool.take()
    address = arr.ctypes.data
    part = arr[1:3]  # a view of a view: numpy points its base at the owner, not at `arr`
    tensor = torch.from_numpy(part)
    del arr, part
    assert pool.take().ctypes.data != address  # the tensor still holds the first buffer
    del tensor
    gc.collect()
    assert pool.take().ctypes.data == address


def test_a_lent_batch_takes_its_buffers_only_when_first_asked_for() -> None:
    # the rows a fetch stage decodes straight into a batch queued behind others: its buffers
    # (fresh memory, faulted in page by page in a new process) are made when the first row is
    # decoded, not when the batch's reads are planned
    pools = {"x": BufferPool((4, 3), np.dtype("f4")), "y": BufferPool((4,), np.dtype("i8"))}
    lent = LentBatch(pools, 2, None)
    assert not lent.taken
    assert [p.allocations for p in pools.values()] == [0, 0]
    assert sum(p.held_bytes for p in pools.values()) == 0
    x = lent.part("x")
    assert lent.taken and x.shape == (2, 3)
    assert [p.allocations for p in pools.values()] == [1, 1]
    assert lent.part("x").ctypes.data == x.ctypes.data
    assert lent.arrays()["y"].shape == (2,)
    assert [p.allocations for p in pools.values()] == [1, 1]


def test_a_lent_batch_asked_for_by_many_threads_at_once_takes_one_buffer() -> None:
    pool = BufferPool((4, 3), np.dtype("f4"))
    lent = LentBatch({"x": pool}, 4, None)
    start = threading.Barrier(8)
    seen: list[int] = []

    def ask() -> None:
        start.wait()
        seen.append(lent.part("x").ctypes.data)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and len(set(seen)) == 1
    assert pool.allocations == 1


def test_buffers_taken_by_many_threads_at_once_are_each_lent_once() -> None:
    pool = BufferPool((4, 3), np.dtype("f4"))
    start = threading.Barrier(8)
    held: list[np.ndarray] = []

    def take() -> None:
        start.wait()
        held.append(pool.take())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({a.ctypes.data for a in held}) == 8
    assert pool.allocations == 8


def test_buffer_reuse_does_not_read_reference_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(obj: object) -> int:
        raise AssertionError("sys.getrefcount was consulted")

    monkeypatch.setattr(sys, "getrefcount", forbidden)
    pool = BufferPool((2, 2), np.dtype("f8"))
    first = pool.take()
    address = first.ctypes.data
    del first
    assert pool.take().ctypes.data == address


def test_a_closed_pipeline_lets_go_of_the_batch_its_loop_last_held_once_it_is_dropped(
    root: Path,
) -> None:
    # the loop's last batch is still alive at close(): it keeps its own memory, and once it is
    # dropped the closed pipeline holds no batch buffer (before: that batch's buffers stayed
    # in the pipeline's pools until the pipeline itself was collected); a held tensor of it
    # is never overwritten by the batches of a resumed pipeline
    pipe = make(root, batch_size=4, prefetch_depth=1)
    batches = iter(pipe)
    batch = next(batches)
    for batch in batches:  # noqa: B007 (the loop's last batch is the one held)
        pass
    rows = np.array(batch.sample_indices["y"])
    tensor = to_torch(batch)["y"]
    pipe.close()
    assert pipe.context.buffers.held_bytes == 0
    del batch
    pipe.reset()
    for _ in pipe:
        pass
    np.testing.assert_array_equal(tensor.numpy(), Oracle(root)("t2m", rows))
    del tensor
    pipe.close()
    assert pipe.context.buffers.held_bytes == 0
