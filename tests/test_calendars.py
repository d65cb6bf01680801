"""Every CF calendar decoded as xarray decodes it, carried per row, windowed by date, and counted.

The oracle is xarray: a store written by xarray (``Dataset.to_zarr`` with the time's
``units``/``calendar`` encoding), read back by ``xr.open_zarr`` — which is ``xr.decode_cf`` of
the stored numbers — against what the pipeline delivers in ``batch.coords``. Counts of elapsed
time are checked against cftime's own ``date2num`` and xarray's ``.dt`` accessor.
"""

from __future__ import annotations

import datetime
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, to_torch
from insitubatch_nodes.io.coords import (
    MISSING_OFFSET,
    Coordinate,
    decode_cf,
    open_coordinates,
    time_offsets,
)

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
cftime = pytest.importorskip("cftime")
from xarray.coding.times import decode_cf_datetime  # noqa: E402

N_TIME, SPC = 96, 8  # 12 chunks of 8 samples

# (calendar, first date, step, units): every CF calendar and its aliases; each run crosses the
# end of February (02-29 and 02-30 where the calendar has them); "days since 0001-01-01" puts the
# reference outside datetime64[ns]'s range while the dates lie inside it
CASES = [
    ("standard", "2000-02-25", "6h", "hours since 1850-01-01 00:00:00"),
    ("gregorian", "2000-02-25", "1D", "days since 0001-01-01"),
    ("proleptic_gregorian", "2000-02-25", "6h", "days since 0001-01-01"),
    ("noleap", "2001-02-25", "6h", "hours since 1850-01-01 00:00:00"),
    ("365_day", "2001-02-25", "1D", "days since 0001-01-01"),
    ("all_leap", "2001-02-25", "6h", "hours since 1850-01-01 00:00:00"),
    ("366_day", "2001-02-25", "1D", "days since 0001-01-01"),
    ("360_day", "2001-02-25", "6h", "hours since 1850-01-01 00:00:00"),
    ("julian", "2000-02-25", "6h", "days since 0001-01-01"),
    # dates the Gregorian reform splits: Julian before 1582-10-15 (cftime dates, as xarray)
    ("standard", "1582-09-20", "1D", "days since 1500-01-01"),
    # dates outside datetime64[ns]'s range in a numpy calendar: cftime dates, as xarray
    ("proleptic_gregorian", "1600-02-25", "6h", "hours since 1600-01-01"),
]
IDS = [f"{c}-{d[:4]}-{s}-{u.split()[0]}" for c, d, s, u in CASES]


def _write_calendar_store(
    path: Path, calendar: str, start: str, step: str, units: str, zarr_format: int = 3
) -> Path:
    times = xr.date_range(start, periods=N_TIME, freq=step, calendar=calendar, use_cftime=True)
    dtype = "float64" if units.startswith("days") and step != "1D" else "int64"  # 0.25 days
    rng = np.random.default_rng(0)
    ds = xr.Dataset(
        {"t2m": (("time", "lat"), rng.standard_normal((N_TIME, 3)).astype(np.float32))},
        coords={"time": times, "lat": [10.0, 20.0, 30.0]},
    )
    encoding = {
        "t2m": {"chunks": (SPC, 3)},
        "time": {"units": units, "calendar": calendar, "dtype": dtype, "chunks": (N_TIME,)},
    }
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=False, encoding=encoding)
    return path


def _xr_time(path: Path) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray warns when it keeps cftime dates)
        with xr.open_zarr(path, consolidated=False) as ds:
            return np.asarray(ds.time.values)


