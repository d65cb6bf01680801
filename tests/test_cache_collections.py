"""A persistent cache over a collection whose members live in several stores (read through a
``RoutingStore``): each stored object is identified by the store it is routed to, so a warm
cache is checked — not trusted — and a changed object in any member store is read again.

The oracle is zarr's own read of each member's store, after every change; the counts are the
pipeline's own GETs and disk hits (``pipe.stats()``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, write_era5

from insitubatch_nodes import Collection, Loader, insitu_pipeline, open_store, split_by_member
from insitubatch_nodes.cache.identity import RoutedLister, lister_for
from insitubatch_nodes.errors import StaleCacheError
from insitubatch_nodes.io.routing import RoutingStore

pytestmark = pytest.mark.timeout(120)

SPC = 8  # samples per chunk of write_era5's stores
LENGTHS = (32, 24)  # member a: 4 chunks, member b: 3 chunks


@pytest.fixture
def roots(tmp_path: Path) -> list[Path]:
    return [write_era5(tmp_path / f"era5_{m}.zarr", n_time=n) for m, n in enumerate(LENGTHS)]


def _collection(items: list[Any]) -> Collection:
    coll = Collection.from_arrays(items, names=["a", "b"])
    assert isinstance(coll.store, RoutingStore) and len(coll.store.stores) == 2
    return coll


def _pipeline(coll: Collection, cache: Path, **kw: Any) -> Any:
    kw.setdefault("persist", not kw.get("readonly_cache", False))
    manifest = split_by_member(coll, {"train": 1.0})
    return insitu_pipeline(coll, manifest, {"x": coll["data"]}, batch_size=5, block_chunks=2,
                           seed=3, cache_dir=cache, **kw)  # fmt: skip


def _epoch(pipe: Any, roots: list[Path]) -> dict[str, int]:
    """One epoch, every row checked against zarr's read of its member's store now; the
    pipeline's counters after it."""
    oracles = [np.asarray(zarr.open_array(r / "t2m", mode="r")[...]) for r in roots]
    seen = []
    try:
        for batch in Loader(pipe):
            for r in range(len(batch)):
                m, i = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                np.testing.assert_array_equal(batch["x"][r], oracles[m][i])
                seen.append((m, i))
        stats = pipe.stats()
    finally:
        pipe.close()
    assert sorted(seen) == [(m, i) for m, n in enumerate(LENGTHS) for i in range(n)]
    return stats


def _rewrite(root: Path, chunk: int) -> None:
    array = zarr.open_array(root / "t2m", mode="r+")
    array[chunk * SPC : (chunk + 1) * SPC] = array[chunk * SPC : (chunk + 1) * SPC] + 100.0


