"""Train a GraphCast-style forecaster with Lightning on an hourly archive as stored, with a
rollout that grows.

The store is ARCO-ERA5-like: hourly, one time step per chunk, every pressure level of a step
whole in its chunk (37 levels by default). A sample is anchored every 6 hours
(``stride="6h"``: 00, 06, 12 and 18 UTC) and holds, per array, two input steps ``x = (t - 6h,
t)`` (a ``window(["-6h", "0h"])`` view) and the target steps ``y = (t + 6h, ..., t + 6h *
rollout)`` (a second window of the same array): every batch holds ``(batch, T, *field)`` per
label, and only the objects of on-grid steps are read — each once per epoch, though windows
overlap (``t + 6h`` is the next anchor's input).

The model predicts the 6-hour tendency of every channel (each level of each array) from the two
input steps, and rolls out: its prediction becomes the next input. The rollout grows during
training (``--rollout-schedule 1:0 2:2 4:4``: one target step from epoch 0, two from epoch 2,
four from epoch 4), as anemoi's rollout curriculum does: a callback swaps the target windows
with ``InSituDataModule.set_views`` between epochs, and the new windows take effect at the next
epoch. The epochs are the data's (``dm.train_epoch``), which Lightning's ``current_epoch`` runs
ahead of after a ``--max-steps`` stop resumed mid-epoch. Validation always rolls out the
longest schedule's steps, so its loss compares across epochs. Checkpoints keep the loader
position, so ``--resume`` continues with exactly the next batch, also after the rollout grew
(and the same losses as a run never stopped).

    .venv/bin/python recipes/forecast_rollout.py --max-epochs 6
    .venv/bin/python recipes/forecast_rollout.py --max-epochs 8 --resume --path /tmp/arco.zarr
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import zarr
from lightning.pytorch.callbacks import ModelCheckpoint

from insitubatch_nodes import ArrayGeometry, PlanConfig
from insitubatch_nodes.lightning import InSituDataModule
from insitubatch_nodes.synthetic import make_weatherbench_like

STEP_H = 6  # the model's time step, and the anchor stride


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_argument_group("data")
    src.add_argument(
        "--path",
        type=Path,
        help="hourly store (a synthetic one is written there if missing; default: a temporary "
        "folder, removed afterwards)",
    )
    src.add_argument("--days", type=int, default=24, help="days of hourly steps to write")
    src.add_argument("--n-lat", type=int, default=16)
    src.add_argument("--n-lon", type=int, default=32)
    src.add_argument("--n-level", type=int, default=37)
    tr = p.add_argument_group("training")
    tr.add_argument("--max-epochs", type=int, default=6)
    tr.add_argument(
        "--max-steps",
        type=int,
        default=-1,
        help="stop after this many steps in all (a budgeted run, resumed with a larger one)",
    )
    tr.add_argument("--batch-size", type=int, default=8)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--rollout-schedule",
        nargs="+",
        default=["1:0", "2:2", "4:4"],
        help="STEPS:EPOCH pairs: target steps from that epoch on",
    )
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints/forecast_rollout"))
    ck.add_argument("--resume", action="store_true", help="continue from --ckpt-dir/last.ckpt")
    return p.parse_args(argv)


def rollout_schedule(pairs: Sequence[str]) -> list[tuple[int, int]]:
    """``["1:0", "2:2"]`` -> ``[(0, 1), (2, 2)]``: (first epoch, target steps), by epoch."""
    out = []
    for pair in pairs:
        steps, _, epoch = pair.partition(":")
        out.append((int(epoch), int(steps)))
    out.sort()
    if not out or out[0][0] != 0:
        raise SystemExit("--rollout-schedule must say how many target steps epoch 0 has (N:0)")
    return out


def steps_at(schedule: list[tuple[int, int]], epoch: int) -> int:
    return [steps for first, steps in schedule if first <= epoch][-1]


def resume_epoch(ckpt: Path, max_steps: bool = False) -> int:
    """The epoch of the data (``InSituDataModule.train_epoch``) whose batches a run resumed from
    a Lightning checkpoint trains first, ``max_steps`` saying whether the resumed trainer has
    ``max_steps`` set: the epochs the checkpoint had processed (a checkpoint saved at
    ``on_train_epoch_end`` counts its epoch: Lightning runs the epoch-end hooks again, and the
    curriculum's ``set_views`` with them), and one more where it was saved after an epoch's
    last batch and before that epoch's end (``ModelCheckpoint(every_n_train_steps=...)``
    landing there): Lightning then counts the epoch as done without running its epoch-end
    hooks again, so the rollout must be the next epoch's from the start. (Reading
    ``completed`` alone, that next epoch trained on the rollout of the one before.)

    Less the epochs the data runs behind Lightning's count: the data module's
    ``"epoch_offset"`` (a run resumed before from a ``max_steps`` stop), and one more for a
    checkpoint of a ``max_steps`` stop mid-epoch resumed with ``max_steps`` set, which
    Lightning counts as done yet goes on with at its next batch. (Before 2026-12-07 these took
    Lightning's count: the rollout of the epoch after, refused for the mid-epoch loader state
    saved under the epoch's own, ``StateMismatchError``.)"""
    state = torch.load(ckpt, weights_only=False, map_location="cpu")
    loop = state["loops"]["fit_loop"]
    epochs = loop["epoch_progress"]["current"]
    batches = loop["epoch_loop.batch_progress"]
    last_batch = bool(batches["is_last_batch"])
    in_epoch = epochs["processed"] < epochs["started"]  # saved before the epoch's end hooks
    first = int(epochs["processed"]) + int(last_batch and in_epoch)
    offset = int(state.get(InSituDataModule.__qualname__, {}).get("epoch_offset", 0))
    stopped_mid_epoch = not in_epoch and not last_batch and batches["current"]["ready"] > 0
    return first - offset - int(max_steps and stopped_mid_epoch)


def ensure_store(path: Path, args: argparse.Namespace) -> None:
    if (path / "zarr.json").exists():
        print(f"using the existing store at {path}")
        return
    make_weatherbench_like(
        path,
        n_time=24 * args.days,
        n_lat=args.n_lat,
        n_lon=args.n_lon,
        n_level=args.n_level,
        surface=2,
        levels=2,
        hours_per_step=1,
        samples_per_chunk=1,
        seed=args.seed,
    )
    print(f"wrote an hourly ARCO-ERA5-like store ({24 * args.days} steps) to {path}")


def forecast_views(geoms: Mapping[str, ArrayGeometry], rollout: int) -> dict[str, ArrayGeometry]:
    """``x/<array>``: the two input steps; ``y/<array>``: ``rollout`` target steps."""
    targets = [f"{STEP_H * k}h" for k in range(1, rollout + 1)]
    views: dict[str, ArrayGeometry] = {}
    for name, g in sorted(geoms.items()):
        views[f"x/{name}"] = g.window([f"-{STEP_H}h", "0h"])
        views[f"y/{name}"] = g.window(targets)
    return views


def channels(batch: Mapping[str, torch.Tensor], role: str) -> torch.Tensor:
    """The ``role`` labels of a batch as one ``(batch, T, C, lat, lon)`` tensor, arrays in
    name order, every level of a leveled array a channel of its own."""
    parts = []
    for label in sorted(k for k in batch if k.startswith(role + "/")):
        t = batch[label]
        parts.append(t if t.ndim == 5 else t.unsqueeze(2))  # (B, T, [L,] lat, lon)
    return torch.cat(parts, dim=2)


def channel_stats(store: Path, names: Sequence[str], stop: int) -> tuple[np.ndarray, ...]:
    """Per-channel mean, standard deviation and 6-hour tendency standard deviation over the
    first ``stop`` steps (the training split's), read with zarr."""
    means, stds, tends = [], [], []
    for name in sorted(names):
        data = np.asarray(zarr.open_array(store=str(store), path=name, mode="r")[:stop:STEP_H])
        data = data.astype(np.float64)
        data = data if data.ndim == 4 else data[:, None]
        means.append(data.mean(axis=(0, 2, 3)))
        stds.append(np.maximum(data.std(axis=(0, 2, 3)), 1e-6))
        tends.append(np.maximum(np.diff(data, axis=0).std(axis=(0, 2, 3)), 1e-6))
    return tuple(np.concatenate(v).astype(np.float32) for v in (means, stds, tends))


class Forecaster(pl.LightningModule):
    """Predict the 6-hour tendency of every channel from the two latest steps, and roll out.

    A small residual convolutional network, circular in longitude. The loss is the mean squared
    error of the predicted tendencies over every target step, in units of each channel's
    tendency standard deviation, so persistence (predicting no change) scores about 1.
    """

    mean: torch.Tensor
    std: torch.Tensor
    tendency_std: torch.Tensor

    def __init__(self, mean: np.ndarray, std: np.ndarray, tendency: np.ndarray, lr: float):
        super().__init__()
        self.lr = lr
        c = len(mean)
        for name, value in (("mean", mean), ("std", std), ("tendency_std", tendency)):
            self.register_buffer(name, torch.as_tensor(value)[:, None, None])
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(2 * c, 64, kernel_size=3, padding=(1, 0)),
            torch.nn.GELU(),
            torch.nn.Conv2d(64, c, kernel_size=1),
        )

    def step(self, prev: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        """The next state from two ``(batch, C, lat, lon)`` states."""
        h = torch.cat([(prev - self.mean) / self.std, (now - self.mean) / self.std], dim=1)
        h = torch.nn.functional.pad(h, (1, 1, 0, 0), mode="circular")
        return now + self.net(h) * self.tendency_std

    def rollout_loss(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = channels(batch, "x"), channels(batch, "y")  # (B, 2, C, ...), (B, R, C, ...)
        prev, now = x[:, 0], x[:, 1]
        loss = torch.zeros((), device=x.device)
        for k in range(y.shape[1]):
            nxt = self.step(prev, now)
            loss = loss + ((nxt - y[:, k]) / self.tendency_std).square().mean()
            prev, now = now, nxt
        return loss / y.shape[1], y.shape[1]

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, rollout = self.rollout_loss(batch)
        self.log("train_loss", loss, batch_size=len(next(iter(batch.values()))))
        self.log("rollout", float(rollout), batch_size=1)
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self.rollout_loss(batch)
        self.log("val_loss", loss, batch_size=len(next(iter(batch.values()))))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class RolloutCurriculum(pl.Callback):
    """Lengthen the target windows between epochs: at the end of each training epoch, the
    training pipeline gets the next epoch's views (``InSituDataModule.set_views``)."""

    def __init__(self, geoms: Mapping[str, ArrayGeometry], schedule: list[tuple[int, int]]):
        self.geoms, self.schedule = dict(geoms), schedule

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # keyed on the data's epoch, not trainer.current_epoch: after a max_steps stop resumed
        # mid-epoch Lightning's count runs one ahead of the data (docs/training.md), and the
        # rollout grew an epoch early
        dm: InSituDataModule = trainer.datamodule  # type: ignore[attr-defined]
        epoch = dm.train_epoch
        now, nxt = steps_at(self.schedule, epoch), steps_at(self.schedule, epoch + 1)
        if nxt != now:
            dm.set_views(forecast_views(self.geoms, nxt))
            print(f"epoch {epoch + 1} trains on {nxt} target steps", flush=True)


class EpochReport(pl.Callback):
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            loss = float(trainer.callback_metrics["val_loss"])
            epoch = trainer.datamodule.train_epoch  # type: ignore[attr-defined]  # (the data's)
            print(f"epoch {epoch}: val loss {loss:.6f}", flush=True)


def run(path: Path, args: argparse.Namespace) -> int:
    pl.seed_everything(args.seed, verbose=False)
    schedule = rollout_schedule(args.rollout_schedule)
    ckpt = args.ckpt_dir / "last.ckpt" if args.resume else None
    if ckpt is not None and not ckpt.exists():
        print(f"no checkpoint at {ckpt}: starting from scratch")
        ckpt = None
    # the epoch a resumed run trains first decides the rollout its pipeline starts with (a
    # state saved under the views before the rollout grew restores at that epoch boundary,
    # and the next epoch reads these views)
    start_epoch = 0 if ckpt is None else resume_epoch(ckpt, max_steps=args.max_steps > 0)
    geoms: dict[str, ArrayGeometry] = {}

    def views(found: dict[str, ArrayGeometry]) -> dict[str, ArrayGeometry]:
        geoms.update(found)  # validation: always the longest rollout (comparable epochs)
        return forecast_views(found, max(steps for _, steps in schedule))

    dm = InSituDataModule(
        str(path),
        views,
        (0.8, 0.2, 0.0),
        config=PlanConfig(batch_size=args.batch_size, block_chunks=24, stride=f"{STEP_H}h"),
    )
    dm.setup()
    assert dm.manifest is not None
    dm.set_views(forecast_views(geoms, steps_at(schedule, start_epoch)))  # training's rollout
    train_stop = max(dm.manifest.chunks("train")) + 1
    print(
        f"{len(geoms)} arrays, {sum(g.n_samples for g in geoms.values()) // len(geoms)} hourly "
        f"steps; anchors every {STEP_H} h; inputs (t-{STEP_H}h, t); rollout schedule "
        + ", ".join(f"{s} step(s) from epoch {e}" for e, s in schedule)
    )
    model = Forecaster(*channel_stats(path, list(geoms), train_stop), lr=args.lr)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        callbacks=[
            ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=0),
            RolloutCurriculum(geoms, schedule),
            EpochReport(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    print(
        f"trained {trainer.current_epoch} epoch(s), {trainer.global_step} steps in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    report = dm.train_report()
    if report is not None:
        print(f"last training epoch:\n{report}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        ensure_store(args.path, args)
        return run(args.path, args)
    with tempfile.TemporaryDirectory(prefix="forecast_rollout-") as tmp:
        path = Path(tmp) / "arco.zarr"
        ensure_store(path, args)
        return run(path, args)


if __name__ == "__main__":
    sys.exit(main())
