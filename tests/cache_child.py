"""A child process for the cache tests: ``python cache_child.py CONFIG_JSON``.

It prints one JSON object per line on stdout (``{"event": ...}``) and reads stdin where it is
told to wait, so a test can hold it at a known point, make it go on, or kill it there.

Actions:

* ``"map"``: map ``file`` (a cached ``.npy``) read-only, outside any pipeline — as a process that
  ignores the lock would — and report a digest of it now and again after a line on stdin;
* ``"hold"``: build a pipeline over ``cache_dir`` and keep it (and its lock) until a line on
  stdin, then close it;
* ``"epoch"``: build a pipeline and run epochs; with ``stop_after=n`` stop after ``n`` batches,
  report, and wait to be killed; else report chunk GETs, pool stats, batch digests and the
  last epoch report's hits, misses and corrupt chunks.

A pipeline that fails to build reports ``{"event": "error", "type", "message"}`` and exits 0.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import counting_store

from insitubatch_nodes import applies, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.transforms import DecodedChunk


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


CALLS: list[tuple[str, int]] = []  # (array, chunk) of every AddConstant call in this process


class AddConstant:
    """Adds ``value``; with a ``cache_key`` its cache identity is that key only."""

    def __init__(self, value: float, cache_key: str | None = None) -> None:
        self.value = value
        if cache_key is not None:
            self.cache_key = cache_key

    def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
        CALLS.append((chunk.array, chunk.chunk_index))
        chunk.data += self.value
        return chunk


def build(cfg: dict[str, Any]) -> tuple[Any, Any]:
    store = counting_store(Path(cfg["store"]), delay=cfg.get("delay", 0.0))
    geoms = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    transforms = []
    if cfg.get("add") is not None:
        t = AddConstant(cfg["add"], cfg.get("cache_key"))
        transforms.append(applies(cfg["add_to"], t) if cfg.get("add_to") else t)
    pipe = insitu_pipeline(
        store,
        manifest,
        ["t2m", "z"],
        coords=(),  # the parent counts the store's chunk GETs: no coordinate read at build
        batch_size=cfg.get("batch_size", 8),
        block_chunks=cfg.get("block_chunks", 4),
        seed=cfg.get("seed", 0),
        cache_dir=cfg.get("cache_dir"),
        persist=cfg.get("persist", False),
        readonly_cache=cfg.get("readonly", False),
        reset_stale_cache=cfg.get("reset", False),
        chunk_transforms=transforms,
        **({"verify_cache": cfg["verify"]} if "verify" in cfg else {}),
    )
    return pipe, store


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg["action"] == "map":
        arr = np.load(cfg["file"], mmap_mode="r")
        say(event="ready", digest=digest(arr))
        sys.stdin.readline()
        say(event="done", digest=digest(arr))
        return
    try:
        pipe, store = build(cfg)
    except Exception as exc:
        say(event="error", type=type(exc).__name__, message=str(exc))
        return
    say(event="ready")
    if cfg["action"] == "hold":
        sys.stdin.readline()
        pipe.close()
        say(event="closed")
        return
    digests = []
    for _ in range(cfg.get("epochs", 1)):
        pipe.reset()
        for i, batch in enumerate(pipe):
            digests.append({k: digest(v) for k, v in batch.arrays.items()})
            if cfg.get("stop_after") is not None and i + 1 >= cfg["stop_after"]:
                time.sleep(cfg.get("linger", 0.5))  # let the chunks in flight land
                say(event="stopped", batches=i + 1)
                time.sleep(3600)  # the test kills us here
    stats = pipe.stats()
    last = pipe.report()
    counts = {k: getattr(last, k, None) for k in ("hits", "misses", "corrupt")} if last else None
    pipe.close()
    say(event="done", gets=store.chunk_gets, stats=stats, digests=digests, report=counts)


if __name__ == "__main__":
    main()


def ddp_cache_worker(rank: int, world: int, init_file: str, cfg: dict[str, Any], out: str) -> None:
    """One gloo rank: run ``cfg["epochs"]`` epochs over a shared ``cache_dir`` with an
    ``all_reduce`` per batch; write chunk GETs per epoch, pool stats and sample indices to
    ``out.format(rank)``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        pipe, store = build(cfg)
        result: dict[str, Any] = {"rank": pipe.stages.plan.rank, "epochs": []}
        for _ in range(cfg.get("epochs", 1)):
            store.reset_counts()
            pipe.reset()
            samples: list[int] = []
            arrays: dict[str, list[str]] = {"t2m": [], "z": []}
            for batch in pipe:
                t = torch.ones(1)
                dist.all_reduce(t)
                samples.extend(int(i) for i in batch.sample_indices["t2m"])
                for k in arrays:
                    arrays[k].append(digest(batch.arrays[k]))
            result["epochs"].append(
                {"gets": store.chunk_counts(), "samples": samples, "digests": arrays}
            )
        result["stats"] = pipe.stats()
        pipe.close()
        Path(out.format(rank)).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
