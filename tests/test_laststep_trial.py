"""A user's trial of resuming an ``InSituDataModule`` fit from the checkpoints Lightning's
``ModelCheckpoint`` saves, where the batch size changes between epochs (a curriculum:
``dm.batch_size`` set from ``on_train_epoch_end``, 7 -> 5 -> 6, so 11, 15 and 12 batches).

One tiny store (``t2m`` 96 x 3 x 5, chunks of 4 steps, training split 0.75); a LightningModule
records, per training step, the trainer's epoch, the batch's epoch and index, its sample
indices, Lightning's ``batch_idx`` and the length it was told (``num_training_batches``). The
oracle is the fit never stopped: a resumed fit must train exactly its steps after the
checkpoint, all six fields equal. Each resumed data module is built with the batch size of the
epoch Lightning trains first (as recipes/forecast_rollout.py's ``resume_epoch`` reads it).

Found wrong (fixed, each a test here):

1. A checkpoint saved by ``ModelCheckpoint(every_n_train_steps=...)`` on an epoch's last batch,
   resumed where the next epoch is longer, lost that epoch's last batches (4 of epoch 1's 15
   here; 3 of 11 in tests/test_curriculum_trial.py), with a ``UserWarning`` calling it a
   Lightning limitation. Cause (Lightning 2.6's ``_TrainingEpochLoop.reset``): Lightning counts
   the ended epoch as done by the ``is_last_batch`` it saved, but starts the next epoch at
   batch 0 only where its count of the ended epoch's batches reaches the length it is told
   then; told the ended epoch's length (11) it trained 11 of the next epoch's 15, told 15 (a
   reload) it would have trained only 15 - 11. With one length for both, no length the loader
   reports can give 15: the data module now raises that count of the finished epoch (which
   Lightning resets right then) to the next epoch's length and has the loader reloaded, so the
   next epoch is told 15 and starts at batch 0 (``lightning_epochs.finish_ended_epoch``).
2. Where the next epoch is shorter (15 -> 12), the batches were right but Lightning was told
   the ended epoch's 15 for it (``num_training_batches``, what its epoch-fraction validation
   and progress read); now 12.
3. The checkpoints saved by a fit resumed from such a checkpoint restored wrongly: Lightning
   2.6 resumes it without counting the next epoch's start (its ``restarted_mid_epoch`` stage
   skips ``increment_ready``/``increment_started`` and ``on_train_epoch_start``; a plain
   ``DataLoader`` shows it too), so its epoch counts stay one short: resumed from the checkpoint
   that fit saved where epoch 1 ended, Lightning counted epoch 2 as done and trained nothing
   (its 12 batches lost; over four epochs, the next epoch's batches ran as the one after), and
   from one mid-epoch 1 it restarted ``batch_idx`` at 0 (the batches right). The data
   module now counts that start when it has the loader reloaded for that epoch
   (``lightning_epochs.count_resumed_epoch_start``; the reload is asked for every such
   checkpoint now, equal lengths too, and for a checkpoint on the last batch
   ``limit_train_batches`` lets an epoch train, whose loader state is mid-epoch: from the one
   such a resumed fit saved mid-epoch, Lightning trained 10 steps where 8 were left).

Tried and found right (tests below, or probes not kept): resumes from every checkpoint of
``every_n_train_steps=1`` (first batches of epochs 0 and 1, mid-epoch, last batches) and of
``save_on_train_epoch_end=True``, 60 over four epochs 7/5/6/4 and 48 at a constant batch size;
from every checkpoint of fits resumed from the last batches of epochs 0, 1 and 2 (99 of them;
60 at a constant batch size, 30 with ``limit_train_batches=5``), and of fits resumed
mid-epoch and at an epoch's end (87); ``every_n_epochs=1``; checkpoints saved at
validation's end with ``val_check_interval=0.5``, ``val_check_interval=4``
(``check_val_every_n_epoch=None``) and at the epoch's end (with a last-batch checkpoint beside
it), validation runs equal too; ``limit_train_batches=5`` and
``0.5`` at a constant batch size; ``max_steps`` with every last-batch and mid-epoch checkpoint;
runs stopped by ``max_steps`` at steps 1, 5, 10, 11 (epoch 0's last), 12, 26 and 27, resumed
from ``ModelCheckpoint``'s checkpoint of that step (curriculum and constant batch size).
Under Lightning 2.4.0 (put ahead on ``PYTHONPATH``) the last-batch checkpoints resume exactly
as well (it restarts the ended epoch at its last batch, which the loader ends at once).

Lightning's own, with a plain ``DataLoader`` too (not fixed here): with ``max_steps`` set, a
checkpoint saved at ``on_train_epoch_end`` resumes one epoch short (a plain ``DataLoader`` of 11
batches: 23 steps trained of 33, the first at ``batch_idx`` 11). Fixed since
(tests/test_lightning4_trial.py): with ``limit_train_batches`` and a batch size that changes, a
checkpoint on the limited epoch's last batch holds a mid-epoch loader state of the old batch
size, which the data module of the next epoch's batch size refused (``StateMismatchError``)
although Lightning resumes at the next epoch. Lightning's, documented with workarounds there: a
run stopped by ``max_steps`` on an epoch's last batch, saved by ``trainer.save_checkpoint``
after ``fit`` and resumed with ``max_steps`` set: Lightning spends the next epoch number on an
empty restart, the data module keeps the data order (epoch 1's batches under trainer epoch 2),
so ``max_epochs`` ends the resumed run an epoch early and a curriculum keyed on
``trainer.current_epoch`` batches that epoch with the next one's settings.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from insitubatch_nodes import PlanConfig, open_geometries
from insitubatch_nodes.batch import Batch
from tests.helpers import write_t2m_96

# Lightning is imported by the tests, not at collection (tests/lightning_parts.py says why).
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("lightning")]

SIZES = (7, 5, 6)  # the batch size of each epoch: 11, 15 and 12 batches
Step = tuple[int, tuple[int, int], tuple[int, ...], int, int]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 3, 5) in chunks of 4 steps, with its time axis named."""
    return write_t2m_96(tmp_path_factory.mktemp("laststep") / "s.zarr")


