"""The read plan: which samples each batch holds and which stored chunks it reads.

Everything here is a pure function of ``(seed, epoch)`` and the configuration, computed with
vectorised numpy (O(samples) array work per epoch, O(chunks) Python per batch):

1. the split's anchor-grid chunks are permuted (``shuffle=True``) or kept in order;
2. with several ranks, :func:`deal` hands each rank the same number of samples — the
   ``V // world_size`` (``remainder="drop"``) or ``ceil(V / world_size)`` (``"pad"``) of the
   ``V`` valid anchors: whole chunks round-robin while they last, then consecutive pieces of the
   remaining (*tail*) chunks' samples; so at most ``world_size - 1`` samples sit out (or are
   repeated) per epoch, and only tail chunks are read by more than one rank;
3. each rank cuts its chunks into *blocks* of ``block_chunks`` chunks and shuffles all valid
   anchors within each block; the result is the *order ledger*, rows ``(chunk_id, within)``.
   With ``ramp=True`` (and shuffling) the epoch's first block is split in two: a lead block of
   just enough chunks to fill one batch, then the rest — so the first batch waits for those few
   chunks instead of (nearly) the whole block;
4. batches are cut over the whole ledger: ``ceil(N / batch_size)`` batches, only the last short.

**Valid anchors.** An anchor ``a`` of the split is emitted only if every view's sample
``a + offset`` lies in the array *and*, by default, on an anchor-grid chunk of the same split
(``(a + offset) // samples_per_chunk`` is one of the split's chunks), so no window reads a sample
of another split. ``cross_split_windows=True`` drops the second condition (windows may read
across the split's edge). In each chunk the valid anchors are one contiguous run, so a chunk's
count is a constant of the configuration and every epoch, rank and resume stays exact.

Each :class:`BatchPlan` says which stored chunks the batch gathers from (``reads``), which of them
it is the first to need this epoch (``fetches`` — each chunk is fetched once per epoch) and which
it reads for the last time (``releases`` — the pool may unpin them once the batch is gathered).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes._checks import check_bool, check_int, check_optional_int
from insitubatch_nodes.geometry import ArrayGeometry
from insitubatch_nodes.residency import working_set_bytes
from insitubatch_nodes.splits import SPLITS, SplitManifest

__all__ = [
    "REMAINDERS",
    "BatchPlan",
    "ChunkKey",
    "ChunkLedger",
    "EpochPlan",
    "PinSchedule",
    "ReadPlanNode",
    "ScheduleFloors",
    "deal",
    "plan_epoch",
    "schedule_floors",
    "shuffle_quality",
]

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

    @property
    def n_segments(self) -> int:
        return int(self.chunk.shape[0])

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

    def first_need(self, chunks: np.ndarray) -> np.ndarray:
        """The row that first reads each of ``chunks`` this epoch (each must be read)."""
        heads = np.flatnonzero(np.r_[True, self.chunk[1:] != self.chunk[:-1]])
        return self.first[heads[np.searchsorted(self.chunk[heads], chunks)]]

    def read_by(self, anchors: np.ndarray) -> np.ndarray:
        """The distinct chunks the rows with ``anchors`` read (ascending)."""
        spc = self.samples_per_chunk
        offsets = sorted(set(self.offsets))
        if len(offsets) == 1:
            cid = (anchors + offsets[0]) // spc
        else:
            cid = np.concatenate([(anchors + k) // spc for k in offsets])
        return _sorted_unique(cid)

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

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def chunks_read(self, ledger: int) -> np.ndarray:
        """Distinct chunks (ascending) this batch reads of the arrays of ledger ``ledger``."""
        return self.epoch_plan.ledgers[ledger].read_by(self.anchors)

    @functools.cached_property
    def reads(self) -> tuple[ChunkKey, ...]:
        """Every stored chunk row the batch gathers from, in first-need order."""
        entries: list[tuple[int, int, int, ChunkKey]] = []
        for ledger in self.epoch_plan.ledgers:
            chunks = ledger.read_by(self.anchors)
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
    labels: Mapping[str, ArrayGeometry]
    pin_gap: int | None  # the residency schedule this epoch uses (None = read-once)
    first_batch: int  # batches of this epoch delivered before this plan (elastic resume)
    resumed: tuple[Stage, ...]  # the elastic cuts this epoch went through, oldest first
    ledgers: tuple[ChunkLedger, ...] = field(repr=False)
    _block_of_row: np.ndarray = field(repr=False)
    _block_of_chunk: np.ndarray = field(repr=False)

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

    @property
    def n_fetches(self) -> int:
        """Chunk fetches the schedule makes this epoch (``len(distinct_chunks())`` unless a
        ``pin_gap`` releases chunks between uses)."""
        return sum(ledger.n_segments * len(ledger.paths) for ledger in self.ledgers)

    def fetch_counts(self) -> np.ndarray:
        """Chunk fetches of each local batch (all arrays)."""
        out = np.zeros(self.n_batches - self.first_batch, dtype=np.int64)
        for ledger in self.ledgers:
            out += np.diff(ledger.fetch_ptr) * len(ledger.paths)
        return out

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
        first-need order: what a run resumed at ``index`` must fetch before that batch's own
        ``fetches``."""
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

    def batch_first_block(self, index: int) -> int:
        """Block of the first row of batch ``index``."""
        return int(self._block_of_row[self._local(index) * self.batch_size])

    def batch(self, index: int) -> BatchPlan:
        """The plan of batch ``index`` (0-based) of this epoch."""
        at = self._local(index)
        lo, hi = at * self.batch_size, min((at + 1) * self.batch_size, self.n_samples)
        rows = self.order[lo:hi]
        anchors = rows[:, 0] * self.samples_per_chunk + rows[:, 1]
        anchors.setflags(write=False)
        by_offset: dict[int, np.ndarray] = {}
        sample_indices: dict[str, np.ndarray] = {}
        for label, geom in self.labels.items():
            samples = by_offset.get(geom.offset)
            if samples is None:  # labels at one offset share one (read-only) array
                samples = by_offset[geom.offset] = anchors + geom.offset
                samples.setflags(write=False)
            sample_indices[label] = samples
        return BatchPlan(
            epoch=self.epoch,
            index=index,
            n_batches=self.n_batches,
            rows=rows,
            anchors=anchors,
            sample_indices=sample_indices,
            blocks=tuple(int(b) for b in np.unique(self._block_of_row[lo:hi])),
            epoch_plan=self,
        )


def _ramp_unit(enabled: bool, samples_per_chunk: int, batch_size: int) -> int:
    """Chunks in the lead block (0 = no ramp): enough to fill one batch."""
    return math.ceil(batch_size / samples_per_chunk) if enabled else 0


def block_index(n_chunks: int, block_chunks: int, lead: int = 0) -> np.ndarray:
    """Block of each chunk position: blocks of ``block_chunks``, except that with
    ``0 < lead < block_chunks`` the first block is split into ``lead`` chunks and the rest."""
    sizes = [lead, block_chunks - lead] if 0 < lead < block_chunks else []
    covered = sum(sizes)
    sizes.extend([block_chunks] * max(0, math.ceil((n_chunks - covered) / block_chunks)))
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)[:n_chunks]


