"""Static fields as forecasters, radio astronomers and microscopists use them: what a black-box
trial against zarr and numpy found.

A static field has no sample dimension (a land-sea mask ``(lat, lon)`` beside ``(time, lat,
lon)`` data, a primary-beam mask ``(dec, ra)`` beside a spectral cube ``(freq, dec, ra)``, a
flat-field ``(c, y, x)`` beside a ``(z, c, y, x)`` stack). Each test is one behaviour the trial
got wrong before its fix; stores are tiny, written with zarr, and zarr's read cut with numpy
at the window ``batch.patch_origins`` names is the oracle.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.storage
from helpers import counting_store
from resume_helpers import assert_resumes_exactly, digest

from insitubatch_nodes import (
    Collection,
    Loader,
    concat,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.io.collection import join
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode,
    ChunkPoolNode,
    GatherNode,
    ReadPlanNode,
    StageContext,
)
from insitubatch_nodes.static import StaticFields, read_static

F, D, R = 6, 12, 14  # a spectral cube, its edges not multiples of the tiles
T, LAT, LON = 16, 8, 12  # an ERA5-like grid
Z, C, Y, X = 8, 2, 10, 12  # a microscopy stack


def _array(
    group: zarr.Group, name: str, data: np.ndarray, dims: tuple[str, ...], **kw: Any
) -> None:
    chunks = kw.pop("chunks", data.shape)
    group.create_array(name, shape=data.shape, chunks=chunks, dtype=data.dtype,
                       dimension_names=dims, **kw)[...] = data  # fmt: skip


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three stores: a cube with its primary beam, an ERA5-like grid with its land-sea mask and
    levelled orography, a microscopy stack with its flat-field."""
    folder = tmp_path_factory.mktemp("static_trial")
    rng = np.random.default_rng(0)
    out = {}
    cube = zarr.open_group(folder / "cube.zarr", mode="w", zarr_format=3)
    _array(cube, "cube", rng.random((F, D, R), dtype="f4"), ("freq", "dec", "ra"),
           chunks=(6, 8, 8))  # fmt: skip
    _array(cube, "beam", rng.random((D, R), dtype="f4"), ("dec", "ra"))
    _array(cube, "beams", rng.random((2, D, R), dtype="f4"), ("pol", "dec", "ra"))
    _array(cube, "pol", np.array([0, 1]), ("pol",))
    out["cube"] = folder / "cube.zarr"
    era5 = zarr.open_group(folder / "era5.zarr", mode="w", zarr_format=3)
    _array(era5, "t2m", rng.random((T, LAT, LON), dtype="f4"), ("time", "lat", "lon"),
           chunks=(4, 4, 6))  # fmt: skip
    _array(era5, "lsm", (rng.random((LAT, LON)) > 0.5).astype("f4"), ("lat", "lon"))
    _array(era5, "orog", rng.random((3, LAT, LON), dtype="f4"), ("level", "lat", "lon"))
    _array(era5, "coarse", rng.random((LAT // 2, LON), dtype="f4"), ("lat", "lon"))
    for name, values in (
        ("time", np.arange(T)),
        ("lat", np.linspace(-60, 60, LAT)),
        ("lon", np.arange(LON) * 30.0),
        ("level", np.array([1000, 850, 500])),
    ):
        _array(era5, name, values, (name,))  # fmt: skip
    out["era5"] = folder / "era5.zarr"
    micro = zarr.open_group(folder / "micro.zarr", mode="w", zarr_format=3)
    _array(micro, "image", rng.random((Z, C, Y, X), dtype="f4"), ("z", "c", "y", "x"),
           chunks=(2, C, 5, 6))  # fmt: skip
    _array(micro, "flat", rng.random((C, Y, X), dtype="f4"), ("c", "y", "x"))
    out["micro"] = folder / "micro.zarr"
    return out


def _read(root: Path, path: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root, path=path, mode="r")[...])


def _window(data: np.ndarray, dims: tuple[str, ...], spec: Any, origin: np.ndarray) -> np.ndarray:
    """``data`` (named ``dims``) at the window of ``spec`` whose origin is ``origin``: cut
    along each patched dimension it has."""
    index: list[Any] = [slice(None)] * data.ndim
    for d, o, e in zip(spec.dims, origin.tolist(), spec.extent, strict=True):
        if d in dims:
            index[dims.index(d)] = slice(o, o + e)
    return data[tuple(index)]


def _assert_windows(
    rows: np.ndarray, data: np.ndarray, dims: tuple[str, ...], spec: Any, origins: np.ndarray
) -> None:
    """Each row of ``rows`` is ``data`` (named ``dims``) at its own window (``origins``)."""
    assert len(rows) == len(origins)
    for row, o in zip(rows, origins, strict=True):
        np.testing.assert_array_equal(row, _window(data, dims, spec, o))


def _epoch(root: Path, views: dict[str, Any], **kw: Any) -> list[Any]:
    """Every batch of one epoch (arrays copied), with its patch origins."""
    first = next(v for v in views.values() if isinstance(v, ArrayGeometry) and not v.static)
    manifest = split_by_chunk(first, (1.0, 0.0, 0.0))
    out = []
    with insitu_pipeline(root, manifest, views, **{"batch_size": 4, "seed": 3, **kw}) as pipe:
        for batch in Loader(pipe):
            origins = next(iter(batch.patch_origins.values()))
            out.append(({k: np.array(v) for k, v in batch.arrays.items()}, origins.copy()))
    return out


def test_a_static_label_beside_patched_labels_carries_each_rows_window_of_it(
    stores: dict[str, Path],
) -> None:
    # before: every row carried the whole mask, (batch, 12, 14) beside (batch, 4, 5) windows,
    # where a patched stack's static member was cut to the row's window
    cube = open_geometries(stores["cube"], sample_axis={"cube": ()})
    sky = cube["cube"].patches({"dec": 4, "ra": 5}, origins="random")
    beam, beams = _read(stores["cube"], "beam"), _read(stores["cube"], "beams")
    views = {
        "x": sky,
        "beam": cube["beam"],
        "beam_x": cube["beams"].as_static().sel(pol=1),  # selected on another dimension
        "beams": cube["beams"].as_static().isel(pol=[1, 0]),
        "s": stack({"cube": sky, "beam": cube["beam"]}),
        "s_last": stack({"cube": sky, "beam": cube["beam"]}, layout="channels_last"),
    }
    spec, dims = sky.patch, ("dec", "ra")
    for arrays, origins in _epoch(stores["cube"], views):
        assert arrays["beam"].shape == (len(origins), 4, 5)
        for r, o in enumerate(origins):
            want = _window(beam, dims, spec, o)
            np.testing.assert_array_equal(arrays["beam"][r], want)
            np.testing.assert_array_equal(arrays["s"][r, F], want)  # the stack's, value for value
            np.testing.assert_array_equal(arrays["s_last"][r, ..., F], want)
            np.testing.assert_array_equal(arrays["beam_x"][r], _window(beams[1], dims, spec, o))
            np.testing.assert_array_equal(
                arrays["beams"][r], _window(beams[[1, 0]], ("pol", *dims), spec, o)
            )
    # 3-D sub-cubes: the beam is cut along (dec, ra), as a label and as a stack's channel
    # (before, the stack refused it: "without the patched dimensions ('freq', 'dec', 'ra')")
    sub = cube["cube"].patches({"freq": 3, "dec": 4, "ra": 5}, origins="random")
    views = {"x": sub, "beam": cube["beam"], "s": stack({"c": sub, "beam": cube["beam"]}),
             "s_last": stack({"c": sub, "beam": cube["beam"]}, layout="channels_last")}  # fmt: skip
    for arrays, origins in _epoch(stores["cube"], views):
        _assert_windows(arrays["beam"], beam, dims, sub.patch, origins)
        np.testing.assert_array_equal(arrays["s"][:, 3], arrays["beam"])  # after 3 channels
        np.testing.assert_array_equal(arrays["s_last"][..., 3], arrays["beam"])
    # an ERA5 grid in random lat/lon patches: the land-sea mask and the orography's levels
    era5 = open_geometries(stores["era5"], sample_axis="time")
    box = era5["t2m"].patches({"lat": 3, "lon": 4}, origins="random")
    lsm, orog = _read(stores["era5"], "lsm"), _read(stores["era5"], "orog")
    views = {"x": box, "lsm": era5["lsm"], "orog": era5["orog"].sel(level=[500, 1000])}
    for arrays, origins in _epoch(stores["era5"], views, coords=()):
        _assert_windows(arrays["lsm"], lsm, ("lat", "lon"), box.patch, origins)
        _assert_windows(arrays["orog"], orog[[2, 0]], ("level", "lat", "lon"), box.patch, origins)
    # a microscopy stack in (y, x) tiles of every z plane, and its flat-field per channel
    micro = open_geometries(stores["micro"], sample_axis="z")
    tiles = micro["image"].patches({"y": 5, "x": 4})
    flat = _read(stores["micro"], "flat")
    views = {"x": tiles, "flat": micro["flat"], "flat1": micro["flat"].isel(c=1)}
    seen = set()
    for arrays, origins in _epoch(stores["micro"], views):
        for r, o in enumerate(origins):
            seen.add(tuple(o.tolist()))
            want = _window(flat, ("c", "y", "x"), tiles.patch, o)
            np.testing.assert_array_equal(arrays["flat"][r], want)
            np.testing.assert_array_equal(arrays["flat1"][r], want[1])
    assert len(seen) == 2 * 3  # every window of the grid came


def test_a_windowed_static_label_resumes_exactly_and_ranks_cut_their_own_rows(
    stores: dict[str, Path],
) -> None:
    era5 = open_geometries(stores["era5"], sample_axis="time")
    box = era5["t2m"].patches({"lat": 3, "lon": 4}, origins="random")
    views = {"x": box, "lsm": era5["lsm"]}
    manifest = split_by_chunk(era5["t2m"], (1.0, 0.0, 0.0))
    lsm = _read(stores["era5"], "lsm")

    def build() -> Any:
        return insitu_pipeline(stores["era5"], manifest, views, batch_size=4, seed=5, coords=())

    def records(batches: list[Any]) -> list[Any]:
        out = []
        for b in batches:  # each row its own window's mask
            _assert_windows(b["lsm"], lsm, ("lat", "lon"), box.patch, b.patch_origins["x"])
            out.append((digest(b["x"]), digest(b["lsm"])))
        return out

    with build() as pipe:
        ref = records([b for _ in range(2) for b in Loader(pipe)])
    assert_resumes_exactly(build, records, ref, [3])
    rows = []
    for rank in (0, 1):
        with insitu_pipeline(stores["era5"], manifest, views, batch_size=4, seed=5, coords=(),
                             rank=rank, world_size=2) as pipe:  # fmt: skip
            for b in pipe:
                _assert_windows(b["lsm"], lsm, ("lat", "lon"), box.patch, b.patch_origins["x"])
                for r, o in enumerate(b.patch_origins["x"]):
                    rows.append((int(b.sample_indices["x"][r]), *o.tolist()))
    assert len(rows) == len(set(rows))  # disjoint rows, each with its own window's mask
    with build() as pipe:  # set_views: other labels of the same windows cut it alike
        pipe.set_views({"y": box.shift(1), "lsm": era5["lsm"]})
        batches = list(pipe)
        assert batches and all("x" not in b.arrays for b in batches)
        for b in batches:
            _assert_windows(b["lsm"], lsm, ("lat", "lon"), box.patch, b.patch_origins["y"])
        other = era5["t2m"].patches({"lat": 2, "lon": 4})
        with pytest.raises(ValueError, match=r"'lat': 2, 'lon': 4.*patch the labels as"):
            pipe.set_views({"x": other, "lsm": era5["lsm"]})


def test_a_static_label_on_another_grid_than_the_patched_field_is_refused_when_built(
    stores: dict[str, Path],
) -> None:
    # before: delivered whole beside the windows; it cannot be cut at them
    era5 = open_geometries(stores["era5"], sample_axis="time")
    box = era5["t2m"].patches({"lat": 3, "lon": 4})
    manifest = split_by_chunk(era5["t2m"], (1.0, 0.0, 0.0))
    reversed_ = era5["lsm"].isel(lat=slice(None, None, -1))  # e.g. stored north to south
    for static, has in ((era5["coarse"], r"4\)"),
                        (era5["lsm"].isel(lat=slice(0, 6)), "6, selected"),
                        (reversed_, "all 8, in another order")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"static label 'm' .*'lat'.*it has {has}"):
            insitu_pipeline(stores["era5"], manifest, {"x": box, "m": static}, coords=())


def test_a_graph_composed_by_hand_refuses_static_fields_that_do_not_cut_at_its_windows(
    stores: dict[str, Path],
) -> None:
    # before: StaticFields(read_static(...)) beside patched labels put the whole mask in rows
    era5 = open_geometries(stores["era5"], sample_axis="time")
    box = era5["t2m"].patches({"lat": 3, "lon": 4}, origins="random")
    statics = {"lsm": era5["lsm"]}
    data = read_static(stores["era5"], statics, 10.0)
    plan = ReadPlanNode(split_by_chunk(box, (1.0, 0.0, 0.0)), {"x": box},
                        config=PlanConfig(batch_size=4))  # fmt: skip
    context = StageContext.create(plan, ChunkPool(None))
    fetch = AsyncChunkFetchNode(plan, zarr.storage.LocalStore(stores["era5"]), context=context)
    resident = ChunkPoolNode(fetch, context=context)
    lsm = _read(stores["era5"], "lsm")
    try:
        other = era5["t2m"].patches({"lat": 4, "lon": 4}).patch
        wrongs = {"given no views": StaticFields(data),
                  "cut at no windows": StaticFields(data, statics),
                  "'lat': 4, 'lon': 4": StaticFields(data, statics, other)}  # fmt: skip
        for match, wrong in wrongs.items():
            with pytest.raises(ValueError, match=match):
                GatherNode(resident, context=context, batch_transforms=[wrong])
        fits = StaticFields(data, statics, box.patch)
        gather = GatherNode(resident, context=context, batch_transforms=[fits])
        batch = next(iter(gather))
        _assert_windows(batch["lsm"], lsm, ("lat", "lon"), box.patch, batch.patch_origins["x"])
    finally:
        fetch.close()


def test_levelled_static_fields_that_outnumber_the_data_arrays_are_still_static(
    tmp_path: Path,
) -> None:
    # before: two (level, lat, lon) orography fields beside one (time, lat, lon) array out-
    # voted it: 'level' became the sample dimension and t2m a static field
    times = np.datetime64("2020-01-01T00", "ns") + np.arange(8) * np.timedelta64(6, "h")
    coords = {"time": times, "level": [1000, 500], "lat": np.arange(4.0), "lon": np.arange(5.0)}
    field = ("level", "lat", "lon")
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), np.zeros((8, 4, 5), "f4")),
         "orog": (field, np.ones((2, 4, 5), "f4")), "sdor": (field, np.ones((2, 4, 5), "f4"))},
        coords=coords,
    )  # fmt: skip
    ds.to_zarr(tmp_path / "s.zarr", zarr_format=3, consolidated=False)
    g = open_geometries(tmp_path / "s.zarr")
    assert {k: v.static for k, v in g.items()} == {"t2m": False, "orog": True, "sdor": True}
    assert g["t2m"].n_samples == 8


