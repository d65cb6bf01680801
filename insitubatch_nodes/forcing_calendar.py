"""The calendar forcings: the local time of day and the year's progress at each time, by
one of two conventions (:data:`CONVENTIONS`).

``"calendar"`` (the default)
    The local mean time of day (UTC plus longitude / 15°), of ``datetime64`` or cftime dates
    (any calendar: a day has 24 hours in each), and the fraction of the *calendar year*
    elapsed, counted in the dates' own calendar (a ``noleap`` year has 365 days, a
    ``360_day`` one 360).
``"graphcast"``
    GraphCast's definitions (google-deepmind/graphcast, ``graphcast/data_utils.py``:
    ``get_year_progress``, ``get_day_progress``), from ``s``, the whole seconds since
    1970-01-01 (``datetime64[s]``): the day progress ``(s mod 86400) / 86400 + λ / 360`` mod
    1, and the year progress ``s / 86400 / 365.24219`` mod 1 (years of the mean tropical year
    counted from 1970, not calendar years: up to 1.8e-3 of a year from ``"calendar"``'s).
    Instants only (the seconds of the proleptic Gregorian calendar): ``datetime64`` times, and
    cftime dates of the ``standard`` and ``proleptic_gregorian`` calendars (:func:`instants`;
    before 2026-12-07 refused); other calendars' dates are refused with a ``TypeError``.

Either way a missing time (``NaT``; ``None`` among cftime dates) gives NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from insitubatch_nodes.io.calendars import (
    CF_CALENDARS,
    DATETIME64_CALENDARS,
    date_fields,
    instants_us,
    none_mask,
)

__all__ = [
    "CONVENTIONS",
    "GRAPHCAST_YEAR_DAYS",
    "check_convention",
    "instants",
    "local_time",
    "native",
    "year_progress",
]

CONVENTIONS = ("calendar", "graphcast")
"""The conventions of the calendar forcings (module docstring)."""
GRAPHCAST_YEAR_DAYS = 365.24219
"""GraphCast's year: the mean tropical year in days (``data_utils._AVG_DAY_PER_YEAR``)."""
_DAY_SECONDS = 86_400


def check_convention(convention: Any) -> str:
    """``convention`` if it is one of :data:`CONVENTIONS`, else a ``ValueError`` naming them."""
    if not isinstance(convention, str) or convention not in CONVENTIONS:
        raise ValueError(
            f'convention must be one of {list(CONVENTIONS)}, got {convention!r}: "calendar" '
            "(the calendar year's fraction) or \"graphcast\" (GraphCast's year and day progress)"
        )
    return convention


def native(times: np.ndarray) -> np.ndarray:
    """``datetime64`` ``times`` in their own unit, or in seconds where it is coarser: never
    cast to nanoseconds, which wraps a time outside 1677–2262 around silently (before, every
    forcing of a ``datetime64[s]`` time in 1600 was another time's)."""
    return times.astype(np.promote_types(times.dtype, np.dtype("datetime64[s]")))


def instants(times: np.ndarray) -> np.ndarray:
    """``times`` as ``datetime64`` where they name instants: ``datetime64`` as given, and
    cftime dates of the ``standard`` (``gregorian``) or ``proleptic_gregorian`` calendar — a
    store's dates outside ``datetime64[ns]``'s range, 1677-2262, decode to those — as
    ``datetime64[us]`` of the same instants (a ``standard`` date before 1582-10-15 is
    Julian: its instant, not its fields; ``NaT`` for ``None``). Other times (a ``noleap`` or
    ``360_day`` calendar's dates, which name no instant of the real year) come as given. A
    pass in Python over cftime dates (the rows of a batch)."""
    t, missing = _missing(np.asarray(times))
    calendar = getattr(t.flat[0], "calendar", None) if t.dtype.kind == "O" and t.size else None
    if CF_CALENDARS.get(str(calendar)) not in DATETIME64_CALENDARS or missing.all():
        return np.asarray(times)
    out = instants_us(t).astype("datetime64[us]")
    out[missing] = np.datetime64("NaT", "us")
    return out


def _graphcast_seconds(times: np.ndarray) -> np.ndarray:
    """The seconds since 1970 as float64 as GraphCast takes them (whole seconds,
    ``datetime64[s]``; NaN at a missing time); ``TypeError`` for cftime dates of a calendar
    other than ``standard`` and ``proleptic_gregorian`` (:func:`instants`)."""
    times = instants(times)
    if times.dtype.kind != "M":
        raise TypeError(
            f"convention='graphcast' needs times as numpy datetime64, got dtype {times.dtype}: "
            "GraphCast counts seconds since 1970 in the Gregorian calendar, which a "
            "non-standard calendar's cftime dates do not have; take convention='calendar' "
            "(counted in their own calendar)"
        )
    seconds = times.astype("datetime64[s]").astype(np.int64)
    return np.where(np.isnat(times), np.nan, seconds.astype(np.float64))


_US_PER_DAY = 86_400 * 1_000_000
_YEAR_DAYS = {"noleap": 365, "365_day": 365, "all_leap": 366, "366_day": 366, "360_day": 360}
"""The days of every year in cftime's calendars of one year length."""


