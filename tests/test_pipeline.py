"""End-to-end: ``insitu_pipeline`` on real zarr stores on disk, with zarr's own read as the oracle.

Every batch is compared with ``zarr.open_group(root)[name]`` read at ``batch.sample_indices``;
stored-object GETs are counted at the store (a ``zarr.storage.LocalStore`` in a counting
wrapper); memory and concurrency bounds are sampled while batches flow.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from helpers import (
    Oracle,
    TrackingBacking,
    View,
    assert_batch_matches,
    assert_same_records,
    chunk_keys_on_disk,
    counting_store,
    expected_anchors,
    expected_chunk_keys,
    run_epoch,
    wait_until,
    write_era5,
    write_microscopy,
    write_mixed_chunking,
)
from torchdata.nodes import Loader

from insitubatch_nodes import (
    ArrayGeometry,
    Batch,
    SplitManifest,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    to_torch,
)
from insitubatch_nodes.errors import ChunkReadError, DecodeError
from insitubatch_nodes.lending import BufferPool
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.schedule import schedule_floors

# zarr warns that numcodecs' LZ4 is not in the v3 spec whenever it opens the v3_lz4 layout
# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = [
    pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr"),
    pytest.mark.xdist_group("pipeline"),
]

# ---------------------------------------------------------------------------------------------
# Cases: a store on disk, the views the pipeline trains on, the same views for the oracle
# ---------------------------------------------------------------------------------------------

ERA5_LAYOUTS: dict[str, dict[str, Any]] = {
    "v2": {"zarr_format": 2},
    "v3": {"zarr_format": 3},
    # 100 samples in shards of 16: the final shard is partial
    "sharded_v3": {"zarr_format": 3, "n_time": 100, "shard_samples": 16},
    # tiles of 3 x 5 on a 10 x 13 field: partial edge tiles on both field axes
    "inner_chunked": {"inner_chunks": (3, 5), "n_lat": 10, "n_lon": 13},
    "v2_inner_chunked_blosc": {
        "zarr_format": 2,
        "inner_chunks": (4, 6),
        "n_lat": 9,
        "n_lon": 14,
        "compressor": "blosc",
    },
    "sharded_inner_chunked": {
        "zarr_format": 3,
        "shard_samples": 16,
        "inner_chunks": (4, 8),
        "n_lat": 8,
        "n_lon": 16,
    },
    "v3_lz4": {"compressor": "lz4"},
    "v3_gzip": {"compressor": "gzip"},
    "v3_uncompressed": {"compressor": "none"},
}
OTHER_CASES = ("microscopy", "mixed_anchor_a", "mixed_anchor_b")


@dataclass
class Case:
    root: Path
    views: dict[str, ArrayGeometry]  # what the pipeline reads
    oracle_views: dict[str, View]  # the same, described for the oracle
    manifest: SplitManifest
    anchor: str  # the label whose offset is 0

    @property
    def offsets(self) -> list[int]:
        return [v.offset for v in self.oracle_views.values()]


def build_case(kind: str, root: Path, *, write: bool = True) -> Case:
    """The store of ``kind`` written at ``root`` (or, ``write=False``, already there: a copy
    of one) and the views read from it."""
    if kind in ERA5_LAYOUTS:
        if write:
            write_era5(root, **ERA5_LAYOUTS[kind])
        g = open_geometries(root, ["t2m", "z"])
        views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
        oviews = {"x": View("t2m"), "y": View("t2m", 0, 1), "z": View("z")}
        return Case(root, views, oviews, split_by_chunk(g["t2m"]), "x")
    if kind == "microscopy":
        if write:
            write_microscopy(root)
        g = open_geometries(root, sample_axis=2)  # image and mask, no coordinates
        assert sorted(g) == ["image", "mask"]
        views = {"image": g["image"], "mask": g["mask"], "image_next": g["image"].shift(1)}
        oviews = {
            "image": View("image", 2),
            "mask": View("mask", 2),
            "image_next": View("image", 2, 1),
        }
        return Case(root, views, oviews, split_by_chunk(g["image"]), "image")
    if kind.startswith("mixed_anchor_"):
        if write:
            write_mixed_chunking(root)
        g = open_geometries(root, ["a", "b"])
        anchor = kind[-1]
        views = {"a": g["a"], "b": g["b"], "b_next": g["b"].shift(2)}
        oviews = {"a": View("a"), "b": View("b"), "b_next": View("b", 0, 2)}
        return Case(root, views, oviews, split_by_chunk(g[anchor]), "a")
    raise ValueError(kind)


@pytest.fixture(scope="module")
def shared_case(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Case]:
    """``shared_case(kind)``: the module's one store of that layout, written at its first use
    and only read after (tests that damage a store take a copy: :func:`own_case`)."""
    built: dict[str, Case] = {}

    def get(kind: str) -> Case:
        if kind not in built:
            built[kind] = build_case(kind, tmp_path_factory.mktemp(kind) / "store.zarr")
        return built[kind]

    return get


@pytest.fixture
def own_case(shared_case: Callable[[str], Case], tmp_path: Path) -> Callable[[str], Case]:
    """``own_case(kind)``: a store of that layout of this test's own, to damage: a file-by-file
    copy of the module's (the same bytes zarr wrote; a copy costs a fraction of writing
    again, 0.06 s against 0.3 s for the tiled layout of 444 files)."""

    def get(kind: str) -> Case:
        root = tmp_path / "store.zarr"
        shutil.copytree(shared_case(kind).root, root, copy_function=shutil.copyfile)
        return build_case(kind, root, write=False)

    return get


@pytest.fixture(scope="module", params=[*ERA5_LAYOUTS, *OTHER_CASES])
def case(request: pytest.FixtureRequest, shared_case: Callable[[str], Case]) -> Case:
    """One read-only store per layout, shared by the tests of this module."""
    return shared_case(request.param)


@pytest.fixture(scope="module")
def tiled(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """An inner-chunked ERA5-like store with many tiles per chunk (for concurrency bounds)."""
    root = tmp_path_factory.mktemp("tiled") / "store.zarr"
    write_era5(root, n_time=64, n_lat=16, n_lon=32, inner_chunks=(4, 8))
    g = open_geometries(root, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    oviews = {"x": View("t2m"), "y": View("t2m", 0, 1), "z": View("z")}
    return Case(root, views, oviews, split_by_chunk(g["t2m"]), "x")


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """A plain v3 ERA5-like store, 160 steps in chunks of 8, x = t2m, y = t2m.shift(1)."""
    root = tmp_path_factory.mktemp("era5") / "store.zarr"
    write_era5(root, n_time=160, variables=("t2m",))
    g = open_geometries(root, ["t2m"])["t2m"]
    views = {"x": g, "y": g.shift(1)}
    oviews = {"x": View("t2m"), "y": View("t2m", 0, 1)}
    return Case(root, views, oviews, split_by_chunk(g), "x")


def anchors_of(records: list[dict[str, Any]], label: str) -> np.ndarray:
    return np.concatenate([r["sample_indices"][label] for r in records])


# ---------------------------------------------------------------------------------------------
# 1-2. Values equal zarr's read; every valid sample exactly once
# ---------------------------------------------------------------------------------------------


def test_every_batch_equals_zarrs_own_read_over_a_full_epoch(case: Case) -> None:
    oracle = Oracle(case.root)
    pipe = insitu_pipeline(case.root, case.manifest, case.views, batch_size=10, block_chunks=3)
    records = run_epoch(pipe, oracle, case.oracle_views)
    assert len(records) == len(pipe) > 1
    assert [r["index"] for r in records] == list(range(len(records)))
    assert all(r["len"] == 10 for r in records[:-1]) and 0 < records[-1]["len"] <= 10


def test_every_valid_sample_is_delivered_exactly_once_per_epoch(case: Case) -> None:
    pipe = insitu_pipeline(case.root, case.manifest, case.views, batch_size=7, block_chunks=2)
    want = expected_anchors(case.manifest, "train", case.offsets)
    for epoch in range(2):
        if epoch:
            pipe.reset()
        records = run_epoch(pipe)
        assert {r["epoch"] for r in records} == {epoch}
        got = anchors_of(records, case.anchor)
        assert len(got) == len(np.unique(got)), "a sample was delivered twice"
        np.testing.assert_array_equal(np.sort(got), want)


@pytest.mark.parametrize("split", ["train", "val", "test"])
@pytest.mark.parametrize("offsets", [(0,), (0, 1), (0, -3), (-2, 0, 5)], ids=str)
def test_every_valid_sample_of_each_split_is_delivered_once_with_shifted_views(
    era5: Case, split: str, offsets: tuple[int, ...]
) -> None:
    g = era5.views["x"]
    views = {f"v{k}": g.shift(k) for k in offsets}
    oviews = {f"v{k}": View("t2m", 0, k) for k in offsets}
    pipe = insitu_pipeline(era5.root, era5.manifest, views, split=split, batch_size=6)
    records = run_epoch(pipe, Oracle(era5.root), oviews)
    got = anchors_of(records, "v0")
    want = expected_anchors(era5.manifest, split, offsets)
    assert len(want) > 0
    np.testing.assert_array_equal(np.sort(got), want)
    assert len(got) == len(want)


@pytest.mark.parametrize("shift", [1, -1, -3, 11, -20], ids=lambda k: f"shift{k:+d}")
def test_shift_windows_read_the_shifted_samples_and_equal_zarrs_read(
    era5: Case, shift: int
) -> None:
    g = era5.views["x"]
    oracle = Oracle(era5.root)
    pipe = insitu_pipeline(era5.root, era5.manifest, {"x": g, "y": g.shift(shift)}, batch_size=9)
    records = run_epoch(pipe, oracle, {"x": View("t2m"), "y": View("t2m", 0, shift)})
    for r in records:
        np.testing.assert_array_equal(r["sample_indices"]["y"], r["sample_indices"]["x"] + shift)
    got = np.sort(anchors_of(records, "x"))
    np.testing.assert_array_equal(got, expected_anchors(era5.manifest, "train", [0, shift]))


def test_shuffle_false_yields_the_split_in_sequential_order(case: Case) -> None:
    pipe = insitu_pipeline(
        case.root, case.manifest, case.views, batch_size=6, block_chunks=2, shuffle=False
    )
    records = run_epoch(pipe, Oracle(case.root), case.oracle_views)
    got = anchors_of(records, case.anchor)
    np.testing.assert_array_equal(got, expected_anchors(case.manifest, "train", case.offsets))


def test_shuffled_epochs_are_permutations_that_differ_from_the_sequential_order(
    era5: Case,
) -> None:
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=8, seed=3)
    e0 = anchors_of(run_epoch(pipe), "x")
    pipe.reset()
    e1 = anchors_of(run_epoch(pipe), "x")
    want = expected_anchors(era5.manifest, "train", [0, 1])
    assert not np.array_equal(e0, want) and not np.array_equal(e0, e1)
    np.testing.assert_array_equal(np.sort(e0), np.sort(e1))


@pytest.mark.parametrize("layout", ["v3", "v2", "sharded_v3", "inner_chunked"])
def test_a_chunk_missing_from_the_store_reads_as_the_fill_value_like_zarr(
    own_case: Callable[[str], Case], layout: str
) -> None:
    case = own_case(layout)
    keys = chunk_keys_on_disk(case.root, "t2m")
    # the manifest's anchor grid is t2m's stored grid (shards on a sharded array)
    victim = sorted(k for k, c in keys.items() if c[0] == case.manifest.chunks("train")[2])[0]
    (case.root / victim).unlink()
    oracle = Oracle(case.root)
    pipe = insitu_pipeline(case.root, case.manifest, case.views, batch_size=10)
    records = run_epoch(pipe, oracle, case.oracle_views, keep_arrays=True)
    # zarr's fill value for these arrays is NaN: the missing chunk really was missing
    assert any(np.isnan(r["arrays"]["x"]).any() for r in records)


def _codec_specs() -> dict[str, dict[str, Any]]:
    import numcodecs
    from zarr.codecs import BytesCodec, Crc32cCodec, TransposeCodec, ZstdCodec

    return {
        "v2_big_endian_fortran_order": {
            "zarr_format": 2,
            "dtype": ">i2",
            "order": "F",
            "compressors": numcodecs.Zstd(),
        },
        "v2_big_endian_f8": {"zarr_format": 2, "dtype": ">f8"},
        "v2_delta_filter_blosc": {
            "zarr_format": 2,
            "dtype": "i4",
            "filters": [numcodecs.Delta(dtype="i4")],
            "compressors": numcodecs.Blosc(),
        },
        "v3_transpose": {
            "zarr_format": 3,
            "dtype": "f4",
            "filters": [TransposeCodec(order=(2, 0, 1))],
        },
        "v3_big_endian_bytes": {
            "zarr_format": 3,
            "dtype": "i4",
            "serializer": BytesCodec(endian="big"),
            "compressors": [ZstdCodec()],
        },
        "v3_crc32c": {"zarr_format": 3, "dtype": "u2", "compressors": [ZstdCodec(), Crc32cCodec()]},
        "v3_sharded_tiled_with_empty_inner_chunks": {
            "zarr_format": 3,
            "dtype": "i2",
            "chunks": (4, 3, 3),
            "shards": (8, 6, 6),
        },
    }


@pytest.mark.parametrize("codecs", list(_codec_specs()))
def test_every_batch_equals_zarrs_read_whatever_the_codec_chain(
    tmp_path: Path, codecs: str
) -> None:
    spec = dict(_codec_specs()[codecs])
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=spec.pop("zarr_format"))
    shape, dtype = (50, 7, 9), np.dtype(spec.pop("dtype"))
    spec.setdefault("chunks", (6, 5, 4))
    arr = group.create_array("a", shape=shape, dtype=dtype, fill_value=0, **spec)
    rng = np.random.default_rng(3)
    data = rng.integers(1, 100, shape).astype(dtype)
    data[8:16] = 0  # a whole row of stored objects is the fill value: zarr does not write it
    data[16:20, :3, :3] = 0  # ... nor these inner chunks of a shard
    arr[...] = data
    g = open_geometries(root, ["a"])["a"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": g, "prev": g.shift(-1)}, batch_size=7)
    records = run_epoch(pipe, Oracle(root), {"x": View("a"), "prev": View("a", 0, -1)})
    assert len(np.concatenate([r["sample_indices"]["x"] for r in records])) == 49


# ---------------------------------------------------------------------------------------------
# 3. Each stored object fetched exactly once per epoch, counted at the store
# ---------------------------------------------------------------------------------------------


def test_each_stored_object_is_fetched_exactly_once_per_epoch_at_the_default_budget(
    case: Case,
) -> None:
    store = counting_store(case.root)
    oracle = Oracle(case.root)
    pipe = insitu_pipeline(store, case.manifest, case.views, batch_size=10, block_chunks=3)
    store.reset_counts()  # building the pipeline reads metadata only, but start clean
    records = run_epoch(pipe, oracle, case.oracle_views)
    want = expected_chunk_keys(oracle, case.oracle_views, records)
    got = store.chunk_counts()
    assert not (set(got) - want), f"objects no batch needed: {sorted(set(got) - want)[:5]}"
    assert not (want - set(got)), f"objects never fetched: {sorted(want - set(got))[:5]}"
    assert {k: n for k, n in got.items() if n != 1} == {}, "objects fetched more than once"
    assert not store.partial_counts
    assert pipe.stats()["gets"] == len(want)

    pipe.reset()  # a second epoch at the default budget: still at most one GET per object
    store.reset_counts()
    run_epoch(pipe, oracle, case.oracle_views)
    assert max(store.chunk_counts().values(), default=0) <= 1


@pytest.mark.parametrize("layout", ["v2", "sharded_v3", "inner_chunked", "microscopy"])
@pytest.mark.parametrize("how", ["reset", "loader"])
def test_a_second_epoch_with_a_budget_that_holds_the_split_makes_no_chunk_gets(
    shared_case: Callable[[str], Case], layout: str, how: str
) -> None:
    case = shared_case(layout)
    store = counting_store(case.root)
    oracle = Oracle(case.root)
    pipe = insitu_pipeline(
        store,
        case.manifest,
        case.views,
        batch_size=10,
        block_chunks=3,
        cache_budget_bytes=64 * 2**20,
    )
    loader = Loader(pipe)
    epochs = []
    for epoch in range(2):
        store.reset_counts()
        if how == "reset":
            if epoch:
                pipe.reset()
            records = run_epoch(pipe, oracle, case.oracle_views)
        else:
            records = run_epoch(loader, oracle, case.oracle_views)
        assert {r["epoch"] for r in records} == {epoch}
        epochs.append(store.chunk_counts())
    assert epochs[0] and max(epochs[0].values()) == 1
    assert epochs[1] == {}, f"{len(epochs[1])} chunk GETs in the cached epoch"
    assert pipe.stats()["evictions"] == 0


# ---------------------------------------------------------------------------------------------
# 5. Bounds: in-flight GETs, resident bytes, the budget floor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
def test_gets_in_flight_never_exceed_max_inflight(tiled: Case, max_inflight: int) -> None:
    # each chunk GET sleeps 2 ms inside the store, so GETs that may overlap do overlap
    store = counting_store(tiled.root, delay=0.002)
    pipe = insitu_pipeline(
        store, tiled.manifest, tiled.views, batch_size=8, max_inflight=max_inflight
    )
    seen: list[int] = []
    run_epoch(
        pipe,
        Oracle(tiled.root),
        tiled.oracle_views,
        each=lambda b: seen.append(pipe.stages.fetch.inflight),
    )
    assert pipe.stats()["inflight_peak"] <= max_inflight
    assert store.peak <= max_inflight, f"the store saw {store.peak} concurrent GETs"
    assert store.peak >= min(max_inflight, 2), "the bound was never even reached"
    assert max(seen) <= max_inflight


class _Sampler:
    """Polls the pool's resident and allocated bytes on a thread while batches flow."""

    def __init__(self, pipe: Any) -> None:
        self.pool = pipe.stages.pool
        self.resident = 0
        self.allocated = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(0.0002)

    def sample(self) -> None:
        self.resident = max(self.resident, self.pool.stats.resident_bytes)
        self.allocated = max(self.allocated, self.pool.allocated_bytes)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _floor_from_error(case: Case, **kwargs: Any) -> int:
    with pytest.raises(ValueError, match="floor") as info:
        insitu_pipeline(case.root, case.manifest, case.views, cache_budget_bytes=1, **kwargs)
    found = re.search(r"floor of ([\d,]+) bytes", str(info.value))
    assert found, f"the message does not state the floor in bytes: {info.value}"
    return int(found.group(1).replace(",", ""))


