"""What checking the persistent cache's content costs: a warm-cache epoch 0, verify on and off.

Writes (once) the reference ERA5-like store (``benchmarks.datasets.REFERENCE``: ``t2m (2048,
181, 360)`` and ``z (2048, 4, 181, 360)`` float32, 16 samples per chunk, zstd; ``--n-time``
shortens the sample axis), warms a new persistent cache over its train split (80 % of the chunks)
in one process, writes the cache's files back to disk (``fsync``, as ``make bench`` does before
reading a warm cache), then runs epoch 0 of a *fresh process* over the warm cache —
``insitu_pipeline(..., cache_dir=DIR, persist=True)`` through ``torchdata.nodes.Loader``, batch
32, a budget that holds the split — with ``verify_cache=True`` and ``verify_cache=False``
alternately (on, off, off, on, ...), ``--rounds`` times each. Every child checks that it fetched
nothing (every chunk a disk hit). Prints, and with ``--out`` writes, samples/s per run, the
medians and their ratio, and the epoch's process CPU seconds (steadier than the wall time on a
shared machine). Last, the check's own CPU apart from the pipeline (:func:`hash_cost`).

    python -m benchmarks.cache_verify [--root DIR] [--n-time 2048] [--rounds 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __name__ == "__main__" and __package__ in (None, ""):  # pragma: no cover - direct script run
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.datasets import REFERENCE, ensure_dataset
from benchmarks.run import write_back

BATCH_SIZE = 32


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One process: build the pipeline over the cache, run epoch 0, return its numbers."""
    from torchdata.nodes import Loader

    from insitubatch_nodes import insitu_pipeline, open_geometries, open_store, split_by_chunk
    from insitubatch_nodes.plan.config import PlanConfig
    from insitubatch_nodes.plan.schedule import working_set_bytes
    from insitubatch_nodes.stages.read_plan import ReadPlanNode

    store = open_store(cfg["store"])
    geoms = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    plan = ReadPlanNode(manifest, geoms, config=PlanConfig(batch_size=BATCH_SIZE))
    floor, _ = working_set_bytes(plan.epoch_plan(0), geoms)
    split_bytes = sum(g.chunk_nbytes for g in geoms.values()) * len(manifest.chunks("train"))
    pipe = insitu_pipeline(
        store,
        manifest,
        ["t2m", "z"],
        batch_size=BATCH_SIZE,
        cache_budget_bytes=split_bytes + floor,
        cache_dir=cfg["cache_dir"],
        persist=True,
        verify_cache=cfg["verify"],
    )
    samples = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    for batch in Loader(pipe):
        samples += len(batch)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    stats = pipe.stats()
    pipe.close()
    return {
        "verify": cfg["verify"],
        "samples": samples,
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": samples / wall,
        "gets": stats["gets"],
        "disk_hits": stats["disk_hits"],
        "misses": stats["misses"],
        "corrupt": stats["corrupt"],
    }


def run_child(cfg: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cache_verify", "--child", json.dumps(cfg)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def hash_cost(folder: Path, passes: int = 3) -> dict[str, float]:
    """The check's own CPU over every cached file, apart from the pipeline: per pass, each file
    mapped afresh and either touched once per page (the page faults a gather pays anyway) or
    hashed with :func:`~insitubatch_nodes.cache.files.content_sum` (faults and hash); thread CPU
    seconds, median of ``passes`` (alternating)."""
    import mmap

    import numpy as np

    from insitubatch_nodes.cache.files import content_sum

    files = sorted(folder.glob("*.npy"))
    page = mmap.PAGESIZE

    def one(hash_it: bool) -> float:
        t0 = time.thread_time()
        for f in files:
            with open(f, "rb") as fh:
                region = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            data = np.frombuffer(region, dtype=np.uint8)
            if hash_it:
                content_sum(data)
            else:
                int(data[::page].sum())
            del data
            region.close()
        return time.thread_time() - t0

    touch, hashed = [], []
    for _ in range(passes):
        touch.append(one(False))
        hashed.append(one(True))
    nbytes = sum(f.stat().st_size for f in files)
    return {
        "files": len(files),
        "bytes": nbytes,
        "touch_cpu_s": statistics.median(touch),
        "hash_cpu_s": statistics.median(hashed),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="data/bench", help="where the store is written (reused)")
    p.add_argument("--n-time", type=int, default=REFERENCE.n_time)
    p.add_argument("--rounds", type=int, default=4, help="runs with verification on (and off)")
    p.add_argument("--out", help="write the numbers as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return {}

    spec = replace(REFERENCE, n_time=args.n_time)
    t0 = time.perf_counter()
    store, written = ensure_dataset(spec, Path(args.root))
    if written:
        print(f"wrote {store} in {time.perf_counter() - t0:.1f} s", flush=True)
    cache_dir = Path(tempfile.mkdtemp(prefix="cache-verify-", dir=args.root))
    try:
        cfg = {"store": str(store), "cache_dir": str(cache_dir)}
        warmed = run_child({**cfg, "verify": True})  # the first process warms the cache
        sync_s = write_back(cache_dir)
        print(f"warmed {cache_dir} at {warmed['samples_per_s']:,.0f} samples/s; "
              f"written back in {sync_s:.1f} s", flush=True)  # fmt: skip
        runs: list[dict[str, Any]] = []
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for verify in order:
                r = run_child({**cfg, "verify": verify})
                if r["gets"] or r["misses"] or r["corrupt"]:
                    raise RuntimeError(f"the warm cache was not all hits: {r}")
                runs.append(r)
                print(f"verify={verify!s:5}  {r['samples_per_s']:8,.0f} samples/s  wall "
                      f"{r['wall_s']:.3f} s  cpu {r['cpu_s']:.3f} s", flush=True)  # fmt: skip
        cost = hash_cost(cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    on = [r["samples_per_s"] for r in runs if r["verify"]]
    off = [r["samples_per_s"] for r in runs if not r["verify"]]
    cpu_on = [r["cpu_s"] for r in runs if r["verify"]]
    cpu_off = [r["cpu_s"] for r in runs if not r["verify"]]
    result = {
        "store": str(store),
        "n_time": args.n_time,
        "samples_per_epoch": runs[0]["samples"],
        "rounds": args.rounds,
        "runs": runs,
        "median_on": statistics.median(on),
        "median_off": statistics.median(off),
        "ratio": statistics.median(on) / statistics.median(off),
        "range_on": [min(on), max(on)],
        "range_off": [min(off), max(off)],
        "median_cpu_s_on": statistics.median(cpu_on),
        "median_cpu_s_off": statistics.median(cpu_off),
        "hash_cost": cost,
    }
    print(
        f"warm-cache epoch 0: verify on {result['median_on']:,.0f} samples/s "
        f"({min(on):,.0f}-{max(on):,.0f}), off {result['median_off']:,.0f} "
        f"({min(off):,.0f}-{max(off):,.0f}): on/off {result['ratio']:.3f}; process CPU "
        f"{result['median_cpu_s_on']:.3f} s on, {result['median_cpu_s_off']:.3f} s off (medians)"
    )
    print(
        f"the check alone over {cost['files']} files ({cost['bytes'] / 1e9:.2f} GB), fresh "
        f"mappings: {cost['hash_cpu_s']:.3f} CPU-s hashing against {cost['touch_cpu_s']:.3f} "
        "CPU-s touching each page once"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
