"""Sample geometry: what one sample of an array is, and which stored objects hold it.

An array has exactly one *sample axis* (any physical axis; time for ERA5, Z for a microscopy
stack). A sample is one index along it; its payload is the whole extent of every other (*field*)
axis. Along the sample axis the array is cut into *chunks* of ``samples_per_chunk`` samples;
the field axes may be cut further into *tiles*. One stored object (one ``store.get``) is one
(chunk, tile) pair — on a sharded v3 array the object is the shard, so the geometry's ``chunks``
is the shard shape.

A *view* is ``(path, offset)``: ``geom.shift(k)`` reads ``array[anchor + k]`` for anchor ``anchor``.
Several views of one array share its path, so the engine decodes their chunks once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any

import numpy as np

from insitubatch_nodes import _zarr_compat
from insitubatch_nodes.stores import StoreLike, as_store, describe_store

__all__ = ["ArrayGeometry", "CorruptMetadataError", "check_arrays_in_store", "open_geometries"]


class CorruptMetadataError(ValueError):
    """A zarr metadata document (``zarr.json``, ``.zarray``, ...) cannot be read.

    ``documents`` lists ``(store key, reason)`` for each unreadable document and ``store``
    names the store; zarr's own error is chained (``__cause__``).
    """

    def __init__(self, store: str, documents: Sequence[tuple[str, str]], detail: str = ""):
        self.store, self.documents = store, list(documents)
        if self.documents:
            what = "; ".join(
                f"{key!r} (the metadata of {_node_name(key)}) {reason}"
                for key, reason in self.documents
            )
        else:
            what = f"a metadata document is not valid JSON ({detail})"
        super().__init__(
            f"corrupt zarr metadata in store {store}: {what}. Restore or rewrite the "
            "document(s): zarr cannot open the array or group without them"
        )


def _node_name(key: str) -> str:
    node = key.rpartition("/")[0]
    return f"array/group {node!r}" if node else "the root group"


def _corrupt_metadata(
    store: Any, exc: BaseException, keys: Sequence[str] | None = None
) -> CorruptMetadataError | None:
    """The error to raise for zarr's ``exc`` when metadata in ``store`` is unreadable."""
    import json

    try:
        bad = _zarr_compat.unreadable_metadata(store, keys)
    except Exception:  # the diagnosis is best effort: the store may not list, or be gone
        bad = []
    if bad or isinstance(exc, json.JSONDecodeError):
        return CorruptMetadataError(describe_store(store), bad, str(exc))
    return None


