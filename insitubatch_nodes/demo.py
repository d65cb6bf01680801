"""``make demo``: train a small forecaster in place on a zarr store.

By default it writes a synthetic ERA5-like store to ``data/era5_demo.zarr`` (once), prints its
geometry, the split and one epoch's read plan, then trains a small convolutional network to
predict ``t2m`` at ``t+1`` from ``t2m`` at ``t`` for a few epochs on the CPU, printing the epoch
report (:meth:`~insitubatch_nodes.pipeline.InSituPipeline.report`) after each. ``--url`` trains
from any store instead (``s3://bucket/path.zarr --endpoint http://127.0.0.1:9000 ...``); a
CF-encoded field (a netCDF-converted ``int16`` packed one) is decoded as xarray decodes it, in
``float32`` (``open_geometries(..., cf_dtype="float32")``), and normalised by its decoded values.
Where the array has a time coordinate, the split (80/10/10 whole chunks) is in time order,
``train`` the earliest times, and the target the next time, also in a store written newest
first; without one, in index order.

``--cache-dir DIR`` shows the persistent chunk cache: the demo runs twice, each time in a fresh
process with ``insitu_pipeline(..., cache_dir=DIR, persist=True)``. The first run warms the
cache (it fetches and decodes every chunk it reads, and keeps them in ``DIR``); the second
finds it warm and reads its chunks from disk. At the end it prints, per run, the first batch's
latency, the epoch times, the GETs and the chunks revived from ``DIR``.

Run ``python -m insitubatch_nodes.demo --help`` for the options.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.coords import coordinate_reader
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import open_store
from insitubatch_nodes.lightning_splits import sample_times
from insitubatch_nodes.pipeline import insitu_pipeline
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.splits import SplitManifest, split_by_chunk
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.synthetic.era5 import make_era5_like

DEFAULT_PATH = Path("data") / "era5_demo.zarr"


def _positive(text: str) -> int:
    """A count flag's value: a positive integer (``--epochs 0`` trained nothing and compared
    the losses of no batches)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: a positive integer")
    return n


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m insitubatch_nodes.demo", description=__doc__)
    p.add_argument("--url", help="store URL or path to train from (default: the synthetic store)")
    p.add_argument("--variable", default="t2m", help="array to forecast (default: t2m)")
    p.add_argument("--endpoint", help="S3 endpoint URL (e.g. http://127.0.0.1:9000)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--access-key-id", help="S3 access key id")
    p.add_argument("--secret-access-key", help="S3 secret access key")
    p.add_argument(
        "--anonymous",
        "--skip-signature",
        dest="anonymous",
        action="store_true",
        help="read a public bucket without credentials (open_store(..., anonymous=True))",
    )
    p.add_argument("--allow-http", action="store_true", help="allow http:// endpoints")
    p.add_argument("--epochs", type=_positive, default=3)
    p.add_argument("--batch-size", type=_positive, default=32)
    p.add_argument("--block-chunks", type=_positive, default=8)
    p.add_argument("--max-inflight", type=_positive, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--plan-only", action="store_true", help="print the plan summary and stop")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument(
        "--cache-dir",
        help="run the demo twice in fresh processes with a persistent chunk cache in this "
        "folder: the first run warms it, the second reads it from disk",
    )
    # Internal: set by the --cache-dir parent on its two child processes.
    p.add_argument("--cache-run", type=int, choices=(1, 2), help=argparse.SUPPRESS)
    p.add_argument("--cache-report", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name in ("endpoint", "region", "access_key_id", "secret_access_key"):
        if getattr(args, name):
            opts[name] = getattr(args, name)
    if args.anonymous:
        opts["anonymous"] = True
    if args.allow_http:
        opts["client_options"] = {"allow_http": True}
    return opts


def describe(geom: ArrayGeometry, manifest: SplitManifest, node: ReadPlanNode) -> str:
    """A human summary of the geometry, the split and epoch 0's read plan."""
    plan = node.epoch_plan(0)
    reads = collections.Counter(k for b in range(plan.n_batches) for k in plan.batch_fetches(b))
    per_chunk = collections.Counter(reads.values())
    distinct = len(reads)
    tiles = sum(node.views[label].n_tiles for label in node.views) // len(node.views)
    lines = [
        f"array      {geom.path}: shape {geom.shape}, stored chunk {geom.chunks}, {geom.dtype}, "
        f"sample axis {geom.sample_axis}",
        f"           {geom.n_samples} samples in {geom.n_chunks} chunks of "
        f"{geom.samples_per_chunk}; sample payload {geom.inner_shape} "
        f"({geom.sample_nbytes / 1024:.0f} KiB); {geom.n_tiles} stored object(s) per chunk",
        "split      "
        + ", ".join(
            f"{s}: {len(manifest.chunks(s))} chunks / {len(manifest.samples(s))} samples"
            for s in ("train", "val", "test")
        ),
        f"read plan  epoch 0 of 'train': {plan.n_samples} samples in {plan.n_batches} batches "
        f"of {plan.batch_size} (last {plan.n_samples - (plan.n_batches - 1) * plan.batch_size}),"
        f" {plan.n_blocks} blocks of {plan.block_chunks} chunks",
        f"           {distinct} distinct chunk rows (~{distinct * tiles} stored objects), "
        f"reads per chunk: {dict(sorted(per_chunk.items()))}; live peak {plan.live_peak()} "
        f"chunks; shuffle quality {plan.shuffle_quality():.3f}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.cache_dir is not None and args.cache_run is None:
        if args.plan_only:
            print("--cache-dir runs the training twice: it cannot be combined with --plan-only")
            return 2
        if _open(args) is None:
            return 2
        return _two_cached_runs(args, argv)
    opened = _open(args)
    if opened is None:
        return 2
    store, geom, reader = opened
    # in time order (train the earliest times), the target the next time: also where the
    # store is written newest first (before 2026-12-07 the index order, which trained such a
    # store on its newest times and had it forecast the time before)
    time = sample_times(store, geom, reader)
    manifest = split_by_chunk(geom, (0.8, 0.1, 0.1), coord=time)
    views = {"x": geom, "y": geom.shift(-1 if time is not None and time.decreasing else 1)}
    config = PlanConfig(batch_size=args.batch_size, block_chunks=args.block_chunks)
    node = ReadPlanNode(manifest, views, config=config)
    print(describe(geom, manifest, node), flush=True)
    if args.plan_only:
        return 0
    return _train(args, store, geom, manifest, views, reader)


#: What the demo's flags are for the errors ``open_store`` and the first read raise (their
#: advice names ``open_store``'s options, which a demo user passes as these flags).
_STORE_FLAGS = (
    "the demo's store flags: --endpoint URL and --region for an S3-compatible server; "
    "--allow-http for an http:// endpoint; --access-key-id and --secret-access-key (or "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment) for a private bucket; "
    "--anonymous for a public one; --variable for the array to train on"
)


def _open(args: argparse.Namespace) -> tuple[Any, ArrayGeometry, Any] | None:
    """The store, the ``--variable`` array's geometry and the coordinate reader that read it
    (the split and the pipeline read through it: each document and the time coordinate
    once); ``None`` (after printing why, with the flags that change it) when ``--url`` cannot
    be opened or read."""
    try:
        store = _prepare_store(args)
        reader = coordinate_reader(store)
        # CF-encoded fields (an int16 packed one decodes to float64) arrive in float32
        found = open_geometries(store, [args.variable], cf_dtype="float32", coords_reader=reader)
        geom = found[args.variable]
    except (PermissionError, FileNotFoundError, KeyError, ValueError) as exc:
        if args.url is None:
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: cannot train from {args.url}: {message}\n{_STORE_FLAGS}", file=sys.stderr)
        return None
    return store, geom, reader


def _prepare_store(args: argparse.Namespace) -> Any:
    """The store to train from: ``--url``, or the synthetic store (written once)."""
    if args.url is None:
        if not (DEFAULT_PATH / "zarr.json").exists():
            print(f"writing the synthetic ERA5-like store to {DEFAULT_PATH} ...", flush=True)
            t0 = time.perf_counter()
            make_era5_like(DEFAULT_PATH, n_time=1024, n_lat=48, n_lon=96, samples_per_chunk=16)
            print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)
        return open_store(DEFAULT_PATH)
    return open_store(args.url, **_store_options(args))


