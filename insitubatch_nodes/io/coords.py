"""Coordinates along the sample axis: read once, CF-decoded, looked up by value, carried per row.

A *coordinate* here is a 1-D array along an array's sample axis — ``time`` for a reanalysis,
``z`` for a stack — that says where each sample sits. :func:`open_coordinates` reads one through
zarr (it is small: one array of ``n_samples`` values) and decodes it with the store's own
attributes as xarray does (:func:`~insitubatch_nodes.io.cf_decode.decode_cf`: missing values,
packing, CF times in any calendar, durations).

A :class:`Coordinate` turns a value window into a sample window (:meth:`Coordinate.index_range`,
what ``split_by_chunk(..., coord=...)`` uses; dates compared in their own calendar), and
:class:`~insitubatch_nodes.stages.gather.GatherNode`
indexes its values with each batch's sample indices to deliver ``batch.coords``.
:func:`time_offsets` counts a time coordinate's values in a unit since an epoch, in its own
calendar: what strides and windows given as time deltas compare.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from insitubatch_nodes.errors import CoordinateLengthError
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.anemoi import DATES, variable_names
from insitubatch_nodes.io.calendars import (
    CF_CALENDARS,
    DATETIME64_CALENDARS,
    calendar_of,
    counts_us,
    date_in,
    elapsed_ticks,
)
from insitubatch_nodes.io.cf import is_cf_time, is_cf_timedelta
from insitubatch_nodes.io.cf_decode import decode_cf
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store, retry_policy
from insitubatch_nodes.io.timeunits import NS_PER_UNIT, as_timedelta

__all__ = [
    "MISSING_OFFSET",
    "Coordinate",
    "FieldCoordinates",
    "coordinate_reader",
    "decode_cf",
    "open_coordinates",
    "time_offsets",
]

log = logging.getLogger(__name__)

MISSING_OFFSET: int = int(np.iinfo(np.int64).min)
""":func:`time_offsets` of a missing time (``NaT`` / ``None``): ``NaT``'s own ``int64`` pattern."""


