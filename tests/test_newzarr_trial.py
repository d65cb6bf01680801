"""Trial: stores written with what zarr 3.2 – 3.4 added, read through the package, with zarr and
numpy as the oracles. Run on both CI legs: Python 3.12 + the newest zarr (3.4.x) and Python 3.11
+ zarr 3.1.6; a test of a feature the installed zarr lacks skips, saying which zarr has it.

Found and fixed:

1. A valid store with a rectilinear (variable-size) chunk grid — zarr 3.2's experimental grid,
   which zarr opens only with ``zarr.config.set({'array.rectilinear_chunks': True})`` — was
   called ``CorruptMetadataError``: "corrupt zarr metadata ... is not valid zarr metadata ...
   Restore or rewrite the document(s)", and, consolidated, "zarr.consolidate_metadata(store)
   writes it again" (which changes nothing). One rectilinear array (a coordinate, say) made
   every array of a consolidated store unreadable with that message. Now it is an
   ``UnsupportedMetadataError`` naming each such array, the option that makes zarr open the
   store (after which its regular arrays read, and the rectilinear one is refused by name),
   and that to train on it the array must be rewritten with one chunk shape. On zarr 3.1 (which
   knows no such grid) it says that zarr >= 3.2 opens it with that option.
2. zarr 3.2's ``array.read_missing_chunks=False`` (zarr raises ``ChunkNotFoundError`` for a
   chunk absent from the store) was ignored: the pipeline read an absent object as the fill
   value, so a user who set the option to catch an incomplete store trained on fill values
   while zarr itself refused them. Now the read of an absent object fails
   (``ChunkReadError`` from ``FileNotFoundError`` naming the option, and what to do), under
   ``on_bad_chunk`` as any failed read; with the option at its default it reads the fill value,
   as zarr does.
3. A structured array whose ``bytes`` codec is big-endian (the spec, and zarr from 3.3, byte-swap
   each multi-byte field) was read with its fields in native order: 6.55e-42 for 36.5, every
   value of every field wrong, while zarr 3.3+ read it right. The decoder now applies the
   codec's byte order to the fields (zarr <= 3.2 drops that endian itself: the test skips).
4. On the newest-zarr leg's numpy (2.5), decoding a CF lead-time coordinate (xarray's
   durations) raised numpy's ``DeprecationWarning`` for a unitless ``NaT`` in the package's
   own frame (``geom.sel(step=...)``); the ``NaT`` now has the coordinate's unit. No zarr
   3.4 ``DeprecationWarning`` / ``FutureWarning`` came from the package's calls.

Tried and found right (each against zarr's read of the same store): sharded arrays whose inner
chunks were written in each of zarr 3.3's ``subchunk_write_order`` (morton, unordered,
lexicographic, colexicographic), the index at the start, inner chunks absent, through a
shuffled pipeline with ``shift``, windows, ``patches()``, ``isel``, a persistent ``cache_dir``
(warm run served from it) and a resume from a mid-epoch state; the ``scale_offset`` codec (zarr
3.2), sharded and not, with ``fit_statistics``; ``datetime64`` with a ``NaT`` fill value;
structured arrays with a fill value (v2 big-endian fields, v3 sharded big-endian) over absent
chunks; a ``ZipStore`` over an open file object (zarr 3.3); big-endian, blosc bitshuffle and
transpose codecs inside and outside shards;
zarr 3.3's opt-in ``FusedCodecPipeline``; with the rectilinear option on, an array with regular
chunks beside rectilinear ones (a coordinate too, read by zarr) trains, and a rectilinear array
or rectilinear shards are refused by name at ``open_geometries``. This module turns
``DeprecationWarning`` and ``FutureWarning`` into errors.

Left as it is: a persistent cache warmed while ``array.read_missing_chunks`` was on holds the
fill value for an absent object, and serves it after the option is turned off (the store's
check at start finds the object still absent, as cached).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.codecs
import zarr.errors
from helpers import Oracle, View, run_epoch

from insitubatch_nodes import (
    Loader,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError, CorruptMetadataError, UnsupportedMetadataError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("error::DeprecationWarning"),
    pytest.mark.filterwarnings("error::FutureWarning"),
    pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part"),
]

HAS_RECTILINEAR = "rectilinear_chunks" in zarr.config.get("array")
HAS_READ_MISSING = "read_missing_chunks" in zarr.config.get("array")
HAS_SUBCHUNK_ORDER = hasattr(zarr.codecs, "SubchunkWriteOrder")
HAS_SCALE_OFFSET = hasattr(zarr.codecs, "ScaleOffset")
NEEDS = f"(zarr {zarr.__version__} is installed)"

DATA = np.arange(24 * 6 * 4, dtype="f4").reshape(24, 6, 4)


def _all(manifest_of: Any) -> Any:
    return split_by_chunk(manifest_of, (1.0, 0.0, 0.0))


def _epoch(
    root: Path, views: dict[str, Any], oracle: dict[str, View], keep_arrays: bool = False, **kw: Any
) -> list[Any]:
    """One shuffled epoch of ``views`` over all of ``root``, every batch checked against zarr."""
    first = next(iter(views.values()))
    pipe = insitu_pipeline(root, _all(first), views, batch_size=4, **kw)
    try:
        return run_epoch(pipe, Oracle(root), oracle, keep_arrays=keep_arrays)
    finally:
        pipe.close()


# -- 1. rectilinear chunk grids ------------------------------------------------------------------


def _rectilinear_store(root: Path, consolidated: bool) -> None:
    """A store with a regular array ``a`` and ``b`` / ``time`` whose ``zarr.json`` have the
    rectilinear grid zarr 3.4 writes (edited by hand, so that zarr 3.1 sees the same store)."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for name, shape, chunks in (
        ("a", (24, 4), (4, 4)),
        ("b", (24, 4), (24, 4)),
        ("time", (24,), (24,)),
    ):
        dims = ("time", "x")[: len(shape)]
        array = group.create_array(
            name, shape=shape, chunks=chunks, dtype="f4", dimension_names=dims
        )
        array[...] = np.arange(np.prod(shape), dtype="f4").reshape(shape)
    grids = {"b": [[4, 8, 12], [4]], "time": [[10, 14]]}
    for name, sizes in grids.items():
        doc = json.loads((root / name / "zarr.json").read_text())
        doc["chunk_grid"] = {
            "name": "rectilinear",
            "configuration": {"kind": "inline", "chunk_shapes": sizes},
        }
        (root / name / "zarr.json").write_text(json.dumps(doc))
        for key in (root / name / "c").rglob("*"):
            key.unlink() if key.is_file() else None  # (no data: the refusal reads none)
    if consolidated:
        root_doc = json.loads((root / "zarr.json").read_text())
        root_doc["consolidated_metadata"] = {
            "kind": "inline",
            "must_understand": False,
            "metadata": {
                n: json.loads((root / n / "zarr.json").read_text()) for n in ("a", "b", "time")
            },
        }
        (root / "zarr.json").write_text(json.dumps(root_doc))


