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

**Beside patched labels** (``view.patches(...)``: each row a window of the field) a static
label that has patched dimensions is cut to **each row's window** along them
(:class:`StaticCut`): ``(len(batch), *window)``, ``mask[window]`` at the row's origin
(``batch.patch_origins`` of the patched labels: every patched label of a pipeline shares its
rows' origins), a dense copy per batch, as a patched stack's static member and the forcings of
a patched label are cut. The copies are written into reusable buffers lent under the batch
buffers' ownership rule (:class:`~insitubatch_nodes.lending.BufferPool`: a buffer is
lent again only once nothing made from its batch is left), counted in
:attr:`StaticFields.held_bytes` and so in ``pipe.stats()``'s ``batch_transform_bytes``. A static
label without any patched dimension (a bandpass ``(freq,)`` beside ``(dec, ra)`` windows) stays
whole and broadcast; one that lacks them by name only (``(latitude, longitude)`` beside ``(lat,
lon)`` windows, or unnamed axes), its axes of the field's lengths there, is refused
(:func:`refuse_whole_on_grid` says which names to give it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from insitubatch_nodes.batch import Batch
from insitubatch_nodes.cache.directory import ChunkCache
from insitubatch_nodes.cache.fingerprint import array_fingerprint
from insitubatch_nodes.cache.identity import meta_identity
from insitubatch_nodes.errors import CorruptCacheError, short_cause
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.geometry import ArrayGeometry, Patches
from insitubatch_nodes.io.patching import cut_windows
from insitubatch_nodes.io.selection import kept_axes, view_keys
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store
from insitubatch_nodes.lending import BufferPool

if TYPE_CHECKING:
    from insitubatch_nodes.pool import PoolStats

__all__ = [
    "StaticCut",
    "StaticFields",
    "broadcast_rows",
    "keep_static_labels",
    "read_static",
    "refuse_whole_on_grid",
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
    stats: PoolStats | None = None,
) -> dict[str, np.ndarray]:
    """``{label: array}`` for the static ``views``: each array read whole once (however many
    views share it) within ``timeout_s``, then selected per view. With a persistent ``cache``
    (``persist=True``) a static array is one cached entry (chunk 0 of its path): served from
    the cache when it is there (nothing read from the store), else read and kept there; a
    read-only cache is never written. ``stats`` (the pipeline's pool's) counts the stored
    objects read (``static_gets``) and the arrays served by the cache (``static_disk_hits``)."""
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
                whole[view.path], cached = _cached_whole(zstore, base, timeout_s, cache)
            else:
                whole[view.path], cached = _read_whole(zstore, base, timeout_s), False
            if stats is not None:
                stats.static_disk_hits += cached
                stats.static_gets += 0 if cached else base.n_tiles
        out[label] = select_static(view, whole[view.path]).astype(view.dtype, copy=False)
    return out


def _read_whole(zstore: Any, base: ArrayGeometry, timeout_s: float) -> np.ndarray:
    array = _zarr_compat.open_array_readonly(zstore, base.path, base.zarr_format)
    try:
        data = _zarr_compat.read_whole_array(array, timeout_s)
    except Exception as exc:  # a refusal keeps its type and its whole advice (ours)
        error = next((t for t in (TimeoutError, PermissionError) if isinstance(exc, t)), OSError)
        said = f"{type(exc).__name__}: {exc}" if error is PermissionError else short_cause(exc)
        raise error(
            f"cannot read static array {base.path!r} from store {describe_store(zstore)} ({said})"
        ) from exc
    if base.cf is not None:  # CF mask and scale, as the engine decodes sampled arrays
        return base.cf.decode(np.asarray(data))
    return np.ascontiguousarray(data, dtype=base.dtype)


def _cached_whole(
    zstore: Any, base: ArrayGeometry, timeout_s: float, cache: ChunkCache
) -> tuple[np.ndarray, bool]:
    """The whole static array ``base`` from the persistent ``cache`` (``(data, True)``), or
    read and kept there with the identity of every stored object it was read from (listed
    before the read, so a change during the read makes the entry stale, never wrongly fresh;
    ``(data, False)``)."""
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
            return np.array(mapped), True  # a copy in memory: the mapping is released with it
        cache.forget(key)
    if cache.readonly:
        return _read_whole(zstore, base, timeout_s), False
    identities = _identities(base, cache)
    data = _read_whole(zstore, base, timeout_s)
    slot = cache.new_slot(key, shape, dtype, 1)
    if slot is None:  # another rank writes it, or no room on disk: kept in memory only
        return data, False
    try:
        slot.array[...] = data
        if cache.identity is not None:
            for store_key, ident in identities:
                cache.identity.note(base.path, 0, store_key, ident)
        cache.seal(slot)
        cache.commit(slot, 1)
    finally:
        cache.drop(slot)
    return data, False


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


@dataclass(frozen=True)
class StaticCut:
    """Where the windows of patched labels cut a static label's data (as its view selects
    it): ``axes`` of that data, ``columns`` of ``batch.patch_origins[label]`` that give each
    row's origin along them, ``extent`` the window's size along them."""

    axes: tuple[int, ...]
    columns: tuple[int, ...]
    extent: tuple[int, ...]

    @classmethod
    def of(
        cls, label: str, view: ArrayGeometry, spec: Patches, who: str | None = None
    ) -> StaticCut | None:
        """The cut of static ``view`` (label ``label``; ``who`` names it in messages) by the
        windows of ``spec``: along each patched dimension it has (by name), ``None`` where it
        has none (or either has no dimension names): it stays whole. ``ValueError`` where it
        has a patched dimension but not whole there, of the field's length in its stored order
        (another grid, a box of it, a reversed latitude): its windows would be at other points
        than the rows'."""
        if spec.dims is None or view.dims is None:
            return None
        keys = view.select.keys if view.select is not None else (None,) * view.ndim
        key_of = dict(zip(view.dims, keys, strict=False))
        kept = [d for d, k in key_of.items() if not isinstance(k, int)]
        axes, columns, extent = [], [], []
        for k, (d, e, n) in enumerate(zip(spec.dims, spec.extent, spec.field, strict=True)):
            if d not in kept:
                continue
            a = kept.index(d)
            has = view.inner_shape[a]
            if key_of[d] is not None or has != n:  # (isel keeps a whole axis as None)
                what = f"{has}, selected" if key_of[d] is not None else f"{has}"
                if has == n and key_of[d] is not None:
                    what = f"all {n}, in another order"
                raise ValueError(
                    f"{who or f'static label {label!r} ({view.path})'} has the patched "
                    f"dimension {d!r}, and each row of it is cut to its row's window there: it "
                    f"must be whole there, of length {n} in its stored order, as the patched "
                    f"views' field (it has {what}); store it on the field's grid, or select on "
                    "other dimensions"
                )
            axes.append(a)
            columns.append(k)
            extent.append(e)
        if not axes:
            return None
        return cls(tuple(axes), tuple(columns), tuple(extent))

    def shape(self, view: ArrayGeometry) -> tuple[int, ...]:
        """The shape of one window of ``view``'s (selected) data."""
        shape = list(view.inner_shape)
        for a, e in zip(self.axes, self.extent, strict=True):
            shape[a] = e
        return tuple(shape)

    def shape_of(self, data: np.ndarray) -> tuple[int, ...]:
        """The shape of one window of ``data`` (the static field as its view selects it)."""
        shape = list(data.shape)
        for a, e in zip(self.axes, self.extent, strict=True):
            shape[a] = e
        return tuple(shape)

    def rows(self, data: np.ndarray, origins: np.ndarray) -> np.ndarray:
        """``(len(origins), *window)``: row ``i`` is ``data`` cut to the window at
        ``origins[i]`` (the patched labels' ``batch.patch_origins``), every row at once (a
        gather from the windows' strided view: write it where it goes, or make it contiguous)."""
        rows = np.broadcast_to(data, (len(origins), *data.shape))
        picked = np.asarray(origins)[:, list(self.columns)]
        return cut_windows(rows, picked, self.axes, self.extent)


class StaticFields:
    """A batch transform that puts the static ``arrays`` (``{label: array}``) into every batch,
    broadcast to ``(len(batch), *array.shape)`` without a copy (see the module docstring).
    ``views`` are the static views they were read through, if known (what
    :func:`keep_static_labels` holds a later set of views to). ``patches``: the windows of the
    batches' patched labels, if any; a static label with a patched dimension is then cut to
    each row's window (:class:`StaticCut`; ``ValueError`` here for one that cannot be)."""

    #: the pipeline's own constants, not a transform the user gave (the epoch report's
    #: ``batch_transforms`` leaves it out)
    pipeline_constants: ClassVar[bool] = True

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        views: Mapping[str, ArrayGeometry] | None = None,
        patches: Patches | None = None,
    ) -> None:
        self.arrays = {label: np.asarray(a) for label, a in arrays.items()}
        self.views = dict(views or {})
        self.patches = patches
        self.cuts: dict[str, StaticCut] = {}
        for label, view in self.views.items():
            cut = None if patches is None else StaticCut.of(label, view, patches)
            if patches is not None:
                refuse_whole_on_grid(label, view, patches, cut)
            if cut is not None:
                self.cuts[label] = cut
        self._buffers: dict[str, Any] = {}  # cut label -> its BufferPool (made at first use)
        self._lock = threading.Lock()  # (one instance may serve two pipelines' threads)

    @property
    def held_bytes(self) -> int:
        """Bytes held outside the pool (``pipe.stats()``'s ``batch_transform_bytes``): the
        static arrays, and the buffers the cut labels' rows are written into (lent out to
        batches, or idle)."""
        arrays = sum(a.nbytes for a in self.arrays.values())
        return arrays + sum(pool.held_bytes for pool in self._buffers.values())

    def most_held_bytes(self, views: Mapping[str, Any], rows: int, batches: int) -> int:
        """The most :attr:`held_bytes` grows to with batches of ``rows`` rows, ``batches`` of
        them alive at once (the batch buffers' count, which the cut rows lent here follow):
        the arrays, and per cut label ``batches`` buffers of its rows' windows. ``views`` is
        the protocol's (unused: the arrays are read). What the build's memory check counts."""
        arrays = sum(a.nbytes for a in self.arrays.values())
        cuts = sum(
            batches * rows * math.prod(cut.shape_of(self.arrays[label]))
            * self.arrays[label].dtype.itemsize
            for label, cut in self.cuts.items()
        )  # fmt: skip
        return arrays + cuts

    def release_idle(self) -> None:
        """Let go of the cut labels' buffers (one lent out is freed with its batch): the
        pipeline's close."""
        with self._lock:
            for pool in self._buffers.values():
                pool.release_idle()

    def __getstate__(self) -> dict[str, Any]:
        # the buffers (and their lock) stay with this process: a copy makes its own
        return {k: v for k, v in self.__dict__.items() if k not in ("_buffers", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _buffers={}, _lock=threading.Lock())

    def _cut_into(self, label: str, cut: StaticCut, data: np.ndarray, origins: Any) -> Any:
        """``cut.rows(data, origins)`` written into a buffer lent from this label's pool."""
        n = len(origins)
        with self._lock:
            pool = self._buffers.get(label)
            if pool is None or pool.shape[0] < n:
                pool = self._buffers[label] = BufferPool((n, *cut.shape_of(data)), data.dtype)
            out = pool.take()[:n]
        np.copyto(out, cut.rows(data, origins))
        return out

    def check_patches(self, spec: Patches | None) -> None:
        """``ValueError`` unless the batches' patched labels, cut by ``spec`` (``None``: none is
        patched), are cut as this transform cuts its labels (what a
        :class:`~insitubatch_nodes.stages.gather.GatherNode` composed by hand checks, as
        ``insitu_pipeline`` builds it): a static label with a patched dimension would otherwise
        carry the whole field beside rows that are windows, or windows of other patches."""
        held = self.patches
        if spec is None or held is None:
            if spec is held:
                return
        elif spec.alike(held):  # (the tiling windows are grouped by aside, cut alike)
            return
        if not self.views and spec is not None:
            raise ValueError(
                f"StaticFields({sorted(self.arrays)}) were given no views, and the labels are "
                "patched: give views= (the static views read) and patches= (the labels' "
                "view.patch), and each static label with a patched dimension is cut to its "
                "row's window"
            )
        if self.cuts or StaticFields({}, self.views, spec).cuts:
            raise ValueError(
                f"static labels {sorted(self.views)} are cut at {_windows(held)}, and the "
                f"labels have {_windows(spec)}: patch the labels as the pipeline was "
                "built (set_views keeps how each array is patched), or give StaticFields "
                "patches= the patched labels' view.patch (None where none is)"
            )

    def __call__(self, batch: Batch) -> Batch:
        n = len(batch)
        for label, data in self.arrays.items():
            if label in batch.arrays:
                raise ValueError(f"label {label!r} is both a static field and a sampled view")
            cut = self.cuts.get(label)
            if cut is None:
                batch.arrays[label] = broadcast_rows(data, n)
                continue
            origins = next(iter(batch.patch_origins.values()), None)
            if origins is None:
                raise ValueError(
                    f"static label {label!r} is cut to each row's window of the patched "
                    "labels, and this batch has no patched label: give StaticFields the "
                    "patches of the batches' labels (patches=), or none"
                )
            batch.arrays[label] = self._cut_into(label, cut, data, origins)
        return batch

    def __repr__(self) -> str:
        return f"StaticFields({sorted(self.arrays)})"


def refuse_whole_on_grid(
    label: str, view: ArrayGeometry, spec: Patches, cut: StaticCut | None
) -> None:
    """``ValueError`` for static ``view`` (label ``label``) that ``cut`` (its
    :meth:`StaticCut.of` by ``spec``) leaves whole along patched dimensions it lacks by name
    (its dimensions named otherwise, or unnamed) while its other axes have the field's lengths
    there, in order: it is likely on the patched field's grid, and carried whole every row
    would hold the whole field beside rows that are windows. The message says how to name its
    dimensions as the patched labels' (each row is then cut to its window)."""
    done = cut.columns if cut is not None else ()
    lacked = [k for k in range(len(spec.extent)) if k not in done]
    free = [a for a in range(len(view.inner_shape)) if cut is None or a not in cut.axes]
    matched: list[int] = []
    for a in free:  # the lacked dimensions' lengths, in order, among the axes left whole
        if len(matched) < len(lacked) and view.inner_shape[a] == spec.field[lacked[len(matched)]]:
            matched.append(a)
    if not lacked or len(matched) < len(lacked):
        return
    if spec.dims is None:
        lacks = f"the patched axes {list(spec.axes)} (the patched labels name no dimensions)"
        name_them = (
            "name the patched labels' dimensions and its own alike, "
            "dataclasses.replace(view, dim_names=(...)) on both"
        )
    else:
        kept = kept_axes(view_keys(view))
        names = list(view.dims or (f"dim_{i}" for i in range(view.ndim)))
        for a, k in zip(matched, lacked, strict=True):
            names[kept[a]] = spec.dims[k]
        lacks = f"the patched dimensions {[spec.dims[k] for k in lacked]}"
        name_them = (
            f"name its dimensions as theirs, dataclasses.replace(view, dim_names={tuple(names)})"
        )
    raise ValueError(
        f"static label {label!r} ({view.path}, dimensions "
        f"{view.dims if view.dims is not None else 'unnamed'}, shape {view.inner_shape}) "
        f"lacks {lacks} by name, and has the field's lengths "
        f"{[spec.field[k] for k in lacked]} there: carried whole, every row would hold the "
        f"whole field beside rows that are windows. If it is on the patched labels' grid, "
        f"{name_them}, and each row carries its own window of it; if it is not, add it whole "
        "with a batch transform of your own"
    )


def _windows(spec: Patches | None) -> str:
    """``spec``'s windows in words, for messages."""
    if spec is None:
        return "no windows (not patched)"
    cut = dict(zip(spec.dims or spec.axes, spec.extent, strict=True))
    return f"windows of {cut} ({spec.origins} origins)"


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
