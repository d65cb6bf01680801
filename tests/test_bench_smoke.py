"""The benchmark harness cannot rot: run ``make bench-smoke``'s suite and check its output.

This asserts that the harness works — every available engine produces complete rows on both
stores, unavailable ones are skipped with a reason, and the report renders — never speed.
The first run builds ``benchmarks/.venv-insitubatch`` (Python 3.12 + ``insitubatch`` from PyPI);
where that cannot be done (no Python 3.12, no network) the harness records a skip row for that
engine, which is accepted here. xbatcher/xarray (the ``bench`` extra) may be missing too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import ENGINES, REQUIRED_FIELDS

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("insitubatch", "xbatcher")
FIELDS = REQUIRED_FIELDS


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--suite", "smoke", "--out", str(out), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    files = sorted(out.glob("bench-smoke-*.jsonl"))
    assert len(files) == 1
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]

    run = rows[0]
    assert run["type"] == "run"
    assert run["machine"]["cores"] and run["machine"]["versions"]["torch"]
    assert rows[-1]["type"] == "end"
    assert not [r for r in rows if r["type"] == "error"]

    raw = [r for r in rows if r["type"] == "rawget"]
    assert {r["store"] for r in raw} == {"local", "s3"}
    assert all(r["objects"] > 0 and r["bytes"] > 0 for r in raw)

    # the decode-only ceiling: the train chunks' objects, every train sample decoded once
    decode = [r for r in rows if r["type"] == "decode"]
    assert {r["store"] for r in decode} == {"local", "s3"}
    train = run["datasets"][0]
    for r in decode:
        assert r["samples"] == train["train_samples"]
        assert r["decoded_bytes"] == train["decoded_train_bytes"]
        assert r["samples_per_s"] > 0 and r["threads"] >= 1
        assert 0 < r["bytes"] <= train["needed_bytes"]

    skipped = {r["engine"]: r["reason"] for r in rows if r["type"] == "skip" and "store" not in r}
    for engine in skipped:
        assert engine in OPTIONAL, f"{engine} must not be skipped: {skipped[engine]}"
        assert skipped[engine], f"{engine} skipped without a reason"
    measured = [r for r in rows if r["type"] == "measurement"]
    for engine in ENGINES:
        if engine in skipped:
            continue
        stores = {"ram"} if engine == "memory" else {"local", "s3"}
        mine = [r for r in measured if r["engine"] == engine]
        assert {r["store"] for r in mine} == stores, engine
        for r in mine:
            missing = [f for f in FIELDS if f not in r]
            assert not missing, (engine, missing)
            assert r["samples"] > 0 and r["samples_per_s"] > 0 and r["wall_s"] > 0
            assert r["rss_peak_MB"] and r["rss_peak_MB"] > 0
            assert r["cpu_s"] >= 0
            assert r["config"]["batch_size"] == 32
        if engine != "memory":
            cold = [r for r in mine if r["epoch_kind"] == "cold"]
            assert cold and all(r["gets"] and r["gets"] > 0 for r in cold), engine
            assert all(r["read_amplification"] and r["read_amplification"] > 0 for r in cold)
            s3 = [r for r in cold if r["store"] == "s3"]
            assert all(r["io_source"] == "proxy" for r in s3)
    # the same samples for every engine: one train split
    nodes_cold = [r for r in measured if r["engine"] == "nodes" and r["epoch_kind"] == "cold"]
    assert {r["samples"] for r in nodes_cold} == {run["datasets"][0]["train_samples"]}

    # the report renders from these rows (plots only when matplotlib is installed)
    doc = tmp_path / "benchmarks.md"
    rep = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.report",
            str(files[0]),
            "--doc",
            str(doc),
            "--plots",
            str(tmp_path / "plots"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    text = doc.read_text()
    assert "shared, noisy 2-core machine" in text
    assert "| nodes |" in text or "nodes cold" in text


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(600)
def test_the_persistent_cache_bench_warms_in_one_process_and_reads_every_chunk_in_a_fresh_one(
    tmp_path: Path,
) -> None:
    """``--variants persist`` on the smoke shape: per engine, a warming process and a fresh one
    over the warm cache folder (insitubatch only where its venv is already built)."""
    from benchmarks import insitubatch_env

    engines = ["nodes", "memory"]
    if (insitubatch_env.VENV / insitubatch_env.MARKER).is_file():
        engines.insert(1, "insitubatch")
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "benchmarks.run", "--suite", "smoke", "--out", str(out)]
    cmd += ["--engines", *engines, "--stores", "local", "--variants", "persist", "--check"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (jsonl,) = out.glob("bench-smoke-*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    train = rows[0]["datasets"][0]
    for engine in [e for e in engines if e != "memory"]:
        mine = {
            r["epoch_kind"]: r
            for r in rows
            if r["type"] == "measurement" and r["engine"] == engine and r.get("cache") == "persist"
        }
        assert sorted(mine) == ["cold_persist", "warm_disk"], engine
        warming, warm = mine["cold_persist"], mine["warm_disk"]
        # the warming process fetched every chunk; the fresh one read each of them from disk
        assert warming["gets"] > 0 and warming["extra"]["misses"] > 0, engine
        assert warm["extra"]["misses"] == 0, engine
        assert warm["extra"]["disk_hits"] == warming["extra"]["misses"], engine
        assert warm["samples"] == warming["samples"] == train["train_samples"]
        assert warm["cache_dir_bytes"] > 0
        # one folder for both processes, deleted after the measurement
        assert warm["config"]["cache_dir"] == warming["config"]["cache_dir"]
        assert not Path(warm["config"]["cache_dir"]).exists()
        if engine == "nodes":  # (insitubatch re-reads array metadata: a few small GETs)
            assert warm["gets"] == 0 and warm["bytes_fetched"] == 0

    doc = tmp_path / "benchmarks.md"
    report = [sys.executable, "-m", "benchmarks.report", str(jsonl), "--doc", str(doc)]
    rep = subprocess.run(
        [*report, "--plots", str(tmp_path / "plots")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    text = doc.read_text()
    assert "## Persistent chunk cache (smoke-spc8, local)" in text
    assert "| nodes warm-cache epoch 0 / in-RAM gather |" in text
    if "insitubatch" in engines:
        assert "| nodes / insitubatch, warm-cache epoch 0 |" in text
