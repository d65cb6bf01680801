"""Channel stacks: several views delivered as one label, ``(batch, [T,] C, *field)``.

:func:`stack` makes a :class:`Stack` from named views (members). Passed to the pipeline as a
label's view, it is assembled in place: every sampled member is a *part* of the label
(:mod:`~insitubatch_nodes.plan.parts`) whose destination is its channel slice of the label's
batch buffer, so the gather copies each member from the pool straight into
``buffer[:, t, c0:c1]`` (and, at one sample per chunk, the fetch stage decodes it there): one
copy from pool to batch, as for a single label. Static members (:attr:`ArrayGeometry.static
<insitubatch_nodes.io.geometry.ArrayGeometry.static>`) are constant channels, written into
each batch's slice after the gather, and so are forcings
(:mod:`~insitubatch_nodes.stack_constants`).

**Channels, in order**: the members in the order given; a member with one more axis than the
field (``(level, lat, lon)`` against a ``(lat, lon)`` field) is one channel per entry of its
first axis, named ``"name@value"`` (the coordinate value where the view knows its coordinates,
else the index), a member of the field's shape is one channel named ``name``.
``batch.channels[label]`` lists them. The field is the last two axes of the members (one
where a sampled member is 1-D, whichever member that is, or a member's last axis is a grid of
points: :mod:`~insitubatch_nodes.io.points`); every member must have the same
field shape and the same number of steps ``T`` (a window of ``T`` steps, or none), or
:func:`stack` raises naming the member.

**Normalisation**: with ``normalize=stats`` (:class:`~insitubatch_nodes.statistics.Statistics`
fitted with the members' names) every member's channel slice is standardised ``(x - mean) /
std`` per channel in place right after it is copied (statics once, when read): no pass over
the batch after it is assembled (float16 members in float32, rounded once: ``x - mean`` may
pass float16's 65504, or ``std`` round to 0, where the result does not). A constant channel
(``std`` 0) becomes 0.

**Ensembles**: with ``ensemble="member"`` every sampled member keeps its ``member``
dimension (the same members in the same order, first after the sample axis or second after
its channel axis as anemoi-datasets stores it: :mod:`~insitubatch_nodes.stack_ensemble`) and
rows are ``([T,] E, C, *field)`` (channels last ``([T,] E, *field, C)``), channels named
without the member, :attr:`Stack.ensemble` the members; static and forcing members are the
same for every member. Statistics pooled over the members (``pool="member"``) or per member
both standardise it.

``batch.sample_indices[label]`` of a stack is its first sampled member's (``(batch,)``, or
``(batch, T)``); its coordinates likewise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from insitubatch_nodes.forcing_grid import GridWindow, refuse_other_points
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.patching import Patches
from insitubatch_nodes.io.points import grid_ndim
from insitubatch_nodes.io.selection import date_strings
from insitubatch_nodes.stack_ensemble import ensemble_members, member_shape
from insitubatch_nodes.stack_points import grid_dims, grid_points, placing, refuse_unlike_points
from insitubatch_nodes.static import StaticCut
from insitubatch_nodes.work_dtypes import work_dtype


class Statistics(Protocol):
    """What :func:`stack` reads of :class:`~insitubatch_nodes.statistics.Statistics`
    (``mean`` read-only: an attribute here would be invariant, and refuse the ``dict`` of
    arrays that ``Statistics`` holds)."""

    @property
    def mean(self) -> Mapping[str, Any]: ...

    def shaped(self, label: str, name: str, view: ArrayGeometry) -> np.ndarray: ...


__all__ = [
    "LAYOUTS",
    "Stack",
    "StackMember",
    "channel_destination",
    "refuse_overflow",
    "stack",
    "static_window",
]

LAYOUTS = ("channels_first", "channels_last")


@dataclass(frozen=True)
class StackMember:
    """One member of a :class:`Stack`: its ``name``, ``view``, its channels ``c0:c1`` of the
    stack, whether it has a channel axis of its own (``leveled``), and the ``(mean, std)``
    it is standardised with (shaped to broadcast against one step of the view), if any. A
    forcing member has no view: ``forcing`` is the :class:`~insitubatch_nodes.forcings.Forcings`
    that computes it (its channel is the forcing ``name``)."""

    name: str
    view: ArrayGeometry | None
    c0: int
    c1: int
    leveled: bool
    norm: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)
    forcing: Forcings | None = field(default=None, compare=False)
    #: a static member of a patched stack: where the windows cut it (:func:`static_window`)
    cut: StaticCut | None = field(default=None, compare=False, repr=False)
    #: in an ensemble stack, where the member keeps the ensemble axis: 0 first (``(E, C,
    #: *field)``), 1 after its channels (``(C, E, *field)``, anemoi-datasets' order)
    ensemble_at: int = 0

    @property
    def geometry(self) -> ArrayGeometry:
        """The view of an array member (``ValueError`` for a forcing)."""
        if self.view is None:
            raise ValueError(f"stack member {self.name!r} is a forcing: it reads no array")
        return self.view

    @property
    def channel(self) -> int | slice:
        """The member's channel index into the stack: an int for a one-channel member."""
        return slice(self.c0, self.c1) if self.leveled else self.c0