@dataclass(frozen=True)
class ArrayGeometry:
    """The frozen, physical description of one array (or one shifted view of it).

    ``shape`` and ``chunks`` are in physical (zarr) axis order. ``chunks`` is the stored object's
    shape (the shard on a sharded array); ``read_chunks`` is zarr's own chunk (the inner chunk of
    a shard). ``offset`` is the view's shift along the sample axis (0 for the array itself).
    """

    path: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype[Any]
    fill_value: Any
    sample_axis: int = 0
    offset: int = 0
    read_chunks: tuple[int, ...] = ()
    zarr_format: int = 3
    metadata: Any = field(default=None, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.chunks) != len(self.shape):
            raise ValueError(f"{self.path}: chunks {self.chunks} do not match shape {self.shape}")
        if not 0 <= self.sample_axis < len(self.shape):
            raise ValueError(
                f"{self.path}: sample_axis {self.sample_axis} is out of range for a "
                f"{len(self.shape)}-d array of shape {self.shape}"
            )
        if any(c <= 0 for c in self.chunks):
            raise ValueError(f"{self.path}: chunk sizes must be positive, got {self.chunks}")
        if not self.read_chunks:
            object.__setattr__(self, "read_chunks", self.chunks)
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    # -- the sample axis -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def samples_per_chunk(self) -> int:
        """Samples in one chunk along the sample axis (the last chunk may hold fewer)."""
        return self.chunks[self.sample_axis]

    @property
    def n_samples(self) -> int:
        """Length of the array along the sample axis."""
        return self.shape[self.sample_axis]

    @property
    def n_chunks(self) -> int:
        """Number of chunks along the sample axis (a partial final chunk counts)."""
        return math.ceil(self.n_samples / self.samples_per_chunk)

    def chunk_range(self, chunk_index: int) -> tuple[int, int]:
        """Half-open sample range ``[start, stop)`` of chunk ``chunk_index``."""
        if not 0 <= chunk_index < self.n_chunks:
            raise IndexError(f"{self.path}: chunk {chunk_index} not in [0, {self.n_chunks})")
        start = chunk_index * self.samples_per_chunk
        return start, min(start + self.samples_per_chunk, self.n_samples)

    # -- the field (inner) axes ------------------------------------------------------------
    @property
    def field_axes(self) -> tuple[int, ...]:
        """Physical indices of the field axes, in order."""
        return tuple(a for a in range(self.ndim) if a != self.sample_axis)

    @property
    def inner_shape(self) -> tuple[int, ...]:
        """Shape of one sample's payload (the array shape without the sample axis)."""
        return tuple(self.shape[a] for a in self.field_axes)

    @property
    def tile_shape(self) -> tuple[int, ...]:
        """Stored-object extent along each field axis."""
        return tuple(self.chunks[a] for a in self.field_axes)

    @property
    def tile_grid(self) -> tuple[int, ...]:
        """Number of stored objects along each field axis."""
        return tuple(math.ceil(self.shape[a] / self.chunks[a]) for a in self.field_axes)

    @property
    def n_tiles(self) -> int:
        """Stored objects per chunk (1 when the field is not tiled)."""
        return math.prod(self.tile_grid)

    @property
    def sample_nbytes(self) -> int:
        """Decoded bytes of one sample's payload."""
        return math.prod(self.inner_shape) * self.dtype.itemsize

    @property
    def chunk_nbytes(self) -> int:
        """Decoded bytes of one full chunk (all its tiles)."""
        return self.samples_per_chunk * self.sample_nbytes

    @property
    def sharded(self) -> bool:
        """True when a stored object is a shard holding several zarr chunks."""
        return self.read_chunks != self.chunks

    @property
    def one_level_per_object(self) -> bool:
        """True when each stored object holds one index of the first field axis and the whole
        of the others, with the sample axis first (ERA5 pressure levels stored one level per
        object: chunks ``(spc, 1, lat, lon)`` of ``(time, level, lat, lon)``).

        In a slot with the usual sample-first layout such an object's region is strided (one
        run per sample), so it cannot be decoded in place; in a *level-major* slot (see
        :mod:`insitubatch_nodes.residency`) each object's decoded bytes are one contiguous run
        and the decompressor writes them straight into the slot."""
        inner, tile = self.inner_shape, self.tile_shape
        return (
            self.sample_axis == 0
            and self.samples_per_chunk > 1
            and len(inner) >= 2
            and inner[0] > 1
            and tile[0] == 1
            and tile[1:] == inner[1:]
        )

    def tiles(self) -> Iterator[tuple[int, ...]]:
        """Every tile coordinate (over the field axes), in C order."""
        return product(*(range(n) for n in self.tile_grid))

    def tile_slices(self, tile: Sequence[int]) -> tuple[slice, ...]:
        """The rectangle a tile covers within ``inner_shape``."""
        return tuple(
            slice(t * c, min((t + 1) * c, n))
            for t, c, n in zip(tile, self.tile_shape, self.inner_shape, strict=True)
        )

    def chunk_coords(self, chunk_index: int, tile: Sequence[int]) -> tuple[int, ...]:
        """Physical chunk-grid coordinates of stored object ``(chunk_index, tile)``."""
        coords = list(tile)
        coords.insert(self.sample_axis, chunk_index)
        return tuple(coords)

    def store_key(self, chunk_index: int, tile: Sequence[int] = ()) -> str:
        """Store key (from the store root) of stored object ``(chunk_index, tile)``."""
        if self.metadata is None:
            raise ValueError(f"{self.path}: this geometry was built without zarr metadata")
        tile = tuple(tile) or (0,) * len(self.field_axes)
        key = _zarr_compat.encode_chunk_key(self.metadata, self.chunk_coords(chunk_index, tile))
        return f"{self.path}/{key}" if self.path else key

    # -- views ---------------------------------------------------------------------------------
    def shift(self, k: int) -> ArrayGeometry:
        """A view that reads ``array[anchor + k]`` along the sample axis (offsets add up)."""
        if not isinstance(k, int | np.integer):
            raise TypeError(f"shift() takes an integer number of samples, got {k!r}")
        return replace(self, offset=self.offset + int(k))

    @property
    def base(self) -> ArrayGeometry:
        """The unshifted array this view reads."""
        return replace(self, offset=0) if self.offset else self

    def with_inner(self, inner_shape: Sequence[int], dtype: Any) -> ArrayGeometry:
        """This view as a chunk transform leaves it: same path, sample axis, chunking along it
        and offset, but a sample payload of ``inner_shape`` and ``dtype`` (one tile).

        The result describes slots and batches, not stored objects: it has no zarr metadata,
        so it cannot name store keys or build a decoder. Returns ``self`` when nothing changes.
        """
        inner = tuple(int(n) for n in inner_shape)
        dtype = np.dtype(dtype)
        if inner == self.inner_shape and dtype == self.dtype:
            return self
        if len(inner) != len(self.field_axes) or any(n <= 0 for n in inner):
            raise ValueError(
                f"{self.path}: a transformed sample must keep {len(self.field_axes)} field "
                f"axes of positive length, got inner shape {inner}"
            )
        axis = self.sample_axis
        shape = (*inner[:axis], self.n_samples, *inner[axis:])
        chunks = (*inner[:axis], self.samples_per_chunk, *inner[axis:])
        return replace(
            self, shape=shape, chunks=chunks, read_chunks=chunks, dtype=dtype, metadata=None
        )

    def __repr__(self) -> str:
        off = f", offset={self.offset}" if self.offset else ""
        return (
            f"ArrayGeometry({self.path!r}, shape={self.shape}, chunks={self.chunks}, "
            f"dtype={self.dtype}, sample_axis={self.sample_axis}{off})"
        )


