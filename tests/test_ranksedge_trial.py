"""DDP edges and elastic resume (the ranksedge trial of 2026-12-07): ranks simulated in one
process (``rank=``, ``world_size=``), zarr's store as the oracle for which samples exist.

Found (fixed):

1. A rank with no batch of an epoch (``PlanConfig(empty_ranks=True)``: 3 test samples on 4
   ranks) kept its epoch counter at 0: the read plan moved on after an epoch that delivered a
   batch, and its state after any number of loops said epoch 0, batch 0. Where the next
   epochs give it samples (views given by ``set_views`` that hold more anchors) it drew them
   from epoch 0's permutation while the others drew from theirs: 8 ranks, a window grown from
   7 to 11 anchors, delivered sample 18 twice and 16 never. Now an epoch's end reached with no
   batch moves it on as the other ranks move (``ReadPlanNode.reset``), and its state there is
   the next epoch's start (``ReadPlanNode.get_state``; the prefetch stage's delivered
   position, ``PrefetcherNode``), so a resumed empty rank goes on at the others' epoch.
   Likewise a rank with none of an ``"uneven"`` epoch's rest after an elastic resume (4 ranks
   resumed on 8): its loop was empty and its next one the next epoch, but its state after
   that loop resumed the empty loop again, one loop behind the ranks that had some.
2. ``remainder="pad"`` over windows (dealt in runs) padded each short run with the sample just
   past its end: the samples at the cuts, the same few epoch after epoch (23 anchors on 3
   ranks, 40 shuffled epochs: only samples 16 and 8 were ever padded, 16 in 23 epochs;
   unshuffled, 16 in all 40), so those few were trained twice as often. Now each short run's
   padded sample is drawn by the epoch's seed from the other runs' samples (``deal_runs``'s
   ``pad_rng``; no two the same; delivered by two ranks, as ``deal``'s are), at the cost of
   the chunks that sample's window reads.
3. ``remainder="pad"`` dealt in chunks drew its padded samples from all the epoch's samples
   and gave them to the ranks whose share they complete, often one the rank already delivers
   (100 samples on 3 ranks: in 1665 of 3000 epochs a rank delivered one of its own samples
   twice; 24 samples on 5 ranks, epoch 0: a batch ``[2, 2]``; ``DistributedSampler`` never
   does). Now each is drawn from the other ranks' samples (``deal``'s ``pad_others``; the
   same draws as before wherever those were another rank's).

For 2 and 3 the config says ``"pad": "drawn"``; a state saved mid-epoch by the rule before
finishes that epoch by it (``LEGACY_PAD``), exactly as main continued it (checked against
main's continuation, also of states main saved again after an elastic cut, when this was
written), on the same and on another number of ranks, also saved again inside that epoch.

Tried and found right: shuffled, the padded samples spread over the split (24 samples on 7
ranks, 60 epochs: every sample padded, none more than 20 times); on 3, 5 and 7 ranks each
padded sample is delivered exactly twice, by two ranks, none left out, every rank
computing the same dealing on its own (rank-independent: the same plans drawn twice), equal
batch counts. A state of 2 ranks saved after any batch ``k`` resumes on 3 and on 1 (plain
views dealt in chunks, windows dealt in runs; ``"drop"`` and ``"pad"``; shuffled and not) with
every valid sample in exactly one batch of that epoch over old and new ranks but the few that
sit out or are padded, equal batch counts, and the next epoch a fresh run's on that many
ranks; through ``Loader`` and ``StatefulDataLoader(as_dataset(...))`` in fresh pipelines the
rows are zarr's and ``len()`` is each loop's count, over two epochs.

Left: unshuffled, which rank holds which sample is the same every epoch, so the samples of
the ranks that take the padded ones are never padded (``"pad"`` with ``shuffle=False`` is
rare: ``overfit_batches``). An empty rank given rank 0's state (the DDP rule of one state
for all ranks, not the rule for prediction loops, where each rank restores its own) resumes
its epoch as an empty loop, one loop behind rank 0 (fixed since: tests/test_ranks2_trial.py,
which also documents the unshuffled padding).
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import uneven_eval as _eval
from helpers import write_ranks_store

from insitubatch_nodes import (
    ArrayGeometry,
    Loader,
    PlanConfig,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.stages._graph import plan_state
from insitubatch_nodes.stages.read_plan import ReadPlanNode

pytestmark = pytest.mark.timeout(60)

T, C = 24, 3  # 8 chunks of 3 steps


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ranks_store(tmp_path_factory.mktemp("ranksedge") / "s.zarr", seed=5)


@pytest.fixture(scope="module")
def geom(store: Path) -> ArrayGeometry:
    return open_geometries(store, ["t2m"])["t2m"]


def _loop(node: Any) -> list[int]:
    return [int(a) for batch in node for a in batch.anchors]


# -- 1. an empty rank's epoch -------------------------------------------------------------------


def test_an_empty_rank_ends_each_epoch_at_the_same_epoch_as_the_other_ranks(
    geom: ArrayGeometry,
) -> None:
    few = split_by_chunk(geom, (0.75, 0.125, 0.125))  # the test split: samples 21 22 23
    nodes = [ReadPlanNode(few, {"x": geom}, config=_eval(r, 4, shuffle=True)) for r in range(4)]
    for epoch in range(3):
        shares = []
        for node in nodes:
            node.reset(None)
            shares.append(_loop(node))
            assert node.epoch == epoch and node.next_epoch == epoch + 1
            assert node.resumed_epoch(node.get_state()) == epoch + 1
        assert sorted(a for s in shares for a in s) == [21, 22, 23] and shares[3] == []


def test_views_that_give_a_formerly_empty_rank_samples_deal_each_sample_once_over_the_ranks(
    geom: ArrayGeometry,
) -> None:
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    world = 8
    nodes = [
        ReadPlanNode(half, {"x": geom.window([-5, 0])}, config=_eval(r, world, shuffle=True))
        for r in range(world)
    ]
    for _ in range(3):  # 7 anchors (17..23) on 8 ranks: rank 7 has none
        shares = [(node.reset(None), _loop(node))[1] for node in nodes]
        assert sorted(a for s in shares for a in s) == list(range(17, 24)) and shares[7] == []
    for node in nodes:  # a shorter window: 11 anchors (13..23), every rank some
        node.set_views({"x": geom.window([-1, 0])})
    for epoch in (3, 4):
        shares = [(node.reset(None), _loop(node))[1] for node in nodes]
        seen = collections.Counter(a for s in shares for a in s)
        assert sorted(seen.elements()) == list(range(13, 24)), seen  # (main: 18 twice, 16 never)
        assert [node.epoch for node in nodes] == [epoch] * world


def test_an_empty_ranks_state_after_its_loop_resumes_at_the_next_epoch_as_the_others_do(
    store: Path, geom: ArrayGeometry
) -> None:
    few = split_by_chunk(geom, (0.75, 0.125, 0.125))
    states = []
    for rank in (0, 3):
        with insitu_pipeline(store, few, {"x": geom}, config=_eval(rank, 4)) as pipe:
            loader = Loader(pipe)
            rows = [[b.sample_indices["x"].tolist() for b in loader] for _ in range(2)]
            assert rows == ([[[21]], [[21]]] if rank == 0 else [[], []])
            states.append(loader.state_dict())
            assert pipe.stages.plan.epoch == 1
            # each rank's own state (a prediction loop's rule): the next epoch, 2
            assert pipe.stages.plan.resumed_epoch(states[-1]) == 2
    with insitu_pipeline(store, few, {"x": geom}, config=_eval(3, 4)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(states[1])
        assert [list(loader), list(loader)] == [[], []]
        assert plan_state(loader.state_dict())["epoch"] == 4  # (after epochs 2 and 3)


def test_ranks_with_none_of_an_uneven_epochs_rest_move_on_with_the_others(
    store: Path, geom: ArrayGeometry
) -> None:
    """4 ranks, 12 samples, 2 batches of 1 delivered; resumed on 8: the rest (4 samples) goes
    to 4 of them, and all 8 end that loop at epoch 0, their states there resuming epoch 1
    (main: those of the 4 without any resumed epoch 0 again, an empty loop), each sample
    once."""
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    old = [ReadPlanNode(half, {"x": geom}, config=_eval(r, 4, shuffle=True)) for r in range(4)]
    delivered = [a for node in old for _ in range(2) for a in node.next().anchors.tolist()]
    state = old[0].get_state()
    rest, epoch1 = [], []
    for r in range(8):
        node = ReadPlanNode(half, {"x": geom}, config=_eval(r, 8, shuffle=True))
        node.reset(state)
        rest.append(_loop(node))
        assert node.epoch == 0 and node.resumed_epoch(node.get_state()) == 1
        node.reset(None)
        epoch1 += _loop(node)
        assert node.epoch == 1 and node.resumed_epoch(node.get_state()) == 2
    assert sorted(delivered + [a for s in rest for a in s]) == list(range(12, 24))
    assert sum(1 for s in rest if not s) == 4 and sorted(epoch1) == list(range(12, 24))
    empty = rest.index([])
    with insitu_pipeline(store, half, {"x": geom}, config=_eval(empty, 8, shuffle=True)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(
            {"root": {"source": {"source": {"source": {"source": state}}}}, "num_yielded": 2}
        )  # fmt: skip  (a Loader's, from rank 0's plan)
        assert list(loader) == []
        after = loader.state_dict()
        assert pipe.stages.plan.resumed_epoch(after) == 1
    with insitu_pipeline(store, half, {"x": geom}, config=_eval(empty, 8, shuffle=True)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(after)
        want = ReadPlanNode(half, {"x": geom}, config=_eval(empty, 8, shuffle=True))
        want.set_epoch(1)
        assert [b.sample_indices["x"].tolist() for b in loader] == _anchors_of(want)


# -- 2. remainder="pad" ---------------------------------------------------------------------------


def _padded(plans: list[Any]) -> collections.Counter[int]:
    """The samples an epoch's plans (one per rank) deliver more than once, and how often."""
    seen = collections.Counter(int(a) for plan in plans for a in plan.anchors)
    return collections.Counter({a: n - 1 for a, n in seen.items() if n > 1})