@dataclass(frozen=True)
class Stack:
    """A channel stack of :class:`StackMember` (made by :func:`stack`; see the module
    docstring). ``steps`` is ``T`` for members that are windows, ``None`` otherwise;
    ``field_shape`` the members' common field; ``channels`` the channel names in order;
    ``ensemble`` the ensemble members kept as an axis (``ensemble_dim``'s values, in order),
    or ``None``."""

    members: tuple[StackMember, ...]
    layout: str
    steps: int | None
    field_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    channels: tuple[str, ...]
    ensemble: tuple[Any, ...] | None = None
    ensemble_dim: str | None = None

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row of the label's batch array (after the batch axis)."""
        lead: tuple[int, ...] = () if self.steps is None else (self.steps,)
        lead += () if self.ensemble is None else (len(self.ensemble),)
        c = len(self.channels)
        if self.layout == "channels_first":
            return (*lead, c, *self.field_shape)
        return (*lead, *self.field_shape, c)

    @property
    def sampled(self) -> tuple[StackMember, ...]:
        """The members read through the plan (neither static nor forcings)."""
        return tuple(m for m in self.members if m.view is not None and not m.view.static)

    @property
    def static(self) -> tuple[StackMember, ...]:
        """The static members: constant channels."""
        return tuple(m for m in self.members if m.view is not None and m.view.static)

    @property
    def forcings(self) -> tuple[StackMember, ...]:
        """The forcing members: computed per batch from the rows' times."""
        return tuple(m for m in self.members if m.forcing is not None)

    def ensemble_after_channels(self, channel: int | slice) -> bool:
        """Whether the sampled member at ``channel`` (its :attr:`StackMember.channel`) keeps
        the ensemble axis after its channels (``(C, E, *field)``)."""
        return (channel.start if isinstance(channel, slice) else channel) in self._after_channels

    @cached_property
    def _after_channels(self) -> frozenset[int]:
        """The first channels of the members that keep ``E`` after their channels (once: the
        destinations are taken per batch)."""
        return frozenset(m.c0 for m in self.members if m.ensemble_at == 1)

    @property
    def views(self) -> tuple[ArrayGeometry, ...]:
        """Every view the stack reads (sampled and static members)."""
        return tuple(m.view for m in self.members if m.view is not None)

    def __repr__(self) -> str:
        names = ", ".join(
            f"{m.name}={m.view if m.view is not None else m.forcing!r}" for m in self.members
        )
        ens = "" if self.ensemble_dim is None else f", ensemble={self.ensemble_dim!r}"
        return f"stack({{{names}}}, layout={self.layout!r}{ens})"


