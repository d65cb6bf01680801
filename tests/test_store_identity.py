"""Store identity: a persisted cache is checked against the store it came from before reuse.

Each test warms a cache over a real zarr store (on disk, or in a moto S3 bucket), then changes
the store from outside the package — rewrites chunks through zarr, deletes an object, writes one
where there was none, appends samples — and checks what a later run gets: the new values
(zarr's own read of the changed store is the oracle) with only the changed chunks fetched, or a
``StaleCacheError`` naming the objects for a read-only reader.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import Oracle, View, counting_store, run_epoch, write_era5

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.cache.identity import (
    IDENTITY_NAME,
    HeadLister,
    IdentityRecorder,
    lister_for,
    read_identities,
)
from insitubatch_nodes.errors import StaleCacheError

pytestmark = pytest.mark.timeout(120)

VIEWS = {"t2m": View("t2m"), "z": View("z")}
SPC = 8  # samples per chunk of write_era5's store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """t2m (96, 8, 16) and z (96, 2, 8, 16), 8 samples per chunk (12 chunks); a fresh copy per
    test, since the tests change it."""
    return write_era5(tmp_path / "era5.zarr")


def pipeline(store: Any, cache_dir: Path, **kw: Any) -> Any:
    store = open_store(str(store)) if isinstance(store, Path) else store
    geoms = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    kw.setdefault("persist", not kw.get("readonly_cache", False))
    return insitu_pipeline(
        store, manifest, ["t2m", "z"], batch_size=8, block_chunks=4, cache_dir=cache_dir, **kw
    )


def run(pipe: Any, oracle: Oracle | None) -> dict[str, int]:
    """One epoch, every batch checked against ``oracle``; the pool's counters after it."""
    try:
        run_epoch(pipe, oracle, VIEWS if oracle is not None else None)
        return pipe.stats()
    finally:
        pipe.close()


def rewrite(root: Path, name: str, chunks: list[int], delta: float = 100.0) -> None:
    """New values in ``chunks`` of array ``name``, same shape, written by zarr."""
    array = zarr.open_array(root / name, mode="r+")
    for c in chunks:
        array[c * SPC : (c + 1) * SPC] = array[c * SPC : (c + 1) * SPC] + delta


