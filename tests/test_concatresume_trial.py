"""Resume over stores written newest first, and an elastic epoch cut on three world sizes
(the concatresume trial of 2026-12-07).

The oracles are xarray and zarr, never the package's plan: ``xr.concat`` of the stores (or
``xr.align`` of joined ones) says which times exist, which windows an epoch holds and what
each row holds; an uninterrupted run says which batches a resumed one must deliver; a fresh
read plan of the new world size says what its next epoch is. Ranks are simulated in one
process (``rank=``, ``world_size=``).

Claims checked (each found right: no code changed):

1. A ``Loader`` state taken after ``k`` batches of a concatenation of stores written newest
   first (windows in time deltas across the stores' edges, a ``missing=`` date), restored in
   a fresh pipeline, delivers the rest of the run bit for bit (values, sample indices,
   members, times), mid-epoch, at the epoch's last batch and in the next epoch; a state of 2
   ranks restored on 3 delivers each window of the epoch not yet delivered once, in equal
   batch counts, valued as ``xr.concat`` values it.
2. A ``missing=`` join of stores written newest first (a concatenation among them) drops
   exactly the windows that read a listed step, given as dates or as sample indices of the
   joined axis (a negative one from its end: the earliest times), and ``dropped`` counts them.
3. An evaluation epoch (``"uneven"``) cut on 3 ranks, resumed on 2 and cut again, then ended
   on 3 (the state carrying both cuts, ``"resumed": [[3, 4], [2, 10]]``), delivers every
   sample once over the three world sizes; each K rank's state after its last batch (the
   longest's and a shorter one's) reads as the epoch's end on 3 ranks and on 2: a ``Loader``
   goes on with the next epoch as a fresh run of that size draws it, and
   ``as_dataset(epoch_fn=...)`` delivers nothing at every ``iter()`` while the trainer stays
   in the epoch, then the next epoch once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import epoch_anchors, open_with_xarray, write_sst
from resume_helpers import assert_resumes_exactly, digest

from insitubatch_nodes import (
    Loader,
    PlanConfig,
    as_dataset,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.batch import to_item
from insitubatch_nodes.io.collection import Collection, concat
from insitubatch_nodes.stages._graph import plan_state
from insitubatch_nodes.stages.read_plan import ReadPlanNode

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(60)

HOUR = np.timedelta64(1, "h")
#: 6-hourly times from 2000-01-01T00
HOURS = pd.date_range("2000-01-01", periods=24, freq="6h")


def _store(root: Path, lo: int, hi: int, chunk: int) -> Path:
    """``HOURS[lo:hi]`` newest first, written by xarray, ``chunk`` steps an object; the values
    of each store its own (``write_sst``'s plus 1000 times ``lo``)."""
    write_sst(root, HOURS[lo:hi][::-1], chunk=chunk)
    sst = zarr.open_array(root / "sst", mode="r+")
    sst[:] = np.asarray(sst[:]) + 1000 * lo
    return root


# -- 1. a concatenation of stores written newest first, resumed ----------------------------------

#: x: the anchor and the step before it (one sample on, newest first); y: the step after it
WINDOWS = {"x": ["-6h", "0h"], "y": ["6h"]}
DELTAS = {k: [np.timedelta64(int(d[:-1]), "h") for d in w] for k, w in WINDOWS.items()}
LISTED = np.datetime64(HOURS[10], "ns")  # in the middle store


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three stores of 8 steps in chunks of 4, listed newest first."""
    tmp = tmp_path_factory.mktemp("concatresume")
    return [_store(tmp / f"s{lo}.zarr", lo, lo + 8, 4) for lo in (16, 8, 0)]


@pytest.fixture(scope="module")
def oracle(roots: list[Path]) -> Any:
    return xr.concat([open_with_xarray(r) for r in roots], dim="time").sst.load()


def _windows(times: np.ndarray, listed: set[Any] = frozenset()) -> set[Any]:
    """Anchor times whose every step is one of ``times`` and none ``listed``."""
    have = set(times)
    return {
        t
        for t in times
        if all(t + d in have and t + d not in listed for ds in DELTAS.values() for d in ds)
    }


def _concat_pipe(roots: list[Path], **kw: Any) -> Any:
    coll = concat(roots, ["sst"])
    v = coll["sst"]
    views = {k: v.window(w) for k, w in WINDOWS.items()}
    return insitu_pipeline(coll, split_by_chunk(v, (1.0, 0.0, 0.0)), views, coords=["time"],
                           missing=[LISTED], batch_size=3, block_chunks=2, seed=5,
                           prefetch_depth=1, **kw)  # fmt: skip


def _check_rows(batch: Any, oracle: Any) -> list[Any]:
    """Assert every row of ``batch`` is ``oracle``'s at its times (each window's steps at its
    deltas from one anchor); the anchors' times."""
    anchors = []
    for label, d in DELTAS.items():
        times = np.asarray(batch.coords[label]["time"]).reshape(len(batch), len(d))
        values = np.asarray(batch[label]).reshape(len(batch), len(d), 2, 3)
        for row, x in zip(times, values, strict=True):
            np.testing.assert_array_equal(row - np.asarray(d), row[0] - d[0])  # one anchor
            np.testing.assert_array_equal(x, oracle.sel(time=row).values)
        if label == "x":
            anchors = [row[1] for row in times]
    return anchors


