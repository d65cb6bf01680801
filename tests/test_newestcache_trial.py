"""Stores written newest first, concatenated, over a persistent cache; the metadata a graph
composed by hand reads; the time coordinate of three splits built by hand (the newestcache
trial of 2026-12-07).

The oracles are xarray and zarr, never the package's plan: ``xr.concat`` of the stores says
which times exist, which windows an epoch holds and what each row holds; a store wrapper
(tests/helpers.CountingStore) counts the GETs of each key.

Found right (no code changed):

1. A concatenation of stores written newest first over a persistent cache
   (``cache_dir=``, ``persist=True``): a second pipeline, over the stores wrapped afresh, GETs
   no object of the data array and delivers the first pipeline's batches bit for bit, with a
   window changed between its epochs by ``set_views``; ``StatefulDataLoader(as_dataset(pipe),
   num_workers=0)`` over it, restored mid-epoch in a fresh pipeline, delivers the rest of
   the run as the uninterrupted one did, with no GET of the data either.
3. Three splits built by hand: without a shared reader the time coordinate is read by the
   split and again by each build (4 GETs); through one ``coordinate_reader`` (documented:
   ``coords_reader=``), once. docs/concepts.md had no example of it for builds by hand; it
   has one now.

Found (fixed):

2. A graph composed by hand read each array's metadata twice where the builder, given a
   reader, reads it once: the fetch stage's store check (``check_arrays=True``) could not take
   the reader the geometries were opened with. ``AsyncChunkFetchNode(...,
   coords_reader=reader)`` now serves the check from it (one of another store is refused as
   the builder refuses it).
3b. Over a concatenation (any collection) a shared reader did not keep the members' metadata:
   each build opened every member's array again past it, twice (``MemberMap.joined``, for
   the rows' times and for the time checks), and the first member's once more (the
   collection's store check). Both now read through the reader (``_Reader.arrays_of``, each
   member once per reader, still concurrently; ``check_collection_in_store(..., reader)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, is_metadata_key, open_with_xarray, write_era5, write_sst
from resume_helpers import digest

from insitubatch_nodes import Loader, as_dataset, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.batch import to_item
from insitubatch_nodes.io.collection import concat

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(60)

HOUR = np.timedelta64(1, "h")
#: 6-hourly times from 2000-01-01T00
HOURS = pd.date_range("2000-01-01", periods=24, freq="6h")
SPC = 4  # steps an object
NAMES = ["s16", "s8", "s0"]  # the stores, newest first

# -- 1. a concatenation of stores written newest first over a persistent cache --------------------

#: the windows of the first epoch and those set_views gives for the second (anchor: 0h)
BEFORE = {"x": ["-6h", "0h"], "y": ["6h"]}
AFTER = {"x": ["-12h", "-6h", "0h"], "y": ["6h", "12h"]}


def _deltas(windows: dict[str, list[str]]) -> dict[str, list[np.timedelta64]]:
    return {k: [np.timedelta64(int(d[:-1]), "h") for d in w] for k, w in windows.items()}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """``HOURS[16:24]``, ``HOURS[8:16]`` and ``HOURS[0:8]``, each written newest first by
    xarray in chunks of 4 steps, listed newest first; the values of each store its own."""
    tmp = tmp_path_factory.mktemp("newestcache")
    out = []
    for lo in (16, 8, 0):
        root = write_sst(tmp / f"s{lo}.zarr", HOURS[lo : lo + 8][::-1], chunk=SPC)
        sst = zarr.open_array(root / "sst", mode="r+")
        sst[:] = np.asarray(sst[:]) + 1000 * lo
        out.append(root)
    return out


@pytest.fixture(scope="module")
def oracle(roots: list[Path]) -> Any:
    return xr.concat([open_with_xarray(r) for r in roots], dim="time").sst.load()


class _Stores:
    """The stores of one concatenation, each wrapped in a :class:`CountingStore` (made afresh
    per pipeline: a second pipeline shares nothing with the first but the cache folder)."""

    def __init__(self, roots: list[Path]) -> None:
        self.stores = [counting_store(r) for r in roots]

    def chunk_gets(self) -> int:
        """GETs of ``sst``'s objects (not its metadata, not the time coordinate's)."""
        return sum(
            n for s in self.stores for k, n in s.counts.items() if k.startswith("sst/c/")
        ) + sum(n for s in self.stores for k, n in s.partial_counts.items() if k.startswith("sst/"))


def _pipe(stores: _Stores, cache: Path, windows: dict[str, list[str]]) -> tuple[Any, Any]:
    """A pipeline over the concatenation of ``stores`` reading ``windows`` of its ``sst``,
    with a persistent cache at ``cache``; and the view of ``sst`` (for ``set_views``)."""
    coll = concat(stores.stores, ["sst"], names=NAMES)
    v = coll["sst"]
    views = {k: v.window(w) for k, w in windows.items()}
    pipe = insitu_pipeline(coll, split_by_chunk(v, (1.0, 0.0, 0.0)), views, coords=["time"],
                           batch_size=3, block_chunks=2, seed=5, prefetch_depth=1,
                           cache_dir=cache, persist=True)  # fmt: skip
    return pipe, v


def _windows(times: np.ndarray, windows: dict[str, list[str]]) -> list[Any]:
    """Sorted anchor times whose every step is one of ``times`` (xarray's)."""
    have = set(times)
    steps = [d for ds in _deltas(windows).values() for d in ds]
    return sorted(t for t in times if all(t + d in have for d in steps))


def _checked(batches: list[Any], oracle: Any, windows: dict[str, list[str]]) -> list[Any]:
    """Assert every row of ``batches`` is ``oracle``'s at its times, each label's steps at its
    window's deltas from one anchor; the records of the batches (positions, digests of sample
    indices, members, times and values), the anchors' sorted times last."""
    records, anchors = [], []
    for b in batches:
        rows = None
        for label, d in _deltas(windows).items():
            times = np.asarray(b.coords[label]["time"]).reshape(len(b), len(d))
            values = np.asarray(b[label]).reshape(len(b), len(d), 2, 3)
            np.testing.assert_array_equal(oracle.sel(time=times.ravel()).values.reshape(
                values.shape), values)  # fmt: skip
            at = times - np.asarray(d)
            assert (at == at[:, :1]).all(), "a row's steps are not one anchor's"
            if rows is None:
                rows = at[:, 0]
            np.testing.assert_array_equal(at[:, 0], rows)  # every label the same anchor
        anchors += list(rows)
        records.append([(b.epoch, b.index)] + [
            [digest(b.sample_indices[k]), digest(b.members[k]),
             digest(np.asarray(b.coords[k]["time"]).view("i8")), digest(b[k])]
            for k in sorted(b.arrays)])  # fmt: skip
    return [*records, sorted(anchors)]


def _run(stores: _Stores, cache: Path, oracle: Any) -> list[Any]:
    """Epoch 0 under ``BEFORE``, ``set_views`` to ``AFTER``, epoch 1: each checked."""
    pipe, sst = _pipe(stores, cache, BEFORE)
    with pipe:
        loader = Loader(pipe)
        first = _checked(list(loader), oracle, BEFORE)
        pipe.set_views({k: sst.window(w) for k, w in AFTER.items()})
        second = _checked(list(loader), oracle, AFTER)
        stats = pipe.stats()
    times = oracle.time.values
    assert first[-1] == _windows(times, BEFORE) and second[-1] == _windows(times, AFTER)
    return [first, second, stats]


def test_a_concat_newest_first_over_a_warm_cache_reads_no_object_and_delivers_the_same_batches(
    roots: list[Path], oracle: Any, tmp_path: Path
) -> None:
    """A first pipeline warms the cache over two epochs (a window changed between them by
    ``set_views``), every row ``xr.concat``'s, windows across the stores' edges; a second
    pipeline in the same sequence, over stores wrapped afresh, GETs no object of ``sst`` and
    delivers the same batches (positions, sample indices, members, times, values)."""
    assert (np.diff(oracle.time.values) == -6 * HOUR).all()  # newest first overall
    cache = tmp_path / "cache"
    warm = _Stores(roots)
    first = _run(warm, cache, oracle)
    assert warm.chunk_gets() == 3 * 8 // SPC  # each object once over the two epochs
    again = _Stores(roots)
    second = _run(again, cache, oracle)
    assert again.chunk_gets() == 0 and second[2]["gets"] == 0
    assert second[2]["disk_hits"] >= 3 * 8 // SPC
    assert second[:2] == first[:2]


def _record(item: Any) -> list[str]:
    """Digests of an item's values and sample indices."""
    return [digest(item[k]) for k in ("x", "y")] + [digest(item["sample_indices"][k]) for k in "xy"]


def _items(loader: Any, k: int | None = None) -> list[Any]:
    """Records of ``loader``'s next ``k`` items of one ``iter()`` (all of them: ``None``)."""
    it: Iterator[Any] = iter(loader)
    out = []
    for item in it:
        out.append(_record(item))
        if k is not None and len(out) == k:
            break
    return out


def test_a_stateful_dataloader_over_a_warm_cache_of_a_concat_newest_first_resumes_mid_epoch(
    roots: list[Path], oracle: Any, tmp_path: Path
) -> None:
    """``StatefulDataLoader(as_dataset(pipe), num_workers=0)`` over a warm cache: two epochs
    uninterrupted, each item's rows ``xr.concat``'s; a state after 3 items of epoch 0, restored
    in a fresh pipeline (stores wrapped afresh), delivers the rest of epoch 0 and epoch 1 as
    the uninterrupted run did, with no GET of ``sst``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    cache = tmp_path / "cache"
    _run(_Stores(roots), cache, oracle)  # warm it

    def sdl(stores: _Stores) -> tuple[Any, Any]:
        pipe = _pipe(stores, cache, BEFORE)[0]
        return pipe, StatefulDataLoader(as_dataset(pipe, transform=to_item), batch_size=None,
                                        num_workers=0)  # fmt: skip

    values = oracle.values
    stores = _Stores(roots)
    pipe, loader = sdl(stores)
    with pipe:
        ref = []
        for _ in range(2):
            for item in loader:
                for key, n in (("x", 2), ("y", 1)):
                    idx = item["sample_indices"][key].numpy().reshape(-1, n)
                    np.testing.assert_array_equal(item[key].numpy().reshape(-1, n, 2, 3),
                                                  values[idx])  # fmt: skip
                ref.append(_record(item))
    n = len(ref) // 2
    assert n >= 5 and stores.chunk_gets() == 0
    stores = _Stores(roots)
    pipe, loader = sdl(stores)
    with pipe:
        head = _items(loader, 3)
        state = loader.state_dict()
    assert head == ref[:3]
    stores = _Stores(roots)
    pipe, loader = sdl(stores)
    with pipe:
        loader.load_state_dict(state)
        rest = _items(loader)
        nxt = _items(loader)
    assert rest == ref[3:n] and nxt == ref[n:]
    assert stores.chunk_gets() == 0


# -- 2. the metadata a graph composed by hand reads ----------------------------------------------


def _reads(store: Any) -> dict[str, int]:
    """GETs per metadata document and per object of the time coordinate."""
    return {k: n for k, n in store.counts.items() if is_metadata_key(k) or k.startswith("time/")}


def _by_hand(store: Any, reader: Any, checks: Any = None) -> Any:
    """docs/pipeline.md's graph, its geometries and the rows' times read through ``reader``,
    the fetch stage's store check through ``checks`` (default: ``reader``); the root."""
    from insitubatch_nodes.io import open_coordinates
    from insitubatch_nodes.options import FetchOptions
    from insitubatch_nodes.plan import PlanConfig, choose_schedule
    from insitubatch_nodes.pool import ChunkPool
    from insitubatch_nodes.stages import (
        AsyncChunkFetchNode,
        ChunkPoolNode,
        GatherNode,
        PrefetcherNode,
        ReadPlanNode,
        StageContext,
    )

    t2m = open_geometries(store, ["t2m"], coords_reader=reader)["t2m"]
    manifest = split_by_chunk(t2m, (0.75, 0.25, 0.0))
    views = {"x": t2m, "y": t2m.shift(1)}
    config = PlanConfig(batch_size=8)
    plan = ReadPlanNode(manifest, views, schedule=choose_schedule(manifest, views, None, config),
                        config=config)  # fmt: skip
    ctx = StageContext.create(plan, ChunkPool(None), options=FetchOptions(prefetch_depth=1))
    fetch = AsyncChunkFetchNode(plan, store, context=ctx, coords_reader=checks or reader)
    time = open_coordinates(store, t2m, reader=reader)["time"].values
    gather = GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx,
                        coords={k: {"time": time} for k in views})  # fmt: skip
    return PrefetcherNode(gather, context=ctx)


