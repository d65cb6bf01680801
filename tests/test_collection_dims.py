"""``dims=`` on ``Collection.from_arrays``, ``concat`` and ``join``: zarr v2 arrays written
without xarray's ``_ARRAY_DIMENSIONS`` name no dimension, so neither ``sample_axis="time"`` nor
the time coordinate a concatenation or a join is checked by can be found without names given.

Each store is a tiny zarr v2 group of a ``t2m``/``sst`` array ``(time, lat, lon)`` and a CF
``time`` in hours, neither naming its dimensions. Every row a pipeline delivers is checked
against zarr's read of the stores, joined with numpy (the oracle).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, split_by_chunk, split_by_member
from insitubatch_nodes.io.collection import Collection, concat, join
from insitubatch_nodes.io.coords import open_coordinates

HOUR = np.timedelta64(1, "h")
NAMES = ["time", "lat", "lon"]


def _store(root: Path, name: str, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A zarr v2 store of ``name`` ``(n, 4, 6)`` chunked ``(2, 2, 3)`` and ``time`` (``n`` steps
    of 6 h from hour ``start``), neither with ``_ARRAY_DIMENSIONS``; its values and times."""
    group = zarr.open_group(root, mode="w", zarr_format=2)
    values = (1000 * start + np.arange(n * 24, dtype="f4")).reshape(n, 4, 6)
    group.create_array(name, shape=values.shape, chunks=(2, 2, 3), dtype="f4")[:] = values
    hours = start + 6 * np.arange(n)
    time_ = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8", fill_value=-999)
    time_[:] = hours
    time_.attrs["units"] = "hours since 2000-01-01"
    assert "_ARRAY_DIMENSIONS" not in group[name].attrs
    return values, np.datetime64("2000-01-01T00", "ns") + hours * HOUR


def _rows(pipe: Any) -> list[Any]:
    try:
        return list(Loader(pipe))
    finally:
        pipe.close()


def test_from_arrays_dims_name_the_axes_for_sample_axis_isel_and_patches(tmp_path: Path) -> None:
    data = [_store(tmp_path / f"s{k}.zarr", "t2m", 6 + 48 * k, 4 + 2 * k)[0] for k in range(2)]
    arrays = [(tmp_path / f"s{k}.zarr", "t2m") for k in range(2)]
    with pytest.raises(KeyError, match=r"no dimension named 'time'.*give the axes' names: dims="):
        Collection.from_arrays(arrays, sample_axis="time")
    coll = Collection.from_arrays(arrays, sample_axis="time", dims=NAMES)
    assert coll.dims == {"data": tuple(NAMES)} and coll["data"].dims == tuple(NAMES)
    by_mapping = Collection.from_arrays(arrays, sample_axis="t", dims={"data": ["t", "y", "x"]})
    assert by_mapping["data"].dims == ("t", "y", "x")
    with pytest.raises(ValueError, match=r"dims\['data'\] must be one unique name"):
        Collection.from_arrays(arrays, dims="tyx")
    view = coll["data"].isel(lon=[0, 2, 5]).patches({"lat": 2})
    seen = []
    for batch in _rows(insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"v": view})):
        for r in range(len(batch)):
            m, t = int(batch.members["v"][r]), int(batch.sample_indices["v"][r])
            y0 = int(batch.patch_origins["v"][r][0])
            np.testing.assert_array_equal(batch["v"][r], data[m][t, y0 : y0 + 2][:, [0, 2, 5]])
            seen.append((m, t, y0))
    assert sorted(seen) == [
        (m, t, y) for m in range(2) for t in range(len(data[m])) for y in (0, 2)
    ]


