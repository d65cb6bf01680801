"""A budget against the process's memory: pipelines no machine like this one holds.

The automatic chunk budget (``cache_budget_bytes=None``) grows to each epoch's working-set
floor (:func:`~insitubatch_nodes.plan.schedule.working_set_bytes`: the chunks live at once plus
one block of read-ahead, bounded by ``block_chunks`` where reading each chunk once would take
over a quarter of RAM). Where the first epoch's floor exceeds the memory this process may use
(:func:`~insitubatch_nodes._process.usable_memory_bytes`), the pipeline could only be killed for
its memory: it is refused when it is built, saying what shrinks the floor. The batches in
flight (``prefetch_depth + 2``, made right after the build) count beside the floor. The
permutation-free bound (:class:`~insitubatch_nodes.plan.schedule.ScheduleFloors`) is not what
is compared: it can be twice an epoch's floor (16.3 against 7.2 GiB for a real-sized ARCO-ERA5
pipeline in ``tests/test_arco_trial.py``), and would refuse pipelines that run.

An explicit ``cache_budget_bytes`` with slots in RAM (the default ``RamBacking``, no
``cache_dir``; a backing of the user's own is not checked) is held to the same
memory (:func:`refuse_budget_beyond_memory`): the slot memory the pool may take — the budget, or
every chunk the split reads where that is less — beside the batches in flight and the decode
threads' scratch (an allowance of one stored object per thread and array). Before 2026-12-07
only the batches in flight were checked beside an explicit budget, alone: the sum was never
compared (an 87-channel stack of ARCO-ERA5 at 0.25 degrees at ``batch_size=4``: a 10.6 GiB
budget beside 10.8 GiB of batches, whatever the machine's memory was). Each pipeline is
checked alone, and the process's own memory (the interpreter, torch, other pipelines) is not
counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from insitubatch_nodes._process import usable_memory_bytes
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.epoch import EpochPlan
from insitubatch_nodes.plan.schedule import read_bytes

__all__ = ["decode_scratch_bytes", "refuse_beyond_memory", "refuse_budget_beyond_memory"]


def refuse_beyond_memory(floor: int, in_flight: int, block_chunks: int) -> None:
    """``ValueError`` where ``floor`` (the first epoch's working-set floor under an automatic
    budget, in bytes) and ``in_flight`` (the bytes of the batches the pipeline keeps in flight)
    together exceed the memory this process may use; ``block_chunks`` (the plan's) is named in
    the message, as what shrinks the floor. Asked only where the slots are in RAM, as for an
    explicit budget (with a ``cache_dir`` they are files on its disk: before 2026-12-07 the
    automatic budget was refused there, an explicit one of four times its floor built)."""
    memory = usable_memory_bytes()
    if floor + in_flight <= memory:
        return
    raise ValueError(
        f"the automatic budget cannot hold this pipeline: its first epoch keeps up to "
        f"{floor / 2**30:,.1f} GiB of chunks resident (those live at once plus one block of "
        f"read-ahead, block_chunks={block_chunks}) beside {in_flight / 2**30:,.1f} GiB of "
        f"batches in flight (prefetch_depth + 2), more than the {memory / 2**30:,.1f} GiB of "
        f"memory this process may use; lower block_chunks (the floor shrinks with it), "
        f"batch_size or prefetch_depth, or read fewer or smaller chunks per sample (fewer "
        f"arrays, levels or window steps)"
    )


def decode_scratch_bytes(geoms: Mapping[str, ArrayGeometry], threads: int) -> int:
    """The decode scratch ``threads`` decode threads may hold over the arrays ``geoms``, as
    ``docs/pipeline.md`` bounds it: per thread and array, one stored object (a zarr chunk,
    decoded; an inner chunk of a shard), which an object decoded aside — an edge chunk, a
    selection the slots keep part of, a chain that cannot decode in place — takes
    (:mod:`~insitubatch_nodes.io.decode`). An allowance: an in-place decode takes nothing, so
    the fetch stage passes only the arrays whose objects may be decoded aside (not those
    ``ChunkDecoder.decodes_in_place``: before 2026-12-07 every array counted, and a stack of
    whole in-place chunks was refused a budget for scratch it never takes)."""
    objects = {
        g.path: g.base.samples_per_chunk * math.prod(g.base.tile_shape) * g.base.dtype.itemsize
        for g in geoms.values()
    }
    return threads * sum(objects.values())


def refuse_budget_beyond_memory(
    budget: int,
    plan: EpochPlan,
    slot_geoms: Mapping[str, ArrayGeometry],
    in_flight: int,
    scratch: int,
) -> None:
    """``ValueError`` where an explicit ``budget`` (bytes of RAM slots), the batches in flight
    (``in_flight`` bytes) and the decode scratch (``scratch`` bytes,
    :func:`decode_scratch_bytes`) together exceed the memory this process may use. The pool
    takes at most every chunk ``plan`` (the first epoch's) reads, a slot each (``slot_geoms``:
    what one slot of each array holds), times the ranks (each epoch deals a rank other chunks
    of the split): a budget above that counts as that. Built once, at the build."""
    split = read_bytes(plan, slot_geoms) * max(1, plan.world_size)
    pool = min(budget, split)
    memory = usable_memory_bytes()
    if pool + in_flight + scratch <= memory:
        return
    room = memory - in_flight - scratch
    lower = (
        f"pass cache_budget_bytes={room:,} or less (the pool's share of that memory; not "
        "below the working-set floor, which lowering block_chunks shrinks), or lower "
        if room > 0
        else "lower "
    )
    raise ValueError(
        f"cache_budget_bytes={budget:,} cannot be held here: the pool may take "
        f"{_gib(pool)} of slots in RAM (its budget, or every chunk the split reads where "
        f"that is less) beside {_gib(in_flight)} of batches in flight (prefetch_depth + 2) and "
        f"{_gib(scratch)} of decode scratch (a stored object per decode thread and array not "
        f"decoded in place, at most), {_gib(pool + in_flight + scratch)} in all, more than the "
        f"{_gib(memory)} of memory this process may use; {lower}batch_size, prefetch_depth or "
        "decode_threads, or give a cache_dir (slots in files on its disk)"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"
