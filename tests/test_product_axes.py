"""Product sample axes (issue 32): ``sample_axis=("t", "z")`` makes every (t, z) pair a sample.

zarr is the oracle: every batch row equals ``array[t, :, z]`` for the (t, z) that
``geom.sample_coords(batch.sample_indices[label])`` names, for a ``(t, c, z, y, x)`` array
whose t and z lengths are not multiples of their chunks (edge blocks with padding). Each stored
object is read once per epoch; splits are whole stored blocks; the block shuffle mixes t; a
resumed epoch continues exactly; ranks deal disjoint samples in equal batch counts; patches and
selections are zarr's reads; shifts, windows and a mix of product and plain views are refused
by name.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store
from resume_helpers import assert_resumes_exactly, epochs_of

from insitubatch_nodes import (
    Coarsen,
    Loader,
    SplitManifest,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.io.product import ProductGrid
from insitubatch_nodes.options import FetchOptions

T, C, Z, Y, X = 5, 2, 7, 4, 6
CHUNKS = (2, 2, 3, 4, 3)  # t blocks 2+2+1, z blocks 3+3+1, two x tiles
GRID = (3, 3)  # stored objects along (t, z): 9 blocks of up to 6 samples


def _write(root: Path) -> np.ndarray:
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = np.arange(T * C * Z * Y * X, dtype="f4").reshape(T, C, Z, Y, X)
    image = group.create_array(
        "image", shape=data.shape, chunks=CHUNKS, dtype="f4", dimension_names=tuple("tczyx")
    )
    image[:] = data
    labels = group.create_array(
        "labels",
        shape=(T, 1, Z, Y, X),
        chunks=(2, 1, 3, 4, 6),
        dtype="u2",
        dimension_names=tuple("tczyx"),
    )
    t_z = np.arange(T)[:, None, None, None, None] * 100 + np.arange(Z)[:, None, None]
    labels[:] = t_z.astype("u2")
    return data


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("product") / "stack.zarr"
    _write(root)
    return root


def _oracle(root: Path, path: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root, path=path, mode="r")[...])


def _rows(pipe: Any, geom: Any, label: str = "x", epochs: int = 1) -> list[tuple[int, ...]]:
    """``(epoch, t, z)`` of every row delivered, in order."""
    out = []
    loader = Loader(pipe)
    for e in range(epochs):
        for batch in loader:
            tz = geom.sample_coords(batch.sample_indices[label])
            out.extend((e, int(t), int(z)) for t, z in tz)
    return out


def _pipeline(root: Any, views: dict[str, Any], manifest: Any = None, **kw: Any) -> Any:
    geom = next(iter(views.values()))
    manifest = manifest if manifest is not None else split_by_chunk(geom, (1.0, 0.0, 0.0))
    return insitu_pipeline(root, manifest, views, **kw)


def test_every_row_is_zarrs_read_at_its_t_and_z(stack: Path) -> None:
    geoms = open_geometries(stack, sample_axis=("t", "z"))
    image, labels = geoms["image"], geoms["labels"]
    assert image.product is not None and image.product.axes == (0, 2)
    assert image.inner_shape == (C, Y, X) and labels.inner_shape == (1, Y, X)
    assert image.samples_per_chunk == 6 and image.n_chunks == 9
    data, seg = _oracle(stack, "image"), _oracle(stack, "labels")
    pipe = _pipeline(stack, {"x": image, "y": labels}, batch_size=4, block_chunks=2, seed=3)
    seen = []
    try:
        for batch in Loader(pipe):
            tz = image.sample_coords(batch.sample_indices["x"])
            assert tz.shape == (len(batch), 2)
            np.testing.assert_array_equal(batch.sample_indices["x"], batch.sample_indices["y"])
            for r, (t, z) in enumerate(tz):
                np.testing.assert_array_equal(batch["x"][r], data[t, :, z])
                np.testing.assert_array_equal(batch["y"][r], seg[t, :, z])
                seen.append((int(t), int(z)))
    finally:
        pipe.close()
    assert sorted(seen) == [(t, z) for t in range(T) for z in range(Z)]  # each pair once


def test_axes_given_by_index_are_the_same_product(stack: Path) -> None:
    by_name = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    by_index = open_geometries(stack, ["image"], sample_axis=(0, 2))["image"]
    assert by_index == by_name and by_index.product == by_name.product


def test_sample_coords_and_samples_are_inverse_and_skip_padding() -> None:
    grid = ProductGrid((0, 2), (T, C, Z, Y, X), CHUNKS)
    pairs = np.array([(t, z) for t in range(T) for z in range(Z)])
    samples = grid.samples(pairs)
    assert len(set(samples.tolist())) == T * Z
    np.testing.assert_array_equal(grid.coords(samples), pairs)
    # the valid samples of each block come first: an edge block's padding follows them
    for chunk in range(grid.n_chunks):
        start, stop = grid.chunk_range(chunk)
        inside = samples[(samples >= chunk * 6) & (samples < (chunk + 1) * 6)]
        assert sorted(inside.tolist()) == list(range(start, stop))
    with pytest.raises(ValueError, match="padding"):
        grid.coords([grid.chunk_range(2)[1]])  # block (0, 2) holds 2 x 1 pairs of 6


def test_each_stored_object_is_read_once_per_epoch(stack: Path) -> None:
    store = counting_store(stack)
    geoms = open_geometries(store, ["image"], sample_axis=("t", "z"))
    store.reset_counts()
    pipe = _pipeline(store, {"x": geoms["image"]}, batch_size=5, block_chunks=2, seed=1)
    loader = Loader(pipe)
    try:
        per_epoch = []
        for _ in range(2):
            rows = sum(len(b) for b in loader)
            per_epoch.append((rows, store.chunk_counts()))
            store.reset_counts()
    finally:
        pipe.close()
    (rows0, first), (rows1, second) = per_epoch
    assert rows0 == rows1 == T * Z
    # every stored object of the array (3 t blocks x 3 z blocks x 2 x tiles), once; the
    # second epoch reads what the pool did not keep, once
    assert len(first) == 3 * 3 * 2 and set(first.values()) == {1}, first
    assert set(second.values()) <= {1}, second


def test_splits_are_whole_stored_blocks(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    manifest = split_by_chunk(image, (0.5, 0.5, 0.0), contiguous=False, seed=4)
    got = {}
    for split in ("train", "val"):
        pipe = _pipeline(stack, {"x": image}, manifest, split=split, batch_size=4)
        try:
            got[split] = [(t, z) for _, t, z in _rows(pipe, image)]
        finally:
            pipe.close()
        blocks = {(t // 2, z // 3) for t, z in got[split]}
        want = {image.product.block_of(c) for c in manifest.chunks(split)}  # type: ignore[union-attr]
        assert blocks == want
        # every pair of the split's blocks, and no other
        assert len(got[split]) == sum(
            int(image.product.counts[c])
            for c in manifest.chunks(split)  # type: ignore[union-attr]
        )
    assert not set(got["train"]) & set(got["val"])
    assert len(got["train"]) + len(got["val"]) == T * Z


def test_the_block_shuffle_mixes_t(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    pipe = _pipeline(stack, {"x": image}, batch_size=6, block_chunks=3, seed=0)
    try:
        batches = [image.sample_coords(b.sample_indices["x"]) for b in Loader(pipe)]
    finally:
        pipe.close()
    assert any(len(set(tz[:, 0].tolist())) > 1 for tz in batches)  # a batch holds several t
    assert any(len(set(tz[:, 1].tolist())) > 1 for tz in batches)
    order = np.concatenate(batches)
    assert not np.array_equal(order, np.array(sorted(map(tuple, order))))  # not in grid order


def _records(batches: list[Any]) -> list[tuple]:
    return [(b.epoch, b.index, b.sample_indices["x"].tolist(), b["x"].sum()) for b in batches]


def test_a_resumed_epoch_continues_exactly(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    manifest = split_by_chunk(image, (1.0, 0.0, 0.0))

    def build() -> Any:
        return insitu_pipeline(stack, manifest, {"x": image}, batch_size=4, block_chunks=2, seed=9)

    pipe = build()
    try:
        ref = _records(list(islice(epochs_of(Loader(pipe)), 2 * 9)))  # two epochs of 9 batches
    finally:
        pipe.close()
    per_epoch = len(ref) // 2
    assert per_epoch == -(-T * Z // 4)
    assert_resumes_exactly(build, _records, ref, (1, per_epoch - 1, per_epoch + 2))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_deal_disjoint_pairs_in_equal_batch_counts(stack: Path, world: int) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    data = _oracle(stack, "image")
    manifest = split_by_chunk(image, (1.0, 0.0, 0.0))
    per_rank, counts = [], []
    for rank in range(world):
        pipe = insitu_pipeline(
            stack, manifest, {"x": image}, batch_size=3, seed=5, rank=rank, world_size=world
        )
        try:
            mine, batches = [], 0
            for batch in Loader(pipe):
                batches += 1
                tz = image.sample_coords(batch.sample_indices["x"])
                for r, (t, z) in enumerate(tz):
                    np.testing.assert_array_equal(batch["x"][r], data[t, :, z])
                    mine.append((int(t), int(z)))
            assert batches == len(pipe)
            per_rank.append(mine)
            counts.append(batches)
        finally:
            pipe.close()
    flat = [p for mine in per_rank for p in mine]
    assert len(flat) == len(set(flat)), "ranks share a pair"
    assert T * Z - len(flat) <= world - 1
    assert len(set(counts)) == 1, f"unequal batch counts {counts}"


def test_shifts_and_windows_on_product_axes_are_refused(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    with pytest.raises(ValueError, match=r"shift\(\).*product of axes \(0, 2\)"):
        image.shift(1)
    with pytest.raises(ValueError, match=r"window\(\).*offset has no single meaning"):
        image.window([-1, 0])


def test_patches_and_selections_on_product_axes_are_zarrs_reads(stack: Path) -> None:
    # before: patches() and isel()/sel() were refused on product sample axes
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    data = _oracle(stack, "image")
    grid = image.patches({"y": 2, "x": 2})  # 2 x 3 windows of each (t, z) pair
    one = image.isel(c=[1]).patches({"y": 3, "x": 2}, origins="random")
    cut = image.isel(c=1, x=slice(1, 5))
    for view, per_pair in ((grid, 6), (one, 2), (cut, 1)):
        seen = set()
        with _pipeline(stack, {"x": view}, batch_size=7, block_chunks=2, seed=1) as pipe:
            for batch in Loader(pipe):
                tz = image.sample_coords(batch.sample_indices["x"])
                origins = batch.patch_origins.get("x", np.zeros((len(batch), 2), np.int64))
                for row, (t, z), (y0, x0) in zip(batch["x"], tz, origins, strict=True):
                    want = data[t, :, z]
                    if view is grid:
                        want = want[:, y0 : y0 + 2, x0 : x0 + 2]
                    elif view is one:
                        want = want[[1], y0 : y0 + 3, x0 : x0 + 2]
                    else:
                        want = want[1, :, 1:5]
                    np.testing.assert_array_equal(row, want)
                    seen.add((int(t), int(z), int(y0), int(x0)))
        assert len(seen) == T * Z * per_pair, view


def test_bad_product_axes_are_refused_by_name(stack: Path) -> None:
    with pytest.raises(ValueError, match="two or more axes"):
        open_geometries(stack, ["image"], sample_axis=("t",))
    with pytest.raises(ValueError, match="two or more distinct axes"):
        open_geometries(stack, ["image"], sample_axis=("t", 0))
    with pytest.raises(KeyError, match="no dimension named 'w'"):
        open_geometries(stack, ["image"], sample_axis=("t", "w"))
    with pytest.raises(ValueError, match="leave no field axis"):
        open_geometries(stack, ["image"], sample_axis=(0, 1, 2, 3, 4))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"stride": 2}, r"stride 2 steps along one sample axis"),
        ({"stride": "6h"}, r"stride 6 hours steps along one sample axis"),
        ({"missing": [np.datetime64("2000-01-01")]}, r"missing= is not supported on views"),
        ({"coords": ["t"]}, r"carry no coordinates: pass coords=\(\)"),
    ],
)
def test_time_options_on_product_axes_are_refused_by_name(
    stack: Path, option: dict[str, Any], message: str
) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    with pytest.raises(ValueError, match=message):
        insitu_pipeline(stack, split_by_chunk(image, (1.0, 0.0, 0.0)), {"x": image}, **option)


def test_an_absent_stored_object_drops_its_blocks_pairs_with_drop(tmp_path: Path) -> None:
    root = tmp_path / "holes.zarr"
    data = _write(root)
    (root / "image" / "c" / "1" / "0" / "0" / "0" / "1").unlink()  # t block 1, z block 0, tile 1
    image = open_geometries(root, ["image"], sample_axis=("t", "z"))["image"]
    pipe = _pipeline(root, {"x": image}, missing_objects="drop", batch_size=5)
    dropped = pipe.stages.plan.dropped
    seen = set()
    with pipe:
        for batch in Loader(pipe):
            for r, (t, z) in enumerate(image.sample_coords(batch.sample_indices["x"])):
                np.testing.assert_array_equal(batch["x"][r], data[t, :, z])
                seen.add((int(t), int(z)))
    gone = {(t, z) for t in (2, 3) for z in (0, 1, 2)}
    assert seen == {(t, z) for t in range(T) for z in range(Z)} - gone
    assert dropped["absent_object"] == len(gone)


def test_a_pipeline_does_not_mix_product_and_plain_views(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    plain = open_geometries(stack, ["labels"], sample_axis="t")["labels"]
    with pytest.raises(ValueError, match=r"'labels' has one sample axis.*same product"):
        insitu_pipeline(stack, split_by_chunk(image, (1.0, 0.0, 0.0)), {"x": image, "y": plain})


def test_member_by_time_pairs_of_an_ensemble_read_whole_blocks_from_a_warm_cache(
    tmp_path: Path,
) -> None:
    # (member, time, lat, lon), members chunked 2 and times 3: the product axes are adjacent,
    # so each block's rows are the stored object's own order (decoded straight, no permutation)
    root = tmp_path / "ens.zarr"
    data = np.arange(5 * 7 * 3 * 4, dtype="f4").reshape(5, 7, 3, 4)
    arr = zarr.open_group(root, mode="w", zarr_format=3).create_array(
        "t2m",
        shape=data.shape,
        chunks=(2, 3, 3, 4),
        dtype="f4",
        dimension_names=("member", "time", "lat", "lon"),
    )
    arr[:] = data
    store = counting_store(root)
    geom = open_geometries(store, ["t2m"], sample_axis=("member", "time"))["t2m"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    for run in range(2):
        store.reset_counts()
        pipe = insitu_pipeline(
            store,
            manifest,
            {"x": geom},
            batch_size=4,
            seed=2,
            cache_dir=tmp_path / "cache",
            persist=True,
        )
        try:
            seen = []
            for batch in Loader(pipe):
                for r, (m, t) in enumerate(geom.sample_coords(batch.sample_indices["x"])):
                    np.testing.assert_array_equal(batch["x"][r], data[m, t])
                    seen.append((int(m), int(t)))
        finally:
            pipe.close()
        assert sorted(seen) == [(m, t) for m in range(5) for t in range(7)]
        if run == 0:
            assert len(store.chunk_counts()) == 3 * 3 and set(store.chunk_counts().values()) == {1}
        else:
            assert store.chunk_counts() == {}, "a warm cache read the store"


@pytest.mark.parametrize("axes", [("member", "time"), ("time", "member")])
def test_a_block_decodes_straight_when_its_axes_lead_in_storage_order_else_in_one_copy(
    tmp_path: Path, axes: tuple[str, str]
) -> None:
    root = tmp_path / "ens.zarr"
    data = np.arange(5 * 7 * 3 * 4, dtype="f4").reshape(5, 7, 3, 4)
    arr = zarr.open_group(root, mode="w", zarr_format=3).create_array(
        "t2m",
        shape=data.shape,
        chunks=(2, 3, 3, 4),
        dtype="f4",
        dimension_names=("member", "time", "lat", "lon"),
    )
    arr[:] = data
    geom = open_geometries(root, ["t2m"], sample_axis=axes)["t2m"]
    decoder = ChunkDecoder(geom)
    last = geom.n_chunks - 1  # the edge block: members 4, times 6 (1 x 1 valid of 2 x 3)
    for chunk in (0, last):
        slot = np.full((geom.samples_per_chunk, *geom.inner_shape), -1, dtype="f4")
        start, stop = geom.chunk_range(chunk)
        key = geom.store_key(chunk)
        decoder.decode_into((root / key).read_bytes(), slot[: stop - start], chunk, (0, 0))
        rows = geom.sample_coords(np.arange(start, stop))
        want = data[rows[:, 0], rows[:, 1]] if axes[0] == "member" else data[rows[:, 1], rows[:, 0]]
        np.testing.assert_array_equal(slot[: stop - start], want)
        assert (slot[stop - start :] == -1).all(), "padding rows are left alone"
    # a whole block whose axes lead in storage order is decompressed into the slot itself
    if axes == ("member", "time"):
        assert decoder._stats.inplace == 1 and decoder._stats.scratch == 1
    else:
        assert decoder._stats.inplace == 0 and decoder._stats.scratch == 2


def test_a_chunk_transform_sees_each_blocks_valid_pairs_sample_first(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    data = _oracle(stack, "image")
    pipe = insitu_pipeline(
        stack,
        split_by_chunk(image, (1.0, 0.0, 0.0)),
        {"x": image},
        batch_size=6,
        chunk_transforms=[Coarsen((1, 2, 3))],
    )
    try:
        n = 0
        for batch in Loader(pipe):
            assert batch["x"].shape[1:] == (C, Y // 2, X // 3)
            for r, (t, z) in enumerate(image.sample_coords(batch.sample_indices["x"])):
                want = data[t, :, z].reshape(C, Y // 2, 2, X // 3, 3).mean(axis=(2, 4))
                np.testing.assert_allclose(batch["x"][r], want, rtol=1e-6)
                n += 1
    finally:
        pipe.close()
    assert n == T * Z


def test_one_pair_per_stored_object_decodes_straight_into_batch_rows(tmp_path: Path) -> None:
    # chunks of one t and one z: one sample per chunk, which the fetch stage decodes straight
    # into the batch rows (no pool slot) with FetchOptions(direct=True)
    root = tmp_path / "planes.zarr"
    data = np.arange(3 * 2 * 4 * 5, dtype="i4").reshape(3, 2, 4, 5)
    arr = zarr.open_group(root, mode="w", zarr_format=3).create_array(
        "image", shape=data.shape, chunks=(1, 2, 1, 5), dtype="i4"
    )
    arr[:] = data
    geom = open_geometries(root, ["image"], sample_axis=(0, 2))["image"]
    assert geom.samples_per_chunk == 1 and geom.inner_shape == (2, 5)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    fetch = FetchOptions(direct=True)
    pipe = insitu_pipeline(root, manifest, {"x": geom}, batch_size=5, fetch=fetch)
    try:
        seen = []
        for batch in Loader(pipe):
            groups = pipe.stages.fetch._admission.groups  # type: ignore[union-attr]
            assert all(g.in_place is not None for g in groups), "rows decoded in place"
            for r, (t, z) in enumerate(geom.sample_coords(batch.sample_indices["x"])):
                np.testing.assert_array_equal(batch["x"][r], data[t, :, z])
                seen.append((int(t), int(z)))
    finally:
        pipe.close()
    assert sorted(seen) == [(t, z) for t in range(3) for z in range(4)]


def test_a_saved_manifest_reloaded_follows_the_product_grid_again(stack: Path) -> None:
    image = open_geometries(stack, ["image"], sample_axis=("t", "z"))["image"]
    saved = split_by_chunk(image, (1.0, 0.0, 0.0))
    loaded = SplitManifest.from_dict(saved.to_dict())
    assert loaded.product is None  # never saved: the pipeline attaches it from the views
    pipe = insitu_pipeline(stack, loaded, {"x": image}, batch_size=8)
    try:
        rows = _rows(pipe, image)
    finally:
        pipe.close()
    assert sorted((t, z) for _, t, z in rows) == [(t, z) for t in range(T) for z in range(Z)]
    other = open_geometries(stack, ["image"], sample_axis=("z", "t"))["image"]
    with pytest.raises(ValueError, match=r"follow ProductGrid\(axes=\(0, 2\).*same product"):
        insitu_pipeline(stack, saved, {"x": other})
