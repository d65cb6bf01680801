"""Forecast samples on an hourly archive as stored: this engine against today's best route.

A GraphCast-style input: 2 input steps (t-6h, t) and 4 target steps (t+6h ... t+24h), anchors
every 6 hours, read from an hourly ARCO-ERA5-like store written by xarray (one step per chunk,
``--levels`` pressure levels whole in each chunk, blosc). Each engine runs in a fresh process
(so its peak RSS and its first epoch are its own), two epochs:

* ``nodes``: one ``geom.window(["-6h", "0h", "6h", "12h", "18h", "24h"])`` view per variable and
  ``stride="6h"``: every batch holds ``(batch, 6, *field)`` per variable;
* ``shifts``: today's best route: ``6 x variables`` ``shift()`` views over a hand-built manifest
  listing only the on-grid (00/06/12/18 UTC) chunks, and a batch transform that stacks each
  variable's six labels into ``(batch, 6, *field)`` (a second copy of every batch);
* ``xarray``: ``xr.open_zarr(store, chunks=None)`` and a map-style dataset whose item reads one
  anchor's six steps of every variable (``ds[v].isel(time=anchor + offsets).values``), in a
  ``DataLoader(batch_size, shuffle=True, num_workers=2)``;
* ``bare``: two threads reading and blosc-decoding every on-grid object once per epoch into
  reused buffers, nothing else (samples/s counts the anchors those objects serve);
* ``deliver``: the ceiling for windows: ``bare`` plus the copies a batch of windows needs
  (each decoded step into the ``(row, t)`` slice of every window reading it, reused buffers):
  a window batch holds each step up to six times, so it delivers ~4x the bytes it decodes.

Reported per engine and epoch: samples/s, objects and bytes read, peak RSS; for ``nodes`` also
the batch buffers' bytes against the delivered tensors', and the bytes of the on-grid objects
(what an epoch must read, exactly). Ratios are taken within one run.
``python -m benchmarks.forecast [--steps 480] [--out benchmarks/results] [--check]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._childutil import proc_status_bytes

ROOT = Path(__file__).resolve().parent.parent
LEVEL_VARS = (
    "temperature",
    "geopotential",
    "u_component_of_wind",
    "v_component_of_wind",
    "specific_humidity",
    "vertical_velocity",
)
SURFACE_VARS = (
    "2m_temperature",
    "10m_u_component_of_wind",
    "10m_v_component_of_wind",
    "mean_sea_level_pressure",
)
OFFSETS_H = (-6, 0, 6, 12, 18, 24)
STRIDE_H = 6
PRESSURE_LEVELS = (
    1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100, 125, 150, 175, 200, 225, 250, 300, 350, 400, 450,
    500, 550, 600, 650, 700, 750, 775, 800, 825, 850, 875, 900, 925, 950, 975, 1000,
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------


def write_store(path: Path, steps: int, levels: int, lat: int, lon: int) -> None:
    """An hourly ARCO-ERA5-like store written by xarray: one step per chunk, every level of a
    step in its chunk, blosc (lz4, byte shuffle), a CF-encoded hourly time coordinate."""
    import pandas as pd
    import xarray as xr
    import zarr

    times = pd.date_range("2020-01-01T00:00", periods=steps, freq="h")
    lats = np.linspace(90, -90, lat, dtype="f4")  # descending, as ERA5
    lons = np.linspace(0, 360, lon, endpoint=False, dtype="f4")
    lv = np.asarray(PRESSURE_LEVELS[:levels], dtype="i4")
    rng = np.random.default_rng(0)
    hours = np.arange(steps, dtype="f4")[:, None, None]
    base = np.sin(np.deg2rad(lats))[None, :, None] + np.cos(np.deg2rad(lons))[None, None, :]
    data_vars: dict[str, Any] = {}
    for i, name in enumerate(SURFACE_VARS):
        field = base + np.sin(hours / 24.0 + i) + rng.normal(0, 0.01, (steps, lat, lon))
        data_vars[name] = (("time", "latitude", "longitude"), field.astype("f4"))
    for i, name in enumerate(LEVEL_VARS):
        field = (base + np.sin(hours / 24.0 + i))[:, None] + lv[None, :, None, None] / 1000.0
        field = field + rng.normal(0, 0.01, (steps, levels, lat, lon))
        data_vars[name] = (("time", "level", "latitude", "longitude"), field.astype("f4"))
    ds = xr.Dataset(
        data_vars,
        coords={"time": times, "level": lv, "latitude": lats, "longitude": lons},
    )
    blosc = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    encoding: dict[str, Any] = {}
    for name, var in ds.data_vars.items():
        encoding[name] = {"chunks": (1, *var.shape[1:]), "compressors": (blosc,)}
    ds.to_zarr(str(path), encoding=encoding, zarr_format=3, consolidated=True, mode="w")


def variables() -> list[str]:
    return [*LEVEL_VARS, *SURFACE_VARS]


def anchors(steps: int) -> np.ndarray:
    """The anchors every engine serves: every 6th hour whose whole window lies in the store."""
    lo, hi = -min(OFFSETS_H), steps - max(OFFSETS_H)
    a = np.arange(steps)
    return a[(a % STRIDE_H == 0) & (a >= lo) & (a < hi)]


def on_grid_steps(steps: int) -> np.ndarray:
    """Every step some anchor's window touches (all on the 6-hour grid)."""
    a = anchors(steps)
    return np.unique((a[:, None] + np.asarray(OFFSETS_H)[None, :]).ravel())


