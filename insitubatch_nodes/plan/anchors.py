"""Which anchors a plan may use: the anchor stride and the missing-step checks.

A plan's anchors are the samples of the split whose every view reads inside the array (and,
by default, inside the split: :func:`~insitubatch_nodes.plan.epoch.chunk_counts`). Two rules
narrow that set, both as one boolean mask over the sample axis, computed with numpy (never a
loop over samples), the same on every rank and every epoch:

* **the stride** (``PlanConfig.stride``): an ``int`` ``k`` keeps the samples ``0, k, 2k, ...``
  (counted from index 0 of the array; of each member, in a collection's virtual array); a
  time step (``np.timedelta64``) keeps the samples whose time is a whole multiple of the step
  since ``1970-01-01T00:00`` in the coordinate's own calendar (``"6h"``: 00, 06, 12 and 18
  UTC), or since 0 where the coordinate holds durations (a lead time). A time step needs the
  anchor array's times (:class:`SampleSteps`) and must be a multiple of the data's step
  (``ValueError`` naming both).
* **missing steps** (:class:`SampleSteps`, given by the builder): an anchor ``a`` is dropped
  when a step ``a + k`` read by its views (``k`` in the set of the views' offsets) is missing,
  for the first of these reasons (:data:`REASONS`, in this order): ``"nat"`` — its time is NaT
  (``None`` for cftime dates); ``"gap"`` — its time is not ``time[a] + k * data_step`` (a gap, a
  duplicated or an out-of-order step), or it is a later copy of a time an earlier sample has
  (``SampleSteps.repeated``: each time is one time, its first sample neither listed nor with an
  absent object; ``k = 0`` included, so an anchor-only view and a time stride take a repeated
  time once); ``"missing"`` — it was listed in ``missing=``;
  ``"absent_object"`` — one of its stored objects is absent from the store
  (``missing_objects="drop"``). The checks are over the set of offsets the views read, so any
  view that reads a set of steps (a window) extends them.

:func:`anchor_filter` returns the mask and the count of dropped anchors per reason. Pure numpy:
no store, no zarr (the builder reads the times and lists the stored objects).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "REASONS",
    "SampleSteps",
    "anchor_filter",
    "calendar_unit",
    "describe_stride",
    "every_sample",
    "off_stride",
    "stride_mask",
]

#: why an anchor is dropped, in the order an anchor's reason is chosen
REASONS: tuple[str, ...] = ("nat", "gap", "missing", "absent_object")

_NO_TIME = np.iinfo(np.int64).min  # a missing time's tick (NaT's int64 pattern)


@dataclass(frozen=True, eq=False)
class SampleSteps:
    """What the plan knows about each sample of the anchor grid's sample axis, for the stride
    and the missing-step checks (built by the builder, carried by the
    :class:`~insitubatch_nodes.plan.splits.SplitManifest` as ``manifest.steps``).

    * ``ticks`` (``int64``, one per sample, or ``None`` when the times were not read): each
      sample's time as a count of ``unit`` since ``1970-01-01T00:00`` in the coordinate's own
      calendar (``io.coords.time_offsets``); a missing time holds ``int64``'s minimum.
    * ``unit``: the length of one tick (``np.timedelta64``): a second, or a calendar month
      (``"M"``) where the dates step by whole months of several lengths (monthly, seasonal or
      yearly means: ``anchor_steps.calendar_ticks``); a time stride or a window in time deltas
      is then refused.
    * ``listed``: the samples listed in ``missing=`` (``bool``, one per sample).
    * ``absent``: the samples one of whose stored objects is absent (``bool``, one per sample).
    * ``coord``: the time coordinate's name (for messages).
    * ``hashed_coord``: the name :meth:`fingerprint` hashes in its place (``None``: ``coord``):
      the builder's ``"time"`` for any coordinate before 2026-12-07 where the times were read
      for a time stride, time-delta windows or dates in ``missing=``, kept so that states
      saved then still restore.
    * ``runs`` (``int64``, ascending, the first ``0``; ``None``: one run): the first sample of
      each run of times that continue one another — a collection's independent members, each
      its own timeline. No difference is taken across a run's edge.
    * ``backwards``: the times run backwards along the samples (newest first) and ``ticks``
      count them negated, so that one step on in samples is one data step (back in time): a
      window's time deltas resolve to samples the other way round (``"-6h"`` is a sample on).
    * ``recorded``: how many of the dates ``listed`` drops the store itself lists as missing
      (anemoi-datasets' ``missing_dates``: :func:`~insitubatch_nodes.io.anemoi.
      recorded_missing`), for messages; not hashed (``listed`` is).

    With ``ticks``, the checks ``"nat"`` and ``"gap"`` run; ``data_step`` is then the most
    common difference between consecutive times of one run (ties: the smallest), in ticks.
    """

    n_samples: int
    ticks: np.ndarray | None = None
    unit: np.timedelta64 = field(default_factory=lambda: np.timedelta64(1, "s"))
    listed: np.ndarray | None = None
    absent: np.ndarray | None = None
    coord: str = "time"
    runs: np.ndarray | None = None
    hashed_coord: str | None = None
    backwards: bool = False
    recorded: int = 0

    def __post_init__(self) -> None:
        n = int(self.n_samples)
        object.__setattr__(self, "n_samples", n)
        for name, kind in (("ticks", np.int64), ("listed", bool), ("absent", bool)):
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.array(value, dtype=kind)
            if arr.shape != (n,):
                raise ValueError(f"SampleSteps.{name} must hold one value per sample ({n})")
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if self.runs is not None:
            runs = np.array(self.runs, dtype=np.int64)
            if runs.ndim != 1 or not len(runs) or runs[0] != 0 or np.any(np.diff(runs) <= 0):
                raise ValueError("SampleSteps.runs must ascend from 0: each run's first sample")
            if runs[-1] >= max(n, 1):
                raise ValueError(f"SampleSteps.runs must start runs inside the {n} samples")
            runs.setflags(write=False)
            object.__setattr__(self, "runs", runs)

    @functools.cached_property
    def nat(self) -> np.ndarray | None:
        """Samples whose time is missing (``None`` without times)."""
        return None if self.ticks is None else self.ticks == _NO_TIME

    @functools.cached_property
    def repeated(self) -> np.ndarray | None:
        """Samples whose time an earlier sample of their run already has (pandas'
        ``duplicated()``, run by run; ``None`` without times): later copies of a time, which
        the checks count as absent (``"gap"``), so that each time is one time. A sample
        listed in ``missing=`` or with an absent stored object (``absent``) is no copy: the
        first one that can be read is the time's (list the copies not to read; before
        2026-12-07 a time whose first copy's object was absent lost its later copies too)."""
        if self.ticks is None:
            return None
        out = np.zeros(self.n_samples, dtype=bool)
        readable = self.ticks != _NO_TIME
        for gone in (self.listed, self.absent):
            if gone is not None:
                readable &= ~gone
        at = np.flatnonzero(readable)
        t = self.ticks[at]
        if bool((np.diff(t) > 0).all()):  # (the usual: O(n))
            return out
        run = np.zeros(len(at), np.int64)
        if self.runs is not None:  # (a time may be once in each run: a member's own)
            run = np.searchsorted(self.runs, at, side="right")
        order = np.lexsort((at, t, run))  # by run, time, then sample
        t, run = t[order], run[order]
        again = np.zeros(len(at), dtype=bool)
        again[1:] = (t[1:] == t[:-1]) & (run[1:] == run[:-1])
        out[at[order]] = again
        return out

    @functools.cached_property
    def data_step(self) -> int | None:
        """The data's step in ticks: the most common positive difference between
        consecutive present times of one run, the smallest on a tie (``None`` when no run
        holds two times: a member's single time, or the gap between two members' times, never
        tells the step)."""
        if self.ticks is None:
            return None
        present = self.ticks != _NO_TIME
        t = self.ticks[present]
        d = np.diff(t)
        if self.runs is not None:  # only differences within one run
            run = np.searchsorted(self.runs, np.flatnonzero(present), side="right")
            d = d[run[1:] == run[:-1]]
        d = d[d > 0]
        if not len(d):
            return None
        values, counts = np.unique(d, return_counts=True)
        return int(values[int(np.argmax(counts))])

    def fingerprint(self) -> str:
        """A short hash of everything here (what a plan's anchors are a function of)."""
        coord = self.coord if self.hashed_coord is None else self.hashed_coord
        h = hashlib.sha256(f"{self.n_samples}|{self.unit}|{coord}".encode())
        for arr in (self.ticks, self.listed, self.absent):
            h.update(b"-" if arr is None else np.ascontiguousarray(arr).tobytes())
        if self.runs is not None:  # (absent otherwise: the fingerprints without runs stay)
            h.update(b"runs|" + self.runs.tobytes())
        if self.backwards:  # (likewise)
            h.update(b"backwards")
        return h.hexdigest()[:16]


def every_sample(stride: int | np.timedelta64) -> bool:
    """Whether ``stride`` keeps every sample: the int 1 (a time step never does, ``"1h"``
    included, though numpy finds ``timedelta64(1, "h") == 1``)."""
    return isinstance(stride, int) and stride == 1


def describe_stride(stride: int | np.timedelta64) -> int | str:
    """``stride`` as plain Python for a fingerprint: the int, or the step in its own unit
    (``"6 hours"`` as numpy writes it)."""
    return int(stride) if isinstance(stride, int) else str(stride)


def _step_ticks(stride: np.timedelta64, steps: SampleSteps | None) -> tuple[int, SampleSteps]:
    """A time stride in ticks of ``steps``, checked against the data's step."""
    if steps is None or steps.ticks is None:
        raise ValueError(
            f"stride {stride} is a time step: it is resolved through the anchor array's time "
            "coordinate, which this plan was not given (build with insitu_pipeline, or attach "
            "SampleSteps to the manifest with manifest.with_steps(...)); or give an int stride"
        )
    calendar = calendar_unit(steps)
    if calendar is not None:
        raise ValueError(
            f"stride {stride} is a time step, but the times of {steps.coord!r} step by calendar "
            f"{calendar} (of several lengths), which no time step counts: give an int stride "
            f"(every k-th sample: k {calendar})"
        )
    unit_ns = int(steps.unit.astype("m8[ns]").astype(np.int64))
    stride_ns = int(stride.astype("m8[ns]").astype(np.int64))
    if stride_ns <= 0 or stride_ns % unit_ns:
        raise ValueError(f"stride {stride} must be a positive whole number of {steps.unit}")
    k = stride_ns // unit_ns
    data = steps.data_step
    if data is not None and k % data:
        step = np.timedelta64(data * unit_ns, "ns")
        raise ValueError(
            f"stride {stride} is not a multiple of the data's step "
            f"({_readable(step)} between samples of {steps.coord!r}): give a multiple of "
            f"{_readable(step)}"
        )
    return k, steps


def calendar_unit(steps: SampleSteps) -> str | None:
    """``"months"`` where ``steps`` counts its ticks in calendar months (dates whole months
    apart, of several lengths); ``None`` for a fixed unit."""
    return "months" if np.datetime_data(steps.unit)[0] == "M" else None


def _readable(step: np.timedelta64) -> str:
    ns = int(step.astype("m8[ns]").astype(np.int64))
    for unit, size in (("D", 86_400 * 10**9), ("h", 3_600 * 10**9), ("min", 60 * 10**9)):
        if ns % size == 0:
            return f"{ns // size}{unit}"
    return f"{ns / 1e9:g}s"


def stride_mask(
    n_samples: int,
    stride: int | np.timedelta64,
    steps: SampleSteps | None,
    origins: np.ndarray | None = None,
) -> Any:
    """The samples ``stride`` keeps as anchors (``bool``, one per sample), or ``None`` for
    every sample (``stride == 1``). A time stride keeps the samples whose time is a whole
    multiple of it since ``1970-01-01T00:00`` (a missing time is not kept). An int stride
    counts from each sample's ``origins`` (one per sample: a collection member's first
    sample), from index 0 without."""
    if isinstance(stride, int):
        if every_sample(stride):
            return None
        at = np.arange(n_samples, dtype=np.int64)
        return (at if origins is None else at - origins) % stride == 0
    k, steps = _step_ticks(stride, steps)
    assert steps.ticks is not None
    return (steps.ticks != _NO_TIME) & (steps.ticks % k == 0)


def off_stride(stride: int | np.timedelta64, steps: SampleSteps | None) -> str | None:
    """Why a time ``stride`` keeps no sample at all — every present time lies off its grid,
    as 6-hourly data at 03, 09, 15 and 21 UTC do under ``"6h"`` — said with what to do; ``None``
    for an int stride, without times, or when some time lies on it."""
    if isinstance(stride, int) or steps is None or steps.ticks is None:
        return None
    k, _ = _step_ticks(stride, steps)
    present = steps.ticks[steps.ticks != _NO_TIME]
    if not len(present) or bool((present % k == 0).any()):
        return None
    unit_ns = int(steps.unit.astype("m8[ns]").astype(np.int64))
    first = -int(present[0]) if steps.backwards else int(present[0])  # (its time's ticks)
    past = _readable(np.timedelta64(first % k * unit_ns, "ns"))
    return (
        f"no time of {steps.coord!r} lies on stride {stride}: a time stride keeps the times "
        "that are whole multiples of it since 1970-01-01T00:00 (in the coordinate's calendar; "
        "since 0 for durations), "
        f"and none is (the first is {past} past one); give an int stride instead (every k-th "
        "sample, counted from the first)"
    )


def _reason_masks(steps: SampleSteps, offsets: Iterable[int]) -> dict[str, np.ndarray]:
    """For each reason, the anchors one of whose steps ``a + k`` is missing for it (a step
    outside the array is not counted here: the range rule drops those anchors)."""
    n = steps.n_samples
    a = np.arange(n, dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    nat, data, repeated = steps.nat, steps.data_step, steps.repeated
    for k in sorted(set(int(k) for k in offsets)):
        j = a + k
        inside = (j >= 0) & (j < n)
        jj = np.clip(j, 0, max(n - 1, 0))
        per: dict[str, np.ndarray] = {}
        if steps.ticks is not None and nat is not None and repeated is not None:
            per["nat"] = nat[jj] | nat  # the anchor's own time is a step too (k = 0)
            per["gap"] = ~per["nat"] & repeated[jj]  # a later copy of a time: as if absent
            if data is not None:
                per["gap"] |= ~per["nat"] & (steps.ticks[jj] != steps.ticks + k * data)
        if steps.listed is not None:
            per["missing"] = steps.listed[jj]
        if steps.absent is not None:
            per["absent_object"] = steps.absent[jj]
        for reason, bad in per.items():
            bad = bad & inside
            out[reason] = out[reason] | bad if reason in out else bad
    return out


def anchor_filter(
    n_samples: int,
    offsets: Iterable[int],
    stride: int | np.timedelta64,
    steps: SampleSteps | None,
    origins: np.ndarray | None = None,
) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """``(keep, dropped)``: the samples that may be anchors under ``stride`` and the
    missing-step checks (``None``: every sample), and for each reason of :data:`REASONS` the
    on-stride samples dropped for it (each under its first reason only). ``origins`` (one per
    sample) is where an int stride counts from (:func:`stride_mask`)."""
    offsets = list(offsets)
    keep = stride_mask(n_samples, stride, steps, origins)
    dropped: dict[str, np.ndarray] = {}
    if steps is None:
        return keep, dropped
    if steps.n_samples != n_samples:
        raise ValueError(
            f"the manifest's SampleSteps cover {steps.n_samples} samples but its anchor grid "
            f"has {n_samples}"
        )
    masks = _reason_masks(steps, offsets)
    taken = np.zeros(n_samples, dtype=bool) if keep is None else ~keep
    for reason in REASONS:
        if reason in masks:
            dropped[reason] = masks[reason] & ~taken
            taken = taken | masks[reason]
    good = ~taken
    return good, dropped


def dropped_counts(
    dropped: Mapping[str, np.ndarray], anchors_in_range: np.ndarray
) -> dict[str, int]:
    """Anchors of ``anchors_in_range`` (sample indices the range rule keeps) dropped for each
    reason: ``{"nat": 3, "gap": 2, ...}`` (every checked reason, zeros included)."""
    return {reason: int(mask[anchors_in_range].sum()) for reason, mask in dropped.items()}
