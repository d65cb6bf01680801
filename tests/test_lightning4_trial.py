"""A demanding Lightning user's trial of ``InSituDataModule`` (docs/training.md): resumes after
``max_steps`` and ``limit_train_batches`` stops, a curriculum of batch sizes, and what each
Trainer call's ``teardown`` closes.

One tiny store (``t2m`` 96 x 3 x 5 in chunks of 4 steps, tests/helpers.write_t2m_96), training
split 0.75: 71 anchors, 3 batches of 24 an epoch. A LightningModule (one weight, SGD with a
learning rate, so its weights are a function of the batches and their order) records per step
the trainer's epoch, Lightning's ``batch_idx`` and the batch's epoch, index and sample indices.
The oracle is the fit never stopped: its steps, and its weights bit for bit.

Found:

1. (Lightning's own, documented with verified workarounds, not fixed) A run stopped by
   ``max_steps`` on an epoch's last batch, saved by ``trainer.save_checkpoint`` after ``fit``
   (or by a checkpoint at ``on_train_epoch_end``) and resumed by a fit that sets ``max_steps``
   again, trains one epoch less than ``max_epochs`` says: with ``max_steps`` set Lightning
   restarts the finished epoch (``FitLoop.restarting`` is forced by
   ``_iteration_based_training``), finds its batch count already at the epoch's length and
   counts that epoch as done. A plain ``DataLoader`` loses the epoch the same way, training
   one stray batch there, its first (Lightning issue #19617, open). The data module keeps
   the data order (the stopped epoch's successor is trained under the next epoch number, and
   the loader delivers nothing in the restarted epoch), so with ``max_steps`` alone the
   resumed run is the uninterrupted one's batch for batch; with ``max_epochs`` too, it ends an
   epoch early. Workarounds (both exact here, weights bit for bit): resume without
   ``max_steps`` (``max_epochs`` bounds the run), or resume from the checkpoint
   ``ModelCheckpoint(every_n_train_steps=...)`` saved on that last batch.
2. (fixed) ``limit_train_batches`` with a batch size that changes between epochs: a checkpoint
   saved on the last batch the limit lets an epoch train holds a mid-epoch loader state at
   that epoch's batch size; resumed into a data module of the next epoch's batch size it was
   refused (``StateMismatchError``: "its batch_size differs (saved 24, this pipeline 18)"),
   though Lightning counts that epoch as over and starts the next one whole. Now the data
   module tells the training dataset where Lightning restarts after an epoch's last trained
   batch (``lightning_epochs.trained_its_last_batch``), and the dataset takes a mid-epoch
   state (also one it would refuse only for being mid-epoch) as where its epoch ended
   (``InSituIterableDataset.end_loaded_epoch``): the next epoch starts whole, exactly. The
   same for checkpoints saved where such an epoch ended, and for views that change between
   epochs (``set_views``: "its dataset's views differ, and it was saved mid-epoch"). Where
   the next epoch's limit lets it train more batches than the cut one (``limit_train_batches
   =0.5``: 1, then 2), Lightning took the cut epoch's count for the next epoch's first
   batches (trained 1 of 2) until the data module had it count the cut epoch as over up to
   the length the loader tells (``finish_ended_epoch`` with the next epoch's length). And
   a ``max_steps`` stop on such a batch, resumed with ``max_steps`` (Lightning's empty
   restart of finding 1, which fetches one batch): the loader delivered the cut epoch's next
   batch, which the limit never lets train, and Lightning trained it (on main), or with a
   curriculum the next epoch's first, trained twice; such a state now behaves as one taken
   where its epoch ends (nothing more of that epoch is delivered).
3. (fixed) ``teardown(stage)`` closed every loader, whatever the stage: a validate, test or
   predict teardown amid a fit (``dm.teardown("validate")`` from a callback) closed the
   training pipeline, whose pool was cleared, so its epoch read 23 chunks where 12 were
   needed. Now each stage closes the loaders that Trainer call read
   (``lightning_splits.read_by``: fit: train and val; validate: val; test and predict: test);
   ``None`` closes every loader, as before.
4. (fixed; on main too) ``val_check_interval=0.5`` with a batch size that changes: the
   checkpoint ``ModelCheckpoint()`` saves at the validation after an epoch's last batch,
   which Lightning resumes by running that epoch's end hooks again, resumed into a longer
   next epoch (3 -> 4 batches): Lightning was told 3 for it and trained 3 of its 4. Where the
   hooks asked whether the next epoch differs, the data module compared the ended epoch's
   length (what its loaded state reports while the trainer is in that epoch) with the length
   told, not the next epoch's; it now compares the next one's (``ended_epoch_lens``).
5. (added) A curriculum keyed on ``trainer.current_epoch`` gives each epoch after a
   ``max_steps`` resume the next one's batch size (the data runs an epoch behind Lightning's
   number there, by design); ``dm.train_epoch`` now says the data's epoch, and a curriculum
   keyed on it resumes exactly (documented).

Tried and found right (probes not kept, all of 9 to 18 checkpoints each resumed, the training
steps and weights equal to the fit never stopped): ``limit_train_batches=2`` at a constant
batch size and with the curriculum, with checkpoints on every step, at each epoch's end and at
each validation's end; ``val_check_interval=0.5`` at a constant batch size and with the
curriculum; ``accumulate_grad_batches=2`` with the curriculum (every optimizer step's
checkpoint and the epoch ends), also with ``limit_train_batches=3``;
``reload_dataloaders_every_n_epochs=1`` with the curriculum, also with ``limit_train_batches=2``;
``limit_train_batches=0.5`` with the curriculum; ``val_check_interval=2`` with
``check_val_every_n_epoch=None`` and the curriculum; views that change (``set_views``) with and
without ``limit_train_batches``; runs stopped by ``max_steps`` at every step of 24 (3-4 batches
an epoch, constant and curriculum batch sizes, with and without ``limit_train_batches=2``),
saved after ``fit`` and resumed with ``max_steps`` (the curriculum keyed on ``dm.train_epoch``).
Not ours, seen there: with the curriculum, validation batches at training's batch size of
when Lightning loads the validation loader (once per fit), so a resumed fit validates the same
samples in other batches (``eval_batch_size`` set: the same batches; documented); and a
checkpoint saved on a batch's end precedes the validation that follows that batch, which the
resumed fit does not run (a plain ``DataLoader`` too).
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

BATCH = 24  # 3 batches an epoch
EPOCHS = 3
Step = tuple[int, int, tuple[int, int], tuple[int, ...]]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_t2m_96(tmp_path_factory.mktemp("lightning4") / "s.zarr")


def _item(batch: Batch) -> dict[str, Any]:
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["x"])),
        "at": (batch.epoch, batch.index),
        "rows": tuple(np.asarray(batch.sample_indices["x"]).tolist()),
    }


def _model() -> Any:
    import lightning as L

    class Model(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.steps: list[Step] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if isinstance(batch, dict):
                x, at, rows = batch["x"], batch["at"], batch["rows"]
            else:  # a plain DataLoader's (x,)
                x, at, rows = batch[0], (-1, -1), tuple(batch[0][:, 0].long().tolist())
            self.steps.append((self.current_epoch, batch_idx, tuple(at), tuple(rows)))
            return ((self.w * x.float().mean() - 1.0) ** 2).sum()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("v", batch["x"].float().mean())

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("t", batch["x"].float().mean())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def _dm(store: Path, batch_size: int = BATCH) -> Any:
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


def _fit(root: Path, data: Any, ckpt: Path | None = None, **options: Any) -> tuple[Any, Any]:
    """``(trainer, model)`` after ``trainer.fit`` (resumed from ``ckpt``), warnings quiet."""
    model, trainer = _model(), _trainer(root, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return trainer, model


def _per_epoch(steps: list[Step]) -> list[int]:
    return [sum(1 for s in steps if s[0] == e) for e in range(EPOCHS + 1)]


@pytest.fixture(scope="module")
def reference(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The fit never stopped: ``max_epochs=3``, 3 batches each."""
    _, model = _fit(tmp_path_factory.mktemp("reference"), _dm(store), max_epochs=EPOCHS)
    assert _per_epoch(model.steps) == [3, 3, 3, 0]
    return model