@pytest.mark.parametrize("budget", ["auto", "floor", "generous"])
def test_resident_and_allocated_bytes_never_exceed_the_budget(tiled: Case, budget: str) -> None:
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 2, "max_inflight": 3}
    explicit = {
        "auto": None,
        "floor": _floor_from_error(tiled, **kwargs),
        "generous": 8 * 2**20,
    }[budget]
    store = counting_store(tiled.root, delay=0.001)
    backing = TrackingBacking()  # counts the slot memory independently of the pool
    pipe = insitu_pipeline(
        store, tiled.manifest, tiled.views, cache_budget_bytes=explicit, backing=backing, **kwargs
    )
    limit = pipe.stages.pool.budget_bytes
    if explicit is not None:
        assert limit == explicit
    with _Sampler(pipe) as sampler:
        run_epoch(pipe, Oracle(tiled.root), tiled.oracle_views, each=lambda b: sampler.sample())
    assert 0 < sampler.resident <= limit
    assert 0 < sampler.allocated <= limit
    assert pipe.stats()["resident_peak_bytes"] <= limit
    assert pipe.stages.pool.allocated_bytes <= limit
    assert 0 < backing.peak <= limit
    assert backing.outstanding == pipe.stages.pool.allocated_bytes


def test_a_budget_below_the_floor_raises_at_construction_stating_the_floor(tiled: Case) -> None:
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 2}
    floor = _floor_from_error(tiled, **kwargs)
    with pytest.raises(ValueError, match=f"{floor:,}"):
        insitu_pipeline(
            tiled.root, tiled.manifest, tiled.views, cache_budget_bytes=floor - 1, **kwargs
        )
    # exactly the floor is enough: an epoch runs through (and stays correct)
    pipe = insitu_pipeline(
        tiled.root, tiled.manifest, tiled.views, cache_budget_bytes=floor, **kwargs
    )
    run_epoch(pipe, Oracle(tiled.root), tiled.oracle_views)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="cache_budget_bytes"):
            insitu_pipeline(
                tiled.root, tiled.manifest, tiled.views, cache_budget_bytes=bad, **kwargs
            )


