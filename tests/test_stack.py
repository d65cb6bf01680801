"""Channel stacks (issue 31): ``stack(views)`` as a label, assembled in place.

zarr and numpy are the oracle: a stack equals ``np.concatenate`` of its members (read by zarr,
selected and shifted by numpy) along the channel axis, in the order given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import (
    FetchOptions,
    Forcings,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.synthetic import make_weatherbench_like

N = 32
LEVELS = [1000, 350, 1]  # of the store's five (1000, 775, 350, 70, 1)


def _store(root: Path, spc: int = 1) -> Path:
    make_weatherbench_like(
        root, n_time=N, n_lat=6, n_lon=8, n_level=5, surface=["2m_temperature"],
        levels=["temperature", "geopotential"], samples_per_chunk=spc,
    )  # fmt: skip
    lsm = zarr.create_array(
        root / "land_sea_mask", shape=(6, 8), chunks=(6, 8), dtype="float32",
        dimension_names=("latitude", "longitude"),
    )  # fmt: skip
    lsm[...] = np.arange(48, dtype=np.float32).reshape(6, 8) / 48
    return root


def _levels(root: Path) -> list[int]:
    return [int(v) for v in zarr.open_array(root / "level")[...]]


def _oracle(root: Path, name: str, samples: np.ndarray, levels: list[int] | None) -> np.ndarray:
    """What zarr reads for member ``name`` at ``samples`` (any shape), as (..., C, H, W)."""
    data = zarr.open_array(root / name, mode="r")[...]
    out = data[samples]
    if levels is not None:
        idx = [_levels(root).index(v) for v in levels]
        out = out[..., idx, :, :]
    return out if out.ndim == samples.ndim + 3 else out[..., None, :, :]


def _members(root: Path) -> dict[str, Any]:
    g = open_geometries(root)
    return {
        "temperature": g["temperature"].sel(level=LEVELS),
        "2m_temperature": g["2m_temperature"],
        "geopotential": g["geopotential"].isel(level=[4, 0]),
    }


@pytest.mark.parametrize("spc", [1, 4])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_a_stack_equals_the_concatenation_of_its_members_in_the_order_given(
    tmp_path: Path, spc: int, layout: str
) -> None:
    root = _store(tmp_path / "s.zarr", spc)
    m = _members(root)
    g = open_geometries(root)
    views = {
        "x": stack(m, layout=layout),
        # a shifted member and a plain one: their own sample indices, the first member's
        "y": stack({"t": m["temperature"].shift(1), "t2m": g["2m_temperature"].shift(1)},
                   layout=layout),
    }  # fmt: skip
    pipe = insitu_pipeline(root, split_by_chunk(g["temperature"], (1.0, 0.0, 0.0)), views,
                           batch_size=5)  # fmt: skip
    try:
        batches = list(Loader(pipe))
        stats = pipe.stats()
    finally:
        pipe.close()
    assert sum(len(b) for b in batches) == N - 1  # the shift leaves the last anchor out
    zlev = _levels(root)
    for b in batches:
        s = b.sample_indices["x"]
        want_x = np.concatenate(
            [_oracle(root, "temperature", s, LEVELS), _oracle(root, "2m_temperature", s, None),
             _oracle(root, "geopotential", s, [zlev[4], zlev[0]])], axis=1,
        )  # fmt: skip
        want_y = np.concatenate(
            [_oracle(root, "temperature", s + 1, LEVELS),
             _oracle(root, "2m_temperature", s + 1, None)], axis=1,
        )  # fmt: skip
        if layout == "channels_last":
            want_x, want_y = np.moveaxis(want_x, 1, -1), np.moveaxis(want_y, 1, -1)
        np.testing.assert_array_equal(b["x"], want_x)
        np.testing.assert_array_equal(b["y"], want_y)
        np.testing.assert_array_equal(b.sample_indices["y"], s + 1)
    assert batches[0].channels["x"] == [
        "temperature@1000", "temperature@350", "temperature@1", "2m_temperature",
        f"geopotential@{zlev[4]}", f"geopotential@{zlev[0]}",
    ]  # fmt: skip
    assert batches[0].channels["y"] == ["t@1000", "t@350", "t@1", "t2m"]
    assert stats["misses"] > 0


def test_a_stack_of_windows_is_batch_t_channels_field_and_equals_the_members_per_step(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr", 2)
    g = open_geometries(root)
    x = stack({"t": g["temperature"].sel(level=LEVELS).window([-1, 0]),
               "t2m": g["2m_temperature"].window([-1, 0])})  # fmt: skip
    pipe = insitu_pipeline(root, split_by_chunk(g["temperature"], (1.0, 0.0, 0.0)), {"x": x},
                           batch_size=4, shuffle=True)  # fmt: skip
    try:
        batches = list(Loader(pipe))
    finally:
        pipe.close()
    assert sum(len(b) for b in batches) == N - 1
    for b in batches:
        s = b.sample_indices["x"]
        assert s.shape == (len(b), 2)
        want = np.concatenate(
            [_oracle(root, "temperature", s, LEVELS), _oracle(root, "2m_temperature", s, None)],
            axis=2,
        )
        assert b["x"].shape == (len(b), 2, 4, 6, 8)
        np.testing.assert_array_equal(b["x"], want)


def test_a_static_member_is_constant_channels_equal_to_the_static_array(tmp_path: Path) -> None:
    root = _store(tmp_path / "s.zarr", 1)
    g = open_geometries(root)
    assert g["land_sea_mask"].static
    x = stack({"t2m": g["2m_temperature"], "lsm": g["land_sea_mask"]}, layout="channels_last")
    pipe = insitu_pipeline(root, split_by_chunk(g["2m_temperature"], (1.0, 0.0, 0.0)),
                           {"x": x}, batch_size=8)  # fmt: skip
    try:
        batches = list(Loader(pipe))
    finally:
        pipe.close()
    lsm = zarr.open_array(root / "land_sea_mask")[...]
    for b in batches:
        np.testing.assert_array_equal(b["x"][..., 1], np.broadcast_to(lsm, (len(b), 6, 8)))
        np.testing.assert_array_equal(
            b["x"][..., 0], _oracle(root, "2m_temperature", b.sample_indices["x"], None)[:, 0]
        )
    assert batches[0].channels["x"] == ["t2m", "lsm"]


@pytest.mark.parametrize("spc", [1, 4])
def test_normalize_standardises_each_channel_as_the_unstacked_members_would_be(
    tmp_path: Path, spc: int
) -> None:
    root = _store(tmp_path / "s.zarr", spc)
    g = open_geometries(root)
    members = {"t": g["temperature"].sel(level=LEVELS), "t2m": g["2m_temperature"],
               "lsm": g["land_sea_mask"]}  # fmt: skip
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    stats = fit_statistics(root, manifest, members)
    x = stack(members, normalize=stats)
    pipe = insitu_pipeline(root, manifest, {"x": x}, batch_size=6)
    try:
        batches = list(Loader(pipe))
    finally:
        pipe.close()
    lsm = zarr.open_array(root / "land_sea_mask")[...][None, None]
    for b in batches:
        s = b.sample_indices["x"]
        raw = [_oracle(root, "temperature", s, LEVELS), _oracle(root, "2m_temperature", s, None),
               np.broadcast_to(lsm, (len(b), 1, 6, 8))]  # fmt: skip
        means = [np.asarray(stats.mean[k], np.float64).reshape(-1, 1, 1) for k in members]
        stds = [np.asarray(stats.std[k], np.float64).reshape(-1, 1, 1) for k in members]
        want = np.concatenate(
            [(r - m) / sd for r, m, sd in zip(raw, means, stds, strict=True)], axis=1
        )
        np.testing.assert_allclose(b["x"], want, rtol=1e-5, atol=1e-5)


def test_normalize_refuses_statistics_fitted_on_other_channels_and_takes_those_of_the_same(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr", 2)
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    fitted = {"t": g["temperature"].sel(level=[1000, 350]), "t1": g["temperature"].sel(level=1),
              "all": g["temperature"], "t2m": g["2m_temperature"]}  # fmt: skip
    stats = fit_statistics(root, manifest, fitted)
    t2m = fitted["t2m"]
    for name, member in (
        ("t", g["temperature"].sel(level=[350, 1000])),  # the levels in another order
        ("t1", g["temperature"].sel(level=1000)),  # another level, dropped
        ("all", g["temperature"].isel(level=[0, 2])),  # fewer channels
    ):
        with pytest.raises(ValueError, match=f"statistics of {name!r} were fitted"):
            stack({name: member, "t2m": t2m}, normalize=stats)
        with pytest.raises(ValueError, match=f"statistics of {name!r} were fitted"):
            stats.normalizer({name: member})
    # what they were fitted on, shifted, as a window, in a box, or selecting every level
    stack({"t": g["temperature"].sel(level=[1000, 350]).shift(1).window([0, 1]),
           "all": g["temperature"].isel(level=slice(None)).window([0, 1])},
          normalize=stats)  # fmt: skip
    stats.normalizer({"t": fitted["t"].isel(latitude=[0, 1]).shift(2)})


def test_a_mid_epoch_state_of_plain_views_or_other_statistics_is_refused_and_an_epoch_end_is_not(
    tmp_path: Path,
) -> None:
    # the rest of a resumed epoch would come with other channels or other normalisation: a
    # state of plain views restored into a level selection, and one of a stack normalised with
    # other statistics, were taken silently (a state without inputs was not checked, and the
    # statistics were not in it)
    root = _store(tmp_path / "s.zarr", 2)
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    members = {"t": g["temperature"].sel(level=LEVELS), "t2m": g["2m_temperature"]}
    stats = fit_statistics(root, manifest, members)
    other = fit_statistics(root, split_by_chunk(g["temperature"], (0.5, 0.5, 0.0)), members)
    cases = [
        ({"x": g["temperature"]}, {"x": g["temperature"].sel(level=LEVELS)}, "'x' select"),
        ({"x": stack(members, normalize=stats)}, {"x": stack(members, normalize=other)},
         "'x' is normalised with other statistics"),
        ({"x": stack(members, normalize=stats)}, {"x": stack(members)}, "other statistics"),
    ]  # fmt: skip
    for saved, restored, says in cases:
        with insitu_pipeline(root, manifest, saved, batch_size=4) as pipe:
            loader = Loader(pipe)
            it = iter(loader)
            next(it)
            middle = loader.state_dict()
            list(it)
            end = loader.state_dict()
        with insitu_pipeline(root, manifest, restored, batch_size=4) as pipe:
            loader = Loader(pipe)
            loader.load_state_dict(middle)
            with pytest.raises(ValueError, match=says):
                next(iter(loader))
            loader.load_state_dict(end)  # the next epoch runs with the pipeline's own inputs
            assert len(list(loader)) == len(pipe)


def test_members_that_disagree_on_t_or_on_the_field_are_refused_naming_the_member(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr", 1)
    g = open_geometries(root)
    with pytest.raises(ValueError, match=r"member 't2m' has a window of 3 steps.*'t' has a "):
        stack({"t": g["temperature"].window([0, 1]), "t2m": g["2m_temperature"].window([0, 1, 2])})
    with pytest.raises(ValueError, match=r"member 'box' has field shape \(3, 8\).*\(6, 8\)"):
        stack({"t2m": g["2m_temperature"], "box": g["temperature"].isel(latitude=[0, 1, 2])})
    with pytest.raises(ValueError, match="layout must be one of"):
        stack({"t2m": g["2m_temperature"]}, layout="nhwc")


def test_a_member_on_the_transposed_grid_is_refused_even_where_the_grid_is_square(
    tmp_path: Path,
) -> None:
    # (lon, lat) against (lat, lon) on a 5 x 5 grid: the shapes agree, the points do not
    group = zarr.open_group(tmp_path / "s.zarr", mode="w")
    for name, shape, dims in (("t", (4, 5, 5), ("time", "lat", "lon")),
                              ("u", (4, 5, 5), ("time", "lon", "lat")),
                              ("mask", (5, 5), ("lon", "lat"))):  # fmt: skip
        group.create_array(name, shape=shape, chunks=shape, dtype="f4", dimension_names=dims)
    g = open_geometries(tmp_path / "s.zarr", sample_axis="time")
    for name in ("u", "mask"):
        with pytest.raises(ValueError, match=rf"member {name!r} is on the grid \('lon', 'lat'\)"):
            stack({"t": g["t"], name: g[name]})
    assert stack({"t": g["t"], "t_next": g["t"].shift(1)}).channels == ("t", "t_next")


def test_a_stack_of_one_dimensional_fields_takes_its_members_in_any_order(tmp_path: Path) -> None:
    # stations: a (time, station) member and a (time, level, station) one; with the leveled
    # member first, the field was taken as (level, station) and the plain member refused
    group = zarr.open_group(tmp_path / "s.zarr", mode="w")
    for name, shape, dims in (("a", (4, 7), ("time", "station")),
                              ("b", (4, 3, 7), ("time", "level", "station"))):  # fmt: skip
        group.create_array(name, shape=shape, chunks=shape, dtype="f4", dimension_names=dims)
    g = open_geometries(tmp_path / "s.zarr")
    assert stack({"a": g["a"], "b": g["b"]}).channels == ("a", "b@0", "b@1", "b@2")
    assert stack({"b": g["b"], "a": g["a"]}).channels == ("b@0", "b@1", "b@2", "a")
    assert stack({"b": g["b"], "a": g["a"]}).row_shape == (4, 7)


def test_one_sample_per_chunk_decodes_members_straight_into_their_channels_with_no_other_memory(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr", 1)
    g = open_geometries(root)
    m = {"t": g["temperature"], "t2m": g["2m_temperature"], "z": g["geopotential"]}
    # the straight path asked for: a split this small is otherwise kept in the pool for the
    # next epoch (kept_bytes)
    fetch = FetchOptions(direct=True, prefetch_depth=1)
    pipe = insitu_pipeline(root, split_by_chunk(g["temperature"], (1.0, 0.0, 0.0)),
                           {"x": stack(m)}, batch_size=8, fetch=fetch)  # fmt: skip
    try:
        loader = Loader(pipe)
        batch_bytes, allocations = 0, 0
        for _ in range(2):
            for b in loader:
                s = b.sample_indices["x"]
                names = ("temperature", "2m_temperature", "geopotential")
                want = np.concatenate([_oracle(root, k, s, None) for k in names], axis=1)
                np.testing.assert_array_equal(b["x"], want)
                batch_bytes = b["x"].nbytes
                del b
            allocations = pipe.stages.gather.buffer_allocations
        stats = pipe.stats()
    finally:
        pipe.close()
    # one (batch, C, H, W) buffer per batch in flight: no per-member buffer, no copy after
    # (the gather's scratch, one row per member for rows out of sample order, is counted too)
    print(f"batch_buffer_bytes {stats['batch_buffer_bytes']}, {allocations} x {batch_bytes}")
    assert stats["misses_in_place"] > 0  # members decoded straight into their channels
    assert stats["batch_buffer_bytes"] <= 1.1 * allocations * batch_bytes


@pytest.mark.parametrize("window", [False, True])
def test_forcing_members_equal_the_forcings_transform_at_the_stacks_times(
    tmp_path: Path, window: bool
) -> None:
    root = _store(tmp_path / "s.zarr", 2)
    g = open_geometries(root)
    names = ["cos_solar_zenith", "year_progress_sin"]
    t2m = g["2m_temperature"].window([-1, 0]) if window else g["2m_temperature"]
    forcings = Forcings("t2m", view=g["2m_temperature"], names=names, period="6h")
    x = stack({"t2m": t2m, "sun": forcings}, layout="channels_last")
    # the oracle: the same forcings as labels, from the same rows' times
    pipe = insitu_pipeline(root, split_by_chunk(g["temperature"], (1.0, 0.0, 0.0)),
                           {"x": x, "t2m": t2m}, batch_size=4,
                           batch_transforms=[forcings])  # fmt: skip
    try:
        batches = list(Loader(pipe))
    finally:
        pipe.close()
    assert batches[0].channels["x"] == ["t2m", *names]
    for b in batches:
        np.testing.assert_array_equal(b.sample_indices["x"], b.sample_indices["t2m"])
        np.testing.assert_array_equal(b.coords["x"]["time"], b.coords["t2m"]["time"])
        np.testing.assert_array_equal(b["x"][..., 0], b["t2m"])
        for c, name in enumerate(names, start=1):
            np.testing.assert_array_equal(b["x"][..., c], b[name])


def test_a_forcing_member_on_another_grid_is_refused(tmp_path: Path) -> None:
    root = _store(tmp_path / "s.zarr", 1)
    g = open_geometries(root)
    other = Forcings("t", lat=[0.0, 10.0], lon=[0.0, 5.0, 10.0], names=["cos_solar_zenith"])
    with pytest.raises(ValueError, match=r"member 'sun' \(forcings\) is on a \(2, 3\) grid"):
        stack({"t2m": g["2m_temperature"], "sun": other})


@pytest.mark.parametrize("spc", [1, 3])
def test_a_stack_of_arrays_sampled_along_their_last_axis_equals_the_concatenation(
    tmp_path: Path, spc: int
) -> None:
    # the sample axis last, by name: "time" is axis 2 of (lat, lon, time) and axis 3 of
    # (level, lat, lon, time)
    root = tmp_path / "last.zarr"
    group = zarr.open_group(root, mode="w")
    rng = np.random.default_rng(0)
    surface = rng.random((6, 8, 24), dtype=np.float32)
    levels = rng.random((4, 6, 8, 24), dtype=np.float32)
    a = group.create_array("a", shape=surface.shape, chunks=(6, 8, spc), dtype="float32",
                           dimension_names=("lat", "lon", "time"))  # fmt: skip
    b = group.create_array("b", shape=levels.shape, chunks=(4, 6, 8, spc), dtype="float32",
                           dimension_names=("level", "lat", "lon", "time"))  # fmt: skip
    a[...], b[...] = surface, levels
    g = open_geometries(root, sample_axis="time")
    x = stack({"b": g["b"].isel(level=[3, 1]), "a": g["a"].shift(1)})
    pipe = insitu_pipeline(root, split_by_chunk(g["a"], (1.0, 0.0, 0.0)), {"x": x},
                           batch_size=5, coords=())  # fmt: skip
    try:
        batches = list(Loader(pipe))
    finally:
        pipe.close()
    assert sum(len(b) for b in batches) == 23
    for batch in batches:
        s = batch.sample_indices["x"]
        want = np.concatenate(
            [np.moveaxis(levels[[3, 1]][..., s], -1, 0),
             np.moveaxis(surface[..., s + 1], -1, 0)[:, None]], axis=1,
        )  # fmt: skip
        np.testing.assert_array_equal(batch["x"], want)
    assert batches[0].channels["x"] == ["b@3", "b@1", "a"]


def test_a_stack_of_patched_members_equals_the_members_windows_at_the_rows_origins(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr", spc=4)
    g = open_geometries(root)
    cut = {"latitude": 4, "longitude": 4}
    members = {
        "t": g["temperature"].patches(cut, origins="random"),
        "z": g["geopotential"].patches(cut, origins="random"),
        "z_next": g["geopotential"].shift(1).patches(cut, origins="random"),
    }
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": stack(members)}, batch_size=5, coords=())
    t, z = (zarr.open_array(root / n, mode="r")[...] for n in ("temperature", "geopotential"))
    rows = 0
    seen: list[int] = []
    try:
        for batch in pipe:
            x, origins = batch.arrays["x"], batch.patch_origins["x"]
            samples = batch.sample_indices["x"]
            seen += [int(s) for s in samples]
            assert x.shape == (len(batch), 15, 4, 4) and batch.channels["x"][5] == "z@1000"
            for i, (s, (oy, ox)) in enumerate(zip(samples, origins, strict=True)):
                box = (slice(oy, oy + 4), slice(ox, ox + 4))
                want = np.concatenate([t[s][:, *box], z[s][:, *box], z[s + 1][:, *box]])
                np.testing.assert_array_equal(x[i], want)
                rows += 1
    finally:
        pipe.close()
    # every anchor whose next step is in the store, each in as many windows as the others
    per_anchor = np.bincount(seen)
    assert len(per_anchor) == N - 1 and rows == per_anchor.sum() and len(set(per_anchor)) == 1


def test_patched_members_must_be_patched_alike_with_static_members_and_forcings_whole(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    cut = {"latitude": 4, "longitude": 4}
    t = g["temperature"].patches(cut)
    with pytest.raises(ValueError, match="'z' is not"):
        stack({"t": t, "z": g["geopotential"]})
    with pytest.raises(ValueError, match="patched differently"):
        stack({"t": t, "z": g["geopotential"].patches({"latitude": 4, "longitude": 4}, stride=2)})
    with pytest.raises(ValueError, match="must be whole there"):
        stack({"t": t, "lsm": g["land_sea_mask"].isel(latitude=slice(0, 4))})
    with pytest.raises(ValueError, match="without the patched dimensions"):
        stack({"t": t, "lsm": g["land_sea_mask"].isel(latitude=0)})
    sun = Forcings("x", view=g["temperature"], names=["cos_solar_zenith"])
    with pytest.raises(ValueError, match="also cut 'level'"):  # forcings have no level axis
        stack({"t": g["temperature"].patches({"level": 2, "latitude": 4}), "sun": sun})
    half = Forcings(
        "x", view=g["temperature"].isel(latitude=slice(0, 3)), names=["cos_solar_zenith"]
    )
    with pytest.raises(ValueError, match=r"\(unpatched\)"):  # the grid of the whole field
        stack({"t": t, "sun": half})


def test_a_selection_that_keeps_a_whole_axis_is_no_cut_and_a_static_member_is_windowed_there(
    tmp_path: Path,
) -> None:
    """A static member selected whole along the patched dimensions (an identity ``isel``, a
    ``sel`` of every value, in order) is cut to each row's window like an unselected one; a
    real cut or another order is refused. numpy on zarr's read is the oracle."""
    root = _store(tmp_path / "s.zarr", spc=8)
    g = open_geometries(root)
    lsm = g["land_sea_mask"]
    cut = {"latitude": 4, "longitude": 4}
    whole = [
        lsm.isel(latitude=slice(None)),
        lsm.isel(latitude=list(range(6)), longitude=[-8, 1, 2, 3, 4, 5, 6, 7]),
        lsm.sel(longitude=slice(None, 1000)),  # every longitude, 0 ... 315
        lsm.isel(latitude=[5, 4, 3, 2, 1, 0]).isel(latitude=slice(None, None, -1)),  # undone
    ]
    members = {"t": g["temperature"].patches(cut, origins="random"),
               **{f"lsm{i}": v for i, v in enumerate(whole)}}  # fmt: skip
    stack(members)  # before: each refused, "is cut by the stack's patches along 'latitude'"
    whole_t = g["temperature"].isel(latitude=slice(None))  # before: "cannot be patched"
    members["t_all"] = whole_t.patches(cut, origins="random")
    pipe = insitu_pipeline(root, split_by_chunk(g["temperature"], (1.0, 0.0, 0.0)),
                           {"x": stack(members)}, batch_size=8, coords=())  # fmt: skip
    t, m = (zarr.open_array(root / n, mode="r")[...] for n in ("temperature", "land_sea_mask"))
    try:
        for batch in pipe:
            x, origins = batch.arrays["x"], batch.patch_origins["x"]
            for i, (s, (oy, ox)) in enumerate(zip(batch.sample_indices["x"], origins, strict=True)):
                box = (slice(oy, oy + 4), slice(ox, ox + 4))
                want = np.concatenate([t[s][:, *box], *[m[None, *box]] * 4, t[s][:, *box]])
                np.testing.assert_array_equal(x[i], want)
    finally:
        pipe.close()
    t = g["temperature"].patches(cut)
    for real in (lsm.isel(latitude=[1, 0, 2, 3, 4, 5]), lsm.isel(longitude=slice(1, None))):
        with pytest.raises(ValueError, match="must be whole there"):
            stack({"t": t, "lsm": real})


