"""The cache directory: slots in files, chunks kept across runs, and one writer per directory.

``cache_dir`` moves the pool's slots from anonymous memory into memory-mapped files on local disk,
so the budget is held as page cache the kernel can write back and reclaim. Two modes:

* **spill** (``persist=False``): each slot is a file mapped and unlinked at once — it takes disk
  space only while mapped, and nothing is left behind, even by a killed process;
* **persistent** (``persist=True``): every chunk that completes (after its chunk transforms) is a
  ``.npy`` file that stays, and one line appended whole to the log ``insitu_cache.jsonl`` records
  it the moment it lands. A later pipeline over the same directory — a fresh process included —
  serves those chunks as hits: no fetch, no decode, no transform. A process killed mid-epoch
  (SIGKILL, OOM, preemption) leaves a cache the next run uses for everything that completed.

**Keys and identity.** A cached chunk is keyed by ``(array path, chunk index along the sample
axis)`` — the array's own index, so overlapping splits and sample ranges share entries. Every log
line carries the fingerprint of its array (:mod:`~insitubatch_nodes.cache.fingerprint`: the
geometry and the chunk transforms scoped to that array). Opening a cache whose lines disagree
with the current fingerprint of an array the pipeline reads raises :class:`StaleCacheError`
naming those arrays (as does another pipeline of this process keeping it otherwise there);
``reset_stale_cache=True`` deletes just their files and log lines instead. The data is checked
too (:mod:`~insitubatch_nodes.cache.identity`): a writer records what identifies each stored
object it read in ``insitu_identity.jsonl`` as each chunk is committed, and opening lists each
cached array's prefix once — chunks whose objects changed, went or appeared are dropped (a
writer fetches them again) or raise :class:`StaleCacheError` naming them when a ``readonly``
reader would serve them (:mod:`~insitubatch_nodes.cache.stale`). A line
whose chunk no longer has the same shape, dtype or number of valid samples is a miss (the chunk
is fetched again and its file replaced). A log that cannot be trusted — an unparseable line
before the last, a file name that is not a bare name in the directory — raises
:class:`CorruptCacheError` whatever the flags say (a last line cut short by a crash is dropped).

**Content checks.** Every log line also carries a checksum of its chunk's bytes (``"sum":
"xxh3-64:<hex>"``, xxhash's XXH3 over the file's data, header excluded), computed once the slot
holds its final bytes, on a decode thread, before the line is written. A chunk revived from the
directory is checked once when its file is mapped (:meth:`ChunkCache.map_file`), before any batch
reads it. A chunk whose bytes disagree — a flipped bit on disk, a bad copy, a file cut short or
garbled — is never served: a writer logs a warning, fetches the chunk again and rewrites its file
(the pool counts it, and the epoch report's ``corrupt``); a ``readonly_cache`` reader raises
:class:`CorruptCacheError` naming the file. A line written without a checksum (by a version
before these checks) is not trusted: for a writer it is a miss whose chunk is fetched and
rewritten, with a checksum this time; a reader raises :class:`CacheMissError` saying so.
``verify=False`` skips both checks (it still writes checksums). Unknown fields are ignored.

**Replace, never truncate.** A chunk file is written under a temporary name and renamed into
place once complete: a process mapping the old file keeps reading its intact bytes (the old inode
lives as long as a mapping does). The next writer sweeps temporary files a killed writer left.

**One writer per directory** (:mod:`~insitubatch_nodes.cache.lock`). An advisory ``flock`` on
``.insitu.lock``, exclusive for a writer (spill or persistent), shared for ``readonly_cache=True``,
is taken when the cache opens and released once every mapping of its files is gone; a conflicting
process fails at once with :class:`CacheBusyError` naming the holder. Pipelines of one process
share the directory, and must keep each array alike there (``lock.share_arrays``).
``readonly_cache=True`` writes nothing (not even the lock file); a chunk missing from the cache
raises :class:`CacheMissError` naming the array and chunk.

**A full disk.** A file is mapped writable only once it has its blocks
(:mod:`~insitubatch_nodes.cache._filemap`): a full file system is never SIGBUS in a decode. The
persistent cache warns once and keeps the chunks that do not fit in RAM slots, not persisted
(:meth:`ChunkCache.new_slot` returns ``None``); spill raises :class:`CacheDiskFullError`.

**Ranks.** Under DDP rank ``r`` writes ``cache_dir`` (rank 0) or ``cache_dir/rank-<r>`` under its
lock, and reads every part's log as it grows (again from its start when replaced): a chunk any
rank completed is a hit for every rank, now and in later runs, and the disk holds one copy (its
latest line wins, whichever part logged it). Two ranks missing one chunk at once do not both
write it: the first to create its claim file in ``cache_dir/.claims`` does, the other keeps its
copy in memory. A second *job* on the directory fails at construction, on rank 0's lock.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes._atomic import close_with
from insitubatch_nodes.cache import _filemap
from insitubatch_nodes.cache import identity as store_identity
from insitubatch_nodes.cache._filemap import Region
from insitubatch_nodes.cache.files import (
    CLAIMS_NAME,
    CLOSE_WAIT_S,
    HEADER_KEY,
    LOG_FORMAT,
    LOG_NAME,
    RANK_DIRS,
    TMP_SUFFIX,
    SlotFile,
    SpillBacking,
    chunk_file_name,
    content_sum,
    file_prefix,
    free_bytes,
    map_new,
    rank_dir,
    read_npy_header,
    writer_dirs,
)
from insitubatch_nodes.cache.lock import (
    LOCK_NAME,
    DirLock,
    claim_abandoned,
    claim_note,
    not_writable,
    share_arrays,
    take_lock,
    unshare_arrays,
    warn_unarbitrated,
)
from insitubatch_nodes.cache.log import Log, Logged, entry_line, is_checked, matches, parse_entry
from insitubatch_nodes.cache.stale import Serves, StaleChunks
from insitubatch_nodes.errors import (
    CacheClosed,
    CacheDiskFullError,
    CacheMissError,
    CorruptCacheError,
    StaleCacheError,
)

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["ChunkCache"]

_log = logging.getLogger("insitubatch_nodes.cache")


class ChunkCache:
    """One pipeline's view of a cache directory (see the module docstring).

    ``fingerprints`` maps every array path the pipeline reads to its
    :func:`~insitubatch_nodes.cache.fingerprint.array_fingerprint`. The pool calls :meth:`find`,
    :meth:`new_slot`, :meth:`commit` and :meth:`drop` under its own lock, and :meth:`map_file`
    and :meth:`seal` on a decode thread (a hit on disk is mapped and checked there, off the IO
    loop); :meth:`close` releases the directory once every mapping is gone and :meth:`open`
    takes it again. ``verify=False`` serves cached chunks without checking their content (and
    trusts lines logged without a checksum); see the module docstring. ``serves`` (a
    read-only cache's) gives the chunk keys its plan reads: its stale chunks among them refuse
    it at open, the others when read (:mod:`~insitubatch_nodes.cache.stale`).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        fingerprints: Mapping[str, str],
        *,
        persist: bool = False,
        readonly: bool = False,
        reset_stale: bool = False,
        rank: int = 0,
        verify: bool = True,
        store_check: store_identity.StoreCheck | None = None,
        serves: Serves | None = None,
    ) -> None:
        if readonly and reset_stale:
            raise ValueError(
                "reset_stale_cache=True deletes files, and readonly_cache=True writes nothing: "
                "reset the cache with a writing run (readonly_cache=False) first"
            )
        self.root = Path(os.path.abspath(os.fspath(cache_dir)))
        self.fingerprints = dict(fingerprints)
        self.readonly = bool(readonly)
        self.persistent = bool(persist) or self.readonly
        self.reset_stale = bool(reset_stale)
        self.rank = int(rank)
        self.verify = bool(verify)
        self.own = rank_dir(self.root, self.rank)
        # unverified: lines without a checksum found by a writer, treated as misses (corrupt
        # files are counted by the pool, which refetches them)
        self.stats = {
            "committed": 0,
            "claimed_elsewhere": 0,
            "reset_files": 0,
            "unverified": 0,
            "stale_chunks": 0,
            "not_persisted": 0,
        }
        #: the store the chunks come from: checked at open, recorded by a writer (store_identity)
        self.store_check = store_check
        self.serves = serves
        self._stale = StaleChunks(self.root, "", serves)  # made anew at each open
        self.identity: store_identity.IdentityRecorder | None = None
        self._locks: list[DirLock] = []
        self._closing: list[DirLock] = []  # released by close() but waiting for mappings to go
        self._index: dict[tuple[str, int], Logged] = {}
        self._logs: dict[Path, Log] = {}
        self._log_fd: int | None = None
        self._log_closer: weakref.finalize[[int], object] | None = None  # closes _log_fd once
        self._spill: SpillBacking | None = None
        self._warned_commit = False
        self._warned_full = False
        self._mutex = threading.Lock()  # orders map_file against close
        self._files_lock = threading.Lock()  # orders commits against closing the log files
        self.closed = True
        self.open()
        weakref.finalize(self, ChunkCache._release_locks, self._locks)

    # -- opening and closing ----------------------------------------------------------------
    def open(self) -> None:
        """Take the directory (locks, sweep, log) — at construction, and again after close."""
        if not self.closed:
            return
        check = self.store_check
        if self.persistent and check is not None and check.enabled and check.cannot_check:
            raise ValueError(
                f"a persistent cache (cache_dir {self.root}) over store {check.name} could serve "
                f"values that changed in the store since they were cached: {check.cannot_check}"
                ". Pass check_store=False if the store is known not to change (an archive "
                "written once), or read the data through a local folder or an obstore-backed "
                "store (open_store(url)), whose objects are checked"
            )
        if self.readonly:
            if not (self.root / LOG_NAME).exists() and not self.root.is_dir():
                raise FileNotFoundError(
                    f"readonly_cache=True, but cache_dir {self.root} does not exist: warm it "
                    "first with a run that has persist=True"
                )
        else:
            try:
                self.own.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                if (better := not_writable(self.root, exc)) is None:
                    raise
                raise better from exc
        warn_unarbitrated(self.root)
        # list it afresh: a directory made again may reuse its inode
        RANK_DIRS.pop(self.root, None)
        locks: list[DirLock] = []
        try:
            if self.readonly:
                for d in writer_dirs(self.root):
                    if (d / LOCK_NAME).exists():
                        locks.append(take_lock(d, shared=True))
            else:
                locks.append(take_lock(self.own, shared=False))
                self._sweep()
            self._locks[:] = locks
            self._index.clear()
            self._logs.clear()
            self._stale = StaleChunks(self.root, check.name if check else "", self.serves)
            if self.persistent:
                share_arrays(self.root, self, self.fingerprints, self.store_check)  # before _load
                self._load()
                self._check_store()
            if self.persistent and not self.readonly:
                self._open_log()
                kind = None if self.store_check is None else self.store_check.kind
                if kind is not None:
                    self.identity = store_identity.IdentityRecorder(self.own, kind)
            if not self.persistent:
                self._spill = SpillBacking(self.own, locks[0])
        except BaseException as exc:
            # construction failed after taking the lock (a stale cache, a corrupt log): release
            # it here — nothing else would until the process exits
            self._close_files()
            unshare_arrays(self.root, self)
            for lock in locks:
                lock.release()
            self._locks[:] = []
            if _filemap.is_full(exc):
                assert isinstance(exc, OSError)
                raise CacheDiskFullError(
                    f"cache_dir {self.own} is full: there is no room for the cache's own files "
                    f"there ({exc}; {free_bytes(self.own)} free). Free space there, or point "
                    "cache_dir at a larger local disk.",
                    code=exc.errno or errno.ENOSPC,
                    directory=self.own,
                    nbytes=0,
                ) from exc
            raise
        self.closed = False

    def close(self) -> None:
        """Stop writing and release the directory once every mapping of it is gone.

        No mapping is made, and no chunk committed, once this has started. A mapping no longer
        used can be alive for a moment (a reference cycle, a fill winding down), so while a lock
        waits for mappings this collects garbage once and waits up to ``CLOSE_WAIT_S`` for them
        to go; mappings you hold (a slot) keep it locked after."""
        self.stop()
        self._close_files()
        unshare_arrays(self.root, self)
        locks = list(self._locks)
        self._release_locks(locks)
        # a close that had to leave locks waiting tries again here (what held them may be gone)
        locks += [lock for lock in self._closing if lock.waiting]
        self._locks[:] = []
        self._spill = None
        self.closed = True
        RANK_DIRS.pop(self.root, None)  # (a cache open on it again lists it afresh)
        self._closing = [lock for lock in locks if lock.waiting]
        if any(lock.waiting for lock in locks):
            gc.collect()
            # a fill that mapped a file just before the close lets go of it as it winds down
            deadline = time.monotonic() + CLOSE_WAIT_S
            while any(lock.waiting for lock in locks) and time.monotonic() < deadline:
                time.sleep(0.01)
            self._closing = [lock for lock in locks if lock.waiting]

    def stop(self) -> None:
        """The first step of :meth:`close`: from now on no file is mapped (idempotent)."""
        with self._mutex:
            self.closed = True

    @staticmethod
    def _release_locks(locks: list[DirLock]) -> None:
        for lock in locks:
            lock.release()

    def _close_files(self) -> None:
        """Close the log and the store-identity file (each is closed when collected too)."""
        with self._files_lock:
            closer, self._log_fd, self._log_closer = self._log_closer, None, None
            recorder, self.identity = self.identity, None
            if closer is not None:
                closer()
            if recorder is not None:
                recorder.close()

    def adopt(self, fingerprints: Mapping[str, str], tiles: Mapping[str, int]) -> None:
        """Cache arrays this cache was opened without too (``{path: fingerprint}``, ``{path:
        stored objects per chunk}``: a static array that ``set_views`` adds). Their chunks
        logged with another fingerprint are misses (rewritten by a writer); those whose stored
        objects changed are dropped (or refused: ``StaleCacheError``), as at open."""
        new = {p: fp for p, fp in fingerprints.items() if p not in self.fingerprints}
        if self.persistent and not self.closed:
            share_arrays(self.root, self, new, self.store_check)
        self.fingerprints.update(new)
        if self.store_check is not None:
            self.store_check.tiles.update({p: tiles[p] for p in new})
        for key in [k for k, lg in self._index.items() if new.get(k[0], lg.fp) != lg.fp]:
            self.forget(key)
        self._check_store(new)  # (nothing to list when nothing is new)

    def _check_store(self, arrays: Collection[str] | None = None) -> None:
        """Drop (a writer), or drop and refuse where served (``readonly``: :class:`StaleChunks`),
        the cached chunks of ``arrays`` (default: the pipeline's; another store's, sharing the
        directory, are not this store's to judge) whose stored objects changed since cached:
        one listing per array (see store_identity)."""
        check = self.store_check
        if check is None or not self._index:  # disabled: only chunks of another store are stale
            return
        arrays = self.fingerprints if arrays is None else arrays
        report = check.stale(store_identity.chunks_by_array(
            (key, logged.file) for key, logged in self._index.items() if key[0] in arrays
        ))  # fmt: skip
        for key in report.chunks:  # (a reader refuses them: when served, never serving them)
            self._index.pop(key, None)
        self.stats["stale_chunks"] += 0 if self.readonly else len(report.chunks)
        self._stale.found(report, self.readonly)

    @property
    def spill(self) -> SpillBacking | None:
        """The slot backing in spill mode (``None`` when persistent)."""
        return self._spill

    def _track(self, region: Region) -> None:
        for lock in self._locks:  # each directory stays locked while this mapping lives
            lock.track(region)

    def _sweep(self) -> None:
        """Remove what killed writers left: temp files here, claims of dead processes."""
        for tmp in self.own.glob(f".*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        claims = self.root / CLAIMS_NAME
        if not claims.is_dir():
            return
        for claim in claims.iterdir():
            try:
                if claim_abandoned(claim.read_text()):
                    claim.unlink(missing_ok=True)
            except OSError:
                continue

    # -- the log -----------------------------------------------------------------------------
    def _load(self) -> None:
        stale: dict[str, list[tuple[Path, int]]] = {}  # array -> (part, when) of its stale lines
        made: dict[str, int] = {}  # array -> when its newest line made as now was written
        own_entries: list[tuple[tuple[str, int], Logged]] = []
        torn_own = False
        dirs = writer_dirs(self.root)
        if self.own not in dirs:
            dirs.append(self.own)
        for d in dirs:
            log = self._logs[d] = Log(d)
            items, torn = log.read_new()
            if d == self.own:
                torn_own = torn
            for line_no, item in items:
                if HEADER_KEY in item:
                    if item[HEADER_KEY] != LOG_FORMAT:
                        # a log of another format tells us nothing we can check: all stale
                        for path in self.fingerprints:
                            stale.setdefault(path, []).append((d, 1 << 62))
                        break
                    continue
                key, logged = parse_entry(log, line_no, item)
                want = self.fingerprints.get(key[0])
                if want is not None and logged.fp != want:
                    stale.setdefault(key[0], []).append((d, logged.written))
                    continue
                made[key[0]] = max(made.get(key[0], 0), logged.written)
                if d == self.own:
                    own_entries.append((key, logged))
                if logged.supersedes(self._index.get(key)):
                    self._index[key] = logged
        if not self.reset_stale:  # older than a line made as now: left by a reset on fewer ranks
            stale = {p: [x for x in xs if x[1] >= made.get(p, 0)] for p, xs in stale.items()}
            stale = {p: xs for p, xs in stale.items() if xs}
        if stale and not self.reset_stale:
            where = ", ".join(
                f"{path!r} (in {', '.join(sorted({str(p) for p, _ in dirs_}))})"
                for path, dirs_ in sorted(stale.items())
            )
            raise StaleCacheError(
                f"cache_dir {self.root} holds chunks of {where} made with another geometry, "
                "decoding (mask_and_scale, cf_dtype), patches or chunk transforms than this "
                "pipeline's (or an earlier version of one, e.g. Coarsen or StandardScaler on "
                "float16; a run reading an array through patches() keeps its stored tiles, one "
                "reading whole fields its chunks: give each its own cache_dir). Pass "
                "reset_stale_cache=True to delete just those arrays' cached chunks and rebuild "
                "them, or use another cache_dir (delete this one to start over)."
            )
        if (stale and self.own in {p for ps in stale.values() for p, _ in ps}) or torn_own:
            self._rewrite_own_log(set(stale), own_entries)

    def _rewrite_own_log(
        self, stale_paths: set[str], kept: list[tuple[tuple[str, int], Logged]]
    ) -> None:
        """Drop the stale arrays' files and lines (and a torn last line) from our own log:
        written under a temporary name and renamed, so a crash leaves the old or the new."""
        keep_files = {logged.file.name for _, logged in kept}
        prefixes = tuple(file_prefix(path) for path in stale_paths)
        for f in self.own.glob("*.npy"):
            if prefixes and f.name.startswith(prefixes) and f.name not in keep_files:
                f.unlink(missing_ok=True)
                self.stats["reset_files"] += 1
        lines = [json.dumps({HEADER_KEY: LOG_FORMAT})]
        last: dict[tuple[str, int], Logged] = dict(kept)
        for key, logged in last.items():
            lines.append(entry_line(key, logged))
        tmp = self.own / f".{LOG_NAME}.{os.getpid()}{TMP_SUFFIX}"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.own / LOG_NAME)
        log = self._logs[self.own] = Log(self.own)
        log.read_new()  # positions past what we just wrote

    def _open_log(self) -> None:
        fd = os.open(self.own / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # closed by close(), or when this cache is collected (a pipeline dropped unclosed); a
        # failure below too: open() closes it
        self._log_fd, self._log_closer = fd, close_with(self, fd)
        if os.fstat(fd).st_size == 0:
            os.write(fd, (json.dumps({HEADER_KEY: LOG_FORMAT}) + "\n").encode())
            self._logs[self.own].read_new()

    def _refresh(self) -> None:
        """Read what the other writers (ranks, and other pipelines of this process) appended
        since the last look."""
        for d in writer_dirs(self.root):
            log = self._logs.get(d)
            if log is None:
                log = self._logs[d] = Log(d)
            items, _ = log.read_new()
            for line_no, item in items:
                if HEADER_KEY in item:
                    continue
                key, logged = parse_entry(log, line_no, item)
                old = self._index.get(key)
                if self.fingerprints.get(key[0]) == logged.fp and logged.supersedes(old):
                    self._index[key] = logged

    # -- slots -------------------------------------------------------------------------------
    def find(
        self, key: tuple[str, int], shape: tuple[int, ...], dtype: np.dtype[Any], valid: int
    ) -> Path | None:
        """The cached file of ``key``, or ``None`` (not cached, cached with another shape,
        dtype or valid-sample count, logged without a checksum, or its file is gone). Reads
        what other writers logged meanwhile. A read-only cache raises :class:`CacheMissError`
        for a chunk logged without a checksum (unless ``verify=False``)."""
        self._stale.refuse(key)  # (a read-only cache's stale chunk: never served)
        logged = self._index.get(key)
        if logged is None:
            self._refresh()
            logged = self._index.get(key)
        if logged is None or not matches(logged, shape, dtype, valid):
            return None
        if self.verify and not is_checked(logged):
            if self.readonly:
                raise CacheMissError(
                    f"chunk {key[1]} of array {key[0]!r} is in the read-only cache at "
                    f"{self.root}, but its file {logged.file.name} was logged without a "
                    "checksum (by a version before content checks), so its bytes cannot be "
                    "verified. Run a writer (persist=True) over the cache once: it fetches such "
                    "chunks again and rewrites them with a checksum. Or pass verify_cache=False "
                    "to trust the cache unchecked."
                )
            self.stats["unverified"] += 1
            self.forget(key)  # a miss: the chunk is fetched and its file rewritten
            return None
        if not logged.file.exists():  # deleted since it was logged: a miss, written again
            self.forget(key)
            return None
        return logged.file

    def forget(self, key: tuple[str, int]) -> None:
        """``key``'s file turned out unusable (gone, truncated): treat it as not cached."""
        self._index.pop(key, None)

    def map_file(
        self, file: Path, shape: tuple[int, ...], dtype: np.dtype[Any], key: tuple[str, int]
    ) -> np.ndarray | None:
        """A read-only mapping of ``key``'s cached file (``None`` when the file is gone,
        truncated, or holds another array), its bytes checked against the checksum logged with
        them: a mismatch raises :class:`CorruptCacheError` naming the file (the pool refetches
        the chunk when it writes the cache). Thread-safe: the fetch stage calls it on a decode
        thread; the check reads every page of the file once, outside the cache's mutex."""
        with self._mutex:
            if self.closed:
                raise CacheClosed(f"{self!r} was closed")
            array = self._map(file, shape, dtype)
        if array is None or not self.verify:
            return array
        logged = self._index.get(key)
        want = logged.checksum if logged is not None and logged.file == file else None
        got = content_sum(array)
        if got != want:
            raise CorruptCacheError(
                f"cached file {file} (chunk {key[1]} of array {key[0]!r}) does not match the "
                f"checksum logged with it ({got}, logged {want}): its bytes changed on disk "
                "since they were written (a disk or memory fault, a bad copy). It is never "
                "served. A writer (persist=True) fetches the chunk again and rewrites the "
                "file; or delete the file and warm the cache again."
            )
        return array

    def _map(self, file: Path, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            return None
        try:
            got_shape, got_dtype, offset = read_npy_header(fd)
            nbytes = math.prod(shape) * dtype.itemsize
            if got_shape != shape or got_dtype != dtype or os.fstat(fd).st_size < offset + nbytes:
                return None
            # not MAP_POPULATE: the gather's page faults map 16 pages each (fault-around) and
            # measured faster at the reference shape (2,100-2,450 against 1,850-1,950 samples/s)
            region = _filemap.map_file(fd, offset + nbytes, writable=False)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the mapping holds no descriptor
        self._track(region)
        return region.array(dtype, shape, offset)

    def new_slot(
        self, key: tuple[str, int], shape: tuple[int, ...], dtype: np.dtype[Any], valid: int
    ) -> SlotFile | None:
        """A writable slot that :meth:`commit` turns into ``key``'s cached file, or ``None``
        when another writer (rank) is writing that chunk now, or when the disk has no room for
        it (warned once): keep it in memory instead."""
        try:
            return self._new_slot(key, shape, dtype, valid)
        except OSError as exc:
            if not _filemap.is_full(exc):
                raise
        self.stats["not_persisted"] += 1
        if not self._warned_full:
            self._warned_full = True
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            warnings.warn(
                f"insitubatch_nodes: cache_dir {self.own} is full: chunk {key[1]} of array "
                f"{key[0]!r} ({nbytes:,} bytes) cannot get its disk blocks there "
                f"({free_bytes(self.own)} free). Chunks that do not fit are held in RAM for "
                "this run and not persisted — the data trained on is the same — and a later "
                "run fetches them again. Free space there, or point cache_dir at a larger local "
                "disk, to keep them.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None

    def _new_slot(
        self, key: tuple[str, int], shape: tuple[int, ...], dtype: np.dtype[Any], valid: int
    ) -> SlotFile | None:
        name = chunk_file_name(*key)
        claims = self.root / CLAIMS_NAME
        claims.mkdir(exist_ok=True)
        claim = claims / name
        try:
            fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self.stats["claimed_elsewhere"] += 1
            return None
        try:
            try:
                os.write(fd, claim_note().encode())
            finally:
                os.close(fd)
            self._refresh()  # logged by another rank just before our claim: read that instead
            logged = self._index.get(key)
            if matches(logged, shape, dtype, valid) and (not self.verify or is_checked(logged)):
                claim.unlink(missing_ok=True)
                return None
            array, tmp = map_new(self.own, name[:-4], shape, dtype, self._track)
        except BaseException:
            claim.unlink(missing_ok=True)
            raise
        if self.identity is not None:  # what its fill reads is recorded from now on
            self.identity.expect(key)
        return SlotFile(key, array, tmp, self.own / name, claim)

    @staticmethod
    def seal(slot: SlotFile) -> None:
        """The slot holds its chunk's final bytes: compute their checksum for :meth:`commit`
        (call it on a decode thread, not under the pool's lock; nothing may write the slot
        afterwards)."""
        slot.checksum = content_sum(slot.array)

    def commit(self, slot: SlotFile, valid: int) -> bool:
        """The slot holds its chunk's final bytes: rename it into place and log it with their
        checksum (the one :meth:`seal` computed, else computed here). A failure (disk full, ...)
        warns once and leaves the chunk uncached; returns whether it stuck."""
        with self._files_lock:  # (a close waits for this commit, or this sees it closed)
            if slot.committed or slot.dropped or self.closed or self._log_fd is None:
                return False
            try:
                checksum = slot.checksum or content_sum(slot.array)
                os.replace(slot.tmp, slot.final)
                slot.committed = True
                if self.identity is not None:  # after the file is in place, before its log line
                    self.identity.commit(slot.key)
                logged = Logged(
                    slot.final,
                    tuple(slot.array.shape),
                    slot.array.dtype.str,
                    int(valid),
                    self.fingerprints[slot.key[0]],
                    checksum,
                )
                Log.append(self._log_fd, entry_line(slot.key, logged) + "\n")
                self._index[slot.key] = logged
                self.stats["committed"] += 1
            except OSError as exc:
                if not self._warned_commit:
                    self._warned_commit = True
                    warnings.warn(
                        f"insitubatch_nodes: could not keep chunk {slot.key} in cache_dir "
                        f"{self.root} ({exc}); chunks that cannot be written stay uncached",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return False
            finally:
                slot.claim.unlink(missing_ok=True)
            return True

    def drop(self, slot: SlotFile) -> None:
        """The pool no longer uses ``slot``: an uncommitted file is removed with its claim."""
        if slot.dropped:
            return
        slot.dropped = True
        if not slot.committed:
            if self.identity is not None:
                self.identity.discard(slot.key)
            slot.tmp.unlink(missing_ok=True)
            slot.claim.unlink(missing_ok=True)

    def has(self, key: tuple[str, int]) -> bool:
        """Whether ``key`` is logged (with this pipeline's fingerprint)."""
        return key in self._index

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "persistent" if self.persistent else "spill"
        return f"ChunkCache({str(self.root)!r}, {mode}, rank={self.rank})"
