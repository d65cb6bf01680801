"""Checks of collections: what making one refuses of a member's array (absent, a group, of
another zarr format than the first member's), what a pipeline over a collection refuses (views
of two collections, or of another collection than the one it reads; options that need times
the members do not share), a subset of one timeline that breaks it, and that the store it
reads holds a view's members. Kept apart from :mod:`~insitubatch_nodes.io.collection`, which
makes collections."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
import zarr

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.arrays import array_cf
from insitubatch_nodes.io.geometry import ArrayGeometry, in_native_byte_order
from insitubatch_nodes.io.stores import describe_store

__all__ = [
    "check_collection_in_store",
    "refuse_broken_timeline",
    "refuse_collection_options",
    "refuse_member_array",
]


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
    concatenation or a join) ``missing=`` takes dates only: a sample index there would count
    along the virtual axis, not within a member."""
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
    if missing is not None and any(
        isinstance(x, int | np.integer) and not isinstance(x, bool) for x in missing
    ):
        raise ValueError(
            "missing= on a collection of independent members takes dates (each member's "
            "times), not sample indices: an index would count along the collection's virtual "
            "axis, not within a member"
        )
    del timed, coords, missing_objects  # (supported: times read per member, MemberMap.joined)


#: the parts of a decoding rule (``CFValues.fingerprint``), by the attribute that sets them
_RULE = {
    "dtype": "decoded dtype",
    "fills": "_FillValue / missing_value",
    "scale": "scale_factor",
    "offset": "add_offset",
    "unsigned": "_Unsigned",
}


def check_collection_in_store(store: Any, geom: ArrayGeometry) -> None:
    """Check that ``store`` is the one collection view ``geom`` reads its members from (its
    first member is there: ``FileNotFoundError`` otherwise), and that the first member's
    values still decode as the view decodes them (its CF attributes, read by the view's own
    options: decoded, in its ``cf_dtype``, or raw): ``ValueError`` naming the attribute that
    changed since the collection was made otherwise. Members after the first are not read."""
    members, base = geom.members, geom.base
    assert members is not None
    zstore = _zarr_compat.opened(store)
    found = _zarr_compat.node_kind(zstore, members.paths[0])
    where = f"{geom.path!r}: its first member {members.names[0]!r} ({members.paths[0]!r})"
    if found is None or found[0] != "array":
        raise FileNotFoundError(
            f"{where} is not in store {describe_store(store)}: pass the collection itself (or "
            "its .store) as the pipeline's store"
        )
    if base.cf is None:  # delivered as stored (raw, or nothing to decode): no rule to compare
        return
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
