"""The fields a :class:`~insitubatch_nodes.forcings.Forcings` remembers of the times it
computed: :class:`Memo`, one per grid, found by a sorted index of the times."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Memo"]


class Memo:
    """The fields of up to ``budget`` bytes of times (:data:`~insitubatch_nodes.forcings.
    MEMO_BYTES`), held as one table per forcing and found
    by a sorted index of the times: a batch's lookups and additions are a few numpy calls
    whatever its rows (a dict per time cost Python per row: 190,000 lines a batch of 4,096
    rows). A full memo forgets its oldest times first (each new time takes the slot of the
    oldest).

    Each table is made once, for ``capacity`` times, at the first addition (``np.empty``: its
    pages are taken as times fill them, so the memory held is the times held, :attr:`nbytes`).
    Before 2026-12-07 the tables grew by doubling, each growth a copy into a new table: filling
    192 times of two forcings on a 64 x 128 grid (12 MiB) grew the resident set by 44.6 MiB —
    the tables left behind stay with ``malloc`` (:func:`~insitubatch_nodes._process.
    tune_allocator` keeps buffers for reuse) — while ``pipe.stats()`` counted 22 MiB."""

    def __init__(
        self, names: Sequence[str], grid: tuple[int, ...], shares: int, budget: int
    ) -> None:
        self.names = tuple(names)
        self.grid = grid
        per_time = max(1, len(self.names) * math.prod(grid) * 4)
        self._per_time = per_time
        # (``shares`` memos, one per grid of a collection's members, share the bytes)
        self.capacity = max(1, budget // (per_time * shares))  # at least one time
        self.keys = np.empty(0, np.int64)  # the time in each slot
        self.fields = {name: np.empty((0, *grid), np.float32) for name in self.names}
        self.oldest = 0  # once full: the slot the next new time takes
        self._sorted = np.empty(0, np.int64)  # the times in order, and their slots
        self._slots = np.empty(0, np.intp)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held: the tables' rows of the times held (their pages; the rest of each table
        is never touched) and the index."""
        index = self.keys.nbytes + self._sorted.nbytes + self._slots.nbytes
        return index + len(self.keys) * self._per_time

    def most_bytes(self, times: int | None = None) -> int:
        """The most :attr:`nbytes` grows to: ``capacity`` times, or ``times`` where fewer
        distinct times can be met (each row with its index entries: three 8-byte words)."""
        held = self.capacity if times is None else min(self.capacity, max(0, times))
        return held * (self._per_time + 24)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each of ``keys`` (sorted, distinct), ``-1`` where it is not held."""
        if not len(self._sorted):
            return np.full(len(keys), -1, np.intp)
        at = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
        return np.where(self._sorted[at] == keys, self._slots[at], -1)

    def add(self, keys: np.ndarray, fields: Mapping[str, np.ndarray]) -> None:
        """Remember ``fields`` (``{name: (len(keys), *grid)}``) of ``keys`` (sorted, distinct,
        held ones are skipped): the last of them, in order, where they are more than it
        holds."""
        new = self.find(keys) < 0  # (another thread may have added some meanwhile)
        keys, fields = keys[new], {name: v[new] for name, v in fields.items()}
        keep = min(len(keys), self.capacity)
        keys = keys[len(keys) - keep :]
        grow = min(self.capacity - len(self.keys), keep)
        if grow > 0 and not len(self.keys):  # the first: the tables, once (class docstring)
            self.fields = {
                name: np.empty((self.capacity, *self.grid), np.float32) for name in self.names
            }
        n = len(self.keys)
        slots = np.concatenate(
            [np.arange(n, n + grow), (self.oldest + np.arange(keep - grow)) % self.capacity]
        ).astype(np.intp)
        if keep > grow:
            self.oldest = int(slots[-1] + 1) % self.capacity
        for name in self.names:
            self.fields[name][slots] = fields[name][len(fields[name]) - keep :]
        forgotten = slots[slots < n]
        self.keys = np.concatenate([self.keys, np.empty(grow, np.int64)])
        self.keys[slots] = keys
        held = np.ones(len(self._sorted), bool)
        if len(forgotten):  # their old times leave the index
            held[np.isin(self._slots, forgotten)] = False
        at = np.searchsorted(self._sorted[held], keys)  # both sorted: a merge
        self._sorted = np.insert(self._sorted[held], at, keys)
        self._slots = np.insert(self._slots[held], at, slots)
