"""What saved statistics are keyed to (private to :mod:`~insitubatch_nodes.statistics`): the
``dataset`` a fit records of what it read, and the check :meth:`Statistics.load
<insitubatch_nodes.statistics.Statistics.load>` makes of a ``dataset`` given against it.

A fit records the store, the split, the manifest's fingerprint and the split's chunks, the
samples of the split (:meth:`~insitubatch_nodes.plan.splits.SplitManifest.samples_fingerprint`),
each view (:func:`view_record`: its array, selection, shape, decoding and its channels'
coordinate values, by which a level is told in another store too), the channel
dimensions pooled per label (``pool``, ``{}`` for none: a pooled fit and a per-channel one are
other statistics of the same views, each refused for the other), and what picked its
anchors: a stride, the missing steps, and the anchors themselves
(:func:`~insitubatch_nodes.plan.fingerprint.anchors_hash`). An archive appended to since the
fit changes the manifest's fingerprint (the array's length is part of it) and the missing steps'
(the times of every step are), not the samples of a split that ends before the new steps: a
manifest drawn again over the same dates, or another fit's ``dataset`` with the same anchors,
is accepted there. Files saved before the samples and anchors were recorded are checked as
before (their manifest by its fingerprint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.places import normal_store_name
from insitubatch_nodes.io.points import grid_ndim
from insitubatch_nodes.io.selection import Selection, kept_axes, view_keys
from insitubatch_nodes.io.stores import store_name
from insitubatch_nodes.plan.anchors import describe_stride
from insitubatch_nodes.plan.config import check_stride
from insitubatch_nodes.plan.splits import SPLITS, SplitManifest
from insitubatch_nodes.stack import Stack

__all__ = [
    "channel_keys",
    "channel_labels",
    "check_fitted_on",
    "check_scaled_channels",
    "label_pairs",
    "unmoved",
    "view_record",
]


def check_fitted_on(
    path: str | os.PathLike[str], fitted_on: Mapping[str, Any], dataset: Mapping[str, Any]
) -> None:
    """Raise ``ValueError`` naming what differs when statistics fitted on ``fitted_on`` (the
    ``dataset`` of the file at ``path``) were fitted on another dataset than ``dataset`` (what
    :meth:`Statistics.load <insitubatch_nodes.statistics.Statistics.load>` was given)."""
    # (absent: every sample, nothing pooled: files of fits before each was recorded)
    fitted: dict[str, Any] = {"stride": 1, "pool": {}, **fitted_on}
    fitted["store"] = normal_store_name(fitted.get("store"))  # (an endpoint's case and /)
    wrong = {
        k: (fitted.get(k), v)
        for k, v in _recorded(dataset).items()
        if k in fitted or k not in ("samples", "anchors")
    }  # (older files: none)
    if isinstance(dataset.get("views"), Mapping):  # the labels given, only
        views, given = fitted_on.get("views", {}), wrong["views"][1]
        # (records saved before the coordinate values were: compared without them)
        given = {k: {f: x for f, x in v.items() if f != "labels" or f in (views.get(k) or {})}
                 if isinstance(v, dict) else v for k, v in given.items()}  # fmt: skip
        wrong["views"] = ({k: views.get(k) for k in given}, given)
        if "pool" in wrong:  # (their pooling too)
            pooled = fitted["pool"]
            wrong["pool"] = ({k: v for k, v in pooled.items() if k in given}, wrong["pool"][1])
    wrong = {k: pair for k, pair in wrong.items() if _plain(pair[0]) != _plain(pair[1])}
    if "manifest" in wrong and _same_samples(fitted_on, dataset):
        del wrong["manifest"]  # an archive grown since, the fitted samples the same
    if "anchors" in fitted and fitted["anchors"] == dataset.get("anchors"):
        wrong.pop("missing_steps", None)  # (the steps of samples the fit did not read)
    if set(wrong) - {"samples", "anchors"}:  # (hashes of what those say, readably)
        wrong = {k: pair for k, pair in wrong.items() if k not in ("samples", "anchors")}
    if wrong:
        raise ValueError(
            f"{path}: these statistics were fitted on another dataset: "
            + "; ".join(f"{k} {a!r} in the file, {b!r} expected" for k, (a, b) in wrong.items())
            + ". Fit them again with fit_statistics"
        )


def view_record(view: ArrayGeometry) -> dict[str, Any]:
    """What a fit records of a view it fitted (as :func:`unmoved` leaves it): its array,
    selection, shape, decoding and the coordinate values of its channels
    (:func:`channel_labels`)."""
    select, cf = view.select, view.cf
    return {"path": view.path, "inner_shape": list(view.inner_shape),
            "select": None if select is None else select.describe(),
            "cf": None if cf is None else cf.fingerprint,
            "labels": channel_labels(view)}  # fmt: skip


def channel_labels(view: ArrayGeometry) -> dict[str, list[str]]:
    """The coordinate values (as text) of the entries ``view`` selects along each of its channel
    axes (its kept axes but the grid's), by dimension name: ``{"level": ["850", "500"]}``. An
    axis whose coordinate cannot be read (none, no reader, another length) is left out: it is
    told by its indices. Read once per view where statistics are fitted or applied (the
    coordinate reader keeps what it read), never per batch."""
    if view.dims is None or view.coordinates is None:
        return {}
    keys = view_keys(view)
    kept = kept_axes(keys)
    out: dict[str, list[str]] = {}
    for i in kept[: len(kept) - grid_ndim(view)]:
        dim = view.dims[view.field_axes[i]]
        try:
            values = np.asarray(view.coordinates(view, dim))
        except (KeyError, ValueError, OSError):  # no such coordinate: told by its indices
            continue
        if values.ndim == 1 and len(values) == view.field_shape[i]:
            taken = values if keys[i] is None else values[list(keys[i])]  # type: ignore[arg-type]
            out[dim] = [_text(v) for v in taken]
    return out


def check_scaled_channels(
    fitted: Mapping[str, Mapping[str, list[str]]], geometries: Mapping[str, ArrayGeometry]
) -> None:
    """``ValueError`` where a chunk scaler (:meth:`Statistics.scaler
    <insitubatch_nodes.statistics.Statistics.scaler>`, which standardises each stored channel
    by its index) runs on an array whose channels' coordinate values are not those its
    statistics were fitted on (``fitted``: path -> :func:`channel_labels` of the fitted view):
    another store's levels in another order. Axes either side does not name are not checked
    (files from before the values were recorded)."""
    for path, geom in geometries.items():
        theirs = fitted.get(path) or {}
        mine = channel_labels(geom) if theirs else {}
        wrong = {d: (theirs[d], mine[d]) for d in theirs if d in mine and theirs[d] != mine[d]}
        if wrong:
            raise ValueError(
                f"the scaler's statistics of {path!r} were fitted on other channels than the "
                "array has ("
                + "; ".join(f"{d} {a} fitted, {b} in the array" for d, (a, b) in wrong.items())
                + "): a chunk scaler standardises the stored channels by index. Fit them on "
                "this store, or standardise per label with Statistics.normalizer (it takes "
                "the fitted levels by value)"
            )


def _text(value: Any) -> str:
    """A coordinate value as text, alike in any dtype: ``850`` of int32, float32 or float64
    levels; a float as its shortest decimal, a float64 that a float32 holds exactly as the
    float32's (float32 0.1 and the float64 it widens to, 0.10000000149011612, are both
    ``0.1``: a store's float32 levels written again as float64 are the same levels; before
    2026-12-07 they were refused as other channels); dates and durations in the coarsest
    unit that holds them (``2000-01-01T06`` of ``datetime64[s]`` and ``[ns]`` alike)."""
    if isinstance(value, np.floating):
        number = float(value)
        if math.isfinite(number) and float(np.float32(number)) == number:
            number = float(str(np.float32(number)))  # (its shortest float32 decimal)
        return str(int(number)) if number.is_integer() else str(number)
    if isinstance(value, np.datetime64 | np.timedelta64):  # (a timedelta64 is an np.integer)
        for unit in ("D", "h", "m", "s", "ms", "us", "ns"):
            coarse = value.astype(f"{value.dtype.kind}8[{unit}]")
            if not np.isnat(value) and coarse == value:
                return str(coarse)
        return str(value)
    return str(int(value)) if isinstance(value, np.integer) else str(value)


def _same_text(text: str) -> str:
    """A recorded coordinate value's text as :func:`_text` gives it now (files saved on
    2026-12-07 hold a float64's own shortest decimal): numbers again through :func:`_text`,
    any other text as it is."""
    try:
        number = float(text)
    except ValueError:
        return text
    return _text(np.float64(number))


def label_pairs(
    fitted: Mapping[str, Any] | None, view: ArrayGeometry, pool: tuple[str, ...]
) -> dict[str, tuple[list[str], list[str]]]:
    """``{dim: (fitted, view's)}`` coordinate values of each channel axis the fitted view's record
    (``fitted``) and ``view`` both name them along (not those pooled): such an axis is told by
    its values, not its indices, so a level is the same level in another store whose levels lie
    otherwise (records saved before the values were: none)."""
    theirs = (fitted or {}).get("labels") or {}
    mine = channel_labels(view) if theirs else {}
    return {
        d: (list(map(_same_text, theirs[d])), list(map(_same_text, mine[d])))
        for d in theirs
        if d in mine and d not in pool
    }


def _recorded(dataset: Mapping[str, Any]) -> dict[str, Any]:
    """``dataset`` (what :meth:`Statistics.load` checks) with a store, a manifest and views
    given as the fit took them turned into what it recorded of them; a store that cannot be
    opened (a name the file holds, such as ``"s3://b/x (endpoint ...)"``) is compared as it is."""
    out = dict(dataset)
    if "store" in out:
        out["store"] = store_name(out["store"])
    with contextlib.suppress(KeyError, TypeError, ValueError):  # else compared as given
        out["stride"] = describe_stride(check_stride(out["stride"]))  # "12h" is "720m"
    if isinstance(out.get("manifest"), SplitManifest):
        out["manifest"] = out["manifest"].fingerprint()
    if isinstance(out.get("views"), Mapping):  # a stack's members too: forcings are not fitted
        views: dict[str, Any] = {}
        given: dict[str, str] = {}  # name -> where it was given (a label, a stack's member)
        for label, v in out["views"].items():
            if isinstance(v, Stack):  # (a pipeline's label: its members, as they are fitted)
                named = [(m.name, m.view, f"member {m.name!r} of stack {label!r}")
                         for m in v.members if m.view is not None]  # fmt: skip
            elif not isinstance(v, Forcings):
                named = [(label, v, f"label {label!r}")]
            else:
                named = []
            for name, view, where in named:
                record = view_record(unmoved(view)) if isinstance(view, ArrayGeometry) else view
                if name in views and _plain(views[name]) != _plain(record):
                    raise ValueError(
                        f"views: {given[name]} and {where} are other views under one name, "
                        "whose statistics would be the file's one entry for it: "
                        f"{views[name]} and {record}. Give each its own name (fit both)"
                    )
                views[name], given[name] = record, where
        out["views"] = views
    return out


def _same_samples(fitted: Mapping[str, Any], given: Mapping[str, Any]) -> bool:
    """Whether a fit (its ``dataset``, ``fitted``) read the samples of the split a ``dataset``
    given to :meth:`Statistics.load` names: its manifest's (a ``SplitManifest``, or another
    fit's ``"samples"``), in the fitted split. Files saved before fits recorded them: never."""
    split, manifest = given.get("split", fitted.get("split")), given.get("manifest")
    if isinstance(manifest, SplitManifest) and split in SPLITS:
        return fitted.get("samples") == manifest.samples_fingerprint(split)
    return "samples" in fitted and fitted["samples"] == given.get("samples")


def unmoved(view: ArrayGeometry) -> ArrayGeometry:
    """``view`` without its shift, window or patches: the array as it selects it. A patched
    view is its field within the box its windows lie in (``within``; the whole field without
    it): overlapping or random windows would count points twice or not at all, and
    consecutive rows are other windows, not the same points one step later."""
    if view.window_offsets is not None:
        view = dataclasses.replace(view, window_offsets=None)
    if view.patch is not None:
        spec = view.patch
        view = dataclasses.replace(view, patch=None)
        kept = [view.field_axes[i] for i in kept_axes(view_keys(view))]
        channel_axes = [a for a in spec.axes if a in kept[: len(kept) - grid_ndim(view)]]
        if channel_axes:
            raise ValueError(
                f"{view.path}: the view is patched along a channel axis ({channel_axes}; "
                "statistics are per entry of every field axis but the grid's): fit the "
                "unpatched view, or patch the grid's field axes only"
            )
        boxed = {
            view.field_axes.index(axis): (lo, hi)
            for axis, (lo, hi), n in zip(spec.axes, spec.bounds, spec.field, strict=True)
            if (lo, hi) != (0, n)
        }
        if boxed:
            keys = tuple(
                tuple(range(*boxed[i])) if i in boxed else key
                for i, key in enumerate(view_keys(view))
            )
            view = dataclasses.replace(view, select=Selection(keys))
    return view.shift(-view.offset) if view.offset else view


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists; numpy scalars and arrays as numbers
    and lists), so a ``dataset`` to check compares equal however it was built."""
    return json.loads(json.dumps(value, default=_numpy_json))


def _numpy_json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {value!r} cannot be compared with a saved dataset")


def channel_keys(
    field_shape: Sequence[int], keys: Sequence[Any], n_grid: int, skip: set[int]
) -> list[Any]:
    """``keys`` (a selection key per field axis) without the grid's (the last ``n_grid`` kept
    axes) and those of the field axes in ``skip`` (pooled, or told by their coordinate values),
    a key taking a whole axis in order as ``None``: what says which channel is which."""
    kept = kept_axes(keys)
    grid = set(kept[len(kept) - n_grid :]) | skip
    return [
        None if k == tuple(range(n)) else k
        for i, (k, n) in enumerate(zip(keys, field_shape, strict=True))
        if i not in grid
    ]
