"""Model inputs as an ML engineer uses them, found wrong by a black-box trial.

xarray (on the same store) and numpy are the oracles; the Sun's position in the forcings'
checks is NOAA's solar calculator (after Meeus), an algorithm other than the package's USNO
one. The stores are tiny and built once per module.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from insitubatch_nodes import (
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.forcings import (
    Forcings,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)

xr = pytest.importorskip("xarray")
cftime = pytest.importorskip("cftime")
pd = pytest.importorskip("pandas")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t2m (time, lat, lon)``, ``z (time, level, lat, lon)`` and a static land-sea mask
    that is all sea (a constant field) over a latitude descending from north to south."""
    rng = np.random.default_rng(0)
    lat = np.array([60.0, 20.0, -20.0, -60.0])
    lon = np.array([0.0, 90.0, 180.0, 270.0])
    ds = xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), 280 + rng.standard_normal((8, 4, 4))),
            "z": (("time", "level", "lat", "lon"), rng.standard_normal((8, 3, 4, 4))),
            "lsm": (("lat", "lon"), np.zeros((4, 4))),
        },
        coords={"time": pd.date_range("2020-01-01", periods=8, freq="6h"), "lat": lat,
                "lon": lon, "level": [1000, 500, 250]},
    )  # fmt: skip
    path = tmp_path_factory.mktemp("inputs") / "trial.zarr"
    enc = {v: {"dtype": "float32", "chunks": ds[v].shape} for v in ("lsm",)}
    enc |= {v: {"dtype": "float32", "chunks": (2, *ds[v].shape[1:])} for v in ("t2m", "z")}
    ds.to_zarr(path, encoding=enc, consolidated=False, zarr_format=3)
    return path


