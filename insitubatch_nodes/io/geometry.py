"""Sample geometry: what one sample of an array is, and which stored objects hold it.

An array has exactly one *sample axis* (any physical axis; time for ERA5, Z for a microscopy
stack). A sample is one index along it; its payload is the whole extent of every other (*field*)
axis. Along the sample axis the array is cut into *chunks* of ``samples_per_chunk`` samples;
the field axes may be cut further into *tiles*. One stored object (one ``store.get``) is one
(chunk, tile) pair — on a sharded v3 array the object is the shard, so the geometry's ``chunks``
is the shard shape.

A *view* is ``(path, offset)``: ``geom.shift(k)`` reads ``array[anchor + k]`` for anchor ``anchor``.
Several views of one array share its path, so the engine decodes their chunks once.

A *window* (``geom.window([-1, 0, 1])``, or in time deltas ``geom.window(["-6h", "0h"])``)
makes a sample several steps of the array: ``array[anchor + offset + k]`` for each ``k``, so its
:attr:`~ArrayGeometry.sample_shape` is ``(len(offsets), *inner_shape)`` and a batch holds
``(batch, T, *inner_shape)``. The engine reads it as ``T`` plain shifted views of the array, its
*parts* (:meth:`~ArrayGeometry.parts`); time deltas are resolved through the time coordinate
when the pipeline is built (:meth:`~ArrayGeometry.in_samples`).

A *patched* view (``geom.patches({"y": 256, "x": 256})``) makes a sample a window of the field:
its samples are ``array[anchor, y0:y0 + 256, x0:x0 + 256]`` for origins the read plan draws
(:class:`Patches` says how), and its :attr:`~ArrayGeometry.inner_shape` is the window's. The
engine then holds and reads the stored tiles the windows touch, not whole fields.

An array's *path* is zarr's own (``array.path``): ``"t2m"``, ``"group/z"``, ``"a/b/t2m"`` below
folders that hold no group metadata, and ``""`` for an array at the store root (written by
``zarr.save_array(store, data)`` or tensorstore); ``"/"`` names the root array too.

``ArrayGeometry.dtype`` is the dtype of the *decoded* values, in native byte order: ``float32``
for a big-endian ``">f4"`` array (v2, or a v3 ``bytes`` codec), ``float64`` for ``int16``
packed with CF ``scale_factor`` / ``add_offset`` (``cf``, :mod:`~insitubatch_nodes.io.cf`). The
decoder swaps and unpacks as it writes each chunk, so chunk transforms, the persistent cache and
the batches all see that one dtype; the stored one stays in ``metadata``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any

import numpy as np

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.axes import axis_of
from insitubatch_nodes.io.cf import CFValues
from insitubatch_nodes.io.members import MemberMap
from insitubatch_nodes.io.patching import AxisMap, Patches, patch_spec
from insitubatch_nodes.io.points import points_hint
from insitubatch_nodes.io.product import ProductGrid, refuse_on_product, sample_coords
from insitubatch_nodes.io.selection import (
    Selection,
    axis_key,
    kept_axes,
    label_positions,
    view_keys,
)
from insitubatch_nodes.io.timeunits import as_timedelta

__all__ = ["ArrayGeometry", "Patches", "in_native_byte_order"]


def _fill_token(value: Any) -> Any:
    """A hashable stand-in for a fill value that compares by value (NaN equals NaN)."""
    if value is None:
        return None
    try:
        arr = np.asarray(value)
        if arr.ndim == 0 and arr.dtype.kind in "biufc":
            return (arr.dtype.kind, repr(arr.item()))
    except (TypeError, ValueError):
        pass
    return ("repr", repr(value))


def in_native_byte_order(dtype: Any) -> np.dtype[Any]:
    """``dtype`` in this machine's byte order (``">f4"`` -> ``float32``); a dtype without a byte
    order (bool, bytes, objects) is returned unchanged."""
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


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
    fill_value: Any = field(compare=False)
    sample_axis: int = 0
    offset: int = 0
    read_chunks: tuple[int, ...] = ()
    zarr_format: int = 3
    metadata: Any = field(default=None, compare=False, repr=False, hash=False)
    patch: Patches | None = None
    window_offsets: tuple[Any, ...] | None = None
    #: what a selected view keeps of each field axis (:meth:`isel`, :meth:`sel`)
    select: Selection | None = None
    #: a static array: no sample axis, every axis a field axis (see :meth:`as_static`)
    static: bool = False
    #: reads a field dimension's coordinate values, ``coordinates(geom, dim)`` (what
    #: :meth:`sel` looks values up in; set by ``open_geometries``)
    coordinates: Any = field(default=None, compare=False, repr=False, hash=False)
    #: a collection variable's virtual array: where each member's samples and stored objects
    #: are (:mod:`~insitubatch_nodes.io.members`; ``None`` for an array of one store)
    members: MemberMap | None = field(default=None, repr=False)
    #: product sample axes: every combination of indices along several axes is a sample
    product: ProductGrid | None = field(default=None, repr=False)
    #: how stored values decode (CF mask and scale; ``None``: as stored), see :mod:`.cf`
    cf: CFValues | None = field(default=None, repr=False)
    #: dimension names given by who built the view, where they win over the metadata's own
    #: (a collection's ``dims=``: an NGFF plate's axes); see :attr:`dims`
    dim_names: tuple[str, ...] | None = None
    #: the latitude and longitude arrays of a grid of points: the last field axis is the
    #: horizontal grid (:mod:`~insitubatch_nodes.io.points`; ``None``: the last two are)
    points: tuple[str, str] | None = field(default=None, compare=False)
    # ``fill_value`` compared by value: a NaN fill value equals itself (Python 3.13's dataclass
    # ``__eq__`` compares field by field, without the identity shortcut of a tuple compare)
    _fill_token: Any = field(init=False, repr=False, default=None)

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
        if self.dim_names is not None and len(self.dim_names) != len(self.shape):
            raise ValueError(f"{self.path}: dim_names {self.dim_names} do not match {self.shape}")
        if not self.read_chunks:
            object.__setattr__(self, "read_chunks", self.chunks)
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "_fill_token", _fill_token(self.fill_value))

    # -- the sample axis -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def samples_per_chunk(self) -> int:
        """Samples in one chunk along the sample axis (the last chunk may hold fewer)."""
        if self.product is not None:
            return self.product.samples_per_chunk
        return self.chunks[self.sample_axis]

    @property
    def n_samples(self) -> int:
        """Length of the array along the sample axis (on product axes: the virtual one)."""
        if self.product is not None:
            return self.product.n_samples
        return self.shape[self.sample_axis]

    @property
    def n_chunks(self) -> int:
        """Number of chunks along the sample axis (a partial final chunk counts)."""
        return math.ceil(self.n_samples / self.samples_per_chunk)

    def chunk_range(self, chunk_index: int) -> tuple[int, int]:
        """Half-open sample range ``[start, stop)`` of chunk ``chunk_index``."""
        if not 0 <= chunk_index < self.n_chunks:
            raise IndexError(f"{self.path}: chunk {chunk_index} not in [0, {self.n_chunks})")
        if self.product is not None:  # a block's valid samples (its padding follows them)
            return self.product.chunk_range(chunk_index)
        start = chunk_index * self.samples_per_chunk
        return start, min(start + self.samples_per_chunk, self.n_samples)

    def sample_coords(self, samples: Any) -> np.ndarray:
        """Each sample index's indices along the sample axes, ``(len(samples), k)``: ``(t, z)``
        rows on product axes ``("t", "z")`` (:mod:`~insitubatch_nodes.io.product`)."""
        return sample_coords(self, samples)

    # -- the field (inner) axes ------------------------------------------------------------
    @functools.cached_property
    def field_axes(self) -> tuple[int, ...]:
        """Physical indices of the field axes, in order (every axis of a static array)."""
        if self.static:
            return tuple(range(self.ndim))
        skip = (self.sample_axis,) if self.product is None else self.product.axes
        return tuple(a for a in range(self.ndim) if a not in skip)

    @functools.cached_property
    def field_shape(self) -> tuple[int, ...]:
        """The array's shape without the sample axis (the whole field, patched or not)."""
        return tuple(self.shape[a] for a in self.field_axes)

    @functools.cached_property
    def inner_shape(self) -> tuple[int, ...]:
        """Shape of one sample's payload: the field (:attr:`field_shape`), on a patched view
        the window (the patched axes at their extent), on a selected view the selection."""
        p = self.patch
        size = {} if p is None else dict(zip(p.axes, p.extent, strict=True))
        shape = tuple(size.get(a, self.shape[a]) for a in self.field_axes)
        return shape if self.select is None else self.select.shape(shape)

    @functools.cached_property
    def tile_shape(self) -> tuple[int, ...]:
        """Stored-object extent along each field axis."""
        return tuple(self.chunks[a] for a in self.field_axes)

    @functools.cached_property
    def tile_grid(self) -> tuple[int, ...]:
        """Number of stored objects along each field axis."""
        return tuple(math.ceil(self.shape[a] / self.chunks[a]) for a in self.field_axes)

    @functools.cached_property
    def n_tiles(self) -> int:
        """Stored objects per chunk (1 when the field is not tiled)."""
        return math.prod(self.tile_grid)

    @functools.cached_property
    def sample_nbytes(self) -> int:
        """Decoded bytes of one sample's payload."""
        return math.prod(self.inner_shape) * self.dtype.itemsize

    @functools.cached_property
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

        In a sample-first slot such an object's region is strided (one run per sample): not
        decoded in place; in a *level-major* slot (:mod:`insitubatch_nodes.pool`) each
        object's decoded bytes are one contiguous run, decoded straight into the slot."""
        inner, tile = self.inner_shape, self.tile_shape
        return (
            self.sample_axis == 0
            and self.product is None
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
            for t, c, n in zip(tile, self.tile_shape, self.field_shape, strict=True)
        )

    def chunk_coords(self, chunk_index: int, tile: Sequence[int]) -> tuple[int, ...]:
        """Physical chunk-grid coordinates of stored object ``(chunk_index, tile)`` (a static
        array's: the tile's)."""
        if self.static:
            return tuple(tile)
        if self.product is not None:  # the block's coordinates along each product axis
            return self.product.chunk_coords(chunk_index, tile, self.ndim)
        coords = list(tile)
        coords.insert(self.sample_axis, chunk_index)
        return tuple(coords)

    def store_key(self, chunk_index: int, tile: Sequence[int] = ()) -> str:
        """Store key (from the store root) of stored object ``(chunk_index, tile)``."""
        if self.metadata is None:
            raise ValueError(f"{self.path}: this geometry was built without zarr metadata")
        tile = tuple(tile) or (0,) * len(self.field_axes)
        coords = self.chunk_coords(chunk_index, tile)
        if self.members is not None:  # the member's own object
            return self.members.store_key(self.metadata, coords, self.sample_axis, chunk_index)
        template = self.key_template
        if template is not None:
            return template.format(*coords)
        key = _zarr_compat.encode_chunk_key(self.metadata, coords)
        return f"{self.path}/{key}" if self.path else key

    @functools.cached_property
    def key_template(self) -> str | None:
        """The store keys of this array as a ``str.format`` template over the physical
        chunk-grid coordinates (``key_template.format(*coords)`` is :meth:`store_key`), or
        ``None`` when zarr must encode each key (no metadata, or an unusual key encoding)."""
        if self.metadata is None or self.members is not None or self.product is not None:
            return None
        template = _zarr_compat.chunk_key_format(self.metadata, self.ndim)
        if template is None:
            return None
        prefix = self.path.replace("{", "{{").replace("}", "}}")
        return f"{prefix}/{template}" if self.path else template

    # -- views ---------------------------------------------------------------------------------
    def shift(self, k: int) -> ArrayGeometry:
        """A view that reads ``array[anchor + k]`` along the sample axis (offsets add up)."""
        if isinstance(k, bool | np.bool_) or not isinstance(k, int | np.integer):
            raise TypeError(f"shift() takes an integer number of samples, got {k!r}")
        if self.static:
            raise ValueError(f"{self.path}: a static array has no samples to shift along")
        refuse_on_product(self, "shift()")
        return replace(self, offset=self.offset + int(k))

    def window(self, offsets: Sequence[Any]) -> ArrayGeometry:
        """A view whose sample is ``len(offsets)`` steps of the array: ``array[anchor + k]`` for
        each ``k`` of ``offsets`` (plus this view's own offset), in the order given, so
        :attr:`sample_shape` is ``(len(offsets), *inner_shape)`` and a batch holds
        ``(batch, len(offsets), *inner_shape)``.

        ``offsets`` are distinct samples (ints, e.g. ``[-1, 0]``) or distinct time deltas
        (``["-6h", "0h"]``, ``numpy.timedelta64``, ``datetime.timedelta``), not both; deltas
        are resolved when the pipeline is built, through the time coordinate of the manifest's
        anchor array (:meth:`in_samples`): a delta that is not a whole multiple of the data's
        step raises ``ValueError`` naming both. Composes with :meth:`shift` (the whole window
        moves) and :meth:`patches` (every step takes the row's window of the field). Anchors
        are kept only where every step reads inside the array (and the split), and the
        missing-step checks look at every step.
        """
        if self.static:
            raise ValueError(f"{self.path}: a static array has no samples to take a window of")
        if self.window_offsets is not None:
            raise ValueError(f"{self.path}: this view is a window already; give all its steps once")
        refuse_on_product(self, "window()")
        if isinstance(offsets, str | bytes) or not isinstance(offsets, Sequence | np.ndarray):
            raise TypeError(
                f"window() takes a sequence of offsets, e.g. [-1, 0] or ['-6h', '0h'], got "
                f"{offsets!r}"
            )
        steps = list(offsets)
        if not steps:
            raise ValueError(f"{self.path}: a window needs at least one offset")
        ints = [_is_int(k) for k in steps]
        if all(ints):
            out: tuple[Any, ...] = tuple(int(k) for k in steps)
        elif any(ints):
            raise TypeError(
                f"{self.path}: window offsets {steps!r} mix samples and time deltas; give all "
                "in samples (ints) or all as time deltas ('-6h')"
            )
        else:
            out = tuple(as_timedelta(k, "a window offset") for k in steps)
        if len(set(out)) != len(out):
            raise ValueError(f"{self.path}: window offsets {steps!r} repeat a step")
        return replace(self, window_offsets=out)

    @property
    def timed_window(self) -> bool:
        """True for a window given in time deltas (not yet resolved to samples)."""
        w = self.window_offsets
        return w is not None and isinstance(w[0], np.timedelta64)

    def in_samples(self, step: np.timedelta64, coord: str = "time") -> ArrayGeometry:
        """This view with a time-delta window resolved to samples, the data's step between
        samples being ``step`` (``self`` when the window is in samples already, or there is
        none). ``ValueError`` naming both when a delta is not a whole multiple of ``step``."""
        if not self.timed_window:
            return self
        assert self.window_offsets is not None
        step_ns = int(np.timedelta64(step, "ns").astype(np.int64))
        out = []
        for k in self.window_offsets:
            k_ns = int(k.astype("m8[ns]").astype(np.int64))
            if step_ns <= 0 or k_ns % step_ns:
                raise ValueError(
                    f"{self.path}: window offset {k} is not a whole multiple of the data's step "
                    f"({_readable_step(step_ns)} between samples of {coord!r}): give multiples"
                )
            out.append(k_ns // step_ns)
        return replace(self, window_offsets=tuple(out))

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one batch row of this view: :attr:`inner_shape`, or on a window view
        ``(len(window_offsets), *inner_shape)``."""
        if self.window_offsets is None:
            return self.inner_shape
        return (len(self.window_offsets), *self.inner_shape)

    def parts(self) -> list[ArrayGeometry]:
        """The plain views this view is read as, one per step: ``[self]`` for a view of one
        step, else one :meth:`shift` view per window offset, in the window's order.
        ``ValueError`` for a window still in time deltas (resolve it with :meth:`in_samples`)."""
        if self.window_offsets is None:
            return [self]
        if self.timed_window:
            raise ValueError(
                f"{self.path}: window offsets {[str(k) for k in self.window_offsets]} are time "
                "deltas, resolved through the time coordinate when the pipeline is built; "
                "resolve them with in_samples(step) to read the window by hand"
            )
        return [
            replace(self, window_offsets=None, offset=self.offset + k) for k in self.window_offsets
        ]

    @property
    def base(self) -> ArrayGeometry:
        """The array this view reads: unshifted, whole (no patches, no selection) and one step
        (no window)."""
        if self.offset or self.patch or self.select or self.window_offsets is not None:
            return replace(self, offset=0, patch=None, select=None, window_offsets=None)
        return self

    @functools.cached_property
    def dims(self) -> tuple[str, ...] | None:
        """The array's dimension names: :attr:`dim_names` where given (a collection's
        ``dims=``, an NGFF plate's axes), else zarr v3 ``dimension_names`` or xarray's
        ``_ARRAY_DIMENSIONS``; ``None`` when it has none."""
        if self.dim_names is not None:
            return self.dim_names
        return _zarr_compat.metadata_dimension_names(self.metadata)

    def patches(
        self,
        extent: AxisMap[int],
        *,
        stride: int | AxisMap[int] | None = None,
        origins: str = "grid",
        per_tile: int | None = None,
        order: str = "shuffled",
        within: AxisMap[tuple[int, int]] | None = None,
    ) -> ArrayGeometry:
        """A view whose samples are windows of the field: ``extent`` maps field axes (physical
        indices, or dimension names where the array has them) to the window's size along each,
        e.g. ``g.patches({1: 256, 2: 256})`` or ``g.patches({"y": 256, "x": 256})``.

        ``origins="grid"`` (the default): windows every ``stride`` (default: the extent, so
        windows tile the field; smaller overlaps them; an int applies to every patched axis),
        plus one flush with the far edge wherever the stride does not end there.
        ``origins="random"``: new uniform origins every epoch, ``per_tile`` windows starting in
        each stored tile (default: as many as the tile holds windows side by side, at least 1).
        ``order`` (``"shuffled"`` or ``"sweep"``) is how a shuffled plan visits regions of
        tiles (:class:`Patches`). ``within`` maps patched axes to ``(lo, hi)``: every window
        lies in that range (a spatial split; the whole field by default). Composes with
        :meth:`shift`, :meth:`isel` and product sample axes (``sample_axis=()``: windows of a
        whole array); views of several arrays patched alike take the same origins, row for
        row. A batch holds ``(batch, *inner_shape)``, ``batch.patch_origins[label]`` origins.
        """
        spec = patch_spec(
            self,
            extent,
            stride=stride,
            origins=origins,
            per_tile=per_tile,
            order=order,
            within=within,
            axis_named=self._patch_axis,
            name_of=self._axis_key,
        )
        return replace(self, patch=spec)

    def _axis_key(self, axis: int) -> int | str:
        """How the user names physical axis ``axis``: its dimension name, else its index."""
        dims = self.dims
        return axis if dims is None else dims[axis]

    def _patch_axis(self, key: int | str) -> int:
        """The physical field axis ``key`` names (an index or a dimension name)."""
        return axis_of(
            self,
            key,
            allowed=self.field_axes,
            what="a patched axis",
            refused=lambda k: (
                f"{self.path}: axis {k!r} is not a field axis (the sample axis is "
                f"{self.sample_axis}; field axes {self.field_axes})"
            ),
        )

    # -- selection on field axes --------------------------------------------------------------
    def isel(self, **indexers: Any) -> ArrayGeometry:
        """A view that keeps part of the field, by dimension name and index, as xarray's
        ``isel``: ``g.isel(level=[3, 5, 9])``, ``g.isel(latitude=slice(10, 50))``,
        ``g.isel(level=7)``. A list, a slice or a boolean mask of the axis keeps the axis, an
        integer drops it (as numpy); the view's :attr:`inner_shape` is the selection's, and
        ``slice(None)`` selects nothing. Selecting a selected view selects within its
        selection. Composes with :meth:`shift` and with :meth:`patches` (on axes not patched).

        What is read (see :mod:`~insitubatch_nodes.io.selection`): along an axis cut into stored
        tiles only the tiles the selection touches; along an axis whole in a stored object the
        object is decoded once into the pool (whole) and the batch receives the selection only.
        """
        current = view_keys(self)
        kept = kept_axes(current)
        keys: list[Any] = [None] * len(kept)
        for name, key in indexers.items():
            i = self._field_dim(name)
            if i not in kept:
                raise ValueError(f"{self.path}: dimension {name!r} was dropped by an earlier isel")
            mine = current[i]
            length = self.field_shape[i] if mine is None else len(mine)  # type: ignore[arg-type]
            keys[kept.index(i)] = key = axis_key(name, key, length)  # (None: the whole axis)
            if key is not None and self.patch is not None and self.field_axes[i] in self.patch.axes:
                raise ValueError(
                    f"{self.path}: {name!r} is patched; select on other axes, or keep its "
                    f"windows in a range with patches(..., within={{{name!r}: (lo, hi)}})"
                )
        if all(k is None for k in keys):
            return self
        base = self.select if self.select is not None else Selection((None,) * len(current))
        select = base.then(Selection(tuple(keys)), self.field_shape)
        return replace(self, select=None if all(k is None for k in select.keys) else select)

    def sel(
        self, *, method: str | None = None, tolerance: Any = None, **indexers: Any
    ) -> ArrayGeometry:
        """A view that keeps part of the field by coordinate value, as xarray's ``sel``:
        ``g.sel(level=[500, 850])``, ``g.sel(latitude=slice(60, 30), longitude=slice(0, 40))``,
        ``g.sel(level=500)``. A value or each value of a list must be in the coordinate
        (``KeyError`` otherwise), or with ``method="nearest"`` the nearest one (ties to the
        larger value, within ``tolerance``: a number, for dates a time step such as ``"2h"``; a
        repeated value: every match, in a list ``ValueError``, as xarray); a slice keeps the
        values between its ends, both included, in the coordinate's order (descending latitude:
        ``slice(north, south)``; unsorted: from one end's position to the other's), every
        ``step``-th (a negative step: the ends in the other order, the values reversed). The
        coordinate (the 1-D array named like the dimension) is read once. Then as :meth:`isel`.
        """
        positions: dict[str, Any] = {}
        for name, key in indexers.items():
            i = self._field_dim(name)
            values = self._coordinate_values(name)
            if self.select is not None:
                mine = self.select.keys[i]
                if isinstance(mine, int):
                    raise ValueError(f"{self.path}: dimension {name!r} was dropped already")
                if mine is not None:
                    values = values[list(mine)]
            positions[name] = label_positions(self.path, name, values, key, method, tolerance)
        return self.isel(**positions)

    def as_static(self) -> ArrayGeometry:
        """This array as a *static* field: no sample axis, each batch carries it whole."""
        if self.offset or self.patch or self.product or self.select:  # (select after, not before)
            raise ValueError(f"{self.path}: only the array can be static: select after as_static")
        return replace(self, static=True)

    def _field_dim(self, name: str) -> int:
        """The position among the field axes of the dimension ``name``."""
        if not isinstance(name, str):
            raise TypeError(f"dimensions are named by strings, got {name!r}")
        axis = axis_of(
            self,
            name,
            allowed=self.field_axes,
            hint=points_hint(self, name),
            refused=lambda k: (
                f"{self.path}: {k!r} is the sample axis (the split chooses samples); to keep "
                f"some {k} in every sample, open it with another sample_axis and isel({k}=...)"
            ),
        )
        return self.field_axes.index(axis)

    def _coordinate_values(self, name: str) -> np.ndarray:
        if self.coordinates is None:
            raise ValueError(
                f"{self.path}: sel() needs the coordinate values of {name!r}, and this "
                "geometry has no coordinate reader: open it with open_geometries(store), or "
                "select by index with isel()"
            )
        values = np.asarray(self.coordinates(self, name))
        length = self.shape[self.field_axes[self._field_dim(name)]]
        if values.ndim != 1 or len(values) != length:
            raise ValueError(
                f"{self.path}: the coordinate {name!r} has shape {values.shape}, not ({length},)"
            )
        return values

    def with_inner(self, inner_shape: Sequence[int], dtype: Any) -> ArrayGeometry:
        """This view as a chunk transform leaves it: same path, sample axis, chunking along it
        and offset, but a sample payload of ``inner_shape`` and ``dtype`` (one tile).

        The result describes slots and batches, not stored objects: no zarr metadata, store
        keys, decoder or grid of points. Returns ``self`` when nothing changes."""
        inner = tuple(int(n) for n in inner_shape)
        dtype = np.dtype(dtype)
        if inner == self.inner_shape and dtype == self.dtype:
            return self
        if len(inner) != len(self.field_axes) or any(n <= 0 for n in inner):
            raise ValueError(
                f"{self.path}: a transformed sample must keep {len(self.field_axes)} field "
                f"axes of positive length, got inner shape {inner}"
            )
        axis = self.sample_axis if self.product is None else 0  # slots: the virtual axis
        shape = (*inner[:axis], self.n_samples, *inner[axis:])
        chunks = (*inner[:axis], self.samples_per_chunk, *inner[axis:])
        return replace(self, shape=shape, chunks=chunks, read_chunks=chunks, dtype=dtype,
                       metadata=None, dim_names=None, sample_axis=axis, product=None,
                       points=None)  # fmt: skip

    def __repr__(self) -> str:
        off = f", offset={self.offset}" if self.offset else ""
        if self.window_offsets is not None:
            off += f", window={[k if isinstance(k, int) else str(k) for k in self.window_offsets]}"
        if self.patch is not None:
            off += f", patches={dict(zip(self.patch.axes, self.patch.extent, strict=True))}"
        off += "" if self.select is None else f", inner_shape={self.inner_shape}"
        off += ", static" if self.static else ""
        off += "" if self.product is None else f", product={self.product.axes}"
        return (
            f"ArrayGeometry({self.path!r}, shape={self.shape}, chunks={self.chunks}, "
            f"dtype={self.dtype}, sample_axis={self.sample_axis}{off})"
        )


def _readable_step(ns: int) -> str:
    """A length in nanoseconds as ``"6h"``, ``"30min"``, ``"1D"`` or seconds."""
    for unit, size in (("D", 86_400 * 10**9), ("h", 3_600 * 10**9), ("min", 60 * 10**9)):
        if ns and ns % size == 0:
            return f"{ns // size}{unit}"
    return f"{ns / 1e9:g}s"


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.timedelta64)
