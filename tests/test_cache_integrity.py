"""Content integrity of the persistent cache: a cached chunk whose bytes changed is never served.

Each test warms a real cache directory from a real zarr store on disk, damages one chunk file
as a disk, a copy or bad RAM would (one flipped bit, a file cut short, a garbled header, a log
written before checksums), and reads the cache again: a writer in a fresh process
(``tests/cache_child.py``) fetches the chunk again and rewrites its file, a ``readonly_cache``
reader raises naming the file. The oracle is zarr's own read of the store.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from cache_child import digest
from helpers import write_era5
from test_cache import N_CHUNKS, Child, build, children, logged, spawn, uncached, warm

from insitubatch_nodes.cache.files import LOG_NAME, chunk_file_name, content_sum
from insitubatch_nodes.errors import CacheMissError, CorruptCacheError

pytestmark = pytest.mark.timeout(120)

__all__ = ["children"]  # the fixture, imported for the tests below

SPC = 8  # samples per chunk of write_era5's store


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 8, 16) and z (96, 2, 8, 16), 8 samples per chunk (12 chunks), one tile each."""
    return write_era5(tmp_path_factory.mktemp("integrity") / "era5.zarr")


def flip_bit(file: Path, sample: int = 2, bit: int = 3) -> None:
    """Flip one bit of one value inside ``file``'s data (after its ``.npy`` header)."""
    offset = np.load(file, mmap_mode="r").offset
    with open(file, "r+b") as fh:
        fh.seek(offset + sample * 4 * 8 * 16 + 17)  # a t2m value of that sample
        byte = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([byte ^ (1 << bit)]))


def zarr_epoch_check(root: Path, pipe: Any) -> int:
    """Run an epoch of ``pipe`` and check every batch against zarr's read; the batches."""
    arrays = {name: zarr.open_array(root / name, mode="r")[...] for name in ("t2m", "z")}
    pipe.reset()
    n = 0
    for batch in pipe:
        for name, got in batch.arrays.items():
            idx = np.asarray(batch.sample_indices[name])
            np.testing.assert_array_equal(np.asarray(got), arrays[name][idx])
        n += 1
    return n


def entry_of(cache: Path, array: str, chunk: int) -> dict[str, Any]:
    """The log's last line for ``(array, chunk)`` (a later line supersedes an earlier one)."""
    return [e for e in logged(cache) if (e["array"], e["chunk"]) == (array, chunk)][-1]