def test_a_static_field_among_a_collections_variables_is_refused_as_one(tmp_path: Path) -> None:
    # before: "no dimension named 'time' ...; name it by index, or give the axes' names: dims="
    # for an array that names its dimensions: dims= cannot help a land-sea mask
    coords = {"lat": np.arange(4.0), "lon": np.arange(5.0)}
    for k in range(2):  # two yearly stores, each with its land-sea mask
        times = np.datetime64("2020-01-01", "ns") + (np.arange(4) + 4 * k) * np.timedelta64(6, "h")
        ds = xr.Dataset(
            {"t2m": (("time", "lat", "lon"), np.zeros((4, 4, 5), "f4")),
             "lsm": (("lat", "lon"), np.ones((4, 5), "f4"))},
            coords={"time": times, **coords},
        )  # fmt: skip
        ds.to_zarr(tmp_path / f"y{k}.zarr", zarr_format=3, consolidated=False)
    stores = [str(tmp_path / f"y{k}.zarr") for k in range(2)]
    match = r"'lsm'.* no .*'time'.*'lsm' may be a static field.*not supported.*batch transform"
    with pytest.raises(KeyError, match=match):
        concat(stores, ["t2m", "lsm"], dim="time")
    with pytest.raises(KeyError, match=match):
        Collection.from_groups(None, [(s, "") for s in stores], {"t2m": "t2m", "lsm": "lsm"},
                               names=["y0", "y1"], sample_axis="time")  # fmt: skip
    # join: "has no time coordinate 'time' beside 'lsm'", as if a coordinate were missing
    with pytest.raises(ValueError, match=match):
        join({"data": (stores[0], ["t2m"]), "const": (stores[1], ["lsm"])})


