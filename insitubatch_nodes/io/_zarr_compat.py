"""Everything that depends on zarr's version or internal layout lives here.

Supported and tested: zarr 3.1.6 through 3.4.x (3.1.6, 3.2.1, 3.3.0, 3.4.2 run through the decode,
geometry and pipeline tests), v2 and v3 formats, sharded or not. The rest of the package asks this
module for plain facts (stored chunk shape, dimension names, chunk keys, codec descriptions) and
never reaches into zarr's metadata or codec classes itself.

Names used here that zarr does not export publicly (each verified on zarr 3.1.6 – 3.4.2):

* ``zarr.core.sync._get_loop`` (:func:`io_loop`): zarr's store-IO event loop, so that our GETs
  share it with zarr's own reads.
* ``zarr.core.sync.sync`` (:func:`_decode_one`): runs a codec's public async ``decode`` on that
  loop, for codecs without a synchronous decode.
* ``zarr.core.array_spec.ArraySpec`` / ``ArrayConfig`` (:func:`_array_spec`): the spec type every
  method of ``zarr.abc.codec`` takes; zarr has no public constructor for it.
* ``Codec._decode_sync`` / ``Codec._sync_capable`` (:func:`_decode_one`): the method of the
  exported ``zarr.abc.codec.SupportsSyncCodec`` protocol, and zarr 3.4's run-time opt-out from it.

* ``Store._is_open`` / ``Store._ensure_open`` (:func:`opened`): how zarr opens a store handed to
  it; ``WrapperStore._store`` (:func:`wrapped_store`): the store a wrapper wraps.

Differences between releases handled here: ``ArrayV3Metadata.get_chunk_spec`` was removed in 3.2
(:func:`chunk_spec` builds the spec itself); ``BytesCodec.endian`` and
``ShardingCodec.index_location`` are enums up to 3.2 and strings from 3.3 (:func:`_enum_value`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import zarr
import zarr.errors

from insitubatch_nodes import _process
from insitubatch_nodes.io._preread import open_read

__all__ = [
    "array_dimension_names",
    "array_metadata_keys",
    "consolidated_arrays",
    "encode_chunk_key",
    "list_dir",
    "list_keys",
    "metadata_dimension_names",
    "node_kind",
    "node_kinds",
    "open_array_readonly",
    "open_arrays_by_name",
    "open_consolidated",
    "open_node",
    "opened",
    "read_chunk_shape",
    "read_whole_array",
    "stored_chunk_shape",
    "walk_arrays",
    "walk_nodes",
    "wrapped_store",
]


def opened(store: Any) -> Any:
    """``store``, opened as zarr's own ``open_array`` / ``open_group`` open a store handed to
    them (``Store._ensure_open``): a ``ZipStore(path, mode="r")`` is built unopened, and its
    ``get`` fails until it is opened. A store already open is returned as it is."""
    if not getattr(store, "_is_open", True):
        from zarr.core.sync import sync

        sync(store._ensure_open())
    return store


def wrapped_store(store: Any) -> Any:
    """The store beneath any number of ``zarr.storage.WrapperStore`` layers (``store`` itself
    when it wraps nothing): whose objects a wrapper's reads return."""
    from zarr.storage import WrapperStore

    while isinstance(store, WrapperStore):
        store = store._store
    return store


def open_node(store: Any, path: str) -> tuple[str, Any] | None:
    """What is at ``path`` of ``store`` (:func:`node_kind`), opened read-only: ``("array",
    zarr.Array)``, ``("group", zarr.Group)`` or ``None``. Each metadata document is one GET:
    zarr's open takes those read to find the kind. zarr's ``open_group`` turns a ``KeyError``
    reading a group (consolidated metadata it cannot parse) into "no group found": that
    ``KeyError`` is raised instead, for the diagnosis."""
    from zarr.core.sync import sync

    kind, docs = sync(_node_read(store, path))
    if kind is None:
        return None
    try:
        node = sync(open_read(store, path, kind, docs))
    except zarr.errors.GroupNotFoundError as exc:
        try:
            open_consolidated(store, path, kind[1])
        except KeyError as why:
            raise why from exc
        raise
    return kind[0], zarr.Array(node) if kind[0] == "array" else zarr.Group(node)