def on_grid_objects(store: Path, steps: int) -> tuple[list[tuple[str, Path]], int]:
    """``(variable, file)`` of every stored object of an on-grid step, and their total bytes."""
    import zarr

    out: list[tuple[str, Path]] = []
    for name in variables():
        arr = zarr.open_array(store=str(store / name), mode="r")
        for t in on_grid_steps(steps).tolist():
            coords = (t,) + (0,) * (arr.ndim - 1)
            out.append((name, store / name / arr.metadata.encode_chunk_key(coords)))
    return out, sum(p.stat().st_size for _, p in out)


# --------------------------------------------------------------------------------------------
# Engines (each in a fresh process)
# --------------------------------------------------------------------------------------------


def _rss_peak_bytes() -> int:
    return proc_status_bytes("VmHWM") or 0


def _epochs(run_epoch: Any, n: int) -> list[dict[str, Any]]:
    out = []
    for e in range(n):
        t0 = time.perf_counter()
        samples, extra = run_epoch(e)
        wall = time.perf_counter() - t0
        out.append({"epoch": e, "samples": samples, "seconds": wall, **extra})
    return out


def _run_pipeline(pipe: Any, cfg: dict[str, Any], setup_s: float) -> dict[str, Any]:
    """``cfg["epochs"]`` epochs of ``pipe`` (then closed): samples, seconds, objects and bytes
    read per epoch; the batch buffers held against the delivered batch's bytes."""
    last = {"gets": 0, "bytes": 0}
    delivered = 0

    def epoch(e: int) -> tuple[int, dict[str, Any]]:
        nonlocal delivered
        if e:
            pipe.reset()
        n = 0
        for batch in pipe:
            n += len(batch)
            delivered = max(delivered, sum(a.nbytes for a in batch.arrays.values()))
        s = pipe.stats()
        gets, nbytes = s["gets"] - last["gets"], s["bytes_fetched"] - last["bytes"]
        last.update(gets=s["gets"], bytes=s["bytes_fetched"])
        return n, {"objects": gets, "bytes": nbytes}

    epochs = _epochs(epoch, cfg["epochs"])
    stats = pipe.stats()
    # a set is one buffer per label the gather assembles
    sets = pipe.stages.gather.buffer_allocations / len(pipe.stages.gather.buffers.layout.views)
    pipe.close()
    return {
        "setup_s": setup_s,
        "epochs": epochs,
        "batch_buffer_bytes": stats["batch_buffer_bytes"],
        "batch_buffer_sets": sets,
        "delivered_batch_bytes": delivered,
        "rss_peak_bytes": _rss_peak_bytes(),
    }