def _floor(root: Path, views: dict[str, ArrayGeometry], manifest: SplitManifest) -> int:
    with pytest.raises(ValueError, match="floor") as info:
        insitu_pipeline(root, manifest, views, batch_size=32, block_chunks=4, cache_budget_bytes=1)
    found = re.search(r"floor of ([\d,]+) bytes", str(info.value))
    assert found
    return int(found.group(1).replace(",", ""))


def test_a_shifted_view_keeps_the_memory_floor_proportional_to_a_block_not_to_the_split(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store.zarr"  # metadata only: no chunk is read to build a pipeline
    zarr.open_group(root, mode="w").create_array(
        "a", shape=(256 * 16, 4), chunks=(16, 4), dtype="f4", fill_value=0
    )
    g = open_geometries(root, ["a"])["a"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    alone = _floor(root, {"x": g}, manifest)
    split_bytes = 256 * g.chunk_nbytes
    assert alone <= 16 * g.chunk_nbytes
    half = split_by_chunk(g, (0.5, 0.5, 0.0))
    for k in (1, -1):
        shifted = _floor(root, {"x": g, "y": g.shift(k)}, manifest)
        # a few blocks' chunks plus their neighbours, and the read-ahead (bounded over every
        # epoch): a few times the floor of the unshifted view, nowhere near the whole split
        assert shifted <= 5 * alone, (
            f"shift({k}): floor {shifted:,} B = {shifted / split_bytes:.0%} of the split "
            f"(the unshifted view needs {alone:,} B)"
        )
        # and it does not grow with the split
        assert _floor(root, {"x": g, "y": g.shift(k)}, half) == shifted


ShiftedStore = tuple[Path, dict[str, ArrayGeometry], SplitManifest]


@pytest.fixture(scope="module")
def shifted_store(tmp_path_factory: pytest.TempPathFactory) -> ShiftedStore:
    """A store of 512 steps in 64 chunks of 8 (read only), views x = t2m, y = t2m.shift(1),
    and a manifest with every chunk in train."""
    root = tmp_path_factory.mktemp("shifted") / "store.zarr"
    write_era5(root, n_time=512, n_lat=4, n_lon=8, variables=("t2m",))
    g = open_geometries(root, ["t2m"])["t2m"]  # 64 chunks of 8
    return root, {"x": g, "y": g.shift(1)}, split_by_chunk(g, (1.0, 0.0, 0.0))


def test_a_budget_below_the_read_once_floor_releases_idle_chunks_and_reads_them_again(
    shifted_store: ShiftedStore,
) -> None:
    root, views, manifest = shifted_store
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 4}
    floors = schedule_floors(manifest, views, PlanConfig(**kwargs))  # bounds over every epoch
    bounded_floor = _floor_of(root, manifest, views, **kwargs)
    assert bounded_floor == floors.bounded
    # the bounded schedule needs about half the memory of read-once (every chunk of the split)
    assert bounded_floor < 0.6 * floors.read_once
    once_floor = insitu_pipeline(root, manifest, views, **kwargs).stages.pool.budget_bytes
    assert bounded_floor < once_floor  # less than even epoch 0's own read-once floor
    with pytest.raises(ValueError, match="reading each chunk once per epoch needs"):
        insitu_pipeline(root, manifest, views, cache_budget_bytes=bounded_floor - 1, **kwargs)

    store = counting_store(root)
    pipe = insitu_pipeline(  # no coordinate: the store's counts are the epoch's chunk reads
        store, manifest, views, cache_budget_bytes=bounded_floor, coords=(), **kwargs
    )
    oracle = Oracle(root)
    peaks: list[int] = []
    records = run_epoch(
        pipe,
        oracle,
        {"x": View("t2m"), "y": View("t2m", 0, 1)},
        each=lambda _: peaks.append(pipe.stages.pool.allocated_bytes),
    )
    anchors = anchors_of(records, "x")
    np.testing.assert_array_equal(np.sort(anchors), expected_anchors(manifest, "train", [0, 1]))
    assert max(peaks) <= bounded_floor
    counts = store.chunk_counts()
    plan = pipe.stages.plan.epoch_plan(0)
    # every planned (re-)admission is a GET unless the chunk was still resident (an LRU hit)
    assert sum(counts.values()) == pipe.stats()["gets"] <= plan.n_fetches
    assert sum(counts.values()) + pipe.stats()["hits"] == plan.n_fetches
    assert max(counts.values()) == 2  # a neighbour read early, released, read again later
    assert plan.n_fetches < 2 * len(plan.distinct_chunks())


def test_an_automatic_budget_over_a_quarter_of_ram_switches_to_the_bounded_schedule(
    shifted_store: ShiftedStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import insitubatch_nodes.plan.schedule as schedule_module

    root, views, manifest = shifted_store
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 4}
    # (a split under a sixteenth of RAM is kept whole: this is about one that is not)
    monkeypatch.setattr(schedule_module, "_auto_keep_bytes", lambda: 0)
    once = insitu_pipeline(root, manifest, views, **kwargs).stages.pool.budget_bytes
    monkeypatch.setattr(schedule_module, "_auto_cap_bytes", lambda: once - 1)
    with caplog.at_level("WARNING", logger="insitubatch_nodes.plan.schedule"):
        pipe = insitu_pipeline(root, manifest, views, **kwargs)
    assert pipe.stages.plan.pin_gap is not None
    assert pipe.stages.pool.budget_bytes < once / 2
    assert "re-read" in caplog.text
    records = run_epoch(pipe, Oracle(root), {"x": View("t2m"), "y": View("t2m", 0, 1)})
    assert sum(len(r["sample_indices"]["x"]) for r in records) == 511


def _floor_of(
    root: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry], **kwargs: Any
) -> int:
    with pytest.raises(ValueError, match="floor") as info:
        insitu_pipeline(root, manifest, views, cache_budget_bytes=1, **kwargs)
    found = re.search(r"floor of ([\d,]+) bytes", str(info.value))
    assert found
    return int(found.group(1).replace(",", ""))