def _is_coordinate(path: str, array: Any) -> bool:
    if array.ndim == 0:
        return True  # a grid mapping / scalar: nothing to draw samples along
    dims = _zarr_compat.array_dimension_names(array)
    if array.ndim == 1 and dims is not None:
        return dims[0] == path.rsplit("/", 1)[-1]
    return False


def _geometry(path: str, array: Any, sample_axis: int) -> ArrayGeometry:
    ndim = array.ndim
    axis = sample_axis + ndim if sample_axis < 0 else sample_axis
    if not 0 <= axis < ndim:
        raise ValueError(
            f"sample_axis={sample_axis} is out of range for array {path!r} of shape "
            f"{tuple(array.shape)} ({ndim} axes); pick an axis in [0, {ndim})"
        )
    return ArrayGeometry(
        path=path,
        shape=tuple(int(s) for s in array.shape),
        chunks=_zarr_compat.stored_chunk_shape(array),
        dtype=np.dtype(array.dtype),
        fill_value=array.fill_value,
        sample_axis=axis,
        read_chunks=_zarr_compat.read_chunk_shape(array),
        zarr_format=int(array.metadata.zarr_format),
        metadata=array.metadata,
    )


def open_geometries(
    store: StoreLike,
    variables: Sequence[str] | None = None,
    *,
    sample_axis: int | Mapping[str, int] = 0,
) -> dict[str, ArrayGeometry]:
    """Read the geometry of the arrays in a zarr v2 or v3 group.

    ``store`` is a URL, a path or any ``zarr.abc.store.Store``. With ``variables=None`` every
    data array in the group (nested groups included) is returned and coordinates are skipped:
    a 1-D array whose only dimension is named like the array itself (``time``, ``lat``) and any
    0-D array (a grid mapping). Naming an array in ``variables`` bypasses that test (a 0-D
    array still has no sample axis, so naming one raises ``ValueError``).

    ``sample_axis`` is one physical axis for every array, or a ``{path: axis}`` mapping (arrays
    it does not name use axis 0). Raises ``KeyError`` for an unknown name (listing the arrays
    that exist), ``ValueError`` for a sample axis out of range, ``FileNotFoundError`` naming
    the store when there is no group at its root (wrong path or prefix, missing bucket) and
    :class:`CorruptMetadataError` naming the document(s) when a metadata document cannot be
    read.
    """
    if isinstance(variables, str):
        variables = [variables]
    zstore = as_store(store)
    try:
        group = _zarr_compat.open_group_readonly(zstore)
    except FileNotFoundError as exc:  # zarr's GroupNotFoundError
        raise FileNotFoundError(
            f"no zarr group in store {describe_store(zstore)}: nothing at its root. Check the "
            "path, or the URL's bucket and prefix (and the endpoint and credentials)"
        ) from exc
    except (ValueError, TypeError, KeyError) as exc:
        error = _corrupt_metadata(zstore, exc)
        if error is None:
            raise
        raise error from exc
    try:
        arrays = dict(_zarr_compat.walk_arrays(group))
    except (ValueError, TypeError, KeyError) as exc:
        error = _corrupt_metadata(zstore, exc)
        if error is None:
            raise
        raise error from exc

    def axis_for(path: str) -> int:
        if isinstance(sample_axis, Mapping):
            unknown = set(sample_axis) - set(arrays)
            if unknown:
                raise KeyError(f"sample_axis names unknown arrays {sorted(unknown)}")
            return int(sample_axis.get(path, 0))
        return int(sample_axis)

    if variables is None:
        names = [p for p, a in arrays.items() if not _is_coordinate(p, a)]
    else:
        missing = [v for v in variables if v.strip("/") not in arrays]
        if missing:
            raise KeyError(
                f"no array named {missing} in store {describe_store(zstore)}; available "
                f"arrays: {sorted(arrays)} (an array whose metadata document, zarr.json or "
                "v2's .zarray, is missing from the store is not found either)"
            )
        names = [v.strip("/") for v in variables]
    return {name: _geometry(name, arrays[name], axis_for(name)) for name in names}


