"""Which zarr metadata documents of a store cannot be read, and why: the diagnosis behind
:class:`~insitubatch_nodes.errors.CorruptMetadataError` and
:class:`~insitubatch_nodes.errors.UnsupportedMetadataError` (slow, for an error path only).

A document that is not JSON, that zarr refuses to open its node from, that names a codec or
data type nothing installed provides, or whose consolidated metadata zarr cannot parse
(zarr's ``open_group`` reports that as "no group found") is reported with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zarr

from insitubatch_nodes.io._zarr_compat import (
    METADATA_DOCUMENTS,
    open_consolidated,
    unsupported_chunk_grid,
)

__all__ = ["UNSUPPORTED", "unreadable_metadata", "unsupported_reason"]

UNSUPPORTED = "needs a "


#: how :func:`unsupported_reason` starts the reason for a chunk grid zarr does not open here
CHUNK_GRID = f"{UNSUPPORTED}chunk grid zarr does not open here: "


def unsupported_reason(exc: BaseException) -> str | None:
    """The reason for zarr's ``exc`` when it says the document is valid but names what this
    Python does not read: a codec or data type that is not installed, or a chunk grid zarr
    opens only with an option (a rectilinear grid, zarr 3.2 on) or not at all (zarr 3.1)."""
    if type(exc).__name__ == "UnknownCodecError":  # numcodecs' (v2) and zarr's (v3)
        return f"{UNSUPPORTED}codec that is not installed ({exc})"
    if str(exc).startswith("No Zarr data type found"):
        return f"{UNSUPPORTED}data type that is not installed ({exc})"
    grid = unsupported_chunk_grid(exc)
    if grid is not None:
        return f"{CHUNK_GRID}{grid}"
    return None


class _Consolidated(ValueError):
    pass


def _consolidated_reason(store: Any, node: str, zarr_format: int) -> None:
    try:
        open_consolidated(store, node, zarr_format)
    except Exception as exc:
        unsupported = unsupported_reason(exc)  # valid, and naming what is not read here
        raise _Consolidated(
            f"{unsupported} (in its consolidated metadata)"
            if unsupported is not None
            else f"holds consolidated metadata zarr cannot read ({type(exc).__name__}: {exc}); "
            "zarr.consolidate_metadata(store) writes it again"
        ) from exc


def unreadable_metadata(store: Any, keys: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``(key, reason)`` for each metadata document zarr cannot read (slow: for diagnosis only).

    ``keys`` are the documents to check; ``None`` lists the whole store for them. A document
    that is missing is skipped; one that is not JSON, or that zarr refuses to open the node
    from, is reported with the reason.
    """
    import json

    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    async def listed() -> list[str]:
        return [k async for k in store.list_prefix("")]

    if keys is None:
        try:
            keys = sorted(k for k in sync(listed()) if k.rsplit("/", 1)[-1] in METADATA_DOCUMENTS)
        except Exception:  # a store that cannot list (HTTP): the root's documents
            keys = sorted(METADATA_DOCUMENTS)
    prototype = default_buffer_prototype()
    docs: dict[str, Any] = {}
    bad: list[tuple[str, str]] = []
    for key in keys:
        buf = sync(store.get(key, prototype=prototype))
        if buf is None:
            continue
        try:
            docs[key] = json.loads(buf.to_bytes())
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            bad.append((key, f"is not valid JSON ({exc})"))
    if bad:  # a node fails to open when any of its documents is not JSON: name only those
        return bad
    for key, doc in docs.items():
        node, _, name = key.rpartition("/")
        try:
            if name == "zarr.json":
                kind = doc.get("node_type") if isinstance(doc, dict) else None
                if kind == "array":
                    zarr.open_array(store=store, path=node, mode="r", zarr_format=3)
                elif kind == "group":
                    zarr.open_group(
                        store=store, path=node, mode="r", zarr_format=3, use_consolidated=False
                    )
                    if doc.get("consolidated_metadata") is not None:
                        _consolidated_reason(store, node, 3)
                else:
                    bad.append((key, f"has no valid node_type ('array' or 'group'): {kind!r}"))
            elif name == ".zarray":
                zarr.open_array(store=store, path=node, mode="r", zarr_format=2)
            elif name == ".zgroup":
                zarr.open_group(
                    store=store, path=node, mode="r", zarr_format=2, use_consolidated=False
                )
            elif not isinstance(doc, dict):
                bad.append((key, f"is not a JSON object ({type(doc).__name__})"))
            elif name == ".zmetadata":
                _consolidated_reason(store, node, 2)
        except FileNotFoundError:
            continue
        except Exception as exc:
            reason = unsupported_reason(exc)  # valid, but names what is not installed
            if reason is None and isinstance(exc, _Consolidated):
                reason = str(exc)
            elif reason is None:
                reason = f"is not valid zarr metadata ({type(exc).__name__}: {exc})"
            bad.append((key, reason))
    return bad