def run_nodes(cfg: dict[str, Any]) -> dict[str, Any]:
    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

    t0 = time.perf_counter()
    store = cfg["store"]
    geoms = open_geometries(store, variables())
    views = {v: g.window([f"{h}h" for h in OFFSETS_H]) for v, g in geoms.items()}
    manifest = split_by_chunk(geoms[LEVEL_VARS[0]], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        store, manifest, views, batch_size=cfg["batch_size"], stride=f"{STRIDE_H}h", coords=()
    )
    return _run_pipeline(pipe, cfg, time.perf_counter() - t0)


def run_shifts(cfg: dict[str, Any]) -> dict[str, Any]:
    from insitubatch_nodes import Batch, SplitManifest, insitu_pipeline, open_geometries

    t0 = time.perf_counter()
    store, steps = cfg["store"], cfg["steps"]
    geoms = open_geometries(store, variables())
    views = {f"{v}@{h}": g.shift(h) for v, g in geoms.items() for h in OFFSETS_H}
    grid = tuple(int(t) for t in np.arange(0, steps, STRIDE_H))
    manifest = SplitManifest(
        array=LEVEL_VARS[0],
        n_samples=steps,
        samples_per_chunk=1,
        splits={"train": grid, "val": (), "test": ()},
    )

    def stack(batch: Batch) -> Batch:
        arrays = batch.arrays
        batch.arrays = {v: np.stack([arrays[f"{v}@{h}"] for h in OFFSETS_H], axis=1) for v in geoms}
        return batch

    pipe = insitu_pipeline(
        store, manifest, views, batch_size=cfg["batch_size"], batch_transforms=[stack], coords=()
    )
    return _run_pipeline(pipe, cfg, time.perf_counter() - t0)


class XarrayWindows:
    """Map-style dataset: item ``i`` is anchor ``anchors[i]``'s six steps of every variable,
    read through xarray (opened lazily in each worker)."""

    def __init__(self, store: str, anchors: np.ndarray) -> None:
        self.store, self.anchors, self.ds = store, anchors, None

    def __len__(self) -> int:
        return len(self.anchors)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        import xarray as xr

        if self.ds is None:
            self.ds = xr.open_zarr(self.store, chunks=None)
        steps = int(self.anchors[i]) + np.asarray(OFFSETS_H)
        return {v: self.ds[v].isel(time=steps).values for v in variables()}


def run_xarray(cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    data = XarrayWindows(cfg["store"], anchors(cfg["steps"]))
    loader = DataLoader(
        data,
        batch_size=cfg["batch_size"],
        shuffle=True,
        drop_last=True,
        num_workers=cfg["workers"],
        multiprocessing_context="spawn" if cfg["workers"] else None,
        persistent_workers=bool(cfg["workers"]),
    )
    setup_s = time.perf_counter() - t0

    def epoch(e: int) -> tuple[int, dict[str, Any]]:
        n = 0
        for batch in loader:
            n += len(next(iter(batch.values())))
        # every item reads each of its six steps' objects of every variable
        return n, {"objects": n * len(OFFSETS_H) * len(variables())}

    epochs = _epochs(epoch, cfg["epochs"])
    return {"setup_s": setup_s, "epochs": epochs, "rss_peak_bytes": _rss_peak_bytes()}


def run_bare(cfg: dict[str, Any]) -> dict[str, Any]:
    """Two threads, each reading every other on-grid object whole and blosc-decoding it into
    a buffer it reuses; the anchors served are counted as the samples."""
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs
    import zarr

    t0 = time.perf_counter()
    store = Path(cfg["store"])
    jobs, _ = on_grid_objects(store, cfg["steps"])
    shapes = {}
    for name in variables():
        arr = zarr.open_array(store=str(store / name), mode="r")
        codecs = [type(c).__name__ for c in arr.metadata.codecs]
        if codecs != ["BytesCodec", "BloscCodec"]:
            raise ValueError(f"{name}: the bare loop decodes plain blosc chunks, not {codecs}")
        shapes[name] = (arr.chunks, arr.dtype)
    threads = 2
    shares = [jobs[i::threads] for i in range(threads)]
    codec = numcodecs.Blosc()
    buffers = [{n: np.ones(s, d) for n, (s, d) in shapes.items()} for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda _: None, range(threads)))
    n_anchors = len(anchors(cfg["steps"]))
    setup_s = time.perf_counter() - t0

    def work(i: int) -> int:
        nbytes = 0
        for name, path in shares[i]:
            with open(path, "rb", buffering=0) as fh:
                raw = fh.read()
            codec.decode(raw, out=buffers[i][name])
            nbytes += len(raw)
        return nbytes

    def epoch(e: int) -> tuple[int, dict[str, Any]]:
        nbytes = sum(pool.map(work, range(threads)))
        return n_anchors, {"objects": len(jobs), "bytes": nbytes}

    epochs = _epochs(epoch, cfg["epochs"])
    pool.shutdown()
    return {"setup_s": setup_s, "epochs": epochs, "rss_peak_bytes": _rss_peak_bytes()}


