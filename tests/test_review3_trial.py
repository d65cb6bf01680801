"""Review of 2026-12-07's changes (memcheck, timeedges, statsload, collections2).

Found wrong, fixed:

* The build's memory check counted a level selection of an array stored all levels per object
  (ARCO-ERA5's chunks are ``(1, 37, 721, 1440)``) twice per decode thread: the
  ``KeepingDecoder``'s buffer of the whole object (``most_aside_bytes``), and a stored object
  of the inner decoder's scratch (``decode_scratch_bytes``), which the whole-object decode
  never takes (it decodes straight into that buffer). Here 262,144 bytes counted at 2 threads
  where 131,072 are held (the inner scratch stays 0); at ARCO-ERA5's 0.25 degrees (an
  object of 146.5 MiB) 293 MiB per thread and variable counted where 146.5 MiB are held, so
  a level selection of 6 variables at 16 decode threads was counted 13.7 GiB of scratch it
  never takes (arithmetic from the shapes, not run), and refused on machines that hold it.
  ``ArrayFill.decodes_in_place`` (``stages/_jobs.py``) now says no scratch where every tile
  read goes through the whole-object buffer and a whole object decodes in place:
  ``test_a_level_selection_of_objects_holding_every_level_counts_its_decode_buffers_once``.
* The other way: ``ChunkDecoder.decodes_in_place`` said an array tiled in its field at several
  samples per chunk (chunks ``(4, 8, 8, 32)`` of ``(64, 8, 16, 32)``: xarray/dask's chunks
  over latitude) and one stored with its sample axis after another (``(level, time, ...)``)
  decode in place, so the check (for the automatic budget too since memcheck) counted no
  scratch, while each decode thread holds a stored object (65,536 and 131,072 bytes held
  at 2 threads, 0 counted): in a sample-first slot such an object is strided. It now asks
  for the whole field in each object (or one level per object into a level-major slot) and
  the sample axis first:
  ``test_a_field_tiled_at_several_samples_per_chunk_counts_its_decode_scratch``.
* Likewise a reshaping chunk transform (``Coarsen(2)``) on chunks of one object each: the
  objects decode in place into the stored-layout spares (counted by ``spare_bytes``), yet a
  stored object per thread was counted beside them (262,144 bytes counted, 131,072 held at
  2 threads; 524,288 and 262,144 at 4). A reshaped array now counts scratch only where its
  objects are not decoded in place into a spare (``stages/fetch.py``, ``_most_scratch``):
  ``test_a_reshaping_transform_of_whole_field_chunks_counts_its_spares_and_no_scratch_beside``.
* On a store written newest first, a missing time (NaT) at sample ``k`` also dropped sample
  ``n - 1 - k``, whose time is there (and the anchors whose windows step on it): the
  backwards ticks (``anchor_steps``) were negated in each sample's own order but masked as
  missing in the flipped order. 16 times with NaT at sample 3: sample 12 was never an
  anchor under ``missing=()``; with ``window(["-6h", "0h"])`` samples 11 and 12 were lost:
  ``test_a_missing_time_of_a_store_written_newest_first_drops_only_its_own_samples``.
* Statistics' channel labels (``_fitted_on._text``): ``fit_statistics`` of a view with a
  channel axis of durations (a forecast ``step`` coordinate, ``timedelta64``) failed with
  ``TypeError: int() argument must be ... not 'datetime.timedelta'`` (a ``timedelta64`` is an
  ``np.integer``); and statistics fitted on a store's float32 levels (0.1, 0.5, 0.7) were
  refused for the same levels written as float64 (``0.10000000149011612``), which were taken
  by index the day before. Floats a float32 holds exactly are now written as the float32's
  shortest decimal, dates and durations in their coarsest exact unit, and recorded texts are
  read again the same way (files of 2026-12-07 too):
  ``test_statistics_of_a_channel_axis_of_durations_are_fitted_and_applied``,
  ``test_statistics_of_float32_levels_apply_to_the_same_levels_written_as_float64``.

Code quality, fixed: ``anchor_steps`` counted backward times twice, in ``anchor_steps`` (the
copy with the masking bug above) and in ``forward_ticks`` (right): one ``_counted_ticks`` now.
``memory_floor``'s docstring named only one part of the decode scratch it sums.

Tried and found right (by scripts, not kept as tests; 2-core VM):

* Yesterday's files and states under today's code (the package at ``ec931ba`` saved, this
  branch loaded): a mid-epoch ``Loader`` state of a forward store with a time-delta window, a
  ``"12h"`` stride, ``missing=()`` and shuffling resumes into the same remaining rows; a
  statistics file of a level selection loads and its channels are checked by index (another
  order refused). The data module's ``chunk_split`` gives a forward store the manifest
  fingerprint ``split_by_chunk`` without ``coord`` gives (three fraction triples). A
  collection's name over 1, 3 and 6 stores is yesterday's; over 7 it changes (as meant).
* The memory check's scratch after the fixes is the peak ``decode_scratch_bytes`` held over
  two epochs, or above it, for level selections of objects holding every level (with an edge
  chunk, a level tiled in 2, a grid box beside the levels, one sample per chunk), fields
  tiled along latitude, the sample axis second, and ``Coarsen(2)`` of whole-field chunks, at
  2 and 3 (or 4) decode threads, every row zarr's. With an edge chunk the count stays above
  what is held (327,680 counted, 229,376 held): the inner scratch an edge object takes.
* Monthly dates written newest first with one month missing: ``window([0, 1])`` and
  ``shift(1)`` under ``missing=()`` give 22 anchors of 24, each window consecutive months.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Coarsen, Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.statistics import FIELDS, Statistics, fit_statistics

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(60)


def _levels_store(root: Path, n_time: int = 64) -> tuple[Path, np.ndarray]:
    """p (time, level, lat, lon), every level in each object, as ARCO-ERA5 stores them."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    values = np.random.default_rng(0).random((n_time, 8, 16, 32), dtype=np.float32)
    p = group.create_array("p", shape=values.shape, chunks=(4, 8, 16, 32), dtype="float32",
                           dimension_names=("time", "level", "lat", "lon"))  # fmt: skip
    p[:] = values
    level = group.create_array("level", shape=(8,), chunks=(8,), dtype="float64",
                               dimension_names=("level",))  # fmt: skip
    level[:] = np.arange(8) * 100.0
    return root, values


