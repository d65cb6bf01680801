"""A demanding user's trial of ``InSituDataModule`` under a real ``lightning.Trainer``
(docs/training.md), with zarr as the oracle of every row a step gets.

One store, ``t2m (60, 3, 4)`` in chunks of 4 steps, split ``(0.6, 0.2, 0.2)``: 35 training
anchors (``x = t2m[t]``, ``y = t2m[t + 1]``), 7 batches of 5 an epoch. A tiny LightningModule
checks each row of ``x`` and ``y`` against zarr's read and records, per step, the batch's epoch
and index and its sample indices; an uninterrupted run is the reference.

What the trial found wrong, each now checked here:

1. a run stopped by ``max_steps`` mid-epoch (Lightning counts that epoch as done, but resumes
   it at the next batch, under the next epoch's number) resumed with the next epoch's first
   batches instead of the rest of the interrupted one: batches skipped, and an epoch's tail
   never trained;
2. a DataModule reused by a new Trainer resuming a checkpoint (with ``configure_optimizers``
   reading ``estimated_stepping_batches``, Lightning issue #20550) restarted the epoch: the
   state went to the old Trainer's loader;
3. a ``PlanConfig`` of another split (``split="val"``) trained on that split: validation data
   in training, without a word;
4. ``eval_batch_size=0`` was taken as "training's batch size";
5. Lightning's batch-size finder (``Tuner.scale_batch_size``) set ``dm.batch_size`` between its
   trials, but every trial and the fit after it ran at the old batch size: the trainer was
   handed back the pipeline it had, built with the old one;
6. ``variables="t2m"`` (one name, as ``open_geometries`` and ``insitu_pipeline`` take it) was
   read as the names ``['t', '2', 'm']``; ``transform=None`` was accepted and failed at the
   first batch, and a single batch or chunk transform (not in a list) failed with "'function'
   object is not iterable";
7. ``Trainer(overfit_batches=2)`` trained on other samples every epoch (the permutation of each
   epoch's first batches): Lightning turns a DataLoader's shuffling off for it, to train on
   the same batches every epoch, and the DataModule's pipeline was left shuffled;
8. Lightning's learning-rate finder (``Tuner.lr_find``) failed with ``AttributeError:
   '_EpochLengthSync' object has no attribute 'lrs'``: the DataModule put its callbacks first
   in ``trainer.callbacks``, where the finder keeps its own;
9. ``str(dm)`` (Lightning's ``LightningDataModule.__str__``) built every split's pipeline, read
   a training batch, and failed with ``AttributeError: 'dict' object has no attribute
   'available'``; printed mid-training, it took the training pipeline over.

Found right (no test here): validation epochs (every sample once, in store order; the sanity
check, ``val_check_interval`` < 1 or in batches, ``check_val_every_n_epoch`` moving neither
split), ``limit_train_batches``, ``accumulate_grad_batches`` (also with ``max_steps``),
``reload_dataloaders_every_n_epochs``, a second ``fit`` on the same Trainer, validate / test /
predict (the test split, in store order), loader lengths equal to the batches delivered
(``remainder``, ``stride``, ``missing=``, ``sample_range``), ``seed_everything`` (does not
change the order; the config's seed does: documented), a stack normalised by fitted statistics,
resume from over 60 checkpoints (every few steps, on validation end, at epoch ends, ``last``;
with and without ``max_steps``), and a 2-rank gloo DDP fit (equal batch counts, disjoint
samples; validation left ``world_size - 1`` samples out under training's ``"drop"``: now
``"uneven"``, every sample once, tests/test_uneven.py and tests/test_ddp.py). Lightning's, not
fixed: with ``max_steps`` and ``limit_train_batches``, a checkpoint saved at an epoch's end
resumes with one batch past the limit (Lightning fetches it, ``num_training_batches`` not yet
set; the same before these changes), the later ones exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import zarr

from insitubatch_nodes import PlanConfig, open_geometries
from insitubatch_nodes.batch import Batch

if TYPE_CHECKING:
    from insitubatch_nodes.lightning import InSituDataModule

# Lightning is imported by the tests, not at collection (tests/lightning_parts.py says why).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lightning")]

PER_EPOCH = 7  # 35 training anchors in batches of 5


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t2m (60, 3, 4)`` in chunks of 4 steps, its time axis named."""
    root = tmp_path_factory.mktemp("lightning-trial") / "s.zarr"
    group = zarr.open_group(root, mode="w")
    array = group.create_array(
        "t2m", shape=(60, 3, 4), chunks=(4, 3, 4), dtype="<f4",
        dimension_names=["time", "lat", "lon"],
    )  # fmt: skip
    array[:] = np.random.default_rng(0).standard_normal((60, 3, 4)).astype("<f4")
    return root


