"""The automatic budget against the process's memory: an epoch no machine like this one holds.

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
"""

from __future__ import annotations

from insitubatch_nodes._process import usable_memory_bytes

__all__ = ["refuse_beyond_memory"]


def refuse_beyond_memory(floor: int, in_flight: int, block_chunks: int) -> None:
    """``ValueError`` where ``floor`` (the first epoch's working-set floor under an automatic
    budget, in bytes) and ``in_flight`` (the bytes of the batches the pipeline keeps in flight)
    together exceed the memory this process may use; ``block_chunks`` (the plan's) is named in
    the message, as what shrinks the floor."""
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
