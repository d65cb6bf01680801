"""Stores as one timeline: where each store's samples sit on a joined time axis.

A :class:`~insitubatch_nodes.io.collection.Collection` made by ``concat`` lays stores that
continue one another end to end (:func:`continuation`: one step, no gap; an overlap kept from
the store ``overlap=`` names), and one made by ``join`` reads arrays of several stores at the
times they share (:func:`alignment`: one step, one grid, each store offset by whole chunks).
Both return each member's stored samples ``[start, stop)`` (its *span*), checked here from the
stores' time coordinates, refusing what does not fit with the stores and their times named;
the member map (:mod:`~insitubatch_nodes.io.members`) then reads whole chunks of those spans.
Stores whose times all run backwards (newest first) are checked on their times negated, so
both run back in time (:func:`_one_direction`: stores running both ways are refused).
A join one of whose stores is a concatenation (:func:`pieces_of_join`) is cut where the
concatenated stores meet: one member per piece, each piece's span per array.
"""

from __future__ import annotations

import datetime
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NoReturn

import numpy as np
from zarr.abc.store import Store

from insitubatch_nodes.errors import CoordinateLengthError
from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.axes import named_axes
from insitubatch_nodes.io.calendars import (
    calendar_months,
    month_step,
    one_calendar,
    refuse_missing_times,
)
from insitubatch_nodes.io.collection_checks import sample_axis_hint
from insitubatch_nodes.io.coords import (
    Coordinate,
    coordinate_reader,
    open_coordinates,
    time_offsets,
)
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import as_store

__all__ = ["alignment", "continuation", "pieces_of_join", "time_coordinate", "whole_seconds"]

#: why concat and join read each store's time coordinate (what their refusals say)
_WHY = {
    "concat": ("the stores are joined by their times, checked to continue at one step",
               "concat checks that the stores' times continue"),
    "join": ("the stores are aligned by their times", "join aligns the stores by time"),
}  # fmt: skip


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def whole_seconds(coord: Any, whose: str, compared_by: str, or_else: str = "") -> np.ndarray:
    """``coord``'s times as whole seconds since 1970, durations since 0 (what strides,
    time-delta windows, ``missing=`` dates and joins compare); a time off the whole second
    (float32 times) is refused naming it, ``whose`` coordinate it is and what to do
    (``or_else``, a way around)."""
    try:
        return time_offsets(coord, "1s")
    except ValueError as exc:
        found = str(exc).split(" is not a whole number")[0]
        raise ValueError(
            f"{compared_by} compare the times of {coord.name!r} ({whose}) in whole seconds, and "
            f"{found} is off the whole second (times stored as float32 lose precision: "
            "float32 'days since' keeps ~7 digits, ~0.1 ms of an hourly time on its reference "
            "date's first day, seconds years after it). Store the times as integers or float64"
            + (f", {or_else}" if or_else else "")
        ) from exc


def _along(geom: ArrayGeometry, dim: str, given: Sequence[str] | None) -> ArrayGeometry:
    """``geom`` sampled along its dimension ``dim`` (named by ``given``, a collection's
    ``dims``, or its own names), whichever axis that is: a ``(member, time, lat, lon)``
    ensemble is opened along axis 0 and continued or aligned along ``time``; ``geom`` as it
    is where no axis is named ``dim`` (what :func:`time_coordinate` then refuses)."""
    names = tuple(given) if given is not None else geom.dims
    if names is None or dim not in names or len(names) != geom.ndim:
        return geom
    return replace(geom, sample_axis=names.index(dim), dim_names=names)