def open_array_readonly(store: Any, path: str, zarr_format: int) -> zarr.Array:
    """Open the array at ``path`` of ``store`` for reading: one metadata read (v2: two)."""
    return zarr.open_array(store=store, path=path, mode="r", zarr_format=zarr_format)  # type: ignore[arg-type]


_NAMED_READS = 32  # metadata documents read at once by open_arrays_by_name

# what zarr raises when a path given as an array holds no array: nothing (ArrayNotFoundError,
# a FileNotFoundError) or a group (zarr 3.1: NodeTypeValidationError)
_NOT_AN_ARRAY: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    *(
        getattr(zarr.errors, n)
        for n in ("NodeTypeValidationError", "ContainsGroupError")
        if isinstance(getattr(zarr.errors, n, None), type)
    ),
)


async def _node_kind(store: Any, path: str) -> tuple[str, int] | None:
    return (await _node_read(store, path))[0]


async def _node_read(store: Any, path: str) -> tuple[tuple[str, int] | None, dict[str, Any]]:
    """What is at ``path`` (:func:`node_kind`) and the documents read to find it (key -> the
    ``Buffer`` its GET returned, ``None`` where absent), for zarr's open to take (_preread)."""
    import asyncio
    import json

    from zarr.core.buffer import default_buffer_prototype

    prototype = default_buffer_prototype()
    keys = [f"{path}/{n}" if path else n for n in ("zarr.json", ".zarray", ".zgroup")]
    got = await asyncio.gather(*(store.get(k, prototype=prototype) for k in keys))
    docs, (v3, v2_array, v2_group) = dict(zip(keys, got, strict=True)), got
    if v3 is not None:
        doc = json.loads(v3.to_bytes())
        kind = doc.get("node_type") if isinstance(doc, dict) else None
        if kind not in ("array", "group"):
            raise ValueError(f"{keys[0]!r} has no valid node_type ('array' or 'group'): {kind!r}")
        return (str(kind), 3), docs
    if v2_array is not None:
        return ("array", 2), docs
    if v2_group is not None:
        return ("group", 2), docs
    return None, docs


def node_kind(store: Any, path: str) -> tuple[str, int] | None:
    """What is at ``path`` of ``store`` (``""``: the root), read by name: ``("array", format)``,
    ``("group", format)``, or ``None`` when there is no zarr metadata there.

    GETs of the metadata documents only (``zarr.json``, ``.zarray``, ``.zgroup``, concurrently),
    never a listing: stores served over HTTP cannot list. Raises ``ValueError`` when a
    ``zarr.json`` is not JSON or names no valid ``node_type``.
    """
    from zarr.core.sync import sync

    return sync(_node_kind(store, path))


def node_kinds(store: Any, paths: Sequence[str]) -> list[tuple[str, int] | None]:
    """:func:`node_kind` of each of ``paths``, concurrently (at most 32 at a time). A path the
    store cannot read metadata below (a plain key: a local store answers "not a directory") is
    ``None``; unreadable metadata still raises ``ValueError``."""
    import asyncio

    from zarr.core.sync import sync

    limit = asyncio.Semaphore(_NAMED_READS)

    async def one(path: str) -> tuple[str, int] | None:
        async with limit:
            try:
                return await _node_kind(store, path)
            except ValueError:
                raise
            except Exception:  # no metadata can live below this key
                return None

    async def every() -> list[tuple[str, int] | None]:
        return list(await asyncio.gather(*(one(p) for p in paths)))

    return sync(every())


def open_arrays_by_name(
    store: Any, paths: Sequence[str], zarr_format: int | None = None
) -> list[zarr.Array | None]:
    """The array at each of ``paths`` (``None`` where there is none: nothing, or a group),
    read by name and concurrently (at most 32 paths at a time): GETs only, never a listing.

    With ``zarr_format`` the array's documents of that format are read straight away; without
    it :func:`node_kind` finds the format first. Raises what :func:`node_kind` and zarr raise
    for unreadable metadata (``ValueError``, ``TypeError``, ``KeyError``).
    """
    import asyncio

    from zarr.api.asynchronous import open_array
    from zarr.core.sync import sync

    limit = asyncio.Semaphore(_NAMED_READS)

    async def one(path: str) -> zarr.Array | None:
        async with limit:
            try:
                if zarr_format is not None:
                    fmt: Any = zarr_format
                    return zarr.Array(
                        await open_array(store=store, path=path, mode="r", zarr_format=fmt)
                    )
                kind, docs = await _node_read(store, path)  # (zarr's open takes them: one GET)
                if kind is None or kind[0] != "array":
                    return None
                return zarr.Array(await open_read(store, path, kind, docs))
            except _NOT_AN_ARRAY:
                return None

    async def every() -> list[zarr.Array | None]:
        return list(await asyncio.gather(*(one(p) for p in paths)))

    return sync(every())


