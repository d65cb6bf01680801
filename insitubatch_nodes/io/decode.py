"""Decode one stored object straight into the caller's memory, with the GIL released.

A :class:`ChunkDecoder` is built once per :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`. It
inspects the array's codec chain once and picks a plan:

* **numcodecs** — the chain is ``bytes`` (+ any mix of numcodecs compressors / checksums and
  ``crc32c``) on v3, or any numcodecs compressor (+ filters) on v2. numcodecs does the work and
  releases the GIL. When the stored chunk is whole (not an edge), the destination is contiguous
  in the chunk's memory order and has the stored dtype, and the last decode step is Zstd, Blosc,
  LZ4 or GZip, the decompressor writes **directly into the destination**. Otherwise it writes
  into a per-thread scratch buffer that is reused (grown, never shrunk) and one ``np.copyto``
  moves the cropped, axis-permuted view into place.
* **sharded** — a v3 ``sharding_indexed`` array: the shard index is parsed with numpy (crc32c
  checked) and every inner chunk that the destination needs is decoded by its own plan (one of
  these three) into its place in the destination; a missing inner chunk gets the fill value.
* **zarr** — anything else (transpose codec, array->array numcodecs filters, vlen strings, ...):
  zarr's own codec objects decode the chunk (this may allocate), then one copy.

Nothing here loops over samples; the only Python loop is over the inner chunks of a shard.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any, Literal

import numcodecs
import numpy as np
from numcodecs.compat import ensure_contiguous_ndarray

from insitubatch_nodes.errors import DecodeError
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.geometry import ArrayGeometry

__all__ = [
    "SCRATCH_MIN_BYTES",
    "ChunkDecoder",
]

_MISSING = 2**64 - 1  # shard index entry of an inner chunk that was never written
_U8 = np.dtype(np.uint8)
SCRATCH_MIN_BYTES = 4096  # the smallest scratch buffer a thread holds (grown, never shrunk)
# numcodecs codecs that honour ``decode(buf, out=...)`` (checked: they write into ``out``) and
# whose decoded size can be read from the encoded header before decoding.
_INPLACE_IDS = frozenset({"zstd", "blosc", "lz4", "gzip"})


@dataclass
class _Stats:
    """Diagnostic counters (plain ints; increments may be lost under heavy concurrency)."""

    inplace: int = 0  # a decompressor wrote straight into ``out``
    scratch: int = 0  # decoded into the per-thread scratch buffer, then copied
    copied: int = 0  # copied straight from the raw bytes / a codec's own result
    fallback: int = 0  # decoded by zarr's codec objects
    filled: int = 0  # a missing object or inner chunk filled with the fill value
    scratch_bytes: int = 0  # scratch memory held by this decoder, over all decode threads


# ---------------------------------------------------------------------------------------------
# Encoded-header sizes (so that a decompressor can be given an exact-size ``out``)
# ---------------------------------------------------------------------------------------------


def _zstd_content_size(buf: np.ndarray) -> int | None:
    """Frame content size from a zstd frame header, or None when absent / not a zstd frame."""
    if len(buf) < 6 or int.from_bytes(bytes(buf[:4]), "little") != 0xFD2FB528:
        return None
    fhd = int(buf[4])
    fcs_flag, single_segment, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(buf) < pos + size:
        return None
    value = int.from_bytes(bytes(buf[pos : pos + size]), "little")
    return value + 256 if size == 2 else value


#: a blosc1 header's ``nbytes`` (bytes 4-8) and ``cbytes`` (bytes 12-16), little endian
_BLOSC_SIZES = struct.Struct("<4xI4xI")


def _decoded_size(codec_id: str, buf: np.ndarray) -> int | None:
    """The decoded size an encoded buffer announces, or None when it cannot be told.

    Raises ``ValueError`` for a blosc header that is short or claims more bytes than given.
    """
    if codec_id == "zstd":
        return _zstd_content_size(buf)
    if codec_id == "blosc":
        # blosc1 header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes (u32 LE).
        # blosc_decompress trusts cbytes (it is not told the input size): check it here.
        if len(buf) < 16:
            raise ValueError(f"{len(buf)} bytes are too short for a blosc header")
        nbytes, cbytes = _BLOSC_SIZES.unpack_from(buf.data)  # (one call: runs per object)
        if cbytes > len(buf):
            raise ValueError(f"blosc header announces {cbytes} bytes, the buffer holds {len(buf)}")
        return int(nbytes)
    if codec_id == "lz4":  # numcodecs LZ4 prefixes the uncompressed size (u32 little endian)
        return int.from_bytes(bytes(buf[:4]), "little") if len(buf) >= 4 else None
    if codec_id == "gzip":  # ISIZE trailer (size mod 2**32 of the last member): only a hint
        return int.from_bytes(bytes(buf[-4:]), "little") if len(buf) >= 18 else None
    return None


def _as_u8(obj: Any) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (bytes, memoryview, ndarray)."""
    kind = type(obj)
    if kind is memoryview or kind is bytes:
        # what a read hands over, once per stored object: numpy's C view of it, not numcodecs'
        # normalisation (~10x the cost); a memoryview that is not C-contiguous takes that path
        if kind is bytes or obj.c_contiguous:
            return np.frombuffer(obj, dtype=_U8)
    elif isinstance(obj, np.ndarray) and obj.dtype == _U8 and obj.ndim == 1:
        return obj
    return ensure_contiguous_ndarray(obj).view(_U8)


