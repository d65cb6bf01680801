"""The anchor array's samples as the plan's anchor rules see them: each sample's time, the
samples ``missing=`` lists and those with an absent stored object
(:class:`~insitubatch_nodes.plan.anchors.SampleSteps`), read for :func:`insitu_pipeline`'s
time stride, windows in time deltas and missing-step checks.

A collection's independent members (scenes, slides) are each their own timeline: the data's
step is taken within members only (``SampleSteps.runs``), never from the time between two
members, and a window in time deltas is refused when no member holds two times.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from zarr.abc.store import Store

from insitubatch_nodes.errors import CoordinateLengthError
from insitubatch_nodes.io.anemoi import recorded_missing
from insitubatch_nodes.io.arrays import absent_samples, open_geometries
from insitubatch_nodes.io.calendars import MONTH_STEPS_NEAR_S, calendar_months, counts_us
from insitubatch_nodes.io.coords import MISSING_OFFSET, Coordinate, open_coordinates, time_offsets
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.members import MemberMap
from insitubatch_nodes.io.timeline import whole_seconds
from insitubatch_nodes.plan.anchors import SampleSteps
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.splits import SplitManifest

__all__ = [
    "anchor_steps",
    "anchor_time_coordinate",
    "calendar_ticks",
    "forward_ticks",
    "repeated_times",
]

_DAY_S = 86_400
_MONTH_S = 30.436875 * _DAY_S  # (the Gregorian calendar's mean month)
#: the unit of ticks counted in calendar months
MONTH: np.timedelta64 = np.timedelta64(1, "M")
#: the unit of ticks counted in seconds
SECOND: np.timedelta64 = np.timedelta64(1, "s")


def anchor_steps(
    zstore: Store,
    manifest: SplitManifest,
    geoms: Mapping[str, ArrayGeometry],
    config: PlanConfig,
    missing: Sequence[Any] | None,
    missing_objects: str,
    reader: Any = None,
    views: Iterable[ArrayGeometry] = (),
) -> SplitManifest:
    """``manifest`` carrying the :class:`SampleSteps` the plan needs for a time stride,
    windows in time deltas and the missing-step checks (unchanged when none is asked for): the
    anchor array's times, the samples ``missing`` lists, the samples with an absent stored
    object. A manifest that already carries steps (``manifest.with_steps``) is kept when only
    a stride or time-delta windows are asked for. On a collection of independent members
    (``manifest.members``, attached first) each member is a run of its own
    (``SampleSteps.runs``), and windows in time deltas (``views``) are refused, naming the
    collection, when no member holds two times. Times that run backwards (newest first) are
    counted negated (``SampleSteps.backwards``: a step back in time is one sample on), a
    collection's independent members' too, all newest first (``MemberMap.joined`` refuses
    members whose times run in different directions, naming two, where it reads them). The
    dates anemoi-datasets lists in the anchor array's group (``missing_dates``:
    :func:`~insitubatch_nodes.io.anemoi.recorded_missing`) are missing as if ``missing`` listed
    them; those of a collection member's store (an independent member, a store joined by
    ``concat``) are that member's own, matched among its own samples only."""
    if missing_objects not in ("read", "drop"):
        raise ValueError(f"missing_objects must be 'read' or 'drop', got {missing_objects!r}")
    if isinstance(missing, str | bytes) or (
        missing is not None and not isinstance(missing, Sequence | np.ndarray)
    ):
        raise TypeError(f"missing must be None or a sequence of indices or times, got {missing!r}")
    # anemoi's: no data at those dates (of a single array; of each member, `own`)
    recorded, own = recorded_missing(zstore, manifest.members, geoms.values())
    if recorded:
        missing = [*(missing if missing is not None else ()), *recorded]
    elif own and missing is None:  # (the times checked, as for a single store's)
        missing = []
    windowed = any(v.timed_window for v in views)
    timed = not isinstance(config.stride, int) or windowed
    if missing is None and not timed and manifest.steps is None:
        _warn_from_times(manifest, geoms, reader)  # (no time checked: every copy is read)
    if missing is None and missing_objects == "read" and (not timed or manifest.steps is not None):
        return manifest  # nothing asked, or steps the caller attached (manifest.with_steps)
    n = manifest.n_samples
    indices = [] if missing is None else [x for x in missing if _is_index(x)]
    dates = [] if missing is None else [x for x in missing if not _is_index(x)]
    ticks, coord_name, coord = None, "time", None
    if timed or missing is not None:
        dated = timed or bool(dates) or bool(own)
        coord = anchor_time_coordinate(zstore, manifest, geoms, reader, needed=dated)
        if coord is not None and dated:
            ticks = whole_seconds(
                coord,
                f"{manifest.array!r}'s time coordinate",
                "a time stride, window offsets in time deltas and dates in missing=",
                "or give an int stride, window offsets in samples and sample indices in missing=",
            )
        elif coord is not None:  # sample indices only: missing= still checks the times
            ticks = whole_seconds(
                coord,
                f"{manifest.array!r}'s time coordinate",
                "missing= checks the times (for gaps and missing times, whatever it lists) and "
                "these checks",
                "or leave missing= out (then nothing checks the times)",
            )
            coord_name = coord.name
    listed = np.zeros(n, dtype=bool)
    for i in indices:
        if not -n <= int(i) < n:
            raise ValueError(
                f"missing lists sample {int(i)}, outside [-{n}, {n}) (indices of the {n} "
                "samples; a negative one counts from the end, as numpy's)"
            )
        listed[int(i)] = True
    members, runs = manifest.members, None
    if members is not None and not (members.continuous or members.product) and ticks is not None:
        runs = members.sample_base  # independent members: no difference across their edges
    counted, unit = ticks, SECOND  # (the checks' ticks: calendar months of monthly dates)
    backwards = ticks is not None and _backwards(ticks, runs)
    if ticks is not None and coord is not None:
        if backwards:  # newest first: counted negated, a step back in time one step on
            _warn_split_backwards(manifest, coord, stacklevel=4)
        counted, unit = _counted_ticks(coord, ticks, backwards)
    if dates:  # matched to the times to the second, whatever the checks count in
        assert ticks is not None and counted is not None and coord is not None
        gone = time_offsets(coord.dates(dates, "a date in missing"), "1s")
        step = SampleSteps(n, ticks=counted, runs=runs).data_step
        _refuse_dates_between_steps(dates, gone, ticks, coord, counted, step)
        listed |= np.isin(ticks, gone) & (ticks != MISSING_OFFSET)
    if own:  # each member's own dates, within its own samples (a concatenation's too)
        assert ticks is not None and coord is not None and members is not None
        listed |= _members_dates(own, members, coord, ticks)
    absent = absent_samples(zstore, geoms) if missing_objects == "drop" else None
    # messages name the store's coordinate; the fingerprint keeps the name hashed before
    # 2026-12-07 ("time" where the times were read for a stride, windows or dates)
    hashed = coord_name
    coord_name = coord.name if coord is not None else coord_name
    steps = SampleSteps(
        n,
        ticks=counted,
        unit=unit,
        listed=listed if missing is not None else None,
        absent=absent,
        coord=coord_name,
        runs=runs,
        hashed_coord=hashed if hashed != coord_name else None,
        backwards=backwards,
        recorded=len(recorded) + sum(len(d) for d in own.values()),
    )
    if members is not None and runs is not None and windowed and steps.data_step is None:
        raise ValueError(
            f"{members.collection}: no member of its {len(members)} holds two times of "
            f"{coord_name!r}, so the data's step cannot be told (the time between two members "
            "is not a step of either): give the window offsets in samples"
        )
    return manifest.with_steps(steps)


