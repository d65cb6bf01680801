"""Trial: ``concat`` and ``join`` read each metadata document of each store once.

Over object storage every metadata read is a round trip, and a concatenation of 80 yearly
stores pays each one 80 times. Before, ``concat`` read its first store's ``sst/zarr.json`` 5
times (on zarr v2 ``.zarray`` and ``.zgroup`` 3 times each) and every other store's twice: the
continuity check, the grid check and the collection itself each opened the arrays on their
own. They now share one coordinate reader (each document once), which the collection keeps
(``coll.reader``) for the pipelines built on it. (tests/helpers.CountingStore counts the
GETs of each key.)
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import counting_store, is_metadata_key, write_era5

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.io.collection import concat, join
from insitubatch_nodes.io.coords import coordinate_reader

xr = pytest.importorskip("xarray")  # (writes the stores, as users' are written)

pytestmark = pytest.mark.timeout(60)

HOURS = np.datetime64("2000-01-01T00", "ns") + np.arange(24) * np.timedelta64(1, "h")


def _write(root: Path, times: np.ndarray, fmt: int) -> Path:
    """``sst (time, lat, lon)`` at ``times``, 4 steps a chunk, written by xarray in ``fmt``."""
    data = np.arange(len(times) * 6, dtype="f4").reshape(-1, 2, 3)
    grid = {"lat": [10.0, 60.0], "lon": [0.0, 90.0, 200.0]}
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), data)}, coords={"time": times, **grid})
    enc = {
        "sst": {"chunks": (4, 2, 3)},
        "time": {"units": "hours since 2000-01-01", "dtype": "int64"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's notes on consolidation and v2)
        ds.to_zarr(root, zarr_format=fmt, consolidated=False, encoding=enc)
    return root


@pytest.fixture(scope="module", params=[3, 2], ids=["v3", "v2"])
def roots(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three stores of 8 hourly steps each, in time order, in zarr format 3 or 2."""
    tmp = tmp_path_factory.mktemp(f"concatreader{request.param}")
    return [_write(tmp / f"s{lo}.zarr", HOURS[lo : lo + 8], request.param) for lo in (0, 8, 16)]


def _twice(stores: list[Any]) -> dict[int, dict[str, int]]:
    """Per store (by position), the metadata documents it was asked for more than once."""
    out = {}
    for k, s in enumerate(stores):
        again = {key: n for key, n in s.counts.items() if is_metadata_key(key) and n > 1}
        if again:
            out[k] = again
    return out


def test_a_concat_reads_each_metadata_document_of_each_store_once(roots: list[Path]) -> None:
    """``concat`` of three stores GETs each of their metadata documents once (``sst``'s, and
    the coordinates' it checks: ``time``, ``lat``, ``lon``), and its rows are the stores'
    (xarray's concatenation the oracle). Before: the first store's ``sst/zarr.json`` 5 times,
    the others' twice (v2: ``.zarray``, ``.zgroup`` 3 times each in the first)."""
    stores = [counting_store(r) for r in roots]
    coll = concat(stores, ["sst"])
    assert _twice(stores) == {}
    doc = "zarr.json" if (roots[0] / "sst" / "zarr.json").exists() else ".zarray"
    assert all(s.counts[f"{a}/{doc}"] == 1 for s in stores for a in ("sst", "time", "lat"))
    oracle = xr.concat([xr.open_zarr(r, consolidated=False) for r in roots], dim="time")
    np.testing.assert_array_equal(coll.lengths, [8, 8, 8])
    from insitubatch_nodes.io import open_coordinates

    time = open_coordinates(coll.store, coll["sst"], reader=coll.reader)["time"].values
    np.testing.assert_array_equal(time, oracle.time.values)
    assert _twice(stores) == {}  # (the times the checks read are the reader's)


def test_a_pipeline_given_the_concats_reader_reads_no_metadata_document_again(
    roots: list[Path],
) -> None:
    """``insitu_pipeline(coll, ..., coords_reader=coll.reader)`` builds on what ``concat``
    read: its store check (``check_collection_in_store``), the rows' times and the time
    checks read no metadata document a second time, and its batches are xarray's rows."""
    stores = [counting_store(r) for r in roots]
    coll = concat(stores, ["sst"])
    v = coll["sst"]
    oracle = xr.concat([xr.open_zarr(r, consolidated=False) for r in roots], dim="time").sst
    with insitu_pipeline(coll, split_by_chunk(v, (1.0, 0.0, 0.0)), {"x": v}, batch_size=6,
                         coords=["time"], stride="2h", shuffle=False, coords_reader=coll.reader,
                         prefetch_depth=1) as pipe:  # fmt: skip
        batches = list(Loader(pipe))
    assert _twice(stores) == {}
    times = np.concatenate([np.asarray(b.coords["x"]["time"]) for b in batches])
    np.testing.assert_array_equal(times, HOURS[::2])
    rows = np.concatenate([np.asarray(b["x"]) for b in batches])
    np.testing.assert_array_equal(rows, oracle.sel(time=times).values)


