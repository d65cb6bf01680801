"""Static fields: arrays without a sample axis, read once per pipeline and carried by every batch.

A static array (WeatherBench2's ``land_sea_mask (latitude, longitude)`` beside ``(time,
latitude, longitude)`` data) has no sample dimension: ``open_geometries`` recognises it
(``geom.static``) and the pipeline does not plan, fetch or pool it. It is read whole once, when
the pipeline is built (its selection, if any, taken then), and :class:`StaticFields` — the
first batch transform of the pipeline — puts it into every batch.

**Cached with the persistent cache:** with ``cache_dir=..., persist=True`` a static array is
one entry of the chunk cache (chunk 0 of its path, the whole array before any selection),
written with the identity of its stored objects by the first pipeline and served to the next
without a read; the cache's store check treats it as any chunk (:func:`read_static`).

**The contract:** ``batch.arrays[label]`` of a static label is ``(len(batch), *inner_shape)``,
like every other label, but its rows are one array broadcast along the batch axis (stride 0):
no copy per row or per batch, and every row is the same memory. Treat it as read-only (a write
into one row writes every row, and every later batch). ``to_torch`` shares that memory too (a
tensor with stride 0 along the batch); ``.to(device)`` makes a dense copy on the device.
``batch.sample_indices`` and ``batch.coords`` have no entry for a static label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes.batch import Batch
from insitubatch_nodes.cache.directory import ChunkCache
from insitubatch_nodes.cache.fingerprint import array_fingerprint
from insitubatch_nodes.cache.identity import meta_identity
from insitubatch_nodes.errors import CorruptCacheError, short_cause
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store

__all__ = [
    "StaticFields",
    "broadcast_rows",
    "keep_static_labels",
    "read_static",
    "select_static",
]


def select_static(view: ArrayGeometry, data: np.ndarray) -> np.ndarray:
    """``data`` (the whole static array) as ``view`` selects it (a C-contiguous copy)."""
    if view.select is not None:
        for axis in reversed(range(len(view.select.keys))):
            key = view.select.keys[axis]
            if key is not None:
                data = np.take(data, key if isinstance(key, int) else list(key), axis=axis)
    return np.ascontiguousarray(data)


def read_static(
    store: StoreLike,
    views: Mapping[str, ArrayGeometry],
    timeout_s: float,
    *,
    cache: ChunkCache | None = None,
) -> dict[str, np.ndarray]:
    """``{label: array}`` for the static ``views``: each array read whole once (however many
    views share it) within ``timeout_s``, then selected per view. With a persistent ``cache``
    (``persist=True``) a static array is one cached entry (chunk 0 of its path): served from
    the cache when it is there (nothing read from the store), else read and kept there; a
    read-only cache is never written."""
    zstore = as_store(store)
    whole: dict[str, np.ndarray] = {}
    out = {}
    for label, view in views.items():
        if not view.static:
            raise ValueError(f"views[{label!r}] ({view.path!r}) is not a static array")
        if view.path not in whole:
            base = view.base
            if cache is not None and cache.persistent:
                # (a static array set_views adds: the cache was opened without it)
                cache.adopt(
                    {base.path: array_fingerprint(base, base, ())}, {base.path: base.n_tiles}
                )
                whole[view.path] = _cached_whole(zstore, base, timeout_s, cache)
            else:
                whole[view.path] = _read_whole(zstore, base, timeout_s)
        out[label] = select_static(view, whole[view.path]).astype(view.dtype, copy=False)
    return out


def _read_whole(zstore: Any, base: ArrayGeometry, timeout_s: float) -> np.ndarray:
    array = _zarr_compat.open_array_readonly(zstore, base.path, base.zarr_format)
    try:
        data = _zarr_compat.read_whole_array(array, timeout_s)
    except Exception as exc:
        error = TimeoutError if isinstance(exc, TimeoutError) else OSError
        raise error(
            f"cannot read static array {base.path!r} from store {describe_store(zstore)} "
            f"({short_cause(exc)})"
        ) from exc
    if base.cf is not None:  # CF mask and scale, as the engine decodes sampled arrays
        return base.cf.decode(np.asarray(data))
    return np.ascontiguousarray(data, dtype=base.dtype)


def _cached_whole(
    zstore: Any, base: ArrayGeometry, timeout_s: float, cache: ChunkCache
) -> np.ndarray:
    """The whole static array ``base`` from the persistent ``cache``, or read and kept there
    with the identity of every stored object it was read from (listed before the read, so a
    change during the read makes the entry stale, never wrongly fresh)."""
    key, shape, dtype = (base.path, 0), tuple(base.inner_shape), base.dtype
    file = cache.find(key, shape, dtype, 1)
    if file is not None:
        try:
            mapped = cache.map_file(file, shape, dtype, key)
        except CorruptCacheError:
            if cache.readonly:
                raise
            mapped = None  # read again below and rewritten
        if mapped is not None:
            return np.array(mapped)  # a copy in memory: the mapping is released with it
        cache.forget(key)
    if cache.readonly:
        return _read_whole(zstore, base, timeout_s)
    identities = _identities(base, cache)
    data = _read_whole(zstore, base, timeout_s)
    slot = cache.new_slot(key, shape, dtype, 1)
    if slot is None:  # another rank writes it, or no room on disk: kept in memory only
        return data
    try:
        slot.array[...] = data
        if cache.identity is not None:
            for store_key, ident in identities:
                cache.identity.note(base.path, 0, store_key, ident)
        cache.seal(slot)
        cache.commit(slot, 1)
    finally:
        cache.drop(slot)
    return data


def _identities(base: ArrayGeometry, cache: ChunkCache) -> list[tuple[str, tuple[int, str, int]]]:
    """``(store key, (size, tag, mtime))`` of every stored object of the static array
    ``base``, as the cache's store check lists them (absent objects recorded as absent)."""
    check = cache.store_check
    if check is None or cache.identity is None or isinstance(check.lister, str):
        return []
    keys = [base.store_key(0, tile) for tile in base.tiles()]
    listing = check.lister.list(base.path, keys)
    listed = {str(k): i for i, k in enumerate(listing.keys)}
    out = []
    for k in keys:
        i = listed.get(k)
        if i is None:
            out.append((k, meta_identity(None)))
        else:
            ident = (int(listing.sizes[i]), str(listing.tags[i]), int(listing.mtimes[i]))
            out.append((k, ident))
    return out


