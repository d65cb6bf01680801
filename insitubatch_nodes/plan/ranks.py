"""Dealing an epoch's samples between ranks: every rank the same number of samples.

Whole chunks go round-robin while they last, then consecutive pieces of the remaining
(*tail*) chunks' samples; ``remainder`` says what happens to the at most ``world_size - 1``
samples that do not divide evenly (``"drop"``: they sit out; ``"pad"``: some repeat).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "REMAINDERS",
    "check_remainder",
    "deal",
    "default_rank_world",
    "samples_per_rank",
]


REMAINDERS = ("drop", "pad")


def samples_per_rank(n_samples: int, world_size: int, remainder: str = "drop") -> int:
    """Samples each of ``world_size`` ranks emits from ``n_samples``: ``floor`` (``"drop"``:
    at most ``world_size - 1`` sit out) or ``ceil`` (``"pad"``: at most ``world_size - 1``
    are repeated) of ``n_samples / world_size``."""
    if remainder == "pad":
        return -(-n_samples // world_size)
    return n_samples // world_size


def deal(
    counts: np.ndarray,
    world_size: int,
    *,
    remainder: str = "drop",
    pad_seed: Sequence[int] = (0,),
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Deal ``counts[g]`` samples of each group ``g`` (a chunk, in visiting order) to ranks.

    Each rank gets exactly :func:`samples_per_rank` samples. Whole groups are dealt
    round-robin (group ``k * world_size + r`` to rank ``r``) for as many rounds as no rank
    goes over its share; the samples of the groups left (the *tail*) are then laid end to end
    and cut into consecutive pieces, rank 0 first, each rank taking what its share still
    lacks. ``"drop"``: the last ``sum(counts) % world_size`` tail samples sit out.
    ``"pad"``: ``(-sum(counts)) % world_size`` samples, drawn without replacement from all
    samples by ``numpy.random.default_rng([*pad_seed, 2])`` (with replacement only when there
    are fewer samples than pads), are appended to the tail (each a
    piece of its own), so none sits out and those few are delivered twice.

    A tail group is read by every rank whose piece touches it: pieces are consecutive, so at
    most ``world_size - 1`` groups are split, plus one group per padded sample.

    Returns, for each rank, ``(group, lo, count)``: the rank's pieces, each the samples
    ``[lo, lo + count)`` (positions within the group) of group ``group`` — its whole groups in
    visiting order, then its (at most two) partial pieces, then its padded samples. Pure.
    """
    counts = np.asarray(counts, dtype=np.int64)
    w = int(world_size)
    n_groups, total = len(counts), int(counts.sum())
    share = samples_per_rank(total, w, remainder)
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
        flat = rng.choice(total, n_pad, replace=n_pad > total)
        ends = np.cumsum(counts)
        pad_group = np.searchsorted(ends, flat, side="right")
        pads = np.stack([pad_group, flat - (ends[pad_group] - counts[pad_group])], axis=1)
    out = []
    for r in range(w):
        mine = np.arange(rounds, dtype=np.int64) * w + r
        groups, los, sizes = [mine], [np.zeros(rounds, dtype=np.int64)], [counts[mine]]
        a, b = int(cuts[r]), int(cuts[r + 1])
        ta, tb = min(a, n_tail), min(b, n_tail)
        if tb > ta:
            first = int(np.searchsorted(tail_end, ta, side="right"))
            last = int(np.searchsorted(tail_end, tb - 1, side="right"))
            sel = np.arange(first, last + 1)
            lo = np.maximum(tail_start[sel], ta) - tail_start[sel]
            hi = np.minimum(tail_end[sel], tb) - tail_start[sel]
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


def check_remainder(remainder: Any) -> str:
    """``remainder`` if it is one of :data:`REMAINDERS`, else ``ValueError``/``TypeError``."""
    if not isinstance(remainder, str):
        raise TypeError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    if remainder not in REMAINDERS:
        raise ValueError(
            f"remainder must be 'drop' (at most world_size - 1 samples sit out each epoch) or "
            f"'pad' (at most world_size - 1 are repeated), got {remainder!r}"
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
