"""GraphCast's exact year and day progress: ``Forcings(..., convention="graphcast")``.

The oracle is GraphCast's ``graphcast/data_utils.py`` (google-deepmind/graphcast) written
here from its published formulas, step for step and in its dtypes: ``s``, the times as
``datetime64[s]`` in int64; ``get_year_progress``: ``mod(s / 86400 / float64(365.24219), 1)``
cast to float32; ``get_day_progress``: ``mod(mod(s, 86400) / 86400 + deg2rad(lon) / 2π, 1)``
cast to float32; ``featurize_progress``: ``sin``/``cos`` of ``progress * 2π`` in float32.

Added (the package offered no way to GraphCast's year progress, 1.8e-3 of a year off, 0.011 in
sine and cosine): ``convention="graphcast"`` on ``Forcings`` (and on ``year_progress`` /
``local_time``), with GraphCast's names ``day_progress_sin``/``_cos`` accepted under it
(``GRAPHCAST_NAMES`` the five GraphCast forcings), in ``forcing_calendar.py`` (the calendar
forcings split out of ``forcings.py``, at 699 of 700 lines). The default convention and names
are unchanged (the default's values are checked equal to the package's calendar fraction).

Found and fixed: every forcing function cast its times to ``datetime64[ns]``, which silently
wraps a time outside 1677–2262 (a ``datetime64[s]`` or ``[us]`` array a user passes; a store's
such dates decode to cftime dates) around into another: 1600-06-01T06's year progress 0.968
(0.416), its hour 5.58 (6). The functions now take the times in their own unit (at least
seconds), and ``Forcings`` (whose memory is keyed by nanoseconds) refused such times with a
``ValueError`` (since the timeedges trial it computes them, outside its memory):
``test_the_forcing_functions_of_seconds_outside_the_nanosecond_range_are_those_times``,
``test_forcings_compute_times_outside_the_nanosecond_range_rather_than_wrap_them``.

Found and corrected (documentation): ``tests/test_graphcast_trial.py`` said GraphCast's TSI
is 1360.9–1361.5 W m⁻², 4e-4 from the package's 1361; GraphCast's default TSI
(``solar_radiation.era5_tsi_data``, interpolated at the fractional year) is 0.9965 × IFS
41r2's yearly series, 1360.83–1361.91 W m⁻² over 1979–2024: up to 6.7e-4 from 1361
(computed from the published table: ``test_graphcasts_default_tsi_is_a_yearly_series_...``).
docs/model-inputs.md now says so; the package keeps a constant ``irradiance=``.

Tried and found right: the progress against the oracle to float32 precision (≤ 1e-6; measured
5.1e-7 in sin/cos, 3.0e-8 in the year progress) on 400 random times 1979–2024 with sub-second
parts, at leap-year boundaries (1980, 2000, 2020: Feb 28 → Mar 1, Dec 31 → Jan 1), before 1970
(negative seconds); a pipeline's labels and a stack's members across 2019/2020's year end and
leap day, each row's value at xarray's own time for that row; a state saved mid-epoch resumes
into the same batches, and one saved with the default convention is refused by a
``"graphcast"`` stack (values differ); cftime rows refused when the pipeline is built (batch
transform, stack member, ``set_views``), and by the functions; unknown conventions and
``day_progress_*`` without the convention refused with a message naming the fix; NaT gives NaN;
``local_time_*`` under the default convention equal to GraphCast's day progress for whole
seconds (sub-second parts, which GraphCast drops, move it up to 7e-5).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes import stack as make_stack
from insitubatch_nodes.forcing_calendar import GRAPHCAST_YEAR_DAYS
from insitubatch_nodes.forcings import (
    FORCINGS,
    GRAPHCAST_NAMES,
    Forcings,
    cos_solar_zenith,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")
pytest.importorskip("cftime")

pytestmark = pytest.mark.timeout(60)

F32 = 1e-6  # float32 precision of a sine or cosine (of a progress held in float32)

# ---------------------------------------------------------------------------------------------
# The oracle: GraphCast's data_utils, in its dtypes
# ---------------------------------------------------------------------------------------------


def gc_seconds(times: Any) -> np.ndarray:
    return np.asarray(times).astype("datetime64[s]").astype(np.int64)


def gc_year_progress(times: Any) -> np.ndarray:
    years = gc_seconds(times) / 86_400 / np.float64(365.24219)
    return np.mod(years, 1.0).astype(np.float32)


def gc_day_progress(times: Any, lon: Any) -> np.ndarray:
    greenwich = np.mod(gc_seconds(times), 86_400) / 86_400
    return np.mod(greenwich[..., None] + np.deg2rad(lon) / (2 * np.pi), 1.0).astype(np.float32)


def gc_features(progress: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    phase = progress * (2 * np.pi)
    return np.sin(phase), np.cos(phase)


def gc_expected(name: str, times: Any, lat: Any, lon: Any) -> np.ndarray:
    """GraphCast's ``name`` at ``times`` (any shape) on a ``(lat, lon)`` grid."""
    times = np.asarray(times)
    shape = (*times.shape, len(lat), len(lon))
    if name.startswith("year_progress"):
        progress = gc_year_progress(times)[..., None, None]
    else:
        progress = gc_day_progress(times, lon)[..., None, :]
    sin, cos = gc_features(progress)
    return np.broadcast_to(sin if name.endswith("sin") else cos, shape)


