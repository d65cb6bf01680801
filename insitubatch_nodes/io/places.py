"""Where a store's objects live, beyond its bucket and prefix: its server and account.

Two stores with one bucket name and prefix are two stores when they are reached at two
endpoints (two S3-compatible servers: MinIO, Ceph, a moto server; a GCS emulator) or in two
Azure accounts (a container name is unique within its account only). A store's name
(:func:`~insitubatch_nodes.io.stores.describe_store`, which saved statistics record) and the
store a persistent cache's chunks were read from
(:attr:`~insitubatch_nodes.cache.identity.StoreCheck.where`) both say it, by the rules here —
one rule for both.

**obstore** (:func:`cloud_endpoint`, :func:`cloud_account`). A store's ``config`` holds only
what it was given; what obstore took from the environment (``AWS_ENDPOINT_URL`` and
``AWS_ENDPOINT``, ``AWS_ENDPOINT_URL_S3``, ``GOOGLE_BASE_URL``, ``AZURE_STORAGE_ACCOUNT_NAME``,
``AZURE_STORAGE_ENDPOINT`` / ``AZURE_ENDPOINT``) it does not report, so that is read here in
the same order of precedence (an option before its variable; S3's ``endpoint_url_s3`` before
``endpoint``). The environment is read when asked (a pipeline's build), not when the store was
made: a variable changed between the two is not seen.

**fsspec** (:func:`fsspec_endpoint`): a zarr ``FsspecStore``'s ``storage_options``
(``endpoint_url``, also under ``client_kwargs``; an Azure ``account_name``), and for ``s3``
what botocore reads from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``).

**A store that cannot be identified by its objects** (:func:`object_place`: a zarr
``MemoryStore``, an ``FsspecStore``, a ``ZipStore``) is identified by what it reads: an
``FsspecStore`` by its protocol, endpoint and path (a local one by its folder, as a folder opened
by path is), a ``ZipStore`` by its file, anything else as the very object (a token kept on it).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "cloud_account",
    "cloud_endpoint",
    "cloud_repr",
    "env_endpoint",
    "fsspec_endpoint",
    "normal_endpoint",
    "normal_store_name",
    "object_place",
    "place_label",
]

# obstore store class -> the config keys naming its endpoint, first given wins, and for each the
# environment variables obstore reads for it when it was not given
_ENDPOINTS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "S3Store": (
        ("endpoint_url_s3", ("AWS_ENDPOINT_URL_S3",)),
        ("endpoint", ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")),
    ),
    "GCSStore": (("base_url", ("GOOGLE_BASE_URL",)),),
    "AzureStore": (("endpoint", ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")),),
}
_TOKEN_ATTR = "_insitubatch_place"  # a store identified as the object itself (object_place)


def _given(config: Mapping[str, Any], key: str, env: tuple[str, ...]) -> str:
    """``config[key]``, else the first of the variables ``env`` set (stripped; ``""``: none)."""
    value = str(config.get(key) or "").strip()
    for name in env if not value else ():
        value = (os.environ.get(name) or "").strip()
        if value:
            break
    return value


def env_endpoint(store_class: str) -> tuple[str, str]:
    """``(variable, value)`` of the first environment variable obstore takes the endpoint of
    a ``store_class`` (``"S3Store"``, ``"GCSStore"``, ``"AzureStore"``) from when no option
    names one, in obstore's order of precedence; ``("", "")`` when none is set."""
    for _, env in _ENDPOINTS.get(store_class, ()):
        for name in env:
            value = (os.environ.get(name) or "").strip()
            if value:
                return name, value
    return "", ""


def cloud_endpoint(inner: Any) -> str:
    """The endpoint an obstore ``S3Store``, ``GCSStore`` or ``AzureStore`` reads from, as
    :func:`normal_endpoint` spells it: given (``endpoint=``, ``endpoint_url=``, ...) or taken
    from the environment; ``""`` for the provider's own (and for any other store)."""
    config = getattr(inner, "config", None) or {}
    for key, env in _ENDPOINTS.get(type(inner).__name__, ()):
        given = _given(config, key, env)
        if given:
            return normal_endpoint(given)
    emulator = _given(config, "use_emulator", ("AZURE_STORAGE_USE_EMULATOR",))
    if type(inner).__name__ == "AzureStore" and emulator.lower() == "true":
        return "http://127.0.0.1:10000"  # (Azurite's, obstore's default emulator)
    return ""


