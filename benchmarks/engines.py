"""Measurement children in this project's venv: nodes, workers, xbatcher, memory, rawget, decode.

Run as ``python -m benchmarks.engines CONFIG_JSON RESULT_JSON`` by ``benchmarks/run.py``, one
fresh interpreter per measurement. The config names the engine, the store, the dataset, the
split's samples and the engine's knobs; the result holds one record per epoch (see
``benchmarks/_childutil.py``). Setup that happens before the first epoch (opening the store,
building the pipeline or DataLoader) is timed separately as ``setup_s``.

Engines:

* ``nodes`` — ``insitu_pipeline(...)`` iterated through ``torchdata.nodes.Loader``: a cold epoch,
  then a warm one. ``budget="default"`` keeps the automatic pool budget; ``budget="split"`` sets
  ``cache_budget_bytes`` large enough to hold the whole split, so the warm epoch is pool hits.
  With ``cache_dir`` (the ``cache="persist"`` variant, ``split`` budget) the pipeline keeps the
  chunks it completes in a persistent cache there (``persist=True``); the harness runs it in two
  fresh processes over one folder: ``epoch_kinds=["cold_persist"]`` warms it, then
  ``epoch_kinds=["warm_disk"]`` is epoch 0 of a process that finds it warm (``disk_hits``: the
  chunks revived from it). The pipeline is closed after the epochs (releasing the folder).
* ``workers`` — a map-style Dataset reading one sample (both variables) through zarr per
  ``__getitem__``, in a ``torch.utils.data.DataLoader(shuffle=True)`` with ``num_workers`` spawned
  workers (persistent, so the second epoch is the steady state). ``max_batches`` caps an epoch
  at that many batches of distinct samples drawn from the whole split.
* ``xbatcher`` — ``xbatcher.BatchGenerator`` over ``xarray.open_zarr(...)`` with one sample per
  patch, indexed by a map-style Dataset in the same kind of DataLoader.
* ``memory`` — the split already in RAM; a random permutation gathered batch by batch with
  ``np.take(..., out=)`` into preallocated buffers (the ceiling).
* ``rawget`` — every stored chunk object fetched with ``obstore.get_async`` at 32 in flight, no
  decode (the store's ceiling), with the pipeline's allocator setting (:func:`tune_allocator`).
* ``decode`` — every stored object of the train chunks fetched the same way and decoded with
  ``ChunkDecoder.decode_into`` on the pipeline's default number of decode threads, into
  preallocated destinations that are reused (the fetch + decode ceiling: no pool, no gather),
  with the pipeline's allocator setting.

``decode``, ``rawget`` and the ``workers`` dataset read ``t2m`` and ``z`` unless the config
names other arrays (``variables``; the first anchors the chunks); ``epoch_kinds`` asks the
ceilings for several timed passes in one process. ``benchmarks/archive_engines.py`` (the
archive-shape suite) reuses them so.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):  # pragma: no cover - direct script run
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._childutil import (
    count_batch,
    counting_store,
    finish,
    load_config,
    make_obstore,
    make_zarr_store,
    timed_epoch,
)

VARIABLES = ("t2m", "z")


# --------------------------------------------------------------------------------------------
# nodes (this project)
# --------------------------------------------------------------------------------------------


def run_nodes(cfg: dict[str, Any]) -> dict[str, Any]:
    from torchdata.nodes import Loader

    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
    from insitubatch_nodes.plan.schedule import working_set_bytes

    t0 = time.monotonic()
    store = make_zarr_store(cfg["store"])
    geoms = open_geometries(store, list(VARIABLES))
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    if list(manifest.chunks("train")) != cfg["train_chunks"]:
        raise RuntimeError("the nodes split differs from the harness split")
    budget = None
    if cfg["budget"] == "split":
        from insitubatch_nodes.plan.config import PlanConfig
        from insitubatch_nodes.stages.read_plan import ReadPlanNode

        config = PlanConfig(batch_size=cfg["batch_size"], block_chunks=cfg["block_chunks"])
        plan = ReadPlanNode(manifest, geoms, config=config)
        floor, _ = working_set_bytes(plan.epoch_plan(0), geoms)
        split_bytes = sum(g.chunk_nbytes for g in geoms.values()) * len(cfg["train_chunks"])
        budget = split_bytes + floor
    # Only when asked: the other variants run unchanged on a package without the cache.
    cache: dict[str, Any] = {}
    if cfg.get("cache_dir"):
        cache = {"cache_dir": cfg["cache_dir"], "persist": bool(cfg.get("persist", False))}
    pipe = insitu_pipeline(
        store,
        manifest,
        {"t2m": geoms["t2m"], "z": geoms["z"]},
        batch_size=cfg["batch_size"],
        block_chunks=cfg["block_chunks"],
        max_inflight=cfg["max_inflight"],
        cache_budget_bytes=budget,
        **cache,
    )
    loader = Loader(pipe)
    setup_s = time.monotonic() - t0

    def io() -> dict[str, int]:
        s = pipe.stats()
        keys = ("gets", "bytes_fetched", "hits", "misses", "evictions", "resident_peak_bytes")
        out = {"gets": s["gets"], "bytes": s["bytes_fetched"], **{k: s[k] for k in keys}}
        if "disk_hits" in s:
            out["disk_hits"] = s["disk_hits"]
        return out

    epochs = []
    warm = "warm_cached" if cfg["budget"] == "split" else "warm_default"
    for kind in cfg.get("epoch_kinds") or ["cold", warm]:
        with timed_epoch(kind, cfg.get("proxy_stats_port"), io) as rec:
            for batch in loader:
                count_batch(rec, len(batch), batch.sample_indices["t2m"])
        for key in ("hits", "misses", "disk_hits"):  # the same keys as insitubatch's rows
            if rec.engine_io and key in rec.engine_io:
                rec.extra[key] = rec.engine_io[key]
        epochs.append(rec.as_dict())
    if cache:
        pipe.close()  # releases cache_dir's lock; with persist the chunks stay on disk
    return {"setup_s": setup_s, "epochs": epochs, "budget_bytes": budget}


# --------------------------------------------------------------------------------------------
# workers and xbatcher: map-style datasets in a torch DataLoader
# --------------------------------------------------------------------------------------------


class ZarrSamples:
    """Map-style dataset: item ``i`` is sample ``samples[i]`` of every array in ``variables``
    (default: both variables), read with zarr (``array[t]`` per array), then the sample index.

    The zarr group is opened lazily, once per process (each spawned worker opens its own).
    """

    def __init__(
        self,
        store_cfg: dict[str, Any],
        samples: np.ndarray,
        gets: Any,
        nbytes: Any,
        variables: Sequence[str] = VARIABLES,
    ) -> None:
        self.store_cfg, self.samples = store_cfg, samples
        self.gets, self.nbytes = gets, nbytes
        self.variables = tuple(variables)
        self._arrays: tuple[Any, ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return len(self.samples)

    def _open(self) -> tuple[Any, ...]:
        import zarr

        store = counting_store(make_zarr_store(self.store_cfg), self.gets, self.nbytes)
        group = zarr.open_group(store, mode="r")
        arrays = tuple(group[v] for v in self.variables)
        self._arrays = arrays
        return arrays

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        arrays = self._arrays or self._open()
        t = int(self.samples[i])
        return (*(a[t] for a in arrays), t)


class XbatcherSamples:
    """Map-style dataset over ``xbatcher.BatchGenerator``: patch ``i`` = one time step, the whole
    field and every level, of ``xarray.open_zarr`` (lazy, no dask) restricted to the split."""

    def __init__(
        self,
        store_cfg: dict[str, Any],
        start: int,
        stop: int,
        sizes: dict[str, int],
        gets: Any,
        nbytes: Any,
    ) -> None:
        self.store_cfg, self.start, self.stop, self.sizes = store_cfg, start, stop, sizes
        self.gets, self.nbytes = gets, nbytes
        self._gen: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_gen": None}

    def __len__(self) -> int:
        return self.stop - self.start

    def _open(self) -> Any:
        import xarray as xr
        import xbatcher

        store = counting_store(make_zarr_store(self.store_cfg), self.gets, self.nbytes)
        ds = xr.open_zarr(store, chunks=None, consolidated=False, decode_times=False)
        ds = ds[list(VARIABLES)].isel(time=slice(self.start, self.stop))
        self._gen = xbatcher.BatchGenerator(
            ds, input_dims={"time": 1, **self.sizes}, preload_batch=True
        )
        if len(self._gen) != len(self):
            raise RuntimeError(f"xbatcher made {len(self._gen)} patches, expected {len(self)}")
        return self._gen

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        gen = self._gen or self._open()
        patch = gen[int(i)]
        t2m = np.asarray(patch["t2m"].transpose("time", "lat", "lon").values[0])
        z = np.asarray(patch["z"].transpose("time", "level", "lat", "lon").values[0])
        return t2m, z, self.start + int(i)


def run_torch_loader(cfg: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing as mp

    import torch  # noqa: F401  (imported before the clock: ``setup_s`` excludes it)

    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    gets, nbytes = ctx.Value("q", 0), ctx.Value("q", 0)
    samples = np.asarray(cfg["samples"], dtype=np.int64)
    dataset: Any
    if cfg["engine"] == "workers":
        variables = cfg.get("variables") or VARIABLES
        dataset = ZarrSamples(cfg["store"], samples, gets, nbytes, variables)
    else:
        if not np.array_equal(samples, np.arange(samples[0], samples[-1] + 1)):
            raise RuntimeError("the xbatcher engine expects a contiguous split")
        ds = cfg["dataset"]
        sizes = {"level": ds["n_level"], "lat": ds["n_lat"], "lon": ds["n_lon"]}
        dataset = XbatcherSamples(
            cfg["store"], int(samples[0]), int(samples[-1]) + 1, sizes, gets, nbytes
        )

    def io() -> dict[str, int]:
        return {"gets": int(gets.value), "bytes": int(nbytes.value)}

    return loader_epochs(dataset, cfg, ctx, t0, io)


def loader_epochs(
    dataset: Any,
    cfg: dict[str, Any],
    ctx: Any,
    t0: float,
    io: Callable[[], dict[str, int]] | None,
    kinds: Sequence[str] = ("cold", "warm"),
) -> dict[str, Any]:
    """Epochs of ``dataset`` (items: arrays..., then the sample index) through a
    ``DataLoader(batch_size, RandomSampler(seeded), num_workers, spawn, persistent_workers)``:
    one timed epoch per kind; ``setup_s`` counts from ``t0``."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    n = int(cfg["num_workers"])
    samples = cfg["samples"]
    # shuffle=True is RandomSampler(dataset); an epoch capped at max_batches draws that many
    # batches of distinct samples from a fresh permutation of the whole split, so no worker is
    # left fetching samples past the end of the epoch.
    cap = cfg.get("max_batches")
    generator = torch.Generator().manual_seed(cfg.get("seed", 0))
    n_samples = min(len(samples), cap * cfg["batch_size"]) if cap else None
    loader = DataLoader(
        dataset,
        batch_size=cfg["batch_size"],
        sampler=RandomSampler(dataset, num_samples=n_samples, generator=generator),
        num_workers=n,
        multiprocessing_context=ctx if n > 0 else None,
        persistent_workers=n > 0,
    )
    setup_s = time.monotonic() - t0

    epochs = []
    for kind in kinds:
        with timed_epoch(kind, cfg.get("proxy_stats_port"), io) as rec:
            for *_arrays, index in loader:
                count_batch(rec, int(index.shape[0]), index.tolist())
        epochs.append(rec.as_dict())
    return {"setup_s": setup_s, "epochs": epochs}


