"""The fetch stage's admission: which chunks each batch needs, pinned a batch at a time.

An :class:`Admission` is the fetch stage's running state between two resets: the plans pulled
ahead of the consumer (each a :class:`~insitubatch_nodes.stages._jobs.PendingBatch`), the pins
the stage holds, and the bytes its read-ahead has admitted. For every batch it works from the
epoch plan's chunk ledgers (one per plan group, numpy: O(1) Python per group, not per chunk)
and admits, in one step under the pool's lock, the chunks the batch is the first to read: each
is pinned in the :class:`~insitubatch_nodes.pool.ChunkPool` (a chunk the pool holds is a hit)
and every miss joins one :class:`~insitubatch_nodes.stages._jobs.FillJob`, which the
:class:`~insitubatch_nodes.stages._fill.FillRunner` GETs and decodes. Chunks read by a single
row are decoded straight into the batch's arrays where :func:`plan_groups` allows it.

The read-ahead admits batches the consumer has not reached only while they take less than one
block's worth of memory (computed from the plan) and the pool's budget has room.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes import _runtime
from insitubatch_nodes.errors import PipelineInterrupted
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held
from insitubatch_nodes.plan.ledger import BatchPlan, ChunkKey, EpochPlan, sorted_unique
from insitubatch_nodes.plan.schedule import kept_bytes
from insitubatch_nodes.plan.working_set import working_set_bytes
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import EpochRecorder
from insitubatch_nodes.slots import ChunkEntry
from insitubatch_nodes.stages._bad import NoteBad
from insitubatch_nodes.stages._direct import direct_allowed, direct_labels
from insitubatch_nodes.stages._fill import FillRunner
from insitubatch_nodes.stages._jobs import (
    ArrayFill,
    FetchedBatch,
    FillJob,
    PendingBatch,
    PlanGroup,
    SlotLayout,
    SlotRequest,
)
from insitubatch_nodes.stages.buffers import BatchBuffers
from insitubatch_nodes.transforms import ChunkTransforms

__all__ = [
    "Admission",
    "FetchHistory",
    "FetchSetup",
    "epoch_floor",
    "plan_groups",
    "reserve_specs",
]

SlotSpec = tuple[tuple[int, ...], np.dtype[Any], bool]  # (shape, dtype, level_major)


@dataclass(frozen=True, eq=False)
class FetchSetup:
    """What admission works from, fixed when the fetch stage is built."""

    pool: ChunkPool
    geoms: Mapping[str, ArrayGeometry]  # path -> stored geometry
    slot_geoms: Mapping[str, ArrayGeometry]  # path -> what a slot holds
    layouts: Mapping[str, SlotLayout]
    arrays: Mapping[str, ArrayFill]
    transforms: ChunkTransforms
    buffers: BatchBuffers
    direct: bool | None  # FetchOptions.direct
    recorder: EpochRecorder
    held: Mapping[str, Held]  # path -> what its slots hold of a selected field
    # the most an automatic budget keeps of a split: the memory rule's room for slots in RAM
    # (plan/memory_floor.slot_room), or None (no room asked: slots elsewhere, explicit budget)
    keep_room: int | None = None


class FetchHistory:
    """Which chunks a fetch stage fetched before (over every epoch): what re-reads count."""

    def __init__(self, geoms: Mapping[str, ArrayGeometry]) -> None:
        self._geoms = geoms
        self._fetched: dict[tuple[str, ...], np.ndarray] = {}  # paths -> chunks fetched

    def count_re_reads(self, paths: tuple[str, ...], chunks: np.ndarray) -> int:
        """How many of ``chunks`` of every path of ``paths`` (read together) were fetched
        before (re-reads), marking them fetched now."""
        bits = self._fetched.get(paths)
        need = int(chunks.max()) + 1 if len(chunks) else 0
        if bits is None or len(bits) < need:
            grown = np.zeros(max(need, self._geoms[paths[0]].n_chunks), dtype=bool)
            if bits is not None:
                grown[: len(bits)] = bits
            bits = self._fetched[paths] = grown
        before = int(np.count_nonzero(bits[chunks])) * len(paths)
        bits[chunks] = True
        return before


def plan_groups(setup: FetchSetup, plan: EpochPlan) -> list[PlanGroup]:
    """How the fetch stage treats each plan group of ``plan``: its slot bytes, and which
    views' single-use chunks decode straight into the batch (see ``_direct``)."""
    buffers = setup.buffers
    allowed = direct_allowed(
        plan, setup.pool, buffers, setup.direct, setup.slot_geoms, setup.keep_room
    )
    out = []
    for ledger in plan.ledgers:
        nbytes = sum(setup.slot_geoms[p].chunk_nbytes for p in ledger.paths)
        in_place = (
            direct_labels(plan, ledger, buffers, setup.slot_geoms, setup.transforms, setup.held)
            if allowed
            else None
        )
        row = (
            0 if in_place is None else sum(setup.slot_geoms[p].sample_nbytes for p in ledger.paths)
        )
        out.append(PlanGroup(tuple(ledger.paths), nbytes, in_place, row))
    return out