def _members_dates(
    own: Mapping[int, Sequence[np.datetime64]],
    members: MemberMap,
    coord: Coordinate,
    ticks: np.ndarray,
) -> np.ndarray:
    """The samples at the dates each collection member's own store lists as missing
    (``own``: ``{member index: dates}``), each matched to the second among its member's
    samples only (``ticks``: the collection's times, whole seconds)."""
    out = np.zeros(len(ticks), dtype=bool)
    for m, dates in own.items():
        gone = time_offsets(coord.dates(dates, "a date in missing_dates"), "1s")
        lo = int(members.sample_base[m])
        mine = ticks[lo : lo + int(members.lengths[m])]
        out[lo : lo + len(mine)] = np.isin(mine, gone) & (mine != MISSING_OFFSET)
    return out


def calendar_ticks(coord: Coordinate, ticks: np.ndarray) -> tuple[np.ndarray, Any]:
    """``(ticks, unit)``: the samples' times as the missing-step checks count them. ``ticks``
    (whole seconds, :data:`MISSING_OFFSET` for a missing time) and ``SECOND``, unless the
    dates step by whole calendar months of several lengths: their most common step is about
    ``k`` months (``k`` >= 1: monthly, seasonal, yearly means), the steps within 3 days of it
    are not all one length, and every one of them is ``k`` months of the calendar. Then each
    sample's count of months since January 1970 and ``np.timedelta64(1, "M")``: a month of 30
    days after one of 31, or a leap year, is one step, not a gap, and a step is missing only
    where a month (season, year) is. Times one fixed length apart (a ``360_day`` calendar's
    months, a ``noleap`` one's years, days) keep their seconds."""
    if not coord.is_time:  # (durations: counted from 0, no calendar)
        return ticks, SECOND
    present = np.flatnonzero(ticks != MISSING_OFFSET)
    d = np.diff(ticks[present])
    if not (d > 0).any():
        return ticks, SECOND
    values, counts = np.unique(d[d > 0], return_counts=True)
    step = int(values[int(np.argmax(counts))])
    k = round(step / _MONTH_S)
    near = np.abs(d - step) <= MONTH_STEPS_NEAR_S
    if k < 1 or (d[near] == step).all():
        return ticks, SECOND
    months = calendar_months(coord.values)
    if (np.diff(months[present])[near] == k).all():
        return months, MONTH
    return ticks, SECOND


