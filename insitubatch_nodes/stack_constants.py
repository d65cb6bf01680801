"""The constant channels of channel stacks: static members read once, forcings per batch.

A :func:`~insitubatch_nodes.stack.stack`'s sampled members are gathered straight into their
channel slices; its static members (arrays without a sample axis, read once) and its forcings
(computed from each row's time) are written by :class:`StackConstants`, the batch transform
the pipeline runs first on every gathered batch.

**Stacks given by set_views**: ``InSituPipeline.set_views`` may give a label a stack with
other static or forcing members, another layout or normalisation (or a stack where the label
had a plain view). :func:`prepare_constants` reads, then, the static arrays the new stacks need
that the pipeline does not hold yet (once, with :func:`~insitubatch_nodes.static.read_static`:
through the persistent cache when the pipeline has one), and the pipeline's
:class:`StackConstants` keeps the constants of the stacks in effect beside those of the new
ones. Each batch gets those of the stack its label is assembled with: the plan's views in
effect (``ReadPlanNode.batch_views``), which change only when an epoch starts, so an epoch
still in progress keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.forcing_grid import no_times
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.patches import patch_spec
from insitubatch_nodes.stack import (
    Stack,
    StackMember,
    channel_destination,
    forcing_window,
    refuse_overflow,
)
from insitubatch_nodes.static import StaticCut, StaticFields, select_static

if TYPE_CHECKING:
    from insitubatch_nodes.stages.gather import GatherNode

__all__ = ["StackConstants", "prepare_constants", "static_fields"]


class ViewsInEffect(Protocol):
    """What :class:`StackConstants` reads of the plan: the batch views in effect."""

    @property
    def batch_views(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class _Prepared:
    """The constants of one stack: each static member with its data as read (``raw``) and as
    written (standardised when the stack normalises, in the stack's dtype), and its forcings."""

    stack: Stack
    fills: tuple[tuple[StackMember, np.ndarray, np.ndarray], ...]
    forcings: tuple[StackMember, ...]
    #: a patched stack's: the extent of its windows, and where they cut each static member
    extent: tuple[int, ...] = ()
    cuts: tuple[StaticCut, ...] = ()
    #: ... and which of each forcing's two grid axes they cut
    forcing_cuts: tuple[tuple[int, ...], ...] = ()


class StackConstants:
    """A batch transform that writes the static and forcing members of channel stacks into
    every batch's channel slices (run first, on the gathered batch). ``stacks`` maps a label
    to its :class:`~insitubatch_nodes.stack.Stack`; ``arrays`` maps ``(label, member name)``
    to a static member's data (as its view selects it), standardised once, here, when the
    stack normalises. Forcings are computed from ``batch.coords[label][time_name]`` (the
    stack's times, ``(batch,)`` or ``(batch, T)``) for each batch, each row on its member's
    grid where the stack reads a collection whose members are at other places
    (``batch.members[label]``).

    ``plan`` (a :class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`) says which stack
    each label is assembled with (its ``batch_views``); :meth:`add` prepares the constants of
    stacks given later (module docstring). Without a plan, the stacks given here are written.
    """

    #: the pipeline's own constants, not a transform the user gave (the epoch report's
    #: ``batch_transforms`` leaves it out)
    pipeline_constants: ClassVar[bool] = True

    def __init__(
        self,
        stacks: Mapping[str, Stack],
        arrays: Mapping[tuple[str, str], np.ndarray],
        plan: ViewsInEffect | None = None,
    ) -> None:
        self.plan = plan
        self._variants: dict[str, list[_Prepared]] = {}
        self._prepare(stacks, arrays)

    def add(
        self, stacks: Mapping[str, Stack], arrays: Mapping[tuple[str, str], np.ndarray]
    ) -> None:
        """Prepare the constants of ``stacks`` (as in the constructor); those of stacks that
        are neither in effect nor among ``stacks`` are dropped."""
        self.adopt(StackConstants(stacks, arrays))

    def adopt(self, other: StackConstants) -> None:
        """Take the constants ``other`` prepared (of stacks given later, made without a plan:
        :func:`prepare_constants`); those of stacks neither in effect nor among its are
        dropped."""
        effect = {} if self.plan is None else dict(self.plan.batch_views)
        for label, variants in self._variants.items():
            variants[:] = [p for p in variants if p.stack is effect.get(label)]
        for label, prepared in other._variants.items():
            self._variants.setdefault(label, []).extend(prepared)

    def _prepare(
        self, stacks: Mapping[str, Stack], arrays: Mapping[tuple[str, str], np.ndarray]
    ) -> None:
        """Prepare the constants of ``stacks`` beside those prepared already."""
        for label, st in stacks.items():
            fills = []
            for member in st.static:
                raw = np.asarray(arrays[(label, member.name)])
                if member.norm is None:  # as read (a complex one keeps its imaginary part),
                    # refused where the stack's dtype does not hold its values
                    data = refuse_overflow(member.name, raw, st.dtype)
                else:  # standardised: the stack's dtype of the exact result, as the others'
                    mean, std = (a.astype(np.float64) for a in member.norm)
                    with np.errstate(over="ignore"):
                        data = ((raw.astype(np.float64) - mean) / std).astype(st.dtype)
                fills.append((member, raw, data))
            spec = st.sampled[0].geometry.patch
            cuts = () if spec is None else tuple(m.cut for m in st.static if m.cut is not None)
            extent = () if spec is None else spec.extent
            first = st.sampled[0].geometry
            forcing_cuts = () if spec is None else tuple(
                forcing_window(m.name, first)[0] for m in st.forcings
            )  # fmt: skip
            prepared = _Prepared(st, tuple(fills), st.forcings, extent, cuts, forcing_cuts)
            self._variants.setdefault(label, []).append(prepared)

    def held(self, view: ArrayGeometry) -> np.ndarray | None:
        """The data of a static member read through ``view``, if a stack prepared here has
        one (as read, before any standardisation), or a member that reads the whole array
        (selected as ``view`` selects it)."""
        whole = None
        for variants in self._variants.values():
            for prepared in variants:
                for member, raw, _ in prepared.fills:
                    if member.view == view:
                        return raw
                    if member.geometry == view.base:
                        whole = raw
        return None if whole is None else select_static(view, whole)

    def _in_effect(self) -> list[tuple[str, _Prepared]]:
        if self.plan is None:
            return [(label, v[0]) for label, v in self._variants.items() if v]
        out = []
        for label, view in self.plan.batch_views.items():
            if not isinstance(view, Stack) or not (view.static or view.forcings):
                continue
            found = next((p for p in self._variants.get(label, ()) if p.stack is view), None)
            if found is None:
                raise ValueError(
                    f"stack {label!r} has static or forcing members that no one read or set up "
                    "for this pipeline: give stacks to a built pipeline with "
                    "InSituPipeline.set_views (it reads them), not to its plan"
                )
            out.append((label, found))
        return out

    @property
    def held_bytes(self) -> int:
        """Bytes held outside the pool: the static members' data (as read and as standardised)
        and the forcing members' remembered fields (``pipe.stats()``'s
        ``batch_transform_bytes``)."""
        return self._held(lambda forcing, _: forcing.held_bytes)

    def most_held_bytes(self, views: Mapping[str, Any], rows: int, batches: int) -> int:
        """The most :attr:`held_bytes` grows to (the batch-transform protocol of the build's
        memory check; ``views``, ``rows`` and ``batches`` unused: the channels are written
        into the batch buffers): the static members' data as now, and each forcing member's
        remembered fields of at most the distinct times its stack's first sampled member
        holds."""
        return self._held(lambda forcing, n_times: forcing.most_remembered_bytes(n_times))

    def _held(self, forcing_bytes: Callable[[Any, int | None], int]) -> int:
        """The static members' data, each array once, plus ``forcing_bytes(forcing, n_times)``
        of each forcing member's transform, once each (``n_times``: the distinct times its
        stack's first sampled member holds, ``None`` where it has none)."""
        arrays: dict[int, int] = {}
        forcings: dict[int, int] = {}
        for variants in self._variants.values():
            for prepared in variants:
                for _, raw, data in prepared.fills:
                    arrays.update({id(raw): raw.nbytes, id(data): data.nbytes})
                sampled = prepared.stack.sampled
                n_times = sampled[0].geometry.base.n_samples if sampled else None
                for member in prepared.forcings:
                    if member.forcing is not None:
                        forcings[id(member.forcing)] = forcing_bytes(member.forcing, n_times)
        return sum(arrays.values()) + sum(forcings.values())

    def __call__(self, batch: Batch) -> Batch:
        for label, prepared in self._in_effect():
            st = prepared.stack
            arr = batch.arrays[label]
            last, ens = st.layout == "channels_last", st.ensemble is not None
            steps = [None] if st.steps is None else list(range(st.steps))
            for k, member in enumerate(prepared.forcings):
                assert member.forcing is not None
                time_name = member.forcing.time_name
                carried = batch.coords.get(label, {})
                times = carried.get(time_name)
                if times is None:
                    raise no_times(f"stack {label!r}, forcing {member.name!r}", label,
                                   time_name, carried)  # fmt: skip
                # each row on its member's grid (forcings of a collection's members' grids)
                rows_of = batch.members.get(label)
                cut = None  # or each row's window of the grid, cut from its time's field
                if prepared.forcing_cuts:
                    origins = batch.patch_origins[label]
                    cut = (origins, prepared.forcing_cuts[k], prepared.extent)
                values = next(iter(member.forcing.compute(times, rows_of, cut=cut).values()))
                for t in steps:
                    at = (member.channel,) if t is None else (t, member.channel)
                    step = values if t is None else values[:, t]
                    # the same for every ensemble member: broadcast along E
                    channel_destination(arr, at, last, ens)[...] = step[:, None] if ens else step
            for i, (member, _, data) in enumerate(prepared.fills):
                for t in steps:
                    at = (member.channel,) if t is None else (t, member.channel)
                    out = channel_destination(arr, at, last, ens)  # (data: broadcast along E)
                    if prepared.cuts:  # each row's window of the static field
                        rows = prepared.cuts[i].rows(data, batch.patch_origins[label])
                        out[...] = rows[:, None] if ens else rows  # (broadcast along E)
                    else:
                        out[...] = data
        return batch

    def __repr__(self) -> str:
        names = [
            (label, m.name)
            for label, variants in self._variants.items()
            for p in variants[:1]
            for m in (*(f[0] for f in p.fills), *p.forcings)
        ]
        return f"StackConstants({names})"


def static_fields(
    views: dict[str, Any], geoms: dict[str, ArrayGeometry]
) -> tuple[
    dict[str, Any],
    dict[str, ArrayGeometry],
    dict[str, ArrayGeometry],
    Callable[[Mapping[str, np.ndarray], ViewsInEffect], tuple[BatchTransform, ...]],
]:
    """The static views taken out of the plan: ``(views, geoms, statics, constants)`` — the
    views and arrays the plan reads, every static view to read once (stack members keyed
    ``"label/member"``), and what makes the batch transforms from the arrays read and the
    plan: a :class:`~insitubatch_nodes.static.StaticFields` that puts the static labels into
    every batch, then a :class:`StackConstants` that writes the static and forcing members of
    stacks into every batch's channel slices."""
    stacks: dict[str, Stack] = {label: v for label, v in views.items() if isinstance(v, Stack)}
    members = {f"{label}/{m.name}": m.geometry for label, st in stacks.items() for m in st.static}
    static = {label: v for label, v in views.items() if not isinstance(v, Stack) and v.static}
    sampled = {label: v for label, v in views.items() if isinstance(v, Stack) or not v.static}
    if not sampled:
        raise ValueError(
            f"every view ({sorted(static)}) is a static array: name at least one array with "
            "samples to train on"
        )
    if stacks or static:
        kept = {
            m.path
            for v in sampled.values()
            for m in (v.views if isinstance(v, Stack) else (v,))
            if not m.static
        }
        geoms = {path: g for path, g in geoms.items() if path in kept}
    fill = bool(members) or any(st.forcings for st in stacks.values())
    # the windows every patched label shares (a stack's by its sampled members): static labels
    # with a patched dimension are cut to each row's window (StaticFields refuses those that
    # cannot be now, not at the first batch)
    patches = patch_spec({
        label: v.sampled[0].geometry if isinstance(v, Stack) else v
        for label, v in sampled.items()
    })  # fmt: skip
    if static and patches is not None:
        StaticFields({}, static, patches)

    def constants(
        data: Mapping[str, np.ndarray], plan: ViewsInEffect
    ) -> tuple[BatchTransform, ...]:
        out: list[BatchTransform] = []
        if static:
            arrays = {label: data[label] for label in static}
            out.append(StaticFields(arrays, static, patches))
        if fill:
            constant = {
                (label, m.name): data[f"{label}/{m.name}"]
                for label, st in stacks.items()
                for m in st.static
            }
            out.append(StackConstants(stacks, constant, plan))
        return tuple(out)

    return sampled, geoms, {**static, **members}, constants


def prepare_constants(
    views: Mapping[str, Any],
    gather: GatherNode,
    plan: ViewsInEffect,
    read: Callable[[Mapping[str, ArrayGeometry]], Mapping[str, np.ndarray]],
) -> tuple[Callable[[], None], StackConstants]:
    """The static and forcing members of the stacks among ``views`` (given to
    ``InSituPipeline.set_views``), checked and read now: ``ValueError`` for a stack with
    forcings whose first sampled member's array has no times the batches carry; the static
    arrays no stack of ``gather``'s :class:`StackConstants` holds are read with ``read``
    (``{key: view} -> {key: data}``), once (``ValueError`` for one whose values the stack's
    dtype cannot hold, :func:`~insitubatch_nodes.stack.refuse_overflow`). Returns what makes
    them take effect — call it once the plan took ``views`` (it adds them to the pipeline's
    :class:`StackConstants`, putting one first among ``gather``'s batch transforms if it has
    none) — and the constants it adds, prepared (what the memory check counts them at, before:
    their ``most_held_bytes``)."""
    stacks = {label: v for label, v in views.items() if isinstance(v, Stack)}
    for label, st in stacks.items():
        path = st.sampled[0].geometry.path
        for m in st.forcings:
            assert m.forcing is not None
            if not gather.carries(path, m.forcing.time_name):
                carried = gather.carried_coordinates()
                timed = sorted(p for p, names in carried.items() if m.forcing.time_name in names)
                raise ValueError(
                    f"stack {label!r} computes forcing {m.name!r} from the times of its first "
                    f"sampled member's array {path!r}, which this pipeline's batches do not "
                    f"carry (they carry {carried}): "
                    + (
                        f"put first a member of {timed} (the arrays whose times the labels "
                        f"it was built with carry), or build it with {path!r} in a label "
                        "(or first in a stack)"
                        if timed
                        else "build the pipeline with coords=None (each view's times)"
                    )
                )
    found = [t for t in gather.batch_transforms if isinstance(t, StackConstants)]
    constants = found[0] if found else StackConstants({}, {}, plan)
    fields = [t for t in gather.batch_transforms if isinstance(t, StaticFields)]

    def held(view: ArrayGeometry) -> np.ndarray | None:
        """``view``'s data from a static array already read: a stack's member, or a static
        label that reads the whole array (selected as ``view`` selects it)."""
        got = constants.held(view)
        for label, v in (fields[0].views if fields and got is None else {}).items():
            if v == view.base:
                return select_static(view, fields[0].arrays[label])
        return got

    want = {(lb, m.name): m.geometry for lb, st in stacks.items() for m in st.static}
    kept = {key: held(view) for key, view in want.items()}
    need = {f"{lb}/{name}": want[(lb, name)] for (lb, name), d in kept.items() if d is None}
    data = dict(read(need)) if need else {}
    arrays: dict[tuple[str, str], np.ndarray] = {}
    for (label, name), have in kept.items():
        got = data[f"{label}/{name}"] if have is None else have
        arrays[(label, name)] = got
    for label, st in stacks.items():  # refused now, before the plan takes the views
        for m in st.static:
            if m.norm is None:
                refuse_overflow(m.name, arrays[(label, m.name)], st.dtype)

    pending = StackConstants(stacks, arrays)  # (prepared now: counted before commit takes it)

    def commit() -> None:
        constants.adopt(pending)
        if not found and any(st.static or st.forcings for st in stacks.values()):
            gather.run_first(constants)

    return commit, pending
