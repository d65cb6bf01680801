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
  carried times, under the key ``"dates"``).

Nothing else of the layout is special: its ``ensemble`` axis comes after ``variable``, and a
stack's ``ensemble="ensemble"`` takes it there (rows ``([T,] E, C, cell)``:
:mod:`~insitubatch_nodes.stack_ensemble`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zarr

from insitubatch_nodes.io import _zarr_compat

__all__ = ["DATES", "VARIABLE", "variable_names"]

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
    parts = str(geom.path).strip("/").split("/")[:-1]
    for i in range(len(parts), -1, -1):
        try:
            group = zarr.open_group(
                store=_zarr_compat.opened(store), path="/".join(parts[:i]), mode="r"
            )
        except (OSError, KeyError, ValueError, zarr.errors.GroupNotFoundError):
            continue
        names = group.attrs.get("variables")
        if (
            isinstance(names, list)
            and len(names) == length
            and all(isinstance(n, str) for n in names)
            and len(set(names)) == length
        ):
            return np.asarray(names)
    return None
