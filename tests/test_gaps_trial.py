"""Missing and irregular time steps, as a user of a reanalysis or satellite archive meets them
(the gaps trial of 2026-12-07).

The stores are written by xarray (``Dataset.to_zarr``; CF times in a calendar) and read back
with ``xr.open_zarr``: which anchors an epoch must hold, each delivered step's time and value,
and the tendency statistics are worked out here from those times with pandas and numpy, never
asked of the package's plan.

Found (fixed; each test failed before the fix):

- **Monthly (and yearly) times were full of gaps that are not there.** The missing-step checks
  count a step as ``time[a] + k * data_step``, the data's step being the most common
  difference between consecutive times: 31 days for monthly means (ERA5's monthly averages,
  CMIP's mid-month stamps), 365 days for yearly ones. So every month of 30 days (and
  February) was a ``"gap"``: ``{"x": g, "y": g.shift(1)}`` with ``missing=()`` over 35
  months with one absent dropped 15 anchors where 1 reads across the absent month, a
  ``window([-2, -1, 0])`` left no anchor at all (``ValueError`` blaming 32 "gaps"), each leap
  year was a gap of yearly data (and each season but the longest of seasonal data), and
  ``fit_statistics``' ``diff_std`` paired only the months 31 days apart (19 of the 33 pairs
  one month apart; 1.311 where numpy gives 1.350). Now dates that step by whole calendar
  months of several lengths are counted in months: a step is missing only where a month
  (season, year) is. A time stride or a window in time
  deltas over them says to count in samples (a ``"30D"`` step matches no month); times one
  fixed length apart (a ``360_day`` calendar's months, any regular step) are counted as
  before.
- **A typo in ``missing=`` passed silently where the data have one shorter step.** A date
  strictly between two consecutive times is refused (no sample has it), but only between
  times the *smallest* spacing apart: with one 3-hour step among 6-hourly times, ``03:00``
  dropped nothing without a word; among mid-month stamps the 1st of a month was refused
  between months 28 days apart only. Now any two consecutive times at most the data's step
  apart (in calendar months for monthly dates) count; a date inside a gap still passes.
- **A time coordinate of another length than the data counted as none.** A store read
  while it is appended to (the time coordinate resized before or after the data) had its
  times left out, so ``missing=()`` checked no time without a word, a time stride said the
  array has no time coordinate, and ``fit_statistics`` differenced across gaps silently. Now
  the pipeline refuses it naming both lengths, and the fit warns that ``diff_std`` cannot see
  gaps.
- A split that gaps left with fewer anchors than ranks said only "1 valid anchors": now it
  says how many the missing-step checks dropped, per reason.

Tried and found right (no change needed): on a 6-hourly store with one step absent, a
duplicated and an out-of-order timestamp, an irregular 3-hour step, an all-NaN step and the
time coordinate chunked otherwise than the data, the anchors of ``shift``, windows in samples
and in time deltas, with and without ``stride="12h"``, equal the oracle's, every delivered
step's time is its anchor's plus its offset, every value is zarr's, each anchor is in exactly
one batch on 1 to 3 ranks (``remainder`` drop, pad, uneven), ``len(loader)``,
``report().batches``, ``report().samples`` and ``report().dropped`` are exact, and a state saved
after any batch resumes bit-exactly; ``set_views`` to time windows and to a stack with int
windows applies the gap checks to the new offsets; stored objects never written read as the
fill value (zarr v2 and v3, as xarray reads them) under ``missing_objects="read"`` and drop
every anchor of any array that reads them under ``"drop"``; ``fit_statistics`` counts the NaNs
of an all-NaN step and of unwritten objects, skips them, and never differences across a gap
or a dropped sample. Outside this file, 120 random time axes (1-, 3- and 6-hourly with
absent, duplicated, swapped and off-grid steps; shifts, windows in samples and in time deltas,
int and time strides, train and val) gave the oracle's anchors and zarr's values every time,
and 120 random fits gave numpy's mean, NaN count and ``diff_std``.

Left as they are (described, not changed): a duplicated time was dropped only where a view
reads it at another offset, so a view of the anchor alone (and ``fit_statistics``) took both
copies (since the coordlen trial a later copy is dropped for every offset); a time axis
whose step changes (6-hourly, later hourly) is checked at its most common step, so the other
part's anchors are dropped as gaps; ``concat`` refuses monthly stores as "not at one step"
(since the timesconcat trial it takes them: ``tests/test_timesconcat_trial.py``);
pentads and dekads (5/10-day steps cut at month ends) still count in days.
(A dimension coordinate of another length, left out of ``batch.coords`` without a word under
the default ``coords=None``, is refused since the coordlen trial: ``test_coordlen_trial.py``.)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.statistics import fit_statistics

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")
pytest.importorskip("cftime")

pytestmark = pytest.mark.timeout(60)


def _write(
    root: Path, times: Any, *, chunk: int = 6, calendar: str | None = None, nan_step: int = -1
) -> Path:
    """``sst (time, lat, lon)`` float32 noise with a trend, at ``times``, ``chunk`` steps per
    stored object, the time coordinate in chunks of 5 (not the data's); step ``nan_step``
    (if any) all NaN."""
    n = len(times)
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((n, 2, 3)) + np.arange(n)[:, None, None]).astype("f4")
    if nan_step >= 0:
        data[nan_step] = np.nan
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), data)}, coords={"time": times})
    tenc: dict[str, Any] = {"units": "days since 1990-01-01", "dtype": "int64", "chunks": (5,)}
    if calendar is not None:
        tenc["calendar"] = calendar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"sst": {"chunks": (chunk, 2, 3)}, "time": tenc})  # fmt: skip
    return root


def _read(root: Path) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with xr.open_zarr(root, consolidated=False, use_cftime=True) as ds:
            return np.asarray(ds.time.values), ds.sst.values


def _months(times: np.ndarray) -> np.ndarray:
    """Each date's month counted from year 0 (cftime dates of any calendar)."""
    return np.array([t.year * 12 + t.month - 1 for t in times])


@pytest.fixture(scope="module")
def monthly(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three years of monthly data with 2001-03 absent: ERA5's monthly means (stamped on the
    1st at 00:00, standard calendar) and a model's (mid-month at 12:00, ``noleap``)."""
    base = tmp_path_factory.mktemp("gaps_monthly")
    era5 = pd.date_range("2000-01-01", periods=36, freq="MS")
    era5 = era5[era5 != pd.Timestamp("2001-03-01")]
    model = xr.date_range("2000-01-01", periods=36, freq="MS", calendar="noleap", use_cftime=True)
    model = [t.replace(day=15, hour=12) for t in model if (t.year, t.month) != (2001, 3)]
    return {
        "era5": _write(base / "era5.zarr", era5),
        "model": _write(base / "model.zarr", xr.CFTimeIndex(model), calendar="noleap"),
    }


@pytest.mark.parametrize("name", ["era5", "model"])
def test_monthly_times_drop_only_the_anchors_that_read_across_the_absent_month(
    monthly: dict[str, Path], name: str
) -> None:
    root = monthly[name]
    times, values = _read(root)
    month = _months(times)
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    for views, offsets in (
        ({"x": g, "y": g.shift(1)}, [0, 1]),
        ({"x": g.window([-2, -1, 0]), "y": g.shift(1)}, [-2, -1, 0, 1]),
    ):
        want = [a for a in range(len(times))
                if all(0 <= a + k < len(times) and month[a + k] == month[a] + k
                       for k in offsets)]  # fmt: skip
        pipe = insitu_pipeline(root, manifest, views, batch_size=4, missing=(), seed=0)
        try:
            got = []
            for batch in Loader(pipe):
                anchor = np.asarray(batch.sample_indices["y"]) - 1
                got += anchor.tolist()
                for label, view in views.items():
                    idx = np.asarray(batch.sample_indices[label])
                    np.testing.assert_array_equal(batch[label], values[idx])
                    steps = np.array(view.window_offsets or [0]) + view.offset
                    assert (month[idx].reshape(len(anchor), -1)
                            == month[anchor][:, None] + steps).all()  # fmt: skip
            assert sorted(got) == want
            # only the anchors whose steps meet the absent month: 1 for a shift, 3 for the window
            assert pipe.stages.plan.dropped == {"nat": 0, "gap": len(offsets) - 1, "missing": 0}
        finally:
            pipe.close()


@pytest.mark.parametrize("freq", ["QS-DEC", "YS"])
def test_seasonal_and_yearly_times_count_each_season_or_year_as_one_step(
    tmp_path: Path, freq: str
) -> None:
    """Seasons of 90 to 92 days (DJF, MAM, ...) and years of 365 or 366: one absent each."""
    times = pd.date_range("1990-12-01", periods=24, freq=freq).delete(13)
    root = _write(tmp_path / "means.zarr", times, chunk=4)
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": g, "y": g.shift(1)}, batch_size=4, missing=())
    try:
        got = sorted(int(a) for b in Loader(pipe) for a in b.sample_indices["x"])
        months = times.year * 12 + times.month
        step = 3 if freq.startswith("Q") else 12
        assert got == [a for a in range(len(times) - 1) if months[a + 1] - months[a] == step]
        assert pipe.stages.plan.dropped == {"nat": 0, "gap": 1, "missing": 0}
    finally:
        pipe.close()


@pytest.mark.parametrize("name", ["era5", "model"])
def test_fit_statistics_diff_std_of_monthly_times_pairs_every_month_with_the_next(
    monthly: dict[str, Path], name: str
) -> None:
    root = monthly[name]
    times, values = _read(root)
    month = _months(times)
    g = open_geometries(root)["sst"]
    stats = fit_statistics(root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"sst": g})
    x = values.astype(np.float64)
    one = np.flatnonzero(np.diff(month) == 1)  # every pair one month apart (33 of 34)
    assert len(one) == len(times) - 2
    np.testing.assert_allclose(stats.diff_std["sst"], np.std(x[one + 1] - x[one]), rtol=1e-6)