def _records(batches: list[Any]) -> list[dict[str, Any]]:
    """What must repeat bit for bit: each batch's position and, per label, a digest of its
    sample indices, members, times and values."""
    return [
        {
            "at": (b.epoch, b.index),
            **{
                label: [digest(b.sample_indices[label]), digest(b.members[label]),
                        digest(np.asarray(b.coords[label]["time"]).view("i8")), digest(b[label])]
                for label in sorted(b.arrays)
            },
        }
        for b in batches
    ]  # fmt: skip


def test_a_concat_of_stores_written_newest_first_resumes_with_the_uninterrupted_runs_batches(
    roots: list[Path], oracle: Any
) -> None:
    """Two uninterrupted epochs (7 batches each: 22 windows less the 3 that read the listed
    date), each row checked against ``xr.concat``; then a state after 2 batches, after the
    epoch's last (its loop not yet ended) and after 9, each restored in a fresh pipeline,
    delivers the rest of the two epochs as the uninterrupted run did."""
    times = oracle.time.values
    assert (np.diff(times) == -6 * HOUR).all() and len(times) == 24  # newest first overall
    want = _windows(times, {LISTED})
    assert len(want) == 22 - 3
    edges = [{HOURS[15], HOURS[16]}, {HOURS[7], HOURS[8]}]  # where the stores meet
    ref, epochs = [], []
    with _concat_pipe(roots) as pipe:
        loader = Loader(pipe)
        for _ in range(2):
            batches = list(loader)
            ref += _records(batches)
            got = [a for b in batches for a in _check_rows(b, oracle)]
            across = [
                r
                for b in batches
                for r in b.coords["x"]["time"]
                if any(e <= set(pd.DatetimeIndex(r)) for e in edges)
            ]
            assert sorted(got) == sorted(want) and across  # each window once; some across
            epochs.append([r["x"][0] for r in ref[-len(batches) :]])
    assert len(ref) == 14 and epochs[0] != epochs[1]  # (shuffled: each epoch its own order)
    assert_resumes_exactly(lambda: _concat_pipe(roots), _records, ref, (2, 7, 9))


def test_a_concat_of_stores_written_newest_first_cut_on_two_ranks_ends_on_three(
    roots: list[Path], oracle: Any
) -> None:
    """Two ranks deliver 2 batches each (12 windows); rank 0's state, restored on 3 ranks:
    the 7 windows left, less at most 2 that sit out (``"drop"``), once over the 3 ranks, in
    equal batch counts, each row ``xr.concat``'s."""
    want = _windows(oracle.time.values, {LISTED})
    before: list[Any] = []
    for rank in range(2):
        with _concat_pipe(roots, rank=rank, world_size=2) as pipe:
            loader = Loader(pipe)
            it = iter(loader)
            before += [a for _ in range(2) for a in _check_rows(next(it), oracle)]
            if rank == 0:
                state = loader.state_dict()
    after, counts = [], set()
    for rank in range(3):
        with _concat_pipe(roots, rank=rank, world_size=3) as pipe:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            batches = list(loader)
            assert {b.epoch for b in batches} <= {0}
            counts.add(len(batches))
            after += [a for b in batches for a in _check_rows(b, oracle)]
    seen = before + after
    assert len(before) == 12 and len(counts) == 1 and counts != {0}
    assert len(seen) == len(set(seen)), "a window was delivered twice"
    assert set(seen) <= want and len(want - set(seen)) <= 3 - 1


# -- 2. missing= on a join of stores written newest first -----------------------------------------