@dataclass(frozen=True, eq=False)
class Coordinate:
    """A 1-D coordinate along the sample axis: ``values[i]`` is where sample ``i`` sits.

    ``values`` is decoded (``datetime64[ns]`` or cftime dates for CF time; see
    :mod:`~insitubatch_nodes.io.cf_decode`) and read-only; ``path`` is the array it was read
    from (``""`` for one built by hand from values, e.g. ones decoded by xarray) and ``attrs``
    its attributes.
    """

    name: str
    values: np.ndarray
    path: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    _calendar: str | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        values = np.array(self.values)  # a private copy: nobody can change ours
        if values.ndim != 1:
            raise ValueError(
                f"coordinate {self.name!r} must be 1-D (one value per sample), got shape "
                f"{values.shape}"
            )
        values.setflags(write=False)
        object.__setattr__(self, "values", values)
        try:
            cal = "proleptic_gregorian" if values.dtype.kind == "M" else calendar_of(values)
        except ValueError as exc:
            raise ValueError(f"coordinate {self.name!r}: {exc}") from exc
        object.__setattr__(self, "_calendar", cal)

    def __len__(self) -> int:
        return len(self.values)

    @property
    def is_time(self) -> bool:
        """True for dates: ``datetime64`` values, or cftime dates of one calendar (``None`` for
        a missing one)."""
        return self._calendar is not None

    @property
    def is_duration(self) -> bool:
        """True for durations (``timedelta64`` values: a lead time), counted from 0."""
        return self.values.dtype.kind == "m"

    @property
    def calendar(self) -> str | None:
        """The dates' calendar as cftime names it (``"proleptic_gregorian"`` for ``datetime64``
        values, ``"noleap"``, ``"360_day"``, ``"standard"``, ... for cftime dates); ``None``
        when the values are not dates."""
        return self._calendar

    @property
    def decreasing(self) -> bool:
        """Whether the values run backwards along the samples (newest first, as some archives
        are written): most consecutive present values decrease (a missing value, and a value
        that is no number nor date, is skipped). ``split_by_chunk(..., coord=)`` splits in
        the values' order by it, lowest (earliest) first. One vectorised pass (a pass in
        Python over cftime dates)."""
        v, bad = self.values, self._missing()
        present = v if bad is None else v[~bad]
        if present.dtype == object and self.is_time:
            keys = counts_us(present)
        elif present.dtype.kind in "Mm":
            keys = present.view(np.int64)
        elif present.dtype.kind in "iuf":
            keys = present
        else:
            return False
        d = np.diff(keys)
        return int((d < 0).sum()) > int((d > 0).sum())

    def _bound(self, x: Any, what: str) -> Any:
        if self.is_duration:  # "6h", numpy timedelta64, datetime.timedelta (pd.Timedelta)
            return as_timedelta(x, f"{what} for duration coordinate {self.name!r}")
        if self.is_time:
            if isinstance(x, (bool, int, float, np.number)) or x is None:
                raise TypeError(
                    f"{what} for time coordinate {self.name!r} must be a date "
                    f"(numpy datetime64, datetime or an ISO string like '2020-01-01'), got {x!r}"
                )
            if self.values.dtype == object:  # cftime dates: read x in their calendar
                like = next(v for v in self.values if v is not None)
                assert self._calendar is not None
                return date_in(x, self._calendar, like, f"{what} for coordinate {self.name!r}")
            calendar = getattr(x, "calendar", None)  # a cftime date: of a numpy calendar only
            if isinstance(calendar, str) and CF_CALENDARS.get(calendar) not in DATETIME64_CALENDARS:
                raise TypeError(
                    f"{what} {x!r} is a date of calendar {calendar!r}, the coordinate's is "
                    f"{self._calendar or 'standard'!r} (datetime64 dates): give a date of its "
                    "calendar or an ISO string"
                )
            if isinstance(x, _dt.datetime) and x.tzinfo is not None:
                x = x.astimezone(_dt.UTC).replace(tzinfo=None)
            try:
                value = np.datetime64(x.strip() if isinstance(x, str) else x)
            except (ValueError, TypeError) as exc:
                raise ValueError(
                    f"{what} {x!r} is not a date: write it as numpy datetime64, "
                    "datetime or ISO 8601 ('2020-01-01', '2020-01-01T06:00')"
                ) from exc
            if np.isnat(value):
                raise ValueError(f"{what} is NaT: give a date")
            return value
        if self.values.dtype.kind not in "iuf":
            raise TypeError(
                f"coordinate {self.name!r} holds {self.values.dtype} values: a value window "
                "needs numbers or dates"
            )
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
            raise TypeError(f"{what} for coordinate {self.name!r} must be a number, got {x!r}")
        if not math.isfinite(float(x)):
            raise ValueError(f"{what} must be finite, got {x!r}")
        return x

    def dates(self, values: Sequence[Any], what: str = "a date") -> np.ndarray:
        """``values`` (dates as numpy ``datetime64``, ``datetime``, ISO strings or cftime dates)
        read as dates of this time coordinate: ``datetime64`` values or cftime dates of its
        calendar, as :meth:`index_range` reads a bound (``TypeError``/``ValueError`` naming
        ``what`` for one that is not a date of it)."""
        if not (self.is_time or self.is_duration):
            raise TypeError(f"coordinate {self.name!r} holds no dates")
        out = [self._bound(x, what) for x in values]
        if self.is_duration:  # (durations, read as the coordinate's values, "6h" and the like)
            return np.array(out, dtype="m8[ns]")
        if self.values.dtype == object:
            arr = np.empty(len(out), dtype=object)
            arr[:] = out
            return arr
        return np.array(out, dtype="datetime64[ns]")

    def _missing(self) -> np.ndarray | None:
        v = self.values
        if v.dtype.kind in "Mm":
            return np.isnat(v)
        if v.dtype.kind == "f":
            return np.isnan(v)
        return np.array([x is None for x in v], bool) if self.is_time else None

    def index_range(self, start: Any, stop: Any) -> tuple[int, int]:
        """The half-open sample range ``[i0, i1)`` of the samples with ``start <= value < stop``.

        Half-open like index ranges and Python slices (unlike xarray's ``sel(slice(a, b))``,
        which includes ``b``): ``("2020-01-01", "2021-01-01")`` is all of 2020. The values must
        be monotonic (increasing or decreasing) and free of NaN/NaT/``None``, so that the window
        is one run of samples; ``start < stop`` whatever the direction. Bounds of cftime dates
        are read in their calendar (``"2000-02-30"`` is a ``360_day`` date), durations (a lead
        time) as ``"6h"``, ``numpy.timedelta64`` or ``datetime.timedelta``. Raises
        ``TypeError`` for a bound of the wrong kind (a number for a time coordinate, a date for
        a numeric one) and ``ValueError`` for a non-monotonic coordinate, a date the calendar
        lacks or a window holding no sample.
        """
        lo, hi = self._bound(start, "sample_range start"), self._bound(stop, "sample_range stop")
        if not lo < hi:
            turned = f": give sample_range=({stop!r}, {start!r})" if hi < lo else ""
            raise ValueError(
                f"sample_range on coordinate {self.name!r} needs start < stop, got "
                f"({start!r}, {stop!r}): the window is the values start <= value < stop, "
                "low end first whatever the coordinate's order (a slice of sel follows the "
                f"order of a descending coordinate; this does not){turned}"
            )
        bad = self._missing()
        v = self.values
        if bad is not None and bad.any():
            raise ValueError(
                f"coordinate {self.name!r} has missing values (first at sample "
                f"{int(np.argmax(bad))}): a value window needs a value for every sample; pass "
                "sample_range as sample indices instead (without coord)"
            )
        cf = self.is_time and v.dtype == object
        keys = counts_us(v) if cf else v.view(np.int64) if self.is_time else v
        if len(v) > 1:
            step = np.diff(keys)
            if not (bool(np.all(step >= 0)) or bool(np.all(step <= 0))):
                rising = bool(step[np.flatnonzero(step)[0]] > 0)
                at = int(np.flatnonzero(step < 0 if rising else step > 0)[0]) + 1
                raise ValueError(
                    f"coordinate {self.name!r} is not monotonic along the sample axis (sample "
                    f"{at} is {v[at]} after {v[at - 1]}): a value window is not one run of "
                    "samples there. Pass sample_range as sample indices instead (without coord)"
                )
        if cf:  # compare elapsed microseconds in the dates' own calendar
            lo, hi = counts_us(np.array([lo, hi], dtype=object)).tolist()
        elif self.is_time:  # compare in the values' own unit: a far bound must not overflow
            lo, hi = _ceil_to(lo, v.dtype), _ceil_to(hi, v.dtype)
            keys = v
        inside = np.flatnonzero((keys >= lo) & (keys < hi))
        if inside.size == 0:
            first, last = (v[0], v[-1]) if len(v) else ("-", "-")
            raise ValueError(
                f"no sample of coordinate {self.name!r} lies in [{start!r}, {stop!r}) (its values "
                f"run from {first} to {last})"
            )
        return int(inside[0]), int(inside[-1]) + 1


