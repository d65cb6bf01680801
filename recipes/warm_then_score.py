"""Warm a persistent chunk cache once, then score against it from several processes at once.

The workload the cache is shaped around: one job reads the store, normalises every chunk with a
:class:`~insitubatch_nodes.StandardScaler` (a chunk transform) and keeps the result on local disk
(``persist=True``); then several scoring processes read that cache with
``readonly_cache=True`` — in parallel, without fetching or decoding anything, and failing loudly
should the cache lack a chunk they read. While they hold it, a second *writer* on the directory is
refused at once (one writer per ``cache_dir``); it gets in as soon as they are done.

Every batch the scorers see is checked against zarr's own read of the same samples, normalised
with the same statistics.

    .venv/bin/python recipes/warm_then_score.py --scorers 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr

from insitubatch_nodes import StandardScaler, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import CacheBusyError
from insitubatch_nodes.synthetic import make_era5_like

VARIABLES = ["t2m", "z"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", type=Path, help="store to write/read (default: a temporary folder)")
    p.add_argument("--cache-dir", type=Path, help="the cache (default: a temporary folder)")
    p.add_argument("--n-time", type=int, default=256, help="time steps of the synthetic store")
    p.add_argument("--scorers", type=int, default=2, help="read-only processes run at once")
    p.add_argument("--score", action="store_true", help=argparse.SUPPRESS)  # a scorer child
    return p.parse_args(argv)


def scaler_for(path: Path) -> StandardScaler:
    """Fixed statistics, versioned by ``cache_key`` (bump it when you re-fit them)."""
    mean = {"t2m": 280.0, "z": np.array([5.0e4, 1.0e5]).reshape(2, 1, 1)}
    std = {"t2m": 15.0, "z": np.array([2.0e3, 4.0e3]).reshape(2, 1, 1)}
    return StandardScaler(mean, std, cache_key="era5-stats-v1")


def build(path: Path, cache_dir: Path, **cache: bool):  # type: ignore[no-untyped-def]
    geoms = open_geometries(path, VARIABLES)
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    return insitu_pipeline(
        path,
        manifest,
        VARIABLES,
        batch_size=16,
        block_chunks=4,
        shuffle=False,
        chunk_transforms=[scaler_for(path)],
        cache_dir=cache_dir,
        coords=(),  # a scorer reads nothing from the store, not even the time coordinate
        **cache,
    )


def score(path: Path, cache_dir: Path) -> None:
    """A scorer: one pass over the cache, checked against zarr; prints one JSON line."""
    scaler = scaler_for(path)
    arrays = {v: zarr.open_array(path / v, mode="r") for v in VARIABLES}
    t0 = time.perf_counter()
    pipe = build(path, cache_dir, readonly_cache=True)
    print(json.dumps({"ready": True}), flush=True)  # holds the directory (shared) from here
    mse, batches = 0.0, 0
    for batch in pipe:
        for v in VARIABLES:
            raw = arrays[v].get_orthogonal_selection((batch.sample_indices[v],))
            want = (raw - scaler.mean[v]) / (scaler.std[v] + scaler.eps)
            np.testing.assert_allclose(batch.arrays[v], want, rtol=1e-5, atol=1e-5)
        mse += float(np.mean(batch.arrays["t2m"] ** 2))
        batches += 1
    stats = pipe.stats()
    print(
        json.dumps(
            {
                "batches": batches,
                "gets": stats["gets"],
                "disk_hits": stats["disk_hits"],
                "mean_square": mse / batches,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        ),
        flush=True,
    )
    # Keep the directory until the parent has shown that a writer is refused: a pass this small
    # can end before the parent gets to try, and the demonstration would then depend on timing.
    sys.stdin.readline()
    pipe.close()


def _line_from(proc: subprocess.Popen[str]) -> str:
    """The scorer's next line of output; raises if it exited first."""
    assert proc.stdout is not None
    line = proc.stdout.readline()  # one reader per pipe: no communicate() beside readline()
    if not line:
        raise SystemExit(f"a scorer exited early (exit code {proc.wait()})")
    return line


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or Path(tmp) / "era5.zarr"
        cache_dir = args.cache_dir or Path(tmp) / "cache"
        if args.score:
            score(path, cache_dir)
            return
        if not (path / "zarr.json").exists():
            make_era5_like(
                path, n_time=args.n_time, n_lat=16, n_lon=32, n_level=2, samples_per_chunk=8
            )

        t0 = time.perf_counter()
        warm = build(path, cache_dir, persist=True)
        n = sum(len(b) for b in warm)
        stats = warm.stats()
        warm.close()
        print(
            f"warmed {cache_dir}: {n} samples in {time.perf_counter() - t0:.2f} s, "
            f"{stats['gets']} GETs, {stats['disk_writes']} chunks written"
        )

        command = [sys.executable, __file__, "--score", "--path", str(path)]
        command += ["--cache-dir", str(cache_dir)]
        scorers = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(args.scorers)
        ]
        for proc in scorers:  # each says when it holds the directory
            if "ready" not in _line_from(proc):
                raise SystemExit("a scorer failed to open the cache")
        try:
            build(path, cache_dir, persist=True).close()
            raise SystemExit("a writer got in while the scorers were reading")
        except CacheBusyError as exc:
            print(f"a second writer is refused while they read: {str(exc).split('. ')[0]}")
        results = [json.loads(_line_from(proc)) for proc in scorers]
        for proc in scorers:  # now let them go
            assert proc.stdin is not None
            proc.stdin.close()  # the scorer's readline sees end of file
            if proc.wait(timeout=60) != 0:
                raise SystemExit(f"a scorer failed (exit code {proc.returncode})")
        for i, r in enumerate(results):
            print(
                f"scorer {i}: {r['batches']} batches in {r['seconds']} s, {r['gets']} GETs, "
                f"{r['disk_hits']} chunks from the cache, mean square {r['mean_square']:.4f}"
            )
        if any(r["gets"] for r in results):
            raise SystemExit("a scorer fetched from the store: the cache was incomplete")
        writer = build(path, cache_dir, persist=True)  # free again once the readers are gone
        writer.close()
        print("every batch matches zarr's own read; the writer got the directory back after")


if __name__ == "__main__":
    main()
