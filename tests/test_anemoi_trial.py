"""An anemoi-datasets user's trial: the model inputs anemoi gives (windows, strides, missing
dates, statistics and tendency statistics, forcings), taken from the original archive.

The store is ERA5-like as xarray writes it: pressure-level and surface fields, a static
land-sea mask, latitude from north to south, 6-hourly times with one step absent (a gap in
the time axis, as a missing date of anemoi's) and one step all NaN. xarray and numpy on the
same store are the oracles; anemoi's definitions are the conventions checked where the docs
claim them (statistics with ``ddof=0``, tendencies ``x[t] - x[t - delta]`` over dates
``delta`` apart, NaNs skipped).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from insitubatch_nodes import fit_statistics, open_geometries, split_by_chunk

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

GAP = "2020-01-02T12:00"  # a step absent from the time axis
NAN_STEP = "2020-01-03T06:00"  # a step whose 2t is all NaN


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t (time, level, latitude, longitude)``, ``2t (time, latitude, longitude)`` and a
    static ``lsm (latitude, longitude)``; 6-hourly over four days without ``GAP``, chunks of
    four steps, values with a trend so that a 12-hour difference is not a 6-hour one."""
    times = pd.date_range("2020-01-01", "2020-01-04T18:00", freq="6h")
    times = times[times != pd.Timestamp(GAP)]
    rng = np.random.default_rng(0)
    hours = ((times - times[0]) / pd.Timedelta("1h")).to_numpy()
    n = len(times)
    t = 250 + rng.standard_normal((n, 3, 4, 6)) + hours[:, None, None, None]
    t2m = 280 + rng.standard_normal((n, 4, 6)) + 0.5 * hours[:, None, None]
    t2m[list(times).index(pd.Timestamp(NAN_STEP))] = np.nan
    ds = xr.Dataset(
        {
            "t": (("time", "level", "latitude", "longitude"), t.astype("float32")),
            "2t": (("time", "latitude", "longitude"), t2m.astype("float32")),
            "lsm": (("latitude", "longitude"), (rng.random((4, 6)) > 0.5).astype("float32")),
        },
        coords={"time": times, "level": [1000, 850, 500], "latitude": [60.0, 20.0, -20.0, -60.0],
                "longitude": np.arange(0.0, 360.0, 60.0)},
    )  # fmt: skip
    path = tmp_path_factory.mktemp("anemoi") / "era5.zarr"
    enc = {v: {"chunks": (4, *ds[v].shape[1:])} for v in ("t", "2t")}
    ds.to_zarr(path, encoding=enc, consolidated=False, zarr_format=3)
    return path


def _tendency_std(values: np.ndarray, times: np.ndarray, delta: str) -> np.ndarray:
    """anemoi's tendency ``stdev`` per channel: ``x[t] - x[t - delta]`` for every time whose
    time ``delta`` before is in the data (a missing date pairs nothing), NaNs skipped, ddof 0;
    ``values`` ``(time, channel, lat, lon)``."""
    where = {t: i for i, t in enumerate(times)}
    pairs = [(where[t - np.timedelta64(pd.Timedelta(delta))], i) for i, t in enumerate(times)
             if t - np.timedelta64(pd.Timedelta(delta)) in where]  # fmt: skip
    before, after = np.array(pairs).T
    d = values[after].astype(np.float64) - values[before]
    return np.nanstd(d.swapaxes(0, 1).reshape(values.shape[1], -1), axis=1)


def test_fit_statistics_diff_std_pairs_no_two_samples_across_a_gap_in_the_times(
    store: Path,
) -> None:
    """A step absent from the time axis made the samples on either side of it consecutive:
    their 12-hour difference was taken for a 6-hour one (diff_std 50 % over anemoi's tendency
    statistics here, with a strong trend; 0.1 % on two months of a milder one), whether or not
    ``missing=`` made the plan read the times. A one-step difference pairs samples one data
    step apart in time."""
    ds = xr.open_zarr(store, consolidated=False)
    times = ds.time.values
    g = open_geometries(store)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    views = {"t": g["t"], "2t": g["2t"]}
    want_t = _tendency_std(ds.t.values, times, "6h")
    want_2t = _tendency_std(ds["2t"].values[:, None], times, "6h")
    for options in ({}, {"missing": ()}):
        stats = fit_statistics(store, manifest, views, batch_size=5, **options)
        np.testing.assert_allclose(stats.diff_std["t"], want_t, rtol=1e-9)
        np.testing.assert_allclose(stats.diff_std["2t"], want_2t[0], rtol=1e-9)
        mean = ds.t.values.astype(np.float64).mean(axis=(0, 2, 3))
        np.testing.assert_allclose(stats.mean["t"], mean, rtol=1e-12)