def _parts(manifest: Any, views: Any) -> Any:
    """``views`` as a plan reads them (a window expanded into its steps)."""
    return ReadPlanNode(manifest, views).views


def _epoch_plans(manifest: Any, views: Any, world: int, epoch: int, **kw: Any) -> list[Any]:
    config, parts = (
        PlanConfig(batch_size=3, block_chunks=2, remainder="pad", **kw),
        _parts(manifest, views),
    )
    return [
        plan_epoch(manifest, parts, config.for_rank(r, world), epoch=epoch) for r in range(world)
    ]


@pytest.mark.parametrize("shuffle", [True, False])
def test_windows_padded_samples_spread_over_the_split_not_the_same_few_at_the_cuts(
    geom: ArrayGeometry, shuffle: bool
) -> None:
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    views = {"x": geom.window([-1, 0])}  # 23 anchors (1..23), dealt in runs
    padded: collections.Counter[int] = collections.Counter()
    for epoch in range(40):
        plans = _epoch_plans(whole, views, 3, epoch, shuffle=shuffle)
        once = _padded(plans)
        assert sum(once.values()) == 1 and max(once.values()) == 1  # 23 = 3 * 8 - 1
        assert sorted(set(int(a) for p in plans for a in p.anchors)) == list(range(1, 24))
        padded.update(once)
    # main: a sample at a cut, the same few every epoch (shuffled: 16 in 23 epochs of 40, 8 in
    # 17; unshuffled: 16 in all 40); now one drawn from the short run's
    # own samples (unshuffled, the short run is the last: its 7 samples)
    assert max(padded.values()) <= (8 if shuffle else 12), padded
    assert len(padded) >= (12 if shuffle else 6), padded


