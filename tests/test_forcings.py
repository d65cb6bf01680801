"""Forcings from time and coordinates, against published solar geometry."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.forcings import (
    FORCINGS,
    SOLAR_IRRADIANCE,
    Forcings,
    cos_solar_zenith,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)
from insitubatch_nodes.synthetic import make_era5_like
from tests.helpers import counting_store

HOUR = np.timedelta64(1, "h")


def test_the_sun_is_overhead_at_the_equinox_sub_solar_point() -> None:
    # March equinox 2023-03-20 21:24 UTC; the equation of time then is -7.5 min, so local
    # apparent noon is at longitude -15 * (21.4 - 12 - 0.125) = -139.1 degrees
    t = np.datetime64("2023-03-20T21:24")
    assert cos_solar_zenith(t, [0.0], [-139.1]).item() > 0.9999
    lon = np.arange(-180.0, 180.0, 0.25)
    overhead = lon[np.argmax(cos_solar_zenith(t, [0.0], lon))]
    assert abs(overhead - -139.1) <= 0.5


def test_polar_night_has_no_sun_and_no_radiation_all_day() -> None:
    day = np.datetime64("2023-12-21T00") + np.arange(24) * HOUR
    lon = np.arange(0.0, 360.0, 30.0)
    assert cos_solar_zenith(day, [80.0, -90.0 + 1e-9], lon)[:, 0].max() < 0
    assert toa_incident_solar_radiation(day, [80.0], lon).max() == 0.0
    assert toa_incident_solar_radiation(day, [-80.0], lon).min() > 0  # midnight sun


def test_at_the_pole_in_june_the_sun_stands_at_the_tilt_of_the_axis_all_day() -> None:
    day = np.datetime64("2023-06-21T00") + np.arange(24) * HOUR
    np.testing.assert_allclose(
        cos_solar_zenith(day, [90.0], [0.0]), np.sin(np.radians(23.44)), atol=2e-4
    )


def test_the_equator_receives_the_irradiance_over_pi_on_an_equinox_day() -> None:
    # daily mean insolation at the equator on an equinox: S / (pi r^2), r = 0.9960 AU on
    # 2023-03-20 (published ephemeris); hourly accumulations in J m-2 sum to the day's energy
    day = np.datetime64("2023-03-20T01") + np.arange(24) * HOUR
    energy = toa_incident_solar_radiation(day, [0.0], [0.0, 120.0]).sum(axis=0) / 86_400
    np.testing.assert_allclose(energy.ravel(), SOLAR_IRRADIANCE / (np.pi * 0.9960**2), rtol=3e-3)


def test_radiation_accumulates_the_flux_over_the_hour_ending_at_the_time() -> None:
    t = np.datetime64("2023-06-01T12:00")
    minutes = t - np.arange(0, 61) * np.timedelta64(1, "m")
    flux = SOLAR_IRRADIANCE * np.maximum(cos_solar_zenith(minutes, [40.0], [10.0]), 0)
    g = np.radians(357.529 + 0.98560028 * 8552.0)  # 8552 days since J2000.0 (USNO)
    r = 1.00014 - 0.01671 * np.cos(g) - 0.00014 * np.cos(2 * g)
    expected = np.trapezoid(flux[::-1].ravel(), dx=60.0) / r**2
    got = toa_incident_solar_radiation(t, [40.0], [10.0]).item()
    assert got == pytest.approx(expected, rel=1e-4)


def test_local_time_and_year_progress_follow_the_clock_and_the_calendar() -> None:
    t = np.datetime64("2023-03-20T06:00")
    np.testing.assert_allclose(local_time(t, [0.0, 90.0, -90.0, 180.0]), [[6.0, 12.0, 0.0, 18.0]])
    times = np.array(["2023-01-01", "2023-07-02T12", "2024-07-02"], dtype="M8[ns]")
    np.testing.assert_allclose(year_progress(times), [0.0, 0.5, 183 / 366])


def test_forcings_come_with_every_batch_from_its_times_without_reading_the_store(
    tmp_path: Path,
) -> None:
    root = tmp_path / "e.zarr"
    make_era5_like(root, n_time=48, n_lat=8, n_lon=16, n_level=2, samples_per_chunk=8)
    geoms = open_geometries(root)
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    box = geoms["z"].isel(level=0, lat=slice(2, 6))
    forcings = Forcings("x", view=box, prefix="f_")
    assert forcings.lat.shape == (4,) and forcings.lon.shape == (16,)
    plain, forced = counting_store(root), counting_store(root)
    for store, transforms in ((plain, []), (forced, [forcings])):
        pipe = insitu_pipeline(
            store, manifest, {"x": box}, batch_size=6, batch_transforms=transforms
        )
        batches = list(pipe)
        pipe.close()
    assert forced.chunk_counts() == plain.chunk_counts()
    for batch in batches:
        times = batch.coords["x"]["time"]
        for name in FORCINGS:
            got = batch.arrays["f_" + name]
            assert got.shape == (len(batch), 4, 16) and got.dtype == np.float32
        np.testing.assert_allclose(
            batch.arrays["f_cos_solar_zenith"],
            cos_solar_zenith(times, forcings.lat, forcings.lon),
            atol=1e-6,
        )
        steps = np.datetime64("2000-01-01") + batch.sample_indices["x"] * 6 * HOUR
        np.testing.assert_array_equal(times, steps)


def test_forcings_refuse_a_grid_whose_latitudes_are_not_latitudes(tmp_path: Path) -> None:
    # a (time, lon, lat) field: its last two axes are longitude and latitude, so taking the
    # first as the latitude computed the Sun at latitudes of -150 and 170 degrees
    zarr = pytest.importorskip("zarr")
    arr = zarr.create_array(
        tmp_path / "s.zarr", shape=(4, 3, 2), chunks=(1, 3, 2), dtype="f4",
        dimension_names=("time", "lon", "lat"),
    )  # fmt: skip
    arr[...] = 0
    view = open_geometries(tmp_path / "s.zarr")[""]
    grid = {"lon": [-150.0, 20.0, 170.0], "lat": [-30.0, 30.0]}
    view = dataclasses.replace(view, coordinates=lambda g, dim: grid[dim])
    with pytest.raises(ValueError, match="latitude"):
        Forcings("x", view=view)
    with pytest.raises(ValueError, match=r"latitudes .* \[-90, 90\]"):
        Forcings("x", lat=[-150.0, 20.0, 170.0], lon=[-30.0, 30.0])


@pytest.mark.parametrize(
    ("period", "seconds", "within"), [("30min", 1800, 0.05), ("1h", 3600, 0.1), ("6h", 21600, 0.5)]
)
def test_the_closed_form_radiation_equals_a_fine_trapezoid_at_every_latitude_and_season(
    period: str, seconds: int, within: float
) -> None:
    # random minutes over a leap year, every latitude from pole to pole (polar day and night,
    # sunrise and sunset inside the period): the mean flux over the period within `within`
    # W m-2 of a 1,000-step trapezoid (the closed form holds the declination at the middle)
    rng = np.random.default_rng(0)
    minutes = rng.integers(0, 366 * 1440, 120) * np.timedelta64(1, "m")
    times = np.datetime64("2020-01-01T00") + minutes
    lat, lon = np.linspace(-90.0, 90.0, 37), np.linspace(0.0, 345.0, 24)
    exact = toa_incident_solar_radiation(times, lat, lon, period=period)
    fine = toa_incident_solar_radiation(times, lat, lon, period=period, bins=1000)
    assert np.abs(exact - fine).max() / seconds < within
    assert exact.min() >= 0.0 and fine.max() > 0.5 * SOLAR_IRRADIANCE * seconds


def test_forcings_compute_each_distinct_time_once_and_remember_it_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pickle

    import insitubatch_nodes.forcings as forcings

    lat, lon = np.linspace(-80, 80, 5), np.linspace(0, 350, 8)
    f = Forcings("x", lat=lat, lon=lon)
    start = np.datetime64("2021-03-20T00:00", "ns")
    hour = np.timedelta64(1, "h")
    # (batch, T) windows overlapping by a step: 4 rows x 2 steps, 5 distinct times
    times = start + hour * (np.arange(4)[:, None] + np.arange(2)[None, :])
    computed: list[int] = []
    real = forcings.Forcings._compute

    def counting(self: Any, t: np.ndarray, g: int = 0) -> dict[str, np.ndarray]:
        computed.append(t.size)
        return real(self, t, g)

    monkeypatch.setattr(forcings.Forcings, "_compute", counting)
    first = f.compute(times)
    again = f.compute(times[::-1])  # a later batch (or epoch) of the same times
    assert computed == [5], "each distinct time once, none again"
    fresh = real(f, times)
    for name in FORCINGS:
        assert first[name].shape == (4, 2, 5, 8) and first[name].dtype == np.float32
        np.testing.assert_array_equal(first[name], fresh[name])
        np.testing.assert_array_equal(again[name], fresh[name][::-1])
    assert len(pickle.loads(pickle.dumps(f))._memos[0]) == 0, "a pickled copy carries nothing"
    monkeypatch.setattr(forcings, "MEMO_BYTES", 3 * 5 * 8 * 4 * len(FORCINGS))
    small = Forcings("x", lat=lat, lon=lon)
    np.testing.assert_array_equal(
        small.compute(times)["cos_solar_zenith"], fresh["cos_solar_zenith"]
    )
    assert len(small._memos[0]) == 3, "the oldest times are forgotten past MEMO_BYTES"
