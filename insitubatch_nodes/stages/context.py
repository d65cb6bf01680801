"""What the stages of one graph share, made once and handed to each stage at construction.

A graph is ``ReadPlanNode -> AsyncChunkFetchNode -> ChunkPoolNode -> GatherNode ->
PrefetcherNode``. Its stages share facts and objects that none of them owns alone: the read
plan and its views, the batch size and the rank, the :class:`~insitubatch_nodes.pool.ChunkPool`,
the chunk transforms, the fetch options, the epoch report's recorder and the batch buffers (the
gather stage fills them, the fetch stage decodes rows straight into them). One call makes them
all, :meth:`StageContext.create`, and every stage receives the result::

    ctx = StageContext.create(plan, pool, options=FetchOptions(max_inflight=8))
    fetch = AsyncChunkFetchNode(plan, store, context=ctx)
    resident = ChunkPoolNode(fetch, context=ctx)
    gather = GatherNode(resident, context=ctx)
    root = PrefetcherNode(gather, context=ctx)

That is what :func:`~insitubatch_nodes.insitu_pipeline` does, so a graph composed by hand is
the builder's graph. No stage looks for another: what one needs from the rest is here.

The context also knows the stages that hold something (pins, a batch lent downstream, the
cache directory's lock) or wait on something: each registers itself when it is built.
:meth:`StageContext.close` and :meth:`StageContext.interrupt` reach every one of them, whatever
plain ``torchdata`` node (a ``Mapper``, a ``Batcher``) sits between two stages.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from insitubatch_nodes import _runtime
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held, held_by_path, held_geometry
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan.patches import patch_spec, region_count, unit_geometry
from insitubatch_nodes.plan.schedule import schedule_floors
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import NULL_RECORDER, EpochRecorder
from insitubatch_nodes.stages._memrule import MemoryRule
from insitubatch_nodes.stages.buffers import BatchBuffers, batch_rows
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.transforms import ChunkTransform, ChunkTransforms

__all__ = ["Member", "StageContext", "slot_holdings"]


class Member(Protocol):
    """A stage that holds or waits on something (registered with :meth:`StageContext.join`)."""

    def release(self) -> None:
        """Let go of what this stage holds (its own pins, lent batch, cache lock); idempotent,
        and nothing else: the context releases every member."""

    def interrupt(self) -> None:
        """Wake this stage's waits now (any thread); they raise ``PipelineInterrupted``."""