@pytest.fixture(scope="module", params=[2, 3])
def era5(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"newestcache_v{request.param}") / "era5.zarr"
    return write_era5(root, n_time=32, variables=("t2m",), zarr_format=request.param)


def test_a_graph_composed_by_hand_reads_each_metadata_document_once_as_the_builder_does(
    era5: Path,
) -> None:
    """The builder given one coordinate reader (``coords_reader=``) reads each metadata
    document and the time coordinate once, geometries included; the same graph composed by
    hand (docs/pipeline.md), its fetch stage checking the store (``check_arrays=True``, the
    default) through the reader its geometries were read with, reads the same documents, each
    once too. Before, the fetch stage had no way to take the reader: its check read each
    array's metadata again (``t2m/zarr.json``, v2 ``t2m/.zarray`` and ``.zattrs``, twice).
    Each first batch is zarr's rows, with xarray's times."""
    from insitubatch_nodes.io.coords import coordinate_reader

    want = zarr.open_array(era5, path="t2m", mode="r")[...]
    times = open_with_xarray(era5).time.values
    counted = []
    for hand in (False, True):
        store = counting_store(era5)
        reader = coordinate_reader(store)
        if hand:
            root = _by_hand(store, reader)
        else:
            t2m = open_geometries(store, ["t2m"], coords_reader=reader)["t2m"]
            root = insitu_pipeline(store, split_by_chunk(t2m, (0.75, 0.25, 0.0)),
                                   {"x": t2m, "y": t2m.shift(1)}, batch_size=8,
                                   coords_reader=reader, prefetch_depth=1)  # fmt: skip
        with root:
            batch = next(iter(Loader(root)))
        idx = batch.sample_indices["x"]
        np.testing.assert_array_equal(batch["x"], want[idx])
        np.testing.assert_array_equal(batch["y"], want[idx + 1])
        np.testing.assert_array_equal(batch.coords["y"]["time"], times[idx + 1])
        reads = _reads(store)
        assert {k: n for k, n in reads.items() if n > 1} == {}, (hand, reads)
        counted.append(reads)
    assert counted[1] == counted[0]
    other = coordinate_reader(counting_store(era5))  # the same folder, another store object
    with pytest.raises(ValueError, match=r"coords_reader reads store .*era5\.zarr.*not the one"):
        _by_hand(store, coordinate_reader(store), other)


