"""A second trial of collections (2026-12-07): members of one name, patched ensemble stacks,
anemoi-datasets' single-array layout, members chunked otherwise over two ranks. zarr's and
numpy's read of the member and index a batch names are the oracles.

Found, and fixed:

* two collections of seven stores or more that differ in a store other than the first three
  and the last three took one name (a routing store's repr, which the name digested, leaves
  the middle stores out): statistics fitted on one were loaded for the other without a word;
* a stack with ``ensemble=`` of patched members was refused ("not supported"); allowed, its
  static member's window was not broadcast along the ensemble axis (a ``ValueError`` from
  numpy in the batch transform);
* anemoi-datasets' converted store (one ``data (time, variable, ensemble, cell)``, the
  variable names in the group's ``variables``, the times in ``dates``): ``sel(variable="2t")``
  raised ``KeyError`` (no coordinate array), a time stride said the array had no time
  coordinate, and ``Forcings(view=...)`` refused its points ("latitudes ... got nan ... nan",
  or "computed at other points ... [nan, 50.0, ...] where the field is at [nan, 50.0, ...]"):
  its ``latitudes``/``longitudes`` are zarr v2 arrays of fill value 0, which masked every
  point at 0 degrees as missing; ``concat`` of two such stores was refused ("no time
  coordinate 'time' beside 'data'").

Tried and found right: members in stores of one name (``data.zarr``) in two folders, and the
well ``A/1`` of two plates, each row its own member's values, times and Forcings; patched
stacks of members as channels; every (member, sample) once per epoch over two ranks with
variables chunked 1 and 4 samples per chunk, shuffled, and a state taken after any batch
resuming bit-exact on each rank; members of one variable chunked otherwise refused by name; an
ensemble stack of anemoi's ``(variable, ensemble)`` order refused, saying to give it as a
label of its own (allowed since: tests/test_anemoiens_trial.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

from insitubatch_nodes import (
    Collection,
    Forcings,
    Loader,
    concat,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    split_by_member,
    stack,
)
from insitubatch_nodes.forcings import cos_solar_zenith
from insitubatch_nodes.statistics import Statistics, fit_statistics

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("collections2_trial")]


def _quiet_to_zarr(ds: xr.Dataset, path: Path, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds.to_zarr(path, zarr_format=3, consolidated=False, **kw)


# -- 1. members of one name ------------------------------------------------------------------


def _stores(root: Path, n: int) -> list[str]:
    """``n`` stores ``d{k}/data.zarr``, each one array of 4 steps chunked 2, valued ``k``."""
    out = []
    for k in range(n):
        path = root / f"d{k}" / "data.zarr"
        arr = zarr.create_array(
            path, shape=(4, 2), chunks=(2, 2), dtype="f4", dimension_names=("t", "x")
        )
        arr[:] = k
        out.append(str(path))
    return out


def test_collections_of_seven_stores_other_in_a_middle_one_are_two_datasets(
    tmp_path: Path,
) -> None:
    paths = _stores(tmp_path, 8)
    a = Collection.from_arrays(paths[:7], sample_axis="t")
    b = Collection.from_arrays([*paths[:3], paths[7], *paths[4:7]], sample_axis="t")
    assert a.name != b.name  # (one name before: the store's repr left d3 and d7 out)
    stats = fit_statistics(a, split_by_member(a, {"train": 1.0}), {"x": a["data"]})
    assert stats.mean["x"] == pytest.approx(3.0)
    stats.save(tmp_path / "a.json")
    given = {"store": b, "manifest": split_by_member(b, {"train": 1.0}), "views": {"x": b["data"]}}
    with pytest.raises(ValueError, match="fitted on another dataset"):
        Statistics.load(tmp_path / "a.json", dataset=given)  # (accepted before: mean 3, not 3.57)
    Statistics.load(
        tmp_path / "a.json",
        dataset={
            **given,
            "store": a,
            "views": {"x": a["data"]},
            "manifest": split_by_member(a, {"train": 1.0}),
        },
    )


def test_scenes_in_stores_of_one_name_give_each_row_its_own_values_times_and_places(
    tmp_path: Path,
) -> None:
    places = {
        "d0": ("2021-06-21T00", np.linspace(44, 48, 3), np.linspace(6, 14, 4)),
        "d1": ("2021-01-03T06", np.linspace(-40, -44, 3), np.linspace(144, 148, 4)),
    }
    truth, stores = [], []
    for k, (folder, (t0, lat, lon)) in enumerate(places.items()):
        times = pd.date_range(t0, periods=6 + 2 * k, freq="3h")
        values = np.arange(len(times) * 12, dtype="f4").reshape(-1, 3, 4) + 1000 * k
        ds = xr.Dataset(
            {"t2m": (("time", "lat", "lon"), values)},
            coords={"time": times, "lat": lat, "lon": lon},
        )
        _quiet_to_zarr(ds, tmp_path / folder / "data.zarr", encoding={"t2m": {"chunks": (2, 3, 4)}})
        truth.append((times.values, values, lat, lon))
        stores.append((str(tmp_path / folder / "data.zarr"), "t2m"))
    with pytest.raises(ValueError, match="give names="):
        Collection.from_groups(None, stores, {"t2m": ""}, sample_axis="time")
    coll = Collection.from_arrays(stores, names=["data.zarr", "data.zarr (2)"], sample_axis="time")
    sun = Forcings("x", view=coll["data"], names=["cos_solar_zenith"])
    view = coll["data"].window([-1, 0])
    seen = []
    with insitu_pipeline(
        coll,
        split_by_member(coll, {"train": 1.0}),
        {"x": view},
        coords=["time"],
        batch_size=4,
        batch_transforms=[sun],
    ) as pipe:
        for batch in Loader(pipe):
            for r in range(len(batch)):
                m, idx = int(batch.members["x"][r]), batch.sample_indices["x"][r]
                times, values, lat, lon = truth[m]
                np.testing.assert_array_equal(batch["x"][r], values[idx])
                assert (batch.coords["x"]["time"][r] == times[idx]).all()
                want = np.stack([cos_solar_zenith(t, lat, lon) for t in times[idx]])  # per step
                np.testing.assert_allclose(batch["cos_solar_zenith"][r], want, atol=1e-5)
                seen.append((m, int(idx[-1])))
    assert sorted(seen) == [(0, i) for i in range(1, 6)] + [(1, i) for i in range(1, 8)]


def test_the_same_well_of_two_plates_reads_each_plate_s_field(tmp_path: Path) -> None:
    from insitubatch_nodes.synthetic import make_hcs_plate

    plates = [
        make_hcs_plate(
            str(tmp_path / f"run{k}" / "plate.zarr"),
            rows=1,
            columns=1,
            fields=1,
            shape=(1, 1, 4, 16, 16),
            levels=1,
            labels=(),
            seed=k,
            ngff_version="0.5",
        )
        for k in range(2)
    ]
    groups = [(p, "A/1/0") for p in plates]
    coll = Collection.from_groups(
        None,
        groups,
        {"image": "s0"},
        names=["run0/A/1/0", "run1/A/1/0"],
        keys={"well": ["A/1", "A/1"]},
        sample_axis=2,
    )
    whole = [zarr.open_array(p, path="A/1/0/s0", mode="r")[...] for p in plates]
    assert not np.array_equal(whole[0], whole[1])
    seen = []
    with insitu_pipeline(
        coll, split_by_member(coll, {"train": 1.0}), {"x": coll["image"]}, batch_size=3
    ) as pipe:
        for batch in Loader(pipe):
            for r in range(len(batch)):
                m, z = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                np.testing.assert_array_equal(batch["x"][r], whole[m][:, :, z])
                seen.append((m, z))
    assert sorted(seen) == [(m, z) for m in range(2) for z in range(4)]


# -- 2. patched ensemble stacks ---------------------------------------------------------------

LAT, LON = [60.0, 20.0, -20.0, -60.0], list(np.arange(0.0, 360.0, 60.0))
PATCH = {"lat": 2, "lon": 3}


@pytest.fixture(scope="module")
def ens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    """``t (time, member, level, lat, lon)``, ``2t (time, member, lat, lon)`` (members 100
    apart, so a mixed-up member shows) and a static ``lsm``; tiles of 2 x 3 points."""
    times = pd.date_range("2020-01-01", periods=12, freq="6h")
    rng = np.random.default_rng(3)
    member = 100.0 * np.arange(3)[None, :, None, None, None]
    t = 250 + member + 10.0 * np.arange(2)[None, None, :, None, None]
    t = t + rng.normal(0, 1, (12, 3, 2, 4, 6))
    t2 = 280 + member[:, :, 0] + rng.normal(0, 2, (12, 3, 4, 6))
    ds = xr.Dataset(
        {
            "t": (("time", "member", "level", "lat", "lon"), t.astype("f4")),
            "2t": (("time", "member", "lat", "lon"), t2.astype("f4")),
            "lsm": (("lat", "lon"), rng.random((4, 6)).astype("f4")),
        },
        coords={"time": times, "member": [1, 2, 3], "level": [850, 500], "lat": LAT, "lon": LON},
    )
    root = tmp_path_factory.mktemp("ens") / "ens.zarr"
    _quiet_to_zarr(
        ds, root, encoding={"t": {"chunks": (4, 3, 2, 2, 3)}, "2t": {"chunks": (4, 3, 4, 6)}}
    )
    return root, ds


def _window(ds: xr.Dataset, i: Any, y0: int, x0: int, levels: bool = True) -> np.ndarray:
    """numpy's ``([T,] E, C, 2, 3)`` window at ``(y0, x0)`` of samples ``i``: t@850, t@500,
    2t, lsm."""
    box = (slice(y0, y0 + 2), slice(x0, x0 + 3))
    t = ds.t.values[i][..., box[0], box[1]]  # ([T,] E, L, 2, 3)
    t2 = ds["2t"].values[i][..., None, box[0], box[1]]
    lsm = np.broadcast_to(ds.lsm.values[box], (*t2.shape[:-3], 1, 2, 3))
    return np.concatenate([t, t2, lsm] if levels else [t2, lsm], axis=-3)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("windowed", [False, True])
def test_an_ensemble_stack_of_patched_members_holds_every_member_s_window(
    ens: tuple[Path, xr.Dataset], layout: str, windowed: bool
) -> None:
    root, ds = ens
    g = open_geometries(root)

    def view(name: str) -> Any:
        v = g[name].window([-1, 0]) if windowed else g[name]
        return v.patches(PATCH)

    x = stack({"t": view("t"), "2t": view("2t"), "lsm": g["lsm"]}, ensemble="member", layout=layout)
    assert x.channels == ("t@850", "t@500", "2t", "lsm") and x.ensemble == (1, 2, 3)
    seen = set()
    with insitu_pipeline(
        root, split_by_chunk(g["2t"], (1.0, 0.0, 0.0)), {"x": x}, batch_size=5, seed=1
    ) as pipe:
        for batch in Loader(pipe):
            for r in range(len(batch)):
                i = batch.sample_indices["x"][r]
                y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                got = batch["x"][r]
                if layout == "channels_last":
                    got = np.moveaxis(got, -1, -3)
                np.testing.assert_array_equal(got, _window(ds, i, y0, x0))
                seen.add((int(np.ravel(i)[-1]), y0, x0))
    first = 1 if windowed else 0
    assert seen == {(i, y, x) for i in range(first, 12) for y in (0, 2) for x in (0, 3)}


def test_a_patched_ensemble_stack_of_a_collection_standardised_per_member_with_forcings(
    ens: tuple[Path, xr.Dataset], tmp_path: Path
) -> None:
    root, ds = ens
    other = ds.assign_coords(time=ds.time + pd.Timedelta("7D"))
    other = other.assign({"2t": other["2t"] + 1000.0})
    _quiet_to_zarr(other[["2t"]], tmp_path / "b.zarr", encoding={"2t": {"chunks": (4, 3, 4, 6)}})
    coll = Collection.from_arrays(
        [(str(root), "2t"), (str(tmp_path / "b.zarr"), "2t")], names=["a", "b"], sample_axis="time"
    )
    manifest = split_by_member(coll, {"train": 1.0})
    picked = coll["data"].sel(member=[3, 1])
    stats = fit_statistics(coll, manifest, {"2t": picked})  # per member: (E,)
    v = picked.patches(PATCH)
    sun = Forcings("x", view=v, names=["cos_solar_zenith"])
    x = stack({"2t": v, "sun": sun}, ensemble="member", normalize=stats)
    mean, std = stats.mean["2t"], stats.std["2t"]
    with insitu_pipeline(coll, manifest, {"x": x}, batch_size=5, coords=["time"]) as pipe:
        n = 0
        for batch in Loader(pipe):
            for r in range(len(batch)):
                m, i = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                member = (ds, other)[m]["2t"].values[i][[2, 0], y0 : y0 + 2, x0 : x0 + 3]
                want = (member - mean[:, None, None]) / std[:, None, None]
                np.testing.assert_allclose(batch["x"][r][:, 0], want, rtol=1e-5, atol=1e-5)
                time = batch.coords["x"]["time"][r]
                sunlit = cos_solar_zenith(time, np.array(LAT[y0 : y0 + 2]), LON[x0 : x0 + 3])
                for e in range(2):  # the same for every ensemble member, never standardised
                    np.testing.assert_allclose(batch["x"][r][e, 1], sunlit, atol=1e-5)
                n += 1
    assert n == 2 * 12 * 4


def test_a_patched_ensemble_stack_resumes_bit_exact_mid_epoch(ens: tuple[Path, xr.Dataset]) -> None:
    root, _ = ens
    g = open_geometries(root)
    x = stack({"2t": g["2t"].patches(PATCH, origins="random"), "lsm": g["lsm"]}, ensemble="member")
    manifest = split_by_chunk(g["2t"], (1.0, 0.0, 0.0))

    def records(state: Any = None, stop: int | None = None) -> tuple[list[Any], Any]:
        out: list[Any] = []
        with insitu_pipeline(root, manifest, {"x": x}, batch_size=5, seed=4) as pipe:
            loader = Loader(pipe)
            if state is not None:
                loader.load_state_dict(state)
            for _ in range(2 if state is None else 1):
                for batch in loader:
                    out.append(
                        (batch.epoch, batch["x"].tobytes(), batch.patch_origins["x"].tolist())
                    )
                    if stop is not None and len(out) == stop:
                        return out, loader.state_dict()
        return out, None

    ref, _ = records()
    per_epoch = len(ref) // 2
    head, state = records(stop=4)
    rest, _ = records(state)
    assert head + rest == ref[:per_epoch]


def test_patched_stacks_of_members_as_channels_hold_numpy_s_windows(
    ens: tuple[Path, xr.Dataset],
) -> None:
    root, ds = ens
    g = open_geometries(root)
    x = stack(
        {
            "t": g["t"].sel(member=[3, 1], level=500).patches(PATCH),
            "2t": g["2t"].sel(member=[3, 1]).patches(PATCH),
            "lsm": g["lsm"],
        }
    )
    assert x.channels == ("t@3", "t@1", "2t@3", "2t@1", "lsm")
    with insitu_pipeline(
        root, split_by_chunk(g["2t"], (1.0, 0.0, 0.0)), {"x": x}, batch_size=7
    ) as pipe:
        for batch in Loader(pipe):
            for r in range(len(batch)):
                i = int(batch.sample_indices["x"][r])
                y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                box = (slice(y0, y0 + 2), slice(x0, x0 + 3))
                want = np.concatenate(
                    [
                        ds.t.values[i][[2, 0], 1][:, box[0], box[1]],
                        ds["2t"].values[i][[2, 0]][:, box[0], box[1]],
                        ds.lsm.values[None, box[0], box[1]],
                    ]
                )
                np.testing.assert_array_equal(batch["x"][r], want)


def test_an_ensemble_stack_patched_along_the_members_is_refused_by_name(
    ens: tuple[Path, xr.Dataset],
) -> None:
    g = open_geometries(ens[0])
    with pytest.raises(ValueError, match="'2t' is patched along 'member'"):
        stack({"2t": g["2t"].patches({"member": 2, "lat": 2})}, ensemble="member")


# -- 3. anemoi-datasets' single array ---------------------------------------------------------

NAMES = ["10u", "2t", "lsm", "t_500", "t_850"]


def _write_anemoi(root: Path, start: str, nt: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A store laid out as ``anemoi-datasets create`` writes it (zarr v2): ``data (time,
    variable, ensemble, cell)`` chunked one date a chunk, ``dates`` in ``datetime64[s]`` from
    ``start`` every 6 hours, ``latitudes``/``longitudes (cell)`` with zarr's default fill value
    0 (points at 0 degrees among them), the names in the root's ``variables`` and
    ``name_to_index``. Returns ``(data, dates)``."""
    nv, ne, nc = len(NAMES), 2, 7
    dates = np.datetime64(start, "s") + np.arange(nt) * np.timedelta64(6, "h")
    rng = np.random.default_rng(seed)
    data = (rng.normal(size=(nt, nv, ne, nc)) + 10 * np.arange(nv)[:, None, None]).astype("f4")
    group = zarr.open_group(root, mode="w", zarr_format=2)
    arr = group.create_array(
        "data", shape=data.shape, chunks=(1, nv, ne, nc), dtype="f4", fill_value=np.nan
    )
    arr[:] = data
    arr.attrs["_ARRAY_DIMENSIONS"] = ["time", "variable", "ensemble", "cell"]
    times = group.create_array("dates", shape=(nt,), chunks=(nt,), dtype="<M8[s]")
    times[:] = dates
    times.attrs["_ARRAY_DIMENSIONS"] = ["time"]
    for name, values in (
        ("latitudes", [-60, -40, -20, 0, 20, 40, 60]),
        ("longitudes", [0, 50, 100, 150, 200, 250, 300]),
    ):
        place = group.create_array(name, shape=(nc,), chunks=(nc,), dtype="f8", fill_value=0.0)
        place[:] = values
        place.attrs["_ARRAY_DIMENSIONS"] = ["cell"]
    group.attrs.update(
        {
            "variables": NAMES,
            "name_to_index": {n: i for i, n in enumerate(NAMES)},
            "frequency": "6h",
            "ensemble_dimension": ne,
        }
    )
    return data, dates


