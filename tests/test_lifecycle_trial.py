"""The pipeline's life in a long-lived process (the lifecycle trial of 2026-12-07): what a
hyper-parameter sweep or a notebook does — build, take part of an epoch, drop it without
``close()``, build again, dozens of times — and what a process does around it: a transform
or the consumer raising mid-epoch, ``fork()``, threads. zarr's own read of the store is the
oracle of every row; ``threading.enumerate()``, ``/proc/self/fd``, ``VmRSS``, ``gc``'s view of
event loops and obstore clients, and the cache directory's files for what a run leaves behind.
(Dropped pipelines' memory, teardown, two threads sharing an epoch and the fork guard of a
pipeline used in a child have their tests elsewhere: test_memory_trial, test_teardown,
test_notebook_trial, test_waits.)

Found and fixed:

* a forked child of a process writing a persistent ``cache_dir`` became a second writer of
  it: the child inherits the parent's lock descriptor — one ``flock`` shared by both — and
  this process's table of writer locks, so its own pipeline on the directory joined the
  parent's lock instead of being refused ("only one process may write a cache_dir"). Its
  opening swept the directory's temporary files, the parent's chunks still being written:
  their commits failed (a warning, 9 of 26 chunks kept). A child whose pipeline kept the
  chunks otherwise was refused with a ``StaleCacheError`` saying the directory was open "in
  this process" — after the sweep. Now the child closes its copies of the lock descriptors
  and forgets the parent's locks at the fork (``cache/lock.py``): its pipeline is refused with
  ``CacheBusyError`` naming the parent's pid, and nothing of the parent's is touched;
* a forked child that lived on (a helper process, a worker pool) kept the parent's cache lock
  held after the parent closed its pipeline: every other process was refused the directory
  until the child exited. The same fix: the child holds no copy of it;
* a child forked while a thread of the parent appended to a cache log (a chunk committed: a
  window of microseconds) hung at its own pipeline's first commit to a ``cache_dir`` of its
  own: the lock serialising appends came over held. It is made anew in the child
  (``_atomic.py``);
* a sweep giving each trial its own ``cache_dir`` kept, for every directory ever written, a
  writer lock (a mutex, an event, its path) in this process's table of writer locks: 30
  trials, 30 locks for the rest of the process. A build now drops those let go of
  (``cache/lock.py``). (Left here: the memo of each directory's rank folders,
  ``cache.files.RANK_DIRS``, one small entry per directory; dropped at close since,
  ``tests/test_budgetmem_trial.py``);
* an exception a batch transform raised reached the consumer as it was — ``ValueError: boom``
  — naming neither the transform, nor the batch and epoch, nor what to do (a chunk
  transform's is a ``ChunkTransformError`` saying all of that). It now carries a note (the
  exception itself unchanged, its type and traceback kept) naming the transform, the batch
  and the epoch, and saying that ``next()`` tries that batch again.

Tried and found right (each a test below):

* 48 builds in one process, each taking 2-5 batches of an epoch then dropped without
  ``close()`` — through ``Loader`` or not, with a persistent ``cache_dir``, a new
  ``open_store`` per build, chunk transforms — leave after one collection the threads,
  descriptors, event loops and obstore clients of before, no pin, a cache directory with no
  temporary file or claim and a lock another process can take, and RSS within 40 MiB
  (measured +5.4 to +5.8 MiB); every batch exact. By script, 100 builds of a 1 MiB split:
  with a collection after each, threads, descriptors and RSS flat (246 to 249 MiB); without
  one, dropped pipelines wait for Python's own (below ``_runtime.COLLECT_DROPPED_ABOVE``, as
  documented): up to 12 parked prefetch threads and 445 MiB RSS against 251, and after a
  final collection threads and descriptors back, 66 MiB still resident;
* a chunk or batch transform that raises mid-epoch: ``next()`` again delivers that batch and
  the rest, each once; a state taken on the error resumes from the failed batch; the last
  state restored into a new pipeline or the failed one resumes the epoch, and the epoch's
  first state re-runs it whole, each batch the same (by script also: a state saved on the
  error, at 5 points of two epochs, through ``Loader`` and not, chunk and batch transforms);
* a consumer that raises while holding batches (a simulated Ctrl-C), at the epoch's start,
  middle, end and in the next epoch, through ``Loader`` and on the pipeline itself: the last
  state restored into the same pipeline gives the rest of a three-epoch run exactly once, and
  every batch held stays intact;
* a forked child builds and runs its own pipeline (no cache, a reader beside a reader parent)
  exactly; dropping or closing the parent's pipeline in the child leaves the parent's run
  and cache files alone;
* ``close()`` from another thread while one iterates: the loop ends with
  ``PipelineInterrupted`` (or, where the close fell between two ``next()`` calls, goes on)
  and the next loop continues the epoch, no sample lost or repeated;
* by script only: ``KeyboardInterrupt`` and ``SystemExit`` raised in a batch transform reach
  the consumer as they are and the epoch goes on exactly; four threads calling ``close()`` at
  once, then iterating; ``state_dict()`` taken from another thread while one iterates (every
  state resumes a suffix of the epoch); 20 abandoned ``DataLoader`` and
  ``StatefulDataLoader`` iterations over ``as_dataset(pipe)`` with a ``cache_dir``: every
  pipeline collected, no thread or descriptor left.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import shutil
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage
from helpers import counting_store, in_forked_child

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.errors import ChunkTransformError, PipelineInterrupted
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # fork() with threads running
]

_JOIN_S = 10.0


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``t2m`` of 128 steps in chunks of 4 (32 chunks; train is 24 of them), and zarr's read."""
    root = tmp_path_factory.mktemp("lifecycle") / "era5.zarr"
    make_era5_like(root, n_time=128, n_lat=4, n_lon=8, samples_per_chunk=4, variables=["t2m"])
    store = zarr.storage.LocalStore(root, read_only=True)  # no obstore: forked children read it
    t2m = open_geometries(store, ["t2m"])["t2m"]
    return {
        "root": root,
        "store": store,
        "t2m": t2m,
        "manifest": split_by_chunk(t2m, (0.75, 0.25, 0.0)),
        "oracle": zarr.open_array(store=store, path="t2m", mode="r")[...],
    }


