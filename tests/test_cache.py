"""The cache directory: a persistent cross-run cache with one writer per directory.

Claims about processes are tested with real processes (``tests/cache_child.py``): a second
writer, readers and writers excluding each other, a SIGKILLed holder, a killed epoch resumed by
a fresh run, a process mapping a file while another rewrites it. The oracle for data is an
uncached pipeline over the same store (itself checked against zarr elsewhere) and, for single
chunks, zarr's own read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest
import zarr
from cache_child import CALLS, AddConstant, digest
from helpers import counting_store, write_era5

from insitubatch_nodes import Loader, applies, open_geometries, split_by_chunk
from insitubatch_nodes import insitu_pipeline as _insitu_pipeline
from insitubatch_nodes.cache.files import LOG_NAME, chunk_file_name
from insitubatch_nodes.cache.lock import LOCK_NAME
from insitubatch_nodes.errors import (
    CacheBusyError,
    CacheMissError,
    CorruptCacheError,
    StaleCacheError,
)
from insitubatch_nodes.options import CacheOptions
from insitubatch_nodes.plan.config import PlanConfig

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).resolve().parent / "cache_child.py"
N_CHUNKS = 12  # 96 samples, 8 per chunk


def insitu_pipeline(*args: Any, **kw: Any) -> Any:
    """``insitu_pipeline`` carrying no coordinates unless told: the claims here count the
    store's chunk GETs, and a carried coordinate is read from the store at build (see
    tests/test_coords.py), whatever the cache holds."""
    kw.setdefault("coords", ())
    return _insitu_pipeline(*args, **kw)


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 8, 16) and z (96, 2, 8, 16), 8 samples per chunk (12 chunks), one tile each."""
    return write_era5(tmp_path_factory.mktemp("cache") / "era5.zarr")


def build(root: Path, cache_dir: Path | None = None, **kw: Any) -> tuple[Any, Any]:
    store = counting_store(root, delay=kw.pop("delay", 0.0))
    geoms = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    kw.setdefault("batch_size", 8)
    kw.setdefault("block_chunks", 4)
    pipe = insitu_pipeline(store, manifest, ["t2m", "z"], cache_dir=cache_dir, **kw)
    return pipe, store


def epoch(pipe: Any) -> list[dict[str, np.ndarray]]:
    pipe.reset()
    return [{k: np.array(v) for k, v in b.arrays.items()} for b in pipe]


