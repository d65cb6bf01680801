"""Coordinates along the sample axis: CF time decoded like xarray, value windows for splits, and
each row's coordinate values carried by the batch.

The oracle is xarray's own decoding of a store xarray wrote (``Dataset.to_zarr``); the rows come
from the batch's sample indices, checked against zarr's read of the data array.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers import CountingStore, is_metadata_key
from torchdata.nodes import Loader

from insitubatch_nodes import Batch, insitu_pipeline, open_geometries, split_by_chunk, to_torch
from insitubatch_nodes.io.coords import Coordinate, open_coordinates
from insitubatch_nodes.plan.config import PlanConfig

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")  # (xarray's own dependency)

N_TIME, SPC = 96, 8  # 12 chunks of 8 six-hourly steps: 2019-12-25 .. 2020-01-18
START = "2019-12-25"


def _dataset(times: np.ndarray, **coords: object) -> object:
    rng = np.random.default_rng(0)
    field = rng.standard_normal((len(times), 3, 4)).astype(np.float32)
    return xr.Dataset(
        {"t2m": (("time", "lat", "lon"), field)},
        coords={"time": times, "lat": [10.0, 20.0, 30.0], "lon": [0.0, 1.0, 2.0, 3.0], **coords},
    )


def _write(path: Path, ds: object, zarr_format: int, time_encoding: dict[str, object]) -> Path:
    encoding = {"t2m": {"chunks": (SPC, 3, 4)}, "time": {"chunks": (N_TIME,), **time_encoding}}
    ds.to_zarr(
        path, mode="w", zarr_format=zarr_format, encoding=encoding, consolidated=zarr_format == 2
    )  # type: ignore[attr-defined]
    return path


# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters; the worker of the tests that import
# Lightning, which one of its tests does
pytestmark = pytest.mark.xdist_group("lightning")


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def era5(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    times = pd.date_range(START, periods=N_TIME, freq="6h").values
    root = tmp_path_factory.mktemp(f"xr{request.param}") / "era5.zarr"
    enc = {"units": "hours since 1900-01-01", "calendar": "proleptic_gregorian"}
    return _write(root, _dataset(times), request.param, enc)


def _xr_time(path: Path) -> np.ndarray:
    with xr.open_zarr(path, consolidated=False) as ds:
        return np.asarray(ds.time.values)


@pytest.mark.parametrize(
    ("units", "calendar", "reference", "step", "dtype"),
    [
        ("hours since 1900-01-01", "standard", "1900-01-01", 6.0, "int64"),
        ("hours since 1900-01-01 00:00:00", "gregorian", "1900-01-01", 1.0, "int32"),
        ("days since 1970-01-01T00:00:00Z", "proleptic_gregorian", "1970-01-01", 1.0, "int64"),
        ("days since 2000-01-01 12:00", None, "2000-01-01T12", 0.25, "float64"),
        ("seconds since 1970-1-1 0:0:0", "standard", "1970-01-01", 90.0, "float32"),
        ("minutes since 2019-12-01 06:00:00+03:00", "standard", "2019-12-01T03", 15.0, "int64"),
        ("hour since 2000-01-01T00:00:00.5", "standard", "2000-01-01T00:00:00.5", 3.0, "int16"),
    ],
)
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_cf_time_decodes_to_the_datetimes_xarray_decodes(
    tmp_path: Path,
    units: str,
    calendar: str | None,
    reference: str,
    step: float,
    dtype: str,
    zarr_format: int,
) -> None:
    raw = (np.arange(N_TIME) * step + 1000 * step).astype(dtype)  # as a writer stores them
    ds = _dataset(np.arange(N_TIME))
    attrs = {"units": units, **({"calendar": calendar} if calendar else {})}
    ds = ds.assign_coords(time=("time", raw, attrs))  # type: ignore[attr-defined]
    ds.to_zarr(tmp_path / "t.zarr", mode="w", zarr_format=zarr_format, consolidated=False)
    root = tmp_path / "t.zarr"
    assert zarr.open_array(root / "time", mode="r").attrs["units"] == units  # stored encoded
    time = open_coordinates(root, open_geometries(root)["t2m"])["time"]
    want = _xr_time(root)
    assert want.dtype.kind == "M"  # xarray decoded it
    assert time.is_time and time.values.dtype == np.dtype("M8[ns]") == want.dtype
    np.testing.assert_array_equal(time.values, want)
    unit = units.split()[0].rstrip("s")
    per = {"hour": 3600, "day": 86400, "second": 1, "minute": 60}[unit]
    expected = np.datetime64(reference, "ns") + (raw.astype(np.float64) * per * 1e9).astype(
        "m8[ns]"
    )
    np.testing.assert_array_equal(time.values, expected)


@pytest.mark.parametrize(
    ("units", "raw"),
    [
        ("days since 2001-01-01", (np.arange(N_TIME) / 24).astype(np.float32)),
        ("hours since 1900-01-01", np.arange(N_TIME) / 24),
        ("seconds since 2001-01-01", np.linspace(0.0, 1e6, N_TIME)),
    ],
    ids=["hourly-float32-days", "float64-fractional-hours", "float64-seconds"],
)
def test_fractional_cf_times_decode_to_xarrays_nanosecond_exactly(
    tmp_path: Path, units: str, raw: np.ndarray
) -> None:
    # xarray counts a fractional offset in nanoseconds and truncates it (float64 * ns per
    # unit, cast to int64); rounding instead puts some dates 1 ns off xarray's, so
    # ``ds.sel(time=batch.coords[...])`` would miss them. The first case is hourly data stored
    # as float32 days: 01:00 is 01:00:00.000107288 to both, 02:00 is ...214576 to xarray.
    ds = _dataset(np.arange(N_TIME))
    ds = ds.assign_coords(time=("time", raw, {"units": units}))  # type: ignore[attr-defined]
    root = tmp_path / "t.zarr"
    ds.to_zarr(root, mode="w", zarr_format=3, consolidated=False)  # type: ignore[attr-defined]
    time = open_coordinates(root, open_geometries(root)["t2m"])["time"]
    want = _xr_time(root)
    assert want.dtype == np.dtype("M8[ns]")
    np.testing.assert_array_equal(time.values, want)


def test_a_date_window_selects_the_chunk_snapped_index_window(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]
    time = open_coordinates(era5, geom)["time"]
    t = _xr_time(era5)
    start, stop = "2020-01-01", "2020-01-05T12:00"
    inside = np.flatnonzero((t >= np.datetime64(start)) & (t < np.datetime64(stop)))
    i0, i1 = int(inside[0]), int(inside[-1]) + 1
    assert (i0, i1) == (28, 46)  # half-open: 2020-01-05T12 itself is left out
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=(start, stop), coord=time)
    assert manifest.sample_range == (i0, i1)
    assert manifest.chunks("train") == list(range(i0 // SPC, (i1 - 1) // SPC + 1))  # [3, 4, 5]
    # the same window from datetime64, datetime and pandas bounds
    for bounds in [
        (np.datetime64(start), np.datetime64(stop)),
        (datetime.datetime(2020, 1, 1), datetime.datetime(2020, 1, 5, 12)),
        (pd.Timestamp(start), pd.Timestamp(stop)),
        (
            datetime.datetime(2020, 1, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=1))),
            datetime.datetime(2020, 1, 5, 12, tzinfo=datetime.UTC),
        ),
    ]:
        again = split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=bounds, coord=time)
        assert again == manifest
    # bounds far outside datetime64[ns]'s range still compare right: every chunk
    everything = split_by_chunk(geom, sample_range=("1000-01-01", "3000-01-01"), coord=time)
    assert everything.sample_range == (0, N_TIME)


def test_adjacent_date_windows_deliver_only_their_own_samples_and_share_none(era5: Path) -> None:
    # 2020-01-01T00 (sample 28) and 2020-01-05T12 (sample 46) both fall inside a chunk of 8:
    # train and val both read chunk 5 but never take each other's samples, nor (by default) a
    # target of the other window
    geom = open_geometries(era5)["t2m"]
    time = open_coordinates(era5, geom)["time"]
    t = _xr_time(era5)
    data = zarr.open_array(era5 / "t2m", mode="r")[...]
    bounds = {"train": ("2020-01-01", "2020-01-05T12"), "val": ("2020-01-05T12", "2020-01-09")}
    windows = {
        s: split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=b, coord=time)
        for s, b in bounds.items()
    }
    assert windows["train"].chunks("train")[-1] == windows["val"].chunks("train")[0] == 5
    assert (
        windows["train"].fingerprint()
        != split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=(24, 46)).fingerprint()
    )  # the window is part of what a state resumes
    seen: dict[str, set[int]] = {}
    for name, manifest in windows.items():
        lo, hi = manifest.sample_range  # type: ignore[misc]
        assert manifest.samples("train").tolist() == list(range(lo, hi))
        for cross in (False, True):
            pipe = insitu_pipeline(
                era5,
                manifest,
                {"x": geom, "y": geom.shift(1)},
                batch_size=5,
                seed=1,
                block_chunks=2,
                cross_split_windows=cross,
            )
            try:
                batches = _epoch(pipe)
                assert len(batches) == len(pipe)
            finally:
                pipe.close()
            x = np.concatenate([b.sample_indices["x"] for b in batches])
            y = np.concatenate([b.sample_indices["y"] for b in batches])
            for b in batches:
                np.testing.assert_array_equal(b["x"], data[b.sample_indices["x"]])
            start, stop = (np.datetime64(v) for v in bounds[name])
            assert np.all((t[x] >= start) & (t[x] < stop))  # every anchor in its window
            # each once; by default the last anchor is one step short of the window's end
            assert sorted(x.tolist()) == list(range(lo, hi if cross else hi - 1))
            assert y.max() == (hi if cross else hi - 1)
            if not cross:
                seen[name] = set(x.tolist()) | set(y.tolist())
    assert not seen["train"] & seen["val"]


def test_a_value_window_is_refused_without_its_coordinate_and_with_the_wrong_kind(
    era5: Path,
) -> None:
    geom = open_geometries(era5)["t2m"]
    time = open_coordinates(era5, geom)["time"]
    with pytest.raises(TypeError, match="coord=open_coordinates"):
        split_by_chunk(geom, sample_range=("2020-01-01", "2021-01-01"))
    with pytest.raises(TypeError, match="must be a date"):
        split_by_chunk(geom, sample_range=(0, 10), coord=time)
    with pytest.raises(ValueError, match="is not a date"):
        split_by_chunk(geom, sample_range=("soon", "later"), coord=time)
    with pytest.raises(ValueError, match=r"no sample .* lies in"):
        split_by_chunk(geom, sample_range=("2021-01-01", "2022-01-01"), coord=time)
    with pytest.raises(ValueError, match="start < stop"):
        split_by_chunk(geom, sample_range=("2020-01-05", "2020-01-01"), coord=time)


def _epoch(pipe: object) -> list[Batch]:
    return [b for b in pipe]  # type: ignore[attr-defined]


def test_every_batch_carries_each_rows_time_and_a_shifted_target_its_own(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]
    manifest = split_by_chunk(geom, (0.75, 0.25, 0.0))
    t = _xr_time(era5)
    data = zarr.open_array(era5 / "t2m", mode="r")[...]
    pipe = insitu_pipeline(
        era5, manifest, {"x": geom, "y": geom.shift(1)}, batch_size=7, block_chunks=2, seed=3
    )
    try:
        batches = _epoch(pipe)
    finally:
        pipe.close()
    assert batches
    for b in batches:
        assert set(b.coords) == {"x", "y"} and set(b.coords["x"]) == {"time"}
        for label in ("x", "y"):
            rows = b.sample_indices[label]
            np.testing.assert_array_equal(b.coords[label]["time"], t[rows])
            np.testing.assert_array_equal(b[label], data[rows])
        assert b.coords["x"]["time"].dtype == np.dtype("M8[ns]")
        assert np.all(b.coords["y"]["time"] - b.coords["x"]["time"] == np.timedelta64(6, "h"))
        tensors = to_torch(b)  # coordinates stay numpy; the arrays go to torch as before
        assert set(tensors) == {"x", "y"}


def test_a_batch_transform_can_turn_times_into_hour_of_day_and_day_of_year(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]

    def time_features(batch: Batch) -> Batch:
        t = batch.coords["x"]["time"]
        day = t.astype("datetime64[D]")
        hour = (t - day) / np.timedelta64(1, "h")
        doy = (day - t.astype("datetime64[Y]")).astype(np.int64) + 1
        batch.arrays["hour"] = hour.astype(np.float32)
        batch.arrays["doy"] = doy.astype(np.float32)
        return batch

    pipe = insitu_pipeline(
        era5, split_by_chunk(geom), {"x": geom}, batch_size=8, batch_transforms=[time_features]
    )
    try:
        b = next(iter(pipe))
    finally:
        pipe.close()
    when = pd.DatetimeIndex(_xr_time(era5)[b.sample_indices["x"]])
    np.testing.assert_array_equal(b["hour"], when.hour.to_numpy(np.float32))
    np.testing.assert_array_equal(b["doy"], when.day_of_year.to_numpy(np.float32))
    assert to_torch(b)["hour"].dtype.is_floating_point


def test_a_state_taken_mid_epoch_resumes_with_the_same_coordinates(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))

    def build() -> object:
        return insitu_pipeline(
            era5, manifest, {"x": geom, "y": geom.shift(1)}, batch_size=5, block_chunks=2
        )

    pipe = build()
    try:
        loader = Loader(pipe)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        want = [b.coords for b in it]
    finally:
        pipe.close()
    pipe = build()
    try:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        got = [b.coords for b in loader]
    finally:
        pipe.close()
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        for label in ("x", "y"):
            np.testing.assert_array_equal(g[label]["time"], w[label]["time"])


def test_coords_off_reads_no_coordinate_and_carries_none(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]
    manifest = split_by_chunk(geom)
    store = CountingStore(zarr.storage.LocalStore(era5, read_only=True))
    pipe = insitu_pipeline(store, manifest, {"x": geom}, batch_size=8, coords=())
    try:
        batches = _epoch(pipe)
    finally:
        pipe.close()
    assert batches and all(b.coords == {} for b in batches)
    assert not [k for k in store.counts if k.startswith("time")]
    assert pipe.stages.gather.coords == {}
    # the default reads the time coordinate once, however many views share it
    store = CountingStore(zarr.storage.LocalStore(era5, read_only=True))
    pipe = insitu_pipeline(store, manifest, {"x": geom, "y": geom.shift(1)}, batch_size=8)
    pipe.close()
    time_chunks = [k for k in store.counts if k.startswith("time/") and not is_metadata_key(k)]
    assert time_chunks and all(store.counts[k] == 1 for k in time_chunks)


def test_a_plain_numeric_coordinate_decodes_like_xarray_and_picks_a_window(
    tmp_path: Path,
) -> None:
    depth = np.linspace(0.5, 95.5, N_TIME)  # sample axis "depth", plain float metres
    rng = np.random.default_rng(1)
    ds = xr.Dataset(
        {"v": (("depth", "x"), rng.standard_normal((N_TIME, 5)).astype(np.float32))},
        coords={"depth": depth, "packed": ("depth", np.arange(N_TIME) * 0.25 + 100.0)},
    )
    root = tmp_path / "d.zarr"
    ds.to_zarr(
        root,
        mode="w",
        zarr_format=3,
        consolidated=False,
        encoding={
            "v": {"chunks": (SPC, 5)},
            "packed": {
                "dtype": "int16",
                "scale_factor": 0.25,
                "add_offset": 100.0,
                "_FillValue": -32768,
            },
        },
    )
    assert zarr.open_array(root / "packed", mode="r").dtype == np.int16  # stored packed
    geom = open_geometries(root)["v"]
    coords = open_coordinates(root, geom, ["depth", "packed"])
    with xr.open_zarr(root, consolidated=False) as back:
        np.testing.assert_array_equal(coords["depth"].values, back.depth.values)
        np.testing.assert_allclose(coords["packed"].values, back.packed.values)
    assert list(open_coordinates(root, geom)) == ["depth"]  # the default: the dimension's own
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=(20.0, 40), coord=coords["depth"])
    i0 = int(np.searchsorted(depth, 20.0))
    i1 = int(np.searchsorted(depth, 40.0))
    assert manifest.sample_range == (i0, i1)
    assert manifest.chunks("train") == list(range(i0 // SPC, (i1 - 1) // SPC + 1))
    with pytest.raises(TypeError, match="must be a number"):
        split_by_chunk(geom, sample_range=("2020-01-01", "2021-01-01"), coord=coords["depth"])
    pipe = insitu_pipeline(root, manifest, ["v"], batch_size=8, coords=["depth", "packed"])
    try:
        for b in pipe:
            rows = b.sample_indices["v"]
            np.testing.assert_array_equal(b.coords["v"]["depth"], depth[rows])
            np.testing.assert_allclose(b.coords["v"]["packed"], rows * 0.25 + 100.0)
    finally:
        pipe.close()


def test_a_non_monotonic_coordinate_is_refused_for_a_value_window(tmp_path: Path) -> None:
    times = pd.date_range(START, periods=N_TIME, freq="6h").values.copy()
    times[[40, 41]] = times[[41, 40]]
    root = _write(tmp_path / "nm.zarr", _dataset(times), 3, {"units": "hours since 1900-01-01"})
    geom = open_geometries(root)["t2m"]
    time = open_coordinates(root, geom)["time"]
    np.testing.assert_array_equal(time.values, _xr_time(root))  # still carried as decoded
    with pytest.raises(ValueError, match=r"'time' is not monotonic .*sample 41"):
        split_by_chunk(geom, sample_range=("2020-01-01", "2020-01-05"), coord=time)
    falling = Coordinate("z", np.arange(N_TIME, 0, -1.0))
    assert falling.index_range(10, 20) == (N_TIME - 19, N_TIME - 9)  # 19.0 .. 10.0


def test_an_unknown_calendar_is_refused_with_a_clear_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = _dataset(np.arange(N_TIME))
    ds["time"].attrs.update(units="days since 2000-01-01", calendar="martian")  # type: ignore[index]
    root = tmp_path / "martian.zarr"
    ds.to_zarr(
        root, mode="w", zarr_format=3, consolidated=False, encoding={"t2m": {"chunks": (SPC, 3, 4)}}
    )  # type: ignore[attr-defined]
    geom = open_geometries(root)["t2m"]
    with pytest.raises(ValueError, match=r"calendar 'martian' is not supported.*coords=\(\)"):
        open_coordinates(root, geom)
    manifest = split_by_chunk(geom)
    with pytest.raises(ValueError, match="calendar 'martian' is not supported"):
        insitu_pipeline(root, manifest, ["t2m"], coords=["time"])
    # by default such a coordinate is left out, with a warning: the pipeline still trains
    with caplog.at_level(logging.WARNING, logger="insitubatch_nodes.io.coords"):
        pipe = insitu_pipeline(root, manifest, ["t2m"], batch_size=8)
    try:
        assert next(iter(pipe)).coords == {}
    finally:
        pipe.close()
    assert "calendar 'martian' is not supported" in caplog.text


def test_a_named_coordinate_that_is_missing_says_where_it_looked(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]
    with pytest.raises(KeyError, match=r"'valid_time'.*looked at \['valid_time'\]"):
        open_coordinates(era5, geom, ["valid_time"])
    with pytest.raises(ValueError, match="runs along dimension 'lat'"):
        open_coordinates(era5, geom, ["lat"])


def test_a_coordinate_is_found_in_the_arrays_group_first_then_in_its_parents(
    tmp_path: Path,
) -> None:
    root = zarr.open_group(tmp_path / "tree.zarr", mode="w", zarr_format=3)
    hours = {"units": "hours since 2000-01-01"}
    root.create_array("time", data=np.arange(16, dtype=np.int64), dimension_names=("time",))
    root["time"].attrs.update(hours)
    sub = root.create_group("sub")
    field = np.zeros((16, 2), np.float32)
    sub.create_array("t2m", data=field, chunks=(4, 2), dimension_names=("time", "x"))
    own = root.create_group("own")
    own.create_array("t2m", data=field, chunks=(4, 2), dimension_names=("time", "x"))
    own.create_array("time", data=np.arange(16, dtype=np.int64) * 6, dimension_names=("time",))
    own["time"].attrs.update(hours)
    geoms = open_geometries(tmp_path / "tree.zarr")
    assert sorted(geoms) == ["own/t2m", "sub/t2m"]
    inherited = open_coordinates(tmp_path / "tree.zarr", geoms["sub/t2m"])["time"]
    assert inherited.path == "time"
    np.testing.assert_array_equal(
        inherited.values, np.datetime64("2000-01-01") + np.arange(16).astype("m8[h]")
    )
    shadowing = open_coordinates(tmp_path / "tree.zarr", geoms["own/t2m"])["time"]
    assert shadowing.path == "own/time"
    np.testing.assert_array_equal(
        shadowing.values, np.datetime64("2000-01-01") + (np.arange(16) * 6).astype("m8[h]")
    )


def test_each_rank_carries_the_times_of_its_own_rows(era5: Path) -> None:
    geom = open_geometries(era5)["t2m"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    t = _xr_time(era5)
    seen: list[np.ndarray] = []
    for rank in (0, 1):
        pipe = insitu_pipeline(
            era5, manifest, {"x": geom, "y": geom.shift(1)}, batch_size=6, rank=rank, world_size=2
        )
        try:
            for b in pipe:
                for label in ("x", "y"):
                    rows = b.sample_indices[label]
                    np.testing.assert_array_equal(b.coords[label]["time"], t[rows])
                seen.append(b.sample_indices["x"])
        finally:
            pipe.close()
    rows = np.concatenate(seen)
    assert len(rows) == len(set(rows.tolist())) > 0  # the ranks' rows (and so times) are disjoint


@pytest.mark.parametrize(
    "encoding",
    [
        {"units": "nanoseconds since 1970-01-01"},  # int64, NaT as its own bit pattern
        {"units": "hours since 1970-01-01", "dtype": "float64"},  # NaN; v3: a base64 _FillValue
    ],
    ids=["int64-ns", "float-hours"],
)
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_missing_time_decodes_to_nat_and_a_named_coordinate_like_xarray(
    tmp_path: Path, encoding: dict[str, object], zarr_format: int
) -> None:
    t = pd.date_range("2020-01-01", periods=N_TIME, freq="6h").values
    valid = t + np.timedelta64(7, "ns")
    valid[3] = np.datetime64("NaT", "ns")
    ds = _dataset(t, valid_time=("time", valid))
    root = tmp_path / "nat.zarr"
    ds.to_zarr(root, mode="w", zarr_format=zarr_format, consolidated=False,  # type: ignore[attr-defined]
               encoding={"valid_time": encoding})  # fmt: skip
    geom = open_geometries(root)["t2m"]
    got = open_coordinates(root, geom, ["valid_time"])["valid_time"].values
    with xr.open_zarr(root, consolidated=False) as back:
        want = back.valid_time.values
    np.testing.assert_array_equal(got, want)
    assert np.isnat(got[3]) and not np.isnat(np.delete(got, 3)).any()
    with pytest.raises(ValueError, match="has missing values"):
        split_by_chunk(geom, sample_range=("2020-01-01", "2020-01-05"),
                       coord=Coordinate("valid_time", got))  # fmt: skip


def test_the_lightning_data_module_hands_each_rows_time_to_its_transform(era5: Path) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    t = _xr_time(era5)
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def keep(batch: Batch) -> dict[str, object]:
        seen.append((batch.sample_indices["t2m"], batch.coords["t2m"]["time"]))
        return to_torch(batch)

    config = PlanConfig(batch_size=8)
    dm = InSituDataModule(
        era5, ["t2m"], (0.75, 0.25, 0.0), config=config, transform=keep, log_report=False
    )
    dm.setup("fit")
    try:
        n = sum(1 for _ in dm.train_dataloader())
    finally:
        dm.teardown("fit")
    assert n == len(seen) > 0
    for rows, times in seen:
        np.testing.assert_array_equal(times, t[rows])
    off = InSituDataModule(
        era5, ["t2m"], (0.75, 0.25, 0.0), config=config, coords=(), transform=lambda b: b.coords
    )
    off.setup("fit")
    try:
        assert next(iter(off.train_dataloader())) == {}
    finally:
        off.teardown("fit")
