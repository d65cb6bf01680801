"""The fetch stage never leaves a consumer waiting on a chunk whose fill failed in the machinery
itself (not in the store, not in a decode)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import counting_store, write_era5

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.stages._jobs import ArrayFill


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reads", ["local", "get"])
def test_a_fill_that_fails_before_any_get_raises_at_the_consumer_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str
) -> None:
    root = tmp_path / "store.zarr"
    write_era5(root, n_time=64, variables=("t2m",))
    store = root if reads == "local" else counting_store(root)  # read on the decode threads
    g = open_geometries(store, ["t2m"])["t2m"]

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug while setting up a stored object's read")

    monkeypatch.setattr(ArrayFill, "key", broken)
    pipe = insitu_pipeline(store, split_by_chunk(g), {"x": g}, batch_size=8)
    with pipe, pytest.raises(RuntimeError, match="setting up a stored object's read"):
        next(iter(pipe))
    assert pipe.stages.pool.pinned_count() == 0
