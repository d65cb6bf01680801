"""One call that composes the five stages into a training pipeline.

``ReadPlanNode -> AsyncChunkFetchNode -> ChunkPoolNode -> GatherNode -> PrefetcherNode``; the
result is a ``torchdata.nodes.BaseNode`` to iterate directly or wrap in
``torchdata.nodes.Loader``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any

from zarr.abc.store import Store

from insitubatch_nodes._checks import check_batch_transforms, check_instance
from insitubatch_nodes.anchor_steps import anchor_steps
from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.cache.directory import ChunkCache
from insitubatch_nodes.cache.fingerprint import array_fingerprint
from insitubatch_nodes.cache.identity import StoreCheck
from insitubatch_nodes.forcing_grid import refuse_forcings_elsewhere
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.collection import Collection, collection_of
from insitubatch_nodes.io.collection_checks import (
    member_missing,
    refuse_collection_options,
)
from insitubatch_nodes.io.coords import coordinate_reader, same_store_reader
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.product import product_of, refuse_product_options
from insitubatch_nodes.io.stores import (
    RetryPolicy,
    StoreLike,
    describe_store,
    retry_policy,
)
from insitubatch_nodes.options import CacheOptions, FetchOptions
from insitubatch_nodes.pipeline_inputs import (
    _carried_coordinates,
    _members,
    _open_store,
    _options,
    _resolve_views,
)
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.parts import expand_views, resolve_windows
from insitubatch_nodes.plan.patches import unit_geometry
from insitubatch_nodes.plan.ranks import check_same_plans
from insitubatch_nodes.plan.schedule import ScheduleFloors, choose_schedule, schedule_floors
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.pool import ChunkPool, PoolStats
from insitubatch_nodes.ranks_agree import fail_together, group_share, succeed_together, together
from insitubatch_nodes.slots import SlotBacking
from insitubatch_nodes.stack import Stack
from insitubatch_nodes.stack_constants import prepare_constants, static_fields
from insitubatch_nodes.stages.buffers import batches_in_flight
from insitubatch_nodes.stages.context import StageContext, chunks_served, slot_holdings
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.gather import (
    GatherNode,
    most_transform_bytes,
    refuse_standardised_twice,
)
from insitubatch_nodes.stages.prefetch import PrefetcherNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ChunkPoolNode
from insitubatch_nodes.static import keep_static_labels, read_static
from insitubatch_nodes.transforms import ChunkTransform, ChunkTransforms

__all__ = ["InSituPipeline", "PipelineStages", "choose_schedule", "insitu_pipeline"]

log = logging.getLogger(__name__)
_FILLS_S = 2.0  # the most close() waits for fills still inside a decode (their slots)


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

    def __init__(self, gather: GatherNode, context: StageContext, stages: dict[str, Any]) -> None:
        super().__init__(gather, context=context)
        self.stages = PipelineStages(prefetch=self, gather=gather, **stages)

    def close(self) -> None:
        """Stop the thread, cancel in-flight fetches, unpin chunks (the position is kept: a
        later ``next()`` goes on), and let go of the memory kept idle: the pool's chunks and
        free slots (``pool.clear()``; fills still in a decode, waited for up to 2 s, give
        theirs back as they end), the batch buffers and the buffers of the static cuts and
        forcings: a batch you still hold keeps its own memory, freed when you drop it (a later
        ``next()`` makes new buffers). Nothing in a child forked after the build: all that is
        the parent's (see ``StageContext.close``)."""
        if self.context.forked():
            return
        with self._lock:  # (a next() on another thread starts its producer after this)
            super().close()
            self.stages.pool.clear()  # fills still in a decode give their slots back as they end:
            wait(self.stages.pool.detached_fills(), timeout=_FILLS_S)  # briefly wait for them
            self.stages.gather.release_idle()

    @property
    def bad_chunks(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(array, chunk_index, tile)`` of the stored objects this epoch read as bad and
        filled (``on_bad_chunk="nan"``), in the order found; cleared when the pipeline is reset
        for the next epoch. ``tile`` is the object's position in the chunk's grid of stored
        objects over the field axes (``(0, 0)`` when a 2-D field is stored whole)."""
        return self.stages.fetch.bad_chunks

    @together("set_views", lambda pipe: _group_share(pipe.stages.plan))
    def set_views(self, views: Mapping[str, ArrayGeometry | Stack]) -> Callable[[], None]:
        """Read ``views`` (``{label: view}`` of the arrays this pipeline reads: other windows,
        shifts or labels; a rollout that grows) from the next epoch on.

        They take effect when the next epoch starts (the next ``iter()`` or ``reset()``, or a
        ``load_state_dict``/``reset(state)``, which then restores under them); the epoch in
        progress keeps its views (also when the pipeline is closed and resumed in it, or a
        state saved mid-epoch under the views still in effect is restored). The batch buffers
        are resized then. A checkpoint taken after the change resumes exactly (in a pipeline
        given the same views, at build or by ``set_views``); a state saved with the views
        before the change restores at an epoch boundary (its epoch not begun, or over), and a
        pipeline reading the new views refuses it mid-epoch with a ``ValueError`` naming both
        sets of views.

        A :func:`~insitubatch_nodes.stack.stack` is a view too, and any of it may change: its
        sampled members (other windows, shifts, selections, order), its static members and
        forcings, its layout and normalisation (a label may also become a stack). The static
        arrays a new stack needs that the pipeline does not hold yet are read here, once, as
        at build (through the persistent cache, with ``cache_dir=..., persist=True``); see
        :mod:`~insitubatch_nodes.stack_constants`. A stack's forcings are computed from the
        times of its first sampled member's array: batches must carry them.

        Static labels (a plain static view as a label) stay as built: give them again as
        they were; a static field that changes is a stack's static member.

        Checked here: ``TypeError`` for a value that is not an ``ArrayGeometry`` or a stack;
        ``ValueError`` for static labels other than the build's (added, dropped or selected
        otherwise), views of other arrays (or of an array with another geometry), an
        array patched otherwise, a stack with forcings whose first sampled member's times the
        batches do not carry, ``Forcings`` among the batch transforms that do not fit their
        label's new view (as at build), a split left with no anchor, an explicit
        ``cache_budget_bytes`` below the new views' floor (as at build), and views the build's
        memory check refuses (counted again for them: their batches in flight, the chunks
        their epochs read, what the batch transforms hold with their stacks' static fields
        and forcings; the views in effect are kept); a static array that cannot be read
        raises as at build. Time-delta windows are resolved through the times
        the pipeline was built with (a time ``stride``, time windows or ``missing=``;
        ``missing=()`` reads them and lists nothing): give offsets in samples otherwise.

        All or nothing: a call that raises changes nothing, and over a ``torch.distributed``
        group (a plan dealt over it) one that raised on any rank takes effect on none, every
        other rank raising :class:`~insitubatch_nodes.errors.RankFailedError` (see
        :func:`~insitubatch_nodes.ranks_agree.together`): caught, every rank reads as before."""
        if not isinstance(views, Mapping) or not views:
            raise TypeError(f"set_views takes a non-empty {{label: view}} mapping, got {views!r}")
        plan, transforms = self.stages.plan, self.context.transforms
        views = keep_static_labels(views, self.stages.gather.batch_transforms)
        carried: dict[str, Any] = {}
        for label, view in views.items():
            if not isinstance(view, ArrayGeometry | Stack):
                raise TypeError(
                    f"views[{label!r}] must be an ArrayGeometry view or a stack(), got {view!r}"
                )
            sampled = view.views if isinstance(view, Stack) else (view,)
            for member in (v for v in sampled if not v.static):
                if member.path not in transforms.outputs or member.base != transforms.source(
                    member.path
                ):
                    raise ValueError(
                        f"views[{label!r}] reads {member.path!r} with another geometry than "
                        f"this pipeline's arrays ({sorted(transforms.outputs)}): set_views "
                        "takes views of the arrays the pipeline was built on"
                    )
            carried[label] = _output_view(transforms, label, view)
        steps = plan.manifest.steps
        timed = [k for k, v in carried.items() if not isinstance(v, Stack) and v.timed_window]
        if timed and (steps is None or steps.ticks is None):
            raise ValueError(
                f"set_views: the windows of {timed} are in time deltas, resolved through the "
                "times this pipeline read when it was built, and it read none (it was built "
                "with an int stride, windows in samples and no missing=): build it with "
                "missing=() — it then reads the times, and drops the anchors a gap touches, as "
                "time-delta windows do — or give the offsets in samples"
            )
        self.stages.gather.check_constants(carried)  # (its Forcings and StaticFields)
        parts, _ = expand_views(resolve_windows(carried, steps))
        pool, store = self.stages.pool, self.stages.fetch.store
        timeout = (self.context.options.retry or retry_policy(store)).timeout_s
        commit, pending = prepare_constants(  # the static arrays new stacks need: read now
            carried,
            self.stages.gather,
            plan,
            lambda need: read_static(store, need, timeout, cache=pool.cache, stats=pool.stats),
        )
        persistent = pool.cache is not None and pool.cache.persistent
        floors = schedule_floors(plan.manifest, parts, plan.plan_config, plan.held)
        schedule = choose_schedule(
            plan.manifest,
            parts,
            None if pool.auto else pool.budget_bytes,
            plan.plan_config,
            revive=persistent and plan.shuffle,
            held=plan.held,
            floors=floors,
        )
        # the plan's check counts the memory rule for them once, with the new stacks'
        # constants and these floors, on the plan of their first epoch it draws
        take = plan.prepare_views(carried, schedule=schedule, floors=floors, extra=[pending])

        def take_all() -> None:  # (once every rank of the group prepared them: see together)
            take()
            commit()

        return take_all

    def stats(self) -> dict[str, int]:
        """The pool's counters (hits, misses, GETs, bytes fetched, evictions, peaks; the
        static fields' reads, ``static_gets`` and ``static_disk_hits``) and the
        memory this pipeline holds outside the pool's budget, in bytes:
        ``batch_buffer_bytes`` (reusable batch buffers, lent out or idle — the prefetch queue's
        batches live in them), ``decode_scratch_bytes`` (per decode
        thread: scratch, and the buffers objects are decoded into before a slot keeps a
        selection of them), ``batch_transform_bytes`` (what the batch transforms hold: static
        fields and the buffers of their cuts, stacks' constant channels, the forcings'
        remembered fields) and their sum ``outside_pool_bytes``."""
        out = self.stages.pool.stats.as_dict()
        out["batch_buffer_bytes"] = self.stages.gather.buffer_bytes
        out["decode_scratch_bytes"] = self.stages.fetch.scratch_bytes
        out["batch_transform_bytes"] = self.stages.gather.transform_bytes
        out["outside_pool_bytes"] = (
            out["batch_buffer_bytes"] + out["decode_scratch_bytes"] + out["batch_transform_bytes"]
        )
        return out


def insitu_pipeline(
    store: StoreLike | Collection,
    manifest: SplitManifest,
    variables: Sequence[str] | Mapping[str, ArrayGeometry | Stack],
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
    cross_split_windows: bool = False,
    remainder: str = "drop",
    stride: Any = 1,
    missing: Sequence[Any] | Mapping[str, Sequence[int]] | None = None,
    missing_objects: str = "read",
    report: bool = True,
    chunk_transforms: Sequence[ChunkTransform] = (),
    on_bad_chunk: str = "raise",
    cache_dir: str | os.PathLike[str] | None = None,
    persist: bool = False,
    readonly_cache: bool = False,
    reset_stale_cache: bool = False,
    verify_cache: bool = True,
    check_store: bool = True,
    coords: Sequence[str] | None = None,
    coords_reader: Any = None,
    config: PlanConfig | None = None,
    fetch: FetchOptions | None = None,
    cache: CacheOptions | None = None,
) -> InSituPipeline:
    """Build the pipeline that trains on ``split`` of ``manifest`` from ``store``.

    ``variables`` is a list of array names (each becomes a label; of a collection, its
    variables' names) or ``{label: view}`` with
    :class:`ArrayGeometry` views (e.g. ``{"x": g, "y": g.shift(1)}``). Batches are
    :class:`~insitubatch_nodes.batch.Batch` es of numpy arrays ``(batch, *inner_shape)``, or
    ``(batch, T, *inner_shape)`` for a window view (``g.window([-1, 0])``, or in time deltas
    ``g.window(["-6h", "0h"])``, resolved here through the time coordinate of the manifest's
    anchor array; see :meth:`ArrayGeometry.window`). :meth:`InSituPipeline.set_views` changes
    the views between epochs.
    An anchor is used only when every view reads inside ``split``'s own chunks (and inside
    the manifest's ``sample_range`` window); ``cross_split_windows=True`` lets windows read
    across that edge. ``remainder`` (``"drop"``, ``"pad"`` or, for ``split="val"``/``"test"``
    only, ``"uneven"``: every sample exactly once, batch counts differing by at most one between
    ranks) is what several ranks do with the samples that do not divide evenly between them
    (see :class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`).

    ``stride`` (a :class:`PlanConfig` field; default 1, every sample) picks the anchors: an
    ``int`` ``k`` keeps every ``k``-th sample counted from index 0, a time step (``"6h"``,
    ``numpy.timedelta64``) the samples whose time — read from the time coordinate of the
    manifest's anchor array, in its own calendar — is a whole multiple of the step since
    ``1970-01-01T00:00`` (00, 06, 12, 18 UTC), or since 0 for durations (a forecast sampled
    along its lead time: ``"6h"`` keeps lead times 0, 6, 12, ...); a step that is not a
    multiple of the data's step raises ``ValueError`` naming both. Only the chunks holding an
    anchor or a step a view reads are read. **Missing steps**: ``missing`` (``None``: no
    check) lists samples as indices or times (``()`` lists none; on a collection of
    independent members, times, or ``{member name: [indices within it]}``); given, or with a time
    stride, every anchor one of whose steps
    (``anchor + offset`` of each view) has a missing time (NaT, ``None``), a time that is not
    the anchor's plus the offset times the data's step (a gap or a duplicate), or is listed, is
    dropped; ``missing_objects="drop"`` (default ``"read"``: an absent object reads as the
    fill value) lists each array's prefix once and drops the anchors a step of which has an
    absent stored object. Decided here; each rank lists the store, and ranks dealt over an
    initialised ``torch.distributed`` group compare their plans (in the exchange below):
    a store that changed between two ranks' builds is a ``ValueError`` naming the ranks, not
    unequal batch counts (a DDP hang). ``pipe.stages.plan.dropped``
    counts the dropped anchors per reason (see :mod:`~insitubatch_nodes.plan.anchors`), and
    ``missing`` is part of the checkpoint's fingerprint when given.

    ``config`` (a :class:`~insitubatch_nodes.plan.config.PlanConfig`) passes ``split``,
    ``batch_size``, ``block_chunks``, ``shuffle``, ``seed``, ``rank``, ``world_size``,
    ``cross_split_windows`` and ``remainder`` (and ``ramp``, ``empty_ranks``: no keyword here)
    as one object. In the same way ``fetch`` (a :class:`~insitubatch_nodes.options.FetchOptions`)
    holds ``max_inflight``, ``decode_threads``, ``retry``, ``on_bad_chunk``, ``report`` and
    ``prefetch_depth`` (and ``direct``, which has no keyword here), and ``cache`` (a
    :class:`~insitubatch_nodes.options.CacheOptions`) holds ``cache_budget_bytes``,
    ``backing``, ``cache_dir``, ``persist``, ``readonly_cache``, ``reset_stale_cache``,
    ``verify_cache`` and ``check_store``. Give each group either as its object or as keywords:
    a keyword off its default beside the object raises ``TypeError``. Each object is checked
    once, when it is made; the stages, the schedule and the pool trust it.

    ``cache_budget_bytes=None`` sizes the pool to each epoch's working set (each chunk read once
    per epoch) — at one sample per chunk, to the whole split when it fits in 1/16 of RAM,
    so that later epochs read nothing (:func:`~insitubatch_nodes.plan.schedule.kept_bytes`); a
    larger budget keeps drained chunks for later epochs; one too small for some epoch raises
    ``ValueError`` here, stating the floor (see :func:`choose_schedule`).
    ``max_inflight`` bounds concurrent stored-object GETs; ``decode_threads`` sizes the shared
    decode pool (default: one per core). Every argument is checked here, once: counts must be
    ``int`` (not ``bool``), flags ``bool``.

    ``retry`` (a :class:`~insitubatch_nodes.io.stores.RetryPolicy`) bounds every read: with a URL
    or path it is what the store is opened with; with an opened ``Store`` its ``timeout_s`` is
    the deadline of each stored-object GET (retries are then the store's own). ``None`` uses
    the policy the store was opened with (the default one for any other store). Construction
    checks that the store holds every array read (one metadata read per array) and raises
    ``FileNotFoundError`` naming the array and the store when it does not.

    ``report=True`` (the default) measures every epoch for :meth:`InSituPipeline.report` (which
    stage limits it, and what to change); ``False`` turns the measurement off.

    ``chunk_transforms`` (callables ``DecodedChunk -> DecodedChunk``, see
    :mod:`~insitubatch_nodes.transforms`) run on the decode threads once per decoded chunk,
    before any batch gathers from it; :func:`~insitubatch_nodes.transforms.applies` scopes one
    to arrays (a path that names no array read here raises ``ValueError`` now). Batches and
    slots take the shape and dtype the transforms declare (``output_inner``); the budget and
    its floor are counted at that size. ``on_bad_chunk`` is ``"raise"`` (default: a stored
    object that cannot be read after the store's retries, or cannot be decoded, fails the
    epoch) or ``"nan"`` (its rectangle is filled with NaN, or the fill value for non-float
    arrays, the epoch goes on and :attr:`InSituPipeline.bad_chunks` lists it).

    ``cache_dir``, ``persist``, ``readonly_cache``, ``reset_stale_cache``: the chunk cache on
    local disk (:mod:`~insitubatch_nodes.cache`, docs/caching.md). ``verify_cache=True`` (the
    default) checks each chunk revived from a persistent cache against the checksum written
    with it, once per revive; ``False`` serves cached chunks unchecked. With a persistent
    cache, a writer records what identifies each stored object it reads, and building the
    pipeline checks the cached chunks against one listing of each array's prefix: chunks whose
    objects changed, went or appeared are fetched again (a writer) or raise
    ``StaleCacheError`` naming them (``readonly_cache=True``). ``check_store=False`` trusts
    the cache without listing (an archive known not to change); see
    :mod:`~insitubatch_nodes.cache.identity`.
    ``coords`` chooses the coordinates each batch carries as ``batch.coords[label][name]`` (one
    value per row, indexed with the rows' sample indices; see :mod:`~insitubatch_nodes.io.coords`):
    ``None`` (the default) carries each label's dimension coordinate of the sample axis where
    the store has one (``time`` for a ``(time, lat, lon)`` array; one that cannot be decoded is
    left out with a warning); a list of names carries those for every label (each must exist:
    ``KeyError`` or ``ValueError`` here otherwise); ``()`` carries none and reads none. Each
    coordinate array is read and decoded once, here, within ``retry``'s ``timeout_s`` (a read
    that fails raises ``OSError`` or ``TimeoutError`` naming the coordinate).
    ``coords_reader`` (:func:`~insitubatch_nodes.io.coords.coordinate_reader` of the opened
    store passed here, within its own ``timeout_s``) shares the coordinates and the arrays'
    metadata it read already with other builds over the same store (``InSituDataModule``'s
    splits; the ``open_geometries`` call given it): each read once for all of them, the store
    check then comparing the geometries with what it read; ``None`` (the default), a reader
    of this build's own, and the arrays' metadata read again. One of another store is a
    ``ValueError``.

    **Ranks fail together.** Where the plan is dealt over an initialised ``torch.distributed``
    group, every rank's build ends in one ``all_gather_object`` of its outcome: a build that
    raised on some ranks raises their own errors there and a
    :class:`~insitubatch_nodes.errors.RankFailedError` naming them and their reasons on every
    other rank (so every rank of the group must build it; :mod:`~insitubatch_nodes.ranks_agree`).
    """
    plan_config, fetch_options, cache_options = _options(
        config,
        fetch,
        cache,
        plan={
            "split": split,
            "batch_size": batch_size,
            "block_chunks": block_chunks,
            "shuffle": shuffle,
            "seed": seed,
            "rank": rank,
            "world_size": world_size,
            "cross_split_windows": cross_split_windows,
            "remainder": remainder,
            "stride": stride,
        },
        fetch={
            "max_inflight": max_inflight,
            "decode_threads": decode_threads,
            "retry": retry,
            "on_bad_chunk": on_bad_chunk,
            "report": report,
            "prefetch_depth": prefetch_depth,
        },
        cache={
            "cache_budget_bytes": cache_budget_bytes,
            "backing": backing,
            "cache_dir": cache_dir,
            "persist": persist,
            "readonly_cache": readonly_cache,
            "reset_stale_cache": reset_stale_cache,
            "verify_cache": verify_cache,
            "check_store": check_store,
        },
    )
    # every rank of a group the plan is dealt over hears whether every other rank built its
    # pipeline, and raises if one did not (ranks_agree): one exchange, at the end of the build
    share = group_share(plan_config.rank, plan_config.world_size)
    try:
        pipe = _build(
            store, manifest, variables, plan_config, fetch_options, cache_options,
            batch_transforms, chunk_transforms, missing, missing_objects, coords, coords_reader,
        )  # fmt: skip
    except Exception as exc:
        fail_together(share, exc, _BUILD)
        raise
    try:
        listed = missing_objects == "drop"  # each rank listed the store: the plans must agree
        plan = pipe.stages.plan
        told = {"config": plan.config(), "dropped": plan.dropped} if listed else None
        plans = succeed_together(share, _BUILD, told)
        if listed and share is not None:
            check_same_plans(plans, _RANKS_LISTED)
    except BaseException:
        pipe.close()
        raise
    return pipe


_BUILD = "the pipeline's build"


def _group_share(plan: ReadPlanNode) -> tuple[int, int] | None:
    """The group ``plan`` is dealt over (:func:`~insitubatch_nodes.ranks_agree.group_share`)."""
    return group_share(plan.rank, plan.world_size)


def _build(
    store: StoreLike | Collection,
    manifest: SplitManifest,
    variables: Sequence[str] | Mapping[str, ArrayGeometry | Stack],
    plan_config: PlanConfig,
    fetch_options: FetchOptions,
    cache_options: CacheOptions,
    batch_transforms: Sequence[BatchTransform],
    chunk_transforms: Sequence[ChunkTransform],
    missing: Sequence[Any] | Mapping[str, Sequence[int]] | None,
    missing_objects: str,
    coords: Sequence[str] | None,
    coords_reader: Any,
) -> InSituPipeline:
    """:func:`insitu_pipeline` on this rank, its option groups resolved."""
    check_instance("manifest", manifest, SplitManifest, "a SplitManifest (split_by_chunk)")
    batch_transforms = check_batch_transforms(batch_transforms)
    collection = store.name if isinstance(store, Collection) else None
    if isinstance(store, Collection):  # its store: one, or its members' stores routed
        if not isinstance(variables, Mapping):  # names: the collection's variables
            names = [variables] if isinstance(variables, str) else list(variables)
            variables = {name: store[name] for name in names}
        store = store.store
    zstore = _open_store(store, fetch_options.retry)
    # one reader: the arrays' metadata and the time coordinate the stride and missing= need
    # are read once, shared (with other builds, where coords_reader is given)
    timeout = (fetch_options.retry or retry_policy(zstore)).timeout_s
    reader = coordinate_reader(zstore, timeout) if coords_reader is None else coords_reader
    views, geoms = _resolve_views(zstore, variables, same_store_reader(reader, zstore))
    read = list(_members(views))
    refuse_collection_options(
        read,
        timed=not isinstance(plan_config.stride, int) or any(v.timed_window for v in read),
        missing=missing,
        missing_objects=missing_objects,
        coords=coords,
        plain_views=sum(v.members is None and not v.static for v in read),
        of=collection,
    )
    refuse_product_options(read, plan_config.stride, missing, missing_objects, coords)
    listed = member_missing(missing, read)  # {member: indices within it}: virtual indices
    labels = {k: v for k, v in views.items() if isinstance(v, ArrayGeometry) and v.static}
    views, geoms, statics, constants = static_fields(views, geoms)
    plain = {label: v for label, v in views.items() if isinstance(v, ArrayGeometry)}
    # a stack's rows carry its first sampled member's coordinates (its forcings' times)
    firsts = {label: v.sampled[0].geometry for label, v in views.items() if isinstance(v, Stack)}
    # forcings as batch transforms: each collection row on its own member's points
    forcings = [t for t in batch_transforms if isinstance(t, Forcings)]
    refuse_forcings_elsewhere(forcings, {**plain, **firsts})
    carried = _carried_coordinates(
        zstore,
        {
            lb: v
            for lb, v in {**plain, **firsts}.items()
            if v.members is None or v.members.continuous or coords  # (named: each member's)
        },
        coords,
        reader,
    )
    # the chunk transforms are checked here, and say what the slots and batches hold
    transforms = ChunkTransforms(chunk_transforms, geoms, {v.path for v in statics.values()})
    views = {label: _output_view(transforms, label, view) for label, view in views.items()}
    refuse_standardised_twice(transforms, views, batch_transforms)  # (before anything starts)
    members = collection_of([manifest.members, *(v.members for v in geoms.values())])
    if members is not None and manifest.members is None:  # no step leaves its member
        manifest = manifest.with_members(members)
    manifest = anchor_steps(
        zstore, manifest, geoms, plan_config, listed, missing_objects, reader, plain.values()
    )
    product = product_of([v for v in geoms.values() if not v.static], manifest.product)
    if product is not None and manifest.product is None:  # no anchor in a block's padding
        manifest = manifest.with_product(product)
    # the schedule is decided first (and fails fast, here, when the budget is too small), over
    # the views the plan reads: a window's steps one by one
    parts, _ = expand_views(resolve_windows(views, manifest.steps))
    held = slot_holdings(parts.values(), transforms, cache_options.persistent)
    floors = schedule_floors(manifest, parts, plan_config, held)  # (the memory check's too)
    schedule = choose_schedule(
        manifest,
        parts,
        cache_options.budget_bytes,
        plan_config,
        revive=cache_options.persistent and plan_config.shuffle,
        held=held,
        floors=floors,
    )
    plan = ReadPlanNode(manifest, views, schedule=schedule, config=plan_config, statics=labels)
    patched = {v.path for v in parts.values() if v.patch}  # stack members' included
    chunk_cache = _open_cache(
        cache_options, zstore, geoms, transforms, plan, statics, frozenset(patched)
    )
    try:  # the static fields: read once here, or taken from the persistent cache
        stats = PoolStats()  # (the pool's, from here: it counts the static fields' reads)
        static_data = read_static(zstore, statics, timeout, cache=chunk_cache, stats=stats)
    except BaseException:
        if chunk_cache is not None:
            chunk_cache.close()
        raise
    made = constants(static_data, plan)
    if made:  # put first; the transforms given are checked as given where they are used
        batch_transforms = (*made, *batch_transforms)
    return _compose_stages(
        plan,
        zstore,
        transforms,
        batch_transforms,
        carried,
        fetch_options,
        cache_options,
        chunk_cache,
        stats,
        floors,
    )


_RANKS_LISTED = (
    "missing_objects='drop' lists the store on each rank: it changed between the ranks' "
    "builds (an object written or deleted), or the ranks read different stores. Build again "
    "when the store no longer changes, or pass missing_objects='read' (absent objects read as "
    "the fill value)"
)


def _output_view(transforms: ChunkTransforms, label: str, view: Any) -> Any:
    """The view as batches carry it; a stack's members must come out of their chunk
    transforms as they went in."""
    if not isinstance(view, Stack):
        return transforms.output_view(view)
    for m in view.sampled:
        if m.view is None or transforms.output_view(m.view) != m.view:
            raise ValueError(
                f"stack {label!r}: the chunk transforms change member {m.name!r} "
                f"({m.geometry.path!r}); stack views of arrays whose transforms keep their "
                "shape and dtype"
            )
    return view


def _open_cache(
    options: CacheOptions,
    zstore: Store,
    geoms: Mapping[str, ArrayGeometry],
    transforms: ChunkTransforms,
    plan: ReadPlanNode,
    statics: Mapping[str, ArrayGeometry],
    patched: frozenset[str] = frozenset(),
) -> ChunkCache | None:
    """The chunk cache on local disk (``None`` without a ``cache_dir``): the directory of
    ``plan``'s rank (a reader is refused for the stale chunks its split reads, any rank's),
    keyed by each array's fingerprint after its chunk transforms (a static array's by its
    geometry: it takes no chunk transforms). An array read through patched views
    (``patched``) is cached by unit, one stored tile of a chunk each: its fingerprint is that
    of a unit's slot, and each cached unit is one stored object."""
    if options.cache_dir is None:
        return None
    fingerprints = {
        path: array_fingerprint(
            transforms.source(path),
            unit_geometry(out) if path in patched else out,
            transforms.chain(path),
            transforms.inputs(path),
        )
        for path, out in transforms.outputs.items()
    }
    static_bases = {v.path: v.base for v in statics.values()}
    fingerprints.update({path: array_fingerprint(g, g, ()) for path, g in static_bases.items()})
    store_check = StoreCheck(
        zstore,
        {
            path: 1 if path in patched else g.n_tiles
            for path, g in {**geoms, **static_bases}.items()
        },
        enabled=options.check_store,
        name=describe_store(zstore),
        members={p: g.members.paths for p, g in geoms.items() if g.members is not None},
    )
    return ChunkCache(
        options.cache_dir,
        fingerprints,
        rank=plan.rank,
        store_check=store_check,
        serves=lambda: chunks_served(plan),
        persist=options.persistent,
        readonly=options.readonly,
        reset_stale=options.reset_stale,
        verify=options.verify,
    )


def _compose_stages(
    plan: ReadPlanNode,
    zstore: Store,
    transforms: ChunkTransforms,
    batch_transforms: Sequence[BatchTransform],
    carried: dict[str, Any],
    options: FetchOptions,
    cache_options: CacheOptions,
    cache: ChunkCache | None,
    stats: PoolStats,
    floors: ScheduleFloors,
) -> InSituPipeline:
    """The pool (counting into ``stats``) and the stages below the read plan, composed
    (``cache`` is closed when one of them cannot be built); the fetch stage's memory check
    counts what the batch transforms hold at most, and the schedule's ``floors``."""
    try:
        pool = ChunkPool(
            cache_options.budget_bytes, backing=cache_options.backing, cache=cache, stats=stats
        )
        # what the stages share (views, buffers, recorder, ...): one context, handed to each
        context = StageContext.create(plan, pool, options=options, chunk_transforms=transforms)
        # (the views were read from this store, or checked against it: _resolve_views)
        most = most_transform_bytes(
            batch_transforms,
            plan.batch_views,
            context.buffers.rows,
            batches_in_flight(options.prefetch_depth),
        )
        fetch = AsyncChunkFetchNode(
            plan, zstore, context=context, check_arrays=False, floors=floors,
            transform_bytes=most,
        )  # fmt: skip
        resident = ChunkPoolNode(fetch, context=context)
        gather = GatherNode(
            resident, context=context, batch_transforms=batch_transforms, coords=carried
        )
    except BaseException:
        if cache is not None:
            cache.close()
        raise
    return InSituPipeline(
        gather, context, {"plan": plan, "fetch": fetch, "resident": resident, "pool": pool}
    )