CHUNKS = sum(n // SPC for n in LENGTHS)


def test_a_second_pipeline_over_a_warm_cache_of_several_stores_reads_no_object(
    roots: list[Path], tmp_path: Path
) -> None:
    """Before, such a cache needed check_store=False: the store check could not identify a
    RoutingStore's objects, and construction raised."""
    cache = tmp_path / "cache"
    items = [(str(r), "t2m") for r in roots]
    first = _epoch(_pipeline(_collection(items), cache), roots)
    assert first["gets"] == CHUNKS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked, not trusted with a warning
        pipe = _pipeline(_collection(items), cache)
    assert isinstance(pipe.stages.pool.cache.store_check.lister, RoutedLister)
    again = _epoch(pipe, roots)
    assert again["gets"] == 0 and again["disk_hits"] == CHUNKS


@pytest.mark.parametrize("wrapped", [False, True], ids=["folders", "wrapped-folders"])
def test_an_object_rewritten_in_one_member_store_is_read_again_and_only_it(
    roots: list[Path], tmp_path: Path, wrapped: bool
) -> None:
    cache = tmp_path / "cache"

    def items() -> list[Any]:
        if wrapped:  # a zarr WrapperStore over each folder: checked as the folder it wraps
            return [(counting_store(r), "t2m") for r in roots]
        return [(str(r), "t2m") for r in roots]

    _epoch(_pipeline(_collection(items()), cache), roots)
    _rewrite(roots[1], 2)  # member b's last chunk, in the second store
    with pytest.raises(StaleCacheError, match=r"1 chunk\(s\).*'s1/t2m/c/2/0/0' changed"):
        _pipeline(_collection(items()), cache, readonly_cache=True)
    pipe = _pipeline(_collection(items()), cache)
    stats = _epoch(pipe, roots)  # zarr's read of the rewritten store
    assert stats["gets"] == 1 and pipe.stages.pool.cache.stats["stale_chunks"] == 1
    assert stats["disk_hits"] == CHUNKS - 1
    _rewrite(roots[0], 0)  # and one in the first store
    pipe = _pipeline(_collection(items()), cache)
    stats = _epoch(pipe, roots)
    assert stats["gets"] == 1 and pipe.stages.pool.cache.stats["stale_chunks"] == 1
    assert _epoch(_pipeline(_collection(items()), cache), roots)["gets"] == 0


def test_a_member_store_that_cannot_be_identified_is_refused_naming_it(
    roots: list[Path], tmp_path: Path
) -> None:
    from zarr.core.buffer import cpu

    files = [f for f in (roots[1] / "t2m").rglob("*") if f.is_file()]  # the same array's bytes
    memory = zarr.storage.MemoryStore(
        {str(f.relative_to(roots[1])): cpu.Buffer.from_bytes(f.read_bytes()) for f in files}
    )
    coll = _collection([(str(roots[0]), "t2m"), (memory, "t2m")])
    why = lister_for(coll.store)
    assert isinstance(why, str) and why.startswith("routed store s1 (") and "MemoryStore" in why
    with pytest.raises(ValueError, match=r"routed store s1 .*MemoryStore.*check_store=False"):
        _pipeline(coll, tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the opt-out, knowingly: no warning either
        pipe = _pipeline(coll, tmp_path / "cache", check_store=False)
    assert _epoch(pipe, roots)["gets"] == CHUNKS


@pytest.mark.xdist_group("s3")
def test_a_collection_of_a_folder_and_an_s3_bucket_is_checked_store_by_store(
    roots: list[Path],
    tmp_path: Path,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
    s3_client: Any,
) -> None:
    """Member b lives in a (moto) S3 bucket: its identities are the GETs' own size, ETag and
    last-modified, listed with obstore; member a's a local file's stat."""
    url = s3_upload(roots[1], "data/b.zarr")
    bucket, prefix = url[len("s3://") :].split("/", 1)

    def coll() -> Collection:
        return _collection([(str(roots[0]), "t2m"), (open_store(url, **s3_options), "t2m")])

    cache = tmp_path / "cache"
    assert _epoch(_pipeline(coll(), cache), roots)["gets"] == CHUNKS
    pipe = _pipeline(coll(), cache)
    # the read paths, and after "@" a digest of the stores the rows were read from
    assert pipe.stages.pool.cache.store_check.kind.split("@")[0] == "routed:local,obstore"
    assert _epoch(pipe, roots)["gets"] == 0
    _rewrite(roots[1], 1)  # the local copy is the oracle; the bucket gets its bytes
    key = "t2m/c/1/0/0"
    client = s3_client
    client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=(roots[1] / key).read_bytes())
    with pytest.raises(StaleCacheError, match=rf"1 chunk\(s\).*'s1/{key}' changed"):
        _pipeline(coll(), cache, readonly_cache=True)
    pipe = _pipeline(coll(), cache)
    stats = _epoch(pipe, roots)
    assert stats["gets"] == 1 and pipe.stages.pool.cache.stats["stale_chunks"] == 1
    assert _epoch(_pipeline(coll(), cache), roots)["gets"] == 0
