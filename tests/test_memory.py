"""Memory paid for once and reused.

A fresh process pays for every new page on first write. Two places did that over and over:
the first epoch's slots (faulted in by the decodes that fill them) and every GET's bytes
(allocated by obstore through glibc ``malloc``, which maps and unmaps buffers of that size
each time). Over a remote store the pipeline now reserves the first epoch's slots ahead of need
on a thread of their own, with their pages mapped in bulk (a local folder's slots are made by
the decodes, without asking for huge pages: ``tests/test_pages.py``), and tunes ``malloc`` to
keep large buffers for reuse, in one arena shared by every thread (obstore's included). These
tests pin the behaviour (not the speed: that is ``benchmarks/``).

The allocator's claims are about a process: each runs in one of its own, forked from the
tests' fork server (``tests/forkserver.py``), which imports the package but never opens a store
nor starts a thread, so a forked process has glibc's one main arena and an untuned allocator,
as a fresh interpreter has, without importing torch again (2-3 s of CPU each). glibc reads
``MALLOC_ARENA_MAX`` only at a process's start, so when the tests' own environment sets it
they start fresh interpreters instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import forkserver
import numpy as np
import pytest
import zarr
from helpers import counting_store

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.lending import BufferPool
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.schedule import schedule_floors
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.slots import RamBacking

LINUX = sys.platform.startswith("linux")


def test_a_populated_slot_is_writable_zeroed_memory_of_the_asked_shape() -> None:
    slot = RamBacking().allocate_populated((3, 5, 7), np.dtype("f4"))
    assert slot.shape == (3, 5, 7) and slot.dtype == np.float32 and slot.flags.c_contiguous
    assert not slot.any()
    slot[...] = 2.0
    assert float(slot.sum()) == 2.0 * 3 * 5 * 7


def _wait_reserved(pool: ChunkPool, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while pool._reserver is not None and pool._reserver.is_alive():
        assert time.monotonic() < deadline, "the reserve did not finish"
        time.sleep(0.01)


def test_the_pool_reserves_slots_in_need_order_up_to_its_budget_and_no_further() -> None:
    shape_a, shape_b = ((4, 8), np.dtype("f8")), ((2, 8), np.dtype("f8"))  # 256 and 128 bytes
    pool = ChunkPool(budget_bytes=900)
    pool.reserve([shape_a, shape_b, shape_a, shape_a, shape_b, shape_b])  # the 2nd `b` won't fit
    _wait_reserved(pool)
    assert pool.allocated_bytes == 256 + 128 + 256 + 256 <= 900
    assert pool.stats.allocations == 4
    # acquisitions take the reserved slots: no allocation of their own
    for i in range(2):
        got = pool.acquire(("a", i), *shape_a)
        assert got is not None and got[1] is False
    assert pool.stats.allocations == 4


def test_allocation_on_demand_never_waits_for_the_reserve() -> None:
    # the reserve may be populating the budget's last slot when the pipeline asks for one:
    # the pipeline gets it, and the reserve's late buffer is dropped
    shape = ((64, 1024), np.dtype("f8"))  # 512 KiB
    nbytes = 64 * 1024 * 8
    for _ in range(20):
        pool = ChunkPool(budget_bytes=2 * nbytes)
        pool.reserve([shape] * 2)
        got = [pool.acquire(("a", i), *shape) for i in range(2)]
        assert all(g is not None for g in got)
        _wait_reserved(pool)
        assert pool.allocated_bytes <= 2 * nbytes


def _until_waiting(pool: BufferPool, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pool._made._waiters:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "take() did not wait for the reserve"
        time.sleep(0.001)


def test_a_batch_buffer_being_made_ahead_is_waited_for_not_allocated_again() -> None:
    # the buffer reserve was measured leaving one populated buffer unused per wb-c1 epoch
    # while takes faulted two others in page by page: a take now waits for the one on its way
    pool = BufferPool((4, 1024), np.dtype("f8"))
    pool.expect(2)
    first = pool.take()  # the first batch does not wait: its decode threads would idle
    assert pool.allocations == 1
    raw = RamBacking().allocate_populated((pool.nbytes,), np.dtype(np.uint8))
    got: list[np.ndarray] = []
    taker = threading.Thread(target=lambda: got.append(pool.take()))
    taker.start()
    _until_waiting(pool)
    pool.add_ready(raw)
    taker.join(20)
    (second,) = got
    assert pool.allocations == 2  # the first and the reserved one: nothing faulted twice
    assert np.shares_memory(second, raw) and not np.shares_memory(second, first)


def test_a_reserve_that_ends_early_lets_a_waiting_take_allocate() -> None:
    pool = BufferPool((4, 1024), np.dtype("f8"))
    pool.expect(3)
    first = pool.take()
    got: list[np.ndarray] = []
    taker = threading.Thread(target=lambda: got.append(pool.take()))
    taker.start()
    _until_waiting(pool)
    pool.expect_no_more()  # the reserve failed or was stopped
    taker.join(20)
    (second,) = got
    assert pool.allocations == 2 and not np.shares_memory(second, first)
    assert pool.take() is not None and pool.allocations == 3  # nothing is expected any more


def test_an_epoch_makes_no_more_batch_buffers_than_the_reserve_and_the_first(
    era5_v3_path: Path,
) -> None:
    store = counting_store(era5_v3_path)  # not a folder read on the decode threads: reserved
    geoms = open_geometries(store, ["t2m"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    pipe = insitu_pipeline(store, manifest, {"x": geoms["t2m"]}, batch_size=4, coords=())
    with pipe:
        loader = Loader(pipe)
        made = []
        for _ in range(2):
            for _batch in loader:
                pass
            (buffers,) = pipe.context.buffers._pools.values()
            made.append(buffers.allocations)
        # the reserve's prefetch_depth + 2 and the first batch's own (which does not wait);
        # a take while the reserve is behind waits for it instead of making another
        assert made[0] <= pipe.prefetch_depth + 2 + 1
        assert made[1] == made[0]  # epoch 1 makes none


def test_closing_a_pipeline_stops_its_reserve(era5_v3_path: Path) -> None:
    store = counting_store(era5_v3_path)
    geoms = open_geometries(store, ["t2m"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    pipe = insitu_pipeline(store, manifest, {"x": geoms["t2m"]}, batch_size=4)
    assert pipe.stages.fetch.memory_ahead
    pipe.close()
    assert pipe.stages.pool._reserver is None


def test_a_local_folder_s_pipeline_makes_no_memory_ahead_of_need(era5_v3_path: Path) -> None:
    # its epoch 0 is CPU-bound (page-cache reads and decodes on every core): slots and buffers
    # made ahead of need on threads of their own only took the decode threads' CPU
    geoms = open_geometries(era5_v3_path, ["t2m"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    pipe = insitu_pipeline(era5_v3_path, manifest, {"x": geoms["t2m"]}, batch_size=4, coords=())
    with pipe:
        assert not pipe.stages.fetch.memory_ahead
        assert not any("reserve" in t.name for t in threading.enumerate())
        assert pipe.stages.pool.stats.allocations == 0 and pipe.context.buffers.allocations == 0
        n = sum(len(batch) for batch in Loader(pipe))
        assert n > 0 and 0 < pipe.context.buffers.allocations <= pipe.prefetch_depth + 2


@pytest.mark.parametrize("budget", ["automatic", "floor"])
def test_the_first_epoch_draws_its_slots_from_the_reserve_and_matches_zarr(
    era5_v3_path: Path, budget: str
) -> None:
    geoms = open_geometries(era5_v3_path, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    labels = {"x": geoms["t2m"], "y": geoms["t2m"].shift(1), "z": geoms["z"]}
    kw = {"batch_size": 5, "block_chunks": 2}
    if budget == "floor":  # the smallest explicit budget accepted: little slack for a race
        config = PlanConfig(**kw)  # type: ignore[arg-type]
        kw["cache_budget_bytes"] = schedule_floors(manifest, labels, config).bounded
    pipe = insitu_pipeline(counting_store(era5_v3_path), manifest, labels, **kw)
    try:
        pool = pipe.stages.pool
        _wait_reserved(pool)
        reserved = pool.stats.allocations
        assert reserved > 0 and pool.allocated_bytes <= pool.budget_bytes
        group = zarr.open_group(era5_v3_path, mode="r")
        full = {p: np.asarray(group[p][...]) for p in ("t2m", "z")}
        n = 0
        for batch in Loader(pipe):
            for label, g in labels.items():
                idx = np.asarray(batch.sample_indices[label])
                np.testing.assert_array_equal(batch.arrays[label], full[g.path][idx])
            n += len(batch)
        assert n > 0
        assert pool.stats.allocations == reserved, "the first epoch allocated slots of its own"
    finally:
        pipe.close()


_TUNED = "from insitubatch_nodes import _process; print(_process.tune_allocator())"


def _run_process(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``argv`` (``python -c ...``) in a process of its own with ``env``: forked from the fork
    server, or a fresh interpreter where the server started with ``MALLOC_ARENA_MAX`` set."""
    runner = subprocess.run if "MALLOC_ARENA_MAX" in os.environ else forkserver.run
    return runner(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.skipif(not LINUX, reason="the allocator tuning is for glibc on Linux")
@pytest.mark.parametrize(("setting", "tuned"), [(None, "True"), ("0", "False"), ("1", "True")])
def test_the_allocator_is_tuned_once_per_process_unless_the_environment_opts_out(
    setting: str | None, tuned: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "INSITUBATCH_NODES_MALLOC_TUNING"}
    if setting is not None:
        env["INSITUBATCH_NODES_MALLOC_TUNING"] = setting
    proc = _run_process([sys.executable, "-c", _TUNED], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == tuned


# Eight threads each malloc (and free) 4 MiB at the same moment, after a store was opened by
# the package (argv[2] "url") or handed to it ("store": a zarr store built by hand), then
# glibc's own malloc_info() says how many arenas (heaps) the process has.
_ARENAS = """
import ctypes, sys, tempfile, threading
import zarr.storage
from obstore.store import LocalStore
from insitubatch_nodes import open_store
from insitubatch_nodes.io.stores import as_store
if sys.argv[2] == "url":
    open_store(sys.argv[1])
else:
    as_store(zarr.storage.ObjectStore(LocalStore(sys.argv[1]), read_only=True))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    p = libc.malloc(4 << 20)
    ctypes.memset(p, 1, 4 << 20)
    libc.free(p)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes, libc.malloc_info.argtypes = [ctypes.c_void_p], [ctypes.c_int, ctypes.c_void_p]
with tempfile.NamedTemporaryFile("r") as out:
    f = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    print(out.read().count("<heap nr="))
"""


@pytest.mark.skipif(not LINUX, reason="the allocator tuning is for glibc on Linux")
@pytest.mark.parametrize("given", ["url", "store"])
@pytest.mark.parametrize(("setting", "one_arena"), [(None, True), ("0", False)])
def test_once_a_store_is_open_every_thread_allocates_from_one_arena_unless_opted_out(
    tmp_path: Path, setting: str | None, one_arena: bool, given: str
) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("INSITUBATCH_NODES_MALLOC_TUNING", "MALLOC_ARENA_MAX")
    }
    if setting is not None:
        env["INSITUBATCH_NODES_MALLOC_TUNING"] = setting
    proc = _run_process([sys.executable, "-c", _ARENAS, str(tmp_path), given], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    arenas = int(proc.stdout.strip())
    # one arena: obstore's threads reuse each other's freed GET buffers (see tune_allocator)
    assert (arenas == 1) if one_arena else (arenas > 1), arenas


# Two epochs over a split that the automatic budget keeps (one sample per chunk, 48 MiB), in a
# process of its own: the peak resident set grew by the pool's budget, the batch buffers and
# decode scratch (the largest ``outside_pool_bytes`` seen), and a few MiB of buffers the
# decode threads read into (measured: 3.2 MiB).
_KEPT_RSS = """
import json, sys
from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
geoms = open_geometries(sys.argv[1], ["a", "b"])
manifest = split_by_chunk(geoms["a"], (0.75, 0.25, 0.0))
base = status("VmRSS:")
pipe = insitu_pipeline(sys.argv[1], manifest, geoms, batch_size=16, coords=(), decode_threads=2)
outside, gets = 0, []
for _ in range(2):
    for batch in Loader(pipe):
        outside = max(outside, pipe.stats()["outside_pool_bytes"])
    gets.append(pipe.report().gets)
print(json.dumps({"grew": status("VmHWM:") - base, "budget": pipe.stages.pool.budget_bytes,
                  "outside": outside, "gets": gets}))
pipe.close()
"""


@pytest.mark.skipif(not LINUX, reason="VmHWM is Linux's")
def test_a_kept_splits_peak_rss_is_its_budget_plus_the_batch_buffers_and_scratch(
    tmp_path: Path,
) -> None:
    root = tmp_path / "kept.zarr"
    group = zarr.open_group(str(root), mode="w")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):  # 256 samples of 128 KiB each
        arr = group.create_array(name, shape=(256, 128, 256), chunks=(1, 128, 256), dtype="f4")
        arr[...] = rng.standard_normal(arr.shape, dtype="float32")
    split = 2 * 192 * 128 * 256 * 4  # the train split: 48 MiB
    proc = _run_process([sys.executable, "-c", _KEPT_RSS, str(root)], dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["gets"] == [2 * 192, 0] and got["budget"] == split  # kept: epoch 1 reads nothing
    assert got["grew"] <= got["budget"] + got["outside"] + 8 * 2**20, got


@pytest.mark.skipif(not LINUX, reason="VmHWM is Linux's")
def test_a_kept_split_of_sub_page_chunks_holds_its_budget_not_a_page_per_chunk(
    tmp_path: Path,
) -> None:
    # 512-byte chunks: each slot the reserve mapped on its own held a whole 4 KiB page (the
    # split's 3 MiB took 24 MiB). Each resident chunk also costs its pool entry and array
    # object outside the budget: ~0.5 KiB measured, 1 KiB allowed.
    root = tmp_path / "tiny.zarr"
    group = zarr.open_group(str(root), mode="w")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):  # uncompressed: each chunk's object is its 512 bytes, written here
        group.create_array(
            name, shape=(4096, 16, 16), chunks=(1, 16, 16), dtype="<u2", compressors=None
        )
        for i, data in enumerate(rng.integers(0, 256, (4096, 512), dtype="u1")):
            (root / name / "c" / str(i) / "0").mkdir(parents=True)
            (root / name / "c" / str(i) / "0" / "0").write_bytes(data.tobytes())
    chunks = 2 * 3072
    proc = _run_process([sys.executable, "-c", _KEPT_RSS, str(root)], dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["gets"] == [chunks, 0] and got["budget"] == chunks * 512
    assert got["grew"] <= got["budget"] + got["outside"] + chunks * 1024 + 8 * 2**20, got