def cloud_account(store: Any) -> str:
    """The account of an obstore ``AzureStore`` (given, or ``AZURE_STORAGE_ACCOUNT_NAME``) or
    of a zarr ``FsspecStore`` (its ``account_name`` option); ``""`` for any other store."""
    if type(store).__name__ == "FsspecStore":
        options = getattr(getattr(store, "fs", None), "storage_options", None) or {}
        return str(options.get("account_name") or "").strip()
    if type(store).__name__ != "AzureStore":
        return ""
    config = getattr(store, "config", None) or {}
    return _given(config, "account_name", ("AZURE_STORAGE_ACCOUNT_NAME",))


def cloud_repr(inner: Any) -> str:
    """``repr(inner)`` of an obstore store, spelled here for an ``AzureStore`` (obstore 0.12's
    repr of one whose account came from the environment panics: "Account name should always
    exist in the config"), as obstore spells it when the account is given."""
    if type(inner).__name__ != "AzureStore":
        return repr(inner)
    container = (getattr(inner, "config", None) or {}).get("container_name")
    prefix = getattr(inner, "prefix", None)
    text = f'AzureStore(container_name="{container}", account_name="{cloud_account(inner)}"'
    return text + (f', prefix="{prefix}")' if prefix else ")")


def fsspec_endpoint(store: Any) -> str:
    """The endpoint a zarr ``FsspecStore`` reads from, normal (``""``: its file system's
    default, or not an ``FsspecStore``)."""
    fs = getattr(store, "fs", None)
    options = getattr(fs, "storage_options", None)
    if type(store).__name__ != "FsspecStore" or not isinstance(options, Mapping):
        return ""
    client = options.get("client_kwargs")
    client = client if isinstance(client, Mapping) else {}
    endpoint = str(options.get("endpoint_url") or client.get("endpoint_url") or "").strip()
    protocol = getattr(fs, "protocol", "")
    if not endpoint and "s3" in (protocol if isinstance(protocol, tuple | list) else [protocol]):
        endpoint = _given({}, "", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    return normal_endpoint(endpoint) if endpoint else ""


def place_label(store: Any) -> str:
    """What a store's name adds after its URL to say where it is: ``" (account A)"`` and
    ``" (endpoint E)"`` where it has them (an obstore cloud store, or a zarr ``FsspecStore``);
    ``""`` else."""
    account = cloud_account(store)
    endpoint = fsspec_endpoint(store) or cloud_endpoint(store)
    return (f" (account {account})" if account else "") + (
        f" (endpoint {endpoint})" if endpoint else ""
    )


def object_place(store: Any) -> str:
    """What a store that cannot be listed reads, as a string that is the same for a store
    opened again over the same objects (module docstring); never that of another store."""
    name = type(store).__name__
    if name == "FsspecStore":
        protocol = getattr(store.fs, "protocol", "")
        protocol = protocol[0] if isinstance(protocol, tuple | list) else protocol
        if protocol in ("file", "local"):
            return "file://" + os.path.realpath(store.path)  # (a folder's, however opened)
        return f"fsspec:{protocol}://{store.path}{place_label(store)}"
    if name == "ZipStore":
        return "zip://" + os.path.realpath(store.path)
    token = getattr(store, _TOKEN_ATTR, None)
    if not isinstance(token, str):
        token = f"object:{uuid.uuid4().hex}"
        with contextlib.suppress(AttributeError, TypeError):  # (slots: this build's only)
            setattr(store, _TOKEN_ATTR, token)
    return token


def normal_endpoint(endpoint: str) -> str:
    """``endpoint`` with its scheme and host in lower case and no trailing ``/``."""
    parts = urlsplit(endpoint)
    if not parts.scheme or not parts.netloc:
        return endpoint.rstrip("/")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def normal_store_name(name: Any) -> Any:
    """A store's name as :func:`~insitubatch_nodes.io.stores.describe_store` gave it (in a saved
    file, say) with its endpoint spelled as :func:`normal_endpoint` spells it, and a zarr
    ``LocalStore``'s (its repr, ``LocalStore('file:///data/x.zarr')``, or a ``WrapperStore``'s
    around one) as its folder, ``/data/x.zarr``, the name of the path it opens; anything else
    as it is."""
    if not isinstance(name, str):
        return name
    local = re.fullmatch(r"(?:LocalStore\(|WrapperStore\(LocalStore, )'file://(/.*)'\)", name)
    if local:
        return local[1]
    found = re.fullmatch(r"(.*) \(endpoint (.+)\)", name)
    return f"{found[1]} (endpoint {normal_endpoint(found[2])})" if found else name
