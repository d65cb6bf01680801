"""The fetch stage: which stored objects each batch needs fetched, admitted a batch at a time.

:class:`AsyncChunkFetchNode` pulls :class:`~insitubatch_nodes.plan.ledger.BatchPlan` s from its
source
ahead of the consumer. For every batch it works from the epoch plan's chunk ledgers (one per
plan group, numpy: O(1) Python per group, not per chunk) and admits, in one step under one
lock, the chunks the batch is the first to read: each is pinned in the
:class:`~insitubatch_nodes.pool.ChunkPool` (a chunk the pool holds is a hit and is not
fetched again), and every miss joins one :class:`~insitubatch_nodes.stages._fill.FillJob` that GETs
and decodes its stored objects (see :mod:`~insitubatch_nodes.stages._fill`: runs on the decode
threads, GETs on the shared IO loop, a store on local disk read on the decode threads).

**Rows decoded straight into the batch.** At one sample per chunk a stored object *is* a batch
row. When the plan says a chunk is read by exactly one row of one label this epoch (a plan
group of one sample per chunk, every array read by one label, no chunk transforms, no
persistent cache) and the pool would not keep it for a later epoch anyway (an automatic budget,
or one below the bytes of every chunk the epoch reads), its objects are decoded into that row of
the batch's own arrays — no slot, no pin, no copy by the gather. The arrays are the gather
stage's reusable batch buffers (:class:`~insitubatch_nodes.stages.gather.BatchBuffers`), which a
:class:`~insitubatch_nodes.stages.gather.GatherNode` offers to the fetch stage below it when it is
built; without them every chunk goes through the pool. ``direct=False`` turns this off,
``direct=True`` uses it whatever the budget.

Two bounds keep it honest:

* ``max_inflight`` — stored-object GETs (and the decodes they feed) in flight at once (a store
  on local disk is read by the decode threads, at most one object per thread);
* the read-ahead — the fetcher admits chunks for batches the consumer has not reached only
  while those chunks (and rows) take less than one block's worth of memory (computed from the
  plan, not configured), and only while the pool's budget has room.

It yields :class:`FetchedBatch` items in plan order as soon as their chunks are *admitted*; the
residency stage downstream waits for their fills. The node owns every pin it takes: each item
carries a ``release`` handle that drops the pins of the chunks its batch reads for the last time
(the residency stage calls it once the batch has been gathered), and ``reset``/``close`` drop
every pin at once and cancel the fills nobody else pins — without waiting for them: a slot is
reused only once its fill has finished (see :mod:`~insitubatch_nodes.pool`), so neither
call ever waits for a GET. A pool shared by several fetch nodes keeps working when one of them
closes.

The IO loop and the obstore runtime do not survive ``fork``: a node used in the child of a
process that forked after building it raises a ``RuntimeError`` saying so, and an obstore-backed
store that the parent already read from is refused in the child (its GETs would never finish).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torchdata.nodes import BaseNode
from zarr.abc.store import Store
from zarr.storage import ObjectStore

from insitubatch_nodes import _runtime
from insitubatch_nodes._checks import check_bool, check_int, check_on_bad_chunk, check_optional_int
from insitubatch_nodes.io import objects
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.localfiles import local_reader
from insitubatch_nodes.io.stores import RetryPolicy, describe_store, retry_policy
from insitubatch_nodes.plan.ledger import BatchPlan, ChunkKey, EpochPlan
from insitubatch_nodes.plan.patches import unit_geometry
from insitubatch_nodes.plan.schedule import working_set_bytes
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import NULL_RECORDER, EpochRecorder
from insitubatch_nodes.slots import ChunkEntry
from insitubatch_nodes.stages._direct import direct_allowed, direct_labels
from insitubatch_nodes.stages._fill import Filler
from insitubatch_nodes.stages._get import Getter, cancel_all_at_exit
from insitubatch_nodes.stages._graph import SOURCE_KEY, find_node
from insitubatch_nodes.stages._jobs import ArrayFill, FetchedBatch, FillJob, PendingBatch, PlanGroup
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.transforms import ChunkTransform, ChunkTransforms

if TYPE_CHECKING:
    from insitubatch_nodes.stages.gather import BatchBuffers

__all__ = ["AsyncChunkFetchNode"]


log = logging.getLogger(__name__)


class AsyncChunkFetchNode(BaseNode[FetchedBatch]):
    """Fetch + decode stage (see the module docstring).

    ``geoms`` maps array path to its (unshifted) geometry; ``store`` is the zarr store the paths
    live in. When it is a ``zarr.storage.ObjectStore`` the GETs go straight to the obstore store
    underneath (``obstore.get_async``); any other zarr store is read with its own ``get``. A
    store that is exactly a local folder is not read with GETs: each object is read and decoded
    by one decode-pool thread (:mod:`~insitubatch_nodes.io.localfiles`; no deadline applies there).
    Every GET fails with ``TimeoutError`` after ``retry.timeout_s`` (default: the policy the
    store was opened with, see :func:`~insitubatch_nodes.io.stores.retry_policy`).

    ``chunk_transforms`` (see :mod:`~insitubatch_nodes.transforms`) run on the decode threads
    on every chunk this node decodes, once all of its stored objects have landed; slots are
    sized at their output (:attr:`slot_geoms`). Pass the same list (or the
    :class:`~insitubatch_nodes.transforms.ChunkTransforms` built from it) that sizes the
    gather stage's labels.

    ``on_bad_chunk="raise"`` (default): a stored object that still cannot be read after the
    store's retries, or cannot be decoded, fails its chunk, and the error reaches the consumer.
    ``"nan"``: that object's rectangle of the chunk is filled with NaN (floating-point arrays)
    or the array's fill value (others) before the chunk transforms run, the epoch goes on, and
    :attr:`bad_chunks` lists ``(array, chunk_index, tile)``. A chunk with a bad object is not
    kept resident once its last reader is done (the next epoch reads it again). Errors in
    chunk transforms are not bad chunks: they always reach the consumer.

    ``direct`` (``None``: decide from the budget; ``True``/``False``) says whether chunks read by
    a single row are decoded straight into the batch (module docstring).
    """

    NESTS_SOURCE_STATE = True

    def __init__(
        self,
        source: BaseNode[BatchPlan],
        store: Store,
        geoms: Mapping[str, ArrayGeometry],
        pool: ChunkPool,
        *,
        max_inflight: int = 32,
        decode_threads: int | None = None,
        retry: RetryPolicy | None = None,
        chunk_transforms: Sequence[ChunkTransform] | ChunkTransforms = (),
        on_bad_chunk: str = "raise",
        direct: bool | None = None,
        report: bool = True,
    ) -> None:
        super().__init__()
        max_inflight = check_int("max_inflight", max_inflight, minimum=1)
        decode_threads = check_optional_int("decode_threads", decode_threads, minimum=1)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
        self.source = source
        self.store = store
        self.pool = pool
        self.geoms = {path: g.base for path, g in geoms.items()}
        self.on_bad_chunk = check_on_bad_chunk(on_bad_chunk)
        self.direct = None if direct is None else check_bool("direct", direct)
        self.transforms = (
            chunk_transforms
            if isinstance(chunk_transforms, ChunkTransforms)
            else ChunkTransforms(chunk_transforms, self.geoms)
        )
        #: arrays read through patched views: their slots hold one stored tile each (a unit)
        self.patched = _patched_paths(source, geoms)
        #: path -> the geometry of what a slot holds (after the chunk transforms; one tile of a
        #: patched array)
        self.slot_geoms = dict(self.transforms.outputs)
        for path in self.patched:
            self.transforms.refuse_patched(path)
            if pool.cache is not None and pool.cache.persistent:
                raise ValueError(
                    f"array {path!r} is read through patched views, which the persistent "
                    "cache does not hold yet; leave cache_dir unset (or use cache_dir with "
                    "persistent=False for slots on disk)"
                )
            self.slot_geoms[path] = unit_geometry(self.geoms[path])
        # Arrays stored one level per object get level-major slots, which their objects decode
        # into in place (see residency). Not under chunk transforms: those see the slot, and a
        # transform written for C-ordered data (``data.reshape(n, -1)[...] = ...``) would
        # silently write into a copy of a level-major one.
        self._level_major = {
            path: g.one_level_per_object
            and not self.transforms.active(path)
            and path not in self.patched
            for path, g in self.geoms.items()
        }
        # bad stored objects of this epoch (written on any thread, read from any thread)
        self._bad: dict[tuple[str, int, tuple[int, ...]], None] = {}
        self._bad_lock = threading.Lock()
        self.max_inflight = max_inflight
        self._decoders = {path: ChunkDecoder(g) for path, g in self.geoms.items()}
        # path -> (slot shape, dtype, level-major, samples per chunk, samples): a request's parts
        # (a patched array's keys name units: n_tiles of them per chunk)
        self._specs = {
            path: (
                *self.slot_spec(path),
                g.samples_per_chunk,
                g.n_samples,
                self.geoms[path].n_tiles if path in self.patched else 1,
            )
            for path, g in self.slot_geoms.items()
        }
        self._arrays = {
            path: ArrayFill(g, self._decoders[path], units=path in self.patched)
            for path, g in self.geoms.items()
        }
        self._decode_pool = _runtime.decode_pool(decode_threads)
        self._loop = _runtime.io_loop()
        _runtime.tune_allocator()  # reuse GET and scratch buffers' memory (see its docstring)
        self._uses_obstore = isinstance(store, ObjectStore)
        if self._uses_obstore:
            _runtime.check_obstore_usable()
        self.retry = retry_policy(store) if retry is None else retry
        self._store_name = describe_store(store)
        # A folder on this machine is read on the decode threads (see localfiles), not as GETs.
        reader = local_reader(store)
        self._getter: Getter | None = None
        if reader is None:
            get = objects.make_async_getter(store, timeout_s=self.retry.timeout_s)
            self._getter = Getter(
                get, self._loop, max_inflight, self._store_name, lambda: self._filler
            )
        self._filler = Filler(
            pool=pool,
            decode_pool=self._decode_pool,
            reader=reader,
            getter=self._getter,
            transforms=self.transforms,
            on_bad_chunk=self.on_bad_chunk,
            store_name=self._store_name,
            note_bad=self._note_bad,
        )
        self._pid = os.getpid()
        self._generation = 0  # bumped by every teardown: older release handles do nothing
        self._queue: deque[PendingBatch] = deque()
        # Chunks this node holds pins on, and how many: a chunk released after one use segment
        # can already be re-admitted (read-ahead) for its next one before that release happens.
        self._live: dict[ChunkKey, ChunkEntry] = {}
        self._pins: dict[ChunkKey, int] = {}
        self._jobs: weakref.WeakSet[FillJob] = weakref.WeakSet()  # started, maybe unfinished
        self._ahead_bytes = 0
        self._read_ahead = 0
        self._epoch_plan: EpochPlan | None = None
        self._groups: list[PlanGroup] = []
        self._fetched: dict[tuple[str, ...], np.ndarray] = {}  # paths -> chunks fetched before
        self._buffers: BatchBuffers | None = None
        self._exhausted = False
        self._last_state: dict[str, Any] | None = None
        self._recorder: EpochRecorder = NULL_RECORDER
        if check_bool("report", report):
            self.recorder = EpochRecorder(
                pool,
                max_inflight=max_inflight,
                decode_threads=len(self._decode_pool.threads),
                # not a bound method: the recorder must not keep this node alive (``del pipe``)
                split_bytes=functools.partial(_split_bytes, source, self.slot_geoms),
            )
        _runtime.stop_at_exit("fetch", self, cancel_all_at_exit)
        self._prepare_pool(source)

    def _prepare_pool(self, source: Any) -> None:
        """Size an automatic budget to the first epoch's working set, and (without a cache
        directory) make that epoch's slots ahead of need, in the order they will be needed (a
        fresh process faults new pages in slowly; see :meth:`ChunkPool.reserve`)."""
        plan = find_node(source, ReadPlanNode)
        if plan is None:  # a hand-made plan source: nothing to size from
            return
        first = plan.epoch_plan(0)
        self.pool.ensure_floor(working_set_bytes(first, self.slot_geoms)[0])
        if self.pool.cache is None:
            self.pool.reserve(self.reserve_specs(first, self.pool.budget_bytes))

    @property
    def recorder(self) -> EpochRecorder:
        """The epoch report's recorder (``report=True``; else the null one), which the stages
        above find down the chain."""
        return self._recorder

    @recorder.setter
    def recorder(self, rec: EpochRecorder) -> None:
        self._recorder = rec
        self._filler.recorder = rec

    def accept_batch_buffers(self, buffers: BatchBuffers) -> None:
        """Decode rows straight into ``buffers`` where the plan allows (the gather stage above
        offers its batch buffers when it is built; see the module docstring)."""
        self._buffers = buffers
        self._epoch_plan = None  # decided again at the next batch

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _runtime.check_same_process(self._pid)
        self._teardown()
        with self._bad_lock:
            self._bad.clear()
        self.source.reset(initial_state[SOURCE_KEY] if initial_state is not None else None)
        self._exhausted = False
        self._last_state = self.source.state_dict()

    def get_state(self) -> dict[str, Any]:
        # The state as of the last batch handed downstream, not of plans pulled ahead.
        return {SOURCE_KEY: self._last_state}

    def next(self) -> FetchedBatch:
        _runtime.check_same_process(self._pid)
        started = time.perf_counter()
        try:
            return self._next()
        finally:
            rec = self._recorder
            rec.add("admit_s", time.perf_counter() - started)

    def _next(self) -> FetchedBatch:
        self._top_up()
        if not self._queue:
            raise StopIteration
        head = self._queue.popleft()
        if not head.done and not self._admit(head):
            raise RuntimeError(
                f"the chunk pool ({self.pool.budget_bytes:,} bytes) has no room for the chunks "
                f"of batch {head.plan.index} even after releasing everything older; this is a "
                "bug in insitubatch_nodes, please report it"
            )
        self._ahead_bytes -= head.ahead_bytes
        self._last_state = head.state
        entries = self._entries_read(head.plan, head.in_place)
        self._top_up()
        release = functools.partial(self._release, self._generation, head.plan)
        return FetchedBatch(
            plan=head.plan,
            entries=entries,
            release=release,
            jobs=tuple(head.jobs),
            arrays=head.arrays,
            direct=head.rows,
        )

    def _entries_read(
        self, plan: BatchPlan, in_place: Mapping[int, set[int]]
    ) -> dict[ChunkKey, ChunkEntry]:
        """The pinned entries of every pool chunk ``plan`` reads (not of the chunks decoded
        straight into its rows, ``in_place``)."""
        live = self._live
        out: dict[ChunkKey, ChunkEntry] = {}
        if not live:  # every chunk of it was decoded in place
            return out
        for i, group in enumerate(self._groups):
            chunks = plan.chunks_read(i).tolist()
            if i in in_place:
                chunks = [c for c in chunks if c not in in_place[i]]
            for path in group.paths:
                for c in chunks:
                    entry = live.get((path, c))
                    if entry is not None:
                        out[(path, c)] = entry
        return out

    # -- pins -------------------------------------------------------------------------------
    def slot_spec(self, path: str) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
        """``(shape, dtype, level_major)`` of the slots this node fills for array ``path`` (as
        :meth:`ChunkPool.acquire` and :meth:`ChunkPool.reserve` take them)."""
        geom = self.slot_geoms[path]
        shape = (geom.samples_per_chunk, *geom.inner_shape)
        return shape, geom.dtype, self._level_major[path]

    def reserve_specs(
        self, plan: EpochPlan, limit_bytes: int
    ) -> list[tuple[tuple[int, ...], np.dtype[Any], bool]]:
        """Slot specs of the pool chunks ``plan`` fetches, in first-need order, up to
        ``limit_bytes`` (what :meth:`ChunkPool.reserve` is worth paying for ahead of need;
        rows decoded straight into batches take no slot)."""
        groups = self._plan_groups(plan)
        order: list[tuple[int, int, int]] = []  # (first row, group, segment)
        for gi, (ledger, group) in enumerate(zip(plan.ledgers, groups, strict=True)):
            seg = ledger.by_first
            if group.direct is not None:
                seg = seg[ledger.first[seg] != ledger.last[seg]]
            seg = seg[: max(0, limit_bytes // max(1, group.nbytes)) + 1]
            firsts = ledger.first[seg].tolist()
            order.extend((f, gi, s) for f, s in zip(firsts, seg.tolist(), strict=True))
        order.sort()
        out: list[tuple[tuple[int, ...], np.dtype[Any], bool]] = []
        total = 0
        for _, gi, _ in order:
            for path in groups[gi].paths:
                spec = self.slot_spec(path)
                total += math.prod(spec[0]) * spec[1].itemsize
                if total > limit_bytes:
                    return out
                out.append(spec)
        return out

    def _release(self, generation: int, plan: BatchPlan) -> None:
        """Unpin chunks the consumer has read for the last time this epoch."""
        if generation != self._generation:  # the pins went with a reset or close
            return
        pins, live = self._pins, self._live
        if not pins:  # every chunk so far was decoded into its rows: nothing is pinned
            return
        epoch = plan.epoch_plan
        at = plan.index - epoch.first_batch
        done: list[ChunkEntry] = []
        for ledger in epoch.ledgers:
            for c in ledger.chunk[ledger.released(at)].tolist():
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
        if self.pool.unpin(done):  # chunks left unpinned while still arriving
            self._filler.cancel()

    @property
    def bad_chunks(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(array, chunk_index, tile)`` of every stored object read as bad since the last
        reset (this epoch), in the order they were found; empty under ``on_bad_chunk="raise"``."""
        with self._bad_lock:
            return list(self._bad)

    @property
    def pinned(self) -> int:
        """Chunks this node currently holds pinned."""
        return sum(self._pins.values())

    def close(self) -> None:
        """Drop this node's pins and cancel the fills nobody else pins; with a ``cache_dir``,
        let go of the directory and its lock (resident chunks are dropped; iterating again
        takes it back). Returns within a few seconds whatever the store does."""
        self.pool.stop_reserve()
        self._teardown()
        self.pool.close_cache()

    # -- read-ahead and admission ----------------------------------------------------------
    def _top_up(self) -> None:
        for pending in self._queue:
            if not pending.done and not self._admit(pending):
                return
        while not self._exhausted and (not self._queue or self._ahead_bytes < self._read_ahead):
            try:
                plan = next(self.source)
            except StopIteration:
                self._exhausted = True
                return
            carried = plan.epoch_plan is not self._epoch_plan
            if carried:
                self._start_epoch(plan.epoch_plan)
            pending = self._prepare(plan, carried)
            self._queue.append(pending)
            if not self._admit(pending):
                return

    def _start_epoch(self, plan: EpochPlan) -> None:
        floor, read_ahead = working_set_bytes(plan, self.slot_geoms)
        self.pool.ensure_floor(floor)  # an automatic budget grows; an explicit one may raise
        self._epoch_plan, self._read_ahead = plan, read_ahead
        self._groups = self._plan_groups(plan)

    def _plan_groups(self, plan: EpochPlan) -> list[PlanGroup]:
        if plan is self._epoch_plan and self._groups:
            return self._groups
        buffers = self._buffers
        direct_ok = direct_allowed(plan, self.pool, buffers, self.direct, self.slot_geoms)
        out = []
        for ledger in plan.ledgers:
            nbytes = sum(self.slot_geoms[p].chunk_nbytes for p in ledger.paths)
            labels = (
                direct_labels(plan, ledger, buffers, self.geoms, self.transforms)
                if direct_ok and buffers is not None
                else None
            )
            row = 0 if labels is None else sum(self.geoms[p].sample_nbytes for p in ledger.paths)
            out.append(PlanGroup(tuple(ledger.paths), nbytes, labels, row))
        return out

    def _prepare(self, plan: BatchPlan, carried: bool) -> PendingBatch:
        """What admitting ``plan`` takes: the pool chunks it (first) reads, in need order, and
        a job for the rows decoded straight into its arrays."""
        epoch = plan.epoch_plan
        at = plan.index - epoch.first_batch
        requests: list[tuple[ChunkKey, tuple[int, ...], np.dtype[Any], int, bool]] = []
        pending = PendingBatch(plan=plan, state=self.source.state_dict(), requests=requests)
        direct: list[tuple[PlanGroup, np.ndarray, np.ndarray, np.ndarray]] = []
        misses = re_reads = 0
        for gi, (ledger, group) in enumerate(zip(epoch.ledgers, self._groups, strict=True)):
            seg = ledger.fetched(at)
            if carried:  # resumed mid-epoch: chunks earlier batches first read, read again
                seg = np.concatenate([ledger.carried(at, epoch.batch_size), seg])
            if group.direct is not None and len(seg):
                single = ledger.first[seg] == ledger.last[seg]
                if self.pool.has_entries():  # a chunk the pool holds is a hit, not a read
                    single &= ~self._resident(group, ledger.chunk[seg])
                if single.any():
                    chunks = ledger.chunk[seg[single]]
                    rows = ledger.first[seg[single]] - at * epoch.batch_size
                    # which view reads each: at one sample per chunk, chunk = anchor + offset
                    offsets = chunks - plan.anchors[rows]
                    direct.append((group, chunks, rows, offsets))
                    pending.in_place[gi] = set(chunks.tolist())
                    misses += len(chunks) * len(group.paths)
                    re_reads += self._seen(group.paths, chunks)
                    seg = seg[~single]
            if len(seg):
                specs = [(path, *self._specs[path]) for path in group.paths]
                for c in ledger.chunk[seg].tolist():
                    for path, shape, dtype, level_major, spc, n, per in specs:
                        valid = min(spc, n - c // per * spc)  # samples the chunk holds
                        requests.append(((path, c), shape, dtype, valid, level_major))
        if direct:
            assert self._buffers is not None
            job = pending.job = FillJob(_runtime.next_ticket(), self._generation)
            arrays = pending.arrays = self._buffers.take(len(plan))
            for group, chunks, rows, offsets in direct:
                assert group.direct is not None
                for offset in np.unique(offsets).tolist():
                    pick = offsets == offset
                    chunk_list, row_list = chunks[pick].tolist(), rows[pick].tolist()
                    for path, labels in group.direct.items():
                        label = labels[offset]
                        job.add_rows(self._arrays[path], arrays[label], chunk_list, row_list)
                        pending.rows[label] = pending.rows.get(label, 0) + len(row_list)
                pending.ahead_bytes += group.row_bytes * len(chunks)
            self._ahead_bytes += pending.ahead_bytes
            rec = self.recorder
            rec.on_admit_counts(0, misses, re_reads)
            self.pool.note_misses_in_place(misses)  # the report counts them as misses
        return pending

    def _resident(self, group: PlanGroup, chunks: np.ndarray) -> np.ndarray:
        lookup = self.pool.lookup
        return np.array(
            [any(lookup((p, c)) is not None for p in group.paths) for c in chunks.tolist()],
            dtype=bool,
        ).reshape(len(chunks))

    def _seen(self, paths: tuple[str, ...], chunks: np.ndarray) -> int:
        """How many of ``chunks`` of every path of ``paths`` (read together) this node fetched
        before (re-reads), marking them fetched now."""
        bits = self._fetched.get(paths)
        need = int(chunks.max()) + 1 if len(chunks) else 0
        if bits is None or len(bits) < need:
            grown = np.zeros(max(need, self.geoms[paths[0]].n_chunks), dtype=bool)
            if bits is not None:
                grown[: len(bits)] = bits
            bits = self._fetched[paths] = grown
        seen = int(np.count_nonzero(bits[chunks])) * len(paths)
        bits[chunks] = True
        return seen

    def _admit(self, pending: PendingBatch) -> bool:
        """Pin the plan's first reads in order and start their fill; False when the pool has no
        room for all of them yet."""
        job = pending.job or FillJob(_runtime.next_ticket(), self._generation)
        pending.job = None
        todo = pending.requests[pending.admitted :]
        got = self.pool.acquire_many(todo, job.fill) if todo else []
        hits = 0
        live, pins, arrays, region = self._live, self._pins, self._arrays, self._filler.region
        missed: dict[str, list[int]] = {}
        ahead = 0
        for entry, hit in got:
            key = entry.key
            if entry.bad_tiles:  # read as bad by an earlier fill: still bad here
                self._note_bad(self._generation, key[0], key[1], entry.bad_tiles)
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
        self._ahead_bytes += ahead
        rec = self.recorder
        if got:
            re_reads = sum(self._seen((p,), np.asarray(c)) for p, c in missed.items())
            misses = sum(len(c) for c in missed.values())
            rec.on_admit_counts(hits, misses, re_reads)
        pending.admitted += len(got)
        if job.units or job.rows:
            pending.jobs.append(job)
            self._jobs.add(job)
            self._filler.submit(job)
        else:
            job.fill.resolve()  # nothing to fill: its entries (if any) were hits
        return pending.done

    def _note_bad(
        self, generation: int, path: str, chunk: int, tiles: Iterable[tuple[int, ...]]
    ) -> bool:
        """List bad stored objects for this epoch; False (nothing listed) for a fill started
        before the last reset, which belongs to an epoch that is over."""
        with self._bad_lock:
            if generation != self._generation:
                return False
            for tile in tiles:
                self._bad[(path, chunk, tile)] = None
            return True

    def _teardown(self) -> None:
        """Drop every pin this node holds and cancel the fills left unpinned (no waiting)."""
        self._generation += 1
        held = [self._live[k] for k, n in self._pins.items() for _ in range(n)]
        detached = self.pool.unpin(held)
        jobs = list(self._jobs)
        self._jobs = weakref.WeakSet()
        for pending in self._queue:
            if pending.job is not None:  # built, never started
                pending.job.fill.resolve()
        self._live.clear()
        self._pins.clear()
        self._queue.clear()
        self._ahead_bytes = 0
        self._epoch_plan = None
        self._groups = []
        if detached or jobs:
            self._filler.cancel(jobs)

    @property
    def scratch_bytes(self) -> int:
        """Decode scratch memory this node's decoders hold (over all decode threads), plus the
        idle buffers kept for decoding chunks that a transform reshapes."""
        return sum(d.scratch_bytes for d in self._decoders.values()) + self._filler.spare_bytes

    @property
    def inflight(self) -> int:
        """Stored-object GETs (and their decodes) in flight right now (for a local store:
        objects being read or decoded)."""
        if self._getter is not None:
            return self._getter.inflight
        return sum(job.runs for job in list(self._jobs))


def _patched_paths(source: Any, geoms: Mapping[str, ArrayGeometry]) -> frozenset[str]:
    """Arrays read through patched views: those of ``geoms`` and of the read plan below."""
    views = list(geoms.values())
    plan = find_node(source, ReadPlanNode)
    if plan is not None:
        views.extend(plan.variables.values())
    return frozenset(g.path for g in views if g.patch is not None)


def _split_bytes(source: Any, geoms: Mapping[str, ArrayGeometry], epoch: int) -> int:
    """Bytes of every chunk epoch ``epoch`` reads (what a budget must hold for no re-read)."""
    node = find_node(source, ReadPlanNode)
    if node is None:
        return 0
    plan = node.epoch_plan(epoch)
    keys = {k for b in plan.batch_indices for k in plan.batch_fetches(b)}
    size = {path: g.chunk_nbytes for path, g in geoms.items()}
    return sum(size[path] for path, _ in keys)
