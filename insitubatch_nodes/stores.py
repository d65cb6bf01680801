"""Open a zarr store by URL or path, backed by obstore.

Every API in this package that takes a store also accepts any ``zarr.abc.store.Store``; this
module turns the common spellings (a local path, ``file://``, ``memory://``, ``s3://``,
``gs://``, ``az://``) into a read-only ``zarr.storage.ObjectStore`` whose underlying obstore
store the fetch stage can drive directly with ``get_async``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from zarr.abc.store import Store
from zarr.storage import ObjectStore

__all__ = ["SUPPORTED_SCHEMES", "StoreLike", "as_store", "open_store"]

SUPPORTED_SCHEMES: tuple[str, ...] = ("file", "memory", "s3", "gs", "az")

StoreLike = Store | str | os.PathLike[str]

# memory://NAME resolves to one obstore MemoryStore per NAME for the life of the process, so two
# opens of the same URL see the same objects (what a user of fsspec's memory:// expects).
_MEMORY_STORES: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


def open_store(
    url_or_path: str | os.PathLike[str], *, read_only: bool = True, **options: Any
) -> Store:
    """Return a zarr ``Store`` for ``url_or_path``, backed by obstore.

    Accepted spellings:

    * a plain path or ``file:///abs/path`` — obstore ``LocalStore`` rooted at that folder;
    * ``memory://NAME`` — a process-wide in-memory store (same NAME, same objects);
    * ``s3://bucket/prefix`` — obstore ``S3Store``; ``options`` are passed through, e.g.
      ``endpoint=``, ``region=``, ``access_key_id=``, ``secret_access_key=``, ``session_token=``,
      ``skip_signature=True``, ``client_options={"allow_http": True}``, ``retry_config=``;
    * ``gs://bucket/prefix`` — obstore ``GCSStore`` (options passed through);
    * ``az://container/prefix`` — obstore ``AzureStore`` (options passed through).

    The store is read-only unless ``read_only=False``. Any other scheme raises ``ValueError``
    naming the supported ones; passing an existing ``zarr.abc.store.Store`` is an error here
    (use :func:`as_store`, which passes stores through).
    """
    from obstore.store import AzureStore, GCSStore, LocalStore, MemoryStore, S3Store

    from insitubatch_nodes import _runtime

    _runtime.check_obstore_usable()  # a fork of a process that used obstore would hang
    _runtime.note_obstore_use()
    if isinstance(url_or_path, Store):
        raise TypeError("open_store() takes a URL or path; a zarr Store can be used as it is")
    text = os.fspath(url_or_path)
    if not text:
        raise ValueError("open_store() needs a URL or a path, got an empty string")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    # A Windows drive letter ("C:\\data") parses as a one-letter scheme: treat it as a path.
    if scheme == "" or len(scheme) == 1:
        return _local(LocalStore, Path(text), read_only, options)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URLs must be local (file:///abs/path), got {text!r}")
        return _local(LocalStore, Path(parts.path), read_only, options)
    if scheme == "memory":
        if options:
            raise ValueError(f"memory:// takes no options, got {sorted(options)}")
        name = (parts.netloc + parts.path).strip("/")
        with _MEMORY_LOCK:
            mem = _MEMORY_STORES.setdefault(name, MemoryStore())
        return ObjectStore(mem, read_only=read_only)
    bucket = parts.netloc
    prefix = parts.path.strip("/") or None
    if scheme in ("s3", "gs", "az") and not bucket:
        raise ValueError(f"{scheme}:// URLs need a bucket: {scheme}://BUCKET/optional/prefix")
    if scheme == "s3":
        return ObjectStore(S3Store(bucket, prefix=prefix, **options), read_only=read_only)
    if scheme == "gs":
        return ObjectStore(GCSStore(bucket, prefix=prefix, **options), read_only=read_only)
    if scheme == "az":
        return ObjectStore(AzureStore(bucket, prefix=prefix, **options), read_only=read_only)
    raise ValueError(
        f"unsupported store scheme {scheme!r} in {text!r}; supported: "
        + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        + ", or a plain local path (or pass any zarr.abc.store.Store)"
    )


def _local(local_cls: Any, path: Path, read_only: bool, options: dict[str, Any]) -> Store:
    if options:
        raise ValueError(f"local stores take no options, got {sorted(options)}")
    path = path.expanduser().absolute()
    if read_only and not path.is_dir():
        raise FileNotFoundError(f"no zarr store at {str(path)!r}: the folder does not exist")
    return ObjectStore(local_cls(path, mkdir=not read_only), read_only=read_only)


def as_store(store: StoreLike, **options: Any) -> Store:
    """A zarr ``Store`` as it is, or :func:`open_store` of a URL/path (read-only)."""
    if isinstance(store, Store):
        if options:
            raise ValueError("store options apply to a URL or path, not to an opened Store")
        return store
    return open_store(store, **options)