# -- 3. three splits built by hand: the time coordinate -------------------------------------------


def test_three_splits_built_by_hand_read_the_time_coordinate_once_through_one_reader(
    tmp_path: Path,
) -> None:
    """A store written newest first, split in time order (``coord=``), its train, val and test
    pipelines built with ``insitu_pipeline`` (each row carrying its time): without a shared
    reader the time coordinate is read by the split and again by each build (4 GETs of its
    object); through one ``coordinate_reader`` given to ``open_geometries``,
    ``open_coordinates`` and each build, once, and each metadata document once. Either way
    each split's rows are xarray's at their times, train the earliest."""
    from insitubatch_nodes.io import open_coordinates
    from insitubatch_nodes.io.coords import coordinate_reader

    root = write_sst(tmp_path / "newest.zarr", HOURS[::-1], chunk=SPC)
    oracle = open_with_xarray(root).sst.load()
    gets = []
    for shared in (False, True):
        store = counting_store(root)
        reader = coordinate_reader(store) if shared else None
        sst = open_geometries(store, ["sst"], coords_reader=reader)["sst"]
        time = open_coordinates(store, sst, reader=reader)["time"]
        manifest = split_by_chunk(sst, (4 / 6, 1 / 6, 1 / 6), coord=time)
        seen = {}
        for split in ("train", "val", "test"):
            with insitu_pipeline(store, manifest, {"x": sst}, split=split, batch_size=4,
                                 coords_reader=reader, prefetch_depth=1) as pipe:  # fmt: skip
                rows = [(t, x) for b in Loader(pipe)
                        for t, x in zip(b.coords["x"]["time"], b["x"], strict=True)]  # fmt: skip
            for t, x in rows:
                np.testing.assert_array_equal(x, oracle.sel(time=t).values)
            seen[split] = sorted(t for t, _ in rows)
        assert seen["train"][-1] < seen["val"][0] < seen["val"][-1] < seen["test"][0]
        reads = _reads(store)
        gets.append(sum(n for k, n in reads.items() if k.startswith("time/c/")))
        if shared:
            assert {k: n for k, n in reads.items() if n > 1} == {}, reads
    assert gets == [4, 1]