# ---------------------------------------------------------------------------------------------
# 7. Errors reach the consumer, precisely, and never hang
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["obstore", "zarr_local_store"])
@pytest.mark.parametrize("layout", ["v3", "v2", "inner_chunked", "sharded_v3"])
def test_a_corrupt_stored_chunk_raises_chunk_read_error_naming_array_chunk_and_key(
    own_case: Callable[[str], Case], reader: str, layout: str
) -> None:
    case = own_case(layout)
    chunk = case.manifest.chunks("train")[3]
    keys = chunk_keys_on_disk(case.root, "t2m")
    # the manifest's anchor grid is t2m's stored grid (shards on a sharded array)
    key = sorted(k for k, c in keys.items() if c[0] == chunk)[-1]
    (case.root / key).write_bytes(b"\x00garbage\xff" * 40)
    store = case.root if reader == "obstore" else counting_store(case.root)
    pipe = insitu_pipeline(store, case.manifest, case.views, batch_size=10, block_chunks=3)
    with pytest.raises(ChunkReadError) as info:
        for _ in pipe:
            pass
    err = info.value
    message = str(err)
    stored_chunk = keys[key][0]
    assert "'t2m'" in message
    assert f"chunk {stored_chunk}" in message
    assert key in message
    assert err.__cause__ is not None
    assert (err.array, err.chunk_index, err.key) == ("t2m", stored_chunk, key)
    if layout == "inner_chunked":
        assert f"tile {keys[key][1:]}" in message
    # the failed pipeline is torn down: no thread, nothing pinned
    assert pipe.threads == []
    assert pipe.stages.pool.pinned_count() == 0
    assert pipe.stages.fetch.pinned == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["obstore", "zarr_local_store"])
@pytest.mark.parametrize("layout", ["v3", "v2", "inner_chunked", "sharded_v3"])
def test_a_zero_byte_stored_object_fails_the_epoch_as_zarrs_own_read_of_it_fails(
    own_case: Callable[[str], Case], reader: str, layout: str
) -> None:
    case = own_case(layout)
    chunk = case.manifest.chunks("train")[2]
    keys = chunk_keys_on_disk(case.root, "t2m")
    key = sorted(k for k, c in keys.items() if c[0] == chunk)[0]
    (case.root / key).write_bytes(b"")
    oracle = Oracle(case.root)
    first = chunk * oracle.stored_samples_per_chunk("t2m")
    with pytest.raises(Exception):  # noqa: B017 - zarr's error type depends on the codec
        oracle("t2m", np.array([first]))
    store = case.root if reader == "obstore" else counting_store(case.root)
    pipe = insitu_pipeline(store, case.manifest, case.views, batch_size=10, block_chunks=3)
    with pytest.raises(ChunkReadError, match=re.escape(key)) as info:
        run_epoch(pipe)
    assert "decode" in str(info.value)
    assert isinstance(info.value.__cause__, DecodeError)
    assert pipe.threads == []


@pytest.mark.timeout(60)
def test_a_store_error_raises_chunk_read_error_with_the_store_error_as_cause(
    era5: Case,
) -> None:
    keys = chunk_keys_on_disk(era5.root, "t2m")
    key = next(k for k, c in keys.items() if c[0] == era5.manifest.chunks("train")[4])
    store = counting_store(era5.root, fail={key: OSError("connection reset by peer")})
    pipe = insitu_pipeline(store, era5.manifest, era5.views, batch_size=10)
    with pytest.raises(ChunkReadError, match=re.escape(key)) as info:
        run_epoch(pipe)
    assert "read" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert "connection reset" in str(info.value.__cause__)
    assert pipe.threads == []


def _exploding_transform(batch: Batch) -> Batch:
    if batch.index == 2:
        raise ZeroDivisionError("the transform blew up on batch 2")
    return batch


