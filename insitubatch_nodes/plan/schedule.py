"""The residency schedule: how long a plan's chunks stay pinned, and what that costs.

Read-once (a chunk pinned from its first reading batch to its last) or *bounded* (released
after ``pin_gap`` idle batches, fetched again at its next use), chosen per epoch against
bounds that hold for every epoch (:func:`schedule_floors`): :func:`choose_schedule` turns a
byte budget into a :class:`PinSchedule`; :func:`working_set_bytes` is one epoch's floor.
Pure numpy over the plan: no pool, no threads.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from insitubatch_nodes._checks import check_optional_int
from insitubatch_nodes._process import usable_memory_bytes
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held
from insitubatch_nodes.plan.anchors import every_sample
from insitubatch_nodes.plan.config import PlanConfig, plan_config
from insitubatch_nodes.plan.epoch import (
    block_index,
    check_plan_inputs,
    patch_layout,
    plan_groups,
    ramp_unit,
)
from insitubatch_nodes.plan.ledger import EpochPlan, sorted_unique
from insitubatch_nodes.plan.patches import PatchLayout, WindowUnits, patch_spec, touched_tiles
from insitubatch_nodes.plan.ranks import default_rank_world
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.plan.valid_anchors import chunk_anchors, chunk_counts
from insitubatch_nodes.plan.working_set import read_bytes, slot_geometries, working_set_bytes

log = logging.getLogger(__name__)

__all__ = [
    "PinSchedule",
    "ScheduleFloors",
    "block_batches",
    "choose_schedule",
    "kept_bytes",
    "read_bytes",  # (defined in plan.working_set, importable from here as before)
    "schedule_floors",
    "slot_geometries",  # (likewise)
    "working_set_bytes",  # (likewise)
]


def block_batches(samples_per_chunk: int, block_chunks: int, batch_size: int) -> int:
    """Batches one full block takes: the ``pin_gap`` of the bounded-memory schedule."""
    return max(1, math.ceil(block_chunks * samples_per_chunk / batch_size))


@dataclass(frozen=True)
class PinSchedule:
    """How long the chunks a plan reads stay pinned, epoch by epoch.

    ``pin_gap=None`` (the default): *read-once* every epoch — a chunk is pinned from the first
    batch that reads it to the last, so it is fetched once per epoch. ``pin_gap=g``: *bounded* — a
    chunk that goes more than ``g`` batches without being read is released and fetched again at
    its next use; except that, with ``read_once_bytes`` set, an epoch whose read-once
    working-set floor (:func:`~insitubatch_nodes.plan.schedule.working_set_bytes`) is at most
    ``read_once_bytes`` uses read-once. Each epoch's choice is a function of that epoch's plan
    only, so a resumed run makes the same choice.
    :func:`~insitubatch_nodes.plan.schedule.choose_schedule` computes the schedule from a budget.
    """

    pin_gap: int | None = None
    read_once_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin_gap", check_optional_int("pin_gap", self.pin_gap, minimum=0))
        object.__setattr__(
            self,
            "read_once_bytes",
            check_optional_int("read_once_bytes", self.read_once_bytes, minimum=0),
        )
        if self.read_once_bytes is not None and self.pin_gap is None:
            raise ValueError(
                "read_once_bytes chooses between read-once and a pin_gap: set pin_gap too "
                "(or leave both None for read-once every epoch)"
            )


@dataclass(frozen=True)
class ScheduleFloors:
    """Upper bounds, valid for *every* epoch, rank, seed, ``shuffle`` and ``ramp``, of the
    working-set floor (:func:`~insitubatch_nodes.plan.schedule.working_set_bytes`) of one
    configuration
    under each schedule, in bytes. ``pin_gap`` is the bounded schedule's gap."""

    read_once: int
    bounded: int
    pin_gap: int

    @property
    def guaranteed(self) -> int:
        """The smallest budget with which every epoch has a schedule that fits."""
        return min(self.read_once, self.bounded)


