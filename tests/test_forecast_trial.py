"""What the forecast-sample trial of 2026-12-06 found: cases where the anchors, or the error
that says why there are none, were wrong.

The oracle is xarray: tiny stores written with ``Dataset.to_zarr`` (CF time in a calendar),
read back with ``xr.open_zarr``; which anchors a batch must hold is worked out here from those
times with numpy, never asked of the package's plan.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pytest.importorskip("cftime")

N = 16


def _write(root: Path, calendar: str, start: str) -> Path:
    """``t2m`` ``(time, 2, 2)``, 6-hourly from ``start``, chunks of 2 steps."""
    times = xr.date_range(start, periods=N, freq="6h", calendar=calendar, use_cftime=True)
    if calendar == "standard":
        times = times.to_datetimeindex(time_unit="ns")
    data = np.arange(N * 4, dtype="f4").reshape(N, 2, 2)
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), data)}, coords={"time": times})
    encoding = {
        "t2m": {"chunks": (2, 2, 2)},
        "time": {"units": "hours since 1990-01-01", "calendar": calendar, "dtype": "int64"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False, encoding=encoding)
    return root


# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = pytest.mark.xdist_group("forecast_trial")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("forecast_trial")
    return {
        "off_grid": _write(base / "off_grid.zarr", "standard", "2000-02-27T03:00"),
        "off_grid_360": _write(base / "off_grid_360.zarr", "360_day", "2001-02-28T03:00"),
        "on_grid": _write(base / "on_grid.zarr", "noleap", "2001-02-26T00:00"),
    }


def _anchors(pipe: Any) -> list[int]:
    return sorted(int(a) for b in Loader(pipe) for a in b.sample_indices["x"])


@pytest.mark.parametrize("name", ["off_grid", "off_grid_360"])
@pytest.mark.parametrize("stride", ["6h", "12h", "1D"])
def test_a_time_stride_no_time_of_the_data_lies_on_says_so_and_names_an_int_stride(
    stores: dict[str, Path], name: str, stride: str
) -> None:
    root = stores[name]
    hours = xr.open_zarr(root, consolidated=False).time.dt.hour.values
    assert set(hours.tolist()) == {3, 9, 15, 21}  # 6-hourly, 3 h off the 00/06/12/18 grid
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError) as info:
        insitu_pipeline(root, manifest, {"x": t2m}, stride=stride, batch_size=4)
    message = str(info.value)
    # why: a time stride counts from 1970-01-01T00:00, and the data sit 3 h off its grid
    assert "1970-01-01" in message and "3h" in message
    # what to do: an int stride counts samples from the first
    assert "int stride" in message


def test_an_int_stride_anchors_the_off_grid_data_the_message_points_to(
    stores: dict[str, Path],
) -> None:
    root = stores["off_grid"]
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    with insitu_pipeline(root, manifest, {"x": t2m}, stride=2, batch_size=4) as pipe:
        assert _anchors(pipe) == list(range(0, N, 2))  # 03, 15 UTC: every 12 h


@pytest.mark.parametrize("index", [N, -N - 1])
def test_a_missing_index_outside_the_array_is_refused_naming_the_indices_it_takes(
    stores: dict[str, Path], index: int
) -> None:
    root = stores["on_grid"]
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=rf"missing lists sample {index}, outside \[-{N}, {N}\)"):
        insitu_pipeline(root, manifest, {"x": t2m}, missing=[index])


def test_a_negative_missing_index_counts_from_the_end_as_numpy_does(
    stores: dict[str, Path],
) -> None:
    root = stores["on_grid"]
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    steps = np.arange(N)
    for listed in ([-1], [-N], [-3, 2]):
        gone = set(steps[listed].tolist())  # numpy's reading of the indices
        # x reads a, y reads a + 1: an anchor is dropped when either step is listed
        want = [a for a in range(N - 1) if a not in gone and a + 1 not in gone]
        views = {"x": t2m, "y": t2m.shift(1)}
        with insitu_pipeline(root, manifest, views, missing=listed, batch_size=4) as pipe:
            assert _anchors(pipe) == want, listed


@pytest.fixture(scope="module")
def gappy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``before`` (8 steps) continued by ``gappy`` (6-hourly, one step left out after 4)."""
    base = tmp_path_factory.mktemp("forecast_trial_gap")
    before = _write(base / "before.zarr", "noleap", "2001-02-26T00:00")
    full = xr.date_range("2001-03-02", periods=9, freq="6h", calendar="noleap", use_cftime=True)
    times = np.delete(np.asarray(full), 4)  # 2001-03-03T00 is left out
    data = np.zeros((8, 2, 2), dtype="f4")
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), data)}, coords={"time": times})
    encoding = {
        "t2m": {"chunks": (2, 2, 2)},
        "time": {"units": "hours since 1990-01-01", "calendar": "noleap", "dtype": "int64"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(base / "gappy.zarr", zarr_format=3, consolidated=False, encoding=encoding)
    return {"before": before, "gappy": base / "gappy.zarr"}


def test_a_concat_or_join_of_a_store_with_a_gap_names_where_and_what_to_do(
    gappy: dict[str, Path],
) -> None:
    from insitubatch_nodes import Collection, concat

    times = xr.open_zarr(gappy["gappy"], consolidated=False).time.values
    after = int(np.flatnonzero(np.diff(times) != np.diff(times)[0])[0]) + 1  # xarray's gap
    assert str(times[after]) == "2001-03-03 06:00:00"
    calls = [
        lambda: concat([gappy["before"], gappy["gappy"]], ["t2m"]),
        lambda: Collection.join({"a": (gappy["before"], ["t2m"]), "b": (gappy["gappy"], ["t2m"])}),
    ]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert f"{times[after]} (index {after}) follows {times[after - 1]}" in message
        assert "pipeline of its own" in message  # the way out: one store drops the gap's anchors


def test_a_time_stride_over_a_time_coordinate_without_cf_units_names_it_and_the_units_to_add(
    tmp_path: Path,
) -> None:
    # a 6-hourly count written as plain numbers: xarray reads them as integers, not dates
    data = np.zeros((8, 2, 2), dtype="f4")
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), data)}, coords={"time": 6 * np.arange(8)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(tmp_path / "counts.zarr", zarr_format=3, consolidated=False)
    assert xr.open_zarr(tmp_path / "counts.zarr", consolidated=False).time.dtype.kind == "i"
    t2m = open_geometries(tmp_path / "counts.zarr", ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    for kw, views in (({"stride": "6h"}, {"x": t2m}), ({}, {"x": t2m.window(["-6h", "0h"])})):
        with pytest.raises(ValueError) as info:
            insitu_pipeline(tmp_path / "counts.zarr", manifest, views, **kw)
        message = str(info.value)
        assert "'time' (units None) is no CF time" in message and "since" in message
        assert "int stride" in message


def test_set_views_with_time_windows_on_a_pipeline_that_read_no_times_says_to_build_with_missing(
    stores: dict[str, Path],
) -> None:
    root = stores["on_grid"]
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    timed = {"x": t2m.window(["-6h", "0h"]), "y": t2m.window(["6h"])}
    untimed = {"x": t2m.window([-1, 0])}  # windows in samples, no missing=: no times read
    with (
        insitu_pipeline(root, manifest, untimed, batch_size=4) as pipe,
        pytest.raises(ValueError) as info,
    ):
        pipe.set_views(timed)
    message = str(info.value)
    assert "missing=()" in message and "offsets in samples" in message
    # the way it names works: built with missing=(), the same views are taken, and each anchor
    # reads the steps 6 h before and after it (xarray's times; the store has no gap)
    times = xr.open_zarr(root, consolidated=False).time.values
    views = {"x": t2m.window([-1, 0])}
    with insitu_pipeline(root, manifest, views, batch_size=4, missing=()) as pipe:
        pipe.set_views(timed)
        batches = list(Loader(pipe))
    got = sorted(int(a) for b in batches for a in b.sample_indices["x"][:, 1])
    assert got == list(range(1, N - 1))
    for b in batches:
        t = b.coords["x"]["time"][:, 1]
        assert all(t_ - before == times[1] - times[0] for before, t_ in b.coords["x"]["time"])
        assert all(
            after - t_ == times[1] - times[0]
            for t_, after in zip(t, b.coords["y"]["time"][:, 0], strict=True)
        )


@pytest.fixture(scope="module")
def backwards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``on_grid``'s 6-hourly times, written newest first."""
    root = tmp_path_factory.mktemp("forecast_trial_back") / "backwards.zarr"
    times = xr.date_range("2000-02-27", periods=N, freq="6h", use_cftime=False)[::-1]
    data = np.arange(N * 4, dtype="f4").reshape(N, 2, 2)
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), data)}, coords={"time": times})
    encoding = {"t2m": {"chunks": (2, 2, 2)}, "time": {"units": "hours since 1990-01-01"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=3, consolidated=False, encoding=encoding)
    return root


@pytest.mark.parametrize(
    "asked", [{"stride": "12h"}, {"missing": ()}, {"missing": ["2000-02-28T00:00"]}]
)
def test_times_that_run_backwards_are_checked_back_in_time_where_the_time_checks_are_asked_for(
    backwards: Path, asked: dict[str, Any]
) -> None:
    """Refused before the timeedges trial (2026-12-07); now the checks count the steps back
    in time (``tests/test_timeedges_trial.py``): ``shift(1)`` reads 6 h earlier, checked."""
    times = xr.open_zarr(backwards, consolidated=False).time.values
    assert (np.diff(times) < np.timedelta64(0)).all()  # y = shift(1) reads 6 h *earlier*
    t2m = open_geometries(backwards, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {"x": t2m, "y": t2m.shift(1)}
    listed = [np.datetime64(d) for d in asked.get("missing", ())]
    twelve = np.timedelta64(12, "h")
    want = [
        a
        for a in range(N - 1)
        if times[a] not in listed and times[a + 1] not in listed
        and ("stride" not in asked or (times[a] - np.datetime64("1970-01-01")) % twelve == 0)
    ]  # fmt: skip
    with insitu_pipeline(backwards, manifest, views, batch_size=4, **asked) as pipe:
        assert _anchors(pipe) == want


def test_times_that_run_backwards_are_read_in_samples_when_no_time_check_is_asked_for(
    backwards: Path,
) -> None:
    t2m = open_geometries(backwards, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {"x": t2m, "y": t2m.shift(1)}
    with insitu_pipeline(backwards, manifest, views, stride=2, batch_size=4) as pipe:
        assert _anchors(pipe) == list(range(0, N - 1, 2))  # samples, as asked


@pytest.fixture(scope="module")
def standard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-hourly from 2000-02-27 in the standard calendar: xarray decodes it to datetime64."""
    return _write(
        tmp_path_factory.mktemp("forecast_trial_std") / "std.zarr", "standard", "2000-02-27"
    )


def test_a_cftime_date_of_another_calendar_is_refused_by_a_datetime64_time_coordinate(
    standard: Path,
) -> None:
    import cftime

    times = xr.open_zarr(standard, consolidated=False).time.values
    assert times.dtype.kind == "M"
    julian = cftime.DatetimeJulian(2000, 2, 27, 6)  # Gregorian 2000-03-11T06 (cftime's reading)
    assert str(julian.change_calendar("standard")) == "2000-03-11 06:00:00"
    t2m = open_geometries(standard, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    for other in (julian, cftime.Datetime360Day(2000, 2, 30), cftime.DatetimeNoLeap(2000, 3, 1)):
        # before, read field by field: the Julian date dropped 2000-02-27T06, the 360_day one
        # was "not a date"
        with pytest.raises(TypeError, match=f"calendar '{other.calendar}'"):
            insitu_pipeline(standard, manifest, {"x": t2m}, missing=[other])
    # a date of the coordinate's own calendar is still read as it stands
    same = cftime.DatetimeGregorian(2000, 2, 27, 6)
    with insitu_pipeline(standard, manifest, {"x": t2m}, missing=[same]) as pipe:
        gone = set(range(N)) - set(_anchors(pipe))
    assert [str(times[i]) for i in gone] == [str(np.datetime64("2000-02-27T06", "ns"))]


def test_a_concat_of_stores_chunked_otherwise_names_the_difference_and_the_fix(
    tmp_path: Path,
) -> None:
    from insitubatch_nodes import concat

    times = xr.date_range("2000-01-01", periods=12, freq="6h", use_cftime=False)
    parts = []
    for name, sel, spc in (("a.zarr", slice(0, 8), 4), ("b.zarr", slice(8, 12), 2)):
        ds = xr.Dataset(
            {"t2m": (("time", "x"), np.zeros((12, 3), dtype="f4")[sel])},
            coords={"time": times[sel]},
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.to_zarr(tmp_path / name, zarr_format=3, consolidated=False,
                       encoding={"t2m": {"chunks": (spc, 3)}})  # fmt: skip
        parts.append(tmp_path / name)
    chunks = [xr.open_zarr(p, consolidated=False).t2m.encoding["chunks"] for p in parts]
    assert chunks == [(4, 3), (2, 3)]
    with pytest.raises(ValueError) as info:
        concat(parts, ["t2m"])
    message = str(info.value)
    assert "chunk" in message and "rewrite that member like the first" in message


def test_float32_times_years_after_their_reference_are_refused_without_understating_the_error(
    tmp_path: Path,
) -> None:
    times = xr.date_range("2000-02-27", periods=8, freq="1h", use_cftime=False)
    ds = xr.Dataset({"t2m": (("time", "x"), np.zeros((8, 2), dtype="f4"))}, coords={"time": times})
    encoding = {"time": {"units": "days since 1990-01-01", "dtype": "float32"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(tmp_path / "f32.zarr", zarr_format=3, consolidated=False, encoding=encoding)
        decoded = xr.open_zarr(tmp_path / "f32.zarr", consolidated=False).time.values
    off = np.abs(decoded - times.values).max()
    assert off > np.timedelta64(1, "s")  # xarray's reading: seconds off, not ~0.1 ms
    t2m = open_geometries(tmp_path / "f32.zarr", ["t2m"])["t2m"]
    with pytest.raises(ValueError) as info:
        insitu_pipeline(tmp_path / "f32.zarr", split_by_chunk(t2m, (1.0, 0.0, 0.0)),
                        {"x": t2m}, stride="2h")  # fmt: skip
    message = str(info.value)
    assert "off the whole second" in message and "seconds years after" in message