def test_a_time_stride_or_a_time_delta_window_over_monthly_times_says_to_count_in_samples(
    monthly: dict[str, Path],
) -> None:
    root = monthly["era5"]
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"step by calendar months.*give an int stride"):
        insitu_pipeline(root, manifest, {"x": g}, stride="30D")
    with pytest.raises(ValueError, match=r"calendar months.*offsets in samples"):
        insitu_pipeline(root, manifest, {"x": g.window(["-30D", "0D"])})


def test_monthly_times_of_a_360_day_calendar_keep_their_fixed_step(tmp_path: Path) -> None:
    """30 days apart, always: a time-delta window of "30D" reads the month before, as ever."""
    times = xr.date_range("2000-01-01", periods=24, freq="MS", calendar="360_day", use_cftime=True)
    times = xr.CFTimeIndex([t for t in times if (t.year, t.month) != (2000, 7)])
    root = _write(tmp_path / "m360.zarr", times, calendar="360_day")
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": g.window(["-30D", "0D"])}, batch_size=4)
    try:
        assert len([1 for _ in Loader(pipe)]) == len(pipe)
        assert pipe.stages.plan.dropped == {"nat": 0, "gap": 1}
    finally:
        pipe.close()


def test_a_missing_date_between_two_steps_is_refused_though_the_data_have_a_shorter_step(
    tmp_path: Path,
) -> None:
    """6-hourly times with one 3-hour step elsewhere (a re-timed pass): a typo in missing=
    (03:00) was accepted and dropped nothing, as only the smallest spacing was a step."""
    times = pd.date_range("2020-01-01", periods=16, freq="6h")
    times = times.delete(9).insert(12, pd.Timestamp("2020-01-03T21:00"))  # absent; irregular
    root = _write(tmp_path / "six.zarr", times, chunk=4)
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g, "y": g.shift(1)}
    said = r"'2020-01-01T03:00'.*between two consecutive times.*2020-01-01T00:00.*2020-01-01T06:00"
    with pytest.raises(ValueError, match=said):
        insitu_pipeline(root, manifest, views, missing=["2020-01-01T03:00"])
    # the 3-hour step's middle, the absent step and a date outside the times pass
    with pytest.raises(ValueError, match=r"2020-01-03T19:30"):
        insitu_pipeline(root, manifest, views, missing=["2020-01-03T19:30"])
    for date in ("2020-01-03T06:00", "2019-06-01T00:00"):
        pipe = insitu_pipeline(root, manifest, views, missing=[date])
        assert pipe.stages.plan.dropped["missing"] == 0, date
        pipe.close()


