"""Dealing an epoch's samples between ranks: every rank the same number of samples, or with
``remainder="uneven"`` numbers that differ by at most one.

Two dealings, each a pure function of the groups' sample counts (:data:`DEALINGS` also holds
the legacy rules kept for states saved by them: :data:`LEGACY_SIT_OUT`, :data:`LEGACY_PAD`
and ``"runs-partial-last"``, the runs' order before 2026-12-07):

* ``"chunks"`` (:func:`deal`): whole chunks go round-robin while they last, then consecutive
  pieces of the remaining (*tail*) chunks' samples. A rank's chunks are spread over the whole
  split: right for views at one offset, where an anchor chunk's samples read only their own
  chunk.
* ``"runs"`` (:func:`deal_runs`): each rank gets one contiguous run of the samples along the
  sample axis. With windows (views at several offsets) an anchor's window reads its
  neighbours' chunks; a run reads its own chunks and, at each of its two ends, the few chunks
  one window span reaches across: summed over the ranks, little beyond the split's reads.

``remainder`` says what happens to the at most ``world_size - 1`` samples that do not divide
evenly (``"drop"``: they sit out; ``"pad"``: some repeat; ``"uneven"``: each goes to one of
the first ranks, so every sample is delivered exactly once and rank ``r`` gets one sample more
than the others exactly when ``r < V % world_size``, for ``V`` samples: the ranks' batch
counts may then differ by one, which evaluation tolerates and gradient sync does not).
In a shuffled ``"drop"`` epoch the samples that sit out are drawn by :func:`sit_out`
from all the epoch's samples and taken out before dealing (so each sits out about equally
often over the epochs); :func:`deal` and :func:`deal_runs` then have nothing left over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEALINGS",
    "LEGACY_PAD",
    "LEGACY_SIT_OUT",
    "REMAINDERS",
    "alone_before_group",
    "check_remainder",
    "check_same_plans",
    "check_still_alone",
    "deal",
    "deal_runs",
    "default_rank_world",
    "rank_shares",
    "resolve_rank_world",
    "samples_per_rank",
    "sit_out",
]


REMAINDERS = ("drop", "pad", "uneven")
# A shuffled "drop" epoch dealt by one of these (the key) left its remainder to the dealing's
# own rule (the value's), as before its sit-out samples were drawn (2026-12-07): kept for
# states saved mid-epoch by that rule, which finish their epoch by it.
LEGACY_SIT_OUT = {"chunks-tail-out": "chunks", "runs-cut-out": "runs"}
# A "pad" epoch dealt by one of these (the key) padded as before its padded samples were drawn
# from other ranks' (2026-12-07; the value's dealing otherwise): in runs, each short run with
# the sample just past its end (the same few samples, at the cuts, epoch after epoch); in
# chunks, with any sample (often one the rank already delivers). Kept for states saved
# mid-epoch by that rule, which finish their epoch by it.
LEGACY_PAD = {
    "runs-pad-edge": "runs",
    "runs-partial-last-pad-edge": "runs-partial-last",
    "chunks-pad-any": "chunks",
}
DEALINGS = ("chunks", "runs", "runs-partial-last", *LEGACY_SIT_OUT, *LEGACY_PAD)


def samples_per_rank(
    n_samples: int, world_size: int, remainder: str = "drop", rank: int = 0
) -> int:
    """Samples rank ``rank`` of ``world_size`` ranks emits from ``n_samples``: ``floor``
    (``"drop"``: at most ``world_size - 1`` sit out) or ``ceil`` (``"pad"``: at most
    ``world_size - 1`` are repeated) of ``n_samples / world_size`` on every rank; with
    ``"uneven"``, ``floor`` plus one on the first ``n_samples % world_size`` ranks (none sits
    out, none repeats)."""
    if remainder == "pad":
        return -(-n_samples // world_size)
    if remainder == "uneven":
        return n_samples // world_size + int(rank < n_samples % world_size)
    return n_samples // world_size


def rank_shares(n_samples: int, world_size: int, remainder: str = "drop") -> np.ndarray:
    """:func:`samples_per_rank` of each rank, rank 0 first (``int64``)."""
    return np.array(
        [samples_per_rank(n_samples, world_size, remainder, r) for r in range(world_size)],
        dtype=np.int64,
    )


def sit_out(
    counts: np.ndarray, anchors: np.ndarray, world_size: int, seed: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, anchors)`` of a shuffled ``remainder="drop"`` epoch's sample pool (``anchors``
    laid group after group, ``counts[g]`` of group ``g``) without the ``V % world_size`` samples
    that sit out, ``V = len(anchors)``: drawn uniformly without replacement by
    ``numpy.random.default_rng(seed)``, so over the epochs each sample sits out about equally
    often (before 2026-12-07 the dealing's own rule chose them: the last samples of the epoch's
    last tail chunk, or for runs those at one of the ``world_size + 1`` cuts — the split's
    first or last, epoch after epoch). The rest divides evenly: :func:`deal` and
    :func:`deal_runs` leave nothing over. Pure; O(``V``) array work."""
    n_out = len(anchors) % int(world_size)
    if n_out == 0:
        return counts, anchors
    out = np.random.default_rng(list(map(int, seed))).choice(len(anchors), n_out, replace=False)
    group = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    counts = counts - np.bincount(group[out], minlength=len(counts))
    return counts, np.delete(anchors, out)