def reread_order(plan: EpochPlan, resident: list[ChunkKey]) -> list[ChunkKey]:
    """The chunks of ``resident`` that ``plan`` reads, the one it first reads last first (the
    order for :meth:`ChunkPool.evict_last`: the chunk needed soonest is evicted last). A
    patched group's tiles keep their LRU order. Numpy over each ledger's sorted chunks: one
    ``searchsorted`` per path, not a Python loop over the epoch's segments."""
    by_path: dict[str, list[int]] = {}
    for path, chunk in resident:
        by_path.setdefault(path, []).append(chunk)
    firsts: list[np.ndarray] = []
    keys: list[ChunkKey] = []
    for ledger in plan.ledgers:
        if ledger.windows is not None or not ledger.n_segments:
            continue
        for path in ledger.paths:
            held = by_path.get(path)
            if not held:
                continue
            chunks = np.asarray(held, dtype=np.int64)
            at = np.minimum(np.searchsorted(ledger.chunk, chunks), ledger.n_segments - 1)
            read = ledger.chunk[at] == chunks  # (chunk, first) order: its first segment
            firsts.append(ledger.first[at[read]])
            keys.extend(zip(itertools.repeat(path), chunks[read].tolist()))
    if not keys:
        return []
    order = np.argsort(-np.concatenate(firsts), kind="stable")
    return list(map(keys.__getitem__, order.tolist()))


def pool_chunks_read(plan: EpochPlan) -> float:
    """How many ``(path, chunk)`` pool chunks ``plan`` reads (``inf`` with a patched group,
    whose units :func:`reread_order` leaves out)."""
    if any(ledger.windows is not None for ledger in plan.ledgers):
        return math.inf
    return float(sum(ledger.n_chunks * len(ledger.paths) for ledger in plan.ledgers))


#: Most slots :func:`reserve_specs` lists: slots are made one by one, so past this many the
#: reserve's Python costs more than the page faults it saves (only chunks of a few KiB reach it:
#: a budget holds far fewer larger ones).
RESERVE_MAX_SLOTS = 1 << 15


def epoch_floor(setup: FetchSetup, plan: EpochPlan) -> tuple[int, int]:
    """:func:`~insitubatch_nodes.plan.schedule.working_set_bytes` of ``plan``, whose floor an
    automatic budget grows to; when the schedule keeps the epoch's chunks for the next one
    (:func:`~insitubatch_nodes.plan.schedule.kept_bytes`: they fit a sixteenth of RAM, at any
    samples per chunk), the floor is all of them. It asks of every group, not of the anchor
    grid, as :func:`~insitubatch_nodes.stages._direct.direct_allowed` does: a
    one-sample-per-chunk array beside an anchor array of larger chunks is kept too, not left in
    slots an epoch's floor cannot hold (read again every epoch). ``direct=False`` (rows always
    through slots) keeps a split that fits as the default does; ``direct=True`` (rows of
    one-sample chunks straight into batches whatever the budget) keeps nothing, at any samples
    per chunk (as :class:`~insitubatch_nodes.options.FetchOptions` says: before 2026-12-07 a
    split of chunks of several samples was kept, and the one pass of ``fit_statistics`` over
    it grew its budget to the whole split). Chunks of more samples under a persistent cache are
    not kept in RAM this way: released, they come back from its files. A split larger than
    ``setup.keep_room`` (what the build's memory rule leaves the slots) is not kept: the floor
    stays the epoch's (before 2026-12-07 such a pipeline was refused at the build, though its
    floor fit)."""
    floor, read_ahead = working_set_bytes(plan, setup.slot_geoms)
    if not setup.pool.auto or setup.direct is True:
        return floor, read_ahead
    cache = setup.pool.cache  # a persistent one brings released chunks of more samples back
    one_sample = any(ledger.samples_per_chunk == 1 for ledger in plan.ledgers)
    if one_sample or cache is None or not cache.persistent:
        kept = kept_bytes(plan, setup.slot_geoms, None) or 0
        if setup.keep_room is None or kept <= setup.keep_room:
            floor = max(floor, kept)
    return floor, read_ahead


