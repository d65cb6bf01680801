"""Assembling patches: each row's window copied out of the tiles it touches.

A patched array's slots hold one stored tile each (a *unit*, see
:mod:`~insitubatch_nodes.plan.patches`). A window that straddles tile edges is put together
from up to ``2 ** n_patch_axes`` of them (more when the window is larger than a tile): one
rectangle copy per ``(row, tile)`` pair. The rectangles are worked out for the whole batch at
once in numpy; Python then issues one slice assignment per pair (about a microsecond each,
against a copy of ``tile_bytes / 4`` on average for windows half a tile wide).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.patches import WindowUnits

__all__ = ["gather_windows"]


def gather_windows(
    out: np.ndarray,
    samples: np.ndarray,
    origins: np.ndarray,
    view: ArrayGeometry,
    slots: Mapping[tuple[str, int], np.ndarray],
) -> int:
    """Fill ``out[i]`` with the window of sample ``samples[i]`` at ``origins[i]`` (physical
    order of the patched axes) from the unit slots of ``view``'s array; the rows copied.

    Which tiles each window overlaps is the read plan's own rule
    (:meth:`~insitubatch_nodes.plan.patches.WindowUnits.pieces`), so the gather copies from
    exactly the units the plan had fetched."""
    spec = view.patch
    assert spec is not None
    base = view.base
    units = WindowUnits(base, spec, [0])
    spc = base.samples_per_chunk
    chunk = samples // spc
    within = (samples - chunk * spc).tolist()
    sizes = base.tile_shape
    spans = units.spans(origins)
    path = base.path
    if view.select is not None:  # patched, and selected along other axes
        _select_windows(out, within, chunk, origins, view, units, spans, slots)
        return len(samples)
    for rows, tile in units.pieces(origins, spans):
        keys = (chunk[rows] * base.n_tiles + units.tile_index(tile, len(rows))).tolist()
        # per axis: the overlap in field coordinates, then where it lies in the slot and in
        # the window
        src_lo, src_hi, dst_lo = [], [], []
        for (start, stop), tc, size in zip(spans, tile, sizes, strict=True):
            t0 = tc * size
            lo = np.maximum(start[rows], t0)
            hi = np.minimum(stop[rows], t0 + size)
            src_lo.append((lo - t0).tolist())
            src_hi.append((hi - t0).tolist())
            dst_lo.append((lo - start[rows]).tolist())
        k = len(tile)
        for j, (r, u) in enumerate(zip(rows.tolist(), keys, strict=True)):
            src = slots[(path, u)]
            s_box: tuple[Any, ...] = tuple(slice(src_lo[f][j], src_hi[f][j]) for f in range(k))
            d_box: tuple[Any, ...] = tuple(
                slice(dst_lo[f][j], dst_lo[f][j] + src_hi[f][j] - src_lo[f][j]) for f in range(k)
            )
            out[(r, *d_box)] = src[(within[r], *s_box)]
    return len(samples)


def _select_windows(
    out: np.ndarray,
    within: list[int],
    chunk: np.ndarray,
    origins: np.ndarray,
    view: ArrayGeometry,
    units: WindowUnits,
    spans: list[tuple[np.ndarray, np.ndarray]],
    slots: Mapping[tuple[str, int], np.ndarray],
) -> None:
    """:func:`gather_windows` of a patched view selected along unpatched axes: per ``(row,
    tile)`` pair, the selected entries the tile holds along each selected axis (an index drops
    the axis), at their places in the selection; the window's box along the others."""
    assert view.select is not None
    base = view.base
    keys, sizes = view.select.keys, base.tile_shape
    for rows, tile in units.pieces(origins, spans):
        for j, r in enumerate(rows.tolist()):
            src: list[Any] = [within[r]]
            dst: list[Any] = [r]
            for f, key in enumerate(keys):
                start, stop = int(spans[f][0][r]), int(spans[f][1][r])
                t0 = int(tile[f][j]) * sizes[f]
                lo, hi = max(start, t0), min(stop, t0 + sizes[f])
                if key is None:
                    src.append(np.arange(lo - t0, hi - t0))
                    dst.append(np.arange(lo - start, hi - start))
                    continue
                wanted = [key] if isinstance(key, int) else list(key)
                at = [i for i, k in enumerate(wanted) if lo <= k < hi]
                if not at:
                    break  # the tile holds none of the selection: nothing to copy
                src.append(np.asarray([wanted[i] - t0 for i in at]))
                if not isinstance(key, int):
                    dst.append(np.asarray(at))
            else:
                unit = int(chunk[r]) * base.n_tiles + int(units.tile_index(
                    tuple(t[j : j + 1] for t in tile), 1)[0])  # fmt: skip
                picked = slots[(base.path, unit)][np.ix_([src[0]], *src[1:])]
                shape = (1, *(len(d) for d in dst[1:]))  # (a dropped axis has length 1)
                out[np.ix_([dst[0]], *dst[1:])] = picked.reshape(shape)
