"""Bad stored chunks: ``on_bad_chunk="raise"`` fails fast, ``"nan"`` fills only the bad stored
object's rectangle, lists it in ``bad_chunks`` and goes on; a deleted object is not bad.

Each test damages its own copy of a small store on disk (garbage bytes, a truncated file, a
deleted file, a store that refuses one key); zarr's read of the undamaged store is the oracle
for everything outside the damaged rectangle.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage
from helpers import CountingStore, Oracle, write_era5

from insitubatch_nodes import DecodedChunk, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import ChunkReadError

pytestmark = pytest.mark.timeout(120)

SPC = 8  # samples per chunk of the store below; z is stored as one object per level


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 8, 16) and z (96, 2, 8, 16); z's stored objects are (8, 1, 8, 16): two per chunk."""
    return write_era5(tmp_path_factory.mktemp("bad") / "era5.zarr")


@pytest.fixture
def damaged(pristine: Path, tmp_path: Path) -> Path:
    """A copy of ``pristine`` for one test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "era5.zarr"))


def _epoch(pipe: Any) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    return [
        (
            {k: np.array(v) for k, v in b.arrays.items()},
            {k: np.array(v) for k, v in b.sample_indices.items()},
        )
        for b in pipe
    ]


def _pipe(store: Any, **kwargs: Any) -> Any:
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    opts: dict[str, Any] = {"batch_size": 12, "shuffle": True}
    opts.update(kwargs)
    return insitu_pipeline(store, manifest, {"x": g["t2m"], "z": g["z"]}, **opts)


def _check_only_rectangle_is_nan(batches: list[Any], oracle: Oracle, chunk: int, level: int) -> int:
    """Every z row equals zarr's read except level ``level`` of chunk ``chunk``'s samples,
    which is all NaN; t2m equals zarr everywhere. Returns the rows seen in the bad chunk."""
    hit = 0
    for arrays, idx in batches:
        np.testing.assert_array_equal(arrays["x"], oracle("t2m", idx["x"]))
        want = oracle("z", idx["z"])
        bad = idx["z"] // SPC == chunk
        hit += int(bad.sum())
        assert np.isnan(arrays["z"][bad, level]).all()
        want[bad, level] = arrays["z"][bad, level]
        np.testing.assert_array_equal(arrays["z"], want)
    return hit


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_stored_chunk_under_nan_is_nan_only_in_its_rectangle_and_listed(
    pristine: Path, damaged: Path, damage: str
) -> None:
    key = damaged / "z" / "c" / "3" / "1" / "0" / "0"  # chunk 3, level 1
    raw = key.read_bytes()
    key.write_bytes(b"not a zstd frame at all" if damage == "garbage" else raw[: len(raw) // 2])
    pipe = _pipe(damaged, on_bad_chunk="nan")
    batches = _epoch(pipe)
    assert _check_only_rectangle_is_nan(batches, Oracle(pristine), chunk=3, level=1) == SPC
    assert pipe.bad_chunks == [("z", 3, (1, 0, 0))]
    report = pipe.report()
    assert report is not None and report.bad_chunks == 1
    assert "1 stored objects could not be read or decoded" in str(report)


def test_a_corrupt_stored_chunk_fails_the_epoch_by_default(damaged: Path) -> None:
    (damaged / "z" / "c" / "3" / "1" / "0" / "0").write_bytes(b"garbage")
    pipe = _pipe(damaged)
    with pytest.raises(ChunkReadError, match=r"decode array 'z' chunk 3 tile \(1, 0, 0\)"):
        _epoch(pipe)
    assert pipe.bad_chunks == []


def test_a_stored_chunk_the_store_refuses_under_nan_is_filled_and_listed(
    pristine: Path,
) -> None:
    store = CountingStore(
        zarr.storage.LocalStore(pristine, read_only=True),
        fail={"z/c/5/0/0/0": PermissionError("access denied")},
    )
    pipe = _pipe(store, on_bad_chunk="nan")
    batches = _epoch(pipe)
    assert _check_only_rectangle_is_nan(batches, Oracle(pristine), chunk=5, level=0) == SPC
    assert pipe.bad_chunks == [("z", 5, (0, 0, 0))]


def test_a_deleted_stored_chunk_reads_as_the_fill_value_like_zarr_and_is_not_bad(
    damaged: Path,
) -> None:
    (damaged / "z" / "c" / "2" / "0" / "0" / "0").unlink()
    oracle = Oracle(damaged)  # zarr's read of the store as it now is: the fill value there
    fill = oracle.array("z").fill_value
    np.testing.assert_array_equal(oracle("z", np.arange(16, 24))[:, 0], np.full((8, 8, 16), fill))
    for policy in ("raise", "nan"):
        pipe = _pipe(damaged, on_bad_chunk=policy)
        for arrays, idx in _epoch(pipe):
            np.testing.assert_array_equal(arrays["z"], oracle("z", idx["z"]))
        assert pipe.bad_chunks == []


def test_a_bad_integer_chunk_is_filled_with_the_fill_value_in_its_tile_only(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ints.zarr"
    rng = np.random.default_rng(3)
    data = rng.integers(1, 200, size=(12, 10, 7)).astype("i2")
    group = zarr.open_group(root, mode="w", zarr_format=3)
    arr = group.create_array("a", shape=data.shape, chunks=(3, 4, 3), dtype="i2", fill_value=-1)
    arr[...] = data
    (root / "a" / "c" / "2" / "1" / "2").write_bytes(b"junk")  # samples 6..9, rows 4..8, cols 6..7
    g = open_geometries(root, ["a"])["a"]
    pipe = insitu_pipeline(
        root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"a": g}, batch_size=5, on_bad_chunk="nan"
    )
    want = data.copy()
    want[6:9, 4:8, 6:7] = -1
    for arrays, idx in _epoch(pipe):
        np.testing.assert_array_equal(arrays["a"], want[idx["a"]])
    assert pipe.bad_chunks == [("a", 2, (1, 2))]


def test_a_bad_chunk_is_read_again_next_epoch_and_listed_again(pristine: Path) -> None:
    store = CountingStore(
        zarr.storage.LocalStore(pristine, read_only=True),
        fail={"t2m/c/4/0/0": OSError("connection reset, still after the retries")},
    )
    pipe = _pipe(store, on_bad_chunk="nan", cache_budget_bytes=64 * 2**20)  # all stays resident
    _epoch(pipe)
    assert pipe.bad_chunks == [("t2m", 4, (0, 0))]
    pipe.reset()
    second = _epoch(pipe)
    assert pipe.bad_chunks == [("t2m", 4, (0, 0))]
    counts = store.chunk_counts()
    assert counts["t2m/c/4/0/0"] == 2  # not kept as if it were good ...
    assert counts["t2m/c/5/0/0"] == 1  # ... while good chunks are hits in epoch 1
    for arrays, idx in second:
        rows = idx["x"] // SPC == 4
        assert np.isnan(arrays["x"][rows]).all() and not np.isnan(arrays["x"][~rows]).any()


def test_a_chunk_transform_sees_the_filled_rectangle_and_can_repair_it(damaged: Path) -> None:
    (damaged / "t2m" / "c" / "7" / "0" / "0").write_bytes(b"garbage")

    def zero_nans(chunk: DecodedChunk) -> DecodedChunk:
        np.nan_to_num(chunk.data, copy=False, nan=0.0)
        return chunk

    pipe = _pipe(damaged, on_bad_chunk="nan", chunk_transforms=[zero_nans])
    for arrays, idx in _epoch(pipe):
        rows = idx["x"] // SPC == 7
        assert (arrays["x"][rows] == 0).all() and not np.isnan(arrays["x"]).any()
    assert pipe.bad_chunks == [("t2m", 7, (0, 0))]


def test_on_bad_chunk_accepts_only_raise_or_nan(pristine: Path) -> None:
    with pytest.raises(ValueError, match=r"'raise'.*'nan'"):
        _pipe(pristine, on_bad_chunk="skip")
    with pytest.raises(TypeError, match="on_bad_chunk"):
        _pipe(pristine, on_bad_chunk=True)


class ExpiringStore(CountingStore):
    """A store whose credentials expire after ``good`` chunk GETs: every later one is refused."""

    def __init__(self, store: Any, good: int) -> None:
        super().__init__(store)
        self.good = good

    def _with_store(self, store: Any) -> ExpiringStore:
        return type(self)(store, self.good)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if not key.endswith("zarr.json") and self.chunk_gets >= self.good:
            raise PermissionError("403 Forbidden: the security token included has expired")
        return await super().get(key, prototype, byte_range)


def _one_per_chunk(tmp_path: Path, n: int = 300) -> Path:
    root = tmp_path / "one.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    arr = group.create_array("a", shape=(n, 4, 4), chunks=(1, 4, 4), dtype="f4")
    arr[...] = np.arange(n * 16, dtype="f4").reshape(n, 4, 4)
    return root


@pytest.mark.parametrize("path", ["store's get", "local files"])
def test_a_store_that_stops_returning_objects_fails_the_epoch_under_nan_not_fills_it(
    tmp_path: Path, path: str
) -> None:
    """``"nan"`` fills the occasional object a store will not return; a store that returns none
    (expired credentials, a store that is down) is not that: once 64 reads in a row have failed
    with none served between them, the epoch fails, and says why."""
    root = _one_per_chunk(tmp_path)
    store: Any = root
    if path == "local files":  # (tests run as root: a link to itself fails its read, ELOOP)
        for chunk in range(40, 300):
            (root / "a" / "c" / str(chunk) / "0" / "0").unlink()
            (root / "a" / "c" / str(chunk) / "0" / "0").symlink_to("0")
    else:
        store = ExpiringStore(zarr.storage.LocalStore(root, read_only=True), good=40)
    g = open_geometries(store, ["a"])["a"]
    pipe = insitu_pipeline(
        store, split_by_chunk(g, (1.0, 0.0, 0.0)), {"a": g}, batch_size=10, shuffle=False,
        on_bad_chunk="nan", max_inflight=4,
    )  # fmt: skip
    delivered = 0
    with pytest.raises(ChunkReadError, match=r"failed \d+ reads in a row") as info:
        for batch in pipe:
            delivered += len(batch.sample_indices["a"])
    # the reads served, then about the run filled (reads served are counted a batch at a time,
    # so a batch's late count can start the run again once): far from the 260 refused
    assert 40 <= delivered <= 40 + 2 * 64 + 10
    assert 64 <= len(pipe.bad_chunks) <= 2 * 64 + 10
    assert info.value.in_a_row > 64
    assert "on_bad_chunk='nan'" in str(info.value) and "state_dict()" in str(info.value)
    pipe.close()


def test_objects_refused_between_objects_served_are_all_filled_under_nan(tmp_path: Path) -> None:
    root = _one_per_chunk(tmp_path)
    refused = {f"a/c/{c}/0/0": PermissionError("access denied") for c in range(0, 300, 2)}
    store = CountingStore(zarr.storage.LocalStore(root, read_only=True), fail=refused)
    g = open_geometries(store, ["a"])["a"]
    pipe = insitu_pipeline(
        store, split_by_chunk(g, (1.0, 0.0, 0.0)), {"a": g}, batch_size=10, shuffle=False,
        on_bad_chunk="nan",
    )  # fmt: skip
    want = np.arange(300 * 16, dtype="f4").reshape(300, 4, 4)
    want[::2] = np.nan
    for batch in pipe:
        np.testing.assert_array_equal(batch.arrays["a"], want[batch.sample_indices["a"]])
    assert len(pipe.bad_chunks) == 150
    pipe.close()


def test_a_collection_store_that_stops_returning_objects_fails_under_nan_while_others_serve(
    tmp_path: Path,
) -> None:
    """The run of failed reads is counted per store of a collection: objects another store
    serves in between do not hide a store that returns none (its own credentials expired)."""
    from insitubatch_nodes import Collection, split_by_member

    for m in range(2):
        image = zarr.create_array(
            tmp_path / f"m{m}.zarr", name="img", shape=(150, 2, 3), chunks=(1, 2, 3), dtype="f4"
        )
        image[:] = m
    for chunk in range(150):  # every object of the second store fails its read (ELOOP)
        (tmp_path / "m1.zarr" / "img" / "c" / str(chunk) / "0" / "0").unlink()
        (tmp_path / "m1.zarr" / "img" / "c" / str(chunk) / "0" / "0").symlink_to("0")
    coll = Collection.from_arrays([(tmp_path / f"m{m}.zarr", "img") for m in range(2)])
    manifest = split_by_member(coll, {"train": 1.0})
    pipe = insitu_pipeline(
        coll, manifest, {"x": coll["data"]}, batch_size=10, shuffle=True, on_bad_chunk="nan"
    )
    with pipe, pytest.raises(ChunkReadError, match=r"failed \d+ reads in a row") as caught:
        for _ in pipe:
            pass
    assert caught.value.key.startswith("s1/") and caught.value.in_a_row > 64
    assert len(pipe.bad_chunks) < 150
