"""Saved statistics loaded back and applied, as a forecaster keeps them between runs: pooled
fits (``pool="level"``) on a latitude/longitude grid and on a grid of points, their JSON round
trip and their ``dataset`` record, ``stack(..., normalize=)``, ``stats.normalizer`` and
``stats.scaler()`` against numpy in float64 on the same values; the load check against level
selections, boxes, windows, splits, manifests, stores (paths and opened ones), strides,
collections and stacks; another store of the variable whose levels lie otherwise; a
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
* Statistics fitted through an opened zarr ``LocalStore`` (or a ``WrapperStore`` around one)
  were refused by ``Statistics.load(path, dataset={"store": root})`` of the same folder, and
  statistics fitted on ``root`` refused against the opened store: the file held the store's
  repr, ``LocalStore('file:///...')``, compared as text with the path.
* Channels were told by index only: statistics of ``z.sel(level=[850])`` standardised level 500
  of another store of ``z`` whose levels are 850, 500, 300 (index 1 there, as 850 was here), by
  ``stack(..., normalize=)`` and ``stats.normalizer`` alike, and refused its level 850 (index
  0). A fit now records its channels' coordinate values, and they are compared where both sides
  read them (files without them by index, as before).

Tried and found right (kept as claims): pooled statistics keep their shape and ``pool`` record
through ``save``/``load`` and standardise every level of a stack member and of a batch label
with the one pooled value (numpy over the same values, within float32 rounding), a reordered
level selection included; ``scaler()`` refuses pooled statistics, naming the batch transforms
that take them; the load check refuses another level, box, split, manifest, store or stride and
accepts another window of the fitted view and the whole ``dataset`` of the same fit; a
``concat`` collection's statistics with NaNs, ``stride=2`` and ``"12h"`` and ``missing=`` dates
equal numpy's in float64 (1e-6 relative), with exact ``count`` and ``nan_count`` and
``diff_std`` over pairs one stride apart only (also tried, not kept: a ``from_arrays``
collection with NaN fill values and NaNs, its members' padding never counted); a fit through a
persistent cache reads every chunk once cold and none warm (read-only too), with numbers
bit-for-bit those of the cold fit, and one over a cache that a pipeline with
``chunk_transforms=[stats.scaler()]`` filled is refused (``StaleCacheError``), not fitted on
standardised values; ``stack(..., normalize=)`` refuses statistics of other levels or another
order, and takes pooled ones for any selection of the pooled dimension (by design: one value
for all, as for the members of an ensemble).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from helpers import counting_store

from insitubatch_nodes import concat, insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.errors import StaleCacheError
from insitubatch_nodes.statistics import FIELDS, Statistics, fit_statistics

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


def test_pooled_statistics_load_back_and_standardise_every_level_with_numpys_one_value(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, ds = era
    g = open_geometries(root)
    views = {"z": g["z"], "zr": g["z"].sel(level=[500, 1000]), "p": g["p"], "lsm": g["lsm"]}
    fitted = fit_statistics(root, _train(g), views, pool="level")
    fitted.save(tmp_path / "pooled.json")
    stats = Statistics.load(tmp_path / "pooled.json", dataset=fitted.dataset)
    assert stats.dataset["pool"] == {"z": ["level"], "zr": ["level"], "p": ["level"]}
    assert {k: v.shape for k, v in stats.mean.items()} == dict.fromkeys(views, ())
    train = {"z": ds.z.values[:12], "zr": ds.z.values[:12, [2, 0]], "p": ds.p.values[:12]}
    for label, data in train.items():  # one value over every level, as numpy's in float64
        np.testing.assert_allclose(stats.mean[label], data.astype("f8").mean(), rtol=1e-12)
        np.testing.assert_allclose(stats.std[label], data.astype("f8").std(), rtol=1e-9)
        assert stats.count[label] == data.size and stats.min[label] == data.min()
    with pytest.raises(ValueError, match=r"pooled over \['level'\].*normalizer"):
        stats.scaler(["z"])
    # a stack member and a batch label: every level with the one pooled value
    xz = stack({"zr": views["zr"], "lsm": g["lsm"]}, normalize=stats)
    xp = stack({"p": g["p"]}, normalize=stats)
    labels = {"xz": xz, "xp": xp, "z": g["z"]}
    norm = stats.normalizer({"z": g["z"]})
    with insitu_pipeline(root, _train(g), labels, batch_size=4, batch_transforms=[norm]) as pipe:
        batch = next(iter(pipe))
    idx = batch.sample_indices["z"]
    got = {"zr": batch["xz"][:, :2], "p": batch["xp"], "z": batch["z"]}
    for label, data in (("zr", ds.z.values[:, [2, 0]]), ("p", ds.p.values), ("z", ds.z.values)):
        f8 = train[label].astype("f8")
        want = (data[idx] - f8.mean()) / f8.std()
        np.testing.assert_allclose(got[label], want, rtol=0, atol=1e-6)
    lsm = ds.lsm.values.astype("f8")
    want = (ds.lsm.values - lsm.mean()) / lsm.std()
    np.testing.assert_allclose(batch["xz"][:, 2], np.broadcast_to(want, (4, Y, X)), atol=1e-6)


def test_load_refuses_statistics_of_another_level_box_split_manifest_store_or_stride(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, ds = era
    g = open_geometries(root)
    views = {"z": g["z"].sel(level=[850]), "box": g["z"].sel(lat=slice(0, 1)), "lsm": g["lsm"]}
    fitted = fit_statistics(root, _train(g), views)
    fitted.save(tmp_path / "stats.json")
    other = tmp_path / "other.zarr"
    ds.to_zarr(other, zarr_format=3, consolidated=False)
    refused = {
        "views": {"z": g["z"].sel(level=[500])},
        "views ": {"box": g["z"].sel(lat=slice(1, 2))},
        "views  ": {"lsm": g["lsm"].sel(lat=slice(0, 1))},
        "split": "validation",
        "manifest": split_by_chunk(g["z"], (0.5, 0.5, 0.0)),
        "store": other,
        "stride": 2,
    }
    for key, value in refused.items():
        with pytest.raises(ValueError, match=f"fitted on another dataset: {key.strip()} "):
            Statistics.load(tmp_path / "stats.json", dataset={key.strip(): value})
    # the same data: another window or shift of the fitted views, the fit's own record
    same = {"z": views["z"].window([-2, -1, 0]), "box": views["box"].shift(1), "lsm": g["lsm"]}
    Statistics.load(tmp_path / "stats.json", dataset={"store": root, "manifest": _train(g),
                                                      "views": same, "split": "train"})  # fmt: skip
    Statistics.load(tmp_path / "stats.json", dataset=fitted.dataset)


@pytest.fixture(scope="module")
def years(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], np.ndarray]:
    """Two stores of 12 6-hourly steps each, one continuing the other: ``z (time, level, lat,
    lon)`` float32, level 500 5000 above level 850 with 30 times its spread; NaNs in a row of
    one step, all of another step's level 500, one point of a third."""
    rng = np.random.default_rng(1)
    data = rng.normal(size=(24, 2, Y, X)) * [[[[1.0]], [[30.0]]]] + [[[[0.0]], [[5000.0]]]]
    data = data.astype("f4")
    data[3, 0, 1, :] = np.nan
    data[9, 1] = np.nan
    data[14, 0, 0, 0] = np.nan
    times = pd.date_range("2020-01-01", periods=24, freq="6h")
    roots = []
    for i in range(2):
        part = slice(12 * i, 12 * i + 12)
        ds = xr.Dataset({"z": (("time", "level", "lat", "lon"), data[part])},
                        coords={"time": times[part], "level": [850, 500]})  # fmt: skip
        roots.append(tmp_path_factory.mktemp("years") / f"y{i}.zarr")
        ds.to_zarr(roots[-1], encoding={"z": {"chunks": (4, 2, Y, X)}}, zarr_format=3,
                   consolidated=False)  # fmt: skip
    return roots, data


