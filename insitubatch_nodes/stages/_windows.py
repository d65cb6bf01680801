"""Assembling patches: each row's window copied out of the tiles it touches.

A patched array's slots hold one stored tile each (a *unit*, see
:mod:`~insitubatch_nodes.plan.patches`). A window that straddles tile edges is put together
from up to ``2 ** n_patch_axes`` of them (more when the window is larger than a tile): one
rectangle per ``(row, tile)`` pair, worked out for the whole batch at once in numpy. Rows
that read one unit *alike* — the same rectangle shape at the same place in the window: every
window wholly in the tile, or cut by its edge at the same place — are copied together,
:data:`ALIKE_ROWS` or more at a time: one index of the slot's sliding windows (a view, no
copy) of the rectangle's shape for all of them, one assignment into the batch. So the Python
work is per (unit, rectangle shape), bounded by the tiles and the window's extent whatever
the batch's rows: (2, 4) windows of (4, 8) fields cost 71,000 Python lines per batch of
4,096 rows when each pair was a slice assignment, 1,500 now, as for 64 rows; (2, 3) windows
across (2, 4) tiles 128,000 and 3,300. The index makes a temporary that the assignment
copies again (numpy has no gather of many windows into a strided destination in one call),
so a group goes :data:`WINDOW_SCRATCH_BYTES` at a time, and rectangles of
:data:`WINDOW_ROW_BYTES` or more are not grouped: like rows in smaller groups, they take one
slice assignment per pair, straight from the slot into the batch (about a microsecond each,
cheaper than a group's numpy calls for a handful of rows, or than a second copy of a large
one; a masked fancy index per unit was slower still). A view also
selected along unpatched axes (levels of a patched field) works out what each piece's tile
holds of the selection once per piece — a slice where the entries lie evenly in the slot —
then takes rows alike a group at a time as above (a list of uneven entries indexed with the
rows, so the temporary holds only what the batch does), and the others with one indexing
per pair (an uneven list one slice per evenly spaced run of it) (measured before the windows
went by group: 13 of 37 levels stored whole in each object, 48 x 96 windows of 32 x 64
tiles, batches of 16: 2.0-2.3 ms per batch from slots that keep the 13 levels, against
11-15 ms when each pair built its index arrays over slots that held all 37).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held, as_slice, even_runs
from insitubatch_nodes.plan.patches import WindowUnits

__all__ = ["ALIKE_ROWS", "WINDOW_ROW_BYTES", "WINDOW_SCRATCH_BYTES", "gather_windows"]

ALIKE_ROWS = 8
"""Rows that read one unit alike are gathered together when there are at least this many: a
group's numpy calls (the sliding windows, the index, the assignment) cost about as much as
eight rows' slice copies one by one (about 1.5 us each; a group of two or three cost 2-3x the
pair-by-pair time per row on 64 x 64 tiles)."""

WINDOW_ROW_BYTES = 32 * 2**10
"""Rectangles (a window's part in one tile, every selected level) of at least this many bytes
are copied pair by pair, each straight from its slot into the batch: one copy. A group's
index of the sliding windows makes a temporary of its rows, which the assignment copies
again; from about this size on that second copy costs more than a slice assignment's Python
per pair. Measured, grouped against pair by pair, windows in (64, 128) tiles, batches of 64
and 256 rows: 14 KiB 295 / 675 us against 353 / 991; 18 KiB 324 / 1,122 against 375 /
1,677; 24 KiB 391 / 1,967 against 416 / 1,513; 32 KiB 657 / 2,998 against 581 / 2,339;
55 KiB 1,012 / 4,508 against 705 / 3,326 (this VM, 2026-12-07, other work beside it). The
Python work of such windows is per row (about 17 lines each: 3,247 lines per batch of 64,
6,487 of 256), as :func:`~insitubatch_nodes.stages.gather.take_rows` takes rows of 8 KiB or
more one by one: each row's copy outweighs it."""

WINDOW_SCRATCH_BYTES = 2**20
"""A group's rows are indexed this many bytes at a time at most (and :data:`ALIKE_ROWS` at
least): the temporary an index makes, copied into the batch right after, stays this small
however many rows the batch has."""


def gather_windows(
    out: np.ndarray,
    samples: np.ndarray,
    origins: np.ndarray,
    view: ArrayGeometry,
    slots: Mapping[tuple[str, int], np.ndarray],
    held: Held | None = None,
) -> int:
    """Fill ``out[i]`` with the window of sample ``samples[i]`` at ``origins[i]`` (physical
    order of the patched axes) from the unit slots of ``view``'s array; the rows copied.
    ``held``: the indices the slots keep along unpatched axes stored whole in each object
    (:func:`~insitubatch_nodes.io.selection.held_by_path`), else ``None``: the whole tile.

    Which tiles each window overlaps is the read plan's own rule
    (:meth:`~insitubatch_nodes.plan.patches.WindowUnits.pieces`), so the gather copies from
    exactly the units the plan had fetched."""
    spec = view.patch
    assert spec is not None
    base = view.base
    units = WindowUnits(base, spec, [0])
    spc = base.samples_per_chunk
    chunk = samples // spc
    at = samples - chunk * spc  # each row's sample within its chunk
    sizes = base.tile_shape
    spans = units.spans(origins)
    path = base.path
    if view.select is not None:  # patched, and selected along other axes
        _select_windows(out, at, chunk, origins, view, units, spans, slots, held)
        return len(samples)
    assert held is None, "a view that selects nothing reads slots that hold everything"
    k = len(sizes)
    patched = [f for f in range(k) if units.patched(f)]
    layout = None  # (the same for every piece: the patched axes' parts are per row)
    for rows, tile in units.pieces(origins, spans):
        keys = chunk[rows] * base.n_tiles + units.tile_index(tile, len(rows))
        # per axis: the overlap in field coordinates, then where it lies in the slot and in
        # the window
        src_lo, src_hi, dst_lo = [], [], []
        for (start, stop), tc, size in zip(spans, tile, sizes, strict=True):
            t0 = tc * size
            lo = np.maximum(start[rows], t0)
            hi = np.minimum(stop[rows], t0 + size)
            src_lo.append(lo - t0)
            src_hi.append(hi - t0)
            dst_lo.append(lo - start[rows])
        # rows alike (one unit, one overlap with it) a group at a time; the others pair by
        # pair. Along an unpatched axis every row of the piece takes the same part of the tile
        part: list[Any] = [None] * k
        place: list[Any] = [None] * k
        for f in range(k):
            if f not in patched:
                s0, s1, d0 = int(src_lo[f][0]), int(src_hi[f][0]), int(dst_lo[f][0])
                part[f], place[f] = slice(s0, s1), slice(d0, d0 + s1 - s0)
        layout = layout or _layout(part, place)
        lo_hi = [(src_lo[f], src_hi[f], dst_lo[f]) for f in patched]
        cut = _gather_alike(out, at, rows, keys, lo_hi, part, place, [], base, slots, layout)
        if not len(cut):
            continue
        s_lo, s_hi, d_lo = ([a[cut].tolist() for a in part] for part in (src_lo, src_hi, dst_lo))
        within = at[rows[cut]].tolist()
        for j, (r, u) in enumerate(zip(rows[cut].tolist(), keys[cut].tolist(), strict=True)):
            src = slots[(path, u)]
            s_box: tuple[Any, ...] = tuple(slice(s_lo[f][j], s_hi[f][j]) for f in range(k))
            d_box: tuple[Any, ...] = tuple(
                slice(d_lo[f][j], d_lo[f][j] + s_hi[f][j] - s_lo[f][j]) for f in range(k)
            )
            out[(r, *d_box)] = src[(within[j], *s_box)]
    return len(samples)


def _alike(
    keys: np.ndarray, lengths: list[np.ndarray], places: list[np.ndarray]
) -> tuple[list[tuple[np.ndarray, int, list[int], list[int]]], np.ndarray]:
    """Rows that read one unit alike (the same ``keys``, and per patched axis the same
    rectangle length and place in the window), in groups of :data:`ALIKE_ROWS` or more: per
    group its positions, unit key, lengths and places; and the positions of the other rows,
    ascending."""
    alike = np.stack([keys, *lengths, *places], axis=1)
    order = np.lexsort(alike.T[::-1])
    ordered = alike[order]
    bounds = np.flatnonzero(np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1), True])
    sizes = np.diff(bounds)
    big = sizes >= ALIKE_ROWS
    k = len(lengths)
    groups = []
    for lo, hi in zip(bounds[:-1][big].tolist(), bounds[1:][big].tolist(), strict=True):
        key, *shape = ordered[lo].tolist()
        groups.append((order[lo:hi], key, shape[:k], shape[k:]))
    return groups, np.sort(order[np.repeat(~big, sizes)])


