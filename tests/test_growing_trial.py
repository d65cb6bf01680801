"""An archive that grows and changes between runs (the ERA5T / operational case), used as a
demanding user would: new time steps appended every day (zarr ``resize`` and writes), a recent
chunk rewritten with corrected values, a new variable added; training over it with the
persistent cache, saved statistics, loader checkpoints and forecast anchors (two input steps,
the next step as target, anchors at 00 and 12 UTC). zarr's own read of the store as it is is
the oracle.

Found (now fixed):

* Statistics fitted on a train split drawn by dates were refused after steps were appended
  outside it ("fitted on another dataset: manifest '9b07...' in the file, 'f217...'
  expected. Fit them again"), given the manifest drawn again over the same dates on the grown
  store: a manifest's fingerprint covers the array's length, and with a time stride the
  missing steps' fingerprint covers every step's time. The fit now records the split's samples
  and its anchors, and ``Statistics.load`` accepts a manifest (or another fit's ``dataset``)
  whose fitted split holds the same ones; a split that gained samples is still refused.
* A loader state taken before an append could never be restored over the grown store: the
  saved manifest is refused by the grown arrays ("has 100 samples but the manifest's anchor
  grid has 92"), a manifest drawn again is "another dataset" (or, with a time stride, "the
  steps dropped as missing differ"), mid-epoch and at an epoch's end alike, the message saying
  to build the pipeline over the manifest of the run that saved it — which the grown store
  refuses. A state now records the split's anchors (chunks, anchors after the stride and the
  missing steps, views) and restores exactly where they are the same; where the append changed
  them the refusal says so and what to do.
* After an append a ``readonly_cache=True`` reader of the past (a date window) is refused with
  ``StaleCacheError`` for the old last chunk, which it never reads, and was told to "warm the
  cache again with a writing run, which refetches just those chunks": a writer of its own
  window drops them for that run only, and the next reader is refused again. The message now
  says a writer whose split reads those chunks, and caching.md when to run it (since
  cachegaps a reader is refused only for the stale chunks it reads: the reader of the past
  reads on).

Tried and found right (kept as claims below, or checked once): after an append a fresh run's
manifest and forecast anchors reach the newest step, every row zarr's; with a persistent cache,
a day's append (the old last chunk grown, a new one), a corrected chunk inside the split and a
new variable fetch exactly the changed and new objects, every other chunk served from the cache
(counted), and a read-only reader after that reads nothing; a chunk corrected while a pipeline
runs keeps its cached values in that pipeline's later epochs (resident, or read back from the
cache after eviction: documented now in pipeline.md) and the next pipeline fetches it alone;
statistics of a split the append grew are refused; consolidated metadata left stale by the
append warns and the array's own shape is used, coordinates included; a store resized before
its new steps are written reads the grown edge chunk's padding as the fill value, as zarr does,
and ``missing_objects="drop"`` drops only the anchors of the absent new chunk; ten pipelines
over one cache directory in a row leave no descriptor or thread behind (12 fds and 11 threads
after 5 and after 15: the shared IO loop and decode pool); a mid-epoch state resumed across an
append outside the split is exact for grid and random patches, windows, selections, two ranks,
and through ``StatefulDataLoader`` with ``torch.save``/``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import Oracle, View, run_epoch, write_era5

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import StaleCacheError
from insitubatch_nodes.io.coords import open_coordinates
from insitubatch_nodes.statistics import Statistics, fit_statistics

pytestmark = pytest.mark.timeout(60)

SPC = 8  # samples per chunk of write_era5's store
N0 = 92  # steps before the first append: 12 chunks, the last holding 4


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """t2m (92, 8, 16) and z (92, 2, 8, 16), six-hourly from 2000-01-01, 8 steps a chunk."""
    return write_era5(tmp_path / "era5.zarr", n_time=N0)


def append(root: Path, n_new: int, names: tuple[str, ...] = ("t2m", "z")) -> None:
    """Append ``n_new`` steps to every array of ``names`` and to ``time``, as an operational
    archive does each day: ``resize``, then write the new steps (values unlike the old ones)."""
    times = zarr.open_array(root / "time", mode="r+")
    old = times.shape[0]
    step = times[1] - times[0]
    times.resize((old + n_new,))
    times[old:] = times[old - 1] + step * np.arange(1, n_new + 1)
    for name in names:
        array = zarr.open_array(root / name, mode="r+")
        array.resize((old + n_new, *array.shape[1:]))
        array[old:] = np.full((n_new, *array.shape[1:]), 1000.0, dtype=array.dtype)


def window(root: Path, first: int, stop: int) -> Any:
    """The manifest a user draws by dates: train, val and test over the steps ``first`` to
    ``stop`` (by their times), on the store as it is now."""
    t2m = open_geometries(root, ["t2m"])["t2m"]
    time = open_coordinates(root, t2m)["time"]
    dates = (time.values[first], time.values[stop])
    return split_by_chunk(t2m, (0.8, 0.1, 0.1), sample_range=dates, coord=time)


# -- a fresh run -------------------------------------------------------------------------------


def test_after_an_append_a_fresh_run_draws_forecast_anchors_up_to_the_newest_step(
    root: Path,
) -> None:
    append(root, 8)
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {"x": t2m.window([-1, 0]), "y": t2m.shift(1)}
    with closing(insitu_pipeline(root, manifest, views, batch_size=4, stride="12h")) as pipe:
        batches = list(Loader(pipe))
    anchors = np.sort(np.concatenate([b.sample_indices["y"] - 1 for b in batches]))
    np.testing.assert_array_equal(anchors, np.arange(2, N0 + 8 - 1, 2))  # 00 and 12 UTC
    oracle = zarr.open_array(root / "t2m")[...]
    for b in batches:
        np.testing.assert_array_equal(b.arrays["y"], oracle[b.sample_indices["y"]])
        np.testing.assert_array_equal(b.arrays["x"], oracle[b.sample_indices["x"]])
        times = b.coords["y"]["time"]
        assert (times.astype("datetime64[h]").astype(int) % 12 == 6).all()  # the anchor's + 6h


# -- saved statistics ----------------------------------------------------------------------------


def test_statistics_fitted_on_a_date_window_stay_valid_after_dates_are_appended_outside_it(
    root: Path, tmp_path: Path
) -> None:
    views = {"t2m": open_geometries(root, ["t2m"])["t2m"]}
    stats = fit_statistics(root, window(root, 0, 80), views, stride="12h")
    stats.save(tmp_path / "stats.json")
    append(root, 8)
    grown = window(root, 0, 80)  # the same dates, drawn again on the grown store
    views = {"t2m": open_geometries(root, ["t2m"])["t2m"]}
    dataset = {"store": root, "manifest": grown, "views": views, "split": "train", "stride": "12h"}
    loaded = Statistics.load(tmp_path / "stats.json", dataset=dataset)
    again = fit_statistics(root, grown, views, stride="12h")  # what a refit gives
    for name in ("mean", "std", "min", "max", "diff_std", "count"):
        np.testing.assert_array_equal(getattr(loaded, name)["t2m"], getattr(again, name)["t2m"])
    Statistics.load(tmp_path / "stats.json", dataset=again.dataset)  # another fit's dataset


def test_statistics_of_a_split_the_append_grew_are_refused(root: Path, tmp_path: Path) -> None:
    views = {"t2m": open_geometries(root, ["t2m"])["t2m"]}
    whole = split_by_chunk(views["t2m"], (1.0, 0.0, 0.0))  # train: every step, the last chunk too
    fit_statistics(root, whole, views).save(tmp_path / "stats.json")
    append(root, 4)  # the last chunk grows from 4 steps to 8: train holds 4 more
    grown = split_by_chunk(open_geometries(root, ["t2m"])["t2m"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="fitted on another dataset"):
        Statistics.load(tmp_path / "stats.json", dataset={"store": root, "manifest": grown})


# -- loader checkpoints --------------------------------------------------------------------------


def _views(root: Path) -> dict[str, Any]:
    t2m = open_geometries(root, ["t2m"])["t2m"]
    return {"x": t2m.window([-1, 0]), "y": t2m.shift(1)}  # two input steps, the next step


def _pipeline(root: Path, last: int = 80, **kw: Any) -> Any:
    """Forecast samples at 00 and 12 UTC over the steps before ``last`` (by date)."""
    kw = {"batch_size": 4, "stride": "12h", "coords": ()} | kw
    return insitu_pipeline(root, window(root, 0, last), _views(root), **kw)


def _records(batches: Any) -> list[tuple[np.ndarray, ...]]:
    return [(b.epoch, b.sample_indices["y"].copy(), b.arrays["x"].copy(), b.arrays["y"].copy())
            for b in batches]  # fmt: skip


def _assert_same(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_mid_epoch_state_taken_before_an_append_outside_the_split_resumes_the_same_epoch(
    root: Path,
) -> None:
    pipe = _pipeline(root)
    loader = Loader(pipe)
    batches = iter(loader)
    for _ in range(2):
        next(batches)
    state = loader.state_dict()
    rest = _records(batches)  # the rest of the epoch, never interrupted
    pipe.close()
    append(root, 8)  # a day of new steps, after the test split
    with closing(_pipeline(root)) as pipe:  # the same dates, drawn again on the grown store
        loader = Loader(pipe)
        loader.load_state_dict(state)
        _assert_same(_records(loader), rest)


def test_an_epoch_end_state_taken_before_an_append_outside_the_split_goes_on_to_the_next_epoch(
    root: Path,
) -> None:
    with closing(_pipeline(root)) as pipe:
        loader = Loader(pipe)
        _records(loader)
        state = loader.state_dict()
        following = _records(loader)  # epoch 1 of a run never stopped
    append(root, 8)
    with closing(_pipeline(root)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        _assert_same(_records(loader), following)


def test_a_mid_epoch_state_of_a_split_the_append_grew_is_refused_saying_what_to_do(
    root: Path,
) -> None:
    states = {}
    for stride in ("12h", 1):  # forecast anchors (the times read), and every step
        with closing(_pipeline(root, last=N0 - 1, stride=stride)) as pipe:
            loader = Loader(pipe)  # its test split: the last chunk, 3 of its 4 steps
            next(iter(loader))
            states[stride] = loader.state_dict()
    append(root, 8)
    for stride, says in (("12h", "steps appended to the archive"), (1, "sample_range")):
        with closing(_pipeline(root, last=N0 + 7, stride=stride)) as pipe:  # it grew
            loader = Loader(pipe)
            loader.load_state_dict(states[stride])
            with pytest.raises(ValueError, match="cannot restore") as info:
                next(iter(loader))
        assert says in str(info.value) and "afresh" in str(info.value)


# -- the persistent cache ------------------------------------------------------------------------


def _cached(root: Path, cache: Path, names: list[str], **kw: Any) -> Any:
    manifest = split_by_chunk(open_geometries(root, ["t2m"])["t2m"], (1.0, 0.0, 0.0))
    kw = {"batch_size": 8, "block_chunks": 4, "cache_dir": cache, "persist": True} | kw
    return insitu_pipeline(root, manifest, names, coords=(), **kw)


def _epoch(pipe: Any, root: Path, names: list[str]) -> dict[str, int]:
    """One epoch checked row by row against zarr's read of the store as it is now."""
    with closing(pipe):
        run_epoch(pipe, Oracle(root), {name: View(name) for name in names})
        return {**pipe.stats(), "stale": pipe.stages.pool.cache.stats["stale_chunks"]}