def _assert_same_dates(got: np.ndarray, want: np.ndarray) -> None:
    """Equal element for element, of the same dtype family (datetime64[ns], or cftime dates of
    the same type)."""
    assert got.shape == want.shape
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype == object:
        assert [type(g) for g in got] == [type(w) for w in want]
        assert all(g == w for g, w in zip(got, want, strict=True))
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("calendar", "start", "step", "units"), CASES, ids=IDS)
def test_every_cf_calendar_reaches_the_batch_as_xarray_decodes_it(
    tmp_path: Path, calendar: str, start: str, step: str, units: str
) -> None:
    root = _write_calendar_store(tmp_path / "cal.zarr", calendar, start, step, units)
    stored = zarr.open_array(root / "time", mode="r")
    assert stored.dtype.kind in "if" and stored.attrs["calendar"] == calendar  # stored encoded
    assert stored.attrs["units"].split()[:3] == units.split()[:3]  # (xarray tidies the time)
    want = _xr_time(root)
    geom = open_geometries(root)["t2m"]
    time = open_coordinates(root, geom)["time"]
    _assert_same_dates(time.values, want)
    assert time.is_time
    expect_numpy = (
        calendar in ("standard", "gregorian", "proleptic_gregorian") and int(start[:4]) > 1677
    )
    assert (want.dtype == np.dtype("M8[ns]")) == expect_numpy  # the documented rule, per xarray
    data = zarr.open_array(root / "t2m", mode="r")[...]
    pipe = insitu_pipeline(
        root,
        split_by_chunk(geom, (1.0, 0.0, 0.0)),
        {"x": geom, "y": geom.shift(1)},
        batch_size=7,
        seed=1,
    )
    try:
        batches = list(pipe)
    finally:
        pipe.close()
    seen = np.concatenate([b.sample_indices["x"] for b in batches])
    assert sorted(seen.tolist()) == list(range(N_TIME - 1))
    for b in batches:
        for label in ("x", "y"):
            rows = b.sample_indices[label]
            _assert_same_dates(b.coords[label]["time"], want[rows])
            np.testing.assert_array_equal(b[label], data[rows])
        assert set(to_torch(b)) == {"x", "y"}  # coordinates stay numpy, whatever their dtype


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_named_cftime_coordinate_in_a_v2_or_v3_store_decodes_like_xarray(
    tmp_path: Path, zarr_format: int
) -> None:
    root = _write_calendar_store(
        tmp_path / "v.zarr", "360_day", "1850-01-01", "6h", "hours since 1850-01-01", zarr_format
    )
    want = _xr_time(root)
    geom = open_geometries(root)["t2m"]
    pipe = insitu_pipeline(root, split_by_chunk(geom), ["t2m"], batch_size=8, coords=["time"])
    try:
        for b in pipe:
            _assert_same_dates(b.coords["t2m"]["time"], want[b.sample_indices["t2m"]])
    finally:
        pipe.close()


def _raw_store(path: Path, raw: np.ndarray, attrs: dict[str, Any], zarr_format: int = 3) -> Path:
    """A store whose time holds ``raw`` numbers with CF ``attrs``, as a model's writer stores
    them (xarray writes the numbers as they are)."""
    rng = np.random.default_rng(0)
    ds = xr.Dataset(
        {"t2m": (("time", "lat"), rng.standard_normal((len(raw), 3)).astype(np.float32))},
        coords={"time": ("time", raw, attrs), "lat": [10.0, 20.0, 30.0]},
    )
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, consolidated=False,
               encoding={"t2m": {"chunks": (SPC, 3)}})  # fmt: skip
    return path


@pytest.mark.parametrize("calendar", [None, *sorted({c for c, *_ in CASES})], ids=lambda c: str(c))
@pytest.mark.parametrize(
    ("units", "raw"),
    [
        ("days since 0001-01-01", np.arange(N_TIME, dtype=np.int32) + 730_000),
        ("hours since 1850-01-01 00:00:00", np.arange(N_TIME, dtype=np.int64) * 6 + 1_314_900),
        ("days since 0001-01-01", np.arange(N_TIME) * 0.25 + 730_000),
    ],
    ids=["int32-days-0001", "int64-hours-1850", "float-days-0001"],
)
def test_stored_numbers_in_every_calendar_decode_to_xarrays_dates(
    tmp_path: Path, calendar: str | None, units: str, raw: np.ndarray
) -> None:
    attrs = {"units": units, **({"calendar": calendar} if calendar else {})}
    root = _raw_store(tmp_path / "r.zarr", raw, attrs)
    assert dict(zarr.open_array(root / "time", mode="r").attrs)["units"] == units  # as written
    got = open_coordinates(root, open_geometries(root)["t2m"])["time"]
    _assert_same_dates(got.values, _xr_time(root))


