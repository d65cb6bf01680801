"""Gathering selected views: each row's selection copied out of its chunk's slot.

A selected view's slot holds the whole chunk, or the stored tiles its array's views touch side
by side (:mod:`~insitubatch_nodes.io.selection`). Its index into one sample of the slot
(:func:`~insitubatch_nodes.io.selection.slot_index`) is worked out once per view. As for an
ordinary label, the rows of one chunk are one contiguous run of the batch, and each run is one
copy: a slice assignment (a view of the slot, no temporary) when the rows are consecutive and
every index is a slice or an integer, otherwise one ``np.ix_`` gather (a temporary the size of
the run's selection, never of the slot).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held, slot_index

__all__ = ["SelectedGather"]


class SelectedGather:
    """How one selected view is gathered: its slot index, worked out once."""

    def __init__(self, view: ArrayGeometry, held: Held | None) -> None:
        assert view.select is not None
        self.path = view.path
        self.spc = view.samples_per_chunk
        base = view.base
        self.index = slot_index(view.select, held, base.tile_shape)
        self.basic = all(not isinstance(i, np.ndarray) for i in self.index)
        # the general gather: ints first (a view), then every kept axis as an index array
        self._ints = tuple(i if isinstance(i, int) else slice(None) for i in self.index)
        self._kept = [i for i in self.index if not isinstance(i, int)]

    def _arrays(self, slot: np.ndarray) -> list[np.ndarray]:
        picked = slot[(slice(None), *self._ints)]
        return [
            np.arange(n)[i] if isinstance(i, slice) else i
            for i, n in zip(self._kept, picked.shape[1:], strict=True)
        ]

    def __call__(
        self,
        out: np.ndarray,
        samples: np.ndarray,
        slots: Mapping[tuple[str, int], np.ndarray],
        skip_missing: bool = False,
    ) -> int:
        """Fill ``out[i]`` with the selection of sample ``samples[i]``; the rows copied (with
        ``skip_missing``, rows of chunks without a slot are left as they are)."""
        n = len(samples)
        chunk = samples // self.spc
        within = samples - chunk * self.spc
        order = np.argsort(chunk, kind="stable")
        sorted_chunks = chunk[order]
        cuts = (np.flatnonzero(sorted_chunks[1:] != sorted_chunks[:-1]) + 1).tolist()
        copied = 0
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            key = (self.path, int(sorted_chunks[lo]))
            if skip_missing and key not in slots:
                continue
            slot = slots[key]
            rows = order[lo:hi]
            w = within[rows]
            consecutive = bool(np.all(np.diff(rows) == 1)) and bool(np.all(np.diff(w) == 1))
            if self.basic and consecutive:
                r0, w0 = int(rows[0]), int(w[0])
                out[r0 : r0 + len(rows)] = slot[(slice(w0, w0 + len(rows)), *self.index)]
            else:
                picked = slot[(slice(None), *self._ints)]
                index: Any = np.ix_(w, *self._arrays(slot))
                out[rows] = picked[index]
            copied += hi - lo
        return copied