def test_chunks_padded_samples_spread_over_the_split_each_about_equally_often(
    geom: ArrayGeometry,
) -> None:
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    padded: collections.Counter[int] = collections.Counter()
    for epoch in range(60):  # 24 samples on 7 ranks: 4 padded each epoch
        plans = _epoch_plans(whole, {"x": geom}, 7, epoch, shuffle=True)
        once = _padded(plans)
        assert sum(once.values()) == 4 and max(once.values()) == 1
        padded.update(once)
    assert len(padded) == 24 and max(padded.values()) <= 20, padded


@pytest.mark.parametrize("views_of", ["plain", "window"])
def test_padding_is_the_same_on_every_rank_and_each_padded_sample_delivered_twice_only(
    geom: ArrayGeometry, views_of: str
) -> None:
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    views = {"x": geom} if views_of == "plain" else {"x": geom.window([-2, 0])}
    n = 24 if views_of == "plain" else 22
    for world in (3, 5, 7):
        for epoch in range(4):
            plans = _epoch_plans(whole, views, world, epoch, shuffle=True, seed=3)
            again = _epoch_plans(whole, views, world, epoch, shuffle=True, seed=3)
            assert [p.anchors.tolist() for p in plans] == [p.anchors.tolist() for p in again]
            assert len({p.n_batches for p in plans}) == 1
            padded = _padded(plans)
            assert sum(padded.values()) == (-n) % world and set(padded.values()) <= {1}
            delivered = {int(a) for p in plans for a in p.anchors}
            assert len(delivered) == n  # none left out
            for plan in plans:  # a padded sample goes to another rank than its own
                assert len(set(plan.anchors.tolist())) == len(plan.anchors), (world, epoch)