@pytest.mark.parametrize(
    ("raw", "attrs", "kind"),
    [
        (np.arange(N_TIME) * 0.25, {"units": "days since 2000-01-01", "calendar": "noleap"}, "O"),
        (np.arange(N_TIME) * 6.0, {"units": "hours since 1500-01-01"}, "O"),
        (np.arange(N_TIME) + 730000.0, {"units": "days since 0001-01-01"}, "M"),
        (np.arange(N_TIME) * 6.0, {"units": "hours since 2000-01-01", "calendar": "julian"}, "O"),
    ],
    ids=["noleap-float", "standard-pre1582", "standard-far-reference", "julian"],
)
def test_a_missing_time_is_none_among_cftime_dates_and_nat_among_datetime64(
    tmp_path: Path, raw: np.ndarray, attrs: dict[str, Any], kind: str
) -> None:
    """A NaN time: xarray writes a missing cftime date (``None``) as NaN, but reading it back,
    xarray 2026.9 gives the reference date there (cftime masks it, ``np.asarray`` drops the
    mask) or fails (``"days since 0001-01-01"``); here it is ``None`` (cftime dates) or ``NaT``
    (``datetime64``) and every other time is xarray's."""
    raw = raw.copy()
    raw[5] = np.nan
    root = _raw_store(tmp_path / "m.zarr", raw, attrs)
    got = open_coordinates(root, open_geometries(root)["t2m"])["time"].values
    assert got.dtype.kind == kind
    if kind == "O":
        assert got[5] is None and all(g is not None for g in np.delete(got, 5))
    else:
        assert np.isnat(got[5]) and not np.isnat(np.delete(got, 5)).any()
    whole = raw.copy()
    whole[5] = raw[4]  # xarray's decoding of the same numbers without the missing one
    want = _xr_time(_raw_store(tmp_path / "w.zarr", whole, attrs))
    _assert_same_dates(np.delete(got, 5), np.delete(want, 5))
    off = time_offsets(got, "1h", epoch="2000-01-01")
    assert off[5] == MISSING_OFFSET and (np.delete(off, 5) != MISSING_OFFSET).all()


def test_an_integer_fill_value_marks_a_missing_cftime_date(tmp_path: Path) -> None:
    raw = np.arange(N_TIME, dtype=np.int64) * 6
    raw[7] = -9999
    attrs = {"units": "hours since 1850-01-01", "calendar": "360_day", "_FillValue": -9999}
    got = decode_cf(raw, attrs, name="time")
    assert got[7] is None
    clean = decode_cf(np.arange(N_TIME, dtype=np.int64) * 6, {**attrs, "_FillValue": None})
    _assert_same_dates(np.delete(got, 7), np.delete(clean, 7))
    with pytest.raises(OverflowError):  # xarray cannot decode it at all
        xr.decode_cf(xr.Dataset(coords={"time": ("time", raw, attrs)})).time.values  # noqa: B018


def test_standard_dates_in_range_need_no_cftime_and_others_say_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cftime", None)  # as if it were not installed
    hours = np.arange(4, dtype=np.int64) * 6
    got = decode_cf(hours, {"units": "hours since 2000-01-01"}, name="time")
    want = np.datetime64("2000-01-01", "ns") + hours.astype("m8[h]")
    np.testing.assert_array_equal(got, want)
    assert time_offsets(got, "6h").tolist() == (np.arange(4) + 10957 * 4).tolist()
    for calendar in ("noleap", "360_day", "julian"):
        with pytest.raises(ModuleNotFoundError, match=r"'time'.*pip install cftime"):
            decode_cf(hours, {"units": "hours since 2000-01-01", "calendar": calendar}, name="time")


def test_without_cftime_a_default_coordinate_is_left_out_saying_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = _write_calendar_store(
        tmp_path / "n.zarr", "noleap", "2001-02-20", "6h", "hours since 1850-01-01"
    )
    geom = open_geometries(root)["t2m"]
    monkeypatch.setitem(sys.modules, "cftime", None)  # as if it were not installed
    with pytest.raises(ModuleNotFoundError, match="pip install cftime"):
        insitu_pipeline(root, split_by_chunk(geom), ["t2m"], batch_size=8, coords=["time"])
    with caplog.at_level(logging.WARNING, logger="insitubatch_nodes.io.coords"):
        pipe = insitu_pipeline(root, split_by_chunk(geom), ["t2m"], batch_size=8)
    try:
        assert next(iter(pipe)).coords == {}  # it still trains
    finally:
        pipe.close()
    assert "pip install cftime" in caplog.text


