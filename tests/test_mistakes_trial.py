"""Common mistakes and unusual-but-valid inputs, found wrong by a black-box trial.

Each mistake must be refused where it is made, with a message that says what to do, and
nothing wrong may be accepted silently. The stores are written by xarray (v2 and v3), which is
also the oracle for the values a pipeline delivers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from insitubatch_nodes import (
    Loader,
    as_dataset,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")
torch_data = pytest.importorskip("torch.utils.data")


# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("mistakes_trial")


@pytest.fixture(scope="module", params=[2, 3])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t2m (time, lat, lon)`` 16 steps in chunks of 4, written by xarray (zarr v2 and v3)."""
    rng = np.random.default_rng(0)
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), rng.standard_normal((16, 4, 6)).astype("float32"))},
        coords={"time": pd.date_range("2000-01-01", periods=16, freq="6h"),
                "lat": np.linspace(-60.0, 60.0, 4), "lon": np.arange(6) * 60.0},
    )  # fmt: skip
    path = tmp_path_factory.mktemp("mistakes") / f"v{request.param}.zarr"
    ds.to_zarr(path, zarr_format=request.param, encoding={"t2m": {"chunks": (4, 4, 6)}})
    return path


def _epoch(store: object, path: Path) -> list[bool]:
    """One unshuffled epoch of ``t2m`` from ``store``: each batch equal to xarray's read?"""
    t2m = open_geometries(path)["t2m"]
    pipe = insitu_pipeline(store, split_by_chunk(t2m, (1.0, 0.0, 0.0)), ["t2m"], batch_size=4,
                           shuffle=False)  # fmt: skip
    oracle = xr.open_zarr(path)["t2m"].values
    with pipe:
        return [np.array_equal(b.arrays["t2m"], oracle[b.sample_indices["t2m"]]) for b in pipe]


def test_a_sample_axis_name_no_array_has_is_refused_instead_of_making_every_array_static(
    store: Path,
) -> None:
    # before: sample_axis="tme" returned every array as static (every batch the whole array)
    with pytest.raises(KeyError, match=r"sample_axis='tme'.*no array.*'time'"):
        open_geometries(store, sample_axis="tme")
    with pytest.raises(KeyError, match="sample_axis='tme'"):
        open_geometries(store, ["t2m"], sample_axis="tme")
    assert not open_geometries(store, sample_axis="time")["t2m"].static


def test_an_xarray_dataset_changed_after_opening_is_refused_not_read_as_stored(
    store: Path,
) -> None:
    # before: the store's values were trained on, whatever the Dataset showed
    opened = xr.open_zarr(store)
    changed = {
        "ds * 2": opened * 2,
        "assign": opened.assign(t2m=opened.t2m + 1),
        "roll": opened.roll(lon=2),
        "sortby": opened.sortby("lat", ascending=False),
        "reversed isel": opened.isel(time=slice(None, None, -1)),
        "roll, not chunked": xr.open_zarr(store, chunks=None).roll(lon=2),
        "sortby, not chunked": xr.open_zarr(store, chunks=None).sortby("lat", ascending=False),
        "reversed, not chunked": xr.open_zarr(store, chunks=None).isel(time=slice(None, None, -1)),
    }
    for what, ds in changed.items():
        with pytest.raises(ValueError, match=r"changed after it was opened.*t2m") as err:
            open_geometries(ds)
        assert "chunk_transforms" in str(err.value), what
    # as opened (rechunked, not decoded, a subset of variables, loaded lazily): read, exactly
    for ds in (
        opened,
        opened.chunk({"time": 8}),
        opened[["t2m"]],
        xr.open_zarr(store, chunks=None),
        xr.open_zarr(store, decode_times=False),
        xr.open_dataset(store, engine="zarr"),
    ):
        assert _epoch(ds, store) == [True] * 4


def test_an_xarray_dataset_whose_stored_coordinates_were_assigned_anew_is_refused(
    store: Path,
) -> None:
    # before: accepted, and sel by value, forcings and the batches' coordinates used the
    # stored values (longitudes 0..300 where the Dataset showed -180..120, times 1 h early)
    opened = xr.open_zarr(store)
    for name, ds in (
        ("lon", opened.assign_coords(lon=((opened.lon + 180) % 360) - 180)),
        ("time", opened.assign_coords(time=opened.time + np.timedelta64(1, "h"))),
        ("lat", opened.assign_coords(lat=opened.lat.values[::-1].copy())),
    ):
        with pytest.raises(ValueError, match=f"coordinate '{name}' was assigned after"):
            open_geometries(ds)
    # a coordinate the store does not hold is the user's own: it is never read
    hour = opened.assign_coords(hour=("time", opened.time.dt.hour.values))
    assert _epoch(hour, store) == [True] * 4