def test_concat_with_dims_joins_v2_stores_without_dimension_names_by_their_times(
    tmp_path: Path,
) -> None:
    reads = [_store(tmp_path / f"p{k}.zarr", "t2m", 6 + 24 * k, 4) for k in range(2)]
    data = np.concatenate([d for d, _ in reads])
    times = np.concatenate([t for _, t in reads])
    coll = concat([tmp_path / f"p{k}.zarr" for k in range(2)], ["t2m"], dims={"t2m": NAMES})
    assert coll["t2m"].dims == tuple(NAMES) and coll["t2m"].n_samples == 8
    np.testing.assert_array_equal(open_coordinates(coll, coll["t2m"])["time"].values, times)
    window = coll["t2m"].window(["-6h", "0h"])  # time deltas: across the stores' edge too
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    batches = _rows(insitu_pipeline(coll, manifest, {"w": window}, coords=["time"]))
    idx = np.concatenate([b.sample_indices["w"] for b in batches])
    np.testing.assert_array_equal(np.concatenate([np.asarray(b["w"]) for b in batches]), data[idx])
    np.testing.assert_array_equal(
        np.concatenate([b.coords["w"]["time"] for b in batches]), times[idx]
    )
    assert sorted(idx[:, 1].tolist()) == list(range(1, 8))


def test_join_with_dims_aligns_v2_stores_without_dimension_names_by_their_times(
    tmp_path: Path,
) -> None:
    t2m, times = _store(tmp_path / "atmos.zarr", "t2m", 6, 6)
    sst, _ = _store(tmp_path / "forcing.zarr", "sst", -6, 10)  # its index 2 is hour 6
    stores = {
        "atmos": (tmp_path / "atmos.zarr", ["t2m"]),
        "forcing": (tmp_path / "forcing.zarr", ["sst"]),
    }
    joined = join(stores, dims={"atmos/t2m": NAMES, "forcing/sst": NAMES})
    assert joined.dims == {"atmos/t2m": tuple(NAMES), "forcing/sst": tuple(NAMES)}
    assert joined["forcing/sst"].n_samples == 6
    views = {"x": joined["atmos/t2m"], "f": joined["forcing/sst"].isel(lat=[1])}
    manifest = split_by_chunk(joined["atmos/t2m"], (1.0, 0.0, 0.0))
    batches = _rows(insitu_pipeline(joined, manifest, views, coords=["time"]))
    idx = np.concatenate([b.sample_indices["x"] for b in batches])
    assert sorted(idx.tolist()) == list(range(6))
    for b in batches:
        i = b.sample_indices["x"]
        np.testing.assert_array_equal(np.asarray(b["x"]), t2m[i])
        np.testing.assert_array_equal(np.asarray(b["f"]), sst[i + 2][:, [1]])
        np.testing.assert_array_equal(b.coords["f"]["time"], times[i])
    # a concatenation made with dims keeps them as a store of a join
    _store(tmp_path / "more.zarr", "t2m", 42, 2)
    archive = concat(
        [tmp_path / "atmos.zarr", tmp_path / "more.zarr"], ["t2m"], dims={"t2m": NAMES}
    )
    both = join(
        {"atmos": (archive, ["t2m"]), "forcing": stores["forcing"]}, dims={"forcing/sst": NAMES}
    )
    assert both["atmos/t2m"].dims == tuple(NAMES) and both["atmos/t2m"].n_samples == 8


def test_concat_and_join_of_arrays_that_name_no_dimensions_say_to_give_dims(tmp_path: Path) -> None:
    for k in range(2):
        _store(tmp_path / f"p{k}.zarr", "t2m", 6 + 24 * k, 4)
    a, b = str(tmp_path / "p0.zarr"), str(tmp_path / "p1.zarr")
    fix = r"names no dimensions .*dims=\{{'{}': \[.*_ARRAY_DIMENSIONS"
    with pytest.raises(ValueError, match=fix.format("t2m")):
        concat([a, b], ["t2m"])
    with pytest.raises(ValueError, match=fix.format("x/t2m")):
        join({"x": (a, ["t2m"]), "y": (b, ["t2m"])})
    with pytest.raises(
        ValueError, match=r"dims names 2 axes \['time', 'lat'\], but the array has 3"
    ):
        concat([a, b], ["t2m"], dims={"t2m": ["time", "lat"]})
    with pytest.raises(ValueError, match=r"dims names 'x/sst', which is not a variable"):
        join({"x": (a, ["t2m"]), "y": (b, ["t2m"])}, dims={"x/sst": NAMES})