def _valid_anchor_range(n_samples: int, offsets: Sequence[int]) -> tuple[int, int]:
    """Anchors ``a`` with ``0 <= a + k < n_samples`` for every offset ``k``."""
    lo = max(0, -min(offsets))
    hi = min(n_samples, n_samples - max(offsets))
    return lo, max(lo, hi)


def _chunk_counts(
    manifest: SplitManifest,
    split: str,
    chunks: np.ndarray,
    offsets: Sequence[int],
    cross_split_windows: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """First valid anchor and number of valid anchors in each of ``chunks`` (see the module
    docstring for the rule). Element-wise: the order of ``chunks`` does not matter."""
    spc, n = manifest.samples_per_chunk, manifest.n_samples
    lo, hi = _valid_anchor_range(n, offsets)
    start = np.maximum(chunks * spc, lo)
    stop = np.minimum(np.minimum((chunks + 1) * spc, n), hi)
    if not cross_split_windows:
        member = np.zeros(manifest.n_chunks + 2, dtype=bool)  # index -1 and n_chunks: outside
        member[np.asarray(manifest.chunks(split), dtype=np.int64)] = True

        def in_split(d: np.ndarray) -> np.ndarray:
            return member[np.clip(d, -1, manifest.n_chunks)]

        for k in set(offsets):
            # the samples a + k of chunk c's anchors fall in anchor-grid chunks d and d + 1;
            # anchors from `edge` on read d + 1
            d = (chunks * spc + k) // spc
            edge = (d + 1) * spc - k
            start = np.where(in_split(d), start, np.maximum(start, edge))
            stop = np.where(in_split(d + 1), stop, np.minimum(stop, edge))
    return start, np.maximum(stop - start, 0)


REMAINDERS = ("drop", "pad")


def samples_per_rank(n_samples: int, world_size: int, remainder: str = "drop") -> int:
    """Samples each of ``world_size`` ranks emits from ``n_samples``: ``floor`` (``"drop"``:
    at most ``world_size - 1`` sit out) or ``ceil`` (``"pad"``: at most ``world_size - 1``
    are repeated) of ``n_samples / world_size``."""
    if remainder == "pad":
        return -(-n_samples // world_size)
    return n_samples // world_size


def deal(
    counts: np.ndarray,
    world_size: int,
    *,
    remainder: str = "drop",
    pad_seed: Sequence[int] = (0,),
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Deal ``counts[g]`` samples of each group ``g`` (a chunk, in visiting order) to ranks.

    Each rank gets exactly :func:`samples_per_rank` samples. Whole groups are dealt
    round-robin (group ``k * world_size + r`` to rank ``r``) for as many rounds as no rank
    goes over its share; the samples of the groups left (the *tail*) are then laid end to end
    and cut into consecutive pieces, rank 0 first, each rank taking what its share still
    lacks. ``"drop"``: the last ``sum(counts) % world_size`` tail samples sit out.
    ``"pad"``: ``(-sum(counts)) % world_size`` samples, drawn without replacement from all
    samples by ``numpy.random.default_rng([*pad_seed, 2])`` (with replacement only when there
    are fewer samples than pads), are appended to the tail (each a
    piece of its own), so none sits out and those few are delivered twice.

    A tail group is read by every rank whose piece touches it: pieces are consecutive, so at
    most ``world_size - 1`` groups are split, plus one group per padded sample.

    Returns, for each rank, ``(group, lo, count)``: the rank's pieces, each the samples
    ``[lo, lo + count)`` (positions within the group) of group ``group`` — its whole groups in
    visiting order, then its (at most two) partial pieces, then its padded samples. Pure.
    """
    counts = np.asarray(counts, dtype=np.int64)
    w = int(world_size)
    n_groups, total = len(counts), int(counts.sum())
    share = samples_per_rank(total, w, remainder)
    rounds_max = n_groups // w
    cum = np.cumsum(counts[: rounds_max * w].reshape(rounds_max, w), axis=0)
    fits = (cum <= share).all(axis=1)
    rounds = int(rounds_max if fits.all() else np.argmin(fits))
    owned = cum[rounds - 1] if rounds else np.zeros(w, dtype=np.int64)
    need = share - owned
    cuts = np.concatenate([[0], np.cumsum(need)])
    tail = np.arange(rounds * w, n_groups, dtype=np.int64)
    tail_end = np.cumsum(counts[tail])
    tail_start = tail_end - counts[tail]
    n_tail = int(tail_end[-1]) if len(tail) else 0
    n_pad = max(0, int(cuts[-1]) - n_tail)
    pads = np.zeros(0, dtype=np.int64)
    if n_pad:
        # without replacement, unless fewer samples than pads are left (an elastic remainder)
        rng = np.random.default_rng([*map(int, pad_seed), 2])
        flat = rng.choice(total, n_pad, replace=n_pad > total)
        ends = np.cumsum(counts)
        pad_group = np.searchsorted(ends, flat, side="right")
        pads = np.stack([pad_group, flat - (ends[pad_group] - counts[pad_group])], axis=1)
    out = []
    for r in range(w):
        mine = np.arange(rounds, dtype=np.int64) * w + r
        groups, los, sizes = [mine], [np.zeros(rounds, dtype=np.int64)], [counts[mine]]
        a, b = int(cuts[r]), int(cuts[r + 1])
        ta, tb = min(a, n_tail), min(b, n_tail)
        if tb > ta:
            first = int(np.searchsorted(tail_end, ta, side="right"))
            last = int(np.searchsorted(tail_end, tb - 1, side="right"))
            sel = np.arange(first, last + 1)
            lo = np.maximum(tail_start[sel], ta) - tail_start[sel]
            hi = np.minimum(tail_end[sel], tb) - tail_start[sel]
            # whole tail chunks first, then the (at most two) partial pieces: a rank's ledger
            # is whole chunks up to its last block (what schedule_floors relies on)
            partial = (hi - lo) < counts[tail[sel]]
            keep = np.concatenate([np.flatnonzero((hi > lo) & ~partial), np.flatnonzero(partial)])
            groups.append(tail[sel][keep])
            los.append(lo[keep])
            sizes.append((hi - lo)[keep])
        pa, pb = max(a, n_tail) - n_tail, max(b, n_tail) - n_tail
        if pb > pa:
            groups.append(pads[pa:pb, 0])
            los.append(pads[pa:pb, 1])
            sizes.append(np.ones(pb - pa, dtype=np.int64))
        out.append(tuple(np.concatenate(x).astype(np.int64) for x in (groups, los, sizes)))
    return out  # type: ignore[return-value]


def _epoch_samples(
    manifest: SplitManifest,
    labels: Mapping[str, ArrayGeometry],
    split: str,
    epoch: int,
    shuffle: bool,
    seed: int,
    cross_split_windows: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's rank-independent sample pool: ``(chunks, counts, anchors)`` — the split's
    chunks in visiting order, their valid-anchor counts and all valid anchors laid out chunk
    after chunk (each chunk's ascending)."""
    offsets = [g.offset for g in labels.values()]
    chunks = np.asarray(manifest.chunks(split), dtype=np.int64)
    if shuffle:
        chunks = np.random.default_rng([seed, epoch, 0]).permutation(chunks)
    starts, counts = _chunk_counts(manifest, split, chunks, offsets, cross_split_windows)
    return chunks, counts, _runs(starts, counts)


def _runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1`` for each ``i``, end to end."""
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    pos = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - first[pos])


def _rank_share(
    chunks: np.ndarray,
    counts: np.ndarray,
    anchors: np.ndarray,
    rank: int,
    world_size: int,
    remainder: str,
    pad_seed: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's ``(chunks, counts, anchors)`` of a sample pool laid out as
    :func:`_epoch_samples` lays it (:func:`deal`; the whole pool with one rank). A rank's
    chunk may repeat (a padded sample is a piece of its own)."""
    if world_size == 1:
        return chunks, counts, anchors
    # A chunk with nothing valid (or nothing left) holds nothing to deal.
    first = np.cumsum(counts) - counts
    keep = counts > 0
    chunks, counts, first = chunks[keep], counts[keep], first[keep]
    group, lo, size = deal(counts, world_size, remainder=remainder, pad_seed=pad_seed)[rank]
    return chunks[group], size, anchors[_runs(first[group] + lo, size)]


def _ledger(
    counts: np.ndarray,
    anchors: np.ndarray,
    key_seed: Sequence[int],
    *,
    spc: int,
    batch_size: int,
    block_chunks: int,
    shuffle: bool,
    ramp: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(anchors, block_of_row, block_of_chunk)`` in emitted order: one rank's pieces cut into
    blocks, shuffled within each block (by ``default_rng(key_seed)``), rows of a batch sorted."""
    total = int(counts.sum())
    chunk_pos = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    block_of_chunk = block_index(
        len(counts), block_chunks, _ramp_unit(ramp and shuffle, spc, batch_size)
    )
    block = block_of_chunk[chunk_pos]
    if shuffle and total:
        keys = np.random.default_rng(list(key_seed)).random(total)
        perm = np.lexsort((keys, block))
        anchors, block = anchors[perm], block[perm]
    # Within a batch, rows go in anchor order. The batch holds the same samples as before, but
    # each chunk's rows are now one contiguous run for every label, so the gather makes one
    # copy per chunk straight into the batch instead of a gather plus a scatter.
    in_batch = np.lexsort((anchors, np.arange(total, dtype=np.int64) // batch_size))
    return anchors[in_batch], block[in_batch], block_of_chunk


def _stage_seeds(seed: int, epoch: int, rank: int, stage: int) -> tuple[list[int], list[int]]:
    """``(pad_seed, key_seed)`` of an epoch's stage: stage 0 is the epoch as first planned,
    stage ``s >= 1`` the remainder after the ``s``-th elastic cut."""
    if stage == 0:
        return [seed, epoch], [seed, epoch, 1, rank]
    return [seed, epoch, 3, stage], [seed, epoch, 4, stage, rank]


def plan_epoch(
    manifest: SplitManifest,
    labels: Mapping[str, ArrayGeometry],
    *,
    split: str = "train",
    epoch: int = 0,
    batch_size: int = 32,
    block_chunks: int = 16,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    ramp: bool = True,
    pin_gap: int | None = None,
    cross_split_windows: bool = False,
    remainder: str = "drop",
    resumed: Sequence[Stage] = (),
) -> EpochPlan:
    """Draw one rank's plan for one epoch. Pure: same arguments, same plan.

    ``pin_gap=None`` keeps each chunk from its first reading batch to its last (each chunk is
    fetched once per epoch). With ``pin_gap=g`` a chunk that goes more than ``g`` batches
    without being read is released and fetched again at its next use — the schedule for a
    budget too small to hold shifted views' neighbours across the epoch.
    ``cross_split_windows`` is the anchor rule of the module docstring.

    ``resumed`` (elastic resume) lists the cuts this epoch went through, oldest first:
    ``(W, k)`` says that each rank of a ``W``-rank run had delivered its first ``k`` batches of
    the epoch (counted from the epoch's start, so ``k`` grows from cut to cut). The plan is then
    the epoch's *remainder* for ``world_size`` ranks: the valid samples no earlier rank
    delivered, grouped by chunk in the epoch's visiting order and dealt by :func:`deal` as a
    fresh epoch's are, its batches numbered from the last cut's ``k``
    (:attr:`EpochPlan.first_batch`).
    """
    spc = manifest.samples_per_chunk
    chunks, counts, anchors = _epoch_samples(
        manifest, labels, split, epoch, shuffle, seed, cross_split_windows
    )
    ledger = functools.partial(
        _ledger,
        spc=spc,
        batch_size=batch_size,
        block_chunks=block_chunks,
        shuffle=shuffle,
        ramp=ramp,
    )
    done = 0  # batches each rank of the previous stage had delivered
    for stage, (w_old, k_old) in enumerate(resumed):
        taken = []
        for r in range(w_old):
            pad_seed, key_seed = _stage_seeds(seed, epoch, r, stage)
            _, rc, ra = _rank_share(chunks, counts, anchors, r, w_old, remainder, pad_seed)
            taken.append(ledger(rc, ra, key_seed)[0][: (k_old - done) * batch_size])
        left = ~np.isin(anchors, np.concatenate(taken))
        group = np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
        counts = np.bincount(group[left], minlength=len(chunks)).astype(np.int64)
        anchors, done = anchors[left], k_old
    if resumed:  # chunks with nothing left take no place in the remainder's blocks
        keep = counts > 0
        chunks, counts = chunks[keep], counts[keep]
    pad_seed, key_seed = _stage_seeds(seed, epoch, rank, len(resumed))
    chunks, counts, anchors = _rank_share(
        chunks, counts, anchors, rank, world_size, remainder, pad_seed
    )
    anchors, block, block_of_chunk = ledger(counts, anchors, key_seed)
    n_emit = len(anchors)
    order = np.stack([anchors // spc, anchors % spc], axis=1)
    order.setflags(write=False)

    n_batches = math.ceil(n_emit / batch_size)
    gap = n_batches if pin_gap is None else int(pin_gap)
    return EpochPlan(
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        block_chunks=block_chunks,
        samples_per_chunk=spc,
        chunks=chunks,
        order=order,
        labels=dict(labels),
        pin_gap=pin_gap,
        first_batch=done,
        resumed=tuple((int(w), int(k)) for w, k in resumed),
        ledgers=_ledgers(labels, anchors, batch_size, n_batches, gap),
        _block_of_row=block,
        _block_of_chunk=block_of_chunk,
    )


def plan_groups(
    labels: Mapping[str, ArrayGeometry],
) -> list[tuple[int, tuple[int, ...], list[str]]]:
    """``(samples_per_chunk, offsets, paths)`` of each plan group: the arrays whose views chunk
    the sample axis alike and sit at the same (sorted) offsets, in label order. Such arrays
    read the same chunk indices in the same rows of every plan."""
    views: dict[str, list[ArrayGeometry]] = {}
    for g in labels.values():
        views.setdefault(g.path, []).append(g)
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for path, vs in views.items():
        key = (vs[0].samples_per_chunk, tuple(sorted(g.offset for g in vs)))
        groups.setdefault(key, []).append(path)
    return [(spc, offsets, paths) for (spc, offsets), paths in groups.items()]


def _ledgers(
    labels: Mapping[str, ArrayGeometry],
    anchors: np.ndarray,
    batch_size: int,
    n_batches: int,
    gap: int,
) -> tuple[ChunkLedger, ...]:
    """One :class:`ChunkLedger` per plan group for the rows ``anchors`` (emitted order)."""
    n_emit = len(anchors)
    rank = {path: i for i, path in enumerate(dict.fromkeys(g.path for g in labels.values()))}
    bounds = np.arange(n_batches + 1, dtype=np.int64)
    out = []
    for pspc, offsets, paths in plan_groups(labels):
        if len(set(offsets)) == 1:
            cid = (anchors + offsets[0]) // pspc
            row = np.arange(n_emit, dtype=np.int64)
        else:
            cid = np.concatenate([(anchors + k) // pspc for k in offsets])
            row = np.tile(np.arange(n_emit, dtype=np.int64), len(offsets))
        by = np.lexsort((row, cid))
        cid, row = cid[by], row[by]
        batch = row // batch_size
        # a new use segment starts at a new chunk, or after more than `gap` idle batches
        starts = np.ones(len(cid), dtype=bool)
        starts[1:] = (cid[1:] != cid[:-1]) | (batch[1:] - batch[:-1] > gap)
        s_idx = np.flatnonzero(starts)
        e_idx = np.append(s_idx[1:], len(cid)).astype(np.int64) - 1 if len(cid) else s_idx
        chunk, first, last = cid[s_idx], row[s_idx], row[e_idx]
        by_first = np.argsort(first, kind="stable")
        by_last = np.argsort(last, kind="stable")
        fetch_ptr = np.searchsorted(first[by_first] // batch_size, bounds, side="left")
        release_ptr = np.searchsorted(last[by_last] // batch_size, bounds, side="left")
        for arr in (chunk, first, last, by_first, by_last, fetch_ptr, release_ptr):
            arr.setflags(write=False)
        out.append(
            ChunkLedger(
                paths=tuple(paths),
                path_rank=tuple(rank[p] for p in paths),
                samples_per_chunk=pspc,
                offsets=offsets,
                chunk=chunk,
                first=first,
                last=last,
                by_first=by_first,
                fetch_ptr=fetch_ptr,
                by_last=by_last,
                release_ptr=release_ptr,
            )
        )
    return tuple(out)


def shuffle_quality(
    order: np.ndarray | Sequence[np.ndarray], batch_size: int | None = None, *, seed: int = 0
) -> float:
    """Score how well batches mix the data, against a global shuffle: ~1 = global, 0 = none.

    ``order`` is either the batches as delivered (a sequence of 1-D arrays of sample indices,
    e.g. each batch's ``sample_indices[label]``; a short final batch is ignored) or the
    emitted sequence of sample indices (e.g. ``EpochPlan.anchors``), which is cut into
    consecutive batches of ``batch_size`` (required then). The score is the mean distance
    between two samples of the same batch, divided by the same mean when those samples are
    dealt into batches by a uniformly random permutation (averaged over 16 draws from
    ``seed``). Samples that share a chunk, or sit close together, drag it down: a sequential
    order scores ~0, batches drawn from a handful of chunks score low, and a global shuffle
    scores ~1. It does not depend on the order of rows
    inside a batch (which does not matter to a gradient step) and measures mixing within an
    epoch, not coverage across epochs.
    """
    if isinstance(order, np.ndarray) and order.ndim == 1:
        if batch_size is None:
            raise ValueError("a flat order needs batch_size= to be cut into batches")
        arr = order.astype(np.int64, copy=False)
    else:
        parts = [np.asarray(b, dtype=np.int64).ravel() for b in order]
        if batch_size is None:
            batch_size = max((len(b) for b in parts), default=0)
        full = [b for b in parts if len(b) == batch_size]
        arr = np.concatenate(full) if full else np.zeros(0, dtype=np.int64)
    if batch_size < 2:
        raise ValueError(f"batch_size must be >= 2 to measure mixing, got {batch_size}")
    n_full = arr.size // batch_size
    if n_full == 0 or np.unique(arr).size < 2:
        return 1.0

    def spread(seq: np.ndarray) -> float:
        batches = np.sort(seq[: n_full * batch_size].reshape(n_full, batch_size), axis=1)
        k = np.arange(batch_size, dtype=np.float64)
        # sum over pairs i < j of (x_j - x_i) for sorted rows = sum_j x_j * (2j - (k - 1))
        pair_sums = batches @ (2 * k - (batch_size - 1))
        return float(pair_sums.mean() / (batch_size * (batch_size - 1) / 2))

    rng = np.random.default_rng(seed)
    pool = np.sort(arr)  # the reference depends on which samples, not on their order
    ref = float(np.mean([spread(rng.permutation(pool)) for _ in range(16)]))
    return max(0.0, spread(arr) / ref) if ref > 0 else 1.0


# -- residency schedules -------------------------------------------------------------------------


def block_batches(samples_per_chunk: int, block_chunks: int, batch_size: int) -> int:
    """Batches one full block takes: the ``pin_gap`` of the bounded-memory schedule."""
    return max(1, math.ceil(block_chunks * samples_per_chunk / batch_size))


@dataclass(frozen=True)
class PinSchedule:
    """How long the chunks a plan reads stay pinned, epoch by epoch.

    ``pin_gap=None`` (the default): *read-once* every epoch — a chunk is pinned from the first
    batch that reads it to the last, so it is fetched once per epoch. ``pin_gap=g``: *bounded* — a
    chunk that goes more than ``g`` batches without being read is released and fetched again at
    its next use; except that, with ``read_once_bytes`` set, an epoch whose read-once
    working-set floor (:func:`~insitubatch_nodes.pool.working_set_bytes`) is at most
    ``read_once_bytes`` uses read-once. Each epoch's choice is a function of that epoch's plan
    only, so a resumed run makes the same choice.
    :func:`~insitubatch_nodes.pipeline.choose_schedule` computes the schedule from a budget.
    """

    pin_gap: int | None = None
    read_once_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin_gap", check_optional_int("pin_gap", self.pin_gap, minimum=0))
        object.__setattr__(
            self,
            "read_once_bytes",
            check_optional_int("read_once_bytes", self.read_once_bytes, minimum=0),
        )
        if self.read_once_bytes is not None and self.pin_gap is None:
            raise ValueError(
                "read_once_bytes chooses between read-once and a pin_gap: set pin_gap too "
                "(or leave both None for read-once every epoch)"
            )


@dataclass(frozen=True)
class ScheduleFloors:
    """Upper bounds, valid for *every* epoch, rank, seed, ``shuffle`` and ``ramp``, of the
    working-set floor (:func:`~insitubatch_nodes.pool.working_set_bytes`) of one configuration
    under each schedule, in bytes. ``pin_gap`` is the bounded schedule's gap."""

    read_once: int
    bounded: int
    pin_gap: int

    @property
    def guaranteed(self) -> int:
        """The smallest budget with which every epoch has a schedule that fits."""
        return min(self.read_once, self.bounded)


def check_remainder(remainder: Any) -> str:
    """``remainder`` if it is one of :data:`REMAINDERS`, else ``ValueError``/``TypeError``."""
    if not isinstance(remainder, str):
        raise TypeError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    if remainder not in REMAINDERS:
        raise ValueError(
            f"remainder must be 'drop' (at most world_size - 1 samples sit out each epoch) or "
            f"'pad' (at most world_size - 1 are repeated), got {remainder!r}"
        )
    return remainder


def _check_plan_inputs(
    manifest: Any, variables: Any, split: Any, cross_split_windows: bool
) -> dict[str, ArrayGeometry]:
    """Validate the data a plan is drawn over; the views as a plain dict."""
    if not isinstance(manifest, SplitManifest):
        raise TypeError(f"manifest must be a SplitManifest, got {type(manifest).__name__}")
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(variables, Mapping) or not variables:
        raise ValueError("variables must be a non-empty {label: ArrayGeometry} mapping")
    for label, geom in variables.items():
        if not isinstance(label, str) or not label:
            raise ValueError(f"labels must be non-empty strings, got {label!r}")
        if not isinstance(geom, ArrayGeometry):
            raise TypeError(f"variables[{label!r}] must be an ArrayGeometry, got {geom!r}")
        if geom.n_samples != manifest.n_samples:
            raise ValueError(
                f"variables[{label!r}] ({geom.path}) has {geom.n_samples} samples along its "
                f"sample axis but the manifest's anchor grid has {manifest.n_samples}; all "
                "labels must share the sample-axis length"
            )
    offsets = [g.offset for g in variables.values()]
    lo, hi = _valid_anchor_range(manifest.n_samples, offsets)
    if hi <= lo and manifest.n_samples > 0:
        raise ValueError(
            f"the views' offsets {offsets} leave no valid anchor in an array of "
            f"{manifest.n_samples} samples"
        )
    split_chunks = np.asarray(manifest.chunks(split), dtype=np.int64)
    _, counts = _chunk_counts(manifest, split, split_chunks, offsets, cross_split_windows)
    if len(split_chunks) and not counts.any():
        raise ValueError(
            f"split {split!r} has {len(split_chunks)} chunks, but with the views' offsets "
            f"{offsets} none of its anchors reads only samples of split {split!r}; use a "
            "longer split or shorter windows, or pass cross_split_windows=True to let windows "
            "read across the split's edge"
        )
    return dict(variables)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` of a 1-D int array by sorting (numpy's hash-based path is far slower on
    millions of keys)."""
    out = np.sort(values)
    return out[np.concatenate([[True], out[1:] != out[:-1]])] if len(out) else out


def _anchor_chunk_bytes(
    manifest: SplitManifest,
    variables: Mapping[str, ArrayGeometry],
    chunks: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, int, bool]:
    """For anchor chunks with valid anchors ``[start, start + count)``: the bytes of the
    distinct stored chunks each one's anchors read (all views), the bytes of every chunk any of
    them reads, and whether some stored chunk is read by two different anchor chunks."""
    weight = np.zeros(len(chunks), dtype=np.int64)
    total, shared = 0, False
    nbytes_of = {g.path: g.chunk_nbytes for g in reversed(list(variables.values()))}
    for pspc, offsets, paths in plan_groups(variables):
        # the arrays of a plan group read the same chunks: count them once, weigh by all
        nbytes = sum(nbytes_of[path] for path in paths)
        owners, ids = [], []
        for offset in offsets:
            first = (starts + offset) // pspc
            last = (starts + counts - 1 + offset) // pspc
            span = last - first + 1
            owners.append(np.repeat(np.arange(len(chunks), dtype=np.int64), span))
            step = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(span) - span, span
            )
            ids.append(np.repeat(first, span) + step)
        owner, cid = np.concatenate(owners), np.concatenate(ids)
        # one int64 key per (anchor chunk, stored chunk) pair: 1-D uniques sort fast
        pairs = _sorted_unique(owner * (int(cid.max()) + 1) + cid)
        n_pairs = len(pairs)
        weight += nbytes * np.bincount(pairs // (int(cid.max()) + 1), minlength=len(chunks))
        distinct = len(_sorted_unique(cid))
        total += nbytes * distinct
        shared = shared or distinct < n_pairs
    return weight, total, shared


def _layout_maxima(
    n_chunks: int, block_chunks: int, lead: int, q: int, slack: int, batch_size: int, gap: int
) -> tuple[int, int, int] | None:
    """Most anchor chunks ``(read in g consecutive batches, live at one batch under read-once
    without shared chunks, fetched by the batches of one block)`` for every ledger whose chunks
    hold at most ``q`` rows and ``slack`` rows fewer than ``q`` each in all.

    The blocks of such a ledger lie where they would with ``q`` rows per chunk, each moved
    earlier by at most ``slack`` rows: block ``k`` occupies rows inside
    ``[start_k - slack, end_k)``. ``None`` when that leaves too wide a spread to be useful."""
    sizes = np.bincount(block_index(n_chunks, block_chunks, lead))
    hi = np.cumsum(sizes * q)
    lo = hi - sizes * q - slack
    n_rows = int(hi[-1])
    last = len(sizes) - 1

    def touch(x: np.ndarray, end: np.ndarray, own: np.ndarray | None = None) -> Any:
        k0 = np.searchsorted(hi, x, side="right")  # first block that can end after x
        k1 = np.searchsorted(lo, end, side="left")  # blocks before k1 can start before end
        width = int((k1 - k0).max(initial=0))
        if width > 64:
            return None
        total = np.zeros(len(x), dtype=np.int64)
        for t in range(width):
            k = k0 + t
            kc = np.minimum(k, last)
            overlap = np.minimum(end, hi[kc]) - np.maximum(x, lo[kc])
            overlap = np.where(k < k1, np.maximum(overlap, 0), 0)
            count = np.minimum(sizes[kc], overlap)
            if own is not None:
                count = np.where((k < k1) & (kc == own), sizes[kc], count)
            total += count
        return total, k1 - k0, k0

    batches = np.arange(math.ceil(n_rows / batch_size), dtype=np.int64)
    window = touch(np.maximum(0, (batches - gap + 1) * batch_size), (batches + 1) * batch_size)
    single = touch(batches * batch_size, (batches + 1) * batch_size)
    blocks = np.arange(len(sizes), dtype=np.int64)
    ahead = touch(
        np.maximum(0, lo // batch_size * batch_size),
        -(-hi // batch_size) * batch_size,
        own=blocks,
    )
    if window is None or single is None or ahead is None:
        return None
    # one batch inside one block: that block's chunks may all be live; else what it reads
    once = np.where(single[1] == 1, sizes[np.minimum(single[2], last)], single[0])
    return int(window[0].max()), int(once.max()), int(ahead[0].max())


def schedule_floors(
    manifest: SplitManifest,
    variables: Mapping[str, ArrayGeometry],
    *,
    split: str = "train",
    batch_size: int = 32,
    block_chunks: int = 16,
    cross_split_windows: bool = False,
    remainder: str = "drop",
    world_size: int | None = None,
) -> ScheduleFloors:
    """Permutation-independent upper bounds of each schedule's working-set floor.

    They hold for every epoch, seed and rank of ``world_size`` ranks (default:
    ``torch.distributed``'s, else 1 — as :class:`ReadPlanNode` resolves it), with or without
    ``shuffle`` and ``ramp``; with ``remainder="drop"`` the bounds for any ``world_size > 1``
    hold for every world size.

    **Tails.** With several ranks a rank's ledger (:func:`deal`) is whole chunks — no two the
    same — then at most two partial pieces of tail chunks: at most ``len(split chunks)``
    distinct positions, falling short of ``q`` rows by at most the single-rank total, plus at
    most ``q`` for the first partial piece (which only the last block can follow). So the
    layout below is computed with ``q`` more slack, and a full block that is not the last holds
    at least its smallest whole chunks and one row. A padded sample (``remainder="pad"``) is a
    one-row piece after those, possibly of a chunk the rank reads elsewhere: the layout then
    allows ``world_size - 1`` more positions, ``2q`` more slack and ``q - 1`` per padded sample,
    and a full block counts one row per piece.

    Let ``w(c)`` be the bytes of the stored chunks anchor chunk ``c``'s anchors read,
    ``top(k)`` the sum of the ``k`` largest ``w`` and ``g`` the bounded schedule's gap
    (:func:`block_batches`). The ledger is a run of blocks of at most ``block_chunks`` chunks;
    each chunk holds at most ``q`` rows (its valid anchors), so a block lies within a known
    distance of where it would lie with ``q`` rows per chunk, and so does every batch. From
    that layout (and, as a fallback, from the fewest rows a block can hold) come the most anchor
    chunks a run of rows can touch:

    * Bounded: a chunk live at batch ``b`` was read in batches ``(b - g, b]`` (a gap of more than
      ``g`` batches would have released it): live bytes ``<= top(most chunks in g batches)``.
    * Read-ahead (both schedules): the fetches counted for a block ``B`` are those of batches
      whose first row (rows are sorted within a batch) lies in ``B``; they intersect ``B``, span
      at most ``g`` batches and so fetch each chunk once: ``<= top(most chunks in the batches
      that intersect one block)``.
    * Read-once: live bytes are at most every chunk the split reads. When no stored chunk is
      read by two anchor chunks (no window reaches a neighbour, labels' grids nest), a chunk
      live at ``b`` is read by ``b`` or belongs to the one block ``b`` lies inside:
      ``<= top(max(block chunks, most chunks in one batch))`` — and read-once is then the
      bounded schedule, so the bounded bound holds for it too.
    """
    variables = _check_plan_inputs(manifest, variables, split, cross_split_windows)
    bs = check_int("batch_size", batch_size, minimum=1)
    bc = check_int("block_chunks", block_chunks, minimum=1)
    spc = manifest.samples_per_chunk
    gap = block_batches(spc, bc, bs)
    chunks = np.asarray(manifest.chunks(split), dtype=np.int64)
    offsets = [g.offset for g in variables.values()]
    starts, counts = _chunk_counts(manifest, split, chunks, offsets, cross_split_windows)
    keep = counts > 0
    if not keep.any():
        return ScheduleFloors(read_once=0, bounded=0, pin_gap=gap)
    weight, total, shared = _anchor_chunk_bytes(
        manifest, variables, chunks[keep], starts[keep], counts[keep]
    )
    heaviest = np.concatenate([[0], np.cumsum(np.sort(weight)[::-1])])
    n = int(keep.sum())
    # With one rank, chunks without a valid anchor stay in the order (they hold no rows);
    # with several they are dropped before dealing. Count them: a bound for both.
    remainder = check_remainder(remainder)
    world = _default_rank_world()[1] if world_size is None else check_int("world_size", world_size)
    n_pad = world - 1 if remainder == "pad" else 0  # padded samples: one-row pieces of their own
    shared = shared or n_pad > 0  # a padded sample's chunk may be read twice
    # partial pieces a full block before the last may hold (none with one rank)
    pieces = 2 + n_pad if n_pad else int(world > 1)
    whole = max(0, min(bc, len(counts)) - pieces)
    m = int(np.sort(counts)[:whole].sum()) + min(bc, len(counts)) - whole  # fewest rows in a block

    def most(rows: int, aligned: bool) -> int:
        if rows <= 0:
            return 0
        if m == 0:
            return min(rows, n)
        blocks = 1 + (rows - 1) // m if aligned else 2 + max(0, rows - 2) // m
        return min(rows, n, bc * blocks)

    def top(k: int) -> int:
        return int(heaviest[min(k, n)])

    live_chunks = most(gap * bs, aligned=False)
    once_chunks = max(min(bc, n), most(bs, aligned=False))
    ahead_chunks = min(n, bc + 2 * most(bs - 1, aligned=True))
    q = int(counts.max())
    slack = int((q - counts).sum())
    if world > 1:
        slack += 2 * q + n_pad * (q - 1) if n_pad else q
    n_pos = len(chunks) + n_pad
    leads = {0, _ramp_unit(True, spc, bs)}
    for lead in leads:
        found = _layout_maxima(n_pos, bc, lead if lead < bc else 0, q, slack, bs, gap)
        if found is None:
            break
    else:
        tight = [
            _layout_maxima(n_pos, bc, lead if lead < bc else 0, q, slack, bs, gap) for lead in leads
        ]
        live_chunks = min(live_chunks, max(t[0] for t in tight if t))
        once_chunks = min(once_chunks, max(t[1] for t in tight if t))
        ahead_chunks = min(ahead_chunks, max(t[2] for t in tight if t))
    read_ahead = top(ahead_chunks)
    bounded = top(live_chunks) + read_ahead
    read_once = total + read_ahead
    if not shared:
        read_once = min(read_once, top(once_chunks) + read_ahead, bounded)
    return ScheduleFloors(read_once=read_once, bounded=bounded, pin_gap=gap)


def _check_cuts(cuts: Any, emitted: int) -> tuple[Stage, ...]:
    """The ``resumed`` entry of a read-plan state as ``((world_size, batches), ...)``."""
    out: list[Stage] = []
    try:
        for w, k in cuts:
            out.append((int(w), int(k)))
    except (TypeError, ValueError):
        raise ValueError(f"not a read-plan state: resumed={cuts!r}") from None
    batches = [k for _, k in out]
    if (
        any(w < 1 for w, _ in out)
        or batches != sorted(set(batches))
        or any(k < 1 or k > emitted for k in batches)
    ):
        raise ValueError(
            f"not a read-plan state: resumed={cuts!r} must list (world_size >= 1, batches) "
            f"cuts with batches rising from 1 to at most batches_emitted={emitted}"
        )
    return tuple(out)


def _default_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return 0, 1


_DRAWN_KEPT = 3  # epoch plans a ReadPlanNode keeps (the current one, the next, len()'s)

_CONFIG_ATTRS = frozenset(
    {
        "manifest",
        "variables",
        "split",
        "batch_size",
        "block_chunks",
        "shuffle",
        "ramp",
        "seed",
        "rank",
        "world_size",
        "cross_split_windows",
        "schedule",
        "remainder",
    }
)


class ReadPlanNode(BaseNode[BatchPlan]):
    """A torchdata node whose items are :class:`BatchPlan` s, one per batch, epoch after epoch.

    ``variables`` maps each label to an :class:`ArrayGeometry` view; every view must have the
    manifest's sample-axis length (labels may chunk the sample axis differently and carry
    ``shift`` offsets). An anchor is emitted only if every view's ``anchor + offset`` lies in the
    array and — unless ``cross_split_windows=True`` — on an anchor-grid chunk of ``split``, so no
    window reads another split's samples. A split that has chunks but no such anchor is refused.

    **Ranks.** ``rank``/``world_size`` default to ``torch.distributed``'s when it is initialised,
    else 0/1. Every rank emits the same number of samples, a constant across epochs — with ``V``
    valid anchors, ``V // world_size`` (``remainder="drop"``, the default) or
    ``ceil(V / world_size)`` (``"pad"``) — so all ranks yield the same number of batches. Each
    epoch :func:`deal` hands the permuted chunks out round-robin as whole chunks while every
    rank stays within its share, then cuts the remaining chunks' samples into consecutive
    pieces, one per rank. ``"drop"``: the last ``V % world_size`` of them (at most
    ``world_size - 1``, changing with the permutation) sit out this epoch. ``"pad"``: none does;
    ``(-V) % world_size`` samples drawn by the epoch's seed are delivered twice, like
    ``DistributedSampler(drop_last=False)``. A rank reads each chunk it holds once per epoch;
    a tail chunk cut between ranks is read by each of them (at most ``world_size - 1`` extra
    chunk reads per epoch, plus one per padded sample), and a shifted view's neighbour chunk —
    ``c + 1`` for the last anchors of ``c`` — may also be read by the rank that holds ``c``.
    With one rank nothing is dropped or repeated. A split with fewer valid anchors than ranks
    is refused.

    **Ramp.** With ``ramp=True`` (the default; only when shuffling) the epoch's first block is
    split into a lead block of just enough chunks for one batch and the rest, so the first batch
    waits for a few chunks rather than a whole block; memory and every later block are
    unchanged, and the epoch's :func:`shuffle_quality` moves by about one epoch-to-epoch
    standard deviation.

    **Residency schedule.** ``schedule`` (a :class:`PinSchedule`; default read-once every epoch)
    decides each epoch's ``fetches``/``releases``; it never changes which samples a batch holds.
    :func:`~insitubatch_nodes.pipeline.choose_schedule` computes it from a budget.

    **Epochs and state.** ``reset(None)`` starts an epoch: the next one if the previous epoch
    yielded a batch, else the same one again (so the extra ``iter()`` calls Lightning makes do not
    skip epochs); :meth:`set_epoch` pins the epoch the next ``reset(None)`` starts. The state is
    O(1) plain Python — the epoch, the batches emitted, and the configuration the plan is a
    function of (computed once, at construction: the configuration is fixed, and assigning to
    it raises ``AttributeError``) — and ``reset(state)`` resumes at exactly the next batch. A
    state taken after the last batch of an epoch resumes at the start of the next epoch.
    Restoring a state whose configuration differs raises ``ValueError`` naming the field —
    except the world size.

    **Elastic resume.** A state saved under another world size ``W`` restores too: every old
    rank is taken to have delivered the state's ``k`` batches (ranks move in lockstep; the
    state is rank 0's), and the rest of the epoch — the valid samples no old rank delivered —
    is dealt to this world size by :func:`deal` (``resumed`` of :func:`plan_epoch`); batches
    go on from ``k``, so that epoch's ``len()`` differs; the next epochs are this world size's
    own. The state then carries the epoch's cuts (``"resumed"``), so it restores again, on any
    world size.
    """

    def __init__(
        self,
        manifest: SplitManifest,
        variables: Mapping[str, ArrayGeometry],
        *,
        split: str = "train",
        batch_size: int = 32,
        block_chunks: int = 16,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        ramp: bool = True,
        cross_split_windows: bool = False,
        schedule: PinSchedule | None = None,
        remainder: str = "drop",
    ) -> None:
        super().__init__()
        cross = check_bool("cross_split_windows", cross_split_windows)
        remainder = check_remainder(remainder)
        views = _check_plan_inputs(manifest, variables, split, cross)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        block_chunks = check_int("block_chunks", block_chunks, minimum=1)
        shuffle = check_bool("shuffle", shuffle)
        ramp = check_bool("ramp", ramp)
        seed = check_int("seed", seed, minimum=0)
        world_arg = check_optional_int("world_size", world_size)
        rank_arg = check_optional_int("rank", rank)
        if schedule is None:
            schedule = PinSchedule()
        if not isinstance(schedule, PinSchedule):
            raise TypeError(f"schedule must be a PinSchedule or None, got {schedule!r}")
        d_rank, d_world = _default_rank_world()
        world = d_world if world_arg is None else world_arg
        rk = (d_rank if world_arg is None else 0) if rank_arg is None else rank_arg
        if world < 1 or not 0 <= rk < world:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rk}, world_size={world}")
        split_chunks = np.asarray(manifest.chunks(split), dtype=np.int64)
        _, counts = _chunk_counts(
            manifest, split, split_chunks, [g.offset for g in views.values()], cross
        )
        n_valid = int(counts.sum())
        if world > 1 and len(split_chunks) and n_valid < world:
            raise ValueError(
                f"split {split!r} has {n_valid} valid anchors but world_size is {world}: every "
                "rank needs at least one sample (use a larger split or fewer ranks)"
            )
        self.manifest = manifest
        self.variables: Mapping[str, ArrayGeometry] = MappingProxyType(views)
        self.split = split
        self.batch_size = batch_size
        self.block_chunks = block_chunks
        self.shuffle = shuffle
        self.ramp = ramp
        self.seed = seed
        self.rank = rk
        self.world_size = world
        self.cross_split_windows = cross
        self.remainder = remainder
        self.schedule = schedule
        self._epoch = 0
        self._pinned_epoch: int | None = None
        self._emitted = 0
        self._resumed: tuple[Stage, ...] = ()  # the current epoch's elastic cuts
        self._epoch_len: int | None = None
        self._plan: EpochPlan | None = None
        # plans drawn lately (pure: the build, the first reset and len() share one draw)
        self._drawn: dict[tuple[Any, ...], EpochPlan] = {}
        self._config = self._fingerprint()  # the configuration is fixed from here on

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONFIG_ATTRS and "_config" in self.__dict__:
            raise AttributeError(
                f"ReadPlanNode.{name} is fixed at construction (the plan, its state and its "
                "fingerprint depend on it); build a new node instead"
            )
        super().__setattr__(name, value)

    # -- configuration identity -----------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        views = sorted(
            (k, g.path, g.offset, g.samples_per_chunk) for k, g in self.variables.items()
        )
        dataset = hashlib.sha256(
            json.dumps([self.manifest.fingerprint(), views]).encode()
        ).hexdigest()[:16]
        return {
            "dataset": dataset,
            "split": self.split,
            "batch_size": self.batch_size,
            "block_chunks": self.block_chunks,
            "shuffle": self.shuffle,
            "ramp": self.ramp,
            "seed": self.seed,
            "world_size": self.world_size,
            "cross_split_windows": self.cross_split_windows,
            "remainder": self.remainder,
        }

    def config(self) -> dict[str, Any]:
        """What the plan is a function of, besides the epoch (plain, rank-independent; computed
        once at construction — a copy is returned)."""
        return dict(self._config)

    @property
    def pin_gap(self) -> int | None:
        """The schedule's ``pin_gap`` (``None``: read-once every epoch)."""
        return self.schedule.pin_gap

    def _draw(
        self,
        epoch: int,
        pin_gap: int | None,
        resumed: Sequence[Stage] = (),
        world: tuple[int, int] | None = None,
    ) -> EpochPlan:
        rank, world_size = (self.rank, self.world_size) if world is None else world
        key = (epoch, pin_gap, tuple(resumed), rank, world_size)
        plan = self._drawn.get(key)
        if plan is None:
            plan = self._drawn[key] = self._draw_new(epoch, pin_gap, resumed, rank, world_size)
            while len(self._drawn) > _DRAWN_KEPT:
                del self._drawn[next(iter(self._drawn))]
        return plan

    def _draw_new(
        self, epoch: int, pin_gap: int | None, resumed: Sequence[Stage], rank: int, world_size: int
    ) -> EpochPlan:
        return plan_epoch(
            self.manifest,
            self.variables,
            split=self.split,
            epoch=epoch,
            batch_size=self.batch_size,
            block_chunks=self.block_chunks,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
            ramp=self.ramp,
            pin_gap=pin_gap,
            cross_split_windows=self.cross_split_windows,
            remainder=self.remainder,
            resumed=resumed,
        )

    def epoch_plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan for ``epoch`` under the schedule; by default the current one (an
        elastic remainder after a resume on another world size, see :meth:`reset`)."""
        if epoch is None and self._plan is not None:
            return self._plan
        if epoch is None:
            return self._scheduled(self._epoch, self._resumed)
        return self._scheduled(int(epoch))

    def _scheduled(self, epoch: int, resumed: Sequence[Stage] = ()) -> EpochPlan:
        gap, within = self.schedule.pin_gap, self.schedule.read_once_bytes
        if gap is None:
            return self._draw(epoch, None, resumed)
        if within is not None:
            once = self._draw(epoch, None, resumed)
            paths = {g.path: g.base for g in self.variables.values()}
            if working_set_bytes(once, paths)[0] <= within:
                return once
        return self._draw(epoch, gap, resumed)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def next_epoch(self) -> int:
        """The epoch the next ``reset(None)`` starts."""
        if self._pinned_epoch is not None:
            return self._pinned_epoch
        if self._plan is not None and self._emitted > 0:
            return self._epoch + 1
        return self._epoch

    def __len__(self) -> int:
        """Batches in the epoch in progress (once it is over: in the next), counted from its
        start. The same every epoch, except an epoch resumed on another world size (see
        :meth:`reset`)."""
        if self._plan is not None and self._emitted < self._plan.n_batches:
            return self._plan.n_batches
        return self.epoch_len

    @property
    def current_len(self) -> int:
        """Batches in the epoch this node is in (its current plan, however far the stages
        below have read it), or in a whole epoch before the first ``reset``."""
        return self.epoch_len if self._plan is None else self._plan.n_batches

    @property
    def epoch_len(self) -> int:
        """Batches this rank yields in a whole epoch (the same every epoch)."""
        if self._epoch_len is None:
            self._epoch_len = self._draw(0, None).n_batches
        return self._epoch_len

    def resumed_len(self, state: Mapping[str, Any]) -> int:
        """The length :meth:`__len__` reports once ``reset(state)`` has run (nothing changes)."""
        self.check_state(state)
        epoch, _, resumed = self._resolve(state)
        return self._draw(epoch, None, resumed).n_batches

    @property
    def block_batches(self) -> int:
        """Batches one full block takes: the ``pin_gap`` of the bounded-memory schedule."""
        return block_batches(self.manifest.samples_per_chunk, self.block_chunks, self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``reset(None)`` start ``epoch`` (e.g. from a trainer's epoch counter)."""
        epoch = check_int("epoch", epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._pinned_epoch = epoch

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.check_state(initial_state)
            epoch, emitted, resumed = self._resolve(initial_state)
            self._epoch, self._emitted, self._resumed = epoch, emitted, resumed
            self._plan = self._scheduled(epoch, resumed)
            self._pinned_epoch = None
            return
        if self._pinned_epoch is not None:
            self._epoch, self._pinned_epoch = self._pinned_epoch, None
        elif self._plan is not None and self._emitted > 0:
            self._epoch += 1
        self._emitted, self._resumed = 0, ()
        self._plan = self._scheduled(self._epoch)

    def _resolve(self, state: Mapping[str, Any]) -> tuple[int, int, tuple[Stage, ...]]:
        """``(epoch, batches emitted, elastic cuts)`` that a checked ``state`` resumes at.

        A state taken under another world size adds a cut: every old rank delivered the
        state's ``batches_emitted`` batches (ranks move in lockstep, and only rank 0's state
        is saved), and the rest of the epoch is dealt to this world size.
        """
        epoch, emitted = int(state["epoch"]), int(state["batches_emitted"])
        resumed = _check_cuts(state.get("resumed", ()), emitted)
        saved_world = int(state["config"].get("world_size", self.world_size))
        if saved_world != self.world_size:
            if emitted == 0:  # nothing delivered yet: the epoch as this world size plans it
                return epoch, 0, ()
            if emitted >= self._draw(epoch, None, resumed, world=(0, saved_world)).n_batches:
                return epoch + 1, 0, ()  # the epoch was over
            resumed = (*resumed, (saved_world, emitted))
        if resumed or emitted:
            n_batches = self._draw(epoch, None, resumed).n_batches
            if emitted >= n_batches and (n_batches > 0 or resumed):
                epoch, emitted, resumed = epoch + 1, 0, ()
        return epoch, emitted, resumed

    def next(self) -> BatchPlan:
        if self._plan is None:
            self.reset(None)
        assert self._plan is not None
        if self._emitted >= self._plan.n_batches:
            raise StopIteration
        batch = self._plan.batch(self._emitted)
        self._emitted += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        state = {"epoch": self._epoch, "batches_emitted": self._emitted, "config": self.config()}
        if self._resumed:  # plain lists: checkpoints load with weights_only=True
            state["resumed"] = [[w, k] for w, k in self._resumed]
        return state

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` (from :meth:`get_state`) fits this node."""
        missing = {"epoch", "batches_emitted", "config"} - set(state)
        if missing:
            raise ValueError(f"not a read-plan state: missing {sorted(missing)}")
        self._check_config(state["config"])

    def _check_config(self, saved: Mapping[str, Any]) -> None:
        mine = self._config
        for key, value in mine.items():
            if key == "cross_split_windows" and key not in saved and self._rule_matters():
                # saved before the rule existed: its windows read across the split's edge
                raise ValueError(
                    "cannot restore this read-plan state: it predates cross_split_windows and "
                    "its windows read across the split's edge; pass cross_split_windows=True "
                    "to resume it"
                )
            if key == "remainder" and key not in saved and int(saved.get("world_size", 1)) > 1:
                # saved before the tail was dealt: its ranks dealt and dropped differently
                raise ValueError(
                    "cannot restore this read-plan state: it was saved with several ranks "
                    "before samples of the remainder chunks were dealt (its remainder policy "
                    "differs); start this run's data order afresh"
                )
            if key == "world_size":
                continue  # another world size resumes elastically (see reset)
            if key in saved and saved[key] != value:
                what = "dataset (arrays, views or split chunks)" if key == "dataset" else key
                raise ValueError(
                    f"cannot restore this read-plan state: its {what} differs "
                    f"(saved {saved[key]!r}, this pipeline {value!r})"
                )

    def _rule_matters(self) -> bool:
        """Whether ``cross_split_windows`` changes this configuration's anchors."""
        if self.cross_split_windows:
            return False
        chunks = np.asarray(self.manifest.chunks(self.split), dtype=np.int64)
        offsets = [g.offset for g in self.variables.values()]
        inside = _chunk_counts(self.manifest, self.split, chunks, offsets, False)[1]
        across = _chunk_counts(self.manifest, self.split, chunks, offsets, True)[1]
        return not np.array_equal(inside, across)
