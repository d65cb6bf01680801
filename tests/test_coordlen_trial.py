"""Time coordinates that do not fit their data: another length, duplicated, unsorted or
missing times, CF integer times in calendars (the coordlen trial of 2026-12-07).

The stores are written by xarray (``Dataset.to_zarr``; CF times in a calendar) or by hand with
zarr; which anchors an epoch holds, each row's time and value and the statistics are worked
out here with xarray, pandas and numpy, never asked of the package's plan.

Found (fixed; each test failed before the fix):

- **A dimension coordinate of another length than the data was left out of ``batch.coords``
  without a word.** A store read mid-append (the time coordinate resized before or after the
  data) built a pipeline whose batches carried no ``time``; a ``Forcings`` transform then
  failed at the first batch with a ``KeyError`` telling to build with ``coords=None`` — the
  default, as built. Now the build refuses it (``CoordinateLengthError``, a ``ValueError``)
  naming the coordinate, both lengths and the dimension, saying what to do, as the anchor
  checks already did where the times are read.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.forcings import Forcings

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")
pytest.importorskip("cftime")

pytestmark = pytest.mark.timeout(60)

LAT, LON = [10.0, 20.0], [0.0, 1.0, 2.0]


def _write(
    root: Path, times: Any, *, chunk: int = 4, encoding: dict[str, Any] | None = None
) -> Path:
    """``sst (time, lat, lon)`` float32 at ``times`` (each step's values: its index plus
    noise), ``chunk`` steps per stored object; ``encoding`` of the time coordinate."""
    n = len(times)
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((n, 2, 3)) + np.arange(n)[:, None, None]).astype("f4")
    ds = xr.Dataset(
        {"sst": (("time", "lat", "lon"), data)},
        coords={"time": times, "lat": LAT, "lon": LON},
    )
    tenc = {"units": "hours since 2000-01-01", "dtype": "int64"} if encoding is None else encoding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(root, zarr_format=3, consolidated=False,
                   encoding={"sst": {"chunks": (chunk, 2, 3)}, "time": tenc})  # fmt: skip
    return root


def _six_hourly(n: int) -> Any:
    return pd.date_range("2020-01-01", periods=n, freq="6h")


@pytest.fixture(params=[-3, 2], ids=["shorter", "longer"])
def torn(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A store read mid-append: its time coordinate 3 shorter or 2 longer than the data (12)."""
    root = _write(tmp_path / "torn.zarr", _six_hourly(12))
    coord = zarr.open_array(root / "time", mode="a")
    last = int(coord[-1])
    coord.resize((12 + request.param,))
    if request.param > 0:
        coord[12:] = last + 6 * np.arange(1, request.param + 1)
    return root


def test_a_dimension_coordinate_of_another_length_is_refused_for_batch_coords_naming_both(
    torn: Path,
) -> None:
    g = open_geometries(torn)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    length = zarr.open_array(torn / "time").shape[0]
    said = rf"'time' has {length} values but 'sst' has 12 samples along 'time'.*coords=\(\)"
    with pytest.raises(ValueError, match=said) as refused:
        insitu_pipeline(torn, manifest, {"x": g}, batch_size=4)
    assert type(refused.value).__name__ == "CoordinateLengthError"  # (errors.py; a ValueError)
    # a Forcings view needs the times: refused at the build, not at the first batch
    forcings = Forcings("x", names=["year_progress_sin"], lat=LAT, lon=LON)
    with pytest.raises(ValueError, match=said):
        insitu_pipeline(torn, manifest, {"x": g}, batch_size=4, batch_transforms=[forcings])
    # the anchor checks say so too, where the batches carry no coordinate
    with pytest.raises(ValueError, match=r"times of 'sst' cannot be read: coordinate 'time'"):
        insitu_pipeline(torn, manifest, {"x": g, "y": g.shift(1)}, missing=(), coords=())
    # coords=() carries none, as asked: every sample read, by index
    pipe = insitu_pipeline(torn, manifest, {"x": g}, batch_size=4, coords=())
    try:
        rows = [b.coords for b in Loader(pipe)]
        assert len(rows) == 3 and all(c == {} for c in rows)
    finally:
        pipe.close()
