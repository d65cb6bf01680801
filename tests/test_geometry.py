"""open_geometries / ArrayGeometry against zarr as the oracle."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zarr
import zarr.storage
from zarr.core.buffer import cpu

from insitubatch_nodes import ArrayGeometry, open_geometries, open_store

DATA_ARRAYS = {"t2m", "z", "station_t2m"}


def _chunk_files(root: Path, array: str) -> set[str]:
    """Store keys (relative to the group root) of the chunk objects zarr wrote for ``array``."""
    folder = root / array
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    return {
        p.relative_to(root).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name not in meta
    }


def _all_keys(geom: ArrayGeometry) -> set[str]:
    return {geom.store_key(c, t) for c in range(geom.n_chunks) for t in geom.tiles()}


@pytest.mark.parametrize("fmt", [2, 3])
def test_geometry_of_a_data_array_matches_zarr(
    fmt: int, request: pytest.FixtureRequest, layout: SimpleNamespace
) -> None:
    root: Path = request.getfixturevalue(f"era5_v{fmt}_path")
    geoms = open_geometries(root)
    arrays = zarr.open_group(root, mode="r")
    for name in ("t2m", "z"):
        geom, arr = geoms[name], arrays[name]
        assert geom.path == name
        assert geom.shape == arr.shape
        assert geom.chunks == arr.chunks == geom.read_chunks
        assert geom.dtype == arr.dtype
        assert geom.fill_value == arr.fill_value
        assert geom.zarr_format == fmt
        assert geom.sample_axis == 0 and geom.offset == 0
        assert not geom.sharded
        assert geom.n_samples == layout.ERA5_TIME
        assert geom.n_chunks == arr.cdata_shape[0]
        assert geom.tile_grid == tuple(arr.cdata_shape[1:])
        assert geom.sample_nbytes == math.prod(arr.shape[1:]) * arr.dtype.itemsize
    assert geoms["t2m"].samples_per_chunk == layout.ERA5_T2M_CHUNKS[0]
    assert geoms["z"].samples_per_chunk == layout.ERA5_Z_CHUNKS[0]


@pytest.mark.parametrize("fmt", [2, 3])
def test_coordinates_and_grid_mappings_are_skipped_but_a_non_self_named_series_is_kept(
    fmt: int, request: pytest.FixtureRequest
) -> None:
    root: Path = request.getfixturevalue(f"era5_v{fmt}_path")
    assert set(open_geometries(root)) == DATA_ARRAYS


@pytest.mark.parametrize("fmt", [2, 3])
def test_naming_a_coordinate_returns_it(
    fmt: int, request: pytest.FixtureRequest, layout: SimpleNamespace
) -> None:
    root: Path = request.getfixturevalue(f"era5_v{fmt}_path")
    geoms = open_geometries(root, ["time", "t2m"])
    assert list(geoms) == ["time", "t2m"]
    assert geoms["time"].shape == (layout.ERA5_TIME,)
    assert geoms["time"].n_chunks == 1
    # a single name is accepted as a string too, with or without slashes
    assert list(open_geometries(root, "/lat")) == ["lat"]


@pytest.mark.parametrize("fmt", [2, 3])
def test_naming_a_zero_d_grid_mapping_raises_because_it_has_no_sample_axis(
    fmt: int, request: pytest.FixtureRequest
) -> None:
    # A 0-D array has no axis to draw samples along: naming it fails loudly with the reason
    # (it cannot be returned as a geometry, whatever the docstring's "whatever it is" says).
    root: Path = request.getfixturevalue(f"era5_v{fmt}_path")
    with pytest.raises(ValueError, match=r"sample_axis=0 is out of range for array 'crs'"):
        open_geometries(root, ["crs"])


def test_a_one_d_array_without_dimension_names_is_data(tmp_path: Path) -> None:
    group = zarr.open_group(tmp_path / "g.zarr", mode="w", zarr_format=3)
    group.create_array("series", shape=(5,), dtype="f4")
    group.create_array("named", shape=(5,), dtype="f4", dimension_names=["named"])
    assert set(open_geometries(tmp_path / "g.zarr")) == {"series"}


def test_arrays_in_nested_groups_are_found_by_their_path(layouts_path: Path) -> None:
    geoms = open_geometries(layouts_path)
    assert "nested/inner" in geoms
    assert geoms["nested/inner"].shape == (10, 2)
    assert open_geometries(layouts_path, ["nested/inner"])["nested/inner"].n_chunks == 2


def test_a_sharded_array_stores_one_object_per_shard(
    layouts_path: Path, layout: SimpleNamespace
) -> None:
    geom = open_geometries(layouts_path, ["sharded"])["sharded"]
    arr = zarr.open_array(layouts_path / "sharded", mode="r")
    assert arr.shards == layout.SHARDED_SHARDS
    assert geom.shape == layout.SHARDED_SHAPE
    assert geom.chunks == layout.SHARDED_SHARDS
    assert geom.read_chunks == layout.SHARDED_CHUNKS
    assert geom.sharded
    assert geom.samples_per_chunk == layout.SHARDED_SHARDS[0]
    assert geom.n_chunks == layout.SHARDED_SHAPE[0] // layout.SHARDED_SHARDS[0]
    assert geom.n_tiles == 1
    # one stored object per shard, and the geometry names exactly those objects
    assert _all_keys(geom) == _chunk_files(layouts_path, "sharded")
    assert geom.chunk_nbytes == math.prod(layout.SHARDED_SHARDS) * 4


def test_tile_grid_and_tile_slices_cover_the_field_of_an_inner_chunked_array(
    layouts_path: Path, layout: SimpleNamespace
) -> None:
    geom = open_geometries(layouts_path, ["tiled"])["tiled"]
    arr = zarr.open_array(layouts_path / "tiled", mode="r")
    assert geom.inner_shape == layout.TILED_SHAPE[1:]
    assert geom.tile_shape == layout.TILED_CHUNKS[1:]
    assert geom.tile_grid == tuple(arr.cdata_shape[1:]) == (3, 3)
    assert geom.n_tiles == 9
    tiles = list(geom.tiles())
    assert tiles == sorted(tiles) and len(tiles) == 9  # C order
    assert geom.tile_slices((0, 0)) == (slice(0, 4), slice(0, 3))
    assert geom.tile_slices((2, 2)) == (slice(8, 10), slice(6, 7))  # partial edge tiles
    # the tiles partition the field exactly once
    cover = np.zeros(geom.inner_shape, dtype=int)
    for tile in tiles:
        cover[geom.tile_slices(tile)] += 1
    assert (cover == 1).all()
    # each (chunk, tile) is one stored object holding exactly that rectangle's values
    data = arr[...]
    assert _all_keys(geom) == _chunk_files(layouts_path, "tiled")
    for chunk in range(geom.n_chunks):
        start, stop = geom.chunk_range(chunk)
        for tile in tiles:
            coords = geom.chunk_coords(chunk, tile)
            rect = (slice(start, stop), *geom.tile_slices(tile))
            selection = tuple(
                slice(c * n, min((c + 1) * n, s))
                for c, n, s in zip(coords, arr.chunks, arr.shape, strict=True)
            )
            assert selection == rect
            np.testing.assert_array_equal(arr[selection], data[rect])


def test_a_partial_final_chunk_is_counted_and_has_its_true_range(
    layouts_path: Path, layout: SimpleNamespace
) -> None:
    geom = open_geometries(layouts_path, ["partial"])["partial"]
    n, spc = layout.PARTIAL_SHAPE[0], layout.PARTIAL_CHUNKS[0]
    assert geom.n_chunks == math.ceil(n / spc)
    assert geom.chunk_range(0) == (0, spc)
    assert geom.chunk_range(geom.n_chunks - 1) == ((geom.n_chunks - 1) * spc, n)
    with pytest.raises(IndexError):
        geom.chunk_range(geom.n_chunks)
    with pytest.raises(IndexError):
        geom.chunk_range(-1)
    assert _all_keys(geom) == _chunk_files(layouts_path, "partial")


def test_an_unknown_name_raises_key_error_listing_the_available_arrays(
    era5_v3_path: Path,
) -> None:
    with pytest.raises(KeyError) as info:
        open_geometries(era5_v3_path, ["t2m", "precip"])
    message = str(info.value)
    assert "precip" in message
    for name in ("t2m", "z", "time", "crs", "station_t2m"):
        assert name in message


@pytest.mark.xdist_group("s3")
def test_an_array_whose_metadata_is_missing_raises_key_error_naming_the_store(
    era5_v3_path: Path, tmp_path: Path, s3_upload, s3_options
) -> None:
    """A 404 on ``t2m/zarr.json``, locally and over S3: the message names the store."""
    copy = tmp_path / "era5.zarr"
    shutil.copytree(era5_v3_path, copy)
    (copy / "t2m" / "zarr.json").unlink()
    url = s3_upload(copy, "no-t2m/era5.zarr")
    for store, name in ((copy, str(copy)), (open_store(url, **s3_options), url)):
        with pytest.raises(KeyError) as info:
            open_geometries(store, ["t2m"])
        message = str(info.value)
        assert f"in store {name}" in message, message
        assert "'t2m'" in message and "'z'" in message  # what was asked, and what exists


def test_a_sample_axis_mapping_naming_an_unknown_array_raises_key_error(
    era5_v3_path: Path,
) -> None:
    with pytest.raises(KeyError, match="precip"):
        open_geometries(era5_v3_path, ["t2m"], sample_axis={"precip": 1})


@pytest.mark.parametrize("axis", [3, 7, -4])
def test_a_sample_axis_out_of_range_raises_value_error(era5_v3_path: Path, axis: int) -> None:
    with pytest.raises(ValueError, match="sample_axis"):
        open_geometries(era5_v3_path, ["t2m"], sample_axis=axis)


def test_a_negative_sample_axis_counts_from_the_end(era5_v3_path: Path) -> None:
    geom = open_geometries(era5_v3_path, ["t2m"], sample_axis=-1)["t2m"]
    assert geom.sample_axis == 2


def test_sample_axis_two_on_the_microscopy_group_samples_z_planes(
    microscopy_path: Path, layout: SimpleNamespace
) -> None:
    geoms = open_geometries(microscopy_path, sample_axis=2)
    image, mask = geoms["image"], geoms["mask"]
    t, c, z, y, x = layout.MICRO_SHAPE
    assert image.sample_axis == mask.sample_axis == 2
    assert image.n_samples == mask.n_samples == z
    assert image.field_axes == (0, 1, 3, 4)
    assert image.inner_shape == (t, c, y, x)
    assert mask.inner_shape == (t, 1, y, x)
    assert image.samples_per_chunk == layout.MICRO_IMAGE_CHUNKS[2]
    assert mask.samples_per_chunk == layout.MICRO_MASK_CHUNKS[2]
    assert image.tile_grid == (t, 1, 1, 1)
    assert mask.tile_grid == (1, 1, 2, 2)
    assert image.sample_nbytes == t * c * y * x * 2
    # chunk coordinates put the chunk index on the Z axis
    assert mask.chunk_coords(3, (0, 0, 1, 0)) == (0, 0, 3, 1, 0)
    for geom in (image, mask):
        assert _all_keys(geom) == _chunk_files(microscopy_path, geom.path)


def test_a_sample_axis_mapping_sets_the_axis_per_array(microscopy_path: Path) -> None:
    geoms = open_geometries(microscopy_path, sample_axis={"image": 2})
    assert geoms["image"].sample_axis == 2
    assert geoms["mask"].sample_axis == 0


@pytest.mark.parametrize("fmt", [2, 3])
def test_store_keys_name_chunk_objects_that_exist_on_disk(
    fmt: int, request: pytest.FixtureRequest
) -> None:
    root: Path = request.getfixturevalue(f"era5_v{fmt}_path")
    for name, geom in open_geometries(root).items():
        keys = _all_keys(geom)
        assert keys == _chunk_files(root, name)
        for key in keys:
            assert (root / key).is_file()
    z = open_geometries(root, ["z"])["z"]
    expected = "z/1.2.1.0" if fmt == 2 else "z/c/1/2/1/0"
    assert z.store_key(1, (2, 1, 0)) == expected
    # the default tile is the first one
    assert z.store_key(1) == z.store_key(1, (0, 0, 0))


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("name", ["t2m", "z"])
def test_the_object_at_store_key_decodes_to_that_chunks_values(
    fmt: int, name: str, request: pytest.FixtureRequest
) -> None:
    """Decode the raw bytes at store_key(c, tile) on their own: they are chunk c's tile."""
    root: Path = request.getfixturevalue(f"era5_v{fmt}_path")
    geom = open_geometries(root, [name])[name]
    arr = zarr.open_array(root / name, mode="r")
    data = arr[...]
    # a one-chunk array with the same codecs decodes a single stored object
    objects: dict[str, object] = {}
    single = zarr.create_array(
        store=zarr.storage.MemoryStore(objects),
        shape=arr.chunks,
        chunks=arr.chunks,
        dtype=arr.dtype,
        fill_value=arr.fill_value,
        zarr_format=fmt,
        **(
            {"compressors": arr.compressors, "filters": arr.filters}
            if fmt == 2
            else {"compressors": arr.compressors, "serializer": arr.serializer}
        ),
    )
    only_key = geom.store_key(0).removeprefix(f"{name}/")  # "c/0/0/0" (v3) or "0.0.0" (v2)
    for chunk in range(geom.n_chunks):
        start, stop = geom.chunk_range(chunk)
        for tile in geom.tiles():
            raw = (root / geom.store_key(chunk, tile)).read_bytes()
            objects[only_key] = cpu.Buffer.from_bytes(raw)
            rect = (slice(start, stop), *geom.tile_slices(tile))
            np.testing.assert_array_equal(single[...], data[rect])