@pytest.mark.parametrize("consolidated", [False, True], ids=["plain", "consolidated"])
def test_a_valid_rectilinear_store_is_refused_as_unsupported_naming_the_option_not_as_corrupt(
    tmp_path: Path, consolidated: bool
) -> None:
    root = tmp_path / "r.zarr"
    _rectilinear_store(root, consolidated)
    asks = [["b"], None] + ([["a"]] if consolidated else [])  # (consolidated: zarr parses all)
    for names in asks:
        with pytest.raises(UnsupportedMetadataError) as info:
            open_geometries(root, names)
        message = str(info.value)
        assert isinstance(info.value, CorruptMetadataError)  # caught as before
        assert "'b/zarr.json'" in message and "'time/zarr.json'" in message
        assert "array.rectilinear_chunks" in message and "rectilinear" in message
        assert "one chunk shape" in message
        assert "corrupt" not in message and "Restore" not in message
        assert "consolidate_metadata" not in message and "Install the package" not in message
        if not HAS_RECTILINEAR:
            assert "zarr >= 3.2" in message


@pytest.mark.skipif(not HAS_RECTILINEAR, reason=f"rectilinear grids need zarr >= 3.2 {NEEDS}")
def test_with_the_rectilinear_option_a_regular_array_trains_and_rectilinear_ones_are_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "r.zarr"
    with zarr.config.set({"array.rectilinear_chunks": True}):
        group = zarr.open_group(root, mode="w", zarr_format=3)
        a = group.create_array(
            "a", shape=(24, 4), chunks=(4, 4), dtype="f4", dimension_names=("time", "x")
        )
        a[...] = DATA[:, 0, :]
        b = group.create_array("b", shape=(24, 4), chunks=[[4, 8, 12], [4]], dtype="f4")
        b[...] = DATA[:, 0, :]
        s = group.create_array("s", shape=(12, 4), chunks=(2, 4), shards=[[4, 8], [4]], dtype="f4")
        s[...] = DATA[:12, 0, :]
        t = group.create_array(
            "time", shape=(24,), chunks=[[10, 14]], dtype="i8", dimension_names=("time",)
        )
        t[...] = np.arange(24) * 3600
        zarr.consolidate_metadata(root)
        geom = open_geometries(root, ["a"])["a"]
        pipe = insitu_pipeline(root, _all(geom), {"x": geom}, batch_size=4, coords=["time"])
        try:
            seen = []
            for batch in pipe:
                np.testing.assert_array_equal(
                    batch.arrays["x"], DATA[batch.sample_indices["x"], 0, :]
                )
                seen.extend(np.asarray(batch.sample_indices["x"]).tolist())
            assert sorted(seen) == list(range(24))
        finally:
            pipe.close()
        for name in ("b", "s"):
            with pytest.raises(ValueError, match=rf"'{name}' has a chunk grid that is not regular"):
                open_geometries(root, [name])


