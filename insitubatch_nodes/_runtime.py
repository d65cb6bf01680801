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
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import itertools
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from insitubatch_nodes.io import _zarr_compat

__all__ = [
    "PriorityPool",
    "check_obstore_usable",
    "check_same_process",
    "decode_pool",
    "default_decode_threads",
    "io_loop",
    "next_ticket",
    "note_obstore_use",
    "stop_at_exit",
    "tune_allocator",
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

# The process that ran obstore GETs through a pipeline. obstore's IO runtime is a set of threads
# that fork() does not copy: in a child of that process every obstore request waits forever.
_OBSTORE_PID: int | None = None


def check_same_process(built_in: int) -> None:
    """Raise ``RuntimeError`` when a pipeline built in process ``built_in`` runs in a fork of it."""
    if built_in != os.getpid():
        raise RuntimeError(
            f"this pipeline was built in process {built_in} and used in process {os.getpid()} "
            "after a fork(): its IO loop, decode threads and prefetch thread do not survive "
            "fork. Build a new pipeline in the child (or start workers with the 'spawn' or "
            "'forkserver' method)."
        )


def note_obstore_use() -> None:
    """Record that this process has started obstore's IO runtime (through a pipeline)."""
    global _OBSTORE_PID
    _OBSTORE_PID = os.getpid()


def check_obstore_usable() -> None:
    """Raise ``RuntimeError`` if this process is a fork of one that already used obstore: its
    requests here would hang, not fail."""
    if _OBSTORE_PID not in (None, os.getpid()):
        raise RuntimeError(
            f"this process was forked from process {_OBSTORE_PID} after it read through "
            "obstore, whose IO threads do not survive fork(): obstore requests here would never "
            "finish. Start child processes with the 'spawn' or 'forkserver' method, or build "
            "pipelines only after forking."
        )


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
# half-finalised interpreter). Each kind registers how to stop a list of its nodes.
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


@atexit.register
def _stop_all_at_exit() -> None:
    pid = os.getpid()
    for kind in EXIT_ORDER:
        nodes = [n for n in list(_EXIT_NODES[kind]) if getattr(n, "_pid", pid) == pid]
        stop = _EXIT_STOPS.get(kind)
        if nodes and stop is not None:
            with contextlib.suppress(Exception):  # best effort at exit
                stop(nodes)


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


# -- the C allocator ----------------------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value (64-bit)
_TRIM_THRESHOLD = 2**30
_ALLOCATOR_ENV = "INSITUBATCH_NODES_MALLOC_TUNING"
_allocator_tuned: bool | None = None


def tune_allocator() -> bool:
    """Make glibc's ``malloc`` keep and reuse the memory of large buffers (once per process).

    Every GET's bytes (allocated by obstore through ``malloc``), and decode scratch, are
    buffers of up to tens of MB. glibc serves those with a fresh ``mmap`` each time and
    unmaps them on ``free``, so every epoch faults all of that memory in anew — measured on
    the project's VM at the reference shape: ~150,000 page faults per pass over 1.7 GB of
    chunks, and raw GETs 25–40 % slower than with reused memory. Raising the mmap threshold
    to 32 MiB (glibc's maximum) and the trim threshold to 1 GiB lets freed buffers go back
    to malloc's heaps and be reused: ~9,000 faults per pass. The cost is that the process
    keeps up to about the largest amount of such buffers it had live at once (``max_inflight``
    GETs' bytes plus decode scratch) instead of returning it to the OS between uses.

    It also caps glibc at **one arena** (``M_ARENA_MAX=1``). obstore reads on many threads
    of its own, and glibc gives each new thread an arena of its own (up to 8 per core), each
    keeping its own freed buffers: a GET buffer freed in one arena is no use to a thread
    allocating from another, so the process holds many sets of them and faults fresh memory
    in for each. With one arena every thread reuses the same heap — measured at the reference
    shape (default budget, two epochs): peak RSS 1,216–1,225 MB against 1,418–1,449 MB, the
    same throughput. The cap binds only threads that have no arena yet — obstore's threads
    keep the ones they took on their first reads — so it is set before the package's first
    read: when a store is opened or first handed to it (:func:`~insitubatch_nodes.open_store`,
    :func:`~insitubatch_nodes.io.stores.as_store`, which every entry point calls), and when a fetch
    stage is built. A store read through obstore before that (zarr calls of your own) keeps its
    threads' arenas; ``MALLOC_ARENA_MAX=1`` in the environment sets the cap from process start.

    A no-op off Linux/glibc. Set the environment variable
    ``INSITUBATCH_NODES_MALLOC_TUNING=0`` to leave the allocator alone. Returns whether the
    tuning is in effect.
    """
    global _allocator_tuned
    if _allocator_tuned is None:
        _allocator_tuned = False
        if os.environ.get(_ALLOCATOR_ENV, "1") != "0" and sys.platform.startswith("linux"):
            try:
                mallopt = ctypes.CDLL(None).mallopt  # glibc only (musl has no mallopt)
            except (OSError, AttributeError):
                return False
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _allocator_tuned = bool(
                mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                and mallopt(_M_ARENA_MAX, 1)
            )
    return _allocator_tuned