def test_a_geometry_built_without_metadata_has_no_store_key() -> None:
    geom = ArrayGeometry("x", shape=(10, 2), chunks=(5, 2), dtype=np.dtype("f4"), fill_value=0)
    with pytest.raises(ValueError, match="metadata"):
        geom.store_key(0)


def test_shift_adds_offsets_and_keeps_the_path_and_base(era5_v3_path: Path) -> None:
    geom = open_geometries(era5_v3_path, ["t2m"])["t2m"]
    one = geom.shift(1)
    assert one.offset == 1 and one.path == geom.path and one.shape == geom.shape
    assert one.shift(2).offset == 3
    assert one.shift(-3).offset == -2
    assert geom.shift(np.int64(4)).offset == 4
    assert one != geom
    assert one.base == geom
    assert one.shift(2).base == geom
    assert geom.base is geom
    assert geom.shift(0) == geom
    # a shifted view reads the same stored objects
    assert one.store_key(2) == geom.store_key(2)
    with pytest.raises(TypeError):
        geom.shift(1.5)  # type: ignore[arg-type]
    for flag in (True, np.bool_(True)):  # a flag is not a number of samples (was a shift of 1)
        with pytest.raises(TypeError, match="integer number of samples"):
            geom.shift(flag)


def test_a_geometry_is_frozen_and_hashable(era5_v3_path: Path) -> None:
    geom = open_geometries(era5_v3_path, ["t2m"])["t2m"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        geom.path = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        geom.offset = 3  # type: ignore[misc]
    assert {geom, geom.shift(1), geom.shift(1)} == {geom, geom.shift(1)}


def test_a_geometry_with_a_nan_fill_value_equals_itself_read_again_and_its_views_base(
    tmp_path: Path,
) -> None:
    # NaN != NaN: compared as a plain field (Python 3.13's dataclass __eq__ does, with no
    # identity shortcut) a NaN fill value made a view's base unequal to its own geometry
    group = zarr.open_group(tmp_path / "g.zarr", mode="w", zarr_format=2)
    group.create_array("a", shape=(8, 2), chunks=(4, 2), dtype="f4", fill_value=np.nan)
    geom = open_geometries(tmp_path / "g.zarr", ["a"])["a"]
    again = open_geometries(tmp_path / "g.zarr", ["a"])["a"]
    assert np.isnan(geom.fill_value)
    assert geom == again and hash(geom) == hash(again)
    assert geom.shift(2).base == geom and dataclasses.replace(geom, offset=0) == geom
    other = dataclasses.replace(geom, fill_value=0.0)
    assert other != geom and other.fill_value == 0.0


def test_invalid_geometries_are_refused() -> None:
    with pytest.raises(ValueError, match="do not match"):
        ArrayGeometry("x", shape=(10, 2), chunks=(5,), dtype=np.dtype("f4"), fill_value=0)
    with pytest.raises(ValueError, match="positive"):
        ArrayGeometry("x", shape=(10, 2), chunks=(0, 2), dtype=np.dtype("f4"), fill_value=0)
    with pytest.raises(ValueError, match="sample_axis"):
        ArrayGeometry(
            "x", shape=(10, 2), chunks=(5, 2), dtype=np.dtype("f4"), fill_value=0, sample_axis=2
        )


@pytest.mark.skipif(
    "rectilinear_chunks" not in zarr.config.get("array"),
    reason="this zarr has no rectilinear chunk grids (zarr >= 3.4 has)",
)
def test_an_array_with_a_rectilinear_chunk_grid_is_refused_with_a_value_error(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s.zarr"
    with zarr.config.set({"array.rectilinear_chunks": True}):
        group = zarr.open_group(root, mode="w", zarr_format=3)
        array = group.create_array("a", shape=(10, 4), chunks=[[2, 3, 5], [4]], dtype="f4")
        array[...] = 1.0
        with pytest.raises(ValueError, match=r"'a' has a chunk grid that is not regular"):
            open_geometries(root)
    with pytest.raises(ValueError, match=r"(?i)rectilinear"):  # zarr refuses to open it by default
        open_geometries(root)
