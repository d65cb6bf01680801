"""Open a zarr store by URL or path, backed by obstore, with a bounded retry policy.

Every API in this package that takes a store also accepts any ``zarr.abc.store.Store``; this
module turns the common spellings (a local path, ``file://``, ``memory://``, ``s3://``,
``gs://``, ``az://``, ``http://``, ``https://``) into a read-only ``zarr.storage.ObjectStore``
whose underlying obstore store the fetch stage can drive directly with ``get_async``.

Public buckets are read with ``open_store(url, anonymous=True)`` (unsigned requests, no
credential lookup). A signed store whose first read finds no credentials, or is refused with
401/403, raises ``PermissionError`` naming the store and suggesting ``anonymous=True``; an
anonymous one refused with 401/403 raises one saying the bucket is not public and to pass
credentials (:func:`credentials_error`; the zarr reads of a cloud store go through
:class:`_CloudObjectStore`, the fetch stage's GETs through the same helper).

:class:`RetryPolicy` is the one place that says how long a read may take: how often a failed
request is retried, with what backoff, and the deadline after which a stored-object read fails
for good (so a store that stops answering surfaces as an error, never as a hang).
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, Union, cast
from urllib.parse import urlsplit

import zarr
from zarr.abc.store import Store
from zarr.storage import ObjectStore

from insitubatch_nodes import _process
from insitubatch_nodes._process import RETRY_TIME_SCALE_ENV, retry_time_scale
from insitubatch_nodes.io import _zarr_compat, store_urls
from insitubatch_nodes.io.datasets import dataset_store, is_xarray_dataset, refuse_changed
from insitubatch_nodes.io.places import env_endpoint, normal_store_name, place_label

if TYPE_CHECKING:
    import xarray

__all__ = [
    "RETRY_TIME_SCALE_ENV",
    "SUPPORTED_SCHEMES",
    "RetryPolicy",
    "StoreLike",
    "as_store",
    "credentials_error",
    "describe_store",
    "open_store",
    "retry_policy",
    "retry_time_scale",
]

SUPPORTED_SCHEMES: tuple[str, ...] = ("file", "memory", "s3", "gs", "az", "http", "https")

#: what the functions that read a store take (:func:`as_store`): a zarr ``Store``, a path or a
#: URL, a zarr root ``Group`` or an xarray ``Dataset`` opened from zarr (xarray is optional:
#: named as a string, so this module does not import it)
StoreLike: TypeAlias = Union[Store, str, os.PathLike[str], zarr.Group, "xarray.Dataset"]

# memory://NAME resolves to one obstore MemoryStore per NAME for the life of the process, so two
# opens of the same URL see the same objects (what a user of fsspec's memory:// expects).
_MEMORY_STORES: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()

# What open_store() remembers on the stores it returns (plain attributes of the zarr store).
_POLICY_ATTR = "_insitubatch_retry_policy"
_LABEL_ATTR = "_insitubatch_label"

# client_options keys that RetryPolicy sets (refused in options: one place says how long).
_TIMEOUT_KEYS = ("connect_timeout", "read_timeout", "timeout")

# obstore 0.12 ignores client options from the environment (AWS_ALLOW_HTTP, ...) as soon as
# client_options is passed, which the policy's timeouts require: they are read here instead.
_ENV_CLIENT_KEYS = (
    "allow_http",
    "allow_invalid_certificates",
    "default_content_type",
    "http1_only",
    "http2_only",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "user_agent",
)
_ENV_PREFIX = {"s3": "AWS_", "gs": "GOOGLE_", "az": "AZURE_"}
_STORE_CLASS = {"s3": "S3Store", "gs": "GCSStore", "az": "AzureStore"}  # obstore's, by scheme

# Options that name a cloud store's endpoint (obstore's spellings): a plain-HTTP one needs
# client_options={"allow_http": True}, which open_store asks for by name.
_ENDPOINT_KEYS = ("endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url", "base_url",
                  "google_base_url", "azure_endpoint", "aws_endpoint_url_s3",
                  "endpoint_url_s3")  # fmt: skip

# Options that give a signed store its credentials: refused together with anonymous=True.
_CREDENTIAL_KEYS = (
    "access_key_id",
    "secret_access_key",
    "session_token",
    "token",
    "credential_provider",
    "service_account",
    "service_account_path",
    "service_account_key",
    "application_credentials",
    "bearer_token",
    "account_key",
    "sas_key",
    "client_secret",
)

# What obstore 0.12's message says when it found no credentials and fell back to a credential
# service that is not there: AWS's instance metadata (PUT /latest/api/token, IMDSv2), ECS's
# container credentials, GCP's and Azure's metadata token endpoints ("token request").
_NO_CREDENTIALS_MARKERS = (
    "/latest/api/token",
    "/latest/meta-data/iam",
    "computemetadata",
    "token request",
    "credential",
)


@dataclass(frozen=True)
class RetryPolicy:
    """How reads from a store are retried, and when they give up.

    ``timeout_s`` is the deadline of one stored-object read, start to finish: every attempt,
    every backoff and the transfer of the bytes. A read still unfinished then fails with
    ``TimeoutError`` (raised to the consumer as a ``ChunkReadError`` naming array, chunk and
    store). It applies to every store, obstore-backed or not. For an obstore-backed remote
    store (``s3://``, ``gs://``, ``az://``, ``http(s)://``) it is also obstore's
    ``retry_timeout`` (no new attempt starts after it) and its per-request ``timeout``, so
    zarr's own metadata reads through the same store end near it too (within one
    ``stall_timeout_s``).

    **Retries spend the deadline.** A transient error is retried, with capped and jittered
    exponential backoff, until ``timeout_s`` is spent: a burst of 503s that clears within the
    deadline costs time, not the read. ``max_retries`` is an optional extra cap:

    * ``max_retries=None`` (default) — no count limit; obstore is given
      :attr:`retry_count_limit`, more retries than fit in ``timeout_s`` at the shortest
      backoff, so the deadline always ends the retries first;
    * ``max_retries=N`` — at most N retries of one request after the first attempt (0
      disables them), or fewer if the deadline comes first: to fail fast rather than wait out
      a burst (N retries of jittered backoff take between ``N * initial_backoff_s`` and
      about ``N * max_backoff_s``).

    The other fields configure obstore's HTTP client and only apply to remote stores:

    * ``initial_backoff_s``, ``max_backoff_s``, ``backoff_base`` — the backoff between
      attempts: each wait is drawn at random between ``initial_backoff_s`` and
      ``backoff_base`` times the previous one, and never exceeds ``max_backoff_s``;
    * ``connect_timeout_s`` — an attempt that cannot connect within it fails (and is retried);
    * ``stall_timeout_s`` — an attempt that receives nothing for this long fails (and is
      retried): what catches an endpoint that accepts connections but no longer answers.

    Retried (transient) by obstore 0.12: HTTP 5xx and 429, S3's 200-with-``SlowDown``/
    ``InternalError`` body, connection errors (refused, reset, dropped mid-body) and
    timeouts of reads. Not retried: other 4xx (a 404 on a chunk reads as the fill value, like
    zarr; 403/401 raise at once). Under the defaults a 6 s burst of 503s or 500s on every
    object is absorbed (a read caught in it ends at most one ``max_backoff_s`` after the burst;
    measured: within 2.4 s), and an endpoint that is dead (refused) or frozen fails each read
    at ``timeout_s`` = 30 s; 30 s is obstore's own per-request default, so a transfer that
    obstore would allow still fits.
    """

    timeout_s: float = 30.0
    max_retries: int | None = None
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    backoff_base: float = 2.0
    connect_timeout_s: float = 5.0
    stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "initial_backoff_s",
            "max_backoff_s",
            "connect_timeout_s",
            "stall_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"RetryPolicy.{name} must be a number of seconds, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"RetryPolicy.{name} must be positive and finite, got {value!r}")
        if self.max_retries is None:
            pass
        elif isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            raise TypeError(
                f"RetryPolicy.max_retries must be an int or None (retry until timeout_s), "
                f"got {self.max_retries!r}"
            )
        elif self.max_retries < 0:
            raise ValueError(f"RetryPolicy.max_retries must be >= 0, got {self.max_retries}")
        if not (isinstance(self.backoff_base, int | float) and self.backoff_base >= 1):
            raise ValueError(f"RetryPolicy.backoff_base must be >= 1, got {self.backoff_base!r}")
        if self.initial_backoff_s > self.max_backoff_s:
            raise ValueError(
                f"RetryPolicy.initial_backoff_s ({self.initial_backoff_s}) is above "
                f"max_backoff_s ({self.max_backoff_s})"
            )

    @property
    def retry_count_limit(self) -> int:
        """The retry count obstore is given: ``max_retries``, or for ``None`` one more retry
        than fits in ``timeout_s`` when every backoff is the shortest (``initial_backoff_s``;
        no wait is shorter), so that only the deadline ends the retries."""
        if self.max_retries is not None:
            return self.max_retries
        return math.ceil(self.timeout_s / self.initial_backoff_s) + 1

    def obstore_retry_config(self) -> dict[str, Any]:
        """The policy as obstore's ``retry_config`` (its seconds on the retry clock, see
        :func:`retry_time_scale`)."""
        scale = retry_time_scale()
        return {
            "max_retries": self.retry_count_limit,
            "retry_timeout": timedelta(seconds=self.timeout_s * scale),
            "backoff": {
                "init_backoff": timedelta(seconds=self.initial_backoff_s * scale),
                "max_backoff": timedelta(seconds=self.max_backoff_s * scale),
                "base": float(self.backoff_base),
            },
        }

    def obstore_client_timeouts(self) -> dict[str, timedelta]:
        """The policy's timeouts as obstore ``client_options`` entries (on the retry clock)."""
        scale = retry_time_scale()
        return {
            "connect_timeout": timedelta(seconds=self.connect_timeout_s * scale),
            "read_timeout": timedelta(seconds=self.stall_timeout_s * scale),
            "timeout": timedelta(seconds=self.timeout_s * scale),
        }


