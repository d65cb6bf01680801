"""A black-box trial of how an epoch is split between DDP ranks: the wrong answers it found.

Each test is a case the trial's generator (one pipeline per rank in one process, zarr's read of
the store as the oracle) caught answering wrongly, kept as a claim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import zarr

from insitubatch_nodes import (
    ArrayGeometry,
    Batch,
    InSituPipeline,
    Loader,
    SplitManifest,
    as_dataset,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.stages.read_plan import ReadPlanNode

N_TIME, SPC = 31, 4  # the last chunk holds 3 samples


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ranks_trial") / "a.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    arr = group.create_array("t", shape=(N_TIME, 2), chunks=(SPC, 2), dtype="f8", fill_value=0)
    arr[...] = np.random.default_rng(0).standard_normal((N_TIME, 2))
    return path


@pytest.fixture(scope="module")
def geom(store: Path) -> ArrayGeometry:
    return open_geometries(store, ["t"])["t"]


@pytest.fixture(scope="module")
def manifest(geom: ArrayGeometry) -> SplitManifest:
    return split_by_chunk(geom, (1.0, 0.0, 0.0))


@contextmanager
def _process_group(rank: int, world: int) -> Iterator[None]:
    """This process as ``rank`` of a ``world``-rank ``torch.distributed`` group (torch's
    in-process ``fake`` backend: no peers, no collectives needed to plan)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _anchors(node: ReadPlanNode) -> list[int]:
    return [int(a) for batch in node for a in batch.anchors]


def test_world_size_given_without_rank_takes_the_process_groups_rank(
    geom: ArrayGeometry, manifest: SplitManifest
) -> None:
    """``PlanConfig`` says ``rank=None`` takes ``torch.distributed``'s. With ``world_size``
    given beside it, every rank of a 3-rank group was planned as rank 0: each delivered rank
    0's samples, and two thirds of the split were never trained on."""
    valid = set(range(N_TIME))  # (zarr's shape: one view, every sample an anchor)
    per_rank = []
    for rank in range(3):
        with _process_group(rank, 3):
            config = PlanConfig(batch_size=5, world_size=3)
            node = ReadPlanNode(manifest, {"x": geom}, config=config)
            assert (node.rank, node.world_size) == (rank, 3)
            per_rank.append(_anchors(node))
    flat = [a for anchors in per_rank for a in anchors]
    assert len(flat) == len(set(flat)), "ranks delivered the same samples"
    assert set(flat) <= valid and len(valid - set(flat)) == N_TIME % 3
    with _process_group(2, 3):
        # one rank of one: the whole split on every rank (an evaluation pass per rank)
        whole = ReadPlanNode(manifest, {"x": geom}, config=PlanConfig(world_size=1))
        assert (whole.rank, sorted(_anchors(whole))) == (0, sorted(valid))
        # a group of another size: which rank this is is ambiguous, and said so
        with pytest.raises(ValueError, match="pass rank explicitly"):
            ReadPlanNode(manifest, {"x": geom}, config=PlanConfig(world_size=2))


def test_a_rank_given_without_world_size_outside_one_rank_names_where_the_world_size_came_from(
    geom: ArrayGeometry, manifest: SplitManifest
) -> None:
    """``rank=2`` alone, with no process group, said ``world_size=1`` as if it had been given."""
    took = r"world_size=None took 1 from no torch\.distributed group"
    with pytest.raises(ValueError, match=took):
        ReadPlanNode(manifest, {"x": geom}, config=PlanConfig(rank=2))


def _deliver(node: ReadPlanNode, k: int | None = None) -> list[int]:
    """Anchors of the next ``k`` batches (all the epoch's remaining ones when ``None``)."""
    out: list[int] = []
    for _ in range(len(node)) if k is None else range(k):
        try:
            out.extend(int(a) for a in node.next().anchors)
        except StopIteration:
            break
    return out


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_an_epoch_cut_on_five_ranks_then_on_one_ends_on_two_with_each_sample_once(
    geom: ArrayGeometry, manifest: SplitManifest, remainder: str
) -> None:
    """5 ranks deliver 3 batches, one rank 9 more, then two ranks the rest. Replaying the
    one-rank stage, the two ranks counted the chunks it had emptied into its blocks, which it
    had not: they drew another order for it, took other samples as delivered, and delivered
    some twice (while others were never delivered)."""

    def node(rank: int, world: int) -> ReadPlanNode:
        config = PlanConfig(
            batch_size=1, block_chunks=2, seed=6, rank=rank, world_size=world, remainder=remainder
        )
        return ReadPlanNode(manifest, {"x": geom}, config=config)

    valid = set(range(N_TIME))
    seen: list[int] = []
    five = [node(r, 5) for r in range(5)]
    for n in five:
        n.reset(None)
        seen.extend(_deliver(n, 3))
    one = node(0, 1)
    one.reset(five[0].get_state())
    seen.extend(_deliver(one, 9))
    state = one.get_state()
    assert state["resumed"] == [[5, 3]]
    counts = set()
    for rank in range(2):
        two = node(rank, 2)
        two.reset(state)
        rest = _deliver(two)
        counts.add(len(rest))
        seen.extend(rest)
    assert len(counts) == 1
    assert set(seen) <= valid
    if remainder == "drop":
        assert len(seen) == len(set(seen)), "a sample was delivered twice"
        assert len(valid - set(seen)) <= 2 - 1
    else:  # padding repeats at most W - 1 samples at each of the three stages
        assert set(seen) == valid, "a sample was never delivered"
        assert len(seen) - len(valid) <= (5 - 1) + (1 - 1) + (2 - 1)


