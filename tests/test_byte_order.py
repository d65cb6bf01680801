"""Batches arrive in native byte order, whatever byte order zarr stored them in.

zarr v2 arrays may be stored big-endian (``">f4"``, ``">i2"``, ``">u4"``); zarr's own read returns
them so, and ``torch.from_numpy`` refuses them. The claims: every batch of such an array equals
zarr's read value for value, is native, and ``to_torch`` takes it (bool and complex too); the
geometry reports the native dtype and chunk transforms and the persistent cache see it; the
level-major gather and a slot a transform declared big-endian give native batches as well.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from insitubatch_nodes import (
    Batch,
    DecodedChunk,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    to_torch,
)
from insitubatch_nodes.stages.gather import take_rows

DTYPES = [">f4", ">f8", ">i2", ">i8", ">u4", ">u2", "|b1", ">c8", "<f4"]


def _data(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    return rng.integers(1, 120, shape).astype(dt)


def _write_v2(root: Path, data: np.ndarray, chunks: tuple[int, ...], **kwargs: Any) -> zarr.Array:
    group = zarr.open_group(root, mode="w", zarr_format=2)
    arr = group.create_array("a", shape=data.shape, chunks=chunks, dtype=data.dtype, **kwargs)
    arr[...] = data
    return zarr.open_array(root, path="a", mode="r")


def _epoch(root: Path, **kwargs: Any) -> list[tuple[Batch, dict[str, torch.Tensor]]]:
    geom = open_geometries(root, ["a"])["a"]
    views = {"x": geom, "next": geom.shift(1)}
    pipe = insitu_pipeline(
        root, split_by_chunk(geom, (1.0, 0.0, 0.0)), views, batch_size=5, seed=1, **kwargs
    )
    try:
        return [(b, to_torch(b)) for b in pipe]
    finally:
        pipe.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_big_endian_v2_array_trains_through_to_torch_equal_to_zarrs_read(
    tmp_path: Path, dtype: str
) -> None:
    want = _write_v2(tmp_path / "s.zarr", _data((31, 3, 4), dtype), (6, 3, 4), fill_value=0)
    assert want.dtype == np.dtype(dtype)  # zarr reads it in the stored byte order
    rows = 0
    for batch, tensors in _epoch(tmp_path / "s.zarr"):
        for label in ("x", "next"):
            idx = batch.sample_indices[label]
            expected = want.oindex[idx]
            got = batch[label]
            assert got.dtype.isnative and got.dtype == expected.dtype.newbyteorder("=")
            np.testing.assert_array_equal(got, expected)
            np.testing.assert_array_equal(tensors[label].numpy(), expected)
        rows += len(batch)
    assert rows == 30  # 31 samples, "next" reads one ahead


def test_the_geometry_reports_the_native_dtype_and_the_metadata_keeps_the_stored_one(
    tmp_path: Path,
) -> None:
    _write_v2(tmp_path / "s.zarr", _data((12, 4), ">i2"), (4, 4))
    geom = open_geometries(tmp_path / "s.zarr")["a"]
    assert geom.dtype == np.dtype("=i2") and geom.dtype.isnative
    assert np.dtype(geom.metadata.dtype.to_native_dtype()) == np.dtype(">i2")


def double(chunk: DecodedChunk) -> DecodedChunk:
    """A chunk transform that computes a new array (numpy results are native-endian)."""
    assert chunk.data.dtype.isnative, chunk.data.dtype
    return replace(chunk, data=chunk.data * 2)


def test_chunk_transforms_and_the_persistent_cache_see_the_native_dtype(tmp_path: Path) -> None:
    want = _write_v2(tmp_path / "s.zarr", _data((24, 3), ">f4"), (4, 3))
    cache_dir = tmp_path / "cache"
    for _ in range(2):  # the second run is served from the cache files the first wrote
        for batch, tensors in _epoch(
            tmp_path / "s.zarr", chunk_transforms=[double], cache_dir=cache_dir, persist=True
        ):
            expected = want.oindex[batch.sample_indices["x"]] * 2
            np.testing.assert_array_equal(tensors["x"].numpy(), expected)
    files = sorted(cache_dir.glob("*.npy"))
    assert files
    for file in files:
        assert np.load(file, mmap_mode="r").dtype == np.dtype("=f4")


def test_a_big_endian_array_stored_one_level_per_object_gathers_natively(tmp_path: Path) -> None:
    want = _write_v2(tmp_path / "s.zarr", _data((20, 3, 4, 5), ">f8"), (4, 1, 4, 5))
    assert open_geometries(tmp_path / "s.zarr")["a"].one_level_per_object
    for batch, tensors in _epoch(tmp_path / "s.zarr"):
        np.testing.assert_array_equal(tensors["x"].numpy(), want.oindex[batch.sample_indices["x"]])


@pytest.mark.parametrize("level_major", [False, True])
def test_take_rows_from_a_big_endian_slot_fills_a_native_batch(level_major: bool) -> None:
    values = _data((8, 3, 4, 5), ">f4")
    slot = np.ascontiguousarray(values.swapaxes(0, 1)).swapaxes(0, 1) if level_major else values
    rows = np.array([6, 1, 1, 3])
    out = np.empty((4, 3, 4, 5), dtype="=f4")
    take_rows(slot, rows, out)
    np.testing.assert_array_equal(out, values[rows])


def test_to_torch_converts_an_array_of_another_byte_order_and_names_a_dtype_torch_lacks() -> None:
    swapped = np.arange(6, dtype=">i4").reshape(2, 3)
    tensors = to_torch({"x": swapped})
    assert tensors["x"].dtype == torch.int32
    np.testing.assert_array_equal(tensors["x"].numpy(), swapped)
    with pytest.raises(TypeError, match=r"'time'.*datetime64.*view\(\"int64\"\)"):
        to_torch({"x": swapped, "time": np.array(["2020-01-01"], dtype="datetime64[ns]")})


def test_a_batch_transform_turns_complex_visibilities_into_real_channels(tmp_path: Path) -> None:
    want = _write_v2(tmp_path / "s.zarr", _data((12, 4), ">c8"), (4, 4))
    geom = open_geometries(tmp_path / "s.zarr")["a"]

    def real_channels(batch: Batch) -> Batch:  # as docs/transforms.md shows
        vis = batch.arrays["vis"]
        batch.arrays["vis"] = np.stack([np.abs(vis), np.angle(vis)], axis=-1)
        return batch

    pipe = insitu_pipeline(
        tmp_path / "s.zarr",
        split_by_chunk(geom, (1.0, 0.0, 0.0)),
        {"vis": geom},
        batch_size=4,
        batch_transforms=[real_channels],
    )
    try:
        for batch in pipe:
            tensor = to_torch(batch)["vis"]
            assert tensor.dtype == torch.float32 and tensor.shape[-1] == 2
            expected = want.oindex[batch.sample_indices["vis"]]
            np.testing.assert_allclose(tensor[..., 0].numpy(), np.abs(expected), rtol=1e-6)
    finally:
        pipe.close()
