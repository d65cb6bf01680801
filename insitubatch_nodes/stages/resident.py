"""The residency stage: a batch moves on once every chunk it reads is resident.

:class:`ChunkPoolNode` sits between the fetch stage and the gather stage. It knows nothing about
who fetches: each item it receives (a :class:`~insitubatch_nodes.stages.fetch.FetchedBatch`)
carries the
pool entries of the chunks the batch reads and a ``release`` handle that drops the pins the batch
held. The stage waits for the entries (a failed fetch or decode re-raises here, in the consumer's
thread, with array, chunk and store key in the message), hands the slots downstream, and calls
``release`` once the downstream stage has gathered the batch — when the next batch is requested.

Every wait here is tied to the liveness of what it waits on: an entry's ``ready`` future always
resolves (see :mod:`~insitubatch_nodes.pool`), and :meth:`ChunkPoolNode.interrupt` wakes a
wait at once from any thread (the prefetch stage calls it when it stops its thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes.errors import PipelineInterrupted
from insitubatch_nodes.plan.ledger import BatchPlan, ChunkKey
from insitubatch_nodes.slots import PENDING, READY, ChunkEntry
from insitubatch_nodes.stages._graph import SOURCE_KEY, source_start_state, source_state
from insitubatch_nodes.stages._ranges import profile_range
from insitubatch_nodes.stages._wiring import check_wiring, claim
from insitubatch_nodes.stages.context import StageContext

__all__ = ["ChunkPoolNode", "Lease", "PipelineInterrupted", "ResidentBatch"]


class AdmittedBatch(Protocol):
    """What the residency stage needs of an item: the plan, its entries, a release handle
    (and, from the fetch stage, the fills it started and any arrays rows landed in)."""

    @property
    def plan(self) -> BatchPlan: ...

    @property
    def entries(self) -> Mapping[ChunkKey, ChunkEntry]: ...

    @property
    def release(self) -> Callable[[], None]: ...


class Lease:
    """Whether a :class:`ResidentBatch`'s chunks are still pinned for it: ``over`` once the
    residency stage released them, when the batch after it was pulled or (``closed``) when the
    graph was closed."""

    __slots__ = ("closed", "over")

    def __init__(self) -> None:
        self.over = self.closed = False


@dataclass(frozen=True, eq=False)
class ResidentBatch:
    """A batch plan whose chunks are all resident: ``slots[(path, chunk)]`` is sample-first.

    ``arrays`` (or ``None``) are the batch's arrays when the fetch stage decoded rows straight
    into them: ``direct[label]`` rows of each label are there already, the others come from
    ``slots``. ``slots`` are valid while ``lease.over`` is false: until the next batch is
    pulled from the residency stage (so a node that pulls ahead must not sit between it and
    the stage that reads the slots; the :class:`GatherNode` refuses a batch gathered late)."""

    plan: BatchPlan
    slots: Mapping[ChunkKey, np.ndarray]
    arrays: Mapping[str, np.ndarray] | None = None
    direct: Mapping[str, int] = field(default_factory=dict)
    lease: Lease = field(default_factory=Lease)


class ChunkPoolNode(BaseNode[ResidentBatch]):
    """Residency stage: yields a batch once every chunk it reads is resident (module doc).

    ``source`` yields items with ``plan``, ``entries`` and ``release`` (the fetch stage's
    :class:`~insitubatch_nodes.stages.fetch.FetchedBatch`); ``context`` is the graph's
    :class:`~insitubatch_nodes.stages.context.StageContext` (its recorder; the stage joins it,
    so closing or interrupting the graph reaches this stage).
    """

    STAGE: ClassVar[int] = 2  # its place in a graph (stages/_wiring.py)

    def __init__(self, source: BaseNode[Any], *, context: StageContext) -> None:
        context = check_wiring(self.STAGE, source, context)
        super().__init__()
        self.source = source
        self.context = context
        self.recorder = context.recorder
        self._held: AdmittedBatch | None = None
        self._lease = Lease()
        self._interrupt: Future[None] = Future()
        context.join(self)
        claim(self, source)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._held = None
        self._interrupt = Future()
        self.source.reset(source_state(initial_state))

    def next(self) -> ResidentBatch:
        self._release_held()
        item: AdmittedBatch = next(self.source)
        rec = self.recorder
        t0 = time.perf_counter()
        jobs = getattr(item, "jobs", ())
        # one wait per fill (a fill is a group of chunks), not one per chunk
        fills = {id(job.fill): job.fill for job in jobs}
        for entry in item.entries.values():
            if entry.state == PENDING:
                fills.setdefault(id(entry.fill), entry.fill)
        with profile_range("insitu.wait_for_chunks"):
            for fill in fills.values():
                self._wait(fill.future)
        for job in jobs:
            if job.error is not None:  # a row decoded in place could not be read or decoded
                raise job.error
        slots: dict[ChunkKey, np.ndarray] = {}
        for key, entry in item.entries.items():
            if entry.state != READY:  # raises the fetch/decode error with its cause chained
                self._check_interrupt()
                entry.ready.result()
            slots[key] = entry.slot
        rec.add("chunk_wait_s", time.perf_counter() - t0, start=t0, batch=item.plan.index)
        self._held, self._lease = item, Lease()
        return ResidentBatch(
            plan=item.plan,
            slots=slots,
            arrays=getattr(item, "arrays", None),
            direct=getattr(item, "direct", {}),
            lease=self._lease,
        )

    def get_state(self) -> dict[str, Any]:
        return {SOURCE_KEY: self.source.state_dict()}

    def start_state(self, epoch: int) -> dict[str, Any] | None:
        """This stage's state before the first batch of ``epoch`` (see ``_graph``)."""
        return source_start_state(self.source, epoch)

    def interrupt(self) -> None:
        """Wake a wait in :meth:`next` now (thread-safe); it raises ``PipelineInterrupted``."""
        interrupt = self._interrupt
        if not interrupt.done():
            interrupt.set_result(None)

    def close(self) -> None:
        """Close the graph, as ``close()`` on its root does (:meth:`StageContext.close_graph`)."""
        self.context.close_graph()

    def release(self) -> None:
        """Hand back the batch last passed downstream (its pins go with it)."""
        self._lease.closed = True
        self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._lease.over = True  # (before the pins go: a gather that sees it false is done)
            held.release()

    def _wait(self, done: Future[None]) -> None:
        """Wait for ``done`` unless the graph is interrupted. An interrupt wins: a wait it ends
        raises ``PipelineInterrupted`` even where the close that follows it has already
        cancelled the fill (which would otherwise surface as ``FillCancelled``)."""
        if not done.done():
            wait((done, self._interrupt), return_when=FIRST_COMPLETED)
        self._check_interrupt()

    def _check_interrupt(self) -> None:
        if self._interrupt.done():
            raise PipelineInterrupted("the pipeline is stopping; this batch was abandoned")
