"""DDP dealing left after the ranksedge trial (the ranks2 trial of 2026-12-07): ranks simulated
in one process (``rank=``, ``world_size=``), zarr's store as the oracle for which samples exist.

Found (fixed):

1. An ``"uneven"`` rank with fewer batches than rank 0, restored from rank 0's state (DDP's
   rule: one state for every rank), took rank 0's ``batches_emitted`` against its own share.
   An empty rank given rank 0's state after rank 0's batch ran that epoch again, an empty
   loop, while rank 0 went on with the next: one loop behind, so once ``set_views`` gave it
   samples it drew them from the epoch before the other ranks' (8 ranks, a window grown from
   7 to 11 anchors). A rank with a batch fewer (12 samples on 5 ranks: 3 3 2 2 2) given rank
   0's state after 2 batches ran the next epoch while rank 0 delivered its last batch of this
   one: one loop ahead. ``"uneven"`` states on several ranks now say which rank saved them
   (``"rank"``), and an epoch is over where that rank's is (a state without one: the rank's
   own, unless it delivered more than the rank's share — then rank 0's). ``Loader`` no
   longer lets torchdata restart a restored loop without a batch (an empty rank resumed at
   the next epoch's start ran the epoch after it there, one loop ahead instead).
2. ``as_dataset(epoch_fn=...)`` on an empty rank: its own state after the trainer's epoch is
   the next epoch's start, and restored while the trainer was still in that epoch (a trainer
   restarting a finished epoch) it ran the next epoch at once; its state after was an epoch
   ahead of the trainer, and where a shorter window then gave the rank samples it delivered
   the epoch after the trainer's ([[19]] where [[20]]). Now it delivers nothing until the
   trainer's next epoch, as rank 0 does with its own. Rank 0's state there tells an empty
   rank its own length (0), not rank 0's (1, once 1. made such a state end the epoch).

Found right (documented): unshuffled ``"pad"`` gives every rank the same batch count, every
valid sample once plus ``(-V) % W`` padded ones, each delivered by two ranks and drawn from
the other ranks' samples by the seed and the epoch (deterministic, other each epoch). The
ranks that take them are the same every epoch unshuffled, so their own samples are never
padded (docs/concepts.md said each sample is padded about equally often; that holds
shuffled); ``DistributedSampler(shuffle=False)`` pads with the same first samples every
epoch.

Left: an ``as_dataset(epoch_fn=...)`` that ended the trainer's epoch from a loaded state
delivers the next epoch at a second ``iter()`` inside that trainer epoch (any rank; seen on
rank 0 of 4, not changed here; fixed since: tests/test_ranks3_trial.py).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import zarr
from helpers import epoch_anchors, plan_anchors, write_ranks_store
from helpers import uneven_eval as _eval

from insitubatch_nodes import (
    ArrayGeometry,
    Loader,
    PlanConfig,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.stages.read_plan import ReadPlanNode

pytestmark = pytest.mark.timeout(60)

T, C = 24, 3  # 8 chunks of 3 steps


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ranks_store(tmp_path_factory.mktemp("ranks2") / "s.zarr", seed=7)


@pytest.fixture(scope="module")
def geom(store: Path) -> ArrayGeometry:
    return open_geometries(store, ["t2m"])["t2m"]


def _flat(batches: list[list[int]]) -> list[int]:
    return [a for b in batches for a in b]


# -- 1. a rank restored from rank 0's state ----------------------------------------------------


def test_an_empty_rank_restored_from_rank_zeros_state_resumes_where_it_would_have_been(
    geom: ArrayGeometry,
) -> None:
    """8 ranks, a window leaving 7 anchors (rank 7 none); rank 0's state after its batch of
    epoch 0 restores every rank (the DDP rule: one state for all): each goes on with epoch 1,
    and once ``set_views`` gives rank 7 samples every rank delivers what an uninterrupted run
    delivers, each sample once (main: rank 7 ran epoch 0 again, an empty loop, and then drew
    the grown views' samples from epoch 1's permutation where the others drew epoch 2's)."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    world, long, short = 8, {"x": geom.window([-5, 0])}, {"x": geom.window([-1, 0])}

    def node(rank: int) -> ReadPlanNode:
        return ReadPlanNode(half, long, config=_eval(rank, world, shuffle=True))

    uninterrupted = []
    for r in range(world):
        n, loops = node(r), []
        for epoch in range(4):
            if epoch == 2:
                n.set_views(short)
            n.reset(None)
            loops.append(plan_anchors(n))
        uninterrupted.append(loops)
    assert uninterrupted[7][:2] == [[], []]
    first = node(0)
    first.reset(None)
    first.next()  # its one batch of epoch 0, the epoch's end not yet reached
    state = first.get_state()
    for r in range(world):
        n = node(r)
        n.reset(state)
        loops = [plan_anchors(n)]
        assert n.epoch == 1, r
        n.set_views(short)
        for _ in range(2):
            n.reset(None)
            loops.append(plan_anchors(n))
        assert loops == uninterrupted[r][1:], r
    for epoch in (2, 3):
        seen = collections.Counter(_flat([a for u in uninterrupted for a in u[epoch]]))
        assert sorted(seen.elements()) == list(range(13, 24))


def test_a_rank_with_a_batch_fewer_given_rank_zeros_state_ends_that_epoch_with_rank_zero(
    geom: ArrayGeometry,
) -> None:
    """12 samples on 5 ranks (3, 3, 2, 2, 2 batches); rank 0's state after 2 batches restores
    every rank: the first loop is the rest of epoch 0 (rank 0 and 1 one batch each, the others
    none; main: ranks 2-4 ran epoch 1 there, one loop ahead, delivering its samples while
    epoch 0's last two were still owed), every sample of epoch 0 once over the ranks, and the
    next loop epoch 1 as an uninterrupted run's. Each rank's own state at the same point (the
    rule for prediction loops) still resumes that rank's next epoch once its share is over."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    world = 5

    def node(rank: int) -> ReadPlanNode:
        return ReadPlanNode(half, {"x": geom}, config=_eval(rank, world, shuffle=True))

    ranks = [node(r) for r in range(world)]
    before = [plan_anchors(n, 2) for n in ranks]  # lockstep: 2 batches each
    own = [n.get_state() for n in ranks]
    rest, epoch1 = [], []
    for r in range(world):
        n = node(r)
        n.reset(own[0])
        rest.append(plan_anchors(n))
        assert n.epoch == 0, r
        n.reset(None)
        epoch1.append(plan_anchors(n))
        assert epoch1[-1] == epoch_anchors(node(r), 1), r
        mine = node(r)
        mine.reset(own[r])
        assert mine.epoch == (0 if r < 2 else 1), r  # (its own share over: the next epoch)
    assert [len(b) for b in rest] == [1, 1, 0, 0, 0]
    assert sorted(_flat([b for r in [*before, *rest] for b in r])) == list(range(12, 24))
    assert sorted(_flat([b for r in epoch1 for b in r])) == list(range(12, 24))


def test_an_empty_ranks_loader_given_rank_zeros_state_after_its_loop_goes_on_at_the_next_epoch(
    store: Path, geom: ArrayGeometry
) -> None:
    """3 samples on 4 ranks: rank 0's ``Loader`` state after its loop, loaded into rank 3's
    fresh pipeline, runs epoch 1 (no batch) in the next loop, as rank 0 restored from it does
    and an uninterrupted rank 3 does; the state after it resumes epoch 2 (main: epoch 0 was
    run again, one loop behind, and the state after it resumed epoch 1)."""
    few = split_by_chunk(geom, (0.75, 0.125, 0.125))  # the test split: samples 21 22 23
    with insitu_pipeline(store, few, {"x": geom}, config=_eval(0, 4)) as pipe:
        loader = Loader(pipe)
        assert [b.sample_indices["x"].tolist() for b in loader] == [[21]]
        state = loader.state_dict()
        assert pipe.stages.plan.resumed_epoch(state) == 1
    with insitu_pipeline(store, few, {"x": geom}, config=_eval(3, 4)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert len(loader) == 0 and list(loader) == []
        assert pipe.stages.plan.epoch == 1
        assert pipe.stages.plan.resumed_epoch(loader.state_dict()) == 2


# -- 3. as_dataset(epoch_fn=) on an empty rank --------------------------------------------------


def _sdl_rows(dataset: Any) -> list[list[int]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loop = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    return [b["sample_indices"]["x"][:, -1].tolist() for b in loop]


def test_an_empty_rank_under_epoch_fn_restored_from_its_own_state_waits_for_the_trainers_epoch(
    store: Path, geom: ArrayGeometry
) -> None:
    """Rank 7 of 8 (no anchor under a 6-step window) through ``as_dataset(epoch_fn=...)``: its
    own state after the trainer's epoch 0, restored while the trainer is still in epoch 0 (a
    trainer restarting a finished epoch), delivers nothing there and keeps the state at epoch
    1's start; restored again in epoch 1, where a shorter window gives it samples, it delivers
    epoch 1's share as an uninterrupted rank 7 does (main: the restored loop ran epoch 1
    inside the trainer's epoch 0, its state then said epoch 2, and epoch 1 delivered epoch
    2's share)."""
    from insitubatch_nodes import as_dataset
    from insitubatch_nodes.batch import to_item

    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    long, short = {"x": geom.window([-5, 0])}, {"x": geom.window([-1, 0])}
    config = _eval(7, 8, shuffle=True)
    want = ReadPlanNode(half, long, config=config)
    want.reset(None)
    assert plan_anchors(want) == []
    want.set_views(short)
    want.reset(None)
    epoch1 = plan_anchors(want)
    assert epoch1  # (11 anchors on 8 ranks: one for rank 7)
    trainer = [0]
    states = []
    for restored in (False, True, True):
        with insitu_pipeline(store, half, long, config=config) as pipe:
            dataset = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
            if restored:
                dataset.load_state_dict(states[-1])
            if len(states) == 2:  # the trainer's epoch 1, which reads the shorter window
                trainer[0] = 1
                pipe.stages.plan.set_views(short)
                assert _sdl_rows(dataset) == epoch1
                break
            assert len(dataset) == 0 and _sdl_rows(dataset) == []
            assert pipe.stages.plan.epoch == 0
            states.append(dataset.state_dict())
            assert pipe.stages.plan.resumed_epoch(states[-1]) == 1


