"""A Trainer that stops itself mid-epoch (``trainer.should_stop``: ``max_time``, a callback, an
early stop on a mid-epoch validation) counts that epoch as done: its checkpoint resumes at the
start of the next epoch. The training loader must follow the trainer there, not finish the
interrupted epoch's permutation under the next epoch's number (which trained the tail of epoch
0 as "epoch 1", then epoch 2: epoch 1's permutation was never seen).

A checkpoint whose loader state the data module refuses (another batch size, mid-epoch) says
what a data module's user can do about it, and that works (it advised ``set_epoch``, which such
a user never calls).

In process: a tiny LightningModule records, per step, the trainer's epoch, the batch's epoch
and index, and its sample indices; an uninterrupted run is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from insitubatch_nodes import PlanConfig, open_geometries
from insitubatch_nodes.batch import Batch
from tests.helpers import write_t2m_96

if TYPE_CHECKING:
    from lightning_parts import StepRecorder

# Lightning is imported by the tests, not at collection (tests/lightning_parts.py says why).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lightning")]

EPOCHS = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 3, 5) in chunks of 4 samples, with its time axis named."""
    return write_t2m_96(tmp_path_factory.mktemp("stop") / "s.zarr")


def item(batch: Batch) -> dict[str, Any]:
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["x"])),
        "rows": np.asarray(batch.sample_indices["x"]).tolist(),
        "at": (batch.epoch, batch.index),
    }


def fit(
    store: Path,
    root: Path,
    callbacks: list[Any],
    ckpt: Path | None = None,
    batch_size: int = 7,
    epochs: int = EPOCHS,
) -> StepRecorder:
    import lightning as L
    from lightning_parts import StepRecorder

    from insitubatch_nodes.lightning import InSituDataModule

    g = open_geometries(str(store), ["t2m"])["t2m"]
    dm = InSituDataModule(
        str(store), {"x": g, "y": g.shift(1)}, (0.75, 0.25, 0.0),
        config=PlanConfig(batch_size=batch_size, block_chunks=2, seed=3), transform=item,
        log_report=False,
    )  # fmt: skip
    model = StepRecorder()
    trainer = L.Trainer(
        max_epochs=epochs, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", limit_val_batches=0,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("stop", [5, 15], ids=["epoch-0", "epoch-1"])
def test_a_run_the_trainer_stopped_mid_epoch_resumes_at_the_next_epoch_as_the_trainer_does(
    store: Path, tmp_path: Path, stop: int
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_parts import StopAt

    reference = fit(store, tmp_path / "ref", []).steps
    per_epoch = len(reference) // EPOCHS
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_on_train_epoch_end=True)
    first = fit(store, tmp_path / "a", [StopAt(stop), saver]).steps
    assert first == reference[:stop]
    resumed = fit(store, tmp_path / "b", [], ckpt=tmp_path / "ck" / "last.ckpt").steps
    # the trainer counted the stopped epoch as done: every later epoch is trained whole, with
    # the permutation of its own number, as in the uninterrupted run
    next_epoch = stop // per_epoch + 1
    assert resumed == reference[next_epoch * per_epoch :]
    assert all(trainer_epoch == at[0] for trainer_epoch, at, _ in first + resumed)


def test_a_mid_epoch_checkpoint_of_another_batch_size_says_how_a_data_module_goes_on_and_that_works(
    store: Path, tmp_path: Path
) -> None:
    from lightning_parts import SaveAt

    from insitubatch_nodes.errors import StateMismatchError

    ckpt = tmp_path / "mid.ckpt"
    fit(store, tmp_path / "a", [SaveAt(5, ckpt)], epochs=1)
    with pytest.raises(StateMismatchError) as refused:
        fit(store, tmp_path / "b", [], ckpt=ckpt, batch_size=8, epochs=2)
    said = str(refused.value)
    assert "set_epoch" not in said, said  # (a data module's user does not call it)
    assert "with batch_size=7" in said and "epoch (0)" in said, said
    # what it says to do, done as said
    edit = (
        "del ckpt['InSituDataModule']; "
        "del ckpt['loops']['fit_loop']['state_dict']['combined_loader']"
    )
    assert edit in said, said
    checkpoint = torch.load(ckpt, weights_only=False)
    exec(edit, {"ckpt": checkpoint})
    torch.save(checkpoint, tmp_path / "new.ckpt")
    steps = fit(store, tmp_path / "c", [], ckpt=tmp_path / "new.ckpt", batch_size=8, epochs=2).steps
    # the rest of epoch 0 and then epoch 1 whole, each batch under the trainer's epoch
    assert steps and all(trainer_epoch == at[0] for trainer_epoch, at, _ in steps)
    assert [at for _, at, _ in steps if at[0] == 1] == [(1, i) for i in range(9)]
