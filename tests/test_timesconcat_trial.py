"""Stores written newest first, concatenated or joined by time (the timesconcat trial of
2026-12-07).

Stores are written by xarray (``Dataset.to_zarr``, CF times), newest first (operational feeds
appended at the front are). Which anchors an epoch holds, each row's times and values are
worked out here with xarray (``xr.concat`` of the stores, ``xr.align`` of joined ones) and
numpy, never asked of the package's plan.

Found (fixed; each test failed before the fix):

- **``concat`` of stores written newest first was refused** ("the times of ... run backwards
  (newest first ...), and a concat lays its stores along increasing times"), though a single
  such store is read, its time checks counting back in time. Stores that all run newest first,
  listed newest first, now make one timeline running back in time: each store's earliest time
  one step after the next store's latest (``timeline.continuation`` on the times negated);
  windows in time deltas, a time stride and ``missing=`` dates count back in time as on one
  store, across the stores' edges. Gaps, overlaps (``overlap="first"`` keeps the store listed
  first) and stores listed out of order are handled and refused as for stores oldest first,
  the times in the messages in the stores' direction. Stores running in different directions
  are refused, naming one of each.
- **``join`` of stores written newest first was refused** likewise. Stores that all run newest
  first are now aligned from their latest shared time back (``timeline._shared``), a
  concatenation of such stores among them; stores in different directions are refused,
  naming one of each and how to sort them.
- **``concat`` and ``join`` refused monthly stores, oldest or newest first** ("not at one
  step": 31 days, then 29), though one such store is read with its months as steps. Where
  every store steps by one count of calendar months (``calendars.month_step``) the checks
  now count months (``timeline._in_months``): a window in samples pairs each month with its
  neighbour across the stores' edge, and a month left out between two stores is a gap naming
  the month that comes next.
- **A store whose times are all one time was an ``IndexError``** in ``concat``/``join``'s
  step check (``_refuse_irregular``); it is now refused as a repeated time.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import open_with_xarray, write_sst
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, split_by_chunk
from insitubatch_nodes.io.collection import Collection, concat

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(60)

HOUR = np.timedelta64(1, "h")
#: 6-hourly times from 2000-01-01T00
HOURS = pd.date_range("2000-01-01", periods=18, freq="6h")


def _store(root: Path, lo: int, hi: int, *, chunk: int = 3, newest_first: bool = True) -> Path:
    """``HOURS[lo:hi]`` written by xarray (newest first where asked), ``chunk`` steps an
    object, the values of store ``root`` its own (``write_sst``'s plus 1000 times ``lo``)."""
    times = HOURS[lo:hi][::-1] if newest_first else HOURS[lo:hi]
    write_sst(root, times, chunk=chunk)
    sst = zarr.open_array(root / "sst", mode="r+")
    sst[:] = np.asarray(sst[:]) + 1000 * lo
    return root


def _epoch(pipe: Any) -> list[Any]:
    with pipe:
        return list(Loader(pipe))


def _three(tmp_path: Path) -> list[Path]:
    """Three stores written newest first, listed newest first: ``HOURS[12:18]``,
    ``HOURS[6:12]``, ``HOURS[1:6]`` (the last one's partial chunk allowed)."""
    return [_store(tmp_path / f"s{lo}.zarr", lo, hi) for lo, hi in ((12, 18), (6, 12), (1, 6))]


@pytest.mark.parametrize(
    ("windows", "asked"),
    [
        ({"w": ["-6h", "0h"]}, {}),
        ({"w": ["-12h", "-6h", "0h"], "y": ["6h"]}, {"stride": "12h"}),
        ({"w": ["-6h", "0h"], "y": ["6h"]},
         {"missing": [np.datetime64("2000-01-03T00"), np.datetime64("2000-01-04T18")]}),
    ],
)  # fmt: skip
def test_a_concat_of_stores_written_newest_first_reads_the_windows_xarray_concat_gives(
    tmp_path: Path, windows: dict[str, list[str]], asked: dict[str, Any]
) -> None:
    """Before, refused ("a concat lays its stores along increasing times"). Now each row's
    steps are the times its window names in ``xr.concat`` of the stores, across their edges,
    and the anchors are every time whose steps are all there, on the stride and not listed."""
    roots = _three(tmp_path)
    oracle = xr.concat([open_with_xarray(r) for r in roots], dim="time")
    times = oracle.time.values
    assert (np.diff(times) == -6 * HOUR).all()  # (the stream: newest first overall)
    coll = concat(roots, ["sst"])
    v = coll["sst"]
    assert v.n_samples == len(times) == 17
    deltas = {k: [np.timedelta64(int(d[:-1]), "h") for d in w] for k, w in windows.items()}
    stride, listed = asked.get("stride"), set(asked.get("missing", ()))
    have = set(times)
    want = set()
    for t in times:
        on = stride is None or (t - np.datetime64("1970-01-01")) % (12 * HOUR) == 0 * HOUR
        steps = [t + d for ds in deltas.values() for d in ds] + [t]
        if on and all(u in have and u not in listed for u in steps):
            want.add(t)
    views = {k: v.window(w) for k, w in windows.items()}
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(coll, manifest, views, batch_size=4, coords=["time"], **asked)
    edges = [{HOURS[11], HOURS[12]}, {HOURS[5], HOURS[6]}]  # where the stores meet
    got, across = set(), 0
    for b in _epoch(pipe):
        for label, d in deltas.items():
            rows = np.asarray(b.coords[label]["time"]).reshape(len(b), -1)
            values = np.asarray(b[label]).reshape(len(b), len(d), 2, 3)
            for r, x in zip(rows, values, strict=True):
                anchor = r[0] - d[0]
                np.testing.assert_array_equal(r, [anchor + k for k in d])
                for step, xs in zip(r, x, strict=True):
                    np.testing.assert_array_equal(xs, oracle.sst.sel(time=step).values)
                across += any(e <= set(pd.DatetimeIndex(r)) for e in edges)
                got.add(anchor)
    assert got == want and len(want) >= 4
    assert across  # some windows run across a store's edge


@pytest.mark.parametrize("winner", ["first", "last"])
def test_overlapping_stores_written_newest_first_are_read_from_the_store_overlap_names(
    tmp_path: Path, winner: str
) -> None:
    """``newer`` holds ``HOURS[9:18]``, ``older`` ``HOURS[0:12]``: they share 3 times, one
    chunk of each (``newer``'s last, ``older``'s first). ``"first"`` keeps the store listed
    first (``newer``), ``"last"`` the other, as for stores oldest first."""
    newer = open_with_xarray(_store(tmp_path / "newer.zarr", 9, 18))
    older = open_with_xarray(_store(tmp_path / "older.zarr", 0, 12))
    kept = (
        [newer, older.isel(time=slice(3, None))]
        if winner == "first"
        else [newer.isel(time=slice(0, 6)), older]
    )
    oracle = xr.concat(kept, dim="time")
    coll = concat([tmp_path / "newer.zarr", tmp_path / "older.zarr"], ["sst"], overlap=winner)
    v = coll["sst"]
    assert v.n_samples == oracle.sizes["time"] == 18
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    batches = _epoch(insitu_pipeline(coll, manifest, {"x": v}, coords=["time"], batch_size=4))
    idx = np.concatenate([b.sample_indices["x"] for b in batches])
    assert sorted(idx.tolist()) == list(range(18))
    for b in batches:
        rows = b.sample_indices["x"]
        np.testing.assert_array_equal(b.coords["x"]["time"], oracle.time.values[rows])
        np.testing.assert_array_equal(np.asarray(b["x"]), oracle.sst.values[rows])


def test_stores_written_newest_first_that_do_not_continue_are_refused_naming_the_times(
    tmp_path: Path,
) -> None:
    """As for stores oldest first: an overlap without a winner, a gap (naming the time that
    comes next, back in time), stores listed out of order, an overlap cut inside a chunk;
    and stores running in different directions, naming one of each."""
    newer = _store(tmp_path / "newer.zarr", 12, 18)  # 2000-01-04T00 .. 2000-01-05T06
    touching = _store(tmp_path / "touching.zarr", 9, 14)  # overlaps newer's last 2
    gap = _store(tmp_path / "gap.zarr", 0, 11)  # 2000-01-01T00 .. 2000-01-03T12
    forward = _store(tmp_path / "forward.zarr", 6, 12, newest_first=False)
    with pytest.raises(
        ValueError,
        match=r"ends at 2000-01-04T00:00.* starts at 2000-01-04T06:00.*: they overlap "
        r".*overlap=.first",
    ):
        concat([newer, touching], ["sst"])
    with pytest.raises(
        ValueError,
        match=r"overlap from 2000-01-04T00:00.* to 2000-01-04T06:00.*overlap='first' would cut "
        r".*touching.zarr.* at its step 2",
    ):
        concat([newer, touching], ["sst"], overlap="first")
    with pytest.raises(
        ValueError,
        match=r"ends at 2000-01-04T00:00.* starts at 2000-01-03T12:00.*leave a gap "
        r"\(at the step of -21600 s, 2000-01-03T18:00:00.* comes next\)",
    ):
        concat([newer, gap], ["sst"])
    with pytest.raises(ValueError, match=r"newer.zarr' starts at 2000-01-05T06:00.*, after "
                                         r".*gap.zarr.*give the stores newest first"):  # fmt: skip
        concat([gap, newer], ["sst"])
    with pytest.raises(
        ValueError,
        match=r"concat: the times of .*forward.zarr' run forward \(oldest first\) and those of "
        r".*newer.zarr' backwards \(newest first\).*sortby\('time', ascending=False\)",
    ):
        concat([newer, forward], ["sst"])


def test_a_store_of_one_time_repeated_is_refused_as_a_repeated_time(tmp_path: Path) -> None:
    same = write_sst(tmp_path / "same.zarr", [HOURS[0]] * 3, chunk=3)
    with pytest.raises(ValueError, match=r"not at one step: .* \(index 1\).*a copy of index 0"):
        concat([same, _store(tmp_path / "b.zarr", 1, 4, newest_first=False)], ["sst"])


def _aligned(da: Any, db: Any) -> tuple[Any, Any]:
    """xarray's inner join of two stores' ``sst``, newest first."""
    a, b = xr.align(da.sst, db.sst, join="inner")
    return a.sortby("time", ascending=False), b.sortby("time", ascending=False)


def test_a_join_of_stores_written_newest_first_reads_both_at_the_times_xarray_aligns(
    tmp_path: Path,
) -> None:
    """``a`` holds ``HOURS[0:12]`` in chunks of 2, ``b`` ``HOURS[3:15]`` in chunks of 3: the
    latest shared time (``HOURS[11]``) is at a chunk boundary of both (index 0 of ``a``, 3 of
    ``b``), so the joined axis is xarray's inner alignment, newest first; a window in time
    deltas counts back in time. Before, refused as running backwards."""
    ra = _store(tmp_path / "a.zarr", 0, 12, chunk=2)
    rb = _store(tmp_path / "b.zarr", 3, 15)
    oa, ob = _aligned(open_with_xarray(ra), open_with_xarray(rb))
    times = oa.time.values
    coll = Collection.join({"a": (ra, ["sst"]), "b": (rb, ["sst"])}, dim="time")
    assert coll["a/sst"].n_samples == len(times) == 9
    views = {"a": coll["a/sst"].window(["-6h", "0h"]), "b": coll["b/sst"]}
    manifest = split_by_chunk(coll["a/sst"], (1.0, 0.0, 0.0))
    got = set()
    for bt in _epoch(insitu_pipeline(coll, manifest, views, coords=["time"], batch_size=4)):
        for r, xa, tb, xb in zip(bt.coords["a"]["time"], bt["a"], bt.coords["b"]["time"],
                                 bt["b"], strict=True):  # fmt: skip
            assert r[1] - r[0] == 6 * HOUR and r[1] == tb
            for step, xs in zip(r, xa, strict=True):
                np.testing.assert_array_equal(xs, oa.sel(time=step).values)
            np.testing.assert_array_equal(xb, ob.sel(time=tb).values)
            got.add(tb)
    assert got == set(times[:-1])  # every shared time with one before it


def test_a_join_takes_a_concatenation_of_stores_written_newest_first(tmp_path: Path) -> None:
    """The concatenation's stores meet at a chunk boundary of the other store's array: one
    piece per concatenated store, each row's values xarray's at its time."""
    parts = [_store(tmp_path / f"p{lo}.zarr", lo, hi) for lo, hi in ((12, 18), (6, 12))]
    other = _store(tmp_path / "other.zarr", 3, 18)  # chunks of 3: its index 0 and 6 are edges
    archive = concat(parts, ["sst"])
    coll = Collection.join({"a": (archive, ["sst"]), "f": (other, ["sst"])}, dim="time")
    assert len(coll.members) == 2
    oa = xr.concat([open_with_xarray(p) for p in parts], dim="time").sst
    ob = open_with_xarray(other).sst
    views = {"a": coll["a/sst"].window(["-6h", "0h"]), "f": coll["f/sst"]}
    manifest = split_by_chunk(coll["a/sst"], (1.0, 0.0, 0.0))
    rows = 0
    for b in _epoch(insitu_pipeline(coll, manifest, views, coords=["time"], batch_size=4)):
        for r, xa, tf, xf in zip(b.coords["a"]["time"], b["a"], b.coords["f"]["time"], b["f"],
                                 strict=True):  # fmt: skip
            assert r[1] - r[0] == 6 * HOUR and r[1] == tf
            np.testing.assert_array_equal(xa, oa.sel(time=r).values)
            np.testing.assert_array_equal(xf, ob.sel(time=tf).values)
            rows += 1
    assert rows == 11  # HOURS[7:18]: each of the 12 times with one before it


def test_a_join_of_stores_running_in_different_directions_is_refused_saying_how_to_sort(
    tmp_path: Path,
) -> None:
    back = _store(tmp_path / "back.zarr", 0, 12)
    ahead = _store(tmp_path / "ahead.zarr", 0, 12, newest_first=False)
    with pytest.raises(
        ValueError,
        match=r"join: the times of 'y' run forward \(oldest first\) and those of 'x' backwards "
        r"\(newest first\).*ds.sortby\('time'\), or ds.sortby\('time', ascending=False\)",
    ):
        Collection.join({"x": (back, ["sst"]), "y": (ahead, ["sst"])}, dim="time")


# ---------------------------------------------------------------------------------------------
# Monthly stores (months of 28 to 31 days: one step of a calendar month)
# ---------------------------------------------------------------------------------------------

MONTHS = pd.date_range("2000-01-01", periods=12, freq="MS")


def _monthly(root: Path, lo: int, hi: int, newest_first: bool) -> Path:
    times = MONTHS[lo:hi][::-1] if newest_first else MONTHS[lo:hi]
    return write_sst(root, times, chunk=3, units="days since 2000-01-01")


@pytest.mark.parametrize("newest_first", [True, False])
def test_monthly_stores_concatenated_pair_each_month_with_the_next_across_their_edge(
    tmp_path: Path, newest_first: bool
) -> None:
    """Before, ``concat`` refused monthly stores either way ("not at one step": 31 days, then
    29). Now a calendar month is one step, within a store and from one store to the next: a
    window of two samples pairs each month with its neighbour in ``xr.concat`` of the stores
    (the month before, newest first), across the stores' edge, and a month ``missing=`` lists
    drops the windows that read it; a month left out between two stores is refused, naming
    the month that comes next. A join of the two stores starts at the month they share."""
    parts = [(6, 12), (0, 6)] if newest_first else [(0, 6), (6, 12)]
    roots = [_monthly(tmp_path / f"m{lo}.zarr", lo, hi, newest_first) for lo, hi in parts]
    oracle = xr.concat([open_with_xarray(r) for r in roots], dim="time")
    times = oracle.time.values
    listed = np.datetime64("2000-03-01", "ns")
    coll = concat(roots, ["sst"])
    v = coll["sst"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(coll, manifest, {"w": v.window([0, 1])}, batch_size=4,
                           coords=["time"], missing=[listed])  # fmt: skip
    want = {p for p in itertools.pairwise(times) if listed not in p}
    got = set()
    for b in _epoch(pipe):
        for r, x in zip(b.coords["w"]["time"], b["w"], strict=True):
            np.testing.assert_array_equal(x, oracle.sst.sel(time=r).values)
            got.add(tuple(r))
    assert got == want and len(want) == 9
    assert (MONTHS[5], MONTHS[6]) in {tuple(sorted(p)) for p in got}  # across the edge
    gap = _monthly(tmp_path / "gap.zarr", 7, 12, newest_first)  # 2000-07 left out
    given = [gap, roots[1]] if newest_first else [roots[0], gap]
    step = -1 if newest_first else 1
    with pytest.raises(ValueError, match=rf"leave a gap \(at the step of {step} calendar "
                                         r"month\(s\), a date in 2000-07 comes next"):  # fmt: skip
        concat(given, ["sst"])
    whole = _monthly(tmp_path / "whole.zarr", 0, 12, newest_first)
    shared = xr.align(open_with_xarray(roots[0]), open_with_xarray(whole), join="inner")[0]
    joined = Collection.join({"a": (roots[0], ["sst"]), "b": (whole, ["sst"])})
    assert joined["a/sst"].n_samples == shared.sizes["time"] == 6
