"""anemoi-datasets' converted layout: what its names mean where the arrays do not say it.

``anemoi-datasets create`` writes one array ``data (time, variable, ensemble, cell)`` (its
dimension names in ``_ARRAY_DIMENSIONS``), and beside it no coordinate array named like a
dimension: the names of ``variable`` are the root group's attribute ``variables`` (``["10u",
"2t", "t_850", ...]``), the times are the array ``dates (time)`` (``datetime64[s]``), the
points' places ``latitudes (cell)`` and ``longitudes (cell)`` (a grid of points:
:mod:`~insitubatch_nodes.io.points`). Two rules read them as a store of one array per variable
would be read:

* :func:`variable_names`: ``sel(variable=["2t", "t_850"])`` looks the names up in the group's
  ``variables`` (so a stack's channels are named ``data@2t``, not by index);
* :data:`DATES`: where no array is named like the sample dimension, the array ``dates`` along
  it is its time coordinate (a time stride, windows in time deltas, ``missing=`` dates, the
  carried times, under the key ``"dates"``);
* :func:`recorded_missing`: the dates the group's ``missing_dates`` attribute lists (slots of
  ``data`` that hold no data: anemoi raises ``MissingDateError`` reading one) are missing
  dates, as if given in ``missing=`` (:func:`~insitubatch_nodes.anchor_steps.anchor_steps`).
  The ``frequency`` attribute is not read: the ``dates`` are the times.

Nothing else of the layout is special: its ``ensemble`` axis comes after ``variable``, and a
stack's ``ensemble="ensemble"`` takes it there (rows ``([T,] E, C, cell)``:
:mod:`~insitubatch_nodes.stack_ensemble`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zarr

from insitubatch_nodes.io import _zarr_compat

__all__ = ["DATES", "VARIABLE", "recorded_missing", "variable_names"]

#: the dimension whose names anemoi keeps in the group's ``variables`` attribute
VARIABLE = "variable"

#: anemoi's name for the time coordinate of the sample dimension (``dates (time)``)
DATES = "dates"


def variable_names(store: Any, geom: Any, dim: str) -> np.ndarray | None:
    """The names of dimension ``dim`` (``"variable"`` only) of the array ``geom`` (an
    :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`) of ``store``: the ``variables``
    attribute of its group or the nearest parent that has one, a list of as many distinct
    strings as the dimension's length. ``None`` for another dimension, or where no group holds
    such a list (a group that cannot be read counts as none)."""
    dims = tuple(geom.dims or ())
    if dim != VARIABLE or dim not in dims:
        return None
    length = int(geom.shape[dims.index(dim)])
    names = _group_attribute(store, str(geom.path), "variables")
    if (
        isinstance(names, list)
        and len(names) == length
        and all(isinstance(n, str) for n in names)
        and len(set(names)) == length
    ):
        return np.asarray(names)
    return None


def recorded_missing(store: Any, path: str) -> list[np.datetime64]:
    """The dates anemoi-datasets lists as missing for the array at ``path`` of ``store``: the
    ``missing_dates`` attribute (ISO 8601 strings) of its group or the nearest parent that has
    one, as ``datetime64[s]``. ``[]`` where no group lists any (or cannot be read); a list
    that is not of dates is a ``ValueError`` naming the attribute."""
    dates = _group_attribute(store, path, "missing_dates")
    if not dates:
        return []
    try:
        return [np.datetime64(str(d), "s") for d in dates]
    except (TypeError, ValueError):
        raise ValueError(
            f"the group of {path!r} lists missing_dates {list(dates)[:3]}..., which are not "
            "ISO 8601 dates: fix the attribute (anemoi writes '2020-01-02T00:00:00'), or "
            "delete it and give the missing dates in missing="
        ) from None


def _group_attribute(store: Any, path: str, name: str) -> Any:
    """Attribute ``name`` of the group holding the array at ``path`` or of its nearest parent
    that has it (``None`` where none has; a group that cannot be read counts as none)."""
    parts = path.strip("/").split("/")[:-1]
    for i in range(len(parts), -1, -1):
        try:
            group = zarr.open_group(
                store=_zarr_compat.opened(store), path="/".join(parts[:i]), mode="r"
            )
        except (OSError, KeyError, ValueError, TypeError, zarr.errors.GroupNotFoundError):
            continue
        if name in group.attrs:
            return group.attrs[name]
    return None