@pytest.fixture(scope="module")
def anemoi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    """One anemoi store of 12 dates from 2020-01-01 (:func:`_write_anemoi`)."""
    root = tmp_path_factory.mktemp("anemoi") / "anemoi.zarr"
    return (root, *_write_anemoi(root, "2020-01-01T00", 12))


def test_anemoi_s_single_array_is_read_as_channels_by_name_at_its_dates(
    anemoi: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    root, data, dates = anemoi
    g = open_geometries(root)["data"]
    picked = ["t_850", "2t"]
    x = stack({"data": g.sel(variable=picked).isel(ensemble=0).window([-1, 0])})
    assert x.channels == ("data@t_850", "data@2t")  # (KeyError before: no coordinate array)
    index = [NAMES.index(n) for n in picked]
    anchors = []
    with insitu_pipeline(
        root,
        split_by_chunk(g, (1.0, 0.0, 0.0)),
        {"x": x},
        stride="12h",
        missing=[np.datetime64("2020-01-02T06")],
        batch_size=4,
    ) as pipe:
        for batch in Loader(pipe):
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"], data[idx][:, :, index, 0])
            np.testing.assert_array_equal(batch.coords["x"]["dates"], dates[idx])
            anchors += list(dates[idx[:, 1]])
    want = [d for d in dates[1:] if d.astype("datetime64[h]").astype(int) % 12 == 0]
    want = [
        d for d in want if np.datetime64("2020-01-02T06") not in (d, d - np.timedelta64(6, "h"))
    ]
    assert sorted(anchors) == want


def test_forcings_on_anemoi_s_points_take_the_points_at_zero_degrees(
    anemoi: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    root, _, dates = anemoi
    g = open_geometries(root)["data"]
    lat = zarr.open_array(root, path="latitudes", mode="r")[...]
    lon = zarr.open_array(root, path="longitudes", mode="r")[...]
    sun = Forcings("x", view=g, time_name="dates", names=["cos_solar_zenith"])  # (refused before)
    with insitu_pipeline(
        root,
        split_by_chunk(g, (1.0, 0.0, 0.0)),
        {"x": g.sel(variable=["2t"])},
        batch_size=6,
        batch_transforms=[sun],
    ) as pipe:
        for batch in Loader(pipe):
            for r, i in enumerate(batch.sample_indices["x"]):
                want = np.diag(cos_solar_zenith(dates[i], lat, lon))  # (each point's own)
                np.testing.assert_allclose(batch["cos_solar_zenith"][r], want, atol=1e-6)


def test_two_anemoi_stores_concatenate_along_their_dates(tmp_path: Path) -> None:
    # concat found the time coordinate by the dimension's name only ("'y1.zarr' has no time
    # coordinate 'time' beside 'data'"), where anemoi names it `dates`
    parts = [_write_anemoi(tmp_path / f"y{k}.zarr", t0, 6, seed=k)
             for k, t0 in enumerate(["2020-01-01T00", "2020-01-02T12"])]  # fmt: skip
    data, dates = (np.concatenate(x) for x in zip(*parts, strict=True))
    archive = concat([str(tmp_path / "y0.zarr"), str(tmp_path / "y1.zarr")], ["data"])
    view = archive["data"].sel(variable=["2t"]).window([-1, 0])
    seen = []
    with insitu_pipeline(archive, split_by_chunk(archive["data"], (1.0, 0.0, 0.0)), {"x": view},
                         stride="12h", coords=["dates"], batch_size=4) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"][:, :, 0], data[idx][:, :, 1])
            np.testing.assert_array_equal(batch.coords["x"]["dates"], dates[idx])
            seen += [int(i) for i in idx[:, 1]]
    assert sorted(seen) == [2, 4, 6, 8, 10]  # every 12 hours, across the stores' edge (5 | 6)


def test_an_ensemble_stack_of_anemoi_s_variable_before_ensemble_order_keeps_the_members(
    anemoi: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    # refused until 2026-12-07 (tests/test_anemoiens_trial.py): rows ([T,] E, C, cell) now
    g = open_geometries(anemoi[0])["data"]
    x = stack({"x": g.isel(variable=[1, 4])}, ensemble="ensemble")
    assert x.row_shape == (2, 2, 7) and x.channels == ("x@2t", "x@t_850")


# -- 4. members chunked otherwise, two ranks, resume ------------------------------------------

LENGTHS = [7, 9, 5, 6]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Collection, dict[Any, np.ndarray]]:
    """Members ``m0..m3`` of a group: ``a`` chunked one sample a chunk, ``b`` four (and 2 x 2
    tiles of the field), values distinct per member, variable, sample and point."""
    root = tmp_path_factory.mktemp("mixed") / "plate.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = {}
    for m, n in enumerate(LENGTHS):
        for var, spc, base in (("a", 1, 0), ("b", 4, 500)):
            arr = group.create_array(
                f"m{m}/{var}",
                shape=(n, 2, 4),
                chunks=(spc, 2, 2),
                dtype="f4",
                dimension_names=("z", "y", "x"),
            )
            arr[:] = np.arange(n * 8, dtype="f4").reshape(n, 2, 4) + 1000 * m + base
            data[m, var] = arr[...]
    coll = Collection.from_groups(
        root, [f"m{m}" for m in range(4)], {"a": "a", "b": "b"}, sample_axis="z"
    )
    return coll, data


def test_members_of_one_variable_chunked_otherwise_are_refused_by_name(tmp_path: Path) -> None:
    group = zarr.open_group(tmp_path / "p.zarr", mode="w", zarr_format=3)
    for m, spc in enumerate((1, 4)):
        group.create_array(
            f"m{m}/img", shape=(8, 2), chunks=(spc, 2), dtype="f4", dimension_names=("z", "x")
        )
    with pytest.raises(ValueError, match=r"member 'm1', variable 'img'.*chunk shape"):
        Collection.from_groups(tmp_path / "p.zarr", ["m0", "m1"], {"img": "img"}, sample_axis="z")


@pytest.mark.parametrize(("kind", "remainder"), [("plain", "pad"), ("window", "drop")])
def test_variables_chunked_one_and_four_deal_each_sample_once_over_two_ranks_and_resume(
    mixed: tuple[Collection, dict[Any, np.ndarray]], kind: str, remainder: str
) -> None:
    coll, data = mixed
    views = (
        {"a": coll["a"], "b": coll["b"]}
        if kind == "plain"
        else {"a": coll["a"].window([-1, 0]), "b": coll["b"].shift(1)}
    )
    manifest = split_by_member(coll, {"train": 1.0})

    def run(rank: int, state: Any = None, stop: int | None = None) -> tuple[list[Any], Any]:
        out: list[Any] = []
        with insitu_pipeline(
            coll,
            manifest,
            views,
            batch_size=3,
            seed=5,
            rank=rank,
            world_size=2,
            remainder=remainder,
        ) as pipe:
            loader = Loader(pipe)
            if state is not None:
                loader.load_state_dict(state)
            for _ in range(2 if state is None else 1):
                for batch in loader:
                    rows = []
                    for r in range(len(batch)):
                        m = int(batch.members["a"][r])
                        assert int(batch.members["b"][r]) == m
                        ia, ib = batch.sample_indices["a"][r], batch.sample_indices["b"][r]
                        np.testing.assert_array_equal(batch["a"][r], data[m, "a"][ia])
                        np.testing.assert_array_equal(batch["b"][r], data[m, "b"][ib])
                        rows.append((m, int(ib)))
                    out.append((batch.epoch, tuple(rows), batch["a"].tobytes()))
                    if stop is not None and len(out) == stop:
                        return out, loader.state_dict()
        return out, None

    refs = [run(rank)[0] for rank in (0, 1)]
    valid = (
        [(m, i) for m, n in enumerate(LENGTHS) for i in range(n)]
        if kind == "plain"
        else [(m, i) for m, n in enumerate(LENGTHS) for i in range(2, n)]  # (b: shift 1)
    )
    for epoch in (0, 1):
        rows = [row for ref in refs for e, rs, _ in ref if e == epoch for row in rs]
        if remainder == "pad":  # every sample, one of them twice (the pad)
            assert set(rows) == set(valid) and len(rows) == len(valid) + 1
        else:  # one sample left out at most, none twice
            assert len(set(rows)) == len(rows) >= len(valid) - 1 and set(rows) <= set(valid)
        assert len({len([1 for e, *_ in ref if e == epoch]) for ref in refs}) == 1
    assert [rs for e, rs, _ in refs[0] if e == 0] != [rs for e, rs, _ in refs[0] if e == 1]
    for rank, ref in enumerate(refs):
        per_epoch = len(ref) // 2
        for k in (1, per_epoch - 1):
            head, state = run(rank, stop=k)
            rest, _ = run(rank, state)
            assert head + rest == ref[:per_epoch], f"rank {rank} resumed after {k} batches"
