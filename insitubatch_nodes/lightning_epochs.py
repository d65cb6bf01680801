"""What a Lightning trainer is told of the training loader's epochs, kept in step with the
training pipeline (needs the ``lightning`` extra; used by :mod:`insitubatch_nodes.lightning`).

Lightning reads a loader's length once, when it loads the loader, and reloads it only when
told to (``reload_dataloaders_every_n_epochs``). An epoch of the training pipeline may differ
from the last one the trainer was told of: an epoch resumed on another number of ranks, views
given by ``set_views`` (a rollout that grows), another batch size (``dm.batch_size``), a
checkpoint saved where an epoch ended restored into a data module of the next epoch's settings.
:class:`EpochLengthSync` has the trainer reload the loader before such an epoch, once.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["EpochLengthSync", "ended_epoch_warning", "resumed_at"]

_RELOAD = "reload_dataloaders_every_n_epochs"  # the Trainer argument, kept as an attribute


class EpochLengthSync(pl.Callback):
    """Has Lightning reload the training loader before the next epoch where that epoch differs
    from what it was told: the trainer's data module says so (its ``_next_epoch_differs()``,
    asked where each training epoch ends), or :meth:`reload_before_next_epoch` is called. The
    trainer's own setting is put back when that epoch starts."""

    def __init__(self) -> None:
        self._restore: tuple[Any] | None = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        differs = getattr(getattr(trainer, "datamodule", None), "_next_epoch_differs", None)
        if callable(differs) and differs():
            self.reload_before_next_epoch(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restore is not None:
            setattr(trainer, _RELOAD, self._restore[0])
            self._restore = None

    def reload_before_next_epoch(self, trainer: pl.Trainer) -> None:
        """Have the trainer reload the training loader when its next epoch starts (once)."""
        if self._restore is None:
            self._restore = (getattr(trainer, _RELOAD),)
        setattr(trainer, _RELOAD, 1)


def resumed_at(trainer: Any) -> int | None:
    """The batches Lightning's training loop counts as done in the epoch it is resuming, while
    it resumes one (its epoch loop ``restarting``: a checkpoint saved mid-epoch, or one saved
    after ``max_steps`` stopped a run, which Lightning resumes at the next batch although it
    counted the epoch as done); ``None`` otherwise."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not getattr(loop, "restarting", False):
        return None
    return int(loop.batch_progress.current.ready)


def ended_epoch_warning(epoch: int, ended: int, nxt: int) -> str:
    """What a checkpoint saved after epoch ``epoch``'s last batch (``on_train_batch_end``)
    costs when restored into a data module whose next epoch has ``nxt`` batches, not the
    ``ended`` of that epoch: Lightning counts the epoch as done by the length it is told at the
    restore (``ended``, which a reload would move), and trains the next with that length."""
    lost = (
        f"its last {nxt - ended} batches will not be trained"
        if nxt > ended
        else "Lightning's count of its batches will be off"
    )
    return (
        f"this checkpoint was saved after the last batch of epoch {epoch} (on_train_batch_end), "
        f"and Lightning resumes epoch {epoch + 1} with the length epoch {epoch} had, {ended} "
        f"batches, where this data module's views and batch size give it {nxt}: {lost}. To "
        "resume it exactly, resume from the checkpoint saved where that epoch ended "
        "(ModelCheckpoint(save_on_train_epoch_end=True)) or from one saved mid-epoch"
    )