def test_a_level_selection_of_objects_holding_every_level_counts_its_decode_buffers_once(
    tmp_path: Path,
) -> None:
    root, values = _levels_store(tmp_path / "l.zarr")
    g = open_geometries(root, ["p"])
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))
    obj = 4 * 8 * 16 * 32 * 4  # one stored object, decoded
    for threads in (2, 3):
        views = {"x": g["p"].isel(level=[0, 2, 5])}
        options = {"batch_size": 4, "coords": (), "decode_threads": threads}
        with insitu_pipeline(root, manifest, views, **options) as pipe:
            counted = pipe.stages.fetch.counted.scratch
            held = 0
            for _ in range(2):
                for b in Loader(pipe):
                    held = max(held, pipe.stats()["decode_scratch_bytes"])
                    rows = np.asarray(b.sample_indices["x"])
                    np.testing.assert_array_equal(b["x"], values[rows][:, [0, 2, 5]])
            assert pipe.stages.fetch._decoders["p"].scratch_bytes == 0  # never taken
            assert held <= counted == threads * obj  # the whole-object buffers, once


def _backwards_with_nat(root: Path, n: int = 16, nat: int = 3) -> Path:
    """sst (time, lat, lon), 6-hourly times newest first, sample ``nat``'s time missing."""
    times = pd.date_range("2000-01-01", periods=n, freq="6h")[::-1].values.copy()
    times[nat] = np.datetime64("NaT")
    data = (np.arange(n)[:, None, None] * 10 + np.arange(6).reshape(2, 3)).astype("f4")
    coords = {"time": times, "lat": [10.0, 60.0], "lon": [0.0, 90.0, 200.0]}
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), data)}, coords=coords)
    enc = {"units": "hours since 2000-01-01", "dtype": "int64", "_FillValue": -999}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"sst": {"chunks": (2, 2, 3)}, "time": enc})  # fmt: skip
    return root


