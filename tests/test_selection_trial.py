"""Field selections and channel stacks as an ML engineer uses them, found wrong by a black-box
trial.

The trial built thousands of tiny stores (zarr v2 and v3, sharded or not, every axis chunked
whole or in tiles, the sample axis first or not) and compared every delivered row with xarray's
``isel``/``sel`` on ``xr.open_zarr`` of the same store (numpy's ``concatenate``/``stack`` of
those for stacks): lists out of order, with duplicates and negative indices, numpy scalars and
arrays, boolean masks, negative-step slices, chained selections; with windows, shifts,
patches, a sample axis named, a persistent cache over two pipelines, ``set_views`` and resume
mid-epoch (about 17,000 pipelines, 480,000 rows): every row was xarray's. What it found wrong,
each a test below that failed before its fix: a stack's patched members were cached as whole
chunks (the next pipeline re-read them all; a read-only cache refused them); ``sel`` of a value
the view's coordinate repeats took the first match (xarray keeps every match); a lead time
written by xarray as durations was read as numbers (``sel(step=np.timedelta64(6, "m"))``
selected the 6-hour step); a DataArray mask and a 0-d index were refused; and two messages
(an empty selection, a negative-step slice) did not say what to do. A second trial found a
label slice of a coordinate an earlier list left unsorted refused (xarray takes it, between
its ends' positions), and a sample axis of durations (a lead time) refused by value windows,
time strides, ``missing=`` and windows in time deltas.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.io.coords import open_coordinates

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``a (time, level, lat, lon)`` with levels stored two per object and the grid in 1 x 2
    tiles, ``b (time, lat, lon)``, ``s (lat, lon)`` static; a descending level coordinate."""
    rng = np.random.default_rng(0)
    ds = xr.Dataset(
        {
            "a": (("time", "level", "lat", "lon"), rng.standard_normal((6, 4, 2, 4))),
            "b": (("time", "lat", "lon"), rng.standard_normal((6, 2, 4))),
            "s": (("lat", "lon"), rng.standard_normal((2, 4))),
        },
        coords={"time": pd.date_range("2020-01-01", periods=6, freq="6h"),
                "level": [1000, 850, 500, 250], "lat": [10.0, -10.0], "lon": [0.0, 90, 180, 270]},
    )  # fmt: skip
    enc = {"a": {"dtype": "float32", "chunks": (3, 2, 1, 2)},
           "b": {"dtype": "float32", "chunks": (3, 1, 2)}, "s": {"dtype": "float32"}}  # fmt: skip
    path = tmp_path_factory.mktemp("selection") / "trial.zarr"
    ds.to_zarr(path, encoding=enc, consolidated=False, zarr_format=3)
    return path


def test_a_stack_of_patched_members_is_taken_from_the_persistent_cache_by_the_next_pipeline(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    g = open_geometries(store)
    manifest = split_by_chunk(g["b"], (1.0, 0.0, 0.0))
    cut = {"lat": 1, "lon": 2}
    x = stack({"a": g["a"].isel(level=[0, 3]).patches(cut), "b": g["b"].patches(cut)})
    ds = xr.open_zarr(store, consolidated=False)
    for readonly in (False, True):  # before: every chunk of 'a' stale, read-only refused
        pipe = insitu_pipeline(
            store, manifest, {"x": x}, batch_size=2, coords=(),
            cache_dir=tmp_path / "c", persist=True, readonly_cache=readonly,
        )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="insitubatch_nodes"):
            for batch in pipe:
                for row, (i, (oy, ox)) in enumerate(
                    zip(batch.sample_indices["x"], batch.patch_origins["x"], strict=True)
                ):
                    a = ds.a.isel(time=i, level=[0, 3]).values[:, oy : oy + 1, ox : ox + 2]
                    b = ds.b.isel(time=i).values[oy : oy + 1, ox : ox + 2]
                    assert np.array_equal(batch.arrays["x"][row], np.concatenate([a, b[None]]))
        pipe.close()
    assert not [r for r in caplog.records if "stale" in r.getMessage()]


def test_sel_of_a_value_repeated_in_the_coordinate_keeps_every_match_as_xarray(
    store: Path,
) -> None:
    g = open_geometries(store)
    a = g["a"].isel(lat=[1, 0, 1])  # the coordinate of the view: [-10, 10, -10]
    ds = xr.open_zarr(store, consolidated=False)
    want = ds.a.isel(lat=[1, 0, 1]).sel(lat=-10.0)  # xarray keeps both matches and the axis
    view = a.sel(lat=-10.0)
    assert view.inner_shape == want.shape[1:]  # was (4, 4): the first match, the axis dropped
    pipe = insitu_pipeline(store, split_by_chunk(g["b"], (1.0, 0.0, 0.0)), {"x": view},
                           batch_size=3, coords=())  # fmt: skip
    for batch in pipe:
        expected = want.isel(time=batch.sample_indices["x"]).values
        assert np.array_equal(batch.arrays["x"], expected)
    pipe.close()
    with pytest.raises(ValueError, match=r"-10.0 is repeated in coordinate 'lat'.*isel\(lat="):
        a.sel(lat=[-10.0, 10.0])  # xarray refuses a list on repeated values; was the first


