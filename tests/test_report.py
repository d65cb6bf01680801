"""The epoch report names the stage that holds the batches back, and its numbers add up.

Each limiting case is built with a large margin (a consumer sleeping 50 ms per batch, a store
answering every GET after 100 ms, one decode thread on bzip2) so the verdict does not depend on
how busy the machine is. Counts are checked against the store's own counts and the files on disk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import resource
import time
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
from helpers import CountingStore, counting_store, wait_until, write_era5

from insitubatch_nodes import EpochReport, Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.recorder import NULL_RECORDER
from insitubatch_nodes.report import (
    CONSUMER_WAIT_FRACTION,
    STAGES,
    limiting_stage,
    memory_bound,
    suggestion_for,
)

N_TIME, SPC = 256, 8  # 32 chunks of t2m


# one worker runs the module: its module fixtures are built once, not once per worker; the
# worker of the tests that import Lightning, which three of its tests do
pytestmark = pytest.mark.xdist_group("lightning")


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_era5(tmp_path_factory.mktemp("report") / "era5.zarr", n_time=N_TIME, n_lat=16,
                      n_lon=32, samples_per_chunk=SPC)  # fmt: skip


@pytest.fixture(scope="module")
def bz2_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report-bz2") / "bz2.zarr"
    group = zarr.open_group(str(root), mode="w", zarr_format=2)
    arr = group.create_array(
        "v", shape=(256, 64, 64), chunks=(16, 64, 64), dtype="float32",
        compressors=numcodecs.BZ2(level=9),
    )  # fmt: skip
    arr[...] = np.random.default_rng(0).normal(size=arr.shape).astype("float32")
    return root


def _pipe(store: CountingStore, **kw: object):  # type: ignore[no-untyped-def]
    t2m = open_geometries(store, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    opts: dict[str, object] = {"batch_size": 16, "block_chunks": 4}
    opts.update(kw)
    return insitu_pipeline(store, manifest, {"x": t2m}, **opts), t2m  # type: ignore[arg-type]


def _epoch(pipe, sleep: float = 0.0) -> EpochReport:  # type: ignore[no-untyped-def]
    for _ in Loader(pipe):
        if sleep:
            time.sleep(sleep)
    report = pipe.report()
    assert report is not None and report.complete
    return report


def test_a_consumer_that_sleeps_50ms_per_batch_is_reported_consumer_limited(era5: Path) -> None:
    pipe, _ = _pipe(counting_store(era5))
    with pipe:
        report = _epoch(pipe, sleep=0.05)
    assert report.limiting == "consumer", str(report)
    assert report.wait_fraction < CONSUMER_WAIT_FRACTION
    assert report.consumer_s >= 0.05 * report.batches
    assert report.suggestion == ""


def test_a_store_answering_after_100ms_is_reported_store_limited(era5: Path) -> None:
    pipe, _ = _pipe(counting_store(era5, delay=0.1))
    with pipe:
        report = _epoch(pipe)
    assert report.limiting == "store", str(report)
    assert report.wait_fraction > 0.5
    assert report.get_active_s > 0.5 * report.wall_s
    assert report.inflight_mean > report.decode_depth_mean
    assert report.get_s >= 0.1 * report.gets  # every GET took at least the delay


def test_a_store_limited_epoch_with_max_inflight_saturated_suggests_raising_it(
    era5: Path,
) -> None:
    pipe, _ = _pipe(counting_store(era5, delay=0.1), max_inflight=2)
    with pipe:
        report = _epoch(pipe)
    assert report.limiting == "store", str(report)
    assert report.inflight_peak == 2
    assert "max_inflight=4" in report.suggestion, report.suggestion


def test_a_store_limited_epoch_below_max_inflight_suggests_a_larger_read_ahead(
    era5: Path,
) -> None:
    pipe, _ = _pipe(counting_store(era5, delay=0.1), max_inflight=64, block_chunks=2)
    with pipe:
        report = _epoch(pipe)
    assert report.limiting == "store", str(report)
    assert report.inflight_peak < 64
    assert "block_chunks" in report.suggestion, report.suggestion


def test_one_decode_thread_on_a_bzip2_store_is_reported_decode_limited(bz2_store: Path) -> None:
    store = counting_store(bz2_store)
    v = open_geometries(store, ["v"])["v"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, {"x": v}, batch_size=16, decode_threads=1)
    with pipe:
        report = _epoch(pipe)
    assert report.limiting == "decode", str(report)
    assert report.decode_threads == 1
    assert report.decode_depth_mean > report.inflight_mean
    if report.cores > 1:
        assert f"decode_threads={report.cores}" in report.suggestion, report.suggestion


def test_samples_and_bytes_add_up_against_the_store_and_the_files_on_disk(era5: Path) -> None:
    store = counting_store(era5)
    # no coordinate: the store's counts are the epoch's chunk reads
    pipe, t2m = _pipe(store, cache_budget_bytes=t2m_split_bytes(era5), coords=())
    delivered_samples = delivered_bytes = 0
    gets_before = store.chunk_gets
    with pipe:
        for batch in Loader(pipe):
            delivered_samples += len(batch)
            delivered_bytes += sum(a.nbytes for a in batch.arrays.values())
        first = pipe.report()
        counts = store.chunk_counts()
        gets_first = store.chunk_gets - gets_before
        store.reset_counts()
        second = _epoch(pipe)
    assert first is not None
    assert first.batches == len(pipe)
    assert first.samples == delivered_samples == N_TIME
    assert first.bytes_delivered == delivered_bytes == N_TIME * t2m.sample_nbytes
    assert first.gets == gets_first == sum(counts.values()) == N_TIME // SPC
    assert first.bytes_fetched == sum((era5 / key).stat().st_size for key in counts)
    assert (first.misses, first.hits, first.re_reads) == (N_TIME // SPC, 0, 0)
    # the whole split is resident: the second epoch is all hits and reads nothing
    assert store.chunk_counts() == {}
    assert (second.gets, second.bytes_fetched, second.misses) == (0, 0, 0)
    assert second.hits == N_TIME // SPC
    assert second.samples == N_TIME


def test_the_consumers_time_and_its_wait_for_batches_add_up_to_the_wall_time(era5: Path) -> None:
    for delay, sleep in ((0.0, 0.02), (0.05, 0.0)):
        pipe, _ = _pipe(counting_store(era5, delay=delay))
        with pipe:
            report = _epoch(pipe, sleep=sleep)
        assert report.handoff_wait_s + report.consumer_s <= report.wall_s
        assert report.handoff_wait_s + report.consumer_s >= 0.95 * report.wall_s - 0.005
        assert 0.0 <= report.wait_fraction <= 1.0


def t2m_split_bytes(root: Path) -> int:
    t2m = open_geometries(counting_store(root), ["t2m"])["t2m"]
    return t2m.n_chunks * t2m.chunk_nbytes


def test_re_reads_suggest_the_budget_that_holds_the_split_and_that_budget_removes_them(
    era5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import insitubatch_nodes.plan.schedule as schedule_module

    # a split past the automatic cap (a sixteenth of RAM: a smaller one is kept whole)
    monkeypatch.setattr(schedule_module, "_auto_keep_bytes", lambda: 0)
    pipe, t2m = _pipe(counting_store(era5, delay=0.05))  # automatic budget: one epoch's floor
    with pipe:
        _epoch(pipe)
        second = _epoch(pipe)
    split_bytes = t2m.n_chunks * t2m.chunk_nbytes
    assert second.re_reads > 0, str(second)
    assert second.re_reads == second.misses  # every chunk was fetched in epoch 0
    assert second.split_bytes == split_bytes
    assert second.limiting == "store", str(second)
    assert f"cache_budget_bytes={split_bytes}" in second.suggestion, second.suggestion
    # following the suggestion turns the re-reads into hits
    pipe, _ = _pipe(counting_store(era5), cache_budget_bytes=split_bytes)
    with pipe:
        _epoch(pipe)
        again = _epoch(pipe)
    assert (again.misses, again.re_reads, again.hits) == (0, 0, t2m.n_chunks)


def test_the_report_follows_delivered_batches_not_the_read_ahead(era5: Path) -> None:
    pipe, _ = _pipe(counting_store(era5), prefetch_depth=4)
    with pipe:
        assert pipe.report() is None
        it = iter(Loader(pipe))
        for _ in range(3):
            next(it)
        time.sleep(0.2)  # the producer runs ahead meanwhile
        current = pipe.report()
        assert current is not None and not current.complete
        assert (current.batches, current.samples) == (3, 3 * 16)
        rest = sum(1 for _ in it)
        done = pipe.report()
        assert done is not None and done.complete
        assert done.batches == 3 + rest == len(pipe)
        pipe.reset()  # nothing consumed yet: the finished epoch is still the report
        assert pipe.report() is done


@pytest.mark.parametrize("trace", [False, True])
def test_an_epoch_ended_by_a_reset_counts_its_work_up_to_its_last_batch(
    era5: Path, trace: bool
) -> None:
    # broken off after 2 batches while a block of read-ahead went on: the report ends at the
    # last batch delivered, so its producer numbers must too (they ran on to the reset: 190%
    # of the wall with a GET in flight, a mean of 51 in flight against a peak of 32)
    store = counting_store(era5, delay=0.01)
    pipe, _ = _pipe(store, batch_size=4, block_chunks=8, fetch=FetchOptions(trace=trace))
    with pipe:
        for i, _batch in enumerate(pipe):
            if i == 1:
                break
        mid = pipe.report()  # the epoch so far, just after its last batch
        assert mid is not None and not mid.complete
        # the read-ahead goes on after it
        assert wait_until(lambda: sum(store.chunk_counts().values()) > mid.gets + 4)
        pipe.reset()
        report = pipe.report()
    assert report is not None and report.complete and report.batches == 2
    assert report.gets <= mid.gets and report.decodes <= mid.decodes, (report.gets, mid.gets)
    assert report.get_active_s <= report.wall_s + 1e-6
    assert report.inflight_mean <= report.inflight_peak
    assert report.chunk_wait_s + report.gather_s + report.admit_s <= report.wall_s + 1e-6
    if trace:
        assert report.trace is not None
        counts = report.trace.counts()
        assert counts.get("GET", 0) == report.gets and counts.get("decode", 0) == report.decodes
        assert max(end for _, _, end, _, _ in report.trace.spans) <= report.trace.t1 + 1e-6


def test_a_pipeline_built_with_report_false_measures_nothing(era5: Path) -> None:
    pipe, _ = _pipe(counting_store(era5), report=False)
    with pipe:
        for _ in Loader(pipe):
            pass
        assert pipe.report() is None
        stages = pipe.stages
        recorders = {stages.fetch.recorder, stages.resident.recorder, stages.gather.recorder}
        assert recorders == {NULL_RECORDER} and pipe.recorder is NULL_RECORDER


def test_each_finished_epoch_logs_one_info_line_and_prints_nothing(
    era5: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    pipe, _ = _pipe(counting_store(era5))
    with caplog.at_level(logging.INFO, logger="insitubatch_nodes"), pipe:
        for _ in range(2):
            _epoch(pipe)
    lines = [r for r in caplog.records if r.name == "insitubatch_nodes.report"]
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    assert "epoch 0: 16 batches" in lines[0].getMessage()
    assert "epoch 1: 16 batches" in lines[1].getMessage()
    assert capsys.readouterr() == ("", "")


def test_print_renders_the_headline_and_one_aligned_line_per_stage(era5: Path) -> None:
    pipe, _ = _pipe(counting_store(era5, delay=0.05), max_inflight=2)
    with pipe:
        report = _epoch(pipe)
    lines = str(report).splitlines()
    assert lines[0] == report.headline()
    assert lines[0].endswith(f"limited by {report.limiting}")
    stages = ["consumer", "store", "decode", "producer", "pool", "delivered"]
    assert [line[:12] for line in lines[1:-1]] == [f"  {s:<10}" for s in stages]
    assert lines[-1] == f"  suggestion: {report.suggestion}"
    d = report.as_dict()
    assert d["limiting"] == "store" and d["gets"] == report.gets
    assert isinstance(d["wall_s"], float)


# -- the rule on its own ---------------------------------------------------------------------


def _made(**kw: float) -> EpochReport:
    base: dict[str, float] = {
        "batches": 10, "samples": 100, "wall_s": 1.0, "first_batch_s": 0.1,
        "handoff_wait_s": 0.6, "first_wait_s": 0.1, "max_inflight": 8, "decode_threads": 2,
        "cores": 4,
    }  # fmt: skip
    base.update(kw)
    return EpochReport(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("numbers", "stage"),
    [
        ({"handoff_wait_s": 0.12}, "consumer"),  # waited 2% of the steady-state wall
        ({"gather_s": 0.5, "chunk_wait_s": 0.2}, "gather"),
        ({"chunk_wait_s": 0.5, "gather_s": 0.1, "inflight_mean": 6.0}, "store"),
        # the decode threads busy 90% of the time, decoding
        (
            {"chunk_wait_s": 0.5, "decode_depth_mean": 7.0, "inflight_mean": 1.0, "decode_s": 1.8},
            "decode",
        ),
        # work queued while the decode threads sat idle: something else held the interpreter
        ({"chunk_wait_s": 0.5, "decode_depth_mean": 7.0, "inflight_mean": 1.0}, "engine"),
        # the threads were busy, but mostly with bookkeeping rather than decoding
        (
            {
                "chunk_wait_s": 0.5,
                "decode_depth_mean": 7.0,
                "inflight_mean": 1.0,
                "decode_s": 0.5,
                "run_s": 1.9,
            },
            "engine",
        ),
        # the producer thread spent longer admitting batches than waiting for their chunks
        ({"admit_s": 0.4, "gather_s": 0.05, "chunk_wait_s": 0.3}, "engine"),
    ],
    ids=["consumer", "gather", "store", "decode", "engine-idle", "engine-runs", "engine-admit"],
)
def test_the_limiting_rule_names_each_stage_from_the_reported_numbers(
    numbers: dict[str, float], stage: str
) -> None:
    assert limiting_stage(_made(**numbers)) == stage


def test_an_engine_limited_report_says_whether_other_processes_or_its_own_work_hold_the_cpu() -> (
    None
):
    starved = _made(chunk_wait_s=0.5, decode_depth_mean=7.0, inflight_mean=1.0, cpu_s=0.3)
    starved.limiting = limiting_stage(starved)
    assert starved.limiting == "engine"
    assert "other processes hold the CPU" in suggestion_for(starved)
    busy = _made(
        chunk_wait_s=0.5, decode_depth_mean=7.0, inflight_mean=1.0, decode_s=0.5, run_s=1.9,
        cpu_s=3.8, decodes=1000,
    )  # fmt: skip
    busy.limiting = limiting_stage(busy)
    assert busy.limiting == "engine"
    text = suggestion_for(busy)
    assert "per stored object" in text and "more samples per chunk" in text, text
    assert "max_inflight" not in text and "decode_threads=" not in text


def test_a_decode_limited_report_with_every_core_busy_suggests_more_cores_not_threads() -> None:
    r = _made(chunk_wait_s=0.5, decode_depth_mean=7.0, decode_threads=4, decode_s=3.6)
    r.limiting = limiting_stage(r)
    assert r.limiting == "decode"
    assert "more cores" in suggestion_for(r) and "decode_threads=" not in suggestion_for(r)


def test_an_epoch_that_waited_on_page_faults_is_told_so_with_its_kernel_time() -> None:
    # a fresh process's first epoch through a large pool: 2 of 4 s in the kernel, 2.3 GiB of
    # fresh pages; its chunks looked late, so the rule says store
    faulted = _made(wall_s=4.0, chunk_wait_s=2.5, inflight_mean=6.0, sys_s=2.0, page_faults=600_000)
    faulted.limiting = limiting_stage(faulted)
    assert faulted.limiting == "store"
    text = suggestion_for(faulted)
    assert "600,000 page faults" in text and "faulted in" in text and "2.00 s" in text, text
    assert memory_bound(faulted)
    # the same epoch with its memory already touched: the store's suggestion instead
    warm = dataclasses.replace(faulted, sys_s=0.1, page_faults=2_000)
    assert not memory_bound(warm) and "faulted in" not in suggestion_for(warm)
    # kernel time without fresh memory (a disk's reads, say) is not page faulting
    assert not memory_bound(dataclasses.replace(faulted, page_faults=2_000))
    # a consumer-limited epoch is told nothing about the pipeline's memory
    slow_consumer = dataclasses.replace(faulted, limiting="consumer")
    assert "faulted in" not in suggestion_for(slow_consumer)


def test_the_slot_memory_the_pool_made_is_counted_in_the_epoch_that_made_it(era5: Path) -> None:
    # a local folder: slots are made on demand by the epoch's decodes (no reserve at the build)
    pipe, _ = _pipe(zarr.storage.LocalStore(era5, read_only=True), coords=(),
                    cache_budget_bytes=t2m_split_bytes(era5))  # fmt: skip
    with pipe:
        first, second = _epoch(pipe), _epoch(pipe)
    assert first.slots_made_bytes == first.resident_peak_bytes == t2m_split_bytes(era5)
    assert second.slots_made_bytes == 0 and second.hits == N_TIME // SPC


def test_fresh_memory_that_is_not_the_pools_slots_is_not_blamed_on_the_budget() -> None:
    # one sample per chunk, rows decoded straight into batches: the pool made nothing, the
    # 2.3 GiB are batch buffers, which a smaller budget would not touch less of
    faulted = _made(wall_s=4.0, chunk_wait_s=2.5, inflight_mean=6.0, sys_s=2.0, page_faults=600_000)
    faulted.limiting = limiting_stage(faulted)
    buffers = suggestion_for(faulted)
    assert "faulted in" in buffers and "batch buffers" in buffers, buffers
    assert "a smaller budget would not" in buffers and "working set" not in buffers
    # the same epoch whose pool made 2 GiB of slots: the budget is what touched it
    slots = suggestion_for(dataclasses.replace(faulted, slots_made_bytes=2 << 30))
    assert "faulted in" in slots and "2.0 GiB) is the pool's slots" in slots, slots
    assert "near the working set" in slots and "batch buffers" not in slots


def test_page_faults_of_the_consumers_own_work_are_not_named_as_the_pipelines() -> None:
    # a store-limited epoch whose training step touched 2.2 GiB of fresh memory: the process's
    # kernel time and faults are the consumer's, not what the pipeline waited on
    r = _made(
        wall_s=4.0, chunk_wait_s=2.5, inflight_mean=6.0, sys_s=2.0, page_faults=600_000,
        consumer_sys_s=1.9, consumer_page_faults=590_000,
    )  # fmt: skip
    r.limiting = limiting_stage(r)
    assert r.limiting == "store" and not memory_bound(r)
    assert "faulted in" not in suggestion_for(r) and "max_inflight" in suggestion_for(r)
    # the pipeline's own share still counts when it is large
    assert memory_bound(dataclasses.replace(r, consumer_sys_s=0.2, consumer_page_faults=9_000))


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="per-thread usage is Linux's")
def test_the_consumers_own_page_faults_are_measured_apart_and_not_told_as_the_pipelines(
    era5: Path,
) -> None:
    pages = 16 * 2**20 // mmap.PAGESIZE  # each step touches 16 MiB of fresh memory
    pipe, _ = _pipe(counting_store(era5, delay=0.05), max_inflight=2)
    with pipe:
        for _ in Loader(pipe):
            fresh = mmap.mmap(-1, pages * mmap.PAGESIZE)
            np.frombuffer(fresh, dtype=np.uint8)[:: mmap.PAGESIZE] = 1
            fresh.close()
        report = pipe.report()
    assert report is not None and report.complete
    touched = pages * report.batches
    assert touched <= report.consumer_page_faults <= report.page_faults, report.as_dict()
    assert 0 <= report.consumer_sys_s <= report.sys_s + 0.05
    assert report.page_faults - report.consumer_page_faults < touched // 4  # the pipeline's
    assert not memory_bound(report) and "faulted in" not in report.suggestion
    # nor would it be told were the epoch store-limited (a consumer-limited epoch is told
    # nothing about memory; which one this epoch is depends on the machine's load: under load
    # 10 the consumer's faulting outlasts the store's 50 ms GETs)
    assert "faulted in" not in suggestion_for(dataclasses.replace(report, limiting="store"))


def test_the_report_counts_the_page_faults_and_kernel_time_of_its_epoch(era5: Path) -> None:
    pipe, _ = _pipe(counting_store(era5))
    with pipe:
        first = _epoch(pipe)
    assert first.page_faults > 0 and 0 <= first.sys_s <= first.cpu_s + 0.05
    assert f"{first.page_faults:,} page faults" in str(first)


def test_the_demo_prints_the_report_after_each_epoch(
    era5: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from insitubatch_nodes import demo

    demo.main(["--url", str(era5), "--epochs", "2", "--no-progress", "--batch-size", "16"])
    out = capsys.readouterr().out
    for epoch in range(2):
        assert f"\nepoch {epoch}: 13 batches, 207 samples in " in out, out
    assert out.count("  store     ") == 2 and out.count(" - limited by ") == 2, out


@pytest.mark.slow  # a real Trainer: about 15 s
def test_the_lightning_datamodule_logs_each_training_epochs_report_through_self_log(
    era5: Path, tmp_path: Path
) -> None:
    import csv

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from insitubatch_nodes.lightning import InSituDataModule

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16 * 32, 16 * 32)

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            x = (batch["t2m"].flatten(1) - 270.0) / 30.0
            return torch.nn.functional.mse_loss(self.layer(x), x)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    config = PlanConfig(batch_size=16, block_chunks=4)
    dm = InSituDataModule(era5, ["t2m"], (0.75, 0.125, 0.125), config=config)
    # the reports the callback logged, as they were when it logged them (a report asked for
    # after fit has seen more wall time, and may name another limiting stage)
    logged_reports: list[EpochReport] = []
    real_train_report = dm.train_report

    def spy() -> EpochReport | None:
        report = real_train_report()
        if report is not None:
            logged_reports.append(dataclasses.replace(report))  # a copy, as it was
        return report

    dm.train_report = spy  # type: ignore[method-assign]
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=CSVLogger(tmp_path, name="run"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Model(), datamodule=dm)
    report = logged_reports[-1]
    assert report.epoch == 1
    with open(next(tmp_path.rglob("metrics.csv"))) as fh:
        rows = list(csv.DictReader(fh))
    logged = [r for r in rows if r.get("insitu/samples_per_s")]
    assert [int(r["epoch"]) for r in logged] == [0, 1]
    last = logged[-1]
    assert float(last["insitu/samples_per_s"]) > 0
    assert float(last["insitu/hits"]) + float(last["insitu/misses"]) == report.hits + report.misses
    assert sum(float(last[f"insitu/limited_by_{s}"]) for s in STAGES) == 1.0
    assert float(last[f"insitu/limited_by_{report.limiting}"]) == 1.0


def test_a_gather_limited_report_names_the_cpu_when_decode_threads_fill_every_core() -> None:
    shared = _made(gather_s=0.5, chunk_wait_s=0.2, decode_threads=4, decode_s=3.0)
    shared.limiting = limiting_stage(shared)
    assert shared.limiting == "gather"
    assert "CPU is the limit" in suggestion_for(shared)
    idle_decode = _made(gather_s=0.5, chunk_wait_s=0.2, decode_threads=4, decode_s=0.1)
    idle_decode.limiting = limiting_stage(idle_decode)
    assert suggestion_for(idle_decode) == ""
    with_transforms = _made(gather_s=0.5, chunk_wait_s=0.2, batch_transforms=1)
    with_transforms.limiting = limiting_stage(with_transforms)
    assert "move them to the consumer" in suggestion_for(with_transforms)


def test_a_store_limited_epoch_on_local_disk_does_not_suggest_max_inflight() -> None:
    # the reads of a local store run on the decode threads: max_inflight changes nothing there
    r = _made(
        chunk_wait_s=0.5, inflight_mean=2.0, get_s=2.0, local_read_s=2.0, gets=1000,
        inflight_peak=2, max_inflight=32,
    )  # fmt: skip
    r.limiting = limiting_stage(r)
    assert r.limiting == "store"
    text = suggestion_for(r)
    assert "max_inflight=" not in text and "block_chunks" not in text, text
    assert "decode_threads=4" in text and "disk" in text, text


def test_as_dict_carries_the_derived_numbers_a_logger_or_a_benchmark_wants() -> None:
    r = _made(decode_s=1.0, run_s=1.5, admit_s=0.2, decodes=10)
    d = r.as_dict()
    assert d["engine_s"] == r.engine_s == pytest.approx(0.2 + 0.5)
    assert d["decode_busy"] == r.decode_busy and d["samples_per_s"] == r.samples_per_s
    assert json.loads(json.dumps(d)) == d  # plain Python


def test_stats_count_rows_decoded_straight_into_batches_so_misses_add_up_to_the_report(
    tmp_path: Path,
) -> None:
    """One-sample chunks are decoded straight into the batch, never into a pool slot: the pool
    counted none of them, so stats() said 0 misses while the report said every chunk. They are
    stats()["misses_in_place"], and the two counters add up to the report's misses."""
    root = write_era5(tmp_path / "one.zarr", n_time=48, samples_per_chunk=1)
    t2m = open_geometries(root, ["t2m"])["t2m"]
    # one sample short of the split: the schedule does not keep it, rows go straight in
    budget = 47 * t2m.sample_nbytes
    pipe, _ = _pipe(counting_store(root), batch_size=8, block_chunks=8, cache_budget_bytes=budget)
    try:
        report = _epoch(pipe)
        stats = pipe.stats()
    finally:
        pipe.close()
    assert report.misses == 48  # every chunk read once, from the store
    assert stats["misses"] == 0 and stats["misses_in_place"] == 48  # no pool slot was used
    assert stats["misses"] + stats["misses_in_place"] == report.misses
    assert stats["hits"] == report.hits


