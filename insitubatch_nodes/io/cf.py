"""CF value rules: which stored values are missing, and how packed values unpack, as xarray reads.

A store converted from netCDF with xarray keeps its CF encoding: an ERA5 field packed as
``int16`` with ``scale_factor`` / ``add_offset`` and a ``_FillValue``, a float field whose
missing points hold ``_FillValue = -9999`` or ``missing_value``. ``xr.open_zarr(store)`` decodes
them (``mask_and_scale=True``, its default); :func:`cf_values` states that decoding for one
data array, once, and :class:`CFValues` applies it to decoded chunks, vectorised, in xarray's
order and arithmetic, so the values are xarray's to the bit:

* **Fill values.** ``missing_value`` and ``_FillValue`` (each a number or a list; a NaN one
  masks nothing) mark missing points, which decode to NaN. On zarr v3 only the attributes count;
  on zarr v2 xarray reads the array's own ``fill_value`` as its ``_FillValue`` — here too, for
  arrays xarray can open (those with ``_ARRAY_DIMENSIONS``) that are float or packed. *One
  difference:* a v2 **integer** array that is not packed keeps its integers (zarr's default
  fill ``0`` of a label image or a counts image is no missing value); xarray would give floats
  with NaN at every 0.
* **Packing.** ``x * scale_factor + add_offset`` (either may be absent), after masking.
* **dtype.** xarray's ``_choose_float_dtype`` for packed arrays: ``scale_factor`` and
  ``add_offset`` both floats of one type give that type (``float64`` for JSON attributes, as a
  zarr store holds them; ``float64`` whatever they are for 32-bit integers); an ``add_offset``
  otherwise gives ``float64``; a ``scale_factor`` alone its own type. Masked, unpacked arrays
  are promoted as xarray promotes them: floats keep their dtype, integers of at most 2 bytes
  become ``float32``, wider ones ``float64``.
* **``_Unsigned``** (``"true"`` on a signed integer array, ``"false"`` on an unsigned one, as
  netCDF-3 writes bytes) reinterprets the stored integers before anything else.
* Arrays whose ``units`` are CF times (``"hours since ..."``) are data here, delivered as
  stored; coordinates decode them (:mod:`~insitubatch_nodes.io.coords`).

Rules shared with coordinates (:func:`fill_scalar`, :func:`encoded_fills`,
:func:`missing_mask`) live here once.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from insitubatch_nodes.io.timeunits import NUMPY_UNIT_NAMES

__all__ = [
    "CFValues",
    "cf_values",
    "decoded_dtype_option",
    "decoding_text",
    "encoded_fills",
    "fill_scalar",
    "is_cf_time",
    "is_cf_timedelta",
    "listed_coordinates",
    "missing_mask",
]

#: CF time units, ``"<unit> since <reference date>"``
UNITS_RE = re.compile(r"^\s*(?P<unit>[A-Za-z_]+)\s+since\s+(?P<ref>.+?)\s*$", re.IGNORECASE)


#: the ``units`` of durations xarray decodes, and their numpy unit (its numpy route's words)
TIMEDELTA_UNITS = NUMPY_UNIT_NAMES


def is_cf_timedelta(attrs: Mapping[str, Any]) -> bool:
    """Whether ``attrs`` are those of durations as xarray writes them (a lead time's): ``units``
    of :data:`TIMEDELTA_UNITS` and a ``dtype`` attribute ``"timedelta64[...]"``, which is what
    xarray decodes by default."""
    if attrs.get("units") not in TIMEDELTA_UNITS or not str(attrs.get("dtype")).startswith(
        "timedelta64["
    ):
        return False
    try:
        unit = np.datetime_data(np.dtype(str(attrs["dtype"])))[0]
    except TypeError:
        return False
    return unit in TIMEDELTA_UNITS.values()  # (a fixed length: not Y, M or generic)


def is_cf_time(attrs: Mapping[str, Any]) -> bool:
    """Whether ``attrs`` are a CF time variable's (``units`` like ``hours since 2000-01-01``)."""
    units = attrs.get("units")
    return isinstance(units, str) and bool(UNITS_RE.match(units))


def listed_coordinates(arrays: Mapping[str, Any]) -> set[str]:
    """The paths the CF ``coordinates`` attribute of ``arrays`` (path -> zarr array) names,
    each in its array's group: auxiliary coordinates (a rotated or projected grid's 2-D ``lat``
    and ``lon``, a forecast's ``valid_time``), which xarray reads as coordinates, not data."""
    out: set[str] = set()
    for path, array in arrays.items():
        names = array.attrs.get("coordinates")
        if isinstance(names, str):
            group = path.rpartition("/")[0]
            out.update(f"{group}/{name}" if group else name for name in names.split())
    return out


def fill_scalar(value: Any, dtype: np.dtype[Any]) -> Any:
    """A ``_FillValue`` as a number (xarray writes float ones to v3 as base64 of ``<d``), or
    ``None`` when it is not one."""
    if isinstance(value, str) and dtype.kind == "f":
        special = {"nan": math.nan, "infinity": math.inf, "-infinity": -math.inf}
        if value.lower() in special:
            return special[value.lower()]
        try:
            return struct.unpack("<d", base64.standard_b64decode(value))[0]
        except (ValueError, struct.error):
            return None
    if isinstance(value, (list, tuple, str, bytes)) or value is None:
        return None
    return value.item() if isinstance(value, np.generic) else value


def encoded_fills(
    attrs: Mapping[str, Any], dtype: np.dtype[Any], fill_value: Any = None
) -> tuple[Any, ...]:
    """The values that mark a missing point: ``missing_value`` and ``_FillValue`` of ``attrs``
    (``fill_value`` stands in for an absent ``_FillValue``: a zarr v2 array's own), each a
    number or a list of them, as numbers of ``dtype``'s kind. Duplicates and unreadable values
    are dropped; a NaN is kept (it marks NaN missing)."""
    out: list[Any] = []
    for given in (attrs.get("missing_value"), attrs.get("_FillValue", fill_value)):
        if given is None:
            continue
        for f in np.ravel(np.asarray(given, dtype=object)).tolist():
            f = fill_scalar(f, dtype)
            if f is None or any(_same(f, o) for o in out):
                continue
            out.append(f)
    return tuple(out)


def _same(a: Any, b: Any) -> bool:
    nan_a = isinstance(a, float) and math.isnan(a)
    nan_b = isinstance(b, float) and math.isnan(b)
    return bool(nan_a and nan_b) or (not nan_a and not nan_b and a == b)


def missing_mask(values: np.ndarray, fills: tuple[Any, ...]) -> np.ndarray | None:
    """Where ``values`` hold one of ``fills`` (NaN matches NaN), or ``None`` for no fills."""
    missing: np.ndarray | None = None
    for f in fills:
        if isinstance(f, float) and math.isnan(f):
            if values.dtype.kind not in "fc":
                continue
            hit = np.isnan(values)
        else:
            hit = np.equal(values, f)
        missing = hit if missing is None else np.logical_or(missing, hit, out=missing)
    return missing


def _scalar(value: Any) -> Any:
    """An attribute given as a list of one value, as that value (as xarray takes it)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value.item() if isinstance(value, np.generic) else value


def choose_float_dtype(dtype: np.dtype[Any], scale: Any, offset: Any) -> np.dtype[Any]:
    """xarray's ``_choose_float_dtype``: the dtype ``dtype`` values decode to, packed with
    ``scale`` / ``offset`` (either ``None``), or merely masked (both ``None``)."""
    if scale is not None or offset is not None:
        scale_type = np.dtype(type(scale)) if scale is not None else None
        offset_type = np.dtype(type(offset)) if offset is not None else None
        if (
            scale is not None
            and offset is not None
            and offset_type == scale_type
            and scale_type in (np.dtype(np.float32), np.dtype(np.float64))
        ):
            if dtype.itemsize == 4 and dtype.kind in "iu":
                return np.dtype(np.float64)
            return np.dtype(scale_type)
        if offset is not None:
            return np.dtype(np.float64)
        assert scale_type is not None
        return scale_type
    if dtype.kind == "f" and dtype.itemsize <= 4:
        return np.dtype(np.float32)
    if dtype.kind in "iu" and dtype.itemsize <= 2:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


@dataclass(frozen=True)
class CFValues:
    """How one data array's stored values decode (see the module docstring).

    ``stored`` is the dtype zarr decodes (native byte order), ``dtype`` what the values decode
    to; ``fills`` the encoded values that mean missing (NaN after decoding); ``scale`` and
    ``offset`` the packing (``None`` when absent); ``unsigned`` the integer dtype ``_Unsigned``
    reinterprets the stored integers as (``None``: as stored)."""

    stored: np.dtype[Any]
    dtype: np.dtype[Any]
    fills: tuple[Any, ...] = ()
    scale: Any = None
    offset: Any = None
    unsigned: np.dtype[Any] | None = None

    @property
    def in_place(self) -> bool:
        """Whether decoding only masks values in place (no cast, no packing): a chunk can be
        decoded straight into its destination, then masked there."""
        return (
            self.stored == self.dtype
            and self.unsigned is None
            and self.scale is None
            and self.offset is None
        )

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The rule as plain JSON values (what a persistent cache keys its chunks by)."""
        return {
            "dtype": self.dtype.str,
            "fills": [repr(f) for f in self.fills],
            "scale": repr(self.scale),
            "offset": repr(self.offset),
            "unsigned": None if self.unsigned is None else self.unsigned.str,
        }

    def in_dtype(self, dtype: np.dtype[Any]) -> CFValues:
        """This rule decoding into the float ``dtype`` instead (``cf_dtype``). ``ValueError``
        where packed integers decode past its largest value (ERA5's pressure, about 1e5 Pa,
        in float16): the stored range unpacked, or the integers cast to it before unpacking,
        would be inf."""
        values = self.unsigned if self.unsigned is not None else self.stored
        packed = self.scale is not None or self.offset is not None
        if packed and values.kind in "iu":
            info, top = np.iinfo(values), float(np.finfo(dtype).max)
            ends = np.array([info.min, info.max], np.float64)
            unpacked = ends * (1.0 if self.scale is None else self.scale) + (self.offset or 0.0)
            reach = float(max(np.abs(unpacked).max(), np.abs(ends).max()))
            if reach > top:
                raise ValueError(
                    f"its packed values unpack up to {reach:.6g}, past the largest {dtype} "
                    f"({top:.6g}): decoded in {dtype} they would be inf. Open it with "
                    "cf_dtype='float32' (or without cf_dtype)"
                )
        return dataclasses.replace(self, dtype=dtype)

    def decode_into(self, raw: np.ndarray, out: np.ndarray) -> None:
        """Write the decoded values of ``raw`` (stored values, ``stored`` dtype) into ``out``
        (``dtype``, the same shape; ``out`` may be ``raw`` itself when :attr:`in_place`): one
        pass that casts and scales, one that offsets, one that masks."""
        if self.unsigned is not None:
            raw = raw.view(self.unsigned)
        missing = missing_mask(raw, self.fills)
        dtype = out.dtype
        if self.scale is not None:
            np.multiply(raw, self.scale, out=out, dtype=dtype, casting="unsafe")
            if self.offset is not None:
                np.add(out, self.offset, out=out, dtype=dtype, casting="unsafe")
        elif self.offset is not None:
            np.add(raw, self.offset, out=out, dtype=dtype, casting="unsafe")
        elif out is not raw:
            np.copyto(out, raw, casting="unsafe")
        if missing is not None:
            np.copyto(out, np.nan, where=missing)

    def decode(self, raw: np.ndarray) -> np.ndarray:
        """The decoded values of ``raw`` as a new array."""
        out = np.empty(np.shape(raw), self.dtype)
        self.decode_into(np.asarray(raw, self.stored), out)
        return out

    def decoded_fill(self, fill_value: Any) -> Any:
        """What a stored object that is absent (zarr reads ``fill_value``) decodes to."""
        return self.decode(np.array([fill_value], self.stored))[0]


def cf_values(
    attrs: Mapping[str, Any],
    stored: np.dtype[Any],
    fill_value: Any,
    zarr_format: int,
) -> CFValues | None:
    """How the values of a data array with ``attrs``, numpy dtype ``stored`` (native byte
    order) and zarr fill value ``fill_value`` decode, or ``None`` when they are delivered as
    stored (no CF encoding; NaN-only fills of a float array; non-numeric values; CF times).
    ``ValueError`` for a ``scale_factor`` or ``add_offset`` that is no number (a string, a
    bool, a list of several)."""
    stored = np.dtype(stored)
    if stored.kind not in "iuf":
        return None
    if is_cf_time(attrs):
        return None
    scale, offset = _scalar(attrs.get("scale_factor")), _scalar(attrs.get("add_offset"))
    for name, value in (("scale_factor", scale), ("add_offset", offset)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(
                f"its {name} {attrs[name]!r} is not a number, so its values cannot be "
                "unpacked: correct the attribute, or read the stored values with "
                "open_geometries(store, mask_and_scale=False)"
            )
    packed = scale is not None or offset is not None
    unsigned: np.dtype[Any] | None = None
    flag = str(attrs.get("_Unsigned", "")).lower()
    if stored.kind == "i" and flag == "true":
        unsigned = np.dtype(f"u{stored.itemsize}")
    elif stored.kind == "u" and flag == "false":
        unsigned = np.dtype(f"i{stored.itemsize}")
    values = stored if unsigned is None else unsigned
    v2_fill = None
    if zarr_format == 2 and "_ARRAY_DIMENSIONS" in attrs and (packed or stored.kind == "f"):
        v2_fill = fill_value  # xarray's reading of a v2 fill value (not an int image's 0)
    fills = encoded_fills(attrs, stored, v2_fill)
    if unsigned is not None:  # the fills as the reinterpreted integers
        fills = tuple(
            int(np.array(f, stored).view(unsigned)) if isinstance(f, int) else f for f in fills
        )
    fills = tuple(f for f in fills if not (isinstance(f, float) and math.isnan(f)))
    if not fills and not packed:
        if unsigned is None:
            return None
        return CFValues(stored, unsigned, unsigned=unsigned)
    if packed:
        dtype = choose_float_dtype(values, scale, offset)
        if fills and dtype.kind != "f":  # (an integer scale_factor: NaN needs a float)
            dtype = np.dtype(np.float64)
    else:
        dtype = values if values.kind == "f" else choose_float_dtype(values, None, None)
    return CFValues(stored, dtype, fills, scale, offset, unsigned)


def decoded_dtype_option(cf_dtype: Any, mask_and_scale: bool) -> np.dtype[Any] | None:
    """The decoding options of ``open_geometries``, the collections and ``open_plate``,
    checked: ``mask_and_scale`` a bool (``TypeError`` otherwise), and ``cf_dtype`` returned as
    ``None`` or a float dtype (native byte order); ``TypeError`` for what is no dtype,
    ``ValueError`` for another kind, or beside ``mask_and_scale=False`` (which decodes
    nothing)."""
    if not isinstance(mask_and_scale, bool):
        raise TypeError(f"mask_and_scale is True or False, got {mask_and_scale!r}")
    if cf_dtype is None:
        return None
    try:
        dtype = np.dtype(cf_dtype)
    except TypeError as exc:
        raise TypeError(f"cf_dtype is a float dtype such as 'float32', got {cf_dtype!r}") from exc
    if dtype.kind != "f":
        raise ValueError(f"cf_dtype is a float dtype such as 'float32', got {dtype}")
    if not mask_and_scale:
        raise ValueError(
            "cf_dtype is the dtype decoded values are delivered in, and mask_and_scale=False "
            "decodes nothing: drop one of them"
        )
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def decoding_text(mask_and_scale: bool, cf_dtype: Any) -> str:
    """Decoding options as messages name them: ``"mask_and_scale=False"``,
    ``"cf_dtype=float32"`` or ``"the default decoding"``."""
    if not mask_and_scale:
        return "mask_and_scale=False"
    return "the default decoding" if cf_dtype is None else f"cf_dtype={cf_dtype}"