# Test-only: the retry clock's speed (see retry_time_scale).


DEFAULT_RETRY = RetryPolicy()


def retry_policy(store: Store) -> RetryPolicy:
    """The policy :func:`open_store` opened ``store`` with (the default for any other store)."""
    policy = getattr(store, _POLICY_ATTR, None)
    return policy if isinstance(policy, RetryPolicy) else DEFAULT_RETRY


def describe_store(store: Any) -> str:
    """A short human name for ``store``, for error messages.

    The URL a store was opened with by :func:`open_store`; for another obstore-backed store its
    bucket and prefix or its folder; else its repr. A cloud store's or an ``FsspecStore``'s
    account and endpoint follow, given or taken from the environment
    (:func:`~insitubatch_nodes.io.places.place_label`): the same bucket elsewhere is another
    store.
    """
    label = getattr(store, _LABEL_ATTR, None)
    if isinstance(label, str):
        return label
    if isinstance(store, ObjectStore):
        inner = store.store
        name = type(inner).__name__
        config = getattr(inner, "config", None) or {}
        prefix = str(getattr(inner, "prefix", None) or "")
        if name == "HTTPStore":
            return str(getattr(inner, "url", "") or repr(store))
        for cls, scheme, key in (
            ("S3Store", "s3", "bucket"),
            ("GCSStore", "gs", "bucket"),
            ("AzureStore", "az", "container_name"),
        ):
            if name == cls:
                url = f"{scheme}://{config.get(key, '?')}/{prefix}".rstrip("/")
                return url + place_label(inner)
        if name == "LocalStore" and prefix:
            return str(prefix)
    return repr(store) + place_label(store)  # (an FsspecStore's endpoint: its repr lacks it)