def test_fit_statistics_of_a_split_without_samples_is_refused_not_nan(store: Path) -> None:
    """A split that holds no chunk (the dates of another split, fractions that gave it none)
    fitted NaN statistics without a word, and a stack normalised with them delivered NaN
    everywhere; anemoi refuses statistics dates outside the data. It says which split is empty
    and what it holds."""
    g = open_geometries(store)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"split 'val' .* no sample"):
        fit_statistics(store, manifest, {"t": g["t"], "lsm": g["lsm"]}, split="val")
    static = fit_statistics(store, manifest, {"lsm": g["lsm"]}, split="val")  # the field's own
    lsm = xr.open_zarr(store, consolidated=False).lsm.values
    np.testing.assert_allclose(static.mean["lsm"], lsm.astype(np.float64).mean(), rtol=1e-12)


def test_forcings_over_times_named_valid_time_say_to_name_them(store: Path, tmp_path: Path) -> None:
    """ERA5 from the new CDS names its time ``valid_time`` (and its levels
    ``pressure_level``). Forcings, in a stack or as a batch transform, look for ``'time'``,
    and the error said to build the pipeline with ``coords=None`` — what it was built with —
    or ``coords=['time']``, a coordinate the store has not. It names the coordinates the
    batches carry and ``time_name=``, which computes them from ``valid_time``."""
    from insitubatch_nodes import Loader, insitu_pipeline, stack
    from insitubatch_nodes.forcings import Forcings, cos_solar_zenith

    ds = xr.open_zarr(store, consolidated=False).rename(
        {"time": "valid_time", "level": "pressure_level"}
    )
    for name in (*ds.data_vars, *ds.coords):
        ds[name].encoding = {}
    path = tmp_path / "cds.zarr"
    ds.chunk({"valid_time": 4}).to_zarr(path, zarr_format=3, consolidated=False)
    g = open_geometries(path)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    for time_name in ("time", "valid_time"):
        sun = Forcings("x", view=g["2t"], names=["cos_solar_zenith"], time_name=time_name)
        x = stack({"t": g["t"].sel(pressure_level=[500]), "sun": sun})
        alone = Forcings("t", view=g["t"], names=["cos_solar_zenith"], time_name=time_name)
        for views, transforms in (({"x": x}, []), ({"t": g["t"]}, [alone])):
            pipe = insitu_pipeline(path, manifest, views, batch_size=4,
                                   batch_transforms=transforms)  # fmt: skip
            try:
                if time_name == "time":
                    with pytest.raises(KeyError, match=r"valid_time.*time_name='valid_time'"):
                        next(iter(Loader(pipe)))
                    continue
                batch = next(iter(Loader(pipe)))
            finally:
                pipe.close()
            label = next(iter(views))
            times = ds.valid_time.values[batch.sample_indices[label]]
            want = cos_solar_zenith(times, ds.latitude.values, ds.longitude.values)
            got = batch["x"][:, 1] if label == "x" else batch["cos_solar_zenith"]
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_fit_statistics_over_times_it_cannot_read_warns_and_pairs_samples(tmp_path: Path) -> None:
    """Reading the times for diff_std must not make a fit fail where it did not: a calendar
    no one decodes, or float32 times off the whole second, pair consecutive samples (numpy's
    ``np.diff`` along the samples), with a warning that a gap is not seen."""
    import zarr

    group = zarr.open_group(tmp_path / "odd.zarr", mode="w")
    x = group.create_array("x", shape=(8, 3, 4), chunks=(2, 3, 4), dtype="f4",
                           dimension_names=("time", "lat", "lon"))  # fmt: skip
    x[...] = np.random.default_rng(1).standard_normal((8, 3, 4)) ** 3
    want = np.diff(x[...].astype(np.float64), axis=0).std()
    odd = {"foo": np.arange(8) * 6.0, "standard": np.arange(8, dtype="f4") * 6 + 0.001}
    for calendar, hours in odd.items():
        time = group.create_array("time", shape=(8,), chunks=(8,), dtype=hours.dtype,
                                  dimension_names=("time",), overwrite=True)  # fmt: skip
        time[...] = hours
        time.attrs.update(units="hours since 2000-01-01", calendar=calendar)
        g = open_geometries(tmp_path / "odd.zarr")["x"]
        with pytest.warns(UserWarning, match="a gap in the times is not seen"):
            stats = fit_statistics(tmp_path / "odd.zarr", split_by_chunk(g, (1.0, 0, 0)), {"x": g})
        np.testing.assert_allclose(stats.diff_std["x"], want, rtol=1e-6)