class StaticFields:
    """A batch transform that puts the static ``arrays`` (``{label: array}``) into every batch,
    broadcast to ``(len(batch), *array.shape)`` without a copy (see the module docstring).
    ``views`` are the static views they were read through, if known (what
    :func:`keep_static_labels` holds a later set of views to)."""

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        views: Mapping[str, ArrayGeometry] | None = None,
    ) -> None:
        self.arrays = {label: np.asarray(a) for label, a in arrays.items()}
        self.views = dict(views or {})

    def __call__(self, batch: Batch) -> Batch:
        n = len(batch)
        for label, data in self.arrays.items():
            if label in batch.arrays:
                raise ValueError(f"label {label!r} is both a static field and a sampled view")
            batch.arrays[label] = broadcast_rows(data, n)
        return batch

    def __repr__(self) -> str:
        return f"StaticFields({sorted(self.arrays)})"


def keep_static_labels(views: Mapping[str, Any], transforms: Sequence[Any]) -> dict[str, Any]:
    """``views`` (given to ``InSituPipeline.set_views``) without their static labels, which
    must be those the pipeline was built with, as they were (the :class:`StaticFields` among
    ``transforms`` carries them into every batch, epoch after epoch). ``ValueError`` for a
    static label added, dropped or selected otherwise, and for views that are all static."""
    held = next((t for t in transforms if isinstance(t, StaticFields)), None)
    built = {} if held is None else held.views
    static = {lb: v for lb, v in views.items() if isinstance(v, ArrayGeometry) and v.static}
    if static != built:
        raise ValueError(
            f"set_views keeps the static labels this pipeline was built with ({sorted(built)}) "
            f"as they were, and was given {sorted(static)}"
            f"{' (selected otherwise)' if sorted(static) == sorted(built) else ''}: make "
            "static fields that change members of a stack (its static members may change), or "
            "build a pipeline with them"
        )
    rest = {lb: v for lb, v in views.items() if lb not in static}
    if not rest:
        raise ValueError(
            f"every view ({sorted(static)}) is a static array: give views with samples"
        )
    return rest


def broadcast_rows(data: np.ndarray, n: int) -> Any:
    """``data`` seen ``n`` times along a new first axis (stride 0). Marked writeable so that
    ``torch.from_numpy`` takes it without a warning; the module docstring says not to write."""
    return np.lib.stride_tricks.as_strided(
        data, shape=(n, *data.shape), strides=(0, *data.strides), writeable=True
    )
