"""Forcings: inputs computed from each row's time and the grid's coordinates, never read.

:class:`Forcings` is a batch transform. For every row it takes the time the batch carries
(``batch.coords[label]["time"]``, ``datetime64``; any shape, e.g. ``(batch,)`` or ``(batch,
T)`` for multi-step samples) and adds, per name, an array ``(*times.shape, n_lat, n_lon)``
float32, computed in numpy for the whole batch at once:

``toa_incident_solar_radiation``
    Top-of-atmosphere incident solar radiation, J m⁻², *accumulated over the ``period`` that
    ends at the row's time* (ERA5's ``tisr``, parameter 212: one hour). The instantaneous flux
    ``S / r² · max(cos θ, 0)`` (``S`` the total solar irradiance, 1361 W m⁻² by default; ``r``
    the Earth–Sun distance in AU; ``θ`` the solar zenith angle) is integrated in closed form
    in equal pieces of at most an hour (a longer period is the sum of its pieces): over one
    piece the Sun's declination and distance are taken at its middle (they move by under
    0.02° and 2·10⁻⁵ AU an hour), the hour angle advances linearly, and ``∫ max(0, a + b cos
    h) dh`` is exact, sunrise and sunset inside the piece included.
    (``bins=N`` integrates by the trapezoidal rule over ``N`` sub-steps instead.)
``cos_solar_zenith``
    ``cos θ`` at the row's time (negative at night): ``sin φ sin δ + cos φ cos δ cos h``, with
    latitude ``φ``, the Sun's declination ``δ`` and the local hour angle ``h``.
``local_time_sin``, ``local_time_cos``
    ``sin``/``cos`` of ``2π · (local mean time of day) / 24 h``, local mean time being UTC plus
    longitude / 15° (hours).
``year_progress_sin``, ``year_progress_cos``
    ``sin``/``cos`` of ``2π ·`` the fraction of the calendar year elapsed at the row's time
    (the same at every grid point, broadcast over the grid).

``convention="graphcast"`` takes GraphCast's definitions of the last four instead
(:mod:`~insitubatch_nodes.forcing_calendar`: the year progress over years of 365.24219 days
since 1970, the day progress from whole seconds) and GraphCast's names ``day_progress_sin``,
``day_progress_cos`` for the local time (:data:`GRAPHCAST_NAMES`). By default the last four
take cftime dates too (a ``noleap`` or ``360_day`` store's times), counted in their own
calendar; the two solar ones, and every forcing of ``convention="graphcast"``, raise
``TypeError`` for them, but for the ``standard`` and ``proleptic_gregorian`` calendars'
dates (a store's dates outside 1677-2262 decode to those), computed at their instants, as
are ``datetime64`` times of any unit outside that range (before 2026-12-07 both were
refused). Each distinct time is computed once and remembered, whatever its kind (before
2026-12-07 cftime dates, and ``datetime64`` outside 1677-2262, were computed again in every
batch: :func:`~insitubatch_nodes.forcing_memo.memo_keys`). Every forcing is NaN at a
missing time (``NaT``; ``None`` among cftime dates), whose row holds data of an unknown time
(before, NaT was read as its int64 pattern, a date in 290 million BC: finite values of another
time).

The grid is one ``(lat, lon)`` grid, or, for a view of a collection whose members lie at other
places, each member's own (:mod:`~insitubatch_nodes.forcing_grid`): every row is computed on
its own member's points. For a patched view (``view.patches(...)``) each row's forcings are
those of its own window of the grid, ``(*times.shape, *window)``, cut at the row's origin
(``batch.patch_origins[label]``) as a patched stack's forcing member is. The rows are written
into reusable buffers lent under the batch buffers' ownership rule
(:class:`~insitubatch_nodes.lending.BufferPool`), counted in :attr:`Forcings.held_bytes`.

The Sun's position follows the U.S. Naval Observatory's *Approximate Solar Coordinates*
(https://aa.usno.navy.mil/faq/sun_approx; accurate to about 1 arcminute within two centuries
of 2000): from ``D``, days since J2000.0 (2000-01-01 12:00 UT), the mean anomaly ``g =
357.529° + 0.98560028° D``, the mean longitude ``q = 280.459° + 0.98564736° D``, the ecliptic
longitude ``L = q + 1.915° sin g + 0.020° sin 2g``, the distance ``r = 1.00014 − 0.01671 cos g −
0.00014 cos 2g``, the obliquity ``ε = 23.439° − 0.00000036° D``; then the right ascension
``α = atan2(cos ε sin L, cos L)``, the declination ``δ = asin(sin ε sin L)``, the Greenwich
mean sidereal time ``GMST = 18.697374558 h + 24.06570982441908 h · D`` and the hour angle ``h =
GMST · 15° + λ − α`` at longitude ``λ``. Times are UT (the difference to terrestrial time, about
a minute, is below the formula's accuracy for these uses).
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes._checks import check_instance, check_number, check_optional_int
from insitubatch_nodes.batch import Batch
from insitubatch_nodes.forcing_calendar import (
    CONVENTIONS,
    check_convention,
    instants,
    local_time,
    year_progress,
)
from insitubatch_nodes.forcing_grid import (
    ForcingGrid,
    GridWindow,
    no_times,
    refuse_other_windows,
)
from insitubatch_nodes.forcing_memo import Memo, memo_keys
from insitubatch_nodes.forcing_solar import (
    SOLAR_IRRADIANCE,
    SOLAR_NAMES,
    accumulation_period,
    cos_solar_zenith,
    solar_into,
    toa_incident_solar_radiation,
)
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.patching import Cut, cut_per_step, cut_windows
from insitubatch_nodes.lending import BufferPool

__all__ = [
    "CONVENTIONS",
    "FORCINGS",
    "GRAPHCAST_NAMES",
    "SOLAR_IRRADIANCE",
    "Forcings",
    "cos_solar_zenith",
    "local_time",
    "no_times",
    "toa_incident_solar_radiation",
    "year_progress",
]

FORCINGS = (
    "toa_incident_solar_radiation",
    "cos_solar_zenith",
    "local_time_sin",
    "local_time_cos",
    "year_progress_sin",
    "year_progress_cos",
)
GRAPHCAST_NAMES = (
    "toa_incident_solar_radiation",
    "year_progress_sin",
    "year_progress_cos",
    "day_progress_sin",
    "day_progress_cos",
)
"""GraphCast's forcings, by its names: ``day_progress_*`` (``convention="graphcast"`` only)
are the local time's ``local_time_*``."""
MEMO_BYTES = 64 * 2**20
"""The fields one :class:`Forcings` remembers, at most (bytes): 64 MiB holds 2,048 times of
one forcing on a 64 x 128 grid, 16 on ERA5's 0.25° grid."""


