"""The read plan: which samples each batch holds and which stored chunks it reads.

Everything here is a pure function of ``(seed, epoch)`` and the configuration, computed with
vectorised numpy (O(samples) array work per epoch, O(chunks) Python per batch):

1. the split's anchor-grid chunks are permuted (``shuffle=True``) or kept in order;
2. with several ranks, the first ``world_size * (C // world_size)`` chunks of that order are dealt
   round-robin, so ranks read disjoint chunks (the other ``C % world_size`` chunks rest this epoch);
3. each rank cuts its chunks into *blocks* of ``block_chunks`` chunks and shuffles all valid
   anchors within each block; the result is the *order ledger*, rows ``(chunk_id, within)``.
   With ``ramp=True`` (and shuffling) the epoch's first block is split in two: a lead block of
   just enough chunks to fill one batch, then the rest — so the first batch waits for those few
   chunks instead of (nearly) the whole block;
4. batches are cut over the whole ledger: ``ceil(N / batch_size)`` batches, only the last short.

Each :class:`BatchPlan` says which stored chunks the batch gathers from (``reads``), which of them
it is the first to need this epoch (``fetches`` — each chunk is fetched once per epoch) and which
it reads for the last time (``releases`` — the pool may unpin them once the batch is gathered).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes.geometry import ArrayGeometry
from insitubatch_nodes.splits import SPLITS, SplitManifest

__all__ = ["BatchPlan", "ChunkKey", "EpochPlan", "ReadPlanNode", "plan_epoch", "shuffle_quality"]

ChunkKey = tuple[str, int]
"""A stored chunk row: ``(array path, chunk index along that array's sample axis)``; it stands
for all of the chunk's field tiles."""


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What one batch holds and reads. Arrays are int64 and must not be modified."""

    epoch: int
    index: int
    n_batches: int
    rows: np.ndarray  # (len, 2): anchor-grid (chunk_id, within)
    anchors: np.ndarray  # (len,): anchor sample index of each row (before any view's offset)
    sample_indices: Mapping[str, np.ndarray]  # label -> (len,) sample-axis index read
    reads: tuple[ChunkKey, ...]
    fetches: tuple[ChunkKey, ...]
    releases: tuple[ChunkKey, ...]
    blocks: tuple[int, ...]
    epoch_plan: EpochPlan = field(repr=False)

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """One rank's plan for one epoch (see the module docstring for how it is drawn)."""

    epoch: int
    rank: int
    world_size: int
    batch_size: int
    block_chunks: int
    samples_per_chunk: int
    chunks: np.ndarray  # this rank's anchor chunks, in visiting order
    order: np.ndarray  # (N, 2) ledger (chunk_id, within)
    labels: Mapping[str, ArrayGeometry]
    _first: dict[ChunkKey, int] = field(repr=False)
    _segments: list[tuple[ChunkKey, int, int]] = field(repr=False)
    _fetch_by_batch: list[tuple[ChunkKey, ...]] = field(repr=False)
    _release_by_batch: list[tuple[ChunkKey, ...]] = field(repr=False)
    _block_of_row: np.ndarray = field(repr=False)
    _block_of_chunk: np.ndarray = field(repr=False)

    @property
    def n_samples(self) -> int:
        return int(self.order.shape[0])

    @property
    def n_batches(self) -> int:
        return math.ceil(self.n_samples / self.batch_size)

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
        return sorted(self._first, key=self._first.__getitem__)

    @property
    def n_fetches(self) -> int:
        """Chunk fetches the schedule makes this epoch (``len(distinct_chunks())`` unless a
        ``pin_gap`` releases chunks between uses)."""
        return len(self._segments)

    def live_peak(self) -> int:
        """Most chunks live at once (first need <= batch <= last need), over the epoch."""
        if not self._first:
            return 0
        delta = np.zeros(self.n_batches + 1, dtype=np.int64)
        for b, keys in enumerate(self._fetch_by_batch):
            delta[b] += len(keys)
        for b, keys in enumerate(self._release_by_batch):
            delta[b + 1] -= len(keys)
        return int(np.cumsum(delta).max())

    def batch_fetches(self, index: int) -> tuple[ChunkKey, ...]:
        """Chunks to fetch for batch ``index``: those it is the first to read this epoch (or,
        with a ``pin_gap``, the first to read since they were released), in first-need order."""
        return self._fetch_by_batch[index]

    def batch_releases(self, index: int) -> tuple[ChunkKey, ...]:
        """Chunks batch ``index`` reads for the last time this epoch."""
        return self._release_by_batch[index]

    def carried_into(self, index: int) -> tuple[ChunkKey, ...]:
        """Chunks first read before batch ``index`` and read again at or after it, in
        first-need order: what a run resumed at ``index`` must fetch before that batch's own
        ``fetches``."""
        bs = self.batch_size
        live = [(f, k) for k, f, la in self._segments if f // bs < index <= la // bs]
        return tuple(k for _, k in sorted(live))

    def batch_first_block(self, index: int) -> int:
        """Block of the first row of batch ``index``."""
        return int(self._block_of_row[index * self.batch_size])

    def batch(self, index: int) -> BatchPlan:
        """The plan of batch ``index`` (0-based) of this epoch."""
        if not 0 <= index < self.n_batches:
            raise IndexError(f"batch {index} not in [0, {self.n_batches})")
        lo, hi = index * self.batch_size, min((index + 1) * self.batch_size, self.n_samples)
        rows = self.order[lo:hi]
        anchors = rows[:, 0] * self.samples_per_chunk + rows[:, 1]
        anchors.setflags(write=False)
        sample_indices: dict[str, np.ndarray] = {}
        reads: set[ChunkKey] = set()
        for label, geom in self.labels.items():
            samples = anchors + geom.offset
            sample_indices[label] = samples
            for c in np.unique(samples // geom.samples_per_chunk).tolist():
                reads.add((geom.path, int(c)))
        for arr in sample_indices.values():
            arr.setflags(write=False)
        blocks = tuple(int(b) for b in np.unique(self._block_of_row[lo:hi]))
        return BatchPlan(
            epoch=self.epoch,
            index=index,
            n_batches=self.n_batches,
            rows=rows,
            anchors=anchors,
            sample_indices=sample_indices,
            reads=tuple(sorted(reads, key=lambda k: self._first[k])),
            fetches=self._fetch_by_batch[index],
            releases=self._release_by_batch[index],
            blocks=blocks,
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
    chunks: np.ndarray, spc: int, n_samples: int, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray]:
    """First valid anchor and number of valid anchors in each chunk."""
    start = np.maximum(chunks * spc, lo)
    stop = np.minimum(np.minimum((chunks + 1) * spc, n_samples), hi)
    return start, np.maximum(stop - start, 0)


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
) -> EpochPlan:
    """Draw one rank's plan for one epoch. Pure: same arguments, same plan.

    ``pin_gap=None`` keeps each chunk from its first reading batch to its last (each chunk is
    fetched once per epoch). With ``pin_gap=g`` a chunk that goes more than ``g`` batches
    without being read is released and fetched again at its next use — the schedule for a
    budget too small to hold shifted views' neighbours across the epoch.
    """
    spc, n = manifest.samples_per_chunk, manifest.n_samples
    lo, hi = _valid_anchor_range(n, [g.offset for g in labels.values()])
    chunks = np.asarray(manifest.chunks(split), dtype=np.int64)
    if shuffle:
        chunks = np.random.default_rng([seed, epoch, 0]).permutation(chunks)
    starts_all, counts_all = _chunk_counts(chunks, spc, n, lo, hi)
    if world_size > 1:
        # A chunk with no valid anchor (a view's offset pushes them all off the array) holds
        # nothing to deal; dealing it would only shorten some rank's share.
        keep = counts_all > 0
        chunks, starts_all, counts_all = chunks[keep], starts_all[keep], counts_all[keep]
        per_rank = len(chunks) // world_size
        # Equal lengths on every rank, constant across epochs: the smallest total any rank can
        # be dealt (its per_rank chunks with the fewest valid anchors).
        n_emit = int(np.sort(counts_all)[:per_rank].sum())
        dealt = np.arange(per_rank) * world_size + rank
        chunks, starts, counts = chunks[dealt], starts_all[dealt], counts_all[dealt]
    else:
        starts, counts = starts_all, counts_all
        n_emit = int(counts.sum())

    total = int(counts.sum())
    chunk_pos = np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
    first_row = np.cumsum(counts) - counts
    anchors = np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - first_row[chunk_pos])
    block_of_chunk = block_index(
        len(chunks), block_chunks, _ramp_unit(ramp and shuffle, spc, batch_size)
    )
    block = block_of_chunk[chunk_pos]
    if shuffle and total:
        keys = np.random.default_rng([seed, epoch, 1, rank]).random(total)
        perm = np.lexsort((keys, block))
        anchors, block = anchors[perm], block[perm]
    anchors, block = anchors[:n_emit], block[:n_emit]
    # Within a batch, rows go in anchor order. The batch holds the same samples as before, but
    # each chunk's rows are now one contiguous run for every label, so the gather makes one
    # copy per chunk straight into the batch instead of a gather plus a scatter.
    in_batch = np.lexsort((anchors, np.arange(n_emit, dtype=np.int64) // batch_size))
    anchors, block = anchors[in_batch], block[in_batch]
    order = np.stack([anchors // spc, anchors % spc], axis=1)
    order.setflags(write=False)

    n_batches = math.ceil(n_emit / batch_size)
    first: dict[ChunkKey, int] = {}
    segments: list[tuple[ChunkKey, int, int]] = []  # (chunk, first row, last row) of each use
    gap = n_batches if pin_gap is None else int(pin_gap)
    if n_emit:
        for path in dict.fromkeys(g.path for g in labels.values()):
            views = [g for g in labels.values() if g.path == path]
            pspc = views[0].samples_per_chunk
            cid = np.concatenate([(anchors + g.offset) // pspc for g in views])
            row = np.tile(np.arange(n_emit, dtype=np.int64), len(views))
            by = np.lexsort((row, cid))
            cid, row = cid[by], row[by]
            batch = row // batch_size
            # a new use segment starts at a new chunk, or after more than `gap` idle batches
            starts = np.ones(len(cid), dtype=bool)
            starts[1:] = (cid[1:] != cid[:-1]) | (batch[1:] - batch[:-1] > gap)
            s_idx = np.flatnonzero(starts)
            e_idx = np.append(s_idx[1:], len(cid)) - 1
            for c, fr, lr in zip(
                cid[s_idx].tolist(), row[s_idx].tolist(), row[e_idx].tolist(), strict=True
            ):
                key = (path, c)
                first.setdefault(key, fr)
                segments.append((key, fr, lr))
    fetch_by_batch: list[list[ChunkKey]] = [[] for _ in range(n_batches)]
    release_by_batch: list[list[ChunkKey]] = [[] for _ in range(n_batches)]
    for key, fr, _ in sorted(segments, key=lambda seg: seg[1]):
        fetch_by_batch[fr // batch_size].append(key)
    for key, _, lr in sorted(segments, key=lambda seg: seg[2]):
        release_by_batch[lr // batch_size].append(key)
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
        _first=first,
        _segments=segments,
        _fetch_by_batch=[tuple(x) for x in fetch_by_batch],
        _release_by_batch=[tuple(x) for x in release_by_batch],
        _block_of_row=block,
        _block_of_chunk=block_of_chunk,
    )


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


def _default_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return 0, 1


class ReadPlanNode(BaseNode[BatchPlan]):
    """A torchdata node whose items are :class:`BatchPlan` s, one per batch, epoch after epoch.

    ``variables`` maps each label to an :class:`ArrayGeometry` view; every view must have the
    manifest's sample-axis length (labels may chunk the sample axis differently and carry
    ``shift`` offsets; anchors whose ``anchor + offset`` falls off the array are dropped).

    **Ranks.** ``rank``/``world_size`` default to ``torch.distributed``'s when it is initialised,
    else 0/1. Each epoch the permuted list of the ``C`` chunks that hold at least one valid
    anchor is cut to ``world_size * (C // world_size)`` chunks and dealt round-robin, so ranks
    draw their samples from disjoint chunks (a shifted view's neighbour chunk — ``c + 1`` for
    the last anchors of ``c`` — may also be read by the rank that holds ``c``); the
    ``C % world_size`` chunks left over rest for that epoch (which ones changes with the
    permutation). Every rank then emits the same number of samples — the fewest any rank can be
    dealt, a constant across epochs — by dropping the tail of its own order, so all ranks yield
    the same number of batches. With one rank nothing is dropped.

    **Ramp.** With ``ramp=True`` (the default; only when shuffling) the epoch's first block is
    split into a lead block of just enough chunks for one batch and the rest, so the first batch
    waits for a few chunks rather than a whole block; memory and every later block are
    unchanged, and the epoch's :func:`shuffle_quality` moves by about one epoch-to-epoch
    standard deviation.

    **Epochs and state.** ``reset(None)`` starts an epoch: the next one if the previous epoch
    yielded a batch, else the same one again (so the extra ``iter()`` calls Lightning makes do not
    skip epochs); :meth:`set_epoch` pins the epoch the next ``reset(None)`` starts. The state is
    O(1) plain Python — the epoch, the batches emitted, and the configuration the plan is a
    function of — and ``reset(state)`` resumes at exactly the next batch. A state taken after the
    last batch of an epoch resumes at the start of the next epoch. Restoring a state whose
    configuration differs raises ``ValueError`` naming the field.
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
    ) -> None:
        super().__init__()
        if not isinstance(manifest, SplitManifest):
            raise TypeError(f"manifest must be a SplitManifest, got {type(manifest).__name__}")
        if split not in SPLITS:
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
        lo, hi = _valid_anchor_range(manifest.n_samples, [g.offset for g in variables.values()])
        if hi <= lo and manifest.n_samples > 0:
            raise ValueError(
                f"the views' offsets {[g.offset for g in variables.values()]} leave no valid "
                f"anchor in an array of {manifest.n_samples} samples"
            )
        for name, value in (("batch_size", batch_size), ("block_chunks", block_chunks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        d_rank, d_world = _default_rank_world()
        world = d_world if world_size is None else int(world_size)
        rk = (d_rank if world_size is None else 0) if rank is None else int(rank)
        if world < 1 or not 0 <= rk < world:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rk}, world_size={world}")
        split_chunks = np.asarray(manifest.chunks(split), dtype=np.int64)
        _, counts = _chunk_counts(
            split_chunks, manifest.samples_per_chunk, manifest.n_samples, lo, hi
        )
        n_chunks = int(np.count_nonzero(counts))
        if world > 1 and len(split_chunks) and n_chunks < world:
            raise ValueError(
                f"split {split!r} has {n_chunks} chunks with valid anchors but world_size is "
                f"{world}: every rank needs at least one (use a larger split or fewer ranks)"
            )
        self.manifest = manifest
        self.variables: dict[str, ArrayGeometry] = dict(variables)
        self.split = split
        self.batch_size = batch_size
        self.block_chunks = block_chunks
        self.shuffle = bool(shuffle)
        self.ramp = bool(ramp)
        self.seed = int(seed)
        self.rank = rk
        self.world_size = world
        self.pin_gap: int | None = None  # residency schedule, set by the pipeline's budget
        self._epoch = 0
        self._pinned_epoch: int | None = None
        self._emitted = 0
        self._plan: EpochPlan | None = None

    # -- configuration identity -----------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What the plan is a function of, besides the epoch (plain, rank-independent)."""
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
        }

    def epoch_plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan for ``epoch`` (default: the current one)."""
        if epoch is None and self._plan is not None:
            return self._plan
        return plan_epoch(
            self.manifest,
            self.variables,
            split=self.split,
            epoch=self._epoch if epoch is None else int(epoch),
            batch_size=self.batch_size,
            block_chunks=self.block_chunks,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            ramp=self.ramp,
            pin_gap=self.pin_gap,
        )

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
        """Batches this rank yields per epoch (the same every epoch)."""
        return self.epoch_plan(0 if self._plan is None else None).n_batches

    @property
    def block_batches(self) -> int:
        """Batches one full block takes: the ``pin_gap`` of the bounded-memory schedule."""
        return max(
            1, math.ceil(self.block_chunks * self.manifest.samples_per_chunk / self.batch_size)
        )

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``reset(None)`` start ``epoch`` (e.g. from a trainer's epoch counter)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._pinned_epoch = int(epoch)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.check_state(initial_state)
            epoch, emitted = int(initial_state["epoch"]), int(initial_state["batches_emitted"])
            plan = self.epoch_plan(epoch)
            if emitted >= plan.n_batches and plan.n_batches > 0:
                epoch, emitted, plan = epoch + 1, 0, self.epoch_plan(epoch + 1)
            self._epoch, self._emitted, self._plan = epoch, emitted, plan
            self._pinned_epoch = None
            return
        if self._pinned_epoch is not None:
            self._epoch, self._pinned_epoch = self._pinned_epoch, None
        elif self._plan is not None and self._emitted > 0:
            self._epoch += 1
        self._emitted = 0
        self._plan = self.epoch_plan(self._epoch)

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
        return {"epoch": self._epoch, "batches_emitted": self._emitted, "config": self.config()}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` (from :meth:`get_state`) fits this node."""
        missing = {"epoch", "batches_emitted", "config"} - set(state)
        if missing:
            raise ValueError(f"not a read-plan state: missing {sorted(missing)}")
        self._check_config(state["config"])

    def _check_config(self, saved: Mapping[str, Any]) -> None:
        mine = self.config()
        for key, value in mine.items():
            if key in saved and saved[key] != value:
                what = "dataset (arrays, views or split chunks)" if key == "dataset" else key
                raise ValueError(
                    f"cannot restore this read-plan state: its {what} differs "
                    f"(saved {saved[key]!r}, this pipeline {value!r})"
                )
