"""One call that composes the five stages into a training pipeline.

``ReadPlanNode -> AsyncChunkFetchNode -> ChunkPoolNode -> GatherNode -> PrefetcherNode``; the
result is a ``torchdata.nodes.BaseNode`` to iterate directly or wrap in
``torchdata.nodes.Loader``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zarr.abc.store import Store

from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.fetch import AsyncChunkFetchNode
from insitubatch_nodes.gather import GatherNode
from insitubatch_nodes.geometry import ArrayGeometry, open_geometries
from insitubatch_nodes.plan import ReadPlanNode
from insitubatch_nodes.pool import ChunkPool, ChunkPoolNode, SlotBacking, working_set_bytes
from insitubatch_nodes.prefetch import PrefetcherNode
from insitubatch_nodes.splits import SplitManifest
from insitubatch_nodes.stores import as_store

__all__ = ["InSituPipeline", "PipelineStages", "insitu_pipeline"]


@dataclass(frozen=True)
class PipelineStages:
    """The five stages of one pipeline, top-down, plus the pool they share."""

    plan: ReadPlanNode
    fetch: AsyncChunkFetchNode
    resident: ChunkPoolNode
    gather: GatherNode
    prefetch: PrefetcherNode[Batch]
    pool: ChunkPool


class InSituPipeline(PrefetcherNode[Batch]):
    """The root node :func:`insitu_pipeline` returns: a ``PrefetcherNode`` that knows its stages."""

    def __init__(self, gather: GatherNode, prefetch_depth: int, stages: dict[str, Any]) -> None:
        super().__init__(gather, prefetch_depth)
        self.stages = PipelineStages(prefetch=self, gather=gather, **stages)

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return len(self.stages.plan)

    def stats(self) -> dict[str, int]:
        """The pool's counters (hits, misses, GETs, bytes fetched, evictions, peaks)."""
        return self.stages.pool.stats.as_dict()


def insitu_pipeline(
    store: Store | str | os.PathLike[str],
    manifest: SplitManifest,
    variables: Sequence[str] | Mapping[str, ArrayGeometry],
    *,
    split: str = "train",
    batch_size: int = 32,
    block_chunks: int = 16,
    shuffle: bool = True,
    seed: int = 0,
    max_inflight: int = 32,
    prefetch_depth: int = 2,
    cache_budget_bytes: int | None = None,
    decode_threads: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    batch_transforms: Sequence[BatchTransform] = (),
    backing: SlotBacking | None = None,
) -> InSituPipeline:
    """Build the pipeline that trains on ``split`` of ``manifest`` from ``store``.

    ``variables`` is a list of array names (each becomes a label) or ``{label: view}`` with
    :class:`ArrayGeometry` views (e.g. ``{"x": g, "y": g.shift(1)}``). Batches are
    :class:`~insitubatch_nodes.batch.Batch` es of numpy arrays ``(batch, *inner_shape)``.

    ``cache_budget_bytes=None`` sizes the pool to the working set (each chunk read once per
    epoch); a larger budget keeps drained chunks for later epochs; a smaller one raises
    ``ValueError`` stating the floor. ``max_inflight`` bounds concurrent stored-object GETs;
    ``decode_threads`` sizes the shared decode pool (default: one per core).
    """
    zstore = as_store(store)
    if isinstance(variables, Mapping):
        labels = dict(variables)
    else:
        names = [variables] if isinstance(variables, str) else list(variables)
        labels = dict(open_geometries(zstore, names))
    if not labels:
        raise ValueError("variables is empty: name at least one array to train on")
    geoms: dict[str, ArrayGeometry] = {}
    for label, view in labels.items():
        if not isinstance(view, ArrayGeometry):
            raise TypeError(f"variables[{label!r}] must be an ArrayGeometry view, got {view!r}")
        base = geoms.setdefault(view.path, view.base)
        if base != view.base:
            raise ValueError(f"two views of {view.path!r} disagree about its geometry")

    plan = ReadPlanNode(
        manifest,
        labels,
        split=split,
        batch_size=batch_size,
        block_chunks=block_chunks,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )
    pool = ChunkPool(cache_budget_bytes, backing=backing)
    pool.ensure_floor(working_set_bytes(plan.epoch_plan(0), geoms)[0])  # fail fast, here
    fetch = AsyncChunkFetchNode(
        plan, zstore, geoms, pool, max_inflight=max_inflight, decode_threads=decode_threads
    )
    resident = ChunkPoolNode(fetch, pool)
    gather = GatherNode(resident, labels, batch_size, batch_transforms)
    return InSituPipeline(
        gather,
        prefetch_depth,
        {"plan": plan, "fetch": fetch, "resident": resident, "pool": pool},
    )