@pytest.fixture(scope="module")
def oracle(store: Path) -> np.ndarray:
    return np.asarray(zarr.open_array(store / "t2m", mode="r")[...])


def item(batch: Batch) -> dict[str, Any]:
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["x"])),
        "y": torch.from_numpy(np.ascontiguousarray(batch.arrays["y"])),
        "rows": np.asarray(batch.sample_indices["x"]).tolist(),
        "at": (batch.epoch, batch.index),
    }


def data_module(store: Path, **options: Any) -> InSituDataModule:
    from insitubatch_nodes.lightning import InSituDataModule

    g = open_geometries(str(store), ["t2m"])["t2m"]
    config = options.pop("config", PlanConfig(batch_size=5, block_chunks=2, seed=3))
    return InSituDataModule(
        str(store), {"x": g, "y": g.shift(1)}, (0.6, 0.2, 0.2), config=config,
        transform=item, log_report=False, **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(
    store: Path, oracle: np.ndarray, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple]:
    """Three uninterrupted epochs."""
    from lightning_parts import Recorder, trainer

    model = Recorder(oracle)
    root = tmp_path_factory.mktemp("reference")
    trainer(root, max_steps=3 * PER_EPOCH).fit(model, datamodule=data_module(store))
    assert [at for at, _ in model.steps] == [(e, i) for e in range(3) for i in range(PER_EPOCH)]
    return model.steps


@pytest.mark.parametrize("stop", [10, PER_EPOCH * 2], ids=["mid-epoch", "at-an-epoch-end"])
def test_a_run_stopped_by_max_steps_resumes_with_the_next_batch_and_stays_exact(
    store: Path, oracle: np.ndarray, reference: list[tuple], tmp_path: Path, stop: int
) -> None:
    from lightning_parts import Recorder, SaveAt, trainer

    first = Recorder(oracle)
    stopped = trainer(tmp_path, max_steps=stop)
    stopped.fit(first, datamodule=data_module(store))
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    assert first.steps == reference[:stop]
    # resumed with more steps: the rest of the interrupted epoch, then the next epochs; a
    # checkpoint saved on the way (under Lightning's epoch number, one ahead) resumes exactly too
    more, saved = Recorder(oracle), stop + 3
    trainer(tmp_path, max_steps=19, callbacks=[SaveAt(saved, tmp_path / "more.ckpt")]).fit(
        more, datamodule=data_module(store), ckpt_path=tmp_path / "stop.ckpt"
    )
    assert more.steps == reference[stop:19]
    last = Recorder(oracle)
    trainer(tmp_path, max_steps=3 * PER_EPOCH).fit(
        last, datamodule=data_module(store), ckpt_path=tmp_path / "more.ckpt"
    )
    assert last.steps == reference[saved:]


def test_a_data_module_reused_by_a_new_trainer_resumes_its_checkpoint_exactly(
    store: Path, oracle: np.ndarray, reference: list[tuple], tmp_path: Path
) -> None:
    from lightning_parts import Recorder, SaveAt, trainer

    dm, first = data_module(store), Recorder(oracle, stepping_batches=True)
    trainer(tmp_path, max_steps=6, callbacks=[SaveAt(4, tmp_path / "4.ckpt")]).fit(
        first, datamodule=dm
    )
    assert first.steps == reference[:6]
    resumed = Recorder(oracle, stepping_batches=True)
    trainer(tmp_path, max_epochs=1).fit(resumed, datamodule=dm, ckpt_path=tmp_path / "4.ckpt")
    assert resumed.steps == reference[4:PER_EPOCH]


def test_a_config_of_another_split_is_refused_not_trained_on(store: Path) -> None:
    for split in ("val", "test"):
        with pytest.raises(ValueError, match=r"split='train'.*plan_config_for") as info:
            data_module(store, config=PlanConfig(batch_size=5, split=split))
        assert repr(split) in str(info.value)


def test_an_eval_batch_size_below_one_is_refused_naming_it(store: Path) -> None:
    for size in (0, -2):
        with pytest.raises(ValueError, match="eval_batch_size must be a positive integer"):
            data_module(store, eval_batch_size=size)
    with pytest.raises(TypeError, match="eval_batch_size"):
        data_module(store, eval_batch_size=2.5)


def test_one_name_is_one_variable_and_transforms_are_checked_where_the_module_is_made(
    store: Path, oracle: np.ndarray
) -> None:
    from insitubatch_nodes.lightning import InSituDataModule

    dm = InSituDataModule(
        str(store), "t2m", (0.6, 0.2, 0.2), config=PlanConfig(batch_size=5), transform=item_of_t2m,
    )  # fmt: skip
    try:
        batch = next(iter(dm.train_dataloader()))
        assert list(dm.views) == ["t2m"]
        np.testing.assert_array_equal(batch["x"].numpy(), oracle[batch["rows"]])
    finally:
        dm.teardown()
    for bad, message in [
        ({"transform": None}, "transform must be a callable Batch -> item, got None"),
        ({"batch_transforms": item}, "batch_transforms must be a sequence of callables"),
        ({"chunk_transforms": item}, "chunk_transforms must be a list of callables"),
        ({"chunk_transforms": [None]}, "chunk_transforms must be callables"),
    ]:
        with pytest.raises(TypeError, match=message):
            InSituDataModule(str(store), ["t2m"], **bad)


def item_of_t2m(batch: Batch) -> dict[str, Any]:
    return {"x": torch.from_numpy(batch.arrays["t2m"]), "rows": batch.sample_indices["t2m"]}


def test_overfit_batches_trains_on_the_same_batches_every_epoch(
    store: Path, oracle: np.ndarray, tmp_path: Path
) -> None:
    from lightning_parts import Recorder, trainer

    model = Recorder(oracle)
    with pytest.warns(UserWarning, match="overfit_batches.*unshuffled"):
        trainer(tmp_path, max_epochs=3, overfit_batches=2).fit(model, datamodule=data_module(store))
    rows = [r for _, r in model.steps]
    assert rows == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)] * 3


