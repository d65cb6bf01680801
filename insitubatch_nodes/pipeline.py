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

from insitubatch_nodes._checks import (
    check_batch_transforms,
    check_bool,
    check_int,
    check_on_bad_chunk,
    check_optional_int,
)
from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.cache.directory import ChunkCache
from insitubatch_nodes.cache.fingerprint import array_fingerprint
from insitubatch_nodes.cache.identity import StoreCheck
from insitubatch_nodes.io.arrays import check_arrays_in_store, open_geometries
from insitubatch_nodes.io.coords import carried_coordinates
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import RetryPolicy, as_store, describe_store, retry_policy
from insitubatch_nodes.plan.config import PlanConfig, resolve_plan_config
from insitubatch_nodes.plan.schedule import choose_schedule
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.slots import SlotBacking
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.gather import GatherNode
from insitubatch_nodes.stages.prefetch import PrefetcherNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ChunkPoolNode
from insitubatch_nodes.transforms import ChunkTransform, ChunkTransforms

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

    def __init__(
        self,
        gather: GatherNode,
        prefetch_depth: int,
        stages: dict[str, Any],
    ) -> None:
        super().__init__(gather, prefetch_depth)
        self.stages = PipelineStages(prefetch=self, gather=gather, **stages)

    @property
    def bad_chunks(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(array, chunk_index, tile)`` of the stored objects this epoch read as bad and
        filled (``on_bad_chunk="nan"``), in the order found; cleared when the pipeline is reset
        for the next epoch. ``tile`` is the object's position in the chunk's grid of stored
        objects over the field axes (``(0, 0)`` when a 2-D field is stored whole)."""
        return self.stages.fetch.bad_chunks

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


def _check_cache_args(
    cache_dir: Any,
    persist: Any,
    readonly: Any,
    reset_stale: Any,
    backing: Any,
    check_store: Any = True,
    verify: Any = True,
) -> dict[str, Any] | None:
    """The cache arguments checked together (``None`` without a ``cache_dir``)."""
    persist = check_bool("persist", persist)
    readonly = check_bool("readonly_cache", readonly)
    reset_stale = check_bool("reset_stale_cache", reset_stale)
    check_store = check_bool("check_store", check_store)
    verify = check_bool("verify_cache", verify)
    if cache_dir is None:
        named = [n for n, v in (("persist", persist), ("readonly_cache", readonly),
                                ("reset_stale_cache", reset_stale)) if v]  # fmt: skip
        if named:
            raise ValueError(f"{' and '.join(named)} need a cache_dir: pass cache_dir=PATH")
        if not check_store:
            raise ValueError("check_store=False needs a persistent cache: pass cache_dir=PATH")
        if not verify:
            raise ValueError("verify_cache=False needs a cache_dir: pass cache_dir=PATH")
        return None
    if not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir):
        raise TypeError(f"cache_dir must be a path (str or os.PathLike) or None, got {cache_dir!r}")
    if backing is not None:
        raise ValueError("cache_dir chooses the slot backing itself: pass cache_dir or backing")
    if readonly and reset_stale:
        raise ValueError(
            "reset_stale_cache=True deletes files and readonly_cache=True writes nothing: reset "
            "the cache with a writing run first"
        )
    return {
        "cache_dir": cache_dir,
        "persist": persist or readonly,
        "readonly": readonly,
        "reset_stale": reset_stale,
        "check_store": check_store,
        "verify": verify,
    }


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
    cross_split_windows: bool = False,
    remainder: str = "drop",
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
    config: PlanConfig | None = None,
) -> InSituPipeline:
    """Build the pipeline that trains on ``split`` of ``manifest`` from ``store``.

    ``variables`` is a list of array names (each becomes a label) or ``{label: view}`` with
    :class:`ArrayGeometry` views (e.g. ``{"x": g, "y": g.shift(1)}``). Batches are
    :class:`~insitubatch_nodes.batch.Batch` es of numpy arrays ``(batch, *inner_shape)``.
    An anchor is used only when every view reads inside ``split``'s own chunks;
    ``cross_split_windows=True`` lets windows read across the split's edge. ``remainder``
    (``"drop"`` or ``"pad"``) is what several ranks do with the samples that do not divide
    evenly between them (see :class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`).
    ``config`` (a :class:`~insitubatch_nodes.plan.config.PlanConfig`) passes ``split``,
    ``batch_size``, ``block_chunks``, ``shuffle``, ``seed``, ``rank``, ``world_size``,
    ``cross_split_windows`` and ``remainder`` (and ``ramp``, which has no keyword here) as one
    object; give either it or those keywords (one off its default beside ``config`` raises
    ``TypeError``).

    ``cache_budget_bytes=None`` sizes the pool to each epoch's working set (each chunk read once
    per epoch); a larger budget keeps drained chunks for later epochs; one too small for some
    epoch raises ``ValueError`` here, stating the floor (see :func:`choose_schedule`).
    ``max_inflight`` bounds concurrent stored-object GETs; ``decode_threads`` sizes the shared
    decode pool (default: one per core). Every argument is checked here: counts must be ``int``
    (not ``bool``), flags ``bool``.

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
    """
    plan_config = resolve_plan_config(
        config,
        "insitu_pipeline",
        split=split,
        batch_size=batch_size,
        block_chunks=block_chunks,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        cross_split_windows=cross_split_windows,
        remainder=remainder,
    )
    max_inflight = check_int("max_inflight", max_inflight, minimum=1)
    prefetch_depth = check_int("prefetch_depth", prefetch_depth, minimum=1)
    cache_budget_bytes = check_optional_int("cache_budget_bytes", cache_budget_bytes, minimum=1)
    decode_threads = check_optional_int("decode_threads", decode_threads, minimum=1)
    report = check_bool("report", report)
    on_bad_chunk = check_on_bad_chunk(on_bad_chunk)
    cache_args = _check_cache_args(
        cache_dir, persist, readonly_cache, reset_stale_cache, backing, check_store, verify_cache
    )
    batch_transforms = check_batch_transforms(batch_transforms)
    if backing is not None and not all(
        callable(getattr(backing, m, None)) for m in ("allocate", "release")
    ):
        raise TypeError(
            f"backing must be a SlotBacking (with allocate() and release()) or None, got "
            f"{backing!r}"
        )
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
        if "" in labels:  # a root array: its path is no label
            raise ValueError(
                "the root array of the store (path '') has no name to label it by: pass the "
                "views as a dict, e.g. variables={'x': open_geometries(store)['']}"
            )
    if not labels:
        raise ValueError("variables is empty: name at least one array to train on")
    geoms: dict[str, ArrayGeometry] = {}
    for label, view in labels.items():
        if not isinstance(view, ArrayGeometry):
            raise TypeError(f"variables[{label!r}] must be an ArrayGeometry view, got {view!r}")
        base = geoms.setdefault(view.path, view.base)
        if base != view.base:
            raise ValueError(f"two views of {view.path!r} disagree about its geometry")
    if isinstance(coords, str):
        coords = [coords]
    if coords is not None and not isinstance(coords, Sequence):
        raise TypeError(f"coords must be None or a sequence of coordinate names, got {coords!r}")
    carried = (
        carried_coordinates(
            zstore,
            labels,
            None if coords is None else list(coords),
            timeout_s=(retry or retry_policy(zstore)).timeout_s,
        )
        if coords is None or len(coords)
        else {}
    )
    # the chunk transforms are checked here, and say what the slots and batches hold
    transforms = ChunkTransforms(chunk_transforms, geoms)
    labels = {label: transforms.output_view(view) for label, view in labels.items()}
    slot_geoms = transforms.outputs

    # the schedule is decided first (and fails fast, here, when the budget is too small)
    schedule = choose_schedule(
        manifest,
        labels,
        cache_budget_bytes,
        revive=cache_args is not None and cache_args["persist"] and plan_config.shuffle,
        config=plan_config,
    )
    plan = ReadPlanNode(manifest, labels, schedule=schedule, config=plan_config)
    cache = None
    if cache_args is not None:
        fingerprints = {
            path: array_fingerprint(transforms.source(path), out, transforms.chain(path))
            for path, out in slot_geoms.items()
        }
        store_check = StoreCheck(
            zstore,
            {path: g.n_tiles for path, g in geoms.items()},
            enabled=cache_args.pop("check_store"),
            name=describe_store(zstore),
        )
        cache = ChunkCache(
            cache_args.pop("cache_dir"),
            fingerprints,
            rank=plan.rank,
            store_check=store_check,
            **cache_args,
        )
    try:
        pool = ChunkPool(cache_budget_bytes, backing=backing, cache=cache)
        fetch = AsyncChunkFetchNode(
            plan,
            zstore,
            geoms,
            pool,
            max_inflight=max_inflight,
            decode_threads=decode_threads,
            retry=retry,
            chunk_transforms=transforms,
            on_bad_chunk=on_bad_chunk,
            report=report,
        )
        resident = ChunkPoolNode(fetch)
        # (the gather takes the views and batch size from the plan, sizes its buffers to the
        # samples a rank delivers, and lends them to the fetch stage: rows decoded in place)
        gather = GatherNode(resident, labels, plan.batch_size, batch_transforms, coords=carried)
    except BaseException:
        if cache is not None:
            cache.close()
        raise
    return InSituPipeline(
        gather,
        prefetch_depth,
        {"plan": plan, "fetch": fetch, "resident": resident, "pool": pool},
    )
