"""Adapters to ``torch.utils.data``: a stateful ``IterableDataset`` over a pipeline.

``StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0)`` checkpoints and resumes
a pipeline exactly: the dataset's ``state_dict()`` is the pipeline's state as of the last batch
*delivered*, it reports an exact ``__len__`` (the batches this rank yields per epoch, which is
what Lightning needs to resume mid-epoch without skipping a batch), and ``load_state_dict()``
makes the next ``iter()`` continue with the following batch.

``num_workers > 0`` is refused: the pipeline already runs its IO on one event loop and decodes
on a thread pool in this process; worker processes would each fork a copy of that machinery
(and of the obstore runtime, which does not survive ``fork``) and re-read the same chunks.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch.utils.data
from torchdata.nodes import BaseNode

from insitubatch_nodes.batch import Batch, to_torch
from insitubatch_nodes.errors import StateMismatchError
from insitubatch_nodes.stages._graph import plan_state
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.loader import OVERTAKEN, Loader

__all__ = ["InSituIterableDataset", "as_dataset"]

_WORKERS_REFUSED = (
    "insitubatch_nodes pipelines run in the main process (num_workers=0): their IO already runs "
    "concurrently on one event loop with decode on a thread pool, so worker processes would only "
    "duplicate chunk reads and fork the object-store runtime, which does not survive fork. Use "
    "StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0) and raise max_inflight "
    "or decode_threads for more throughput."
)


_BATCHED_AGAIN = (
    "a DataLoader with a batch_size (torch's default is 1) would batch the pipeline's batches "
    "again: each would arrive as (1, batch_size, ...). The pipeline batches itself: pass "
    "batch_size=None, e.g. DataLoader(as_dataset(pipe), batch_size=None) or "
    "StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0)"
)

#: the running iteration of each pipeline wrapped by ``as_dataset`` (an older one is refused)
_ITERATIONS: weakref.WeakKeyDictionary[BaseNode[Any], object] = weakref.WeakKeyDictionary()


def _refuse_batching_again(caller: FrameType | None) -> None:
    """Raise when the frame that asked for the first item is a torch DataLoader fetcher that
    collates items into batches (``batch_size`` not ``None``): torch's ``_IterableDatasetFetcher``
    (and torchdata's copy of it) keep ``auto_collation`` and the dataset's iterator on ``self``.
    Anything else (a plain loop, ``batch_size=None``) passes."""
    fetcher = None if caller is None else caller.f_locals.get("self")
    if getattr(fetcher, "auto_collation", False) is True and hasattr(fetcher, "dataset_iter"):
        raise ValueError(_BATCHED_AGAIN)


class InSituIterableDataset(torch.utils.data.IterableDataset[Any]):
    """An ``IterableDataset`` over a pipeline, with exact length and resumable state.

    ``pipeline`` is what :func:`~insitubatch_nodes.insitu_pipeline` returns, or the root stage
    of a graph composed by hand (its :class:`~insitubatch_nodes.stages.StageContext` names the
    :class:`~insitubatch_nodes.stages.ReadPlanNode`; a
    :class:`~insitubatch_nodes.stages.PrefetcherNode` at the top gives the exact length).
    Each item is ``transform(batch)`` — by default :func:`~insitubatch_nodes.batch.to_torch`
    (``{label: tensor}``); ``transform=to_item`` (:func:`~insitubatch_nodes.batch.to_item`)
    adds each row's ``"sample_indices"``, ``"members"`` and ``"patch_origins"``
    (``{label: tensor}`` each), so a row names its member and sample as in the pipeline's own
    batch. ``epoch_fn``, when
    given, is asked for the epoch at every fresh ``iter()`` (e.g. a trainer's
    ``current_epoch``), so the permutation follows the trainer.
    A loaded state resumes its own epoch unless ``epoch_fn`` is already past it (a trainer
    stopped mid-epoch by ``should_stop`` counts that epoch as done and resumes at the next):
    the state is then dropped and the trainer's epoch starts from its first batch. A state
    taken where ``epoch_fn``'s epoch ends — its last batch delivered, or, restored on another
    world size, none of the epoch left for these ranks — delivers nothing while ``epoch_fn``
    stays in that epoch (whose length is then this rank's batches of it: rank 0's state
    restored on a rank with fewer, as an ``"uneven"`` one, counts that rank's; after an
    ``iter()`` in it, the next epoch's) and starts the next epoch when ``epoch_fn`` does: the
    next epoch is delivered once, under its own number, however often ``iter()`` is called
    before (before 2026-12-07 a second ``iter()`` in the ended epoch delivered the next).
    So does a state at the next epoch's start, taken after a loop over ``epoch_fn``'s epoch:
    a rank's with no batch of it (``empty_ranks``), or this dataset's after an ``iter()``
    in an epoch a loaded state ended (before 2026-12-07 that next epoch ran at once, inside
    the trainer's, and the state after it was an epoch ahead of the trainer).
    """

    def __init__(
        self,
        pipeline: BaseNode[Batch],
        transform: Callable[[Batch], Any] = to_torch,
        epoch_fn: Callable[[], int] | None = None,
    ) -> None:
        context = getattr(pipeline, "context", None)
        if not isinstance(pipeline, BaseNode) or not isinstance(context, StageContext):
            raise TypeError(
                "as_dataset() takes the pipeline insitu_pipeline() returns, or the root stage of "
                "a graph composed with a StageContext (which names its ReadPlanNode), got "
                f"{pipeline!r}"
            )
        if not callable(transform):
            raise TypeError(
                f"as_dataset(transform=...) must be a callable Batch -> item, got {transform!r}"
            )
        self.pipeline = pipeline
        self.plan = context.plan
        self.transform = transform
        self.epoch_fn = epoch_fn
        self._loader: Loader[Batch] = Loader(pipeline)
        self._pending: dict[str, Any] | None = None
        self._iterated = False
        self.told_len: int | None = None  # the last length reported (what a trainer was told)
        #: How to go on without a saved state this dataset refuses, said in place of the
        #: pipeline's own advice (``set_epoch``) by whoever drives the dataset otherwise (a
        #: data module's trainer); ``{epoch}`` is the state's epoch. ``None``: the pipeline's.
        self.without_state: str | None = None
        self._loaded_epoch_over = False  # (end_loaded_epoch, until the next iter())
        # epoch_fn's epoch where a loaded state ended it here (an iter() in it found it over,
        # or end_loaded_epoch took a mid-epoch state as its end): every iter() in it delivers
        # nothing, the next epoch's start pending in its place
        self._ended_here: int | None = None

    def __len__(self) -> int:
        """Batches in the epoch the next ``iter()`` continues or starts: the same every epoch,
        except an epoch resumed on another world size (counted from that epoch's start)."""
        self.told_len = self.next_len()
        return self.told_len

    def _drop_overtaken_state(self) -> bool:
        """Forget a pending state whose epoch ``epoch_fn`` has moved past (see the class);
        whether one was forgotten."""
        if self._pending is None or self.epoch_fn is None:
            return False
        epoch = int(self.epoch_fn())
        if epoch <= self.plan.resumed_epoch(plan_state(self._pending)):
            return False
        self._pending = None
        self.plan.set_epoch(epoch)
        return True

    def _ended_epoch(self) -> int | None:
        """The batches of ``epoch_fn``'s epoch when a pending state was taken at that epoch's
        end (its last batch delivered, or on another world size none of it left): the trainer
        is still in that epoch, which holds nothing more; ``None`` otherwise. For a state cut
        short of its epoch's end (:meth:`end_loaded_epoch`), and once an ``iter()`` in the
        ended epoch found it over (the trainer is told the next epoch's length at its end):
        the next epoch's batches (the cut epoch's count, less any limit the trainer applies to
        it, could come to none)."""
        if self.epoch_fn is None:
            return None
        epoch = int(self.epoch_fn())
        if self._ended_here == epoch:  # (the next epoch's start is pending)
            if self._pending is None:  # (a graph that cannot say its start: epoch pinned)
                return self.plan.epoch_len
            return self.plan.resumed_len(plan_state(self._pending))
        if self._pending is None:
            return None
        state = plan_state(self._pending)
        if int(state["epoch"]) == epoch and self.plan.ends_epoch(state):
            return self.plan.ended_len(state)  # (this rank's: rank 0's state holds rank 0's)
        if (
            int(state["epoch"]) == epoch + 1
            and not int(state["batches_emitted"])
            and not state.get("resumed")
        ):
            # the next epoch's start: the state after a loop over the trainer's epoch (an
            # empty rank's, or one an iter() found ended here): that epoch is over here too
            # (before 2026-12-07 only an empty rank's; any other delivered the next epoch
            # inside the trainer's, and again in the next); its length this rank's batches
            return self.plan.resumed_len({**state, "epoch": epoch})
        return None

    def _end_here(self) -> None:
        """Hold ``epoch_fn``'s epoch as over here, the start of the next epoch pending."""
        assert self.epoch_fn is not None
        self._ended_here = int(self.epoch_fn())
        if self._pending is not None:
            self._pend_start(self.plan.resumed_epoch(plan_state(self._pending)))

    def ended_epoch_lens(self) -> tuple[int, int] | None:
        """``(batches of the epoch, batches of the next)`` where a pending state was taken at
        the end of ``epoch_fn``'s epoch (the next one under this pipeline's views and batch
        size); ``None`` otherwise."""
        ended = self._ended_epoch()
        if ended is None:
            return None
        if self._pending is None:  # (a graph that cannot say its start: epoch pinned)
            return ended, self.plan.epoch_len
        return ended, self.plan.resumed_len(plan_state(self._pending))

    def _pend_start(self, epoch: int) -> None:
        """Make the state pending the start of ``epoch`` (what a checkpoint taken now holds,
        and what the length of the next epoch is counted from)."""
        start = getattr(self.pipeline, "start_state", None)
        state = start(epoch) if callable(start) else None
        if state is None:  # (a graph that cannot say its start: pin the epoch instead)
            self._pending = None
            self.plan.set_epoch(epoch)
        else:
            self._pending = {"root": state, "num_yielded": 0}

    def next_len(self) -> int:
        """``len(self)`` without recording it as told."""
        self._drop_overtaken_state()
        ended = self._ended_epoch()
        if ended is not None:
            return ended
        if self._pending is not None:
            return self.plan.resumed_len(plan_state(self._pending))
        if hasattr(self.pipeline, "__len__"):
            return len(self.pipeline)
        return self.plan.current_len

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(_WORKERS_REFUSED)
        self._iterated = True
        self._loaded_epoch_over = False
        self._drop_overtaken_state()
        if self._ended_epoch() is not None:
            # nothing left of the trainer's epoch, at this iter() or any other in it: the next
            # one starts when the trainer's does (delivered now, it would be delivered again
            # under the trainer's next epoch; before 2026-12-07 a second iter() did so)
            self._end_here()
            return
        self._ended_here = None
        if self._pending is not None:
            self._loader.load_state_dict(self._pending)
            self._pending = None
        elif self.epoch_fn is not None:
            self.plan.set_epoch(int(self.epoch_fn()))
        first, token = True, object()
        _ITERATIONS[self.pipeline] = token
        for batch in self._loader:
            if first:
                first = False
                _refuse_batching_again(sys._getframe(1))
            yield self.transform(batch)
            if _ITERATIONS.get(self.pipeline) is not token:  # a newer iteration took over
                raise RuntimeError(OVERTAKEN)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state as of the last batch delivered (rank-independent)."""
        dropped = self._drop_overtaken_state()
        if self._pending is not None:
            return self._pending
        start = getattr(self.pipeline, "start_state", None)
        if (dropped or not self._iterated) and callable(start):
            # Asking torchdata's Loader would start the pipeline (and pin its epoch) just to
            # report "before the first batch": say it directly instead, where the graph can.
            epoch = int(self.epoch_fn()) if self.epoch_fn is not None else self.plan.next_epoch
            state = start(epoch)
            if state is not None:
                return {"root": state, "num_yielded": 0}
        return self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` resume after the batch ``state`` was taken at.

        Raises ``ValueError`` naming the field when the state comes from a pipeline with a
        different dataset or split, or, mid-epoch, batch size or seed (a state taken where an
        epoch begins or ends batches the next epoch by this pipeline's): a
        :class:`~insitubatch_nodes.errors.StateMismatchError` says how to go on without the
        state as :attr:`without_state` does, when set. A different world size is not refused:
        the epoch resumes elastically (see ``ReadPlanNode``). After :meth:`end_loaded_epoch`,
        a state taken mid-epoch is taken as where its epoch ended (see there).
        """
        plan = plan_state(state)
        try:
            self.plan.check_state(plan)
        except StateMismatchError as refused:
            if self._loaded_epoch_over and self._fits_where_its_epoch_ends(plan):
                self._take_as_ended(plan)
                return
            if self.without_state is None:
                raise
            raise refused.told(self.without_state.format(epoch=refused.epoch)) from None
        epoch = int(plan["epoch"])
        if self._loaded_epoch_over and self.plan.resumed_epoch(plan) == epoch:
            self._take_as_ended(plan)  # (mid-epoch: its consumer cut that epoch short)
            return
        self._pending, self._ended_here = state, None

    def _take_as_ended(self, plan: Mapping[str, Any]) -> None:
        """Pend the start of the epoch after read-plan state ``plan``'s, taking ``plan`` as
        where its epoch ended: while ``epoch_fn`` stays in that epoch, the dataset delivers
        nothing (its length: the next epoch's batches), as for a state taken at an epoch's
        end (see the class)."""
        epoch = int(plan["epoch"])
        self._pend_start(epoch + 1)
        self._ended_here = epoch

    def end_loaded_epoch(self) -> None:
        """Take a state loaded before the next ``iter()`` as where its epoch ended: its
        consumer counts that epoch as over there (a trainer that restarts after the last batch
        ``limit_train_batches`` let it train, short of the pipeline's epoch). A state taken
        mid-epoch then behaves as one taken where that epoch ends: nothing more of that epoch
        is delivered (while ``epoch_fn`` stays in it, its length is the next epoch's) and the
        next epoch starts whole, also under another batch size, seed or views, which
        :meth:`load_state_dict` otherwise refuses mid-epoch."""
        self._loaded_epoch_over = True

    def _fits_where_its_epoch_ends(self, plan: Mapping[str, Any]) -> bool:
        """Whether the read-plan state ``plan`` would restore here had it been taken where its
        epoch ends (the start of the next: same dataset and split, any batching)."""
        ended = {k: v for k, v in plan.items() if k != "resumed"}
        ended.update(epoch=int(plan["epoch"]) + 1, batches_emitted=0)
        try:
            self.plan.check_state(ended)
        except StateMismatchError:
            return False
        return True

    def close(self) -> None:
        """Close the pipeline: every stage of its graph lets go of what it holds."""
        closer = getattr(self.pipeline, "close", None)
        if callable(closer):
            closer()
        else:
            self.pipeline.context.close()


def as_dataset(
    pipeline: BaseNode[Batch],
    transform: Callable[[Batch], Any] = to_torch,
    epoch_fn: Callable[[], int] | None = None,
) -> InSituIterableDataset:
    """Wrap ``pipeline`` for ``torch.utils.data`` / torchdata's ``StatefulDataLoader``: each
    item is ``transform(batch)``, by default :func:`~insitubatch_nodes.batch.to_torch` (the
    arrays as tensors; ``transform=to_item`` adds where each row came from: see
    :class:`InSituIterableDataset`)."""
    return InSituIterableDataset(pipeline, transform=transform, epoch_fn=epoch_fn)
