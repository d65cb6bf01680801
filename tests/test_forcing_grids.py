"""Forcings of a collection whose members lie at other places: each row on its own member's grid.

Three scenes written with xarray: two over Europe (the same grid, other times) and one over
Australia (latitudes stored north to south). Every delivered row's forcing is compared with
the package's formulas (``forcings.py``'s functions, numpy) evaluated at that row's time on
the coordinates xarray reads from that row's member (of a patched label: cut to the row's own
window). Forcings that would put a row at other points are refused, by the builder and by a
graph composed by hand alike.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from insitubatch_nodes import (
    Collection,
    Loader,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    split_by_member,
    stack,
)
from insitubatch_nodes.forcings import (
    FORCINGS,
    Forcings,
    cos_solar_zenith,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode,
    ChunkPoolNode,
    GatherNode,
    ReadPlanNode,
    StageContext,
)

HOUR = np.timedelta64(1, "h")
FOLDER: dict[str, Path] = {}  # the scenes' folder, by the collection's name
SCENES = {  # name: (lat, lon, first time)
    "europe": (np.linspace(40.0, 61.0, 4), np.linspace(-10.0, 25.0, 8), "2021-06-01T00"),
    "australia": (np.linspace(-12.0, -39.0, 4), np.linspace(115.0, 150.0, 8), "2021-06-01T05"),
    "europe_later": (np.linspace(40.0, 61.0, 4), np.linspace(-10.0, 25.0, 8), "2021-12-01T07"),
}


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> Collection:
    """The three scenes, ``t2m (time, lat, lon)`` of 8 hourly steps chunked 2, each a store
    written by xarray, as one collection."""
    folder = tmp_path_factory.mktemp("scenes")
    rng = np.random.default_rng(0)
    for name, (lat, lon, start) in SCENES.items():
        times = np.datetime64(start, "ns") + np.arange(8) * 3 * HOUR
        t2m = rng.standard_normal((8, len(lat), len(lon))).astype("float32")
        ds = xr.Dataset(
            {"t2m": (("time", "lat", "lon"), t2m)}, coords={"time": times, "lat": lat, "lon": lon}
        )
        ds.to_zarr(folder / f"{name}.zarr", encoding={"t2m": {"chunks": (2, 4, 8)}},
                   zarr_format=3, consolidated=False)  # fmt: skip
    pairs = [(str(folder / f"{name}.zarr"), "t2m") for name in SCENES]
    coll = Collection.from_arrays(pairs, names=list(SCENES), sample_axis="time")
    FOLDER[coll.name] = folder
    return coll


def _expected(name: str, times: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """Forcing ``name`` at ``times`` on the grid ``(lat, lon)``, by the module's functions."""
    shape = (*np.shape(times), len(lat), len(lon))
    if name == "toa_incident_solar_radiation":
        return toa_incident_solar_radiation(times, lat, lon)
    if name == "cos_solar_zenith":
        return cos_solar_zenith(times, lat, lon)
    if name.startswith("local_time"):
        angle = 2 * np.pi * local_time(times, lon) / 24.0
    else:
        angle = 2 * np.pi * year_progress(times)[..., None, None]
    return np.broadcast_to(np.sin(angle) if name.endswith("sin") else np.cos(angle), shape)


def _grid(coll: Collection, member: int, lat: Any = slice(None), lon: Any = slice(None)) -> Any:
    """Member ``member`` of ``coll`` (a subset of the scenes, or all): its coordinates as
    xarray reads them from its store, selected by index."""
    folder = next(iter(FOLDER.values()))
    lats, lons = _coordinates(folder / f"{coll.members[member]}.zarr")
    return lats[lat], lons[lon]


