"""CF calendars: which dates are numpy ``datetime64`` values, the others as cftime objects, and
any calendar's dates as integer counts.

The rule is xarray's (``decode_times=True``, its default ``use_cftime=None`` and
``time_unit="ns"``; checked against xarray 2026.9 and cftime 1.6):

* ``standard`` (also ``gregorian``, and no ``calendar`` attribute) and ``proleptic_gregorian``
  decode to ``numpy.datetime64[ns]`` when every date lies in ``datetime64[ns]``'s range
  (1677-09-21T00:12:43.145224193 to 2262-04-11T23:47:16.854775807) — for ``standard`` that is
  after the Gregorian reform of 1582-10-15, so numpy's proleptic Gregorian dates are the
  calendar's own; otherwise (a date outside that range, a ``standard`` date before 1582-10-15,
  counted in the Julian calendar there) to cftime objects of the calendar
  (``cftime.DatetimeGregorian``, ``cftime.DatetimeProlepticGregorian``);
* ``noleap`` / ``365_day``, ``all_leap`` / ``366_day``, ``360_day`` and ``julian`` always decode
  to cftime objects (``DatetimeNoLeap``, ``DatetimeAllLeap``, ``Datetime360Day``,
  ``DatetimeJulian``): one ``object`` array;
* a missing value is ``NaT`` in a ``datetime64`` array and ``None`` in a cftime one (xarray
  writes ``None`` in a cftime array as NaN; reading such a value back, xarray 2026.9 gives the
  reference date, a masked entry whose mask it drops, or raises ``OverflowError`` for an integer
  ``_FillValue`` — cftime's num2date masks them, xarray's ``np.asarray`` drops the mask).

cftime (a dependency of the package) is imported only when a calendar needs it; where it is
missing, such a coordinate raises ``ModuleNotFoundError`` saying ``pip install cftime``.
:func:`counts_us` turns cftime dates into integer microseconds (cftime's resolution) counted in
their own calendar, vectorised over the ordinal day and the time of day, which is what
:func:`~insitubatch_nodes.io.coords.time_offsets` and date windows compare.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import operator
import re
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from insitubatch_nodes.io.timeunits import NS_PER_UNIT

__all__ = [
    "CF_CALENDARS",
    "DATETIME64_CALENDARS",
    "DATE_FIELDS",
    "MONTH_STEPS_NEAR_S",
    "calendar_months",
    "calendar_of",
    "counts_us",
    "date_fields",
    "date_in",
    "decode_with_cftime",
    "instants_us",
    "month_step",
    "none_mask",
    "one_calendar",
    "require_cftime",
]

CF_CALENDARS: dict[str, str] = {
    "standard": "standard",
    "gregorian": "standard",
    "proleptic_gregorian": "proleptic_gregorian",
    "noleap": "noleap",
    "365_day": "noleap",
    "all_leap": "all_leap",
    "366_day": "all_leap",
    "360_day": "360_day",
    "julian": "julian",
}
"""Every CF calendar this package decodes, to cftime's name for it (CF's aliases folded)."""

DATETIME64_CALENDARS: frozenset[str] = frozenset({"standard", "proleptic_gregorian"})
"""Calendars (cftime's names) whose dates in ``datetime64[ns]``'s range decode to ``datetime64``."""

_US_PER_DAY = 86_400_000_000
# datetime64[ns]'s range in microseconds since 1970-01-01 (xarray's own bounds, at cftime's
# resolution): a date inside decodes to datetime64[ns] in the calendars above
_NS_LO_US = int(np.datetime64("1677-09-21T00:12:43.145224", "us").astype(np.int64))
_NS_HI_US = int(np.datetime64("2262-04-11T23:47:16.854775", "us").astype(np.int64))


def require_cftime(why: str) -> ModuleType:
    """The ``cftime`` module, or ``ModuleNotFoundError`` saying what needs it and how to get it."""
    try:
        import cftime
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"{why} needs cftime (the CF calendars xarray decodes with it): pip install cftime"
        ) from exc
    return cftime


def decode_with_cftime(
    values: np.ndarray, missing: np.ndarray, word: str, ref: str, calendar: str, name: str
) -> np.ndarray:
    """Numbers of ``word`` (``"hours"``, ...) since ``ref`` in ``calendar``, decoded as xarray
    decodes them (see the module docstring): ``datetime64[ns]`` (``NaT`` where ``missing``) or
    an ``object`` array of cftime dates (``None`` where ``missing``).

    ``ref`` is the reference date as ``"YYYY-MM-DD hh:mm:ss[.f][+hh:mm]"``. Values are handed to
    cftime as stored (integers stay exact; xarray hands it float64).
    """
    cftime = require_cftime(f"coordinate {name!r} (calendar {calendar!r})")
    valid = values[~missing]
    if word == "nanoseconds":  # cftime counts microseconds at the finest
        if valid.dtype.kind in "iu" and not np.any(valid % 1000):
            valid = valid // 1000
        else:
            valid = valid.astype(np.float64) / 1000.0
        word = "microseconds"
    if valid.dtype.kind in "iu":
        if valid.size and valid.dtype.kind == "u" and int(valid.max()) >= 2**63:
            raise ValueError(f"coordinate {name!r}: time values overflow 64-bit integers")
        valid = valid.astype(np.int64)
    else:
        valid = valid.astype(np.float64)
    units = f"{word} since {ref}"
    try:
        dates = np.asarray(
            cftime.num2date(valid, units, calendar, only_use_cftime_datetimes=True), dtype=object
        )
    except (ValueError, OverflowError, TypeError) as exc:
        raise ValueError(
            f"coordinate {name!r}: cannot decode {units!r} in calendar {calendar!r}: {exc}"
        ) from exc
    out = np.full(values.shape, None, dtype=object)
    out[~missing] = dates.reshape(-1)
    canonical = CF_CALENDARS[calendar]
    if canonical in DATETIME64_CALENDARS and dates.size:
        us = instants_us(dates)
        if int(us.min()) >= _NS_LO_US and int(us.max()) <= _NS_HI_US:
            times = np.full(values.shape, np.datetime64("NaT", "ns"))
            times[~missing] = us.astype("M8[us]").astype("M8[ns]")
            return times
    elif canonical in DATETIME64_CALENDARS:  # nothing but missing values: NaT, like xarray
        return np.full(values.shape, np.datetime64("NaT", "ns"))
    return out


def _epoch_us(like: Any) -> int:
    """1970-01-01T00:00 of ``like``'s calendar, counted as :func:`counts_us` counts."""
    cftime = require_cftime("a cftime date")
    epoch = cftime.datetime(1970, 1, 1, calendar=like.calendar, has_year_zero=like.has_year_zero)
    return int(epoch.toordinal()) * _US_PER_DAY


def instants_us(dates: np.ndarray) -> np.ndarray:
    """cftime dates (no ``None``) of one calendar as ``int64`` microseconds since its
    1970-01-01T00:00 (:func:`counts_us` less the epoch's): in the ``standard`` and
    ``proleptic_gregorian`` calendars the dates' instants as ``datetime64[us]`` counts them (a
    ``standard`` date before 1582-10-15, Julian, at its instant, not its fields)."""
    return counts_us(dates) - _epoch_us(dates.flat[0])


def counts_us(dates: np.ndarray) -> np.ndarray:
    """cftime dates (no ``None``) as ``int64`` microseconds since their calendar's ordinal day
    0: ``toordinal()`` days (continuous across the 1582 reform in ``standard``) plus the time of
    day. Differences of these are exact elapsed microseconds in that calendar."""
    days, hour, minute, second, micro = date_fields(
        dates.reshape(-1), "toordinal", "hour", "minute", "second", "microsecond"
    )
    tod = ((hour * 60 + minute) * 60 + second) * 1_000_000 + micro
    return (days * _US_PER_DAY + tod).reshape(dates.shape)


def date_fields(dates: np.ndarray, *names: str) -> list[np.ndarray]:
    """Fields ``names`` of the cftime dates ``dates`` (no ``None``; a field of
    :data:`DATE_FIELDS`), as ``int64`` arrays shaped like ``dates``. Each is read by a ufunc:
    the loop and the calls in C, no Python per date (which a batch's dates would otherwise
    cost every batch)."""
    return [np.asarray(_READ[name](dates), dtype=object).astype(np.int64) for name in names]


def none_mask(values: np.ndarray) -> np.ndarray:
    """Where the object array ``values`` holds ``None`` (a missing cftime date), by a ufunc."""
    return np.asarray(_IS(values, _NONE), dtype=bool)


#: The fields :func:`date_fields` reads: ``toordinal()`` (the day number :func:`counts_us`
#: counts from) and the date's attributes.
DATE_FIELDS = ("toordinal", "year", "dayofyr", "hour", "minute", "second", "microsecond")
_READ = {
    name: np.frompyfunc(
        operator.methodcaller(name) if name == "toordinal" else operator.attrgetter(name), 1, 1
    )
    for name in DATE_FIELDS
}
_IS = np.frompyfunc(operator.is_, 2, 1)
_NONE = np.array(None, dtype=object)


def elapsed_ticks(dates: np.ndarray, epoch: Any, shown: str) -> tuple[np.ndarray, int]:
    """``dates - epoch`` as ``int64`` ticks and the nanoseconds in one tick, exactly.

    ``dates`` (no missing value) are ``datetime64`` — ticks of the finer of their unit and
    ``epoch``'s (a ``datetime64``) — or cftime dates, microseconds counted in their calendar
    (``epoch`` a cftime date of it). A difference past ``int64`` raises ``OverflowError`` naming
    the epoch as ``shown``.
    """
    if dates.dtype == object:
        ticks = counts_us(dates) - int(counts_us(np.array([epoch], dtype=object))[0])
        return ticks, NS_PER_UNIT["us"]
    if np.datetime_data(dates.dtype)[0] not in NS_PER_UNIT:  # years or months: exact in days
        dates = dates.astype("M8[D]")
    if np.datetime_data(epoch.dtype)[0] not in NS_PER_UNIT:
        epoch = epoch.astype("M8[D]")
    units = (np.datetime_data(dates.dtype)[0], np.datetime_data(epoch.dtype)[0])
    tick = min(units, key=NS_PER_UNIT.__getitem__)
    try:  # (numpy < 2.5 wraps around silently in casts between units; 2.5 raises)
        e = epoch.astype(f"M8[{tick}]")
        wrapped = e.astype(epoch.dtype) != epoch
    except OverflowError:
        wrapped = True
    ratio = NS_PER_UNIT[units[0]] // NS_PER_UNIT[tick]
    raw = dates.astype(np.int64)
    if wrapped or (raw.size and float(np.abs(raw).max()) * ratio >= 2.0**62):
        raise OverflowError(
            f"the times cannot be counted in {tick} since epoch {shown}: choose an epoch near them"
        )
    et = int(e.astype(np.int64))
    lo, hi = float(raw.min()) * ratio - et, float(raw.max()) * ratio - et
    if max(abs(lo), abs(hi)) >= 2.0**62:
        raise OverflowError(f"the times counted in {tick} since epoch {shown} overflow int64")
    return raw * ratio - et, NS_PER_UNIT[tick]


def calendar_of(values: np.ndarray) -> str | None:
    """The calendar (cftime's name) of an ``object`` array of cftime dates (``None`` entries
    are missing values), or ``None`` when the array holds anything else. Dates of two calendars
    raise ``ValueError``."""
    if values.dtype != object:
        return None
    try:
        import cftime
    except ImportError:  # without cftime there are no cftime dates
        return None
    kinds = {type(v) for v in values.reshape(-1).tolist() if v is not None}
    if not kinds or not all(issubclass(k, cftime.datetime) for k in kinds):
        return None
    found = {v.calendar for v in values.reshape(-1).tolist() if v is not None}
    if len(found) != 1:
        raise ValueError(f"dates of calendars {sorted(found)} in one coordinate: use one calendar")
    return str(found.pop())


def one_calendar(names: Sequence[str], values: Sequence[np.ndarray], what: str) -> None:
    """Refuse time coordinates ``values`` (decoded; one per name in ``names``) that count their
    dates in different calendars: a second of ``noleap`` and a second of ``standard`` since 1970
    are other dates, so such times are not one timeline (nor one coordinate). ``ValueError``
    names the first two that differ, prefixed by ``what``."""
    kinds = [_time_kind(v) for v in values]
    for k, kind in enumerate(kinds):
        if kind != kinds[0]:
            raise ValueError(
                f"{what}: the times of {names[0]!r} are {kinds[0]} and those of {names[k]!r} "
                f"{kind}: times in two calendars are not one timeline (the same count of "
                "seconds is another date in each), so they are not joined or stepped through "
                "together: write them in one calendar, or read them in separate pipelines"
            )


def refuse_missing_times(values: np.ndarray, whose: str, why: str) -> None:
    """Refuse decoded times ``values`` that hold a missing one (``NaT``, or ``None`` among
    cftime dates) where every time is needed (``why``): ``ValueError`` says ``whose`` times
    they are (``"'a.zarr''s time"``), the first missing index and how many, and where missing
    times come from (a ``_FillValue``, or a zarr v2 array's own ``fill_value``, 0 unless set,
    so that a time ``0 hours since ...`` reads as missing, as xarray reads it)."""
    if values.dtype.kind == "M":
        missing = np.flatnonzero(np.isnat(values))
    elif values.dtype == object:
        missing = np.flatnonzero([v is None for v in values.tolist()])
    else:
        return
    if not len(missing):
        return
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ValueError(
        f"{whose} at index {int(missing[0])} is missing (NaT){more}: {why}. A time reads "
        "as missing where it equals the time array's _FillValue or missing_value, and in a "
        "zarr v2 store its own fill_value (0 unless set, as xarray reads v2: a first time of "
        "0 'hours since ...' is then missing); rewrite the time array with a fill_value no "
        "time takes, or leave this store out"
    )


def _time_kind(values: np.ndarray) -> str:
    if values.dtype.kind == "M":
        return "datetime64 dates (the standard calendar)"
    calendar = calendar_of(values)
    return f"cftime dates of calendar {calendar!r}" if calendar else f"{values.dtype} values"


_ISO_RE = re.compile(
    r"^\s*(?P<y>-?\d{1,4})-(?P<mo>\d{1,2})-(?P<d>\d{1,2})"
    r"(?:[T ](?P<h>\d{1,2})(?::(?P<mi>\d{1,2})(?::(?P<s>\d{1,2})(?:\.(?P<f>\d{1,6}))?)?)?)?\s*$"
)


def date_in(x: Any, calendar: str, like: Any, what: str) -> Any:
    """``x`` as a cftime date of ``calendar`` (of the same type as ``like``, a date of it).

    ``x`` is a cftime date of that calendar, an ISO string (``"2000-02-30"``, ``"1850-01-01T06"``;
    read in ``calendar``), or a ``datetime`` / ``numpy.datetime64`` / ``pandas.Timestamp`` whose
    fields (year, month, day, time of day; an aware one converted to UTC) are taken as a date of
    ``calendar``. A date that ``calendar`` lacks (``"2001-02-29"`` in ``noleap``) raises
    ``ValueError``; a number or another calendar's cftime date ``TypeError``.
    """
    cftime = require_cftime(f"{what} in calendar {calendar!r}")
    if isinstance(x, cftime.datetime):
        if CF_CALENDARS.get(str(x.calendar), x.calendar) != calendar:
            raise TypeError(
                f"{what} {x!r} is a date of calendar {x.calendar!r}, the coordinate's is "
                f"{calendar!r}: give a date of its calendar or an ISO string"
            )
        fields = (x.year, x.month, x.day, x.hour, x.minute, x.second, x.microsecond)
    elif isinstance(x, str):
        m = _ISO_RE.match(x)
        if m is None:
            raise ValueError(
                f"{what} {x!r} is not a date: write it in ISO 8601 ('2000-01-01', "
                f"'2000-01-01T06:00'), read in calendar {calendar!r}"
            )
        frac = (m["f"] or "").ljust(6, "0")
        y, mo, d, h, mi, sec = (int(m[k] or 0) for k in ("y", "mo", "d", "h", "mi", "s"))
        fields = (y, mo, d, h, mi, sec, int(frac))
    elif isinstance(x, (_dt.datetime, np.datetime64)):
        if isinstance(x, np.datetime64):
            if np.isnat(x):
                raise ValueError(f"{what} is NaT: give a date")
            x = x.astype("M8[us]").item()
            if not isinstance(x, _dt.datetime):  # (a date outside datetime's years 1..9999)
                raise ValueError(f"{what} {x!r} lies outside years 1..9999: give an ISO string")
        if x.tzinfo is not None:
            x = x.astimezone(_dt.UTC).replace(tzinfo=None)
        fields = (x.year, x.month, x.day, x.hour, x.minute, x.second, x.microsecond)
    elif isinstance(x, _dt.date):
        fields = (x.year, x.month, x.day, 0, 0, 0, 0)
    else:
        raise TypeError(
            f"{what} must be a date (an ISO string like '2000-01-01', a cftime date of calendar "
            f"{calendar!r}, a datetime or numpy datetime64), got {x!r}"
        )
    try:
        return cftime.datetime(*fields, calendar=like.calendar, has_year_zero=like.has_year_zero)
    except ValueError as exc:
        raise ValueError(f"{what} {x!r} is not a date of calendar {calendar!r}: {exc}") from exc


MONTH_STEPS_NEAR_S = 3 * 86_400
"""Steps of ``k`` calendar months differ by 3 days at most: the rule by which dates of
monthly, seasonal or yearly means are told from a fixed step (:func:`month_step`,
``anchor_steps.calendar_ticks``)."""


def calendar_months(values: np.ndarray) -> np.ndarray:
    """Whole months of the calendar from January 1970 to each date's month, in the dates' own
    calendar (``datetime64``, or cftime dates); int64's minimum (``NaT``'s own pattern) where a
    date is missing (``NaT``, ``None``)."""
    if values.dtype.kind == "M":  # (NaT stays int64's minimum)
        return values.astype("datetime64[M]").astype(np.int64)
    missing = np.array([x is None for x in values], dtype=bool)  # (cftime dates; None)
    year = np.frompyfunc(lambda t: 1970 if t is None else t.year, 1, 1)(values)
    month = np.frompyfunc(lambda t: 1 if t is None else t.month, 1, 1)(values)
    out = (year.astype(np.int64) - 1970) * 12 + month.astype(np.int64) - 1
    out[missing] = np.iinfo(np.int64).min
    return out


def month_step(values: np.ndarray) -> int | None:
    """``k`` where the present dates ``values`` (``datetime64``, or cftime dates) step by
    ``k`` whole months of their calendar (``k`` >= 1; ``-k`` where they run backwards, newest
    first), of several lengths all within 3 days of each other (monthly, seasonal, yearly
    means: the rule of ``anchor_steps.calendar_ticks``); ``None`` otherwise (one fixed step,
    other steps, fewer than two dates). A collection's member then steps at ``k`` months
    (``MemberMap``; before 2026-12-07 monthly dates newest first were no month step, and such
    a member was refused for steps of 31 days after 30)."""
    if len(values) < 2 or values.dtype.kind not in "MO":
        return None
    if values.dtype.kind == "M":
        d = np.diff(values.astype("datetime64[s]").astype(np.int64))
    else:  # cftime dates (once per member, at build)
        d = np.array([(b - a).total_seconds() for a, b in itertools.pairwise(values)])
    dm = np.diff(calendar_months(values))
    near = d.max() - d.min() <= MONTH_STEPS_NEAR_S
    if dm[0] == 0 or np.any(dm != dm[0]) or np.all(d == d[0]) or not near:
        return None
    return int(dm[0])  # (negative: newest first)
