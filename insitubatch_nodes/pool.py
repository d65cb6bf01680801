"""Chunk residency: the pool of decoded chunks under a byte budget (no torchdata here).

A *slot* holds one decoded chunk of one array, sample-axis first: shape ``(samples_per_chunk,
*inner_shape)``. A chunk is *pinned* from admission until the last batch that reads it has been
gathered; then it stays resident as least-recently-used and is evicted only when a new chunk
needs its memory. With a budget above the working set, drained chunks therefore survive into the
next epoch and are hits there.

Slot buffers come from a :class:`SlotBacking` and are recycled through per-size free lists, so a
steady-state epoch allocates nothing. The bytes the backing has handed out (slots in use plus
free-listed ones) never exceed the budget.

**Slot layouts.** A slot is always *indexed* sample-first, but its memory comes in one of two
layouts. The usual one is C order ``(spc, *inner)``. A *level-major* slot (``level_major=True``
in :meth:`ChunkPool.acquire`; for arrays stored one level per object,
:attr:`~insitubatch_nodes.io.geometry.ArrayGeometry.one_level_per_object`) is C order
``(inner[0], spc, *inner[1:])`` seen through ``swapaxes(0, 1)``: each stored object's region is
then one contiguous run that the decompressor writes in place, where the usual layout would
need a scratch decode and a strided copy of every such object. Readers see an ordinary numpy
view either way; :func:`is_level_major` tells them apart (the gather uses it to keep one copy
per row). Files of the persistent cache keep the usual layout.

**Fill lifetime.** An entry admitted as a miss is filled by exactly one task (whoever admitted
it). Its ``ready`` future always resolves: with ``None`` once the slot holds the data, or with
the error that stopped the fill — also when the fill is cancelled before it ever ran (the fill's
owner calls :meth:`ChunkPool.discard` from the task's done-callback). A slot goes back to the free
list only once nothing writes into it any more. When the last pin on a chunk that is still
arriving is dropped, the entry is *detached*: removed from the index at once (a later request is
a fresh miss, never a wait on a fill nobody owns) and :meth:`ChunkPool.unpin` returns it so its
owner can cancel the fill; if the fill completes anyway, the chunk is kept as an ordinary
resident chunk. A chunk that another pipeline sharing the pool still pins is never cancelled
under it. A chunk with ``bad_tiles`` (stored objects filled under ``on_bad_chunk="nan"``) is
dropped as soon as nothing pins it: it is never a hit for a later reader.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from insitubatch_nodes._checks import check_optional_int
from insitubatch_nodes._pages import plain_pages
from insitubatch_nodes.errors import CacheClosed, CacheMissError, CorruptCacheError, FillCancelled
from insitubatch_nodes.slots import (
    FAILED,
    PENDING,
    READY,
    UNMAPPED,
    ChunkEntry,
    Fill,
    RamBacking,
    SlotBacking,
    SlotKey,
    new_slot,
    slot_key,
    wants_level_major,
)

if TYPE_CHECKING:
    from insitubatch_nodes.cache.directory import ChunkCache
    from insitubatch_nodes.plan.ledger import ChunkKey

log = logging.getLogger(__name__)

__all__ = ["ChunkPool", "PoolStats", "RamBacking", "SlotBacking"]


@dataclass
class PoolStats:
    """Counters of one pool (cumulative over its life; read them any time)."""

    hits: int = 0
    misses: int = 0
    gets: int = 0
    bytes_fetched: int = 0
    evictions: int = 0
    allocations: int = 0
    resident_bytes: int = 0
    resident_peak_bytes: int = 0
    inflight: int = 0
    inflight_peak: int = 0
    disk_hits: int = 0  # chunks served from the persistent cache (also counted in hits)
    disk_writes: int = 0  # chunks written to the persistent cache
    # cached files found corrupt when revived (checksum mismatch, cut short or garbled):
    # fetched again (counted in misses, not in disk_hits) and rewritten
    corrupt: int = 0
    # chunks fetched and decoded straight into batch rows, never into a slot of this pool (rows
    # of one-sample chunks): not in misses; the epoch report's misses count both
    misses_in_place: int = 0
    # static fields (read once per pipeline, outside the pool; not in gets): the stored objects
    # read from the store for them, and the static fields taken from the persistent cache
    static_gets: int = 0
    static_disk_hits: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class ChunkPool:
    """Chunk residency under a byte budget (thread-safe).

    ``budget_bytes=None`` means *automatic*: the pipeline sets it to the working-set floor of
    each epoch (:func:`working_set_bytes`). An explicit budget must be a positive integer
    (``TypeError`` / ``ValueError`` here otherwise, as for ``CacheOptions.budget_bytes``); one
    below an epoch's floor raises
    ``ValueError`` naming the floor when that epoch starts (the builder checks epoch 0 up front).
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        backing: SlotBacking | None = None,
        cache: ChunkCache | None = None,
        stats: PoolStats | None = None,
    ):
        if backing is not None and cache is not None and not cache.persistent:
            raise ValueError("pass a backing or a spill cache_dir, not both")
        budget_bytes = check_optional_int("budget_bytes", budget_bytes, minimum=1)
        self.auto = budget_bytes is None
        self.budget_bytes = budget_bytes or 0
        self.cache = cache
        spill = cache.spill if cache is not None else None
        self.backing: SlotBacking = backing or spill or RamBacking()
        in_ram = getattr(self.backing, "in_ram", False)
        if not isinstance(in_ram, bool):  # (a method or a string would read as "in RAM")
            raise TypeError(
                f"the backing's in_ram must be True or False (whether its slots are process "
                f"memory), got {in_ram!r}; leave it out where they are not"
            )
        self._in_ram = in_ram
        self.stats = stats or PoolStats()  # (given: counters kept since before the pool)
        self._lock = threading.Lock()
        self._entries: dict[ChunkKey, ChunkEntry] = {}
        self._lru: OrderedDict[ChunkKey, ChunkEntry] = OrderedDict()
        self._free: dict[SlotKey, list[np.ndarray]] = {}
        self._allocated = 0
        # detached chunks still arriving, by id: their slots come back when their fills end
        self._detached: dict[int, ChunkEntry] = {}
        self._cleared = False  # since clear(), until the next acquire: a landing fill keeps nothing
        self._reserver: threading.Thread | None = None
        self._stop_reserve = threading.Event()

    # -- budget -----------------------------------------------------------------------------
    def ensure_floor(self, floor_bytes: int, read_once_bytes: int | None = None) -> None:
        """Grow an automatic budget to ``floor_bytes``; an explicit one below it raises."""
        with self._lock:
            if self.auto:
                self.budget_bytes = max(self.budget_bytes, floor_bytes)
            elif self.budget_bytes < floor_bytes:
                once = (
                    f"; reading each chunk once per epoch needs {read_once_bytes:,} bytes"
                    if read_once_bytes and read_once_bytes > floor_bytes
                    else ""
                )
                raise ValueError(
                    f"cache_budget_bytes={self.budget_bytes:,} is below this epoch's working-set "
                    f"floor of {floor_bytes:,} bytes ({floor_bytes / 2**20:.1f} MiB: chunks live "
                    f"at once plus one block of read-ahead, at most every chunk the epoch reads)"
                    f"{once}; raise it to at least the "
                    "floor, lower block_chunks, or pass None for the automatic budget"
                )

    @property
    def slots_in_ram(self) -> bool:
        """Whether this pool's slots are process memory, which the build's memory check
        (:mod:`~insitubatch_nodes.plan.memory_floor`) holds them to: no cache directory, and a
        backing whose ``in_ram`` says so (``RamBacking``'s does; a backing without the
        attribute is taken as not RAM, and not checked; one that is no bool was refused when
        the pool was made)."""
        return self.cache is None and self._in_ram

    @property
    def allocated_bytes(self) -> int:
        """Bytes of slot memory handed out by the backing (in use + free-listed)."""
        return self._allocated

    # -- paying for memory ahead of need ----------------------------------------------------
    def reserve(self, shapes: Iterable[tuple[Any, ...]]) -> None:
        """Allocate slots of ``shapes`` — ``(shape, dtype)`` or ``(shape, dtype, level_major)``
        as :meth:`acquire` takes them, in the order they will be needed — into the free lists
        on a background thread, with their pages already faulted in, while the budget has room.
        A fresh process otherwise pays for each new slot's pages on first write, inside the
        decode that fills it — in the first epoch, that is most of its slots.

        Allocation on demand goes on meanwhile and never waits for the reserve: a slot the
        reserve finishes after the budget was taken is dropped, and the reserve stops at the
        first shape that no longer fits. Backings without
        ``allocate_populated`` are left alone. :meth:`stop_reserve` ends it early.
        """
        populated = getattr(self.backing, "allocate_populated", None)
        if populated is None:
            return
        todo = [
            (tuple(s[0]), np.dtype(s[1]), wants_level_major(tuple(s[0]), bool(s[2:] and s[2])))
            for s in shapes
        ]
        self.stop_reserve()
        self._stop_reserve.clear()

        def run() -> None:
            for shape, dtype, major in todo:
                nbytes = math.prod(shape) * dtype.itemsize
                with self._lock:
                    if self._stop_reserve.is_set() or self._allocated + nbytes > self.budget_bytes:
                        return
                try:
                    buf = new_slot(populated, shape, dtype, major)
                except (OSError, MemoryError, ValueError):
                    return
                with self._lock:
                    # On-demand allocation never waits for the reserve: if it took the budget
                    # meanwhile, this buffer is not needed.
                    if self._stop_reserve.is_set() or self._allocated + nbytes > self.budget_bytes:
                        self.backing.release(buf)
                        return
                    self._allocated += nbytes
                    self.stats.allocations += 1
                    self._recycle(buf)

        self._reserver = threading.Thread(target=run, name="insitu-slot-reserve", daemon=True)
        self._reserver.start()

    def stop_reserve(self, timeout: float = 2.0) -> None:
        """Stop a running :meth:`reserve` (waits for the slot in progress, at most ``timeout``)."""
        self._stop_reserve.set()
        thread, self._reserver = self._reserver, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- admission ------------------------------------------------------------------------
    def note_misses_in_place(self, n: int) -> None:
        """Count ``n`` chunks read from the store without a slot of this pool (rows decoded
        straight into a batch; any thread): ``misses_in_place``."""
        with self._lock:
            self.stats.misses_in_place += n

    def note_io(self, gets: int = 0, nbytes: int = 0, inflight: int = 0) -> None:
        """Count ``gets`` stored-object reads of ``nbytes`` bytes, and ``inflight`` more (or,
        negative, fewer) reads in flight (any thread; once per group of objects)."""
        with self._lock:
            stats = self.stats
            stats.gets += gets
            stats.bytes_fetched += nbytes
            if inflight:
                stats.inflight += inflight
                if stats.inflight > stats.inflight_peak:
                    stats.inflight_peak = stats.inflight

    def has_entries(self) -> bool:
        """Whether any chunk is resident or arriving (a hint: not locked)."""
        return bool(self._entries)

    def lookup(self, key: ChunkKey) -> ChunkEntry | None:
        with self._lock:
            return self._entries.get(key)

    def acquire(
        self,
        key: ChunkKey,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        valid: int | None = None,
        level_major: bool = False,
        fill: Fill | None = None,
    ) -> tuple[ChunkEntry, bool] | None:
        """Pin ``key``: ``(entry, True)`` if already present (a hit), ``(new entry, False)``
        with a fresh slot to fill (a miss), or ``None`` when the budget has no room now.

        ``shape`` is the slot's sample-first shape; ``level_major`` asks for a level-major slot
        (module docstring) when the chunk is a miss held in memory — a hit keeps the layout
        it was filled in, and a file of the persistent cache has the usual one. A new entry
        joins ``fill`` (its owner's group; a fill of its own by default), which counts it as a
        member to resolve.

        With a persistent cache a chunk it holds comes back as a ready hit (a read-only mapping
        of its file); ``valid`` is the number of valid samples the chunk holds (the slot's
        length by default) — a cached chunk with another count is a miss. With
        ``readonly_cache`` a chunk the cache lacks raises
        :class:`~insitubatch_nodes.cache.CacheMissError`.
        """
        got = self.acquire_many([(key, shape, dtype, valid, level_major)], fill)
        return got[0] if got else None

    def acquire_many(
        self,
        requests: Sequence[tuple[ChunkKey, tuple[int, ...], np.dtype[Any], int | None, bool]],
        fill: Fill | None = None,
    ) -> list[tuple[ChunkEntry, bool]]:
        """:meth:`acquire` for each ``(key, shape, dtype, valid, level_major)`` in order, under
        one lock; stops at the first one the budget has no room for (the result is the
        admitted prefix). New entries join ``fill`` (counted as its members)."""
        out: list[tuple[ChunkEntry, bool]] = []
        try:
            with self._lock:
                for key, shape, dtype, valid, level_major in requests:
                    got = self._acquire(key, shape, dtype, valid, level_major, fill)
                    if got is None:
                        break
                    out.append(got)
        except BaseException:  # (a read-only cache that lacks a chunk): admit none of them
            for entry in self.unpin([entry for entry, _ in out]):
                self.discard(entry)
            raise
        return out

    def _acquire(
        self,
        key: ChunkKey,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        valid: int | None,
        level_major: bool,
        fill: Fill | None,
    ) -> tuple[ChunkEntry, bool] | None:
        self._cleared = False
        entry = self._entries.get(key)
        if entry is not None:
            entry.pins += 1
            self._lru.pop(key, None)
            self.stats.hits += 1
            return entry, True
        shape, dtype = tuple(shape), np.dtype(dtype)
        valid = shape[0] if valid is None else valid
        cache = self.cache
        if cache is not None and cache.closed:  # closed with its pipeline, used again
            cache.open()
            self.backing = cache.spill or self.backing
        if cache is not None and cache.persistent:
            nbytes = math.prod(shape) * dtype.itemsize
            if not self._make_room(nbytes):
                return None
            file = cache.find(key, shape, dtype, valid)
            if file is not None:
                # a hit on disk: its fill maps the file, on a decode thread (no GET, no
                # decode); the slot is that mapping (budgeted as page cache)
                entry = self._admit(key, UNMAPPED, False, valid, fill, nbytes)
                entry.cached = (file, shape, dtype)
                self.stats.hits += 1
                self.stats.disk_hits += 1
                return entry, False
            if cache.readonly:
                raise CacheMissError(
                    f"chunk {key[1]} of array {key[0]!r} is not in the read-only cache at "
                    f"{cache.root} (readonly_cache=True asserts that the cache holds every "
                    "chunk the run reads). The usual cause: the run that warmed it read "
                    "another split, sample range, or ran other chunk transforms. Warm it "
                    "with this configuration and persist=True, or drop readonly_cache."
                )
            written = cache.new_slot(key, shape, dtype, valid)
            if written is not None:
                entry = self._admit(key, written.array, False, valid, fill)
                entry.file = written
                self.stats.misses += 1
                return entry, False
        slot = self._take_buffer(shape, dtype, wants_level_major(shape, level_major))
        if slot is None:
            return None
        entry = self._admit(key, slot, True, valid, fill)
        self.stats.misses += 1
        return entry, False

    def _admit(
        self,
        key: ChunkKey,
        slot: np.ndarray,
        recycle: bool,
        valid: int,
        fill: Fill | None,
        nbytes: int | None = None,
    ) -> ChunkEntry:
        nbytes = slot.nbytes if nbytes is None else nbytes
        if not recycle:  # a file's mapping: budgeted like a slot, never reused for another chunk
            self._allocated += nbytes
            self.stats.allocations += 1
        if fill is not None:
            fill.add(1)
        entry = ChunkEntry(key, slot, nbytes, pins=1, recycle=recycle, fill=fill)
        entry.valid = valid
        self._entries[key] = entry
        stats = self.stats
        stats.resident_bytes += nbytes
        if stats.resident_bytes > stats.resident_peak_bytes:
            stats.resident_peak_bytes = stats.resident_bytes
        return entry

    def map_cached(self, entry: ChunkEntry) -> bool:
        """Fill an entry admitted as a hit on disk by mapping its cached file, checked against
        its checksum (any thread; a decode thread in the pipeline).

        Returns False when the file turned out unusable — deleted since it was found, or
        *corrupt*: its bytes fail their checksum, or it is cut short or garbled. The entry then
        holds a fresh slot (already budgeted) and its owner fetches the chunk into it, as a
        miss; that slot is a new cache file when the cache can write it, so the fetched chunk
        replaces the unusable one. A corrupt file is logged (a warning) and counted
        (``stats.corrupt``, ``entry.corrupt``). A read-only cache raises instead:
        :class:`~insitubatch_nodes.cache.CorruptCacheError` naming a corrupt file,
        :class:`~insitubatch_nodes.cache.CacheMissError` for one that cannot be read.
        """
        assert entry.cached is not None and self.cache is not None
        file, shape, dtype = entry.cached
        cache = self.cache
        corrupt: str | None = None  # why the file is corrupt
        try:
            slot = cache.map_file(file, shape, dtype, entry.key)
        except CacheClosed:
            raise FillCancelled(f"chunk {entry.key} was cancelled (its cache closed)") from None
        except CorruptCacheError as exc:
            if cache.readonly:
                raise
            slot, corrupt = None, str(exc)
        if slot is not None:
            entry.slot = slot
            return True
        if corrupt is None and file.exists():  # there, but it does not map: cut short, garbled
            corrupt = (
                f"cached file {file} (chunk {entry.key[1]} of array {entry.key[0]!r}) is cut "
                "short or garbled"
            )
        if cache.readonly:
            if corrupt is not None:
                raise CorruptCacheError(
                    f"{corrupt}: it is never served. Run a writer (persist=True) over the cache "
                    f"at {cache.root} to rewrite it, or delete the file and warm the cache again."
                )
            raise CacheMissError(
                f"chunk {entry.key[1]} of array {entry.key[0]!r} is logged in the read-only "
                f"cache at {cache.root} but its file {file.name} is gone (deleted "
                "since the run found it); warm the cache again"
            )
        if corrupt is not None:
            log.warning(
                "insitubatch_nodes: corrupt chunk in cache_dir, fetched again and rewritten: %s",
                corrupt,
            )
        with self._lock:
            cache.forget(entry.key)
            self.stats.hits -= 1
            self.stats.disk_hits -= 1
            self.stats.misses += 1
            if corrupt is not None:
                self.stats.corrupt += 1
                entry.corrupt = True
            valid = entry.valid if entry.valid is not None else shape[0]
            try:
                written = None if cache.closed else cache.new_slot(entry.key, shape, dtype, valid)
            except OSError:  # cannot write the directory now: the chunk stays in memory
                written = None
            if written is not None:  # the fetched chunk replaces the file (committed when ready)
                entry.file = written
                entry.slot = written.array
            else:  # another rank writes it now, or the cache closed: kept in memory
                entry.slot = plain_pages(shape, dtype)
        return False

    def seal(self, entry: ChunkEntry) -> None:
        """The chunk a fill wrote into a cache file is complete: checksum its bytes for the
        commit in :meth:`mark_ready` (on a decode thread, outside the pool's lock)."""
        if entry.file is not None and self.cache is not None and not entry.bad_tiles:
            self.cache.seal(entry.file)

    def _make_room(self, nbytes: int) -> bool:
        """Free memory until ``nbytes`` more fit the budget (free lists, then LRU chunks)."""
        while self._allocated + nbytes > self.budget_bytes:
            if self._drop_other_free(None):
                continue
            if self._evict_lru():
                continue
            return False
        return True

    def _take_buffer(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], level_major: bool
    ) -> np.ndarray | None:
        size_key = (shape, dtype.str, level_major)
        nbytes = math.prod(shape) * dtype.itemsize
        while True:
            free = self._free.get(size_key)
            if free:
                return free.pop()
            if self._allocated + nbytes <= self.budget_bytes:
                # counted once it exists: a backing may raise (a spill disk that is full)
                slot = new_slot(self.backing.allocate, shape, dtype, level_major)
                self._allocated += nbytes
                self.stats.allocations += 1
                return slot
            if self._drop_other_free(size_key):
                continue
            if self._evict_lru():
                continue
            return None

    def _evict_lru(self) -> bool:
        """Evict the least recently used unpinned chunk (its slot goes back); ``False`` if none."""
        if not self._lru:
            return False
        _, victim = self._lru.popitem(last=False)
        del self._entries[victim.key]
        self.stats.evictions += 1
        self._return_slot(victim)
        return True

    def _drop_other_free(self, keep: SlotKey | None) -> bool:
        for size_key, bufs in self._free.items():
            if size_key != keep and bufs:
                buf = bufs.pop()
                self._allocated -= buf.nbytes
                self.backing.release(buf)
                return True
        return False

    def _recycle(self, slot: np.ndarray) -> None:
        self._free.setdefault(slot_key(slot), []).append(slot)

    # -- completion and release --------------------------------------------------------------
    def mark_ready(self, entry: ChunkEntry) -> None:
        """The fill finished: the entry is ready (its fill's waiters wake once the rest of the
        fill resolved). A detached chunk becomes an unpinned resident one (or gives its slot
        back when a newer entry took its key meanwhile). A no-op on a resolved entry."""
        if entry.file is not None and not entry.bad_tiles and self.cache is not None:
            with self._lock:  # before waiters wake: a chunk a batch used is already logged
                if entry.state == PENDING and self.cache.commit(
                    entry.file, entry.valid or entry.slot.shape[0]
                ):
                    self.stats.disk_writes += 1
        with self._lock:
            if entry.state != PENDING:
                return
            entry.state = READY
            if entry.detached:
                entry.detached = False
                self._detached.pop(id(entry), None)
                closed = self.cache is not None and self.cache.closed  # it let go of its files
                if entry.key in self._entries or entry.bad_tiles or closed or self._cleared:
                    self._return_slot(entry)
                else:
                    self._entries[entry.key] = entry
                    self._lru[entry.key] = entry
        entry.fill.resolve()

    def discard(self, entry: ChunkEntry, error: BaseException | None = None) -> None:
        """Drop an entry whose fill failed or was cancelled; its waiters see ``error``.

        Call only once nothing writes into its slot any more (from the fill itself, once its
        last stored object is done). Idempotent: a resolved entry stays as it is.
        """
        with self._lock:
            if entry.state != PENDING:
                return
            entry.state = FAILED
            entry.error = error or FillCancelled(f"chunk {entry.key} was cancelled")
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                self._lru.pop(entry.key, None)
            entry.detached = False
            self._detached.pop(id(entry), None)
            self._return_slot(entry)
        entry.fill.resolve()

    def unpin(self, entries: Iterable[ChunkEntry]) -> list[ChunkEntry]:
        """Release one pin on each entry; fully released ready chunks become LRU-evictable.

        Returns the entries whose last pin went while they were still arriving: they are
        detached (see the module docstring) and their owner should cancel their fills.
        """
        detached: list[ChunkEntry] = []
        with self._lock:
            for entry in entries:
                entry.pins -= 1
                if entry.pins < 0:
                    raise RuntimeError(f"chunk {entry.key} unpinned more often than pinned")
                if entry.pins == 0 and self._entries.get(entry.key) is entry:
                    if entry.state == READY and entry.bad_tiles:  # never a later reader's hit
                        del self._entries[entry.key]
                        self._return_slot(entry)
                    elif entry.state == READY:
                        self._lru[entry.key] = entry
                    elif entry.state == PENDING:  # still arriving: nobody will wait on it
                        del self._entries[entry.key]
                        entry.detached = True
                        self._detached[id(entry)] = entry
                        detached.append(entry)
        return detached

    def detached_fills(self) -> list[Future[None]]:
        """The completions of the fills still writing into detached chunks (let go of while
        arriving: a run torn down, a batch dropped). Their slots count against the budget
        until those fills end — a fill cannot be stopped inside a decode or a chunk transform
        — and they always end (module docstring)."""
        with self._lock:
            return list({id(e.fill): e.fill.future for e in self._detached.values()}.values())

    def _return_slot(self, entry: ChunkEntry) -> None:
        if not entry.slot_returned:
            entry.slot_returned = True
            self.stats.resident_bytes -= entry.nbytes
            if entry.recycle:
                if self._cleared or (self.cache is not None and self.cache.closed):  # keep none
                    self._allocated -= entry.slot.nbytes
                    self.backing.release(entry.slot)
                else:
                    self._recycle(entry.slot)
                return
            self._allocated -= entry.nbytes  # a file's mapping: unmapped once unreferenced
            if entry.file is not None and self.cache is not None:
                self.cache.drop(entry.file)

    def evict_last(self, keys: Iterable[ChunkKey]) -> None:
        """Move the unpinned resident chunks among ``keys`` to the most-recently-used end of
        the LRU list, in that order: they are evicted after every other unpinned chunk, the
        last of them last. Only the order changes (a key not resident, or pinned, is skipped).
        The fetch stage calls this when an epoch starts, with the chunks that epoch reads
        again, so the ones it adds evict what it no longer reads, not what it is about to hit
        (an LRU order alone evicts the oldest: under DDP, a rank whose automatic budget held
        its share made 23 reads for the 18 chunks its next share added)."""
        with self._lock:
            lru = self._lru
            for key in keys:
                if key in lru:
                    lru.move_to_end(key)

    def pinned_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.pins > 0)

    def resident_keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def close_cache(self) -> None:
        """Let go of the cache directory: drop every resident chunk and free slot (nothing may
        be pinned) and release its lock once their mappings are gone. A later :meth:`acquire`
        takes the directory again (a persistent cache; a spill one stays closed)."""
        if self.cache is None:
            return
        with self._lock:  # from here no fill that lands re-admits its chunk (see mark_ready)
            self.cache.stop()
        self.clear()
        self.cache.close()

    def clear(self) -> None:
        """Drop every unpinned chunk and free list (pinned chunks stay). Until the next
        :meth:`acquire`, a fill still running (a detached chunk) gives its slot back to the
        backing when it ends, instead of keeping its chunk or listing the slot free."""
        self.stop_reserve()
        with self._lock:
            self._cleared = True
            for key, entry in list(self._lru.items()):
                del self._entries[key]
                self._return_slot(entry)
            self._lru.clear()
            for bufs in self._free.values():
                for buf in bufs:
                    self._allocated -= buf.nbytes
                    self.backing.release(buf)
            self._free.clear()
