"""Selections on field axes: which indices of each field axis a view keeps, and what is read.

A *selected* view (:meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.isel`, ``.sel``) keeps,
along each field axis, either everything, a list of indices (a list or a slice: the axis is
kept) or one index (an integer: the axis is dropped, as numpy drops it). Its ``inner_shape``
is the selection's.

What is read for it depends on how the array is chunked along the selected axes:

* **An axis whole in a stored object** (ARCO-ERA5's 37 levels in one object): the object is
  decoded once, and its slot keeps only the indices the array's views select (13 levels of
  37: 13/37 of the memory), copied out of the decoded object on the decoding thread while it
  is hot in cache. A view selecting exactly what is held is then one contiguous copy per row.
  (A slot holds the whole object where it must: the array has chunk transforms, which take
  the stored chunk, or the pool keeps a persistent cache, whose files are stored chunks.)
* **An axis cut into tiles** (levels stored one per object, a tiled latitude/longitude grid):
  only the tiles the selection touches are read, each decoded straight into its place in the
  slot, the touched tiles side by side (smaller than the chunk).

Views of one array share its slots, so what a slot holds is the union of what every view of
the array selects (everything when one view reads the whole field); a later ``set_views``
may select only within it.

Everything here is plain data worked out once per view or array, before any read (as zarr
plans a selection); the fetch stage fills the held tiles, the gather indexes the slot.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from insitubatch_nodes.io.longitudes import refuse_other_convention
from insitubatch_nodes.io.timeunits import as_timedelta

__all__ = [
    "Held",
    "HeldBox",
    "Selection",
    "as_slice",
    "axis_key",
    "covers",
    "even_runs",
    "held_boxes",
    "held_by_path",
    "held_geometry",
    "held_indices",
    "kept_axes",
    "slot_index",
    "view_keys",
]

AxisKey = int | tuple[int, ...] | None
"""What a selection keeps along one field axis: ``None`` everything, an ``int`` one index (the
axis is dropped), a tuple of indices (the axis is kept, in that order)."""


@dataclass(frozen=True)
class Selection:
    """What a view keeps of each field axis (``keys``, one per field axis, in physical order;
    see :data:`AxisKey`); indices are non-negative and within the axis."""

    keys: tuple[AxisKey, ...]

    def shape(self, field_shape: Sequence[int]) -> tuple[int, ...]:
        """The selected payload's shape: kept axes at their selected length, dropped ones out."""
        out = []
        for key, n in zip(self.keys, field_shape, strict=True):
            if key is None:
                out.append(int(n))
            elif isinstance(key, tuple):
                out.append(len(key))
        return tuple(out)

    def then(self, other: Selection, field_shape: Sequence[int] | None = None) -> Selection:
        """This selection followed by ``other`` (whose keys run over this one's kept axes).
        With the ``field_shape``, a key that takes a whole axis in order (a reorder undone)
        is ``None``: no selection there."""
        kept = [i for i, k in enumerate(self.keys) if not isinstance(k, int)]
        keys = list(self.keys)
        for i, key in zip(kept, other.keys, strict=True):
            if key is None:
                continue
            mine = keys[i]
            if mine is None:
                keys[i] = key
            else:
                assert isinstance(mine, tuple)
                keys[i] = mine[key] if isinstance(key, int) else tuple(mine[j] for j in key)
        if field_shape is not None:
            whole = [tuple(range(n)) for n in field_shape]
            keys = [None if k == w else k for k, w in zip(keys, whole, strict=True)]
        return Selection(tuple(keys))

    def describe(self) -> list[Any]:
        """A plain-Python description (for a saved state's configuration check)."""
        return [k if k is None or isinstance(k, int) else list(k) for k in self.keys]


def view_keys(view: Any) -> tuple[AxisKey, ...]:
    """A view's (an :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`'s) selection key per
    field axis: its selection's, or ``None`` (the whole axis) for each without one."""
    return view.select.keys if view.select is not None else (None,) * len(view.field_axes)