def channel_destination(
    arr: np.ndarray,
    index: tuple[int | slice, ...],
    channels_last: bool,
    ensemble: bool = False,
    channels_first: bool = False,
) -> np.ndarray:
    """The view of the batch array ``arr`` (``(n, [T,] C, *field)``, or ``(n, [T,] *field,
    C)`` with ``channels_last``; ``ensemble``: ``E`` after ``[T,]``) that a part at ``index``
    (``([t,] channel)``) fills: ``(n, [E,] *member's inner)`` — a leveled member's channels
    first (after ``E``), whatever the layout; ``channels_first`` (a leveled member of an
    ensemble stack that keeps ``E`` after its channels): ``(n, C, E, *field)``, the member's
    own axis order, so that its data is copied (and standardised) as it is stored."""
    *lead, channel = index
    sub = arr[(slice(None), *lead)]
    if not channels_last:
        out = sub[:, :, channel] if ensemble else sub[:, channel]
    else:
        out = sub[..., channel]
        out = np.moveaxis(out, -1, 1 + ensemble) if isinstance(channel, slice) else out
    return np.swapaxes(out, 1, 2) if ensemble and channels_first else out


def _cf_dtype_helps(view: ArrayGeometry) -> bool:
    """Whether ``view`` is float32 when opened with ``cf_dtype="float32"``: it is, or its
    stored values decode to floats (open_geometries' arrays and a collection's variables)."""
    return view.dtype == np.float32 or (view.cf is not None and view.cf.dtype.kind == "f")


