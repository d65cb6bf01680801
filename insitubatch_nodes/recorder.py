"""What a pipeline measures while an epoch runs: the stages' waits, busy time and counters.

The fetch, pool, gather and prefetch stages note into one :class:`EpochRecorder`; at the
epoch's end it becomes an :class:`~insitubatch_nodes.report.EpochReport`.

**The trace.** With ``trace=True`` (``FetchOptions(trace=True)``) the recorder also keeps a
:class:`~insitubatch_nodes.trace.TraceLog`: one timestamped span per GET, local read, decode,
chunk transform and fill run (on the thread that ran it; a failed GET, read or decode has its
span too, naming the error), per admission, chunk wait and gather (the producer thread) and per
hand-off wait and stretch of the consumer's own work (the consumer's thread), each with its
chunk and batch ids; the epoch's report carries them
(:class:`~insitubatch_nodes.trace.EpochTrace`). A stored object's spans are packed as numbers
as they are recorded (:class:`~insitubatch_nodes.trace.PackedSpans`: no lasting Python object
per span; a failed read's or decode's, rare, is a loose span). The spans are handed over with
the counters they match — a fill run's at its end, a failed read's or decode's at once
(:meth:`EpochRecorder.on_object_failed`), each under the lock its counters take — so the
trace's counts are the report's. Without it ``trace`` is ``None`` and the hot paths test that
once per run or per batch, never build anything.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from insitubatch_nodes.report import EpochReport, limiting_stage, suggestion_for
from insitubatch_nodes.trace import EpochTrace, TraceLog, TraceMark

_now = time.perf_counter

__all__ = ["NULL_RECORDER", "EpochRecorder", "NullRecorder", "TraceLog"]

log = logging.getLogger("insitubatch_nodes.report")  # the epoch line keeps its logger name


class _Level:
    """A count that goes up and down: current value, peak, and its integral over time."""

    __slots__ = ("active", "area", "last", "peak", "value")

    def __init__(self) -> None:
        self.value = 0
        self.peak = 0
        self.area = 0.0  # sum of value * dt
        self.active = 0.0  # time with value >= 1
        self.last = _now()

    def change(self, delta: int, now: float) -> None:
        dt = now - self.last
        self.area += self.value * dt
        if self.value > 0:
            self.active += dt
        self.last = now
        self.value += delta
        if self.value > self.peak:
            self.peak = self.value

    def snapshot(self, now: float) -> tuple[float, float]:
        dt = now - self.last
        return self.area + self.value * dt, self.active + (dt if self.value > 0 else 0.0)


_CUMULATIVE = (
    "admit_s",
    "run_s",
    "local_read_s",
    "get_s",
    "decode_s",
    "decode_queued_s",
    "chunk_wait_s",
    "gather_s",
    "gets",
    "decodes",
    "hits",
    "misses",
    "re_reads",
    "in_place",
    "bytes_fetched",
    "transform_s",
    "transforms",
    "bad_chunks",
    "corrupt",
)


class EpochRecorder:
    """Measures one pipeline (module docstring). Stages call the ``on_*`` hooks; cheap.

    ``pool`` is the pipeline's :class:`~insitubatch_nodes.pool.ChunkPool` (resident bytes,
    evictions, budget); ``split_bytes`` returns the bytes of every chunk epoch ``e`` reads and
    ``budget_floor`` the smallest explicit budget the pipeline accepts (both asked only when an
    epoch had re-reads); ``read_ahead_capped`` why a larger ``block_chunks`` would read no
    further ahead, or ``""``; ``dropped`` the plan's anchors dropped for missing steps, per
    reason (both asked for each report: a few arithmetic steps, and the plan's count).
    """

    enabled = True

    def __init__(
        self,
        pool: Any,
        *,
        max_inflight: int,
        decode_threads: int,
        batch_transforms: int = 0,
        split_bytes: Callable[[int], int] | None = None,
        budget_floor: Callable[[], int] | None = None,
        read_ahead_capped: Callable[[], str] | None = None,
        dropped: Callable[[], Mapping[str, int]] | None = None,
        trace: bool = False,
        direct: bool | None = None,
    ) -> None:
        self.pool = pool
        self.direct = direct  # FetchOptions.direct, for the suggestion
        self._dropped = dropped
        #: the spans of the epoch in progress (``None``: no trace asked for)
        self.trace: TraceLog | None = TraceLog() if trace else None
        self.batch_transforms = batch_transforms
        self.max_inflight = max_inflight
        self.decode_threads = decode_threads
        self._split_bytes = split_bytes
        self._budget_floor = budget_floor
        self._read_ahead_capped = read_ahead_capped
        self._lock = threading.Lock()
        self._inflight = _Level()
        self._depth = _Level()
        self._fetched: set[Any] = set()
        self.totals: dict[str, float] = dict.fromkeys(_CUMULATIVE, 0)
        #: the open epoch's numbers (``None``: none open); replaced whole as a batch is handed
        #: over (:meth:`on_deliver`), changed in place by the other hooks
        self.open_epoch: dict[str, Any] | None = None
        #: the first next() of the open (or last) epoch: the GETs and fill runs of a fill job
        #: submitted before it are an earlier epoch's work (see :meth:`_earlier`)
        self._opened = -math.inf
        self.last: EpochReport | None = None

    # -- producer-side hooks (any thread) ------------------------------------------------------
    def on_get_start(self) -> float:
        now = _now()
        with self._lock:
            self._inflight.change(1, now)
        return now

    def on_get_end(
        self,
        started: float,
        nbytes: int,
        ok: bool = True,
        what: tuple[Any, ...] | None = None,
        submitted: float | None = None,
        failed: str | None = None,
    ) -> None:
        """A GET ended: with its bytes; or failed (``ok=False``, ``failed`` the name of the
        error the store raised: counted, with no bytes, and its span names the error — the
        store was asked and the epoch spent that time, a timeout's whole deadline); or was
        cancelled (``ok=False`` alone: not counted). ``what`` (with a trace: the array path,
        chunk, tile, key and batch it read) goes with its span. ``submitted``: when its fill
        job was submitted (a GET of a job submitted before the open epoch began is not
        counted, see :meth:`_earlier`)."""
        now = _now()
        with self._lock:
            self._inflight.change(-1, now)
            if (ok or failed is not None) and not self._earlier(submitted):
                t = self.totals
                t["get_s"] += now - started
                t["gets"] += 1
                t["bytes_fetched"] += nbytes
                if self.trace is not None and what is not None:
                    path, chunk, tile, key, batch = what
                    self.trace.get(started, now, path, chunk, tile, key, nbytes, batch, failed)

    def on_fill_submit(self, objects: int, now: float) -> None:
        """A fill job queued ``objects`` stored objects for the decode threads."""
        with self._lock:
            self._depth.change(objects, now)

    def on_fill_run(self, tally: Any) -> None:
        """A decode thread ended a run of a fill job (``tally``: what it did, see
        :mod:`~insitubatch_nodes.stages._fill`): reads of a local store count as GETs. With a
        trace, ``tally.packed`` (its reads, decodes and transforms) and ``tally.spans``
        (``(name, t0, t1, args)``: the run's own) are the calling thread's."""
        now = _now()
        with self._lock:
            self._depth.change(-tally.handled, now)
            if self._earlier(tally.submitted):
                return
            trace = self.trace
            if trace is not None and tally.spans is not None:
                tid = trace.thread()
                trace.spans.extend((n, t0, t1, tid, a) for n, t0, t1, a in tally.spans)
                if tally.packed:
                    trace.packed.append((tid, tally.packed))
            t = self.totals
            if tally.reads:
                t["gets"] += tally.reads
                t["get_s"] += tally.read_s
                t["bytes_fetched"] += tally.read_bytes
                t["local_read_s"] += tally.read_s
            t["decodes"] += tally.decodes
            t["decode_s"] += tally.decode_s
            t["decode_queued_s"] += tally.queued_s
            t["transforms"] += tally.transforms
            t["transform_s"] += tally.transform_s
            t["run_s"] += tally.run_s

    def on_object_failed(
        self, what: str, t0: float, t1: float, *, submitted: float, since: float,
        ids: tuple[str, int, tuple[int, ...], int, int], error: str,
    ) -> None:  # fmt: skip
        """A local read (``what="read"``) or a decode (``"decode"``) of a stored object raised
        ``error`` (its exception's name), ``t0`` to ``t1``, on the calling decode thread: it
        counts as one that worked — a read in the GETs (no bytes), their seconds and
        ``local_read_s``, as a failed GET does; a decode in the decodes, their seconds and
        queue time (since ``since``) — and with a trace its span names the error (``ids``: the
        array path, chunk, tile, batch and batch row, ``-1`` for a slot). ``submitted``: when
        its fill job was submitted (see :meth:`_earlier`)."""
        with self._lock:
            if self._earlier(submitted):
                return
            t = self.totals
            if what == "read":
                t["gets"] += 1
                t["get_s"] += t1 - t0
                t["local_read_s"] += t1 - t0
            else:
                t["decodes"] += 1
                t["decode_s"] += t1 - t0
                t["decode_queued_s"] += t1 - since
            if self.trace is not None:
                self.trace.failed(what, t0, t1, ids, error)

    def _earlier(self, submitted: float | None) -> bool:
        """Whether work of a fill job submitted at ``submitted`` belongs to an earlier epoch
        than the open one: submitted before its first ``next()`` (the producer starts at that
        ``next()``, so the open epoch's own jobs never are). A broken-off epoch's read-ahead
        still running at the reset ends in the next epoch: it counts in neither (its report
        ends at its last batch), and its spans are not the next epoch's (they would start
        before it). Under the lock."""
        return submitted is not None and submitted < self._opened

    def on_admit_counts(self, hits: int, misses: int, re_reads: int, in_place: int = 0) -> None:
        """The fetch stage admitted chunks: ``hits``, ``misses`` (``re_reads`` of them fetched
        by this pipeline before, ``in_place`` of them decoded straight into batch rows)."""
        t = self.totals
        t["hits"] += hits
        t["misses"] += misses
        t["re_reads"] += re_reads
        t["in_place"] += in_place

    def on_bad_chunk(self) -> None:
        """A stored object was filled under ``on_bad_chunk="nan"``."""
        with self._lock:
            self.totals["bad_chunks"] += 1

    def on_corrupt(self) -> None:
        """A chunk admitted as a hit on disk was corrupt there: it is fetched, a miss (the
        report moves it from ``hits`` to ``misses``)."""
        with self._lock:
            self.totals["corrupt"] += 1

    def add(self, name: str, seconds: float, *, start: float = 0.0, batch: int = -1) -> None:
        """Add producer-thread seconds to ``chunk_wait_s``, ``gather_s`` or ``admit_s``; with a
        trace, a span from ``start`` for batch ``batch``."""
        self.totals[name] += seconds
        trace = self.trace
        if trace is not None:
            trace.span(_SPAN_OF[name], start, start + seconds, {"batch": batch})

    # -- consumer-side hooks (the consumer's thread) -------------------------------------------
    def on_next(self) -> float:
        """The consumer calls ``next()``: opens an epoch if none is open; returns the time.

        The time since the consumer's time was last counted (``returned``: the last batch
        returned, the error ``next()`` raised, or the call before that returned nothing — a
        Ctrl-C) is the consumer's own work, counted once."""
        now = _now()
        ep = self.open_epoch
        if ep is None:
            self.open_epoch = self._open(now)
            return now
        since, ep["returned"] = ep["returned"], now
        ep["consumer_s"] += now - since
        usage, ep["returned_usage"] = ep["returned_usage"], None
        if usage is not None:
            thread, sys_s, faults = usage
            mine = _thread_usage()
            if mine is not None and mine[0] == thread:  # the same thread returned it
                ep["consumer_sys_s"] += max(0.0, mine[1] - sys_s)
                ep["consumer_faults"] += max(0, mine[2] - faults)
        if self.trace is not None:
            self.trace.span("consumer", since, now, {"batch": ep["index"]})
        return now

    def on_deliver(self, called: float, item: Any) -> dict[str, Any] | None:
        """The open epoch's numbers once ``item``, waited for since ``called``, is handed over:
        a new dict, not yet counted. The prefetch stage makes it :attr:`open_epoch` in the step
        that returns ``item``, where no Ctrl-C can land in between: an item a Ctrl-C kept from
        being returned is counted by the call that returns it, once (before, it was counted
        here and again by that call). ``None`` where no epoch is open."""
        now = _now()
        ep = self.open_epoch
        if ep is None:  # pragma: no cover - on_next always opens one
            return None
        ep = dict(ep)
        wait = now - called
        ep["handoff_wait_s"] += wait
        index = getattr(item, "index", -1)
        ep["index"] = index
        if self.trace is not None:
            self.trace.span("next", called, now, {"batch": index})
        if ep["batches"] == 0:
            ep["first_batch_s"] = now - ep["t0"]
            ep["first_wait_s"] = wait
        ep["batches"] += 1
        ep["returned"] = now
        ep["returned_usage"] = _thread_usage()
        ep["last"] = now
        arrays = getattr(item, "arrays", None)
        if arrays is not None:
            ep["samples"] += len(item)
            ep["bytes_delivered"] += sum(int(a.nbytes) for a in arrays.values())
        resident = int(self.pool.stats.resident_bytes)
        ep["resident_sum"] += resident
        ep["resident_peak"] = max(ep["resident_peak"], resident)
        ep["epoch"] = getattr(item, "epoch", ep["epoch"])
        ep["mark"] = self._mark(now)  # what a report ending at this batch counts
        return ep

    def on_error(self, called: float, error: BaseException) -> None:
        """``next()`` raised ``error`` after waiting since ``called``: the wait counts as one
        (and, with a trace, is a ``next`` span naming the error), and the consumer's own work
        is counted from here if it calls ``next()`` again. The epoch stays open."""
        ep = self.open_epoch
        if ep is None:  # pragma: no cover - on_next always opens one
            return
        now = _now()
        ep["handoff_wait_s"] += now - called
        ep["returned"], ep["returned_usage"] = now, None
        if self.trace is not None:
            args = {"batch": -1, "error": type(error).__name__}
            self.trace.span("next", called, now, args)
        if ep["batches"]:  # the epoch's wall runs to the error
            ep["last"] = now
            ep["mark"] = self._mark(now)

    def on_end(self, called: float) -> None:
        """The epoch ended (``StopIteration``): finalize it."""
        ep = self.open_epoch
        if ep is not None:
            now = _now()
            ep["handoff_wait_s"] += now - called
            ep["last"] = now  # the wall time ends with the epoch, so wait + consumer = wall
            if self.trace is not None:
                self.trace.span("next", called, now, {"batch": -1, "end": True})
            ep["mark"] = self._mark(now)
        self.finalize()

    def on_reset(self) -> None:
        """Finalize the open epoch if it delivered a batch (else forget it)."""
        self.finalize()

    # -- reports -------------------------------------------------------------------------------
    def finalize(self) -> EpochReport | None:
        """Finish the open epoch (if it delivered a batch): its report ends at its last batch
        delivered (or at ``StopIteration``, or at the error ``next()`` raised), and counts
        what the stages had done by then — not the read-ahead that went on until the reset
        (a broken-off epoch of 2 batches counted a block of it: more GET-seconds than wall)."""
        ep, self.open_epoch = self.open_epoch, None
        if ep is None or ep["batches"] == 0:
            return None
        report = self._build(ep, complete=True)
        self.last = report
        log.info("insitubatch_nodes: %s", report.headline())
        return report

    def report(self) -> EpochReport | None:
        """The epoch in progress if it delivered a batch, else the last finalized one."""
        ep = self.open_epoch
        if ep is not None and ep["batches"] > 0:
            return self._build(ep, complete=False)
        return self.last

    def _open(self, now: float) -> dict[str, Any]:
        if self.trace is not None:  # spans before the epoch's first next() are not its own
            self.trace.take()
        with self._lock:
            self._opened = now
            self._inflight.change(0, now)
            self._depth.change(0, now)
            self._inflight.peak, self._depth.peak = self._inflight.value, self._depth.value
            inflight = self._inflight.snapshot(now)
            totals = dict(self.totals)
        return {
            "t0": now,
            "epoch": -1,
            "returned": now,  # what the consumer's own time is counted from (see on_next)
            "index": -1,
            "last": now,
            "batches": 0,
            "samples": 0,
            "bytes_delivered": 0,
            "handoff_wait_s": 0.0,
            "first_wait_s": 0.0,
            "first_batch_s": 0.0,
            "consumer_s": 0.0,
            "returned_usage": None,
            "consumer_sys_s": 0.0,
            "consumer_faults": 0,
            "resident_sum": 0,
            "resident_peak": 0,
            "inflight0": inflight,
            "totals0": totals,
            "evictions0": int(self.pool.stats.evictions),
            "allocated0": int(self.pool.allocated_bytes),
            "cpu0": time.process_time(),
            "usage0": _usage(),
        }

    def _mark(self, now: float) -> _Mark:
        """The counters, levels and spans as of ``now`` (one dict copy and a few numbers: a
        few us per batch)."""
        with self._lock:
            return self._mark_locked(now)

    def _mark_locked(self, now: float) -> _Mark:
        trace = None if self.trace is None else self.trace.mark()
        return _Mark(
            now,
            dict(self.totals),
            self._inflight.snapshot(now),
            (self._inflight.peak, self._depth.peak),
            int(self.pool.stats.evictions),
            int(self.pool.allocated_bytes),
            time.process_time(),
            _usage(),
            trace,
        )

    def _build(self, ep: dict[str, Any], complete: bool) -> EpochReport:
        trace = self.trace
        with self._lock:
            if complete:  # as of its last batch (see finalize)
                m = ep["mark"]
                spans = None if trace is None else trace.take(upto=m.trace)
            else:  # in progress: as of now, with the spans that go with these counters
                m = self._mark_locked(_now())
                spans = None if trace is None else trace.take(keep=True)
        end, totals, inflight, peaks = m.end, m.totals, m.inflight, m.peaks
        evictions, cpu, usage = m.evictions, m.cpu, m.usage
        wall = max(end - ep["t0"], 1e-9)
        d = {k: totals[k] - ep["totals0"][k] for k in _CUMULATIVE}
        r = EpochReport(
            epoch=int(ep["epoch"]),
            complete=complete,
            batches=ep["batches"],
            samples=ep["samples"],
            wall_s=wall,
            first_batch_s=ep["first_batch_s"],
            handoff_wait_s=ep["handoff_wait_s"],
            first_wait_s=ep["first_wait_s"],
            consumer_s=ep["consumer_s"],
            get_s=d["get_s"],
            # reads of a local store (on the decode threads) count as GETs in flight
            get_active_s=inflight[1] - ep["inflight0"][1] + min(d["local_read_s"], wall),
            decode_s=d["decode_s"],
            decode_queued_s=d["decode_queued_s"],
            chunk_wait_s=d["chunk_wait_s"],
            gather_s=d["gather_s"],
            admit_s=d["admit_s"],
            run_s=d["run_s"],
            local_read_s=d["local_read_s"],
            cpu_s=cpu - ep["cpu0"],
            sys_s=usage[0] - ep["usage0"][0],
            page_faults=usage[1] - ep["usage0"][1],
            consumer_sys_s=ep["consumer_sys_s"],
            consumer_page_faults=ep["consumer_faults"],
            inflight_mean=(inflight[0] - ep["inflight0"][0] + d["local_read_s"]) / wall,
            inflight_peak=max(peaks[0], self.decode_threads if d["local_read_s"] else 0),
            decode_depth_mean=d["decode_queued_s"] / wall,
            decode_depth_peak=peaks[1],
            resident_mean_bytes=ep["resident_sum"] / max(1, ep["batches"]),
            resident_peak_bytes=ep["resident_peak"],
            slots_made_bytes=max(0, m.allocated - ep["allocated0"]),
            gets=int(d["gets"]),
            decodes=int(d["decodes"]),
            hits=int(d["hits"] - d["corrupt"]),
            misses=int(d["misses"] + d["corrupt"]),
            re_reads=int(d["re_reads"]),
            in_place=int(d["in_place"]),
            evictions=evictions - ep["evictions0"],
            bytes_fetched=int(d["bytes_fetched"]),
            bytes_delivered=ep["bytes_delivered"],
            transform_s=d["transform_s"],
            transforms=int(d["transforms"]),
            bad_chunks=int(d["bad_chunks"]),
            corrupt=int(d["corrupt"]),
            max_inflight=self.max_inflight,
            decode_threads=self.decode_threads,
            cores=_cores(),
            budget_bytes=int(self.pool.budget_bytes),
            auto_budget=bool(self.pool.auto),
            direct=self.direct,
            batch_transforms=self.batch_transforms,
        )
        if spans is not None and trace is not None:
            loose, packed = spans
            r.trace = EpochTrace(r.epoch, ep["t0"], end, loose, dict(trace.threads), packed)
        r.limiting = limiting_stage(r)
        if r.re_reads and self._split_bytes is not None and r.epoch >= 0:
            r.split_bytes = self._split_bytes(r.epoch)
            if self._budget_floor is not None:
                r.budget_floor = self._budget_floor()
        if self._read_ahead_capped is not None:
            r.read_ahead_capped = self._read_ahead_capped()
        r.suggestion = suggestion_for(r)
        if self._dropped is not None:
            r.dropped = {why: int(n) for why, n in self._dropped().items()}
        return r


class _Mark(NamedTuple):
    """What a report ending at ``end`` counts (:meth:`EpochRecorder._mark`)."""

    end: float
    totals: dict[str, float]
    inflight: tuple[float, float]
    peaks: tuple[int, int]
    evictions: int
    allocated: int  # the pool's slot bytes handed out
    cpu: float
    usage: tuple[float, int]
    trace: TraceMark | None


# the producer thread's seconds each span name stands for
_SPAN_OF = {"admit_s": "admit", "chunk_wait_s": "wait for chunks", "gather_s": "gather"}


def _usage() -> tuple[float, int]:
    """(system CPU seconds, minor page faults) of this process so far."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 0.0, 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


def _thread_usage() -> tuple[int, float, int] | None:
    """(thread id, system CPU seconds, minor page faults) of the calling thread so far, or
    ``None`` where the OS does not count per thread (``RUSAGE_THREAD`` is Linux's): what the
    consumer's own work between two batches took, apart from the pipeline's threads. About
    1 us per call, two calls per batch."""
    if _THREAD_RUSAGE is None:  # pragma: no cover - not Linux
        return None
    getrusage, who = _THREAD_RUSAGE
    usage = getrusage(who)
    return threading.get_ident(), usage.ru_stime, usage.ru_minflt


def _thread_rusage() -> tuple[Callable[[int], Any], int] | None:
    """``(resource.getrusage, resource.RUSAGE_THREAD)``, or ``None`` where there is none."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else (resource.getrusage, who)


_THREAD_RUSAGE = _thread_rusage()


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class NullRecorder(EpochRecorder):
    """The recorder of a pipeline that does not measure (``report=False``): every hook does
    nothing and :meth:`report` is ``None``. Stages call their recorder unconditionally."""

    enabled = False

    def __init__(self) -> None:
        self.batch_transforms = 0
        self.last = None
        self.trace = None
        self.open_epoch = None

    def on_get_start(self) -> float:
        return 0.0

    def on_get_end(
        self,
        started: float,
        nbytes: int,
        ok: bool = True,
        what: tuple[Any, ...] | None = None,
        submitted: float | None = None,
        failed: str | None = None,
    ) -> None:
        pass

    def on_fill_submit(self, objects: int, now: float) -> None:
        pass

    def on_fill_run(self, tally: Any) -> None:
        pass

    def on_object_failed(
        self, what: str, t0: float, t1: float, *, submitted: float, since: float,
        ids: tuple[str, int, tuple[int, ...], int, int], error: str,
    ) -> None:  # fmt: skip
        pass

    def on_admit_counts(self, hits: int, misses: int, re_reads: int, in_place: int = 0) -> None:
        pass

    def on_bad_chunk(self) -> None:
        pass

    def on_corrupt(self) -> None:
        pass

    def add(self, name: str, seconds: float, *, start: float = 0.0, batch: int = -1) -> None:
        pass

    def on_next(self) -> float:
        return 0.0

    def on_deliver(self, called: float, item: Any) -> None:
        pass

    def on_error(self, called: float, error: BaseException) -> None:
        pass

    def on_end(self, called: float) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def finalize(self) -> EpochReport | None:
        return None

    def report(self) -> EpochReport | None:
        return None


NULL_RECORDER = NullRecorder()
"""The one recorder of every pipeline that does not measure."""
