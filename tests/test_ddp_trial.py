"""One node's DDP ranks over one cache_dir (the ranks-and-processes trial of 2026-12-06): the
wrong answers it found.

The trial ran 1-4 gloo ranks in real processes over one ``cache_dir`` with ``persist=True`` — all
cold at once, warm again, a rank SIGKILLed mid-epoch and the job restarted, restarted on another
number of ranks, with ``remainder`` "drop"/"pad"/"uneven", different budgets, read-only readers
beside a writer and a full tmpfs — every delivered row checked against zarr's read. Each test
below is a case it caught answering wrongly. What went wrong there is how the cache reads and
writes its rank parts' logs, not a process's timing, so the tests build the ranks' pipelines (or
caches) one after another in this process (``rank=``/``world_size=`` given, each writing its own
part of the directory), in the order the trial's processes reached that point — except the
last, whose point is a process's identity: two real processes, each pid 1 of its own pid
namespace, as two runs of a restarted container are. The oracles are zarr's read, the store's
GETs (``pipe.stats()``) and the cache directory's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Loader,
    StandardScaler,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.cache.files import LOG_NAME
from insitubatch_nodes.errors import StaleCacheError

pytestmark = pytest.mark.timeout(60)

N_TIME, SPC = 40, 4  # 10 chunks of one stored object each


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, np.ndarray]:
    values = np.random.default_rng(3).random((N_TIME, 4, 4)).astype("f4") + 1
    array = zarr.create_array(tmp_path / "s.zarr", name="t2m", shape=values.shape,
                              chunks=(SPC, 4, 4), dtype="f4", fill_value=0,
                              dimension_names=("time", "lat", "lon"))  # fmt: skip
    array[...] = values
    return tmp_path / "s.zarr", values


def _pipe(root: Path, cache: Path, rank: int, world: int, **kw: Any) -> Any:
    geom = open_geometries(root)["t2m"]
    kw.setdefault("persist", not kw.get("readonly_cache", False))
    return insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"t2m": geom},
                           batch_size=4, block_chunks=2, coords=(), cache_dir=cache,
                           rank=rank, world_size=world, **kw)  # fmt: skip


def _epoch(pipe: Any, want: np.ndarray) -> list[int]:
    """One epoch, every row checked against ``want`` (zarr's read); the samples delivered."""
    seen: list[int] = []
    for batch in Loader(pipe):
        np.testing.assert_array_equal(batch["t2m"], want[batch.sample_indices["t2m"]])
        seen += batch.sample_indices["t2m"].tolist()
    return seen


def scaler(key: str) -> list[StandardScaler]:
    """A fitted normalisation, version ``key`` ("v1": std 2, later ones: std 4)."""
    return [StandardScaler({"t2m": 1.0}, {"t2m": 2.0 if key == "v1" else 4.0}, cache_key=key)]


def _logged(part: Path) -> list[int]:
    """The chunks one rank's part of the directory logged (line by line)."""
    lines = (part / LOG_NAME).read_text().splitlines()[1:]
    return [json.loads(line)["chunk"] for line in lines]


def test_a_corrupt_chunk_another_ranks_part_held_is_rewritten_once_not_every_run(
    tmp_path: Path, store: tuple[Path, np.ndarray]
) -> None:
    """Rank 1 of 2 cached its chunks in ``cache_dir/rank-1``; one of its files rotted. The job
    restarted on one rank: rank 0 found the file corrupt, fetched the chunk and rewrote it in
    its own part. Before: every later run again served rank 1's logged entry (the parts were
    read in rank order, the last one read winning), found it corrupt, fetched and rewrote it —
    one GET and one more log line per run, forever ("a new log line supersedes the old one"
    held only within one part). After: the newest entry of a chunk wins whichever part logged
    it, and the run after the repair reads nothing."""
    root, values = store
    cache = tmp_path / "cache"
    with _pipe(root, cache, rank=1, world=2) as pipe:
        _epoch(pipe, values)
    rotten = sorted((cache / "rank-1").glob("t2m*.npy"))[0]
    data = np.load(rotten, mmap_mode="r+")
    data[0, 0, 0] += 1
    data.flush()
    del data
    for run in range(3):
        with _pipe(root, cache, rank=0, world=1) as pipe:
            assert sorted(_epoch(pipe, values)) == list(range(N_TIME))
            stats = pipe.stats()
        if run == 0:  # rank 1 had cached half the chunks (and the tail chunk cut between them)
            assert stats["corrupt"] == 1
        else:
            assert (stats["gets"], stats["corrupt"], stats["disk_hits"]) == (0, 0, N_TIME // SPC)
    assert len(_logged(cache)) == len(set(_logged(cache))), "a chunk rewritten twice"


def test_ranks_that_reset_a_stale_cache_at_once_read_each_others_new_chunks(
    tmp_path: Path, store: tuple[Path, np.ndarray]
) -> None:
    """A 2-rank job warmed the cache; the normalisation changed (a new ``cache_key``) and the
    job was relaunched with ``reset_stale_cache=True``. Rank 0 read rank 1's log while it was
    still stale; then rank 1 rewrote its log without the stale lines and logged its new chunks.
    Before: rank 0 went on reading rank 1's log from where the old one had ended — in the
    middle of the new one: the chunks logged before that point were never seen (fetched
    again from the store, and written a second time), and an offset falling inside a line
    raised CorruptCacheError mid-epoch. After: a log replaced under a reader is read again
    from its start, and rank 0 fetches only the chunks rank 1 did not cache."""
    root, values = store
    cache = tmp_path / "cache"

    for rank in range(2):
        with _pipe(root, cache, rank=rank, world=2, chunk_transforms=scaler("v1")) as pipe:
            _epoch(pipe, (values - 1) / 2)
    new = scaler("v2")
    want = (values - 1) / 4
    rank0 = _pipe(root, cache, rank=0, world=1, chunk_transforms=new, reset_stale_cache=True)
    try:
        with _pipe(root, cache, rank=1, world=2, chunk_transforms=new,
                   reset_stale_cache=True) as rank1:  # fmt: skip
            _epoch(rank1, want)
        by_rank1 = set(_logged(cache / "rank-1"))
        assert 0 < len(by_rank1) < N_TIME // SPC
        assert sorted(_epoch(rank0, want)) == list(range(N_TIME))
        stats = rank0.stats()
    finally:
        rank0.close()
    assert stats["gets"] == N_TIME // SPC - len(by_rank1)
    assert stats["disk_hits"] == len(by_rank1)
    assert set(_logged(cache)).isdisjoint(by_rank1), "a chunk cached twice"


def test_a_cache_reset_by_a_job_on_fewer_ranks_opens_without_a_stale_error_after(
    tmp_path: Path, store: tuple[Path, np.ndarray]
) -> None:
    """3 ranks warmed the cache; the normalisation changed and the job came back on 2 ranks
    with ``reset_stale_cache=True``: ranks 0 and 1 reset their parts, and nothing writes
    ``rank-2`` any more. Before: every later run raised StaleCacheError for the old lines in
    ``rank-2`` and said to pass ``reset_stale_cache=True`` — which could never clear them, so
    every run had to pass it, and a read-only reader could not open the cache at all. After:
    lines older than a line made as now are a reset's leftovers and ignored; a pipeline made
    otherwise than the newest lines is still refused."""
    root, values = store
    cache = tmp_path / "cache"
    for rank in range(3):
        with _pipe(root, cache, rank=rank, world=3, chunk_transforms=scaler("v1")) as pipe:
            _epoch(pipe, (values - 1) / 2)
    for rank in range(2):
        with _pipe(root, cache, rank=rank, world=2, chunk_transforms=scaler("v2"),
                   reset_stale_cache=True) as pipe:  # fmt: skip
            _epoch(pipe, (values - 1) / 4)
    assert set(_logged(cache / "rank-2"))  # (its old lines stay)
    for kw in ({}, {"readonly_cache": True}):
        with _pipe(root, cache, rank=0, world=1, chunk_transforms=scaler("v2"), **kw) as pipe:
            assert sorted(_epoch(pipe, (values - 1) / 4)) == list(range(N_TIME))
            assert pipe.stats()["gets"] == 0
    with pytest.raises(StaleCacheError, match=r"'t2m' \(in .*cache\b"):
        _pipe(root, cache, rank=0, world=1, chunk_transforms=scaler("v1"))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (as root, as CI runs; skipped where it cannot be mounted)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_log_line_the_full_disk_cut_short_is_not_left_to_corrupt_the_cache(
    small_tmpfs: Path,
) -> None:
    """Ranks filled the cache's disk while they wrote it. A chunk's file had its blocks (they
    are reserved before it is mapped), but its log line crossed into a block the disk no longer
    had: the write took the part that fit and the line was cut short. Before: the commit
    counted the chunk as kept; the next line appended after the fragment made it an
    unparseable line before the last, and every later open of the cache — each rank's, the
    next run's — raised CorruptCacheError ("delete the cache directory"). After: the fragment
    is cut off again, the chunk is not kept (a warning, as for a chunk that did not fit), and
    the next run opens the cache with every chunk logged whole."""
    from insitubatch_nodes.cache.directory import ChunkCache

    fps, shape, dtype = {"t2m": "0123456789abcdef"}, (2, 2), np.dtype("f4")
    cache = ChunkCache(small_tmpfs, fps, persist=True)

    def slot(chunk: int) -> Any:
        got = cache.new_slot(("t2m", chunk), shape, dtype, 2)
        assert got is not None
        got.array[...] = chunk
        cache.seal(got)
        return got

    log, chunk = small_tmpfs / LOG_NAME, 0
    while not 4096 - 200 < log.stat().st_size % 4096 < 4096 - 100:  # the next line crosses
        assert cache.commit(slot(chunk), 2)
        chunk += 1
    last = slot(chunk)  # its file has its blocks
    filler = os.open(small_tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError):
            while True:
                os.write(filler, b"\0" * 4096)
    finally:
        os.close(filler)
    with pytest.warns(RuntimeWarning, match=f"could not keep chunk \\('t2m', {chunk}\\)"):
        assert not cache.commit(last, 2)
    assert log.read_bytes().endswith(b"\n")
    (small_tmpfs / "filler").unlink()
    assert cache.commit(slot(chunk + 1), 2)
    del last  # (a slot's mapping keeps the directory locked)
    cache.close()
    again = ChunkCache(small_tmpfs, fps, persist=True)  # raised CorruptCacheError
    try:
        kept = [c for c in range(chunk + 2) if again.has(("t2m", c))]
        assert kept == [*range(chunk), chunk + 1]
    finally:
        again.close()


_AS_PID_ONE = r"""
import ctypes, json, os, sys
from pathlib import Path
import numpy as np
from insitubatch_nodes.cache.directory import ChunkCache

libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x20000000) != 0:  # CLONE_NEWPID: the next child is pid 1 of a new namespace
    print(json.dumps({"skip": os.strerror(ctypes.get_errno())}), flush=True)
    sys.exit(0)
child = os.fork()
if child:
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
# a container's own /proc (CLONE_NEWNS, then proc mounted over /proc in it), as docker gives
if libc.unshare(0x00020000) != 0 or libc.mount(None, b"/", None, 16384 | 262144, None) != 0:
    os._exit(3)
if libc.mount(b"proc", b"/proc", b"proc", 0, None) != 0:
    os._exit(4)
cache = ChunkCache(sys.argv[1], {"t2m": "0123456789abcdef"}, persist=True)
slot = cache.new_slot(("t2m", 0), (2, 2), np.dtype("f4"), 2)
print(json.dumps({"pid": os.getpid(), "slot": slot is not None}), flush=True)
if sys.argv[2] == "die":  # holding the claim, as a killed rank does
    os._exit(0)
if slot is not None:
    cache.drop(slot)
del slot  # (its mapping would hold the directory's lock)
cache.close()
"""


def test_a_claim_a_killed_rank_left_is_swept_when_a_restarted_container_reuses_its_pid(
    tmp_path: Path,
) -> None:
    """A rank killed while it wrote a chunk leaves the chunk's claim file naming its host and
    pid; the next writer sweeps the claims of processes that are gone. A job restarted in a new
    container (a pod restarted on the same node, its NVMe kept) numbers its processes as the
    last one did, here pid 1. Before: the claim named a live pid — another process of the new
    job — so it was kept, the chunk counted as "claimed elsewhere", fetched and never written,
    in every later run. After: a claim names when its pid started too, and one whose pid now
    runs a process started at another time is swept."""
    cache = tmp_path / "cache"
    cache.mkdir()
    seen = []
    for what in ("die", "restart"):
        done = forkserver.run([sys.executable, "-c", _AS_PID_ONE, str(cache), what],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        event = json.loads(done.stdout.splitlines()[0])
        if "skip" in event:
            pytest.skip(f"no pid namespace here: {event['skip']}")
        seen.append(event)
        time.sleep(0.05)  # start times are counted in clock ticks
    assert [e["pid"] for e in seen] == [1, 1]
    assert seen[0]["slot"], "the first writer claims the chunk"
    assert seen[1]["slot"], "the restarted writer was kept off the chunk by a dead claim"
    assert not list((cache / ".claims").iterdir())
