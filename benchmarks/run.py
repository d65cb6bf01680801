"""The side-by-side benchmark harness: ``python -m benchmarks.run --suite full|smoke``.

One measurement = one engine, one store, one dataset, one repeat, one variant (pool budget or
worker count), run in a fresh interpreter (``benchmarks/engines.py``, or
``benchmarks/engine_insitubatch.py`` in the predecessor's own venv). The harness

1. writes the suite's datasets once (``benchmarks/data/``; reused when their spec matches);
2. starts a moto S3 server on 127.0.0.1, uploads the datasets once, and puts a counting latency
   proxy (``--latency-ms``) in front of it: every engine reads "s3" through the proxy, which
   counts requests and bytes for all of them;
3. measures two ceilings of each (store, dataset) once: ``rawget`` (every stored chunk object,
   ``obstore.get_async`` at 32 in flight, no decode) and ``decode`` (every stored object of the
   train chunks fetched the same way and decoded on the pipeline's default decode threads into
   preallocated, reused buffers) — for the suite's ``ceilings_every_round`` datasets (the
   reference shape) in every round instead, right before that round's engines on it;
4. sweeps the per-sample loaders' worker counts once per store on the tuning dataset and keeps
   the best (by warm samples/s) for the rounds;
5. runs ``--repeats`` rounds; in each round, for every store and dataset, the engines in an
   order that rotates from round to round; a tree sampler in the harness records the RSS of
   each child's whole process tree; past the suite's time budget it records skips instead;
   on the suite's ``persist_datasets`` nodes and insitubatch also run their persistent chunk
   cache: one child warms a fresh cache folder (``cold_persist``), a second fresh child reads
   its epoch 0 from it (``warm_disk``), then the folder is deleted;
6. appends one JSONL row per (measurement, epoch kind) to
   ``<out>/bench-<suite>-<UTC time>.jsonl`` (plus ``run``/``end`` rows, ``rawget`` and
   ``decode`` rows, ``best_workers`` rows, and ``skip``/``error`` rows that say why).

``benchmarks/report.py`` turns the JSONL into ``docs/benchmarks.md`` and the plots.
``--check`` asserts that every available engine produced complete rows (the smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import insitubatch_env
from benchmarks.datasets import (
    REFERENCE,
    SUITES,
    DatasetSpec,
    chunk_sizes,
    ensure_dataset,
    needed_bytes,
)
from benchmarks.datasets import object_keys as list_objects
from benchmarks.sampler import TreeSampler, rss_source

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("nodes", "insitubatch", "workers", "xbatcher", "memory")
STORES = ("local", "s3")
REQUIRED_FIELDS = (
    "engine",
    "store",
    "dataset",
    "repeat",
    "epoch_kind",
    "samples",
    "wall_s",
    "samples_per_s",
    "decoded_MB_per_s",
    "ttfb_s",
    "rss_peak_MB",
    "cpu_s",
    "gets",
    "bytes_fetched",
    "needed_bytes",
    "read_amplification",
    "shuffle_quality",
    "config",
)
ALWAYS_AVAILABLE = ("nodes", "workers", "memory")
CEILINGS = ("rawget", "decode")  # per store and dataset: before the rounds, or in every round


@dataclass
class Suite:
    name: str
    datasets: list[DatasetSpec]
    repeats: int
    worker_counts: tuple[int, ...]
    child_timeout_s: float
    # The per-sample loaders (workers, xbatcher) cost several seconds of worker start-up per
    # process on 2 cores, and tens of seconds per epoch through the S3 stand-in: they sweep their
    # worker counts once per store, on ``tune_dataset``, then run the best count on
    # ``per_sample_datasets[store]`` only, with epochs of ``per_sample_batches`` batches.
    tune_dataset: str
    per_sample_datasets: dict[str, tuple[str, ...]]
    per_sample_batches: int | None
    # Past ``soft_budget_s`` the per-sample loaders are skipped, past ``hard_budget_s`` every
    # engine is (each skip is recorded): the suite ends in time whatever the machine's load.
    soft_budget_s: float | None = None
    hard_budget_s: float | None = None
    # The ceilings of these datasets are measured in every round, right before its engines (the
    # targets' ratios pair an epoch with its own round's ceiling); the others' once, up front.
    ceilings_every_round: tuple[str, ...] = ()
    # Where nodes and insitubatch also run their persistent chunk cache (store -> datasets):
    # a warming process, then a fresh process whose epoch 0 reads the warm cache.
    persist_datasets: dict[str, tuple[str, ...]] = field(default_factory=dict)


def make_suite(name: str) -> Suite:
    if name == "smoke":
        return Suite(
            "smoke",
            SUITES["smoke"],
            repeats=1,
            worker_counts=(1,),
            child_timeout_s=180,
            tune_dataset="smoke-spc8",
            per_sample_datasets={"local": ("smoke-spc8",), "s3": ("smoke-spc8",)},
            per_sample_batches=None,
            persist_datasets={"local": ("smoke-spc8",)},
        )
    return Suite(
        "full",
        SUITES["full"],
        repeats=3,
        worker_counts=(0, 1, 2, 4),
        child_timeout_s=420,
        tune_dataset="spc16",
        per_sample_datasets={"local": ("spc1", "spc16", "spc32"), "s3": ("spc1", "spc16")},
        per_sample_batches=4,
        # The reference shape (first in every round) adds ~6 minutes on an idle 2-core machine
        # (~11 loaded) to the spc series' ~10: past these the later cells are skipped instead.
        soft_budget_s=24 * 60,
        hard_budget_s=28 * 60,
        ceilings_every_round=(REFERENCE.name,),
        # A warm cache's epoch reads no store: one store is enough (the warming epoch on
        # `local` is the cheap one). Each round adds ~4 processes on the reference shape.
        persist_datasets={"local": (REFERENCE.name,)},
    )


PER_SAMPLE = ("workers", "xbatcher")
POOL_VARIANTS = ("default", "split", "persist")  # what nodes and insitubatch run (--variants)
PERSIST = {"budget": "split", "cache": "persist"}


# --------------------------------------------------------------------------------------------
# machine and versions
# --------------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": cpu,
        "cores": cores,
        "ram_bytes": mem,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {
            name: _dist_version(name)
            for name in (
                "insitubatch_nodes",
                "torch",
                "torchdata",
                "zarr",
                "numpy",
                "numcodecs",
                "obstore",
                "moto",
                "xarray",
                "xbatcher",
                "psutil",
                "matplotlib",
            )
        },
        "rss_source": rss_source(),
    }


def insitubatch_versions(python: str) -> dict[str, Any]:
    code = (
        "import json, platform, importlib.metadata as m; print(json.dumps({'python': "
        "platform.python_version(), **{n: m.version(n) for n in "
        "('insitubatch', 'zarr', 'numpy', 'obstore')}}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-300:]}


# --------------------------------------------------------------------------------------------
# S3: moto + counting latency proxy
# --------------------------------------------------------------------------------------------

BUCKET = "bench"


def upload_dataset(path: Path, prefix: str, endpoint: str) -> int:
    """Upload every file of a dataset folder to ``s3://bench/PREFIX/`` (16 PUTs in flight)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        prefix=prefix,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        client_options={"allow_http": True},
    )
    files = [p for p in sorted(path.rglob("*")) if p.is_file()]

    async def put_all() -> None:
        sem = asyncio.Semaphore(16)

        async def one(file: Path) -> None:
            async with sem:
                await obstore.put_async(store, file.relative_to(path).as_posix(), file.read_bytes())

        await asyncio.gather(*(one(f) for f in files))

    asyncio.run(put_all())
    return len(files)