def run_deliver(cfg: dict[str, Any]) -> dict[str, Any]:
    """The bare loop plus the copies a window batch needs: each on-grid object, once decoded,
    copied into the ``(row, t)`` slice of every anchor's window that reads it, in batch
    buffers of ``(batch, 6, *field)`` per array reused from batch to batch (two threads, each
    its own buffers and its share of the anchors' batches). The ceiling for delivering
    windows: the decode of ``bare`` and the unavoidable copies, nothing else."""
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs
    import zarr

    t0 = time.perf_counter()
    store = Path(cfg["store"])
    arrays = {n: zarr.open_array(store=str(store / n), mode="r") for n in variables()}
    keys = {
        n: {t: store / n / a.metadata.encode_chunk_key((t,) + (0,) * (a.ndim - 1))
            for t in on_grid_steps(cfg["steps"]).tolist()}
        for n, a in arrays.items()
    }  # fmt: skip
    a_all = anchors(cfg["steps"])
    bs, threads = cfg["batch_size"], 2
    batches = [a_all[i : i + bs] for i in range(0, len(a_all), bs)]
    codec = numcodecs.Blosc()
    shapes = {n: (a.shape[1:], a.dtype) for n, a in arrays.items()}
    bufs = [
        {n: np.ones((bs, len(OFFSETS_H), *shp), dt) for n, (shp, dt) in shapes.items()}
        for _ in range(threads)
    ]
    decoded = [{n: np.ones(shp, dt) for n, (shp, dt) in shapes.items()} for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda _: None, range(threads)))
    setup_s = time.perf_counter() - t0

    def work(i: int) -> int:
        # this thread's batches; each step's object decoded once for the batch, copied to
        # every (row, t) that reads it (a thread re-decodes a step its neighbour's batch
        # shares: at most the window's span per batch)
        nbytes = 0
        for batch in batches[i::threads]:
            steps = batch[:, None] + np.asarray(OFFSETS_H)[None, :]
            for name in variables():
                out, dec = bufs[i][name], decoded[i][name]
                for t in np.unique(steps).tolist():
                    with open(keys[name][t], "rb", buffering=0) as fh:
                        raw = fh.read()
                    codec.decode(raw, out=dec)
                    nbytes += len(raw)
                    for r, k in zip(*np.nonzero(steps == t), strict=True):
                        out[r, k] = dec
        return nbytes

    def epoch(e: int) -> tuple[int, dict[str, Any]]:
        nbytes = sum(pool.map(work, range(threads)))
        return len(a_all), {"bytes": nbytes}

    epochs = _epochs(epoch, cfg["epochs"])
    pool.shutdown()
    return {"setup_s": setup_s, "epochs": epochs, "rss_peak_bytes": _rss_peak_bytes()}


ENGINES = {
    "nodes": run_nodes,
    "shifts": run_shifts,
    "xarray": run_xarray,
    "bare": run_bare,
    "deliver": run_deliver,
}