def _lightning_fit(era5: Path, tmp_path: Path, distributed: bool) -> tuple[Any, list[str]]:
    import warnings

    import lightning.pytorch as pl
    import torch

    from insitubatch_nodes.lightning import InSituDataModule

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16 * 32, 16 * 32)

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            x = (batch["t2m"].flatten(1) - 270.0) / 30.0
            return torch.nn.functional.mse_loss(self.layer(x), x)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    dm = InSituDataModule(
        era5, ["t2m"], (0.75, 0.125, 0.125), config=PlanConfig(batch_size=16, block_chunks=4)
    )
    options: dict[str, Any] = {}
    if distributed:  # DDP with one CPU rank (gloo): Lightning's "distributed setting"
        import os

        from lightning.pytorch.strategies import DDPStrategy

        from insitubatch_nodes.testing import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        options = {"strategy": DDPStrategy(process_group_backend="gloo"), "devices": 1}
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        num_sanity_val_steps=0, default_root_dir=tmp_path, **options,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(Model(), datamodule=dm)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return dm, [str(w.message) for w in caught]


def test_after_lightning_fit_the_report_is_the_finished_last_epoch(
    era5: Path, tmp_path: Path
) -> None:
    dm, _ = _lightning_fit(era5, tmp_path, distributed=False)
    report = dm.train_report()
    assert report is not None and report.complete and report.epoch == 1
    assert "(in progress)" not in str(report)
    dm.teardown("fit")


