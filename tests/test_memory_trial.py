"""The memory a pipeline holds, against what the docs and ``pipe.stats()`` say (the memory
trial of 2026-12-06): pipelines built, run and dropped in one process, their pools, batch
buffers and static cuts measured. Each test proves a before/after behaviour the trial found;
zarr's own read of the store is the oracle for the batches, weak references and the pipeline's
own counters for what is held.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.forcings import FORCINGS, Forcings
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = pytest.mark.timeout(60)


def test_a_pipeline_run_by_a_loader_is_freed_with_its_pool_once_dropped(
    era5_v3_path: Path,
) -> None:
    # before: the loader registry (one running loop per root) was a WeakKeyDictionary whose
    # value, the Loader, held its key, the root: every pipeline ever iterated by a Loader stayed
    # alive with its pool and batch buffers (three builds in one process held three pools)
    geoms = open_geometries(era5_v3_path, ["t2m"])
    manifest = split_by_chunk(geoms["t2m"], (0.8, 0.1, 0.1))
    reference = np.asarray(zarr.open_group(era5_v3_path, mode="r")["t2m"][...])
    dropped = []
    for _ in range(2):
        pipe = insitu_pipeline(era5_v3_path, manifest, {"x": geoms["t2m"]}, batch_size=8)
        with pipe:
            for batch in Loader(pipe):
                np.testing.assert_array_equal(batch["x"], reference[batch.sample_indices["x"]])
        dropped.append((weakref.ref(pipe), weakref.ref(pipe.stages.pool)))
        del pipe, batch
    gc.collect()
    assert [(p() is None, q() is None) for p, q in dropped] == [(True, True)] * 2


def _grid(root: Path) -> None:
    group = zarr.open_group(root, mode="w", zarr_format=3)
    rng = np.random.default_rng(0)
    for name, data, dims, chunks in (
        ("t2m", rng.random((32, 8, 12), dtype="f4"), ("time", "lat", "lon"), (4, 4, 6)),
        ("lsm", rng.random((8, 12), dtype="f4"), ("lat", "lon"), (8, 12)),
        ("time", np.arange(32), ("time",), (32,)),
    ):
        group.create_array(name, shape=data.shape, chunks=chunks, dtype=data.dtype,
                           dimension_names=dims)[...] = data  # fmt: skip


def test_a_static_label_cut_to_each_rows_window_is_counted_outside_the_pool(
    tmp_path: Path,
) -> None:
    # before: each batch's cut of the static label was a fresh array, held by the batches in
    # the prefetch queue and by the consumer like a label's batch buffer, and counted nowhere
    # (stats() counted the patched label's buffers only; the cuts are the static fields', in
    # batch_transform_bytes)
    root = tmp_path / "grid.zarr"
    _grid(root)
    geoms = open_geometries(root, sample_axis="time")
    box = geoms["t2m"].patches({"lat": 3, "lon": 4}, origins="random")
    lsm = np.asarray(zarr.open_group(root, mode="r")["lsm"][...])
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    views = {"x": box, "lsm": geoms["lsm"]}
    with insitu_pipeline(root, manifest, views, batch_size=4, coords=()) as pipe:
        kept = []
        for epoch in range(2):
            for batch in Loader(pipe):
                for row, (i, j) in enumerate(batch.patch_origins["x"]):
                    np.testing.assert_array_equal(batch["lsm"][row], lsm[i : i + 3, j : j + 4])
                if epoch == 0:
                    kept.append(batch)  # held by the consumer: lent out, counted
            held = sum(a.nbytes for b in kept for a in b.arrays.values())
            stats = pipe.stats()
            assert stats["batch_buffer_bytes"] + stats["batch_transform_bytes"] >= held
        allocations = pipe.stats()["batch_transform_bytes"]
        kept.clear()
        for _ in Loader(pipe):  # the kept batches' buffers are lent again, none made
            pass
        assert pipe.stats()["batch_transform_bytes"] <= allocations


def test_what_the_batch_transforms_hold_is_counted_outside_the_pool(tmp_path: Path) -> None:
    # before: the forcings' memory of the times they computed (up to 64 MiB per Forcings, kept
    # for the pipeline's life), a static field read whole when the pipeline was built and the
    # buffers its cuts are lent from were counted in no entry of stats()
    root = tmp_path / "e.zarr"
    make_era5_like(root, n_time=48, n_lat=8, n_lon=16, samples_per_chunk=8, variables=["t2m"])
    t2m = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    forcings = Forcings("x", view=t2m)
    times = zarr.open_group(root, mode="r")["time"][...]
    with insitu_pipeline(
        root, manifest, {"x": t2m}, batch_size=6, batch_transforms=[forcings]
    ) as pipe:
        for batch in Loader(pipe):
            assert set(batch.arrays) == {"x", *FORCINGS}
        stats = pipe.stats()
    remembered = len(np.unique(times)) * len(FORCINGS) * 8 * 16 * 4  # float32 fields
    assert stats["batch_transform_bytes"] >= remembered
    assert stats["outside_pool_bytes"] == (
        stats["batch_buffer_bytes"] + stats["decode_scratch_bytes"] + stats["batch_transform_bytes"]
    )
    # a static field: its whole array, and its cuts' buffers beside patched labels
    grid = tmp_path / "grid.zarr"
    _grid(grid)
    geoms = open_geometries(grid, sample_axis="time")
    lsm = np.asarray(zarr.open_group(grid, mode="r")["lsm"][...])
    box = geoms["t2m"].patches({"lat": 3, "lon": 4}, origins="random")
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    for views in ({"x": geoms["t2m"], "lsm": geoms["lsm"]}, {"x": box, "lsm": geoms["lsm"]}):
        with insitu_pipeline(grid, manifest, views, batch_size=4, coords=()) as pipe:
            kept = list(Loader(pipe))
            cuts = sum(b["lsm"].nbytes for b in kept) if "x" in kept[0].patch_origins else 0
            assert pipe.stats()["batch_transform_bytes"] >= lsm.nbytes + cuts


def test_the_forcings_rows_are_lent_and_counted_outside_the_pool(tmp_path: Path) -> None:
    # before: each batch's forcings were fresh arrays (one per forcing, a row per sample), held
    # by the batches in the prefetch queue and by the consumer, and counted nowhere:
    # batch_transform_bytes held the forcings' memory of the times they computed only
    root = tmp_path / "e.zarr"
    make_era5_like(root, n_time=48, n_lat=8, n_lon=16, samples_per_chunk=8, variables=["t2m"])
    t2m = open_geometries(root, ["t2m"])["t2m"]
    box = t2m.patches({"lat": 3, "lon": 4}, origins="random")
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    names = ["cos_solar_zenith", "local_time_sin"]
    oracle = Forcings("x", names=names, view=t2m)  # on the whole grid, computed apart
    for view in (t2m, box):
        forcings = Forcings("x", names=names, view=view)
        with insitu_pipeline(root, manifest, {"x": view}, batch_size=6,
                             batch_transforms=[forcings]) as pipe:  # fmt: skip
            kept = list(Loader(pipe))  # held by the consumer: lent out, counted
            copies = [{n: np.array(b[n]) for n in names} for b in kept]
            for batch, values in zip(kept, copies, strict=True):
                want = oracle.compute(batch.coords["x"]["time"])
                for n in names:
                    w = want[n]
                    if view.patch is not None:
                        at = enumerate(batch.patch_origins["x"])
                        w = np.stack([w[r, i : i + 3, j : j + 4] for r, (i, j) in at])
                    np.testing.assert_array_equal(values[n], w)
            held = sum(b[n].nbytes for b in kept for n in names)
            remembered = 48 * len(names) * 8 * 16 * 4  # every time's float32 fields
            stats = pipe.stats()
            assert stats["batch_transform_bytes"] >= forcings.held_bytes >= remembered + held
            for _ in Loader(pipe):  # the kept batches' rows are never written again
                pass
            for batch, values in zip(kept, copies, strict=True):
                for n in names:
                    np.testing.assert_array_equal(batch[n], values[n])
            made = pipe.stats()["batch_transform_bytes"]
            kept.clear()
            for _ in range(2):  # once dropped, their buffers are lent again: none made
                for _ in Loader(pipe):
                    pass
            assert pipe.stats()["batch_transform_bytes"] <= made


def test_close_lets_go_of_the_idle_chunks_and_buffers_and_the_pipeline_goes_on(
    tmp_path: Path,
) -> None:
    # before: close() stopped the thread and unpinned, and kept the pool's slots, the idle
    # batch buffers and the static cuts' and forcings' idle buffers until the pipeline was
    # dropped (docs/pipeline.md said so: "close() keeps them")
    root = tmp_path / "e.zarr"
    make_era5_like(root, n_time=48, n_lat=8, n_lon=16, samples_per_chunk=8, variables=["t2m"])
    group = zarr.open_group(root, mode="r+")
    lsm = np.arange(8 * 16, dtype="f4").reshape(8, 16)
    group.create_array("lsm", shape=lsm.shape, dtype="f4", dimension_names=("lat", "lon"))
    group["lsm"][...] = lsm
    t2m = np.asarray(group["t2m"][...])
    geoms = open_geometries(root, ["t2m", "lsm"], sample_axis="time")
    box = geoms["t2m"].patches({"lat": 4, "lon": 8}, origins="random")
    manifest = split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0))
    sun = Forcings("x", names=["cos_solar_zenith"], view=box)
    views = {"x": box, "lsm": geoms["lsm"]}
    with insitu_pipeline(root, manifest, views, batch_size=6, batch_transforms=[sun]) as pipe:
        epoch = len(list(pipe))  # (the forcings remember every time: they grow no more)
        pipe.reset()
        first = next(pipe)  # kept by the consumer: lent, stays counted and unchanged
        kept = {k: np.array(v) for k, v in first.arrays.items()}
        for _ in range(2):
            next(pipe)
        before = pipe.stats()
        pipe.close()
        after = pipe.stats()
        pool = pipe.stages.pool
        assert before["batch_buffer_bytes"] > after["batch_buffer_bytes"]
        assert before["batch_transform_bytes"] > after["batch_transform_bytes"]
        assert pool.allocated_bytes == 0 and pool.pinned_count() == 0
        lent = sum(a.nbytes for k, a in first.arrays.items() if k != "lsm") + first["lsm"].nbytes
        assert after["batch_buffer_bytes"] + after["batch_transform_bytes"] >= lent
        rest = list(pipe)  # the same epoch goes on
        assert 3 + len(rest) == epoch
        for batch in rest:
            for r, (i, j) in enumerate(batch.patch_origins["x"]):
                index = batch.sample_indices["x"][r]
                np.testing.assert_array_equal(batch["x"][r], t2m[index, i : i + 4, j : j + 8])
                np.testing.assert_array_equal(batch["lsm"][r], lsm[i : i + 4, j : j + 8])
        for k, v in kept.items():
            np.testing.assert_array_equal(first.arrays[k], v)
