"""The persistent cache as a forecaster uses it: stacks, static fields, windows, statistics.

A black-box trial of ``cache_dir=`` (``persist=True``, ``readonly_cache=True``) and of
``fit_statistics(..., cache_dir=...)`` against zarr and numpy, on a tiny ERA5-like store
(``t (time, level, lat, lon)`` chunked by 8 steps, a land-sea mask ``lsm (lat, lon)``).

Found (each fixed, each test failed before its fix):

* ``fit_statistics(..., cache_dir=..., persist=True)`` read its static views from the store
  every time, never through the cache, though the pipeline it builds caches its sampled views
  and a pipeline caches its static labels: a second fit over the warm cache still GET the
  mask (and a ``readonly_cache=True`` fit did too).
* A ``readonly_cache=True`` reader was refused (``StaleCacheError`` at construction) for a
  stale chunk it never reads: the val chunk rewritten in the store stopped a scorer of the
  train split, which would have served nothing but unchanged chunks. Now a reader is refused
  for the stale chunks its split reads (at construction, as before), and a stale chunk it
  reads later (a view ``set_views`` adds) raises ``StaleCacheError`` when it is needed; it
  is never served. Under DDP (several ranks read other chunks each epoch) each rank is refused
  for the stale chunks any rank reads in the split, so all ranks start or stop alike.
* A cache warmed by a patched run (``t.patches(...)``: kept by stored tile) refuses a
  whole-field run of the same array with ``StaleCacheError`` saying it was "made with another
  geometry, decoding or chunk transforms" — none of which differed — and to reset the cache
  (which deletes the tiles). It now names patches among the causes and says to give each way
  of reading its own ``cache_dir``.

Tried and found right (kept as claims below):

* the pipeline's static labels, and a stack's static member, are served from a warm cache by
  a second pipeline and by a read-only reader: zero GETs;
* a cache written through ``sel(level=500)`` serves a reader of ``sel(level=850)`` (the files
  hold whole chunks; the selection is taken at the gather), every row zarr's;
* a store rewritten in place (same shape, new values): a writer fetches exactly the changed
  chunk and serves the new values, never the cached bytes;
* a cached chunk whose bytes were flipped on disk is fetched again by a writer (counted as
  ``corrupt``) and refused by a reader (``CorruptCacheError``);
* two pipelines of one process (train and val, and x/y stacks) writing one ``cache_dir`` at
  once, their iterations interleaved: every row zarr's, each stored chunk fetched once;
* a windowed forecast stack (two input steps, the mask, a solar forcing; a target a step
  ahead) gives bit for bit the batches of a pipeline without a cache, warming it and reading
  it back read-only;
* a read-only reader of arrays whose other arrays' chunks are stale (the mask rewritten, not
  read) reads on; one that reads the mask is refused when built.

Left as they are: the coordinates a pipeline or a fit reads (the time coordinate of forcings,
``diff_std`` and ``batch.coords``) are read from the store at every build, never cached (one
GET per coordinate array here); static views fitted alone (no sampled view, so no pass and no
cache opened) are read from the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store

from insitubatch_nodes import (
    Forcings,
    Loader,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.errors import CorruptCacheError, StaleCacheError

pytestmark = pytest.mark.timeout(60)

T, LEV, LAT, LON, SPC = 48, 3, 4, 6, 8
LEVELS = np.array([1000, 850, 500])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A fresh store per test (some rewrite it): ``t`` in 6 chunks of 8 steps, ``lsm``."""
    rng = np.random.default_rng(1)
    group = zarr.open_group(tmp_path / "era5.zarr", mode="w", zarr_format=3)

    def put(name: str, data: np.ndarray, dims: tuple[str, ...], chunks: Any = None) -> None:
        group.create_array(name, shape=data.shape, chunks=chunks or data.shape, dtype=data.dtype,
                           dimension_names=dims)[...] = data  # fmt: skip

    put("t", rng.random((T, LEV, LAT, LON), dtype="f4"), ("time", "level", "lat", "lon"),
        (SPC, LEV, LAT, LON))  # fmt: skip
    put("lsm", (rng.random((LAT, LON)) > 0.5).astype("f4"), ("lat", "lon"))
    put("time", np.arange(T, dtype="i8"), ("time",))
    group["time"].attrs.update({"units": "hours since 2020-01-01", "calendar": "standard"})
    put("level", LEVELS, ("level",))
    put("lat", np.linspace(-60, 60, LAT), ("lat",))
    put("lon", np.arange(LON) * 60.0, ("lon",))
    return tmp_path / "era5.zarr"


