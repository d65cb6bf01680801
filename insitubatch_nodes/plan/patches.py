"""Patch origins and the stored tiles each window touches (pure numpy).

A patched plan's sample is ``(anchor, patch)``: an anchor along the sample axis and one of the
``P`` windows of the field (:class:`~insitubatch_nodes.io.geometry.Patches`). Its id is
``anchor * P + patch``. Patches are numbered once per configuration, *region by region*: the
field's home tiles (the stored tiles, along the patched axes, that windows start in) are
grouped into square regions of about ``block_tiles`` tiles, and a patch belongs to the region
its origin lies in. The plan's unit of shuffling is ``(anchor chunk, region)`` — a *patch
chunk* — so a block of the shuffle reads one region's tiles (plus the rim its windows reach
into), and each region holds the same number of patches every epoch.

Grid origins are fixed. Random origins are drawn per ``(seed, epoch, sample id, axis)`` by a
counter-based hash, uniform within the patch's home tile: the same origins whatever the rank,
world size or resume point, without storing a table.

:class:`WindowUnits` turns rows ``(anchor, origin)`` into the *units* one array's windows read:
``unit = chunk * n_tiles + tile`` (the tile raveled in C order over the array's tile grid), one
stored object each — what the pool holds a slot for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from itertools import permutations, product

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry, Patches
from insitubatch_nodes.io.selection import held_indices

__all__ = [
    "PatchLayout",
    "WindowUnits",
    "patch_spec",
    "region_count",
    "touched_tiles",
    "unit_chunk_tile",
    "unit_geometry",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def patch_spec(views: Mapping[str, ArrayGeometry]) -> Patches | None:
    """The one :class:`Patches` every patched view of ``views`` shares (the first one's
    grouping tiling), or ``None`` when no view is patched. Raises ``ValueError`` when patched
    views cut their fields differently (their origins could not be shared row for row)."""
    specs = [(label, g.patch) for label, g in views.items() if g.patch is not None]
    if not specs:
        return None
    first_label, first = specs[0]
    for label, spec in specs[1:]:
        assert spec is not None and first is not None
        differ = first.differences(spec)
        if differ:
            raise ValueError(
                f"patched views {first_label!r} and {label!r} cut their fields differently: "
                f"they differ in {differ}; views read together take the same origins, so "
                "patch them with the same dimensions (or axes), extent, field length, origins, "
                "stride and within box"
            )
    return first


def _uniform(keys: np.ndarray, seed: int, epoch: int, axis: int) -> np.ndarray:
    """A uniform float in [0, 1) per key: splitmix64 of the key under ``(seed, epoch, axis)``."""
    salt = np.random.SeedSequence([seed, epoch, 9, axis]).generate_state(1, np.uint64)[0]
    z = keys.astype(np.uint64) * _GOLDEN + np.uint64(salt)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _regions(
    spec: Patches, block_tiles: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...], int, tuple[int, ...]]:
    """``(first, last, home0, home_grid, side, region_grid)`` of :class:`PatchLayout`: the
    origins' first and last along each axis (every window within the bounds), the first home
    tile, the home tiles per axis, the region's side in tiles and the regions per axis."""
    first = np.asarray([lo for lo, _ in spec.bounds], dtype=np.int64)
    last = np.asarray([hi - e for (_, hi), e in zip(spec.bounds, spec.extent, strict=True)])
    t = np.asarray(spec.tile, dtype=np.int64)
    home0 = first // t
    home_grid = tuple(int(n) for n in last // t - home0 + 1)
    side = max(1, round(block_tiles ** (1.0 / spec.n_axes)))
    return first, last, home0, home_grid, side, tuple(math.ceil(h / side) for h in home_grid)


def region_count(spec: Patches, block_tiles: int) -> int:
    """The regions of one sample-axis chunk a plan of ``block_chunks=block_tiles`` cuts the
    windows' home tiles into (:class:`PatchLayout`'s ``n_regions``, without its patches): 1
    when one region already holds every tile, and a larger block reads no further ahead."""
    return math.prod(_regions(spec, block_tiles)[-1])


class PatchLayout:
    """The patches of one plan: their order, home tiles, regions and origins.

    ``block_tiles`` is the plan's ``block_chunks``: a region is a square (cube, ...) of
    ``max(1, round(block_tiles ** (1 / n_axes)))`` home tiles per patched axis.
    """

    def __init__(self, spec: Patches, block_tiles: int) -> None:
        self.spec = spec
        k = spec.n_axes
        first, last, home0, self.home_grid, self.side, region_grid = _regions(spec, block_tiles)
        t = np.asarray(spec.tile, dtype=np.int64)
        self.n_regions = math.prod(region_grid)
        if spec.origins == "grid":
            assert spec.stride is not None
            per_axis = []
            for a0, a1, st in zip(first.tolist(), last.tolist(), spec.stride, strict=True):
                o = list(range(a0, a1 + 1, st))
                if o[-1] != a1:
                    o.append(a1)  # flush with the far edge: the windows cover the box
                per_axis.append(np.asarray(o, dtype=np.int64))
            grids = np.meshgrid(*per_axis, indexing="ij")
            origins = np.stack([g.ravel() for g in grids], axis=1)
            home = origins // t - home0
            self._lo = origins
            self._span = np.ones_like(origins)
        else:
            grids = np.meshgrid(*(np.arange(h) for h in self.home_grid), indexing="ij")
            tiles = np.stack([g.ravel() for g in grids], axis=1).astype(np.int64).reshape(-1, k)
            lo = np.maximum((tiles + home0) * t, first)
            hi = np.minimum((tiles + home0) * t + t - 1, last)
            width = hi - lo + 1  # origins in this home tile
            # a tile's share of per_tile: its start positions over the most a tile has along
            # each axis (the tile size where the field has a whole tile there; a field, or a
            # box, within one tile along an axis: its own, so it takes all of per_tile)
            share = np.prod(width / width.max(axis=0), axis=1)
            per = np.maximum(1, np.rint(spec.windows_per_tile * share)).astype(np.int64)
            home = np.repeat(tiles, per, axis=0)
            self._lo = np.repeat(lo, per, axis=0)
            self._span = np.repeat(width, per, axis=0)
        region = np.ravel_multi_index(tuple((home // self.side).T), region_grid)
        order = np.lexsort((np.arange(len(region)), region))  # region by region, stable
        self._lo, self._span = self._lo[order], self._span[order]
        self.region_of = region[order]
        self.n_patches = len(order)
        self.region_counts = np.bincount(self.region_of, minlength=self.n_regions).astype(np.int64)
        self.region_start = np.cumsum(self.region_counts) - self.region_counts
        #: (variants, n_regions): each region's place in each symmetric boustrophedon sweep
        self.sweeps = _sweeps(region_grid)

    def visit_order(self, pc: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The order (a permutation of positions) a shuffled plan visits patch chunks ``pc``
        in: at random (``order="shuffled"``) or, with ``order="sweep"``, anchor chunk by anchor
        chunk in a random order, each chunk's regions along a sweep drawn per chunk."""
        if self.spec.order == "shuffled":
            return rng.permutation(len(pc))
        chunk, region = pc // self.n_regions, pc % self.n_regions
        ids, at = np.unique(chunk, return_inverse=True)
        rank = rng.permutation(len(ids))[at]
        variant = rng.integers(0, len(self.sweeps), size=len(ids))[at]
        return np.lexsort((self.sweeps[variant, region], rank))

    def origins(self, seed: int, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
        """``(len(sample_ids), n_axes)`` window origins of the samples ``anchor * P + patch``."""
        patch = sample_ids % self.n_patches
        lo, span = self._lo[patch], self._span[patch]
        if self.spec.origins == "grid":
            return lo
        out = np.empty_like(lo)
        for axis in range(self.spec.n_axes):
            u = _uniform(sample_ids, seed, epoch, axis)
            out[:, axis] = lo[:, axis] + (u * span[:, axis]).astype(np.int64)
        return out

    def samples(
        self, chunks: np.ndarray, counts: np.ndarray, anchors: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The patch chunks of anchor chunks ``chunks`` (``counts[i]`` valid anchors each, laid
        out chunk after chunk in ``anchors``, each chunk's ascending: a run, or the anchors a
        stride and the missing-step checks keep): ``(patch chunk ids, counts, sample ids)``,
        each patch chunk's samples laid out together (anchor, then patch, ascending). A patch
        chunk id is ``anchor_chunk * n_regions + region``; empty ones are left out."""
        r = self.n_regions
        pc = (chunks[:, None] * r + np.arange(r, dtype=np.int64)).ravel()
        n_anchor = np.repeat(counts, r)
        per = np.tile(self.region_counts, len(chunks))
        cnt = n_anchor * per
        keep = cnt > 0
        pc, cnt, n_anchor, per = pc[keep], cnt[keep], n_anchor[keep], per[keep]
        first_anchor = np.repeat(np.cumsum(counts) - counts, r)[keep]  # its chunk's first
        first_patch = np.tile(self.region_start, len(chunks))[keep]
        total = int(cnt.sum())
        owner = np.repeat(np.arange(len(pc), dtype=np.int64), cnt)
        step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        anchor = anchors[first_anchor[owner] + step // per[owner]]
        patch = first_patch[owner] + step % per[owner]
        return pc, cnt, anchor * self.n_patches + patch

    def most_per_chunk(self, anchors_per_chunk: int) -> int:
        """The most samples one patch chunk holds."""
        return anchors_per_chunk * int(self.region_counts.max(initial=0))

    def block_batches(self, anchors_per_chunk: int, batch_size: int) -> int:
        """Batches one full block (one patch chunk) takes: a patched plan's ``pin_gap``."""
        return max(1, math.ceil(self.most_per_chunk(anchors_per_chunk) / batch_size))


def _snake(index: np.ndarray, grid: Sequence[int]) -> np.ndarray:
    """Rank of each multi-index (rows of ``index``) along the boustrophedon over ``grid``:
    C order, every axis after the first running backwards whenever the ranks of the axes
    before it add up to an odd number (so consecutive ranks are neighbours)."""
    if index.shape[1] == 0:
        return np.zeros(len(index), dtype=np.int64)
    inner = _snake(index[:, 1:], grid[1:])
    size = math.prod(grid[1:])
    odd = index[:, 0] % 2 == 1
    return index[:, 0] * size + np.where(odd, size - 1 - inner, inner)


def _sweeps(grid: Sequence[int]) -> np.ndarray:
    """Every symmetric variant (axis order, direction per axis) of the boustrophedon over
    ``grid``: ``(variants, prod(grid))``, each region's rank in each."""
    k = len(grid)
    cells = np.stack(np.unravel_index(np.arange(math.prod(grid)), grid), axis=1) if k else None
    out = []
    for axes in permutations(range(k)):
        for flips in product((False, True), repeat=k):
            assert cells is not None
            moved = np.where(np.asarray(flips), np.asarray(grid) - 1 - cells, cells)
            out.append(_snake(moved[:, list(axes)], [grid[a] for a in axes]))
    return np.stack(out).astype(np.int64)


def unit_geometry(geom: ArrayGeometry) -> ArrayGeometry:
    """What one slot of a patched array holds: a chunk's samples of one stored tile."""
    base = geom.base
    return base.with_inner(base.tile_shape, base.dtype)


def unit_chunk_tile(geom: ArrayGeometry, unit: int) -> tuple[int, tuple[int, ...]]:
    """``(chunk, tile)`` of unit ``unit`` of ``geom`` (see the module docstring)."""
    chunk, tile = divmod(int(unit), geom.n_tiles)
    return chunk, tuple(int(t) for t in np.unravel_index(tile, geom.tile_grid))


def touched_tiles(
    views: Mapping[str, ArrayGeometry], paths: Sequence[str]
) -> tuple[tuple[int, ...] | None, ...] | None:
    """Per field axis of the (alike tiled) arrays ``paths``, the tiles their views' selections
    touch — the union over the views, as
    :func:`~insitubatch_nodes.io.selection.held_indices` takes it; ``None`` where some view
    takes the whole axis or every tile is touched. ``None`` when that is every axis."""
    group = [g for g in views.values() if g.path in paths]
    base = group[0].base
    shape, tiles = base.field_shape, base.tile_shape
    held = held_indices([g.select for g in group], tiles, shape, exact=False)
    if held is None:
        return None
    return tuple(
        None if h is None else tuple(sorted({i // t for i in h}))
        for h, t in zip(held, tiles, strict=True)
    )


class WindowUnits:
    """The units (stored objects) one array's windows read, for rows ``(anchor, origin)``.

    ``geom`` is the array (unshifted, whole); ``offsets`` its views' offsets; ``spec`` the
    plan's patches (the first patched view's: another array patched alike may have other
    axes, matched by dimension name: :meth:`~insitubatch_nodes.io.patching.Patches.axes_of`).
    Along a patched axis a window at origin ``o`` reads tiles ``o // t`` to ``(o + extent -
    1) // t``; along any other field axis every tile, or the tiles ``touched`` names
    (:func:`touched_tiles`: what the views' selections take of an axis cut into tiles).
    """

    def __init__(
        self,
        geom: ArrayGeometry,
        spec: Patches,
        offsets: Sequence[int],
        touched: Sequence[tuple[int, ...] | None] | None = None,
    ) -> None:
        self.geom = geom
        self.spec = spec
        self.offsets = tuple(sorted(set(offsets)))
        self.spc = geom.samples_per_chunk
        self.n_tiles = geom.n_tiles
        # the columns of the rows' origins, on this array's own axes (found by name)
        pos = {a: i for i, a in enumerate(spec.axes_of(geom.dims))}
        #: per field axis: (index into the origin columns or -1, tile size, extent, grid)
        self._axes = [
            (
                pos.get(a, -1),
                geom.chunks[a],
                spec.extent[pos[a]] if a in pos else geom.shape[a],
                math.ceil(geom.shape[a] / geom.chunks[a]),
            )
            for a in geom.field_axes
        ]
        #: per field axis: the tiles read along an unpatched axis (``None``: all of them)
        self._touched = tuple(touched) if touched is not None else (None,) * len(self._axes)

    @property
    def per_chunk(self) -> int:
        """The most units of one sample-axis chunk the windows can read: every tile along a
        patched axis, the touched ones along the others. Each is a whole tile's slot, so an
        edge tile cropped by the field counts in full."""
        return math.prod(
            grid if col >= 0 or only is None else len(only)
            for (col, _, _, grid), only in zip(self._axes, self._touched, strict=True)
        )

    def patched(self, axis: int) -> bool:
        """Whether field axis ``axis`` is cut into windows (else a window spans all of it)."""
        return self._axes[axis][0] >= 0

    def spans(self, origins: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per field axis, each row's window as ``[start, stop)`` in field coordinates (the
        whole axis where it is not patched)."""
        n = len(origins)
        out = []
        for col, _, e, _ in self._axes:
            start = origins[:, col].astype(np.int64) if col >= 0 else np.zeros(n, np.int64)
            out.append((start, start + e))
        return out

    def pieces(
        self, origins: np.ndarray, spans: list[tuple[np.ndarray, np.ndarray]] | None = None
    ) -> Iterator[tuple[np.ndarray, tuple[np.ndarray, ...]]]:
        """``(rows, tile)`` for each way a window can overlap the tile grid: the rows whose
        window overlaps it that way, and the coordinate of the tile along each field axis
        (``len(rows)`` each). Every ``(row, tile)`` pair a window overlaps comes once."""
        spans = self.spans(origins) if spans is None else spans
        lows, highs, steps = [], [], []
        for (col, t, e, grid), (start, stop), only in zip(
            self._axes, spans, self._touched, strict=True
        ):
            lows.append(start // t)
            highs.append((stop - 1) // t)
            if col < 0:  # an unpatched axis: every tile, or those the selections touch
                steps.append(range(grid) if only is None else only)
            else:
                steps.append(range(min(grid, (e - 1) // t + 2)))
        for d in product(*steps):
            ok = np.ones(len(origins), dtype=bool)
            for lo, hi, dd in zip(lows, highs, d, strict=True):
                ok &= lo + dd <= hi
            rows = np.flatnonzero(ok)
            if len(rows):
                yield rows, tuple(lo[rows] + dd for lo, dd in zip(lows, d, strict=True))

    def tile_index(self, tile: tuple[np.ndarray, ...], n: int) -> np.ndarray:
        """The position of each of ``n`` tiles in C order over the array's tile grid (a unit
        is ``chunk * n_tiles + position``)."""
        if not tile:  # no field axes: one tile
            return np.zeros(n, np.int64)
        return np.ravel_multi_index(tile, [a[3] for a in self._axes])

    def uses(self, anchors: np.ndarray, origins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(unit, row)`` pairs: every unit each row reads (rows index ``anchors``)."""
        units, rows = [], []
        pieces = list(self.pieces(origins))
        for k in self.offsets:
            chunk = (anchors + k) // self.spc
            for r, tile in pieces:
                units.append(chunk[r] * self.n_tiles + self.tile_index(tile, len(r)))
                rows.append(r)
        if not units:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(units), np.concatenate(rows)

    def rim(self, layout: PatchLayout) -> int:
        """The most units of one sample-axis chunk the windows of one region read: its home
        tiles widened by the reach of a window starting in them, in this array's tiling."""
        count = 1
        for (col, t, e, grid), only in zip(self._axes, self._touched, strict=True):
            if col < 0:
                count *= grid if only is None else len(only)
                continue
            home = layout.spec.tile[col]
            covered = layout.side * home + e - 1
            aligned = home % t == 0  # a region starts on a tile edge of this array
            count *= min(grid, math.ceil(covered / t) + (0 if aligned else 1))
        return count