# -- 1. max_steps stopped on an epoch's last batch, resumed under max_epochs ------------------


def test_lightning_itself_trains_an_epoch_less_after_a_max_steps_stop_on_an_epochs_last_batch(
    tmp_path: Path,
) -> None:
    """With a plain ``DataLoader``: stopped by ``max_steps=3`` on epoch 0's last batch, saved
    after ``fit``, resumed with ``max_steps=9, max_epochs=3``: Lightning restarts the finished
    epoch 0 under the number 1, trains one stray batch there (the loader's first, at
    ``batch_idx`` 3), counts that epoch as done, then epoch 2: 4 steps where 6 were left."""
    import lightning as L

    class Plain(L.LightningDataModule):  # type: ignore[misc]
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            rows = torch.arange(9.0).reshape(9, 1)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=3)

    stopped, first = _fit(tmp_path, Plain(), max_steps=3)
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    _, resumed = _fit(tmp_path, Plain(), tmp_path / "stop.ckpt", max_steps=9, max_epochs=EPOCHS)
    assert _per_epoch(first.steps) == [3, 0, 0, 0]
    assert [s[:2] for s in resumed.steps] == [(1, 3), (2, 0), (2, 1), (2, 2)]  # Lightning's


def test_the_data_module_keeps_the_data_order_where_lightning_spends_an_epoch_number(
    store: Path, tmp_path: Path, reference: Any
) -> None:
    """The same stop with the data module: resumed with ``max_steps`` alone, the batches are
    the uninterrupted run's, each trained one trainer epoch later; with ``max_epochs=3`` too,
    Lightning ends the run an epoch early (its own, as with the plain loader above)."""
    stopped, first = _fit(tmp_path, _dm(store), max_steps=3)
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    assert first.steps == reference.steps[:3]
    _, steps_only = _fit(tmp_path, _dm(store), tmp_path / "stop.ckpt", max_steps=9)
    assert [s[1:] for s in steps_only.steps] == [s[1:] for s in reference.steps[3:]]
    assert [s[0] for s in steps_only.steps] == [s[0] + 1 for s in reference.steps[3:]]
    assert torch.equal(steps_only.w, reference.w)
    _, both = _fit(tmp_path, _dm(store), tmp_path / "stop.ckpt", max_steps=9, max_epochs=EPOCHS)
    assert [s[1:] for s in both.steps] == [s[1:] for s in reference.steps[3:6]]