@pytest.mark.parametrize("cut", [{"latitude": 4, "longitude": 4}, {"longitude": 3}])
def test_a_patched_stacks_forcings_are_each_rows_window_of_the_whole_grids_forcing(
    tmp_path: Path, cut: dict[str, int]
) -> None:
    root = _store(tmp_path / "s.zarr", spc=2)
    g = open_geometries(root)
    sun = Forcings("x", view=g["temperature"], names=["toa_incident_solar_radiation"])
    zenith = Forcings("x", view=g["temperature"], names=["cos_solar_zenith"])
    members = {
        "t2m": g["2m_temperature"].window([-1, 0]).patches(cut, stride=2),
        "sun": sun,
        "lsm": g["land_sea_mask"],
        "zenith": zenith,
    }
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": stack(members)}, batch_size=5)
    t2m = zarr.open_array(root / "2m_temperature", mode="r")[...]
    lsm = zarr.open_array(root / "land_sea_mask", mode="r")[...]
    axes = [("latitude", "longitude").index(d) for d in cut]
    try:
        batches = list(pipe)
    finally:
        pipe.close()
    assert batches
    for batch in batches:
        x, origins = batch.arrays["x"], batch.patch_origins["x"]
        times = batch.coords["x"]["time"]  # (batch, 2)
        assert batch.channels["x"] == ["t2m", "toa_incident_solar_radiation", "lsm",
                                       "cos_solar_zenith"]  # fmt: skip
        whole = {"sun": sun.compute(times)["toa_incident_solar_radiation"],
                 "zenith": zenith.compute(times)["cos_solar_zenith"]}  # fmt: skip
        for i, (steps, origin) in enumerate(zip(batch.sample_indices["x"], origins, strict=True)):
            box = [slice(None), slice(None)]
            for a, o, (_, e) in zip(axes, origin, cut.items(), strict=True):
                box[a] = slice(int(o), int(o) + e)
            for t in range(2):
                want = np.stack([t2m[steps[t]][*box], whole["sun"][i, t][*box], lsm[*box],
                                 whole["zenith"][i, t][*box]])  # fmt: skip
                np.testing.assert_array_equal(x[i, t], want)


