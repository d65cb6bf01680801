"""A batch label's *parts*: the plain views the plan reads for it, and where each one lands.

A label whose view reads one step of its array (``g``, ``g.shift(1)``, ``g.patches(...)``) is
one part, itself, filling the whole of the label's batch array ``(batch, *inner)``. A window
view (``g.window([-1, 0, 1])``) is ``T`` parts, one plain shifted view per step, labelled
``"x[0]"``, ``"x[1]"``, ...; part ``t`` fills ``batch.arrays["x"][:, t]``. The plan, the
read-once schedule, the dealing between ranks, the schedule's floors, resume and elastic resume
all work on parts as on any views (the steps of one array share its path, so each stored chunk
is still fetched and decoded once per epoch); only the batch buffer and each part's
destination in it differ.

:class:`BatchLayout` says, per label, the leading axes its rows carry before the field
(``()`` for one step, ``(T,)`` for a window) and each part's index into them. The rule is
general: a label whose buffer is filled by several parts, each writing to one index of the
label's leading axes. A channel stack (:func:`~insitubatch_nodes.stack.stack`) is one: each
sampled member (each step of a member, for windows) is a part at ``([t,] channel)``, the
channel an int (one channel) or a slice (a member with channels of its own), and its
destination the member's channel slice of the label's buffer (channels first or last).

Pure Python over :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`: no numpy arrays, no
store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.anchors import SampleSteps, calendar_unit
from insitubatch_nodes.stack import Stack, channel_destination

__all__ = [
    "BatchLayout",
    "LabelParts",
    "Stack",
    "expand_views",
    "part_label",
    "resolve_windows",
]


def part_label(label: str, index: tuple[int, ...]) -> str:
    """The plan's label of the part of ``label`` at ``index`` of its leading axes (``label``
    itself for a label of one part)."""
    return label if not index else f"{label}[{','.join(str(i) for i in index)}]"


@dataclass(frozen=True)
class LabelParts:
    """One label's batch rows: ``lead`` axes before the field (``()``, or ``(T,)`` for a
    window), and ``parts``: ``(part label, index into lead)`` for each part, in order.

    A channel stack (``stack`` set) has rows ``stack.row_shape``; its parts' indices are
    ``([t,] channel)`` (see :func:`~insitubatch_nodes.stack.channel_destination`), and its
    sample indices are those of ``steps`` (its first member's parts, one per step)."""

    lead: tuple[int, ...]
    parts: tuple[tuple[str, tuple[Any, ...]], ...]
    stack: Stack | None = None
    steps: tuple[str, ...] = ()
    members: tuple[str, ...] = ()  # a stack's: the member each part reads

    def row_shape(self, part_inner: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one row of the label (``part_inner``: its first part's inner shape)."""
        return self.stack.row_shape if self.stack is not None else (*self.lead, *part_inner)

    def destination(self, arr: np.ndarray, index: tuple[Any, ...]) -> np.ndarray:
        """The view of the label's batch array ``arr`` that the part at ``index`` fills."""
        if self.stack is not None:
            last, ens = self.stack.layout == "channels_last", self.stack.ensemble is not None
            swap = ens and self.stack.ensemble_after_channels(index[-1])
            return channel_destination(arr, index, last, ens, swap)
        return arr[(slice(None), *index)] if index else arr

    def indices(self, by_part: Mapping[str, np.ndarray]) -> np.ndarray:
        """The label's sample indices from its parts': ``(batch,)`` or ``(batch, T)``."""
        if self.stack is not None:
            if self.stack.steps is None:
                return by_part[self.steps[0]]
            return np.stack([by_part[p] for p in self.steps], axis=1)
        if not self.lead:
            return by_part[self.parts[0][0]]
        return np.stack([by_part[p] for p, _ in self.parts], axis=1)


@dataclass(frozen=True)
class BatchLayout:
    """How each batch label is assembled from its parts (module docstring).

    ``labels`` maps a batch label to its :class:`LabelParts`; ``views`` maps a batch label to
    the view it was given (a window view for a window).
    """

    labels: Mapping[str, LabelParts]
    views: Mapping[str, ArrayGeometry | Stack]

    def is_plain(self) -> bool:
        """True when every label is one part (no window): batch labels are plan labels."""
        return all(not lp.lead and lp.stack is None for lp in self.labels.values())

    def normalized(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Part label -> ``(mean, std)`` of the stack members standardised in the copy."""
        out = {}
        for lp in self.labels.values():
            if lp.stack is None:
                continue
            norms = {m.name: m.norm for m in lp.stack.members if m.norm is not None}
            for (part, _), name in zip(lp.parts, lp.members, strict=True):
                if name in norms:
                    out[part] = norms[name]
        return out

    def strided_parts(self) -> frozenset[str]:
        """The parts whose rows are not contiguous in the batch (channels last, an ensemble
        axis)."""
        return frozenset(
            part
            for lp in self.labels.values()
            if lp.stack is not None
            and (lp.stack.layout == "channels_last" or lp.stack.ensemble is not None)
            for part, _ in lp.parts
        )


def expand_views(
    views: Mapping[str, ArrayGeometry | Stack],
) -> tuple[dict[str, ArrayGeometry], BatchLayout]:
    """``(parts, layout)``: the plain views the plan reads (part label -> view) and how the
    batch labels are assembled from them. A view of one step is its own part; a window of
    ``T`` steps (resolved to samples) is ``T`` parts ``label[t]``; a channel stack's sampled
    member ``m`` is the part ``label[m]`` (``label[m,t]`` per step of a window). ``ValueError``
    when a window is still in time deltas, or a part's label is also a given label."""
    parts: dict[str, ArrayGeometry] = {}
    labels: dict[str, LabelParts] = {}
    for label, view in views.items():
        if isinstance(view, Stack):
            labels[label] = _stack_parts(label, view, views, parts)
            continue
        if not isinstance(view, ArrayGeometry):
            raise TypeError(f"views[{label!r}] must be an ArrayGeometry view, got {view!r}")
        steps = view.parts()  # (refuses a window still in time deltas)
        if view.window_offsets is None:
            labels[label] = LabelParts((), ((label, ()),))
            parts[label] = view
            continue
        members = []
        for t, step in enumerate(steps):
            name = part_label(label, (t,))
            if name in views:
                raise ValueError(
                    f"label {name!r} names both a view and step {t} of window {label!r}: "
                    "rename the view"
                )
            parts[name] = step
            members.append((name, (t,)))
        labels[label] = LabelParts((len(steps),), tuple(members))
    return parts, BatchLayout(labels, dict(views))


def _stack_parts(
    label: str,
    view: Stack,
    views: Mapping[str, ArrayGeometry | Stack],
    parts: dict[str, ArrayGeometry],
) -> LabelParts:
    members: list[tuple[str, tuple[Any, ...]]] = []
    names: list[str] = []
    steps: list[str] = []
    for member in view.sampled:
        if "[" in member.name or "," in member.name or "]" in member.name:
            raise ValueError(f"stack member name {member.name!r} may not hold '[', ',' or ']'")
        one = member.geometry.parts() if view.steps is not None else [member.geometry]
        for t, step in enumerate(one):
            at = (member.channel,) if view.steps is None else (t, member.channel)
            name = (
                f"{label}[{member.name}]" if view.steps is None else f"{label}[{member.name},{t}]"
            )
            if name in views:
                raise ValueError(
                    f"label {name!r} names both a view and member {member.name!r} of stack "
                    f"{label!r}: rename the view"
                )
            parts[name] = step
            members.append((name, at))
            names.append(member.name)
            if member is view.sampled[0]:
                steps.append(name)
    lead = (len(view.channels),) if view.steps is None else (view.steps, len(view.channels))
    return LabelParts(lead, tuple(members), view, tuple(steps), tuple(names))


def resolve_windows(
    views: Mapping[str, ArrayGeometry | Stack], steps: SampleSteps | None
) -> dict[str, ArrayGeometry | Stack]:
    """``views`` with every time-delta window resolved to samples through ``steps`` (the
    anchor array's times, :class:`~insitubatch_nodes.plan.anchors.SampleSteps`): a delta must
    be a whole multiple of the data's step (``ValueError`` naming both). ``ValueError`` when a
    window is in time deltas and there are no times to resolve it with, or no step (fewer
    than two times; with ``steps.runs``, no run holding two) — never a guessed step."""
    timed = sorted(
        label for label, v in views.items() if not isinstance(v, Stack) and v.timed_window
    )
    if not timed:
        return dict(views)
    if steps is not None and steps.ticks is not None and steps.data_step is None:
        where = "in one run (member)" if steps.runs is not None else "in the array"
        raise ValueError(
            f"the windows of {timed} are in time deltas, but the times of {steps.coord!r} give "
            f"no step to count them in (no two consecutive times {where}): give their offsets "
            "in samples"
        )
    if steps is None or steps.ticks is None:
        raise ValueError(
            f"the windows of {timed} are in time deltas: they are resolved through the anchor "
            "array's time coordinate, which this plan was not given (build with "
            "insitu_pipeline, or attach SampleSteps with manifest.with_steps(...)); or give "
            "their offsets in samples"
        )
    assert steps.data_step is not None
    calendar = calendar_unit(steps)
    if calendar is not None:
        raise ValueError(
            f"the windows of {timed} are in time deltas, but the times of {steps.coord!r} step "
            f"by calendar {calendar} (of several lengths), which no time delta counts: give "
            f"their offsets in samples ({calendar})"
        )
    step = steps.unit * steps.data_step
    out = {
        label: v if isinstance(v, Stack) else v.in_samples(step, steps.coord)
        for label, v in views.items()
    }
    if steps.backwards:  # newest first: a step back in time is a sample on
        for label in timed:
            view = out[label]
            assert isinstance(view, ArrayGeometry) and view.window_offsets is not None
            out[label] = replace(view, window_offsets=tuple(-k for k in view.window_offsets))
    return out