def test_nanoseconds_in_a_cftime_calendar_are_read_at_microseconds() -> None:
    """xarray refuses ``nanoseconds since`` in a cftime calendar (cftime counts microseconds at
    the finest); whole microseconds read exactly, finer ones round to cftime's resolution."""
    us = np.arange(N_TIME, dtype=np.int64) * 90_000_000  # 90 s steps
    want = decode_cf(us, {"units": "microseconds since 2000-02-28", "calendar": "noleap"})
    ns = {"units": "nanoseconds since 2000-02-28", "calendar": "noleap"}
    _assert_same_dates(decode_cf(us * 1000, ns), want)
    _assert_same_dates(decode_cf(us * 1000 + 3, ns), want)
    with pytest.raises(ValueError, match="nanoseconds"):
        xr.decode_cf(xr.Dataset(coords={"time": ("time", us * 1000, ns)}))


# every spelling of a unit before "since" that xarray (numpy's route: a plural name, "s" added
# to a singular) or cftime (its abbreviations; months in 360_day, common_years in noleap) reads,
# and spellings that neither reads; the oracle says which are which, per calendar
UNIT_WORDS = [
    *("days", "day", "d", "hours", "hour", "hr", "hrs", "h", "minutes", "minute", "min"),
    *("mins", "seconds", "second", "sec", "secs", "s", "milliseconds", "millisecond"),
    *("millisec", "millisecs", "msec", "msecs", "ms", "microseconds", "microsecond"),
    *("microsec", "microsecs", "nanoseconds", "nanosecond", "months", "month"),
    *("common_years", "common_year", "years", "year", "yr", "weeks", "week", "w", "m", "mon"),
    *("us", "usec", "ns", "nanosec", "nanosecs", "hourss", "ds"),
]


