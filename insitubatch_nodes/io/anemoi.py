"""anemoi-datasets' converted layout: what its names mean where the arrays do not say it.

``anemoi-datasets create`` writes one array ``data (time, variable, ensemble, cell)`` (its
dimension names in ``_ARRAY_DIMENSIONS``), and beside it no coordinate array named like a
dimension: the names of ``variable`` are the root group's attribute ``variables`` (``["10u",
"2t", "t_850", ...]``), the times are the array ``dates (time)`` (``datetime64[s]``), the
points' places ``latitudes (cell)`` and ``longitudes (cell)`` (a grid of points:
:mod:`~insitubatch_nodes.io.points`). Three rules read them as a store of one array per variable
would be read:

* :func:`variable_names`: ``sel(variable=["2t", "t_850"])`` looks the names up in the group's
  ``variables`` (so a stack's channels are named ``data@2t``, not by index);
* :data:`DATES`: where no array is named like the sample dimension, the array ``dates`` along
  it is its time coordinate (a time stride, windows in time deltas, ``missing=`` dates, the
  carried times, under the key ``"dates"``);
* :func:`recorded_missing`: the dates the group's ``missing_dates`` attribute lists (slots of
  ``data`` that hold no data: anemoi raises ``MissingDateError`` reading one) are missing
  dates, as if given in ``missing=`` (:func:`~insitubatch_nodes.anchor_steps.anchor_steps`):
  those of every sampled array's group (a sample is missing where any array read at it lacks
  it: stores joined by ``Collection.join``), each member's own, of a collection's independent
  members and of stores joined along one timeline (``concat``) alike (a date one member lacks
  is not missing from another: a store whose copy of a time ``overlap=`` skips keeps its own
  list to itself).
  They are looked for only in the groups of the sampled arrays in anemoi's layout, whose
  dimensions name ``variable`` (metadata read already: another store is not read for them),
  and each group's attributes are read once a build (one document a group, concurrently,
  whatever the views and members). The ``frequency`` attribute is not read: the ``dates``
  are the times.

Nothing else of the layout is special: its ``ensemble`` axis comes after ``variable``, and a
stack's ``ensemble="ensemble"`` takes it there (rows ``([T,] E, C, cell)``:
:mod:`~insitubatch_nodes.stack_ensemble`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.members import MemberMap
from insitubatch_nodes.io.objects import read_documents
from insitubatch_nodes.io.routing import RoutingStore

__all__ = ["DATES", "VARIABLE", "Recorded", "recorded_missing", "variable_names"]

#: the dimension whose names anemoi keeps in the group's ``variables`` attribute
VARIABLE = "variable"

#: anemoi's name for the time coordinate of the sample dimension (``dates (time)``)
DATES = "dates"

#: what :func:`recorded_missing` found: the dates missing along a single array's sample axis,
#: and each collection member's own (``{member index: dates}``)
Recorded = tuple[list[np.datetime64], dict[int, list[np.datetime64]]]


def variable_names(store: Any, geom: Any, dim: str) -> np.ndarray | None:
    """The names of dimension ``dim`` (``"variable"`` only) of the array ``geom`` (an
    :class:`~insitubatch_nodes.io.geometry.ArrayGeometry`) of ``store``: the ``variables``
    attribute of its group or the nearest parent that has one, a list of as many distinct
    strings as the dimension's length. ``None`` for another dimension, or where no group holds
    such a list (a group that cannot be read counts as none)."""
    dims = tuple(geom.dims or ())
    if dim != VARIABLE or dim not in dims:
        return None
    length = int(geom.shape[dims.index(dim)])
    [names] = group_attribute(store, [(str(geom.path), int(geom.zarr_format))], "variables")
    if (
        isinstance(names, list)
        and len(names) == length
        and all(isinstance(n, str) for n in names)
        and len(set(names)) == length
    ):
        out = np.asarray(names)
        out.setflags(write=False)  # (kept by the geometries' reader, and shared)
        return out
    return None


def recorded_missing(
    store: Any, members: MemberMap | None, geoms: Iterable[ArrayGeometry]
) -> Recorded:
    """The dates anemoi-datasets lists as missing for the samples a build reads, as
    ``datetime64[s]``: the ``missing_dates`` attribute (ISO 8601 strings) of the group of each
    array of ``geoms`` (the sampled arrays of ``store``) in anemoi's layout (its dimensions
    name :data:`VARIABLE`), or of its nearest parent that has one. A sample is missing where
    any array read at it lacks it. Of arrays of one store, every array's (the first item); of a
    collection (``members``: the anchor array's member map), each member's own (the second,
    ``{member index: dates}``): its stores' of every variable (stores joined by
    ``Collection.join``), whether the members are independent or stores joined along one
    timeline (``concat``: a store lists its own dates, which another store's samples at the
    same time, where ``overlap=`` keeps that store's, do not lack). ``([], {})`` where no array
    is in anemoi's layout (nothing is read) and on product sample axes. Each group's attribute
    document is read once, all of them concurrently; a list that is not of dates is a
    ``ValueError`` naming the attribute."""
    anemoi = [g for g in geoms if VARIABLE in (g.dims or ()) and g.product is None]
    if not anemoi or (members is not None and members.product):
        return [], {}
    if members is None:
        arrays = {g.path: int(g.zarr_format) for g in anemoi if g.members is None}
        found = group_attribute(store, list(arrays.items()), "missing_dates")
        every = [d for p, got in zip(arrays, found, strict=True) for d in _dates(repr(p), got)]
        return list(dict.fromkeys(every)), {}
    maps = [(g.members, int(g.zarr_format)) for g in anemoi if g.members is not None]
    pairs = [(m, mm, (mm.paths[m], fmt)) for mm, fmt in maps for m in range(len(mm))]
    found = group_attribute(store, [p for *_, p in pairs], "missing_dates")
    own: dict[int, list[np.datetime64]] = {}
    for (m, mm, _), got in zip(pairs, found, strict=True):
        where = f"the array of member {mm.names[m]!r} ({mm.collection})"
        own.setdefault(m, []).extend(_dates(where, got))
    return [], {m: list(dict.fromkeys(d)) for m, d in own.items() if d}


def _dates(where: str, dates: Any) -> list[np.datetime64]:
    """The ``missing_dates`` listed for the array ``where`` names, as ``datetime64[s]``."""
    if not dates:
        return []
    try:
        return [np.datetime64(str(d), "s") for d in dates]
    except (TypeError, ValueError):
        raise ValueError(
            f"the group of {where} lists missing_dates {list(dates)[:3]}..., which are not "
            "ISO 8601 dates: fix the attribute (anemoi writes '2020-01-02T00:00:00'), or "
            "delete it and give the missing dates in missing="
        ) from None


def group_attribute(store: Any, arrays: Sequence[tuple[str, int]], name: str) -> list[Any]:
    """Attribute ``name`` of the group holding each array of ``arrays`` (``(path, zarr
    format)`` pairs of ``store``) or of its nearest parent that has it (``None`` where none
    has; a group that cannot be read counts as none). Each group's attribute document
    (``.zattrs``; v3: ``zarr.json``) is read once, all concurrently: one GET a group, not a
    group opened (four GETs) per level and per array. The root of a
    :class:`~insitubatch_nodes.io.routing.RoutingStore` is no group (each routed store's root
    is). Where the document of an array's own group cannot be read (an error other than its
    absence), the attribute is taken as absent with a ``UserWarning`` naming the key."""
    store = _zarr_compat.opened(store)
    routed = isinstance(store, RoutingStore)
    chains = []
    for path, fmt in arrays:
        parts = path.strip("/").split("/")[:-1]
        levels = range(len(parts), 0 if routed else -1, -1)
        chains.append([("/".join(parts[:i]), int(fmt)) for i in levels])
    groups = list(dict.fromkeys(g for chain in chains for g in chain))
    docs = [(g, ".zattrs" if fmt == 2 else "zarr.json") for g, fmt in groups]
    keys = [f"{g}/{doc}" if g else doc for g, doc in docs]
    texts, failed = _documents(store, keys)
    attrs = {g: _attributes(t, g[1]) for g, t in zip(groups, texts, strict=True)}
    own = {chain[0] for chain in chains if chain}  # (a parent may lack the document)
    unread = [(k, failed[k]) for g, k in zip(groups, keys, strict=True) if k in failed and g in own]
    if unread:
        key, exc = unread[0]
        warnings.warn(
            f"the attributes of the group holding an array ({key!r}) cannot be read "
            f"({type(exc).__name__}: {exc}): its {name!r} attribute is taken as absent (anemoi's "
            "missing_dates: samples at those dates are read; variables: names cannot be looked "
            "up). Grant read access to that document (or repair it), or give the missing dates "
            "in missing=",
            UserWarning,
            stacklevel=3,
        )
    return [next((attrs[g][name] for g in chain if name in attrs[g]), None) for chain in chains]


def _documents(store: Any, keys: list[str]) -> tuple[list[Any], dict[str, BaseException]]:
    """:func:`~insitubatch_nodes.io.objects.read_documents` of ``keys``, and the error of each
    key that could not be read (where a read fails: each key alone, a failed one none; a store
    may answer a missing key with an error, e.g. S3's 403 without the right to list)."""
    try:
        return read_documents(store, keys), {}
    except (OSError, KeyError):
        out: list[Any] = []
        failed: dict[str, BaseException] = {}
        for key in keys:
            try:
                out += read_documents(store, [key])
            except (OSError, KeyError) as exc:
                out.append(None)
                failed[key] = exc
        return out, failed


def _attributes(text: Any, zarr_format: int) -> dict[str, Any]:
    """The attributes in a group's document (``{}`` where it is absent or not a group's)."""
    if text is None:
        return {}
    try:
        doc = json.loads(bytes(text))
    except (TypeError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    if zarr_format == 2:
        return doc
    attrs = doc.get("attributes") if doc.get("node_type") == "group" else None
    return attrs if isinstance(attrs, dict) else {}