def same_batches(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def uncached(root: Path, **kw: Any) -> list[dict[str, np.ndarray]]:
    pipe, _ = build(root, **kw)
    try:
        return epoch(pipe)
    finally:
        pipe.close()


def warm(root: Path, cache_dir: Path, **kw: Any) -> list[dict[str, np.ndarray]]:
    pipe, _ = build(root, cache_dir, persist=True, **kw)
    try:
        return epoch(pipe)
    finally:
        pipe.close()


def logged(cache_dir: Path) -> list[dict[str, Any]]:
    lines = (cache_dir / LOG_NAME).read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


class Child:
    """A ``cache_child.py`` process that reports JSON events line by line (forked from the
    tests' fork server: a new process that shares nothing with this one)."""

    def __init__(self, **cfg: Any) -> None:
        self.proc = forkserver.popen(
            [sys.executable, str(CHILD), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )

    def event(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError(f"child exited: {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def go_on(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.event()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        child.finish()


def spawn(children: list[Child], **cfg: Any) -> Child:
    child = Child(**cfg)
    children.append(child)
    return child


# ---------------------------------------------------------------------------------------------
# Persistence
# ---------------------------------------------------------------------------------------------


def test_a_fresh_process_over_a_persisted_cache_fetches_and_decodes_nothing(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    want = warm(era5, cache)
    assert len(logged(cache)) == 2 * N_CHUNKS  # every chunk of both arrays, logged as it landed
    child = spawn(children, action="epoch", store=str(era5), cache_dir=str(cache), persist=True)
    assert child.event()["event"] == "ready"
    done = child.event()
    assert done["gets"] == 0  # counted at the store
    assert done["stats"]["disk_hits"] == 2 * N_CHUNKS
    assert done["stats"]["misses"] == 0
    assert done["digests"] == [{k: digest(v) for k, v in b.items()} for b in want]
    same_batches(want, uncached(era5))


def test_a_cached_chunk_is_the_chunk_after_its_transforms_and_a_hit_runs_no_transform(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache, chunk_transforms=[AddConstant(100.0, cache_key="add-100")])
    CALLS.clear()
    pipe, store = build(
        era5, cache, persist=True, chunk_transforms=[AddConstant(100.0, cache_key="add-100")]
    )
    got = epoch(pipe)
    pipe.close()
    assert CALLS == [] and store.chunk_gets == 0
    t2m = zarr.open_array(era5 / "t2m", mode="r")[:8]
    cached = np.load(cache / chunk_file_name("t2m", 0))
    np.testing.assert_array_equal(cached, t2m + 100.0)
    same_batches(got, uncached(era5, chunk_transforms=[AddConstant(100.0)]))


def test_overlapping_splits_share_entries_keyed_by_the_arrays_own_chunk_index(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    store = counting_store(era5)
    g = open_geometries(store, ["t2m"])["t2m"]
    first = insitu_pipeline(
        store, split_by_chunk(g, (0.5, 0.5, 0.0)), ["t2m"], batch_size=8, cache_dir=cache,
        persist=True,
    )  # fmt: skip
    epoch(first)
    first.close()
    assert sorted(e["chunk"] for e in logged(cache)) == list(range(6))
    store2 = counting_store(era5)
    second = insitu_pipeline(
        store2, split_by_chunk(g, (0.5, 0.5, 0.0)), ["t2m"], split="val", batch_size=8,
        cache_dir=cache, persist=True,
    )  # fmt: skip
    epoch(second)
    second.close()
    assert sorted(e["chunk"] for e in logged(cache)) == list(range(12))
    # a run over everything is all hits now
    store3 = counting_store(era5)
    every = insitu_pipeline(
        store3, split_by_chunk(g, (1.0, 0.0, 0.0)), ["t2m"], batch_size=8, cache_dir=cache,
        readonly_cache=True,
    )  # fmt: skip
    epoch(every)
    every.close()
    assert store3.chunk_gets == 0


def test_a_process_killed_mid_epoch_leaves_a_cache_that_serves_every_completed_chunk(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    child = spawn(
        children, action="epoch", store=str(era5), cache_dir=str(cache), persist=True,
        stop_after=3, block_chunks=2,
    )  # fmt: skip
    assert child.event()["event"] == "ready"
    assert child.event()["event"] == "stopped"
    child.kill()  # SIGKILL: nothing of close() runs
    done = {(e["array"], e["chunk"]) for e in logged(cache)}
    assert 0 < len(done) < 2 * N_CHUNKS
    pipe, store = build(era5, cache, persist=True, block_chunks=2)  # the lock is free at once
    got = epoch(pipe)
    stats = pipe.stats()
    pipe.close()
    fetched = {k for k, n in store.chunk_counts().items() if n}
    for array, chunk in done:  # a completed chunk is never fetched again
        assert not any(k.startswith(f"{array}/c/{chunk}/") for k in fetched), (array, chunk)
    assert stats["disk_hits"] == len(done)
    assert stats["misses"] == 2 * N_CHUNKS - len(done)
    same_batches(got, uncached(era5, block_chunks=2))
    assert not list(cache.glob(".*.tmp"))  # the killed writer's temp files were swept


def test_temp_files_a_killed_writer_left_are_swept_by_the_next_writer_not_by_a_reader(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    litter = cache / f".{chunk_file_name('t2m', 4)[:-4]}.99999.0.tmp"
    litter.write_bytes(b"half a chunk")
    pipe, _ = build(era5, cache, readonly_cache=True)
    pipe.close()
    assert litter.exists()  # a reader writes nothing, removes nothing
    pipe, _ = build(era5, cache, persist=True)
    pipe.close()
    assert not litter.exists()


def test_a_torn_last_log_line_is_dropped_and_a_corrupt_one_before_it_raises(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    log = cache / LOG_NAME
    text = log.read_text()
    log.write_text(text + '{"array": "t2m", "chu')  # a crash cut the last write short
    pipe, store = build(era5, cache, persist=True)
    epoch(pipe)
    pipe.close()
    assert store.chunk_gets == 0
    assert log.read_text().endswith("\n") and len(logged(cache)) == 2 * N_CHUNKS
    lines = log.read_text().splitlines()
    lines[3] = lines[3][:20]  # an unparseable line in the middle
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptCacheError, match="line 4"):
        build(era5, cache, persist=True, reset_stale_cache=True)
    # the failed construction released the lock: a reader can take the directory
    log.write_text(text)
    pipe, _ = build(era5, cache, readonly_cache=True)
    pipe.close()


@pytest.mark.parametrize("name", ["../escape.npy", "/etc/passwd", "sub/x.npy", ".insitu.lock"])
def test_a_log_naming_a_file_outside_the_directory_always_raises(
    era5: Path, tmp_path: Path, name: str
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    log = cache / LOG_NAME
    lines = log.read_text().splitlines()
    entry = json.loads(lines[1])
    entry["file"] = name
    lines[1] = json.dumps(entry)
    log.write_text("\n".join(lines) + "\n")
    for flags in ({"persist": True}, {"persist": True, "reset_stale_cache": True}):
        with pytest.raises(CorruptCacheError, match="not a bare file name"):
            build(era5, cache, **flags)


def test_a_cached_chunk_with_another_valid_sample_count_is_a_miss_not_an_error(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    want = warm(era5, cache)
    log = cache / LOG_NAME
    lines = log.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"array":"t2m"' in line)  # one object each
    entry = json.loads(lines[at])
    entry["valid"] = 3  # as if the array had grown since that chunk was cached
    lines[at] = json.dumps(entry, separators=(",", ":"))
    log.write_text("\n".join(lines) + "\n")
    pipe, store = build(era5, cache, persist=True)
    got = epoch(pipe)
    pipe.close()
    assert store.chunk_gets == 1  # that one chunk, fetched again
    same_batches(got, want)
    assert len(logged(cache)) == 2 * N_CHUNKS + 1  # its new line wins from now on


# ---------------------------------------------------------------------------------------------
# Identity
# ---------------------------------------------------------------------------------------------


def test_a_stale_array_raises_naming_it_and_reset_rebuilds_only_the_stale_arrays(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache, chunk_transforms=[applies("t2m", AddConstant(1.0, cache_key="v1"))])
    changed = [applies("t2m", AddConstant(2.0, cache_key="v2"))]
    with pytest.raises(StaleCacheError, match="'t2m'") as err:
        build(era5, cache, persist=True, chunk_transforms=changed)
    assert "'z'" not in str(err.value) and "reset_stale_cache=True" in str(err.value)
    # the construction that raised let go of the directory: another process takes it at once
    other = spawn(children, action="hold", store=str(era5), cache_dir=str(cache))
    assert other.event()["event"] == "ready"
    assert other.go_on()["event"] == "closed"
    other.proc.wait(30)
    z_files = {p.name: p.stat().st_ino for p in cache.glob(f"{chunk_file_name('z', 0)[:-5]}*")}
    pipe, store = build(era5, cache, persist=True, reset_stale_cache=True, chunk_transforms=changed)
    got = epoch(pipe)
    stats = pipe.stats()
    pipe.close()
    assert stats["disk_hits"] == N_CHUNKS  # z
    assert {k.split("/")[0] for k in store.chunk_counts()} == {"t2m"}
    assert store.chunk_gets == N_CHUNKS
    assert z_files == {
        p.name: p.stat().st_ino for p in cache.glob(f"{chunk_file_name('z', 0)[:-5]}*")
    }
    same_batches(got, uncached(era5, chunk_transforms=[applies("t2m", AddConstant(2.0))]))
    pipe, store = build(era5, cache, persist=True, chunk_transforms=changed)  # not stale now
    epoch(pipe)
    pipe.close()
    assert store.chunk_gets == 0


def test_a_closure_change_is_noticed_through_its_pickle(era5: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    def scale_by(k: float) -> Any:
        def scale(chunk: Any) -> Any:
            chunk.data *= k
            return chunk

        return scale

    warm(era5, cache, chunk_transforms=[scale_by(2.0)])
    build(era5, cache, persist=True, chunk_transforms=[scale_by(2.0)])[0].close()
    with pytest.raises(StaleCacheError, match=r"'t2m'.*'z'"):
        build(era5, cache, persist=True, chunk_transforms=[scale_by(3.0)])


FINGERPRINTS = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
from cache_child import CALLS, AddConstant, digest
from insitubatch_nodes import Coarsen, StandardScaler, applies, open_geometries
from insitubatch_nodes.cache.fingerprint import array_fingerprint, transform_identity
from insitubatch_nodes.transforms import ChunkTransforms
from helpers import counting_store
store = counting_store({store!r})
geoms = open_geometries(store, ["t2m", "z"])
k = 1.5
def closure(chunk):
    chunk.data *= k
    return chunk
mean = {{"t2m": np.arange(8 * 16.0).reshape(8, 16), "z": 2.0}}
scaler = StandardScaler(mean, {{"t2m": 3.0, "z": 4.0}})
ts = ChunkTransforms([scaler, applies("t2m", Coarsen(2)), closure, AddConstant(1.0)], geoms)
print(json.dumps({{p: array_fingerprint(ts.source(p), ts.outputs[p], ts.chain(p)) for p in geoms}}))
"""


def test_fingerprints_are_the_same_in_fresh_processes_with_other_hash_seeds(
    era5: Path, tmp_path: Path
) -> None:
    script = tmp_path / "fp.py"
    script.write_text(FINGERPRINTS.format(tests=str(CHILD.parent), store=str(era5)))
    procs = [  # side by side: two interpreter start-ups cost one on an idle core
        subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for seed in ("0", "12345")
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert outs[0]["t2m"] != outs[0]["z"]


# ---------------------------------------------------------------------------------------------
# One writer per cache_dir
# ---------------------------------------------------------------------------------------------


def test_a_second_writer_fails_at_once_naming_the_holder(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    holder = spawn(children, action="hold", store=str(era5), cache_dir=str(cache), persist=True)
    assert holder.event()["event"] == "ready"
    with pytest.raises(CacheBusyError) as err:
        build(era5, cache, persist=True)
    message = str(err.value)
    assert f"pid {holder.proc.pid}" in message and os.uname().nodename in message
    assert "fuser -v" in message and "lsof" in message and "Never delete" in message
    assert holder.go_on()["event"] == "closed"
    holder.proc.wait(30)
    build(era5, cache, persist=True)[0].close()  # free once the holder has gone


def test_the_lock_keys_on_cache_dir_not_on_persist(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    holder = spawn(children, action="hold", store=str(era5), cache_dir=str(cache))  # spill
    assert holder.event()["event"] == "ready"
    with pytest.raises(CacheBusyError):
        build(era5, cache)
    with pytest.raises(CacheBusyError):
        build(era5, cache, persist=True)


def test_a_reader_excludes_a_writer_and_a_writer_excludes_a_reader_across_processes(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    reader = spawn(children, action="hold", store=str(era5), cache_dir=str(cache), readonly=True)
    assert reader.event()["event"] == "ready"
    with pytest.raises(CacheBusyError, match="read-only process"):
        build(era5, cache, persist=True)
    assert reader.go_on()["event"] == "closed"
    reader.proc.wait(30)
    writer = spawn(children, action="hold", store=str(era5), cache_dir=str(cache), persist=True)
    assert writer.event()["event"] == "ready"
    with pytest.raises(CacheBusyError, match=f"pid {writer.proc.pid}"):
        build(era5, cache, readonly_cache=True)


def test_many_readers_share_a_cache(era5: Path, tmp_path: Path, children: list[Child]) -> None:
    cache = tmp_path / "cache"
    want = warm(era5, cache)
    readers = [
        spawn(children, action="hold", store=str(era5), cache_dir=str(cache), readonly=True)
        for _ in range(3)
    ]
    for r in readers:
        assert r.event()["event"] == "ready"
    pipe, store = build(era5, cache, readonly_cache=True)
    same_batches(epoch(pipe), want)
    pipe.close()
    assert store.chunk_gets == 0


def test_a_sigkilled_holders_lock_is_free_at_once(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    holder = spawn(children, action="hold", store=str(era5), cache_dir=str(cache), persist=True)
    assert holder.event()["event"] == "ready"
    holder.kill()
    pipe, _ = build(era5, cache, persist=True)
    pipe.close()
    assert (cache / LOCK_NAME).exists()  # the lock file stays: its inode is the lock


def test_a_readonly_miss_raises_naming_the_array_and_chunk(era5: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    store = counting_store(era5)
    g = open_geometries(store, ["t2m"])["t2m"]
    pipe = insitu_pipeline(
        store, split_by_chunk(g, (0.5, 0.5, 0.0)), ["t2m"], batch_size=8, cache_dir=cache,
        persist=True,
    )  # fmt: skip
    epoch(pipe)
    pipe.close()
    pipe = insitu_pipeline(
        store, split_by_chunk(g, (0.5, 0.5, 0.0)), ["t2m"], split="val", batch_size=8,
        cache_dir=cache, readonly_cache=True, shuffle=False,
    )  # fmt: skip
    with pytest.raises(CacheMissError, match=r"chunk 6 of array 't2m' is not in the read-only"):
        epoch(pipe)
    pipe.close()


def test_a_readonly_run_writes_nothing(era5: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)

    def snapshot() -> dict[str, tuple[int, int, int]]:
        return {
            str(p.relative_to(cache)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(cache.rglob("*"))
        }

    before = snapshot()
    pipe, store = build(era5, cache, readonly_cache=True)
    epoch(pipe)
    epoch(pipe)
    pipe.close()
    assert snapshot() == before and store.chunk_gets == 0


def test_a_cache_dir_on_a_network_file_system_warns_that_writers_are_not_arbitrated(
    era5: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from insitubatch_nodes.cache import lock as cache_module

    local = cache_module._mount_type(tmp_path)
    assert local is not None and local not in cache_module._NETWORK_FS  # read from /proc/mounts
    monkeypatch.setattr(cache_module, "_mount_type", lambda path: "nfs4")
    with pytest.warns(
        UserWarning, match=r"not arbitrated: it is on a network file system \(nfs4\)"
    ):
        build(era5, tmp_path / "cache", persist=True)[0].close()


def test_readonly_refuses_reset_stale_cache_and_every_flag_needs_a_cache_dir(
    era5: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="writes nothing"):
        build(era5, tmp_path / "c", readonly_cache=True, reset_stale_cache=True)
    for flag in ("persist", "readonly_cache", "reset_stale_cache"):
        with pytest.raises(ValueError, match="need a cache_dir"):
            build(era5, None, **{flag: True})
    with pytest.raises(TypeError, match="cache_dir must be a path"):
        build(era5, 3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Replace, never truncate; the lock outlives every mapping
# ---------------------------------------------------------------------------------------------


def test_a_process_mapping_a_cached_chunk_keeps_its_bytes_while_another_rewrites_it(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache, chunk_transforms=[AddConstant(1.0, cache_key="same")])
    target = cache / chunk_file_name("t2m", 0)
    reader = spawn(children, action="map", file=str(target))  # ignores the lock, as NFS may
    before = reader.event()["digest"]
    # The log forgets chunk 0 (as if it never completed), and a writer whose transform changed
    # but whose cache_key did not re-admits it: new bytes under the same file name.
    log = cache / LOG_NAME
    lines = [
        line for line in log.read_text().splitlines() if '"file":"' + target.name + '"' not in line
    ]
    log.write_text("\n".join(lines) + "\n")
    warm(era5, cache, chunk_transforms=[AddConstant(50.0, cache_key="same")])
    assert not np.array_equal(np.load(target), zarr.open_array(era5 / "t2m", mode="r")[:8] + 1)
    assert reader.go_on()["digest"] == before


def test_a_deleted_cached_file_under_a_live_mapping_does_not_disturb_the_reader(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    pipe, _ = build(era5, cache, persist=True, cache_budget_bytes=2**24)  # holds the split
    first = epoch(pipe)  # every slot is a mapping of the file it became
    for f in cache.glob("*.npy"):
        f.unlink()  # while the pool maps them all
    second = epoch(pipe)  # served from those mappings (pool hits)
    stats = pipe.stats()
    pipe.close()
    assert stats["hits"] == 2 * N_CHUNKS and stats["disk_hits"] == 0
    plain, _ = build(era5)
    same_batches(first, epoch(plain))
    same_batches(second, epoch(plain))
    plain.close()


def test_a_cached_file_deleted_since_it_was_logged_is_fetched_and_cached_again_or_raises(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    want = warm(era5, cache)
    victim = cache / chunk_file_name("t2m", 3)
    victim.unlink()
    pipe, _ = build(era5, cache, readonly_cache=True)
    with pytest.raises(CacheMissError, match="chunk 3 of array 't2m' is not in the read-only"):
        epoch(pipe)
    pipe.close()
    pipe, store = build(era5, cache, persist=True)
    got = epoch(pipe)
    stats = pipe.stats()
    pipe.close()
    assert store.chunk_gets == 1 and stats["misses"] == 1  # that chunk only, from the store
    assert stats["disk_writes"] == 1 and victim.exists()  # and it is cached again
    same_batches(got, want)


def test_a_lock_whose_release_waits_only_on_garbage_is_this_process_s_to_take_again(
    tmp_path: Path,
) -> None:
    """The flaky CacheBusyError's cause, made deterministic: a pipeline stopped by an error
    closes its cache while the error is alive, and the error's traceback (a reference cycle)
    keeps a slot that is a view of a mapped file, so the lock's release waits for that mapping.
    The same process asking for the directory again is waiting on itself: it collects garbage
    and takes it, instead of raising CacheBusyError."""
    import gc

    from insitubatch_nodes.cache import _filemap
    from insitubatch_nodes.cache.lock import take_lock

    directory = tmp_path / "cache"
    directory.mkdir()
    path = directory / "chunk.npy"
    (directory / LOCK_NAME).touch()  # as a writer leaves it: readers open it
    path.write_bytes(bytes(4096))
    for first_shared, then_shared in ((True, False), (False, True), (False, False)):
        lock = take_lock(directory, shared=first_shared)
        fd = os.open(path, os.O_RDONLY)
        region = _filemap.map_file(fd, 4096, writable=False)
        os.close(fd)
        lock.track(region)

        def fail(view: np.ndarray) -> None:
            raise CacheMissError("chunk 3 is not in the read-only cache")

        try:
            fail(region.array(np.dtype("u1"), (4096,), 0))
        except CacheMissError as exc:
            error = exc
        cycle: list[Any] = [error]
        cycle.append(cycle)  # the error's frames and the list: garbage only a collection frees
        del error, region
        lock.release()
        assert lock.waiting  # the mapping is alive, in the cycle
        gc.disable()  # no automatic collection may free it first
        try:
            del cycle
            again = take_lock(directory, shared=then_shared)
        finally:
            gc.enable()
        assert not lock.waiting and again.held
        again.release()


def test_the_lock_outlives_every_mapping_the_pool_holds(
    era5: Path, tmp_path: Path, children: list[Child]
) -> None:
    cache = tmp_path / "cache"
    pipe, _ = build(era5, cache, persist=True)
    epoch(pipe)  # writes every chunk: its slots are mappings of the cache's files
    pool = pipe.stages.pool
    written = [k for k in pool.resident_keys() if getattr(pool.lookup(k), "file", None)]
    mapped = pool.lookup(written[0]).slot  # type: ignore[union-attr]  # a file's view
    pipe.close()
    child = spawn(children, action="hold", store=str(era5), cache_dir=str(cache), persist=True)
    assert child.event()["event"] == "error"  # still locked: a mapping is alive
    del mapped
    child = spawn(children, action="hold", store=str(era5), cache_dir=str(cache), persist=True)
    assert child.event()["event"] == "ready"


def test_a_closed_pipeline_takes_the_directory_back_when_iterated_again(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    pipe, store = build(era5, cache, persist=True)
    first = epoch(pipe)
    fetched = store.chunk_gets
    pipe.close()
    other, _ = build(era5, cache, persist=True)  # the directory is free meanwhile
    other.close()
    second = epoch(pipe)
    pipe.close()
    assert store.chunk_gets == fetched  # the second epoch came from disk
    plain, _ = build(era5)
    want = [epoch(plain), epoch(plain)]
    plain.close()
    same_batches(first, want[0])
    same_batches(second, want[1])


def test_spill_files_take_no_name_on_disk_and_leave_only_the_lock(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "spill"
    want = uncached(era5)
    pipe, _ = build(era5, cache)
    got = epoch(pipe)
    assert {p.name for p in cache.iterdir()} == {LOCK_NAME}
    pipe.close()
    same_batches(got, want)
    assert {p.name for p in cache.iterdir()} == {LOCK_NAME}


# ---------------------------------------------------------------------------------------------
# Windowed shuffled passes release blocks and read them back from disk
# ---------------------------------------------------------------------------------------------


def test_a_windowed_shuffled_pass_with_persist_holds_a_few_blocks_and_revives_from_disk(
    tmp_path: Path,
) -> None:
    root = write_era5(tmp_path / "long.zarr", n_time=2048, n_lat=4, n_lon=4, samples_per_chunk=8)
    store = counting_store(root)
    g = open_geometries(store, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g, "y": g.shift(24), "z": g.shift(240)}  # leads far beyond one block

    def run(**kw: Any) -> tuple[list[dict[str, np.ndarray]], dict[str, int], int]:
        s = counting_store(root)
        pipe = insitu_pipeline(s, manifest, views, batch_size=16, block_chunks=4, **kw)
        out = epoch(pipe)
        stats = pipe.stats()
        pipe.close()
        return out, stats, s.chunk_gets

    plain, plain_stats, plain_gets = run()
    cached, stats, gets = run(cache_dir=tmp_path / "cache", persist=True)
    same_batches(cached, plain)
    assert gets == plain_gets == 256  # each stored chunk fetched once
    assert stats["disk_hits"] > 0  # released chunks came back from disk, not from the store
    # measured: 188 chunks live at the peak without the cache, 48 with it
    assert stats["resident_peak_bytes"] * 3 < plain_stats["resident_peak_bytes"]


# ---------------------------------------------------------------------------------------------
# Lightning and DDP
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # two real Trainer fits
@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_lightning_fit_warms_the_cache_for_train_and_val_and_a_readonly_fit_fetches_nothing(
    era5: Path, tmp_path: Path
) -> None:
    import lightning.pytorch as pl
    import torch

    from insitubatch_nodes.lightning import InSituDataModule

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8 * 16, 8 * 16)

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            x = batch["t2m"].flatten(1)
            return torch.nn.functional.mse_loss(self.layer(x), x)

        def validation_step(self, batch: dict[str, torch.Tensor], _: int) -> None:
            self.log("val", batch["t2m"].mean())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    def fit(**cache: Any) -> Any:
        store = counting_store(era5)
        dm = InSituDataModule(
            store, ["t2m"], (0.75, 0.25, 0.0), config=PlanConfig(batch_size=8, block_chunks=4),
            cache=CacheOptions(cache_dir=tmp_path / "cache", **cache),
            coords=(),  # GETs count chunks only
        )  # fmt: skip
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(Model(), datamodule=dm)
        dm.teardown("fit")
        return store

    def t2m_gets(store: Any) -> int:  # (the data module reads the time coordinate once per
        # fit to split the fractions in time order: not a chunk of t2m, nor cached)
        return sum(n for k, n in store.counts.items() if k.startswith("t2m/c"))

    warmed = fit(persist=True)  # the train and val pipelines write one directory together
    assert t2m_gets(warmed) == N_CHUNKS
    assert sorted(e["chunk"] for e in logged(tmp_path / "cache")) == list(range(N_CHUNKS))
    again = fit(readonly=True)
    assert t2m_gets(again) == 0


@pytest.mark.slow  # gloo processes
@pytest.mark.timeout(300)
def test_gloo_ranks_share_one_cache_with_no_chunk_fetched_twice_nor_written_twice(
    tmp_path: Path,
) -> None:
    from cache_child import ddp_cache_worker
    from resume_helpers import spawn_ranks

    # 100 samples in 13 chunks (the last holds 4): 50 per rank, so one chunk is cut in two
    root = write_era5(tmp_path / "era5.zarr", n_time=100)
    world, cache = 2, tmp_path / "cache"
    cfg = {"store": str(root), "cache_dir": str(cache), "persist": True, "epochs": 2}
    out = str(tmp_path / "rank{}.json")
    spawn_ranks(ddp_cache_worker, (world, str(tmp_path / "init"), cfg, out), world, tmp_path / "j1")
    results = [json.loads(Path(out.format(r)).read_text()) for r in range(world)]
    # Over both epochs every stored object was fetched once, by one rank — a chunk another rank
    # completed came from disk — except the tail chunk both ranks read at once in epoch 0
    # (the deal cuts one chunk's samples between the ranks: which one, the shuffle decides).
    fetched: dict[str, int] = {}
    for r in results:
        for e in r["epochs"]:
            for key, n in e["gets"].items():
                fetched[key] = fetched.get(key, 0) + n
    assert len(fetched) == 3 * 13  # t2m: one object per chunk, z: two
    twice = {k for k, n in fetched.items() if n != 1}
    assert len({k.split("/")[2] for k in twice}) <= world - 1  # the tail chunk's objects only
    assert all(n <= 2 for n in fetched.values())
    # each chunk written once: one log line per chunk over the ranks' directories (the claim
    # kept the second rank from writing the tail chunk too)
    lines = logged(cache) + logged(cache / "rank-1")
    keys = [(e["array"], e["chunk"]) for e in lines]
    assert len(keys) == len(set(keys)) == 2 * 13
    assert logged(cache) and logged(cache / "rank-1")  # both ranks wrote their share
    for r in results:
        for e in r["epochs"]:
            assert len(e["samples"]) == 50
    # a second job over the same directory reads everything from disk, and gets the same
    # batches as the first job, whose first epoch decoded them from the store
    out2 = str(tmp_path / "again{}.json")
    args2 = (world, str(tmp_path / "init2"), cfg, out2)
    spawn_ranks(ddp_cache_worker, args2, world, tmp_path / "j2")
    again = [json.loads(Path(out2.format(r)).read_text()) for r in range(world)]
    assert all(not e["gets"] for r in again for e in r["epochs"])
    assert sum(r["stats"]["disk_hits"] for r in again) >= 2 * 13
    for first, second in zip(results, again, strict=True):
        for e1, e2 in zip(first["epochs"], second["epochs"], strict=True):
            assert e1["samples"] == e2["samples"]
            assert e1["digests"] == e2["digests"]


def test_two_ranks_missing_one_chunk_at_once_write_it_once_and_both_read_it_after(
    tmp_path: Path,
) -> None:
    from insitubatch_nodes.cache.directory import ChunkCache

    fps = {"t2m": "0123456789abcdef"}
    rank0 = ChunkCache(tmp_path, fps, persist=True, rank=0)
    rank1 = ChunkCache(tmp_path, fps, persist=True, rank=1)  # writes tmp_path/rank-1
    key, shape, dtype = ("t2m", 5), (8, 4), np.dtype("f4")
    first = rank0.new_slot(key, shape, dtype, 8)
    assert first is not None
    assert rank1.new_slot(key, shape, dtype, 8) is None  # claimed: rank 1 keeps it in memory
    first.array[...] = np.arange(32, dtype="f4").reshape(shape)
    assert rank0.commit(first, 8)
    file = rank1.find(key, shape, dtype, 8)  # rank 0's log, read as it grew
    assert file is not None
    got = rank1.map_file(file, shape, dtype, key)
    assert got is not None
    np.testing.assert_array_equal(got, np.arange(32, dtype="f4").reshape(shape))
    assert rank1.new_slot(key, shape, dtype, 8) is None  # logged now: nothing to write
    assert not list((tmp_path / ".claims").iterdir())
    del got
    rank0.close()
    rank1.close()


# ---------------------------------------------------------------------------------------------
# A cache_dir this process cannot write
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def read_only_view(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``(writable, read_only)``: one directory, and the same directory seen read-only — a
    read-only bind mount as root (root writes through file modes), mode 0555 otherwise."""
    writable, view = tmp_path / "cache", tmp_path / "ro"
    writable.mkdir()
    if os.geteuid() != 0:
        yield writable, writable
        return
    view.mkdir()
    bound = subprocess.run(["mount", "--bind", str(writable), str(view)], capture_output=True)
    if bound.returncode != 0:
        pytest.skip(f"a read-only bind mount needs CAP_SYS_ADMIN: {bound.stderr.decode()}")
    try:
        remount = ["mount", "-o", "remount,ro,bind", str(view)]
        if subprocess.run(remount, capture_output=True).returncode != 0:
            pytest.skip("this kernel refused to remount the bind mount read-only")
        yield writable, view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)


def test_a_writer_on_a_read_only_cache_dir_is_told_to_pass_readonly_cache(
    era5: Path, read_only_view: tuple[Path, Path]
) -> None:
    writable, view = read_only_view
    warm, _ = build(era5, writable, persist=True)
    want = epoch(warm)
    warm.close()
    if view == writable:  # not root: take the write permission away instead
        os.chmod(writable, 0o555)
        os.chmod(writable / LOCK_NAME, 0o444)
    try:
        with pytest.raises(OSError) as info:
            build(era5, view, persist=True)
        message = str(info.value)
        assert "readonly_cache=True" in message and str(view) in message
        assert "not writable" in message
        reader, store = build(era5, view, readonly_cache=True)  # what the message says works
        same_batches(epoch(reader), want)
        assert store.chunk_gets == 0  # every chunk came from the cache
        reader.close()
    finally:
        os.chmod(writable, 0o755)


@pytest.mark.parametrize("batches", [1, 2])
def test_a_spill_directory_closed_mid_epoch_is_free_at_once(tmp_path: Path, batches: int) -> None:
    """Closed a batch or two into an epoch, with fills still in flight: before, those fills
    landed after the pool had dropped its free slots and put their mapped spill files back on
    that list, so the directory stayed locked until the pipeline object was collected (and
    ``close()`` waited its 2 s for the mappings first)."""
    import fcntl

    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w")
    array = group.create_array(
        "t2m", shape=(97, 3, 5), chunks=(4, 3, 5), dtype="<f4",
        dimension_names=["time", "lat", "lon"],
    )  # fmt: skip
    array[:] = np.random.default_rng(1).standard_normal((97, 3, 5)).astype("<f4")
    g = open_geometries(str(root), ["t2m"])["t2m"]
    cache = tmp_path / "spill"
    pipe = _insitu_pipeline(
        str(root), split_by_chunk(g, (0.8, 0.2, 0.0)), {"x": g.window([-2, 0]), "y": g.shift(3)},
        batch_size=5, block_chunks=2, seed=7, stride=2, cache_dir=cache,
    )  # fmt: skip
    batches_of = iter(Loader(pipe))
    for _ in range(batches):
        next(batches_of)
    pipe.close()
    fd = os.open(cache / LOCK_NAME, os.O_RDWR)
    try:  # another open file description: conflicts with any flock still held here
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert pipe.stages.pool.stats.resident_bytes == 0
