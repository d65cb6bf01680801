"""A review of the package changes merged on 2026-12-07 (moments, coordlen, splitinfer,
budgetmem, laststep, suitetime2, gcexact: ``git diff ca61f28 9aa505c -- insitubatch_nodes``),
the review2 trial. numpy, zarr, pandas and xarray are the oracles.

Found (fixed; each test failed before its fix):

- **Float32 differences with a NaN in the batch were formed in float64.** ``add_difference``
  forms float32 data's one-step differences in float32 (its docstring; ``statistics``'), but a
  batch holding a NaN went to the masked moments with ``np.subtract(..., dtype=float64)``: the
  same pairs gave another ``diff_std`` (4.8e-8 relative) depending on whether a NaN was
  elsewhere in the batch. One rule now, ``_moments._difference_dtype``, for both paths:
  ``test_float32_differences_with_a_nan_are_formed_in_float32_as_without_one``.
- **The explicit budget's memory check refused budgets for decode scratch never taken.** It
  added one stored object per decode thread and *every* array, though whole chunks decode
  straight into their slots (``decode_scratch_bytes`` stays 0 over an epoch): ARCO-ERA5's
  whole 37-level chunks (154 MB) at 16 threads and 6 such arrays make a 14.8 GB allowance
  (computed).
  Only arrays that ``ChunkDecoder.decodes_in_place`` does not vouch for count now (edge
  chunks, shards, filters, other dtypes or order, a slot of part of a chunk, one-sample chunks
  holding part of each field): ``test_an_explicit_budget_is_not_refused_for_decode_scratch_``
  ``that_whole_chunks_never_take``; the predicate never says "in place" for an array that took
  scratch (a first version did, for a microscopy store's one-sample chunks decoded strided
  into the batch row): ``test_an_array_said_to_decode_in_place_takes_no_decode_scratch``.
- **The automatic budget with a ``cache_dir`` was refused for RAM its slots do not take.**
  Its slots are the cache's files (``SpillBacking``); the explicit budget's check skips such
  slots, the automatic budget's compared its floor with RAM all the same: at a memory of the
  batches plus half the floor the automatic budget was refused, an explicit one of four times
  the floor built, with the same ``cache_dir``. Both now ask only of slots in RAM
  (``stages/fetch.py``):
  ``test_the_automatic_budget_with_a_cache_dir_is_not_refused_for_ram_its_slots_do_not_take``.
- **A repeated time whose first copy's object is absent was lost.** Under ``missing=()`` and
  ``missing_objects="drop"`` the first copy was dropped (absent) and the stored later copy as
  a copy: that time was in no epoch, where listing the first copy in ``missing=`` reads the
  later one. An unreadable copy (listed, or with an absent object) is now no copy
  (``SampleSteps.repeated``):
  ``test_a_repeated_time_whose_first_copy_is_absent_is_read_from_its_stored_copy``.

Tried and found right: ``_Moments._sums``' blocks cut along values, channels and rows
(``BLOCK`` 5, 64, default) for float32/float64/int16/uint8/float16 data near and far (1e4)
from zero, ``add`` and ``add_difference``, against numpy (rtol 1e-9); ``direct=True`` at 4
samples per chunk under the automatic budget (which now keeps nothing) delivers every sample
once per shuffled epoch, zarr's values, with evictions; ``diff_std`` under the new ``b > a``
rule equals numpy's over consecutive anchors 6 h apart around a repeated time, a NaT and a
12 h jump, with and without ``missing=()``; a pipeline built before a group reads its split in
a group of one and is refused in a group of two (``check_still_alone``); ``fit_statistics``
builds with ``world_size=1``, so no refusal inside DDP (read). Outside this file (scripts):
``forcing_calendar``'s ``"calendar"`` and ``"graphcast"`` year and day progress equal Python's
``datetime`` arithmetic and GraphCast's ``data_utils`` formulas at 1600, 1969, 2000 and 2300
``datetime64[s]`` times (1e-12), NaT -> NaN; a state saved before the repeated-time rule
(coordlen) would be refused at resume, not resumed into other anchors: states carry the plan's
anchors digest (``read_plan``'s ``"anchors"``); a window ``[-1, 0]`` under ``missing=()`` on
two repeated times, shuffled, resumed after 1 and 3 batches, delivers the uninterrupted run's
rows to its epoch's end and the next epoch's.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from torchdata.nodes import Loader

from insitubatch_nodes import _moments, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan import memory_floor, ranks
from insitubatch_nodes.plan.schedule import working_set_bytes
from insitubatch_nodes.stack import stack
from insitubatch_nodes.stages import buffers
from insitubatch_nodes.statistics import fit_statistics
from tests.helpers import Oracle, View, run_epoch, write_era5, write_microscopy

pytestmark = pytest.mark.timeout(60)


def _moments_of(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """numpy's per-channel mean and std (ddof=0, NaNs skipped) of ``(rows, channels, values)``
    parts, in float64."""
    x = np.concatenate([np.asarray(p, np.float64) for p in parts])
    return np.nanmean(x, axis=(0, 2)), np.nanstd(x, axis=(0, 2))


@pytest.mark.parametrize("block", [_moments.BLOCK, 5, 64])
@pytest.mark.parametrize("dtype", ["f4", "f8", "i2", "u1", "f2"])
def test_block_sums_equal_numpy_at_any_block_size_dtype_and_distance_from_zero(
    monkeypatch: pytest.MonkeyPatch, block: int, dtype: str
) -> None:
    """``_Moments._sums`` walks (rows, channels, values) in blocks; blocks cut along each axis
    (BLOCK 5: values split; 64: channels split; the default: rows whole), float, integer and
    half data, near zero and far from it (the reference fallback), and ``add_difference`` in
    float32 for float32 data, float64 otherwise, all equal numpy's moments."""
    monkeypatch.setattr(_moments, "BLOCK", block)
    rng = np.random.default_rng(1)
    for shape in [(3, 4, 5), (5, 3, 17), (2, 7, 3), (9, 2, 1)]:
        for offset in (0.0, 1e4):
            parts = [(rng.normal(size=shape) * 3 + offset).astype(dtype) for _ in range(3)]
            m = _moments._Moments()
            for p in parts:
                m.add(p)
            got = m.result((shape[1],))
            mean, std = _moments_of(parts)
            np.testing.assert_allclose(got["mean"], mean, rtol=1e-9)
            np.testing.assert_allclose(got["std"], std, rtol=1e-7)
            wide = "f4" if dtype == "f4" else "f8"
            diffs = [np.subtract(b, a, dtype=wide) for a, b in itertools.pairwise(parts)]
            m = _moments._Moments()
            for a, b in itertools.pairwise(parts):
                m.add_difference(b, a)
            got = m.result((shape[1],))
            mean, std = _moments_of(diffs)
            np.testing.assert_allclose(got["mean"], mean, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(got["std"], std, rtol=1e-9)


def test_float32_differences_with_a_nan_are_formed_in_float32_as_without_one() -> None:
    """``add_difference`` forms float32 data's differences in float32 (its docstring, and
    ``statistics``' module docstring), but a batch holding a NaN went to the masked moments
    with differences formed in float64: the same pairs gave other ``diff_std`` (1e-8 apart)
    depending on whether a NaN was elsewhere in the batch."""
    rng = np.random.default_rng(2)
    a = (rng.normal(size=(4, 3, 7)) * 3 + 0.1).astype("f4")
    b = (rng.normal(size=(4, 3, 7)) * 3 + 0.1).astype("f4")
    b[0, 0, 0] = np.nan
    m = _moments._Moments()
    m.add_difference(b, a)
    got = m.result((3,))
    mean, std = _moments_of([b - a])  # float32 differences, as without a NaN
    np.testing.assert_allclose(got["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(got["std"], std, rtol=1e-12)
    assert got["nan"].tolist() == [1.0, 0.0, 0.0]


def test_direct_true_at_several_samples_per_chunk_delivers_each_sample_once_with_evictions(
    tmp_path: Path,
) -> None:
    """``direct=True`` now keeps nothing at any samples per chunk (``_admit.epoch_floor``): the
    automatic budget holds one epoch's working set, so chunks are evicted and read again each
    epoch; every shuffled epoch still delivers each sample of the split exactly once, each
    row zarr's."""
    root = write_era5(tmp_path / "e.zarr", n_time=64, samples_per_chunk=4)
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"x": g["t2m"], "y": g["z"].shift(1)}
    pipe = insitu_pipeline(
        root, manifest, views, batch_size=5, block_chunks=2, coords=(),
        fetch=FetchOptions(direct=True, decode_threads=2),
    )  # fmt: skip
    oracle = Oracle(root)
    want_views = {"x": View("t2m"), "y": View("z", 0, 1)}
    try:
        loader = Loader(pipe)
        for _epoch in range(3):
            records = run_epoch(loader, oracle, want_views)
            got = np.concatenate([r["sample_indices"]["x"] for r in records])
            assert sorted(got.tolist()) == list(range(63))
        report = pipe.report()
        assert report.evictions > 0
    finally:
        pipe.close()


def _fake_memory(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The process may use ``nbytes`` (nothing is allocated: the checks ask this function)."""
    monkeypatch.setattr(memory_floor, "usable_memory_bytes", lambda: nbytes)
    monkeypatch.setattr(buffers, "usable_memory_bytes", lambda: nbytes)


def test_an_explicit_budget_is_not_refused_for_decode_scratch_that_whole_chunks_never_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explicit budget's memory check added a decode-scratch allowance of one stored object
    per decode thread and array, for every array, though whole chunks decode straight into
    their slots and take none (``decode_scratch_bytes`` stays 0 over an epoch): a budget the
    machine holds beside the batches was refused (ARCO-ERA5's whole 37-level chunks, 154 MB
    each, at 16 threads and 6 such arrays: a 14.8 GB allowance, computed, of scratch never
    taken). Now only arrays whose objects may be decoded aside count (an edge chunk: still
    refused)."""
    for n_time, edge in ((64, False), (60, True)):
        root = write_era5(tmp_path / f"e{n_time}.zarr", n_time=n_time, samples_per_chunk=8)
        g = open_geometries(root, ["t2m", "z"])
        manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
        views = {"x": g["t2m"], "y": g["z"]}
        split = sum(v.chunk_nbytes * v.n_chunks for v in g.values())
        allowance = memory_floor.decode_scratch_bytes(g, 4)
        options = {"batch_size": 4, "coords": (), "decode_threads": 4, "block_chunks": 2}
        # measured on the machine's memory (the last round's is 1 byte short of the split
        # beside the scratch: the automatic budget of edge chunks is refused there too, by the
        # one rule both budgets are held to since tests/test_memcheck_trial.py)
        monkeypatch.undo()
        with insitu_pipeline(root, manifest, views, **options) as pipe:
            in_flight = 4 * pipe.context.buffers.batch_nbytes  # prefetch_depth 2: 4 batches
        _fake_memory(monkeypatch, split + in_flight + allowance - 1)
        if edge:
            with pytest.raises(ValueError, match=r"cannot be held here.*decode scratch"):
                insitu_pipeline(root, manifest, views, cache_budget_bytes=split, **options)
            continue
        pipe = insitu_pipeline(root, manifest, views, cache_budget_bytes=split, **options)
        with pipe:
            assert sum(len(b["x"]) for b in Loader(pipe)) == n_time
            assert pipe.stats()["decode_scratch_bytes"] == 0


def test_a_repeated_time_whose_first_copy_is_absent_is_read_from_its_stored_copy(
    tmp_path: Path,
) -> None:
    """Under ``missing=()`` a later copy of a time counts as absent (``SampleSteps.repeated``),
    and a copy listed in ``missing=`` is none, so listing the older copy reads the newer. But
    where the older copy's stored object is absent (``missing_objects="drop"``), the newer copy
    was dropped too: 12:00 of that day was in no epoch though it is stored. Now a copy that
    cannot be read (listed, or an absent object) is no copy: the first readable one is the
    time's, as pandas' ``duplicated()`` of the readable samples says."""
    t = list(pd.date_range("2020-01-01", periods=8, freq="6h"))
    t.insert(3, t[2])  # sample 3 holds sample 2's time
    times = pd.DatetimeIndex(t)
    n = len(times)
    ds = xr.Dataset(
        {"sst": (("time", "lat"), np.arange(n * 2, dtype="f4").reshape(n, 2))},
        coords={"time": times, "lat": [0.0, 1.0]},
    )
    root = tmp_path / "r.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False, encoding={
            "sst": {"chunks": (1, 2)},
            "time": {"units": "hours since 2000-01-01", "dtype": "int64"},
        })  # fmt: skip
    (root / "sst" / "c" / "2" / "0").unlink()  # the first copy's object is gone
    readable = np.ones(n, bool)
    readable[2] = False
    first = ~pd.Series(times[readable]).duplicated().to_numpy()
    want_x = np.flatnonzero(readable)[first].tolist()
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    six = np.timedelta64(6, "h")
    tt = times.to_numpy()
    for views, want in (
        ({"x": g}, want_x),
        ({"x": g, "y": g.shift(1)},  # each step a + 1 readable, one step on in time
         [a for a in want_x if a + 1 in want_x and tt[a + 1] == tt[a] + six]),
    ):  # fmt: skip
        pipe = insitu_pipeline(
            root, manifest, views, batch_size=2, missing=(), missing_objects="drop",
            shuffle=False,
        )  # fmt: skip
        try:
            got: list[int] = []
            for batch in Loader(pipe):
                got += np.asarray(batch.sample_indices["x"]).tolist()
                np.testing.assert_array_equal(batch["x"], ds.sst.values[batch.sample_indices["x"]])
            assert got == want, list(views)
            assert len(set(tt[got])) == len(got)
        finally:
            pipe.close()


def test_a_pipeline_built_before_a_group_of_one_rank_reads_its_split_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check_still_alone`` refuses a pipeline built before the group (``world_size=None``)
    only where the group has several ranks: built before a group of one it reads the whole
    split, every epoch, as it would have anyway; in a group of two (faked: the check asks
    ``default_rank_world``) it is refused at the epoch's start, saying what to pass."""
    root = write_era5(tmp_path / "e.zarr", n_time=16, samples_per_chunk=4)
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": g["t2m"]}, batch_size=4, coords=())
    try:
        monkeypatch.setattr(ranks, "default_rank_world", lambda: (0, 1))  # a group of one
        for _ in range(2):
            assert sorted(i for b in Loader(pipe) for i in b.sample_indices["x"]) == list(range(16))
        monkeypatch.setattr(ranks, "default_rank_world", lambda: (1, 2))
        with pytest.raises(RuntimeError, match=r"rank 1 of 2.*pass rank and world_size"):
            next(iter(Loader(pipe)))
    finally:
        pipe.close()


def test_an_array_said_to_decode_in_place_takes_no_decode_scratch(tmp_path: Path) -> None:
    """``ChunkDecoder.decodes_in_place`` (what the explicit budget's memory check leaves out of
    the scratch allowance) is never wrong the other way: over plain views, shifts, windows, a
    stack, chunks of one and of eight samples, zarr v2 and a microscopy store whose one-sample
    chunks hold part of each field (rows decoded straight into the batch: strided, so decoded
    aside), no array said to decode in place took scratch over an epoch."""
    e8 = write_era5(tmp_path / "e8.zarr", n_time=32, samples_per_chunk=8)
    e1 = write_era5(tmp_path / "e1.zarr", n_time=8, samples_per_chunk=1)
    v2 = write_era5(tmp_path / "v2.zarr", n_time=32, samples_per_chunk=8, zarr_format=2)
    micro = write_microscopy(tmp_path / "m.zarr")
    cases: list[tuple[Path, dict[str, Any], str]] = []
    for root in (e8, e1, v2):
        g = open_geometries(root)
        cases += [
            (root, {"x": g["t2m"], "y": g["z"].shift(1)}, "t2m"),
            (root, {"x": g["t2m"].window([-1, 0])}, "t2m"),
            (root, {"s": stack([g["t2m"], g["z"]])}, "t2m"),
        ]
    cases.append((micro, dict(open_geometries(micro)), "image"))
    said = 0
    for root, views, anchor in cases:
        manifest = split_by_chunk(open_geometries(root)[anchor], (1.0, 0.0, 0.0))
        with insitu_pipeline(root, manifest, views, batch_size=4, coords=(),
                             decode_threads=2) as pipe:  # fmt: skip
            for _ in Loader(pipe):
                pass
            fetch = pipe.stages.fetch
            for path, decoder in fetch._decoders.items():
                g = fetch.geoms[path]
                if decoder.decodes_in_place(g, fetch.slot_geoms.get(path, g)):
                    said += 1
                    assert decoder.scratch_bytes == 0, (root.name, list(views), path)
    assert said >= 9  # (t2m of every era5 case)


@pytest.mark.parametrize("missing", [(), None])
def test_diff_std_pairs_consecutive_anchors_one_data_step_apart_in_time(
    tmp_path: Path, missing: Any
) -> None:
    """``_one_step``'s rule changed from ``b - a == k`` to ``b > a`` (and one data step in
    time): over 6-hourly times with a repeated time, a NaT and a jump of 12 h, ``diff_std`` is
    numpy's over consecutive anchors (the plan's with ``missing=()``: no copy, no NaT; every
    sample without) whose times are 6 h apart, and ``mean`` numpy's over those anchors."""
    t = list(pd.date_range("2020-01-01", periods=20, freq="6h").to_numpy())
    t.insert(5, t[4])
    t[9] = np.datetime64("NaT")
    t = t[:14] + [v + np.timedelta64(6, "h") for v in t[14:]]
    times = np.array(t, "datetime64[ns]")
    n = len(times)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, 2, 3)) + np.arange(n)[:, None, None] ** 1.3).astype("f4")
    ds = xr.Dataset(
        {"sst": (("time", "lat", "lon"), x)},
        coords={"time": times, "lat": [0.0, 1.0], "lon": [0.0, 1.0, 2.0]},
    )
    root = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False, encoding={
            "sst": {"chunks": (4, 2, 3)},
            "time": {"units": "hours since 2000-01-01", "dtype": "int64", "_FillValue": -999},
        })  # fmt: skip
    g = open_geometries(root)["sst"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (without the checks: the repeated-time warning)
        stats = fit_statistics(root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"sst": g},
                               missing=missing)  # fmt: skip
    nat = np.isnat(times)
    copy = np.array([bool((times[i] == times[:i]).any()) for i in range(n)])
    keep = np.flatnonzero(~nat & ~copy) if missing == () else np.arange(n)
    a, b = keep[:-1], keep[1:]
    one = ~nat[a] & ~nat[b] & (times[b] - times[a] == np.timedelta64(6, "h"))
    d = x[b[one]].astype(np.float64) - x[a[one]]
    assert one.sum() == 16
    np.testing.assert_allclose(stats.diff_std["sst"], d.std(), rtol=1e-9)
    np.testing.assert_allclose(stats.mean["sst"], x[keep].astype(np.float64).mean(), rtol=1e-12)


