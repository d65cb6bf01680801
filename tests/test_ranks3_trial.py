"""Resume defects left by the ranks2 trial (the ranks3 trial of 2026-12-07): ranks simulated
in one process (``rank=``, ``world_size=``), zarr's store as the oracle for which samples exist
and an uninterrupted run's read plan for which samples an epoch holds.

Found (fixed):

1. ``as_dataset(epoch_fn=...)`` given a state taken where the trainer's epoch ends delivered
   nothing at its first ``iter()`` in that epoch, as it should, but the next epoch at a second
   ``iter()`` there (a user re-iterating, a loop asking again), and the trainer's epoch again,
   whole, at a third: what an ``iter()`` delivered followed how often it was called, not the
   trainer's epoch (rank 0 of 4 and one rank alike). Every ``iter()`` now delivers nothing
   while ``epoch_fn`` stays in the ended epoch, and the next epoch is delivered once, when
   ``epoch_fn`` moves on. The state after such an ``iter()`` (the next epoch's start)
   restored while the trainer was still in that epoch delivered the next epoch there, and
   again in the next (any rank with a batch: ranks2 had made it end the epoch only on an
   empty rank); it now ends the trainer's epoch as the state it came from does.
2. An ``"uneven"`` rank's own state saved after its last batch, its loop not yet ended, was
   read elastically (on another number of ranks) as rank 0's: its epoch went on with the
   batches rank 0 had left, where the same state on its own number of ranks ends the epoch
   (ranks2: the epoch is over where the saving rank's is); and on either it was refused
   under another batch size or views as saved mid-epoch, though it resumed at the next
   epoch. The elastic rule and the mid-epoch check now read the epoch's end by the saving
   rank (its ``"rank"``); a state without one is read as rank 0's, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import epoch_anchors, plan_anchors, write_ranks_store

from insitubatch_nodes import (
    ArrayGeometry,
    Loader,
    PlanConfig,
    as_dataset,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.batch import to_item
from insitubatch_nodes.stages.read_plan import ReadPlanNode

pytestmark = pytest.mark.timeout(60)

T, C = 24, 3  # 8 chunks of 3 steps


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ranks_store(tmp_path_factory.mktemp("ranks3") / "s.zarr", seed=7)


@pytest.fixture(scope="module")
def geom(store: Path) -> ArrayGeometry:
    return open_geometries(store, ["t2m"])["t2m"]


def _rows(dataset: Any) -> list[list[int]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loop = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    return [b["sample_indices"]["x"].tolist() for b in loop]


# -- 1. a second iter() inside the trainer's ended epoch -----------------------------------------


@pytest.mark.parametrize("world", [1, 4])
def test_every_iter_inside_a_trainer_epoch_a_loaded_state_ended_delivers_nothing(
    store: Path, geom: ArrayGeometry, world: int
) -> None:
    """A ``Loader``'s state after its whole loop over epoch 0 (rank 0 of ``world``, shuffled),
    loaded into ``as_dataset(epoch_fn=...)`` while the trainer is in epoch 0: three ``iter()``
    there deliver nothing (told epoch 0's length before the first, the next epoch's after,
    as the trainer asks at its epoch's end), the state staying at epoch 1's start; the
    trainer's epoch 1 then delivers epoch 1 as an uninterrupted rank 0 draws it, once (main:
    the second ``iter()`` delivered epoch 1 inside the trainer's epoch 0, the third epoch 0
    again)."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    uneven = {"remainder": "uneven"} if world > 1 else {}
    config = PlanConfig(split="test", batch_size=2, shuffle=True, rank=0, world_size=world,
                        **uneven)  # fmt: skip
    want = ReadPlanNode(half, {"x": geom}, config=config)
    want.reset(None)
    epoch0 = plan_anchors(want)
    want.reset(None)
    epoch1 = plan_anchors(want)
    assert epoch0 != epoch1
    with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
        loader = Loader(pipe)
        assert [b.sample_indices["x"].tolist() for b in loader] == epoch0
        state = loader.state_dict()
    trainer = [0]
    with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
        dataset = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
        dataset.load_state_dict(state)
        assert len(dataset) == len(epoch0)
        for _ in range(3):
            assert _rows(dataset) == []
            assert len(dataset) == len(epoch1)
            assert pipe.stages.plan.resumed_epoch(dataset.state_dict()) == 1
        trainer[0] = 1
        assert len(dataset) == len(epoch1) and _rows(dataset) == epoch1
        assert pipe.stages.plan.resumed_epoch(dataset.state_dict()) == 2