@pytest.mark.parametrize("given", ["dates", "indices"])
def test_a_missing_join_of_stores_written_newest_first_drops_the_windows_that_read_a_listed_step(
    tmp_path: Path, given: str
) -> None:
    """A concatenation of ``HOURS[9:18]`` and ``HOURS[0:9]`` joined with ``HOURS[3:18]``:
    15 shared times, newest first (xarray's inner alignment). ``missing=`` lists
    ``HOURS[12]`` and ``HOURS[7]`` (or their indices on the joined axis, 5 and -5): the
    windows left are those whose every step is a shared time not listed, from both pieces
    of the concatenation and across their edge, each row both stores' values at its time;
    ``dropped`` counts the 6 windows inside the axis that read a listed step. A state after
    the first batch, restored in a fresh pipeline, delivers the rest as the run did."""
    parts = [_store(tmp_path / f"a{lo}.zarr", lo, hi, 3) for lo, hi in ((9, 18), (0, 9))]
    other = _store(tmp_path / "f.zarr", 3, 18, 3)
    oa = xr.concat([open_with_xarray(p) for p in parts], dim="time").sst
    of = open_with_xarray(other).sst
    oa, of = (o.sortby("time", ascending=False) for o in xr.align(oa, of, join="inner"))
    times = oa.time.values
    assert len(times) == 15 and times[0] == HOURS[17]
    listed = {np.datetime64(HOURS[12], "ns"), np.datetime64(HOURS[7], "ns")}
    assert {times[5], times[-5]} == listed
    missing: list[Any] = sorted(listed) if given == "dates" else [5, -5]
    windows = {"a": ["-6h", "0h"], "f": ["6h"]}  # the step before (one on) and after (one back)
    have = set(times)
    inside = {t for t in times if t - 6 * HOUR in have and t + 6 * HOUR in have}
    reads = {t: {t - 6 * HOUR, t, t + 6 * HOUR} for t in inside}
    want = {t for t in inside if not reads[t] & listed}

    def build() -> Any:
        coll = Collection.join({"a": (concat(parts, ["sst"]), ["sst"]), "f": (other, ["sst"])},
                               dim="time")  # fmt: skip
        assert len(coll.members) == 2
        views = {k: coll[f"{k}/sst"].window(w) for k, w in windows.items()}
        manifest = split_by_chunk(coll["a/sst"], (1.0, 0.0, 0.0))
        return insitu_pipeline(coll, manifest, views, coords=["time"], batch_size=3,
                               missing=missing, prefetch_depth=1)  # fmt: skip

    got, pieces = [], set()
    with build() as pipe:
        assert pipe.stages.plan.dropped == {"nat": 0, "gap": 0, "missing": len(inside - want)}
        batches = list(Loader(pipe))
        for b in batches:
            for ta, xa, tf, xf in zip(b.coords["a"]["time"], b["a"], b.coords["f"]["time"],
                                      b["f"], strict=True):  # fmt: skip
                assert ta[1] - ta[0] == 6 * HOUR and tf[0] == ta[1] + 6 * HOUR
                np.testing.assert_array_equal(xa, oa.sel(time=ta).values)
                np.testing.assert_array_equal(xf, of.sel(time=tf).values)
                got.append(ta[1])
            pieces |= {tuple(m) for m in b.members["a"].tolist()}
        ref = _records(batches)
    assert sorted(got) == sorted(want) and len(want) == 13 - 6
    assert {(0, 0), (1, 0), (1, 1)} <= pieces  # each piece, and windows across the edge
    assert_resumes_exactly(build, _records, ref, (1,), epochs=1)  # (3 batches: 3, 3 and 1)


# -- 3. an evaluation epoch cut on three world sizes ---------------------------------------------

N_STEPS = 47  # 46 anchors (y reads one step on), in 12 chunks of 4


@pytest.fixture(scope="module")
def hops_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("concatresume") / "h.zarr"
    data = np.random.default_rng(1).random((N_STEPS, 2)).astype("f4")
    group = zarr.open_group(root, mode="w")
    group.create_array("t", data=data, chunks=(4, 2), dimension_names=("time", "lat"))
    return root, data


def _hops_pipe(store: Path, rank: int, world: int) -> Any:
    geom = open_geometries(store, ["t"])["t"]
    manifest = split_by_chunk(geom, (0.0, 0.0, 1.0))  # the test split: every chunk
    return insitu_pipeline(store, manifest, {"x": geom, "y": geom.shift(1)},
                           config=_hops_config(rank, world), prefetch_depth=1)  # fmt: skip


def _hops_config(rank: int, world: int) -> PlanConfig:
    return PlanConfig(split="test", remainder="uneven", batch_size=1, block_chunks=2, seed=3,
                      rank=rank, world_size=world)  # fmt: skip


