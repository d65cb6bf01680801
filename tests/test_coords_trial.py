"""The coordinates a batch's rows are attached to belong to those rows: cases found by the
coordinate trial of 2026-12-06 (xarray-written stores, xarray as the oracle), each kept as a
claim. A row's field is the field at the coordinate values the view says it holds.

Found (wrong answers, each now refused): a concat of stores whose latitude runs the other way
in a later store; sel on scenes at other places (the first scene's coordinate used for all);
a stack of join members, or of forcings, at other points of a grid of one shape; a slice of
an unsorted string coordinate (refused then, xarray's rule since). Misleading errors, now
saying what to do: a longitude box across the seam; missing= of sample indices on float32
times. Per-row time coordinates (shifts, windows, strides, missing=, splits by date, resume,
ranks, concat, join, scenes, in every CF calendar and encoding tried) matched xarray in every
case and need no claim here."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from insitubatch_nodes import (
    Collection,
    concat,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.forcings import Forcings

LON = [0.0, 120.0, 240.0]


def _write(root: Path, times: np.ndarray, lat: list[float], seed: int) -> Path:
    """``t2m (time, lat, lon)``, two steps a chunk, CF time in hours; xarray writes it."""
    rng = np.random.default_rng(seed)
    field = rng.standard_normal((len(times), len(lat), len(LON))).astype(np.float32)
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), field)},
        coords={"time": times, "lat": lat, "lon": LON},
    )
    encoding = {"t2m": {"chunks": (2, len(lat), len(LON))},
                "time": {"units": "hours since 2000-01-01", "dtype": "int64"}}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, encoding=encoding, consolidated=False)
    return root


def test_concat_refuses_stores_whose_field_coordinates_differ(tmp_path: Path) -> None:
    # before: accepted, and the rows of b.zarr came at a.zarr's latitudes (its lat 0, 30 rows
    # under sel(lat=slice(0, 30)) held lat 0 and -30)
    times = pd.date_range("2000-01-01", periods=8, freq="6h").values
    north_up = _write(tmp_path / "a.zarr", times[:4], [-30.0, 0.0, 30.0], 0)
    south_up = _write(tmp_path / "b.zarr", times[4:], [30.0, 0.0, -30.0], 1)
    with pytest.raises(ValueError, match=r"'lat' coordinate of 't2m'.*b\.zarr") as err:
        concat([north_up, south_up], ["t2m"], dim="time")
    assert "[-30.0, 0.0, 30.0]" in str(err.value) and "[30.0, 0.0, -30.0]" in str(err.value)
    # stores on one grid: each row is its store's field at the selected latitudes
    same = _write(tmp_path / "c.zarr", times[4:], [-30.0, 0.0, 30.0], 2)
    coll = concat([north_up, same], ["t2m"], dim="time")
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    view = coll["t2m"].sel(lat=slice(0, 30))
    with insitu_pipeline(coll, manifest, {"x": view}, batch_size=8, shuffle=False) as pipe:
        batch = next(iter(pipe))
    with xr.open_mfdataset([north_up, same], engine="zarr", consolidated=False) as both:
        want = both.t2m.sel(lat=[0.0, 30.0]).values
    np.testing.assert_array_equal(batch["x"], want[batch.sample_indices["x"]])


def test_sel_on_scenes_at_other_places_is_refused_naming_the_member(tmp_path: Path) -> None:
    # before: sel looked values up in the first scene's lat only, so sel(lat=slice(0, 30))
    # delivered scene b's rows at its lat 60 and 70
    times = pd.date_range("2000-01-01", periods=4, freq="6h").values
    a = _write(tmp_path / "a.zarr", times, [-30.0, 0.0, 30.0], 0)
    b = _write(tmp_path / "b.zarr", times, [50.0, 60.0, 70.0], 1)
    c = _write(tmp_path / "c.zarr", times, [-30.0, 0.0, 30.0], 2)
    scenes = Collection.from_arrays([(a, "t2m"), (b, "t2m")], names=["a", "b"])
    with pytest.raises(
        ValueError, match=r"'lat' coordinate of member 'b'.*\[50\.0, 60\.0, 70\.0\].*isel"
    ):
        scenes["data"].sel(lat=slice(0, 30))
    assert scenes["data"].sel(lon=120.0).inner_shape == (3,)  # lon: one grid, selectable
    # scenes on one grid: each row is its member's field at the selected latitudes
    same = Collection.from_arrays([(a, "t2m"), (c, "t2m")], names=["a", "c"])
    view = same["data"].sel(lat=slice(0, 30))
    manifest = split_by_chunk(same["data"], (1.0, 0.0, 0.0))
    with insitu_pipeline(same, manifest, {"x": view}, batch_size=8, shuffle=False) as pipe:
        batch = next(iter(pipe))
    for row, i, m in zip(batch["x"], batch.sample_indices["x"], batch.members["x"], strict=True):
        with xr.open_zarr([a, c][m], consolidated=False) as ds:
            np.testing.assert_array_equal(row, ds.t2m.sel(lat=[0.0, 30.0]).values[i])


def test_a_longitude_box_across_the_seam_is_refused_saying_it_is_not_supported(
    tmp_path: Path,
) -> None:
    # before: "give the slice's ends in that order", which selects the complement of the box
    times = pd.date_range("2000-01-01", periods=2, freq="6h").values
    t2m = open_geometries(_write(tmp_path / "a.zarr", times, [0.0], 0))["t2m"]
    with pytest.raises(IndexError, match=r"crosses.*not supported.*two views") as err:
        t2m.sel(lon=slice(240.0, 0.0))  # 240 east across 360/0: lon is 0, 120, 240
    assert "give the slice's ends in that order" not in str(err.value)
    with pytest.raises(IndexError, match="give the slice's ends in that order"):
        t2m.sel(lat=slice(10.0, -10.0))  # another dimension: the ends in the wrong order


def test_missing_indices_on_float32_times_say_that_missing_checks_the_times(
    tmp_path: Path,
) -> None:
    # before: the refusal ended "or give ... sample indices in missing=", which it was given
    times = pd.date_range("2000-03-01", periods=8, freq="1h").values
    ds = xr.Dataset({"t2m": (("time", "lat"), np.zeros((8, 2), np.float32))},
                    coords={"time": times, "lat": [0.0, 1.0]})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(tmp_path / "f.zarr", zarr_format=3, consolidated=False, encoding={
            "time": {"units": "days since 2000-01-01", "dtype": "float32"}})  # fmt: skip
    with xr.open_zarr(tmp_path / "f.zarr", consolidated=False) as xds:
        assert (xds.time.values != times).any()  # xarray too decodes them off the hour
    t2m = open_geometries(tmp_path / "f.zarr")["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="whole second") as err:
        insitu_pipeline(tmp_path / "f.zarr", manifest, {"x": t2m}, missing=[3])
    message = str(err.value)
    assert "sample indices in missing=" not in message
    assert "missing= checks the times" in message and "leave missing= out" in message


def test_stack_refuses_members_on_other_points_of_a_grid_of_one_shape(tmp_path: Path) -> None:
    # before: stacked, and the sst channel's row at t2m's lat 30 held sst at lat -30
    times = pd.date_range("2000-01-01", periods=4, freq="6h").values
    a = _write(tmp_path / "a.zarr", times, [-30.0, 0.0, 30.0], 0)
    b = _write(tmp_path / "b.zarr", times, [30.0, 0.0, -30.0], 1)
    joined = Collection.join({"atmos": (a, ["t2m"]), "forcing": (b, ["t2m"])})
    atmos, forcing = joined["atmos/t2m"], joined["forcing/t2m"]
    with pytest.raises(ValueError, match=r"member 'sst'.*'lat'.*\[30\.0, 0\.0, -30\.0\]"):
        stack({"t2m": atmos, "sst": forcing})
    # the same points, selected in the first member's order: stacked, point for point
    x = stack({"t2m": atmos, "sst": forcing.sel(lat=[-30.0, 0.0, 30.0])})
    manifest = split_by_chunk(atmos, (1.0, 0.0, 0.0))
    with insitu_pipeline(joined, manifest, {"x": x}, batch_size=4, shuffle=False) as pipe:
        batch = next(iter(pipe))
    rows = batch.sample_indices["x"]
    with xr.open_zarr(a, consolidated=False) as da, xr.open_zarr(b, consolidated=False) as db:
        want = np.stack([da.t2m.values[rows], db.t2m.sel(lat=[-30.0, 0.0, 30.0]).values[rows]], 1)
    np.testing.assert_array_equal(batch["x"], want)


def test_a_stack_and_a_pipeline_refuse_forcings_at_other_points_than_their_rows(
    tmp_path: Path,
) -> None:
    # before: stacked, and the solar channel at the member's lat 30 was computed at lat -30
    times = pd.date_range("2000-01-01", periods=4, freq="6h").values
    a = _write(tmp_path / "a.zarr", times, [-30.0, 0.0, 30.0], 0)
    t2m = open_geometries(a)["t2m"]
    sun = Forcings("x", lat=[30.0, 0.0, -30.0], lon=LON, names=["cos_solar_zenith"])
    with pytest.raises(ValueError, match=r"member 'cos_solar_zenith'.*'lat'.*\[30\.0, 0\.0"):
        stack({"t2m": t2m, "sun": sun})
    on_grid = Forcings("x", view=t2m, names=["cos_solar_zenith"])
    assert stack({"t2m": t2m, "sun": on_grid}).channels == ("t2m", "cos_solar_zenith")
    # a pipeline's label with those forcings as a batch transform: refused alike (before:
    # built, its rows' solar channel at lat 30 computed at lat -30; the pipeline checked the
    # points of a collection's members only)
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"Forcings\('x'\).*'lat'.*\[30\.0, 0\.0.*view="):
        insitu_pipeline(a, manifest, {"x": t2m}, coords=["time"], batch_transforms=[sun])
    with insitu_pipeline(a, manifest, {"x": t2m}, batch_size=2, coords=["time"],
                         batch_transforms=[on_grid]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
    want = on_grid.compute(batch.coords["x"]["time"])["cos_solar_zenith"]
    np.testing.assert_array_equal(batch["cos_solar_zenith"], want)


def test_a_slice_of_an_unsorted_string_coordinate_is_xarrays_not_misread(tmp_path: Path) -> None:
    # before the trial: taken for ascending, sel(var=slice("msl", "sp")) kept all four
    # channels; then refused; now xarray's: from the first end's position to the second's
    times = pd.date_range("2000-01-01", periods=2, freq="6h").values
    field = np.arange(16, dtype=np.float32).reshape(2, 4, 2)
    for name, var in (("unsorted", ["t2m", "u10", "msl", "sp"]), ("sorted", ["a", "b", "c", "d"])):
        ds = xr.Dataset({"x": (("time", "var", "lat"), field)},
                        coords={"time": times, "var": var, "lat": [0.0, 1.0]})  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.to_zarr(tmp_path / f"{name}.zarr", zarr_format=3, consolidated=False)
        x = open_geometries(tmp_path / f"{name}.zarr")["x"]
        for key in (slice(var[2], var[3]), slice(None, var[1]), slice(var[1], None)):
            kept = x.sel(var=key).select.keys[0]  # type: ignore[union-attr]
            assert [var[i] for i in kept] == ds["var"].sel(var=key).values.tolist()