def test_every_logged_chunk_carries_the_checksum_of_its_files_data(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    entries = logged(cache)
    assert len(entries) == 2 * N_CHUNKS
    for e in entries:
        data = np.load(cache / e["file"], mmap_mode="r")
        assert e["sum"] == content_sum(np.asarray(data)), e
        assert e["sum"].startswith("xxh3-64:")


def test_a_flipped_bit_in_a_cached_chunk_is_refetched_exact_rewritten_and_counted_corrupt(
    era5: Path, tmp_path: Path, children: list[Child], caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    want = warm(era5, cache)
    victim = cache / chunk_file_name("t2m", 3)
    flip_bit(victim)
    # a writer in a fresh process: fetches that chunk again, serves zarr's values, rewrites it
    child = spawn(children, action="epoch", store=str(era5), cache_dir=str(cache), persist=True)
    assert child.event()["event"] == "ready"
    done = child.event()
    assert done["gets"] == 1  # t2m chunk 3 only (one stored object), counted at the store
    assert done["stats"]["corrupt"] == 1
    assert done["stats"]["disk_hits"] == 2 * N_CHUNKS - 1
    assert done["stats"]["misses"] == 1 and done["stats"]["disk_writes"] == 1
    assert done["report"] == {"hits": 2 * N_CHUNKS - 1, "misses": 1, "corrupt": 1}
    assert done["digests"] == [{k: digest(v) for k, v in b.items()} for b in want]
    assert "corrupt chunk" in child.proc.communicate(timeout=30)[1]  # the warning, on stderr
    t2m = zarr.open_array(era5 / "t2m", mode="r")
    np.testing.assert_array_equal(np.load(victim), t2m[3 * SPC : 4 * SPC])  # rewritten
    assert entry_of(cache, "t2m", 3)["sum"] == content_sum(np.load(victim))
    # the rewritten cache serves every chunk again, exact, with no GET
    pipe, store = build(era5, cache, readonly_cache=True)
    with caplog.at_level(logging.WARNING, logger="insitubatch_nodes"):
        assert zarr_epoch_check(era5, pipe) == len(want)
    stats = pipe.stats()
    pipe.close()
    assert store.chunk_gets == 0 and stats["corrupt"] == 0
    assert not [r for r in caplog.records if "corrupt" in r.getMessage()]
    # and what the writer delivered was zarr's read too (its digests are the uncached run's)
    assert [{k: digest(v) for k, v in b.items()} for b in uncached(era5)] == done["digests"]


def test_a_flipped_bit_is_checked_once_per_revive_and_the_writer_serves_zarrs_values(
    era5: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    flip_bit(cache / chunk_file_name("z", 5), sample=1, bit=6)
    pipe, store = build(era5, cache, persist=True)
    with caplog.at_level(logging.WARNING, logger="insitubatch_nodes"):
        zarr_epoch_check(era5, pipe)
        zarr_epoch_check(era5, pipe)  # resident now: neither checked nor fetched again
    stats, report = pipe.stats(), pipe.report()
    pipe.close()
    # z stores one object per level: chunk 5's two objects, fetched once
    assert store.chunk_gets == 2 and stats["corrupt"] == 1 and stats["disk_writes"] == 1
    assert report is not None and report.corrupt == 0  # the second epoch's report
    warned = [r.getMessage() for r in caplog.records if "corrupt chunk" in r.getMessage()]
    assert len(warned) == 1 and chunk_file_name("z", 5) in warned[0]


def test_a_readonly_reader_of_a_flipped_bit_raises_corrupt_cache_error_naming_the_file(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    victim = cache / chunk_file_name("t2m", 7)
    flip_bit(victim)
    before = victim.read_bytes()
    pipe, store = build(era5, cache, readonly_cache=True)
    with pytest.raises(CorruptCacheError, match=str(victim)):
        zarr_epoch_check(era5, pipe)
    pipe.close()
    assert store.chunk_gets == 0 and victim.read_bytes() == before  # nothing fetched or written


@pytest.mark.parametrize("damage", ["cut short", "garbled header"])
def test_a_cached_file_cut_short_or_garbled_is_rewritten_by_a_writer_and_an_error_for_a_reader(
    era5: Path, tmp_path: Path, damage: str
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    victim = cache / chunk_file_name("t2m", 4)
    data = victim.read_bytes()
    if damage == "cut short":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(b"\x00" * 16 + data[16:])
    pipe, _ = build(era5, cache, readonly_cache=True)
    with pytest.raises(CorruptCacheError, match=str(victim)):
        zarr_epoch_check(era5, pipe)
    pipe.close()
    pipe, store = build(era5, cache, persist=True)
    zarr_epoch_check(era5, pipe)
    stats = pipe.stats()
    pipe.close()
    assert store.chunk_gets == 1 and stats["corrupt"] == 1 and stats["disk_writes"] == 1
    t2m = zarr.open_array(era5 / "t2m", mode="r")
    np.testing.assert_array_equal(np.load(victim), t2m[4 * SPC : 5 * SPC])


def test_a_chunk_logged_without_a_checksum_is_a_readonly_miss_and_rewritten_by_a_writer(
    era5: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    log = cache / LOG_NAME
    lines = log.read_text().splitlines()
    old = [lines[0]]  # the log a version before checksums wrote: the same lines, no "sum"
    for line in lines[1:]:
        entry = json.loads(line)
        del entry["sum"]
        old.append(json.dumps(entry))
    log.write_text("\n".join(old) + "\n")
    flip_bit(cache / chunk_file_name("t2m", 2))  # nothing could tell
    pipe, store = build(era5, cache, readonly_cache=True)
    with pytest.raises(CacheMissError, match="logged without a checksum"):
        zarr_epoch_check(era5, pipe)
    pipe.close()
    pipe, store = build(era5, cache, persist=True)
    zarr_epoch_check(era5, pipe)
    stats = pipe.stats()
    pipe.close()
    assert stats["disk_hits"] == 0 and stats["disk_writes"] == 2 * N_CHUNKS
    assert store.chunk_gets == 3 * N_CHUNKS  # every chunk fetched again, once (z: 2 objects)
    assert all("sum" in entry_of(cache, e["array"], e["chunk"]) for e in logged(cache))
    pipe, store = build(era5, cache, readonly_cache=True)
    zarr_epoch_check(era5, pipe)
    pipe.close()
    assert store.chunk_gets == 0


def test_verify_cache_false_serves_the_cache_unchecked(era5: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm(era5, cache)
    victim = cache / chunk_file_name("t2m", 0)
    flip_bit(victim)
    pipe, store = build(era5, cache, readonly_cache=True, verify_cache=False, shuffle=False)
    pipe.reset()
    first = next(iter(pipe))
    pipe.close()
    assert store.chunk_gets == 0
    np.testing.assert_array_equal(first.arrays["t2m"], np.load(victim)[: len(first)])
    t2m = zarr.open_array(era5 / "t2m", mode="r")
    assert not np.array_equal(first.arrays["t2m"], t2m[: len(first)])  # the flipped value
    with pytest.raises(ValueError, match="verify_cache=False needs a cache_dir"):
        build(era5, verify_cache=False)
