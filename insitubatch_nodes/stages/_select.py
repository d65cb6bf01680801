"""Gathering selected views: each row's selection copied out of its chunk's slot.

A selected view's slot holds the whole chunk, or the indices its array's views select side by
side (:mod:`~insitubatch_nodes.io.selection`): a view selecting exactly what is held takes
each row with one contiguous copy. Its index into one sample of the slot
(:func:`~insitubatch_nodes.io.selection.slot_index`) is worked out once per view. As for an
ordinary label, the rows of one chunk are one contiguous run of the batch, and each run is
copied with basic indexing wherever it can be: one slice assignment (a view of the slot, no
temporary) when every index is a slice or an integer (evenly spaced lists are slices), one
``np.take`` along the axis straight into the batch when one axis takes an uneven list (13
levels of 37: one call, not one copy per level) and the run's rows are contiguous in the batch
— into a strided destination (a stack's channels, a window's step) ``np.take`` would copy
through a temporary as large as the rows, so there the list's evenly spaced runs are one
slice assignment each (levels 0, 3 and 4: two) — and one
``np.ix_`` gather (a temporary the size of the run's selection, never of the slot) when two
axes do. Rows out of sample order within a chunk are taken with one index array. At one
sample per chunk every row is its own run: one such copy per row, with no sort or run search.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held, even_runs, slot_index

__all__ = ["SelectedGather"]


class SelectedGather:
    """How one selected view is gathered: its slot index, worked out once."""

    def __init__(self, view: ArrayGeometry, held: Held | None) -> None:
        assert view.select is not None
        self.path = view.path
        self.spc = view.samples_per_chunk
        self.index = slot_index(view.select, held)
        arrays = [a for a, i in enumerate(self.index) if isinstance(i, np.ndarray)]
        #: one index array (a list of levels): basic indexing, then one np.take
        self.listed: tuple[int, np.ndarray] | None = None
        if len(arrays) == 1:
            axis = arrays[0]
            kept = sum(not isinstance(i, int) for i in self.index[:axis])  # its place in out
            listed = self.index[axis]
            assert isinstance(listed, np.ndarray)
            self.listed = (kept, listed)
            self._runs = even_runs(listed.tolist())
        self._others = tuple(slice(None) if isinstance(i, np.ndarray) else i for i in self.index)
        # the general gather (two or more index arrays): ints first, then np.ix_ over the rest
        self._ints = tuple(i if isinstance(i, int) else slice(None) for i in self.index)
        self._kept = [i for i in self.index if not isinstance(i, int)]
        #: every index a slice or an integer: basic indexing, a view of the slot
        self._basic = self.listed is None and not any(isinstance(i, np.ndarray) for i in self.index)
        #: the index of one row's selection into a slot's row 0 (one sample per chunk)
        self._row = (0, *self.index)

    def _copy(self, out: Any, rows: Any, slot: np.ndarray, w: Any) -> None:
        """``out[rows] = slot[w][selection]`` (``rows``, ``w``: slices or index arrays)."""
        if self._basic:
            out[rows] = slot[(w, *self.index)]
        elif self.listed is not None:
            place, listed = self.listed
            # the other axes by basic indexing (a view of the slot), then one take along the
            # listed axis straight into a contiguous destination (clip: no bounds pass, no
            # buffering), or run by run into a strided one
            picked = slot[(w, *self._others)]
            if isinstance(rows, slice) and not out[rows].flags.c_contiguous:
                lead = (slice(None),) * (1 + place)  # the rows and the kept axes before it
                dest = out[rows]
                for into, taken in self._runs:
                    dest[(*lead, into)] = picked[(*lead, taken)]
            elif isinstance(rows, slice):
                np.take(picked, listed, axis=1 + place, out=out[rows], mode="clip")
            else:  # rows out of order: out[rows] would be a copy
                out[rows] = np.take(picked, listed, axis=1 + place, mode="clip")
        else:
            picked = slot[(slice(None), *self._ints)]
            w_array = np.arange(slot.shape[0])[w] if isinstance(w, slice) else w
            spans = [
                np.arange(n)[i] if isinstance(i, slice) else i
                for i, n in zip(self._kept, picked.shape[1:], strict=True)
            ]
            out[rows] = picked[np.ix_(w_array, *spans)]

    def __call__(
        self,
        out: np.ndarray,
        samples: np.ndarray,
        slots: Mapping[tuple[str, int], np.ndarray],
        skip_missing: bool = False,
    ) -> int:
        """Fill ``out[i]`` with the selection of sample ``samples[i]``; the rows copied (with
        ``skip_missing``, rows of chunks without a slot are left as they are)."""
        if self.spc == 1:  # a chunk per row: each row is its own run, no sort
            return self._per_row(out, samples, slots, skip_missing)
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
            rows = order[lo:hi]
            w = within[rows]
            if bool(np.all(np.diff(rows) == 1)) and bool(np.all(np.diff(w) == 1)):
                r0, w0, k = int(rows[0]), int(w[0]), len(rows)
                self._copy(out, slice(r0, r0 + k), slots[key], slice(w0, w0 + k))
            else:
                self._copy(out, rows, slots[key], w)
            copied += hi - lo
        return copied

    def _per_row(
        self,
        out: np.ndarray,
        samples: np.ndarray,
        slots: Mapping[tuple[str, int], np.ndarray],
        skip_missing: bool,
    ) -> int:
        """``__call__`` at one sample per chunk: row ``i`` is sample 0 of chunk ``samples[i]``'s
        slot, copied by one call (no sort, no run search: their Python cost is most of a
        small row's copy)."""
        copied = 0
        path = self.path
        if self._basic:  # the usual case: each row one assignment from a view of its slot
            row = self._row
            for r, s in enumerate(samples.tolist()):
                slot = slots.get((path, s))
                if slot is None:
                    if skip_missing:
                        continue
                    raise KeyError((path, s))
                out[r] = slot[row]
                copied += 1
            return copied
        one = slice(0, 1)
        for r, s in enumerate(samples.tolist()):
            key = (path, s)
            if skip_missing and key not in slots:
                continue
            self._copy(out, slice(r, r + 1), slots[key], one)
            copied += 1
        return copied
