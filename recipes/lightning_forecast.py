"""Train a next-step 2 m temperature forecaster with Lightning, in place on a zarr store.

One sample is one time step: ``x = t2m[t]`` and ``y = t2m[t + 1]`` (a ``shift(1)`` view of the
same array, so every chunk is read once per epoch for both). A tiny residual convolutional
network, circular in longitude, learns the tendency ``y - x`` from ``x``; the synthetic
ERA5-like data advect eastward, so it soon beats persistence (predicting no change).

``InSituDataModule`` builds one pipeline per split with the rank and world size taken from the
Trainer, reports exact loader lengths and keeps the training position in every checkpoint, so a
run stopped at any point resumes with exactly the next batch. ``ModelCheckpoint`` writes a
checkpoint every ``--ckpt-every`` steps (and ``last.ckpt``); ``--resume`` continues from the
last checkpoint in ``--ckpt-dir``.

Without ``--url`` a synthetic ERA5-like store is written to ``--path`` (default: a temporary
folder; the data are deterministic, so a resumed run sees the same store either way).

    .venv/bin/python recipes/lightning_forecast.py --max-epochs 2
    .venv/bin/python recipes/lightning_forecast.py --max-epochs 4 --resume
    .venv/bin/python recipes/lightning_forecast.py --devices 2            # DDP on the CPU
    .venv/bin/python recipes/lightning_forecast.py --url s3://bucket/era5.zarr \\
        --endpoint http://127.0.0.1:9000 --region us-east-1 --allow-http
"""

from __future__ import annotations

import argparse
import math
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

from insitubatch_nodes import ArrayGeometry, SplitManifest
from insitubatch_nodes.lightning import InSituDataModule
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.synthetic import make_era5_like


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_argument_group("data")
    src.add_argument("--url", help="train from this store (s3://, gs://, az://, file://, path)")
    src.add_argument("--endpoint", help="object-store endpoint URL (e.g. a local S3 server)")
    src.add_argument("--region", help="object-store region")
    src.add_argument("--allow-http", action="store_true", help="allow plain-http endpoints")
    src.add_argument("--skip-signature", action="store_true", help="anonymous (public) reads")
    src.add_argument("--access-key-id", help="S3 access key id (default: from the environment)")
    src.add_argument("--secret-access-key", help="S3 secret key (default: from the environment)")
    src.add_argument("--variable", default="t2m", help="array to forecast (time first)")
    src.add_argument(
        "--path",
        type=Path,
        help="synthetic store (written if missing) when no --url is given "
        "(default: a temporary folder, removed afterwards)",
    )
    src.add_argument("--n-time", type=int, default=512, help="time steps of the synthetic store")
    src.add_argument("--n-lat", type=int, default=32)
    src.add_argument("--n-lon", type=int, default=64)
    src.add_argument("--samples-per-chunk", type=int, default=16, help="chunk length along time")
    tr = p.add_argument_group("training")
    tr.add_argument("--max-epochs", type=int, default=3)
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--block-chunks", type=int, default=8, help="chunks shuffled together")
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--devices", type=int, default=1, help="devices (ranks); > 1 uses DDP")
    tr.add_argument("--accelerator", default="cpu", help="cpu, gpu or auto")
    tr.add_argument("--limit-val-batches", type=int, default=4)
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints/lightning_forecast"))
    ck.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N train steps")
    ck.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --ckpt-dir"
    )
    return p.parse_args(argv)


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    """``open_store`` options for ``--url`` (only those given)."""
    opts: dict[str, Any] = {}
    for name in ("endpoint", "region", "access_key_id", "secret_access_key"):
        value = getattr(args, name)
        if value:
            opts[name] = value
    if args.skip_signature:
        opts["skip_signature"] = True
    if args.allow_http:
        opts["client_options"] = {"allow_http": True}
    return opts


def ensure_synthetic(path: Path, args: argparse.Namespace) -> None:
    if (path / "zarr.json").exists() or (path / ".zgroup").exists():
        print(f"using the existing store at {path}")
        return
    make_era5_like(
        path,
        n_time=args.n_time,
        n_lat=args.n_lat,
        n_lon=args.n_lon,
        samples_per_chunk=args.samples_per_chunk,
        variables=("t2m",),
        seed=args.seed,
    )
    print(f"wrote a synthetic ERA5-like store to {path}")