def stack(
    views: Mapping[str, ArrayGeometry | Forcings] | Sequence[ArrayGeometry | Forcings],
    *,
    layout: str = "channels_first",
    normalize: Statistics | None = None,
    ensemble: str | None = None,
) -> Stack:
    """A view of ``views`` stacked along a channel axis, usable as a label of the pipeline:
    ``batch.arrays[label]`` is ``(batch, [T,] C, *field)`` (``layout="channels_last"``:
    ``(batch, [T,] *field, C)``) and ``batch.channels[label]`` the channel names (module
    docstring). ``views`` maps member names to views (a sequence names each by its array's
    path); a :class:`~insitubatch_nodes.forcings.Forcings` member is one channel per forcing
    it names (channel and member named by the forcing, ``prefix`` included), computed for each
    batch from the stack's times (the pipeline must carry the time coordinate: the default
    ``coords=None`` does) and never normalised. ``normalize``: fitted
    :class:`~insitubatch_nodes.statistics.Statistics` with an entry per member name; each
    member is standardised during the copy into the batch (a constant channel, ``std`` 0,
    becomes 0). ``ensemble``: the dimension every sampled member keeps as the ensemble
    axis of the rows, ``([T,] E, C, *field)`` (module docstring; ``None``: no such axis).

    ``ValueError`` for an unknown ``layout``, no member, no sampled member, members that
    disagree on ``T``, the field shape (or the order of its named dimensions: a transposed
    grid; or its points: grid coordinates, as selected, of other values) or the dtype
    (naming the member and what it has), a member of more than one axis beyond the field,
    patched members not patched alike (or beside a static or forcing member), a window still
    in time deltas, a member without statistics or with statistics fitted on other channels
    (other levels, another order), or non-float members with ``normalize``; with
    ``ensemble``, a sampled member without that dimension first after its sample axis (or
    second, after a channel axis), or
    selecting other members than the first sampled member (naming both selections), a static
    member with it, or a member patched along it
    (:func:`~insitubatch_nodes.stack_ensemble.ensemble_members`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    given = _named(views)
    if not given:
        raise ValueError("stack() needs at least one view")
    named = {k: v for k, v in given.items() if isinstance(v, ArrayGeometry)}
    if all(v.static for v in named.values()):
        raise ValueError(
            f"every member of the stack ({sorted(named)}) is static: stack at least one "
            "array with samples"
        )
    first_name, first = next((n, v) for n, v in named.items() if not v.static)
    members_e = None if ensemble is None else ensemble_members(named, ensemble)
    e = 0 if ensemble is None else 1  # a sampled member's ensemble axis, before its own
    # the field: the last two axes, or one where a sampled member has one (whatever the order)
    # or a member is on a grid of points (its last axis: ``(level, values)`` is levels)
    ranks = [len(v.inner_shape) - e for v in named.values() if not v.static and v.inner_shape]
    ranks += [grid_ndim(v) for v in named.values() if v.points is not None]
    field_ndim = min(2, *ranks) if ranks else 0
    field_shape = first.inner_shape[len(first.inner_shape) - field_ndim :]
    steps = _steps(first)
    members: list[StackMember] = []
    channels: list[str] = []
    field_dims = grid_dims(first, field_ndim)
    _check_patched(named, first_name, first, field_dims)
    first_points = grid_points(first, field_ndim)  # read once, compared with every member
    for name, view in given.items():
        if isinstance(view, Forcings):
            grid = view.grid.shape
            whole = field_shape if first.patch is None else forcing_window(name, first)[1]
            if grid != whole:
                raise ValueError(
                    f"stack member {name!r} (forcings) is on a {grid} grid, but {first_name!r} "
                    f"has field shape {whole}{' (unpatched)' if first.patch else ''}: give "
                    "Forcings the members' grid (view=one of them)"
                )
            _refuse_unheld_forcings(name, view, first_name, first.dtype)
            who = f"the forcings of stack member {view.names[0]!r}"
            fix = f"give Forcings view= the view of {first_name!r}"
            refuse_other_points(view.grid, first, who, repr(first_name), fix)
            for forcing in view.names:
                channels.append(view.prefix + forcing)
                one = view.only(forcing)
                c = len(channels) - 1
                members.append(StackMember(channels[-1], None, c, c + 1, False, forcing=one))
            continue
        at, inner = member_shape(name, view, ensemble, field_ndim)  # (without E)
        cut = None
        if isinstance(view, ArrayGeometry) and view.static and first.patch is not None:
            cut = static_window(name, view, first.patch, field_dims)
            inner = cut.shape(view)
        if len(inner) not in (field_ndim, field_ndim + 1):
            raise ValueError(
                f"stack member {name!r} has shape {inner}: a member is a field {field_shape} "
                f"or channels of it (channels, *field); select one axis away with isel/sel"
            )
        if inner[len(inner) - field_ndim :] != field_shape:
            raise ValueError(
                f"stack member {name!r} has field shape {inner[len(inner) - field_ndim :]}, "
                f"but {first_name!r} has {field_shape}: members must agree on the field "
                "after selection (select the same box with isel/sel)"
            )
        on, first_on = grid_dims(view, field_ndim), grid_dims(first, field_ndim)
        if on is not None and first_on is not None and on != first_on == on[::-1]:
            raise ValueError(
                f"stack member {name!r} is on the grid {on}, but {first_name!r} on "
                f"{first_on}: the shapes agree, the points do not (a transposed field); "
                "stack fields stored in one axis order"
            )
        if view is not first:
            placed = (placing(first, field_ndim), first_points)
            refuse_unlike_points(name, view, first_name, placed, field_ndim)
        if not view.static and _steps(view) != steps:
            raise ValueError(
                f"stack member {name!r} has {_describe_steps(_steps(view))}, but "
                f"{first_name!r} has {_describe_steps(steps)}: members must agree on T"
            )
        if view.dtype != first.dtype and not view.static:
            cast = _OWN_LABELS
            if all(_cf_dtype_helps(v) for v in (view, first)):
                cast = (
                    "cf_dtype='float32', open_geometries' or the collection's, delivers every "
                    f"CF-decoded array in float32; or {cast}"
                )
            raise ValueError(
                f"stack member {name!r} is {view.dtype}, but {first_name!r} is {first.dtype}: "
                f"stack members of one dtype ({cast})"
            )
        if view.static:
            _refuse_unheld_static(name, view, first_name, first.dtype)
        leveled = len(inner) == field_ndim + 1
        names = _channel_names(name, view, 0 if view.static or at else e) if leveled else [name]
        norm = None
        if normalize is not None:
            norm = _norm(normalize, name, view, first.dtype)
        c0 = len(channels)
        channels.extend(names)
        members.append(
            StackMember(name, view, c0, len(channels), leveled, norm, cut=cut, ensemble_at=at)
        )
    _refuse_shared_channel_names(members, channels)
    if normalize is not None and first.dtype.kind != "f":
        raise ValueError(
            f"normalize needs float members, and these are {first.dtype}: stack them without "
            "normalize= and standardise the stack's array in a batch transform, or give them "
            "as labels of their own with stats.normalizer (which delivers integer labels in "
            "float32)"
        )
    channel_names = tuple(channels)
    return Stack(tuple(members), layout, steps, field_shape, first.dtype, channel_names,
                 members_e, ensemble)  # fmt: skip


def _refuse_shared_channel_names(members: Sequence[StackMember], channels: Sequence[str]) -> None:
    """``ValueError`` when two members give a channel the same name (a member ``t`` of
    ensemble members, ``t@1 t@2 ...``, beside a member named ``t@1``): ``batch.channels``
    would name two fields alike. (A member that selects one position twice repeats a channel
    of itself: the same field, named alike.)"""
    owner: dict[str, str] = {}
    for m in members:
        for c in dict.fromkeys(channels[m.c0 : m.c1]):
            first = owner.setdefault(c, m.name)
            if first != m.name:
                raise ValueError(
                    f"stack members {first!r} and {m.name!r} both name a channel {c!r}: "
                    "batch.channels would name two fields alike; rename one of the members "
                    "(the name before '@' is the member's)"
                )


#: what to do with members of other dtypes (a chunk transform that casts a stack member is
#: refused: the stack is laid out from the stored dtypes)
_OWN_LABELS = (
    "give them as labels of their own, which a batch transform can cast and concatenate; a "
    "chunk transform that casts a stack member is refused"
)

#: per kind of the stack's dtype, the kinds of static members it holds (their values checked
#: when read: :func:`refuse_overflow`); complex, floats in an integer stack, other kinds refused
_HELD_KINDS = {"c": "biufc", "f": "biuf", "i": "biu", "u": "biu", "b": "b"}


def _refuse_unheld_static(
    name: str, view: ArrayGeometry, first_name: str, dtype: np.dtype[Any]
) -> None:
    """``ValueError`` for static member ``name`` whose values a stack of ``dtype`` cannot hold
    by kind: a float in an integer stack (truncated), a complex one in a real stack (its
    imaginary part dropped), an integer in a bool stack. (Values are checked when read.)"""
    if view.dtype == dtype or view.dtype.kind in _HELD_KINDS.get(dtype.kind, ""):
        return
    raise ValueError(
        f"stack member {name!r} is a static {view.dtype} field, but the stack is {dtype} (the "
        f"dtype of {first_name!r}): its values would be cast to {dtype} without a word "
        "(truncated, or their imaginary part dropped). Stack it beside members of its kind, "
        "give it as a label of its own, or cast it in a batch transform"
    )


def refuse_overflow(name: str, data: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """The values of static member ``name`` (``data``, as read) cast to the stack's ``dtype``;
    ``ValueError`` where the cast does not hold them: an integer out of the range of an
    integer stack, a value past the largest of a float stack (inf). Floats and integers are
    rounded to a float stack's precision, as numpy rounds them."""
    with np.errstate(over="ignore", invalid="ignore"):  # (what is lost is refused below)
        out = data.astype(dtype)
    if dtype.kind in "iu" and data.dtype.kind in "iu" and data.size:
        info = np.iinfo(dtype)
        lost = int(data.min()) < info.min or int(data.max()) > info.max
    elif dtype.kind in "fc":
        lost = bool(np.any(np.isfinite(data) & ~np.isfinite(out)))
    else:
        lost = False
    if lost:
        raise ValueError(
            f"stack member {name!r} has values ({np.nanmin(data)} to {np.nanmax(data)}) that "
            f"the stack's {dtype} cannot hold: standardise it (normalize=, with statistics "
            "fitted on it), or stack members of a wider dtype"
        )
    return out