def reserve_specs(setup: FetchSetup, plan: EpochPlan, limit_bytes: int) -> list[SlotSpec]:
    """Slot specs of the pool chunks ``plan`` fetches, in first-need order, up to
    ``limit_bytes`` and :data:`RESERVE_MAX_SLOTS` slots (what :meth:`ChunkPool.reserve` is
    worth paying for ahead of need; rows decoded straight into batches take no slot)."""
    groups = plan_groups(setup, plan)
    order: list[tuple[int, int, int]] = []  # (first row, group, segment)
    for gi, (ledger, group) in enumerate(zip(plan.ledgers, groups, strict=True)):
        seg = ledger.by_first
        if group.in_place is not None:
            seg = seg[ledger.first[seg] != ledger.last[seg]]
        # (each segment takes a slot of every path: none of the first RESERVE_MAX_SLOTS
        # specs lies past this many of one group's segments)
        most = min(limit_bytes // max(1, group.nbytes), RESERVE_MAX_SLOTS // len(group.paths))
        seg = seg[: max(0, most) + 1]
        firsts = ledger.first[seg].tolist()
        order.extend((f, gi, s) for f, s in zip(firsts, seg.tolist(), strict=True))
    order.sort()
    out: list[SlotSpec] = []
    total = 0
    for _, gi, _ in order:
        for path in groups[gi].paths:
            layout = setup.layouts[path]
            total += math.prod(layout.shape) * layout.dtype.itemsize
            if total > limit_bytes or len(out) >= RESERVE_MAX_SLOTS:
                return out
            out.append((layout.shape, layout.dtype, layout.level_major))
    return out


class Admission:
    """The fetch stage's running state from one reset to the next (module docstring).

    ``source`` yields the plans; ``generation`` tags this run's fill jobs (bad objects a fill
    of an older run reports are dropped, see ``note_bad``).
    """

    def __init__(
        self,
        setup: FetchSetup,
        source: BaseNode[BatchPlan],
        runner: FillRunner,
        history: FetchHistory,
        generation: int,
        note_bad: NoteBad,
        stopping: Future[None],
    ) -> None:
        self.setup = setup
        self.stopping = stopping  # done once the graph is interrupted: a wait here ends
        self.source = source
        self.runner = runner
        self.history = history
        self.generation = generation
        self.note_bad = note_bad
        self.queue: deque[PendingBatch] = deque()
        # Chunks this run holds pins on, and how many: a chunk released after one use segment
        # can already be re-admitted (read-ahead) for its next one before that release happens.
        self.live: dict[ChunkKey, ChunkEntry] = {}
        self.pins: dict[ChunkKey, int] = {}
        self.jobs: weakref.WeakSet[FillJob] = weakref.WeakSet()  # started, maybe unfinished
        self.ahead_bytes = 0
        self.read_ahead = 0
        self.epoch_plan: EpochPlan | None = None
        self.groups: list[PlanGroup] = []
        # an epoch resumed mid-way, per group: the segments earlier batches first read that
        # later ones read again, and the local batch that next reads each (ascending)
        self.carried: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.exhausted = False
        self.closed = False
        self.lent: set[int] = set()  # batches handed downstream whose release() is not called

    # -- the consumer's side -------------------------------------------------------------------
    def next_batch(self) -> tuple[FetchedBatch, dict[str, Any]] | None:
        """The next batch, admitted, and the source's state right after its plan (``None`` at
        the end of the epoch)."""
        self.admit_ahead()
        if not self.queue:
            return None
        head = self.queue.popleft()
        if not head.done and not self._admit(head):
            self._admit_after_detached(head)
        self.ahead_bytes -= head.ahead_bytes
        entries = self._entries_read(head.plan, head.in_place)
        self.admit_ahead()
        self.lent.add(head.plan.index)
        batch = FetchedBatch(
            plan=head.plan,
            entries=entries,
            release=self._releaser(head.plan, head.in_place),
            jobs=tuple(head.jobs),
            arrays=None if head.lent is None else head.lent.arrays(),
            direct=head.rows,
        )
        return batch, head.state

    def _admit_after_detached(self, head: PendingBatch) -> None:
        """Admit ``head``, the consumer's next batch, once the fills of detached chunks (a
        run torn down by a close or a reset, whose fills were still inside a decode or a chunk
        transform) give their slots back; ``PipelineInterrupted`` when the graph is
        interrupted meanwhile. With nothing left to wait for, no room is a bug."""
        pool = self.setup.pool
        while fills := pool.detached_fills():
            wait((*fills, self.stopping), return_when=FIRST_COMPLETED)
            if self.stopping.done():
                raise PipelineInterrupted("the pipeline is stopping; this batch was abandoned")
            if self._admit(head):
                return
        if self.lent:
            raise RuntimeError(
                f"the chunk pool ({pool.budget_bytes:,} bytes) has no room for the chunks of "
                f"batch {head.plan.index}: {len(self.lent)} batches the fetch stage handed on are "
                "not released yet, so a node between the AsyncChunkFetchNode and the "
                "ChunkPoolNode holds batches (a torchdata Batcher, Prefetcher or ParallelMapper "
                "with workers) and their pins; place it above the GatherNode, or raise the "
                "pool's budget"
            )
        raise RuntimeError(
            f"the chunk pool ({pool.budget_bytes:,} bytes) has no room for the chunks of batch "
            f"{head.plan.index} even after releasing everything older; this is a bug in "
            "insitubatch_nodes, please report it"
        )

    def _releaser(self, plan: BatchPlan, in_place: Mapping[int, set[int]]) -> Callable[[], None]:
        ref = weakref.ref(self)

        def release() -> None:
            admission = ref()
            if admission is not None:
                admission.lent.discard(plan.index)
                admission.release(plan, in_place)

        return release

    def release(self, plan: BatchPlan, in_place: Mapping[int, set[int]] | None = None) -> None:
        """Unpin chunks the consumer has read for the last time this epoch (a no-op once this
        run is torn down). ``in_place`` (group index -> chunks) are the chunks ``plan``'s
        batch decoded straight into its rows: their segments ending here were never pinned,
        and a pin on such a chunk is a later batch's (read ahead, under a ``pin_gap`` or in
        the next epoch), not this one's to drop. A batch holds one segment of a chunk at most
        (segments split after idle *batches*), so the chunk tells the segment."""
        pins, live = self.pins, self.live
        if self.closed or not pins:  # (no pins: every chunk so far was decoded into its rows)
            return
        epoch = plan.epoch_plan
        at = plan.index - epoch.first_batch
        done: list[ChunkEntry] = []
        for gi, ledger in enumerate(epoch.ledgers):
            mine = in_place.get(gi, ()) if in_place else ()
            for c in ledger.chunk[ledger.released(at)].tolist():
                if c in mine:  # decoded into its row, never pinned by this batch
                    continue
                for path in ledger.paths:
                    key = (path, c)
                    count = pins.get(key, 0)
                    if count == 0:  # (a row decoded in place: never pinned)
                        continue
                    done.append(live[key])
                    if count == 1:
                        del pins[key], live[key]
                    else:
                        pins[key] = count - 1
        if self.setup.pool.unpin(done):  # chunks left unpinned while still arriving
            self.runner.cancel()

    def teardown(self) -> None:
        """Drop every pin this run holds and cancel the fills left unpinned (no waiting)."""
        self.closed = True
        held = [self.live[k] for k, n in self.pins.items() for _ in range(n)]
        detached = self.setup.pool.unpin(held)
        jobs = list(self.jobs)
        self.jobs = weakref.WeakSet()
        for pending in self.queue:
            if pending.job is not None:  # built, never started
                pending.job.fill.resolve()
        self.live.clear()
        self.pins.clear()
        self.queue.clear()
        self.ahead_bytes = 0
        self.epoch_plan = None
        self.groups = []
        self.carried = {}
        if detached or jobs:
            self.runner.cancel(jobs)

    @property
    def pinned(self) -> int:
        return sum(self.pins.values())

    def _entries_read(
        self, plan: BatchPlan, in_place: Mapping[int, set[int]]
    ) -> dict[ChunkKey, ChunkEntry]:
        """The pinned entries of every pool chunk ``plan`` reads (not of the chunks decoded
        straight into its rows, ``in_place``)."""
        live = self.live
        out: dict[ChunkKey, ChunkEntry] = {}
        if not live:  # every chunk of it was decoded in place
            return out
        for i, group in enumerate(self.groups):
            chunks = plan.chunks_read(i).tolist()
            if i in in_place:
                chunks = [c for c in chunks if c not in in_place[i]]
            for path in group.paths:
                for c in chunks:
                    entry = live.get((path, c))
                    if entry is not None:
                        out[(path, c)] = entry
        return out

    # -- read-ahead and admission ----------------------------------------------------------
    def admit_ahead(self) -> None:
        """Finish admitting the queued batches, then pull and admit more plans while the
        read-ahead has room."""
        for pending in self.queue:
            if not pending.done and not self._admit(pending):
                return
        while not self.exhausted and (not self.queue or self.ahead_bytes < self.read_ahead):
            try:
                plan = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            starts_epoch = plan.epoch_plan is not self.epoch_plan  # a new or resumed epoch
            if starts_epoch:
                self._start_epoch(plan.epoch_plan)
            pending = self._prepare(plan, starts_epoch)
            self.queue.append(pending)
            if not self._admit(pending):
                return

    def _start_epoch(self, plan: EpochPlan) -> None:
        floor, read_ahead = epoch_floor(self.setup, plan)
        pool = self.setup.pool
        pool.ensure_floor(floor)  # an automatic budget grows; an explicit one may raise
        if pool.has_entries():  # what this epoch reads again is evicted last
            again = reread_order(plan, pool.resident_keys())
            # an epoch that reads only resident chunks (a kept split) adds none, so evicts
            # none: its order is left as it is (a step per resident chunk, under the pool's
            # lock: 0.34 s of the 0.57 s an epoch of 300,000 kept chunks took to start)
            if len(again) < pool_chunks_read(plan):
                pool.evict_last(again)
        self.epoch_plan, self.read_ahead = plan, read_ahead
        self.groups = plan_groups(self.setup, plan)
        self.carried = {}

    def _prepare(self, plan: BatchPlan, starts_epoch: bool) -> PendingBatch:
        """What admitting ``plan`` takes: the pool chunks it (first) reads, in need order, and
        a job for the rows decoded straight into its arrays. In an epoch started or resumed
        mid-way, a chunk earlier batches first read and later ones read again is read again
        with the batch that next reads it (``self.carried``), not all before the first: at one
        sample per chunk that was half the epoch's chunks read before the resumed run's first
        batch."""
        setup = self.setup
        epoch = plan.epoch_plan
        at = plan.index - epoch.first_batch
        requests: list[SlotRequest] = []
        pending = PendingBatch(plan=plan, state=self.source.state_dict(), requests=requests)
        rows_in_place: list[tuple[PlanGroup, np.ndarray, np.ndarray, np.ndarray]] = []
        misses = re_reads = 0
        for gi, (ledger, group) in enumerate(zip(epoch.ledgers, self.groups, strict=True)):
            seg = ledger.fetched(at)
            if starts_epoch and at > 0:  # resumed mid-epoch
                start = at * epoch.batch_size
                carried = ledger.carried(at, epoch.batch_size)
                origins = None if epoch.origins is None else epoch.origins[start:]
                nxt = ledger.next_reads(carried, start, epoch.anchors[start:], origins)
                by = np.argsort(nxt, kind="stable")  # (ties: first-need order)
                self.carried[gi] = (carried[by], nxt[by] // epoch.batch_size)
            if gi in self.carried:  # what earlier batches first read, from its next reader on
                carried, batch = self.carried[gi]
                due = int(np.searchsorted(batch, at, side="right"))
                seg = np.concatenate([carried[:due], seg])
                self.carried[gi] = (carried[due:], batch[due:])
            if group.in_place is not None and len(seg):
                single = ledger.first[seg] == ledger.last[seg]
                if setup.pool.has_entries():  # a chunk the pool holds is a hit, not a read
                    single &= ~self._resident(group, ledger.chunk[seg])
                if single.any():
                    chunks = ledger.chunk[seg[single]]
                    rows = ledger.first[seg[single]] - at * epoch.batch_size
                    # which view reads each: at one sample per chunk, chunk = anchor + offset
                    offsets = chunks - plan.anchors[rows]
                    rows_in_place.append((group, chunks, rows, offsets))
                    pending.in_place[gi] = set(chunks.tolist())
                    misses += len(chunks) * len(group.paths)
                    re_reads += self.history.count_re_reads(group.paths, chunks)
                    seg = seg[~single]
            if len(seg):
                layouts = [(path, setup.layouts[path]) for path in group.paths]
                for c in ledger.chunk[seg].tolist():
                    for path, lay in layouts:
                        first_sample = c // lay.units_per_chunk * lay.samples_per_chunk
                        valid = min(lay.samples_per_chunk, lay.n_samples - first_sample)
                        if lay.counts is not None:  # product axes: the block's valid pairs
                            valid = int(lay.counts[c // lay.units_per_chunk])
                        requests.append(
                            SlotRequest((path, c), lay.shape, lay.dtype, valid, lay.level_major)
                        )
        if rows_in_place:
            self._prepare_rows(plan, pending, rows_in_place)
            setup.recorder.on_admit_counts(0, misses, re_reads, in_place=misses)
            setup.pool.note_misses_in_place(misses)  # the report counts them as misses
        return pending

    def _prepare_rows(
        self,
        plan: BatchPlan,
        pending: PendingBatch,
        rows_in_place: list[tuple[PlanGroup, np.ndarray, np.ndarray, np.ndarray]],
    ) -> None:
        """A job that decodes ``rows_in_place`` (per group: chunks, their rows, their views'
        offsets) straight into batch arrays taken from the batch buffers."""
        job = pending.job = FillJob(_runtime.next_ticket(), self.generation, plan.index)
        # (the buffers are taken when the first row is decoded, not now: see LentBatch)
        lent = pending.lent = self.setup.buffers.lend(len(plan))
        for group, chunks, rows, offsets in rows_in_place:
            assert group.in_place is not None
            for offset in sorted_unique(offsets).tolist():
                pick = offsets == offset
                chunk_list, row_list = chunks[pick].tolist(), rows[pick].tolist()
                for path, labels in group.in_place.items():
                    label = labels[offset]
                    job.add_rows(self.setup.arrays[path], lent, label, chunk_list, row_list)
                    pending.rows[label] = pending.rows.get(label, 0) + len(row_list)
            pending.ahead_bytes += group.row_bytes * len(chunks)
        self.ahead_bytes += pending.ahead_bytes

    def _resident(self, group: PlanGroup, chunks: np.ndarray) -> np.ndarray:
        lookup = self.setup.pool.lookup
        return np.array(
            [any(lookup((p, c)) is not None for p in group.paths) for c in chunks.tolist()],
            dtype=bool,
        ).reshape(len(chunks))

    def _admit(self, pending: PendingBatch) -> bool:
        """Pin the plan's first reads in order and start their fill; False when the pool has no
        room for all of them yet."""
        setup = self.setup
        job = pending.job or FillJob(_runtime.next_ticket(), self.generation, pending.plan.index)
        pending.job = None
        todo = pending.requests[pending.admitted :]
        got = setup.pool.acquire_many(todo, job.fill) if todo else []
        hits = 0
        live, pins, arrays, region = self.live, self.pins, setup.arrays, self.runner.region
        missed: dict[str, list[int]] = {}
        ahead = 0
        for entry, hit in got:
            key = entry.key
            if entry.bad_tiles:  # read as bad by an earlier fill: still bad here
                self.note_bad(self.generation, key[0], key[1], entry.bad_tiles)
            live[key] = entry
            pins[key] = pins.get(key, 0) + 1
            if hit or entry.cached is not None:
                hits += 1
            else:
                missed.setdefault(key[0], []).append(key[1])
            if not hit:
                array = arrays[key[0]]
                job.add_entry(entry, array, region(job, entry, array, entry.valid))
            ahead += entry.nbytes
        pending.ahead_bytes += ahead
        self.ahead_bytes += ahead
        if got:
            count = self.history.count_re_reads
            re_reads = sum(count((p,), np.asarray(c)) for p, c in missed.items())
            misses = sum(len(c) for c in missed.values())
            setup.recorder.on_admit_counts(hits, misses, re_reads)
        pending.admitted += len(got)
        if job.units or job.rows:
            pending.jobs.append(job)
            self.jobs.add(job)
            self.runner.submit(job)
        else:
            job.fill.resolve()  # nothing to fill: its entries (if any) were hits
        return pending.done