def repeated_times(
    coord: Coordinate, ticks: np.ndarray, members: MemberMap | None = None
) -> str | None:
    """Where the times of ``coord`` (``ticks``: counts of any one unit) repeat — a later copy
    of a time an earlier sample has, as ``SampleSteps.repeated`` finds them — said with what
    to do; ``None`` where each time is once. ``members`` (a collection's member map, its
    members independent): a time repeats within one member only, and the samples are named
    as their member's."""
    runs = _independent_runs(members)
    again = SampleSteps(len(ticks), ticks=ticks, runs=runs).repeated
    if again is None or not again.any():
        return None
    at = int(np.argmax(again))
    copies = np.flatnonzero(ticks == ticks[at])
    if runs is not None:
        copies = copies[
            np.searchsorted(runs, copies, side="right") == np.searchsorted(runs, at, side="right")
        ]
    first = int(copies[0])
    whose = f"{coord.name!r}"
    later, earlier = f"sample {at}", f"sample {first}"
    if runs is not None and members is not None:
        m = int(members.member_of(np.array([at]))[0])
        base = int(members.sample_base[m])
        whose = f"{coord.name!r} in member {members.names[m]!r} of {members.collection}"
        later, earlier = f"its sample {at - base}", f"its sample {first - base}"
    return (
        f"the times of {whose} repeat ({later} has {coord.values[at]} as {earlier} does; "
        f"{int(again.sum())} repeated in all): every copy is read where the times "
        "are not checked; pass missing=() to count each time once (a later copy is then "
        "dropped as a gap; list the copies not to read in missing= to keep others), or "
        f"write the store without them (xarray: ds.drop_duplicates({coord.name!r}))"
    )


def _independent_runs(members: MemberMap | None) -> np.ndarray | None:
    """Each independent member's first virtual sample (``SampleSteps.runs``), or ``None``
    for one timeline (a single array; stores continuing one another)."""
    if members is None or members.continuous or members.product:
        return None
    return members.sample_base


def _exact_ticks(coord: Coordinate) -> np.ndarray:
    """The dates of ``coord`` as ``int64`` counts to compare (``datetime64``: their own
    ticks; cftime dates: microseconds in their calendar, one pass in Python), a missing one
    :data:`MISSING_OFFSET`: equal counts are equal dates, and larger ones later."""
    v = coord.values
    if v.dtype.kind == "M":
        return v.view(np.int64)  # (NaT: MISSING_OFFSET)
    present = np.array([x is not None for x in v.tolist()], dtype=bool)
    out = np.full(len(v), MISSING_OFFSET, dtype=np.int64)
    out[present] = counts_us(v[present])
    return out


