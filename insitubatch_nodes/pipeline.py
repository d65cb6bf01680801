"""One call that composes the five stages into a training pipeline.

``ReadPlanNode -> AsyncChunkFetchNode -> ChunkPoolNode -> GatherNode -> PrefetcherNode``; the
result is a ``torchdata.nodes.BaseNode`` to iterate directly or wrap in
``torchdata.nodes.Loader``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zarr.abc.store import Store

from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.fetch import AsyncChunkFetchNode
from insitubatch_nodes.gather import GatherNode
from insitubatch_nodes.geometry import ArrayGeometry, check_arrays_in_store, open_geometries
from insitubatch_nodes.plan import ReadPlanNode
from insitubatch_nodes.pool import ChunkPoolNode
from insitubatch_nodes.prefetch import PrefetcherNode
from insitubatch_nodes.residency import ChunkPool, SlotBacking, working_set_bytes
from insitubatch_nodes.splits import SplitManifest
from insitubatch_nodes.stores import RetryPolicy, as_store

__all__ = ["InSituPipeline", "PipelineStages", "choose_schedule", "insitu_pipeline"]

log = logging.getLogger(__name__)


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

    def start_state(self, epoch: int) -> dict[str, Any]:
        """The state of this pipeline before the first batch of ``epoch`` (nothing is started).

        Every stage above the read plan reports its source's state as ``{"source": ...}``, so
        this is the plan's state wrapped once per stage.
        """
        plan = self.stages.plan
        state: dict[str, Any] = {"epoch": int(epoch), "batches_emitted": 0, "config": plan.config()}
        for _ in ("fetch", "resident", "gather", "prefetch"):
            state = {"source": state}
        return state

    def stats(self) -> dict[str, int]:
        """The pool's counters (hits, misses, GETs, bytes fetched, evictions, peaks) and the
        memory this pipeline holds outside the pool's budget, in bytes:
        ``batch_buffer_bytes`` (reusable batch buffers, lent out or idle — the prefetch queue's
        batches live in them — plus gather scratch), ``decode_scratch_bytes`` (per decode
        thread) and their sum ``outside_pool_bytes``."""
        out = self.stages.pool.stats.as_dict()
        out["batch_buffer_bytes"] = self.stages.gather.buffer_bytes
        out["decode_scratch_bytes"] = self.stages.fetch.scratch_bytes
        out["outside_pool_bytes"] = out["batch_buffer_bytes"] + out["decode_scratch_bytes"]
        return out


def _auto_cap_bytes() -> int:
    """The most an automatic budget takes before it trades re-reads for memory: 1/4 of RAM."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 * 2**30


def choose_schedule(
    plan: ReadPlanNode, pool: ChunkPool, geoms: Mapping[str, ArrayGeometry]
) -> None:
    """Pick how long chunks stay pinned, from the budget, and check the budget's floor.

    Read-once (each chunk pinned from its first reading batch to its last) is the default. A
    shifted view can make that schedule hold a large part of the split — chunk ``c + 1`` is read
    by the last anchors of chunk ``c`` and again, much later, in its own block. When the budget
    cannot hold it (an explicit budget below the read-once floor, or an automatic one whose
    read-once floor is above a quarter of RAM), chunks are instead released after a block without
    reads and fetched again at their next use: bounded memory for some re-reads.
    """
    plan.pin_gap = None
    read_once = working_set_bytes(plan.epoch_plan(0), geoms)[0]
    if pool.fits(read_once) and (not pool.auto or read_once <= _auto_cap_bytes()):
        pool.ensure_floor(read_once)
        return
    plan.pin_gap = plan.block_batches
    bounded = working_set_bytes(plan.epoch_plan(0), geoms)[0]
    if bounded >= read_once:  # releasing between uses saves nothing: keep read-once
        plan.pin_gap = None
        pool.ensure_floor(read_once)
        return
    if pool.auto:
        log.warning(
            "insitubatch_nodes: reading each chunk once per epoch would pin %.1f GiB (over a "
            "quarter of RAM); chunks idle for a block are released and re-read instead (floor "
            "%.1f GiB). Pass cache_budget_bytes to choose.",
            read_once / 2**30,
            bounded / 2**30,
        )
    pool.ensure_floor(bounded, read_once_bytes=read_once)


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
    retry: RetryPolicy | None = None,
) -> InSituPipeline:
    """Build the pipeline that trains on ``split`` of ``manifest`` from ``store``.

    ``variables`` is a list of array names (each becomes a label) or ``{label: view}`` with
    :class:`ArrayGeometry` views (e.g. ``{"x": g, "y": g.shift(1)}``). Batches are
    :class:`~insitubatch_nodes.batch.Batch` es of numpy arrays ``(batch, *inner_shape)``.

    ``cache_budget_bytes=None`` sizes the pool to the working set (each chunk read once per
    epoch); a larger budget keeps drained chunks for later epochs; a smaller one raises
    ``ValueError`` stating the floor. ``max_inflight`` bounds concurrent stored-object GETs;
    ``decode_threads`` sizes the shared decode pool (default: one per core).

    ``retry`` (a :class:`~insitubatch_nodes.stores.RetryPolicy`) bounds every read: with a URL
    or path it is what the store is opened with; with an opened ``Store`` its ``timeout_s`` is
    the deadline of each stored-object GET (retries are then the store's own). ``None`` uses
    the policy the store was opened with (the default one for any other store). Construction
    checks that the store holds every array read (one metadata read per array) and raises
    ``FileNotFoundError`` naming the array and the store when it does not.
    """
    # -- the store, its retry policy, and a check that it holds the arrays --------------------
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
    zstore = (
        as_store(store)
        if retry is None or isinstance(store, Store)
        else as_store(store, retry=retry)
    )
    if isinstance(variables, Mapping):  # views may come from elsewhere: check this store
        views = {label: v for label, v in variables.items() if isinstance(v, ArrayGeometry)}
        check_arrays_in_store(zstore, {v.path: v.base for v in views.values()})
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
    choose_schedule(plan, pool, geoms)  # fails fast, here, when the budget is too small
    fetch = AsyncChunkFetchNode(
        plan,
        zstore,
        geoms,
        pool,
        max_inflight=max_inflight,
        decode_threads=decode_threads,
        retry=retry,
    )
    resident = ChunkPoolNode(fetch)
    gather = GatherNode(resident, labels, batch_size, batch_transforms)
    return InSituPipeline(
        gather,
        prefetch_depth,
        {"plan": plan, "fetch": fetch, "resident": resident, "pool": pool},
    )