def _child(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    result = ENGINES[cfg["engine"]](cfg)
    Path(argv[1]).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# The harness
# --------------------------------------------------------------------------------------------


def run_engine(engine: str, cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    out = tmp / f"{engine}.json"
    child = {**cfg, "engine": engine}
    cmd = [sys.executable, "-m", "benchmarks.forecast", "--child", json.dumps(child), str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def summarise(results: dict[str, list[dict[str, Any]]], on_grid_bytes: int) -> dict[str, Any]:
    """Best-of-rounds samples/s per engine and epoch, and the ratios the issue sets targets on."""

    def rate(engine: str, epoch: int) -> float:
        runs = results.get(engine, [])
        return max((r["epochs"][epoch]["samples"] / r["epochs"][epoch]["seconds"] for r in runs),
                   default=float("nan"))  # fmt: skip

    out: dict[str, Any] = {"samples_per_s": {}, "ratios": {}}
    for engine in results:
        out["samples_per_s"][engine] = [rate(engine, 0), rate(engine, 1)]
    for e in (0, 1):
        if "nodes" in results and "bare" in results:
            out["ratios"][f"nodes/bare epoch {e}"] = rate("nodes", e) / rate("bare", e)
        if "nodes" in results and "deliver" in results:
            out["ratios"][f"nodes/deliver epoch {e}"] = rate("nodes", e) / rate("deliver", e)
        if "nodes" in results and "shifts" in results:
            out["ratios"][f"nodes/shifts epoch {e}"] = rate("nodes", e) / rate("shifts", e)
        if "nodes" in results and "xarray" in results:
            out["ratios"][f"nodes/xarray epoch {e}"] = rate("nodes", e) / rate("xarray", e)
    if "nodes" in results:
        node = results["nodes"][0]
        out["nodes_bytes_per_epoch"] = [ep["bytes"] for ep in node["epochs"]]
        out["on_grid_bytes"] = on_grid_bytes
        # the batch buffers held (every set the read-ahead and prefetch keep in flight)
        # against the delivered tensors of as many batches: 1.0 is no memory beyond them
        out["batch_buffer_sets"] = node["batch_buffer_sets"]
        out["batch_memory_ratio"] = node["batch_buffer_bytes"] / max(
            1, node["batch_buffer_sets"] * node["delivered_batch_bytes"]
        )
    out["rss_peak_mib"] = {
        engine: max(r["rss_peak_bytes"] for r in runs) / 2**20 for engine, runs in results.items()
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--levels", type=int, default=37)
    p.add_argument("--lat", type=int, default=32)
    p.add_argument("--lon", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="xarray DataLoader workers")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--smoke", action="store_true", help="a tiny store, one round")
    p.add_argument("--check", action="store_true", help="assert the exact-bytes claim")
    p.add_argument("--out", type=Path, default=None, help="write forecast-*.jsonl here")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.levels, args.lat, args.lon, args.rounds = 96, 4, 8, 16, 1
    with tempfile.TemporaryDirectory(prefix="forecast-") as d:
        tmp = Path(d)
        store = tmp / "arco.zarr"
        t0 = time.perf_counter()
        write_store(store, args.steps, args.levels, args.lat, args.lon)
        print(f"wrote {store} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        _, on_grid_bytes = on_grid_objects(store, args.steps)
        cfg = {
            "store": str(store),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "epochs": 2,
            "workers": args.workers,
        }
        results: dict[str, list[dict[str, Any]]] = {e: [] for e in args.engines}
        for r in range(args.rounds):
            order = args.engines[r % len(args.engines) :] + args.engines[: r % len(args.engines)]
            for engine in order:
                results[engine].append(run_engine(engine, cfg, tmp))
        summary = summarise(results, on_grid_bytes)
    row = {
        "type": "forecast",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
        "summary": summary,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"forecast-{'smoke' if args.smoke else 'full'}-{time.strftime('%Y%m%dT%H%M%S')}"
        (args.out / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    if args.check and "nodes" in results:
        got = summary["nodes_bytes_per_epoch"][0]
        if got != on_grid_bytes:
            raise SystemExit(
                f"nodes read {got} bytes in epoch 0, the on-grid objects hold {on_grid_bytes}"
            )
    return row


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