# -- 2. zarr's read_missing_chunks option --------------------------------------------------------


def _holey_store(root: Path) -> None:
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for name, chunks in (("a", (4, 6, 4)), ("one", (1, 6, 4))):
        array = group.create_array(
            name, shape=DATA.shape, chunks=chunks, dtype="f4", fill_value=-1.0
        )
        array[:8], array[12:] = DATA[:8], DATA[12:]  # samples 8..11: absent objects


@pytest.mark.skipif(
    not HAS_READ_MISSING, reason=f"array.read_missing_chunks needs zarr >= 3.2 {NEEDS}"
)
@pytest.mark.parametrize("name", ["a", "one"])
def test_an_absent_object_fails_its_read_when_zarrs_read_missing_chunks_is_off_as_zarr_does(
    tmp_path: Path, name: str
) -> None:
    root = tmp_path / "h.zarr"
    _holey_store(root)
    geom = open_geometries(root, [name])[name]
    with zarr.config.set({"array.read_missing_chunks": False}):
        with pytest.raises(Exception, match=r"ChunkNotFound|not found"):
            zarr.open_array(root / name, mode="r")[8:12]  # zarr's own answer
        with pytest.raises(ChunkReadError) as info:
            _epoch(root, {"x": geom}, {"x": View(name)}, shuffle=False)
        cause = info.value.__cause__
        assert isinstance(cause, FileNotFoundError)
        assert "array.read_missing_chunks" in str(cause) and "missing_objects='drop'" in str(cause)
        # missing_objects="drop" leaves those samples out, as before
        pipe = insitu_pipeline(root, _all(geom), {"x": geom}, batch_size=4, missing_objects="drop")
        try:
            seen = sorted(i for r in run_epoch(pipe) for i in r["sample_indices"]["x"].tolist())
        finally:
            pipe.close()
        assert seen == [*range(8), *range(12, 24)]
    # the option at its default: the fill value, as zarr reads it
    records = _epoch(root, {"x": geom}, {"x": View(name)})
    assert sum(r["len"] for r in records) == 24