def _item(batch: Batch) -> dict[str, Any]:
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["x"])),
        "rows": tuple(np.asarray(batch.sample_indices["x"]).tolist()),
        "at": (batch.epoch, batch.index),
    }


def _fit(
    store: Path, work: Path, *, start: int = 0, ckpt: Path | None = None,
    checkpoints: tuple[dict[str, Any], ...] = (), sizes: tuple[int, ...] = SIZES,
    **options: Any,
) -> tuple[list[Step], list[str]]:  # fmt: skip
    """``trainer.fit`` over the curriculum ``sizes`` from epoch ``start``'s batch size (resumed from
    ``ckpt``), saving ``ModelCheckpoint(**each of checkpoints)`` into ``work``: the steps and
    the data module's warnings."""
    import lightning as L

    from insitubatch_nodes.lightning import InSituDataModule

    steps: list[Step] = []

    class Model(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            told = int(self.trainer.num_training_batches)
            steps.append((self.current_epoch, batch["at"], batch["rows"], batch_idx, told))
            return (self.w * 0.0).sum()

        def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
            steps.append((self.current_epoch, batch["at"], batch["rows"], -1, self.global_step))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Curriculum(L.Callback):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: L.Trainer, module: Any) -> None:
            trainer.datamodule.batch_size = sizes[min(trainer.current_epoch + 1, len(sizes) - 1)]

    g = open_geometries(str(store), ["t2m"])["t2m"]
    dm = InSituDataModule(
        str(store), {"x": g, "y": g.shift(1)}, (0.75, 0.25, 0.0), transform=_item,
        config=PlanConfig(batch_size=sizes[start], block_chunks=2, seed=3), log_report=False,
        eval_batch_size=6,
    )  # fmt: skip
    callbacks = [Curriculum()]
    callbacks += [L.pytorch.callbacks.ModelCheckpoint(dirpath=work, save_top_k=-1, **c)
                  for c in checkpoints]  # fmt: skip
    settings: dict[str, Any] = {
        "max_epochs": len(sizes), "default_root_dir": work, "logger": False,
        "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu",
        "limit_val_batches": 0, "num_sanity_val_steps": 0, "callbacks": callbacks,
        "enable_checkpointing": bool(checkpoints), **options,
    }  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**settings).fit(Model(), datamodule=dm, ckpt_path=ckpt)
    ours = [str(w.message) for w in caught if "insitubatch_nodes" in w.filename]
    return steps, ours