def test_a_static_stack_member_on_a_grid_named_otherwise_is_compared_point_by_point(
    tmp_path: Path,
) -> None:
    # before: a land-sea mask on (latitude, longitude), its latitude stored north to south,
    # stacked beside (lat, lon) data stored south to north, was accepted: every row's mask
    # upside down against its data (the points were compared only under equal names)
    times = np.datetime64("2020-01-01", "ns") + np.arange(8) * np.timedelta64(6, "h")
    lat, lon = np.linspace(-60.0, 60.0, 4), np.arange(5) * 60.0
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), np.zeros((8, 4, 5), "f4"))},
                    coords={"time": times, "lat": lat, "lon": lon})  # fmt: skip
    mask = np.arange(20, dtype="f4").reshape(4, 5)
    ds["lsm"] = xr.DataArray(mask[::-1], dims=("latitude", "longitude"),
                             coords={"latitude": lat[::-1], "longitude": lon})  # fmt: skip
    ds.to_zarr(tmp_path / "s.zarr", zarr_format=3, consolidated=False)
    g = open_geometries(tmp_path / "s.zarr")
    with pytest.raises(ValueError, match=r"'lsm' is at 'latitude' \[60.0, .*'t' at 'lat' \[-60"):
        stack({"t": g["t2m"], "lsm": g["lsm"]})
    flipped = g["lsm"].sel(latitude=slice(None, None, -1))  # the points of the data, in order
    x = stack({"t": g["t2m"], "lsm": flipped, "lsm_i": g["lsm"].isel(latitude=[3, 2, 1, 0])})
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    with insitu_pipeline(tmp_path / "s.zarr", manifest, {"x": x}, batch_size=4) as pipe:
        batch = next(iter(pipe))
    np.testing.assert_array_equal(batch["x"][:, 1:], np.broadcast_to(mask, (4, 2, 4, 5)))