def _refuse_unheld_forcings(
    name: str, forcings: Forcings, first_name: str, dtype: np.dtype[Any]
) -> None:
    """``ValueError`` for forcings (float32 values, never standardised) that a stack of
    ``dtype`` cannot hold: an integer stack truncates them (a cosine becomes 0) or wraps them
    around, a float16 one overflows the radiation (millions of J m-2) to inf."""
    for forcing in forcings.names:
        bound = forcings.largest(forcing)
        if dtype.kind in "fc" and bound <= float(np.finfo(dtype).max):
            continue
        fix = (
            "stack float members"
            if dtype.kind not in "fc"
            else "compute it as a label of its own (a Forcings batch transform, float32) or "
            "stack members of a wider dtype"
        )
        raise ValueError(
            f"stack member {name!r}: forcing {forcing!r} (float32 values up to {bound:.4g}, "
            f"never standardised) cannot be held by the stack's {dtype} (the dtype of "
            f"{first_name!r}): {fix}"
        )


def _check_patched(
    named: Mapping[str, ArrayGeometry],
    first_name: str,
    first: ArrayGeometry,
    grid: Sequence[str] | None,
) -> None:
    """Patched members: every sampled member patched alike (the same windows of the same
    dimensions: they share each row's origins), and a static member cut by those windows
    (:func:`static_window`, on the stack's field ``grid``)."""
    for name, view in named.items():
        if view.static:
            if first.patch is not None:
                static_window(name, view, first.patch, grid)  # (raises when it has no window)
            continue
        if (view.patch is None) != (first.patch is None):
            patched, whole = (name, first_name) if view.patch is not None else (first_name, name)
            raise ValueError(
                f"stack member {patched!r} is patched and {whole!r} is not: patch every "
                "sampled member alike, or none"
            )
        a, b = first.patch, view.patch
        differ = "" if a is None or b is None else a.differences(b)
        if differ:
            raise ValueError(
                f"stack members {first_name!r} and {name!r} are patched differently: they "
                f"differ in {differ}; members share each row's windows, so patch the same "
                "dimensions (by name: arrays of any rank) with the same extent, origins, "
                "stride and within box"
            )


