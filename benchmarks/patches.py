"""Patches from a plane too large to hold: this engine against the usual two ways.

One plane of ``--size``\\ ² float32 (20,000² = 1.6 GB decoded) in ``--tile``\\ ² tiles (zstd),
random ``--patch``\\ ² windows, batches of ``--batch-size``. Each engine runs in a fresh process
(so its peak RSS is its own) over ``--patches`` windows:

* ``nodes``: ``image.patches(..., origins="random")`` under a pool budget of the plan's
  guaranteed floor (or ``--budget-mib``), a whole epoch (every window of the plane once);
  ``nodes-sweep`` the same with ``order="sweep"``; ``nodes-read-once`` the shuffled order
  under a budget of the epoch's read-once floor (every tile read once);
* ``crop``: the whole field per sample + a batch transform cutting ``batch_size`` random
  windows out of it (the workaround patches replace);
* ``tensorstore``: a map-style dataset whose ``__getitem__`` reads one window with
  tensorstore (no chunk cache), ``DataLoader(batch_size, num_workers=0)``.

Reported per engine: windows/s, bytes read from the store, peak RSS; for ``nodes`` also the
stored bytes of every tile its windows touched (the read-once ideal). Ratios are taken within
one run. ``python -m benchmarks.patches [--size 20000] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._childutil import proc_status_bytes

ROOT = Path(__file__).resolve().parent.parent


def write_plane(path: Path, size: int, tile: int) -> None:
    import zarr

    arr = zarr.create_array(
        str(path), name="slide", shape=(1, size, size), chunks=(1, tile, tile), dtype="f4",
        dimension_names=("z", "y", "x"),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    step = 4 * tile
    for y0 in range(0, size, step):
        y = np.arange(y0, min(y0 + step, size), dtype=np.float32)[:, None]
        x = np.arange(size, dtype=np.float32)[None, :]
        band = np.sin(y / 37.0) + np.cos(x / 53.0)
        band += rng.normal(0, 0.05, band.shape).astype("f4")  # a little texture
        arr[0, y0 : y0 + band.shape[0], :] = np.round(band, 2)


def _rss_peak_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` (``ru_maxrss`` may carry the parent's
    peak across fork and exec on Linux), else ``ru_maxrss``."""
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_nodes(
    args: argparse.Namespace, order: str = "shuffled", read_once: bool = False
) -> dict[str, Any]:
    from torchdata.nodes import Loader

    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
    from insitubatch_nodes.plan.config import PlanConfig
    from insitubatch_nodes.plan.patches import unit_chunk_tile
    from insitubatch_nodes.plan.schedule import schedule_floors

    store = str(args.store)
    geom = open_geometries(store, ["slide"])["slide"]
    view = geom.patches({"y": args.patch, "x": args.patch}, origins="random", order=order)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    config = PlanConfig(batch_size=args.batch_size)
    floors = schedule_floors(manifest, {"x": view}, config)
    budget = args.budget_mib * 2**20 if args.budget_mib else floors.guaranteed
    if read_once:  # enough to read this epoch's tiles once (its read-once floor)
        from insitubatch_nodes.plan.epoch import plan_epoch
        from insitubatch_nodes.plan.schedule import slot_geometries, working_set_bytes

        first = plan_epoch(manifest, {"x": view}, config)
        budget = max(budget, working_set_bytes(first, slot_geometries({"x": view}))[0])
    t0 = time.perf_counter()
    pipe = insitu_pipeline(
        store, manifest, {"x": view}, batch_size=args.batch_size, cache_budget_bytes=budget,
        coords=(),
    )  # fmt: skip
    n = 0
    for batch in Loader(pipe):
        n += len(batch)
    wall = time.perf_counter() - t0
    stats = pipe.stats()
    report = pipe.report()
    plan = pipe.stages.plan.epoch_plan(0)
    units = {u for led in plan.ledgers for u in led.chunk.tolist()}
    stored = 0
    for u in units:
        chunk, tile = unit_chunk_tile(geom, u)
        stored += os.path.getsize(Path(store) / geom.store_key(chunk, tile))
    pipe.close()
    return {
        "windows": n,
        "seconds": wall,
        "bytes_read": stats["bytes_fetched"],
        "touched_tiles": len(units),
        "touched_bytes": stored,
        "gets": stats["gets"],
        "budget_bytes": budget,
        "pool_peak_bytes": stats["resident_peak_bytes"],
        "rss_peak_bytes": _rss_peak_bytes(),
        # the gather stage's own time per batch (windows copied out of their tiles)
        "gather_ms_per_batch": 1000 * report.gather_s / max(1, report.batches),
        "limited_by": report.limiting,
    }


