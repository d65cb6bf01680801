"""The read plan: which samples each batch holds and which stored chunks it reads.

Everything here is a pure function of ``(seed, epoch)`` and the configuration, computed with
vectorised numpy (O(samples) array work per epoch, O(chunks) Python per batch):

1. the split's anchor-grid chunks are permuted (``shuffle=True``) or kept in order;
2. with several ranks, :func:`deal` hands each rank the same number of samples — the
   ``V // world_size`` (``remainder="drop"``) or ``ceil(V / world_size)`` (``"pad"``) of the
   ``V`` valid anchors: whole chunks round-robin while they last, then consecutive pieces of the
   remaining (*tail*) chunks' samples; so at most ``world_size - 1`` samples sit out (or are
   repeated) per epoch, and only tail chunks are read by more than one rank (with
   ``"uneven"`` the first ``V % world_size`` ranks get one sample more, and none sits out).
   With windows (views at several offsets, :func:`dealing_for`) :func:`deal_runs` deals
   instead: each rank one contiguous run of the valid anchors along the sample axis, its chunks
   then visited in the epoch's permuted order (shuffled within the rank), so ranks share only
   the chunks one window span reaches across each cut;
3. each rank cuts its chunks into *blocks* of ``block_chunks`` chunks and shuffles all valid
   anchors within each block; the result is the *order ledger*, rows ``(chunk_id, within)``.
   With ``ramp=True`` (and shuffling) the epoch's first block is split in two: a lead block of
   just enough chunks to fill one batch, then the rest — so the first batch waits for those few
   chunks instead of (nearly) the whole block;
4. batches are cut over the whole ledger: ``ceil(N / batch_size)`` batches, only the last short.

**Valid anchors** (which anchors of the split a plan draws, per chunk) are decided in
:mod:`~insitubatch_nodes.plan.valid_anchors`.

Each :class:`BatchPlan` says which stored chunks the batch gathers from (``reads``), which of them
it is the first to need this epoch (``fetches`` — each chunk is fetched once per epoch) and which
it reads for the last time (``releases`` — the pool may unpin them once the batch is gathered).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from insitubatch_nodes.errors import TooFewSamplesError
from insitubatch_nodes.io.arrays import check_batchable
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.anchors import off_stride
from insitubatch_nodes.plan.config import PlanConfig, plan_config
from insitubatch_nodes.plan.ledger import ChunkLedger, EpochPlan, Stage
from insitubatch_nodes.plan.patches import PatchLayout, WindowUnits, patch_spec, touched_tiles
from insitubatch_nodes.plan.ranks import (
    DEALINGS,
    LEGACY_PAD,
    LEGACY_SIT_OUT,
    deal,
    deal_runs,
    sit_out,
)
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.plan.valid_anchors import (
    _runs,
    _valid_anchor_range,
    chunk_anchors,
    chunk_counts,
    dropped_anchors,
)

__all__ = [
    "block_index",
    "check_ranks",
    "chunk_anchors",
    "dealing_for",
    "dropped_anchors",
    "patch_layout",
    "plan_epoch",
    "plan_groups",
]


def ramp_unit(enabled: bool, samples_per_chunk: int, batch_size: int) -> int:
    """Chunks in the lead block (0 = no ramp): enough to fill one batch."""
    return math.ceil(batch_size / samples_per_chunk) if enabled else 0


def block_index(n_chunks: int, block_chunks: int, lead: int = 0) -> np.ndarray:
    """Block of each chunk position: blocks of ``block_chunks``, except that with
    ``0 < lead < block_chunks`` the first block is split into ``lead`` chunks and the rest."""
    sizes = [lead, block_chunks - lead] if 0 < lead < block_chunks else []
    covered = sum(sizes)
    sizes.extend([block_chunks] * max(0, math.ceil((n_chunks - covered) / block_chunks)))
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)[:n_chunks]


def _epoch_samples(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    config: PlanConfig,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's rank-independent sample pool: ``(chunks, counts, anchors)`` — the split's
    chunks in visiting order, their valid-anchor counts and all valid anchors laid out chunk
    after chunk (each chunk's ascending)."""
    offsets = [g.offset for g in views.values()]
    chunks = manifest.chunk_array(config.split)
    if config.shuffle and len(chunks):  # (numpy refuses to permute an empty read-only array)
        chunks = np.random.default_rng([config.seed, epoch, 0]).permutation(chunks)
    counts, anchors = chunk_anchors(manifest, chunks, offsets, config)
    return chunks, counts, anchors


