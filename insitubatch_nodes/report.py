"""The epoch report: which stage holds the batches back, and what knob moves it.

Every pipeline built by :func:`~insitubatch_nodes.pipeline.insitu_pipeline` carries an
:class:`EpochRecorder` (``report=False`` turns it off). The stages tell it where their time
went, summed per group of work (a run of a fill job hands over its tallies once), never with a
lock per stored object:

* **store** — each stored-object GET, from its start to the bytes received (on the IO loop), or
  each read of a local store's file (on the decode thread that reads it); the number in flight
  is a time-weighted level (its mean is the summed GET seconds over the wall time) with its
  peak, and the wall time with at least one GET in flight is kept;
* **decode** — each decode, timed on the decode thread that runs it (thread-busy seconds); the
  decode queue depth (objects handed to the decode threads and not finished: waiting, being
  read from a local store, or decoding) is a time-weighted level, its mean the summed seconds
  each object spent so over the wall time. Chunk transforms run on the same threads: their busy
  seconds are ``transform_s`` (not in ``decode_s``);
* **engine** — the engine's own Python work: ``admit_s``, the producer thread's time in the
  fetch stage (pulling plans, pinning chunks, building fill jobs), and ``run_s``, the decode
  threads' time in their runs, of which what is not reading, decoding or transforming is
  bookkeeping (``engine_s`` adds the two parts up);
* **chunk wait** — the producer thread's time waiting for the chunks of a batch to be ready;
* **gather** — the time in the gather stage excluding the wait on its source (batch transforms
  included);
* **hand-off** — the time the consumer waits in ``next()`` for a finished batch;
* **consumer** — the time between ``next()`` returning a batch and the next call;
* ``cpu_s`` — the CPU time of the whole process over the epoch.

Resident pool bytes are sampled at each batch delivery (mean and peak of those samples).
``dropped`` is the read plan's count of the split's anchors dropped for missing steps, per
reason (the same every epoch); the printed report names them when any were dropped.

An epoch follows *delivered* batches: it starts at the first ``next()`` after a reset and is
finalized when the pipeline raises ``StopIteration`` (or at the next reset, if it delivered a
batch). :meth:`EpochRecorder.report` returns the epoch in progress when it has delivered a batch,
else the last finalized one. Each finalized epoch logs one INFO line (its headline) on the
``insitubatch_nodes.report`` logger; nothing is printed unless asked (``print(pipe.report())``).

**The trace** (``FetchOptions(trace=True)``): the report also carries the epoch's spans
(:class:`EpochTrace`), and :meth:`EpochReport.write_trace` writes them as a Chrome-trace JSON
file (the Trace Event Format, which Perfetto, ``chrome://tracing`` and TensorBoard open): one
track per thread, a span per GET (on the IO loop's track, as async spans, since they overlap),
local read, decode, chunk transform, fill run, admission, chunk wait, gather, consumer wait and
stretch of the consumer's own work, each with its array, chunk and batch ids.

**The limiting rule** (:func:`limiting_stage`), over the epoch without its first batch (the
start-up wait is reported separately as the time to first batch):

1. ``consumer`` when the consumer waited for batches less than
   :data:`CONSUMER_WAIT_FRACTION` of the wall time: the pipeline was ahead, a faster one would
   not deliver sooner;
2. otherwise, when the producer thread's own work (gather plus admission) is at least its
   chunk wait, the producer thread is the bottleneck: ``gather`` when the gather took longer
   than the admission, else ``engine``;
3. otherwise the chunks were late. When the time-weighted decode queue depth exceeds the
   time-weighted number of GETs in flight (objects spent more of their fill time waiting for or
   in the decode threads than in the store), the decode threads are the bottleneck — but which
   of their work? ``decode`` when they were busy at least :data:`DECODE_BUSY_FRACTION` of the
   time and reading, decoding and transforming took them at least as long as their bookkeeping;
   ``engine`` when bookkeeping took longer, or when work waited while the threads were not busy
   (they could not run: the engine's Python work elsewhere held the interpreter, or other
   processes held the cores — the suggestion tells which from ``cpu_s``). Else ``store``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from insitubatch_nodes._process import usable_memory_bytes
from insitubatch_nodes.trace import OBJECT_ARGS, SPAN_CATEGORIES, EpochTrace, Span

__all__ = [
    "CONSUMER_WAIT_FRACTION",
    "DECODE_BUSY_FRACTION",
    "FAULT_MIN_BYTES",
    "FAULT_SYS_FRACTION",
    "OBJECT_ARGS",
    "SPAN_CATEGORIES",
    "STAGES",
    "EpochReport",
    "EpochTrace",
    "Span",
    "Stage",
    "limiting_stage",
    "memory_bound",
    "suggestion_for",
]


log = logging.getLogger(__name__)

Stage = Literal["store", "decode", "gather", "engine", "consumer"]
STAGES: tuple[Stage, ...] = ("store", "decode", "gather", "engine", "consumer")

#: The consumer is the limit when it waited for batches less than this share of the wall time.
CONSUMER_WAIT_FRACTION = 0.10
#: Decode threads busy at least this share of the wall time (all of them) are saturated.
DECODE_BUSY_FRACTION = 0.75
#: A budget suggestion is made only when the bytes fit in this share of the machine's RAM.
_BUDGET_RAM_SHARE = 0.5

_now = time.perf_counter


@dataclass
class EpochReport:
    """One epoch of one pipeline, as measured (see the module docstring for each number).

    Times are seconds, sizes bytes. ``complete`` is False for an epoch still in progress.
    """

    epoch: int = 0
    complete: bool = False
    batches: int = 0
    samples: int = 0
    wall_s: float = 0.0
    first_batch_s: float = 0.0
    # where the time went
    handoff_wait_s: float = 0.0  # the consumer waiting in next() (first batch included)
    first_wait_s: float = 0.0  # the part of handoff_wait_s spent on the first batch
    consumer_s: float = 0.0  # the consumer's own time between batches
    get_s: float = 0.0  # summed over GETs: start to bytes received
    get_active_s: float = 0.0  # wall time with at least one GET in flight
    decode_s: float = 0.0  # decode-thread busy seconds
    decode_queued_s: float = 0.0  # summed over decodes: submitted to finished
    chunk_wait_s: float = 0.0  # producer thread waiting for a batch's chunks
    gather_s: float = 0.0  # gather stage, source wait excluded (batch transforms included)
    admit_s: float = 0.0  # producer thread in the fetch stage: plans, pins, fill jobs
    run_s: float = 0.0  # decode threads in runs of fill jobs (reads, decodes, bookkeeping)
    local_read_s: float = 0.0  # the part of get_s read on the decode threads (a local store)
    cpu_s: float = 0.0  # CPU time of the whole process over the epoch
    sys_s: float = 0.0  # the part of it in the kernel (page faults: clearing fresh pages)
    page_faults: int = 0  # minor page faults of the process over the epoch (first touches)
    # the parts of sys_s and page_faults the consumer's thread took in its own work between
    # batches (its training step: not what the pipeline waited on); 0 where not measured
    consumer_sys_s: float = 0.0
    consumer_page_faults: int = 0
    # levels: time-weighted mean and peak
    inflight_mean: float = 0.0
    inflight_peak: int = 0
    decode_depth_mean: float = 0.0
    decode_depth_peak: int = 0
    resident_mean_bytes: float = 0.0  # sampled at each delivery
    resident_peak_bytes: int = 0
    # slot memory the pool's backing handed out over the epoch (its growth): the part of the
    # epoch's fresh memory that is the pool's; the rest is batch buffers and scratch
    slots_made_bytes: int = 0
    # counts
    gets: int = 0  # stored objects asked for: GETs, local reads (a failed one too, no bytes)
    decodes: int = 0  # stored objects decoded (a missing one filled, a failed one too)
    hits: int = 0
    misses: int = 0  # fetched: into slots, or straight into rows (stats() misses + misses_in_place)
    # the misses decoded straight into batch rows (one sample per chunk, the split not kept):
    # no slot, nothing kept for the next epoch (stats() misses_in_place)
    in_place: int = 0
    re_reads: int = 0  # misses on chunks this pipeline fetched before (this or an earlier epoch)
    evictions: int = 0
    bytes_fetched: int = 0
    bytes_delivered: int = 0
    transform_s: float = 0.0  # decode-thread busy seconds in chunk transforms
    transforms: int = 0  # chunks the chunk transforms ran on
    bad_chunks: int = 0  # stored objects filled under on_bad_chunk="nan"
    # chunks whose persistent-cache file failed its content check when revived: fetched again
    # (counted in misses, not hits) and rewritten
    corrupt: int = 0
    # the knobs, for the suggestion
    max_inflight: int = 0
    decode_threads: int = 0
    cores: int = 0
    budget_bytes: int = 0
    auto_budget: bool = True
    direct: bool | None = None  # FetchOptions.direct
    batch_transforms: int = 0  # the batch transforms given (not the static fields and stack
    # constants the pipeline writes into each batch itself)
    split_bytes: int | None = None  # every chunk the epoch read, in bytes (when re-reads > 0)
    # the smallest cache_budget_bytes the pipeline accepts for its views (the working-set floor
    # every epoch of every rank fits: schedule_floors' guaranteed), when re-reads > 0
    budget_floor: int | None = None
    # why a larger block_chunks would read no further ahead, or "": "epoch" - one block holds
    # every chunk of this rank's epoch; "patched" - a patched plan's block is one region of one
    # sample-axis chunk, and the region already holds every tile the windows start in
    read_ahead_capped: str = ""
    limiting: Stage = "consumer"
    suggestion: str = ""
    # anchors of the split the plan dropped for missing steps, per reason (the plan's
    # ``dropped``: the same every epoch); empty without the missing-step checks
    dropped: dict[str, int] = field(default_factory=dict)
    #: the epoch's spans, with ``FetchOptions(trace=True)`` (else ``None``)
    trace: EpochTrace | None = field(default=None, repr=False, compare=False)

    def write_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write this epoch as a Chrome-trace JSON file (module docstring) to ``path`` and
        return it: open it in https://ui.perfetto.dev, ``chrome://tracing`` or TensorBoard.
        Raises ``ValueError`` for a pipeline built without ``FetchOptions(trace=True)``."""
        if self.trace is None:
            raise ValueError(
                "this epoch was not traced: build the pipeline with "
                "fetch=FetchOptions(trace=True) to record its spans"
            )
        return self.trace.write(path)

    def as_dict(self) -> dict[str, Any]:
        """Plain Python (numbers and strings), e.g. for a logger or JSON: every field but the
        trace, and the numbers derived from them (``samples_per_s``, ``wait_fraction``,
        ``decode_busy``, ``overhead_s``, ``engine_s``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        for name in ("samples_per_s", "wait_fraction", "decode_busy", "overhead_s", "engine_s"):
            out[name] = getattr(self, name)
        return out

    def metrics(self) -> dict[str, float]:
        """The headline numbers as floats, for a metrics logger (``limited_by_<stage>`` is 1.0
        for the limiting stage and 0.0 for the others)."""
        out = {
            "samples_per_s": self.samples_per_s,
            "wall_s": self.wall_s,
            "first_batch_s": self.first_batch_s,
            "wait_fraction": self.wait_fraction,
            "get_s": self.get_s,
            "decode_s": self.decode_s,
            "gather_s": self.gather_s,
            "engine_s": self.engine_s,
            "cpu_s": self.cpu_s,
            "consumer_s": self.consumer_s,
            "inflight_mean": self.inflight_mean,
            "decode_depth_mean": self.decode_depth_mean,
            "resident_peak_bytes": float(self.resident_peak_bytes),
            "hits": float(self.hits),
            "misses": float(self.misses),
            "in_place": float(self.in_place),
            "re_reads": float(self.re_reads),
            "bytes_fetched": float(self.bytes_fetched),
            "bytes_delivered": float(self.bytes_delivered),
            "transform_s": self.transform_s,
            "bad_chunks": float(self.bad_chunks),
            "corrupt": float(self.corrupt),
        }
        for stage in STAGES:
            out[f"limited_by_{stage}"] = float(stage == self.limiting)
        return out

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def work_s(self) -> float:
        """Decode-thread seconds reading (a local store), decoding and transforming."""
        return self.local_read_s + self.decode_s + self.transform_s

    @property
    def overhead_s(self) -> float:
        """Decode-thread seconds in runs that were none of :attr:`work_s`: bookkeeping."""
        return max(0.0, self.run_s - self.work_s)

    @property
    def engine_s(self) -> float:
        """The engine's own Python work: admission on the producer thread plus the decode
        threads' bookkeeping."""
        return self.admit_s + self.overhead_s

    @property
    def decode_busy(self) -> float:
        """Share of the wall time the decode threads (all of them) were busy."""
        busy = max(self.run_s, self.work_s)
        return busy / (max(self.wall_s, 1e-9) * max(1, self.decode_threads))

    @property
    def wait_fraction(self) -> float:
        """Share of the wall time the consumer waited for batches after the first one."""
        wall = self.wall_s - self.first_batch_s
        wait = self.handoff_wait_s - self.first_wait_s
        if self.batches <= 1 or wall <= 0:
            return self.handoff_wait_s / self.wall_s if self.wall_s > 0 else 0.0
        return max(0.0, wait) / wall

    def headline(self) -> str:
        """One line: epoch, batches, throughput, first batch, the limit."""
        state = "" if self.complete else " (in progress)"
        return (
            f"epoch {self.epoch}{state}: {self.batches} batches, {self.samples:,} samples in "
            f"{self.wall_s:.2f} s ({self.samples_per_s:,.0f} samples/s), first batch "
            f"{1000 * self.first_batch_s:.0f} ms, consumer waited {100 * self.wait_fraction:.0f}%"
            f" - limited by {self.limiting}"
        )

    def __str__(self) -> str:
        wall = self.wall_s or 1.0
        n = max(1, self.batches)
        threads = max(1, self.decode_threads)
        objects = max(1, self.decodes)
        lines = [
            self.headline(),
            f"  consumer  {1000 * self.consumer_s / n:8.1f} ms/batch of its own work; waited "
            f"{self.handoff_wait_s:.2f} s for batches ({1000 * self.first_wait_s:.0f} ms of it "
            "for the first)"
            + (
                f"; its own work {self.consumer_sys_s:.2f} s in the kernel, "
                f"{self.consumer_page_faults:,} page faults"
                if self.consumer_page_faults
                else ""
            ),
            f"  store     {self.gets:,} GETs, {_size(self.bytes_fetched)} in {self.get_s:.2f} "
            f"GET-s; >=1 in flight {100 * self.get_active_s / wall:.0f}% of the wall; in flight "
            f"mean {self.inflight_mean:.1f}, peak {self.inflight_peak} "
            f"(max_inflight {self.max_inflight})",
            f"  decode    {self.decodes:,} decodes, busy {self.decode_s:.2f} s = "
            f"{100 * self.decode_s / (wall * threads):.0f}% of {threads} thread(s); queue mean "
            f"{self.decode_depth_mean:.1f}, peak {self.decode_depth_peak}; threads busy "
            f"{100 * self.decode_busy:.0f}%, "
            + (
                f"{1e6 * self.overhead_s / objects:.0f} us/object of it bookkeeping"
                if self.decodes
                # nothing decoded (every chunk a pool hit or a persistent-cache file mapped):
                # the runs' time is no per-object cost
                else f"{1000 * self.overhead_s:.1f} ms of it outside decodes (no object decoded)"
            )
            + (
                f"; chunk transforms on {self.transforms:,} chunks, busy {self.transform_s:.2f} s"
                if self.transforms
                else ""
            ),
            f"  producer  waited {self.chunk_wait_s:.2f} s for chunks; gather "
            f"{1000 * self.gather_s / n:.1f} ms/batch; admission {1000 * self.admit_s / n:.1f} "
            f"ms/batch; process CPU {self.cpu_s:.2f} s ({self.sys_s:.2f} s in the kernel, "
            f"{self.page_faults:,} page faults)",
            f"  pool      resident mean {_size(self.resident_mean_bytes)}, peak "
            f"{_size(self.resident_peak_bytes)} (budget {_size(self.budget_bytes)}); "
            f"{self.hits:,} hits, {self.misses:,} misses ({self.re_reads:,} re-reads), "
            f"{self.evictions:,} evictions"
            + (
                f"; {self.in_place:,} of the misses decoded straight into batch rows, not kept"
                if self.in_place
                else ""
            ),
            f"  delivered {_size(self.bytes_delivered)} "
            f"({self.bytes_delivered / wall / 2**20:,.1f} MiB/s)",
        ]
        if self.bad_chunks:
            lines.append(
                f"  bad       {self.bad_chunks:,} stored objects could not be read or decoded "
                "and were filled (on_bad_chunk='nan'; see bad_chunks)"
            )
        if self.corrupt:
            lines.append(
                f"  corrupt   {self.corrupt:,} cached chunk files failed their content check "
                "and were fetched again and rewritten (see the warnings logged)"
            )
        n_dropped = sum(self.dropped.values())
        if n_dropped:
            reasons = ", ".join(f"{n:,} {why}" for why, n in self.dropped.items() if n)
            lines.append(
                f"  dropped   {n_dropped:,} anchors of the split read a missing step and are "
                f"never sampled ({reasons})"
            )
        if self.suggestion:
            lines.append(f"  suggestion: {self.suggestion}")
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def limiting_stage(r: EpochReport) -> Stage:
    """The stage that limits the epoch, by the rule in the module docstring."""
    if r.wait_fraction < CONSUMER_WAIT_FRACTION:
        return "consumer"
    if r.gather_s + r.admit_s >= r.chunk_wait_s:
        return "gather" if r.gather_s >= r.admit_s else "engine"
    if r.decode_depth_mean > r.inflight_mean:
        if r.decode_busy >= DECODE_BUSY_FRACTION and r.work_s >= r.overhead_s:
            return "decode"
        return "engine"
    return "store"


