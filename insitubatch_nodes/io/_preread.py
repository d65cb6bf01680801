"""zarr's own open of a node whose metadata documents were read already (by
:func:`~insitubatch_nodes.io._zarr_compat.node_kind`, which GETs them to find what the node
is): the documents are handed to zarr from memory, so that each is one GET, not two.

Public zarr only: ``zarr.storage.WrapperStore`` serves the documents read, zarr's
``open_array`` / ``open_group`` parse them as they parse any, and the node they return is made
again over the store zarr opened (``zarr.AsyncArray(metadata, store_path, config)``,
``zarr.AsyncGroup(metadata, store_path)``), so nothing keeps the wrapper. An array opened
already is made again the same way over another store's path (:func:`rebased`: a join's
routing store over the stores its concatenations opened it in).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import StorePath, WrapperStore

__all__ = ["open_read", "rebased"]


class _Preread(WrapperStore[Store]):
    """``store`` with some of its keys' whole-object GETs answered from ``docs`` (key -> what
    a GET of it returned, ``None`` for an absent key); every other call goes to ``store``."""

    def __init__(self, store: Store, docs: Mapping[str, Buffer | None] | None = None) -> None:
        super().__init__(store)
        self._docs = dict(docs or {})

    def _with_store(self, store: Store) -> _Preread:  # (zarr's read-only copy for mode="r")
        return type(self)(store, self._docs)

    @property
    def supports_consolidated_metadata(self) -> bool:
        return self._store.supports_consolidated_metadata

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if byte_range is None and key in self._docs:
            return self._docs[key]
        return await self._store.get(key, prototype, byte_range)


async def open_read(
    store: Any, path: str, kind: tuple[str, int], docs: Mapping[str, Buffer | None]
) -> Any:
    """The node at ``path`` of ``store`` that ``kind`` names (``("array" | "group", zarr
    format)``), opened read-only by zarr from ``docs`` (the documents read to find ``kind``,
    key -> what its GET returned) and the GETs of the documents it still needs (a v2 array's
    ``.zattrs``, a v2 group's ``.zattrs`` and ``.zmetadata``): an ``AsyncArray`` or an
    ``AsyncGroup`` over the store itself (zarr's read-only copy of it, as ``zarr.open_array``
    gives). Raises what zarr raises for those documents."""
    from zarr.api.asynchronous import open_array, open_group

    pre = _Preread(store, docs)
    if kind[0] == "array":
        array = await open_array(store=pre, path=path, mode="r", zarr_format=kind[1])  # type: ignore[arg-type]
        where = _unwrapped(array.store_path)
        return zarr.AsyncArray(metadata=array.metadata, store_path=where, config=array.config)
    group = await open_group(store=pre, path=path, mode="r", zarr_format=kind[1])  # type: ignore[arg-type]
    return zarr.AsyncGroup(metadata=group.metadata, store_path=_unwrapped(group.store_path))


def _unwrapped(where: StorePath) -> StorePath:
    """``where`` over the store the :class:`_Preread` wraps (zarr may have copied it)."""
    store = where.store
    return StorePath(store._store if isinstance(store, _Preread) else store, where.path)


def rebased(array: zarr.Array, store: Store, path: str) -> zarr.Array:
    """``array`` (its metadata read already) as zarr opens the array at ``path`` of ``store``,
    reading nothing: its metadata and config, over ``StorePath(store, path)``. Its chunks are
    read through ``store``; where ``store`` serves at ``path`` what ``array``'s own store
    serves at its path (a routing store over it), it reads the same bytes."""
    where = StorePath(store, path)
    return zarr.Array(zarr.AsyncArray(metadata=array.metadata, store_path=where,
                                      config=array.async_array.config))  # fmt: skip
