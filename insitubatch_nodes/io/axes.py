"""An axis named by index or by dimension name, resolved once: :func:`axis_of`.

Every place that takes an axis — ``open_geometries``' ``sample_axis``, product sample axes,
the axes of :meth:`~insitubatch_nodes.ArrayGeometry.patches`, ``isel``/``sel`` — resolves it
here; they differ only in which axes they allow and in the words of their refusals.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple, Protocol

import numpy as np

__all__ = ["AxisNames", "axis_of"]


class HasAxes(Protocol):
    """What :func:`axis_of` reads of an array: an :class:`ArrayGeometry` has it."""

    @property
    def path(self) -> str: ...
    @property
    def dims(self) -> Sequence[str] | None: ...
    @property
    def ndim(self) -> int: ...


class AxisNames(NamedTuple):
    """The axes of an array that is not (yet) a geometry: its path, dimension names (or
    ``None``) and number of axes."""

    path: str
    dims: Sequence[str] | None
    ndim: int


def axis_of(
    geom_or_dims: HasAxes,
    key: int | str,
    *,
    allowed: Collection[int] | None = None,
    what: str = "an axis",
    hint: str = "name axes by index instead",
    refused: Callable[[int | str], str] | None = None,
    out_of_range: Callable[[int | str], str] | None = None,
) -> int:
    """The physical axis ``key`` names in ``geom_or_dims``: an index (negative counts from the
    end) or one of its dimension names.

    ``allowed`` (default: every axis) are the axes ``key`` may name. Raises ``KeyError`` for a
    name the array has no dimension of (``hint`` says what to do instead), ``TypeError`` for a
    key that is neither an int nor a string (``what`` names what it should have been), and
    ``ValueError`` for an axis not ``allowed`` (the message ``refused(key)``) or, when every axis
    is allowed, out of range (``out_of_range(key)``).
    """
    path, ndim = geom_or_dims.path, geom_or_dims.ndim
    if isinstance(key, str):
        dims = geom_or_dims.dims
        if dims is None or key not in dims:
            raise KeyError(
                f"{path}: no dimension named {key!r} (the array's dimension names: {dims})"
                + (f"; {hint}" if hint else "")
            )
        axis = list(dims).index(key)
    elif isinstance(key, int | np.integer) and not isinstance(key, bool):
        axis = int(key) + (ndim if key < 0 else 0)
    else:
        raise TypeError(f"{what} is an int or a dimension name, got {key!r}")
    if allowed is not None:
        if axis not in allowed:
            raise ValueError(
                refused(key) if refused else f"{path}: axis {key!r} is not one of {tuple(allowed)}"
            )
    elif not 0 <= axis < ndim:
        default = f"{path}: axis {key} is out of range for {ndim} axes"
        raise ValueError(out_of_range(key) if out_of_range else default)
    return axis