def time_coordinate(
    store: Any,
    geom: ArrayGeometry,
    dim: str,
    given: Sequence[str] | None,
    *,
    op: str,
    name: str,
    variable: str,
    key: str,
    reader: Any = None,
) -> Coordinate:
    """The time coordinate ``dim`` beside store ``name``'s array ``variable`` (``geom``), which
    ``op`` (``"concat"`` or ``"join"``) reads each store by: the dimension coordinate
    :func:`~insitubatch_nodes.io.coords.open_coordinates` finds from the array's dimension
    names, ``given`` (the collection's ``dims[key]``, which win) or its own. ``ValueError``
    saying what to do where the array names no dimension and none are given, where the names
    are not one per axis, where it has no dimension ``dim`` (a static field), where no time
    coordinate ``dim`` is found, or where a time is missing. ``reader``: the coordinate
    reader of ``store`` to read it through (:func:`~insitubatch_nodes.io.coords.
    open_coordinates`'s)."""
    where = f"{op}: {name!r}'s {variable!r}"
    named = named_axes(where, given, geom.dims, geom.ndim)
    if named.dims is None:
        raise ValueError(
            f"{where} names no dimensions (zarr v2 written without _ARRAY_DIMENSIONS), so its "
            f"time coordinate {dim!r} cannot be found: name its {geom.ndim} axes, "
            f"{op}(..., dims={{{key!r}: [{dim!r}, ...]}}), or write each array's "
            "_ARRAY_DIMENSIONS attribute (as xarray does)"
        )
    if dim not in named.dims:  # (a land-sea mask beside the data: no time to align it by)
        hint = sample_axis_hint(variable, named.dims, [dim])
        raise ValueError(f"{where} has no {dim!r} dimension (it has {tuple(named.dims)}): {hint}")
    if given is not None:
        geom = replace(geom, dim_names=tuple(given))
    try:
        found = open_coordinates(
            store, _along(geom, dim, given), reader=reader
        )  # (anemoi's: `dates`)
        coord = next(iter(found.values()), None)
    except CoordinateLengthError as exc:  # (a store read mid-append: name the store)
        raise exc.while_doing(f"{where}: ") from None
    if coord is None:
        raise ValueError(
            f"{op}: {name!r} has no time coordinate {dim!r} beside {variable!r}: {_WHY[op][0]}"
        )
    if not coord.is_time:  # a frequency, a depth: numbers, not CF times
        units = coord.attrs.get("units")
        raise ValueError(
            f"{op}: {name!r}'s coordinate {dim!r} beside {variable!r} "
            f"({f'units {units!r}' if units else 'no units'}) is no CF time ('<unit> since "
            f"<date>'): {op} reads stores along time only ({_WHY[op][0]})"
            + (
                ". To read stores along another axis as one stream, each store one member "
                f"laid end to end (no window crosses from one to the next): "
                f"Collection.from_arrays([(store, {variable!r}), ...], sample_axis={dim!r})"
                if op == "concat"
                else ""
            )
        )
    refuse_missing_times(coord.values, f"{op}: {name!r}'s time", _WHY[op][1])
    return coord


def _in_months(
    values: Sequence[np.ndarray], ticks: list[np.ndarray]
) -> tuple[list[np.ndarray], str]:
    """``(ticks, unit)``: the stores' times as their checks count them. ``ticks`` (whole
    seconds) and ``"s"``, unless the dates step by whole calendar months of several lengths
    (monthly, seasonal, yearly means: :func:`~insitubatch_nodes.io.calendars.month_step` of a
    store) and every store of two times or more steps by one count of calendar months: then
    each date's months since January 1970 and ``"calendar month(s)"``, so that a month of 30
    days after one of 31 is one step, within a store and from one store to the next (before
    2026-12-07 such stores were refused as "not at one step")."""
    if all(month_step(v) is None for v in values):
        return ticks, "s"
    months = [calendar_months(v) for v in values]
    steps = [np.unique(np.diff(m)) for m in months]
    if any(len(d) > 1 or (len(d) and d[0] == 0) for d in steps):
        return ticks, "s"  # (a store at another step, a gap: refused in seconds, as before)
    return months, "calendar month(s)"


def _month_name(month: int) -> str:
    """``"YYYY-MM"``: the month ``month`` months after January 1970 (of any calendar)."""
    return f"{1970 + month // 12:04d}-{month % 12 + 1:02d}"


