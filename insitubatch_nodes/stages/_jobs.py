"""What the fetch stage's parts hand each other: a batch's fill job, its rows and units, what
admission keeps per batch, and the item the fetch stage yields."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.routing import split_routed
from insitubatch_nodes.io.selection import Held, held_boxes
from insitubatch_nodes.plan.ledger import BatchPlan, ChunkKey
from insitubatch_nodes.plan.patches import unit_chunk_tile
from insitubatch_nodes.slots import PENDING, ChunkEntry, Fill
from insitubatch_nodes.stages._spares import SpareRegion, SpareView
from insitubatch_nodes.stages.buffers import LentBatch

__all__ = [
    "REVIVE",
    "ROWS_PER_ITEM",
    "SMALL_OBJECT_S",
    "ArrayFill",
    "FetchedBatch",
    "FillJob",
    "KeepingDecoder",
    "PendingBatch",
    "PlanGroup",
    "Queued",
    "Rows",
    "SlotLayout",
    "SlotRequest",
    "Unit",
]


class ArrayFill:
    """What filling one array's stored objects needs, worked out once per array: its decoder,
    its key template, its tiles and the rectangle each covers."""

    __slots__ = (
        "_missing_raises",
        "decoder",
        "fill_value",
        "geom",
        "held",
        "listed",
        "member_key",
        "missing",
        "path",
        "routed",
        "row_key",
        "template",
        "tiles",
        "units",
        "whole",
    )

    def __init__(
        self,
        geom: ArrayGeometry,
        decoder: ChunkDecoder,
        units: bool = False,
        held: Held | None = None,
        routed: Sequence[str] = (),
        listed: bool = False,
        missing_raises: bool = False,
    ) -> None:
        self.geom = geom
        #: an absent object fails its read (:meth:`gone_error`) instead of reading as the fill
        #: value: the store was listed when the plan was built (``missing_objects="drop"``: the
        #: plan reads no object found absent then, so an absent one now was deleted since), or
        #: ``missing_raises``: zarr's ``array.read_missing_chunks`` option is off (zarr 3.2 on),
        #: so that zarr itself raises ``ChunkNotFoundError`` for an absent chunk
        self.listed = listed or missing_raises
        self._missing_raises = missing_raises and not listed
        #: the descriptions of a routing store's stores (a collection in several stores)
        self.routed = tuple(routed)
        #: a patched array: a pool entry's key names a unit (one stored tile), not a chunk
        self.units = units
        self.path = geom.path
        self.decoder: ChunkDecoder | KeepingDecoder = decoder
        self.template = geom.key_template
        self.held = held
        #: every tile read and the (sample-first) index of its rectangle within a chunk's
        #: region: all of them, or the ``held`` ones side by side (see io/selection)
        if held is None:
            self.tiles = [(tuple(t), (slice(None), *geom.tile_slices(t))) for t in geom.tiles()]
        else:
            boxes = held_boxes(held, geom.tile_shape, geom.field_shape)
            self.tiles = [(t, (slice(None), *box)) for t, box, _ in boxes]
            kept = {t: within for t, _, within in boxes if any(w is not None for w in within)}
            if kept:  # tiles of which the slot keeps some indices: decoded aside, then taken
                self.decoder = KeepingDecoder(decoder, kept)
        self.whole = geom.n_tiles == 1  # one stored object covers the whole field
        self.fill_value: Any = np.nan if geom.dtype.kind in "fc" else decoder.fill_value
        self.missing = False  # the last object read of this array was missing (a hint)
        #: ``(before, after)``: the key of a whole chunk is ``before + str(chunk) + after``
        self.row_key: tuple[str, str] | None = None
        #: a collection's whole-chunk keys: ``member_key(chunk)`` (its member's own object)
        self.member_key: Any = None
        if self.whole and geom.members is not None and geom.metadata is not None:
            self.member_key = geom.members.whole_chunk_key(
                geom.metadata, geom.ndim, geom.sample_axis
            )
        if self.whole and self.template is not None:
            coords: list[Any] = ["0"] * geom.ndim
            coords[geom.sample_axis] = "\x00"
            parts = self.template.format(*coords).split("\x00")
            if len(parts) == 2:
                self.row_key = (parts[0], parts[1])

    def read_error(
        self, chunk: int, tile: tuple[int, ...], key: str, what: str, store: str
    ) -> ChunkReadError:
        """The error for stored object ``key`` (of ``chunk``, ``tile``) that could not be read
        or decoded (``what``): on a collection it names the member, and a key of one of
        several stores says which store and its key there."""
        member, located = "", ""
        members = self.geom.members
        if members is not None:
            start = self.geom.chunk_range(chunk)[0]
            member = members.names[int(members.member_of(np.array([start]))[0])]
        if self.routed:
            try:
                index, rest = split_routed(key)
                located = f"key {rest!r} of routed store s{index} ({self.routed[index]})"
            except (KeyError, IndexError):
                located = ""
        return ChunkReadError(
            self.path, chunk, tile, key, what, store, member=member, located=located
        )

    def gone_error(self, chunk: int, tile: tuple[int, ...], key: str, store: str) -> ChunkReadError:
        """The error for stored object ``key`` that the read finds absent although the store's
        listing held it when the plan was built (:attr:`listed`): it was deleted since, and
        reading it as the fill value would deliver the rows ``missing_objects="drop"`` drops."""
        error = self.read_error(chunk, tile, key, "read", store)
        if self._missing_raises:
            error.__cause__ = FileNotFoundError(
                f"{key!r} is absent from the store and zarr's option array.read_missing_chunks "
                "is off (zarr raises ChunkNotFoundError for it), so it is not read as the fill "
                "value. Restore the object; or read absent objects as the fill value, as zarr "
                "does with zarr.config.set({'array.read_missing_chunks': True}); or pass "
                "missing_objects='drop' to leave out the samples that read absent objects"
            )
            return error
        error.__cause__ = FileNotFoundError(
            f"{key!r} was in the store's listing when the pipeline was built "
            "(missing_objects='drop') and is absent now: the store changed during the run. "
            "Restore the object, or build the pipeline again (its listing then drops the "
            "anchors that read it; a state saved before is refused, as the epoch's samples "
            "differ)"
        )
        return error

    def decodes_in_place(self, slot: ArrayGeometry, level_major: bool) -> bool:
        """Whether no stored object of this array takes its
        :class:`~insitubatch_nodes.io.decode.ChunkDecoder`'s scratch (``slot`` being what a slot
        holds, ``level_major`` its layout): each is decoded straight into its slot
        (``ChunkDecoder.decodes_in_place``), or, where the slot keeps some indices of every
        tile read (a :class:`KeepingDecoder`), straight into that decoder's buffer of the whole
        object, which :meth:`KeepingDecoder.most_aside_bytes` counts (before 2026-12-07 such
        an array was counted a stored object per thread twice: the buffer, and scratch the
        whole-object decode never takes)."""
        decoder = self.decoder
        if not isinstance(decoder, KeepingDecoder):
            return decoder.decodes_in_place(self.geom, slot, level_major)
        if not all(decoder.keeps_part_of(tile) for tile, _ in self.tiles):
            return False  # (a tile kept whole is decoded into a part of the slot)
        # a buffer of a whole object is one contiguous run, as a level-major slot's object is
        base = self.geom.base
        return decoder.inner.decodes_in_place(self.geom, base, level_major=True)

    def unit_parts(self, unit: int) -> tuple[int, tuple[int, ...], tuple[slice, ...]]:
        """``(chunk, tile, box)`` of unit ``unit``: the stored object it is and where that
        object's valid rectangle lies in the unit's slot (an edge tile or chunk fills part; a
        held axis, the indices the slot keeps)."""
        chunk, tile = unit_chunk_tile(self.geom, unit)
        start, stop = self.geom.chunk_range(chunk)
        held = self.held or (None,) * len(tile)
        box = (
            slice(0, stop - start),
            *(
                slice(0, s.stop - s.start if h is None else len(h))
                for s, h in zip(self.geom.tile_slices(tile), held, strict=True)
            ),
        )
        return chunk, tile, box

    def entry_index(self, chunk: int, tile: tuple[int, ...]) -> int:
        """The index of the pool entry (and cache key) stored object ``tile`` of ``chunk``
        fills: the chunk, or for a patched array its unit (``chunk * n_tiles + tile``)."""
        if not self.units:
            return chunk
        return chunk * self.geom.n_tiles + int(np.ravel_multi_index(tile, self.geom.tile_grid))

    def key(self, chunk: int, tile: tuple[int, ...]) -> str:
        if self.template is None:
            return self.geom.store_key(chunk, tile)
        coords = list(tile)
        coords.insert(self.geom.sample_axis, chunk)
        return self.template.format(*coords)


class KeepingDecoder:
    """A :class:`~insitubatch_nodes.io.decode.ChunkDecoder` for slots that keep only some
    indices of a stored object (:func:`~insitubatch_nodes.io.selection.held_boxes`): such an
    object is decoded whole into this thread's buffer, then the kept indices are copied into
    the slot while they are hot in cache; other objects decode straight into the slot. What
    each tile keeps (its rectangle's extent, the axes taken and their indices) is worked out
    once, here: a call does the decode and the copy, and little Python beside (it runs once
    per stored object)."""

    __slots__ = ("_inner", "_kept", "_local", "_lock", "aside_bytes")

    def __init__(
        self, inner: ChunkDecoder, kept: Mapping[tuple[int, ...], tuple[np.ndarray | None, ...]]
    ) -> None:
        self._inner = inner
        geom = inner.geometry
        #: tile -> (its rectangle's extent, (slot axis, indices kept) per field axis that
        #: keeps only some)
        self._kept = {
            tuple(tile): (
                tuple(s.stop - s.start for s in geom.tile_slices(tuple(tile))),
                tuple((1 + a, w) for a, w in enumerate(within) if w is not None),
            )
            for tile, within in kept.items()
        }
        self._local = threading.local()
        self._lock = threading.Lock()
        #: the buffers objects are decoded into aside, over all threads (one per thread and
        #: object shape; the inner decoder's own scratch is its ``scratch_bytes``)
        self.aside_bytes = 0

    @property
    def fill_value(self) -> Any:
        return self._inner.fill_value

    @property
    def inner(self) -> ChunkDecoder:
        """The decoder of the array's stored objects, which this one decodes whole."""
        return self._inner

    def keeps_part_of(self, tile: tuple[int, ...]) -> bool:
        """Whether the slots keep only some indices of ``tile``'s objects (decoded aside
        whole first); other tiles decode straight into the slot."""
        return tuple(tile) in self._kept

    def most_aside_bytes(self, threads: int) -> int:
        """The most :attr:`aside_bytes` grows to over ``threads`` decode threads: per thread, a
        buffer per object shape — each kept tile's extent, at a whole chunk's samples and at
        an edge chunk's (what the build's memory check counts beside the inner decoder's
        scratch; before 2026-12-07 it counted neither shape)."""
        geom = self._inner.geometry
        lengths = {geom.samples_per_chunk, geom.n_samples % geom.samples_per_chunk} - {0}
        extents = {extent for extent, _ in self._kept.values()}
        per_thread = sum(n * math.prod(e) for n in lengths for e in extents)
        return threads * per_thread * geom.dtype.itemsize

    def decode_trusted(
        self, raw: Any, out: np.ndarray, chunk_index: int, tile: tuple[int, ...]
    ) -> None:
        """``ChunkDecoder.decode_trusted`` into ``out``, the kept indices of the object's
        rectangle (all of it for a tile kept whole)."""
        kept = self._kept.get(tile)
        if kept is None or raw is None:  # (a missing object: the fill value, straight)
            self._inner.decode_trusted(raw, out, chunk_index, tile)
            return
        extent, axes = kept
        try:
            buffers: dict[tuple[int, ...], np.ndarray] = self._local.buffers
        except AttributeError:
            buffers = self._local.buffers = {}
        shape = (out.shape[0], *extent)
        whole = buffers.get(shape)
        if whole is None:
            whole = buffers[shape] = np.empty(shape, self._inner.geometry.dtype)
            with self._lock:
                self.aside_bytes += whole.nbytes
        self._inner.decode_trusted(raw, whole, chunk_index, tile)
        if len(axes) == 1:
            axis, w = axes[0]
            np.take(whole, w, axis=axis, out=out, mode="clip")
            return
        picked = whole
        for axis, w in axes:
            picked = np.take(picked, w, axis=axis, mode="clip")
        out[...] = picked


class Unit(NamedTuple):
    """One stored object to fill: ``tile`` of ``chunk`` of ``array``, decoded into ``out``
    (a rectangle of ``entry``'s slot, or of a batch row when ``entry`` is ``None``: ``row``
    is then that row's index in its batch, for the trace)."""

    array: ArrayFill
    chunk: int
    tile: tuple[int, ...]
    out: np.ndarray | SpareView
    entry: ChunkEntry | None
    row: int = -1


class Queued(NamedTuple):
    """A unit (or rows) waiting for the decode threads. ``landed``: when its GET ended (0.0:
    the run reads the object itself, a local store); ``raw``: the GET's bytes; ``error``: the
    GET's error; ``permit``: it holds one of the GETs' in-flight permits."""

    work: Unit | Rows
    landed: float = 0.0
    raw: Any = None
    error: BaseException | None = None
    permit: bool = False


class SlotLayout(NamedTuple):
    """How the fetch stage requests the slots of one array (worked out once per array)."""

    shape: tuple[int, ...]  # a slot's shape, sample axis first
    dtype: np.dtype[Any]
    level_major: bool  # stored one level per object: level-major slots (see the pool)
    samples_per_chunk: int
    n_samples: int
    units_per_chunk: int  # pool keys per chunk: stored tiles of a patched array, else 1
    #: valid samples of each chunk on product sample axes (an edge block's padding is no
    #: sample; see io/product), else ``None``
    counts: np.ndarray | None = None


class SlotRequest(NamedTuple):
    """One pool chunk to admit, as :meth:`~insitubatch_nodes.pool.ChunkPool.acquire_many`
    takes it (``valid``: samples the chunk holds)."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    valid: int
    level_major: bool


REVIVE: tuple[int, ...] = (-1,)  # the tile of a unit that maps a persistent-cache file
ROWS_PER_ITEM = 8  # chunks one queued item of rows decoded in place holds (per array)
#: Stored objects that take the decode threads less than this (read + decode) are filled by
#: one thread at a time: a second thread would only pass the interpreter lock back and forth.
SMALL_OBJECT_S = 40e-6


class Rows:
    """Chunks of one array (one sample each) decoded straight into rows of a batch array:
    chunk ``chunks[i]`` into ``out[rows[i]]``, ``out`` being part ``label`` of the batch
    ``lent`` (its buffers taken when a decode thread first asks for :attr:`out`). One queued
    item: a run takes all of them, with no Python object per stored object (what keeps sixty
    arrays a sample cheap)."""

    __slots__ = ("array", "chunks", "label", "lent", "objects", "rows")

    def __init__(
        self, array: ArrayFill, lent: LentBatch, label: str, chunks: list[int], rows: list[int]
    ):
        self.array, self.lent, self.label, self.chunks, self.rows = array, lent, label, chunks, rows
        self.objects = len(chunks) * len(array.tiles)

    @property
    def out(self) -> np.ndarray:
        """The batch array these rows land in (taking the batch's buffers on first use)."""
        return self.lent.part(self.label)

    def units(self) -> list[Unit]:
        """One unit per stored object (for GETs, which go one by one)."""
        array, out = self.array, self.out
        units: list[Unit] = []
        for chunk, r in zip(self.chunks, self.rows, strict=True):
            row = out[r : r + 1]
            units.extend(
                Unit(array, chunk, tile, row if array.whole else row[box], None, r)
                for tile, box in array.tiles
            )
        return units

    def store_keys(self) -> list[str]:
        return [self.array.key(c, t) for c in self.chunks for t, _ in self.array.tiles]


class FillJob:
    """The stored objects one admission fetches (module docstring); built on the producer
    thread, then owned by the :class:`~insitubatch_nodes.stages._fill.FillRunner`.

    ``fill`` is shared with every entry the admission pins as a miss (pass it to
    :meth:`~insitubatch_nodes.pool.ChunkPool.acquire_many`); the job itself is one of its
    members, resolved when every object has been handled. ``rows`` land in the batch arrays
    of a :class:`~insitubatch_nodes.stages.buffers.LentBatch`; ``error`` is the first error of
    a direct row (the batch fails with it).
    """

    __slots__ = (
        "__weakref__",
        "batch",
        "cancelled",
        "error",
        "fill",
        "generation",
        "left",
        "lock",
        "rows",
        "runs",
        "spares",
        "submitted",
        "ticket",
        "todo",
        "units",
    )

    def __init__(self, ticket: int, generation: int, batch: int = -1) -> None:
        self.ticket = ticket
        self.generation = generation
        self.batch = batch  # the index of the batch whose admission made it (for the trace)
        self.fill = Fill(1)
        self.units: list[Unit] = []  # stored objects of pool entries
        self.rows: list[Rows] = []  # rows decoded straight into the batch
        self.spares: dict[int, SpareRegion] = {}  # id(entry) -> its decode region (reshaping)
        self.error: BaseException | None = None
        self.cancelled = False
        self.lock = threading.Lock()
        self.todo: deque[Queued] = deque()
        self.left = 0
        self.runs = 0
        self.submitted = 0.0

    def add_entry(
        self, entry: ChunkEntry, array: ArrayFill, region: np.ndarray | SpareRegion
    ) -> None:
        """Fill ``entry`` (a miss) by this job: one unit per stored object (one for a chunk
        found in the persistent cache, whose file is mapped instead)."""
        chunk = entry.key[1]
        if entry.cached is not None:  # (a patched array's unit, too)
            entry.tiles_left = 1
            self.units.append(Unit(array, chunk, REVIVE, region[...], entry))
            return
        if array.units:  # one stored tile per slot
            chunk, tile, box = array.unit_parts(chunk)
            entry.tiles_left = 1
            self.units.append(Unit(array, chunk, tile, region[box], entry))
            return
        entry.tiles_left = len(array.tiles)
        self.units.extend(Unit(array, chunk, tile, region[box], entry) for tile, box in array.tiles)

    def add_rows(
        self, array: ArrayFill, lent: LentBatch, label: str, chunks: list[int], rows: list[int]
    ) -> None:
        """Decode chunk ``chunks[i]`` (one sample) of ``array`` straight into row ``rows[i]``
        of part ``label`` of the batch ``lent``."""
        for lo in range(0, len(chunks), ROWS_PER_ITEM):
            hi = lo + ROWS_PER_ITEM
            self.rows.append(Rows(array, lent, label, chunks[lo:hi], rows[lo:hi]))

    def skips(self, unit: Unit) -> bool:
        """Whether ``unit`` no longer needs filling: its entry failed, was resolved, or lost
        its last pin (detached); a direct row of a cancelled or failed job."""
        entry = unit.entry
        if entry is None:
            return self.cancelled or self.error is not None
        return (
            entry.state != PENDING
            or entry.error is not None
            or (entry.detached and entry.pins == 0)
        )


@dataclass(frozen=True, eq=False)
class FetchedBatch:
    """A batch plan whose chunks are admitted: ``entries`` covers every pool chunk it reads.

    ``jobs`` are the fills this batch started (wait for them too); ``arrays`` are its batch
    arrays when some rows were decoded straight into them (``direct[label]`` rows of each
    label), else ``None``. ``release()`` drops the pins of the chunks this batch reads for the
    last time; call it once the batch has been gathered. It is a no-op after the fetch node was
    reset or closed.
    """

    plan: BatchPlan
    entries: Mapping[ChunkKey, ChunkEntry]
    release: Callable[[], None]
    jobs: tuple[FillJob, ...] = ()
    arrays: Mapping[str, np.ndarray] | None = None
    direct: Mapping[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class PendingBatch:
    plan: BatchPlan
    state: dict[str, Any]  # the source's state right after this plan was pulled
    # pool chunks to admit before this batch (its first reads, plus any re-read into it when
    # it starts an epoch mid-way, see ChunkLedger.carried)
    requests: list[SlotRequest]
    job: FillJob | None = None  # built with its rows decoded in place; submitted at admission
    lent: LentBatch | None = None  # the batch its rows decoded in place land in
    rows: dict[str, int] = field(default_factory=dict)  # label -> rows decoded in place
    # group index -> the chunks decoded in place (a slot of the same chunk is not read)
    in_place: dict[int, set[int]] = field(default_factory=dict)
    admitted: int = 0  # how many of requests are admitted
    ahead_bytes: int = 0
    jobs: list[FillJob] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.admitted == len(self.requests)


@dataclass(frozen=True)
class PlanGroup:
    """How the fetch stage treats one plan group (one ledger) in this node."""

    paths: tuple[str, ...]
    nbytes: int  # slot bytes of one chunk of every path
    # path -> {view offset: the label} its single-use chunks decode into (None: all via slots)
    in_place: Mapping[str, Mapping[int, str]] | None
    row_bytes: int  # batch bytes of one direct row over every path
