"""Windows on several ranks: each rank is dealt one contiguous run of anchors (issue 30).

With views at several offsets (a window), an anchor reads its neighbours' chunks. Dealt whole
chunks round-robin, every rank held most chunks (chunk reads summed over 4 ranks: 2.96x one
rank's, 5 views -2..+2 at one step per chunk). Dealt as contiguous runs along the sample axis,
summed over the ranks they read the split's chunks plus, at each of the ``W - 1`` cuts between
runs, the chunks one window span reaches across (and one per padded sample).

The oracles: the GETs a zarr store sees (a counting store), zarr's own read of the array,
arithmetic on which anchors are valid, and hand-written legacy states.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import plan_anchors
from torchdata.nodes import Loader

from insitubatch_nodes import ArrayGeometry, SplitManifest, open_geometries, split_by_chunk
from insitubatch_nodes.pipeline import insitu_pipeline
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.quality import shuffle_quality
from insitubatch_nodes.plan.ranks import deal, deal_runs
from insitubatch_nodes.plan.schedule import schedule_floors, working_set_bytes
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from tests.helpers import counting_store

N_TIME = 68  # one step per chunk
OFFSETS = (-2, -1, 0, 1, 2)  # a 5-step window as five shift views
T = len(OFFSETS)
VALID = list(range(2, N_TIME - 2))  # anchors whose whole window lies in the array


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("runs") / "a.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    arr = group.create_array("t", shape=(N_TIME, 3), chunks=(1, 3), dtype="f4", fill_value=0)
    arr[...] = np.random.default_rng(7).standard_normal((N_TIME, 3)).astype(np.float32) + 10
    return path


@pytest.fixture(scope="module")
def geom(store: Path) -> ArrayGeometry:
    return open_geometries(store, ["t"])["t"]


@pytest.fixture(scope="module")
def manifest(geom: ArrayGeometry) -> SplitManifest:
    return split_by_chunk(geom, (1.0, 0.0, 0.0))


def _window(g: ArrayGeometry, offsets: tuple[int, ...] = OFFSETS) -> dict[str, ArrayGeometry]:
    return {f"t{k:+d}": g.shift(k) for k in offsets}


def _epoch_through_pipelines(
    store: Path, manifest: SplitManifest, geom: ArrayGeometry, world: int, remainder: str
) -> tuple[list[list[int]], list[set[str]], list[int]]:
    """Every rank of ``world`` reads epoch 1 through its own pipeline and counting store:
    each rank's anchors, the chunk keys it GETs (each once: read-once per rank), and its batch
    count (arrays checked against zarr)."""
    oracle = zarr.open_array(store / "t", mode="r")[...]
    anchors, gets, n_batches = [], [], []
    for rank in range(world):
        counting = counting_store(store)
        pipe = insitu_pipeline(
            counting,
            manifest,
            _window(geom),
            batch_size=8,
            block_chunks=4,
            seed=2,
            rank=rank,
            world_size=world,
            remainder=remainder,
            prefetch_depth=1,
        )
        try:
            pipe.stages.plan.set_epoch(1)
            batches = list(Loader(pipe))
            assert len(batches) == len(pipe)
            mine: list[int] = []
            for b in batches:
                idx = b.sample_indices["t+0"]
                for k in OFFSETS:
                    assert np.array_equal(b[f"t{k:+d}"], oracle[idx + k])
                mine.extend(int(i) for i in idx)
        finally:
            pipe.close()
        anchors.append(mine)
        counts = counting.chunk_counts()
        assert set(counts.values()) == {1}, "a rank read a chunk twice in one epoch"
        gets.append(set(counts))
        n_batches.append(len(batches))
    return anchors, gets, n_batches


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_window_ranks_read_at_most_the_split_plus_one_window_per_cut_and_a_quarter_more_at_four(
    store: Path, manifest: SplitManifest, geom: ArrayGeometry, remainder: str
) -> None:
    (one,), (split_gets,), _ = _epoch_through_pipelines(store, manifest, geom, 1, remainder)
    assert sorted(one) == VALID
    assert split_gets == {f"t/c/{i}/0" for i in range(N_TIME)}  # what zarr wrote
    ratios = {}
    for world in (2, 3, 4):
        anchors, gets, n_batches = _epoch_through_pipelines(store, manifest, geom, world, remainder)
        share = (len(VALID) // world) if remainder == "drop" else math.ceil(len(VALID) / world)
        assert [len(a) for a in anchors] == [share] * world
        assert set(n_batches) == {math.ceil(share / 8)}
        flat = [a for mine in anchors for a in mine]
        n_pad = world * share - len(VALID) if remainder == "pad" else 0
        if remainder == "drop":
            assert len(flat) == len(set(flat)), "ranks share a sample"
            assert len(VALID) - len(flat) <= world - 1
        else:
            assert set(flat) == set(VALID) and len(flat) - len(VALID) == n_pad
        summed = sum(len(g) for g in gets)
        # the documented bound: (W - 1) cuts, each sharing the T - 1 chunks a window reaches
        # across, plus the T chunks of each padded sample's window (drawn from another run's
        # samples since 2026-12-07; before, the sample past its run's end, one chunk)
        assert summed <= len(split_gets) + (world - 1) * (T - 1) + n_pad * T, (world, summed)
        ratios[world] = summed / len(split_gets)
    assert ratios[4] <= 1.25, ratios


def _plans(manifest: SplitManifest, views: Any, world: int, epoch: int, **kw: Any) -> list[Any]:
    return [
        plan_epoch(
            manifest,
            views,
            PlanConfig(batch_size=8, block_chunks=4, rank=r, world_size=world, **kw),
            epoch=epoch,
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_each_rank_holds_one_contiguous_run_of_the_valid_anchors_drawn_afresh_each_epoch(
    manifest: SplitManifest, geom: ArrayGeometry, remainder: str, shuffle: bool
) -> None:
    views = _window(geom)
    runs_by_epoch = []
    for epoch in range(4):
        runs = []
        for plan in _plans(manifest, views, 4, epoch, remainder=remainder, shuffle=shuffle):
            anchors = plan.anchors.tolist()
            own = sorted(set(anchors))
            if remainder == "pad" and len(own) < len(anchors):
                pad = [a for a in own if anchors.count(a) > 1] or [anchors[-1]]
                assert len(anchors) - len(own) <= 1 and len(pad) == 1
            # one run of consecutive valid anchors, give or take one padded neighbour
            assert own == list(range(own[0], own[-1] + 1)), own
            runs.append((own[0], own[-1]))
        runs_by_epoch.append(runs)
    if shuffle:  # which rank gets which run changes with the epoch
        assert len({tuple(r) for r in runs_by_epoch}) > 1
    else:
        assert len({tuple(r) for r in runs_by_epoch}) == 1
        assert [a for a, _ in runs_by_epoch[0]] == sorted(a for a, _ in runs_by_epoch[0])


def test_a_strided_window_is_dealt_in_runs_disjoint_with_equal_batch_counts_and_few_reads(
    tmp_path: Path,
) -> None:
    path = tmp_path / "h.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t", shape=(600, 2), chunks=(1, 2), dtype="f4", fill_value=0)
    g = open_geometries(path, ["t"])["t"]
    m = split_by_chunk(g, (1.0, 0.0, 0.0))
    offsets = (-6, 0, 6, 12, 18, 24)  # 2 inputs, 4 targets, 6-hourly on an hourly axis
    views = _window(g, offsets)
    valid = list(range(6, 600 - 24, 6))
    one = _plans(m, views, 1, 0, stride=6)[0]
    split_reads = len(one.distinct_chunks())
    assert split_reads == len({a + k for a in valid for k in offsets})
    for world in (2, 3, 4):
        for epoch in (0, 1):
            plans = _plans(m, views, world, epoch, stride=6)
            flat = [a for p in plans for a in p.anchors.tolist()]
            assert len(flat) == len(set(flat)) and set(flat) <= set(valid)
            assert len(valid) - len(flat) <= world - 1
            assert len({p.n_batches for p in plans}) == 1
            summed = sum(len(p.distinct_chunks()) for p in plans)
            assert summed <= split_reads + (world - 1) * (len(offsets) - 1)


def test_deal_runs_covers_every_sample_once_in_runs_and_equals_deal_on_one_rank() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        counts = rng.integers(0, 9, size=int(rng.integers(1, 30)))
        if counts.sum() == 0:
            continue
        axis = rng.permutation(len(counts)) * 3  # distinct places, in another order
        one = deal_runs(counts, axis, 1)[0]
        (g1, lo1, n1) = deal(counts, 1)[0]
        held = n1 > 0  # (deal lists a group with no sample as a whole one)
        assert all(np.array_equal(x, y[held]) for x, y in zip(one, (g1, lo1, n1), strict=True))
        for world in range(2, 7):
            for remainder in ("drop", "pad"):
                draw = np.random.default_rng(world) if world % 2 else None
                pieces = deal_runs(counts, axis, world, remainder=remainder, rng=draw)
                share = counts.sum() // world if remainder == "drop" else -(-counts.sum() // world)
                seen: list[tuple[int, int]] = []
                for group, lo, n in pieces:
                    assert int(n.sum()) == share
                    assert np.all(lo >= 0) and np.all(lo + n <= counts[group])
                    mine = [(int(g), i) for g, a, k in zip(group, lo, n, strict=True)
                            for i in range(a, a + k)]  # fmt: skip
                    seen.extend(mine)
                    # whole groups first, in visiting order (ascending group), then partial
                    # pieces (and the last piece may be a padded sample: a whole 1-group);
                    # unshuffled, where visiting order is axis order: the run in axis order
                    run = group[: len(n) - 1] if remainder == "pad" else group
                    if draw is None and np.all(np.diff(axis[run]) > 0):
                        continue
                    whole = (n == counts[group])[: len(n) - 1].tolist()
                    k_whole = whole.index(False) if False in whole else len(whole)
                    assert not any(whole[k_whole:])
                    assert np.all(np.diff(group[:k_whole]) > 0)
                distinct = set(seen)
                if remainder == "drop":
                    assert len(seen) == len(distinct)
                    assert counts.sum() - len(seen) <= world - 1
                else:
                    assert len(distinct) == counts.sum()
                    assert len(seen) - len(distinct) == world * share - counts.sum()


def test_runs_mix_each_rank_as_well_as_chunks_dealt_round_robin(
    tmp_path: Path,
) -> None:
    path = tmp_path / "q.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t", shape=(2400, 2), chunks=(8, 2), dtype="f4", fill_value=0)
    g = open_geometries(path, ["t"])["t"]
    m = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = _window(g)
    scores: dict[str, list[float]] = {"chunks": [], "runs": []}
    for how in scores:
        for epoch in range(3):
            for rank in range(4):
                config = PlanConfig(batch_size=32, rank=rank, world_size=4)
                plan = plan_epoch(m, views, config, epoch=epoch, dealing=how)
                scores[how].append(shuffle_quality(plan.anchors, 32))
    # measured: 0.941 (chunks), 0.946 (runs)
    assert np.mean(scores["runs"]) >= np.mean(scores["chunks"]) - 0.02, scores


def test_the_schedule_floors_bound_every_epoch_dealt_in_runs(
    manifest: SplitManifest, geom: ArrayGeometry
) -> None:
    views = _window(geom)
    for bs, bc in ((3, 2), (8, 4), (5, 16)):
        for remainder in ("drop", "pad"):
            for world in (2, 3, 4):
                config = PlanConfig(batch_size=bs, block_chunks=bc, world_size=world,
                                    remainder=remainder)  # fmt: skip
                floors = schedule_floors(manifest, views, config)
                for epoch in (0, 1):
                    for rank in range(world):
                        cfg = config.for_rank(rank, world)
                        for gap, bound in ((None, floors.read_once),
                                           (floors.pin_gap, floors.bounded)):  # fmt: skip
                            plan = plan_epoch(manifest, views, cfg, epoch=epoch, pin_gap=gap)
                            assert working_set_bytes(plan, {"t": geom})[0] <= bound


def _node(manifest: SplitManifest, geom: ArrayGeometry, rank: int, world: int, **kw: Any):
    config = PlanConfig(batch_size=2, block_chunks=3, seed=4, rank=rank, world_size=world, **kw)
    return ReadPlanNode(manifest, _window(geom), config=config)


def _rest(node: ReadPlanNode) -> list[list[int]]:
    return plan_anchors(node)


@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize(("old", "new"), [(4, 4), (2, 3), (4, 3), (3, 1)])
def test_a_window_run_resumes_exactly_mid_epoch_and_elastically_on_another_world_size(
    manifest: SplitManifest, geom: ArrayGeometry, old: int, new: int, stride: int
) -> None:
    valid = [a for a in VALID if a % stride == 0]
    k = 2
    before: list[int] = []
    nodes = [_node(manifest, geom, r, old, stride=stride) for r in range(old)]
    full = []
    for n in nodes:
        n.set_epoch(1)
        n.reset(None)
        full.append(_rest(n))
        assert len(full[-1]) == len(full[0])
        before.extend(a for b in full[-1][:k] for a in b)
    state = None
    for r in range(old):
        fresh = _node(manifest, geom, r, old, stride=stride)
        fresh.set_epoch(1)
        fresh.reset(None)
        for _ in range(k):
            fresh.next()
        if r == 0:
            state = fresh.get_state()
        assert state is not None and state["config"]["deal"] == "runs"
        if new == old:  # exact: every rank goes on with its own batches
            again = _node(manifest, geom, r, old, stride=stride)
            again.reset(state)
            assert _rest(again) == full[r][k:]
    if new == old:
        return
    after: list[int] = []
    counts = set()
    for r in range(new):
        node = _node(manifest, geom, r, new, stride=stride)
        node.reset(state)
        got = _rest(node)
        counts.add(len(got))
        after.extend(a for b in got for a in b)
    assert len(counts) == 1
    seen = before + after
    assert len(seen) == len(set(seen)) and set(seen) <= set(valid)
    assert len(valid) - len(seen) <= new - 1


def test_a_mid_epoch_state_from_before_runs_goes_on_dealt_in_chunks_then_deals_runs(
    manifest: SplitManifest, geom: ArrayGeometry
) -> None:
    # what the package saved before windows were dealt in runs: the same state, no "deal" key
    node = _node(manifest, geom, 1, 3)
    node.set_epoch(2)
    node.reset(None)
    node.next()
    legacy = node.get_state()
    del legacy["config"]["deal"]
    config = PlanConfig(batch_size=2, block_chunks=3, seed=4, rank=1, world_size=3)
    old_way = plan_epoch(manifest, _window(geom), config, epoch=2, dealing="chunks")
    new_way = plan_epoch(manifest, _window(geom), config, epoch=2)
    assert old_way.anchors.tolist() != new_way.anchors.tolist()
    resumed = _node(manifest, geom, 1, 3)
    resumed.reset(legacy)
    assert "deal" not in resumed.get_state()["config"]  # saved again, it stays a legacy epoch
    rest = _rest(resumed)
    want = [old_way.batch(i).anchors.tolist() for i in range(1, old_way.n_batches)]
    assert rest == want
    resumed.reset(None)  # the next epoch is dealt in runs
    assert resumed.get_state()["config"]["deal"] == "runs"
    nxt = plan_epoch(manifest, _window(geom), config, epoch=3)
    assert _rest(resumed) == [nxt.batch(i).anchors.tolist() for i in range(nxt.n_batches)]
    # elastically, on two ranks: the old ranks' chunk-dealt batches are what they delivered
    delivered = [
        a
        for r in range(3)
        for a in plan_epoch(
            manifest, _window(geom), config.for_rank(r, 3), epoch=2, dealing="chunks"
        ).anchors[:2]
    ]
    after = []
    for r in range(2):
        elastic = _node(manifest, geom, r, 2)
        elastic.reset(legacy)
        after.extend(a for b in _rest(elastic) for a in b)
    seen = delivered + after
    assert len(seen) == len(set(seen)) and len(VALID) - len(seen) <= 1


def test_a_dealing_other_than_chunks_or_runs_is_refused(
    manifest: SplitManifest, geom: ArrayGeometry
) -> None:
    with pytest.raises(ValueError, match="dealing must be"):
        plan_epoch(manifest, _window(geom), PlanConfig(world_size=2), dealing="round-robin")