def test_a_day_of_new_steps_a_corrected_chunk_and_a_new_variable_fetch_only_what_changed(
    root: Path, tmp_path: Path
) -> None:
    cache, names = tmp_path / "cache", ["t2m", "z"]
    assert _epoch(_cached(root, cache, names), root, names)["gets"] == 12 * (1 + 2)
    t2m = zarr.open_array(root / "t2m", mode="r+")
    t2m[9 * SPC : 10 * SPC] = t2m[9 * SPC : 10 * SPC] + 0.5  # a correction of chunk 9
    append(root, 12)  # chunk 11 grows from 4 steps to 8, chunk 12 is new
    sst = zarr.create_array(root, name="sst", shape=(N0 + 12, 8, 16), chunks=(SPC, 8, 16),
                            dtype="f4", dimension_names=("time", "lat", "lon"))  # fmt: skip
    sst[...] = np.arange(sst.size, dtype="f4").reshape(sst.shape)
    names = ["t2m", "z", "sst"]
    stats = _epoch(_cached(root, cache, names), root, names)
    # t2m: chunks 9, 11 and 12 (one object each); z: chunks 11 and 12 (two levels each); sst: all
    assert stats["gets"] == 3 + 2 * 2 + 13
    assert stats["disk_hits"] == (13 - 3) + (13 - 2)  # every unchanged chunk from the cache
    assert stats["stale"] == 3  # t2m's chunks 9 and 11, z's chunk 11
    stats = _epoch(_cached(root, cache, names, persist=False, readonly_cache=True), root, names)
    assert stats["gets"] == 0 and stats["disk_hits"] == 3 * 13


