"""Saved statistics loaded back and applied, as a forecaster keeps them between runs: pooled
fits (``pool="level"``) on a latitude/longitude grid and on a grid of points, their JSON round
trip and their ``dataset`` record, ``stack(..., normalize=)``, ``stats.normalizer`` and
``stats.scaler()`` against numpy in float64 on the same values; the load check against level
selections, boxes, windows, splits, manifests, stores, strides, collections and stacks; a
``concat`` collection with NaNs, an int and a time stride and missing steps; a fit through a
warm persistent cache (the statistics trial of 2026-12-07).

Found (now fixed):

* ``stats.scaler()`` of a level selection on a grid of points (``p (time, level, values)``,
  ``p.sel(level=[850])``) was accepted, and the chunk transform standardised every level of the
  array with level 850's statistics (level 1000 came out at a mean of -5.6, level 500 at 52):
  its check for a selection took the last two field axes for the grid, where a grid of points
  has one.
* ``Statistics.load(path, dataset=other.dataset)`` refused per-level statistics against a pooled
  fit's ``dataset`` but accepted pooled ones against a per-level fit's: an unpooled fit recorded
  no ``pool``, so nothing was compared. A model trained on per-level statistics was handed
  statistics of one value per variable without a word.
* ``Statistics.load(path, dataset={"views": pipeline_views})`` with a stack among the views (the
  pipeline's own views, ``{"x": stack(...)}``) failed with ``TypeError: Stack ... cannot be
  compared with a saved dataset``; a stack is now checked member by member, as it is fitted.

Tried and found right (kept as claims): pooled statistics keep their shape and ``pool`` record
through ``save``/``load`` and standardise every level of a stack member and of a batch label
with the one pooled value (numpy over the same values, within float32 rounding), a reordered
level selection included; ``scaler()`` refuses pooled statistics, naming the batch transforms
that take them; the load check refuses another level, box, split, manifest, store or stride and
accepts another window of the fitted view and the whole ``dataset`` of the same fit; a
``concat`` collection's statistics with NaNs, ``stride=2`` and ``"12h"`` and ``missing=`` dates
equal numpy's in float64 (1e-6 relative), with exact ``count`` and ``nan_count`` and
``diff_std`` over pairs one stride apart only; a fit through a persistent cache reads every chunk
once cold and none warm (read-only too), with numbers bit-for-bit those of the cold fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.statistics import Statistics, fit_statistics

pytestmark = pytest.mark.timeout(60)

T, L, Y, X, N = 16, 3, 3, 4, 5
TIMES = pd.date_range("2020-01-01", periods=T, freq="6h")
SCALE = np.array([1.0, 10.0, 100.0])  # the levels' spread and offset differ by far
OFFSET = np.array([0.0, 50.0, 500.0])


@pytest.fixture(scope="module")
def era(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    """``z (time, level, lat, lon)`` and ``p (time, level, values)`` (a grid of points beside
    1-D latitude and longitude), float32, 6-hourly, levels 1000, 850 and 500 far apart; ``lsm
    (lat, lon)`` static; chunks of 4 steps."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(T, L, Y, X)) * SCALE[:, None, None] + OFFSET[:, None, None]
    p = rng.normal(size=(T, L, N)) * SCALE[:, None] + OFFSET[:, None]
    ds = xr.Dataset(
        {"z": (("time", "level", "lat", "lon"), z.astype("f4")),
         "p": (("time", "level", "values"), p.astype("f4")),
         "lsm": (("lat", "lon"), rng.random((Y, X)).astype("f4")),
         "latitude": (("values",), np.linspace(-60, 60, N)),
         "longitude": (("values",), np.linspace(0, 300, N))},
        coords={"time": TIMES, "level": [1000, 850, 500], "lat": np.arange(Y) * 1.0,
                "lon": np.arange(X) * 1.0},
    )  # fmt: skip
    root = tmp_path_factory.mktemp("statsload") / "era.zarr"
    chunks = {k: {"chunks": (4, *ds[k].shape[1:])} for k in ("z", "p")}
    ds.to_zarr(root, encoding=chunks, zarr_format=3, consolidated=False)
    return root, ds


def _train(g: dict[str, Any]) -> Any:
    return split_by_chunk(g["z"], (0.75, 0.25, 0.0))  # samples 0..11 train


def test_a_scaler_of_a_level_selection_on_a_grid_of_points_is_refused_not_applied_to_every_level(
    era: tuple[Path, xr.Dataset],
) -> None:
    root, ds = era
    g = open_geometries(root)
    assert g["p"].points == ("latitude", "longitude")
    one = fit_statistics(root, _train(g), {"p": g["p"].sel(level=[850])})
    # the chunk scaler runs on every level of the array: level 850's statistics are not theirs
    with pytest.raises(ValueError, match="reads a selection of 'p'"):
        one.scaler()
    # the whole field of points: one value per level, each level standardised by its own
    whole = fit_statistics(root, _train(g), {"p": g["p"]})
    with insitu_pipeline(root, _train(g), {"p": g["p"]}, batch_size=4,
                         chunk_transforms=[whole.scaler()]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
    train = ds.p.values[:12].astype("f8")
    mean, std = train.mean(axis=(0, 2)), train.std(axis=(0, 2))
    want = (ds.p.values[batch.sample_indices["p"]] - mean[:, None]) / std[:, None]
    np.testing.assert_allclose(batch["p"], want, rtol=1e-5, atol=1e-5)


def test_a_pooled_fit_is_refused_against_a_per_level_fits_dataset_as_the_other_way_round(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, _ = era
    g = open_geometries(root)
    views = {"z": g["z"]}
    per_level = fit_statistics(root, _train(g), views)
    pooled = fit_statistics(root, _train(g), views, pool="level")
    per_level.save(tmp_path / "per_level.json")
    pooled.save(tmp_path / "pooled.json")
    with pytest.raises(ValueError, match="pool"):
        Statistics.load(tmp_path / "per_level.json", dataset=pooled.dataset)
    with pytest.raises(ValueError, match=r"pool \{'z': \['level'\]\} in the file, \{\} expected"):
        Statistics.load(tmp_path / "pooled.json", dataset=per_level.dataset)
    # each against its own fit's, and a partial dataset that says nothing of pooling
    assert Statistics.load(tmp_path / "pooled.json", dataset=pooled.dataset).pooled("z") == (
        "level",
    )
    Statistics.load(tmp_path / "per_level.json", dataset=per_level.dataset)
    Statistics.load(tmp_path / "pooled.json", dataset={"views": views, "split": "train"})


def test_a_stack_among_the_views_given_to_load_is_checked_member_by_member(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, _ = era
    g = open_geometries(root)
    members = {"z": g["z"].sel(level=[850, 500]), "lsm": g["lsm"]}
    fit_statistics(root, _train(g), members).save(tmp_path / "stats.json")
    # the pipeline's views, a stack among them, as they are given to insitu_pipeline
    x = stack({k: v.window([-1, 0]) if k == "z" else v for k, v in members.items()})
    stats = Statistics.load(tmp_path / "stats.json", dataset={"views": {"x": x}})
    assert stats.mean["z"].shape == (2,)
    other = stack({"z": g["z"].sel(level=[500, 850]), "lsm": g["lsm"]})
    with pytest.raises(
        ValueError, match=r"fitted on another dataset: views .*'select': \[\[1, 2\]"
    ):
        Statistics.load(tmp_path / "stats.json", dataset={"views": {"x": other}})
