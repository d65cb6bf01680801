"""``Loader``: torchdata's ``Loader``, safe to resume whatever the call order, with a length.

torchdata 0.11's ``Loader`` drops a state given to ``load_state_dict`` when ``state_dict()`` was
called on that loader before (it had built an iterator just to answer, and the next ``iter()``
hands back that iterator without applying the pending state — fixed upstream in
meta-pytorch/data PR #1548, unreleased). A training loop that saves a state at every step and
then restores one on the same object restarts at batch 0 without any error. This subclass fixes
exactly that and adds ``__len__`` (the root's batches per epoch), which is what Lightning needs
to resume mid-epoch without skipping a batch. It also refuses a second loop over one root at
once: torchdata lets two ``Loader`` s over one pipeline share its stream (each got every other
batch); here the older loop's next batch raises ``RuntimeError`` (:data:`OVERTAKEN`).
And it restores pipelines mixed by torchdata's ``MultiNodeWeightedSampler`` exactly: a state
holding a sampler's is handed on as a copy (torchdata 0.11's sampler changes the dict of
exhausted sources it was restored from) in which each source the sampler had not found
exhausted is marked (:func:`~insitubatch_nodes.stages._graph.owe_stops`): a pipeline saved
after its epoch's last batch then raises that epoch's ``StopIteration`` when the sampler asks
it next, as the run that saved the state would have, instead of starting its next epoch at
once (what a pipeline restored at an epoch's end does for every other consumer). torchdata's
own ``Loader`` over such a mix resumes it with another epoch of that pipeline. Its iterator
forgets, on each ``reset``, the state its look-ahead took (torchdata 0.11 went on reporting a
state taken before a restart: upstream PR #1552). Everything else is torchdata's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar, overload

from torchdata.nodes import BaseNode
from torchdata.nodes import Loader as _TorchdataLoader
from torchdata.nodes.loader import LoaderIterator

from insitubatch_nodes._checks import check_bool
from insitubatch_nodes.stages._graph import owe_stops
from insitubatch_nodes.stages.prefetch import PrefetcherNode, not_a_map_dataset

__all__ = ["OVERTAKEN", "Loader"]

T = TypeVar("T")

OVERTAKEN = (
    "this pipeline was iterated again (another Loader or DataLoader over it, or a new iter()) "
    "while this loop was still running, and the newer loop has taken it over: its batches are "
    "not this loop's. A pipeline feeds one loop at a time: build a pipeline per loader (e.g. "
    "insitu_pipeline(..., split='val') for validation), or end one loop before starting the next"
)

#: the loader whose loop runs each root node now (an older loader's loop is refused), held
#: weakly: a loader holds its root, so a loader held here kept its key, the pipeline with its
#: pool and batch buffers, alive for the life of the process
_RUNNING: weakref.WeakKeyDictionary[BaseNode[Any], weakref.ref[Any]] = weakref.WeakKeyDictionary()


class Loader(_TorchdataLoader[T]):
    """``torchdata.nodes.Loader`` whose ``load_state_dict`` always applies at the next ``iter()``.

    ``len(loader)`` is ``len(root)`` when the root node has a length (every pipeline that
    :func:`~insitubatch_nodes.insitu_pipeline` builds does), else ``TypeError``; with a state
    loaded and not yet applied, the length of the epoch that state resumes (a pipeline's
    ``resumed_len``), which differs only for an epoch resumed on another world size. The same
    holds right after the ``iter()`` that applies it: torchdata's iterator then holds the
    first batch, taken ahead, and the length is counted at the consumer's position, not the
    pipeline's (a resumed epoch with one batch left is that epoch's, not the next one's).
    A state taken inside an epoch resumes that epoch's loop even where this rank has no batch
    of it left (an elastic ``"uneven"`` rank with no share of the rest: an empty loop; before
    2026-12-07 torchdata's restart ran the next epoch in it); one taken at an epoch's end, the
    next epoch, also where this rank has no batch of that (an empty ``"uneven"`` rank given
    rank 0's state: before 2026-12-07 the restart ran the epoch after it in its place).
    """

    # torchdata ships no type information (``BaseNode[T]`` is ``Any`` to a type checker): over
    # a pipeline or a PrefetcherNode the item type is taken from it (``Loader[Batch]``)
    @overload
    def __init__(self, root: PrefetcherNode[T], restart_on_stop_iteration: bool = True) -> None: ...
    @overload
    def __init__(self, root: BaseNode[T], restart_on_stop_iteration: bool = True) -> None: ...
    def __init__(self, root: BaseNode[T], restart_on_stop_iteration: bool = True) -> None:
        if not isinstance(root, BaseNode):
            raise TypeError(
                "Loader takes the pipeline insitu_pipeline() returns, or the root node of a "
                f"torchdata.nodes graph, got {type(root).__name__}: {root!r:.80}"
            )
        restart = check_bool("restart_on_stop_iteration", restart_on_stop_iteration)
        super().__init__(root, restart_on_stop_iteration=restart)
        self._it: LoaderIterator[T] | None = None  # (as torchdata's; typed for the checks)

    def __iter__(self) -> Iterator[T]:
        """torchdata's ``iter()`` (the root reset, or resumed from a loaded state), this loader
        becoming the one whose loop runs its root."""
        _RUNNING[self.root] = weakref.ref(self)
        if self._it is None:
            self._it = _OneLoop(self)
        pending = self._next_iter_state_dict
        if pending is not None and hasattr(self.root, "ends_epoch"):
            # this package's root resumes a state taken at its epoch's end at the next epoch's
            # start itself, and one inside its epoch in that epoch: the loop the state resumes,
            # empty where this rank has no batch of it (torchdata's restarts a restored loop
            # without one: the epoch after it, one loop ahead)
            self._next_iter_state_dict = None
            self._it.reset(initial_state=pending)
            return self._it
        return super().__iter__()

    if TYPE_CHECKING:  # torchdata's own (untyped), declared for type checkers
        _next_iter_state_dict: dict[str, Any] | None

        def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` at the next ``iter()`` (a state asked for earlier with
        :meth:`state_dict` no longer hides it); ``state_dict`` itself is not changed, a
        sampler's sources are marked in a copy (see the module doc)."""
        super().load_state_dict(owe_stops(state_dict))
        self._iter_for_state_dict = False

    def __len__(self) -> int:
        pending, it = self._next_iter_state_dict, self._it
        if pending is None and it is not None and it._cached_item is not None:
            # iter() applying a state takes the next batch ahead (torchdata's has_next): the
            # root is a batch past the consumer, so ask for the length at the consumer's
            # position (where that batch ended the epoch, the root already counts the next)
            pending = it._cached_state_dict
        resumed_len = getattr(self.root, "resumed_len", None)
        if pending is not None and resumed_len is not None:
            return int(resumed_len(pending))
        length = getattr(self.root, "__len__", None)
        if length is None:
            raise TypeError(f"the root node {type(self.root).__name__} has no length")
        return int(length())

    def __getitem__(self, index: object) -> T:
        """Refused (``TypeError`` saying to wrap the pipeline with ``as_dataset``)."""
        raise not_a_map_dataset(self, index)


class _OneLoop(LoaderIterator[T]):
    """torchdata's loader iterator, refusing a batch once another loader runs its root, and
    forgetting on ``reset`` the state its look-ahead took (torchdata 0.11 keeps it after a
    look-ahead that found the epoch's end, and reports it from then on: upstream
    meta-pytorch/data PR #1552, unreleased)."""

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cached_state_dict = None

    def next(self) -> T:
        running = _RUNNING.get(self.root)
        if running is None or running() is not self.loader:
            raise RuntimeError(OVERTAKEN)
        return super().next()
