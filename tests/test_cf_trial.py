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


def _read(
    root: Path, views: Mapping[str, Any], batch_size: int = 3, by: Any = None
) -> list[list[dict[str, Any]]]:
    """Every batch of ``views`` (in order, split by whole chunks of ``by``, else of the first
    view), read by iterating the pipeline and by ``Loader``: a list of
    ``{label: array, "rows": {label: sample indices}}`` per way of reading."""
    manifest = split_by_chunk(by or next(iter(views.values())), (1.0, 0.0, 0.0))
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


def _era5(root: Path, zarr_format: int = 3, time_chunk: int = 2) -> Path:
    """An ERA5-like store as xarray writes it: t2m packed int16 (float64 decoded), sst float32
    with ``_FillValue = -9999`` (float32 decoded)."""
    rng = np.random.default_rng(3)
    t2m = (273 + 5 * rng.standard_normal((6, 4, 5))).astype(np.float32)
    t2m[1, 0, 0] = np.nan
    sst = (290 + rng.standard_normal((6, 4, 5))).astype(np.float32)
    sst[:, 0] = -9999.0
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), t2m), "sst": (("time", "lat", "lon"), sst)})
    encoding = {
        "t2m": {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0,
                "_FillValue": -32767, "chunks": (time_chunk, 4, 5)},
        "sst": {"_FillValue": -9999.0, "chunks": (time_chunk, 4, 5)},
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=zarr_format, encoding=encoding, consolidated=False)
    return root


def test_views_of_one_array_opened_with_other_cf_options_are_refused_saying_how_to_agree(
    tmp_path: Path,
) -> None:
    # one open_geometries call per view is easy to write; the refusal must say what differs
    # and that the views come from one call
    root = _era5(tmp_path / "e.zarr")
    t2m = open_geometries(root)["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    for other, dtypes in (
        (open_geometries(root, cf_dtype="float32")["t2m"], "float64 and float32"),
        (open_geometries(root, mask_and_scale=False)["t2m"], "float64 and int16"),
    ):
        with pytest.raises(ValueError, match="disagree about its geometry") as info:
            insitu_pipeline(root, manifest, {"a": t2m, "b": other.shift(1)}, batch_size=2)
        message = str(info.value)
        assert f"dtype {dtypes}" in message and "one open_geometries call" in message, message


def test_a_stack_of_a_packed_and_a_float_member_is_refused_pointing_at_cf_dtype(
    tmp_path: Path,
) -> None:
    # xarray's rule decodes a packed int16 field to float64 and a filled float32 one to float32:
    # the refusal names cf_dtype, which gives them one dtype (and then the stack equals xarray's
    # values cast to float32, within one unit in the last place)
    from insitubatch_nodes import stack

    root = _era5(tmp_path / "e.zarr")
    g = open_geometries(root)
    with pytest.raises(ValueError, match=r"'sst' is float32.*cf_dtype='float32'"):
        stack({"t2m": g["t2m"], "sst": g["sst"]})
    g32 = open_geometries(root, cf_dtype="float32")
    ds = _xarray(root)
    x = stack({"t2m": g32["t2m"], "sst": g32["sst"]})
    for b in _read(root, {"x": x}, by=g32["t2m"])[1]:
        rows = b["rows"]["x"]
        assert b["x"].dtype == np.float32
        want = ds["t2m"].values[rows].astype(np.float32)
        np.testing.assert_allclose(b["x"][:, 0], want, rtol=2**-23)
        np.testing.assert_array_equal(np.isnan(b["x"][:, 0]), np.isnan(want))
        np.testing.assert_array_equal(b["x"][:, 1], ds["sst"].values[rows])
