"""Helpers shared by the pipeline tests: zarr's own read as the oracle, stores that count (or
slow down, or fail) their GETs, store writers and epoch runners.

Nothing here uses the package's geometry or plan to decide what the *right* answer is: the
expected values come from zarr's read path, the expected chunk keys from the files zarr wrote
on disk, and the expected samples from the manifest's chunk lists.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.storage
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from insitubatch_nodes import (
    Batch,
    PlanConfig,
    SplitManifest,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.stages._spares import SpareBuffers
from insitubatch_nodes.synthetic import make_era5_like, make_microscopy_like

METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"})


def is_metadata_key(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in METADATA_NAMES


# ---------------------------------------------------------------------------------------------
# What the fill holds
# ---------------------------------------------------------------------------------------------


class LiveSpares:
    """Counts a reshaping chunk transform's stored-layout decode buffers taken and not yet given
    back (``live``, its peak ``peak``) and the most bytes of them held at once, live and idle
    (``peak_bytes``), by patching ``SpareBuffers.take``/``give`` for the test."""

    def __init__(self, monkeypatch: Any) -> None:
        self.lock = threading.Lock()
        self.live = self.peak = self.peak_bytes = 0
        self.nbytes = 0
        take, give = SpareBuffers.take, SpareBuffers.give
        live = self

        def counted_take(spares: SpareBuffers, *args: Any) -> Any:
            buf = take(spares, *args)
            with live.lock:
                live.live += 1
                live.nbytes += buf.nbytes
                live.peak = max(live.peak, live.live)
                live.peak_bytes = max(live.peak_bytes, live.nbytes + spares.nbytes)
            return buf

        def counted_give(spares: SpareBuffers, path: str, buf: Any) -> None:
            with live.lock:
                live.live -= 1
                live.nbytes -= buf.nbytes
            give(spares, path, buf)

        monkeypatch.setattr(SpareBuffers, "take", counted_take)
        monkeypatch.setattr(SpareBuffers, "give", counted_give)


# ---------------------------------------------------------------------------------------------
# Stores that watch the pipeline's GETs
# ---------------------------------------------------------------------------------------------


class CountingStore(zarr.storage.WrapperStore[Store]):
    """Wraps a zarr store; counts ``get`` calls per key and the peak of concurrent chunk GETs.

    ``delay`` (seconds) is awaited inside every chunk GET (not metadata), so GETs overlap and a
    close can catch them in flight. ``fail`` maps a key to an exception to raise for it.
    ``stall_after=n`` answers the first ``n`` chunk GETs and leaves every later one hanging (an
    endpoint that froze): those wait an hour unless cancelled.
    """

    def __init__(
        self,
        store: Store,
        *,
        delay: float = 0.0,
        fail: Mapping[str, BaseException] | None = None,
        stall_after: int | None = None,
    ) -> None:
        super().__init__(store)
        self.delay = delay
        self.fail = dict(fail or {})
        self.stall_after = stall_after
        self.chunk_gets = 0
        self.counts: Counter[str] = Counter()
        self.partial_counts: Counter[str] = Counter()
        self.active = 0
        self.peak = 0
        self._lock = threading.Lock()

    def _with_store(self, store: Store) -> CountingStore:
        return type(self)(store, delay=self.delay, fail=self.fail, stall_after=self.stall_after)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        chunk = not is_metadata_key(key)
        with self._lock:
            self.counts[key] += 1
            if chunk:
                self.active += 1
                self.peak = max(self.peak, self.active)
                self.chunk_gets += 1
                stalled = self.stall_after is not None and self.chunk_gets > self.stall_after
        try:
            if chunk and stalled:
                await asyncio.sleep(3600)
            if chunk and self.delay:
                await asyncio.sleep(self.delay)
            if key in self.fail:
                raise self.fail[key]
            return await self._store.get(key, prototype, byte_range)
        finally:
            if chunk:
                with self._lock:
                    self.active -= 1

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        with self._lock:
            for key, _ in key_ranges:
                self.partial_counts[key] += 1
        return await self._store.get_partial_values(prototype, key_ranges)

    def chunk_counts(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self.counts.items() if not is_metadata_key(k)}

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.partial_counts.clear()
            self.peak = self.active


def counting_store(root: Path, **kwargs: Any) -> CountingStore:
    """A read-only ``zarr.storage.LocalStore`` at ``root`` wrapped in a :class:`CountingStore`."""
    return CountingStore(zarr.storage.LocalStore(root, read_only=True), **kwargs)


class TrackingBacking:
    """A slot backing (RAM) that tracks the bytes it has handed out and not taken back."""

    name = "tracking"

    def __init__(self) -> None:
        self.outstanding = 0
        self.peak = 0
        self._lock = threading.Lock()

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        buf = np.empty(shape, dtype=dtype)
        with self._lock:
            self.outstanding += buf.nbytes
            self.peak = max(self.peak, self.outstanding)
        return buf

    def release(self, buffer: np.ndarray) -> None:
        with self._lock:
            self.outstanding -= buffer.nbytes


# ---------------------------------------------------------------------------------------------
# The oracle: zarr's own read path
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """What a label reads, described without the package: array name, sample axis, shift."""

    name: str
    sample_axis: int = 0
    offset: int = 0


# Arrays up to this size are read whole by an Oracle, once (see Oracle).
ORACLE_WHOLE_READ_MAX_BYTES = 256 * 2**20


def _folder_digest(root: Path | Store, name: str) -> bytes | None:
    """A hash of every byte zarr reads for array ``name`` of a local folder store (the root's
    metadata documents, and every file under the array's folder, by path and content) and of
    zarr's array read options; None for any other store."""
    if not isinstance(root, str | os.PathLike):
        return None
    base = Path(root)
    folder = base / name
    if not folder.is_dir():
        return None
    h = hashlib.blake2b(digest_size=32)
    h.update(name.encode() + b"\0")
    h.update(repr(sorted(zarr.config.get("array", {}).items())).encode())  # read options
    files = [base / n for n in sorted(METADATA_NAMES) if (base / n).is_file()]
    files += sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        data = path.read_bytes()
        h.update(f"{path.relative_to(base).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.digest()


class _WholeReads:
    """zarr's whole reads of arrays, by :func:`_folder_digest` of the bytes they were read
    from (read-only; the least recently used are dropped past ``max_bytes``). Tests build
    many oracles over the same session-scoped stores: each read them whole again with zarr
    (~30 ms an array, a tenth of some test files' time). An entry is found again only for
    byte-identical files, so a store damaged or rewritten since is read again."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[bytes, np.ndarray] = {}
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> np.ndarray | None:
        with self._lock:
            whole = self._entries.pop(digest, None)
            if whole is not None:
                self._entries[digest] = whole  # most recently used last
            return whole

    def put(self, digest: bytes, whole: np.ndarray) -> np.ndarray:
        """Keep ``whole`` (read-only from now on) and return it."""
        whole.setflags(write=False)
        if whole.nbytes > self.max_bytes:
            return whole
        with self._lock:
            self._entries[digest] = whole
            total = sum(w.nbytes for w in self._entries.values())
            while total > self.max_bytes:
                total -= self._entries.pop(next(iter(self._entries))).nbytes
        return whole


_WHOLE_READS = _WholeReads(max_bytes=64 * 2**20)


class Oracle:
    """``oracle(name, indices, sample_axis)`` = zarr's read of those samples, sample axis first.

    Each array is read whole with zarr at its first use and the samples are cut from that read
    with numpy: one zarr read per array, not one per batch and label (those reads, ~7 ms each,
    were more than half of test_pipeline.py's time). So an oracle answers for the store as it
    was at its first use of an array: a test that changes the store after that makes a new
    oracle. A sharded array is read per call, as before: zarr reads a shard whole or by byte
    ranges depending on what is asked, and the two differ on a damaged shard (a zero-byte one
    reads as the fill value whole, and fails by ranges) and in the requests a server sees.
    Where the whole read fails (a chunk damaged on purpose, which the test never asks for) or
    the array is over ``ORACLE_WHOLE_READ_MAX_BYTES``, each call reads its samples alone too.
    For unsharded arrays zarr decodes whole chunks either way: the values are the same.
    A whole read of a local folder's array is also kept for the test process, found again by a
    hash of the bytes it was read from (``_WholeReads``): an oracle over byte-identical files
    (the same session store, or a copy) answers with zarr's read of those bytes without
    reading them with zarr again."""

    def __init__(self, root: Path | Store) -> None:
        self.root = root
        self.group = zarr.open_group(store=root, mode="r")
        self._arrays: dict[str, Any] = {}
        self._wholes: dict[str, np.ndarray | None] = {}

    def array(self, name: str) -> Any:
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def _whole(self, name: str) -> np.ndarray | None:
        """zarr's read of the whole array ``name`` (made once), or None where it cannot be."""
        if name not in self._wholes:
            arr = self.array(name)
            whole = None
            if getattr(arr, "shards", None) is None and arr.nbytes <= ORACLE_WHOLE_READ_MAX_BYTES:
                digest = _folder_digest(self.root, name)
                whole = _WHOLE_READS.get(digest) if digest is not None else None
                if whole is None:
                    try:
                        whole = np.asarray(arr[...])
                    except Exception:  # a damaged chunk: the calls read only the samples they ask
                        whole = None
                    if whole is not None and digest is not None:
                        whole = _WHOLE_READS.put(digest, whole)
            self._wholes[name] = whole
        return self._wholes[name]

    def __call__(self, name: str, indices: np.ndarray, sample_axis: int = 0) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        whole = self._whole(name)
        if whole is not None:
            return np.moveaxis(np.take(whole, idx, axis=sample_axis), sample_axis, 0)
        arr = self.array(name)
        sel: list[Any] = [slice(None)] * arr.ndim
        sel[sample_axis] = idx
        out = arr.oindex[tuple(sel)] if sample_axis else arr[sel[0]]
        return np.moveaxis(np.asarray(out), sample_axis, 0)

    def n_samples(self, name: str, sample_axis: int = 0) -> int:
        return int(self.array(name).shape[sample_axis])

    def stored_samples_per_chunk(self, name: str, sample_axis: int = 0) -> int:
        arr = self.array(name)
        shards = getattr(arr, "shards", None)
        return int((shards or arr.chunks)[sample_axis])


def assert_batch_matches(batch: Batch, oracle: Oracle, views: Mapping[str, View]) -> None:
    """Every label of ``batch`` equals zarr's read of ``batch.sample_indices[label]``."""
    assert set(batch.arrays) >= set(views), (sorted(batch.arrays), sorted(views))
    anchors = None
    for label, view in views.items():
        idx = np.asarray(batch.sample_indices[label])
        got = batch.arrays[label]
        want = oracle(view.name, idx, view.sample_axis)
        # zarr reads a big-endian v2 array as ">f4"; a batch holds the same values natively
        native = want.dtype if want.dtype.isnative else want.dtype.newbyteorder("=")
        assert got.dtype == native and got.dtype.isnative, (label, got.dtype, want.dtype)
        assert got.shape == want.shape, (label, got.shape, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"label {label!r} batch {batch.index}")
        a = idx - view.offset
        if anchors is None:
            anchors = a
        else:  # every label's row i is the same anchor, shifted by that label's offset
            np.testing.assert_array_equal(a, anchors)


def run_epoch(
    batches: Iterable[Batch],
    oracle: Oracle | None = None,
    views: Mapping[str, View] | None = None,
    *,
    keep_arrays: bool = False,
    each: Callable[[Batch], None] | None = None,
) -> list[dict[str, Any]]:
    """Iterate ``batches`` to the end, checking each against the oracle; returns a record per
    batch: ``{"epoch", "index", "len", "sample_indices", ["arrays"]}`` (copies)."""
    records: list[dict[str, Any]] = []
    for batch in batches:
        if oracle is not None and views is not None:
            assert_batch_matches(batch, oracle, views)
        if each is not None:
            each(batch)
        rec: dict[str, Any] = {
            "epoch": batch.epoch,
            "index": batch.index,
            "len": len(batch),
            "sample_indices": {k: np.array(v) for k, v in batch.sample_indices.items()},
        }
        if keep_arrays:
            rec["arrays"] = {k: np.array(v) for k, v in batch.arrays.items()}
        records.append(rec)
    return records


def assert_same_records(got: Sequence[dict[str, Any]], want: Sequence[dict[str, Any]]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        assert (g["epoch"], g["index"], g["len"]) == (w["epoch"], w["index"], w["len"])
        assert g["sample_indices"].keys() == w["sample_indices"].keys()
        for label in w["sample_indices"]:
            np.testing.assert_array_equal(g["sample_indices"][label], w["sample_indices"][label])
        if "arrays" in g and "arrays" in w:
            for label in w["arrays"]:
                np.testing.assert_array_equal(g["arrays"][label], w["arrays"][label])


def expected_anchors(
    manifest: SplitManifest,
    split: str,
    offsets: Sequence[int],
    *,
    cross_split_windows: bool = False,
) -> np.ndarray:
    """Sorted anchors of ``split`` whose every shifted sample lies inside the array and (unless
    ``cross_split_windows``) on an anchor-grid chunk of ``split`` itself — the documented rule,
    written out sample by sample."""
    spc, n = manifest.samples_per_chunk, manifest.n_samples
    own = set(manifest.chunks(split))
    parts = [np.arange(c * spc, min((c + 1) * spc, n)) for c in manifest.chunks(split)]
    anchors = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    ok = np.ones(anchors.shape, dtype=bool)
    for k in offsets:
        ok &= (anchors + k >= 0) & (anchors + k < n)
        if not cross_split_windows:
            ok &= np.array([(int(a) + k) // spc in own for a in anchors], dtype=bool)
    return np.sort(anchors[ok])


# ---------------------------------------------------------------------------------------------
# Chunk keys on disk (what zarr wrote), for the fetch-count oracle
# ---------------------------------------------------------------------------------------------


def chunk_keys_on_disk(root: Path, name: str) -> dict[str, tuple[int, ...]]:
    """``{store key: chunk-grid coords}`` of every stored object zarr wrote for array ``name``."""
    folder = root / name
    out: dict[str, tuple[int, ...]] = {}
    for path in folder.rglob("*"):
        if not path.is_file() or path.name in METADATA_NAMES:
            continue
        rel = path.relative_to(folder).as_posix()
        if rel.startswith("c/"):  # v3 default encoding
            coords = tuple(int(p) for p in rel[2:].split("/"))
        elif rel == "c":  # v3 0-d
            coords = ()
        else:  # v2: "0.1.2" (or "0/1/2" with the "/" separator)
            coords = tuple(int(p) for p in rel.replace("/", ".").split("."))
        out[f"{name}/{rel}"] = coords
    return out


def expected_chunk_keys(
    oracle: Oracle,
    views: Mapping[str, View],
    records: Sequence[dict[str, Any]],
) -> set[str]:
    """Every stored object (zarr's key for it, written or not) whose sample-axis chunk holds a
    sample some batch read: the objects an epoch must GET."""
    needed: dict[str, set[int]] = {}
    axes: dict[str, int] = {}
    for label, view in views.items():
        spc = oracle.stored_samples_per_chunk(view.name, view.sample_axis)
        idx = np.concatenate([r["sample_indices"][label] for r in records])
        needed.setdefault(view.name, set()).update((idx // spc).tolist())
        axes[view.name] = view.sample_axis
    keys: set[str] = set()
    for name, chunks in needed.items():
        arr = oracle.array(name)
        stored = getattr(arr, "shards", None) or arr.chunks
        grid: list[Sequence[int]] = [
            range(-(-n // c)) for n, c in zip(arr.shape, stored, strict=True)
        ]
        grid[axes[name]] = sorted(chunks)
        for coords in itertools.product(*grid):
            keys.add(f"{name}/{arr.metadata.encode_chunk_key(tuple(coords))}")
    return keys


# ---------------------------------------------------------------------------------------------
# Store writers (small, fast)
# ---------------------------------------------------------------------------------------------


def put_array(
    group: zarr.Group, name: str, data: np.ndarray, dims: tuple[str, ...], chunks: Any = None
) -> zarr.Array:
    """``data`` written whole as array ``name`` of ``group``: uncompressed, named ``dims``, in
    chunks of ``chunks`` (one chunk by default)."""
    a = group.create_array(
        name, shape=data.shape, dtype=data.dtype, chunks=chunks or data.shape,
        compressors=None, dimension_names=dims,
    )  # fmt: skip
    a[...] = data
    return a


def write_t2m_96(root: Path) -> Path:
    """``t2m`` (96, 3, 5) in chunks of 4 steps, its time axis named, seeded: the store of the
    Lightning resume tests (test_lightning_stop, test_laststep_trial)."""
    group = zarr.open_group(root, mode="w")
    array = group.create_array(
        "t2m", shape=(96, 3, 5), chunks=(4, 3, 5), dtype="<f4",
        dimension_names=["time", "lat", "lon"],
    )  # fmt: skip
    array[:] = np.random.default_rng(0).standard_normal((96, 3, 5)).astype("<f4")
    return root


def write_era5(root: Path, **kwargs: Any) -> Path:
    """A small ERA5-like store (t2m and z); keyword arguments override the small defaults."""
    opts: dict[str, Any] = {
        "n_time": 96,
        "n_lat": 8,
        "n_lon": 16,
        "n_level": 2,
        "samples_per_chunk": 8,
    }
    opts.update(kwargs)
    make_era5_like(root, **opts)
    return root


def write_microscopy(root: Path, **kwargs: Any) -> Path:
    """A small microscopy-like store: image and mask chunked differently along Z (axis 2)."""
    opts: dict[str, Any] = {
        "shape": (2, 2, 24, 12, 12),
        "image_chunks": (1, 2, 2, 12, 12),
        "mask_chunks": (2, 1, 6, 8, 8),
    }
    opts.update(kwargs)
    make_microscopy_like(root, **opts)
    return root


def write_mixed_chunking(root: Path, n_time: int = 72) -> Path:
    """Two arrays sharing the time axis but chunked differently along it (8 vs 12), the second
    also tiled in its field, with non-divisible edge tiles; seeded values, never the fill."""
    rng = np.random.default_rng(5)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    a = group.create_array("a", shape=(n_time, 5, 7), chunks=(8, 5, 7), dtype="f4", fill_value=0)
    a[...] = (rng.random((n_time, 5, 7)) + 1).astype("f4")
    b = group.create_array(
        "b", shape=(n_time, 3, 5, 7), chunks=(12, 1, 3, 4), dtype="i4", fill_value=0
    )
    b[...] = rng.integers(1, 10_000, size=(n_time, 3, 5, 7)).astype("i4")
    return root


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# ---------------------------------------------------------------------------------------------
# Stopping promptly, told apart from a busy machine
# ---------------------------------------------------------------------------------------------

#: What the stop tests set the bounded waits of stopping to (the prefetch thread's join and the
#: exit hook's wait for cancelled GETs, 2 s each in the package): a stop that waits one of
#: them out takes at least this long...
STOP_GRACE_S = 20.0
#: ...and one that waits out none returns within this, on a 2-core machine under load 10-13
#: too (a woken thread stops in milliseconds; the exit of an interpreter with torch imported
#: took 6 s under load 10). A bound of 2-3 s on the package's own graces cannot tell the two
#: apart on such a machine.
PROMPT_S = 12.0


def lengthen_stop_graces(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Set the package's bounded waits of stopping to :data:`STOP_GRACE_S` (``setattr_`` is
    ``monkeypatch.setattr``, or ``setattr`` in a child process)."""
    from insitubatch_nodes.stages import _get, prefetch

    setattr_(prefetch, "_JOIN_S", STOP_GRACE_S)
    setattr_(_get, "_EXIT_GRACE_S", STOP_GRACE_S)


def window_of(data: np.ndarray, view: Any, origin: np.ndarray) -> np.ndarray:
    """``data`` (zarr's read of a whole-array sample: ``sample_axis=()``) at the window of
    patched ``view`` whose origin is ``origin`` (a row of ``batch.patch_origins``); all of it
    where the view is not patched."""
    index: list[Any] = [slice(None)] * data.ndim
    if view.patch is not None:
        spec = view.patch
        for a, o, e in zip(spec.axes, np.asarray(origin).tolist(), spec.extent, strict=True):
            index[a] = slice(o, o + e)
    return data[tuple(index)]


def in_forked_child(fn: Callable[[], object], timeout: float = 20.0) -> str:
    """Run ``fn()`` in a forked child: ``"ok <its result>"``, ``"raised <Type>: <message>"``,
    or ``"hung"`` when the child did not end within ``timeout`` seconds (it is killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_end)
        try:
            message = f"ok {fn()}"
        except BaseException as exc:
            message = f"raised {type(exc).__name__}: {exc}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read_end)
            return "hung"
        time.sleep(0.02)
    with os.fdopen(read_end) as f:
        return f.read()


def write_sst(root: Path, times: Any, *, chunk: int, units: str = "hours since 2000-01-01",
              calendar: str | None = None) -> Path:  # fmt: skip
    """An xarray-written store at ``root``: ``sst (time, lat, lon)`` float32 on lat
    [10, 60] x lon [0, 90, 200] (each step's values: 10 times its index plus the grid
    position) at ``times``, ``chunk`` steps an object, the times int64 CF ``units`` (and
    ``calendar``, where given). xarray is imported here: the trials that call this skip
    without it."""
    import warnings

    import xarray as xr

    n = len(times)
    data = (np.arange(n)[:, None, None] * 10 + np.arange(6).reshape(2, 3)).astype("f4")
    grid = {"lat": [10.0, 60.0], "lon": [0.0, 90.0, 200.0]}
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), data)}, coords={"time": times, **grid})
    enc: dict[str, Any] = {"units": units, "dtype": "int64"}
    if calendar is not None:
        enc["calendar"] = calendar
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"sst": {"chunks": (chunk, 2, 3)}, "time": enc})  # fmt: skip
    return root


def open_with_xarray(root: Path) -> Any:
    """The store at ``root`` as xarray decodes it by default (cftime dates where numpy has
    none), warnings quiet: the trials' oracle."""
    import warnings

    import xarray as xr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note that dates before 1582 are cftime's)
        return xr.open_zarr(root, consolidated=False, use_cftime=None)


def plan_anchors(node: Any, k: int | None = None) -> list[list[int]]:
    """The anchors of a read plan node's next ``k`` batches (all its epoch's remaining ones
    when ``None``), a list per batch."""
    out = []
    while k is None or len(out) < k:
        try:
            out.append(node.next().anchors.tolist())
        except StopIteration:
            break
    return out


def epoch_anchors(node: Any, epoch: int) -> list[list[int]]:
    """The anchors of every batch of epoch ``epoch`` of a read plan node started afresh there
    (:func:`plan_anchors` after ``set_epoch`` and ``reset(None)``)."""
    node.set_epoch(epoch)
    node.reset(None)
    return plan_anchors(node)


def write_ranks_store(root: Path, seed: int) -> Path:
    """The ranks trials' store: ``t2m`` of 24 steps by 2 points, ``(time, lat)``, in chunks of 3
    steps (8 chunks), random values from ``seed``."""
    group = zarr.open_group(root, mode="w")
    data = np.random.default_rng(seed).random((24, 2)).astype("f4")
    group.create_array("t2m", data=data, chunks=(3, 2), dimension_names=("time", "lat"))
    return root


def uneven_eval(rank: int, world: int, **kw: Any) -> PlanConfig:
    """The test split dealt ``remainder="uneven"`` with empty ranks allowed, to ``rank`` of
    ``world`` (batches of 1 unless ``kw`` says otherwise)."""
    return PlanConfig(split="test", remainder="uneven", empty_ranks=True, rank=rank,
                      world_size=world, **{"batch_size": 1, **kw})  # fmt: skip


def t2m_halves(root: Path, n_time: int) -> dict[str, Any]:
    """A ``t2m`` store of ``n_time`` steps in chunks of 8 on a 4 x 8 grid, written at ``root``:
    ``{"root", "store", "t2m" (its view), "manifest" (train the first half of the chunks,
    val the rest), "oracle" (zarr's read)}``."""
    make_era5_like(root, n_time=n_time, n_lat=4, n_lon=8, samples_per_chunk=8, variables=["t2m"])
    store = open_store(root)
    t2m = open_geometries(store, ["t2m"])["t2m"]
    return {
        "root": root,
        "store": store,
        "t2m": t2m,
        "manifest": split_by_chunk(t2m, (0.5, 0.5, 0.0)),
        "oracle": zarr.open_array(store=store, path="t2m", mode="r")[...],
    }