def test_the_pipelines_stats_count_the_reads_of_its_static_fields(
    stores: dict[str, Path], tmp_path: Path
) -> None:
    # before: pipe.stats() counted the pool's GETs only, and a static field read once per
    # pipeline (or taken from the persistent cache) left no trace there
    era5 = open_geometries(stores["era5"], sample_axis="time")
    manifest = split_by_chunk(era5["t2m"], (1.0, 0.0, 0.0))
    views = {"t": era5["t2m"], "lsm": era5["lsm"], "s": stack({"t": era5["t2m"], "m": era5["lsm"]})}
    for k in range(2):  # the second pipeline over the persistent cache reads none of them
        store = counting_store(stores["era5"])
        with insitu_pipeline(store, manifest, views, batch_size=4, coords=(),
                             cache_dir=tmp_path / "cache", persist=True) as pipe:  # fmt: skip
            list(pipe)
            pipe.set_views({**views, "o": stack({"t": era5["t2m"], "o": era5["orog"]})})
            pipe.reset()
            list(pipe)
            stats = pipe.stats()
        static = sum(n for key, n in store.counts.items() if key.startswith(("lsm/c", "orog/c")))
        assert static == stats["static_gets"] == (2 if k == 0 else 0)  # one object each
        assert stats["static_disk_hits"] == (0 if k == 0 else 2)
        assert stats["gets"] == store.chunk_gets - static


