"""Where a channel stack's field lies: the points its members' fields are at.

:func:`stack <insitubatch_nodes.stack.stack>` stacks members whose fields agree in shape; this
module says which coordinates place a member's field (its last ``field_ndim`` kept axes: their
dimension names, or a grid of points' latitude and longitude,
:mod:`~insitubatch_nodes.io.points`), reads their values as selected, and refuses a member
whose field is at other points than the first member's (:func:`refuse_unlike_points`:
``ValueError`` naming the member and the selection that fixes it). It reads coordinates and
compares them; it changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.longitudes import same_points
from insitubatch_nodes.io.points import grid_ndim
from insitubatch_nodes.io.selection import kept_axes, view_keys

__all__ = ["grid_dims", "grid_points", "placing", "refuse_unlike_points"]


def grid_dims(view: ArrayGeometry, field_ndim: int) -> tuple[str, ...] | None:
    """The dimension names of the view's field (its last ``field_ndim`` kept axes), if known."""
    if view.dims is None:
        return None
    kept = [view.dims[view.field_axes[i]] for i in kept_axes(view_keys(view))]
    return tuple(kept[len(kept) - field_ndim :])


def _on_points(view: ArrayGeometry, field_ndim: int) -> bool:
    """Whether the view's field is a grid of points (:mod:`~insitubatch_nodes.io.points`)."""
    return view.points is not None and field_ndim == 1 == grid_ndim(view)


def placing(view: ArrayGeometry, field_ndim: int) -> tuple[str, ...] | None:
    """The coordinates that place the field's points: its grid dimensions' (as
    :func:`grid_dims`), or a grid of points' latitude and longitude."""
    return view.points if _on_points(view, field_ndim) else grid_dims(view, field_ndim)


def grid_points(view: ArrayGeometry, field_ndim: int) -> dict[str, np.ndarray]:
    """``{coordinate: values, as selected}`` of the view's field (its last ``field_ndim``
    kept axes; a grid of points' latitude and longitude), for those the view can read."""
    if view.dims is None or view.coordinates is None:
        return {}
    keys = view_keys(view)
    kept = kept_axes(keys)
    grid = [(view.dims[view.field_axes[i]], keys[i]) for i in kept[len(kept) - field_ndim :]]
    if _on_points(view, field_ndim):
        grid = [(name, grid[0][1]) for name in view.points or ()]
    out = {}
    for dim, key in grid:
        try:
            values = np.asarray(view.coordinates(view.base, dim))
        except (KeyError, ValueError):  # no such coordinate (or none shared): nothing to compare
            continue
        out[dim] = values if key is None else values[list(key)]  # type: ignore[arg-type]
    return out


def refuse_unlike_points(
    name: str,
    view: ArrayGeometry,
    first_name: str,
    first: tuple[tuple[str, ...] | None, Mapping[str, np.ndarray]],
    field_ndim: int,
) -> None:
    """Refuse member ``name`` whose field is at other points than the first member's
    (``first``: its :func:`placing` and :func:`grid_points`): a grid dimension whose
    coordinate (as selected) both read holds other values (a latitude stored the other way
    round in another store of a join; a grid of points' latitude or longitude: its points in
    another order), beyond float32 rounding (longitudes as places, whatever
    their convention: -157.5 is 202.5). Dimensions are paired by their
    place in the field, so a field named otherwise (``(latitude, longitude)`` beside ``(lat,
    lon)``) is compared too."""
    (first_dims, theirs), mine = first, grid_points(view, field_ndim)
    for dim, ref_dim in zip(placing(view, field_ndim) or (), first_dims or (), strict=False):
        values, ref = mine.get(dim), theirs.get(ref_dim)
        if values is None or ref is None or ref.shape != values.shape:
            continue
        numeric = values.dtype.kind in "iuf" and ref.dtype.kind in "iuf"
        if numeric:  # longitudes as places: -157.5 is 202.5
            longitude = dim.lower().startswith("lon") and ref_dim.lower().startswith("lon")
            same = bool(same_points(values, ref, longitude=longitude))
        else:
            same = np.array_equal(values, ref)
        if not same:
            theirs_at = "" if ref_dim == dim else f"{ref_dim!r} "
            how = f"sel({dim}=[...])"
            if _on_points(view, field_ndim):  # (no coordinate named like the points' axis)
                axis = (grid_dims(view, 1) or ("<points>",))[0]
                how = f"isel({axis}=[...]) (the order of its points)"
            raise ValueError(
                f"stack member {name!r} is at {dim!r} {values[:8].tolist()}, but "
                f"{first_name!r} at {theirs_at}{ref[:8].tolist()}: the shapes agree, the "
                f"points do not. Select the first member's points with {how} on it, or stack "
                "members on one grid"
            )