def _resume_epoch(ckpt: Path) -> int:
    """The epoch Lightning trains first from ``ckpt`` (recipes/forecast_rollout.py's rule)."""
    loop = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]
    epochs = loop["epoch_progress"]["current"]
    last_batch = bool(loop["epoch_loop.batch_progress"]["is_last_batch"])
    return int(epochs["processed"]) + int(last_batch and epochs["processed"] < epochs["started"])


def _step_of(ckpt: Path) -> int:
    return int(torch.load(ckpt, weights_only=False)["global_step"])


@pytest.fixture(scope="module")
def fitted(store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Step]]:
    """The fit never stopped, with a checkpoint after every step and at every epoch's end."""
    work = tmp_path_factory.mktemp("fitted")
    steps, said = _fit(store, work, checkpoints=(
        {"every_n_train_steps": 1, "filename": "{epoch}-{step}"},
        {"save_on_train_epoch_end": True, "filename": "end-{epoch}-{step}"},
    ))  # fmt: skip
    assert [sum(1 for s in steps if s[0] == e) for e in range(3)] == [11, 15, 12]
    assert not said
    return work, steps


@pytest.fixture(scope="module")
def resumed(
    store: Path, fitted: tuple[Path, list[Step]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Step], list[str]]:
    """The fit resumed from the checkpoint on epoch 0's last batch (step 11), itself saving a
    checkpoint after every step and at every epoch's end: ``(their folder, its steps, the data
    module's warnings)``."""
    work = tmp_path_factory.mktemp("resumed")
    ckpt = fitted[0] / "epoch=0-step=11.ckpt"
    assert _resume_epoch(ckpt) == 1
    steps, said = _fit(store, work, start=1, ckpt=ckpt, checkpoints=(
        {"every_n_train_steps": 1, "filename": "{epoch}-{step}"},
        {"save_on_train_epoch_end": True, "filename": "end-{epoch}-{step}"},
    ))  # fmt: skip
    return work, steps, said


def test_a_checkpoint_saved_on_an_epochs_last_batch_resumes_a_longer_next_epoch_whole(
    fitted: tuple[Path, list[Step]], resumed: tuple[Path, list[Step], list[str]]
) -> None:
    """Saved on epoch 0's last batch (step 11), epoch 1 has 15 batches: all 15 are trained,
    Lightning told 15 and counting from ``batch_idx`` 0, then epoch 2 (before: 11 of epoch 1's
    15, told 11, and a warning that its last 4 batches would not be trained)."""
    _, got, said = resumed
    assert got == fitted[1][11:]
    assert not said, said


@pytest.mark.parametrize("name", ["end-epoch=1-step=26", "epoch=1-step=20"])
def test_the_checkpoints_of_a_fit_resumed_from_a_last_batch_resume_exactly(
    store: Path, tmp_path: Path, fitted: tuple[Path, list[Step]],
    resumed: tuple[Path, list[Step], list[str]], name: str,
) -> None:  # fmt: skip
    """Saved by the fit resumed from epoch 0's last batch: where epoch 1 ended and mid-epoch
    1, each resumes as the fit never stopped (before: Lightning had not counted epoch 1's
    start, so from the one at its end it counted epoch 2 as done and trained none of its 12
    batches, and from the mid-epoch one it restarted ``batch_idx`` at 0)."""
    ckpt = resumed[0] / f"{name}.ckpt"
    got, said = _fit(store, tmp_path, start=_resume_epoch(ckpt), ckpt=ckpt)
    assert got == fitted[1][_step_of(ckpt) :]
    assert not said, said