@pytest.mark.parametrize("how", ["without-max-steps", "model-checkpoint"])
def test_a_max_steps_stop_on_an_epochs_last_batch_resumes_exactly_by_the_documented_workarounds(
    store: Path, tmp_path: Path, reference: Any, how: str
) -> None:
    """docs/training.md's workarounds: resume with ``max_epochs`` alone (no ``max_steps``), or
    from the checkpoint ``ModelCheckpoint(every_n_train_steps=...)`` saved on that batch (with
    ``max_steps`` and ``max_epochs``): every epoch's batches as the fit never stopped, the
    weights bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for stop in (3, 6):  # the last batches of epochs 0 and 1
        work = tmp_path / str(stop)
        saver = ModelCheckpoint(
            dirpath=work, every_n_train_steps=1, save_top_k=-1, filename="{step}"
        )
        stopped, first = _fit(
            work, _dm(store), max_steps=stop, callbacks=[saver], enable_checkpointing=True
        )
        if how == "without-max-steps":
            stopped.save_checkpoint(work / "stop.ckpt")
            ckpt, more = work / "stop.ckpt", {"max_epochs": EPOCHS}
        else:
            ckpt, more = work / f"step={stop}.ckpt", {"max_steps": 9, "max_epochs": EPOCHS}
        _, resumed = _fit(work, _dm(store), ckpt, **more)
        assert first.steps + resumed.steps == reference.steps, stop
        assert torch.equal(resumed.w, reference.w), stop


def test_a_curriculum_keyed_on_the_data_modules_train_epoch_survives_a_max_steps_resume(
    store: Path, tmp_path: Path
) -> None:
    """Batch sizes 24 -> 18 -> 20 set from ``on_train_epoch_end`` for the epoch after
    ``dm.train_epoch``; stopped by ``max_steps`` mid-epoch 0 and resumed with ``max_steps``
    (Lightning goes on under epoch number 1): the batches and weights are the uninterrupted
    run's. Keyed on ``trainer.current_epoch`` instead, epoch 1's batches come at epoch 2's
    batch size."""
    import lightning as L

    sizes = (24, 18, 20)

    class Curriculum(L.Callback):  # type: ignore[misc]
        def __init__(self, key: str) -> None:
            self.key = key

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            dm = trainer.datamodule
            epoch = dm.train_epoch if self.key == "data" else trainer.current_epoch
            dm.batch_size = sizes[min(epoch + 1, 2)]

    _, whole = _fit(tmp_path, _dm(store, 24), callbacks=[Curriculum("data")], max_steps=8)
    assert [len(s[3]) for s in whole.steps] == [24, 24, 23, 18, 18, 18, 17, 20]
    for key, exact in (("data", True), ("trainer", False)):
        stopped, first = _fit(tmp_path, _dm(store, 24), callbacks=[Curriculum(key)], max_steps=1)
        stopped.save_checkpoint(tmp_path / "stop.ckpt")
        _, got = _fit(
            tmp_path, _dm(store, 24), tmp_path / "stop.ckpt", callbacks=[Curriculum(key)],
            max_steps=8,
        )  # fmt: skip
        same = [s[2:] for s in first.steps + got.steps] == [s[2:] for s in whole.steps]
        assert same == exact and torch.equal(got.w, whole.w) == exact, key


# -- 2. limit_train_batches with a batch size that changes between epochs ----------------------

SIZES = (24, 18, 20)  # a curriculum: the batch size of each epoch


def _curriculum() -> Any:
    import lightning as L

    class Curriculum(L.Callback):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            trainer.datamodule.batch_size = SIZES[min(trainer.current_epoch + 1, EPOCHS - 1)]

    return Curriculum()


def test_a_checkpoint_on_the_last_batch_limit_train_batches_lets_a_curriculum_epoch_train_resumes(
    store: Path, tmp_path: Path
) -> None:
    """``limit_train_batches=2`` and batch sizes 24 -> 18 -> 20: the checkpoints saved on the
    last batch each epoch trains (steps 2 and 4) and where epoch 0 ended (their loader states
    are mid-epoch, at the old batch size), resumed into a data module of the next epoch's
    batch size, train the uninterrupted fit's steps, the weights bit for bit (before:
    ``StateMismatchError``, "its batch_size differs (saved 24, this pipeline 18)", though
    Lightning trains no more batch of the saved epoch); so do those of the fit resumed from
    step 2, mid-epoch 1 and on its last batch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def savers(into: Path) -> list[Any]:
        return [
            ModelCheckpoint(dirpath=into, every_n_train_steps=1, save_top_k=-1, filename="{step}"),
            ModelCheckpoint(
                dirpath=into, save_on_train_epoch_end=True, save_top_k=-1, filename="end-{step}"
            ),
        ]

    limited: dict[str, Any] = {"max_epochs": EPOCHS, "limit_train_batches": 2}
    _, want = _fit(
        tmp_path, _dm(store, SIZES[0]), callbacks=[_curriculum(), *savers(tmp_path)],
        enable_checkpointing=True, **limited,
    )  # fmt: skip
    assert _per_epoch(want.steps) == [2, 2, 2, 0]
    assert [len(s[3]) for s in want.steps] == [24, 24, 18, 18, 20, 20]
    again = tmp_path / "again"  # the checkpoints of the fit resumed from step 2
    for ckpt, step, epoch, saving in (
        (tmp_path / "step=2.ckpt", 2, 1, savers(again)), (tmp_path / "step=4.ckpt", 4, 2, []),
        (tmp_path / "end-step=2.ckpt", 2, 1, []),
        (again / "step=3.ckpt", 3, 1, []), (again / "step=4.ckpt", 4, 2, []),
    ):  # fmt: skip
        _, got = _fit(
            tmp_path, _dm(store, SIZES[epoch]), ckpt, callbacks=[_curriculum(), *saving],
            enable_checkpointing=bool(saving), **limited,
        )  # fmt: skip
        assert got.steps == want.steps[step:], ckpt
        assert torch.equal(got.w, want.w), ckpt