# --------------------------------------------------------------------------------------------
# memory: the ceiling
# --------------------------------------------------------------------------------------------


def run_memory(cfg: dict[str, Any]) -> dict[str, Any]:
    import zarr

    t0 = time.monotonic()
    group = zarr.open_group(make_zarr_store(cfg["store"]), mode="r")
    samples = np.asarray(cfg["samples"], dtype=np.int64)
    contiguous = np.array_equal(samples, np.arange(samples[0], samples[0] + len(samples)))
    data = {}
    for v in VARIABLES:
        array = group[v]
        assert isinstance(array, zarr.Array)
        # A slice when the split is one run of samples (zarr 3.1's orthogonal selection on a
        # sharded array peaks at ~10x the result's memory, which would be charged to the epoch).
        if contiguous:
            loaded = array[int(samples[0]) : int(samples[0]) + len(samples)]
        else:
            loaded = array.get_orthogonal_selection(samples)
        data[v] = np.ascontiguousarray(loaded)
    setup_s = time.monotonic() - t0
    bs = int(cfg["batch_size"])
    bufs = {v: np.empty((bs, *a.shape[1:]), dtype=a.dtype) for v, a in data.items()}
    rng = np.random.default_rng(cfg.get("seed", 0))
    epochs = []
    for kind in ("cold", "warm"):
        with timed_epoch(kind, None) as rec:
            perm = rng.permutation(len(samples))
            for start in range(0, len(perm), bs):
                idx = perm[start : start + bs]
                for v, arr in data.items():
                    np.take(arr, idx, axis=0, out=bufs[v][: len(idx)], mode="clip")
                count_batch(rec, len(idx), samples[idx])
        epochs.append(rec.as_dict())
    return {"setup_s": setup_s, "epochs": epochs}