def test_three_splits_of_a_concat_newest_first_read_each_stores_metadata_once_through_one_reader(
    roots: list[Path], oracle: Any
) -> None:
    """The same over a concatenation of stores written newest first: with one reader of the
    collection's store, the split in time order and the three builds read each store's
    ``sst`` metadata, time metadata and time object once in all. Before, every build opened
    every store's ``sst`` again, past the reader (twice: the rows' times and the time checks
    each joined the stores' coordinates; the first store's once more, for the collection's
    store check): 13 GETs of the first store's ``sst/zarr.json``."""
    from insitubatch_nodes.io import open_coordinates
    from insitubatch_nodes.io.coords import coordinate_reader

    stores = _Stores(roots)
    coll = concat(stores.stores, ["sst"], names=NAMES)
    for s in stores.stores:
        s.reset_counts()  # (what concat itself reads is its own)
    reader = coordinate_reader(coll.store)
    v = coll["sst"]
    time = open_coordinates(coll.store, v, reader=reader)["time"]
    manifest = split_by_chunk(v, (4 / 6, 1 / 6, 1 / 6), coord=time)
    seen = {}
    for split in ("train", "val", "test"):
        views = {k: v.window(w) for k, w in BEFORE.items()}
        with insitu_pipeline(coll, manifest, views, split=split, batch_size=3, coords=["time"],
                             coords_reader=reader, prefetch_depth=1) as pipe:  # fmt: skip
            seen[split] = _checked(list(Loader(pipe)), oracle, BEFORE)[-1]
    assert seen["train"][-1] < seen["val"][0] and seen["val"][-1] < seen["test"][0]
    for s in stores.stores:
        reads = _reads(s)
        assert {"sst/zarr.json", "time/zarr.json", "time/c/0"} <= set(reads)
        assert {k: n for k, n in reads.items() if n > 1} == {}, reads
