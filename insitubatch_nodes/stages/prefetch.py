"""The prefetch stage: a background thread keeps finished batches ahead of the consumer.

:class:`PrefetcherNode` runs its source (the gather stage and everything above it) on one
thread of its own and hands finished items over a queue of ``prefetch_depth``. Its state is the
source's state *as of the last item delivered to the consumer* — items still in the queue, and
plans the fetcher pulled ahead, are not counted — so a checkpoint resumes at exactly the next
undelivered batch. A batch leaves the queue only as ``next()`` returns it: a Ctrl-C inside
``next()`` leaves it there, and the next call returns it.

Lifecycle, following ``BaseNode``'s contract: ``iter(node)`` is the node itself, so
``next(iter(pipe))`` called again and again continues the same epoch; only once an epoch has
ended does ``iter()`` start the next one (a ``reset``), so each ``for batch in pipe:`` is an
epoch, as over a ``Loader`` (before, every loop after the first got nothing). The thread starts
at the first ``next()`` after a ``reset`` (so ``reset`` twice with nothing consumed starts the
same epoch twice, never skipping one). It stops at the end of an epoch, on ``reset``, on
``close()`` (also ``with`` blocks, ``del`` and interpreter exit). ``close()`` cancels this
pipeline's in-flight fetches and unpins its chunks, keeping the delivered position, so a later
``next()`` resumes where the consumer was. ``next()`` is safe from several threads at once: they
share the one producer and its epoch (each item to one of them, ``StopIteration`` to all at its
end). Leaving a ``for`` loop early (``break``) releases nothing: the thread parks once
``prefetch_depth`` batches wait, and the next ``next()`` continues; call ``close()`` (or use
``with``) to release memory at once.

Stopping never waits for a GET: the thread is woken from any wait on a chunk
(``interrupt()`` of the stages below) and joined for at most a few seconds. A producer still
inside its source after that (a batch transform, a torchdata node between the stages, or a
thread the machine's load kept waiting) is waited for before the source is reset again — by
``reset`` or by the ``next()`` that starts the next producer — as a source reset under it
would hand it the first batch of the new position, which it drops (a skipped batch). An
exception raised in any stage re-raises in the consumer with its original traceback.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar, overload

from torchdata.nodes import BaseNode

from insitubatch_nodes import _process, _runtime, _waits
from insitubatch_nodes._frames import drop_frame_locals
from insitubatch_nodes.errors import PipelineInterrupted
from insitubatch_nodes.report import EpochReport
from insitubatch_nodes.stages._graph import (
    SOURCE_KEY,
    plan_state,
    source_start_state,
    source_state,
)
from insitubatch_nodes.stages._ranges import profile_range
from insitubatch_nodes.stages._wiring import check_wiring, claim
from insitubatch_nodes.stages.context import StageContext

if TYPE_CHECKING:
    from insitubatch_nodes.batch import Batch
    from insitubatch_nodes.stages.gather import GatherNode

__all__ = ["PrefetcherNode", "not_a_map_dataset"]

T = TypeVar("T")
log = logging.getLogger(__name__)
_ids = itertools.count()
_POLL_S = 0.05
_JOIN_S = 2.0  # how long stopping waits for the thread (it is woken from every chunk wait)


def _halt_all(nodes: Sequence[PrefetcherNode[Any]]) -> None:
    """At exit (see :func:`insitubatch_nodes._runtime.stop_at_exit`): stop every producer
    thread first, so nothing admits new fetches while the fetch stages cancel theirs."""
    for node in nodes:
        node._halt(close_source=True)


def not_a_map_dataset(obj: object, index: object) -> TypeError:
    """The error for ``obj[index]`` on a pipeline or a loader: what torch's ``DataLoader`` asks
    of a dataset it takes for map-style, when the pipeline is handed to it unwrapped."""
    return TypeError(
        f"{type(obj).__name__} delivers batches by iteration; it is not a map-style torch "
        f"Dataset (something asked it for item {index!r}: a torch DataLoader given the "
        "pipeline itself). Wrap the pipeline: DataLoader(as_dataset(pipe), batch_size=None) or "
        "StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0); or iterate it, "
        "for batch in Loader(pipe)"
    )


class _Worker:
    """The thread and its queue; holds no reference to the node (so ``del node`` works)."""

    def __init__(self, source: BaseNode[Any], context: StageContext, depth: int, name: str) -> None:
        self.source = source
        self.context = context
        self.queue = _HandOff(depth)
        # set once the node has recorded this worker: the thread touches the source only after
        # (a Ctrl-C inside ``next()`` between start and record would leave a producer running
        # in the source that no halt can reach, see ``PrefetcherNode.next``)
        self.go = threading.Event()
        self.stop = threading.Event()
        self.close_source = threading.Event()
        self.thread = threading.Thread(
            target=_run,
            args=(source, context, self.queue, self.go, self.stop, self.close_source),
            name=name,
        )
        self.thread.daemon = True

    def start(self) -> None:
        self.thread.start()

    def halt(self, close_source: bool, join: bool = True) -> None:
        """Stop the thread: wake it from any wait, and (``join``) wait up to ``_JOIN_S``.

        With ``close_source`` the source is closed — by the thread on its way out, or here once
        the thread is gone (closing is idempotent).
        """
        if close_source:
            self.close_source.set()
        self.stop.set()
        self.go.set()  # (a producer not yet let go ends at once)
        while True:  # unblock a producer parked on a full queue, then wake a waiting consumer
            with contextlib.suppress(queue.Empty):
                while True:
                    self.queue.get_nowait()
            try:
                self.queue.put_nowait(("halted", None, None))
                break
            except queue.Full:  # the producer slipped one more item in: drop it too
                continue
        self.context.interrupt()
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
            self.context.close()

    def wait_gone(self, why: str) -> None:
        """Wait until the thread has ended (see the module doc), saying so in the log every
        ``_JOIN_S`` it is not; ``why`` says what waits. Returns at once on the thread itself."""
        while self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(_JOIN_S)
            if self.thread.is_alive():
                log.warning(
                    "insitubatch_nodes: %s waits for %s to stop: it is still inside its "
                    "source (a batch transform or a torchdata node still running?)",
                    why,
                    self.thread.name,
                )


class _HandOff(queue.Queue[tuple[str, Any, Any]]):
    """The queue from the producer to ``next()``, of ``depth`` messages. A batch stays first in
    it until ``next()`` returns it (module doc); ``taken`` is that batch's message from the
    moment ``next()`` has done its bookkeeping and woken the producer, until the return."""

    def __init__(self, depth: int) -> None:
        super().__init__(maxsize=depth)
        self.taken: tuple[str, Any, Any] | None = None

    def put_when_room(self, msg: tuple[str, Any, Any], stop: threading.Event) -> bool:
        """Append ``msg`` once fewer than ``depth`` messages wait, the ``taken`` one not
        counted: ``next()`` wakes the producer just before that one leaves, and a producer
        that ran first would find the queue still full and sleep until its next poll (``next()``
        meanwhile waiting on it, at ``prefetch_depth=1``). Woken every ``_POLL_S`` to see
        ``stop``; ``False`` (nothing appended) once it is set."""
        with self.not_full:
            while not stop.is_set():
                waiting = len(self.queue)
                if waiting and self.queue[0] is self.taken:
                    waiting -= 1
                if waiting < self.maxsize:
                    self._put(msg)
                    self.not_empty.notify()
                    return True
                self.not_full.wait(_POLL_S)
        return False


def _run(
    source: BaseNode[Any],
    context: StageContext,
    q: _HandOff,
    go: threading.Event,
    stop: threading.Event,
    close_source: threading.Event,
) -> None:
    try:
        while not go.wait(_POLL_S):  # until the node has recorded this producer
            if stop.is_set():
                return
        while not stop.is_set():
            try:
                item = next(source)
            except StopIteration:
                q.put_when_room(("end", None, None), stop)
                return
            if not q.put_when_room(("item", item, source.state_dict()), stop):
                return
    except BaseException as exc:  # handed to the consumer, traceback intact
        q.put_when_room(("error", exc, None), stop)
    finally:
        if close_source.is_set():
            context.close()


#: who closes or resets a pipeline under a waiting ``next()``, and what to do when it was a mistake
_BY_WHOM = (
    " (by its close(), or by a reset from another loop over it, such as a second Loader or "
    "iter() on another thread: a pipeline feeds one loop at a time, so build a pipeline per "
    "loop)"
)


class PrefetcherNode(BaseNode[T], Generic[T]):
    """Keep up to ``prefetch_depth`` finished items ahead of the consumer (see module doc).

    ``context`` is the graph's :class:`~insitubatch_nodes.stages.context.StageContext`: the
    depth is its options' ``prefetch_depth``; its plan gives the length; closing this node
    closes every stage of the graph through it (also through plain torchdata nodes between).
    """

    STAGE: ClassVar[int] = 4  # its place in a graph (stages/_wiring.py)

    # torchdata ships no type information, so ``BaseNode[T]`` is ``Any`` to a type checker and
    # cannot tell it ``T``: a graph over this package's GatherNode delivers ``Batch``
    @overload
    def __init__(
        self: PrefetcherNode[Batch], source: GatherNode, *, context: StageContext
    ) -> None: ...
    @overload
    def __init__(self, source: BaseNode[T], *, context: StageContext) -> None: ...
    def __init__(self, source: BaseNode[T], *, context: StageContext) -> None:
        context = check_wiring(self.STAGE, source, context)
        super().__init__()
        self.source = source
        self.context = context
        self.prefetch_depth = context.options.prefetch_depth
        self.name = f"insitu-prefetch-{next(_ids)}"
        self._worker: _Worker | None = None
        self._halted: _Worker | None = None  # a producer halted but not yet gone (module doc)
        self._delivered: dict[str, Any] | None = None
        self._source_at_delivered = False  # the source sits exactly at the delivered position
        self._ended = False
        self._pid = os.getpid()
        # a worker is started and recorded, and taken by a halt, under this lock; each halt
        # counts, so a next() that a close() or reset() from another thread overtook while it
        # started its worker stops instead of waiting on a producer nobody halts
        self._lock = threading.RLock()
        self._halts = 0
        self.recorder = context.recorder
        _runtime.stop_at_exit("prefetch", self, _halt_all)
        claim(self, source)
        context.set_root(self)

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _process.check_same_process(self._pid)
        with self._lock:  # a next() on another thread starts no producer until it is over
            self._halt(close_source=False)
            self._await_halted("reset()")
            self.recorder.on_reset()
            if initial_state is None:
                self.source.reset(self._unbegun())
            else:
                self.source.reset(source_state(initial_state))
            self._delivered = self.source.state_dict()
            self._source_at_delivered = True
            # restored at an epoch's end by a consumer not yet told it was over (a sampler's
            # source, see ReadPlanNode): that epoch's StopIteration first, no producer started
            self._ended = self.context.plan.owes_stop

    def _unbegun(self) -> dict[str, Any] | None:
        """The delivered position when it is the start of an epoch the producer has run into
        (an interrupted or closed first ``next()``): ``reset(None)`` restarts that epoch there,
        as epochs advance on batches delivered, not on the plans pulled ahead. ``None`` (the
        source's own ``reset(None)``) otherwise, and when ``set_epoch`` pinned the next epoch."""
        delivered = self._delivered
        if delivered is None or self._ended or self._source_at_delivered:
            return None
        if plan_state(delivered)["batches_emitted"] or self.context.plan.pinned_epoch is not None:
            return None
        return delivered

    def _end_delivered_epoch(self) -> None:
        """At an epoch's end, where the delivered position would resume that epoch again (a
        rank with no batch of it, ``empty_ranks=True``, or none of an elastic ``"uneven"``
        rest while rank 0 had some), make it the next epoch's start, where the read plan now
        is. Left as it is where the graph cannot say its start (a plain torchdata node between
        the stages)."""
        delivered = None if self._delivered is None else plan_state(self._delivered)
        if delivered is None or self.context.plan.ends_epoch(delivered):
            return
        after = source_start_state(self.source, int(delivered["epoch"]) + 1)
        if after is not None:
            self._delivered = after[SOURCE_KEY]

    def __iter__(self) -> Self:
        """The node itself (torchdata's contract: ``next(iter(pipe))`` continues the epoch);
        once an epoch ended, the next epoch first (a ``reset()``), so that ``for batch in
        pipe:`` runs one epoch each time, as it does over a ``Loader``. An iterator taken once
        still raises ``StopIteration`` at its epoch's end."""
        if self._ended:
            self.reset()
        return self

    def next(self) -> T:
        _process.check_same_process(self._pid)
        if self._ended:
            raise StopIteration
        rec = self.recorder
        called = rec.on_next()
        worker = self._worker
        if worker is None:  # first next() since reset, or closed earlier: resume
            halts = self._halts
            with self._lock:  # after any halt in progress (another thread's close) is over
                if self._halts != halts:
                    raise PipelineInterrupted(
                        f"{self.name} was closed or reset while next() started its producer"
                        f"{_BY_WHOM}"
                    )
                worker = self._worker  # a next() on another thread may have started it
                if worker is None:
                    self._await_halted("next()")
                    if not self._source_at_delivered:
                        self.source.reset(self._delivered)
                    self._source_at_delivered = False
                    worker = _Worker(self.source, self.context, self.prefetch_depth, self.name)
                    try:
                        worker.start()  # it waits for ``go``: the source is not touched yet
                        self._worker = worker
                    except BaseException:  # Ctrl-C landed in between: a producer nobody
                        worker.stop.set()  # records (and so halts) must not run on unseen
                        worker.go.set()
                        raise
        if not worker.go.is_set():  # (also when a Ctrl-C landed right after the record)
            worker.go.set()
        # A blocking hand-off: the producer always ends with an "end" or "error" message, and
        # halting (close or reset, from any thread) puts a "halted" one. (Woken to let a
        # signal's handler run: :mod:`insitubatch_nodes._waits`.) A batch stays first in the
        # queue until it is returned: a Ctrl-C in the wait, the report's bookkeeping or the
        # producer's wake-up leaves it there for the next call (a reset or close drops it with
        # the rest: the state never counted it). The last message stays for every consumer.
        q = worker.queue
        while True:  # (again only where another consumer or a halt took the batch meanwhile)
            # (the lock itself, not a condition on it: a condition's __enter__ and __exit__ are
            # Python code, and a Ctrl-C landing in them left the lock held for good)
            with q.mutex:
                with profile_range("insitu.next"):
                    msg = _waits.head(q)
                kind, payload, state = msg
                if kind != "item":
                    q.not_empty.notify()  # (any other consumer waiting: to this last message)
                    break
                numbers = rec.on_deliver(called, payload)  # (in effect as it is returned)
                q.taken = msg  # the producer's room counts it gone from here: it goes on
                q.not_full.notify()
            # From here to the return no function is called and nothing jumps back: CPython
            # (with its GIL) runs a signal's handler and switches threads only there, so the
            # batch is counted in the report, recorded, leaves the queue and is returned as one
            # step. (A Ctrl-C in the instant after, in the caller, loses it as it would any
            # Python iterator's item.)
            if q.queue and q.queue[0] is msg:
                rec.open_epoch = numbers
                self._delivered = state
                q.taken = None
                del q.queue[0]
                return payload
        if kind == "end":  # first, with no call before it: a Ctrl-C from here on (the thread's
            self._ended = True  # join, the report) still ends the epoch at the next call
        elif kind == "halted":
            interrupted = PipelineInterrupted(
                f"{self.name} was closed or reset while next() waited for a batch{_BY_WHOM}"
            )
            rec.on_error(called, interrupted)
            raise interrupted
        with self._lock:
            if self._worker is worker:
                self._worker = None
        worker.thread.join()
        if kind == "end":
            self._end_delivered_epoch()
            rec.on_end(called)
            raise StopIteration
        drop_frame_locals(payload)  # (the producer is gone: its frames are finished)
        self.context.close()
        rec.on_error(called, payload)
        raise payload

    def get_state(self) -> dict[str, Any]:
        return {SOURCE_KEY: self._delivered}

    if TYPE_CHECKING:  # torchdata's own (untyped) methods, declared with this node's item type

        def __next__(self) -> T: ...

        def state_dict(self) -> dict[str, Any]: ...

    # -- what the graph below says ----------------------------------------------------------
    def report(self) -> EpochReport | None:
        """The epoch report: the epoch in progress once it has delivered a batch, else the last
        finished one (``None`` before the first batch, or when the fetch stage was built with
        ``report=False``).

        ``print(pipe.report())`` shows where the time went and which stage limits the epoch
        (``limiting``: ``"store"``, ``"decode"``, ``"gather"``, ``"engine"`` or
        ``"consumer"``), with a suggestion when one applies; ``.as_dict()`` gives plain numbers.
        See :mod:`insitubatch_nodes.report` for every field and the rule.
        """
        return self.recorder.report()

    def __repr__(self) -> str:
        """From the plan, never the store: the split, the batch size, each label's view (a
        stack's members), the epoch."""
        plan = getattr(getattr(self, "context", None), "plan", None)
        if plan is None:  # (not made yet: an error raised while it was being made)
            return super().__repr__()
        return (
            f"{type(self).__name__}(split={plan.split!r}, batch_size={plan.batch_size}, "
            f"views={dict(plan.layout.views)}, epoch={plan.epoch})"
        )

    def __getitem__(self, index: object) -> T:
        """Refused (``TypeError`` saying to wrap the pipeline with ``as_dataset``): torch's
        ``DataLoader`` asks this of a pipeline handed to it unwrapped."""
        raise not_a_map_dataset(self, index)

    def __len__(self) -> int:
        """Batches in the epoch being delivered (once it is over: in the next), counted from
        its start. The same every epoch, except an epoch resumed on another world size (see
        :meth:`ReadPlanNode.reset`). Decided by the delivered position: the read plan itself
        runs ahead of it by the read-ahead and the prefetch queue."""
        plan = self.context.plan
        current = plan.current_len
        delivered = None if self._delivered is None else plan_state(self._delivered)
        if self._ended or (delivered is not None and delivered["batches_emitted"] >= current):
            return plan.epoch_len
        return current

    def resumed_len(self, state: Mapping[str, Any]) -> int:
        """What ``len(self)`` reports once ``state`` (this node's or a ``Loader``'s) is
        restored: the batches of the epoch it resumes, counted from that epoch's start."""
        return self.context.plan.resumed_len(plan_state(state))

    def ends_epoch(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` (this node's or a ``Loader``'s) was taken at its epoch's end, so
        that restoring it goes on with the next epoch; ``False`` inside an epoch, also where
        this rank has no batch of it left (an elastic rank with no share of the rest)."""
        return self.context.plan.ends_epoch(state)

    def start_state(self, epoch: int) -> dict[str, Any] | None:
        """The state of this graph before the first batch of ``epoch`` (nothing is started):
        the plan's state wrapped once per stage above it. ``None`` when a node between here and
        the plan is not one of this package's stages (its state cannot be made up)."""
        return source_start_state(self.source, epoch)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread, cancel in-flight fetches, unpin chunks; the position is kept.

        Returns within a few seconds whatever the store does (in-flight GETs are cancelled,
        not awaited)."""
        self._halt(close_source=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None and getattr(self, "_pid", None) == os.getpid():
            worker.halt(close_source=True, join=False)

    def _halt(self, close_source: bool) -> None:
        if os.getpid() != self._pid:  # a forked child: the thread and its locks are the parent's
            self._worker = None
            return
        # the whole halt under the lock: a next() on another thread (woken by this halt)
        # starts its producer only once the old one is gone and the source closed - started
        # before, the closing released the new producer's chunks (FillCancelled)
        with self._lock:
            worker, self._worker = self._worker, None
            self._halts += 1
            if worker is not None:
                worker.halt(close_source=close_source)
                if worker.thread.is_alive():
                    self._halted = worker
            elif close_source:
                self.context.close()
            if close_source:
                self._source_at_delivered = False

    def _await_halted(self, why: str) -> None:
        """Before the source is reset: wait for the producer a halt left running, if any."""
        worker, self._halted = self._halted, None
        if worker is not None:
            worker.wait_gone(why)

    @property
    def threads(self) -> list[threading.Thread]:
        """Threads this pipeline started that are still alive."""
        return [t for t in threading.enumerate() if t.name == self.name]
