"""The statistics a fit gives, kept and applied: :class:`Statistics` (saved and loaded as JSON,
checked against what they were fitted on) and the transforms that standardise with them
(:meth:`Statistics.normalizer`, :meth:`Statistics.scaler`).

:func:`~insitubatch_nodes.statistics.fit_statistics` makes them (its module says what each
value is, per channel, and how it is accumulated); this module holds what every later use of
them needs: their file format, the checks that statistics fitted on one view fit the view
they are applied to (the same array, channels and decoding), and the channel layout of a view
both modules share (:func:`channel_lengths`, :func:`channel_dims`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from insitubatch_nodes._atomic import atomic_write
from insitubatch_nodes._checks import check_number
from insitubatch_nodes._fitted_on import (
    channel_keys,
    check_fitted_on,
    check_scaled_channels,
    label_pairs,
    unmoved,
)
from insitubatch_nodes.batch import Batch
from insitubatch_nodes.io.collection_paths import same_variable
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.points import grid_ndim
from insitubatch_nodes.io.selection import kept_axes, view_keys
from insitubatch_nodes.static import broadcast_rows
from insitubatch_nodes.transforms import StandardScaler
from insitubatch_nodes.work_dtypes import standardise_in_place, work_dtype

__all__ = [
    "FIELDS",
    "FORMAT",
    "NormalizeBatch",
    "Statistics",
    "channel_dims",
    "channel_lengths",
    "refuse_complex",
]

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
        self._checkchannels(label, view, values.shape, pool)
        self._check_decoding(label, view)
        # statistics pooled over a channel dimension broadcast along it (length 1 there)
        shape = [1 if d in pool else n for n, d in zip(channel_lengths(view), channel_dims(view),
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

    def _checkchannels(
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
        if shape != channel_lengths(view, pool) or (keys is not None and theirs != mine) or named:
            raise ValueError(
                f"statistics of {label!r} were fitted on other channels than {view!r} has "
                f"(shape {shape}, selection {keys}; the view: {channel_lengths(view, pool)}, "
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
        refuse_complex(views, "Statistics.normalizer")
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
            _refuse_emptychannels(label, path, m, np.asarray(self.std[label]))
            # per channel: (n_level,) becomes (n_level, 1, 1) against (level, lat, lon), (n_level,
            # 1) against (level, values); one value is a scalar
            grid = grid if m.ndim else 0
            mean[path] = m.reshape(m.shape + (1,) * grid)
            s = _constant_as_unit(np.asarray(self.std[label]))
            std[path] = s.reshape(s.shape + (1,) * grid)
            channels[path] = fitted.get("labels") or {}
        check = functools.partial(check_scaled_channels, channels)
        return StandardScaler(mean, std, cache_key=cache_key, check=check)


def refuse_complex(views: Mapping[str, ArrayGeometry], who: str) -> None:
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


def _refuse_emptychannels(label: str, path: str, mean: np.ndarray, std: np.ndarray) -> None:
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


def channel_lengths(view: ArrayGeometry, pool: Sequence[str] = ()) -> tuple[int, ...]:
    """The view's channel axes' lengths: its kept axes but the grid's (module docstring), less
    those of the dimensions in ``pool``."""
    lengths = view.inner_shape[: len(view.inner_shape) - grid_ndim(view)]
    return tuple(n for n, d in zip(lengths, channel_dims(view), strict=True) if d not in pool)


def channel_dims(view: ArrayGeometry) -> list[str | None]:
    """The dimension names of the view's channel axes (``None`` where the array has none)."""
    kept = kept_axes(view_keys(view))
    return [
        None if view.dims is None else view.dims[view.field_axes[i]]
        for i in kept[: len(kept) - grid_ndim(view)]
    ]


def _to_json(values: np.ndarray) -> Any:
    """``values`` as nested lists, NaN as ``None`` (JSON has no NaN)."""
    if values.ndim == 0:
        return None if np.isnan(values) else float(values)
    return [_to_json(v) for v in values]


def _from_json(values: Any) -> np.ndarray:
    return np.array(values, dtype=np.float64)  # None (a NaN saved) reads as NaN