def test_a_mask_of_the_coordinate_as_xarray_gives_it_and_a_0d_index_select_as_in_xarray(
    store: Path,
) -> None:
    a = open_geometries(store)["a"]
    da = xr.open_zarr(store, consolidated=False).a
    deep = da.level >= 500  # an xarray DataArray, as `ds.level >= 500` gives it
    cases = [("sel", {"level": deep}), ("isel", {"level": deep}),  # sel: KeyError True
             ("isel", {"level": np.array(2)}), ("isel", {"lat": np.array(-1)})]  # fmt: skip
    for method, key in cases:  # before: sel's mask a KeyError, a 0-d index a TypeError
        want = getattr(da, method)(**key)
        assert getattr(a, method)(**key).inner_shape == want.shape[1:], (method, key)


def test_a_negative_step_slice_that_selects_nothing_names_the_slice_given_and_its_fix(
    store: Path,
) -> None:
    a = open_geometries(store)["a"]  # levels 1000 ... 250, descending
    with pytest.raises(IndexError) as caught:
        a.sel(level=slice(850, 250, -1))  # xarray: nothing; a negative step wants 250 ... 850
    message = str(caught.value)
    assert "slice(850, 250, -1)" in message  # was slice(250, 850, None), not what was given
    assert "slice(250, 850, -1)" in message  # the fix (was: give the ends in that order)
    assert a.sel(level=slice(250, 850, -1)).inner_shape[0] == 3


def test_sel_on_a_lead_time_axis_compares_durations_as_xarray_decodes_them(
    tmp_path: Path,
) -> None:
    """A forecast's ``step`` coordinate: xarray writes durations as numbers of ``units`` with
    a ``dtype: timedelta64[...]`` attribute, and decodes them back to durations."""
    ds = xr.Dataset(
        {"f": (("time", "step", "lat"), np.arange(6 * 4 * 2, dtype="float32").reshape(6, 4, 2))},
        coords={"time": pd.date_range("2020-01-01", periods=6, freq="6h"),
                "step": pd.to_timedelta([0, 6, 12, 24], unit="h"), "lat": [1.0, 2.0]},
    )  # fmt: skip
    ds.to_zarr(tmp_path / "f.zarr", consolidated=False, zarr_format=3)
    f = open_geometries(tmp_path / "f.zarr")["f"]
    da = xr.open_zarr(tmp_path / "f.zarr", consolidated=False).f
    assert np.array_equal(f.coordinates(f, "step"), da.step.values)  # was [0, 6, 12, 24]
    for key in (np.timedelta64(6, "h"), np.timedelta64(360, "m"), "12h", pd.Timedelta("1D"),
                ["6h", "24h"], slice("6h", "12h")):  # fmt: skip
        assert f.sel(step=key).inner_shape == da.sel(step=key).shape[1:], key  # was KeyError
    for wrong in (np.timedelta64(6, "m"), np.timedelta64(6, "D")):  # was the 6 h step, silently
        with pytest.raises(KeyError, match="is not a value of coordinate 'step'"):
            f.sel(step=wrong)


def test_an_empty_selection_is_refused_saying_what_a_view_keeps(store: Path) -> None:
    a = open_geometries(store)["a"]  # xarray gives an axis of length 0, which no batch can use
    for key in ([], slice(2, 2), np.array([], dtype=int), np.zeros(4, dtype=bool)):
        with pytest.raises(IndexError, match=r"selects nothing.*at least one index.*an int"):
            a.isel(level=key)  # was "selects nothing along an axis of 4", and no way on


