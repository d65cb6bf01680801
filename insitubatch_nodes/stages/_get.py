"""The GETs of a fetch stage: on the IO loop, under one permit budget, handed to the decoders.

:class:`GetQueue` knows nothing of who decodes: every object whose GET ends (with its bytes, an
error or a cancellation) is handed to the ``land`` callback it was built with, and the decode
side hands each permit back with :meth:`GetQueue.release`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from insitubatch_nodes import _runtime
from insitubatch_nodes.cache.identity import meta_identity
from insitubatch_nodes.errors import FillCancelled
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import EpochRecorder
from insitubatch_nodes.stages._jobs import FillJob, Queued, Rows, Unit

__all__ = ["GetQueue", "Land", "cancel_all_at_exit", "cancel_gets"]

Land = Callable[[FillJob, Sequence[Queued]], None]
"""Where a GET's object goes when it ends: ``land(job, [Queued(unit, landed, raw, error,
permit=True)])`` (any thread; the decode side)."""

_now = time.perf_counter
log = logging.getLogger("insitubatch_nodes.stages.fetch")


class GetQueue:
    """GETs on the IO loop for one fetch stage, at most ``max_inflight`` objects in flight
    (module docstring), each handed to ``land`` when it ends. Everything but :meth:`release`,
    :meth:`enqueue` and :meth:`cancel_skipped` runs on the loop."""

    def __init__(
        self,
        get: Callable[..., Any],
        loop: asyncio.AbstractEventLoop,
        max_inflight: int,
        store_name: str,
        *,
        pool: ChunkPool,
        recorder: EpochRecorder,
        land: Land,
    ) -> None:
        self._get = get
        self.loop = loop
        self.max_inflight = max_inflight
        self.store_name = store_name
        self.pool = pool
        self.recorder = recorder
        self._land = land
        self._queue: deque[tuple[FillJob, Unit]] = deque()  # on the loop only
        self._lock = threading.Lock()
        self.inflight = 0  # permits taken: GETs started and not yet decoded
        self._starved = False
        self.tasks: dict[asyncio.Task[None], tuple[FillJob, Unit]] = {}  # loop only
        self.obstore = False

    def enqueue(self, job: FillJob, units: Sequence[Unit], rows: Sequence[Rows] = ()) -> None:
        """Queue ``job``'s objects for GETs (any thread: one loop wake-up per call)."""
        self.loop.call_soon_threadsafe(self._enqueue, job, units, rows)

    def _enqueue(self, job: FillJob, units: Sequence[Unit], rows: Sequence[Rows]) -> None:
        self._queue.extend((job, unit) for unit in units)
        for r in rows:
            self._queue.extend((job, unit) for unit in r.units())
        self._pump()

    def release(self) -> None:
        """A permit's object is handled (any thread): wake the loop if it waits for one."""
        self.pool.note_io(inflight=-1)
        with self._lock:
            self.inflight -= 1
            wake, self._starved = self._starved, False
        if wake and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._pump)

    def _pump(self) -> None:
        queue = self._queue
        while queue:
            job, unit = queue[0]
            if job.skips(unit):
                queue.popleft()
                self._land(job, [Queued(unit, _now(), error=FillCancelled("cancelled"))])
                continue
            with self._lock:
                if self.inflight >= self.max_inflight:
                    self._starved = True
                    return
                self.inflight += 1
            self.pool.note_io(inflight=1)
            queue.popleft()
            task = self.loop.create_task(self._fetch(job, unit))
            self.tasks[task] = (job, unit)
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        held = self.tasks.pop(task, None)
        if not task.cancelled():
            task.exception()  # retrieved: a failure was landed already
        elif held is not None:  # cancelled before its first step: _fetch never ran to land it
            job, unit = held  # (so its entry would stay pending and its permit taken for good)
            self._land(job, [Queued(unit, _now(), error=FillCancelled("cancelled"), permit=True)])

    async def _fetch(self, job: FillJob, unit: Unit) -> None:
        array, chunk, tile = unit.array, unit.chunk, unit.tile
        rec = self.recorder
        cache = self.pool.cache
        ids = None if cache is None else cache.identity
        meta: list[Any] | None = None if ids is None else []
        raw: Any = None
        error: BaseException | None = None
        try:
            key = array.key(chunk, tile)
        except Exception as exc:  # a bug, not a read error: it fails the batch as it is
            self._land(job, [Queued(unit, _now(), error=exc, permit=True)])
            return
        started = rec.on_get_start()  # (after the key: a GET that never started never ends)
        try:
            raw = await (self._get(key) if meta is None else self._get(key, meta))
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # ours: its object is not needed
                error = FillCancelled(f"the read of {key!r} was cancelled")
            else:  # raised by the store itself, unasked (a client torn down): a failed read
                error = array.read_error(chunk, tile, key, "read", self.store_name)
                error.__cause__ = exc
        except Exception as exc:
            error = array.read_error(chunk, tile, key, "read", self.store_name)
            error.__cause__ = exc
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: the consumer raises it
            error = exc  # (raised here it would end the IO loop every zarr read shares)
        nbytes = 0 if raw is None else len(raw)
        if error is None:
            self.pool.note_io(1, nbytes)
        what = None if rec.trace is None else (array.path, chunk, tile, key, job.batch)
        failed = None  # a read that failed (not one cancelled): counted, its error named
        if error is not None and not isinstance(error, FillCancelled):
            failed = type(error.__cause__ or error).__name__
        rec.on_get_end(
            started, nbytes, ok=error is None, what=what, submitted=job.submitted, failed=failed
        )
        if error is None and ids is not None and meta:  # what identifies the object
            ids.note(array.path, array.entry_index(chunk, tile), key, meta_identity(meta[0]))
        self._land(job, [Queued(unit, _now(), raw, error, permit=True)])

    def cancel_skipped(self) -> None:
        """Cancel the GETs in flight whose objects are no longer needed (any thread)."""

        def cancel() -> None:
            for task, (job, unit) in list(self.tasks.items()):
                if job.skips(unit):
                    task.cancel()

        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(cancel)

    async def cancel_all(self) -> None:
        """Cancel every GET in flight and wait for them (interpreter exit)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)


_EXIT_GRACE_S = 2.0


def cancel_all_at_exit(nodes: Sequence[Any]) -> None:
    """At exit (see :func:`insitubatch_nodes._runtime.stop_at_exit`): release every fetch stage
    (its pins, fills and cache lock), then cancel and await their in-flight GETs while the IO
    loop still runs."""
    for node in nodes:
        try:
            node.release()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("insitubatch_nodes: teardown at exit failed", exc_info=True)
    loop = _runtime.io_loop()
    getters = [n.gets for n in nodes if n.gets is not None]
    if getters and loop.is_running():
        done = asyncio.run_coroutine_threadsafe(cancel_gets(getters), loop)
        try:
            done.result(timeout=_EXIT_GRACE_S)
        except Exception:  # pragma: no cover - a wedged loop: exit anyway
            log.debug("insitubatch_nodes: in-flight GETs did not stop at exit", exc_info=True)


async def cancel_gets(getters: Iterable[GetQueue]) -> None:
    await asyncio.gather(*(g.cancel_all() for g in getters))
