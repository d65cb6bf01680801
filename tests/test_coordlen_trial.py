"""Time coordinates that do not fit their data: another length, duplicated, unsorted or
missing times, CF integer times in calendars (the coordlen trial of 2026-12-07).

The stores are written by xarray (``Dataset.to_zarr``; CF times in a calendar) or by hand with
zarr; which anchors an epoch holds, each row's time and value and the statistics are worked
out here with xarray, pandas and numpy, never asked of the package's plan.

Found (fixed; each test failed before the fix):

- **A dimension coordinate of another length than the data was left out of ``batch.coords``
  without a word.** A store read mid-append (the time coordinate resized before or after the
  data) built a pipeline whose batches carried no ``time``; a ``Forcings`` transform then
  failed at the first batch with a ``KeyError`` telling to build with ``coords=None`` — the
  default, as built. Now the build refuses it (``CoordinateLengthError``, a ``ValueError``)
  naming the coordinate, both lengths and the dimension, saying what to do, as the anchor
  checks already did where the times are read; ``concat`` said such a store "has no time
  coordinate", and now names it and both lengths.
- **A repeated time was read twice where the times are checked.** Two samples with one time
  (an append that overlapped by a step; a step re-sent later, out of place) under ``missing=()``
  or a time stride: an anchor-only view took both copies (the time twice in an epoch), a window
  ``[-1, 0]`` read the later copy as the step before the next time, and ``fit_statistics(...,
  missing=())`` counted both in ``mean``/``std``/``count``. Decided: a time is one time — its
  first sample is that time's and each later copy counts as absent (a ``"gap"``, for every
  offset, the anchor's own included), as pandas' ``duplicated()`` marks them (a copy listed
  in ``missing=`` is none: listing the older keeps the newer); refusing the store
  would have thrown away a training run for one overlapping append that the checks can skip,
  and keeping the first matches xarray's ``drop_duplicates`` default. ``diff_std`` now pairs
  the samples either side of a dropped copy (one step apart in time; it required them to be
  one *sample* apart). Without the checks every copy is read by index, as asked, and
  ``insitu_pipeline`` (from the times its batches carry) and ``fit_statistics`` say so in a
  warning naming the first repeated sample and ``missing=()``.
- **``fit_statistics`` differenced across gaps of times that run backwards.** Newest first
  (an archive written backwards), one step absent: the fit found no step forward in time, so
  ``diff_std`` paired every two consecutive samples, the two either side of the gap included
  (1.62 where numpy gives 1.39 over the one-step pairs), monthly means too. Now the fit counts
  such times backwards (``anchor_steps.forward_ticks``): a step back in time is one step.

Tried and found right (no change needed): int CF times (``hours``, ``minutes`` with a UTC
offset in the reference, float ``days``) in the ``standard``, ``proleptic_gregorian``,
``noleap``, ``all_leap``, ``360_day`` and ``julian`` calendars across the end of February, with
one step absent, one written twice and one missing (``_FillValue``): for ``{"x"}``,
``shift(1)``, ``window([-1, 0])`` and ``window(["-6h", "0h"])``, stride 1 and ``"12h"``,
``missing=()`` and a listed date, the anchors equal cftime's (128 combinations outside this
file, three kept here), every row's time is cftime's and its values zarr's; a date a calendar
lacks (``2000-02-29`` in ``noleap``) in ``missing=`` is refused naming the calendar; a
``Forcings`` row of a missing time is NaN, and the solar forcings of cftime dates are refused
at the build; ``fit_statistics`` skips the differences either side of a missing time in every
calendar (numpy's ``diff_std``); times that run backwards are refused where they are checked
(a time stride, ``missing=``); independent members of a collection may share times (each its
own timeline: none is a copy of another's); a value window (``split_by_chunk(coord=...)``) on
decreasing times takes the right samples.

Left as they were then, and taken up by ``tests/test_timeedges_trial.py``: ``split_by_chunk``
splitting times that run backwards in sample order (``train`` the newest chunks: now
``coord=`` splits in time order, and the build warns); a collection member whose times repeat
refused as "steps from T to T" (now its later copy is a gap, as in a single store); the
build's repeated-times warning looking at ``datetime64`` times only (now cftime dates too).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.collection import concat
from insitubatch_nodes.statistics import fit_statistics

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")
pytest.importorskip("cftime")

pytestmark = pytest.mark.timeout(60)

LAT, LON = [10.0, 20.0], [0.0, 1.0, 2.0]


def _write(
    root: Path,
    times: Any,
    *,
    chunk: int = 4,
    encoding: dict[str, Any] | None = None,
    trend: Any = None,
) -> Path:
    """``sst (time, lat, lon)`` float32 at ``times`` (each step's values: its ``trend``, by
    default its index, plus noise), ``chunk`` steps per stored object; ``encoding`` of the
    time coordinate."""
    n = len(times)
    rng = np.random.default_rng(0)
    level = np.arange(n) if trend is None else np.asarray(trend)
    data = (rng.standard_normal((n, 2, 3)) + level[:, None, None]).astype("f4")
    ds = xr.Dataset(
        {"sst": (("time", "lat", "lon"), data)},
        coords={"time": times, "lat": LAT, "lon": LON},
    )
    tenc = {"units": "hours since 2000-01-01", "dtype": "int64"} if encoding is None else encoding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"sst": {"chunks": (chunk, 2, 3)}, "time": tenc})  # fmt: skip
    return root


def _six_hourly(n: int) -> Any:
    return pd.date_range("2020-01-01", periods=n, freq="6h")


@pytest.fixture(params=[-3, 2], ids=["shorter", "longer"])
def torn(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A store read mid-append: its time coordinate 3 shorter or 2 longer than the data (12)."""
    root = _write(tmp_path / "torn.zarr", _six_hourly(12))
    coord = zarr.open_array(root / "time", mode="a")
    last = int(coord[-1])
    coord.resize((12 + request.param,))
    if request.param > 0:
        coord[12:] = last + 6 * np.arange(1, request.param + 1)
    return root


