"""The prefetch stage's hand-over: the producer's wake-up, the report's count, Ctrl-C in it.

``next()`` keeps a batch first in the prefetch queue until it returns it (a Ctrl-C anywhere
before leaves it for the next call, tests/test_notebook_trial.py). Four things it did wrong,
each forced here at the instant it happens instead of waited for:

* the producer, woken before the batch left the queue, could run first (a thread switch on
  the way out of the queue's lock), find the queue still full and sleep until its next poll;
* a Ctrl-C after the report's bookkeeping and before the return counted the batch twice (it
  stays first in the queue, and the next call hands it over again);
* a Ctrl-C as ``next()`` took or gave back the queue's lock (through a condition's Python
  ``__enter__``/``__exit__``) left the lock held for good;
* a Ctrl-C in the ``next()`` that ends an epoch, once it had let the producer go, lost the
  epoch's end: the next call went on with the next epoch.

zarr's own read of the store is the oracle of every row delivered; a fresh pipeline's batches
are the oracle of their order.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import t2m_halves, wait_until

from insitubatch_nodes import insitu_pipeline
from insitubatch_nodes.stages import prefetch

pytestmark = pytest.mark.timeout(60)
_WAIT_S = 10.0  # the most any step here waits for the other thread (each takes milliseconds)


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``t2m`` of 256 steps in chunks of 8 (train is the first 16 chunks), and zarr's read."""
    return t2m_halves(tmp_path_factory.mktemp("prefetchwake") / "era5.zarr", 256)


