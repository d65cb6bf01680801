"""Patches as a demanding user meets them: what a black-box trial against zarr and numpy found.

Each test is one behaviour the trial got wrong before its fix; stores are tiny and shared.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.schedule import schedule_floors


@pytest.fixture(scope="module")
def two_images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, ArrayGeometry]]:
    """An image and its label, (z, y, x) = (2, 40, 40) in 10² tiles."""
    root = tmp_path_factory.mktemp("patch_trial") / "two.zarr"
    data = np.arange(2 * 40 * 40, dtype="f4").reshape(2, 40, 40)
    for name in ("image", "label"):
        arr = zarr.create_array(
            str(root), name=name, shape=data.shape, chunks=(1, 10, 10), dtype="f4",
            dimension_names=("z", "y", "x"),
        )  # fmt: skip
        arr[...] = data
    return root, open_geometries(str(root), ["image", "label"])


def test_views_patched_within_other_boxes_in_one_pipeline_are_refused(
    two_images: tuple[Path, dict[str, Any]],
) -> None:
    # before: the label's box was silently ignored (it took the image's windows, rows 0-20)
    root, g = two_images
    views = {
        "x": g["image"].patches({"y": 8}, within={"y": (0, 20)}),
        "y": g["label"].patches({"y": 8}, within={"y": (20, 40)}),
    }
    manifest = split_by_chunk(g["image"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"cut their fields differently.*within"):
        insitu_pipeline(str(root), manifest, views, batch_size=4)


def test_one_plane_of_many_windows_is_dealt_to_several_ranks(
    two_images: tuple[Path, dict[str, Any]],
) -> None:
    # a whole-slide image: one plane, many windows; before, world_size=2 was refused because
    # the rank check counted anchors (planes), not windows ("1 valid anchors but world_size 2")
    root, g = two_images
    view = g["image"].patches({"y": 10, "x": 10})  # 16 windows per plane
    manifest = split_by_chunk(g["image"], (0.5, 0.5, 0.0))  # train: plane 0 alone
    data = np.asarray(zarr.open_array(str(root), path="image", mode="r")[...])
    seen: list[tuple[int, ...]] = []
    for rank in range(3):
        pipe = insitu_pipeline(
            str(root), manifest, {"x": view}, batch_size=4, rank=rank, world_size=3
        )
        try:
            pipe.reset()
            for b in pipe:
                rows = zip(b["x"], b.sample_indices["x"], b.patch_origins["x"], strict=True)
                for row, s, (y0, x0) in rows:
                    assert np.array_equal(row, data[s, y0 : y0 + 10, x0 : x0 + 10])
                    seen.append((int(s), int(y0), int(x0)))
        finally:
            pipe.close()
    assert len(seen) == len(set(seen)) == 16 // 3 * 3  # disjoint, 5 windows a rank
    # more ranks than windows is still refused, counting windows
    with pytest.raises(ValueError, match="16 windows"):
        insitu_pipeline(str(root), manifest, {"x": view}, batch_size=4, rank=0, world_size=17)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        # before: "a window of 41 along axis 1 does not fit the field's 40" (no name, no fix)
        (lambda g: g.patches({"y": 41}), r"'y' \(axis 1\).*at most 40"),
        # before: "within[1] = (30, 50) must lie in ..." (the index of an axis named 'y')
        (lambda g: g.patches({"y": 4}, within={"y": (30, 50)}), r"within\['y'\] = \(30, 50\)"),
        # before: "within names axes that are not patched" (which? which are?)
        (lambda g: g.patches({"y": 4}, within={"x": (0, 8)}), r"\['x'\].*patched: \['y'\]"),
        (lambda g: g.patches({"y": 4}, stride={"x": 2}), r"\['x'\].*patched: \['y'\]"),
        # before: no word of within=, the way to keep windows inside a range of a patched axis
        (lambda g: g.isel(y=slice(0, 20)).patches({"y": 4}), r"within=\{'y': \(lo, hi\)\}"),
        (lambda g: g.patches({"y": 4}).isel(y=slice(0, 20)), r"within=\{'y': \(lo, hi\)\}"),
    ],
    ids=["too-large", "within-outside", "within-unpatched", "stride-unpatched", "selected", "isel"],
)
def test_patch_errors_name_the_dimension_and_the_fix(
    two_images: tuple[Path, dict[str, Any]], make: Any, says: str
) -> None:
    _, g = two_images
    with pytest.raises(ValueError, match=says):
        make(g["image"])


def test_the_guaranteed_budget_of_a_field_its_tiles_overhang_runs_an_epoch(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # 50 x 46 in 16² tiles: a slot holds a whole tile, so the edge tiles' slots overhang the
    # field (64 x 48 of slot space). Before, the floors capped every unit's bytes at the
    # field's (18,400) and this budget was refused ("below this epoch's working-set floor of
    # 24,576 bytes"), although schedule_floors promises it fits every epoch.
    root = tmp_path_factory.mktemp("overhang") / "img.zarr"
    data = np.random.default_rng(0).standard_normal((1, 50, 46)).astype("f4")
    arr = zarr.create_array(str(root), name="img", shape=data.shape, chunks=(1, 16, 16), dtype="f4")
    arr[...] = data
    geom = open_geometries(str(root), ["img"])["img"]
    views = {"x": geom.patches({1: 17, 2: 9})}
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    for block in (1, 4):
        floors = schedule_floors(manifest, views, PlanConfig(batch_size=16, block_chunks=block))
        pipe = insitu_pipeline(
            str(root), manifest, views, batch_size=16, block_chunks=block,
            cache_budget_bytes=floors.guaranteed,
        )  # fmt: skip
        try:
            for _ in range(2):
                pipe.reset()
                for b in pipe:
                    for row, (y0, x0) in zip(b["x"], b.patch_origins["x"], strict=True):
                        assert np.array_equal(row, data[0, y0 : y0 + 17, x0 : x0 + 9])
        finally:
            pipe.close()


@pytest.mark.parametrize(
    ("image", "label", "says"),
    [
        ({"origins": "grid"}, {"origins": "random"}, "origins 'grid' vs 'random'"),
        ({"stride": 4}, {"stride": 5}, "stride (4,) vs (5,)"),
        ({"within": {"y": (0, 20)}}, {}, "within ((0, 20),) vs None"),
    ],
    ids=["origins", "stride", "within"],
)
def test_views_patched_otherwise_are_refused_naming_what_differs(
    two_images: tuple[Path, dict[str, Any]], image: Any, label: Any, says: str
) -> None:
    # before: both Patches reprs (ten fields each) and a list of everything that must agree
    root, g = two_images
    views = {
        "x": g["image"].patches({"y": 8}, **image),
        "y": g["label"].patches({"y": 8}, **label),
    }
    manifest = split_by_chunk(g["image"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=re.escape(f"differ in {says}")):
        insitu_pipeline(str(root), manifest, views, batch_size=4)
    with pytest.raises(ValueError, match=re.escape(f"differ in {says}")):
        stack({"x": views["x"], "y": views["y"]})


def test_a_state_restores_only_where_the_same_tiles_stratify_random_windows(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # random windows are stratified by the first patched view's tiles: the image's 8² or the
    # mask's 16². Before, a state saved with the image first restored silently into views
    # listing the mask first, and the rest of the epoch took other windows than the run that
    # saved it would have.
    root = tmp_path_factory.mktemp("order") / "pair.zarr"
    data = np.zeros((2, 32, 32), dtype="u1")
    for name, tile in (("image", 8), ("mask", 16)):
        arr = zarr.create_array(
            str(root), name=name, shape=data.shape, chunks=(1, tile, tile), dtype="u1"
        )
        arr[...] = data
    g = open_geometries(str(root), ["image", "mask"])
    x, y = (g[p].patches({1: 4, 2: 4}, origins="random") for p in ("image", "mask"))
    manifest = split_by_chunk(g["image"], (1.0, 0.0, 0.0))
    saved = insitu_pipeline(str(root), manifest, {"x": x, "y": y}, batch_size=8)
    try:
        saved.reset()
        next(saved)
        state = saved.state_dict()
    finally:
        saved.close()
    same = insitu_pipeline(str(root), manifest, {"x": x, "y": y}, batch_size=8)
    same.reset(state)  # the same order restores
    same.close()
    other = insitu_pipeline(str(root), manifest, {"y": y, "x": x}, batch_size=8)
    try:
        with pytest.raises(ValueError, match="patch_tiles"):
            other.reset(state)
    finally:
        other.close()


@pytest.mark.parametrize("bounds", [(2.7, 20.2), (2.0, 20), (True, 20)])
def test_a_within_box_of_floats_is_refused_not_truncated(
    two_images: tuple[Path, dict[str, Any]], bounds: tuple[Any, Any]
) -> None:
    # (2.7, 20.2) was cut to (2, 20) silently, while the window's size refuses 4.0
    _, g = two_images
    with pytest.raises(TypeError, match=r"within\['y'\] = .* indices along the axis, so ints"):
        g["image"].patches({"y": 8, "x": 8}, within={"y": bounds})
    box = g["image"].patches({"y": 8, "x": 8}, within={"y": (np.int64(2), 20)}).patch
    assert box is not None and box.within is not None and box.within[0] == (2, 20)
