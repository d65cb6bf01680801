"""Plans stay O(sample axis) with windows, strides and missing steps (issue 30).

An hourly archive the size of ERA5 (745,000 steps) with 60 arrays, trained 6-hourly on a
6-step window (each array read at offsets -6 h ... +24 h: 360 views) with listed missing steps:
building the pipeline and delivering its first batch takes seconds, not minutes, and well under
the memory of a laptop. The store holds metadata only (every chunk absent, read as its fill
value), so what is measured is the plan, the schedule and the builder, not the data. The
claim is about a fresh interpreter's time and peak memory, so it runs in one of its own.

Measured with this test's child on the shared 2-core machine (load 2-4): 2.7-4.3 s of wall
time, 2.1 s of CPU, 615 MiB peak RSS (torch imported included); before issue 30's fixes
9.0-12.6 s, 6.4-6.6 s of CPU and 1.29 GiB (6.5 million slot specs listed for the reserve, the
manifest's chunks checked and copied in Python loops). The bound is on CPU time (5 s): wall
time follows the machine's load (10.9 s for 1.9 CPU-seconds under load 10).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

N_STEPS, N_ARRAYS = 745_000, 60
OFFSETS = (-6, 0, 6, 12, 18, 24)

_CHILD = """
import json, resource, sys, time
from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
root = sys.argv[1]
offsets = json.loads(sys.argv[2])
wall0, cpu0 = time.perf_counter(), time.process_time()
geoms = open_geometries(root, [f"v{i:02d}" for i in range(int(sys.argv[3]))])
manifest = split_by_chunk(geoms["v00"], (0.9, 0.05, 0.05))
views = {f"{name}{k:+d}": g.shift(k) for name, g in geoms.items() for k in offsets}
pipe = insitu_pipeline(root, manifest, views, stride="6h", missing=[102, 2004],
                       batch_size=16, coords=())
batch = next(iter(Loader(pipe)))
wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
dropped, rows = pipe.stages.plan.dropped, batch.sample_indices["v00+0"].tolist()
pipe.close()
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "dropped": dropped, "rows": rows,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_an_era5_sized_hourly_archive_builds_and_delivers_its_first_batch_in_seconds(
    tmp_path: Path,
) -> None:
    root = tmp_path / "hourly.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    time = group.create_array("time", shape=(N_STEPS,), chunks=(N_STEPS,), dtype="i8",
                              fill_value=0, dimension_names=("time",),
                              attributes={"units": "hours since 1940-01-01",
                                          "calendar": "proleptic_gregorian"})  # fmt: skip
    time[...] = np.arange(N_STEPS, dtype=np.int64)
    for i in range(N_ARRAYS):  # metadata only: no chunk is written
        group.create_array(f"v{i:02d}", shape=(N_STEPS, 1), chunks=(1, 1), dtype="f4",
                           fill_value=0, dimension_names=("time", "x"))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), json.dumps(OFFSETS), str(N_ARRAYS)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # listed steps 102 and 2004 (hours 102, 2004): the on-grid anchors whose window holds one,
    # a - 6, a, a + 6, ..., a + 24 = step, a % 6 == 0 — six each (hand-counted)
    assert got["dropped"] == {"nat": 0, "gap": 0, "missing": 12}
    assert len(got["rows"]) == 16 and all(r % 6 == 0 for r in got["rows"])
    assert got["peak_rss"] <= 1.5 * 2**30, got
    # The target is 5 s of wall time on a quiet machine. What is held here is the CPU
    # time this process spends (all its threads, the slot reserve's included), which other
    # processes on a busy machine do not inflate: issue 30's plan spent 6.4-6.6 s of it, this
    # one 2.1 s. Wall time is only held to "seconds, not minutes": on the 2-core test machine
    # under load 10 the same 1.9 CPU-seconds took 10.9 s of wall time.
    assert got["cpu_s"] <= 5.0, got
    assert got["wall_s"] <= 60.0, got
