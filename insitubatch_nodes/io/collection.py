"""Collections: many arrays of one schema read as one stream of samples.

A :class:`Collection` holds *members* (the fields of an HCS plate, slides, scenes), each with
the same *variables* (``"image"``, ``"labels/nuclei"``): member ``i``'s variable ``v`` is one
zarr array. Every member of a variable has the same dtype, field shape, chunking and codecs;
only the sample-axis length may differ, but all variables of one member have the same length.
A sample is a pair (member, index along the member's sample axis).

``collection["image"]`` is a *virtual array*: an
:class:`~insitubatch_nodes.io.geometry.ArrayGeometry` whose sample axis lays the members end to
end, each starting on a chunk boundary (:mod:`~insitubatch_nodes.io.members`), so it is used
wherever a geometry is — labels of :func:`~insitubatch_nodes.insitu_pipeline`, ``shift``,
``window`` (in samples), ``patches``, ``isel``, :func:`~insitubatch_nodes.split_by_chunk` — and
the plan, the pool, the persistent cache, dealing between ranks and resume work on it as on
one array. The plan never lets a sample or a window step fall into another member or into a
member's padding (:func:`~insitubatch_nodes.plan.epoch.chunk_counts`); each batch says which
member each row came from (``batch.members[label]``) and its index within that member
(``batch.sample_indices[label]``).

Building a collection reads the metadata of every member array once, concurrently (one
``asyncio.gather`` on zarr's IO loop), and keeps a few numpy arrays per variable, never a
Python object per member on the per-batch path. Members in several stores are read through a
:class:`~insitubatch_nodes.io.routing.RoutingStore`; a collection of one store reads that store
directly (a local folder keeps the decode threads' direct reads).

:meth:`Collection.concat` joins stores that continue one another along time into one
*continuous* axis instead: there windows run across the stores' edges and the index is the
joined axis's; where stores overlap, ``overlap=`` names the store that wins (whole chunks
skipped). :meth:`Collection.join` aligns arrays of several stores by their times instead (one
member; each variable an array of its own store, offset by whole chunks to the shared times).

A concatenation is one timeline (its views' time coordinate is the stores' times joined), so
a time stride, time-delta windows, ``missing=`` dates and carried coordinates work on it as on
one array; independent members keep their own times (``MemberMap.joined``: one step and one
calendar in all), so the same options work within each member.

``sample_axis=("t", "z")`` gives every member product sample axes
(:mod:`~insitubatch_nodes.io.product`): each member lays out the same grid of stored blocks,
member after member. ``missing_objects="drop"`` lists each member's folder. ``sample_axis=()``:
each member's whole array is one sample (one block); patched, its windows are the samples.

A join may take a concatenation as one of its stores (an archive's back-extension and main
store, joined with a forcing store): its axis is cut where the concatenated stores meet.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import Store

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.arrays import array_cf
from insitubatch_nodes.io.axes import axis_of, dims_option, named_axes
from insitubatch_nodes.io.cf import CFValues, decoded_dtype_option, decoding_text
from insitubatch_nodes.io.collection_checks import (
    MemberCoordinates,
    coords_option,
    member_lengths,
    refuse_broken_timeline,
    refuse_member_array,
    refuse_other_grids,
    sample_axis_hint,
)
from insitubatch_nodes.io.coords import coordinate_reader, same_store_reader
from insitubatch_nodes.io.geometry import ArrayGeometry, in_native_byte_order
from insitubatch_nodes.io.join_reads import located_pieces
from insitubatch_nodes.io.member_docs import first_member, member_documents
from insitubatch_nodes.io.members import MemberMap, check_cf_encoding, collection_of
from insitubatch_nodes.io.points import points_of
from insitubatch_nodes.io.product import ProductGrid, first_axis, product_axes, same_grids
from insitubatch_nodes.io.routing import RoutingStore, locate
from insitubatch_nodes.io.stores import StoreLike, describe_store
from insitubatch_nodes.io.timeline import alignment, continuation, pieces_of_join

__all__ = [
    "Collection",
    "collection_of",
    "concat",
    "join",
]


#: a sample axis (an index or a dimension name), or product sample axes (a tuple of them)
SampleAxis = int | str | tuple[int | str, ...]


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


class Collection:
    """Members of one schema as one stream (see the module docstring). Build one with
    :meth:`from_groups` (members are groups of one store: an HCS plate's fields) or
    :meth:`from_arrays` (any arrays, in any stores).

    ``members`` are the member names in order (member ``i``), ``variables`` the variable
    names, ``keys`` per-member group keys (``{"well": array of "A/1", ...}``: one value per
    member, for :func:`~insitubatch_nodes.split_by_member`'s ``by=``), ``store`` the store
    every member is read from (a :class:`~insitubatch_nodes.io.routing.RoutingStore` when they
    live in several), ``lengths`` each member's sample count (on product axes: its pairs).

    ``mask_and_scale`` and ``cf_dtype`` (every constructor takes them, checked once here) say
    how every view of the collection decodes its stored values, as
    :func:`~insitubatch_nodes.open_geometries` takes them: CF-decoded by default, in xarray's
    dtype or in the float dtype ``cf_dtype``; ``mask_and_scale=False`` delivers the stored
    values. Decoded, every member follows the first member's rule, so members whose CF
    attributes differ are refused (:func:`~insitubatch_nodes.io.members.check_cf_encoding`);
    raw, their attributes are not read: each row holds its member's own stored values (as
    ``xr.open_mfdataset(..., mask_and_scale=False)`` concatenates them, even where members are
    packed otherwise: ``batch.members`` names each row's member).

    ``dims`` (``{variable: names}``, one unique name per axis; :meth:`from_groups` takes it)
    names the dimensions of variables whose arrays name none (zarr v2 without
    ``_ARRAY_DIMENSIONS``, an NGFF 0.4 plate's), so that ``sample_axis``, ``isel``, ``sel`` and
    ``patches`` take names; the names given win over the arrays' own (``coll.dims``).
    ``coords`` (``{variable: {dimension: values}}``, one value per index of that axis, the same
    for every member) gives ``sel`` the coordinate of a dimension, before any coordinate array
    beside the members (``open_plate`` gives an image's ``omero`` channel names this way)."""

    def __init__(
        self,
        store: Store,
        members: Sequence[str],
        paths: Mapping[str, Sequence[str]],
        *,
        keys: Mapping[str, Sequence[Any]] | None = None,
        sample_axis: SampleAxis = 0,
        continuous: bool = False,
        spans: Sequence[tuple[int, int]] | Mapping[str, Sequence[tuple[int, int]]] | None = None,
        mask_and_scale: bool = True,
        cf_dtype: Any = None,
        dims: Mapping[str, Sequence[str]] | None = None,
        coords: Mapping[str, Mapping[str, Any]] | None = None,
        reader: Any = None,
    ) -> None:
        #: the coordinate reader of ``store`` the members were read through (``concat`` and
        #: ``join``'s; else one made here): the pipelines built on the collection share it
        self.reader = same_store_reader(reader, store) if reader else coordinate_reader(store)
        #: how the views decode stored values (CF mask and scale; the decoded float dtype)
        self.cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
        self.mask_and_scale = mask_and_scale
        self.store = store
        #: the members are consecutive pieces of one sample axis (:meth:`concat`)
        self.continuous = bool(continuous)
        self.members: tuple[str, ...] = tuple(str(m) for m in members)
        if len(set(self.members)) != len(self.members):
            twice = sorted(m for m, k in Counter(self.members).items() if k > 1)
            raise ValueError(
                f"member names must be unique; {twice[:5]} appear more than once (members of "
                "several stores at the same path: give names=)"
            )
        if not self.members:
            raise ValueError("a collection needs at least one member")
        if not paths:
            raise ValueError("a collection needs at least one variable")
        self.variables: tuple[str, ...] = tuple(paths)
        #: dimension names given per variable (``dims=``): its views' ``dims``
        self.dims = dims_option(dims, self.variables)
        #: field coordinates given per variable (``coords=``): what ``sel`` looks values up in
        self.coords = coords_option(coords, self.variables)
        self._paths = {v: tuple(p) for v, p in paths.items()}
        for v, p in self._paths.items():
            if len(p) != len(self.members):
                raise ValueError(
                    f"variable {v!r} has {len(p)} member paths for {len(self.members)} members"
                )
        self.keys: dict[str, np.ndarray] = {}
        for name, values in (keys or {}).items():
            arr = np.asarray(list(values))
            if arr.shape != (len(self.members),):
                raise ValueError(
                    f"keys[{name!r}] has {arr.shape[0] if arr.ndim else 0} values for "
                    f"{len(self.members)} members: give one per member"
                )
            arr.setflags(write=False)
            self.keys[str(name)] = arr
        # every store by name (a routing store's repr leaves out all but six: two collections
        # of seven stores, other in the fourth, took one name, so statistics fitted on one
        # were loaded for the other without a word)
        named = store.identity if isinstance(store, RoutingStore) else describe_store(store)
        digest = hashlib.sha256(named.encode())
        for v in self.variables:
            digest.update(("\x01" + v + "\x00" + "\x00".join(self._paths[v])).encode())
        #: each member's stored samples ``[start, stop)`` it contributes (``None``: all): a
        #: concatenation whose stores overlap keeps one store's steps (``concat(overlap=)``)
        #: (a mapping: per variable, for stores joined by time, :meth:`join`)
        self.spans: dict[str, tuple[tuple[int, int], ...]] | None = None
        if spans is not None:
            given = spans if isinstance(spans, Mapping) else dict.fromkeys(paths, spans)
            self.spans = {str(v): tuple((int(a), int(b)) for a, b in given[v]) for v in self._paths}
            if any(len(x) != len(self.members) for x in self.spans.values()):
                raise ValueError(f"spans {self.spans} need one span per member")
            digest.update(("\x02" + repr(sorted(self.spans.items()))).encode())
        #: the prefix of the virtual arrays' paths (``"<name>:<variable>"``): stable for the
        #: same members in the same store, never a key of any store
        self.name = f"collection-{digest.hexdigest()[:8]}"
        self._sample_axis = sample_axis
        self._geoms, self.lengths = self._read(sample_axis)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "reader": None}  # (what it read stays with this process)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, reader=coordinate_reader(state["store"]))

    # -- the face ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, variable: str) -> ArrayGeometry:
        """Variable ``variable``'s virtual array, usable as a pipeline label (a view)."""
        if variable not in self._geoms:
            raise KeyError(
                f"{self.name}: no variable {variable!r}; the variables are {list(self.variables)}"
            )
        return self._geoms[variable]

    def paths(self, variable: str) -> tuple[str, ...]:
        """Each member's array path of ``variable`` in :attr:`store`."""
        self[variable]
        return self._paths[variable]

    def subset(self, names: Sequence[str]) -> Collection:
        """The collection of members ``names`` (in that order), with their keys: e.g. one
        collection per split for ``InSituDataModule``. An unknown name raises ``KeyError``.
        Of one timeline (:meth:`concat`, :meth:`join`), ``names`` must be consecutive members
        in their order, which continue one another (``ValueError`` otherwise)."""
        index = {m: i for i, m in enumerate(self.members)}
        missing = [n for n in names if n not in index]
        if missing:
            raise KeyError(f"{self.name}: no members {missing[:5]}")
        rows = [index[n] for n in names]
        if self.continuous:
            refuse_broken_timeline(self.name, self.members, rows)
        return Collection(
            self.store,
            [self.members[i] for i in rows],
            {v: [self._paths[v][i] for i in rows] for v in self.variables},
            keys={k: list(v[rows]) for k, v in self.keys.items()},
            sample_axis=self._sample_axis,
            continuous=self.continuous,
            spans=None
            if self.spans is None
            else {v: [x[i] for i in rows] for v, x in self.spans.items()},
            mask_and_scale=self.mask_and_scale,
            cf_dtype=self.cf_dtype,
            dims=self.dims,
            coords=self.coords,
        )

    def sources(self) -> list[str]:
        """Each member, as ``"<its store>::<its first variable's path there>"``: what
        identifies a member across collections (checks that splits share no member)."""
        out = []
        for path in self._paths[self.variables[0]]:
            store: Any = self.store
            if isinstance(store, RoutingStore):
                head, _, path = path.partition("/")
                store = store.stores[int(head[1:])]
            out.append(f"{describe_store(store)}::{path}")
        return out

    def __repr__(self) -> str:
        return (
            f"Collection({self.name!r}, {len(self)} members, variables={list(self.variables)}, "
            f"store={describe_store(self.store)})"
        )

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def from_groups(
        cls,
        store: StoreLike | None,
        groups: Sequence[str | tuple[StoreLike, str]],
        variables: Mapping[str, str],
        *,
        names: Sequence[str] | None = None,
        keys: Mapping[str, Sequence[Any]] | None = None,
        sample_axis: SampleAxis = 0,
        mask_and_scale: bool = True,
        cf_dtype: Any = None,
        dims: Mapping[str, Sequence[str]] | None = None,
        coords: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Collection:
        """Members that are groups: member ``i``'s variable ``v`` is the array at
        ``f"{groups[i]}/{variables[v]}"`` of ``store`` (a ``Store``, path or URL). A group may
        also be a ``(store, path)`` pair, for members in several stores (``store`` is then
        ``None`` or the default for plain paths). ``names`` (default: the group paths) names the
        members; ``keys`` gives per-member group keys; ``sample_axis`` is an index or a
        dimension name, the same for every array (two or more: product sample axes; ``()``:
        each member's whole array one sample, to patch). Every array's metadata is read once,
        concurrently; an absent array raises ``FileNotFoundError`` and arrays that do not share
        the schema ``ValueError``, both naming the member and the variable. ``mask_and_scale``
        and ``cf_dtype``: how the views decode; ``dims``: the dimension names of variables
        whose arrays name none; ``coords``: coordinates ``sel`` takes (all: the class
        docstring)."""
        if isinstance(groups, str) or not isinstance(variables, Mapping) or not variables:
            raise TypeError(
                "from_groups(store, groups, variables) takes a list of group paths and a "
                "non-empty {variable: path below each group} mapping, e.g. {'image': '0'}"
            )
        pairs = [g if isinstance(g, tuple) else (store, g) for g in groups]
        zstore, located = locate([(s, str(g).strip("/")) for s, g in pairs])
        member_names = [g for _, g in pairs] if names is None else names
        paths = {str(v): [_join(g, str(p)) for g in located] for v, p in variables.items()}
        return cls(zstore, member_names, paths, keys=keys, sample_axis=sample_axis,
                   mask_and_scale=mask_and_scale, cf_dtype=cf_dtype, dims=dims,
                   coords=coords)  # fmt: skip

    @classmethod
    def from_arrays(
        cls,
        arrays: Sequence[Any],
        *,
        names: Sequence[str] | None = None,
        variable: str = "data",
        sample_axis: SampleAxis = 0,
        mask_and_scale: bool = True,
        cf_dtype: Any = None,
        dims: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    ) -> Collection:
        """Members that are arrays anywhere: each item a ``zarr.Array``, a ``(store, path)``
        pair, or a URL or path (the array at that store's root). Members may live in different
        stores (read through a :class:`~insitubatch_nodes.io.routing.RoutingStore`); each is one
        member with one variable, ``variable``. ``sample_axis`` as :meth:`from_groups` takes
        it (``()``: each whole array one sample, to patch). ``names`` defaults to ``"0"``, ...;
        ``mask_and_scale`` and ``cf_dtype``: how the views decode; ``dims``: the dimension
        names of arrays that name none, one per axis (``["time", "y", "x"]``, or
        ``{variable: names}``; the class docstring)."""
        if isinstance(arrays, str) or not len(arrays):
            raise TypeError("from_arrays takes a non-empty list of arrays")
        given: list[tuple[Any, str]] = []
        for item in arrays:
            if isinstance(item, zarr.Array):
                given.append((item.store_path.store, item.path))
            elif isinstance(item, tuple) and len(item) == 2:
                given.append((item[0], str(item[1]).strip("/")))
            else:
                given.append((item, ""))
        zstore, paths = locate(given)
        member_names = [str(i) for i in range(len(arrays))] if names is None else names
        if dims is not None and not isinstance(dims, Mapping):  # the names of its one variable
            dims = {variable: dims}
        return cls(zstore, member_names, {variable: paths}, sample_axis=sample_axis,
                   mask_and_scale=mask_and_scale, cf_dtype=cf_dtype, dims=dims)  # fmt: skip

    @classmethod
    def concat(
        cls,
        stores: Sequence[Any],
        variables: Sequence[str],
        *,
        dim: str = "time",
        names: Sequence[str] | None = None,
        overlap: str = "error",
        mask_and_scale: bool = True,
        cf_dtype: Any = None,
        dims: Mapping[str, Sequence[str]] | None = None,
    ) -> Collection:
        """Stores that continue one another along ``dim`` (an archive and its extension, one
        store per period) as one sample axis: member ``i`` is store ``i``, with the arrays
        ``variables`` (array paths, the same in every store), sampled along the dimension
        ``dim``. Unlike other collections the index is continuous: windows, shifts and strides
        run across the stores' edges (``batch.members`` still names each row's store), and the
        views have a time coordinate, the stores' times joined: a time stride, window offsets
        in time deltas, dates in ``missing=`` and carried coordinates (``coords=``) work on them
        as on one array.

        ``overlap`` says which store wins where two consecutive stores hold the same times:
        ``"error"`` (the default) refuses an overlap; ``"first"`` keeps the earlier store's
        steps and skips the later store's overlapping ones at its start; ``"last"`` keeps the
        later store's and drops the earlier store's overlapping tail. Only whole chunks (of
        every variable) can be skipped: an overlap that is not is refused, naming the times.

        Checked here: every store but the last holds whole chunks (of every variable) of what it
        contributes, and the times of ``dim``'s coordinate continue from store to store at one
        step, without a gap (nor an overlap, unless ``overlap`` says who wins); otherwise
        ``ValueError`` naming the stores and the times. Stores all written newest first are
        listed newest first and continue back in time (stores in two directions are refused).
        The stores are on one grid: each other dimension's coordinate (``lat``, ``level``),
        where two stores have one, holds the same values in the same order (``ValueError``
        naming the dimension and the stores). ``mask_and_scale`` and ``cf_dtype``: how the views
        decode (the class docstring), checked before any store is read; so is ``dims``
        (``{variable: names}``, a variable being an array path of ``variables``): the dimension
        names of arrays that name none, by which ``dim`` and its time coordinate are found
        (where an array names none and ``dims`` does not name it, ``ValueError`` says so)."""
        cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
        if overlap not in ("error", "first", "last"):
            raise ValueError(f"overlap must be 'error', 'first' or 'last', got {overlap!r}")
        if isinstance(stores, str) or not len(stores):
            raise TypeError("concat takes a non-empty list of stores (Store, path or URL)")
        if isinstance(variables, str) or not len(variables):
            raise TypeError("concat takes a list of array names, e.g. ['t2m', 'z']")
        dims = dims_option(dims, [str(v) for v in variables])
        zstore, roots = locate([(s, "") for s in stores])
        if names is None:
            names = [os.fspath(s) if isinstance(s, str | os.PathLike) else repr(s) for s in stores]
        paths = {str(v): [_join(r, str(v)) for r in roots] for v in variables}
        names = [str(n) for n in names]
        reader = coordinate_reader(zstore)  # (each store's documents read once, by all checks)
        spans = continuation(zstore, names, paths, dim, overlap, dims, reader)
        refuse_other_grids(zstore, names, paths, dim, dims, reader)
        return cls(zstore, names, paths, sample_axis=dim, continuous=True, spans=spans,
                   mask_and_scale=mask_and_scale, cf_dtype=cf_dtype, dims=dims,
                   reader=reader)  # fmt: skip

    @classmethod
    def join(
        cls,
        stores: Mapping[str, tuple[Any, Sequence[str]]],
        *,
        dim: str = "time",
        mask_and_scale: bool = True,
        cf_dtype: Any = None,
        dims: Mapping[str, Sequence[str]] | None = None,
    ) -> Collection:
        """Arrays of several stores aligned by their times, as the variables of one collection:
        ``stores`` maps a name to ``(store, [array paths])`` (a ``Store``, path or URL), and
        variable ``"<name>/<path>"`` is that array, e.g. ``join({"atmos": (a, ["t2m"]),
        "forcing": (b, ["sst"])})["forcing/sst"]``. Every view of it reads the same times at
        the same index, so they are the labels of one pipeline (with the collection as its
        store); its one member is named ``"joined"``, and it is one timeline, as a
        :meth:`concat` is (time strides, windows in time deltas, ``missing=``, ``coords=``).

        The joined axis is the stores' shared times: each store's times of ``dim`` (the
        coordinate beside its first array) are at one step, the same in every store, on one grid
        (a whole number of steps apart); each store's index is its own, offset. Each array is
        read by whole chunks of its own chunking (stores may be chunked differently), so the
        axis starts at the first shared time where every array is at a chunk boundary: up to a
        few chunks' steps after the latest start; it ends at the earliest end (stores all newest
        first: from the latest shared time back; two directions refused). Otherwise
        ``ValueError`` names the stores and their times. A store may be a concatenation
        (:meth:`concat`, with array paths of its variables): the joined axis is then cut where
        its stores meet, one member per piece, and each cut must fall on a chunk boundary of
        every array. ``mask_and_scale`` and ``cf_dtype``: how the views decode (the class
        docstring), checked before any store is read; a concatenation given as a store must have
        been made with the same (``ValueError`` otherwise: the join decodes every array by its
        own). ``dims`` (``{"<name>/<path>": names}``, keyed by the join's variables, checked
        before any store is read) names the dimensions of arrays that name none, as
        :meth:`concat` takes them; a concatenation's own ``dims`` are kept."""
        cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
        decode = {"mask_and_scale": mask_and_scale, "cf_dtype": cf_dtype}
        if not isinstance(stores, Mapping) or not stores:
            raise TypeError(
                "join takes {name: (store, [array paths])}, e.g. {'atmos': (a, ['t2m']), "
                "'forcing': (b, ['sst'])}"
            )
        names = [str(k) for k in stores]
        given, var_names, inherited = [], [], {}
        for k, item in stores.items():
            if not (isinstance(item, tuple) and len(item) == 2) or isinstance(item[1], str):
                raise TypeError(f"join: stores[{k!r}] must be (store, [array paths])")
            given.append(item)
            made, ours = item[0], decoding_text(**decode)
            for v in item[1]:
                var_names.append(f"{k}/{str(v).strip('/')}")
                if isinstance(made, Collection) and str(v) in made.dims:  # its views' names
                    inherited[var_names[-1]] = made.dims[str(v)]
            if isinstance(made, Collection):
                theirs = decoding_text(made.mask_and_scale, made.cf_dtype)
                if theirs != ours:
                    raise ValueError(
                        f"join: {k!r} is a concatenation made with {theirs}, but the join with "
                        f"{ours}: a join decodes every array by its own options; give concat "
                        "and join the same ones"
                    )
        dims = inherited | dims_option(dims, var_names)  # the names given win
        if any(isinstance(s, Collection) for s, _ in given):  # a concatenation: in pieces
            entries = [
                (n, s, [str(v) for v in vs]) for n, (s, vs) in zip(names, given, strict=True)
            ]
            pieces, rows, readers = pieces_of_join(entries, dim, dims)
            zstore, paths, spans, reader = located_pieces(rows, readers)
            return cls(zstore, pieces, paths, sample_axis=dim, continuous=True, spans=spans,
                       dims=dims, reader=reader, **decode)  # fmt: skip
        zstore, roots = locate([(s, "") for s, _ in given])
        paths = {
            f"{name}/{str(v).strip('/')}": [_join(root, str(v))]
            for name, root, (_, variables) in zip(names, roots, given, strict=True)
            for v in variables
        }
        if len(paths) != sum(len(v) for _, v in given):
            raise ValueError(f"join: an array is named twice in {names}")
        reader = coordinate_reader(zstore)
        spans = alignment(zstore, names, roots, [list(v) for _, v in given], dim, dims, reader)
        return cls(zstore, ["joined"], paths, sample_axis=dim, continuous=True, spans=spans,
                   dims=dims, reader=reader, **decode)  # fmt: skip

    def _read(self, sample_axis: SampleAxis) -> tuple[dict[str, ArrayGeometry], np.ndarray]:
        """Every member array's metadata document (one concurrent read), checked against the
        first member's; the virtual array of each variable, and each member's sample count.
        Only the first member of each variable is opened as a zarr array."""
        store = _zarr_compat.opened(self.store)
        n = len(self.members)
        refs: dict[str, tuple[Any, int]] = {}
        products: dict[str, tuple[int, ...]] = {}  # product sample axes, per variable
        formats: dict[str, int] = {}
        for v in self.variables:
            found = first_member(store, self._paths[v][0], self.reader)
            if found is None:
                refuse_member_array(self.name, self.store, self.members, self._paths[v], v, 0)
            ref, formats[v] = found
            where = f"member {self.members[0]!r}, variable {v!r}"
            own = _zarr_compat.array_dimension_names(ref)
            named = named_axes(where, self.dims.get(v), own, ref.ndim)
            asked = sample_axis if isinstance(sample_axis, tuple | list) else (sample_axis,)
            hint = sample_axis_hint(v, named.dims, asked)
            axes = [axis_of(named, a, what="sample_axis", hint=hint) for a in asked]
            if isinstance(sample_axis, tuple | list):  # product sample axes
                products[v] = product_axes(ref, axes)
            refs[v] = (ref, first_axis(products[v]) if v in products else axes[0])
        docs, attrs = member_documents(store, self._paths, formats, self.mask_and_scale,
                                       self.reader)  # fmt: skip
        lengths = {v: member_lengths(self, v, docs[v], refs[v][1]) for v in self.variables}
        # raw values are each member's own: no rule to agree on (the class docstring)
        for v in self.variables if self.mask_and_scale else ():
            check_cf_encoding(self.name, v, self.members, attrs[v])
        starts: dict[str, np.ndarray | None] = dict.fromkeys(self.variables)
        for v, kept in (self.spans or {}).items():  # each member's kept samples
            span = np.array(kept, dtype=np.int64).reshape(-1, 2)
            if (
                np.any(span[:, 0] < 0)
                or np.any(span[:, 1] > lengths[v])
                or np.any(span[:, 1] <= span[:, 0])
            ):
                raise ValueError(f"{self.name}: spans {list(kept)} of {v!r} outside its members")
            starts[v], lengths[v] = span[:, 0], span[:, 1] - span[:, 0]
        ref_len = lengths[self.variables[0]]
        if products:  # every member on one product grid, members laid end to end
            if self.continuous:
                raise ValueError(f"{self.name}: product sample axes take independent members")
            geoms = {  # (each variable's own lengths: same_grids compares the variables)
                v: self._virtual_product(v, refs[v][0], products[v], lengths[v])
                for v in self.variables
            }
            grid = same_grids(self.name, {v: g.product for v, g in geoms.items()})
            pairs = np.full(n, math.prod(grid.lengths), dtype=np.int64)  # samples: (t, z) pairs
            pairs.setflags(write=False)
            return geoms, pairs
        for v in self.variables[1:]:
            bad = np.flatnonzero(lengths[v] != ref_len)
            if len(bad):
                m = int(bad[0])
                raise ValueError(
                    f"{self.name}: member {self.members[m]!r} has {int(ref_len[m])} samples in "
                    f"variable {self.variables[0]!r} but {int(lengths[v][m])} in {v!r}: every "
                    "variable of a member needs the same sample-axis length"
                )
        spcs = [_zarr_compat.stored_chunk_shape(a)[axis] for a, axis in refs.values()]
        align = math.lcm(*spcs)
        geoms = {v: self._virtual(v, *refs[v], ref_len, align, starts[v]) for v in self.variables}
        ref_len.setflags(write=False)
        return geoms, ref_len

    def _points(self, variable: str, ref: Any) -> tuple[str, str] | None:
        """The first member's latitude and longitude along a grid of points (``io.points``)."""
        return points_of(_zarr_compat.opened(self.store), self._paths[variable][0], ref, None)

    def _coordinates(self, variable: str) -> MemberCoordinates:
        """What ``sel`` on ``variable``'s views looks values up in: the ``coords=`` given,
        else the members' coordinate arrays."""
        given = self.coords.get(variable)
        return MemberCoordinates(self.store, self._paths[variable], self.members, given=given)

    def _cf(self, ref: Any) -> CFValues | None:
        """How the stored values of ``ref`` (a variable's first member) decode, by the
        collection's options."""
        return array_cf(ref, self.cf_dtype) if self.mask_and_scale else None

    def _virtual_product(
        self, variable: str, ref: Any, axes: tuple[int, ...], lengths: np.ndarray
    ) -> ArrayGeometry:
        """Variable ``variable``'s virtual array on product sample axes ``axes``: every member's
        blocks of one :class:`~insitubatch_nodes.io.product.ProductGrid`, member after member
        (the members' lengths along the axes must be the same)."""
        differs = np.flatnonzero(lengths != lengths[0])
        if len(differs):
            m = int(differs[0])
            rule = (
                "on product sample axes every member needs the same lengths along them"
                if axes
                else "with sample_axis=() (each member one sample) every member needs one shape"
            )
            raise ValueError(
                f"{self.name}: member {self.members[m]!r} has {int(lengths[m])} steps along "
                f"axis {first_axis(axes)} of {variable!r}, member {self.members[0]!r} "
                f"{int(lengths[0])}: "
                f"{rule} (open the members of each length as a collection of their own)"
            )
        chunks, cf = _zarr_compat.stored_chunk_shape(ref), self._cf(ref)
        grid = ProductGrid(axes, ref.shape, chunks, members=len(self.members))
        spc = grid.samples_per_chunk
        members = MemberMap(
            f"{self.name}:{variable}",
            self.members,
            self._paths[variable],
            np.full(len(self.members), grid.n_blocks * spc, dtype=np.int64),
            spc,
            spc,
            product=True,
        )
        return ArrayGeometry(
            path=f"{self.name}:{variable}",
            shape=tuple(int(s) for s in ref.shape),  # one member's (the grid spans them all)
            chunks=chunks,
            dtype=in_native_byte_order(ref.dtype) if cf is None else cf.dtype,
            fill_value=ref.fill_value,
            sample_axis=first_axis(axes),
            read_chunks=_zarr_compat.read_chunk_shape(ref),
            zarr_format=int(ref.metadata.zarr_format),
            metadata=ref.metadata,
            members=members,
            product=grid,
            cf=cf,
            coordinates=self._coordinates(variable),
            dim_names=self.dims.get(variable),
            points=self._points(variable, ref),
        )

    def _virtual(
        self,
        variable: str,
        ref: Any,
        axis: int,
        lengths: np.ndarray,
        align: int,
        starts: np.ndarray | None = None,
    ) -> ArrayGeometry:
        chunks, cf = _zarr_compat.stored_chunk_shape(ref), self._cf(ref)
        members = MemberMap(
            f"{self.name}:{variable}",
            self.members,
            self._paths[variable],
            lengths,
            chunks[axis],
            align,
            continuous=self.continuous,
            starts=starts,
        )
        shape = list(int(s) for s in ref.shape)
        shape[axis] = members.n_samples
        return ArrayGeometry(
            path=f"{self.name}:{variable}",
            shape=tuple(shape),
            chunks=chunks,
            dtype=in_native_byte_order(ref.dtype) if cf is None else cf.dtype,
            fill_value=ref.fill_value,
            sample_axis=axis,
            read_chunks=_zarr_compat.read_chunk_shape(ref),
            zarr_format=int(ref.metadata.zarr_format),
            metadata=ref.metadata,
            members=members,
            coordinates=self._coordinates(variable),
            cf=cf,
            dim_names=self.dims.get(variable),
            points=self._points(variable, ref),
        )


def concat(
    stores: Sequence[Any],
    variables: Sequence[str],
    *,
    dim: str = "time",
    names: Sequence[str] | None = None,
    overlap: str = "error",
    mask_and_scale: bool = True,
    cf_dtype: Any = None,
    dims: Mapping[str, Sequence[str]] | None = None,
) -> Collection:
    """Stores that continue one another along ``dim`` as one sample axis:
    :meth:`Collection.concat` (its contract and checks)."""
    return Collection.concat(stores, variables, dim=dim, names=names, overlap=overlap,
                             mask_and_scale=mask_and_scale, cf_dtype=cf_dtype,
                             dims=dims)  # fmt: skip


def join(
    stores: Mapping[str, tuple[Any, Sequence[str]]],
    *,
    dim: str = "time",
    mask_and_scale: bool = True,
    cf_dtype: Any = None,
    dims: Mapping[str, Sequence[str]] | None = None,
) -> Collection:
    """Arrays of several stores aligned by their times as one collection:
    :meth:`Collection.join` (its contract and checks)."""
    return Collection.join(stores, dim=dim, mask_and_scale=mask_and_scale, cf_dtype=cf_dtype,
                           dims=dims)  # fmt: skip
