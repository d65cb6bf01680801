"""Tests for insitubatch_nodes.synthetic: layout, metadata, content and determinism."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.storage import MemoryStore

from insitubatch_nodes.synthetic import (
    ERA5_ADVECTION_CELLS,
    ERA5_HOURS_PER_STEP,
    ERA5_VARIABLES,
    make_era5_like,
    make_microscopy_like,
)

SMALL_ERA5: dict[str, Any] = {"n_time": 24, "n_lat": 12, "n_lon": 32, "n_level": 3}
SMALL_MICRO: dict[str, Any] = {
    "shape": (2, 2, 12, 32, 32),
    "image_chunks": (1, 2, 1, 32, 32),
    "mask_chunks": (2, 1, 4, 16, 16),
}
# Reading back zarr v3 arrays that use numcodecs' LZ4 warns that it is outside the v3 spec.
LZ4_WARNING = "ignore:Numcodecs codecs are not in the Zarr version 3 specification"


def array(group: zarr.Group, name: str) -> zarr.Array:
    node = group[name]
    assert isinstance(node, zarr.Array), f"{name} is not an array"
    return node


def values(group: zarr.Group, name: str) -> np.ndarray:
    return np.asarray(array(group, name)[...])


def read_all(group: zarr.Group) -> dict[str, np.ndarray]:
    return {name: np.asarray(arr[...]) for name, arr in group.arrays()}


def dimension_names(arr: zarr.Array) -> tuple[str | None, ...]:
    if arr.metadata.zarr_format == 2:
        dims = arr.attrs["_ARRAY_DIMENSIONS"]
        assert isinstance(dims, list)
        return tuple(str(d) for d in dims)
    return tuple(arr.metadata.dimension_names or ())


def zonal_anomaly(field: np.ndarray) -> np.ndarray:
    return field - field.mean(axis=-1, keepdims=True)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


# ---------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------


def test_same_seed_writes_identical_arrays(tmp_path: Path) -> None:
    first = read_all(make_era5_like(tmp_path / "a.zarr", seed=3, **SMALL_ERA5))
    second = read_all(make_era5_like(tmp_path / "b.zarr", seed=3, **SMALL_ERA5))
    assert first.keys() == second.keys() == {"t2m", "z", "time", "lat", "lon", "level", "crs"}
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name

    first = read_all(make_microscopy_like(tmp_path / "ma.zarr", seed=3, **SMALL_MICRO))
    second = read_all(make_microscopy_like(tmp_path / "mb.zarr", seed=3, **SMALL_MICRO))
    for name in ("image", "mask"):
        assert first[name].tobytes() == second[name].tobytes(), name


def test_different_seeds_write_different_arrays(tmp_path: Path) -> None:
    a = read_all(make_era5_like(tmp_path / "a.zarr", seed=0, **SMALL_ERA5))
    b = read_all(make_era5_like(tmp_path / "b.zarr", seed=1, **SMALL_ERA5))
    assert not np.array_equal(a["t2m"], b["t2m"])
    assert not np.array_equal(a["z"], b["z"])
    np.testing.assert_array_equal(a["lat"], b["lat"])  # the grid does not depend on the seed

    ma = read_all(make_microscopy_like(tmp_path / "ma.zarr", seed=0, **SMALL_MICRO))
    mb = read_all(make_microscopy_like(tmp_path / "mb.zarr", seed=1, **SMALL_MICRO))
    assert not np.array_equal(ma["image"], mb["image"])
    assert not np.array_equal(ma["mask"], mb["mask"])


def test_values_do_not_depend_on_layout_format_or_compressor(tmp_path: Path) -> None:
    plain = read_all(make_era5_like(tmp_path / "plain.zarr", **SMALL_ERA5))
    other = read_all(
        make_era5_like(
            tmp_path / "sharded.zarr",
            samples_per_chunk=4,
            shard_samples=8,
            inner_chunks=(5, 8),
            compressor="blosc",
            **SMALL_ERA5,
        )
    )
    v2 = read_all(
        make_era5_like(tmp_path / "v2.zarr", zarr_format=2, samples_per_chunk=5, **SMALL_ERA5)
    )
    for name in ("t2m", "z"):
        np.testing.assert_array_equal(plain[name], other[name])
        np.testing.assert_array_equal(plain[name], v2[name])

    micro = read_all(make_microscopy_like(tmp_path / "m1.zarr", **SMALL_MICRO))
    rechunked = read_all(
        make_microscopy_like(
            tmp_path / "m2.zarr",
            shape=SMALL_MICRO["shape"],
            image_chunks=(2, 1, 5, 16, 32),
            mask_chunks=(1, 1, 3, 32, 32),
            zarr_format=2,
        )
    )
    for name in ("image", "mask"):
        np.testing.assert_array_equal(micro[name], rechunked[name])


# ---------------------------------------------------------------------------------------------
# layout and metadata
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_era5_arrays_have_requested_shapes_dtypes_chunks_and_dimensions(
    tmp_path: Path, zarr_format: int
) -> None:
    group = make_era5_like(
        tmp_path / "era5.zarr", samples_per_chunk=8, zarr_format=zarr_format, **SMALL_ERA5
    )
    t2m, z = array(group, "t2m"), array(group, "z")
    assert group.metadata.zarr_format == zarr_format
    assert (t2m.shape, t2m.dtype, t2m.chunks) == ((24, 12, 32), np.float32, (8, 12, 32))
    assert (z.shape, z.dtype, z.chunks) == ((24, 3, 12, 32), np.float32, (8, 1, 12, 32))
    assert t2m.shards is None and z.shards is None
    assert dimension_names(t2m) == ("time", "lat", "lon")
    assert dimension_names(z) == ("time", "level", "lat", "lon")
    assert t2m.attrs["units"] == "K" and "long_name" in t2m.attrs
    assert "units" in z.attrs and "long_name" in z.attrs
    for name in ("time", "lat", "lon", "level"):
        arr = array(group, name)
        assert arr.ndim == 1 and dimension_names(arr) == (name,)


def test_inner_chunks_tile_the_lat_lon_field(tmp_path: Path) -> None:
    group = make_era5_like(
        tmp_path / "tiled.zarr", samples_per_chunk=4, inner_chunks=(6, 16), **SMALL_ERA5
    )
    assert array(group, "t2m").chunks == (4, 6, 16)
    assert array(group, "z").chunks == (4, 1, 6, 16)


def test_sharded_store_uses_requested_shard_and_inner_chunk_shapes(tmp_path: Path) -> None:
    group = make_era5_like(
        tmp_path / "sharded.zarr",
        samples_per_chunk=4,
        shard_samples=12,
        inner_chunks=(6, 16),
        **SMALL_ERA5,
    )
    t2m, z = array(group, "t2m"), array(group, "z")
    assert (t2m.shards, t2m.chunks) == ((12, 12, 32), (4, 6, 16))
    assert (z.shards, z.chunks) == ((12, 3, 12, 32), (4, 1, 6, 16))
    assert np.isfinite(t2m[...]).all() and np.isfinite(z[...]).all()


def test_coordinate_arrays_are_cf_like(tmp_path: Path) -> None:
    group = make_era5_like(tmp_path / "era5.zarr", **SMALL_ERA5)
    time, lat, lon, level, crs = (array(group, n) for n in ("time", "lat", "lon", "level", "crs"))
    assert time.dtype == np.int64
    assert str(time.attrs["units"]).startswith("hours since 2000-01-01")
    assert "calendar" in time.attrs
    np.testing.assert_array_equal(values(group, "time"), np.arange(24) * ERA5_HOURS_PER_STEP)
    lat_values, lon_values = values(group, "lat"), values(group, "lon")
    assert lat.dtype == np.float32 and lon.dtype == np.float32
    assert lat_values[0] == -90.0 and lat_values[-1] == 90.0
    assert np.all(np.diff(lat_values) > 0)
    assert lon_values[0] == 0.0 and lon_values[-1] < 360.0
    np.testing.assert_allclose(np.diff(lon_values), 360.0 / 32)
    assert level.dtype == np.int32
    np.testing.assert_array_equal(values(group, "level"), [1000, 850, 500])
    assert crs.shape == () and crs.dtype == np.int32
    assert crs.attrs["grid_mapping_name"] == "latitude_longitude"


def test_only_requested_variables_are_written(tmp_path: Path) -> None:
    group = make_era5_like(tmp_path / "t2m.zarr", variables=["t2m"], **SMALL_ERA5)
    assert set(group.array_keys()) == {"t2m", "time", "lat", "lon", "crs"}
    group = make_era5_like(tmp_path / "z.zarr", variables=("z",), **SMALL_ERA5)
    assert set(group.array_keys()) == {"z", "time", "lat", "lon", "level", "crs"}
    assert set(ERA5_VARIABLES) == {"t2m", "z"}


@pytest.mark.filterwarnings(LZ4_WARNING)
@pytest.mark.parametrize("compressor", ["zstd", "blosc", "lz4", "gzip", "none"])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_every_compressor_writes_readable_arrays(
    tmp_path: Path, zarr_format: int, compressor: str
) -> None:
    kwargs: dict[str, Any] = {"zarr_format": zarr_format, "compressor": compressor}
    group = make_era5_like(tmp_path / "e.zarr", n_time=8, n_lat=4, n_lon=8, n_level=2, **kwargs)
    t2m = array(group, "t2m")
    assert len(t2m.compressors) == (0 if compressor == "none" else 1)
    assert np.isfinite(values(zarr.open_group(tmp_path / "e.zarr", mode="r"), "t2m")).all()
    micro = make_microscopy_like(
        tmp_path / "m.zarr",
        shape=(1, 1, 4, 8, 8),
        image_chunks=(1, 1, 2, 8, 8),
        mask_chunks=(1, 1, 4, 8, 8),
        **kwargs,
    )
    assert values(micro, "image").shape == (1, 1, 4, 8, 8)


def test_accepts_a_zarr_store_object(tmp_path: Path) -> None:
    store = MemoryStore()
    group = make_era5_like(store, **SMALL_ERA5)
    on_disk = make_era5_like(tmp_path / "era5.zarr", **SMALL_ERA5)
    np.testing.assert_array_equal(values(group, "t2m"), values(on_disk, "t2m"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_era5_like(store, **SMALL_ERA5)
    make_microscopy_like(MemoryStore(), **SMALL_MICRO)


# ---------------------------------------------------------------------------------------------
# content
# ---------------------------------------------------------------------------------------------


def test_t2m_pattern_advects_east_by_the_advection_step(tmp_path: Path) -> None:
    group = make_era5_like(tmp_path / "era5.zarr", **SMALL_ERA5)
    t2m = np.asarray(values(group, "t2m"), dtype=np.float64)
    anomaly = zonal_anomaly(t2m)
    for t in (0, 7, 22):
        advected = np.roll(anomaly[t], ERA5_ADVECTION_CELLS, axis=-1)
        rolled = correlation(advected, anomaly[t + 1])
        unrolled = correlation(anomaly[t], anomaly[t + 1])
        assert rolled > 0.97
        assert rolled > unrolled + 0.3
        # The residual after advection is just the small noise.
        residual = np.abs(np.roll(t2m[t], ERA5_ADVECTION_CELLS, axis=-1) - t2m[t + 1])
        assert residual.mean() < 0.5 * np.abs(t2m[t] - t2m[t + 1]).mean()


def test_t2m_is_warm_at_the_equator_and_cold_at_the_poles(tmp_path: Path) -> None:
    group = make_era5_like(tmp_path / "era5.zarr", n_time=8, n_lat=19, n_lon=32, variables=["t2m"])
    zonal_mean = np.asarray(values(group, "t2m")).mean(axis=(0, 2))
    assert 285.0 < zonal_mean[9] < 315.0
    assert 225.0 < zonal_mean[0] < 255.0 and 225.0 < zonal_mean[-1] < 255.0


def test_z_is_geopotential_like_and_finite(tmp_path: Path) -> None:
    group = make_era5_like(tmp_path / "era5.zarr", **SMALL_ERA5)
    z = np.asarray(values(group, "z"))
    assert np.isfinite(z).all()
    level_means = z.mean(axis=(0, 2, 3))
    assert np.all(np.diff(level_means) > 0)  # higher up (lower pressure) => larger geopotential
    anomaly = zonal_anomaly(z[:, 1].astype(np.float64))
    advected = np.roll(anomaly[4], ERA5_ADVECTION_CELLS, axis=-1)
    assert correlation(advected, anomaly[5]) > 0.9


def test_microscopy_arrays_have_requested_layout(tmp_path: Path) -> None:
    group = make_microscopy_like(tmp_path / "micro.zarr", **SMALL_MICRO)
    image, mask = array(group, "image"), array(group, "mask")
    assert (image.shape, image.dtype, image.chunks) == (
        (2, 2, 12, 32, 32),
        np.uint16,
        (1, 2, 1, 32, 32),
    )
    assert (mask.shape, mask.dtype, mask.chunks) == (
        (2, 1, 12, 32, 32),
        np.uint8,
        (2, 1, 4, 16, 16),
    )
    assert dimension_names(image) == dimension_names(mask) == ("t", "c", "z", "y", "x")

    v2 = make_microscopy_like(tmp_path / "micro2.zarr", zarr_format=2, **SMALL_MICRO)
    assert dimension_names(array(v2, "image")) == ("t", "c", "z", "y", "x")
    assert dimension_names(array(v2, "mask")) == ("t", "c", "z", "y", "x")


def test_microscopy_mask_labels_cover_bright_image_regions(tmp_path: Path) -> None:
    group = make_microscopy_like(tmp_path / "micro.zarr", **SMALL_MICRO)
    image = np.asarray(values(group, "image"), dtype=np.float64)
    mask = np.asarray(values(group, "mask"))
    labels = np.unique(mask)
    assert labels[0] == 0 and len(labels) >= 2
    np.testing.assert_array_equal(labels, np.arange(len(labels)))  # ids 1..k, no gaps
    assert 0.005 < (mask > 0).mean() < 0.6
    inside = np.broadcast_to(mask > 0, image.shape)
    brightest = image.max(axis=1)  # every blob is bright in at least one channel
    assert brightest[mask[:, 0] > 0].mean() > 3 * brightest[mask[:, 0] == 0].mean()
    assert image[inside].mean() > 2 * image[~inside].mean()
    # A fixed threshold on the brightest channel recovers the mask almost exactly.
    threshold = 0.5 * (brightest[mask[:, 0] > 0].min() + np.median(brightest[mask[:, 0] == 0]))
    agreement = ((brightest > threshold) == (mask[:, 0] > 0)).mean()
    assert agreement > 0.95


# ---------------------------------------------------------------------------------------------
# argument checking
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_time": 0}, "n_time"),
        ({"n_lat": -1}, "n_lat"),
        ({"n_lon": 2.5}, "n_lon"),
        ({"n_level": 0}, "n_level"),
        ({"samples_per_chunk": 0}, "samples_per_chunk"),
        ({"inner_chunks": (4,)}, "inner_chunks"),
        ({"inner_chunks": (4, 0)}, "inner_chunks"),
        ({"shard_samples": 8, "zarr_format": 2}, "zarr_format=3"),
        ({"samples_per_chunk": 4, "shard_samples": 6}, "multiple of samples_per_chunk"),
        ({"shard_samples": 0}, "shard_samples"),
        ({"zarr_format": 4}, "zarr_format"),
        ({"compressor": "brotli"}, "zstd"),
        ({"variables": ("t2m", "u10")}, "t2m, z"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_era5_arguments_raise_value_error(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_era5_like(tmp_path / "bad.zarr", **kwargs)
    assert not (tmp_path / "bad.zarr").exists()  # nothing written before validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": (2, 2, 4, 8)}, "shape"),
        ({"shape": (2, 0, 4, 8, 8)}, "shape"),
        ({"image_chunks": (1, 1, 0, 8, 8)}, "image_chunks"),
        ({"mask_chunks": (1, 1, 4, 8)}, "mask_chunks"),
        ({"zarr_format": 1}, "zarr_format"),
        ({"compressor": "snappy"}, "compressor"),
    ],
)
def test_invalid_microscopy_arguments_raise_value_error(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_microscopy_like(tmp_path / "bad.zarr", **kwargs)


def test_existing_folder_without_overwrite_raises_file_exists_error(tmp_path: Path) -> None:
    path = tmp_path / "era5.zarr"
    make_era5_like(path, seed=0, **SMALL_ERA5)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_era5_like(path, seed=1, **SMALL_ERA5)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_microscopy_like(str(path), **SMALL_MICRO)

    replaced = make_era5_like(path, seed=1, overwrite=True, **SMALL_ERA5)
    fresh = make_era5_like(tmp_path / "fresh.zarr", seed=1, **SMALL_ERA5)
    np.testing.assert_array_equal(values(replaced, "t2m"), values(fresh, "t2m"))


def test_existing_empty_folder_is_written_into(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    group = make_microscopy_like(path, **SMALL_MICRO)
    assert set(group.array_keys()) == {"image", "mask"}