def static_window(
    name: str, view: ArrayGeometry, spec: Patches, grid: Sequence[str] | None = None
) -> StaticCut:
    """Where the windows of ``spec`` (a patched stack's) cut the data of static member
    ``name``: along each patched dimension it has (:class:`~insitubatch_nodes.static.
    StaticCut`; ``.shape(view)`` is one window's shape). It may lack patched dimensions off the
    stack's field ``grid`` (its dimension names: a ``freq`` of 3-D sub-cubes beside a ``(dec,
    ra)`` beam), not those on it. ``ValueError`` when it lacks one of those, selects part of a
    patched dimension or reorders it (a selection of the whole axis in its order is none:
    :meth:`ArrayGeometry.isel <insitubatch_nodes.io.geometry.ArrayGeometry.isel>`), or has
    another length there."""
    cut = StaticCut.of(name, view, spec, who=f"stack member {name!r} (static)")
    keys = view.select.keys if view.select is not None else (None,) * view.ndim
    kept = [d for d, k in zip(view.dims or (), keys, strict=False) if not isinstance(k, int)]
    lacks = [d for d in spec.dims or () if d not in kept and (grid is None or d in grid)]
    if cut is None or lacks:
        raise ValueError(
            f"stack member {name!r} is a static field without the patched dimensions "
            f"{lacks or spec.dims or spec.axes}, but the stack's members are patched: give it "
            "as a label of its own, or stack arrays whose dimensions are named"
        )
    return cut