def consolidated_arrays(group: zarr.Group) -> dict[str, zarr.Array] | None:
    """Every array the consolidated metadata of ``group`` lists (relative path -> array, no
    store read), or ``None`` when the group was not opened from consolidated metadata."""
    if getattr(group.metadata, "consolidated_metadata", None) is None:
        return None
    return dict(walk_arrays(group))


def list_dir(store: Any, prefix: str) -> list[str]:
    """The names directly below ``prefix`` (``""``: the store root): keys and "folders" alike,
    as zarr's ``Store.list_dir`` yields them. One delimited listing; raises whatever the store
    raises when it cannot list. An obstore-backed store is listed with obstore, skipping a
    folder marker (a 0-byte ``prefix/`` object, what the S3 console's "Create folder" writes),
    which zarr's ``list_dir`` fails on ("The first component of sub does not start with sub")."""
    from zarr.core.sync import sync
    from zarr.storage import ObjectStore

    if type(store) is ObjectStore or type(store).__name__ == "_CloudObjectStore":
        import obstore

        base = prefix.strip("/")
        listed = obstore.list_with_delimiter(store.store, prefix=base or None)
        paths = [*listed["common_prefixes"], *(o["path"] for o in listed["objects"])]
        return sorted({p.rsplit("/", 1)[-1] for p in paths if p.strip("/") != base})

    async def names() -> list[str]:
        return [name.rstrip("/") async for name in store.list_dir(prefix)]

    return sorted(set(sync(names())))


def list_keys(store: Any, prefix: str) -> set[str]:
    """Every key below ``prefix`` (zarr's ``Store.list_prefix``): one recursive listing."""
    from zarr.core.sync import sync

    async def listed() -> set[str]:
        return {key async for key in store.list_prefix(prefix)}

    return sync(listed())


def read_whole_array(array: zarr.Array, timeout_s: float) -> np.ndarray:
    """All of ``array``, read by zarr (its public ``AsyncArray.getitem``) on zarr's IO loop.

    Raises ``TimeoutError`` when the read has not finished within ``timeout_s`` seconds (it is
    cancelled); zarr's and the store's own errors pass through. Not for use on the IO loop.
    """
    import asyncio

    from insitubatch_nodes import _waits
    from insitubatch_nodes._process import retry_time_scale

    scale = retry_time_scale()

    async def read() -> Any:
        deadline = asyncio.timeout(timeout_s * scale)
        try:
            async with deadline:
                return await array.async_array.getitem(Ellipsis)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise TimeoutError(
                f"no complete answer within {timeout_s:g} s (RetryPolicy.timeout_s): the store "
                "stopped answering or is too slow"
            ) from None

    return np.asarray(_waits.result(asyncio.run_coroutine_threadsafe(read(), io_loop())))


METADATA_DOCUMENTS: tuple[str, ...] = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")


def array_metadata_keys(path: str, zarr_format: int) -> tuple[str, ...]:
    """The metadata documents zarr reads to open the array at ``path``."""
    names = ("zarr.json",) if zarr_format == 3 else (".zarray", ".zattrs")
    return tuple(f"{path}/{n}" if path else n for n in names)


#: how :func:`unreadable_metadata` starts the reason for a valid document naming a codec or
#: data type that is not installed
def open_consolidated(store: Any, node: str, zarr_format: Any) -> None:
    """Open the group ``node`` with its consolidated metadata as zarr does, raising what made
    it fail (``open_group`` says "no group found" for a ``KeyError`` parsing it)."""
    from zarr.core.group import AsyncGroup
    from zarr.core.sync import sync
    from zarr.storage import StorePath

    sync(AsyncGroup.open(StorePath(store, node), zarr_format=zarr_format, use_consolidated=None))