def time_offsets(
    times: Coordinate | np.ndarray, unit: Any, *, epoch: Any = "1970-01-01"
) -> np.ndarray:
    """Each time as an ``int64`` count of ``unit`` since ``epoch``, in the times' own calendar.

    ``times`` is a time :class:`Coordinate` or its values (``datetime64``, or cftime dates of one
    calendar with ``None`` for a missing one), or durations (``timedelta64``: a lead time),
    counted from 0 (``epoch`` unused). ``unit`` is a positive fixed length: ``"6h"``,
    ``"1D"``, ``"30min"``, ``"s"``, a ``numpy.timedelta64`` or ``datetime.timedelta``.
    ``epoch`` (default ``1970-01-01T00:00``) is a date read in the times' calendar as
    :meth:`Coordinate.index_range` reads a bound. Elapsed time is counted in the calendar: from
    ``2001-02-28T18`` to ``2001-03-01T00`` is ``1`` of ``"6h"`` in ``noleap`` and in
    ``standard``, ``9`` in ``360_day`` (which has 02-29 and 02-30). So the samples on a 6-hourly
    grid are ``time_offsets(t, "1h") % 6 == 0``, and a step of 6 h between samples ``i`` and
    ``j`` is ``off[j] - off[i] == 6`` in every calendar.

    A missing time gives :data:`MISSING_OFFSET` (``NaT``'s ``int64`` pattern). A time that is not
    a whole number of ``unit`` after ``epoch`` raises ``ValueError`` naming it (count in a finer
    unit, such as ``"1s"``, and divide); a count past ``int64`` raises ``OverflowError``.
    Vectorised: numpy arithmetic for ``datetime64``, one pass over the dates for cftime.
    """
    coord = times if isinstance(times, Coordinate) else Coordinate("times", np.asarray(times))
    if not (coord.is_time or coord.is_duration):
        raise TypeError(f"time_offsets needs dates or durations, got {coord.values.dtype} values")
    step = as_timedelta(unit, "unit")
    step_ns = int(step.astype("m8[ns]").astype(np.int64))
    if step_ns <= 0:
        raise ValueError(f"unit must be a positive length, got {unit!r}")
    v = coord.values
    missing = coord._missing()
    assert missing is not None
    out = np.full(len(v), MISSING_OFFSET, np.int64)
    if bool(missing.all()):
        return out
    if coord.is_duration:  # counted from 0, not from an epoch
        res, count = np.datetime_data(v.dtype)
        ticks, tick_ns = v[~missing].view(np.int64), NS_PER_UNIT[res] * count
    else:
        ticks, tick_ns = elapsed_ticks(v[~missing], coord._bound(epoch, "epoch"), repr(epoch))
    g = math.gcd(tick_ns, step_ns)
    scale, per = tick_ns // g, step_ns // g
    if ticks.size and float(np.abs(ticks).max()) * scale >= 2.0**63:
        raise OverflowError(f"times counted in {unit!r} since {epoch!r} overflow int64")
    counts, rest = np.divmod(ticks * scale, per)
    if rest.any():
        at = int(np.flatnonzero(~missing)[int(np.flatnonzero(rest)[0])])
        shown = v[at].isoformat() if hasattr(v[at], "isoformat") else v[at]  # cftime: all of it
        raise ValueError(
            f"time {shown} (sample {at}) is not a whole number of {unit!r} after {epoch!r}: "
            "count in a unit that divides every time's distance from the epoch (such as '1s')"
        )
    out[~missing] = counts
    return out