# --------------------------------------------------------------------------------------------
# rawget: the store's ceiling (no decode)
# --------------------------------------------------------------------------------------------


def tune_allocator() -> bool:
    """Apply the pipeline's own allocator setting (``insitubatch_nodes._process.tune_allocator``:
    glibc keeps freed GET buffers for reuse instead of unmapping them), so that a ceiling pays
    for memory what the pipeline pays. False where the package has no such setting or it is not
    in effect (not glibc, or ``INSITUBATCH_NODES_MALLOC_TUNING=0``)."""
    from insitubatch_nodes import _process

    tune = getattr(_process, "tune_allocator", None)
    return bool(tune()) if tune is not None else False


def run_rawget(cfg: dict[str, Any]) -> dict[str, Any]:
    import obstore

    tuned = tune_allocator()
    store = make_obstore(cfg["store"])
    keys = [k for k, _ in cfg["objects"]]
    limit = int(cfg["max_inflight"])

    async def fetch_all() -> int:
        sem = asyncio.Semaphore(limit)

        async def one(key: str) -> int:
            async with sem:
                result = await obstore.get_async(store, key)
                return len(await result.bytes_async())

        return sum(await asyncio.gather(*(one(k) for k in keys)))

    epochs = []
    for kind in cfg.get("epoch_kinds") or ["raw"]:  # one pass unless asked for more
        with timed_epoch(kind, cfg.get("proxy_stats_port")) as rec:
            nbytes = asyncio.run(fetch_all())
            count_batch(rec, 0, None)
        out = rec.as_dict()
        out["extra"] = {"objects": len(keys), "bytes": nbytes, "allocator_tuned": tuned}
        epochs.append(out)
    return {"setup_s": 0.0, "epochs": epochs}