def test_a_store_rewritten_after_warming_serves_the_new_values_refetching_only_what_changed(
    root: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    run(pipeline(root, cache), Oracle(root))
    rewrite(root, "t2m", [1, 5])
    pipe = pipeline(root, cache)
    stats = run(pipe, Oracle(root))  # zarr's read of the rewritten store
    assert stats["gets"] == 2  # the two rewritten objects, nothing else
    assert pipe.stages.pool.cache.stats["stale_chunks"] == 2
    assert stats["disk_hits"] == 2 * 12 - 2
    # the refetched chunks were rewritten with their new identity: the next run trusts them
    again = run(pipeline(root, cache), Oracle(root))
    assert again["gets"] == 0


@pytest.mark.parametrize(
    "layout", [{"zarr_format": 2}, {"shard_samples": 16}], ids=["v2", "sharded"]
)
def test_a_rewritten_v2_or_sharded_store_is_refetched_where_it_changed(
    tmp_path: Path, layout: dict[str, Any]
) -> None:
    root = write_era5(tmp_path / "era5.zarr", **layout)
    cache = tmp_path / "cache"
    run(pipeline(root, cache), Oracle(root))
    rewrite(root, "t2m", [1])  # one stored object: chunk 1, or the shard holding it
    stats = run(pipeline(root, cache), Oracle(root))
    assert stats["gets"] == 1


def test_a_readonly_reader_of_a_rewritten_store_raises_naming_the_changed_objects(
    root: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    run(pipeline(root, cache), None)
    rewrite(root, "t2m", [3])
    with pytest.raises(StaleCacheError) as info:
        pipeline(root, cache, readonly_cache=True)
    message = str(info.value)
    assert "1 chunk(s)" in message and "'t2m/c/3/0/0' changed" in message
    assert "check_store=False" in message and "readonly_cache=False" in message
    rewrite(root, "z", list(range(12)))  # every z object (2 per chunk): named by the first few
    with pytest.raises(StaleCacheError, match=r"13 chunk\(s\).*and 20 more"):
        pipeline(root, cache, readonly_cache=True)


def test_a_deleted_object_and_a_new_one_are_stale_for_a_reader_and_refetched_by_a_writer(
    root: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    (root / "t2m" / "c" / "4" / "0" / "0").unlink()  # chunk 4 is the fill value when warmed
    run(pipeline(root, cache), Oracle(root))
    rewrite_from = np.asarray(zarr.open_array(root / "t2m")[:SPC])
    zarr.open_array(root / "t2m", mode="r+")[4 * SPC : 5 * SPC] = rewrite_from + 1.0  # new
    (root / "t2m" / "c" / "9" / "0" / "0").unlink()  # deleted: the fill value from now on
    with pytest.raises(StaleCacheError) as info:
        pipeline(root, cache, readonly_cache=True)
    message = str(info.value)
    assert "'t2m/c/4/0/0' new" in message and "'t2m/c/9/0/0' deleted" in message
    stats = run(pipeline(root, cache), Oracle(root))
    assert stats["gets"] == 2
    values = np.asarray(zarr.open_array(root / "t2m")[9 * SPC : 10 * SPC])
    assert np.isnan(values).all()  # the oracle did read the deletion as the fill value


def test_an_append_along_the_sample_axis_fetches_the_new_and_grown_chunks_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    root = write_era5(tmp_path / "era5.zarr", n_time=92)  # 12 chunks, the last holds 4
    cache = tmp_path / "cache"
    run(pipeline(root, cache), Oracle(root))
    for name in ("t2m", "z"):
        array = zarr.open_array(root / name, mode="r+")
        tail = np.asarray(array[84:92])
        array.resize((100, *array.shape[1:]))
        array[92:100] = tail + 1.0  # chunk 11 grows to 8 samples, chunk 12 is new
    time = zarr.open_array(root / "time", mode="r+")  # (appended too: a store's coordinate
    steps = np.asarray(time[:])  # of another length than its arrays is refused)
    time.resize((100,))
    time[92:100] = steps[-1] + (steps[1] - steps[0]) * np.arange(1, 9)
    pipe = pipeline(root, cache)
    assert pipe.stages.pool.cache.stats["stale_chunks"] == 2  # chunk 11's rewritten objects
    stats = run(pipe, Oracle(root))
    n_tiles = 1 + 2  # t2m one object per chunk, z one per level
    assert stats["gets"] == 2 * n_tiles  # chunks 11 and 12 of both arrays
    assert stats["disk_hits"] == 2 * 11  # chunks 0-10 of both arrays, kept


def test_each_ranks_directory_is_checked_and_a_rank_refetches_what_another_rank_cached(
    root: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"

    def ranks(**kw: Any) -> list[dict[str, int]]:  # rank 0, then rank 1, of a 2-rank job
        return [
            run(pipeline(root, cache, rank=r, world_size=2, **kw), Oracle(root)) for r in (0, 1)
        ]

    ranks()
    assert (cache / "rank-1" / IDENTITY_NAME).stat().st_size > 0
    rewrite(root, "t2m", list(range(12)))  # chunks cached by both ranks
    with pytest.raises(StaleCacheError, match=r"12 chunk\(s\)"):
        pipeline(root, cache, readonly_cache=True, rank=1, world_size=2)
    assert sum(s["gets"] for s in ranks()) == 12  # each changed object fetched once
    assert sum(s["gets"] for s in ranks(readonly_cache=True)) == 0


def test_check_store_false_trusts_the_cache_of_a_store_known_not_to_change(
    root: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    before = tmp_path / "before.zarr"
    shutil.copytree(root, before)
    run(pipeline(root, cache), None)
    rewrite(root, "t2m", [2])
    stats = run(pipeline(root, cache, check_store=False), Oracle(before))  # the cached values
    assert stats["gets"] == 0
    run(pipeline(root, cache, readonly_cache=True, check_store=False), Oracle(before))
    with pytest.raises(TypeError, match="check_store"):
        pipeline(root, cache, check_store="no")
    with pytest.raises(ValueError, match="check_store=False needs"):
        pipeline(root, None, check_store=False, persist=False)  # type: ignore[arg-type]


def test_a_cache_without_recorded_identities_is_refetched_by_a_writer_and_refused_by_a_reader(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    run(pipeline(root, cache), None)
    (cache / IDENTITY_NAME).unlink()  # as warmed by a version that did not record
    with pytest.raises(StaleCacheError, match="no recorded store identity"):
        pipeline(root, cache, readonly_cache=True)
    with caplog.at_level(logging.WARNING, logger="insitubatch_nodes.cache"):
        stats = run(pipeline(root, cache), Oracle(root))
    assert stats["gets"] == 12 * 3 and "24 cached chunk(s)" in caplog.text
    assert run(pipeline(root, cache, readonly_cache=True), Oracle(root))["gets"] == 0


def test_a_store_rewritten_behind_a_wrapper_store_serves_the_new_values(
    root: Path, tmp_path: Path
) -> None:
    """A zarr WrapperStore (here one counting GETs) over a local folder is checked as that
    folder: before, the cache was trusted with a warning and served the old values."""
    cache = tmp_path / "cache"
    run(pipeline(counting_store(root), cache), Oracle(root))
    rewrite(root, "t2m", [0, 7])
    with pytest.raises(StaleCacheError, match=r"'t2m/c/0/0/0' changed"):
        pipeline(counting_store(root), cache, readonly_cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked, not trusted with a warning
        pipe = pipeline(counting_store(root), cache)
    stats = run(pipe, Oracle(root))  # zarr's read of the rewritten store
    assert stats["gets"] == 2 and pipe.stages.pool.cache.stats["stale_chunks"] == 2
    assert run(pipeline(counting_store(root), cache), Oracle(root))["gets"] == 0


def test_a_store_whose_objects_cannot_be_identified_is_refused_for_a_persistent_cache(
    root: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    from helpers import CountingStore
    from obstore.store import HTTPStore
    from zarr.storage import ObjectStore

    http = ObjectStore(HTTPStore.from_url("http://127.0.0.1:9/"), read_only=True)
    assert isinstance(lister_for(http), HeadLister)  # checked object by object (test_http_store)
    assert isinstance(lister_for(CountingStore(http)), HeadLister)  # unwrapped
    unidentifiable = zarr.storage.FsspecStore.from_url(f"file://{root}", read_only=True)
    with pytest.raises(ValueError, match=r"check_store=False.*known not to change"):
        pipeline(unidentifiable, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the opt-out, knowingly: no warning either
        run(pipeline(unidentifiable, cache, check_store=False), Oracle(root))


@pytest.mark.xdist_group("s3")
def test_an_object_rewritten_on_s3_is_refetched_and_a_readonly_reader_names_it(
    root: Path,
    tmp_path: Path,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
    s3_client: Any,
) -> None:
    url = s3_upload(root, "data/era5.zarr")
    bucket, prefix = url[len("s3://") :].split("/", 1)
    cache = tmp_path / "cache"
    run(pipeline(open_store(url, **s3_options), cache), Oracle(root))
    rewrite(root, "t2m", [6])
    key = "t2m/c/6/0/0"
    client = s3_client
    client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=(root / key).read_bytes())
    with pytest.raises(StaleCacheError, match=rf"1 chunk\(s\).*'{key}' changed"):
        pipeline(open_store(url, **s3_options), cache, readonly_cache=True)
    remote = open_store(url, **s3_options)
    stats = run(pipeline(remote, cache), Oracle(remote))  # zarr's read of the bucket
    assert stats["gets"] == 1
    # the same bytes uploaded again: a new last-modified, the same ETag — still valid
    client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=(root / key).read_bytes())
    assert run(pipeline(open_store(url, **s3_options), cache), None)["gets"] == 0


@pytest.mark.parametrize("wrapped", [False, True], ids=["folder", "wrapper"])
def test_a_local_object_rewritten_in_place_with_the_same_size_is_refetched(
    tmp_path: Path, wrapped: bool
) -> None:
    """``cp new old`` (and any writer that truncates and writes) keeps a file's inode and, for an
    uncompressed chunk, its size: only the mtime says it changed. Before, a local folder's
    objects were compared by size and inode alone, and the old values were served."""
    root = tmp_path / "plain.zarr"
    group = zarr.open_group(root, mode="w")
    array = group.create_array(
        "t2m", shape=(16, 3), chunks=(4, 3), dtype="<f4", compressors=None,
        dimension_names=["time", "x"],
    )  # fmt: skip
    array[:] = np.arange(48, dtype="<f4").reshape(16, 3)
    cache = tmp_path / "cache"

    def epoch() -> tuple[np.ndarray, dict[str, int]]:
        store = counting_store(root) if wrapped else open_store(str(root))
        g = open_geometries(store, ["t2m"])["t2m"]
        manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
        with insitu_pipeline(
            store, manifest, {"x": g}, batch_size=4, shuffle=False, cache_dir=cache,
            persist=True, coords=(),
        ) as pipe:  # fmt: skip
            rows = np.concatenate([b.arrays["x"] for b in Loader(pipe)])
            return rows, pipe.stats()

    epoch()
    key = root / "t2m" / "c" / "2" / "0"
    before = key.stat()
    with open(key, "r+b") as f:  # in place: same inode, same size, new bytes
        f.write((np.arange(12, dtype="<f4") + 1000).tobytes())
    os.utime(key, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # a second later
    after = key.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    rows, stats = epoch()
    np.testing.assert_array_equal(rows, zarr.open_array(root / "t2m", mode="r")[:])
    assert stats["gets"] == 1
    assert epoch()[1]["gets"] == 0  # refetched with its new identity: trusted again


def _commit(recorder: IdentityRecorder, chunk: int, objects: int) -> None:
    """Record chunk ``chunk`` of ``"t2m"`` as read from ``objects`` stored objects."""
    recorder.expect(("t2m", chunk))
    for k in range(objects):
        recorder.note("t2m", chunk, f"t2m/c/{chunk}/{k}", (100 + k, f"tag{chunk}.{k}", 7))
    recorder.commit(("t2m", chunk))


def test_a_torn_identity_row_is_cut_off_when_the_writer_opens_its_directory(
    tmp_path: Path,
) -> None:
    # before: a row cut short by a crash stayed at the file's end, and the next writer's first
    # row was appended to it: one line that does not parse, so that chunk's rows were lost
    recorder = IdentityRecorder(tmp_path, "local")
    _commit(recorder, 0, 3)
    recorder.close()
    path = tmp_path / IDENTITY_NAME
    whole = path.read_bytes()
    with open(path, "ab") as fh:  # a crash in the middle of chunk 1's row
        fh.write(b'["t2m",1,"t2m/c/1/0",10')
    recorder = IdentityRecorder(tmp_path, "local")
    _commit(recorder, 2, 2)
    recorder.close()
    assert path.read_bytes().startswith(whole)
    got = read_identities(tmp_path)["t2m"]
    rows = zip(got.chunks.tolist(), got.keys.tolist(), got.sizes.tolist(), strict=True)
    assert sorted(rows) == [
        (0, "t2m/c/0/0", 100), (0, "t2m/c/0/1", 101), (0, "t2m/c/0/2", 102),
        (2, "t2m/c/2/0", 100), (2, "t2m/c/2/1", 101),
    ]  # fmt: skip
    for line in path.read_text().splitlines():  # every line a row
        assert json.loads(line)[0] == "t2m"
