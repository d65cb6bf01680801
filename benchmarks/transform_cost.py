"""What a StandardScaler costs, placed as a chunk transform, as a batch transform, or nowhere.

Writes (once) the reference ERA5-like store — ``t2m (2048, 181, 360)`` and ``z (2048, 4, 181,
360)`` float32, 16 samples per chunk, blosc-zstd, the same store as ``report_overhead`` — and
builds three pipelines over its train split (80 % of the chunks), identical except for the
scaler:

* ``none`` — no transform;
* ``chunk`` — ``StandardScaler`` (per array, per level for ``z``) in ``chunk_transforms``: on
  the decode threads, once per chunk;
* ``batch`` — the same statistics applied to every batch in a ``batch_transform`` (on the
  producer thread, once per sample a batch holds).

After one warm-up epoch each, the epochs run in rounds of ``none chunk batch batch chunk none``
(so drift on a shared machine hits all three alike). The consumer does nothing with the
batches: the pipeline's own speed is measured. The automatic budget holds one epoch's working
set, so every epoch fetches, decodes (and transforms) the split again — the case where a chunk
transform costs most. It prints the median epoch per placement and the ratios to ``none``.

    python -m benchmarks.transform_cost [--path DIR] [--rounds 3] [--out FILE.json]
    python -m benchmarks.transform_cost --n-time 256 --n-lat 61 --n-lon 120  # a quick try
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from insitubatch_nodes import (
    Batch,
    Loader,
    StandardScaler,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.synthetic import make_era5_like

REFERENCE = {
    "n_time": 2048,
    "n_lat": 181,
    "n_lon": 360,
    "n_level": 4,
    "samples_per_chunk": 16,
    "compressor": "blosc",
}
PLACEMENTS = ("none", "chunk", "batch")


def _epoch(pipe: Any) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one epoch."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in Loader(pipe):
        pass
    return time.perf_counter() - w0, time.process_time() - c0


def _statistics(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-array mean/std (per level for z) from the first 64 samples, read with zarr."""
    group = zarr.open_group(root, mode="r")
    t2m = np.asarray(group["t2m"][:64], dtype=np.float64)
    z = np.asarray(group["z"][:64], dtype=np.float64)
    mean = {"t2m": t2m.mean(), "z": z.mean(axis=(0, 2, 3)).reshape(-1, 1, 1)}
    std = {"t2m": t2m.std(), "z": z.std(axis=(0, 2, 3)).reshape(-1, 1, 1)}
    return mean, std


def batch_scaler(mean: dict[str, Any], std: dict[str, Any]) -> Any:
    """The same arithmetic as the chunk transform, on every batch (labels are array paths)."""
    stats = {
        k: (np.asarray(mean[k], dtype=np.float32), (1.0 / np.asarray(std[k] + 1e-8)).astype("f4"))
        for k in mean
    }

    def scale(batch: Batch) -> Batch:
        for label, arr in batch.arrays.items():
            m, s = stats[label]
            np.subtract(arr, m, out=arr)
            np.multiply(arr, s, out=arr)
        return batch

    return scale


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", default="data/era5_reference_blosc.zarr")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 6 epochs (2 per placement)")
    p.add_argument("--batch-size", type=int, default=32)
    for name in ("n_time", "n_lat", "n_lon"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=REFERENCE[name])
    p.add_argument("--out", help="write the numbers as JSON here")
    args = p.parse_args(argv)

    shape = dict(REFERENCE, n_time=args.n_time, n_lat=args.n_lat, n_lon=args.n_lon)
    root = Path(args.path)
    if not (root / "zarr.json").exists():
        t0 = time.perf_counter()
        make_era5_like(root, **shape)  # type: ignore[arg-type]
        print(f"wrote {root} in {time.perf_counter() - t0:.1f} s", flush=True)
    store = open_store(root)
    geoms = open_geometries(store, ["t2m", "z"])
    if geoms["t2m"].shape != (shape["n_time"], shape["n_lat"], shape["n_lon"]):
        raise SystemExit(f"{root} holds t2m {geoms['t2m'].shape}, not the shape asked for")
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    mean, std = _statistics(root)
    options: dict[str, dict[str, Any]] = {
        "none": {},
        "chunk": {"chunk_transforms": [StandardScaler(mean, std)]},
        "batch": {"batch_transforms": [batch_scaler(mean, std)]},
    }
    pipes = {
        k: insitu_pipeline(store, manifest, geoms, batch_size=args.batch_size, **options[k])
        for k in PLACEMENTS
    }
    for pipe in pipes.values():  # warm the page cache and the pools, not measured
        _epoch(pipe)
    walls: dict[str, list[float]] = {k: [] for k in PLACEMENTS}
    cpus: dict[str, list[float]] = {k: [] for k in PLACEMENTS}
    order = (*PLACEMENTS, *reversed(PLACEMENTS))
    for _ in range(args.rounds):
        for k in order:
            wall, cpu = _epoch(pipes[k])
            walls[k].append(wall)
            cpus[k].append(cpu)
            print(f"{k:6} wall {wall:6.3f} s  cpu {cpu:6.3f} s", flush=True)
    reports = {k: pipes[k].report() for k in PLACEMENTS}
    for pipe in pipes.values():
        pipe.close()
    median = {k: statistics.median(v) for k, v in walls.items()}
    chunk_report = reports["chunk"]
    result = {
        "store": shape,
        "split": "train (0.8)",
        "batch_size": args.batch_size,
        "batches_per_epoch": len(pipes["none"]),
        "rounds": args.rounds,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "wall_s": walls,
        "cpu_s": cpus,
        "median_wall_s": median,
        "ratio_to_none": {k: median[k] / median["none"] for k in PLACEMENTS},
        "chunk_transform_busy_s": chunk_report.transform_s if chunk_report else None,
        "chunks_transformed": chunk_report.transforms if chunk_report else None,
        "reports": {k: r.as_dict() if r else None for k, r in reports.items()},
    }
    r = result["ratio_to_none"]
    print(
        "median epoch: "
        + ", ".join(f"{k} {median[k]:.3f} s" for k in PLACEMENTS)
        + f"  |  chunk/none {r['chunk']:.3f}, batch/none {r['batch']:.3f}, "
        f"chunk/batch {median['chunk'] / median['batch']:.3f}"
    )
    if chunk_report is not None:
        print(
            f"chunk transform: on {chunk_report.transforms} of the "
            f"{chunk_report.hits + chunk_report.misses} chunks the last epoch read (the rest "
            f"were pool hits), {chunk_report.transform_s:.3f} s busy on the decode threads"
        )
        if chunk_report.transforms == 0:
            print("warning: every chunk stayed resident, so this measured hits, not transforms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