def _select_windows(
    out: np.ndarray,
    within: np.ndarray,
    chunk: np.ndarray,
    origins: np.ndarray,
    view: ArrayGeometry,
    units: WindowUnits,
    spans: list[tuple[np.ndarray, np.ndarray]],
    slots: Mapping[tuple[str, int], np.ndarray],
    held: Held | None,
) -> None:
    """:func:`gather_windows` of a patched view selected along unpatched axes (a patched axis
    takes no selection: the view refuses it). All rows of one piece share its tile along every
    unpatched axis, so what that tile holds of each selection — the entries within it and their
    places in the selection (an index drops the axis) — is worked out once per piece; each
    ``(row, tile)`` pair then takes one indexing of its slot (and one ``take`` per listed
    axis) and one assignment."""
    assert view.select is not None
    base = view.base
    keys, sizes = view.select.keys, base.tile_shape
    # along a held axis a slot keeps some indices, side by side: an index's place among them
    place: list[dict[int, int] | None] = [None] * len(keys)
    if held is not None:
        place = [None if h is None else {v: i for i, v in enumerate(h)} for h in held]
    for rows, tile in units.pieces(origins, spans):
        src: list[Any] = []  # per field axis: the tile's part (None: the row's window)
        dst: list[Any] = []  # per axis of the delivered window (an index drops the axis)
        takes: list[tuple[int, np.ndarray]] = []  # (axis of the cut slot, indices) per list
        for f, key in enumerate(keys):
            t0 = int(tile[f][0]) * sizes[f]
            if units.patched(f):  # (no selection here) the row's window, per row
                src.append(None)
                dst.append(None)
            elif key is None:  # a whole unpatched axis: the tile's part of it, in its place
                hi = min(int(spans[f][1][0]), t0 + sizes[f])
                src.append(slice(0, hi - t0))
                dst.append(slice(t0, hi))
            else:
                wanted = [key] if isinstance(key, int) else list(key)
                at = [i for i, k in enumerate(wanted) if t0 <= k < t0 + sizes[f]]
                if not at:
                    break  # the tile holds none of the selection: nothing to copy
                where = place[f]
                inside = [wanted[i] - t0 if where is None else where[wanted[i]] for i in at]
                if isinstance(key, int):
                    src.append(inside[0])  # drops the axis, in the cut and in the window
                    continue
                taken = as_slice(np.asarray(inside, np.intp))
                if isinstance(taken, slice):  # evenly spaced in the slot: a view
                    src.append(taken)
                else:  # uneven in the slot: taken from it by an index
                    takes.append((len(dst), taken))
                    src.append(slice(None))
                runs = at == list(range(at[0], at[-1] + 1))
                dst.append(slice(at[0], at[-1] + 1) if runs else np.asarray(at, np.intp))
        else:
            _copy_piece(out, within, chunk, rows, tile, units, spans, slots, base, src, dst,
                        takes)  # fmt: skip


