"""Slot memory and the chunk entries a pool holds.

A *slot* is the memory one resident chunk's data lives in: from a :class:`SlotBacking`
(RAM by default; the cache directory's files when one is given), shaped ``(rows, *inner)``
or level-major. A :class:`ChunkEntry` is one chunk in the pool: its slot, pins, state and
the :class:`Fill` it waits on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from insitubatch_nodes._pages import plain_pages, populated_pages

if TYPE_CHECKING:
    from pathlib import Path

    from insitubatch_nodes.cache.files import SlotFile
    from insitubatch_nodes.plan.ledger import ChunkKey

log = logging.getLogger(__name__)

__all__ = ["ChunkEntry", "Fill", "RamBacking", "SlotBacking", "is_level_major"]


UNMAPPED = np.empty(0, dtype=np.uint8)  # the slot of a disk hit until its file is mapped
SlotKey = tuple[tuple[int, ...], str, bool]  # (shape, dtype, level-major): one free list each


def is_level_major(slot: np.ndarray) -> bool:
    """Whether ``slot`` is a level-major view: C-ordered memory ``(inner[0], spc, ...)`` seen as
    ``(spc, inner[0], ...)`` (see the module docstring)."""
    return (
        slot.ndim >= 3
        and not slot.flags.c_contiguous
        and bool(slot.swapaxes(0, 1).flags.c_contiguous)
    )


def wants_level_major(shape: tuple[int, ...], level_major: bool) -> bool:
    # with a single sample or a single level both layouts are the same memory
    return level_major and len(shape) >= 3 and shape[0] > 1 and shape[1] > 1


def new_slot(
    allocate: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    level_major: bool,
) -> np.ndarray:
    """A slot of sample-first ``shape`` in the layout asked for, its memory from
    ``allocate(memory_shape, dtype)`` (a backing's ``allocate`` or ``allocate_populated``)."""
    if not level_major:
        return allocate(shape, dtype)
    return allocate((shape[1], shape[0], *shape[2:]), dtype).swapaxes(0, 1)


def slot_key(slot: np.ndarray) -> SlotKey:
    return (tuple(slot.shape), slot.dtype.str, is_level_major(slot))


class SlotBacking(Protocol):
    """Where slot memory comes from. RAM today; mmap'd files and a persistent cache plug in here.

    An optional ``in_ram`` attribute (a class attribute will do) says whether the slots are
    process memory: where it is ``True`` the build holds the pool's budget, beside the batches
    in flight and the decode scratch, to the memory the process may use
    (:mod:`~insitubatch_nodes.plan.memory_floor`), as for the default :class:`RamBacking`.
    Absent (or ``False``), the slots are taken to live elsewhere (files, a device) and are not
    checked; anything but a bool is a ``TypeError`` when the pool is made.
    """

    name: str

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A new writable C-contiguous array (contents undefined)."""
        ...

    def release(self, buffer: np.ndarray) -> None:
        """Give back a buffer obtained from :meth:`allocate` (it is no longer referenced)."""
        ...


class RamBacking:
    """Slots in anonymous process memory (:mod:`~insitubatch_nodes._pages`: no huge pages asked
    for, whose first faults a VM may make several times as slow).

    :meth:`allocate` returns untouched memory (its pages fault in on first write, on whichever
    thread writes). :meth:`allocate_populated` returns memory whose pages are already faulted
    in, in one pass of the kernel several times as fast as first writes: the pool uses it to
    pay for slot memory ahead of need (:meth:`ChunkPool.reserve
    <insitubatch_nodes.pool.ChunkPool.reserve>`). A slot smaller than
    :data:`~insitubatch_nodes._pages.OWN_MAPPING_MIN_BYTES` is taken from the heap.
    """

    name = "ram"
    in_ram = True  # (the build's memory check counts these slots: see SlotBacking)

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return plain_pages(shape, dtype)

    def allocate_populated(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return populated_pages(shape, dtype)

    def release(self, buffer: np.ndarray) -> None:
        del buffer


class Fill:
    """The completion of one fill: a set of chunk entries (and any other work) filled together.

    A fetch stage fills the chunks one batch first needs as one unit of work; every entry it
    admits for that batch shares one ``Fill``, so completion, waking and waiting happen once
    per group of chunks, not once per chunk. ``members`` counts what must resolve (entries,
    plus the work the owner adds); :meth:`resolve` is called once per member (any thread) and
    the last one completes ``future``. A member that failed says so on its entry (``error``):
    the future itself always completes with ``None``.
    """

    __slots__ = ("_left", "_lock", "future")

    def __init__(self, members: int = 1) -> None:
        self.future: Future[None] = Future()
        self._left = members
        self._lock = threading.Lock()
        if members <= 0:
            self.future.set_result(None)

    def add(self, members: int) -> None:
        """Count ``members`` more (before the fill can complete)."""
        with self._lock:
            self._left += members

    def resolve(self, members: int = 1) -> None:
        with self._lock:
            self._left -= members
            done = self._left == 0
        if done:
            self.future.set_result(None)

    @property
    def done(self) -> bool:
        return self.future.done()


_DONE = Fill(0)  # the fill of an entry that was never filled by a job (already resolved)

PENDING, READY, FAILED = 0, 1, 2  # ChunkEntry.state


class _Ready:
    """``entry.ready``: the ``concurrent.futures.Future``-like face of one entry's state."""

    __slots__ = ("_entry",)

    def __init__(self, entry: ChunkEntry) -> None:
        self._entry = entry

    def done(self) -> bool:
        return self._entry.state != PENDING

    def exception(self, timeout: float | None = None) -> BaseException | None:
        entry = self._entry
        if entry.state == PENDING:
            entry.fill.future.result(timeout)  # raises TimeoutError when it stays pending
            if entry.state == PENDING:  # its fill completed without resolving it
                raise RuntimeError(f"chunk {entry.key} was left unresolved by its fill")
        return entry.error

    def result(self, timeout: float | None = None) -> None:
        error = self.exception(timeout)
        if error is not None:
            raise error


class ChunkEntry:
    """One resident (or arriving) chunk.

    ``state`` goes once from ``PENDING`` to ``READY`` (the slot holds the data) or ``FAILED``
    (``error`` says why: a read, decode or transform error, or :class:`FillCancelled`), and
    ``fill`` completes no earlier than that: wait on ``fill.future``, then read ``state``.
    ``ready`` offers the same as a future (``done()``, ``result(timeout)``).
    """

    __slots__ = (
        "bad_tiles",
        "cached",
        "corrupt",
        "detached",
        "error",
        "file",
        "fill",
        "key",
        "nbytes",
        "pins",
        "recycle",
        "slot",
        "slot_returned",
        "state",
        "tiles_left",
        "valid",
    )

    def __init__(
        self,
        key: ChunkKey,
        slot: np.ndarray,
        nbytes: int,
        pins: int = 0,
        recycle: bool = True,
        fill: Fill | None = None,
    ) -> None:
        self.key = key
        self.slot = slot
        self.nbytes = nbytes
        self.pins = pins
        self.recycle = recycle  # the slot goes back to a free list (False: a file's mapping)
        self.fill = Fill() if fill is None else fill
        self.state = PENDING
        self.error: BaseException | None = None
        self.detached = False  # dropped from the index while its fill was still running
        self.slot_returned = False  # the slot went back to the free list
        # tiles filled in place of a stored object that could not be read or decoded
        # (on_bad_chunk="nan"): such a chunk is not kept resident once nothing pins it
        self.bad_tiles: list[tuple[int, ...]] = []
        self.file: SlotFile | None = None  # the cache file this slot becomes once filled
        self.valid: int | None = None  # valid samples the chunk holds (None: the slot's length)
        # a hit on disk: (file, shape, dtype) its fill maps instead of fetching (``slot`` is
        # empty until then)
        self.cached: tuple[Path, tuple[int, ...], np.dtype[Any]] | None = None
        self.corrupt = False  # its cached file failed its check when revived (then fetched)
        self.tiles_left = 0  # stored objects still to land (kept by the filling job)

    @property
    def ready(self) -> _Ready:
        return _Ready(self)

    def __repr__(self) -> str:
        state = ("pending", "ready", "failed")[self.state]
        return f"ChunkEntry({self.key!r}, {state}, pins={self.pins})"