def walk_arrays(group: zarr.Group) -> list[tuple[str, zarr.Array]]:
    """Every array under ``group`` (nested groups included) as ``(relative path, array)``."""
    return walk_nodes(group)[0]


def walk_nodes(group: zarr.Group) -> tuple[list[tuple[str, zarr.Array]], list[str]]:
    """``(arrays, groups)`` under ``group``, nested groups included, as zarr's ``members`` finds
    them: ``(relative path, array)`` pairs and the relative paths of the groups. Without
    consolidated metadata zarr lists each group once and reads its children concurrently; a
    folder without group metadata is not a member (nothing below it is found)."""
    arrays: list[tuple[str, zarr.Array]] = []
    groups: list[str] = []
    for name, member in group.members(max_depth=None):
        if isinstance(member, zarr.Array):
            arrays.append((name, member))
        else:
            groups.append(name)
    return sorted(arrays, key=lambda item: item[0]), sorted(groups)


def stored_chunk_shape(array: zarr.Array) -> tuple[int, ...]:
    """Shape of one stored object: the shard of a sharded v3 array, else the chunk.

    Raises ``ValueError`` for a chunk grid that is not regular (zarr 3.4's rectilinear grids,
    where zarr itself raises ``NotImplementedError`` for ``chunks`` / ``shards``).
    """
    try:
        shards = getattr(array, "shards", None)
        if shards is not None:
            return tuple(int(s) for s in shards)
        return tuple(int(c) for c in array.chunks)
    except NotImplementedError as exc:
        raise ValueError(
            f"array {array.path!r} has a chunk grid that is not regular (variable chunk sizes); "
            "insitubatch_nodes reads arrays with a regular chunk grid only: rewrite the array "
            "with one chunk shape"
        ) from exc


#: the zarr option without which zarr (3.2 on) refuses to open a rectilinear chunk grid
RECTILINEAR_OPTION = (
    "zarr.config.set({'array.rectilinear_chunks': True}) (or ZARR_ARRAY__RECTILINEAR_CHUNKS=True)"
)


def unsupported_chunk_grid(exc: BaseException) -> str | None:
    """Why zarr refused to open an array, when ``exc`` says its metadata is valid but names a
    chunk grid zarr does not open here; ``None`` for any other error. zarr 3.2 – 3.4 raise
    ``RectilinearChunksDisabledError`` (a ``ValueError`` in ``zarr.core.metadata.v3``, not
    exported) for a rectilinear grid while ``array.rectilinear_chunks`` is off; zarr 3.1 raises
    ``ValueError("Unknown chunk grid. Got rectilinear.")``."""
    if type(exc).__name__ == "RectilinearChunksDisabledError":
        return (
            "a rectilinear chunk grid (variable chunk sizes), which zarr opens only with "
            f"{RECTILINEAR_OPTION}"
        )
    if isinstance(exc, ValueError) and str(exc).startswith("Unknown chunk grid"):
        return (
            f"a chunk grid zarr {zarr.__version__} does not know ({exc}); zarr >= 3.2 opens a "
            f"rectilinear grid (variable chunk sizes) with {RECTILINEAR_OPTION}"
        )
    return None


def reads_missing_chunks() -> bool:
    """zarr's ``array.read_missing_chunks`` option (zarr 3.2 on; always ``True`` before):
    whether zarr reads a chunk absent from the store as the fill value (``True``) or raises
    ``ChunkNotFoundError`` (``False``)."""
    return bool(zarr.config.get("array.read_missing_chunks", True))


def read_chunk_shape(array: zarr.Array) -> tuple[int, ...]:
    """zarr's chunk shape (the inner chunk of a sharded array)."""
    return tuple(int(c) for c in array.chunks)


def array_dimension_names(array: zarr.Array) -> tuple[str, ...] | None:
    """Dimension names from v3 ``dimension_names`` or xarray's v2 ``_ARRAY_DIMENSIONS``."""
    names: Sequence[Any] | None = getattr(array.metadata, "dimension_names", None)
    if names is None:
        attr = array.attrs.get("_ARRAY_DIMENSIONS")
        names = attr if isinstance(attr, list) else None
    if names is None or any(n is None for n in names):
        return None
    return tuple(str(n) for n in names)


