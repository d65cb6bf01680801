"""The trace of an epoch: a Chrome-trace JSON file of every stage's spans, and the stages'
ranges inside a ``torch.profiler`` trace.

The file is checked as a trace viewer reads it (the Trace Event Format): it loads as JSON, has a
span for every stage with its chunk and batch ids, the spans of one thread nest or follow each
other, and its counts are the epoch report's, which the store's own counts back.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Oracle, View, counting_store, run_epoch, write_era5

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.stages import _ranges
from insitubatch_nodes.trace import SPAN_CATEGORIES

pytestmark = pytest.mark.timeout(120)

N_TIME, SPC = 96, 4


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_era5(tmp_path_factory.mktemp("trace") / "era5.zarr", n_time=N_TIME, n_lat=8,
                      n_lon=16, samples_per_chunk=SPC)  # fmt: skip


def _pipe(store: Any, trace: bool = True, **kw: Any) -> Any:
    g = open_geometries(store, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    manifest = split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))
    return insitu_pipeline(
        store, manifest, views, batch_size=8, block_chunks=4, coords=(),
        fetch=FetchOptions(trace=trace), **kw,
    )  # fmt: skip


def _oracle_views() -> dict[str, View]:
    return {"x": View("t2m"), "y": View("t2m", offset=1), "z": View("z")}


def _complete(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X"]


def _assert_nested_per_thread(events: list[dict[str, Any]]) -> None:
    """On each thread, two complete spans either nest or do not overlap (what a viewer's flame
    chart needs)."""
    by_thread: dict[int, list[tuple[float, float, str]]] = {}
    for e in _complete(events):
        by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for tid, spans in by_thread.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[float] = []
        for start, end, name in spans:
            while open_ends and open_ends[-1] <= start + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, (tid, name, start, end)
            open_ends.append(end)


def test_a_traced_epoch_is_chrome_trace_json_with_every_stage_and_the_reports_counts(
    era5: Path, tmp_path: Path
) -> None:
    pipe = _pipe(era5)
    records = run_epoch(pipe, Oracle(era5), _oracle_views())
    report = pipe.report()
    assert report is not None and report.complete
    path = report.write_trace(tmp_path / "epoch0.json")
    pipe.close()
    doc = json.loads(path.read_text())  # a viewer's first step: it is JSON
    events = doc["traceEvents"]
    spans = _complete(events)
    names = Counter(e["name"] for e in spans)
    # a store on local disk is read on the decode threads: reads, not GETs
    for name in ("read", "decode", "fill run", "admit", "wait for chunks", "gather", "next"):
        assert names[name] > 0, names
    # the consumer's waits: one per batch, and the call that ended the epoch; its own work
    # after each batch
    assert names["next"] == len(records) + 1 and names["consumer"] == len(records)
    assert names["read"] == report.gets and names["decode"] == report.decodes
    assert {e["cat"] for e in spans} <= set(SPAN_CATEGORIES.values())
    # every batch's stages, with its id; every decode with its array, chunk and batch
    delivered = sorted(r["index"] for r in records)
    for name in ("gather", "wait for chunks"):
        assert sorted(e["args"]["batch"] for e in spans if e["name"] == name) == delivered
    decodes = [e for e in spans if e["name"] == "decode"]
    assert {e["args"]["array"] for e in decodes} == {"t2m", "z"}
    assert all(0 <= e["args"]["chunk"] < N_TIME // SPC for e in decodes)
    assert {e["args"]["batch"] for e in decodes} <= set(delivered)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    # threads are named, and each thread's spans nest
    named = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {e["tid"] for e in spans} <= set(named)
    assert any(n.startswith("insitu-prefetch") for n in named.values()), named
    assert any(n.startswith("insitu-decode") for n in named.values()), named
    _assert_nested_per_thread(events)


def test_gets_are_async_spans_with_their_keys_one_per_get_the_store_served(
    era5: Path, tmp_path: Path
) -> None:
    store = counting_store(era5)  # read with GETs on the IO loop
    pipe = _pipe(store)
    run_epoch(pipe, Oracle(era5), _oracle_views())
    report = pipe.report()
    assert report is not None
    events = json.loads(report.write_trace(tmp_path / "gets.json").read_text())["traceEvents"]
    pipe.close()
    begins = [e for e in events if e["ph"] == "b"]
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    assert len(begins) == len(ends) == report.gets > 0
    assert all(e["name"] == "GET" and ends[e["id"]]["ts"] >= e["ts"] for e in begins)
    keys = Counter(e["args"]["key"] for e in begins)
    counts = store.chunk_counts()  # what the store served, object by object
    assert keys == Counter({k: n for k, n in counts.items() if n}), (keys, counts)
    assert Counter(e["name"] for e in _complete(events))["decode"] == report.decodes


def test_each_epoch_has_its_own_trace_and_an_untraced_pipeline_records_none(
    era5: Path, tmp_path: Path
) -> None:
    pipe = _pipe(era5)
    first = []
    for epoch in range(2):
        run_epoch(pipe)
        report = pipe.report()
        assert report is not None and report.trace is not None and report.trace.epoch == epoch
        first.append(min(s[1] for s in report.trace.spans))
        assert min(s[1] for s in report.trace.spans) >= report.trace.t0
        pipe.reset()
    assert first[1] > first[0]
    assert "trace" not in report.as_dict()  # plain numbers only
    pipe.close()
    plain = _pipe(era5, trace=False)
    run_epoch(plain)
    assert plain.stages.fetch.recorder.trace is None
    report = plain.report()
    assert report is not None and report.trace is None
    with pytest.raises(ValueError, match=r"FetchOptions\(trace=True\)"):
        report.write_trace(tmp_path / "none.json")
    plain.close()


def test_a_trace_write_that_fails_midway_leaves_the_earlier_file_whole_and_no_partial_one(
    era5: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file was opened at its path and written in place: an interrupted write (Ctrl-C, a
    # full disk) left a truncated JSON that no viewer opens, over the earlier epoch's trace.
    pipe = _pipe(era5)
    run_epoch(pipe)
    report = pipe.report()
    pipe.close()
    assert report is not None
    path = report.write_trace(tmp_path / "trace.json")
    whole = path.read_bytes()

    def interrupted(obj: Any, f: Any, **kwargs: Any) -> None:
        f.write(json.dumps(obj)[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write_trace(path)
    assert path.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_a_trace_needs_the_report() -> None:
    with pytest.raises(ValueError, match="report=True"):
        FetchOptions(trace=True, report=False)
    with pytest.raises(TypeError):
        FetchOptions(trace=1)  # type: ignore[arg-type]


def test_the_stages_show_as_named_ranges_inside_a_torch_profiler_trace(era5: Path) -> None:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import profile

    pipe = _pipe(era5, trace=False, cache_budget_bytes=None)
    assert not _ranges.profiling()
    assert _ranges.profile_range("insitu.gather") is _ranges.profile_range("insitu.next")
    with profile() as consumer_only:  # the consumer's thread: its wait for each batch
        for i, _ in enumerate(pipe):
            if i == 3:
                break
    got = Counter(e.name for e in consumer_only.events() if e.name.startswith("insitu."))
    assert got["insitu.next"] == 4, got
    pipe.close()
    pipe = _pipe(era5, trace=False)
    with profile(experimental_config=_ExperimentalConfig(profile_all_threads=True)) as every:
        for i, _ in enumerate(pipe):
            if i == 3:
                break
    pipe.close()
    names = {e.name for e in every.events() if e.name.startswith("insitu.")}
    assert names == set(_ranges.RANGE_NAMES), names
    assert not _ranges.profiling()


def test_tracing_leaves_the_batches_exactly_as_zarr_reads_them(era5: Path) -> None:
    traced = run_epoch(_pipe(era5), Oracle(era5), _oracle_views(), keep_arrays=True)
    plain = run_epoch(_pipe(era5, trace=False), keep_arrays=True)
    assert [r["index"] for r in traced] == [r["index"] for r in plain]
    for a, b in zip(traced, plain, strict=True):
        for label in ("x", "y", "z"):
            np.testing.assert_array_equal(a["arrays"][label], b["arrays"][label])


@pytest.fixture(scope="module")
def one_step_per_object(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """1,200 steps of two arrays, one step per stored object: 2,400 objects an epoch, in a
    folder in memory (``/dev/shm``) where it has room: writing its 2,400 objects and their
    folders took 2.6 CPU-s on this machine's disk against 1.8 s in memory (2026-12-07); what
    the test counts (garbage collections in an epoch) does not depend on the medium."""
    shm = Path("/dev/shm")
    in_memory = shm.is_dir() and shutil.disk_usage(shm).free > 1 << 30
    folder = Path(tempfile.mkdtemp(dir=shm)) if in_memory else tmp_path_factory.mktemp("trace")
    try:
        yield write_era5(folder / "steps.zarr", n_time=1200, n_lat=2, n_lon=4, n_level=1,
                         samples_per_chunk=1)  # fmt: skip
    finally:
        if in_memory:
            shutil.rmtree(folder, ignore_errors=True)


def _collections_in_an_epoch(store: Path, trace: bool) -> tuple[int, Any, dict[str, int]]:
    """Garbage collections during one epoch (any generation), its report and the stats.
    Batches of 100: the few spans each batch records (admission, gather, waits) are not what
    is measured. A budget of half the split: rows decode straight into the batches, so the
    pool keeps no entry per stored object (the untraced epoch makes next to no lasting
    object)."""
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    budget = (g["t2m"].sample_nbytes + g["z"].sample_nbytes) * 600
    pipe = insitu_pipeline(store, manifest, {"x": g["t2m"], "z": g["z"]}, batch_size=100,
                           coords=(), cache_budget_bytes=budget,
                           fetch=FetchOptions(trace=trace))  # fmt: skip
    started = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(note)
    try:
        run_epoch(pipe)
    finally:
        gc.callbacks.remove(note)
    report, stats = pipe.report(), pipe.stats()
    pipe.close()
    return len(started), report, stats


def test_a_traced_epoch_wakes_the_garbage_collector_no_more_than_an_untraced_one(
    one_step_per_object: Path,
) -> None:
    # each stored object's read and decode spans were kept as tuples: ~4 live containers per
    # object, a young collection every 700 of them (15 here, against none untraced)
    _collections_in_an_epoch(one_step_per_object, trace=False)  # the process's first: warm-up
    plain, _, _ = _collections_in_an_epoch(one_step_per_object, trace=False)
    traced, report, stats = _collections_in_an_epoch(one_step_per_object, trace=True)
    assert report is not None and report.trace is not None
    counts = report.trace.counts()
    assert counts["read"] == report.gets == 2400 and counts["decode"] == report.decodes == 2400
    assert stats["misses_in_place"] == 2400, "rows decoded straight into the batches"
    assert traced <= plain + 2, (traced, plain)


def test_a_report_mid_epoch_has_the_spans_so_far_and_the_epochs_end_has_them_all(
    era5: Path,
) -> None:
    store = counting_store(era5)  # GETs, recorded on the IO loop's own buffer
    pipe = _pipe(store)
    it = iter(pipe)
    next(it)
    next(it)
    partial = pipe.report()
    assert partial is not None and not partial.complete and partial.trace is not None
    so_far = partial.trace.counts()
    assert 0 < so_far["GET"] <= partial.gets and so_far["decode"] <= partial.decodes
    for _ in it:
        pass
    final = pipe.report()
    pipe.close()
    assert final is not None and final.complete and final.trace is not None
    counts = final.trace.counts()
    assert counts["GET"] == final.gets >= so_far["GET"]
    assert counts["decode"] == final.decodes >= so_far["decode"]


@pytest.mark.parametrize("reads", ["local", "get"])
@pytest.mark.parametrize("kept", [False, True])
def test_rows_decoded_in_place_carry_the_batch_and_row_whose_sample_they_are(
    tmp_path: Path, kept: bool, reads: str
) -> None:
    # one sample per chunk: a chunk is a row's sample, so each read and decode span names the
    # (batch, row) it filled (z is stored one level per object: two per row); kept (the split
    # fits the budget) it is filled into a slot for the first batch reading it, and epoch 1
    # has no read at all. (Decodes after a GET, and reads of z, carried no row.)
    root = write_era5(tmp_path / "one.zarr", n_time=24, n_lat=2, n_lon=4, n_level=2,
                      samples_per_chunk=1)  # fmt: skip
    store = root if reads == "local" else counting_store(root)
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))
    split = 18 * (g["t2m"].chunk_nbytes + g["z"].chunk_nbytes)
    pipe = insitu_pipeline(
        store, manifest, {"t2m": g["t2m"], "z": g["z"]}, batch_size=4, block_chunks=2,
        coords=(), cache_budget_bytes=split if kept else split - 1,
        fetch=FetchOptions(trace=True),
    )  # fmt: skip
    with pipe:
        for epoch in range(2):
            samples = {b.index: {k: np.array(v) for k, v in b.sample_indices.items()} for b in pipe}
            report = pipe.report()
            assert report is not None and report.trace is not None
            objects = [
                e for e in report.trace.chrome()["traceEvents"] if e["name"] in ("read", "decode")
            ]
            per_pass = 18 * 3  # t2m and z's 2 levels: 3 stored objects a sample
            assert len(objects) == (0 if kept and epoch else per_pass * (1 + (reads == "local")))
            for e in objects:
                a = e["args"]
                readers = [i for i, s in samples.items() if a["chunk"] in s[a["array"]]]
                if kept:  # into a slot, for its first reader
                    assert "row" not in a and a["batch"] == min(readers), a
                else:  # straight into the row that is that sample
                    assert samples[a["batch"]][a["array"]][a["row"]] == a["chunk"], a
            pipe.reset()


def test_a_next_that_fails_shows_its_wait_and_error_in_the_trace(tmp_path: Path) -> None:
    # the consumer's row of a failed epoch ends with the wait that raised, not with the last
    # batch it got (the wait before an error, up to a GET's deadline, was not in the trace),
    # and that wait covers the reads and decodes of the batch that failed
    root = write_era5(tmp_path / "bad.zarr", n_time=24, n_lat=2, n_lon=4, n_level=1,
                      samples_per_chunk=1)  # fmt: skip
    g = open_geometries(root, ["t2m"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    (root / "t2m" / "c" / "9" / "0" / "0").write_bytes(b"not zstd")  # sample 9: batch 2
    pipe = insitu_pipeline(
        root, manifest, {"x": g["t2m"]}, batch_size=4, block_chunks=1, shuffle=False,
        coords=(), fetch=FetchOptions(trace=True),
    )  # fmt: skip
    got = 0
    with pipe, pytest.raises(ChunkReadError):
        for _ in pipe:
            got += 1
    assert got == 2
    report = pipe.report()
    assert report is not None and not report.complete and report.batches == 2
    spans = _complete(report.trace.chrome()["traceEvents"])  # type: ignore[union-attr]
    waits = sorted((e for e in spans if e["name"] == "next"), key=lambda e: e["ts"])
    assert [e["args"]["batch"] for e in waits] == [0, 1, -1]
    assert waits[-1]["args"]["error"] == "ChunkReadError"
    # it ends after every span of the batches delivered and of the object that failed; other
    # reads (read-ahead, the failed batch's other rows) may still be winding down when the
    # error reaches the consumer, at once
    args = [e.get("args", {}) for e in spans]
    before = [
        e
        for e, a in zip(spans, args, strict=True)
        if e["name"] != "next" and (a.get("batch", -1) in (0, 1) or a.get("chunk") == 9)
    ]
    assert any(a.get("chunk") == 9 for a in args)
    assert waits[-1]["ts"] + waits[-1]["dur"] >= max(e["ts"] + e["dur"] for e in before)
    wait_s = sum(e["dur"] for e in waits) / 1e6
    assert report.handoff_wait_s == pytest.approx(wait_s, abs=1e-4)
