"""The cache directory: slots in files, chunks kept across runs, and one writer per directory.

``cache_dir`` moves the pool's slots from anonymous memory into memory-mapped files on local disk,
so the budget is held as page cache the kernel can write back and reclaim. Two modes:

* **spill** (``persist=False``): each slot is a file mapped and unlinked at once — it takes disk
  space only while mapped, and nothing is left behind, even by a killed process;
* **persistent** (``persist=True``): every chunk that completes (after its chunk transforms) is a
  ``.npy`` file that stays, and one line in the append-only log ``insitu_cache.jsonl`` records it
  the moment it lands (a single ``os.write`` of the whole line on an ``O_APPEND`` descriptor). A
  later pipeline over the same directory — a fresh process included — serves those chunks as
  hits: no fetch, no decode, no transform. Since the log is written as chunks land, a process
  killed mid-epoch (SIGKILL, OOM, preemption) leaves a cache the next run uses for everything
  that completed.

**Keys and identity.** A cached chunk is keyed by ``(array path, chunk index along the sample
axis)`` — the array's own index, so overlapping splits and sample ranges share entries. Every log
line carries the fingerprint of its array (:mod:`~insitubatch_nodes.fingerprint`: the geometry and
the chunk transforms scoped to that array). Opening a cache whose lines disagree with the current
fingerprint of an array the pipeline reads raises :class:`StaleCacheError` naming those arrays;
``reset_stale_cache=True`` deletes just their files and log lines instead. The data is checked
too (:mod:`~insitubatch_nodes.store_identity`): a writer records what identifies each stored
object it read in ``insitu_identity.jsonl`` as each chunk is committed, and opening lists each
cached array's prefix once — chunks whose objects changed, went or appeared are dropped (a
writer fetches them again) or raise :class:`StaleCacheError` naming them (``readonly``). A line
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
``verify=False`` skips both checks (it still writes checksums). Fields a version does not know
are ignored when a line is read.

**Replace, never truncate.** A chunk file is written under a temporary name and renamed into
place once its data is complete, so a process that maps the old file keeps reading the old,
intact bytes (the rename gives the name a new inode; the old one lives as long as a mapping
does). Temporary files a killed writer left are swept by the next writer of that directory.

**One writer per directory.** An advisory ``flock`` on ``.insitu.lock`` is taken when the cache
opens and released only after every mapping of its files is gone: exclusive for a writer (spill
or persistent), shared for ``readonly_cache=True``. A second writer, a writer while readers run,
or a reader while a writer runs, fails at once with :class:`CacheBusyError` naming the holder.
The kernel drops the lock when its holder exits, however it exits: there is no stale lock and no
cleanup step. Never delete the lock file: that releases nothing and lets the next two processes
lock different files. A network file system (where ``flock`` may be local to each client) or a
platform without ``flock`` warns that writers there are not arbitrated.

**Read-only.** ``readonly_cache=True`` writes nothing (not even the lock file) and a chunk missing
from the cache raises :class:`CacheMissError` naming the array and chunk: the run asserts that the
cache is complete for what it reads.

**A full disk.** A file is mapped writable only once it has its blocks
(:mod:`~insitubatch_nodes._filemap`), so a full file system is never SIGBUS in a decode: the
persistent cache warns once and leaves the chunks that do not fit in RAM slots, not persisted
(:meth:`ChunkCache.new_slot` returns ``None``); spill raises :class:`CacheDiskFullError` (its
slot memory does not move into RAM behind the budget's back). No mapping holds a descriptor.

**Ranks.** Under DDP each rank writes its own directory — ``cache_dir`` itself for rank 0,
``cache_dir/rank-<r>`` for rank ``r`` — holding that directory's lock, and reads the logs of all of
them (re-reading the others' as they grow), so a chunk any rank completed is a hit for every
rank, in this run and the next, and the disk holds one copy of it. Two ranks that miss the same
chunk at once (the tail chunks several ranks share, or an epoch boundary) do not both write it:
the first to create its claim file in ``cache_dir/.claims`` writes it, the other keeps its copy in
memory. A second *job* on the same directory fails at construction, on rank 0's lock.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import io
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from insitubatch_nodes import _filemap, store_identity
from insitubatch_nodes._filemap import Region

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CLAIMS_NAME",
    "LOCK_NAME",
    "LOG_NAME",
    "CacheBusyError",
    "CacheClosed",
    "CacheDiskFullError",
    "CacheMissError",
    "ChunkCache",
    "CorruptCacheError",
    "SlotFile",
    "SpillBacking",
    "StaleCacheError",
    "chunk_file_name",
    "rank_dir",
]

LOG_NAME = "insitu_cache.jsonl"
LOCK_NAME = ".insitu.lock"
CLAIMS_NAME = ".claims"
LOG_FORMAT = 1
_HEADER_KEY = "insitubatch_nodes_cache"
_SUM_KEY = "sum"  # the log field of a chunk's checksum
_SUM_ALGO = "xxh3-64"  # the only algorithm written; a line with another is a miss, unverified
_log = logging.getLogger(__name__)
_TMP_SUFFIX = ".tmp"
_CLOSE_WAIT_S = 2.0  # the most close() waits for winding-down fills to unmap (module doc)
# file systems on which flock may be emulated per client (two hosts can both "hold" it)
_NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "lustre", "gpfs", "beegfs",
    "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
    "fuse.juicefs", "fuse.ceph", "virtiofs",
}  # fmt: skip


class CacheBusyError(RuntimeError):
    """Another process holds the cache directory in a conflicting mode (see the module doc)."""


class StaleCacheError(RuntimeError):
    """The cache holds chunks of arrays whose geometry or chunk transforms have changed, or
    whose stored objects changed since they were cached (see ``store_identity``)."""


class CacheMissError(RuntimeError):
    """``readonly_cache=True`` and a chunk the run reads is not in the cache."""


class CacheClosed(RuntimeError):
    """The cache was closed (its pipeline closed) while a fill still wanted a file mapped."""


class CorruptCacheError(RuntimeError):
    """The cache's log cannot be trusted (malformed line, or a file outside the directory), or
    a cached chunk's bytes no longer match the checksum logged with it (read-only readers)."""