@dataclass(frozen=True, eq=False)
class StageContext:
    """What the stages of one graph share (module docstring); make it with :meth:`create`.

    * ``plan``: the graph's :class:`ReadPlanNode`; ``batch_size``, ``rank`` and
      ``world_size`` are its own;
    * ``views``: label -> the view batches carry (after the chunk transforms): the plan's
      views, a window's steps one by one (:mod:`~insitubatch_nodes.plan.parts`; the batch
      buffers' ``layout`` assembles batch labels from them); after the plan's
      :meth:`~insitubatch_nodes.stages.read_plan.ReadPlanNode.set_views`, the new ones from
      the next epoch on (:meth:`sync_views`);
    * ``geoms``: array path -> its stored geometry (what is decoded);
    * ``slot_geoms``: array path -> what one pool slot of it holds (after the chunk transforms;
      one stored tile of an array read through patched views);
    * ``patched``: the arrays read through patched views;
    * ``pool``, ``transforms``, ``options``: the chunk pool, the chunk transforms, the fetch
      side's settings (:class:`~insitubatch_nodes.options.FetchOptions`, checked when made);
    * ``recorder``: the epoch report's recorder (the null one with ``options.report=False``);
    * ``buffers``: the batch buffers, sized to ``min(batch_size, samples this rank delivers per
      epoch)`` rows;
    * ``held``: array path -> the indices of its field axes its slots hold, for arrays whose
      selected views select only part of a field axis (:mod:`~insitubatch_nodes.io.selection`:
      the selected indices of an axis whole in each object, the touched tiles of a tiled
      one); absent: everything. The plan is told (:meth:`ReadPlanNode.hold`), so that
      ``set_views`` selects only within it.
    """

    plan: ReadPlanNode
    geoms: Mapping[str, ArrayGeometry]
    slot_geoms: Mapping[str, ArrayGeometry]
    patched: frozenset[str]
    pool: ChunkPool
    transforms: ChunkTransforms
    options: FetchOptions
    recorder: EpochRecorder
    buffers: BatchBuffers
    held: Mapping[str, Held] = field(default_factory=dict)
    memory: MemoryRule = field(default_factory=MemoryRule)
    _members: list[Member] = field(default_factory=list, repr=False)
    _root: list[weakref.ref[Any]] = field(default_factory=list, repr=False)
    _pid: int = field(default_factory=os.getpid, repr=False)  # the process that made it

    @classmethod
    def create(
        cls,
        plan: ReadPlanNode,
        pool: ChunkPool,
        *,
        options: FetchOptions | None = None,
        chunk_transforms: Sequence[ChunkTransform] | ChunkTransforms = (),
    ) -> StageContext:
        """The context of a graph reading ``plan`` through ``pool``.

        ``chunk_transforms``: the callables that run on every decoded chunk (checked here
        against the plan's arrays), or the :class:`~insitubatch_nodes.transforms.ChunkTransforms`
        already built from them. The plan's views may be views of the stored arrays or
        already transformed ones. ``options`` (default ``FetchOptions()``) are the fetch and
        prefetch stages' settings.

        Raises ``TypeError`` when ``plan``, ``pool`` or ``options`` is not one, and
        ``ValueError`` when a view fits neither its stored array nor what the
        transforms make of it, when an array read through patched views has chunk transforms
        or ``pool`` keeps a persistent cache, and when one batch of ``batch_size`` samples
        cannot fit in this machine's memory.
        """
        if not isinstance(plan, ReadPlanNode):
            raise TypeError(f"plan must be the graph's ReadPlanNode, got {plan!r}")
        if not isinstance(pool, ChunkPool):
            raise TypeError(
                f"pool must be a ChunkPool (insitubatch_nodes.pool.ChunkPool(None): an automatic "
                f"budget), got {pool!r}"
            )
        options = FetchOptions() if options is None else options
        if not isinstance(options, FetchOptions):
            raise TypeError(f"options must be a FetchOptions, got {options!r}")
        _runtime.collect_dropped()  # before this graph takes memory of its own
        transforms = _resolve_transforms(plan, chunk_transforms)
        views = {label: _carried_view(label, v, transforms) for label, v in plan.views.items()}
        patched = frozenset(v.path for v in views.values() if v.patch is not None)
        persistent = pool.cache is not None and pool.cache.persistent
        held = slot_holdings(views.values(), transforms, persistent)
        slot_geoms = _slot_geometries(transforms, patched, pool, held)
        plan.hold(held)
        rows = batch_rows(
            plan.batch_size,
            plan.epoch_plan(0).n_samples,
            views,
            plan.split,
            plan.rank,
            plan.world_size,
            options.prefetch_depth,
        )
        recorder: EpochRecorder = NULL_RECORDER
        if options.report:
            recorder = EpochRecorder(
                pool,
                max_inflight=options.max_inflight,
                decode_threads=len(_runtime.decode_pool(options.decode_threads).threads),
                split_bytes=functools.partial(_split_bytes, plan, slot_geoms),
                budget_floor=functools.partial(_budget_floor, plan),
                read_ahead_capped=functools.partial(_read_ahead_capped, plan),
                dropped=lambda: plan.epoch_plan().dropped,
                trace=options.trace,
                direct=options.direct,
            )
        return cls(
            plan=plan,
            geoms=MappingProxyType({path: g.base for path, g in transforms.geoms.items()}),
            slot_geoms=MappingProxyType(slot_geoms),
            patched=patched,
            pool=pool,
            transforms=transforms,
            options=options,
            recorder=recorder,
            buffers=BatchBuffers(views, rows, plan.layout),
            held=MappingProxyType(held),
        )

    @property
    def views(self) -> Mapping[str, ArrayGeometry]:
        return MappingProxyType(self.buffers.views)

    def sync_views(self) -> bool:
        """Take the views the plan reads now, if :meth:`ReadPlanNode.set_views
        <insitubatch_nodes.stages.read_plan.ReadPlanNode.set_views>` changed them (the stage
        that assembles batches calls this once its source's reset returned, before any batch
        of the epoch is pulled): the batch buffers' views and layout. True when they changed."""
        if self.plan.layout is self.buffers.layout:
            return False
        views = {
            label: _carried_view(label, v, self.transforms) for label, v in self.plan.views.items()
        }
        self.buffers.set_views(views, self.plan.layout)
        return True

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def join(self, stage: Member) -> None:
        """Register ``stage`` (at its construction): :meth:`close` and :meth:`interrupt` reach
        it from then on."""
        self._members.append(stage)

    def set_root(self, root: Any) -> None:
        """Register ``root`` (a ``PrefetcherNode``, at its construction): :meth:`close_graph`
        closes the graph through it from then on."""
        self._root[:] = [weakref.ref(root)]

    def close_graph(self) -> None:
        """What ``close()`` on any stage does: the root's ``close()`` where the graph has a
        root ``PrefetcherNode`` (its thread stopped first, its delivered position kept, so a
        later ``next()`` on it goes on from there), else :meth:`close`."""
        root = self._root[0]() if self._root else None
        if root is not None:
            root.close()
        else:
            self.close()

    def forked(self) -> bool:
        """Whether this is a child forked after the graph was built (the stages' threads and
        what they hold stayed in the parent)."""
        return os.getpid() != self._pid

    def close(self) -> None:
        """Release what every registered stage holds, the last built first (top-down: the
        batch lent downstream, then the fetch stage's pins, fills and cache lock). In a child
        forked after the graph was built it releases nothing: what the stages hold (their
        threads, pins, the locks a parent's thread may have held at the fork) is the parent's,
        and taking those locks could wait forever."""
        if self.forked():
            return
        for stage in reversed(self._members):
            stage.release()

    def interrupt(self) -> None:
        """Wake every registered stage's waits now (thread-safe; nothing in a forked child,
        see :meth:`close`)."""
        if self.forked():
            return
        for stage in self._members:
            stage.interrupt()