def _two_cached_runs(args: argparse.Namespace, argv: list[str]) -> int:
    """``--cache-dir``: the demo twice, each in a fresh child process over the same cache
    folder (the first warms it, the second reads it), then what each run measured."""
    import insitubatch_nodes

    # The children import the package this process runs (not another install of it).
    root = str(Path(insitubatch_nodes.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="insitubatch-demo-") as tmp:
        for run in (1, 2):
            what = "warms the cache" if run == 1 else "reads the warm cache"
            print(
                f"\n=== run {run} of 2 ({what} in {args.cache_dir}): a fresh process ===",
                flush=True,
            )
            report = Path(tmp) / f"run{run}.json"
            cmd = [sys.executable, "-m", "insitubatch_nodes.demo", *argv]
            cmd += ["--cache-run", str(run), "--cache-report", str(report)]
            rc = _run_child(cmd, env)
            if not report.is_file():
                print(f"run {run} failed (exit status {rc})")
                return rc or 1
            runs.append({**json.loads(report.read_text()), "rc": rc})
    print(f"\npersistent chunk cache in {args.cache_dir}:")
    for run, r in enumerate(runs, 1):
        epochs = ", ".join(
            f"{t:.2f} s ({w:.2f} s waiting for data)"
            for t, w in zip(r["epoch_s"], r["wait_s"], strict=True)
        )
        print(
            f"  run {run} (pid {r['pid']}): first batch after {r['first_batch_s']:.3f} s; "
            f"epoch 0: {r['gets']} GETs, {r['disk_hits']} chunks read from the cache; "
            f"epochs: {epochs}"
        )
    first, second = runs
    print(
        f"  with the warm cache: the first batch after {second['first_batch_s']:.3f} s instead "
        f"of {first['first_batch_s']:.3f} s; epoch 0 waited {second['wait_s'][0]:.2f} s for "
        f"data instead of {first['wait_s'][0]:.2f} s"
    )
    return max(r["rc"] for r in runs)


def _run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run one child, passing its standard output through this process's (line by line)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
    return proc.returncode


def _train(
    args: argparse.Namespace,
    store: Any,
    geom: ArrayGeometry,
    manifest: SplitManifest,
    views: dict[str, ArrayGeometry],
    reader: Any,
) -> int:
    import torch

    from insitubatch_nodes.batch import to_torch

    torch.manual_seed(args.seed)
    cache: dict[str, Any] = {}
    if args.cache_dir is not None:
        cache = {"cache_dir": args.cache_dir, "persist": True}
    pipe = insitu_pipeline(
        store,
        manifest,
        views,
        batch_size=args.batch_size,
        block_chunks=args.block_chunks,
        max_inflight=args.max_inflight,
        seed=args.seed,
        coords_reader=reader,
        **cache,
    )
    if len(geom.inner_shape) != 2:
        print(f"the demo model expects 2-D fields; {geom.path} has {geom.inner_shape}")
        return 2
    sample = pipe.stages.plan.epoch_plan(0)
    mean, std = _stats(reader.array(geom.path), geom, manifest)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 5, padding=2, padding_mode="circular"),
        torch.nn.GELU(),
        torch.nn.Conv2d(16, 16, 5, padding=2, padding_mode="circular"),
        torch.nn.GELU(),
        torch.nn.Conv2d(16, 1, 5, padding=2, padding_mode="circular"),
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    bar = None if args.no_progress else _tqdm()
    print(
        f"training: {sample.n_batches} batches/epoch, batch {args.batch_size}, "
        f"{args.epochs} epochs, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    first_losses: list[float] = []
    last_losses: list[float] = []
    # What --cache-dir's summary shows: per epoch, the wall time and the part of it the loop
    # spent waiting for batches; epoch 0's first-batch latency, GETs and chunks read from disk.
    timing: dict[str, Any] = {"pid": os.getpid(), "epoch_s": [], "wait_s": []}
    with pipe:
        for epoch in range(args.epochs):
            losses: list[float] = []
            before = pipe.stats()
            t_start = t_asked = time.perf_counter()
            wait = 0.0
            iterator = iter(pipe)
            progress = bar(total=len(pipe), desc=f"epoch {epoch}", leave=False) if bar else None
            for batch in iterator:
                wait += time.perf_counter() - t_asked
                if not losses and epoch == 0:
                    timing["first_batch_s"] = time.perf_counter() - t_start
                t = to_torch(batch)
                x = ((t["x"].float() - mean) / std).unsqueeze(1)  # (a float64 field too)
                y = ((t["y"].float() - mean) / std).unsqueeze(1)
                loss = torch.nn.functional.mse_loss(model(x) + x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{losses[-1]:.4f}")
                t_asked = time.perf_counter()
            timing["epoch_s"].append(time.perf_counter() - t_start)
            timing["wait_s"].append(wait)
            if epoch == 0:
                after = pipe.stats()
                timing["gets"] = after["gets"] - before["gets"]
                timing["disk_hits"] = after.get("disk_hits", 0) - before.get("disk_hits", 0)
            if progress is not None:
                progress.close()
            print(
                f"epoch {epoch}: loss {np.mean(losses[:5]):.4f} -> {np.mean(losses[-5:]):.4f}",
                flush=True,
            )
            print(pipe.report(), flush=True)  # where the time went, and what limits the epoch
            if epoch == 0:
                first_losses = losses[:5]
            last_losses = losses[-5:]
            pipe.reset()
    if args.cache_report:
        Path(args.cache_report).write_text(json.dumps(timing))
    falling = float(np.mean(last_losses)) < float(np.mean(first_losses))
    print(
        f"loss {'fell' if falling else 'did NOT fall'}: "
        f"{np.mean(first_losses):.4f} -> {np.mean(last_losses):.4f}"
    )
    return 0 if falling else 1


def _stats(arr: Any, geom: ArrayGeometry, manifest: SplitManifest) -> tuple[float, float]:
    """Mean/std of the first train chunk of the zarr array ``arr`` (``geom``'s, its metadata
    read already), read through zarr (cheap normalisation) and decoded as the batches are (CF
    mask and scale: masked points are NaN, skipped)."""
    first = manifest.chunks("train")[0]
    start, stop = geom.chunk_range(first)
    index = [slice(None)] * geom.ndim
    index[geom.sample_axis] = slice(start, stop)
    data = np.asarray(arr[tuple(index)])
    if geom.cf is not None:
        data = geom.cf.decode(data)
    data = data.astype(np.float64)
    return float(np.nanmean(data)), float(np.nanstd(data) or 1.0)


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the demo/dev extras
        return None
    return tqdm


if __name__ == "__main__":
    sys.exit(main())