def _hop(
    hops_store: tuple[Path, np.ndarray], state: Any, world: int, k: int | None
) -> tuple[list[int], list[Any], list[Any], list[int]]:
    """Every rank of ``world``, restored from ``state`` (a fresh pipeline each), delivers ``k``
    batches of epoch 0 (all it has when ``None``: then its loop ends), each row checked
    against zarr's. The anchors delivered, each rank's ``Loader`` state after its last batch
    and after its loop (``None`` where it did not end), and its batch count."""
    store, data = hops_store
    anchors: list[int] = []
    states, looped, counts = [], [], []
    for rank in range(world):
        with _hops_pipe(store, rank, world) as pipe:
            loader = Loader(pipe)
            if state is not None:
                loader.load_state_dict(state)
            it, n, last, over = iter(loader), 0, None, None
            while k is None or n < k:
                try:
                    b = next(it)
                except StopIteration:
                    over = loader.state_dict()
                    break
                assert b.epoch == 0
                idx = b.sample_indices["x"]
                np.testing.assert_array_equal(b["x"], data[idx])
                np.testing.assert_array_equal(b["y"], data[idx + 1])
                anchors += idx.tolist()
                last, n = loader.state_dict(), n + 1
            states.append(last)
            looped.append(over)
            counts.append(n)
    return anchors, states, looped, counts


def _sdl_rows(dataset: Any) -> list[list[int]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loop = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    return [b["sample_indices"]["x"].tolist() for b in loop]


def test_an_epoch_cut_on_three_ranks_then_two_then_ended_on_three_delivers_each_sample_once(
    hops_store: tuple[Path, np.ndarray],
) -> None:
    """3 ranks deliver 4 batches of 1 (12 samples), 2 ranks 6 more each (12), 3 ranks the
    22 left (8, 7 and 7): every one of the 46 samples once. Each end state (rank 0's after
    its 8th batch, rank 2's after its 7th: the epoch over where the saving rank's is; and
    rank 2's after its loop) carries both cuts and is read as the epoch's end by ranks of 3
    and of 2 (the first and the last of each): a restored ``Loader`` delivers epoch 1 as a
    fresh run of that size draws it; through ``as_dataset(epoch_fn=...)``, while the trainer
    stays in epoch 0, two ``iter()`` deliver nothing (told this rank's batches of the ended
    epoch first, epoch 1's after), then epoch 1 once when the trainer gets there."""
    store = hops_store[0]
    seen, s3, _, _ = _hop(hops_store, None, 3, 4)
    more, s2, _, _ = _hop(hops_store, s3[0], 2, 6)
    assert plan_state(s2[0])["resumed"] == [[3, 4]]
    rest, ends, looped, counts = _hop(hops_store, s2[0], 3, None)
    assert all(plan_state(e)["resumed"] == [[3, 4], [2, 10]] for e in ends + looped)
    seen += more + rest
    assert counts == [8, 7, 7]
    assert sorted(seen) == list(range(N_STEPS - 1)), "a sample twice, or never"
    geom = open_geometries(store, ["t"])["t"]
    manifest = split_by_chunk(geom, (0.0, 0.0, 1.0))
    trainer = [0]
    for saver, state in ((0, ends[0]), (2, ends[2]), (2, looped[2])):
        for world in (3, 2):
            for rank in (0, world - 1):
                node = ReadPlanNode(manifest, {"x": geom, "y": geom.shift(1)},
                                    config=_hops_config(rank, world))  # fmt: skip
                fresh = epoch_anchors(node, 1)
                with _hops_pipe(store, rank, world) as pipe:
                    assert pipe.stages.plan.resumed_epoch(state) == 1
                    loader = Loader(pipe)
                    loader.load_state_dict(state)
                    batches = list(loader)
                    assert {b.epoch for b in batches} == {1}, (saver, world, rank)
                    assert [b.sample_indices["x"].tolist() for b in batches] == fresh
                trainer[0] = 0
                with _hops_pipe(store, rank, world) as pipe:
                    data = as_dataset(pipe, transform=to_item, epoch_fn=lambda: trainer[0])
                    data.load_state_dict(state)
                    told = 10 + counts[saver]  # the saving rank's batches of the epoch
                    if world == 3:  # at most this rank's own (rank 0's state on a shorter rank)
                        told = min(told, 10 + counts[rank])
                    assert len(data) == told, (saver, world, rank)
                    assert [_sdl_rows(data) for _ in range(2)] == [[], []]
                    assert len(data) == len(fresh)
                    trainer[0] = 1
                    assert _sdl_rows(data) == fresh, (saver, world, rank)
