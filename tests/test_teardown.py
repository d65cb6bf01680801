"""Teardown: leaving a loop, closing, deleting, resetting and failing leave nothing behind.

"Nothing behind" means: no thread named after the pipeline is alive (``pipe.threads == []``),
no pool slot is pinned (``pipe.stages.pool.pinned_count() == 0``) and the fetch stage holds no
pin (``pipe.stages.fetch.pinned == 0``). The process-wide IO loop (zarr's ``zarr_io`` thread)
and other pipelines keep running.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import (
    PROMPT_S,
    Oracle,
    View,
    assert_batch_matches,
    assert_same_records,
    counting_store,
    expected_anchors,
    expected_chunk_keys,
    lengthen_stop_graces,
    run_epoch,
    wait_until,
    write_era5,
)
from torchdata.nodes import Loader

from insitubatch_nodes import (
    ArrayGeometry,
    SplitManifest,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError, PipelineInterrupted

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("teardown")]


@dataclass
class Store:
    root: Path
    views: dict[str, ArrayGeometry]
    oracle_views: dict[str, View]
    manifest: SplitManifest


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A v3 ERA5-like store with tiled fields (several GETs per chunk): x = t2m, y = its next
    step, z = the 4-D geopotential."""
    root = tmp_path_factory.mktemp("teardown") / "store.zarr"
    write_era5(root, n_time=128, n_lat=8, n_lon=16, inner_chunks=(4, 8))
    g = open_geometries(root, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    oviews = {"x": View("t2m"), "y": View("t2m", 0, 1), "z": View("z")}
    return Store(root, views, oviews, split_by_chunk(g["t2m"]))


def make(era5: Store, store: Any = None, **kwargs: Any) -> Any:
    kwargs = {"batch_size": 8, "block_chunks": 3, "seed": 5, **kwargs}
    return insitu_pipeline(store or era5.root, era5.manifest, era5.views, **kwargs)


def assert_torn_down(pipe: Any) -> None:
    assert pipe.threads == [], f"threads still alive: {pipe.threads}"
    assert not [t for t in threading.enumerate() if t.name == pipe.name]
    assert pipe.stages.pool.pinned_count() == 0, "a pool slot is still pinned"
    assert pipe.stages.fetch.pinned == 0, "the fetch stage still holds pins"


def io_thread() -> threading.Thread:
    found = [t for t in threading.enumerate() if t.name == "zarr_io"]
    assert len(found) == 1, [t.name for t in threading.enumerate()]
    return found[0]


@pytest.fixture(scope="module")
def reference(era5: Store) -> list[dict[str, Any]]:
    """One uninterrupted epoch (epoch 0), values kept."""
    return run_epoch(make(era5), keep_arrays=True)


# ---------------------------------------------------------------------------------------------
# Leaving early
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["fast_store", "slow_store"])
def test_breaking_out_of_a_for_loop_keeps_the_position_and_close_then_releases_everything(
    era5: Store, reference: list[dict[str, Any]], delay: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengthen_stop_graces(monkeypatch.setattr)  # a close that waits the thread out is slow
    store = counting_store(era5.root, delay=delay)
    pipe = make(era5, store)
    for seen, _ in enumerate(pipe, start=1):
        if seen == 2:
            break
    assert len(pipe.threads) == 1  # BaseNode's contract: leaving a loop tears nothing down
    assert next(pipe).index == 2  # the same epoch continues at the next batch
    t0 = time.monotonic()
    pipe.close()
    assert time.monotonic() - t0 < PROMPT_S
    assert_torn_down(pipe)
    assert wait_until(lambda: store.active == 0), "GETs still running after close()"


def test_closing_a_pipeline_iterated_through_a_loader_stops_the_thread_and_unpins(
    era5: Store,
) -> None:
    pipe = make(era5, counting_store(era5.root, delay=0.02))
    it = iter(Loader(pipe))
    next(it)
    next(it)
    assert len(pipe.threads) == 1
    pipe.close()
    assert_torn_down(pipe)


def test_deleting_a_pipeline_stops_its_thread_and_releases_its_slots(era5: Store) -> None:
    pipe = make(era5, counting_store(era5.root, delay=0.02))
    next(pipe)
    name, pool, fetch = pipe.name, pipe.stages.pool, pipe.stages.fetch
    assert [t for t in threading.enumerate() if t.name == name]
    del pipe
    gc.collect()
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == name])
    assert wait_until(lambda: pool.pinned_count() == 0 and fetch.pinned == 0)


