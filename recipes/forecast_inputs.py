"""GraphCast-style inputs from an archive as it is stored: 13 of 37 levels, static fields,
forcings, normalised by statistics fitted on the training split.

The store is ARCO-ERA5-like (``make_weatherbench_like`` with 37 levels, every level in one
stored object, one time step per chunk) with a static ``land_sea_mask (latitude, longitude)``
written beside it. The recipe

* selects the 13 WeatherBench2 levels by value (``geom.sel(level=LEVELS_13)``): each stored
  object is decoded once, whole, into the pool, and only the 13 levels reach the batch;
* lets ``open_geometries`` recognise the land-sea mask as static: every batch carries it as a
  ``(batch, lat, lon)`` view of one array (no copy per row);
* fits per-level statistics on the training split (``fit_statistics``, one pass, float64) and
  saves them as JSON;
* adds GraphCast's forcings computed from each row's time (``Forcings(...,
  names=GRAPHCAST_NAMES, convention="graphcast")``): top-of-atmosphere solar radiation over
  the hour ending at the step, and GraphCast's own year progress (seconds since 1970 over
  365.24219-day years) and day progress, as its ``data_utils`` defines them (the radiation's
  Sun and constant irradiance are the package's: docs/model-inputs.md says how far from
  GraphCast's); nothing read for them;
* stacks inputs, mask and forcings into one label ``x (batch, channels, lat, lon)`` and the
  next step into ``y`` (``stack``: each member copied from the pool straight into its channel
  slice and standardised there, no second copy of the batch), checks the first batch against
  zarr, and trains a small convolutional forecaster of the next step for a few batches.

    .venv/bin/python recipes/forecast_inputs.py
    .venv/bin/python recipes/forecast_inputs.py --n-time 128 --n-lat 32 --n-lon 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from insitubatch_nodes import (
    Forcings,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
    to_torch,
)
from insitubatch_nodes.forcings import GRAPHCAST_NAMES, SOLAR_IRRADIANCE
from insitubatch_nodes.synthetic import make_weatherbench_like

LEVELS_13 = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]
PROGNOSTIC = ("temperature", "geopotential", "2m_temperature")


def write_store(root: Path, n_time: int, n_lat: int, n_lon: int) -> None:
    make_weatherbench_like(
        root, n_time=n_time, n_lat=n_lat, n_lon=n_lon, n_level=37,
        surface=["2m_temperature"], levels=["temperature", "geopotential"],
    )  # fmt: skip
    lat = zarr.open_array(root / "latitude")[...]
    lsm = zarr.create_array(
        root / "land_sea_mask", shape=(n_lat, n_lon), chunks=(n_lat, n_lon), dtype="float32",
        dimension_names=("latitude", "longitude"),
    )  # fmt: skip
    lsm[...] = (np.cos(np.radians(lat))[:, None] * np.sin(np.arange(n_lon) / 5.0) > 0.3) * 1.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", type=Path, default=None, help="store (default: a temp folder)")
    parser.add_argument("--n-time", type=int, default=96, help="6-hourly steps, one per chunk")
    parser.add_argument("--n-lat", type=int, default=16)
    parser.add_argument("--n-lon", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="training batches")
    args = parser.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    root = args.path or Path(tmp.name) / "arco_like.zarr"
    if not root.exists():
        write_store(root, args.n_time, args.n_lat, args.n_lon)

    geoms = open_geometries(root)
    print("static arrays:", sorted(p for p, g in geoms.items() if g.static))
    inputs = {
        "temperature": geoms["temperature"].sel(level=LEVELS_13),
        "geopotential": geoms["geopotential"].sel(level=LEVELS_13),
        "2m_temperature": geoms["2m_temperature"],
    }
    constant = {"land_sea_mask": geoms["land_sea_mask"]}
    stored = geoms["temperature"].sample_nbytes
    delivered = inputs["temperature"].sample_nbytes
    print(
        f"temperature: {stored / 2**10:.0f} KiB decoded per step, {delivered / 2**10:.0f} KiB "
        f"delivered ({len(LEVELS_13)} of 37 levels)"
    )
    manifest = split_by_chunk(geoms["temperature"], (0.75, 0.25, 0.0))

    stats = fit_statistics(root, manifest, {**inputs, **constant})
    stats.save(Path(tmp.name) / "stats.json")
    print("temperature mean per level (train):", np.round(stats.mean["temperature"], 1).tolist())
    # the radiation of the hour ending at each step (ERA5's tisr), as GraphCast takes it at its
    # 6-hourly steps too: period="6h" would be another input, six hours' accumulation
    # GraphCast's names and its year and day progress (the default convention counts the
    # calendar year instead, up to 1.8e-3 of a year apart)
    forcings = Forcings("x", view=inputs["temperature"], names=GRAPHCAST_NAMES,
                        convention="graphcast")  # fmt: skip
    # one input tensor and one target tensor; the target (the next step) is standardised with
    # its input's statistics: its members carry the same names
    x = stack({**inputs, **constant, "forcings": forcings}, normalize=stats)
    y = stack({name: view.shift(1) for name, view in inputs.items()}, normalize=stats)
    print("channels:", len(x.channels), x.channels[:2], "...", x.channels[-2:])

    # the first batch, as stored: compared with zarr's own read of the selection
    check = insitu_pipeline(root, manifest, {"x": stack(inputs)}, batch_size=args.batch_size,
                            shuffle=False)  # fmt: skip
    first = next(iter(check))
    check.close()
    rows = first.sample_indices["x"]
    levels = zarr.open_array(root / "level")[...].tolist()
    pick = [levels.index(v) for v in LEVELS_13]
    want = np.concatenate(
        [zarr.open_array(root / "temperature")[rows][:, pick],
         zarr.open_array(root / "geopotential")[rows][:, pick],
         zarr.open_array(root / "2m_temperature")[rows][:, None]], axis=1,
    )  # fmt: skip
    assert np.array_equal(first.arrays["x"], want), "batch differs from zarr"
    print("the first batch matched zarr's own read of the 13 levels, stacked")

    tisr = x.channels.index("toa_incident_solar_radiation")

    def radiation_to_unit(batch: Any) -> Any:  # J m-2 over the hour -> a fraction of the most
        batch.arrays["x"][:, tisr] /= SOLAR_IRRADIANCE * 3600
        return batch

    pipe = insitu_pipeline(root, manifest, {"x": x, "y": y}, batch_size=args.batch_size,
                           batch_transforms=[radiation_to_unit])  # fmt: skip
    model = torch.nn.Sequential(
        torch.nn.Conv2d(len(x.channels), 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, len(y.channels), 1),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    while len(losses) < args.steps:
        pipe.reset()  # a new epoch
        for batch in pipe:
            tensors = to_torch(batch)
            inputs_t, targets_t = tensors["x"], tensors["y"]
            loss = torch.nn.functional.mse_loss(model(inputs_t), targets_t)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == args.steps:
                break
    pipe.close()
    print(f"inputs {tuple(inputs_t.shape)} targets {tuple(targets_t.shape)}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} batches")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