def test_a_join_reads_each_metadata_document_of_each_store_once(roots: list[Path]) -> None:
    """``join`` of two stores over the same times GETs each metadata document once. Before:
    each store's ``sst`` document twice (the alignment check, then the collection)."""
    a, b = counting_store(roots[0]), counting_store(roots[0])
    coll = join({"a": (a, ["sst"]), "b": (b, ["sst"])})
    assert _twice([a, b]) == {}
    assert coll.lengths.tolist() == [8]


# -- 2. recipes/compose_nodes.py: the graph composed by hand shares one reader ------------------

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "compose_nodes.py"


def _recipe() -> Any:
    spec = importlib.util.spec_from_file_location("compose_nodes_concatreader", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _composed(store: Any, reader: Any = None) -> list[Any]:
    """One epoch of the recipe's graph over ``store`` (views opened through ``reader``)."""
    recipe = _recipe()
    geoms = open_geometries(store, ["t2m", "z"], coords_reader=reader)
    views = {"x": geoms["t2m"], "y": geoms["t2m"].shift(1), "z": geoms["z"]}
    args = recipe.parse_args(["--batch-size", "4", "--block-chunks", "2", "--prefetch-depth", "1"])
    stages = recipe.build_nodes(store, views, args, *([reader] if reader else []))
    try:
        return list(Loader(stages.prefetch))
    finally:
        stages.prefetch.close()


def _time_reads(store: Any) -> dict[str, int]:
    return {k: n for k, n in store.counts.items() if k.startswith("time/")}


def test_the_compose_recipe_reads_the_time_coordinate_once_for_its_three_labels(
    tmp_path: Path,
) -> None:
    """``build_nodes(store, views, args)`` (tests/test_compose.py's call) reads the time
    coordinate the rows carry once for its three labels, and the batches carry it (xarray's
    decoding of ``time`` the oracle). Before: each label's ``open_coordinates`` read it again
    (3 GETs of ``time/zarr.json`` and of each of its objects)."""
    store = counting_store(write_era5(tmp_path / "era5.zarr", n_time=32))
    batches = _composed(store)
    reads = _time_reads(store)
    assert "time/zarr.json" in reads and set(reads.values()) == {1}, reads
    time = xr.open_zarr(tmp_path / "era5.zarr", consolidated=False).time.values
    b = batches[0]
    np.testing.assert_array_equal(b.coords["x"]["time"], time[b.sample_indices["x"]])


def test_the_compose_recipe_given_the_geometries_reader_reads_each_metadata_document_once(
    tmp_path: Path,
) -> None:
    """The recipe's ``run``: one ``coordinate_reader`` opens the geometries and goes to
    ``build_nodes``, whose fetch stage checks the store against what it read and whose rows'
    times are read through it: every metadata document (``t2m``, ``z``, ``time``) and the
    time coordinate's objects are GET once in all. Before: the fetch check read ``t2m`` and
    ``z`` again, and each label the time coordinate."""
    store = counting_store(write_era5(tmp_path / "era5.zarr", n_time=32))
    batches = _composed(store, coordinate_reader(store))
    assert len(batches) > 1
    reads = {k: n for k, n in store.counts.items() if is_metadata_key(k) or k.startswith("time/")}
    assert {"t2m/zarr.json", "z/zarr.json", "time/zarr.json"} <= set(reads)
    assert {k: n for k, n in reads.items() if n > 1} == {}


def test_a_join_of_a_concat_reads_none_of_the_concats_times_again(roots: list[Path]) -> None:
    """A join given a concatenation reads its stores' times through the reader ``concat`` read
    them with (``coll.reader``): no GET of their ``time`` documents or objects again. Before:
    each store's ``time/zarr.json`` and ``time/c/0`` once more. (Neither does the collection
    the join makes read its pieces' ``sst`` documents again: tests/test_joinconcat_trial.py.)"""
    stores = [counting_store(r) for r in roots[:2]]
    archive = concat(stores, ["sst"])
    for s in stores:
        s.reset_counts()
    forced = join({"atmos": (archive, ["sst"]), "forcing": (counting_store(roots[0]), ["sst"])})
    assert forced["atmos/sst"].n_samples == 8
    assert [_time_reads(s) for s in stores] == [{}, {}]
