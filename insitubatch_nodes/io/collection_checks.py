"""Checks of collections: what making one refuses of a member's array (absent, a group, of
another zarr format than the first member's), what a pipeline over a collection refuses (views
of two collections, or of another collection than the one it reads; options that need times
the members do not share), a subset of one timeline that breaks it, stores or members whose
field coordinates differ (:class:`MemberCoordinates`), and that the store it reads holds a
view's members. Kept apart from :mod:`~insitubatch_nodes.io.collection`, which
makes collections."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NoReturn

import numpy as np
import zarr

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.arrays import array_cf, open_geometries
from insitubatch_nodes.io.coords import FieldCoordinates
from insitubatch_nodes.io.geometry import ArrayGeometry, in_native_byte_order
from insitubatch_nodes.io.members import MEMBER_READERS, SCHEMA_FIELDS, member_schema
from insitubatch_nodes.io.stores import describe_store

__all__ = [
    "MemberCoordinates",
    "check_collection_in_store",
    "coords_option",
    "member_lengths",
    "member_missing",
    "refuse_broken_timeline",
    "refuse_collection_options",
    "refuse_member_array",
    "refuse_other_grids",
    "sample_axis_hint",
]


def sample_axis_hint(variable: str, dims: Sequence[str] | None, asked: Sequence[Any]) -> str:
    """What a collection's ``variable`` lacking the sample axis ``asked`` names (its dimension
    names ``dims``, or ``None``) should do: name its axes, or name its own sample dimension, or
    — a static field (a land-sea mask beside yearly stores' data) — leave it out: a
    collection's variables are all sampled."""
    missing = [a for a in asked if isinstance(a, str) and dims is not None and a not in dims]
    if not missing:
        return "name it by index, or give the axes' names: dims="
    return (
        f"where one of its dimensions is the sample dimension, name that one; {variable!r} "
        "may be a static field (a land-sea mask), which is not a variable of a collection, "
        f"every one of which is sampled along {missing[0]!r}: "
        "static fields of a collection are not supported; leave it out of the variables and "
        "put it into the batches with a batch transform (read once from one store with zarr "
        "or xarray)"
    )


def refuse_member_array(
    collection: str, store: Any, members: Sequence[str], paths: Sequence[str], variable: str, m: int
) -> NoReturn:
    """Refuse member ``m``'s array of ``variable`` (``paths``: each member's, in ``store``) in
    collection ``collection``: ``FileNotFoundError`` where it is absent, ``ValueError`` where it
    is a group (naming arrays inside it) or a zarr array of another format than member 0's."""
    zstore = _zarr_compat.opened(store)
    got, first = _zarr_compat.node_kinds(zstore, [paths[m], paths[0]])
    if m and got is not None and got[0] == "array" and first is not None:
        raise ValueError(
            f"{collection}: member {members[m]!r}'s {variable!r} is a zarr v{got[1]} array and "
            f"member {members[0]!r}'s v{first[1]}: the members of a variable need one zarr "
            "format (rewrite one, or read them in separate pipelines)"
        )
    if got is not None and got[0] == "group":
        group = zarr.open_group(zstore, path=paths[m], mode="r")
        inside = [f"{paths[m]}/{p}" for p, _ in _zarr_compat.walk_arrays(group)][:3]
        raise ValueError(
            f"{collection}: member {members[m]!r}'s {variable!r} at {paths[m]!r} of "
            f"{describe_store(store)} is a group, not an array: name an array inside it "
            f"(such as {inside}), or give from_groups the group and the variables' paths"
        )
    raise FileNotFoundError(
        f"{collection}: member {members[m]!r} has no array for variable {variable!r} at "
        f"{paths[m]!r} of {describe_store(store)}"
    )


def member_lengths(
    collection: Any, variable: str, docs: Sequence[bytes | None], axis: int
) -> np.ndarray:
    """Each member's length along ``axis`` of ``variable`` of ``collection`` (a
    :class:`~insitubatch_nodes.io.collection.Collection` being made), from its array metadata
    document ``docs[m]``; an absent array, or one whose schema differs from the first
    member's, raises naming both."""
    want, paths, members = None, collection._paths[variable], collection.members
    lengths = np.empty(len(docs), dtype=np.int64)
    for m, raw in enumerate(docs):
        doc = None if raw is None else json.loads(raw)
        if not isinstance(doc, dict) or doc.get("node_type", "array") != "array":
            refuse_member_array(collection.name, collection.store, members, paths, variable, m)
        got = member_schema(doc, axis)
        if want is None:
            want = got
        elif got != want:
            what = next(k for k in SCHEMA_FIELDS if got.get(k) != want.get(k))
            todo = (
                "members of another size (a slide, a scene, a cube) are a collection of their "
                "own: open each size's members as one, build a pipeline of each, and mix them "
                "with torchdata.nodes.MultiNodeWeightedSampler"
                if what == "field shape"
                else "rewrite that member like the first (its chunks, dtype, codecs), or read "
                "it apart"
            )
            raise ValueError(
                f"{collection.name}: member {members[m]!r}, variable {variable!r}: its "
                f"{what} {got.get(what)!r} differs from member {members[0]!r}'s "
                f"{want.get(what)!r}; the members of a variable need the same dtype, field "
                f"shape, chunks and codecs (only the sample-axis length may differ): {todo}"
            )
        shape = doc.get("shape") or ()
        lengths[m] = int(shape[axis]) if len(shape) > axis else -1
    return lengths


def refuse_broken_timeline(collection: str, members: Sequence[str], rows: Sequence[int]) -> None:
    """Refuse a subset ``rows`` (member indices) of the one timeline ``collection`` (stores
    concatenated or joined by time, ``members``) that is not consecutive members in order: its
    windows and strides would run across a gap, or back in time (``ValueError``)."""
    if len(rows) and list(rows) != list(range(rows[0], rows[0] + len(rows))):
        raise ValueError(
            f"{collection} is one timeline (stores concatenated or joined by time): a subset "
            f"of it must be consecutive members in order, e.g. {list(members[1:])}, not "
            f"{[members[r] for r in rows][:5]}; concat the stores you want in time order, or "
            "split its time axis (split_by_chunk)"
        )


class MemberCoordinates:
    """The field coordinates (``level``, ``lat``) of a collection variable, what ``sel`` on a
    collection view looks values up in (and a stack's channel names):
    ``reader(geom, dim)`` is the first member's coordinate named like ``dim``, where every
    member that has one holds the same values in the same order. A member whose coordinate
    differs (a scene at another place) has other points at the same index, so a selection by
    value has no one answer: ``ValueError`` naming the member, both coordinates, and to select
    by index with ``isel``. ``KeyError`` where the first member has none. Each member's
    coordinate is read once (one read per member the first time a dimension is asked for;
    ``reader``, a :class:`FieldCoordinates` of ``store``, shares what it read already).
    :meth:`each` gives every member's own, differing or not (a forcing's grid per member).
    Picklable when the store is."""

    def __init__(
        self,
        store: Any,
        paths: Sequence[str],
        names: Sequence[str],
        reader: FieldCoordinates | None = None,
        given: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.paths = tuple(paths)
        self.names = tuple(names)
        self.reader = FieldCoordinates(store) if reader is None else reader
        #: coordinates given for every member (a collection's ``coords=``): read from no store
        self.given = dict(given or {})

    def differing(self, geom: ArrayGeometry, dim: str) -> tuple[str, np.ndarray, np.ndarray]:
        """``(member, its coordinate, the first member's)`` of the first member whose
        coordinate ``dim`` differs from the first member's, or ``("", first, first)``."""
        if dim in self.given:  # one coordinate for every member
            return "", self.given[dim], self.given[dim]
        first = self.reader(replace(geom, path=self.paths[0], members=None), dim)
        for name, path in zip(self.names[1:], self.paths[1:], strict=True):
            try:
                own = self.reader(replace(geom, path=path, members=None), dim)
            except KeyError:  # no coordinate: nothing says where its points are
                continue
            kind = own.dtype.kind == first.dtype.kind == "f"
            if own.shape != first.shape or not np.array_equal(own, first, equal_nan=kind):
                return name, own, first
        return "", first, first

    def each(self, geom: ArrayGeometry, dim: str) -> list[np.ndarray]:
        """Every member's own coordinate ``dim``, in member order, whether they differ or not
        (what forcings compute each member's rows on): the first member's read first, the
        others 16 at a time. ``KeyError`` naming the first member without one."""

        if dim in self.given:
            return [self.given[dim]] * len(self.paths)

        def one(path: str) -> np.ndarray | KeyError:
            try:
                return self.reader(replace(geom, path=path, members=None), dim)
            except KeyError as exc:
                return exc

        found = [one(self.paths[0])]
        if len(self.paths) > 1 and not isinstance(found[0], KeyError):  # (none: said at once)
            readers = min(MEMBER_READERS, len(self.paths) - 1)
            with ThreadPoolExecutor(readers, thread_name_prefix="insitu-coords") as pool:
                found += pool.map(one, self.paths[1:])
        for name, got in zip(self.names, found, strict=False):
            if isinstance(got, KeyError):
                raise KeyError(
                    f"{geom.path}: member {name!r} has no {dim!r} coordinate beside its array, "
                    "so nothing says where its points are"
                )
        return found  # type: ignore[return-value]

    def __call__(self, geom: ArrayGeometry, dim: str) -> np.ndarray:
        name, own, first = self.differing(geom, dim)
        if name:
            raise ValueError(
                f"{geom.path}: the {dim!r} coordinate of member {name!r} is {_listed(own)}, "
                f"and of member {self.names[0]!r} {_listed(first)}: the members hold other "
                f"points at the same index along {dim!r}, so a value of it selects no one "
                f"index; select by index with isel({dim}=...)"
            )
        return first


def coords_option(
    coords: Mapping[str, Mapping[str, Any]] | None, variables: Sequence[str]
) -> dict[str, dict[str, np.ndarray]]:
    """A collection's ``coords=`` checked: ``{variable: {dimension: values}}``, each a
    variable of the collection and each ``values`` 1-D, without a value twice (``sel`` by a
    value must find one index); read-only copies. ``ValueError`` saying what to give."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for variable, given in (coords or {}).items():
        if variable not in variables or not isinstance(given, Mapping):
            raise ValueError(
                f"coords={{{variable!r}: ...}}: give {{variable: {{dimension: values}}}} for "
                f"variables of the collection, {list(variables)}"
            )
        for dim, values in given.items():
            arr = np.array(list(values))
            if arr.ndim != 1 or len(np.unique(arr)) != len(arr):
                raise ValueError(
                    f"coords[{variable!r}][{dim!r}] = {list(values)!r}: give one value per "
                    "index of the axis, none twice"
                )
            arr.setflags(write=False)
            out.setdefault(str(variable), {})[str(dim)] = arr
    return out


def refuse_other_grids(
    store: Any,
    names: Sequence[str],
    paths: Mapping[str, Sequence[str]],
    dim: str,
    dims: Mapping[str, Sequence[str]],
    reader: Any = None,
) -> None:
    """Refuse stores joined along ``dim`` (``concat``) whose field coordinates differ: for each
    variable (``paths``: each store's array, in ``store``) and each of its other dimensions,
    the coordinate named like it (``lat``, ``level``), where the first store and another both
    have one, must hold the same values, in the same order (:class:`MemberCoordinates`).
    Otherwise rows of the two stores at one field index are at other points (a latitude
    stored north to south in one store, south to north in the next), and a selection by
    value, made on the first store's coordinates, would pick other points in the other:
    ``ValueError`` naming the stores, the dimension and both coordinates. ``dims`` names the
    axes of arrays that name none. Each store's coordinate arrays are read once, whatever
    the number of variables that share them; through ``reader`` (a
    :func:`~insitubatch_nodes.io.coords.coordinate_reader` of ``store``) where one is given,
    which keeps them, and takes the arrays it read already."""
    fields = FieldCoordinates(store, reader)
    for variable, located in paths.items():
        geom = open_geometries(store, [located[0]], coords_reader=reader)[located[0]]
        given = dims.get(variable)
        geom = geom if given is None else replace(geom, dim_names=tuple(given))
        coordinates = MemberCoordinates(store, located, names, fields)
        for field_dim in geom.dims or ():
            if field_dim == dim:
                continue
            try:
                name, own, first = coordinates.differing(geom, field_dim)
            except KeyError:  # the first store has none: nothing to compare with
                continue
            if name:
                raise ValueError(
                    f"concat: the {field_dim!r} coordinate of {variable!r} is {_listed(own)} in "
                    f"store {name!r} and {_listed(first)} in store {names[0]!r}: their rows "
                    f"would hold other points at the same index along {field_dim!r}. Write "
                    f"the stores on one grid (with xarray: ds.sortby({field_dim!r}), or "
                    f"ds.reindex({field_dim}=...)), or read them in separate pipelines"
                )


def _listed(values: np.ndarray) -> str:
    shown = values[:8].tolist()
    return f"{shown}{' ...' if len(values) > 8 else ''}"


def refuse_collection_options(
    views: Sequence[ArrayGeometry],
    *,
    timed: bool,
    missing: Any,
    missing_objects: str,
    coords: Sequence[str] | None,
    plain_views: int,
    of: str | None = None,
) -> None:
    """Refuse, naming it, what a pipeline over collection ``views`` does not support: views of
    two collections, or of another collection than ``of`` (the name of the collection the
    pipeline reads, when it is given one). Time
    strides, timed windows, ``missing=`` dates and ``coords=`` read each member's own time
    coordinate (:meth:`~insitubatch_nodes.io.members.MemberMap.joined`),
    ``missing_objects="drop"`` lists each member's folder; on independent members (not a
    concatenation or a join) ``missing=`` takes dates, or member names mapped to indices
    within each member (:func:`member_missing`), not indices along the virtual axis."""
    if not any(v.members is not None for v in views):
        return
    # a view reads its collection's member paths from whatever store the pipeline reads:
    # another collection laid out alike would be read in its place
    names = sorted({v.members.collection.partition(":")[0] for v in views if v.members})
    if len(names) > 1:
        raise ValueError(
            f"the views of a pipeline read one collection, not views of {names[0]} and "
            f"{names[1]}: make their arrays one collection (Collection.from_groups with several "
            "variables, or Collection.join), or read each in its own pipeline"
        )
    if of is not None and names[0] != of:
        path = next(v.path for v in views if v.members is not None)
        raise ValueError(
            f"the views ({path!r}) are of {names[0]}, but the pipeline reads {of}: pass the "
            "collection the views come from as the pipeline's store"
        )
    if plain_views:
        raise ValueError(
            "a pipeline reads either collection views or plain arrays: its labels share one "
            "sample axis; read a plain array of the same store in another pipeline"
        )
    if all(v.members.continuous for v in views if v.members is not None):
        return
    if (
        missing is not None
        and not isinstance(missing, Mapping)
        and any(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in missing)
    ):
        raise ValueError(
            "missing= on a collection of independent members takes dates (each member's "
            "times), or member names mapped to sample indices within each member "
            "(missing={'cube_lo': [17]}), not sample indices: an index would count along the "
            "collection's virtual axis, not within a member"
        )
    del timed, coords, missing_objects  # (supported: times read per member, MemberMap.joined)


def member_missing(missing: Any, views: Sequence[ArrayGeometry]) -> Sequence[Any] | None:
    """``missing`` as :func:`~insitubatch_nodes.pipeline.insitu_pipeline` takes it: a mapping
    of a collection's member names (or positions, ints) to sample indices *within that member*
    (a flagged channel of one cube of a frequency collection: ``{"cube_lo": [17]}``; a negative
    index counts from the member's end) becomes the indices of those samples on the
    collection's virtual axis; any other value is returned as it is. ``KeyError`` for a name
    that is no member, ``ValueError`` for an index outside its member and for a mapping beside
    plain arrays; ``TypeError`` for what is not an index."""
    if not isinstance(missing, Mapping):
        return missing
    members = next((v.members for v in views if v.members is not None), None)
    if members is None:
        raise ValueError(
            "missing= maps member names to sample indices on a collection only; for one array "
            "give a list of sample indices or times"
        )
    where = {name: m for m, name in enumerate(members.names)}
    out: list[int] = []
    for name, listed in missing.items():
        if isinstance(name, int | np.integer) and not isinstance(name, bool):
            name = members.names[int(name)] if 0 <= int(name) < len(members) else name
        if name not in where:
            raise KeyError(
                f"missing= names {name!r}, which is no member of {members.collection} (its "
                f"members: {_listed(np.asarray(members.names))})"
            )
        m = where[name]
        n, base = int(members.lengths[m]), int(members.sample_base[m])
        if isinstance(listed, str | bytes) or not isinstance(listed, Sequence | np.ndarray):
            listed = [listed]
        for i in listed:
            if not isinstance(i, int | np.integer) or isinstance(i, bool):
                raise TypeError(
                    f"missing={{{name!r}: ...}} takes sample indices within that member, got "
                    f"{i!r}; list dates in missing= as a list (each member's own times)"
                )
            if not -n <= int(i) < n:
                raise ValueError(
                    f"missing={{{name!r}: [{int(i)}]}}: member {name!r} holds {n} samples "
                    f"(indices -{n} .. {n - 1})"
                )
            out.append(base + int(i) % n)
    return sorted(set(out))


#: the parts of a decoding rule (``CFValues.fingerprint``), by the attribute that sets them
_RULE = {
    "dtype": "decoded dtype",
    "fills": "_FillValue / missing_value",
    "scale": "scale_factor",
    "offset": "add_offset",
    "unsigned": "_Unsigned",
}


def check_collection_in_store(store: Any, geom: ArrayGeometry, reader: Any = None) -> None:
    """Check that ``store`` is the one collection view ``geom`` reads its members from (its
    first member is there: ``FileNotFoundError`` otherwise), and that the first member's
    values still decode as the view decodes them (its CF attributes, read by the view's own
    options: decoded, in its ``cf_dtype``, or raw): ``ValueError`` naming the attribute that
    changed since the collection was made otherwise. Members after the first are not read;
    the first is read through ``reader`` (a
    :func:`~insitubatch_nodes.io.coords.coordinate_reader` of ``store``) where one is given:
    not again where it read it already."""
    members, base = geom.members, geom.base
    assert members is not None
    zstore = _zarr_compat.opened(store)
    where = f"{geom.path!r}: its first member {members.names[0]!r} ({members.paths[0]!r})"
    if reader is not None:
        array = reader.array(members.paths[0])
        found = None if array is None else ("array", array.metadata.zarr_format)
    else:
        found = _zarr_compat.node_kind(zstore, members.paths[0])
    if found is None or found[0] != "array":
        raise FileNotFoundError(
            f"{where} is not in store {describe_store(store)}: pass the collection itself (or "
            "its .store) as the pipeline's store"
        )
    if base.cf is None:  # delivered as stored (raw, or nothing to decode): no rule to compare
        return
    if reader is None:
        array = _zarr_compat.open_array_readonly(zstore, members.paths[0], found[1])
    cf = array_cf(array, base.cf.dtype)
    now = {"dtype": str(in_native_byte_order(array.dtype))} if cf is None else cf.fingerprint
    then = base.cf.fingerprint
    changed = [k for k in _RULE if now.get(k) != then.get(k)]
    if changed:
        what = _RULE[changed[0]]
        raise ValueError(
            f"{where} in store {describe_store(store)} decodes by another rule than when the "
            f"collection was made: its {what} is {now.get(changed[0])} there, "
            f"{then.get(changed[0])} in the view. The store was rewritten since: make the "
            "collection again (it reads the members' CF attributes once, when it is made)"
        )
