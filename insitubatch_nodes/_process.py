"""What this process has done that a pipeline must know: obstore's runtime started, the C
allocator tuned; the guards against using either in a forked child; the retry clock's
scale (a test-only hook, read from the environment); and the memory this process may use (the
machine's, or its cgroup's limit where a container or a batch job sets one).

Below everything that reads a store (``io/stores`` calls it when it opens one; the fetch stage
when it is built), and importing nothing of the package: the IO loop and the decode pools are
:mod:`insitubatch_nodes._runtime`'s.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "RETRY_TIME_SCALE_ENV",
    "check_obstore_usable",
    "check_same_process",
    "drain_wakeups",
    "guard_close",
    "note_obstore_use",
    "retry_time_scale",
    "tune_allocator",
    "usable_memory_bytes",
    "watch_wakeups",
]

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


# -- wakeups of the IO loop by obstore's threads ---------------------------------------------------
# obstore's runtime threads hand each finished request to the IO loop with a Python call,
# ``loop.call_soon_threadsafe``, which releases the GIL while it writes to the loop's wakeup
# socket. Before Python 3.14 a thread that takes the GIL back once the interpreter has begun to
# finalize is ended with ``pthread_exit``, and on a Rust stack that aborts the process: a
# program that exits a moment after its last read (a command-line tool, a short script) has been
# seen to die with status -6 after its work was done. The calls in progress are counted (a
# list's append and pop are atomic under the GIL) and the exit hook waits for them to end.
_WAKEUPS_IN_PROGRESS: list[None] = []
_DRAIN_SETTLE_S = 0.01


def watch_wakeups(loop: Any) -> None:
    """Count ``loop``'s ``call_soon_threadsafe`` calls in progress, for :func:`drain_wakeups`
    (once per loop: the method is wrapped on the loop object itself)."""
    if getattr(loop.call_soon_threadsafe, "_insitu_counted", False):
        return
    original: Callable[..., Any] = loop.call_soon_threadsafe
    inside = _WAKEUPS_IN_PROGRESS

    def call_soon_threadsafe(callback: Any, *args: Any, context: Any = None) -> Any:
        inside.append(None)
        try:
            return original(callback, *args, context=context)
        finally:
            inside.pop()

    call_soon_threadsafe._insitu_counted = True  # type: ignore[attr-defined]
    loop.call_soon_threadsafe = call_soon_threadsafe


def drain_wakeups(timeout_s: float = 2.0) -> bool:
    """Wait, the GIL released, until no thread is inside a watched loop's
    ``call_soon_threadsafe`` (at most ``timeout_s``; each such call is a socket write), then a
    moment more for the last one to give the GIL back. Called at interpreter exit, before
    finalization begins. Returns whether none was left."""
    if not _WAKEUPS_IN_PROGRESS:
        return True
    deadline = time.monotonic() + timeout_s
    while _WAKEUPS_IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(_DRAIN_SETTLE_S)
    return not _WAKEUPS_IN_PROGRESS


# -- closing the IO loop -------------------------------------------------------------------------
# zarr's exit hook (``zarr.core.sync.cleanup_resources``) asks its IO loop to stop, joins the
# loop's thread for 0.2 s and then closes the loop whether the thread has left ``run_forever``
# or not. A thread not yet scheduled (a loaded machine) or still inside a callback is still in
# it, and asyncio's ``close`` raises "RuntimeError: Cannot close a running event loop": a
# recipe printed that at its exit (under Lightning, on a loaded machine).
#: How long a close of the IO loop from another thread waits for the loop to stop.
CLOSE_WAIT_S = 10.0


def guard_close(loop: Any) -> None:
    """Make ``loop.close()`` idempotent and safe from any thread (once per loop: the method is
    wrapped on the loop object itself, as :func:`watch_wakeups` wraps its wakeup call).

    Called from another thread while the loop runs, the close asks the loop to stop and waits
    (at most :data:`CLOSE_WAIT_S`) for its thread to leave ``run_forever``, then closes it; a
    loop that does not stop in time is left open, with a warning (its daemon thread ends with
    the process), rather than closed under a running thread. Closes racing each other run one
    at a time; a closed loop's close returns at once. In a forked child, where the loop's
    thread does not exist, it does nothing. Called from the loop's own thread (a callback),
    it raises as asyncio's does: a loop cannot wait for itself to stop."""
    if getattr(loop.close, "_insitu_guarded", False):
        return
    original: Callable[[], None] = loop.close
    lock, pid = threading.Lock(), os.getpid()

    def close() -> None:
        if os.getpid() != pid:
            return
        try:
            own_thread = asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop runs in the calling thread
            own_thread = False
        if own_thread:
            original()
            return
        with lock:
            if loop.is_closed():
                return
            if loop.is_running():
                loop.call_soon_threadsafe(loop.stop)
                deadline = time.monotonic() + CLOSE_WAIT_S
                while loop.is_running() and time.monotonic() < deadline:
                    time.sleep(0.001)
                if loop.is_running():
                    logging.getLogger("insitubatch_nodes").warning(
                        "the IO event loop did not stop within %.0f s of a close; it is left "
                        "open (a callback on it may be blocked)",
                        CLOSE_WAIT_S,
                    )
                    return
            original()

    close._insitu_guarded = True  # type: ignore[attr-defined]
    loop.close = close


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


