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
  whatever the views and members). A group whose attributes cannot be read (a 403, a deadline
  spent after the store's retries) fails the build with an ``OSError`` saying what to do: its
  dates are never taken as none, so that every DDP rank plans the same samples or fails
  (before 2026-12-07, later in the day, it warned and read the samples at them). The
  ``frequency`` attribute is not read: the ``dates`` are the times.

Nothing else of the layout is special: its ``ensemble`` axis comes after ``variable``, and a
stack's ``ensemble="ensemble"`` takes it there (rows ``([T,] E, C, cell)``:
:mod:`~insitubatch_nodes.stack_ensemble`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.members import MemberMap
from insitubatch_nodes.io.objects import read_documents
from insitubatch_nodes.io.routing import RoutingStore
from insitubatch_nodes.io.stores import describe_store

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
    such a list; a group whose attributes cannot be read raises (:func:`group_attribute`)."""
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
    ``ValueError`` naming the attribute, a document that cannot be read an ``OSError`` naming
    it (:func:`group_attribute`: never taken as listing nothing)."""
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
    has; an absent document holds none). Each group's attribute document (``.zattrs``; v3:
    ``zarr.json``) is read once, all concurrently: one GET a group, not a group opened (four
    GETs) per level and per array. The root of a :class:`~insitubatch_nodes.io.routing.
    RoutingStore` is no group (each routed store's root is).

    A document that cannot be read (after the store's own retries: a 403, a deadline spent)
    where it could decide the answer (the array's group, or a parent below the nearest group
    that has the attribute) raises ``OSError`` (``PermissionError``, ``TimeoutError``: the
    cause's kind) naming the key, the store and what to do: the attribute is never guessed, so
    that every process (each DDP rank) that builds from the store plans the same samples or
    fails. A parent above the group that has it is not needed, and not said."""
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
    failed: dict[str, Exception] = {}
    texts = read_documents(store, keys, errors=failed)
    attrs = {g: _attributes(t, g[1]) for g, t in zip(groups, texts, strict=True)}
    unread = {g: (k, failed[k]) for g, k in zip(groups, keys, strict=True) if k in failed}
    out = []
    for (path, _), chain in zip(arrays, chains, strict=True):
        found = None
        for group in chain:  # nearest first: an unread group before the answer hides it
            if group in unread:
                raise _unread(store, path, name, *unread[group])
            if name in attrs[group]:
                found = attrs[group][name]
                break
        out.append(found)
    return out


#: what each attribute read here decides, for the error of one that cannot be read
_DECIDES = {
    "missing_dates": "which samples a build reads (anemoi-datasets' dates without data)",
    "variables": "the names sel(variable=...) looks up and a stack's channels are named by",
}


def _unread(store: Any, path: str, name: str, key: str, exc: Exception) -> OSError:
    """The error of the attribute document ``key`` that could not be read (``exc``)."""
    kind = (
        TimeoutError
        if isinstance(exc, TimeoutError)
        else PermissionError
        if isinstance(exc, PermissionError)
        else OSError
    )
    error = kind(
        f"cannot read {key!r} from store {describe_store(store)}, the attributes of a group "
        f"holding array {path!r} ({type(exc).__name__}: {exc}): its {name!r} attribute "
        f"decides {_DECIDES.get(name, 'how the array is read')}, and is not guessed (ranks "
        "that guessed differently would train on different samples). Grant read access to "
        "that object (S3 answers 403 for an absent one to credentials without s3:ListBucket) "
        "or repair it, check the store, and build again"
    )
    error.__cause__ = exc
    return error


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