def store_name(store: Any) -> str:
    """:func:`describe_store` of the store ``store`` names (what :func:`as_store` takes), or,
    for a name that opens no store (``"s3://b/x (endpoint ...)"``), that name; normalised
    (:func:`~insitubatch_nodes.io.places.normal_store_name`)."""
    try:
        return str(normal_store_name(describe_store(as_store(store))))
    except (OSError, TypeError, ValueError):
        if not isinstance(store, str):
            raise
        return str(normal_store_name(store))


class _CloudObjectStore(ObjectStore[Any]):
    """zarr's ``ObjectStore`` over a cloud store from :func:`open_store` (``s3://``, ``gs://``,
    ``az://``, signed or anonymous): a read that finds no credentials, or is refused with
    401/403, raises :func:`credentials_error`'s ``PermissionError`` instead of obstore's error
    (chained). Every other behaviour is zarr's."""

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        try:
            return await super().get(key, prototype, byte_range)
        except Exception as exc:
            _raise_credentials_error(self, exc)
            raise

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
        try:
            return await super().get_partial_values(prototype, key_ranges)
        except Exception as exc:
            _raise_credentials_error(self, exc)
            raise

    async def exists(self, key: str) -> bool:
        try:
            return await super().exists(key)
        except Exception as exc:
            _raise_credentials_error(self, exc)
            raise


