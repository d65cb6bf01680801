"""What the trace costs: its hooks timed on their own, and epochs with and without it.

The hooks first: the producer-side span hook (``EpochRecorder.add``) and a stored object's read
and decode spans in a decode loop (one ``PackedSpans.add``, and the ``is not None`` test that is
all a run pays without a trace), per call, with the trace off and on; then the per-run hand-over
of 100 objects' spans.
Then A/B epochs: a WeatherBench2-like store (13 arrays, one time step per chunk; written once)
read by two pipelines that differ only in ``FetchOptions(trace=...)``, with a budget short of
the split (every epoch decodes each stored object straight into its row), epochs alternated
ABBA; process CPU per epoch as well as wall time (the wall time of a shared machine is noisy).

    python -m benchmarks.trace_overhead [--path DIR] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from pathlib import Path

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.recorder import EpochRecorder
from insitubatch_nodes.stages._fill import _Tally
from insitubatch_nodes.synthetic import make_weatherbench_like
from insitubatch_nodes.trace import READ_DECODE, PackedSpans

N = 200_000


def _hook_costs(trace: bool, base: float) -> str:
    rec = EpochRecorder(ChunkPool(1 << 20), max_inflight=32, decode_threads=2, trace=trace)
    add = timeit.timeit(lambda: rec.add("gather_s", 1e-3, start=1.0, batch=3), number=N) / N
    acc = _Tally()
    if trace:
        acc.spans, acc.packed = [], PackedSpans(3)
    packed = acc.packed
    ref = -1 if packed is None else packed.ref("t2m", (0, 0))

    def one() -> None:
        if packed is not None:
            packed.add(READ_DECODE, 1.0, 2.0, 3.0, ref, 5, 3)

    obj = timeit.timeit(one, number=N) / N

    tallies = []
    for _ in range(20_000):
        tally = _Tally()
        if trace:
            tally.spans, tally.packed = [("fill run", 1.0, 2.0, {"batch": 3})], PackedSpans(3)
            for _ in range(100):
                tally.packed.add(READ_DECODE, 1.0, 2.0, 3.0, 0, 5, 3)
        tallies.append(tally)
    hand = timeit.timeit(lambda: rec.on_fill_run(tallies.pop()), number=20_000) / 20_000
    return (
        f"trace={trace}: add() {1e9 * (add - base):.0f} ns/call; a stored object's read and decode "
        f"spans {1e9 * (obj - base):.0f} ns; a run's hand-over with 100 objects {1e6 * hand:.1f} us"
    )


def hooks() -> None:
    base = timeit.timeit(lambda: None, number=N) / N
    for trace in (False, True):
        print(_hook_costs(trace, base))


def epochs(path: Path, rounds: int) -> None:
    if not path.exists():
        make_weatherbench_like(path, n_time=256, n_lat=60, n_lon=120)
    g = {
        k: v
        for k, v in open_geometries(path).items()
        if k not in ("time", "latitude", "longitude", "level")
    }
    manifest = split_by_chunk(next(iter(g.values())), (1.0, 0.0, 0.0))
    budget = sum(v.sample_nbytes for v in g.values()) * 128  # half the split: not kept
    pipes = {
        t: insitu_pipeline(
            path, manifest, g, batch_size=32, cache_budget_bytes=budget, coords=(),
            fetch=FetchOptions(trace=t),
        )
        for t in (False, True)
    }  # fmt: skip
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for t in (False, True) if r % 2 == 0 else (True, False):
            pipe = pipes[t]
            t0 = time.perf_counter()
            for _ in pipe:
                pass
            wall[t].append(time.perf_counter() - t0)
            report = pipe.report()
            assert report is not None
            cpu[t].append(report.cpu_s)
            pipe.reset()
    for t in (False, True):
        print(
            f"trace={t}: epoch wall median {statistics.median(wall[t]):.3f} s "
            f"({min(wall[t]):.3f}-{max(wall[t]):.3f}), CPU median "
            f"{statistics.median(cpu[t]):.3f} s ({min(cpu[t]):.3f}-{max(cpu[t]):.3f})"
        )
    traced = pipes[True].report()
    if traced is not None and traced.trace is not None:
        print("spans of a traced epoch:", traced.trace.counts())
    for name, series in (("wall", wall), ("CPU", cpu)):
        ratio = statistics.median(series[True]) / statistics.median(series[False])
        print(f"{name} on/off (medians): {ratio:.3f}")
    for pipe in pipes.values():
        pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", type=Path, default=Path("benchmarks/data/wb-trace.zarr"))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    hooks()
    epochs(args.path, args.rounds)


if __name__ == "__main__":
    main()
