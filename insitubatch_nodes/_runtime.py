"""Process-wide execution resources shared by every pipeline: one event loop, decode pools.

The event loop is zarr's own store-IO loop (one thread), so a store's async session lives on
the loop every zarr call in the process already uses, and no second loop is ever created.
Decode runs on process-wide thread pools, one per requested size. Pipelines borrow both and
never stop, close or shut them down; they cancel only the tasks they started.

A decode pool serves its queue by *priority*, not arrival: every chunk gets a ticket when it is
admitted (in the order batches first need chunks), and a stored object whose bytes arrive is
decoded before any object of a later ticket. Without that, the objects of the first batch wait
behind the read-ahead of the rest of the block, whose GETs complete in whatever order the store
answers.

What the process itself has done that matters (obstore's runtime started, the allocator tuned)
and the fork guards are in :mod:`insitubatch_nodes._process`, below the stores.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import itertools
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from insitubatch_nodes import _process
from insitubatch_nodes.io import _zarr_compat

__all__ = [
    "PriorityPool",
    "decode_pool",
    "default_decode_threads",
    "gather_helper",
    "io_loop",
    "next_ticket",
    "stop_at_exit",
]

R = TypeVar("R")
_TICKETS = itertools.count()


def next_ticket() -> int:
    """A process-wide, increasing priority ticket (smaller = sooner)."""
    return next(_TICKETS)


class PriorityPool:
    """A fixed set of daemon threads serving submitted calls smallest ``priority`` first."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.PriorityQueue[
            tuple[int, int, Future[Any], Callable[..., Any], tuple[Any, ...]]
        ]
        self._queue = queue.PriorityQueue()
        self._seq = itertools.count()
        self.threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def submit(self, priority: int, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Run ``fn(*args)`` on a pool thread; cancelling the future before it starts skips it."""
        fut: Future[R] = Future()
        self._queue.put((priority, next(self._seq), fut, fn, args))
        return fut

    def preempted(self, priority: int) -> bool:
        """Whether a call of a smaller (sooner) ``priority`` waits in the queue: a long run of
        work checks this between items and gives its thread up (a hint: not locked)."""
        try:
            head = self._queue.queue[0]
        except IndexError:
            return False
        return head[0] < priority

    def _work(self) -> None:
        while True:
            _, _, fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)
            # drop the finished job before waiting for the next: its arguments (a slot, maybe
            # a mapping of a cache file) must not stay alive for as long as the thread idles
            del fut, fn, args


_POOLS: dict[int | str, PriorityPool] = {}
_POOLS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # Decode threads do not exist in the child: pools are rebuilt on first use. (zarr resets
    # its own IO loop after fork; pipelines built before the fork refuse to run, see fetch.)
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the one exit hook ----------------------------------------------------------------------------
# At interpreter exit every live pipeline is stopped in a fixed order, whatever the order its
# modules were imported in: first the prefetch threads (so nothing admits new fetches), then the
# fetch stages (their in-flight GETs cancelled and awaited while the IO loop still runs: a
# request left in flight inside the object store's own runtime could otherwise complete into a
# half-finalised interpreter). Each kind registers how to stop a list of its nodes. Last, the
# wakeups of the IO loop by obstore's threads still in progress are waited for
# (``_process.drain_wakeups``).
EXIT_ORDER = ("prefetch", "fetch")
_EXIT_NODES: dict[str, weakref.WeakSet[Any]] = {kind: weakref.WeakSet() for kind in EXIT_ORDER}
_EXIT_STOPS: dict[str, Callable[[Sequence[Any]], None]] = {}


def stop_at_exit(kind: str, node: Any, stop_all: Callable[[Sequence[Any]], None]) -> None:
    """Stop ``node`` at interpreter exit with ``stop_all`` (called once per ``kind`` with every
    live node of that kind built in this process), in :data:`EXIT_ORDER`."""
    if kind not in _EXIT_NODES:
        raise ValueError(f"kind must be one of {EXIT_ORDER}, got {kind!r}")
    _EXIT_STOPS.setdefault(kind, stop_all)
    _EXIT_NODES[kind].add(node)


#: the memory (pool slots and batch buffers) the live pipelines of a process hold from which a
#: build collects garbage first: below it, a dropped pipeline waits for Python's own collection
COLLECT_DROPPED_ABOVE = 64 << 20


def collect_dropped() -> None:
    """Collect garbage before a graph is built when the pipelines of this process hold
    :data:`COLLECT_DROPPED_ABOVE` or more of pool slots and batch buffers: a pipeline dropped
    without ``close()`` lives in reference cycles, and until a full collection happens to run
    it keeps its thread, its pool and its batch buffers — each run of a notebook cell that
    rebinds ``pipe`` would add one. A full collection takes 0.1-0.3 s in a process that has
    imported torch and Lightning, so pipelines holding little (tests, small data) are left to
    Python's own collection rather than paying it at every build."""
    if _held_by_pipelines() >= COLLECT_DROPPED_ABOVE:
        gc.collect()


def _held_by_pipelines() -> int:
    """Bytes of pool slots and batch buffers the live pipelines of this process hold (a
    function of its own: no reference to a pipeline may stay on the frame that collects)."""
    pid = os.getpid()
    held = 0
    for node in list(_EXIT_NODES["prefetch"]):
        context = getattr(node, "context", None)
        if getattr(node, "_pid", None) == pid and context is not None:
            held += context.pool.allocated_bytes + context.buffers.held_bytes
    return held


@atexit.register
def _stop_all_at_exit() -> None:
    pid = os.getpid()
    for kind in EXIT_ORDER:
        nodes = [n for n in list(_EXIT_NODES[kind]) if getattr(n, "_pid", pid) == pid]
        stop = _EXIT_STOPS.get(kind)
        if nodes and stop is not None:
            with contextlib.suppress(Exception):  # best effort at exit
                stop(nodes)
    _process.drain_wakeups()  # no obstore thread left inside the IO loop's wakeup call


def io_loop() -> asyncio.AbstractEventLoop:
    """The process's single IO event loop (running on its own daemon thread)."""
    return _zarr_compat.io_loop()


def default_decode_threads() -> int:
    """Decode threads when the user does not say: one per usable CPU core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def decode_pool(threads: int | None = None) -> PriorityPool:
    """The shared decode pool with ``threads`` workers (created once, never shut down)."""
    n = default_decode_threads() if threads is None else int(threads)
    if n < 1:
        raise ValueError(f"decode_threads must be >= 1, got {n}")
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = PriorityPool(n, name=f"insitu-decode{n}")
            _POOLS[n] = pool
        return pool


def gather_helper() -> PriorityPool | None:
    """The shared thread that copies half of each large batch while the pipeline's own thread
    copies the other half (created once); ``None`` with a single usable core."""
    if default_decode_threads() < 2:
        return None
    with _POOLS_LOCK:
        pool = _POOLS.get("gather")
        if pool is None:
            pool = _POOLS["gather"] = PriorityPool(1, name="insitu-gather")
        return pool
