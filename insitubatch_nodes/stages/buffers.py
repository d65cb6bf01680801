"""The batch buffers: reusable batch arrays, lent under one ownership rule.

:class:`BatchBuffers` holds one :class:`BufferPool` per label. The gather stage assembles each
batch into arrays it takes from them; the fetch stage decodes rows of one-sample chunks straight
into the same arrays (see :mod:`~insitubatch_nodes.stages.fetch`). Both are handed the buffers
by the graph's :class:`~insitubatch_nodes.stages.context.StageContext`, which makes them; both
take them on the pipeline's producer thread.

A buffer is handed out again only once every array, view and tensor made from the batch that
borrowed it is gone, so a batch (or anything made from it) that you keep is never overwritten
(see :class:`BufferPool`). A short final batch is a prefix view of a full buffer.

A label's buffer is filled by its *parts* (:mod:`~insitubatch_nodes.plan.parts`): the one
plain view of a label of one step fills all of it; the ``T`` steps of a window fill
``buffer[:, t]`` each (:meth:`BatchBuffers.parts` hands every part its destination, a view into
the label's buffer, so the fetch stage decodes a step straight into its ``(row, t)`` slice and
the gather copies into it: there is no per-part buffer and no copy into the batch after).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry, in_native_byte_order
from insitubatch_nodes.plan.parts import BatchLayout, LabelParts
from insitubatch_nodes.slots import RamBacking

__all__ = ["BatchBuffers", "BufferPool", "batch_rows"]

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

    def add_ready(self, raw: np.ndarray) -> None:
        """Keep ``raw`` (``nbytes`` of writable uint8 memory, its pages already faulted in) for
        a later :meth:`take` that finds no idle buffer (any thread)."""
        with self._made:
            self._ready.append(raw)
            self.allocations += 1
            self._expected = max(0, self._expected - 1)
            self._made.notify_all()

    def take(self) -> np.ndarray:
        idle = [i for i, lease in enumerate(self._leases) if lease is None or lease() is None]
        for i in reversed(idle[self.max_idle :]):
            del self._buffers[i], self._leases[i]
        if idle:
            return self._lend(idle[0])
        with self._made:
            # One being made ahead of need is on its way: faulting in another one page by page
            # on the decode threads costs more CPU, and leaves that one unused. Not for the
            # first buffer, though: the first batch's decode threads have nothing else to do
            # meanwhile (later batches' waits overlap the decodes of the batches before).
            if not self._ready and self._expected and self._buffers:
                self._made.wait_for(lambda: self._ready or not self._expected, RESERVE_WAIT_S)
            raw = self._ready.pop(0) if self._ready else None
            if raw is None:
                self.allocations += 1
        self._buffers.append(np.empty(self.nbytes, dtype=np.uint8) if raw is None else raw)
        self._leases.append(None)
        return self._lend(len(self._buffers) - 1)

    def _lend(self, i: int) -> np.ndarray:
        raw = self._buffers[i]
        if raw.nbytes == 0:
            return np.empty(self.shape, dtype=self.dtype)
        owner: Any = (ctypes.c_char * raw.nbytes).from_buffer(raw)  # type: ignore[arg-type]
        self._leases[i] = weakref.ref(owner)
        return np.frombuffer(owner, dtype=self.dtype).reshape(self.shape)


class BatchBuffers:
    """The reusable batch arrays of one graph, one :class:`BufferPool` per batch label.

    ``views`` are the plan's views (part label -> view, as batches carry them: after the chunk
    transforms); ``layout`` says how each batch label is assembled from them (default: every
    view is a label of its own). :meth:`take` lends arrays for a batch of ``n`` rows, per batch
    label ``(n, *lead, *inner)`` (a prefix view of buffers of :attr:`rows` rows; larger batches,
    after an elastic resume, grow the buffers); :meth:`parts` gives each part its destination
    in them. The gather stage takes them for the batches it assembles; the fetch stage takes
    them for the batches whose rows it decodes straight into them. Both run on the pipeline's
    producer thread.
    """

    def __init__(
        self, views: Mapping[str, ArrayGeometry], rows: int, layout: BatchLayout | None = None
    ) -> None:
        self._retired_allocations = 0
        self._pools: dict[str, BufferPool] = {}
        self.rows = rows
        self.set_views(views, layout)

    def set_views(self, views: Mapping[str, ArrayGeometry], layout: BatchLayout | None) -> None:
        """Lend buffers for ``views`` assembled by ``layout`` from now on (buffers lent before
        stay valid): the views a pipeline reads after ``set_views``."""
        self.views = dict(views)
        if layout is None:
            layout = BatchLayout({lb: LabelParts((), ((lb, ()),)) for lb in views}, dict(views))
        self.layout = layout
        self._plain = layout.is_plain()
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
        for label, lp in layout.labels.items():
            first = self.views[lp.parts[0][0]]
            self._shapes[label] = (lp.row_shape(first.inner_shape), first.dtype)
        self.resize(self.rows)

    def resize(self, rows: int) -> None:
        """Lend buffers of ``rows`` rows from now on (buffers lent before stay valid)."""
        self._retired_allocations += sum(p.allocations for p in self._pools.values())
        self.rows = rows
        self._pools = {
            label: BufferPool((rows, *shape), dtype)
            for label, (shape, dtype) in self._shapes.items()
        }

    def take(self, n: int) -> dict[str, np.ndarray]:
        """Arrays ``(n, *lead, *inner)`` for every batch label (on the producer thread)."""
        if n > self.rows:
            self.resize(n)
        return {label: pool.take()[:n] for label, pool in self._pools.items()}

    def parts(self, arrays: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Each part's destination in the batch ``arrays`` (from :meth:`take`): part label ->
        ``arrays[label]`` itself, the view ``arrays[label][:, t]`` of a window's step ``t``,
        or a stack member's channel slice. Views share the batch's memory (and keep its
        buffer lent)."""
        if self._plain:
            return arrays
        out: dict[str, np.ndarray] = {}
        for label, lp in self.layout.labels.items():
            arr = arrays[label]
            for part, index in lp.parts:
                out[part] = lp.destination(arr, index)
        return out

    def reserve(self, batches: int) -> None:
        """Make the buffers of ``batches`` batches ahead of need, on a thread of their own, with
        their pages already faulted in (:meth:`RamBacking.allocate_populated
        <insitubatch_nodes.slots.RamBacking.allocate_populated>`: one pass of the kernel
        several times as fast as first writes faulting them in page by page, which a fresh
        process would otherwise pay inside the decodes of its first batches). :meth:`take`
        never waits for it: a batch that finds none ready allocates as before."""
        pools = list(self._pools.values())
        if batches <= 0 or not pools:
            return
        for pool in pools:
            pool.expect(batches)

        def run() -> None:
            backing = RamBacking()
            try:
                for _ in range(batches):
                    for pool in pools:
                        raw = backing.allocate_populated((pool.nbytes,), np.dtype(np.uint8))
                        pool.add_ready(raw)
            except (OSError, MemoryError, ValueError):
                pass
            finally:
                for pool in pools:
                    pool.expect_no_more()

        threading.Thread(target=run, name="insitu-buffer-reserve", daemon=True).start()

    @property
    def allocations(self) -> int:
        """Buffers allocated so far (stays flat in steady state)."""
        return self._retired_allocations + sum(p.allocations for p in self._pools.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of buffer memory held now, lent out or idle."""
        return sum(p.held_bytes for p in self._pools.values())


def _physical_memory_bytes() -> int:
    """This machine's physical memory (a very large number where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 2**62


def batch_rows(
    batch_size: int,
    delivered: int,
    views: Mapping[str, ArrayGeometry],
    split: str,
    rank: int,
    world_size: int,
) -> int:
    """Rows of the batch buffers: ``min(batch_size, delivered)`` (``delivered``: the samples
    this rank yields per epoch, so no batch holds more); ``ValueError`` naming ``batch_size``,
    the split and what fits when one batch of ``batch_size`` samples would not fit in this
    machine's memory (such a request is a mistake whatever the split holds)."""
    sample_bytes = sum(math.prod(v.inner_shape) * v.dtype.itemsize for v in views.values())
    memory = _physical_memory_bytes()
    if batch_size * sample_bytes <= memory:
        return max(1, min(batch_size, delivered))
    on_rank = f" on rank {rank} of {world_size}" if world_size > 1 else ""
    fits = memory // max(1, sample_bytes)
    raise ValueError(
        f"batch_size={batch_size:,} is impossible here: one batch of that many samples would "
        f"take {_human_bytes(batch_size * sample_bytes)} ({sample_bytes:,} bytes per sample "
        f"over every view), more than this machine's {_human_bytes(memory)} of memory (at "
        f"most {fits:,} samples fit in one batch). Split {split!r} delivers {delivered:,} "
        f"samples per epoch{on_rank}, so batch_size={delivered:,} already puts all of them in "
        f"one batch: pass a batch_size of at most {min(delivered, fits):,}"
    )


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:,.0f} {unit}" if unit == "bytes" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover
