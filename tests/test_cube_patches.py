"""Windows of an array without a sample axis (``sample_axis=()``): a spectral cube
``(freq, dec, ra)`` with no Stokes axis to sample along is one sample, and its patches —
sky patches with the whole spectrum or a band, or 3-D sub-cubes — are the samples.

zarr's read of the cube (read once per check) cut at the window ``batch.patch_origins``
names is the oracle for every row. Each window of an epoch comes exactly once, each stored
object is read once per epoch (swept: also under a budget below the cube), a mid-epoch state
resumes bit-exactly, and two ranks deliver disjoint windows. Before, ``sample_axis=()`` was
refused and a static view could not be patched: a cube without a length-1 axis to sample
along could not be cut into windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, window_of
from resume_helpers import assert_resumes_exactly, epochs_of

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.schedule import schedule_floors

F, D, R = 20, 30, 34  # edges: dec and ra are not multiples of the tiles
CHUNKS = (8, 16, 16)  # 3 x 2 x 3 = 18 stored objects
FREQ = 1.42e9 - np.arange(F) * 1e6  # Hz, descending, as FITS-converted cubes run


@pytest.fixture(scope="module")
def cube(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cube") / "cube.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((F, D, R)).astype("f4")
    data[3] = np.nan  # a flagged channel
    dims = ("freq", "dec", "ra")
    group.create_array("cube", shape=data.shape, chunks=CHUNKS, dtype="f4",
                       fill_value=np.nan, dimension_names=dims)[...] = data  # fmt: skip
    mask = (data > 1.5).astype("u1")  # a source mask, tiled otherwise
    group.create_array("mask", shape=mask.shape, chunks=(20, 8, 34), dtype="u1",
                       dimension_names=dims)[...] = mask  # fmt: skip
    for name, values in (("freq", FREQ), ("dec", np.arange(D) / 3600), ("ra", np.arange(R))):
        group.create_array(name, shape=values.shape, dtype="f8",
                           dimension_names=(name,))[...] = values  # fmt: skip
    return root


def _read(root: Path, path: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root, path=path, mode="r")[...])


def _deliver(
    root: Any, views: dict[str, ArrayGeometry], band: slice = slice(None), **kw: Any
) -> list[tuple[int, ...]]:
    """The origins of every row of one epoch, each row checked against zarr's read (of the
    channels ``band`` where the views select a band)."""
    first = next(iter(views.values()))
    manifest = split_by_chunk(first, (1.0, 0.0, 0.0))
    data = {label: _read(root, v.path)[band] for label, v in views.items()}
    seen = []
    with insitu_pipeline(root, manifest, views, **{"batch_size": 5, "seed": 1, **kw}) as pipe:
        for batch in Loader(pipe):
            o = batch.patch_origins.get("x", np.zeros((len(batch), 0), np.int64))
            for label in views:  # views patched alike: the same origins, row for row
                if o.shape[1]:
                    np.testing.assert_array_equal(batch.patch_origins[label], o)
                np.testing.assert_array_equal(batch.sample_indices[label], 0)  # one sample
            for r in range(len(batch)):
                for label, view in views.items():
                    want = window_of(data[label], view, o[r])
                    assert np.array_equal(batch[label][r], want, equal_nan=True), (label, o[r])
                seen.append(tuple(int(v) for v in o[r]))
    return seen


def test_a_cube_without_a_sample_axis_was_refused_and_is_now_one_sample(cube: Path) -> None:
    static = open_geometries(cube, ["cube"])["cube"].as_static()
    with pytest.raises(ValueError, match=r"open it with sample_axis=\(\)"):
        static.patches({"dec": 8, "ra": 8})  # before: "patch the arrays", and no way to
    geom = open_geometries(cube, sample_axis=())["cube"]  # before: "two or more axes"
    assert not geom.static and geom.product is not None and geom.product.axes == ()
    assert (geom.n_samples, geom.n_chunks, geom.samples_per_chunk) == (1, 1, 1)
    assert geom.field_axes == (0, 1, 2) and geom.inner_shape == (F, D, R)
    assert geom.sample_coords([0]).shape == (1, 0)
    assert geom.product.samples(np.zeros((3, 0), np.int64)).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"shift\(\) .* this view has none"):
        geom.shift(1)
    assert {geom.store_key(0, t) for t in geom.tiles()} == {
        f"cube/c/{f}/{d}/{r}" for f in range(3) for d in range(2) for r in range(3)
    }
    mixed = open_geometries(cube, ["cube", "mask"], sample_axis={"cube": ()})
    assert mixed["cube"].product == geom.product and mixed["mask"].product is None
    whole = _deliver(cube, {"x": geom})  # unpatched: the whole cube, one row an epoch
    assert whole == [()]


def test_every_window_is_zarrs_read_and_comes_once_an_epoch(cube: Path) -> None:
    geoms = open_geometries(cube, sample_axis=())
    cube_, mask = geoms["cube"], geoms["mask"]
    sky = {"dec": 8, "ra": 8}
    dec = [0, 8, 16, 22]  # a grid, plus a window flush with the far edge
    ra = [0, 8, 16, 24, 26]
    # sky patches with the whole spectrum, and the cube's mask patched alike (tiled otherwise)
    seen = _deliver(cube, {"x": cube_.patches(sky), "y": mask.patches(sky)}, block_chunks=2)
    assert sorted(seen) == [(d, r) for d in dec for r in ra]
    # a band by value (high to low, as the axis runs; both ends kept) and by index
    band = cube_.sel(freq=slice(1.418e9, 1.409e9))
    assert band.inner_shape == (10, D, R)
    views = {"x": band.patches(sky), "y": mask.isel(freq=slice(2, 12)).patches(sky)}
    seen = _deliver(cube, views, band=slice(2, 12))
    assert sorted(seen) == [(d, r) for d in dec for r in ra]
    # 3-D sub-cubes (a 3-D U-Net's inputs) in a box of the sky: a spatial split
    sub = cube_.patches({"freq": 8, "dec": 8, "ra": 8}, within={"ra": (0, 20)})
    assert sub.inner_shape == (8, 8, 8)
    seen = _deliver(cube, {"x": sub}, block_chunks=3)
    assert sorted(seen) == [(f, d, r) for f in (0, 8, 12) for d in dec for r in (0, 8, 12)]
    # random origins: new windows each epoch, every row still zarr's read
    rand = cube_.patches(sky, origins="random", per_tile=2)
    seen = _deliver(cube, {"x": rand})
    assert len(seen) == 2 + 1 + 1 + 1  # per full home tile 2, the edge tiles their share
    assert seen != _deliver(cube, {"x": rand}, seed=2)  # other seed, other windows


def test_each_stored_object_is_read_once_per_epoch(cube: Path) -> None:
    store = counting_store(cube)
    geom = open_geometries(store, ["cube"], sample_axis=())["cube"]
    view = geom.patches({"dec": 8, "ra": 8}, within={"ra": (0, 16)})  # one column of tiles
    store.reset_counts()
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    with insitu_pipeline(store, manifest, {"x": view}, batch_size=3, block_chunks=1) as pipe:
        loader = Loader(pipe)
        counts = []
        for _ in range(2):
            assert sum(len(b) for b in loader) == 4 * 2
            counts.append(store.chunk_counts())
            store.reset_counts()
    first, second = counts
    # only the tiles the box overlaps (ra tile 0), every one of them once
    assert first == {f"cube/c/{f}/{d}/0": 1 for f in range(3) for d in range(2)}, first
    assert set(second.values()) <= {1}, second


def test_a_cube_larger_than_the_budget_is_swept_reading_each_tile_once(tmp_path: Path) -> None:
    root = tmp_path / "big.zarr"
    data = np.random.default_rng(2).random((8, 128, 128), dtype="f4")
    zarr.create_array(root, name="cube", shape=data.shape, chunks=(8, 16, 16), dtype="f4",
                      dimension_names=("freq", "dec", "ra"))[...] = data  # fmt: skip
    store = counting_store(root)
    geom = open_geometries(store, ["cube"], sample_axis=())["cube"]
    view = geom.patches({"dec": 16, "ra": 16}, origins="random", order="sweep")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    budget = schedule_floors(manifest, {"x": view}, PlanConfig(batch_size=8, block_chunks=4))
    assert budget.guaranteed < 0.7 * geom.chunk_nbytes  # a few regions' tiles, not the cube
    store.reset_counts()
    with insitu_pipeline(store, manifest, {"x": view}, batch_size=8, block_chunks=4,
                         cache_budget_bytes=budget.guaranteed) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            for row, (y0, x0) in zip(batch["x"], batch.patch_origins["x"], strict=True):
                np.testing.assert_array_equal(row, data[:, y0 : y0 + 16, x0 : x0 + 16])
    counts = store.chunk_counts()
    assert len(counts) == 64 and set(counts.values()) == {1}, counts  # 64 tiles, once each


def test_a_resumed_epoch_continues_bit_exactly(cube: Path) -> None:
    geom = open_geometries(cube, ["cube"], sample_axis=())["cube"]
    view = geom.patches({"dec": 8, "ra": 8}, origins="random")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))

    def build() -> Any:
        return insitu_pipeline(cube, manifest, {"x": view}, batch_size=4, block_chunks=2, seed=7)

    def records(batches: list[Any]) -> list[tuple]:
        return [(b.epoch, b.index, b.patch_origins["x"].tolist(), b["x"].tobytes())
                for b in batches]  # fmt: skip

    pipe = build()
    try:
        n = len(pipe)
        ref = records([next(it) for it in [epochs_of(Loader(pipe))] for _ in range(2 * n)])
    finally:
        pipe.close()
    assert n > 2 and ref[:n] != ref[n:]  # random windows: another epoch, other windows
    assert_resumes_exactly(build, records, ref, (1, n - 1, n + 1))


def test_two_ranks_deliver_disjoint_windows(cube: Path) -> None:
    geom = open_geometries(cube, ["cube"], sample_axis=())["cube"]
    view = geom.patches({"dec": 8, "ra": 8})
    per_rank = [
        _deliver(cube, {"x": view}, batch_size=3, block_chunks=1, rank=r, world_size=2)
        for r in range(2)
    ]
    a, b = (set(w) for w in per_rank)
    assert not a & b and len(a) == len(per_rank[0]) and len(b) == len(per_rank[1])
    assert len(a) == len(b) and 20 - len(a | b) <= 1  # 20 windows, one may sit out
