"""The fetch stage: which stored objects each batch needs fetched, admitted a batch at a time.

:class:`AsyncChunkFetchNode` pulls :class:`~insitubatch_nodes.plan.ledger.BatchPlan` s from its
source ahead of the consumer. It is three parts, each in its own module:

* the node (here): its configuration, made once in ``__init__`` from the graph's
  :class:`~insitubatch_nodes.stages.context.StageContext` (the pool, the chunk transforms, the
  batch buffers, the recorder, the :class:`~insitubatch_nodes.options.FetchOptions`); its
  running state is made afresh by every ``reset``;
* admission (:mod:`~insitubatch_nodes.stages._admit`): the plans pulled ahead, the chunks each
  batch is the first to read pinned in the :class:`~insitubatch_nodes.pool.ChunkPool` in one
  step (a chunk the pool holds is a hit and is not fetched again), the read-ahead;
* the filling (:mod:`~insitubatch_nodes.stages._fill`, :mod:`~insitubatch_nodes.stages._get`):
  every miss joins one :class:`~insitubatch_nodes.stages._jobs.FillJob` whose stored objects
  are read on the decode threads (a store on local disk) or GET on the shared IO loop, then
  decoded there.

**Rows decoded straight into the batch.** At one sample per chunk a stored object *is* a batch
row. When the plan says a chunk is read by exactly one row of one label this epoch (a plan
group of one sample per chunk, every array read by one label, no chunk transforms, no
persistent cache) and the schedule does not keep the epoch's chunks for the next epoch
(:func:`~insitubatch_nodes.plan.schedule.kept_bytes`: they do not fit the budget, or 1/16 of RAM
for the automatic one), its objects are decoded into that row of
the batch's own arrays — no slot, no pin, no copy by the gather. The arrays come from the
context's batch buffers (:class:`~insitubatch_nodes.stages.buffers.BatchBuffers`), which the
gather stage above fills with the other rows. ``FetchOptions(direct=False)`` turns this off (a
graph whose batches are not assembled by a :class:`~insitubatch_nodes.stages.gather.GatherNode`
needs that), ``direct=True`` uses it whatever the budget.

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

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar

from torchdata.nodes import BaseNode
from zarr.storage import ObjectStore

from insitubatch_nodes import _process, _runtime
from insitubatch_nodes.io import _zarr_compat, objects
from insitubatch_nodes.io.arrays import check_arrays_in_store
from insitubatch_nodes.io.collection_checks import check_collection_in_store
from insitubatch_nodes.io.coords import same_store_reader
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.localfiles import local_reader
from insitubatch_nodes.io.routing import RoutingStore
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store, retry_policy
from insitubatch_nodes.plan.ledger import BatchPlan
from insitubatch_nodes.plan.memory_floor import (
    HeldMemory,
    decode_scratch_bytes,
    every_epoch_budget,
    held_memory,
    slot_room,
    spare_bytes,
)
from insitubatch_nodes.plan.schedule import PinSchedule, ScheduleFloors, schedule_floors
from insitubatch_nodes.plan.working_set import working_set_bytes
from insitubatch_nodes.stages._admit import (
    Admission,
    FetchHistory,
    FetchSetup,
    epoch_floor,
    reserve_specs,
)
from insitubatch_nodes.stages._fill import FillRunner
from insitubatch_nodes.stages._get import GetQueue, cancel_all_at_exit
from insitubatch_nodes.stages._graph import (
    SOURCE_KEY,
    plan_state,
    source_start_state,
    source_state,
)
from insitubatch_nodes.stages._jobs import ArrayFill, FetchedBatch, KeepingDecoder, SlotLayout
from insitubatch_nodes.stages._memrule import most_transform_bytes
from insitubatch_nodes.stages._ranges import profile_range
from insitubatch_nodes.stages._wiring import check_wiring, claim
from insitubatch_nodes.stages.buffers import BatchBuffers, batches_in_flight
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.read_plan import ReadPlanNode

__all__ = ["AsyncChunkFetchNode"]


class AsyncChunkFetchNode(BaseNode[FetchedBatch]):
    """Fetch + decode stage (see the module docstring).

    ``source`` yields the plans (the context's :class:`ReadPlanNode`, or a node over it);
    ``store`` is the zarr store the arrays live in (a path or URL is opened read-only, as
    :func:`~insitubatch_nodes.io.stores.as_store` opens it). When it is a
    ``zarr.storage.ObjectStore`` the GETs go straight to the obstore store underneath
    (``obstore.get_async``); any other zarr store is read with its own ``get``. A store that
    is exactly a local folder is not read with GETs: each object is read and decoded by one
    decode-pool thread (:mod:`~insitubatch_nodes.io.localfiles`; no deadline applies there).
    Every GET fails with ``TimeoutError`` after ``retry.timeout_s`` (the options' ``retry``; by
    default the policy the store was opened with, see
    :func:`~insitubatch_nodes.io.stores.retry_policy`). With ``check_arrays`` (the default) the
    store is checked to hold the context's arrays with their geometry, as the builder checks it
    (one metadata read per array; ``ValueError`` / ``FileNotFoundError`` naming the array and
    the store otherwise); the builder, having checked, passes ``False``. ``coords_reader`` (the
    :func:`~insitubatch_nodes.io.coords.coordinate_reader` of the opened store passed here that
    the geometries were read with, ``open_geometries(..., coords_reader=)``) serves that check
    the metadata it read already, as ``insitu_pipeline(..., coords_reader=)`` does: each
    document is read once for the whole graph (before 2026-12-07 this check read each array's
    metadata again, ``tests/test_newestcache_trial.py``). One of another store is a
    ``ValueError``; without one, the check reads the store.

    The build's memory check (:attr:`counted`) counts ``transform_bytes`` beside the pool,
    what the batch transforms hold at most (the builder passes
    :func:`~insitubatch_nodes.stages.gather.most_transform_bytes`; where it is not given, the
    :class:`~insitubatch_nodes.stages.gather.GatherNode` counts the same when it is built),
    and an automatic budget as the most every epoch grows it to, from ``floors``
    (:func:`~insitubatch_nodes.plan.schedule.schedule_floors` of the context's plan; computed
    here where not given). :meth:`count_views` counts it for other views. An automatic
    budget keeps a small split whole only where the check leaves its slots room beside the
    batch transforms; where the ``GatherNode`` counts more than this stage was told, that
    choice is made again with them (:meth:`_count_build`), so a graph composed by hand
    decides as the builder's: not told, this stage grows the pool at its build only to the
    first epoch's floor without keeping, and the first epoch's start grows it to what was
    decided (before 2026-12-07 the choice left them out, and the ``GatherNode`` then refused
    a graph the builder builds, ``tests/test_setviews_trial.py``).

    ``source`` must be the context's read plan (or a node over it); a graph wired wrong is
    refused here (:mod:`~insitubatch_nodes.stages._wiring`).

    Everything else is the ``context``'s: the arrays (its plan's), the pool, the chunk
    transforms (they run on the decode threads on every chunk this node decodes, once all of
    its stored objects have landed; slots are sized at their output, :attr:`slot_geoms`), the
    recorder, and the options (``max_inflight``, ``decode_threads``, ``on_bad_chunk``,
    ``direct``; see :class:`~insitubatch_nodes.options.FetchOptions`).

    ``on_bad_chunk="raise"`` (default): a stored object that still cannot be read after the
    store's retries, or cannot be decoded, fails its chunk, and the error reaches the consumer.
    ``"nan"``: that object's rectangle of the chunk is filled with NaN (floating-point arrays)
    or the array's fill value (others) before the chunk transforms run, the epoch goes on, and
    :attr:`bad_chunks` lists ``(array, chunk_index, tile)``. A chunk with a bad object is not
    kept resident once its last reader is done (the next epoch reads it again). Errors in
    chunk transforms are not bad chunks: they always reach the consumer.
    """

    STAGE: ClassVar[int] = 1  # its place in a graph (stages/_wiring.py)

    def __init__(
        self,
        source: BaseNode[BatchPlan],
        store: StoreLike,
        *,
        context: StageContext,
        check_arrays: bool = True,
        coords_reader: Any = None,
        floors: ScheduleFloors | None = None,
        transform_bytes: int | None = None,
    ) -> None:
        context = check_wiring(self.STAGE, source, context)
        super().__init__()
        options = context.options
        self.source = source
        # a path or URL is opened as the builder opens it (read-only), here, not at a first read
        self.store = store = as_store(store)
        self.geoms = context.geoms
        if check_arrays:  # what insitu_pipeline checks before it builds the stages
            memo = None if coords_reader is None else same_store_reader(coords_reader, store)
            plain = {p: g for p, g in self.geoms.items() if g.members is None}
            check_arrays_in_store(store, plain, memo)
            for geom in self.geoms.values():
                if geom.members is not None:
                    check_collection_in_store(store, geom, memo)
        self.context = context
        self.pool = context.pool
        self.transforms = context.transforms
        self.patched = context.patched
        self.slot_geoms = context.slot_geoms
        self.recorder = context.recorder
        self.on_bad_chunk = options.on_bad_chunk
        self.max_inflight = options.max_inflight
        self.retry = retry_policy(store) if options.retry is None else options.retry
        self._store_name = describe_store(store)
        self._decoders = {path: ChunkDecoder(g) for path, g in self.geoms.items()}
        self._decode_pool = _runtime.decode_pool(options.decode_threads)
        _process.tune_allocator()  # reuse GET and scratch buffers' memory (see its docstring)
        if isinstance(store, ObjectStore):
            _process.check_obstore_usable()
        # A folder on this machine is read on the decode threads (see localfiles), not as GETs.
        reader = local_reader(store)
        #: whether slot and batch memory is made ahead of need (:meth:`_prepare_pool`)
        self.memory_ahead = reader is None and self.pool.cache is None
        get = None
        if reader is None:
            get = objects.make_async_getter(store, timeout_s=self.retry.timeout_s)
        self._runner = FillRunner(
            pool=self.pool,
            decode_pool=self._decode_pool,
            reader=reader,
            get=get,
            loop=_runtime.io_loop(),
            max_inflight=options.max_inflight,
            transforms=self.transforms,
            on_bad_chunk=options.on_bad_chunk,
            store_name=self._store_name,
            note_bad=self._note_bad,
            recorder=self.recorder,
        )
        routed = (
            [describe_store(s) for s in store.stores] if isinstance(store, RoutingStore) else []
        )
        steps = context.plan.manifest.steps  # listed at build: an absent object is gone since
        listed = steps is not None and steps.absent is not None
        missing_raises = not _zarr_compat.reads_missing_chunks()  # as zarr would read them
        layouts = {path: self._layout(path) for path in self.slot_geoms}
        arrays = {
            path: ArrayFill(
                g,
                self._decoders[path],
                units=path in self.patched,
                held=context.held.get(path),
                routed=routed,
                listed=listed,
                missing_raises=missing_raises,
            )
            for path, g in self.geoms.items()
        }
        # the memory rule's parts beside the pool (plan/memory_floor.py), slots in RAM only
        in_ram = self.pool.slots_in_ram
        in_flight = batches_in_flight(options.prefetch_depth) * context.buffers.batch_nbytes
        scratch = self._most_scratch(layouts, arrays)
        self._in_flight, self._scratch = in_flight, scratch
        self._setup = FetchSetup(
            pool=self.pool,
            geoms=self.geoms,
            slot_geoms=self.slot_geoms,
            layouts=layouts,
            arrays=arrays,
            transforms=self.transforms,
            buffers=context.buffers,
            direct=options.direct,
            recorder=self.recorder,
            held=context.held,
        )
        self._history = FetchHistory(self.geoms)
        first = context.plan.epoch_plan(0)  # (drawn once: the floor and the memory checks)
        if self.pool.auto and floors is None:
            plan = context.plan
            floors = schedule_floors(plan.manifest, plan.views, plan.plan_config, plan.held)
        self._floors = floors
        # the memory check: before this node holds anything, so nothing to tear down
        context.memory.count(  # (kept in the context: the gather stage adds its transforms)
            self._count_build(int(transform_bytes or 0)),
            enforced=in_ram,
            explicit=not self.pool.auto,
            block_chunks=context.plan.block_chunks,
        )
        # (the gather stage counts the batch transforms: the keep decision is made again)
        context.memory.recount = self._count_build
        # what the pool grows to at the build: not told the batch transforms' bytes, the
        # floor without keeping the split (the GatherNode's count may turn that decision)
        self._build_floor = self._first_floor
        if transform_bytes is None and self._setup.keep_room is not None:
            self._build_floor = working_set_bytes(first, self.slot_geoms)[0]
        context.plan.check_views_with(self._count_views)  # (other views: counted again)
        self._pid = os.getpid()
        # bad stored objects of this epoch (written on any thread, read from any thread)
        self._bad: dict[tuple[str, int, tuple[int, ...]], None] = {}
        self._bad_lock = threading.Lock()
        self._generation = 0  # bumped by every teardown: older fills note nothing
        self._admission: Admission | None = None  # the running state, made by reset
        self._stopping: Future[None] = Future()  # the running state's interrupt
        self._last_state: dict[str, Any] | None = None
        _runtime.stop_at_exit("fetch", self, cancel_all_at_exit)
        context.join(self)
        self._prepare_pool()
        claim(self, source)

    @property
    def counted(self) -> HeldMemory:
        """What the build's memory check counts this pipeline to hold at most
        (:mod:`~insitubatch_nodes.plan.memory_floor`; the context's ``memory``, which the
        gather stage and ``set_views`` count again)."""
        counted = self.context.memory.counted
        assert counted is not None  # (counted in __init__)
        return counted

    def count_views(
        self,
        views: Mapping[str, Any],
        schedule: PinSchedule,
        extra: Sequence[Any] = (),
        *,
        plan: ReadPlanNode | None = None,
        floors: ScheduleFloors | None = None,
    ) -> HeldMemory:
        """What the memory check counts this pipeline to hold once it reads ``views`` (batch
        label -> view, as :meth:`ReadPlanNode.set_views <insitubatch_nodes.stages.read_plan.
        ReadPlanNode.set_views>` takes them) under ``schedule``: the batches in flight in
        their buffers, the chunks their first epoch reads, an automatic budget grown to what
        their epochs grow it to (it never shrinks: at least what was counted), the same decode
        scratch, and what the batch transforms hold on them (the gather stage's, see
        ``context.memory``) with ``extra`` ones (a stack's constants ``set_views`` adds).
        ``plan``: a read plan node of ``views`` under ``schedule`` (the plan's ``set_views``
        gives the one it drew their first epoch on; default: one is made here), ``floors``
        their :func:`~insitubatch_nodes.plan.schedule.schedule_floors` where the caller has
        them (trusted; computed here otherwise, for an automatic budget).
        ``ValueError`` where that breaks the rule, as at the build; nothing is kept (the
        plan's ``set_views`` keeps it in ``context.memory``)."""
        current = self.context.plan
        if plan is None:
            plan = ReadPlanNode(
                current.manifest, views, schedule=schedule, config=current.plan_config
            )
            plan.hold(current.held)
        first = plan.epoch_plan(current.next_epoch)
        rows = self.context.buffers.rows
        batches = batches_in_flight(self.context.options.prefetch_depth)
        batch = BatchBuffers(plan.views, rows, plan.layout).batch_nbytes  # (nothing allocated)
        budget, was, most = self.pool.budget_bytes, self.counted, self.context.memory.transforms
        if self.pool.auto:
            if floors is None:
                floors = schedule_floors(plan.manifest, plan.views, plan.plan_config, plan.held)
            grown = every_epoch_budget(epoch_floor(self._setup, first)[0], floors, schedule)
            budget = max(was.budget, grown)
        transforms = was.transforms if most is None else most(views)
        transforms += most_transform_bytes(extra, views, rows, batches)
        held = held_memory(budget, first, self.slot_geoms, batches * batch, was.scratch, transforms)
        try:
            self.context.memory.check(held)
        except ValueError as exc:
            raise ValueError(
                f"set_views: the pipeline cannot hold these views, which it checks as it "
                f"checks a build — {exc}. The views in effect are kept: give views that read "
                "less (fewer window steps, channels, static members or forcings), or build "
                "the pipeline anew for these"
            ) from None
        return held

    def _count_build(self, transforms: int) -> HeldMemory:
        """What the build's memory check counts this stage's graph to hold beside
        ``transforms`` bytes of batch transforms (returned; the caller keeps the count, this
        stage keeps the keep-the-split decision and the first epoch's floor made here): an
        automatic budget with
        slots in RAM keeps a small split whole only where the rule leaves its slots room beside
        them (``keep_room``, :func:`~insitubatch_nodes.plan.memory_floor.slot_room`), decided
        here — at the build, and again where the gather stage counts more than this stage was
        told (``context.memory.recount``), so that a graph composed by hand decides as the
        builder's; the automatic budget as every epoch may grow it, an explicit one as given."""
        pool = self.pool
        room = None
        if pool.slots_in_ram and pool.auto:
            room = slot_room(self._in_flight, self._scratch, transforms)
        self._setup = dataclasses.replace(self._setup, keep_room=room)
        plan = self.context.plan
        first = plan.epoch_plan(0)  # (the build's draw, kept by the plan)
        self._first_floor = epoch_floor(self._setup, first)[0]
        budget = pool.budget_bytes
        if pool.auto:
            assert self._floors is not None  # (computed at the build)
            budget = every_epoch_budget(self._first_floor, self._floors, plan.schedule)
        return held_memory(
            budget, first, self.slot_geoms, self._in_flight, self._scratch, transforms
        )

    def _count_views(
        self,
        views: Mapping[str, Any],
        schedule: PinSchedule,
        *,
        plan: ReadPlanNode,
        extra: Sequence[Any],
        floors: ScheduleFloors | None,
    ) -> Callable[[], None]:
        """The plan's check of the views its ``set_views`` is given (:meth:`count_views`, on
        the node it drew them on): the one count of the rule for them (``InSituPipeline.
        set_views`` gives its stacks' constants as ``extra``). Returns what keeps it as the
        count, which the plan calls once it takes them (not where another rank refused them)."""
        held = self.count_views(views, schedule, extra, plan=plan, floors=floors)
        memory = self.context.memory

        def keep() -> None:
            memory.counted = held

        return keep

    def _most_scratch(
        self, layouts: Mapping[str, SlotLayout], arrays: Mapping[str, ArrayFill]
    ) -> int:
        """The decode scratch the memory check counts (:attr:`scratch_bytes` at most): a stored
        object per decode thread for each array whose objects may be decoded aside (not those
        that all decode in place: into their slots, or into the whole-object buffers or
        stored-layout spares below), the buffers a selection's objects are decoded into whole
        (per thread and object shape), and the chunks of the stored layout that the chunks of
        a reshaping transform are decoded into, idle and being decoded (``spare_bytes``; before
        2026-12-07 a reshaped array of one object per chunk, decoded in place into them, was
        counted scratch too)."""
        threads = len(self._decode_pool.threads)
        reshaped = {p: g for p, g in self.geoms.items() if self.transforms.reshapes(p)}
        # (a reshaped array's objects decode into a spare of the stored, sample-first layout)
        aside = {
            p: g
            for p, g in self.geoms.items()
            if not (
                arrays[p].decodes_in_place(g.base, False)
                if p in reshaped
                else arrays[p].decodes_in_place(
                    self.slot_geoms.get(p, g), p in layouts and layouts[p].level_major
                )
            )
        }
        keeping = [a.decoder for a in arrays.values() if isinstance(a.decoder, KeepingDecoder)]
        return (
            decode_scratch_bytes(aside, threads, self._decoders)
            + sum(d.most_aside_bytes(threads) for d in keeping)
            + spare_bytes(reshaped, threads, None if self.gets is None else self.max_inflight)
        )

    def _layout(self, path: str) -> SlotLayout:
        """How this node requests the slots of ``path``. Arrays stored one level per object
        get level-major slots, which their objects decode into in place (see the pool). Not
        under chunk transforms: those see the slot, and a transform written for C-ordered data
        (``data.reshape(n, -1)[...] = ...``) would silently write into a copy of a level-major
        one. A patched array's keys name units: ``n_tiles`` of them per chunk."""
        geom, stored = self.slot_geoms[path], self.geoms[path]
        level_major = (
            stored.one_level_per_object
            and not self.transforms.active(path)
            and path not in self.patched
        )
        return SlotLayout(
            shape=(geom.samples_per_chunk, *geom.inner_shape),
            dtype=geom.dtype,
            level_major=level_major,
            samples_per_chunk=geom.samples_per_chunk,
            n_samples=geom.n_samples,
            units_per_chunk=stored.n_tiles if path in self.patched else 1,
            counts=None if stored.product is None else stored.product.counts,
        )

    def _prepare_pool(self) -> None:
        """Size an automatic budget to the first epoch's working set; where the store is not a
        folder read on the decode threads (and no cache directory holds the slots), make that
        epoch's slots and the batch buffers in flight ahead of need, on threads of their own,
        in the order they will be needed (:meth:`ChunkPool.reserve`,
        :meth:`BatchBuffers.reserve <insitubatch_nodes.stages.buffers.BatchBuffers.reserve>`).

        A remote store's epoch 0 waits on the network, and the reserves use the CPU it leaves
        idle; a local folder's is CPU-bound — reads from the page cache and decodes on every
        core — and there the reserves only took the decode threads' CPU: measured on the
        project's 2-core VM (2026-12-07, fresh processes alternated), epoch 0 with them on
        ``wb-c1`` in 0.97–1.06 s against 0.85–0.93 s without, on ``wb-c16`` 2.8–3.4 s against
        1.4–2.3 s, at the reference shape no difference (docs/pipeline.md); over S3 (moto, 10 ms)
        ``wb-c1``'s epoch 0 ran at 0.91–0.94 of raw GETs with them, 0.86–0.87 without."""
        self.pool.ensure_floor(self._build_floor)
        if self.memory_ahead:
            first = self.context.plan.epoch_plan(0)
            self.pool.reserve(reserve_specs(self._setup, first, self.pool.budget_bytes))
            depth = self.context.options.prefetch_depth
            self.context.buffers.reserve(batches_in_flight(depth))

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _process.check_same_process(self._pid)
        self._teardown()
        with self._bad_lock:
            self._bad.clear()
        self.source.reset(source_state(initial_state))
        self._start_admission()
        self._last_state = self.source.state_dict()

    def _start_admission(self) -> Admission:
        self._stopping = Future()
        self._admission = Admission(
            self._setup,
            self.source,
            self._runner,
            self._history,
            self._generation,
            self._note_bad,
            self._stopping,
        )
        return self._admission

    def get_state(self) -> dict[str, Any]:
        # The state as of the last batch handed downstream, not of plans pulled ahead.
        return {SOURCE_KEY: self._last_state}

    def start_state(self, epoch: int) -> dict[str, Any] | None:
        """This stage's state before the first batch of ``epoch`` (see ``_graph``)."""
        return source_start_state(self.source, epoch)

    def next(self) -> FetchedBatch:
        _process.check_same_process(self._pid)
        started = time.perf_counter()
        index = -1
        try:
            admission = self._admission or self._go_on()
            with profile_range("insitu.admit"):
                got = admission.next_batch()
            if got is None:
                raise StopIteration
            batch, self._last_state = got
            index = batch.plan.index
            return batch
        finally:
            rec = self.recorder
            rec.add("admit_s", time.perf_counter() - started, start=started, batch=index)

    def _go_on(self) -> Admission:
        """After a close with no reset since: the closed run's plans pulled ahead are gone, so
        the source goes back to the last batch handed downstream and a new run starts after it
        (``StopIteration`` when that batch ended its epoch). A root ``PrefetcherNode`` resets
        the graph to its delivered position instead, before this is ever reached."""
        plan, last = self.context.plan, plan_state(self._last_state or {})
        if int(last["epoch"]) == plan.epoch and int(last["batches_emitted"]) >= plan.current_len:
            raise StopIteration
        self.source.reset(self._last_state)
        return self._start_admission()

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the graph, as ``close()`` on its root does (:meth:`StageContext.close_graph`):
        this node's pins and fills, and with a ``cache_dir`` the directory and its lock
        (resident chunks are dropped; iterating again takes it back). Returns within a few
        seconds whatever the store does."""
        self.context.close_graph()

    def release(self) -> None:
        """Drop this node's pins, cancel the fills nobody else pins, let go of the cache
        directory (the context calls it; so does the exit hook)."""
        self.pool.stop_reserve()
        self._teardown()
        self.pool.close_cache()

    def interrupt(self) -> None:
        """Wake admission's one wait (for the slots of a torn-down run's fills, see
        :meth:`Admission.next_batch`) now (thread-safe): it raises ``PipelineInterrupted``."""
        stopping = self._stopping
        if not stopping.done():
            stopping.set_result(None)

    def _teardown(self) -> None:
        """Drop every pin of the running state and cancel the fills left unpinned."""
        with self._bad_lock:
            self._generation += 1
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.teardown()

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

    # -- what it holds ---------------------------------------------------------------------
    @property
    def bad_chunks(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(array, chunk_index, tile)`` of every stored object read as bad since the last
        reset (this epoch), in the order they were found; empty under ``on_bad_chunk="raise"``."""
        with self._bad_lock:
            return list(self._bad)

    @property
    def pinned(self) -> int:
        """Chunks this node currently holds pinned."""
        return 0 if self._admission is None else self._admission.pinned

    @property
    def gets(self) -> GetQueue | None:
        """This node's GETs on the IO loop (``None`` for a store on local disk)."""
        return self._runner.gets

    @property
    def scratch_bytes(self) -> int:
        """Decode scratch memory this node's decoders hold (over all decode threads), the
        buffers objects of which slots keep a selection are decoded into aside, and the
        buffers of the stored layout that chunks a transform reshapes are decoded into (idle,
        and taken by the chunks being decoded: before 2026-12-07 only the idle ones)."""
        aside = sum(
            a.decoder.aside_bytes
            for a in self._setup.arrays.values()
            if isinstance(a.decoder, KeepingDecoder)
        )
        return (
            sum(d.scratch_bytes for d in self._decoders.values())
            + aside
            + self._runner.spares.nbytes
            + self._runner.spares.live_bytes
        )

    @property
    def inflight(self) -> int:
        """Stored-object GETs (and their decodes) in flight right now (for a local store:
        objects being read or decoded)."""
        if self.gets is not None:
            return self.gets.inflight
        jobs = () if self._admission is None else list(self._admission.jobs)
        return sum(job.runs for job in jobs)