def _ceil_to(bound: np.datetime64, dtype: np.dtype[Any]) -> np.datetime64:
    """The smallest ``dtype`` value at or after ``bound`` (clamped to what ``dtype`` holds), so
    that ``v >= bound`` and ``v < bound`` can be decided in ``dtype``'s own unit."""
    unit = np.datetime_data(dtype)[0]
    info = np.iinfo(np.int64)
    # a margin inside int64's ends: numpy's casts between units overflow right at them
    first, last = np.array([info.min + 10**12, info.max - 10**12]).astype(f"M8[{unit}]")
    common = unit if NS_PER_UNIT.get(unit, 10**18) >= NS_PER_UNIT["s"] else "s"  # no finer than s
    b = bound.astype(f"M8[{common}]")
    if b < first.astype(f"M8[{common}]"):
        return first
    if b > last.astype(f"M8[{common}]"):
        return last
    tick = bound.astype(dtype)
    if tick < bound:  # (both near bound: representable in the finer unit)
        tick = tick + np.array(1).astype(f"m8[{unit}]")
    return tick


def candidate_paths(geom_path: str, name: str) -> list[str]:
    """Where a coordinate ``name`` of the array at ``geom_path`` may sit: a path with ``/`` is
    from the store root; a bare name is looked up in the array's group, then each parent."""
    if "/" in name.strip("/"):
        return [name.strip("/")]
    parts = geom_path.split("/")[:-1]
    return ["/".join([*parts[:i], name]) for i in range(len(parts), -1, -1)]


