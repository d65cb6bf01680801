"""The golden files under ``tests/data/``: states and a cache written by an earlier version.

``python tests/golden.py`` rewrites them (only when their format is meant to change: the tests in
``tests/test_golden.py`` hold that a state saved and a cache written by an earlier version of the
package still resume to the same batches and still hit). Everything here is deterministic: the
store is the synthetic ERA5-like one of :mod:`tests.resume_helpers`, written afresh by each test.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import resume_helpers as rh  # noqa: E402

DATA = HERE / "data"
LOADER_STATE = DATA / "golden_loader_state.json"
DATASET_STATE = DATA / "golden_dataset_state.json"
CACHE_DIR = DATA / "golden_cache"
TAKEN_AFTER = 3  # batches delivered before the state was taken (mid-epoch 1, carried chunks)


def golden_config(store: Path) -> dict[str, Any]:
    """The pipeline the golden states were taken from (a window x/y pair, block shuffle)."""
    return rh.pipe_config(store)


def loader_state(store: Path) -> dict[str, Any]:
    """A ``Loader`` state after one epoch and ``TAKEN_AFTER`` batches, and the batch after it."""
    from torchdata.nodes import Loader

    pipe = rh.build_pipeline(golden_config(store))
    try:
        loader = Loader(pipe)
        list(loader)
        it = iter(loader)
        for _ in range(TAKEN_AFTER):
            next(it)
        state = loader.state_dict()
        after = rh.record(next(it))
    finally:
        pipe.close()
    return {"state": state, "next": after}


def dataset_state(store: Path) -> dict[str, Any]:
    """A ``StatefulDataLoader`` state over ``as_dataset`` and the item that follows it."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes import as_dataset

    pipe = rh.build_pipeline(golden_config(store))
    try:
        dl = StatefulDataLoader(
            as_dataset(pipe, transform=rh.indexed_transform), batch_size=None, num_workers=0
        )
        it = iter(dl)
        for _ in range(TAKEN_AFTER):
            next(it)
        state = dl.state_dict()
        after = rh.record_item(next(it))
    finally:
        pipe.close()
    return {"state": state, "next": after}


def cache_pipeline(store: Path, cache_dir: Path, **kw: Any) -> Any:
    """The persistent-cache pipeline the golden cache was written by (one transform keyed)."""
    from insitubatch_nodes import (
        StandardScaler,
        insitu_pipeline,
        open_geometries,
        split_by_chunk,
    )

    store_obj = rh.as_store(str(store))
    geoms = open_geometries(store_obj, ["t2m", "z"])
    manifest = split_by_chunk(geoms["t2m"], (0.75, 0.125, 0.125))
    scaler = StandardScaler(
        {"t2m": 280.0, "z": 5.0e4}, {"t2m": 20.0, "z": 3.0e3}, cache_key="golden-1"
    )
    return insitu_pipeline(
        store_obj,
        manifest,
        geoms,
        batch_size=16,
        cache_dir=cache_dir,
        persist=True,
        check_store=False,
        chunk_transforms=[scaler],
        **kw,
    )


def write_all() -> None:
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = rh.write_store(Path(tmp) / "era5.zarr")
        LOADER_STATE.write_text(json.dumps(loader_state(store), indent=1, sort_keys=True) + "\n")
        DATASET_STATE.write_text(json.dumps(dataset_state(store), indent=1, sort_keys=True) + "\n")
        shutil.rmtree(CACHE_DIR, ignore_errors=True)
        pipe = cache_pipeline(store, CACHE_DIR)
        try:
            for _ in pipe_epoch(pipe):
                pass
        finally:
            pipe.close()
        (CACHE_DIR / ".insitu.lock").unlink(missing_ok=True)  # a run's, not the cache's
        shutil.rmtree(CACHE_DIR / ".claims", ignore_errors=True)


def pipe_epoch(pipe: Any) -> Any:
    from torchdata.nodes import Loader

    return iter(Loader(pipe))


if __name__ == "__main__":
    write_all()