def metadata_dimension_names(metadata: Any) -> tuple[str, ...] | None:
    """:func:`array_dimension_names` from an array's metadata alone (v3 ``dimension_names``,
    v2 ``_ARRAY_DIMENSIONS`` in its attributes): what an :class:`ArrayGeometry` keeps."""
    names: Sequence[Any] | None = getattr(metadata, "dimension_names", None)
    if names is None:
        attr = (getattr(metadata, "attributes", None) or {}).get("_ARRAY_DIMENSIONS")
        names = attr if isinstance(attr, list) else None
    if names is None or any(n is None for n in names):
        return None
    return tuple(str(n) for n in names)


def encode_chunk_key(metadata: Any, coords: Sequence[int]) -> str:
    """The store key (relative to the array) of the stored object at chunk-grid ``coords``."""
    return str(metadata.encode_chunk_key(tuple(int(c) for c in coords)))


def chunk_key_format(metadata: Any, ndim: int) -> str | None:
    """A ``str.format`` template equal to :func:`encode_chunk_key` for this array's
    ``ndim``-d chunk coordinates (``template.format(*coords)``), or ``None`` when the key
    encoding is not a plain decimal join (then encode each key with zarr).

    Every zarr key encoding in use ("default" ``c/0/1``, "v2" ``0.1`` or ``0/1``, either
    separator) writes each coordinate as its decimal digits between fixed separators: the
    template is read off the key of distinctive probe coordinates and checked against zarr
    on a few others."""
    probe = tuple(913_579_000 + i for i in range(ndim))
    key = encode_chunk_key(metadata, probe)
    template = key.replace("{", "{{").replace("}", "}}")
    for i, value in enumerate(probe):
        token = str(value)
        if template.count(token) != 1:
            return None
        template = template.replace(token, f"{{{i}}}")
    checks = [tuple(0 for _ in range(ndim)), tuple(range(1, ndim + 1)), tuple([12] * ndim)]
    for coords in checks:
        if template.format(*coords) != encode_chunk_key(metadata, coords):
            return None
    return template


def io_loop() -> Any:
    """zarr's process-wide store-IO event loop (started on first use, on its own thread), its
    wakeups by other threads counted for the exit hook (``_process.watch_wakeups``) and its
    ``close`` safe from any thread, zarr's exit hook included (``_process.guard_close``)."""
    from zarr.core.sync import _get_loop

    loop = _get_loop()
    _process.watch_wakeups(loop)
    _process.guard_close(loop)
    return loop


# -- decoding (used by insitubatch_nodes.io.decode) ---
# zarr's codec classes and chunk-spec types are imported lazily inside these functions: they are
# the names that move between zarr releases.


@dataclass(frozen=True)
class CodecDescription:
    """What the decoder needs to know about one zarr v3 codec.

    ``role`` is ``"array_array"``, ``"array_bytes"`` or ``"bytes_bytes"``. ``kind`` is
    ``"bytes"`` (``endian`` is ``"little"``, ``"big"`` or ``None``), ``"crc32c"``, ``"numcodecs"``
    (a compressor/checksum that a numcodecs codec built from ``numcodec_config`` decodes),
    ``"sharding"`` or ``"other"`` (only zarr itself can decode it). ``codec`` is zarr's object.
    """

    role: str
    kind: str
    codec: Any
    endian: str | None = None
    numcodec_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class ShardingLayout:
    """The parts of a ``sharding_indexed`` codec: inner chunk shape, inner and index codecs."""

    chunk_shape: tuple[int, ...]
    codecs: tuple[Any, ...]
    index_codecs: tuple[Any, ...]
    index_at_end: bool


def v3_codecs(metadata: Any) -> tuple[Any, ...]:
    """The codec chain of a v3 array, in encode order (array->array, array->bytes, bytes->bytes)."""
    return tuple(metadata.codecs)


