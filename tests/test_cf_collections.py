"""CF decoding options of collections: ``mask_and_scale`` and ``cf_dtype``, as
``open_geometries`` takes them, on every collection constructor and on ``open_plate``.

Ten yearly ERA5 stores packed as ``int16``, read as one ``concat`` stream, must arrive as
``xr.concat`` of ``xr.open_zarr(store, mask_and_scale=...)`` gives them: ``float64`` by
default, ``float32`` with ``cf_dtype="float32"`` (unpacked in float32, as xarray computes with
float32 attributes), the stored integers with ``mask_and_scale=False``. Every view a collection
makes (``coll[v]``, ``subset``, stacks of its views) decodes by the collection's options.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import (
    Collection,
    concat,
    insitu_pipeline,
    split_by_chunk,
    split_by_member,
    stack,
)
from insitubatch_nodes.cache.fingerprint import array_fingerprint
from insitubatch_nodes.errors import StaleCacheError
from insitubatch_nodes.io.collection import join

Y, X = 3, 4
PACKED = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}
OPTIONS = {"default": {}, "float32": {"cf_dtype": "float32"}, "raw": {"mask_and_scale": False}}
TIMES = np.arange("2020-01-01T00", "2020-01-05T12", np.timedelta64(6, "h"), "M8[ns]")  # 18


def _write(root: Path, zarr_format: int, times: np.ndarray, seed: int, **packing: Any) -> Path:
    """A packed ``int16`` store of ``p`` and ``q`` along ``time`` (3 steps a chunk), a NaN
    (stored as the ``_FillValue``) in ``p``."""
    rng = np.random.default_rng(seed)
    data = {v: (273 + 3 * rng.standard_normal((len(times), Y, X))).astype(np.float32)
            for v in ("p", "q")}  # fmt: skip
    data["p"][1, 0, 0] = np.nan
    ds = xr.Dataset({v: (("time", "y", "x"), a) for v, a in data.items()},
                    coords={"time": times})  # fmt: skip
    encoding = {v: {**PACKED, **packing, "chunks": (3, Y, X)} for v in data}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=zarr_format, encoding=encoding, consolidated=False)
    return root


def _stores(tmp_path: Path, zarr_format: int, **packing: Any) -> list[Path]:
    """Three stores continuing one another along time; the middle one lost a chunk of ``p``
    (it reads as zarr's fill value, decoded or raw as xarray reads it)."""
    stores = [
        _write(tmp_path / f"year{i}.zarr", zarr_format, TIMES[6 * i : 6 * i + 6], i, **packing)
        for i in range(3)
    ]
    key = ("p", "1.0.0") if zarr_format == 2 else ("p", "c", "1", "0", "0")
    stores[1].joinpath(*key).unlink()
    return stores


def _open(root: Path, group: str | None = None, **options: Any) -> xr.Dataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_zarr(root, group=group, consolidated=False, **options).load()


def _float32_decoded(raw: xr.DataArray) -> np.ndarray:
    """xarray's decoding of the stored values with ``float32`` packing attributes: its
    arithmetic is then float32 (``raw.astype(float32) * scale_factor + add_offset``)."""
    attrs = dict(raw.attrs)
    for name in ("scale_factor", "add_offset"):
        if name in attrs:
            attrs[name] = np.float32(attrs[name])
    var = xr.Variable(raw.dims, raw.values, attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = np.asarray(xr.conventions.decode_cf_variable("p", var).values)
    assert out.dtype == np.float32
    return out


def _xarray(roots: list[Path], option: str, v: str = "p", group: str | None = None) -> Any:
    """xarray's values of ``v`` in each of ``roots`` read with ``option``: one array per root."""
    if option == "float32":
        return [_float32_decoded(_open(r, group, mask_and_scale=False)[v]) for r in roots]
    mask_and_scale = option != "raw"
    return [_open(r, group, mask_and_scale=mask_and_scale)[v].values for r in roots]


def _rows(coll: Collection, views: dict[str, Any], manifest: Any = None, **kw: Any) -> list[Any]:
    """Every batch of a pipeline over ``coll``: ``(arrays, members, sample indices)``."""
    first = next(iter(views.values()))
    manifest = manifest or split_by_chunk(first, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(coll, manifest, views, batch_size=4, coords=(), **kw)
    try:
        return [
            ({k: np.array(a) for k, a in b.arrays.items()}, dict(b.members), b.sample_indices)
            for b in Loader(pipe)
        ]
    finally:
        pipe.close()


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_concatenation_of_packed_stores_delivers_what_xarray_concatenates_with_the_options(
    tmp_path: Path, zarr_format: int, option: str
) -> None:
    stores = _stores(tmp_path, zarr_format)
    want = np.concatenate(_xarray(stores, option))
    if option == "raw":  # the stored integers, as zarr reads them
        stored = [zarr.open_array(str(s / "p"), mode="r")[...] for s in stores]
        np.testing.assert_array_equal(want, np.concatenate(stored))
        assert want.dtype == np.int16 and (want == -32767).sum() >= 3
    else:  # (v2: the absent chunk is the _FillValue, NaN; v3: zarr's fill 0, add_offset)
        assert np.isnan(want).sum() == (3 + 36 if zarr_format == 2 else 3)
    coll = concat(stores, ["p"], **OPTIONS[option])
    assert coll["p"].dtype == want.dtype
    rows = 0
    for arrays, _, indices in _rows(coll, {"p": coll["p"]}):
        got = arrays["p"]
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want[indices["p"]])
        rows += len(got)
    assert rows == len(TIMES)
    if option == "float32":  # within a unit in the last place of xarray's float64, cast
        default = np.concatenate(_xarray(stores, "default"))
        np.testing.assert_allclose(want, default.astype(np.float32), rtol=2**-23)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_members_packed_otherwise_are_read_raw_but_refused_decoded(
    tmp_path: Path, zarr_format: int
) -> None:
    # monthly netCDF files each packed with their own add_offset: their stored integers mean
    # different things, but a user who asks for them gets each member's own, as xarray does
    times = [TIMES[:6], TIMES[6:12]]
    stores = [
        _write(tmp_path / f"m{i}.zarr", zarr_format, t, i, add_offset=270.0 + 5 * i)
        for i, t in enumerate(times)
    ]
    for options in ({}, {"cf_dtype": "float32"}):
        with pytest.raises(ValueError, match="add_offset"):
            concat(stores, ["p"], **options)
    coll = concat(stores, ["p"], mask_and_scale=False)
    want = np.concatenate(_xarray(stores, "raw"))
    seen = set()
    for arrays, members, indices in _rows(coll, {"p": coll["p"]}):
        np.testing.assert_array_equal(arrays["p"], want[indices["p"]])
        seen |= set(members["p"].tolist())
    assert seen == {0, 1}


def _groups(root: Path, zarr_format: int) -> Path:
    """Two members, groups ``a`` and ``b`` of one store, of 6 and 9 samples."""
    for i, (g, n) in enumerate((("a", 6), ("b", 9))):
        rng = np.random.default_rng(i)
        data = {v: (273 + 3 * rng.standard_normal((n, Y, X))).astype(np.float32)
                for v in ("p", "q")}  # fmt: skip
        data["q"][2, 1, 1] = np.nan
        ds = xr.Dataset({v: (("time", "y", "x"), a) for v, a in data.items()})
        encoding = {v: {**PACKED, "chunks": (3, Y, X)} for v in data}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.to_zarr(root, group=g, zarr_format=zarr_format, encoding=encoding,
                       consolidated=False)  # fmt: skip
    return root


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("option", ["float32", "raw"])
def test_from_groups_views_subsets_and_stacks_decode_by_the_collections_options(
    tmp_path: Path, zarr_format: int, option: str
) -> None:
    root = _groups(tmp_path / "g.zarr", zarr_format)
    want = {v: [_xarray([root], option, v, g)[0] for g in ("a", "b")] for v in ("p", "q")}
    coll = Collection.from_groups(root, ["a", "b"], {"p": "p", "q": "q"}, **OPTIONS[option])
    dtype = want["p"][0].dtype
    assert {coll["p"].dtype, coll["q"].dtype} == {dtype}
    assert (coll.mask_and_scale, coll.cf_dtype) == (
        option != "raw", np.dtype(np.float32) if option == "float32" else None
    )  # fmt: skip
    part = coll.subset(["b"])  # a subset decodes as its collection
    assert (part["p"].dtype, part["p"].cf) == (dtype, coll["p"].cf)
    views = {"p": coll["p"], "x": stack({"p": coll["p"], "q": coll["q"]}, layout="channels_first")}
    rows = 0
    for arrays, members, indices in _rows(coll, views, split_by_member(coll, {"train": 1.0})):
        for r, (m, i) in enumerate(zip(members["p"], indices["p"], strict=True)):
            assert arrays["p"].dtype == arrays["x"].dtype == dtype
            np.testing.assert_array_equal(arrays["p"][r], want["p"][m][i])
            np.testing.assert_array_equal(arrays["x"][r, 0], want["p"][m][i])
            np.testing.assert_array_equal(arrays["x"][r, 1], want["q"][m][i])
        rows += len(members["p"])
    assert rows == 15


def test_from_arrays_and_join_take_the_options_and_a_join_refuses_a_concatenation_made_otherwise(
    tmp_path: Path,
) -> None:
    stores = _stores(tmp_path, 3)
    coll = Collection.from_arrays([(s, "q") for s in stores], cf_dtype="float32")
    assert coll["data"].dtype == np.float32
    raw = Collection.from_arrays([(s, "q") for s in stores], mask_and_scale=False)
    assert raw["data"].dtype == np.int16 and raw["data"].cf is None
    forcing = _write(tmp_path / "forcing.zarr", 3, TIMES, 9)
    joined = join({"atmos": (stores[0], ["p"]), "forcing": (forcing, ["q"])}, cf_dtype="float32")
    assert {joined[v].dtype for v in joined.variables} == {np.dtype(np.float32)}
    want = _float32_decoded(_open(forcing, mask_and_scale=False)["q"])
    for arrays, _, indices in _rows(joined, {"q": joined["forcing/q"]}):
        np.testing.assert_array_equal(arrays["q"], want[indices["q"]])
    archive = concat(stores, ["p"], cf_dtype="float32")
    by_time = join({"atmos": (archive, ["p"]), "forcing": (forcing, ["q"])}, cf_dtype="float32")
    assert by_time["atmos/p"].dtype == np.float32
    with pytest.raises(ValueError, match=r"cf_dtype=float32.*join"):
        join({"atmos": (archive, ["p"]), "forcing": (forcing, ["q"])})


def test_bad_options_are_refused_by_every_constructor_saying_what_to_pass(tmp_path: Path) -> None:
    stores = _stores(tmp_path, 3)
    makers = {
        "concat": lambda **o: concat(stores, ["p"], **o),
        "Collection.concat": lambda **o: Collection.concat(stores, ["p"], **o),
        "from_groups": lambda **o: Collection.from_groups(
            None, [(s, "") for s in stores], {"p": "p"}, names=["a", "b", "c"], **o
        ),
        "from_arrays": lambda **o: Collection.from_arrays([(s, "p") for s in stores], **o),
        "join": lambda **o: join({"a": (stores[0], ["p"]), "b": (stores[0], ["q"])}, **o),
    }
    for name, make in makers.items():
        with pytest.raises(ValueError, match="float dtype such as 'float32'"):
            make(cf_dtype="int16")
        with pytest.raises(TypeError, match="float dtype"):
            make(cf_dtype=object())
        with pytest.raises(TypeError, match="mask_and_scale is True or False"):
            make(mask_and_scale="no")
        with pytest.raises(ValueError, match="decodes nothing: drop one of them"):
            make(mask_and_scale=False, cf_dtype="float32")
        assert make(cf_dtype=">f4").cf_dtype == np.dtype("float32"), name  # native order


def test_a_persistent_cache_keeps_decoded_raw_and_float32_chunks_of_a_concatenation_apart(
    tmp_path: Path,
) -> None:
    stores = _stores(tmp_path, 3)
    cache = {"cache_dir": tmp_path / "cache", "persist": True}
    views = {}
    for k, (option, options) in enumerate(OPTIONS.items()):
        coll = concat(stores, ["p"], **options)
        views[option] = view = coll["p"]
        want = np.concatenate(_xarray(stores, option))
        if k:  # the chunks cached by the last run are another decoding's: never served
            with pytest.raises(
                StaleCacheError, match=r"another geometry, decoding \(mask_and_scale, cf_dtype\)"
            ):
                _rows(coll, {"p": view}, **cache)
        # rebuilt, then served from the cache alone: this decoding's values each time
        for run in ({"reset_stale_cache": True}, {"readonly_cache": True}):
            for arrays, _, indices in _rows(coll, {"p": view}, **cache, **run):
                np.testing.assert_array_equal(arrays["p"], want[indices["p"]])
    assert len({array_fingerprint(v, v, ()) for v in views.values()}) == 3


def test_the_pipeline_refuses_raw_views_beside_decoded_ones_of_one_collection(
    tmp_path: Path,
) -> None:
    stores = _stores(tmp_path, 2)
    decoded, raw = concat(stores, ["p"]), concat(stores, ["p"], mask_and_scale=False)
    manifest = split_by_chunk(decoded["p"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="disagree about its geometry"):
        insitu_pipeline(decoded, manifest, {"a": decoded["p"], "b": raw["p"]}, batch_size=4)
    # raw views read through the decoded collection are read raw: the views say how
    want = np.concatenate(_xarray(stores, "raw"))
    for arrays, _, indices in _rows(decoded, {"p": raw["p"]}, manifest):
        np.testing.assert_array_equal(arrays["p"], want[indices["p"]])


@pytest.mark.parametrize("ngff_version", ["0.4", "0.5"])
def test_open_plate_delivers_a_packed_plates_fields_as_its_options_say(
    tmp_path: Path, ngff_version: str
) -> None:
    pytest.importorskip("ome_zarr")
    from insitubatch_nodes.io.ngff import open_plate
    from insitubatch_nodes.synthetic import make_hcs_plate

    root = tmp_path / "plate.zarr"
    make_hcs_plate(root, rows=1, columns=2, fields=1, shape=(1, 1, 4, 16, 16), levels=1,
                   labels=(), ngff_version=ngff_version)  # fmt: skip
    packing = {"scale_factor": 0.5, "add_offset": 10.0}
    stored = {}
    for field in ("A/1/0", "A/2/0"):  # uint16 images, packed as a converted plate would be
        arr = zarr.open_array(str(root / field / "s0"), mode="r+")
        arr.attrs.update(packing)
        stored[field] = arr[...]
    xr_attrs = {"default": packing, "float32": {k: np.float32(v) for k, v in packing.items()}}
    for option, options in OPTIONS.items():
        want = {}
        for field, raw in stored.items():
            var = xr.Variable(("t", "c", "z", "y", "x"), raw, xr_attrs.get(option, {}))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                values = np.asarray(xr.conventions.decode_cf_variable("image", var).values)
            want[field] = np.moveaxis(values, 2, 0)  # one z plane a sample
        dtype = {"default": np.float64, "float32": np.float32, "raw": np.uint16}[option]
        coll = open_plate(root, **options)
        assert coll["image"].dtype == dtype and want["A/1/0"].dtype == dtype
        rows = 0
        for arrays, members, indices in _rows(coll, {"x": coll["image"]}):
            for r, (m, i) in enumerate(zip(members["x"], indices["x"], strict=True)):
                np.testing.assert_array_equal(arrays["x"][r], want[coll.members[m]][i])
            rows += len(members["x"])
        assert rows == 8
    with pytest.raises(ValueError, match="decodes nothing"):
        open_plate(root, mask_and_scale=False, cf_dtype="float32")


def test_the_pipeline_refuses_views_decoded_by_a_rule_the_first_member_no_longer_has(
    tmp_path: Path,
) -> None:
    # the collection read the packing when it was made; a store repacked since would be
    # decoded by the old rule: the pipeline's store check compares the decodings
    stores = _stores(tmp_path, 3)
    decoded, f32 = concat(stores, ["p"]), concat(stores, ["p"], cf_dtype="float32")
    raw = concat(stores, ["p"], mask_and_scale=False)
    zarr.open_array(str(stores[0] / "p"), mode="r+").attrs["scale_factor"] = 0.02
    for coll in (decoded, f32):
        with pytest.raises(ValueError, match=r"scale_factor.*make the collection again"):
            insitu_pipeline(coll, split_by_chunk(coll["p"], (1.0, 0.0, 0.0)), ["p"], batch_size=4)
    want = np.concatenate(_xarray(stores, "raw"))  # the stored integers: no rule to compare
    for arrays, _, indices in _rows(raw, {"p": raw["p"]}):
        np.testing.assert_array_equal(arrays["p"], want[indices["p"]])


def test_a_refusal_of_members_filled_otherwise_shows_the_fill_values_not_their_base64(
    tmp_path: Path,
) -> None:
    # xarray writes a float _FillValue to a v3 store as base64 of a little-endian double
    stores = []
    for i, fill in enumerate([-9999.0, np.nan]):
        times = pd.date_range("2020-01-01", periods=4, freq="6h") + pd.Timedelta(days=i)
        ds = xr.Dataset({"p": (("time", "x"), np.ones((4, 2), "f4"))}, coords={"time": times})
        ds.to_zarr(tmp_path / f"f{i}.zarr", zarr_format=3, encoding={"p": {"_FillValue": fill}})
        stores.append(tmp_path / f"f{i}.zarr")
    with pytest.raises(ValueError, match=r"its _FillValue 'nan' differs from .*'s -9999\.0;") as e:
        concat(stores, ["p"])
    assert "AAAA" not in str(e.value)
    # the same fill written in two spellings (base64 and "NaN") is one encoding
    nan_spelled = zarr.open_array(stores[1] / "p", mode="r+")
    nan_spelled.attrs["_FillValue"] = "NaN"
    again = tmp_path / "again.zarr"
    times = pd.date_range("2020-01-03", periods=4, freq="6h")
    ds = xr.Dataset({"p": (("time", "x"), np.ones((4, 2), "f4"))}, coords={"time": times})
    ds.to_zarr(again, zarr_format=3, encoding={"p": {"_FillValue": np.nan}})
    assert len(concat([stores[1], again], ["p"])) == 2
