"""A Trainer that stops itself mid-epoch (``trainer.should_stop``: ``max_time``, a callback, an
early stop on a mid-epoch validation) counts that epoch as done: its checkpoint resumes at the
start of the next epoch. The training loader must follow the trainer there, not finish the
interrupted epoch's permutation under the next epoch's number (which trained the tail of epoch
0 as "epoch 1", then epoch 2: epoch 1's permutation was never seen).

In process: a tiny LightningModule records, per step, the trainer's epoch, the batch's epoch
and index, and its sample indices; an uninterrupted run is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import zarr

from insitubatch_nodes import PlanConfig, open_geometries
from insitubatch_nodes.batch import Batch
from insitubatch_nodes.lightning import InSituDataModule

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lightning")]

EPOCHS = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 3, 5) in chunks of 4 samples, with its time axis named."""
    root = tmp_path_factory.mktemp("stop") / "s.zarr"
    group = zarr.open_group(root, mode="w")
    array = group.create_array(
        "t2m", shape=(96, 3, 5), chunks=(4, 3, 5), dtype="<f4",
        dimension_names=["time", "lat", "lon"],
    )  # fmt: skip
    array[:] = np.random.default_rng(0).standard_normal((96, 3, 5)).astype("<f4")
    return root


def item(batch: Batch) -> dict[str, Any]:
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["x"])),
        "rows": np.asarray(batch.sample_indices["x"]).tolist(),
        "at": (batch.epoch, batch.index),
    }


class Recorder(L.LightningModule):
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
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def fit(store: Path, root: Path, callbacks: list[Any], ckpt: Path | None = None) -> Recorder:
    g = open_geometries(str(store), ["t2m"])["t2m"]
    dm = InSituDataModule(
        str(store), {"x": g, "y": g.shift(1)}, (0.75, 0.25, 0.0),
        config=PlanConfig(batch_size=7, block_chunks=2, seed=3), transform=item,
        log_report=False,
    )  # fmt: skip
    model = Recorder()
    trainer = L.Trainer(
        max_epochs=EPOCHS, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", limit_val_batches=0,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("stop", [5, 15], ids=["epoch-0", "epoch-1"])
def test_a_run_the_trainer_stopped_mid_epoch_resumes_at_the_next_epoch_as_the_trainer_does(
    store: Path, tmp_path: Path, stop: int
) -> None:
    reference = fit(store, tmp_path / "ref", []).steps
    per_epoch = len(reference) // EPOCHS
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ck", save_last=True, save_on_train_epoch_end=True
    )
    first = fit(store, tmp_path / "a", [StopAt(stop), saver]).steps
    assert first == reference[:stop]
    resumed = fit(store, tmp_path / "b", [], ckpt=tmp_path / "ck" / "last.ckpt").steps
    # the trainer counted the stopped epoch as done: every later epoch is trained whole, with
    # the permutation of its own number, as in the uninterrupted run
    next_epoch = stop // per_epoch + 1
    assert resumed == reference[next_epoch * per_epoch :]
    assert all(trainer_epoch == at[0] for trainer_epoch, at, _ in first + resumed)
