"""How a patched view cuts its field into windows: :class:`Patches`, the plain description
:meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.patches` makes and the read plan
(:mod:`~insitubatch_nodes.plan.patches`) draws origins from, and :func:`patch_spec`, which
checks what ``patches()`` is given and makes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np

__all__ = [
    "ORIGIN_POLICIES",
    "REGION_ORDERS",
    "AxisMap",
    "Patches",
    "cut_windows",
    "only_patched",
    "patch_spec",
    "refuse_selected",
    "window_bounds",
    "windows_fit",
]

ORIGIN_POLICIES = ("grid", "random")
REGION_ORDERS = ("shuffled", "sweep")

V = TypeVar("V")
#: field axes (physical indices, or dimension names) to a value, as ``patches`` takes them: a
#: ``dict[str, int]`` is no ``Mapping[int | str, int]`` to a type checker (keys are invariant)
AxisMap: TypeAlias = Mapping[str, V] | Mapping[int, V] | Mapping[int | str, V]


@dataclass(frozen=True)
class Patches:
    """How a patched view cuts its field into windows (see :meth:`ArrayGeometry.patches`).

    ``axes`` are the physical axes that are cut (ascending), ``dims`` their dimension names
    (``None`` for an array without), ``extent`` the window's size along each and ``field`` the
    array's length along each. ``origins="grid"``: windows start every
    ``stride`` along each axis, plus one flush with the far edge where the stride does not end
    there, so the windows cover the field exactly; the same windows every epoch.
    ``origins="random"``: each epoch draws new origins, uniform and *stratified by stored tile*:
    ``per_tile`` windows start in each full tile of the grouping tiling (``tile``, the first
    patched array's tiles along ``axes``), an edge tile's share in proportion to its start
    positions over those of the fullest tile along each axis (a field within one tile along an
    axis: all of ``per_tile``), so
    every tile holds the same number of windows every epoch (what keeps batch counts, budget
    floors and resume exact).

    ``order`` is how a shuffled plan visits the regions of tiles its windows are grouped in
    (see :mod:`~insitubatch_nodes.plan.patches`): ``"shuffled"`` in a random order (neighbouring
    batches come from anywhere; under a budget below the read-once floor the tiles on region
    edges are read again), ``"sweep"`` plane by plane (planes in a random order), each swept
    region by region along a boustrophedon in one of its symmetric variants drawn per epoch
    (neighbouring batches come from neighbouring regions; every tile is read once per epoch in
    little more than one row of regions' memory).

    ``within`` (``[lo, hi)`` per patched axis, or ``None`` for the whole field) keeps every
    window inside a box of the field: the patches of a spatial split. Views patched within
    disjoint boxes never share a pixel (a held-out region for validation).
    """

    axes: tuple[int, ...]
    dims: tuple[str, ...] | None
    extent: tuple[int, ...]
    field: tuple[int, ...]
    tile: tuple[int, ...]
    origins: str = "grid"
    stride: tuple[int, ...] | None = None
    per_tile: int | None = None
    order: str = "shuffled"
    within: tuple[tuple[int, int], ...] | None = None

    def alike(self, other: Patches) -> bool:
        """Whether views patched by ``self`` and ``other`` can share each row's origins: the
        same dimensions cut (by name where both arrays name them, so arrays of other ranks
        too, e.g. ``(time, lat, lon)`` and ``(time, level, lat, lon)``; else the same axes),
        the same extent, field, origins, stride, windows per tile, order and ``within`` box
        (origins drawn in one box would leave the other's windows outside it)."""
        return not self.differences(other)

    def differences(self, other: Patches) -> str:
        """What keeps ``self`` and ``other`` from being :meth:`alike`, for an error message
        (``"origins 'grid' vs 'random'"``); empty when they are alike."""
        named = self.dims is not None and other.dims is not None
        cut = "dims" if named else "axes"
        keys = (cut, "extent", "field", "origins", "stride", "per_tile", "order", "within")
        return "; ".join(
            f"{k} {getattr(self, k)!r} vs {getattr(other, k)!r}"
            for k in keys
            if getattr(self, k) != getattr(other, k)
        )

    def axes_of(self, dims: Sequence[str] | None) -> tuple[int, ...]:
        """The axes these patches cut in an array of dimensions ``dims`` (patched alike,
        :meth:`alike`): found by name where both are named, else :attr:`axes`."""
        if self.dims is None or dims is None or not set(self.dims) <= set(dims):
            return self.axes
        return tuple(list(dims).index(d) for d in self.dims)

    @property
    def n_axes(self) -> int:
        return len(self.axes)

    @property
    def windows_per_tile(self) -> int:
        """Random windows per full tile: ``per_tile``, or as many as the tile holds side by
        side (at least 1)."""
        if self.per_tile is not None:
            return self.per_tile
        return max(1, math.prod(t // e for t, e in zip(self.tile, self.extent, strict=True)))

    def describe(self) -> list[Any]:
        """A plain-Python description (for a saved state's configuration check)."""
        return [
            list(self.axes),
            list(self.extent),
            list(self.field),
            list(self.tile),
            self.origins,
            None if self.stride is None else list(self.stride),
            self.per_tile,
            self.order,
            None if self.within is None else [list(b) for b in self.within],
        ]

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``[lo, hi)`` along each patched axis that windows lie in (``within``, or the field)."""
        return self.within or tuple((0, f) for f in self.field)


def window_bounds(axis: int | str, value: Any, extent: int, length: int) -> tuple[int, int]:
    """``within``'s ``(lo, hi)`` along ``axis`` (an index or a dimension name, as the message
    names it), checked: inside the field, a window wide."""
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise TypeError(f"within[{axis!r}] must be a (lo, hi) pair, got {value!r}") from None
    if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (lo, hi)):
        raise TypeError(
            f"within[{axis!r}] = {value!r}: the bounds are indices along the axis, so ints "
            "(not coordinate values)"
        )
    lo, hi = int(lo), int(hi)
    if not 0 <= lo < hi <= length or hi - lo < extent:
        raise ValueError(
            f"within[{axis!r}] = ({lo}, {hi}) must lie in [0, {length}] and hold a window of "
            f"{extent}"
        )
    return lo, hi


def only_patched(
    path: str,
    option: str,
    given: Iterable[int],
    axes: Sequence[int],
    key: Callable[[int], int | str],
) -> None:
    """``ValueError`` naming the axes ``option`` (``stride``, ``within``) gives — physical
    indices, shown as ``key`` names them — that are not among the patched ``axes``."""
    extra = sorted(set(given) - set(axes))
    if extra:
        raise ValueError(
            f"{path}: {option} names axes that are not patched: {[key(a) for a in extra]}; "
            f"patched: {[key(a) for a in axes]}"
        )


def windows_fit(
    path: str,
    axes: Sequence[int],
    extent: Sequence[int],
    shape: Sequence[int],
    key: Callable[[int], int | str],
) -> None:
    """``ValueError`` unless a window of ``extent`` fits the array's ``shape`` along each of
    ``axes`` (the message names the axis as ``key`` does and the largest extent that fits)."""
    for a, e in zip(axes, extent, strict=True):
        if e > shape[a]:
            name = key(a)
            where = f"axis {a}" if name == a else f"{name!r} (axis {a})"
            raise ValueError(
                f"{path}: a window of {e} along {where} does not fit the field's {shape[a]}; "
                f"take an extent of at most {shape[a]} there"
            )


def refuse_selected(path: str, selected: Sequence[int | str]) -> None:
    """``ValueError`` for patching axes a selection cut (``selected``, as the user names
    them; none: nothing to refuse), pointing to ``within=``, which keeps windows in a range."""
    if selected:
        name = selected[0]
        raise ValueError(
            f"{path}: a selected axis cannot be patched ({name!r}); patch the others, or patch "
            f"the whole axis and keep its windows in a range with within={{{name!r}: (lo, hi)}}"
        )


Cut = tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]
"""Each row's window of a field: ``(origins, axes, extent)``, as :func:`cut_windows` takes
them (``origins`` ``(rows, len(axes))``)."""


def cut_per_step(cut: Cut, field: tuple[int, ...], steps: int) -> tuple[Cut, tuple[int, ...]]:
    """``cut`` for ``steps`` fields per row (a window's, laid out row after row: each row's
    origin repeated), and the shape of a ``field``-shaped field cut to the window."""
    origins, axes, extent = cut
    shape = tuple(extent[axes.index(a)] if a in axes else n for a, n in enumerate(field))
    return (np.repeat(np.asarray(origins), steps, axis=0), axes, extent), shape


def cut_windows(
    values: np.ndarray,
    origins: np.ndarray,
    axes: tuple[int, ...],
    extent: tuple[int, ...],
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """Row ``i`` of ``values`` (``(rows, *row)``) cut along ``axes`` (of a row, in the order of
    ``extent`` and of ``origins``' columns) to the window of ``extent`` at ``origins[i]``,
    every row at once: one gather from the windows' strided view (no Python per row). What a
    patched stack's static and forcing members and a patched label's
    :class:`~insitubatch_nodes.forcings.Forcings` take of their whole field. With ``rows``,
    row ``i`` is cut from ``values[rows[i]]`` (a table of distinct fields, such as the
    forcings' of a batch's distinct times), no row's whole field copied first."""
    ndim = values.ndim - 1
    cut = tuple(1 + a for a in axes)
    windows = np.lib.stride_tricks.sliding_window_view(values, extent, axis=cut)
    # (rows, *cut axes (one window origin each), *other axes, *window) then one index per row
    windows = np.moveaxis(windows, cut, range(1, 1 + len(cut)))
    at = (
        np.arange(len(values)) if rows is None else rows,
        *(np.asarray(origins)[:, k] for k in range(len(cut))),
    )
    picked = windows[at]  # (rows, *other axes, *window)
    rest = [a for a in range(ndim) if a not in axes]
    # each row back in its own axis order: a cut axis at its own place
    order = [len(rest) + axes.index(a) if a in axes else rest.index(a) for a in range(ndim)]
    return picked.transpose(0, *(1 + k for k in order))


class _Patched(Protocol):
    """What :func:`patch_spec` reads of the view it patches (an
    :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`)."""

    @property
    def path(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def chunks(self) -> tuple[int, ...]: ...
    @property
    def patch(self) -> Patches | None: ...
    @property
    def static(self) -> bool: ...
    @property
    def select(self) -> Any: ...  # a Selection (its ``keys``), or None
    @property
    def field_axes(self) -> tuple[int, ...]: ...
    @property
    def dims(self) -> tuple[str, ...] | None: ...


def patch_spec(
    view: _Patched,
    extent: AxisMap[int],
    *,
    stride: int | AxisMap[int] | None,
    origins: str,
    per_tile: int | None,
    order: str,
    within: AxisMap[tuple[int, int]] | None,
    axis_named: Callable[[int | str], int],
    name_of: Callable[[int], int | str],
) -> Patches:
    """The :class:`Patches` of :meth:`ArrayGeometry.patches
    <insitubatch_nodes.io.geometry.ArrayGeometry.patches>` (its docstring states the arguments),
    each checked once here: ``axis_named`` gives the physical field axis a key names (an index or
    a dimension name), ``name_of`` how the user names a physical axis (for messages)."""
    if view.patch is not None:
        raise ValueError(f"{view.path}: this view is patched already; patch the array once")
    if view.static:
        raise ValueError(
            f"{view.path}: a static view cannot be patched; to draw windows of an array "
            "without a sample axis, open it with sample_axis=() (the whole array one sample)"
        )
    if not isinstance(extent, Mapping) or not extent:
        raise TypeError(
            f"patches() takes a mapping of field axes to sizes, e.g. {{1: 256, 2: 256}}, "
            f"got {extent!r}"
        )
    if origins not in ORIGIN_POLICIES:
        raise ValueError(f"origins must be one of {ORIGIN_POLICIES}, got {origins!r}")
    if order not in REGION_ORDERS:
        raise ValueError(f"order must be one of {REGION_ORDERS}, got {order!r}")
    sizes = {axis_named(k): _positive(f"extent[{k!r}]", v) for k, v in extent.items()}
    if len(sizes) != len(extent):
        raise ValueError(f"{view.path}: extent {dict(extent)} names one axis twice")
    axes = tuple(sorted(sizes))
    keys = (None,) * len(view.field_axes) if view.select is None else view.select.keys
    chosen = [name_of(a) for a in axes if keys[view.field_axes.index(a)] is not None]
    refuse_selected(view.path, chosen)
    ext = tuple(sizes[a] for a in axes)
    windows_fit(view.path, axes, ext, view.shape, name_of)
    steps: tuple[int, ...] | None = None
    if origins == "grid":
        if per_tile is not None:
            raise ValueError("per_tile applies to origins='random'; a grid takes stride=")
        if stride is None:
            steps = ext
        elif isinstance(stride, Mapping):
            given = {axis_named(k): _positive(f"stride[{k!r}]", v) for k, v in stride.items()}
            only_patched(view.path, "stride", given, axes, name_of)
            steps = tuple(given.get(a, e) for a, e in zip(axes, ext, strict=True))
        else:
            steps = (_positive("stride", stride),) * len(axes)
    else:
        if stride is not None:
            raise ValueError("stride applies to origins='grid'; random origins take per_tile=")
        if per_tile is not None:  # None: as many as fit side by side (Patches.windows_per_tile)
            per_tile = _positive("per_tile", per_tile)
    box: tuple[tuple[int, int], ...] | None = None
    if within is not None:
        given_box = {axis_named(k): v for k, v in dict(within).items()}
        only_patched(view.path, "within", given_box, axes, name_of)
        box = tuple(
            window_bounds(name_of(a), given_box.get(a, (0, view.shape[a])), e, view.shape[a])
            for a, e in zip(axes, ext, strict=True)
        )
    return Patches(
        axes=axes,
        dims=None if view.dims is None else tuple(view.dims[a] for a in axes),
        extent=ext,
        field=tuple(view.shape[a] for a in axes),
        tile=tuple(view.chunks[a] for a in axes),
        origins=origins,
        stride=steps,
        per_tile=per_tile,
        order=order,
        within=box,
    )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)
