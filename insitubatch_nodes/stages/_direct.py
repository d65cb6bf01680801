"""When the fetch stage decodes rows straight into batches, and into which label's rows.

At one sample per chunk a chunk read by a single row need not pass through the pool: its stored
object is decoded straight into that row of the graph's batch buffers (see
:mod:`insitubatch_nodes.stages.fetch`). These two decisions are pure functions of the epoch
plan, the pool and the batch buffers; the fetch stage asks them once per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held
from insitubatch_nodes.plan.ledger import ChunkLedger, EpochPlan
from insitubatch_nodes.plan.schedule import kept_bytes
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages.buffers import BatchBuffers
from insitubatch_nodes.transforms import ChunkTransforms

__all__ = ["direct_allowed", "direct_labels"]


def direct_allowed(
    plan: EpochPlan,
    pool: ChunkPool,
    buffers: BatchBuffers | None,
    direct: bool | None,
    slot_geoms: Mapping[str, ArrayGeometry],
    keep_room: int | None = None,
) -> bool:
    """Whether rows may be decoded straight into batches this epoch: there are batch buffers,
    ``direct`` does not forbid it, no persistent cache wants the chunks kept, and either
    ``direct=True`` or the schedule does not keep the epoch's chunks for the next one
    (:func:`~insitubatch_nodes.plan.schedule.kept_bytes`: they do not fit the budget, or a
    sixteenth of RAM for the automatic one, nor ``keep_room``, the room the build's memory
    rule leaves an automatic budget's slots, as :func:`~insitubatch_nodes.stages._admit.
    epoch_floor` decides)."""
    if buffers is None or direct is False:
        return False
    cache = pool.cache
    if cache is not None and cache.persistent:
        return False
    if direct:
        return True
    kept = kept_bytes(plan, slot_geoms, None if pool.auto else pool.budget_bytes)
    return kept is None or (pool.auto and keep_room is not None and kept > keep_room)


def direct_labels(
    plan: EpochPlan,
    ledger: ChunkLedger,
    buffers: BatchBuffers,
    geoms: Mapping[str, ArrayGeometry],
    transforms: ChunkTransforms,
    held: Mapping[str, Held],
) -> dict[str, dict[int, str]] | None:
    """``{path: {offset: label}}`` when ``ledger``'s single-use chunks can be decoded straight
    into the batch arrays: one sample per chunk, each view of an array (each offset) read by
    exactly one label (whose batch buffer row has the shape and dtype of what the array's
    slots hold: ``geoms`` maps a path to that), no chunk transforms. A selected view is
    decoded straight in when it selects exactly what the slots hold (``held``, see
    :mod:`~insitubatch_nodes.io.selection`), in that order. A chunk read by one row is then
    read by one view, whose offset tells the label. ``None`` otherwise."""
    if (
        ledger.windows is not None  # a patched array: rows are windows of tiles
        or ledger.samples_per_chunk != 1
        or len(set(ledger.offsets)) != len(ledger.offsets)
    ):
        return None
    lent = buffers.views
    strided = buffers.layout.strided_parts()  # channels last: a row is not contiguous
    out: dict[str, dict[int, str]] = {}
    for label, view in plan.views.items():
        if view.path not in ledger.paths:
            continue
        geom = geoms[view.path]
        mine = lent.get(label)
        if (
            transforms.active(view.path)
            or mine is None
            or label in strided
            or mine.path != view.path
            or mine.offset != view.offset
            or not _holds_exactly(mine, held.get(view.path))
            or mine.inner_shape != geom.inner_shape
            or mine.dtype != geom.dtype
        ):
            return None
        out.setdefault(view.path, {})[view.offset] = label
    return out if len(out) == len(ledger.paths) else None


def _holds_exactly(view: ArrayGeometry, held: Held | None) -> bool:
    """Whether ``view`` selects exactly what slots holding ``held`` hold, in that order (no
    axis dropped): a row of it is then laid out as a slot's row."""
    if view.select is None:
        return held is None
    if held is None:
        return False
    return all(
        not isinstance(key, int) and key == kept
        for key, kept in zip(view.select.keys, held, strict=True)
    )
