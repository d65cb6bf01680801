"""The benchmark accounts the CPU its S3 stand-in (moto and the latency proxy) spends.

The claims: the counting proxy's counters carry its own thread's CPU and the CPU of the server
process it was given, both growing as they work; the report turns them into a per-pass table of
engine, moto and proxy CPU-s and the cores they keep busy.
"""

from __future__ import annotations

import subprocess
import sys

from benchmarks.datasets import REFERENCE
from benchmarks.proxy import CountingLatencyProxy
from benchmarks.report import _s3_cpu_table
from insitubatch_nodes.testing import free_port

# the server burns 0.6 CPU-s when told to (a line on stdin), says so, then sleeps
_BURN = (
    "import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
    "while time.process_time() - t < 0.6: pass\nprint('burnt', flush=True)\ntime.sleep(30)\n"
)


def test_the_counting_proxy_reports_its_own_cpu_and_the_cpu_of_the_server_process() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdin is not None and server.stdout is not None
    proxy = CountingLatencyProxy(free_port(), delay_s=0.0, server_pid=server.pid)
    try:
        first = proxy.snapshot()
        # told to burn only now, and waited for however long a busy machine makes it (a fixed
        # 1.5 s sleep saw 260 ms of the burn under load 9)
        server.stdin.write("go\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "burnt"
        second = proxy.snapshot()
    finally:
        proxy.stop()
        server.kill()
        server.wait()
    assert {"proxy_cpu_ms", "server_cpu_ms"} <= set(first)
    assert second["proxy_cpu_ms"] >= first["proxy_cpu_ms"] >= 0
    assert 400 <= second["server_cpu_ms"] - first["server_cpu_ms"] <= 1500


def test_a_proxy_without_a_server_pid_reports_only_its_own_cpu() -> None:
    proxy = CountingLatencyProxy(free_port(), delay_s=0.0)
    try:
        counters = proxy.snapshot()
    finally:
        proxy.stop()
    assert "proxy_cpu_ms" in counters and "server_cpu_ms" not in counters


def _row(kind: str, wall: float, cpu: float, server_ms: int, proxy_ms: int, **extra: object):
    return {
        "type": kind,
        "store": "s3",
        "dataset": REFERENCE.name,
        "wall_s": wall,
        "cpu_s": cpu,
        "proxy": {"server_cpu_ms": server_ms, "proxy_cpu_ms": proxy_ms},
        **extra,
    }


def test_the_report_shows_the_cores_each_s3_pass_keeps_busy() -> None:
    nodes = {
        "engine": "nodes",
        "budget": "default",
        "repeat": 0,
        "epoch_kind": "cold",
        "samples_per_s": 300.0,
    }
    rows = [
        _row("rawget", 4.0, 1.5, 3500, 2500),
        _row("decode", 5.0, 4.0, 3000, 2000),
        _row("measurement", 5.0, 5.0, 3000, 1000, **nodes),
        _row("rawget", 4.0, 1.0, 1000, 1000, dataset="spc16"),  # not the reference shape
    ]
    table = _s3_cpu_table(rows)
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert lines["rawget"] == "| rawget | 4 | 1.50 | 3.50 | 2.50 | 1.88 |"
    assert lines["decode"].endswith("| 1.80 |")
    assert lines["nodes epoch 0 (`default`)"].endswith("| 1.80 |")
    assert "spc16" not in table


def test_the_report_says_so_when_no_s3_pass_recorded_the_server_cpu() -> None:
    row = _row("rawget", 4.0, 1.5, 0, 0)
    del row["proxy"]
    assert "No s3 pass" in _s3_cpu_table([row])