# -- 3. structured dtypes with a big-endian bytes codec -------------------------------------------


@pytest.mark.skipif(
    not HAS_SUBCHUNK_ORDER,  # (both came with zarr 3.3)
    reason="zarr <= 3.2 drops the bytes codec's endian for a structured dtype (zarr-python "
    f"#4141), so neither zarr nor the package sees it {NEEDS}",
)
def test_a_structured_array_stored_big_endian_reads_its_fields_in_that_byte_order(
    tmp_path: Path,
) -> None:
    """The ``bytes`` codec's ``endian`` applies to each multi-byte field of a structured dtype
    (the spec; zarr from 3.3, #4141; stores of other writers, virtual references to
    big-endian files). The chunks are written by hand: the oracle is numpy's."""
    from zarr.codecs import BytesCodec

    fields = np.dtype([("u", "<f4"), ("v", "<i2"), ("w", "<f8")])
    want = np.zeros((24, 3), dtype=fields)
    want["u"] = np.arange(72).reshape(24, 3) + 0.5
    want["v"] = np.arange(72).reshape(24, 3) - 30
    want["w"] = np.arange(72).reshape(24, 3) * 1.25
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    with warnings.catch_warnings():  # (zarr <= 3.2: "does not have a Zarr V3 specification")
        warnings.simplefilter("ignore", zarr.errors.UnstableSpecificationWarning)
        group.create_array("a", shape=want.shape, dtype=fields, chunks=(4, 3),
                           serializer=BytesCodec(endian="big"), compressors=None)  # fmt: skip
    big = want.astype(fields.newbyteorder(">"))
    for c in range(6):
        (root / "a" / "c" / str(c)).mkdir(parents=True, exist_ok=True)
        (root / "a" / "c" / str(c) / "0").write_bytes(big[4 * c : 4 * c + 4].tobytes())
    np.testing.assert_array_equal(zarr.open_array(root / "a", mode="r")[...], want)  # zarr too
    geom = open_geometries(root, ["a"])["a"]
    pipe = insitu_pipeline(root, _all(geom), {"x": geom}, batch_size=4)
    try:
        for batch in pipe:
            np.testing.assert_array_equal(batch.arrays["x"], want[batch.sample_indices["x"]])
    finally:
        pipe.close()


# -- 4. numpy 2.5 (the newest-zarr leg's numpy) ---------------------------------------------------


def test_a_lead_time_coordinate_decodes_without_numpys_generic_unit_deprecation(
    tmp_path: Path,
) -> None:
    """Decoding CF durations (xarray's lead times: hours, ``dtype: timedelta64[ns]``) marked
    the missing ones with a unitless ``NaT``: numpy 2.5 deprecates its conversion (a
    ``DeprecationWarning`` in the package's frame; this module makes it an error)."""
    root = tmp_path / "f.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = np.arange(24, dtype="f4").reshape(6, 4)
    f = group.create_array(
        "f", shape=(6, 4), chunks=(1, 4), dtype="f4", dimension_names=("time", "step")
    )
    f[...] = data
    step = group.create_array(
        "step", shape=(4,), chunks=(4,), dtype="i8", dimension_names=("step",)
    )
    step[...] = [0, 6, 12, -1]  # (the last one missing)
    step.attrs.update({"units": "hours", "dtype": "timedelta64[ns]", "_FillValue": -1})
    geom = open_geometries(root, ["f"])["f"]
    picked = geom.sel(step=["0h", "12h"])
    pipe = insitu_pipeline(root, _all(geom), {"x": picked}, batch_size=2, shuffle=False)
    try:
        for batch in pipe:
            np.testing.assert_array_equal(
                batch.arrays["x"], data[batch.sample_indices["x"]][:, [0, 2]]
            )
    finally:
        pipe.close()