def plain_object_store(store: Any) -> bool:
    """Whether ``store`` is zarr's own ``ObjectStore`` as :func:`open_store` makes it (a wrapper
    or subclass of anyone else's may read its objects another way)."""
    return type(store) is ObjectStore or type(store) is _CloudObjectStore


def cannot_list(store: Any) -> bool:
    """Whether ``store`` is known to answer no listing: an obstore ``HTTPStore`` (a plain web
    server answers WebDAV's ``PROPFIND`` with 405). Other stores are tried."""
    return isinstance(store, ObjectStore) and type(store.store).__name__ == "HTTPStore"


def credentials_error(store: Any, exc: BaseException) -> PermissionError | None:
    """A ``PermissionError`` that explains ``exc``, or ``None`` when ``exc`` is not about
    credentials. Only for a cloud store from :func:`open_store` (``s3://``, ``gs://``,
    ``az://``) and an obstore error that says no credentials were found (obstore then asks the
    cloud's metadata service, which is not there) or that the request was refused (401/403).
    The message names the store. Signed, it says how to read a public bucket: ``open_store(url,
    anonymous=True)``; for a 403 also that temporary credentials can expire during a run, and
    that S3 answers 403 for an absent object to credentials that may not list the bucket (a
    fill-value chunk zarr did not write, met mid-epoch). Anonymous, a refusal says the bucket
    (or that object) is not public, and to pass credentials."""
    if not isinstance(store, _CloudObjectStore):
        return None
    from obstore.exceptions import BaseError, PermissionDeniedError, UnauthenticatedError

    if not isinstance(exc, BaseError):
        return None
    name = describe_store(store)
    config = getattr(store.store, "config", None) or {}
    if str(config.get("skip_signature", "")).lower() == "true":
        if not isinstance(exc, PermissionDeniedError | UnauthenticatedError):
            return None
        return PermissionError(
            f"{name} refused an unsigned request ({type(exc).__name__}): the bucket is not "
            "public, or not this object (S3 also answers 403 for an absent object when "
            "anonymous users may not list the bucket). Open it with credentials, without "
            f"anonymous=True: open_store({name.split()[0]!r}, ...) with credential options or "
            "environment variables, and pass that store"
        )
    fix = (
        f"If the bucket is public, open it without credentials: open_store({name.split()[0]!r}, "
        "anonymous=True), and pass that store"
    )
    if isinstance(exc, PermissionDeniedError):
        return PermissionError(
            f"{name} refused the request ({type(exc).__name__}): check the credentials; "
            "temporary ones (a session token) may have expired during the run. S3 also answers "
            "403, not 404, for an absent object when the credentials may not list the bucket "
            "(no s3:ListBucket; on GCS, storage.objects.list): grant that, and absent chunks "
            f"read as the fill value, as zarr's do. {fix}"
        )
    if isinstance(exc, UnauthenticatedError):
        return PermissionError(
            f"{name} refused the request ({type(exc).__name__}): check the credentials. {fix}"
        )
    text = str(exc).lower()
    if any(marker in text for marker in _NO_CREDENTIALS_MARKERS):
        return PermissionError(
            f"no credentials found to sign requests to {name} (none in the options or the "
            f"environment, and no cloud metadata service answered). {fix}; else pass "
            "credentials (options or environment variables)"
        )
    return None


def _raise_credentials_error(store: Any, exc: BaseException) -> None:
    error = credentials_error(store, exc)
    if error is not None:
        raise error from exc


def _remember(store: Store, label: str, policy: RetryPolicy) -> Store:
    setattr(store, _LABEL_ATTR, label)
    setattr(store, _POLICY_ATTR, policy)
    return store