@pytest.mark.parametrize("views_of", ["plain", "window"])
def test_a_pad_state_saved_before_padded_samples_were_drawn_ends_its_epoch_as_begun(
    geom: ArrayGeometry, views_of: str
) -> None:
    """A ``"pad"`` state on several ranks saved mid-epoch by the rule before (its config
    without ``"pad"``: main's) finishes that epoch with main's padded samples (checked against
    main's own continuation when this was written), on 3 ranks, on 2 and on 1, also when
    saved again in it; the next epoch is today's."""
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    views = (  # 22 anchors (2 padded on 3 ranks), dealt in chunks; 22, dealt in runs
        {"x": geom.shift(2)}
        if views_of == "plain"
        else {"x": geom.window([-1, 0]), "y": geom.shift(1)}
    )
    old_rule = "chunks-pad-any" if views_of == "plain" else "runs-pad-edge"
    differs = 0
    for shuffle in (True, False):
        config = PlanConfig(
            batch_size=3, block_chunks=2, remainder="pad", shuffle=shuffle, seed=16
        )  # fmt: skip  (main's pads give a rank its own sample)
        nodes = [ReadPlanNode(whole, views, config=config.for_rank(r, 3)) for r in range(3)]
        for node in nodes:
            node.reset(None)
            node.next()
        state = nodes[0].get_state()
        old = {**state, "config": {k: v for k, v in state["config"].items() if k != "pad"}}
        for world in (3, 2, 1):
            cut = [(3, 1)] if world != 3 else []
            for r in range(world):
                parts, mine = _parts(whole, views), config.for_rank(r, world)
                edge = plan_epoch(whole, parts, mine, resumed=cut, dealing=old_rule)
                want = [edge.batch(i).anchors.tolist() for i in range(1, edge.n_batches)]
                node = ReadPlanNode(whole, views, config=config.for_rank(r, world))
                node.reset(old)
                assert [b.anchors.tolist() for b in node] == want
                node.reset(old)
                node.next()
                again = ReadPlanNode(whole, views, config=config.for_rank(r, world))
                again.reset(node.get_state())  # saved again inside that epoch
                assert [b.anchors.tolist() for b in again] == want[1:]
                node.reset(state)
                differs += [b.anchors.tolist() for b in node] != want
                node.reset(None)  # the next epoch: today's rule
                assert node.get_state()["config"]["pad"] == "drawn"
    assert differs  # (the two rules deliver other rows)


# -- 3. elastic resume, as a user runs it ----------------------------------------------------


def _anchors_of(node: ReadPlanNode) -> list[list[int]]:
    return [b.anchors.tolist() for b in node]