class CacheDiskFullError(OSError):
    """The file system of ``cache_dir`` has no room for the file slot memory needs (spill mode),
    or for the cache's own files at construction. ``errno`` is ENOSPC (EDQUOT for a quota);
    ``directory`` and ``nbytes`` say where and how much."""

    def __init__(self, message: str, *, code: int, directory: Path, nbytes: int) -> None:
        super().__init__(code, message)
        self.directory = directory
        self.nbytes = nbytes

    def __str__(self) -> str:
        return str(self.strerror)


def _free_bytes(directory: Path) -> str:
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # pragma: no cover - no statvfs (Windows)
        return "an unknown number of bytes"
    return f"{st.f_bavail * st.f_frsize:,} bytes"


def rank_dir(cache_dir: Path, rank: int) -> Path:
    """The directory rank ``rank`` writes: ``cache_dir`` for rank 0, ``cache_dir/rank-<r>``."""
    return cache_dir if rank == 0 else cache_dir / f"rank-{rank}"


_RANK_DIRS: dict[Path, tuple[tuple[int, int, int], list[Path]]] = {}


def _writer_dirs(cache_dir: Path) -> list[Path]:
    """``cache_dir`` and its ``rank-<r>`` directories, in rank order.

    The cache asks at every miss, and listing a directory of 10,000 chunk files takes ~20 ms:
    the list is made again only when the directory's link count — 2 plus its subdirectories on
    ext4, XFS and tmpfs — has changed. Where it does not count them (btrfs: always 1) every
    call lists the directory."""
    try:
        st = cache_dir.stat()
    except OSError:
        return [cache_dir]
    stamp = (st.st_dev, st.st_ino, st.st_nlink)
    known = _RANK_DIRS.get(cache_dir)
    if known is not None and known[0] == stamp and st.st_nlink >= 2:
        return list(known[1])
    found = [cache_dir]
    if cache_dir.is_dir():
        found += sorted(
            (p for p in cache_dir.glob("rank-*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
    _RANK_DIRS[cache_dir] = (stamp, found)
    return list(found)


def _file_prefix(path: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in path) or "array"
    return f"{safe}-{hashlib.sha256(path.encode()).hexdigest()[:8]}."


def chunk_file_name(path: str, chunk: int) -> str:
    """The file a cached chunk lives in: a bare name, readable, unique per ``(path, chunk)``."""
    return f"{_file_prefix(path)}{int(chunk)}.npy"


def content_sum(array: np.ndarray) -> str:
    """The checksum the log records for a chunk: ``"xxh3-64:<16 hex digits>"``, xxhash's
    XXH3 (64 bits) over ``array``'s bytes in C order — for a cached file, its data after the
    ``.npy`` header. xxhash releases the GIL while it hashes."""
    data = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    return f"{_SUM_ALGO}:{xxhash.xxh3_64_intdigest(data.data):016x}"


def _npy_header(shape: tuple[int, ...], dtype: np.dtype[Any]) -> bytes:
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def _read_npy_header(fd: int) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    with os.fdopen(os.dup(fd), "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        if fortran:
            raise ValueError("a Fortran-ordered file is not a cached slot")
        return tuple(shape), np.dtype(dtype), fh.tell()


# -------------------------------------------------------------------------------------------
# The lock
# -------------------------------------------------------------------------------------------


def _lock_pids(lock: Path) -> list[tuple[int, str]]:
    """``(pid, "READ"|"WRITE")`` of the processes holding a flock on ``lock`` (Linux only)."""
    try:
        st = lock.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == dev:
            out.append((int(parts[4]), parts[3]))
    return out


def _mount_type(path: Path) -> str | None:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    real, best, kind = str(path.resolve()), "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, parts[2]
    return kind


def _warn_unarbitrated(directory: Path) -> None:
    if fcntl is None:  # pragma: no cover - Windows
        reason = "this platform has no POSIX flock"
    else:
        kind = _mount_type(directory)
        if kind is None or kind not in _NETWORK_FS:
            return
        reason = f"it is on a network file system ({kind}), where flock may hold on one client only"
    warnings.warn(
        f"insitubatch_nodes: cache_dir {directory} is not arbitrated: {reason}. Two processes "
        "writing it at once can corrupt each other's chunks there. Use a local disk, or make "
        "sure only one job writes this directory (any number may read it with "
        "readonly_cache=True).",
        UserWarning,
        stacklevel=4,
    )


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def not_writable(directory: Path, exc: OSError) -> OSError | None:
    """``exc`` (an ``OSError`` creating or writing something in ``directory``) as the same
    error type with a message that says what to do, when the cause is that the directory is
    read-only to this process (``EROFS``, ``EACCES``, ``EPERM``); else ``None``."""
    if exc.errno not in _NOT_WRITABLE:
        return None
    return type(exc)(
        exc.errno,
        f"cache_dir {directory} is not writable ({os.strerror(exc.errno)}: cannot write "
        f"{exc.filename or directory}); a pipeline that warms or spills to a cache_dir writes "
        "there. To read a cache warmed elsewhere without writing, pass readonly_cache=True; "
        "to warm one, point cache_dir at a directory this process can write",
        exc.filename,
    )


class DirLock:
    """The advisory lock on one directory's ``.insitu.lock``, released only after :meth:`release`
    has been called *and* every mapping registered with :meth:`track` has been unmapped."""

    def __init__(self, directory: Path, *, shared: bool) -> None:
        self.path = directory / LOCK_NAME
        self.shared = shared
        self._mutex = threading.Lock()
        self._live = 0
        self._holders = 1
        self._closing = False
        if shared:
            fd = os.open(self.path, os.O_RDONLY)
        else:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                if (better := not_writable(directory, exc)) is None:
                    raise
                raise better from exc
        if fcntl is not None:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                message = self._busy_message(fd)
                os.close(fd)
                raise CacheBusyError(message) from None
        if not shared:  # who holds it, for the message a second writer gets
            note = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
            except OSError as exc:  # a full disk: the note is only for the busy message
                if not _filemap.is_full(exc):
                    os.close(fd)
                    raise
        self._fd: int | None = fd

    def _busy_message(self, fd: int) -> str:
        want = "read" if self.shared else "write"
        held_shared = False
        if not self.shared and fcntl is not None:
            try:  # a shared lock we can take means readers hold it, not a writer
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                held_shared = True
            except OSError:
                pass
        pids = _lock_pids(self.path)
        host = socket.gethostname()
        if held_shared:
            readers = sorted({p for p, kind in pids if kind == "READ"})
            who = (
                f"{len(readers) or 'some'} read-only process(es) "
                f"({', '.join(f'pid {p}' for p in readers) or 'pids unknown'}, on {host}) "
                "hold it shared (readonly_cache=True); a writer must wait until they finish"
            )
        else:
            try:
                note = json.loads(self.path.read_text() or "{}")
            except (OSError, ValueError):
                note = {}
            if note.get("pid") is not None:
                who = (
                    f"pid {note['pid']} on host {note.get('host', '?')} (since "
                    f"{note.get('since', '?')}) writes it"
                )
            else:
                writers = [p for p, kind in pids if kind == "WRITE"]
                who = f"pid {writers[0]} on {host} writes it" if writers else "a writer holds it"
        if any(pid == os.getpid() for pid, _ in pids) or f"pid {os.getpid()} " in who:
            who += (
                " — that is this process: close its other pipeline on this cache_dir first "
                "(pipelines of one process may all write it, or all read it, not both)"
            )
        return (
            f"cannot {want} cache_dir {self.path.parent}: {who}. Only one process may write a "
            "cache_dir, and no reader may use it meanwhile; readers (readonly_cache=True) share "
            "it with each other. If that process is still running, give this run its own "
            "cache_dir, wait for it, or read alongside other readers with readonly_cache=True. "
            "A process that has exited holds nothing — the kernel drops its lock — so if it is "
            f"gone, just retry. See who holds it: `fuser -v {self.path}` or `lsof {self.path}`. "
            f"Never delete {self.path}: that releases nothing and lets two writers in."
        )

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def waiting(self) -> bool:
        """Released by every holder, still held for mappings alive."""
        with self._mutex:
            return self._closing and self._fd is not None

    def track(self, region: Region) -> None:
        """Keep the lock until ``region`` has been unmapped (once it and every array over it
        are garbage collected: :mod:`~insitubatch_nodes._filemap`)."""
        with self._mutex:
            self._live += 1
        region.on_unmap(self._unmapped)

    def _unmapped(self) -> None:
        with self._mutex:
            self._live -= 1
            if self._closing and self._live == 0:
                self._drop()

    def release(self) -> None:
        """One holder lets go; the last one's release takes effect once every tracked mapping
        is gone (at once when none is left)."""
        with self._mutex:
            self._holders -= 1
            if self._holders > 0:
                return
            self._closing = True
            if self._live == 0:
                self._drop()

    def _join(self) -> bool:
        """Become one more holder of this (still held) lock."""
        with self._mutex:
            if self._fd is None:
                return False
            self._holders += 1
            self._closing = False
            return True

    def _drop(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


_WARNED_UNCHECKED: set[tuple[str, str]] = set()  # (cache_dir, store) warned about, once each
_WRITERS: dict[str, DirLock] = {}  # lock file -> the exclusive lock this process holds on it
_WRITERS_LOCK = threading.Lock()


def take_lock(directory: Path, *, shared: bool) -> DirLock:
    """Lock ``directory``: a shared lock of its own, or this process's exclusive one — pipelines
    of one process (a training and a validation pipeline) write one ``cache_dir`` together."""
    if shared:
        return DirLock(directory, shared=True)
    key = os.path.realpath(directory / LOCK_NAME)
    with _WRITERS_LOCK:
        lock = _WRITERS.get(key)
        if lock is not None and lock._join():
            return lock
        lock = _WRITERS[key] = DirLock(directory, shared=False)
        return lock


# -------------------------------------------------------------------------------------------
# Mapped files
# -------------------------------------------------------------------------------------------

_counter = itertools.count()


def _map_new(
    directory: Path,
    stem: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    track: Callable[[Region], None],
) -> tuple[np.ndarray, Path]:
    """A writable mapping of a new ``.npy`` file in ``directory`` under a temporary name.

    The file gets its blocks before it is mapped (:func:`~insitubatch_nodes._filemap.reserve`),
    so no write into the array can fault for space: a file system without room raises
    ``OSError`` here (ENOSPC or EDQUOT, :func:`~insitubatch_nodes._filemap.is_full`) and leaves
    no file behind. The mapping holds no descriptor."""
    header = _npy_header(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    tmp = directory / f".{stem}.{os.getpid()}.{next(_counter)}{_TMP_SUFFIX}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _filemap.reserve(fd, len(header) + nbytes)
        os.pwrite(fd, header, 0)
        region = _filemap.map_file(fd, len(header) + nbytes, writable=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    track(region)
    return region.array(dtype, shape, len(header)), tmp


class SpillBacking:
    """Slot memory from files in a directory, each mapped and unlinked at once (spill mode)."""

    name = "spill"

    def __init__(self, directory: Path, lock: DirLock) -> None:
        self.directory = directory
        self.lock = lock

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A slot file's mapping; raises :class:`CacheDiskFullError` when the file system has
        no room for it (slot memory is what the user put on this disk: it does not move into
        RAM behind the budget's back)."""
        dtype = np.dtype(dtype)
        try:
            array, tmp = _map_new(self.directory, "spill", tuple(shape), dtype, self.lock.track)
        except OSError as exc:
            if not _filemap.is_full(exc):
                raise
            nbytes = math.prod(shape) * dtype.itemsize
            raise CacheDiskFullError(
                f"cache_dir {self.directory} is full: a spill slot of {nbytes:,} bytes cannot "
                f"get its disk blocks there ({exc.strerror}; {_free_bytes(self.directory)} "
                "free). Without persist=True the pool's slot memory — up to cache_budget_bytes "
                "— lives in files in cache_dir, and that file system must hold it. Free space "
                "there, point cache_dir at a larger local disk, lower cache_budget_bytes (None "
                "sizes it to the working set), or drop cache_dir to keep the slots in RAM.",
                code=exc.errno or errno.ENOSPC,
                directory=self.directory,
                nbytes=nbytes,
            ) from exc
        tmp.unlink()  # the mapping keeps the inode: disk space only while mapped
        return array

    def release(self, buffer: np.ndarray) -> None:
        del buffer  # unmapped when the last view is dropped


@dataclass(eq=False)
class SlotFile:
    """A writable slot that becomes the cached file of ``key`` once :meth:`ChunkCache.commit` ed."""

    key: tuple[str, int]
    array: np.ndarray
    tmp: Path
    final: Path
    claim: Path
    committed: bool = False
    dropped: bool = False
    checksum: str | None = None  # set by ChunkCache.seal (else by commit) over the final bytes


@dataclass(frozen=True)
class _Logged:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    valid: int
    fp: str
    checksum: str | None = None  # content_sum of the file's data; None: logged without one


class _Log:
    """One writer directory's log, read incrementally (whole lines only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOG_NAME
        self.offset = 0
        self.line_no = 0
        self.header_seen = False

    def read_new(self) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
        """New complete lines since the last call; ``(entries, torn)`` — ``torn`` when the file
        ends in a partial line (a crash cut the last write short)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return [], False
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: empty, or a partial line
        entries: list[tuple[int, dict[str, Any]]] = []
        for raw in lines:
            self.line_no += 1
            self.offset += len(raw) + 1
            try:
                item = json.loads(raw)
                if not isinstance(item, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise CorruptCacheError(
                    f"{self.path} line {self.line_no} is not a cache entry ({raw[:80]!r}); the "
                    "log cannot be trusted. Delete the cache directory to start over."
                ) from None
            if not self.header_seen:
                self.header_seen = True
                if _HEADER_KEY not in item:
                    raise CorruptCacheError(
                        f"{self.path} does not start with a cache header; it was not written by "
                        "insitubatch_nodes. Point cache_dir at a directory of its own."
                    )
            entries.append((self.line_no, item))
        return entries, bool(tail)


def _parse_entry(
    log: _Log, line_no: int, item: Mapping[str, Any]
) -> tuple[tuple[str, int], _Logged]:
    where = f"{log.path} line {line_no}"
    try:
        array, chunk, name = item["array"], item["chunk"], item["file"]
        shape = tuple(int(n) for n in item["shape"])
        dtype, valid, fp = str(item["dtype"]), int(item["valid"]), str(item["fp"])
        checksum = item.get(_SUM_KEY)
    except (KeyError, TypeError, ValueError):
        raise CorruptCacheError(
            f"{where} lacks a field of a cache entry ({dict(item)!r}); delete the cache "
            "directory to start over"
        ) from None
    if not isinstance(array, str) or not isinstance(chunk, int) or not isinstance(name, str):
        raise CorruptCacheError(f"{where} has a malformed entry {dict(item)!r}")
    bare = name not in ("", ".", "..") and os.path.basename(name) == name and "\\" not in name
    if not bare or name.startswith("."):
        raise CorruptCacheError(
            f"{where} names file {name!r}, which is not a bare file name inside {log.directory}; "
            "the log has been tampered with or corrupted. Delete the cache directory."
        )
    if checksum is not None and not isinstance(checksum, str):
        raise CorruptCacheError(f"{where} has a malformed checksum {checksum!r}")
    return (array, chunk), _Logged(log.directory / name, shape, dtype, valid, fp, checksum)


# -------------------------------------------------------------------------------------------
# The cache
# -------------------------------------------------------------------------------------------


class ChunkCache:
    """One pipeline's view of a cache directory (see the module docstring).

    ``fingerprints`` maps every array path the pipeline reads to its
    :func:`~insitubatch_nodes.fingerprint.array_fingerprint`. The pool calls :meth:`find`,
    :meth:`new_slot`, :meth:`commit` and :meth:`drop` under its own lock, and :meth:`map_file`
    and :meth:`seal` on a decode thread (a hit on disk is mapped and checked there, off the IO
    loop); :meth:`close` releases the directory once every mapping is gone and :meth:`open`
    takes it again. ``verify=False`` serves cached chunks without checking their content (and
    trusts lines logged without a checksum); see the module docstring.
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
        self.identity: store_identity.IdentityRecorder | None = None
        self._locks: list[DirLock] = []
        self._index: dict[tuple[str, int], _Logged] = {}
        self._logs: dict[Path, _Log] = {}
        self._log_fd: int | None = None
        self._spill: SpillBacking | None = None
        self._warned_commit = False
        self._warned_full = False
        self._mutex = threading.Lock()  # orders map_file against close
        self.closed = True
        self.open()
        weakref.finalize(self, ChunkCache._release_locks, self._locks)

    # -- opening and closing ----------------------------------------------------------------
    def open(self) -> None:
        """Take the directory (locks, sweep, log) — at construction, and again after close."""
        if not self.closed:
            return
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
        _warn_unarbitrated(self.root)
        # list it afresh: a directory made again may reuse its inode
        _RANK_DIRS.pop(self.root, None)
        locks: list[DirLock] = []
        try:
            if self.readonly:
                for d in _writer_dirs(self.root):
                    if (d / LOCK_NAME).exists():
                        locks.append(take_lock(d, shared=True))
            else:
                locks.append(take_lock(self.own, shared=False))
                self._sweep()
            self._locks[:] = locks
            self._index.clear()
            self._logs.clear()
            if self.persistent:
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
            self._close_log()
            self._close_identity()
            for lock in locks:
                lock.release()
            self._locks[:] = []
            if _filemap.is_full(exc):
                assert isinstance(exc, OSError)
                raise CacheDiskFullError(
                    f"cache_dir {self.own} is full: there is no room for the cache's own files "
                    f"there ({exc}; {_free_bytes(self.own)} free). Free space there, or point "
                    "cache_dir at a larger local disk.",
                    code=exc.errno or errno.ENOSPC,
                    directory=self.own,
                    nbytes=0,
                ) from exc
            raise
        self.closed = False

    def close(self) -> None:
        """Stop writing and release the directory once every mapping of it is gone.

        No mapping is made once this has started. A mapping the pipeline no longer uses can
        still be alive for a moment — in a reference cycle (the traceback of an error that
        stopped an epoch holds frames that held slots), or in a fill that is winding down — so
        while a lock waits for mappings this collects garbage once and waits up to
        ``_CLOSE_WAIT_S`` for them to go; mappings you hold (a slot) keep it locked after."""
        self.stop()
        self._close_log()
        self._close_identity()
        locks = list(self._locks)
        self._release_locks(locks)
        self._locks[:] = []
        self._spill = None
        self.closed = True
        if any(lock.waiting for lock in locks):
            gc.collect()
            # a fill that mapped a file just before the close lets go of it as it winds down
            deadline = time.monotonic() + _CLOSE_WAIT_S
            while any(lock.waiting for lock in locks) and time.monotonic() < deadline:
                time.sleep(0.01)

    def stop(self) -> None:
        """The first step of :meth:`close`: from now on no file is mapped (idempotent)."""
        with self._mutex:
            self.closed = True

    @staticmethod
    def _release_locks(locks: list[DirLock]) -> None:
        for lock in locks:
            lock.release()

    def _close_log(self) -> None:
        fd, self._log_fd = self._log_fd, None
        if fd is not None:
            os.close(fd)

    def _close_identity(self) -> None:
        recorder, self.identity = self.identity, None
        if recorder is not None:
            recorder.close()

    def _check_store(self) -> None:
        """Drop (a writer) or refuse (``readonly``) the cached chunks whose stored objects
        changed since they were cached: one listing per array (see store_identity)."""
        check = self.store_check
        if check is None or not check.enabled or not self._index:
            return
        report = check.stale(store_identity.chunks_by_array(
            (key, logged.file) for key, logged in self._index.items()
        ))  # fmt: skip
        if report.unchecked is not None:
            if (str(self.root), check.name) in _WARNED_UNCHECKED:
                return
            _WARNED_UNCHECKED.add((str(self.root), check.name))
            warnings.warn(
                f"insitubatch_nodes: cache_dir {self.root} is trusted without checking store "
                f"{check.name}: {report.unchecked}. A chunk whose stored objects changed since "
                "it was cached would be served as cached. Pass check_store=False if the store "
                "is known not to change (this warning goes), or give the changed data a new "
                "cache_dir.",
                UserWarning,
                stacklevel=5,
            )
            return
        if not report.chunks:
            return
        if self.readonly:
            raise StaleCacheError(store_identity.stale_message(self.root, check.name, report))
        for key in report.chunks:
            self._index.pop(key, None)
        self.stats["stale_chunks"] += len(report.chunks)
        _log.warning(
            "insitubatch_nodes: %d cached chunk(s) in %s are stale (their stored objects in %s "
            "changed): they are fetched again and rewritten: %s",
            len(report.chunks),
            self.root,
            check.name,
            report.describe(),
        )

    @property
    def spill(self) -> SpillBacking | None:
        """The slot backing in spill mode (``None`` when persistent)."""
        return self._spill

    def _track(self, region: Region) -> None:
        for lock in self._locks:  # each directory stays locked while this mapping lives
            lock.track(region)

    def _sweep(self) -> None:
        """Remove what killed writers left: temp files here, claims of dead processes."""
        for tmp in self.own.glob(f".*{_TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        claims = self.root / CLAIMS_NAME
        if not claims.is_dir():
            return
        host = socket.gethostname()
        for claim in claims.iterdir():
            try:
                owner_host, pid = claim.read_text().split()
                if owner_host == host and not _alive(int(pid)):
                    claim.unlink(missing_ok=True)
            except (OSError, ValueError):
                continue

    # -- the log -----------------------------------------------------------------------------
    def _load(self) -> None:
        stale: dict[str, list[Path]] = {}
        own_entries: list[tuple[tuple[str, int], _Logged]] = []
        torn_own = False
        dirs = _writer_dirs(self.root)
        if self.own not in dirs:
            dirs.append(self.own)
        for d in dirs:
            log = self._logs[d] = _Log(d)
            items, torn = log.read_new()
            if d == self.own:
                torn_own = torn
            for line_no, item in items:
                if _HEADER_KEY in item:
                    if item[_HEADER_KEY] != LOG_FORMAT:
                        # a log of another format tells us nothing we can check: all stale
                        for path in self.fingerprints:
                            stale.setdefault(path, []).append(d)
                        break
                    continue
                key, logged = _parse_entry(log, line_no, item)
                want = self.fingerprints.get(key[0])
                if want is not None and logged.fp != want:
                    stale.setdefault(key[0], []).append(d)
                    continue
                if d == self.own:
                    own_entries.append((key, logged))
                self._index[key] = logged
        if stale and not self.reset_stale:
            where = ", ".join(
                f"{path!r} (in {', '.join(sorted({str(p) for p in dirs_}))})"
                for path, dirs_ in sorted(stale.items())
            )
            raise StaleCacheError(
                f"cache_dir {self.root} holds chunks of {where} made with another geometry or "
                "other chunk transforms than this pipeline's. Pass reset_stale_cache=True to "
                "delete just those arrays' cached chunks and rebuild them, or use another "
                "cache_dir (delete this one to start over)."
            )
        if (stale and self.own in {p for ps in stale.values() for p in ps}) or torn_own:
            self._rewrite_own_log(set(stale), own_entries)

    def _rewrite_own_log(
        self, stale_paths: set[str], kept: list[tuple[tuple[str, int], _Logged]]
    ) -> None:
        """Drop the stale arrays' files and lines (and a torn last line) from our own log:
        written under a temporary name and renamed, so a crash leaves the old or the new."""
        keep_files = {logged.file.name for _, logged in kept}
        prefixes = tuple(_file_prefix(path) for path in stale_paths)
        for f in self.own.glob("*.npy"):
            if prefixes and f.name.startswith(prefixes) and f.name not in keep_files:
                f.unlink(missing_ok=True)
                self.stats["reset_files"] += 1
        lines = [json.dumps({_HEADER_KEY: LOG_FORMAT})]
        last: dict[tuple[str, int], _Logged] = dict(kept)
        for key, logged in last.items():
            lines.append(_entry_line(key, logged))
        tmp = self.own / f".{LOG_NAME}.{os.getpid()}{_TMP_SUFFIX}"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.own / LOG_NAME)
        log = self._logs[self.own] = _Log(self.own)
        log.read_new()  # positions past what we just wrote

    def _open_log(self) -> None:
        path = self.own / LOG_NAME
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size == 0:
            os.write(fd, (json.dumps({_HEADER_KEY: LOG_FORMAT}) + "\n").encode())
            self._logs[self.own].read_new()
        self._log_fd = fd

    def _refresh(self) -> None:
        """Read what the other writers (ranks, and other pipelines of this process) appended
        since the last look."""
        for d in _writer_dirs(self.root):
            log = self._logs.get(d)
            if log is None:
                log = self._logs[d] = _Log(d)
            items, _ = log.read_new()
            for line_no, item in items:
                if _HEADER_KEY in item:
                    continue
                key, logged = _parse_entry(log, line_no, item)
                if self.fingerprints.get(key[0]) == logged.fp:
                    self._index[key] = logged

    # -- slots -------------------------------------------------------------------------------
    def find(
        self, key: tuple[str, int], shape: tuple[int, ...], dtype: np.dtype[Any], valid: int
    ) -> Path | None:
        """The cached file of ``key``, or ``None`` (not cached, cached with another shape,
        dtype or valid-sample count, logged without a checksum, or its file is gone). Reads
        what other writers logged meanwhile. A read-only cache raises :class:`CacheMissError`
        for a chunk logged without a checksum (unless ``verify=False``)."""
        logged = self._index.get(key)
        if logged is None:
            self._refresh()
            logged = self._index.get(key)
        if logged is None or not _matches(logged, shape, dtype, valid):
            return None
        if self.verify and not _checked(logged):
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
            got_shape, got_dtype, offset = _read_npy_header(fd)
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
                f"({_free_bytes(self.own)} free). Chunks that do not fit are held in RAM for "
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
                os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            finally:
                os.close(fd)
            self._refresh()  # logged by another rank just before our claim: read that instead
            logged = self._index.get(key)
            if _matches(logged, shape, dtype, valid) and (not self.verify or _checked(logged)):
                claim.unlink(missing_ok=True)
                return None
            array, tmp = _map_new(self.own, name[:-4], shape, dtype, self._track)
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
        if slot.committed or slot.dropped or self._log_fd is None:
            return False
        try:
            checksum = slot.checksum or content_sum(slot.array)
            os.replace(slot.tmp, slot.final)
            slot.committed = True
            if self.identity is not None:  # after the file is in place, before its log line
                self.identity.commit(slot.key)
            logged = _Logged(
                slot.final,
                tuple(slot.array.shape),
                slot.array.dtype.str,
                int(valid),
                self.fingerprints[slot.key[0]],
                checksum,
            )
            os.write(self._log_fd, (_entry_line(slot.key, logged) + "\n").encode())
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


def _matches(
    logged: _Logged | None, shape: tuple[int, ...], dtype: np.dtype[Any], valid: int
) -> bool:
    return (
        logged is not None
        and logged.shape == shape
        and logged.dtype == dtype.str
        and logged.valid == valid
    )


def _checked(logged: _Logged | None) -> bool:
    """Whether ``logged`` carries a checksum this version verifies."""
    return (
        logged is not None
        and logged.checksum is not None
        and logged.checksum.startswith(f"{_SUM_ALGO}:")
    )


def _entry_line(key: tuple[str, int], logged: _Logged) -> str:
    return json.dumps(
        {
            "array": key[0],
            "chunk": int(key[1]),
            "file": logged.file.name,
            "shape": list(logged.shape),
            "dtype": logged.dtype,
            "valid": logged.valid,
            "fp": logged.fp,
            **({_SUM_KEY: logged.checksum} if logged.checksum is not None else {}),
        },
        separators=(",", ":"),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