def test_a_checkpoint_saved_on_an_epochs_last_batch_tells_lightning_a_shorter_next_epochs_length(
    store: Path, tmp_path: Path, fitted: tuple[Path, list[Step]]
) -> None:
    """Saved on epoch 1's last batch (step 26), epoch 2 has 12 batches: Lightning is told 12
    (before: the 15 of epoch 1, the batches themselves right)."""
    work, want = fitted
    ckpt = work / "epoch=1-step=26.ckpt"
    got, said = _fit(store, tmp_path, start=_resume_epoch(ckpt), ckpt=ckpt)
    assert {s[4] for s in got} == {12}
    assert got == want[26:]
    assert not said, said


@pytest.mark.parametrize("name", ["epoch=0-step=1", "epoch=1-step=12", "end-epoch=0-step=11"])
def test_checkpoints_on_first_batches_and_at_an_epochs_end_resume_exactly(
    store: Path, tmp_path: Path, fitted: tuple[Path, list[Step]], name: str
) -> None:
    """The first batch of the fit and of epoch 1, and where epoch 0 ended
    (``on_train_epoch_end``): the steps after each are the uninterrupted fit's."""
    work, want = fitted
    ckpt = work / f"{name}.ckpt"
    got, said = _fit(store, tmp_path, start=_resume_epoch(ckpt), ckpt=ckpt)
    assert not said, said
    assert got == want[_step_of(ckpt) :]


def test_checkpoints_saved_where_a_mid_epoch_validation_ends_resume_exactly(
    store: Path, tmp_path: Path
) -> None:
    """``val_check_interval=0.5``: a checkpoint at each validation's end, mid-epoch (steps 5
    and 10 of epoch 0's 11, 7 and 14 of epoch 1's 15) and on the fit's last batch: resumed from
    the one before epoch 0's last batch, training and validation steps are the uninterrupted
    fit's."""
    options = {"limit_val_batches": 2, "val_check_interval": 0.5}
    want, _ = _fit(store, tmp_path / "ref", checkpoints=({"filename": "v-{epoch}-{step}"},),
                   **options)  # fmt: skip
    names = sorted(p.stem for p in (tmp_path / "ref").glob("*.ckpt"))
    assert names == [f"v-epoch={e}-step={s}" for e, s in
                     ((0, 10), (0, 5), (1, 18), (1, 25), (2, 32), (2, 38))], names  # fmt: skip
    for name in ("v-epoch=0-step=10",):
        ckpt = tmp_path / "ref" / f"{name}.ckpt"
        got, said = _fit(store, tmp_path / name, start=_resume_epoch(ckpt), ckpt=ckpt, **options)
        assert not said, said
        assert got == want[_index_after(want, _step_of(ckpt)) :], name


def test_a_fit_resumed_from_the_last_batch_limit_train_batches_allows_saves_exact_checkpoints(
    store: Path, tmp_path: Path
) -> None:
    """``limit_train_batches=5`` at a constant batch size: resumed from the checkpoint on epoch
    0's fifth (last trained) batch, the fit trains the uninterrupted one's steps, and so does a
    fit resumed from a checkpoint that one saved mid-epoch 1 (before: Lightning had not counted
    epoch 1's start, and from that checkpoint restarted ``batch_idx`` at 0 and trained 10 steps
    where 8 were left: batches the fit never stopped does not train)."""
    one = (7, 7, 7)
    limit = {"limit_train_batches": 5}
    every = ({"every_n_train_steps": 1, "filename": "{epoch}-{step}"},)
    want, _ = _fit(store, tmp_path / "ref", sizes=one, checkpoints=every, **limit)
    assert len(want) == 15
    first = tmp_path / "ref" / "epoch=0-step=5.ckpt"
    got, said = _fit(store, tmp_path / "a", start=_resume_epoch(first), ckpt=first, sizes=one,
                     checkpoints=every, **limit)  # fmt: skip
    assert got == want[5:] and not said, said
    second = tmp_path / "a" / "epoch=1-step=7.ckpt"
    got, said = _fit(store, tmp_path / "b", start=_resume_epoch(second), ckpt=second, sizes=one,
                     **limit)  # fmt: skip
    assert got == want[7:] and not said, said


def _index_after(steps: list[Step], step: int) -> int:
    """Where the steps after training step ``step`` (and its validation) begin."""
    trained = 0
    for i, s in enumerate(steps):
        if s[3] != -1:
            if trained == step:
                return i
            trained += 1
    return len(steps)
