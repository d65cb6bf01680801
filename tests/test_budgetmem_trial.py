"""Memory bounds and leaks: the build's memory checks, and memory that grows run after run.

Found wrong, fixed:

* An explicit ``cache_budget_bytes`` was built whatever the batches in flight beside it took:
  the automatic budget's first epoch was added to them at the build, an explicit budget was
  not (an 87-channel stack of ARCO-ERA5 at 0.25 degrees at ``batch_size=4``: 10.6 GiB of budget
  beside 10.8 GiB of batches, never summed). Now the build refuses a budget (with slots in RAM)
  whose slot memory — the budget, or every chunk the split reads where that is less — beside
  the batches in flight and the decode scratch allowance (one stored object per decode thread
  and array) exceeds the process's memory, naming each and the budget that fits
  (``plan/memory_floor.py``):
  ``test_an_explicit_budget_beside_the_batches_in_flight_beyond_memory_is_refused_at_build``.
* A sweep building pipelines with a persistent ``cache_dir`` of their own kept, for each
  directory ever used, an entry in the memo of its rank folders (``cache.files.RANK_DIRS``):
  10 builds and closes, 10 entries for the rest of the process. A cache's close now drops its
  directory's entry, and the memo keeps at most ``RANK_DIRS_KEPT`` (64), the oldest dropped
  first, for caches never closed (``cache/files.py``; nothing per build):
  ``test_a_sweep_of_pipelines_with_cache_dirs_of_their_own_leaves_no_memo_per_directory``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import write_era5

from insitubatch_nodes import (
    InSituPipeline,
    Loader,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    statistics,
)
from insitubatch_nodes.cache import files
from insitubatch_nodes.forcing_memo import Memo
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan import memory_floor
from insitubatch_nodes.plan.memory_floor import decode_scratch_bytes
from insitubatch_nodes.stages import buffers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_era5(tmp_path_factory.mktemp("budgetmem") / "era5.zarr")


def _fake_memory(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The process may use ``nbytes`` (nothing is allocated: the checks ask this function)."""
    monkeypatch.setattr(memory_floor, "usable_memory_bytes", lambda: nbytes)
    monkeypatch.setattr(buffers, "usable_memory_bytes", lambda: nbytes)


