"""What an epoch plan is: the order ledger of an epoch and each batch's chunk reads.

:class:`EpochPlan` is one epoch of one rank (drawn by
:func:`~insitubatch_nodes.plan.epoch.plan_epoch`). Its :class:`ChunkLedger` s, one per group of
arrays read alike, say as numpy arrays which chunks each batch fetches first and releases last;
:class:`BatchPlan` is one batch of it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.patches import WindowUnits
from insitubatch_nodes.plan.quality import shuffle_quality

__all__ = ["BatchPlan", "ChunkKey", "ChunkLedger", "EpochPlan", "Stage"]


ChunkKey = tuple[str, int]
"""A stored chunk row: ``(array path, chunk index along that array's sample axis)``; it stands
for all of the chunk's field tiles."""


Stage = tuple[int, int]
"""An elastic-resume cut: ``(world_size, batches_emitted)`` — the world size an interrupted epoch
was running under and how many batches each of its ranks had delivered when it was saved."""


@dataclass(frozen=True, eq=False)
class ChunkLedger:
    """Every use of one *plan group*'s chunks in one epoch, as numpy arrays (read-only).

    Arrays whose views chunk the sample axis alike and sit at the same offsets (the sixty
    arrays of a reanalysis archive, read as one label each) read the same chunk indices in the
    same rows, so one ledger serves all of ``paths``: its size is the sample axis, not
    samples x arrays. A *segment* is one use of one chunk: from its first reading row to its
    last (a chunk read again after more than ``pin_gap`` idle batches has a second segment).
    Segments are stored in ``(chunk, first)`` order; ``by_first``/``fetch_ptr`` list the
    segments each batch fetches (CSR over the epoch's local batches), ``by_last``/
    ``release_ptr`` those it releases.
    """

    paths: tuple[str, ...]
    path_rank: tuple[int, ...]  # each path's position among the plan's paths (label order)
    samples_per_chunk: int
    offsets: tuple[int, ...]  # the views' offsets, sorted (a path read by two labels: twice)
    chunk: np.ndarray  # (S,) chunk index of each segment
    first: np.ndarray  # (S,) first row reading it (rows of this plan's ledger)
    last: np.ndarray  # (S,) last row reading it
    by_first: np.ndarray  # segment indices in first-need order
    fetch_ptr: np.ndarray  # (local batches + 1,): by_first[fetch_ptr[b]:fetch_ptr[b + 1]]
    by_last: np.ndarray  # segment indices in last-need order
    release_ptr: np.ndarray  # (local batches + 1,): by_last[release_ptr[b]:...]
    #: a patched group: its "chunks" are units (one stored tile each), which rows' windows read
    windows: WindowUnits | None = None

    @property
    def n_segments(self) -> int:
        return int(self.chunk.shape[0])

    @functools.cached_property
    def n_chunks(self) -> int:
        """How many distinct chunks (units, for a patched group) the ledger reads: segments
        are in chunk order, so one pass, no sort (asked once per epoch by several parts)."""
        c = self.chunk
        return int(np.count_nonzero(c[1:] != c[:-1])) + 1 if len(c) else 0

    def fetched(self, at: int) -> np.ndarray:
        """Segments local batch ``at`` fetches, in first-need order."""
        return self.by_first[self.fetch_ptr[at] : self.fetch_ptr[at + 1]]

    def released(self, at: int) -> np.ndarray:
        """Segments local batch ``at`` reads for the last time, in last-need order."""
        return self.by_last[self.release_ptr[at] : self.release_ptr[at + 1]]

    def carried(self, at: int, batch_size: int) -> np.ndarray:
        """Segments first read before local batch ``at`` and read again at or after it, in
        first-need order."""
        seg = self.by_first[: self.fetch_ptr[at]]
        return seg[self.last[seg] // batch_size >= at]

    def next_reads(
        self,
        segments: np.ndarray,
        start: int,
        anchors: np.ndarray,
        origins: np.ndarray | None = None,
    ) -> np.ndarray:
        """The row at or after row ``start`` that next reads each of ``segments`` (each read
        there: a carried segment, see :meth:`carried`). ``anchors`` (and window ``origins``)
        are the plan's rows from ``start`` on."""
        if not len(segments):
            return np.zeros(0, dtype=np.int64)
        upto = int(self.last[segments].max()) + 1 - start  # rows past every segment's last
        anchors = anchors[:upto]
        if self.windows is not None:
            assert origins is not None, "a patched ledger needs the rows' origins"
            cid, row = self.windows.uses(anchors, origins[:upto])
        else:
            offsets = sorted(set(self.offsets))
            cid = np.concatenate([(anchors + k) // self.samples_per_chunk for k in offsets])
            row = np.tile(np.arange(len(anchors), dtype=np.int64), len(offsets))
        # the smallest row reading each chunk, over the chunks these rows read (a segment's
        # chunk is among them: it is read again after ``start``)
        lo = int(cid.min())
        first = np.full(int(cid.max()) - lo + 1, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, cid - lo, row)
        return start + first[self.chunk[segments] - lo]

    def first_need(self, chunks: np.ndarray) -> np.ndarray:
        """The row that first reads each of ``chunks`` this epoch (each must be read)."""
        heads = np.flatnonzero(np.r_[True, self.chunk[1:] != self.chunk[:-1]])
        return self.first[heads[np.searchsorted(self.chunk[heads], chunks)]]

    def read_by(self, anchors: np.ndarray, origins: np.ndarray | None = None) -> np.ndarray:
        """The distinct chunks (units, in a patched group) the rows with ``anchors`` (and
        window ``origins``) read (ascending)."""
        if self.windows is not None:
            assert origins is not None, "a patched ledger needs the rows' origins"
            return sorted_unique(self.windows.uses(anchors, origins)[0])
        spc = self.samples_per_chunk
        offsets = sorted(set(self.offsets))
        if len(offsets) == 1:
            cid = (anchors + offsets[0]) // spc
        else:
            cid = np.concatenate([(anchors + k) // spc for k in offsets])
        return sorted_unique(cid)

    def keys(
        self, segments: np.ndarray, rows: np.ndarray, names: Mapping[str, int] | None = None
    ) -> list[tuple[int, int, int, ChunkKey]]:
        """``(row, rank, chunk, key)`` sort keys of ``segments``' chunks for every path (the
        tuple form of the plan: see :meth:`EpochPlan.batch_fetches`)."""
        chunks = self.chunk[segments].tolist()
        at = rows.tolist()
        out: list[tuple[int, int, int, ChunkKey]] = []
        for path, rank in zip(self.paths, self.path_rank, strict=True):
            r = rank if names is None else names[path]
            out.extend((w, r, c, (path, c)) for w, c in zip(at, chunks, strict=True))
        return out


def _tuple_order(entries: list[tuple[int, int, int, ChunkKey]]) -> tuple[ChunkKey, ...]:
    entries.sort(key=lambda e: e[:3])
    return tuple(e[3] for e in entries)


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What one batch holds and reads. Arrays are int64 and must not be modified.

    ``reads``, ``fetches`` and ``releases`` are the tuple form, built on first access: the
    pipeline itself works from the epoch plan's :class:`ChunkLedger` s
    (:meth:`EpochPlan.ledger_fetches`, :meth:`chunks_read`), O(1) Python per plan group.
    """

    epoch: int
    index: int
    n_batches: int
    rows: np.ndarray  # (len, 2): anchor-grid (chunk_id, within)
    anchors: np.ndarray  # (len,): anchor sample index of each row (before any view's offset)
    sample_indices: Mapping[str, np.ndarray]  # label -> (len,) sample-axis index read
    blocks: tuple[int, ...]
    epoch_plan: EpochPlan = field(repr=False)
    #: a patched plan: (len, n_patch_axes) window origin of each row (else None)
    origins: np.ndarray | None = None
    #: label -> the origins of its windows (every patched label; the same array)
    patch_origins: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def chunks_read(self, ledger: int) -> np.ndarray:
        """Distinct chunks (ascending) this batch reads of the arrays of ledger ``ledger``."""
        return self.epoch_plan.ledgers[ledger].read_by(self.anchors, self.origins)

    @functools.cached_property
    def reads(self) -> tuple[ChunkKey, ...]:
        """Every stored chunk row the batch gathers from, in first-need order."""
        entries: list[tuple[int, int, int, ChunkKey]] = []
        for ledger in self.epoch_plan.ledgers:
            chunks = ledger.read_by(self.anchors, self.origins)
            rows = ledger.first_need(chunks)
            for path, rank in zip(ledger.paths, ledger.path_rank, strict=True):
                entries.extend(
                    (w, rank, c, (path, c))
                    for w, c in zip(rows.tolist(), chunks.tolist(), strict=True)
                )
        return _tuple_order(entries)

    @functools.cached_property
    def fetches(self) -> tuple[ChunkKey, ...]:
        """Chunks this batch is the first to read (see :meth:`EpochPlan.batch_fetches`)."""
        return self.epoch_plan.batch_fetches(self.index)

    @functools.cached_property
    def releases(self) -> tuple[ChunkKey, ...]:
        """Chunks this batch reads for the last time (see :meth:`EpochPlan.batch_releases`)."""
        return self.epoch_plan.batch_releases(self.index)


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """One rank's plan for one epoch (see the module docstring for how it is drawn).

    Batches are numbered from the epoch's start. An elastic remainder (``resumed`` non-empty,
    see :func:`plan_epoch`) holds batches ``first_batch .. n_batches - 1`` only: its ranks had
    delivered the first ``first_batch`` batches under another world size.

    Which chunks each batch fetches and releases lives in ``ledgers`` (one
    :class:`ChunkLedger` per plan group, numpy); the ``batch_*`` methods and
    :meth:`distinct_chunks` give the same as tuples of ``(path, chunk)`` keys.
    """

    epoch: int
    rank: int
    world_size: int
    batch_size: int
    block_chunks: int
    samples_per_chunk: int
    chunks: np.ndarray  # this rank's anchor chunks, in visiting order
    order: np.ndarray  # (N, 2) ledger (chunk_id, within)
    views: Mapping[str, ArrayGeometry]  # label -> the view it reads
    pin_gap: int | None  # the residency schedule this epoch uses (None = read-once)
    first_batch: int  # batches of this epoch delivered before this plan (elastic resume)
    resumed: tuple[Stage, ...]  # the elastic cuts this epoch went through, oldest first
    ledgers: tuple[ChunkLedger, ...] = field(repr=False)
    _block_of_row: np.ndarray = field(repr=False)
    _block_of_chunk: np.ndarray = field(repr=False)
    #: a patched plan: (N, n_patch_axes) window origin of every row (else None)
    origins: np.ndarray | None = field(default=None, repr=False)
    #: anchors of the split the missing-step checks dropped, per reason ({"nat": 3, ...};
    #: empty without the checks), the same for every epoch and rank
    dropped: Mapping[str, int] = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        return int(self.order.shape[0])

    @property
    def n_batches(self) -> int:
        """Batches in the epoch, counted from its start (``first_batch`` of them precede
        this plan)."""
        return self.first_batch + math.ceil(self.n_samples / self.batch_size)

    @property
    def batch_indices(self) -> range:
        """The batches this plan holds: ``range(first_batch, n_batches)``."""
        return range(self.first_batch, self.n_batches)

    def _local(self, index: int) -> int:
        if not self.first_batch <= index < self.n_batches:
            raise IndexError(f"batch {index} not in [{self.first_batch}, {self.n_batches})")
        return index - self.first_batch

    @property
    def anchors(self) -> np.ndarray:
        """Anchor sample index of every row of the ledger, in emitted order."""
        return self.order[:, 0] * self.samples_per_chunk + self.order[:, 1]

    @property
    def n_blocks(self) -> int:
        return int(self._block_of_chunk[-1]) + 1 if len(self._block_of_chunk) else 0

    def shuffle_quality(self) -> float:
        """:func:`shuffle_quality` of this epoch's batches (1.0 ≈ a global shuffle)."""
        return shuffle_quality(self.anchors, self.batch_size)

    def distinct_chunks(self) -> list[ChunkKey]:
        """Every stored chunk this rank reads this epoch, in first-need order."""
        entries: list[tuple[int, int, int, ChunkKey]] = []
        for ledger in self.ledgers:
            heads = np.flatnonzero(np.r_[True, ledger.chunk[1:] != ledger.chunk[:-1]])
            if ledger.n_segments:
                entries.extend(ledger.keys(heads, ledger.first[heads]))
        return list(_tuple_order(entries))

    def read_bytes(self, nbytes: Mapping[str, int]) -> int:
        """Bytes of every distinct chunk this rank reads this epoch, ``nbytes[path]`` each
        (what a budget must hold for no re-read): the set of every batch's
        :meth:`batch_fetches`, counted from the ledgers with O(ledgers) Python, not O(chunks)."""
        chunks: dict[str, list[np.ndarray]] = {}
        for ledger in self.ledgers:
            fetched = ledger.chunk[ledger.by_first[ledger.fetch_ptr[0] : ledger.fetch_ptr[-1]]]
            for path in ledger.paths:
                chunks.setdefault(path, []).append(fetched)
        return sum(nbytes[p] * len(np.unique(np.concatenate(c))) for p, c in chunks.items())

    @property
    def n_fetches(self) -> int:
        """Chunk fetches the schedule makes this epoch (``len(distinct_chunks())`` unless a
        ``pin_gap`` releases chunks between uses)."""
        return sum(ledger.n_segments * len(ledger.paths) for ledger in self.ledgers)

    def live_peak(self) -> int:
        """Most chunks live at once (first need <= batch <= last need), over the epoch."""
        n = self.n_batches - self.first_batch
        if n == 0:
            return 0
        delta = np.zeros(n + 1, dtype=np.int64)
        for ledger in self.ledgers:
            delta[:-1] += np.diff(ledger.fetch_ptr) * len(ledger.paths)
            delta[1:] -= np.diff(ledger.release_ptr) * len(ledger.paths)
        return int(np.cumsum(delta).max(initial=0))

    def batch_fetches(self, index: int) -> tuple[ChunkKey, ...]:
        """Chunks to fetch for batch ``index``: those it is the first to read this epoch (or,
        with a ``pin_gap``, the first to read since they were released), in first-need order."""
        at = self._local(index)
        entries: list[tuple[int, int, int, ChunkKey]] = []
        for ledger in self.ledgers:
            seg = ledger.fetched(at)
            entries.extend(ledger.keys(seg, ledger.first[seg]))
        return _tuple_order(entries)

    def batch_releases(self, index: int) -> tuple[ChunkKey, ...]:
        """Chunks batch ``index`` reads for the last time this epoch."""
        at = self._local(index)
        entries: list[tuple[int, int, int, ChunkKey]] = []
        for ledger in self.ledgers:
            seg = ledger.released(at)
            # in last-need order; ties as the segments were made: path, then chunk
            entries.extend(ledger.keys(seg, ledger.last[seg]))
        return _tuple_order(entries)

    def carried_into(self, index: int) -> tuple[ChunkKey, ...]:
        """Chunks first read before batch ``index`` and read again at or after it, in
        first-need order: what a run resumed at ``index`` must fetch again (each with the
        ``fetches`` of the batch that next reads it, not all before batch ``index``)."""
        at = index - self.first_batch
        if at <= 0:
            return ()
        names = {p: i for i, p in enumerate(sorted(self._paths()))}
        entries: list[tuple[int, int, int, ChunkKey]] = []
        for ledger in self.ledgers:
            seg = ledger.carried(min(at, len(ledger.fetch_ptr) - 1), self.batch_size)
            entries.extend(ledger.keys(seg, ledger.first[seg], names))
        return _tuple_order(entries)

    def _paths(self) -> list[str]:
        return [p for ledger in self.ledgers for p in ledger.paths]

    def batch(self, index: int) -> BatchPlan:
        """The plan of batch ``index`` (0-based) of this epoch."""
        at = self._local(index)
        lo, hi = at * self.batch_size, min((at + 1) * self.batch_size, self.n_samples)
        rows = self.order[lo:hi]
        anchors = rows[:, 0] * self.samples_per_chunk + rows[:, 1]
        anchors.setflags(write=False)
        by_offset: dict[int, np.ndarray] = {}
        sample_indices: dict[str, np.ndarray] = {}
        for label, geom in self.views.items():
            samples = by_offset.get(geom.offset)
            if samples is None:  # labels at one offset share one (read-only) array
                samples = by_offset[geom.offset] = anchors + geom.offset
                samples.setflags(write=False)
            sample_indices[label] = samples
        origins = None if self.origins is None else self.origins[lo:hi]
        return BatchPlan(
            epoch=self.epoch,
            index=index,
            n_batches=self.n_batches,
            rows=rows,
            anchors=anchors,
            sample_indices=sample_indices,
            blocks=tuple(sorted_unique(self._block_of_row[lo:hi]).tolist()),
            epoch_plan=self,
            origins=origins,
            patch_origins={
                label: origins
                for label, geom in self.views.items()
                if origins is not None and geom.patch is not None
            },
        )


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` of a 1-D int array by sorting (numpy's hash-based path is far slower on
    millions of keys)."""
    out = np.sort(values)
    return out[np.concatenate([[True], out[1:] != out[:-1]])] if len(out) else out
