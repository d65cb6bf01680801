"""The cache log: one JSON line per persisted chunk (file, shape, count, fingerprint, checksum)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes._atomic import append_lines
from insitubatch_nodes.cache.files import HEADER_KEY, LOG_NAME, SUM_ALGO, SUM_KEY
from insitubatch_nodes.errors import CorruptCacheError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = []

TIME_KEY = "t"  # the log field of when a line was written (time.time_ns())


@dataclass(frozen=True)
class Logged:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    valid: int
    fp: str
    checksum: str | None = None  # content_sum of the file's data; None: logged without one
    # when it was logged (time.time_ns(): now, for a new entry); 0: by a version without it
    written: int = field(default_factory=time.time_ns)

    def supersedes(self, old: Logged | None) -> bool:
        """Whether this entry replaces ``old`` as its chunk's: within one writer directory the
        later line does; across directories (ranks) the one logged later, so a chunk rewritten
        in one rank's part (found corrupt or stale) is not shadowed by the older entry in
        another's, whatever order the parts are read in. Lines of versions that did not record
        the time tie, and the one read last wins."""
        return old is None or old.file.parent == self.file.parent or self.written >= old.written


class Log:
    """One writer directory's log, read incrementally (whole lines only).

    Its writer appends to it, and replaces it (a new file renamed over it) when it opens the
    directory and drops stale or torn lines: a log replaced since the last look — another
    inode, or shorter than what was read — is read again from its start."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOG_NAME
        self.offset = 0
        self.line_no = 0
        self.header_seen = False
        self.inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read so far

    def read_new(self) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
        """New complete lines since the last call (every line, when the file was replaced
        since); ``(entries, torn)`` — ``torn`` when the file ends in a partial line (a crash
        cut the last write short)."""
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                inode = (st.st_dev, st.st_ino)
                if inode != self.inode or st.st_size < self.offset:
                    self.offset, self.line_no, self.header_seen = 0, 0, False
                    self.inode = inode
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
                if HEADER_KEY not in item:
                    raise CorruptCacheError(
                        f"{self.path} does not start with a cache header; it was not written by "
                        "insitubatch_nodes. Point cache_dir at a directory of its own."
                    )
            entries.append((self.line_no, item))
        return entries, bool(tail)

    @staticmethod
    def append(fd: int, text: str) -> None:
        """Append ``text`` (whole lines) to the log open on ``fd`` (``O_APPEND``), all or nothing.

        A full file system can take part of a write (the bytes that fit its last block) and
        refuse the rest: that piece is cut off again and ``OSError`` (``ENOSPC``) raised. Left
        there, the next line appended after it made it an unparseable line before the last,
        and every later open of the cache raised :class:`CorruptCacheError`
        (:func:`~insitubatch_nodes._atomic.append_lines`)."""
        append_lines(fd, text, "log line")


def parse_entry(log: Log, line_no: int, item: Mapping[str, Any]) -> tuple[tuple[str, int], Logged]:
    where = f"{log.path} line {line_no}"
    try:
        array, chunk, name = item["array"], item["chunk"], item["file"]
        shape = tuple(int(n) for n in item["shape"])
        dtype, valid, fp = str(item["dtype"]), int(item["valid"]), str(item["fp"])
        checksum = item.get(SUM_KEY)
        written = int(item.get(TIME_KEY, 0))
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
    return (array, chunk), Logged(log.directory / name, shape, dtype, valid, fp, checksum, written)


def matches(
    logged: Logged | None, shape: tuple[int, ...], dtype: np.dtype[Any], valid: int
) -> bool:
    return (
        logged is not None
        and logged.shape == shape
        and logged.dtype == dtype.str
        and logged.valid == valid
    )


def is_checked(logged: Logged | None) -> bool:
    """Whether ``logged`` carries a checksum this version verifies."""
    return (
        logged is not None
        and logged.checksum is not None
        and logged.checksum.startswith(f"{SUM_ALGO}:")
    )


def entry_line(key: tuple[str, int], logged: Logged) -> str:
    return json.dumps(
        {
            "array": key[0],
            "chunk": int(key[1]),
            "file": logged.file.name,
            "shape": list(logged.shape),
            "dtype": logged.dtype,
            "valid": logged.valid,
            "fp": logged.fp,
            **({SUM_KEY: logged.checksum} if logged.checksum is not None else {}),
            **({TIME_KEY: logged.written} if logged.written else {}),
        },
        separators=(",", ":"),
    )
