"""A channel stack that keeps the ensemble axis: ``stack(views, ensemble="member")``.

anemoi-style ensemble training takes ``(batch, time, ensemble, grid, variables)``; a stack
with ``ensemble="member"`` delivers ``(batch, [T,] E, C, *grid)`` (channels last: ``(batch,
[T,] E, *grid, C)``), each sampled member's data copied into its ``(E, c0:c1)`` slice. The
oracle is numpy/xarray on the same tiny stores: ``t (time, member, level, lat, lon)``, ``2t
(time, member, lat, lon)``, a static ``lsm (lat, lon)`` (members numbered 1, 2, 3, each offset
by 100 so a mixed-up member shows), and the same data stored ``(member, time, ...)`` sampled
along ``time``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from resume_helpers import assert_resumes_exactly, digest

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.forcings import Forcings, cos_solar_zenith
from insitubatch_nodes.statistics import fit_statistics

pytestmark = pytest.mark.timeout(90)

GRID = ("lat", "lon")
N_LAT, N_LON = 3, 4
SIX = np.timedelta64(6, "h")


def _dataset() -> xr.Dataset:
    times = pd.date_range("2020-01-01", periods=16, freq="6h")
    n, rng = len(times), np.random.default_rng(3)
    member = 100.0 * np.arange(3)[None, :, None, None, None]
    level = 10.0 * np.arange(2)[None, None, :, None, None]
    t = 250 + member + level + rng.normal(0, 1, (n, 3, 2, N_LAT, N_LON))
    t2 = 280 + member[:, :, 0] + rng.normal(0, 2, (n, 3, N_LAT, N_LON))
    return xr.Dataset(
        {"t": (("time", "member", "level", *GRID), t.astype("f4")),
         "2t": (("time", "member", *GRID), t2.astype("f4")),
         "lsm": (GRID, (rng.random((N_LAT, N_LON)) > 0.5).astype("f4"))},
        coords={"time": times, "member": [1, 2, 3], "level": [850, 500],
                "lat": [40.0, 0.0, -40.0], "lon": np.arange(0.0, 360.0, 90.0)},
    )  # fmt: skip


def _write(root: Path, ds: xr.Dataset, time_chunk: int) -> Path:
    enc = {v: {"chunks": tuple(time_chunk if d == "time" else n for d, n in ds[v].sizes.items())}
           for v in ("t", "2t") if v in ds}  # fmt: skip
    ds.to_zarr(root, encoding=enc, zarr_format=3, consolidated=False)
    return root


@pytest.fixture(scope="module")
def ens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    ds = _dataset()
    return _write(tmp_path_factory.mktemp("ens") / "ens.zarr", ds, 4), ds


def _train(g: dict[str, Any]) -> Any:
    return split_by_chunk(g["2t"], (1.0, 0.0, 0.0))


def _want(ds: xr.Dataset, idx: np.ndarray, members: list[int], levels: list[int]) -> np.ndarray:
    """The oracle: ``(n, [T,] E, C, lat, lon)``, channels t@levels, 2t, lsm; ``idx`` ``(n,
    [T])``."""
    t = ds.t.sel(member=members, level=levels).values[idx]  # (..., E, L, lat, lon)
    t2 = ds["2t"].sel(member=members).values[idx][..., None, :, :]
    lsm = np.broadcast_to(ds.lsm.values, (*t.shape[:-3], 1, N_LAT, N_LON))
    return np.concatenate([t, t2, lsm], axis=-3)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_an_ensemble_stack_of_windows_keeps_the_member_axis_beside_statics_and_forcings(
    ens: Any, layout: str
) -> None:
    root, ds = ens
    g = open_geometries(root)
    x = stack({"t": g["t"].window([-1, 0]), "2t": g["2t"].window([-1, 0]), "lsm": g["lsm"],
               "sun": Forcings("x", view=g["2t"], names=["cos_solar_zenith"])},
              layout=layout, ensemble="member")  # fmt: skip
    assert x.channels == ("t@850", "t@500", "2t", "lsm", "cos_solar_zenith")
    assert x.ensemble == (1, 2, 3) and x.ensemble_dim == "member"
    last = layout == "channels_last"
    assert x.row_shape == ((2, 3, N_LAT, N_LON, 5) if last else (2, 3, 5, N_LAT, N_LON))
    rows = 0
    with insitu_pipeline(root, _train(g), {"x": x}, batch_size=4) as pipe:
        for batch in pipe:
            assert batch.channels["x"] == list(x.channels)
            idx, times = batch.sample_indices["x"], batch.coords["x"]["time"]
            got = np.moveaxis(batch["x"], -1, 3) if last else batch["x"]
            assert got.shape == (len(idx), 2, 3, 5, N_LAT, N_LON)
            np.testing.assert_array_equal(got[:, :, :, :4], _want(ds, idx, [1, 2, 3], [850, 500]))
            sun = cos_solar_zenith(times, ds.lat.values, ds.lon.values)  # (n, T, lat, lon)
            for e in range(3):  # the same Sun for every member
                np.testing.assert_allclose(got[:, :, e, 4], sun, atol=1e-6)
            assert (np.diff(times, axis=1) == SIX).all()
            rows += len(idx)
    assert rows == len(ds.time) - 1


def test_members_and_levels_selected_by_value_keep_their_order_and_shift_with_the_target(
    ens: Any,
) -> None:
    """No window: rows ``(E, C, *grid)``, no T axis, as a stack without windows today."""
    root, ds = ens
    g = open_geometries(root)
    pick = {"member": [3, 1]}
    members = {"t": g["t"].sel(level=[500], **pick), "2t": g["2t"].sel(**pick), "lsm": g["lsm"]}
    x = stack(members, ensemble="member")
    y = stack({k: v.shift(1) if k != "lsm" else v for k, v in members.items()},
              ensemble="member", layout="channels_last")  # fmt: skip
    assert x.channels == ("t@500", "2t", "lsm") and x.ensemble == (3, 1)
    assert x.row_shape == (2, 3, N_LAT, N_LON)
    with insitu_pipeline(root, _train(g), {"x": x, "y": y}, batch_size=5) as pipe:
        for batch in pipe:
            idx, nxt = batch.sample_indices["x"], batch.sample_indices["y"]
            np.testing.assert_array_equal(nxt, idx + 1)
            np.testing.assert_array_equal(batch["x"], _want(ds, idx, [3, 1], [500]))
            np.testing.assert_array_equal(
                np.moveaxis(batch["y"], -1, 2), _want(ds, nxt, [3, 1], [500])
            )


def test_a_member_major_store_sampled_along_time_and_one_sample_per_chunk_give_the_same_rows(
    ens: Any, tmp_path: Path
) -> None:
    """``(member, time, ...)`` sampled along ``time``, and a store of one time per chunk (the
    fetch stage's direct decode, where it applies), against the oracle."""
    _, ds = ens
    for store, kw in (
        (_write(tmp_path / "mm.zarr", ds.transpose("member", "time", ...), 4),
         {"sample_axis": "time"}),
        (_write(tmp_path / "one.zarr", ds, 1), {}),
    ):  # fmt: skip
        g = open_geometries(store, **kw)
        x = stack({"t": g["t"].window([-1, 0]), "2t": g["2t"].window([-1, 0]), "lsm": g["lsm"]},
                  ensemble="member")  # fmt: skip
        with insitu_pipeline(store, _train(g), {"x": x}, batch_size=4, shuffle=False) as pipe:
            n = size = 0
            for batch in pipe:
                idx = batch.sample_indices["x"]
                np.testing.assert_array_equal(batch["x"], _want(ds, idx, [1, 2, 3], [850, 500]))
                n, size = n + len(idx), max(size, batch["x"].nbytes)
            stats, allocations = pipe.stats(), pipe.stages.gather.buffer_allocations
        assert n == len(ds.time) - 1
        # one (batch, T, E, C, lat, lon) buffer per batch in flight: each member copied from
        # the pool into its (E, c0:c1) slice, no per-member buffer, no copy after
        assert stats["batch_buffer_bytes"] <= 1.1 * allocations * size


def test_pooled_statistics_standardise_every_member_alike_and_per_member_ones_each_member(
    ens: Any,
) -> None:
    root, ds = ens
    g = open_geometries(root)
    members = {"t": g["t"], "2t": g["2t"], "lsm": g["lsm"]}
    every, mine = ("time", "member", *GRID), ("time", *GRID)
    d = ds.astype("f8")
    for pool, over in (("member", every), ((), mine)):
        stats = fit_statistics(root, _train(g), members, pool=pool)
        x = stack(members, normalize=stats, ensemble="member")
        with insitu_pipeline(root, _train(g), {"x": x}, batch_size=8) as pipe:
            batch = next(iter(pipe))
        idx = batch.sample_indices["x"]
        for name, c in (("t", slice(0, 2)), ("2t", slice(2, 3))):
            data = d[name] if name == "t" else d[name].expand_dims(level=[0], axis=2)
            mean = data.mean(over).values[..., None, None]  # (L,) pooled, (E, L) per member
            std = data.std(over).values[..., None, None]
            want = (data.values[idx] - mean) / std
            np.testing.assert_allclose(batch["x"][:, :, c], want, rtol=1e-4, atol=1e-4)
        lsm = (d.lsm - d.lsm.mean()) / d.lsm.std()
        np.testing.assert_allclose(batch["x"][:, :, 3], np.broadcast_to(lsm, (8, 3, N_LAT, N_LON)),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        if pool:  # one value per channel: member 3 stays 200 K above member 1
            gap = batch["x"][:, 2, 2].mean() - batch["x"][:, 0, 2].mean()
            assert abs(gap - 200 / float(d["2t"].std(every))) < 0.3


def test_members_that_select_other_members_are_refused_by_name(ens: Any, tmp_path: Path) -> None:
    root, ds = ens
    g = open_geometries(root)
    with pytest.raises(ValueError, match=r"'2t' selects member \[2, 1\].*'t' selects \[1, 2\]"):
        stack({"t": g["t"].sel(member=[1, 2]), "2t": g["2t"].sel(member=[2, 1])},
              ensemble="member")  # fmt: skip
    with pytest.raises(ValueError, match=r"'2t' selects member \[1, 2\].*\[1, 2, 3\]"):
        stack({"t": g["t"], "2t": g["2t"].sel(member=[1, 2])}, ensemble="member")
    with pytest.raises(ValueError, match="'2t' selects one 'member'"):
        stack({"t": g["t"], "2t": g["2t"].sel(member=2)}, ensemble="member")
    with pytest.raises(ValueError, match="'t' has no 'number' dimension"):
        stack({"t": g["t"], "2t": g["2t"]}, ensemble="number")
    # members after the levels (anemoi's order): allowed since 2026-12-07, rows (E, C, *grid)
    levels_first = ds[["t"]].transpose("time", "level", "member", *GRID)
    lm = open_geometries(_write(tmp_path / "lm.zarr", levels_first, 4))
    assert stack({"t": lm["t"]}, ensemble="member").row_shape == (3, 2, N_LAT, N_LON)
    with pytest.raises(ValueError, match=f"'t' has 'member' after '{GRID[0]}'"):
        grid_first = ds[["t"]].transpose("time", "level", GRID[0], "member", GRID[1])
        lg = open_geometries(_write(tmp_path / "lg.zarr", grid_first, 4))
        stack({"t": lg["t"]}, ensemble="member")
    with pytest.raises(ValueError, match="'2t' is patched along 'member'"):
        stack({"2t": g["2t"].patches({"member": 1, "lat": 1})}, ensemble="member")
    # the default: today's stack, the members as channels
    assert stack({"2t": g["2t"]}).channels == ("2t@1", "2t@2", "2t@3")
    assert stack({"2t": g["2t"]}).ensemble is None


def test_an_ensemble_stack_resumes_exactly_mid_epoch(ens: Any) -> None:
    root, _ = ens
    g = open_geometries(root)
    members = {"t": g["t"].sel(level=[500]), "2t": g["2t"], "lsm": g["lsm"]}
    stats = fit_statistics(root, _train(g), members, pool="member")

    def build() -> Any:
        x = stack({k: v.window([-1, 0]) if k != "lsm" else v for k, v in members.items()},
                  normalize=stats, ensemble="member")  # fmt: skip
        return insitu_pipeline(root, _train(g), {"x": x}, batch_size=3, seed=5)

    def records(batches: list[Any]) -> list[Any]:
        return [(b.sample_indices["x"].tolist(), digest(b["x"])) for b in batches]

    with build() as pipe:
        ref = records(list(pipe)) + records(list(pipe))
    assert_resumes_exactly(build, records, ref, [2, 6])


def test_anemoi_s_layout_on_a_grid_of_points_is_batch_ensemble_grid_variables(
    tmp_path: Path,
) -> None:
    """``2t (time, member, values)`` beside 1-D latitude/longitude: channels last gives rows
    ``(E, values, C)``, as anemoi-training's ``(batch, ensemble, grid, variables)``."""
    n, rng = 7, np.random.default_rng(0)
    times = pd.date_range("2020-01-01", periods=8, freq="6h")
    ds = xr.Dataset(
        {"t": (("time", "member", "level", "values"), rng.normal(size=(8, 2, 3, n)).astype("f4")),
         "2t": (("time", "member", "values"), rng.normal(size=(8, 2, n)).astype("f4")),
         "lsm": (("values",), rng.random(n).astype("f4")),
         "latitude": (("values",), np.linspace(-60, 60, n)),
         "longitude": (("values",), np.linspace(0, 300, n))},
        coords={"time": times, "member": [0, 1], "level": [1000, 850, 500]},
    )  # fmt: skip
    root = _write(tmp_path / "points.zarr", ds, 4)
    g = open_geometries(root)
    x = stack({"t": g["t"].sel(level=[850, 500]), "2t": g["2t"], "lsm": g["lsm"],
               "sun": Forcings("x", view=g["2t"], names=["cos_solar_zenith"])},
              ensemble="member", layout="channels_last")  # fmt: skip
    assert x.channels == ("t@850", "t@500", "2t", "lsm", "cos_solar_zenith")
    assert x.row_shape == (2, n, 5)
    with insitu_pipeline(root, _train(g), {"x": x}, batch_size=5) as pipe:
        for batch in pipe:
            i, got = batch.sample_indices["x"], batch["x"]
            want = ds.t.sel(level=[850, 500]).values[i]
            np.testing.assert_array_equal(np.moveaxis(got[..., :2], -1, 2), want)
            np.testing.assert_array_equal(got[..., 2], ds["2t"].values[i])
            assert (got[..., 3] == ds.lsm.values).all()
            np.testing.assert_array_equal(got[:, 0, :, 4], got[:, 1, :, 4])
