"""What notebook and research code does to pipelines, found wrong by a black-box trial.

Re-running a cell while the old pipeline lives, two pipelines over one store and one
``cache_dir``, a pipeline iterated from threads, Ctrl-C inside ``next()``, pipelines dropped
without ``close()``, and batches kept while the pipeline moves on. zarr's own read of the store
is the oracle of every row delivered; every thread is joined with a timeout, so a hang fails
the test instead of the run.
"""

from __future__ import annotations

import _thread
import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import t2m_halves

from insitubatch_nodes import Loader, insitu_pipeline
from insitubatch_nodes.cache import lock as cache_lock
from insitubatch_nodes.errors import CacheBusyError, ChunkReadError, PipelineInterrupted

_JOIN_S = 10.0


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``t2m`` of 128 steps in chunks of 8 (16 chunks; train is the first 8), and zarr's read."""
    return t2m_halves(tmp_path_factory.mktemp("notebook") / "era5.zarr", 128)


def _pipe(era5: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("batch_size", 4)
    return insitu_pipeline(era5["store"], era5["manifest"], {"x": era5["t2m"]}, **kwargs)


def _exact(era5: dict[str, Any], batch: Any) -> bool:
    return bool(np.array_equal(batch["x"], era5["oracle"][batch.sample_indices["x"]]))


def _two_threads(
    era5: dict[str, Any], pipe: Any
) -> tuple[list[list[tuple[int, int, bool]]], list[BaseException | None], bool]:
    """Two threads each running ``for batch in pipe``: per thread ``(epoch, index, exact)`` of
    each batch, what each raised, and whether one was still running after ``_JOIN_S``."""
    got: list[list[tuple[int, int, bool]]] = [[], []]
    errors: list[BaseException | None] = [None, None]

    # both take their iterator before either reads (``iter`` of an ended pipeline starts the
    # next epoch: a thread started after the other ended the epoch would run one of its own)
    both = threading.Barrier(2)

    def consume(i: int) -> None:
        try:
            batches = iter(pipe)
            both.wait(_JOIN_S)
            for batch in batches:
                got[i].append((batch.epoch, batch.index, _exact(era5, batch)))
        except BaseException as exc:  # reported to the test
            errors[i] = exc

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_JOIN_S)
    return got, errors, any(thread.is_alive() for thread in threads)


def test_two_threads_iterating_one_pipeline_share_its_epoch_each_batch_once_and_both_end(
    era5: dict[str, Any],
) -> None:
    # before: both threads started a producer of their own: batches were duplicated or lost
    # (5 of 16 delivered, (0, 2) twice), KeyError(('t2m', 5)) from the fetch stage, and the
    # thread that did not take the producer's one "end" message waited forever - close() did
    # not wake it either
    for trial in range(6):
        pipe = _pipe(era5, shuffle=False)
        if trial % 2:
            pipe.reset()  # else both threads' first next() resets it lazily
        got, errors, hung = _two_threads(era5, pipe)
        pipe.close()
        assert not hung, f"trial {trial}: a thread hangs"
        delivered = sorted(row[:2] for rows in got for row in rows)
        assert all(row[2] for rows in got for row in rows), f"trial {trial}: rows not zarr's"
        if any(isinstance(err, PipelineInterrupted) for err in errors):
            # both threads' first next() reset it (the lazy reset of BaseNode): the second reset
            # interrupts the first loop, saying so; nothing is delivered twice
            assert len(set(delivered)) == len(delivered), f"trial {trial}: {delivered}"
            continue
        assert errors == [None, None], f"trial {trial}: {errors}"
        assert delivered == [(0, i) for i in range(len(pipe))], f"trial {trial}: {delivered}"


def test_a_chunk_that_fails_raises_in_every_thread_iterating_the_pipeline(
    era5: dict[str, Any],
) -> None:
    # before: the thread that took the producer's one "error" message raised it and the other
    # waited in next() forever
    stored = era5["root"] / "t2m" / "c" / "5" / "0" / "0"
    good = stored.read_bytes()
    stored.write_bytes(b"not zstd")
    try:
        for _ in range(2):
            pipe = _pipe(era5, shuffle=False)
            pipe.reset()
            got, errors, hung = _two_threads(era5, pipe)
            pipe.close()
            assert not hung
            assert all(isinstance(err, ChunkReadError) for err in errors), errors
            delivered = sorted(row[1] for rows in got for row in rows)
            assert delivered == list(range(10)) and all(row[2] for rows in got for row in rows)
    finally:
        stored.write_bytes(good)


