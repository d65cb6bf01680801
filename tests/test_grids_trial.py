"""Model inputs on grids that are not a regular latitude/longitude rectangle, and arrays with an
ensemble axis: what anemoi users train on, against xarray and numpy.

The stores are written by xarray as such archives are laid out: ERA5 on a reduced Gaussian grid
in anemoi's gridpoints layout (``2t (time, values)``, ``t (time, level, values)``, a static
``lsm (values,)``, 1-D ``latitude(values)`` and ``longitude(values)``; zarr v3 and v2), and an
ERA5 ensemble ``(time, number, level, latitude, longitude)`` (zarr v2).

Found wrong, fixed (each test failed before its fix):

- ``fit_statistics`` of a ``(level, values)`` view took the last two field axes for the
  horizontal grid: one statistic over every level (std 20.7 where xarray gives 1.0 / 4.9 / 20.2
  per level), which ``stack(..., normalize=)`` then applied to each level.
- ``stack`` of pressure-level members on such a grid took ``(level, values)`` for the field:
  one channel ``"t"`` of shape ``(3, 40)``; beside a static ``lsm (values,)`` it was refused,
  saying the mask was no field ``(3, 40)``.
- ``Forcings`` on such a grid: ``view=`` was refused ("keeps fewer than two field axes"), and
  ``lat=``/``lon=`` (the points' 1-D coordinates) were taken for a regular grid: every row
  ``(40, 40)``, the forcings at every pair of a point's latitude and another's longitude.
- Windows of the points (``patches({"values": 8})``): their forcings, as a batch transform
  or a stack member, were cut as if the grid had two axes (``ValueError: window shape cannot
  be larger than input``).
- ``sel(latitude=slice(...))`` there said only that there is no such dimension; it now says
  ``latitude`` is each point's and to select a box with ``isel(values=mask)``.
- The same on a ``concat`` of such stores (the collection's views had no grid of points).
- ``stack`` of two stores of a ``join`` on the same points stored in other orders stacked
  each channel at other places (a regular grid's flipped latitude is refused); now refused,
  comparing each member's ``latitude`` and ``longitude`` as selected.

Cause: every per-channel rule took "the last two field axes" for the horizontal grid. Fix:
``open_geometries`` (and collections) find 1-D ``latitude``/``longitude`` arrays along an
array's last dimension and name them in ``geom.points``; ``io.points.grid_ndim`` is the one
rule statistics, stacks and forcings take (1 axis there, else 2).

Tried and found right: a stack on the points (two levels' windows, mask, Sun, standardised)
delivers each anchor once, reads 8 of 12 objects in epoch 0 and none in epoch 1, and resumes
exactly mid-epoch; ``isel(values=mask)`` on the points (a boolean mask, the static field
too), windows on the points grid, both
zarr formats; on the ensemble: ``sel``/``isel`` of ``number`` (values against xarray),
per-(member, level) statistics, members as channels (``"t@0"`` ... named by the ``number``
coordinate) with windows, one member selected into a stack with forcings; a stack member that
keeps the ``number`` and ``level`` axes is refused saying to select one away; product sample
axes ``("time", "number")`` refuse windows, saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from resume_helpers import assert_resumes_exactly, digest
from torchdata.nodes import Loader

from insitubatch_nodes import concat, insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.forcings import (
    Forcings,
    cos_solar_zenith,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)
from insitubatch_nodes.io.collection import join
from insitubatch_nodes.statistics import fit_statistics

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("grids_trial")]

N = 40  # points of the reduced grid
LEVELS = [1000, 850, 500]


def _points_dataset() -> xr.Dataset:
    """ERA5 on a tiny reduced grid in cfgrib's / anemoi's layout: levels of very different
    spread, so one statistic over them is far from each level's."""
    rng = np.random.default_rng(0)
    lat = np.repeat(np.linspace(75.0, -75.0, 8), 5)
    lon = np.concatenate([np.arange(5) * 72.0 + 9.0 * r for r in range(8)]) % 360
    times = pd.date_range("2020-01-01", periods=16, freq="6h")
    spread = np.array([1.0, 5.0, 20.0])[None, :, None]
    t = np.array([280.0, 260.0, 240.0])[None, :, None] + rng.normal(0, 1, (16, 3, N)) * spread
    return xr.Dataset(
        {
            "2t": (("time", "values"), rng.normal(280, 3, (16, N)).astype("float32")),
            "t": (("time", "level", "values"), t.astype("float32")),
            "lsm": (("values",), (rng.random(N) > 0.5).astype("float32")),
        },
        coords={"time": times, "level": LEVELS, "latitude": ("values", lat),
                "longitude": ("values", lon)},
    )  # fmt: skip