_PAGE = 4096
#: Memory faulting is named when the kernel took at least this share of the wall time...
FAULT_SYS_FRACTION = 0.25
#: ...and the page faults touched at least this many bytes (4 KiB pages).
FAULT_MIN_BYTES = 256 * 2**20


def memory_bound(r: EpochReport) -> bool:
    """Whether the epoch waited on fresh memory being faulted in: the process's kernel time
    is at least :data:`FAULT_SYS_FRACTION` of the wall time and its page faults touched at
    least :data:`FAULT_MIN_BYTES` (what a fresh process's first epoch through a large pool
    does; the kernel clears every new page) — both without the consumer's own share
    (``consumer_sys_s``, ``consumer_page_faults``: a training step that touches fresh memory
    is not the pipeline waiting on it)."""
    sys_s, faults = _pipeline_faults(r)
    return sys_s >= FAULT_SYS_FRACTION * r.wall_s and faults * _PAGE >= FAULT_MIN_BYTES


def _pipeline_faults(r: EpochReport) -> tuple[float, int]:
    """The process's kernel seconds and page faults over the epoch, less the consumer's own."""
    return (
        max(0.0, r.sys_s - r.consumer_sys_s),
        max(0, r.page_faults - r.consumer_page_faults),
    )


def suggestion_for(r: EpochReport) -> str:
    """One suggestion computed from the report's numbers, or ``""`` when none applies.

    * not consumer-limited, and memory faulting took the epoch (:func:`memory_bound`): it says
      so, with the kernel seconds and the fresh memory touched;
    * store- or decode-limited with re-reads, and the bytes of every chunk the epoch read fit
      under half the RAM and above the budget: ``cache_budget_bytes`` of that size, or of the
      working-set floor an explicit budget is checked against where that is more (a rank's
      epoch reads less than that floor): the re-reads become hits. With
      ``FetchOptions(direct=True)`` and rows decoded straight into batches (which no budget
      keeps): leave ``direct`` unset, with that budget where the one given is smaller or
      automatic;
    * store-limited, a store on local disk (its files read on the decode threads): the disk;
      more decode threads for a disk that serves reads in parallel (``max_inflight`` does not
      apply there);
    * store-limited with ``max_inflight`` saturated (the peak reached it): raise it (doubled);
      not saturated: the read-ahead bounds the GETs — raise ``block_chunks``, unless a larger
      block reads no further ahead (``read_ahead_capped``: one block holds the epoch's chunks,
      or patched views' region the whole field), then more samples per chunk;
    * decode-limited: more decode threads while they are fewer than the cores, else more cores
      or a cheaper codec; when the chunk transforms took the threads longer than reading and
      decoding, it names them (their seconds, per chunk) and says to lighten them instead of
      the codec;
    * gather-limited with batch transforms (they run in the gather stage): lighten them or move
      them to the consumer; without, and with decode threads on every core at least half busy:
      the CPU is the limit (more cores). Otherwise the gather is one copy per chunk: no knob;
    * engine-limited by the producer thread's admission (rule 2): its cost per batch, and what
      moves it (fewer, larger chunks per sample); by the decode threads (rule 3): other
      processes holding the CPU when the threads sat idle with work queued and the process
      used under 60 % of the cores, else the engine's work per batch and per stored object.
    """
    stage = r.limiting
    if stage != "consumer" and memory_bound(r):
        sys_s, faults = _pipeline_faults(r)
        fresh = faults * _PAGE
        slots = min(r.slots_made_bytes, fresh)
        said = (
            f"the process spent {sys_s:.2f} s of the epoch's {r.wall_s:.2f} s in the kernel "
            f"and took {faults:,} page faults (~{_size(fresh)} of fresh memory touched) "
            "outside the consumer's own work: this epoch waited on memory being faulted in, "
            "not on the store or the codec; later epochs reuse that memory. "
        )
        if 2 * slots >= fresh:
            return said + (
                f"Most of it ({_size(slots)}) is the pool's slots: a budget near the working "
                "set (the floor cache_budget_bytes errors state) touches less of it"
            )
        return said + (
            f"Most of it is not the pool's ({_size(slots)} of slots): it is the batch buffers "
            "(up to prefetch_depth + 2 batches, made once per process) and decode scratch; a "
            "smaller batch_size touches less of it, a smaller budget would not"
        )
    if stage in ("store", "decode") and r.re_reads and r.split_bytes:
        ram = usable_memory_bytes()  # (a container's limit where one is set)
        # every chunk the epoch read; an explicit budget below the floor is refused
        want = max(r.split_bytes, r.budget_floor or 0)
        what = "every chunk this epoch read" + (
            ""
            if want == r.split_bytes
            else f" ({_size(r.split_bytes)}) raised to the working-set floor an explicit budget "
            "must reach"
        )
        fits = not ram or want <= ram * _BUDGET_RAM_SHARE
        if r.direct is True and r.in_place and fits:  # no budget keeps what direct=True reads
            budget = (
                ""
                if not r.auto_budget and want <= r.budget_bytes
                else f" with cache_budget_bytes={want} ({_size(want)}, {what})"
            )
            return (
                f"{r.re_reads:,} of {r.misses:,} misses re-read chunks fetched before; "
                f"{r.in_place:,} were decoded straight into batch rows, which "
                "FetchOptions(direct=True) does whatever the budget: nothing is kept for the "
                f"next epoch. Leave direct unset (None){budget} to keep them: later epochs "
                "read nothing"
            )
        if want > r.budget_bytes and fits:
            return (
                f"{r.re_reads:,} of {r.misses:,} misses re-read chunks fetched before; "
                f"cache_budget_bytes={want} ({_size(want)}, {what}; budget now "
                f"{_size(r.budget_bytes)}) would make them hits"
            )
    if stage == "store":
        if r.local_read_s > 0.5 * r.get_s:  # a store on local disk, read by the decode threads
            per = 1e6 * r.local_read_s / max(1, r.gets)
            return (
                f"reading the store's files took the decode threads {r.local_read_s:.2f} s "
                f"({per:.0f} us per object; max_inflight does not apply to a local store): the "
                f"disk is the limit. More reads in flight help a disk that serves them in "
                f"parallel: decode_threads={2 * max(1, r.decode_threads)}; else faster storage "
                "or a warm page cache"
            )
        if r.inflight_peak >= r.max_inflight:
            return (
                f"GETs in flight reached max_inflight={r.max_inflight} (mean "
                f"{r.inflight_mean:.1f}); raise it, e.g. max_inflight={2 * r.max_inflight}"
            )
        if r.read_ahead_capped:
            why = (
                "patched views read ahead one region of tiles of one sample-axis chunk, and the "
                "region already holds every tile of the field"
                if r.read_ahead_capped == "patched"
                else "one block already holds every chunk of the epoch"
            )
            return (
                f"GETs in flight peaked at {r.inflight_peak} < max_inflight={r.max_inflight}: "
                f"{why}, so a larger block_chunks reads no further ahead: the epoch waits on "
                "each GET's latency. A store with more samples per chunk (fewer, larger GETs) "
                "moves it"
            )
        return (
            f"GETs in flight peaked at {r.inflight_peak} < max_inflight={r.max_inflight}: the "
            "read-ahead (one block of chunks) bounds them; raise block_chunks"
        )
    if stage == "engine":
        return _engine_suggestion(r)
    if stage == "decode":
        if r.transform_s > r.decode_s + r.local_read_s:  # the chunk transforms held them
            what = (
                f"decode threads busy {100 * r.decode_busy:.0f}% of {r.decode_threads} "
                f"thread(s), mostly in the chunk transforms ({r.transform_s:.2f} s on "
                f"{r.transforms:,} chunks, {1000 * r.transform_s / max(1, r.transforms):.1f} ms "
                f"each; decoding {r.decode_s:.2f} s)"
            )
            if r.decode_threads < r.cores:
                return (
                    f"{what}: lighten them, or raise decode_threads, e.g. decode_threads={r.cores}"
                )
            return f"{what} on all {r.cores} cores: lighten them, or more cores"
        busy = r.decode_s / (max(r.wall_s, 1e-9) * max(1, r.decode_threads))
        if r.decode_threads < r.cores:
            return (
                f"decode threads busy {100 * busy:.0f}% of {r.decode_threads} thread(s) with "
                f"{r.cores} cores: raise decode_threads, e.g. decode_threads={r.cores}"
            )
        return (
            f"decode is busy {100 * busy:.0f}% of {r.decode_threads} thread(s) = all "
            f"{r.cores} cores: more cores, or a cheaper codec for the store"
        )
    if stage == "gather":
        per = 1000 * r.gather_s / max(1, r.batches)
        if r.batch_transforms:
            return (
                f"gather takes {per:.1f} ms/batch on the producer thread (batch_transforms run "
                "there): lighten the transforms or move them to the consumer"
            )
        busy = r.decode_s / (max(r.wall_s, 1e-9) * max(1, r.decode_threads))
        if r.decode_threads >= r.cores and busy >= 0.5:
            return (
                f"gather ({per:.1f} ms/batch) shares {r.cores} cores with {r.decode_threads} "
                f"decode threads busy {100 * busy:.0f}%: the CPU is the limit; more cores would "
                "speed both"
            )
    return ""


