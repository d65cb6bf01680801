"""The batch buffers: reusable batch arrays, lent under one ownership rule.

:class:`BatchBuffers` holds one :class:`~insitubatch_nodes.lending.BufferPool` per label. The
gather stage assembles each batch into arrays it takes from them; the fetch stage decodes rows of
one-sample chunks straight into the same arrays (see :mod:`~insitubatch_nodes.stages.fetch`).
Both are handed the buffers by the graph's
:class:`~insitubatch_nodes.stages.context.StageContext`, which makes them; both take them on the
pipeline's producer thread.

A buffer is handed out again only once every array, view and tensor made from the batch that
borrowed it is gone, so a batch (or anything made from it) that you keep is never overwritten
(see :class:`~insitubatch_nodes.lending.BufferPool`). A short final batch is a prefix view of a
full buffer.

A label's buffer is filled by its *parts* (:mod:`~insitubatch_nodes.plan.parts`): the one
plain view of a label of one step fills all of it; the ``T`` steps of a window fill
``buffer[:, t]`` each (:meth:`BatchBuffers.parts` hands every part its destination, a view into
the label's buffer, so the fetch stage decodes a step straight into its ``(row, t)`` slice and
the gather copies into it: there is no per-part buffer and no copy into the batch after).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes._process import usable_memory_bytes
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.lending import BufferPool
from insitubatch_nodes.plan.parts import BatchLayout, LabelParts
from insitubatch_nodes.slots import RamBacking

__all__ = ["BatchBuffers", "LentBatch", "batch_rows", "batches_in_flight"]


class BatchBuffers:
    """The reusable batch arrays of one graph, one
    :class:`~insitubatch_nodes.lending.BufferPool` per batch label.

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
        """Arrays ``(n, *lead, *inner)`` for every batch label, taken now (on the producer
        thread)."""
        return self.lend(n).arrays()

    def lend(self, n: int) -> LentBatch:
        """A batch of ``n`` rows whose arrays are taken when first asked for, on any thread
        (:class:`LentBatch`); made on the producer thread."""
        if n > self.rows:
            self.resize(n)
        return LentBatch(dict(self._pools), n, self.layout if not self._plain else None)

    def parts(self, arrays: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """Each part's destination in the batch ``arrays`` (from :meth:`take`): part label ->
        ``arrays[label]`` itself, the view ``arrays[label][:, t]`` of a window's step ``t``,
        or a stack member's channel slice. Views share the batch's memory (and keep its
        buffer lent)."""
        return _parts(arrays, None if self._plain else self.layout)

    def reserve(self, batches: int) -> None:
        """Make the buffers of ``batches`` batches ahead of need, on a thread of their own, with
        their pages already faulted in (:meth:`RamBacking.allocate_populated
        <insitubatch_nodes.slots.RamBacking.allocate_populated>`: one pass of the kernel
        several times as fast as first writes faulting them in page by page, which a fresh
        process would otherwise pay inside the decodes of its first batches). :meth:`take`
        never waits for it: a batch that finds none ready allocates as before. It stops where
        the buffers are called off (:meth:`release_idle`, the pipeline's ``close()``): what it
        made then is dropped, not kept idle."""
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
                        if not pool.add_ready(raw):  # (called off: the pipeline closed)
                            return
            except (OSError, MemoryError, ValueError):
                pass
            finally:
                for pool in pools:
                    pool.expect_no_more()

        threading.Thread(target=run, name="insitu-buffer-reserve", daemon=True).start()

    def release_idle(self) -> None:
        """Let go of every label's buffers (:meth:`BufferPool.release_idle
        <insitubatch_nodes.lending.BufferPool.release_idle>`: the idle ones freed, one lent out
        freed with its batch)."""
        for pool in self._pools.values():
            pool.release_idle()

    @property
    def allocations(self) -> int:
        """Buffers allocated so far (stays flat in steady state)."""
        return self._retired_allocations + sum(p.allocations for p in self._pools.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of buffer memory held now, lent out or idle."""
        return sum(p.held_bytes for p in self._pools.values())

    @property
    def batch_nbytes(self) -> int:
        """Bytes of one batch's buffers, every label's together."""
        return sum(p.nbytes for p in self._pools.values())


class LentBatch:
    """One batch's arrays, taken from the batch buffers when first asked for.

    The fetch stage plans the rows it decodes straight into a batch ahead of the decodes
    (read-ahead), but a batch's buffers are taken only when :meth:`arrays` or :meth:`part`
    is first called: over a local folder by the decode thread that reaches its first row, over
    a store read by GETs when the fetch stage submits its reads (on the producer thread: the
    event loop that lands them must never wait for a buffer), and at the latest by the pool
    stage when the batch is handed on. A batch queued behind others thus faults in no fresh
    memory before the decode threads reach it: in a fresh process's first epoch at one sample
    per chunk over a local folder, two batches' buffers (up to hundreds of MB) fewer are made,
    each page of which this machine's kernel faults in at 0.4–2 GB/s. A batch that is
    abandoned before any of these takes nothing. Safe from any thread; the pools and layout
    are those of :meth:`BatchBuffers.lend` (a later ``set_views`` or resize changes neither).
    """

    __slots__ = ("_arrays", "_layout", "_lock", "_n", "_parts", "_pools")

    def __init__(self, pools: Mapping[str, BufferPool], n: int, layout: BatchLayout | None):
        self._pools, self._n, self._layout = pools, n, layout
        self._arrays: dict[str, np.ndarray] | None = None
        self._parts: Mapping[str, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def taken(self) -> bool:
        """Whether the buffers were taken."""
        return self._arrays is not None

    def arrays(self) -> dict[str, np.ndarray]:
        """The batch arrays ``(n, *lead, *inner)`` per label, taken on the first call."""
        arrays = self._arrays
        if arrays is None:
            with self._lock:
                arrays = self._arrays
                if arrays is None:
                    arrays = {label: pool.take()[: self._n] for label, pool in self._pools.items()}
                    self._parts = _parts(arrays, self._layout)
                    self._arrays = arrays
        return arrays

    def part(self, label: str) -> np.ndarray:
        """Part ``label``'s destination in the batch arrays (:meth:`BatchBuffers.parts`)."""
        if self._arrays is None:
            self.arrays()
        return self._parts[label]


def _parts(
    arrays: Mapping[str, np.ndarray], layout: BatchLayout | None
) -> Mapping[str, np.ndarray]:
    """:meth:`BatchBuffers.parts` of ``arrays`` under ``layout`` (``None``: plain)."""
    if layout is None:
        return arrays
    out: dict[str, np.ndarray] = {}
    for label, lp in layout.labels.items():
        arr = arrays[label]
        for part, index in lp.parts:
            out[part] = lp.destination(arr, index)
    return out


def batch_rows(
    batch_size: int,
    delivered: int,
    views: Mapping[str, ArrayGeometry],
    split: str,
    rank: int,
    world_size: int,
    prefetch_depth: int | None = None,
) -> int:
    """Rows of the batch buffers: ``min(batch_size, delivered)`` (``delivered``: the samples
    this rank yields per epoch, so no batch holds more); ``ValueError`` naming ``batch_size``,
    the split and what fits when one batch of ``batch_size`` samples would not fit in the
    memory this process may use (the machine's, or its container's limit; such a request is a
    mistake whatever the split holds). With ``prefetch_depth`` (a prefetch stage's), also a
    ``ValueError`` naming both when the ``prefetch_depth + 2`` batches it keeps in flight (the
    consumer's, the queue's, the one being filled; made and faulted in right after the build)
    would not fit there together."""
    sample_bytes = sum(math.prod(v.inner_shape) * v.dtype.itemsize for v in views.values())
    memory = usable_memory_bytes()
    if batch_size * sample_bytes <= memory:
        rows = max(1, min(batch_size, delivered))
        if prefetch_depth is not None:
            _check_in_flight(rows, sample_bytes, prefetch_depth, memory)
        return rows
    on_rank = f" on rank {rank} of {world_size}" if world_size > 1 else ""
    fits = memory // max(1, sample_bytes)
    raise ValueError(
        f"batch_size={batch_size:,} is impossible here: one batch of that many samples would "
        f"take {_human_bytes(batch_size * sample_bytes)} ({sample_bytes:,} bytes per sample "
        f"over every view), more than the {_human_bytes(memory)} of memory this process may "
        f"use (at most {fits:,} samples fit in one batch). Split {split!r} delivers {delivered:,} "
        f"samples per epoch{on_rank}, so batch_size={delivered:,} already puts all of them in "
        f"one batch: pass a batch_size of at most {min(delivered, fits):,}"
    )


def batches_in_flight(prefetch_depth: int) -> int:
    """The batches a prefetch stage of ``prefetch_depth`` keeps in flight, each in buffers of
    its own: the consumer's, ``prefetch_depth`` queued ahead, the one being filled."""
    return prefetch_depth + 2


def _check_in_flight(rows: int, sample_bytes: int, prefetch_depth: int, memory: int) -> None:
    """``ValueError`` when :func:`batches_in_flight` batches of ``rows`` rows exceed ``memory``."""
    in_flight = batches_in_flight(prefetch_depth)
    if in_flight * rows * sample_bytes <= memory:
        return
    rows_fit = memory // (in_flight * max(1, sample_bytes))
    depth_fit = memory // max(1, rows * sample_bytes) - 2
    depth = f"or prefetch_depth={depth_fit:,}" if depth_fit >= 1 else "(no prefetch_depth fits)"
    raise ValueError(
        f"batch_size={rows:,} with prefetch_depth={prefetch_depth:,} would not fit: the "
        f"pipeline keeps {in_flight} batches in flight (the consumer's, {prefetch_depth} queued "
        f"ahead, the one being filled; made right after the build), "
        f"{_human_bytes(in_flight * rows * sample_bytes)} at {_human_bytes(rows * sample_bytes)} "
        f"a batch ({sample_bytes:,} bytes per sample over every view), more than the "
        f"{_human_bytes(memory)} of memory this process may use: pass batch_size={rows_fit:,} "
        f"{depth}, or select fewer levels, channels or points per sample"
    )


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:,.0f} {unit}" if unit == "bytes" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover
