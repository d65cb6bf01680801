"""An axis named by index or by dimension name, resolved once: :func:`axis_of`.

Every place that takes an axis — ``open_geometries``' ``sample_axis``, product sample axes,
the axes of :meth:`~insitubatch_nodes.ArrayGeometry.patches`, ``isel``/``sel`` — resolves it
here; they differ only in which axes they allow and in the words of their refusals.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from insitubatch_nodes.errors import ArrayNotFoundError
from insitubatch_nodes.io import _zarr_compat

__all__ = ["AxisNames", "axis_of", "check_sample_axis", "dims_option", "named_axes"]


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


_DIMS_EXAMPLE = "e.g. dims={'image': ['c', 'z', 'y', 'x']}"


def dims_option(
    dims: Mapping[str, Sequence[str]] | None, variables: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """A collection's ``dims=`` checked: ``{variable: names}`` for variables of ``variables``,
    each a sequence of unique non-empty strings (one per axis: :func:`named_axes` checks the
    count against the arrays). ``{}`` for ``None``; ``ValueError`` saying what to pass."""
    if dims is None:
        return {}
    if not isinstance(dims, Mapping):
        raise ValueError(f"dims maps variables to dimension names, {_DIMS_EXAMPLE}; got {dims!r}")
    out: dict[str, tuple[str, ...]] = {}
    for variable, names in dims.items():
        if variable not in variables:
            raise ValueError(
                f"dims names {variable!r}, which is not a variable; the variables are "
                f"{list(variables)}"
            )
        if (
            isinstance(names, str)
            or not isinstance(names, Sequence)
            or not all(isinstance(n, str) and n for n in names)
            or len(set(names)) != len(names)
        ):
            raise ValueError(
                f"dims[{variable!r}] must be one unique name (a non-empty string) per axis of "
                f"its arrays, {_DIMS_EXAMPLE}; got {names!r}"
            )
        out[str(variable)] = tuple(names)
    return out


def named_axes(
    where: str, given: Sequence[str] | None, own: Sequence[str] | None, ndim: int
) -> AxisNames:
    """The axes of an array whose dimension names may be ``given`` (a collection's ``dims=``;
    they win over the array's ``own``): ``ValueError`` where they are not one per axis."""
    if given is not None and len(given) != ndim:
        raise ValueError(
            f"{where}: dims names {len(given)} axes {list(given)}, but the array has {ndim}: "
            f"give one name per axis, {_DIMS_EXAMPLE}"
        )
    return AxisNames(where, own if given is None else given, ndim)


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


def check_sample_axis(
    store: Any, where: str, axes: Mapping[str, Any], arrays: Mapping[str, Any], dim: Any
) -> None:
    """Refuse a ``sample_axis`` option of ``open_geometries`` that names what ``store``
    (described as ``where``) does not hold, before any geometry is built from it.

    The paths of its ``{path: axis}`` mapping (``axes``) must be arrays of the store
    (:class:`~insitubatch_nodes.errors.ArrayNotFoundError` otherwise), and a dimension name
    (``dim``, or a name in ``axes``) must be a dimension of one of ``arrays`` (every array
    found or named, coordinates included) or the name of an array of the store (its coordinate,
    read by name): otherwise ``KeyError`` naming the dimensions there. An array without the
    sample dimension is static, so before, a misspelt name made every array static (each batch
    carrying it whole).
    """
    maybe = [p for p in axes if p not in arrays]
    opened = _zarr_compat.open_arrays_by_name(store, maybe) if maybe else []
    unknown = [p for p, a in zip(maybe, opened, strict=True) if a is None]
    if unknown:
        raise ArrayNotFoundError(
            f"sample_axis names unknown arrays {sorted(unknown)} in store {where}; arrays "
            f"there: {sorted(arrays)}"
        )
    firsts = [(a[0] if a else None) if isinstance(a, tuple) else a for a in [dim, *axes.values()]]
    names = {n for n in firsts if isinstance(n, str)}  # (``()``: no sample axis, no name)
    dims = {d for a in arrays.values() for d in _zarr_compat.array_dimension_names(a) or ()}
    absent = sorted(names - dims)
    found = _zarr_compat.open_arrays_by_name(store, absent) if absent else []
    for name, array in zip(absent, found, strict=True):
        if array is None:
            raise KeyError(
                f"sample_axis={name!r} is the dimension name of no array in store {where} "
                f"(their dimension names: {sorted(dims)}): check its spelling (an array "
                "without the sample dimension is static, carried whole by every batch)"
            )
