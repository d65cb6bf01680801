"""Measurement children of the archive-shape suite (``benchmarks/archive.py``).

Run as ``python -m benchmarks.archive_engines CONFIG_JSON RESULT_JSON``, one fresh interpreter
per measurement, like ``benchmarks/engines.py`` (whose ``decode``, ``rawget`` and zarr
``Dataset`` this module reuses, over any list of arrays). The config names the engine, the
store (``benchmarks._childutil.make_obstore``'s config), the data arrays (``variables``: every
one is a label), the train split (``train_chunks``, ``samples``) and the epochs to time
(``epoch_kinds``, default ``epoch0`` then ``epoch1``); the result holds one record per epoch.

Engines:

* ``nodes`` — ``insitu_pipeline(store, manifest, {name: geometry for every array},
  batch_size=32)`` iterated through ``torchdata.nodes.Loader``; after each epoch the row's
  ``extra.report`` is ``pipe.report().as_dict()`` (the whole dict: limiting stage, decode_s...).
* ``bare`` (local store only) — the loop the issue defines as the ceiling: two threads, each
  reading its half of the train split's stored objects (``open(path, 'rb',
  buffering=0).read()``, paths from zarr's own key encoding) and decoding each with
  ``numcodecs.Blosc().decode(raw, out=buffer)`` into a buffer per array that the thread reuses.
* ``decode`` / ``rawget`` — ``benchmarks.engines.run_decode`` / ``run_rawget`` on the arrays of
  the config: every stored object of the train chunks fetched (a local store read on the decode
  thread) and decoded with ``ChunkDecoder.decode_into`` on ``default_decode_threads()``
  threads; or every stored object of the train split fetched with ``obstore.get_async``, 32 in
  flight, no decode.
* ``zarr`` — ``benchmarks.engines.ZarrSamples`` (``zarr.open_group`` per process, ``array[t]``
  per array) in ``DataLoader(batch_size=32, RandomSampler(seeded), num_workers=N, spawn,
  persistent_workers)``; ``max_batches`` caps an epoch.
* ``tensorstore`` — the same DataLoader over :class:`TensorstoreSamples` (one
  ``ts.open({'driver': 'zarr3', 'kvstore': ...})`` per array, opened lazily in each process).
* ``scale`` — planning on a metadata-only store (every chunk missing): the seconds of
  ``open_geometries``, ``split_by_chunk``, ``insitu_pipeline(...)``, the first batch, and the
  mean per batch over the next ones; the process's ``ru_maxrss``.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):  # pragma: no cover - direct script run
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._childutil import (
    count_batch,
    finish,
    load_config,
    make_zarr_store,
    proc_status_bytes,
    timed_epoch,
)
from benchmarks.engines import ZarrSamples, loader_epochs, run_decode, run_rawget

EPOCHS = ("epoch0", "epoch1")


def _kinds(cfg: dict[str, Any]) -> list[str]:
    return list(cfg.get("epoch_kinds") or EPOCHS)


# --------------------------------------------------------------------------------------------
# nodes (this project)
# --------------------------------------------------------------------------------------------


def run_nodes(cfg: dict[str, Any]) -> dict[str, Any]:
    from torchdata.nodes import Loader

    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

    t0 = time.monotonic()
    variables = list(cfg["variables"])
    store = make_zarr_store(cfg["store"])
    geoms = open_geometries(store, variables)
    manifest = split_by_chunk(geoms[variables[0]], (0.8, 0.1, 0.1))
    if list(manifest.chunks("train")) != cfg["train_chunks"]:
        raise RuntimeError("the nodes split differs from the harness split")
    views = {name: geoms[name] for name in variables}
    pipe = insitu_pipeline(store, manifest, views, batch_size=cfg["batch_size"])
    loader = Loader(pipe)
    setup_s = time.monotonic() - t0

    def io() -> dict[str, int]:
        s = pipe.stats()
        return {"gets": s["gets"], "bytes": s["bytes_fetched"], "hits": s.get("hits", 0)}

    epochs = []
    anchor = variables[0]
    for kind in _kinds(cfg):
        with timed_epoch(kind, cfg.get("proxy_stats_port"), io) as rec:
            for batch in loader:
                count_batch(rec, len(batch), batch.sample_indices[anchor])
        report = pipe.report()
        rec.extra["report"] = report.as_dict() if report is not None else None
        rec.extra["budget_bytes"] = pipe.context.pool.budget_bytes
        epochs.append(rec.as_dict())
    return {"setup_s": setup_s, "epochs": epochs}


# --------------------------------------------------------------------------------------------
# bare: two threads, read + blosc decode into reused buffers, nothing else
# --------------------------------------------------------------------------------------------


def run_bare(cfg: dict[str, Any]) -> dict[str, Any]:
    """The bare loop: the train split's stored objects (paths from zarr's own chunk-key
    encoding, listed before the clock) read whole with an unbuffered ``open().read()`` and
    decoded with ``numcodecs.Blosc().decode(raw, out=...)`` into a per-thread buffer per array,
    on two threads that split the objects between them (every other object)."""
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs
    import zarr

    if cfg["store"]["kind"] != "local":
        raise ValueError("the bare loop reads files: local store only")
    t0 = time.monotonic()
    root = Path(cfg["store"]["path"])
    variables = list(cfg["variables"])
    arrays = {name: zarr.open_array(store=str(root / name), mode="r") for name in variables}
    for name, arr in arrays.items():
        codecs = [type(c).__name__ for c in arr.metadata.codecs]
        if codecs != ["BytesCodec", "BloscCodec"] or arr.dtype.byteorder == ">":
            raise ValueError(f"{name}: the bare loop decodes plain blosc chunks, not {codecs}")
    jobs: list[tuple[str, str]] = []
    for chunk in cfg["train_chunks"]:
        for name, arr in arrays.items():
            for coords in _chunk_coords(arr, chunk):
                key = arr.metadata.encode_chunk_key(coords)
                jobs.append((name, str(root / name / key)))
    threads = 2
    shares = [jobs[i::threads] for i in range(threads)]
    codec = numcodecs.Blosc()
    buffers = []
    for _ in range(threads):
        bufs = {name: np.empty(arr.chunks, arr.dtype) for name, arr in arrays.items()}
        for b in bufs.values():
            b.fill(0)  # first touch outside the timed window
        buffers.append(bufs)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bare")
    list(pool.map(lambda _: None, range(threads)))  # start the threads before the clock
    samples = len(cfg["samples"])
    setup_s = time.monotonic() - t0

    def work(i: int) -> int:
        bufs = buffers[i]
        nbytes = 0
        for name, path in shares[i]:
            with open(path, "rb", buffering=0) as fh:
                raw = fh.read()
            codec.decode(raw, out=bufs[name])
            nbytes += len(raw)
        return nbytes

    epochs = []
    for kind in _kinds(cfg):
        with timed_epoch(kind, None) as rec:
            nbytes = sum(pool.map(work, range(threads)))
            count_batch(rec, samples, None)
        out = rec.as_dict()
        out["extra"] = {"objects": len(jobs), "bytes": nbytes, "threads": threads}
        epochs.append(out)
    pool.shutdown()
    return {"setup_s": setup_s, "epochs": epochs}


def _chunk_coords(arr: Any, chunk: int) -> list[tuple[int, ...]]:
    """Chunk-grid coordinates of every stored object of time chunk ``chunk`` (axis 0)."""
    grid = [-(-n // c) for n, c in zip(arr.shape[1:], arr.chunks[1:], strict=True)]
    out: list[tuple[int, ...]] = [(chunk,)]
    for n in grid:
        out = [(*c, i) for c in out for i in range(n)]
    return out


# --------------------------------------------------------------------------------------------
# decode and rawget: benchmarks.engines' ceilings over the config's arrays, two passes
# --------------------------------------------------------------------------------------------


def run_decode_ceiling(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_decode({**cfg, "epoch_kinds": _kinds(cfg)})


def run_rawget_ceiling(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_rawget({**cfg, "epoch_kinds": _kinds(cfg)})


# --------------------------------------------------------------------------------------------
# peers: zarr and tensorstore per sample in a DataLoader
# --------------------------------------------------------------------------------------------


class TensorstoreSamples:
    """Map-style dataset: item ``i`` is sample ``samples[i]`` of every array, read with
    tensorstore, then the sample index. Each process opens every array once, lazily, in one
    shared ``ts.Context``; ``__getitem__`` starts the reads of all arrays, then waits for them.
    ``store_cfg`` is a local folder (``file`` kvstore) or the S3 stand-in (``s3`` kvstore)."""

    def __init__(self, store_cfg: dict[str, Any], samples: Any, variables: list[str]) -> None:
        self.store_cfg, self.samples, self.variables = store_cfg, samples, list(variables)
        self._arrays: list[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return len(self.samples)

    def _kvstore(self, name: str) -> dict[str, Any]:
        cfg = self.store_cfg
        if cfg["kind"] == "local":
            return {"driver": "file", "path": os.path.join(cfg["path"], name, "")}
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        return {
            "driver": "s3",
            "bucket": cfg["bucket"],
            "path": f"{cfg['prefix']}/{name}/",
            "endpoint": cfg["endpoint"],
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }

    def _open(self) -> list[Any]:
        import tensorstore as ts

        context = ts.Context()
        futures = [
            ts.open({"driver": "zarr3", "kvstore": self._kvstore(name)}, context=context)
            for name in self.variables
        ]
        self._arrays = [f.result() for f in futures]
        return self._arrays

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        arrays = self._arrays or self._open()
        t = int(self.samples[i])
        reads = [a[t].read() for a in arrays]
        return (*(r.result() for r in reads), t)


def run_peer(cfg: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing as mp

    import torch  # noqa: F401  (imported before the clock: ``setup_s`` excludes it)

    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    samples = np.asarray(cfg["samples"], dtype=np.int64)
    io = None
    dataset: Any
    if cfg["engine"] == "zarr":
        gets, nbytes = ctx.Value("q", 0), ctx.Value("q", 0)
        dataset = ZarrSamples(cfg["store"], samples, gets, nbytes, cfg["variables"])

        def io() -> dict[str, int]:
            return {"gets": int(gets.value), "bytes": int(nbytes.value)}

    else:
        dataset = TensorstoreSamples(cfg["store"], samples, cfg["variables"])
    return loader_epochs(dataset, cfg, ctx, t0, io, _kinds(cfg))


# --------------------------------------------------------------------------------------------
# scale: planning on a metadata-only store
# --------------------------------------------------------------------------------------------


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _hwm_bytes() -> int | None:
    """This process's own peak RSS since its ``exec`` (Linux ``VmHWM``), or None (see
    :func:`~benchmarks._childutil.proc_status_bytes`)."""
    return proc_status_bytes("VmHWM")


def run_scale(cfg: dict[str, Any]) -> dict[str, Any]:
    """``open_geometries`` (every data array, found by listing), ``split_by_chunk``,
    ``insitu_pipeline(...)``, ``iter`` + ``next`` (the first batch), then batches until
    ``max_batches`` or ``max_seconds``: the times, and the peak RSS after each step (``VmHWM``
    and ``ru_maxrss``, see :func:`_hwm_bytes`). Monotonic
    stamps let the harness cut its tree sampler to each step."""
    from torchdata.nodes import Loader

    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

    marks: dict[str, float] = {}
    rss: dict[str, int] = {}
    hwm: dict[str, int | None] = {}
    t0 = marks["start"] = time.monotonic()
    rss["start"] = _maxrss_bytes()
    hwm["start"] = _hwm_bytes()
    store = make_zarr_store(cfg["store"])
    geoms = open_geometries(store)
    marks["opened"] = time.monotonic()
    rss["opened"] = _maxrss_bytes()
    hwm["opened"] = _hwm_bytes()
    names = sorted(geoms)
    manifest = split_by_chunk(geoms[names[0]], (0.8, 0.1, 0.1))
    marks["split"] = time.monotonic()
    pipe = insitu_pipeline(store, manifest, geoms, batch_size=cfg["batch_size"])
    marks["built"] = time.monotonic()
    rss["built"] = _maxrss_bytes()
    hwm["built"] = _hwm_bytes()
    it = iter(Loader(pipe))
    first = next(it)
    marks["first"] = time.monotonic()
    rss["first"] = _maxrss_bytes()
    hwm["first"] = _hwm_bytes()
    if not np.isnan(first[names[0]]).all():
        raise RuntimeError("a metadata-only store read something other than the fill value")
    n, limit, cap = 0, float(cfg["max_seconds"]), int(cfg["max_batches"])
    t_more = time.monotonic()
    while n < cap and time.monotonic() - t_more < limit:
        try:
            next(it)
        except StopIteration:
            break
        n += 1
    marks["end"] = time.monotonic()
    rss["end"] = _maxrss_bytes()
    hwm["end"] = _hwm_bytes()
    return {
        "setup_s": 0.0,
        "epochs": [],
        "scale": {
            "arrays": len(geoms),
            "n_time": geoms[names[0]].n_samples,
            "train_samples": len(manifest.samples("train")),
            "open_s": marks["opened"] - t0,
            "split_s": marks["split"] - marks["opened"],
            "build_s": marks["built"] - marks["split"],
            "first_batch_s": marks["first"] - marks["built"],
            "batches_after_first": n,
            "per_batch_s": (marks["end"] - t_more) / n if n else None,
            "ru_maxrss_bytes": rss,
            "hwm_bytes": hwm,
            "marks": marks,
        },
    }


RUNNERS = {
    "nodes": run_nodes,
    "bare": run_bare,
    "decode": run_decode_ceiling,
    "rawget": run_rawget_ceiling,
    "zarr": run_peer,
    "tensorstore": run_peer,
    "scale": run_scale,
}


def main(argv: list[str]) -> None:
    cfg, result_path = load_config(argv)
    result = RUNNERS[cfg["engine"]](cfg)
    finish(result_path, result)


if __name__ == "__main__":
    # Re-import under the package name so the dataset classes pickle as
    # ``benchmarks.archive_engines.*`` for spawned DataLoader workers (not ``__main__.*``).
    from benchmarks import archive_engines

    archive_engines.main(sys.argv)
