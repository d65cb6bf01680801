"""The spans of an epoch's trace: recorded while it runs, named when it is read.

With ``FetchOptions(trace=True)`` the stages record one span per GET, local read, decode, chunk
transform and fill run (on the thread that ran it), per admission, chunk wait and gather (the
producer thread) and per hand-off wait and stretch of the consumer's own work (the consumer's
thread). The recorder (:mod:`~insitubatch_nodes.recorder`) keeps them in a :class:`TraceLog`
and hands them, with the epoch's report, to an :class:`EpochTrace`, which names them and writes
them as Chrome-trace JSON.

**Recording costs no lasting container.** A stored object's spans — one or two per object, a
million an epoch on a large archive — are packed as numbers into one flat list per run
(:class:`PackedSpans`): recording one makes no tuple or dict that outlives the call. Tuples
kept per span woke the cyclic garbage collector as they piled up: measured on a 13-array store
(3,328 stored objects an epoch, ~0.2 s), 15 young and one middle collection an epoch, 2.2 ms
median and up to 58 ms; packed, the one young collection an untraced epoch has. Recording a
stored object's read and decode costs ~0.13 µs, handing a run's over ~0.02 µs per object (was
~0.4 and ~0.25). The few spans of each batch and run (admission, gather, fill run, consumer),
and those of the rare reads and decodes that failed (their ``args`` name the error), stay
tuples. :attr:`EpochTrace.spans` unpacks everything into :data:`Span` tuples when first read,
off the epoch's path.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from insitubatch_nodes._atomic import atomic_write

__all__ = [
    "OBJECT_ARGS",
    "SPAN_CATEGORIES",
    "EpochTrace",
    "PackedSpans",
    "Span",
    "TraceLog",
]

Span = tuple[str, float, float, int, Any]
"""One span of a trace: ``(name, start, end, thread id, args)``, times from
``time.perf_counter``; ``args`` is a dict, ``None``, or the ids of a stored object as a tuple in
the order of :data:`OBJECT_ARGS`."""

#: The names of a stored object's ids when a span holds them as a tuple (``row``: ``-1`` when
#: not decoded in place; ``missing``: present, 1, for a missing object filled with the fill
#: value).
OBJECT_ARGS = ("array", "chunk", "tile", "batch", "row", "missing")

#: Every span name a trace holds, and the category (the stage) it is filed under.
SPAN_CATEGORIES: dict[str, str] = {
    "GET": "store",
    "read": "store",
    "decode": "decode",
    "transform": "decode",
    "fill run": "decode",
    "admit": "engine",
    "wait for chunks": "producer",
    "gather": "gather",
    "next": "consumer",
    "consumer": "consumer",
}
_ASYNC = frozenset({"GET"})  # overlapping on one thread (the IO loop): async spans


#: The kinds of a :class:`PackedSpans` record.
READ, DECODE, READ_DECODE, MISSING, TRANSFORM, GET = range(6)


class PackedSpans:
    """Spans of stored objects, packed (module docstring): eight numbers per record in one flat
    list, :attr:`records` — kind, ref, chunk, row, extra and three times ``t0``, ``t1``, ``t2``
    (from ``time.perf_counter``). Numbers are not tracked by the garbage collector; appending
    them to a list makes no container. ``ref`` indexes :attr:`refs`, the ``(array path, tile)``
    pairs seen. The kinds:

    * :data:`READ` — a local read, ``t0`` to ``t1``;
    * :data:`DECODE` — a decode, ``t1`` to ``t2``;
    * :data:`READ_DECODE` — both, one after the other (two spans);
    * :data:`MISSING` — a missing object filled with the fill value, ``t1`` to ``t2``;
    * :data:`TRANSFORM` — a chunk transform, ``t1`` to ``t2``;
    * :data:`GET` — a GET, ``t0`` to ``t1``; its row is its batch, its extra its bytes, and
      its key the next of :attr:`keys`; one that failed has its error's name in
      :attr:`errors` (by record number).

    One buffer belongs to one thread while it records (a decode thread's run, or the IO loop's
    GETs); ``batch`` is the batch of a run's spans.
    """

    __slots__ = ("_ref_of", "batch", "errors", "keys", "records", "refs")

    def __init__(self, batch: int = -1) -> None:
        self.batch = batch
        self.records: list[float] = []
        self.refs: list[tuple[str, tuple[int, ...]]] = []
        self.keys: list[str] = []
        #: record number -> the name of the error a failed GET raised (few: kept aside)
        self.errors: dict[int, str] = {}
        self._ref_of: dict[tuple[str, tuple[int, ...]], int] = {}

    def __len__(self) -> int:
        return len(self.records) // 8

    def ref(self, path: str, tile: tuple[int, ...] = ()) -> int:
        """The index of ``(path, tile)`` in :attr:`refs` (added on first use)."""
        key = (path, tile)
        ref = self._ref_of.get(key)
        if ref is None:
            ref = self._ref_of[key] = len(self.refs)
            self.refs.append(key)
        return ref

    def add(
        self, kind: int, t0: float, t1: float, t2: float, ref: int, chunk: int, row: int = -1,
        extra: int = 0,
    ) -> None:  # fmt: skip
        """Record one record (the class docstring)."""
        self.records.extend((kind, ref, chunk, row, extra, t0, t1, t2))

    def copy(self) -> PackedSpans:
        """A snapshot (for the report of an epoch in progress)."""
        out = PackedSpans(self.batch)
        out.records, out.refs, out.keys = list(self.records), list(self.refs), list(self.keys)
        out.errors = dict(self.errors)
        return out

    def spans(self, tid: int) -> Iterator[Span]:
        """The records as :data:`Span` tuples of thread ``tid``."""
        records, refs, batch = self.records, self.refs, self.batch
        keys = iter(self.keys)
        for i in range(0, len(records), 8):
            kind, ref, chunk, row, extra, t0, t1, t2 = records[i : i + 8]
            kind, chunk, row = int(kind), int(chunk), int(row)
            path, tile = refs[int(ref)]
            if kind == GET:
                args = {"array": path, "chunk": chunk, "tile": list(tile), "key": next(keys),
                        "bytes": int(extra), "batch": row}  # fmt: skip
                failed = self.errors.get(i // 8)
                if failed is not None:
                    args["error"] = failed
                yield ("GET", t0, t1, tid, args)
                continue
            ids = (path, chunk, tile, batch, row)
            if kind in (READ, READ_DECODE):
                yield ("read", t0, t1, tid, ids)
            if kind in (DECODE, READ_DECODE):
                yield ("decode", t1, t2, tid, ids)
            elif kind == MISSING:
                yield ("decode", t1, t2, tid, (*ids, 1))
            elif kind == TRANSFORM:
                yield ("transform", t1, t2, tid, ids)


TraceMark = tuple[int, int, dict[int, tuple[int, int]]]
"""How far a :class:`TraceLog` had got (:meth:`TraceLog.mark`): its loose spans, its finished
runs, and per GET thread its records and keys."""


class TraceLog:
    """The spans of the epoch in progress: :attr:`spans`, tuples appended from any thread (a
    list's ``append`` and ``extend`` are atomic); :attr:`packed`, the stored objects' spans of
    each finished run as ``(thread id, PackedSpans)``; the GETs', one buffer per thread that
    made them (recorded under the recorder's lock). Taken by the recorder when the epoch is
    reported. ``threads`` names each thread id seen."""

    __slots__ = ("gets", "packed", "spans", "threads")

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.packed: list[tuple[int, PackedSpans]] = []
        self.gets: dict[int, PackedSpans] = {}
        self.threads: dict[int, str] = {}

    def thread(self) -> int:
        """The calling thread's id (the kernel's, as trace viewers show it), named once."""
        tid = threading.get_native_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        return tid

    def span(self, name: str, t0: float, t1: float, args: dict[str, Any] | None = None) -> None:
        """A span of the calling thread, ``t0`` to ``t1`` (``time.perf_counter``)."""
        self.spans.append((name, t0, t1, self.thread(), args))

    def failed(self, name: str, t0: float, t1: float, ids: tuple[Any, ...], error: str) -> None:
        """A stored object's ``name`` (``"read"`` or ``"decode"``) that raised ``error`` (its
        name), ``t0`` to ``t1``: a loose span of the calling thread, its ``args`` the object's
        ``ids`` (named as :data:`OBJECT_ARGS` orders them) and the error."""
        self.span(name, t0, t1, {**_named(ids), "error": error})

    def get(
        self, t0: float, t1: float, path: str, chunk: int, tile: tuple[int, ...], key: str,
        nbytes: int, batch: int, failed: str | None = None,
    ) -> None:  # fmt: skip
        """A GET of the calling thread (one thread at a time: the recorder's lock); ``failed``:
        the name of the error it raised."""
        tid = self.thread()
        buf = self.gets.get(tid)
        if buf is None:
            buf = self.gets[tid] = PackedSpans()
        if failed is not None:
            buf.errors[len(buf)] = failed
        buf.add(GET, t0, t1, t1, buf.ref(path, tile), chunk, batch, nbytes)
        buf.keys.append(key)

    def mark(self) -> TraceMark:
        """How far the log has got (under the recorder's lock: no GET is being added)."""
        gets = {tid: (len(buf.records), len(buf.keys)) for tid, buf in self.gets.items()}
        return len(self.spans), len(self.packed), gets

    def take(
        self, keep: bool = False, upto: TraceMark | None = None
    ) -> tuple[list[Span], list[tuple[int, PackedSpans]]]:
        """The spans so far, as :class:`EpochTrace` takes them; forgotten unless ``keep``
        (then copies, for an epoch still in progress). With ``upto`` (a :meth:`mark`), only
        those recorded before that mark; everything is forgotten. Forgetting everything (the
        recorder does so when an epoch opens) also forgets the names of threads that have
        ended: each epoch's producer is a new thread, and the names of all of them were kept
        (and copied into every report) for the rest of the run."""
        if upto is not None:
            n_spans, n_packed, n_gets = upto
            spans, packed, by_thread = self.spans, self.packed, self.gets
            self.spans, self.packed, self.gets = [], [], {}
            cut: list[tuple[int, PackedSpans]] = []
            for tid, (n_records, n_keys) in n_gets.items():
                buf, part = by_thread[tid], PackedSpans()
                part.records, part.refs = buf.records[:n_records], buf.refs
                part.keys, part.errors = buf.keys[:n_keys], buf.errors
                cut.append((tid, part))
            return spans[:n_spans], [*packed[:n_packed], *cut]
        if keep:
            gets = [(tid, buf.copy()) for tid, buf in self.gets.items()]
            return list(self.spans), [*self.packed, *gets]
        spans, self.spans = self.spans, []
        packed, self.packed = self.packed, []
        packed.extend(self.gets.items())
        self.gets = {}
        alive = {t.native_id for t in threading.enumerate()}
        for tid in list(self.threads):  # (an ended thread adds no span again; a new thread
            if tid not in alive:  # given its id is named anew)
                self.threads.pop(tid, None)
        return spans, packed


@dataclass(frozen=True, eq=False)
class EpochTrace:
    """The spans of one epoch (see the module docstring), from ``t0`` (its first ``next()``)
    to ``t1``; ``threads`` names each thread id. ``loose`` and ``packed`` are the spans as
    recorded; :attr:`spans` has them all as :data:`Span` tuples."""

    epoch: int
    t0: float
    t1: float
    loose: list[Span] = field(repr=False)
    threads: dict[int, str] = field(default_factory=dict)
    packed: list[tuple[int, PackedSpans]] = field(default_factory=list, repr=False)

    @cached_property
    def spans(self) -> list[Span]:
        """Every span of the epoch, unpacked on first use (unordered)."""
        out = list(self.loose)
        for tid, buf in self.packed:
            out.extend(buf.spans(tid))
        return out

    def counts(self) -> dict[str, int]:
        """Spans per name."""
        out: dict[str, int] = {}
        for span in self.spans:
            out[span[0]] = out.get(span[0], 0) + 1
        return out

    def chrome(self) -> dict[str, Any]:
        """The trace as Chrome's Trace Event Format (a JSON-able dict): complete events
        (``"ph": "X"``) per thread, GETs as async begin/end pairs, times in microseconds from
        the epoch's first ``next()``, thread names as metadata events."""
        pid = os.getpid()
        t0 = self.t0
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
             "args": {"name": f"insitubatch_nodes epoch {self.epoch}"}},
        ]  # fmt: skip
        used = {span[3] for span in self.spans}
        for tid, name in sorted(self.threads.items()):
            if tid not in used:  # a thread of an earlier epoch
                continue
            events.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
        spans = sorted(self.spans, key=lambda s: (s[1], -s[2]))  # parents before children
        for i, (name, start, end, tid, args) in enumerate(spans):
            ts = round((start - t0) * 1e6, 3)
            cat = SPAN_CATEGORIES.get(name, "engine")
            common = {"name": name, "cat": cat, "pid": pid, "tid": tid, "args": _named(args)}
            if name in _ASYNC:
                events.append({**common, "ph": "b", "ts": ts, "id": i})
                events.append({**common, "ph": "e", "ts": round((end - t0) * 1e6, 3), "id": i})
            else:
                events.append({**common, "ph": "X", "ts": ts, "dur": round((end - start) * 1e6, 3)})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`chrome` as JSON to ``path``; returns the path. The file appears whole
        or not at all: it is written next to ``path`` under a temporary name and renamed over
        it, so an interrupted write (Ctrl-C, a full disk) leaves any earlier file at ``path``
        as it was, and no partial one."""
        with atomic_write(path) as f:
            json.dump(self.chrome(), f)
        return Path(path)


def _named(args: Any) -> dict[str, Any]:
    """A span's ``args`` as the trace's dict (a stored object's tuple named, see
    :data:`OBJECT_ARGS`)."""
    if not isinstance(args, tuple):
        return args or {}
    out = dict(zip(OBJECT_ARGS, args, strict=False))
    out["tile"] = list(out["tile"])
    if out["row"] < 0:
        del out["row"]
    return out