def _pipe(era5: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("shuffle", False)
    return insitu_pipeline(era5["store"], era5["manifest"], {"x": era5["t2m"]}, **kwargs)


def _exact(era5: dict[str, Any], batch: Any) -> bool:
    return bool(np.array_equal(batch["x"], era5["oracle"][batch.sample_indices["x"]]))


def _ids(batches: list[Any]) -> list[tuple[int, int]]:
    return [(b.epoch, b.index) for b in batches]


# -- 1. the producer's wake-up ------------------------------------------------------------------
class _HandOverLock:
    """The prefetch queue's lock, instrumented: once :meth:`arm` ed, the consumer's first
    release of it after it woke the producer (``not_full.notify``) lets the producer run —
    until it puts its batch or waits again — before the consumer goes on. The thread switch a
    busy machine makes there now and then (one with more threads than cores), made every
    time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.armed = False
        self.woke = False  # the consumer woke the producer and still holds the lock
        self.moved = threading.Event()  # the producer put a message or waited again
        self.puts = 0
        self.rewaits = 0

    def arm(self) -> None:
        self.armed, self.woke = True, False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._owner = threading.get_ident()
        return got

    def release(self) -> None:
        self._owner = None
        self._lock.release()
        if self.woke and threading.current_thread() is threading.main_thread():
            self.armed = self.woke = False
            assert self.moved.wait(_WAIT_S), "the woken producer neither put nor waited"

    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Room(threading.Condition):
    """The queue's ``not_full``, telling :class:`_HandOverLock` when the producer waits."""

    def __init__(self, lock: _HandOverLock) -> None:
        super().__init__(lock)  # type: ignore[arg-type]
        self.lock = lock
        self.waiting = False

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread() is not threading.main_thread():
            self.lock.rewaits += 1
            self.lock.moved.set()
        self.waiting = True
        try:
            return super().wait(timeout)
        finally:
            self.waiting = False

    def notify(self, n: int = 1) -> None:
        super().notify(n)
        lock = self.lock
        if lock.armed and threading.current_thread() is threading.main_thread():
            lock.moved.clear()
            lock.woke = True


def _instrumented(monkeypatch: pytest.MonkeyPatch) -> list[_HandOverLock]:
    """Give each prefetch queue made from here a :class:`_HandOverLock` (before its producer
    runs); the locks, in order."""
    locks: list[_HandOverLock] = []
    start = prefetch._Worker.start

    def start_instrumented(worker: Any) -> None:
        q, lock = worker.queue, _HandOverLock()
        q.mutex = lock
        q.not_empty = threading.Condition(lock)  # type: ignore[arg-type]
        q.not_full = _Room(lock)
        q.all_tasks_done = threading.Condition(lock)  # type: ignore[arg-type]
        put = q._put

        def counted_put(item: Any) -> None:
            put(item)
            if threading.current_thread() is not threading.main_thread():
                lock.puts += 1
                lock.moved.set()

        q._put = counted_put
        locks.append(lock)
        start(worker)

    monkeypatch.setattr(prefetch._Worker, "start", start_instrumented)
    return locks


@pytest.mark.parametrize("depth", [1, 2])
def test_the_producer_woken_before_the_batch_leaves_the_queue_puts_its_next_batch_at_once(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    # before: next() woke the producer (not_full.notify) before it removed the batch, so a
    # producer that ran first saw the queue still full and waited again - until its put's
    # 50 ms poll ran out, or the next next(); at prefetch_depth=1 that next() found the queue
    # empty and waited on the sleeping producer. Here the producer always runs first.
    fresh = _pipe(era5, prefetch_depth=depth)
    want = [next(fresh).sample_indices["x"].copy() for _ in range(4)]
    fresh.close()
    locks = _instrumented(monkeypatch)
    pipe = _pipe(era5, prefetch_depth=depth)
    got = [next(pipe)]
    (lock,) = locks
    q, room = pipe._worker.queue, pipe._worker.queue.not_full
    for _ in range(3):  # the producer waits for room, a batch in hand
        assert wait_until(lambda: len(q.queue) == depth and room.waiting, _WAIT_S)
        lock.arm()
        puts = lock.puts
        got.append(next(pipe))
        assert not lock.armed, "next() never woke the producer"
        parked = lock.puts == puts
        assert not parked, (
            f"the producer woken by next() #{len(got)} found the queue full (the batch not "
            f"yet removed) and went back to sleep ({lock.rewaits} waits again)"
        )
    pipe.close()
    assert _ids(got) == [(0, i) for i in range(4)]
    assert all(np.array_equal(b.sample_indices["x"], w) for b, w in zip(got, want, strict=True))
    assert all(_exact(era5, b) for b in got)


# -- 2. the report's count of a batch handed over after a Ctrl-C --------------------------------
def _ctrl_c_after_bookkeeping(pipe: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make the pipeline's next ``next()`` raise ``KeyboardInterrupt`` right after the epoch
    report's bookkeeping of the batch it hands over (``on_deliver`` returned), before the
    return - where a Ctrl-C lands that arrives while the producer is woken. Returns a check
    that it fired."""
    rec = pipe.recorder
    on_deliver = rec.on_deliver
    fired = [False]

    def deliver_then_ctrl_c(*args: Any) -> Any:
        result = on_deliver(*args)
        if not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(rec, "on_deliver", deliver_then_ctrl_c)

    def check() -> None:
        assert fired[0], "the Ctrl-C never landed"

    return check


@pytest.mark.parametrize("then", ["next", "close", "state"])
def test_a_ctrl_c_after_the_bookkeeping_of_a_batch_counts_it_once_in_the_report(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    # before: the batch stayed first in the queue (right), and the next call handed it over
    # and counted it again: the report said 65 batches (130 samples) for 64 delivered. ``then``
    # is what follows the Ctrl-C: next() at once, close() then next() (the same position, the
    # batch made again), or a restore of the state taken after it, in another pipeline.
    fresh = _pipe(era5)
    want = [b.sample_indices["x"].copy() for b in fresh]  # the whole epoch
    fresh.close()
    pipe = _pipe(era5)
    first = next(pipe)
    fired = _ctrl_c_after_bookkeeping(pipe, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        next(pipe)
    fired()
    counted = [first]  # the batches this pipeline's report counts
    if then == "close":
        pipe.close()
    elif then == "state":
        state = pipe.state_dict()
        pipe.close()
        pipe = _pipe(era5)
        pipe.reset(state)
        counted = []
    rest = list(pipe)  # to the epoch's end: its report is complete
    counted += rest
    report = pipe.report()
    pipe.close()
    got = [first, *rest]
    assert _ids(got) == [(0, i) for i in range(len(want))]
    assert all(np.array_equal(b.sample_indices["x"], w) for b, w in zip(got, want, strict=True))
    assert all(_exact(era5, b) for b in got)
    assert report is not None
    rows = sum(len(b) for b in counted)
    nbytes = sum(b["x"].nbytes for b in counted)
    assert (report.batches, report.samples, report.bytes_delivered) == (len(counted), rows, nbytes)
    assert report.complete
    # the epoch's time is its waits and the consumer's own work, each instant once
    assert report.handoff_wait_s + report.consumer_s == pytest.approx(report.wall_s, rel=1e-6)


def test_a_ctrl_c_after_the_bookkeeping_of_a_batch_then_a_reset_reports_only_batches_returned(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the finished epoch's report (made at the reset) counted the batch the Ctrl-C
    # kept from being returned: 3 batches, where the loop got 2
    pipe = _pipe(era5)
    got = [next(pipe), next(pipe)]
    fired = _ctrl_c_after_bookkeeping(pipe, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        next(pipe)
    fired()
    pipe.reset()
    report = pipe.report()
    pipe.close()
    assert report is not None and report.complete
    assert (report.batches, report.samples) == (2, sum(len(b) for b in got))


# -- 3. a Ctrl-C at each instant of the hand-over -----------------------------------------------
def _ctrl_c_at(k: int) -> Callable[[Any, str, Any], None]:
    """A profile function (``sys.setprofile``) that raises ``KeyboardInterrupt`` at the
    ``k``-th instant where CPython can run a signal's handler — a Python function's entry, a
    builtin's return — inside ``PrefetcherNode.next`` (on the way back into the caller a
    Ctrl-C loses the batch as it would any iterator's item, docs/pipeline.md)."""
    inside = prefetch.PrefetcherNode.next.__code__
    seen = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "c_return"):
            return
        f = frame if event == "c_return" else frame.f_back
        while f is not None and f.f_code is not inside:
            f = f.f_back
        if f is None:
            return
        seen[0] += 1
        if seen[0] == k:
            sys.setprofile(None)
            raise KeyboardInterrupt

    return profile


def _ends(q: Any) -> bool:
    """Whether the producer's last message is in ``q`` (the epoch's end, or an error)."""
    return bool(q.queue) and q.queue[-1][0] != "item"


def test_a_ctrl_c_at_each_instant_of_next_loses_no_batch_counts_each_once_and_frees_the_queue(
    era5: dict[str, Any],
) -> None:
    # before: a Ctrl-C on entering the queue condition's __exit__ (a Python function, where
    # CPython runs a signal's handler) left the queue's lock held: the producer could never put
    # again, and the next next() waited on the lock for good; on leaving its __enter__ likewise.
    # Each next() here is interrupted at one more instant than the one before (47 on Python
    # 3.11, the batch ready in the queue), then called again.
    fresh = _pipe(era5)
    want = [b.sample_indices["x"].copy() for b in fresh]
    fresh.close()
    pipe = _pipe(era5)
    got = [next(pipe)]
    q = pipe._worker.queue
    k = 0
    while True:
        k += 1
        ready = wait_until(lambda: len(q.queue) == q.maxsize or _ends(q))
        assert ready, "the producer never filled the queue"
        sys.setprofile(_ctrl_c_at(k))
        try:
            got.append(next(pipe))
        except KeyboardInterrupt:
            pass
        else:
            assert sys.getprofile() is not None, f"a Ctrl-C at instant {k} was swallowed"
            sys.setprofile(None)
            break  # the call had fewer than k instants: each one was tried
        finally:
            sys.setprofile(None)
        free = q.mutex.acquire(timeout=_WAIT_S)
        q.mutex.release()  # (where it was not free: this thread's for good, so the pipe closes)
        if not free:
            pipe.close()
        assert free, f"a Ctrl-C at instant {k} of next() left the queue's lock held"
        got.append(next(pipe))  # the batch it was handing over
    assert k > 20, f"only {k} instants"
    got += list(pipe)  # to the epoch's end: its report is complete
    report = pipe.report()
    pipe.close()
    assert _ids(got) == [(0, i) for i in range(len(want))]
    assert all(np.array_equal(b.sample_indices["x"], w) for b, w in zip(got, want, strict=True))
    assert all(_exact(era5, b) for b in got)
    assert report is not None and report.complete
    assert (report.batches, report.samples) == (len(got), sum(len(b) for b in got))
    assert report.handoff_wait_s + report.consumer_s == pytest.approx(report.wall_s, rel=1e-6)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_at_each_instant_of_the_next_that_ends_an_epoch_still_ends_it(
    era5: dict[str, Any],
) -> None:
    # before: a Ctrl-C once next() had the producer's "end" and let the producer go, before it
    # marked the epoch ended (in the thread's join), made the next call start a new producer:
    # it returned the next epoch's first batch instead of StopIteration, so a for loop ran on
    # into the next epoch (from instant 20 on Python 3.11, ten instants in all; under real
    # SIGINTs every 0-1 ms, epochs of 128 batches for 64). The instants of this call vary (a
    # generator finalized in it, where CPython ignores the interrupt): the first 60 are tried.
    pipe = _pipe(era5, batch_size=64)  # 2 batches an epoch
    landed = 0
    for k in range(1, 61):
        got = [next(pipe), next(pipe)]
        queue = pipe._worker.queue
        assert wait_until(lambda q=queue: _ends(q)), "the producer never ended the epoch"
        sys.setprofile(_ctrl_c_at(k))
        try:
            next(pipe)
        except KeyboardInterrupt:
            landed += 1
            free = queue.mutex.acquire(timeout=_WAIT_S)
            queue.mutex.release()  # (as in the test above)
            if not free:
                pipe.close()
            assert free, f"a Ctrl-C at instant {k} of next() left the queue's lock held"
            with pytest.raises(StopIteration):
                extra = next(pipe)
                pytest.fail(
                    f"a Ctrl-C at instant {k} of the epoch's last next() lost its end: the "
                    f"next call returned batch {(extra.epoch, extra.index)}"
                )
        except StopIteration:
            pass  # (fewer than k instants, or the interrupt ignored in a finalizer)
        finally:
            sys.setprofile(None)
        assert _ids(got) == [(got[0].epoch, 0), (got[0].epoch, 1)]
        iter(pipe)  # the next epoch
    pipe.close()
    assert landed > 40, f"only {landed} interrupts landed"
