"""States saved and a cache written by an earlier version still resume and still hit.

The files under ``tests/data/`` were written by ``tests/golden.py`` before the package was
restructured; moving modules, renaming internals or reshaping a node must not change what a saved
checkpoint resumes to, nor make a warmed cache miss. Rewrite them only for a deliberate change of
the checkpoint or cache format (and say so in the change).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import golden
import numpy as np
import pytest
import resume_helpers as rh
import zarr


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rh.write_store(tmp_path_factory.mktemp("golden") / "era5.zarr")


def _saved(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_a_loader_state_saved_by_an_earlier_version_resumes_to_the_same_next_batch(
    store: Path,
) -> None:
    from insitubatch_nodes import Loader

    saved = _saved(golden.LOADER_STATE)
    pipe = rh.build_pipeline(golden.golden_config(store))
    try:
        loader = Loader(pipe)
        loader.load_state_dict(saved["state"])
        batch = next(iter(loader))
        assert rh.record(batch) == saved["next"]
        full = np.asarray(zarr.open_group(str(store), mode="r")["t2m"][...])
        np.testing.assert_array_equal(batch.arrays["y"], full[batch.sample_indices["y"]])
    finally:
        pipe.close()


def test_a_dataset_state_saved_by_an_earlier_version_resumes_to_the_same_next_item(
    store: Path,
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes import as_dataset

    saved = _saved(golden.DATASET_STATE)
    pipe = rh.build_pipeline(golden.golden_config(store))
    try:
        dl = StatefulDataLoader(
            as_dataset(pipe, transform=rh.indexed_transform), batch_size=None, num_workers=0
        )
        dl.load_state_dict(saved["state"])
        assert rh.record_item(next(iter(dl))) == saved["next"]
    finally:
        pipe.close()


def test_a_cache_written_by_an_earlier_version_is_all_hits_with_the_same_values(
    store: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(golden.CACHE_DIR, cache)
    pipe = golden.cache_pipeline(store, cache, readonly_cache=True)
    group = zarr.open_group(str(store), mode="r")
    full = {name: np.asarray(group[name][...]) for name in ("t2m", "z")}
    stats = {"t2m": (280.0, 20.0), "z": (5.0e4, 3.0e3)}
    try:
        n = 0
        for batch in golden.pipe_epoch(pipe):
            for name, (mean, std) in stats.items():
                want = (full[name][batch.sample_indices[name]] - mean) / std
                np.testing.assert_allclose(batch.arrays[name], want, rtol=1e-5, atol=1e-5)
            n += 1
        counts = pipe.stats()
    finally:
        pipe.close()
    assert n > 0
    assert counts["gets"] == 0 and counts["misses"] == 0
    assert counts["disk_hits"] == counts["hits"] > 0