def _missing(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(t, missing)``: the times' missing ones (``NaT``, a ``None`` among cftime dates)
    marked, and for cftime dates replaced by a present one, so that fields can be read."""
    if t.dtype.kind != "O":
        return t, np.isnat(t)
    missing = none_mask(t)
    if missing.any() and not missing.all():
        t = t.copy()
        t[missing] = t[~missing].flat[0]
    return t, missing


def _fields(t: np.ndarray, *names: str) -> list[np.ndarray]:
    """Fields ``names`` of the cftime dates ``t``, as ``int64`` arrays shaped like ``t``
    (zeros if every date is missing)."""
    if t.size and t.reshape(-1)[0] is None:
        return [np.zeros(t.shape, np.int64) for _ in names]
    return date_fields(t, *names)


def _year_days(calendar: str, year: np.ndarray) -> np.ndarray:
    """The days of each date's ``year`` in ``calendar`` (cftime's name), 0 where this does not
    say (a ``standard`` date in 1582, the year of the reform; a year before 1; a calendar it
    does not know)."""
    if calendar in _YEAR_DAYS:
        return np.full(year.shape, _YEAR_DAYS[calendar], np.int64)
    julian = year % 4 == 0
    gregorian = julian & ((year % 100 != 0) | (year % 400 == 0))
    if calendar == "julian":
        leap = julian
    elif calendar == "proleptic_gregorian":
        leap = gregorian
    elif calendar in ("standard", "gregorian"):
        leap = np.where(year < 1582, julian, gregorian)
    else:
        return np.zeros(year.shape, np.int64)
    days = np.where(leap, 366, 365)
    days[year < 1] = 0
    if calendar in ("standard", "gregorian"):
        days[year == 1582] = 0
    return days


def local_time(times: Any, lon: Any, *, convention: str = "calendar") -> np.ndarray:
    """Local mean time of day in hours, ``[0, 24)``: ``(*times.shape, 1, n_lon)``. ``times``
    are ``datetime64`` or cftime dates (any calendar: a day has 24 hours in each); NaN at a
    missing time (``NaT``, ``None``). ``convention="graphcast"``: 24 h times GraphCast's day
    progress (module docstring; ``datetime64`` only), the same to float rounding but for
    sub-second times (GraphCast drops the fraction of a second)."""
    lon = np.asarray(lon, dtype=np.float64).reshape(1, -1)
    if check_convention(convention) == "graphcast":
        seconds = _graphcast_seconds(np.asarray(times))
        day = np.mod(np.mod(seconds, _DAY_SECONDS) / _DAY_SECONDS, 1.0)[..., None, None]
        return 24.0 * np.mod(day + lon / 360.0, 1.0)
    t, missing = _missing(np.asarray(times))
    if t.dtype.kind == "O":  # cftime dates: the time of day from their fields
        hour, minute, second, micro = _fields(t, "hour", "minute", "second", "microsecond")
        utc = (((hour * 60 + minute) * 60 + second) + micro / 1e6) / 3600.0
    else:
        t = native(t)
        utc = (t - t.astype("datetime64[D]")) / np.timedelta64(1, "h")
    utc = np.where(missing, np.nan, utc)
    return (utc[..., None, None] + lon / 15.0) % 24.0


def year_progress(times: Any, *, convention: str = "calendar") -> np.ndarray:
    """The fraction of the calendar year elapsed at each time, ``[0, 1)``: of the dates' own
    calendar for cftime dates (a ``noleap`` year has 365 days, a ``360_day`` one 360). cftime
    dates are read field by field for the whole array at once; only a ``standard`` date of
    1582 (the reform's year) or before year 1 is counted on its own. NaN at a missing time
    (``NaT``, ``None``). ``convention="graphcast"``: GraphCast's year progress instead, whole
    seconds since 1970 over years of 365.24219 days, mod 1 (``datetime64`` only)."""
    if check_convention(convention) == "graphcast":
        seconds = _graphcast_seconds(np.asarray(times))
        return np.mod(seconds / _DAY_SECONDS / GRAPHCAST_YEAR_DAYS, 1.0)
    t, missing = _missing(np.asarray(times))
    return np.where(missing, np.nan, _year_progress(t))


def _year_progress(t: np.ndarray) -> np.ndarray:
    if t.dtype.kind == "O":
        if not t.size or t.reshape(-1)[0] is None:
            return np.zeros(t.shape)
        year, day, hour, minute, second, micro = _fields(
            t, "year", "dayofyr", "hour", "minute", "second", "microsecond"
        )
        # microseconds since the year began, over the year's: as the timedelta division rounds
        seconds = (day - 1) * 86_400 + (hour * 60 + minute) * 60 + second
        days = _year_days(str(t.reshape(-1)[0].calendar), year)
        out = (seconds * 1_000_000 + micro) / (np.maximum(days, 1) * _US_PER_DAY)
        for i in np.flatnonzero(days.reshape(-1) == 0).tolist():  # told by the date itself
            d = t.reshape(-1)[i]
            start = d.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
            out.reshape(-1)[i] = (d - start) / (start.replace(year=d.year + 1) - start)
        return np.asarray(out, dtype=np.float64)
    t = native(t)
    year = t.astype("datetime64[Y]")
    start = year.astype(t.dtype)
    length = (year + np.timedelta64(1, "Y")).astype(t.dtype) - start
    return (t - start) / length