def test_a_chunk_corrected_while_a_pipeline_runs_reaches_the_next_pipeline_not_this_one(
    root: Path, tmp_path: Path
) -> None:
    cache, names = tmp_path / "cache", ["t2m"]
    budget = 6 * SPC * 8 * 16 * 4  # six of the 12 chunks: the others are read back from the cache
    pipe = _cached(root, cache, names, cache_budget_bytes=budget, block_chunks=1)
    before = Oracle(root)
    run_epoch(Loader(pipe), before, {"t2m": View("t2m")})  # epoch 0 warms the cache
    t2m = zarr.open_array(root / "t2m", mode="r+")
    t2m[2 * SPC : 3 * SPC] = t2m[2 * SPC : 3 * SPC] + 0.5  # corrected between epochs
    run_epoch(Loader(pipe), before, {"t2m": View("t2m")})  # as documented: as it was cached
    assert pipe.stats()["gets"] == 12 and pipe.stats()["evictions"] > 0
    pipe.close()
    stats = _epoch(_cached(root, cache, names), root, names)  # the next pipeline: the new values
    assert stats["gets"] == 1 and stats["stale"] == 1


def test_after_an_append_a_read_only_reader_of_the_past_reads_on_and_one_of_the_grown_chunk_waits(
    root: Path, tmp_path: Path
) -> None:
    # before (cachegaps): the reader of the past was refused too, for chunk 11, which it never
    # reads, until a writer whose split reads it had fetched it again
    cache, names = tmp_path / "cache", ["t2m", "z"]
    _epoch(_cached(root, cache, names), root, names)  # a writer of every step, chunk 11 too
    append(root, 8)  # rewrites chunk 11, which a reader of the first 80 steps never reads

    def past(**kw: Any) -> Any:
        return insitu_pipeline(root, window(root, 0, 80), names, coords=(), cache_dir=cache, **kw)

    assert _epoch(past(readonly_cache=True), root, names)["gets"] == 0
    with pytest.raises(StaleCacheError, match="whose split reads those chunks") as info:
        _cached(root, cache, names, persist=False, readonly_cache=True)  # reads chunk 11
    assert "'t2m/c/11/0/0' changed" in str(info.value)
    assert _epoch(_cached(root, cache, names), root, names)["gets"] == 2 * (1 + 2)  # 11 and 12
    assert _epoch(_cached(root, cache, names, persist=False, readonly_cache=True), root,
                  names)["gets"] == 0  # fmt: skip
