"""A join's coordinate reader, over what the readers of the stores it joins read already.

:meth:`~insitubatch_nodes.io.collection.Collection.join` given concatenations (each read
through its own :func:`~insitubatch_nodes.io.coords.coordinate_reader`, kept as
``coll.reader``) reads their stores again through a store of its own: a
:class:`~insitubatch_nodes.io.routing.RoutingStore` over all of them, whose key
``"s{i}/{key}"`` is ``key`` of its store ``i``. :func:`join_reader` makes the join's reader
hold what theirs hold (each array opened, each coordinate decoded; a path found to hold no
array), keyed by the join's paths, so that the join's checks and the pipelines built with
``coords_reader=joined.reader`` read none of it again. An array is made again over the join's
store at the join's path (:func:`~insitubatch_nodes.io._preread.rebased`, no read): the same
array a fresh read of that path opens, whose chunks are the same objects of the same store.
The reader's contract holds as it holds for theirs: what was read is not read again, so a
change made to a store after it was read is not seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zarr.abc.store import Store

from insitubatch_nodes.io._preread import rebased
from insitubatch_nodes.io.coords import Coordinate, coordinate_reader
from insitubatch_nodes.io.routing import RoutingStore, locate, routed_path, split_routed

__all__ = ["join_reader", "located_pieces"]


def located_pieces(
    rows: Mapping[str, Sequence[tuple[Any, str, int, int]]], readers: Sequence[Any]
) -> tuple[Store, dict[str, list[str]], dict[str, list[tuple[int, int]]], Any]:
    """Where a join's pieces are read (``rows``: per variable, each piece's ``(store, path,
    start, stop)``, :func:`~insitubatch_nodes.io.timeline.pieces_of_join`'s): the store to
    read them from (:func:`~insitubatch_nodes.io.routing.locate`), each variable's piece paths
    in it, each piece's kept samples ``(start, stop)``, and the reader of that store holding
    what ``readers`` (the stores' given to the join) read (:func:`join_reader`)."""
    store, flat = locate([(st, p) for r in rows.values() for st, p, _, _ in r])
    at = iter(flat)
    paths = {v: [next(at) for _ in r] for v, r in rows.items()}
    spans = {v: [(a, b) for *_, a, b in r] for v, r in rows.items()}
    return store, paths, spans, join_reader(store, readers)


def join_reader(store: Store, readers: Sequence[Any]) -> Any:
    """A coordinate reader of ``store`` (the join's: a routing store over the stores of its
    pieces, or their one store) holding what each of ``readers`` (coordinate readers of the
    stores the join was given, a concatenation's over its own routing store) read, at the
    path of ``store`` that serves the same key of the same store; what lies in no store of
    ``store`` is left out. Where two readers read one path, the first one's is kept. Nothing
    is read here, and ``readers`` are not changed."""
    reader = coordinate_reader(store)
    to_join = _paths_in(store)
    for source in readers:
        for key, array in source.arrays.items():
            path = to_join(source.store, key)
            if path is not None and path not in reader.arrays:
                reader.arrays[path] = None if array is None else rebased(array, store, path)
        for key, coord in source.loaded.items():
            path = to_join(source.store, key)
            if path is not None and path not in reader.loaded:
                reader.loaded[path] = Coordinate(coord.name, coord.values, path=path,
                                                 attrs=coord.attrs)  # fmt: skip
    return reader


def _paths_in(store: Store) -> Any:
    """``(other store, key) -> the path of store that serves that key of the store beneath``
    (``None`` where ``store`` serves none): a key of a routing store is its routed store's."""
    held = store.stores if isinstance(store, RoutingStore) else (store,)
    by_id: dict[int, int | None] = {id(s): i for i, s in enumerate(held)}

    def index(beneath: Store) -> int | None:  # (as locate dedups stores: the same, or equal)
        if id(beneath) not in by_id:  # (each other store compared once)
            by_id[id(beneath)] = next((i for i, s in enumerate(held) if s == beneath), None)
        return by_id[id(beneath)]

    def to_join(other: Store, key: str) -> str | None:
        beneath, rest = other, key
        if isinstance(other, RoutingStore):
            try:
                at, rest = split_routed(key)
            except KeyError:  # (above the routed stores: nothing lives there)
                return None
            if at >= len(other.stores):
                return None
            beneath = other.stores[at]
        i = index(beneath)
        if i is None:
            return None
        return routed_path(i, rest) if isinstance(store, RoutingStore) else rest

    return to_join