def _anchor_chunk_bytes(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    chunks: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    held: Mapping[str, Held],
) -> tuple[np.ndarray, int, bool]:
    """For anchor chunks with valid anchors ``[start, start + count)``: the bytes of the
    distinct stored chunks each one's anchors read (all views; a slot's, as ``held``), the
    bytes of every chunk any of them reads, and whether some stored chunk is read by two
    different anchor chunks."""
    weight = np.zeros(len(chunks), dtype=np.int64)
    total, shared = 0, False
    nbytes_of = {path: g.chunk_nbytes for path, g in slot_geometries(views, held).items()}
    for pspc, offsets, paths in plan_groups(views):
        # the arrays of a plan group read the same chunks: count them once, weigh by all
        nbytes = sum(nbytes_of[path] for path in paths)
        owners, ids = [], []
        for offset in offsets:
            first = (starts + offset) // pspc
            last = (starts + counts - 1 + offset) // pspc
            span = last - first + 1
            owners.append(np.repeat(np.arange(len(chunks), dtype=np.int64), span))
            step = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(span) - span, span
            )
            ids.append(np.repeat(first, span) + step)
        owner, cid = np.concatenate(owners), np.concatenate(ids)
        # one int64 key per (anchor chunk, stored chunk) pair: 1-D uniques sort fast
        pairs = sorted_unique(owner * (int(cid.max()) + 1) + cid)
        n_pairs = len(pairs)
        weight += nbytes * np.bincount(pairs // (int(cid.max()) + 1), minlength=len(chunks))
        distinct = len(sorted_unique(cid))
        total += nbytes * distinct
        shared = shared or distinct < n_pairs
    return weight, total, shared


def _patch_chunk_bytes(
    views: Mapping[str, ArrayGeometry],
    layout: PatchLayout,
    chunks: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    held: Mapping[str, Held],
) -> tuple[np.ndarray, int, np.ndarray]:
    """:func:`_anchor_chunk_bytes` of a patched plan, over its patch chunks (every anchor
    chunk's regions): ``(bytes each may read, bytes of every unit read, samples in each)``.
    A patch chunk's windows read its region's tiles and the rim they reach into, in the
    sample-axis chunks its anchors' views read."""
    r = layout.n_regions
    cnt = (counts[:, None] * layout.region_counts[None, :]).ravel()
    weight = np.zeros(len(cnt), dtype=np.int64)
    total = 0
    view_of: dict[str, ArrayGeometry] = {}  # the first view of each array
    for g in views.values():
        view_of.setdefault(g.path, g)
    slot = slot_geometries(views, held)
    for pspc, offsets, paths in plan_groups(views):
        geom = view_of[paths[0]]
        if geom.patch is not None:
            units = WindowUnits(geom.base, layout.spec, offsets, touched_tiles(views, paths))
            unit_bytes = sum(slot[p].chunk_nbytes for p in paths)
            per_chunk = unit_bytes * units.rim(layout)
            # every unit of a chunk: whole tiles' slots (an edge tile's overhangs the field)
            every = unit_bytes * units.per_chunk
        else:
            per_chunk = every = sum(slot[p].chunk_nbytes for p in paths)
        span_total = np.zeros(len(chunks), dtype=np.int64)
        read = []
        for offset in sorted(set(offsets)):
            first = (starts + offset) // pspc
            last = (starts + counts - 1 + offset) // pspc
            span_total += last - first + 1
            read.append(sorted_unique(np.concatenate([first, last])))
        weight += np.repeat(span_total * per_chunk, r)
        # every chunk a view reads lies between some anchor chunk's first and last read
        total += every * len(sorted_unique(np.concatenate(read)))
    keep = cnt > 0  # a plan leaves out patch chunks without samples
    return weight[keep], total, cnt[keep]


class _Touched(NamedTuple):
    """What runs of ledger rows can touch, one entry per run (see :meth:`_BlockLayout.touched`)."""

    chunks: np.ndarray  # most anchor chunks the run can read
    blocks: np.ndarray  # blocks the run can overlap
    first_block: np.ndarray  # the first block it can overlap


@dataclass(frozen=True)
class _BlockLayout:
    """Where the blocks of every ledger whose chunks hold at most ``q`` rows, ``slack`` rows
    fewer than ``q`` each in all, can lie: where they would with ``q`` rows per chunk, each
    moved earlier by at most ``slack`` rows, so block ``k`` occupies rows inside
    ``[start[k], end[k])``."""

    sizes: np.ndarray  # chunks in each block
    start: np.ndarray  # the earliest row block k can start at
    end: np.ndarray  # the row block k ends before, at the latest

    #: Blocks one run may overlap before the layout is too loose to be useful.
    MAX_SPREAD = 64

    @classmethod
    def of(cls, n_chunks: int, block_chunks: int, lead: int, q: int, slack: int) -> _BlockLayout:
        sizes = np.bincount(block_index(n_chunks, block_chunks, lead))
        end = np.cumsum(sizes * q)
        return cls(sizes, end - sizes * q - slack, end)

    @property
    def n_rows(self) -> int:
        return int(self.end[-1])

    def touched(
        self, first: np.ndarray, stop: np.ndarray, own: np.ndarray | None = None
    ) -> _Touched | None:
        """For runs of rows ``[first, stop)``: the most chunks each can read, counting a block
        it overlaps by its overlap (at most the block's size), or whole when it is the run's
        ``own`` block; ``None`` when some run can overlap more than :attr:`MAX_SPREAD` blocks."""
        last = len(self.sizes) - 1
        k0 = np.searchsorted(self.end, first, side="right")  # first block that can end after
        k1 = np.searchsorted(self.start, stop, side="left")  # blocks before k1 can start before
        spread = int((k1 - k0).max(initial=0))
        if spread > self.MAX_SPREAD:
            return None
        chunks = np.zeros(len(first), dtype=np.int64)
        for step in range(spread):
            k = k0 + step
            block = np.minimum(k, last)
            overlap = np.minimum(stop, self.end[block]) - np.maximum(first, self.start[block])
            overlap = np.where(k < k1, np.maximum(overlap, 0), 0)
            count = np.minimum(self.sizes[block], overlap)
            if own is not None:
                count = np.where((k < k1) & (block == own), self.sizes[block], count)
            chunks += count
        return _Touched(chunks, k1 - k0, k0)


def _layout_maxima(
    n_chunks: int, block_chunks: int, lead: int, q: int, slack: int, batch_size: int, gap: int
) -> tuple[int, int, int] | None:
    """Most anchor chunks ``(read in g consecutive batches, live at one batch under read-once
    without shared chunks, fetched by the batches of one block)`` for every ledger whose chunks
    hold at most ``q`` rows and ``slack`` rows fewer than ``q`` each in all
    (:class:`_BlockLayout`); ``None`` when that leaves too wide a spread to be useful."""
    layout = _BlockLayout.of(n_chunks, block_chunks, lead, q, slack)
    batches = np.arange(math.ceil(layout.n_rows / batch_size), dtype=np.int64)
    batch_start, batch_stop = batches * batch_size, (batches + 1) * batch_size
    window = layout.touched(np.maximum(0, batch_start - (gap - 1) * batch_size), batch_stop)
    single = layout.touched(batch_start, batch_stop)
    ahead = layout.touched(  # the batches that intersect each block
        np.maximum(0, layout.start // batch_size * batch_size),
        -(-layout.end // batch_size) * batch_size,
        own=np.arange(len(layout.sizes), dtype=np.int64),
    )
    if window is None or single is None or ahead is None:
        return None
    # one batch inside one block: that block's chunks may all be live; else what it reads
    last = len(layout.sizes) - 1
    inside = layout.sizes[np.minimum(single.first_block, last)]
    once = np.where(single.blocks == 1, inside, single.chunks)
    return int(window.chunks.max()), int(once.max()), int(ahead.chunks.max())


def schedule_floors(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    config: PlanConfig | None = None,
    held: Mapping[str, Held] | None = None,
) -> ScheduleFloors:
    """Permutation-independent upper bounds of each schedule's working-set floor.

    ``held`` (array path -> the indices its slots hold, as the stage context decides: see
    :func:`~insitubatch_nodes.io.selection.held_by_path`) sizes the slots of arrays read through
    selected views: a slot keeping 13 of 37 levels counts 13 levels' bytes, not the stored
    chunk's.

    ``config`` (a :class:`~insitubatch_nodes.plan.config.PlanConfig`, trusted; ``None``: the
    defaults) is the plan's; only its ``split, batch_size, block_chunks, cross_split_windows,
    remainder, world_size`` matter here (:data:`~insitubatch_nodes.plan.config.SCHEDULE_FIELDS`).
    The bounds hold for every epoch, seed and rank of ``world_size`` ranks (default:
    ``torch.distributed``'s, else 1 — as :class:`ReadPlanNode` resolves it), with or without
    ``shuffle`` and ``ramp``; with ``remainder="drop"`` or ``"uneven"`` (its ledgers are shaped
    as ``"drop"``'s) the bounds for any ``world_size > 1`` hold for every world size.

    **Tails.** With several ranks a rank's ledger (:func:`deal`, or :func:`deal_runs` for
    windows: the same shape) is whole chunks — no two the same — then at most two partial
    pieces of tail chunks (of its run's two ends; unshuffled runs put the first of them
    first, which moves no block later than these bounds allow): at most ``len(split chunks)``
    distinct positions, falling short of ``q`` rows by at most the single-rank total, plus at
    most ``q`` for the first partial piece (which only the last block can follow). So the
    layout below is computed with ``q`` more slack, and a full block that is not the last holds
    at least its smallest whole chunks and one row. A padded sample (``remainder="pad"``) is a
    one-row piece after those, possibly of a chunk the rank reads elsewhere: the layout then
    allows ``world_size - 1`` more positions, ``2q`` more slack and ``q - 1`` per padded sample,
    and a full block counts one row per piece (:class:`_Deal`).

    Let ``w(c)`` be the bytes of the stored chunks anchor chunk ``c``'s anchors read,
    ``top(k)`` the sum of the ``k`` largest ``w`` (:meth:`_Units.top`) and ``g`` the bounded
    schedule's gap (:func:`block_batches`). The ledger is a run of blocks of at most
    ``block_chunks`` chunks; each chunk holds at most ``q`` rows (its valid anchors), so a block
    lies within a known distance of where it would lie with ``q`` rows per chunk, and so does
    every batch (:func:`_layout_maxima`). From that layout (and, as a fallback, from the fewest
    rows a block can hold: :func:`_most_units`) come the most anchor chunks a run of rows can
    touch (:class:`_UnitCounts`):

    * Bounded: a chunk live at batch ``b`` was read in batches ``(b - g, b]`` (a gap of more than
      ``g`` batches would have released it): live bytes ``<= top(most chunks in g batches)``.
    * Read-ahead (both schedules): the fetches counted for a block ``B`` are those of batches
      whose first row (rows are sorted within a batch) lies in ``B``; they intersect ``B``, span
      at most ``g`` batches and so fetch each chunk once: ``<= top(most chunks in the batches
      that intersect one block)``.
    * Read-once: live bytes are at most every chunk the split reads. When no stored chunk is
      read by two anchor chunks (no window reaches a neighbour, labels' grids nest), a chunk
      live at ``b`` is read by ``b`` or belongs to the one block ``b`` lies inside:
      ``<= top(max(block chunks, most chunks in one batch))`` — and read-once is then the
      bounded schedule, so the bounded bound holds for it too.
    * Neither schedule holds more than every chunk the split reads, a slot each (live chunks
      and read-ahead are among them): both bounds stop there.
    """
    cfg = plan_config(config, "schedule_floors")
    views = check_plan_inputs(manifest, views, cfg)
    units, gap = _plan_units(manifest, views, cfg, {} if held is None else held)
    if units is None:
        return ScheduleFloors(read_once=0, bounded=0, pin_gap=gap)
    world = default_rank_world()[1] if cfg.world_size is None else cfg.world_size
    deal = _Deal(world=world, padded=world - 1 if cfg.remainder == "pad" else 0)
    most = _UnitCounts.coarse(units, deal, gap, cfg.batch_size)
    tight = _UnitCounts.from_layout(units, deal, gap, cfg.batch_size)
    if tight is not None:
        most = most.tightened(tight)
    read_ahead = units.top(most.ahead)
    bounded = units.top(most.live) + read_ahead
    read_once = units.total + read_ahead
    if not (units.shared or deal.padded):  # (a padded sample's chunk may be read twice)
        read_once = min(read_once, units.top(most.once) + read_ahead, bounded)
    # nor does any schedule hold more than every chunk the split reads (one slot each)
    read_once, bounded = min(read_once, units.total), min(bounded, units.total)
    return ScheduleFloors(read_once=read_once, bounded=bounded, pin_gap=gap)


@dataclass(frozen=True)
class _Units:
    """What a plan's blocks are made of, for :func:`schedule_floors`: anchor chunks, or — in a
    patched plan — patch chunks (one region of tiles of one anchor chunk, a block each), with
    the bytes each reads."""

    rows: np.ndarray  # valid anchors of each unit, one block position each (0: none valid)
    weight: np.ndarray  # bytes of the stored chunks each unit with rows reads (all views)
    total: int  # bytes of every stored chunk (or tile) any unit reads
    shared: bool  # whether some stored chunk is read by two units
    block_units: int  # units per full block: block_chunks, or 1 in a patched plan
    samples_per_unit: int  # anchors a unit spans: samples_per_chunk, or 1 in a patched plan
    patched: bool

    @property
    def n(self) -> int:
        """Units that hold rows."""
        return len(self.weight)

    @functools.cached_property
    def _heaviest(self) -> np.ndarray:
        """``[0, w1, w1 + w2, ...]`` over the weights, heaviest first."""
        return np.concatenate([[0], np.cumsum(np.sort(self.weight)[::-1])])

    def top(self, k: int) -> int:
        """Most bytes ``k`` units can read: the ``k`` heaviest; a patched plan's units share
        their rims, so never more than every unit there is."""
        most_bytes = int(self._heaviest[min(k, self.n)])
        return min(most_bytes, self.total) if self.patched else most_bytes


def _plan_units(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    cfg: PlanConfig,
    held: Mapping[str, Held],
) -> tuple[_Units | None, int]:
    """The plan's :class:`_Units` (``None`` when no anchor is valid) and the bounded schedule's
    gap: :func:`block_batches`, or a patched plan's :meth:`PatchLayout.block_batches`."""
    spc, bs, bc = manifest.samples_per_chunk, cfg.batch_size, cfg.block_chunks
    chunks = manifest.chunk_array(cfg.split)
    offsets = [g.offset for g in views.values()]
    starts, counts = chunk_counts(manifest, cfg.split, chunks, offsets, cfg.cross_split_windows)
    layout = patch_layout(views, bc)
    spans = counts
    if layout is None and (not every_sample(cfg.stride) or manifest.steps is not None):
        # the stride and the missing-step checks keep a subset of each chunk's run: the rows
        # are the anchors kept; the bytes, those of the stored chunks between each chunk's
        # first and last anchor kept (an upper bound of what its anchors read)
        counts, anchors = chunk_anchors(manifest, chunks, offsets, cfg)
        if len(anchors):
            first = np.cumsum(counts) - counts
            has = counts > 0
            starts = np.where(has, anchors[np.minimum(first, len(anchors) - 1)], starts)
            last = np.where(has, anchors[np.maximum(first + counts - 1, 0)], starts)
            spans = np.where(has, last - starts + 1, 0)
    keep = counts > 0
    gap = block_batches(spc, bc, bs) if layout is None else layout.block_batches(spc, bs)
    if not keep.any():
        return None, gap
    if layout is None:
        weight, total, shared = _anchor_chunk_bytes(
            manifest, views, chunks[keep], starts[keep], spans[keep], held
        )
        units = _Units(counts, weight, total, shared, bc, spc, patched=False)
    else:
        weight, total, rows = _patch_chunk_bytes(
            views, layout, chunks[keep], starts[keep], counts[keep], held
        )
        units = _Units(rows, weight, total, True, 1, 1, patched=True)
    return units, gap


@dataclass(frozen=True)
class _Deal:
    """How dealing between ranks can reshape a rank's ledger, for :func:`schedule_floors`."""

    world: int  # ranks
    padded: int  # padded samples (remainder="pad"): one-row pieces of their own

    @property
    def pieces(self) -> int:
        """Partial pieces a full block before the last may hold (none with one rank)."""
        return 2 + self.padded if self.padded else int(self.world > 1)

    def slack(self, q: int) -> int:
        """Rows a block may move earlier beyond the single-rank layout, for chunks of at most
        ``q`` rows: the tail pieces' and the padded samples'."""
        if self.world == 1:
            return 0
        return 2 * q + self.padded * (q - 1) if self.padded else q


def _fewest_block_rows(units: _Units, deal: _Deal) -> int:
    """The fewest rows a full block before the last can hold: its smallest whole units, and
    one row per partial piece."""
    size = min(units.block_units, len(units.rows))
    whole = max(0, size - deal.pieces)
    return int(np.sort(units.rows)[:whole].sum()) + size - whole


def _most_units(rows: int, aligned: bool, units: _Units, fewest: int) -> int:
    """Most units ``rows`` consecutive rows of the ledger can touch, when every full block
    holds at least ``fewest`` rows; ``aligned``: the run starts at a block's start."""
    if rows <= 0:
        return 0
    if fewest == 0:
        return min(rows, units.n)
    blocks = 1 + (rows - 1) // fewest if aligned else 2 + max(0, rows - 2) // fewest
    return min(rows, units.n, units.block_units * blocks)


@dataclass(frozen=True)
class _UnitCounts:
    """Most units a schedule can hold at once, for :func:`schedule_floors`."""

    live: int  # read within one gap of batches: the bounded schedule's live units
    once: int  # live at one batch under read-once, when no stored chunk is shared
    ahead: int  # fetched by the batches that intersect one block: the read-ahead

    @classmethod
    def coarse(cls, units: _Units, deal: _Deal, gap: int, batch_size: int) -> _UnitCounts:
        """From the fewest rows a block can hold (:func:`_fewest_block_rows`)."""
        fewest = _fewest_block_rows(units, deal)
        return cls(
            live=_most_units(gap * batch_size, False, units, fewest),
            once=max(
                min(units.block_units, units.n), _most_units(batch_size, False, units, fewest)
            ),
            ahead=min(
                units.n, units.block_units + 2 * _most_units(batch_size - 1, True, units, fewest)
            ),
        )

    @classmethod
    def from_layout(
        cls, units: _Units, deal: _Deal, gap: int, batch_size: int
    ) -> _UnitCounts | None:
        """From where the blocks can lie (:func:`_layout_maxima`), the worst over an epoch with
        and without the ramp's lead block; ``None`` when the layout is too loose to use."""
        q = int(units.rows.max())
        slack = int((q - units.rows).sum()) + deal.slack(q)
        positions = len(units.rows) + deal.padded
        bc = units.block_units
        found = []
        for lead in {0, ramp_unit(True, units.samples_per_unit, batch_size)}:
            maxima = _layout_maxima(
                positions, bc, lead if lead < bc else 0, q, slack, batch_size, gap
            )
            if maxima is None:
                return None
            found.append(maxima)
        return cls(*(max(column) for column in zip(*found, strict=True)))

    def tightened(self, other: _UnitCounts) -> _UnitCounts:
        """The smaller of two bounds, count by count."""
        return _UnitCounts(
            min(self.live, other.live), min(self.once, other.once), min(self.ahead, other.ahead)
        )


def kept_bytes(
    plan: EpochPlan, geoms: Mapping[str, ArrayGeometry], budget_bytes: int | None
) -> int | None:
    """The slot bytes of every chunk ``plan`` reads when the pool keeps them all for the next
    epoch, else ``None``: they are kept when they fit ``budget_bytes`` — for the automatic
    budget (``None``), a sixteenth of RAM (:func:`_auto_keep_bytes`). ``geoms`` is what one
    slot of each array holds (:func:`slot_geometries`).

    Kept, an automatic budget grows to hold them, and the next epoch finds them (no GET, no
    decode); at one sample per chunk (:mod:`~insitubatch_nodes.stages._direct`) a chunk read
    by one row is decoded straight into that row when its epoch is not kept. Under DDP each
    epoch deals the rank other samples: where the whole split (this rank's chunks times the
    ranks: their shares are one size) fits the automatic cap, that is returned, so the budget
    holds every chunk the rank has read and epochs read only chunks it never read.
    """
    reads = read_bytes(plan, geoms)
    if budget_bytes is not None:
        return reads if reads <= budget_bytes else None
    cap = _auto_keep_bytes()
    if plan.world_size > 1 and reads * plan.world_size <= cap:
        return reads * plan.world_size
    return reads if reads <= cap else None


def _auto_keep_bytes() -> int:
    """The largest split an automatic budget keeps at one sample per chunk: 1/16 of RAM.

    Kept, a split is decoded into fresh slot memory in its first epoch instead of into the
    batch buffers that every batch reuses, and fresh memory is slow to touch the first time
    (0.1-0.7 GB/s on the project's VM, against 3.6 GB/s rewriting memory already touched):
    the 2.3 GB train split of the WeatherBench2-like benchmark store (``wb-c1``), kept, ran
    its first epoch at 0.31x the bare loop (0.62x straight into the batch) and its second at
    3.2x (hits) there. Small data pays little for it; a split of gigabytes is left to an
    explicit budget.
    """
    return _auto_cap_bytes() // 4


def _auto_cap_bytes() -> int:
    """The most an automatic budget takes before it trades re-reads for memory: 1/4 of RAM —
    of the memory this process may use (:func:`~insitubatch_nodes._process.
    usable_memory_bytes`: a container's or a batch job's limit where one is set, not the
    node's RAM)."""
    return usable_memory_bytes() // 4


def choose_schedule(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    budget_bytes: int | None,
    config: PlanConfig | None = None,
    *,
    revive: bool = False,
    held: Mapping[str, Held] | None = None,
    floors: ScheduleFloors | None = None,
) -> PinSchedule:
    """The residency schedule for a budget: pure, computed before the read plan is built.

    Pass the result as ``ReadPlanNode(..., schedule=...)``; :func:`insitu_pipeline` does exactly
    this, so a pipeline composed by hand behaves like the builder's. ``config`` is the
    :class:`~insitubatch_nodes.plan.config.PlanConfig` the read plan is built with, and ``held``
    what the slots of selected arrays keep, as for :func:`schedule_floors`. ``budget_bytes`` is
    ``None`` or a positive integer, trusted: it was checked where it was made
    (``CacheOptions.budget_bytes``, the builder's ``cache_budget_bytes``).

    Read-once (each chunk pinned from its first reading batch to its last, fetched once per
    epoch) is the default. A shifted view can make that schedule hold a large part of the split —
    chunk ``c + 1`` is read by the last anchors of chunk ``c`` and again, much later, in its own
    block — and how much depends on each epoch's permutation. So the choice is made per epoch
    against :func:`~insitubatch_nodes.plan.schedule.schedule_floors`, bounds that hold for every
    epoch:

    * an explicit budget at or above the read-once bound: read-once, every epoch;
    * else, at or above the bounded bound: each epoch reads once if *its* read-once floor fits
      the budget and otherwise releases chunks idle for a block and re-reads them (that epoch's
      floor is within the bounded bound, hence within the budget);
    * else ``ValueError`` stating the smallest budget that fits every epoch — here, never in a
      later epoch; and a larger budget never fails where a smaller one succeeds.

    ``budget_bytes=None`` (automatic) reads once every epoch while the read-once bound is under a
    quarter of RAM; above that, an epoch whose read-once floor exceeds a quarter of RAM uses the
    bounded schedule (a warning says so).

    ``revive=True`` (a shuffled pipeline with a persistent cache: a released chunk comes back
    from disk, neither fetched nor decoded) with views at different offsets uses the bounded
    schedule every epoch (when the budget holds its bound): residency stays near a couple of
    blocks instead of the part of the split a shifted view keeps pinned between its uses.

    ``floors``: :func:`schedule_floors` of the same arguments, where the caller has them (the
    builder: its memory check counts them too), so that they are not computed twice.
    """
    cfg = plan_config(config, "choose_schedule")
    if floors is None:  # (else computed by the caller, trusted: schedule_floors of these)
        floors = schedule_floors(manifest, views, cfg, held)
    windowed = len({view.offset for view in views.values()}) > 1
    fits_bounded = budget_bytes is None or budget_bytes >= floors.bounded
    if revive and windowed and fits_bounded:
        return PinSchedule(pin_gap=floors.pin_gap)
    if budget_bytes is None:
        cap = _auto_cap_bytes()
        if floors.read_once <= cap:
            return PinSchedule()
        log.warning(
            "insitubatch_nodes: reading each chunk once per epoch could pin up to %.1f GiB "
            "(over a quarter of RAM); epochs whose read-once floor exceeds that release chunks "
            "idle for a block and re-read them instead (floor at most %.1f GiB). Pass "
            "cache_budget_bytes to choose.",
            floors.read_once / 2**30,
            floors.bounded / 2**30,
        )
        return PinSchedule(pin_gap=floors.pin_gap, read_once_bytes=cap)
    budget = budget_bytes
    if budget >= floors.read_once:
        return PinSchedule()
    if budget >= floors.bounded:
        return PinSchedule(pin_gap=floors.pin_gap, read_once_bytes=budget)
    floor = floors.guaranteed
    once = (
        f"; reading each chunk once per epoch needs up to {floors.read_once:,} bytes"
        if floors.read_once > floor
        else ""
    )
    what = (
        "chunks"
        if patch_spec(views) is None
        else "stored tiles of the patched arrays (and chunks of any other)"
    )
    raise ValueError(
        f"cache_budget_bytes={budget:,} is below the working-set floor of {floor:,} bytes "
        f"({floor / 2**20:.1f} MiB) that every epoch is guaranteed to fit ({what} live at once "
        f"plus one block of read-ahead, bounded over every permutation; at most every one the "
        f"split reads){once}; raise it to at "
        "least the floor, lower block_chunks, or pass None for the automatic budget"
    )
