"""The fetch stage: stored-object GETs on one shared event loop, decoded into pool slots.

:class:`AsyncChunkFetchNode` pulls :class:`~insitubatch_nodes.plan.BatchPlan` s from its source
ahead of the consumer and, for every chunk a plan is the first to read, pins a slot in the
:class:`~insitubatch_nodes.pool.ChunkPool` (a chunk the pool already holds is a hit and is not
fetched again) and starts a task on the process's IO loop that GETs each of the chunk's stored
objects and decodes it, on the shared decode pool, straight into the slot.

Two bounds keep it honest:

* ``max_inflight`` — stored-object GETs (and the decodes they feed) in flight at once;
* the read-ahead — the fetcher admits chunks for batches the consumer has not reached only
  while those chunks take less than one block's worth of slot memory (computed from the plan,
  not configured), and only while the pool's budget has room.

It yields :class:`FetchedBatch` items in plan order as soon as their chunks are *admitted*; the
residency stage downstream waits for them to be *ready*. The node owns every pin it takes: the
residency stage calls :meth:`AsyncChunkFetchNode.release` once a batch has been gathered, and
``reset``/``close`` cancel this node's tasks (and only those) and drop its pins.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchdata.nodes import BaseNode
from zarr.abc.store import Store

from insitubatch_nodes import _runtime, _zarr_compat
from insitubatch_nodes.decode import ChunkDecoder
from insitubatch_nodes.geometry import ArrayGeometry
from insitubatch_nodes.plan import BatchPlan, ChunkKey, EpochPlan
from insitubatch_nodes.pool import ChunkEntry, ChunkPool, working_set_bytes
from insitubatch_nodes.stores import RetryPolicy, describe_store, retry_policy

__all__ = ["AsyncChunkFetchNode", "ChunkReadError", "FetchedBatch"]

log = logging.getLogger(__name__)

# Every fetch node alive in the process. At interpreter exit their in-flight GETs are cancelled
# (and awaited) while the IO loop still runs: a request left in flight inside the object store's
# own runtime could otherwise complete into a half-finalised interpreter.
_LIVE: weakref.WeakSet[AsyncChunkFetchNode] = weakref.WeakSet()


@atexit.register
def _cancel_all_at_exit() -> None:
    for node in list(_LIVE):
        try:
            node.close()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("insitubatch_nodes: teardown at exit failed", exc_info=True)


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
    """A batch plan whose chunks are admitted: ``entries`` covers every chunk it reads."""

    plan: BatchPlan
    entries: Mapping[ChunkKey, ChunkEntry]


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


@dataclass(eq=False)
class _Counters:
    inflight: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class AsyncChunkFetchNode(BaseNode[FetchedBatch]):
    """Fetch + decode stage (see the module docstring).

    ``geoms`` maps array path to its (unshifted) geometry; ``store`` is the zarr store the paths
    live in. When it is a ``zarr.storage.ObjectStore`` the GETs go straight to the obstore store
    underneath (``obstore.get_async``); any other zarr store is read with its own ``get``.
    Every GET fails with ``TimeoutError`` after ``retry.timeout_s`` (default: the policy the
    store was opened with, see :func:`~insitubatch_nodes.stores.retry_policy`).
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
    ) -> None:
        super().__init__()
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be a positive integer, got {max_inflight!r}")
        self.source = source
        self.store = store
        self.pool = pool
        self.geoms = {path: g.base for path, g in geoms.items()}
        self.max_inflight = max_inflight
        self._decoders = {path: ChunkDecoder(g) for path, g in self.geoms.items()}
        self._decode_pool = _runtime.decode_pool(decode_threads)
        self._loop = _runtime.io_loop()
        self.retry = retry_policy(store) if retry is None else retry
        self._get = _zarr_compat.make_async_getter(store, timeout_s=self.retry.timeout_s)
        self._store_name = describe_store(store)
        self._sem: asyncio.Semaphore | None = None
        self._counters = _Counters()
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
        _LIVE.add(self)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._teardown()
        self.source.reset(initial_state["source"] if initial_state is not None else None)
        self._exhausted = False
        self._last_state = self.source.state_dict()

    def get_state(self) -> dict[str, Any]:
        # The state as of the last batch handed downstream, not of plans pulled ahead.
        return {"source": self._last_state}

    def next(self) -> FetchedBatch:
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
        return FetchedBatch(plan=head.plan, entries=entries)

    # -- pins -------------------------------------------------------------------------------
    def release(self, keys: Iterable[ChunkKey]) -> None:
        """Unpin chunks the consumer has read for the last time this epoch."""
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
        self.pool.unpin(done)

    @property
    def pinned(self) -> int:
        """Chunks this node currently holds pinned."""
        return sum(self._pins.values())

    def close(self) -> None:
        """Cancel this node's in-flight tasks and drop its pins (the loop and pools stay up)."""
        self._teardown()

    # -- read-ahead and admission ----------------------------------------------------------
    def _top_up(self) -> None:
        for pending in self._queue:
            if not pending.done and not self._admit(pending):
                return
        while not self._exhausted and (not self._queue or self._ahead_bytes < self._read_ahead):
            try:
                plan = self.source.next()
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
        floor, read_ahead = working_set_bytes(plan, self.geoms)
        self.pool.ensure_floor(floor)  # an automatic budget grows; an explicit one may raise
        self._epoch_plan, self._read_ahead = plan, read_ahead

    def _admit(self, pending: _Pending) -> bool:
        """Pin the plan's first reads in order; False when the pool has no room yet."""
        fetches = pending.keys
        spawn: list[tuple[ChunkEntry, int]] = []
        ok = True
        while pending.admitted < len(fetches):
            key = fetches[pending.admitted]
            geom = self.geoms[key[0]]
            got = self.pool.acquire(key, (geom.samples_per_chunk, *geom.inner_shape), geom.dtype)
            if got is None:
                ok = False
                break
            entry, hit = got
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
        for entry, ticket in entries:
            task = self._loop.create_task(self._fill(entry, ticket))
            self._counters.tasks.add(task)
            task.add_done_callback(self._counters.tasks.discard)

    async def _fill(self, entry: ChunkEntry, ticket: int) -> None:
        path, chunk = entry.key
        try:
            geom, decoder = self.geoms[path], self._decoders[path]
            start, stop = geom.chunk_range(chunk)
            region = entry.slot[: stop - start]
            tiles = [self._fill_tile(geom, decoder, region, chunk, t, ticket) for t in geom.tiles()]
        except BaseException as exc:  # nothing was started: waiters must still hear of it
            self.pool.discard(entry, exc)
            raise
        results = await asyncio.gather(*tiles, return_exceptions=True)
        # gather() returns only once every tile task has finished, so no decode is still
        # writing into the slot when it is discarded or marked ready.
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.pool.discard(entry, errors[0])
            if any(isinstance(e, asyncio.CancelledError) for e in errors):
                raise asyncio.CancelledError
        else:
            self.pool.mark_ready(entry)

    async def _fill_tile(
        self,
        geom: ArrayGeometry,
        decoder: ChunkDecoder,
        region: Any,
        chunk: int,
        tile: tuple[int, ...],
        ticket: int,
    ) -> None:
        assert self._sem is not None
        key = geom.store_key(chunk, tile)
        stats = self.pool.stats
        async with self._sem:
            self._counters.inflight += 1
            stats.inflight += 1
            stats.inflight_peak = max(stats.inflight_peak, self._counters.inflight)
            try:
                try:
                    raw = await self._get(key)
                except Exception as exc:
                    raise ChunkReadError(
                        geom.path, chunk, tile, key, "read", self._store_name
                    ) from exc
                stats.gets += 1
                stats.bytes_fetched += 0 if raw is None else len(raw)
                out = region[(slice(None), *geom.tile_slices(tile))]
                job = self._decode_pool.submit(ticket, decoder.decode_into, raw, out, chunk, tile)
                try:
                    await asyncio.wrap_future(job)
                except asyncio.CancelledError:
                    job.cancel()
                    while not job.done():  # a running decode cannot be interrupted: let it land
                        await asyncio.sleep(0.001)
                    raise
                except Exception as exc:
                    raise ChunkReadError(
                        geom.path, chunk, tile, key, "decode", self._store_name
                    ) from exc
            finally:
                self._counters.inflight -= 1
                stats.inflight -= 1

    async def _cancel_all(self) -> None:
        tasks = list(self._counters.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _teardown(self) -> None:
        if self._counters.tasks or self._live:
            on_loop_thread = threading.current_thread() is getattr(self._loop, "_thread", None)
            if self._loop.is_running() and not on_loop_thread:
                done = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
                try:
                    done.result(timeout=60)
                except Exception:  # pragma: no cover - a wedged loop: keep slots pinned
                    log.warning("insitubatch_nodes: fetch tasks did not stop within 60 s")
                    self._queue.clear()
                    return
        stuck = {t.get_name() for t in self._counters.tasks if not t.done()}
        if stuck:  # pragma: no cover - only when the loop is not running
            log.warning("insitubatch_nodes: %d fetch tasks still running at teardown", len(stuck))
        self.pool.unpin([self._live[k] for k, n in self._pins.items() for _ in range(n)])
        self._live.clear()
        self._pins.clear()
        self._queue.clear()
        self._ahead_bytes = 0
        self._epoch_plan = None

    @property
    def inflight(self) -> int:
        """Stored-object GETs (and their decodes) in flight right now."""
        return self._counters.inflight
