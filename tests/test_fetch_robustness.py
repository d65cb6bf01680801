"""The fetch stage never leaves a consumer waiting on a chunk whose task failed to start."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_era5

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.fetch import AsyncChunkFetchNode


@pytest.mark.timeout(60)
def test_a_fetch_task_that_fails_before_any_get_raises_at_the_consumer_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store.zarr"
    write_era5(root, n_time=64, variables=("t2m",))
    g = open_geometries(root, ["t2m"])["t2m"]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug while setting up a tile task")

    monkeypatch.setattr(AsyncChunkFetchNode, "_fill_tile", broken)
    pipe = insitu_pipeline(root, split_by_chunk(g), {"x": g}, batch_size=8)
    with pipe, pytest.raises(RuntimeError, match="setting up a tile task"):
        next(iter(pipe))
    assert pipe.stages.pool.pinned_count() == 0