def _warn_from_times(
    manifest: SplitManifest, geoms: Mapping[str, ArrayGeometry], reader: Any
) -> None:
    """Warn, where the plan checks no time, from the times ``reader`` read already for the
    batches' coordinates (nothing is read here): where the anchor array's times repeat (every
    copy is then an anchor, by index), and where they run backwards (newest first) while the
    manifest's contiguous splits follow the index order, so that ``train`` holds the newest
    times and ``test`` the oldest. ``datetime64`` dates: vectorised (~20 ms a million);
    cftime dates: passes in Python (0.19-0.29 s for 200,000 ``noleap`` dates, measured on
    the shared 2-core machine, where their decoding took 1.16 s)."""
    geom = geoms.get(manifest.array)
    coord = None if geom is None or reader is None else reader.read_already(geom)
    if coord is None or not coord.is_time or len(coord) != manifest.n_samples:
        return
    ticks = _exact_ticks(coord)
    said = repeated_times(coord, ticks, manifest.members)
    if said is not None:
        warnings.warn(f"insitu_pipeline: {said}", UserWarning, stacklevel=4)
    if _backwards(ticks, _independent_runs(manifest.members)):
        _warn_split_backwards(manifest, coord, stacklevel=5)


def _warn_split_backwards(manifest: SplitManifest, coord: Coordinate, stacklevel: int) -> None:
    """Warn that the times of ``coord`` run backwards (newest first) while ``manifest``'s
    contiguous splits follow the index order: ``train`` then holds the newest times and
    ``test`` (or ``val``) the oldest (``split_by_chunk(..., coord=)`` splits in time order)."""
    train = manifest.chunk_array("train")
    if not manifest.contiguous or not len(train) or manifest.members is not None:
        return
    later = next((name for name in ("test", "val") if len(manifest.chunk_array(name))
                  and int(train[-1]) < int(manifest.chunk_array(name)[0])), None)  # fmt: skip
    if later is None:
        return
    warnings.warn(
        f"insitu_pipeline: the times of {coord.name!r} run backwards (newest first: "
        f"{coord.values[0]} at sample 0), and the manifest's contiguous splits follow the "
        f"sample order: 'train' holds the times after those of {later!r} (a model trained "
        "on the future of its own evaluation). Split in time order, train the earliest: "
        "split_by_chunk(geom, fractions, coord=open_coordinates(store, geom)"
        f"[{coord.name!r}])",
        UserWarning,
        stacklevel=stacklevel,
    )


def forward_ticks(coord: Coordinate, seconds: np.ndarray) -> np.ndarray:
    """``calendar_ticks(coord, seconds)[0]`` counted forward along the samples: where the times
    run backwards (newest first), each negated (a missing time stays :data:`MISSING_OFFSET`),
    so that a step back in time from one sample to the next is one step on (what pairs
    samples one step apart whichever way the store runs: ``fit_statistics``' ``diff_std``)."""
    return _counted_ticks(coord, seconds, _backwards(seconds, None))[0]


def _counted_ticks(
    coord: Coordinate, seconds: np.ndarray, backwards: bool
) -> tuple[np.ndarray, Any]:
    """:func:`calendar_ticks` of ``coord``, each negated where the times run ``backwards``
    (a missing time stays :data:`MISSING_OFFSET`): the months are counted oldest first, then
    each sample's own count negated (the one place both the plan's checks and ``diff_std``
    take them from: before 2026-12-07 the plan's masked the missing times in the flipped
    order, and a missing time at sample ``k`` dropped sample ``n - 1 - k`` too)."""
    if not backwards:
        return calendar_ticks(coord, seconds)
    flipped = Coordinate(coord.name, coord.values[::-1])  # (months counted oldest first)
    ticks, unit = calendar_ticks(flipped, seconds[::-1])
    ticks = ticks[::-1]
    return np.where(ticks == MISSING_OFFSET, MISSING_OFFSET, -ticks), unit


def _backwards(ticks: np.ndarray, runs: np.ndarray | None) -> bool:
    """Whether most consecutive present times of one run decrease."""
    present = np.flatnonzero(ticks != MISSING_OFFSET)
    d = np.diff(ticks[present])
    if runs is not None:  # only differences within one run (member)
        run = np.searchsorted(runs, present, side="right")
        d = d[run[1:] == run[:-1]]
    return int((d < 0).sum()) > int((d > 0).sum())