class _Reader:
    """Reads and decodes coordinate arrays of one store, each once, and keeps the metadata of
    every array it opened (:meth:`array`)."""

    def __init__(self, store: StoreLike, timeout_s: float | None = None) -> None:
        self.store = as_store(store)
        self.timeout_s = retry_policy(self.store).timeout_s if timeout_s is None else timeout_s
        self.arrays: dict[str, Any] = {}  # path -> the opened zarr array (None: not there)
        self.loaded: dict[str, Coordinate] = {}
        #: a collection view's path -> its coordinates read so far, joined from its members'
        self.joined: dict[str, dict[str, Coordinate]] = {}

    def find(self, geom: ArrayGeometry, name: str) -> tuple[str, Any] | None:
        """The first candidate path of ``name`` that holds an array, and that array."""
        for path in candidate_paths(geom.path, name):
            if self.array(path, geom.zarr_format) is not None:
                return path, self.arrays[path]
        return None

    def array(self, path: str, zarr_format: int | None = None) -> Any:
        """The zarr array at ``path`` (``None``: no array there), its metadata read once by
        this reader, or taken from an earlier read (``open_geometries``, the builder's store
        check). Raises what :func:`~insitubatch_nodes.io._zarr_compat.open_arrays_by_name`
        raises for unreadable metadata (then nothing is kept)."""
        if path not in self.arrays:
            opened = _zarr_compat.open_arrays_by_name(self.store, [path], zarr_format)
            self.arrays[path] = opened[0]
        return self.arrays[path]

    def arrays_of(self, paths: Sequence[str], zarr_format: int | None = None) -> list[Any]:
        """:meth:`array` of each of ``paths``, those not read yet read concurrently
        (:func:`~insitubatch_nodes.io._zarr_compat.open_arrays_by_name`: a collection's
        members, once per reader however many builds ask)."""
        unread = [p for p in dict.fromkeys(paths) if p not in self.arrays]
        if unread:
            opened = _zarr_compat.open_arrays_by_name(self.store, unread, zarr_format)
            self.arrays.update(zip(unread, opened, strict=True))
        return [self.arrays[p] for p in paths]

    def read_already(self, geom: ArrayGeometry) -> Coordinate | None:
        """``geom``'s dimension coordinate where this reader has read it already (``None``
        otherwise; a collection view's joined from its members): nothing is read here."""
        dim = _sample_dimension(geom)
        if dim is None:
            return None
        if geom.members is not None:
            return self.joined.get(geom.path, {}).get(dim)
        for path in candidate_paths(geom.path, dim):
            if path in self.loaded or self.arrays.get(path) is not None:
                return self.loaded.get(path)  # (the first path holding an array is the one)
        return None

    def load(self, path: str, array: Any) -> Coordinate:
        if path not in self.loaded:
            if array.ndim != 1:
                raise ValueError(
                    f"{path!r} in store {describe_store(self.store)} is not a 1-D coordinate "
                    f"array (shape {tuple(array.shape)})"
                )
            attrs = dict(array.attrs)
            # A zarr v2 array's own fill value (0 unless set) marks a missing *time*, as xarray
            # reads it; a place is never missing: a latitude, longitude or depth of 0 is a value
            # (anemoi-datasets writes `latitudes`/`longitudes` with fill value 0: every global
            # grid's points at 0 E read as NaN, so Forcings refused it). `_FillValue` masks all.
            timed = is_cf_time(attrs) or is_cf_timedelta(attrs)
            v2_fill = array.fill_value if int(array.metadata.zarr_format) == 2 and timed else None
            name = path.rsplit("/", 1)[-1]
            try:
                raw = _zarr_compat.read_whole_array(array, self.timeout_s)
            except Exception as exc:
                error = TimeoutError if isinstance(exc, TimeoutError) else OSError
                raise error(
                    f"cannot read coordinate {path!r} from store {describe_store(self.store)}: "
                    f"{exc}. Check the store, then build again; coords=() skips it for batches, "
                    "not for a time stride, time-delta windows or missing= (an int stride: none)"
                ) from exc
            values = decode_cf(raw, attrs, v2_fill, name=name)
            self.loaded[path] = Coordinate(name, values, path=path, attrs=attrs)
        return self.loaded[path]


def _sample_dimension(geom: ArrayGeometry) -> str | None:
    dims = geom.dims  # the metadata's, or its maker's (a collection's dims=); product axes: none
    return None if dims is None or geom.product is not None else dims[geom.sample_axis]