def _covered(
    starts: np.ndarray, ends: np.ndarray, a: int, b: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunks whose samples ``[starts, ends)`` (laid end to end, ascending) meet
    ``[a, b)`` (``b > a``): their positions and the part of each inside, ``[lo, hi)`` counted
    from the chunk's first sample (empty pieces possible at the ends)."""
    first = int(np.searchsorted(ends, a, side="right"))
    last = int(np.searchsorted(ends, b - 1, side="right"))
    sel = np.arange(first, last + 1)
    lo = np.maximum(starts[sel], a) - starts[sel]
    hi = np.minimum(ends[sel], b) - starts[sel]
    return sel, lo, hi


def deal(
    counts: np.ndarray,
    world_size: int,
    *,
    remainder: str = "drop",
    pad_seed: Sequence[int] = (0,),
    pad_others: bool = True,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Deal ``counts[g]`` samples of each group ``g`` (a chunk, in visiting order) to ranks.

    Each rank gets exactly :func:`samples_per_rank` samples (its share). Whole groups are dealt
    round-robin (group ``k * world_size + r`` to rank ``r``) for as many rounds as no rank
    goes over its share; the samples of the groups left (the *tail*) are then laid end to end
    and cut into consecutive pieces, rank 0 first, each rank taking what its share still
    lacks. ``"drop"``: the last ``sum(counts) % world_size`` tail samples sit out (a shuffled
    plan leaves none over: it drew its sit-out samples first, :func:`sit_out`).
    ``"uneven"``: none does (the shares add up to ``sum(counts)``).
    ``"pad"``: ``(-sum(counts)) % world_size`` samples, drawn by
    ``numpy.random.default_rng([*pad_seed, 2])``, are appended to the tail (each a piece of its
    own), so none sits out and those few are delivered twice, by two ranks: each padded sample
    is drawn uniformly from the samples of the other ranks than the one it goes to, no two the
    same (:func:`_draw_pads`; a sample drawn before, or the rank's own, only where few samples
    are left: an elastic remainder). ``pad_others=False``: drawn without replacement from all
    samples (``rng.choice``), the rule before 2026-12-07 (:data:`LEGACY_PAD`), under which a
    rank was often given one of its own samples (in 1665 of 3000 epochs of 100 samples on 3
    ranks), delivering it twice.

    A tail group is read by every rank whose piece touches it: pieces are consecutive, so at
    most ``world_size - 1`` groups are split, plus one group per padded sample.

    Returns, for each rank, ``(group, lo, count)``: the rank's pieces, each the samples
    ``[lo, lo + count)`` (positions within the group) of group ``group`` — its whole groups in
    visiting order, then its (at most two) partial pieces, then its padded samples. Pure.
    """
    counts = np.asarray(counts, dtype=np.int64)
    w = int(world_size)
    n_groups, total = len(counts), int(counts.sum())
    share = rank_shares(total, w, remainder)
    rounds_max = n_groups // w
    cum = np.cumsum(counts[: rounds_max * w].reshape(rounds_max, w), axis=0)
    fits = (cum <= share).all(axis=1)
    rounds = int(rounds_max if fits.all() else np.argmin(fits))
    owned = cum[rounds - 1] if rounds else np.zeros(w, dtype=np.int64)
    need = share - owned
    cuts = np.concatenate([[0], np.cumsum(need)])
    tail = np.arange(rounds * w, n_groups, dtype=np.int64)
    tail_end = np.cumsum(counts[tail])
    tail_start = tail_end - counts[tail]
    n_tail = int(tail_end[-1]) if len(tail) else 0
    n_pad = max(0, int(cuts[-1]) - n_tail)
    pads = np.zeros(0, dtype=np.int64)
    if n_pad:
        # without replacement, unless fewer samples than pads are left (an elastic remainder)
        rng = np.random.default_rng([*map(int, pad_seed), 2])
        ends = np.cumsum(counts)
        if pad_others:
            tail_first = int(ends[rounds * w - 1]) if rounds else 0

            def rank_at(pos: int) -> int:  # the rank sample ``pos`` goes to
                if pos < tail_first:  # a whole group's: round-robin
                    return int(np.searchsorted(ends, pos, side="right")) % w
                return int(np.searchsorted(cuts, pos - tail_first, side="right")) - 1

            receivers = np.searchsorted(cuts, n_tail + np.arange(n_pad), side="right") - 1
            flat = _draw_outside(total, rank_at, receivers, rng)
        else:
            flat = rng.choice(total, n_pad, replace=n_pad > total)
        pad_group = np.searchsorted(ends, flat, side="right")
        pads = np.stack([pad_group, flat - (ends[pad_group] - counts[pad_group])], axis=1)
    out = []
    for r in range(w):
        mine = np.arange(rounds, dtype=np.int64) * w + r
        groups, los, sizes = [mine], [np.zeros(rounds, dtype=np.int64)], [counts[mine]]
        a, b = int(cuts[r]), int(cuts[r + 1])
        ta, tb = min(a, n_tail), min(b, n_tail)
        if tb > ta:
            sel, lo, hi = _covered(tail_start, tail_end, ta, tb)
            # whole tail chunks first, then the (at most two) partial pieces: a rank's ledger
            # is whole chunks up to its last block (what schedule_floors relies on)
            partial = (hi - lo) < counts[tail[sel]]
            keep = np.concatenate([np.flatnonzero((hi > lo) & ~partial), np.flatnonzero(partial)])
            groups.append(tail[sel][keep])
            los.append(lo[keep])
            sizes.append((hi - lo)[keep])
        pa, pb = max(a, n_tail) - n_tail, max(b, n_tail) - n_tail
        if pb > pa:
            groups.append(pads[pa:pb, 0])
            los.append(pads[pa:pb, 1])
            sizes.append(np.ones(pb - pa, dtype=np.int64))
        out.append(tuple(np.concatenate(x).astype(np.int64) for x in (groups, los, sizes)))
    return out  # type: ignore[return-value]


def deal_runs(
    counts: np.ndarray,
    axis: np.ndarray,
    world_size: int,
    *,
    remainder: str = "drop",
    rng: np.random.Generator | None = None,
    store_order: bool = True,
    pad_rng: np.random.Generator | None = None,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Deal ``counts[g]`` samples of each group ``g`` (a chunk, in visiting order) to ranks as
    contiguous runs along the sample axis; ``axis[g]`` is group ``g``'s place on it (its
    chunk index: distinct, and each group's samples lie between its neighbours').

    The samples are laid end to end in axis order and cut into ``world_size`` consecutive
    *segments*, one per rank, each of the :func:`samples_per_rank` samples of the rank it goes
    to (so, with ``"uneven"``, one more for the first ``sum(counts) % world_size`` ranks, and
    nothing sits out or repeats):

    * ``"drop"``: the ``sum(counts) % world_size`` samples left over sit out as one run at one
      of the ``world_size + 1`` cuts (before the first segment, between two, after the last;
      a shuffled plan leaves none over: it drew its sit-out samples first, :func:`sit_out`);
    * ``"pad"``: ``(-sum(counts)) % world_size`` segments are one sample short and each takes,
      as its padded sample, a sample of the other segments drawn uniformly by ``pad_rng``
      (:func:`_draw_pads`), no two the same — each delivered twice, by two ranks, as
      ``"chunks"``' padded samples are; so, with ``rng``, over the epochs each sample is
      padded about equally often (a padded sample's window reads its own chunks, beyond the
      run's; without, the short segments are the last ones every epoch, and their own
      samples are never padded).
      Without ``pad_rng`` (the rule before 2026-12-07, :data:`LEGACY_PAD`), the sample just
      past its end (just before its start for the segment at the axis' end), delivered by it
      and by its neighbour: the samples at the cuts, the same few epoch after epoch.

    With ``rng`` (a shuffled epoch) the sit-out cut, the short segments and which rank gets
    which segment are drawn from it (in that order; ``"uneven"`` draws only the last); without,
    the sit-out run is the axis' last samples, the short segments the last ones, and rank ``r``
    gets segment ``r``.

    Returns, for each rank, ``(group, lo, count)`` as :func:`deal` does: the rank's pieces, its
    whole groups in visiting order, then its (at most two) partial pieces in axis order, then
    its padded sample (a piece of its own) — except unshuffled (``rng=None`` with the groups
    visited in axis order), where the run's pieces are in axis order, its first partial piece
    first, so that each rank sweeps its share in store order (``store_order=False``: as
    shuffled, the rule before 2026-12-07, for an epoch resumed from a state saved by it). Runs
    do not share a sample, so two ranks read a group in common only where a cut falls inside
    it, or a window reaches across a cut. Pure.
    """
    counts = np.asarray(counts, dtype=np.int64)
    w = int(world_size)
    total = int(counts.sum())
    share = samples_per_rank(total, w, remainder)
    by_axis = np.argsort(np.asarray(axis), kind="stable")
    ends = np.cumsum(counts[by_axis])
    starts = ends - counts[by_axis]
    sizes = np.full(w, share, dtype=np.int64)
    lead = np.zeros(w, dtype=np.int64)  # samples sitting out before each segment
    n_pad = w * share - total
    if remainder == "pad":
        short = rng.choice(w, n_pad, replace=False) if rng is not None else np.arange(w - n_pad, w)
        sizes[short] -= 1
    elif remainder == "drop":
        cut = int(rng.integers(w + 1)) if rng is not None else w
        if cut < w:
            lead[cut] = total - w * share
    owner = rng.permutation(w) if rng is not None else np.arange(w)  # segment -> rank
    if remainder == "uneven":  # each segment the size of the rank it goes to
        sizes = rank_shares(total, w, remainder)[owner]
    seg_start = np.cumsum(lead + sizes) - sizes
    segment_of = np.argsort(owner)  # rank -> segment
    # each segment's padded sample, if short: one of its own, drawn (rank-independent)
    drawn = None
    if pad_rng is not None and remainder == "pad":
        drawn = _draw_pads(seg_start, sizes, share, total, pad_rng)
    out = []
    for r in range(w):
        s = int(segment_of[r])
        a, b = int(seg_start[s]), int(seg_start[s] + sizes[s])
        empty = np.zeros(0, dtype=np.int64)
        groups, los, cnts = [empty], [empty], [empty]
        if b > a:
            sel, lo, hi = _covered(starts, ends, a, b)
            got = hi > lo
            sel, lo, hi = sel[got], lo[got], hi[got]
            whole = (hi - lo) == counts[by_axis[sel]]
            w_idx = np.flatnonzero(whole)
            w_idx = w_idx[np.argsort(by_axis[sel[w_idx]], kind="stable")]  # visiting order
            if store_order and rng is None and np.all(np.diff(by_axis[sel]) > 0):
                # unshuffled (groups visited in axis order): the run in axis order, so an
                # evaluation sweeps each rank's share in store order (its first piece first)
                keep = np.arange(len(sel))
            else:
                keep = np.concatenate([w_idx, np.flatnonzero(~whole)])
            groups.append(by_axis[sel[keep]])
            los.append(lo[keep])
            cnts.append((hi - lo)[keep])
        if remainder == "pad" and sizes[s] < share:  # short: its padded sample lies past one end
            pad = drawn[s] if drawn is not None else (b if b < total else a - 1)
            g = int(np.searchsorted(ends, pad, side="right"))
            groups.append(by_axis[[g]])
            los.append(np.array([pad - starts[g]], dtype=np.int64))
            cnts.append(np.ones(1, dtype=np.int64))
        out.append(tuple(np.concatenate(x).astype(np.int64) for x in (groups, los, cnts)))
    return out  # type: ignore[return-value]


def _draw_outside(
    total: int, rank_at: Callable[[int], int], receivers: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """One of ``total`` sample positions for each of ``receivers`` (ranks, in order), drawn
    uniformly by ``rng`` among those ``rank_at`` does not give to that rank, no two the same —
    but where a few draws find none (few samples left: an elastic remainder), the last one
    drawn. A few draws per receiver."""
    out: list[int] = []
    for receiver in receivers.tolist():
        for _ in range(64):
            pos = int(rng.integers(total))
            if rank_at(pos) != receiver and pos not in out:
                break
        out.append(pos)
    return np.asarray(out, dtype=np.int64)


def _draw_pads(
    seg_start: np.ndarray, sizes: np.ndarray, share: int, total: int, rng: np.random.Generator
) -> dict[int, int]:
    """The padded sample of each short segment (``sizes[s] < share``), segment ``s`` the samples
    ``[seg_start[s], seg_start[s] + sizes[s])`` of ``total``: drawn uniformly by ``rng`` from the
    other segments' samples, segment after segment, a sample drawn before drawn again (only
    where few samples are left: an elastic remainder). O(1) per padded sample."""
    out: dict[int, int] = {}
    for s in np.flatnonzero(sizes < share).tolist():
        a, n = int(seg_start[s]), int(sizes[s])
        others = total - n
        for _ in range(64):  # (another draw while it repeats one)
            x = int(rng.integers(others)) if others else int(rng.integers(total))
            pad = x + n if others and x >= a else x
            if pad not in out.values():
                break
        out[s] = pad
    return out


def check_remainder(remainder: Any) -> str:
    """``remainder`` if it is one of :data:`REMAINDERS`, else ``ValueError``/``TypeError``."""
    if not isinstance(remainder, str):
        raise TypeError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    if remainder not in REMAINDERS:
        raise ValueError(
            "remainder must be 'drop' (at most world_size - 1 samples sit out each epoch), "
            "'pad' (at most world_size - 1 are repeated) or 'uneven' (every sample once; the "
            f"ranks' batch counts may differ by one), got {remainder!r}"
        )
    return remainder


def default_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised ``torch.distributed`` group, else ``(0, 1)``."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return 0, 1


def alone_before_group(world_size: int | None) -> bool:
    """Whether a plan given ``world_size`` (``None``: the group's) reads the whole split alone
    only because no ``torch.distributed`` group is initialised yet (see
    :func:`check_still_alone`)."""
    return world_size is None and default_rank_world() == (0, 1)


def check_still_alone(alone: bool) -> None:
    """``RuntimeError`` when a plan built :func:`alone_before_group` starts an epoch inside an
    initialised group of several ranks: it took ``world_size=1``, so every rank of the group
    would deliver the whole split (a prediction or test on ``W`` ranks ``W`` times over, a
    training's ranks the same batches). Asked where each epoch starts (one call, no
    per-batch cost)."""
    if not alone:
        return
    rank, world = default_rank_world()
    if world > 1:
        raise RuntimeError(
            "this pipeline was built before torch.distributed was initialised, so it took "
            f"world_size=1, and it is read on rank {rank} of {world}: every rank would deliver "
            "the whole split. Build it once the group is initialised, or pass rank and "
            "world_size (world_size=1 to read the whole split on every rank on purpose). With "
            "Lightning, pass the data module (trainer.predict(model, datamodule=dm)): its "
            "loaders are built inside the trainer, where dataloaders=dm.predict_dataloader() "
            "called before it builds them for one rank"
        )


def resolve_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` of a plan, each ``None`` taken from the initialised
    ``torch.distributed`` group, else ``0`` and ``1``.

    ``world_size`` given with ``rank=None`` takes the group's rank when the group has that
    world size (every rank of it then reads its own share), ``0`` with one rank or without a
    group; a group of another size leaves the rank ambiguous: ``ValueError`` asking for it.
    ``rank`` given with ``world_size=None`` takes the group's world size; outside
    ``[0, world_size)`` it is a ``ValueError`` saying where the world size came from.
    """
    d_rank, d_world = default_rank_world()
    grouped = d_world > 1 or d_rank > 0  # (an initialised group of one is rank 0 of 1 anyway)
    world = d_world if world_size is None else int(world_size)
    if rank is not None:
        rk = int(rank)
    elif world == 1 or not grouped:
        rk = 0
    elif world == d_world:
        rk = d_rank
    else:
        raise ValueError(
            f"rank=None with world_size={world}: the torch.distributed group has "
            f"{d_world} ranks, so its rank ({d_rank}) is not a rank of {world}; pass rank "
            "explicitly (or world_size=None to take both from the group)"
        )
    if world < 1 or not 0 <= rk < world:
        source = (
            f"world_size={world}"
            if world_size is not None
            else f"world_size=None took {world} from "
            + ("the torch.distributed group" if grouped else "no torch.distributed group")
        )
        raise ValueError(
            f"need 0 <= rank < world_size, got rank={rk} and {source}; pass world_size with rank"
        )
    return rk, world


# What a read plan's config keys say, in words (the others are PlanConfig's field names).
_PLAN_KEYS = {"missing_steps": "the steps dropped as missing", "dataset": "the manifest or views"}


def check_same_plans(plans: Sequence[Mapping[str, Any]], why: str) -> None:
    """Raise ``ValueError`` when the ranks of a ``torch.distributed`` group built different
    read plans: they would deliver different numbers of batches, and DDP would hang at the
    first collective one rank waits for alone.

    ``plans`` holds every rank's ``{"config": ReadPlanNode.config(), "dropped": its anchors
    dropped per reason}`` as JSON values, in rank order: the builder exchanges them with each
    rank's outcome (one ``all_gather_object``, :mod:`~insitubatch_nodes.ranks_agree`), so every
    rank raises alike. ``why`` says what the ranks read on their own. The message names the
    ranks whose plan differs from rank 0's, and in what."""
    first = plans[0]["config"]
    differ = {
        r: sorted(_PLAN_KEYS.get(k, k) for k in {*p["config"], *first}
                  if p["config"].get(k) != first.get(k))
        for r, p in enumerate(plans)
        if p["config"] != first
    }  # fmt: skip
    if not differ:
        return
    drops = ", ".join(
        f"rank {r} {({k: n for k, n in p['dropped'].items() if n}) or 'none'}"
        for r, p in enumerate(plans)
    )
    raise ValueError(
        "the ranks built different read plans, so they would deliver different numbers of "
        "batches and DDP would hang: "
        + "; ".join(f"rank {r} differs from rank 0 in {', '.join(ks)}" for r, ks in differ.items())
        + f" (anchors dropped: {drops}). {why}"
    )
