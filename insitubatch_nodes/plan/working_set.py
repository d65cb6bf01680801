"""What one drawn epoch holds in slot bytes: a slot's geometry, the working-set floor, the
bytes of every chunk it reads.

:func:`slot_geometries` says what one slot of each array holds (a whole chunk, one stored tile
of a patched array, or the indices a selection keeps); :func:`working_set_bytes` is an epoch
plan's floor (the most slot memory live at once plus one block of read-ahead, at most every
chunk it reads) and :func:`read_bytes` the bytes of every chunk it reads, each once. Pure
numpy over an :class:`~insitubatch_nodes.plan.ledger.EpochPlan`: no pool, no threads. The
schedule (:mod:`~insitubatch_nodes.plan.schedule`) bounds these over every epoch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held, held_geometry
from insitubatch_nodes.plan.ledger import EpochPlan
from insitubatch_nodes.plan.patches import unit_geometry

__all__ = ["read_bytes", "slot_geometries", "working_set_bytes"]


def slot_geometries(
    views: Mapping[str, ArrayGeometry], held: Mapping[str, Held] | None = None
) -> dict[str, ArrayGeometry]:
    """What one slot of each array holds, by path: a whole chunk, one stored tile of an array
    read through patched views, or the indices ``held`` says its slots keep (before any chunk
    transform)."""
    out: dict[str, ArrayGeometry] = {}
    for g in views.values():
        if g.patch is not None:
            unit = unit_geometry(g)
            out[g.path] = held_geometry(unit, held[g.path]) if held and g.path in held else unit
        elif held and g.path in held:
            out[g.path] = held_geometry(g.base, held[g.path])
        else:
            out[g.path] = g.base
    return out


def working_set_bytes(plan: EpochPlan, geoms: Mapping[str, ArrayGeometry]) -> tuple[int, int]:
    """``(floor, read_ahead)`` in bytes for one epoch plan.

    ``read_ahead`` is the most slot memory one block's first reads take; the fetcher may run at
    most that far ahead of the batch being gathered. ``floor`` is the most memory live at once
    (chunks between their first and last reading batch) plus ``read_ahead``, at most every chunk
    the plan reads (a slot each): the smallest budget with which the pipeline never waits on
    itself.
    """
    n = plan.n_batches - plan.first_batch
    if n == 0:
        return 0, 0
    got = np.zeros(n, dtype=np.int64)  # bytes each batch fetches
    gone = np.zeros(n, dtype=np.int64)  # bytes each batch releases
    for ledger in plan.ledgers:
        nbytes = sum(geoms[path].chunk_nbytes for path in ledger.paths)
        got += np.diff(ledger.fetch_ptr) * nbytes
        gone += np.diff(ledger.release_ptr) * nbytes
    live = np.cumsum(got) - np.concatenate([[0], np.cumsum(gone)[:-1]])
    peak = int(live.max(initial=0))
    first_rows = np.arange(n, dtype=np.int64) * plan.batch_size
    blocks = plan._block_of_row[first_rows]
    per_block = np.bincount(blocks, weights=got, minlength=max(1, plan.n_blocks))
    read_ahead = int(per_block.max(initial=0))
    return min(peak + read_ahead, read_bytes(plan, geoms)), read_ahead


def read_bytes(plan: EpochPlan, geoms: Mapping[str, ArrayGeometry]) -> int:
    """The slot bytes of every chunk ``plan`` reads, each once."""
    return sum(
        ledger.n_chunks * sum(geoms[p].chunk_nbytes for p in ledger.paths)
        for ledger in plan.ledgers
    )