def slot_holdings(
    views: Iterable[ArrayGeometry], transforms: ChunkTransforms, persistent: bool
) -> dict[str, Held]:
    """Array path -> the indices its slots hold, for arrays read only through selected views
    (:func:`~insitubatch_nodes.io.selection.held_by_path`): just the selected indices of an
    axis whole in each object, unless the slots must hold stored chunks — for chunk transforms,
    or as a ``persistent`` cache's files. The builder sizes the schedule by it before the
    stages exist; the context then hands it to the plan (:meth:`ReadPlanNode.hold`)."""
    return held_by_path(views, exact=lambda path: not (persistent or transforms.active(path)))


def chunks_served(plan: ReadPlanNode) -> list[tuple[str, int]]:
    """The chunk keys ``plan``'s split is read from in an epoch, by any of its ranks: the
    distinct chunks of one rank's plan, or under several ranks (which read other chunks each
    epoch) of the plan of one rank reading the whole split — the same on every rank. What a
    read-only cache must not hold stale (:mod:`~insitubatch_nodes.cache.stale`); asked only
    when it does (a draw of the epoch)."""
    if plan.world_size > 1:
        config, views = plan.plan_config.for_rank(0, 1), dict[str, Any](plan.batch_views)
        plan = ReadPlanNode(plan.manifest, views, schedule=plan.schedule, config=config)
    return plan.epoch_plan().distinct_chunks()


def _resolve_transforms(
    plan: ReadPlanNode, chunk_transforms: Sequence[ChunkTransform] | ChunkTransforms
) -> ChunkTransforms:
    """The chunk transforms resolved against the stored arrays: as given when already built,
    else against the arrays the plan's views read."""
    if isinstance(chunk_transforms, ChunkTransforms):
        return chunk_transforms
    geoms = {v.path: v.base for v in plan.views.values()}
    return ChunkTransforms(chunk_transforms, geoms)


