"""Waits in the caller's thread that a signal can end: on a future another thread completes
(the IO loop's coroutines), on a queue another thread fills (the producer's batches).

Linux gives a process's signal (Ctrl-C's ``SIGINT``) to any thread that does not block it, and
Python runs the handler (``KeyboardInterrupt``) in the main thread only when that thread next
runs bytecode. A main thread blocked in one untimed wait sleeps through a signal another thread
took until the wait ends — never, when what it waits on is a stalled store. These waits wake
every :data:`POLL_S` to let the handler run; what they return or raise is the untimed wait's.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, wait
from typing import TypeVar

__all__ = ["POLL_S", "head", "result"]

T = TypeVar("T")

POLL_S = 0.05
"""How often a wait wakes to let a signal's handler run (a wake costs microseconds)."""


def result(future: Future[T]) -> T:
    """``future.result()``, cancelling ``future`` when the wait is interrupted (a coroutine
    from ``asyncio.run_coroutine_threadsafe`` is cancelled with it)."""
    try:
        while not wait([future], timeout=POLL_S).done:
            pass
    except BaseException:
        future.cancel()
        raise
    return future.result()


def head(q: queue.Queue[T]) -> T:
    """``q``'s first item, left in ``q``: ``q.get()`` without the removal. The caller holds
    ``q.mutex`` (``with q.mutex:``), which the wait gives up while it waits, and takes the
    item off the queue itself once it has handed it over (``PrefetcherNode.next``), so an
    interrupt before that leaves the item where it was."""
    while not q.queue:
        q.not_empty.wait(POLL_S)
    item: T = q.queue[0]
    return item
