"""What a Lightning trainer is told of the training loader's epochs, kept in step with the
training pipeline (needs the ``lightning`` extra; used by :mod:`insitubatch_nodes.lightning`).

Lightning reads a loader's length once, when it loads the loader, and reloads it only when
told to (``reload_dataloaders_every_n_epochs``). An epoch of the training pipeline may differ
from the last one the trainer was told of: an epoch resumed on another number of ranks, views
given by ``set_views`` (a rollout that grows), another batch size (``dm.batch_size``), a
checkpoint saved where an epoch ended restored into a data module of the next epoch's settings.
:class:`EpochLengthSync` has the trainer reload the loader before such an epoch, once;
:func:`follow_ended_epoch` asks for it where a loaded state ended the trainer's epoch.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = [
    "EpochLengthSync",
    "count_resumed_epoch_start",
    "ends_epoch_on_restart",
    "finish_ended_epoch",
    "follow_ended_epoch",
    "rebuild_training_loader",
    "restoring_loops",
    "resumed_at",
    "trained_its_last_batch",
]

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

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a training loader built while Lightning restored a checkpoint (configure_optimizers
        # reading estimated_stepping_batches) went without the data module's state: built again
        if getattr(getattr(trainer, "datamodule", None), "_pending_train_state", None):
            rebuild_training_loader(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restore is not None:
            setattr(trainer, _RELOAD, self._restore[0])
            self._restore = None

    def reload_before_next_epoch(self, trainer: pl.Trainer) -> None:
        """Have the trainer reload the training loader when its next epoch starts (once)."""
        if self._restore is None:
            self._restore = (getattr(trainer, _RELOAD),)
        setattr(trainer, _RELOAD, 1)


def restoring_loops(trainer: Any) -> bool:
    """Whether ``trainer`` is restoring a checkpoint into a ``fit`` and has not yet restored its
    loops' counts: from where it loads the data module's state (``load_state_dict``) to where
    it restores its loops (``Trainer._run``), with ``configure_optimizers`` run in between
    (one reading ``trainer.estimated_stepping_batches`` has Lightning build the training
    loader there: Lightning issue #20550). Its epoch and batch counts are then those it had
    before: 0 for a new trainer, where the last ``fit`` left them for one fitted before."""
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None)
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return isinstance(loaded, dict) and "loops" in loaded and getattr(fn, "value", fn) == "fit"


def rebuild_training_loader(trainer: Any) -> None:
    """Have ``trainer``'s fit loop build its training loader afresh where it next sets up its
    data (``FitLoop.setup_data``: ``train_dataloader`` asked again, its length read and
    Lightning's own copy of the loader state loaded where it resumes), as Lightning's
    batch-size finder has it do; nothing where it holds none."""
    fit: Any = getattr(trainer, "fit_loop", None)
    if getattr(fit, "_combined_loader", None) is not None:
        fit._combined_loader = None


def _epoch_loop(trainer: Any) -> Any:
    """The trainer's training epoch loop (``fit_loop.epoch_loop``), whose ``batch_progress``
    counts the epoch's batches; ``None`` for a trainer without one (a stand-in)."""
    return getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)


def resumed_at(trainer: Any) -> int | None:
    """The batches Lightning's training loop counts as done in the epoch it is resuming, while
    it resumes one (its epoch loop ``restarting``: a checkpoint saved mid-epoch, or one saved
    after ``max_steps`` stopped a run, which Lightning resumes at the next batch although it
    counted the epoch as done); ``None`` otherwise."""
    loop = _epoch_loop(trainer)
    if loop is None or not getattr(loop, "restarting", False):
        return None
    return int(loop.batch_progress.current.ready)


def ends_epoch_on_restart(trainer: Any) -> bool:
    """Whether Lightning (2.5+) restarts from a checkpoint saved after the last batch it
    trained of an epoch (``on_train_batch_end``: ``ModelCheckpoint(every_n_train_steps=...)``
    on that batch), counting that epoch as over: the batch it saved as ``is_last_batch`` (the
    epoch's, or the last ``limit_train_batches`` lets it train), saved between the batch's end
    hooks and Lightning's count of it. The loader state of such a checkpoint holds nothing
    Lightning trains: it starts the next epoch (see :func:`finish_ended_epoch`). ``False``
    under a Lightning before 2.5 (it restarts the ended epoch at its last batch)."""
    loop = _epoch_loop(trainer)
    progress = getattr(loop, "batch_progress", None)
    if progress is None or not getattr(loop, "restarting", False):
        return False
    if not hasattr(loop, "restarted_on_train_batch_end"):  # (Lightning before 2.5)
        return False
    current = progress.current
    return bool(progress.is_last_batch) and current.completed == current.processed - 1


def trained_its_last_batch(trainer: Any) -> bool:
    """Whether the trainer's count of its epoch says it trained the batch it flagged
    ``is_last_batch`` (the epoch's, or the last ``limit_train_batches`` lets it train). Asked
    where a checkpoint's loader state is loaded, before Lightning moves on: the checkpoint was
    saved at that batch's end (:func:`ends_epoch_on_restart`), at the validation after it, or
    where the epoch ended, and Lightning trains no more batch of that epoch (it starts the
    next, or runs the ended epoch's end hooks first). The loader state, mid-epoch where the
    limit cut the epoch short, then holds nothing Lightning trains."""
    loop = _epoch_loop(trainer)
    progress = getattr(loop, "batch_progress", None)
    if progress is None:
        return False
    current = progress.current
    return bool(progress.is_last_batch) and current.ready > 0 and current.processed == current.ready


def finish_ended_epoch(trainer: Any, nxt: int) -> bool:
    """Where Lightning restarts from a checkpoint saved after an epoch's last batch
    (``on_train_batch_end``: ``ModelCheckpoint(every_n_train_steps=...)`` on that batch), have
    it count that epoch as over whatever length it is told of the next (up to ``nxt``, the
    next epoch's batches): whether it does, so that the loader may be reloaded for that epoch.

    Lightning (2.5+) counts the ended epoch as done by the batch flag it saved
    (``is_last_batch``), but its epoch loop starts the next epoch at batch 0 only where its
    count of the ended epoch's batches reaches the length it is told when that epoch starts
    (``_TrainingEpochLoop.reset``): told a longer next epoch, it took the ended epoch's
    batches for the next epoch's first and trained the rest (told the ended epoch's length
    instead, it trained that many of the next). That count is of an epoch Lightning has
    finished and resets right then; raised to ``nxt``, the next epoch starts at batch 0 and
    runs the length it is told. ``False`` for a restart of another kind, which runs the ended
    epoch's end hooks again (where :class:`EpochLengthSync` has the loader reloaded): a
    checkpoint saved after the epoch's validation, one that ``max_steps`` has Lightning
    restart, and any under a Lightning before 2.5 (it restarts the ended epoch at its last
    batch, which the training loader ends at once: the state holds nothing more of it)."""
    if not ends_epoch_on_restart(trainer):
        return False
    current = _epoch_loop(trainer).batch_progress.current
    if current.processed < nxt:
        current.ready = current.started = current.processed = nxt
        current.completed = nxt - 1
    return True


def count_resumed_epoch_start(trainer: Any) -> None:
    """Count the start of the epoch Lightning resumes after the checkpoint of an epoch's last
    batch (:func:`finish_ended_epoch`), as Lightning counts any epoch's start: asked when the
    training loader is reloaded for that epoch (``on_advance_start``). Lightning (2.5+, 2.6.6
    at least) skips that count there (its restart stage, ``restarted_mid_epoch``, is still
    set), which left its epoch counts one short ever after: the checkpoints the resumed fit
    saved then restored wrongly, with any loader (one saved where an epoch ended lost the next
    epoch; one mid-epoch restarted Lightning's ``batch_idx`` at 0). Counted only where
    Lightning has not (its epochs ``ready`` still equal to those ``processed``)."""
    fit: Any = getattr(trainer, "fit_loop", None)
    loop: Any = getattr(fit, "epoch_loop", None)
    if not getattr(fit, "restarted_mid_epoch", False):
        return
    if not getattr(loop, "restarted_on_train_batch_end", False):
        return
    progress = fit.epoch_progress
    if loop.batch_progress.is_last_batch and progress.current.ready == progress.current.processed:
        progress.increment_ready()
        progress.increment_started()


def follow_ended_epoch(trainer: Any, lens: tuple[int, int] | None) -> bool:
    """For a training loader asked for by ``trainer`` (``train_dataloader``): ``lens`` (the
    batches of the trainer's epoch, of the next) where its state was loaded where that epoch
    ended, ``None`` otherwise. Has the trainer reload the loader before the next epoch where
    Lightning would otherwise keep a length not the next epoch's (a checkpoint saved at
    ``on_train_epoch_end`` restored into a data module of other views or batch size), and
    wherever Lightning restarts after the last batch it trained of an epoch (the epoch's, or
    the last ``limit_train_batches`` lets it train: :func:`finish_ended_epoch`), so that
    :func:`count_resumed_epoch_start` is asked at that reload. Whether it did."""
    count_resumed_epoch_start(trainer)
    if trainer is None:
        return False
    if getattr(getattr(trainer, "fit_loop", None), "restarting", False):
        if not finish_ended_epoch(trainer, 0 if lens is None else lens[1]):
            return False
    elif lens is None or lens[0] == lens[1]:
        return False
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, EpochLengthSync):
            callback.reload_before_next_epoch(trainer)
    return True
