"""The persistent cache under a demanding user (the cache trial of 2026-12-06): one cache_dir
filled by one pipeline and read by another whose store changed in a way the first did not
expect. Each test proves a before/after behaviour found by the trial; zarr's own read of the
store is the oracle, and the counts are the pipeline's GETs (``pipe.stats()``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.cache.identity import IDENTITY_NAME
from insitubatch_nodes.errors import StaleCacheError

pytestmark = pytest.mark.timeout(60)


def _write(root: Path, chunks: tuple[int, ...], seed: int, name: str = "t2m") -> np.ndarray:
    values = np.random.default_rng(seed).random((8, 4, 4)).astype("f4")
    array = zarr.create_array(root, name=name, shape=values.shape, chunks=chunks, dtype="f4",
                              dimension_names=("time", "lat", "lon"), overwrite=True)  # fmt: skip
    array[...] = values
    return values


def _epoch(
    root: Path, cache: Path, want: np.ndarray, name: str = "t2m", **kw: Any
) -> dict[str, int]:
    """One epoch of array ``name`` over the persistent cache (``persist=True`` unless ``kw``
    says ``readonly_cache=True``), every row checked against ``want``; the stats."""
    geom = open_geometries(root, mask_and_scale=kw.pop("mask_and_scale", True))[name]
    kw.setdefault("persist", not kw.get("readonly_cache", False))
    pipe = insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), {name: geom}, batch_size=4,
                           coords=(), cache_dir=cache, **kw)  # fmt: skip
    try:
        seen = []
        for batch in Loader(pipe):
            np.testing.assert_array_equal(batch[name], want[batch.sample_indices[name]])
            seen += batch.sample_indices[name].tolist()
        assert sorted(seen) == list(range(len(want)))
        return pipe.stats()
    finally:
        pipe.close()


def test_a_cache_rebuilt_after_the_store_was_rechunked_is_warm_on_the_next_run(
    tmp_path: Path,
) -> None:
    """Before: the identity rows of the old chunking's objects (``t2m/c/0/1/0``, gone after the
    rewrite) stayed attached to the rebuilt chunks, so every later run found them "deleted",
    warned and fetched those chunks again, forever. After: a chunk's rows are those of its
    last commit, and the run after the rebuild reads nothing."""
    root, cache = tmp_path / "s.zarr", tmp_path / "cache"
    first = _write(root, (4, 2, 4), seed=0)  # two stored objects per chunk
    assert _epoch(root, cache, first)["gets"] == 4
    second = _write(root, (4, 4, 4), seed=1)  # one object per chunk: c/i/1/0 deleted
    assert _epoch(root, cache, second, reset_stale_cache=True)["gets"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = _epoch(root, cache, second)
    assert stats["gets"] == 0 and stats["disk_hits"] == 2
    # rows of a cache warmed before commits were recorded (7 columns) still vouch for chunks
    rows = [json.loads(r) for r in (cache / IDENTITY_NAME).read_text().splitlines()]
    run = rows[-1][-1].split(".")[0]  # the rebuilding run's rows (commit tokens "run.n")
    latest = [r[:7] for r in rows if r[-1].split(".")[0] == run]
    (cache / IDENTITY_NAME).write_text("".join(json.dumps(r) + "\n" for r in latest))
    assert _epoch(root, cache, second)["gets"] == 0


def test_a_reader_of_one_store_is_not_refused_for_chunks_another_store_cached_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One cache_dir shared by pipelines over two stores (a collection and a single store, an
    archive and a scratch store). Before: building a pipeline checked every array the
    directory held against its own store, so the chunks of ``a/t2m`` (which the pipeline over
    ``b`` never reads) were "deleted": a writer warned about them, and a read-only reader of
    ``b`` raised StaleCacheError telling it to warm the cache again, which could not help.
    After: only the arrays the pipeline reads are checked against its store."""
    a, b, cache = tmp_path / "a.zarr", tmp_path / "b.zarr", tmp_path / "cache"
    in_a = _write(a, (4, 4, 4), seed=0)
    in_b = _write(b, (4, 4, 4), seed=1, name="u")
    assert _epoch(a, cache, in_a)["gets"] == 2
    with caplog.at_level("WARNING", logger="insitubatch_nodes.cache"):
        assert _epoch(b, cache, in_b, name="u")["gets"] == 2
    assert "stale" not in caplog.text
    assert _epoch(b, cache, in_b, name="u", readonly_cache=True)["gets"] == 0
    assert _epoch(a, cache, in_a, readonly_cache=True)["gets"] == 0


