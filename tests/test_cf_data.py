"""CF-encoded data arrays: batches equal xarray's decoded values (``xr.open_zarr``, defaults).

A store written by xarray from a netCDF-like dataset keeps its encoding: ``int16`` packed with
``scale_factor`` / ``add_offset`` and a ``_FillValue``, float fields with ``_FillValue = -9999``
or ``missing_value``. xarray decodes them on read (mask and scale); so must every batch, with
xarray's dtype, NaN where masked, and the decoded fill value where a stored object is absent.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.statistics import Statistics, fit_statistics

T, L, Y, X = 12, 3, 3, 4

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("cf_data")

PACKED = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}


def _write(root: Path, zarr_format: int, time_chunk: int) -> Path:
    """A dataset as a netCDF-converted ERA5 field arrives: packed, filled, missing-valued."""
    rng = np.random.default_rng(7)
    p = (273 + 3 * rng.standard_normal((T, Y, X))).astype(np.float32)
    p[1, 0, 0] = p[4, 2, 3] = np.nan
    q = (280 + rng.standard_normal((T, Y, X))).astype(np.float32)
    q[3, 1, 1] = np.nan
    f = rng.standard_normal((T, Y, X)).astype(np.float32)
    f[2, 1, 2] = f[7, 0, 0] = -9999.0
    m = rng.standard_normal((T, Y, X)).astype(np.float32)
    m[5, 2, 1] = -9999.0
    z = (5000 + 50 * rng.standard_normal((T, L, Y, X))).astype(np.float32)
    z[6, 1, 0, 0] = np.nan
    lsm = rng.random((Y, X)).astype(np.float32)
    lsm[0, 1] = np.nan
    ds = xr.Dataset(
        {
            "p": (("time", "y", "x"), p),
            "q": (("time", "y", "x"), q),
            "f": (("time", "y", "x"), f),
            "m": (("time", "y", "x"), m, {"missing_value": np.float32(-9999.0)}),
            "lsm": (("y", "x"), lsm),
            "z": (("time", "level", "y", "x"), z),
        },
        coords={"time": np.arange(T)},
    )
    encoding: dict[str, Any] = {
        "p": dict(PACKED),
        "q": dict(PACKED),
        "f": {"_FillValue": -9999.0},
        "m": {},
        # one level per object (a level-major slot)
        "z": {
            **PACKED,
            "scale_factor": 0.05,
            "add_offset": 5000.0,
            "chunks": (time_chunk, 1, Y, X),
        },
        "lsm": {"dtype": "int16", "scale_factor": 0.001, "add_offset": 0.0, "_FillValue": -1},
    }
    for v in ("p", "q", "f", "m"):
        encoding[v]["chunks"] = (time_chunk, Y, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=zarr_format, encoding=encoding, consolidated=False)
    # the second chunk of p and of f never written: it reads as the fill value (decoded)
    for v in ("p", "f"):
        key = root / v / "1.0.0" if zarr_format == 2 else root / v / "c" / "1" / "0" / "0"
        key.unlink()
    return root


def _xarray(root: Path) -> xr.Dataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_zarr(root, consolidated=False).load()


def _batches(root: Path, views: dict[str, Any], batch_size: int = 5, **kw: Any) -> list[Any]:
    manifest = split_by_chunk(open_geometries(root)["p"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, views, batch_size=batch_size, **kw)
    try:
        return [
            {"arrays": {k: np.array(a) for k, a in b.arrays.items()}, "rows": b.sample_indices}
            for b in Loader(pipe)
        ]
    finally:
        pipe.close()


@pytest.fixture(
    scope="module", params=[(2, 1), (2, 3), (3, 1), (3, 3)], ids=lambda p: f"v{p[0]}-spc{p[1]}"
)
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each layout written once for the module (its tests only read it): written for each of
    the 40 tests, the file took 8.7 CPU-s in a process of its own, 6.0 now (2026-12-07)."""
    fmt, spc = request.param
    return _write(tmp_path_factory.mktemp("cf") / "s.zarr", fmt, spc)