def test_a_with_block_closes_the_pipeline(era5: Store) -> None:
    with make(era5) as pipe:
        next(pipe)
        next(pipe)
    assert_torn_down(pipe)


def test_closing_twice_or_before_starting_is_harmless(era5: Store) -> None:
    pipe = make(era5)
    pipe.close()
    pipe.close()
    assert_torn_down(pipe)
    assert len(run_epoch(pipe, Oracle(era5.root), era5.oracle_views)) == len(pipe)
    pipe.close()
    pipe.close()
    assert_torn_down(pipe)


def test_a_finished_epoch_leaves_no_thread_and_no_pinned_slot(era5: Store) -> None:
    pipe = make(era5)
    run_epoch(pipe)
    assert_torn_down(pipe)
    pipe.reset()
    run_epoch(pipe)
    assert_torn_down(pipe)


@pytest.mark.parametrize("delay", [0.0, 0.03], ids=["fast_store", "slow_store"])
def test_reset_in_the_middle_of_an_epoch_starts_a_clean_next_epoch(
    era5: Store, delay: float
) -> None:
    pipe = make(era5, counting_store(era5.root, delay=delay))
    next(pipe)
    next(pipe)
    pipe.reset()
    records = run_epoch(pipe, Oracle(era5.root), era5.oracle_views)
    assert {r["epoch"] for r in records} == {1}
    got = np.sort(np.concatenate([r["sample_indices"]["x"] for r in records]))
    np.testing.assert_array_equal(got, expected_anchors(era5.manifest, "train", [0, 1, 0]))
    assert_torn_down(pipe)


