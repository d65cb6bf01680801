"""Patches: samples that are windows of the field, read from the stored tiles they touch.

zarr's own read of the array, cut at ``[sample, y0:y0 + h, x0:x0 + w]``, is the oracle for
every row (the array is read once per check, not once per window: thousands of small zarr
reads were most of these tests' time).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.patches import WindowUnits, unit_chunk_tile
from insitubatch_nodes.plan.schedule import schedule_floors
from insitubatch_nodes.stages.read_plan import ReadPlanNode


def _write(
    root: Path,
    name: str,
    data: np.ndarray,
    chunks: tuple[int, ...],
    *,
    shards: tuple[int, ...] | None = None,
    zarr_format: int = 3,
    dims: tuple[str, ...] | None = None,
) -> None:
    kwargs: dict[str, Any] = {"zarr_format": zarr_format}
    if shards is not None:
        kwargs["shards"] = shards
    if dims is not None and zarr_format == 3:
        kwargs["dimension_names"] = dims
    arr = zarr.create_array(
        str(root), name=name, shape=data.shape, chunks=chunks, dtype=data.dtype, **kwargs
    )
    arr[...] = data


def _window(
    arr: np.ndarray,
    sample_axis: int,
    s: int,
    axes: tuple[int, ...],
    o: np.ndarray,
    ext: tuple[int, ...],
) -> np.ndarray:
    """One window of ``arr`` (zarr's read of the whole array), sample axis first."""
    index: list[Any] = [slice(None)] * arr.ndim
    index[sample_axis] = int(s)
    for a, o0, e in zip(axes, o.tolist(), ext, strict=True):
        index[a] = slice(o0, o0 + e)
    return np.asarray(arr[tuple(index)])


def _epochs(pipe: Any, n: int) -> list[list[Any]]:
    out = []
    for _ in range(n):
        pipe.reset()
        out.append(list(pipe))
    return out


def _check_against_zarr(
    root: Path, batches: list[Any], labels: dict[str, Any], sample_axis: int = 0
) -> int:
    rows = 0
    for label, view in labels.items():
        arr = np.asarray(zarr.open_array(str(root), path=view.path, mode="r")[...])
        spec = view.patch
        for b in batches:
            origins = b.patch_origins[label]
            assert origins.shape == (len(b), spec.n_axes) and origins.dtype.kind == "i"
            assert b.arrays[label].shape == (len(b), *view.inner_shape)
            for i in range(len(b)):
                want = _window(
                    arr, sample_axis, b.sample_indices[label][i], spec.axes, origins[i], spec.extent
                )
                np.testing.assert_array_equal(b.arrays[label][i], want)
                rows += 1
    return rows


LAYOUTS = {
    # name: (shape, chunks, shards, zarr_format, sample_axis)
    "one-plane-per-chunk": ((3, 301, 257), (1, 64, 48), None, 3, 0),
    "4-samples-per-chunk": ((9, 130, 200), (4, 50, 70), None, 3, 0),
    "sample-axis-last": ((140, 150, 5), (60, 40, 2), None, 3, 2),
    "sharded": ((2, 256, 192), (1, 32, 32), (1, 128, 96), 3, 0),
    "zarr-v2": ((3, 200, 130), (1, 64, 64), None, 2, 0),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("origins", ["grid", "random"])
def test_every_patch_equals_zarrs_read_of_its_window(
    tmp_path: Path, layout: str, origins: str
) -> None:
    shape, chunks, shards, fmt, axis = LAYOUTS[layout]
    rng = np.random.default_rng(7)
    data = rng.standard_normal(shape).astype("f4")
    _write(tmp_path, "img", data, chunks, shards=shards, zarr_format=fmt)
    geom = open_geometries(str(tmp_path), ["img"], sample_axis=axis)["img"]
    field = [a for a in range(3) if a != axis]
    ext = {field[0]: 37, field[1]: min(29, shape[field[1]])}  # odd sizes: windows straddle tiles
    stride = {field[0]: 23} if origins == "grid" else None
    view = geom.patches(ext, origins=origins, stride=stride)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        str(tmp_path), manifest, {"x": view}, batch_size=7, block_chunks=4, seed=1
    )
    try:
        (batches,) = _epochs(pipe, 1)
        rows = _check_against_zarr(tmp_path, batches, {"x": view}, axis)
        assert rows == pipe.stages.plan.epoch_plan(0).n_samples > 0
    finally:
        pipe.close()


def test_an_image_and_its_mask_tiled_differently_take_the_same_windows(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    image = rng.standard_normal((2, 700, 520)).astype("f4")
    _write(tmp_path, "image", image, (1, 128, 128), dims=("z", "y", "x"))
    _write(tmp_path, "mask", (image > 0.5).astype("u1"), (1, 256, 200), dims=("z", "y", "x"))
    geoms = open_geometries(str(tmp_path), ["image", "mask"])
    labels = {
        "x": geoms["image"].patches({"y": 96, "x": 64}, origins="random"),
        "y": geoms["mask"].patches({"y": 96, "x": 64}, origins="random"),
    }
    manifest = split_by_chunk(geoms["image"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(str(tmp_path), manifest, labels, batch_size=16, seed=2)
    try:
        for batches in _epochs(pipe, 2):
            for b in batches:
                np.testing.assert_array_equal(b.patch_origins["x"], b.patch_origins["y"])
            _check_against_zarr(tmp_path, batches, labels)
    finally:
        pipe.close()


def test_a_shifted_patched_view_reads_the_next_sample_at_the_same_origin(tmp_path: Path) -> None:
    data = np.random.default_rng(3).standard_normal((12, 90, 80)).astype("f4")
    _write(tmp_path, "t2m", data, (4, 32, 32))
    geom = open_geometries(str(tmp_path), ["t2m"])["t2m"]
    labels = {
        "x": geom.patches({1: 40, 2: 40}, origins="random"),
        "y": geom.shift(1).patches({1: 40, 2: 40}, origins="random"),
    }
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(str(tmp_path), manifest, labels, batch_size=8, seed=4)
    try:
        (batches,) = _epochs(pipe, 1)
        for b in batches:
            np.testing.assert_array_equal(b.sample_indices["y"], b.sample_indices["x"] + 1)
        _check_against_zarr(tmp_path, batches, labels)
    finally:
        pipe.close()


def _touched_objects(view: Any, plan: Any) -> set[tuple[int, tuple[int, ...]]]:
    """Every stored object the epoch's windows touch, worked out pixel-free by brute force."""
    base, spec = view.base, view.patch
    out = set()
    for s, o in zip(plan.anchors.tolist(), plan.origins.tolist(), strict=True):
        ranges = []
        for f, a in enumerate(base.field_axes):
            t = base.chunks[a]
            if a in spec.axes:
                o0 = o[spec.axes.index(a)]
                e = spec.extent[spec.axes.index(a)]
                ranges.append(range(o0 // t, (o0 + e - 1) // t + 1))
            else:
                ranges.append(range(base.tile_grid[f]))
        for tile in itertools.product(*ranges):
            out.add(((s + view.offset) // base.samples_per_chunk, tile))
    return out


def test_each_stored_tile_is_fetched_once_per_epoch_when_the_budget_allows(tmp_path: Path) -> None:
    data = np.random.default_rng(5).standard_normal((2, 400, 300)).astype("f4")
    _write(tmp_path, "img", data, (1, 64, 64))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    view = geom.patches({1: 50, 2: 50}, origins="random", per_tile=3)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(str(tmp_path), manifest, {"x": view}, batch_size=8, block_chunks=4)
    pool = pipe.stages.pool
    try:
        for epoch in range(2):
            before = pool.stats.gets
            pipe.reset()
            list(pipe)
            plan = pipe.stages.plan.epoch_plan(epoch)
            touched = _touched_objects(view, plan)
            # the units the plan names are exactly the stored objects the windows touch
            units = {unit_chunk_tile(geom, u) for led in plan.ledgers for u in led.chunk.tolist()}
            assert units == touched
            if epoch == 0:  # (epoch 1 may find tiles still resident from epoch 0: hits)
                assert pool.stats.gets - before == len(touched)
            else:
                assert pool.stats.gets - before <= len(touched)
    finally:
        pipe.close()


def test_peak_residency_is_bounded_by_tiles_not_fields(tmp_path: Path) -> None:
    data = np.random.default_rng(6).standard_normal((1, 2048, 2048)).astype("f4")
    _write(tmp_path, "slide", data, (1, 128, 128))
    geom = open_geometries(str(tmp_path), ["slide"])["slide"]
    view = geom.patches({1: 64, 2: 64}, origins="random")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    floors = schedule_floors(manifest, {"x": view}, PlanConfig(batch_size=16, block_chunks=16))
    field = geom.chunk_nbytes  # 16 MiB: 256 tiles
    assert floors.bounded < 0.6 * field  # a bound over every epoch, rims counted apart
    pipe = insitu_pipeline(
        str(tmp_path),
        manifest,
        {"x": view},
        batch_size=16,
        block_chunks=16,
        cache_budget_bytes=floors.bounded,
    )
    pool = pipe.stages.pool
    try:
        (batches,) = _epochs(pipe, 1)
        _check_against_zarr(tmp_path, batches[::7], {"x": view})
        # the pool keeps at most its budget, in tiles: never a whole field's bytes
        assert pool.stats.resident_peak_bytes <= floors.bounded < 0.6 * field
        # the bounded schedule re-reads only the rims of regions, never whole fields
        assert 256 <= pool.stats.gets <= 1.6 * 256
    finally:
        pipe.close()


def test_a_sweep_reads_every_tile_once_in_a_budget_far_below_the_plane(tmp_path: Path) -> None:
    data = np.random.default_rng(6).standard_normal((2, 2048, 2048)).astype("f4")
    _write(tmp_path, "slide", data, (1, 128, 128))
    geom = open_geometries(str(tmp_path), ["slide"])["slide"]
    view = geom.patches({1: 64, 2: 64}, origins="random", order="sweep")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    config = PlanConfig(batch_size=16, block_chunks=16)
    budget = schedule_floors(manifest, {"x": view}, config).guaranteed
    assert budget < 0.6 * geom.chunk_nbytes  # a plane is 16 MiB, 256 tiles
    pipe = insitu_pipeline(
        str(tmp_path), manifest, {"x": view}, batch_size=16, block_chunks=16,
        cache_budget_bytes=budget,
    )  # fmt: skip
    pool = pipe.stages.pool
    try:
        for epoch in range(2):
            before = pool.stats.gets
            (batches,) = _epochs(pipe, 1)
            if epoch == 0:
                _check_against_zarr(tmp_path, batches[::9], {"x": view})
            assert pool.stats.gets - before == 2 * 256  # every tile of both planes, once
            plan = pipe.stages.plan.epoch_plan(epoch)
            # one plane after the other, each swept region by region through neighbours
            layout_side = 4  # round(sqrt(16)) tiles a side: a 4 x 4 grid of regions
            chunk, region = plan.chunks // 16, plan.chunks % 16
            assert np.count_nonzero(np.diff(chunk)) == 1
            for c in (0, 1):
                r = region[chunk == c]
                step = np.abs(np.diff(r // layout_side)) + np.abs(np.diff(r % layout_side))
                assert set(step.tolist()) == {1} and len(set(r.tolist())) == 16
        assert pool.stats.resident_peak_bytes <= budget
    finally:
        pipe.close()


def test_a_budget_below_the_tile_floor_is_refused_in_tile_bytes(tmp_path: Path) -> None:
    data = np.zeros((1, 512, 512), dtype="f4")
    _write(tmp_path, "slide", data, (1, 128, 128))
    geom = open_geometries(str(tmp_path), ["slide"])["slide"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"guaranteed to fit \(stored tiles of the patched"):
        insitu_pipeline(
            str(tmp_path),
            manifest,
            {"x": geom.patches({1: 64, 2: 64})},
            cache_budget_bytes=128 * 128 * 4,
        )


@pytest.mark.parametrize("stride", [None, 16, 25])
def test_grid_origins_cover_the_field_exactly(tmp_path: Path, stride: int | None) -> None:
    data = np.zeros((2, 130, 97), dtype="f4")
    _write(tmp_path, "img", data, (1, 32, 40))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    view = geom.patches({1: 30, 2: 30}, stride=stride)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    config = PlanConfig(batch_size=5, shuffle=True, seed=9)
    plan = plan_epoch(manifest, {"x": view}, config)
    step = stride or 30
    for s in (0, 1):
        cover = np.zeros((130, 97), dtype=np.int64)
        mine = plan.origins[plan.anchors == s]
        for y0, x0 in mine.tolist():
            assert 0 <= y0 <= 100 and 0 <= x0 <= 67
            cover[y0 : y0 + 30, x0 : x0 + 30] += 1
        assert cover.min() >= 1  # every pixel of the field is in some window
        ys = sorted({y for y, _ in mine.tolist()})
        assert ys[-1] == 100 and all(b - a <= step for a, b in itertools.pairwise(ys))
        assert len(mine) == len({tuple(o) for o in mine.tolist()})  # no window twice
    # the same windows every epoch (only their order changes)
    again = plan_epoch(manifest, {"x": view}, config, epoch=1)
    assert sorted(map(tuple, again.origins.tolist())) == sorted(map(tuple, plan.origins.tolist()))


def test_random_origins_are_seeded_new_each_epoch_and_stratified_by_tile(tmp_path: Path) -> None:
    data = np.zeros((3, 256, 256), dtype="f4")
    _write(tmp_path, "img", data, (1, 64, 64))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    view = geom.patches({1: 32, 2: 32}, origins="random")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))

    def draw(epoch: int, seed: int = 0) -> Any:
        return plan_epoch(manifest, {"x": view}, PlanConfig(batch_size=8, seed=seed), epoch=epoch)

    a, b = draw(0), draw(0)
    np.testing.assert_array_equal(a.origins, b.origins)
    assert not np.array_equal(np.sort(draw(1).origins, axis=0), np.sort(a.origins, axis=0))
    assert not np.array_equal(np.sort(draw(0, seed=1).origins, axis=0), np.sort(a.origins, axis=0))
    # stratified: 4 windows start in every full 64 x 64 tile of every plane, each epoch (the
    # last tile row and column hold 33 of 64 origins: about half as many windows start there)
    for plan in (a, draw(1)):
        assert plan.n_samples == 3 * (9 * 4 + 6 * 2 + 1)
        home = plan.origins // 64
        full = (home < 3).all(axis=1)
        counts = np.unique(np.c_[plan.anchors, home][full], axis=0, return_counts=True)[1]
        assert len(counts) == 3 * 9 and set(counts.tolist()) == {4}


@pytest.mark.parametrize(("per_tile", "want"), [(3, 3), (None, 1), (5, 5)])
def test_a_field_of_one_tile_takes_per_tile_random_windows_not_an_edge_tiles_share(
    tmp_path: Path, per_tile: int | None, want: int
) -> None:
    # a plane stored as one 96 x 96 tile, 64 x 64 windows: its 33 x 33 start positions were
    # taken as an edge tile's share of a tile (0.12), so per_tile=3 drew one window a plane;
    # the tile the field's start positions lie in holds all of them: per_tile windows (the
    # default: the one that fits side by side). A field of several tiles keeps its edge
    # tiles' shares (test above)
    data = np.zeros((4, 96, 96), dtype="f4")
    _write(tmp_path, "img", data, (1, 96, 96))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    view = geom.patches({1: 64, 2: 64}, origins="random", per_tile=per_tile)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    plan = plan_epoch(manifest, {"x": view}, PlanConfig(batch_size=2))
    assert plan.n_samples == 4 * want
    assert np.bincount(plan.anchors).tolist() == [want] * 4
    assert (plan.origins >= 0).all() and (plan.origins <= 32).all()


@pytest.mark.parametrize("origins", ["grid", "random"])
def test_windows_within_disjoint_boxes_never_share_a_pixel(tmp_path: Path, origins: str) -> None:
    data = np.random.default_rng(11).standard_normal((2, 300, 400)).astype("f4")
    _write(tmp_path, "img", data, (1, 64, 64), dims=("z", "y", "x"))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    ext = {"y": 40, "x": 50}
    boxes = {"train": (0, 270), "val": (270, 400)}  # along x, not on a tile edge
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    seen = {}
    for name, box in boxes.items():
        view = geom.patches(ext, origins=origins, within={"x": box})
        assert view.patch.bounds == ((0, 300), box)
        plan = plan_epoch(manifest, {"x": view}, PlanConfig(batch_size=8, seed=1))
        x0 = plan.origins[:, 1]
        assert (x0 >= box[0]).all() and (x0 + 50 <= box[1]).all()
        assert (plan.origins[:, 0] + 40 <= 300).all()
        cover = np.zeros((2, 300, 400), dtype=bool)
        for s, (y, x) in zip(plan.anchors.tolist(), plan.origins.tolist(), strict=True):
            cover[s, y : y + 40, x : x + 50] = True
        if origins == "grid":  # the windows cover the box exactly
            assert cover[:, :, box[0] : box[1]].all() and not cover[:, :, : box[0]].any()
        seen[name] = cover
        # only tiles overlapping the box are read
        cols = {unit_chunk_tile(geom, u)[1][1] for led in plan.ledgers for u in led.chunk.tolist()}
        assert cols <= set(range(box[0] // 64, (box[1] - 1) // 64 + 1))
        pipe = insitu_pipeline(str(tmp_path), manifest, {"x": view}, batch_size=8, seed=1)
        try:
            (batches,) = _epochs(pipe, 1)
            _check_against_zarr(tmp_path, batches, {"x": view})
        finally:
            pipe.close()
    assert not (seen["train"] & seen["val"]).any()


def test_random_origins_resume_mid_epoch_bit_identically(tmp_path: Path) -> None:
    data = np.random.default_rng(8).standard_normal((2, 300, 260)).astype("f4")
    _write(tmp_path, "img", data, (1, 64, 64))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    labels = {"x": geom.patches({1: 48, 2: 48}, origins="random")}
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))

    def build() -> Any:
        return insitu_pipeline(str(tmp_path), manifest, labels, batch_size=10, seed=5)

    def record(batches: list[Any]) -> list[tuple[Any, ...]]:
        return [
            (
                b.epoch,
                b.index,
                b.sample_indices["x"].tolist(),
                b.patch_origins["x"].tolist(),
                b.arrays["x"].tobytes(),
            )
            for b in batches
        ]

    whole = build()
    try:
        reference = record([b for b in Loader(whole)]) + record([b for b in Loader(whole)])
    finally:
        whole.close()
    first = build()
    loader = Loader(first)
    it = iter(loader)
    head = [next(it) for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    first.close()
    again = build()
    loader = Loader(again)
    loader.load_state_dict(state)
    try:
        rest = record(list(loader))
        rest += record(list(loader))
    finally:
        again.close()
    # the rest of epoch 0, then epoch 1, as an uninterrupted run delivers them
    assert (record(head) + rest)[: len(reference)] == reference


def test_ranks_take_disjoint_windows_and_equal_batches(tmp_path: Path) -> None:
    data = np.zeros((5, 200, 200), dtype="f4")
    _write(tmp_path, "img", data, (1, 50, 50))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    view = geom.patches({1: 40, 2: 40}, origins="random")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    config = PlanConfig(batch_size=4, seed=3)
    every = plan_epoch(manifest, {"x": view}, config, epoch=2)
    everything = {
        (a, *o) for a, o in zip(every.anchors.tolist(), every.origins.tolist(), strict=True)
    }
    for world in (2, 3):
        seen: list[tuple[int, ...]] = []
        lens = set()
        for rank in range(world):
            p = plan_epoch(
                manifest, {"x": view}, config.replace(rank=rank, world_size=world), epoch=2
            )
            mine = [(a, *o) for a, o in zip(p.anchors.tolist(), p.origins.tolist(), strict=True)]
            seen.extend(mine)
            lens.add(p.n_batches)
        assert len(lens) == 1
        assert len(seen) == len(set(seen)) == len(everything) // world * world
        assert set(seen) <= everything
    # an elastic cut: two ranks delivered 3 batches each; one rank takes the rest exactly
    delivered = []
    for rank in range(2):
        p = plan_epoch(manifest, {"x": view}, config.replace(rank=rank, world_size=2), epoch=2)
        delivered += [
            (a, *o) for a, o in zip(p.anchors[:12].tolist(), p.origins[:12].tolist(), strict=True)
        ]
    rest = plan_epoch(manifest, {"x": view}, config, epoch=2, resumed=[(2, 3)])
    left = [(a, *o) for a, o in zip(rest.anchors.tolist(), rest.origins.tolist(), strict=True)]
    assert sorted(delivered + left) == sorted(everything)


def test_units_of_a_window_are_the_tiles_it_overlaps(tmp_path: Path) -> None:
    data = np.zeros((2, 100, 100), dtype="f4")
    _write(tmp_path, "img", data, (1, 30, 40))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    view = geom.patches({1: 31, 2: 41})
    units = WindowUnits(geom, view.patch, [0])
    cid, row = units.uses(np.array([1, 0]), np.array([[29, 39], [0, 0]]))
    got = sorted((int(r), unit_chunk_tile(geom, int(u))) for u, r in zip(cid, row, strict=True))
    # row 0: y 29..59 spans tile rows 0..1 (and 59 is in 1), x 39..79 spans tile cols 0..1
    assert got == [
        (0, (1, (0, 0))),
        (0, (1, (0, 1))),
        (0, (1, (1, 0))),
        (0, (1, (1, 1))),
        (1, (0, (0, 0))),
        (1, (0, (0, 1))),
        (1, (0, (1, 0))),
        (1, (0, (1, 1))),
    ]


def test_patches_take_dimension_names_and_refuse_what_cannot_be_cut(tmp_path: Path) -> None:
    data = np.zeros((2, 64, 48), dtype="f4")
    _write(tmp_path, "img", data, (1, 32, 32), dims=("t", "lat", "lon"))
    _write(tmp_path, "other", data, (1, 32, 32))
    geoms = open_geometries(str(tmp_path), ["img", "other"])
    g = geoms["img"]
    assert g.patches({"lat": 16, "lon": 8}) == g.patches({1: 16, 2: 8})
    assert g.patches({"lat": 16, "lon": 8}).inner_shape == (16, 8)
    assert g.shift(1).patches({1: 16}).inner_shape == (16, 48)
    with pytest.raises(KeyError, match="no dimension named"):
        g.patches({"y": 16})
    with pytest.raises(ValueError, match="not a field axis"):
        g.patches({0: 1})
    with pytest.raises(ValueError, match="does not fit"):
        g.patches({1: 65})
    with pytest.raises(ValueError, match="positive"):
        g.patches({1: 0})
    with pytest.raises(ValueError, match="stride applies"):
        g.patches({1: 8}, origins="random", stride=4)
    with pytest.raises(ValueError, match="hold a window"):
        g.patches({1: 16}, within={1: (0, 8)})
    with pytest.raises(ValueError, match="not patched"):
        g.patches({1: 16}, within={2: (0, 8)})
    with pytest.raises(ValueError, match="patched already"):
        g.patches({1: 8}).patches({2: 8})
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="cut their fields differently"):
        ReadPlanNode(manifest, {"a": g.patches({1: 8}), "b": geoms["other"].patches({1: 16})})
    with pytest.raises(ValueError, match="both whole and patched"):
        ReadPlanNode(manifest, {"a": g.patches({1: 8}), "b": g})
    with pytest.raises(ValueError, match="no chunk transforms"):
        insitu_pipeline(
            str(tmp_path), manifest, {"a": g.patches({1: 8})}, chunk_transforms=[_Scale()]
        )


class _Scale:
    """An elementwise chunk transform (patched views refuse every chunk transform)."""

    def __call__(self, chunk: Any) -> Any:
        chunk.data *= 2
        return chunk


# -- real processes: gloo ranks, a restore in a fresh process, a Lightning-free loader -----------

PATCHED = {"extent": [3, 5], "origins": "random"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["shuffled", "sweep"])
def test_gloo_ranks_take_disjoint_windows_in_equal_batch_counts(tmp_path: Path, order: str) -> None:
    from resume_helpers import ddp_worker, pipe_config, spawn_ranks, write_store

    store = write_store(tmp_path / "era5.zarr", n_time=64, inner_chunks=(4, 6), variables=("t2m",))
    cfg = pipe_config(
        store,
        windowed=True,
        fractions=[1.0, 0.0, 0.0],
        batch_size=7,
        block_chunks=4,
        patches={**PATCHED, "order": order},
    )
    world = 2
    spawn_ranks(
        ddp_worker,
        args=(world, str(tmp_path / "init"), cfg, 2, str(tmp_path / "rank{}.json")),
        nprocs=world,
        workdir=tmp_path / "ranks",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    geom = open_geometries(str(store), ["t2m"])["t2m"]
    views = {
        "x": geom.patches({1: 3, 2: 5}, origins="random", order=order),
        "y": geom.shift(1).patches({1: 3, 2: 5}, origins="random", order=order),
    }
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    for e in range(2):
        every = plan_epoch(manifest, views, PlanConfig(batch_size=7, block_chunks=4), epoch=e)
        valid = {
            (a, *o) for a, o in zip(every.anchors.tolist(), every.origins.tolist(), strict=True)
        }
        per = [{tuple(s) for s in r["epochs"][e]["samples"]} for r in results]
        assert per[0].isdisjoint(per[1]), "ranks share a window"
        assert per[0] | per[1] <= valid
        assert len(per[0]) == len(per[1]) == len(valid) // world
        assert {r["epochs"][e]["n_batches"] for r in results} == {-(-len(valid) // world // 7)}


@pytest.mark.slow
def test_a_patched_run_restored_in_a_fresh_process_continues_exactly(tmp_path: Path) -> None:
    from resume_helpers import pipe_config, reference_run, run_fresh, take_state, write_store

    store = write_store(tmp_path / "era5.zarr", inner_chunks=(4, 6), variables=("t2m",))
    cfg = pipe_config(store, patches=PATCHED)
    reference = reference_run(cfg, epochs=3)  # each window checked against zarr's read
    strip = [{key: v for key, v in r.items() if key != "state"} for r in reference]
    n = len(reference) // 3
    k = n + n // 2 + 1  # mid-way through epoch 1
    before, state = take_state(cfg, k)
    assert before == strip[:k] and all("origins" in r for r in before)
    wire = json.loads(json.dumps(state))
    resp = run_fresh("loader-restore", {"config": cfg, "state": wire, "passes": 2}, tmp_path)
    got = [{key: v for key, v in r.items() if key != "state"} for r in resp["records"]]
    assert got == strip[k:]  # the rest of epoch 1, then epoch 2


def test_a_state_saved_with_other_patches_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "img", np.zeros((4, 64, 64), dtype="f4"), (1, 32, 32))
    geom = open_geometries(str(tmp_path), ["img"])["img"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    config = PlanConfig(batch_size=4)
    saved = ReadPlanNode(manifest, {"x": geom.patches({1: 16, 2: 16})}, config=config)
    saved.reset()
    next(saved)
    state = saved.state_dict()
    for other in (geom, geom.patches({1: 16, 2: 8}), geom.patches({1: 16, 2: 16}, stride=8)):
        node = ReadPlanNode(manifest, {"x": other}, config=config)
        with pytest.raises(ValueError, match="patched otherwise"):  # (naming the array, how)
            node.reset(state)
    same = ReadPlanNode(manifest, {"x": geom.patches({1: 16, 2: 16})}, config=config)
    same.reset(state)
    nxt = next(same)
    saved_next = next(saved)
    np.testing.assert_array_equal(nxt.origins, saved_next.origins)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lightning_run_killed_mid_epoch_resumes_on_the_same_windows(tmp_path: Path) -> None:
    from resume_helpers import (
        comparable,
        lightning_request,
        read_records,
        run_lightning,
        write_store,
    )

    store = write_store(tmp_path / "era5.zarr", inner_chunks=(4, 6), variables=("t2m",))
    options = {"patches": PATCHED, "every_n_train_steps": 2}

    def train(name: str, **more: Any) -> tuple[int, str, list[tuple]]:
        out = tmp_path / name
        req = lightning_request(store, out, tmp_path / f"{name}-ckpt", **options, **more)
        rc, log = run_lightning(req, tmp_path)
        return rc, log, comparable(read_records(out))

    rc, log, reference = train("uninterrupted")
    assert rc == 0, log[-5000:]
    assert all(isinstance(i, list) and len(i) == 3 for row in reference for i in row[5])
    per_epoch = len(reference) // 2
    kill_at = per_epoch + 2 * (per_epoch // 4)  # mid-way through epoch 1, on a checkpoint step
    rc, log, killed = train("killed", kill_at_step=kill_at)
    assert rc == -9, log[-5000:]
    ckpt = tmp_path / "killed-ckpt" / f"step={kill_at}.ckpt"
    rc, log, resumed = train("resumed", ckpt_path=str(ckpt))
    assert rc == 0, log[-5000:]
    assert killed == reference[:kill_at]
    assert resumed == reference[kill_at:]


def _cached_run(store: Any, root: Path, labels: dict[str, Any], cache: Path, **kw: Any) -> Any:
    """One epoch of patched views over ``store`` with a persistent cache at ``cache``: its
    ``(sample, origin)`` rows, each checked against zarr's read of its window, and the GETs."""
    store.reset_counts()
    manifest = split_by_chunk(labels["x"].base, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, labels, batch_size=5, block_chunks=2, seed=3,
                           cache_dir=cache, persist=True, **kw)  # fmt: skip
    try:
        (batches,) = _epochs(pipe, 1)
        _check_against_zarr(root, batches, labels)
        rows = [
            (int(s), *map(int, o))
            for b in batches
            for s, o in zip(b.sample_indices["x"], b.patch_origins["x"], strict=True)
        ]
        return rows, store.chunk_counts(), {**pipe.stages.pool.cache.stats, **pipe.stats()}
    finally:
        pipe.close()


def test_patched_views_from_a_warm_persistent_cache_give_zarrs_windows_and_read_no_object(
    tmp_path: Path,
) -> None:
    from helpers import counting_store

    from insitubatch_nodes.cache.files import chunk_file_name
    from insitubatch_nodes.errors import StaleCacheError

    root = tmp_path / "s.zarr"
    rng = np.random.default_rng(11)
    image = rng.standard_normal((4, 130, 100)).astype("f4")  # edge tiles on both axes
    _write(root, "image", image, (2, 48, 40), dims=("z", "y", "x"))
    _write(root, "mask", (image > 0).astype("u1"), (1, 64, 100), dims=("z", "y", "x"))
    store = counting_store(root)
    geoms = open_geometries(store, ["image", "mask"])
    labels = {
        "x": geoms["image"].patches({"y": 37, "x": 29}, origins="random"),
        "y": geoms["mask"].patches({"y": 37, "x": 29}, origins="random"),
    }
    cache = tmp_path / "cache"
    rows, gets, _ = _cached_run(store, root, labels, cache)
    assert rows and set(gets.values()) == {1}  # each touched object once
    again, warm, _ = _cached_run(store, root, labels, cache)
    assert again == rows and warm == {}, "a warm cache read the store"
    assert _cached_run(store, root, labels, cache, readonly_cache=True)[1] == {}
    # one stored tile rewritten: that unit alone is read again, the rows are zarr's new read
    zarr.open_array(str(root), path="image", mode="a")[0:2, 48:96, 40:80] = 7.0
    stale = "'image/c/0/1/1' changed"
    with pytest.raises(StaleCacheError, match=rf"1 chunk\(s\).*{stale}"):
        _cached_run(store, root, labels, cache, readonly_cache=True)
    again, gets, stats = _cached_run(store, root, labels, cache)
    assert again == rows and gets == {"image/c/0/1/1": 1} and stats["stale_chunks"] == 1
    # a flipped byte in a cached unit's file: never served, that one object read again
    unit = 0 * geoms["image"].n_tiles + 1 * 3 + 1  # chunk 0, tile (1, 1) of a 3 x 3 grid
    victim = cache / chunk_file_name("image", unit)
    with open(victim, "r+b") as fh:
        fh.seek(np.load(victim, mmap_mode="r").offset + 4 * 100)
        byte = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([byte ^ 0x10]))
    again, gets, stats = _cached_run(store, root, labels, cache)  # (it logs a warning)
    assert again == rows and gets == {"image/c/0/1/1": 1} and stats["corrupt"] == 1
    # whole fields are other slots than units: that cache is not theirs (named, not served)
    whole = {"x": geoms["image"], "y": geoms["mask"]}
    with pytest.raises(StaleCacheError, match="image"):
        insitu_pipeline(store, split_by_chunk(geoms["image"], (1.0, 0.0, 0.0)), whole,
                        batch_size=5, cache_dir=cache, persist=True)  # fmt: skip


@pytest.mark.parametrize(
    "dims, chunks, select",
    [
        (("time", "level", "y", "x"), (2, 2, 4, 5), {"level": [4, 0, 3]}),
        (("time", "level", "y", "x"), (2, 2, 4, 5), {"level": 3}),
        (("time", "level", "y", "x"), (2, 2, 4, 5), {"level": slice(1, 4)}),
        (("time", "y", "x", "level"), (2, 4, 5, 2), {"level": [4, 0, 3]}),
        (
            ("time", "band", "y", "x", "level"),
            (2, 3, 4, 5, 2),
            {"band": [2, 0], "level": [3, 1, 4]},
        ),
        (("time", "band", "y", "x", "level"), (2, 1, 4, 5, 5), {"band": 1, "level": [0, 4, 2]}),
    ],
    ids=[
        "a list across tiles",
        "an index",
        "a slice",
        "listed axis after the patched ones",
        "two listed axes",
        "an index and a list",
    ],
)
def test_a_patched_view_selected_along_other_axes_equals_numpys_window_of_the_selection(
    tmp_path: Path, dims: tuple[str, ...], chunks: tuple[int, ...], select: dict[str, Any]
) -> None:
    rng = np.random.default_rng(11)
    shape = {"time": 6, "band": 4, "y": 10, "x": 12, "level": 5}
    data = rng.standard_normal(tuple(shape[d] for d in dims)).astype("f4")
    _write(tmp_path, "q", data, chunks, dims=dims)
    geom = open_geometries(str(tmp_path), ["q"])["q"]
    view = geom.patches({"y": 6, "x": 7}, origins="random").isel(**select)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(str(tmp_path), manifest, {"x": view}, batch_size=4, seed=3)
    try:
        (batches,) = _epochs(pipe, 1)
    finally:
        pipe.close()
    assert sum(map(len, batches)) == pipe.stages.plan.epoch_plan(0).n_samples > 0
    for b in batches:
        rows = zip(b["x"], b.sample_indices["x"], b.patch_origins["x"], strict=True)
        for row, s, (oy, ox) in rows:
            field = data[s]
            for axis, name in reversed(list(enumerate(dims[1:]))):  # numpy: axis by axis
                if isinstance(select.get(name), slice):
                    field = field[(slice(None),) * axis + (select[name],)]
                elif name in select:
                    field = np.take(field, select[name], axis=axis)
                elif name == "y":
                    field = np.take(field, range(oy, oy + 6), axis=axis)
                elif name == "x":
                    field = np.take(field, range(ox, ox + 7), axis=axis)
            np.testing.assert_array_equal(row, field)


def _assert_6x7_windows(batches: list[Any], data: np.ndarray, keys: dict[str, Any]) -> None:
    """Each row of each label equals numpy's 6 x 7 window of its sample, at its origin, of the
    label's selection (``keys``: label -> the key along the first field axis)."""
    assert sum(map(len, batches)) > 0
    for b in batches:
        for label, key in keys.items():
            rows = zip(b[label], b.sample_indices[label], b.patch_origins[label], strict=True)
            for row, s, (oy, ox) in rows:
                np.testing.assert_array_equal(row, data[s][key][..., oy : oy + 6, ox : ox + 7])


def test_a_patched_view_selecting_levels_stored_whole_keeps_only_those_levels_per_tile(
    tmp_path: Path,
) -> None:
    # every level in each stored object (ARCO-ERA5's layout): the issue's contract holds for
    # patches too — each object decoded once, and the unit's slot keeps only the levels the
    # views select (their union), not all of them
    rng = np.random.default_rng(2)
    data = rng.standard_normal((8, 7, 10, 12)).astype("f4")
    _write(tmp_path, "q", data, (1, 7, 4, 5), dims=("time", "level", "y", "x"))
    geom = open_geometries(str(tmp_path), ["q"])["q"]
    cut = {"y": 6, "x": 7}
    views = {
        "a": geom.patches(cut, origins="random").isel(level=[4, 0, 2]),
        "b": geom.shift(1).patches(cut, origins="random").isel(level=1),
    }
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(str(tmp_path), manifest, views, batch_size=3, seed=4, coords=())
    try:
        epochs = _epochs(pipe, 2)  # epoch 1 from the pool: the kept levels, in their places
        stats = pipe.stats()
        n_tiles = geom.n_tiles
    finally:
        pipe.close()
    for batches in epochs:
        _assert_6x7_windows(batches, data, {"a": [4, 0, 2], "b": 1})
    assert stats["gets"] == 8 * n_tiles, "each stored object read once"
    # 4 of 7 levels kept (0, 1, 2, 4) per unit slot of 4 x 5
    assert stats["resident_peak_bytes"] <= 8 * n_tiles * 4 * 4 * 5 * 4


def test_a_patched_view_selecting_channels_stored_apart_reads_only_their_objects(
    tmp_path: Path,
) -> None:
    from helpers import counting_store

    # an OME-Zarr-like stack: one channel per stored object, the plane cut into tiles; two
    # views take channels 1 and 3 (and 3 again) of 5: only their objects are read, once each
    # (every channel was, before: 5 / 2 the GETs and decodes)
    rng = np.random.default_rng(8)
    data = rng.standard_normal((6, 5, 10, 12)).astype("f4")
    _write(tmp_path, "img", data, (2, 1, 4, 5), dims=("t", "c", "y", "x"))
    store = counting_store(tmp_path)
    geom = open_geometries(store, ["img"])["img"]
    cut = {"y": 6, "x": 7}
    views = {
        "a": geom.patches(cut, origins="random").isel(c=[3, 1]),
        "b": geom.patches(cut, origins="random").isel(c=3),
    }
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, views, batch_size=4, seed=2, coords=())
    try:
        (batches,) = _epochs(pipe, 1)
    finally:
        pipe.close()
    _assert_6x7_windows(batches, data, {"a": [3, 1], "b": 3})
    gets = store.chunk_counts()
    channels = {int(k.split("/")[3]) for k, n in gets.items() if n}
    assert channels == {1, 3}, sorted(gets)
    assert set(gets.values()) <= {0, 1}, "each object read once"