LAT = np.array([60.0, 0.0, -60.0])
LON = np.array([-180.0, -97.5, 0.0, 45.25, 179.75])
GC_CALENDAR = ["year_progress_sin", "year_progress_cos", "day_progress_sin", "day_progress_cos"]


def _random_times(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lo = np.datetime64("1979-01-01", "ns").astype(np.int64)
    hi = np.datetime64("2025-01-01", "ns").astype(np.int64)
    return rng.integers(lo, hi, n).astype("datetime64[ns]")  # with sub-second parts


BOUNDARIES = np.array(
    [
        f"{y}-{md}"
        for y in (1980, 2000, 2020, 2021)
        for md in (
            "02-28T18",
            "02-28T23:59:59",
            "02-29T00",
            "02-29T12",
            "03-01T00",
            "12-31T18",
            "12-31T23:59:59",
        )
        if y != 2021 or not md.startswith("02-29")
    ]
    + [
        "1981-01-01T00",
        "2001-01-01T00",
        "2021-01-01T00",
        "2022-01-01T00",
        "1970-01-01T00",
        "1969-12-31T23:59:59.75",
        "1959-06-30T06",
        "1950-01-01T00",
    ],
    dtype="datetime64[ns]",
)


# ---------------------------------------------------------------------------------------------
# The definitions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["random 1979-2024", "leap-year boundaries"])
def test_graphcasts_year_and_day_progress_equal_its_formulas_to_float32_precision(
    where: str,
) -> None:
    times = _random_times(400, 7) if where.startswith("random") else BOUNDARIES
    sun = Forcings("x", lat=LAT, lon=LON, names=GC_CALENDAR, convention="graphcast")
    got = sun.compute(times.reshape(-1, 2) if len(times) % 2 == 0 else times)
    for name in GC_CALENDAR:
        want = gc_expected(name, times, LAT, LON).reshape(got[name].shape)
        assert got[name].dtype == np.float32
        assert np.abs(got[name] - want).max() <= F32, name
    # the progress itself, of the functions
    np.testing.assert_allclose(year_progress(times, convention="graphcast"),
                               gc_year_progress(times), atol=1e-7, rtol=0)  # fmt: skip
    hours = local_time(times, LON, convention="graphcast")[..., 0, :]
    np.testing.assert_allclose(hours / 24, gc_day_progress(times, LON), atol=1e-7, rtol=0)
    # local_time_* are the same under either convention, but for sub-second parts (GraphCast
    # drops them: up to 7e-5 in sin/cos): GraphCast's day progress of whole seconds
    whole = times.astype("datetime64[s]").astype("datetime64[ns]")
    plain = Forcings("x", lat=LAT, lon=LON, names=["local_time_sin", "local_time_cos"])
    for name, values in plain.compute(whole).items():
        want = gc_expected(name.replace("local_time", "day_progress"), times, LAT, LON)
        assert np.abs(values - want).max() <= F32, name


def test_the_default_year_progress_stays_the_calendar_years_and_graphcasts_differs() -> None:
    times = _random_times(400, 8)
    calendar = Forcings("x", lat=LAT, lon=LON, names=["year_progress_sin"])
    graphcast = Forcings("x", lat=LAT, lon=LON, names=["year_progress_sin"],
                         convention="graphcast")  # fmt: skip
    t = pd.DatetimeIndex(times)
    frac = np.asarray((t - t.to_period("Y").start_time) / pd.Timedelta(days=1)) / (
        365 + t.is_leap_year
    )
    want = np.sin(2 * np.pi * np.asarray(frac))
    got = calendar.compute(times)["year_progress_sin"][:, 0, 0]
    assert np.abs(got - want).max() <= 2e-6
    # the two conventions differ (by up to 1.8e-3 of a year, 0.011 in the sine): the option
    # discriminates, and the default is not GraphCast's
    gap = np.abs(graphcast.compute(times)["year_progress_sin"][:, 0, 0] - got).max()
    assert 5e-3 < gap < 0.012
    assert abs(GRAPHCAST_YEAR_DAYS - 365.24219) == 0


def test_graphcasts_default_tsi_is_a_yearly_series_up_to_6_7e_4_from_the_constant_1361() -> None:
    # solar_radiation.era5_tsi_data (the default TsiDataLoader), 1979-2024 rows of its table
    table = 0.9965 * np.array(
        [1366.2747, 1366.6348, 1366.6482, 1366.6951, 1366.2859, 1366.1992, 1365.8103, 1365.6416,
         1365.6379, 1365.7899, 1366.0826, 1366.6479, 1366.5533, 1366.4457, 1366.3021, 1366.0286,
         1365.7971, 1365.6996]  # 1978-1995
        + [1365.6121, 1365.7399, 1366.1021, 1366.3851, 1366.6836, 1366.6022, 1366.6807,
           1366.2300, 1366.0480, 1365.8545, 1365.8107, 1365.7240, 1365.6918] * 3  # 1996-2034
    )  # fmt: skip
    years = np.arange(1978.5, 2035.5)
    span = table[(years > 1978.6) & (years < 2024.6)]
    assert len(span) == 46
    assert round(span.min(), 2) == 1360.83 and round(span.max(), 2) == 1361.91
    assert 6.6e-4 < np.abs(span / 1361.0 - 1).max() < 6.8e-4
    sun = Forcings("x", lat=LAT, lon=LON, names=["toa_incident_solar_radiation"])
    assert sun.irradiance == 1361.0  # GraphCast's _REFERENCE_TSI, a constant


def test_graphcast_convention_is_refused_for_cftime_dates_and_unknown_names() -> None:
    cftime = pytest.importorskip("cftime")
    dates = np.array([cftime.DatetimeNoLeap(2003, 12, 31, 18)], dtype=object)
    with pytest.raises(TypeError, match="convention='graphcast' needs times as numpy datetime64"):
        year_progress(dates, convention="graphcast")
    with pytest.raises(TypeError, match="take convention='calendar'"):
        local_time(dates, LON, convention="graphcast")
    assert np.isfinite(year_progress(dates)).all()  # the default counts its own calendar
    with pytest.raises(ValueError, match=r"convention must be one of \['calendar', 'graphcast'\]"):
        Forcings("x", lat=LAT, lon=LON, convention="GraphCast")
    with pytest.raises(ValueError, match="day_progress_\\* take convention='graphcast'"):
        Forcings("x", lat=LAT, lon=LON, names=["day_progress_sin"])
    with pytest.raises(ValueError, match="convention must be one of"):
        year_progress(np.array(["2020-01-01"], "datetime64[ns]"), convention="era5")
    nat = np.array(["2020-01-01T06", "NaT"], "datetime64[ns]")
    assert np.isnan(year_progress(nat, convention="graphcast")[1])
    got = Forcings("x", lat=LAT, lon=LON, names=GC_CALENDAR, convention="graphcast").compute(nat)
    for name in GC_CALENDAR:
        assert np.isnan(got[name][1]).all() and np.isfinite(got[name][0]).all(), name


# ---------------------------------------------------------------------------------------------
# In a pipeline
# ---------------------------------------------------------------------------------------------


def _to_zarr(ds: Any, path: Path, chunks: dict[str, tuple[int, ...]], **enc: Any) -> Path:
    encoding = {v: {"chunks": c} for v, c in chunks.items()} | enc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(path, encoding=encoding, zarr_format=3, consolidated=False)
    return path


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-hourly across 2019/2020's year end and 2020-02-29: ``2t (time, lat, lon)``."""
    times = np.concatenate([pd.date_range("2019-12-30", periods=16, freq="6h"),
                            pd.date_range("2020-02-28", periods=16, freq="6h")])  # fmt: skip
    rng = np.random.default_rng(1)
    ds = xr.Dataset({"2t": (("time", "lat", "lon"), rng.normal(280, 3, (32, 3, 5)))},
                    coords={"time": times, "lat": LAT, "lon": LON}).astype("float32")  # fmt: skip
    return _to_zarr(ds, tmp_path_factory.mktemp("gc") / "era5.zarr", {"2t": (4, 3, 5)})


def _times(root: Path) -> np.ndarray:
    return np.asarray(xr.open_zarr(root, consolidated=False).time.values)


def test_graphcast_forcings_as_labels_and_as_stack_members_are_each_rows_own(era5: Path) -> None:
    g = open_geometries(era5)
    times = _times(era5)
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    labels = Forcings("x", view=g["2t"], names=GRAPHCAST_NAMES, convention="graphcast",
                      prefix="gc_")  # fmt: skip
    x = make_stack({"2t": g["2t"].window([-1, 0]),
                    "sun": Forcings("x", view=g["2t"], names=GRAPHCAST_NAMES,
                                    convention="graphcast")})  # fmt: skip
    assert x.channels == ("2t", *GRAPHCAST_NAMES)
    pipe = insitu_pipeline(era5, manifest, {"x": x}, batch_size=8, batch_transforms=[labels])
    seen = []
    for batch in Loader(pipe):
        at = times[batch.sample_indices["x"]]  # xarray's time of each row's steps
        np.testing.assert_array_equal(batch.coords["x"]["time"], at)
        for c, name in enumerate(GRAPHCAST_NAMES[1:], start=2):
            want = gc_expected(name, at, LAT, LON)
            assert np.abs(batch["x"][:, :, c] - want).max() <= F32, name
            assert np.abs(batch[f"gc_{name}"] - want).max() <= F32, name
        np.testing.assert_array_equal(batch["x"][:, :, 1], batch["gc_toa_incident_solar_radiation"])
        seen += list(at.ravel())
    pipe.close()
    days = set(pd.DatetimeIndex(seen).strftime("%m-%d"))
    assert {"12-31", "01-01", "02-29", "03-01"} <= days


def _state_after(pipe: Any, k: int) -> tuple[dict[str, Any], Any]:
    loader = Loader(pipe)
    it = iter(loader)
    for _ in range(k):
        next(it)
    return json.loads(json.dumps(loader.state_dict())), next(it)


def test_a_graphcast_stack_resumes_exactly_and_refuses_a_state_of_the_calendar_convention(
    era5: Path,
) -> None:
    g = open_geometries(era5)
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    names = ["year_progress_sin", "day_progress_cos"]

    def build(convention: str) -> Any:
        calendar = ["year_progress_sin", "local_time_cos"]
        mine = names if convention == "graphcast" else calendar
        sun = Forcings("x", view=g["2t"], convention=convention, names=mine)
        x = make_stack({"2t": g["2t"], "sun": sun})
        return insitu_pipeline(era5, manifest, {"x": x}, batch_size=4, seed=5)

    with build("graphcast") as pipe:
        state, want = _state_after(pipe, 3)
    with build("graphcast") as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        got = next(iter(loader))
    np.testing.assert_array_equal(got.sample_indices["x"], want.sample_indices["x"])
    np.testing.assert_array_equal(got["x"], want["x"])
    # a state saved by the calendar convention's stack: other year-progress values under the
    # same channel name... refused mid-epoch, as another period of the radiation is
    with build("calendar") as pipe:
        state, _ = _state_after(pipe, 2)
    with build("graphcast") as pipe, pytest.raises(ValueError, match="static members"):
        loader = Loader(pipe)
        loader.load_state_dict(state)
        next(iter(loader))


def test_graphcast_forcings_of_cftime_rows_are_refused_when_the_pipeline_is_built(
    tmp_path: Path,
) -> None:
    times = xr.date_range("2003-12-29", periods=8, freq="6h", calendar="noleap", use_cftime=True)
    ds = xr.Dataset({"2t": (("time", "lat", "lon"), np.zeros((8, 3, 5), "float32"))},
                    coords={"time": times, "lat": LAT, "lon": LON})  # fmt: skip
    enc = {"time": {"units": "hours since 2000-01-01", "calendar": "noleap"}}
    root = _to_zarr(ds, tmp_path / "noleap.zarr", {"2t": (4, 3, 5)}, **enc)
    g = open_geometries(root)
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    sun = Forcings("x", view=g["2t"], names=["local_time_sin"], convention="graphcast")
    with pytest.raises(TypeError, match="convention='graphcast' counts seconds since 1970"):
        insitu_pipeline(root, manifest, {"x": g["2t"]}, batch_size=4, batch_transforms=[sun])
    x = make_stack({"2t": g["2t"], "sun": sun})
    with pytest.raises(TypeError, match="take convention='calendar'"):
        insitu_pipeline(root, manifest, {"x": x}, batch_size=4)
    calendar = Forcings("x", view=g["2t"], names=["local_time_sin", "year_progress_cos"])
    with insitu_pipeline(root, manifest, {"x": g["2t"]}, batch_size=4) as pipe:
        with pytest.raises(TypeError, match="convention='graphcast'"):
            pipe.set_views({"x": x})
        pipe.set_views({"x": make_stack({"2t": g["2t"], "sun": calendar})})
        assert next(iter(pipe)).channels["x"] == ["2t", "local_time_sin", "year_progress_cos"]
    assert FORCINGS == ("toa_incident_solar_radiation", "cos_solar_zenith", "local_time_sin",
                        "local_time_cos", "year_progress_sin", "year_progress_cos")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Times outside datetime64[ns]'s range
# ---------------------------------------------------------------------------------------------

FAR = np.array(["1600-06-01T06", "1600-06-21T12", "2300-06-21T12"], dtype="datetime64[s]")


def test_the_forcing_functions_of_seconds_outside_the_nanosecond_range_are_those_times() -> None:
    # before, every function cast the times to datetime64[ns], silently wrapping around a time
    # outside 1677-2262 (a datetime64[s] or [us] array; xarray's own decoding gives them
    # cftime dates, a user's numpy does not): 1600-06-01T06's year progress 0.968, its hour 5.58
    np.testing.assert_allclose(year_progress(FAR[:1]), (152 + 0.25) / 366, rtol=1e-12)
    np.testing.assert_allclose(local_time(FAR, [0.0, 90.0])[:, 0], [[6, 12], [12, 18], [12, 18]])
    # the Sun near the zenith over the tropic of Cancer at the June solstice's noon (USNO's
    # formula, less exact so far from 2000, still within a degree)
    assert (cos_solar_zenith(FAR[1:], [23.44], [0.0])[:, 0, 0] > np.cos(np.radians(1.5))).all()
    tisr = toa_incident_solar_radiation(FAR[1:], [90.0], [0.0])[:, 0, 0]  # polar day, ~constant
    np.testing.assert_allclose(tisr, 1361 * 3600 * np.sin(np.radians(23.44)) / 1.016**2,
                               rtol=2e-2)  # fmt: skip
    # within the range, any unit gives the nanoseconds' values
    near = np.array(["1979-02-28T18:00:01", "2024-12-31T23"], dtype="datetime64[s]")
    for f in (year_progress, lambda t: local_time(t, LON), lambda t: cos_solar_zenith(t, LAT, LON)):
        np.testing.assert_array_equal(f(near), f(near.astype("datetime64[ns]")))


def test_forcings_compute_times_outside_the_nanosecond_range_rather_than_wrap_them() -> None:
    sun = Forcings("x", lat=LAT, lon=LON, names=["year_progress_sin"])
    np.testing.assert_allclose(  # (before the timeedges trial: refused with a ValueError)
        sun.compute(FAR)["year_progress_sin"][:, 0, 0],
        np.sin(2 * np.pi * year_progress(FAR)),
        atol=2e-7,
    )
    near = np.array(["1979-02-28T18", "NaT"], dtype="datetime64[s]")
    got = sun.compute(near)["year_progress_sin"]
    np.testing.assert_array_equal(
        got, sun.compute(near.astype("datetime64[ns]"))["year_progress_sin"]
    )


def test_graphcast_day_progress_of_a_grid_of_points_is_each_points_own(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lat, lon = rng.uniform(-90, 90, 7), rng.uniform(-180, 180, 7)
    times = pd.date_range("2020-12-31T12", periods=8, freq="6h")
    ds = xr.Dataset(
        {"2t": (("time", "values"), rng.normal(280, 3, (8, 7)).astype("float32"))},
        coords={"time": times, "latitude": ("values", lat), "longitude": ("values", lon)},
    )
    root = _to_zarr(ds, tmp_path / "points.zarr", {"2t": (2, 7)})
    g = open_geometries(root)
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    sun = Forcings("x", view=g["2t"], names=GC_CALENDAR, convention="graphcast")
    pipe = insitu_pipeline(root, manifest, {"x": g["2t"]}, batch_size=8, batch_transforms=[sun])
    batch = next(iter(pipe))
    pipe.close()
    at = _times(root)[batch.sample_indices["x"]]
    for name in GC_CALENDAR:
        want = gc_expected(name, at, [0.0], lon)[:, 0]  # (batch, points)
        assert batch[name].shape == (8, 7)
        assert np.abs(batch[name] - want).max() <= F32, name