def test_a_dimension_coordinate_of_another_length_is_refused_for_batch_coords_naming_both(
    torn: Path,
) -> None:
    g = open_geometries(torn)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    length = zarr.open_array(torn / "time").shape[0]
    said = rf"'time' has {length} values but 'sst' has 12 samples along 'time'.*coords=\(\)"
    with pytest.raises(ValueError, match=said) as refused:
        insitu_pipeline(torn, manifest, {"x": g}, batch_size=4)
    assert type(refused.value).__name__ == "CoordinateLengthError"  # (errors.py; a ValueError)
    # a Forcings view needs the times: refused at the build, not at the first batch
    forcings = Forcings("x", names=["year_progress_sin"], lat=LAT, lon=LON)
    with pytest.raises(ValueError, match=said):
        insitu_pipeline(torn, manifest, {"x": g}, batch_size=4, batch_transforms=[forcings])
    # the anchor checks say so too, where the batches carry no coordinate
    with pytest.raises(ValueError, match=r"times of 'sst' cannot be read: coordinate 'time'"):
        insitu_pipeline(torn, manifest, {"x": g, "y": g.shift(1)}, missing=(), coords=())
    # coords=() carries none, as asked: every sample read, by index
    pipe = insitu_pipeline(torn, manifest, {"x": g}, batch_size=4, coords=())
    try:
        rows = [b.coords for b in Loader(pipe)]
        assert len(rows) == 3 and all(c == {} for c in rows)
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def repeated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """6-hourly times with 2020-01-02T00 written twice (an append that overlapped by one
    step), and 2020-01-02T18 twice further on, out of place (a step re-sent later)."""
    t = list(_six_hourly(14))
    t.insert(5, t[4])
    t.insert(11, t[7])
    times = pd.DatetimeIndex(t)
    return _write(tmp_path_factory.mktemp("repeated") / "r.zarr", times), times


def _anchors(pipe: Any, label: str = "x") -> list[int]:
    """Each row's anchor (a window's last step), in the order delivered."""
    out: list[int] = []
    for batch in Loader(pipe):
        idx = np.asarray(batch.sample_indices[label])
        out += (idx[:, -1] if idx.ndim > 1 else idx).tolist()
    return out


@pytest.mark.parametrize("stride", [1, "12h"])
def test_a_repeated_time_is_one_time_where_the_times_are_checked(
    repeated: tuple[Path, Any], stride: Any
) -> None:
    """A later copy of a time (pandas' ``duplicated()``) is neither an anchor nor a step of
    one: an anchor-only view took both copies (the time twice in an epoch), a time stride
    too, and ``window([-1, 0])`` read the second copy as the step before the next time."""
    root, times = repeated
    copy = np.asarray(times.duplicated())
    assert copy.sum() == 2
    six = np.timedelta64(6, "h")
    t = times.to_numpy()
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    for views, offsets in (
        ({"x": g}, [0]),
        ({"x": g, "y": g.shift(1)}, [0, 1]),
        ({"x": g.window([-1, 0])}, [-1, 0]),
    ):
        on = [a for a in range(len(t)) if stride == 1
              or (t[a] - np.datetime64("1970-01-01")) % (2 * six) == np.timedelta64(0)]  # fmt: skip
        want = [a for a in on
                if all(0 <= a + k < len(t) and not copy[a + k] and t[a + k] == t[a] + k * six
                       for k in offsets)]  # fmt: skip
        pipe = insitu_pipeline(root, manifest, views, batch_size=4, missing=(), stride=stride)
        try:
            got = _anchors(pipe)
            assert sorted(got) == want, views
            assert len(set(t[got])) == len(got)  # each time once
            assert pipe.report().batches == len(pipe) == -(-len(want) // 4)
            inside = [a for a in on if all(0 <= a + k < len(t) for k in offsets)]
            assert sum(pipe.report().dropped.values()) == len(inside) - len(want)
        finally:
            pipe.close()
    # missing= picks the copy: the first one listed, the later one is that time's
    pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=4, missing=[4], stride=stride)
    try:
        got = _anchors(pipe)
        assert 5 in got and 4 not in got and len(set(t[got])) == len(got)
    finally:
        pipe.close()