@pytest.mark.timeout(60)
def test_an_exception_in_a_batch_transform_reaches_the_consumer_with_its_traceback(
    era5: Case,
) -> None:
    pipe = insitu_pipeline(
        era5.root,
        era5.manifest,
        era5.views,
        batch_size=10,
        batch_transforms=[_exploding_transform],
    )
    delivered = []
    with pytest.raises(ZeroDivisionError, match="blew up on batch 2") as info:
        for batch in pipe:
            delivered.append(batch.index)
    assert delivered == [0, 1]
    frames = traceback.extract_tb(info.value.__traceback__)
    assert "_exploding_transform" in [f.name for f in frames]
    assert frames[-1].name == "_exploding_transform"
    assert pipe.threads == []
    assert pipe.stages.pool.pinned_count() == 0


@pytest.mark.timeout(60)
def test_a_corrupt_chunk_raises_promptly_while_slow_gets_are_in_flight(
    own_case: Callable[[str], Case],
) -> None:
    case = own_case("inner_chunked")
    chunk = case.manifest.chunks("train")[1]
    key = next(k for k, c in chunk_keys_on_disk(case.root, "t2m").items() if c == (chunk, 1, 1))
    (case.root / key).write_bytes(b"junk" * 30)
    store = counting_store(case.root, delay=0.3)  # every GET takes 0.3 s
    pipe = insitu_pipeline(
        store, case.manifest, case.views, batch_size=10, max_inflight=8, shuffle=False
    )
    with pytest.raises(ChunkReadError, match=re.escape(key)):
        run_epoch(pipe)
    assert pipe.threads == []
    assert pipe.stages.pool.pinned_count() == 0
    assert wait_until(lambda: store.active == 0, timeout=10)


@pytest.mark.timeout(60)
def test_after_a_transient_transform_error_iteration_resumes_at_the_failed_batch(
    era5: Case,
) -> None:
    failed: list[int] = []

    def flaky(batch: Batch) -> Batch:
        if batch.index == 2 and not failed:
            failed.append(batch.index)
            raise RuntimeError("transient failure")
        return batch

    pipe = insitu_pipeline(
        era5.root, era5.manifest, era5.views, batch_size=10, batch_transforms=[flaky]
    )
    reference = run_epoch(
        insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=10), keep_arrays=True
    )
    first = run_epoch([next(pipe), next(pipe)])
    with pytest.raises(RuntimeError, match="transient failure"):
        next(pipe)
    rest = run_epoch(pipe, Oracle(era5.root), era5.oracle_views, keep_arrays=True)
    assert_same_records(first, reference[:2])
    assert_same_records(rest, reference[2:])


# ---------------------------------------------------------------------------------------------
# 8. Train and val side by side
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_train_and_val_pipelines_iterated_together_finish_and_are_both_correct(
    shared_case: Callable[[str], Case],
) -> None:
    case = shared_case("inner_chunked")
    manifest = split_by_chunk(case.views["x"].base, (0.6, 0.4, 0.0))
    store = counting_store(case.root, delay=0.001)  # one store, GETs interleave on one loop
    oracle = Oracle(case.root)
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 2, "max_inflight": 2}
    train = insitu_pipeline(store, manifest, case.views, split="train", **kwargs)
    val = insitu_pipeline(store, manifest, case.views, split="val", **kwargs)
    seen: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for epoch in range(2):
        if epoch:
            train.reset()
            val.reset()
        for bt, bv in itertools.zip_longest(train, val):
            for name, b in (("train", bt), ("val", bv)):
                if b is not None:
                    assert_batch_matches(b, oracle, case.oracle_views)
                    assert b.epoch == epoch
                    seen[name].append(np.array(b.sample_indices["x"]))
    for name, pipe in (("train", train), ("val", val)):
        got = np.sort(np.concatenate(seen[name]))
        want = expected_anchors(manifest, name, case.offsets)
        np.testing.assert_array_equal(got, np.sort(np.concatenate([want, want])))
        assert pipe.threads == []
        assert pipe.stages.pool.pinned_count() == 0


# ---------------------------------------------------------------------------------------------
# 9. Batch buffers
# ---------------------------------------------------------------------------------------------


def test_the_short_final_batch_is_a_prefix_view_of_a_full_size_buffer(era5: Case) -> None:
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=7)
    batches = list(pipe)
    last = batches[-1]
    assert 0 < len(last) < 7
    for label, arr in last.arrays.items():
        full = arr.base
        assert full is not None, f"{label}: the short batch is not a view"
        assert full.nbytes == 7 * arr[0].nbytes  # the memory of a full-size batch
        assert arr.ctypes.data == full.ctypes.data  # a prefix: it starts where the buffer does
        assert arr.flags.c_contiguous
    assert_batch_matches(last, Oracle(era5.root), era5.oracle_views)
    for b in batches[:-1]:
        assert all(a.shape[0] == 7 for a in b.arrays.values())


@pytest.mark.parametrize("batch_size", [1, 1000])
def test_extreme_batch_sizes_deliver_every_sample_once(era5: Case, batch_size: int) -> None:
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=batch_size)
    records = run_epoch(pipe, Oracle(era5.root), era5.oracle_views)
    want = expected_anchors(era5.manifest, "train", [0, 1])
    assert len(records) == -(-len(want) // batch_size)
    np.testing.assert_array_equal(np.sort(anchors_of(records, "x")), want)


def _small_split(era5: Case) -> tuple[SplitManifest, np.ndarray]:
    """A train split of 8 chunks (64 samples; 63 valid anchors for x and y = x.shift(1))."""
    manifest = split_by_chunk(era5.views["x"], (0.4, 0.6, 0.0))
    want = expected_anchors(manifest, "train", [0, 1])
    assert len(manifest.samples("train")) == 64 and len(want) == 63
    return manifest, want


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2)])
def test_a_batch_size_far_above_the_split_builds_buffers_of_what_the_rank_delivers(
    era5: Case, rank: int, world: int
) -> None:
    manifest, want = _small_split(era5)
    pipe = insitu_pipeline(
        era5.root, manifest, era5.views, batch_size=100_000, rank=rank, world_size=world
    )
    delivered = len(want) // world  # remainder="drop": at most world - 1 samples sit out
    records = run_epoch(pipe, Oracle(era5.root), era5.oracle_views)
    assert len(pipe) == len(records) == 1  # the whole split of this rank in one batch
    got = anchors_of(records, "x")
    assert len(got) == delivered and set(got.tolist()) <= set(want.tolist())
    sample_bytes = sum(math.prod(v.inner_shape) * v.dtype.itemsize for v in era5.views.values())
    # buffers of 100,000 rows would take 100 MB; these hold the rank's 63 (or 31) samples
    assert pipe.stages.gather.buffer_bytes <= 8 * delivered * sample_bytes
    assert pipe.stages.gather.rows == delivered
    pipe.close()


def test_a_batch_size_no_batch_could_hold_is_refused_at_build_naming_the_split_and_what_fits(
    era5: Case,
) -> None:
    manifest, want = _small_split(era5)
    with pytest.raises(ValueError) as info:
        insitu_pipeline(era5.root, manifest, era5.views, batch_size=10**12)
    message = str(info.value)
    assert "batch_size=1,000,000,000,000" in message  # what was asked
    assert "TiB" in message and "memory" in message  # why it cannot be
    assert f"Split 'train' delivers {len(want)} samples per epoch" in message  # the split
    assert f"at most {len(want)}" in message  # what fits
    with pytest.raises(ValueError, match="on rank 1 of 2"):
        insitu_pipeline(era5.root, manifest, era5.views, batch_size=10**12, rank=1, world_size=2)


