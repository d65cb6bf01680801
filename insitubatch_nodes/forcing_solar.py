"""The Sun's position and the solar forcings: ``cos_solar_zenith`` and
``toa_incident_solar_radiation`` (the formulas: :mod:`~insitubatch_nodes.forcings`' docstring),
and :func:`solar_into`, which writes either into a float32 array in blocks of bounded scratch.

Each function works in float64 over the whole of its arguments at once:
``toa_incident_solar_radiation`` peaks at about 5 float64 arrays of its output's shape beside it
(measured with ``tracemalloc``: 294 MiB over 8 times of ERA5's 0.25° grid, 2.4 MiB over 8 times of
64 x 128; on a grid of points, where every term is per point, about 15), ``cos_solar_zenith`` at
about 2. :func:`solar_into` (what :class:`~insitubatch_nodes.forcings.Forcings` computes with)
evaluates them over blocks of at most :data:`SOLAR_BLOCK` points x times, so its scratch is at
most :data:`SOLAR_SCRATCH_BYTES` whatever the batch and the grid (before 2026-12-07 a batch's new
times were computed at once: scratch proportional to the batch, which no memory check counted).
The values are the same to the bit (elementwise formulas); the blocks are no slower (8 times of
0.25°: 571 against 3,508 ms at once; of 64 x 128: 2.5 against 2.2 ms; best of 3 on a loaded
2-core VM).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from insitubatch_nodes.forcing_calendar import instants, native
from insitubatch_nodes.io.timeunits import as_timedelta

__all__ = [
    "PIECE_SECONDS",
    "SOLAR_BLOCK",
    "SOLAR_IRRADIANCE",
    "SOLAR_NAMES",
    "SOLAR_SCRATCH_BYTES",
    "accumulation_period",
    "cos_solar_zenith",
    "solar_into",
    "toa_incident_solar_radiation",
]

SOLAR_NAMES = ("toa_incident_solar_radiation", "cos_solar_zenith")
"""The forcings computed from the Sun's position (:func:`solar_into` computes them)."""
SOLAR_BLOCK = 1 << 15
"""The most points x times :func:`solar_into` evaluates at once (a block's rows of one time, or
whole fields of several)."""
SOLAR_SCRATCH_BYTES = 8 * 2**20
"""The most scratch :func:`solar_into` takes: the float64 temporaries of one block (measured at
:data:`SOLAR_BLOCK`: ``toa_incident_solar_radiation`` 1.6 MiB on a latitude-longitude grid, 4.0
MiB on a grid of points, where every term is per point, with ``period="6h"``), with room."""

SOLAR_IRRADIANCE = 1361.0  # W m-2, the reference total solar irradiance
PIECE_SECONDS = 3600.0  # the longest span integrated with one declination and distance
_J2000 = np.datetime64("2000-01-01T12:00:00", "s")


def _days_since_j2000(times: np.ndarray) -> np.ndarray:
    t = instants(times)  # (cftime dates of the standard calendars: their instants)
    if t.dtype.kind != "M":
        raise TypeError(
            f"solar forcings need times as numpy datetime64, got dtype {t.dtype}; a non-standard "
            "calendar's cftime dates have no solar position here (local_time_* and "
            "year_progress_* take them, in their own calendar)"
        )
    delta = (native(t) - _J2000) / np.timedelta64(1, "D")  # (in ns only where t is)
    return np.where(np.isnat(t), np.nan, delta)  # a missing time: NaN, not NaT's int64