def test_a_pipeline_that_checks_no_time_says_where_the_times_repeat(
    repeated: tuple[Path, Any],
) -> None:
    """Without the checks every copy is an anchor, by index, as asked; it was said nowhere.
    The times the batches carry were read anyway: no read is added for it."""
    root, times = repeated
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    said = r"insitu_pipeline: the times of 'time' repeat \(sample 5 .* as sample 4 does; 2 "
    with pytest.warns(UserWarning, match=said):
        pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=4)
    try:
        assert sorted(_anchors(pipe)) == list(range(len(times)))
    finally:
        pipe.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked (missing=()), or no time read (coords=())
        insitu_pipeline(root, manifest, {"x": g}, missing=()).close()
        insitu_pipeline(root, manifest, {"x": g}, coords=()).close()


def test_fit_statistics_count_a_repeated_time_once_with_the_time_checks_and_warn_without(
    repeated: tuple[Path, Any],
) -> None:
    """With ``missing=()`` (the time checks) the fit took both copies of a time; without, it
    takes them as the pipeline reads them, and now says so. A difference across a dropped
    copy is one step in time: it counts."""
    root, times = repeated
    keep = ~np.asarray(times.duplicated())
    with xr.open_zarr(root, consolidated=False) as ds:
        x = ds.sst.values.astype(np.float64)
    t = times.to_numpy()[keep]
    one = np.flatnonzero(np.diff(t) == np.timedelta64(6, "h"))
    assert len(one) == keep.sum() - 1
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    stats = fit_statistics(root, manifest, {"sst": g}, missing=())
    np.testing.assert_allclose(stats.mean["sst"], x[keep].mean(), rtol=1e-12)
    assert stats.count["sst"] == keep.sum() * 6
    d = np.diff(x[keep], axis=0)[one]
    np.testing.assert_allclose(stats.diff_std["sst"], d.std(), rtol=1e-6)
    said = (
        r"times of 'time' repeat \(sample 5 has 2020-01-02T00:00.* as sample 4 does; 2 "
        r"repeated in all\).*missing=\(\)"
    )
    with pytest.warns(UserWarning, match=said):
        every = fit_statistics(root, manifest, {"sst": g})
    assert every.count["sst"] == len(times) * 6
    np.testing.assert_allclose(every.mean["sst"], x.mean(), rtol=1e-12)


@pytest.mark.parametrize("freq", ["6h", "MS"])
def test_fit_statistics_of_times_that_run_backwards_never_difference_across_a_gap(
    tmp_path: Path, freq: str
) -> None:
    """Newest first (an archive written backwards), one step absent: the fit found no step
    forward in time, so ``diff_std`` paired every two samples, across the gap, without a word
    (the pipeline refuses such times where it checks them; the fit reads them by index).
    Monthly means too (months of 28 to 31 days: one step each)."""
    times = pd.date_range("2020-01-01", periods=16, freq=freq).delete(7)[::-1]
    days = {"units": "days since 2000-01-01", "dtype": "int64"}
    root = _write(tmp_path / "back.zarr", times, encoding=days if freq == "MS" else None,
                  trend=np.arange(16)[::-1].take(np.r_[0:8, 9:16]) * 3.0)  # fmt: skip
    with xr.open_zarr(root, consolidated=False) as ds:
        x = ds.sst.values.astype(np.float64)
    month = times.year * 12 + times.month
    one = np.flatnonzero(np.diff(month if freq == "MS" else times.to_numpy()) == np.diff(
        month if freq == "MS" else times.to_numpy()).max())  # fmt: skip
    assert len(one) == len(times) - 2  # every pair but the one across the gap
    g = open_geometries(root)["sst"]
    stats = fit_statistics(root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"sst": g})
    np.testing.assert_allclose(stats.diff_std["sst"], np.diff(x, axis=0)[one].std(), rtol=1e-6)