@pytest.mark.parametrize(("stride", "k"), [(2, 2), ("12h", 2)])
def test_statistics_of_a_concat_with_nans_a_stride_and_missing_steps_equal_numpys(
    years: tuple[list[Path], np.ndarray], stride: Any, k: int
) -> None:
    roots, data = years
    coll = concat(roots, ["z"])
    manifest = split_by_chunk(coll["z"], (0.75, 0.25, 0.0))  # samples 0..19
    times = pd.date_range("2020-01-01", periods=24, freq="6h")
    missing = [times[6], times[16]]
    stats = fit_statistics(coll, manifest, {"z": coll["z"]}, stride=stride, missing=missing)
    anchors = [a for a in manifest.samples("train") if a % k == 0 and times[a] not in missing]
    x = data[anchors].astype("f8")
    # differences between anchors one stride apart, across the stores' edge, none across 6, 16
    pairs = [a for a in anchors if a + k in anchors]
    d = (data[[a + k for a in pairs]] - data[pairs]).astype("f8")
    axes = (0, 2, 3)
    np.testing.assert_allclose(stats.mean["z"], np.nanmean(x, axis=axes), rtol=1e-6)
    np.testing.assert_allclose(stats.std["z"], np.nanstd(x, axis=axes), rtol=1e-6)
    np.testing.assert_allclose(stats.diff_std["z"], np.nanstd(d, axis=axes), rtol=1e-6)
    np.testing.assert_array_equal(stats.count["z"], np.isfinite(x).sum(axis=axes))
    np.testing.assert_array_equal(stats.nan_count["z"], np.isnan(x).sum(axis=axes))
    np.testing.assert_array_equal(stats.min["z"], np.nanmin(x, axis=axes))
    assert stats.dataset["stride"] in (2, "12 hours") and len(pairs) == 5


