"""The persistent cache under a demanding user (the cache trial of 2026-12-06): one cache_dir
filled by one pipeline and read by another whose store changed in a way the first did not
expect. Each test proves a before/after behaviour found by the trial; zarr's own read of the
store is the oracle, and the counts are the pipeline's GETs (``pipe.stats()``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk

pytestmark = pytest.mark.timeout(60)


def _write(root: Path, chunks: tuple[int, ...], seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).random((8, 4, 4)).astype("f4")
    array = zarr.create_array(root, name="t2m", shape=values.shape, chunks=chunks, dtype="f4",
                              dimension_names=("time", "lat", "lon"), overwrite=True)  # fmt: skip
    array[...] = values
    return values


def _epoch(root: Path, cache: Path, want: np.ndarray, **kw: Any) -> dict[str, int]:
    """One epoch over the persistent cache, every row checked against ``want``; the stats."""
    geom = open_geometries(root)["t2m"]
    pipe = insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), ["t2m"], batch_size=4,
                           coords=(), cache_dir=cache, persist=True, **kw)  # fmt: skip
    try:
        seen = []
        for batch in Loader(pipe):
            np.testing.assert_array_equal(batch["t2m"], want[batch.sample_indices["t2m"]])
            seen += batch.sample_indices["t2m"].tolist()
        assert sorted(seen) == list(range(len(want)))
        return pipe.stats()
    finally:
        pipe.close()


def test_a_cache_rebuilt_after_the_store_was_rechunked_is_warm_on_the_next_run(
    tmp_path: Path,
) -> None:
    """Before: the identity rows of the old chunking's objects (``t2m/c/0/1/0``, gone after the
    rewrite) stayed attached to the rebuilt chunks, so every later run found them "deleted",
    warned and fetched those chunks again, forever. After: a chunk's rows are those of its
    last commit, and the run after the rebuild reads nothing."""
    root, cache = tmp_path / "s.zarr", tmp_path / "cache"
    first = _write(root, (4, 2, 4), seed=0)  # two stored objects per chunk
    assert _epoch(root, cache, first)["gets"] == 4
    second = _write(root, (4, 4, 4), seed=1)  # one object per chunk: c/i/1/0 deleted
    assert _epoch(root, cache, second, reset_stale_cache=True)["gets"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = _epoch(root, cache, second)
    assert stats["gets"] == 0 and stats["disk_hits"] == 2