def test_a_limited_epochs_last_batch_resumes_a_next_epoch_the_limit_lets_train_longer(
    store: Path, tmp_path: Path
) -> None:
    """``limit_train_batches=0.5`` and batch sizes 24 -> 18 -> 20 (1, 2, 2 batches trained):
    the checkpoint on epoch 0's only trained batch resumes epoch 1 from its first batch, both
    its batches trained (before the fix above: refused; with only the refusal lifted, Lightning
    counted the cut epoch's 1 batch as epoch 1's first and trained 1 of its 2)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    limited: dict[str, Any] = {"max_epochs": EPOCHS, "limit_train_batches": 0.5}
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, filename="{step}")
    _, want = _fit(
        tmp_path, _dm(store, SIZES[0]), callbacks=[_curriculum(), saver], max_steps=1,
        enable_checkpointing=True, **limited,
    )  # fmt: skip
    _, whole = _fit(tmp_path, _dm(store, SIZES[0]), callbacks=[_curriculum()], **limited)
    assert _per_epoch(whole.steps) == [1, 2, 2, 0] and want.steps == whole.steps[:1]
    ckpt = tmp_path / "step=1.ckpt"
    _, got = _fit(tmp_path, _dm(store, SIZES[1]), ckpt, callbacks=[_curriculum()], **limited)
    assert got.steps == whole.steps[1:]
    assert torch.equal(got.w, whole.w)


def test_a_max_steps_stop_on_a_limited_epochs_last_batch_resumes_without_a_stray_batch(
    store: Path, tmp_path: Path
) -> None:
    """``limit_train_batches=2``, stopped by ``max_steps=2`` on epoch 0's last trained batch,
    saved after ``fit``, resumed with ``max_steps=6``: Lightning's empty restart of the ended
    epoch (finding 1) fetches a batch, and the loader delivers none there; the batches are
    the uninterrupted run's, one trainer epoch later, the weights bit for bit (before: it
    delivered epoch 0's third batch, which the limit never lets train, and Lightning trained
    it)."""
    limited: dict[str, Any] = {"limit_train_batches": 2}
    _, whole = _fit(tmp_path, _dm(store), max_steps=6, **limited)
    stopped, first = _fit(tmp_path, _dm(store), max_steps=2, **limited)
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    _, got = _fit(tmp_path, _dm(store), tmp_path / "stop.ckpt", max_steps=6, **limited)
    assert [s[1:] for s in first.steps + got.steps] == [s[1:] for s in whole.steps]
    assert torch.equal(got.w, whole.w)


def test_a_limited_epochs_last_checkpoints_resume_into_the_next_epochs_views(
    store: Path, tmp_path: Path
) -> None:
    """The same with views that change between epochs (``dm.set_views``: ``y`` 1, 9, then 17
    steps ahead, from ``on_train_epoch_end``) and ``limit_train_batches=3``: the checkpoints
    on epoch 0's last trained batch and where it ended resume into a data module of epoch
    1's views exactly (before: ``StateMismatchError``, "its dataset's views differ, and it
    was saved mid-epoch")."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from insitubatch_nodes.lightning import InSituDataModule

    g = open_geometries(str(store), ["t2m"])["t2m"]
    views = [{"x": g, "y": g.shift(ahead)} for ahead in (1, 9, 17)]

    def dm(epoch: int) -> InSituDataModule:
        return InSituDataModule(
            str(store), views[epoch], (0.75, 0.25, 0.0), transform=_item, log_report=False,
            config=PlanConfig(batch_size=8, block_chunks=2, seed=3),
        )  # fmt: skip

    class Rollout(L.Callback):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            trainer.datamodule.set_views(views[min(trainer.current_epoch + 1, EPOCHS - 1)])

    limited: dict[str, Any] = {"max_epochs": EPOCHS, "limit_train_batches": 3}
    savers = [
        ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}"),
        ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=True, filename="end-{step}"),
    ]
    _, want = _fit(
        tmp_path, dm(0), callbacks=[Rollout(), *savers], enable_checkpointing=True, max_steps=3,
        **limited,
    )  # fmt: skip
    _, whole = _fit(tmp_path, dm(0), callbacks=[Rollout()], **limited)
    assert want.steps == whole.steps[:3]
    for name in ("step=3", "end-step=3"):
        _, got = _fit(tmp_path, dm(1), tmp_path / f"{name}.ckpt", callbacks=[Rollout()], **limited)
        assert got.steps == whole.steps[3:], name
        assert torch.equal(got.w, whole.w), name