@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize("views_of", ["plain", "window"])
def test_a_state_of_two_ranks_at_any_batch_resumes_on_three_and_on_one_each_sample_once(
    geom: ArrayGeometry, remainder: str, views_of: str
) -> None:
    """Saved after batch ``k`` on 2 ranks (rank 0's state), resumed on 3 and on 1: in that
    epoch every valid sample in exactly one batch over old and new ranks (but the at most
    ``1 + (W - 1)`` that sit out or are padded), equal batch counts on the new ranks; the next
    epoch a fresh run's on that many ranks."""
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    views = {"x": geom} if views_of == "plain" else {"x": geom.window([-1, 0]), "y": geom.shift(1)}
    valid = set(range(24)) if views_of == "plain" else set(range(1, 23))
    for shuffle in (True, False):
        config = PlanConfig(batch_size=3, block_chunks=2, shuffle=shuffle, remainder=remainder)
        n_old = len(ReadPlanNode(whole, views, config=config.for_rank(0, 2)))
        for k in range(1, n_old):
            old = [ReadPlanNode(whole, views, config=config.for_rank(r, 2)) for r in range(2)]
            delivered = [a for node in old for _ in range(k) for a in node.next().anchors.tolist()]
            state = old[0].get_state()
            for world in (3, 1):
                epoch0, lens = list(delivered), set()
                for r in range(world):
                    node = ReadPlanNode(whole, views, config=config.for_rank(r, world))
                    node.reset(state)
                    lens.add(len(node))
                    epoch0 += [a for b in _anchors_of(node) for a in b]
                    node.reset(None)
                    fresh = ReadPlanNode(whole, views, config=config.for_rank(r, world))
                    fresh.set_epoch(1)
                    fresh.reset(None)
                    assert _anchors_of(node) == _anchors_of(fresh)
                assert len(lens) == 1
                seen = collections.Counter(epoch0)
                assert set(seen) <= valid
                off = 1 + (world - 1)  # (2 ranks' remainder, then the new world's)
                if remainder == "drop":
                    assert max(seen.values()) == 1 and len(valid) - len(seen) <= off
                else:
                    assert set(seen) == valid and len(epoch0) - len(valid) <= off


def test_loaders_resumed_on_three_and_on_one_deliver_zarrs_rows_once_over_two_epochs(
    store: Path, geom: ArrayGeometry
) -> None:
    """Through ``Loader`` and ``StatefulDataLoader(as_dataset(...))`` in fresh pipelines, the
    rows checked against zarr's array; ``len()`` is each loop's batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes import as_dataset

    data = np.asarray(zarr.open_array(store / "t2m", mode="r")[...])
    whole = split_by_chunk(geom, (1.0, 0.0, 0.0))
    views = {"x": geom.window([-1, 0]), "y": geom.shift(1)}  # anchors 1..22

    def rows(batch: Any) -> list[int]:
        last = np.asarray(batch.sample_indices["x"])[:, -1]
        assert np.array_equal(np.asarray(batch["y"]), data[last + 1])
        assert np.array_equal(np.asarray(batch["x"]), data[np.stack([last - 1, last], 1)])
        return last.tolist()

    def config(rank: int, world: int) -> PlanConfig:
        return PlanConfig(batch_size=3, block_chunks=2, remainder="pad", rank=rank,
                          world_size=world)  # fmt: skip

    pipes = [insitu_pipeline(store, whole, views, config=config(r, 2)) for r in range(2)]
    loaders = [Loader(p) for p in pipes]
    delivered = [a for loader in loaders for b in itertools.islice(loader, 2) for a in rows(b)]
    state = loaders[0].state_dict()
    for p in pipes:
        p.close()
    for world, how in itertools.product((3, 1), ("loader", "sdl")):
        epochs: list[list[int]] = [list(delivered), []]
        for r in range(world):
            with insitu_pipeline(store, whole, views, config=config(r, world)) as pipe:
                if how == "loader":
                    loop: Any = Loader(pipe)
                    loop.load_state_dict(state)
                    sized = loop
                else:
                    sized = as_dataset(pipe, transform=lambda b: b)
                    sized.load_state_dict(state)
                    loop = StatefulDataLoader(sized, batch_size=None, num_workers=0)
                for e in (0, 1):
                    told = len(sized)
                    got = [rows(b) for b in loop]
                    assert told == len(got) + (2 if e == 0 else 0), (how, world, e)
                    epochs[e] += [a for b in got for a in b]
        for e, samples in enumerate(epochs):
            assert set(samples) == set(range(1, 23)), (how, world, e)
            # 22 on 2 ranks pad none; then (-22) % world padded (epoch 0: at most that)
            assert len(samples) - 22 <= world - 1 if e == 0 else len(samples) - 22 == (-22) % world