def check_arrays_in_store(store: StoreLike, geoms: Mapping[str, ArrayGeometry]) -> None:
    """Check that ``store`` holds every array ``geoms`` describes, with that layout.

    One metadata read per array (two for zarr v2). Raises ``FileNotFoundError`` naming the
    array and the store when there is no such array there (a wrong path or prefix, a missing
    bucket, geometries read from another store), ``ValueError`` when the array there has
    another shape, chunking, dtype or chunk key encoding, and :class:`CorruptMetadataError`
    when its metadata cannot be read. Without this check a pipeline over a store that holds
    nothing would read every chunk as missing, i.e. as the fill value.
    """
    zstore = as_store(store)
    name = describe_store(zstore)
    for path, geom in geoms.items():
        geom = geom.base
        try:
            array = _zarr_compat.open_array_readonly(zstore, path, geom.zarr_format)
        except FileNotFoundError as exc:
            keys = _zarr_compat.array_metadata_keys(path, geom.zarr_format)
            raise FileNotFoundError(
                f"array {path!r} is not in store {name}: no zarr v{geom.zarr_format} array "
                f"metadata at {keys[0]!r}. Check the path, or the URL's bucket and prefix (and "
                "the endpoint), and that the geometries were read from this store"
            ) from exc
        except (ValueError, TypeError, KeyError) as exc:
            keys = _zarr_compat.array_metadata_keys(path, geom.zarr_format)
            error = _corrupt_metadata(zstore, exc, keys)
            if error is None:
                raise
            raise error from exc
        found = _geometry(path, array, geom.sample_axis)
        diffs = [
            f"{field} {getattr(found, field)} in the store, {getattr(geom, field)} in the geometry"
            for field in ("shape", "chunks", "read_chunks", "dtype")
            if getattr(found, field) != getattr(geom, field)
        ]
        if not diffs and geom.metadata is not None and found.store_key(0) != geom.store_key(0):
            diffs.append(
                f"chunk keys like {found.store_key(0)!r} in the store, "
                f"{geom.store_key(0)!r} in the geometry"
            )
        if diffs:
            raise ValueError(
                f"array {path!r} in store {name} does not match the geometry passed for it: "
                + "; ".join(diffs)
                + ". Were the geometries read from another store? Read them from this one "
                "with open_geometries(store)"
            )
