"""The prefetch stage: a background thread keeps finished batches ahead of the consumer.

:class:`PrefetcherNode` runs its source (the gather stage and everything above it) on one
thread of its own and hands finished items over a queue of ``prefetch_depth``. Its state is the
source's state *as of the last item delivered to the consumer* — items still in the queue, and
plans the fetcher pulled ahead, are not counted — so a checkpoint resumes at exactly the next
undelivered batch.

Lifecycle: ``reset`` restarts the thread; ``close()`` (also on ``del`` and when a ``for`` loop
over the node is left early) stops it, cancels this pipeline's in-flight fetches and unpins its
chunks, keeping the delivered position, so a later ``next()`` resumes where the consumer was.
An exception raised in any stage re-raises in the consumer with its original traceback.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from torchdata.nodes import BaseNode

__all__ = ["PrefetcherNode"]

T = TypeVar("T")
_ids = itertools.count()
_POLL_S = 0.05
_LIVE: weakref.WeakSet[PrefetcherNode[Any]] = weakref.WeakSet()


@atexit.register
def _halt_all_at_exit() -> None:
    # Runs before the fetch stage's own exit hook (registered earlier, so called later): stop
    # every producer thread first, so nothing admits new fetches while those are cancelled.
    for node in list(_LIVE):
        worker, node._worker = node._worker, None
        if worker is not None:
            worker.halt(close_source=True, join=True, timeout=10.0)


class _Worker:
    """The thread and its queue; holds no reference to the node (so ``del node`` works)."""

    def __init__(self, source: BaseNode[Any], depth: int, name: str) -> None:
        self.queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.close_source = threading.Event()
        self.thread = threading.Thread(
            target=_run, args=(source, self.queue, self.stop, self.close_source), name=name
        )
        self.thread.daemon = True
        self.thread.start()

    def halt(self, close_source: bool, join: bool = True, timeout: float | None = None) -> None:
        if close_source:
            self.close_source.set()
        self.stop.set()
        while True:  # unblock a producer parked on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if join and self.thread is not threading.current_thread():
            self.thread.join(timeout)


def _put(
    q: queue.Queue[tuple[str, Any, Any]], stop: threading.Event, msg: tuple[str, Any, Any]
) -> bool:
    while not stop.is_set():
        try:
            q.put(msg, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _run(
    source: BaseNode[Any],
    q: queue.Queue[tuple[str, Any, Any]],
    stop: threading.Event,
    close_source: threading.Event,
) -> None:
    try:
        while not stop.is_set():
            try:
                item = next(source)
            except StopIteration:
                _put(q, stop, ("end", None, None))
                return
            if not _put(q, stop, ("item", item, source.state_dict())):
                return
    except BaseException as exc:  # handed to the consumer, traceback intact
        _put(q, stop, ("error", exc, None))
    finally:
        if close_source.is_set():
            closer = getattr(source, "close", None)
            if closer is not None:
                closer()


class PrefetcherNode(BaseNode[T], Generic[T]):
    """Keep up to ``prefetch_depth`` finished items ahead of the consumer (see module doc)."""

    def __init__(self, source: BaseNode[T], prefetch_depth: int = 2) -> None:
        super().__init__()
        if not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be a positive integer, got {prefetch_depth!r}")
        self.source = source
        self.prefetch_depth = prefetch_depth
        self.name = f"insitu-prefetch-{next(_ids)}"
        self._worker: _Worker | None = None
        self._delivered: dict[str, Any] | None = None
        self._ended = False
        _LIVE.add(self)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._halt(close_source=False)
        self.source.reset(initial_state["source"] if initial_state is not None else None)
        self._delivered = self.source.state_dict()
        self._ended = False
        self._start()

    def next(self) -> T:
        if self._ended:
            raise StopIteration
        if self._worker is None:  # closed earlier: resume at the delivered position
            self.source.reset(self._delivered)
            self._start()
        worker = self._worker
        assert worker is not None
        while True:
            try:
                kind, payload, state = worker.queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not worker.thread.is_alive() and worker.queue.empty():
                    self._worker = None
                    raise RuntimeError(f"{self.name}: the prefetch thread died") from None
        if kind == "item":
            self._delivered = state
            return payload
        self._worker = None
        worker.thread.join()
        if kind == "end":
            self._ended = True
            raise StopIteration
        self._close_source()
        raise payload

    def get_state(self) -> dict[str, Any]:
        return {"source": self._delivered}

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread, cancel in-flight fetches, unpin chunks; the position is kept."""
        self._halt(close_source=True)

    def __iter__(self) -> Iterator[T]:
        return self._iterate()

    def _iterate(self) -> Iterator[T]:
        finished = False
        try:
            while True:
                try:
                    item = next(self)
                except StopIteration:
                    finished = True
                    return
                yield item
        finally:
            if not finished:  # the loop was left early (break, exception, generator closed)
                self.close()

    def __enter__(self) -> PrefetcherNode[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.halt(close_source=True, join=False)

    def _start(self) -> None:
        self._worker = _Worker(self.source, self.prefetch_depth, self.name)

    def _halt(self, close_source: bool) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.halt(close_source=close_source)
        elif close_source:
            self._close_source()

    def _close_source(self) -> None:
        closer = getattr(self.source, "close", None)
        if closer is not None:
            closer()

    @property
    def threads(self) -> list[threading.Thread]:
        """Threads this pipeline started that are still alive."""
        return [t for t in threading.enumerate() if t.name == self.name]
