"""Reading stored objects: :func:`make_async_getter` (one GET per object, through obstore or
the store's own ``get``, with what identifies the object and a deadline) and
:func:`head_objects` (HEAD requests, many in flight: identities without the bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from insitubatch_nodes import _waits
from insitubatch_nodes._process import retry_time_scale
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.localfiles import local_reader
from insitubatch_nodes.io.stores import credentials_error, plain_object_store

__all__ = [
    "HEADS_IN_FLIGHT",
    "RoutedGetter",
    "head_objects",
    "make_async_getter",
    "read_documents",
]


class RoutedGetter:
    """:func:`make_async_getter`'s getter of a :class:`~insitubatch_nodes.io.routing.
    RoutingStore`: each key read by its own store's getter; ``served[i]`` counts the objects
    store ``i`` returned (on the IO loop), which tells a store that stopped answering from the
    others (see :mod:`~insitubatch_nodes.stages._bad`)."""

    def __init__(self, getters: Sequence[Any]) -> None:
        from insitubatch_nodes.io.routing import split_routed

        self.getters = list(getters)
        self.served = [0] * len(self.getters)
        self._split = split_routed

    async def __call__(self, key: str, meta: list[Any] | None = None) -> Any:
        index, rest = self._split(key)
        got = await self.getters[index](rest, meta)
        self.served[index] += 1
        return got


def make_async_getter(store: Any, timeout_s: float | None = None) -> Any:
    """An ``async get(key, meta=None) -> bytes-like | None`` for ``store`` (None = object
    missing). A list passed as ``meta`` receives the obstore ``ObjectMeta`` of the object read
    (``None`` when missing) — what identifies it (see store_identity). A zarr ``WrapperStore``
    (a logging, counting or caching wrapper) is read through its own ``get``, and ``meta``
    receives what identifies the object in the store it wraps, asked for before the read (a
    local folder's ``os.stat``, an obstore store's ``head``); other stores add nothing.

    A ``zarr.storage.ObjectStore`` is read through the obstore store beneath it
    (``obstore.get_async``), skipping zarr's buffer layer; any other zarr store through its own
    ``Store.get``. With ``timeout_s`` every read (request, retries and body) that has not
    finished after that many seconds (on the retry clock, see
    :func:`~insitubatch_nodes.io.stores.retry_time_scale`) is cancelled and raises
    ``TimeoutError``. A signed cloud store that finds no credentials raises
    :func:`~insitubatch_nodes.io.stores.credentials_error`'s ``PermissionError`` (obstore's
    error chained).
    """
    from zarr.storage import ObjectStore

    from insitubatch_nodes.io.routing import RoutingStore

    get: Any
    if isinstance(store, RoutingStore):  # each key read by its own store's getter
        return RoutedGetter([_member_getter(s, timeout_s) for s in store.stores])
    if isinstance(store, ObjectStore):
        import obstore

        inner = store.store

        async def get_obstore(key: str, meta: list[Any] | None = None) -> Any:
            try:
                response = await obstore.get_async(inner, key)
            except FileNotFoundError:
                if meta is not None:
                    meta.append(None)
                return None
            except obstore.exceptions.BaseError as exc:
                error = credentials_error(store, exc)  # no credentials: say anonymous=True
                if error is None:
                    raise
                raise error from exc
            if meta is not None:
                meta.append(response.meta)
            return await response.bytes_async()

        get = get_obstore
    else:
        from zarr.buffer import default_buffer_prototype

        prototype = default_buffer_prototype()
        inner = _zarr_compat.wrapped_store(store)
        identify = _identify_before_read(inner) if inner is not store else None

        async def get_zarr(key: str, meta: list[Any] | None = None) -> Any:
            if meta is not None and identify is not None:
                meta.append(await identify(key))  # before the read: never newer than the bytes
            buf = await store.get(key, prototype=prototype)
            return None if buf is None else buf.as_numpy_array()

        get = get_zarr

    if timeout_s is None:
        return get
    import asyncio

    scale = retry_time_scale()

    async def get_with_deadline(key: str, meta: list[Any] | None = None) -> Any:
        deadline = asyncio.timeout(timeout_s * scale)
        try:
            async with deadline:
                return await get(key, meta)
        except TimeoutError:
            if not deadline.expired():
                raise  # the store's own TimeoutError, not our deadline
            raise TimeoutError(
                f"no complete answer for {key!r} within {timeout_s:g} s "
                "(RetryPolicy.timeout_s): the store stopped answering or is too slow"
            ) from None

    return get_with_deadline


def _member_getter(store: Any, timeout_s: float | None) -> Any:
    """The getter of one store of a collection over several: as :func:`make_async_getter`'s,
    except that a local folder (read as a GET here, not on the decode threads) is identified
    by its file's ``os.stat`` before the read, as a wrapper's would be."""
    get = make_async_getter(store, timeout_s)
    if _zarr_compat.wrapped_store(store) is not store or local_reader(store) is None:
        return get  # a wrapper's getter identifies its reads; obstore's GETs carry their own
    identify = _identify_before_read(store)

    async def get_identified(key: str, meta: list[Any] | None = None) -> Any:
        if meta is not None:
            meta.append(await identify(key))  # before the read: never newer than the bytes
        return await get(key, None)

    return get_identified


def _identify_before_read(inner: Any) -> Any:
    """For a wrapper's reads: an ``async identify(key)`` of the store it wraps — a local
    folder's file ``os.stat`` (``None`` when missing), an obstore store's ``head`` (its
    ``ObjectMeta``) — or ``None`` when that store gives no identities."""
    import asyncio
    import os

    reader = local_reader(inner)
    if reader is not None:
        root = os.fspath(reader.root)

        async def stat(key: str) -> Any:
            try:
                return await asyncio.to_thread(os.stat, os.path.join(root, key))
            except (FileNotFoundError, NotADirectoryError):
                return None

        return stat
    if plain_object_store(inner):  # HTTP too: a HEAD gives its ETag / Last-Modified
        import obstore

        async def head(key: str) -> Any:
            try:
                return await obstore.head_async(inner.store, key)
            except FileNotFoundError:
                return None

        return head
    return None


HEADS_IN_FLIGHT = 64  # HEAD requests at once when a cache checks objects one by one


def head_objects(store: Any, keys: list[str], in_flight: int = HEADS_IN_FLIGHT) -> list[Any]:
    """The obstore ``ObjectMeta`` of each of ``keys`` (``None`` where there is no such object)
    in a zarr ``ObjectStore`` (:func:`plain_object_store`): one HEAD request each, ``in_flight``
    at a time, on zarr's IO loop. What a cache checks a store that cannot list against (an
    HTTP server's ``ETag`` / ``Last-Modified`` / ``Content-Length``). Raises what obstore
    raises for anything but a missing object (a network error, a refusal)."""
    import asyncio

    import obstore

    inner = store.store

    async def heads() -> list[Any]:
        limit = asyncio.Semaphore(in_flight)

        async def one(key: str) -> Any:
            async with limit:
                try:
                    return await obstore.head_async(inner, key)
                except FileNotFoundError:
                    return None

        return list(await asyncio.gather(*(one(k) for k in keys)))

    return _waits.result(asyncio.run_coroutine_threadsafe(heads(), _zarr_compat.io_loop()))


def read_documents(
    store: Any,
    keys: Sequence[str],
    in_flight: int = HEADS_IN_FLIGHT,
    errors: dict[str, Exception] | None = None,
) -> list[Any]:
    """The bytes at each of ``keys`` of a zarr ``store`` (``None`` where there is nothing): the
    metadata documents of many arrays or groups read without building a zarr object for each
    (a collection's members, a plate's wells and fields). A read that fails (after the store's
    own retries) raises; with ``errors`` given it is recorded there instead (``{key: the
    error}``, that key's item ``None``) and the other keys are still read, each once.

    A folder of files on this machine (:func:`~insitubatch_nodes.io.localfiles.local_reader`)
    is read file by file on the calling thread (about 15 µs a document from the page cache,
    against about 200 µs through the store's async ``get``); any other store on zarr's IO loop
    by ``in_flight`` readers that each take the next key as they finish one (cheaper than a
    task per key)."""
    local = local_reader(store)
    if local is not None:
        out = []
        for key in keys:
            try:
                out.append(_read_file(local.path(key)))
            except OSError as exc:
                if errors is None:
                    raise
                out.append(None)
                errors[key] = exc
        return out
    import asyncio

    from zarr.buffer import default_buffer_prototype

    prototype = default_buffer_prototype()
    docs: list[Any] = [None] * len(keys)
    todo = iter(enumerate(keys))

    async def reader() -> None:
        for i, key in todo:
            try:
                found = await store.get(key, prototype=prototype)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except Exception as exc:
                if errors is None:
                    raise
                errors[key] = exc
                continue
            docs[i] = None if found is None else found.to_bytes()

    async def every() -> None:
        await asyncio.gather(*(reader() for _ in range(min(in_flight, len(keys)))))

    _waits.result(asyncio.run_coroutine_threadsafe(every(), _zarr_compat.io_loop()))
    return docs


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
