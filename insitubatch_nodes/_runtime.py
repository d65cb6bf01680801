"""Process-wide execution resources shared by every pipeline: one event loop, decode pools.

The event loop is zarr's own store-IO loop (one thread), so a store's async session lives on
the loop every zarr call in the process already uses, and no second loop is ever created.
Decode runs on process-wide thread pools, one per requested size. Pipelines borrow both and
never stop, close or shut them down; they cancel only the tasks they started.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from insitubatch_nodes import _zarr_compat

__all__ = ["decode_pool", "default_decode_threads", "io_loop"]

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def io_loop() -> asyncio.AbstractEventLoop:
    """The process's single IO event loop (running on its own daemon thread)."""
    return _zarr_compat.io_loop()


def default_decode_threads() -> int:
    """Decode threads when the user does not say: one per usable CPU core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def decode_pool(threads: int | None = None) -> ThreadPoolExecutor:
    """The shared decode pool with ``threads`` workers (created once, never shut down here)."""
    n = default_decode_threads() if threads is None else int(threads)
    if n < 1:
        raise ValueError(f"decode_threads must be >= 1, got {n}")
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"insitu-decode{n}")
            _POOLS[n] = pool
        return pool