def test_the_report_callback_logs_without_sync_dist_warnings_in_a_distributed_setting(
    era5: Path, tmp_path: Path
) -> None:
    dm, messages = _lightning_fit(era5, tmp_path, distributed=True)
    assert not [m for m in messages if "sync_dist" in m], messages
    dm.teardown("fit")


def test_the_report_prints_the_anchors_dropped_for_missing_steps_per_reason(era5: Path) -> None:
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {"x": t2m, "y": t2m.shift(1)}
    # listed steps 10 and 100: anchors 9, 10, 99 and 100 read one (hand-counted)
    with insitu_pipeline(era5, manifest, views, batch_size=16, missing=[10, 100]) as pipe:
        report = _epoch(pipe)
    assert report.dropped.get("missing") == 4 and sum(report.dropped.values()) == 4
    assert report.as_dict()["dropped"] == report.dropped
    lines = str(report).splitlines()
    want = (
        "  dropped   4 anchors of the split read a missing step and are never sampled (4 missing)"
    )
    assert want in lines, lines
    assert report.samples == N_TIME - 1 - 4
    with insitu_pipeline(era5, manifest, views, batch_size=16) as plain:
        quiet = _epoch(plain)
    assert quiet.dropped == {} and not any("dropped" in line for line in str(quiet).splitlines())