def test_stack_normalize_makes_a_constant_channel_zero_not_nan(store: Path) -> None:
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    members = {"t2m": g["t2m"], "lsm": g["lsm"], "z": g["z"].isel(level=[0, 2])}
    stats = fit_statistics(store, manifest, members)
    assert stats.std["lsm"] == 0.0
    pipe = insitu_pipeline(store, manifest, {"x": stack(members, normalize=stats)},
                           batch_size=4, coords=())  # fmt: skip
    batch = next(iter(pipe))
    pipe.close()
    ds = xr.open_zarr(store, consolidated=False)
    idx = batch.sample_indices["x"]
    t2m = (ds.t2m.values[idx] - stats.mean["t2m"]) / stats.std["t2m"]
    np.testing.assert_allclose(batch.arrays["x"][:, 0], t2m, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(batch.arrays["x"][:, 1], 0.0)  # was NaN: 0 / 0


@pytest.mark.parametrize(
    ("calendar", "date", "day_of_year", "year_days"),
    [
        ("noleap", (2004, 3, 1, 12), 59.5, 365),  # a leap year in numpy's calendar
        ("360_day", (2001, 2, 30, 6), 59.25, 360),  # no such date in numpy's calendar
        ("360_day", (2001, 12, 30, 18), 359.75, 360),
        ("all_leap", (2001, 12, 31, 12), 365.5, 366),
        ("julian", (1900, 3, 1, 0), 60.0, 366),  # 1900 is a Julian leap year
    ],
)
def test_year_progress_and_local_time_count_a_cftime_calendars_own_year(
    calendar: str, date: tuple[int, int, int, int], day_of_year: float, year_days: int
) -> None:
    times = np.array([[cftime.datetime(*date, calendar=calendar)]], dtype=object)
    np.testing.assert_allclose(year_progress(times), [[day_of_year / year_days]], rtol=1e-12)
    lon = np.array([-180.0, 0.0, 90.0])
    np.testing.assert_allclose(local_time(times, lon)[0, 0, 0], (date[3] + lon / 15) % 24)
    f = Forcings("x", lat=[0.0], lon=lon, names=["year_progress_cos", "local_time_sin"])
    out = f.compute(times)
    assert out["year_progress_cos"].shape == (1, 1, 1, 3)
    np.testing.assert_allclose(
        out["year_progress_cos"], np.cos(2 * np.pi * day_of_year / year_days), atol=1e-6
    )
    with pytest.raises(TypeError, match="no solar position"):
        Forcings("x", lat=[0.0], lon=lon, names=["cos_solar_zenith"]).compute(times)


def _noaa_flux(times: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """``S / r² · max(cos θ, 0)`` by NOAA's solar calculator (Meeus' low-precision Sun:
    mean longitude and anomaly, equation of centre, apparent longitude, corrected obliquity,
    equation of time), ``(time, lat, lon)``."""
    rad = np.pi / 180
    jc = (times.astype("datetime64[ns]").astype(np.int64) / 86400e9 + 2440587.5 - 2451545) / 36525
    l0 = (280.46646 + jc * (36000.76983 + jc * 0.0003032)) % 360
    m = 357.52911 + jc * (35999.05029 - 0.0001537 * jc)
    e = 0.016708634 - jc * (0.000042037 + 0.0000001267 * jc)
    c = np.sin(m * rad) * (1.914602 - jc * (0.004817 + 0.000014 * jc))
    c += np.sin(2 * m * rad) * (0.019993 - 0.000101 * jc) + np.sin(3 * m * rad) * 0.000289
    r = 1.000001018 * (1 - e * e) / (1 + e * np.cos((m + c) * rad))
    omega = 125.04 - 1934.136 * jc
    app = l0 + c - 0.00569 - 0.00478 * np.sin(omega * rad)
    eps = 23 + (26 + (21.448 - jc * (46.815 + jc * (0.00059 - jc * 0.001813))) / 60) / 60
    eps += 0.00256 * np.cos(omega * rad)
    dec = np.arcsin(np.sin(eps * rad) * np.sin(app * rad))
    y = np.tan(eps / 2 * rad) ** 2
    eot = 4 / rad * (
        y * np.sin(2 * l0 * rad) - 2 * e * np.sin(m * rad)
        + 4 * e * y * np.sin(m * rad) * np.cos(2 * l0 * rad)
        - 0.5 * y * y * np.sin(4 * l0 * rad) - 1.25 * e * e * np.sin(2 * m * rad)
    )  # fmt: skip
    minutes = (times - times.astype("datetime64[D]")).astype("timedelta64[ns]").astype(np.int64)
    tst = minutes[:, None, None] / 60e9 + eot[:, None, None] + 4 * lon[None, None, :]
    phi, d = lat[None, :, None] * rad, dec[:, None, None]
    cos_z = np.sin(phi) * np.sin(d) + np.cos(phi) * np.cos(d) * np.cos((tst / 4 - 180) * rad)
    return 1361.0 * np.maximum(cos_z, 0.0) / r[:, None, None] ** 2


@pytest.mark.parametrize(
    ("end", "period", "lat", "lon"),
    [
        ("1991-03-20T18:31:36", "24h", -85.0, 0.0),  # equinox near the pole: 2.8 % off before
        ("2014-03-17T20:47:10", "6h", 85.0, 200.0),  # 1.5 % off before
        ("2021-08-10T00:00:00", "6h", 66.0, 0.0),
        ("2021-06-21T00:00:00", "1h", 80.0, 0.0),
    ],
)
def test_tisr_over_long_periods_matches_noaa_integrated_minute_by_minute(
    end: str, period: str, lat: float, lon: float
) -> None:
    t = np.array([np.datetime64(end, "ns")])
    seconds = int(pd.Timedelta(period).total_seconds())
    minutes = t[0] - np.arange(seconds // 60, -1, -1).astype("timedelta64[m]")
    flux = _noaa_flux(minutes, np.array([lat]), np.array([lon]))[:, 0, 0]
    want = np.trapezoid(flux, dx=60.0)
    got = toa_incident_solar_radiation(t, [lat], [lon], period=period)[0, 0, 0]
    # USNO's Sun is good to about an arcminute: 3e-4 of cos θ, at most 3e-4 of S · period
    assert abs(got - want) < 1e-4 * 1361 * seconds, (got, want)


SELECTIONS = {
    "near": {"lat": 25.0, "lon": 100.0},  # nearest: 20 and 90
    "near_list": {"level": [700, 260, 1000]},
    "near_tie": {"lat": [0.0, 40.0], "lon": 135.0},  # ties go to the larger value, as pandas
    "near_tol": {"level": [499], "tolerance": 2},
    "step": {"lat": slice(60, -60, 2), "lon": slice(90, None, 2)},
    "back": {"lat": slice(-20, 60, -1), "level": slice(250, None, -2)},
}


def test_sel_nearest_and_slices_with_steps_match_xarray(store: Path) -> None:
    g = open_geometries(store)
    views = {}
    for label, key in SELECTIONS.items():
        method = "nearest" if label.startswith("near") else None
        views[label] = g["z"].sel(**key, method=method) if method else g["z"].sel(**key)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, views, batch_size=4, coords=())
    batch = next(iter(pipe))
    pipe.close()
    z = xr.open_zarr(store, consolidated=False).z
    for label, key in SELECTIONS.items():
        method = "nearest" if label.startswith("near") else None
        want = (z.sel(**key, method=method) if method else z.sel(**key)).values
        np.testing.assert_array_equal(batch.arrays[label], want[batch.sample_indices[label]])
    with pytest.raises(KeyError, match="499"):
        g["z"].sel(level=499, method="nearest", tolerance=0.5)
    with pytest.raises(ValueError, match="nearest"):
        g["z"].sel(lat=slice(60, 0), method="nearest")
    with pytest.raises(ValueError, match="method"):
        g["z"].sel(lat=20.0, method="pad")


def test_forcings_refuse_a_2d_grid_instead_of_flattening_it() -> None:
    lat2d, lon2d = np.meshgrid([-60.0, 0.0, 60.0], [0.0, 90.0, 180.0, 270.0], indexing="ij")
    with pytest.raises(ValueError, match=r"1-D.*\(3, 4\)"):
        Forcings("x", lat=lat2d, lon=lon2d, names=["cos_solar_zenith"])  # was a (12, 12) grid
    f = Forcings("x", lat=lat2d[:, 0], lon=lon2d[0], names=["cos_solar_zenith"])
    times = np.array(["2020-01-01T00"], dtype="datetime64[ns]")
    assert f.compute(times)["cos_solar_zenith"].shape == (1, 3, 4)


def test_fit_statistics_takes_a_stacks_members_forcings_included(store: Path) -> None:
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    sun = Forcings("x", view=g["t2m"], names=["cos_solar_zenith"])
    members = {"t2m": g["t2m"], "sun": sun}
    stats = fit_statistics(store, manifest, members)  # was AttributeError: no window_offsets
    assert sorted(stats.mean) == ["t2m"]
    t2m = xr.open_zarr(store, consolidated=False).t2m.values.astype(np.float64)
    np.testing.assert_allclose(stats.mean["t2m"], t2m.mean(), rtol=1e-12)
    pipe = insitu_pipeline(store, manifest, {"x": stack(members, normalize=stats)}, batch_size=4)
    batch = next(iter(pipe))
    pipe.close()
    want = (t2m[batch.sample_indices["x"]] - t2m.mean()) / t2m.std()
    np.testing.assert_allclose(batch.arrays["x"][:, 0], want, rtol=1e-5, atol=1e-5)
    times = batch.coords["x"]["time"]
    np.testing.assert_array_equal(batch.arrays["x"][:, 1], sun.compute(times)["cos_solar_zenith"])
    with pytest.raises(TypeError, match="'t2m'"):
        fit_statistics(store, manifest, {"t2m": "t2m"})  # type: ignore[dict-item]


@pytest.mark.parametrize("period", ["0h", "-1h"])
def test_forcings_refuse_a_period_that_is_not_positive(period: str) -> None:
    times = np.array(["2020-06-01T12"], dtype="datetime64[ns]")
    with pytest.raises(ValueError, match="positive"):  # was NaN (0h) or negative J m-2
        toa_incident_solar_radiation(times, [0.0], [0.0], period=period)
    with pytest.raises(ValueError, match="positive"):
        Forcings("x", lat=[0.0], lon=[0.0], period=period)


def test_stack_names_channels_of_a_float32_coordinate_as_written(tmp_path: Path) -> None:
    ds = xr.Dataset(
        {"z": (("time", "depth", "lat", "lon"), np.zeros((2, 3, 2, 2), dtype=np.float32))},
        coords={"depth": np.array([0.1, 0.07, 12.5], dtype=np.float32)},
    )
    ds.to_zarr(tmp_path / "f32.zarr", consolidated=False, zarr_format=3)
    g = open_geometries(tmp_path / "f32.zarr")
    x = stack({"z": g["z"].isel(depth=[1, 0, 2]), "t": g["z"].isel(depth=0)})
    assert x.channels == ("z@0.07", "z@0.1", "z@12.5", "t")  # was z@0.07000000029802322