def _engine_suggestion(r: EpochReport) -> str:
    """What helps when the engine's own work, or a CPU it cannot get, is the limit: the
    producer thread's admission (rule 2; the decode threads are not what the batches waited
    on), else the decode threads' bookkeeping or a CPU they could not get (rule 3)."""
    if r.gather_s + r.admit_s >= r.chunk_wait_s:
        return (
            f"the producer thread's admission ({1000 * r.admit_s / max(1, r.batches):.1f} "
            f"ms/batch: pulling plans, pinning chunks, building fill jobs) took longer than the "
            f"gather ({1000 * r.gather_s / max(1, r.batches):.1f} ms/batch) and than its wait "
            f"for chunks ({r.chunk_wait_s:.2f} s): it grows with the chunks and stored objects "
            "each batch reads; fewer, larger ones per sample (a store with more samples per "
            "chunk, or fewer arrays) move it; more decode threads or GETs in flight do not"
        )
    wall = max(r.wall_s, 1e-9)
    cores = max(1, r.cores)
    per_object = 1e6 * r.engine_s / max(1, r.decodes)
    used = r.cpu_s / (wall * cores)
    if r.decode_busy < DECODE_BUSY_FRACTION and r.cpu_s and used < 0.6:
        return (
            f"decode threads were busy {100 * r.decode_busy:.0f}% with "
            f"{r.decode_depth_mean:.0f} objects queued on average, while this process used "
            f"{100 * used:.0f}% of {cores} cores: other processes hold the CPU; free cores "
            "for this one"
        )
    return (
        f"the engine's own Python work ({1000 * r.engine_s / max(1, r.batches):.1f} ms/batch, "
        f"{per_object:.0f} us per stored object) holds the interpreter lock the decode threads "
        "need: fewer, larger stored objects per sample (a store with more samples per chunk, "
        "or fewer arrays) are what move it; more decode threads do not"
    )
