"""Normalisation statistics fitted on a split: :func:`fit_statistics` and :class:`Statistics`.

Per label, over the samples of one split (a leakage-safe range: the manifest's chunks of that
split, nothing of the others): the mean, standard deviation, minimum and maximum, and the
standard deviation of one-step differences (``x[t + 1] - x[t]`` for consecutive samples both in
the split, one data step apart in time where the samples have times: none is taken across a
step absent from the times; GraphCast's and anemoi's *tendency* statistics; with a ``stride``
the samples are its anchors and a step is the stride). Each is computed **per channel**:
reduced over the samples and the horizontal grid (the last two field axes, or the last one where
it is a grid of points: :func:`~insitubatch_nodes.io.points.grid_ndim`), kept along the others,
so ``(level, lat, lon)`` and ``(level, values)`` views have one value per level, and an
ensemble's ``(member, level, lat, lon)`` one per member and level. ``pool=("member",)`` reduces
over the named dimensions too (anemoi's statistics, one per variable over every member): the
statistics record which (``dataset["pool"]``) and standardise any members of the view alike.
A static view's statistics are its field's, and it has no differences; nor has a view on product
sample axes (``(t, z)`` planes): rows next on its virtual axis are no one step of anything.

One pass: the pipeline's own engine reads every chunk of the split once, in sample order (no
shuffle; a chunk never read twice), with the views' selections; each batch is accumulated in
float64 and batches are merged as Chan et al.'s pairwise update (``std`` with ``ddof=0``;
:mod:`~insitubatch_nodes._moments` says how a batch's sums are taken without cancelling: a
constant channel, missing points or not, has a ``std`` of exactly 0). A batch's one-step
differences of float32 data without NaNs are taken in the same pass as its values: each row's
float64 sum and sum of squares and each pair's dot product give the exact differences' moments,
no difference formed (``_Moments.add_steps``), except in a channel whose steps are too small
beside its values for that (its squares would cancel); there, across a batch's edge, and for
other data the differences are formed a block at a time (a batch-sized array only in a batch
with NaNs): in float32 for float32 data (each within half an ulp of the exact difference), in
float64 for other dtypes; and summed in float64. NaNs are skipped and counted
(``nan_count``); a channel with no finite value has NaN statistics.

:meth:`Statistics.save` and :meth:`Statistics.load` keep them as JSON together with what they
were fitted on (``dataset``: the store, the split, its sample range, the views, and a
``stride`` or missing steps that picked the samples, as a pipeline's config names them), which
:meth:`Statistics.load` can check. :meth:`Statistics.normalizer` is a batch transform that
standardises each label in place; :meth:`Statistics.scaler` the chunk transform
:class:`~insitubatch_nodes.transforms.StandardScaler` for labels that read whole arrays. Both,
and a stack's ``normalize=``, take a constant channel's ``std`` of 0 as 1 (``x - mean``), and
refuse statistics fitted on another array, other channels or otherwise decoded values than the
view given under their label. :class:`Statistics` lives in
:mod:`~insitubatch_nodes.statistics_fitted` (what every later use of fitted statistics needs)
and is importable from here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes._checks import check_instance
from insitubatch_nodes._fitted_on import (
    unmoved,
    view_record,
)
from insitubatch_nodes._moments import _Moments, as_channels
from insitubatch_nodes.anchor_steps import anchor_time_coordinate, forward_ticks, repeated_times
from insitubatch_nodes.batch import Batch
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.coords import MISSING_OFFSET
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store, retry_policy
from insitubatch_nodes.io.timeline import whole_seconds
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.pipeline import insitu_pipeline
from insitubatch_nodes.plan.anchors import SampleSteps
from insitubatch_nodes.plan.fingerprint import anchors_hash
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.static import read_static
from insitubatch_nodes.statistics_fitted import (
    FIELDS,
    Statistics,
    channel_dims,
    channel_lengths,
    refuse_complex,
)

__all__ = ["Statistics", "fit_statistics"]


def fit_statistics(
    store: StoreLike | Collection,
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry | Forcings] | Sequence[str],
    split: str = "train",
    *,
    batch_size: int = 32,
    pool: str | Sequence[str] = (),
    **pipeline_options: Any,
) -> Statistics:
    """Fit :class:`Statistics` on ``split`` of ``manifest`` for ``views`` (``{label: view}``, or
    array names; a stack's members may be given as they are: a
    :class:`~insitubatch_nodes.forcings.Forcings` among them is skipped, as the stack never
    normalises it), in one pass over the split's chunks (module docstring). ``store`` is what
    :func:`~insitubatch_nodes.pipeline.insitu_pipeline` takes, a collection included (its
    members' own samples count, never their padding, and no difference spans two members). A
    view's shift and window are ignored (the statistics, per channel, are of its array, as
    selected). A ``split`` that holds no chunk is refused (``ValueError``) when a view is
    sampled. Every rank that calls it reads the whole split (``rank=0, world_size=1``): fit once
    and share the saved file; ``rank``, ``world_size``, ``shuffle`` and ``coords`` among
    ``pipeline_options`` are a ``TypeError`` (the fit sets them); the others go to
    :func:`~insitubatch_nodes.pipeline.insitu_pipeline` (``cache_budget_bytes``, ``fetch=``,
    ...). A patched view's statistics are those of its field within the box its windows lie
    in (``within``, else the whole field; the fit reads whole samples of it), so a patched stack
    member is normalised with the statistics of every point it may cut. The pass keeps nothing
    for a next epoch: rows read by one sample are decoded straight into the batches
    (``direct=True`` unless ``fetch`` says otherwise) and the automatic budget holds only the
    working set, whose slots are reused, where a pipeline built for training keeps a split that
    fits a sixteenth of RAM whole (in fresh memory, slow to touch the first time). Static
    views are read through the pass's persistent cache (``cache_dir=..., persist=True`` or
    ``readonly_cache=True``) as a pipeline reads its static labels: kept there by the first
    fit, served by the next without a read; static views alone (no pass) are read from the
    store.

    ``pool``: channel dimensions (by name) to reduce over as well, in every view that keeps
    them: ``pool="member"`` fits an ensemble's statistics over all its members, one value per
    level as anemoi-datasets fits them, where by default each member is a channel of its own.
    They then standardise any selection of the members (one value for all); ``ValueError`` for
    a name that is no view's channel dimension (a sample or grid dimension is reduced already).
    """
    fixed = sorted(set(pipeline_options) & {"shuffle", "rank", "world_size", "coords"})
    if fixed:
        raise TypeError(
            f"fit_statistics sets {fixed} itself: it reads the whole split, in sample order, on "
            "whichever rank calls it (rank=0, world_size=1, shuffle=False, coords=()). Leave "
            "them out; under DDP fit once (on rank 0), save, and load the file on every rank"
        )
    check_instance("manifest", manifest, SplitManifest, "a SplitManifest (split_by_chunk)")
    zstore = as_store(store.store if isinstance(store, Collection) else store)
    if not isinstance(views, Mapping):
        names = [views] if isinstance(views, str) else list(views)
        views = open_geometries(zstore, names)
    # a stack's members as they are: its forcings are computed, never normalised
    given = {label: v for label, v in views.items() if not isinstance(v, Forcings)}
    wrong = {label: type(v).__name__ for label, v in given.items()
             if not isinstance(v, ArrayGeometry)}  # fmt: skip
    if wrong:
        raise TypeError(
            f"fit_statistics takes views (ArrayGeometry) or array names, got {wrong}: give "
            "{label: open_geometries(store)[name]}, or a list of names"
        )
    refuse_complex(given, "fit_statistics")
    plain = {label: unmoved(v) for label, v in given.items() if isinstance(v, ArrayGeometry)}
    pool = _check_pool(pool, plain)
    pooled = {label: tuple(i for i, d in enumerate(channel_dims(v)) if d in pool)
              for label, v in plain.items()}  # fmt: skip
    sampled = {label: v for label, v in plain.items() if not v.static}
    shapes = {label: channel_lengths(v) for label, v in sampled.items()}  # (once, not per batch)
    static = {label: v for label, v in plain.items() if v.static}
    moments = {label: _Moments() for label in plain}
    diffs = {label: _Moments() for label, v in sampled.items() if v.product is None}
    last: dict[str, tuple[int, np.ndarray, int]] = {}
    statics: dict[str, np.ndarray] = {}  # the static views' data
    anchors: dict[str, Any] = {}  # (a stride, missing steps: none for every sample)
    if sampled and not manifest.chunks(split):
        held = {name: len(manifest.chunks(name)) for name in manifest.splits}
        raise ValueError(
            f"split {split!r} of the manifest holds no sample (chunks per split: {held}): "
            f"statistics of {sorted(sampled)} would be NaN, and would standardise every value "
            "to NaN. Fit them on a split that holds samples (split='train'), or draw the "
            "manifest with a share for this one"
        )
    if sampled:
        pipe = insitu_pipeline(
            zstore,
            manifest,
            sampled,
            split=split,
            batch_size=batch_size,
            shuffle=False,
            rank=0,
            world_size=1,
            coords=(),
            fetch=_one_pass(pipeline_options),
            **pipeline_options,
        )
        plan = pipe.stages.plan
        apart = _one_step(plan, zstore, {v.path: v for v in sampled.values()})
        separate = isinstance(store, Collection) and not store.continuous  # own indices each
        config = plan.config()  # the samples fitted, beyond the split's chunks
        anchors = {k: config[k] for k in ("stride", "missing_steps") if k in config}
        anchors["anchors"] = anchors_hash(plan.manifest, plan.views, plan.plan_config)
        try:
            if static:  # through the pass's cache, as a pipeline reads its static labels
                chunks = pipe.stages.pool
                statics = read_static(zstore, static, retry_policy(zstore).timeout_s,
                                      cache=chunks.cache, stats=chunks.stats)  # fmt: skip
            for batch in pipe:
                for label in sampled:
                    _accumulate(batch, label, shapes[label], pooled[label], moments[label],
                                diffs.get(label), last, apart, separate)  # fmt: skip
        finally:
            pipe.close()
    if static and not sampled:  # (no pass: read from the store; see the docstring)
        statics = read_static(zstore, static, retry_policy(zstore).timeout_s)
    if static:
        for label, data in statics.items():
            channels = channel_lengths(static[label])
            moments[label].add(as_channels(data[None], channels, pooled[label]))
    fields: dict[str, dict[str, np.ndarray]] = {name: {} for name in FIELDS}
    for label, view in plain.items():
        channels = channel_lengths(view, pool)
        r = moments[label].result(channels)
        fields["mean"][label], fields["std"][label] = r["mean"], r["std"]
        fields["min"][label], fields["max"][label] = r["min"], r["max"]
        fields["count"][label], fields["nan_count"][label] = r["count"], r["nan"]
        d = diffs[label].result(channels)["std"] if label in diffs else np.full(channels, np.nan)
        fields["diff_std"][label] = d  # NaN: static, or on product sample axes
    dataset = {
        "store": describe_store(zstore),
        "split": split,
        "manifest": manifest.fingerprint(),
        "chunks": [int(c) for c in manifest.chunks(split)],
        "samples": manifest.samples_fingerprint(split),
        "views": {label: view_record(v) for label, v in plain.items()},
        **anchors,
    }
    # ({} for none: a per-channel fit's ``dataset`` refuses pooled statistics at a load)
    dataset["pool"] = {label: [d for d in pool if d in channel_dims(plain[label])]
                       for label, at in pooled.items() if at}  # fmt: skip
    return Statistics(**fields, dataset=dataset, paths={k: v.path for k, v in plain.items()})


def _check_pool(pool: str | Sequence[str], views: Mapping[str, ArrayGeometry]) -> tuple[str, ...]:
    """``pool`` as a tuple of dimension names, each a channel dimension of some view of
    ``views`` (``ValueError`` otherwise, naming each view's channel dimensions)."""
    names = (pool,) if isinstance(pool, str) else tuple(pool)
    if not all(isinstance(d, str) for d in names):
        raise TypeError(f"pool takes dimension names, got {pool!r}")
    dims = {label: channel_dims(v) for label, v in views.items()}
    unknown = [d for d in names if not any(d in ds for ds in dims.values())]
    if unknown:
        raise ValueError(
            f"pool={unknown} names no channel dimension of the views: their channel dimensions "
            f"are {dims} (a sample or grid dimension is reduced already): pool over one of those"
        )
    return names


def _one_pass(options: dict[str, Any]) -> FetchOptions:
    """The fetch options of a fit (taking ``fetch=`` or its keywords out of ``options``): no
    epoch report, and rows decoded straight into the batch (``direct=True``, unless given):
    nothing is kept for a next epoch, so the pool holds only the working set and reuses its
    memory, where the automatic budget would keep a small split whole, in fresh memory."""
    fetch = options.pop("fetch", None)
    if fetch is None:
        names = {f.name for f in dataclasses.fields(FetchOptions)} - {"direct", "trace"}
        fetch = FetchOptions(**{k: options.pop(k) for k in names if k in options})
    elif not isinstance(fetch, FetchOptions):
        raise TypeError(f"fetch must be a FetchOptions or None, got {fetch!r}")
    direct = True if fetch.direct is None else fetch.direct
    return fetch.replace(report=False, trace=False, direct=direct)


def _accumulate(
    batch: Batch,
    label: str,
    channels: tuple[int, ...],
    pooled: tuple[int, ...],
    moments: _Moments,
    diffs: _Moments | None,
    last: dict[str, tuple[int, np.ndarray, int]],
    apart: Any,
    separate: bool,
) -> None:
    x = batch.arrays[label]
    idx = np.asarray(batch.sample_indices[label])
    rows = as_channels(x, channels, pooled)
    if diffs is None:  # product sample axes: no one step (module docstring)
        moments.add(rows)
        return
    # one-step differences between consecutive anchors one step apart (``apart``), across the
    # batch edge too: the edge's formed by the moments, the batch's own taken in the pass
    # over its values (``_Moments.add_steps``; module docstring)
    # a collection's members count their samples apart: a step never joins two (``separate``)
    own = np.asarray(batch.members[label]) if separate else np.zeros(len(idx), np.int64)
    prev = last.get(label)
    if prev and len(idx) and prev[2] == own[0] and apart(np.array(prev[:1]), idx[:1])[0]:
        diffs.add_difference(rows[:1], as_channels(prev[1][None], channels, pooled))
    step = apart(idx[:-1], idx[1:]) & (own[1:] == own[:-1])
    moments.add_steps(rows, diffs, np.flatnonzero(step))
    if len(idx):
        last[label] = (int(idx[-1]), np.array(x[-1]), int(own[-1]))


def _one_step(plan: Any, zstore: Any, geoms: Mapping[str, ArrayGeometry]) -> Any:
    """``apart(a, b)``: whether anchors ``b`` are one step (``k`` samples, or a time stride's
    time) after anchors ``a``, elementwise; where the anchor array has times (read by the plan,
    else here, once, along the fitted views' sample axis, ``geoms``; a collection's only by the
    plan), ``b`` is ``k`` data steps on in time (and after ``a``; not always ``k`` samples on:
    a later copy of a time the plan dropped lies between): samples either side of a missing
    date are two steps apart, not one."""
    stride = plan.plan_config.stride
    steps = plan.manifest.steps
    if isinstance(stride, np.timedelta64):
        if steps is None or steps.ticks is None:  # (the builder reads them for a time stride)
            raise ValueError("a time stride needs the samples' times")
        ticks, span = steps.ticks, int(stride / steps.unit)
        return lambda a, b: ticks[b] - ticks[a] == span
    k = int(stride)
    ticks, runs = (None, None) if steps is None else (steps.ticks, steps.runs)
    if ticks is None and plan.manifest.members is None:
        ticks = _sample_ticks(zstore, plan.manifest, geoms)
    data_step = None if ticks is None else SampleSteps(len(ticks), ticks=ticks, runs=runs).data_step
    if ticks is None or data_step is None:  # no times (or fewer than two): samples apart
        return lambda a, b: b - a == k
    timed, span = ticks, k * data_step

    def apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ta, tb = timed[a], timed[b]
        known = (ta != MISSING_OFFSET) & (tb != MISSING_OFFSET)
        elapsed = np.where(known, tb, 0) - np.where(known, ta, 0)
        return (b > a) & known & (elapsed == span)  # (a dropped copy of a time between)

    return apart


def _sample_ticks(
    zstore: Any, manifest: SplitManifest, geoms: Mapping[str, ArrayGeometry]
) -> np.ndarray | None:
    """The anchor array's times as whole seconds, or as calendar months (years) where they
    step by months (years) of several lengths, negated where they run backwards (newest
    first: a step back in time is one step; ``forward_ticks``; ``None`` without a time
    coordinate).
    Times that cannot be decoded (an unknown calendar) or compared in whole seconds (float32
    times) give ``None`` with a ``UserWarning``: the differences then pair samples, as a
    pipeline without time checks reads them."""
    try:
        coord = anchor_time_coordinate(zstore, manifest, geoms, None, needed=False)
        if coord is None:
            return None
        seconds = whole_seconds(
            coord,
            f"{manifest.array!r}'s time coordinate",
            "fit_statistics' one-step differences (diff_std, samples one data step apart)",
        )
        again = repeated_times(coord, seconds)  # (counted as often as a pipeline reads them)
        if again is not None:
            warnings.warn(f"fit_statistics: {again}", UserWarning, stacklevel=4)
        return forward_ticks(coord, seconds)  # monthly dates: a month apart is one step
    except ValueError as exc:
        warnings.warn(
            f"fit_statistics: diff_std pairs consecutive samples whatever their times, which "
            f"cannot be read here ({exc}); a gap in the times is not seen",
            UserWarning,
            stacklevel=4,
        )
        return None