def describe_codec(codec: Any) -> CodecDescription:
    """Classify one zarr v3 codec object (see :class:`CodecDescription`)."""
    from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec
    from zarr.codecs import (
        BloscCodec,
        BytesCodec,
        Crc32cCodec,
        GzipCodec,
        ShardingCodec,
        ZstdCodec,
    )

    if isinstance(codec, ArrayArrayCodec):
        return CodecDescription("array_array", "other", codec)
    if isinstance(codec, ArrayBytesCodec):
        if isinstance(codec, BytesCodec):
            endian = None if codec.endian is None else _enum_value(codec.endian)
            return CodecDescription("array_bytes", "bytes", codec, endian=endian)
        if isinstance(codec, ShardingCodec):
            return CodecDescription("array_bytes", "sharding", codec)
        return CodecDescription("array_bytes", "other", codec)
    # bytes -> bytes: the compression parameters do not matter for decoding.
    if isinstance(codec, Crc32cCodec):
        return CodecDescription("bytes_bytes", "crc32c", codec)
    config: dict[str, Any] | None = None
    if isinstance(codec, ZstdCodec):
        config = {"id": "zstd"}
    elif isinstance(codec, BloscCodec):
        config = {"id": "blosc"}
    elif isinstance(codec, GzipCodec):
        config = {"id": "gzip"}
    else:
        wrapped = getattr(codec, "codec_config", None)  # zarr.codecs.numcodecs.* wrappers
        name = getattr(codec, "codec_name", "")
        if isinstance(wrapped, dict) and isinstance(name, str) and name.startswith("numcodecs."):
            config = dict(wrapped)
    if config is None:
        return CodecDescription("bytes_bytes", "other", codec)
    return CodecDescription("bytes_bytes", "numcodecs", codec, numcodec_config=config)


def _enum_value(value: Any) -> str:
    """The string of a zarr codec option: an enum member up to zarr 3.2 (``Endian.little``,
    ``ShardingCodecIndexLocation.end``), a plain string literal from zarr 3.3 on."""
    return str(getattr(value, "value", value))


def sharding_layout(codec: Any) -> ShardingLayout:
    """Inner chunk shape, inner codecs, index codecs and index location of a sharding codec."""
    return ShardingLayout(
        chunk_shape=tuple(int(c) for c in codec.chunk_shape),
        codecs=tuple(codec.codecs),
        index_codecs=tuple(codec.index_codecs),
        index_at_end=_enum_value(codec.index_location) == "end",
    )


def v2_chunk_codecs(metadata: Any) -> tuple[Any | None, tuple[Any, ...], str]:
    """``(compressor, filters, order)`` of a v2 array: numcodecs objects (or ``None``), 'C'/'F'."""
    filters = tuple(metadata.filters) if metadata.filters else ()
    return metadata.compressor, filters, str(metadata.order)


def numcodec_config(codec: Any) -> dict[str, Any]:
    """The config dict (with ``id``) that rebuilds a numcodecs codec via ``get_codec``."""
    return dict(codec.get_config())


def native_dtype(metadata: Any) -> np.dtype[Any]:
    """The in-memory numpy dtype of an array (byte order as zarr reports it)."""
    return np.dtype(metadata.dtype.to_native_dtype())


def default_fill_value(metadata: Any) -> Any:
    """The fill value zarr uses for a missing chunk (the dtype's default when it is null)."""
    fill = metadata.fill_value
    return metadata.dtype.default_scalar() if fill is None else fill


def _array_spec(shape: Sequence[int], dtype: Any, fill_value: Any, order: str) -> Any:
    # ``ArraySpec`` / ``ArrayConfig`` live in ``zarr.core.array_spec`` (no public re-export) but are
    # the types every codec method of ``zarr.abc.codec`` takes. Constructor verified unchanged on
    # zarr 3.1.6 – 3.4.2 (``ArrayConfig.from_dict`` fills the fields zarr 3.4 added).
    from zarr.buffer import default_buffer_prototype
    from zarr.core.array_spec import ArrayConfig, ArraySpec

    config = ArrayConfig.from_dict({"order": order, "write_empty_chunks": False})  # type: ignore[typeddict-item]
    return ArraySpec(
        shape=tuple(int(c) for c in shape),
        dtype=dtype,
        fill_value=fill_value,
        config=config,
        prototype=default_buffer_prototype(),
    )


def chunk_spec(metadata: Any, shape: Sequence[int], order: str = "C") -> Any:
    """zarr's ``ArraySpec`` of one stored object of ``shape`` (what zarr's codec calls take).

    Built from the metadata's dtype and fill value: ``ArrayV3Metadata.get_chunk_spec`` existed up
    to zarr 3.1 and was removed in 3.2.
    """
    return _array_spec(shape, metadata.dtype, metadata.fill_value, order)