def test_a_retained_batch_keeps_its_data_while_later_batches_are_produced(era5: Case) -> None:
    oracle = Oracle(era5.root)
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=8, prefetch_depth=1)
    it = iter(pipe)
    kept = next(it)  # a whole batch
    assert_batch_matches(kept, oracle, era5.oracle_views)
    slice_batch = next(it)
    kept_slice = slice_batch["y"][2:5]  # only a slice of one label of this batch
    slice_rows = np.array(slice_batch.sample_indices["y"][2:5])
    del slice_batch
    for epoch in range(2):  # two epochs: every buffer not held could be reused many times
        if epoch:
            pipe.reset()
            it = iter(pipe)
        for _ in it:
            pass
    assert_batch_matches(kept, oracle, era5.oracle_views)
    np.testing.assert_array_equal(kept_slice, oracle("t2m", slice_rows))


def test_tensors_from_a_dropped_batch_keep_their_data(era5: Case) -> None:
    oracle = Oracle(era5.root)
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=8, prefetch_depth=1)
    it = iter(pipe)
    next(it)
    batch = next(it)
    rows = {k: np.array(v) for k, v in batch.sample_indices.items()}
    tensors = to_torch(batch)
    del batch
    for _ in it:
        pass
    pipe.reset()
    for _ in pipe:
        pass
    np.testing.assert_array_equal(tensors["x"].numpy(), oracle("t2m", rows["x"]))
    np.testing.assert_array_equal(tensors["y"].numpy(), oracle("t2m", rows["y"]))


def test_batch_buffer_allocations_stay_flat_when_batches_are_not_retained(era5: Case) -> None:
    depth = 2
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=4, prefetch_depth=depth)
    run_epoch(pipe)
    after_one = pipe.stages.gather.buffer_allocations
    for _ in range(2):
        pipe.reset()
        run_epoch(pipe)
    n_labels = len(era5.views)
    assert len(pipe) > 20
    # in flight at once: the consumer's batch, the queue, the one being gathered, plus slack;
    # the same bound after three epochs of >20 batches each (a leak would allocate per batch).
    # Not "== after_one": on a loaded machine a buffer can still be referenced by the thread
    # that lent it when the next take() runs, one extra allocation per label (seen in CI)
    bound = n_labels * (depth + 4)
    assert after_one <= bound
    assert pipe.stages.gather.buffer_allocations <= bound


def test_a_buffer_pool_hands_out_again_a_buffer_nobody_references() -> None:
    pool = BufferPool((4, 3), np.dtype("f4"))
    first = pool.take()
    address = first.ctypes.data
    del first
    again = pool.take()
    assert pool.allocations == 1
    assert again.ctypes.data == address


def test_a_buffer_pool_never_hands_out_a_buffer_that_is_still_referenced() -> None:
    pool = BufferPool((4, 3), np.dtype("f4"))
    held = [pool.take() for _ in range(3)]
    views = [held[0][1:], torch.from_numpy(held[1])]
    del held[:2]
    fresh = pool.take()
    addresses = {views[0].base.ctypes.data, views[1].data_ptr(), held[0].ctypes.data}
    assert fresh.ctypes.data not in addresses


# ---------------------------------------------------------------------------------------------
# 10. to_torch
# ---------------------------------------------------------------------------------------------


