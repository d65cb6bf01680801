"""Regenerate ``docs/benchmarks.md`` and the plots from a benchmark JSONL.

``python -m benchmarks.report [JSONL] [--doc docs/benchmarks.md] [--plots benchmarks/plots]``

Without a JSONL it takes the newest ``benchmarks/results/bench-full-*.jsonl``. Every number on
the page is computed here from the rows (medians and min–max over repeats); nothing is typed by
hand. Plots need matplotlib (the ``bench`` extra); without it the page is written and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.datasets import REFERENCE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINE_ORDER = ("nodes", "insitubatch", "workers", "xbatcher", "memory")
KIND_ORDER = ("cold", "warm_default", "warm_cached", "cold_persist", "warm_disk", "warm")
ENGINE_TEXT = {
    "nodes": "this project: `insitu_pipeline(...)` through `torchdata.nodes.Loader`",
    "insitubatch": "the predecessor, `insitubatch` 0.2.0 from PyPI (`InSituDataset(...).train`)",
    "workers": "per-sample zarr reads in a map-style `Dataset`, "
    "`DataLoader(shuffle=True, num_workers=N, multiprocessing_context='spawn')`",
    "xbatcher": "`xbatcher.BatchGenerator` over `xarray.open_zarr(...)`, one sample per patch, "
    "in the same kind of `DataLoader`",
    "memory": "the split already in RAM, permutation gathered with `np.take(..., out=)`: "
    "the ceiling",
}


Row = dict[str, Any]


def load(path: Path) -> list[Row]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def newest(results: Path) -> Path:
    files = sorted(results.glob("bench-full-*.jsonl"))
    if not files:
        raise SystemExit(f"no bench-full-*.jsonl under {results}: run `make bench` first")
    return files[-1]


# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------


def num(x: float | None, digits: int = 3) -> str:
    """A number with about ``digits`` significant digits, thousands separated."""
    if x is None:
        return "–"
    if x == 0:
        return "0"
    ax = abs(x)
    if ax >= 10 ** (digits - 1) or float(x).is_integer():
        return f"{x:,.0f}"
    decimals = max(0, digits - 1 - int(f"{ax:e}".split("e")[1]))
    return f"{x:,.{decimals}f}"


def med(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def span(values: Iterable[float | None], digits: int = 3) -> str:
    """``median (min–max)``, or just the value when there is one."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    m = num(statistics.median(vals), digits)
    if len(vals) == 1 or min(vals) == max(vals):
        return m
    return f"{m} ({num(min(vals), digits)}–{num(max(vals), digits)})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def mb(n: float | None) -> float | None:
    return None if n is None else n / 1e6


# --------------------------------------------------------------------------------------------
# grouping
# --------------------------------------------------------------------------------------------


def measurements(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.get("type") == "measurement"]


def headline_rows(rows: list[Row]) -> list[Row]:
    """The rows the tables summarise: for the per-sample loaders, the chosen worker count's
    rounds (the sweep's other counts have their own table)."""
    best = {
        (r["engine"], r["store"]): r["num_workers"] for r in rows if r["type"] == "best_workers"
    }
    out = []
    for r in measurements(rows):
        if r["engine"] in ("workers", "xbatcher"):
            chosen = best.get((r["engine"], r["store"]))
            if chosen is not None and r["num_workers"] != chosen:
                continue
        out.append(r)
    return out


def group(rows: Iterable[Row], *keys: str) -> dict[tuple[Any, ...], list[Row]]:
    out: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for r in rows:
        out[tuple(r.get(k) for k in keys)].append(r)
    return out


def engine_key(engine: str) -> int:
    return ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else len(ENGINE_ORDER)


