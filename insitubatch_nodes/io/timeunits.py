"""Time units: the words for a length of time, in CF ``units`` and in time steps, and what each
is in numpy.

Two languages name the same units (numpy's codes ``D``, ``h``, ``m``, ``s``, ``ms``, ``us``,
``ns``; ``W`` for steps), each spelling them its own way, and both are read from the one table
of spellings here:

* **CF time units**, ``"<unit> since <date>"`` (:func:`cf_time_unit`): the words xarray decodes
  (checked against xarray 2026.9 and cftime 1.6), in any case. xarray reads a word two ways:
  numpy's route takes ``days``, ``hours``, ``minutes``, ``seconds``, ``milliseconds``,
  ``microseconds`` and ``nanoseconds`` (a singular, such as ``hour``, gets its ``s``), and
  decodes them to the nanosecond; any other word goes to cftime, which reads its abbreviations
  (``d``, ``h``, ``hr``, ``hrs``, ``min``, ``mins``, ``s``, ``sec``, ``secs``, ``ms``, ``msec``,
  ``msecs``, ``millisec``, ``millisecs``, ``microsec``, ``microsecs``) at the microsecond, even
  for the standard calendar (``1.001 h`` is 01:00:03.6, ``1.001 hours`` 01:00:03.599999999).
  cftime also reads ``months`` in the ``360_day`` calendar (30 days) and ``common_years`` in
  ``noleap`` / ``365_day`` (365 days); elsewhere months and years have no fixed length, and
  xarray refuses them, as it refuses ``weeks``, ``m``, ``us`` and ``ns``.
* **Time steps**, ``"6h"``, ``"30min"``, ``"1D"`` (:func:`as_timedelta`): a count and a unit,
  ``W``, ``D``, ``h``, ``min`` or ``m``, ``s``, ``ms``, ``us`` or ``µs``, ``ns`` (pandas' short
  spellings), ``hr``, ``hrs``, ``mins``, ``sec``, ``secs`` or the unit's name, any case; ``M``,
  ``Y`` and their names are months and years, refused (``"ms"`` is milliseconds, ``"MS"`` a
  month start, as in pandas). cftime's ``msec``, ``millisec``, ``microsec`` are no steps.
"""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any, NamedTuple

import numpy as np

__all__ = ["NS_PER_UNIT", "NUMPY_UNIT_NAMES", "CFTimeUnit", "as_timedelta", "cf_time_unit"]

NS_PER_UNIT: dict[str, int] = {
    "ns": 1, "us": 1_000, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9,
    "D": 86_400 * 10**9, "W": 7 * 86_400 * 10**9,
}  # fmt: skip
"""Nanoseconds in one numpy time unit, for every unit of a fixed length."""

_SPELLINGS: dict[str, str] = {
    **dict.fromkeys(("w", "week", "weeks"), "W"),
    **dict.fromkeys(("d", "day", "days"), "D"),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), "h"),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), "m"),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), "s"),
    **dict.fromkeys(("ms", "msec", "msecs", "millisec", "millisecs"), "ms"),
    **dict.fromkeys(("millisecond", "milliseconds"), "ms"),
    **dict.fromkeys(("us", "µs", "microsec", "microsecs", "microsecond", "microseconds"), "us"),
    **dict.fromkeys(("ns", "nanosecond", "nanoseconds"), "ns"),
}
# (lower case) every spelling of a unit of a fixed length either language reads, to its unit

# CF: the names numpy's route reads (xarray's ``_netcdf_to_numpy_timeunit``: lower case, an "s"
# added to a word without one), and what cftime reads besides them (its ``_units``, lower-cased:
# the names but nanoseconds, their singulars, and these abbreviations)
NUMPY_UNIT_NAMES: dict[str, str] = {
    n: _SPELLINGS[n]
    for n in ("days", "hours", "minutes", "seconds", "milliseconds", "microseconds", "nanoseconds")
}
"""The unit words xarray's numpy route reads (in CF time units, and as the ``units`` of the
durations it writes), to their numpy unit: ``{"days": "D", "hours": "h", ...}``."""
_CFTIME_ABBREVIATIONS: tuple[str, ...] = (
    "d", "h", "hr", "hrs", "min", "mins", "s", "sec", "secs",
    "ms", "msec", "msecs", "millisec", "millisecs", "microsec", "microsecs",
)  # fmt: skip
# words cftime reads in one calendar only (cftime's names), where they have a fixed length
_CALENDAR_WORDS: dict[str, str] = {
    **dict.fromkeys(("month", "months"), "360_day"),
    **dict.fromkeys(("common_year", "common_years"), "noleap"),
}
# steps: cftime's spellings that steps never took
_STEP_WORDS = frozenset(_SPELLINGS) - {"msec", "msecs", "millisec", "millisecs"} - {
    "microsec", "microsecs"
}  # fmt: skip
_NO_FIXED_LENGTH = frozenset({"mo", "month", "months", "y", "yr", "year", "years"})