class Forecaster(pl.LightningModule):
    """Predict the tendency ``y - x`` from the standardised field ``x``.

    A linear 3x5 convolution (enough to express a shift of two longitude cells) plus a small
    non-linear branch; circular in longitude, zero-padded in latitude. The loss is in units of
    the tendency's standard deviation, so persistence (predicting no change) scores about 1.
    """

    mean: torch.Tensor
    scale: torch.Tensor

    def __init__(self, lat_mean: np.ndarray, std: float, tendency_std: float, lr: float) -> None:
        super().__init__()
        self.lr = lr
        # buffers (tensors) rather than hyperparameters: checkpoints stay loadable with
        # torch.load(weights_only=True), which Lightning uses when resuming
        self.register_buffer("mean", torch.as_tensor(lat_mean, dtype=torch.float32)[:, None])
        self.register_buffer("scale", torch.tensor([std, tendency_std], dtype=torch.float32))
        self.linear = torch.nn.Conv2d(1, 1, kernel_size=(3, 5), padding=(1, 0), bias=False)
        self.hidden = torch.nn.Conv2d(1, 8, kernel_size=(3, 5), padding=(1, 0))
        self.out = torch.nn.Conv2d(8, 1, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ((x - self.mean) / self.scale[0]).unsqueeze(1)  # (B, 1, lat, lon)
        h = torch.nn.functional.pad(h, (2, 2, 0, 0), mode="circular")
        t = self.linear(h) + self.out(torch.nn.functional.gelu(self.hidden(h)))
        return t.squeeze(1)

    def _losses(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        target = (batch["y"] - batch["x"]) / self.scale[1]
        loss = torch.nn.functional.mse_loss(self(batch["x"]), target)
        return loss, target.square().mean()

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._losses(batch)
        self.log("train_loss", loss, batch_size=len(batch["x"]))
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        loss, persistence = self._losses(batch)
        n = len(batch["x"])
        self.log("val_loss", loss, batch_size=n, sync_dist=True)
        self.log("val_persistence", persistence, batch_size=n, sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        # Reading estimated_stepping_batches here is what Lightning issue #20550 is about; the
        # DataModule keeps the loader position in its own state, so resume stays exact. The
        # schedule is a function (not saved), so a resume with more epochs stretches it.
        total = max(1, int(self.trainer.estimated_stepping_batches))

        def factor(step: int) -> float:
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(step / total, 1.0)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class EpochReport(pl.Callback):
    """Print the validation losses after each epoch (rank 0 only)."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        if "val_loss" in m:
            print(
                f"epoch {trainer.current_epoch} step {trainer.global_step}: val loss "
                f"{float(m['val_loss']):.4f} (persistence {float(m['val_persistence']):.4f})",
                flush=True,
            )


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """``last.ckpt`` if present, else the newest ``*.ckpt`` in ``ckpt_dir``."""
    last = ckpt_dir / "last.ckpt"
    if last.exists():
        return last
    found = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def field_stats(
    store: Any, geom: ArrayGeometry, manifest: SplitManifest
) -> tuple[np.ndarray, float, float]:
    """Per-latitude mean, anomaly std and tendency std of the first training chunks, read with
    zarr (for standardising) and decoded as the batches are (CF mask and scale; masked
    points skipped)."""
    arr = zarr.open_array(store=store, path=geom.path, mode="r")
    spc = manifest.samples_per_chunk
    first = manifest.chunks("train")[:4]
    data = np.concatenate([np.asarray(arr[c * spc : (c + 1) * spc]) for c in first])
    if geom.cf is not None:
        data = geom.cf.decode(data)
    data = data.astype(np.float64)
    lat_mean = np.nanmean(data, axis=(0, 2))
    std = float(max(np.nanstd(data - lat_mean[:, None]), 1e-3))
    tendency = float(max(np.nanstd(np.diff(data, axis=0)), 1e-6))
    return lat_mean.astype(np.float32), std, tendency


def run(source: str | Path, options: dict[str, Any], args: argparse.Namespace) -> int:
    pl.seed_everything(args.seed, verbose=False)
    variable = args.variable

    def windowed(geoms: dict[str, ArrayGeometry]) -> dict[str, ArrayGeometry]:
        if variable not in geoms:
            raise KeyError(f"no array {variable!r} in the store; arrays: {sorted(geoms)}")
        return {"x": geoms[variable], "y": geoms[variable].shift(1)}

    dm = InSituDataModule(
        source,
        windowed,
        (0.8, 0.1, 0.1),
        config=PlanConfig(
            batch_size=args.batch_size, block_chunks=args.block_chunks, seed=args.seed
        ),
        store_options=options,
        cf_dtype="float32",  # a CF-packed int16 field decodes to float64: the model is float32
    )
    dm.setup()
    assert dm.store is not None and dm.manifest is not None
    x = dm.views["x"]
    assert isinstance(x, ArrayGeometry)  # (a label may be a stack: this one is an array)
    print(
        f"{x.path}: shape {x.shape}, chunks {x.chunks}; train/val/test chunks "
        f"{[len(dm.manifest.chunks(s)) for s in ('train', 'val', 'test')]}"
    )
    lat_mean, std, tendency_std = field_stats(dm.store, x, dm.manifest)
    model = Forecaster(lat_mean, std, tendency_std, args.lr)

    ckpt_path: Path | None = None
    if args.resume:
        ckpt_path = last_checkpoint(args.ckpt_dir)
        print(
            f"resuming from {ckpt_path}"
            if ckpt_path
            else f"no checkpoint in {args.ckpt_dir}: starting from scratch"
        )
    checkpoints = ModelCheckpoint(
        dirpath=args.ckpt_dir,
        filename="{epoch}-{step}",
        every_n_train_steps=args.ckpt_every,
        save_top_k=-1,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.max_epochs,
        limit_val_batches=args.limit_val_batches,
        callbacks=[checkpoints, EpochReport()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        print(
            f"trained {trainer.current_epoch} epoch(s), {trainer.global_step} steps in "
            f"{time.perf_counter() - t0:.1f} s; checkpoints in {args.ckpt_dir}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        return run(args.url, store_options(args), args)
    if any(getattr(args, n) for n in ("endpoint", "region", "access_key_id", "allow_http")):
        print("--endpoint/--region/--allow-http/... apply to --url only", file=sys.stderr)
        return 2
    if args.path is not None:
        ensure_synthetic(args.path, args)
        return run(args.path, {}, args)
    with tempfile.TemporaryDirectory(prefix="lightning_forecast-") as tmp:
        path = Path(tmp) / "era5.zarr"
        ensure_synthetic(path, args)
        return run(path, {}, args)


if __name__ == "__main__":
    sys.exit(main())