def test_a_file_in_place_of_the_store_folder_says_it_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "era5.zarr"
    path.write_bytes(b"PK\x03\x04")  # a file where the folder should be (a zipped store, say)
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder.*ZipStore"):
        open_geometries(path)
    with pytest.raises(FileNotFoundError, match="the folder does not exist"):
        open_geometries(tmp_path / "nope.zarr")


def test_a_url_with_one_slash_after_the_scheme_says_to_write_two() -> None:
    # before: "s3:// URLs need a bucket", although the bucket was there
    for url, fixed in (("s3:/bucket/era5.zarr", "s3://bucket/era5.zarr"), ("gs:/b/x", "gs://b/x")):
        with pytest.raises(ValueError, match=f"two slashes.*{fixed}"):
            open_store(url)


def test_a_url_without_its_colon_says_to_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: "no zarr store at '/cwd/s3/bucket/era5.zarr': the folder does not exist", a
    # relative path the user never meant
    monkeypatch.chdir(tmp_path)
    for url in ("s3//bucket/era5.zarr", "HTTPS//host/data.zarr"):
        fixed = url.replace("//", "://", 1)
        with pytest.raises(FileNotFoundError, match=f"does not exist; for a URL.*{fixed}"):
            open_store(url)
    (tmp_path / "s3" / "bucket.zarr").mkdir(parents=True)  # such a folder, there: it is read
    assert open_store("s3//bucket.zarr") is not None


def test_a_pipeline_handed_to_a_dataloader_unwrapped_says_to_wrap_it(store: Path) -> None:
    t2m = open_geometries(store)["t2m"]
    pipe = insitu_pipeline(store, split_by_chunk(t2m, (1.0, 0.0, 0.0)), ["t2m"], batch_size=4)
    # before: TypeError: 'InSituPipeline' object is not subscriptable
    for unwrapped in (pipe, Loader(pipe)):
        loader = torch_data.DataLoader(unwrapped, batch_size=None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"as_dataset\(pipe\), batch_size=None"):
            next(iter(loader))
    pipe.close()


def test_one_dataset_in_two_loaders_at_once_refuses_the_older_iteration(store: Path) -> None:
    t2m = open_geometries(store)["t2m"]
    pipe = insitu_pipeline(store, split_by_chunk(t2m, (1.0, 0.0, 0.0)), ["t2m"], batch_size=4,
                           shuffle=False)  # fmt: skip
    dataset = as_dataset(pipe)
    first = iter(torch_data.DataLoader(dataset, batch_size=None))
    next(first)
    second = iter(torch_data.DataLoader(dataset, batch_size=None))
    assert len(list(second)) == 4  # the newer iteration runs a whole epoch
    # before: `first` went on with batches of the newer iteration's epoch, a mix of two
    with pytest.raises(RuntimeError, match=r"one loop at a time.*a pipeline per loader"):
        next(first)
    # one after the other (an epoch each, a new iter() per epoch) is what a trainer does
    assert len(list(torch_data.DataLoader(dataset, batch_size=None))) == 4
    pipe.close()


def test_two_loaders_over_one_pipeline_at_once_refuse_the_older_loop(store: Path) -> None:
    t2m = open_geometries(store)["t2m"]
    pipe = insitu_pipeline(store, split_by_chunk(t2m, (1.0, 0.0, 0.0)), ["t2m"], batch_size=4,
                           shuffle=False)  # fmt: skip
    first = iter(Loader(pipe))
    assert next(first).index == 0
    second = iter(Loader(pipe))
    # before: the two loops shared one stream, each getting every other batch of an epoch
    assert next(second).index == 0
    with pytest.raises(RuntimeError, match=r"one loop at a time.*a pipeline per loader"):
        next(first)
    assert [b.index for b in second] == [1, 2, 3]
    # one loader after the other, and one loader's own next epoch, are not refused
    again = Loader(pipe)
    assert [b.index for b in again] == [0, 1, 2, 3] == [b.index for b in again]
    pipe.close()
