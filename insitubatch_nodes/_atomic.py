"""Files written whole or not at all: :func:`atomic_write`; lines appended whole or not at all:
:func:`append_lines` (and :func:`cut_torn_tail`, what heals a file a crash cut mid-line); the
descriptor of such a file closed with the object that owns it: :func:`close_with`."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_APPEND_LOCK = threading.Lock()  # threads (and pipelines) of one process append to one file


def _after_fork_in_child() -> None:
    # a thread of the parent appending at the fork held the lock; it does not exist here, and
    # every append of the child would wait for it forever (its own pipeline's cache log)
    global _APPEND_LOCK
    _APPEND_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def close_with(owner: object, fd: int) -> weakref.finalize[[int], object]:
    """Close ``fd`` once: when the returned finalizer is called (the owner's ``close()``) or when
    ``owner`` is garbage-collected, whichever comes first. A plain descriptor of an object that
    is dropped without ``close()`` stays open for the rest of the process otherwise (a pipeline
    per epoch, never closed, kept two per build). Not at interpreter exit: a thread still
    appending then would write to a closed (or reused) descriptor."""
    closer = weakref.finalize(owner, os.close, fd)
    closer.atexit = False
    return closer


def append_lines(fd: int, text: str, what: str = "line") -> None:
    """Append ``text`` (whole lines) to the file open on ``fd`` (``O_APPEND``), all or nothing.

    A full file system can take part of a write (the bytes that fit its last block) and refuse
    the rest: that piece is cut off again and ``OSError`` (``ENOSPC``, saying "a ``what`` cut
    short") raised. Left there, the next line appended after it made one line that does not
    parse (a cut JSON row, and the whole row after it). Appends of one process are serialised,
    so the cut takes back this write's bytes only."""
    data = text.encode()
    with _APPEND_LOCK:
        done = os.write(fd, data)
        if done != len(data):
            os.ftruncate(fd, os.fstat(fd).st_size - done)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: a {what} cut short")


def cut_torn_tail(fd: int) -> int:
    """Cut the file open on ``fd`` (readable and writable) back to just after its last newline:
    a line a crash cut short is dropped before anything is appended after it (the line would
    otherwise swallow the next one). Returns the bytes cut (0 for a file that ends in a newline,
    or is empty). Call it where no other writer appends to the file."""
    size = end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - (1 << 16))
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            end = start + at + 1
            break
        end = start
    if end < size:
        os.ftruncate(fd, end)
    return size - end


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """A text file to write ``path`` through: it is written beside ``path`` under a temporary
    name of this process and thread and renamed over it (``os.replace``) when the block ends
    without an exception. So an interrupted write (Ctrl-C, a full disk, an error while
    serialising) leaves any earlier file at ``path`` as it was, and no partial one (the
    temporary file is removed); readers see the old file or the new one, never a mix. The file
    gets the permissions ``open(path, "w")`` gives a new file (the umask's)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with tmp.open("w") as f:
            yield f
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
