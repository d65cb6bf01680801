"""What identifies the dataset a read plan reads, in its saved states: the manifest and the
plan's views, hashed (a state restores only onto the same dataset, or says which views it was
saved with)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.splits import SplitManifest

__all__ = ["dataset_hash", "readable_views", "views_list"]


def dataset_hash(manifest: SplitManifest, views: Sequence[Sequence[Any]]) -> str:
    """The fingerprint's ``dataset``: the manifest and the plan's views (sorted
    ``(label, path, offset, samples_per_chunk[, patch])``)."""
    return hashlib.sha256(json.dumps([manifest.fingerprint(), views]).encode()).hexdigest()[:16]


def views_list(views: Mapping[str, ArrayGeometry]) -> list[list[Any]]:
    """The plan's views as the fingerprint lists them: sorted ``[label, path, offset,
    samples_per_chunk(, patch)]``."""
    return sorted(
        [k, g.path, g.offset, g.samples_per_chunk]
        + ([] if g.patch is None else [g.patch.describe()])
        for k, g in views.items()
    )


def readable_views(views: Sequence[Sequence[Any]]) -> str:
    """A state's ``views`` entry as ``[x[0]: t2m -1, x[1]: t2m +0, y: t2m +1]``."""
    return "[" + ", ".join(f"{v[0]}: {v[1] or '/'} {int(v[2]):+d}" for v in views) + "]"
