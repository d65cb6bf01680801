"""Grids of points: a horizontal grid stored as one axis, and how many axes a view's grid has.

ERA5 on a reduced Gaussian grid (O96, N320), ICON's or HEALPix cells and anemoi's gridpoints
layout store a field as one axis of points (cfgrib's ``values``), with 1-D ``latitude(values)``
and ``longitude(values)`` arrays beside it: ``t (time, level, values)``. There the horizontal
grid is that one axis, and ``level`` is a channel axis, where on a regular grid ``(level, lat,
lon)`` the grid is the last two axes. :func:`points_of` finds such an axis when the geometries
are opened (``ArrayGeometry.points`` names the latitude and longitude arrays), and
:func:`grid_ndim` is the rule every per-channel reduction and channel layout takes: statistics
per channel, a stack's field, forcings on the grid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.selection import kept_axes, view_keys

__all__ = ["grid_ndim", "lat_lon_arrays", "points_hint", "points_of"]


def _role(name: str) -> str | None:
    base = name.rsplit("/", 1)[-1].lower()
    return "lat" if base.startswith("lat") else "lon" if base.startswith("lon") else None


def lat_lon_arrays(listed: Mapping[str, Any]) -> dict[str, Any]:
    """The 1-D arrays of a store's listing (path -> zarr array) named ``lat...`` or
    ``lon...``: what :func:`points_of` looks among."""
    return {p: a for p, a in listed.items() if a.ndim == 1 and _role(p) is not None}


def points_of(
    zstore: Any, path: str, array: Any, listed: Mapping[str, Any] | None
) -> tuple[str, str] | None:
    """The names of the latitude and longitude arrays along ``array``'s last dimension, where
    that dimension is a grid of points: 1-D arrays named ``lat...`` and ``lon...`` whose only
    dimension it is, in the array's group or a parent, among the arrays ``listed`` (the
    store's listing, :func:`lat_lon_arrays`) or, without one, those its CF ``coordinates``
    attribute names (read by name, as xarray writes them). ``None`` for a regular grid (a
    last dimension named ``lat...`` or ``lon...``), an array without dimension names, or where
    either is missing."""
    dims = _zarr_compat.array_dimension_names(array)
    if not dims or array.ndim < 1 or _role(dims[-1]) is not None:
        return None
    group = path.rpartition("/")[0]
    if listed is None:
        names = array.attrs.get("coordinates")
        if not isinstance(names, str):
            return None
        paths = [f"{group}/{n}" if group else n for n in names.split()]
        listed = dict(zip(paths, _zarr_compat.open_arrays_by_name(zstore, paths), strict=True))
    found: dict[str, str] = {}
    for name, coord in sorted(listed.items()):
        role, where = _role(name), name.rpartition("/")[0]
        if role is None or coord is None or role in found or coord.ndim != 1:
            continue
        if group != where and not group.startswith(f"{where}/") and where:
            continue
        if _zarr_compat.array_dimension_names(coord) == (dims[-1],):
            found[role] = name.rsplit("/", 1)[-1]  # (found again from the array's group)
    return (found["lat"], found["lon"]) if len(found) == 2 else None


def grid_ndim(view: Any) -> int:
    """How many of ``view``'s last kept field axes are its horizontal grid: 1 where its last
    field axis is a grid of points (``view.points``) and kept, 0 where an integer selection
    dropped it, else two (fewer where the view keeps fewer axes)."""
    kept = kept_axes(view_keys(view))
    if getattr(view, "points", None) is not None and view.field_axes:
        return 1 if len(view.field_axes) - 1 in kept else 0
    return min(2, len(kept))


def points_hint(view: Any, name: str) -> str:
    """What to say to ``sel``/``isel`` of ``name`` on ``view`` where it is the latitude or
    longitude of a grid of points (not a dimension: a box of the points is a mask of them);
    ``""`` otherwise."""
    if view.points is None or name not in view.points or not view.dims:
        return ""
    dim = view.dims[view.field_axes[-1]]
    return (
        f"{name!r} is the {'latitude' if name == view.points[0] else 'longitude'} of each "
        f"point of {dim!r} (a grid of points): select a box of them with a mask, e.g. "
        f"isel({dim}=(lat >= 30) & (lat <= 60)) with lat the {view.points[0]!r} array"
    )
