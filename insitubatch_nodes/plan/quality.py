"""How well an order mixes the data, scored against a global shuffle."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["shuffle_quality"]


def shuffle_quality(
    order: np.ndarray | Sequence[np.ndarray], batch_size: int | None = None, *, seed: int = 0
) -> float:
    """Score how well batches mix the data, against a global shuffle: ~1 = global, 0 = none.

    ``order`` is either the batches as delivered (a sequence of 1-D arrays of sample indices,
    e.g. each batch's ``sample_indices[label]``; a short final batch is ignored) or the
    emitted sequence of sample indices (e.g. ``EpochPlan.anchors``), which is cut into
    consecutive batches of ``batch_size`` (required then). The score is the mean distance
    between two samples of the same batch, divided by the same mean when those samples are
    dealt into batches by a uniformly random permutation (averaged over 16 draws from
    ``seed``). Samples that share a chunk, or sit close together, drag it down: a sequential
    order scores ~0, batches drawn from a handful of chunks score low, and a global shuffle
    scores ~1. It does not depend on the order of rows
    inside a batch (which does not matter to a gradient step) and measures mixing within an
    epoch, not coverage across epochs.
    """
    if isinstance(order, np.ndarray) and order.ndim == 1:
        if batch_size is None:
            raise ValueError("a flat order needs batch_size= to be cut into batches")
        arr = order.astype(np.int64, copy=False)
    else:
        parts = [np.asarray(b, dtype=np.int64).ravel() for b in order]
        if batch_size is None:
            batch_size = max((len(b) for b in parts), default=0)
        full = [b for b in parts if len(b) == batch_size]
        arr = np.concatenate(full) if full else np.zeros(0, dtype=np.int64)
    if batch_size < 2:
        raise ValueError(f"batch_size must be >= 2 to measure mixing, got {batch_size}")
    n_full = arr.size // batch_size
    if n_full == 0 or np.unique(arr).size < 2:
        return 1.0

    def spread(seq: np.ndarray) -> float:
        batches = np.sort(seq[: n_full * batch_size].reshape(n_full, batch_size), axis=1)
        k = np.arange(batch_size, dtype=np.float64)
        # sum over pairs i < j of (x_j - x_i) for sorted rows = sum_j x_j * (2j - (k - 1))
        pair_sums = batches @ (2 * k - (batch_size - 1))
        return float(pair_sums.mean() / (batch_size * (batch_size - 1) / 2))

    rng = np.random.default_rng(seed)
    pool = np.sort(arr)  # the reference depends on which samples, not on their order
    ref = float(np.mean([spread(rng.permutation(pool)) for _ in range(16)]))
    return max(0.0, spread(arr) / ref) if ref > 0 else 1.0
