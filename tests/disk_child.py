"""A child process for the full-disk and descriptor tests: ``python disk_child.py CONFIG_JSON``.

The pipeline runs here, not in the pytest worker, so a process killed by a signal (SIGBUS from
a write to a mapped page the disk cannot back) is a failed test, not a lost worker. It prints
one JSON object on its last stdout line:

* ``{"event": "done", "exact": ..., "warnings": [...], "runs": [...]}`` — every batch of every
  run was compared with zarr's own read of its samples; per run: batches, pool stats, chunks
  resident at the end (and how many of them are mappings of ``cache_dir`` files), open
  descriptors at the end;
* ``{"event": "error", "type": ..., "message": ...}`` — the pipeline raised (at build or while
  iterating).

Config: ``store``, ``arrays``, ``cache_dir``, ``persist``, ``budget`` (``cache_budget_bytes``),
``batch_size``, ``block_chunks``, ``runs`` (pipelines built one after the other over the same
``cache_dir``, one epoch each), ``nofile`` (an ``RLIMIT_NOFILE`` soft limit set first), and
``keep`` (each run's pipeline stays open, its chunks resident, until the end).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def one_run(cfg: dict[str, Any], oracle: dict[str, np.ndarray], kept: list[Any]) -> dict[str, Any]:
    geoms = open_geometries(cfg["store"], cfg["arrays"])
    manifest = split_by_chunk(geoms[cfg["arrays"][0]], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        cfg["store"],
        manifest,
        cfg["arrays"],
        batch_size=cfg.get("batch_size", 8),
        block_chunks=cfg.get("block_chunks", 4),
        cache_budget_bytes=cfg.get("budget"),
        cache_dir=cfg["cache_dir"],
        persist=cfg.get("persist", False),
        report=False,
    )
    exact, batches = True, 0
    pipe.reset()
    for batch in pipe:
        batches += 1
        for name in cfg["arrays"]:
            want = oracle[name][np.asarray(batch.sample_indices[name])]
            exact = exact and bool(np.array_equal(batch.arrays[name], want))
    pool = pipe.stages.pool
    entries = [pool.lookup(k) for k in pool.resident_keys()]
    mapped = sum(1 for e in entries if e is not None and (e.file or e.cached))
    out = {
        "exact": exact,
        "batches": batches,
        "stats": pipe.stats(),
        "resident": len(entries),
        "mapped": mapped,
        "fds": open_fds(),
    }
    if cfg.get("keep"):
        kept.append(pipe)
    else:
        pipe.close()
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("nofile"):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], hard))
    # zarr's own read of each whole array, once (the arrays are small)
    oracle = {
        name: zarr.open_array(Path(cfg["store"]) / name, mode="r")[:] for name in cfg["arrays"]
    }
    kept: list[Any] = []
    runs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(cfg.get("runs", 1)):
                runs.append(one_run(cfg, oracle, kept))
        except Exception as exc:
            say(event="error", type=type(exc).__name__, message=str(exc), runs=runs)
            return
        finally:
            for pipe in kept:
                pipe.close()
    say(
        event="done",
        exact=all(r["exact"] for r in runs),
        warnings=[f"{w.category.__name__}: {w.message}" for w in caught],
        runs=runs,
    )


if __name__ == "__main__":
    main()