def _read(root: Path, name: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root, path=name, mode="r")[...])


def _geoms(root: Path) -> dict[str, Any]:
    return open_geometries(root, ["t", "lsm"], sample_axis="time")


def _manifest(root: Path) -> Any:
    return split_by_chunk(_geoms(root)["t"], (0.5, 0.25, 0.25))  # chunks 0-2, 3-4, 5


def _epoch(pipe: Any) -> list[dict[str, Any]]:
    """Every batch of one epoch: arrays copied, with the rows' sample indices."""
    with pipe:
        return [
            {"arrays": {k: np.array(v) for k, v in b.arrays.items()},
             "index": {k: np.array(v) for k, v in b.sample_indices.items()}}
            for b in Loader(pipe)
        ]  # fmt: skip


def _check_rows(batches: list[dict[str, Any]], label: str, data: np.ndarray) -> int:
    """Each row of ``label`` is ``data`` at its sample index; the number of rows."""
    n = 0
    for b in batches:
        for row, i in zip(b["arrays"][label], b["index"][label], strict=True):
            np.testing.assert_array_equal(row, data[int(i)])
            n += 1
    return n


def _chunk_gets(store: Any, name: str) -> int:
    return sum(n for key, n in store.chunk_counts().items() if key.startswith(f"{name}/"))


# ---------------------------------------------------------------------------------------------
# Found: fit_statistics' static views and the persistent cache
# ---------------------------------------------------------------------------------------------