def _pipe(era5: dict[str, Any], store: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("batch_size", 4)
    store = era5["store"] if store is None else store
    return insitu_pipeline(store, era5["manifest"], {"x": era5["t2m"]}, **kwargs)


def _exact(era5: dict[str, Any], batch: Any) -> bool:
    return bool(np.array_equal(batch["x"], era5["oracle"][batch.sample_indices["x"]]))


def _key(batch: Any) -> tuple[int, int, tuple[int, ...]]:
    return batch.epoch, batch.index, tuple(int(i) for i in batch.sample_indices["x"])


def _fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor
            continue
    return sorted(out)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _count(kind: Callable[[Any], bool]) -> int:
    return sum(1 for obj in gc.get_objects() if kind(obj))


def _is_loop(obj: Any) -> bool:
    return isinstance(obj, asyncio.AbstractEventLoop)


def _is_obstore(obj: Any) -> bool:
    return str(getattr(type(obj), "__module__", "")).startswith("obstore")


#: threads of the process-wide pools (each started once, or grown up to its bound, and never
#: ended): asyncio's default executor and zarr's, the decode and gather pools, the readahead
#: thread, zarr's IO loop; foreign threads that called into Python (obstore's)
_POOLED = ("asyncio_", "zarr_", "ThreadPoolExecutor", "insitu-decode", "insitu-gather",
           "insitu-readahead")  # fmt: skip


def _process_wide(thread: threading.Thread) -> bool:
    return (
        thread is threading.main_thread()
        or isinstance(thread, threading._DummyThread)
        or thread.name.startswith(_POOLED)
    )


def _io_loop_ran_what_was_queued() -> None:
    """Return once the IO loop has run every callback queued on it before this call (two
    rounds: a task cancelled there ends on the loop's next step)."""
    from insitubatch_nodes import _runtime

    for _ in range(2):
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), _runtime.io_loop()).result(_JOIN_S)


def _readahead_idle() -> None:
    """Return once the readahead thread has taken up everything queued before this call (it
    serves its queue in order; a stand-in reader at the end says when it got there)."""
    from insitubatch_nodes.io import localfiles

    reached = threading.Event()

    class _Last:
        decided = threading.Event()

        @property
        def cold(self) -> bool:
            reached.set()
            return False  # (nothing to read ahead)

    _Last.decided.set()
    localfiles._readahead_queue().put((_Last(), ["-"]))  # type: ignore[arg-type]
    assert reached.wait(_JOIN_S)


