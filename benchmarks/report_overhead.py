"""What the epoch report costs: the same pipeline with ``report=True`` and ``report=False``.

Writes (once) the reference ERA5-like store — ``t2m (2048, 181, 360)`` and ``z (2048, 4, 181,
360)`` float32, 16 samples per chunk, blosc-zstd — then builds four identical pipelines over its
train split (80 % of the chunks), two measuring and two not, in ABBA order, and runs their
epochs in ABBA order too (so drift on a shared machine, and which pool got its memory first,
hit both alike). The consumer does nothing with the batches: the pipeline's own speed is
measured, where any overhead shows most. The automatic budget holds one epoch's working set, so
every epoch fetches and decodes the split again.

It also times the recorder's hooks on their own, per stored object and per batch, and scales
them by the epoch's counts: on a busy machine that bound is far tighter than the A/B difference.

    python -m benchmarks.report_overhead [--path DIR] [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.synthetic import make_era5_like

REFERENCE = {
    "n_time": 2048,
    "n_lat": 181,
    "n_lon": 360,
    "n_level": 4,
    "samples_per_chunk": 16,
    "compressor": "blosc",
}


def _epoch(pipe: Any) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one epoch."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in Loader(pipe):
        pass
    return time.perf_counter() - w0, time.process_time() - c0


def hook_cost(n: int = 20000) -> dict[str, float]:
    """Seconds the recorder's hooks take per stored object and per batch, timed in a loop on a
    real recorder (what the pipeline calls: a GET's start and end, a fill job's submission and
    its decode thread's run, one object each — a run of several objects costs less per
    object; per batch: next, the chunk wait, the gather, the admission counts and the
    hand-over, whose numbers the prefetch stage makes the open epoch's as it returns the
    batch)."""
    from types import SimpleNamespace

    import numpy as np

    from insitubatch_nodes import Batch
    from insitubatch_nodes.pool import ChunkPool
    from insitubatch_nodes.recorder import EpochRecorder

    rec = EpochRecorder(ChunkPool(1 << 20), max_inflight=32, decode_threads=2)
    rec.on_next()
    tally = SimpleNamespace(
        handled=1, submitted=None, spans=None, packed=None, reads=1, read_s=1e-5,
        read_bytes=1000, decodes=1, decode_s=1e-5, queued_s=1e-6, transforms=0,
        transform_s=0.0, run_s=2e-5,
    )  # fmt: skip
    t0 = time.perf_counter()
    for _ in range(n):
        started = rec.on_get_start()
        rec.on_get_end(started, 1000)
        rec.on_fill_submit(1, time.perf_counter())
        rec.on_fill_run(tally)
    per_object = (time.perf_counter() - t0) / n
    batch = Batch(arrays={"x": np.zeros((32, 4))}, sample_indices={}, epoch=0, index=0)
    t0 = time.perf_counter()
    for _ in range(n):
        called = rec.on_next()
        rec.add("chunk_wait_s", time.perf_counter() - called)
        rec.add("gather_s", time.perf_counter() - called)
        rec.on_admit_counts(0, 4, 0)
        rec.open_epoch = rec.on_deliver(called, batch)
    per_batch = (time.perf_counter() - t0) / n
    return {"per_object_s": per_object, "per_batch_s": per_batch}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--path", default="data/era5_reference_blosc.zarr")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 8 epochs (2 per pipeline)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", help="write the numbers as JSON here")
    args = p.parse_args(argv)

    root = Path(args.path)
    if not (root / "zarr.json").exists():
        t0 = time.perf_counter()
        make_era5_like(root, **REFERENCE)  # type: ignore[arg-type]
        print(f"wrote {root} in {time.perf_counter() - t0:.1f} s", flush=True)
    store = open_store(root)
    geoms = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    # Four pipelines built in ABBA order: which pool got its memory first matters (measured:
    # a 5 % steady difference between two pipelines built one after the other, report or not).
    flags = (True, False, False, True)
    pipes = [
        insitu_pipeline(store, manifest, geoms, batch_size=args.batch_size, report=on)
        for on in flags
    ]
    for pipe in pipes:  # warm the page cache and the pools, not measured
        _epoch(pipe)
    walls: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for i in (0, 1, 2, 3, 3, 2, 1, 0):
            wall, cpu = _epoch(pipes[i])
            walls[flags[i]].append(wall)
            cpus[flags[i]].append(cpu)
            print(f"pipeline {i} report={flags[i]!s:5}  wall {wall:6.3f} s  cpu {cpu:6.3f} s")
    last = pipes[0].report()
    for pipe in pipes:
        pipe.close()
    cost = hook_cost()
    hooks_s = cost["per_object_s"] * (last.gets if last else 0) + cost["per_batch_s"] * (
        last.batches if last else 0
    )
    result = {
        "store": REFERENCE,
        "split": "train (0.8)",
        "batches_per_epoch": len(pipes[0]),
        "rounds": args.rounds,
        "wall_s": {"on": walls[True], "off": walls[False]},
        "cpu_s": {"on": cpus[True], "off": cpus[False]},
        "median_wall_overhead": statistics.median(walls[True]) / statistics.median(walls[False])
        - 1,
        "median_cpu_overhead": statistics.median(cpus[True]) / statistics.median(cpus[False]) - 1,
        "mean_wall_overhead": statistics.mean(walls[True]) / statistics.mean(walls[False]) - 1,
        "hook_cost": cost,
        "hooks_s_per_epoch": hooks_s,
        "hooks_share_of_epoch": hooks_s / statistics.median(walls[True]),
        "last_report": last.as_dict() if last else None,
    }
    print(
        f"overhead of the report: wall {100 * result['median_wall_overhead']:+.2f}% (median), "
        f"{100 * result['mean_wall_overhead']:+.2f}% (mean); CPU "
        f"{100 * result['median_cpu_overhead']:+.2f}% (median)"
    )
    print(
        f"hooks: {1e6 * cost['per_object_s']:.1f} us per stored object, "
        f"{1e6 * cost['per_batch_s']:.1f} us per batch -> {1000 * hooks_s:.2f} ms per epoch = "
        f"{100 * result['hooks_share_of_epoch']:.3f}% of the median epoch"
    )
    if last is not None:
        print(last)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
