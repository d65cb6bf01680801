"""The archive-shape suite: ``python -m benchmarks.archive --suite full|smoke``.

Users' archives (WeatherBench2, ARCO-ERA5) store **one time step per chunk** of many arrays.
This suite measures that shape, in fresh processes (``benchmarks/archive_engines.py``), next to
peers and ceilings, and writes one JSONL, ``<out>/archive-<suite>-<UTC time>.jsonl``, that
``benchmarks/report.py`` renders as the results page's *Archive shape* and *Planning at scale*
sections. It reuses the side-by-side harness's pieces (``benchmarks/run.py``: ``run_child``
with its outside tree sampler, the moto server + counting latency proxy with the upload,
``machine_info``; ``benchmarks/datasets.py``'s write-once folders).

1. Datasets (``insitubatch_nodes.synthetic.make_weatherbench_like``) are written once under
   ``benchmarks/data/`` and reused while their spec matches the marker next to the folder.
   Full: 512 steps of the default archive (121 x 240, 10 surface + 3 thirteen-level arrays,
   blosc-zstd) at 1 sample per chunk (``wb-c1``) and the same data at 16 (``wb-c16``), and a
   long store at 16 (``wb-c16-long``: 4,096 steps on 61 x 120, local only) whose train split is
   6.4x the default budget, the regime of real archives (there the automatic budget is the
   working set, and slots are recycled within the epoch). The split is ``split_by_chunk(first
   array, (0.8, 0.1, 0.1))``'s train split; every data array is a label; batch size 32.
2. ``local`` = obstore ``LocalStore`` (every file read once right before each measurement: the
   page cache is warm);
   ``s3`` = moto on loopback behind the counting latency proxy (``--latency-ms``, default 10),
   the datasets uploaded once.
3. Scale rows, once, before the rounds: metadata-only stores (every chunk missing), planning
   and the first batches at 10^5-10^6 steps and tens of arrays.
4. ``--repeats`` rounds, each starting with a fresh process measuring the machine's
   first-touch rate (``benchmarks/first_touch.py``: a ``first_touch`` row); within a round
   every engine runs on every (store, dataset) — the chunk-1 dataset on every store first — in
   an order that rotates from round to round; each measurement times epoch 0 and epoch 1 of
   one fresh process (a ceiling on s3: one pass).
   The peers run every worker count in round 0 and the best per peer after (local), or in
   round 0 only (s3). Past the suite's time budget the peers are skipped, then every engine
   (``skip`` rows say so).

``--check`` asserts that every planned measurement has complete rows or a skip row with a
reason, and that every scale store has its row (the smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.datasets import ensure_written
from benchmarks.run import (
    BUCKET,
    ChildResult,
    _dist_version,
    _terminate,
    machine_info,
    run_child,
    s3_endpoint,
)
from benchmarks.sampler import rss_source

HERE = Path(__file__).resolve().parent
ENGINES = ("nodes", "bare", "bare_batches", "bare_kept", "decode", "rawget", "tensorstore", "zarr")
CEILINGS = ("bare", "bare_batches", "bare_kept", "decode", "rawget")
BARE = ("bare", "bare_batches", "bare_kept")  # they read files: local store only
PEERS = ("tensorstore", "zarr")
STORES = ("local", "s3")
EPOCHS = ("epoch0", "epoch1")
ROLE = {"nodes": "engine", **dict.fromkeys(CEILINGS, "ceiling"), **dict.fromkeys(PEERS, "peer")}
REQUIRED_FIELDS = (
    "engine",
    "role",
    "store",
    "dataset",
    "repeat",
    "epoch_kind",
    "samples",
    "wall_s",
    "samples_per_s",
    "ttfb_s",
    "cpu_s",
    "rss_peak_MB",
    "gets",
    "bytes_fetched",
    "objects",
    "config",
)
SCALE_FIELDS = ("open_s", "build_s", "first_batch_s", "per_batch_ms", "peak_rss_MB")


@dataclass(frozen=True)
class ArchiveSpec:
    """One ``make_weatherbench_like`` store (its arguments) under a label."""

    name: str
    n_time: int
    n_lat: int = 121
    n_lon: int = 240
    n_level: int = 13
    surface: int = 10
    levels: int = 3
    samples_per_chunk: int = 1
    compressor: str = "blosc"
    clevel: int = 3
    write_chunks: bool = True

    @property
    def folder(self) -> str:
        """A folder name that changes whenever the layout does."""
        text = (
            f"wb_t{self.n_time}_{self.n_lat}x{self.n_lon}_s{self.surface}_"
            f"l{self.levels}x{self.n_level}_c{self.samples_per_chunk}_"
            f"{self.compressor}{self.clevel}"
        )
        return text + ("" if self.write_chunks else "_meta") + ".zarr"

    @property
    def arrays(self) -> int:
        return self.surface + self.levels

    @property
    def sample_nbytes(self) -> int:
        """Decoded bytes of one sample, every array (float32)."""
        return 4 * self.n_lat * self.n_lon * (self.surface + self.levels * self.n_level)

    @property
    def layout(self) -> str:
        levels = f" + {self.levels} on {self.n_level} levels" if self.levels else ""
        return (
            f"{self.n_lat}x{self.n_lon}, {self.surface} surface{levels}, "
            f"{self.samples_per_chunk} sample(s)/chunk"
        )

    def to_json(self) -> dict[str, Any]:
        return {"writer": "make_weatherbench_like", **asdict(self)}

    def write(self, path: Path) -> None:
        from insitubatch_nodes.synthetic import make_weatherbench_like

        make_weatherbench_like(
            path,
            n_time=self.n_time,
            n_lat=self.n_lat,
            n_lon=self.n_lon,
            n_level=self.n_level,
            surface=self.surface,
            levels=self.levels,
            samples_per_chunk=self.samples_per_chunk,
            compressor=self.compressor,
            clevel=self.clevel,
            write_chunks=self.write_chunks,
        )


def scale_spec(n_time: int, arrays: int) -> ArchiveSpec:
    """A metadata-only store: ``arrays`` surface arrays of ``n_time`` steps on 32 x 64."""
    return ArchiveSpec(
        f"scale-{n_time}x{arrays}",
        n_time,
        n_lat=32,
        n_lon=64,
        surface=arrays,
        levels=0,
        write_chunks=False,
    )


@dataclass(frozen=True)
class PeerPlan:
    """How the peers run on one store: worker counts per peer, the rounds they run in (None:
    every round), and the cap on an epoch: ``max(base_batches, batches_per_worker * N)``
    batches (enough that every one of N workers has batches to fetch; None: whole epochs).
    With ``sweep``, round 0 runs every worker count and the later rounds only the count with
    the best epoch 1 (steady state) of round 0, per peer (a ``best_workers`` row says which)."""

    workers: dict[str, tuple[int, ...]]
    base_batches: int | None
    batches_per_worker: int = 0
    rounds: tuple[int, ...] | None = None
    sweep: bool = False

    def max_batches(self, num_workers: int) -> int | None:
        if self.base_batches is None:
            return None
        return max(self.base_batches, self.batches_per_worker * num_workers)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["workers"] = {k: list(v) for k, v in self.workers.items()}
        out["rounds"] = None if self.rounds is None else list(self.rounds)
        out["max_batches"] = {
            engine: {str(n): self.max_batches(n) for n in counts}
            for engine, counts in self.workers.items()
        }
        return out


@dataclass
class ArchiveSuite:
    name: str
    datasets: list[ArchiveSpec]
    repeats: int
    child_timeout_s: float
    # the peers run on these datasets only (the chunk-1 archive: what a user would pick them
    # for), as each store's plan says
    peer_datasets: tuple[str, ...]
    peers: dict[str, PeerPlan]
    scale: list[ArchiveSpec]
    # timed passes of each ceiling per process, per store (the s3 passes are the long ones)
    ceiling_epochs: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {"local": EPOCHS, "s3": EPOCHS}
    )
    # engines that run in round 0 only, per store (their ratios in later rounds take their
    # median over the rounds)
    once: dict[str, tuple[str, ...]] = field(default_factory=dict)
    scale_max_s: float = 10.0
    scale_max_batches: int = 200
    scale_timeout_s: float = 300.0
    # past ``soft_budget_s`` the peers are skipped, past ``hard_budget_s`` every engine
    soft_budget_s: float | None = None
    hard_budget_s: float | None = None
    # these datasets run on the local store only (the long one: real archives' regime, where
    # the split is many times the default budget)
    local_only: tuple[str, ...] = ()
    # MiB of the per-round first-touch measurement (``benchmarks/first_touch.py``)
    first_touch_mib: int = 512
    # ``bare_kept`` (the least a loader keeping the split must do) runs on these datasets only:
    # those whose split the automatic budget keeps for the next epoch
    kept: tuple[str, ...] = ()


def make_suite(name: str) -> ArchiveSuite:
    if name == "smoke":
        tiny = ArchiveSpec(
            "wb-smoke", 64, n_lat=16, n_lon=32, n_level=4, surface=3, levels=1, samples_per_chunk=1
        )
        return ArchiveSuite(
            "smoke",
            [tiny],
            repeats=1,
            child_timeout_s=180,
            peer_datasets=(tiny.name,),
            # every code path once (with and without workers, file and s3 kvstores), short
            peers={
                "local": PeerPlan({"tensorstore": (0, 2), "zarr": (0, 2)}, 2),
                "s3": PeerPlan({"tensorstore": (2,), "zarr": (0,)}, 1),
            },
            ceiling_epochs={"local": EPOCHS, "s3": EPOCHS[:1]},
            scale=[scale_spec(5_000, 8)],
            scale_max_s=2.0,
            scale_max_batches=50,
            scale_timeout_s=180,
            first_touch_mib=32,
            kept=(tiny.name,),
        )
    c1 = ArchiveSpec("wb-c1", 512, samples_per_chunk=1)
    c16 = ArchiveSpec("wb-c16", 512, samples_per_chunk=16)
    # the same arrays at a quarter of the grid over 8x the steps: the train split (4.7 GB
    # decoded) is 6.4x the default budget (a working set of ~0.7 GB), as in real archives
    long = ArchiveSpec("wb-c16-long", 4096, n_lat=61, n_lon=120, samples_per_chunk=16)
    return ArchiveSuite(
        "full",
        [c1, c16, long],
        repeats=3,
        child_timeout_s=300,
        peer_datasets=(c1.name,),
        # The peers keep no cache, so their rate does not change over an epoch: their epochs are
        # capped. On local every worker count runs in round 0, the best one per peer after.
        # Through the S3 stand-in a sample is 13 GETs (~20 ms each, one after the other for
        # zarr): there they run once (round 0), 1-2 batches an epoch (one per worker).
        peers={
            "local": PeerPlan({"tensorstore": (0, 2), "zarr": (0, 2, 4)}, 4, 2, sweep=True),
            "s3": PeerPlan({"tensorstore": (0, 2), "zarr": (0, 2)}, 1, 1, rounds=(0,)),
        },
        # At chunk 1 an s3 pass takes ~25 s (raw GET) to ~50 s (decode: it shares the 2 cores
        # with moto): one pass per s3 ceiling process, and the s3 decode-only ceiling (no
        # target on s3) in round 0 only.
        ceiling_epochs={"local": EPOCHS, "s3": EPOCHS[:1]},
        once={"s3": ("decode",)},
        scale=[
            scale_spec(100_000, 2),
            scale_spec(100_000, 60),
            scale_spec(745_000, 20),
            scale_spec(745_000, 60),
        ],
        soft_budget_s=13 * 60,
        hard_budget_s=16 * 60,
        local_only=(long.name,),
        kept=(c16.name,),
    )


# --------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------


@dataclass
class ArchiveInfo:
    spec: ArchiveSpec
    path: Path
    variables: list[str]
    split_chunks: dict[str, list[int]]
    samples: list[int]
    train_objects: list[tuple[str, int]]  # (key relative to the group, stored bytes)
    objects: int  # every stored chunk object of the data arrays
    stored_bytes: int
    decoded_sample_bytes: int

    @property
    def train_bytes(self) -> int:
        return sum(n for _, n in self.train_objects)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.spec.to_json(),
            "folder": self.spec.folder,
            "layout": self.spec.layout,
            "variables": self.variables,
            "arrays": len(self.variables),
            "objects": self.objects,
            "objects_per_sample": self.objects / max(self.spec.n_time, 1),
            "stored_bytes": self.stored_bytes,
            "train_samples": len(self.samples),
            "train_chunks": len(self.split_chunks["train"]),
            "train_objects": len(self.train_objects),
            "train_stored_bytes": self.train_bytes,
            "sample_nbytes": self.decoded_sample_bytes,
            "decoded_train_bytes": self.decoded_sample_bytes * len(self.samples),
        }


def object_keys(path: Path, variables: list[str], chunks: list[int]) -> list[tuple[str, int]]:
    """(key, size) of every stored object of ``chunks`` (time-chunk indices) of the arrays,
    keys from zarr's own chunk-key encoding (not the package's)."""
    import zarr

    out = []
    for name in variables:
        arr = zarr.open_array(store=str(path / name), mode="r")
        grid = [-(-n // c) for n, c in zip(arr.shape[1:], arr.chunks[1:], strict=True)]
        for chunk in chunks:
            coords: list[tuple[int, ...]] = [(chunk,)]
            for n in grid:
                coords = [(*c, i) for c in coords for i in range(n)]
            for c in coords:
                key = f"{name}/{arr.metadata.encode_chunk_key(c)}"
                file = path / key
                out.append((key, file.stat().st_size if file.is_file() else 0))
    return out


def prepare(spec: ArchiveSpec, data_dir: Path) -> tuple[ArchiveInfo, float | None]:
    from insitubatch_nodes import open_geometries, split_by_chunk

    t0 = time.monotonic()
    path, written = ensure_written(data_dir, spec.folder, spec.to_json(), spec.write)
    gen_s = time.monotonic() - t0 if written else None
    geoms = open_geometries(path)  # the data arrays (coordinates are not)
    variables = sorted(geoms)
    manifest = split_by_chunk(geoms[variables[0]], (0.8, 0.1, 0.1))
    split_chunks = {s: list(manifest.chunks(s)) for s in ("train", "val", "test")}
    train = object_keys(path, variables, split_chunks["train"])
    every = [
        f
        for name in variables
        for f in (path / name).rglob("*")
        if f.is_file() and f.name != "zarr.json"
    ]
    info = ArchiveInfo(
        spec,
        path,
        variables,
        split_chunks,
        [int(s) for s in manifest.samples("train")],
        train,
        len(every),
        sum(f.stat().st_size for f in every),
        sum(geoms[v].sample_nbytes for v in variables),
    )
    return info, gen_s


def warm_page_cache(path: Path) -> float:
    """Read every file under ``path`` once (the local store's files are then in the page
    cache, as the reference shape's are). Seconds it took."""
    t0 = time.monotonic()
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb", buffering=0) as fh:
                while fh.read(1 << 24):
                    pass
    return time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# the harness
# --------------------------------------------------------------------------------------------


def _mb(n: float | None) -> float | None:
    return None if n is None else n / 1e6


class ArchiveHarness:
    def __init__(self, args: argparse.Namespace, suite: ArchiveSuite, out: Path) -> None:
        self.args, self.suite = args, suite
        self.run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.out_path = out / f"archive-{suite.name}-{self.run_id}.jsonl"
        self.tmp = Path(tempfile.mkdtemp(prefix="archive-child-"))
        self.rows: list[dict[str, Any]] = []
        self.proxy: Any = None
        self.unavailable: dict[tuple[str, str], str] = {}  # (engine, store) -> why
        self.best: dict[tuple[str, str, str], int] = {}  # (peer, store, dataset) -> workers
        self.t_run = time.monotonic()

    # -- output --------------------------------------------------------------------------------
    def emit(self, row: dict[str, Any]) -> None:
        row = {"run_id": self.run_id, "suite": self.suite.name, "harness": "archive", **row}
        self.rows.append(row)
        with open(self.out_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def skip(self, engine: str, reason: str, **where: Any) -> None:
        print(f"[archive] SKIP {engine} {where or ''}: {reason}")
        self.emit({"type": "skip", "engine": engine, "reason": reason, **where})

    def error(self, engine: str, where: dict[str, Any], child: ChildResult) -> None:
        status = "timeout" if child.timed_out else f"rc={child.rc}"
        print(f"[archive] FAIL {engine} {where}: {status}\n{child.log_tail}")
        row = {"type": "error", "engine": engine, **where, "status": status}
        self.emit({**row, "log_tail": child.log_tail[-1500:]})

    # -- config --------------------------------------------------------------------------------
    def store_config(self, store: str, info: ArchiveInfo) -> tuple[dict[str, Any], int | None]:
        if store == "local":
            return {"kind": "local", "path": str(info.path)}, None
        cfg = {"kind": "s3", "bucket": BUCKET, "prefix": info.spec.folder}
        return {**cfg, "endpoint": self.proxy.endpoint}, self.proxy.stats_port

    def over_budget(self, engine: str) -> str | None:
        elapsed = time.monotonic() - self.t_run
        limit = self.suite.hard_budget_s
        if engine in PEERS and self.suite.soft_budget_s is not None:
            limit = self.suite.soft_budget_s
        if limit is None or self.args.no_time_budget or elapsed <= limit:
            return None
        return (
            f"time budget: {elapsed / 60:.1f} min elapsed > {limit / 60:.0f} min "
            f"({'peers' if engine in PEERS else 'all engines'})"
        )

    def variants(
        self, engine: str, store: str, info: ArchiveInfo, repeat: int
    ) -> list[dict[str, Any]]:
        """What one engine runs on one (store, dataset) in a round."""
        if engine in BARE and store != "local":
            return []  # it reads files
        if engine == "bare_kept" and info.spec.name not in self.suite.kept:
            return []
        if info.spec.name in self.suite.local_only and store != "local":
            return []
        if repeat > 0 and engine in self.suite.once.get(store, ()):
            return []
        if engine in PEERS:
            plan = self.suite.peers.get(store)
            if plan is None or info.spec.name not in self.suite.peer_datasets:
                return []
            if plan.rounds is not None and repeat not in plan.rounds:
                return []
            counts = plan.workers.get(engine, ())
            if plan.sweep and repeat > 0 and counts:
                counts = (self.best_workers(engine, store, info, counts),)
            out = []
            for n in counts:
                cap = plan.max_batches(n)
                out.append({"num_workers": n, **({"max_batches": cap} if cap else {})})
            return out
        return [{}]

    def best_workers(
        self, engine: str, store: str, info: ArchiveInfo, counts: tuple[int, ...]
    ) -> int:
        """The worker count of ``engine`` with the best epoch 1 in round 0 on (store, dataset)
        (the largest count when round 0 measured none); recorded once as a row."""
        key = (engine, store, info.spec.name)
        if key not in self.best:
            rates = {
                r["num_workers"]: r["samples_per_s"]
                for r in self.rows
                if r.get("type") == "measurement"
                and (r["engine"], r["store"], r["dataset"]) == key
                and r["repeat"] == 0
                and r["epoch_kind"] == "epoch1"
            }
            best = max(rates, key=lambda n: rates[n]) if rates else max(counts)
            self.best[key] = best
            self.emit(
                {
                    "type": "best_workers",
                    "engine": engine,
                    "store": store,
                    "dataset": info.spec.name,
                    "num_workers": best,
                    "epoch1_samples_per_s": rates,
                }
            )
        return self.best[key]

    # -- one measurement -----------------------------------------------------------------------
    def measure(
        self, engine: str, store: str, info: ArchiveInfo, repeat: int, variant: dict[str, Any]
    ) -> None:
        where = {"store": store, "dataset": info.spec.name, "repeat": repeat, "variant": variant}
        why = self.unavailable.get((engine, store)) or self.over_budget(engine)
        if why:
            self.skip(engine, why, **where)
            return
        store_cfg, stats_port = self.store_config(store, info)
        cfg: dict[str, Any] = {
            "engine": engine,
            "store": store_cfg,
            "proxy_stats_port": stats_port,
            "variables": info.variables,
            "train_chunks": info.split_chunks["train"],
            "samples": info.samples,
            "batch_size": 32,
            "max_inflight": 32,
            "seed": repeat,
            "epoch_kinds": list(
                self.suite.ceiling_epochs.get(store, EPOCHS) if engine in CEILINGS else EPOCHS
            ),
            **variant,
        }
        if engine == "rawget":
            cfg["objects"] = info.train_objects
        if engine == "decode":  # local: the decode threads read and decode, no event loop
            cfg["local_dispatch"] = "threads"
        cmd = [sys.executable, "-m", "benchmarks.archive_engines"]
        child = run_child(cmd, cfg, self.tmp, self.suite.child_timeout_s)
        if child.result is None:
            self.error(engine, where, child)
            return
        res = child.result
        config = {k: v for k, v in cfg.items() if k not in ("samples", "store", "objects")}
        config.update(
            store_kind=store_cfg["kind"],
            train_chunks=len(info.split_chunks["train"]),
            variables=len(info.variables),
            rss_source=rss_source(),
            latency_ms=self.args.latency_ms if store == "s3" else None,
        )
        whole = child.sampler.peak()
        texts = []
        for ep in res["epochs"]:
            row = self.epoch_row(engine, store, info, ep, child)
            row.update(
                {
                    "type": "measurement",
                    "engine": engine,
                    "role": ROLE[engine],
                    "store": store,
                    "dataset": info.spec.name,
                    "spc": info.spec.samples_per_chunk,
                    "repeat": repeat,
                    "variant": " ".join(f"{k}={v}" for k, v in variant.items()) or None,
                    "num_workers": variant.get("num_workers"),
                    "max_batches": variant.get("max_batches"),
                    "setup_s": res.get("setup_s"),
                    "process_wall_s": child.wall_s,
                    "process_rc": child.rc,
                    "process_rss_peak_MB": _mb(whole["rss_peak_bytes"]),
                    "t_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "config": config,
                }
            )
            self.emit(row)
            texts.append(f"{row['samples_per_s']:8.1f}")
        label = " ".join(f"{k}={v}" for k, v in variant.items())
        print(
            f"[archive] r{repeat} {store:5s} {info.spec.name:8s} {engine:11s} {label:26s} "
            f"{' -> '.join(texts)} samples/s  (process {child.wall_s:5.1f} s)"
        )

    def epoch_row(
        self, engine: str, store: str, info: ArchiveInfo, ep: dict[str, Any], child: ChildResult
    ) -> dict[str, Any]:
        wall = max(ep["wall_s"], 1e-9)
        mem = child.sampler.peak(ep["t_start"], ep["t_end"])
        proxy, engine_io = ep.get("proxy"), ep.get("engine_io")
        extra = ep.get("extra") or {}
        samples = ep["samples"]
        if engine == "rawget":  # it reads exactly the train split's objects
            samples = len(info.samples)
        if store == "s3" and proxy is not None:
            gets, fetched, source = proxy["gets"], proxy["get_body_bytes"], "proxy"
        elif engine_io is not None:
            gets, fetched, source = engine_io["gets"], engine_io["bytes"], "engine"
        elif "objects" in extra:  # the ceilings: one read of each object (none: kept)
            gets, fetched, source = extra.get("gets", extra["objects"]), extra["bytes"], "engine"
        else:
            gets, fetched, source = None, None, "none (no counter)"
        per_sample = len(info.train_objects) / max(len(info.samples), 1)
        return {
            "epoch_kind": ep["kind"],
            "epoch": EPOCHS.index(ep["kind"]) if ep["kind"] in EPOCHS else None,
            "samples": samples,
            "batches": ep["batches"],
            "wall_s": ep["wall_s"],
            "samples_per_s": samples / wall,
            "decoded_MB_per_s": samples * info.decoded_sample_bytes / wall / 1e6,
            "ttfb_s": ep["ttfb_s"] if ROLE[engine] != "ceiling" else None,
            "rss_peak_MB": _mb(mem["rss_peak_bytes"]),
            "rss_at_start_MB": _mb(child.sampler.at(ep["t_start"])),
            "memory_samples": mem["memory_samples"],
            "cpu_s": ep["cpu_s"],
            "gets": gets,
            "bytes_fetched": fetched,
            "io_source": source,
            # stored objects the epoch's samples live in (one sample is this many at chunk 1)
            "objects": extra.get("objects") or round(samples * per_sample),
            "proxy": proxy,
            "engine_io": engine_io,
            "extra": extra,
        }

    # -- the machine's first-touch rate ----------------------------------------------------------
    def first_touch(self, repeat: int) -> None:
        """One fresh process measuring how fast this machine hands out fresh memory
        (``benchmarks/first_touch.py``), at the start of every round: the rate every cold epoch
        of that round pays for its pool and batch memory."""
        out = self.tmp / f"first-touch-{repeat}.json"
        cmd = [sys.executable, "-m", "benchmarks.first_touch"]
        cmd += ["--mib", str(self.suite.first_touch_mib), "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=HERE.parent)
        if done.returncode != 0 or not out.exists():
            tail = (done.stdout + done.stderr)[-1500:]
            print(f"[archive] FAIL first-touch round {repeat}: rc={done.returncode}\n{tail}")
            self.emit(
                {
                    "type": "error",
                    "engine": "first_touch",
                    "repeat": repeat,
                    "status": f"rc={done.returncode}",
                    "log_tail": tail,
                }
            )
            return
        rates = json.loads(out.read_text())
        self.emit({"type": "first_touch", "repeat": repeat, **rates})
        text = ", ".join(
            f"{k.removesuffix('_GBps')} {v:.2f}"
            for k, v in rates.items()
            if k.endswith("_GBps") and v is not None
        )
        print(f"[archive] r{repeat} first touch of fresh memory, GB/s: {text}")

    # -- scale ---------------------------------------------------------------------------------
    def scale(self, spec: ArchiveSpec, data_dir: Path) -> None:
        t0 = time.monotonic()
        path, written = ensure_written(data_dir, spec.folder, spec.to_json(), spec.write)
        if written:
            print(f"[archive] wrote {spec.folder} in {time.monotonic() - t0:.1f} s")
        where = {"store": "local", "dataset": spec.name, "n_time": spec.n_time}
        cfg = {
            "engine": "scale",
            "store": {"kind": "local", "path": str(path)},
            "batch_size": 32,
            "max_seconds": self.suite.scale_max_s,
            "max_batches": self.suite.scale_max_batches,
        }
        cmd = [sys.executable, "-m", "benchmarks.archive_engines"]
        child = run_child(cmd, cfg, self.tmp, self.suite.scale_timeout_s)
        if child.result is None:
            self.error("scale", {**where, "arrays": spec.arrays}, child)
            return
        s = child.result["scale"]
        marks = s["marks"]
        rss = s["ru_maxrss_bytes"]
        hwm = s.get("hwm_bytes") or {}
        row = {
            "type": "scale",
            "engine": "nodes",
            **where,
            "arrays": s["arrays"],
            "train_samples": s["train_samples"],
            "open_s": s["open_s"],
            "split_s": s["split_s"],
            "build_s": s["build_s"],
            "first_batch_s": s["first_batch_s"],
            "batches_after_first": s["batches_after_first"],
            "per_batch_ms": None if s["per_batch_s"] is None else s["per_batch_s"] * 1e3,
            # the process's own peak (VmHWM; None off Linux: then ru_maxrss, see below)
            "peak_rss_MB": _mb(hwm.get("end") if hwm.get("end") is not None else rss["end"]),
            "peak_rss_built_MB": _mb(hwm.get("built")),
            "peak_rss_first_MB": _mb(hwm.get("first")),
            # ru_maxrss: on Linux at least the harness's RSS when it started the child (exec
            # keeps the replaced memory's high-water mark)
            "ru_maxrss_MB": _mb(rss["end"]),
            "tree_rss_peak_MB": _mb(
                child.sampler.peak(marks["start"], marks["end"])["rss_peak_bytes"]
            ),
            "tree_rss_at_start_MB": _mb(child.sampler.at(marks["start"])),
            "process_wall_s": child.wall_s,
            "config": {
                **{k: v for k, v in cfg.items() if k != "store"},
                "spec": spec.to_json(),
                "rss_source": rss_source(),
            },
        }
        self.emit(row)
        per = row["per_batch_ms"]
        print(
            f"[archive] scale {spec.n_time:>8,d} x {spec.arrays:3d}: open {row['open_s']:.2f} s, "
            f"build {row['build_s']:.2f} s, first batch {row['first_batch_s']:.2f} s, "
            f"{'–' if per is None else f'{per:.1f}'} ms/batch, peak RSS {row['peak_rss_MB']:.0f} MB"
        )

    # -- availability --------------------------------------------------------------------------
    def check_tensorstore(self, infos: list[ArchiveInfo]) -> None:
        """tensorstore is optional (the ``bench`` extra); over s3 it must read the stand-in."""
        if importlib.util.find_spec("tensorstore") is None:
            for store in self.args.stores:
                self.unavailable[("tensorstore", store)] = (
                    "tensorstore not installed (pip install -e '.[bench]')"
                )
            return
        if "s3" not in self.args.stores or not infos or self.proxy is None:
            return
        try:
            from benchmarks.archive_engines import TensorstoreSamples

            info = infos[0]
            store_cfg, _ = self.store_config("s3", info)
            probe = TensorstoreSamples(store_cfg, info.samples[:1], info.variables[:1])
            probe[0]
        except Exception as exc:  # the reason goes into the skip rows
            self.unavailable[("tensorstore", "s3")] = (
                f"tensorstore's s3 kvstore could not read the moto stand-in: {exc!r}"[:400]
            )

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> int:
        self.t_run = time.monotonic()
        data_dir = Path(self.args.data) if self.args.data else HERE / "data"
        engines = [e for e in ENGINES if e in self.args.engines]
        infos: list[ArchiveInfo] = []
        for spec in self.suite.datasets:
            if self.args.datasets and spec.name not in self.args.datasets:
                continue
            info, gen_s = prepare(spec, data_dir)
            if gen_s is not None:
                print(f"[archive] wrote dataset {spec.folder} in {gen_s:.1f} s")
            infos.append(info)
        machine = machine_info()
        machine["versions"]["tensorstore"] = _dist_version("tensorstore")
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
                "latency_ms": self.args.latency_ms,
                "batch_size": 32,
                "peer_datasets": list(self.suite.peer_datasets),
                "peers": {k: v.to_json() for k, v in self.suite.peers.items()},
                "ceiling_epochs": {k: list(v) for k, v in self.suite.ceiling_epochs.items()},
                "once": {k: list(v) for k, v in self.suite.once.items()},
                "soft_budget_s": self.suite.soft_budget_s,
                "hard_budget_s": self.suite.hard_budget_s,
                "datasets": [i.to_json() for i in infos],
                "scale": [
                    {**s.to_json(), "arrays": s.arrays}
                    for s in self.suite.scale
                    if not self.args.no_scale
                ],
                "scale_max_s": self.suite.scale_max_s,
                "scale_max_batches": self.suite.scale_max_batches,
                "local_only": list(self.suite.local_only),
                "kept": list(self.suite.kept),
            }
        )
        if "local" in self.args.stores:
            warm = sum(warm_page_cache(i.path) for i in infos)
            print(f"[archive] read every local file once in {warm:.1f} s (page cache warm)")
        if not self.args.no_scale:
            for spec in self.suite.scale:
                self.scale(spec, data_dir)
        with contextlib.ExitStack() as stack:
            if "s3" in self.args.stores:
                _, self.proxy = stack.enter_context(
                    s3_endpoint({i.spec.folder: i.path for i in infos}, self.args.latency_ms)
                )
            if "tensorstore" in engines:
                self.check_tensorstore(infos)
            # Within a round the first dataset (chunk 1: the targets) runs on every store
            # before the next, so the time budget cuts the comparison layouts first.
            for repeat in range(self.suite.repeats):
                self.first_touch(repeat)
                k = repeat % len(engines) if engines else 0
                order = engines[k:] + engines[:k]
                for info in infos:
                    for store in self.args.stores:
                        for engine in order:
                            for variant in self.variants(engine, store, info, repeat):
                                if store == "local":
                                    # before every measurement (seconds when nothing was
                                    # evicted): this machine's kernel reclaims idle page cache
                                    # within minutes, and an epoch 0 that reads from disk
                                    # measures the disk, not the engine
                                    warm_page_cache(info.path)
                                self.measure(engine, store, info, repeat, variant)
        shutil.rmtree(self.tmp, ignore_errors=True)
        total = time.monotonic() - self.t_run
        self.emit({"type": "end", "total_s": total})
        print(f"[archive] {len(self.rows)} rows in {total:.0f} s -> {self.out_path}")
        print_summary(self.rows)
        return 0


def print_summary(rows: list[dict[str, Any]]) -> None:
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        if r.get("type") == "measurement":
            key = (r["store"], r["dataset"], r["engine"], r["variant"] or "", r["epoch_kind"])
            groups.setdefault(key, []).append(r["samples_per_s"])
    for key in sorted(groups):
        vals = groups[key]
        print(
            f"  {key[0]:5s} {key[1]:8s} {key[2]:11s} {key[3]:26s} {key[4]:6s} "
            f"median {statistics.median(vals):9.1f} samples/s (n={len(vals)})"
        )


def check_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Problems with a run's rows (empty = the harness works): every (engine, store, dataset,
    variant) the run planned has both epochs with complete fields, or a skip row with a reason
    (a missing optional peer, the time budget); nodes, bare, decode and rawget are never
    skipped for want of a package; every scale store has its row; no error rows."""
    problems = []
    run = next((r for r in rows if r.get("type") == "run"), None)
    if run is None:
        return ["no 'run' row"]
    if not any(r.get("type") == "end" for r in rows):
        problems.append("no 'end' row")
    for r in rows:
        if r.get("type") == "error":
            where = f"{r.get('store')}/{r.get('dataset')} {r.get('variant') or ''}"
            problems.append(f"error row: {r.get('engine')} {where} {r.get('status')}")
        if r.get("type") == "skip" and not r.get("reason"):
            problems.append(f"skip row without a reason: {r}")
        budget = "time budget" in str(r.get("reason"))
        if r.get("type") == "skip" and r["engine"] not in PEERS and not budget:
            problems.append(f"{r['engine']} skipped: {r['reason']}")
    measured: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    skipped: set[tuple[Any, ...]] = set()
    for r in rows:
        key = (r.get("engine"), r.get("store"), r.get("dataset"), _variant_key(r.get("variant")))
        if r.get("type") == "measurement":
            measured.setdefault(key, []).append(r)
        elif r.get("type") == "skip":
            skipped.add(key)
    for d in run["datasets"]:
        for store in run["stores"]:
            for engine in run["engines"]:
                for variant in _planned(run, engine, store, d["name"]):
                    key = (engine, store, d["name"], variant)
                    mine = measured.get(key, [])
                    where = f"{engine} {variant} on {store}/{d['name']}".replace("  ", " ")
                    if not mine and key not in skipped:
                        problems.append(f"no rows for {where}")
                    problems += _check_measurements(run, engine, store, d, mine, where)
    touched = {r["repeat"] for r in rows if r.get("type") == "first_touch"}
    rounds = {r["repeat"] for r in rows if r.get("type") == "measurement"}
    for rep in sorted(rounds - touched):
        problems.append(f"no first-touch row for round {rep}")
    scale = {(r["n_time"], r["arrays"]) for r in rows if r.get("type") == "scale"}
    for s in run.get("scale", []):
        if (s["n_time"], s["arrays"]) not in scale:
            problems.append(f"no scale row for {s['n_time']} x {s['arrays']}")
    for r in rows:
        if r.get("type") == "scale":
            missing = [f for f in SCALE_FIELDS if r.get(f) is None]
            if missing:
                problems.append(f"scale {r['n_time']} x {r['arrays']}: missing {missing}")
    return problems


def _variant_key(variant: Any) -> str:
    """One spelling of a variant for matching rows: ``num_workers=2`` (the epoch cap aside)."""
    if isinstance(variant, dict):
        variant = " ".join(f"{k}={v}" for k, v in variant.items())
    parts = [p for p in str(variant or "").split() if not p.startswith("max_batches=")]
    return " ".join(parts)


def _planned(run: dict[str, Any], engine: str, store: str, dataset: str) -> list[str]:
    """The variants the run planned for one engine on one (store, dataset), in any round."""
    if engine in BARE and store != "local":
        return []
    if engine == "bare_kept" and dataset not in run.get("kept", []):
        return []
    if dataset in run.get("local_only", []) and store != "local":
        return []
    if engine not in PEERS:
        return [""]
    plan = (run.get("peers") or {}).get(store)
    if plan is None or dataset not in run["peer_datasets"]:
        return []
    return [f"num_workers={n}" for n in plan["workers"].get(engine, [])]


def _check_measurements(
    run: dict[str, Any],
    engine: str,
    store: str,
    dataset: dict[str, Any],
    rows: list[dict[str, Any]],
    where: str,
) -> list[str]:
    problems = []
    for r in rows:
        missing = [f for f in REQUIRED_FIELDS if f not in r]
        if missing:
            problems.append(f"{where}: missing fields {missing}")
        if not r.get("samples") or not r.get("samples_per_s"):
            problems.append(f"{where} {r['epoch_kind']}: no samples")
        if r.get("rss_peak_MB") is None:
            problems.append(f"{where} {r['epoch_kind']}: no RSS")
        # a later epoch of nodes may read nothing: a split that fits the budget is kept in the
        # pool (plan.schedule.kept_bytes); every other epoch reads, and says how much
        kept = (
            engine in ("nodes", "bare_kept")
            and r.get("epoch_kind") != "epoch0"
            and r.get("gets") == 0
        )
        if engine != "tensorstore" and not r.get("gets") and not kept:
            problems.append(f"{where} {r['epoch_kind']}: no GET count")
        if engine == "nodes":
            if r["samples"] != dataset["train_samples"]:
                problems.append(f"{where}: {r['samples']} samples, not the train split's")
            if not (r.get("extra") or {}).get("report"):
                problems.append(f"{where} {r['epoch_kind']}: no epoch report")
    epochs = EPOCHS
    if engine in CEILINGS:
        epochs = tuple((run.get("ceiling_epochs") or {}).get(store, EPOCHS))
    for rep in {r["repeat"] for r in rows}:
        kinds = sorted(r["epoch_kind"] for r in rows if r["repeat"] == rep)
        if kinds != sorted(epochs):
            problems.append(f"{where} round {rep}: epochs {kinds}, expected {list(epochs)}")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("full", "smoke"), default="full")
    p.add_argument("--out", help="folder for the JSONL (default benchmarks/results)")
    p.add_argument("--data", help="folder for the datasets (default benchmarks/data)")
    p.add_argument("--repeats", type=int, help="rounds (default: 3 full, 1 smoke)")
    p.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--datasets", nargs="+", help="dataset names of the suite to run")
    p.add_argument(
        "--latency-ms", type=float, default=10.0, help="proxy delay per request (default 10)"
    )
    p.add_argument("--no-scale", action="store_true", help="skip the scale rows")
    p.add_argument(
        "--no-time-budget",
        action="store_true",
        help="never skip measurements to stay within the suite's time budget",
    )
    p.add_argument("--check", action="store_true", help="assert complete rows (smoke)")
    return p.parse_args(argv)


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
    harness = ArchiveHarness(args, suite, out)
    rc = harness.run()
    if args.check:
        problems = check_rows(harness.rows)
        for problem in problems:
            print(f"[archive] CHECK FAILED: {problem}")
        if problems:
            return 1
        print(f"[archive] check passed: {len(harness.rows)} rows")
    return rc


if __name__ == "__main__":
    sys.exit(main())
