"""A regional forecast model's inputs, as its user builds them, found wrong by a black-box trial.

The trial wrote ERA5/WeatherBench2-like stores with xarray (latitude 90..-90 and -90..90,
longitude 0..360 and -180..180; zarr v3 and v2, grids whole in each object or in tiles, and
sharded) and took latitude/longitude boxes of them with ``sel``: the rows, the static fields,
the forcings and the statistics were compared with xarray's ``sel`` of the same store (numpy in
float64 for the statistics; the package's own forcing formulas at xarray's selected points, and
the whole field's forcings cropped, for the forcings).

Found wrong, and fixed (each test below failed before its fix):

* Forcings on a grid whose axes are not latitude and longitude — a rotated pole's ``rlat`` /
  ``rlon`` (degrees in the rotated frame, the grid of COSMO, ICON-LAM and most regional
  climate models) or a projection's ``y`` / ``x`` — were computed at those axes' values, taken
  for latitudes and longitudes: a rotated grid's solar zenith cosine was 0.68 off at some
  points, with no word. They are refused now (``Forcings`` and a stack's forcing member),
  saying to give ``lat=`` and ``lon=`` where the grid is a regular latitude/longitude one
  named otherwise. ``open_geometries(store)`` of such a store also returned its 2-D ``lat``
  and ``lon`` as static data arrays, where xarray reads them as coordinates (the data
  variables' CF ``coordinates`` attribute names them); they are skipped now, as xarray does.
* A longitude given in the other convention than the coordinate's was taken as a number, as
  xarray's ``sel`` takes it: on an ERA5 0..360 coordinate, ``sel(longitude=slice(-10, 30))``
  (a box over Europe) kept only 0..30, and ``sel(longitude=-3.2, method="nearest")`` (a station
  in the UK) took 0, not 356.75 beside it; on a -180..180 coordinate ``slice(350, 10)`` was
  refused as a box across the seam, told to select ``slice(350, None)``, which selects nothing
  there. Such a slice or nearest value is refused now, saying which box it is in the
  coordinate's convention (``slice(300, 350)``) or that it crosses the seam and which two views
  select it.
* A stack member or a ``Forcings`` whose longitudes are the same places as the first member's
  in the other convention (a mask on -180..180 beside ERA5 on 0..360, east of 180) was refused
  as "at other points", told to select values the member does not have: longitudes are now
  compared as places (modulo 360), and such members stack.
* xarray's station idiom, ``sel(latitude=DataArray(lats, dims="station"), longitude=...,
  method="nearest")``, selects one point per station (pointwise); a view took those indexers
  as lists and held every latitude with every longitude, ``(3, 3)`` for three stations. An
  indexer along another dimension than the axis's is refused now, saying to pass lists for that
  box or to take the points out of the box in a batch transform (pointwise selection is not
  supported: a view keeps a selection of each axis on its own).

Tried and found right: boxes of every orientation and convention, on v3 and v2, whole and tiled,
sharded, at one and at several samples per chunk, decoded straight into the batch or not, with
``method="nearest"`` station lists, negative-step slices, boolean masks and chained selections, two
views of one array selecting other boxes (a halo input and its interior target): every row equals
xarray's; a box on a tiled grid reads only the tiles it touches (counted GETs: 6 of 12 tiles per
chunk, v3 and v2; sharded, one GET per shard); a persistent cache across pipelines of other boxes;
``set_views`` from one box to another (the forcings recomputed at the new points); resume mid-epoch
of a box stack with forcings; a ``concat`` of two stores with a box; forcings of a box (all six, as
a batch transform and as stack members) are the package's formulas at xarray's selected points and
the whole field's forcings cropped; static boxes; a stack's channel order and names;
``fit_statistics`` over a box (a packed v2 field with NaNs over land too) equals numpy in float64
over xarray's selection, tendencies included; windows of a box; patches ``within`` a region, with a
static and a forcing member, carry xarray's values at each window (one axis selected, the other
patched too). A ``sel`` fuzz of 3,200 random slices and nearest lists on float32 and float64 grids
agreed with xarray's wherever xarray selected something, but for the 139 keys in the other
longitude convention, now refused (above).

Left as it is (a cost, not a wrong answer): a static box is read from the whole static array
(a box in one of 12 tiles of ``orog`` read all 12), as the static fields are designed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.forcings import (
    Forcings,
    cos_solar_zenith,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)
from insitubatch_nodes.statistics import fit_statistics
from tests.helpers import counting_store

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(120)

NT = 8
FORCING_NAMES = [
    "toa_incident_solar_radiation",
    "cos_solar_zenith",
    "local_time_sin",
    "local_time_cos",
    "year_progress_sin",
    "year_progress_cos",
]


def _era5(
    path: Path,
    *,
    descending: bool = True,
    east: bool = True,
    zarr_format: int = 3,
    tile: tuple[int, int] | None = None,
    shard: bool = False,
    per_chunk: int = 4,
) -> Any:
    """``t (time, level, latitude, longitude)``, ``2t (time, latitude, longitude)`` and static
    ``lsm``, ``orog`` on a 22.5-degree grid, written by xarray; the Dataset written."""
    lat = np.linspace(90, -90, 9) if descending else np.linspace(-90, 90, 9)
    lon = np.arange(0, 360, 22.5) if east else np.arange(-180, 180, 22.5)
    rng = np.random.default_rng(0)
    grid = ("latitude", "longitude")
    ds = xr.Dataset(
        {"t": (("time", "level", *grid), rng.normal(250, 5, (NT, 3, 9, 16)).astype("f4")),
         "2t": (("time", *grid), rng.normal(280, 3, (NT, 9, 16)).astype("f4")),
         "lsm": (grid, (rng.random((9, 16)) > 0.5).astype("f4")),
         "orog": (grid, rng.normal(0, 1000, (9, 16)).astype("f4"))},
        coords={"time": pd.date_range("2020-06-01", periods=NT, freq="6h"),
                "level": [1000, 850, 500], "latitude": lat, "longitude": lon},
    )  # fmt: skip
    encoding = {}
    for name in ("t", "2t"):
        chunks = [per_chunk, *ds[name].shape[1:]]
        if tile is not None:
            chunks[-2:] = tile
        encoding[name] = {"chunks": tuple(chunks)}
        if shard:
            encoding[name]["shards"] = (per_chunk, *ds[name].shape[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(path, encoding=encoding, zarr_format=zarr_format, consolidated=False)
    return ds


# -- found wrong --------------------------------------------------------------------------------


def test_forcings_on_a_rotated_or_projected_grid_are_refused_not_computed_at_its_axes_values(
    tmp_path: Path,
) -> None:
    # a COSMO-like rotated-pole grid: rlat/rlon are degrees in the rotated frame, the places'
    # latitudes and longitudes 2-D coordinates beside them
    rlat, rlon = np.linspace(-5, 5, 3), np.linspace(-8, 8, 4)
    times = pd.date_range("2020-06-01", periods=4, freq="3h")
    ds = xr.Dataset(
        {"t2m": (("time", "rlat", "rlon"), np.zeros((4, 3, 4), "f4"))},
        coords={"time": times,
                "rlat": ("rlat", rlat, {"standard_name": "grid_latitude", "units": "degrees"}),
                "rlon": ("rlon", rlon, {"standard_name": "grid_longitude", "units": "degrees"}),
                "lat": (("rlat", "rlon"), 50 + rlat[:, None] + 0 * rlon),
                "lon": (("rlat", "rlon"), 10 + rlon + 0 * rlat[:, None])},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(tmp_path / "rotated.zarr", zarr_format=3, consolidated=False)
        km = {"units": "km"}
        projected = ds.rename({"rlat": "y", "rlon": "x"}).assign_coords(
            y=("y", [0.0, 2.5, 5.0], km), x=("x", [0.0, 2.5, 5.0, 7.5], km)
        )
        projected.to_zarr(tmp_path / "projected.zarr", zarr_format=3, consolidated=False)
    geoms = open_geometries(tmp_path / "rotated.zarr")
    with xr.open_zarr(tmp_path / "rotated.zarr", consolidated=False) as xds:
        assert list(xds.data_vars) == ["t2m"]  # lat and lon: named by t2m's "coordinates"
    assert sorted(geoms) == ["t2m"]  # before: the 2-D lat and lon too, as static data
    t2m = geoms["t2m"]
    with pytest.raises(ValueError, match=r"\(rlat, rlon\).*lat= and lon=.*2-D.*not supported"):
        Forcings("t2m", view=t2m, names=["cos_solar_zenith"])  # before: cos θ 0.68 off
    with pytest.raises(ValueError, match=r"\(rlat, rlon\)"):
        stack({"t2m": t2m, "sun": Forcings("x", view=t2m, names=["cos_solar_zenith"])})
    xy = open_geometries(tmp_path / "projected.zarr")["t2m"]
    with pytest.raises(ValueError, match=r"\(y, x\)"):
        Forcings("t2m", view=xy, names=["cos_solar_zenith"])  # before: at latitude 0..5 km
    # a grid named otherwise whose points are latitudes and longitudes: given, they are taken
    lat, lon = [45.0, 50.0, 55.0], [0.0, 5.0, 10.0, 15.0]
    sun = Forcings("t2m", lat=lat, lon=lon, names=["cos_solar_zenith"])
    manifest = split_by_chunk(xy, (1.0, 0.0, 0.0))
    with insitu_pipeline(tmp_path / "projected.zarr", manifest, {"t2m": xy}, batch_size=4,
                         shuffle=False, batch_transforms=[sun]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
    want = cos_solar_zenith(times.values[batch.sample_indices["t2m"]], lat, lon)
    np.testing.assert_allclose(batch["cos_solar_zenith"], want, atol=1e-6)


def test_a_longitude_box_in_the_other_convention_is_refused_saying_which_box_it_is_here(
    tmp_path: Path,
) -> None:
    ds = _era5(tmp_path / "east.zarr")  # ERA5: longitude 0 .. 337.5
    g = open_geometries(tmp_path / "east.zarr")["2t"]
    assert ds.sel(longitude=slice(-30, 30)).longitude.values.tolist() == [0.0, 22.5]  # xarray
    with pytest.raises(IndexError, match=r"330 east to 30.*slice\(330, None\).*slice\(None, 30\)"):
        g.sel(longitude=slice(-30, 30))  # before: 0 .. 22.5, the box's west part lost
    for part in (slice(330, None), slice(None, 30)):  # what it says to do is xarray's
        assert g.sel(longitude=part).inner_shape == ds["2t"].sel(longitude=part).shape[1:]
    with pytest.raises(IndexError, match=r"slice\(300, 350, None\)"):
        g.sel(longitude=slice(-60, -10))  # (xarray: nothing)
    with pytest.raises(KeyError, match=r"longitude=345"):
        g.sel(latitude=52.0, longitude=-15, method="nearest")  # before: 0, not 337.5 beside it
    assert g.sel(longitude=slice(0, 360)).select is None  # its own convention: as xarray
    west = _era5(tmp_path / "west.zarr", east=False)  # longitude -180 .. 157.5
    w = open_geometries(tmp_path / "west.zarr")["2t"]
    with pytest.raises(IndexError, match=r"slice\(-10, 10, None\)") as err:
        w.sel(longitude=slice(350, 10))  # before: told to select slice(350, None): nothing
    assert "slice(350, None)" not in str(err.value)
    here = slice(-10, 10)
    assert w.sel(longitude=here).inner_shape == west["2t"].sel(longitude=here).shape[1:]
    with pytest.raises(
        IndexError, match=r"across the seam.*slice\(10, None\).*slice\(None, -160\)"
    ):
        w.sel(longitude=slice(10, 200))  # (xarray: 22.5 .. 157.5)
    # a regional coordinate (10 .. 60) is in both conventions: keys are xarray's
    region = west.isel(longitude=slice(9, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        region.to_zarr(tmp_path / "region.zarr", zarr_format=3, consolidated=False)
    r = open_geometries(tmp_path / "region.zarr")["2t"]
    both = slice(-5, 30)
    assert r.sel(longitude=both).inner_shape == region["2t"].sel(longitude=both).shape[1:]


def test_members_and_forcings_at_the_same_places_in_the_other_longitude_convention_stack(
    tmp_path: Path,
) -> None:
    # ERA5 data on longitude 0..360 and, in the same store, a land-sea mask from another
    # source on lon -180..180: a box east of 180 is the same places in both
    ds = _era5(tmp_path / "era5.zarr")
    mask = xr.Dataset(
        {"mask": (("lat", "lon"), np.arange(9 * 16, dtype="f4").reshape(9, 16))},
        coords={"lat": ds.latitude.values, "lon": np.arange(-180, 180, 22.5)},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mask.to_zarr(tmp_path / "era5.zarr", mode="a", zarr_format=3, consolidated=False)
    g = open_geometries(tmp_path / "era5.zarr")
    box = {"latitude": slice(60, -30), "longitude": slice(202.5, 292.5)}
    west = {"lat": slice(60, -30), "lon": slice(-157.5, -67.5)}  # the same places
    near = ds.sel(**box)
    lon = (near.longitude.values + 180) % 360 - 180  # -157.5 .. -67.5
    sun = Forcings("x", lat=near.latitude.values, lon=lon, names=["cos_solar_zenith"])
    # before: refused, "the points do not agree", told to select 202.5 .. on a -180..180 mask
    x = stack({"2t": g["2t"].sel(**box), "mask": g["mask"].sel(**west), "sun": sun})
    label_sun = Forcings("y", lat=near.latitude.values, lon=lon, names=["cos_solar_zenith"])
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    views = {"x": x, "y": g["2t"].sel(**box)}
    with insitu_pipeline(tmp_path / "era5.zarr", manifest, views, batch_size=4, shuffle=False,
                         batch_transforms=[label_sun]) as pipe:  # fmt: skip
        for batch in pipe:  # (before: this Forcings was refused as "at other points")
            i = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"][:, 0], near["2t"].values[i])
            np.testing.assert_array_equal(batch["x"][:, 1], np.broadcast_to(
                mask.mask.sel(**west).values, batch["x"][:, 1].shape))  # fmt: skip
            want = cos_solar_zenith(near.time.values[i], near.latitude, near.longitude)
            np.testing.assert_allclose(batch["x"][:, 2], want, atol=1e-6)
            np.testing.assert_allclose(batch["cos_solar_zenith"], want, atol=1e-6)


def test_station_indexers_along_a_new_dimension_are_refused_not_taken_as_every_pair(
    tmp_path: Path,
) -> None:
    ds = _era5(tmp_path / "era5.zarr")
    g = open_geometries(tmp_path / "era5.zarr")["2t"]
    lat = xr.DataArray([52.0, -31.0, 10.0], dims="station")
    lon = xr.DataArray([350.0, 100.0, 10.0], dims="station")
    stations = ds["2t"].sel(latitude=lat, longitude=lon, method="nearest")
    assert stations.dims == ("time", "station")  # xarray: one point per station
    with pytest.raises(TypeError, match=r"pointwise.*'station'.*list"):
        g.sel(latitude=lat, longitude=lon, method="nearest")  # before: every pair, (3, 3)
    with pytest.raises(TypeError, match=r"pointwise"):
        g.isel(latitude=xr.DataArray([1, 2], dims="station"))
    # indexers along the axis itself are xarray's orthogonal ones, as before
    north = ds.latitude > 0
    assert g.sel(latitude=north).inner_shape == ds["2t"].sel(latitude=north).shape[1:]
    some = ds.latitude[2:5]
    assert g.sel(latitude=some).inner_shape == ds["2t"].sel(latitude=some).shape[1:]
    box = g.sel(latitude=np.asarray(lat), longitude=np.asarray(lon), method="nearest")
    assert box.inner_shape == (3, 3)  # the box of every pair, asked for as lists


# -- tried and found right ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("descending", "east", "zarr_format", "tile", "shard", "per_chunk"),
    [(True, True, 3, None, False, 4), (False, False, 2, (3, 4), False, 4),
     (True, False, 3, (3, 4), True, 1), (False, True, 2, None, False, 1)],
)  # fmt: skip
def test_a_box_delivers_xarrays_selection_for_every_grid_orientation_and_layout(
    tmp_path: Path,
    descending: bool,
    east: bool,
    zarr_format: int,
    tile: tuple[int, int] | None,
    shard: bool,
    per_chunk: int,
) -> None:
    path = tmp_path / "era5.zarr"
    ds = _era5(path, descending=descending, east=east, zarr_format=zarr_format, tile=tile,
               shard=shard, per_chunk=per_chunk)  # fmt: skip
    g = open_geometries(path)
    lat = slice(70, -50) if descending else slice(-50, 70)
    big = {"latitude": lat, "longitude": slice(20, 160) if east else slice(-100, 40)}
    inner = {"latitude": slice(lat.start - 20, lat.stop + 20, lat.step) if descending
             else slice(lat.start + 20, lat.stop - 20), "longitude": slice(45, 135) if east
             else slice(-67.5, 22.5)}  # fmt: skip
    stations = {"latitude": [-31, 55, 12], "longitude": [100, 10, 130], "method": "nearest"}
    views = {
        "x": stack({"t": g["t"].sel(level=[850, 500], **big), "2t": g["2t"].sel(**big)}),
        "y": g["2t"].sel(**inner).shift(1),
        "r": g["t"].sel(level=1000, latitude=slice(lat.stop, lat.start, -1)),
        "st": g["2t"].sel(**stations),
        "lsm": g["lsm"].sel(**inner),
    }
    want = {"x": np.concatenate([ds.t.sel(level=[850, 500], **big).values,
                                 ds["2t"].sel(**big).values[:, None]], axis=1),
            "y": ds["2t"].sel(**inner).values,
            "r": ds.t.sel(level=1000, latitude=slice(lat.stop, lat.start, -1)).values,
            "st": ds["2t"].sel(**stations).values}  # fmt: skip
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    rows = 0
    with insitu_pipeline(path, manifest, views, batch_size=3, seed=1) as pipe:
        for batch in pipe:
            for label, values in want.items():
                np.testing.assert_array_equal(batch[label], values[batch.sample_indices[label]])
            np.testing.assert_array_equal(batch["lsm"][0], ds.lsm.sel(**inner).values)
            rows += len(batch)
    assert rows == NT - 1


def test_a_box_on_a_tiled_grid_reads_only_the_tiles_it_touches(tmp_path: Path) -> None:
    _era5(tmp_path / "era5.zarr", tile=(3, 4))  # 3 x 4 tiles of 3 x 4 points
    g = open_geometries(tmp_path / "era5.zarr")
    box = g["2t"].sel(latitude=slice(60, -30), longitude=slice(45, 200))  # rows 1-5, cols 2-8
    store = counting_store(tmp_path / "era5.zarr")
    with insitu_pipeline(store, split_by_chunk(box, (1.0, 0.0, 0.0)), {"x": box},
                         batch_size=4) as pipe:  # fmt: skip
        for _ in pipe:
            pass
    counts = {k: n for k, n in store.chunk_counts().items() if k.startswith("2t/")}
    tiles = {tuple(int(i) for i in k.split("/")[-2:]) for k in counts}
    assert tiles == {(r, c) for r in (0, 1) for c in (0, 1, 2)}  # of 3 x 4
    assert len(counts) == 2 * 6 and set(counts.values()) == {1}  # two chunks, each tile once


def test_forcings_statics_and_members_of_a_box_stack_in_order_at_xarrays_points(
    tmp_path: Path,
) -> None:
    ds = _era5(tmp_path / "era5.zarr", tile=(3, 4))
    g = open_geometries(tmp_path / "era5.zarr")
    box = {"latitude": slice(60, -30), "longitude": slice(45, 200)}
    near = ds.sel(**box)
    two_t = g["2t"].sel(**box)
    x = stack({"t": g["t"].sel(level=[500, 850], **box), "lsm": g["lsm"].sel(**box),
               "sun": Forcings("x", view=two_t, names=FORCING_NAMES), "2t": two_t},
              layout="channels_last")  # fmt: skip
    assert x.channels == ("t@500", "t@850", "lsm", *FORCING_NAMES, "2t")
    transforms = [Forcings("box", view=two_t, names=FORCING_NAMES),
                  Forcings("full", view=g["2t"], names=FORCING_NAMES, prefix="full_")]  # fmt: skip
    views = {"x": x, "box": two_t, "full": g["2t"], "orog": g["orog"].sel(**box)}
    at = np.ix_(np.flatnonzero(np.isin(ds.latitude, near.latitude)),
                np.flatnonzero(np.isin(ds.longitude, near.longitude)))  # fmt: skip
    manifest = split_by_chunk(two_t, (1.0, 0.0, 0.0))
    with insitu_pipeline(tmp_path / "era5.zarr", manifest, views, batch_size=4, shuffle=False,
                         batch_transforms=transforms) as pipe:  # fmt: skip
        for batch in pipe:
            i = batch.sample_indices["x"]
            t = near.time.values[i]
            lat, lon = near.latitude.values, near.longitude.values
            angle = 2 * np.pi * local_time(t, lon) / 24
            year = 2 * np.pi * year_progress(t)[:, None, None]
            formulas = {
                "toa_incident_solar_radiation": toa_incident_solar_radiation(t, lat, lon),
                "cos_solar_zenith": cos_solar_zenith(t, lat, lon),
                "local_time_sin": np.sin(angle), "local_time_cos": np.cos(angle),
                "year_progress_sin": np.sin(year), "year_progress_cos": np.cos(year),
            }  # fmt: skip
            assert batch.channels["x"] == list(x.channels)
            got = np.moveaxis(batch["x"], -1, 1)
            np.testing.assert_array_equal(got[:, :2], near.t.sel(level=[500, 850]).values[i])
            np.testing.assert_array_equal(
                got[:, 2], np.broadcast_to(near.lsm.values, got[:, 2].shape)
            )
            np.testing.assert_array_equal(got[:, -1], near["2t"].values[i])
            np.testing.assert_array_equal(batch["orog"][0], near.orog.values)
            for c, name in enumerate(FORCING_NAMES):
                want = np.broadcast_to(formulas[name], got[:, 3 + c].shape)
                scale = 3e6 if name.startswith("toa") else 1.0  # J m-2 in float32
                np.testing.assert_allclose(got[:, 3 + c], want, rtol=1e-6, atol=1e-6 * scale)
                np.testing.assert_array_equal(batch[name], got[:, 3 + c])
                np.testing.assert_array_equal(
                    batch[name], batch[f"full_{name}"][(slice(None), *at)]
                )


def test_fit_statistics_over_a_box_equal_numpy_in_float64_over_xarrays_selection(
    tmp_path: Path,
) -> None:
    # a netCDF-converted v2 store: packed int16, sst missing over land
    rng = np.random.default_rng(1)
    sst = rng.normal(290, 3, (12, 9, 16))
    sst[:, rng.random((9, 16)) > 0.6] = np.nan
    ds = xr.Dataset(
        {"sst": (("time", "latitude", "longitude"), sst),
         "t2m": (("time", "latitude", "longitude"), rng.normal(280, 4, (12, 9, 16)))},
        coords={"time": pd.date_range("2020-06-01", periods=12, freq="6h"),
                "latitude": np.linspace(90, -90, 9), "longitude": np.arange(0, 360, 22.5)},
    )  # fmt: skip
    packed = {"dtype": "int16", "scale_factor": 0.01, "_FillValue": -32767}
    encoding = {"sst": {**packed, "add_offset": 290.0, "chunks": (4, 9, 16)},
                "t2m": {**packed, "add_offset": 280.0, "chunks": (4, 5, 8)}}  # fmt: skip
    path = tmp_path / "packed.zarr"
    ds.to_zarr(path, encoding=encoding, zarr_format=2, consolidated=True)
    g = open_geometries(path)
    box = {"latitude": slice(70, -20), "longitude": slice(30, 300)}
    manifest = split_by_chunk(g["sst"], (0.67, 0.33, 0.0))
    stats = fit_statistics(path, manifest, {"sst": g["sst"].sel(**box), "t2m": g["t2m"].sel(**box)})
    train = manifest.samples("train")
    with xr.open_zarr(path) as xds:
        for name in ("sst", "t2m"):
            values = xds[name].sel(**box).values[train].astype(np.float64)
            np.testing.assert_allclose(stats.mean[name], np.nanmean(values), rtol=1e-12)
            np.testing.assert_allclose(stats.std[name], np.nanstd(values), rtol=1e-10)
            assert stats.min[name] == np.nanmin(values) and stats.max[name] == np.nanmax(values)
            assert stats.nan_count[name] == np.isnan(values).sum()
            tendency = np.nanstd(np.diff(values, axis=0))
            np.testing.assert_allclose(stats.diff_std[name], tendency, rtol=1e-10)
    assert stats.nan_count["sst"] > 0


def test_windows_of_a_box_and_patches_within_a_region_carry_xarrays_values_and_forcings(
    tmp_path: Path,
) -> None:
    ds = _era5(tmp_path / "era5.zarr", tile=(3, 4))
    g = open_geometries(tmp_path / "era5.zarr")
    box = {"latitude": slice(60, -30), "longitude": slice(45, 200)}
    near = ds.sel(**box)
    sun = Forcings("x", view=g["2t"].sel(**box), names=["cos_solar_zenith"])
    x = stack({"2t": g["2t"].sel(**box).window([-1, 0]), "sun": sun})
    cut, within = {"latitude": 3, "longitude": 4}, {"latitude": (1, 7), "longitude": (2, 12)}
    p = stack({"2t": g["2t"].patches(cut, origins="random", within=within), "lsm": g["lsm"],
               "sun": Forcings("p", view=g["2t"], names=["cos_solar_zenith"])})  # fmt: skip
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))
    with insitu_pipeline(tmp_path / "era5.zarr", manifest, {"x": x}, batch_size=4) as pipe:
        for batch in pipe:
            i = batch.sample_indices["x"]  # (batch, 2)
            np.testing.assert_array_equal(batch["x"][:, :, 0], near["2t"].values[i])
            want = cos_solar_zenith(near.time.values[i], near.latitude, near.longitude)
            np.testing.assert_allclose(batch["x"][:, :, 1], want, atol=1e-6)
    with insitu_pipeline(tmp_path / "era5.zarr", manifest, {"p": p}, batch_size=8) as pipe:
        for batch in pipe:
            for row, i, (la, lo) in zip(batch["p"], batch.sample_indices["p"],
                                        batch.patch_origins["p"], strict=True):  # fmt: skip
                assert 1 <= la <= 4 and 2 <= lo <= 8  # inside the region
                w = ds.isel(latitude=slice(la, la + 3), longitude=slice(lo, lo + 4))
                np.testing.assert_array_equal(row[0], w["2t"].values[i])
                np.testing.assert_array_equal(row[1], w.lsm.values)
                want = cos_solar_zenith(w.time.values[i][None], w.latitude, w.longitude)[0]
                np.testing.assert_allclose(row[2], want, atol=1e-6)