def forcing_window(name: str, first: ArrayGeometry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(axes, grid)`` of forcing member ``name`` of a patched stack whose first sampled
    member is ``first``: which of the forcing's two grid axes (its last two kept field axes)
    the stack's patches cut, in the patches' order, and the whole grid's shape (the field's
    length along the cut axes). ``ValueError`` when the patches cut another axis."""
    window = GridWindow.of_view(first)
    assert window is not None
    if window.off_grid:
        raise ValueError(
            f"stack member {name!r} (forcings) is on the grid of the last two field "
            f"dimensions, but the stack's patches also cut {window.off_grid[0]!r}: patch the "
            "grid only, or compute forcings as a batch transform (Forcings with view= the "
            "patched view)"
        )
    return window.axes, window.grid


def _named(
    views: Mapping[str, ArrayGeometry | Forcings] | Sequence[ArrayGeometry | Forcings],
) -> dict[str, ArrayGeometry | Forcings]:
    named: dict[str, ArrayGeometry | Forcings]
    if isinstance(views, Mapping):
        named = dict(views)
    else:
        named = {}
        for v in views:
            if isinstance(v, Forcings):
                named[f"forcings{len(named)}"] = v
                continue
            if not isinstance(v, ArrayGeometry):
                raise TypeError(f"stack() takes ArrayGeometry views, got {v!r}")
            if v.path in named:
                raise ValueError(
                    f"two members read {v.path!r}: name them, stack({{'a': ..., 'b': ...}})"
                )
            named[v.path] = v
    for name, v in named.items():
        if not isinstance(v, ArrayGeometry | Forcings):
            raise TypeError(
                f"stack member {name!r} must be an ArrayGeometry view or Forcings, got {v!r}"
            )
    return named


def _steps(view: ArrayGeometry) -> int | None:
    if view.window_offsets is None:
        return None
    if view.timed_window:
        raise ValueError(
            f"{view.path}: a stack member's window must be in samples: give its offsets as "
            "ints (a window in time deltas is resolved by the pipeline, not by stack())"
        )
    return len(view.window_offsets)


def _describe_steps(steps: int | None) -> str:
    return "no window (one step)" if steps is None else f"a window of {steps} steps"


def _channel_names(name: str, view: ArrayGeometry, skip: int = 0) -> list[str]:
    """``name@value`` per entry of the member's first inner axis after ``skip`` (an
    ensemble axis) (value: the coordinate's, or anemoi's ``variables`` names, where the store
    has them, else the index; where the store cannot be read, a 403 or a deadline spent, the
    ``OSError`` saying what to do, never the index). An axis the member's patches cut (windows of
    members, 3-D sub-cubes along ``freq``) holds other entries in each row: ``name@dim+k``,
    the ``k``-th of the row's window (``batch.patch_origins`` says where it starts)."""
    n = view.inner_shape[skip]
    keys = view.select.keys if view.select is not None else None
    kept = [i for i in range(len(view.field_axes)) if keys is None or not isinstance(keys[i], int)]
    axis = kept[skip]
    if view.patch is not None and view.field_axes[axis] in view.patch.axes:
        dim = "" if view.dims is None else view.dims[view.field_axes[axis]]
        return [f"{name}@{dim}+{k}" for k in range(n)]
    key = None if keys is None else keys[axis]
    index = list(range(n)) if key is None else list(key)  # type: ignore[arg-type]
    labels: list[Any] = index
    dims = view.dims
    if dims is not None and view.coordinates is not None:
        dim = dims[view.field_axes[axis]]
        try:  # (a store that cannot be read fails the stack, saying what to do: OSError)
            values = np.asarray(view.coordinates(view, dim))
        except KeyError:  # no such coordinate, nor anemoi names: the index names the channel
            values = None
        if values is not None and values.ndim == 1 and len(values) == view.field_shape[axis]:
            labels = [_plain(values[i]) for i in index]
            if values.dtype.kind == "M":  # dates as ISO 8601, to the precision they need
                labels = date_strings(values, values[index])
    return [f"{name}@{v}" for v in labels]


def _plain(value: Any) -> Any:
    # a float as its shortest decimal in its own dtype: float32 0.1 is 0.1, not 0.10000000149...
    item = float(str(value)) if isinstance(value, np.floating) else value
    item = item.item() if isinstance(item, np.generic) else item
    if isinstance(item, float) and item.is_integer():
        return int(item)
    return item


def _norm(
    stats: Statistics, name: str, view: ArrayGeometry, dtype: np.dtype[Any]
) -> tuple[np.ndarray, np.ndarray]:
    if name not in stats.mean:
        raise ValueError(
            f"normalize has no statistics for stack member {name!r} (it has "
            f"{sorted(stats.mean)}): fit them with fit_statistics under the member's name"
        )
    mean = stats.shaped(name, "mean", view)
    std = stats.shaped(name, "std", view)
    # a constant channel (std 0: a mask that is all sea in the box) standardises to 0, not NaN
    std = np.where(std == 0, 1.0, std)
    # float16 members are standardised in float32 (and rounded once): x - mean, or a std
    # float16 rounds to 0, would be inf or NaN where the result is a plain float16
    work = work_dtype(dtype)
    return mean.astype(work), std.astype(work)