def _remote_options(scheme: str, options: dict[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """``options`` with the policy's retry config and client timeouts merged in."""
    if "retry_config" in options:
        raise ValueError(
            f"{scheme}:// stores take retries from retry=RetryPolicy(...), not retry_config="
        )
    given = options.get("client_options")
    if given is not None and not isinstance(given, Mapping):
        raise TypeError(
            "client_options must be a dict of obstore client options, e.g. "
            f"client_options={{'allow_http': True}}; got {given!r}"
        )
    client = dict(given or {})
    clash = sorted(k for k in _TIMEOUT_KEYS if k in client)
    if clash:
        raise ValueError(
            f"client_options {clash} are set by retry=RetryPolicy(...) (timeout_s, "
            "stall_timeout_s, connect_timeout_s); set them there"
        )
    env_prefix = _ENV_PREFIX.get(scheme)  # HTTPStore reads no environment variables
    for key in _ENV_CLIENT_KEYS if env_prefix else ():
        value = os.environ.get(f"{env_prefix}{key.upper()}")
        if value is not None and key not in client:
            client[key] = value
    client.update(policy.obstore_client_timeouts())
    endpoint = next((str(v) for k, v in options.items() if k.lower() in _ENDPOINT_KEYS), "")
    source = ""
    if not endpoint:  # obstore reads the endpoint from the environment then (places' rule)
        variable, endpoint = env_endpoint(_STORE_CLASS.get(scheme, ""))
        source = f" (from {variable})" if variable else ""
    if endpoint.lower().startswith("http://") and str(client.get("allow_http")).lower() != "true":
        raise ValueError(
            f"{scheme}:// endpoint {endpoint!r}{source} is plain HTTP, which obstore refuses at "
            "the first "
            "read ('builder error'): pass client_options={'allow_http': True}"
            + (f" (or set {env_prefix}ALLOW_HTTP=true)" if env_prefix else "")
            + ", or use an https:// endpoint"
        )
    return {**options, "client_options": client, "retry_config": policy.obstore_retry_config()}


def open_store(
    url_or_path: str | os.PathLike[str],
    *,
    read_only: bool = True,
    retry: RetryPolicy | None = None,
    anonymous: bool = False,
    **options: Any,
) -> Store:
    """Return a zarr ``Store`` for ``url_or_path``, backed by obstore.

    Accepted spellings:

    * a plain path or ``file:///abs/path`` — obstore ``LocalStore`` rooted at that folder (a
      URL's path is percent-decoded: ``Path.as_uri()`` round-trips);
    * ``memory://NAME`` — a process-wide in-memory store (same NAME, same objects);
    * ``s3://bucket/prefix`` — obstore ``S3Store``; ``options`` are passed through, e.g.
      ``endpoint=``, ``region=``, ``access_key_id=``, ``secret_access_key=``, ``session_token=``,
      ``client_options={"allow_http": True}`` (a public bucket: ``anonymous=True``);
    * ``gs://bucket/prefix`` — obstore ``GCSStore`` (options passed through);
    * ``az://container/prefix`` — obstore ``AzureStore`` (options passed through);
      a cloud prefix ends at its trailing ``/`` (``s3://b/p/`` is ``s3://b/p``); one with an
      empty, ``.`` or ``..`` path segment (``s3://b/p//q``, ``s3://b//p``: keys ``/p/...``),
      which obstore cannot address, is a ``ValueError`` saying what reads it (zarr's
      ``FsspecStore``);
    * ``https://host/path`` and ``http://host/path`` — obstore ``HTTPStore`` over a plain web
      server (any server that answers GETs with byte ranges, e.g. nginx): the only option is
      ``client_options`` (``http://`` sets ``allow_http``). HTTP cannot list a folder, so
      arrays are found by name or through consolidated metadata, never by listing.

    ``anonymous=True`` reads a public ``s3://``, ``gs://`` or ``az://`` bucket without
    credentials: requests are not signed and no credentials are looked up (obstore's
    ``skip_signature``); credential options are then refused. HTTP stores are always
    anonymous. A signed store whose first read finds no credentials, or is refused with
    401/403, raises ``PermissionError`` naming the store and suggesting ``anonymous=True``.

    ``retry`` (default ``RetryPolicy()``) bounds every read: for the remote schemes (the cloud
    ones and ``http(s)://``) it becomes obstore's ``retry_config`` and the client's
    connect/stall/request timeouts (so ``retry_config=`` and those ``client_options`` keys are
    refused: set them in the policy);
    for every scheme its ``timeout_s`` is the deadline the fetch stage puts on each
    stored-object read. Opening does no IO: a missing bucket or prefix (or missing
    credentials) is reported at first use
    (:func:`~insitubatch_nodes.open_geometries`, :func:`~insitubatch_nodes.insitu_pipeline`).

    The store is read-only unless ``read_only=False``. Any other scheme raises ``ValueError``
    naming the supported ones; passing an existing ``zarr.abc.store.Store`` is an error here
    (use :func:`as_store`, which passes stores through).
    """
    from obstore.store import AzureStore, GCSStore, HTTPStore, LocalStore, MemoryStore, S3Store

    _process.check_obstore_usable()  # a fork of a process that used obstore would hang
    _process.note_obstore_use()
    _process.tune_allocator()  # before obstore's threads allocate (see its docstring)
    if isinstance(url_or_path, Store):
        raise TypeError("open_store() takes a URL or path; a zarr Store can be used as it is")
    if retry is None:
        retry = DEFAULT_RETRY
    elif not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
    if not isinstance(anonymous, bool):
        raise TypeError(f"anonymous must be True or False, got {anonymous!r}")
    if not isinstance(read_only, bool):  # "false" would open a store read-only, silently
        raise TypeError(f"read_only must be True or False, got {read_only!r}")
    text = os.fspath(url_or_path)
    if not text:
        raise ValueError("open_store() needs a URL or a path, got an empty string")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if anonymous and (scheme in ("", "file", "memory") or len(scheme) == 1):
        raise ValueError(
            "anonymous=True applies to s3://, gs:// and az:// URLs (unsigned requests); "
            f"{text!r} is a local or in-memory store"
        )
    if len(scheme) > 1 and ("?" in text or "#" in text):
        raise ValueError(store_urls.query_refused(scheme, text))
    last = text.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    if last in _zarr_compat.METADATA_DOCUMENTS:  # a store is a folder, never its document
        raise ValueError(
            f"{text!r} names the zarr metadata document {last!r}, not a store: open the folder "
            f"it is in, {text.rstrip('/')[: -len(last)].rstrip('/')!r}"
        )
    # A Windows drive letter ("C:\\data") parses as a one-letter scheme: treat it as a path.
    if scheme == "" or len(scheme) == 1:
        return _local(LocalStore, Path(text), read_only, options, retry, given=text)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URLs must be local (file:///abs/path), got {text!r}")
        return _local(
            LocalStore, store_urls.file_path(parts.path, read_only), read_only, options, retry
        )
    if scheme == "memory":
        if options:
            raise ValueError(f"memory:// takes no options, got {sorted(options)}")
        name = (parts.netloc + parts.path).strip("/")
        with _MEMORY_LOCK:
            mem = _MEMORY_STORES.setdefault(name, MemoryStore())
        return _remember(ObjectStore(mem, read_only=read_only), f"memory://{name}", retry)
    if scheme in ("http", "https"):
        return _http(HTTPStore, scheme, text, parts, read_only, options, retry)
    bucket = parts.netloc
    if scheme in ("s3", "gs", "az") and not bucket:
        raise ValueError(store_urls.no_bucket(scheme, text, parts.path))
    classes = {"s3": S3Store, "gs": GCSStore, "az": AzureStore}
    if scheme in classes:
        prefix = store_urls.cloud_prefix(scheme, bucket, parts.path, text)
        if anonymous:
            given = sorted(k for k in ("skip_signature", *_CREDENTIAL_KEYS) if k in options)
            if given:
                raise ValueError(
                    f"anonymous=True reads without credentials; drop the options {given}"
                )
            options = {**options, "skip_signature": True}
        merged = _remote_options(scheme, options, retry)
        inner = classes[scheme](bucket, prefix=prefix, **merged)
        label = f"{scheme}://{bucket}/{prefix or ''}".rstrip("/") + place_label(inner)
        return _remember(_CloudObjectStore(inner, read_only=read_only), label, retry)
    raise ValueError(
        f"unsupported store scheme {scheme!r} in {text!r}; supported: "
        + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        + ", or a plain local path (or pass any zarr.abc.store.Store)"
    )


def _http(
    http_cls: Any,
    scheme: str,
    text: str,
    parts: Any,
    read_only: bool,
    options: dict[str, Any],
    retry: RetryPolicy,
) -> Store:
    """An ``ObjectStore`` over obstore's ``HTTPStore`` at ``text`` (the URL's path is the
    prefix of every key); labelled with the URL, its password (if any) left out."""
    if not parts.netloc:
        raise ValueError(f"{scheme}:// URLs need a host: {scheme}://HOST/path")
    extra = sorted(set(options) - {"client_options"})
    if extra:
        raise ValueError(f"{scheme}:// stores take client_options= (and retry=) only, got {extra}")
    merged = _remote_options(scheme, options, retry)
    if scheme == "http":
        merged["client_options"].setdefault("allow_http", True)
    url = text.rstrip("/")
    label = url
    if parts.password is not None:
        label = url.replace(f":{parts.password}@", ":***@", 1)
    inner = http_cls.from_url(url, **merged)
    return _remember(ObjectStore(inner, read_only=read_only), label, retry)


def _local(
    local_cls: Any,
    path: Path,
    read_only: bool,
    options: dict[str, Any],
    retry: RetryPolicy,
    given: str = "",
) -> Store:
    if options:
        raise ValueError(f"local stores take no options, got {sorted(options)}")
    path = path.expanduser().absolute()
    if read_only and not path.is_dir():
        why = "the folder does not exist"
        if path.exists():  # (a zipped store, say: zarr reads one through its ZipStore)
            why = "it is a file, not a folder: pass zarr.storage.ZipStore(path, mode='r') for a zip"
        elif _URL_WITHOUT_COLON.match(given):  # "s3//bucket/x" is a relative path
            why += f"; for a URL, write its colon: {given.replace('//', '://', 1)!r}"
        raise FileNotFoundError(f"no zarr store at {str(path)!r}: {why}")
    store = ObjectStore(local_cls(path, mkdir=not read_only), read_only=read_only)
    return _remember(store, str(path), retry)


#: a URL whose scheme lost its colon ("s3//bucket/x"), which reads as a relative path
_URL_WITHOUT_COLON = re.compile(r"(?i)(s3|gs|gcs|az|abfss?|https?|file)//")


def as_store(store: StoreLike, **options: Any) -> Store:
    """A zarr ``Store`` as it is (opened first, as zarr opens a store handed to it: a
    ``ZipStore`` is made unopened), or :func:`open_store` of a URL/path (read-only).

    ``options`` (``retry=`` included) apply to a URL or path only. Every entry point of the
    package passes its store through here, before its first read, which is when the allocator
    is tuned (:func:`~insitubatch_nodes._process.tune_allocator`: once per process) and zarr's IO
    loop started with its wakeups watched (:func:`~insitubatch_nodes._process.watch_wakeups`).

    An xarray ``Dataset`` opened from zarr (``xr.open_zarr(path_or_store)``) stands for the
    store it was opened from: the path or URL xarray recorded (``ds.encoding["source"]``), or
    the zarr store beneath it; one opened any other way raises ``TypeError`` saying what to
    pass, and one that is a selection of its store (``ds.isel(time=slice(0, 4))``, a
    transpose: a data variable shaped otherwise than its stored array) raises ``ValueError``
    (the store's arrays are read as stored, whatever the Dataset shows), as does one changed
    after opening (``ds * 2``, ``roll``: :mod:`~insitubatch_nodes.io.datasets`). A
    :class:`~insitubatch_nodes.io.collection.Collection` stands for the store its members are
    read through (``collection.store``), as it does for ``insitu_pipeline``."""
    dataset = store if is_xarray_dataset(store) else None
    if dataset is not None:
        store = dataset_store(dataset)
    if isinstance(store, zarr.Group | zarr.Array):
        store = _node_store(store)
    if _is_collection(store):
        store = cast(Any, store).store
    if isinstance(store, Store):
        if options:
            raise ValueError("store options apply to a URL or path, not to an opened Store")
        _process.tune_allocator()  # before obstore's threads allocate (see its docstring)
        opened = _zarr_compat.opened(store)
    else:
        opened = open_store(cast("str | os.PathLike[str]", store), **options)
    _zarr_compat.io_loop()  # started here, its wakeups watched before the first read
    if dataset is not None:
        refuse_changed(dataset, opened, describe_store(opened))
    return opened


def _node_store(node: zarr.Group | zarr.Array) -> Store:
    """The store a zarr root group was opened from; ``TypeError`` saying what to pass for a
    group below the root or an array (their paths are relative to the store's root)."""
    example = f"{node.path}/t2m" if isinstance(node, zarr.Group) else node.path
    if isinstance(node, zarr.Group) and not node.path:
        return node.store
    what = f"group {node.path!r} of" if isinstance(node, zarr.Group) else "an array of"
    raise TypeError(
        f"a zarr {type(node).__name__} is not a store ({what} {node.store}): pass its store "
        f"(node.store, or the path or URL it was opened from) and name the arrays by their path "
        f"from the store's root, e.g. open_geometries(node.store, [{example!r}])"
    )


def _is_collection(obj: Any) -> bool:
    # (by its type's name: io.collection imports this module)
    return type(obj).__name__ == "Collection" and type(obj).__module__.startswith(
        "insitubatch_nodes."
    )