def test_a_fit_through_a_warm_persistent_cache_reads_no_chunk_and_gives_the_cold_numbers(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, _ = era
    g = open_geometries(root)
    views = {"z": g["z"].sel(level=[850, 500]), "p": g["p"], "lsm": g["lsm"]}
    runs, gets = [], []
    for options in ({"persist": True}, {"persist": True}, {"readonly_cache": True}):
        store = counting_store(root)
        runs.append(fit_statistics(store, _train(g), views, cache_dir=tmp_path / "c", **options))
        gets.append({k for k in store.chunk_counts() if not k.startswith("time/")})
    # cold: each of the 3 train chunks of z and p once, and the static field; warm: none
    assert len(gets[0]) == 7 and gets[1:] == [set(), set()]
    for stats in runs[1:]:
        for name in FIELDS:
            for label in views:
                got, want = getattr(stats, name)[label], getattr(runs[0], name)[label]
                np.testing.assert_array_equal(got, want)
        assert stats.dataset == runs[0].dataset


def test_a_fit_over_a_cache_a_scaled_pipeline_filled_is_refused_not_fitted_on_scaled_values(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, _ = era
    g = open_geometries(root)
    views = {"z": g["z"]}
    stats = fit_statistics(root, _train(g), views)
    with insitu_pipeline(root, _train(g), views, batch_size=4, cache_dir=tmp_path / "c",
                         persist=True, chunk_transforms=[stats.scaler()]) as pipe:  # fmt: skip
        for _ in pipe:
            pass
    # the cached chunks are standardised ones: their statistics would be about 0 and 1
    with pytest.raises(StaleCacheError, match="chunk transforms"):
        fit_statistics(root, _train(g), views, cache_dir=tmp_path / "c", persist=True)


def test_a_stack_normalised_with_statistics_of_other_levels_is_refused_naming_them(
    era: tuple[Path, xr.Dataset],
) -> None:
    root, _ = era
    g = open_geometries(root)
    stats = fit_statistics(root, _train(g), {"z": g["z"].sel(level=[850, 500])})
    for other in (g["z"].sel(level=[500, 850]), g["z"].sel(level=[1000, 500]), g["z"]):
        with pytest.raises(ValueError, match="fitted on other channels"):
            stack({"z": other}, normalize=stats)
    pooled = fit_statistics(root, _train(g), {"z": g["z"].sel(level=[850, 500])}, pool="level")
    stack({"z": g["z"].sel(level=[1000])}, normalize=pooled)  # one value for every level


def test_statistics_fitted_through_an_opened_local_store_load_against_its_path_and_back(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, _ = era
    g = open_geometries(root)
    opened = zarr.storage.LocalStore(root, read_only=True)
    for fitted_on, given in ((opened, root), (root, opened), (counting_store(root), str(root))):
        fit_statistics(fitted_on, _train(g), {"z": g["z"]}).save(tmp_path / "stats.json")
        Statistics.load(tmp_path / "stats.json", dataset={"store": given})
    with pytest.raises(ValueError, match="fitted on another dataset: store"):
        Statistics.load(tmp_path / "stats.json", dataset={"store": tmp_path})


def test_statistics_of_a_level_standardise_that_level_of_another_store_not_its_index(
    era: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    """Another archive of the same variable whose levels are 850, 500, 300 (as floats): its
    index 1 is level 500, and level 850 is its index 0."""
    root, ds = era
    g = open_geometries(root)
    other = tmp_path / "other.zarr"
    ds.assign_coords(level=[850.0, 500.0, 300.0]).to_zarr(other, zarr_format=3, consolidated=False)
    go = open_geometries(other)
    stats = fit_statistics(root, _train(g), {"z": g["z"].sel(level=[850])})
    with pytest.raises(ValueError, match=r"fitted on other channels.*level \['850'\]"):
        stack({"z": go["z"].sel(level=[500])}, normalize=stats)  # index 1, as 850 was
    with pytest.raises(ValueError, match="fitted on other channels"):
        stats.normalizer({"z": go["z"].sel(level=[500])})
    x = stack({"z": go["z"].sel(level=[850])}, normalize=stats)  # index 0: the fitted level
    with insitu_pipeline(other, _train(go), {"x": x}, batch_size=4) as pipe:
        batch = next(iter(pipe))
    want = (ds.z.values[batch.sample_indices["x"], 0] - stats.mean["z"][0]) / stats.std["z"][0]
    np.testing.assert_allclose(batch["x"][:, 0], want, rtol=1e-5, atol=1e-5)
    # the load check compares the levels too; files without them by their indices, as before
    stats.save(tmp_path / "stats.json")
    with pytest.raises(ValueError, match="fitted on another dataset: views"):
        Statistics.load(tmp_path / "stats.json", dataset={"views": {"z": go["z"].sel(level=[500])}})
    older = dict(stats.dataset, views={"z": {k: v for k, v in stats.dataset["views"]["z"].items()
                                             if k != "labels"}})  # fmt: skip
    Statistics(**{f: getattr(stats, f) for f in FIELDS}, dataset=older,
               paths=stats.paths).save(tmp_path / "older.json")  # fmt: skip
    Statistics.load(tmp_path / "older.json", dataset={"views": {"z": g["z"].sel(level=[850])}})
    stack({"z": go["z"].sel(level=[500])}, normalize=Statistics.load(tmp_path / "older.json"))