def run_crop(args: argparse.Namespace) -> dict[str, Any]:
    from insitubatch_nodes import Batch, insitu_pipeline, open_geometries, split_by_chunk

    store = str(args.store)
    geom = open_geometries(store, ["slide"])["slide"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    rng = np.random.default_rng(0)
    p, bs = args.patch, args.batch_size

    def crop(batch: Batch) -> Batch:
        field = batch.arrays["x"][0]
        o = rng.integers(0, field.shape[0] - p + 1, size=(bs, 2))
        batch.arrays["x"] = np.stack([field[y : y + p, x : x + p] for y, x in o.tolist()])
        return batch

    t0 = time.perf_counter()
    pipe = insitu_pipeline(
        store, manifest, {"x": geom}, batch_size=1, batch_transforms=[crop], coords=()
    )
    n = 0
    while n < args.crop_windows:
        pipe.reset()
        for batch in pipe:
            n += len(batch.arrays["x"])
    wall = time.perf_counter() - t0
    stats = pipe.stats()
    pipe.close()
    return {
        "windows": n,
        "seconds": wall,
        "bytes_read": stats["bytes_fetched"],
        "rss_peak_bytes": _rss_peak_bytes(),
    }


def run_tensorstore(args: argparse.Namespace) -> dict[str, Any]:
    import tensorstore as ts
    import torch
    from torch.utils.data import DataLoader, Dataset

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(args.store / "slide")}}
    arr = ts.open(spec, read=True).result()
    size, p = arr.shape[1], args.patch
    origins = np.random.default_rng(0).integers(0, size - p + 1, size=(args.ts_windows, 2))

    class Windows(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(origins)

        def __getitem__(self, i: int) -> torch.Tensor:
            y, x = origins[i].tolist()
            return torch.from_numpy(arr[0, y : y + p, x : x + p].read().result())

    t0 = time.perf_counter()
    n = 0
    for batch in DataLoader(Windows(), batch_size=args.batch_size, num_workers=0):
        n += len(batch)
    wall = time.perf_counter() - t0
    tile = args.tile
    touched = {
        (y // tile + dy, x // tile + dx)
        for y, x in origins.tolist()
        for dy in range(2)
        for dx in range(2)
        if (y // tile + dy) * tile < y + p and (x // tile + dx) * tile < x + p
    }
    # tensorstore reads every tile a window touches, once per window (no cache)
    per_window = sum(
        ((y + p - 1) // tile - y // tile + 1) * ((x + p - 1) // tile - x // tile + 1)
        for y, x in origins.tolist()
    )
    mean_obj = np.mean(
        [os.path.getsize(f) for f in (args.store / "slide" / "c" / "0").rglob("*") if f.is_file()]
    )
    return {
        "windows": n,
        "seconds": wall,
        "bytes_read": int(per_window * mean_obj),
        "touched_tiles": len(touched),
        "rss_peak_bytes": _rss_peak_bytes(),
    }


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    return run_nodes(args, order="sweep")


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    return run_nodes(args, read_once=True)


ENGINES = {
    "nodes": run_nodes,
    "nodes-sweep": run_sweep,
    "nodes-read-once": run_once,
    "crop": run_crop,
    "tensorstore": run_tensorstore,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--tile", type=int, default=512)
    ap.add_argument("--patch", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--budget-mib", type=int, default=0, help="0: the plan's guaranteed floor")
    ap.add_argument("--crop-windows", type=int, default=256, help="windows the crop engine cuts")
    ap.add_argument("--ts-windows", type=int, default=1600, help="windows tensorstore reads")
    ap.add_argument("--store", type=Path, default=Path("/tmp/insitu-bench/patch-plane.zarr"))
    ap.add_argument("--engine", choices=sorted(ENGINES))
    ap.add_argument(
        "--engines",
        nargs="+",
        default=["nodes", "nodes-sweep", "nodes-read-once", "tensorstore", "crop"],
    )
    ap.add_argument("--out", type=Path, default=None, help="append a JSONL record here")
    args = ap.parse_args(argv)
    if args.engine:  # a child: one engine, one JSON line
        print(json.dumps(ENGINES[args.engine](args)))
        return 0
    if not (args.store / "zarr.json").exists():
        t0 = time.perf_counter()
        args.store.parent.mkdir(parents=True, exist_ok=True)
        write_plane(args.store, args.size, args.tile)
        print(f"wrote a {args.size:,}^2 plane in {time.perf_counter() - t0:.0f} s", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for name in args.engines:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.patches", "--engine", name, *_child_args(args)],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 1
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = rows[name]
        print(
            f"{name:12s} {r['windows'] / r['seconds']:8.1f} windows/s  "
            f"read {r['bytes_read'] / 2**20:8.1f} MiB  "
            f"peak RSS {r['rss_peak_bytes'] / 2**20:7.0f} MiB"
            + (
                f"  (tiles touched {r['touched_tiles']}, {r['touched_bytes'] / 2**20:.1f} MiB "
                f"stored; pool peak {r['pool_peak_bytes'] / 2**20:.0f} MiB of a "
                f"{r['budget_bytes'] / 2**20:.0f} MiB budget)"
                if name.startswith("nodes")
                else ""
            ),
            flush=True,
        )
    if {"crop", "tensorstore"} <= set(rows):
        crop, tsr = rows["crop"], rows["tensorstore"]
        for name in [n for n in rows if n.startswith("nodes")]:
            nodes = rows[name]
            ratios = {
                "rss_vs_crop": nodes["rss_peak_bytes"] / crop["rss_peak_bytes"],
                "read_vs_touched": nodes["bytes_read"] / nodes["touched_bytes"],
                "speed_vs_tensorstore": (nodes["windows"] / nodes["seconds"])
                / (tsr["windows"] / tsr["seconds"]),
            }
            print(f"{name} ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
            nodes["ratios"] = ratios
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        record = {
            "size": args.size,
            "tile": args.tile,
            "patch": args.patch,
            "batch_size": args.batch_size,
            **rows,
        }
        with open(args.out / f"patches-{stamp}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


def _child_args(args: argparse.Namespace) -> list[str]:
    return [
        "--size", str(args.size), "--tile", str(args.tile), "--patch", str(args.patch),
        "--batch-size", str(args.batch_size), "--budget-mib", str(args.budget_mib),
        "--crop-windows", str(args.crop_windows), "--ts-windows", str(args.ts_windows),
        "--store", str(args.store),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