def kind_key(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


# --------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------


def summary_table(rows: list[Row], store: str, datasets: list[str]) -> str:
    """samples/s medians: one line per dataset, cold and warm per engine."""
    head = headline_rows(rows)
    engines = sorted({r["engine"] for r in head if r["store"] in (store, "ram")}, key=engine_key)
    header = ["dataset"]
    for e in engines:
        header += [f"{e} cold", f"{e} warm"]
    out = []
    for ds in datasets:
        line = [ds]
        for e in engines:
            st = "ram" if e == "memory" else store
            mine = [r for r in head if r["engine"] == e and r["store"] == st and r["dataset"] == ds]
            if e in ("nodes", "insitubatch"):
                cold = [r for r in mine if r["epoch_kind"] == "cold" and r["budget"] == "default"]
                warm = [r for r in mine if r["epoch_kind"] == "warm_cached"]
            else:
                cold = [r for r in mine if r["epoch_kind"] == "cold"]
                warm = [r for r in mine if r["epoch_kind"] == "warm"]
            line += [
                num(med(r["samples_per_s"] for r in cold)),
                num(med(r["samples_per_s"] for r in warm)),
            ]
        out.append(line)
    return table(header, out)


def detail_tables(rows: list[Row], store: str, datasets: list[str]) -> str:
    head = [r for r in headline_rows(rows) if r["store"] == store]
    parts = []
    header = [
        "engine",
        "variant",
        "epoch",
        "samples",
        "samples/s",
        "decoded MB/s",
        "TTFB s",
        "peak RSS MB",
        "CPU-s",
        "GETs",
        "MB fetched",
        "read amp.",
        "shuffle q.",
        "n",
    ]
    for ds in datasets:
        mine = [r for r in head if r["dataset"] == ds]
        if not mine:
            continue
        lines = []
        groups = group(mine, "engine", "variant", "epoch_kind")
        for key in sorted(groups, key=lambda k: (engine_key(k[0]), str(k[1]), kind_key(k[2]))):
            g = groups[key]
            engine, variant, kind = key
            lines.append(
                [
                    engine,
                    variant or "–",
                    kind,
                    num(med(r["samples"] for r in g)),
                    span(r["samples_per_s"] for r in g),
                    num(med(r["decoded_MB_per_s"] for r in g)),
                    span((r["ttfb_s"] for r in g), 2),
                    num(med(r["rss_peak_MB"] for r in g)),
                    num(med(r["cpu_s"] for r in g), 2),
                    num(med(r["gets"] for r in g)),
                    num(med(mb(r["bytes_fetched"]) for r in g)),
                    num(med(r["read_amplification"] for r in g), 2),
                    num(med(r["shuffle_quality"] for r in g), 2),
                    str(len(g)),
                ]
            )
        parts.append(f"#### {ds}\n\n" + table(header, lines))
    return "\n\n".join(parts)


def sweep_table(rows: list[Row]) -> str:
    sweep = [r for r in measurements(rows) if r.get("phase") == "sweep"]
    if not sweep:
        return "_No worker sweep in this run._"
    lines = []
    groups = group(sweep, "store", "engine", "num_workers", "epoch_kind")
    for key in sorted(groups, key=lambda k: (k[0], engine_key(k[1]), k[2], kind_key(k[3]))):
        g = groups[key]
        lines.append(
            [
                key[0],
                key[1],
                str(key[2]),
                key[3],
                span(r["samples_per_s"] for r in g),
                span((r["ttfb_s"] for r in g), 2),
                num(med(r["rss_peak_MB"] for r in g)),
                num(med(r["cpu_s"] for r in g), 2),
            ]
        )
    header = [
        "store",
        "engine",
        "num_workers",
        "epoch",
        "samples/s",
        "TTFB s",
        "peak RSS MB",
        "CPU-s",
    ]
    return table(header, lines)


def rawget_table(rows: list[Row]) -> str:
    raw = [r for r in rows if r.get("type") in ("rawget", "decode")]
    if not raw:
        return "_No raw-GET measurement in this run._"
    lines = [
        [
            r["store"],
            r["dataset"],
            r["type"],
            "before" if r.get("repeat") is None else str(r["repeat"]),
            str(r["objects"]),
            num(mb(r["bytes"])),
            num(r["wall_s"], 2),
            num(r["MB_per_s"]),
            num(r["requests_per_s"]),
            num(r.get("samples_per_s")),
            num(r.get("decoded_MB_per_s")),
            num(r.get("cpu_s"), 2),
        ]
        for r in sorted(
            raw,
            key=lambda r: (r["store"], r["dataset"], r.get("repeat") or 0, r["type"] != "rawget"),
        )
    ]
    header = [
        "store",
        "dataset",
        "pass",
        "round",
        "objects",
        "stored MB",
        "s",
        "stored MB/s",
        "GETs/s",
        "samples/s",
        "decoded MB/s",
        "CPU-s",
    ]
    return table(header, lines)


def datasets_table(run: Row) -> str:
    lines = []
    for d in run["datasets"]:
        lines.append(
            [
                d["name"],
                d["layout"],
                str(d["objects"]),
                num(mb(d["stored_bytes"])),
                str(d["train_samples"]),
                num(mb(d["decoded_train_bytes"])),
                num(mb(d["needed_bytes"])),
            ]
        )
    header = [
        "dataset",
        "layout",
        "stored objects",
        "stored MB",
        "train samples",
        "decoded MB / epoch",
        "stored MB the epoch needs",
    ]
    return table(header, lines)


def problems_section(rows: list[Row]) -> str:
    lines = []
    run = next((r for r in rows if r.get("type") == "run"), {})
    names = [d["name"] for d in run.get("datasets", [])]
    for store, measured in (run.get("per_sample_datasets") or {}).items():
        rest = [n for n in names if n not in measured]
        if rest and store in run.get("stores", []):
            lines.append(
                f"- by design, not a failure: workers and xbatcher are not run on {store} for "
                f"{', '.join(rest)} (see Setup)"
            )
    budget: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        if r.get("type") == "skip" and "store" in r:
            budget[(r["engine"], r["store"])].append(r)
        elif r.get("type") == "skip":
            lines.append(f"- **skipped** `{r['engine']}`: {r['reason']}")
        elif r.get("type") == "error":
            tail = (r.get("log_tail") or "").strip().splitlines()[-1:] or [""]
            lines.append(
                f"- **failed** `{r['engine']}` on {r.get('store')}/{r.get('dataset')} "
                f"(repeat {r.get('repeat')}, {r.get('variant')}): {r.get('status')} — "
                f"`{tail[0][:200]}`"
            )
    for (engine, store), skips in budget.items():
        cells = ", ".join(f"{r['dataset']} (repeat {r.get('repeat')})" for r in skips)
        lines.append(f"- **skipped** `{engine}` on {store}: {skips[0]['reason']} — {cells}")
    aborted = [r for r in measurements(rows) if r.get("process_rc") not in (0, None)]
    for key, g in group(aborted, "engine", "store", "process_rc").items():
        lines.append(
            f"- `{key[0]}` on {key[1]}: {len(g)} epoch rows from processes that exited with "
            f"rc={key[2]} after writing their results (kept)"
        )
    n_err = sum(r.get("type") == "error" for r in rows)
    n_skip = sum(r.get("type") == "skip" for r in rows)
    counts = (
        f"Failed measurements: {n_err}; skipped (engine or time budget): {n_skip}; epoch rows "
        f"from processes that exited non-zero: {len(aborted)}."
    )
    return "\n".join([counts, "", *lines]) if lines else counts


# --------------------------------------------------------------------------------------------
# the reference shape (issue 13): epochs 0 and 1, ceilings, and the targets' ratios
# --------------------------------------------------------------------------------------------

EPOCH1 = {"default": "warm_default", "split": "warm_cached"}


def _by_repeat(rows: list[Row], engine: str, store: str, budget: str, kind: str) -> dict:
    """``{repeat: row}`` of one engine's rows on the reference dataset (one per repeat)."""
    out = {}
    for r in measurements(rows):
        if (
            r["dataset"] == REFERENCE.name
            and r["engine"] == engine
            and r["store"] == store
            and r.get("budget") == budget
            and r["epoch_kind"] == kind
        ):
            out[r["repeat"]] = r
    return out


def _ceilings(rows: list[Row], kind: str, store: str, ref: Row) -> dict[Any, float]:
    """``{repeat: samples/s}`` of a ceiling pass on the reference shape (repeat None: one pass
    before the rounds). The raw-GET rate is read in train samples/s: its MB/s over the stored
    MB the train split lives in (the pass reads every object; an epoch needs the train
    chunks')."""
    out = {}
    for r in rows:
        if r.get("type") == kind and r["store"] == store and r["dataset"] == REFERENCE.name:
            if kind == "rawget":
                if ref.get("needed_bytes"):
                    out[r.get("repeat")] = (
                        r["MB_per_s"] * 1e6 * ref["train_samples"] / ref["needed_bytes"]
                    )
            else:
                out[r.get("repeat")] = r["samples_per_s"]
    return out


def _ratios(num_rows: dict, den_rows: dict, metric: str = "samples_per_s") -> list[float | None]:
    """Per-repeat ratios (rows paired by repeat: both were measured in the same round)."""
    out: list[float | None] = []
    for rep in sorted(set(num_rows) & set(den_rows)):
        a, b = num_rows[rep].get(metric), den_rows[rep].get(metric)
        out.append(a / b if a is not None and b else None)
    return out


def _over(rows: dict, ceiling: dict[Any, float]) -> list[float | None]:
    """Per-repeat ratios of samples/s over the ceiling of the same round (or, where the round
    has none, the median of the ceiling's passes)."""
    if not ceiling:
        return []
    fallback = statistics.median(ceiling.values())
    out: list[float | None] = []
    for rep, r in sorted(rows.items()):
        value = ceiling.get(rep, fallback)
        out.append(r["samples_per_s"] / value if value else None)
    return out


def _met(
    values: list[float | None], target: float, below: bool = False, strict: bool = False
) -> str:
    """Whether the median meets the target (``below``: at most, else at least; ``strict``:
    less than / more than)."""
    m = med(values)
    if m is None:
        return "–"
    ok = m <= target if below else m >= target
    return "met" if ok and not (strict and m == target) else "**missed**"


def reference_section(rows: list[Row], run: Row) -> list[str]:
    """The first section of the page: the design's reference shape, epoch 0 and epoch 1 side
    by side, the ceilings of the same run, and the issue's targets as ratios."""
    ref = next((d for d in run["datasets"] if d["name"] == REFERENCE.name), None)
    if ref is None:
        return []
    stores = [s for s in run["stores"] if s in ("local", "s3")]
    out = [
        "## Reference shape",
        "",
        f"The design's reference shape: `t2m` ({ref['n_time']}, {ref['n_lat']}, "
        f"{ref['n_lon']}) + `z` ({ref['n_time']}, {ref['n_level']}, {ref['n_lat']}, "
        f"{ref['n_lon']}), float32, {ref['samples_per_chunk']} samples per chunk, "
        f"{ref['compressor']}: {num(mb(ref['stored_bytes']))} MB stored in {ref['objects']} "
        f"objects; the train split is {ref['train_samples']} samples in "
        f"{ref['train_chunks']} chunks ({num(mb(ref['decoded_train_bytes']))} MB decoded, "
        f"{num(mb(ref['needed_bytes']))} MB stored). *Epoch 0* is the first epoch of a fresh "
        "process, *epoch 1* the second; `budget=default` is the automatic pool budget (epoch 1 "
        "re-fetches and re-decodes most chunks: the same work as epoch 0), `budget=split` "
        "holds the whole split (epoch 1 is pool hits). Medians over the rounds, (min–max) "
        "where they differ; a ratio is taken per round (both sides measured in the same round: "
        "the reference shape's ceilings are measured in every round, right before its "
        "engines), then its median (min–max). The raw-GET ceiling is in train samples/s: its "
        "MB/s over the stored MB the train split lives in.",
        "",
    ]
    for store in stores:
        lines = []
        for budget in ("default", "split"):
            for label, kind in (("0", "cold"), ("1", EPOCH1[budget])):
                nodes = _by_repeat(rows, "nodes", store, budget, kind)
                ib = _by_repeat(rows, "insitubatch", store, budget, kind)
                if not nodes and not ib:
                    continue
                lines.append(
                    [
                        f"`{budget}`",
                        f"{label} ({kind})",
                        span(r["samples_per_s"] for r in nodes.values()),
                        span(r["samples_per_s"] for r in ib.values()),
                        span(_ratios(nodes, ib), 2),
                        span((r["cpu_s"] for r in nodes.values()), 2),
                        span((r["cpu_s"] for r in ib.values()), 2),
                        num(med(r["rss_peak_MB"] for r in nodes.values())),
                        num(med(r["rss_peak_MB"] for r in ib.values())),
                    ]
                )
        header = [
            "budget",
            "epoch",
            "nodes samples/s",
            "insitubatch samples/s",
            "nodes / insitubatch",
            "nodes CPU-s",
            "insitubatch CPU-s",
            "nodes peak RSS MB",
            "insitubatch peak RSS MB",
        ]
        out += [
            f"### {store}",
            "",
            table(header, lines) if lines else "_No nodes or insitubatch rows on this store._",
            "",
        ]
    out += ["### Ceilings (same run)", "", _ceilings_table(rows, ref, stores), ""]
    if "s3" in stores:
        out += ["### Where the cores go on `s3`", "", _s3_cpu_table(rows), ""]
    out += [
        "### Targets (issue 13), as measured in this run",
        "",
        _targets_table(rows, ref, stores),
    ]
    out += [""]
    return out


def _ceilings_table(rows: list[Row], ref: Row, stores: list[str]) -> str:
    lines = []
    texts = {
        "rawget": "raw GET (every stored object, 32 in flight, no decode)",
        "decode": "decode-only (train chunks read + decoded, {threads} threads, reused "
        "buffers laid out as the slots; a local store read on the decode thread)",
    }
    for store in stores:
        for kind, text in texts.items():
            g = [
                r
                for r in rows
                if r.get("type") == kind and r["store"] == store and r["dataset"] == REFERENCE.name
            ]
            if not g:
                continue
            rate = _ceilings(rows, kind, store, ref)
            unit = " decoded" if kind == "decode" else " stored"
            metric = "decoded_MB_per_s" if kind == "decode" else "MB_per_s"
            lines.append(
                [
                    store,
                    text.format(threads=g[0].get("threads")),
                    span(rate.values()),
                    span(r[metric] for r in g) + unit,
                    span((r["wall_s"] for r in g), 2),
                    num(med(r.get("cpu_s") for r in g), 2),
                ]
            )
    memory = {
        kind: [
            r
            for r in measurements(rows)
            if r["engine"] == "memory"
            and r["dataset"] == REFERENCE.name
            and r["epoch_kind"] == kind
        ]
        for kind in ("cold", "warm")
    }
    for kind, g in memory.items():
        if g:
            lines.append(
                [
                    "ram",
                    f"in-RAM gather (`np.take`), {'first' if kind == 'cold' else 'second'} pass",
                    span(r["samples_per_s"] for r in g),
                    num(med(r["decoded_MB_per_s"] for r in g)) + " decoded",
                    span((r["wall_s"] for r in g), 2),
                    num(med(r["cpu_s"] for r in g), 2),
                ]
            )
    if not lines:
        return "_No ceiling was measured on the reference shape in this run._"
    header = ["store", "ceiling", "samples/s", "MB/s", "s", "CPU-s"]
    return table(header, lines)


def _s3_cpu_table(rows: list[Row]) -> str:
    """Per pass on the reference shape over s3: wall time and the CPU of the engine, the S3
    server (moto) and the latency proxy, all on the same cores (medians over the rounds)."""
    passes: list[tuple[str, list[Row]]] = [
        (kind, [r for r in rows if r.get("type") == kind and r.get("store") == "s3"])
        for kind in ("rawget", "decode")
    ]
    for engine in ("nodes", "insitubatch"):
        for kind, label in (("cold", "epoch 0"), ("warm_default", "epoch 1")):
            got = _by_repeat(rows, engine, "s3", "default", kind)
            passes.append((f"{engine} {label} (`default`)", list(got.values())))
    lines = []
    for name, group in passes:
        group = [
            r
            for r in group
            if r.get("dataset") == REFERENCE.name
            and "server_cpu_ms" in (r.get("proxy") or {})
            and r.get("wall_s")
        ]
        if not group:
            continue
        wall = [r["wall_s"] for r in group]
        client = [r["cpu_s"] for r in group]
        server = [r["proxy"]["server_cpu_ms"] / 1000 for r in group]
        proxy = [r["proxy"]["proxy_cpu_ms"] / 1000 for r in group]
        busy = [(c + sv + px) / w for c, sv, px, w in zip(client, server, proxy, wall, strict=True)]
        lines.append(
            [name, span(wall, 3), span(client, 3), span(server, 3), span(proxy, 3), span(busy, 3)]
        )
    if not lines:
        return "_No s3 pass on the reference shape recorded the server's CPU in this run._"
    header = ["pass", "s", "engine CPU-s", "moto CPU-s", "proxy CPU-s", "cores busy"]
    note = (
        "\n\n*cores busy* = (engine + moto + proxy CPU-s) / wall s. Against the machine's "
        "cores it shows how much of the raw-GET ceiling is the stand-in server's own CPU: an "
        "epoch that must also decode shares the same cores with it."
    )
    return table(header, lines) + note


def _targets_table(rows: list[Row], ref: Row, stores: list[str]) -> str:
    lines = []

    def add(name: str, store: str, values: list[float | None], target: str, met: str) -> None:
        if values:
            lines.append([name, store, span(values, 3), target, met])

    memory_warm = {
        r["repeat"]: r["samples_per_s"]
        for r in measurements(rows)
        if r["engine"] == "memory" and r["dataset"] == REFERENCE.name and r["epoch_kind"] == "warm"
    }
    for store in stores:
        cold = _by_repeat(rows, "nodes", store, "default", "cold")
        warm = _by_repeat(rows, "nodes", store, "default", "warm_default")
        cached = _by_repeat(rows, "nodes", store, "split", "warm_cached")
        ib_cold = _by_repeat(rows, "insitubatch", store, "default", "cold")
        ib_warm = _by_repeat(rows, "insitubatch", store, "default", "warm_default")
        v = _ratios(cold, ib_cold)
        add("epoch 0: nodes / insitubatch", store, v, "≥ 1.5", _met(v, 1.5))
        v = _ratios(cold, warm)
        add("nodes epoch 0 / epoch 1 (`default`: same work)", store, v, "≥ 0.9", _met(v, 0.9))
        if store == "local":
            ceiling = _ceilings(rows, "decode", store, ref)
            for label, g in (("0", cold), ("1", warm)):
                v = _over(g, ceiling)
                add(f"nodes epoch {label} / decode-only ceiling", store, v, "≥ 0.85", _met(v, 0.85))
        else:
            ceiling = _ceilings(rows, "rawget", store, ref)
            for label, g in (("0", cold), ("1", warm)):
                v = _over(g, ceiling)
                add(f"nodes epoch {label} / raw-GET ceiling", store, v, "≥ 0.8", _met(v, 0.8))
        v = _over(cached, memory_warm)
        add("nodes epoch 1 (`split`) / in-RAM gather", store, v, "≥ 0.6", _met(v, 0.6))
        for label, a, b in (("0", cold, ib_cold), ("1", warm, ib_warm)):
            v = [
                a[k]["process_rss_peak_MB"] - b[k]["process_rss_peak_MB"]
                for k in sorted(set(a) & set(b))
                if a[k].get("process_rss_peak_MB") is not None
                and b[k].get("process_rss_peak_MB") is not None
            ]
            if label == "0":  # one process per measurement: both epochs share its peak
                add(
                    "peak RSS of the process, nodes − insitubatch (MB, `default`)",
                    store,
                    v,
                    "≤ 300",
                    _met(v, 300, below=True),
                )
            v = _ratios(a, b, "cpu_s")
            add(
                f"CPU-s of epoch {label}, nodes / insitubatch (`default`)",
                store,
                v,
                "≤ 1",
                _met(v, 1.0, below=True),
            )
    if not lines:
        return "_Not enough rows on the reference shape for the targets._"
    return table(["target", "store", "measured", "target", "median"], lines)


# --------------------------------------------------------------------------------------------
# the persistent chunk cache (issue 9): epoch 0 of a fresh process over a warm cache folder
# --------------------------------------------------------------------------------------------

PERSIST_KINDS = (
    ("cold", "epoch 0, no cache (`default` budget)"),
    ("cold_persist", "epoch 0 warming the cache (`persist=True`, `split` budget)"),
    ("warm_disk", "epoch 0 of a fresh process over the warm cache"),
)


def _epochs_of(rows: list[Row], dataset: str, engine: str, store: str, kind: str) -> dict:
    """``{repeat: row}``: one engine's epochs of one kind on (store, dataset); ``cold`` is the
    plain pipeline's (``budget=default``, no cache), the others the persistent cache's."""
    out = {}
    for r in measurements(rows):
        if (r["dataset"], r["engine"], r["store"], r["epoch_kind"]) != (
            dataset,
            engine,
            store,
            kind,
        ):
            continue
        if kind == "cold" and (r.get("budget") != "default" or r.get("cache")):
            continue
        out[r["repeat"]] = r
    return out


def persist_section(rows: list[Row], run: Row) -> list[str]:
    """Beside the reference shape: the persistent chunk cache. Per engine, epoch 0 without a
    cache, the epoch that warms the cache, and epoch 0 of a fresh process over the warm cache,
    next to the in-RAM gather; the issue's targets as ratios taken per round."""
    cells = [
        (store, name)
        for store, names in (run.get("persist_datasets") or {}).items()
        for name in names
        if store in run.get("stores", [])
    ]
    out: list[str] = []
    for store, dataset in cells:
        warm = {
            e: _epochs_of(rows, dataset, e, store, "warm_disk") for e in ("nodes", "insitubatch")
        }
        if not any(warm.values()):
            continue
        memory = _epochs_of(rows, dataset, "memory", "ram", "warm")
        lines = []
        for engine in ("nodes", "insitubatch"):
            for kind, text in PERSIST_KINDS:
                g = list(_epochs_of(rows, dataset, engine, store, kind).values())
                if not g:
                    continue
                extra = [r.get("extra") or {} for r in g]
                lines.append(
                    [
                        engine,
                        text,
                        span(r["samples_per_s"] for r in g),
                        span((r["ttfb_s"] for r in g), 2),
                        num(med(r["cpu_s"] for r in g), 2),
                        num(med(r["rss_peak_MB"] for r in g)),
                        num(med(r["gets"] for r in g)),
                        num(med(e.get("disk_hits") for e in extra)) if kind != "cold" else "–",
                        num(med(mb(r.get("cache_dir_bytes")) for r in g)),
                        str(len(g)),
                    ]
                )
        if memory:
            g = list(memory.values())
            lines.append(
                [
                    "memory",
                    "in-RAM gather (`np.take`), second pass: the ceiling",
                    span(r["samples_per_s"] for r in g),
                    span((r["ttfb_s"] for r in g), 2),
                    num(med(r["cpu_s"] for r in g), 2),
                    num(med(r["rss_peak_MB"] for r in g)),
                    "–",
                    "–",
                    "–",
                    str(len(g)),
                ]
            )
        header = [
            "engine",
            "epoch",
            "samples/s",
            "TTFB s",
            "CPU-s",
            "peak RSS MB",
            "GETs",
            "chunks from disk",
            "cache on disk MB",
            "n",
        ]
        cold = {e: _epochs_of(rows, dataset, e, store, "cold") for e in warm}
        out += [
            f"## Persistent chunk cache ({dataset}, {store})",
            "",
            "Epoch 0 of a *fresh process* whose `cache_dir` another process warmed: nodes "
            "`insitu_pipeline(..., cache_dir=DIR, persist=True)`, insitubatch "
            "`InSituDataset(..., cache_dir=DIR, persist=True)`, both with the `split` budget. "
            "Per round and engine, one process runs an epoch over a new, empty folder (the "
            "warming epoch: fetch, decode, and write every chunk to the folder), exits, and a "
            "second process over the same folder runs the measured epoch; then the folder is "
            "deleted. *chunks from disk*: chunks (per variable) revived from the folder in "
            "that epoch; *GETs* of the warm epoch are metadata reads, if any. The folder is on "
            "local disk; between the two processes its files are written back to disk (`fsync`, "
            "as a later run finds them: the warming run's writeback is not the reader's cost), "
            "and they stay in the page cache, as the local store's files do. The ceiling is the "
            "in-RAM gather of the same round. Ratios are taken "
            "per round, then summarised as median (min–max).",
            "",
            table(header, lines),
            "",
            _persist_targets(warm, cold, memory),
            "",
        ]
    return out


def _persist_targets(warm: dict[str, dict], cold: dict[str, dict], memory: dict) -> str:
    """The persistent cache's ratios: issue 9's two targets, and two for context."""
    lines = []

    def add(name: str, values: list[float | None], target: str, met: str) -> None:
        if values:
            lines.append([name, span(values, 3), target, met])

    ours, theirs = warm["nodes"], warm["insitubatch"]
    ceiling = {k: r["samples_per_s"] for k, r in memory.items()}
    v = _over(ours, ceiling)
    add("nodes warm-cache epoch 0 / in-RAM gather", v, "≥ 0.6", _met(v, 0.6))
    v = _ratios(ours, theirs)
    add("nodes / insitubatch, warm-cache epoch 0", v, "> 1", _met(v, 1.0, strict=True))
    v = _over(theirs, ceiling)
    add("insitubatch warm-cache epoch 0 / in-RAM gather", v, "–", "–")
    for engine, g in warm.items():
        v = _ratios(g, cold[engine])
        add(f"{engine} warm-cache epoch 0 / its epoch 0 without a cache", v, "–", "–")
    if not lines:
        return "_Not enough rows for the ratios._"
    return table(["ratio", "measured", "target", "median"], lines)


def _persist_setup(run: Row) -> list[str]:
    """The Setup bullet of the persistent-cache measurement (none when the run had none)."""
    cells = [
        f"`{name}` on {store}"
        for store, names in (run.get("persist_datasets") or {}).items()
        for name in names
        if store in run.get("stores", [])
    ]
    if not cells or "persist" not in run.get("variants", ["persist"]):
        return []
    return [PERSIST_SETUP.format(cells=", ".join(cells))]


PERSIST_SETUP = (
    "- Persistent chunk cache (nodes and insitubatch, on {cells}): in every round, one process "
    "runs an epoch with `cache_dir=DIR, persist=True` and the `split` budget over a new folder "
    "in the harness's temporary folder on local disk (`cold_persist`: it fetches and decodes "
    "every chunk and writes it to the folder) and exits; a second, fresh process over the same "
    "folder runs its epoch 0 (`warm_disk`), served from the folder (no chunk fetched or "
    "decoded); then the folder is deleted. That epoch's ceiling is the in-RAM gather of the "
    "same round (see *Persistent chunk cache*)."
)


def _budget_text(run: Row) -> str:
    soft, hard = run.get("soft_budget_s"), run.get("hard_budget_s")
    if soft is None or hard is None:
        return "none."
    return (
        f"past {soft / 60:.0f} minutes the per-sample loaders are skipped, past {hard / 60:.0f} "
        "minutes every engine is, so the suite ends in time on a loaded machine; any such skip "
        "is listed under *Skipped, failed or unusual*."
    )


def render(rows: list[Row], source: Path, plots: dict[str, Path | None], doc: Path) -> str:
    run = next(r for r in rows if r.get("type") == "run")
    end = next((r for r in rows if r.get("type") == "end"), None)
    m = run["machine"]
    v = m["versions"]
    ib = m.get("insitubatch_venv") or {}
    grid = [d for d in run["datasets"] if d["name"] != REFERENCE.name]
    d0 = grid[0] if grid else (run["datasets"][0] if run["datasets"] else {})
    besides = bool(grid) and len(grid) < len(run["datasets"])
    datasets = [d["name"] for d in run["datasets"]]
    per_sample = run.get("per_sample_datasets") or {}
    spc_sets = "; ".join(f"{st}: {', '.join(names)}" for st, names in per_sample.items())
    cfg: dict[str, Any] = next((r["config"] for r in measurements(rows)), {})
    rel = {k: (os.path.relpath(p, doc.parent) if p else None) for k, p in plots.items()}
    total = f"{end['total_s'] / 60:.1f} minutes" if end else "unknown (the run did not finish)"
    best = [r for r in rows if r.get("type") == "best_workers"]
    best_text = ", ".join(f"{r['engine']} on {r['store']}: N={r['num_workers']}" for r in best)

    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/report.py from the JSONL named below. Do not edit by hand:"
        " run `make bench` (or `python -m benchmarks.report`) to regenerate. -->",
        "",
        f"**These numbers come from one run on a shared, noisy 2-core machine** "
        f"(`{source.name}`, {total}). Every cell is the median over the repeats, with the "
        "min–max range where it differs; treat differences smaller than that range as noise. "
        "They compare the engines with each other on this machine; they are not absolute "
        "figures for other hardware.",
        "",
        *reference_section(rows, run),
        *persist_section(rows, run),
        "## How to reproduce",
        "",
        "```bash",
        "make bench        # the full suite, then this page and the plots",
        "make bench-smoke  # < 2 minutes: every engine once on a tiny dataset (a harness check)",
        "```",
        "",
        f"This run's command: `{run['command']}`  ",
        f"Harness arguments: `{' '.join(run['argv'][1:]) or '(defaults)'}`. "
        "What each engine is, and the caveats, are in "
        f"[benchmarks/README.md]({os.path.relpath(HERE / 'README.md', doc.parent)}).",
        "",
        "## Machine",
        "",
        table(
            ["", ""],
            [
                ["CPU", f"{m['cpu_model']}, {m['cores']} cores"],
                ["RAM", f"{m['ram_bytes'] / 2**30:.1f} GiB" if m.get("ram_bytes") else "?"],
                ["OS", m["os"]],
                ["Python (nodes, workers, xbatcher, memory)", m["python"]],
                ["torch / torchdata", f"{v.get('torch')} / {v.get('torchdata')}"],
                [
                    "zarr / numcodecs / numpy",
                    f"{v.get('zarr')} / {v.get('numcodecs')} / {v.get('numpy')}",
                ],
                ["obstore / moto", f"{v.get('obstore')} / {v.get('moto')}"],
                ["xarray / xbatcher", f"{v.get('xarray')} / {v.get('xbatcher')}"],
                [
                    "insitubatch venv",
                    f"Python {ib.get('python')}, insitubatch {ib.get('insitubatch')}, "
                    f"zarr {ib.get('zarr')}, numpy {ib.get('numpy')}, obstore {ib.get('obstore')}"
                    if ib and "error" not in ib
                    else "not available",
                ],
                ["memory sampling", f"{m['rss_source']}, RSS summed over the process tree"],
            ],
        ),
        "",
        "## Setup",
        "",
        f"- Data: `make_era5_like`, `t2m` (time, lat, lon) and `z` (time, level, lat, lon), "
        f"{'besides the reference shape (above), ' if besides else ''}"
        f"n_time={d0.get('n_time')}, grid {d0.get('n_lat')}×{d0.get('n_lon')}, "
        f"{d0.get('n_level')} levels, float32, {d0.get('compressor')}; one sample (both "
        f"variables) is {num(mb(d0.get('sample_nbytes')))} MB decoded. Split: "
        "`split_by_chunk(t2m, (0.8, 0.1, 0.1))`, the train split, the same for every engine.",
        f"- Every engine: batch size {cfg.get('batch_size')}, both variables, shuffled; nodes "
        f"and insitubatch with block_chunks={cfg.get('block_chunks')}, "
        f"max_inflight={cfg.get('max_inflight')}.",
        "- Stores: `local` = obstore `LocalStore` on the local disk (the files are in the page "
        "cache: the raw-GET pass reads them first); `s3` = moto S3 on 127.0.0.1 behind a "
        f"latency proxy adding {run['latency_ms']:g} ms to every request, which also counts the "
        "requests and response bytes of every engine. `ram` = the memory engine.",
        f"- Repeats: {run['repeats']} round(s); within a round the engines run in an order that "
        "rotates from round to round, each measurement in a fresh interpreter.",
        f"- Per-sample loaders (workers, xbatcher): worker counts {run['worker_counts']} swept "
        f"once per store on `{run.get('tune_dataset')}` (round 0); the best by warm samples/s "
        f"({best_text or 'n/a'}) then runs every round on {spc_sets}. Their epochs are "
        f"{run.get('per_sample_batches') or 'all'} batches of distinct samples drawn from the "
        "whole split (they have no cache, so the rate does not change over an epoch), which "
        "keeps the suite within its time budget; their cold epoch includes spawning the workers.",
        f"- Time budget: {_budget_text(run)}",
        "- nodes / insitubatch: `budget=default` is the automatic pool budget (cold, then "
        "`warm_default`); `budget=split` sets `cache_budget_bytes` to hold the whole split "
        "(cold, then `warm_cached`: pool hits). workers / xbatcher: `cold` is the first epoch "
        "(spawns the workers), `warm` the second (persistent workers).",
        *_persist_setup(run),
        "",
        "### Datasets",
        "",
        datasets_table(run),
        "",
        "## Summary: samples/s (median)",
        "",
        "Cold = first epoch of a fresh process (nodes/insitubatch: automatic budget). Warm = "
        "second epoch (nodes/insitubatch: `warm_cached`, the split held in the pool; "
        "workers/xbatcher: persistent workers; memory: second pass). – = not measured on that "
        "layout (see Setup). The memory engine reads no store: its columns repeat the same RAM "
        "numbers in every store's table, as the ceiling.",
        "",
    ]
    for store in run["stores"]:
        out += [f"### {store}", "", summary_table(rows, store, datasets), ""]
    if rel.get("throughput"):
        out += [f"![throughput vs samples per chunk]({rel['throughput']})", ""]
    if rel.get("memory"):
        out += [f"![peak memory]({rel['memory']})", ""]
    if not any(rel.values()):
        out += [
            "_Plots were not drawn: matplotlib is not installed (`pip install -e '.[bench]'`)._",
            "",
        ]
    out += [
        "## Raw-GET and decode-only ceilings",
        "",
        "`rawget`: every stored chunk object of the dataset fetched once with "
        "`obstore.get_async`, 32 in flight, no decode. `decode`: every stored object of the "
        "train chunks fetched the same way and decoded with `ChunkDecoder.decode_into` on the "
        "pipeline's default number of decode threads into preallocated buffers that are reused "
        "and laid out as the pipeline's slots (level-major for an array stored one level per "
        "object; no pool, no gather). A local store is read on the decode thread, as the "
        "pipeline reads it. One pass each per store and dataset before the rounds (round "
        "`before`), or in every round for the reference shape.",
        "",
        rawget_table(rows),
        "",
        "## Details",
        "",
        "Medians over the repeats, (min–max) where they differ. *samples/s* and *decoded MB/s* "
        "are over the epoch's wall time (from `iter()` to the last batch); *TTFB* = `iter()` to "
        "the first batch; *peak RSS* = the largest RSS of the whole process tree (workers "
        "included) sampled every 20 ms during the epoch; *CPU-s* = user+sys of the process "
        "tree during the epoch; *GETs* / *MB fetched* = counted at the S3 proxy for `s3`, by "
        "the engine for `local` (nodes: its pool counters; the others: a counting zarr store "
        "wrapper); *read amp.* = MB fetched / stored MB of the distinct objects the delivered "
        "samples live in (0 = served from the pool; below 1 = byte-range reads of parts of "
        "objects); *shuffle q.* = `insitubatch_nodes.shuffle_quality` of the delivered sample "
        "order (≈1 = as mixed as a global shuffle).",
        "",
    ]
    for store in [*run["stores"], "ram"]:
        tables = detail_tables(rows, store, datasets)
        if tables:
            out += [f"### {store}", "", tables, ""]
    out += [
        "## Worker-count sweep (per-sample loaders)",
        "",
        sweep_table(rows),
        "",
        "## Skipped, failed or unusual",
        "",
        problems_section(rows),
        "",
        "## Caveats",
        "",
        "- One run, one shared 2-core machine, other jobs possibly running: the min–max ranges "
        "are part of the result.",
        "- The S3 endpoint is moto (Python) on loopback behind a Python proxy: its request rate "
        "and bandwidth (see the raw-GET table) are those of this stand-in, not of a cloud "
        "service; moto answers every request on a new connection. Server and proxy CPU is not "
        "in any engine's CPU-s; *Where the cores go on `s3`* shows it, per pass.",
        "- `local` reads come from the page cache, not from a cold disk.",
        "- The per-sample loaders' epochs are shorter than the others' (see Setup), so their "
        "cold samples/s carries their worker start-up over fewer samples; compare their warm "
        "numbers and TTFB.",
        "- RSS sums count pages shared between processes once per process. The nodes, workers "
        "and xbatcher processes import torch (a few hundred MB of RSS before any data; each "
        "spawned worker imports it again); insitubatch and memory do not. The JSONL also has "
        "each epoch's RSS at its start (`rss_at_start_MB`).",
        "",
    ]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------


