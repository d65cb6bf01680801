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


def _era5(
    root: Path, zarr_format: int = 3, time_chunk: int = 2, start: str = "2020-01-01T00"
) -> Path:
    """An ERA5-like store as xarray writes it: t2m and z packed int16 (float64 decoded), sst
    float32 with ``_FillValue = -9999`` (float32 decoded), a static land-sea mask packed uint8
    (float64), with time, level, lat and lon coordinates."""
    rng = np.random.default_rng(3)
    t2m = (273 + 5 * rng.standard_normal((6, 4, 5))).astype(np.float32)
    t2m[1, 0, 0] = t2m[4, 3, 4] = np.nan
    sst = (290 + rng.standard_normal((6, 4, 5))).astype(np.float32)
    sst[:, 0] = -9999.0
    z = (5000 + 50 * rng.standard_normal((6, 3, 4, 5))).astype(np.float32)
    z[3, 1, 2, 2] = np.nan
    lsm = rng.random((4, 5)).astype(np.float32)
    lsm[1, 1] = np.nan
    dims = ("time", "lat", "lon")
    ds = xr.Dataset(
        {"t2m": (dims, t2m), "sst": (dims, sst), "lsm": (dims[1:], lsm),
         "z": (("time", "level", "lat", "lon"), z)},
        coords={"time": np.datetime64(start) + np.arange(6) * np.timedelta64(6, "h"),
                "level": [500, 700, 850], "lat": np.linspace(60, 30, 4),
                "lon": np.linspace(0, 20, 5)},
    )  # fmt: skip
    packed = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}
    encoding = {
        "t2m": {**packed, "chunks": (time_chunk, 4, 5)},
        "z": {**packed, "scale_factor": 0.05, "add_offset": 5000.0,
              "chunks": (time_chunk, 1, 4, 5)},
        "sst": {"_FillValue": -9999.0, "chunks": (time_chunk, 4, 5)},
        "lsm": {"dtype": "uint8", "scale_factor": 1 / 250, "_FillValue": 255},
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


#: (dtype, CF attributes, zarr fill_value): how netCDF-converted data arrays arrive
ENCODINGS: list[tuple[str, dict[str, Any], Any]] = [
    ("int16", {"scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}, None),
    ("int16", {"scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}, -32767),
    ("int16", {"scale_factor": 0.01}, None),  # scale only: float64
    ("int16", {"add_offset": 273.0}, None),  # offset only: float64
    ("int16", {"scale_factor": 0.5, "add_offset": 1, "_FillValue": -1}, None),  # an int offset
    ("int16", {"scale_factor": [0.01], "add_offset": [273.0]}, None),  # attributes as lists
    ("int8", {"scale_factor": 0.1, "add_offset": 1.0, "_FillValue": -128}, None),
    ("uint8", {"scale_factor": 0.1, "add_offset": 1.0, "_FillValue": 255}, None),
    ("uint16", {"scale_factor": 0.5, "add_offset": 1.0}, None),
    ("int32", {"scale_factor": 0.001, "add_offset": 1.0, "missing_value": [-1, -2]}, None),
    (
        "int16",
        {"scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767, "missing_value": -32766},
        None,
    ),
    (
        "int16",
        {"scale_factor": 0.01, "add_offset": 273.0, "missing_value": [-32766, -32765]},
        None,
    ),
    ("float32", {"scale_factor": 0.5, "add_offset": 1.0, "_FillValue": -9999.0}, None),
    ("float32", {"_FillValue": -9999.0}, None),
    ("float64", {"_FillValue": -9999.0, "missing_value": 1e20}, None),
    ("float16", {"_FillValue": -1.0}, None),
    ("int16", {"_FillValue": -1}, None),  # masked integers: float32
    ("int16", {"missing_value": -1}, None),
    ("int32", {"missing_value": -1}, None),  # float64
    ("int64", {"missing_value": -1}, None),
    ("int8", {"_Unsigned": "true", "_FillValue": -1, "scale_factor": 0.5}, None),
    ("int8", {"_Unsigned": "true"}, None),
    ("bool", {}, None),
]


def _encoded_array(dtype: str, attrs: Mapping[str, Any], rng: np.random.Generator) -> np.ndarray:
    """Stored values of ``dtype`` holding each fill value of ``attrs`` twice."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random((6, 3, 4)) > 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        data = rng.integers(max(info.min, -30000), min(info.max, 30000) + 1, (6, 3, 4)).astype(dt)
    else:
        data = (10 * rng.standard_normal((6, 3, 4))).astype(dt)
    fills = [f for k in ("_FillValue", "missing_value") for f in np.ravel(attrs.get(k, []))]
    for i, f in enumerate(fills):
        data.flat[[3 + 7 * i, 40 + 5 * i]] = f
    return data


def _write_encodings(root: Path, zarr_format: int, spc: int) -> list[str]:
    """:data:`ENCODINGS` as arrays ``e0``, ``e1``, ... of one store (v3 float fills base64, as
    xarray writes them); each array's second object is deleted (it reads as the fill)."""
    rng = np.random.default_rng(0)
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    names = []
    for i, (dtype, attrs, fill) in enumerate(ENCODINGS):
        at = dict(attrs)
        kw: dict[str, Any] = {"dimension_names": ("time", "y", "x")}
        if zarr_format == 2:
            at["_ARRAY_DIMENSIONS"], kw = ["time", "y", "x"], {}
        elif "_FillValue" in at and np.dtype(dtype).kind == "f":
            at["_FillValue"] = _b64(at["_FillValue"])
        array = group.create_array(f"e{i}", shape=(6, 3, 4), chunks=(spc, 3, 4), dtype=dtype,
                                   fill_value=fill, attributes=at, **kw)  # fmt: skip
        array[...] = _encoded_array(dtype, attrs, rng)
        names.append(f"e{i}")
        key = f"e{i}/1.0.0" if zarr_format == 2 else f"e{i}/c/1/0/0"
        (root / key).unlink()
    return names


@pytest.mark.parametrize(
    ("zarr_format", "spc"), [(2, 1), (2, 3), (3, 1), (3, 3)], ids=["v2-1", "v2-3", "v3-1", "v3-3"]
)
def test_every_encoding_of_a_converted_archive_reads_as_xarray_decodes_it(
    tmp_path: Path, zarr_format: int, spc: int
) -> None:
    root = tmp_path / "e.zarr"
    names = _write_encodings(root, zarr_format, spc)
    g = open_geometries(root)
    assert _assert_batches_equal_xarray(root, {n: g[n] for n in names}) == 2 * 6


def _float32_oracle(array: Any) -> np.ndarray:
    """xarray's decoding of ``array``'s stored values with ``scale_factor`` / ``add_offset``
    given as float32 attributes (as netCDF files hold them), the zarr v2 fill value standing
    for ``_FillValue`` as xarray reads v2."""
    attrs = {k: v for k, v in array.attrs.items() if k != "_ARRAY_DIMENSIONS"}
    if array.metadata.zarr_format == 2 and array.fill_value is not None:
        attrs["_FillValue"] = array.fill_value
    if isinstance(attrs.get("_FillValue"), str):
        attrs["_FillValue"] = struct.unpack("<d", base64.standard_b64decode(attrs["_FillValue"]))[0]
    for k in ("scale_factor", "add_offset"):
        if isinstance(np.ravel(attrs.get(k, 0))[0], float):
            attrs[k] = np.float32(np.ravel(attrs[k])[0])
    var = xr.Variable(("t", "y", "x"), array[...], attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(xr.conventions.decode_cf_variable("v", var).values)


@pytest.mark.parametrize(("zarr_format", "spc"), [(2, 1), (3, 3)], ids=["v2-1", "v3-3"])
def test_every_encoding_reads_raw_as_zarr_and_in_float32_as_xarray_with_float32_attrs(
    tmp_path: Path, zarr_format: int, spc: int
) -> None:
    root = tmp_path / "e.zarr"
    names = _write_encodings(root, zarr_format, spc)
    group = zarr.open_group(root, mode="r")
    raw = open_geometries(root, mask_and_scale=False)
    f32 = open_geometries(root, cf_dtype="float32")
    for b in _read(root, {n: raw[n] for n in names})[0]:
        for n in names:
            want = group[n][...][b["rows"][n]]
            assert b[n].dtype == want.dtype, n
            np.testing.assert_array_equal(b[n], want, err_msg=n)
    exact = 0
    for b in _read(root, {n: f32[n] for n in names})[1]:
        for n in names:
            want = _float32_oracle(group[n])[b["rows"][n]]
            got = b[n]
            if want.dtype == np.float32 or want.dtype.kind not in "f":  # xarray's own float32
                assert got.dtype == want.dtype, (n, got.dtype, want.dtype)
                np.testing.assert_array_equal(got, want, err_msg=n)
                exact += 1
            else:  # a float64 result, delivered in float32: within one unit in the last place
                assert got.dtype == np.float32, n
                np.testing.assert_allclose(got, want, rtol=2**-23, err_msg=n)
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=n)
    assert exact >= 2 * 12


@pytest.mark.parametrize(("zarr_format", "time_chunk"), [(2, 1), (3, 4)], ids=["v2-1", "v3-4"])
def test_an_era5_archive_reads_as_xarray_through_windows_selections_norms_and_a_warm_cache(
    tmp_path: Path, zarr_format: int, time_chunk: int
) -> None:
    from insitubatch_nodes import stack, to_torch
    from insitubatch_nodes.statistics import fit_statistics

    root = _era5(tmp_path / "e.zarr", zarr_format, time_chunk)
    ds = _xarray(root)
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    stats = fit_statistics(root, manifest, {v: g[v] for v in ("t2m", "sst", "z", "lsm")})
    for v, axes in (("t2m", None), ("sst", None), ("z", (0, 2, 3)), ("lsm", None)):
        x = ds[v].values.astype(np.float64)
        np.testing.assert_array_equal(np.ravel(stats.nan_count[v]), np.isnan(x).sum(axes), v)
        np.testing.assert_allclose(np.ravel(stats.mean[v]), np.nanmean(x, axes), rtol=1e-12)
        np.testing.assert_allclose(np.ravel(stats.std[v]), np.nanstd(x, axes), rtol=1e-9)
    views = {
        "w": g["t2m"].window([-1, 0, 1]),
        "z700": g["z"].sel(level=700),
        "north": g["t2m"].sel(lat=slice(55, 35), lon=[5.0, 15.0]),
        "lsm": g["lsm"],
        "x": stack({"t2m": g["t2m"], "z": g["z"]}, normalize=stats),
    }
    wants = {
        "w": lambda r: ds["t2m"].values[r],  # (rows: (batch, 3) of a window)
        "z700": lambda r: ds["z"].sel(level=700).values[r],
        "north": lambda r: ds["t2m"].sel(lat=slice(55, 35), lon=[5.0, 15.0]).values[r],
        "lsm": lambda r: np.broadcast_to(ds["lsm"].values, (len(r), 4, 5)),
    }
    mean, std = (
        np.concatenate([np.ravel(s["t2m"]), np.ravel(s["z"])]) for s in (stats.mean, stats.std)
    )
    cache = {"cache_dir": tmp_path / "cache", "persist": True}
    epochs, gets = [], []
    for _ in ("cold", "warm"):
        pipe = insitu_pipeline(root, manifest, views, batch_size=2, shuffle=False, **cache)
        with pipe:
            epochs.append([(b, to_torch(b)) for b in pipe])
            gets.append(pipe.report().gets)
    assert gets[0] > 0 and gets[1] == 0, gets  # (the warm epoch is read from the cache)
    for (cold, _), (warm, tensors) in zip(*epochs, strict=True):
        rows = warm.sample_indices["x"]  # (a static label has none)
        assert np.array_equal(warm.sample_indices["w"][:, 1], rows)
        for label, want in wants.items():
            got, expected = (
                np.asarray(warm.arrays[label]),
                want(warm.sample_indices.get(label, rows)),
            )
            assert got.dtype == expected.dtype == tensors[label].numpy().dtype, label
            np.testing.assert_array_equal(got, expected, err_msg=label)
            np.testing.assert_array_equal(np.asarray(cold.arrays[label]), got, err_msg=label)
        channels = np.concatenate([ds["t2m"].values[rows][:, None], ds["z"].values[rows]], axis=1)
        want_x = (channels - mean[:, None, None]) / std[:, None, None]
        np.testing.assert_allclose(np.asarray(warm.arrays["x"]), want_x, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(np.isnan(warm.arrays["x"]), np.isnan(want_x))
    assert sum(len(b.sample_indices["x"]) for b, _ in epochs[1]) == 4


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_packed_field_in_every_stored_layout_reads_as_xarray_decodes_it(
    tmp_path: Path, zarr_format: int
) -> None:
    # big-endian, Fortran order, a Delta filter, no compressor, field tiles with edges, shards:
    # each decodes into the stored dtype first, then unpacks (an absent object: the fill)
    import numcodecs
    from zarr.codecs import BytesCodec

    root = tmp_path / "l.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    data = np.random.default_rng(4).integers(-300, 300, (7, 4, 5)).astype(np.int16)
    data[3, 1, 1] = data[6, 3, 4] = -32767
    layouts: dict[str, dict[str, Any]] = {
        "tiles": {"chunks": (3, 3, 3)},
        "one": {"chunks": (1, 4, 5), "compressors": None},
    }
    if zarr_format == 2:
        layouts |= {
            "big": {"chunks": (2, 4, 5), "dtype": ">i2"},
            "fortran": {"chunks": (2, 4, 5), "order": "F"},
            "delta": {"chunks": (2, 4, 5), "filters": [numcodecs.Delta(dtype="i2")]},
        }
        kw: dict[str, Any] = {}
        attrs = {"_ARRAY_DIMENSIONS": ["time", "y", "x"], "scale_factor": 0.01, "add_offset": 273.0}
    else:
        layouts |= {
            "big": {"chunks": (2, 4, 5), "serializer": BytesCodec(endian="big")},
            "shards": {"chunks": (1, 2, 5), "shards": (2, 4, 5)},
        }
        kw = {"dimension_names": ("time", "y", "x")}
        attrs = {"scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}
    for name, layout in layouts.items():
        layout = {"dtype": "int16", **layout}
        array = group.create_array(name, shape=data.shape, fill_value=-32767, attributes=attrs,
                                   **layout, **kw)  # fmt: skip
        array[...] = data
    for name in ("tiles", "one"):  # one stored object never written
        (root / name / ("1.0.0" if zarr_format == 2 else "c/1/0/0")).unlink()
    g = open_geometries(root)
    assert _assert_batches_equal_xarray(root, {n: g[n] for n in layouts}) == 2 * 7


def test_a_stack_of_collection_members_of_two_dtypes_points_at_the_collections_cf_dtype(
    tmp_path: Path,
) -> None:
    # a concatenation of monthly stores decodes its packed t2m to float64 and sst to float32;
    # the collection takes cf_dtype too, and then the stack equals xarray's values in float32
    from insitubatch_nodes import stack
    from insitubatch_nodes.io.collection import Collection

    stores = [_era5(tmp_path / f"{t}.zarr", start=t) for t in ("2020-01-01T00", "2020-01-02T12")]
    coll = Collection.concat(stores, ["t2m", "sst"])
    assert (coll["t2m"].dtype, coll["sst"].dtype) == (np.float64, np.float32)
    with pytest.raises(ValueError, match=r"cf_dtype='float32'.*the collection's"):
        stack({"t2m": coll["t2m"], "sst": coll["sst"]})
    coll32 = Collection.concat(stores, ["t2m", "sst"], cf_dtype="float32")
    x = stack({"t2m": coll32["t2m"], "sst": coll32["sst"]})
    whole = {v: np.concatenate([_xarray(s)[v].values for s in stores]) for v in ("t2m", "sst")}
    pipe = insitu_pipeline(coll32, split_by_chunk(coll32["t2m"], (1.0, 0.0, 0.0)), {"x": x},
                           batch_size=4, shuffle=False, coords=())  # fmt: skip
    rows = 0
    with pipe:
        for b in pipe:
            got, r = np.asarray(b.arrays["x"]), b.sample_indices["x"]
            assert got.dtype == np.float32
            np.testing.assert_allclose(got[:, 0], whole["t2m"][r].astype(np.float32), rtol=2**-23)
            np.testing.assert_array_equal(np.isnan(got[:, 0]), np.isnan(whole["t2m"][r]))
            np.testing.assert_array_equal(got[:, 1], whole["sst"][r])
            rows += len(r)
    assert rows == 12


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_lightning_data_module_opens_a_packed_store_in_the_cf_dtype_it_is_given(
    tmp_path: Path,
) -> None:
    # InSituDataModule opens the arrays itself (names, or a callable when the store is only
    # reachable at training time): a float32 model needs them in float32, not xarray's float64
    from insitubatch_nodes.lightning import InSituDataModule
    from insitubatch_nodes.plan.config import PlanConfig

    root = _era5(tmp_path / "e.zarr")
    ds, raw = _xarray(root), zarr.open_group(root, mode="r")

    def views(geoms: dict[str, Any]) -> dict[str, Any]:
        return {"x": geoms["t2m"], "y": geoms["t2m"].shift(1)}

    config = PlanConfig(batch_size=2, shuffle=False)
    for variables, kw, dtype in (
        (["t2m", "sst"], {"cf_dtype": "float32"}, np.float32),
        (views, {"cf_dtype": "float32"}, np.float32),
        (["t2m"], {"mask_and_scale": False}, np.int16),
    ):
        dm = InSituDataModule(root, variables, (1.0, 0.0, 0.0), config=config,
                              transform=lambda b: b, log_report=False, **kw)  # fmt: skip
        dm.setup("fit")
        try:
            batches = list(dm.train_dataloader())
        finally:
            dm.teardown("fit")
        assert batches
        for b in batches:
            for label, got in b.arrays.items():
                name = dm.views[label].path
                rows = b.sample_indices[label]
                assert got.dtype == dtype, (label, got.dtype)
                if dtype == np.int16:
                    np.testing.assert_array_equal(got, raw[name][...][rows])
                    continue
                want = ds[name].values[rows]
                np.testing.assert_allclose(got, want.astype(np.float32), rtol=2**-23)
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    g = open_geometries(root)
    with pytest.raises(ValueError, match="decoded where they were opened"):
        InSituDataModule(root, {"x": g["t2m"]}, cf_dtype="float32")
    with pytest.raises(ValueError, match="cf_dtype is a float dtype"):
        InSituDataModule(root, ["t2m"], cf_dtype="int16")


def test_a_stack_beside_a_float64_member_stored_so_is_not_sent_to_cf_dtype(tmp_path: Path) -> None:
    # cf_dtype changes CF-decoded arrays only: a plain float64 member stays float64
    from insitubatch_nodes import stack

    root = _era5(tmp_path / "e.zarr")
    group = zarr.open_group(root, mode="a")
    dims = ("time", "lat", "lon")
    plain = group.create_array("plain", shape=(6, 4, 5), chunks=(2, 4, 5), dtype="float64",
                               fill_value=np.nan, dimension_names=dims)  # fmt: skip
    plain[...] = 1.0
    g = open_geometries(root, cf_dtype="float32")
    with pytest.raises(ValueError, match="labels of their own") as info:
        stack({"t2m": g["t2m"], "plain": g["plain"]})
    assert "cf_dtype" not in str(info.value)


@pytest.mark.parametrize("scale", ["0.01", [0.01, 0.02], True], ids=["string", "two", "bool"])
def test_a_scale_factor_that_is_no_number_is_refused_when_the_array_is_opened(
    tmp_path: Path, scale: Any
) -> None:
    # (a string, as some converters write attributes, failed deep in the first batch with
    # "could not convert string to float: ''"; two numbers made the array 'variable-length
    # values, store fixed-width strings'; True made it bool): say so where it is read
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array("t2m", shape=(4, 3), chunks=(2, 3), dtype="int16",
                               dimension_names=("time", "x"),
                               attributes={"scale_factor": scale, "add_offset": 273.0})  # fmt: skip
    array[...] = 1
    with pytest.raises(ValueError, match=r"'t2m'.*scale_factor .* is not a number") as info:
        open_geometries(root)
    assert "mask_and_scale=False" in str(info.value)
    assert open_geometries(root, mask_and_scale=False)["t2m"].dtype == np.int16
