"""Fit a StandardScaler over the loader in one pass, then train with it as a chunk transform.

1. **Fit.** One epoch of a pipeline without transforms, in order (``shuffle=False``): every
   batch feeds an incremental scaler per array — one statistic for ``t2m``, one per pressure
   level for ``z``. With scikit-learn installed (``pip install 'insitubatch_nodes[recipes]'``)
   that is ``sklearn.preprocessing.StandardScaler.partial_fit``; without it, a numpy running
   mean/variance with the same ``partial_fit`` interface (Chan et al.'s pairwise update) does
   the same job — this recipe needs only numpy. ``--fit-with numpy`` forces the latter.
2. **Train.** A second pipeline applies the fitted statistics as a chunk transform
   (``insitubatch_nodes.StandardScaler``): on the decode threads, once per chunk, before any
   batch gathers from it. A tiny linear model learns to predict ``t2m`` one step ahead from
   ``t2m`` and ``z`` (both standardized). The recipe prints the standardized mean/std per array
   seen by the model (about 0 and 1) and the training loss.

The fit pass reads every chunk of the split once. Its pool holds raw chunks, so it does not
warm the training pipeline's pool (that one holds standardized chunks); what it warms is
whatever sits under the store (the OS page cache for a local store).

    .venv/bin/python recipes/fit_scaler.py
    .venv/bin/python recipes/fit_scaler.py --epochs 3 --fit-with numpy
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from insitubatch_nodes import (
    StandardScaler,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    to_torch,
)
from insitubatch_nodes.synthetic import make_era5_like


class RunningMoments:
    """Per-column running mean and variance, ``partial_fit`` like scikit-learn's scaler.

    Rows are observations, columns are the statistics kept (one column for a per-array
    statistic, one per level for per-level ones). Updates merge each batch's moments into the
    running ones (Chan, Golub & LeVeque), so the result does not depend on how the data was
    split into batches.
    """

    def __init__(self) -> None:
        self.n_samples_seen_ = 0
        self.mean_: np.ndarray | None = None
        self._m2: np.ndarray | None = None

    def partial_fit(self, x: np.ndarray) -> RunningMoments:
        x = np.asarray(x, dtype=np.float64)
        n = x.shape[0]
        if n == 0:
            return self
        mean = x.mean(axis=0)
        m2 = ((x - mean) ** 2).sum(axis=0)
        if self.mean_ is None or self._m2 is None:
            self.n_samples_seen_, self.mean_, self._m2 = n, mean, m2
            return self
        total = self.n_samples_seen_ + n
        delta = mean - self.mean_
        self.mean_ = self.mean_ + delta * (n / total)
        self._m2 = self._m2 + m2 + delta**2 * (self.n_samples_seen_ * n / total)
        self.n_samples_seen_ = total
        return self

    @property
    def var_(self) -> np.ndarray:
        assert self._m2 is not None, "partial_fit was never called"
        return self._m2 / self.n_samples_seen_

    @property
    def scale_(self) -> np.ndarray:
        return np.sqrt(self.var_)


def make_scaler(kind: str) -> Any:
    if kind == "sklearn":
        from sklearn.preprocessing import StandardScaler as SkScaler

        return SkScaler()
    return RunningMoments()


def columns(batch_array: np.ndarray, per_level: bool) -> np.ndarray:
    """Rows = observations, columns = statistics: (all values, 1) or (..., n_level)."""
    if per_level:  # (batch, level, lat, lon) -> (batch * lat * lon, level)
        return np.moveaxis(batch_array, 1, -1).reshape(-1, batch_array.shape[1])
    return batch_array.reshape(-1, 1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", type=Path, help="ERA5-like store (written if missing)")
    p.add_argument("--n-time", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--fit-with",
        choices=("auto", "sklearn", "numpy"),
        default="auto",
        help="auto: scikit-learn's partial_fit when installed, else numpy's running moments",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    kind = args.fit_with
    if kind == "auto":
        try:
            import sklearn  # noqa: F401

            kind = "sklearn"
        except ImportError:
            kind = "numpy"
    with tempfile.TemporaryDirectory() as tmp:
        root = args.path or Path(tmp) / "era5.zarr"
        if not (root / "zarr.json").exists():
            make_era5_like(root, n_time=args.n_time, n_lat=16, n_lon=32, n_level=3)
        g = open_geometries(root, ["t2m", "z"])
        manifest = split_by_chunk(g["t2m"], (0.8, 0.2, 0.0))
        per_level = {"t2m": False, "z": True}

        # -- 1. fit: one in-order pass over the training split, raw values -------------------
        t0 = time.perf_counter()
        fits = {path: make_scaler(kind) for path in per_level}
        fit_pipe = insitu_pipeline(
            root, manifest, {"t2m": g["t2m"], "z": g["z"]}, batch_size=64, shuffle=False
        )
        for batch in fit_pipe:
            for path, fit in fits.items():
                fit.partial_fit(columns(batch[path], per_level[path]))
        fit_pipe.close()
        mean = {"t2m": float(fits["t2m"].mean_[0]), "z": fits["z"].mean_.reshape(-1, 1, 1)}
        std = {"t2m": float(fits["t2m"].scale_[0]), "z": fits["z"].scale_.reshape(-1, 1, 1)}
        print(
            f"fit ({kind}) over {int(np.max(fits['t2m'].n_samples_seen_)):,} t2m values in "
            f"{time.perf_counter() - t0:.2f} s: t2m mean {mean['t2m']:.2f} std {std['t2m']:.2f}; "
            f"z per level mean {np.round(mean['z'].ravel(), 1).tolist()}"
        )
        scaler = StandardScaler(mean, std, cache_key=f"era5-{kind}-v1")

        # -- 2. train with the scaler as a chunk transform --------------------------------
        views = {"x": g["t2m"], "z": g["z"], "y": g["t2m"].shift(1)}
        pipe = insitu_pipeline(
            root, manifest, views, batch_size=args.batch_size, chunk_transforms=[scaler]
        )
        inner = int(np.prod(g["t2m"].inner_shape))
        n_level = g["z"].inner_shape[0]
        torch.manual_seed(0)
        model = torch.nn.Linear(inner * (1 + n_level), inner)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for epoch in range(args.epochs):
            sums = {k: [0.0, 0.0, 0] for k in ("x", "z")}
            losses = []
            for batch in pipe:
                for k in sums:  # what the model sees, standardized per array
                    a = batch[k].astype(np.float64)
                    sums[k][0] += a.sum()
                    sums[k][1] += (a**2).sum()
                    sums[k][2] += a.size
                t = to_torch(batch)
                inputs = torch.cat([t["x"].flatten(1), t["z"].flatten(1)], dim=1)
                loss = torch.nn.functional.mse_loss(model(inputs), t["y"].flatten(1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            report = pipe.report()
            pipe.reset()
            stats = {
                k: (s / n, np.sqrt(max(q / n - (s / n) ** 2, 0.0))) for k, (s, q, n) in sums.items()
            }
            print(
                f"epoch {epoch}: loss {np.mean(losses):.4f}; standardized t2m mean "
                f"{stats['x'][0]:+.3f} std {stats['x'][1]:.3f}, z mean {stats['z'][0]:+.3f} "
                f"std {stats['z'][1]:.3f}; the scaler ran on "
                f"{report.transforms if report else 0} chunks "
                f"({report.transform_s if report else 0.0:.3f} s on the decode threads; "
                "a chunk still resident from the last epoch is not transformed again)"
            )
        pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
