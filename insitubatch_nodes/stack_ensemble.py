"""The ensemble axis of a channel stack: ``stack(views, ensemble="member")``.

Every sampled member keeps the ensemble dimension (named by ``ensemble``) with the same
selection: the same members (coordinate values, or indices where the view reads no
coordinate), in the same order; the dimension is the first of its axes after the sample axis
(``(member, level, lat, lon)``), or the second, after its channel axis (anemoi-datasets'
``data (time, variable, ensemble, cell)``: :func:`ensemble_position`). The stack's rows are
then ``([T,] E, C, *field)`` (channels last: ``([T,] E, *field, C)``): each member's data is
copied from the pool straight into its ``(E, c0:c1)`` slice (a member whose channels come
first, into that slice with its axes swapped: ``(c0:c1, E)``). Static members and forcings,
which have no ensemble dimension, are the same for every member (broadcast along ``E``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import kept_axes, view_keys

__all__ = ["ensemble_members", "ensemble_position", "member_shape"]


def _members_of(name: str, view: ArrayGeometry, dim: str) -> list[Any]:
    """The ensemble members ``view`` (stack member ``name``) selects along ``dim``, in order:
    the coordinate's values where it reads them, else the indices. ``ValueError`` when it
    lacks ``dim``, selects one member (an int: the axis is dropped) or ``dim`` is neither its
    first nor its second axis after the sample axis (:func:`ensemble_position`)."""
    dims = view.dims or ()
    if dim not in dims or dims.index(dim) not in view.field_axes:
        raise ValueError(
            f"stack member {name!r} has no {dim!r} dimension besides its sample axis (its "
            f"dimensions: {list(dims) or 'unnamed'}): with ensemble={dim!r} every sampled "
            "member keeps the ensemble dimension; give the others as static members, "
            "forcings or labels of their own"
        )
    if view.patch is not None and dims.index(dim) in view.patch.axes:
        raise ValueError(
            f"stack member {name!r} is patched along {dim!r}: with ensemble={dim!r} every "
            f"row keeps all the members it selects; patch the grid's axes only, and select "
            f"members with sel({dim}=[...])"
        )
    axis = view.field_axes.index(dims.index(dim))
    keys = view_keys(view)
    kept = kept_axes(keys)
    if axis not in kept:
        raise ValueError(
            f"stack member {name!r} selects one {dim!r} (an int drops the axis): with "
            f"ensemble={dim!r} select a list, sel({dim}=[...])"
        )
    if axis not in kept[:2]:
        raise ValueError(
            f"stack member {name!r} has {dim!r} after {dims[view.field_axes[kept[1]]]!r}: "
            f"with ensemble={dim!r} the ensemble dimension must be the first after the "
            "sample axis, or the second after a channel axis (as stored); give it as a label "
            "of its own"
        )
    key = keys[axis]
    n = view.shape[view.field_axes[axis]]
    index = list(range(n)) if key is None else [int(i) for i in key]  # type: ignore[union-attr]
    values: np.ndarray | None = None
    if view.coordinates is not None:
        try:
            values = np.asarray(view.coordinates(view.base, dim))
        except (KeyError, ValueError):  # no such coordinate: the indices name the members
            values = None
    if values is None or values.ndim != 1 or len(values) != n:
        return index
    return [v.item() if isinstance(v, np.generic) else v for v in values[index]]


def ensemble_position(view: ArrayGeometry, dim: str) -> int:
    """Where sampled member ``view`` (checked by :func:`ensemble_members`) keeps the ensemble
    dimension ``dim`` among its kept axes after the sample axis: 0 (``(E, [C,] *field)``) or
    1, after its channel axis (``(C, E, *field)``, as anemoi-datasets stores it; ``stack``
    refuses it where the member has no channel axis, ``dim`` then among the field's axes)."""
    dims = view.dims or ()
    return kept_axes(view_keys(view)).index(view.field_axes.index(dims.index(dim)))


def member_shape(
    name: str, view: ArrayGeometry, dim: str | None, field_ndim: int
) -> tuple[int, tuple[int, ...]]:
    """``(position, shape)`` of stack member ``name`` in a stack with ``ensemble=dim`` (or
    none) whose field has ``field_ndim`` axes: where it keeps the ensemble axis
    (:func:`ensemble_position`; 0 for a static member or without ``dim``), and its shape
    after the sample axis without that axis. ``ValueError`` when it keeps it second with no
    channel axis before it (among the field's axes: ``(lat, member, lon)``)."""
    if view.static or dim is None:
        return 0, view.inner_shape
    at = ensemble_position(view, dim)
    inner = view.inner_shape
    inner = (inner[0], *inner[2:]) if at else inner[1:]
    if at and len(inner) != field_ndim + 1:
        raise ValueError(
            f"stack member {name!r} has {dim!r} among its field's axes (its shape after the "
            f"sample axis: {view.inner_shape}): with ensemble={dim!r} the ensemble dimension "
            "is the first after the sample axis, or the second after a channel axis; give it "
            "as a label of its own"
        )
    return at, inner


def ensemble_members(named: Mapping[str, ArrayGeometry], dim: str) -> tuple[Any, ...]:
    """The ensemble members (``dim``'s values, in order) every sampled view of ``named`` (a
    stack's members by name) selects. ``ValueError`` naming the member when one selects
    others (values or order) than the first sampled member, lacks ``dim`` (or drops it, or
    has it after another field axis), when a static member has ``dim`` (it would be one
    channel per ensemble member, not the same field for every member), or when a member is
    patched along ``dim``. Patched members (patched alike along the grid: ``stack`` checks
    it) are windows of every ensemble member at one origin, rows ``([T,] E, C, *window)``."""
    if not isinstance(dim, str) or not dim:
        raise ValueError(f"ensemble must be a dimension name (str), got {dim!r}")
    first: tuple[str, list[Any]] | None = None
    for name, view in named.items():
        if view.static:
            if dim in (view.dims or ()):
                raise ValueError(
                    f"stack member {name!r} is static with a {dim!r} dimension: with "
                    f"ensemble={dim!r} a static member is the same field for every member; "
                    f"select one with isel({dim}=...), or give it as a label of its own"
                )
            continue
        mine = _members_of(name, view, dim)
        if first is None:
            first = (name, mine)
        elif mine != first[1]:
            raise ValueError(
                f"stack member {name!r} selects {dim} {mine}, but {first[0]!r} selects "
                f"{first[1]}: with ensemble={dim!r} every sampled member selects the same "
                f"members in the same order (sel({dim}={first[1]}) on {name!r})"
            )
    assert first is not None  # (stack() refuses a stack without a sampled member)
    return tuple(first[1])