def kept_axes(keys: Sequence[AxisKey]) -> list[int]:
    """The field axes (positions in ``keys``) a selection keeps, in order: all but those an
    integer key drops. The last two of them are a view's grid."""
    return [i for i, k in enumerate(keys) if not isinstance(k, int)]


def axis_key(name: str, key: Any, length: int) -> AxisKey:
    """``key`` (an int or a 0-d integer array, a slice, a list of ints, or a boolean mask of
    the axis's length, as xarray's ``isel`` takes it) along an axis of ``length``, normalised:
    ``None`` for a key that takes the whole axis in order (``slice(None)``: no selection, so
    the axis stays whole: patchable, a static stack member's window there)."""
    _refuse_pointwise("isel", name, key)
    if isinstance(key, bool):
        raise TypeError(f"isel({name}=...) takes an int, a slice or a list of ints, got {key!r}")
    if isinstance(key, np.ndarray) and key.ndim == 0 and key.dtype.kind in "iu":
        key = key.item()  # a 0-d index array is its integer, as numpy and xarray take it
    if isinstance(key, int | np.integer):
        i = int(key)
        if not -length <= i < length:
            raise IndexError(f"isel({name}={i}): index out of range for an axis of {length}")
        return i % length
    if isinstance(key, slice):
        picked = tuple(range(length)[key])
    else:
        try:
            values = np.asarray(key)
        except (TypeError, ValueError):
            values = np.asarray([], dtype=object)
        if values.ndim == 1 and values.dtype.kind == "b":  # a mask: the indices it marks
            if len(values) != length:
                raise IndexError(
                    f"isel({name}=...): a boolean mask of {len(values)} for an axis of {length}"
                )
            values = np.flatnonzero(values)
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise TypeError(
                f"isel({name}=...) takes an int, a slice, a 1-D list of ints or a boolean mask "
                f"of the axis, got {key!r}"
            )
        bad = values[(values < -length) | (values >= length)]
        if bad.size:
            raise IndexError(
                f"isel({name}=...): indices {bad.tolist()} out of range for an axis of {length}"
            )
        picked = tuple(int(v) % length for v in values.tolist())
    if not picked:
        raise IndexError(
            f"isel({name}={key!r}) selects nothing along an axis of {length}: a view keeps at "
            "least one index of each axis (a batch of an empty axis holds nothing); leave the "
            "axis out to keep it whole, or give an int to keep one index and drop the axis"
        )
    return None if picked == tuple(range(length)) else picked


def _refuse_pointwise(how: str, name: str, key: Any) -> None:
    """``TypeError`` for an xarray ``DataArray`` indexer along another dimension than ``name``
    (``xr.DataArray(lats, dims="station")``): with such indexers xarray selects pointwise (one
    point per station, the indexers of the axes taken together), where a view keeps a
    selection of each axis on its own (every pair of them)."""
    dims = getattr(key, "dims", None)
    if isinstance(dims, tuple) and dims and dims != (name,):
        raise TypeError(
            f"{how}({name}=<DataArray along {dims}>): with indexers along a new dimension "
            f"xarray selects pointwise (one point per {dims[0]!r}, the axes' indexers taken "
            "together), and a view keeps a selection of each axis on its own: it would hold "
            f"every {name} with every value of the other axes. Pass the values as a list "
            f"(np.asarray(indexer)) for that box, or select the box around the points and "
            "take them out of each batch in a batch transform (pointwise selection is not "
            "supported)"
        )


# -- what one array's slots hold -------------------------------------------------------------
Held = tuple[tuple[int, ...] | None, ...]
"""Per field axis, the indices of the axis a slot holds (ascending, side by side in the slot),
or ``None`` for all of them."""


def _selected(key: AxisKey) -> tuple[int, ...] | None:
    """The indices ``key`` takes along its axis (``None``: all of them)."""
    if key is None:
        return None
    return (key,) if isinstance(key, int) else tuple(key)


