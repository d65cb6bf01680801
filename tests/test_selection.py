"""Selection on field axes (isel/sel), sample axes by name, and static fields.

xarray's ``isel``/``sel`` on the same store is the oracle; zarr writes the stores (through
xarray's ``to_zarr``), and a counting store counts the stored objects read.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack, to_torch
from tests.helpers import counting_store

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

T, L, Y, X = 12, 7, 10, 16

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("selection")

LEVELS = np.array([1000, 925, 850, 700, 500, 300, 100])


def _write(root: Path, *, descending: bool, zarr_format: int = 3) -> Path:
    """A WeatherBench2-like store: ``t`` with every level in one object per step, ``u`` with
    one level per object and latitude cut into tiles of 4, and a static ``lsm``."""
    rng = np.random.default_rng(7)
    lat = np.linspace(90, -90, Y) if descending else np.linspace(-90, 90, Y)
    ds = xr.Dataset(
        {
            "t": (("time", "level", "latitude", "longitude"), rng.random((T, L, Y, X), "f4")),
            "u": (("time", "level", "latitude", "longitude"), rng.random((T, L, Y, X), "f4")),
            "lsm": (("latitude", "longitude"), rng.random((Y, X), "f4")),
        },
        coords={
            "time": np.arange(T),
            "level": LEVELS,
            "latitude": lat,
            "longitude": 22.5 * np.arange(X),
        },
    )
    encoding = {
        "t": {"chunks": (1, L, Y, X)},
        "u": {"chunks": (2, 1, 4, X)},
        "lsm": {"chunks": (Y, X)},
    }
    ds.to_zarr(root, mode="w", encoding=encoding, zarr_format=zarr_format, consolidated=False)
    return root


@pytest.fixture(scope="module", params=[True, False], ids=["lat-descending", "lat-ascending"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("sel") / "s.zarr", descending=request.param)


def _box(store: Path) -> dict[str, Any]:
    descending = xr.open_zarr(store, consolidated=False).latitude.values[0] > 0
    return {"latitude": slice(60, -20) if descending else slice(-20, 60)}


def _epoch(store: Any, views: dict[str, Any], **kwargs: Any) -> list[Any]:
    manifest = split_by_chunk(open_geometries(store)["u"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, views, batch_size=4, coords=(), **kwargs)
    try:
        return [
            (dict(b.sample_indices), {k: np.array(v) for k, v in b.arrays.items()}) for b in pipe
        ]
    finally:
        pipe.close()


SELECTIONS = {
    "levels by value": ("sel", {"level": [500, 850]}),
    "one level drops the axis": ("sel", {"level": 500}),
    "a latitude-longitude box": ("sel", "box"),
    "indices and a slice": ("isel", {"level": [6, 0, 3], "longitude": slice(2, 14, 3)}),
    "one index of two axes": ("isel", {"level": 2, "latitude": 4}),
    "boolean masks, as xarray takes them": ("isel", "masks"),
    "boolean masks of coordinate values": ("sel", "masks"),
}


@pytest.mark.parametrize("array", ["t", "u"], ids=["levels-whole-in-a-chunk", "levels-chunked"])
@pytest.mark.parametrize("case", list(SELECTIONS))
def test_a_selected_view_delivers_what_xarray_selects_from_the_same_store(
    store: Path, array: str, case: str
) -> None:
    method, key = SELECTIONS[case]
    if key == "box":
        key = {**_box(store), "longitude": slice(45, 200)}
    if key == "masks":
        ds = xr.open_zarr(store, consolidated=False)
        key = {
            "level": ds.level.values >= 500,
            "longitude": np.arange(ds.sizes["longitude"]) % 3 == 1,
        }
    view = getattr(open_geometries(store)[array], method)(**key)
    expected = getattr(xr.open_zarr(store, consolidated=False)[array], method)(**key).values
    assert view.inner_shape == expected.shape[1:]
    batches = _epoch(store, {"x": view, "y": view.shift(1)})
    assert batches
    for indices, arrays in batches:
        for label in ("x", "y"):
            np.testing.assert_array_equal(arrays[label], expected[indices[label]])


def test_selecting_a_selection_selects_within_it(store: Path) -> None:
    g = open_geometries(store)["t"]
    view = g.sel(level=[1000, 700, 300, 100]).isel(level=[3, 1]).sel(longitude=[90.0, 0.0])
    ds = xr.open_zarr(store, consolidated=False).t
    expected = ds.sel(level=[1000, 700, 300, 100]).isel(level=[3, 1]).sel(longitude=[90.0, 0.0])
    for indices, arrays in _epoch(store, {"x": view}):
        np.testing.assert_array_equal(arrays["x"], expected.values[indices["x"]])


def test_a_chunked_selection_reads_only_the_tiles_it_touches(store: Path) -> None:
    # u: levels one per object, latitude in tiles of 4 (3 tiles); two labels of one array
    # share its slots: levels {2, 5} x latitude tiles {0, 2} of 7 x 3 objects per chunk
    g = open_geometries(store)["u"]
    views = {"a": g.isel(level=2, latitude=[0, 1]), "b": g.isel(level=[5], latitude=slice(8, 10))}
    counting = counting_store(store)
    batches = _epoch(counting, views)
    ds = xr.open_zarr(store, consolidated=False).u
    for indices, arrays in batches:
        np.testing.assert_array_equal(
            arrays["a"], ds.isel(level=2, latitude=[0, 1]).values[indices["a"]]
        )
    gets = counting.chunk_counts()
    read = sorted({tuple(int(p) for p in key.split("/")[-4:]) for key in gets})
    chunks = T // 2
    assert read == sorted(
        (c, lev, lat, 0) for c in range(chunks) for lev in (2, 5) for lat in (0, 2)
    )
    assert all(n == 1 for n in gets.values()), "every touched object is read once"


def test_a_selection_whole_in_a_chunk_decodes_each_object_once(store: Path) -> None:
    counting = counting_store(store)
    view = open_geometries(store)["t"].sel(level=[500, 850])
    _epoch(counting, {"x": view})
    gets = counting.chunk_counts()
    assert len(gets) == T and all(n == 1 for n in gets.values())


def test_a_selection_whole_in_a_chunk_keeps_only_the_selected_levels_in_the_pool(
    store: Path,
) -> None:
    # t: 7 levels whole in each object; two views select 3 of them between them (the union is
    # held: 3/7 of the memory), one in the held order (a contiguous copy), one out of it
    g = open_geometries(store)["t"]
    views = {"a": g.sel(level=[850, 500]), "b": g.isel(level=[6, 4]), "c": g.sel(level=500)}
    manifest = split_by_chunk(open_geometries(store)["u"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, views, batch_size=4, coords=())
    ds = xr.open_zarr(store, consolidated=False).t
    expected = {
        "a": ds.sel(level=[850, 500]).values,
        "b": ds.isel(level=[6, 4]).values,
        "c": ds.sel(level=500).values,
    }
    try:
        for _ in range(2):  # epoch 1 from the pool: the kept levels, still in their places
            pipe.reset()
            for batch in pipe:
                for label, want in expected.items():
                    rows = batch.sample_indices[label]
                    np.testing.assert_array_equal(np.array(batch.arrays[label]), want[rows])
        stats = pipe.stats()
    finally:
        pipe.close()
    assert stats["gets"] == T, "each stored object is read once"
    assert stats["resident_peak_bytes"] == T * 3 * Y * X * 4, "3 levels of 7 are kept per step"


def _two_epochs_of_850_and_500(store: Path, pipe: Any) -> dict[str, int]:
    """Two epochs of ``pipe``, whose labels ``x`` and ``y`` read t's levels 850 and 500, each
    row checked against xarray's; the pipeline's stats after them (it is closed)."""
    ds = xr.open_zarr(store, consolidated=False).t.sel(level=[850, 500]).values
    try:
        for _ in range(2):
            pipe.reset()
            for batch in pipe:
                for label in ("x", "y"):
                    rows = batch.sample_indices[label]
                    np.testing.assert_array_equal(np.array(batch.arrays[label]), ds[rows])
        return dict(pipe.stats())
    finally:
        pipe.close()


def test_a_budget_that_holds_the_selected_levels_is_enough_though_whole_objects_would_not_fit(
    store: Path,
) -> None:
    from insitubatch_nodes.io.selection import held_by_path
    from insitubatch_nodes.plan.config import PlanConfig
    from insitubatch_nodes.plan.schedule import schedule_floors

    # t keeps 2 of its 7 levels per slot: the plan's floors are 2/7 of whole objects'. An
    # explicit budget at the held floor was refused, with a floor 3.5 times what it needs
    g = open_geometries(store)["t"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g.sel(level=[850, 500]), "y": g.sel(level=[850, 500]).shift(1)}
    cfg = PlanConfig(batch_size=4)
    whole = schedule_floors(manifest, views, cfg)
    held = schedule_floors(manifest, views, cfg, held_by_path(views.values()))
    assert (held.read_once * 7, held.bounded * 7) == (whole.read_once * 2, whole.bounded * 2)
    budget = held.guaranteed
    assert budget < whole.guaranteed
    pipe = insitu_pipeline(store, manifest, views, batch_size=4, coords=(),
                           cache_budget_bytes=budget)  # fmt: skip
    stats = _two_epochs_of_850_and_500(store, pipe)
    assert stats["resident_peak_bytes"] <= budget


def test_the_buffers_a_kept_selection_is_decoded_into_count_as_decode_scratch(
    store: Path,
) -> None:
    # t: each object (7 levels) is decoded whole into a buffer of its thread, then 2 levels
    # are kept in the slot: that buffer is memory outside the pool, as the decoders' scratch is
    g = open_geometries(store)["t"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, {"x": g.sel(level=[850, 500])}, batch_size=4,
                           coords=())  # fmt: skip
    try:
        before = pipe.stats()["decode_scratch_bytes"]
        for _ in pipe:
            pass
        stats = pipe.stats()
        report = pipe.report()
        assert report is not None
    finally:
        pipe.close()
    whole = L * Y * X * 4  # one stored object, decoded
    aside = stats["decode_scratch_bytes"] - before
    # at least one thread's buffer; at most one per thread, beside each thread's own scratch
    assert whole <= aside <= 2 * report.decode_threads * whole, (aside, whole)
    assert stats["outside_pool_bytes"] >= stats["batch_buffer_bytes"] + aside


def test_at_one_sample_per_chunk_a_level_selection_decodes_straight_into_the_batch(
    store: Path,
) -> None:
    from insitubatch_nodes import FetchOptions

    # t: one step per object, 7 levels whole in each; the labels select exactly what the
    # slots hold (levels 850 and 500, in the held order), so their rows need no slot when the
    # schedule decodes rows straight into batches (a split larger than the budget; forced
    # here with direct=True on this small store)
    g = open_geometries(store)["t"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    view = g.sel(level=[850, 500])
    for direct in (True, None):
        pipe = insitu_pipeline(
            store, manifest, {"x": view, "y": view.shift(1)}, batch_size=4, coords=(),
            fetch=FetchOptions(direct=direct),
        )  # fmt: skip
        stats = _two_epochs_of_850_and_500(store, pipe)
        if direct:
            assert stats["misses_in_place"] > 0, "rows decoded straight into the batch"
            assert stats["resident_peak_bytes"] < T * 2 * Y * X * 4
        else:  # the split fits the budget: kept in the pool, the second epoch all hits
            assert stats["misses_in_place"] == 0 and stats["gets"] == T


def test_set_views_selects_within_what_the_slots_hold_or_says_what_to_build(
    store: Path,
) -> None:
    # the slots hold what the build's views select: levels {300, 500, 850} of t (whole in each
    # object) and the tile of u's level 2 (one level per object); a later set of views may
    # select within that, and is refused (not an IndexError mid-epoch) beyond it
    g = open_geometries(store)
    manifest = split_by_chunk(g["u"], (1.0, 0.0, 0.0))
    built = {"x": g["t"].sel(level=[500, 850, 300]), "y": g["u"].isel(level=[2])}
    pipe = insitu_pipeline(store, manifest, built, batch_size=4, coords=())
    ds = xr.open_zarr(store, consolidated=False)
    try:
        list(pipe)
        pipe.set_views({"x": g["t"].sel(level=[850, 300]), "y": g["u"].isel(level=2)})
        pipe.reset()
        batches = list(pipe)
        assert batches
        for batch in batches:
            rows = batch.sample_indices
            np.testing.assert_array_equal(
                np.array(batch.arrays["x"]), ds.t.sel(level=[850, 300]).values[rows["x"]]
            )
            np.testing.assert_array_equal(
                np.array(batch.arrays["y"]), ds.u.isel(level=2).values[rows["y"]]
            )
        for beyond in (
            {"x": g["t"].sel(level=1000), "y": g["u"].isel(level=2)},
            {"x": g["t"], "y": g["u"].isel(level=2)},
            {"x": g["t"].sel(level=500), "y": g["u"].isel(level=5)},
        ):
            with pytest.raises(ValueError, match="do not hold"):
                pipe.set_views(beyond)
    finally:
        pipe.close()


@pytest.mark.parametrize("descending", [True, False], ids=["descending", "ascending"])
def test_sel_compares_values_in_the_coordinates_float32_as_xarray_does(
    tmp_path: Path, descending: bool
) -> None:
    # a 0.1-degree grid stored in float32 (ERA5-Land): 37.2 is 37.200000763 there, so a slice
    # ending at 37.2 compared in float64 left that row out, and np.float64(37.2) was no value
    lat = np.round(np.arange(35.7, 37.25, 0.1), 1).astype("f4")
    lat = lat[::-1] if descending else lat
    ds = xr.Dataset({"t": (("time", "lat"), np.zeros((2, len(lat)), "f4"))},
                    coords={"time": [0, 1], "lat": lat})  # fmt: skip
    ds.to_zarr(tmp_path / "s.zarr", mode="w", consolidated=False)
    g = open_geometries(tmp_path / "s.zarr")["t"]
    ends = (37.2, 36.5) if descending else (36.5, 37.2)
    for key in (slice(*ends), slice(ends[1], None), slice(36.5, 36.5), [np.float64(37.2), 36.5]):
        want = ds.t.sel(lat=key).lat.values
        got = g.sel(lat=key).select.keys[0]
        np.testing.assert_array_equal(lat[list(got)], want, err_msg=str(key))
    assert lat[g.sel(lat=np.float64(36.9)).select.keys[0]] == np.float32(36.9)
    between = (36.59, 36.51) if descending else (36.51, 36.59)
    with pytest.raises(IndexError, match="no value of it lies between the slice's ends"):
        g.sel(lat=slice(*between))


def test_a_view_cannot_be_selected_by_an_unknown_dimension_or_value(store: Path) -> None:
    g = open_geometries(store)["t"]
    with pytest.raises(KeyError, match="no dimension named 'height'"):
        g.isel(height=1)
    with pytest.raises(KeyError, match="not a value of coordinate 'level'"):
        g.sel(level=[500, 501])
    with pytest.raises(ValueError, match="sample axis"):
        g.isel(time=1)
    with pytest.raises(IndexError, match="out of range"):
        g.isel(level=[7])
    with pytest.raises(IndexError, match="selects nothing"):
        g.sel(latitude=slice(_box(store)["latitude"].stop, _box(store)["latitude"].start))
    with pytest.raises(ValueError, match="dropped"):
        g.isel(level=1).isel(level=0)


def test_sample_axis_and_patches_take_dimension_names(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    data = np.arange(6 * 5 * 4, dtype="f4").reshape(6, 5, 4)
    arr = zarr.create_array(
        tmp_path / "s.zarr", shape=data.shape, chunks=(6, 1, 4), dtype="f4",
        dimension_names=("y", "z", "x"),
    )  # fmt: skip
    arr[...] = data
    g = open_geometries(tmp_path / "s.zarr", sample_axis="z")[""]
    assert g.sample_axis == 1 and g.inner_shape == (6, 4)
    assert g.patches({"y": 3}).inner_shape == (3, 4)
    assert g.isel(x=[0, 3]).inner_shape == (6, 2)


def test_static_arrays_are_recognised_and_carried_by_every_batch_without_a_copy(
    store: Path,
) -> None:
    geoms = open_geometries(store)
    assert geoms["lsm"].static and not geoms["t"].static
    assert geoms["lsm"].inner_shape == (Y, X)
    box = _box(store)
    views = {"x": geoms["t"].sel(level=500), "lsm": geoms["lsm"], "box": geoms["lsm"].sel(**box)}
    manifest = split_by_chunk(geoms["u"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, views, batch_size=5)
    ds = xr.open_zarr(store, consolidated=False)
    try:
        seen = 0
        for batch in pipe:
            n = len(batch)
            assert batch.arrays["lsm"].shape == (n, Y, X)
            assert batch.arrays["lsm"].strides[0] == 0, "one field broadcast, not a copy per row"
            np.testing.assert_array_equal(
                batch.arrays["lsm"], np.broadcast_to(ds.lsm.values, (n, Y, X))
            )
            np.testing.assert_array_equal(batch.arrays["box"][n - 1], ds.lsm.sel(**box).values)
            assert "lsm" not in batch.sample_indices and "lsm" not in batch.coords
            assert to_torch(batch)["lsm"].stride()[0] == 0
            seen += n
        assert seen == T
    finally:
        pipe.close()


def test_static_fields_that_outnumber_the_data_arrays_or_are_named_first_are_still_static(
    tmp_path: Path,
) -> None:
    # three static fields beside one (time, latitude, longitude) array: latitude is at index
    # 0 of more arrays than time is, but it is a field axis of t2m, so it is not sampled along
    rng = np.random.default_rng(2)
    statics = {name: (("latitude", "longitude"), rng.random((Y, X), "f4")) for name in
               ("lsm", "orography", "soil_type")}  # fmt: skip
    ds = xr.Dataset(
        {"t2m": (("time", "latitude", "longitude"), rng.random((T, Y, X), "f4")), **statics},
        coords={"time": np.arange(T), "latitude": np.linspace(90, -90, Y)},
    )
    ds.to_zarr(tmp_path / "s.zarr", mode="w", consolidated=False)
    for variables in (None, ["lsm", "t2m"], ["t2m", "lsm"]):
        geoms = open_geometries(tmp_path / "s.zarr", variables)
        assert not geoms["t2m"].static and geoms["t2m"].sample_axis == 0
        assert all(geoms[name].static for name in geoms if name != "t2m"), variables


def test_a_tie_between_sample_dimensions_goes_to_the_one_whose_coordinate_holds_times(
    tmp_path: Path,
) -> None:
    # one (time, ...) array beside one (soil_level, ...) static: each dimension is at index 0
    # of one array, and the first path's won (soil_level named first sampled soil, not time)
    rng = np.random.default_rng(3)
    ds = xr.Dataset(
        {"t2m": (("time", "latitude", "longitude"), rng.random((T, Y, X), "f4")),
         "soil": (("soil_level", "latitude", "longitude"), rng.random((4, Y, X), "f4"))},
        coords={"time": pd.date_range("2020-01-01", periods=T, freq="6h"),
                "soil_level": [0.07, 0.28, 1.0, 2.89]},
    )  # fmt: skip
    ds.to_zarr(tmp_path / "s.zarr", mode="w", consolidated=False)
    for variables in (None, ["soil", "t2m"], ["t2m", "soil"]):
        geoms = open_geometries(tmp_path / "s.zarr", variables)
        assert not geoms["t2m"].static and geoms["soil"].static, variables


def test_set_views_keeps_the_static_labels_of_the_build_and_says_how_to_change_them(
    store: Path,
) -> None:
    # a static label passed again as it was built (a rollout's next views) was a KeyError;
    # adding, dropping or reselecting one is refused, naming the stack as the way to do it
    g = open_geometries(store)
    manifest = split_by_chunk(g["u"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, {"x": g["t"].sel(level=500), "lsm": g["lsm"]},
                           batch_size=4, coords=())  # fmt: skip
    lsm = xr.open_zarr(store, consolidated=False).lsm.values
    try:
        list(pipe)
        pipe.set_views({"x": g["t"].sel(level=500).shift(1), "lsm": g["lsm"]})
        pipe.reset()
        batches = list(pipe)
        assert batches and all(b.sample_indices["x"].min() >= 1 for b in batches)
        for batch in batches:
            np.testing.assert_array_equal(batch.arrays["lsm"][-1], lsm)
        for other in (
            {"x": g["t"].sel(level=500)},
            {"x": g["t"].sel(level=500), "lsm": g["lsm"].isel(latitude=[0])},
            {"x": g["t"].sel(level=500), "lsm": g["lsm"], "mask": g["lsm"]},
        ):
            with pytest.raises(ValueError, match=r"static labels .*\['lsm'\].*stack"):
                pipe.set_views(other)
    finally:
        pipe.close()


def test_a_static_array_is_read_once_though_set_views_selects_it_otherwise(store: Path) -> None:
    # built with the whole mask as a label; later stacks take it whole and boxed: each is
    # taken from the array already read, not read again (it was read once per set_views)
    counting = counting_store(store)
    g = open_geometries(counting)
    box = _box(store)
    pipe = insitu_pipeline(counting, split_by_chunk(g["u"], (1.0, 0.0, 0.0)),
                           {"x": g["t"].sel(level=500), "lsm": g["lsm"]}, batch_size=4,
                           coords=())  # fmt: skip
    lsm = xr.open_zarr(store, consolidated=False).lsm
    try:
        list(pipe)
        for members, want in (
            ({"t": g["t"].sel(level=500), "lsm": g["lsm"]}, lsm.values),
            ({"t": g["t"].sel(level=500, **box), "lsm": g["lsm"].sel(**box)}, lsm.sel(**box)),
        ):
            pipe.set_views({"x": stack(members), "lsm": g["lsm"]})
            pipe.reset()
            for batch in pipe:
                np.testing.assert_array_equal(batch.arrays["x"][-1, 1], want)
    finally:
        pipe.close()
    assert {k: n for k, n in counting.chunk_counts().items() if k.startswith("lsm")} == {
        "lsm/c/0/0": 1
    }


def test_static_fields_are_kept_in_the_persistent_cache_and_the_next_pipeline_reads_none(
    store: Path, tmp_path: Path
) -> None:
    root = tmp_path / "s.zarr"
    shutil.copytree(store, root)
    geoms = open_geometries(root)
    t500 = geoms["t"].sel(level=500)
    views = {"x": t500, "lsm": geoms["lsm"], "s": stack({"t": t500, "lsm": geoms["lsm"]})}
    lsm = xr.open_zarr(root, consolidated=False).lsm.values
    for run in range(3):
        if run == 2:  # the static field changes in the store: the cache's check reads it again
            lsm = lsm + 1.0
            zarr.open_array(root / "lsm", mode="r+")[...] = lsm
        counting = counting_store(root)
        batches = _epoch(counting, views, cache_dir=tmp_path / "cache", persist=True)
        static_reads = sum(n for k, n in counting.chunk_counts().items() if k.startswith("lsm/"))
        assert static_reads == (0 if run == 1 else 1), f"run {run}: {counting.chunk_counts()}"
        if run == 1:
            assert counting.chunk_counts() == {}, "the second pipeline reads nothing at all"
        for _, arrays in batches:
            np.testing.assert_array_equal(arrays["lsm"][-1], lsm)
            np.testing.assert_array_equal(
                arrays["s"][:, 1], np.broadcast_to(lsm, arrays["s"][:, 1].shape)
            )


def test_a_pipeline_of_static_arrays_only_says_what_to_add(store: Path) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["u"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="static array"):
        insitu_pipeline(store, manifest, {"lsm": geoms["lsm"]})


def test_a_selection_works_on_zarr_v2_stores(tmp_path: Path) -> None:
    root = _write(tmp_path / "v2.zarr", descending=True, zarr_format=2)
    view = open_geometries(root)["u"].sel(level=[850, 100], latitude=slice(60, -20))
    expected = xr.open_zarr(root, consolidated=False).u.sel(
        level=[850, 100], latitude=slice(60, -20)
    )
    for indices, arrays in _epoch(root, {"x": view}):
        np.testing.assert_array_equal(arrays["x"], expected.values[indices["x"]])


def _write_layout(root: Path, chunks: tuple[int, ...], shards: tuple[int, ...] | None) -> Path:
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(11)
    group = zarr.open_group(root, mode="w")
    data = rng.random((T, L, Y, X), dtype="f4")
    arr = group.create_array(
        "u", shape=data.shape, chunks=chunks, shards=shards, dtype="f4",
        dimension_names=("time", "level", "latitude", "longitude"),
    )  # fmt: skip
    arr[...] = data
    level = group.create_array("level", shape=(L,), dtype="i8", dimension_names=("level",))
    level[...] = LEVELS
    return root


@pytest.mark.parametrize(
    ("chunks", "shards"),
    [((4, 1, Y, X), None), ((2, 1, 5, 8), (4, 7, 10, 16)), ((2, 1, 5, 8), (4, 1, 5, 16))],
    ids=["one-level-per-object (level-major slots)", "sharded, levels whole", "sharded by level"],
)
def test_a_selection_equals_zarrs_read_for_level_major_and_sharded_layouts(
    tmp_path: Path, chunks: tuple[int, ...], shards: tuple[int, ...] | None
) -> None:
    root = _write_layout(tmp_path / "l.zarr", chunks, shards)
    whole = pytest.importorskip("zarr").open_array(root / "u")[...]
    g = open_geometries(root)["u"]
    views = {"a": g.sel(level=[850, 100]), "b": g.isel(level=4, latitude=slice(5, 10)).shift(1)}
    for indices, arrays in _epoch(root, views):
        np.testing.assert_array_equal(arrays["a"], whole[indices["a"]][:, [2, 6]])
        np.testing.assert_array_equal(arrays["b"], whole[indices["b"]][:, 4, 5:10])


def test_a_selected_view_takes_shape_preserving_chunk_transforms_where_slots_hold_chunks(
    store: Path,
) -> None:
    from insitubatch_nodes import StandardScaler, applies

    g = open_geometries(store)
    scale = applies("t", StandardScaler({"t": 1.0}, {"t": 0.5}, eps=0.0))
    expected = (xr.open_zarr(store, consolidated=False).t.sel(level=[500]).values - 1.0) / 0.5
    for indices, arrays in _epoch(store, {"x": g["t"].sel(level=[500])}, chunk_transforms=[scale]):
        np.testing.assert_allclose(arrays["x"], expected[indices["x"]], rtol=1e-6)
    scale_u = applies("u", StandardScaler({"u": 1.0}, {"u": 0.5}))
    with pytest.raises(ValueError, match="no chunk transforms"):
        _epoch(store, {"x": g["u"].isel(level=1)}, chunk_transforms=[scale_u])


def test_a_persistent_cache_holds_selections_of_whole_chunks_and_refuses_held_tiles(
    store: Path, tmp_path: Path
) -> None:
    g = open_geometries(store)
    expected = xr.open_zarr(store, consolidated=False).t.isel(level=[1, 2]).values
    for _ in range(2):  # a writer, then a reader of the same cache
        batches = _epoch(
            store, {"x": g["t"].isel(level=[1, 2])}, cache_dir=tmp_path / "c", persist=True
        )
        for indices, arrays in batches:
            np.testing.assert_array_equal(arrays["x"], expected[indices["x"]])
    with pytest.raises(ValueError, match="persistent cache"):
        _epoch(store, {"x": g["u"].isel(level=1)}, cache_dir=tmp_path / "d", persist=True)


def test_a_selected_view_pickles_with_its_coordinate_reader(store: Path) -> None:
    import pickle

    view = open_geometries(store)["t"].sel(level=[500, 850])
    back = pickle.loads(pickle.dumps(view))
    assert back == view and back.inner_shape == (2, Y, X)
    assert back.sel(level=500).inner_shape == (Y, X)


def test_patches_and_selections_compose_on_other_axes_only(store: Path) -> None:
    g = open_geometries(store)["t"]
    both = g.patches({"latitude": 4}).isel(level=[1, 0])
    assert both == g.isel(level=[1, 0]).patches({"latitude": 4})
    assert both.inner_shape == (2, 4, g.field_shape[2])
    assert g.patches({"latitude": 4}).isel(level=1).inner_shape == (4, g.field_shape[2])
    with pytest.raises(ValueError, match="is patched"):
        g.patches({"latitude": 4}).isel(latitude=1)
    with pytest.raises(ValueError, match="selected axis cannot be patched"):
        g.isel(latitude=[1, 2, 3, 4]).patches({"latitude": 4})


@pytest.mark.parametrize(
    "keys",
    [
        ((1, 4, 2), None, (3, 0, 5, 6)),  # two uneven lists: the np.ix_ gather
        ((5, 0, 2), 3, None),  # one uneven list and a dropped axis: a copy per entry
        ((0, 2, 4), (7, 8), 1),  # evenly spaced lists: slices
    ],
    ids=["two-lists", "one-list", "slices"],
)
@pytest.mark.parametrize("spc", [4, 1], ids=["4 samples per chunk", "one sample per chunk"])
def test_the_gather_of_a_selection_equals_numpy_for_rows_in_any_order(
    keys: tuple[object, ...], spc: int
) -> None:
    from insitubatch_nodes.io.geometry import ArrayGeometry
    from insitubatch_nodes.io.selection import Selection
    from insitubatch_nodes.stages._select import SelectedGather

    shape = (40, 6, 9, 7)
    data = np.random.default_rng(5).random(shape).astype("f4")
    view = ArrayGeometry("a", shape, (spc, 6, 9, 7), np.float32, None, select=Selection(keys))
    slots = {("a", c): data[c * spc : (c + 1) * spc] for c in range(40 // spc)}
    samples = np.array([13, 4, 5, 6, 15, 12, 39, 0, 37])  # runs in and out of sample order
    out = np.empty((len(samples), *view.inner_shape), "f4")
    assert SelectedGather(view, None)(out, samples, slots) == len(samples)
    expected = data[samples]
    for axis in reversed(range(3)):
        key = keys[axis]
        if key is not None:
            expected = np.take(expected, key if isinstance(key, int) else list(key), axis=axis + 1)
    np.testing.assert_array_equal(out, expected)
    # into a channel slice of a wider buffer (a stack member's destination: not contiguous)
    inner = view.inner_shape
    wide = np.full((len(samples), inner[0] + 3, *inner[1:]), np.nan, "f4")
    assert SelectedGather(view, None)(wide[:, 1 : 1 + inner[0]], samples, slots) == len(samples)
    np.testing.assert_array_equal(wide[:, 1 : 1 + inner[0]], expected)
    assert np.isnan(wide[:, 0]).all() and np.isnan(wide[:, 1 + inner[0] :]).all()
    # rows of chunks without a slot (decoded in place) are left as they are, and not counted
    gone = {key: slot for key, slot in slots.items() if key != ("a", 12 // spc)}
    left = np.full_like(out, -1.0)
    kept = samples // spc != 12 // spc
    copied = SelectedGather(view, None)(left, samples, gone, skip_missing=True)
    assert copied == kept.sum() < len(samples)
    np.testing.assert_array_equal(left[kept], expected[kept])
    assert (left[~kept] == -1.0).all()
