"""The cache directory's files: names, the ``.npy`` layout, mapped slots and spill files."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import itertools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from insitubatch_nodes.cache import _filemap
from insitubatch_nodes.cache._filemap import Region
from insitubatch_nodes.errors import CacheDiskFullError

if TYPE_CHECKING:
    from insitubatch_nodes.cache.lock import DirLock

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CLAIMS_NAME",
    "LOG_FORMAT",
    "LOG_NAME",
    "SlotFile",
    "SpillBacking",
    "chunk_file_name",
    "content_sum",
    "rank_dir",
]


LOG_NAME = "insitu_cache.jsonl"
CLAIMS_NAME = ".claims"
LOG_FORMAT = 1
HEADER_KEY = "insitubatch_nodes_cache"
SUM_KEY = "sum"  # the log field of a chunk's checksum
SUM_ALGO = "xxh3-64"  # the only algorithm written; a line with another is a miss, unverified
_log = logging.getLogger("insitubatch_nodes.cache")
TMP_SUFFIX = ".tmp"
CLOSE_WAIT_S = 2.0  # the most close() waits for winding-down fills to unmap (module doc)


def free_bytes(directory: Path) -> str:
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # pragma: no cover - no statvfs (Windows)
        return "an unknown number of bytes"
    return f"{st.f_bavail * st.f_frsize:,} bytes"


def rank_dir(cache_dir: Path, rank: int) -> Path:
    """The directory rank ``rank`` writes: ``cache_dir`` for rank 0, ``cache_dir/rank-<r>``."""
    return cache_dir if rank == 0 else cache_dir / f"rank-{rank}"


RANK_DIRS: dict[Path, tuple[tuple[int, int, int], list[Path]]] = {}
"""The memo of :func:`writer_dirs`, by directory: at most :data:`RANK_DIRS_KEPT` entries, the
oldest dropped first, and a directory's dropped when its cache closes (a sweep building
thousands of pipelines, each with a cache directory of its own, kept one entry per directory
for the rest of the process before 2026-12-07)."""
RANK_DIRS_KEPT = 64


def writer_dirs(cache_dir: Path) -> list[Path]:
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
    known = RANK_DIRS.get(cache_dir)
    if known is not None and known[0] == stamp and st.st_nlink >= 2:
        return list(known[1])
    found = [cache_dir]
    if cache_dir.is_dir():
        found += sorted(
            (p for p in cache_dir.glob("rank-*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
    if known is None and len(RANK_DIRS) >= RANK_DIRS_KEPT:  # the oldest goes (another thread
        with contextlib.suppress(StopIteration, KeyError, RuntimeError):  # may drop it first)
            del RANK_DIRS[next(iter(RANK_DIRS))]
    RANK_DIRS[cache_dir] = (stamp, found)
    return list(found)


def file_prefix(path: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in path) or "array"
    return f"{safe}-{hashlib.sha256(path.encode()).hexdigest()[:8]}."


def chunk_file_name(path: str, chunk: int) -> str:
    """The file a cached chunk lives in: a bare name, readable, unique per ``(path, chunk)``."""
    return f"{file_prefix(path)}{int(chunk)}.npy"


def content_sum(array: np.ndarray) -> str:
    """The checksum the log records for a chunk: ``"xxh3-64:<16 hex digits>"``, xxhash's
    XXH3 (64 bits) over ``array``'s bytes in C order — for a cached file, its data after the
    ``.npy`` header. xxhash releases the GIL while it hashes. The bytes are hashed as
    ``uint8``: numpy exports no buffer of a ``datetime64`` or ``timedelta64`` array."""
    data = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    flat = data.reshape(-1).view(np.uint8)
    return f"{SUM_ALGO}:{xxhash.xxh3_64_intdigest(flat.data):016x}"


def _npy_header(shape: tuple[int, ...], dtype: np.dtype[Any]) -> bytes:
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def read_npy_header(fd: int) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    with os.fdopen(os.dup(fd), "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        if fortran:
            raise ValueError("a Fortran-ordered file is not a cached slot")
        return tuple(shape), np.dtype(dtype), fh.tell()


_counter = itertools.count()


def map_new(
    directory: Path,
    stem: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    track: Callable[[Region], None],
) -> tuple[np.ndarray, Path]:
    """A writable mapping of a new ``.npy`` file in ``directory`` under a temporary name.

    The file gets its blocks before it is mapped
    (:func:`~insitubatch_nodes.cache._filemap.reserve`),
    so no write into the array can fault for space: a file system without room raises
    ``OSError`` here (ENOSPC or EDQUOT, :func:`~insitubatch_nodes.cache._filemap.is_full`) and
    leaves
    no file behind. The mapping holds no descriptor."""
    header = _npy_header(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    tmp = directory / f".{stem}.{os.getpid()}.{next(_counter)}{TMP_SUFFIX}"
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
    in_ram = False  # files on the cache directory's disk (page cache the kernel reclaims)

    def __init__(self, directory: Path, lock: DirLock) -> None:
        self.directory = directory
        self.lock = lock

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A slot file's mapping; raises :class:`CacheDiskFullError` when the file system has
        no room for it (slot memory is what the user put on this disk: it does not move into
        RAM behind the budget's back)."""
        dtype = np.dtype(dtype)
        try:
            array, tmp = map_new(self.directory, "spill", tuple(shape), dtype, self.lock.track)
        except OSError as exc:
            if not _filemap.is_full(exc):
                raise
            nbytes = math.prod(shape) * dtype.itemsize
            raise CacheDiskFullError(
                f"cache_dir {self.directory} is full: a spill slot of {nbytes:,} bytes cannot "
                f"get its disk blocks there ({exc.strerror}; {free_bytes(self.directory)} "
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
