"""Where the first epoch's extra time goes, at the reference shape: A/B of the memory levers.

Every measurement runs in a fresh interpreter (first touch of memory is what is measured), and
the variants are interleaved round by round so that machine noise hits them alike. Two kinds:

* ``gets`` — three passes of raw GETs (``obstore.get_async``, 32 in flight) over the train
  split's stored objects, with the glibc allocator tuning on and off
  (``INSITUBATCH_NODES_MALLOC_TUNING``): seconds and page faults per pass.
* ``epochs`` — ``insitu_pipeline`` at the default budget, two epochs, with every combination
  of the allocator tuning and the reserves of slots and batch buffers made ahead of need (what a
  remote store gets; over this local folder the default makes them on demand,
  ``AsyncChunkFetchNode.memory_ahead``): samples/s, CPU seconds and page faults of each epoch,
  epoch 0 / epoch 1.

    .venv/bin/python -m benchmarks.first_epoch --rounds 3 [--what gets epochs]

The dataset is the reference shape (ERA5-like t2m + z on 4 levels, 2048 x 181 x 360, 16 samples
per chunk, zstd), written under ``benchmarks/data/`` on first use (~25 s on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
_GETS = textwrap.dedent(
    """
    import asyncio, json, os, resource, sys, time
    import obstore
    from obstore.store import LocalStore
    from insitubatch_nodes import _process, open_geometries, split_by_chunk
    root = sys.argv[1]
    tuned = _process.tune_allocator()
    t2m = open_geometries(root, ["t2m"])["t2m"]
    train = set(split_by_chunk(t2m, (0.8, 0.1, 0.1)).chunks("train"))
    keys = []
    for a in ("t2m", "z"):
        base = os.path.join(root, a, "c")
        for d, _, fs in os.walk(base):
            for f in fs:
                rel = os.path.relpath(os.path.join(d, f), base)
                if int(rel.split(os.sep)[0]) in train:
                    keys.append(os.path.join(a, "c", rel))
    store = LocalStore(root)

    async def one_pass():
        sem = asyncio.Semaphore(32)
        async def get(k):
            async with sem:
                return len(await (await obstore.get_async(store, k)).bytes_async())
        return sum(await asyncio.gather(*(get(k) for k in keys)))

    out = []
    for _ in range(3):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.monotonic()
        nbytes = asyncio.run(one_pass())
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        out.append({"s": time.monotonic() - t0, "faults": faults, "bytes": nbytes})
    print(json.dumps({"tuned": tuned, "passes": out}))
    """
)

_EPOCHS = textwrap.dedent(
    """
    import json, os, resource, sys, time
    from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
    if os.environ.get("BENCH_RESERVE") == "1":  # the reserves, as over a remote store
        AsyncChunkFetchNode.memory_ahead = property(lambda self: True, lambda self, v: None)
    from insitubatch_nodes import Loader, _process, insitu_pipeline, open_geometries, split_by_chunk
    root = sys.argv[1]
    g = open_geometries(root, ["t2m", "z"])
    m = split_by_chunk(g["t2m"], (0.8, 0.1, 0.1))
    pipe = insitu_pipeline(root, m, {"t2m": g["t2m"], "z": g["z"]}, batch_size=32, block_chunks=16)
    loader = Loader(pipe)
    out = []
    for _ in range(2):
        ru0, t0, n = resource.getrusage(resource.RUSAGE_SELF), time.monotonic(), 0
        for batch in loader:
            n += len(batch)
        ru1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
        cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        faults = ru1.ru_minflt - ru0.ru_minflt
        out.append({"samples_per_s": n / wall, "cpu_s": cpu, "faults": faults})
    pipe.close()
    print(json.dumps({"tuned": _process.tune_allocator(), "epochs": out,
                      "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    """
)


def dataset(root: Path) -> Path:
    """The suite's reference dataset (``benchmarks.datasets.REFERENCE``), written if missing."""
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.datasets import REFERENCE, ensure_dataset

    return ensure_dataset(REFERENCE, root)[0]


def child(script: str, path: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(values: list[float], spec: str) -> str:
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}–{max(values):{spec}}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--what", nargs="+", choices=("gets", "epochs"), default=["gets", "epochs"])
    p.add_argument("--data", type=Path, default=HERE / "data")
    args = p.parse_args(argv)
    path = dataset(args.data)
    if "gets" in args.what:
        rows: dict[str, list[dict]] = {"1": [], "0": []}
        for _ in range(args.rounds):
            for setting in rows:
                rows[setting].append(
                    child(_GETS, path, {"INSITUBATCH_NODES_MALLOC_TUNING": setting})
                )
        print("raw GETs of the train split, 3 passes per process (median [min–max] over rounds)")
        for setting, runs in rows.items():
            for i in range(3):
                secs = [r["passes"][i]["s"] for r in runs]
                faults = [r["passes"][i]["faults"] for r in runs]
                mbs = [r["passes"][i]["bytes"] / r["passes"][i]["s"] / 1e6 for r in runs]
                print(
                    f"  malloc tuning {'on ' if setting == '1' else 'off'} pass {i}: "
                    f"{_fmt(secs, '.2f')} s, {_fmt(mbs, '.0f')} MB/s, {_fmt(faults, '.0f')} faults"
                )
    if "epochs" in args.what:
        variants = {
            "tuning only (default)": {},
            "tuning+reserve": {"BENCH_RESERVE": "1"},
            "reserve only": {"INSITUBATCH_NODES_MALLOC_TUNING": "0", "BENCH_RESERVE": "1"},
            "neither": {"INSITUBATCH_NODES_MALLOC_TUNING": "0"},
        }
        res: dict[str, list[dict]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res[name].append(child(_EPOCHS, path, variants[name]))
        print("insitu_pipeline, default budget, 2 epochs per process (median [min–max])")
        for name, runs in res.items():
            e0 = [x["epochs"][0]["samples_per_s"] for x in runs]
            e1 = [x["epochs"][1]["samples_per_s"] for x in runs]
            ratio = [a / b for a, b in zip(e0, e1, strict=True)]
            print(
                f"  {name:15s} epoch0 {_fmt(e0, '.0f')} s/s  epoch1 {_fmt(e1, '.0f')} s/s  "
                f"e0/e1 {_fmt(ratio, '.2f')}  "
                f"cpu0 {_fmt([x['epochs'][0]['cpu_s'] for x in runs], '.1f')} s  "
                f"faults0 {_fmt([x['epochs'][0]['faults'] for x in runs], '.0f')}  "
                f"faults1 {_fmt([x['epochs'][1]['faults'] for x in runs], '.0f')}  "
                f"rss {_fmt([x['maxrss_mb'] for x in runs], '.0f')} MB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