class CFTimeUnit(NamedTuple):
    """How xarray reads the unit word of CF time ``units`` (see the module docstring)."""

    numpy: str | None
    """The numpy unit when numpy's route reads the word (``"h"`` for ``hours``), ``None`` when
    only cftime does (its abbreviations, ``months``, ``common_years``)."""
    cftime: str
    """The word as cftime reads it (``"hours"`` for ``hrs``; ``"months"``)."""


def cf_time_unit(word: str, calendar: str, what: str) -> CFTimeUnit:
    """The unit word of CF time units (``"hrs"`` of ``"hrs since 2000-01-01"``) in ``calendar``
    (cftime's name: CF's aliases folded), read as xarray reads it.

    A word xarray refuses raises ``ValueError`` prefixed by ``what``, listing the words read.
    """
    lower = word.lower()
    plural = lower if lower.endswith("s") else lower + "s"
    if plural in NUMPY_UNIT_NAMES:
        return CFTimeUnit(NUMPY_UNIT_NAMES[plural], plural)
    if lower in _CFTIME_ABBREVIATIONS:
        unit = _SPELLINGS[lower]
        return CFTimeUnit(None, next(n for n, u in NUMPY_UNIT_NAMES.items() if u == unit))
    if _CALENDAR_WORDS.get(lower) == calendar:
        return CFTimeUnit(None, plural)
    raise ValueError(
        f"{what}: time unit {word!r} is not supported in calendar {calendar!r}: xarray reads "
        f"{', '.join(NUMPY_UNIT_NAMES)} (or one of them without its 's'), and cftime's "
        f"abbreviations {', '.join(_CFTIME_ABBREVIATIONS)} (any case); months "
        "and years have no fixed length (cftime reads 'months' only in calendar '360_day', "
        "'common_years' only in 'noleap' / '365_day'). Rewrite the times in one of these "
        "units, or leave this coordinate out (insitu_pipeline(..., coords=()))"
    )


_DELTA_RE = re.compile(r"^\s*(?P<n>[+-]?\d+)?\s*(?P<unit>[A-Za-zµ]+)\s*$")


def as_timedelta(x: Any, what: str = "a time step") -> np.timedelta64:
    """``x`` as a ``numpy.timedelta64`` of a fixed length: ``"6h"``, ``"-6h"``, ``"30min"``,
    ``"1D"``, ``"90 s"``, ``"hours"`` (one), a ``numpy.timedelta64`` or a ``datetime.timedelta``.
    Months and years (no fixed length) and ``NaT`` raise ``ValueError``; a number ``TypeError``."""
    if isinstance(x, np.timedelta64):
        unit = np.datetime_data(x.dtype)[0]
        if np.isnat(x):
            raise ValueError(f"{what} is NaT: give a length such as '6h'")
        if unit in ("Y", "M", "generic"):
            raise ValueError(
                f"{what} {x!r} has no fixed length: give it in weeks, days, hours, minutes, "
                "seconds or finer"
            )
        return x
    if isinstance(x, _dt.timedelta):
        return np.timedelta64(x)
    if isinstance(x, str):
        m = _DELTA_RE.match(x)
        word = m["unit"] if m else ""
        if word in ("M", "Y", "MS", "YS") or word.lower() in _NO_FIXED_LENGTH:
            raise ValueError(
                f"{what} {x!r} has no fixed length: give it in weeks, days, hours, minutes, "
                "seconds or finer"
            )
        unit = _SPELLINGS.get(word.lower(), "") if word.lower() in _STEP_WORDS else ""
        if m is None or not unit:
            raise ValueError(
                f"{what} {x!r} is not a time step: write a count and a unit, such as '6h', "
                "'-6h', '30min', '1D', '90s' (units W, D, h, min, s, ms, us, ns; months and "
                "years have no fixed length)"
            )
        return np.timedelta64(int(m["n"] or 1), unit)  # type: ignore[call-overload]
    raise TypeError(
        f"{what} must be a time step ('6h', numpy.timedelta64, datetime.timedelta), got {x!r}"
    )
