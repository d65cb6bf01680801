"""The gather stage: build each batch from resident chunks with vectorised copies.

The read plan emits each batch's rows in sample order, so for every label the rows that come
from one chunk are one contiguous run of the batch: each distinct chunk contributes one
``np.take`` (or slice copy) straight into the batch — Python work is O(chunks in the batch),
never O(samples).

Batches are in native byte order whatever the slots hold: the buffers are allocated native and
the copy converts (a slot is native already unless a chunk transform declared otherwise: the
decoder swaps big-endian chunks as it writes them, see :mod:`insitubatch_nodes.io.geometry`).

Batch arrays are carved from reusable buffers, lent under one explicit ownership rule (see
:class:`BufferPool`): a buffer is handed out again only once every array, view and tensor made
from the batch that borrowed it is gone, so a batch (or anything made from it) that you keep is
never overwritten. A short final batch is a prefix view of a full buffer.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes import _runtime
from insitubatch_nodes._checks import check_batch_transforms, check_int
from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.io.geometry import ArrayGeometry, in_native_byte_order
from insitubatch_nodes.recorder import NULL_RECORDER, EpochRecorder
from insitubatch_nodes.slots import RamBacking, is_level_major
from insitubatch_nodes.stages._graph import SOURCE_KEY, find_attr, find_node
from insitubatch_nodes.stages._windows import gather_windows
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ResidentBatch

__all__ = ["PARALLEL_GATHER_BYTES", "BatchBuffers", "BufferPool", "GatherNode", "gather_label"]

PARALLEL_GATHER_BYTES = 8 * 2**20
"""A batch at least this large (all labels) is copied by two threads, half the rows each
(with two or more usable cores): one thread copies memory at well under the machine's
bandwidth, two ~1.5x faster (measured on the project's VM)."""


class BufferPool:
    """Reusable batch buffers of one shape and dtype, lent out under an explicit ownership rule.

    Each array :meth:`take` returns is built on a *lease*: an owner object of its own (a ctypes
    view of the buffer's memory) that every array, view and ``torch.from_numpy`` tensor derived
    from it keeps alive. The pool holds only a weak reference to the lease, and lends the buffer
    again only once that weak reference is dead — once nothing made from the batch exists. This
    rests on weak-reference semantics, not on reference-count values (which free-threaded
    Python changes). ``take()`` allocates only when every buffer is still out; at most
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
        self._lock = threading.Lock()
        self.allocations = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of buffer memory this pool holds (lent out, idle or made ahead)."""
        return (len(self._buffers) + len(self._ready)) * self.nbytes

    def add_ready(self, raw: np.ndarray) -> None:
        """Keep ``raw`` (``nbytes`` of writable uint8 memory, its pages already faulted in) for
        a later :meth:`take` that finds no idle buffer (any thread)."""
        with self._lock:
            self._ready.append(raw)
            self.allocations += 1

    def take(self) -> np.ndarray:
        idle = [i for i, lease in enumerate(self._leases) if lease is None or lease() is None]
        for i in reversed(idle[self.max_idle :]):
            del self._buffers[i], self._leases[i]
        if idle:
            return self._lend(idle[0])
        with self._lock:
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
    """The reusable batch arrays of one gather stage, one :class:`BufferPool` per label.

    :meth:`take` lends arrays for a batch of ``n`` rows (a prefix view of buffers of
    :attr:`rows` rows; larger batches, after an elastic resume, grow the buffers). The gather
    stage takes them for the batches it assembles; it also lends them to the fetch stage below
    it (:meth:`~insitubatch_nodes.stages.fetch.AsyncChunkFetchNode.accept_batch_buffers`), which
    decodes rows straight into them. Both run on the pipeline's producer thread.
    """

    def __init__(self, labels: Mapping[str, ArrayGeometry], rows: int) -> None:
        self.labels = dict(labels)
        self._retired_allocations = 0
        self._pools: dict[str, BufferPool] = {}
        self.resize(rows)

    def resize(self, rows: int) -> None:
        """Lend buffers of ``rows`` rows from now on (buffers lent before stay valid)."""
        self._retired_allocations += sum(p.allocations for p in self._pools.values())
        self.rows = rows
        self._pools = {
            label: BufferPool((rows, *g.inner_shape), g.dtype) for label, g in self.labels.items()
        }

    def take(self, n: int) -> dict[str, np.ndarray]:
        """Arrays ``(n, *inner)`` for every label (on the producer thread)."""
        if n > self.rows:
            self.resize(n)
        return {label: pool.take()[:n] for label, pool in self._pools.items()}

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

        def run() -> None:
            backing = RamBacking()
            for _ in range(batches):
                for pool in pools:
                    try:
                        raw = backing.allocate_populated((pool.nbytes,), np.dtype(np.uint8))
                    except (OSError, MemoryError, ValueError):
                        return
                    pool.add_ready(raw)

        threading.Thread(target=run, name="insitu-buffer-reserve", daemon=True).start()

    @property
    def allocations(self) -> int:
        """Buffers allocated so far (stays flat in steady state)."""
        return self._retired_allocations + sum(p.allocations for p in self._pools.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of buffer memory held now, lent out or idle."""
        return sum(p.held_bytes for p in self._pools.values())


def gather_label(
    out: np.ndarray,
    samples: np.ndarray,
    samples_per_chunk: int,
    path: str,
    slots: Mapping[tuple[str, int], np.ndarray],
    scratch: np.ndarray,
    skip_missing: bool = False,
) -> int:
    """Fill ``out[i] = slot_of(samples[i])[samples[i] % spc]`` with one copy per chunk; the
    number of rows copied.

    The read plan emits each batch's rows in sample order, so every chunk's rows form one
    contiguous run of ``out``: a single ``np.take`` (or slice copy) per chunk writes them in
    place. Rows in any other order still work, through ``scratch`` (a gather, then a scatter).
    With ``skip_missing`` the rows of chunks that have no slot are left as they are (the fetch
    stage decoded them in place).
    """
    n = len(samples)
    if samples_per_chunk == 1 and not skip_missing and n > 1:
        # a chunk per row: every row's slot is one sample, laid end to end by one call
        np.concatenate([slots[(path, s)] for s in samples.tolist()], axis=0, out=out)
        return n
    chunk = samples // samples_per_chunk
    within = samples - chunk * samples_per_chunk
    copied = 0
    if n > 1 and bool(np.all(chunk[1:] >= chunk[:-1])):
        cuts = (np.flatnonzero(chunk[1:] != chunk[:-1]) + 1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            slot = slots.get((path, int(chunk[lo]))) if skip_missing else None
            if slot is None:
                if skip_missing:
                    continue
                slot = slots[(path, int(chunk[lo]))]
            w0, w1 = int(within[lo]), int(within[hi - 1])
            if w1 - w0 == hi - lo - 1:  # consecutive samples: a plain slice copy
                out[lo:hi] = slot[w0 : w1 + 1]
            else:
                take_rows(slot, within[lo:hi], out[lo:hi])
            copied += hi - lo
        return copied
    order = np.argsort(chunk, kind="stable")
    sorted_chunks = chunk[order]
    cuts = (np.flatnonzero(sorted_chunks[1:] != sorted_chunks[:-1]) + 1).tolist()
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        key = (path, int(sorted_chunks[lo]))
        if skip_missing and key not in slots:
            continue
        rows = order[lo:hi]
        block = scratch[: hi - lo]
        take_rows(slots[key], within[rows], block)
        out[rows] = block
        copied += hi - lo
    return copied


def take_rows(slot: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = slot[rows]`` with one ``np.take`` into the C-contiguous ``out``.

    ``np.take`` copies a non-contiguous source whole before it gathers, so a level-major slot
    (see :mod:`insitubatch_nodes.pool`) is gathered from its memory instead: seen as rows
    ``(level, sample)``, every sample's level is one contiguous run, and row ``r`` of ``out``
    is the runs ``level * spc + rows[r]`` for every level, in order.
    """
    if is_level_major(slot) and out.flags.c_contiguous:
        spc, levels = slot.shape[0], slot.shape[1]
        memory = slot.swapaxes(0, 1).reshape(levels * spc, -1)  # a view: it is C-contiguous
        index = (rows[:, None] + spc * np.arange(levels)).ravel()
        np.take(memory, index, axis=0, out=out.reshape(len(rows) * levels, -1), mode="clip")
    else:
        np.take(slot, rows, axis=0, out=out, mode="clip")


class GatherNode(BaseNode[Batch]):
    """Gather stage: :class:`ResidentBatch` in, :class:`~insitubatch_nodes.batch.Batch` out.

    ``labels`` maps each label to its :class:`ArrayGeometry` view; ``batch_transforms`` run in
    order on every gathered batch (on the pipeline's thread, so they overlap the consumer).
    ``rows`` (default ``batch_size``) sizes the batch buffers: the most samples one batch holds,
    which :func:`~insitubatch_nodes.pipeline.insitu_pipeline` sets to ``min(batch_size,
    samples the rank delivers per epoch)``. A batch with more rows (an epoch resumed on
    another world size) gets buffers of its size, allocated then.

    ``coords`` maps a label to ``{name: values}`` (1-D, one value per sample of its array): each
    batch's ``coords[label][name]`` is ``values[sample_indices[label]]``, one vectorised take.
    """

    NESTS_SOURCE_STATE = True

    def __init__(
        self,
        source: BaseNode[ResidentBatch],
        labels: Mapping[str, ArrayGeometry] | None = None,
        batch_size: int | None = None,
        batch_transforms: Sequence[BatchTransform] = (),
        *,
        rows: int | None = None,
        coords: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    ) -> None:
        super().__init__()
        batch_transforms = check_batch_transforms(batch_transforms)
        self.source = source
        plan = find_node(source, ReadPlanNode)
        fetch = find_node(source, AsyncChunkFetchNode)
        if labels is None or batch_size is None:
            if plan is None:
                raise ValueError(
                    "GatherNode needs labels and batch_size when no ReadPlanNode is down its "
                    "chain to take them from"
                )
            labels = plan.variables if labels is None else labels
            batch_size = plan.batch_size if batch_size is None else batch_size
        self.labels = _gathered_views(labels, fetch)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        batch_size = self.batch_size
        if rows is None and plan is not None:
            rows = batch_rows(
                batch_size,
                plan.epoch_plan(0).n_samples,
                self.labels,
                plan.split,
                plan.rank,
                plan.world_size,
            )
        self.batch_transforms = tuple(batch_transforms)
        unknown = set(coords or {}) - set(self.labels)
        if unknown:
            raise ValueError(f"coords name labels {sorted(unknown)} that are not in labels")
        self.coords = {
            label: {name: np.asarray(v) for name, v in named.items()}
            for label, named in (coords or {}).items()
            if named
        }
        rows = batch_size if rows is None else max(1, min(rows, batch_size))
        self.buffers = BatchBuffers(self.labels, rows)
        self._size(rows)
        self.recorder: EpochRecorder = find_attr(source, "recorder") or NULL_RECORDER
        if self.recorder.enabled:
            self.recorder.batch_transforms = len(self.batch_transforms)
        _offer_buffers(source, self.buffers)

    def _size(self, rows: int) -> None:
        """Batch buffers of ``rows`` rows, and scratch to match."""
        self.rows = rows
        if self.buffers.rows < rows:
            self.buffers.resize(rows)
        # one scratch set per gathering thread (used only for rows out of sample order)
        self._scratch = [
            {
                label: np.empty((min(rows, g.samples_per_chunk), *g.inner_shape), g.dtype)
                for label, g in self.labels.items()
            }
            for _ in range(2)
        ]

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state[SOURCE_KEY] if initial_state is not None else None)

    def get_state(self) -> dict[str, Any]:
        return {SOURCE_KEY: self.source.state_dict()}

    def next(self) -> Batch:
        resident: ResidentBatch = next(self.source)
        t0 = time.perf_counter()
        plan = resident.plan
        n = len(plan)
        if n > self.rows:  # batches of more rows than sized for (elastic resume): resize
            self._size(min(n, self.batch_size))
        given = resident.arrays
        arrays = self.buffers.take(n) if given is None else dict(given)
        # labels whose every row the fetch stage decoded in place need no copy at all
        labels = [lb for lb in self.labels if resident.direct.get(lb, 0) < n]
        nbytes = sum(arrays[lb].nbytes for lb in labels)
        helper = _runtime.gather_helper() if n > 1 and nbytes >= PARALLEL_GATHER_BYTES else None
        if helper is None:
            copied = self._gather_rows(arrays, resident, labels, 0, n, 0)
        else:  # two threads copy half the rows each: copies from memory go ~1.5x as fast
            half = n // 2
            other = helper.submit(-1, self._gather_rows, arrays, resident, labels, half, n, 1)
            try:
                copied = self._gather_rows(arrays, resident, labels, 0, half, 0)
            finally:
                more = other.result()  # also when ours raised: nothing writes into the batch
            copied = {lb: copied[lb] + more[lb] for lb in labels}
        for label in labels:
            if copied[label] + resident.direct.get(label, 0) != n:
                raise RuntimeError(
                    f"batch {plan.index} of label {label!r}: {copied[label]} rows gathered and "
                    f"{resident.direct.get(label, 0)} decoded in place, of {n}; this is a bug "
                    "in insitubatch_nodes, please report it"
                )
        batch = Batch(
            arrays=arrays,
            sample_indices=dict(plan.sample_indices),
            patch_origins=dict(plan.patch_origins),
            epoch=plan.epoch,
            index=plan.index,
            coords={
                label: {
                    name: values.take(plan.sample_indices[label]) for name, values in named.items()
                }
                for label, named in self.coords.items()
            },
        )
        for transform in self.batch_transforms:
            batch = transform(batch)
        self.recorder.add("gather_s", time.perf_counter() - t0)
        return batch

    def _gather_rows(
        self,
        arrays: Mapping[str, np.ndarray],
        resident: ResidentBatch,
        labels: Sequence[str],
        lo: int,
        hi: int,
        scratch: int,
    ) -> dict[str, int]:
        """Rows ``lo:hi`` of ``labels`` (``scratch`` picks the scratch set of this thread); the
        rows copied per label (rows decoded in place are left as they are)."""
        partial = resident.arrays is not None
        out = {}
        for label in labels:
            geom = self.labels[label]
            if geom.patch is not None:
                origins = resident.plan.origins
                assert origins is not None, "a patched view needs a patched read plan"
                out[label] = gather_windows(
                    arrays[label][lo:hi],
                    resident.plan.sample_indices[label][lo:hi],
                    origins[lo:hi],
                    geom,
                    resident.slots,
                )
                continue
            out[label] = gather_label(
                arrays[label][lo:hi],
                resident.plan.sample_indices[label][lo:hi],
                geom.samples_per_chunk,
                geom.path,
                resident.slots,
                self._scratch[scratch][label],
                skip_missing=partial and resident.direct.get(label, 0) > 0,
            )
        return out

    def close(self) -> None:
        closer = getattr(self.source, "close", None)
        if closer is not None:
            closer()

    @property
    def buffer_allocations(self) -> int:
        """Batch buffers allocated so far (stays flat in steady state)."""
        return self.buffers.allocations

    @property
    def buffer_bytes(self) -> int:
        """Bytes of batch-buffer memory held now, lent out or idle (scratch included)."""
        held = self.buffers.held_bytes
        return held + sum(s.nbytes for scratch in self._scratch for s in scratch.values())


def _offer_buffers(source: Any, buffers: BatchBuffers) -> None:
    """Lend ``buffers`` to the first stage down the ``source`` chain that decodes rows straight
    into batches (the fetch stage), so a graph composed by hand does what the builder's does."""
    seen: set[int] = set()
    node = source
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        accept = getattr(node, "accept_batch_buffers", None)
        if callable(accept):
            accept(buffers)
            return
        node = getattr(node, "source", None)


def _physical_memory_bytes() -> int:
    """This machine's physical memory (a very large number where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 2**62


def batch_rows(
    batch_size: int,
    delivered: int,
    labels: Mapping[str, ArrayGeometry],
    split: str,
    rank: int,
    world_size: int,
) -> int:
    """Rows of the batch buffers: ``min(batch_size, delivered)`` (``delivered``: the samples
    this rank yields per epoch, so no batch holds more); ``ValueError`` naming ``batch_size``,
    the split and what fits when one batch of ``batch_size`` samples would not fit in this
    machine's memory (such a request is a mistake whatever the split holds)."""
    sample_bytes = sum(math.prod(v.inner_shape) * v.dtype.itemsize for v in labels.values())
    memory = _physical_memory_bytes()
    if batch_size * sample_bytes <= memory:
        return max(1, min(batch_size, delivered))
    on_rank = f" on rank {rank} of {world_size}" if world_size > 1 else ""
    fits = memory // max(1, sample_bytes)
    raise ValueError(
        f"batch_size={batch_size:,} is impossible here: one batch of that many samples would "
        f"take {_human_bytes(batch_size * sample_bytes)} ({sample_bytes:,} bytes per sample "
        f"over every label), more than this machine's {_human_bytes(memory)} of memory (at "
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


def _gathered_views(labels: Mapping[str, ArrayGeometry], fetch: Any) -> dict[str, ArrayGeometry]:
    """Each label's view as batches carry it: a view of an array the fetch stage's chunk
    transforms reshape becomes the transformed one (a view given already transformed stays)."""
    transforms = None if fetch is None else fetch.transforms
    out: dict[str, ArrayGeometry] = {}
    for label, view in labels.items():
        if not isinstance(view, ArrayGeometry):
            raise TypeError(f"labels[{label!r}] must be an ArrayGeometry view, got {view!r}")
        if transforms is not None and view.path in transforms.outputs:
            if view.base == transforms.source(view.path) and transforms.active(view.path):
                view = transforms.output_view(view)
            elif view.base != transforms.outputs[view.path]:
                raise ValueError(
                    f"labels[{label!r}] is a view of {view.path!r} whose geometry is neither the "
                    "stored array's nor what the fetch stage's chunk transforms make of it"
                )
        out[label] = view
    return out
