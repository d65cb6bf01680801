"""The fetch stage: stored-object GETs on one shared event loop, decoded into pool slots.

:class:`AsyncChunkFetchNode` pulls :class:`~insitubatch_nodes.plan.BatchPlan` s from its source
ahead of the consumer and, for every chunk a plan is the first to read, pins a slot in the
:class:`~insitubatch_nodes.pool.ChunkPool` (a chunk the pool already holds is a hit and is not
fetched again) and starts a task on the process's IO loop that GETs each of the chunk's stored
objects and decodes it, on the shared decode pool, straight into the slot (a store on local
disk is read on the decode pool itself, right before the decode: see
:mod:`~insitubatch_nodes.localfiles`).

Two bounds keep it honest:

* ``max_inflight`` — stored-object GETs (and the decodes they feed) in flight at once;
* the read-ahead — the fetcher admits chunks for batches the consumer has not reached only
  while those chunks take less than one block's worth of slot memory (computed from the plan,
  not configured), and only while the pool's budget has room.

It yields :class:`FetchedBatch` items in plan order as soon as their chunks are *admitted*; the
residency stage downstream waits for them to be *ready*. The node owns every pin it takes: each
item carries a ``release`` handle that drops the pins of the chunks its batch reads for the last
time (the residency stage calls it once the batch has been gathered), and ``reset``/``close``
drop every pin at once and cancel the fills nobody else pins — without waiting for them: a slot
is reused only once its fill has finished (see :mod:`~insitubatch_nodes.residency`), so neither
call ever waits for a GET. A pool shared by several fetch nodes keeps working when one of them
closes.

The IO loop and the obstore runtime do not survive ``fork``: a node used in the child of a
process that forked after building it raises a ``RuntimeError`` saying so, and an obstore-backed
store that the parent already read from is refused in the child (its GETs would never finish).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from torchdata.nodes import BaseNode
from zarr.abc.store import Store
from zarr.storage import ObjectStore

from insitubatch_nodes import _runtime, _zarr_compat
from insitubatch_nodes.decode import ChunkDecoder
from insitubatch_nodes.geometry import ArrayGeometry
from insitubatch_nodes.localfiles import local_reader
from insitubatch_nodes.plan import BatchPlan, ChunkKey, EpochPlan
from insitubatch_nodes.report import EpochRecorder
from insitubatch_nodes.residency import ChunkEntry, ChunkPool, FillCancelled, working_set_bytes
from insitubatch_nodes.store_identity import IdentityRecorder, meta_identity, stat_identity
from insitubatch_nodes.stores import RetryPolicy, describe_store, retry_policy
from insitubatch_nodes.transforms import ChunkTransform, ChunkTransforms

__all__ = ["BAD_CHUNK_POLICIES", "AsyncChunkFetchNode", "ChunkReadError", "FetchedBatch"]

#: What ``on_bad_chunk`` accepts: fail the epoch, or fill the bad stored chunk and go on.
BAD_CHUNK_POLICIES = ("raise", "nan")


def check_on_bad_chunk(value: Any) -> str:
    """``value`` if it is one of :data:`BAD_CHUNK_POLICIES`, else ``ValueError``/``TypeError``."""
    if not isinstance(value, str):
        raise TypeError(f"on_bad_chunk must be 'raise' or 'nan', got {value!r}")
    if value not in BAD_CHUNK_POLICIES:
        raise ValueError(
            "on_bad_chunk must be 'raise' (a stored chunk that cannot be read or decoded fails "
            "the epoch) or 'nan' (it is filled with NaN, or the fill value for non-float "
            f"arrays, and listed in bad_chunks), got {value!r}"
        )
    return value


log = logging.getLogger(__name__)

# Every fetch node alive in the process. At interpreter exit their in-flight GETs are cancelled
# (and awaited) while the IO loop still runs: a request left in flight inside the object store's
# own runtime could otherwise complete into a half-finalised interpreter.
_LIVE: weakref.WeakSet[AsyncChunkFetchNode] = weakref.WeakSet()


_EXIT_GRACE_S = 2.0


@atexit.register
def _cancel_all_at_exit() -> None:
    nodes = [n for n in list(_LIVE) if n._pid == os.getpid()]
    for node in nodes:
        try:
            node.close()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("insitubatch_nodes: teardown at exit failed", exc_info=True)
    loop = _runtime.io_loop()
    if nodes and loop.is_running():
        done = asyncio.run_coroutine_threadsafe(_cancel_tasks(nodes), loop)
        try:
            done.result(timeout=_EXIT_GRACE_S)
        except Exception:  # pragma: no cover - a wedged loop: exit anyway
            log.debug("insitubatch_nodes: in-flight GETs did not stop at exit", exc_info=True)


async def _cancel_tasks(nodes: Iterable[AsyncChunkFetchNode]) -> None:
    tasks = [t for node in nodes for t in node._tasks]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=_EXIT_GRACE_S)


R = TypeVar("R")


async def _landed(job: Future[R]) -> R:
    """The result of a decode-pool job. Cancelled while it runs, the job is not interrupted
    (decode and transforms write into a slot): this waits for it to finish, then re-raises the
    cancellation, so nothing writes into the slot once the caller has gone."""
    try:
        return await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        job.cancel()
        while not job.done():
            await asyncio.sleep(0.001)
        raise


class ChunkReadError(RuntimeError):
    """A stored object could not be read or decoded. The cause is chained (``__cause__``).

    The message names the array, the chunk (and tile), the store key and the store.
    """

    def __init__(
        self,
        array: str,
        chunk_index: int,
        tile: tuple[int, ...],
        key: str,
        what: str,
        store: str = "",
    ):
        self.array, self.chunk_index, self.tile, self.key = array, chunk_index, tile, key
        self.store = store
        where = f"chunk {chunk_index}" + (f" tile {tile}" if any(tile) else "")
        source = f" in store {store}" if store else ""
        super().__init__(f"failed to {what} array {array!r} {where} (store key {key!r}{source})")


@dataclass(frozen=True, eq=False)
class FetchedBatch:
    """A batch plan whose chunks are admitted: ``entries`` covers every chunk it reads.

    ``release()`` drops the pins of the chunks this batch reads for the last time; call it once
    the batch has been gathered. It is a no-op after the fetch node was reset or closed.
    """

    plan: BatchPlan
    entries: Mapping[ChunkKey, ChunkEntry]
    release: Callable[[], None]


@dataclass(eq=False)
class _Pending:
    plan: BatchPlan
    state: dict[str, Any]  # the source's state right after this plan was pulled
    keys: tuple[ChunkKey, ...]  # chunks to admit before this batch: its first reads (+ carry)
    admitted: int = 0  # how many of keys are admitted
    ahead_bytes: int = 0

    @property
    def done(self) -> bool:
        return self.admitted == len(self.keys)


class AsyncChunkFetchNode(BaseNode[FetchedBatch]):
    """Fetch + decode stage (see the module docstring).

    ``geoms`` maps array path to its (unshifted) geometry; ``store`` is the zarr store the paths
    live in. When it is a ``zarr.storage.ObjectStore`` the GETs go straight to the obstore store
    underneath (``obstore.get_async``); any other zarr store is read with its own ``get``. A
    store that is exactly a local folder is not read with GETs: each object is read and decoded
    by one decode-pool job (:mod:`~insitubatch_nodes.localfiles`; no deadline applies there).
    Every GET fails with ``TimeoutError`` after ``retry.timeout_s`` (default: the policy the
    store was opened with, see :func:`~insitubatch_nodes.stores.retry_policy`).

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
    """

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
    ) -> None:
        super().__init__()
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be a positive integer, got {max_inflight!r}")
        self.source = source
        self.store = store
        self.pool = pool
        self.geoms = {path: g.base for path, g in geoms.items()}
        self.on_bad_chunk = check_on_bad_chunk(on_bad_chunk)
        self.transforms = (
            chunk_transforms
            if isinstance(chunk_transforms, ChunkTransforms)
            else ChunkTransforms(chunk_transforms, self.geoms)
        )
        #: path -> the geometry of what a slot holds (after the chunk transforms)
        self.slot_geoms = self.transforms.outputs
        # Arrays stored one level per object get level-major slots, which their objects decode
        # into in place (see residency). Not under chunk transforms: those see the slot, and a
        # transform written for C-ordered data (``data.reshape(n, -1)[...] = ...``) would
        # silently write into a copy of a level-major one.
        self._level_major = {
            path: g.one_level_per_object and not self.transforms.active(path)
            for path, g in self.geoms.items()
        }
        # bad stored objects of this epoch (written on the IO loop, read from any thread)
        self._bad: dict[tuple[str, int, tuple[int, ...]], None] = {}
        self._bad_lock = threading.Lock()
        self._spares: dict[tuple[str, int], list[np.ndarray]] = {}
        self._spare_bytes = 0
        self.max_inflight = max_inflight
        self._decoders = {path: ChunkDecoder(g) for path, g in self.geoms.items()}
        self._decode_pool = _runtime.decode_pool(decode_threads)
        self._max_spares = max(2, len(self._decode_pool.threads))
        self._loop = _runtime.io_loop()
        _runtime.tune_allocator()  # reuse GET and scratch buffers' memory (see its docstring)
        self._uses_obstore = isinstance(store, ObjectStore)
        if self._uses_obstore:
            _runtime.check_obstore_usable()
        self.retry = retry_policy(store) if retry is None else retry
        self._get = _zarr_compat.make_async_getter(store, timeout_s=self.retry.timeout_s)
        # A folder on this machine is read on the decode threads (see localfiles), not as GETs.
        self._local = local_reader(store)
        self._store_name = describe_store(store)
        self._sem: asyncio.Semaphore | None = None
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()  # touched on the IO loop only
        self._pid = os.getpid()
        self._generation = 0  # bumped by every teardown: older release handles do nothing
        self._queue: deque[_Pending] = deque()
        # Chunks this node holds pins on, and how many: a chunk released after one use segment
        # can already be re-admitted (read-ahead) for its next one before that release happens.
        self._live: dict[ChunkKey, ChunkEntry] = {}
        self._pins: dict[ChunkKey, int] = {}
        self._ahead_bytes = 0
        self._read_ahead = 0
        self._epoch_plan: EpochPlan | None = None
        self._exhausted = False
        self._last_state: dict[str, Any] | None = None
        self.recorder: EpochRecorder | None = None  # set by the pipeline (see report.py)
        _LIVE.add(self)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _runtime.check_same_process(self._pid)
        self._teardown()
        with self._bad_lock:
            self._bad.clear()
        self.source.reset(initial_state["source"] if initial_state is not None else None)
        self._exhausted = False
        self._last_state = self.source.state_dict()

    def get_state(self) -> dict[str, Any]:
        # The state as of the last batch handed downstream, not of plans pulled ahead.
        return {"source": self._last_state}

    def next(self) -> FetchedBatch:
        _runtime.check_same_process(self._pid)
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
        entries = {key: self._live[key] for key in head.plan.reads}
        self._top_up()
        release = functools.partial(self._release, self._generation, head.plan.releases)
        return FetchedBatch(plan=head.plan, entries=entries, release=release)

    # -- pins -------------------------------------------------------------------------------
    def slot_spec(self, path: str) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
        """``(shape, dtype, level_major)`` of the slots this node fills for array ``path`` (as
        :meth:`ChunkPool.acquire` and :meth:`ChunkPool.reserve` take them)."""
        geom = self.slot_geoms[path]
        shape = (geom.samples_per_chunk, *geom.inner_shape)
        return shape, geom.dtype, self._level_major[path]

    def _release(self, generation: int, keys: Iterable[ChunkKey]) -> None:
        """Unpin chunks the consumer has read for the last time this epoch."""
        if generation != self._generation:  # the pins went with a reset or close
            return
        done: list[ChunkEntry] = []
        for key in keys:
            count = self._pins.get(key, 0)
            if count == 0:
                continue
            done.append(self._live[key])
            if count == 1:
                del self._pins[key], self._live[key]
            else:
                self._pins[key] = count - 1
        self._cancel_fills(self.pool.unpin(done))

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
        """Drop this node's pins and cancel the fills nobody else pins; returns at once."""
        self._teardown()

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
            keys = plan.fetches
            if plan.epoch_plan is not self._epoch_plan:
                self._start_epoch(plan.epoch_plan)
                # Resumed mid-epoch: chunks that earlier (undelivered-here) batches first read
                # and later batches read again have to be fetched now.
                keys = plan.epoch_plan.carried_into(plan.index) + keys
            pending = _Pending(plan=plan, state=self.source.state_dict(), keys=keys)
            self._queue.append(pending)
            if not self._admit(pending):
                return

    def _start_epoch(self, plan: EpochPlan) -> None:
        floor, read_ahead = working_set_bytes(plan, self.slot_geoms)
        self.pool.ensure_floor(floor)  # an automatic budget grows; an explicit one may raise
        self._epoch_plan, self._read_ahead = plan, read_ahead

    def _admit(self, pending: _Pending) -> bool:
        """Pin the plan's first reads in order; False when the pool has no room yet."""
        fetches = pending.keys
        spawn: list[tuple[ChunkEntry, int]] = []
        ok = True
        while pending.admitted < len(fetches):
            key = fetches[pending.admitted]
            start, stop = self.slot_geoms[key[0]].chunk_range(key[1])
            shape, dtype, level_major = self.slot_spec(key[0])
            got = self.pool.acquire(key, shape, dtype, stop - start, level_major)
            if got is None:
                ok = False
                break
            entry, hit = got
            if entry.bad_tiles:  # read as bad by an earlier fill: still bad here
                self._note_bad(self._generation, key[0], key[1], entry.bad_tiles)
            if self.recorder is not None:
                self.recorder.on_admit(key, hit or entry.cached is not None)
            self._live[key] = entry
            self._pins[key] = self._pins.get(key, 0) + 1
            if not hit:  # tickets follow first need: the decode pool serves them in that order
                spawn.append((entry, _runtime.next_ticket()))
            pending.admitted += 1
            pending.ahead_bytes += entry.nbytes
            self._ahead_bytes += entry.nbytes
        if spawn:
            self._loop.call_soon_threadsafe(self._spawn, spawn)
        return ok

    # -- on the loop ------------------------------------------------------------------------
    def _spawn(self, entries: list[tuple[ChunkEntry, int]]) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_inflight)
        if self._uses_obstore:
            _runtime.note_obstore_use()
        for entry, ticket in entries:
            if entry.detached and entry.pins == 0:  # abandoned before its fill could start
                self.pool.discard(entry, FillCancelled(f"chunk {entry.key} was cancelled"))
                continue
            task = self._loop.create_task(self._fill(entry, ticket))
            entry.filler = task
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._fill_done, entry))

    def _fill_done(self, entry: ChunkEntry, task: asyncio.Task[None]) -> None:
        # Runs however the task ended — even cancelled before its first step, when no code of
        # _fill ran: the entry must still resolve, or its waiters would wait forever.
        self._tasks.discard(task)
        entry.filler = None
        error = None if task.cancelled() else task.exception()  # retrieved: nothing is logged
        if not entry.ready.done():
            self.pool.discard(entry, error or FillCancelled(f"chunk {entry.key} was cancelled"))

    async def _fill(self, entry: ChunkEntry, ticket: int) -> None:
        if entry.cached is not None:  # a hit in the persistent cache: map its file, no GET
            job = self._decode_pool.submit(ticket, self.pool.map_cached, entry)
            if await _landed(job):
                self.pool.mark_ready(entry)
                return
            if entry.corrupt and self.recorder is not None:  # fetched below, as a miss
                self.recorder.on_corrupt()
        path, chunk = entry.key
        geom, decoder = self.geoms[path], self._decoders[path]
        start, stop = geom.chunk_range(chunk)
        region = entry.slot[: stop - start]
        # Decode straight into the slot, unless the transforms change the shape or dtype: then
        # into a chunk-sized buffer of the stored layout that the transforms turn into the slot.
        reshapes = self.transforms.reshapes(path)
        decoded = self._take_spare(geom, stop - start) if reshapes else region
        tasks = [
            asyncio.ensure_future(
                self._fill_tile(geom, decoder, decoded, entry, t, ticket, self._generation)
            )
            for t in geom.tiles()
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            # The first failed tile fails the chunk: the others (maybe still queued behind
            # max_inflight, each with its own deadline) are cancelled. gather() completes only
            # once every tile task has, so no decode still writes into the slot afterwards.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        errors = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
        if errors:
            self.pool.discard(entry, errors[0])
            if reshapes:  # every tile task has finished: nothing writes into it any more
                self._give_spare(path, decoded)
            return
        if any(t.cancelled() for t in tasks):
            raise asyncio.CancelledError  # the done-callback resolves the entry
        if self.transforms.active(path):
            try:
                await self._transform(path, chunk, (start, stop), decoded, region, ticket)
            except Exception as exc:
                self.pool.discard(entry, exc)
                if reshapes:
                    self._give_spare(path, decoded)
                return
        if reshapes:
            self._give_spare(path, decoded)
        if entry.file is not None:  # a new cache file: checksum it on a decode thread first
            await _landed(self._decode_pool.submit(ticket, self.pool.seal, entry))
        self.pool.mark_ready(entry)

    # Buffers a chunk is decoded into when its transforms reshape it, recycled (touched on the
    # IO loop only): a fresh allocation of a few MB costs its page faults on every chunk.
    # A buffer whose fill was cancelled is not recycled (a decode may still be landing in it).
    def _take_spare(self, geom: ArrayGeometry, n: int) -> np.ndarray:
        free = self._spares.get((geom.path, n))
        if free:
            buf = free.pop()
            self._spare_bytes -= buf.nbytes
            return buf
        return np.empty((n, *geom.inner_shape), dtype=geom.dtype)

    def _give_spare(self, path: str, buf: np.ndarray) -> None:
        free = self._spares.setdefault((path, buf.shape[0]), [])
        if len(free) < self._max_spares:
            free.append(buf)
            self._spare_bytes += buf.nbytes

    async def _transform(
        self,
        path: str,
        chunk: int,
        sample_range: tuple[int, int],
        decoded: np.ndarray,
        region: np.ndarray,
        ticket: int,
    ) -> None:
        """Run the chunk transforms of ``path`` on a decode thread; the result lands in
        ``region`` (the slot). Raises what the transforms raise."""
        rec = self.recorder
        submitted = rec.on_transform_submit() if rec is not None else 0.0
        job = self._decode_pool.submit(
            ticket, self._run_transforms, path, chunk, sample_range, decoded, region
        )
        busy: float | None = None
        try:
            busy = await _landed(job)
        finally:
            if rec is not None:
                rec.on_transform_end(submitted, busy)

    def _run_transforms(
        self,
        path: str,
        chunk: int,
        sample_range: tuple[int, int],
        decoded: np.ndarray,
        region: np.ndarray,
    ) -> float:
        t0 = time.perf_counter()
        out = self.transforms.apply(path, chunk, sample_range, decoded)
        if out is not region:
            np.copyto(region, out)
        return time.perf_counter() - t0

    def _cancel_fills(self, entries: list[ChunkEntry]) -> None:
        """Cancel the fills of detached entries (no pin left on them), from any thread."""
        if not entries:
            return

        def cancel() -> None:
            for entry in entries:
                if entry.filler is not None:
                    entry.filler.cancel()

        if self._pid == os.getpid() and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(cancel)

    async def _fill_tile(
        self,
        geom: ArrayGeometry,
        decoder: ChunkDecoder,
        region: Any,
        entry: ChunkEntry,
        tile: tuple[int, ...],
        ticket: int,
        generation: int,
    ) -> None:
        chunk = entry.key[1]
        out = region[(slice(None), *geom.tile_slices(tile))]
        try:
            await self._read_tile(geom, decoder, out, chunk, tile, ticket)
        except ChunkReadError as exc:
            if self.on_bad_chunk == "raise":
                raise
            # Retries are the store's (obstore's, under the RetryPolicy): what still fails is bad.
            log.warning(
                "insitubatch_nodes: on_bad_chunk='nan': %s (%s); its rectangle is filled",
                exc,
                exc.__cause__,
            )
            out[...] = np.nan if geom.dtype.kind in "fc" else decoder.fill_value
            entry.bad_tiles.append(tuple(tile))
            noted = self._note_bad(generation, geom.path, chunk, [tuple(tile)])
            if noted and self.recorder is not None:
                self.recorder.on_bad_chunk()

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

    async def _read_tile(
        self,
        geom: ArrayGeometry,
        decoder: ChunkDecoder,
        out: Any,
        chunk: int,
        tile: tuple[int, ...],
        ticket: int,
    ) -> None:
        assert self._sem is not None
        key = geom.store_key(chunk, tile)
        stats = self.pool.stats
        async with self._sem:
            self._inflight += 1
            stats.inflight += 1
            stats.inflight_peak = max(stats.inflight_peak, self._inflight)
            try:
                if self._local is not None:
                    nbytes = await self._read_local_tile(
                        geom, decoder, key, out, chunk, tile, ticket
                    )
                    stats.gets += 1
                    stats.bytes_fetched += nbytes
                    return
                rec = self.recorder
                started = rec.on_get_start() if rec is not None else 0.0
                ids = self._identities()
                meta: list[Any] | None = None if ids is None else []
                try:
                    raw = await (self._get(key) if meta is None else self._get(key, meta))
                except BaseException as exc:
                    if rec is not None:
                        rec.on_get_end(started, 0, ok=False)
                    if not isinstance(exc, Exception):
                        raise
                    raise ChunkReadError(
                        geom.path, chunk, tile, key, "read", self._store_name
                    ) from exc
                if ids is not None and meta:  # what identifies the object (store_identity)
                    ids.note(geom.path, chunk, key, meta_identity(meta[0]))
                nbytes = 0 if raw is None else len(raw)
                stats.gets += 1
                stats.bytes_fetched += nbytes
                job: Future[Any]
                if rec is None:
                    job = self._decode_pool.submit(
                        ticket, decoder.decode_into, raw, out, chunk, tile
                    )
                else:
                    rec.on_get_end(started, nbytes)
                    submitted = rec.on_decode_submit()
                    job = self._decode_pool.submit(
                        ticket, rec.timed, decoder.decode_into, raw, out, chunk, tile
                    )
                try:
                    busy = await _landed(job)
                except asyncio.CancelledError:
                    if rec is not None:
                        rec.on_decode_end(submitted, None)
                    raise
                except Exception as exc:
                    if rec is not None:
                        rec.on_decode_end(submitted, None)
                    raise ChunkReadError(
                        geom.path, chunk, tile, key, "decode", self._store_name
                    ) from exc
                if rec is not None:
                    rec.on_decode_end(submitted, busy)
            finally:
                self._inflight -= 1
                stats.inflight -= 1

    async def _read_local_tile(
        self,
        geom: ArrayGeometry,
        decoder: ChunkDecoder,
        key: str,
        out: Any,
        chunk: int,
        tile: tuple[int, ...],
        ticket: int,
    ) -> int:
        """Read + decode one stored object of a local store as one decode-thread job (the
        bytes stay in that thread's buffer); its size in bytes. Errors as :meth:`_read_tile`."""
        assert self._local is not None
        self._local.advise(key)  # the kernel reads ahead while the job waits for a thread
        rec = self.recorder
        submitted = rec.on_decode_submit() if rec is not None else 0.0
        job = self._decode_pool.submit(
            ticket, self._local_job, geom, decoder, key, out, chunk, tile, rec
        )
        try:
            nbytes, busy = await _landed(job)
        except BaseException:
            if rec is not None:
                rec.on_decode_end(submitted, None)
            raise
        if rec is not None:
            rec.on_decode_end(submitted, busy)
        return nbytes

    def _local_job(
        self,
        geom: ArrayGeometry,
        decoder: ChunkDecoder,
        key: str,
        out: Any,
        chunk: int,
        tile: tuple[int, ...],
        rec: EpochRecorder | None,
    ) -> tuple[int, float | None]:
        # On a decode thread. The read counts as a GET in the report, the decode as a decode
        # (timed as the GET path times it; None without a recorder).
        assert self._local is not None
        started = rec.on_get_start() if rec is not None else 0.0
        ids = self._identities()
        info: list[Any] | None = None if ids is None else []
        try:
            raw = self._local.read(key) if info is None else self._local.read(key, info)
        except OSError as exc:
            if rec is not None:
                rec.on_get_end(started, 0, ok=False)
            raise ChunkReadError(geom.path, chunk, tile, key, "read", self._store_name) from exc
        if ids is not None and info:  # what identifies the file (store_identity)
            ids.note(geom.path, chunk, key, stat_identity(info[0]))
        nbytes = 0 if raw is None else len(raw)
        if rec is not None:
            rec.on_get_end(started, nbytes)
        try:
            if rec is None:
                decoder.decode_into(raw, out, chunk, tile)
                return nbytes, None
            return nbytes, rec.timed(decoder.decode_into, raw, out, chunk, tile)
        except Exception as exc:
            raise ChunkReadError(geom.path, chunk, tile, key, "decode", self._store_name) from exc

    def _identities(self) -> IdentityRecorder | None:
        """Where the objects' identities go: a persistent cache writer's recorder, or ``None``."""
        cache = self.pool.cache
        return None if cache is None else cache.identity

    def _teardown(self) -> None:
        """Drop every pin this node holds and cancel the fills left unpinned (no waiting)."""
        self._generation += 1
        held = [self._live[k] for k, n in self._pins.items() for _ in range(n)]
        self._cancel_fills(self.pool.unpin(held))
        self._live.clear()
        self._pins.clear()
        self._queue.clear()
        self._ahead_bytes = 0
        self._epoch_plan = None

    @property
    def scratch_bytes(self) -> int:
        """Decode scratch memory this node's decoders hold (over all decode threads), plus the
        idle buffers kept for decoding chunks that a transform reshapes."""
        return sum(d.scratch_bytes for d in self._decoders.values()) + self._spare_bytes

    @property
    def inflight(self) -> int:
        """Stored-object GETs (and their decodes) in flight right now."""
        return self._inflight