def test_a_pipeline_dropped_without_close_does_not_keep_its_cache_dir_from_the_next_cell(
    era5: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a writer (or reader) left unreferenced, not closed, held cache_dir until Python
    # happened to collect it (a pipeline lives in reference cycles): the next cell's pipeline
    # of the other kind raised CacheBusyError saying "close its other pipeline", which nobody
    # could any more; now the builder collects this process's garbage and waits (at most 2 s)
    cache = tmp_path / "cache"
    for first, then in (({"persist": True}, {"readonly_cache": True}),
                        ({"readonly_cache": True}, {"persist": True})):  # fmt: skip
        for iterated in (True, False):
            pipe = _pipe(era5, cache_dir=cache, **first)
            if iterated:
                next(pipe)
            pipe = None  # re-running the cell: the old pipeline is only unreferenced
            pipe = _pipe(era5, cache_dir=cache, shuffle=False, **then)
            with pipe:
                assert all(_exact(era5, batch) for batch in pipe)
            del pipe
    # a pipeline still referenced (here by a generator over it) keeps it, and the message says
    # what may hold it (after waiting, shortened here, for a release that does not come)
    monkeypatch.setattr(cache_lock, "PENDING_WAIT_S", 0.2)
    kept = _pipe(era5, cache_dir=cache, persist=True)
    rows = (batch for batch in kept)
    next(rows)
    del kept
    with pytest.raises(CacheBusyError, match=r"this process.*generator"):
        _pipe(era5, cache_dir=cache, readonly_cache=True)
    rows.close()


def test_pipelines_dropped_without_close_give_their_threads_and_memory_back_at_the_next_build(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a pipeline lives in reference cycles, so one rebound without close() kept its
    # prefetch thread, pool and batch buffers until a full collection happened to run: 20
    # builds of a cell left 11 alive (10 threads, 240 MB more at 2 MiB per batch). Now a build
    # collects garbage while another pipeline of the process is alive. The worst case is made
    # deterministic here: no automatic collection at all. A build collects when the live
    # pipelines hold _runtime.COLLECT_DROPPED_ABOVE (64 MiB): these hold less, so it is lowered
    # (and a build under it runs no collection: a full one costs 0.1-0.3 s with torch imported)
    from insitubatch_nodes import _runtime

    collections: list[int] = []
    gc.disable()  # (only a collection the build runs is counted)
    gc.callbacks.append(lambda phase, info: collections.append(1) if phase == "start" else None)
    try:
        first = _pipe(era5)
        next(first)
        _pipe(era5).close()
    finally:
        del gc.callbacks[-1]
        gc.enable()
    assert not collections, "a build under the threshold collected garbage"
    first.close()
    del first
    monkeypatch.setattr(_runtime, "COLLECT_DROPPED_ABOVE", 1)
    gc.collect()
    alive: list[weakref.ref[Any]] = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        pipe = None
        for build in range(6):
            pipe = _pipe(era5)  # the old one is still bound while this one is built
            alive.append(weakref.ref(pipe))
            assert all(_exact(era5, next(pipe)) for _ in range(3))
            live = [ref for ref in alive if ref() is not None]
            assert len(live) <= 2, f"build {build}: {len(live)} pipelines alive"
            threads = [t for t in threading.enumerate() if t.name.startswith("insitu-prefetch")]
            assert len(threads) <= 2, f"build {build}: {[t.name for t in threads]}"
        batch = next(pipe)  # a batch kept after its pipeline is dropped stays valid
        rows = batch["x"].copy()
        pipe = None
        gc.collect()
        assert all(ref() is None for ref in alive)
        assert np.array_equal(batch["x"], rows) and _exact(era5, batch)
    finally:
        if was_enabled:
            gc.enable()


def test_ctrl_c_in_the_first_next_then_a_new_loop_starts_the_epoch_nothing_was_delivered_of(
    era5: dict[str, Any],
) -> None:
    # before: the producer had pulled plans of epoch 0 ahead, so the reset of the next loop
    # (iter(Loader(pipe)), pipe.reset()) took epoch 0 for begun and started epoch 1 - a run
    # whose first batch was interrupted in a notebook skipped an epoch, unlike a reset with
    # nothing delivered (docs: epochs advance on batches delivered)
    fresh = _pipe(era5)
    want = next(fresh).sample_indices["x"].copy()
    fresh.close()
    for how in ("loader", "reset"):
        entered, release = threading.Event(), threading.Event()

        def hold(batch: Any, entered: threading.Event = entered, release: Any = release) -> Any:
            entered.set()
            release.wait(_JOIN_S)
            return batch

        pipe = _pipe(era5, batch_transforms=[hold])
        ctrl_c = threading.Thread(target=lambda e=entered: e.wait(_JOIN_S) and _interrupt())
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            next(pipe)
        ctrl_c.join(_JOIN_S)
        release.set()
        if how == "loader":
            batch = next(iter(Loader(pipe)))
        else:
            pipe.reset()
            batch = next(pipe)
        pipe.close()
        assert (batch.epoch, batch.index) == (0, 0), how
        assert np.array_equal(batch.sample_indices["x"], want) and _exact(era5, batch)


def _interrupt() -> None:
    _thread.interrupt_main()


def test_close_gives_the_pool_back_also_with_decodes_in_flight_and_keeps_it_given_back(
    era5: dict[str, Any],
) -> None:
    # before: close() cleared the pool while fills were still inside a decode or a chunk
    # transform (which cannot be stopped); each one that ended afterwards put its chunk back
    # as resident, or its slot on the free list, so the memory close() says it gives back came
    # back: allocated_bytes 8,192-65,536 after close in 6 of 60 runs of the docs' own example,
    # and every time here, where a chunk transform is slow
    def slow(chunk: Any) -> Any:
        time.sleep(0.05)
        return chunk

    for _ in range(2):
        pipe = _pipe(era5, shuffle=False, chunk_transforms=[slow])
        first = next(pipe)
        pipe.close()
        pool = pipe.stages.pool
        assert (pool.allocated_bytes, pool.resident_keys()) == (0, [])
        time.sleep(0.2)  # any fill still running has ended by now
        assert (pool.allocated_bytes, pool.resident_keys()) == (0, [])
        assert _exact(era5, first) and _exact(era5, next(pipe))  # and it goes on after
        pipe.close()


def test_ctrl_c_while_next_starts_the_producer_then_a_new_loop_starts_the_epoch_at_its_first_batch(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: Ctrl-C that landed after the first next() had started its producer thread but
    # before it recorded it (a busy machine keeps the main thread off the CPU that long) left
    # a producer nobody could halt: the reset that followed reset the graph under it, and it
    # took the new epoch's first plans into a queue nobody reads - the next loop began at
    # batch (0, 2) (seen once under the full suite), and the thread stayed parked for good
    from insitubatch_nodes.stages import prefetch

    fresh = _pipe(era5)
    want = next(fresh).sample_indices["x"].copy()
    fresh.close()
    start = prefetch._Worker.start
    for how in ("loader", "reset"):
        entered, release = threading.Event(), threading.Event()

        def hold(batch: Any, entered: threading.Event = entered, release: Any = release) -> Any:
            entered.set()
            release.wait(_JOIN_S)
            return batch

        def start_then_ctrl_c(worker: Any, entered: threading.Event = entered) -> None:
            start(worker)  # the producer runs into its first batch, or waits to be recorded ...
            deadline = time.monotonic() + _JOIN_S
            while not (entered.is_set() or _waits_to_be_recorded(worker.thread)):
                assert time.monotonic() < deadline, "the producer neither ran nor waited"
                time.sleep(0.001)
            _interrupt()  # ... and Ctrl-C lands before next() has recorded it
            time.sleep(0)  # (the interrupt is raised at the next bytecode: here)

        pipe = _pipe(era5, batch_transforms=[hold])
        monkeypatch.setattr(prefetch._Worker, "start", start_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            next(pipe)
        monkeypatch.setattr(prefetch._Worker, "start", start)
        release.set()
        if how == "loader":
            batch = next(iter(Loader(pipe)))
        else:
            pipe.reset()
            batch = next(pipe)
        pipe.close()
        assert (batch.epoch, batch.index) == (0, 0), how
        assert np.array_equal(batch.sample_indices["x"], want) and _exact(era5, batch)
        for thread in pipe.threads:  # no producer left behind: each one ends
            thread.join(_JOIN_S)
        assert pipe.threads == [], how


def test_ctrl_c_as_next_hands_over_the_first_batch_then_a_new_loop_starts_the_epoch_at_it(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: next() took the batch's position for delivered before it finished handing the
    # batch over (the epoch report's bookkeeping ran in between), so a Ctrl-C landing there
    # counted a batch the loop never got, and the next loop started epoch 1
    fresh = _pipe(era5)
    want = next(fresh).sample_indices["x"].copy()
    fresh.close()
    for how in ("loader", "reset"):
        pipe = _pipe(era5)
        on_deliver = pipe.recorder.on_deliver

        def ctrl_c_then_deliver(*args: Any, _deliver: Any = on_deliver) -> None:
            _interrupt()  # lands in the hand-over's bookkeeping
            time.sleep(0)
            _deliver(*args)

        monkeypatch.setattr(pipe.recorder, "on_deliver", ctrl_c_then_deliver)
        with pytest.raises(KeyboardInterrupt):
            next(pipe)
        monkeypatch.setattr(pipe.recorder, "on_deliver", on_deliver)
        if how == "loader":
            batch = next(iter(Loader(pipe)))
        else:
            pipe.reset()
            batch = next(pipe)
        pipe.close()
        assert (batch.epoch, batch.index) == (0, 0), how
        assert np.array_equal(batch.sample_indices["x"], want) and _exact(era5, batch)


def _waits_to_be_recorded(thread: threading.Thread) -> bool:
    """Whether the prefetch stage's producer ``thread`` is parked before its first touch of
    the source, waiting for ``next()`` to record it (its ``_run`` on its ``go.wait`` line)."""
    import linecache
    import sys

    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None and frame.f_code.co_name != "_run":
        frame = frame.f_back
    if frame is None:
        return False
    return "go.wait(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


@pytest.mark.parametrize("where", ["take", "bookkeeping"])
def test_ctrl_c_after_next_took_a_batch_then_next_again_returns_that_batch_not_the_one_after(
    era5: dict[str, Any], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # before: once next() had taken a batch off the prefetch queue, a Ctrl-C that landed before
    # it returned the batch - inside the queue's get() (its wake-up of the producer), or in the
    # epoch report's bookkeeping - lost it: the state still said the batch was to come (a
    # reset resumed at it), but a next() called again without a reset went on with the producer
    # and silently skipped it - a notebook user's epoch missed a batch for each such Ctrl-C
    fresh = _pipe(era5)
    want = [next(fresh).sample_indices["x"].copy() for _ in range(3)]
    fresh.close()
    pipe = _pipe(era5)
    first = next(pipe)  # the producer runs: the interrupted next() takes a batch it queued
    armed = [True]

    def ctrl_c_once() -> None:
        if armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            _interrupt()
            time.sleep(0)  # (raised here)

    if where == "take":  # the wake-up of a producer waiting for room (also while nothing waits)
        room = pipe._worker.queue.not_full
        notify = room.notify

        def ctrl_c_then_notify(*args: Any) -> None:
            ctrl_c_once()
            notify(*args)

        monkeypatch.setattr(room, "notify", ctrl_c_then_notify)
    else:
        on_deliver = pipe.recorder.on_deliver

        def ctrl_c_then_deliver(*args: Any) -> None:
            ctrl_c_once()
            on_deliver(*args)

        monkeypatch.setattr(pipe.recorder, "on_deliver", ctrl_c_then_deliver)
    with pytest.raises(KeyboardInterrupt):
        next(pipe)
    assert not armed[0]
    state = pipe.state_dict()
    got = [first, next(pipe), next(pipe)]  # no reset
    pipe.close()
    assert [(b.epoch, b.index) for b in got] == [(0, 0), (0, 1), (0, 2)]
    assert all(np.array_equal(b.sample_indices["x"], w) for b, w in zip(got, want, strict=True))
    assert all(_exact(era5, b) for b in got)
    restored = _pipe(era5)  # the state taken after the Ctrl-C resumes at that batch too
    restored.reset(state)
    again = next(restored)
    restored.close()
    assert (again.epoch, again.index) == (0, 1)
    assert np.array_equal(again.sample_indices["x"], want[1]) and _exact(era5, again)