def test_a_dataset_told_its_loaded_epoch_is_over_starts_the_next_and_still_refuses_another_split(
    store: Path,
) -> None:
    """``InSituIterableDataset.end_loaded_epoch`` without Lightning: a state taken 2 batches
    into epoch 0 (of 3) at batch size 16, loaded into a dataset of batch size 12, is refused;
    told the loaded epoch is over, the dataset starts epoch 1 whole at 12 instead (its length
    told before the first batch); a state of another split is still refused."""
    from insitubatch_nodes import insitu_pipeline
    from insitubatch_nodes.errors import StateMismatchError
    from insitubatch_nodes.plan.splits import split_by_chunk
    from insitubatch_nodes.torch_data import as_dataset

    g = open_geometries(str(store), ["t2m"])["t2m"]
    views = {"x": g, "y": g.shift(1)}
    manifest = split_by_chunk(g.base, (0.5, 0.25, 0.25))

    def dataset(batch_size: int, split: str = "train") -> Any:
        config = PlanConfig(batch_size=batch_size, block_chunks=2, seed=3, split=split)
        return as_dataset(insitu_pipeline(str(store), manifest, views, config=config), _item)

    old = dataset(16)
    it = iter(old)
    next(it), next(it)
    state = old.state_dict()
    old.close()
    fresh = dataset(12)
    with pytest.raises(StateMismatchError, match="batch_size differs"):
        fresh.load_state_dict(state)
    fresh.end_loaded_epoch()
    fresh.load_state_dict(state)
    assert len(fresh) == 4
    assert [b["at"] for b in fresh] == [(1, i) for i in range(4)]
    other = dataset(12, "val")
    other.end_loaded_epoch()
    with pytest.raises(ValueError, match="split"):
        other.load_state_dict(state)
    for ds in (fresh, other):
        ds.close()