def test_two_pipelines_of_one_process_caching_an_array_otherwise_are_refused_one_cache_dir(
    tmp_path: Path,
) -> None:
    """Two pipelines of one process over one cache_dir, both built before either wrote, that
    cache ``t2m`` otherwise (here decoded and raw, both float32: ``_FillValue = -9999``). Before:
    both were built, each wrote its chunks under the same file names over the other's, and the
    first served the second's raw -9999s for its NaNs from its next epoch on (silently with
    ``verify_cache=False``; as a "corrupt" file, fetched again and again, with it). After:
    building the second raises StaleCacheError naming the array; once the first is closed it
    builds, and reads what it should."""
    root, cache = tmp_path / "s.zarr", tmp_path / "cache"
    values = np.random.default_rng(2).random((8, 4, 4)).astype("f4")
    values[:, 0, 0] = -9999.0
    array = zarr.create_array(root, name="t2m", shape=values.shape, chunks=(4, 4, 4), dtype="f4",
                              dimension_names=("time", "lat", "lon"),
                              attributes={"_FillValue": -9999.0})  # fmt: skip
    array[...] = values
    decoded, raw = open_geometries(root)["t2m"], open_geometries(root, mask_and_scale=False)["t2m"]
    assert decoded.dtype == raw.dtype == np.float32

    def build(geom: Any) -> Any:
        return insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"t2m": geom},
                               coords=(), cache_dir=cache, persist=True)  # fmt: skip

    first = build(decoded)
    try:
        with pytest.raises(StaleCacheError, match=r"'t2m'.*close"):
            build(raw)
    finally:
        first.close()
    assert _epoch(root, cache, values, reset_stale_cache=True, mask_and_scale=False)["gets"] == 2


def test_two_pipelines_of_one_process_over_two_stores_are_refused_one_cache_dir(
    tmp_path: Path,
) -> None:
    """Two pipelines of one process over one cache_dir, reading ``t2m`` of two stores of one
    schema (a training and a validation store). Before: the second picked up the first's
    chunks from the shared log as they landed — same array path, same fingerprint, never
    checked against its own store — and delivered store a's values as store b's, checksums
    and all (every batch wrong, by default). After: building the second raises
    StaleCacheError naming the array and both stores; the same store opened another way (a
    path and a zarr LocalStore of it) still shares the directory."""
    a, b, cache = tmp_path / "a.zarr", tmp_path / "b.zarr", tmp_path / "cache"
    in_a, in_b = _write(a, (4, 4, 4), seed=0), _write(b, (4, 4, 4), seed=1)

    def build(store: Any) -> Any:
        geom = open_geometries(store)["t2m"]
        return insitu_pipeline(store, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"t2m": geom},
                               coords=(), cache_dir=cache, persist=True)  # fmt: skip

    first = build(a)
    try:
        with pytest.raises(StaleCacheError, match=r"'t2m'.*b\.zarr.*close"):
            build(b)
        build(zarr.storage.LocalStore(a, read_only=True)).close()  # the same objects
    finally:
        first.close()
    assert _epoch(b, cache, in_b)["gets"] == 2  # one after the other: each checked, right
    assert _epoch(a, cache, in_a)["gets"] == 2  # (b's files replaced a's: one name per chunk)


def test_a_chunk_whose_cache_checksum_fails_raises_from_next_instead_of_hanging_the_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The checksum of a new cache file is taken on a decode thread once its chunk is complete.
    # An error there (the decode trial's: numpy refused a datetime64 chunk's buffer) skipped the
    # end of its fill job when that chunk was the job's last: the producer waited for the job
    # forever, and next() never returned (4 of 4 runs with one chunk per batch).
    import threading

    import insitubatch_nodes.cache.directory as directory

    _write(tmp_path / "s.zarr", (2, 4, 4), seed=1)
    geom = open_geometries(tmp_path / "s.zarr")["t2m"]

    def broken(array: np.ndarray) -> str:
        raise ValueError("checksum refused")

    monkeypatch.setattr(directory, "content_sum", broken)
    pipe = insitu_pipeline(tmp_path / "s.zarr", split_by_chunk(geom, (1.0, 0.0, 0.0)),
                           {"t2m": geom}, batch_size=2, coords=(), cache_dir=tmp_path / "cache",
                           persist=True)  # fmt: skip
    raised: list[BaseException] = []

    def epoch() -> None:
        try:
            for _ in Loader(pipe):
                pass
        except Exception as exc:
            raised.append(exc)

    thread = threading.Thread(target=epoch, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the epoch hung on a failed checksum"
    pipe.close()
    assert raised and "checksum refused" in repr(raised[0]) + repr(raised[0].__cause__), raised
