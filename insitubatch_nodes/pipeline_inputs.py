"""What :func:`~insitubatch_nodes.pipeline.insitu_pipeline` is given, resolved and checked
before anything is built: the three settings objects (from the objects given or the loose
keywords, each checked once), the store opened, the views resolved against it (array names
opened, given views checked; one geometry per array), and the coordinates each batch carries.

Each function raises where its argument is wrong (``TypeError``, ``ValueError``, ``KeyError``;
``OSError``/``TimeoutError`` for a coordinate that cannot be read), saying what to pass
instead; the builder then trusts what they return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from zarr.abc.store import Store

from insitubatch_nodes.io.arrays import check_arrays_in_store, open_geometries
from insitubatch_nodes.io.collection_checks import check_collection_in_store
from insitubatch_nodes.io.coords import carried_coordinates
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import RetryPolicy, StoreLike, as_store
from insitubatch_nodes.options import CacheOptions, FetchOptions, resolve_options
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.stack import Stack

# The builder keywords whose settings field is named otherwise (the rest are named alike).
_FIELD_OF = {
    "cache_budget_bytes": "budget_bytes",
    "readonly_cache": "readonly",
    "reset_stale_cache": "reset_stale",
    "verify_cache": "verify",
}


def _options(
    config: PlanConfig | None,
    fetch_options: FetchOptions | None,
    cache_options: CacheOptions | None,
    *,
    plan: Mapping[str, Any],
    fetch: Mapping[str, Any],
    cache: Mapping[str, Any],
) -> tuple[PlanConfig, FetchOptions, CacheOptions]:
    """The three settings objects the pipeline is built from, each checked once: the one
    given, or one made from the loose keywords (``plan``, ``fetch``, ``cache``: keyword ->
    value); an object beside a keyword off its default raises ``TypeError``."""
    return (
        _resolve(config, PlanConfig, plan, "config"),
        _resolve(fetch_options, FetchOptions, fetch, "fetch"),
        _resolve(cache_options, CacheOptions, cache, "cache"),
    )


def _resolve(given: Any, kind: type, keywords: Mapping[str, Any], argument: str) -> Any:
    fields = {_FIELD_OF.get(keyword, keyword): (keyword, v) for keyword, v in keywords.items()}
    return resolve_options(given, kind, fields, where="insitu_pipeline", argument=argument)


def _open_store(store: StoreLike, retry: RetryPolicy | None) -> Store:
    """The store to read: a URL or path opened (with ``retry`` when given), a ``Store`` as is
    (``retry`` then bounds each GET's deadline only)."""
    if retry is None or isinstance(store, Store):
        return as_store(store)
    return as_store(store, retry=retry)


def _resolve_views(
    zstore: Store, variables: Sequence[str] | Mapping[str, ArrayGeometry | Stack], reader: Any
) -> tuple[dict[str, Any], dict[str, ArrayGeometry]]:
    """``(views, geoms)``: label -> view (array names opened from the store; given views
    checked against it), and path -> the array's geometry, one per array read. ``reader``
    (a coordinate reader of ``zstore``) keeps the arrays' metadata read, or gives it."""
    if isinstance(variables, Mapping):  # views may come from elsewhere: check this store
        given = [v for v in _members(variables) if isinstance(v, ArrayGeometry)]
        check_arrays_in_store(zstore, {v.path: v.base for v in given if v.members is None}, reader)
        for v in {v.path: v for v in given if v.members is not None}.values():
            check_collection_in_store(zstore, v, reader)
        views: dict[str, Any] = dict(variables)
    else:
        names = [variables] if isinstance(variables, str) else list(variables)
        views = dict(open_geometries(zstore, names, coords_reader=reader))
        if "" in views:  # a root array: its path is no label
            raise ValueError(
                "the root array of the store (path '') has no name to label it by: pass the "
                "views as a dict, e.g. variables={'x': open_geometries(store)['']}"
            )
    if not views:
        raise ValueError("variables is empty: name at least one array to train on")
    geoms: dict[str, ArrayGeometry] = {}
    for label, given_view in views.items():
        if not isinstance(given_view, ArrayGeometry | Stack):
            raise TypeError(
                f"variables[{label!r}] must be an ArrayGeometry view or a stack(), got "
                f"{given_view!r}"
            )
    for view in _members(views):
        base = geoms.setdefault(view.path, view.base)
        if base != view.base:
            raise ValueError(
                f"two views of {view.path!r} disagree about its geometry "
                f"({_differences(base, view.base)}): take every view of one array from one "
                "open_geometries call (its mask_and_scale and cf_dtype decide the dtype)"
            )
    return views, geoms


def _differences(a: ArrayGeometry, b: ArrayGeometry) -> str:
    """The compared fields in which two geometries of one array differ, with both values."""
    out = []
    for f in fields(ArrayGeometry):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.compare and not f.name.startswith("_") and x != y:
            if f.name == "cf":  # (its dtype is the geometry's)
                x, y = ("as stored" if v is None else "CF-decoded" for v in (x, y))
                out.append(f"values {x} and {y}" if x != y else "another CF rule")
                continue
            out.append(f"{f.name} {x} and {y}")
    return "; ".join(out) or f"fill value {a.fill_value} and {b.fill_value}"


def _members(views: Mapping[str, Any]) -> list[Any]:
    """Every view ``views`` reads: the views, and the members of its stacks."""
    out: list[Any] = []
    for v in views.values():
        if isinstance(v, Stack):
            out.extend(v.views)
        else:
            out.append(v)
    return out


def _carried_coordinates(
    zstore: Store,
    views: Mapping[str, ArrayGeometry],
    coords: Sequence[str] | None,
    reader: Any,
) -> dict[str, Any]:
    """The coordinates each batch carries (see ``coords`` of :func:`insitu_pipeline`), read
    and decoded once, here, by ``reader`` (:func:`coordinate_reader`)."""
    if isinstance(coords, str):
        coords = [coords]
    if coords is not None and not isinstance(coords, Sequence):
        raise TypeError(f"coords must be None or a sequence of coordinate names, got {coords!r}")
    if coords is not None and not len(coords):
        return {}
    return carried_coordinates(
        zstore, views, None if coords is None else list(coords), reader=reader
    )