def _coordinates(
    reader: _Reader, geom: ArrayGeometry, names: Sequence[str] | None
) -> dict[str, Coordinate]:
    """The coordinates of ``geom``'s sample axis (``names=None``: its dimension coordinate)."""
    if geom.members is not None:  # a collection view: its members' own, joined
        joined = geom.members.joined(
            geom, reader, bool(names), lambda g: _coordinates(reader, g, names)
        )
        laid = {
            k: Coordinate(k, v, path=f"{geom.path}/{k}", attrs=attrs)
            for k, (v, attrs) in joined.items()
        }
        reader.joined.setdefault(geom.path, {}).update(laid)
        return laid
    dim = _sample_dimension(geom)
    where = f"store {describe_store(reader.store)}"
    if names is None:
        if dim is None:
            return {}
        found = reader.find(geom, dim) or reader.find(geom, DATES)  # (anemoi's name)
        if found is None:
            return {}
        path, array = found
        own = _zarr_compat.metadata_dimension_names(array.metadata)
        if array.ndim != 1 or (own != (dim,) and (own is not None or geom.dim_names is None)):
            return {}
        coord = reader.load(path, array)
        if len(coord) != geom.n_samples:  # (before 2026-12-07: left out without a word)
            raise CoordinateLengthError(path, len(coord), geom.path, geom.n_samples, dim)
        return {coord.name: coord}
    out: dict[str, Coordinate] = {}
    for name in names:
        if not isinstance(name, str) or not name.strip("/"):
            raise TypeError(f"coordinate names must be non-empty strings, got {name!r}")
        found = reader.find(geom, name)
        if found is None:
            raise KeyError(
                f"no coordinate array {name!r} for array {geom.path!r} in {where}: looked at "
                f"{candidate_paths(geom.path, name)}. Name an existing 1-D array, or pass "
                "coords=() to carry none"
            )
        path, array = found
        dims = _zarr_compat.metadata_dimension_names(array.metadata)
        if array.ndim == 1 and dim is not None and dims is not None and dims != (dim,):
            raise ValueError(
                f"coordinate {path!r} runs along dimension {dims[0]!r}, but the sample "
                f"axis of {geom.path!r} is {dim!r}: it is not a coordinate of the samples"
            )
        coord = reader.load(path, array)
        if len(coord) != geom.n_samples and dim is not None and dims == (dim,):
            raise CoordinateLengthError(path, len(coord), geom.path, geom.n_samples, dim)
        if len(coord) != geom.n_samples:
            raise ValueError(
                f"coordinate {path!r} has {len(coord)} values but {geom.path!r} has "
                f"{geom.n_samples} samples: it is not a coordinate of the sample axis"
            )
        key = name.strip("/").rsplit("/", 1)[-1]
        if key in out:
            raise ValueError(f"two coordinates named {key!r}: {out[key].path!r} and {path!r}")
        out[key] = coord
    return out


class FieldCoordinates:
    """Reads the coordinate of a field dimension (``level``, ``latitude``) of arrays in one
    store, each once: ``reader(geom, "level")`` is the decoded 1-D array named like the
    dimension, found as :func:`open_coordinates` finds the sample axis's (the array's group,
    then each parent); where there is none, the names of anemoi-datasets' ``variable``
    dimension, its group's ``variables`` attribute (:func:`~insitubatch_nodes.io.anemoi.
    variable_names`), read once per array and dimension (``sel`` in a loop reads nothing
    more). What :meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.sel` looks values up in;
    ``open_geometries`` gives the geometries it opens one, shared (over its ``coords_reader``
    where one is given). Picklable when the store is (the names read so far go with it)."""

    def __init__(self, store: StoreLike, reader: _Reader | None = None) -> None:
        self.store = as_store(store)
        self._reader: Any = reader  # (made at the first look-up when not given)
        #: (array path, dimension, dims, shape) -> anemoi's names of it, or None (looked up once)
        self._names: dict[tuple[Any, ...], np.ndarray | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "_reader": None, "_names": dict(self._names)}

    def __call__(self, geom: ArrayGeometry, dim: str) -> np.ndarray:
        if self._reader is None:
            self._reader = coordinate_reader(self.store)
        try:
            found = self._reader.find(geom, dim)
        except OSError as exc:  # (a 403, a deadline spent: the kind kept, what to do said)
            kind = next(k for k in (TimeoutError, PermissionError, OSError) if isinstance(exc, k))
            raise kind(
                f"cannot look up coordinate {dim!r} of array {geom.path!r} in store "
                f"{describe_store(self.store)} ({type(exc).__name__}: {exc}): grant read access "
                f"to {candidate_paths(geom.path, dim)} (S3 answers 403 for an absent object to "
                "credentials without s3:ListBucket), check the store, and try again"
            ) from exc
        if found is None:
            key = (str(geom.path), dim, tuple(geom.dims or ()), tuple(geom.shape))
            if key not in self._names:
                self._names[key] = variable_names(self.store, geom, dim)
            names = self._names[key]
            if names is not None:
                return names  # anemoi's layout: the names in the group's `variables`
            raise KeyError(
                f"no coordinate array {dim!r} for array {geom.path!r} in store "
                f"{describe_store(self.store)}: looked at {candidate_paths(geom.path, dim)}; "
                "select by index with isel()"
            )
        return np.asarray(self._reader.load(*found).values)


