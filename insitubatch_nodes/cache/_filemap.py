"""Files mapped into memory: blocks reserved before a file is mapped, no descriptor kept after.

Two rules hold for every file the cache directory maps (spill slots, the slots of the persistent
cache, cached chunks read back):

* **Blocks before mapping.** :func:`reserve` gives a new file its blocks (``posix_fallocate``)
  before it is mapped writable. A write through a mapping to a page the file system cannot back
  is nothing a program can catch: the kernel sends SIGBUS to the thread that wrote (a sparse
  file, sized with ``ftruncate``, on a full file system). A file whose blocks are reserved
  cannot fault for space, and a full file system is an ``OSError`` (ENOSPC, or EDQUOT for a
  quota: :func:`is_full`) raised by :func:`reserve`, before anything is mapped. Where
  ``posix_fallocate`` is missing (macOS, Windows) or the file system refuses it (EOPNOTSUPP:
  glibc then emulates it itself, musl does not), zeros are written over the range instead —
  the same blocks, paid for with a write of the whole file. A copy-on-write file system that
  does not honour preallocation (ZFS) cannot promise any write, reserved or not.
* **No descriptor per mapping.** :func:`map_file` maps with libc's ``mmap`` (through ctypes), so
  the caller closes the descriptor at once: the mapping keeps the file open inside the kernel
  and costs an entry of ``vm.max_map_count`` (65,530 by default on Linux), not a descriptor of
  ``RLIMIT_NOFILE``. Python's ``mmap.mmap`` keeps a duplicate descriptor for the mapping's life
  (until 3.13's ``trackfd=False``): a thousand resident chunks reach the common soft limit of
  1,024. Where libc has no ``mmap`` (Windows) :func:`map_file` uses ``mmap.mmap``, descriptor
  and all.

**Lifetime.** A :class:`Region` owns one mapping. The arrays :meth:`Region.array` returns, and
every view of them, reach it through numpy's ``base`` chain, so the range stays mapped while any
of them lives. When the last one goes the range is unmapped, and only then do the callbacks
given to :meth:`Region.on_unmap` run, in the order given (the cache's lock counts live mappings
with them). A region still alive at interpreter exit is left to the kernel: other finalizers may
still read it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Region", "is_full", "map_file", "reserve"]

_FULL = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code)
# posix_fallocate's answers for "this file system cannot preallocate" (not "it is full")
_UNSUPPORTED = frozenset(
    code
    for code in (
        errno.EOPNOTSUPP,
        getattr(errno, "ENOTSUP", None),
        errno.EINVAL,
        getattr(errno, "ENOSYS", None),
    )
    if code
)
_ZEROS = 1 << 20  # the block of zeros written at a time where posix_fallocate is unavailable


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system (or the user's quota on it) has no room."""
    return isinstance(exc, OSError) and exc.errno in _FULL


def reserve(fd: int, nbytes: int) -> None:
    """Give the file open at ``fd`` (writable) its blocks for bytes ``[0, nbytes)``, growing it
    to ``nbytes``; raises ``OSError`` (:func:`is_full`) when the file system cannot hold them."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, nbytes)
            return
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
    zeros = bytes(min(nbytes, _ZEROS))
    os.lseek(fd, 0, os.SEEK_SET)
    done = 0
    while done < nbytes:
        done += os.write(fd, zeros[: min(len(zeros), nbytes - done)])


def _load_libc() -> tuple[Any, Any] | None:
    if os.name != "posix":  # pragma: no cover - Windows
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        c_mmap, c_munmap = libc.mmap, libc.munmap
    except (OSError, AttributeError):  # pragma: no cover - a libc without them
        return None
    # off_t is a C long on the LP64 platforms this runs on; the offset is always 0 here
    c_mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    c_mmap.restype = ctypes.c_void_p
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    c_munmap.restype = ctypes.c_int
    return c_mmap, c_munmap


_LIBC = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


class Region:
    """One shared mapping of the first ``length`` bytes of a file (see the module docstring)."""

    __slots__ = ("__weakref__", "_callbacks", "_keep", "address", "length", "writable")

    def __init__(
        self, address: int, length: int, writable: bool, unmap: Callable[[], Any], keep: Any
    ) -> None:
        self.address = address
        self.length = length
        self.writable = writable
        self._keep = keep  # the mmap.mmap object of the fallback (None through libc)
        self._callbacks: list[Callable[[], None]] = []
        done = weakref.finalize(self, _unmapped, unmap, self._callbacks)
        done.atexit = False

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "data": (self.address, not self.writable),
            "shape": (self.length,),
            "typestr": "|u1",
            "version": 3,
        }

    def array(self, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray:
        """A C-ordered ``shape`` array of ``dtype`` starting ``offset`` bytes in (read-only
        unless the region is writable); it keeps the region mapped."""
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > self.length:
            raise ValueError(f"{nbytes} bytes at offset {offset} overrun a {self.length}-byte map")
        raw: np.ndarray = np.asarray(self)
        return raw[offset : offset + nbytes].view(dtype).reshape(shape)

    def on_unmap(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the range has been unmapped (after the earlier ones)."""
        self._callbacks.append(callback)


def _unmapped(unmap: Callable[[], Any], callbacks: list[Callable[[], None]]) -> None:
    try:
        unmap()
    finally:
        for callback in callbacks:
            callback()


def _libc_munmap(address: int, length: int) -> None:
    assert _LIBC is not None
    _LIBC[1](address, length)  # fails only for a bad range, which this module never passes


def map_file(fd: int, length: int, *, writable: bool) -> Region:
    """Map the first ``length`` bytes of the file open at ``fd``, shared (writes reach the file),
    read-only unless ``writable``; the caller may close ``fd`` at once. Raises ``OSError``."""
    if length <= 0:
        raise ValueError(f"cannot map {length} bytes")
    if _LIBC is None:  # pragma: no cover - Windows: a descriptor per mapping
        mm = mmap.mmap(fd, length, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        probe = np.frombuffer(mm, dtype=np.uint8)
        address = int(probe.__array_interface__["data"][0])
        del probe  # no export left: close() can unmap it
        return Region(address, length, writable, mm.close, mm)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    address = _LIBC[0](None, length, prot, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap of {length} bytes failed: {os.strerror(code)}")
    return Region(address, length, writable, functools.partial(_libc_munmap, address, length), None)