@pytest.mark.parametrize("window", [None, ["-6h", "0h"]])
def test_a_missing_time_of_a_store_written_newest_first_drops_only_its_own_samples(
    tmp_path: Path, window: list[str] | None
) -> None:
    root = _backwards_with_nat(tmp_path / "b.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = xr.open_zarr(root, consolidated=False).time.values
    have = {t: i for i, t in enumerate(times) if not np.isnat(t)}
    deltas = (
        [np.timedelta64(0, "h")]
        if window is None
        else [np.timedelta64(-6, "h"), np.timedelta64(0, "h")]
    )
    want = {i for t, i in have.items() if all(t + d in have for d in deltas)}
    g = open_geometries(root)["sst"]
    view = g if window is None else g.window(window)
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the split in index order of backward times)
        pipe = insitu_pipeline(root, manifest, {"x": view}, batch_size=4, missing=())
    got = set()
    with pipe:
        for b in Loader(pipe):
            for row, values in zip(
                b.coords["x"]["time"].reshape(len(b), -1),
                np.asarray(b["x"]).reshape(len(b), len(deltas), 2, 3),
                strict=True,
            ):
                anchor = row[-1]
                np.testing.assert_array_equal(row, [anchor + d for d in deltas])
                for t, v in zip(row, values, strict=True):  # each step the time it names
                    assert v[0, 0] == 10 * have[t]
                got.add(have[anchor])
    assert got == want


def _levels_of(root: Path, z: np.ndarray, dim: str, values: Any) -> Path:
    """z (time, dim, lat, lon) at 6-hourly times, ``dim``'s coordinate ``values``."""
    times = pd.date_range("2020-01-01", periods=len(z), freq="6h")
    ds = xr.Dataset({"z": (("time", dim, "lat", "lon"), z)}, coords={"time": times, dim: values})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"z": {"chunks": (4, *z.shape[1:])}})  # fmt: skip
    return root


Z = (np.random.default_rng(1).normal(size=(8, 3, 2, 2)) * [[[[1.0]], [[10.0]], [[100.0]]]]).astype(
    "f4"
)


def test_statistics_of_a_channel_axis_of_durations_are_fitted_and_applied(tmp_path: Path) -> None:
    steps = pd.to_timedelta([0, 6, 12], unit="h")
    root = _levels_of(tmp_path / "s.zarr", Z, "step", steps)
    g = open_geometries(root)
    view = g["z"].isel(step=[1, 2])
    stats = fit_statistics(root, split_by_chunk(g["z"], (1.0, 0.0, 0.0)), {"z": view})
    assert stats.dataset["views"]["z"]["labels"] == {"step": ["6 hours", "12 hours"]}
    np.testing.assert_allclose(stats.mean["z"], Z[:, 1:].mean(axis=(0, 2, 3)), rtol=1e-5)
    stats.normalizer({"z": view})  # the same steps
    with pytest.raises(ValueError, match="fitted on other channels"):
        stats.normalizer({"z": g["z"].isel(step=[0, 1])})


