"""Store identity: which stored objects a persisted chunk was made from, checked before reuse.

A persistent cache (:mod:`~insitubatch_nodes.cache`) keeps chunks after their chunk transforms;
its fingerprint (:mod:`~insitubatch_nodes.cache.fingerprint`) covers the geometry and the
transforms,
not the data. This module covers the data: a rewritten store (same shape, new values), a deleted
object, or an object that appeared where the warming run read none (the chunk was the fill
value) makes the chunks it belongs to *stale*.

**Recording (the warming run, free).** Every stored object a writing run reads comes with what
identifies it — nothing is requested for it:

* through obstore (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``, a local folder
  read through obstore): the GET result's ``meta`` — size, ``e_tag`` and ``last_modified``;
* a local folder read on the decode threads (:mod:`~insitubatch_nodes.io.localfiles`): the
  ``fstat`` of the file it read — size, ``mtime_ns`` and inode;
* an object that is not there (read as the fill value): recorded as *absent*.

:class:`IdentityRecorder` keeps what a chunk's fill read and writes it when the chunk is
committed — after the chunk file was renamed into place and before its log line — as compact
JSON rows in ``insitu_identity.jsonl``, a file of each writer directory's own (append-only). A
chunk's rows are those of its last commit: a chunk fetched again after the store was rewritten
with other chunking is made of other objects, and the old ones no longer describe it. A crash
between the file's rename and its log line leaves a row that describes the file's bytes, or the
old row, which then no longer matches the store: never a row that vouches for bytes it did
not describe. A chunk's rows are appended all or nothing (a full disk's partial write is cut
off again, :func:`~insitubatch_nodes._atomic.append_lines`), and a row a crash cut short is
cut off when the next writer opens the file (:func:`~insitubatch_nodes._atomic.cut_torn_tail`).

**Checking (a later run, one listing per array).** :class:`StoreCheck` lists each cached array's
prefix once (obstore ``list``: one LIST request per 1,000 objects on S3; ``os.scandir`` over the
array's folder locally, one ``stat`` per file) and compares the listing with the recorded rows,
vectorised over sorted keys. A chunk is stale when one of its objects

* changed — another size, or another ETag (obstore) / another mtime or inode (local files: a
  file rewritten in place keeps its inode); an object rewritten with the same bytes keeps its
  S3 ETag and stays valid;
* is missing — recorded present, not listed;
* is new — recorded absent, listed now;
* has no recorded identity (a cache warmed by a version that did not record, or through another
  kind of read path): it cannot be vouched for.

A row also carries, after its read path (``kind``), a digest of the store it was read from
(:attr:`StoreCheck.where`): a chunk recorded from another store is stale without a listing,
also under ``check_store=False``.

Objects the cache holds nothing of (metadata documents, chunks appended since) are not
compared: they are misses anyway. So an append that grows the sample axis keeps every chunk
whose objects are unchanged, and the grown last chunk, whose object was rewritten, is stale.

A zarr ``WrapperStore`` (a logging, counting or caching wrapper) is checked as the store it
wraps: its reads record the wrapped store's identities (a file's ``stat``, an object's ``head``,
asked for before the read, so a rewrite racing the read is stale, never trusted). A store that
cannot list (obstore's ``HTTPStore``: a web server answers no listing) is checked one recorded
object at a time, with a HEAD request each (64 in flight) whose ``ETag`` / ``Last-Modified`` /
size are compared as a listing's entry would be (:class:`HeadLister`). A store whose objects
cannot be identified at all (a zarr ``MemoryStore``, ``FsspecStore`` or ``ZipStore``) is
refused for a persistent cache (``ValueError`` at construction) unless ``check_store=False``
says the store is known not to change; each chunk then records its store alone (one row, kind
``none``: :func:`~insitubatch_nodes.io.places.object_place`). A listing that fails (a
network error) trusts the cache for that run with a warning naming why. What is not caught: a
file rewritten in place with the same size within one tick of the file system's clock, or whose
mtime was set back (mtime and inode unchanged), and an object a web server serves rewritten
with the same size within the same second (nginx's ``ETag`` is its ``Last-Modified`` second and
its size).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import stat
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from insitubatch_nodes._atomic import append_lines, close_with, cut_torn_tail
from insitubatch_nodes.errors import short_cause

__all__ = [
    "IDENTITY_NAME",
    "IdentityRecorder",
    "Listing",
    "Recorded",
    "StaleReport",
    "StoreCheck",
    "lister_for",
    "read_identities",
]

IDENTITY_NAME = "insitu_identity.jsonl"
_ABSENT = -1  # the size recorded for an object that was not there (read as the fill value)
_UNREAD = -2  # the size of a chunk's one row from a store that cannot be listed (its store)
_UNLISTED = "none"  # the read path (kind) of such a store

# one row: [array, chunk, store key, size (-1: absent), tag ("" when none), mtime_ns (-1), kind,
# commit] -- the commit is a token of the writer's commit of that chunk (rows without it, of
# caches warmed before it was recorded, count as one commit)
Row = tuple[str, int, str, int, str, int, str, str]


def meta_identity(meta: Mapping[str, Any] | os.stat_result | None) -> tuple[int, str, int]:
    """``(size, tag, mtime_ns)`` of an obstore ``ObjectMeta`` (a GET result's ``meta`` or a
    listing's entry), or of a local file's ``stat`` (a wrapper over a folder, see
    :func:`stat_identity`); ``None`` (no such object) is absent."""
    if meta is None:
        return _ABSENT, "", -1
    if isinstance(meta, os.stat_result):
        return stat_identity(meta)
    modified = meta.get("last_modified")
    mtime = -1 if modified is None else round(modified.timestamp() * 1e6) * 1000
    return int(meta.get("size") or 0), str(meta.get("e_tag") or ""), mtime


def stat_identity(info: os.stat_result | None) -> tuple[int, str, int]:
    """``(size, tag, mtime_ns)`` of a local file's ``stat`` (the tag is its inode)."""
    if info is None:
        return _ABSENT, "", -1
    return int(info.st_size), str(info.st_ino), int(info.st_mtime_ns)


# -------------------------------------------------------------------------------------------
# Listing a store
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """The objects under one prefix, sorted by key (numpy arrays of one length)."""

    keys: np.ndarray  # str
    sizes: np.ndarray  # int64
    tags: np.ndarray  # str ("" when the store gives none)
    mtimes: np.ndarray  # int64 (-1 when the store gives none)
    # bool: the mtime counts beside the tag (a local file, whose tag is its inode: a file
    # rewritten in place keeps it); False for an ETag, which alone decides (same bytes, same tag)
    dated: np.ndarray

    @classmethod
    def build(
        cls, keys: list[str], sizes: Any, tags: Any, mtimes: Any, dated: Any = False
    ) -> Listing:
        """Columns in any order, sorted here by key (``dated``: one flag for all, or one each)."""
        k = np.array(keys, dtype=str)
        order = np.argsort(k, kind="stable")
        return cls(
            k[order],
            np.asarray(sizes, dtype=np.int64)[order],
            np.asarray(tags).astype(str)[order],
            np.asarray(mtimes, dtype=np.int64)[order],
            np.broadcast_to(np.asarray(dated, dtype=bool), k.shape)[order],
        )


class LocalLister:
    """Lists a folder store with ``os.scandir`` (recursively under the array's folder)."""

    kind = "local"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self.where: str = "file://" + os.path.realpath(self.root)  #: whose objects (see StoreCheck)

    def list(self, prefix: str, keys_recorded: Iterable[str] = ()) -> Listing:
        keys: list[str] = []
        sizes: list[int] = []
        inodes: list[int] = []
        mtimes: list[int] = []
        stack = [prefix.strip("/")]
        while stack:
            rel = stack.pop()
            try:
                it = os.scandir(os.path.join(self.root, rel))
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for entry in it:
                    key = f"{rel}/{entry.name}" if rel else entry.name
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(key)
                        continue
                    info = entry.stat()
                    if stat.S_ISREG(info.st_mode):
                        keys.append(key)
                        sizes.append(info.st_size)
                        inodes.append(info.st_ino)
                        mtimes.append(info.st_mtime_ns)
        return Listing.build(keys, sizes, np.array(inodes, dtype=np.uint64), mtimes, True)


class ObstoreLister:
    """Lists an obstore store with ``obstore.list`` (one LIST request per 1,000 objects on S3)."""

    kind = "obstore"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        from insitubatch_nodes.io.places import cloud_endpoint, cloud_repr  # (a trailing "/"
        # is no store; an endpoint or account in the environment is one)

        self.where = f"{cloud_repr(inner)} {cloud_endpoint(inner)}"

    def list(self, prefix: str, keys_recorded: Iterable[str] = ()) -> Listing:
        import obstore

        keys: list[str] = []
        sizes: list[int] = []
        tags: list[str] = []
        mtimes: list[int] = []
        folder = prefix.strip("/")  # an array at the store's root lists the whole store
        for batch in obstore.list(
            self.inner, prefix=folder + "/" if folder else None, chunk_size=1000
        ):
            for meta in batch:
                size, tag, mtime = meta_identity(meta)
                keys.append(str(meta["path"]))
                sizes.append(size)
                tags.append(tag)
                mtimes.append(mtime)
        return Listing.build(keys, sizes, np.array(tags, dtype=str), mtimes)


class HeadLister:
    """Checks the objects of an obstore store that cannot list (``HTTPStore``) one by one: a HEAD
    request per recorded object (:func:`~insitubatch_nodes.io.objects.head_objects`, many in
    flight), whose ``ETag`` / ``Last-Modified`` / size are compared as a listing's would be."""

    kind = "obstore"  # GETs through the same store record obstore ObjectMeta

    def __init__(self, store: Any) -> None:
        self.store = store
        self.where: str = repr(getattr(store, "store", store))

    def list(self, prefix: str, keys: Iterable[str] = ()) -> Listing:
        from insitubatch_nodes.io.objects import head_objects

        wanted = sorted(set(keys))
        found = [
            (key, meta_identity(meta))
            for key, meta in zip(wanted, head_objects(self.store, wanted), strict=True)
            if meta is not None
        ]
        return Listing.build(
            [k for k, _ in found],
            [i[0] for _, i in found],
            np.array([i[1] for _, i in found], dtype=str),
            [i[2] for _, i in found],
        )


class RoutedLister:
    """Lists a :class:`~insitubatch_nodes.io.routing.RoutingStore` (a collection over several
    stores) store by store: prefix ``"s{i}/rest"`` is ``rest`` listed by store ``i``'s own lister
    (each member store checked as it would be alone), its keys given back below ``"s{i}/"``."""

    kind: str  #: the read path of every routed store, in order (recorded rows carry it)

    def __init__(self, listers: Sequence[Lister]) -> None:
        self.listers = tuple(listers)
        self.kind = "routed:" + ",".join(str(lister.kind) for lister in listers)
        self.where: str = "routed:" + ",".join(lister.where for lister in listers)

    def list(self, prefix: str, keys_recorded: Iterable[str] = ()) -> Listing:
        from insitubatch_nodes.io.routing import split_routed

        index, rest = split_routed(prefix.strip("/"))
        head = f"s{index}/"
        mine = [k[len(head) :] for k in keys_recorded if k.startswith(head)]
        inner = self.listers[index].list(rest, mine)
        keys = np.char.add(head, inner.keys)
        return Listing(keys, inner.sizes, inner.tags, inner.mtimes, inner.dated)

    def prefixes(self, paths: Iterable[str]) -> tuple[str, ...]:
        """The prefixes to list for objects below ``paths``: one per routed store, the folder
        all of that store's ``paths`` are below."""
        from insitubatch_nodes.io.routing import split_routed

        by_store: dict[int, list[str]] = {}
        for path in paths:
            index, rest = split_routed(path.strip("/"))
            by_store.setdefault(index, []).append("/" + rest)
        return tuple(
            f"s{i}/{posixpath.commonpath(rests).strip('/')}".rstrip("/")
            for i, rests in sorted(by_store.items())
        )


Lister = LocalLister | ObstoreLister | HeadLister | RoutedLister


def lister_for(store: Any) -> Lister | str:
    """How ``store`` is listed — the same read path the fetch stage records through (a folder
    read on the decode threads is listed as a folder; an obstore-backed store with obstore; a
    collection's stores each as it would be alone) — or a sentence saying why it cannot be."""
    from insitubatch_nodes.io._zarr_compat import wrapped_store
    from insitubatch_nodes.io.localfiles import local_reader
    from insitubatch_nodes.io.routing import RoutingStore
    from insitubatch_nodes.io.stores import cannot_list, describe_store, plain_object_store

    if isinstance(store, RoutingStore):
        listers: list[Lister] = []
        for i, member in enumerate(store.stores):
            lister = lister_for(member)
            if isinstance(lister, str):
                return f"routed store s{i} ({describe_store(member)}): {lister}"
            listers.append(lister)
        return RoutedLister(listers)
    outer, store = store, wrapped_store(store)  # a wrapper's objects are those it wraps
    reader = local_reader(store)
    if reader is not None:
        return LocalLister(reader.root)
    if plain_object_store(store):
        if cannot_list(store):
            return HeadLister(store)
        return ObstoreLister(store.store)
    wraps = f" (wrapped by a {type(outer).__name__})" if outer is not store else ""
    return (
        f"a {type(store).__name__}{wraps} is neither a local folder nor an obstore-backed "
        "zarr ObjectStore, so its objects' identities are neither recorded nor listed"
    )


# -------------------------------------------------------------------------------------------
# Recording
# -------------------------------------------------------------------------------------------


class IdentityRecorder:
    """What a writer's fills read, written to its directory's ``insitu_identity.jsonl`` as each
    chunk is committed (thread-safe: fills note from the IO loop and the decode threads).

    Only chunks given a cache file (:meth:`expect`) are recorded: :meth:`commit` writes a chunk's
    rows, :meth:`discard` forgets them.
    """

    def __init__(self, directory: Path, kind: str) -> None:
        self.path = directory / IDENTITY_NAME
        self.kind = kind
        self._marks = kind.startswith(_UNLISTED + "@")  # one row per chunk: its store only
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], dict[str, Row]] = {}
        self._session = os.urandom(4).hex()  # with a counter: a token per commit
        self._commits = 0
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._closer = close_with(self, fd)  # closed by close(), or when this is collected
        self._fd: int | None = fd
        try:  # a row a crash cut short goes before anything is appended after it
            cut_torn_tail(fd)
        except OSError:
            self._closer()
            raise

    def expect(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._pending[key] = {}

    def note(self, array: str, chunk: int, store_key: str, ident: tuple[int, str, int]) -> None:
        """Stored object ``store_key`` of chunk ``(array, chunk)`` was read with ``ident``."""
        with self._lock:
            rows = self._pending.get((array, chunk))
            if rows is not None:
                rows[store_key] = (array, int(chunk), store_key, *ident, self.kind, "")

    def commit(self, key: tuple[str, int]) -> None:
        """Write ``key``'s rows (call after its file is in place, before its log line)."""
        with self._lock:
            rows = self._pending.pop(key, None)
            if rows is not None and self._marks:  # (whose objects, without their identities)
                mark = f"\x00{key[1]}"  # (no store's key; one per chunk)
                rows = {mark: (key[0], int(key[1]), mark, _UNREAD, "", -1, self.kind, "")}
            fd = self._fd
            self._commits += 1
            commit = f"{self._session}.{self._commits}"
        if rows and fd is not None:
            text = "".join(
                json.dumps([*r[:7], commit], separators=(",", ":")) + "\n" for r in rows.values()
            )
            append_lines(fd, text, "store identity row")

    def discard(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._fd = None
            self._pending.clear()
        self._closer()  # (once: a second close does nothing)


@dataclass(frozen=True)
class Recorded:
    """The rows one writer directory recorded for one array, as columns (of each chunk's last
    commit, the last row of a key)."""

    chunks: np.ndarray  # int64
    keys: np.ndarray  # str
    sizes: np.ndarray  # int64 (-1: absent)
    tags: np.ndarray  # str
    mtimes: np.ndarray  # int64
    kinds: np.ndarray  # str

    def take(self, mask: np.ndarray) -> Recorded:
        return Recorded(*(getattr(self, f)[mask] for f in _RECORDED_FIELDS))


_RECORDED_FIELDS = ("chunks", "keys", "sizes", "tags", "mtimes", "kinds")


def read_identities(directory: Path) -> dict[str, Recorded]:
    """``{array: rows}`` recorded in ``directory``: each chunk's rows of its last commit (the last
    row of an array's store key wins among them); a torn last line, or a line that is not a row,
    is skipped: its chunks are unrecorded."""
    try:
        data = (directory / IDENTITY_NAME).read_bytes()
    except FileNotFoundError:
        return {}
    text = data[: data.rfind(b"\n") + 1].decode("utf-8", "replace")
    try:
        rows = json.loads("[" + text.rstrip("\n").replace("\n", ",") + "]") if text else []
    except ValueError:  # a damaged line: read line by line, skipping what does not parse
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    rows = [r if len(r) == 8 else [*r, ""] for r in rows if type(r) is list and len(r) in (7, 8)]
    if not rows:
        return {}
    try:
        arrays, chunks, keys, sizes, tags, mtimes, kinds, commits = (
            np.array(col) for col in zip(*rows, strict=True)
        )
        cols = Recorded(
            chunks.astype(np.int64),
            keys.astype(str),
            sizes.astype(np.int64),
            tags.astype(str),
            mtimes.astype(np.int64),
            kinds.astype(str),
        )
        arrays, commits = arrays.astype(str), commits.astype(str)
    except (TypeError, ValueError):  # a row of the wrong types: nothing here can be vouched for
        return {}
    # a chunk's rows are those of its last commit (the commit of its last row) ...
    unit = np.char.add(np.char.add(arrays, "\x00"), cols.chunks.astype(str))
    _, inverse = np.unique(unit, return_inverse=True)
    last_of_unit = np.zeros(int(inverse.max()) + 1, dtype=np.int64)
    np.maximum.at(last_of_unit, inverse, np.arange(len(rows)))
    keep = np.flatnonzero(commits == commits[last_of_unit[inverse]])
    # ... and within it (or among rows without a commit) the last row of each store key
    obj = np.char.add(np.char.add(arrays[keep], "\x00"), cols.keys[keep])
    _, first = np.unique(obj[::-1], return_index=True)
    last = keep[np.sort(len(keep) - 1 - first)]
    arrays, cols = arrays[last], cols.take(last)
    return {str(a): cols.take(arrays == a) for a in np.unique(arrays)}


# -------------------------------------------------------------------------------------------
# Checking
# -------------------------------------------------------------------------------------------


@dataclass
class StaleReport:
    """What :meth:`StoreCheck.stale` found: the stale chunks and why (one reason per object)."""

    chunks: set[tuple[str, int]] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    unchecked: str | None = None  # why the store could not be checked (then nothing is stale)
    elsewhere: set[tuple[str, int]] = field(default_factory=set)  # cached from another store
    why: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # each chunk's reasons

    def add(self, chunk: tuple[str, int], reason: str) -> None:
        """``chunk`` is stale for ``reason``."""
        self.chunks.add(chunk)
        self.reasons.append(reason)
        self.why.setdefault(chunk, []).append(reason)

    def merge(self, other: StaleReport, chunks: Iterable[tuple[str, int]] | None = None) -> None:
        """Add ``other``'s stale chunks (those among ``chunks``; default: all) to these."""
        keep = other.chunks if chunks is None else other.chunks.intersection(chunks)
        for chunk in sorted(keep):
            for reason in other.why.get(chunk, []):
                self.add(chunk, reason)
            self.chunks.add(chunk)
        self.elsewhere |= other.elsewhere & keep

    def only(self, chunks: Iterable[tuple[str, int]]) -> StaleReport:
        """The part of this report about ``chunks``."""
        part = StaleReport(unchecked=self.unchecked)
        part.merge(self, chunks)
        return part

    def describe(self, first: int = 5) -> str:
        shown = "; ".join(self.reasons[:first])
        more = len(self.reasons) - first
        return shown + (f"; and {more} more" if more > 0 else "")


class StoreCheck:
    """The store a cache's chunks came from, and how to check them against it.

    ``tiles`` maps each array path to its stored objects per chunk (``members``: the member
    paths of an array whose objects are not below its own path, a collection's); ``enabled=False``
    (``check_store=False``) records identities but trusts the cache without listing."""

    def __init__(
        self,
        store: Any,
        tiles: Mapping[str, int],
        *,
        enabled: bool = True,
        name: str = "",
        members: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        from insitubatch_nodes.io.stores import describe_store

        self.lister = lister_for(store)
        #: the prefixes listed for an array whose objects are not below its path (a collection's
        #: virtual array: the folder all its members are below, or one such folder per store
        #: of a collection over several)
        self.prefixes: dict[str, Sequence[str]] = {}
        for array, paths in (members or {}).items():
            if isinstance(self.lister, RoutedLister):
                self.prefixes[array] = self.lister.prefixes(paths)
            else:
                self.prefixes[array] = (posixpath.commonpath(["/" + p for p in paths]).strip("/"),)
        self.tiles = dict(tiles)
        self.enabled = bool(enabled)
        self.name = name or describe_store(store)
        #: whose objects the cache holds: two checks of one ``where`` see the same objects (a
        #: folder however it is opened; a store that cannot be listed, by what it reads:
        #: :func:`~insitubatch_nodes.io.places.object_place`)
        self.where = _place(store) if isinstance(self.lister, str) else self.lister.where

    @property
    def cannot_check(self) -> str | None:
        """Why this store's objects can never be checked (``None``: they can)."""
        return self.lister if isinstance(self.lister, str) else None

    @property
    def kind(self) -> str:
        """What recorded rows carry: the kind of read path and, after an ``@``, a digest of
        ``where``: the store they were read from, so a cache warmed from one store and opened
        over another finds its chunks stale (the objects of two stores written alike can look
        the same: nginx's ETag is a second and a size). A store that cannot be listed records
        one row per chunk, of kind ``none``, its store only (under ``check_store=False``)."""
        kind = _UNLISTED if isinstance(self.lister, str) else self.lister.kind
        return f"{kind}@{hashlib.sha256(self.where.encode()).hexdigest()[:12]}"

    def stale(self, cached: Mapping[str, Mapping[Path, np.ndarray]]) -> StaleReport:
        """The stale chunks among ``cached`` (``{array: {directory that logged them: chunk
        indices}}``, see :func:`chunks_by_array`), listing each array's prefix once.

        A chunk whose rows were recorded from another store (another ``kind`` after its ``@``)
        is stale without a listing, also when the check is disabled (``check_store=False``
        trusts the store not to change, not another store to hold the same values); rows
        without a store (of caches warmed before it was recorded) are compared as before."""
        report = StaleReport()
        listed = not isinstance(self.lister, str)  # (else: stale from another store only)
        if not listed and self.enabled:
            report.unchecked = str(self.lister)
        recorded: dict[Path, dict[str, Recorded]] = {}
        for array, by_dir in sorted(cached.items()):
            if not by_dir:
                continue
            rows_of: list[tuple[np.ndarray, Recorded | None]] = []
            for directory, chunks in sorted(by_dir.items()):
                if directory not in recorded:
                    recorded[directory] = read_identities(directory)
                rows = recorded[directory].get(array)
                want = np.unique(np.asarray(chunks, dtype=np.int64))
                if rows is not None:  # rows of this directory's cached chunks, read the same way
                    rows = rows.take(np.isin(rows.chunks, want))
                    mine, digest = self.kind, self.kind.partition("@")[2]
                    kinds = np.unique(rows.kinds).tolist()  # (after "@" their store; "": none)
                    other = np.isin(
                        rows.kinds, [k for k in kinds if k.partition("@")[2] not in ("", digest)]
                    )
                    for c in np.unique(rows.chunks[other]).tolist():
                        report.elsewhere.add((array, c))
                        report.add((array, c), f"{array!r} chunk {c}: cached from another store")
                    want = want[~np.isin(want, rows.chunks[other])]
                    rows = rows.take(np.isin(rows.kinds, [mine, mine.partition("@")[0]]))
                rows_of.append((want, rows))
            if not self.enabled or not listed:
                continue
            try:  # a HeadLister asks for the recorded objects only; the others list the prefix
                keys = {str(k) for _, rows in rows_of if rows is not None for k in rows.keys}
                lister = cast(Lister, self.lister)
                listings = [lister.list(p, keys) for p in self.prefixes.get(array, [array])]
                listing = listings[0] if len(listings) == 1 else Listing.build(
                    [str(k) for li in listings for k in li.keys],
                    np.concatenate([li.sizes for li in listings]),
                    np.concatenate([li.tags for li in listings]),
                    np.concatenate([li.mtimes for li in listings]),
                    np.concatenate([li.dated for li in listings]),
                )  # fmt: skip
            except Exception as exc:  # NotSupported, a denied ListBucket, a network error
                report = report.only(report.elsewhere)  # stale whatever the listing would say
                report.unchecked = f"listing {array!r} failed ({short_cause(exc)})"
                return report
            for want, rows in rows_of:
                self._compare(array, want, rows, listing, report)
        return report

    def _compare(
        self,
        array: str,
        want: np.ndarray,
        rows: Recorded | None,
        listing: Listing,
        report: StaleReport,
    ) -> None:
        """Add to ``report`` the chunks of ``want`` (sorted, unique) that ``rows`` does not
        vouch for against ``listing``."""
        if rows is not None and len(rows.keys):
            keys, size, tags, mtime, chunk = (
                rows.keys,
                rows.sizes,
                rows.tags,
                rows.mtimes,
                rows.chunks,
            )
            listed = len(listing.keys)
            at = np.minimum(np.searchsorted(listing.keys, keys), max(listed - 1, 0))
            if listed:
                found = listing.keys[at] == keys
                l_size, l_tag, l_mtime = listing.sizes[at], listing.tags[at], listing.mtimes[at]
                dated = listing.dated[at]
            else:
                found = np.zeros(len(keys), dtype=bool)
                l_size, l_tag, l_mtime = size, tags, mtime
                dated = found
            absent = size == _ABSENT
            tagged = (tags != "") & (l_tag != "")
            # an ETag decides alone; an inode (a local file) with its mtime: in place, it stays
            differ = (l_size != size) | np.where(tagged, l_tag != tags, l_mtime != mtime)
            differ |= dated & (l_mtime != mtime)
            for mask, why in (
                (~absent & found & differ, "changed"),
                (~absent & ~found, "deleted"),
                (absent & found, "new"),
            ):
                for i in np.flatnonzero(mask):
                    detail = ""
                    if why == "changed" and l_size[i] != size[i]:
                        detail = f" (size {size[i]} -> {l_size[i]})"
                    report.add((array, int(chunk[i])), f"{str(keys[i])!r} {why}{detail}")
            ids, counts = np.unique(chunk, return_counts=True)
        else:
            ids, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        # every cached chunk must have a row for each of its stored objects
        have = np.zeros(len(want), dtype=np.int64)
        have[np.searchsorted(want, ids)] = counts  # every row's chunk is in want (filtered)
        for c in want[have < self.tiles.get(array, 1)]:
            report.add((array, int(c)), f"{array!r} chunk {int(c)}: no recorded store identity")


def _place(store: Any) -> str:
    """``where`` of a store that cannot be listed
    (:func:`~insitubatch_nodes.io.places.object_place` of the store it wraps; a collection's,
    each store's own)."""
    from insitubatch_nodes.io._zarr_compat import wrapped_store
    from insitubatch_nodes.io.places import object_place
    from insitubatch_nodes.io.routing import RoutingStore

    if not isinstance(store, RoutingStore):
        return object_place(wrapped_store(store))
    wheres = [lister_for(s) for s in store.stores]
    return "routed:" + ",".join(
        _place(s) if isinstance(w, str) else w.where
        for s, w in zip(store.stores, wheres, strict=True)
    )


def chunks_by_array(
    entries: Iterable[tuple[tuple[str, int], Path]],
) -> dict[str, dict[Path, np.ndarray]]:
    """``{array: {directory: chunk indices}}`` of ``((array, chunk), file)`` pairs."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for (array, chunk), file in entries:
        grouped.setdefault((array, os.path.dirname(file)), []).append(chunk)
    out: dict[str, dict[Path, np.ndarray]] = {}
    for (array, directory), chunks in grouped.items():
        out.setdefault(array, {})[Path(directory)] = np.array(chunks, dtype=np.int64)
    return out
