"""Decoding a coordinate's stored values with its CF attributes, as xarray does for a zarr
store, but without xarray: :func:`decode_cf` (what
:func:`~insitubatch_nodes.io.coords.open_coordinates` applies to each coordinate it reads).

* ``_FillValue`` / ``missing_value`` mark missing values (for zarr v2 the array's own
  ``fill_value`` is the ``_FillValue``, as xarray reads v2; for v3 only the attribute counts),
  then ``scale_factor`` / ``add_offset`` unpack — packed values and masked integers decode to
  ``float64`` (NaN where missing);
* ``units`` of the CF form ``"<unit> since <reference date>"`` (a unit word xarray reads:
  ``hours``, ``hour``, ``hrs``, ``h``, ...; :mod:`~insitubatch_nodes.io.timeunits` lists them)
  in any CF ``calendar`` (absent means ``standard``) decode to the dates xarray gives
  (:mod:`~insitubatch_nodes.io.calendars` states the rule): ``numpy.datetime64[ns]`` for
  ``standard``, ``gregorian`` and ``proleptic_gregorian`` dates that all lie in its range
  (``NaT`` where missing, and for NaT's own ``int64`` bit pattern, which is how xarray writes a
  NaT), numpy alone; cftime dates in one ``object`` array (``None`` where missing) for dates
  outside that range, ``standard`` dates before 1582-10-15 (Julian there), and the calendars
  numpy lacks: ``noleap`` / ``365_day``, ``all_leap`` / ``366_day``, ``360_day``, ``julian``.
  Another calendar raises ``ValueError``;
* durations as xarray writes them (``units`` ``hours``, ``minutes``, ... with a ``dtype``
  attribute ``timedelta64[...]``: a forecast's lead time) decode to ``timedelta64`` of that
  resolution, as xarray decodes them by default;
* anything else comes as stored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.calendars import CF_CALENDARS, DATETIME64_CALENDARS, decode_with_cftime
from insitubatch_nodes.io.cf import (
    TIMEDELTA_UNITS,
    encoded_fills,
    is_cf_time,
    is_cf_timedelta,
    missing_mask,
)
from insitubatch_nodes.io.cf import UNITS_RE as _UNITS_RE
from insitubatch_nodes.io.timeunits import NS_PER_UNIT, cf_time_unit

__all__ = ["CALENDARS", "decode_cf"]

CALENDARS: tuple[str, ...] = tuple(CF_CALENDARS)
"""Every CF calendar a time coordinate may name (see the module docstring for what each decodes
to)."""

_REF_RE = re.compile(
    r"^(?P<y>\d{1,4})-(?P<mo>\d{1,2})-(?P<d>\d{1,2})"
    r"(?:[T ]+(?P<h>\d{1,2})(?::(?P<mi>\d{1,2})(?::(?P<s>\d{1,2})(?P<frac>\.\d*)?)?)?)?"
    r"\s*(?P<tz>Z|UTC|GMT|[+-]\d{1,2}(?::?\d{2})?)?$",
    re.IGNORECASE,
)
# whole seconds inside datetime64[ns]'s range (1677-09-21T00:12:43.145 .. 2262-04-11T23:47:16.854):
# the numpy route decodes dates between them; the slivers beyond go through cftime, as in xarray
_NS_FIRST_S = np.datetime64("1677-09-21T00:12:44", "s")
_NS_LAST_S = np.datetime64("2262-04-11T23:47:15", "s")


def _parse_reference(ref: str, units: str, name: str) -> tuple[str, int]:
    """The reference date of CF ``units`` as ISO ``YYYY-MM-DDThh:mm:ss[.f]`` (its own wall
    clock, any calendar) and its UTC offset in minutes."""
    m = _REF_RE.match(ref.strip())
    if m is None:
        raise ValueError(
            f"coordinate {name!r}: cannot read the reference date of units {units!r}; CF time "
            "units look like 'hours since 1900-01-01' or 'seconds since 1970-01-01 00:00:00'"
        )
    g = m.groupdict()
    iso = f"{int(g['y']):04d}-{int(g['mo']):02d}-{int(g['d']):02d}"
    iso += f"T{int(g['h'] or 0):02d}:{int(g['mi'] or 0):02d}:{int(g['s'] or 0):02d}"
    iso += (g["frac"] or "").rstrip("0").rstrip(".")
    tz = (g["tz"] or "").upper()
    offset = 0
    if tz and tz not in ("Z", "UTC", "GMT"):  # the reference is local time
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        hours, minutes = (
            (int(digits), 0) if len(digits) <= 2 else (int(digits[:-2]), int(digits[-2:]))
        )
        offset = sign * (hours * 60 + minutes)
    return iso, offset


def _reference_date(ref: str, units: str, name: str) -> np.datetime64:
    iso, offset = _parse_reference(ref, units, name)
    try:
        date = np.datetime64(iso, "ns" if "." in iso else "s")
    except ValueError as exc:
        raise ValueError(
            f"coordinate {name!r}: invalid reference date in {units!r}: {exc}"
        ) from exc
    return date - np.timedelta64(offset, "m")  # in UTC


def _cftime_reference(ref: str, units: str, name: str) -> str:
    """The reference date as cftime reads it, ``YYYY-MM-DD hh:mm:ss[.ffffff][+hh:mm]``."""
    iso, offset = _parse_reference(ref, units, name)
    date, _, frac = iso.replace("T", " ").partition(".")
    text = f"{date}.{frac[:6]}" if frac else date
    if offset:
        sign = "-" if offset < 0 else "+"
        text += f"{sign}{abs(offset) // 60:02d}:{abs(offset) % 60:02d}"
    return text


def _decode_time(
    values: np.ndarray, missing: np.ndarray | None, units: str, calendar: Any, name: str
) -> np.ndarray:
    cal = "standard" if calendar is None else str(calendar).strip().lower()
    if cal not in CF_CALENDARS:
        raise ValueError(
            f"coordinate {name!r}: calendar {calendar!r} is not supported: CF calendars are "
            f"{', '.join(repr(c) for c in CALENDARS)}. Leave this coordinate out "
            "(insitu_pipeline(..., coords=())) or decode it yourself and build a Coordinate "
            "from the values"
        )
    m = _UNITS_RE.match(units)
    assert m is not None  # is_cf_time checked it
    unit = cf_time_unit(m["unit"], CF_CALENDARS[cal], f"coordinate {name!r} ({units!r})")
    missing = np.zeros(values.shape, bool) if missing is None else missing.copy()
    if values.dtype.kind == "f":
        missing |= ~np.isfinite(values)
    elif values.dtype == np.int64:  # NaT's own bit pattern (how xarray writes a NaT)
        missing |= values == np.iinfo(np.int64).min
    if values.dtype.kind not in "iuf":
        raise ValueError(
            f"coordinate {name!r}: CF time values must be numbers, got dtype {values.dtype}"
        )
    if CF_CALENDARS[cal] in DATETIME64_CALENDARS and unit.numpy is not None:
        ref = _reference_date(m["ref"], units, name)
        out = _decode_datetime64(values, missing, unit.numpy, ref)
        if out is not None:
            return out
    return decode_with_cftime(
        values, missing, unit.cftime, _cftime_reference(m["ref"], units, name), cal, name
    )


def _decode_datetime64(
    values: np.ndarray, missing: np.ndarray, unit: str, ref: np.datetime64
) -> np.ndarray | None:
    """``ref + values`` as ``datetime64[ns]`` (``NaT`` where missing) with numpy alone, when the
    reference and every date lie in ``datetime64[ns]``'s range (xarray's pandas route); else
    ``None``, for cftime to decode."""
    if not _NS_FIRST_S <= ref.astype("M8[s]") <= _NS_LAST_S:
        return None
    valid = values[~missing]
    if valid.dtype.kind in "iu":
        span = float(np.abs(valid.astype(np.float64)).max()) if valid.size else 0.0
        finest = min(NS_PER_UNIT[unit], NS_PER_UNIT[np.datetime_data(ref.dtype)[0]])
        if span * (NS_PER_UNIT[unit] // finest) >= 2.0**62:
            return None
        delta = np.zeros(values.shape, f"m8[{unit}]")
        delta[~missing] = valid.astype(np.int64).astype(f"m8[{unit}]")
    else:  # fractional offsets: float64 nanoseconds truncated to int64, as xarray counts them
        ticks = valid.astype(np.float64) * NS_PER_UNIT[unit]
        if ticks.size and float(np.abs(ticks).max()) >= 2.0**62:
            return None
        delta = np.zeros(values.shape, "m8[ns]")
        delta[~missing] = ticks.astype(np.int64).astype("m8[ns]")
        ref = ref.astype("M8[ns]")
    out = ref + delta
    out[missing] = np.array("NaT", dtype=out.dtype)
    good = out[~missing].astype("M8[s]")  # coarser: every value fits
    if good.size and not (good.min() >= _NS_FIRST_S and good.max() <= _NS_LAST_S):
        return None
    return out.astype("M8[ns]")


def _decode_timedelta(
    values: np.ndarray, missing: np.ndarray | None, units: str, dtype: str
) -> np.ndarray:
    """Numbers of ``units`` as xarray decodes durations: ``timedelta64`` of the resolution
    the ``dtype`` attribute names (``NaT`` where missing or not a number)."""
    out_dtype = np.dtype(dtype)
    resolution = np.datetime_data(out_dtype)[0]
    per_unit = NS_PER_UNIT[TIMEDELTA_UNITS[units]] / NS_PER_UNIT[resolution]
    bad = ~np.isfinite(values) if values.dtype.kind == "f" else np.zeros(values.shape, bool)
    if missing is not None:
        bad |= missing
    if values.dtype.kind in "iu" and per_unit == int(per_unit):  # exact, however long
        counts = np.where(bad, 0, values).astype(np.int64) * int(per_unit)
    else:
        counts = np.round(np.where(bad, 0, values) * per_unit).astype(np.int64)
    out = counts.view(out_dtype)
    out[bad] = np.array("NaT", out_dtype)  # (numpy 2.5 deprecates a unitless NaT)
    return out


def decode_cf(
    raw: np.ndarray, attrs: Mapping[str, Any], fill_value: Any = None, *, name: str = ""
) -> np.ndarray:
    """Decode coordinate values as stored, with their CF attributes (see the module docstring).

    ``fill_value`` is a ``_FillValue`` that does not sit in ``attrs`` (a zarr v2 array's own
    fill value); ``name`` goes into error messages. Returns a new array.
    """
    values = np.asarray(raw)
    if values.dtype.kind not in "iufb":
        return values.copy()
    missing = missing_mask(values, encoded_fills(attrs, values.dtype, fill_value))
    scale, offset = attrs.get("scale_factor"), attrs.get("add_offset")
    if (
        scale is not None
        or offset is not None
        or (missing is not None and values.dtype.kind != "f" and not is_cf_time(attrs))
    ):  # (integer CF times stay integers: nanosecond counts do not fit a float exactly)
        values = values.astype(np.float64)
        if scale is not None:
            values = values * float(scale)
        if offset is not None:
            values = values + float(offset)
    if is_cf_time(attrs):
        return _decode_time(values, missing, str(attrs["units"]), attrs.get("calendar"), name)
    if is_cf_timedelta(attrs):
        return _decode_timedelta(values, missing, str(attrs["units"]), str(attrs["dtype"]))
    if missing is not None and missing.any():
        values = values.astype(np.float64 if values.dtype.itemsize > 4 else np.float32)
        values[missing] = np.nan
    return values.copy() if values is raw else values