def test_statistics_of_float32_levels_apply_to_the_same_levels_written_as_float64(
    tmp_path: Path,
) -> None:
    levels = np.array([0.1, 0.5, 0.7], dtype="f4")
    a = _levels_of(tmp_path / "a.zarr", Z, "level", levels)
    b = _levels_of(tmp_path / "b.zarr", Z, "level", levels.astype("f8"))
    c = _levels_of(tmp_path / "c.zarr", Z, "level", np.array([0.7, 0.5, 0.1], dtype="f4"))
    ga, gb, gc = open_geometries(a), open_geometries(b), open_geometries(c)
    stats = fit_statistics(a, split_by_chunk(ga["z"], (1.0, 0.0, 0.0)), {"z": ga["z"]})
    assert stats.dataset["views"]["z"]["labels"] == {"level": ["0.1", "0.5", "0.7"]}
    norm = stats.normalizer({"z": gb["z"]})  # the same levels, as float64
    with insitu_pipeline(b, split_by_chunk(gb["z"], (1.0, 0.0, 0.0)), {"z": gb["z"]},
                         batch_size=4, batch_transforms=[norm]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
    want = (Z[batch.sample_indices["z"]] - stats.mean["z"][:, None, None]) / (
        stats.std["z"][:, None, None] + 1e-8
    )
    np.testing.assert_allclose(batch["z"], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fitted on other channels"):
        stats.normalizer({"z": gc["z"]})  # other levels at those indices
    # a file saved on 2026-12-07 holds the float64's own decimals: read alike
    view = dict(stats.dataset["views"]["z"], labels={"level": ["0.10000000149011612", "0.5",
                                                               "0.699999988079071"]})  # fmt: skip
    older = dict(stats.dataset, views={"z": view})
    kept = Statistics(**{f: getattr(stats, f) for f in FIELDS}, dataset=older, paths=stats.paths)
    kept.save(tmp_path / "s.json")
    Statistics.load(tmp_path / "s.json").normalizer({"z": ga["z"]})


@pytest.mark.parametrize(
    ("shape", "chunks", "dims"),
    [
        ((64, 8, 16, 32), (4, 8, 8, 32), ("time", "level", "lat", "lon")),
        ((8, 64, 16, 32), (8, 4, 16, 32), ("level", "time", "lat", "lon")),
    ],
)
def test_a_field_tiled_at_several_samples_per_chunk_counts_its_decode_scratch(
    tmp_path: Path, shape: tuple[int, ...], chunks: tuple[int, ...], dims: tuple[str, ...]
) -> None:
    group = zarr.open_group(tmp_path / "t.zarr", mode="w", zarr_format=3)
    values = np.random.default_rng(2).random(shape, dtype=np.float32)
    group.create_array("p", shape=shape, chunks=chunks, dtype="float32", dimension_names=dims)[
        :
    ] = values
    g = open_geometries(tmp_path / "t.zarr", ["p"], sample_axis="time")
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))
    options = {"batch_size": 4, "coords": (), "decode_threads": 2}
    by_time = np.moveaxis(values, dims.index("time"), 0)
    with insitu_pipeline(tmp_path / "t.zarr", manifest, {"x": g["p"]}, **options) as pipe:
        held = 0
        for b in Loader(pipe):
            held = max(held, pipe.stats()["decode_scratch_bytes"])
            np.testing.assert_array_equal(b["x"], by_time[np.asarray(b.sample_indices["x"])])
        assert 0 < held <= pipe.stages.fetch.counted.scratch  # a stored object per thread


def test_a_reshaping_transform_of_whole_field_chunks_counts_its_spares_and_no_scratch_beside(
    tmp_path: Path,
) -> None:
    group = zarr.open_group(tmp_path / "c.zarr", mode="w", zarr_format=3)
    values = np.random.default_rng(3).random((64, 32, 32), dtype=np.float32)
    for name in ("a", "b"):
        group.create_array(name, shape=values.shape, chunks=(8, 32, 32), dtype="float32",
                           dimension_names=("time", "lat", "lon"))[:] = values  # fmt: skip
    g = open_geometries(tmp_path / "c.zarr", ["a", "b"])
    manifest = split_by_chunk(g["a"], (1.0, 0.0, 0.0))
    options = {"batch_size": 4, "coords": (), "decode_threads": 2}
    views = {"x": g["a"], "y": g["b"]}
    with insitu_pipeline(
        tmp_path / "c.zarr", manifest, views, chunk_transforms=[Coarsen(2)], **options
    ) as pipe:
        held = 0
        for _ in range(2):
            for b in Loader(pipe):
                held = max(held, pipe.stats()["decode_scratch_bytes"])
                rows = np.asarray(b.sample_indices["x"])
                want = values[rows].reshape(len(rows), 16, 2, 16, 2).mean(axis=(2, 4))
                np.testing.assert_allclose(b["x"], want, rtol=1e-6)
        fetch = pipe.stages.fetch
        assert all(d.scratch_bytes == 0 for d in fetch._decoders.values())  # all in place
        spares = 2 * 2 * 8 * 32 * 32 * 4  # 2 arrays x 2 threads, a chunk each
        # (all 4 were held once when admitted chunks took them; since they are taken at the
        # decode, test_fillscratch_trial, fewer may be: 65,536 bytes in one run here)
        assert 0 < held <= fetch.counted.scratch == spares
