"""Gather time per batch of a channel stack against today's routes (issue 31).

An ARCO-like store (37 levels in each object, 13 selected by value, plus a surface array) is
read warm (a budget that holds the split; the third epoch is timed) four ways: one stack
``x (batch, 27, lat, lon)``, the same stack normalised during the copy, the three members as
separate labels, and separate labels plus a batch transform that concatenates them (the route
of today). Each route runs ``--reps`` times, interleaved; the least gather time per batch
(batch transforms included, from the epoch report) and the best samples/s are printed.

    .venv/bin/python -m benchmarks.stack_gather --spc 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes import (
    Batch,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.synthetic import make_weatherbench_like

LEVELS_13 = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000]


def _concat(batch: Batch) -> Batch:
    arrays = batch.arrays
    x = np.concatenate([arrays["t"], arrays["z"], arrays["t2m"][:, None]], axis=1)
    batch.arrays = {"x": x}
    return batch


def _run(
    root: Path, manifest: Any, views: Mapping[str, Any], transforms: Sequence[Any], bs: int
) -> tuple[float, float, int]:
    """(gather ms per batch, samples/s, batch_buffer_bytes) of the third (warm) epoch."""
    pipe = insitu_pipeline(
        root, manifest, views, batch_size=bs, report=True,
        batch_transforms=list(transforms), cache_budget_bytes=2 * 2**30,
    )  # fmt: skip
    try:
        for epoch in range(3):
            t0, n = time.perf_counter(), 0
            for b in pipe:
                n += len(b)
                del b
            wall = time.perf_counter() - t0
            report = pipe.report()
            if epoch < 2:
                pipe.reset()
        held = pipe.stats()["batch_buffer_bytes"]
    finally:
        pipe.close()
    assert report is not None
    return 1000 * report.gather_s / max(1, report.batches), n / wall, held


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spc", type=int, default=1, help="samples per chunk")
    parser.add_argument("--n-lat", type=int, default=64)
    parser.add_argument("--n-lon", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "arco.zarr"
        make_weatherbench_like(
            root, n_time=128, n_lat=args.n_lat, n_lon=args.n_lon, n_level=37,
            surface=["2m_temperature"], levels=["temperature", "geopotential"],
            samples_per_chunk=args.spc,
        )  # fmt: skip
        g = open_geometries(root)
        members = {
            "t": g["temperature"].sel(level=LEVELS_13),
            "z": g["geopotential"].sel(level=LEVELS_13),
            "t2m": g["2m_temperature"],
        }
        manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
        stats = fit_statistics(root, manifest, members)
        routes: list[tuple[str, dict[str, Any], Sequence[Any]]] = [
            ("stack", {"x": stack(members)}, ()),
            ("stack, normalize=", {"x": stack(members, normalize=stats)}, ()),
            ("separate labels", dict(members), ()),
            ("separate + concatenate", dict(members), (_concat,)),
        ]
        best: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for name, views, transforms in routes:
                ms, sps, held = _run(root, manifest, views, transforms, args.batch_size)
                b = best.setdefault(name, [float("inf"), 0.0, float(held)])
                b[0], b[1] = min(b[0], ms), max(b[1], sps)
        batch_mib = args.batch_size * 27 * args.n_lat * args.n_lon * 4 / 2**20
        print(f"samples per chunk {args.spc}, batch {args.batch_size} ({batch_mib:.2f} MiB)")
        for name, (ms, sps, held) in best.items():
            print(f"  {name:24s} gather {ms:6.2f} ms/batch  {sps:6.0f} samples/s  "
                  f"batch buffers {held / 2**20:.2f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