def test_batches_of_packed_filled_and_missing_valued_fields_equal_xarrays_decoded_values(
    store: Path,
) -> None:
    ds = _xarray(store)
    g = open_geometries(store)
    for v in ("p", "f", "m"):
        assert g[v].dtype == ds[v].dtype, (v, g[v].dtype, ds[v].dtype)
    views = {v: g[v] for v in ("p", "f", "m", "z")} | {
        "p_next": g["p"].shift(1),
        "p_rows": g["p"].isel(y=[2, 0]),  # a selection of an axis whole in the stored object
        "z_levels": g["z"].isel(level=[2, 0]),  # of an axis cut into stored objects
    }
    picks = {"p_rows": (slice(None), [2, 0]), "z_levels": (slice(None), [2, 0])}
    seen = 0
    for b in _batches(store, views):
        for label in views:
            v = label.split("_")[0]
            want = ds[v].values[b["rows"][label]][picks.get(label, ())]
            got = b["arrays"][label]
            assert got.dtype == want.dtype, (label, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=label)
        seen += len(b["rows"]["p"])
    assert seen == T - 1
    # the packed fills, the float fills, the missing values and the absent chunk: all NaN
    assert np.isnan(ds["f"].values).sum() >= 2 and np.isnan(ds["m"].values).sum() == 1


def test_a_stack_of_packed_members_with_a_packed_static_field_equals_xarrays_channels(
    store: Path,
) -> None:
    ds = _xarray(store)
    g = open_geometries(store)
    assert g["lsm"].static and g["lsm"].dtype == ds["lsm"].dtype
    x = stack({"p": g["p"], "q": g["q"], "lsm": g["lsm"]}, layout="channels_first")
    batches = _batches(store, {"x": x, "lsm": g["lsm"]})
    for b in batches:
        rows = b["rows"]["x"]
        got = b["arrays"]["x"]
        assert got.dtype == ds["p"].dtype
        np.testing.assert_array_equal(got[:, 0], ds["p"].values[rows])
        np.testing.assert_array_equal(got[:, 1], ds["q"].values[rows])
        lsm = np.broadcast_to(ds["lsm"].values, (len(rows), Y, X))
        np.testing.assert_array_equal(got[:, 2], lsm)  # (float32 into the float64 stack)
        assert b["arrays"]["lsm"].dtype == ds["lsm"].dtype
        np.testing.assert_array_equal(b["arrays"]["lsm"], lsm)
    assert np.isnan(ds["lsm"].values).sum() == 1


def test_patches_of_a_packed_field_are_xarrays_windows_at_the_rows_origins(store: Path) -> None:
    ds = _xarray(store)
    view = open_geometries(store)["p"].patches({"y": 2, "x": 3}, stride=1)
    manifest = split_by_chunk(view, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, {"w": view}, batch_size=4)
    rows = 0
    try:
        for b in Loader(pipe):
            for i, (t, (y0, x0)) in enumerate(
                zip(b.sample_indices["w"], b.patch_origins["w"], strict=True)
            ):
                want = ds["p"].values[t, y0 : y0 + 2, x0 : x0 + 3]
                np.testing.assert_array_equal(b.arrays["w"][i], want)
                rows += 1
    finally:
        pipe.close()
    assert rows == T * 2 * 2


def test_fit_statistics_counts_fill_values_and_missing_values_as_nans_as_xarray_reads_them(
    store: Path,
) -> None:
    ds = _xarray(store)
    g = open_geometries(store)
    manifest = split_by_chunk(g["p"], (0.5, 0.25, 0.25), contiguous=False, seed=2)
    views = {v: g[v] for v in ("p", "f", "m")} | {"lsm": g["lsm"]}
    stats = fit_statistics(store, manifest, views, split="train", batch_size=4)
    samples = manifest.samples("train")
    for label in ("p", "f", "m", "lsm"):
        x = ds[label].values.astype(np.float64)
        x = x if label == "lsm" else x[samples]
        assert int(np.ravel(stats.nan_count[label])[0]) == int(np.isnan(x).sum()), label
        assert int(np.ravel(stats.count[label])[0]) == int(np.isfinite(x).sum()), label
        for name, fn in (("mean", np.nanmean), ("min", np.nanmin), ("max", np.nanmax)):
            got = float(np.ravel(getattr(stats, name)[label])[0])
            np.testing.assert_allclose(got, fn(x), rtol=1e-6, err_msg=f"{label} {name}")
    assert float(np.ravel(stats.min["f"])[0]) > -9999.0


