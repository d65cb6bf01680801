"""A read-only zarr store over several stores: what a collection whose members live in
different stores (slides, scenes, archives) is read through.

Key ``"s{i}/{key}"`` is ``key`` of store ``i`` (``"s{i}"`` alone is the root of store ``i``):
each member's path is its array's path below its own store's prefix, so every stored-object
GET, the metadata reads and listings go to the member's own store, with that store's own
retries. A collection of one store never uses it (the fetch stage then keeps its fast paths,
e.g. a local folder read on the decode threads).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from insitubatch_nodes.io.stores import as_store, describe_store

__all__ = ["RoutingStore", "locate", "routed_path", "split_routed"]


def routed_path(index: int, path: str) -> str:
    """The path of ``path`` of store ``index`` in a :class:`RoutingStore`."""
    return f"s{index}/{path}" if path else f"s{index}"


def split_routed(key: str) -> tuple[int, str]:
    """``(store index, key in that store)`` of key ``key`` of a :class:`RoutingStore`
    (``"s1/img/c/0"`` -> ``(1, "img/c/0")``); ``KeyError`` for a key below no routed store."""
    head, _, rest = key.partition("/")
    if not (head.startswith("s") and head[1:].isdigit()):
        raise KeyError(f"{key!r} is below no routed store (keys start with 's<index>/')")
    return int(head[1:]), rest


class RoutingStore(Store):
    """``stores`` as one read-only store (see the module docstring)."""

    def __init__(self, stores: Sequence[Store]) -> None:
        super().__init__(read_only=True)
        self.stores = tuple(stores)
        self._is_open = True

    def _routes(self, key: str) -> bool:
        head = key.partition("/")[0]
        return head.startswith("s") and head[1:].isdigit() and int(head[1:]) < len(self.stores)

    def _route(self, key: str) -> tuple[Store, str]:
        if not self._routes(key):
            raise KeyError(f"{key!r} names none of the {len(self.stores)} routed stores")
        index, rest = split_routed(key)
        return self.stores[index], rest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutingStore) and other.stores == self.stores

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        """The stores, the first and last three of more (error messages and a collection's
        repr quote it: a thousand scenes in stores of their own made it a page long). Not an
        identity: two routing stores that differ in a middle store print alike
        (:attr:`identity` names them all)."""
        n = len(self.stores)
        if n <= 6:
            return self.identity
        shown = (*self.stores[:3], None, *self.stores[-3:])
        names = ", ".join("..." if s is None else describe_store(s) for s in shown)
        return f"RoutingStore({n} stores: {names})"

    @property
    def identity(self) -> str:
        """Every store's name, in order: what tells this routing store from another (a
        collection's name and fingerprint digest it). Of up to six stores it is the repr."""
        return f"RoutingStore({', '.join(describe_store(s) for s in self.stores)})"

    async def _ensure_open(self) -> None:
        for store in self.stores:
            if not getattr(store, "_is_open", True):
                await store._ensure_open()

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if not self._routes(key):  # nothing lives above the routed stores (no root group)
            return None
        store, rest = self._route(key)
        return await store.get(rest, prototype, byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        if not self._routes(key):
            return False
        store, rest = self._route(key)
        return await store.exists(rest)

    @property
    def supports_writes(self) -> bool:
        return False

    async def set(self, key: str, value: Buffer) -> None:
        raise ValueError("a RoutingStore is read-only")

    @property
    def supports_deletes(self) -> bool:
        return False

    async def delete(self, key: str) -> None:
        raise ValueError("a RoutingStore is read-only")

    @property
    def supports_listing(self) -> bool:
        return all(s.supports_listing for s in self.stores)

    async def list(self) -> AsyncIterator[str]:
        for i, store in enumerate(self.stores):
            async for key in store.list():
                yield f"s{i}/{key}"

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        store, rest = self._route(prefix)
        head = prefix.partition("/")[0]
        async for key in store.list_prefix(rest):
            yield f"{head}/{key}"

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        if not prefix.strip("/"):
            for i in range(len(self.stores)):
                yield f"s{i}"
            return
        store, rest = self._route(prefix.strip("/"))
        async for key in store.list_dir(rest):
            yield key


def locate(given: Sequence[tuple[Any, str]]) -> tuple[Store, list[str]]:
    """The store to read ``(store, path)`` pairs from, and each path in it: the one store, or
    a :class:`RoutingStore` over several (a collection's members in several stores)."""
    stores: list[Store] = []
    located: list[tuple[int, str]] = []
    opened: dict[Any, Store] = {}
    # Stores are unhashable; one equal to an earlier one is found among those of its text
    # (equal stores print alike: their URL or root), not by comparing it with every store
    # (quadratic: 8 million comparisons, 16 s, for 4,000 members in stores of their own).
    # A store whose text holds its id (a memory store) is compared with every store, as is
    # every store with those.
    by_text: dict[str, list[int]] = {}
    by_id: list[int] = []
    for store, path in given:
        if store is None:
            raise TypeError(f"{path!r} names no store: give a store, or a (store, path) pair")
        # a path or URL is opened once, however often it is given
        token = os.fspath(store) if isinstance(store, str | os.PathLike) else id(store)
        if token not in opened:
            opened[token] = as_store(store)
        zstore = opened[token]
        text = str(zstore)
        own_id = str(id(zstore)) in text or f"{id(zstore):x}" in text
        alike = range(len(stores)) if own_id else sorted([*by_text.get(text, ()), *by_id])
        index = next((i for i in alike if stores[i] is zstore or stores[i] == zstore), None)
        if index is None:
            stores.append(zstore)
            index = len(stores) - 1
            (by_id if own_id else by_text.setdefault(text, [])).append(index)
        located.append((index, path))
    if len(stores) == 1:
        return stores[0], [p for _, p in located]
    return RoutingStore(stores), [routed_path(i, p) for i, p in located]
