"""The fetch stage's fill machinery: stored objects read, decoded and landed in groups.

A :class:`FillJob` is the work one admission of the fetch stage starts: the stored objects of
the chunks one batch is the first to read. Some land in pool slots (chunks other batches read
too); at one sample per chunk, an object whose only reader is one row of this batch lands
straight in that row of the batch's arrays (see :mod:`~insitubatch_nodes.stages.fetch`). Everything
per job is done once, not once per object: one admission, one :class:`~insitubatch_nodes.
residency.Fill` that every entry of the job joins (one wake-up for the batch that waits on
it), one priority ticket, one submission to the decode threads.

**Decode threads take runs.** A job's objects wait in its own queue; up to one *run* per decode
thread takes them one after the other — for a store on local disk each object is read on the
run's thread (:mod:`~insitubatch_nodes.io.localfiles`) and decoded in place at once — with no
round trip through the event loop between objects. A run gives its thread up between two
objects when a job of a sooner ticket (an earlier batch) is waiting, and carries on later.

**GETs on the loop.** For any other store a :class:`~insitubatch_nodes.stages._get.GetQueue` (which
the runner owns, and which hands each object back through a callback) on the process's IO loop
keeps at most ``max_inflight`` objects *in flight* — from the GET's start until its bytes are
decoded, as before — taking objects in ticket order; a GET that lands queues its bytes on its job
and starts a run there if none is running (the objects of a chunk that a transform reshapes
queue together, once its last has landed: :func:`~insitubatch_nodes.stages._spares.
land_together`). A decode thread that frees a permit wakes the loop only
when the loop ran out of permits (at most once per such stall), not once per object.

**Resolution.** An entry resolves once every stored object of it has been handled: ready (after its
chunk transforms and, for a cache file, its checksum) or failed (the first error of its objects, or
:class:`~insitubatch_nodes.pool.FillCancelled` when it lost its last pin before all its objects
landed; a fill that completes anyway keeps its chunk). A job resolves its own member of the fill
once every object is handled; direct rows that failed set :attr:`FillJob.error`, which the batch
re-raises; a stored object that cannot be read or decoded is counted, and fills or fails, as
:mod:`~insitubatch_nodes.stages._bad` says.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes._frames import drop_frame_locals
from insitubatch_nodes._runtime import PriorityPool
from insitubatch_nodes.cache.identity import IdentityRecorder, stat_identity
from insitubatch_nodes.errors import ChunkReadError, FillCancelled
from insitubatch_nodes.io.localfiles import LocalReader
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import EpochRecorder
from insitubatch_nodes.slots import PENDING, ChunkEntry
from insitubatch_nodes.stages._bad import BadChunks, NoteBad
from insitubatch_nodes.stages._get import GetQueue
from insitubatch_nodes.stages._jobs import (
    REVIVE,
    SMALL_OBJECT_S,
    ArrayFill,
    FillJob,
    Queued,
    Rows,
    Unit,
)
from insitubatch_nodes.stages._ranges import profile_range
from insitubatch_nodes.stages._spares import (
    SpareBuffers,
    SpareRegion,
    SpareView,
    as_array,
    land_together,
)
from insitubatch_nodes.trace import DECODE, MISSING, READ, READ_DECODE, TRANSFORM, PackedSpans
from insitubatch_nodes.transforms import ChunkTransforms

__all__ = ["FillRunner"]

_now = time.perf_counter


class FillRunner:
    """Runs :class:`FillJob` s for one fetch stage (module docstring).

    ``reader`` reads a local store on the decode threads; else ``get`` (an async GET, see
    :func:`~insitubatch_nodes.io.objects.make_async_getter`) runs on ``loop`` through this
    runner's own :class:`~insitubatch_nodes.stages._get.GetQueue`, at most ``max_inflight``
    objects at once. Bad stored objects are reported to ``note_bad``; ``recorder`` is the epoch
    report's (or the null one).
    """

    def __init__(
        self,
        *,
        pool: ChunkPool,
        decode_pool: PriorityPool,
        reader: LocalReader | None,
        get: Callable[..., Any] | None,
        loop: asyncio.AbstractEventLoop,
        max_inflight: int,
        transforms: ChunkTransforms,
        on_bad_chunk: str,
        store_name: str,
        note_bad: NoteBad,
        recorder: EpochRecorder,
    ) -> None:
        self.pool = pool
        self.decode_pool = decode_pool
        self.reader = reader
        self.transforms = transforms
        self.bad = BadChunks(
            on_bad_chunk, pool, getattr(get, "served", None),
            note_bad=note_bad, recorder=recorder, store_name=store_name,
        )  # fmt: skip
        self.store_name = store_name
        self.recorder = recorder
        self.gets: GetQueue | None = None
        if reader is None and get is not None:
            self.gets = GetQueue(
                get,
                loop,
                max_inflight,
                store_name,
                pool=pool,
                recorder=recorder,
                land=functools.partial(land_together, self.land_many, max_inflight),
            )
        self.threads = len(decode_pool.threads)
        self.spares = SpareBuffers(max_idle=max(2, self.threads))
        self._work_per_object = 1.0  # seconds; large until runs have measured it

    # -- submission (producer thread) ----------------------------------------------------------
    def submit(self, job: FillJob) -> None:
        """Start ``job`` (its units and rows are final). An empty job resolves at once."""
        units, job.units = job.units, []
        rows, job.rows = job.rows, []
        job.left = len(units) + sum(r.objects for r in rows)
        job.submitted = _now()
        if not job.left:
            self._job_done(job)
            return
        revive = [u for u in units if u.tile is REVIVE]
        if self.gets is None:
            if self.reader is not None and self.reader.cold:
                keys = [u.array.key(u.chunk, u.tile) for u in units if u.tile is not REVIVE]
                self.reader.advise_many([*keys, *(k for r in rows for k in r.store_keys())])
            items = [Queued(u) for u in units]
            items.extend(Queued(r) for r in rows)
            self.land_many(job, items, job.left)
            return
        if revive:  # cache files are mapped on the decode threads, never GET
            self.land_many(job, [Queued(u) for u in revive])
        fetch = [u for u in units if u.tile is not REVIVE]
        # GETs land rows in their batch arrays from the event loop: take those here (a take may
        # wait for a buffer the reserve is making; the loop must never wait)
        for r in rows:
            r.lent.arrays()  # (taken once: the rest find them)
        if fetch or rows:
            self.gets.enqueue(job, fetch, rows)

    def land_many(
        self,
        job: FillJob,
        items: Sequence[Queued],
        objects: int | None = None,
    ) -> None:
        """Queue items (``objects`` stored objects; one each by default) on ``job`` for the
        decode threads (any thread); start runs while fewer than one per decode thread run."""
        rec = self.recorder
        rec.on_fill_submit(len(items) if objects is None else objects, _now())
        starts = 0
        # objects too small to be worth a second thread: the interpreter lock would be passed
        # between the threads at every system call instead (measured: two threads opening
        # missing files run slower than one)
        limit = 1 if self._work_per_object < SMALL_OBJECT_S else self.threads
        with job.lock:
            job.todo.extend(items)
            while job.runs < limit and job.runs < len(job.todo):
                job.runs += 1
                starts += 1
        for _ in range(starts):
            self.decode_pool.submit(job.ticket, self._run, job)

    # -- runs (decode threads) -----------------------------------------------------------------
    def _run(self, job: FillJob) -> None:
        acc = _Tally(job.submitted)
        if self.recorder.trace is not None:  # a trace: this run's spans (the recorder's doc)
            acc.spans, acc.packed = [], PackedSpans(job.batch)
        t0 = _now()
        pool = self.decode_pool
        local = self.reader is not None
        if local:  # a local store's reads in flight: one per running run
            self.pool.note_io(inflight=1)
        span = profile_range("insitu.fill_run")
        span.__enter__()
        try:
            while True:
                with job.lock:
                    if not job.todo:
                        job.runs -= 1
                        return
                    item = job.todo.popleft()
                self._handle(job, item, acc)
                # (an error's traceback keeps this frame, which runs on: never the last item,
                # whose slot may map a cache file that a close waits for)
                del item
                if job.todo and pool.preempted(job.ticket) and not _mid_chunk(job):
                    pool.submit(job.ticket, self._run, job)  # carry on after sooner work
                    return
        finally:
            span.__exit__(None, None, None)
            end = _now()
            acc.run_s = end - t0
            if acc.spans is not None:
                acc.spans.append(
                    ("fill run", t0, end, {"batch": job.batch, "objects": acc.handled})
                )
            if acc.handled:  # what one object costs the decode threads, lately
                work = (acc.read_s + acc.decode_s) / acc.handled
                self._work_per_object += 0.25 * (work - self._work_per_object)
            self._note_reads(acc, -1 if local else 0)
            rec = self.recorder
            rec.on_fill_run(acc)
            # their tracebacks keep this thread's frames: no slot may outlive the run (_frames)
            for error in _RUN.__dict__.pop("errors", ()):
                drop_frame_locals(error)
            del job, acc

    def _handle(self, job: FillJob, item: Queued, acc: _Tally) -> None:
        unit, landed, raw, error, permit = item
        if isinstance(unit, Rows):
            self._fill_rows(job, unit, acc)
            return
        acc.handled += 1
        try:
            self._fill_one(job, unit, landed, raw, error, acc)
        except BaseException as exc:  # a bug here must fail the batch, never leave it waiting
            self._failed(job, unit, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            if permit and self.gets is not None:
                self.gets.release()

    def _fill_rows(self, job: FillJob, rows: Rows, acc: _Tally) -> None:
        """Read and decode every stored object of ``rows`` into its batch row (a local store),
        in one loop with no Python object made per stored object."""
        array, out = rows.array, rows.out
        acc.handled += rows.objects
        try:
            if array.whole and (array.row_key is not None or array.member_key is not None):
                self._fill_whole_rows(job, rows, acc)
                return
            decode = array.decoder.decode_trusted
            packed = acc.packed
            for chunk, r in zip(rows.chunks, rows.rows, strict=True):
                if job.cancelled or job.error is not None:
                    break  # the batch is abandoned, or failed already: nobody needs the rest
                row = out[r : r + 1]
                for tile, box in array.tiles:
                    dest = row[box]
                    key = array.key(chunk, tile)
                    try:
                        raw = self._read(job, array, chunk, tile, key, acc, r)
                        if raw is None and array.listed:
                            raise array.gone_error(chunk, tile, key, self.store_name)
                    except Exception as exc:  # a ChunkReadError (else: the decode's, as ever)
                        error = self.bad.decode_error(array, chunk, tile, key, exc)
                        self._bad(job, Unit(array, chunk, tile, dest, None, r), error)
                        continue
                    t1 = _now()
                    try:
                        decode(raw, dest, chunk, tile)
                    except Exception as exc:
                        unit = Unit(array, chunk, tile, dest, None, r)
                        self._decode_failed(job, unit, key, exc, t1)
                        continue
                    t2 = _now()
                    acc.decodes += 1
                    acc.decode_s += t2 - t1
                    acc.queued_s += t2 - job.submitted
                    if packed is not None:
                        kind = DECODE if raw is not None else MISSING
                        packed.add(kind, t1, t1, t2, packed.ref(array.path, tile), chunk, r)
        except BaseException as exc:  # a bug here must fail the batch, never leave it waiting
            if job.error is None:
                job.error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            self._objects_done(job, rows.objects, acc)

    def _fill_whole_rows(self, job: FillJob, rows: Rows, acc: _Tally) -> None:
        """:meth:`_fill_rows` for an array stored one object per chunk (no tiles): the lean
        loop sixty arrays a sample go through. Missing objects are filled together."""
        array, out = rows.array, rows.out
        assert self.reader is not None
        read, decode = self.reader.read, array.decoder.decode_trusted
        before, after = array.row_key or ("", "")
        member_key = array.member_key  # a collection's: the key is its member's
        tile = array.tiles[0][0]
        missing: list[int] = []  # rows, and their chunks (for the trace)
        missing_chunks: list[int] = []
        reads = nbytes = decodes = 0
        read_s = decode_s = queued_s = 0.0
        submitted = job.submitted
        packed = acc.packed
        ref = -1 if packed is None else packed.ref(array.path, tile)
        probe = array.missing  # after a missing object, ask whether the next one exists
        for chunk, r in zip(rows.chunks, rows.rows, strict=True):
            if job.cancelled or job.error is not None:
                break  # the batch is abandoned, or failed already: nobody needs the rest
            key = before + str(chunk) + after if member_key is None else member_key(chunk)
            t0 = _now()
            try:
                raw = read(key, None, probe)
            except Exception as exc:  # (an OSError; a MemoryError for an object too large)
                error = array.read_error(chunk, tile, key, "read", self.store_name)
                error.__cause__ = exc
                self.bad.count(job, error, r, t0, _now())
                self._bad(job, Unit(array, chunk, tile, out[r : r + 1], None, r), error)
                continue
            t1 = _now()
            reads += 1
            read_s += t1 - t0
            if raw is None:
                if packed is not None:
                    packed.add(READ, t0, t1, t1, ref, chunk, r)
                if array.listed:
                    error = array.gone_error(chunk, tile, key, self.store_name)
                    self._bad(job, Unit(array, chunk, tile, out[r : r + 1], None, r), error)
                    continue
                missing.append(r)
                missing_chunks.append(chunk)
                probe = True
                continue
            probe = False
            nbytes += len(raw)
            try:
                decode(raw, out[r : r + 1], chunk, tile)
            except Exception as exc:
                if packed is not None:
                    packed.add(READ, t0, t1, t1, ref, chunk, r)
                unit = Unit(array, chunk, tile, out[r : r + 1], None, r)
                self._decode_failed(job, unit, key, exc, t1)
                continue
            t2 = _now()
            decodes += 1
            decode_s += t2 - t1
            queued_s += t2 - submitted
            if packed is not None:
                packed.add(READ_DECODE, t0, t1, t2, ref, chunk, r)
        array.missing = probe
        if missing:  # what zarr reads for a missing object: the fill value, in one go
            t1 = _now()
            out[missing] = array.decoder.fill_value
            decodes += len(missing)
            if packed is not None:
                t2 = _now()
                for r, chunk in zip(missing, missing_chunks, strict=True):
                    packed.add(MISSING, t1, t1, t2, ref, chunk, r)
        acc.reads += reads
        acc.read_bytes += nbytes
        acc.read_s += read_s
        acc.decodes += decodes
        acc.decode_s += decode_s
        acc.queued_s += queued_s

    def _note_reads(self, acc: _Tally | None, inflight: int = 0) -> None:
        """Count the reads ``acc`` made since it last did in the pool's stats (and ``inflight``
        more or fewer reads in flight), before their units are reported done: the end of a job
        lets its batch, and maybe the epoch, finish, and the epoch's ``stats()`` must already
        count every read it made."""
        if acc is not None and (acc.reads != acc.noted_reads or inflight):
            self.pool.note_io(
                acc.reads - acc.noted_reads, acc.read_bytes - acc.noted_bytes, inflight
            )
            acc.noted_reads, acc.noted_bytes = acc.reads, acc.read_bytes

    def _objects_done(self, job: FillJob, n: int, acc: _Tally | None = None) -> None:
        self._note_reads(acc)
        with job.lock:
            job.left -= n
            finish = job.left == 0
        if finish:
            self._job_done(job)

    def _fill_one(
        self,
        job: FillJob,
        unit: Unit,
        landed: float,
        raw: Any,
        error: BaseException | None,
        acc: _Tally,
    ) -> None:
        array, chunk, tile, out, entry, row = unit
        if isinstance(error, FillCancelled) or job.skips(unit):
            self._skip(job, unit)
            return
        if error is not None and not isinstance(error, ChunkReadError):
            raise error  # the machinery failed, not the store
        if tile is REVIVE:
            self._revive(job, unit, acc)
            return
        key = array.key(chunk, tile)
        if error is None:
            try:
                if not landed:
                    raw = self._read(job, array, chunk, tile, key, acc, row)
                if raw is None and array.listed:
                    raise array.gone_error(chunk, tile, key, self.store_name)
            except Exception as exc:  # a ChunkReadError (else: the decode's, as ever)
                error = self.bad.decode_error(array, chunk, tile, key, exc)
        if error is None:
            t1 = _now()
            try:
                array.decoder.decode_trusted(raw, as_array(out), chunk, tile)
            except Exception as exc:
                self._decode_failed(job, unit, key, exc, t1, landed)
            else:
                t2 = _now()
                acc.decodes += 1
                acc.decode_s += t2 - t1
                acc.queued_s += t2 - (landed or job.submitted)
                if acc.packed is not None:
                    ref = acc.packed.ref(array.path, tile)
                    acc.packed.add(
                        DECODE if raw is not None else MISSING, t1, t1, t2, ref, chunk, row
                    )
        elif isinstance(error, ChunkReadError):
            self._bad(job, unit, error)
        self._unit_done(job, entry, acc)

    def _failed(self, job: FillJob, unit: Unit, error: BaseException) -> None:
        """``unit`` failed in the machinery itself (not a read or a decode): it fails its
        entry, or its batch, whatever ``on_bad_chunk`` says."""
        _RUN.__dict__.setdefault("errors", []).append(error)  # (for the run's end)
        entry = unit.entry
        if entry is None:
            if job.error is None:
                job.error = error
        elif entry.error is None:
            entry.error = error
        self._unit_done(job, entry, None)

    def _read(
        self,
        job: FillJob,
        array: ArrayFill,
        chunk: int,
        tile: tuple[int, ...],
        key: str,
        acc: _Tally,
        row: int = -1,
    ) -> Any:
        """Read one stored object of a local store for ``job`` (``row``: the batch row it is
        decoded into, ``-1`` for a slot; for the trace). A read that fails raises its
        :class:`ChunkReadError`, counted (:meth:`BadChunks.count`)."""
        assert self.reader is not None
        ids = self._identities()
        info: list[Any] | None = None if ids is None else []
        t0 = _now()
        try:
            raw = self.reader.read(key) if info is None else self.reader.read(key, info)
        except Exception as exc:  # whatever the read raised (not its decode's): a failed read
            error = array.read_error(chunk, tile, key, "read", self.store_name)
            error.__cause__ = exc
            self.bad.count(job, error, row, t0, _now())
            raise error from exc
        t1 = _now()
        acc.reads += 1
        acc.read_s += t1 - t0
        acc.read_bytes += 0 if raw is None else len(raw)
        if acc.packed is not None:
            acc.packed.add(READ, t0, t1, t1, acc.packed.ref(array.path, tile), chunk, row)
        if ids is not None and info:  # what identifies the file (store_identity)
            ids.note(array.path, array.entry_index(chunk, tile), key, stat_identity(info[0]))
        return raw

    def _bad(self, job: FillJob, unit: Unit, error: ChunkReadError) -> None:
        """``unit``'s object could not be read or decoded: it fills or fails
        (:meth:`BadChunks.handle`)."""
        _RUN.__dict__.setdefault("errors", []).append(error)  # (for the run's end)
        self.bad.handle(job, unit, error)

    def _decode_failed(
        self, job: FillJob, unit: Unit, key: str, exc: Exception, t1: float, since: float = 0.0
    ) -> None:
        """``unit``'s decode, begun at ``t1``, raised ``exc``: counted, then :meth:`_bad`."""
        error = self.bad.decode_error(unit.array, unit.chunk, unit.tile, key, exc)
        self.bad.count(job, error, unit.row, t1, _now(), since)
        self._bad(job, unit, error)

    def _skip(self, job: FillJob, unit: Unit) -> None:
        entry = unit.entry
        if entry is not None and entry.error is None and entry.state == PENDING:
            entry.error = FillCancelled(f"chunk {entry.key} was cancelled")
        self._unit_done(job, entry, None)

    def _revive(self, job: FillJob, unit: Unit, acc: _Tally) -> None:
        """Map a persistent-cache file; a file that cannot be used is fetched instead, its
        objects joining this job."""
        array, chunk, _, _, entry, _ = unit
        assert entry is not None
        try:
            mapped = self.pool.map_cached(entry)
        except Exception as exc:
            entry.error = exc
            self._unit_done(job, entry, acc)
            return
        if mapped:
            self._unit_done(job, entry, acc)
            return
        rec = self.recorder
        if entry.corrupt:  # fetched below, as a miss
            rec.on_corrupt()
        if array.units:  # a patched array's unit: its one stored tile
            chunk, tile, box = array.unit_parts(chunk)
            start, stop = array.geom.chunk_range(chunk)
            region = self.region(job, entry, array, stop - start)
            units = [Unit(array, chunk, tile, region[box], entry)]
        else:
            start, stop = array.geom.chunk_range(chunk)
            region = self.region(job, entry, array, stop - start)
            units = [Unit(array, chunk, tile, region[box], entry) for tile, box in array.tiles]
        with job.lock:
            entry.tiles_left += len(units) - 1  # the revive unit becomes the fetch's units
            job.left += len(units) - 1
        if self.gets is None:
            self.land_many(job, [Queued(u) for u in units])
        else:
            self.gets.enqueue(job, units)

    def region(
        self, job: FillJob, entry: ChunkEntry, array: ArrayFill, n: int | None
    ) -> np.ndarray | SpareRegion:
        """Where ``entry``'s ``n`` samples decode (all of its slot with ``None``): its slot, or
        when its chunk transforms reshape it a :class:`~insitubatch_nodes.stages._spares.
        SpareRegion` of the stored layout, whose buffer is taken only when the chunk's first
        object is decoded (before 2026-12-07: here, when the fill was queued)."""
        if n is None:
            n = entry.slot.shape[0] if entry.cached is None else entry.cached[1][0]
        if not self.transforms.reshapes(array.path):
            return entry.slot[:n]
        region = job.spares[id(entry)] = SpareRegion(self.spares, array.geom, n, job.lock)
        return region

    def _unit_done(self, job: FillJob, entry: ChunkEntry | None, acc: _Tally | None) -> None:
        self._note_reads(acc)
        finish_entry = False
        with job.lock:
            if entry is not None:
                entry.tiles_left -= 1
                finish_entry = entry.tiles_left == 0
            job.left -= 1
            finish_job = job.left == 0
        try:
            if finish_entry:
                assert entry is not None
                self._entry_done(job, entry, acc)
        finally:  # an entry's failure must not leave its job, and the batch waiting on it, open
            if finish_job:
                self._job_done(job)

    def _entry_done(self, job: FillJob, entry: ChunkEntry, acc: _Tally | None) -> None:
        """Every object of ``entry`` is handled: transforms, checksum, then ready; or the
        first error (or the cancellation) fails it. Nothing writes into its slot any more."""
        spare = job.spares.pop(id(entry), None)
        try:
            if entry.error is not None:
                self.pool.discard(entry, entry.error)
                return
            path = entry.key[0]
            if self.transforms.active(path) and entry.cached is None:
                try:
                    self._transform(entry, None if spare is None else spare.buffer(), acc)
                except Exception as exc:
                    self.pool.discard(entry, exc)
                    return
            if entry.file is not None:  # a new cache file: its checksum, before the commit
                try:
                    self.pool.seal(entry)
                except Exception as exc:  # the batch raises it (a waiting one, promptly)
                    self.pool.discard(entry, exc)
                    return
            self.pool.mark_ready(entry)
        except BaseException as exc:
            self.pool.discard(entry, exc)
            raise
        finally:
            if spare is not None:
                spare.release()

    def _transform(self, entry: ChunkEntry, decoded: np.ndarray | None, acc: _Tally | None) -> None:
        path, chunk = entry.key
        source = self.transforms.source(path)
        start, stop = source.chunk_range(chunk)
        index, member, members = chunk, None, source.members
        if members is not None and not members.continuous:  # counted within its member
            m = int(members.member_of(np.array([start]))[0])
            base = int(members.sample_base[m])
            start, stop = start - base, min(stop - base, int(members.lengths[m]))
            index, member = chunk - int(members.chunk_base[m]), (m, members.names[m])
        region = entry.slot[: stop - start]
        data = region if decoded is None else decoded[: stop - start]
        t0 = _now()
        out = self.transforms.apply(path, index, (start, stop), data, member)
        if out is not region:
            np.copyto(region, out)
        if acc is not None:
            t1 = _now()
            acc.transforms += 1
            acc.transform_s += t1 - t0
            if acc.packed is not None:
                acc.packed.add(TRANSFORM, t0, t0, t1, acc.packed.ref(path), chunk)

    def _job_done(self, job: FillJob) -> None:
        job.spares.clear()
        job.fill.resolve()

    def _identities(self) -> IdentityRecorder | None:
        cache = self.pool.cache
        return None if cache is None else cache.identity

    # -- cancellation ---------------------------------------------------------------------
    def cancel(self, jobs: Iterable[FillJob] = ()) -> None:
        """Stop work nobody waits for any more (any thread, returns at once): the rows of
        ``jobs``, and the objects of entries that lost their last pin (which runs skip by
        themselves). GETs in flight for either are cancelled on the loop."""
        for job in jobs:
            job.cancelled = True
        if self.gets is not None:
            self.gets.cancel_skipped()