def test_close_with_gets_in_flight_returns_promptly_and_unpins(
    era5: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengthen_stop_graces(monkeypatch.setattr)  # a close that waits the thread out is slow
    store = counting_store(era5.root, delay=0.3)
    pipe = make(era5, store, max_inflight=4)
    next(pipe)
    assert wait_until(lambda: store.active > 0, timeout=5), "nothing was in flight"
    t0 = time.monotonic()
    pipe.close()
    took = time.monotonic() - t0
    assert took < PROMPT_S, f"close() took {took:.1f} s"
    assert_torn_down(pipe)
    assert wait_until(lambda: store.active == 0, timeout=PROMPT_S)


# ---------------------------------------------------------------------------------------------
# Resuming after close
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "break"])  # "break": leave a for loop, then close
@pytest.mark.parametrize("k", [1, 3, "mid", "last"])
def test_after_close_iteration_resumes_at_the_next_undelivered_batch(
    era5: Store, reference: list[dict[str, Any]], how: str, k: Any
) -> None:
    n = len(reference)
    taken = {"mid": n // 2, "last": n - 1}.get(k, k)
    pipe = make(era5, counting_store(era5.root, delay=0.002))
    first: list[dict[str, Any]] = []
    if how == "close":
        first = run_epoch(next(pipe) for _ in range(taken))
        pipe.close()
    else:
        for batch in pipe:
            first += run_epoch([batch])
            if len(first) == taken:
                break
        pipe.close()
    assert_torn_down(pipe)
    rest = run_epoch(pipe, Oracle(era5.root), era5.oracle_views, keep_arrays=True)
    assert_same_records(first, reference[:taken])
    assert_same_records(rest, reference[taken:])
    assert_torn_down(pipe)


def closed_with_fills_held(era5: Store) -> tuple[Any, list[dict[str, Any]], threading.Event]:
    """``(pipe, first, gate)``: a pipeline closed after its first 3 batches (``first``) while
    the fills of its read-ahead stay inside a chunk transform until ``gate`` is set. Such
    fills cannot be stopped: until they end they hold their slots, more than half the
    budget."""
    gate = threading.Event()
    gate.set()

    def held(chunk: Any) -> Any:
        gate.wait()
        return chunk

    pipe = make(era5, chunk_transforms=[held])
    pool = pipe.stages.pool
    first = run_epoch(next(pipe) for _ in range(3))
    gate.clear()  # the fills running or started from now on stay inside the transform
    seen, stable_since = -1, time.monotonic()
    while time.monotonic() - stable_since < 0.3:  # until the read-ahead stops admitting
        if pool.stats.resident_bytes != seen:
            seen, stable_since = pool.stats.resident_bytes, time.monotonic()
        time.sleep(0.01)
    assert seen > pool.budget_bytes // 2, (seen, pool.budget_bytes)
    pipe.close()
    return pipe, first, gate


@pytest.mark.timeout(60)
def test_iterating_after_close_waits_for_the_closed_runs_fills_instead_of_calling_it_a_bug(
    era5: Store, reference: list[dict[str, Any]]
) -> None:
    # the resumed run's first batch must wait for the closed run's fills (before: "the chunk
    # pool has no room ... this is a bug", whenever they held enough of the budget)
    pipe, first, gate = closed_with_fills_held(era5)
    threading.Timer(0.3, gate.set).start()  # they end a moment after the next batch is asked
    rest = run_epoch(pipe, Oracle(era5.root), era5.oracle_views, keep_arrays=True)
    assert_same_records(first, reference[:3])
    assert_same_records(rest, reference[3:])
    assert_torn_down(pipe)


@pytest.mark.timeout(60)
def test_a_close_ends_the_wait_for_a_closed_runs_fills_and_the_epoch_still_resumes_exactly(
    era5: Store, reference: list[dict[str, Any]]
) -> None:
    pipe, first, gate = closed_with_fills_held(era5)
    closer = threading.Timer(0.3, pipe.close)  # while the producer waits for those fills
    closer.start()
    started = time.monotonic()
    # the message says who interrupts, and what to do about a second loop (before: nothing)
    with pytest.raises(PipelineInterrupted, match=r"closed or reset while next.*one loop at a"):
        next(pipe)
    closer.join()  # (the close joins the producer: it stopped, woken by the interrupt)
    assert time.monotonic() - started < 10  # not after the fills, which never end meanwhile
    assert_torn_down(pipe)
    gate.set()
    rest = run_epoch(pipe, Oracle(era5.root), era5.oracle_views, keep_arrays=True)
    assert_same_records(first, reference[:3])
    assert_same_records(rest, reference[3:])
    assert_torn_down(pipe)


@pytest.mark.parametrize("k", [1, 2, 4, "mid", "last"])
def test_resuming_after_close_works_at_the_budget_floor(era5: Store, k: Any) -> None:
    with pytest.raises(ValueError, match="floor") as info:
        make(era5, cache_budget_bytes=1)
    found = re.search(r"floor of ([\d,]+) bytes", str(info.value))
    assert found
    floor = int(found.group(1).replace(",", ""))
    reference = run_epoch(make(era5, cache_budget_bytes=floor), keep_arrays=True)
    n = len(reference)
    taken = {"mid": n // 2, "last": n - 1}.get(k, k)
    pipe = make(era5, cache_budget_bytes=floor)
    for _ in range(taken):
        next(pipe)
    pipe.close()
    rest = run_epoch(pipe, Oracle(era5.root), era5.oracle_views, keep_arrays=True)
    assert_same_records(rest, reference[taken:])
    assert pipe.stats()["resident_peak_bytes"] <= floor


# ---------------------------------------------------------------------------------------------
# Shared resources and other pipelines
# ---------------------------------------------------------------------------------------------


def test_the_shared_zarr_io_loop_survives_a_closed_pipeline_and_zarr_reads_still_work(
    era5: Store,
) -> None:
    pipe = make(era5, counting_store(era5.root, delay=0.02))
    next(pipe)
    loop_thread = io_thread()
    pipe.close()
    del pipe
    gc.collect()
    assert io_thread() is loop_thread and loop_thread.is_alive()
    arr = zarr.open_group(era5.root, mode="r")["t2m"]
    assert arr[0:3].shape == (3, 8, 16)
    # and a new pipeline runs on the same loop
    fresh = make(era5)
    assert len(run_epoch(fresh, Oracle(era5.root), era5.oracle_views)) == len(fresh)
    assert io_thread() is loop_thread


@pytest.mark.parametrize("how", ["close", "break", "del", "error"])
def test_closing_one_pipeline_does_not_disturb_another_running_in_the_same_process(
    era5: Store, tmp_path: Path, how: str
) -> None:
    oracle = Oracle(era5.root)
    store_b = counting_store(era5.root, delay=0.01)
    b = make(era5, store_b, max_inflight=3, seed=9, coords=())  # counts: chunk reads only
    if how == "error":  # A fails on a corrupt chunk of its own copy of the store
        root_a = tmp_path / "copy.zarr"
        write_era5(root_a, n_time=128, n_lat=8, n_lon=16, inner_chunks=(4, 8))
        for path in (root_a / "t2m").rglob("c/*/0/0"):
            path.write_bytes(b"not zstd at all" * 8)
        a = insitu_pipeline(
            counting_store(root_a, delay=0.01), era5.manifest, era5.views, batch_size=8
        )
    else:
        a = make(era5, counting_store(era5.root, delay=0.01), max_inflight=3, seed=1)
    b_records = run_epoch([next(b), next(b)], oracle, era5.oracle_views)
    a_iter = iter(a)
    if how == "error":
        with pytest.raises(ChunkReadError):
            next(a_iter)
    else:
        next(a_iter)
        next(a_iter)
        if how == "close":
            a.close()
        elif how == "break":
            a_iter.close()  # what leaving a for loop does
        else:
            name = a.name
            del a, a_iter
            gc.collect()
            assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == name])
    if how != "del":
        assert_torn_down(a)
    assert len(b.threads) == 1
    b_records += run_epoch(b, oracle, era5.oracle_views)
    got = np.sort(np.concatenate([r["sample_indices"]["x"] for r in b_records]))
    np.testing.assert_array_equal(got, expected_anchors(era5.manifest, "train", [0, 1, 0]))
    # B still fetched every object it needed exactly once
    want = expected_chunk_keys(oracle, era5.oracle_views, b_records)
    assert store_b.chunk_counts() == dict.fromkeys(want, 1)
    assert_torn_down(b)


