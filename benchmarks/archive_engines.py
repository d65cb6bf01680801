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
* ``bare_batches`` / ``bare_kept`` (local store only) — the same loop, its decodes landing in
  the rows of a ring of batch buffers, or in a populated slot per object kept for the next
  epoch (whose rows are copied into the ring): the least a loader that hands out batches, or
  that also keeps the split, must do on this machine (:func:`run_bare`).
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

import math
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
# bare: two threads, read + blosc decode into reused buffers, nothing else (and its variants
# that deliver batches, or keep the split, at the least cost this machine allows)
# --------------------------------------------------------------------------------------------

BATCH_RING = 5  # batch buffers in flight, as the nodes engine lends them (prefetch_depth + 2)


def run_bare(cfg: dict[str, Any]) -> dict[str, Any]:
    """The bare loop: the train split's stored objects (paths from zarr's own chunk-key
    encoding, listed before the clock) read whole with an unbuffered ``open().read()`` and
    decoded with ``numcodecs.Blosc().decode(raw, out=...)`` on two threads that split the
    objects between them (every other object). Where the decoded bytes land is ``cfg["into"]``:

    * ``"buffers"`` (``bare``, the issue's ceiling): a per-thread buffer per array, reused for
      every object — it stays in the core's cache, and no batch is made.
    * ``"batches"`` (``bare_batches``): the rows of a batch. A ring of ``BATCH_RING`` batch
      buffers (``batch_size`` rows of every array, made populated inside epoch 0's clock, as a
      fresh process's loader must make its own) stands for the batches a loader has in
      flight; each train sample has a row in it (a seeded permutation of the split, as a
      shuffled epoch places them). At one sample per chunk an object is decoded
      straight into its row; at more, into the thread's buffer, then each row is copied to its
      own. The least any loader that hands out batches must do.
    * ``"kept"`` (``bare_kept``): epoch 0 decodes each object into a slot of its own, an
      anonymous ``mmap`` with ``MAP_POPULATE`` made on the decoding thread inside the timed
      window (the fastest way this machine gives a process fresh memory, see
      ``benchmarks/first_touch.py``), kept for the next epoch, and copies its rows into the
      batch ring as ``"batches"`` does; epoch 1 only copies the kept rows into the ring. The
      least a loader that keeps the split for the next epoch must do in a fresh process.
    """
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs
    import zarr

    into = cfg.get("into", "buffers")
    if into not in ("buffers", "batches", "kept"):
        raise ValueError(f"into={into!r}: one of buffers, batches, kept")
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
        if arr.chunks[1:] != arr.shape[1:]:
            raise ValueError(f"{name}: the bare loop takes whole fields in each stored object")
    spc = arrays[variables[0]].chunks[0]
    samples = [int(s) for s in cfg["samples"]]
    batch = int(cfg.get("batch_size", 32))
    ring = BATCH_RING * batch
    # each sample's row in the batch ring: its place in a seeded shuffle of the split
    order = np.random.default_rng(0).permutation(len(samples))
    row_of = dict(zip(samples, (order % ring).tolist(), strict=True))
    jobs: list[tuple[str, str, list[tuple[int, int]]]] = []
    for chunk in cfg["train_chunks"]:
        start = chunk * spc
        # (row within the chunk, row in the ring) of the chunk's train samples
        rows = [(t - start, row_of[t]) for t in range(start, start + spc) if t in row_of]
        for name, arr in arrays.items():
            for coords in _chunk_coords(arr, chunk):
                key = arr.metadata.encode_chunk_key(coords)
                jobs.append((name, str(root / name / key), rows))
    threads = 2
    shares = [jobs[i::threads] for i in range(threads)]
    codec = numcodecs.Blosc()
    buffers = []
    for _ in range(threads):
        bufs = {name: np.empty(arr.chunks, arr.dtype) for name, arr in arrays.items()}
        for b in bufs.values():
            b.fill(0)  # first touch outside the timed window
        buffers.append(bufs)
    batches: dict[str, np.ndarray] = {}
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

    def make_ring() -> None:
        """The batch buffers, made populated inside epoch 0's clock: a fresh process's loader
        has to obtain its own, and ``MAP_POPULATE`` is the fastest way this machine gives."""
        for name, arr in arrays.items():
            nbytes = ring * arr.dtype.itemsize * math.prod(arr.shape[1:])
            slab = mmap.mmap(-1, nbytes, flags=flags)
            batches[name] = np.frombuffer(slab, arr.dtype).reshape(ring, *arr.shape[1:])

    kept: list[list[tuple[str, Any, np.ndarray, list[tuple[int, int]]]]] = [[] for _ in shares]
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bare")
    list(pool.map(lambda _: None, range(threads)))  # start the threads before the clock
    setup_s = time.monotonic() - t0

    def read(path: str) -> bytes:
        with open(path, "rb", buffering=0) as fh:
            return fh.read()

    def copy_rows(name: str, chunk: np.ndarray, rows: list[tuple[int, int]]) -> None:
        dest = batches[name]
        for j, r in rows:
            dest[r] = chunk[j]

    def work(i: int) -> int:
        bufs = buffers[i]
        nbytes = 0
        for name, path, rows in shares[i]:
            raw = read(path)
            nbytes += len(raw)
            if into == "buffers":
                codec.decode(raw, out=bufs[name])
            elif into == "batches" and spc == 1:
                r = rows[0][1]
                codec.decode(raw, out=batches[name][r : r + 1])
            elif into == "batches":
                codec.decode(raw, out=bufs[name])
                copy_rows(name, bufs[name], rows)
            else:
                arr = arrays[name]
                slot = mmap.mmap(-1, bufs[name].nbytes, flags=flags)
                out = np.frombuffer(slot, arr.dtype).reshape(arr.chunks)
                codec.decode(raw, out=out)
                kept[i].append((name, slot, out, rows))
                copy_rows(name, out, rows)
        return nbytes

    def revisit(i: int) -> int:
        for name, _slot, out, rows in kept[i]:
            copy_rows(name, out, rows)
        return 0

    epochs = []
    for n, kind in enumerate(_kinds(cfg)):
        step = revisit if into == "kept" and n > 0 else work
        with timed_epoch(kind, None) as rec:
            if into != "buffers" and not batches:
                make_ring()
            nbytes = sum(pool.map(step, range(threads)))
            count_batch(rec, len(samples), None)
        out = rec.as_dict()
        out["extra"] = {"objects": len(jobs), "bytes": nbytes, "threads": threads, "into": into}
        if step is revisit:  # nothing read: the kept slots are the epoch's source
            out["extra"]["gets"] = 0
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
    "bare_batches": lambda cfg: run_bare({**cfg, "into": "batches"}),
    "bare_kept": lambda cfg: run_bare({**cfg, "into": "kept"}),
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