# -- 3. teardown(stage) closes what that Trainer call read ---------------------------------------


def _counted_dm(root: Path) -> tuple[Any, Any]:
    """``(counting store, data module over it)``: train, val and test splits of 36, 24 and 24
    anchors, batches of 8."""
    from insitubatch_nodes.lightning import InSituDataModule
    from tests.helpers import counting_store

    counted = counting_store(root)
    g = open_geometries(counted, ["t2m"])["t2m"]
    dm = InSituDataModule(
        counted, {"x": g, "y": g.shift(1)}, (0.5, 0.25, 0.25), transform=_item,
        config=PlanConfig(batch_size=8, block_chunks=2, seed=3), log_report=False,
    )  # fmt: skip
    return counted, dm


def test_a_validate_or_test_teardown_during_a_fit_leaves_the_training_pipeline_alone(
    store: Path, tmp_path: Path
) -> None:
    """``dm.teardown("validate")``, ``("test")`` and ``("predict")`` (what those Trainer calls
    end with) in the middle of a fit's epoch: the training pipeline goes on with its thread and
    pool, reading each chunk of the epoch once, as the fit without them (before: teardown
    closed every loader, the training pipeline's pool was cleared, and the epoch read 23 chunks
    where 12 were needed); the fit's own ``teardown("fit")`` closes it."""
    import lightning as L

    class Evaluated(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                for stage in ("validate", "test", "predict"):
                    trainer.datamodule.teardown(stage)

    plain, fitted = _counted_dm(store), _counted_dm(store)
    _, want = _fit(tmp_path, plain[1], max_epochs=1)
    _, got = _fit(tmp_path, fitted[1], max_epochs=1, callbacks=[Evaluated()])
    assert got.steps == want.steps
    assert fitted[0].chunk_gets == plain[0].chunk_gets == 12
    assert not fitted[1]._loaders["train"].pipeline.threads  # closed by Lightning's teardown


def test_teardown_closes_the_loaders_of_its_stage_and_none_closes_every_loader(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``teardown("test")`` closes the test loader (``"predict"`` reads the same),
    ``teardown("validate")`` validation's, ``teardown("fit")`` training's and validation's,
    ``teardown()`` every loader; a closed loader resumes where it was, and none leaves a
    thread behind. The Trainer's own calls after a fit close their split's loader only."""
    from insitubatch_nodes.torch_data import InSituIterableDataset

    closed: list[str] = []
    close = InSituIterableDataset.close

    def spied(self: InSituIterableDataset) -> None:
        closed.append(self.plan.split)
        close(self)

    monkeypatch.setattr(InSituIterableDataset, "close", spied)
    _, dm = _counted_dm(store)
    loaders = {"train": dm.train_dataloader(), "val": dm.val_dataloader()}
    loaders["test"] = dm.test_dataloader()
    running = {split: iter(loader) for split, loader in loaders.items()}
    seen = {split: [next(it)["at"][1]] for split, it in running.items()}
    for stage, want in [
        ("test", ["test"]), ("validate", ["val"]), ("predict", ["test"]),
        ("fit", ["train", "val"]), (None, ["train", "val", "test"]),
    ]:  # fmt: skip
        closed.clear()
        dm.teardown(stage)
        assert closed == want, stage
    for split, it in running.items():  # each closed loader resumed at its next batch
        seen[split] += [batch["at"][1] for batch in it]
        assert seen[split] == list(range(len(loaders[split]))), split
    dm.teardown()
    assert not any(ds.pipeline.threads for ds in loaders.values())
    trainer, model = _fit(tmp_path, dm, max_epochs=1, limit_val_batches=1.0)
    for call, split, logged in ((trainer.validate, "val", "v"), (trainer.test, "test", "t")):
        closed.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert logged in call(model, datamodule=dm, verbose=False)[0]
        assert set(closed) == {split}, (call, closed)


# -- 4. val_check_interval < 1 with a curriculum: the checkpoint of the last batch's validation --


def test_a_checkpoint_of_the_validation_on_an_epochs_last_batch_resumes_a_longer_next_epoch_whole(
    store: Path, tmp_path: Path
) -> None:
    """``val_check_interval=0.5`` validates after an epoch's last batch inside the epoch, and
    ``ModelCheckpoint()`` saves there; Lightning resumes such a checkpoint by running the ended
    epoch's end hooks again. Batch sizes 24 -> 18 -> 20 (3, 4, 4 batches): resumed from the
    checkpoint of epoch 0's last validation, epoch 1 is trained whole, told its 4 batches, the
    weights bit for bit (before: Lightning was told epoch 0's 3 batches for epoch 1 and
    trained 3 of its 4: the data module compared the ended epoch's length, not the next
    one's, where the hooks asked whether the next epoch differs)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    told: list[int] = []

    class Told(_curriculum().__class__):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            told.append(int(trainer.num_training_batches))

    checked: dict[str, Any] = {"max_epochs": EPOCHS, "limit_val_batches": 1.0}
    checked["val_check_interval"] = 0.5
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}-{step}")
    _, want = _fit(
        tmp_path, _dm(store, SIZES[0]), callbacks=[Told(), saver], enable_checkpointing=True,
        **checked,
    )  # fmt: skip
    assert _per_epoch(want.steps) == [3, 4, 4, 0]
    assert told == [3] * 3 + [4] * 8
    told.clear()
    _, got = _fit(
        tmp_path, _dm(store, SIZES[1]), tmp_path / "epoch=0-step=3.ckpt", callbacks=[Told()],
        **checked,
    )  # fmt: skip
    assert got.steps == want.steps[3:]
    assert told == [4] * 8
    assert torch.equal(got.w, want.w)