def test_set_views_takes_stacks_from_the_next_epoch_with_their_static_and_forcing_members(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    lsm = zarr.open_array(root / "land_sea_mask", mode="r")[...]
    sun = Forcings("x", view=g["2m_temperature"], names=["cos_solar_zenith"])
    t = g["temperature"].sel(level=LEVELS)
    before = stack({"t": t, "t2m": g["2m_temperature"], "lsm": g["land_sea_mask"], "sun": sun})
    after = stack({"t": t.window([-1, 0]), "t2m": g["2m_temperature"].window([-1, 0]),
                   "lsm": g["land_sea_mask"], "sun": sun})  # fmt: skip
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": before}, batch_size=4)
    try:
        assert next(iter(pipe)).arrays["x"].shape == (4, 6, 6, 8)
        pipe.set_views({"x": after})
        pipe.reset()
        rows = 0
        for b in pipe:
            x, s = b.arrays["x"], b.sample_indices["x"]
            assert x.shape == (len(b), 2, 6, 6, 8) and s.shape == (len(b), 2)
            assert b.channels["x"] == ["t@1000", "t@350", "t@1", "t2m", "lsm",
                                       "cos_solar_zenith"]  # fmt: skip
            want = np.concatenate(
                [_oracle(root, "temperature", s, LEVELS), _oracle(root, "2m_temperature", s, None)],
                axis=2,
            )
            np.testing.assert_array_equal(x[:, :, :4], want)
            np.testing.assert_array_equal(x[:, :, 4], np.broadcast_to(lsm, x[:, :, 4].shape))
            suns = sun.compute(b.coords["x"]["time"])["cos_solar_zenith"]
            np.testing.assert_allclose(x[:, :, 5], suns, rtol=1e-6)
            rows += len(b)
        assert rows == N - 1
        with pytest.raises(ValueError, match="do not carry"):
            pipe.set_views({"x": stack({"t2m": g["2m_temperature"], "t": t,
                                        "lsm": g["land_sea_mask"], "sun": sun})})  # fmt: skip
        with pytest.raises(ValueError, match="another geometry"):
            pipe.set_views({"x": stack({"t": t, "q": g["geopotential"], "lsm": g["land_sea_mask"],
                                        "sun": sun})})  # fmt: skip
    finally:
        pipe.close()


@pytest.mark.parametrize("first", ["t2m", "q"])
def test_a_patched_stack_of_arrays_of_any_rank_equals_each_members_window_at_the_rows_origin(
    tmp_path: Path, first: str
) -> None:
    root = _store(tmp_path / "s.zarr", spc=2)
    q = zarr.create_array(
        root / "q", shape=(N, 5, 6, 8), chunks=(2, 5, 3, 4), dtype="float32",
        dimension_names=("time", "level", "latitude", "longitude"),
    )  # fmt: skip
    q[...] = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)
    g = open_geometries(root)
    cut = {"latitude": 4, "longitude": 4}
    members = {
        "t2m": g["2m_temperature"].patches(cut, stride=3),  # (time, lat, lon)
        "q": g["q"].isel(level=[4, 0, 2]).patches(cut, stride=3),  # (time, level, lat, lon)
        "lsm": g["land_sea_mask"],  # static (lat, lon)
        "t": g["temperature"].patches(cut, stride=3).isel(level=1),  # a level dropped
    }
    if first == "q":
        members = {"q": members.pop("q"), **members}
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": stack(members)}, batch_size=5, coords=())
    data = {n: zarr.open_array(root / n, mode="r")[...] for n in
            ("2m_temperature", "q", "land_sea_mask", "temperature")}  # fmt: skip
    seen = set()
    try:
        batches = list(pipe)
    finally:
        pipe.close()
    for batch in batches:
        x, origins = batch.arrays["x"], batch.patch_origins["x"]
        assert x.shape == (len(batch), 6, 4, 4)
        for i, (s, (oy, ox)) in enumerate(zip(batch.sample_indices["x"], origins, strict=True)):
            box = (slice(oy, oy + 4), slice(ox, ox + 4))
            parts = {
                "t2m": data["2m_temperature"][s][None, *box],
                "q": data["q"][s][[4, 0, 2]][:, *box],
                "lsm": data["land_sea_mask"][None, *box],
                "t": data["temperature"][s][1][None, *box],
            }
            np.testing.assert_array_equal(x[i], np.concatenate([parts[m] for m in members]))
            seen.add((int(oy), int(ox)))
    # every window of the grid, the edge ones flush with the far side included
    assert seen == {(a, b) for a in (0, 2) for b in (0, 3, 4)}
    assert sum(map(len, batches)) == N * 6