def test_an_explicit_budget_beside_the_batches_in_flight_beyond_memory_is_refused_at_build(
    era5: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    geoms = open_geometries(era5, ["t2m", "z"])
    views = {"x": geoms["z"], "y": geoms["t2m"]}
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    split = sum(g.chunk_nbytes * g.n_chunks for g in geoms.values())  # every chunk, once
    scratch = decode_scratch_bytes(geoms, 2)
    assert scratch == 2 * 2 * 8 * 8 * 16 * 4  # 2 threads x 2 arrays; an object: 8 x 8 x 16

    def build(**kw: Any) -> InSituPipeline:
        kw = {"cache_budget_bytes": split, "batch_size": 8, "block_chunks": 2, **kw}
        return insitu_pipeline(era5, manifest, views, coords=(), decode_threads=2, **kw)

    with build() as pipe:  # the machine's memory: built
        batch = pipe.context.buffers.batch_nbytes
    in_flight = 4 * batch  # prefetch_depth=2: the consumer's, two queued, one being filled
    need = split + in_flight + scratch
    _fake_memory(monkeypatch, need - 1)  # each part alone fits, together they do not
    with pytest.raises(ValueError, match=(
        rf"cache_budget_bytes={split:,} cannot be held here.*batches in flight.*decode scratch"
        rf".*pass cache_budget_bytes={split - 1:,} or less.*batch_size, prefetch_depth or "
        r"decode_threads, or give a cache_dir"
    )):  # fmt: skip
        build()
    with build(cache_budget_bytes=split - 1) as pipe:  # the budget it names is built
        assert sum(len(b["x"]) for b in Loader(pipe)) == 96
    with build(prefetch_depth=1) as pipe:  # and so is a batch fewer in flight
        assert pipe.stages.pool.budget_bytes == split
    # a budget above every chunk the split reads counts as those chunks: nothing holds more
    _fake_memory(monkeypatch, need)
    with build(cache_budget_bytes=1000 * split):
        pass
    # slots in a cache_dir are files on its disk, not this memory
    _fake_memory(monkeypatch, in_flight + scratch + split // 2)
    with build(cache_dir=tmp_path / "spill"):
        pass
    with pytest.raises(ValueError, match="cannot be held here"):
        build()


def test_a_sweep_of_pipelines_with_cache_dirs_of_their_own_leaves_no_memo_per_directory(
    era5: Path, tmp_path: Path
) -> None:
    # a hyper-parameter sweep: each trial builds a pipeline with a temporary cache directory
    # of its own, and closes it. The memo of each directory's rank folders kept an entry per
    # directory ever used, for the rest of the process
    geoms = open_geometries(era5, ["t2m"])
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    before = set(files.RANK_DIRS)
    for trial in range(50):
        pipe = insitu_pipeline(
            era5, manifest, {"x": geoms["t2m"]}, batch_size=48, coords=(),
            cache_dir=tmp_path / f"trial-{trial}", persist=True,
        )  # fmt: skip
        with pipe:
            assert sum(len(b["x"]) for b in Loader(pipe)) == 96  # (misses ask for the memo)
    assert set(files.RANK_DIRS) <= before
    # and caches never closed leave at most RANK_DIRS_KEPT entries: the oldest go first
    for d in range(files.RANK_DIRS_KEPT + 10):
        (tmp_path / f"open-{d}").mkdir()
        assert files.writer_dirs(tmp_path / f"open-{d}") == [tmp_path / f"open-{d}"]
    assert len(files.RANK_DIRS) == files.RANK_DIRS_KEPT
    assert tmp_path / "open-0" not in files.RANK_DIRS
    assert tmp_path / f"open-{files.RANK_DIRS_KEPT + 9}" in files.RANK_DIRS


def test_direct_true_and_the_fit_s_one_pass_keep_no_split_of_chunks_of_several_samples(
    era5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FetchOptions says direct=True "never keeps" a split, and fit_statistics that its one
    # pass (direct=True) "holds only the working set": at 8 samples per chunk both grew the
    # automatic budget to the whole split (147,456 bytes here, 3x the floor)
    geoms = open_geometries(era5, ["t2m", "z"])
    views = {"x": geoms["t2m"], "y": geoms["z"]}
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    split = sum(g.chunk_nbytes * g.n_chunks for g in geoms.values())
    got = {}
    for direct in (None, True):
        fetch = FetchOptions(direct=direct)
        kw: dict[str, Any] = {"batch_size": 8, "block_chunks": 2, "coords": (), "fetch": fetch}
        with insitu_pipeline(era5, manifest, views, **kw) as pipe:
            gets = []
            for _ in range(2):
                assert sum(len(b["x"]) for b in Loader(pipe)) == 96
                gets.append(pipe.report().gets)
            got[direct] = (pipe.stages.pool.budget_bytes, gets)
    assert got[None] == (split, [36, 0])  # kept: epoch 1 reads nothing
    floor, gets = got[True]
    assert floor < split // 2 and gets[1] > 24, got  # its floor; epoch 1 reads (most) again
    passes: list[InSituPipeline] = []

    def watched(*args: Any, **kw: Any) -> InSituPipeline:
        passes.append(insitu_pipeline(*args, **kw))
        return passes[-1]

    monkeypatch.setattr(statistics, "insitu_pipeline", watched)
    stats = fit_statistics(era5, manifest, views, batch_size=8, block_chunks=2)
    assert passes[0].stages.pool.budget_bytes < split // 2
    assert float(stats.count["x"]) == 96 * 8 * 16  # every value, once


def test_a_forcings_memo_fills_tables_made_once_and_counts_the_times_it_holds() -> None:
    # its tables grew by doubling, each growth a copy: filling 192 times of two forcings on a
    # 64 x 128 grid (12 MiB) grew a fresh process's resident set by 44.6 MiB (the old tables
    # stay with the tuned malloc) while nbytes, in pipe.stats(), said 22 MiB
    grid = (8, 16)
    per_time = 2 * 8 * 16 * 4
    memo = Memo(["a", "b"], grid, 1, 40 * per_time)  # room for 40 times
    rows = {n: np.arange(6 * 128, dtype=np.float32).reshape(6, *grid) for n in "ab"}
    memo.add(np.arange(6, dtype=np.int64), rows)
    tables = dict(memo.fields)
    for start in range(6, 60, 6):  # past its capacity: the oldest are forgotten
        memo.add(
            np.arange(start, start + 6, dtype=np.int64), {n: r + start for n, r in rows.items()}
        )
        assert all(memo.fields[n] is tables[n] for n in "ab")  # no table made again
        held = min(start + 6, 40)
        assert len(memo) == held
        assert memo.nbytes == held * per_time + len(memo.keys) * 8 + 2 * held * 8
    slots = memo.find(np.arange(60, dtype=np.int64))
    assert (slots[:20] == -1).all() and (slots[20:] >= 0).all()  # the newest 40 are held
    np.testing.assert_array_equal(memo.fields["b"][slots[59]], rows["b"][5] + 54)
