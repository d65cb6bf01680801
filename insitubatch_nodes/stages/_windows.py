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
from itertools import product
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry

__all__ = ["gather_windows"]


def gather_windows(
    out: np.ndarray,
    samples: np.ndarray,
    origins: np.ndarray,
    view: ArrayGeometry,
    slots: Mapping[tuple[str, int], np.ndarray],
) -> int:
    """Fill ``out[i]`` with the window of sample ``samples[i]`` at ``origins[i]`` (physical
    order of the patched axes) from the unit slots of ``view``'s array; the rows copied."""
    spec = view.patch
    assert spec is not None
    base = view.base
    n = len(samples)
    spc = base.samples_per_chunk
    chunk = samples // spc
    within = (samples - chunk * spc).tolist()
    col = {a: i for i, a in enumerate(spec.axes)}
    tiles = base.tile_shape
    grid = base.tile_grid
    lows, highs, starts, ends, widths = [], [], [], [], []
    for f, a in enumerate(base.field_axes):
        t = tiles[f]
        if a in col:
            o = origins[:, col[a]].astype(np.int64)
            e = spec.extent[col[a]]
            widths.append(min(grid[f], (e - 1) // t + 2))
        else:
            o = np.zeros(n, dtype=np.int64)
            e = base.shape[a]
            widths.append(grid[f])
        lows.append(o // t)
        highs.append((o + e - 1) // t)
        starts.append(o)
        ends.append(o + e)
    unit_base = chunk * base.n_tiles
    path = base.path
    for d in product(*(range(w) for w in widths)):
        tile = [lo + dd for lo, dd in zip(lows, d, strict=True)]
        ok = np.ones(n, dtype=bool)
        for tc, hi in zip(tile, highs, strict=True):
            ok &= tc <= hi
        rows = np.flatnonzero(ok)
        if not len(rows):
            continue
        flat = (
            np.ravel_multi_index(tuple(tc[rows] for tc in tile), grid)
            if tile
            else np.zeros(len(rows), np.int64)
        )
        units = (unit_base[rows] + flat).tolist()
        # per axis: the rectangle in field coordinates, then in the slot and in the window
        src_lo, src_hi, dst_lo = [], [], []
        for f, tc in enumerate(tile):
            t0 = tc[rows] * tiles[f]
            lo = np.maximum(starts[f][rows], t0)
            hi = np.minimum(ends[f][rows], t0 + tiles[f])
            src_lo.append((lo - t0).tolist())
            src_hi.append((hi - t0).tolist())
            dst_lo.append((lo - starts[f][rows]).tolist())
        k = len(tile)
        for j, (r, u) in enumerate(zip(rows.tolist(), units, strict=True)):
            src = slots[(path, u)]
            s_box: tuple[Any, ...] = tuple(slice(src_lo[f][j], src_hi[f][j]) for f in range(k))
            d_box: tuple[Any, ...] = tuple(
                slice(dst_lo[f][j], dst_lo[f][j] + src_hi[f][j] - src_lo[f][j]) for f in range(k)
            )
            out[(r, *d_box)] = src[(within[r], *s_box)]
    return n