RETRY_TIME_SCALE_ENV = "INSITUBATCH_NODES_RETRY_TIME_SCALE"


def retry_time_scale() -> float:
    """How many real seconds one second of a retry policy lasts: 1.0 (see
    :class:`~insitubatch_nodes.io.stores.RetryPolicy`).

    **A test-only hook.** The environment variable ``INSITUBATCH_NODES_RETRY_TIME_SCALE``, a
    number in (0, 1], runs every wait a policy sets on a faster clock: the deadline
    (``timeout_s``, in the fetch stage, in coordinate reads and in obstore), the backoffs and
    obstore's connect and stall timeouts are all multiplied by it when a store is opened or a
    read starts, so a test of the default policy's 30 s deadline can wait 3 s and still check
    the same claim in the policy's units. The policy's numbers, its retry count limit and the
    messages (which name the policy's seconds) are unchanged. Unset, the scale is 1.0.
    """
    raw = os.environ.get(RETRY_TIME_SCALE_ENV)
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not (0.0 < scale <= 1.0):
        raise ValueError(f"{RETRY_TIME_SCALE_ENV} must be a number in (0, 1], got {raw!r}")
    return scale


# -- the memory this process may use --------------------------------------------------------------
#: Where the cgroup file systems are mounted, and the file naming this process's cgroups (read at
#: each call; module attributes so that a test can point them at a tree of its own).
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def usable_memory_bytes() -> int:
    """The memory this process may use, in bytes: the machine's physical memory, or less where
    a cgroup caps it — a container's or a batch job's memory limit (cgroup v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``, of the process's cgroup and each of its parents; the least
    counts). The automatic budget's shares of "RAM" are of this: on a 1 TiB node a job given
    64 GiB would otherwise keep a split of up to 64 GiB and be killed for it. A very large
    number where the OS says neither. A few small files read per call (once per epoch)."""
    try:
        physical = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        physical = 2**62
    return min([physical, *_cgroup_limits()])


def _cgroup_limits() -> Iterator[int]:
    """Each memory limit of this process's cgroups and their parents (v1 and v2), in bytes."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:  # not Linux, or no /proc
        return
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2: one unified tree
            base, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        # the cgroup and its parents; inside a container the tree is often mounted at the
        # container's own cgroup, whose limit is then the root's file
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                text = (base.joinpath(*parts[:depth]) / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < _NO_LIMIT:
                yield int(text)