def draw_plots(rows: list[Row], out_dir: Path) -> dict[str, Path | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"throughput": None, "memory": None}
    out_dir.mkdir(parents=True, exist_ok=True)
    run = next(r for r in rows if r.get("type") == "run")
    spc_of = {
        d["name"]: d["samples_per_chunk"]
        for d in run["datasets"]
        if not d.get("inner_chunks") and not d.get("shard_samples") and d["name"] != REFERENCE.name
    }
    head = [r for r in headline_rows(rows) if r["dataset"] in spc_of]
    stores = run["stores"]

    def pick(r: Row, kind: str) -> bool:
        if r["engine"] in ("nodes", "insitubatch"):
            if kind == "cold":
                return r["epoch_kind"] == "cold" and r["budget"] == "default"
            return r["epoch_kind"] == "warm_cached"
        return r["epoch_kind"] == kind

    def series(
        store: str, engine: str, kind: str, metric: Callable[[Row], float | None]
    ) -> tuple[list[int], list[float]]:
        st = "ram" if engine == "memory" else store
        by: dict[int, list[float]] = defaultdict(list)
        for r in head:
            if r["engine"] == engine and r["store"] == st and pick(r, kind):
                val = metric(r)
                if val is not None:
                    by[spc_of[r["dataset"]]].append(val)
        xs = sorted(by)
        return xs, [statistics.median(by[x]) for x in xs]

    engines = sorted({r["engine"] for r in head}, key=engine_key)
    ticks = sorted(set(spc_of.values()))
    styles = {"memory": {"linestyle": "--", "color": "grey"}}
    fig, axes = plt.subplots(len(stores), 2, figsize=(11, 4.2 * len(stores)), squeeze=False)
    for i, store in enumerate(stores):
        for j, kind in enumerate(("cold", "warm")):
            ax = axes[i][j]
            for engine in engines:
                xs, ys = series(store, engine, kind, lambda r: r["samples_per_s"])
                if xs:
                    ax.plot(xs, ys, marker="o", label=engine, **styles.get(engine, {}))
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, labels=[str(t) for t in ticks])
            ax.set_yscale("log")
            ax.set_xlabel("samples per chunk")
            ax.set_ylabel("samples/s (median)")
            ax.set_title(f"{store}: {kind} epoch")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle("Throughput vs samples per chunk (one run, shared 2-core machine)")
    fig.tight_layout()
    throughput = out_dir / "throughput.png"
    fig.savefig(throughput, dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(stores), figsize=(5.5 * len(stores), 4.2), squeeze=False)
    for i, store in enumerate(stores):
        ax = axes[0][i]
        for engine in engines:
            xs, ys = series(store, engine, "cold", lambda r: r["rss_peak_MB"])
            if xs:
                ax.plot(xs, ys, marker="o", label=engine, **styles.get(engine, {}))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.set_xlabel("samples per chunk")
        ax.set_ylabel("peak RSS of the process tree, MB (cold epoch)")
        ax.set_title(store)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Peak memory (median; one run, shared 2-core machine)")
    fig.tight_layout()
    memory = out_dir / "peak_memory.png"
    fig.savefig(memory, dpi=90)
    plt.close(fig)
    return {"throughput": throughput, "memory": memory}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", nargs="?", help="a bench JSONL (default: the newest full run)")
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--plots", default=str(HERE / "plots"))
    args = p.parse_args(argv)
    source = Path(args.jsonl) if args.jsonl else newest(HERE / "results")
    rows = load(source)
    if not any(r.get("type") == "run" for r in rows):
        raise SystemExit(f"{source} has no run header row")
    doc = Path(args.doc)
    plots = draw_plots(rows, Path(args.plots))
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(rows, source, plots, doc))
    print(f"[report] {doc} and {', '.join(str(p) for p in plots.values() if p) or 'no plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