def inner_chunk_spec(sharding_codec: Any, shard_spec: Any) -> Any:
    """The ``ArraySpec`` of one inner chunk of a shard described by ``shard_spec``."""
    return _array_spec(
        sharding_codec.chunk_shape, shard_spec.dtype, shard_spec.fill_value, shard_spec.config.order
    )


def _index_spec(chunks_per_shard: Sequence[int]) -> Any:
    # The shard index, as the sharding_indexed spec defines it: ``(*chunks_per_shard, 2)``
    # little-endian uint64, ``2**64 - 1`` marking a missing inner chunk.
    from zarr.dtype import UInt64

    return _array_spec(
        (*(int(c) for c in chunks_per_shard), 2), UInt64(endianness="little"), 2**64 - 1, "C"
    )


def _resolved_specs(codecs: Sequence[Any], spec: Any) -> list[Any]:
    """The spec each codec of a chain sees (encode order), via ``Codec.resolve_metadata``."""
    specs: list[Any] = []
    current = spec
    for codec in codecs:
        specs.append(current)
        current = codec.resolve_metadata(current)
    return specs


def shard_index_nbytes(sharding_codec: Any, chunks_per_shard: Sequence[int]) -> int:
    """Encoded size of a shard's index (``(*chunks_per_shard, 2)`` uint64 plus checksums)."""
    codecs = tuple(sharding_codec.index_codecs)
    specs = _resolved_specs(codecs, _index_spec(chunks_per_shard))
    size = 16 * math.prod(int(c) for c in chunks_per_shard)
    for codec, spec in zip(codecs, specs, strict=True):
        size = int(codec.compute_encoded_size(size, spec))
    return size


def decode_shard_index(
    sharding_codec: Any, index_bytes: np.ndarray, chunks_per_shard: Sequence[int]
) -> np.ndarray:
    """Decode an encoded shard index with zarr's index codecs: ``(*chunks_per_shard, 2)`` u8."""
    cps = tuple(int(c) for c in chunks_per_shard)
    index = decode_with_zarr_codecs(
        tuple(sharding_codec.index_codecs), index_bytes, _index_spec(cps)
    )
    return np.asarray(index, dtype=np.uint64).reshape(*cps, 2)


def _decode_one(codec: Any, data: Any, spec: Any) -> Any:
    # ``_decode_sync`` is the method of ``zarr.abc.codec.SupportsSyncCodec``, a protocol zarr
    # exports (3.1.6 – 3.4.2 verified); zarr 3.4 lets a codec opt out of it at run time with
    # ``_sync_capable = False`` (a sharding codec whose inner codecs are async only). Everything
    # else goes through the public async ``BaseCodec.decode`` on zarr's own event loop.
    decode_sync = getattr(codec, "_decode_sync", None)
    if decode_sync is not None and getattr(codec, "_sync_capable", True):
        return decode_sync(data, spec)
    from zarr.core.sync import sync

    (decoded,) = sync(codec.decode([(data, spec)]))
    return decoded


def decode_with_zarr_codecs(codecs: Sequence[Any], raw: np.ndarray, spec: Any) -> np.ndarray:
    """Decode one encoded chunk with zarr's own codec objects (the slow, general path).

    ``raw`` is the encoded bytes as a 1-D uint8 array; ``spec`` the chunk's ``ArraySpec``.
    Returns the chunk as a numpy array of the chunk shape (physical axis order). Codecs with a
    synchronous decode are called directly; others run their async decode on zarr's event loop.
    Raises ``ValueError`` when a codec yields nothing (zarr's codecs return ``None`` for an
    empty input in some releases).
    """
    specs = _resolved_specs(codecs, spec)
    data: Any = spec.prototype.buffer.from_array_like(raw)
    for codec, codec_spec in zip(reversed(codecs), reversed(specs), strict=True):
        data = _decode_one(codec, data, codec_spec)
        if data is None:
            raise ValueError(f"zarr's {type(codec).__name__} decoded nothing")
    return np.asarray(data.as_numpy_array())


def crc32c(data: np.ndarray) -> int:
    """CRC-32C of a contiguous uint8 array (the checksum zarr's ``crc32c`` codec stores)."""
    return int(google_crc32c.value(data))