def test_to_torch_on_the_cpu_shares_memory_with_the_batch(era5: Case) -> None:
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=7)
    batches = list(pipe)
    for batch in (batches[0], batches[-1]):  # a full batch and the short final one
        for device in (None, "cpu", torch.device("cpu")):
            tensors = to_torch(batch, device=device)
            assert set(tensors) == set(batch.arrays)
            for label, t in tensors.items():
                arr = batch[label]
                assert t.device.type == "cpu"
                assert t.data_ptr() == arr.ctypes.data
                assert np.shares_memory(t.numpy(), arr)
                assert tuple(t.shape) == arr.shape
                assert t.dtype == torch.float32
    # a mapping of arrays works as well
    tensors = to_torch(dict(batches[0].arrays))
    assert tensors["x"].data_ptr() == batches[0]["x"].ctypes.data


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_to_torch_on_cuda_without_cuda_raises_a_clear_error(era5: Case) -> None:
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=7)
    batch = next(pipe)
    pipe.close()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        to_torch(batch, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_torch_on_cuda_copies_the_values_through_pinned_host_staging(
    era5: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every host -> device copy goes through Tensor.to (to_torch documents a non_blocking copy
    # from page-locked memory): record whether its source was pinned.
    transfers: list[tuple[bool, bool]] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "cuda":
            transfers.append((self.is_pinned(), bool(kwargs.get("non_blocking", False))))
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    oracle = Oracle(era5.root)
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_size=7)
    batches = list(pipe)
    for batch in (batches[0], batches[-1]):  # a full batch and the short final one
        transfers.clear()
        tensors = to_torch(batch, device="cuda")
        torch.cuda.current_stream().synchronize()
        assert len(transfers) == len(batch.arrays)
        assert all(pinned for pinned, _ in transfers), "host staging is not page-locked"
        assert all(non_blocking for _, non_blocking in transfers)
        for label, t in tensors.items():
            assert t.device.type == "cuda"
            assert t.dtype == torch.float32 and tuple(t.shape) == batch[label].shape
            view = era5.oracle_views[label]
            want = oracle(view.name, np.asarray(batch.sample_indices[label]))
            np.testing.assert_array_equal(t.cpu().numpy(), want)
        before = tensors["x"].cpu().clone()
        batch["x"][...] = -1.0  # the device tensor is a copy, not a view of the batch
        torch.cuda.synchronize()
        assert torch.equal(tensors["x"].cpu(), before)
    explicit = to_torch(batches[1], device=torch.device("cuda", 0))
    assert explicit["x"].device == torch.device("cuda", 0)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(explicit["x"].cpu().numpy(), batches[1]["x"])


# ---------------------------------------------------------------------------------------------
# 11. Batch transforms
# ---------------------------------------------------------------------------------------------


def test_batch_transforms_run_in_order_and_can_add_a_derived_label(era5: Case) -> None:
    calls: list[tuple[str, int, str]] = []
    thread_names: set[str] = set()

    def add_tendency(batch: Batch) -> Batch:
        calls.append(("tendency", batch.index, ""))
        thread_names.add(threading.current_thread().name)
        batch.arrays["dy"] = batch["y"] - batch["x"]
        batch.meta["order"] = ["tendency"]
        return batch

    def add_scaled(batch: Batch) -> Batch:
        assert "dy" in batch.arrays, "the transforms ran out of order"
        calls.append(("scaled", batch.index, ""))
        batch.meta["order"].append("scaled")
        return Batch(
            arrays={**batch.arrays, "dy2": batch["dy"] * 2},
            sample_indices=batch.sample_indices,
            epoch=batch.epoch,
            index=batch.index,
            meta=batch.meta,
        )

    oracle = Oracle(era5.root)
    pipe = insitu_pipeline(
        era5.root,
        era5.manifest,
        era5.views,
        batch_size=8,
        batch_transforms=[add_tendency, add_scaled],
    )
    n = 0
    for batch in pipe:
        assert_batch_matches(batch, oracle, era5.oracle_views)
        x = oracle("t2m", np.asarray(batch.sample_indices["x"]))
        y = oracle("t2m", np.asarray(batch.sample_indices["y"]))
        np.testing.assert_array_equal(batch["dy"], y - x)
        np.testing.assert_array_equal(batch["dy2"], (y - x) * 2)
        assert batch.meta["order"] == ["tendency", "scaled"]
        n += 1
    assert n == len(pipe)
    assert [c[0] for c in calls] == ["tendency", "scaled"] * n
    assert thread_names == {pipe.name}  # on the pipeline's thread, overlapping the consumer


def test_a_batch_transform_that_is_not_callable_is_rejected(era5: Case) -> None:
    with pytest.raises(TypeError, match="batch_transforms"):
        insitu_pipeline(era5.root, era5.manifest, era5.views, batch_transforms=["nope"])  # type: ignore[list-item]


def forgets_to_return(batch: Batch) -> Batch:
    batch.arrays["x"] = batch["x"] * 2
    return None  # type: ignore[return-value]


@pytest.mark.parametrize("returned", ["None", "an array"])
def test_a_batch_transform_that_returns_no_batch_raises_naming_it(
    era5: Case, returned: str
) -> None:
    # a batch transform that forgot its `return batch` used to hand the consumer None for
    # every batch (an array, for one returning batch["x"]), silently
    transform = forgets_to_return if returned == "None" else (lambda batch: batch["x"])
    pipe = insitu_pipeline(era5.root, era5.manifest, era5.views, batch_transforms=[transform])
    with pipe, pytest.raises(TypeError, match=r"batch transform .* returned (None|ndarray).*"
                             r"return the Batch"):  # fmt: skip
        next(iter(pipe))


# ---------------------------------------------------------------------------------------------
# 12. Through torchdata.nodes.Loader: epochs and checkpoints
# ---------------------------------------------------------------------------------------------


def _loader_pipe(case: Case, **kwargs: Any) -> Any:
    kwargs = {"batch_size": 8, "block_chunks": 3, "seed": 11, **kwargs}
    return insitu_pipeline(case.root, case.manifest, case.views, **kwargs)


def test_a_loader_runs_two_epochs_each_a_different_permutation(era5: Case) -> None:
    oracle = Oracle(era5.root)
    loader = Loader(_loader_pipe(era5))
    e0 = run_epoch(loader, oracle, era5.oracle_views)
    e1 = run_epoch(loader, oracle, era5.oracle_views)
    assert {r["epoch"] for r in e0} == {0} and {r["epoch"] for r in e1} == {1}
    assert len(e0) == len(e1) == len(loader.root)
    a0, a1 = anchors_of(e0, "x"), anchors_of(e1, "x")
    assert not np.array_equal(a0, a1)
    np.testing.assert_array_equal(np.sort(a0), np.sort(a1))
    np.testing.assert_array_equal(np.sort(a0), expected_anchors(era5.manifest, "train", [0, 1]))


@pytest.fixture(scope="module")
def uninterrupted(era5: Case) -> list[list[dict[str, Any]]]:
    """Two epochs through a Loader, never interrupted: the reference for resumption."""
    loader = Loader(_loader_pipe(era5))
    return [run_epoch(loader, keep_arrays=True) for _ in range(2)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "k",
    [
        0,
        1,
        4,
        "last",  # n - 1 batches: one to go
        "end",  # all n batches of epoch 0: resumes at epoch 1, batch 0
        "epoch1+2",
    ],
)
def test_loader_state_after_k_batches_resumes_at_batch_k_plus_1_in_a_fresh_pipeline(
    era5: Case, uninterrupted: list[list[dict[str, Any]]], k: Any
) -> None:
    n = len(uninterrupted[0])
    epoch, taken = {"last": (0, n - 1), "end": (0, n), "epoch1+2": (1, 2)}.get(k, (0, k))
    loader = Loader(_loader_pipe(era5))
    if epoch:
        run_epoch(loader)
    it = iter(loader)
    for _ in range(taken):
        next(it)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state  # a checkpoint is plain JSON
    resumed = Loader(_loader_pipe(era5))
    resumed.load_state_dict(state)
    rest = run_epoch(resumed, keep_arrays=True)
    if taken == n:  # resumes at the start of the next epoch
        epoch, taken = epoch + 1, 0
    assert rest, "nothing left after resuming"
    assert (rest[0]["epoch"], rest[0]["index"]) == (epoch, taken)
    assert_same_records(rest, uninterrupted[epoch][taken:])


def test_a_state_from_a_different_configuration_is_refused(era5: Case) -> None:
    loader = Loader(_loader_pipe(era5))
    next(iter(loader))
    state = loader.state_dict()
    other = Loader(_loader_pipe(era5, batch_size=5))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        next(iter(other))


def test_len_is_the_number_of_batches_per_epoch(era5: Case) -> None:
    pipe = _loader_pipe(era5)
    n = len(pipe)
    assert n == -(-len(expected_anchors(era5.manifest, "train", [0, 1])) // 8)
    assert len(list(pipe)) == n


# ---------------------------------------------------------------------------------------------
# 13. A budget holds every epoch, and more memory never fails where less succeeds
# ---------------------------------------------------------------------------------------------


def _epoch_floors(
    manifest: SplitManifest, views: dict[str, ArrayGeometry], epochs: int, **kwargs: Any
) -> list[int]:
    """The exact read-once working-set floor of each epoch (seed 0, one rank)."""
    from insitubatch_nodes.plan.epoch import plan_epoch
    from insitubatch_nodes.plan.schedule import working_set_bytes

    geoms = {v.path: v.base for v in views.values()}
    return [
        working_set_bytes(plan_epoch(manifest, views, PlanConfig(**kwargs), epoch=e), geoms)[0]
        for e in range(epochs)
    ]


def _run_epochs(pipe: Any, n: int, oracle: Oracle, views: dict[str, View]) -> list[np.ndarray]:
    out = []
    for epoch in range(n):
        if epoch:
            pipe.reset()
        records = run_epoch(pipe, oracle, views)
        assert {r["epoch"] for r in records} == {epoch}
        out.append(np.sort(anchors_of(records, "x")))
    return out


def test_a_budget_one_byte_over_epoch_0s_read_once_floor_runs_later_epochs_with_higher_floors(
    shifted_store: ShiftedStore,
) -> None:
    root, views, manifest = shifted_store
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 4}
    floors = _epoch_floors(manifest, views, 8, **kwargs)
    later = next(e for e in range(1, 8) if floors[e] > floors[0] + 1)  # the quoted failure
    budget = floors[0] + 1
    pipe = insitu_pipeline(root, manifest, views, cache_budget_bytes=budget, **kwargs)
    oracle_views = {"x": View("t2m"), "y": View("t2m", 0, 1)}
    want = expected_anchors(manifest, "train", [0, 1])
    for got in _run_epochs(pipe, later + 1, Oracle(root), oracle_views):
        np.testing.assert_array_equal(got, want)
    plan = pipe.stages.plan
    assert plan.epoch_plan(0).pin_gap is None  # epoch 0 fits read-once: it reads each chunk once
    assert plan.epoch_plan(later).pin_gap is not None  # that epoch does not: bounded instead
    assert pipe.stages.pool.budget_bytes == budget
    assert pipe.stats()["resident_peak_bytes"] <= budget


def test_more_memory_never_fails_where_less_succeeds(shifted_store: ShiftedStore) -> None:
    from insitubatch_nodes.plan.schedule import working_set_bytes

    root, views, manifest = shifted_store
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 4}
    floors = _epoch_floors(manifest, views, 8, **kwargs)
    guaranteed = _floor_of(root, manifest, views, **kwargs)
    chunk = views["x"].chunk_nbytes
    budgets = sorted(
        {guaranteed - 1, guaranteed, floors[0], floors[0] + 1, max(floors), 64 * chunk, 2**30}
        | {guaranteed + k * chunk for k in range(0, 40, 3)}
    )
    ok = []
    geoms = {"t2m": views["x"].base}
    for budget in budgets:
        try:
            pipe = insitu_pipeline(root, manifest, views, cache_budget_bytes=budget, **kwargs)
        except ValueError:
            ok.append(False)
            continue
        ok.append(True)
        for epoch in range(12):  # every epoch's own plan fits the budget: nothing raises later
            assert working_set_bytes(pipe.stages.plan.epoch_plan(epoch), geoms)[0] <= budget
    accepted = list(zip(budgets, ok, strict=True))
    assert ok == sorted(ok), f"accepted budgets are not upward closed: {accepted}"
    assert ok.index(True) == budgets.index(guaranteed)
    # the quoted failure: a budget at epoch 0's read-once floor (above every bounded floor) ran
    # read-once and raised in a later epoch, while a smaller budget ran; now both run
    oracle, oracle_views = Oracle(root), {"x": View("t2m"), "y": View("t2m", 0, 1)}
    later = next(e for e in range(1, 8) if floors[e] > floors[0])
    for budget in (guaranteed, floors[0]):
        pipe = insitu_pipeline(root, manifest, views, cache_budget_bytes=budget, **kwargs)
        _run_epochs(pipe, later + 1, oracle, oracle_views)


def test_a_budget_below_the_guaranteed_floor_raises_at_construction_never_in_a_later_epoch(
    shifted_store: ShiftedStore,
) -> None:
    root, views, manifest = shifted_store
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 4}
    guaranteed = _floor_of(root, manifest, views, **kwargs)
    with pytest.raises(ValueError, match=f"floor of {guaranteed:,} bytes"):
        insitu_pipeline(root, manifest, views, cache_budget_bytes=guaranteed - 1, **kwargs)
    # the floor is an upper bound of every epoch's: a long run of epochs' plans stays under it
    pipe = insitu_pipeline(root, manifest, views, cache_budget_bytes=guaranteed, **kwargs)
    from insitubatch_nodes.plan.schedule import working_set_bytes

    geoms = {"t2m": views["x"].base}
    bounded = [working_set_bytes(pipe.stages.plan.epoch_plan(e), geoms)[0] for e in range(40)]
    assert max(bounded) <= guaranteed