@functools.cache
def _coordinates(store: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(lat, lon)`` of a scene's store as xarray reads them, read once per store (not once per
    row checked: an ``open_zarr`` a row was two thirds of this file's CPU time). The stores are
    written once, by the module's fixture, in a folder of their own; read-only copies, so no
    check can change what a later one compares with."""
    ds = xr.open_zarr(store, consolidated=False)
    lat, lon = ds.lat.values, ds.lon.values
    lat.flags.writeable = lon.flags.writeable = False
    return lat, lon


def _check_rows(
    scenes: Collection, batch: Any, label: str, got: dict[str, np.ndarray], **box: Any
) -> set[int]:
    """Every row's forcings against the formulas on its own member's grid; the members seen."""
    times, members = batch.coords[label]["time"], batch.members[label]
    for i, m in enumerate(members.tolist()):
        lat, lon = _grid(scenes, m, **box)
        for name, values in got.items():
            want = _expected(name, times[i], lat, lon)
            scale = 3.6e6 if name.startswith("toa") else 1.0  # J m-2 over an hour
            np.testing.assert_allclose(values[i], want, atol=2e-6 * scale, err_msg=name)
    return set(members.tolist())


def test_forcings_of_a_collection_compute_each_row_on_its_own_members_grid(
    scenes: Collection,
) -> None:
    view = scenes["data"]
    manifest = split_by_member(scenes, {"train": 1.0})
    forcings = Forcings("x", view=view, prefix="f_")
    # the two European scenes share one grid: one computation, one memory for both
    assert forcings.grid.of_member is not None
    assert forcings.grid.of_member.tolist() == [0, 1, 0] and len(forcings.grid.lats) == 2
    sun = Forcings("s", view=view, names=["cos_solar_zenith", "toa_incident_solar_radiation"])
    s = stack({"t2m": view.window([-1, 0]), "sun": sun})  # (batch, T) times, one member a row
    seen: set[int] = set()
    mixed = 0
    with insitu_pipeline(scenes, manifest, {"x": view, "s": s}, batch_size=5, coords=["time"],
                         batch_transforms=[forcings]) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            got = {name: batch.arrays["f_" + name] for name in FORCINGS}
            seen |= _check_rows(scenes, batch, "x", got)
            channels = batch.arrays["s"][:, :, 1:]  # (batch, T, 2 forcings, lat, lon)
            _check_rows(scenes, batch, "s", {"cos_solar_zenith": channels[:, :, 0],
                        "toa_incident_solar_radiation": channels[:, :, 1]})  # fmt: skip
            mixed += len(set(batch.members["x"].tolist())) > 1
    assert seen == {0, 1, 2} and mixed, "batches mixing scenes at other places"
    # each scene's 7 anchors (the window leaves its first step out): Europe's two scenes on
    # one grid, remembered together
    assert [len(memo) for memo in forcings._memos] == [14, 7]


def test_an_isel_box_and_patches_of_a_collection_take_each_members_own_points(
    scenes: Collection,
) -> None:
    view = scenes["data"]
    manifest = split_by_member(scenes, {"train": 1.0})
    box = view.isel(lat=[0, 2], lon=slice(1, 7, 2))
    forcings = Forcings("b", view=box, names=["cos_solar_zenith"])
    cut = {"lat": 2, "lon": 4}
    patched = stack({"t2m": view.patches(cut, origins="random"),
                     "sun": Forcings("p", view=view, names=["cos_solar_zenith"])})  # fmt: skip
    with insitu_pipeline(scenes, manifest, {"b": box}, batch_size=6, coords=["time"],
                         batch_transforms=[forcings]) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            got = {"cos_solar_zenith": batch.arrays["cos_solar_zenith"]}
            _check_rows(scenes, batch, "b", got, lat=[0, 2], lon=slice(1, 7, 2))
    # a patched stack's forcing: each row's window of its own member's grid
    with insitu_pipeline(scenes, manifest, {"p": patched}, batch_size=6,
                         coords=["time"]) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            times, members = batch.coords["p"]["time"], batch.members["p"]
            for i, (m, (a, b)) in enumerate(zip(members, batch.patch_origins["p"], strict=True)):
                lat, lon = _grid(scenes, int(m), slice(a, a + 2), slice(b, b + 4))
                want = cos_solar_zenith(times[i], lat, lon)
                np.testing.assert_allclose(batch.arrays["p"][i, 1], want, atol=2e-6)
    with pytest.raises(ValueError, match="isel"):  # a value is at other points in each member
        view.sel(lat=slice(40, 50))


def test_forcings_on_one_grid_beside_members_at_other_places_are_refused_when_built(
    scenes: Collection, tmp_path: Path
) -> None:
    view = scenes["data"]
    manifest = split_by_member(scenes, {"train": 1.0})
    lat, lon, _ = SCENES["europe"]
    europe = Forcings("x", lat=lat, lon=lon, names=["cos_solar_zenith"])
    # before: built, and Australia's rows were computed at Europe's points
    with pytest.raises(ValueError, match=r"member 'australia'.*view="):
        insitu_pipeline(scenes, manifest, {"x": view}, coords=["time"], batch_transforms=[europe])
    with pytest.raises(ValueError, match=r"member 'australia'.*view="):
        stack({"t2m": view, "sun": europe})
    # ... and by set_views, for a label it adds (before: taken, Australia at Europe's points)
    later = Forcings("y", lat=lat, lon=lon, names=["cos_solar_zenith"])
    pipe = insitu_pipeline(scenes, manifest, {"x": view}, coords=["time"], batch_transforms=[later])
    with pipe, pytest.raises(ValueError, match=r"member 'australia'.*view="):
        pipe.set_views({"x": view, "y": view})
    # forcings on the grids of another collection's members count its member indices
    other = scenes.subset(["australia", "europe"])
    swapped = Forcings("x", view=other["data"], names=["cos_solar_zenith"])
    with pytest.raises(ValueError, match="a view of the collection the pipeline reads"):
        insitu_pipeline(scenes, manifest, {"x": view}, coords=["time"], batch_transforms=[swapped])
    with pytest.raises(ValueError, match="members of collection-"):
        stack({"t2m": view, "sun": swapped})
    # one grid given where every member is on it: taken, as for one array
    both = scenes.subset(["europe", "europe_later"])
    one = split_by_member(both, {"train": 1.0})
    with insitu_pipeline(both, one, {"x": both["data"]}, batch_size=4, coords=["time"],
                         batch_transforms=[europe]) as pipe:  # fmt: skip
        batch = next(iter(Loader(pipe)))
    assert Forcings("x", view=both["data"]).grid.of_member is None
    _check_rows(both, batch, "x", {"cos_solar_zenith": batch.arrays["cos_solar_zenith"]})
    # a member whose points nothing gives: refused by name, saying what to give
    europe_store = next(iter(FOLDER.values())) / "europe.zarr"
    shutil.copytree(europe_store, tmp_path / "bare.zarr")
    for name in ("lat", "lon"):
        shutil.rmtree(tmp_path / "bare.zarr" / name)
    mixed = Collection.from_arrays(
        [(str(europe_store), "t2m"), (str(tmp_path / "bare.zarr"), "t2m")], names=["europe", "bare"]
    )
    with pytest.raises(KeyError, match=r"member 'bare'.*lat= and lon="):
        Forcings("x", view=mixed["data"])


def _check_windows(
    coll: Collection, batch: Any, label: str, got: dict[str, np.ndarray], extent: dict[str, int]
) -> None:
    """Every row's forcings against the formulas on its own window of its own member's grid:
    the coordinates xarray reads, cut at the row's ``patch_origins`` (in the order of the
    patched dimensions, ``extent``'s)."""
    times, members = batch.coords[label]["time"], batch.members[label]
    for i, (m, origin) in enumerate(zip(members, batch.patch_origins[label], strict=True)):
        at = dict(zip(extent, origin.tolist(), strict=True))
        box = {
            d: slice(at[d], at[d] + extent[d]) if d in at else slice(None) for d in ("lat", "lon")
        }
        lat, lon = _grid(coll, int(m), box["lat"], box["lon"])
        for name, values in got.items():
            scale = 3.6e6 if name.startswith("toa") else 1.0
            np.testing.assert_allclose(values[i], _expected(name, times[i], lat, lon),
                                       atol=2e-6 * scale, err_msg=name)  # fmt: skip


def test_forcings_of_a_patched_label_give_each_row_the_forcings_of_its_own_window(
    scenes: Collection,
) -> None:
    view = scenes["data"]
    manifest = split_by_member(scenes, {"train": 1.0})
    cut = {"lat": 2, "lon": 4}
    patched = view.patches(cut, origins="random")
    steps = patched.window([-1, 0])
    sun = Forcings("p", view=patched, names=["cos_solar_zenith", "toa_incident_solar_radiation"],
                   prefix="p_")  # fmt: skip
    clock = Forcings("w", view=steps, names=["local_time_sin"], prefix="w_")
    channel = stack({"t2m": patched, "sun": Forcings("s", view=view, names=["cos_solar_zenith"])})
    seen: set[int] = set()
    views = {"p": patched, "w": steps, "s": channel}
    with insitu_pipeline(
        scenes, manifest, views, batch_size=6, coords=["time"], batch_transforms=[sun, clock]
    ) as pipe:
        for batch in Loader(pipe):
            n = len(batch.members["p"])
            # before: (batch, 4, 8), the whole grid's forcings beside rows of (2, 4) windows
            assert batch.arrays["p_cos_solar_zenith"].shape == batch.arrays["p"].shape == (n, 2, 4)
            assert batch.arrays["w_local_time_sin"].shape == (n, 2, 2, 4)  # (batch, T, *window)
            got = {name: batch.arrays["p_" + name] for name in sun.names}
            _check_windows(scenes, batch, "p", got, cut)
            _check_windows(scenes, batch, "w", {"local_time_sin": batch.arrays["w_local_time_sin"]},
                           cut)  # fmt: skip
            # the batch transform's cut is the stack's forcing member's, value for value
            np.testing.assert_array_equal(batch.arrays["s"][:, 1], got["cos_solar_zenith"])
            seen |= set(batch.members["p"].tolist())
    assert seen == {0, 1, 2}
    assert sun.window is not None and (sun.window.axes, sun.window.extent) == ((0, 1), (2, 4))
    # one grid for every member, patched along one of its axes: each row (4, 3) of its lon
    both = scenes.subset(["europe", "europe_later"])
    strip = both["data"].patches({"lon": 3}, origins="random")
    zenith = Forcings("x", view=strip, names=["cos_solar_zenith"])
    assert not zenith.grid.per_member
    one = split_by_member(both, {"train": 1.0})
    with insitu_pipeline(
        both, one, {"x": strip}, batch_size=5, coords=["time"], batch_transforms=[zenith]
    ) as pipe:
        batch = next(iter(Loader(pipe)))
    assert batch.arrays["cos_solar_zenith"].flags.c_contiguous
    _check_windows(both, batch, "x", {"cos_solar_zenith": batch.arrays["cos_solar_zenith"]},
                   {"lon": 3})  # fmt: skip


def test_forcings_that_do_not_fit_a_patched_labels_windows_are_refused_not_cropped_by_hand(
    scenes: Collection,
) -> None:
    both = scenes.subset(["europe", "europe_later"])
    manifest = split_by_member(both, {"train": 1.0})
    view = both["data"]
    patched = view.patches({"lat": 2, "lon": 4}, origins="random")
    lat, lon, _ = SCENES["europe"]
    names = ["cos_solar_zenith"]
    whole = Forcings("p", lat=lat, lon=lon, names=names)  # before: every row the (4, 8) grid
    unpatched = Forcings("p", view=view, names=names)
    other = Forcings("p", view=view.patches({"lat": 2, "lon": 2}), names=names)
    wrong = [
        (whole, r"label 'p' is patched .*whole grid.*view= the view of label 'p'"),
        (unpatched, r"label 'p' is patched .*whole grid.*view= the view of label 'p'"),
        (other, r"cut windows of \{'lat': 2, 'lon': 2\}.*view= the view of label 'p'"),
    ]
    for forcings, match in wrong:
        with pytest.raises(ValueError, match=match):
            insitu_pipeline(both, manifest, {"p": patched}, coords=["time"],
                            batch_transforms=[forcings])  # fmt: skip
    cropped = Forcings("p", view=patched, names=names)
    with pytest.raises(ValueError, match=r"label 'p' is not patched: build Forcings with view="):
        insitu_pipeline(both, manifest, {"p": view}, coords=["time"], batch_transforms=[cropped])
    # applied to the batches by hand (a Mapper after the pipeline): refused at the first batch
    batches = {}
    for label, v in (("p", patched), ("x", view)):
        with insitu_pipeline(both, manifest, {label: v}, batch_size=4, coords=["time"]) as pipe:
            batches[label] = next(iter(Loader(pipe)))
    for forcings in (whole, unpatched):
        with pytest.raises(ValueError, match=r"label 'p' is patched .*whole grid.*view="):
            forcings(batches["p"])
    with pytest.raises(ValueError, match=r"label 'x' is not patched"):
        Forcings("x", view=patched, names=names)(batches["x"])
    assert cropped(batches["p"]).arrays["cos_solar_zenith"].shape == (4, 2, 4)


def test_a_graph_composed_by_hand_refuses_forcings_at_other_points_as_the_builder_does(
    scenes: Collection,
) -> None:
    view = scenes["data"]
    manifest = split_by_member(scenes, {"train": 1.0})
    lat, lon, _ = SCENES["europe"]
    europe = Forcings("x", lat=lat, lon=lon, names=["cos_solar_zenith"])
    patched = view.patches({"lat": 2, "lon": 4})
    whole = Forcings("p", view=view, names=["cos_solar_zenith"])
    # before: built, and Australia's rows were computed at Europe's points (1.1 off in cos θ),
    # and the patched label's rows got the whole grid
    for label, v, wrong, match in (
        ("x", view, europe, r"member 'australia'.*view="),
        ("p", patched, whole, r"label 'p' is patched .*whole grid"),
    ):
        plan = ReadPlanNode(manifest, {label: v}, config=PlanConfig(batch_size=4))
        context = StageContext.create(plan, ChunkPool(None))
        fetch = AsyncChunkFetchNode(plan, scenes.store, context=context)
        resident = ChunkPoolNode(fetch, context=context)
        try:
            with pytest.raises(ValueError, match=match):
                GatherNode(resident, context=context, batch_transforms=[wrong])
            fits = [Forcings(label, view=v)]
            assert GatherNode(resident, context=context, batch_transforms=fits).batch_transforms
        finally:
            fetch.close()


def test_forcings_of_patches_that_also_cut_levels_or_a_selected_grid_cut_only_the_grid(
    tmp_path: Path,
) -> None:
    """The route a stack's error points patches cutting ``level`` to: the batch transform cuts
    the grid's axes only, at their columns of ``patch_origins``; a grid axis selected, not
    patched, stays as selected."""
    lat, lon = np.linspace(30.0, 55.0, 6), np.linspace(0.0, 35.0, 8)
    times = np.datetime64("2022-03-20T00", "ns") + np.arange(8) * 5 * HOUR
    data = np.zeros((8, 3, 6, 8), "float32")
    coords = {"time": times, "level": [1000, 850, 500], "lat": lat, "lon": lon}
    ds = xr.Dataset({"z": (("time", "level", "lat", "lon"), data)}, coords=coords)
    encoding = {"z": {"chunks": (2, 3, 6, 8)}}
    ds.to_zarr(tmp_path / "z.zarr", encoding=encoding, zarr_format=3, consolidated=False)
    z = open_geometries(tmp_path / "z.zarr")["z"]
    manifest = split_by_chunk(z, (1.0, 0.0, 0.0))
    cases = [  # view, (lat, lon) of a row at its origins
        (z.patches({"level": 2, "lat": 3}), lambda o: (lat[o[1] : o[1] + 3], lon)),
        (
            z.isel(lat=[1, 3, 5]).patches({"lon": 3}),
            lambda o: (lat[[1, 3, 5]], lon[o[0] : o[0] + 3]),
        ),
    ]
    for view, window in cases:
        sun = Forcings("x", view=view, names=["cos_solar_zenith"])
        with insitu_pipeline(
            tmp_path / "z.zarr", manifest, {"x": view}, batch_size=4, batch_transforms=[sun]
        ) as pipe:
            batch = next(iter(Loader(pipe)))
        got, when = batch.arrays["cos_solar_zenith"], batch.coords["x"]["time"]
        assert got.shape == (4, *batch.arrays["x"].shape[-2:])  # before: (4, 6, 8) or (4, 3, 8)
        for i, origin in enumerate(batch.patch_origins["x"].tolist()):
            np.testing.assert_allclose(
                got[i], cos_solar_zenith(when[i], *window(origin)), atol=2e-6
            )