# -- tried and found right -----------------------------------------------------------------------


def _ordered(order: str) -> dict[str, str]:
    """``ShardingCodec``'s ``subchunk_write_order`` (zarr 3.3 on); morton, the only order before,
    without it."""
    if order == "morton" and not HAS_SUBCHUNK_ORDER:
        return {}
    if not HAS_SUBCHUNK_ORDER:
        pytest.skip(f"subchunk_write_order needs zarr >= 3.3 {NEEDS}")
    return {"subchunk_write_order": order}


@pytest.mark.parametrize("order", ["morton", "unordered", "lexicographic", "colexicographic"])
def test_shards_written_in_any_subchunk_order_read_as_zarr_reads_them(
    tmp_path: Path, order: str
) -> None:
    from zarr.codecs import BytesCodec, ShardingCodec, ZstdCodec

    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for name, at in (("end", "end"), ("start", "start")):
        serializer = ShardingCodec(
            chunk_shape=(2, 3, 2), codecs=[BytesCodec(), ZstdCodec()], index_location=at,
            **_ordered(order),
        )  # fmt: skip
        array = group.create_array(name, shape=DATA.shape, dtype="f4", chunks=(8, 6, 4),
                                   serializer=serializer, compressors=None, fill_value=0.5,
                                   dimension_names=("time", "y", "x"))  # fmt: skip
        array[...] = DATA
        array[2:4, :3] = 0.5  # inner chunks left absent
    geom = open_geometries(root, ["end"])["end"]
    start = open_geometries(root, ["start"])["start"]
    assert geom.chunks == (8, 6, 4) and geom.read_chunks == (2, 3, 2)
    views = {"x": geom, "y": start.shift(1), "w": geom.window([-2, -1, 0])}
    oracle = {"x": View("end"), "y": View("start", offset=1)}
    records = _epoch(root, views, oracle, keep_arrays=True)
    want = zarr.open_array(root / "end", mode="r")[...]
    for rec in records:
        anchors = rec["sample_indices"]["x"]
        np.testing.assert_array_equal(
            rec["arrays"]["w"], np.stack([want[anchors - 2], want[anchors - 1], want[anchors]], 1)
        )
    assert sorted(i for r in records for i in r["sample_indices"]["x"].tolist()) == list(
        range(2, 23)
    )
    # patches and a selection of the sharded field read zarr's values
    sel = start.isel(y=slice(1, 5))  # (one array is read whole or patched in a plan)
    other = zarr.open_array(root / "start", mode="r")[...]
    pipe = insitu_pipeline(
        root, _all(geom), {"p": geom.patches({1: 3, 2: 2}), "s": sel}, batch_size=8
    )
    try:
        for batch in pipe:
            np.testing.assert_array_equal(batch.arrays["s"], other[batch.sample_indices["s"], 1:5])
            patch = batch.arrays["p"]
            assert patch.shape[1:] == (3, 2)
            for row, i in zip(patch, batch.sample_indices["p"], strict=True):  # a window of it
                field = want[i]
                hits = [(y, x) for y in range(4) for x in range(3)
                        if np.array_equal(field[y : y + 3, x : x + 2], row)]  # fmt: skip
                assert hits, i
    finally:
        pipe.close()


