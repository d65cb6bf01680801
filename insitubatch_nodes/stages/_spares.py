"""The stored-layout decode buffers of chunks that their chunk transforms reshape.

Under a reshaping chunk transform (``Coarsen``) the slot holds the transform's output, so a
chunk's stored objects are decoded elsewhere first: into a buffer of the stored, sample-first
layout, which the transform then reads. :class:`SpareBuffers` keeps the idle ones (at most
``max_idle`` per array and length). A chunk's :class:`SpareRegion` takes its buffer when its
first object is written (decoded, or filled as bad) on a decode thread, not when its fill is
queued, and gives it back once the chunk's transform has run: a buffer is live only while its
chunk is being decoded. Before 2026-12-07 it was taken at the admission, and every admitted
chunk still waiting to be read held one (17 to 23 whole chunks at 2 decode threads, where the
memory check counted the 2 idle ones).

From a store read by GETs the objects of a chunk land apart, and a run decoded each as it
landed: a chunk stored in several objects held its buffer from its first object's decode to
its last one's GET, while the decode threads went on to other chunks (11 buffers live at once
at 2 decode threads, where 4 were counted; ``tests/test_memrule3_trial.py``). Its objects now
wait, landed, until the last has (:meth:`SpareRegion.park`), and reach the decode threads
together, as a local store's do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry

__all__ = ["SpareBuffers", "SpareRegion", "SpareView", "as_array", "land_together"]

_T = TypeVar("_T")


class SpareBuffers:
    """Idle decode buffers of the stored layout, for chunks their transforms reshape (the slot
    holds the output; the stored chunk is decoded elsewhere first): at most ``max_idle`` kept
    per array and length, any thread."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max_idle
        self._free: dict[tuple[str, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0  # held idle
        self.live_bytes = 0  # taken, not given back yet (chunks being decoded)

    def take(self, geom: ArrayGeometry, n: int) -> np.ndarray:
        """A buffer for ``n`` samples of ``geom`` as stored (an idle one, else a new one)."""
        with self._lock:
            free = self._free.get((geom.path, n))
            if free:
                buf = free.pop()
                self.nbytes -= buf.nbytes
                self.live_bytes += buf.nbytes
                return buf
        buf = np.empty((n, *geom.inner_shape), dtype=geom.dtype)
        with self._lock:
            self.live_bytes += buf.nbytes
        return buf

    def give(self, path: str, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later :meth:`take` (dropped when ``max_idle`` are kept)."""
        with self._lock:
            self.live_bytes -= buf.nbytes
            free = self._free.setdefault((path, buf.shape[0]), [])
            if len(free) < self.max_idle:
                free.append(buf)
                self.nbytes += buf.nbytes


class SpareRegion:
    """Where one reshaped chunk's ``n`` samples decode, in the stored layout: no buffer until
    :meth:`buffer` is first called (by the decode thread that writes its first object; ``lock``,
    its job's, orders two threads writing two of its objects), then one from ``spares`` until
    :meth:`release`. Indexing it with a tile's box gives the :class:`SpareView` its unit
    decodes into."""

    __slots__ = ("_geom", "_lock", "_n", "_parked", "_parks", "_spares", "buf")

    def __init__(
        self, spares: SpareBuffers, geom: ArrayGeometry, n: int, lock: threading.Lock
    ) -> None:
        self._spares, self._geom, self._n, self._lock = spares, geom, n, lock
        self.buf: np.ndarray | None = None  # taken: some object of the chunk was written
        self._parked: list[Any] = []  # landed objects waiting for the chunk's last (park)
        self._parks: bool | None = None  # whether its objects wait for the last (park)

    def __getitem__(self, box: Any) -> SpareView:
        return SpareView(self, box)

    def buffer(self) -> np.ndarray:
        """The chunk's buffer, taken now if no object of it was written yet."""
        buf = self.buf
        if buf is None:
            with self._lock:
                buf = self.buf
                if buf is None:
                    buf = self.buf = self._spares.take(self._geom, self._n)
        return buf

    def park(self, item: _T, entry: Any, most: int) -> list[_T]:
        """A GET of one of the chunk's objects ended (``item``: it, landed, with its permit):
        the objects to hand the decode threads now. None until the last of them has landed
        too (``entry.tiles_left`` at the first landing, read under the job's lock: none of
        them handled yet), then all at once, so that the buffer is taken when the chunk's
        decoding starts and given back when it ends. A chunk of more objects than ``most``
        (``max_inflight``) is not parked (its objects go at once, as they land): the ones
        parked would hold every GET permit, and the last would wait for one of theirs."""
        with self._lock:
            if self._parks is None:  # decided once, before any of its objects is handled
                self._parks = entry.tiles_left <= most
            if not self._parks:
                return [item]
            self._parked.append(item)
            if len(self._parked) < entry.tiles_left:
                return []
            parked, self._parked = self._parked, []
        return parked

    def release(self) -> None:
        """Give the buffer back (its chunk is done: transformed, or failed); none taken: no-op."""
        buf, self.buf = self.buf, None
        if buf is not None:
            self._spares.give(self._geom.path, buf)


class SpareView(NamedTuple):
    """One stored object's rectangle (``box``) of a :class:`SpareRegion`: a unit's ``out``."""

    region: SpareRegion
    box: Any

    def array(self) -> np.ndarray:
        """The rectangle itself (taking the region's buffer if it has none yet)."""
        return self.region.buffer()[self.box]


def as_array(out: np.ndarray | SpareView) -> np.ndarray:
    """``out`` as the array an object is written into (a spare's view: its rectangle, taken)."""
    return out if isinstance(out, np.ndarray) else out.array()


def land_together(
    land: Callable[[Any, list[Any]], None], most: int, job: Any, items: Sequence[Any]
) -> None:
    """A store read by GETs hands each landed object here (``items``: the fill's ``Queued``
    of ``job``): ``land(job, ready)`` with them, but the objects of a chunk decoded into a
    spare (a :class:`SpareView`) wait until the chunk's last has landed and go together
    (:meth:`SpareRegion.park`; ``most``: ``max_inflight``)."""
    ready: list[Any] = []
    for item in items:
        out = getattr(item.work, "out", None)  # (a batch's rows decode into no spare)
        if isinstance(out, SpareView):
            ready.extend(out.region.park(item, item.work.entry, most))
        else:
            ready.append(item)
    if ready:
        land(job, ready)