def test_statistics_fitted_on_stored_integers_refuse_to_normalise_decoded_values(
    store: Path, tmp_path: Path
) -> None:
    decoded = open_geometries(store, ["p", "f"])
    raw = open_geometries(store, ["p", "f"], mask_and_scale=False)
    manifest = split_by_chunk(decoded["p"], (1.0, 0.0, 0.0))
    fitted_raw = fit_statistics(store, manifest, raw, batch_size=4)
    fitted_raw.save(tmp_path / "raw.json")
    fitted = fit_statistics(store, manifest, decoded, batch_size=4)
    assert float(np.ravel(fitted_raw.mean["p"])[0]) < 0 < 273 - 5 < float(fitted.mean["p"])
    for stats in (fitted_raw, Statistics.load(tmp_path / "raw.json")):
        with pytest.raises(ValueError, match=r"'p' were fitted on 'p' as stored.*mask_and_scale"):
            stack({"p": decoded["p"]}, normalize=stats)
        with pytest.raises(ValueError, match="fitted on 'f' as stored, but 'f' is delivered dec"):
            stats.normalizer({"f": decoded["f"]})
    with pytest.raises(ValueError, match=r"fitted on 'p' decoded .* delivered as stored"):
        fitted.normalizer({"p": raw["p"]})
    # alike, they are used as before; a cf_dtype of its own is the same physical values
    fitted.normalizer(decoded)
    stack({"p": open_geometries(store, ["p"], cf_dtype="float32")["p"]}, normalize=fitted)
    fitted_raw.normalizer(raw)


def test_mask_and_scale_false_delivers_the_stored_integers_and_fill_values(store: Path) -> None:
    raw = open_geometries(store, mask_and_scale=False)
    assert raw["p"].dtype == np.int16 and raw["p"].cf is None
    group = zarr.open_group(store, mode="r")
    batches = _batches(store, {"p": raw["p"], "f": raw["f"]})
    for b in batches:
        for v in ("p", "f"):
            want = group[v][...][b["rows"][v]]
            assert b["arrays"][v].dtype == want.dtype
            np.testing.assert_array_equal(b["arrays"][v], want)
    assert any((b["arrays"]["f"] == -9999.0).any() for b in batches)
    with pytest.raises(TypeError, match="mask_and_scale"):
        open_geometries(store, mask_and_scale="no")  # type: ignore[arg-type]
    decoded = open_geometries(store)["p"]  # one array read raw and decoded: refused
    with pytest.raises(ValueError, match="disagree about its geometry"):
        insitu_pipeline(store, split_by_chunk(decoded, (1.0, 0.0, 0.0)),
                        {"a": decoded, "b": raw["p"]}, batch_size=4)  # fmt: skip


