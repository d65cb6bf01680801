"""See an epoch: write it as a Chrome-trace file, and profile training with the loader inside.

Writes a small ERA5-like store, then

* trains one epoch of a tiny model with ``FetchOptions(trace=True)`` and writes that epoch's
  spans (every GET or read, decode, fill run, admission, chunk wait, gather and consumer wait,
  per thread, with chunk and batch ids) with ``pipe.report().write_trace(path)``;
* runs the epoch's first steps under ``torch.profiler.profile`` (every thread recorded): the
  loader's ``insitu.*`` ranges sit in that trace next to the model's operators.

Open either JSON file in https://ui.perfetto.dev or ``chrome://tracing`` (docs/tracing.md).

    .venv/bin/python recipes/trace_epoch.py --out traces/
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, to_torch
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.synthetic import make_era5_like


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the two traces")
    parser.add_argument("--path", type=Path, default=None, help="store (default: a temp folder)")
    parser.add_argument("--n-time", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="steps under the profiler")
    args = parser.parse_args(argv)
    tmp = None
    root = args.path
    if root is None:
        tmp = tempfile.TemporaryDirectory()
        root = Path(tmp.name) / "era5.zarr"
    if not root.exists():
        make_era5_like(root, n_time=args.n_time, n_lat=32, n_lon=64, n_level=4)
    args.out.mkdir(parents=True, exist_ok=True)
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (0.8, 0.2, 0.0))
    pipe = insitu_pipeline(
        root, manifest, {"x": g, "y": g.shift(1)}, batch_size=16, fetch=FetchOptions(trace=True)
    )
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.Conv2d(8, 1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(batch: object) -> None:
        t = to_torch(batch)  # type: ignore[arg-type]
        loss = torch.nn.functional.mse_loss(model(t["x"][:, None]), t["y"][:, None])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    config = _ExperimentalConfig(profile_all_threads=True)  # the loader's threads too
    with pipe:
        # the first steps of epoch 0 under the profiler, then the rest of the epoch
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            for i, batch in enumerate(pipe):
                step(batch)
                if i + 1 == args.steps:
                    break
        for batch in pipe:  # the same epoch goes on
            step(batch)
        report = pipe.report()
        assert report is not None and report.complete
        epoch_trace = report.write_trace(args.out / "epoch0.trace.json")
        print(report.headline())
        counts = report.trace.counts() if report.trace is not None else {}
        print(f"wrote {epoch_trace}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    profile_trace = args.out / "profile.trace.json"
    prof.export_chrome_trace(str(profile_trace))
    ranges = sorted({e.name for e in prof.events() if e.name.startswith("insitu.")})
    print(f"wrote {profile_trace}: loader ranges {', '.join(ranges)}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