def test_a_state_cut_short_by_its_trainer_stays_ended_at_every_iter_of_that_epoch(
    store: Path, geom: ArrayGeometry
) -> None:
    """``end_loaded_epoch`` (a trainer whose ``limit_train_batches`` ended the epoch): a
    state after 2 of 6 batches of epoch 0 delivers nothing at any ``iter()`` while the
    trainer stays in epoch 0 (found right: the rule 1. now follows), then epoch 1 whole."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))
    config = PlanConfig(split="test", batch_size=2, shuffle=True)
    epoch1 = epoch_anchors(ReadPlanNode(half, {"x": geom}, config=config), 1)
    with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
        loader = Loader(pipe)
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
    trainer = [0]
    with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
        dataset = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
        dataset.end_loaded_epoch()
        dataset.load_state_dict(state)
        assert [_rows(dataset) for _ in range(3)] == [[], [], []]
        trainer[0] = 1
        assert _rows(dataset) == epoch1


# -- 2. a short rank's own state, restored elastically --------------------------------------------


def _eval(rank: int, world: int) -> PlanConfig:
    return PlanConfig(split="test", remainder="uneven", batch_size=1, shuffle=True, rank=rank,
                      world_size=world)  # fmt: skip


def test_a_short_ranks_own_state_after_its_last_batch_ends_its_epoch_on_any_number_of_ranks(
    geom: ArrayGeometry,
) -> None:
    """12 samples on 5 ranks (3, 3, 2, 2, 2 batches): rank 2's own state after its 2nd and
    last batch, its loop not yet ended, restores on 5 ranks at epoch 1 (ranks2: over where
    the saving rank's epoch is), and on 3 ranks now too: each new rank's next loop is epoch 1
    as a run begun on 3 ranks draws it (main: the 3 ranks went on with epoch 0, dealing the
    2 samples of ranks 0 and 1's third batches); and an epoch's end, it restores under
    another batch size and views on either (main: refused as saved mid-epoch). The same
    state without ``"rank"`` (saved before ranks2) is read as rank 0's, as before: those 2
    samples, once over the 3 ranks."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23

    def node(rank: int, world: int) -> ReadPlanNode:
        return ReadPlanNode(half, {"x": geom}, config=_eval(rank, world))

    old = [node(r, 5) for r in range(5)]
    shares = [plan_anchors(n) for n in old]
    assert [len(s) for s in shares] == [3, 3, 2, 2, 2]
    short = node(2, 5)
    assert plan_anchors(short, 2) == shares[2]
    state = short.get_state()
    assert state["rank"] == 2 and state["batches_emitted"] == 2
    for r in range(5):
        n = node(r, 5)
        n.reset(state)
        assert n.epoch == 1, r
    for world in (5, 3):  # an epoch's end: another batching, other views take it there too
        other = ReadPlanNode(half, {"x": geom.window([-1, 0])},
                             config=_eval(0, world).replace(batch_size=2))  # fmt: skip
        assert other.resumed_epoch(state) == 1, world
    for r in range(3):
        n = node(r, 3)
        assert n.resumed_epoch(state) == 1, r
        n.reset(state)
        assert (n.epoch, plan_anchors(n)) == (1, epoch_anchors(node(r, 3), 1)), r
    unsigned = {k: v for k, v in state.items() if k != "rank"}
    rest = []
    for r in range(3):
        n = node(r, 3)
        n.reset(unsigned)
        assert n.epoch == 0, r
        rest += [a for b in plan_anchors(n) for a in b]
    assert sorted(rest) == sorted(shares[0][2] + shares[1][2])


def test_the_state_after_an_ended_epochs_iter_ends_that_epoch_again_where_it_is_restored(
    store: Path, geom: ArrayGeometry
) -> None:
    """The state ``as_dataset(epoch_fn=...)`` holds after an ``iter()`` in an epoch a loaded
    state ended (the next epoch's start: a checkpoint saved at the trainer's epoch end), loaded
    into a fresh dataset while the trainer is still in that epoch, delivers nothing there, as
    the state it came from does, and so does the state after that; epoch 1 once, when the
    trainer gets there (main: epoch 1 in the trainer's epoch 0, and again in its epoch 1)."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))
    config = PlanConfig(split="test", batch_size=2, shuffle=True)
    epoch1 = epoch_anchors(ReadPlanNode(half, {"x": geom}, config=config), 1)
    with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
        loader = Loader(pipe)
        list(loader)
        state = loader.state_dict()
    trainer = [0]
    for _ in range(2):
        with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
            dataset = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
            dataset.load_state_dict(state)
            assert len(dataset) == len(epoch1) and _rows(dataset) == []
            state = dataset.state_dict()
    with insitu_pipeline(store, half, {"x": geom}, config=config) as pipe:
        dataset = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
        dataset.load_state_dict(state)
        trainer[0] = 1
        assert _rows(dataset) == epoch1
