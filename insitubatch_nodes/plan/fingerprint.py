"""What identifies the dataset a read plan reads, in its saved states: the manifest and the
plan's views, hashed (a state restores only onto the same dataset, or says which views it was
saved with); and the checks of a saved state's anchors (stride, missing steps) and elastic
cuts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.ledger import Stage
from insitubatch_nodes.plan.patches import patch_spec
from insitubatch_nodes.plan.splits import SplitManifest

__all__ = [
    "check_cuts",
    "check_same_anchors",
    "dataset_hash",
    "readable_views",
    "stratifying_tiles",
    "views_list",
]


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


def stratifying_tiles(views: Mapping[str, ArrayGeometry]) -> list[int] | None:
    """The tiles a patched plan stratifies its windows and regions by — the first patched
    view's, in the order ``views`` are given — where patched arrays are tiled differently
    (``None`` otherwise). :func:`views_list` sorts the views, so it cannot say whose."""
    spec = patch_spec(views)
    tiles = {g.patch.tile for g in views.values() if g.patch is not None}
    return None if spec is None or len(tiles) < 2 else list(spec.tile)


def readable_views(views: Sequence[Sequence[Any]]) -> str:
    """A state's ``views`` entry as ``[x[0]: t2m -1, x[1]: t2m +0, y: t2m +1]``."""
    return "[" + ", ".join(f"{v[0]}: {v[1] or '/'} {int(v[2]):+d}" for v in views) + "]"


def check_same_anchors(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless a saved read-plan config (``saved``) draws its anchors as
    this plan's (``mine``) does: the same ``stride`` and the same missing steps (a hash of the
    steps dropped by ``missing=``, ``missing_objects="drop"`` and the time checks; absent when
    nothing was checked)."""
    if saved.get("stride", 1) != mine.get("stride", 1):  # absent = the default
        raise ValueError(
            f"cannot restore this read-plan state: its stride differs (saved "
            f"{saved.get('stride', 1)!r}, this pipeline {mine.get('stride', 1)!r}); "
            "the anchors a plan draws depend on it"
        )
    theirs, ours = saved.get("missing_steps"), mine.get("missing_steps")
    if theirs == ours:
        return
    checked = {True: "steps checked", False: "no steps checked"}
    if (theirs is None) != (ours is None):
        how = f"saved with {checked[theirs is not None]}, built with {checked[ours is not None]}"
    else:
        how = f"fingerprint {theirs} saved, {ours} now"
    raise ValueError(
        f"cannot restore this read-plan state: the steps dropped as missing differ ({how}): "
        "the missing= list, missing_objects='drop' (a stored object absent then and present "
        "now, or the reverse), or the times' gaps and NaTs changed since it was saved, and the "
        "anchors a plan draws depend on them; build the pipeline with the saved run's missing= "
        "and missing_objects= over the same store, or start this run's data order afresh "
        "(without this state)"
    )


def check_cuts(cuts: Any, emitted: int) -> tuple[Stage, ...]:
    """The ``resumed`` entry of a read-plan state as ``((world_size, batches), ...)``."""
    out: list[Stage] = []
    try:
        for w, k in cuts:
            out.append((int(w), int(k)))
    except (TypeError, ValueError):
        raise ValueError(f"not a read-plan state: resumed={cuts!r}") from None
    batches = [k for _, k in out]
    if (
        any(w < 1 for w, _ in out)
        or batches != sorted(set(batches))
        or any(k < 1 or k > emitted for k in batches)
    ):
        raise ValueError(
            f"not a read-plan state: resumed={cuts!r} must list (world_size >= 1, batches) "
            f"cuts with batches rising from 1 to at most batches_emitted={emitted}"
        )
    return tuple(out)