def test_an_empty_rank_under_epoch_fn_given_rank_zeros_state_is_told_its_own_length(
    store: Path, geom: ArrayGeometry
) -> None:
    """3 samples on 4 ranks: rank 0's state after its loop, loaded into rank 3's
    ``as_dataset(epoch_fn=...)`` while the trainer is in that epoch: length 0 (its share of
    the epoch, not rank 0's 1), nothing delivered; epoch 1 when the trainer gets there."""
    from insitubatch_nodes import as_dataset
    from insitubatch_nodes.batch import to_item

    few = split_by_chunk(geom, (0.75, 0.125, 0.125))  # the test split: samples 21 22 23
    with insitu_pipeline(store, few, {"x": geom}, config=_eval(0, 4)) as pipe:
        loader = Loader(pipe)
        list(loader)
        state = loader.state_dict()
    trainer = [0]
    with insitu_pipeline(store, few, {"x": geom}, config=_eval(3, 4)) as pipe:
        dataset = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
        dataset.load_state_dict(state)
        assert len(dataset) == 0 and _sdl_rows(dataset) == []
        trainer[0] = 1
        assert len(dataset) == 0 and _sdl_rows(dataset) == []
        assert pipe.stages.plan.epoch == 1


# -- 2. remainder="pad" unshuffled ---------------------------------------------------------------