def _direction(op: str, name: str, ticks: np.ndarray, values: np.ndarray, unit: str) -> int:
    """``1`` where the times of store ``name`` increase at one step, ``-1`` where they
    decrease at one step (newest first), ``0`` for a store of one time (of a ``concat``: it
    says nothing of a step or a direction); refused otherwise (:func:`_refuse_irregular`)."""
    d = np.unique(np.diff(ticks))
    if len(d) == 1 and d[0] != 0:
        return 1 if d[0] > 0 else -1
    if not len(d) and op == "concat":
        return 0
    _refuse_irregular(op, name, ticks, values, unit)


def _one_direction(op: str, names: Sequence[str], ways: Sequence[int]) -> int:
    """``-1`` where the stores ``names`` run newest first (``ways``: each one's
    :func:`_direction`), ``1`` otherwise; stores running both ways are refused, naming one of
    each and what to do (before 2026-12-07 any store newest first was refused)."""
    up = next((n for n, w in zip(names, ways, strict=True) if w > 0), None)
    down = next((n for n, w in zip(names, ways, strict=True) if w < 0), None)
    if up is not None and down is not None:
        laid = "lays its stores along one timeline" if op == "concat" else "aligns its stores"
        raise ValueError(
            f"{op}: the times of {up!r} run forward (oldest first) and those of {down!r} "
            f"backwards (newest first): a {op} {laid} in one direction; write the stores in "
            "one order (xarray: ds.sortby('time'), or ds.sortby('time', ascending=False))"
        )
    return -1 if down is not None else 1


def _refuse_irregular(
    op: str, name: str, ticks: np.ndarray, values: np.ndarray, unit: str = "s"
) -> NoReturn:
    """Refuse the times of store ``name`` that are not at one step, naming where the step
    first changes (from the store's most common step, in the direction most of its times run:
    newest first too) and what to do (before 2026-12-07 times newest first were refused as
    such, and a store of one time repeated raised ``IndexError``)."""
    d = np.diff(ticks)
    if not len(d):
        raise ValueError(
            f"{op}: {name!r} holds {len(ticks)} time(s) of its dimension, so its step cannot "
            f"be told: the stores of a {op} need two times or more (leave it out)"
        )
    way = -1 if int((d < 0).sum()) > int((d > 0).sum()) else 1
    on = d * way
    steps, counts = np.unique(on[on > 0], return_counts=True)
    step = int(steps[int(np.argmax(counts))]) if len(steps) else 0
    bad = np.flatnonzero(on != step)
    i = int(bad[0]) + 1 if len(bad) else 1
    earlier = np.flatnonzero(ticks[:i] == ticks[i])
    what = (
        f"a copy of index {int(earlier[0])}'s: a repeated time; write the store without it, "
        "xarray: ds.drop_duplicates(...), or"
        if len(earlier)
        else "a gap, or an out-of-order time: fill or trim the times there, or"
    )
    raise ValueError(
        f"{op}: the times of {name!r} are not at one step: {values[i]} (index {i}) follows "
        f"{values[i - 1]} after {int(d[i - 1])} {unit}, where the store steps {way * step} {unit} "
        f"({what} read the store in a pipeline of its own, which drops the anchors whose steps "
        f"a gap or a later copy touches: missing steps). The stores of a {op} must be at one "
        "step"
    )