class Forcings:
    """A batch transform adding forcings (module docstring) as labels.

    ``names`` picks them (default: all of :data:`FORCINGS`); ``prefix`` is put before each
    label. ``time_label`` is the label whose ``batch.coords[time_label][time_name]`` gives the
    rows' times. ``lat`` and ``lon`` are the grid's coordinates in degrees (1-D: ``ValueError``
    for a 2-D meshgrid), one grid for every row; or give a ``view`` (an
    :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`, selected or not) and its last two
    field dimensions' coordinates are read through ``view.coordinates``. A view of a
    :class:`~insitubatch_nodes.io.collection.Collection` gives each member's own coordinates
    (:class:`~insitubatch_nodes.forcing_grid.ForcingGrid`): each row's forcings are computed
    on the grid of its member (``batch.members[time_label]``), so ``time_label`` must be a
    label of that collection; members on equal grids share one computation.
    A patched ``view`` (:meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.patches`, the
    label's) gives each row the forcings of its own window (:attr:`window`): labels ``(batch,
    [T,] *window)`` like the label's rows, computed on the whole grid and cut at each row's
    ``batch.patch_origins[time_label]``, every row at once. Where rows and forcings disagree
    (the label patched and these on the whole grid, ``lat=``/``lon=`` or a view not patched;
    other windows; these patched and the label not) the pipeline refuses them when built
    (``insitu_pipeline``, and a ``GatherNode`` composed by hand), and this transform at the
    first batch where the label's ``patch_origins`` say so (``ValueError``), never giving a
    window's row the whole grid's forcings.
    ``period``, ``bins`` and ``irradiance`` are those of :func:`toa_incident_solar_radiation`.
    ``convention`` (:data:`~insitubatch_nodes.forcing_calendar.CONVENTIONS`) is that of the
    local time and the year progress: ``"graphcast"`` gives GraphCast's, and takes its names
    ``day_progress_*`` (a ``ValueError`` otherwise) and ``datetime64`` times only.
    Nothing is read from the store.
    """

    def __init__(
        self,
        time_label: str,
        *,
        names: Sequence[str] = FORCINGS,
        lat: Any = None,
        lon: Any = None,
        view: ArrayGeometry | None = None,
        time_name: str = "time",
        prefix: str = "",
        period: Any = "1h",
        bins: int | None = None,
        irradiance: float = SOLAR_IRRADIANCE,
        convention: str = "calendar",
    ) -> None:
        if isinstance(names, str):
            raise TypeError(f"Forcings names= is a list of forcings: names=[{names!r}]")
        check_instance("Forcings' time_label", time_label, str, "the label of the times (a str)")
        check_instance("Forcings' view", view, (ArrayGeometry, type(None)), "an ArrayGeometry")
        self.convention = check_convention(convention)
        known = FORCINGS + (GRAPHCAST_NAMES[3:] if convention == "graphcast" else ())
        unknown = sorted(set(names) - set(known))
        if unknown:
            day = " (GraphCast's day_progress_* take convention='graphcast')" if any(
                n.startswith("day_progress") for n in unknown) else ""  # fmt: skip
            raise ValueError(f"unknown forcings {unknown}; choose from {list(known)}{day}")
        if view is not None:
            if lat is not None or lon is not None:
                raise TypeError("give the grid as lat= and lon=, or as view=, not both")
            grid = ForcingGrid.of_view(view)
        elif lat is None or lon is None:
            raise TypeError("Forcings needs the grid: lat= and lon= (degrees), or view=")
        else:
            grid = ForcingGrid.given(lat, lon)
        self.time_label, self.time_name = time_label, time_name
        self.names = tuple(names)
        self.prefix = prefix
        self.period = accumulation_period(period)
        self.bins = check_optional_int("bins", bins, minimum=1)  # (int() truncated 1.5 to 1)
        self.irradiance = check_number("irradiance", irradiance, minimum=0.0)
        #: where each row's window cuts the grid (``view=`` a patched view), or ``None``: every
        #: row's forcings are on the whole grid
        self.window = None if view is None else GridWindow.of_view(view)
        self._on(grid)

    def _on(self, grid: ForcingGrid) -> None:
        """Compute on ``grid`` from now on, remembering nothing yet."""
        #: the grid (one, or one per member of a collection) the fields are computed on
        self.grid = grid
        #: per distinct grid, the fields of the times computed so far (keyed by
        #: ``forcing_memo.memo_keys``), oldest forgotten first; the memory is shared out
        #: between the grids
        self._memos = [Memo(self.names, grid.shape, len(grid.lats), MEMO_BYTES) for _ in grid.lats]
        self._lock = threading.Lock()
        self._buffers: dict[str, BufferPool] = {}  # forcing -> the pool its rows are lent from

    @property
    def lat(self) -> np.ndarray:
        """The grid's latitudes (degrees), where it is one grid for every row (``ValueError``
        where each member of a collection has its own: :attr:`grid` holds them)."""
        return self._one_grid()[0]

    @property
    def lon(self) -> np.ndarray:
        """The grid's longitudes (degrees): as :attr:`lat`."""
        return self._one_grid()[1]

    def _one_grid(self) -> tuple[np.ndarray, np.ndarray]:
        if self.grid.per_member:
            raise ValueError(
                f"{self!r} is on a grid per member of {self.grid.collection} "
                f"({len(self.grid.lats)} grids): read them in .grid"
            )
        return self.grid.lats[0], self.grid.lons[0]

    def refuse_times(self, times: np.ndarray | None) -> None:
        """``TypeError`` where ``times`` (the times the rows carry, where known) are cftime
        dates of a calendar other than ``standard`` and ``proleptic_gregorian`` (which name no
        instant of the real year) and a solar forcing is named, or any with
        ``convention="graphcast"``: what a pipeline checks when built (before, the first batch
        raised it). The Gregorian calendars' dates outside ``datetime64[ns]``'s range
        (1677-2262), which a store decodes to cftime dates, are computed at their instants
        (before 2026-12-07 they were refused too)."""
        solar = [n for n in self.names if n in FORCINGS[:2] or self.convention == "graphcast"]
        if not solar or times is None or instants(np.asarray(times)[:64]).dtype.kind != "O":
            return
        why = "cftime dates (a non-standard calendar)"
        if self.convention == "graphcast":
            raise TypeError(
                f"{self!r}: convention='graphcast' counts seconds since 1970 in the "
                f"Gregorian calendar, and the rows' times are {why}: take "
                "convention='calendar' (local_time_* and year_progress_* counted in their "
                "calendar)"
            )
        raise TypeError(
            f"{self!r}: {solar} need times as numpy datetime64, and the rows' times are "
            f"{why}, with no solar position here: keep local_time_* and year_progress_*, "
            "counted in their calendar"
        )

    def largest(self, name: str) -> float:
        """A bound on the magnitude of forcing ``name``: 1 for the cosines and sines, for
        the radiation the irradiance over the period at the Sun's nearest (r = 0.983 au)."""
        if name != "toa_incident_solar_radiation":
            return 1.0
        return self.irradiance * float(self.period / np.timedelta64(1, "s")) / 0.983**2

    def only(self, name: str) -> Forcings:
        """These forcings reduced to forcing ``name``, on the same grid (with nothing
        remembered): a stack's channel."""
        out = copy.copy(self)
        out.names = (name,)
        out._on(self.grid)
        return out

    def compute(
        self,
        times: Any,
        members: Any = None,
        out: Mapping[str, np.ndarray] | None = None,
        cut: Cut | None = None,
    ) -> dict[str, np.ndarray]:
        """``{name: (*times.shape, n_lat, n_lon) float32}`` for ``times``; on a grid per member,
        each row's on its member's (``members``: ``batch.members[time_label]``,
        ``(batch,)`` or shaped like the times; :meth:`ForcingGrid.rows
        <insitubatch_nodes.forcing_grid.ForcingGrid.rows>` says what it refuses).

        Each distinct (grid, time) is computed once and its fields are remembered (up to
        :data:`MEMO_BYTES` per instance, the oldest forgotten first): a time several rows or
        steps share (overlapping windows), or that a later epoch meets again, costs a copy,
        not the trigonometry. The Python work is per distinct grid in the batch, never per
        row. ``out`` (``{name: C-contiguous float32 array of that shape}``, optional): the
        arrays the fields are written into (and returned). ``cut`` (a patching ``Cut``): each
        row's window instead, cut from the distinct times' fields (no row's grid copied)."""
        times = np.asarray(times)
        flat = times.ravel()
        field = self.grid.shape
        if cut is not None:  # each time's row's origin, and the window's shape
            cut, field = cut_per_step(cut, field, flat.size // max(1, len(cut[0])))
        shape, rows_of = (*times.shape, *field), (flat.size, *field)
        into = {n: (np.empty(rows_of, np.float32) if out is None else out[n].reshape(rows_of))
                for n in self.names}  # fmt: skip
        if not self.grid.per_member:
            self._lookup(0, flat, into, cut)
        else:
            which = self.grid.rows(members, times.shape, self.time_label)
            for g in np.unique(which).tolist():  # the grids of the batch's members
                rows = np.flatnonzero(which == g)
                part = None if cut is None else (cut[0][rows], *cut[1:])
                for name, values in self._lookup(g, flat[rows], None, part).items():
                    into[name][rows] = values
        return {name: v.reshape(shape) for name, v in into.items()}

    def _lookup(
        self, g: int, times: np.ndarray, out: Mapping[str, np.ndarray] | None, cut: Cut | None
    ) -> dict[str, np.ndarray]:
        """:meth:`compute` of the 1-D ``times`` on grid ``g``, through its memory (written
        into ``out``, ``{name: (len(times), *grid)}``, where given; windows with ``cut``)."""
        memo = self._memos[g]
        keyed = memo_keys(times, memo.kind)
        if keyed is None:  # (times of another kind than those remembered; not times at all)
            computed = self._compute(times, g)  # (it says what is wrong with them)
            if cut is not None:
                computed = {n: cut_windows(v, *cut) for n, v in computed.items()}
            return _copied(out, computed)
        keys, kind = keyed
        distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        # each distinct time as computed: nanoseconds as before, else the time given
        at = distinct.view("datetime64[ns]") if kind == "ns" else times[first]
        if cut is not None:
            return self._lookup_cut(g, (distinct, at, kind), inverse.ravel(), out, cut)
        table = {name: np.empty((len(distinct), *self.grid.shape), np.float32)
                 for name in self.names}  # fmt: skip
        with self._lock:
            slots = memo.find(distinct, kind)
            known = np.flatnonzero(slots >= 0)
            for name in self.names:
                table[name][known] = memo.fields[name][slots[known]]
        new = np.flatnonzero(slots < 0)
        if len(new):
            fresh = self._compute(at[new], g)
            for name in self.names:
                table[name][new] = fresh[name]
            with self._lock:
                memo.add(distinct[new], fresh, kind)
        return {
            name: np.take(table[name], inverse.ravel(), axis=0, mode="clip",
                          out=None if out is None else out[name])
            for name in self.names
        }  # fmt: skip

    def _lookup_cut(
        self,
        g: int,
        keyed: tuple[np.ndarray, np.ndarray, str],
        inverse: np.ndarray,
        out: Mapping[str, np.ndarray] | None,
        cut: Cut,
    ) -> dict[str, np.ndarray]:
        """:meth:`_lookup` of each row's window (``cut``) at the times ``distinct[inverse]``
        (``keyed``: the distinct keys, their times, the keys' kind), cut straight from the
        remembered fields and from those computed now: no row's (nor time's) whole field is
        copied (before, a batch of 0.25-degree patches copied 4 MiB per row and forcing to
        cut a few KiB)."""
        distinct, times, kind = keyed
        origins, axes, extent = cut
        field = (len(inverse), *cut_per_step(cut, self.grid.shape, 1)[1])
        into = {n: np.empty(field, np.float32) if out is None else out[n] for n in self.names}
        memo = self._memos[g]
        with self._lock:  # (an addition may move the remembered fields)
            slot = memo.find(distinct, kind)[inverse]
            held = np.flatnonzero(slot >= 0)
            for name in self.names:
                into[name][held] = cut_windows(memo.fields[name], origins[held], axes, extent,
                                               rows=slot[held])  # fmt: skip
        new = np.flatnonzero(slot < 0)  # the rows whose time is computed now
        if len(new):
            which, at = np.unique(inverse[new], return_inverse=True)
            fresh = self._compute(times[which], g)
            for name in self.names:
                into[name][new] = cut_windows(fresh[name], origins[new], axes, extent,
                                              rows=at.ravel())  # fmt: skip
            with self._lock:
                memo.add(distinct[which], fresh, kind)
        return dict(into)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_memos=[Memo(self.names, self.grid.shape, len(self._memos), MEMO_BYTES)
                             for _ in self._memos], _lock=None, _buffers={})  # fmt: skip
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _compute(self, times: np.ndarray, g: int = 0) -> dict[str, np.ndarray]:
        """:meth:`compute` without the memory, on grid ``g``: every time computed."""
        lat, lon, points = self.grid.lats[g], self.grid.lons[g], self.grid.points
        shape = (*times.shape, *self.grid.shape)
        out: dict[str, np.ndarray] = {}
        for name in self.names:
            if name in SOLAR_NAMES:  # (in blocks: float64 scratch bounded, not per batch)
                out[name] = solar_into(
                    np.empty(shape, np.float32), name, times, lat, lon, points=points,
                    period=self.period, bins=self.bins, irradiance=self.irradiance,
                )  # fmt: skip
                continue
            if name.startswith(("local_time", "day_progress")):
                angle = 2 * np.pi * local_time(times, lon, convention=self.convention) / 24.0
                values = np.sin(angle) if name.endswith("sin") else np.cos(angle)
            else:
                angle = (
                    2 * np.pi * year_progress(times, convention=self.convention)[..., None, None]
                )
                values = np.sin(angle) if name.endswith("sin") else np.cos(angle)
            if points and values.ndim > len(shape):  # (*times, 1, n) or (*times, 1, 1)
                values = np.broadcast_to(values, (*times.shape, 1, len(lon)))[..., 0, :]
            out[name] = np.ascontiguousarray(np.broadcast_to(values, shape), dtype=np.float32)
        return out

    @property
    def held_bytes(self) -> int:
        """Bytes of the fields remembered so far (at most :data:`MEMO_BYTES`) and of the
        buffers the batches' rows are lent from (lent out, or idle): memory outside the pool,
        counted in ``pipe.stats()``'s ``batch_transform_bytes``."""
        lent = sum(pool.held_bytes for pool in list(self._buffers.values()))
        return sum(m.nbytes for m in self._memos) + lent

    def most_held_bytes(self, views: Mapping[str, Any], rows: int, batches: int) -> int:
        """The most :attr:`held_bytes` grows to in a pipeline of ``views`` (label -> view, as
        batches carry them) whose batches have ``rows`` rows, ``batches`` of them alive at
        once (the batch buffers' count, which the rows lent here follow): the fields of the
        distinct times the label's array holds (at most :data:`MEMO_BYTES`' worth per grid
        share) and ``batches`` batches' rows, each row its window's steps of the grid (or
        of the row's window of it). What the build's memory check counts for it."""
        view = views.get(self.time_label)
        steps, n_times = 1, None
        if isinstance(view, ArrayGeometry):
            steps = len(view.window_offsets or (0,))
            n_times = view.base.n_samples
        elif view is not None and getattr(view, "steps", None):
            steps = int(view.steps)
        field = self.grid.shape if self.window is None else self.window.shape(self.grid.shape)
        lent = batches * rows * steps * math.prod(field) * 4 * len(self.names)
        return self.most_remembered_bytes(n_times) + lent

    def most_remembered_bytes(self, n_times: int | None = None) -> int:
        """The most the remembered fields take (:data:`MEMO_BYTES` at most, per grid its
        share), of at most ``n_times`` distinct times where fewer can be met."""
        return sum(m.most_bytes(n_times) for m in self._memos)

    def release_idle(self) -> None:
        """Let go of the buffers the rows are lent from (one lent out is freed with its batch;
        the remembered fields stay): the pipeline's close."""
        with self._lock:
            for pool in self._buffers.values():
                pool.release_idle()

    def _lend(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 array of ``shape`` for forcing ``name``'s rows of one batch, lent from
        its :class:`~insitubatch_nodes.lending.BufferPool` (lent again once nothing made from
        that batch is left); a batch of more rows, or rows of another shape, makes a new
        pool."""
        with self._lock:
            pool = self._buffers.get(name)
            if pool is None or pool.shape[1:] != shape[1:] or pool.shape[0] < shape[0]:
                pool = self._buffers[name] = BufferPool(shape, np.dtype(np.float32))
            return pool.take()[: shape[0]]

    def __call__(self, batch: Batch) -> Batch:
        carried = batch.coords.get(self.time_label, {})
        times = carried.get(self.time_name)
        if times is None:
            raise no_times("Forcings", self.time_label, self.time_name, carried)
        members = batch.members.get(self.time_label)
        origins = batch.patch_origins.get(self.time_label)
        self._refuse_other_windows(origins)
        cut, field = None, self.grid.shape
        if self.window is not None and origins is not None:  # each row's own window
            cut, field = self.window.cut_of(origins), self.window.shape(field)
        rows = (*np.shape(times), *field)
        into = {name: self._lend(name, rows) for name in self.names}
        for name, values in self.compute(times, members, out=into, cut=cut).items():
            batch.arrays[self.prefix + name] = values
        return batch

    def _refuse_other_windows(self, origins: np.ndarray | None) -> None:
        """``ValueError`` for batches whose label is patched otherwise than :attr:`window`
        says (``origins``: its ``batch.patch_origins``, ``None`` for a label not patched)."""
        if origins is None:
            refuse_other_windows(self.time_label, self.window, None)
            return
        columns = np.shape(origins)[-1]
        if self.window is not None and columns == self.window.origins:
            return
        mine = "are on the whole grid" if self.window is None else (
            f"cut {self.window.describe()} of {self.window.origins} patched dimension(s)"
        )  # fmt: skip
        raise ValueError(
            f"label {self.time_label!r} is patched (windows of {columns} patched "
            f"dimension(s)), and {self!r} {mine}: build Forcings with view= the view of label "
            f"{self.time_label!r} (view.patches(...) as the label's), which gives each row the "
            "forcings of its own window, or make them a member of stack(...) with the patched "
            "members"
        )

    def __repr__(self) -> str:
        convention = "" if self.convention == "calendar" else f", convention={self.convention!r}"
        return f"Forcings({self.time_label!r}, names={list(self.names)}{convention})"


def _copied(
    out: Mapping[str, np.ndarray] | None, values: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``values``, or ``out`` with them copied in where given."""
    if out is None:
        return values
    for name, v in values.items():
        np.copyto(out[name], v)
    return dict(out)
