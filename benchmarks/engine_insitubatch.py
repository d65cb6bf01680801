"""Measurement child for the predecessor, ``insitubatch`` 0.2.0 (PyPI), in its own venv.

insitubatch needs Python >= 3.12 and does not use torch, so ``benchmarks/run.py`` runs this
file with the interpreter of ``benchmarks/.venv-insitubatch`` (see
``benchmarks/insitubatch_env.py``): ``python engine_insitubatch.py CONFIG_JSON RESULT_JSON``.
It imports nothing from this project but ``_childutil`` (stdlib only), found next to it.

Configuration mirrors the ``nodes`` engine: the same store (obstore-backed zarr store), the same
train split (the harness's chunk lists, passed in), both variables, ``batch_size``,
``block_chunks``, ``max_inflight``; ``budget="default"`` leaves ``cache_budget_bytes`` to the
library (its residency floor), ``budget="split"`` makes it large enough to keep the whole split,
so the second epoch is served from the pool. Batches are iterated straight from
``dataset.train`` (numpy; its documented torch path wraps that same iterator).

The persistent cache (``cache="persist"``, with ``cache_dir``): ``InSituDataset(...,
cache_dir=DIR, persist=True)`` with the ``split`` budget (insitubatch deletes a persisted file
when the budget evicts its slot, so only a budget that holds the split keeps all of it on disk).
The harness runs it twice over one folder, in two fresh processes: ``epoch_kinds=["cold_persist"]``
warms the cache, then ``epoch_kinds=["warm_disk"]`` is epoch 0 of a process that finds it warm.
The dataset is closed after the epochs (releasing the folder's lock); a fresh process's hits
are chunks revived from the folder, reported as ``disk_hits``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _childutil as cu

VARIABLES = ["t2m", "z"]


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import insitubatch
    from insitubatch import InSituDataset, SplitManifest, open_geometries

    t0 = time.monotonic()
    gets, nbytes = cu.LocalCounter(), cu.LocalCounter()
    store = cu.counting_store(cu.make_zarr_store(cfg["store"]), gets, nbytes)
    geoms = open_geometries(store, VARIABLES)
    spc = geoms["t2m"].sample_chunk_size
    n_samples = geoms["t2m"].n_samples
    manifest = SplitManifest(
        n_chunks=geoms["t2m"].n_chunks,
        sample_chunk_size=spc,
        n_samples=n_samples,
        chunks={k: list(v) for k, v in cfg["split_chunks"].items()},
        seed=0,
    )
    budget = None
    if cfg["budget"] == "split":
        sample_bytes = sum(
            int(g.dtype.itemsize) * int(_prod(g.inner_shape)) for g in geoms.values()
        )
        split_bytes = sample_bytes * spc * len(cfg["split_chunks"]["train"])
        budget = 2 * split_bytes + (64 << 20)  # the whole split, plus its residency floor
    dataset = InSituDataset(
        store,
        manifest,
        geometries=geoms,
        batch_size=cfg["batch_size"],
        block_chunks=cfg["block_chunks"],
        max_inflight=cfg["max_inflight"],
        seed=cfg.get("seed", 0),
        cache_budget_bytes=budget,
        cache_dir=cfg.get("cache_dir"),
        persist=bool(cfg.get("persist", False)),
    )
    setup_s = time.monotonic() - t0

    def io() -> dict[str, int]:
        return {"gets": gets.value, "bytes": nbytes.value}

    epochs = []
    warm = "warm_cached" if cfg["budget"] == "split" else "warm_default"
    kinds = cfg.get("epoch_kinds") or ["cold", warm]
    for epoch, kind in enumerate(kinds):
        dataset.set_epoch(epoch)
        with cu.timed_epoch(kind, cfg.get("proxy_stats_port"), io) as rec:
            for batch in dataset.train:
                cu.count_batch(rec, len(batch), batch.sample_indices)
        rec.extra["hits"] = dataset.cache_hits  # per pass (these reset every pass)
        rec.extra["misses"] = dataset.cache_misses
        if cfg.get("persist") and epoch == 0:
            # Epoch 0 of a fresh process: nothing is resident yet, so every hit is a chunk
            # revived from cache_dir (insitubatch does not count those apart).
            rec.extra["disk_hits"] = dataset.cache_hits
        epochs.append(rec.as_dict())
    if cfg.get("cache_dir"):
        dataset.close()  # releases cache_dir's lock; with persist the files stay
    return {
        "setup_s": setup_s,
        "epochs": epochs,
        "budget_bytes": dataset.cache_budget_bytes,
        "block_chunks_used": dataset.block_chunks,
        "version": insitubatch.__version__,
    }


def _prod(shape: Any) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def main() -> None:
    cfg, result_path = cu.load_config(sys.argv)
    cu.finish(result_path, run(cfg))


if __name__ == "__main__":
    main()