def _mid_chunk(job: FillJob) -> bool:
    """Whether ``job``'s next queued object is of a reshaped chunk whose buffer is live (some
    object of it written): a run gives its thread up to sooner work only between two such
    chunks, so that a chunk's buffer is held only while a decode thread works on it."""
    with job.lock:
        if not job.todo:
            return False
        work = job.todo[0].work
    out = work.out if isinstance(work, Unit) else None
    return isinstance(out, SpareView) and out.region.buf is not None


_RUN = threading.local()  # the errors the decode thread's current run recorded ("errors")


class _Tally:
    """What one run did, handed to the recorder once at its end (no lock per object)."""

    __slots__ = (
        "decode_s",
        "decodes",
        "handled",
        "noted_bytes",
        "noted_reads",
        "packed",
        "queued_s",
        "read_bytes",
        "read_s",
        "reads",
        "run_s",
        "spans",
        "submitted",
        "transform_s",
        "transforms",
    )

    def __init__(self, submitted: float) -> None:
        self.submitted = submitted  # when the run's job was submitted (the recorder's epoch)
        self.handled = 0  # objects taken off the job's queue (decoded, failed or skipped)
        self.reads = 0
        self.read_s = 0.0
        self.read_bytes = 0
        self.noted_reads = self.noted_bytes = 0  # of reads and read_bytes, counted in the pool
        self.decodes = 0
        self.decode_s = 0.0
        self.queued_s = 0.0
        self.transforms = 0
        self.transform_s = 0.0
        self.run_s = 0.0
        #: with a trace: ``(name, t0, t1, args)`` of the run itself
        self.spans: list[tuple[str, float, float, Any]] | None = None
        #: with a trace: its reads, decodes and transforms, packed (the batch its job's)
        self.packed: PackedSpans | None = None