def continuation(
    store: Store,
    names: Sequence[str],
    paths: Mapping[str, Sequence[str]],
    dim: str,
    overlap: str,
    dims: Mapping[str, Sequence[str]],
    reader: Any = None,
) -> list[tuple[int, int]] | None:
    """Each member's stored samples ``[start, stop)`` that make one continuous axis of the
    times of ``dim`` (``None``: every member whole): the times continue from member to member at
    one step; where they overlap, ``overlap`` keeps the earlier (``"first"``) or the later
    (``"last"``) member's, skipping whole chunks only. ``ValueError`` names the members and the
    times otherwise. Stores whose times all run backwards (newest first, a store of one time
    either way) continue back in time: listed newest first, each store's earliest time one
    step after the next store's latest, the same checks made on the times negated (since
    2026-12-07; stores running both ways are refused, naming one of each). ``dims``
    (``{variable: names}``, checked) names the axes of variables whose arrays name none
    (:func:`time_coordinate`). ``reader`` (a :func:`~insitubatch_nodes.io.coords.
    coordinate_reader` of ``store``) reads the members' arrays, concurrently, and their times,
    and keeps them for the collection made of them."""
    first_var = next(iter(paths))
    align = 1
    ticks, values, ways = [], [], []
    heads = [p[0] for p in paths.values()]
    geoms = open_geometries(store, [*heads, *paths[first_var]], coords_reader=reader)
    # every member has the same chunks (checked when the collection is made)
    align = math.lcm(*(_along(geoms[p[0]], dim, dims.get(v)).samples_per_chunk
                       for v, p in paths.items()))  # fmt: skip
    for name, path in zip(names, paths[first_var], strict=True):
        given = dims.get(first_var)
        coord = time_coordinate(store, geoms[path], dim, given, op="concat", name=name,
                                variable=first_var, key=first_var, reader=reader)  # fmt: skip
        ticks.append(whole_seconds(coord, f"store {name!r}", "concat's continuity checks"))
        values.append(coord.values)
    one_calendar(names, values, "concat")
    ticks, unit = _in_months(values, ticks)
    ways = [_direction("concat", *given, unit) for given in zip(names, ticks, values, strict=True)]
    # newest first (every store): checked on the times negated, a step back in time one on
    way = _one_direction("concat", names, ways)
    ticks = [t * way for t in ticks]
    steps = [int(t[1] - t[0]) if len(t) > 1 else None for t in ticks]
    step = next((s for s in steps if s is not None), None)
    spans = [[0, len(t)] for t in ticks]
    for k, own in enumerate(steps):
        if own is not None and own != step:
            raise ValueError(
                f"concat: {names[k]!r} steps {way * own} {unit}, {names[0]!r} "
                f"{way * (step or 0)} {unit}: the stores must share one step"
            )
        if not k or step is None:
            continue
        a, b = spans[k - 1], spans[k]
        last, first = values[k - 1][a[1] - 1], values[k][b[0]]
        gap = int(ticks[k][b[0]] - ticks[k - 1][a[1] - 1])
        if gap == step:
            continue
        if ticks[k][b[0]] < ticks[k - 1][a[0]]:  # not an overlap: listed out of order
            raise ValueError(
                f"concat: {names[k]!r} starts at {first}, {'before' if way > 0 else 'after'} "
                f"{names[k - 1]!r} (from {values[k - 1][a[0]]}), which is listed before it: "
                + (
                    "give the stores in time order"
                    if way > 0
                    else "give the stores newest first, as their times run"
                )
            )
        what = "overlap" if gap <= 0 else "leave a gap"
        delta: Any = (
            np.timedelta64(way * step, "s")
            if isinstance(last, np.datetime64)
            else datetime.timedelta(seconds=way * step)
        )
        after = (
            last + delta
            if unit == "s"
            else f"a date in {_month_name(int(ticks[k - 1][a[1] - 1]) * way + way * step)}"
        )
        if gap > 0 or overlap == "error" or gap % step:
            hint = (
                ' (or give overlap="first" or "last" to say which store wins)'
                if gap <= 0 and not gap % step
                else ""
            )
            raise ValueError(
                f"concat: {names[k - 1]!r} ends at {last} and {names[k]!r} starts at {first}: "
                f"they {what} (at the step of {way * step} {unit}, {after} comes next){hint}"
            )
        shared = (step - gap) // step  # the steps both hold
        if overlap == "first":  # the later member skips them at its start
            b[0] += shared
            loser, cut = k, b[0]
        else:  # the earlier member drops them at its end
            a[1] -= shared
            loser, cut = k - 1, a[1]
        if b[0] >= b[1] or a[1] <= a[0]:
            raise ValueError(
                f"concat: {names[k]!r} ({values[k][0]} .. {values[k][-1]}) and "
                f"{names[k - 1]!r} ({values[k - 1][0]} .. {values[k - 1][-1]}): one holds "
                f"all of the other's times left after the overlap; leave it out"
            )
        if cut % align:
            raise ValueError(
                f"concat: {names[k - 1]!r} and {names[k]!r} overlap from "
                f"{first if way > 0 else last} to {last if way > 0 else first}, and "
                f"overlap={overlap!r} would cut {names[loser]!r} at its step {cut} "
                f"({values[loser][cut]}), inside a chunk of {align} steps: only whole chunks "
                "can be skipped; give the other overlap= or trim the stores"
            )
    if all(a == 0 and b == len(t) for (a, b), t in zip(spans, ticks, strict=True)):
        return None
    return [(a, b) for a, b in spans]