def _sun(days: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(sin δ, cos δ, Greenwich hour angle of the Sun in radians, distance in AU)``."""
    rad = np.pi / 180.0
    g = (357.529 + 0.98560028 * days) * rad
    q = (280.459 + 0.98564736 * days) * rad
    ecliptic = q + (1.915 * np.sin(g) + 0.020 * np.sin(2 * g)) * rad
    distance = 1.00014 - 0.01671 * np.cos(g) - 0.00014 * np.cos(2 * g)
    obliquity = (23.439 - 0.00000036 * days) * rad
    sin_dec = np.sin(obliquity) * np.sin(ecliptic)
    ascension = np.arctan2(np.cos(obliquity) * np.sin(ecliptic), np.cos(ecliptic))
    gmst_hours = 18.697374558 + 24.06570982441908 * days
    hour_angle = (gmst_hours % 24.0) * 15.0 * rad - ascension
    return sin_dec, np.sqrt(1.0 - sin_dec**2), hour_angle, distance


def _grid(lat: Any, lon: Any, points: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Latitude ``(n_lat, 1)`` and longitude ``(1, n_lon)`` in radians; ``points``: both
    ``(1, n)``, point ``i`` at ``(lat[i], lon[i])``."""
    phi = np.radians(np.asarray(lat, dtype=np.float64)).reshape((1, -1) if points else (-1, 1))
    lam = np.radians(np.asarray(lon, dtype=np.float64)).reshape(1, -1)
    return phi, lam


def cos_solar_zenith(times: Any, lat: Any, lon: Any, *, points: bool = False) -> np.ndarray:
    """``cos θ`` (float64) at each time (any shape) and grid point: ``(*times.shape, n_lat,
    n_lon)`` for 1-D ``lat`` and ``lon`` in degrees; ``points=True``: ``(*times.shape, n)`` at
    the ``n`` points ``(lat[i], lon[i])`` of a grid of points."""
    days = _days_since_j2000(times)[..., None, None]
    phi, lam = _grid(lat, lon, points)
    sin_dec, cos_dec, hour, _ = _sun(days)
    cos_z = np.sin(phi) * sin_dec + np.cos(phi) * cos_dec * np.cos(hour + lam)
    return cos_z[..., 0, :] if points else cos_z


def toa_incident_solar_radiation(
    times: Any,
    lat: Any,
    lon: Any,
    *,
    period: Any = "1h",
    bins: int | None = None,
    irradiance: float = SOLAR_IRRADIANCE,
    points: bool = False,
) -> np.ndarray:
    """Top-of-atmosphere incident solar radiation, J m⁻², accumulated over the ``period``
    ending at each time (ERA5's ``tisr`` with ``period="1h"``): ``(*times.shape, n_lat,
    n_lon)`` float64 (``(*times.shape, n)`` with ``points=True``, as :func:`cos_solar_zenith`;
    ``ValueError`` for a period that is not positive). Integrated in closed
    form (module docstring); ``bins=N`` uses the
    trapezoidal rule over ``N`` sub-steps instead (N + 1 evaluations of the flux, for checks)."""
    seconds = accumulation_period(period) / np.timedelta64(1, "s")
    days = _days_since_j2000(times)[..., None, None]
    phi, lam = _grid(lat, lon, points)
    if bins is not None:
        total = _trapezoid(days, phi, lam, seconds, int(bins), irradiance)
        return total[..., 0, :] if points else total
    # the declination and distance are held for at most an hour: a longer period is the sum
    # of its pieces (over a day at the equinox they move 0.4°: polar sums were 3 % off)
    pieces = max(1, math.ceil(seconds / PIECE_SECONDS))
    step = seconds / pieces
    total = _closed_form(days, phi, lam, step, irradiance)
    for k in range(1, pieces):
        total = total + _closed_form(days - k * step / 86_400.0, phi, lam, step, irradiance)
    return total[..., 0, :] if points else total


def accumulation_period(period: Any) -> np.timedelta64:
    """The accumulation period as a ``timedelta64``; ``ValueError`` unless it is positive."""
    span = as_timedelta(period, "the accumulation period")
    if not span > np.timedelta64(0, "s"):
        raise ValueError(f"the accumulation period must be positive, got {period!r}")
    return span


def _closed_form(
    days: np.ndarray, phi: np.ndarray, lam: np.ndarray, seconds: float, irradiance: float
) -> np.ndarray:
    """The radiation over the ``seconds`` ending at ``days``, the declination and distance
    taken at the middle (module docstring)."""
    half = seconds / 2 / 86_400.0
    sin_dec, cos_dec, _, distance = _sun(days - half)  # the period's middle
    _, _, h0, _ = _sun(days - 2 * half)
    _, _, h1, _ = _sun(days)
    nominal = 2 * np.pi * seconds / 86_400.0  # the hour angle turns once a solar day
    h1 = h0 + nominal + ((h1 - h0 - nominal + np.pi) % (2 * np.pi) - np.pi)
    a = np.sin(phi) * sin_dec  # cos θ = a + b cos h
    b = np.cos(phi) * cos_dec
    # the Sun is up where cos h > -a / b: |h| < w (mod 2π); w = π: all day, w = 0: never
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.arccos(np.clip(np.where(b > 0, -a / b, np.where(a > 0, -1.0, 1.0)), -1.0, 1.0))
    sin_w = np.sin(w)
    day = 2 * (a * w + b * sin_w)  # ∫ over one whole turn of the hour angle

    # the local hour angle h + λ over the period
    integral = _turn_integral(h0 + lam, h1 + lam, a, b, w, sin_w, day)
    rate = (h1 - h0) / seconds  # radians of hour angle per second
    return irradiance / distance**2 * integral / rate


def _turn_integral(
    lo: np.ndarray,
    hi: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    w: np.ndarray,
    sin_w: np.ndarray,
    day: np.ndarray,
) -> np.ndarray:
    """``∫_lo^hi max(0, a + b cos x) dx`` with ``w = arccos(-a/b)`` (clipped to [0, π]) and
    ``day`` its integral over one turn, for ``lo <= hi``, elementwise."""

    def cumulative(h: np.ndarray) -> np.ndarray:
        turns = np.floor((h + np.pi) / (2 * np.pi))
        x = h - 2 * np.pi * turns  # in [-π, π)
        inside = np.clip(x, -w, w)
        part = np.where(x > -w, a * (inside + w) + b * (np.sin(inside) + sin_w), 0.0)
        return turns * day + part

    return cumulative(hi) - cumulative(lo)


def _trapezoid(
    days: np.ndarray, phi: np.ndarray, lam: np.ndarray, seconds: float, bins: int, irradiance: float
) -> np.ndarray:
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    total = np.zeros(np.broadcast_shapes(days.shape, phi.shape, lam.shape))
    for k in range(bins + 1):
        at = days - (seconds / 86_400.0) * (1.0 - k / bins)
        sin_dec, cos_dec, hour, distance = _sun(at)
        cos_z = np.sin(phi) * sin_dec + np.cos(phi) * cos_dec * np.cos(hour + lam)
        weight = 0.5 if k in (0, bins) else 1.0
        total += weight * np.maximum(cos_z, 0.0) / distance**2
    return irradiance * total * (seconds / bins)


def solar_into(
    out: np.ndarray,
    name: str,
    times: np.ndarray,
    lat: Any,
    lon: Any,
    *,
    points: bool = False,
    **kwargs: Any,
) -> np.ndarray:
    """Write forcing ``name`` (one of :data:`SOLAR_NAMES`) at the 1-D ``times`` into ``out``
    (float32, ``(len(times), n_lat, n_lon)``; ``(len(times), n)`` with ``points``), evaluated
    over blocks of at most :data:`SOLAR_BLOCK` points x times (whole fields of several times
    where a field is smaller, else rows of latitude — points — of one time), so that the float64
    scratch stays under :data:`SOLAR_SCRATCH_BYTES`; ``kwargs`` go to
    :func:`toa_incident_solar_radiation` (``period``, ``bins``, ``irradiance``). Returns
    ``out``. The values are those of the function over all of them at once, cast to float32."""
    fn: Any = toa_incident_solar_radiation if name == SOLAR_NAMES[0] else cos_solar_zenith
    if name == SOLAR_NAMES[1]:
        kwargs = {}
    lat, lon = np.asarray(lat), np.asarray(lon)
    n = len(lon) if points else len(lat) * len(lon)
    if len(times) == 0 or n <= SOLAR_BLOCK:  # whole fields, several times a block
        step = max(1, SOLAR_BLOCK // max(1, n))
        for i in range(0, max(1, len(times)), step):
            out[i : i + step] = fn(times[i : i + step], lat, lon, points=points, **kwargs)
        return out
    width = len(lon) if not points else 1  # points x times per row of a block
    rows = max(1, SOLAR_BLOCK // width)
    for i in range(len(times)):
        for r in range(0, len(lon) if points else len(lat), rows):
            part = slice(r, r + rows)
            at = (lat[part], lon[part]) if points else (lat[part], lon)
            out[i, part] = fn(times[i : i + 1], *at, points=points, **kwargs)[0]
    return out