def held_indices(
    selections: Sequence[Selection | None],
    tile_shape: Sequence[int],
    field_shape: Sequence[int],
    *,
    exact: bool = True,
) -> Held | None:
    """The indices the slots of one array hold for views with ``selections``, per field axis:
    along an axis stored whole in each object (one tile), the union of what the views select
    when ``exact`` (the object is decoded once, and only those indices are kept); along an
    axis cut into tiles, every index of the tiles the views touch (each decodes straight into
    its place). ``None`` when that is everything (an ordinary slot)."""
    held: list[set[int] | None] = [set() for _ in tile_shape]
    for sel in selections:
        keys = (None,) * len(tile_shape) if sel is None else sel.keys
        for axis, key in enumerate(keys):
            have, idx = held[axis], _selected(key)
            if idx is None or have is None:
                held[axis] = None
            else:
                have.update(idx)
    out: list[tuple[int, ...] | None] = []
    for h, size, n in zip(held, tile_shape, field_shape, strict=True):
        if h is not None and not (exact and size >= n):  # whole touched tiles
            h = {
                i for t in {i // size for i in h} for i in range(t * size, min(n, t * size + size))
            }
        out.append(None if h is None or len(h) == n else tuple(sorted(h)))
    return None if all(h is None for h in out) else tuple(out)


def held_shape(held: Held, field_shape: Sequence[int]) -> tuple[int, ...]:
    """A held slot's payload shape: per field axis, the held indices side by side."""
    return tuple(n if h is None else len(h) for h, n in zip(held, field_shape, strict=True))


HeldBox = tuple[tuple[int, ...], tuple[slice, ...], tuple[np.ndarray | None, ...]]
"""One stored tile a held slot takes from: its coordinates in the array's tile grid, the
rectangle it fills in the slot's payload, and per field axis the indices within the tile it
keeps (``None``: the tile's whole extent, decoded straight into the rectangle)."""


def held_boxes(held: Held, tile_shape: Sequence[int], field_shape: Sequence[int]) -> list[HeldBox]:
    """Every stored tile a held slot takes indices from, in C order (see :data:`HeldBox`)."""
    per_axis: list[list[tuple[int, slice, np.ndarray | None]]] = []
    for h, c, n in zip(held, tile_shape, field_shape, strict=True):
        idx = np.arange(n) if h is None else np.asarray(h, dtype=np.int64)
        tiles = idx // c
        spots = []
        for t in np.unique(tiles).tolist():
            place = np.flatnonzero(tiles == t)
            within = idx[place] - t * c
            whole = len(within) == _extent(t, c, n)  # (ascending: then it is 0, 1, ..., e - 1)
            box = slice(int(place[0]), int(place[-1]) + 1)
            spots.append((int(t), box, None if whole else within))
        per_axis.append(spots)
    return [
        (
            tuple(t for t, _, _ in combo),
            tuple(s for _, s, _ in combo),
            tuple(w for _, _, w in combo),
        )
        for combo in product(*per_axis)
    ]


def _extent(tile: int, size: int, length: int) -> int:
    return min((tile + 1) * size, length) - tile * size


def covers(held: Held | None, selection: Selection | None) -> bool:
    """Whether slots holding ``held`` hold every index ``selection`` takes."""
    if held is None:
        return True
    keys = (None,) * len(held) if selection is None else selection.keys
    for h, key in zip(held, keys, strict=True):
        if h is None:
            continue
        selected = _selected(key)
        if selected is None or not set(selected) <= set(h):
            return False
    return True


def slot_index(selection: Selection, held: Held | None) -> tuple[int | slice | np.ndarray, ...]:
    """The index of ``selection`` into one sample of a slot (held or whole), per field axis:
    an ``int`` (a dropped axis), a ``slice`` (everything, or evenly spaced indices) or an
    index array; a payload ``slot[row][index]`` has the selection's shape."""
    out: list[int | slice | np.ndarray] = []
    for axis, key in enumerate(selection.keys):
        kept = None if held is None else held[axis]
        if key is None:
            out.append(slice(None))
            continue
        idx = np.asarray(_selected(key), dtype=np.int64)
        if kept is not None:  # where each index lies among the held ones, side by side
            idx = np.searchsorted(np.asarray(kept, dtype=np.int64), idx)
        if isinstance(key, int):
            out.append(int(idx[0]))
        else:
            out.append(as_slice(idx))
    return tuple(out)


def as_slice(idx: np.ndarray) -> slice | np.ndarray:
    """``idx`` as a slice when it is evenly spaced (a view, no gather), else the array."""
    if len(idx) == 1:
        return slice(int(idx[0]), int(idx[0]) + 1)
    step = int(idx[1] - idx[0])
    if step == 0 or not np.all(np.diff(idx) == step):
        return idx
    stop = int(idx[-1]) + step
    return slice(int(idx[0]), None if stop < 0 else stop, step)


def even_runs(listed: Sequence[int]) -> list[tuple[slice, slice]]:
    """``listed`` (indices along one axis) cut into runs that rise evenly, each as long as it
    can be from the left: per run, its place among the entries and the indices it takes, both
    slices (a view each, where an index array would gather). ``[0, 3, 4]``: two runs,
    ``[0, 2, 4]``: one; a falling or repeated entry starts a run of its own."""
    runs = []
    i = 0
    while i < len(listed):
        j = i + 1
        step = listed[j] - listed[i] if j < len(listed) else 1
        if step > 0:
            while j < len(listed) and listed[j] - listed[j - 1] == step:
                j += 1
        else:
            step = 1
        runs.append((slice(i, j), slice(listed[i], listed[j - 1] + 1, step)))
        i = j
    return runs


def held_by_path(
    views: Iterable[Any], exact: Callable[[str], bool] = lambda path: True
) -> dict[str, Held]:
    """Array path -> the indices its slots hold (:func:`held_indices`), for the arrays (of
    ``views``, geometries) whose views all select only part of a field axis; arrays left out
    hold everything. ``exact(path)``: whether the array's slots may keep only the selected
    indices of an axis stored whole in each object (else they keep whole tiles).

    A patched array's slot holds one stored tile (a unit): it keeps only the selected indices
    of an unpatched axis stored whole in each object, and all of any other axis."""
    selections: dict[str, list[Selection | None]] = {}
    bases: dict[str, Any] = {}
    patched: dict[str, set[int]] = {}
    for view in views:
        if view.static:
            continue
        selections.setdefault(view.path, []).append(view.select)
        bases.setdefault(view.path, view.base)
        if view.patch is not None:
            patched.setdefault(view.path, set()).update(view.patch.axes_of(view.base.dims))
    out = {}
    for path, sels in selections.items():
        base = bases[path]
        held = held_indices(sels, base.tile_shape, base.field_shape, exact=exact(path))
        if held is not None and path in patched:  # a unit: one tile of every tiled axis
            held = tuple(
                h if exact(path) and a not in patched[path] and c >= n else None
                for h, a, c, n in zip(
                    held, base.field_axes, base.tile_shape, base.field_shape, strict=True
                )
            )
            if all(h is None for h in held):
                held = None
        if held is not None:
            out[path] = held
    return out


def held_geometry(base: Any, held: Held) -> Any:
    """What one slot of array ``base`` (a geometry) holds when it holds the indices ``held``."""
    return base.with_inner(held_shape(held, base.field_shape), base.dtype)


def label_positions(
    path: str,
    name: str,
    values: np.ndarray,
    key: Any,
    method: str | None = None,
    tolerance: float | None = None,
) -> Any:
    """The positions in ``values`` that label ``key`` selects (pandas' rules: an exact value,
    a list of them, or a slice with both ends included, every ``step``-th: of a monotonic
    coordinate the values between its ends, of an unsorted one the positions from its first
    end's to its second's, which it must hold, see :func:`_slice_bounds`; values compared in
    a float coordinate's own dtype, so ``37.2`` is the float32 ``37.2`` of a float32
    coordinate). ``method="nearest"``: a value not in the coordinate takes the nearest (ties
    to the larger value), within ``tolerance`` if given. A value the coordinate repeats (a
    view that selected a position twice) selects every match, the axis kept; in a list it is
    a ``ValueError`` (pandas refuses it too). A boolean mask of the axis is returned as it is
    (positions, for :func:`axis_key`), as xarray's ``sel``. A longitude slice or ``nearest``
    value in the other convention than the coordinate's (-10 on 0..360) is refused
    (:func:`~insitubatch_nodes.io.longitudes.refuse_other_convention`)."""
    if method not in (None, "nearest"):
        raise ValueError(f"sel(method={method!r}): the methods are None (exact) and 'nearest'")
    _refuse_pointwise("sel", name, key)
    refuse_other_convention(path, name, values, key, method)
    listed = isinstance(key, list | tuple) or (hasattr(key, "__array__") and np.ndim(key) == 1)
    mask = np.asarray(key) if listed else None  # (an xarray DataArray mask too)
    if mask is not None and mask.ndim == 1 and mask.dtype.kind == "b":
        return key  # a boolean mask (``coord >= 500``) selects by position, as xarray's sel
    if isinstance(key, slice):
        if method is not None:
            raise ValueError(f"sel({name}={key!r}): method='nearest' takes values, not slices")
        step = key.step
        if step is not None and (not isinstance(step, int | np.integer) or step == 0):
            raise ValueError(f"sel({name}=...): a slice's step is a non-zero int, got {key!r}")
        backwards = step is not None and step < 0  # pandas: the ends swapped, values reversed
        ends = (key.stop, key.start) if backwards else (key.start, key.stop)
        start, stop = _slice_bounds(path, name, values, key, *ends)
        if stop <= start:
            if backwards:
                raise _nothing_backwards(path, name, values, key)
            raise _nothing(path, name, values, key)
        if backwards:
            assert step is not None
            return slice(stop - 1, start - 1 if start else None, int(step))
        return slice(start, stop, None if step is None else int(step))
    scalar = np.ndim(key) == 0
    if scalar and isinstance(key, str) and values.dtype.kind == "M" and method is None:
        period = _date_period(values, key)
        if period is not None:  # coarser than the dates (a day of 6-hourly times): all in it
            inside = np.flatnonzero((values >= period[0]) & (values <= period[1]))
            if not len(inside):
                raise KeyError(
                    f"{path}: no date of coordinate {name!r} lies in {key!r} ({shown(values)})"
                )
            return inside.tolist()
    wanted = np.atleast_1d(_in_dtype(values, key))
    out = []
    for given, v in zip(np.atleast_1d(np.asarray(key, dtype=object)).tolist(), wanted, strict=True):
        hits = np.flatnonzero(values == v)
        if not len(hits) and method is not None:
            hits = _nearest(path, name, values, v, tolerance)
        if not len(hits):
            near = "" if method is None else f", nor within tolerance={tolerance!r} of one"
            raise KeyError(
                f"{path}: {given!r} is not a value of coordinate {name!r}{near} "
                f"({shown(values)})" + (near and ": widen the tolerance, or leave it out")
            )
        if len(hits) > 1 and scalar:  # every match, the axis kept (pandas' get_loc)
            return hits.tolist()
        if len(hits) > 1:  # xarray refuses a list on repeated values
            raise ValueError(
                f"{path}: {given!r} is repeated in coordinate {name!r} (at positions "
                f"{hits.tolist()}), so a list of values is ambiguous: select by position with "
                f"isel({name}=[...]), or give the value alone (sel({name}={given!r}) keeps "
                "every match, as xarray)"
            )
        out.append(int(hits[0]))
    return out[0] if scalar else out


def _slice_bounds(
    path: str, name: str, values: np.ndarray, key: slice, first: Any, last: Any
) -> tuple[int, int]:
    """``[start, stop)``: the positions of ``values`` from label ``first`` to label ``last``,
    both included (``None``: the coordinate's end), as pandas' ``slice_locs`` (``key``, the
    slice as given, names them in errors). A monotonic coordinate: the values between the
    ends, in its order (ends it lacks included). An unsorted one: from the position of
    ``first`` to that of ``last``, which it must hold (``KeyError`` otherwise)."""
    ascending, descending = _monotonic(values)
    if values.dtype.kind == "M":  # a date string spans its period: the first end from its
        # start, the last to its end (in the coordinate's order; exact where it is unsorted),
        # as pandas' slice_locs
        first = _date_bound(values, first, upper=descending and not ascending)
        last = _date_bound(values, last, upper=ascending)
    first, last = _in_dtype(values, first), _in_dtype(values, last)
    n = len(values)
    if not (ascending or descending):
        start = 0 if first is None else _unsorted_bound(path, name, values, key, first, "start")
        stop = n if last is None else _unsorted_bound(path, name, values, key, last, "stop")
        return start, stop
    if ascending:
        start = 0 if first is None else int(np.searchsorted(values, first, side="left"))
        stop = n if last is None else int(np.searchsorted(values, last, side="right"))
        return start, stop
    rising = values[::-1]  # descending: the slice runs from high to low values
    start = 0 if first is None else n - int(np.searchsorted(rising, first, side="right"))
    stop = n if last is None else n - int(np.searchsorted(rising, last, side="left"))
    return start, stop


def _unsorted_bound(
    path: str, name: str, values: np.ndarray, key: slice, end: Any, side: str
) -> int:
    """Where a slice's ``end`` (its ``side``: ``"start"`` or ``"stop"``) lies in the unsorted
    ``values``: its position (the first of a run of it for a start, past the last for a
    stop), as pandas' ``get_slice_bound``. ``KeyError`` saying what to do where ``values``
    lack ``end`` or repeat it apart (pandas and xarray refuse both)."""
    hits = np.flatnonzero(values == end)
    listed = shown(values)
    if not len(hits):
        raise KeyError(
            f"{path}: sel({name}={key!r}): {end!r} is not a value of coordinate {name!r}, "
            f"which is not sorted ({listed}): a slice of an unsorted coordinate runs from the "
            "position of one of its values to that of another (xarray's rule), so both ends "
            f"must be values it holds; give values it holds, a list of values, or sort it "
            f"first (isel({name}=[...]) in the coordinate's order)"
        )
    if len(hits) > 1 and bool(np.any(np.diff(hits) != 1)):
        raise KeyError(
            f"{path}: sel({name}={key!r}): {end!r} is repeated apart in coordinate {name!r} "
            f"(at positions {hits.tolist()}), which is not sorted, so where the slice's {side} "
            f"lies is ambiguous (xarray refuses it too): give another value as its {side}, or "
            f"select by position with isel({name}=slice(i, j))"
        )
    return int(hits[0]) if side == "start" else int(hits[-1]) + 1


def _order(values: np.ndarray) -> str:
    ascending, descending = _monotonic(values)
    if ascending:
        return "ascending"
    return "descending" if descending else "not sorted"


def _nothing(path: str, name: str, values: np.ndarray, key: slice) -> IndexError:
    """The error of a slice ``key`` (a step of at least 1) that selects nothing, with what to
    do: the ends the other way round, or two views for a box across the longitudes' seam."""
    first, last = _in_dtype(values, key.start), _in_dtype(values, key.stop)
    order = _order(values)
    if order == "not sorted":  # both ends present, the stop before the start
        fix = (
            "a slice of an unsorted coordinate runs in its order, from the position of the "
            f"first end to that of the second; give the ends the other way round: "
            f"sel({name}={slice(key.stop, key.start, key.step)!r})"
        )
    elif first is None or last is None or (first <= last) == (order == "ascending"):
        fix = "no value of it lies between the slice's ends"
    elif name.lower().startswith("lon") and order == "ascending":
        fix = (
            f"a box from {first} east to {last} crosses the seam of the longitudes "
            "(the antimeridian, or 360/0), which is not supported: select the two "
            f"parts as two views, sel({name}=slice({key.start}, None)) and "
            f"sel({name}=slice(None, {key.stop})), or store the longitudes rolled so "
            "that the box is one run of them"
        )
    else:
        fix = "give the slice's ends in that order"
    return IndexError(
        f"{path}: sel({name}={key!r}) selects nothing; {name!r} is {order} "
        f"({values[0]} ... {values[-1]}): {fix}"
    )


def _nothing_backwards(path: str, name: str, values: np.ndarray, key: slice) -> IndexError:
    """The error of a negative-step slice ``key`` that selects nothing: it names ``key`` as
    given, and the slice to give where its ends are the other way round."""
    start, stop = _slice_bounds(path, name, values, key, key.start, key.stop)
    if stop <= start:
        fix = "no value of it lies between the slice's ends"
    else:
        other = slice(key.stop, key.start, key.step)
        fix = (
            f"a negative step takes the ends against the coordinate's order (values reversed): "
            f"sel({name}={other!r})"
        )
    return IndexError(
        f"{path}: sel({name}={key!r}) selects nothing; {name!r} is {_order(values)} "
        f"({values[0]} ... {values[-1]}): {fix}"
    )


def _monotonic(values: np.ndarray) -> tuple[bool, bool]:
    """Whether ``values`` never decrease, and whether they never increase (a NaN, or values
    that do not compare, is neither). Strings and dates are ordered as numbers are."""
    try:
        with np.errstate(invalid="ignore"):
            later, earlier = values[1:], values[:-1]
            return bool(np.all(later >= earlier)), bool(np.all(later <= earlier))
    except TypeError:
        return False, False


#: the units of numpy dates, finest first (a string's own unit is its precision)
_DATE_UNITS = ("ns", "us", "ms", "s", "m", "h", "D", "W", "M", "Y")
_DATE_STEPS = (("D", 86_400 * 10**9), ("h", 3_600 * 10**9), ("m", 60 * 10**9), ("s", 10**9),
               ("ms", 10**6), ("us", 10**3))  # fmt: skip


def date_resolution(values: np.ndarray) -> str:
    """The finest unit the dates ``values`` need (``"D"`` for dates at midnight, ``"h"`` for
    6-hourly ones, ...; at most a day), as pandas' ``DatetimeIndex.resolution``."""
    ns = values[~np.isnat(values)].astype("datetime64[ns]").astype(np.int64)
    return next((unit for unit, size in _DATE_STEPS if not np.any(ns % size)), "ns")


def _tick(unit: str) -> Any:
    """One ``unit`` (``"h"``, ``"M"``, ...) as a ``timedelta64``."""
    return np.array(1).astype(f"timedelta64[{unit}]")[()]


def date_strings(values: np.ndarray, of: np.ndarray | None = None) -> list[str]:
    """The dates ``values`` (or those ``of`` the coordinate ``values``) as ISO 8601, all to the
    precision the coordinate's dates need (``"2020-06-01T06"`` of 6-hourly dates)."""
    unit: Any = date_resolution(values)
    return [str(d) for d in np.datetime_as_string(values if of is None else of, unit=unit)]


def shown(values: np.ndarray) -> str:
    """The first values of a coordinate for a message (dates as ISO 8601, not integers)."""
    head = values[:8]
    if values.dtype.kind == "M":
        items: list[Any] = date_strings(values, head)
    elif values.dtype.kind == "m":  # as datetime.timedelta: "6:00:00", "1 day, 0:00:00"
        items = [str(v) for v in head.astype("timedelta64[us]").tolist()]
    else:
        items = head.tolist()
    return f"{items}{' ...' if len(values) > 8 else ''}"


def _as_date(key: Any) -> Any:
    """``key`` (an ISO string, a ``datetime``, a ``pd.Timestamp``) as a ``datetime64`` of its
    own precision; unchanged where it is no date."""
    if isinstance(key, _dt.datetime) and key.tzinfo is not None:
        key = key.astimezone(_dt.UTC).replace(tzinfo=None)
    if isinstance(key, str | _dt.date | np.datetime64):
        try:
            return np.datetime64(key.strip() if isinstance(key, str) else key)
        except ValueError:
            return key
    return key


def _date_period(values: np.ndarray, key: str) -> tuple[np.datetime64, np.datetime64] | None:
    """The first and last instant (in the dates' unit) of the period an ISO string less precise
    than the dates ``values`` names (``"2020-06-01"`` of 6-hourly times: the whole day), as
    pandas reads such a string; ``None`` for a string as precise as they are or more, or no
    date."""
    date = _as_date(key)
    if not isinstance(date, np.datetime64) or np.isnat(date):
        return None
    unit = np.datetime_data(date.dtype)[0]
    if _DATE_UNITS.index(unit) <= _DATE_UNITS.index(date_resolution(values)):
        return None
    tick = _tick(np.datetime_data(values.dtype)[0])
    end = (date + _tick(unit)).astype(values.dtype) - tick
    return date.astype(values.dtype), end


def _date_bound(values: np.ndarray, key: Any, *, upper: bool) -> Any:
    """A slice's end on the dates ``values``: a string from the first instant of the period it
    names (``upper``: to its last), as pandas' ``slice_locs``; other ends as they are."""
    if not isinstance(key, str):
        return key
    date = _as_date(key)
    if not isinstance(date, np.datetime64) or np.isnat(date):
        return key
    unit = np.datetime_data(date.dtype)[0]
    if not upper:
        return date.astype(values.dtype)
    tick = _tick(np.datetime_data(values.dtype)[0])
    return (date + _tick(unit)).astype(values.dtype) - tick


def _in_dtype(values: np.ndarray, key: Any) -> Any:
    """``key`` (a value or a list of them) in the dtype of a float coordinate ``values``, as
    pandas casts labels to its index's dtype; dates (ISO strings, ``datetime``) as
    ``datetime64`` for a date coordinate; unchanged otherwise (``None`` stays ``None``)."""
    if key is not None and values.dtype.kind == "M":
        if isinstance(key, list | tuple | np.ndarray):
            dates = [_as_date(k) for k in key]
            as_dates = all(isinstance(d, np.datetime64) for d in dates)
            return np.array(dates) if as_dates else key
        return _as_date(key)
    if key is not None and values.dtype.kind == "m":  # durations: "6h", pd.Timedelta, ...
        if isinstance(key, list | tuple | np.ndarray):
            return np.array([as_timedelta(k, "a value of a duration coordinate") for k in key])
        return as_timedelta(key, "a value of a duration coordinate")
    if key is None or values.dtype.kind != "f":
        return key
    wanted = np.asarray(key)
    if wanted.dtype.kind not in "iuf":
        return key
    with np.errstate(over="ignore"):
        return wanted.astype(values.dtype)


def _nearest(path: str, name: str, values: np.ndarray, v: Any, tolerance: float | None) -> Any:
    """The position of the value of ``values`` nearest ``v`` (ties: the larger value, as
    pandas), or none when it is farther than ``tolerance``."""
    if values.dtype.kind in "Mm":  # dates and durations: the distance in their own unit
        distance = np.abs((values - v).astype(np.int64)).astype(np.float64)
        if tolerance is not None:
            span = _tick(np.datetime_data(values.dtype)[0])
            tolerance = float(as_timedelta(tolerance, "a tolerance") / span)
    elif values.dtype.kind not in "iuf":
        raise TypeError(f"{path}: sel(method='nearest') needs a numeric coordinate {name!r}")
    elif tolerance is not None and not isinstance(tolerance, int | float | np.number):
        raise TypeError(f"{path}: sel(tolerance=...) is a number for {name!r}, got {tolerance!r}")
    else:
        distance = np.abs(values.astype(np.float64) - float(v))
    tied = np.flatnonzero(distance == np.nanmin(distance))
    best = int(tied[np.argmax(values[tied])])
    return [] if tolerance is not None and distance[best] > tolerance else [best]
