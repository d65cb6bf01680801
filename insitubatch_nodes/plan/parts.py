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
label's leading axes (a stack of channels would be ``(T, C)`` with parts at ``(t, c)``).

Pure Python over :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`: no numpy arrays, no
store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.anchors import SampleSteps

__all__ = [
    "BatchLayout",
    "LabelParts",
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
    window), and ``parts``: ``(part label, index into lead)`` for each part, in order."""

    lead: tuple[int, ...]
    parts: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class BatchLayout:
    """How each batch label is assembled from its parts (module docstring).

    ``labels`` maps a batch label to its :class:`LabelParts`; ``views`` maps a batch label to
    the view it was given (a window view for a window).
    """

    labels: Mapping[str, LabelParts]
    views: Mapping[str, ArrayGeometry]

    def is_plain(self) -> bool:
        """True when every label is one part (no window): batch labels are plan labels."""
        return all(not lp.lead for lp in self.labels.values())


def expand_views(
    views: Mapping[str, ArrayGeometry],
) -> tuple[dict[str, ArrayGeometry], BatchLayout]:
    """``(parts, layout)``: the plain views the plan reads (part label -> view) and how the
    batch labels are assembled from them. A view of one step is its own part; a window of
    ``T`` steps (resolved to samples) is ``T`` parts ``label[t]``. ``ValueError`` when a
    window is still in time deltas, or a part's label is also a given label."""
    parts: dict[str, ArrayGeometry] = {}
    labels: dict[str, LabelParts] = {}
    for label, view in views.items():
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


def resolve_windows(
    views: Mapping[str, ArrayGeometry], steps: SampleSteps | None
) -> dict[str, ArrayGeometry]:
    """``views`` with every time-delta window resolved to samples through ``steps`` (the
    anchor array's times, :class:`~insitubatch_nodes.plan.anchors.SampleSteps`): a delta must
    be a whole multiple of the data's step (``ValueError`` naming both). ``ValueError`` when a
    window is in time deltas and there are no times to resolve it with."""
    timed = sorted(label for label, v in views.items() if v.timed_window)
    if not timed:
        return dict(views)
    if steps is None or steps.ticks is None or steps.data_step is None:
        raise ValueError(
            f"the windows of {timed} are in time deltas: they are resolved through the anchor "
            "array's time coordinate, which this plan was not given (build with "
            "insitu_pipeline, or attach SampleSteps with manifest.with_steps(...)); or give "
            "their offsets in samples"
        )
    step = steps.unit * steps.data_step
    return {label: v.in_samples(step, steps.coord) for label, v in views.items()}