def _flat_bytes(dest: np.ndarray, order: Literal["C", "F"]) -> np.ndarray:
    """A flat uint8 *view* of ``dest`` (C- or F-contiguous per ``order``) in its memory order."""
    flat = (dest if order == "C" else dest.T).reshape(-1)
    return flat.view(_U8)


def _verify_crc32c(data: np.ndarray) -> np.ndarray:
    """Check and strip the trailing crc32c checksum of ``data``."""
    if len(data) < 4:
        raise ValueError(f"{len(data)} bytes are too short to hold a crc32c checksum")
    body = data[:-4]
    stored = int.from_bytes(bytes(data[-4:]), "little")
    computed = _zarr_compat.crc32c(body)
    if stored != computed:
        raise ValueError(
            f"crc32c checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
        )
    return body


# ---------------------------------------------------------------------------------------------
# Plans: how to decode one encoded chunk into a (cropped) region of a destination
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """One bytes->bytes decode step: ``crc32c`` (verify and strip) or a numcodecs codec."""

    kind: str  # "crc32c" | "numcodecs"
    config: dict[str, Any] | None = None

    @property
    def codec_id(self) -> str:
        return str(self.config["id"]) if self.config else ""


class _Plan:
    """Decodes one encoded chunk of ``shape`` (physical order) into ``dest``.

    ``crop`` are slices of the chunk (physical order) that ``dest`` holds: ``dest.shape`` is the
    crop's extent. ``data`` is the encoded chunk as a flat uint8 array.
    """

    shape: tuple[int, ...]
    strategy: str

    def decode(
        self, data: np.ndarray, dest: np.ndarray, crop: tuple[slice, ...], rt: ChunkDecoder
    ) -> None:
        raise NotImplementedError