def test_a_static_label_on_the_patched_grid_named_otherwise_is_refused_until_renamed(
    tmp_path: Path,
) -> None:
    # before: a land-sea mask on (latitude, longitude), or on unnamed axes, beside (lat, lon)
    # patches stayed whole: every row carried the whole (8, 12) mask beside (3, 4) windows
    rng = np.random.default_rng(1)
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    _array(group, "t2m", rng.random((T, LAT, LON), dtype="f4"), ("time", "lat", "lon"),
           chunks=(4, 4, 6))  # fmt: skip
    mask = rng.random((LAT, LON), dtype="f4")
    _array(group, "lsm", mask, ("latitude", "longitude"))
    _array(group, "half", mask, ("lat", "longitude"))  # cut along lat only, whole along lon
    _array(group, "orog", rng.random((3, LAT, LON), dtype="f4"), ("level", "y", "x"))
    group.create_array("bare", shape=mask.shape, dtype=mask.dtype)[...] = mask  # no names
    _array(group, "band", rng.random(LAT, dtype="f4"), ("freq",))  # not on the grid: whole
    g = open_geometries(root, ["t2m", "lsm", "half", "orog", "band"], sample_axis="time")
    g["bare"] = open_geometries(root, ["bare"])["bare"].as_static()
    box = g["t2m"].patches({"lat": 3, "lon": 4}, origins="random")
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    for name, dims in (("lsm", r"\('latitude', 'longitude'\)"), ("half", "'longitude'"),
                       ("orog", r"\('level', 'y', 'x'\)"), ("bare", "unnamed")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"static label 'm' .*{dims}.*dim_names="):
            insitu_pipeline(root, manifest, {"x": box, "m": g[name]}, coords=())
    # named as the patched labels' dimensions (what the message says to do), each row is cut
    lsm = replace(g["lsm"], dim_names=("lat", "lon"))
    orog = replace(g["orog"], dim_names=("level", "lat", "lon"))
    views = {"x": box, "lsm": lsm, "orog": orog.isel(level=[2, 0]), "band": g["band"]}
    for arrays, origins in _epoch(root, views, coords=()):
        _assert_windows(arrays["lsm"], mask, ("lat", "lon"), box.patch, origins)
        want = _read(root, "orog")[[2, 0]]
        _assert_windows(arrays["orog"], want, ("level", "lat", "lon"), box.patch, origins)
        np.testing.assert_array_equal(arrays["band"][0], _read(root, "band"))  # (freq,): whole
    # no names on either side: named alike on both, as the message says, it is cut too
    group.create_array("bare_t", shape=(T, LAT, LON), chunks=(4, 4, 6), dtype="f4")[...] = 1
    bare_t = open_geometries(root, ["bare_t"])["bare_t"]
    with pytest.raises(ValueError, match=r"patched axes \[1, 2\] .*dim_names=\(\.\.\.\)\) on both"):
        insitu_pipeline(root, manifest, {"x": bare_t.patches({1: 3, 2: 4}), "m": g["bare"]})
    named = replace(bare_t, dim_names=("t", "y", "x")).patches({"y": 3, "x": 4}, origins="random")
    views = {"x": named, "m": replace(g["bare"], dim_names=("y", "x"))}
    for arrays, origins in _epoch(root, views, coords=()):
        _assert_windows(arrays["m"], mask, ("y", "x"), named.patch, origins)
