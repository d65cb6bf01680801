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

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import counting_store, is_metadata_key

from insitubatch_nodes.io.collection import concat, join

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


def test_a_join_reads_each_metadata_document_of_each_store_once(roots: list[Path]) -> None:
    """``join`` of two stores over the same times GETs each metadata document once. Before:
    each store's ``sst`` document twice (the alignment check, then the collection)."""
    a, b = counting_store(roots[0]), counting_store(roots[0])
    coll = join({"a": (a, ["sst"]), "b": (b, ["sst"])})
    assert _twice([a, b]) == {}
    assert coll.lengths.tolist() == [8]