def test_the_learning_rate_finder_runs_and_the_fit_after_it_trains_the_reference_batches(
    store: Path, oracle: np.ndarray, reference: list[tuple], tmp_path: Path
) -> None:
    from lightning.pytorch.tuner import Tuner
    from lightning_parts import Recorder, trainer

    model, dm = Recorder(oracle), data_module(store)
    fitter = trainer(tmp_path, max_epochs=2)
    Tuner(fitter).lr_find(model, datamodule=dm, num_training=4, early_stop_threshold=None)
    assert len(model.steps) == 4
    model.steps.clear()
    fitter.fit(model, datamodule=dm)
    assert model.steps == reference[: 2 * PER_EPOCH]


def test_printing_a_data_module_reads_nothing_and_leaves_training_alone(
    store: Path, oracle: np.ndarray, reference: list[tuple], tmp_path: Path
) -> None:
    from lightning_parts import PrintEachStep, Recorder, trainer

    dm = data_module(store)
    text = str(dm)
    assert dm.store is None and not dm._loaders, "str() set the data module up"
    assert "InSituDataModule" in text and "not set up" in text, text
    model, printer = Recorder(oracle), PrintEachStep()
    trainer(tmp_path, max_steps=PER_EPOCH + 2, callbacks=[printer]).fit(model, datamodule=dm)
    assert model.steps == reference[: PER_EPOCH + 2]
    assert "train: 7 batches" in printer.printed[-1], printer.printed[-1]


def test_the_batch_size_finder_tries_each_size_and_the_fit_trains_at_the_one_found(
    store: Path, oracle: np.ndarray, tmp_path: Path
) -> None:
    from lightning.pytorch.tuner import Tuner
    from lightning_parts import Sizes, trainer

    dm, model = data_module(store), Sizes(oracle)
    fitter = trainer(tmp_path, max_epochs=1)
    found = Tuner(fitter).scale_batch_size(
        model, datamodule=dm, mode="power", init_val=2, max_trials=3, steps_per_trial=1
    )
    assert found == dm.batch_size == 8
    # Lightning runs its first trial on the loader it had (5) before it sets init_val
    assert model.sizes == [5, 4, 8]
    model.sizes.clear()
    model.steps.clear()
    fitter.fit(model, datamodule=dm)
    assert model.sizes == [8, 8, 8, 8, 3]
    assert sorted(i for _, rows in model.steps for i in rows) == list(range(35))