def test_a_missing_date_inside_any_month_of_mid_month_times_is_refused(
    monthly: dict[str, Path],
) -> None:
    """Mid-month stamps (15th, 12:00): the 1st of a month is no sample's time. It was refused
    between months 28 days apart only, and passed silently between the others."""
    root = monthly["model"]
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    for date in ("2000-03-01", "2001-05-01", "2002-08-01"):  # 29, 30 and 31 days around it
        with pytest.raises(ValueError, match=rf"'{date}'.*between two consecutive times"):
            insitu_pipeline(root, manifest, {"x": g}, missing=[date])
    pipe = insitu_pipeline(root, manifest, {"x": g, "y": g.shift(1)},
                           missing=["2001-05-15T12:00", "2001-03-01"])  # fmt: skip
    try:  # a listed month drops its two anchors; the 1st of the absent month passes
        assert pipe.stages.plan.dropped == {"nat": 0, "gap": 1, "missing": 2}
    finally:
        pipe.close()


def test_an_irregular_6_hourly_store_delivers_each_kept_anchor_once_at_its_offsets_and_resumes(
    tmp_path: Path,
) -> None:
    """One step absent, one duplicated, two out of order, one 3 hours off, one all NaN; the
    time coordinate chunked by 5, the data by 4: windows in time deltas at a 12-hour stride on
    two ranks (found right; kept as a claim)."""
    t = list(pd.date_range("2020-01-01", periods=40, freq="6h"))
    del t[10]
    t.insert(20, t[19])
    t[25], t[26] = t[26], t[25]
    t[30] -= pd.Timedelta("3h")
    root = _write(tmp_path / "irregular.zarr", pd.DatetimeIndex(t), chunk=4, nan_step=14)
    _, values = _read(root)
    times = pd.DatetimeIndex(t).to_numpy()  # (_read's are cftime dates)
    six = np.timedelta64(6, "h")
    offsets = {"x": [-1, 0], "y": [1, 2]}
    want = [a for a in range(len(times))
            if (times[a] - np.datetime64("1970-01-01")) % (2 * six) == np.timedelta64(0)
            and all(0 <= a + k < len(times) and times[a + k] == times[a] + k * six
                    for k in (-1, 0, 1, 2))]  # fmt: skip
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h", "12h"])}
    got: list[int] = []
    for rank in (0, 1):
        kw = dict(stride="12h", batch_size=2, seed=3, rank=rank, world_size=2, remainder="pad")
        pipe = insitu_pipeline(root, manifest, views, **kw)
        try:
            loader = Loader(pipe)
            batches, states = [], []
            for batch in loader:
                anchor = batch.sample_indices["x"][:, 1]
                for label, steps in offsets.items():
                    idx = batch.sample_indices[label]
                    assert (batch.coords[label]["time"] == times[anchor][:, None]
                            + np.array(steps) * six).all()  # fmt: skip
                    np.testing.assert_array_equal(batch[label], values[idx])
                batches.append([b.copy() for b in batch.arrays.values()])
                states.append(loader.state_dict())
                got += anchor.tolist()
            assert len(batches) == len(pipe) == pipe.report().batches
            assert pipe.report().dropped == pipe.stages.plan.dropped
        finally:
            pipe.close()
        again = insitu_pipeline(root, manifest, views, **kw)  # resumed after its first batch
        try:
            resumed = Loader(again)
            resumed.load_state_dict(states[0])
            for want_arrays, batch in zip(batches[1:], resumed, strict=True):
                for a, b in zip(want_arrays, batch.arrays.values(), strict=True):
                    np.testing.assert_array_equal(a, b)
        finally:
            again.close()
    assert sorted(set(got)) == want  # (pad repeats at most one anchor to even the ranks)
    assert len(got) - len(set(got)) <= 1