def coordinate_reader(store: StoreLike, timeout_s: float | None = None) -> _Reader:
    """A reader that reads and decodes each coordinate array of ``store`` once, however many
    calls of :func:`open_coordinates` and :func:`carried_coordinates` it is passed to (as
    ``reader=``); ``timeout_s`` bounds each read (default: the store's ``RetryPolicy``). It
    keeps each array's metadata it read, for the later calls it is passed to
    (``open_geometries(..., coords_reader=)``, ``insitu_pipeline(..., coords_reader=)``'s check
    of the store): what it read is not read again, so a change made to the store after it
    read it is not seen through it. Share one between the builds of one run, not for longer."""
    return _Reader(store, timeout_s)


def same_store_reader(reader: _Reader, store: Any) -> _Reader:
    """``reader``, where it reads the opened ``store`` itself; another store's would share
    what it read of that store (its times carried by this one's rows): ``ValueError``."""
    if reader.store is not store:
        raise ValueError(
            f"coords_reader reads store {describe_store(reader.store)}, not the one read here "
            f"({describe_store(store)}): make it with coordinate_reader() of the opened store "
            "passed here"
        )
    return reader


def open_coordinates(
    store: StoreLike,
    geom: ArrayGeometry,
    names: Sequence[str] | None = None,
    *,
    reader: _Reader | None = None,
) -> dict[str, Coordinate]:
    """Read and decode the coordinates of ``geom``'s sample axis: ``{name: Coordinate}``.

    ``names=None`` finds its *dimension coordinate*: the 1-D array named like the sample axis's
    dimension (``time`` for a ``(time, lat, lon)`` array) whose only dimension is that one — what
    :func:`~insitubatch_nodes.io.arrays.open_geometries` skips as a coordinate — looked up in the
    array's group, then in each parent group; where ``geom``'s names were given (``dim_names``:
    a collection's ``dims=``), such an array that names no dimension (zarr v2 without
    ``_ARRAY_DIMENSIONS``) counts too. ``{}`` when there is none (no dimension names, no such
    array); one of another length than the sample axis (a store read while it is appended to)
    raises :class:`~insitubatch_nodes.errors.CoordinateLengthError` (a ``ValueError``) naming
    both lengths. ``names`` lists arrays to read instead: a bare
    name is looked up the same way, a path with ``/`` from the store root; each must be 1-D with
    one value per sample (``KeyError`` naming where it looked when missing, ``ValueError`` when
    it does not fit). Keys are the arrays' names (the last path component). Decoding errors
    (an unsupported calendar, units that are not CF) raise ``ValueError``. One metadata read and
    the array's chunks per coordinate, within the store's ``RetryPolicy.timeout_s`` (else
    ``TimeoutError``; another read error raises ``OSError`` naming the coordinate).
    ``reader`` (from :func:`coordinate_reader` over the same store) shares the arrays already
    read.
    """
    reader = _Reader(store) if reader is None else reader
    listed = None if names is None else [names] if isinstance(names, str) else list(names)
    return _coordinates(reader, geom, listed)


def carried_coordinates(
    store: StoreLike,
    views: Mapping[str, ArrayGeometry],
    names: Sequence[str] | None,
    timeout_s: float | None = None,
    *,
    reader: _Reader | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """``{label: {name: values}}`` for the builder: the coordinates each label's rows carry.

    ``names=None`` is the default selection (each view's dimension coordinate): one that cannot
    be decoded (here) is left out with a warning rather than failing a pipeline that reads no
    coordinate otherwise; one of another length than its array's sample axis fails (a torn
    store: :class:`~insitubatch_nodes.errors.CoordinateLengthError`), as it does where the
    times are read for the anchors. Explicit ``names`` fail loudly. Each coordinate array is
    read once, however many views share it (and not again with the ``reader`` of an earlier
    read; its ``timeout_s`` then applies).
    """
    reader = _Reader(store, timeout_s) if reader is None else reader
    out: dict[str, dict[str, np.ndarray]] = {}
    for label, view in views.items():
        if names is None:
            try:
                coords = _coordinates(reader, view, None)
            except CoordinateLengthError:  # (no decoding error: the store is torn)
                raise
            except (ValueError, ModuleNotFoundError) as exc:  # (cftime, were it missing)
                log.warning(
                    "insitubatch_nodes: batches of %r carry no coordinates: %s. Pass coords=() "
                    "to silence this",
                    label,
                    exc,
                )
                coords = {}
        else:
            coords = _coordinates(reader, view, names)
        if coords:
            out[label] = {name: c.values for name, c in coords.items()}
    return out
