"""The valid anchors of a split: which anchors a read plan draws, chunk by chunk.

**Valid anchors.** An anchor ``a`` of the split is emitted only if every view's sample
``a + offset`` lies in the array (in a collection's virtual array: in the anchor's own member,
never in its padding nor in another member, see ``manifest.members``) *and*, by default, on an
anchor-grid chunk of the same split (``(a + offset) // samples_per_chunk`` is one of the split's
chunks), so no window reads a sample of another split. ``cross_split_windows=True`` drops the
second condition (windows may read across the split's edge). A manifest drawn with a
``sample_range`` narrows both to that window: its anchors lie in it and, by default, so does
every step they read. In each chunk these anchors are
one contiguous run (:func:`chunk_counts`); the anchor stride and the missing-step checks
(:mod:`~insitubatch_nodes.plan.anchors`) then keep a subset of it, as one mask over the
sample axis (:func:`chunk_anchors`). Either way a chunk's count is a constant of the
configuration and every epoch, rank and resume stays exact.

Pure numpy, a function of the manifest, the views' offsets and the config only (no epoch, no
rank): :func:`chunk_counts` (each chunk's contiguous run), :func:`chunk_anchors` (the run narrowed
by the stride and the missing-step checks) and :func:`dropped_anchors` (what those checks drop,
per reason). :mod:`~insitubatch_nodes.plan.epoch` draws each epoch over them (and re-exports
them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.anchors import anchor_filter, dropped_counts, every_sample
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.splits import SplitManifest

__all__ = ["chunk_anchors", "chunk_counts", "dropped_anchors"]


def _valid_anchor_range(n_samples: int, offsets: Sequence[int]) -> tuple[int, int]:
    """Anchors ``a`` with ``0 <= a + k < n_samples`` for every offset ``k``."""
    lo = max(0, -min(offsets))
    hi = min(n_samples, n_samples - max(offsets))
    return lo, max(lo, hi)


def chunk_counts(
    manifest: SplitManifest,
    split: str,
    chunks: np.ndarray,
    offsets: Sequence[int],
    cross_split_windows: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """First valid anchor and number of valid anchors in each of ``chunks`` (see the module
    docstring for the rule). Element-wise: the order of ``chunks`` does not matter."""
    spc, n = manifest.samples_per_chunk, manifest.n_samples
    lo, hi = _valid_anchor_range(n, offsets)
    start = np.maximum(chunks * spc, lo)
    stop = np.minimum(np.minimum((chunks + 1) * spc, n), hi)
    if not cross_split_windows:
        member = np.zeros(manifest.n_chunks + 2, dtype=bool)  # index -1 and n_chunks: outside
        member[manifest.chunk_array(split)] = True

        def in_split(d: np.ndarray) -> np.ndarray:
            return member[np.clip(d, -1, manifest.n_chunks)]

        for k in set(offsets):
            # the samples a + k of chunk c's anchors fall in anchor-grid chunks d and d + 1;
            # anchors from `edge` on read d + 1
            d = (chunks * spc + k) // spc
            edge = (d + 1) * spc - k
            start = np.where(in_split(d), start, np.maximum(start, edge))
            stop = np.where(in_split(d + 1), stop, np.minimum(stop, edge))
    if manifest.sample_range is not None:  # a window: its anchors and, like a split's edge,
        lo_w, hi_w = manifest.sample_range  # every step they read (unless crossing is allowed)
        reach = (0, 0) if cross_split_windows else (min(offsets), max(offsets))
        start = np.maximum(start, max(lo_w, lo_w - reach[0]))
        stop = np.minimum(stop, min(hi_w, hi_w - reach[1]))
    if manifest.members is not None:  # a collection: every step inside the anchor's member
        first, end = manifest.members.sample_bounds(chunks, spc)
        start = np.maximum(start, first - min(offsets))
        stop = np.minimum(stop, end - max(offsets))
    if manifest.product is not None:  # product axes: never in an edge block's padding
        first, end = manifest.product.sample_bounds(chunks, spc)
        start = np.maximum(start, first - min(offsets))
        stop = np.minimum(stop, end - max(offsets))
    return start, np.maximum(stop - start, 0)


def chunk_anchors(
    manifest: SplitManifest,
    chunks: np.ndarray,
    offsets: Sequence[int],
    config: PlanConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, anchors)``: the number of valid anchors in each of ``chunks`` and the valid
    anchors laid out chunk after chunk (each chunk's ascending) — :func:`chunk_counts`' runs,
    narrowed by ``config.stride`` and the missing-step checks of ``manifest.steps`` (one
    vectorised mask, :func:`~insitubatch_nodes.plan.anchors.anchor_filter`)."""
    starts, counts = chunk_counts(
        manifest, config.split, chunks, offsets, config.cross_split_windows
    )
    anchors = _runs(starts, counts)
    keep, _ = anchor_filter(
        manifest.n_samples, offsets, config.stride, manifest.steps, _origins(manifest, config)
    )
    if keep is None:
        return counts, anchors
    ok = keep[anchors]
    owner = np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
    return np.bincount(owner[ok], minlength=len(chunks)).astype(np.int64), anchors[ok]


def _origins(manifest: SplitManifest, config: PlanConfig) -> np.ndarray | None:
    """Where an int stride counts from, per sample: each collection member's first sample
    (``None``: index 0 of the array)."""
    members = manifest.members
    if members is None or members.continuous:
        return None
    if not isinstance(config.stride, int) or every_sample(config.stride):
        return None
    return members.sample_base[members.member_of(np.arange(manifest.n_samples))]


def dropped_anchors(
    manifest: SplitManifest, views: Mapping[str, ArrayGeometry], config: PlanConfig
) -> dict[str, int]:
    """Anchors of ``config.split`` the missing-step checks drop, per reason
    (:data:`~insitubatch_nodes.plan.anchors.REASONS`; each anchor under its first reason; only
    the reasons checked): the split's on-stride anchors whose views read inside the array (and
    the split) but one of whose steps is missing. ``{}`` without ``manifest.steps``."""
    if manifest.steps is None:
        return {}
    offsets = [g.offset for g in views.values()]
    chunks = manifest.chunk_array(config.split)
    starts, counts = chunk_counts(
        manifest, config.split, chunks, offsets, config.cross_split_windows
    )
    _, dropped = anchor_filter(
        manifest.n_samples, offsets, config.stride, manifest.steps, _origins(manifest, config)
    )
    return dropped_counts(dropped, _runs(starts, counts))


def _runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1`` for each ``i``, end to end."""
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    pos = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - first[pos])
