"""The archive-shape suite cannot rot: run its smoke and check the rows and the report.

``python -m benchmarks.archive --suite smoke --check`` (as ``make bench-smoke`` does) on a tiny
one-sample-per-chunk archive, both stores: every engine, ceiling and peer has rows (tensorstore
may be missing: then its skip rows say why), the scale store has its row, and the results
page renders the *Archive shape* and *Planning at scale* sections. It asserts that the harness
works, never speed. A fast test checks the report's per-round ratios on rows made by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.archive import CEILINGS, PEERS, REQUIRED_FIELDS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(600)
def test_archive_smoke_measures_every_engine_and_the_report_renders_it(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "benchmarks.archive", "--suite", "smoke", "--out", str(out)]
    proc = subprocess.run([*cmd, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (jsonl,) = out.glob("archive-smoke-*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    run = rows[0]
    assert run["type"] == "run" and run["harness"] == "archive"
    assert rows[-1]["type"] == "end"
    assert not [r for r in rows if r["type"] == "error"]
    (data,) = run["datasets"]
    assert data["samples_per_chunk"] == 1 and data["arrays"] == len(data["variables"]) == 4
    measured = [r for r in rows if r["type"] == "measurement"]
    skipped = [r for r in rows if r["type"] == "skip"]

    def mine(engine: str, store: str) -> list[dict]:
        return [r for r in measured if (r["engine"], r["store"]) == (engine, store)]

    # the machine's first-touch rate, measured in each round by a fresh process
    (touch,) = [r for r in rows if r["type"] == "first_touch"]
    assert touch["repeat"] == 0 and touch["first_write_GBps"] > 0 and touch["rewrite_GBps"] > 0

    for store in ("local", "s3"):
        nodes = mine("nodes", store)
        assert sorted(r["epoch_kind"] for r in nodes) == ["epoch0", "epoch1"]
        for r in nodes:
            assert not [f for f in REQUIRED_FIELDS if f not in r]
            assert r["samples"] == data["train_samples"] and r["samples_per_s"] > 0
            # every object once in epoch 0; the smoke split (a few MB) fits the automatic
            # budget, so the schedule keeps it in the pool and epoch 1 reads nothing
            want = data["train_objects"] if r["epoch_kind"] == "epoch0" else 0
            assert r["gets"] == want, (r["epoch_kind"], r["gets"])
            assert r["rss_peak_MB"] > 0 and r["cpu_s"] >= 0
            assert r["extra"]["report"]["samples"] == data["train_samples"]  # pipe.report()
        for engine in CEILINGS:
            got = mine(engine, store)
            if engine.startswith("bare") and store == "s3":
                assert not got  # it reads files
                continue
            assert got, (engine, store)
            for r in got:
                assert r["role"] == "ceiling" and r["samples"] == data["train_samples"]
                assert r["objects"] == data["train_objects"] and r["samples_per_s"] > 0
        for engine in PEERS:
            got = mine(engine, store)
            why = [r["reason"] for r in skipped if (r["engine"], r["store"]) == (engine, store)]
            assert got or why, (engine, store)
            for r in got:
                assert r["role"] == "peer" and 0 < r["samples"] <= data["train_samples"]
                assert r["config"]["batch_size"] == 32
            if store == "s3":
                assert all(r["io_source"] == "proxy" and r["gets"] > 0 for r in got)
    assert {r["num_workers"] for r in mine("zarr", "local")} == {0, 2}

    (scale,) = [r for r in rows if r["type"] == "scale"]
    assert (scale["n_time"], scale["arrays"]) == (5_000, 8)
    assert scale["build_s"] > 0 and scale["first_batch_s"] > 0 and scale["per_batch_ms"] > 0
    assert scale["peak_rss_MB"] > 0 and scale["batches_after_first"] > 0

    doc = tmp_path / "benchmarks.md"
    report = [sys.executable, "-m", "benchmarks.report", str(jsonl), "--doc", str(doc)]
    rep = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    text = doc.read_text()
    assert "## Archive shape: one sample per chunk" in text
    assert "### local · wb-smoke (1 sample(s) per chunk)" in text
    assert "| nodes / bare loop | 0 |" in text and "| nodes / raw GET | 0 |" in text
    # the loops that also deliver batches, and keep the split (the smoke split is kept): what
    # the bare-loop target leaves out; keeping it reads nothing in epoch 1
    assert "| nodes / bare loop into batch rows | 0 |" in text
    assert "| bare loop keeping the split / bare loop | 1 |" in text
    kept = {r["epoch_kind"]: r["gets"] for r in mine("bare_kept", "local")}
    assert kept == {"epoch0": data["train_objects"], "epoch1": 0}
    assert "engine CPU per stored object beyond decode" in text
    assert "split / automatic budget" in text
    assert "first touch of fresh memory in this run" in text
    assert "## Planning at scale" in text and "| 5,000 | 8 |" in text


def _row(engine: str, role: str, repeat: int, kind: str, rate: float, **more: object) -> dict:
    return {
        "type": "measurement",
        "engine": engine,
        "role": role,
        "store": "local",
        "dataset": "wb-c1",
        "repeat": repeat,
        "epoch_kind": kind,
        "variant": more.pop("variant", None),
        "samples": 400,
        "samples_per_s": rate,
        "decoded_MB_per_s": rate,
        "ttfb_s": 0.1,
        "cpu_s": more.pop("cpu_s", 1.0),
        "rss_peak_MB": 500.0,
        "gets": 5200,
        "bytes_fetched": 1e9,
        "objects": 5200,
        **more,
    }


def test_the_archive_ratios_pair_each_round_with_its_own_ceilings_and_peers() -> None:
    from benchmarks.report import _archive_ratios

    rows = []
    for repeat, (nodes, bare, peer) in enumerate([(90.0, 100.0, 30.0), (60.0, 50.0, 60.0)]):
        rows.append(_row("nodes", "engine", repeat, "epoch0", nodes, cpu_s=1.26))
        rows.append(_row("bare", "ceiling", repeat, "epoch0", bare))
        rows.append(_row("decode", "ceiling", repeat, "epoch0", bare, cpu_s=1.0))
        rows.append(_row("rawget", "ceiling", repeat, "epoch0", 4 * bare))
        rows.append(_row("zarr", "peer", repeat, "epoch0", peer, variant="num_workers=2"))
        rows.append(_row("zarr", "peer", repeat, "epoch0", peer / 2, variant="num_workers=0"))
    c1 = {"name": "wb-c1", "samples_per_chunk": 1, "decoded_train_bytes": 2e9}
    lines = {line[0]: line for line in _archive_ratios(rows, "local", c1)}
    # per round: 0.9 and 1.2 -> median 1.05; against the fastest peer of the round: 3 and 1
    assert lines["nodes / bare loop"][2:] == ["1.05 (0.900–1.20)", "≥ 0.85", "met"]
    assert lines["nodes / best peer"][2:] == ["2 (1–3)", "≥ 1.5", "met"]
    assert lines["nodes / raw GET"][3:] == ["–", "–"]  # a target on s3 only
    # (1.26 - 1.0) CPU-s over 5,200 objects = 50 µs per object
    cpu = lines["engine CPU per stored object beyond decode, µs"]
    assert float(cpu[2]) == pytest.approx(50) and cpu[3:] == ["≤ 30", "**missed**"]
    # at 16 samples per chunk: epoch 0 against the bare loop (>= 0.6), the rest for comparison
    c16 = _archive_ratios(rows, "local", {**c1, "samples_per_chunk": 16})
    assert [line[3] for line in c16 if line[3] != "–"] == ["≥ 0.6"]
    assert [line[4] for line in c16 if line[3] != "–"] == ["met"]  # 1.05


def test_the_archive_targets_of_the_cold_epoch_follow_the_budget_and_the_split() -> None:
    from benchmarks.report import _archive_ratios

    rows = []
    for repeat, (nodes, bare) in enumerate([(80.0, 100.0), (90.0, 100.0)]):
        for kind in ("epoch0", "epoch1"):
            extra = {"budget_bytes": 1e9}
            rows.append(_row("nodes", "engine", repeat, kind, nodes, cpu_s=1.1, extra=extra))
            rows.append(_row("bare", "ceiling", repeat, kind, bare))
            rows.append(_row("decode", "ceiling", repeat, kind, bare, cpu_s=1.0))
    long = {"name": "wb-c1", "samples_per_chunk": 16, "decoded_train_bytes": 4e9}
    lines = [line for line in _archive_ratios(rows, "local", long) if line[3] != "–"]
    by = {(line[0], line[1]): line[2:] for line in lines}
    # a split 4x the automatic budget (its working set): >= 0.85 of the bare loop in epoch 0
    assert by[("nodes / bare loop", "0")] == ["0.850 (0.800–0.900)", "≥ 0.85", "met"]
    # and CPU beyond decode in epoch 0, (1.1 - 1.0) / 5,200 = 19 µs
    cpu = by[("engine CPU per stored object beyond decode, µs", "0")]
    assert float(cpu[0]) == pytest.approx(19.2) and cpu[1:] == ["≤ 30", "met"]
    assert len(lines) == 2
    # a split under 4x the budget (the pool keeps it): >= 0.6 in epoch 0, no CPU target
    short = _archive_ratios(rows, "local", {**long, "decoded_train_bytes": 3.9e9})
    assert [line[2:] for line in short if line[3] != "–"] == [
        ["0.850 (0.800–0.900)", "≥ 0.6", "met"]
    ]


def test_the_archive_ratios_show_what_batches_and_a_kept_split_cost_the_bare_loop() -> None:
    from benchmarks.report import _archive_ratios

    rows = []
    for repeat in (0, 1):
        for kind, nodes, batches, kept in (
            ("epoch0", 60.0, 90.0, 20.0),
            ("epoch1", 80.0, 90.0, 400.0),
        ):
            rows.append(_row("nodes", "engine", repeat, kind, nodes))
            rows.append(_row("bare", "ceiling", repeat, kind, 100.0))
            rows.append(_row("bare_batches", "ceiling", repeat, kind, batches))
            rows.append(_row("bare_kept", "ceiling", repeat, kind, kept))
    c1 = {"name": "wb-c1", "samples_per_chunk": 1, "decoded_train_bytes": 2e9}
    by = {(line[0], line[1]): line[2:] for line in _archive_ratios(rows, "local", c1)}
    assert by[("nodes / bare loop", "0")] == ["0.600", "≥ 0.85", "**missed**"]
    # comparisons, no targets: the engine against each loop, each loop against the bare one
    assert by[("nodes / bare loop into batch rows", "0")] == ["0.667", "–", "–"]
    assert by[("bare loop into batch rows / bare loop", "1")] == ["0.900", "–", "–"]
    assert by[("nodes / bare loop keeping the split", "0")] == ["3", "–", "–"]
    assert by[("bare loop keeping the split / bare loop", "1")] == ["4", "–", "–"]
    # no such rows where the loops did not run (s3, or a dataset they skip)
    plain = [r for r in rows if not r["engine"].startswith("bare_")]
    assert not [line for line in _archive_ratios(plain, "local", c1) if "batch rows" in line[0]]