def _copy_piece(
    out: np.ndarray,
    within: np.ndarray,
    chunk: np.ndarray,
    rows: np.ndarray,
    tile: tuple[np.ndarray, ...],
    units: WindowUnits,
    spans: list[tuple[np.ndarray, np.ndarray]],
    slots: Mapping[tuple[str, int], np.ndarray],
    base: ArrayGeometry,
    src: list[Any],
    dst: list[Any],
    takes: list[tuple[int, np.ndarray]],
) -> None:
    """One piece of :func:`_select_windows`: ``src``/``dst`` hold the piece's parts, ``None``
    along patched axes, filled per row with the window's overlap with the row's tile (rows
    alike a group at a time: :func:`_gather_alike`)."""
    keys = chunk[rows] * base.n_tiles + units.tile_index(tile, len(rows))
    per_row = [f for f, part in enumerate(src) if part is None]
    lo_hi = []
    for f in per_row:
        start, stop = spans[f][0][rows], spans[f][1][rows]
        t0 = tile[f] * base.tile_shape[f]
        lo, hi = np.maximum(start, t0), np.minimum(stop, t0 + base.tile_shape[f])
        lo_hi.append((lo - t0, hi - t0, lo - start))
    at_dst = [i for i, part in enumerate(dst) if part is None]
    # rows alike (one unit, one overlap with it) a group at a time; the others pair by pair
    cut = _gather_alike(out, within, rows, keys, lo_hi, src, dst, takes, base, slots)
    if not len(cut):
        return
    lo_hi = [tuple(a[cut].tolist() for a in part) for part in lo_hi]
    arrays = sum(isinstance(part, np.ndarray) for part in dst)
    at = within[rows[cut]].tolist()
    # one listed axis, in its place in the window: its evenly spaced runs, a view each
    runs, listed, into = [], 0, slice(0)
    if len(takes) == 1 and isinstance(dst[takes[0][0]], slice):
        axis, idx = takes[0]
        listed, into = (
            [f for f, part in enumerate(src) if not isinstance(part, int)][axis],
            dst[axis],
        )
        runs = [(axis, slice(into.start + i.start, into.start + i.stop), taken)
                for i, taken in even_runs(idx.tolist())]  # fmt: skip
    for j, (r, u) in enumerate(zip(rows[cut].tolist(), keys[cut].tolist(), strict=True)):
        for k, (f, d) in enumerate(zip(per_row, at_dst, strict=True)):
            s_lo, s_hi, d_lo = lo_hi[k]
            src[f] = slice(s_lo[j], s_hi[j])
            dst[d] = slice(d_lo[j], d_lo[j] + s_hi[j] - s_lo[j])
        if runs:  # straight from the slot, run by run
            row = slots[(base.path, u)][at[j]]
            for axis, place, taken in runs:
                src[listed], dst[axis] = taken, place
                out[r][tuple(dst)] = row[tuple(src)]
            src[listed], dst[axis] = slice(None), into
            continue
        piece = slots[(base.path, u)][at[j]][tuple(src)]
        for axis, idx in takes:
            piece = np.take(piece, idx, axis=axis)
        if arrays > 1:  # two listed axes out of order: an open mesh, not a broadcast
            mesh = [np.arange(p.start, p.stop) if isinstance(p, slice) else p for p in dst]
            out[r][np.ix_(*mesh)] = piece
        else:
            out[r][tuple(dst)] = piece
    for f in per_row:
        src[f] = None  # (the piece's parts as given, for the next caller)
    for d in at_dst:
        dst[d] = None


