"""The gather stage: build each batch from resident chunks with vectorised copies.

For every label, the batch's rows are grouped by the chunk they come from (one ``argsort``); then
each distinct chunk contributes one ``np.take`` of its rows into a scratch block and one
scatter into the batch — Python work is O(chunks in the batch), never O(samples). When a chunk's
rows are already a contiguous run in both the slot and the batch (``shuffle=False``), the copy is
a single slice assignment.

Batch arrays are carved from reusable buffers: a buffer is handed out again only when nothing
outside the stage references it (a batch, a view, or a tensor made with ``torch.from_numpy``),
so keeping a batch is always safe. A short final batch is a prefix view of a full buffer.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.geometry import ArrayGeometry
from insitubatch_nodes.pool import ChunkPoolNode, ResidentBatch

__all__ = ["BufferPool", "GatherNode", "gather_label"]


class BufferPool:
    """Reusable batch buffers of one shape and dtype.

    ``take()`` returns a buffer no one else references, allocating only when every buffer is
    still held downstream; at most ``max_idle`` unreferenced buffers are kept.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any], max_idle: int = 4) -> None:
        self.shape, self.dtype, self.max_idle = shape, np.dtype(dtype), max_idle
        self._buffers: list[np.ndarray] = []
        self.allocations = 0

    # References an idle buffer has while _idle() inspects it: the list, the loop variable,
    # the parameter and getrefcount's own argument.
    _IDLE_REFS = 4

    @classmethod
    def _refs(cls, buf: np.ndarray) -> int:
        return sys.getrefcount(buf)

    def take(self) -> np.ndarray:
        idle = [i for i, b in enumerate(self._buffers) if self._refs(b) <= self._IDLE_REFS]
        if idle:
            for i in reversed(idle[self.max_idle :]):
                del self._buffers[i]
            return self._buffers[idle[0]]
        buf = np.empty(self.shape, dtype=self.dtype)
        self._buffers.append(buf)
        self.allocations += 1
        return buf


def gather_label(
    out: np.ndarray,
    samples: np.ndarray,
    samples_per_chunk: int,
    path: str,
    slots: Mapping[tuple[str, int], np.ndarray],
    scratch: np.ndarray,
) -> None:
    """Fill ``out[i] = slot_of(samples[i])[samples[i] % spc]`` with one copy per chunk."""
    chunk = samples // samples_per_chunk
    within = samples - chunk * samples_per_chunk
    order = np.argsort(chunk, kind="stable")
    sorted_chunks = chunk[order]
    cuts = np.flatnonzero(sorted_chunks[1:] != sorted_chunks[:-1]) + 1
    starts = np.concatenate(([0], cuts)).tolist()
    stops = np.concatenate((cuts, [len(order)])).tolist()
    for lo, hi in zip(starts, stops, strict=True):
        rows = order[lo:hi]
        slot = slots[(path, int(sorted_chunks[lo]))]
        src = within[rows]
        r0, w0, n = int(rows[0]), int(src[0]), hi - lo
        if int(rows[-1]) - r0 == n - 1 and int(src[-1]) - w0 == n - 1 and _is_run(rows, src):
            out[r0 : r0 + n] = slot[w0 : w0 + n]
        else:
            block = scratch[:n]
            np.take(slot, src, axis=0, out=block, mode="clip")
            out[rows] = block


def _is_run(rows: np.ndarray, src: np.ndarray) -> bool:
    return bool(np.all(np.diff(rows) == 1) and np.all(np.diff(src) == 1))


class GatherNode(BaseNode[Batch]):
    """Gather stage: :class:`ResidentBatch` in, :class:`~insitubatch_nodes.batch.Batch` out.

    ``labels`` maps each label to its :class:`ArrayGeometry` view; ``batch_transforms`` run in
    order on every gathered batch (on the pipeline's thread, so they overlap the consumer).
    """

    def __init__(
        self,
        source: ChunkPoolNode,
        labels: Mapping[str, ArrayGeometry],
        batch_size: int,
        batch_transforms: Sequence[BatchTransform] = (),
    ) -> None:
        super().__init__()
        for t in batch_transforms:
            if not callable(t):
                raise TypeError(f"batch_transforms must be callables Batch -> Batch, got {t!r}")
        self.source = source
        self.labels = dict(labels)
        self.batch_size = batch_size
        self.batch_transforms = tuple(batch_transforms)
        self._buffers = {
            label: BufferPool((batch_size, *g.inner_shape), g.dtype) for label, g in labels.items()
        }
        self._scratch = {
            label: np.empty((min(batch_size, g.samples_per_chunk), *g.inner_shape), g.dtype)
            for label, g in labels.items()
        }

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state["source"] if initial_state is not None else None)

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}

    def next(self) -> Batch:
        resident: ResidentBatch = self.source.next()
        plan = resident.plan
        n = len(plan)
        arrays: dict[str, np.ndarray] = {}
        for label, geom in self.labels.items():
            out = self._buffers[label].take()[:n]
            gather_label(
                out,
                plan.sample_indices[label],
                geom.samples_per_chunk,
                geom.path,
                resident.slots,
                self._scratch[label],
            )
            arrays[label] = out
        batch = Batch(
            arrays=arrays,
            sample_indices=dict(plan.sample_indices),
            epoch=plan.epoch,
            index=plan.index,
        )
        for transform in self.batch_transforms:
            batch = transform(batch)
        return batch

    def close(self) -> None:
        self.source.close()

    @property
    def buffer_allocations(self) -> int:
        """Batch buffers allocated so far (stays flat in steady state)."""
        return sum(b.allocations for b in self._buffers.values())
