"""What a store URL's parts name, checked where :func:`~insitubatch_nodes.io.stores.open_store`
parses the URL: a ``file://`` URL's folder, a cloud URL's key prefix, and why a URL with a
query string or a fragment is refused. Pure functions of the URL's text (the file system aside:
:func:`file_path` looks for the folder)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

__all__ = ["cloud_prefix", "file_path", "query_refused"]

# The Python package fsspec reads each cloud scheme with (zarr's FsspecStore).
_FSSPEC_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs"}


def cloud_prefix(scheme: str, bucket: str, path: str, text: str) -> str | None:
    """The key prefix a cloud URL's ``path`` names (``None``: the bucket's root); trailing
    ``/`` end it, as zarr's ``FsspecStore`` reads them.

    ``ValueError`` for a prefix with an empty, ``.`` or ``..`` path segment (``p//q``,
    ``//p``: keys ``/p/...``), legal in the cloud but not in obstore's paths, which refuse such
    a key or drop its empty segments and read other keys; the message says what reads it."""
    prefix = path.rstrip("/")[1:]  # [1:]: the '/' after the bucket
    bad = [s for s in prefix.split("/") if s in ("", ".", "..")] if prefix else []
    if not bad:
        return prefix or None
    what = "an empty path segment '//'" if "" in bad else f"a path segment {bad[0]!r}"
    if prefix.startswith("/"):
        what += " after the bucket (its keys start with '/')"
    meant = f"{scheme}://{bucket}/{prefix.lstrip('/')}"
    raise ValueError(
        f"{text!r}: the key prefix {prefix!r} has {what}, and obstore cannot address such keys "
        "(its paths have no empty, '.' or '..' segments: it refuses them, or reads the keys "
        "without the empty segments)"
        + (f"; if you meant {meant!r}, write that" if prefix.startswith("/") else "")
        + ". Copy the objects to a prefix without such a segment, or pass a zarr store that "
        "reads any key instead of the URL: zarr.storage.FsspecStore.from_url("
        f"{text!r}, storage_options={{...}}, read_only=True) (needs {_FSSPEC_PACKAGES[scheme]})"
    )


def query_refused(scheme: str, text: str) -> str:
    """Why a store URL with a query string or a fragment is refused: the store is a prefix
    of keys, so ``?versionId=...``, a signed URL's ``?X-Amz-...`` or ``#...`` would be dropped
    silently (the newest objects read instead of a version, say)."""
    cut = min(i for i in (text.find("?"), text.find("#")) if i >= 0)
    if scheme == "file":
        hint = (
            "percent-encode '?' and '#' in a folder's name (%3F, %23: Path.as_uri() does), "
            "or pass the plain path"
        )
    elif scheme in ("http", "https"):
        hint = "a web server's store is the URL's path; headers go in client_options"
    else:
        hint = (
            "give options as keywords of open_store(); a prefix with '?' or '#' in it cannot be "
            "spelled in a URL: open the folder above it and name the arrays from there"
        )
    return (
        f"{scheme}:// store URLs take no query string or fragment: {text[cut:]!r} in {text!r} "
        f"would be ignored (the store would be {text[:cut]!r}, its objects as they are now); "
        f"{hint}"
    )


def file_path(path: str, read_only: bool) -> Path:
    """The folder a ``file://`` URL's path names: percent-decoded (RFC 8089; what
    ``Path.as_uri()`` writes and obstore's own ``LocalStore.from_url`` reads), so ``a%20b`` is
    the folder ``a b``. A folder whose name holds a literal ``%`` escape, opened read-only by its
    undecoded spelling (as before decoding), is still found when the decoded one does not
    exist."""
    decoded = Path(unquote(path))
    if read_only and str(decoded) != path and not decoded.is_dir() and Path(path).is_dir():
        return Path(path)
    return decoded


def no_bucket(scheme: str, text: str, path: str) -> str:
    """The refusal of a cloud URL without a bucket; ``s3:/bucket/x`` (one slash) is told to
    write two."""
    if path.strip("/") and not text.split(":", 1)[1].startswith("//"):
        return (
            f"{text!r} has one slash after '{scheme}:': write two slashes, "
            f"{scheme}://{path.lstrip('/')}"
        )
    return f"{scheme}:// URLs need a bucket: {scheme}://BUCKET/optional/prefix"
