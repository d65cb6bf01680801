"""Reusable arrays lent under one ownership rule: :class:`BufferPool`.

The batch buffers (:mod:`~insitubatch_nodes.stages.buffers`) keep one pool per label; a batch
transform that writes per-batch arrays (a static field cut to each row's window,
:mod:`~insitubatch_nodes.static`; the forcings' rows, :mod:`~insitubatch_nodes.forcings`) keeps
its own. An array is lent again only once nothing made
from it is alive, so a batch (or anything made from it) that you keep is never overwritten.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Any

import numpy as np

from insitubatch_nodes._pages import plain_pages
from insitubatch_nodes.io.geometry import in_native_byte_order

__all__ = ["RESERVE_WAIT_S", "BufferPool"]

#: The longest a :meth:`BufferPool.take` waits for a buffer being made ahead of need before it
#: allocates one itself (making one of a few hundred MB takes a fraction of a second).
RESERVE_WAIT_S = 2.0


class BufferPool:
    """Reusable batch buffers of one shape and dtype, lent out under an explicit ownership rule.

    Each array :meth:`take` returns is built on a *lease*: an owner object of its own (a ctypes
    view of the buffer's memory) that every array, view and ``torch.from_numpy`` tensor derived
    from it keeps alive. The pool holds only a weak reference to the lease, and lends the buffer
    again only once that weak reference is dead — once nothing made from the batch exists. This
    rests on weak-reference semantics, not on reference-count values (which free-threaded
    Python changes). ``take()`` allocates only when every buffer is still out and no buffer
    is being made ahead of need (:meth:`expect`: then, once it has lent one, it waits for
    that one, at most :data:`RESERVE_WAIT_S`, rather than fault another in page by page); at most
    ``max_idle`` buffers that nobody borrows are kept. The arrays are in native byte order
    whatever ``dtype`` says; the gather's copy into them converts.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any], max_idle: int = 4) -> None:
        # native byte order whatever ``dtype`` says (">f4" lends float32): torch takes no other
        self.shape, self.dtype, self.max_idle = tuple(shape), in_native_byte_order(dtype), max_idle
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._buffers: list[np.ndarray] = []  # raw memory, uint8
        self._leases: list[weakref.ref[Any] | None] = []
        self._ready: list[np.ndarray] = []  # buffers made ahead of need (see add_ready)
        self._expected = 0  # buffers still being made ahead of need (see expect)
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)
        self.allocations = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of buffer memory this pool holds (lent out, idle or made ahead)."""
        return (len(self._buffers) + len(self._ready)) * self.nbytes

    def release_idle(self) -> None:
        """Let go of every buffer: those nobody borrows (idle, or made ahead of need) are freed
        now, and one still lent out lives on with what was made from it (its batch, a tensor:
        their lease keeps its memory) and is freed with that, never lent again. What a closed
        pipeline lets go of; a later :meth:`take` makes new ones. (Before 2026-12-07 a buffer
        lent out at the close stayed in the pool after it came back: a closed pipeline held
        the batch its loop had last seen — one batch of every label — until it was dropped and
        collected.) Call it where no :meth:`take` runs at the same time (the pipeline's close,
        under its lock)."""
        with self._made:
            self._buffers = []
            self._leases = []
            self._ready.clear()
            self._expected = 0
            self._made.notify_all()

    def expect(self, n: int) -> None:
        """Say that ``n`` more buffers are being made ahead of need (any thread): until each
        arrives by :meth:`add_ready` or is called off by :meth:`expect_no_more`, a
        :meth:`take` that finds no buffer waits for it instead of allocating."""
        with self._lock:
            self._expected += n

    def expect_no_more(self) -> None:
        """Call off the buffers :meth:`expect` announced and not yet added (any thread)."""
        with self._made:
            self._expected = 0
            self._made.notify_all()

    def add_ready(self, raw: np.ndarray) -> bool:
        """Keep ``raw`` (``nbytes`` of writable uint8 memory, its pages already faulted in) for
        a later :meth:`take` that finds no idle buffer (any thread); ``True`` where kept.
        Turned away (``False``; the caller drops it and makes no more) where no buffer is
        expected any more: :meth:`release_idle` (the pipeline closed) or :meth:`expect_no_more`
        called them off (before 2026-12-07 a reserve still running at ``close()`` kept the
        rest of its buffers afterwards: ``prefetch_depth + 2`` batches' idle memory)."""
        with self._made:
            if self._expected <= 0:
                return False
            self._ready.append(raw)
            self.allocations += 1
            self._expected -= 1
            self._made.notify_all()
        return True

    def take(self) -> np.ndarray:
        """A buffer to fill, from any thread: the first idle one, else one made ahead of need
        (:meth:`add_ready`), else a new one."""
        with self._made:
            leases = self._leases
            idle = [i for i, lease in enumerate(leases) if lease is None or lease() is None]
            for i in reversed(idle[self.max_idle :]):
                del self._buffers[i], leases[i]
            if idle:
                return self._lend(idle[0])
            # One being made ahead of need is on its way: faulting in another one page by page
            # on the decode threads costs more CPU, and leaves that one unused. Not for the
            # first buffer, though: the first batch's decode threads have nothing else to do
            # meanwhile (later batches' waits overlap the decodes of the batches before).
            if not self._ready and self._expected and self._buffers:
                self._made.wait_for(lambda: self._ready or not self._expected, RESERVE_WAIT_S)
            raw = self._ready.pop(0) if self._ready else None
            if raw is None:
                self.allocations += 1
                raw = plain_pages((self.nbytes,), np.uint8)
            self._buffers.append(raw)
            leases.append(None)
            return self._lend(len(self._buffers) - 1)

    def _lend(self, i: int) -> np.ndarray:
        raw = self._buffers[i]
        if raw.nbytes == 0:
            return np.empty(self.shape, dtype=self.dtype)
        owner: Any = (ctypes.c_char * raw.nbytes).from_buffer(raw)  # type: ignore[arg-type]
        self._leases[i] = weakref.ref(owner)
        return np.frombuffer(owner, dtype=self.dtype).reshape(self.shape)