def _is_index(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.timedelta64)


def anchor_time_coordinate(
    zstore: Store,
    manifest: SplitManifest,
    geoms: Mapping[str, ArrayGeometry],
    reader: Any,
    *,
    needed: bool,
) -> Any:
    """The time coordinate of the manifest's anchor array (``None`` when it has none and
    ``needed`` is false; ``ValueError`` when it is needed). The array is taken from ``geoms``
    (``{path: view}``), else opened along the sample dimension the views of ``geoms`` share
    (axis 0 without one): a ``(member, time, ...)`` store sampled along ``time`` has the times
    of ``time``, not the member numbers of axis 0."""
    geom = geoms.get(manifest.array)
    if geom is None:
        dims = {v.dims[v.sample_axis] for v in geoms.values()
                if v.dims is not None and not v.static and v.product is None}  # fmt: skip
        axis = dims.pop() if len(dims) == 1 else 0
        geom = next(iter(open_geometries(zstore, [manifest.array], sample_axis=axis).values()))
    try:  # one of another length than the samples is refused (a store read mid-append)
        coords = open_coordinates(zstore, geom, reader=reader)
    except CoordinateLengthError as exc:
        raise exc.while_doing(f"the times of {geom.path!r} cannot be read: ") from None
    times = [c for c in coords.values() if c.is_time] or [
        c for c in coords.values() if c.is_duration
    ]  # dates, else durations (a forecast sampled along its lead time: counted from 0)
    if not times:
        if needed:
            found = ", ".join(
                f"{c.name!r} (units {c.attrs.get('units')!r})" for c in coords.values()
            )
            why = (
                f"its coordinate {found} is no CF time nor duration: give it units such as "
                "'hours since 1970-01-01' (what xarray writes for dates; for durations "
                "'hours' and a 'dtype' attribute 'timedelta64[ns]'), or"
                if found
                else "it has none:"
            )
            raise ValueError(
                f"a time stride, window offsets in time deltas or dates in missing= need the "
                f"time coordinate of {manifest.array!r} (the manifest's anchor array), and "
                f"{why} give an int stride, window offsets in samples and sample indices in "
                "missing="
            )
        return None
    return times[0]


def _refuse_dates_between_steps(
    dates: Sequence[Any],
    gone: np.ndarray,
    ticks: np.ndarray,
    coord: Coordinate,
    counted: np.ndarray,
    step: int | None,
) -> None:
    """Refuse a date of ``missing=`` that lies strictly inside one step of the data: between
    two consecutive times at most the data's step apart (``step``, in the ticks the checks
    count, ``counted``: a calendar month of monthly dates, whatever its days). No sample has
    that time, so it would drop nothing: a typo (a wrong hour, a minute off) that would go
    unnoticed. A date outside the times, or inside a gap of them, passes (a list kept for a
    whole archive names steps other stores or other years hold). Before 2026-12-07 only a
    step of the smallest spacing counted: one shorter step anywhere (a 3-hour one among
    6-hourly times), or months of several lengths, let such typos pass."""
    present = ticks != MISSING_OFFSET
    times, first = np.unique(ticks[present], return_index=True)
    if len(times) < 2:
        return
    spacing = np.abs(np.diff(counted[present][first]))  # (the checks' ticks; negated backwards)
    one_step = spacing <= step if step is not None else np.diff(times) == np.diff(times).min()
    at = np.searchsorted(times, gone)  # times[at - 1] < gone <= times[at]
    inside = (at > 0) & (at < len(times))
    inside[inside] = times[at[inside]] != gone[inside]
    inside[inside] = one_step[at[inside] - 1]
    if not inside.any():
        return
    i = int(np.flatnonzero(inside)[0])
    before, after = (
        coord.values[int(np.flatnonzero(ticks == t)[0])] for t in times[at[i] - 1 : at[i] + 1]
    )
    raise ValueError(
        f"missing lists {dates[i]!r}, which falls between two consecutive times of "
        f"{coord.name!r} ({before} and {after}): no sample has it, so it would drop nothing. "
        "List the time of a step (or its sample index)"
    )
