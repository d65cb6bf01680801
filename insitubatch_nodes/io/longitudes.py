"""Longitude conventions: a box or a point given in the other convention than the coordinate's.

Longitudes are stored from 0 to 360 (ERA5, WeatherBench2, ARCO-ERA5) or from -180 to 180 (many
regional and station archives). A longitude of one convention is a valid number on a coordinate
of the other, and ``sel`` takes labels as numbers, as xarray's does, not as places on the
circle: on 0..360, ``sel(longitude=slice(-10, 30))`` keeps 0..30 (the part of the box west of
0 is lost without a word), and ``sel(longitude=-3.2, method="nearest")`` takes 0, not the point
at 356.75 beside the station. :func:`refuse_other_convention` refuses such a slice or
``nearest`` value instead, saying what it is in the coordinate's own convention, wherever
taking it by number selects other points than taking it as a place (a box whose part across
the seam holds no grid point is xarray's selection either way, and is taken).

The convention of a coordinate is read from its values, and only where they say it: an
ascending numeric coordinate whose dimension is named ``lon...`` that holds values past 180
(0..360) or below 0 (-180..180). A regional box stored from 10 to 60 is in both, and keys on it
are taken as xarray takes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["refuse_other_convention", "same_longitudes", "same_points"]


def same_longitudes(values: Any, ref: Any) -> np.ndarray:
    """Per row of ``values`` and ``ref`` (longitudes in degrees, of one shape), whether every
    point is the same place as its match beyond float32 rounding, whatever the convention of
    each (202.5 is -157.5): compared along the last axis, the differences taken modulo 360."""
    turn = (np.asarray(values, np.float64) - np.asarray(ref, np.float64) + 180.0) % 360.0 - 180.0
    scale = np.maximum(np.abs(np.asarray(ref, np.float64)), 1.0)
    return np.all(np.abs(turn) <= 1e-6 * scale + 1e-6, axis=-1)


def same_points(values: Any, ref: Any, *, longitude: bool) -> np.ndarray:
    """Per row of ``values`` and ``ref`` (coordinates of one shape), whether every point is its
    match beyond float32 rounding, compared along the last axis: longitudes (``longitude``) as
    places (:func:`same_longitudes`), other coordinates by value."""
    if longitude:
        return same_longitudes(values, ref)
    return np.all(np.isclose(values, ref, rtol=1e-6, atol=1e-6), axis=-1)


def _convention(name: str, values: np.ndarray) -> tuple[float, float] | None:
    """``(0, 360)`` or ``(-180, 180)``: the convention longitudes ``values`` (of dimension
    ``name``) are in; ``None`` where that is not a longitude, or its values fit both."""
    if not name.lower().startswith("lon") or values.dtype.kind not in "iuf" or not len(values):
        return None
    with np.errstate(invalid="ignore"):
        if not bool(np.all(values[1:] >= values[:-1])):
            return None
        low, high = float(values[0]), float(values[-1])
    if low >= 0.0 and 180.0 < high <= 360.0:
        return (0.0, 360.0)
    if -180.0 <= low < 0.0 and high <= 180.0:
        return (-180.0, 180.0)
    return None


def _other(end: Any, convention: tuple[float, float]) -> bool:
    """Whether ``end`` (a number) is a longitude of the other convention than ``convention``."""
    if end is None or isinstance(end, bool) or not isinstance(end, int | float | np.number):
        return False
    v = float(end)
    return -180.0 <= v < 0.0 if convention[0] == 0.0 else 180.0 < v <= 360.0


def _mine(end: Any, convention: tuple[float, float]) -> Any:
    """``end`` (a number) in ``convention``: unchanged where it lies in its range, else turned
    by 360 degrees into it."""
    v = float(end)
    if convention[0] <= v <= convention[1]:
        return end
    v = v % 360.0 if convention[0] == 0.0 else (v + 180.0) % 360.0 - 180.0
    return int(v) if v.is_integer() else v


def _seam_parts(
    values: np.ndarray, key: slice, convention: tuple[float, float]
) -> tuple[Any, Any, np.ndarray]:
    """The box of slice ``key`` in ``convention``: its west and east ends there (``None``:
    the whole circle) and which ``values`` it holds, taken as places on the circle (an open end
    is the other convention's end, as the slice's giver counts)."""
    backwards = key.step is not None and key.step < 0
    west, east = (key.stop, key.start) if backwards else (key.start, key.stop)
    low, high = (-180, 180) if convention[0] == 0.0 else (0, 360)
    west, east = low if west is None else west, high if east is None else east  # (theirs)
    if float(east) - float(west) >= 360.0:
        return None, None, np.ones(len(values), bool)
    west, east = _mine(west, convention), _mine(east, convention)
    if west <= east:
        return west, east, (values >= west) & (values <= east)
    return west, east, (values >= west) | (values <= east)


def _nearest_place(values: np.ndarray, v: float) -> int:
    """The position of the longitude of ``values`` nearest ``v`` on the circle."""
    turn = np.abs(values.astype(np.float64) - v) % 360.0
    return int(np.argmin(np.minimum(turn, 360.0 - turn)))


def refuse_other_convention(
    path: str, name: str, values: np.ndarray, key: Any, method: str | None
) -> None:
    """Refuse ``sel(name=key, method=method)`` on longitudes ``values`` (of the array at
    ``path``) where a slice's end, or a value taken by ``method="nearest"``, is in the other
    convention than the coordinate's (module docstring) and taking it by number would select
    other points than taking it as a place: ``IndexError`` for a slice, saying which box it is
    here (or that it crosses this coordinate's seam, and which two views select its two
    parts), ``KeyError`` for values, giving them in this convention. Keys in the coordinate's
    convention, keys whose points are the same either way (a box whose part across the seam
    holds no grid point), exact values (absent ones are a ``KeyError`` anyway) and
    coordinates of no clear convention pass."""
    convention = _convention(name, values)
    if convention is None:
        return
    other = "-180..180" if convention[0] == 0.0 else "0..360"
    runs = (
        f"{name!r} runs from {convention[0]:g} to {convention[1]:g} ({values[0]} ... {values[-1]})"
    )
    if isinstance(key, slice):
        ends = [e for e in (key.start, key.stop) if _other(e, convention)]
        if not ends:
            return
        west, east, by_place = _seam_parts(values, key, convention)
        backwards = key.step is not None and key.step < 0
        ends_n = (key.stop, key.start) if backwards else (key.start, key.stop)
        lo = -np.inf if ends_n[0] is None else float(ends_n[0])  # by number, as xarray
        hi = np.inf if ends_n[1] is None else float(ends_n[1])
        if np.array_equal(by_place, (values >= lo) & (values <= hi)):
            return  # the same points either way (the part across the seam holds none)
        if west is None:
            fix = f"it spans the whole circle: leave {name!r} out to keep every longitude"
        elif west > east:
            fix = (
                f"here the box runs from {west} east to {east}, across the seam of this "
                f"coordinate ({convention[1]:g}/{convention[0]:g}), which one view cannot "
                f"select: select the two parts as two views, sel({name}=slice({west}, None)) "
                f"and sel({name}=slice(None, {east})), or store the longitudes rolled"
            )
        else:
            mine = slice(east, west, key.step) if backwards else slice(west, east, key.step)
            fix = f"give it in this convention: sel({name}={mine!r})"
        raise IndexError(
            f"{path}: sel({name}={key!r}) gives {', '.join(map(str, ends))} in the {other} "
            f"convention, and {runs}: the slice would be taken by number, not by place "
            f"(xarray keeps only the part of the box inside {values[0]} ... {values[-1]}); "
            f"{fix}"
        )
    if method is None:
        return
    given = np.atleast_1d(np.asarray(key, dtype=object)).tolist()
    numbers = values.astype(np.float64)
    moved = []
    for v in given:
        if _other(v, convention):
            distance = np.abs(numbers - float(v))  # by number (xarray's nearest, ties included)
            if distance[_nearest_place(values, float(v))] > distance.min():
                moved.append(v)
    if moved:
        turned = [_mine(v, convention) if _other(v, convention) else v for v in given]
        points: Any = turned[0] if np.ndim(key) == 0 else turned
        raise KeyError(
            f"{path}: sel({name}={key!r}, method={method!r}) gives longitudes in the {other} "
            f"convention ({', '.join(map(str, moved))}), and {runs}: the nearest value would "
            "be taken by number, not by place (xarray's rule: the grid point nearest the "
            "number, at the coordinate's end, not the one nearest the place); give them in "
            f"this convention: sel({name}={points!r}, method={method!r})"
        )
