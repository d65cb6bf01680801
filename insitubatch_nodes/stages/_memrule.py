"""One graph's memory rule as counted now (:mod:`~insitubatch_nodes.plan.memory_floor`), kept
in its :class:`~insitubatch_nodes.stages.context.StageContext` (``context.memory``).

Three stages add to it, each where it learns its part:

* the fetch stage counts it when it is built (the pool, the batches in flight, the decode
  scratch, and the batch transforms where it is told them: ``transform_bytes=``, as the
  builder passes them), and refuses a pipeline beyond memory there;
* the gather stage, built after it, counts what its batch transforms hold at most
  (:func:`~insitubatch_nodes.stages.gather.most_transform_bytes`), so a graph composed by hand
  is held to the builder's count for the same transforms (before 2026-12-07 it counted 0
  bytes for them unless ``transform_bytes=`` was passed); where that is more than the fetch
  stage was told, the fetch stage counts again (:attr:`MemoryRule.recount`): its automatic
  budget's choice to keep a small split whole then sees them, as the builder's does (later
  that day it did not, and a graph the builder builds was refused,
  ``tests/test_setviews_trial.py``);
* ``set_views`` counts it again for the new views before the plan takes them, once: the
  plan's ``set_views`` hands them to the fetch stage's check (:meth:`AsyncChunkFetchNode.
  count_views <insitubatch_nodes.stages.fetch.AsyncChunkFetchNode.count_views>`) with the
  plan of their first epoch it draws, and ``InSituPipeline.set_views`` gives it the new stacks'
  constants (``extra=``) and the schedule's floors: their batches, the chunks they read, and
  the static fields and forcings of their stacks (before 2026-12-07 none of it was counted
  again; later that day the pipeline counted it, then the plan's check again without the
  constants: two counts, three plans drawn per call, ``tests/test_setviews_trial.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from insitubatch_nodes.plan.memory_floor import HeldMemory, refuse_beyond_memory

__all__ = ["MemoryRule", "most_transform_bytes"]


class MemoryRule:
    """The build's memory check of one graph (module docstring): :attr:`counted` is what it
    counts the graph to hold at most (``None`` until the fetch stage is built)."""

    def __init__(self) -> None:
        self.counted: HeldMemory | None = None
        #: what the batch transforms hold at most for given batch views (the gather stage's,
        #: :meth:`count_transforms`), or ``None`` (no gather stage: what was counted)
        self.transforms: Callable[[Mapping[str, Any]], int] | None = None
        #: the fetch stage's count beside a number of bytes of batch transforms (it decides
        #: again whether an automatic budget keeps the split), or ``None``
        self.recount: Callable[[int], HeldMemory] | None = None
        self._enforced = False  # slots in RAM: the rule applies (plan/memory_floor)
        self._explicit = False
        self._block_chunks = 0

    def count(self, held: HeldMemory, *, enforced: bool, explicit: bool, block_chunks: int) -> None:
        """Count ``held`` (the fetch stage, at its build): ``ValueError`` where it exceeds the
        memory this process may use and the rule applies (``enforced``: the pool's slots are
        in RAM), as :func:`~insitubatch_nodes.plan.memory_floor.refuse_beyond_memory` says for
        an ``explicit`` or automatic budget; kept otherwise."""
        self._enforced, self._explicit, self._block_chunks = enforced, explicit, block_chunks
        self.check(held)
        self.counted = held

    def check(self, held: HeldMemory) -> None:
        """``ValueError`` where ``held`` breaks the rule this graph was counted under (nothing
        is kept: :meth:`count` or :meth:`count_transforms` keep what passes)."""
        if self._enforced:
            refuse_beyond_memory(held, explicit=self._explicit, block_chunks=self._block_chunks)

    def count_transforms(
        self, most: Callable[[Mapping[str, Any]], int], views: Mapping[str, Any]
    ) -> None:
        """The batch transforms hold ``most(views)`` at most on the batch ``views`` (the gather
        stage, at its build; kept, for other views): counted where more than the fetch stage
        was told — by the fetch stage again (:attr:`recount`), whose automatic budget keeps a
        split whole only where the rule leaves room beside them, as the builder's does — and
        checked (``ValueError`` as :meth:`check`)."""
        self.transforms = most
        counted = self.counted
        nbytes = int(most(views))
        if counted is None or nbytes <= counted.transforms:
            return
        if self.recount is None:
            held = dataclasses.replace(counted, transforms=nbytes)
        else:
            held = self.recount(nbytes)
        self.check(held)
        self.counted = held


def most_transform_bytes(
    transforms: Sequence[Any], views: Mapping[str, Any], rows: int, batches: int
) -> int:
    """The most the batch ``transforms`` hold outside the pool (``pipe.stats()``'s
    ``batch_transform_bytes`` at most), in a pipeline of ``views`` (label -> view) whose
    batches have ``rows`` rows, ``batches`` of them alive at once: what each declares
    (``most_held_bytes(views, rows, batches)``: static fields and their cut rows, stacks'
    constant channels, the forcings' remembered fields and lent rows), else what it holds
    now (``held_bytes``; a transform of the user's that says neither counts nothing). The
    build's memory check counts it (before 2026-12-07 nothing of it: a ``Forcings``' up to
    64 MiB of remembered fields were beside every count)."""
    total = 0
    for t in transforms:
        most = getattr(t, "most_held_bytes", None)
        total += int(most(views, rows, batches) if callable(most) else getattr(t, "held_bytes", 0))
    return total