# --------------------------------------------------------------------------------------------
# decode: the fetch + decode ceiling
# --------------------------------------------------------------------------------------------


def _chunk_buffer(g: Any) -> np.ndarray:
    """A chunk buffer laid out as the pipeline lays out its slot: level-major for an array
    stored one level per object (its objects then decode in place, as in the pipeline)."""
    shape = (g.samples_per_chunk, *g.inner_shape)
    if g.one_level_per_object:
        return np.empty((shape[1], shape[0], *shape[2:]), g.dtype).swapaxes(0, 1)
    return np.empty(shape, g.dtype)


def run_decode(cfg: dict[str, Any]) -> dict[str, Any]:
    """GET every stored object of the train chunks (32 in flight) and decode each on
    ``default_decode_threads()`` threads into preallocated, reused chunk buffers.

    Like the pipeline's fetch stage, a GET's in-flight slot is held until its object is decoded
    (at most ``max_inflight`` raw objects in memory). A local store is read the way the fetch
    stage reads one (``insitubatch_nodes.io.localfiles``): on the decode thread, into a buffer that
    thread reuses, right before the decode — without the readahead, as nothing else competes
    for the disk here. Each decode borrows one of ``threads``
    buffer sets (one ``(samples_per_chunk, *inner_shape)`` array per variable, level-major
    for an array stored one level per object as the pipeline's slots are, allocated and
    written once before the timed window), writes its tile's region (``tile_slices``, as
    ``fetch.py`` does) and returns the set: the timed window allocates no destination memory.
    """
    import queue
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    from insitubatch_nodes import open_geometries
    from insitubatch_nodes._runtime import default_decode_threads
    from insitubatch_nodes.io.decode import ChunkDecoder
    from insitubatch_nodes.io.localfiles import LocalReader

    t0 = time.monotonic()
    tuned = tune_allocator()
    variables = list(cfg.get("variables") or VARIABLES)  # the first one anchors the chunks
    geoms = open_geometries(make_zarr_store(cfg["store"]), variables)
    store = make_obstore(cfg["store"])
    decoders = {v: ChunkDecoder(g) for v, g in geoms.items()}
    threads = default_decode_threads()
    buffers: queue.SimpleQueue[dict[str, np.ndarray]] = queue.SimpleQueue()
    for _ in range(threads):
        bufs = {v: _chunk_buffer(g) for v, g in geoms.items()}
        for b in bufs.values():
            b.fill(0)  # first touch outside the timed window
        buffers.put(bufs)
    jobs = [
        (v, chunk, tile, g.store_key(chunk, tile))
        for v, g in geoms.items()
        for chunk in cfg["train_chunks"]
        for tile in g.tiles()
    ]
    ranges = [geoms[variables[0]].chunk_range(c) for c in cfg["train_chunks"]]
    samples = sum(stop - start for start, stop in ranges)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="decode")
    list(pool.map(lambda _: None, range(threads)))  # start the threads before the clock
    limit = int(cfg["max_inflight"])
    setup_s = time.monotonic() - t0

    def decode(v: str, chunk: int, tile: tuple[int, ...], raw: Any) -> None:
        g = geoms[v]
        start, stop = g.chunk_range(chunk)
        bufs = buffers.get()
        try:
            out = bufs[v][: stop - start][(slice(None), *g.tile_slices(tile))]
            decoders[v].decode_into(raw, out, chunk, tile)
        finally:
            buffers.put(bufs)

    reader = LocalReader(cfg["store"]["path"]) if cfg["store"]["kind"] == "local" else None

    def read_decode(v: str, chunk: int, tile: tuple[int, ...], key: str) -> int:
        assert reader is not None
        raw = reader.read(key)
        decode(v, chunk, tile, raw)
        return 0 if raw is None else len(raw)

    async def fetch_decode_all() -> int:
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(limit)

        async def one(v: str, chunk: int, tile: tuple[int, ...], key: str) -> int:
            async with sem:
                if reader is not None:
                    return await loop.run_in_executor(pool, read_decode, v, chunk, tile, key)
                result = await obstore.get_async(store, key)
                raw = await result.bytes_async()
                await loop.run_in_executor(pool, decode, v, chunk, tile, raw)
                return len(raw)

        return sum(await asyncio.gather(*(one(*job) for job in jobs)))

    # ``local_dispatch="threads"`` (a local store only): the decode threads take the objects
    # straight from a shared iterator, with no event loop between them (no per-object task or
    # hand-off): the ceiling at many small objects. Default ``"loop"``: through the event loop.
    threaded = reader is not None and cfg.get("local_dispatch", "loop") == "threads"

    def drain(todo: Iterator[tuple[str, int, tuple[int, ...], str]], lock: Any) -> int:
        nbytes = 0
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return nbytes
            nbytes += read_decode(*job)

    def read_decode_all() -> int:
        import threading

        todo, lock = iter(jobs), threading.Lock()
        return sum(pool.map(lambda _: drain(todo, lock), range(threads)))

    decoded = sum(g.sample_nbytes for g in geoms.values()) * samples
    epochs = []
    for kind in cfg.get("epoch_kinds") or ["decode"]:  # one pass unless asked for more
        with timed_epoch(kind, cfg.get("proxy_stats_port")) as rec:
            nbytes = read_decode_all() if threaded else asyncio.run(fetch_decode_all())
            count_batch(rec, samples, None)
        out = rec.as_dict()
        out["extra"] = {
            "objects": len(jobs),
            "bytes": nbytes,
            "decoded_bytes": decoded,
            "threads": threads,
            "strategy": {v: d.strategy for v, d in decoders.items()},
            "allocator_tuned": tuned,
            "read": "decode thread" if reader is not None else "obstore GET",
            "dispatch": "threads" if threaded else "event loop",
        }
        epochs.append(out)
    pool.shutdown()
    return {"setup_s": setup_s, "epochs": epochs}


RUNNERS = {
    "nodes": run_nodes,
    "workers": run_torch_loader,
    "xbatcher": run_torch_loader,
    "memory": run_memory,
    "rawget": run_rawget,
    "decode": run_decode,
}


def main(argv: list[str]) -> None:
    cfg, result_path = load_config(argv)
    result = RUNNERS[cfg["engine"]](cfg)
    finish(result_path, result)


if __name__ == "__main__":
    # Re-import under the package name so the dataset classes pickle as
    # ``benchmarks.engines.*`` for spawned DataLoader workers (not ``__main__.*``).
    from benchmarks import engines

    engines.main(sys.argv)