def test_a_decoded_pipeline_resumes_mid_epoch_to_the_same_next_batches(store: Path) -> None:
    g = open_geometries(store)
    views = {"p": g["p"], "f": g["f"]}
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))

    def pipe() -> Any:
        return insitu_pipeline(store, manifest, views, batch_size=3, shuffle=True, seed=5)

    first = pipe()
    try:
        loader = Loader(first)
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
        rest = [{k: np.array(a) for k, a in b.arrays.items()} for b in it]
    finally:
        first.close()
    second = pipe()
    try:
        again = Loader(second)
        again.load_state_dict(state)
        resumed = [{k: np.array(a) for k, a in b.arrays.items()} for b in again]
    finally:
        second.close()
    assert len(resumed) == len(rest) >= 1
    for a, b in zip(resumed, rest, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


CASES: list[tuple[str, dict[str, Any]]] = [
    ("int16", {"scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}),
    ("int16", {"scale_factor": 0.5}),
    ("int16", {"add_offset": 10}),
    ("int16", {"scale_factor": 2}),
    ("int8", {"_FillValue": -1}),
    ("int8", {"_Unsigned": "true", "_FillValue": -1, "scale_factor": 0.1, "add_offset": 0.0}),
    ("int8", {"_Unsigned": "true"}),
    ("uint8", {"_Unsigned": "false", "_FillValue": 5}),
    ("int32", {"scale_factor": 0.001, "add_offset": 1.0, "missing_value": [-1, -2]}),
    ("uint16", {"missing_value": 65535}),
    ("float32", {"_FillValue": -9999.0}),
    ("float32", {"missing_value": -9999.0, "_FillValue": -1e30}),
    ("float64", {"scale_factor": 10.0, "_FillValue": 1e20}),
    ("float16", {"_FillValue": 0.5}),
]


@pytest.mark.parametrize(("dtype", "attrs"), CASES, ids=[f"{d}-{sorted(a)}" for d, a in CASES])
def test_cf_values_decode_as_xarrays_decode_cf_variable_bit_for_bit(
    dtype: str, attrs: dict[str, Any]
) -> None:
    from insitubatch_nodes.io.cf import cf_values

    rng = np.random.default_rng(0)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    if info is not None:
        raw = rng.integers(info.min, int(info.max) + 1, size=200).astype(dtype)
    else:
        raw = (rng.standard_normal(200) * 100).astype(dtype)
    for value in (attrs.get("_FillValue"), attrs.get("missing_value")):
        for i, f in enumerate(np.ravel(value) if value is not None else ()):
            raw[3 + 5 * i] = f
    var = xr.Variable(("x",), raw, dict(attrs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.asarray(xr.conventions.decode_cf_variable("v", var).values)
    cf = cf_values(attrs, np.dtype(dtype), None, 3)
    assert cf is not None
    got = cf.decode(raw)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    big = np.zeros((2, *raw.shape), cf.dtype)  # into a strided destination (a slot's tile)
    cf.decode_into(raw[::-1], big[1, ::-1])
    np.testing.assert_array_equal(big[1], want)


def test_a_v2_integer_array_that_is_not_packed_keeps_its_integers_and_its_fill_value(
    tmp_path: Path,
) -> None:
    # zarr's fill 0 of a label or counts image marks no missing point (xarray would give
    # floats with NaN at every 0); a packed one, or one naming its fill, is decoded
    group = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=2)
    dims = {"_ARRAY_DIMENSIONS": ["z", "x"]}
    labels = group.create_array("labels", shape=(4, 3), chunks=(1, 3), dtype="uint8",
                                fill_value=0, attributes=dims)  # fmt: skip
    labels[...] = np.arange(12).reshape(4, 3) % 3
    named = group.create_array("named", shape=(4, 3), chunks=(1, 3), dtype="int16",
                               fill_value=0, attributes=dims | {"missing_value": 2})  # fmt: skip
    named[...] = np.arange(12).reshape(4, 3) % 3
    g = open_geometries(tmp_path / "s.zarr")
    assert g["labels"].dtype == np.uint8 and g["labels"].cf is None
    assert g["named"].dtype == np.float32
    batch = _batches_of(tmp_path / "s.zarr", {"l": g["labels"], "n": g["named"]})
    np.testing.assert_array_equal(batch["l"], labels[...][batch["rows"]])
    want = (named[...] % 3).astype(np.float32)[batch["rows"]]
    want[want == 2] = np.nan
    np.testing.assert_array_equal(batch["n"], want)


def _batches_of(root: Path, views: dict[str, Any]) -> dict[str, Any]:
    first = next(iter(views.values()))
    pipe = insitu_pipeline(root, split_by_chunk(first, (1.0, 0.0, 0.0)), views, batch_size=4)
    try:
        (b,) = list(Loader(pipe))
        return {k: np.array(a) for k, a in b.arrays.items()} | {"rows": b.sample_indices["l"]}
    finally:
        pipe.close()


def test_a_persistent_cache_keys_decoded_chunks_apart_from_raw_ones(store: Path) -> None:
    from insitubatch_nodes.cache.fingerprint import array_fingerprint

    for v in ("p", "f"):
        decoded = open_geometries(store, [v])[v]
        raw = open_geometries(store, [v], mask_and_scale=False)[v]
        assert array_fingerprint(decoded, decoded, ()) != array_fingerprint(raw, raw, ())


def test_a_concatenation_of_packed_stores_delivers_xarrays_decoded_values_joined(
    tmp_path: Path,
) -> None:
    from insitubatch_nodes.io.collection import Collection

    rng = np.random.default_rng(11)
    times = np.arange("2020-01-01T00", "2020-01-04T00", np.timedelta64(6, "h"), "M8[ns]")
    stores, decoded = [], []
    for i, part in enumerate((times[:6], times[6:])):
        p = (273 + rng.standard_normal((len(part), Y, X))).astype(np.float32)
        p[i, 0, 0] = np.nan
        ds = xr.Dataset({"p": (("time", "y", "x"), p)}, coords={"time": part})
        root = tmp_path / f"part{i}.zarr"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.to_zarr(root, zarr_format=3, consolidated=False,
                       encoding={"p": {**PACKED, "chunks": (3, Y, X)}})  # fmt: skip
        stores.append(root)
        decoded.append(_xarray(root)["p"].values)
    whole = np.concatenate(decoded)
    coll = Collection.concat(stores, ["p"])
    view = coll["p"]
    assert view.dtype == whole.dtype
    pipe = insitu_pipeline(coll, split_by_chunk(view, (1.0, 0.0, 0.0)), {"p": view},
                           batch_size=4, coords=())  # fmt: skip
    rows = 0
    try:
        for b in Loader(pipe):
            np.testing.assert_array_equal(b.arrays["p"], whole[b.sample_indices["p"]])
            rows += len(b)
    finally:
        pipe.close()
    assert rows == len(whole) and np.isnan(whole).sum() == 2


def test_unsigned_bytes_are_delivered_as_xarray_reads_them_straight_and_through_the_pool(
    tmp_path: Path,
) -> None:
    # netCDF-3 bytes: int8 stored, "_Unsigned" says they are uint8 (one with a fill, packed)
    root = tmp_path / "u.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = np.arange(-48, 48, dtype=np.int8).reshape(8, 3, 4)  # -1 is 255, and the fill
    for name, chunks, attrs in (
        ("u", (1, 3, 4), {"_Unsigned": "true"}),
        ("v", (4, 3, 4), {"_Unsigned": "true", "_FillValue": -1, "scale_factor": 0.5}),
    ):
        arr = group.create_array(name, shape=data.shape, chunks=chunks, dtype="int8",
                                 dimension_names=("t", "y", "x"), attributes=attrs)  # fmt: skip
        arr[...] = data
    ds = _xarray(root)
    g = open_geometries(root)
    assert (g["u"].dtype, g["v"].dtype) == (ds["u"].dtype, ds["v"].dtype)
    pipe = insitu_pipeline(root, split_by_chunk(g["v"], (1.0, 0.0, 0.0)),
                           {"u": g["u"], "v": g["v"]}, batch_size=3)  # fmt: skip
    rows = 0
    try:
        for b in Loader(pipe):
            for v in ("u", "v"):
                np.testing.assert_array_equal(b.arrays[v], ds[v].values[b.sample_indices[v]])
            rows += len(b)
    finally:
        pipe.close()
    assert rows == 8 and ds["u"].values.max() == 255 and np.isnan(ds["v"].values).sum() == 1


@pytest.mark.parametrize("time_chunk", [1, 4])
def test_a_packed_array_sampled_along_its_last_axis_equals_xarray(
    tmp_path: Path, time_chunk: int
) -> None:
    rng = np.random.default_rng(5)
    p = (273 + rng.standard_normal((Y, X, 8))).astype(np.float32)
    p[1, 2, 5] = np.nan
    ds = xr.Dataset({"p": (("y", "x", "time"), p)})
    root = tmp_path / "last.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"p": {**PACKED, "chunks": (Y, X, time_chunk)}})  # fmt: skip
    want = np.moveaxis(_xarray(root)["p"].values, -1, 0)
    g = open_geometries(root, sample_axis="time")["p"]
    pipe = insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"p": g}, batch_size=3)
    rows = 0
    try:
        for b in Loader(pipe):
            np.testing.assert_array_equal(b.arrays["p"], want[b.sample_indices["p"]])
            rows += len(b)
    finally:
        pipe.close()
    assert rows == 8 and np.isnan(want).sum() == 1


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_concatenation_of_stores_packed_otherwise_is_refused_naming_the_attribute(
    tmp_path: Path, zarr_format: int
) -> None:
    # netCDF files written month by month (ERA5 from the CDS) pack each file with its own
    # scale_factor / add_offset: decoding every member by the first one's would be wrong
    from insitubatch_nodes.io.collection import Collection

    times = np.arange("2020-01-01T00", "2020-01-04T00", np.timedelta64(6, "h"), "M8[ns]")
    stores = []
    for i, part in enumerate((times[:6], times[6:])):
        p = np.full((len(part), Y, X), 273.0 + 10 * i, np.float32)
        ds = xr.Dataset({"p": (("time", "y", "x"), p)}, coords={"time": part})
        root = tmp_path / f"part{i}.zarr"
        packing = {**PACKED, "add_offset": 273.0 + 10 * i, "chunks": (3, Y, X)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.to_zarr(root, zarr_format=zarr_format, consolidated=False,
                       encoding={"p": packing})  # fmt: skip
        stores.append(root)
    with pytest.raises(ValueError, match="add_offset"):
        Collection.concat(stores, ["p"])["p"]


def _float32_decoded(root: Path, v: str) -> np.ndarray:
    """``v`` unpacked as xarray computes with float32 attributes: the stored values cast to
    float32, times scale_factor, plus add_offset (float32 arithmetic), NaN where filled."""
    arr = zarr.open_array(str(root / v), mode="r")
    raw, attrs = arr[...], dict(arr.attrs)
    fills = [attrs.get("_FillValue", arr.fill_value if arr.metadata.zarr_format == 2 else None)]
    fills += [attrs.get("missing_value")]
    out = raw.astype(np.float32)
    if "scale_factor" in attrs:
        out *= np.float32(attrs["scale_factor"])
    if "add_offset" in attrs:
        out += np.float32(attrs["add_offset"])
    for f in fills:
        if f is not None and not (isinstance(f, float) and np.isnan(f)):
            out[raw == f] = np.nan
    return out


def test_cf_dtype_float32_delivers_packed_and_filled_fields_unpacked_in_float32(
    store: Path,
) -> None:
    # a packed int16 ERA5 field decodes to float64 by xarray's rule (four times its stored
    # size); models take float32, and stacks need one dtype
    ds = _xarray(store)
    g = open_geometries(store, cf_dtype="float32")
    assert {g[v].dtype for v in ("p", "f", "m", "z", "lsm")} == {np.dtype(np.float32)}
    want = {v: _float32_decoded(store, v) for v in ("p", "z")}
    # the absent chunk of p reads as its fill: NaN, as the oracle's missing rows
    absent = np.isnan(ds["p"].values)
    want["p"][absent] = np.nan
    views = {"p": g["p"], "z": g["z"], "f": g["f"], "x": stack({"p": g["p"], "lsm": g["lsm"]})}
    seen = 0
    for b in _batches(store, views):
        for v in ("p", "z"):
            got = b["arrays"][v]
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want[v][b["rows"][v]], err_msg=v)
            # within a unit in the last place of xarray's float64 values, cast
            np.testing.assert_allclose(got, ds[v].values[b["rows"][v]], rtol=2**-23)
        f = ds["f"].values[b["rows"]["f"]].astype(np.float32)  # masked only: exact
        np.testing.assert_array_equal(b["arrays"]["f"], f)
        np.testing.assert_array_equal(b["arrays"]["x"][:, 0], b["arrays"]["p"])
        lsm = ds["lsm"].values.astype(np.float32)
        np.testing.assert_allclose(b["arrays"]["x"][:, 1], np.broadcast_to(lsm, (len(f), Y, X)),
                                   rtol=2**-23)  # fmt: skip
        seen += len(b["rows"]["p"])
    assert seen == T


def test_cf_dtype_is_refused_when_it_is_no_float_or_beside_mask_and_scale_false(
    store: Path,
) -> None:
    with pytest.raises(ValueError, match="float dtype"):
        open_geometries(store, cf_dtype="int16")
    with pytest.raises(TypeError, match="float dtype"):
        open_geometries(store, cf_dtype=object())
    with pytest.raises(ValueError, match="decodes nothing"):
        open_geometries(store, mask_and_scale=False, cf_dtype="float32")