def test_a_pipeline_that_failed_can_be_reset_and_run_again(tmp_path: Path) -> None:
    root = tmp_path / "store.zarr"
    write_era5(root, n_time=64, variables=("t2m",))
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g)
    victim = root / "t2m" / "c" / str(manifest.chunks("train")[2]) / "0" / "0"
    good = victim.read_bytes()
    victim.write_bytes(b"\x01" * 64)
    pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=8)
    with pytest.raises(ChunkReadError):
        run_epoch(pipe)
    assert_torn_down(pipe)
    victim.write_bytes(good)  # repaired
    pipe.reset()
    oracle = Oracle(root)
    records = run_epoch(pipe, oracle, {"x": View("t2m")})
    for r in records:
        assert r["len"] > 0
    got = np.sort(np.concatenate([r["sample_indices"]["x"] for r in records]))
    np.testing.assert_array_equal(got, expected_anchors(manifest, "train", [0]))
    assert_torn_down(pipe)


def test_batches_delivered_before_a_close_stay_valid(era5: Store) -> None:
    oracle = Oracle(era5.root)
    pipe = make(era5)
    held = [next(pipe) for _ in range(3)]
    pipe.close()
    gc.collect()
    for batch in held:
        assert_batch_matches(batch, oracle, era5.oracle_views)