@contextlib.contextmanager
def s3_endpoint(datasets: dict[str, Path], latency_ms: float) -> Iterator[tuple[Any, Any]]:
    """moto on loopback with every dataset uploaded, behind a counting latency proxy."""
    import boto3

    from benchmarks.proxy import CountingLatencyProxy
    from insitubatch_nodes.testing import MotoServer

    with MotoServer() as moto:
        boto3.client(
            "s3",
            endpoint_url=moto.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=BUCKET)
        t0 = time.monotonic()
        n = sum(upload_dataset(path, prefix, moto.endpoint) for prefix, path in datasets.items())
        print(f"[bench] uploaded {n} objects to moto in {time.monotonic() - t0:.1f} s")
        proxy = CountingLatencyProxy(moto.port, delay_s=latency_ms / 1000.0, server_pid=moto.pid)
        try:
            yield moto, proxy
        finally:
            proxy.stop()


# --------------------------------------------------------------------------------------------
# running one child
# --------------------------------------------------------------------------------------------


@dataclass
class ChildResult:
    result: dict[str, Any] | None
    rc: int | None
    wall_s: float
    sampler: TreeSampler
    log_tail: str
    timed_out: bool


def run_child(cmd: list[str], cfg: dict[str, Any], tmp: Path, timeout_s: float) -> ChildResult:
    cfg_path = tmp / "config.json"
    res_path = tmp / "result.json"
    log_path = tmp / "child.log"
    res_path.unlink(missing_ok=True)
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*cmd, str(cfg_path), str(res_path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        sampler = TreeSampler(proc.pid)
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        except BaseException:  # interrupted: take the child (and its workers) down with us
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            sampler.stop()
    # A spawned worker that outlives its parent would keep its session: end it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - t0
    result = json.loads(res_path.read_text()) if res_path.is_file() else None
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.is_file() else ""
    return ChildResult(result, rc, wall, sampler, tail, timed_out)


# --------------------------------------------------------------------------------------------
# the harness
# --------------------------------------------------------------------------------------------


@dataclass
class DatasetInfo:
    spec: DatasetSpec
    path: Path
    split_chunks: dict[str, list[int]]
    samples: list[int]
    needed: int
    sizes: dict[str, dict[int, int]]
    stored_bytes: int
    objects: list[tuple[str, int]]


def prepare_dataset(spec: DatasetSpec, data_dir: Path) -> tuple[DatasetInfo, float | None]:
    from insitubatch_nodes import open_geometries, split_by_chunk

    t0 = time.monotonic()
    path, written = ensure_dataset(spec, data_dir)
    gen_s = time.monotonic() - t0 if written else None
    geom = open_geometries(path, ["t2m"])["t2m"]
    if geom.samples_per_chunk != spec.anchor_spc:
        raise RuntimeError(f"{spec.name}: anchor grid {geom.samples_per_chunk} != spec")
    manifest = split_by_chunk(geom, (0.8, 0.1, 0.1))
    split_chunks = {s: list(manifest.chunks(s)) for s in ("train", "val", "test")}
    samples = [int(s) for s in manifest.samples("train")]
    sizes = chunk_sizes(path)
    objects = list_objects(path)
    info = DatasetInfo(
        spec,
        path,
        split_chunks,
        samples,
        needed_bytes(sizes, samples, spec.anchor_spc),
        sizes,
        sum(n for _, n in objects),
        objects,
    )
    return info, gen_s


def write_back(folder: Path) -> float:
    """Write every file of ``folder`` to disk (``fsync`` each); the seconds it took.

    A persistent cache just warmed leaves its chunks as dirty page cache; a process started at
    once would read them while the kernel writes them back, which is the warming run's cost, not
    the reader's (measured at the reference shape: a warm-cache epoch 0 at 4,030-4,270
    samples/s read right away, 4,700-5,950 after a sync).
    """
    t0 = time.monotonic()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.monotonic() - t0


class Harness:
    def __init__(self, args: argparse.Namespace, suite: Suite, out: Path) -> None:
        self.args, self.suite = args, suite
        self.run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.out_path = out / f"bench-{suite.name}-{self.run_id}.jsonl"
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-child-"))
        self.rows: list[dict[str, Any]] = []
        self.best_workers: dict[tuple[str, str], int] = {}
        self.insitubatch_python: str | None = None
        self.proxy: Any = None
        self.t_run = time.monotonic()

    # -- output --------------------------------------------------------------------------------
    def emit(self, row: dict[str, Any]) -> None:
        row = {"run_id": self.run_id, "suite": self.suite.name, **row}
        self.rows.append(row)
        with open(self.out_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def skip(self, engine: str, reason: str, **where: Any) -> None:
        print(f"[bench] SKIP {engine} {where or ''}: {reason}")
        self.emit({"type": "skip", "engine": engine, "reason": reason, **where})

    # -- config --------------------------------------------------------------------------------
    def base_config(self, info: DatasetInfo) -> dict[str, Any]:
        return {
            "batch_size": 32,
            "block_chunks": 16,
            "max_inflight": 32,
            "seed": 0,
            "latency_ms": self.args.latency_ms,
            "dataset": info.spec.to_json(),
        }

    def store_config(self, store: str, info: DatasetInfo) -> tuple[dict[str, Any], int | None]:
        if store == "local":
            return {"kind": "local", "path": str(info.path)}, None
        proxy = self.proxy
        cfg = {"kind": "s3", "bucket": BUCKET, "prefix": info.spec.folder}
        return {**cfg, "endpoint": proxy.endpoint}, proxy.stats_port

    # -- one measurement -----------------------------------------------------------------------
    def measure(
        self,
        engine: str,
        store: str,
        info: DatasetInfo,
        repeat: int,
        variant: dict[str, Any],
        phase: str = "round",
    ) -> None:
        where = {"store": "ram" if engine == "memory" else store, "dataset": info.spec.name}
        over = self.over_budget(engine)
        if over:
            self.skip(engine, over, **where, repeat=repeat, variant=variant)
            return
        if variant.get("cache") == "persist":
            self.measure_persist(engine, store, info, repeat, variant, phase)
        else:
            self.run_measurement(engine, store, info, repeat, variant, phase)

    def measure_persist(
        self,
        engine: str,
        store: str,
        info: DatasetInfo,
        repeat: int,
        variant: dict[str, Any],
        phase: str,
    ) -> None:
        """The persistent chunk cache, in two fresh processes over one new folder: the first
        runs one epoch with ``persist=True`` (``cold_persist``: it warms the folder), the second
        is a new process over the warm folder whose epoch 0 (``warm_disk``) is served from it.
        Between the two, the folder's dirty pages are written back to disk (:func:`write_back`),
        so the reading process finds the files as a later run finds them: on disk and in the
        page cache, with no writeback of the warming process's 2 GB competing for the cores.
        The folder (under the harness's temporary folder, on local disk unless ``TMPDIR`` says
        otherwise) is deleted afterwards; its size after warming, and the seconds the write-back
        took, are on the ``warm_disk`` row (``cache_dir_bytes``, ``write_back_s``)."""
        cache_dir = Path(tempfile.mkdtemp(prefix=f"cache-{engine}-", dir=self.tmp))
        cache = {"cache_dir": str(cache_dir), "persist": True}
        try:
            warmed = self.run_measurement(
                engine,
                store,
                info,
                repeat,
                variant,
                phase,
                {**cache, "epoch_kinds": ["cold_persist"]},
            )
            if warmed:
                on_disk = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
                write_back_s = write_back(cache_dir)
                self.run_measurement(
                    engine,
                    store,
                    info,
                    repeat,
                    variant,
                    phase,
                    {**cache, "epoch_kinds": ["warm_disk"]},
                    {"cache_dir_bytes": on_disk, "write_back_s": round(write_back_s, 3)},
                )
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)

    def run_measurement(
        self,
        engine: str,
        store: str,
        info: DatasetInfo,
        repeat: int,
        variant: dict[str, Any],
        phase: str,
        extra_cfg: dict[str, Any] | None = None,
        extra_row: dict[str, Any] | None = None,
    ) -> bool:
        """One child process: its epochs become one row each. False when it failed."""
        where = {"store": "ram" if engine == "memory" else store, "dataset": info.spec.name}
        store_cfg, stats_port = self.store_config(store, info)
        cfg = {
            **self.base_config(info),
            **variant,
            **(extra_cfg or {}),
            "engine": engine,
            "store": store_cfg,
            "proxy_stats_port": stats_port,
            "train_chunks": info.split_chunks["train"],
            "split_chunks": info.split_chunks,
            "samples": info.samples,
        }
        if engine == "insitubatch":
            assert self.insitubatch_python is not None
            cmd = [self.insitubatch_python, str(HERE / "engine_insitubatch.py")]
        else:
            cmd = [sys.executable, "-m", "benchmarks.engines"]
        label = " ".join(f"{k}={v}" for k, v in variant.items() if k != "max_batches")
        child = run_child(cmd, cfg, self.tmp, self.suite.child_timeout_s)
        status = "timeout" if child.timed_out else f"rc={child.rc}"
        if child.result is None:
            print(f"[bench] FAIL {engine} {where} {label}: {status}\n{child.log_tail}")
            self.emit(
                {
                    "type": "error",
                    "engine": engine,
                    **where,
                    "repeat": repeat,
                    "variant": variant,
                    "status": status,
                    "log_tail": child.log_tail[-1500:],
                }
            )
            return False
        res = child.result
        config = {k: v for k, v in cfg.items() if k not in ("samples", "store", "split_chunks")}
        config["store_kind"] = store_cfg["kind"]
        config["train_chunks"] = len(info.split_chunks["train"])
        config["rss_source"] = rss_source()
        whole = child.sampler.peak()
        for ep in res["epochs"]:
            row = self.epoch_row(engine, store, info, ep, child)
            row.update(
                {
                    "type": "measurement",
                    "engine": engine,
                    **where,
                    "layout": info.spec.layout,
                    "spc": info.spec.samples_per_chunk,
                    "repeat": repeat,
                    "phase": phase,
                    "variant": label,
                    "num_workers": variant.get("num_workers"),
                    "max_batches": variant.get("max_batches"),
                    "budget": variant.get("budget"),
                    "cache": variant.get("cache"),
                    "setup_s": res.get("setup_s"),
                    "process_wall_s": child.wall_s,
                    "process_rc": child.rc,
                    "process_rss_peak_MB": _mb(whole["rss_peak_bytes"]),
                    "t_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "config": config,
                }
            )
            for key in ("budget_bytes", "block_chunks_used", "version"):
                if key in res:
                    row["config"] = {**row["config"], key: res[key]}
            row.update(extra_row or {})
            self.emit(row)
        first = res["epochs"][0]
        last = res["epochs"][-1]
        print(
            f"[bench] r{repeat} {store:5s} {info.spec.name:12s} {engine:11s} {label:14s} "
            f"{first['samples'] / first['wall_s']:9.1f} -> {last['samples'] / last['wall_s']:9.1f}"
            f" samples/s  (process {child.wall_s:5.1f} s, {status})"
            + (f" [{', '.join(ep['kind'] for ep in res['epochs'])}]" if extra_cfg else "")
        )
        return True

    def epoch_row(
        self, engine: str, store: str, info: DatasetInfo, ep: dict[str, Any], child: ChildResult
    ) -> dict[str, Any]:
        wall = max(ep["wall_s"], 1e-9)
        mem = child.sampler.peak(ep["t_start"], ep["t_end"])
        proxy, engine_io = ep.get("proxy"), ep.get("engine_io")
        if engine == "memory":
            gets, fetched, source = 0, 0, "none (split in RAM)"
        elif store == "s3" and proxy is not None:
            gets, fetched, source = proxy["gets"], proxy["get_body_bytes"], "proxy"
        elif engine_io is not None:
            gets, fetched, source = engine_io["gets"], engine_io["bytes"], "engine"
        else:
            gets, fetched, source = None, None, "unknown"
        order = ep.get("order") or []
        # The distinct stored objects the delivered samples live in (the whole split for a full
        # epoch; fewer for the per-sample loaders' shorter epochs).
        needed = needed_bytes(info.sizes, order, info.spec.anchor_spc) if order else info.needed
        return {
            "epoch_kind": ep["kind"],
            "samples": ep["samples"],
            "batches": ep["batches"],
            "wall_s": ep["wall_s"],
            "samples_per_s": ep["samples"] / wall,
            "decoded_MB_per_s": ep["samples"] * info.spec.sample_nbytes / wall / 1e6,
            "ttfb_s": ep["ttfb_s"],
            "rss_peak_MB": _mb(mem["rss_peak_bytes"]),
            "rss_at_start_MB": _mb(child.sampler.at(ep["t_start"])),
            "memory_samples": mem["memory_samples"],
            "cpu_s": ep["cpu_s"],
            "gets": gets,
            "bytes_fetched": fetched,
            "io_source": source,
            "needed_bytes": needed,
            "read_amplification": (fetched / needed) if fetched is not None and needed else None,
            "shuffle_quality": _shuffle_quality(order, info, ep),
            "proxy": proxy,
            "engine_io": engine_io,
            "extra": ep.get("extra") or {},
        }

    def over_budget(self, engine: str) -> str | None:
        """Why ``engine`` is not run now (past the suite's time budget), or None."""
        elapsed = time.monotonic() - self.t_run
        limit = self.suite.hard_budget_s
        if engine in PER_SAMPLE and self.suite.soft_budget_s is not None:
            limit = self.suite.soft_budget_s
        if limit is None or self.args.no_time_budget or elapsed <= limit:
            return None
        return (
            f"time budget: {elapsed / 60:.1f} min elapsed > {limit / 60:.0f} min "
            f"({'per-sample loaders' if engine in PER_SAMPLE else 'all engines'})"
        )

    def ceiling(self, engine: str, store: str, info: DatasetInfo, repeat: int | None) -> None:
        """One pass of a ceiling engine on (store, dataset): ``rawget`` (every stored object,
        no decode) or ``decode`` (the train chunks' objects fetched and decoded into reused
        buffers). One row of type ``engine``; ``repeat`` is None for the pass before the rounds.
        A pass within a round is skipped past the time budget, like the engines."""
        over = self.over_budget(engine) if repeat is not None else None
        if over:
            self.skip(engine, over, store=store, dataset=info.spec.name, repeat=repeat)
            return
        store_cfg, stats_port = self.store_config(store, info)
        cfg: dict[str, Any] = {
            "engine": engine,
            "store": store_cfg,
            "proxy_stats_port": stats_port,
            "max_inflight": 32,
        }
        if engine == "rawget":
            cfg["objects"] = info.objects
        else:
            cfg["train_chunks"] = info.split_chunks["train"]
        child = run_child(
            [sys.executable, "-m", "benchmarks.engines"], cfg, self.tmp, self.suite.child_timeout_s
        )
        where = {"store": store, "dataset": info.spec.name, "repeat": repeat}
        if child.result is None:
            status = "timeout" if child.timed_out else f"rc={child.rc}"
            print(f"[bench] FAIL {engine} {where}: {status}\n{child.log_tail}")
            self.emit(
                {
                    "type": "error",
                    "engine": engine,
                    **where,
                    "status": status,
                    "log_tail": child.log_tail[-1500:],
                }
            )
            return
        ep = child.result["epochs"][0]
        extra = ep["extra"]
        wall = max(ep["wall_s"], 1e-9)
        row: dict[str, Any] = {
            "type": engine,
            "engine": engine,
            **where,
            "objects": extra["objects"],
            "bytes": extra["bytes"],
            "wall_s": ep["wall_s"],
            "MB_per_s": extra["bytes"] / wall / 1e6,
            "requests_per_s": extra["objects"] / wall,
            "cpu_s": ep["cpu_s"],
            "rss_peak_MB": _mb(child.sampler.peak(ep["t_start"], ep["t_end"])["rss_peak_bytes"]),
            "proxy": ep.get("proxy"),
            "config": {
                "max_inflight": 32,
                "latency_ms": self.args.latency_ms,
                "allocator_tuned": extra.get("allocator_tuned"),
            },
        }
        text = (
            f"{extra['objects']:5d} objects {row['MB_per_s']:8.1f} MB/s "
            f"{row['requests_per_s']:8.1f} req/s"
        )
        if engine == "decode":
            row.update(
                {
                    "samples": ep["samples"],
                    "samples_per_s": ep["samples"] / wall,
                    "decoded_bytes": extra["decoded_bytes"],
                    "decoded_MB_per_s": extra["decoded_bytes"] / wall / 1e6,
                    "threads": extra["threads"],
                    "strategy": extra["strategy"],
                    "setup_s": child.result.get("setup_s"),
                }
            )
            row["config"]["decode_threads"] = extra["threads"]
            text += f" {row['samples_per_s']:8.1f} samples/s ({extra['threads']} threads)"
        self.emit(row)
        print(f"[bench] {engine:6s} {store:5s} {info.spec.name:12s} {text}")

    # -- variants and order --------------------------------------------------------------------
    def variants(self, engine: str, store: str, info: DatasetInfo, repeat: int) -> list[dict]:
        """What to run for one engine in one cell of one round."""
        if engine in ("nodes", "insitubatch"):
            out = [{"budget": "default"}, {"budget": "split"}]
            if info.spec.name in self.suite.persist_datasets.get(store, ()):
                out.append(dict(PERSIST))
            wanted = self.args.variants
            return [v for v in out if v.get("cache", v["budget"]) in wanted]
        if engine == "memory":
            return [{}] if store == "local" else []
        name = info.spec.name
        if name not in self.suite.per_sample_datasets.get(store, ()):
            return []
        if self.args.full_sweep:
            counts = self.suite.worker_counts
        elif repeat == 0 and name == self.suite.tune_dataset:
            return []  # the sweep already measured this cell for round 0
        else:
            counts = (self.best_workers.get((engine, store), self.suite.worker_counts[-1]),)
        return [self.per_sample_variant(n) for n in counts]

    def per_sample_variant(self, num_workers: int) -> dict[str, Any]:
        variant: dict[str, Any] = {"num_workers": num_workers}
        if self.suite.per_sample_batches:
            variant["max_batches"] = self.suite.per_sample_batches
        return variant

    def sweep(self, engines: list[str], infos: list[DatasetInfo]) -> None:
        """Round 0 of the tuning dataset: every worker count, per store; then pick the best."""
        tune = [i for i in infos if i.spec.name == self.suite.tune_dataset]
        if self.args.full_sweep or not tune:
            return
        for store in self.args.stores:
            for engine in [e for e in engines if e in PER_SAMPLE]:
                for n in self.suite.worker_counts:
                    self.measure(engine, store, tune[0], 0, self.per_sample_variant(n), "sweep")
        self.choose_best_workers()

    def choose_best_workers(self) -> None:
        """The worker count with the best warm (steady-state) throughput in the sweep."""
        best: dict[tuple[str, str], tuple[float, int]] = {}
        for row in self.rows:
            if row.get("type") != "measurement" or row.get("phase") != "sweep":
                continue
            if row["epoch_kind"] != "warm":
                continue
            key = (row["engine"], row["store"])
            rate = row["samples_per_s"]
            if key not in best or rate > best[key][0]:
                best[key] = (rate, int(row["num_workers"]))
        self.best_workers = {k: v[1] for k, v in best.items()}
        for (engine, store), n in sorted(self.best_workers.items()):
            print(f"[bench] best num_workers for {engine} on {store}: {n}")
            self.emit({"type": "best_workers", "engine": engine, "store": store, "num_workers": n})

    def available_engines(self) -> list[str]:
        engines = []
        for engine in self.args.engines:
            if engine == "insitubatch":
                python, why = insitubatch_env.ensure()
                if python is None:
                    self.skip("insitubatch", why or "unavailable")
                    continue
                self.insitubatch_python = python
            if engine == "xbatcher":
                missing = [m for m in ("xarray", "xbatcher") if importlib.util.find_spec(m) is None]
                if missing:
                    self.skip(
                        "xbatcher",
                        f"{' and '.join(missing)} not installed (pip install -e '.[bench]')",
                    )
                    continue
            engines.append(engine)
        return engines

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> int:
        self.t_run = t_run = time.monotonic()
        data_dir = Path(self.args.data) if self.args.data else HERE / "data"
        infos: list[DatasetInfo] = []
        for spec in self.suite.datasets:
            if self.args.datasets and spec.name not in self.args.datasets:
                continue
            info, gen_s = prepare_dataset(spec, data_dir)
            if gen_s is not None:
                print(f"[bench] wrote dataset {spec.folder} in {gen_s:.1f} s")
            infos.append(info)
        engines = self.available_engines()
        machine = machine_info()
        if self.insitubatch_python:
            machine["insitubatch_venv"] = insitubatch_versions(self.insitubatch_python)
        self.emit(
            {
                "type": "run",
                "command": os.environ.get("BENCH_COMMAND") or " ".join(sys.argv),
                "argv": sys.argv,
                "started_utc": self.run_id,
                "machine": machine,
                "engines": engines,
                "stores": self.args.stores,
                "repeats": self.suite.repeats,
                "worker_counts": list(self.suite.worker_counts),
                "tune_dataset": self.suite.tune_dataset,
                "per_sample_datasets": {
                    k: list(v) for k, v in self.suite.per_sample_datasets.items()
                },
                "soft_budget_s": self.suite.soft_budget_s,
                "ceilings_every_round": list(self.suite.ceilings_every_round),
                "persist_datasets": {k: list(v) for k, v in self.suite.persist_datasets.items()},
                "variants": list(self.args.variants),
                "hard_budget_s": self.suite.hard_budget_s,
                "per_sample_batches": self.suite.per_sample_batches,
                "full_sweep": self.args.full_sweep,
                "latency_ms": self.args.latency_ms,
                "datasets": [
                    {
                        **i.spec.to_json(),
                        "folder": i.spec.folder,
                        "layout": i.spec.layout,
                        "stored_bytes": i.stored_bytes,
                        "objects": len(i.objects),
                        "train_samples": len(i.samples),
                        "train_chunks": len(i.split_chunks["train"]),
                        "needed_bytes": i.needed,
                        "decoded_train_bytes": len(i.samples) * i.spec.sample_nbytes,
                        "sample_nbytes": i.spec.sample_nbytes,
                    }
                    for i in infos
                ],
            }
        )
        with contextlib.ExitStack() as stack:
            if "s3" in self.args.stores:
                _, self.proxy = stack.enter_context(
                    s3_endpoint({i.spec.folder: i.path for i in infos}, self.args.latency_ms)
                )
            every_round = set(self.suite.ceilings_every_round)
            for store in self.args.stores:
                for info in infos:
                    if info.spec.name not in every_round:
                        for ceiling in CEILINGS:
                            self.ceiling(ceiling, store, info, None)
            self.sweep(engines, infos)
            for repeat in range(self.suite.repeats):
                k = repeat % len(engines) if engines else 0
                order = engines[k:] + engines[:k]
                for store in self.args.stores:
                    for info in infos:
                        if info.spec.name in every_round:
                            for ceiling in CEILINGS:
                                self.ceiling(ceiling, store, info, repeat)
                        for engine in order:
                            for variant in self.variants(engine, store, info, repeat):
                                self.measure(engine, store, info, repeat, variant)
        shutil.rmtree(self.tmp, ignore_errors=True)
        total = time.monotonic() - t_run
        self.emit({"type": "end", "total_s": total})
        print(f"[bench] {len(self.rows)} rows in {total:.0f} s -> {self.out_path}")
        print_summary(self.rows)
        return 0


def _shuffle_quality(order: list[int], info: DatasetInfo, ep: dict[str, Any]) -> float | None:
    """``insitubatch_nodes.plan.shuffle_quality`` of the emitted order, cut into batches of 32."""
    from insitubatch_nodes.plan.quality import shuffle_quality

    if len(order) < 3:
        return None
    arr = np.asarray(order, dtype=np.int64)
    try:
        return float(shuffle_quality(arr, 32))  # (order, batch_size): the batch-mixing score
    except TypeError:  # an older signature: (order, *, bins=None, seed=0)
        return float(shuffle_quality(arr))


def _mb(n: int | None) -> float | None:
    return None if n is None else n / 1e6


def print_summary(rows: list[dict[str, Any]]) -> None:
    groups: dict[tuple[str, str, str, str, str], list[float]] = {}
    for r in rows:
        if r.get("type") == "measurement":
            key = (r["store"], r["dataset"], r["engine"], r["variant"], r["epoch_kind"])
            groups.setdefault(key, []).append(r["samples_per_s"])
    for key in sorted(groups):
        vals = groups[key]
        print(
            f"  {key[0]:5s} {key[1]:12s} {key[2]:11s} {key[3]:14s} {key[4]:12s} "
            f"median {statistics.median(vals):9.1f} samples/s (n={len(vals)})"
        )


def check_rows(rows: list[dict[str, Any]], engines: list[str], stores: list[str]) -> list[str]:
    """Problems with a run's rows (empty = the harness works): every requested engine has
    complete measurement rows for every store (memory: once, in RAM) or a skip row saying why;
    nodes, workers and memory may not be skipped. Where the run planned the persistent cache,
    nodes and insitubatch have a warming epoch and a ``warm_disk`` epoch that missed no chunk
    and was served by chunks revived from the folder."""
    problems = []
    kinds = {r.get("type") for r in rows}
    for needed in ("run", "end", *CEILINGS):
        if needed not in kinds:
            problems.append(f"no {needed!r} row")
    for r in rows:
        if r.get("type") == "error":
            problems.append(f"error row: {r.get('engine')} {r.get('store')} {r.get('status')}")
    skipped = {  # whole engines (a time-budget skip names a store and a dataset)
        r["engine"]: r.get("reason") for r in rows if r.get("type") == "skip" and "store" not in r
    }
    for engine in engines:
        if engine in skipped:
            if engine in ALWAYS_AVAILABLE:
                problems.append(f"{engine} was skipped: {skipped[engine]}")
            elif not skipped[engine]:
                problems.append(f"{engine} was skipped without a reason")
            continue
        for store in ["ram"] if engine == "memory" else stores:
            mine = [
                r
                for r in rows
                if r.get("type") == "measurement" and r["engine"] == engine and r["store"] == store
            ]
            if not mine:
                problems.append(f"no rows for {engine} on {store}")
            for r in mine:
                missing = [f for f in REQUIRED_FIELDS if f not in r]
                if missing:
                    problems.append(f"{engine}/{store}: missing fields {missing}")
                if not r.get("samples") or not r.get("samples_per_s"):
                    problems.append(f"{engine}/{store}/{r.get('epoch_kind')}: no samples")
                if r.get("rss_peak_MB") is None:
                    problems.append(f"{engine}/{store}/{r.get('epoch_kind')}: no RSS")
                if engine != "memory" and r.get("gets") is None:
                    problems.append(f"{engine}/{store}/{r.get('epoch_kind')}: no GET count")
    problems += _check_persist_rows(rows, [e for e in engines if e not in skipped], stores)
    return problems


def _check_persist_rows(
    rows: list[dict[str, Any]], engines: list[str], stores: list[str]
) -> list[str]:
    run = next((r for r in rows if r.get("type") == "run"), {})
    if "persist" not in run.get("variants", POOL_VARIANTS):
        return []
    problems = []
    for store, names in (run.get("persist_datasets") or {}).items():
        if store not in stores:
            continue
        for dataset in names:
            for engine in [e for e in engines if e in ("nodes", "insitubatch")]:
                mine = {
                    r["epoch_kind"]: r
                    for r in rows
                    if r.get("type") == "measurement"
                    and (r["engine"], r["store"], r["dataset"]) == (engine, store, dataset)
                    and r.get("cache") == "persist"
                }
                where = f"{engine}/{store}/{dataset} persistent cache"
                if "cold_persist" not in mine:
                    problems.append(f"{where}: no warming epoch")
                disk = mine.get("warm_disk")
                if disk is None:
                    problems.append(f"{where}: no epoch read from the warm cache")
                    continue
                extra = disk.get("extra") or {}
                if extra.get("misses") != 0:  # (insitubatch re-reads metadata: GETs, no chunks)
                    problems.append(f"{where}: {extra.get('misses')} chunks missed the warm cache")
                if not extra.get("disk_hits"):
                    problems.append(f"{where}: the warm epoch revived no chunk from disk")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("full", "smoke"), default="full")
    p.add_argument("--out", help="folder for the JSONL (default benchmarks/results)")
    p.add_argument("--data", help="folder for the datasets (default benchmarks/data)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    p.add_argument("--datasets", nargs="+", help="dataset names of the suite to run")
    p.add_argument("--repeats", type=int, help="rounds (default: 3 full, 1 smoke)")
    p.add_argument(
        "--latency-ms", type=float, default=15.0, help="proxy delay per request (default 15)"
    )
    p.add_argument(
        "--full-sweep",
        action="store_true",
        help="run every worker count in every round (default: all in round 0, then the best)",
    )
    p.add_argument(
        "--no-time-budget",
        action="store_true",
        help="never skip measurements to stay within the suite's time budget",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=POOL_VARIANTS,
        default=list(POOL_VARIANTS),
        help="what nodes and insitubatch run: the automatic pool budget, a budget holding the "
        "split, the persistent chunk cache (warming process, then a fresh one reading it)",
    )
    p.add_argument("--check", action="store_true", help="assert complete rows (smoke)")
    return p.parse_args(argv)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: the current child, the proxy and moto are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(argv)
    suite = make_suite(args.suite)
    if args.repeats:
        suite.repeats = args.repeats
    out = Path(args.out) if args.out else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    if args.suite == "smoke" and not args.data:
        args.data = str(out / "data")
    harness = Harness(args, suite, out)
    rc = harness.run()
    if args.check:
        problems = check_rows(harness.rows, args.engines, args.stores)
        for p in problems:
            print(f"[bench] CHECK FAILED: {p}")
        if problems:
            return 1
        print(f"[bench] check passed: {len(harness.rows)} rows, engines {args.engines}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
