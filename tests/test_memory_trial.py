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


def test_a_static_label_cut_to_each_rows_window_is_counted_in_the_batch_buffer_bytes(
    tmp_path: Path,
) -> None:
    # before: each batch's cut of the static label was a fresh array, held by the batches in
    # the prefetch queue and by the consumer like a label's batch buffer, and counted nowhere
    # (stats()'s batch_buffer_bytes counted the patched label's buffers only)
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
            assert pipe.stats()["batch_buffer_bytes"] >= held
        allocations = pipe.stats()["batch_buffer_bytes"]
        kept.clear()
        for _ in Loader(pipe):  # the kept batches' buffers are lent again, none made
            pass
        assert pipe.stats()["batch_buffer_bytes"] <= allocations