def alignment(
    store: Store,
    names: Sequence[str],
    roots: Sequence[str],
    arrays: Sequence[list[str]],
    dim: str,
    dims: Mapping[str, Sequence[str]],
    reader: Any = None,
) -> dict[str, list[tuple[int, int]]]:
    """Each joined array's stored samples ``[start, stop)`` on the stores' shared times (see
    ``Collection.join``), keyed by variable name (``"<name>/<path>"``, as ``dims`` is: the
    names of the axes of arrays that name none); ``ValueError`` naming the stores and their
    times where the stores do not align. ``reader``: as :func:`continuation` takes it."""
    ticks, values, spcs = [], [], []
    for name, variables in zip(names, arrays, strict=True):
        if not variables:
            raise ValueError(f"join: {name!r} names no array")
    every = [
        _join(root, v) for root, variables in zip(roots, arrays, strict=True) for v in variables
    ]
    geoms = open_geometries(store, every, coords_reader=reader)  # (one read of the root)
    for name, root, variables in zip(names, roots, arrays, strict=True):
        located = [_join(root, v) for v in variables]
        key = f"{name}/{variables[0].strip('/')}"
        coord = time_coordinate(store, geoms[located[0]], dim, dims.get(key), op="join",
                                name=name, variable=variables[0], key=key,
                                reader=reader)  # fmt: skip
        ticks.append(whole_seconds(coord, f"store {name!r}", "join's alignment checks"))
        values.append(coord.values)
        spcs.append([_along(geoms[p], dim, dims.get(f"{name}/{v.strip('/')}")).samples_per_chunk
                     for p, v in zip(located, variables, strict=True)])  # fmt: skip
    starts, n = _shared(names, ticks, values, spcs, dim)
    out: dict[str, list[tuple[int, int]]] = {}
    for store_name, variables, start in zip(names, arrays, starts, strict=True):
        for path in variables:
            out[f"{store_name}/{path.strip('/')}"] = [(start, start + n)]
    return out