_Layout = tuple[list[int], tuple[int, ...], tuple[int, ...], list[int], bool, int]


def _layout(src: list[Any], dst: list[Any]) -> _Layout:
    """What :func:`_gather_alike` works out of a piece's parts (``src``/``dst``, as it takes
    them): the patched axes among the kept ones, the permutation that puts a gathered group's
    axes back in the field's order, the sliding windows' axes, the patched axes' places in
    ``dst``, whether a listed axis makes an open mesh, and how many axes are kept."""
    kept = [f for f, part in enumerate(src) if not isinstance(part, int)]  # an int drops it
    patched = [kept.index(f) for f, part in enumerate(src) if part is None]
    others = [i for i in range(len(kept)) if i not in patched]
    perm = (0, *(1 + (others + patched).index(i) for i in range(len(kept))))
    at_dst = [i for i, part in enumerate(dst) if part is None]
    mesh = any(isinstance(part, np.ndarray) for part in dst)
    return patched, perm, tuple(1 + i for i in patched), at_dst, mesh, len(kept)


def _gather_alike(
    out: np.ndarray,
    within: np.ndarray,
    rows: np.ndarray,
    keys: np.ndarray,
    lo_hi: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    src: list[Any],
    dst: list[Any],
    takes: list[tuple[int, np.ndarray]],
    base: ArrayGeometry,
    slots: Mapping[tuple[str, int], np.ndarray],
    layout: _Layout | None = None,
) -> np.ndarray:
    """The rows of a piece that read one unit alike — the same overlap with the tile along
    every patched axis (a window wholly in it, or cut by its edge at the same place) —
    :data:`ALIKE_ROWS` or more at a time. ``src``/``dst``: the piece's part of the tile and
    its place in the row along each field axis (``None`` along the patched axes; an int drops
    an axis, a list is taken by ``takes``), ``lo_hi``: per patched axis each row's rectangle
    in the tile and its place in the window. Per group, one index of the (selected) slot's
    sliding windows (a view) of the rectangle's shape takes every row's part (the listed
    axes' entries in the same index, so it holds just what the batch does), and one assignment
    puts them in the batch: two copies, the second out of cache. The positions (in ``rows``)
    of the rows left to copy one by one, straight into the batch: those in smaller groups, and
    those whose rectangle is :data:`WINDOW_ROW_BYTES` or more. ``layout``: :func:`_layout` of
    the parts, where the caller has it already."""
    patched, perm, axes, at_dst, mesh, n_kept = layout or _layout(src, dst)
    cut = tuple(slice(None) if part is None else part for part in src)
    lengths = [hi - lo for lo, hi, _ in lo_hi]
    groups, alone = _alike(keys, lengths, [place for _, _, place in lo_hi])
    # per kept axis: each row's start in the tile (a patched axis), or None (the whole part)
    starts = [lo_hi[patched.index(i)][0] if i in patched else None for i in range(n_kept)]
    whole = slice(None)
    lists: dict[int, np.ndarray] = {}  # listed axes: indexed with the rows, an outer product
    for j, (axis, idx) in enumerate(takes):
        lists[axis] = idx.reshape((1,) * (1 + j) + (-1,) + (1,) * (len(takes) - 1 - j))
    if lists:  # their axes come right after the rows' in what the index takes
        order = [*lists, *(i for i in range(n_kept) if i not in lists and i not in patched)]
        order += patched
        perm = (0, *(1 + order.index(i) for i in range(n_kept)))
    lead = (-1,) + (1,) * len(takes)  # the rows' index, broadcast against the lists
    straight = [alone]  # rows whose rectangles are large: each copied straight, by the caller
    for pick, key, extent, place in groups:
        slot = slots[(base.path, key)][(whole, *cut)]
        row = slot.itemsize * math.prod(extent)  # the bytes of one row's rectangle
        row *= math.prod(n for i, n in enumerate(slot.shape[1:]) if i not in patched)
        for axis, idx in takes:
            row = row // slot.shape[1 + axis] * len(idx)
        if row >= WINDOW_ROW_BYTES:
            straight.append(pick)
            continue
        windows = np.lib.stride_tricks.sliding_window_view(slot, extent, axis=axes)
        box = list(dst)
        for d, e, p in zip(at_dst, extent, place, strict=True):
            box[d] = slice(p, p + e)
        if mesh:  # a listed axis in the window: an open mesh over every axis
            spans = [np.arange(n)[p] if isinstance(p, slice) else p
                     for n, p in zip(out.shape[1:], box, strict=True)]  # fmt: skip
        block = max(ALIKE_ROWS, WINDOW_SCRATCH_BYTES // row)
        for b in range(0, len(pick), block):
            some = pick[b : b + block]
            index = [lists.get(i, whole) if lo is None else lo[some].reshape(lead)
                     for i, lo in enumerate(starts)]  # fmt: skip
            values = windows[(within[rows[some]].reshape(lead), *index)].transpose(perm)
            if mesh:
                out[np.ix_(rows[some], *spans)] = values
            else:
                out[(rows[some], *box)] = values
    return np.sort(np.concatenate(straight)) if len(straight) > 1 else alone
