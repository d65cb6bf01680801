"""A trial of the work the Lightning data module repeats per build (anemoi2, 2026-12-07): the
GETs of one ``fit``, counted by a store wrapper; xarray's decoding of the ``time`` array the
oracle of the times the batches carry.

Found (fixed):

* one ``fit`` read the time coordinate three times (its ``zarr.json`` and its chunk): at
  ``setup`` (the time-ordered split), and again in each of the training and validation
  pipelines' builds (the times the rows carry). The data module now keeps one coordinate
  reader per store (``InSituDataModule.coords_reader``) and passes it to the split and to every
  build (``insitu_pipeline(..., coords_reader=)``): read once per store per process.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import counting_store, is_metadata_key, open_with_xarray, write_era5

from insitubatch_nodes import PlanConfig
from insitubatch_nodes.batch import Batch

# Lightning is imported by the test, not at collection (tests/lightning_parts.py says why).
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("lightning")]


def _item(batch: Batch) -> dict[str, Any]:
    times = batch.coords["t2m"]["time"].astype("datetime64[s]").astype(np.int64)
    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch.arrays["t2m"])),
        "rows": torch.from_numpy(np.asarray(batch.sample_indices["t2m"])),
        "times": torch.from_numpy(times),
    }


def test_a_fit_reads_the_time_coordinate_and_each_metadata_document_once(
    tmp_path: Path,
) -> None:
    """``(0.75, 0.25, 0)`` of 32 times in chunks of 8: one epoch of 3 training batches, then
    validation's 8 samples, each batch's times xarray's at its rows. Before: the time
    coordinate's ``zarr.json`` and ``c/0`` were read 3 times each (split, train, val); and
    (metadata2) ``t2m/zarr.json`` 4 times (the geometries' open twice, each build's store
    check), the root's ``zarr.json`` and ``.zgroup`` twice each."""
    import lightning as L
    from lightning_parts import trainer

    from insitubatch_nodes.lightning import InSituDataModule

    root = write_era5(tmp_path / "era5.zarr", n_time=32, variables=("t2m",))
    times = open_with_xarray(root)["time"].values.astype("datetime64[s]").astype(np.int64)
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    class Model(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append((batch["rows"].numpy(), batch["times"].numpy()))
            return (self.w * batch["x"].float().mean()).sum()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append((batch["rows"].numpy(), batch["times"].numpy()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    store = counting_store(root)
    dm = InSituDataModule(store, ["t2m"], (0.75, 0.25, 0.0), transform=_item,
                          config=PlanConfig(batch_size=8), log_report=False)  # fmt: skip
    store.reset_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Lightning's: few workers, a small epoch)
        trainer(tmp_path, max_epochs=1, limit_val_batches=None, num_sanity_val_steps=0).fit(
            Model(), datamodule=dm
        )
    assert {k: n for k, n in store.counts.items() if k.startswith("time/")} == {
        "time/zarr.json": 1,
        "time/c/0": 1,
    }
    twice = {k: n for k, n in store.counts.items() if is_metadata_key(k) and n > 1}
    assert twice == {} and store.counts["t2m/zarr.json"] == store.counts["zarr.json"] == 1
    assert sorted(np.concatenate([rows for rows, _ in seen]).tolist()) == list(range(32))
    for rows, got in seen:
        np.testing.assert_array_equal(got, times[rows])


def test_a_coordinate_reader_of_another_store_is_refused_by_the_builder(tmp_path: Path) -> None:
    """``coords_reader`` shares what it read: of another store, its times would be carried by
    rows of this one (two stores of the same layout, other times)."""
    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
    from insitubatch_nodes.io.coords import coordinate_reader

    a, b = (counting_store(write_era5(tmp_path / f"{n}.zarr", n_time=16, variables=("t2m",)))
            for n in "ab")  # fmt: skip
    g = open_geometries(b)["t2m"]
    with pytest.raises(ValueError, match=r"coords_reader reads store .*a\.zarr.*not the one"):
        insitu_pipeline(b, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g},
                        coords_reader=coordinate_reader(a))  # fmt: skip