def test_the_automatic_budget_with_a_cache_dir_is_not_refused_for_ram_its_slots_do_not_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a ``cache_dir`` the pool's slots are files on its disk (``SpillBacking``): the
    explicit budget's memory check skips them, but the automatic budget's compared its floor
    with RAM all the same, so a pipeline with ``cache_dir`` and an explicit budget of four
    times the floor was built where the automatic one was refused. Now both ask the memory
    only of slots in RAM; without a ``cache_dir`` the automatic budget is still refused."""
    root = write_era5(tmp_path / "e.zarr", n_time=64, samples_per_chunk=8)
    g = open_geometries(root, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"x": g["t2m"], "y": g["z"]}
    options = {"batch_size": 4, "coords": (), "decode_threads": 2, "block_chunks": 2}
    with insitu_pipeline(root, manifest, views, **options) as pipe:
        floor = pipe.stages.fetch._first_floor
        in_flight = 4 * pipe.context.buffers.batch_nbytes
        # (the epoch's own floor: the automatic budget keeps the split only where the memory
        # rule passes, and runs at this floor otherwise, since tests/test_memcheck_trial.py)
        least = working_set_bytes(pipe.stages.plan.epoch_plan(0), pipe.context.slot_geoms)[0]
    _fake_memory(monkeypatch, in_flight + least // 2)
    with pytest.raises(ValueError, match="automatic budget cannot hold this pipeline"):
        insitu_pipeline(root, manifest, views, **options)
    explicit = {"cache_budget_bytes": 4 * floor, **options}
    with insitu_pipeline(root, manifest, views, cache_dir=tmp_path / "a", **explicit):
        pass
    with insitu_pipeline(root, manifest, views, cache_dir=tmp_path / "b", **options) as pipe:
        assert pipe.stages.pool.backing.name == "spill"
        assert sum(len(b["x"]) for b in Loader(pipe)) == 64