# ---------------------------------------------------------------------------------------------
# 14. The builder and a hand-composed pipeline make the same decisions
# ---------------------------------------------------------------------------------------------


def _compose_recipe() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "recipes" / "compose_nodes.py"
    spec = importlib.util.spec_from_file_location("compose_nodes_recipe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("budget", ["auto", "bounded", "read_once"])
def test_a_pipeline_composed_by_hand_plans_and_schedules_like_the_builders(
    shifted_store: ShiftedStore, budget: str
) -> None:
    recipe = _compose_recipe()
    root, views, _ = shifted_store
    manifest = split_by_chunk(views["x"].base, (0.8, 0.1, 0.1))  # what the recipe splits
    kwargs: dict[str, Any] = {"batch_size": 8, "block_chunks": 4}
    guaranteed = _floor_of(root, manifest, views, **kwargs)
    explicit = {"auto": None, "bounded": guaranteed, "read_once": 2**30}[budget]
    argv = ["--batch-size", "8", "--block-chunks", "4", "--seed", "5"]
    if explicit is not None:
        argv += ["--cache-budget-bytes", str(explicit)]
    store = root
    from insitubatch_nodes import open_store

    zstore = open_store(store)
    hand = recipe.build_nodes(zstore, views, recipe.parse_args(argv))
    prefetch, hand_plan, hand_pool = hand.prefetch, hand.plan, hand.pool
    built = insitu_pipeline(zstore, manifest, views, seed=5, cache_budget_bytes=explicit, **kwargs)
    plan = built.stages.plan
    assert hand_plan.schedule == plan.schedule
    assert (hand_plan.schedule.pin_gap is None) == (budget != "bounded")
    assert hand_plan.config() == plan.config()
    # the pool's budget once each has started its first epoch (a graph composed by hand, told
    # no transform_bytes, grows its pool to what it keeps there: the GatherNode counts its
    # batch transforms after the fetch stage is built)
    hand_first, built_first = next(prefetch), next(built)
    assert hand_first.index == built_first.index == 0
    assert hand_pool.budget_bytes == built.stages.pool.budget_bytes
    for epoch in range(4):
        a, b = hand_plan.epoch_plan(epoch), plan.epoch_plan(epoch)
        assert a.pin_gap == b.pin_gap
        assert np.array_equal(a.order, b.order)
        for i in range(a.n_batches):
            assert a.batch_fetches(i) == b.batch_fetches(i)
            assert a.batch_releases(i) == b.batch_releases(i)
    prefetch.close()
    built.close()


# ---------------------------------------------------------------------------------------------
# 15. Arguments are checked at the boundary
# ---------------------------------------------------------------------------------------------


class _NotABacking:
    name = "nothing"

    def __repr__(self) -> str:  # a stable test id (xdist workers must collect the same ids)
        return "_NotABacking()"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": 1.5}, TypeError, "seed must be an integer"),
        ({"seed": True}, TypeError, "seed must be an integer"),
        ({"shuffle": "no"}, TypeError, "shuffle must be True or False"),
        ({"shuffle": 1}, TypeError, "shuffle must be True or False"),
        ({"cache_budget_bytes": True}, TypeError, "cache_budget_bytes must be an integer"),
        ({"cache_budget_bytes": 2.0**30}, TypeError, "cache_budget_bytes must be an integer"),
        ({"cache_budget_bytes": 0}, ValueError, "cache_budget_bytes must be a positive"),
        ({"batch_size": True}, TypeError, "batch_size must be an integer"),
        ({"batch_size": 8.0}, TypeError, "batch_size must be an integer"),
        ({"block_chunks": "4"}, TypeError, "block_chunks must be an integer"),
        ({"max_inflight": True}, TypeError, "max_inflight must be an integer"),
        ({"max_inflight": 0}, ValueError, "max_inflight must be a positive"),
        ({"prefetch_depth": 2.5}, TypeError, "prefetch_depth must be an integer"),
        ({"prefetch_depth": False}, TypeError, "prefetch_depth must be an integer"),
        ({"decode_threads": True}, TypeError, "decode_threads must be an integer"),
        ({"decode_threads": 0}, ValueError, "decode_threads must be a positive"),
        ({"rank": 0.0, "world_size": 1}, TypeError, "rank must be an integer"),
        ({"world_size": True}, TypeError, "world_size must be an integer"),
        ({"cross_split_windows": "yes"}, TypeError, "cross_split_windows must be True or"),
        ({"split": "validation"}, ValueError, "split must be one of"),
        ({"batch_transforms": "nope"}, TypeError, "batch_transforms must be a sequence"),
        ({"backing": _NotABacking()}, TypeError, "backing must be a SlotBacking"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__,
)
def test_bad_pipeline_arguments_raise_with_a_sentence(
    era5: Case, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        insitu_pipeline(era5.root, era5.manifest, era5.views, **kwargs)


def test_a_batch_is_copied_by_two_threads_only_when_its_copies_are_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import insitubatch_nodes._runtime as runtime
    import insitubatch_nodes.stages.gather as gather

    # thresholds scaled down to a small store: every batch is "large"; what decides is the
    # piece one copy moves: a 16 KiB row at one sample per chunk, 8 such rows at eight
    monkeypatch.setattr(gather, "PARALLEL_GATHER_BYTES", 0)
    monkeypatch.setattr(gather, "PARALLEL_PIECE_BYTES", 64 * 2**10)
    asked: list[bool] = []
    real = runtime.gather_helper

    def helper() -> Any:
        asked.append(True)
        return real()

    monkeypatch.setattr(runtime, "gather_helper", helper)
    data = np.random.default_rng(3).random((64, 64, 64), dtype=np.float32)
    for spc, two_threads in ((1, False), (8, True)):
        path = tmp_path / f"spc{spc}.zarr"
        arr = zarr.open_array(path, mode="w", shape=data.shape, chunks=(spc, 64, 64), dtype="f4")
        arr[:] = data
        g = open_geometries(path)[""]
        pipe = insitu_pipeline(path, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g}, batch_size=16)
        asked.clear()
        try:
            for batch in pipe:
                np.testing.assert_array_equal(batch.arrays["x"], data[batch.sample_indices["x"]])
        finally:
            pipe.close()
        assert bool(asked) is two_threads, f"{spc} samples per chunk"