def test_a_label_slice_of_a_coordinate_a_list_unsorted_runs_between_its_ends_as_xarray(
    store: Path,
) -> None:
    """pandas' rule for a slice of an unsorted index (xarray's ``sel``): from the position of
    the first end to that of the second, both included; an end the coordinate lacks, or
    repeats apart, is a ``KeyError``."""
    g = open_geometries(store)
    da = xr.open_zarr(store, consolidated=False).a
    picks = {"unsorted": [2, 0, 3, 1], "a run": [2, 2, 0, 3], "repeated apart": [2, 0, 2, 1]}
    slices = [slice(1000, 250), slice(500, 850), slice(None, 250), slice(1000, None),
              slice(500, 850, 2), slice(850, 1000, -1), slice(250, None, -1),
              slice(1000, 300), slice(300, 850), slice(500, 250), slice(1000, 850)]  # fmt: skip
    views, wanted = {}, {}
    for pick, positions in picks.items():
        for key in slices:
            try:
                want = da.isel(level=positions).sel(level=key)
            except KeyError:  # an end absent (or repeated apart): refused saying what to do
                with pytest.raises(KeyError, match=r"slice.*(not a value|repeated).*give"):
                    g["a"].isel(level=positions).sel(level=key)
                continue
            view = g["a"].isel(level=positions).sel(level=key)  # before: refused, not sorted
            assert view.inner_shape == want.shape[1:], (pick, key)
            views[f"{pick} {key}"], wanted[f"{pick} {key}"] = view, want
    assert len(views) == 17  # (the cases xarray takes)
    with pytest.raises(IndexError, match=r"selects nothing.*not sorted.*slice\(1000, 250, None\)"):
        g["a"].isel(level=[2, 0, 3, 1]).sel(level=slice(250, 1000))  # xarray: nothing
    pipe = insitu_pipeline(store, split_by_chunk(g["b"], (1.0, 0.0, 0.0)), views,
                           batch_size=3, coords=())  # fmt: skip
    for batch in pipe:
        for label, want in wanted.items():
            expected = want.isel(time=batch.sample_indices[label]).values
            assert np.array_equal(batch.arrays[label], expected), label
    pipe.close()


def test_a_sample_axis_of_durations_splits_strides_and_windows_by_value_as_xarray_reads_it(
    tmp_path: Path,
) -> None:
    """A forecast sampled along its lead time (xarray writes durations: ``units: hours``, no
    ``since``, a ``dtype: timedelta64[...]`` attribute): splits by a window of durations,
    a stride, ``missing=`` and window offsets in durations count from lead time 0."""
    lead = pd.to_timedelta(np.arange(16) * 3, unit="h")  # 0, 3, ..., 45 hours
    ds = xr.Dataset({"f": (("lead_time", "lat"), np.arange(32, dtype="float32").reshape(16, 2))},
                    coords={"lead_time": lead, "lat": [1.0, 2.0]})  # fmt: skip
    ds.to_zarr(tmp_path / "f.zarr", encoding={"f": {"chunks": (4, 2)}}, zarr_format=3,
               consolidated=False)  # fmt: skip
    da = xr.open_zarr(tmp_path / "f.zarr", consolidated=False).f
    values = da.lead_time.values  # xarray's durations
    f = open_geometries(tmp_path / "f.zarr")["f"]
    coord = open_coordinates(tmp_path / "f.zarr", f)["lead_time"]
    for lo, hi in ((np.timedelta64(6, "h"), np.timedelta64(30, "h")), ("6h", "1D"),
                   (pd.Timedelta("7h"), pd.Timedelta("45h"))):  # fmt: skip
        inside = np.flatnonzero((values >= pd.Timedelta(lo)) & (values < pd.Timedelta(hi)))
        want = (int(inside[0]), int(inside[-1]) + 1)  # before: TypeError, "needs numbers"
        assert coord.index_range(lo, hi) == want, (lo, hi)
        split = split_by_chunk(f, (1.0, 0.0, 0.0), sample_range=(lo, hi), coord=coord)
        assert split.sample_range == want
    # every 6 hours of lead time but 12 h, with the step 3 h ahead; before: "no CF time"
    pipe = insitu_pipeline(
        tmp_path / "f.zarr", split_by_chunk(f, (1.0, 0.0, 0.0)),
        {"x": f, "y": f.window(["0h", "3h"])}, batch_size=4, shuffle=False,
        stride=np.timedelta64(6, "h"), missing=[np.timedelta64(12, "h")],
    )  # fmt: skip
    on = (values % np.timedelta64(6, "h") == np.timedelta64(0)) & (values != values[4])
    anchors = np.flatnonzero(on[:-1])  # the last lead time has no step 3 h ahead
    seen = []
    for batch in pipe:
        i = batch.sample_indices["x"]
        seen += i.tolist()
        assert np.array_equal(batch.arrays["x"], da.isel(lead_time=i).values)
        assert np.array_equal(batch.arrays["y"][:, 1], da.isel(lead_time=i + 1).values)
        assert np.array_equal(batch.coords["x"]["lead_time"], values[i])
    pipe.close()
    assert seen == anchors.tolist()