def _shared(
    names: Sequence[str],
    ticks: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    spcs: Sequence[Sequence[int]],
    dim: str,
) -> tuple[list[int], int]:
    """``(starts, n)``: the joined axis is ``n`` shared steps, from each timeline's index
    ``starts[k]`` on, the first shared time at which every array (chunked ``spcs[k]`` along
    ``dim``) is at a chunk boundary; ``ValueError`` naming the timelines and their times where
    they do not align (another step, another grid, no shared time at a chunk boundary). Where
    every timeline runs backwards (newest first) the axis does too, from the latest shared
    time (since 2026-12-07); timelines running both ways are refused, naming one of each."""
    one_calendar(names, values, "join")
    ticks, unit = _in_months(values, list(ticks))
    ways = [_direction("join", *given, unit) for given in zip(names, ticks, values, strict=True)]
    # newest first (every store): aligned on the times negated, from the latest shared time
    way = _one_direction("join", names, ways)
    ticks = [t * way for t in ticks]
    steps = [np.unique(np.diff(t)) for t in ticks]
    step = int(steps[0][0])
    for k in range(1, len(names)):
        if int(steps[k][0]) != step:
            raise ValueError(
                f"join: {names[k]!r} steps {way * int(steps[k][0])} {unit}, {names[0]!r} "
                f"{way * step} {unit}: the stores must share one step (coarsen one first)"
            )
        if (ticks[k][0] - ticks[0][0]) % step:
            raise ValueError(
                f"join: {names[k]!r} starts at {values[k][0]} and {names[0]!r} at "
                f"{values[0][0]}: at the step of {step} {unit} their times are not on one grid"
            )
    first = max(int(t[0]) for t in ticks)
    last = min(int(t[-1]) for t in ticks)
    spans_of = ", ".join(f"{n!r} {v[0]} .. {v[-1]}" for n, v in zip(names, values, strict=True))
    if first > last:
        raise ValueError(f"join: the stores share no time ({spans_of})")
    offsets = [(first - int(t[0])) // step for t in ticks]  # each store's index of `first`
    period = math.lcm(*(c for per in spcs for c in per))
    skip = next(
        (
            j
            for j in range(period)
            if all((d + j) % c == 0 for d, per in zip(offsets, spcs, strict=True) for c in per)
        ),
        None,
    )
    n = (last - first) // step + 1 - (skip or 0)
    if skip is None or n <= 0:
        raise ValueError(
            f"join: the stores share the times from {_time_at(values, ticks, first)} to "
            f"{_time_at(values, ticks, last)} ({spans_of}), but no shared time in it is at a "
            f"chunk boundary of every array (their chunks along {dim!r}: "
            f"{dict(zip(names, spcs, strict=True))}): each array is read by whole chunks; "
            "rechunk one store so that its chunks start on the other's"
        )
    return [d + skip for d in offsets], n


def pieces_of_join(
    entries: Sequence[tuple[str, Any, Sequence[str]]], dim: str, dims: Mapping[str, Sequence[str]]
) -> tuple[list[str], dict[str, list[tuple[Any, str, int, int]]], list[Any]]:
    """A join one of whose stores is a concatenation (``Collection.concat``, or any
    continuous collection): ``entries`` are ``(name, store or collection, [array paths])``.
    The joined axis is cut where a concatenation's store ends, so each *piece* reads one store
    of every entry: returns the pieces' names and, per variable ``"<name>/<path>"``, each
    piece's ``(store, path, start, stop)`` (its stored samples; a store given as a path or URL
    opened once, here), and each entry's coordinate reader, holding what was read of it (a
    concatenation's own, which read its times; a store's, made here): what the join's reader
    takes over (:func:`~insitubatch_nodes.io.join_reads.join_reader`). Every cut must fall on
    a chunk boundary of every array (``ValueError`` naming the time and the array otherwise).
    ``dims`` names the axes of arrays that name none, by variable (a concatenation's views
    carry its own)."""
    from insitubatch_nodes.io.routing import RoutingStore  # (routing needs no timeline)

    ticks, values, spcs, cuts, readers = [], [], [], [], []
    located: list[list[list[tuple[Any, str, int, int]]]] = []  # [entry][variable][member]
    for name, source, variables in entries:
        if not variables:
            raise ValueError(f"join: {name!r} names no array")
        if hasattr(source, "continuous"):  # a collection
            unknown = [v for v in variables if v not in source.variables]
            if unknown or not source.continuous:
                raise ValueError(
                    f"join: {name!r} is a collection; a join takes a concatenation (concat) "
                    f"and arrays of its variables {list(source.variables)}, not {unknown}"
                )
            geoms = [source[v] for v in variables]
            base = geoms[0].members.sample_base
            cuts.append(base[1:])
            per_var = []
            for g in geoms:
                mm = g.members
                rows = []
                for path, a, n in zip(mm.paths, mm.starts, mm.lengths, strict=True):
                    store: Any = source.store
                    if isinstance(store, RoutingStore):
                        head, _, path = path.partition("/")
                        store = store.stores[int(head[1:])]
                    rows.append((store, path, int(a), int(a) + int(n)))
                per_var.append(rows)
            located.append(per_var)
            timeline, reader = source.store, source.reader  # (its views read the stores by it)
        else:
            timeline = as_store(source)  # (opened once: the join's routing store takes it)
            reader = coordinate_reader(timeline)
            geoms_by = open_geometries(timeline, list(variables), coords_reader=reader)
            geoms = [geoms_by[v] for v in variables]
            cuts.append(np.zeros(0, dtype=np.int64))
            located.append(
                [[(timeline, v, 0, g.n_samples)] for v, g in zip(variables, geoms, strict=True)]
            )
        readers.append(reader)
        key = f"{name}/{variables[0].strip('/')}"
        # (a concatenation's times through the reader it was made with: not read again)
        coord = time_coordinate(timeline, geoms[0], dim, dims.get(key), op="join", name=name,
                                variable=variables[0], key=key, reader=reader)  # fmt: skip
        ticks.append(whole_seconds(coord, f"store {name!r}", "join's alignment checks"))
        values.append(coord.values)
        spcs.append([g.samples_per_chunk for g in geoms])
    names = [e[0] for e in entries]
    starts, n = _shared(names, ticks, values, spcs, dim)
    bounds = sorted({0, n, *(int(c) - s for c, s in _cuts(cuts, starts) if 0 < int(c) - s < n)})
    piece_names: list[str] = []
    out: dict[str, list[tuple[Any, str, int, int]]] = {}
    for lo, hi in itertools.pairwise(bounds):
        parts = []
        for (name, source, variables), start, per_var, per_spc in zip(
            entries, starts, located, spcs, strict=True
        ):
            at = start + lo  # the entry's own index of the piece's first step
            for v, rows, spc in zip(variables, per_var, per_spc, strict=True):
                m = _member_at(rows, at)
                store, path, a, _ = rows[m]
                offset = at - sum(r[3] - r[2] for r in rows[:m])
                begin = a + offset
                if begin % spc or (hi < n and (hi - lo) % spc):
                    seam = values[0][starts[0] + (lo if begin % spc else hi)]
                    raise ValueError(
                        f"join: the concatenation's stores meet at {seam}, inside a chunk of "
                        f"{spc} steps of {name!r}'s {v!r}: each array is "
                        "read by whole chunks, so every store boundary of a concatenation must "
                        "fall on a chunk boundary of every joined array (rechunk, or trim)"
                    )
                out.setdefault(f"{name}/{v.strip('/')}", []).append(
                    (store, path, begin, begin + hi - lo)
                )
            if hasattr(source, "continuous"):
                parts.append(str(source.members[_member_at(per_var[0], at)]))
        piece_names.append(" + ".join(parts))
    return piece_names, out, readers


def _cuts(cuts: Sequence[np.ndarray], starts: Sequence[int]) -> list[tuple[int, int]]:
    return [(int(c), s) for per, s in zip(cuts, starts, strict=True) for c in per]


def _member_at(rows: Sequence[tuple[Any, str, int, int]], at: int) -> int:
    """The member of a concatenation (its rows' kept spans, in order) holding its index ``at``."""
    ends = np.cumsum([r[3] - r[2] for r in rows])
    return int(np.searchsorted(ends, at, side="right"))


def _time_at(values: Sequence[np.ndarray], ticks: Sequence[np.ndarray], tick: int) -> Any:
    """The date at ``tick`` (seconds) in the first store that holds it."""
    for v, t in zip(values, ticks, strict=True):
        hit = np.flatnonzero(t == tick)
        if len(hit):
            return v[int(hit[0])]
    return tick