def test_a_cache_warmed_from_unordered_shards_serves_them_and_a_mid_epoch_state_resumes_exactly(
    tmp_path: Path,
) -> None:
    from zarr.codecs import ShardingCodec

    order = _ordered("unordered" if HAS_SUBCHUNK_ORDER else "morton")
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array("a", shape=DATA.shape, dtype="f4", chunks=(8, 6, 4),
                               serializer=ShardingCodec(chunk_shape=(4, 3, 2), **order),
                               compressors=None)  # fmt: skip
    array[...] = DATA
    geom = open_geometries(root, ["a"])["a"]
    cache = tmp_path / "cache"

    def build() -> Any:
        return insitu_pipeline(
            root, _all(geom), {"x": geom}, batch_size=4, cache_dir=cache, persist=True
        )

    pipe = build()
    try:
        whole = [
            (r["sample_indices"]["x"], r["arrays"]["x"]) for r in run_epoch(pipe, keep_arrays=True)
        ]
    finally:
        pipe.close()
    pipe = build()
    try:
        loader = Loader(pipe)
        it = iter(loader)
        for _ in range(2):
            next(it)
        state = loader.state_dict()
    finally:
        pipe.close()
    pipe = build()
    try:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        rest = [(np.array(b.sample_indices["x"]), np.array(b.arrays["x"])) for b in loader]
        assert pipe.stats()["disk_hits"] > 0 and pipe.stats()["misses"] == 0  # served warm
    finally:
        pipe.close()
    assert len(rest) == len(whole) - 2
    for (gi, ga), (wi, wa) in zip(rest, whole[2:], strict=True):
        np.testing.assert_array_equal(gi, wi)
        np.testing.assert_array_equal(ga, wa)
        np.testing.assert_array_equal(ga, DATA[gi])


@pytest.mark.skipif(
    not HAS_SCALE_OFFSET, reason=f"the scale_offset codec needs zarr >= 3.2 {NEEDS}"
)
@pytest.mark.parametrize("shards", [None, (8, 6, 4)], ids=["chunked", "sharded"])
def test_the_scale_offset_codec_reads_as_zarr_reads_it_and_fits_statistics(
    tmp_path: Path, shards: Any
) -> None:
    from zarr.codecs import ScaleOffset

    root = tmp_path / "so.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array("a", shape=DATA.shape, dtype="f4", chunks=(4, 3, 4), shards=shards,
                               filters=[ScaleOffset(offset=3, scale=2)])  # fmt: skip
    array[...] = DATA
    geom = open_geometries(root, ["a"])["a"]
    records = _epoch(
        root, {"x": geom, "y": geom.shift(1)}, {"x": View("a"), "y": View("a", offset=1)}
    )
    assert sum(r["len"] for r in records) == 23
    stats = fit_statistics(root, _all(geom), {"a": geom})
    want = zarr.open_array(root / "a", mode="r")[...].astype("f8")
    np.testing.assert_allclose(
        np.ravel(stats.mean["a"]),
        want.mean(axis=(0, 1, 2)) if np.size(stats.mean["a"]) == 1 else np.ravel(want.mean(axis=0)),
        rtol=1e-6,
    )


def test_a_datetime_array_with_a_nat_fill_value_reads_as_zarr_reads_it(tmp_path: Path) -> None:
    root = tmp_path / "t.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array("a", shape=(24, 3), dtype="M8[s]", chunks=(4, 3))
    array[:12] = np.arange(36).reshape(12, 3).astype("M8[s]")  # 12..23: absent, NaT
    geom = open_geometries(root, ["a"])["a"]
    records = _epoch(root, {"x": geom}, {"x": View("a")}, keep_arrays=True)
    last = [r for r in records if (r["sample_indices"]["x"] >= 12).all()]
    assert last and all(np.isnat(r["arrays"]["x"]).all() for r in last)


@pytest.mark.skipif(not HAS_SUBCHUNK_ORDER, reason=f"FusedCodecPipeline needs zarr >= 3.3 {NEEDS}")
def test_zarrs_fused_codec_pipeline_changes_nothing_read(tmp_path: Path) -> None:
    root = tmp_path / "f.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array(
        "a", shape=DATA.shape, dtype="f4", chunks=(2, 3, 4), shards=(8, 6, 4)
    )
    array[...] = DATA
    with zarr.config.set({"codec_pipeline.path": "zarr.core.codec_pipeline.FusedCodecPipeline"}):
        geom = open_geometries(root, ["a"])["a"]
        records = _epoch(root, {"x": geom}, {"x": View("a")})
    assert sum(r["len"] for r in records) == 24