def test_a_state_saved_before_the_first_batch_of_an_elastic_resume_restores_on_a_third_size(
    geom: ArrayGeometry, manifest: SplitManifest
) -> None:
    """3 ranks deliver 2 batches; the run restarts on 2 ranks and is checkpointed before their
    first batch (preempted again at once), then restarts on 4. The 4 ranks recorded a second cut
    at the same batch, ``resumed=[[3, 2], [2, 2]]``, which every later state of that epoch
    carried and no pipeline would restore ("not a read-plan state")."""

    def node(rank: int, world: int) -> ReadPlanNode:
        config = PlanConfig(batch_size=2, block_chunks=2, seed=6, rank=rank, world_size=world)
        return ReadPlanNode(manifest, {"x": geom}, config=config)

    seen: list[int] = []
    three = [node(r, 3) for r in range(3)]
    for n in three:
        n.reset(None)
        seen.extend(_deliver(n, 2))
    two = node(0, 2)
    two.reset(three[0].get_state())
    idle = two.get_state()  # nothing delivered on 2 ranks
    four = [node(r, 4) for r in range(4)]
    for n in four:
        n.reset(idle)
        seen.extend(_deliver(n, 1))
    state = four[0].get_state()
    assert state["resumed"] == [[3, 2]]
    counts = set()
    for rank in range(4):
        again = node(rank, 4)
        again.reset(state)  # raised ValueError
        rest = _deliver(again)
        counts.add(len(rest))
        seen.extend(rest)
    assert len(counts) == 1
    assert len(seen) == len(set(seen)), "a sample was delivered twice"
    assert set(seen) <= set(range(N_TIME)) and N_TIME - len(seen) <= 4 - 1


def test_a_padded_sample_beside_a_strided_one_is_gathered_from_its_own_row(
    store: Path, geom: ArrayGeometry, manifest: SplitManifest
) -> None:
    """``stride=2`` leaves 16 anchors, six ranks of ``"pad"`` take 3 each: rank 4 holds anchors
    16 and 18 of chunk 4, and 18 again as its padded sample. The gather took a chunk's rows
    ``w0 .. w1`` as consecutive samples whenever ``w1 - w0`` was their count less one — true
    of ``16, 18, 18`` too — and copied sample 17 (no anchor) into the row of 18."""
    oracle = zarr.open_array(store / "t", mode="r")[...]
    valid = set(range(0, N_TIME, 2))
    delivered: list[int] = []
    for rank in range(6):
        with insitu_pipeline(
            store, manifest, {"x": geom}, batch_size=4, block_chunks=2, shuffle=False,
            rank=rank, world_size=6, remainder="pad", stride=2, prefetch_depth=1,
        ) as pipe:  # fmt: skip
            for batch in Loader(pipe):
                idx = batch.sample_indices["x"]
                np.testing.assert_array_equal(batch["x"], oracle[idx], err_msg=f"rank {rank}")
                delivered.extend(int(i) for i in idx)
    assert set(delivered) == valid and len(delivered) == 6 * 3


def test_an_epoch_with_nothing_left_for_the_trainers_ranks_is_not_delivered_twice(
    store: Path, geom: ArrayGeometry, manifest: SplitManifest
) -> None:
    """One rank delivers 6 of its 7 batches of 5 (30 of 31 samples); the one sample left is
    no sample for each of two ranks ("drop"), so the docs give that epoch ``6 + 0`` batches.
    Through ``as_dataset`` with ``epoch_fn`` (Lightning's ``current_epoch``, still 0) the two
    ranks reported the next epoch's length, delivered epoch 1 under the trainer's epoch 0,
    then epoch 1 again under its epoch 1. The same held on one rank for a state taken after
    the 7th batch (the epoch's last)."""
    config = PlanConfig(batch_size=5, block_chunks=2, seed=1)

    def build(rank: int, world: int) -> InSituPipeline:
        return insitu_pipeline(
            store, manifest, {"x": geom}, config=config.replace(rank=rank, world_size=world)
        )

    trainer_epoch = [0]
    for world, taken in ((2, 6), (1, 7)):
        with build(0, 1) as pipe:
            data = as_dataset(pipe, transform=lambda b: b)
            it = iter(data)
            for _ in range(taken):
                next(it)
            state = data.state_dict()
        for rank in range(world):
            with build(rank, world) as pipe:
                fresh = [
                    [b.sample_indices["x"].tolist() for b in _epoch_of(pipe, e)] for e in (1, 2)
                ]
            trainer_epoch[0] = 0
            with build(rank, world) as pipe:
                data = as_dataset(pipe, transform=lambda b: b, epoch_fn=lambda: trainer_epoch[0])
                data.load_state_dict(state)
                assert len(data) == taken  # the interrupted epoch's batches (was 3 on 2 ranks)
                got = []
                for epoch in range(3):
                    trainer_epoch[0] = epoch
                    got.append([(b.epoch, b.sample_indices["x"].tolist()) for b in data])
                    if epoch == 0:  # at the trainer's epoch end (InSituDataModule asks): the next
                        assert data.next_len() == len(fresh[0])
            assert got[0] == [], (world, rank)  # (was the pipeline's epoch 1)
            assert got[1] == [(1, s) for s in fresh[0]]
            assert got[2] == [(2, s) for s in fresh[1]]


def _epoch_of(pipe: InSituPipeline, epoch: int) -> list[Batch]:
    pipe.stages.plan.set_epoch(epoch)
    return list(Loader(pipe))
