"""A collection's member metadata, taken from a coordinate reader that read it already
(``concat`` and ``join`` open every member for their checks) or read here, concurrently.

What :class:`~insitubatch_nodes.io.collection.Collection` checks its members by: the first
member's array of each variable, each member's array metadata document (its schema, its
length) and each member's attributes (its CF encoding).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.objects import read_documents

__all__ = ["first_member", "member_documents"]


def first_member(store: Any, path: str, reader: Any = None) -> tuple[Any, int] | None:
    """The array at ``path`` of ``store`` and its zarr format (``None``: no array there):
    ``reader``'s (a :func:`~insitubatch_nodes.io.coords.coordinate_reader` of ``store``) where
    it opened it, else read here (:func:`~insitubatch_nodes.io._zarr_compat.node_kind`, then
    zarr's open)."""
    held = None if reader is None else reader.arrays.get(path)
    if held is not None:
        return held, int(held.metadata.zarr_format)
    kind = _zarr_compat.node_kind(store, path)
    if kind is None or kind[0] != "array":
        return None
    return _zarr_compat.open_array_readonly(store, path, kind[1]), kind[1]


def member_documents(
    store: Any,
    paths: Mapping[str, Sequence[str]],
    formats: Mapping[str, int],
    attributes: bool,
    reader: Any = None,
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Per variable (``paths``: its members' array paths; ``formats``: its zarr format), each
    member's array metadata document (JSON bytes, ``None`` where absent) and, with
    ``attributes``, its attributes (``None`` where absent; ``{}`` without ``attributes``).

    Where ``reader`` opened every member's array (``concat``'s and ``join``'s checks did), the
    documents are its arrays' metadata, read nothing again; otherwise every document is read
    here, concurrently (one GET each; a v2 array's ``.zattrs`` is a second). Either way all of
    them come from one source, so the members' schemas compare like with like."""
    docs: dict[str, list[Any]]
    attrs: dict[str, list[Any]] = {}
    every = [p for ps in paths.values() for p in ps]
    held = {} if reader is None else reader.arrays
    if every and all(held.get(p) is not None for p in every):
        docs = {v: [_document(held[p]) for p in ps] for v, ps in paths.items()}
        attrs = {
            v: [dict(held[p].attrs) if attributes else {} for p in ps] for v, ps in paths.items()
        }
        return docs, attrs
    keys = [
        _zarr_compat.array_metadata_keys(p, formats[v])[0] for v, ps in paths.items() for p in ps
    ]
    read = iter(read_documents(store, keys))
    docs = {v: [next(read) for _ in ps] for v, ps in paths.items()}
    v2 = [v for v in paths if formats[v] == 2] if attributes else []
    attr_keys = [_zarr_compat.array_metadata_keys(p, 2)[1] for v in v2 for p in paths[v]]
    found = iter(read_documents(store, attr_keys) if attr_keys else [])
    for v, ps in paths.items():
        if not attributes:
            attrs[v] = [{} for _ in ps]
        elif v in v2:
            attrs[v] = [_parsed(next(found)) for _ in ps]
        else:
            attrs[v] = [
                d.get("attributes") if isinstance(d, dict) else None for d in map(_parsed, docs[v])
            ]
    return docs, attrs


def _parsed(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)


def _document(array: Any) -> bytes:
    """The metadata document of a zarr ``array`` as zarr would write it (JSON bytes)."""
    return json.dumps(array.metadata.to_dict(), default=_plain).encode()


def _plain(value: Any) -> Any:
    """A value of a metadata dict that ``json`` cannot write (a numpy scalar, an enum)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "value"):
        return value.value
    return str(value)
