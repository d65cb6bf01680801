"""The prefetch stage: a background thread keeps finished batches ahead of the consumer.

:class:`PrefetcherNode` runs its source (the gather stage and everything above it) on one
thread of its own and hands finished items over a queue of ``prefetch_depth``. Its state is the
source's state *as of the last item delivered to the consumer* — items still in the queue, and
plans the fetcher pulled ahead, are not counted — so a checkpoint resumes at exactly the next
undelivered batch.

Lifecycle, following ``BaseNode``'s contract: ``iter(node)`` is the node itself, so
``next(iter(pipe))`` called again and again continues the same epoch. The thread starts at the
first ``next()`` after a ``reset`` (so ``reset`` twice with nothing consumed starts the same
epoch twice, never skipping one). It stops at the end of an epoch, on ``reset``, on ``close()``
(also ``with`` blocks, ``del`` and interpreter exit). ``close()`` cancels this pipeline's
in-flight fetches and unpins its chunks, keeping the delivered position, so a later ``next()``
resumes where the consumer was. Leaving a ``for`` loop early (``break``) releases nothing: the
thread parks once ``prefetch_depth`` batches wait, and the next ``next()`` continues; call
``close()`` (or use ``with``) to release memory at once.

Stopping never waits for a GET: the thread is woken from any wait on a chunk
(``interrupt()`` of the stages below) and joined for at most a few seconds. An exception raised
in any stage re-raises in the consumer with its original traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import threading
import weakref
from typing import Any, Generic, TypeVar

from torchdata.nodes import BaseNode

from insitubatch_nodes import _runtime
from insitubatch_nodes.errors import PipelineInterrupted
from insitubatch_nodes.recorder import EpochRecorder

__all__ = ["PrefetcherNode"]

T = TypeVar("T")
log = logging.getLogger(__name__)
_ids = itertools.count()
_POLL_S = 0.05
_JOIN_S = 2.0  # how long stopping waits for the thread (it is woken from every chunk wait)
_LIVE: weakref.WeakSet[PrefetcherNode[Any]] = weakref.WeakSet()


@atexit.register
def _halt_all_at_exit() -> None:
    # Runs before the fetch stage's own exit hook (registered earlier, so called later): stop
    # every producer thread first, so nothing admits new fetches while those are cancelled.
    for node in list(_LIVE):
        if node._pid == os.getpid():
            node._halt(close_source=True)


def interrupt_chain(node: Any) -> None:
    """Call ``interrupt()`` on ``node`` and every ``source`` below it that has one (thread-safe):
    a stage blocked waiting on a chunk wakes at once."""
    seen: set[int] = set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        interrupt = getattr(node, "interrupt", None)
        if callable(interrupt):
            interrupt()
        node = getattr(node, "source", None)


class _Worker:
    """The thread and its queue; holds no reference to the node (so ``del node`` works)."""

    def __init__(self, source: BaseNode[Any], depth: int, name: str) -> None:
        self.source = source
        self.queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.close_source = threading.Event()
        self.thread = threading.Thread(
            target=_run, args=(source, self.queue, self.stop, self.close_source), name=name
        )
        self.thread.daemon = True
        self.thread.start()

    def halt(self, close_source: bool, join: bool = True) -> None:
        """Stop the thread: wake it from any wait, and (``join``) wait up to ``_JOIN_S``.

        With ``close_source`` the source is closed — by the thread on its way out, or here once
        the thread is gone (closing is idempotent).
        """
        if close_source:
            self.close_source.set()
        self.stop.set()
        while True:  # unblock a producer parked on a full queue, then wake a waiting consumer
            with contextlib.suppress(queue.Empty):
                while True:
                    self.queue.get_nowait()
            try:
                self.queue.put_nowait(("halted", None, None))
                break
            except queue.Full:  # the producer slipped one more item in: drop it too
                continue
        interrupt_chain(self.source)
        if not join or self.thread is threading.current_thread():
            return
        self.thread.join(_JOIN_S)
        if self.thread.is_alive():
            log.warning(
                "insitubatch_nodes: %s did not stop within %.0f s (a batch transform still "
                "running?); it stops at its next step",
                self.thread.name,
                _JOIN_S,
            )
        elif close_source:
            _close(self.source)


def _close(node: Any) -> None:
    closer = getattr(node, "close", None)
    if closer is not None:
        closer()


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
            _close(source)


class PrefetcherNode(BaseNode[T], Generic[T]):
    """Keep up to ``prefetch_depth`` finished items ahead of the consumer (see module doc)."""

    def __init__(self, source: BaseNode[T], prefetch_depth: int = 2) -> None:
        super().__init__()
        if (
            isinstance(prefetch_depth, bool)
            or not isinstance(prefetch_depth, int)
            or prefetch_depth < 1
        ):
            raise ValueError(f"prefetch_depth must be a positive integer, got {prefetch_depth!r}")
        self.source = source
        self.prefetch_depth = prefetch_depth
        self.name = f"insitu-prefetch-{next(_ids)}"
        self._worker: _Worker | None = None
        self._delivered: dict[str, Any] | None = None
        self._source_at_delivered = False  # the source sits exactly at the delivered position
        self._ended = False
        self._pid = os.getpid()
        self.recorder: EpochRecorder | None = None  # set by the pipeline (see report.py)
        _LIVE.add(self)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _runtime.check_same_process(self._pid)
        self._halt(close_source=False)
        if self.recorder is not None:
            self.recorder.on_reset()
        self.source.reset(initial_state["source"] if initial_state is not None else None)
        self._delivered = self.source.state_dict()
        self._source_at_delivered = True
        self._ended = False

    def next(self) -> T:
        _runtime.check_same_process(self._pid)
        if self._ended:
            raise StopIteration
        rec = self.recorder
        called = rec.on_next() if rec is not None else 0.0
        if self._worker is None:  # first next() since reset, or closed earlier: resume
            if not self._source_at_delivered:
                self.source.reset(self._delivered)
            self._source_at_delivered = False
            self._worker = _Worker(self.source, self.prefetch_depth, self.name)
        worker = self._worker
        # A blocking hand-off: the producer always ends with an "end" or "error" message, and
        # halting (close or reset, from any thread) puts a "halted" one.
        kind, payload, state = worker.queue.get()
        if kind == "halted":
            worker.queue.put_nowait((kind, payload, state))  # for any other waiting consumer
            raise PipelineInterrupted(
                f"{self.name} was closed or reset while next() waited for a batch"
            )
        if kind == "item":
            self._delivered = state
            if rec is not None:
                rec.on_deliver(called, payload)
            return payload
        self._worker = None
        worker.thread.join()
        if kind == "end":
            self._ended = True
            if rec is not None:
                rec.on_end(called)
            raise StopIteration
        _close(self.source)
        raise payload

    def get_state(self) -> dict[str, Any]:
        return {"source": self._delivered}

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread, cancel in-flight fetches, unpin chunks; the position is kept.

        Returns within a few seconds whatever the store does (in-flight GETs are cancelled,
        not awaited)."""
        self._halt(close_source=True)

    def __enter__(self) -> PrefetcherNode[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.halt(close_source=True, join=False)

    def _halt(self, close_source: bool) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.halt(close_source=close_source)
        elif close_source:
            _close(self.source)
        if close_source:
            self._source_at_delivered = False

    @property
    def threads(self) -> list[threading.Thread]:
        """Threads this pipeline started that are still alive."""
        return [t for t in threading.enumerate() if t.name == self.name]