def _xr_reads(units: str, calendar: str) -> bool:
    """Whether xarray decodes ``units`` in ``calendar`` to dates (what ``xr.open_zarr`` calls)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return decode_cf_datetime(np.arange(3.0), units, calendar).dtype.kind in "MO"
    except Exception:  # (KeyError, ValueError, OutOfBoundsDatetime...: xarray's refusals)
        return False


@pytest.mark.parametrize("calendar", ["standard", "noleap", "360_day"])
def test_every_time_unit_word_xarray_reads_decodes_to_its_dates_and_the_others_are_refused(
    tmp_path: Path, calendar: str
) -> None:
    """Each word in lower case as fractional float64 offsets (xarray reads cftime's
    abbreviations with cftime, at microseconds, and the plural names with numpy, at
    nanoseconds: "1.001 h" and "1.001 hours" are other dates) and in upper or capitalised case as
    int64; a word xarray refuses is refused, saying which words are read."""
    fractional = np.array([0.0, 1 / 3, 2.5, 1.001, 0.123456789, -77.7, 12345.678])
    whole = np.array([0, 1, 2, 1000, 7, -77, 12345], np.int64)
    cases = [(w, fractional) for w in UNIT_WORDS]
    cases += [((w.upper(), w.capitalize())[i % 2], whole) for i, w in enumerate(UNIT_WORDS)]
    coords: dict[str, Any] = {}
    for word, raw in cases:
        attrs = {"units": f"{word} since 2000-01-01", "calendar": calendar}
        if _xr_reads(attrs["units"], calendar):
            coords[f"t{len(coords)}"] = (f"t{len(coords)}", raw, attrs)
        elif word.lower() not in ("nanoseconds", "nanosecond"):  # (read at microseconds: above)
            with pytest.raises(ValueError, match=rf"time unit '{word}'.* is not supported"):
                decode_cf(raw, attrs, name="time")
    assert len(coords) >= 2 * 28  # (cftime's 28 spellings, in two cases, in every calendar)
    data = {f"v{k[1:]}": (k, np.zeros(len(whole), np.float32)) for k in coords}
    root = tmp_path / "u.zarr"
    xr.Dataset(data, coords=coords).to_zarr(root, zarr_format=3, consolidated=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray warns when it keeps cftime dates)
        with xr.open_zarr(root, consolidated=False) as ds:
            want = {k: np.asarray(ds[k].values) for k in coords}
    geoms = open_geometries(root)
    for name, (_, _, attrs) in coords.items():
        got = open_coordinates(root, geoms[f"v{name[1:]}"])[name].values
        assert want[name].dtype.kind in "MO", attrs
        try:
            _assert_same_dates(got, want[name])
        except AssertionError as exc:
            raise AssertionError(f"{attrs}: {got} != {want[name]}") from exc


def test_a_calendar_that_is_not_cf_or_a_date_the_calendar_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"calendar 'martian' is not supported.*'360_day'"):
        decode_cf(np.arange(3), {"units": "days since 2000-01-01", "calendar": "martian"})
    with pytest.raises(ValueError, match=r"cannot decode .*2001-02-29.* calendar 'noleap'"):
        decode_cf(np.arange(3), {"units": "days since 2001-02-29", "calendar": "noleap"})
    with pytest.raises(ValueError, match=r"cannot decode .*1582-10-10.* calendar 'standard'"):
        decode_cf(np.arange(3), {"units": "days since 1582-10-10"})  # the reform's gap


@pytest.mark.parametrize("calendar", ["noleap", "all_leap", "360_day", "julian", "standard"])
def test_a_window_by_date_selects_the_samples_xarray_compares_inside_it(
    tmp_path: Path, calendar: str
) -> None:
    root = _write_calendar_store(
        tmp_path / "w.zarr", calendar, "1400-02-20", "6h", "hours since 1400-01-01"
    )
    t = _xr_time(root)
    assert t.dtype == object
    geom = open_geometries(root)["t2m"]
    time = open_coordinates(root, geom)["time"]
    assert time.calendar == t[0].calendar
    lo, hi = "1400-02-28T12", "1400-03-05"
    date = type(t[0])
    inside = np.flatnonzero([date(1400, 2, 28, 12) <= x < date(1400, 3, 5) for x in t])
    i0, i1 = int(inside[0]), int(inside[-1]) + 1
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=(lo, hi), coord=time)
    assert manifest.sample_range == (i0, i1)
    assert manifest.chunks("train") == list(range(i0 // SPC, (i1 - 1) // SPC + 1))
    for bounds in [
        (date(1400, 2, 28, 12), date(1400, 3, 5)),  # the calendar's own dates
        (datetime.datetime(1400, 2, 28, 12), datetime.datetime(1400, 3, 5)),  # read by fields
        (np.datetime64("1400-02-28T12"), np.datetime64("1400-03-05")),
    ]:
        again = split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=bounds, coord=time)
        assert again == manifest
    with pytest.raises(TypeError, match="must be a date"):
        split_by_chunk(geom, sample_range=(0, 10), coord=time)
    with pytest.raises(ValueError, match=r"no sample .* lies in"):
        split_by_chunk(geom, sample_range=("1500-01-01", "1501-01-01"), coord=time)
    with pytest.raises(ValueError, match="start < stop"):
        split_by_chunk(geom, sample_range=(hi, lo), coord=time)
    if calendar in ("noleap", "julian"):  # a date the calendar lacks, another calendar's date
        with pytest.raises(ValueError, match="is not a date of calendar"):
            time.index_range("1401-02-29" if calendar == "noleap" else "1400-02-30", hi)
        with pytest.raises(TypeError, match="is a date of calendar '360_day'"):
            time.index_range(cftime.Datetime360Day(1400, 2, 28), hi)


def test_a_window_by_date_in_360_day_can_name_february_30th(tmp_path: Path) -> None:
    root = _write_calendar_store(
        tmp_path / "w.zarr", "360_day", "2001-02-20", "6h", "hours since 1850-01-01"
    )
    t = _xr_time(root)
    time = open_coordinates(root, open_geometries(root)["t2m"])["time"]
    i0, i1 = time.index_range("2001-02-30", "2001-03-02T06")
    d = cftime.Datetime360Day
    assert (t[i0], t[i1 - 1], t[i0 - 1]) == (d(2001, 2, 30), d(2001, 3, 2), d(2001, 2, 29, 18))
    missing = Coordinate("time", np.array([*t[:3], None, *t[4:]], dtype=object))
    with pytest.raises(ValueError, match="has missing values"):
        missing.index_range("2001-02-30", "2001-03-02")
    shuffled = Coordinate("time", t[[0, 2, 1, *range(3, len(t))]])
    with pytest.raises(ValueError, match=r"is not monotonic .*sample 2"):
        shuffled.index_range("2001-02-30", "2001-03-02")


@pytest.mark.parametrize(
    "calendar",
    ["standard", "proleptic_gregorian", "noleap", "all_leap", "360_day", "julian"],
)
def test_time_offsets_count_each_calendars_own_elapsed_time_as_cftime_does(
    calendar: str,
) -> None:
    hourly = xr.date_range(
        "1999-12-30", periods=24 * 400, freq="1h", calendar=calendar, use_cftime=True
    )
    dates = np.asarray(hourly.values)
    oracle = cftime.date2num(dates, "hours since 1970-01-01", calendar)
    np.testing.assert_array_equal(time_offsets(dates, "1h"), oracle)
    np.testing.assert_array_equal(time_offsets(dates, "h"), oracle)
    six = dates[::6]
    np.testing.assert_array_equal(time_offsets(six, "6h"), oracle[::6] // 6)
    for unit in (np.timedelta64(6, "h"), datetime.timedelta(hours=6), "360min"):
        np.testing.assert_array_equal(time_offsets(six, unit), oracle[::6] // 6)
    # the anchors of a 6-hourly grid: what xarray's own hour accessor selects
    on_grid = time_offsets(Coordinate("time", dates), "1h") % 6 == 0
    np.testing.assert_array_equal(on_grid, np.asarray(hourly.hour) % 6 == 0)
    # an epoch in the calendar: days since 2000-02-28 (02-29 exists in all but noleap)
    days = time_offsets(dates[::24], "1D", epoch="2000-02-28")
    np.testing.assert_array_equal(
        days, cftime.date2num(dates[::24], "days since 2000-02-28", calendar)
    )
    with pytest.raises(ValueError, match=r"not a whole number of '6h'.*'1s'"):
        time_offsets(dates[1:], "6h")


def test_time_offsets_of_datetime64_are_numpys_own_arithmetic() -> None:
    t = np.datetime64("2020-01-01T00", "ns") + np.arange(48).astype("m8[h]")
    t[7] = np.datetime64("NaT", "ns")
    off = time_offsets(Coordinate("time", t), "1h")
    want = (np.delete(t, 7) - np.datetime64("1970-01-01", "ns")) // np.timedelta64(1, "h")
    assert off[7] == MISSING_OFFSET
    np.testing.assert_array_equal(np.delete(off, 7), want)
    np.testing.assert_array_equal(
        time_offsets(t[::6], "6h")[2:], (np.delete(want, 7)[::6] // 6)[2:]
    )
    seconds = time_offsets(t.astype("M8[s]"), "30min", epoch="2020-01-01T00:30")
    np.testing.assert_array_equal(np.delete(seconds, 7), np.delete(np.arange(48) * 2 - 1, 7))
    with pytest.raises(ValueError, match="not a whole number of '1D'"):
        time_offsets(t, "1D")
    # an epoch of another unit (a month), one whose nanoseconds numpy cannot hold
    np.testing.assert_array_equal(
        time_offsets(t[:7], "1h", epoch=np.datetime64("2020-01")), np.arange(7)
    )
    with pytest.raises(OverflowError, match="choose an epoch near them"):
        time_offsets(t, "1h", epoch="1000-01-01")
    far = np.array(["1000-01-01T06", "3000-01-01T12"], "M8[s]")  # seconds reach far
    np.testing.assert_array_equal(
        time_offsets(far, "6h", epoch="1000-01-01"),
        (far - np.datetime64("1000-01-01", "s")) // np.timedelta64(6, "h"),
    )
    with pytest.raises(ValueError, match="no fixed length"):
        time_offsets(t, "1M")
    with pytest.raises(ValueError, match="positive"):
        time_offsets(t, "-6h")
    with pytest.raises(TypeError, match="needs dates"):
        time_offsets(np.arange(4.0), "1h")


def test_a_coordinate_of_two_calendars_is_refused() -> None:
    mixed = np.array([cftime.DatetimeNoLeap(2000, 1, 1), cftime.Datetime360Day(2000, 1, 2)])
    with pytest.raises(ValueError, match=r"'time'.*calendars \['360_day', 'noleap'\]"):
        Coordinate("time", mixed)


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_lightning_data_module_hands_each_rows_noleap_date_to_its_transform(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule
    from insitubatch_nodes.plan.config import PlanConfig

    root = _write_calendar_store(
        tmp_path / "n.zarr", "noleap", "2001-02-20", "6h", "hours since 1850-01-01"
    )
    want = _xr_time(root)
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def keep(batch: Any) -> dict[str, object]:
        seen.append((batch.sample_indices["t2m"], batch.coords["t2m"]["time"]))
        return to_torch(batch)

    dm = InSituDataModule(
        root,
        ["t2m"],
        (0.75, 0.25, 0.0),
        config=PlanConfig(batch_size=8),
        transform=keep,
        log_report=False,
    )
    dm.setup("fit")
    try:
        n = sum(1 for _ in dm.train_dataloader())
    finally:
        dm.teardown("fit")
    assert n == len(seen) > 0
    for rows, times in seen:
        _assert_same_dates(times, want[rows])
