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
constant channel, missing points or not, has a ``std`` of exactly 0). One-step
differences are formed a block at a time (a batch-sized array only in a batch with NaNs): in
float32 for float32 data (each within half an ulp of the exact difference), in float64 for
other dtypes; and summed in float64. NaNs are skipped and counted
(``nan_count``); a channel with no finite value has NaN statistics.

:meth:`Statistics.save` and :meth:`Statistics.load` keep them as JSON together with what they
were fitted on (``dataset``: the store, the split, its sample range, the views, and a
``stride`` or missing steps that picked the samples, as a pipeline's config names them), which
:meth:`Statistics.load` can check. :meth:`Statistics.normalizer` is a batch transform that
standardises each label in place; :meth:`Statistics.scaler` the chunk transform
:class:`~insitubatch_nodes.transforms.StandardScaler` for labels that read whole arrays. Both,
and a stack's ``normalize=``, take a constant channel's ``std`` of 0 as 1 (``x - mean``), and
refuse statistics fitted on another array, other channels or otherwise decoded values than the
view given under their label.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from insitubatch_nodes._atomic import atomic_write
from insitubatch_nodes._checks import check_instance, check_number
from insitubatch_nodes._fitted_on import (
    channel_keys,
    check_fitted_on,
    check_scaled_channels,
    label_pairs,
    unmoved,
    view_record,
)
from insitubatch_nodes._moments import _Moments, as_channels
from insitubatch_nodes.anchor_steps import anchor_time_coordinate, forward_ticks, repeated_times
from insitubatch_nodes.batch import Batch
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.collection_paths import same_variable
from insitubatch_nodes.io.coords import MISSING_OFFSET
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.points import grid_ndim
from insitubatch_nodes.io.selection import kept_axes, view_keys
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store, retry_policy
from insitubatch_nodes.io.timeline import whole_seconds
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.pipeline import insitu_pipeline
from insitubatch_nodes.plan.anchors import SampleSteps
from insitubatch_nodes.plan.fingerprint import anchors_hash
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.static import broadcast_rows, read_static
from insitubatch_nodes.transforms import StandardScaler
from insitubatch_nodes.work_dtypes import standardise_in_place, work_dtype

__all__ = ["Statistics", "fit_statistics"]

FORMAT = 1
FIELDS = ("mean", "std", "min", "max", "diff_std", "count", "nan_count")


@dataclass(repr=False)
class Statistics:
    """Fitted statistics, ``{label: array}`` each, one value per channel (see the module
    docstring). ``count`` is the finite values per channel, ``nan_count`` the NaNs skipped;
    ``diff_std`` is NaN for a static label or where no two consecutive samples are in the split.
    ``dataset`` says what they were fitted on; ``paths`` maps each label to its array."""

    mean: dict[str, np.ndarray]
    std: dict[str, np.ndarray]
    min: dict[str, np.ndarray]
    max: dict[str, np.ndarray]
    diff_std: dict[str, np.ndarray]
    count: dict[str, np.ndarray]
    nan_count: dict[str, np.ndarray]
    dataset: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        """One line, no values: each label's channel shape, and the store and split fitted on."""
        shapes = {label: np.shape(v) for label, v in self.mean.items()}
        where = {k: self.dataset[k] for k in ("store", "split") if k in self.dataset}
        return f"Statistics({shapes}, fitted on {where or 'unknown data'})"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write these statistics as JSON (values as nested lists, NaN as ``null``). The file
        appears whole or not at all: an interrupted write leaves an earlier file at ``path``
        as it was (written beside it under a temporary name, then renamed over it)."""
        doc: dict[str, Any] = {"format": FORMAT, "dataset": self.dataset, "paths": self.paths}
        for name in FIELDS:
            doc[name] = {label: _to_json(np.asarray(v)) for label, v in getattr(self, name).items()}
        with atomic_write(path) as f:
            json.dump(doc, f, indent=1, sort_keys=True)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, dataset: Mapping[str, Any] | None = None
    ) -> Statistics:
        """Read statistics :meth:`save` wrote. With ``dataset`` (another fit's ``dataset``, or
        the part of it to check), raise ``ValueError`` when they were fitted on another. Its
        entries may be given as the fit took them: ``"store"`` anything
        :func:`fit_statistics` takes (a path, URL, opened store or collection: compared by
        the store it names), ``"manifest"`` a :class:`SplitManifest` (by its fingerprint),
        ``"views"`` ``{label: view}`` (each label given against the file's record of it; a
        :class:`~insitubatch_nodes.stack.Stack`, a pipeline's label, by its members' names)."""
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path}: not a statistics file of format {FORMAT}")
        stats = cls(
            **{name: {label: _from_json(v) for label, v in doc[name].items()} for name in FIELDS},
            dataset=doc["dataset"],
            paths=doc["paths"],
        )
        if dataset is not None:
            check_fitted_on(path, stats.dataset, dataset)
        return stats

    def shaped(self, label: str, name: str, view: ArrayGeometry) -> np.ndarray:
        """Statistic ``name`` of ``label`` shaped to broadcast against one sample of ``view``
        (``(n_level, 1, 1)`` for a ``(level, lat, lon)`` view). ``ValueError`` when ``view``
        has other channels than the view ``label`` was fitted on: another number, or other
        indices of an axis that is not the grid (levels in another order, another dropped
        level; told by their coordinate values where both the fit and ``view`` read them: level
        850 of another store is index 0 there) or another array than ``paths[label]`` (set it to
        take statistics over to the same quantity under another name); its shift, window,
        patches and box on the grid may differ. ``ValueError`` too when ``view`` decodes its
        values otherwise than the fitted view did (``mask_and_scale``: stored integers against
        unpacked values)."""
        values = np.asarray(getattr(self, name)[label], dtype=np.float64)
        pool = self.pooled(label)
        self._check_array(label, view)
        self._check_channels(label, view, values.shape, pool)
        self._check_decoding(label, view)
        # statistics pooled over a channel dimension broadcast along it (length 1 there)
        shape = [1 if d in pool else n for n, d in zip(_channels(view), _channel_dims(view),
                                                        strict=True)]  # fmt: skip
        return values.reshape(*shape, *(1,) * grid_ndim(view))

    def pooled(self, label: str) -> tuple[str, ...]:
        """The channel dimensions ``label``'s statistics were pooled over (``fit_statistics(...,
        pool=)``; ``()``: one value per channel)."""
        return tuple(self.dataset.get("pool", {}).get(label, ()))

    def _check_array(self, label: str, view: ArrayGeometry) -> None:
        """``ValueError`` when ``label`` was fitted on another array than ``view`` reads (its
        ``paths`` entry): another quantity's statistics standardise nothing. A collection's
        variable (``"<collection>:<variable>"``) is one quantity over any members: statistics
        fitted on training members' (``subset``) standardise the others' views of it."""
        fitted = self.paths.get(label)
        if fitted is None or fitted == view.path or same_variable(fitted, view.path):
            return
        raise ValueError(
            f"statistics of {label!r} were fitted on array {fitted!r}, but the view given "
            f"under {label!r} reads {view.path!r}: fit them on this view "
            f"(fit_statistics(store, manifest, {{{label!r}: view}})), or, where {view.path!r} "
            f"is {fitted!r} under another name (another store's), say so: "
            f"stats.paths[{label!r}] = {view.path!r}"
        )

    def _check_decoding(self, label: str, view: ArrayGeometry) -> None:
        """``ValueError`` when ``label`` was fitted on values decoded otherwise than ``view``
        delivers them: the stored integers or fill values (``mask_and_scale=False``) against
        unpacked, masked values, or the other way round. (Files from before the statistics
        recorded it are not checked; another ``cf_dtype`` or packing of the same physical
        values is no mismatch.)"""
        fitted = self.dataset.get("views", {}).get(label, {})
        if "cf" not in fitted or (fitted["cf"] is None) == (view.cf is None):
            return
        said = {True: "decoded (unpacked, fill values as NaN)", False: "as stored"}
        raise ValueError(
            f"statistics of {label!r} were fitted on {fitted.get('path')!r} "
            f"{said[fitted['cf'] is not None]}, but {view.path!r} is delivered "
            f"{said[view.cf is not None]}: normalising with them gives wrong values. Fit "
            "them on views opened as these are (open_geometries(..., mask_and_scale=...) "
            "alike), or open these as the fitted ones were"
        )

    def _check_channels(
        self, label: str, view: ArrayGeometry, shape: tuple[int, ...], pool: tuple[str, ...]
    ) -> None:
        field, fitted = view.field_shape, self.dataset.get("views", {}).get(label)
        # a pooled dimension may be selected as the view likes: one value stands for all; an
        # axis with coordinate values is told by them (not by index: another store's levels)
        values = label_pairs(fitted, unmoved(view), pool)
        skip = {i for i in range(len(field)) if view.dims is not None
                and view.dims[view.field_axes[i]] in (*pool, *values)}  # fmt: skip
        mine = channel_keys(field, view_keys(unmoved(view)), grid_ndim(view), skip)
        keys = None if fitted is None else fitted.get("select") or [None] * len(field)
        theirs = None
        if keys is not None and len(keys) == len(field):
            theirs = channel_keys(field, [k if k is None or isinstance(k, int) else tuple(k)
                                           for k in keys], grid_ndim(view), skip)  # fmt: skip
        named = {d: pair for d, pair in values.items() if pair[0] != pair[1]}
        if shape != _channels(view, pool) or (keys is not None and theirs != mine) or named:
            raise ValueError(
                f"statistics of {label!r} were fitted on other channels than {view!r} has "
                f"(shape {shape}, selection {keys}; the view: {_channels(view, pool)}, "
                f"{list(view_keys(view))}"
                + "".join(f"; {d} {a} fitted, {b} in the view" for d, (a, b) in named.items())
                + "): fit them on the view's levels, in its order, under its name"
            )

    def normalizer(
        self,
        views: Mapping[str, ArrayGeometry],
        *,
        same_as: Mapping[str, str] | None = None,
        eps: float = 1e-8,
    ) -> NormalizeBatch:
        """A batch transform: ``(x - mean) / (std + eps)`` per label of ``views``, in place in
        the batch's arrays (a constant channel's ``std`` of 0 taken as 1: ``x - mean``, as a
        stack's ``normalize=`` does, not 1e8 times it; float arrays, float16 computed in float32
        and rounded once, so neither ``x - mean`` nor a tiny ``std`` overflows or underflows
        float16 where the result does not; a static label's broadcast rows get a new array of
        one standardised row, broadcast, in the label's dtype; integer labels become float32).
        ``same_as`` maps labels to the fitted label whose statistics they take (a shifted
        target to its input: ``{"next_t": "t"}``); every other label must have been fitted."""
        bad = (
            [k for k, v in views.items() if not isinstance(v, ArrayGeometry)]
            if isinstance(views, Mapping)
            else ["views"]
        )
        if bad:  # (a stack normalises its members itself: stack(..., normalize=stats))
            raise TypeError(
                f"normalizer takes {{label: ArrayGeometry view}}, as the pipeline's views; {bad} "
                "are not views (a stack: stack(members, normalize=stats) instead)"
            )
        check_number("eps", eps, minimum=0.0)
        _refuse_complex(views, "Statistics.normalizer")
        source = {label: (same_as or {}).get(label, label) for label in views}
        missing = sorted(label for label, fitted in source.items() if fitted not in self.mean)
        if missing:
            raise ValueError(
                f"no statistics for labels {missing}: fit them with fit_statistics, or name the "
                "fitted label they take theirs from with same_as={label: fitted}"
            )
        return NormalizeBatch(
            {
                label: (
                    self.shaped(source[label], "mean", v),
                    _constant_as_unit(self.shaped(source[label], "std", v)) + eps,
                )
                for label, v in views.items()
            }
        )

    def scaler(
        self, labels: Sequence[str] | None = None, *, cache_key: str | None = None
    ) -> StandardScaler:
        """A :class:`~insitubatch_nodes.transforms.StandardScaler` (a chunk transform, keyed by
        array path) from the statistics of ``labels`` (default: all), which must read every
        channel of their arrays (the scaler runs on chunks, before any selection): no level
        selection, at most a box on the grid (a patched view's ``within``). Labels of one array
        share its scaling: ``ValueError`` when their statistics differ (a box and the whole
        field); a shifted label's are its array's and agree. A constant channel's ``std`` of 0
        is given as 1 (``x - mean``, as :meth:`normalizer` makes it). At the build, an array
        whose levels' coordinate values are not the fitted ones, in order, is refused."""
        labels = list(self.mean) if labels is None else list(labels)
        mean, std, channels = {}, {}, {}  # (channels: path -> the fitted levels' values)
        taken: dict[str, str] = {}  # path -> the label whose statistics it takes
        for label in labels:
            path = self.paths[label]
            first = taken.setdefault(path, label)
            if first != label:  # the scaler standardises the array once, for every label
                same = all(
                    np.array_equal(np.asarray(stat[first]), np.asarray(stat[label]))
                    for stat in (self.mean, self.std)
                )
                if not same:
                    raise ValueError(
                        f"labels {first!r} and {label!r} both read array {path!r}, with other "
                        "statistics (fitted on other points); a chunk transform standardises "
                        f"the array once for every label: name one, e.g. scaler([{first!r}]), "
                        "or standardise per label with Statistics.normalizer"
                    )
                continue
            if self.pooled(label):
                raise ValueError(
                    f"statistics of {label!r} are pooled over {list(self.pooled(label))}: a "
                    "chunk scaler takes one value per channel of the array; standardise with "
                    "Statistics.normalizer or stack(..., normalize=stats)"
                )
            m, fitted = np.asarray(self.mean[label]), self.dataset.get("views", {}).get(label, {})
            # the fitted grid's axes: the kept axes but the channels' (two on a lat/lon grid,
            # one on a grid of points; two for files without the shape)
            grid = 2 if "inner_shape" not in fitted else len(fitted["inner_shape"]) - m.ndim
            keys = fitted.get("select") or []
            if any(isinstance(k, int) for k in keys) or any(keys[: len(keys) - grid]):
                raise ValueError(
                    f"label {label!r} reads a selection of {path!r}: a chunk transform sees "
                    "the whole array; use Statistics.normalizer (a batch transform) instead"
                )
            _refuse_empty_channels(label, path, m, np.asarray(self.std[label]))
            # per channel: (n_level,) becomes (n_level, 1, 1) against (level, lat, lon), (n_level,
            # 1) against (level, values); one value is a scalar
            grid = grid if m.ndim else 0
            mean[path] = m.reshape(m.shape + (1,) * grid)
            s = _constant_as_unit(np.asarray(self.std[label]))
            std[path] = s.reshape(s.shape + (1,) * grid)
            channels[path] = fitted.get("labels") or {}
        check = functools.partial(check_scaled_channels, channels)
        return StandardScaler(mean, std, cache_key=cache_key, check=check)


def _refuse_complex(views: Mapping[str, ArrayGeometry], who: str) -> None:
    """``ValueError`` naming the complex views among ``views``: a mean, a standard deviation
    and extrema per channel are of real values (numpy's would cast them, dropping the
    imaginary part)."""
    complex_ = {label: str(v.dtype) for label, v in views.items() if v.dtype.kind == "c"}
    if complex_:
        raise ValueError(
            f"{who} takes real values, and {complex_} are complex: their statistics (and a "
            "standardisation) are of real channels. Turn them into real channels (real and "
            "imaginary parts, amplitude and phase) with a batch transform, and standardise "
            "those in it"
        )


def _constant_as_unit(std: np.ndarray) -> np.ndarray:
    """``std`` with a constant channel's 0 as 1: the channel standardises to ``x - mean`` (0 on
    the fitted values, the difference elsewhere), as a stack's ``normalize=`` does, not to
    ``(x - mean) / eps`` (1e8 times the difference, inf in float16)."""
    return np.where(std == 0, 1.0, std)


def _refuse_empty_channels(label: str, path: str, mean: np.ndarray, std: np.ndarray) -> None:
    """``ValueError`` for statistics a chunk scaler cannot apply: channels of ``label`` with no
    value but NaN in the fitted split (a flagged channel of a spectral cube) have NaN mean and
    std; the message names them and the batch transform that standardises them to NaN."""
    bad = ~(np.isfinite(mean) & np.isfinite(std))
    if not bad.any():
        return
    where = np.argwhere(bad)
    channels = [int(i[0]) if len(i) == 1 else tuple(int(j) for j in i) for i in where]
    shown = f"{channels[:8]}{' ...' if len(channels) > 8 else ''}"
    which = f"channels {shown}" if mean.ndim else "its only channel"
    raise ValueError(
        f"label {label!r} (array {path!r}) has NaN statistics in {which}: no value but NaN "
        "in the fitted split (a flagged channel). A chunk scaler needs finite statistics for "
        "every channel of the array; use Statistics.normalizer (a batch transform), which "
        "leaves those channels NaN, or refit on a split where they hold data"
    )


class NormalizeBatch:
    """The batch transform :meth:`Statistics.normalizer` makes."""

    def __init__(self, stats: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.stats = dict(stats)

    @property
    def normalized_labels(self) -> frozenset[str]:
        """The labels it standardises (what the pipeline checks no chunk transform also does)."""
        return frozenset(self.stats)

    def __call__(self, batch: Batch) -> Batch:
        for label, (mean, std) in self.stats.items():
            arr = batch.arrays[label]
            static = arr.ndim > 0 and arr.strides[0] == 0  # a static field's broadcast rows
            if arr.dtype.kind == "f" and (static or arr.flags.writeable):
                work = work_dtype(arr.dtype)  # float16: in float32, rounded once
                # a static field: one row (a copy) standardised, then broadcast again
                rows = np.array(arr[:1]) if static else arr
                standardise_in_place(rows, mean.astype(work), std.astype(work))
                if static:
                    batch.arrays[label] = broadcast_rows(rows[0], len(arr))
            else:  # integers (or read-only rows): a new float32 array
                batch.arrays[label] = ((arr - mean) / std).astype(np.float32)
        return batch


def _channels(view: ArrayGeometry, pool: Sequence[str] = ()) -> tuple[int, ...]:
    """The view's channel axes' lengths: its kept axes but the grid's (module docstring), less
    those of the dimensions in ``pool``."""
    lengths = view.inner_shape[: len(view.inner_shape) - grid_ndim(view)]
    return tuple(n for n, d in zip(lengths, _channel_dims(view), strict=True) if d not in pool)


def _channel_dims(view: ArrayGeometry) -> list[str | None]:
    """The dimension names of the view's channel axes (``None`` where the array has none)."""
    kept = kept_axes(view_keys(view))
    return [
        None if view.dims is None else view.dims[view.field_axes[i]]
        for i in kept[: len(kept) - grid_ndim(view)]
    ]


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
    _refuse_complex(given, "fit_statistics")
    plain = {label: unmoved(v) for label, v in given.items() if isinstance(v, ArrayGeometry)}
    pool = _check_pool(pool, plain)
    pooled = {label: tuple(i for i, d in enumerate(_channel_dims(v)) if d in pool)
              for label, v in plain.items()}  # fmt: skip
    sampled = {label: v for label, v in plain.items() if not v.static}
    shapes = {label: _channels(v) for label, v in sampled.items()}  # (once, not per batch)
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
            channels = _channels(static[label])
            moments[label].add(as_channels(data[None], channels, pooled[label]))
    fields: dict[str, dict[str, np.ndarray]] = {name: {} for name in FIELDS}
    for label, view in plain.items():
        channels = _channels(view, pool)
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
    dataset["pool"] = {label: [d for d in pool if d in _channel_dims(plain[label])]
                       for label, at in pooled.items() if at}  # fmt: skip
    return Statistics(**fields, dataset=dataset, paths={k: v.path for k, v in plain.items()})


def _check_pool(pool: str | Sequence[str], views: Mapping[str, ArrayGeometry]) -> tuple[str, ...]:
    """``pool`` as a tuple of dimension names, each a channel dimension of some view of
    ``views`` (``ValueError`` otherwise, naming each view's channel dimensions)."""
    names = (pool,) if isinstance(pool, str) else tuple(pool)
    if not all(isinstance(d, str) for d in names):
        raise TypeError(f"pool takes dimension names, got {pool!r}")
    dims = {label: _channel_dims(v) for label, v in views.items()}
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
    moments.add(as_channels(x, channels, pooled))
    if diffs is None:  # product sample axes: no one step (module docstring)
        return
    # one-step differences between consecutive anchors one step apart (``apart``), across the
    # batch edge too, each formed by the moments (module docstring)
    # a collection's members count their samples apart: a step never joins two (``separate``)
    own = np.asarray(batch.members[label]) if separate else np.zeros(len(idx), np.int64)
    prev = last.get(label)
    if prev and len(idx) and prev[2] == own[0] and apart(np.array(prev[:1]), idx[:1])[0]:
        diffs.add_difference(as_channels(x[:1], channels, pooled),
                             as_channels(prev[1][None], channels, pooled))  # fmt: skip
    step = apart(idx[:-1], idx[1:]) & (own[1:] == own[:-1])
    if step.all() and len(idx) > 1:
        diffs.add_difference(as_channels(x[1:], channels, pooled),
                             as_channels(x[:-1], channels, pooled))  # fmt: skip
    elif step.any():
        at = np.flatnonzero(step)
        diffs.add_difference(as_channels(x[at + 1], channels, pooled),
                             as_channels(x[at], channels, pooled))  # fmt: skip
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


def _to_json(values: np.ndarray) -> Any:
    """``values`` as nested lists, NaN as ``None`` (JSON has no NaN)."""
    if values.ndim == 0:
        return None if np.isnan(values) else float(values)
    return [_to_json(v) for v in values]


def _from_json(values: Any) -> np.ndarray:
    return np.array(values, dtype=np.float64)  # None (a NaN saved) reads as NaN