def test_a_store_read_mid_append_is_refused_by_concat_naming_it_and_both_lengths(
    tmp_path: Path, torn: Path
) -> None:
    """``concat`` said the store "has no time coordinate 'time'", which it has."""
    first = _write(tmp_path / "first.zarr", pd.date_range("2019-12-29", periods=12, freq="6h"))
    length = zarr.open_array(torn / "time").shape[0]
    said = rf"concat: '{re.escape(str(torn))}''s 'sst': coordinate .*time' has {length} values"
    with pytest.raises(ValueError, match=said):
        concat([first, torn], ["sst"])


def _hand_written(root: Path, raw: list[int], calendar: str) -> np.ndarray:
    """A store written with zarr alone: ``sst`` as ``_write``'s, ``time`` int64 hours since
    2000-02-27 in ``calendar`` with ``_FillValue`` -999 (a missing time), chunked by 5."""
    n = len(raw)
    data = np.random.default_rng(1).standard_normal((n, 2, 3)) + np.arange(n)[:, None, None]
    group = zarr.open_group(root, mode="w", zarr_format=3)
    sst = group.create_array("sst", shape=(n, 2, 3), chunks=(4, 2, 3), dtype="f4",
                             dimension_names=("time", "lat", "lon"))  # fmt: skip
    sst[:] = data.astype("f4")
    time = group.create_array("time", shape=(n,), chunks=(5,), dtype="i8", fill_value=-999,
                              dimension_names=("time",))  # fmt: skip
    time[:] = raw
    units = "hours since 2000-02-27"
    time.attrs.update({"units": units, "calendar": calendar, "_FillValue": -999})
    return data.astype("f4")


@pytest.mark.parametrize("calendar", ["noleap", "360_day", "julian"])
def test_int_cf_times_with_a_gap_a_copy_and_a_missing_time_give_cftimes_anchors_in_a_calendar(
    tmp_path: Path, calendar: str
) -> None:
    """Found right (kept as a claim; the copy's rule is this trial's): 6-hourly int hours
    across the end of February (29 and 30 days in 360_day, none in noleap), one step absent,
    one written twice, one missing (the fill value). Shift, windows in samples and in time
    deltas, a 12-hour stride and a listed date: the anchors are cftime's, each row's time is
    cftime's and its values zarr's, and a Forcings row of a missing time is NaN."""
    cftime = pytest.importorskip("cftime")
    raw = list(range(0, 6 * 20, 6))
    del raw[8]
    raw.insert(12, raw[11])
    raw[15] = -999
    root = tmp_path / f"{calendar}.zarr"
    data = _hand_written(root, raw, calendar)
    units = "hours since 2000-02-27"
    t = [None if r == -999 else cftime.num2date(r, units, calendar) for r in raw]
    h = [None if x is None else cftime.date2num(x, "hours since 1970-01-01", calendar) for x in t]
    copy = [i > 0 and h[i] is not None and h[i] in h[:i] for i in range(len(t))]
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    listed = str(t[3])
    for views, offsets in (
        ({"x": g, "y": g.shift(1)}, [0, 1]),
        ({"x": g.window(["-6h", "0h"])}, [-1, 0]),
    ):
        for stride in (1, "12h"):
            want = [a for a in range(len(t))
                    if (stride == 1 or (h[a] is not None and h[a] % 12 == 0))
                    and all(0 <= a + k < len(t) and h[a + k] is not None and h[a] is not None
                            and not copy[a + k] and a + k != 3 and h[a + k] == h[a] + 6 * k
                            for k in offsets)]  # fmt: skip
            pipe = insitu_pipeline(root, manifest, views, batch_size=3, stride=stride,
                                   missing=[listed])  # fmt: skip
            try:
                got = []
                for batch in Loader(pipe):
                    for label in views:
                        idx = np.asarray(batch.sample_indices[label])
                        np.testing.assert_array_equal(batch[label], data[idx])
                        assert [str(x) for x in np.ravel(batch.coords[label]["time"])] == [
                            str(t[i]) for i in idx.ravel()]  # fmt: skip
                    idx = np.asarray(batch.sample_indices["x"])
                    got += (idx[:, -1] if idx.ndim > 1 else idx).tolist()
                assert sorted(got) == want, (views, stride)
            finally:
                pipe.close()
    forcings = Forcings("x", names=["year_progress_sin"], lat=LAT, lon=LON)
    with pytest.warns(UserWarning, match="repeat"):  # (cftime dates too, since timeedges)
        pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=4, batch_transforms=[forcings])
    try:
        for batch in Loader(pipe):
            gone = [t[i] is None for i in batch.sample_indices["x"]]
            assert np.isnan(batch["year_progress_sin"]).all(axis=(1, 2)).tolist() == gone
    finally:
        pipe.close()
