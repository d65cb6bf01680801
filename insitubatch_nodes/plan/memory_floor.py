"""What a pipeline holds at most, against the process's memory: pipelines no machine like this
one holds are refused when they are built.

One rule (:class:`HeldMemory`, :func:`refuse_beyond_memory`), for the automatic budget and an
explicit ``cache_budget_bytes`` alike, asked where the pool's slots are in RAM
(:attr:`ChunkPool.slots_in_ram <insitubatch_nodes.pool.ChunkPool.slots_in_ram>`: no
``cache_dir``, and a backing that says its slots are process memory, as ``RamBacking`` does).
A pipeline holds at most, beside the interpreter:

* the pool's slots: its budget, or every chunk the split reads (a slot each, times the ranks:
  each epoch deals a rank other chunks of the split) where that is less. An explicit budget
  counts as given; the automatic one as the most its epochs grow it to
  (:func:`every_epoch_budget`): it grows to each epoch's working-set floor
  (:func:`~insitubatch_nodes.plan.schedule.working_set_bytes`: the chunks live at once plus
  one block of read-ahead, bounded by ``block_chunks`` where reading each chunk once would
  take over a quarter of RAM) and never shrinks, so what counts is the schedule's bound over
  every permutation (:class:`~insitubatch_nodes.plan.schedule.ScheduleFloors`, the bound an
  explicit budget is held to), or the whole split where it keeps it (a sixteenth of RAM at
  most, and only within the room this rule leaves the slots, :func:`slot_room`). Until
  later on 2026-12-07 the first epoch's floor was counted, as that bound can be twice it
  (16.3 against 7.2 GiB for a real-sized ARCO-ERA5 pipeline, ``tests/test_arco_trial.py``);
  but a later epoch's draw grows the budget past it (``tests/test_memrule2_trial.py``: 40,960
  bytes counted, 49,152 taken), so a pipeline built on a machine that holds only the first
  epoch was not held to what it takes. Such a pipeline is refused now, saying to lower
  ``block_chunks`` (or give a ``cache_dir``);
* the batches in flight: ``prefetch_depth + 2`` batches' buffers, made right after the build;
* the decode scratch: one stored object per decode thread and array whose objects may be
  decoded aside (:func:`decode_scratch_bytes`), the buffers per thread that a selection's
  objects are decoded into whole (``KeepingDecoder.most_aside_bytes``: such an array's own
  scratch only where a whole object is not decoded in place), and the stored-layout
  chunks of reshaping chunk transforms (:func:`spare_bytes`); the fetch stage sums them;
* what the batch transforms hold (``stages.gather.most_transform_bytes``: each transform's
  ``most_held_bytes``): static fields and the rows cut from them, stacks' constant channels,
  ``Forcings``' remembered fields (of at most the times the label's array holds, 64 MiB at
  most) and the rows they lend. Before 2026-12-07 none of it was counted: the check ran
  before the gather stage existed.

Before 2026-12-07 the two budgets were held to two rules: the automatic one to its floor and
the batches in flight, an explicit one to those and the decode scratch, so a pipeline was
refused an explicit budget equal to the floor the automatic budget was built at, on the same
memory (``tests/test_memcheck_trial.py``). Earlier that day an explicit budget was not summed
with anything (an 87-channel stack of ARCO-ERA5 at 0.25 degrees at ``batch_size=4``: a 10.6
GiB budget beside 10.8 GiB of batches, whatever the machine's memory was). Each pipeline is
checked alone, and the process's own memory (the interpreter, torch, other pipelines) is not
counted; nor is the solar forcings' scratch, bounded by
:data:`~insitubatch_nodes.forcing_solar.SOLAR_SCRATCH_BYTES` whatever the batch and the grid.
The check is built once, at the build, from the first epoch's plan the fetch stage draws
anyway (sums over its ledgers, no pass over the samples), completed by the gather stage with
the batch transforms where the fetch stage was not given them (a graph composed by hand), and
counted again by ``set_views`` for the views it is given (``stages/_memrule.py``; before
2026-12-07 neither: a hand-composed graph counted 0 bytes for its batch transforms, and other
views were held to the count of the build's, ``tests/test_memrule3_trial.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from insitubatch_nodes._process import usable_memory_bytes
from insitubatch_nodes.io.decode import SCRATCH_MIN_BYTES, ChunkDecoder
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.epoch import EpochPlan
from insitubatch_nodes.plan.schedule import PinSchedule, ScheduleFloors
from insitubatch_nodes.plan.working_set import read_bytes

__all__ = [
    "HeldMemory",
    "decode_scratch_bytes",
    "every_epoch_budget",
    "held_memory",
    "refuse_beyond_memory",
    "slot_room",
    "spare_bytes",
]


@dataclass(frozen=True)
class HeldMemory:
    """The most a pipeline holds outside the interpreter, in bytes, as the build's memory
    check counts it (module docstring). ``budget`` is the pool's budget as counted (an
    explicit one as given, the automatic one as its first epoch grows it), ``pool`` the slot
    memory it may take (``min(budget, split)``), ``split`` every chunk the split reads (a
    slot each, times the ranks), ``transforms`` what the batch transforms hold at most
    (``stages.gather.most_transform_bytes``, counted by the gather stage where the fetch stage
    was not given it)."""

    budget: int
    split: int
    in_flight: int
    scratch: int
    transforms: int = 0

    @property
    def pool(self) -> int:
        """The slot memory the pool may take: its budget, or the split where that is less."""
        return min(self.budget, self.split)

    @property
    def total(self) -> int:
        """Everything counted: the slots, the batches in flight, the decode scratch and the
        batch transforms."""
        return self.pool + self.in_flight + self.scratch + self.transforms


def held_memory(
    budget: int,
    plan: EpochPlan,
    slot_geoms: Mapping[str, ArrayGeometry],
    in_flight: int,
    scratch: int,
    transforms: int = 0,
) -> HeldMemory:
    """:class:`HeldMemory` of a pool of ``budget`` bytes over ``plan`` (the first epoch's:
    every chunk it reads, a slot each of ``slot_geoms``, times the ranks), beside ``in_flight``
    bytes of batches, ``scratch`` bytes of decode scratch (:func:`decode_scratch_bytes`) and
    ``transforms`` bytes the batch transforms hold."""
    split = read_bytes(plan, slot_geoms) * max(1, plan.world_size)
    return HeldMemory(budget, split, in_flight, scratch, transforms)


def every_epoch_budget(first_floor: int, floors: ScheduleFloors, schedule: PinSchedule) -> int:
    """The most an automatic budget grows to over every epoch under ``schedule``: at least
    ``first_floor`` (its first epoch's, a kept split included), and the bound of the
    ``floors`` (:func:`~insitubatch_nodes.plan.schedule.schedule_floors`, over every
    permutation) of the floors its epochs may take: read-once every epoch, its read-once bound;
    the bounded schedule, its bound; both (an epoch reads once where its floor is at most
    ``read_once_bytes``), the larger of the two. The budget grows to each epoch's floor and
    never shrinks: before 2026-12-07 the check counted the first epoch's, and a later draw of
    the shuffle grew it past what was counted (windows across chunk boundaries: 40,960 bytes
    counted, 45,056 then 49,152 taken, ``tests/test_memrule2_trial.py``)."""
    if schedule.pin_gap is None:
        bound = floors.read_once
    elif schedule.read_once_bytes is None:
        bound = floors.bounded
    else:
        bound = max(min(floors.read_once, schedule.read_once_bytes), floors.bounded)
    return max(first_floor, bound)


def slot_room(in_flight: int, scratch: int, transforms: int = 0) -> int:
    """The memory the rule leaves the pool's slots beside ``in_flight`` bytes of batches,
    ``scratch`` bytes of decode scratch and ``transforms`` bytes of the batch transforms
    (negative where those alone exceed it): the automatic budget keeps a split whole only
    where it fits here (:func:`~insitubatch_nodes.stages._admit.epoch_floor`), so its choice
    passes the rule wherever its floor does."""
    return usable_memory_bytes() - in_flight - scratch - transforms


def refuse_beyond_memory(held: HeldMemory, *, explicit: bool, block_chunks: int) -> None:
    """``ValueError`` where ``held`` (:func:`held_memory`) exceeds the memory this process may
    use (:func:`~insitubatch_nodes._process.usable_memory_bytes`), giving each part, the
    memory, and what lowers which: for an ``explicit`` budget the ``cache_budget_bytes`` that
    fits, for the automatic one ``block_chunks`` (the floor shrinks with it). One rule for both
    budgets: the automatic budget is built where an explicit budget of the same slot bytes is,
    and refused where it is refused."""
    memory = usable_memory_bytes()
    if held.total <= memory:
        return
    room = memory - held.in_flight - held.scratch - held.transforms
    if explicit:
        head = f"cache_budget_bytes={held.budget:,} cannot be held here"
        slots = "its budget, or every chunk the split reads where that is less"
        lower = (
            f"pass cache_budget_bytes={room:,} or less (the pool's share of that memory; not "
            "below the working-set floor, which lowering block_chunks shrinks), or lower "
            if room > 0
            else "lower "
        )
    else:
        head = "the automatic budget cannot hold this pipeline"
        slots = (
            "the most its epochs' working-set floors reach, over every draw: the chunks live "
            f"at once plus one block of read-ahead, block_chunks={block_chunks}"
        )
        lower = (
            "lower block_chunks (the floor shrinks with it), read fewer or smaller chunks per "
            "sample (fewer arrays, levels or window steps), or lower "
        )
    raise ValueError(
        f"{head}: the pool may take {_size(held.pool)} of slots in RAM ({slots}) beside "
        f"{_size(held.in_flight)} of batches in flight (prefetch_depth + 2) and "
        f"{_size(held.scratch)} of decode scratch (a stored object per decode thread and "
        f"array not decoded in place, at most) and {_size(held.transforms)} the batch "
        "transforms hold (static fields, remembered forcings, their lent rows), "
        f"{_size(held.total)} in all, more than the "
        f"{_size(memory)} of memory this process may use; {lower}batch_size, prefetch_depth or "
        "decode_threads, or give a cache_dir (slots in files on its disk)"
    )


def decode_scratch_bytes(
    geoms: Mapping[str, ArrayGeometry],
    threads: int,
    decoders: Mapping[str, ChunkDecoder] | None = None,
) -> int:
    """The decode scratch ``threads`` decode threads may hold over the arrays ``geoms``, as
    ``docs/pipeline.md`` bounds it: per thread and array, one stored object (a zarr chunk,
    decoded; an inner chunk of a shard), which an object decoded aside — an edge chunk, a
    selection the slots keep part of, a chain that cannot decode in place — takes
    (:mod:`~insitubatch_nodes.io.decode`). An allowance: an in-place decode takes nothing, so
    the fetch stage passes only the arrays whose objects may be decoded aside (not those
    ``ChunkDecoder.decodes_in_place``: before 2026-12-07 every array counted, and a stack of
    whole in-place chunks was refused a budget for scratch it never takes).

    CF-packed values (scaled, offset or cast: not masked only) are decoded into a per-thread
    buffer of the *stored* dtype, and that decode takes a stored object of scratch beside it
    only where a whole object cannot go straight into it (``decoders``, by path, say so; none
    given: counted). Before, such an object was counted at the decoded dtype's width and no
    more: an int16 field decoded to float32 counted 4 bytes a value where 2 are held."""
    total = 0
    for g in geoms.values():
        base = g.base
        values = base.samples_per_chunk * math.prod(base.tile_shape)
        cf = base.cf
        if cf is None or cf.in_place:
            total += max(values * base.dtype.itemsize, SCRATCH_MIN_BYTES)
            continue
        stored = max(values * cf.stored.itemsize, SCRATCH_MIN_BYTES)  # the packed buffer
        decoder = None if decoders is None else decoders.get(g.path)
        plain = dataclasses.replace(base, cf=None)  # (the packed buffer: a whole object)
        direct = decoder is not None and decoder.decodes_in_place(plain, plain, True)
        total += stored if direct else 2 * stored
    return threads * total


def spare_bytes(
    geoms: Mapping[str, ArrayGeometry], threads: int, max_inflight: int | None = None
) -> int:
    """The buffers the fill holds for decoding the chunks of ``geoms`` (the arrays whose chunk
    transforms reshape them) in their stored layout before the transforms write the slot
    (:mod:`~insitubatch_nodes.stages._spares`). A chunk takes one when its first object is
    decoded and gives it back (kept idle, by array and length) after its transform, and a new
    one is made only when none of its length is idle, so an array holds at most as many of a
    length as were ever taken at once: one whole chunk per decode thread (``threads``), two
    where a chunk is stored in several objects (two runs may share a chunk, and the next one
    begins while the last objects of the other decode). From a store read by GETs
    (``max_inflight`` given) a chunk's objects reach the decode threads together once the
    last has landed, so the same holds, except for chunks of more objects than
    ``max_inflight``: those begin decoding as they land, and every chunk begun but one holds
    a GET permit, so ``max_inflight + 1`` of them at most.

    Chunks shorter than the others (the valid samples of an edge: where the array ends inside
    a chunk, a continuous collection's last piece, or the edge blocks of product sample axes,
    each length of its own) take buffers of their own length: as many of each length as its
    chunks, up to the whole chunks' number (one for an array's edge chunk). A collection's
    members that do not continue one another are padded to whole chunks: their edges take
    whole buffers. Counted beside :func:`decode_scratch_bytes`.

    Before 2026-12-07 none were counted (a field tiled in 16 objects per chunk under
    ``Coarsen(2)`` held 147,456 bytes where the check counted 8,192); later that day an edge
    chunk's buffers counted as two whole chunks (98,304 bytes counted, 73,728 held); each
    admitted chunk took its buffer when queued, not when decoded (up to 23 held at once where
    2 were counted); the edge blocks of product axes counted nothing (their lengths 2, 3 and 1
    held beside a whole chunk of 6 at one decode thread, where 6 samples were counted), and a
    GET store's tiled chunks held a buffer from their first object's decode to their last
    one's landing (11 live at 2 decode threads, where 4 were counted;
    ``tests/test_memrule3_trial.py``)."""
    total = 0
    for g in geoms.values():
        base = g.base
        sample = math.prod(base.inner_shape) * base.dtype.itemsize
        whole = threads * (2 if base.n_tiles > 1 else 1)
        if max_inflight is not None and base.n_tiles > max_inflight:
            whole = max(whole, max_inflight + 1)
        total += whole * base.samples_per_chunk * sample
        for length, chunks in _edge_chunks(base).items():
            total += min(chunks, whole) * length * sample
    return total


def _edge_chunks(base: ArrayGeometry) -> dict[int, int]:
    """Length -> how many chunks of ``base`` hold that many valid samples, for the lengths
    under ``samples_per_chunk`` (:meth:`ArrayGeometry.chunk_range`)."""
    spc = base.samples_per_chunk
    if base.product is not None:
        lengths, chunks = np.unique(base.product.counts, return_counts=True)
        return {int(n): int(c) for n, c in zip(lengths, chunks, strict=True) if n < spc}
    edge = base.n_samples % spc
    return {edge: 1} if edge else {}


def _size(n: int) -> str:
    """``n`` bytes, exactly and in the largest binary unit under which it is at least 1."""
    value, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n:,} bytes" if unit == "bytes" else f"{n:,} bytes ({value:,.2f} {unit})"