def _lock_free(folder: Path) -> bool:
    """Whether another process could write ``folder`` now (an exclusive ``flock`` on its lock
    file, taken and let go on a descriptor of our own: another open file, as in another
    process)."""
    fd = os.open(folder / ".insitu.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing drops it)
    return True


# ---------------------------------------------------------------------------------------------
# Found: a forked child wrote the parent's cache_dir, and kept its lock
# ---------------------------------------------------------------------------------------------


def _held_fill(era5: dict[str, Any], cache: Path) -> tuple[Any, threading.Event, Any, Any]:
    """A writer of ``cache`` whose first chunk's fill is held inside its chunk transform (its
    file still a temporary one) until the returned event is set; the thread taking batch 0,
    and the transform."""
    entered, gate = threading.Event(), threading.Event()

    def held(chunk: Any) -> Any:
        entered.set()
        gate.wait(_JOIN_S)
        return chunk

    held.cache_key = "held"  # type: ignore[attr-defined]  # (it closes over events)

    pipe = _pipe(era5, shuffle=False, cache_dir=cache, persist=True, chunk_transforms=[held],
                 decode_threads=1)  # fmt: skip
    taker = threading.Thread(target=lambda: next(pipe), daemon=True)
    taker.start()
    assert entered.wait(_JOIN_S)
    return pipe, gate, taker, held


def test_a_forked_child_cannot_write_the_parents_cache_dir_nor_sweep_its_chunks_in_progress(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    # before: the child's pipeline joined the parent's writer lock (this process's table of
    # locks and the flock came with the fork) and its opening swept the parent's temporary
    # chunk files: the parent's commits failed, "could not keep chunk ('t2m', 0)", 9 of 26
    # chunks kept. With other chunk transforms than the parent's, the child was refused
    # with StaleCacheError "open in this process by another pipeline", after the sweep.
    for same_transforms in (True, False):
        cache = tmp_path / f"cache-{same_transforms}"
        parent, gate, taker, held = _held_fill(era5, cache)
        in_progress = sorted(p.name for p in cache.glob(".*.tmp"))
        assert in_progress

        def child_writes(
            cache: Path = cache, same: bool = same_transforms, gate: Any = gate, held: Any = held
        ) -> int:
            gate.set()  # (the child's copy of it: the parent's fill stays held)
            kw = {"chunk_transforms": [held]} if same else {}
            pipe = _pipe(era5, zarr.storage.LocalStore(era5["root"], read_only=True),
                         cache_dir=cache, persist=True, **kw)  # fmt: skip
            return sum(_exact(era5, batch) for batch in pipe)

        said = in_forked_child(child_writes, timeout=30.0)
        assert said.startswith("raised CacheBusyError"), said
        assert f"pid {os.getpid()} " in said and "this process" not in said, said
        assert set(in_progress) <= {p.name for p in cache.glob(".*.tmp")}  # untouched
        gate.set()
        taker.join(_JOIN_S)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "could not keep chunk ..." fails the test
            rest = list(parent)
        assert all(_exact(era5, batch) for batch in rest) and len(rest) == len(parent) - 1
        assert parent.stats()["disk_writes"] == len(era5["manifest"].splits["train"])
        parent.close()


def test_a_forked_child_that_lives_on_does_not_keep_the_parents_cache_lock(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    # before: the child's copy of the lock descriptor kept the flock: once the parent closed its
    # pipeline, every other process was still refused the cache_dir while the child lived
    cache = tmp_path / "cache"
    parent = _pipe(era5, cache_dir=cache, persist=True)
    assert _exact(era5, next(parent))
    read_end, write_end = os.pipe()
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child waits for the parent's word, then exits
        os.close(write_end)
        os.write(started_write, b"s")  # its fork handlers have run (they run before fork returns)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(started_write)
    try:
        assert os.read(started_read, 1) == b"s"  # the child's fork handlers ran: no race with them
        os.close(started_read)
        assert not _lock_free(cache)  # the parent writes it
        parent.close()
        assert _lock_free(cache)
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.waitpid(pid, 0)


def test_a_child_forked_while_a_thread_appends_to_a_cache_log_writes_its_own_cache(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    # before: the lock serialising this process's log appends was copied held (a decode thread
    # of the parent was committing a chunk at the fork: a window of microseconds, held open
    # here), and the child's own persistent cache waited for it forever at its first commit
    from insitubatch_nodes import _atomic

    with _atomic._APPEND_LOCK:  # as a parent's thread holds it, mid-append

        def child_caches() -> int:
            pipe = _pipe(era5, cache_dir=tmp_path / "child", persist=True)
            n = sum(_exact(era5, batch) for batch in pipe)
            return n + pipe.stats()["disk_writes"]

        said = in_forked_child(child_caches, timeout=10.0)
    n = len(era5["manifest"].splits["train"])
    assert said == f"ok {len(_pipe(era5)) + n}", said


def test_a_child_forked_while_a_parents_thread_holds_the_pool_closes_the_parents_pipeline(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    # before: close() in the child took the parent's locks (the prefetch stage's, the pool's:
    # a decode or the producer thread of the parent inside them at the fork, held open here)
    # and waited forever, where pipeline.md says closing it there leaves the parent's run alone
    parent = _pipe(era5, cache_dir=tmp_path / "cache", persist=True)
    assert _exact(era5, next(parent))
    with parent.stages.pool._lock:  # as a parent's thread holds it, admitting a chunk

        def child_closes() -> str:
            parent.close()
            return "closed"

        said = in_forked_child(child_closes, timeout=10.0)
    assert said == "ok closed", said
    rest = list(parent)  # the parent's run goes on
    assert all(_exact(era5, batch) for batch in rest) and len(rest) == len(parent) - 1
    parent.close()


def test_a_child_forked_while_a_thread_signals_a_lock_dropped_can_drop_its_copy(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    # before: the fork handler made each inherited cache lock's mutex anew but not the event a
    # drop sets; a parent's thread inside that event at the fork left its lock held in the
    # child, whose drop of its copy (a collection of the parent's pipeline) waited forever
    from insitubatch_nodes.cache import lock

    parent = _pipe(era5, cache_dir=tmp_path / "cache", persist=True)
    assert _exact(era5, next(parent))
    (held,) = [lk for lk in lock._LOCKS if lk._fd is not None]
    with held._dropped._cond:  # as a parent's thread holds it, inside Event.set or .wait

        def child_drops() -> str:
            held._drop()
            return "dropped"

        said = in_forked_child(child_drops, timeout=10.0)
    assert said == "ok dropped", said
    assert not _lock_free(tmp_path / "cache")  # the parent's lock is the parent's still
    parent.close()


def test_a_sweep_over_cache_dirs_leaves_no_lock_behind_for_each_directory(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    # before: this process's table of writer locks kept one lock (a mutex, an event, its path)
    # for every cache_dir ever written, closed or collected: 30 trials, 30 locks for good
    from insitubatch_nodes.cache import lock

    for trial in range(30):
        pipe = _pipe(era5, cache_dir=tmp_path / f"trial-{trial}", persist=True, seed=trial)
        assert _exact(era5, next(pipe))
        if trial % 2:
            pipe.close()
        del pipe
    gc.collect()
    last = _pipe(era5, cache_dir=tmp_path / "last", persist=True)  # (a build prunes them)
    assert len(lock._WRITERS) <= 2 and len(lock._LOCKS) <= 2, len(lock._WRITERS)
    assert len(lock._SHARED) <= 2, len(lock._SHARED)
    last.close()


# ---------------------------------------------------------------------------------------------
# Found: a batch transform's exception named nothing
# ---------------------------------------------------------------------------------------------


def test_a_batch_transform_raising_mid_epoch_is_named_with_its_batch_and_next_retries_it(
    era5: dict[str, Any],
) -> None:
    # before: the consumer got the bare ValueError("flaky"), naming neither the transform nor
    # the batch nor what to do
    calls = {"n": 0}

    def flaky(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise ValueError("flaky")
        return batch

    want = [_key(b) for b in _pipe(era5, seed=2)]
    pipe = _pipe(era5, seed=2, batch_transforms=[flaky])
    got, errors, saved = [], [], []
    while True:
        try:
            batch = next(pipe)
        except StopIteration:
            break
        except ValueError as exc:
            errors.append(exc)
            saved.append(pipe.state_dict())  # a checkpoint saved on the error
            continue
        assert _exact(era5, batch)
        got.append(_key(batch))
    pipe.close()
    assert got == want  # the failed batch was delivered by the next next(), once
    resumed = _pipe(era5, seed=2)
    resumed.reset(saved[0])
    assert [_key(b) for b in resumed] == want[3:]  # from the failed batch on
    resumed.close()
    (err,) = errors
    assert str(err) == "flaky"  # the exception itself, its type and message kept
    note = " ".join(getattr(err, "__notes__", []))
    assert "batch transform" in note and "flaky" in note, note
    assert "batch 3 of epoch 0" in note and "next()" in note, note


def test_a_chunk_transform_raising_mid_epoch_is_retried_by_next_or_resumed_from_a_state(
    era5: dict[str, Any],
) -> None:
    calls = {"n": 0}

    def flaky(chunk: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 9:
            raise ValueError("flaky")
        return chunk

    want = [_key(b) for b in _pipe(era5, seed=4, block_chunks=2)]
    for how in ("next", "state", "same", "rerun"):
        calls["n"] = 0
        pipe = _pipe(era5, seed=4, block_chunks=2, chunk_transforms=[flaky])
        loader = Loader(pipe)
        got, state, raised = [], loader.state_dict(), None
        start = state
        try:
            for batch in loader:
                assert _exact(era5, batch)
                got.append(_key(batch))
                state = loader.state_dict()
        except ChunkTransformError as exc:
            raised = exc
        assert raised is not None and "flaky" in str(raised) and 0 < len(got) < len(want)
        if how == "next":
            while (batch := next(pipe, None)) is not None:
                got.append(_key(batch))
        elif how == "state":  # into a new pipeline
            fresh = Loader(_pipe(era5, seed=4, block_chunks=2, chunk_transforms=[flaky]))
            fresh.load_state_dict(state)
            got += [_key(b) for b in fresh if _exact(era5, b)]
        else:  # into the failed one: from the last state, or the epoch again from its start
            if how == "rerun":
                state, got = start, []
            loader.load_state_dict(state)
            got += [_key(b) for b in loader if _exact(era5, b)]
        pipe.close()
        assert got == want, how


# ---------------------------------------------------------------------------------------------
# Right: builds abandoned again and again, a consumer raising, fork, threads
# ---------------------------------------------------------------------------------------------


def test_builds_abandoned_mid_epoch_again_and_again_leave_nothing_behind_once_collected(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    root = era5["root"]

    def build(i: int) -> Any:
        kw: dict[str, Any] = {"seed": i}
        store = None
        if i % 4 == 1:
            kw.update(cache_dir=cache, persist=True)
        if i % 4 == 2:
            store = open_store(root)  # a new obstore client each build
        if i % 4 == 3:
            kw["chunk_transforms"] = [lambda chunk: chunk]
        return _pipe(era5, store, **kw)

    there = set(threading.enumerate())  # (other tests' threads: not this test's to wait for)

    def held() -> tuple[set[threading.Thread], Counter[str], int, int]:
        """The threads, descriptors, event loops and obstore clients of the process, once every
        thread a build started that is not a process-wide pool's has ended (joined: a collected
        pipeline's thread ends on its way out; what its frames held is collected after), the
        IO loop has run what was queued on it (a cancelled GET lets go of its store there) and
        the readahead thread is idle (it opens the store's files for a moment). Waits on those,
        not on the clock (it waited 2 s at most: a loaded machine makes them slower, not
        different)."""
        gc.collect()
        for thread in set(threading.enumerate()) - there:
            if not _process_wide(thread):
                thread.join(_JOIN_S)
        _io_loop_ran_what_was_queued()
        _readahead_idle()
        gc.collect()  # (what the ended threads' frames held)
        return (set(threading.enumerate()), Counter(_fds()), _count(_is_loop),
                _count(_is_obstore))  # fmt: skip

    for i in range(4):  # what a first build of each kind starts for good (pools, loops)
        next(build(i))
    before, rss = held(), [_rss_mib()]
    for i in range(48):
        pipe = build(i)
        rows = iter(Loader(pipe)) if i % 2 else pipe
        for _ in range(2 + i % 4):
            assert _exact(era5, next(rows))
        del pipe, rows
        if i == 23:  # (the second half's growth: a leak per build grows it as much as the
            gc.collect()  # first's, the allocator's one-off growth does not)
            rss.append(_rss_mib())
    after = held()
    # no thread outlives the build that started it (a process-wide pool may have grown to its
    # bound: a loaded machine keeps its workers busy longer, so more of them start), no
    # descriptor stays open, no event loop or obstore client is kept
    assert not [t for t in after[0] - before[0] if not _process_wide(t)], (after[0], before[0])
    assert not after[1] - before[1], after[1] - before[1]
    assert after[2] <= before[2] and after[3] <= before[3], (after[2:], before[2:])
    assert not [fd for fd in _fds() if fd.startswith(str(cache))]
    assert not [p for p in cache.glob(".*.tmp")] and not list((cache / ".claims").iterdir())
    assert _lock_free(cache)
    rss.append(_rss_mib())
    assert rss[2] - rss[1] < 20, rss  # MiB over 24 builds


@pytest.mark.parametrize("how", ["loader", "pipeline"])
def test_a_consumer_raising_while_holding_batches_resumes_from_its_last_state_exactly(
    era5: dict[str, Any], how: str
) -> None:
    class Interrupt(Exception):
        pass

    reference = _pipe(era5, seed=7)
    want = [_key(b) for _ in range(3) for b in Loader(reference)]
    reference.close()
    per_epoch = len(want) // 3
    for stop_at in (0, 5, per_epoch - 1, per_epoch, per_epoch + 3):
        pipe = _pipe(era5, seed=7)
        rows: Any = Loader(pipe) if how == "loader" else pipe
        held, got, state = [], [], rows.state_dict()
        try:
            for _ in range(3):
                for batch in rows:
                    held.append((batch, batch["x"].copy()))
                    if len(got) == stop_at:
                        raise Interrupt  # the training step fails with this batch in hand
                    got.append(_key(batch))
                    state = rows.state_dict()
        except Interrupt:
            pass
        if how == "loader":
            rows.load_state_dict(state)
        else:
            rows.reset(state)
        while len(got) < len(want):
            got += [_key(b) for b in rows]
        pipe.close()
        assert got == want, (how, stop_at)
        assert all(np.array_equal(b["x"], rows_then) for b, rows_then in held)
        assert all(_exact(era5, b) for b, _ in held)


def test_a_forked_child_builds_its_own_pipeline_and_leaves_the_parents_alone(
    era5: dict[str, Any], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm = _pipe(era5, cache_dir=cache, persist=True)
    list(warm)
    warm.close()
    del warm
    parent = _pipe(era5, seed=1, cache_dir=cache, readonly_cache=True)
    want = [_key(b) for b in _pipe(era5, seed=1)]
    got = [_key(next(parent)) for _ in range(3)]

    def own(**kw: Any) -> Callable[[], int]:
        def run() -> int:
            pipe = _pipe(era5, zarr.storage.LocalStore(era5["root"], read_only=True), **kw)
            return sum(_exact(era5, batch) for batch in pipe)

        return run

    def drop_parents() -> str:
        nonlocal parent
        parent.close()
        parent = None
        gc.collect()
        return "dropped"

    n = len(want)
    assert in_forked_child(own(), timeout=30.0) == f"ok {n}"
    assert in_forked_child(own(cache_dir=cache, readonly_cache=True), timeout=30.0) == f"ok {n}"
    said = in_forked_child(lambda: next(parent), timeout=30.0)
    assert said.startswith("raised RuntimeError") and "fork" in said, said
    assert in_forked_child(drop_parents, timeout=30.0) == "ok dropped"
    files = sorted(p.name for p in cache.iterdir())
    got += [_key(b) for b in parent]
    assert got == want and parent.stats()["disk_hits"] > 0
    assert sorted(p.name for p in cache.iterdir()) == files
    parent.close()
    shutil.rmtree(cache)


def test_close_from_another_thread_ends_the_loop_and_the_next_loop_goes_on_exactly(
    era5: dict[str, Any],
) -> None:
    # a store answering each GET in 20 ms, one at a time: the consuming thread waits in next()
    # for most batches, where a close from another thread interrupts it (or, between two
    # next() calls, it simply goes on: a later next() restarts the pipeline)
    slow = counting_store(era5["root"], delay=0.02)
    want = [_key(b) for b in _pipe(era5, seed=3)]
    for trial in range(3):
        pipe = _pipe(era5, slow, seed=3, max_inflight=1)
        got: list[tuple[int, int, tuple[int, ...]]] = []
        errors: list[BaseException] = []
        third = threading.Event()

        def consume(
            pipe: Any = pipe,
            got: Any = got,
            errors: Any = errors,
            third: Any = third,
            n: int = 3 + trial,
        ) -> None:
            try:
                for batch in pipe:
                    assert _exact(era5, batch)
                    got.append(_key(batch))
                    if len(got) == n:
                        third.set()
            except PipelineInterrupted as exc:
                errors.append(exc)

        loop = threading.Thread(target=consume, daemon=True)
        loop.start()
        assert third.wait(_JOIN_S)
        pipe.close()
        loop.join(_JOIN_S)
        assert not loop.is_alive()
        while (batch := next(pipe, None)) is not None:  # the epoch, where the loop left it
            assert _exact(era5, batch)
            got.append(_key(batch))
        pipe.close()
        assert got == want, (trial, errors)