def patch_layout(views: Mapping[str, ArrayGeometry], block_chunks: int) -> PatchLayout | None:
    """The :class:`PatchLayout` of a plan over ``views`` (``None`` without patched views)."""
    spec = patch_spec(views)
    return None if spec is None else PatchLayout(spec, block_chunks)


def _patch_samples(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    layout: PatchLayout,
    config: PlanConfig,
    epoch: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_epoch_samples` of a patched plan: ``(patch chunks, counts, sample ids)`` (see
    :mod:`~insitubatch_nodes.plan.patches`) over the anchors :func:`chunk_anchors` keeps (the
    stride and the missing-step checks too), the patch chunks permuted when shuffling."""
    offsets = [g.offset for g in views.values()]
    chunks = manifest.chunk_array(config.split)
    counts, anchors = chunk_anchors(manifest, chunks, offsets, config)
    pc, cnt, ids = layout.samples(chunks, counts, anchors)
    if config.shuffle and len(pc):
        perm = layout.visit_order(pc, np.random.default_rng([config.seed, epoch, 0]))
        first = np.cumsum(cnt) - cnt
        ids = ids[_runs(first[perm], cnt[perm])]
        pc, cnt = pc[perm], cnt[perm]
    return pc, cnt, ids


def dealing_for(views: Mapping[str, ArrayGeometry]) -> str:
    """How an epoch over ``views`` is dealt between ranks (one of
    :data:`~insitubatch_nodes.plan.ranks.DEALINGS`): ``"runs"`` (contiguous runs along the
    sample axis, :func:`deal_runs`) when the views sit at several offsets — windows, whose
    anchors read their neighbours' chunks — and none is patched; else ``"chunks"``
    (:func:`deal`), where an anchor chunk reads only its own."""
    offsets = {g.offset for g in views.values()}
    patched = any(g.patch is not None for g in views.values())
    return "runs" if len(offsets) > 1 and not patched else "chunks"


def _rank_shares(
    chunks: np.ndarray,
    counts: np.ndarray,
    anchors: np.ndarray,
    ranks: Sequence[int],
    world_size: int,
    remainder: str,
    pad_seed: Sequence[int],
    dealing: str = "chunks",
    shuffle: bool = True,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The ``(chunks, counts, anchors)`` of each of ``ranks`` in a sample pool laid out as
    :func:`_epoch_samples` lays it, dealt once (:func:`deal`, or :func:`deal_runs` for
    ``dealing="runs"``, its draws from ``default_rng([*pad_seed, 5])`` when shuffling and its
    padded samples from ``default_rng([*pad_seed, 7])``, except by a legacy dealing of
    :data:`LEGACY_PAD`; the whole pool with one rank). A rank's chunk may repeat (a padded
    sample is a piece of its own).
    Shuffled, ``"drop"``'s samples that sit out are drawn and taken out first (:func:`sit_out`;
    not by a legacy dealing of :data:`LEGACY_SIT_OUT`, which left them to its own rule)."""
    if world_size == 1:
        return [(chunks, counts, anchors) for _ in ranks]
    if remainder == "drop" and shuffle and dealing not in LEGACY_SIT_OUT:
        counts, anchors = sit_out(counts, anchors, world_size, [*pad_seed, 6])
    dealing = LEGACY_SIT_OUT.get(dealing, dealing)
    pad_edge = dealing in LEGACY_PAD  # (its padded samples at the cuts: see deal_runs)
    dealing = LEGACY_PAD.get(dealing, dealing)
    # A chunk with nothing valid (or nothing left) holds nothing to deal.
    first = np.cumsum(counts) - counts
    keep = counts > 0
    chunks, counts, first = chunks[keep], counts[keep], first[keep]
    if dealing != "chunks":  # "runs", or its rule before 2026-12-07 (see deal_runs)
        rng = np.random.default_rng([*map(int, pad_seed), 5]) if shuffle else None
        pad_rng = None if pad_edge else np.random.default_rng([*map(int, pad_seed), 7])
        pieces = deal_runs(
            counts,
            chunks,
            world_size,
            remainder=remainder,
            rng=rng,
            store_order=dealing == "runs",
            pad_rng=pad_rng,
        )
    else:
        pieces = deal(
            counts, world_size, remainder=remainder, pad_seed=pad_seed, pad_others=not pad_edge
        )
    return [
        (chunks[group], size, anchors[_runs(first[group] + lo, size)])
        for group, lo, size in (pieces[r] for r in ranks)
    ]


def _ledger(
    counts: np.ndarray,
    anchors: np.ndarray,
    key_seed: Sequence[int],
    *,
    spc: int,
    batch_size: int,
    block_chunks: int,
    shuffle: bool,
    ramp: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(anchors, block_of_row, block_of_chunk)`` in emitted order: one rank's pieces cut into
    blocks, shuffled within each block (by ``default_rng(key_seed)``), rows of a batch sorted."""
    total = int(counts.sum())
    chunk_pos = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    block_of_chunk = block_index(
        len(counts), block_chunks, ramp_unit(ramp and shuffle, spc, batch_size)
    )
    block = block_of_chunk[chunk_pos]
    if shuffle and total:
        keys = np.random.default_rng(list(key_seed)).random(total)
        first = np.cumsum(counts) - counts  # each block's samples are one run from its first
        perm = _argsort_in_runs(keys, first[np.diff(block_of_chunk, prepend=-1) > 0])
        anchors, block = anchors[perm], block[perm]
    # Within a batch, rows go in anchor order. The batch holds the same samples as before, but
    # each chunk's rows are now one contiguous run for every label, so the gather makes one
    # copy per chunk straight into the batch instead of a gather plus a scatter.
    in_batch = _argsort_in_runs(anchors, np.arange(0, total, batch_size, dtype=np.int64))
    return anchors[in_batch], block[in_batch], block_of_chunk


def _argsort_in_runs(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The permutation that sorts ``values`` (stably) within each run ``starts[i] ..
    starts[i + 1] - 1`` (``starts`` ascending from 0; a run may be empty) and keeps the runs in
    place: ``np.lexsort((values, run_of_each))``, index for index. Runs of one length are
    sorted together as the rows of one 2-D array: many small sorts that stay in cache, where
    one ``np.lexsort`` of a whole epoch took 8.8 s of CPU at 10 million samples."""
    total = len(values)
    out = np.empty(total, dtype=np.int64)
    if total == 0:
        return out
    lengths = np.diff(starts, append=total)
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    by_length = np.argsort(lengths, kind="stable")
    kinds, cuts = np.unique(lengths[by_length], return_index=True)
    for length, first in zip(kinds.tolist(), np.split(starts[by_length], cuts[1:]), strict=True):
        lo, hi = int(first[0]), int(first[-1]) + length
        if hi - lo == length * len(first):  # adjacent runs (batches, even blocks): no copies
            order = _argsort_rows(values[lo:hi].reshape(-1, length))
            out[lo:hi] = (order + first[:, None]).ravel()
        else:
            rows = first[:, None] + np.arange(length, dtype=np.int64)
            out[rows] = _argsort_rows(values[rows]) + first[:, None]
    return out


def _argsort_rows(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, axis=1, kind="stable")``, by the faster unstable sort where a row
    holds no value twice (random keys, anchors: nearly always)."""
    order = np.argsort(values, axis=1)
    ranked = np.sort(values, axis=1)
    tied = (ranked[:, 1:] == ranked[:, :-1]).any(axis=1)
    if tied.any():
        order[tied] = np.argsort(values[tied], axis=1, kind="stable")
    return order


def _stage_seeds(seed: int, epoch: int, rank: int, stage: int) -> tuple[list[int], list[int]]:
    """``(pad_seed, key_seed)`` of an epoch's stage: stage 0 is the epoch as first planned,
    stage ``s >= 1`` the remainder after the ``s``-th elastic cut."""
    if stage == 0:
        return [seed, epoch], [seed, epoch, 1, rank]
    return [seed, epoch, 3, stage], [seed, epoch, 4, stage, rank]


def plan_epoch(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    config: PlanConfig | None = None,
    *,
    epoch: int = 0,
    pin_gap: int | None = None,
    resumed: Sequence[Stage] = (),
    dealing: str | None = None,
) -> EpochPlan:
    """Draw one rank's plan for one epoch of ``config`` (a
    :class:`~insitubatch_nodes.plan.config.PlanConfig`; ``None``: the defaults). Pure: same
    arguments, same plan. The config is trusted (it was checked when it was made); its
    ``rank``/``world_size`` left at ``None`` mean rank 0 of 1 here (``ReadPlanNode`` resolves
    them from ``torch.distributed`` before it draws).

    ``pin_gap=None`` keeps each chunk from its first reading batch to its last (each chunk is
    fetched once per epoch). With ``pin_gap=g`` a chunk that goes more than ``g`` batches
    without being read is released and fetched again at its next use — the schedule for a
    budget too small to hold shifted views' neighbours across the epoch.
    ``cross_split_windows`` is the anchor rule of the module docstring.

    ``resumed`` (elastic resume) lists the cuts this epoch went through, oldest first:
    ``(W, k)`` says that each rank of a ``W``-rank run had delivered its first ``k`` batches of
    the epoch (counted from the epoch's start, so ``k`` grows from cut to cut; a rank with fewer,
    under ``remainder="uneven"``, all of its own). The plan is then
    the epoch's *remainder* for ``world_size`` ranks: the valid samples no earlier rank
    delivered, grouped by chunk in the epoch's visiting order and dealt by :func:`deal` as a
    fresh epoch's are (with ``"uneven"``: every one of them exactly once), its batches numbered
    from the last cut's ``k`` (:attr:`EpochPlan.first_batch`).

    ``dealing`` (one of :data:`~insitubatch_nodes.plan.ranks.DEALINGS`) is how every stage of
    the epoch is dealt between ranks; ``None`` takes :func:`dealing_for` the views. With one
    rank all give the same plan.
    """
    cfg = plan_config(config, "plan_epoch")
    if dealing is not None and dealing not in DEALINGS:
        raise ValueError(f"dealing must be None or one of {DEALINGS}, got {dealing!r}")
    how = dealing_for(views) if dealing is None else dealing
    batch_size, block_chunks, shuffle, seed = (
        cfg.batch_size,
        cfg.block_chunks,
        cfg.shuffle,
        cfg.seed,
    )
    remainder, ramp = cfg.remainder, cfg.ramp
    rank = 0 if cfg.rank is None else cfg.rank
    world_size = 1 if cfg.world_size is None else cfg.world_size
    spc = manifest.samples_per_chunk
    layout = patch_layout(views, block_chunks)
    if layout is None:
        chunks, counts, anchors = _epoch_samples(manifest, views, cfg, epoch)
    else:  # "anchors" are sample ids (anchor * P + patch) until the ledger is drawn
        chunks, counts, anchors = _patch_samples(manifest, views, layout, cfg, epoch)
    ledger = functools.partial(
        _ledger,
        spc=spc if layout is None else 1,
        batch_size=batch_size,
        # a patched plan's block is one patch chunk: one region of tiles of one anchor chunk
        block_chunks=block_chunks if layout is None else 1,
        shuffle=shuffle,
        ramp=ramp,
    )
    done = 0  # batches each rank of the previous stage had delivered
    for stage, (w_old, k_old) in enumerate(resumed):
        # every old rank's share of one dealing (the pad seed is the stage's, not the rank's)
        pad_seed, _ = _stage_seeds(seed, epoch, 0, stage)
        shares = _rank_shares(
            chunks, counts, anchors, range(w_old), w_old, remainder, pad_seed, how, shuffle
        )
        taken = [
            ledger(rc, ra, _stage_seeds(seed, epoch, r, stage)[1])[0][: (k_old - done) * batch_size]
            for r, (_, rc, ra) in enumerate(shares)
        ]
        left = ~np.isin(anchors, np.concatenate(taken))
        group = np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
        counts = np.bincount(group[left], minlength=len(chunks)).astype(np.int64)
        anchors, done = anchors[left], k_old
        # chunks with nothing left take no place in the remainder's blocks: here, before the
        # next cut's replay too (one rank deals no chunk away, so its blocks saw none of them)
        keep = counts > 0
        chunks, counts = chunks[keep], counts[keep]
    pad_seed, key_seed = _stage_seeds(seed, epoch, rank, len(resumed))
    [(chunks, counts, anchors)] = _rank_shares(
        chunks, counts, anchors, [rank], world_size, remainder, pad_seed, how, shuffle
    )
    anchors, block, block_of_chunk = ledger(counts, anchors, key_seed)
    n_emit = len(anchors)
    origins = None
    if layout is not None:
        origins = layout.origins(seed, epoch, anchors)
        origins.setflags(write=False)
        anchors = anchors // layout.n_patches
    order = np.stack([anchors // spc, anchors % spc], axis=1)
    order.setflags(write=False)

    n_batches = math.ceil(n_emit / batch_size)
    gap = n_batches if pin_gap is None else int(pin_gap)
    return EpochPlan(
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        block_chunks=block_chunks,
        samples_per_chunk=spc,
        chunks=chunks,
        order=order,
        views=dict(views),
        pin_gap=pin_gap,
        first_batch=done,
        resumed=tuple((int(w), int(k)) for w, k in resumed),
        ledgers=_ledgers(views, anchors, batch_size, n_batches, gap, origins),
        dropped=dropped_anchors(manifest, views, cfg),
        _block_of_row=block,
        _block_of_chunk=block_of_chunk,
        origins=origins,
    )


def plan_groups(
    views: Mapping[str, ArrayGeometry],
) -> list[tuple[int, tuple[int, ...], list[str]]]:
    """``(samples_per_chunk, offsets, paths)`` of each plan group: the arrays whose views chunk
    the sample axis alike and sit at the same (sorted) offsets, in label order. Such arrays
    read the same chunk indices in the same rows of every plan."""
    by_path: dict[str, list[ArrayGeometry]] = {}
    for label, g in views.items():
        if g.window_offsets is not None:  # (a window's steps are planned one by one)
            raise ValueError(
                f"views[{label!r}] is a window: a plan reads its steps as plain views; expand "
                "it with insitubatch_nodes.plan.parts.expand_views (ReadPlanNode and "
                "insitu_pipeline do)"
            )
        by_path.setdefault(g.path, []).append(g)
    groups: dict[tuple[int, tuple[int, ...], Any], list[str]] = {}
    for path, vs in by_path.items():
        # patched arrays read units of their own tiles: only arrays tiled alike share a ledger
        tiling = None if vs[0].patch is None else (vs[0].shape, vs[0].chunks)
        key = (vs[0].samples_per_chunk, tuple(sorted(g.offset for g in vs)), tiling)
        groups.setdefault(key, []).append(path)
    return [(spc, offsets, paths) for (spc, offsets, _), paths in groups.items()]


def _ledgers(
    views: Mapping[str, ArrayGeometry],
    anchors: np.ndarray,
    batch_size: int,
    n_batches: int,
    gap: int,
    origins: np.ndarray | None = None,
) -> tuple[ChunkLedger, ...]:
    """One :class:`ChunkLedger` per plan group for the rows ``anchors`` (emitted order) and,
    in a patched plan, their window ``origins``."""
    n_emit = len(anchors)
    rank = {path: i for i, path in enumerate(dict.fromkeys(g.path for g in views.values()))}
    by_path = {g.path: g for g in views.values()}
    spec = patch_spec(views)
    bounds = np.arange(n_batches + 1, dtype=np.int64)
    out = []
    for pspc, offsets, paths in plan_groups(views):
        windows = None
        if by_path[paths[0]].patch is not None:
            assert spec is not None and origins is not None
            touched = touched_tiles(views, paths)
            windows = WindowUnits(by_path[paths[0]].base, spec, offsets, touched)
            cid, row = windows.uses(anchors, origins)
        elif len(set(offsets)) == 1:
            cid = (anchors + offsets[0]) // pspc
            row = np.arange(n_emit, dtype=np.int64)
        else:
            cid = np.concatenate([(anchors + k) // pspc for k in offsets])
            row = np.tile(np.arange(n_emit, dtype=np.int64), len(offsets))
        by = np.lexsort((row, cid))
        cid, row = cid[by], row[by]
        batch = row // batch_size
        # a new use segment starts at a new chunk, or after more than `gap` idle batches
        starts = np.ones(len(cid), dtype=bool)
        starts[1:] = (cid[1:] != cid[:-1]) | (batch[1:] - batch[:-1] > gap)
        s_idx = np.flatnonzero(starts)
        e_idx = np.append(s_idx[1:], len(cid)).astype(np.int64) - 1 if len(cid) else s_idx
        chunk, first, last = cid[s_idx], row[s_idx], row[e_idx]
        by_first = np.argsort(first, kind="stable")
        by_last = np.argsort(last, kind="stable")
        fetch_ptr = np.searchsorted(first[by_first] // batch_size, bounds, side="left")
        release_ptr = np.searchsorted(last[by_last] // batch_size, bounds, side="left")
        for arr in (chunk, first, last, by_first, by_last, fetch_ptr, release_ptr):
            arr.setflags(write=False)
        out.append(
            ChunkLedger(
                paths=tuple(paths),
                path_rank=tuple(rank[p] for p in paths),
                samples_per_chunk=pspc,
                offsets=offsets,
                chunk=chunk,
                first=first,
                last=last,
                by_first=by_first,
                fetch_ptr=fetch_ptr,
                by_last=by_last,
                release_ptr=release_ptr,
                windows=windows,
            )
        )
    return tuple(out)


def check_ranks(
    manifest: SplitManifest, views: Mapping[str, ArrayGeometry], config: PlanConfig
) -> None:
    """:class:`~insitubatch_nodes.errors.TooFewSamplesError` unless every rank of ``config``
    gets a sample of its split (a valid anchor, or with patched views one window of one: a
    single whole-slide plane holds thousands) or ``config.empty_ranks`` lets a rank get none."""
    world = 1 if config.world_size is None else config.world_size
    split_chunks = manifest.chunk_array(config.split)
    counts, _ = chunk_anchors(manifest, split_chunks, [g.offset for g in views.values()], config)
    n_valid = int(counts.sum())
    layout = patch_layout(views, config.block_chunks)
    n_samples = n_valid if layout is None else n_valid * layout.n_patches
    if world > 1 and len(split_chunks) and n_samples < world and not config.empty_ranks:
        what = "valid anchors" if layout is None else f"windows ({n_valid} valid anchors)"
        dropped = {k: n for k, n in dropped_anchors(manifest, views, config).items() if n}
        why = f"; the missing-step checks dropped {dropped}" if dropped else ""
        counted = f"{n_samples} {what}{why}"
        raise TooFewSamplesError(
            f"split {config.split!r} has {n_samples} {what} but world_size is {world}{why}: "
            f"every rank needs at least one sample (remainder {config.remainder!r} too: a rank "
            "without a batch leaves the others waiting at their first collective call). To "
            f"evaluate it, read it on at most {n_samples} rank(s) (rank=r, world_size="
            f"{n_samples} on ranks r < {n_samples}, no loader on the others, outside any "
            "collective call), or, in a plain loop with no collective call per batch, on every "
            "rank with config=PlanConfig(..., remainder='uneven', empty_ranks=True) (the ranks "
            "beyond its samples run zero batches); to train on it, give it more samples (more "
            "chunks, a larger share) or train on fewer ranks",
            split=config.split,
            n_samples=n_samples,
            world_size=world,
            counted=counted,
        )


def check_plan_inputs(manifest: Any, views: Any, config: PlanConfig) -> dict[str, ArrayGeometry]:
    """Validate the data a plan is drawn over for ``config`` (a checked :class:`PlanConfig`);
    the views as a plain dict."""
    split, cross_split_windows = config.split, config.cross_split_windows
    if not isinstance(manifest, SplitManifest):
        raise TypeError(f"manifest must be a SplitManifest, got {type(manifest).__name__}")
    if not isinstance(views, Mapping) or not views:
        raise ValueError("views must be a non-empty {label: ArrayGeometry} mapping")
    for label, geom in views.items():
        if not isinstance(label, str) or not label:
            raise ValueError(f"labels must be non-empty strings, got {label!r}")
        if not isinstance(geom, ArrayGeometry):
            raise TypeError(f"views[{label!r}] must be an ArrayGeometry, got {geom!r}")
        if geom.static:
            raise ValueError(
                f"views[{label!r}] ({geom.path}) is a static array (no sample axis), which a "
                "read plan does not draw: insitu_pipeline carries static views itself; a graph "
                "built by hand adds static.StaticFields(static.read_static(...)) as a batch "
                "transform (beside patched views, with views= and patches=)"
            )
        if geom.n_samples != manifest.n_samples:
            raise ValueError(
                f"views[{label!r}] ({geom.path}) has {geom.n_samples} samples along its "
                f"sample axis but the manifest's anchor grid has {manifest.n_samples}; all "
                "labels must share the sample-axis length"
            )
    check_batchable({g.path: g.base for g in views.values()})
    whole = {g.path for g in views.values() if g.patch is None}
    both = sorted({g.path for g in views.values() if g.patch is not None} & whole)
    if both:
        raise ValueError(
            f"arrays {both} are read both whole and patched; read an array one way in a plan "
            "(a whole field and its windows would need two kinds of slot)"
        )
    patch_spec(views)  # patched views must cut their fields alike
    offsets = [g.offset for g in views.values()]
    lo, hi = _valid_anchor_range(manifest.n_samples, offsets)
    if hi <= lo and manifest.n_samples > 0:
        raise ValueError(
            f"the views' offsets {offsets} leave no valid anchor in an array of "
            f"{manifest.n_samples} samples"
        )
    split_chunks = manifest.chunk_array(split)
    _, counts = chunk_counts(manifest, split, split_chunks, offsets, cross_split_windows)
    if (
        len(split_chunks)
        and counts.any()
        and not chunk_anchors(manifest, split_chunks, offsets, config)[0].any()
    ):
        off = off_stride(config.stride, manifest.steps)
        if off is not None:
            raise ValueError(f"split {split!r} has no anchor: {off}")
        dropped = dropped_anchors(manifest, views, config)
        hint = "use a smaller stride or check the times and missing steps"
        if dropped.get("absent_object"):  # the store's absent objects, not the times
            hint = (
                "anchors were dropped for stored objects absent from the store "
                "(missing_objects='drop'): pass missing_objects='read' to read absent objects "
                f"as the fill value, as zarr does; or {hint}"
            )
        raise ValueError(
            f"split {split!r} has no anchor left with stride={config.stride} and the "
            f"missing-step checks (dropped per reason: {dropped}); {hint}"
        )
    members = manifest.members
    if (
        len(split_chunks)
        and not counts.any()
        and members is not None
        and not members.continuous
        and not chunk_counts(manifest, split, split_chunks, offsets, True)[1].any()
    ):
        first, end = members.sample_bounds(split_chunks, manifest.samples_per_chunk)
        longest = int((end - first).max())
        raise ValueError(
            f"split {split!r}: with the views' offsets {offsets} no anchor has every step "
            "in its own member, and a window never leaves its member: the members of split "
            f"{split!r} hold at most {longest} sample{'s' if longest != 1 else ''}, and the "
            f"views span {max(offsets) - min(offsets) + 1}; use shorter windows or put "
            "longer members in this split"
        )
    if len(split_chunks) and not counts.any():
        raise ValueError(
            f"split {split!r} has {len(split_chunks)} chunks, but with the views' offsets "
            f"{offsets} none of its anchors reads only samples of split {split!r}; use a "
            "longer split or shorter windows, or pass cross_split_windows=True to let windows "
            "read across the split's edge"
        )
    return dict(views)