@pytest.fixture(scope="module", params=[3, 2], ids=["v3", "v2"])
def points(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("o96") / "o96.zarr"
    ds = _points_dataset()
    enc = {"2t": {"chunks": (4, N)}, "t": {"chunks": (4, 1, N)}}
    ds.to_zarr(root, encoding=enc, zarr_format=request.param, consolidated=False)
    return root


def test_statistics_of_a_level_axis_on_a_grid_of_points_are_per_level(points: Path) -> None:
    """The horizontal grid of ``(level, values)`` is ``values``: one statistic per level, as
    xarray reduces over time and the points (before: one over every level)."""
    ds = xr.open_zarr(points, consolidated=False)
    g = open_geometries(points)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    views = {"t": g["t"], "t2": g["t"].sel(level=[500, 1000]), "2t": g["2t"], "lsm": g["lsm"]}
    stats = fit_statistics(points, manifest, views)
    np.testing.assert_allclose(stats.std["t"], ds.t.std(("time", "values")), rtol=1e-5)
    np.testing.assert_allclose(stats.mean["t"], ds.t.mean(("time", "values")), rtol=1e-6)
    np.testing.assert_allclose(stats.max["t2"], ds.t.sel(level=[500, 1000]).max(("time", "values")))
    np.testing.assert_allclose(stats.mean["2t"], ds["2t"].mean(), rtol=1e-6)
    assert np.shape(stats.mean["2t"]) == () and np.shape(stats.mean["lsm"]) == ()
    want_diff = ds.t.diff("time").std(("time", "values"))
    np.testing.assert_allclose(stats.diff_std["t"], want_diff, rtol=1e-5)
    # found by the listing, by name (the CF ``coordinates`` attribute) and from a Dataset
    assert g["t"].points == ("latitude", "longitude")
    assert open_geometries(points, ["t"])["t"].points == ("latitude", "longitude")
    assert open_geometries(ds)["2t"].points == ("latitude", "longitude")


def test_a_stack_of_levels_on_a_grid_of_points_has_a_channel_per_level(points: Path) -> None:
    """Pressure-level members alone, or beside a static ``(values,)`` mask, stack one channel
    per level on the points (before: ``"t"``, a ``(3, 40)`` field; with the mask: refused),
    standardised per level."""
    ds = xr.open_zarr(points, consolidated=False)
    g = open_geometries(points)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    members = {"t": g["t"].sel(level=[850, 500]), "lsm": g["lsm"]}
    stats = fit_statistics(points, manifest, members)
    x = stack({"t": members["t"].window([-1, 0]), "lsm": g["lsm"]}, normalize=stats)
    assert x.channels == ("t@850", "t@500", "lsm")
    with insitu_pipeline(points, manifest, {"x": x}, batch_size=4, shuffle=False) as pipe:
        batch = next(iter(pipe))
    assert batch["x"].shape == (4, 2, 3, N)
    idx = batch.sample_indices["x"]
    t = ds.t.sel(level=[850, 500])
    want = (t.values[idx] - t.mean(("time", "values")).values[:, None]) / t.std(
        ("time", "values")
    ).values[:, None]
    np.testing.assert_allclose(batch["x"][:, :, :2], want, atol=2e-5)
    lsm = ds.lsm.values
    np.testing.assert_allclose(batch["x"][0, 0, 2], (lsm - lsm.mean()) / lsm.std(), atol=1e-5)
    assert stack({"t": g["t"]}).channels == ("t@1000", "t@850", "t@500")


def _at_points(times: Any, lat: np.ndarray, lon: np.ndarray, f: Any = cos_solar_zenith) -> Any:
    """The regular-grid forcing ``f`` on the one-point grid of each (lat, lon): ``(*times,
    N)``."""
    at = [f(times, [a], [b])[..., 0, 0] for a, b in zip(lat, lon, strict=True)]
    return np.stack(at, -1)


def test_forcings_on_a_grid_of_points_are_computed_at_each_point(points: Path) -> None:
    """``Forcings(view=)`` of a ``(values,)`` field computes each point at its own latitude
    and longitude, as the regular-grid formula at that (lat, lon) (before: refused); as a batch
    transform and as a stack member."""
    ds = xr.open_zarr(points, consolidated=False)
    lat, lon = ds.latitude.values, ds.longitude.values
    g = open_geometries(points)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    names = ["cos_solar_zenith", "local_time_cos", "toa_incident_solar_radiation",
             "year_progress_sin"]  # fmt: skip
    sun = Forcings("2t", view=g["2t"], names=names)
    x = stack({"2t": g["2t"].window([-1, 0]), "sun": Forcings("x", view=g["2t"], names=names)})
    views = {"2t": g["2t"], "x": x}
    with insitu_pipeline(points, manifest, views, batch_size=4, batch_transforms=[sun]) as pipe:
        batch = next(iter(pipe))
    times = batch.coords["2t"]["time"]
    assert batch["cos_solar_zenith"].shape == (4, N)
    np.testing.assert_allclose(batch["cos_solar_zenith"], _at_points(times, lat, lon), atol=1e-6)
    hours = local_time(times, lon)[:, 0, :]
    np.testing.assert_allclose(batch["local_time_cos"], np.cos(2 * np.pi * hours / 24), atol=1e-6)
    want = _at_points(times, lat, lon, toa_incident_solar_radiation)
    np.testing.assert_allclose(batch["toa_incident_solar_radiation"], want, rtol=1e-6, atol=1e-2)
    year = np.sin(2 * np.pi * year_progress(times))[:, None]
    np.testing.assert_allclose(batch["year_progress_sin"], np.broadcast_to(year, (4, N)), atol=1e-6)
    xt = batch.coords["x"]["time"]
    np.testing.assert_allclose(batch["x"][:, :, 1], _at_points(xt, lat, lon), atol=1e-6)


def test_windows_of_a_grid_of_points_carry_their_own_points_forcings_and_mask(points: Path) -> None:
    """``patches({"values": 8})``: each row a run of 8 points; its static mask and forcings
    are those 8 points', as a batch transform and in a stack (before: the forcings' cut took
    the grid for two axes and raised ``window shape cannot be larger than input``)."""
    ds = xr.open_zarr(points, consolidated=False)
    lat, lon = ds.latitude.values, ds.longitude.values
    g = open_geometries(points)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    p = g["t"].sel(level=[850, 500]).patches({"values": 8}, origins="random")
    sun = Forcings("p", view=p, names=["cos_solar_zenith"])
    x = stack(
        {"t": p, "lsm": g["lsm"], "sun": Forcings("x", view=g["t"], names=["cos_solar_zenith"])}
    )
    views = {"p": p, "lsm": g["lsm"], "x": x}
    with insitu_pipeline(points, manifest, views, batch_size=4, batch_transforms=[sun]) as pipe:
        batch = next(iter(pipe))
    t = ds.t.sel(level=[850, 500]).values
    for label, sun_of in (("p", batch["cos_solar_zenith"]), ("x", batch["x"][:, 3])):
        times = batch.coords[label]["time"]
        for i, (o,) in enumerate(batch.patch_origins[label]):
            at = slice(o, o + 8)
            want = _at_points(times[i : i + 1], lat[at], lon[at])[0]
            np.testing.assert_allclose(sun_of[i], want, atol=1e-6)
            rows = batch[label][i] if label == "p" else batch[label][i, :2]
            np.testing.assert_array_equal(rows, t[batch.sample_indices[label][i], :, at])
            if label == "x":
                np.testing.assert_array_equal(batch["x"][i, 2], ds.lsm.values[at])
    lsm_rows = [ds.lsm.values[o : o + 8] for (o,) in batch.patch_origins["p"]]
    np.testing.assert_array_equal(batch["lsm"], lsm_rows)


def test_a_stack_on_a_grid_of_points_counts_its_reads_and_resumes_exactly(points: Path) -> None:
    """Two of three levels stored one per object, windows of two steps, the mask, the Sun,
    standardised: an epoch delivers each of the 15 anchors once, the first reads the two levels'
    objects of each chunk once (8 of 12), and a state taken after 3 batches resumes exactly."""
    g = open_geometries(points)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    t = g["t"].sel(level=[850, 500])
    stats = fit_statistics(points, manifest, {"t": t, "lsm": g["lsm"]})
    sun = Forcings("x", view=t, names=["cos_solar_zenith"])
    x = stack({"t": t.window([-1, 0]), "lsm": g["lsm"], "sun": sun}, normalize=stats)

    def build() -> Any:
        return insitu_pipeline(points, manifest, {"x": x}, batch_size=4, seed=3)

    def records(batches: list[Any]) -> list[Any]:
        return [(digest(b["x"]), b.sample_indices["x"].tolist()) for b in batches]

    with build() as pipe:
        ref = records(list(Loader(pipe)))
        first = pipe.report()
        ref += records(list(Loader(pipe)))
        second = pipe.report()
    anchors = sorted(i for _, rows in ref[:4] for i, _ in rows)
    assert anchors == list(range(15)) and first.samples == second.samples == 15
    assert (first.gets, second.gets) == (8, 0)  # the pool keeps the split for epoch 1
    assert_resumes_exactly(build, records, ref, [3])


def test_forcings_given_the_points_coordinates_as_a_regular_grid_are_refused(points: Path) -> None:
    """``lat=``/``lon=`` the points' 1-D coordinates describe a regular grid of every pair:
    refused for a label on the points (before: every row ``(40, 40)``)."""
    ds = xr.open_zarr(points, consolidated=False)
    g = open_geometries(points)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    lat, lon = ds.latitude.values, ds.longitude.values
    sun = Forcings("2t", lat=lat, lon=lon, names=["cos_solar_zenith"])
    with pytest.raises(ValueError, match="view="):
        insitu_pipeline(points, manifest, {"2t": g["2t"]}, batch_size=4, batch_transforms=[sun])


def test_a_box_of_a_grid_of_points_is_a_mask_of_the_points(points: Path) -> None:
    """``sel(latitude=...)`` on the points is refused saying to select a mask of them with
    ``isel`` (before: only that there is no such dimension); a boolean mask of the points
    through ``isel`` selects them (data and static alike)."""
    ds = xr.open_zarr(points, consolidated=False)
    g = open_geometries(points)
    assert g["lsm"].static and not g["2t"].static
    with pytest.raises(KeyError, match=r"a grid of points.*isel\(values="):
        g["2t"].sel(latitude=slice(40, -40))
    box = (np.abs(ds.latitude.values) <= 40) & (ds.longitude.values <= 180)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    views = {"2t": g["2t"].isel(values=box), "lsm": g["lsm"].isel(values=box)}
    with insitu_pipeline(points, manifest, views, batch_size=4) as pipe:
        batch = next(iter(pipe))
    np.testing.assert_array_equal(batch["2t"], ds["2t"].values[batch.sample_indices["2t"]][:, box])
    np.testing.assert_array_equal(batch["lsm"][0], ds.lsm.values[box])


def test_a_concatenation_of_stores_on_a_grid_of_points_fits_per_level(tmp_path: Path) -> None:
    """Two stores of consecutive times on the points, ``concat``-ed: the collection's views
    know the grid of points too (statistics per level, forcings at each point)."""
    ds = _points_dataset()
    paths = []
    for k, times in enumerate([slice(0, 8), slice(8, 16)]):
        paths.append(tmp_path / f"part{k}.zarr")
        enc = {"2t": {"chunks": (4, N)}, "t": {"chunks": (4, 1, N)}}
        ds.isel(time=times).to_zarr(paths[-1], encoding=enc, zarr_format=3, consolidated=False)
    coll = concat(paths, ["t", "2t"])
    manifest = split_by_chunk(coll["t"], (1.0, 0.0, 0.0))
    stats = fit_statistics(coll, manifest, {"t": coll["t"]})
    np.testing.assert_allclose(stats.std["t"], ds.t.std(("time", "values")), rtol=1e-5)
    sun = Forcings("2t", view=coll["2t"], names=["cos_solar_zenith"])
    with insitu_pipeline(
        coll, manifest, {"2t": coll["2t"]}, batch_size=4, batch_transforms=[sun]
    ) as pipe:
        batch = next(iter(pipe))
    want = _at_points(batch.coords["2t"]["time"], ds.latitude.values, ds.longitude.values)
    np.testing.assert_allclose(batch["cos_solar_zenith"], want, atol=1e-6)


def test_a_stack_refuses_members_whose_points_are_in_another_order(tmp_path: Path) -> None:
    """Two stores of a join on the same points stored in other orders: refused, as a latitude
    stored the other way round is on a regular grid (before: stacked, each channel at other
    places); ``isel`` of the first member's order on it stacks them point for point."""
    ds = _points_dataset()
    order = np.random.default_rng(2).permutation(N)
    ds[["t"]].to_zarr(
        tmp_path / "pl.zarr",
        encoding={"t": {"chunks": (4, 1, N)}},
        zarr_format=3,
        consolidated=False,
    )
    sfc = ds[["2t"]].isel(values=order)
    sfc.to_zarr(
        tmp_path / "sfc.zarr",
        encoding={"2t": {"chunks": (4, N)}},
        zarr_format=3,
        consolidated=False,
    )
    coll = join({"pl": (tmp_path / "pl.zarr", ["t"]), "sfc": (tmp_path / "sfc.zarr", ["2t"])})
    with pytest.raises(ValueError, match="isel\\(values="):
        stack({"t": coll["pl/t"], "2t": coll["sfc/2t"]})
    x = stack({"t": coll["pl/t"], "2t": coll["sfc/2t"].isel(values=np.argsort(order))})
    manifest = split_by_chunk(coll["pl/t"], (1.0, 0.0, 0.0))
    with insitu_pipeline(coll, manifest, {"x": x}, batch_size=4) as pipe:
        batch = next(iter(pipe))
    want = ds["2t"].values[batch.sample_indices["x"]]
    np.testing.assert_array_equal(batch["x"][:, 3], want)


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ERA5's ensemble layout, zarr v2: each member and level offset so mixing them shows."""
    rng = np.random.default_rng(1)
    shape = (12, 3, 2, 4, 6)
    member = 10.0 * np.arange(3)[None, :, None, None, None]
    level = 30.0 * np.arange(2)[None, None, :, None, None]
    ds = xr.Dataset(
        {
            "t": (("time", "number", "level", "latitude", "longitude"),
                  (250 + member + level + rng.normal(0, 1, shape)).astype("float32")),
            "lsm": (("latitude", "longitude"), (rng.random((4, 6)) > 0.5).astype("float32")),
        },
        coords={"time": pd.date_range("2020-01-01", periods=12, freq="6h"), "number": [0, 1, 2],
                "level": [850, 500], "latitude": [60.0, 20.0, -20.0, -60.0],
                "longitude": np.arange(0.0, 360.0, 60.0)},
    )  # fmt: skip
    root = tmp_path_factory.mktemp("ens") / "ens.zarr"
    ds.to_zarr(root, encoding={"t": {"chunks": (4, 1, 1, 4, 6)}}, zarr_format=2)
    return root


def test_ensemble_members_select_stack_and_fit_per_member_and_level(ensemble: Path) -> None:
    ds = xr.open_zarr(ensemble)
    g = open_geometries(ensemble)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    t = g["t"]
    stats = fit_statistics(ensemble, manifest, {"t": t, "t1": t.sel(number=1)})
    np.testing.assert_allclose(stats.mean["t"], ds.t.mean(("time", "latitude", "longitude")),
                               rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(stats.std["t1"], ds.t.sel(number=1).std(("time", "latitude",
                               "longitude")), rtol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="select one axis away"):
        stack({"t": t, "lsm": g["lsm"]})
    members = stack({"t": t.sel(level=500).window([-1, 0]), "lsm": g["lsm"]})
    assert members.channels == ("t@0", "t@1", "t@2", "lsm")
    views = {"m": members, "one": t.sel(number=[2, 0], level=850)}
    with insitu_pipeline(ensemble, manifest, views, batch_size=4, shuffle=False) as pipe:
        batch = next(iter(pipe))
    idx = batch.sample_indices["m"]
    np.testing.assert_array_equal(batch["m"][:, :, :3], ds.t.sel(level=500).values[idx])
    one = ds.t.sel(number=[2, 0], level=850).values[batch.sample_indices["one"]]
    np.testing.assert_array_equal(batch["one"], one)
    product = open_geometries(ensemble, sample_axis=("time", "number"))
    with pytest.raises(ValueError, match="one sample axis"):
        product["t"].window([-1, 0])