class _NumcodecsPlan(_Plan):
    """bytes->bytes steps with numcodecs/crc32c, optional v2 filters, then a dtype reinterpret."""

    strategy = "numcodecs"

    def __init__(
        self,
        shape: tuple[int, ...],
        stored_dtype: np.dtype[Any],
        order: Literal["C", "F"],
        steps: Sequence[_Step],
        filters: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.shape = shape
        self.stored_dtype = stored_dtype
        self.order = order
        self.steps = tuple(steps)  # in *decode* order
        self.filters = tuple(_Step("numcodecs", f) for f in filters)  # in *encode* order
        self.nbytes = math.prod(shape) * stored_dtype.itemsize
        last = self.steps[-1] if self.steps else None
        #: the final decode step can write straight into the destination
        self.inplace_capable = (
            not self.filters
            and last is not None
            and last.kind == "numcodecs"
            and last.codec_id in _INPLACE_IDS
            and stored_dtype.kind != "O"
        )
        #: one decompressor and nothing else (the common case): a whole chunk goes straight
        #: from it into the destination, with no per-step bookkeeping
        self._lone = self.inplace_capable and len(self.steps) == 1
        self._lone_id = self.steps[0].codec_id if self._lone else ""
        #: numcodecs' blosc ``decompress(source, dest)`` when the lone step is its Blosc codec:
        #: what ``Blosc.decode`` runs, less one normalisation of the source (already a flat
        #: uint8 array here) and the per-thread codec lookup, per stored object
        self._blosc = _blosc_decompress(self.steps[0]) if self._lone_id == "blosc" else None

    def _is_direct(self, dest: np.ndarray) -> bool:
        """Whether the chunk can be decoded straight into ``dest``: the whole chunk (a crop as
        large as the chunk starts at 0), in the stored dtype and memory order, writeable."""
        if dest.shape != self.shape:  # an edge chunk: zarr stored it full size, crop it
            return False
        if dest.dtype != self.stored_dtype:
            return False
        flags = dest.flags
        return bool(
            flags.writeable and (flags.c_contiguous if self.order == "C" else flags.f_contiguous)
        )

    def decode(
        self, data: np.ndarray, dest: np.ndarray, crop: tuple[slice, ...], rt: ChunkDecoder
    ) -> None:
        if self._lone and self._is_direct(dest):
            step = self.steps[0]
            if _decoded_size(self._lone_id, data) == self.nbytes:
                if self._blosc is not None:
                    self._blosc(data, _flat_bytes(dest, self.order))
                else:
                    _decode_into(rt._codec(step), data, _flat_bytes(dest, self.order))
                rt._stats.inplace += 1
                return
            # a size the header does not announce, or a wrong one: the general path says which
        n_steps = len(self.steps)
        used_scratch = False
        for k, step in enumerate(self.steps):
            if step.kind == "crc32c":
                data = _verify_crc32c(data)
                continue
            codec = rt._codec(step)
            if k != n_steps - 1:  # an intermediate step: let numcodecs allocate
                _decoded_size(step.codec_id, data)  # validates a blosc header
                data = _as_u8(codec.decode(data))
                continue
            size = _decoded_size(step.codec_id, data)
            if size is not None and not self.filters and size != self.nbytes:
                # only hints: gzip's trailer (of the last member) and a zstd frame header (of
                # the first frame) describe one part of a multi-member / multi-frame stream
                if step.codec_id not in ("gzip", "zstd"):
                    raise ValueError(
                        f"{step.codec_id} stream announces {size} decoded bytes, the chunk "
                        f"holds {self.nbytes}"
                    )
                size = None
            if size is None:
                data = _as_u8(codec.decode(data))
                continue
            if self.inplace_capable and self._is_direct(dest):
                target = _flat_bytes(dest, self.order)
                _decode_into(codec, data, target)
                rt._stats.inplace += 1
                return
            target = rt._scratch(size)
            _decode_into(codec, data, target)
            data = target
            used_scratch = True
        if self.filters:
            chunk = self._apply_filters(data, rt)
        else:
            if len(data) != self.nbytes:
                raise ValueError(f"decoded {len(data)} bytes, the chunk holds {self.nbytes}")
            chunk = data.view(self.stored_dtype).reshape(self.shape, order=self.order)
        np.copyto(dest, chunk[crop])
        if used_scratch:
            rt._stats.scratch += 1
        else:
            rt._stats.copied += 1

    def _apply_filters(self, data: np.ndarray, rt: ChunkDecoder) -> np.ndarray:
        """v2 filters in reverse, then reinterpret as the stored dtype (like zarr's V2Codec)."""
        chunk: Any = data
        for step in reversed(self.filters):
            chunk = rt._codec(step).decode(chunk)
        arr = np.asarray(chunk)
        if self.stored_dtype.kind != "O" and arr.dtype.kind != "O":
            arr = np.ascontiguousarray(arr).reshape(-1).view(self.stored_dtype)
        elif self.stored_dtype.kind != "O":
            arr = arr.astype(self.stored_dtype)
        if arr.size != math.prod(self.shape):
            raise ValueError(f"filters decoded {arr.size} values, the chunk holds {self.shape}")
        return arr.reshape(-1, order="A").reshape(self.shape, order=self.order)


def _blosc_decompress(step: _Step) -> Callable[[np.ndarray, np.ndarray], Any] | None:
    """``numcodecs.blosc.decompress`` when ``step``'s codec is numcodecs' own ``Blosc`` (whose
    ``decode(buf, out)`` is ``decompress(ensure_contiguous_ndarray(buf), out)``), else None."""
    try:
        from numcodecs import blosc
    except ImportError:  # pragma: no cover - a numcodecs built without blosc
        return None
    codec = numcodecs.get_codec(dict(step.config or {}))
    return blosc.decompress if type(codec) is blosc.Blosc else None


def _decode_into(codec: Any, data: np.ndarray, target: np.ndarray) -> None:
    """``codec.decode(data, out=target)``; copies when a codec returns a buffer of its own."""
    result = codec.decode(data, out=target)
    if result is target or (
        isinstance(result, np.ndarray) and result.ctypes.data == target.ctypes.data
    ):
        return
    got = _as_u8(result)
    if len(got) != len(target):
        raise ValueError(f"decoded {len(got)} bytes, expected {len(target)}")
    target[...] = got


class _ZarrPlan(_Plan):
    """zarr's own codec objects (the general, allocating path)."""

    strategy = "zarr"

    def __init__(self, shape: tuple[int, ...], codecs: tuple[Any, ...], spec: Any) -> None:
        self.shape = shape
        self.codecs = codecs
        self.spec = spec

    def decode(
        self, data: np.ndarray, dest: np.ndarray, crop: tuple[slice, ...], rt: ChunkDecoder
    ) -> None:
        chunk = _zarr_compat.decode_with_zarr_codecs(self.codecs, data, self.spec)
        if chunk.shape != self.shape:
            raise ValueError(f"zarr decoded a chunk of shape {chunk.shape}, expected {self.shape}")
        np.copyto(dest, chunk[crop])
        rt._stats.fallback += 1


class _ShardPlan(_Plan):
    """A v3 shard: parse the index, decode each needed inner chunk into its place."""

    strategy = "sharded"

    def __init__(
        self,
        shape: tuple[int, ...],
        codec: Any,
        layout: _zarr_compat.ShardingLayout,
        inner: _Plan,
    ) -> None:
        self.shape = shape
        self.codec = codec
        self.inner_shape = layout.chunk_shape
        self.inner = inner
        self.index_at_end = layout.index_at_end
        self.cps = tuple(s // c for s, c in zip(shape, self.inner_shape, strict=True))
        # strides of the C-order flat index of an inner chunk in the index table
        self.strides = tuple(math.prod(self.cps[a + 1 :]) for a in range(len(self.cps)))
        n = math.prod(self.cps)
        descs = [_zarr_compat.describe_codec(c) for c in layout.index_codecs]
        fast = (
            bool(descs)
            and descs[0].kind == "bytes"
            and descs[0].endian in (None, "little")
            and all(d.kind == "crc32c" for d in descs[1:])
        )
        self.index_crcs = len(descs) - 1 if fast else -1  # -1: decode the index with zarr
        if fast:
            self.index_nbytes = 16 * n + 4 * self.index_crcs
        else:
            self.index_nbytes = _zarr_compat.shard_index_nbytes(codec, self.cps)

    def _index(self, data: np.ndarray) -> list[list[int]]:
        """``[offset, nbytes]`` of every inner chunk, in C order of the chunk grid."""
        if len(data) < self.index_nbytes:
            raise ValueError(
                f"a shard of {len(data)} bytes cannot hold its {self.index_nbytes}-byte index"
            )
        raw = (
            data[len(data) - self.index_nbytes :]
            if self.index_at_end
            else data[: self.index_nbytes]
        )
        if self.index_crcs >= 0:
            for _ in range(self.index_crcs):
                raw = _verify_crc32c(raw)
            table = raw.view("<u8").reshape(-1, 2)
        else:
            table = _zarr_compat.decode_shard_index(self.codec, raw, self.cps).reshape(-1, 2)
        rows: list[list[int]] = table.tolist()
        return rows

    def decode(
        self, data: np.ndarray, dest: np.ndarray, crop: tuple[slice, ...], rt: ChunkDecoder
    ) -> None:
        index = self._index(data)
        size = len(data)
        ranges = [
            range(s.start // c, -(-s.stop // c))
            for s, c in zip(crop, self.inner_shape, strict=True)
        ]
        for coords in product(*ranges):
            dest_sel: list[slice] = []
            inner_crop: list[slice] = []
            for i, s, c in zip(coords, crop, self.inner_shape, strict=True):
                lo, hi = max(s.start, i * c), min(s.stop, (i + 1) * c)
                dest_sel.append(slice(lo - s.start, hi - s.start))
                inner_crop.append(slice(lo - i * c, hi - i * c))
            region = dest[tuple(dest_sel)]
            offset, nbytes = index[sum(i * st for i, st in zip(coords, self.strides, strict=True))]
            if offset == _MISSING and nbytes == _MISSING:  # stored values, decoded after
                region[...] = rt._stored_fill
                rt._stats.filled += 1
                continue
            if offset + nbytes > size:
                raise ValueError(
                    f"inner chunk {coords} at bytes [{offset}, {offset + nbytes}) lies outside "
                    f"the {size}-byte shard"
                )
            self.inner.decode(data[offset : offset + nbytes], region, tuple(inner_crop), rt)


# ---------------------------------------------------------------------------------------------
# Building a plan from zarr metadata
# ---------------------------------------------------------------------------------------------


def _with_endian(dtype: np.dtype[Any], endian: str | None) -> np.dtype[Any]:
    """``dtype`` in the byte order of the ``bytes`` codec's ``endian``: a structured dtype's
    multi-byte fields too (the spec's, and zarr's from 3.3; zarr <= 3.2 ignored ``endian`` for
    structured dtypes), never raw bytes (``V``) or objects."""
    if endian is None or dtype.itemsize <= 1 or dtype.kind == "O":
        return dtype
    if dtype.kind == "V" and dtype.fields is None:
        return dtype
    return dtype.newbyteorder("<" if endian == "little" else ">")


def _plan_v3(
    codecs: tuple[Any, ...], shape: tuple[int, ...], dtype: np.dtype[Any], spec: Any
) -> _Plan:
    descs = [_zarr_compat.describe_codec(c) for c in codecs]
    array_array = [d for d in descs if d.role == "array_array"]
    array_bytes = [d for d in descs if d.role == "array_bytes"]
    bytes_bytes = [d for d in descs if d.role == "bytes_bytes"]
    if not array_array and len(array_bytes) == 1:
        ab = array_bytes[0]
        if ab.kind == "bytes" and all(d.kind in ("crc32c", "numcodecs") for d in bytes_bytes):
            steps = [
                _Step("crc32c") if d.kind == "crc32c" else _Step("numcodecs", d.numcodec_config)
                for d in reversed(bytes_bytes)
            ]
            return _NumcodecsPlan(shape, _with_endian(dtype, ab.endian), "C", steps)
        if ab.kind == "sharding" and not bytes_bytes:
            layout = _zarr_compat.sharding_layout(ab.codec)
            inner_spec = _zarr_compat.inner_chunk_spec(ab.codec, spec)
            inner = _plan_v3(layout.codecs, layout.chunk_shape, dtype, inner_spec)
            return _ShardPlan(shape, ab.codec, layout, inner)
    return _ZarrPlan(shape, codecs, spec)


def _plan_v2(metadata: Any, shape: tuple[int, ...]) -> _Plan:
    compressor, filters, order = _zarr_compat.v2_chunk_codecs(metadata)
    steps = (
        [] if compressor is None else [_Step("numcodecs", _zarr_compat.numcodec_config(compressor))]
    )
    return _NumcodecsPlan(
        shape,
        _zarr_compat.native_dtype(metadata),
        "F" if order == "F" else "C",
        steps,
        [_zarr_compat.numcodec_config(f) for f in filters],
    )


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


class ChunkDecoder:
    """Decodes the stored objects of one array (built once per geometry; thread-safe; immutable).

    The plan is fixed at construction; per-thread state (numcodecs codec instances and the
    scratch buffer) lives in a ``threading.local``, so any number of threads may call
    :meth:`decode_into` concurrently for different destinations.
    """

    def __init__(self, geom: ArrayGeometry) -> None:
        metadata = geom.metadata
        if metadata is None:
            raise ValueError(f"{geom.path}: the geometry was built without zarr metadata")
        self._geom = geom.base
        fill = geom.fill_value
        #: what zarr reads for a value never written (an absent inner chunk of a shard is
        #: decoded from it with the stored values around it)
        self._stored_fill: Any = _zarr_compat.default_fill_value(metadata) if fill is None else fill
        #: how stored values decode (CF mask and scale), applied as each object is written
        self._cf = geom.cf
        #: what an absent stored object reads as: the fill value, decoded
        self._fill: Any = (
            self._stored_fill if self._cf is None else self._cf.decoded_fill(self._stored_fill)
        )
        if geom.zarr_format == 2:
            self._plan = _plan_v2(metadata, geom.chunks)
        else:
            spec = _zarr_compat.chunk_spec(metadata, geom.chunks)
            dtype = _zarr_compat.native_dtype(metadata)
            self._plan = _plan_v3(_zarr_compat.v3_codecs(metadata), geom.chunks, dtype, spec)
        self._local = threading.local()
        self._crops: dict[tuple[int, ...], tuple[slice, ...]] = {}  # by destination shape
        self._stats = _Stats()
        self._scratch_lock = threading.Lock()

    def __reduce__(self) -> tuple[type[ChunkDecoder], tuple[ArrayGeometry]]:
        """Pickles as its geometry (per-thread state is rebuilt on the other side)."""
        return (ChunkDecoder, (self._geom,))

    @property
    def fill_value(self) -> Any:
        """What a missing stored object reads as (the array's fill value, as zarr reads it)."""
        return self._fill

    @property
    def geometry(self) -> ArrayGeometry:
        """The (unshifted) array this decoder decodes."""
        return self._geom

    @property
    def strategy(self) -> str:
        """``"numcodecs"``, ``"sharded"`` (inner chunks: :attr:`inner_strategy`) or ``"zarr"``."""
        return self._plan.strategy

    @property
    def inner_strategy(self) -> str:
        """The plan of a shard's inner chunks (the same as :attr:`strategy` when not sharded)."""
        plan = self._plan
        return plan.inner.strategy if isinstance(plan, _ShardPlan) else plan.strategy

    @property
    def inplace_capable(self) -> bool:
        """True when whole, contiguous chunks are decompressed straight into ``out``."""
        plan = self._plan
        if isinstance(plan, _ShardPlan):
            plan = plan.inner
        return isinstance(plan, _NumcodecsPlan) and plan.inplace_capable

    def decodes_in_place(
        self, geom: ArrayGeometry, slot: ArrayGeometry, level_major: bool = False
    ) -> bool:
        """Whether every stored object of ``geom`` (this decoder's array) is decoded straight
        into its slot or batch row, ``slot`` being what a slot holds: whole unsharded chunks,
        none at an edge, in the stored native dtype and C order, no filter, no CF decoding, a
        slot of the whole chunk, the sample axis first (or one sample per chunk), the whole
        field in each object (elsewhere it is strided in a sample-first slot: before
        2026-12-07 a tiled field was said to decode in place, counted no scratch), or one level
        per object (:attr:`ArrayGeometry.one_level_per_object`) into a ``level_major`` slot
        (:mod:`~insitubatch_nodes.pool`: one contiguous run each). Such an array takes no
        decode scratch; any other may (one object per thread)."""
        base = geom.base
        plan = self._plan
        return (
            isinstance(plan, _NumcodecsPlan)
            and plan.inplace_capable
            and plan.order == "C"
            and slot == base
            and base.dtype.isnative
            and base.cf is None
            and all(n % c == 0 for n, c in zip(base.shape, base.chunks, strict=True))
            and (base.sample_axis == 0 or base.samples_per_chunk == 1)
            and (base.tile_shape == base.field_shape or (base.one_level_per_object and level_major))
        )

    # -- per-thread state ----------------------------------------------------------------------
    def _codec(self, step: _Step) -> Any:
        """This thread's numcodecs codec instance for ``step``."""
        codecs: dict[int, Any] | None = getattr(self._local, "codecs", None)
        if codecs is None:
            codecs = self._local.codecs = {}
        codec = codecs.get(id(step))
        if codec is None:
            codec = codecs[id(step)] = numcodecs.get_codec(dict(step.config or {}))
        return codec

    def _scratch(self, nbytes: int, name: str = "scratch") -> np.ndarray:
        """This thread's scratch buffer ``name``, at least ``nbytes`` long (grown, never
        shrunk; counted in ``scratch_bytes``)."""
        buf: np.ndarray | None = getattr(self._local, name, None)
        if buf is None or buf.nbytes < nbytes:
            old = 0 if buf is None else buf.nbytes
            buf = np.empty(max(nbytes, SCRATCH_MIN_BYTES), dtype=_U8)
            setattr(self._local, name, buf)
            with self._scratch_lock:
                self._stats.scratch_bytes += buf.nbytes - old
        return buf[:nbytes]

    @property
    def scratch_bytes(self) -> int:
        """Scratch memory this decoder holds over all threads (at most one buffer per thread,
        each at most the largest decoded stored object it needed scratch for)."""
        return self._stats.scratch_bytes

    # -- the one public operation --------------------------------------------------------------
    def decode_into(
        self,
        raw: bytes | memoryview | None,
        out: np.ndarray,
        chunk_index: int,
        tile: tuple[int, ...],
    ) -> None:
        """Decode the stored object (chunk_index, tile) from `raw` into `out`.

        `out` is the region of the caller's slot that this object covers, in *sample-axis-first
        logical order*: shape ``(n_valid_samples_in_this_chunk, *tile_extent)`` where
        ``tile_extent`` is the extent of this tile within ``inner_shape`` (edge tiles/chunks are
        smaller than the stored chunk shape: zarr stores full-size chunks and the decoder crops).
        The caller's slot for a chunk is a C-contiguous array of shape
        ``(samples_per_chunk, *inner_shape)``; `out` is a view into it (possibly non-contiguous
        when the field is tiled). ``raw=None`` means the object is missing in the store: `out`
        is filled with the fill value.

        Raises ``ValueError`` when `out` has the wrong shape, ``IndexError`` for a chunk index
        out of range, and :class:`DecodeError` (the cause chained) on corrupt input.
        """
        geom = self._geom
        start, stop = geom.chunk_range(chunk_index)
        field_axes = geom.field_axes
        tile = tuple(tile) or (0,) * len(field_axes)
        if len(tile) != len(field_axes) or any(
            not 0 <= t < n for t, n in zip(tile, geom.tile_grid, strict=True)
        ):
            raise IndexError(f"{geom.path}: tile {tile} not in the tile grid {geom.tile_grid}")
        extent = (stop - start, *(s.stop - s.start for s in geom.tile_slices(tile)))
        if out.shape != extent:
            raise ValueError(
                f"{geom.path}: out has shape {out.shape}, stored object ({chunk_index}, {tile}) "
                f"covers {extent} (samples first)"
            )
        self.decode_trusted(raw, out, chunk_index, tile)

    def decode_trusted(
        self,
        raw: bytes | memoryview | np.ndarray | None,
        out: np.ndarray,
        chunk_index: int,
        tile: tuple[int, ...],
    ) -> None:
        """:meth:`decode_into` without its argument checks, for callers that checked the
        shape of ``out`` once for every object of its kind (the fetch stage's fill runs):
        ``out`` must be exactly the region :meth:`decode_into` would be given."""
        if raw is None:
            out[...] = self._fill
            self._stats.filled += 1
            return
        cf = self._cf
        if cf is None:
            self._decode_stored(raw, out, chunk_index, tile)
        elif cf.in_place:  # masked only: decoded straight into ``out``, then masked there
            self._decode_stored(raw, out, chunk_index, tile)
            cf.decode_into(out, out)
        else:  # stored values aside (a thread's buffer), unpacked into ``out`` in one pass
            packed = self._packed(out.shape, cf.stored)
            self._decode_stored(raw, packed, chunk_index, tile)
            cf.decode_into(packed, out)

    def _packed(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """This thread's buffer for an object's stored values, ``shape`` of ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self._scratch(nbytes, "packed").view(dtype).reshape(shape)

    def _decode_stored(
        self,
        raw: bytes | memoryview | np.ndarray,
        out: np.ndarray,
        chunk_index: int,
        tile: tuple[int, ...],
    ) -> None:
        """Decode the stored values of an object into ``out`` (of the stored dtype, or one
        they cast to safely)."""
        geom = self._geom
        if geom.product is not None:  # a block's rows in the stored object's axis order
            dest = geom.product.slot_view(out, chunk_index, geom.field_axes, geom.ndim)
        else:
            axis = geom.sample_axis
            dest = out if axis == 0 else np.moveaxis(out, 0, axis)
        crop = self._crops.get(dest.shape)
        if crop is None:
            crop = self._crops[dest.shape] = tuple(slice(0, n) for n in dest.shape)
        try:
            self._plan.decode(_as_u8(raw), dest, crop, self)
        except Exception as exc:
            raise DecodeError(
                f"{self._geom.path}: cannot decode stored object ({chunk_index}, {tile}): {exc}"
            ) from exc
