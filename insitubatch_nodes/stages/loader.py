"""``Loader``: torchdata's ``Loader``, safe to resume whatever the call order, with a length.

torchdata 0.11's ``Loader`` drops a state given to ``load_state_dict`` when ``state_dict()`` was
called on that loader before (it had built an iterator just to answer, and the next ``iter()``
hands back that iterator without applying the pending state — fixed upstream in
meta-pytorch/data PR #1548, unreleased). A training loop that saves a state at every step and
then restores one on the same object restarts at batch 0 without any error. This subclass fixes
exactly that and adds ``__len__`` (the root's batches per epoch), which is what Lightning needs
to resume mid-epoch without skipping a batch. Everything else is torchdata's.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode
from torchdata.nodes import Loader as _TorchdataLoader

__all__ = ["Loader", "not_a_map_dataset"]

T = TypeVar("T")


def not_a_map_dataset(obj: object, index: object) -> TypeError:
    """The error for ``obj[index]`` on a pipeline or a loader: what torch's ``DataLoader`` asks
    of a dataset it takes for map-style, when the pipeline is handed to it unwrapped."""
    return TypeError(
        f"{type(obj).__name__} delivers batches by iteration; it is not a map-style torch "
        f"Dataset (something asked it for item {index!r}: a torch DataLoader given the "
        "pipeline itself). Wrap the pipeline: DataLoader(as_dataset(pipe), batch_size=None) or "
        "StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0); or iterate it, "
        "for batch in Loader(pipe)"
    )


class Loader(_TorchdataLoader[T]):
    """``torchdata.nodes.Loader`` whose ``load_state_dict`` always applies at the next ``iter()``.

    ``len(loader)`` is ``len(root)`` when the root node has a length (every pipeline that
    :func:`~insitubatch_nodes.insitu_pipeline` builds does), else ``TypeError``; with a state
    loaded and not yet applied, the length of the epoch that state resumes (a pipeline's
    ``resumed_len``), which differs only for an epoch resumed on another world size. The same
    holds right after the ``iter()`` that applies it: torchdata's iterator then holds the
    first batch, taken ahead, and the length is counted at the consumer's position, not the
    pipeline's (a resumed epoch with one batch left is that epoch's, not the next one's).
    """

    def __init__(self, root: BaseNode[T], restart_on_stop_iteration: bool = True) -> None:
        super().__init__(root, restart_on_stop_iteration=restart_on_stop_iteration)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict`` at the next ``iter()`` (a state asked for earlier with
        :meth:`state_dict` no longer hides it)."""
        super().load_state_dict(state_dict)
        self._iter_for_state_dict = False

    def __len__(self) -> int:
        pending = self._next_iter_state_dict
        ahead = self._it is not None and self._it._cached_item is not None
        if pending is None and ahead:
            # iter() applying a state takes the next batch ahead (torchdata's has_next): the
            # root is a batch past the consumer, so ask for the length at the consumer's
            # position (where that batch ended the epoch, the root already counts the next)
            pending = self._it._cached_state_dict
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
