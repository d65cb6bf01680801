"""Train on a reanalysis archive as it is stored: one time step per chunk, many arrays.

WeatherBench2 and ARCO-ERA5 keep every variable as an array of its own, chunked one time step
per chunk, the whole lat/lon field (and, for pressure-level variables, every level) in one
stored object. This recipe writes such a store (``make_weatherbench_like``: surface arrays
``(time, lat, lon)`` and 13-level arrays ``(time, level, lat, lon)``, blosc-zstd), then trains a
small convolutional forecaster of ``2m_temperature`` at ``t + 1`` from every array at ``t``:

* every array is one label (``{name: geometry}``): at one sample per chunk the fetch stage
  decodes each stored object straight into its row of the batch — the pool holds none of them —
  unless the split fits the budget (the automatic one: 1/16 of RAM): then it is decoded
  once into the pool and later epochs read nothing (``--budget-mib`` smaller than the split
  shows the straight path);
* the target is a shifted view of one of those arrays (``t2m.shift(1)``): that array's chunks are
  read once each and serve both its input rows and its target rows (through the pool);
* after each epoch it prints the epoch report — which stage limited the epoch — and checks the
  first batch of every epoch against zarr's own read.

    .venv/bin/python recipes/archive_forecast.py
    .venv/bin/python recipes/archive_forecast.py --n-time 512 --surface 10 --levels 3
    .venv/bin/python recipes/archive_forecast.py --budget-mib 40   # smaller than the split
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, to_torch
from insitubatch_nodes.synthetic import make_weatherbench_like

TARGET = "2m_temperature"
COORDS = ("time", "latitude", "longitude", "level")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", type=Path, default=None, help="store (default: a temp folder)")
    parser.add_argument("--n-time", type=int, default=256, help="time steps (one chunk each)")
    parser.add_argument("--n-lat", type=int, default=32)
    parser.add_argument("--n-lon", type=int, default=64)
    parser.add_argument("--surface", type=int, default=10, help="surface arrays")
    parser.add_argument("--levels", type=int, default=3, help="13-level arrays")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--budget-mib", type=float, default=None, help="cache_budget_bytes (default: automatic)"
    )
    args = parser.parse_args(argv)
    tmp = None
    root = args.path
    if root is None:
        tmp = tempfile.TemporaryDirectory()
        root = Path(tmp.name) / "weatherbench.zarr"
    if not root.exists():
        make_weatherbench_like(
            root, n_time=args.n_time, n_lat=args.n_lat, n_lon=args.n_lon,
            surface=args.surface, levels=args.levels,
        )  # fmt: skip
    geoms = {p: g for p, g in open_geometries(root).items() if p not in COORDS}
    names = sorted(geoms)
    per_sample = sum(g.sample_nbytes for g in geoms.values())
    print(
        f"{len(names)} arrays, one time step per chunk: {len(names)} stored objects and "
        f"{per_sample / 2**20:.1f} MiB per sample"
    )
    manifest = split_by_chunk(geoms[TARGET], (0.8, 0.1, 0.1))
    labels = {name: geoms[name] for name in names}
    labels["target"] = geoms[TARGET].shift(1)  # t2m at t + 1
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    pipe = insitu_pipeline(
        root, manifest, labels, batch_size=args.batch_size, cache_budget_bytes=budget
    )

    channels = sum(int(np.prod(g.inner_shape[:-2])) for g in geoms.values())
    model = torch.nn.Sequential(
        torch.nn.Conv2d(channels, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 1, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    oracle = zarr.open_group(root, mode="r")
    scale = {
        name: (float(oracle[name][0].mean()), float(oracle[name][0].std()) + 1e-6) for name in names
    }
    with pipe:
        for epoch in range(args.epochs):
            losses = []
            for i, batch in enumerate(pipe):
                if i == 0:  # zarr's own read is the oracle
                    for label, view in labels.items():
                        want = oracle[view.path][batch.sample_indices[label]]
                        assert np.array_equal(batch.arrays[label], want), label
                t = to_torch(batch)
                x = torch.cat(
                    [
                        ((t[n] - scale[n][0]) / scale[n][1]).reshape(
                            len(batch), -1, *t[n].shape[-2:]
                        )
                        for n in names
                    ],
                    dim=1,
                )
                y = (t["target"] - scale[TARGET][0]) / scale[TARGET][1]
                loss = torch.nn.functional.mse_loss(model(x)[:, 0], y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            report = pipe.report()
            stats = pipe.stats()
            print(f"epoch {epoch}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
            print(report)
            if stats["misses_in_place"]:  # the split does not fit: the straight path
                print(
                    f"  pool peak {stats['resident_peak_bytes'] / 2**20:.1f} MiB: only the "
                    f"target array's chunks ({TARGET}, read by two views) went through slots"
                )
            else:  # small data kept: epochs after the first read nothing
                print(
                    f"  the split is kept in the pool ({stats['resident_peak_bytes'] / 2**20:.1f}"
                    f" MiB): this epoch made {report.gets if report else 0} GETs"
                )
            pipe.reset()
    print("every first batch matched zarr's own read")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
