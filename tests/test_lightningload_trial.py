"""A Lightning user's trial of how ``InSituDataModule`` loads a checkpoint's state, and of
recipes/forecast_rollout.py's rollout schedule across a resume (docs/training.md).

One tiny store (``t2m`` 96 x 3 x 5 in chunks of 4 steps, tests/helpers.write_t2m_96), split
``(0.75, 0.25, 0)``: 71 training anchors, 3 batches of 24 an epoch; 23 validation anchors. A
LightningModule with one weight (SGD, so its weight is a function of the batches and their
order) records per step the trainer's epoch, Lightning's ``batch_idx`` and the batch's epoch,
index and sample indices. The oracle is the fit never stopped: its steps and its weight.

Found (each fixed, each test failed before):

1. ``dm.load_state_dict`` read the trainer's epoch and batch counts before Lightning restored
   them from the checkpoint. Lightning loads the data module's state, then runs
   ``configure_optimizers`` (which, reading ``trainer.estimated_stepping_batches``, has it
   build the training loader: Lightning issue #20550), and only then restores its loops.
   a) A second ``trainer.fit(..., ckpt_path=mid-epoch checkpoint)`` on the trainer of a first
      fit (same data module): the state went straight into the loader the trainer held, and
      the loader's length, asked at that early build, compared it with the epoch the first fit
      had ended in (3): taken as overtaken, the state was dropped, and the resumed epoch 1
      trained its batches 0 and 1 where 1 and 2 were left (one repeated, one skipped).
   b) A new trainer: a checkpoint on the last batch ``limit_train_batches=2`` lets an epoch
      train, resumed into the next epoch's batch size (a curriculum 24 -> 18 -> 20), was
      refused (``StateMismatchError``: "its batch_size differs (saved 24, this pipeline 18)"):
      the module asked whether the trainer had trained that last batch with the counts of a
      trainer not yet restored (none).
   Now the module keeps a state loaded while Lightning restores (``lightning_epochs.
   restoring_loops``) and applies it to a loader built after the restore: a loader built
   before it (by ``estimated_stepping_batches``, or held from a first fit) is built again
   once the counts are the checkpoint's (``rebuild_training_loader``, as Lightning's
   batch-size finder has it; ``EpochLengthSync.on_fit_start``).
2. recipes/forecast_rollout.py keyed its rollout on ``trainer.current_epoch``, and
   ``resume_epoch`` read Lightning's epoch count. A budgeted run (``max_steps``) stopped
   mid-epoch and resumed with ``max_steps`` goes on with the stopped epoch under Lightning's
   next epoch number: the resumed run was built with the next epoch's rollout and refused the
   checkpoint (``StateMismatchError``: "its dataset's views differ, and it was saved
   mid-epoch"); keyed on ``trainer.current_epoch``, each later epoch trained on the rollout of
   the epoch after it. Now the curriculum keys on ``dm.train_epoch`` and ``resume_epoch``
   subtracts the epochs the data runs behind (the module's saved ``"epoch_offset"``, and the
   stopped epoch Lightning resumes under ``max_steps``); the recipe takes ``--max-steps``.

Tried and found right (no test, or the test below): a mid-epoch checkpoint resumed under
another ``limit_train_batches`` (none -> 2, 2 -> none, 2 -> 1, 1 -> 3, 0.5 -> none, none -> 1,
every step of the first run) with validation every 2 steps (``val_check_interval=2,
check_val_every_n_epoch=None``): no sample trained twice in an epoch, every validation run
reads the 23 validation samples once each. Where the checkpoint's batch count reaches the new
limit Lightning restarts that epoch at ``batch_idx`` 0 and trains the rest of it from the
loader, past the new limit (none -> 2 from batch 2: the epoch's third batch): a
``StatefulDataLoader`` of the same batches does the same, so it is Lightning's, not fixed.
The checkpoints ``ModelCheckpoint`` saves at each of those validations' end (steps 2 to 8),
resumed under the same limit (none, 2) with ``estimated_stepping_batches`` read: the steps and
the weight of the fit never stopped; under another limit: no sample twice in an epoch, each
validation run whole. A second ``fit`` on the same trainer from a mid-epoch checkpoint
without ``estimated_stepping_batches`` was already exact. The recipe itself (``--max-steps
2``, then ``--resume --max-steps 8``) prints the validation losses of a run never stopped.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from insitubatch_nodes import PlanConfig, open_geometries
from insitubatch_nodes.batch import Batch
from tests.helpers import write_t2m_96

# Lightning is imported by the tests, not at collection (tests/lightning_parts.py says why).
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("lightning")]

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "forecast_rollout.py"
SIZES = (24, 18, 20)  # a curriculum: the batch size of each epoch


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_t2m_96(tmp_path_factory.mktemp("lightningload") / "s.zarr")


def _item(batch: Batch) -> dict[str, Any]:
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["x"])),
        "at": (batch.epoch, batch.index),
        "rows": tuple(np.asarray(batch.sample_indices["x"]).tolist()),
    }


def _model(stepping_batches: bool = False) -> Any:
    """One weight; records ``(trainer epoch, batch_idx, (epoch, index), rows)`` per step and
    ``(global step, rows)`` per validation step; ``stepping_batches``: its
    ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (issue #20550)."""
    import lightning as L

    class Model(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.steps: list[tuple[Any, ...]] = []
            self.validated: list[tuple[int, tuple[int, ...]]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps.append((self.current_epoch, batch_idx, tuple(batch["at"]), batch["rows"]))
            return ((self.w * batch["x"].float().mean() - 1.0) ** 2).sum()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.validated.append((self.global_step, batch["rows"]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if stepping_batches:
                assert self.trainer.estimated_stepping_batches > 0
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def _dm(store: Path, batch_size: int = SIZES[0]) -> Any:
    from insitubatch_nodes.lightning import InSituDataModule

    g = open_geometries(str(store), ["t2m"])["t2m"]
    return InSituDataModule(
        str(store), {"x": g, "y": g.shift(1)}, (0.75, 0.25, 0.0), transform=_item,
        config=PlanConfig(batch_size=batch_size, block_chunks=2, seed=3), log_report=False,
    )  # fmt: skip


def _trainer(root: Path, **options: Any) -> Any:
    """``lightning_parts.trainer`` without the sanity validation (every call here sets
    ``max_epochs`` or ``max_steps``)."""
    from lightning_parts import trainer

    return trainer(root, **{"num_sanity_val_steps": 0, **options})


def _fit(trainer: Any, model: Any, data: Any, ckpt: Path | None = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return model


def _save_at(step: int, path: Path) -> Any:
    import lightning as L

    class SaveAt(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step:
                trainer.save_checkpoint(path)

    return SaveAt()


# -- 1. the state loaded before Lightning restores its counts ---------------------------------


def test_a_second_fit_of_a_trainer_resumed_mid_epoch_trains_the_batches_left_with_stepping_batches(
    store: Path, tmp_path: Path
) -> None:
    """The trainer and data module of a fit never stopped (3 epochs, a checkpoint at step 4:
    mid-epoch 1) fit again from that checkpoint, ``configure_optimizers`` reading
    ``estimated_stepping_batches``: the steps and the weight are the first fit's from step 4
    (before: epoch 1's batches 0 and 1, where 1 and 2 were left)."""
    data = _dm(store)
    trainer = _trainer(tmp_path, max_epochs=3, callbacks=[_save_at(4, tmp_path / "4.ckpt")])
    whole = _fit(trainer, _model(stepping_batches=True), data)
    assert [s[2] for s in whole.steps] == [(e, i) for e in range(3) for i in range(3)]
    again = _fit(trainer, _model(stepping_batches=True), data, tmp_path / "4.ckpt")
    assert again.steps == whole.steps[4:]
    assert torch.equal(again.w, whole.w)


def test_a_new_trainer_with_stepping_batches_resumes_a_limited_epochs_last_batch_at_the_next_size(
    store: Path, tmp_path: Path
) -> None:
    """``limit_train_batches=2``, batch sizes 24 -> 18 -> 20 from ``on_train_epoch_end``,
    ``configure_optimizers`` reading ``estimated_stepping_batches``: the checkpoint on epoch
    0's last trained batch, resumed by a new trainer into a module of epoch 1's batch size,
    trains the uninterrupted fit's steps, the weight bit for bit (before:
    ``StateMismatchError``, "its batch_size differs (saved 24, this pipeline 18)")."""
    import lightning as L

    class Curriculum(L.Callback):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            trainer.datamodule.batch_size = SIZES[min(trainer.datamodule.train_epoch + 1, 2)]

    limited: dict[str, Any] = {"max_epochs": 3, "limit_train_batches": 2}
    saver = _save_at(2, tmp_path / "2.ckpt")
    whole = _fit(
        _trainer(tmp_path, callbacks=[Curriculum(), saver], **limited),
        _model(stepping_batches=True), _dm(store),
    )  # fmt: skip
    assert [len(s[3]) for s in whole.steps] == [24, 24, 18, 18, 20, 20]
    got = _fit(
        _trainer(tmp_path, callbacks=[Curriculum()], **limited), _model(stepping_batches=True),
        _dm(store, SIZES[1]), tmp_path / "2.ckpt",
    )  # fmt: skip
    assert got.steps == whole.steps[2:]
    assert torch.equal(got.w, whole.w)


# -- 2. recipes/forecast_rollout.py: the rollout schedule across a resume ---------------------


def _recipe(path: Path = RECIPE) -> ModuleType:
    spec = importlib.util.spec_from_file_location("recipe_forecast_rollout_load", path)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.fixture(scope="module")
def hourly(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An hourly ARCO-like store of 5 days, 2 x 4 grid: 2 batches of 4 anchors (every 6 h) an
    epoch with the recipe's split."""
    from insitubatch_nodes.synthetic import make_weatherbench_like

    path = tmp_path_factory.mktemp("rollout") / "arco.zarr"
    make_weatherbench_like(
        path, n_time=24 * 5, n_lat=2, n_lon=4, n_level=2, surface=1, levels=1,
        hours_per_step=1, samples_per_chunk=1,
    )  # fmt: skip
    return path


def test_the_rollout_recipes_schedule_follows_the_datas_epoch_across_a_max_steps_resume(
    hourly: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe's data module, views and ``RolloutCurriculum`` (1, 2, then 3 target steps
    from epochs 0, 1, 2), a run stopped by ``max_steps=2`` mid-epoch 0 and resumed with
    ``max_steps`` (its views from ``resume_epoch``), and a checkpoint of that run (step 7,
    mid-epoch 1, Lightning's epoch 2) resumed again: every step's inputs and target steps are
    the run never stopped's. (Before: the first resume was refused, its views the next
    epoch's; keyed on ``trainer.current_epoch``, epoch 1 trained on 3 target steps.)"""
    import hashlib

    import lightning as L

    from insitubatch_nodes.lightning import InSituDataModule

    recipe, schedule = _recipe(), [(0, 1), (1, 2), (2, 3)]

    class Rollouts(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.steps: list[tuple[int, str]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = recipe.channels(batch, "x"), recipe.channels(batch, "y")
            self.steps.append((y.shape[1], hashlib.md5(x.numpy().tobytes()).hexdigest()))
            return (self.w * x.mean()).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(steps: int, ckpt: Path | None = None, save: int = 0) -> tuple[Any, Any]:
        """As recipe.run builds a run: the training views of the epoch it resumes in."""
        start = 0 if ckpt is None else recipe.resume_epoch(ckpt, max_steps=True)
        geoms: dict[str, Any] = {}

        def views(found: dict[str, Any]) -> dict[str, Any]:
            geoms.update(found)
            return recipe.forecast_views(found, 3)

        config = PlanConfig(batch_size=4, block_chunks=24, stride="6h")
        dm = InSituDataModule(str(hourly), views, (0.8, 0.2, 0.0), config=config, log_report=False)
        dm.setup()
        dm.set_views(recipe.forecast_views(geoms, recipe.steps_at(schedule, start)))
        callbacks = [recipe.RolloutCurriculum(geoms, schedule)]
        callbacks += [_save_at(save, tmp_path / f"{save}.ckpt")] if save else []
        trainer = _trainer(tmp_path, max_steps=steps, callbacks=callbacks)
        return trainer, _fit(trainer, Rollouts(), dm, ckpt)

    _, whole = fit(12)
    assert [r for r, _ in whole.steps] == [1] * 4 + [2] * 4 + [3] * 4
    stopped, first = fit(2)
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    _, rest = fit(12, tmp_path / "stop.ckpt", save=7)
    assert first.steps + rest.steps == whole.steps
    _, again = fit(12, tmp_path / "7.ckpt")
    assert again.steps == whole.steps[7:]
    capsys.readouterr()  # (the curriculum's prints)


# -- 3. another limit_train_batches on resume, validation every 2 steps -----------------------


def test_a_mid_epoch_checkpoint_resumed_under_another_limit_trains_no_sample_twice_validates_all(
    store: Path, tmp_path: Path
) -> None:
    """Checkpoint at step 1 of a fit without a limit, resumed with ``limit_train_batches=2``
    and validation every 2 steps: epoch 0 goes on at its batch 1, every epoch trains 2
    batches of 24 distinct samples, and each validation run (steps 2, 4, 6) reads the 23
    validation samples once each."""
    every_2 = {"limit_val_batches": None, "val_check_interval": 2, "check_val_every_n_epoch": None}
    saver = _save_at(1, tmp_path / "1.ckpt")
    first = _fit(
        _trainer(tmp_path, max_steps=1, callbacks=[saver], **every_2), _model(), _dm(store)
    )
    rest = _fit(
        _trainer(tmp_path, max_epochs=3, limit_train_batches=2, **every_2), _model(),
        _dm(store), tmp_path / "1.ckpt",
    )  # fmt: skip
    steps = first.steps + rest.steps
    assert [s[2] for s in steps] == [(e, i) for e in range(3) for i in range(2)]
    for epoch in range(3):
        rows = [r for s in steps if s[2][0] == epoch for r in s[3]]
        assert len(rows) == len(set(rows)) == 48, epoch
    runs: dict[int, list[int]] = {}
    for step, rows in rest.validated:
        runs.setdefault(step, []).extend(rows)
    assert sorted(runs) == [2, 4, 6]
    assert all(sorted(rows) == list(range(72, 95)) for rows in runs.values()), runs
