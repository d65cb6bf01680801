"""One writer per cache directory: the lock file, who holds it, and shared readers.

The kernel drops a ``flock`` when its holder exits, however it exits: there is no stale lock and
no cleanup step. Never delete the lock file: that releases nothing and lets the next two
processes lock different files. A network file system (where ``flock`` may be local to each
client) or a platform without ``flock`` warns that writers there are not arbitrated. Pipelines
of one process share a directory (one lock, joined), and must keep each array alike there
(:func:`share_arrays`).

A forked child inherits the parent's lock descriptors, and with them the parent's ``flock``
(one lock per open file, shared by both): the child closes its copies at once and forgets
the parent's locks and shared arrays, so it takes a directory only with a lock of its own —
refused while the parent holds it — and never keeps the parent's lock alive after the parent
lets go.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from insitubatch_nodes.cache import _filemap
from insitubatch_nodes.cache._filemap import Region
from insitubatch_nodes.errors import CacheBusyError, StaleCacheError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_NAME",
    "DirLock",
    "claim_abandoned",
    "claim_note",
    "not_writable",
    "share_arrays",
    "take_lock",
    "unshare_arrays",
]

LOCK_NAME = ".insitu.lock"
# file systems on which flock may be emulated per client (two hosts can both "hold" it)
_NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "lustre", "gpfs", "beegfs",
    "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
    "fuse.juicefs", "fuse.ceph", "virtiofs",
}  # fmt: skip


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


def warn_unarbitrated(directory: Path) -> None:
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
        self._key = os.path.realpath(self.path)
        self._dropped = threading.Event()
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
        _LOCKS.add(self)

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
                "(pipelines of one process may all write it, or all read it, not both; one "
                "you no longer use is still referenced — by a variable, a generator or loop "
                "over it, IPython's Out[...], or an exception's traceback — since it was not "
                "released when this process collected its garbage)"
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
        are garbage collected: :mod:`~insitubatch_nodes.cache._filemap`)."""
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
            if self._live == 0 or self._fd is None:  # (a parent's lock, in a forked child)
                self._drop()
            else:  # this process still holds the lock, for its mappings: a later take waits
                with _PENDING_LOCK:
                    _PENDING.setdefault(self._key, set()).add(self)

    def _join(self) -> bool:
        """Become one more holder of this (still held) lock."""
        with self._mutex:
            if self._fd is None:
                return False
            self._holders += 1
            self._closing = False
            self._not_pending()
            return True

    def _drop(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock
        self._not_pending()
        self._dropped.set()

    def _not_pending(self) -> None:
        with _PENDING_LOCK:
            pending = _PENDING.get(self._key)
            if pending is not None:
                pending.discard(self)
                if not pending:
                    del _PENDING[self._key]


_LOCKS: weakref.WeakSet[DirLock] = weakref.WeakSet()  # every lock made in this process
WARNED_UNCHECKED: set[tuple[str, str]] = set()  # (cache_dir, store) warned about, once each
_WRITERS: dict[str, DirLock] = {}  # lock file -> the exclusive lock this process holds on it
_WRITERS_LOCK = threading.Lock()
# lock file -> this process's locks on it that every holder released but mappings still hold
_PENDING: dict[str, set[DirLock]] = {}
_PENDING_LOCK = threading.RLock()  # re-entrant: an unmap may run in a collection under it
PENDING_WAIT_S = 2.0  # the most take_lock waits for this process's own pending releases


def take_lock(directory: Path, *, shared: bool) -> DirLock:
    """Lock ``directory``: a shared lock of its own, or this process's exclusive one — pipelines
    of one process (a training and a validation pipeline) write one ``cache_dir`` together.

    A lock this process released whose release still waits for mappings (see :class:`DirLock`)
    is this process's own, not another's: before taking the directory again this collects
    garbage once — a pipeline stopped by an error closes its cache while the error is alive,
    and the error's traceback keeps slots that are views of mapped files until it is collected
    — and waits up to ``PENDING_WAIT_S`` for those releases (fills winding down let go of their
    mappings). Only a mapping still alive after that (a slot the caller holds) makes a
    conflicting lock raise ``CacheBusyError``. Likewise a conflicting lock this process holds
    for a pipeline that is merely unreferenced (not closed; pipelines live in reference cycles,
    so the previous run of a notebook cell holds it until Python collects it): garbage is
    collected and the lock tried again for up to ``PENDING_WAIT_S`` before the error."""
    key = os.path.realpath(directory / LOCK_NAME)
    deadline = time.monotonic() + PENDING_WAIT_S
    while True:
        try:
            return _take(directory, key, shared)
        except CacheBusyError:
            pids = _lock_pids(directory / LOCK_NAME)
            if time.monotonic() >= deadline or all(pid != os.getpid() for pid, _ in pids):
                raise
        gc.collect()  # the collected pipeline's thread lets go on its way out: poll briefly
        time.sleep(_POLL_S)


_POLL_S = 0.05


def _take(directory: Path, key: str, shared: bool) -> DirLock:
    _await_own_releases(key, shared)
    if shared:
        return DirLock(directory, shared=True)
    with _WRITERS_LOCK:
        lock = _WRITERS.get(key)
        if lock is not None and lock._join():
            return lock
        for other in [k for k, held in _WRITERS.items() if not held.held]:
            del _WRITERS[other]  # a directory let go of (a sweep makes one per trial)
        lock = _WRITERS[key] = DirLock(directory, shared=False)
        return lock


def _await_own_releases(key: str, shared: bool) -> None:
    """Wait for this process's pending releases of ``key`` that conflict with a new lock."""
    with _PENDING_LOCK:
        pending = [lk for lk in _PENDING.get(key, ()) if lk.shared != shared]  # others coexist
    if not pending:
        return
    gc.collect()
    deadline = time.monotonic() + PENDING_WAIT_S
    for lock in pending:
        lock._dropped.wait(max(0.0, deadline - time.monotonic()))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _started(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat``'s start time, in clock ticks since
    boot), or ``None`` where that cannot be read (no such process, no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def claim_note() -> str:
    """What a claim file (a chunk being written, ``cache_dir/.claims``) says of its writer:
    host, pid and when that pid started (``-`` where unknown)."""
    return f"{socket.gethostname()} {os.getpid()} {_started(os.getpid()) or '-'}\n"


def claim_abandoned(note: str) -> bool:
    """Whether the writer a claim file names (:func:`claim_note`) has gone: its pid runs no
    process on this host, or a process started at another time — the pid was reused, as in a
    restarted container, which numbers its processes as the last one did (the claims a killed
    job left then named live processes of the next, and their chunks were never cached again).
    Claims of other hosts, unreadable ones, and live writers' are kept."""
    parts = note.split()
    if len(parts) not in (2, 3) or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if not pid_alive(pid):
        return True
    now = _started(pid)
    return len(parts) == 3 and parts[2] != "-" and now is not None and now != parts[2]


@dataclass
class _Keeper:
    """A persistent cache open in this process (weakly: one collected without close() no
    longer counts), what it keeps (array path -> fingerprint) and from which store."""

    owner: weakref.ref[object]
    fingerprints: dict[str, str]
    store: str  # whose objects (``StoreCheck.where``)
    name: str  # the store, as errors name it


_SHARED: dict[str, list[_Keeper]] = {}  # per directory
_SHARED_LOCK = threading.Lock()


def share_arrays(
    directory: Path, owner: object, fingerprints: Mapping[str, str], check: Any = None
) -> None:
    """Record that ``owner`` (a cache open on ``directory``) keeps ``fingerprints``' arrays
    there, read from the store of ``check`` (its ``StoreCheck``: ``where`` says whose objects,
    ``name`` names the store in errors). Pipelines of one process share a directory, and a
    chunk's file has one name per ``(array, chunk)``: two that keep one array made otherwise
    (other chunk transforms, decoding, patches) would each replace the other's files, and one
    reading another store would take the other's chunks for its own as they land. Raises
    :class:`StaleCacheError` naming such arrays while the other is open."""
    key = os.path.realpath(directory)
    store, name = getattr(check, "where", ""), getattr(check, "name", "")
    for attempt in range(2):
        with _SHARED_LOCK:
            live = [k for k in _SHARED.get(key, ()) if k.owner() is not None]
            why = _clash([k for k in live if k.owner() is not owner], fingerprints, store, name)
            if why is None:
                mine = next((k for k in live if k.owner() is owner), None)
                if mine is None:
                    live.append(mine := _Keeper(weakref.ref(owner), {}, store, name))
                mine.fingerprints.update(fingerprints)
                _SHARED[key] = live
                return
        if attempt == 0:  # a pipeline merely unreferenced (held in a cycle) counts until collected
            gc.collect()
    raise StaleCacheError(
        f"cache_dir {directory} is open in this process by another pipeline that {why}. "
        "Pipelines of one process sharing a cache_dir must read each array they both keep "
        "alike, from one store; close the other pipeline first (pipe.close()), or give this "
        "one another cache_dir."
    )


def _clash(
    others: list[_Keeper], fingerprints: Mapping[str, str], store: str, name: str
) -> str | None:
    """Why ``fingerprints`` from ``store`` cannot share the directory with ``others``."""
    made = sorted({
        p for k in others for p, fp in k.fingerprints.items() if fingerprints.get(p, fp) != fp
    })  # fmt: skip
    if made:
        return (
            f"keeps {', '.join(map(repr, made))} made with another geometry, decoding "
            "(mask_and_scale, cf_dtype), patches or chunk transforms: both would write its "
            "chunk files, each over the other's"
        )
    for k in others:
        read = sorted(k.fingerprints.keys() & fingerprints.keys())
        if read and k.store != store:
            return (
                f"keeps {', '.join(map(repr, read))} read from store {k.name}, not "
                f"{name or store}: each would serve the other's chunks as its own"
            )
    return None


def unshare_arrays(directory: Path, owner: object) -> None:
    """``owner`` closed: its arrays no longer bind the directory's other pipelines."""
    key = os.path.realpath(directory)
    with _SHARED_LOCK:
        live = [k for k in _SHARED.pop(key, ()) if k.owner() not in (None, owner)]
        if live:
            _SHARED[key] = live


def _after_fork_in_child() -> None:
    """In a forked child: close the inherited copies of the parent's lock descriptors and
    forget the parent's locks, pending releases and shared arrays. Before, a child sharing the
    parent's ``flock`` joined the parent's writer lock — a second writer on the directory,
    whose opening swept the parent's chunk files still being written (their commits then
    failed: 9 of 26 chunks kept) — and a child that lived on kept the lock held after the
    parent closed its pipeline, refusing every other writer."""
    global _WRITERS_LOCK, _PENDING_LOCK, _SHARED_LOCK
    _WRITERS_LOCK, _PENDING_LOCK, _SHARED_LOCK = (
        threading.Lock(),
        threading.RLock(),
        threading.Lock(),
    )
    for lock in list(_LOCKS):
        lock._mutex = threading.Lock()  # (another thread of the parent may have held it)
        lock._dropped = threading.Event()  # (its condition's lock too, inside set or wait)
        lock._dropped.set()  # the child's copy is dropped: its descriptor is closed below
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # the parent's flock stays: its own descriptor holds it
    _WRITERS.clear()
    _PENDING.clear()
    _SHARED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