@pytest.mark.parametrize("extra", [-4, 4])
def test_a_time_coordinate_of_another_length_than_the_data_is_refused_where_times_are_read(
    tmp_path: Path, extra: int
) -> None:
    """A store read mid-append (the time coordinate resized before or after the data): its
    times counted as none, so missing=() checked nothing, a time stride said the array has no
    time coordinate, and diff_std paired the samples across the gap without a word."""
    times = pd.date_range("2020-01-01", periods=20, freq="6h").delete(9)
    root = _write(tmp_path / "append.zarr", times, chunk=4)
    coord = zarr.open_array(root / "time", mode="a")
    last = int(coord[-1])
    coord.resize((len(times) + extra,))
    if extra > 0:
        coord[len(times) :] = last + np.arange(1, extra + 1)
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    said = rf"'time' has {len(times) + extra} values.*'sst' has {len(times)} samples"
    for options in ({"missing": ()}, {"stride": "12h"}, {"missing": (), "coords": ()}):
        with pytest.raises(ValueError, match=said):
            insitu_pipeline(root, manifest, {"x": g, "y": g.shift(1)}, **options)
    with pytest.warns(UserWarning, match=r"diff_std pairs consecutive samples.*cannot be read"):
        fit_statistics(root, manifest, {"sst": g})


def test_a_split_left_with_fewer_anchors_than_ranks_by_gaps_says_how_many_the_gaps_dropped(
    tmp_path: Path,
) -> None:
    """It said only "1 valid anchors", which a user counting the split's 5 samples could not
    place."""
    times = pd.date_range("2020-01-01", periods=24, freq="6h").delete([17, 19, 21])
    root = _write(tmp_path / "few.zarr", times, chunk=4)
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (0.6, 0.4, 0.0))  # val: samples 16..20, four anchors
    said = (
        r"'val' has 1 valid anchors but world_size is 3; the missing-step checks dropped \{'gap': 3"
    )
    with pytest.raises(ValueError, match=said):
        insitu_pipeline(root, manifest, {"x": g, "y": g.shift(1)}, split="val", missing=(),
                        rank=0, world_size=3, remainder="uneven")  # fmt: skip
