"""A stored object that cannot be read or decoded: what it counts, and what it does to its batch.

**Counted as one that worked.** The store was asked, or the decoder ran, and the epoch spent
that time: a local read that failed counts in the report's GETs (with no bytes), its seconds and
``local_read_s``, and a decode that failed in its decodes and their seconds, as a remote GET
that failed does (:mod:`~insitubatch_nodes.stages._get`); with a trace each has its ``read`` or
``decode`` span, which names the error (:meth:`BadChunks.count`). A failed read is still not a
read *served* (the pool's ``stats()``): that count is the clock below.

**``on_bad_chunk``.** ``"raise"`` fails the batch that needs the object. ``"nan"`` fills the
object's rectangle and goes on: it is for the occasional object a store will not return (an
upload cut short, an object the credentials may not read) or whose bytes do not decode. A store
that returns *none* is not that — credentials that expired mid-run, a store or a network that is
down — and filling would turn the rest of the run into fill values, one logged warning per
object. So under ``"nan"`` too, a failed read fails its batch once
:data:`READ_FAILURES_IN_A_ROW` reads have failed with no stored object served between them (the
pool's count of reads served is the clock: nothing is added to the path of a read that
succeeds; a collection's several stores count each its own). Its
:class:`~insitubatch_nodes.errors.ChunkReadError` says so (``in_a_row``). Objects that do not
decode never count: a store that serves bytes is answering.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.io.routing import split_routed
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import EpochRecorder
from insitubatch_nodes.stages._jobs import ArrayFill, FillJob, Unit
from insitubatch_nodes.stages._spares import as_array

__all__ = ["READ_FAILURES_IN_A_ROW", "BadChunks", "NoteBad"]

#: failed reads in a row, none served between them, that ``on_bad_chunk="nan"`` still fills
READ_FAILURES_IN_A_ROW = 64

NoteBad = Callable[[int, str, int, Iterable[tuple[int, ...]]], bool]
"""``note_bad(generation, path, chunk, tiles)``: list bad stored objects (the fetch stage's);
False when the fill belongs to an epoch that is over."""

log = logging.getLogger("insitubatch_nodes.stages.fetch")


class BadChunks:
    """The bad stored objects of one fetch stage's fills (module docstring; any thread).

    ``policy`` is ``on_bad_chunk`` (``"raise"`` or ``"nan"``); filled objects are listed with
    ``note_bad`` and counted, as failed reads and decodes are, in ``recorder``. ``served``: for
    a collection's several stores (a :class:`~insitubatch_nodes.io.objects.RoutedGetter`'s),
    the objects each store returned: the run of failed reads is then counted per store, so that
    the objects the other stores serve do not hide one that returns none."""

    def __init__(
        self,
        policy: str,
        pool: ChunkPool,
        served: list[int] | None = None,
        *,
        note_bad: NoteBad,
        recorder: EpochRecorder,
        store_name: str = "",
    ) -> None:
        self.policy = policy
        self._pool = pool
        self._by_store = served
        self.note_bad = note_bad
        self.recorder = recorder
        self.store_name = store_name
        self._lock = threading.Lock()
        self._failed: dict[int, int] = {}  # per store: reads failed since one was served
        self._served: dict[int, int] = {}  # per store: the count served when one last failed

    def count(
        self, job: FillJob, error: ChunkReadError, row: int, t0: float, t1: float,
        since: float = 0.0,
    ) -> None:  # fmt: skip
        """The local read (``error.what == "read"``) or the decode of ``error``'s object, for
        batch row ``row`` (``-1``: a slot), failed after running from ``t0`` to ``t1``: counted
        as one that worked, its span naming the error's cause (a decode's queue time since
        ``since``: its GET's landing, else its job's submission)."""
        cause = error.__cause__
        self.recorder.on_object_failed(
            error.what, t0, t1, submitted=job.submitted, since=since or job.submitted,
            ids=(error.array, error.chunk_index, error.tile, job.batch, row),
            error=type(cause if cause is not None else error).__name__,
        )  # fmt: skip

    def decode_error(
        self, array: ArrayFill, chunk: int, tile: tuple[int, ...], key: str, exc: Exception
    ) -> ChunkReadError:
        """``exc``, raised reading or decoding ``key``, as a :class:`ChunkReadError` (one
        already is; anything else failed the decode, and is its cause)."""
        if isinstance(exc, ChunkReadError):
            return exc
        error = array.read_error(chunk, tile, key, "decode", self.store_name)
        error.__cause__ = exc
        return error

    def handle(self, job: FillJob, unit: Unit, error: ChunkReadError) -> None:
        """``unit``'s object is bad: under ``"nan"`` (while :meth:`fills` says so) its rectangle
        is filled, listed and counted; else it fails its entry, or its batch (a batch row)."""
        array, chunk, tile, out, entry, _ = unit
        if not self.fills(error):
            if entry is None:
                if job.error is None:
                    job.error = error
            elif entry.error is None:
                entry.error = error
            return
        # Retries are the store's (obstore's, under the RetryPolicy): what still fails is bad.
        log.warning(  # (strings: a handler that keeps records must not keep the chunks)
            "insitubatch_nodes: on_bad_chunk='nan': %s (%s); its rectangle is filled",
            error.where,
            str(error.__cause__),
        )
        as_array(out)[...] = array.fill_value
        if entry is not None:
            entry.bad_tiles.append(tuple(tile))
        if self.note_bad(job.generation, array.path, chunk, [tuple(tile)]):
            self.recorder.on_bad_chunk()

    def fills(self, error: ChunkReadError) -> bool:
        """Whether ``error``'s object is filled (else it fails its batch); a read failing after
        :data:`READ_FAILURES_IN_A_ROW` others, none served between them, is not, and its
        error's ``in_a_row`` says how many failed."""
        if self.policy == "raise":
            return False
        if error.what != "read":
            return True
        store = 0
        if self._by_store is None:  # (read unlocked: a count from a moment ago will do)
            served = self._pool.stats.gets
        else:
            store = split_routed(error.key)[0]
            served = self._by_store[store]
        with self._lock:
            if served != self._served.get(store):
                self._served[store], self._failed[store] = served, 0
            failed = self._failed[store] = self._failed[store] + 1
            if failed <= READ_FAILURES_IN_A_ROW:
                return True
            error.in_a_row = failed
            return False
