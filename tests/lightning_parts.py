"""The Lightning modules and callbacks of tests/test_lightning_stop.py and
tests/test_lightning_trial.py, in a module of their own so that those tests import Lightning
when they run, not when they are collected.

Every xdist worker collects every test module, and one worker runs the ``lightning`` group:
importing Lightning (about 3 to 5 CPU-s) at the top of those two modules made each worker pay
it for tests it never runs. Their tests import from here, inside the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# tests/test_lightning_stop.py
# ---------------------------------------------------------------------------------------------


class StepRecorder(L.LightningModule):
    """Records ``(trainer epoch, (batch epoch, index), rows)`` per training step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.steps: list[tuple[int, tuple[int, int], list[int]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.steps.append((self.current_epoch, batch["at"], batch["rows"]))
        return self.layer(batch["x"].mean().reshape(1, 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class StopAt(L.Callback):
    """``trainer.should_stop`` at the end of training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


# ---------------------------------------------------------------------------------------------
# tests/test_lightning_trial.py
# ---------------------------------------------------------------------------------------------


class Recorder(L.LightningModule):
    """Checks every row against zarr and records ``((epoch, index), rows)`` per training step."""

    def __init__(self, oracle: np.ndarray, stepping_batches: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.oracle = oracle
        self.stepping_batches = stepping_batches
        self.lr = 0.0  # (what the learning-rate finder sets)
        self.steps: list[tuple[tuple[int, int], tuple[int, ...]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        for r, i in enumerate(batch["rows"]):
            np.testing.assert_array_equal(batch["x"][r].numpy(), self.oracle[i])
            np.testing.assert_array_equal(batch["y"][r].numpy(), self.oracle[i + 1])
        self.steps.append((tuple(batch["at"]), tuple(batch["rows"])))
        return self.layer(batch["x"].mean().reshape(1, 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.stepping_batches:  # Lightning issue #20550
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Sizes(Recorder):
    """A :class:`Recorder` that also records each training batch's size."""

    def __init__(self, oracle: np.ndarray) -> None:
        super().__init__(oracle)
        self.sizes: list[int] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.sizes.append(len(batch["rows"]))
        return super().training_step(batch, batch_idx)


def trainer(root: Path, **options: Any) -> L.Trainer:
    """A quiet CPU Trainer with no validation nor checkpointing unless ``options`` say so."""
    settings: dict[str, Any] = {
        "max_epochs": -1, "default_root_dir": root, "logger": False,
        "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu",
        "limit_val_batches": 0, "enable_checkpointing": False, **options,
    }  # fmt: skip
    return L.Trainer(**settings)


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` at the end of training step ``step``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class PrintEachStep(L.Callback):
    """Records ``str(trainer.datamodule)`` at the end of each training step."""

    def __init__(self) -> None:
        self.printed: list[str] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.printed.append(str(trainer.datamodule))