def test_fit_statistics_over_a_warm_cache_reads_its_static_views_from_the_cache(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    views = {"t": g["t"], "lsm": g["lsm"]}
    fits = []
    for kw in ({"persist": True}, {"persist": True}, {"readonly_cache": True}):
        store = counting_store(root)
        fits.append(fit_statistics(store, _manifest(root), views, cache_dir=cache, **kw))
        if len(fits) == 1:  # the warming fit reads each stored object once
            assert _chunk_gets(store, "lsm") == 1 and _chunk_gets(store, "t") == 3
        else:  # before: the mask was read from the store by every fit
            assert _chunk_gets(store, "lsm") == _chunk_gets(store, "t") == 0
    lsm = _read(root, "lsm")
    for fit in fits:
        np.testing.assert_allclose(fit.mean["lsm"], lsm.astype("f8").mean(), rtol=1e-12)
        np.testing.assert_allclose(fit.std["t"], fits[0].std["t"], rtol=0)
    t = _read(root, "t")[: 3 * SPC].astype("f8")
    np.testing.assert_allclose(fits[1].mean["t"], t.mean(axis=(0, 2, 3)), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Found: a read-only reader refused for stale chunks it never reads
# ---------------------------------------------------------------------------------------------


def _warm_every_split(root: Path, cache: Path, views: dict[str, Any]) -> None:
    for split in ("train", "val", "test"):
        _epoch(insitu_pipeline(root, _manifest(root), views, split=split, batch_size=4,
                               coords=(), cache_dir=cache, persist=True))  # fmt: skip


def _rewrite_chunk(root: Path, chunk: int) -> np.ndarray:
    """Chunk ``chunk`` of ``t`` rewritten in place, same shape, new values; ``t`` after."""
    t = zarr.open_array(root, path="t", mode="r+")
    t[chunk * SPC : (chunk + 1) * SPC] = np.asarray(t[chunk * SPC : (chunk + 1) * SPC]) + 1.0
    return np.asarray(t[...])


def test_a_readonly_reader_is_not_refused_for_a_stale_chunk_outside_its_split(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    views = {"x": g["t"], "m": g["lsm"]}
    _warm_every_split(root, cache, views)
    new = _rewrite_chunk(root, 3)  # the val chunk: the train split never reads it

    store = counting_store(root)
    train = insitu_pipeline(store, _manifest(root), views, batch_size=4, coords=(),
                            cache_dir=cache, readonly_cache=True)  # fmt: skip
    assert _check_rows(_epoch(train), "x", new) == 3 * SPC  # (chunks 0-2: unchanged)
    assert store.chunk_gets == 0
    # the val reader serves chunk 3: refused at construction, naming the rewritten object
    with pytest.raises(StaleCacheError, match=r"'t/c/3/0/0/0' changed"):
        insitu_pipeline(root, _manifest(root), views, split="val", batch_size=4, coords=(),
                        cache_dir=cache, readonly_cache=True)  # fmt: skip
    # the mask rewritten: a reader without it reads on, one with it is refused when built
    mask = zarr.open_array(root, path="lsm", mode="r+")
    mask[...] = 1.0 - np.asarray(mask[...])
    alone = {"x": g["t"]}
    _epoch(insitu_pipeline(root, _manifest(root), alone, batch_size=4, coords=(),
                           cache_dir=cache, readonly_cache=True))  # fmt: skip
    with pytest.raises(StaleCacheError, match=r"'lsm/c/0/0' changed"):
        insitu_pipeline(root, _manifest(root), views, batch_size=4, coords=(), cache_dir=cache,
                        readonly_cache=True)  # fmt: skip


def test_a_readonly_reader_refuses_a_stale_chunk_a_later_view_reads_when_it_is_needed(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    _warm_every_split(root, cache, {"x": g["t"]})
    _rewrite_chunk(root, 3)
    pipe = insitu_pipeline(root, _manifest(root), {"x": g["t"]}, batch_size=4, coords=(),
                           cache_dir=cache, readonly_cache=True,
                           cross_split_windows=True)  # fmt: skip
    with pipe:
        assert sum(len(b) for b in Loader(pipe)) == 3 * SPC
        # a lead of 8 steps reads chunk 3 from the last train chunk's anchors: never the old bytes
        pipe.set_views({"x": g["t"], "y": g["t"].shift(SPC)})
        with pytest.raises(StaleCacheError, match=r"'t/c/3/0/0/0' changed"):
            list(Loader(pipe))


def test_readonly_ranks_start_or_are_refused_alike_for_the_stale_chunks_of_their_split(
    root: Path, tmp_path: Path
) -> None:
    # each rank reads other chunks each epoch: none may start where another is refused
    g, cache = _geoms(root), tmp_path / "cache"
    _warm_every_split(root, cache, {"x": g["t"]})
    new = _rewrite_chunk(root, 3)  # a val chunk

    def rank(r: int, split: str) -> Any:
        return insitu_pipeline(root, _manifest(root), {"x": g["t"]}, split=split, batch_size=2,
                               coords=(), cache_dir=cache, readonly_cache=True, rank=r,
                               world_size=2, remainder="pad")  # fmt: skip

    assert sum(_check_rows(_epoch(rank(r, "train")), "x", new) for r in range(2)) == 3 * SPC
    for r in range(2):  # whichever rank reads chunk 3 this epoch
        with pytest.raises(StaleCacheError, match=r"'t/c/3/0/0/0' changed"):
            rank(r, "val")


def test_a_whole_field_run_over_a_cache_of_tiles_is_told_that_patches_made_it(
    tmp_path: Path,
) -> None:
    group = zarr.open_group(tmp_path / "tiled.zarr", mode="w", zarr_format=3)
    group.create_array("t", shape=(32, 4, 6), chunks=(8, 2, 3), dtype="f4",
                       dimension_names=("time", "lat", "lon"))[...] = 1.0  # fmt: skip
    g = open_geometries(tmp_path / "tiled.zarr", ["t"], sample_axis="time")["t"]
    manifest, cache = split_by_chunk(g, (1.0, 0.0, 0.0)), tmp_path / "cache"
    kw: dict[str, Any] = {"batch_size": 4, "coords": (), "cache_dir": cache, "persist": True}
    _epoch(
        insitu_pipeline(
            tmp_path / "tiled.zarr",
            manifest,
            {
                "x": g.patches({"lat": 2}),
            },
            **kw,
        )
    )
    with pytest.raises(StaleCacheError, match=r"patches.*give each its own cache_dir"):
        insitu_pipeline(tmp_path / "tiled.zarr", manifest, {"x": g}, **kw)


# ---------------------------------------------------------------------------------------------
# Tried and found right
# ---------------------------------------------------------------------------------------------


def test_static_labels_and_a_stacks_static_member_come_from_a_warm_cache_with_no_get(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    views = {"m": g["lsm"], "s": stack({"t": g["t"].sel(level=500), "lsm": g["lsm"]})}
    lsm = _read(root, "lsm")
    for k, kw in enumerate(({"persist": True}, {"persist": True}, {"readonly_cache": True})):
        store = counting_store(root)
        batches = _epoch(insitu_pipeline(store, _manifest(root), views, batch_size=4, coords=(),
                                         cache_dir=cache, **kw))  # fmt: skip
        assert store.chunk_gets == (1 + 3 if k == 0 else 0), store.chunk_counts()
        rows = np.broadcast_to(lsm, (4, LAT, LON))
        for b in batches:
            np.testing.assert_array_equal(b["arrays"]["m"], rows)
            np.testing.assert_array_equal(b["arrays"]["s"][:, 1], rows)


def test_a_cache_written_through_one_level_serves_a_reader_of_another(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    t = _read(root, "t")
    _epoch(insitu_pipeline(root, _manifest(root), {"x": g["t"].sel(level=500)}, batch_size=4,
                           coords=(), cache_dir=cache, persist=True))  # fmt: skip
    store = counting_store(root)
    batches = _epoch(insitu_pipeline(store, _manifest(root), {"x": g["t"].sel(level=850)},
                                     batch_size=4, coords=(), cache_dir=cache,
                                     readonly_cache=True))  # fmt: skip
    assert store.chunk_gets == 0
    assert _check_rows(batches, "x", t[:, 1]) == 3 * SPC


def test_a_store_rewritten_in_place_is_fetched_again_never_served_from_the_cache(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    _warm_every_split(root, cache, {"x": g["t"]})
    new = _rewrite_chunk(root, 1)
    store = counting_store(root)
    pipe = insitu_pipeline(store, _manifest(root), {"x": g["t"]}, batch_size=4, coords=(),
                           cache_dir=cache, persist=True)  # fmt: skip
    assert _check_rows(_epoch(pipe), "x", new) == 3 * SPC
    assert store.chunk_counts() == {"t/c/1/0/0/0": 1}
    reader = insitu_pipeline(root, _manifest(root), {"x": g["t"]}, batch_size=4, coords=(),
                             cache_dir=cache, readonly_cache=True)  # fmt: skip
    assert _check_rows(_epoch(reader), "x", new) == 3 * SPC


def test_a_cached_chunk_flipped_on_disk_is_refetched_by_a_writer_and_refused_by_a_reader(
    root: Path, tmp_path: Path
) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    _warm_every_split(root, cache, {"x": g["t"]})
    t = _read(root, "t")
    (file,) = cache.glob("t-*.2.npy")
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0x40
    file.write_bytes(bytes(raw))
    reader = insitu_pipeline(root, _manifest(root), {"x": g["t"]}, batch_size=4, coords=(),
                             cache_dir=cache, readonly_cache=True)  # fmt: skip
    with pytest.raises(CorruptCacheError, match=r"chunk 2 of array 't'"):
        _epoch(reader)
    store = counting_store(root)
    writer = insitu_pipeline(store, _manifest(root), {"x": g["t"]}, batch_size=4, coords=(),
                             cache_dir=cache, persist=True)  # fmt: skip
    assert _check_rows(_epoch(writer), "x", t) == 3 * SPC
    assert writer.stats()["corrupt"] == 1 and store.chunk_counts() == {"t/c/2/0/0/0": 1}


def test_two_pipelines_of_one_process_write_one_cache_at_once(root: Path, tmp_path: Path) -> None:
    g, cache = _geoms(root), tmp_path / "cache"
    t = _read(root, "t")
    store = counting_store(root)
    x = stack({"t500": g["t"].sel(level=500), "lsm": g["lsm"]})
    y = stack({"t500": g["t"].sel(level=500).shift(1)})
    kw: dict[str, Any] = {"batch_size": 4, "coords": (), "cache_dir": cache, "persist": True}
    train = insitu_pipeline(store, _manifest(root), {"x": x, "y": y}, **kw)
    val = insitu_pipeline(store, _manifest(root), {"x": g["t"]}, split="val", **kw)
    with train, val:
        a, b = iter(Loader(train)), iter(Loader(val))
        rows = 0
        for tb in a:  # interleaved: a val batch between train batches while val lasts
            vb = next(b, None)
            if vb is not None:
                for row, i in zip(vb["x"], vb.sample_indices["x"], strict=True):
                    np.testing.assert_array_equal(row, t[int(i)])
            for row, i in zip(tb["x"][:, 0], tb.sample_indices["x"], strict=True):
                np.testing.assert_array_equal(row, t[int(i), 2])
            for row, i in zip(tb["y"][:, 0], tb.sample_indices["y"], strict=True):
                np.testing.assert_array_equal(row, t[int(i), 2])
            rows += len(tb)
    assert rows == 3 * SPC - 1  # the last anchor's lead leaves the split
    counts = store.chunk_counts()
    assert max(counts.values()) == 1, counts  # each stored object fetched once, by one of them
    assert set(counts) == {"lsm/c/0/0", *(f"t/c/{c}/0/0/0" for c in range(5))}


def test_a_windowed_forecast_stack_is_the_same_from_the_store_a_warm_cache_and_a_reader(
    root: Path, tmp_path: Path
) -> None:
    # inputs of two steps with the mask and a forcing, targets a step ahead: bit for bit the
    # batches of a pipeline without a cache, shuffled alike
    g, cache = _geoms(root), tmp_path / "cache"
    t500 = g["t"].sel(level=500)
    sun = Forcings("x", view=t500, names=["cos_solar_zenith"])
    views = {
        "x": stack({"t": t500.window([-1, 0]), "lsm": g["lsm"], "sun": sun}),
        "y": stack({"t": t500.shift(1)}),
    }
    runs = []
    for kw in ({}, {"persist": True}, {"readonly_cache": True}):
        store = counting_store(root)
        pipe = insitu_pipeline(store, _manifest(root), views, batch_size=4, seed=7,
                               **({"cache_dir": cache, **kw} if kw else {}))  # fmt: skip
        runs.append(_epoch(pipe))
        if kw.get("readonly_cache"):
            assert _chunk_gets(store, "t") == _chunk_gets(store, "lsm") == 0
    assert sum(len(b["index"]["y"]) for b in runs[0]) == 3 * SPC - 2  # (a window, a lead)
    for run in runs[1:]:
        assert len(run) == len(runs[0])
        for a, b in zip(runs[0], run, strict=True):
            for label in ("x", "y"):
                np.testing.assert_array_equal(a["arrays"][label], b["arrays"][label])
                np.testing.assert_array_equal(a["index"][label], b["index"][label])