@pytest.mark.parametrize(
    ("shape", "axes", "extent"),
    [((6, 8), (0, 1), (3, 4)), ((5, 6, 8), (1, 2), (2, 3)), ((6, 5, 8), (0, 2), (2, 3)),
     ((6, 8), (1, 0), (3, 2))],
)  # fmt: skip
def test_a_static_field_is_cut_to_every_rows_window_at_once_in_its_own_axis_order(
    shape: tuple[int, ...], axes: tuple[int, ...], extent: tuple[int, ...]
) -> None:
    from insitubatch_nodes.static import StaticCut

    rng = np.random.default_rng(0)
    data = rng.random(shape).astype("f4")
    pairs = zip(axes, extent, strict=True)
    origins = np.stack([rng.integers(0, shape[a] - e + 1, 7) for a, e in pairs], 1)
    row = list(shape)
    for a, e in zip(axes, extent, strict=True):
        row[a] = e
    out = StaticCut(axes, tuple(range(len(axes))), extent).rows(data, origins)
    assert out.shape == (7, *row)
    for i, origin in enumerate(origins.tolist()):
        box = [slice(None)] * data.ndim
        for a, o, e in zip(axes, origin, extent, strict=True):
            box[a] = slice(o, o + e)
        np.testing.assert_array_equal(out[i], data[tuple(box)])