@pytest.mark.parametrize("views_of", ["plain", "window"])
def test_unshuffled_pad_draws_each_epochs_padded_samples_from_the_ranks_that_take_none(
    store: Path, geom: ArrayGeometry, views_of: str
) -> None:
    """Unshuffled ``"pad"`` on 3 ranks, 40 epochs (found right, and so documented): every
    rank the same batch count, every valid anchor (zarr's length less the views' reach) in
    the epoch, ``(-V) % 3`` padded samples each delivered by two ranks, no rank a sample
    twice, the same plans when drawn again; the padded samples are drawn afresh each epoch
    from the other ranks' samples, so the receiving rank's own (the same rank every epoch,
    unshuffled) are never padded: rank 2's chunks 2 and 5 (dealt in chunks), its run
    17-23 (in runs)."""
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    n = zarr.open_array(store / "t2m", mode="r").shape[0]
    views, valid, own = (
        ({"x": geom.shift(2)}, set(range(n - 2)), {6, 7, 8, 15, 16, 17})
        if views_of == "plain"
        else ({"x": geom.window([-1, 0])}, set(range(1, n)), set(range(17, 24)))
    )
    nodes = [
        ReadPlanNode(whole, views, config=PlanConfig(batch_size=3, block_chunks=2,
                     remainder="pad", shuffle=False, rank=r, world_size=3))
        for r in range(3)
    ]  # fmt: skip
    padded: collections.Counter[int] = collections.Counter()
    for epoch in range(40):
        plans = [node.epoch_plan(epoch) for node in nodes]
        assert len({p.n_batches for p in plans}) == 1
        seen = collections.Counter(int(a) for p in plans for a in p.anchors)
        assert set(seen) == valid
        twice = {a for a, k in seen.items() if k == 2}
        assert max(seen.values()) <= 2 and len(twice) == (-len(valid)) % 3
        assert all(len(set(p.anchors.tolist())) == len(p.anchors) for p in plans)
        assert own <= set(plans[2].anchors.tolist())
        padded.update(twice)
    again = ReadPlanNode(whole, views, config=nodes[2].plan_config).epoch_plan(39)
    assert again.anchors.tolist() == plans[2].anchors.tolist()
    assert not own & set(padded) and len(padded) >= 8, padded
