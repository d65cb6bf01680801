"""The (latitude, longitude) grid forcings are computed on: one grid, or one per member.

A :class:`ForcingGrid` is what :class:`~insitubatch_nodes.forcings.Forcings` computes its
fields at. Given as ``lat=`` and ``lon=`` it is one grid for every row. Read from a view
(:meth:`ForcingGrid.of_view`) it is the view's last two kept field axes' coordinates, as
selected (of a grid of points, :mod:`~insitubatch_nodes.io.points`, the latitude and longitude
of each point of its last axis); for a view of a
:class:`~insitubatch_nodes.io.collection.Collection` those of **each member**: scenes at
other places hold other points at the same index, so each row's forcings are computed on its
own member's points (the row's member: ``batch.members[label]``). Members
whose points are equal share one grid, so one computation (and one memory of computed times)
serves them all; where every member is on one grid the collection's forcings are that one grid,
as for a single array.

:class:`GridWindow` is how a patched view's windows cut that grid: a ``Forcings`` built with
``view=`` a patched view gives each row the forcings of its own window
(``batch.patch_origins[label]``), as a patched stack's forcing member does.

:func:`refuse_forcings_elsewhere` is what a pipeline (and a
:class:`~insitubatch_nodes.stages.gather.GatherNode` composed by hand) checks of the
:class:`~insitubatch_nodes.forcings.Forcings` among its batch transforms: that rows of members
at other places are never computed on another member's grid, and that a patched label's rows
get their own window's forcings, never the whole grid's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any, Protocol

import numpy as np

from insitubatch_nodes.io.collection_checks import MemberCoordinates
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.longitudes import same_points
from insitubatch_nodes.io.patching import Cut
from insitubatch_nodes.io.points import grid_ndim
from insitubatch_nodes.io.selection import kept_axes, view_keys

__all__ = [
    "ForcingGrid",
    "GridWindow",
    "no_times",
    "refuse_forcings_elsewhere",
    "refuse_other_points",
]


@dataclass(frozen=True, eq=False)
class ForcingGrid:
    """Distinct ``(lat, lon)`` grids in degrees (``lats`` ``(G, n_lat)``, ``lons`` ``(G,
    n_lon)``, all of one shape) and which one each member is on (``of_member``, ``(M,)``;
    ``None``: one grid, ``G == 1``, for every row). ``collection`` names the collection whose
    member indices ``of_member`` counts in (``None`` for a grid given, or read from an array),
    ``members`` its member names (for messages)."""

    lats: np.ndarray
    lons: np.ndarray
    of_member: np.ndarray | None = None
    collection: str | None = None
    members: tuple[str, ...] = ()
    #: a grid of points: point ``i`` at ``(lats[:, i], lons[:, i])``, of shape ``(n,)``
    points: bool = False

    @classmethod
    def given(cls, lat: Any, lon: Any) -> ForcingGrid:
        """One grid for every row: ``lat`` and ``lon``, 1-D, in degrees (``ValueError`` for a
        2-D meshgrid, or latitudes outside [-90, 90])."""
        for axis, values in (("lat", lat), ("lon", lon)):
            if np.ndim(values) > 1:
                raise ValueError(
                    f"Forcings: {axis}= must be the 1-D coordinate of a regular (lat, lon) grid, "
                    f"got shape {np.shape(values)}: give lat2d[:, 0] and lon2d[0, :] of a "
                    "meshgrid (a curvilinear grid is not supported)"
                )
        phi = np.asarray(lat, dtype=np.float64).reshape(1, -1)
        lam = np.asarray(lon, dtype=np.float64).reshape(1, -1)
        _refuse_latitudes(phi, "")
        return cls(phi, lam)

    @classmethod
    def of_view(cls, view: ArrayGeometry) -> ForcingGrid:
        """The grid of ``view``'s last two kept field axes, as selected (``ValueError`` where
        their names say they are longitude then latitude, where they are not named
        ``lat...`` and ``lon...``, a rotated or projected grid's ``rlat``/``rlon`` or ``y``/``x``
        whose values are no latitudes and longitudes, or where it has no names or
        coordinates). A collection's view: each member's own coordinates (read once, 16
        members at a time; ``KeyError`` naming a member without one, ``ValueError`` naming one
        whose coordinate does not fit its axis), equal ones shared."""
        dims = view.dims
        if dims is None or view.coordinates is None:
            raise ValueError(f"{view.path}: no dimension names or coordinates to find its grid by")
        field = [dims[a] for a in view.field_axes]
        keys = view_keys(view)
        kept = [(i, field[i], keys[i]) for i in kept_axes(keys)]
        if view.points is not None and grid_ndim(view) == 1:  # each point's latitude, longitude
            return cls._read(view, [(kept[-1][0], name, kept[-1][2]) for name in view.points])
        if len(kept) < 2:
            raise ValueError(
                f"{view.path}: the view keeps fewer than two field axes (forcings need its grid: "
                "a latitude and a longitude axis, or one of points with 1-D latitude and "
                "longitude arrays beside it)"
            )
        first, second = (name.lower() for _, name, _ in kept[-2:])
        if first.startswith("lon") or second.startswith("lat"):
            raise ValueError(
                f"{view.path}: its grid is ({kept[-2][1]}, {kept[-1][1]}), and forcings are "
                "computed on a (latitude, longitude) grid: give Forcings lat= and lon= and "
                "transpose them, or use a (latitude, longitude) view"
            )
        if not (first.startswith("lat") and second.startswith("lon")):
            raise ValueError(
                f"{view.path}: its grid is ({kept[-2][1]}, {kept[-1][1]}), and forcings are "
                "computed at each point's latitude and longitude: axes not named lat.../lon... "
                "(a rotated pole's rlat/rlon, a projection's y/x) do not hold them, and "
                "forcings computed at their values would be at other places. On a regular "
                "latitude/longitude grid named otherwise, give Forcings lat= and lon= "
                "(its points, in degrees); a grid whose latitudes and longitudes are 2-D "
                "(rotated, projected) is not supported"
            )
        return cls._read(view, kept[-2:])

    @classmethod
    def _read(cls, view: ArrayGeometry, axes: list[tuple[int, str, Any]]) -> ForcingGrid:
        """The grid of the coordinates ``axes`` name (the latitude's, the longitude's: ``(field
        axis, coordinate name, selection key)``; both of one axis: a grid of points)."""
        coords = view.coordinates
        points = axes[0][0] == axes[1][0]
        per_axis = []  # per grid axis: each member's values, as selected
        for i, name, key in axes:
            if isinstance(coords, MemberCoordinates):
                try:
                    values = coords.each(view.base, name)
                except KeyError as exc:
                    raise KeyError(
                        f"{exc.args[0]}: forcings need every member's grid; give Forcings lat= "
                        "and lon= where every member is on one grid"
                    ) from None
            else:
                values = [np.asarray(coords(view.base, name))]
            length = view.field_shape[i]
            for m, v in enumerate(values):
                if np.ndim(v) != 1 or len(v) != length:
                    who = f" of member {coords.names[m]!r}" if len(values) > 1 else ""
                    raise ValueError(
                        f"{view.path}: the {name!r} coordinate{who} has shape {np.shape(v)}, "
                        f"but the axis holds {length} points: forcings need one value per "
                        f"point; give Forcings lat= and lon="
                    )
            at = slice(None) if key is None else np.asarray(key)
            per_axis.append([np.asarray(v, np.float64)[at] for v in values])
        if not isinstance(coords, MemberCoordinates):
            grid = cls(per_axis[0][0].reshape(1, -1), per_axis[1][0].reshape(1, -1), points=points)
            _refuse_latitudes(grid.lats, f"{view.path}: ")
            return grid
        # equal grids share one index: a dict of each member's points, as bytes
        index: dict[bytes, int] = {}
        of_member = np.empty(len(per_axis[0]), np.intp)
        for m, (phi, lam) in enumerate(zip(*per_axis, strict=True)):
            of_member[m] = index.setdefault(phi.tobytes() + b"|" + lam.tobytes(), len(index))
        firsts = np.unique(of_member, return_index=True)[1]
        lats = np.stack([per_axis[0][m] for m in firsts])
        lons = np.stack([per_axis[1][m] for m in firsts])
        _refuse_latitudes(lats, f"{view.path}: ")
        if len(firsts) == 1:  # one grid for every member: as an array's
            return cls(lats, lons, points=points)
        assert view.members is not None
        name = view.members.collection.partition(":")[0]
        return cls(lats, lons, of_member, name, tuple(coords.names), points)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(n_lat, n_lon)``: every grid's; ``(n,)`` of a grid of points."""
        if self.points:
            return (self.lons.shape[1],)
        return self.lats.shape[1], self.lons.shape[1]

    @property
    def per_member(self) -> bool:
        """Whether rows of different members are on different grids."""
        return self.of_member is not None

    def rows(self, members: np.ndarray | None, shape: tuple[int, ...], label: str) -> np.ndarray:
        """The grid of each time of a batch of ``shape`` (``(batch,)`` or ``(batch, T)``),
        flat: its row's member's (``members``: ``batch.members[label]``, ``(batch,)``, or
        shaped like the times on a concatenation). ``KeyError`` where a grid per member has
        no members to go by, ``ValueError`` for a member index it does not know."""
        assert self.of_member is not None
        if members is None:
            raise KeyError(
                f"Forcings: the forcings are on the grids of the members of {self.collection}, "
                f"and batches carry no member for label {label!r}: give time_label= a label "
                "read from that collection"
            )
        m = np.asarray(members)
        if m.shape != shape:  # one member per row, for each of its times
            m = np.broadcast_to(m.reshape(len(m), *(1,) * (len(shape) - 1)), shape)
        if m.size and (m.min() < 0 or m.max() >= len(self.of_member)):
            raise ValueError(
                f"Forcings: label {label!r} has a row of member {int(m.max())}, and the "
                f"forcings know the {len(self.of_member)} members of {self.collection}: build "
                "Forcings from a view of the collection the pipeline reads"
            )
        return np.asarray(self.of_member[m.ravel()])

    def member_points(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Each of ``n`` members' latitudes ``(n, n_lat)`` and longitudes ``(n, n_lon)`` (one
        grid: the same for each)."""
        at = np.zeros(n, np.intp) if self.of_member is None else self.of_member
        return self.lats[at], self.lons[at]

    def differs_from(self, other: ForcingGrid) -> str:
        """Where this grid's points are other than ``other``'s (a collection's member by
        member), beyond float32 rounding (longitudes as places: -157.5 is 202.5): ``""`` where
        they agree."""
        if self.shape != other.shape:
            return f"the grid is {self.shape}, theirs {other.shape}"
        if self.per_member and other.per_member and self.collection != other.collection:
            return f"the grids of the members of {self.collection}, not of {other.collection}"
        on = other if other.per_member else self  # the one that counts members, if any
        n = 1 if on.of_member is None else len(on.of_member)
        names = on.members
        mine, ours = self.member_points(n), other.member_points(n)
        for axis, ref, got in (("lat", ours[0], mine[0]), ("lon", ours[1], mine[1])):
            bad = ~same_points(got, ref, longitude=axis == "lon")  # 202.5 is -157.5
            if bad.any():
                m = int(np.argmax(bad))
                who = f"member {names[m]!r}: " if names else ""
                return f"{who}{axis!r} {_listed(got[m])} where the field is at {_listed(ref[m])}"
        return ""


@dataclass(frozen=True)
class GridWindow:
    """Where a patched view's windows cut the forcings' grid (its last two kept field axes):
    ``axes`` which of the grid's two axes (0: latitude, 1: longitude) are cut, in the patches'
    order, ``columns`` the columns of ``batch.patch_origins[label]`` that give each row's
    origin along them, ``extent`` the window's size along them; ``origins`` is how many columns
    the origins have (one per patched dimension). Compared by these: two windows that cut the
    grid alike are equal. ``grid`` is the whole grid's shape, ``dims`` the grid's cut
    dimensions' names and ``off_grid`` the patched dimensions that are not on the grid (a
    ``level``), for checks and messages."""

    axes: tuple[int, ...]
    columns: tuple[int, ...]
    extent: tuple[int, ...]
    origins: int
    grid: tuple[int, ...] = _field(compare=False)
    dims: tuple[int | str, ...] = _field(compare=False)
    off_grid: tuple[int | str, ...] = _field(compare=False)

    @classmethod
    def of_view(cls, view: ArrayGeometry) -> GridWindow | None:
        """The cut of ``view``'s patches (``None`` for a view that is not patched)."""
        spec = view.patch
        if spec is None:
            return None
        kept = [view.field_axes[i] for i in kept_axes(view_keys(view))]
        grid_axes = kept[len(kept) - grid_ndim(view) :]
        # the grid as selected, whole along the axes the patches cut (a selected axis is whole)
        grid = list(view.inner_shape[len(view.inner_shape) - len(grid_axes) :])
        axes, columns, extent, dims, off = [], [], [], [], []
        cuts = zip(spec.axes_of(view.dims), spec.extent, spec.field, strict=True)
        for k, (axis, n, length) in enumerate(cuts):
            name = axis if view.dims is None else view.dims[axis]
            if axis not in grid_axes:
                off.append(name)
                continue
            axes.append(grid_axes.index(axis))
            grid[axes[-1]] = length
            columns.append(k)
            extent.append(n)
            dims.append(name)
        return cls(tuple(axes), tuple(columns), tuple(extent), spec.n_axes, tuple(grid),
                   tuple(dims), tuple(off))  # fmt: skip

    def describe(self) -> str:
        """The windows in words, for messages: ``"windows of {'lat': 4, 'lon': 8}"``."""
        return f"windows of {dict(zip(self.dims, self.extent, strict=True))}"

    def shape(self, grid: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one window of a ``grid``-shaped field (``(n_lat, n_lon)``)."""
        out = list(grid)
        for a, e in zip(self.axes, self.extent, strict=True):
            out[a] = e
        return tuple(out)

    def cut_of(self, origins: np.ndarray) -> Cut | None:
        """The :data:`~insitubatch_nodes.io.patching.Cut` of each row's window of the grid at
        its origin (``origins``: ``batch.patch_origins[label]``), for
        :meth:`Forcings.compute <insitubatch_nodes.forcings.Forcings.compute>`; ``None``
        where the patches cut no grid axis (every row's grid is whole)."""
        if not self.axes:
            return None
        return np.asarray(origins)[:, list(self.columns)], self.axes, self.extent


def refuse_other_windows(label: str, mine: GridWindow | None, theirs: GridWindow | None) -> None:
    """``ValueError`` unless ``Forcings(label)`` whose rows are cut by ``mine`` (``None``:
    rows on the whole grid) fit a label whose windows are ``theirs`` (``None``: not patched):
    each row must get the forcings of its own window."""
    if mine == theirs:
        return
    fix = (
        f"build Forcings with view= the view of label {label!r} (view.patches(...) as the "
        "label's), which gives each row the forcings of its own window, or make them a "
        "member of stack(...) with the patched members"
    )
    if theirs is None:
        assert mine is not None
        raise ValueError(
            f"Forcings({label!r}) were built with view= a patched view (they cut each row's "
            f"{mine.describe()}), and label {label!r} is not patched: build Forcings with "
            f"view= the view of label {label!r}"
        )
    if mine is None:
        raise ValueError(
            f"label {label!r} is patched ({theirs.describe()} of its {theirs.grid} grid), and "
            f"Forcings({label!r}) are on the whole grid (lat= and lon=, or view= a view not "
            f"patched): every row would get the whole grid's forcings; {fix}"
        )
    raise ValueError(
        f"label {label!r} is patched ({theirs.describe()}), and Forcings({label!r}) cut "
        f"{mine.describe()}: {fix}"
    )


def _listed(values: np.ndarray) -> str:
    return f"{values[:8].tolist()}{' ...' if len(values) > 8 else ''}"


def _refuse_latitudes(lats: np.ndarray, where: str) -> None:
    if not np.all(np.abs(lats) <= 90.0):
        raise ValueError(
            f"{where}Forcings: latitudes must lie in [-90, 90] degrees, got {lats.min()} ... "
            f"{lats.max()}: give lat= the latitudes and lon= the longitudes (the forcings' "
            "grid is (lat, lon))"
        )


class _Forcings(Protocol):
    """What :func:`refuse_forcings_elsewhere` reads of a ``Forcings``."""

    time_label: str
    grid: ForcingGrid
    window: GridWindow | None


def refuse_forcings_elsewhere(
    forcings: Sequence[_Forcings], views: Mapping[str, ArrayGeometry]
) -> None:
    """Refuse ``forcings`` (batch transforms of a pipeline whose labels read ``views``: a
    stack's by its first sampled member) that would compute a row on other points than its
    own: a patched label's rows on the whole grid (forcings given ``lat=`` and ``lon=``, or
    ``view=`` a view not patched), or on windows other than the label's, or a label read whole
    cut into windows (forcings built with ``view=`` a patched view); rows at other points
    than the label's grid (:func:`refuse_other_points`: ``lat=``/``lon=`` other than its
    coordinates; a collection's rows on the grids of another collection's members, or on one
    grid where its members are at other points). ``ValueError`` saying to build them with
    ``view=`` the label's view. A label whose grid has no coordinates (a collection whose
    members have none) says nothing of its points: the grid given is taken."""
    for f in forcings:
        view = views.get(f.time_label)
        if view is None:
            continue  # (no such label: the transform says so at its first batch)
        refuse_other_windows(f.time_label, f.window, GridWindow.of_view(view))
        refuse_other_points(
            f.grid, view, f"Forcings({f.time_label!r})", f"label {f.time_label!r}",
            "build Forcings with view= the label's view (a view of the collection the pipeline "
            "reads, for a collection's label), which computes each row on its own points",
        )  # fmt: skip


def refuse_other_points(
    grid: ForcingGrid, view: ArrayGeometry, who: str, whose: str, fix: str
) -> None:
    """``ValueError`` where forcings on ``grid`` (``who``, in words) would compute rows of
    ``view`` (``whose``) at other points than theirs (``fix`` says what to do): the grids of
    another collection's members (their indices count in that one), or points other than the
    view's grid's (its last two kept field axes, as selected; a collection's member by member),
    beyond float32 rounding. A view whose grid is unknown (no names or coordinates, or
    members without them) says nothing of its points: the grid given is taken. What the
    pipeline checks of its ``Forcings`` and :func:`~insitubatch_nodes.stack.stack` of a forcing
    member."""
    own = view.members.collection.partition(":")[0] if view.members is not None else None
    if grid.per_member and grid.collection != own:
        raise ValueError(
            f"{who} are on the grids of the members of {grid.collection}, and {whose} reads "
            f"{own or 'an array, not a collection'}: {fix}"
        )
    try:
        theirs = ForcingGrid.of_view(view)
    except (KeyError, ValueError):  # no coordinates: nothing says where the points are
        return
    differ = grid.differs_from(theirs)
    if differ:
        raise ValueError(f"{who} are computed at other points than {whose} ({differ}): {fix}")


def no_times(what: str, label: str, time_name: str, carried: Mapping[str, Any]) -> KeyError:
    """The error for batches whose ``label`` carries no coordinate ``time_name``: it names the
    coordinates they carry and, where one holds dates (ERA5 from the new CDS calls its time
    ``valid_time``), ``time_name=`` it."""
    dated = [n for n, v in carried.items() if np.asarray(v).dtype.kind in "MO"]
    fix = (
        f"give Forcings time_name={dated[0]!r}, the coordinate of the rows' times"
        if dated
        else "build the pipeline with coords=None (each label's dimension coordinate) or "
        "coords=[...] naming the times, and give Forcings that name as time_name="
    )
    return KeyError(
        f"{what}: batches carry no coordinate {time_name!r} for label {label!r} (they carry "
        f"{sorted(carried)}): {fix}"
    )
