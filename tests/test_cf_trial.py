"""A user's trial of CF decoding: stores as netCDF-converted archives hold them, read through
``insitu_pipeline`` (iterated directly and through ``Loader``), against ``xr.open_zarr``.

Each case writes a zarr store (with zarr, or with xarray's ``to_zarr`` and a CF ``encoding``) and
compares every batch with xarray's decoded values: the dtype, the values and the NaNs.
"""

from __future__ import annotations

import base64
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

PACKED = {"scale_factor": 0.5, "add_offset": 100.0, "_FillValue": -32767}


def _xarray(root: Path) -> xr.Dataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_zarr(root, consolidated=False).load()


def _b64(value: float) -> str:
    """A float ``_FillValue`` as xarray writes it to a zarr v3 attribute."""
    return base64.standard_b64encode(struct.pack("<d", value)).decode()


def _read(root: Path, views: Mapping[str, Any], batch_size: int = 3) -> list[list[dict[str, Any]]]:
    """Every batch of ``views`` (in order), read by iterating the pipeline and by ``Loader``:
    ``[{label: array}, ..., {"rows": {label: sample indices}}]`` per way of reading."""
    first = next(iter(views.values()))
    manifest = split_by_chunk(first, (1.0, 0.0, 0.0))
    out = []
    for wrap in (lambda p: p, Loader):
        pipe = insitu_pipeline(root, manifest, dict(views), batch_size=batch_size, shuffle=False)
        try:
            out.append(
                [
                    {k: np.array(a) for k, a in b.arrays.items()} | {"rows": b.sample_indices}
                    for b in wrap(pipe)
                ]
            )
        finally:
            pipe.close()
    return out


def _assert_batches_equal_xarray(root: Path, views: Mapping[str, Any]) -> int:
    """Every batch of every label equals xarray's values at its rows; the rows read."""
    ds = _xarray(root)
    rows = 0
    for batches in _read(root, views):
        for b in batches:
            for label, view in views.items():
                want = ds[view.path].values[b["rows"][label]]
                got = b[label]
                assert got.dtype == want.dtype, (label, got.dtype, want.dtype)
                np.testing.assert_array_equal(got, want, err_msg=label)
            rows += len(b["rows"][label])
    return rows


@pytest.mark.parametrize("spc", [1, 4], ids=["1-sample-shards", "4-sample-shards"])
@pytest.mark.parametrize("zarr_fill", [0, -32767], ids=["zarr-fill-0", "zarr-fill-is-_FillValue"])
def test_an_absent_inner_chunk_of_a_packed_shard_reads_as_xarray_reads_it(
    tmp_path: Path, spc: int, zarr_fill: int
) -> None:
    # a sharded v3 array writes no inner chunk that holds only the fill value: zarr reads it
    # as fill_value, which decodes like any stored value (add_offset for 0, NaN for _FillValue)
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = (np.arange(8 * 4 * 6).reshape(8, 4, 6) - 50).astype(np.int16)
    data[2, :2] = zarr_fill  # the first inner chunk of sample 2: never written
    data[5, 3, 1] = -32767
    for name, attrs in (("packed", PACKED), ("masked", {"_FillValue": -32767})):
        array = group.create_array(name, shape=data.shape, chunks=(1, 2, 6), shards=(spc, 4, 6),
                                   dtype="int16", fill_value=zarr_fill, attributes=attrs,
                                   dimension_names=("time", "y", "x"),
                                   config={"write_empty_chunks": False})  # fmt: skip
        array[...] = data
    # (the inner chunk really is absent: its entry in the shard's index is 2**64 - 1, twice)
    stored = (root / "packed" / "c" / str(2 // spc) / "0" / "0").read_bytes()
    index = np.frombuffer(stored[-(16 * 2 * spc + 4) : -4], "<u8").reshape(spc, 2, 2)
    assert (index[2 % spc, 0] == 2**64 - 1).all() and (index[2 % spc, 1] != 2**64 - 1).all()
    g = open_geometries(root)
    assert _assert_batches_equal_xarray(root, {"p": g["packed"], "m": g["masked"]}) == 2 * 8