def _slot_geometries(
    transforms: ChunkTransforms,
    patched: frozenset[str],
    pool: ChunkPool,
    held: Mapping[str, Held],
) -> dict[str, ArrayGeometry]:
    """Path -> what one slot holds: the transformed chunk, one stored tile of an array read
    through patched views, or the held indices of an array read through selected views (of
    its one tile, when patched; held tiles of a tiled axis take neither chunk transforms nor a
    persistent cache)."""
    out = dict(transforms.outputs)
    for path in sorted(held):
        if transforms.active(path):
            raise ValueError(
                f"array {path!r} is read through selected views that touch only some of its "
                "stored tiles, so a slot holds those tiles, not a chunk, and takes no chunk "
                "transforms; transform the selection in a batch transform instead"
            )
        if pool.cache is not None and pool.cache.persistent:
            raise ValueError(
                f"array {path!r} is read through selected views that touch only some of its "
                "stored tiles, which the persistent cache does not hold: pass persist=False "
                "(slots on disk in cache_dir; CacheOptions(persist=False)) or leave cache_dir "
                "unset, or select every stored tile of it"
            )
        out[path] = held_geometry(transforms.geoms[path].base, held[path])
    for path in sorted(patched):
        transforms.refuse_patched(path)
        unit = unit_geometry(transforms.geoms[path].base)
        out[path] = held_geometry(unit, held[path]) if path in held else unit
    return out


def _carried_view(label: str, view: ArrayGeometry, transforms: ChunkTransforms) -> ArrayGeometry:
    """``view`` as batches carry it: a view of an array the chunk transforms reshape becomes
    the transformed one (a view given already transformed stays as it is)."""
    if not isinstance(view, ArrayGeometry):
        raise TypeError(f"views[{label!r}] must be an ArrayGeometry view, got {view!r}")
    if view.path not in transforms.outputs:
        raise ValueError(
            f"views[{label!r}] reads {view.path!r}, which the chunk transforms were not built "
            f"for (their arrays: {sorted(transforms.outputs)})"
        )
    if view.base == transforms.source(view.path) and transforms.active(view.path):
        return transforms.output_view(view)
    if view.base != transforms.outputs[view.path]:
        raise ValueError(
            f"views[{label!r}] is a view of {view.path!r} whose geometry is neither the stored "
            "array's nor what the chunk transforms make of it"
        )
    return view


def _split_bytes(plan: ReadPlanNode, slot_geoms: Mapping[str, ArrayGeometry], epoch: int) -> int:
    """Bytes of every chunk epoch ``epoch`` reads (what a budget must hold for no re-read)."""
    sizes = {path: g.chunk_nbytes for path, g in slot_geoms.items()}
    return plan.epoch_plan(epoch).read_bytes(sizes)


def _budget_floor(plan: ReadPlanNode) -> int:
    """The smallest explicit budget the pipeline accepts for the views in effect: the floor
    ``insitu_pipeline`` and ``set_views`` check a budget against (every epoch of every rank
    fits it), which a rank's epoch can read less than."""
    return schedule_floors(plan.manifest, plan.views, plan.plan_config, plan.held).guaranteed


def _read_ahead_capped(plan: ReadPlanNode) -> str:
    """Why a larger ``block_chunks`` would read no further ahead (:class:`~insitubatch_nodes.
    report.EpochReport`'s ``read_ahead_capped``), or ``""``: ``"patched"`` — a patched plan's
    block is one region of one sample-axis chunk, and one region already holds every tile the
    windows start in; ``"epoch"`` — one block already holds every chunk of this rank's epoch.
    A few arithmetic steps over the current plan."""
    spec = patch_spec(plan.views)
    if spec is not None:
        return "patched" if region_count(spec, plan.block_chunks) == 1 else ""
    return "epoch" if len(plan.epoch_plan().chunks) <= plan.block_chunks else ""
