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
