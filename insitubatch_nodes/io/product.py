"""Product sample axes: every combination of indices along several axes is one sample.

``open_geometries(store, sample_axis=("t", "z"))`` makes each ``(t, z)`` pair of a
``(t, c, z, y, x)`` array a sample whose payload is ``(c, y, x)`` (the remaining axes, in
their order). The geometry presents the pairs as one *virtual* sample axis, so the plan, the
pool, the gather, resume, DDP dealing and the persistent cache work on it unchanged:

* the *blocks* are the stored objects' grid over the product axes, in C order over the axes
  as given (``("t", "z")``: t-block major). Virtual chunk ``b`` is block ``b``: it holds the
  virtual samples ``[b * spc, (b + 1) * spc)`` with ``spc = ct * cz`` (the stored chunk's
  extent along each product axis, multiplied);
* within a block the valid samples come first, in C order over the product axes: a block
  holding ``vt`` of its ``ct`` t steps and ``vz`` of its ``cz`` z planes (an edge block) has
  the valid samples ``b * spc + jt * vz + jz`` for ``jt < vt``, ``jz < vz``; the rest of the
  block is *padding* — no sample, never an anchor (as a collection member's tail);
* decoding a stored object writes its ``(vt, …, vz, …)`` data into those rows with one
  permuting copy (:meth:`ProductGrid.slot_view`).

:meth:`ProductGrid.coords` turns virtual sample indices (``batch.sample_indices[label]``)
back into the array's indices along the product axes — a ``(B, k)`` array of e.g. ``(t, z)``
rows. Shifts and windows along a product axis are refused: an offset has no single meaning on
the virtual axis. Patches (:meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.patches`) and
selections (``isel``/``sel``) cut the field as on any view.

The *empty* product, ``sample_axis=()``, has no axes: one block (every stored object of the
array) holding one sample, the whole array. Patched, its windows are the samples — a spectral
cube ``(freq, dec, ra)`` cut into sky patches, or into sub-cubes — and the plan shuffles,
deals and resumes them as any patched plan's (regions of stored tiles of that one block).

On a collection (``Collection.from_groups(..., sample_axis=("t", "z"))``, ``open_plate``) one
grid serves every member: ``ProductGrid(..., members=n)`` lays member after member, virtual
chunk ``c`` being block ``c % n_blocks`` of member ``c // n_blocks``, and the member map keys
each block below its member's path
(:meth:`~insitubatch_nodes.io.members.MemberMap.store_key`). The empty product on a collection
(``Collection.from_arrays(..., sample_axis=())``) is one block per member: a survey's
pointings, each one sample whose windows, patched, are the samples.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from insitubatch_nodes.io.axes import axis_of

__all__ = [
    "ProductGrid",
    "first_axis",
    "product_axes",
    "product_view",
    "same_grids",
    "sample_coords",
]


class ProductGrid:
    """The product of the physical axes ``axes`` (in the order given) of an array of shape
    ``shape`` stored in objects of shape ``chunks``, as one virtual sample axis. No axes
    (``()``): the whole array is one sample, in one block.

    ``members`` > 1: the product grids of that many arrays of the same shape along the product
    axes (a collection's members, :mod:`~insitubatch_nodes.io.collection`), laid end to end:
    virtual chunk ``c`` is block ``c % n_blocks`` of member ``c // n_blocks``, and every
    per-chunk array (:attr:`block_coords`, :attr:`valid`, :attr:`counts`) repeats per member;
    :meth:`coords` gives indices within the member.

    Immutable; compares and hashes by :attr:`fingerprint`.
    """

    def __init__(
        self,
        axes: Sequence[int],
        shape: Sequence[int],
        chunks: Sequence[int],
        members: int = 1,
    ) -> None:
        self.axes = tuple(int(a) for a in axes)
        if len(self.axes) == 1 or len(set(self.axes)) != len(self.axes):
            raise ValueError(f"a product takes no axes, or two or more distinct ones: {self.axes}")
        if members < 1:
            raise ValueError(f"a product grid needs at least one member, got {members}")
        self.members = int(members)
        #: the array's length and stored-object extent along each product axis, in product order
        self.lengths = tuple(int(shape[a]) for a in self.axes)
        self.extents = tuple(int(chunks[a]) for a in self.axes)
        #: stored objects along each product axis (of one member)
        self.grid = tuple(math.ceil(n / c) for n, c in zip(self.lengths, self.extents, strict=True))
        self.samples_per_chunk = math.prod(self.extents)
        #: blocks of one member; virtual chunks of all members
        self.n_blocks = math.prod(self.grid)
        self.n_chunks = self.n_blocks * self.members
        self.n_samples = self.n_chunks * self.samples_per_chunk
        # valid steps of each block along each product axis: (n_chunks, k)
        blocks = (
            np.stack(np.unravel_index(np.arange(self.n_blocks), self.grid), axis=1)
            if self.axes
            else np.zeros((1, 0), dtype=np.int64)  # no axes: one block, the whole array
        )
        ext = np.asarray(self.extents, dtype=np.int64)
        self.block_coords = np.tile(blocks.astype(np.int64), (self.members, 1))
        self.valid = np.minimum(ext, np.asarray(self.lengths) - self.block_coords * ext)
        #: valid samples of each block (the rest of its ``samples_per_chunk`` is padding)
        self.counts = np.prod(self.valid, axis=1).astype(np.int64)
        for arr in (self.block_coords, self.valid, self.counts):
            arr.setflags(write=False)

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex digits of the axes, lengths and extents (and the member count, if > 1)."""
        body = f"product|{self.axes}|{self.lengths}|{self.extents}"
        body += f"|members:{self.members}" if self.members > 1 else ""
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProductGrid) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        more = f", members={self.members}" if self.members > 1 else ""
        return (
            f"ProductGrid(axes={self.axes}, lengths={self.lengths}, extents={self.extents}{more})"
        )

    # -- blocks ----------------------------------------------------------------------------
    def block_of(self, chunk: int) -> tuple[int, ...]:
        """The stored-object coordinates along the product axes of virtual chunk ``chunk``."""
        return tuple(int(c) for c in self.block_coords[chunk])

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """The valid virtual samples ``[start, stop)`` of virtual chunk ``chunk``."""
        start = chunk * self.samples_per_chunk
        return start, start + int(self.counts[chunk])

    def sample_bounds(self, chunks: np.ndarray, samples_per_chunk: int) -> tuple[np.ndarray, ...]:
        """``(lo, hi)``: the valid virtual samples ``[lo, hi)`` of each of ``chunks`` (on this
        grid's ``samples_per_chunk``, which an anchor grid must share)."""
        if samples_per_chunk != self.samples_per_chunk:
            raise ValueError(
                f"an anchor grid of {samples_per_chunk} samples a chunk does not follow the "
                f"product grid's {self.samples_per_chunk}"
            )
        chunks = np.asarray(chunks, dtype=np.int64)
        lo = chunks * self.samples_per_chunk
        return lo, lo + self.counts[chunks]

    def chunk_coords(self, chunk: int, tile: Sequence[int], ndim: int) -> tuple[int, ...]:
        """Physical chunk-grid coordinates of stored object ``(chunk, tile)`` of an array of
        ``ndim`` axes (``tile`` over its field axes, in order)."""
        where = dict(zip(self.axes, self.block_of(chunk), strict=True))
        rest = iter(tile)
        return tuple(where[a] if a in where else next(rest) for a in range(ndim))

    # -- samples ---------------------------------------------------------------------------
    def coords(self, samples: np.ndarray | Sequence[int]) -> np.ndarray:
        """The array's indices along the product axes (in product order) of each virtual
        sample: ``(len(samples), k)`` ``int64``. Raises ``ValueError`` for padding."""
        s = np.asarray(samples, dtype=np.int64).reshape(-1)
        spc = self.samples_per_chunk
        if len(s) and (s.min() < 0 or s.max() >= self.n_samples):
            raise ValueError(f"virtual samples must be in [0, {self.n_samples})")
        chunk, within = np.divmod(s, spc)
        if np.any(within >= self.counts[chunk]):
            bad = int(s[np.argmax(within >= self.counts[chunk])])
            raise ValueError(f"virtual sample {bad} is padding of an edge block, not a sample")
        valid = self.valid[chunk]  # (n, k)
        out = np.empty((len(s), len(self.axes)), dtype=np.int64)
        rest = within
        for i in range(len(self.axes) - 1, -1, -1):  # C order over the valid steps
            rest, out[:, i] = np.divmod(rest, valid[:, i])
        return out + self.block_coords[chunk] * np.asarray(self.extents, dtype=np.int64)

    def samples(self, coords: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
        """The virtual sample of each row of indices along the product axes (inverse of
        :meth:`coords`; within a member: member 0's)."""
        c = np.asarray(coords, dtype=np.int64)
        if not self.axes:  # the empty product: every row is its one sample
            return np.zeros(len(c) if c.ndim else 1, dtype=np.int64)
        c = c.reshape(-1, len(self.axes))
        ext = np.asarray(self.extents, dtype=np.int64)
        block, step = np.divmod(c, ext)
        chunk = np.ravel_multi_index(tuple(block.T), self.grid)
        valid = self.valid[chunk]
        within = np.zeros(len(c), dtype=np.int64)
        for i in range(len(self.axes)):
            within = within * valid[:, i] + step[:, i]
        return chunk * self.samples_per_chunk + within

    # -- decoding ----------------------------------------------------------------------------
    def slot_view(
        self, out: np.ndarray, chunk: int, field_axes: Sequence[int], ndim: int
    ) -> np.ndarray:
        """``out`` (a block's valid rows, ``(count, *field extent)``, sample first) as a view in
        the array's physical axis order: ``(…, vt, …, vz, …)``, what the decoder writes the
        stored object's data into (one permuting copy)."""
        valid = [int(v) for v in self.valid[chunk]]
        step = out.strides[0]
        strides = [step * math.prod(valid[i + 1 :]) for i in range(len(valid))]
        view = np.lib.stride_tricks.as_strided(  # splits the sample axis: always a view
            out, shape=(*valid, *out.shape[1:]), strides=(*strides, *out.strides[1:])
        )
        order = (*self.axes, *field_axes)  # dims of `view`, as physical axes
        assert len(order) == ndim
        return view.transpose(np.argsort(order))


def product_of(views: Sequence[Any], given: ProductGrid | None = None) -> ProductGrid | None:
    """The product grid a plan over ``views`` (geometries with samples) follows: theirs, or
    ``given`` (a manifest's); ``None`` when no view has product sample axes. Views on product
    axes share one grid (the same axes, lengths and extents along them), and a pipeline does
    not mix them with views of one sample axis (``ValueError``, naming both)."""
    grids = [v.product for v in views]
    first = given if given is not None else next((g for g in grids if g is not None), None)
    if first is None:
        return None
    for view, grid in zip(views, grids, strict=True):
        if grid != first:
            what = "one sample axis" if grid is None else f"product axes {grid!r}"
            raise ValueError(
                f"{view.path!r} has {what}, but the pipeline's samples follow {first!r}: every "
                "view of a pipeline on product sample axes takes the same product (the same "
                "axes, lengths and stored extents along them)"
            )
    return first


def refuse_product_options(
    views: Sequence[Any],
    stride: Any,
    missing: Any,
    missing_objects: str,
    coords: Sequence[str] | None,
) -> None:
    """Refuse, naming it, what a pipeline over views on product sample axes does not support:
    anything that reads the time coordinate or steps along one sample axis."""
    product = next((v.product for v in views if v.product is not None), None)
    if product is None:
        return
    where = f"views on product sample axes {product.axes}"
    if not (isinstance(stride, int) and stride == 1):
        raise ValueError(
            f"stride {stride} steps along one sample axis, and {where} have none: give "
            "stride=1 and subsample in a batch transform (geom.sample_coords gives each row's "
            "indices)"
        )
    if missing is not None:
        raise ValueError(f"missing= is not supported on {where} (missing_objects='drop' is)")
    if coords:
        raise ValueError(
            f"{where} carry no coordinates: pass coords=() (or None); each row's indices along "
            "the product axes are geom.sample_coords(batch.sample_indices[label])"
        )


def product_view(geom: Any, axes: Sequence[int | str]) -> Any:
    """``geom`` with every combination of indices along ``axes`` (physical indices or
    dimension names, two or more, in the order given) as one sample, and the remaining axes
    as the field: ``product_view(g, ("t", "z"))`` of a ``(t, c, z, y, x)`` array has samples
    of shape ``(c, y, x)``, one per ``(t, z)`` pair (``open_geometries(store,
    sample_axis=("t", "z"))`` makes these). ``axes=()``: the whole array is one sample, every
    axis a field axis (to patch: its windows are then the samples). Checked here, once."""
    if geom.static or geom.offset or geom.window_offsets is not None:
        raise ValueError(f"{geom.path}: take product axes of the array itself")
    if geom.patch is not None or geom.select is not None or geom.members is not None:
        raise ValueError(
            f"{geom.path}: product sample axes apply to a whole array of one store (not a "
            "patched, selected or collection view)"
        )
    if isinstance(axes, str | bytes) or not isinstance(axes, Sequence):
        raise TypeError(f"product axes are a sequence, e.g. ('t', 'z'), got {axes!r}")
    phys = _checked(geom.path, [_physical_axis(geom, a) for a in axes], geom.ndim, axes)
    grid = ProductGrid(phys, geom.shape, geom.chunks)
    return replace(geom, sample_axis=first_axis(phys), product=grid)


def first_axis(axes: Sequence[int]) -> int:
    """The sample axis a view on product axes ``axes`` names: the first, or 0 for the empty
    product (whose one sample is the whole array)."""
    return int(axes[0]) if axes else 0


def product_axes(array: Any, axes: Sequence[int]) -> tuple[int, ...]:
    """Physical axes ``axes`` of ``array`` (a collection's first member) checked as product
    sample axes: none (each member's whole array one sample, to patch), or two or more,
    distinct, leaving a field axis (``ValueError`` otherwise)."""
    return _checked(str(getattr(array, "path", "")), axes, array.ndim, axes)


def _checked(where: str, phys: Sequence[int], ndim: int, given: Any) -> tuple[int, ...]:
    out = tuple(int(a) for a in phys)
    if len(out) == 1 or len(set(out)) != len(out):
        raise ValueError(
            f"{where}: product sample axes must be two or more distinct axes (or none: the "
            f"whole array one sample), got {tuple(given)!r}"
        )
    if len(out) == ndim:
        raise ValueError(f"{where}: product axes {tuple(given)!r} leave no field axis")
    return out


def same_grids(where: str, grids: Mapping[str, ProductGrid | None]) -> ProductGrid:
    """The one product grid the variables of collection ``where`` share (the same axes,
    lengths and stored extents along them): they are read as labels of one plan."""
    (first, grid), *rest = grids.items()
    assert grid is not None
    for name, other in rest:
        if other != grid:
            raise ValueError(
                f"{where}: variable {name!r} is on {other!r}, {first!r} on {grid!r}: on product "
                "sample axes every variable of a collection needs the same lengths and stored "
                "extents along them (rechunk, or open the variables as collections of their own)"
            )
    return grid


def _physical_axis(geom: Any, key: int | str) -> int:
    return axis_of(geom, key, what="a product axis", hint="name the product axes by index instead")


def refuse_on_product(geom: Any, what: str) -> None:
    """Refuse view ``what`` (``"shift()"``, ``"window()"``: a move along the sample axis) on
    product sample axes, naming why."""
    product = geom.product
    if product is None:
        return
    if not product.axes:
        raise ValueError(
            f"{geom.path}: {what} moves along the sample axis, and this view has none (its "
            "one sample is the whole array, sample_axis=()): open the array with a sample axis"
        )
    raise ValueError(
        f"{geom.path}: {what} moves along the sample axis, and this view's samples are "
        f"the product of axes {product.axes}: an offset has no single meaning there. Open "
        "the array with one sample axis to shift or window it"
    )


def sample_coords(geom: Any, samples: Any) -> np.ndarray:
    """``geom.sample_coords(samples)``: ``(len(samples), k)`` indices along the sample axes
    of an :class:`~insitubatch_nodes.io.geometry.ArrayGeometry` (one column on a plain one)."""
    if geom.product is not None:
        return geom.product.coords(samples)
    return np.asarray(samples, dtype=np.int64).reshape(-1, 1)
