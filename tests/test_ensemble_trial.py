"""An ensemble archive, as an anemoi user moving here would train on it: against xarray and numpy.

The stores are written by xarray as an ensemble reanalysis is laid out: ``t (time, member,
level, lat, lon)``, ``2t (time, member, lat, lon)``, a static ``lsm (lat, lon)``, dimension
coordinates (members numbered 1, 2, 3: values that are not their indices; latitude north to
south; one 6-hourly date never written), zarr v3; and the same data stored ``(member, time,
...)``. Each member and level is offset, and the members' spreads differ, so a mixed-up member,
level or statistic shows.

Found wrong, fixed (each test failed before its fix):

- **Statistics pooled over the members, as anemoi's.** anemoi-datasets pools its statistics
  over every ensemble member (one mean and stdev per variable); ``fit_statistics`` fits one per
  channel, and a member axis is a channel: one per member. The anemoi table of
  docs/model-inputs.md mapped anemoi's ``statistics`` to ``fit_statistics`` "per channel (per
  level)", and nothing could give the pooled ones to a stack of members (statistics of another
  channel shape are refused): ``stack(normalize=)`` standardised every member with its own mean
  and spread, removing the differences between members and rescaling their spread (here member 3,
  200 K above member 1, came out centred on 0 as well). ``fit_statistics(...,
  pool="member")`` now reduces over the named channel dimensions too (mean, std, min, max,
  diff_std, counts; equal to xarray's over ``(time, member, lat, lon)``, and to a fit on the
  product sample axes ``("time", "member")``); the statistics record it (``dataset["pool"]``),
  standardise a stack's member channels, any selection of members or one member alike (each
  with the pooled values), and survive ``save``/``load``. The docs say what a channel is for an
  ensemble and how anemoi's statistics are had.
- **The ``(member, time, ...)`` store sampled along ``time``**: ``fit_statistics`` opened the
  anchor array along axis 0 (``member``) to read its times, found none, and paired the samples
  either side of the missing date in ``diff_std`` (1.3655 / 4.2865 / 7.4155 where xarray gives
  1.3694 / 4.3149 / 7.2846); a pipeline with a time stride whose manifest was drawn on an array
  it does not read was refused ("'member' is no CF time"). The anchor array is now opened along
  the views' sample dimension.
- **Channels of a window along the members** (a stack member patched ``{"member": 2, "lat":
  2, "lon": 3}`` at random origins; 3-D sub-cubes along ``freq`` alike) were named by the first
  window's members, ``2t@1 2t@2``, in every row, where a row at origin 1 holds members 2 and 3;
  now ``2t@member+0 2t@member+1``, their place in the row's window (``batch.patch_origins``
  gives the row's members).
- **Two stack members whose channels share a name** (a member ``t`` of the members at 500 hPa,
  channels ``t@1 t@2 t@3``, beside a member named ``t@1``) gave ``batch.channels`` a name twice,
  for two different fields; refused now, naming the name and both members.

Tried and found right: members selected by value (``sel(member=[3, 1])``, ``sel(member=2)``) and
levels by value, stacked as channels ``"t@1" ...`` named by the member coordinate in the order
selected, with windows, the static mask (one channel, the same in every row and step) and the
Sun (each row's and step's time), a whole epoch against xarray; windows and shifted targets at a
time stride never across the missing date nor across members; the ``(member, time, ...)`` store
sampled along ``time`` delivers the same batches, statistics and differences as the time-major
one (by default its sample axis is ``member``: axis 0, as documented); per-member statistics and
``diff_std`` (across the missing date none) against xarray; a mid-epoch resume of a
standardised stack of members; two DDP ranks dealing each anchor once, in equal batch counts.

A stack that keeps the ensemble axis, ``(batch, [T,] E, C, *grid)`` as anemoi-training's
ensemble batches are, is ``stack(..., ensemble="member")`` (built since: tests/test_ensaxis.py);
here the members are channels, variable after variable (``t@1 t@2 t@3 2t@1 ...``), or samples
(product sample axes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from resume_helpers import assert_resumes_exactly, digest
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.forcings import Forcings, cos_solar_zenith
from insitubatch_nodes.io import open_coordinates
from insitubatch_nodes.statistics import Statistics, fit_statistics

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(90), pytest.mark.xdist_group("ensemble_trial")]

MEMBERS = [1, 2, 3]
LEVELS = [850, 500]
GRID = ("lat", "lon")
N_LAT, N_LON = 4, 6


def _dataset() -> xr.Dataset:
    times = pd.date_range("2020-01-01", periods=25, freq="6h")
    times = times[times != pd.Timestamp("2020-01-03T12:00")]  # a missing date
    n, e, k = len(times), len(MEMBERS), len(LEVELS)
    rng = np.random.default_rng(7)
    member = 100.0 * np.arange(e)[None, :, None, None, None]
    spread = (1.0 + 2.0 * np.arange(e))[None, :, None, None, None]  # 1, 3, 5
    level = 10.0 * np.arange(k)[None, None, :, None, None]
    t = 250 + member + level + spread * rng.normal(0, 1, (n, e, k, N_LAT, N_LON))
    t2 = 280 + member[:, :, 0] + spread[:, :, 0] * rng.normal(0, 1, (n, e, N_LAT, N_LON))
    return xr.Dataset(
        {"t": (("time", "member", "level", *GRID), t.astype("f4")),
         "2t": (("time", "member", *GRID), t2.astype("f4")),
         "lsm": (GRID, (rng.random((N_LAT, N_LON)) > 0.5).astype("f4"))},
        coords={"time": times, "member": MEMBERS, "level": LEVELS,
                "lat": [60.0, 20.0, -20.0, -60.0], "lon": np.arange(0.0, 360.0, 60.0)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def ens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    """Time-major: ``t`` one member (both levels) per object, ``2t`` every member per object."""
    ds = _dataset()
    root = tmp_path_factory.mktemp("ens") / "ens.zarr"
    enc = {"t": {"chunks": (4, 1, 2, N_LAT, N_LON)}, "2t": {"chunks": (4, 3, N_LAT, N_LON)}}
    ds.to_zarr(root, encoding=enc, zarr_format=3, consolidated=False)
    return root, ds


@pytest.fixture(scope="module")
def member_major(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same data stored ``(member, time, ...)``, one member per object."""
    ds = _dataset().transpose("member", "time", ...)
    root = tmp_path_factory.mktemp("ens") / "member_major.zarr"
    enc = {"t": {"chunks": (1, 4, 2, N_LAT, N_LON)}, "2t": {"chunks": (1, 4, N_LAT, N_LON)}}
    ds.to_zarr(root, encoding=enc, zarr_format=3, consolidated=False)
    return root


def _x(g: dict[str, Any], normalize: Any = None) -> Any:
    return stack(
        {"t": g["t"].sel(level=500).window([-1, 0]),
         "2t": g["2t"].sel(member=[3, 1]).window([-1, 0]),
         "lsm": g["lsm"],
         "sun": Forcings("x", view=g["2t"], names=["cos_solar_zenith"])},
        normalize=normalize,
    )  # fmt: skip


def _train(g: dict[str, Any]) -> Any:
    return split_by_chunk(g["2t"], (0.75, 0.25, 0.0))


def test_members_by_value_stack_as_channels_named_by_the_member_coordinate(ens: Any) -> None:
    root, ds = ens
    g = open_geometries(root)
    x = _x(g)
    assert x.channels == ("t@1", "t@2", "t@3", "2t@3", "2t@1", "lsm", "cos_solar_zenith")
    y = stack({"t": g["t"].sel(member=2).shift(1), "2t": g["2t"].sel(member=2).shift(1)})
    assert y.channels == ("t@850", "t@500", "2t")
    times = ds.time.values
    seen = []
    with insitu_pipeline(root, _train(g), {"x": x, "y": y}, batch_size=4, stride="6h") as pipe:
        for batch in pipe:
            idx, t = batch.sample_indices["x"], batch.coords["x"]["time"]
            np.testing.assert_array_equal(t, times[idx])
            got = batch["x"]
            np.testing.assert_array_equal(got[:, :, 0:3], ds.t.sel(level=500).values[idx])
            np.testing.assert_array_equal(got[:, :, 3:5], ds["2t"].sel(member=[3, 1]).values[idx])
            assert (got[:, :, 5] == ds.lsm.values).all()  # the one mask, every row and step
            sun = cos_solar_zenith(t, ds.lat.values, ds.lon.values)
            np.testing.assert_allclose(got[:, :, 6], sun, atol=1e-6)
            nxt = batch.sample_indices["y"]
            np.testing.assert_array_equal(nxt, idx[:, 1] + 1)
            np.testing.assert_array_equal(batch["y"][:, 0:2], ds.t.sel(member=2).values[nxt])
            np.testing.assert_array_equal(batch["y"][:, 2], ds["2t"].sel(member=2).values[nxt])
            # a step and the next are 6 h apart: no window nor target across the missing date
            six = np.timedelta64(6, "h")
            assert (np.diff(t, axis=1) == six).all() and (times[nxt] - t[:, 1] == six).all()
            seen += idx[:, 1].tolist()
    train, six = set(_train(g).samples("train").tolist()), np.timedelta64(6, "h")
    want = [i for i in sorted(train) if {i - 1, i + 1} <= train
            and times[i] - times[i - 1] == six == times[i + 1] - times[i]]  # fmt: skip
    assert sorted(seen) == want and 9 not in want  # (the missing date is after sample 9)


def test_a_member_major_store_sampled_along_time_gives_the_same_batches(
    ens: Any, member_major: Path
) -> None:
    root, ds = ens
    default = open_geometries(member_major)["t"]
    assert default.dims[default.sample_axis] == "member"  # axis 0, as documented
    g, gm = open_geometries(root), open_geometries(member_major, sample_axis="time")
    assert gm["lsm"].static and gm["t"].inner_shape == (3, 2, N_LAT, N_LON)
    assert _x(gm).channels == _x(g).channels

    def run(store: Path, geoms: dict[str, Any]) -> list[tuple[Any, ...]]:
        with insitu_pipeline(store, _train(geoms), {"x": _x(geoms)}, batch_size=4,
                             stride="6h", shuffle=False) as pipe:  # fmt: skip
            return [(b.sample_indices["x"].tolist(), digest(b["x"])) for b in pipe]

    assert run(member_major, gm) == run(root, g)
    per = {"t": g["t"], "2t": g["2t"]}
    fitted = fit_statistics(root, _train(g), per)
    fitted_mm = fit_statistics(member_major, _train(gm), {"t": gm["t"], "2t": gm["2t"]})
    for name in ("mean", "std", "diff_std"):
        for label in per:
            np.testing.assert_allclose(getattr(fitted_mm, name)[label],
                                       getattr(fitted, name)[label], rtol=1e-12)  # fmt: skip
    # none across the missing date (before: the member-major fit paired its two neighbours)
    train = _train_ds(ds, g)["2t"]
    np.testing.assert_allclose(fitted_mm.diff_std["2t"], _diff_std(train, ("time", *GRID)),
                               rtol=1e-6)  # fmt: skip


def test_a_time_stride_on_a_member_major_store_takes_the_times_of_time(member_major: Path) -> None:
    """The manifest drawn on ``2t``, the pipeline reading ``t`` only: the anchor array is opened
    along the views' sample dimension (before: along axis 0, ``member``, refused as having no
    time coordinate)."""
    gm = open_geometries(member_major, sample_axis="time")
    view = {"t": gm["t"].sel(level=850).window([-1, 0])}
    with insitu_pipeline(member_major, _train(gm), view, batch_size=4, stride="6h") as pipe:
        steps = np.concatenate([b.coords["t"]["time"] for b in pipe])
    assert (np.diff(steps, axis=1) == np.timedelta64(6, "h")).all()
    assert len(steps) == len(np.unique(steps[:, 1])) == 18


def _train_ds(ds: xr.Dataset, g: dict[str, Any]) -> xr.Dataset:
    samples = _train(g).samples("train")
    return ds.isel(time=slice(int(samples.min()), int(samples.max()) + 1)).astype("f8")


def _diff_std(da: xr.DataArray, dims: tuple[str, ...]) -> np.ndarray:
    """The standard deviation of one-step (6 h) differences, none across the missing date."""
    d = da.diff("time")
    d = d.where(da.time.diff("time") == np.timedelta64(6, "h"), drop=True)
    return d.std(dims).values


def test_statistics_are_per_member_unless_pooled_over_the_members_as_anemoi(ens: Any) -> None:
    root, ds = ens
    g = open_geometries(root)
    train = _train_ds(ds, g)
    reduce = ("time", *GRID)
    per = fit_statistics(root, _train(g), {"t": g["t"], "2t": g["2t"]})
    assert per.mean["t"].shape == (3, 2)  # (member, level): a member axis is a channel
    np.testing.assert_allclose(per.mean["2t"], train["2t"].mean(reduce), rtol=1e-12)
    np.testing.assert_allclose(per.std["t"], train.t.std(reduce), rtol=1e-6)
    np.testing.assert_allclose(per.diff_std["2t"], _diff_std(train["2t"], reduce), rtol=1e-5)
    # anemoi's statistics: one per variable (and level), over every member
    pooled = fit_statistics(root, _train(g), {"t": g["t"], "2t": g["2t"], "lsm": g["lsm"]},
                            pool="member")  # fmt: skip
    every = ("time", "member", *GRID)
    assert pooled.mean["t"].shape == (2,) and pooled.mean["2t"].shape == ()
    np.testing.assert_allclose(pooled.mean["t"], train.t.mean(every), rtol=1e-12)
    np.testing.assert_allclose(pooled.std["t"], train.t.std(every), rtol=1e-6)
    np.testing.assert_allclose(pooled.std["2t"], train["2t"].std(every), rtol=1e-6)
    np.testing.assert_array_equal(pooled.min["2t"], train["2t"].min().values)
    np.testing.assert_array_equal(pooled.max["t"], train.t.max(every).values)
    np.testing.assert_allclose(pooled.diff_std["t"], _diff_std(train.t, every), rtol=1e-5)
    assert pooled.count["2t"] == train["2t"].size
    assert pooled.dataset["pool"] == {"t": ["member"], "2t": ["member"]}
    with pytest.raises(ValueError, match="pool"):
        fit_statistics(root, _train(g), {"t": g["t"]}, pool="number")
    # the product sample axes (time, member) pool them too: the same statistics
    gp = open_geometries(root, ["2t"], sample_axis=("time", "member"))
    product = fit_statistics(root, split_by_chunk(gp["2t"], (0.75, 0.25, 0.0)), gp)
    for name in ("mean", "std", "min", "max", "count"):
        np.testing.assert_allclose(getattr(product, name)["2t"],
                                   getattr(pooled, name)["2t"], rtol=1e-12)  # fmt: skip


def test_pooled_statistics_standardise_every_member_alike(ens: Any, tmp_path: Path) -> None:
    root, ds = ens
    g = open_geometries(root)
    members = {"t": g["t"].sel(level=500), "2t": g["2t"], "lsm": g["lsm"]}  # every member
    pooled = fit_statistics(root, _train(g), members, pool="member")
    pooled.save(tmp_path / "stats.json")
    pooled = Statistics.load(tmp_path / "stats.json", dataset={"views": members})
    train = _train_ds(ds, g)
    every = ("time", "member", *GRID)
    mean = {"t": train.t.sel(level=500).mean(every).values, "2t": train["2t"].mean(every).values}
    std = {"t": train.t.sel(level=500).std(every).values, "2t": train["2t"].std(every).values}
    x = _x(g, normalize=pooled)
    one = stack({"2t": g["2t"].sel(member=3)}, normalize=pooled)  # one member: the same values
    with insitu_pipeline(root, _train(g), {"x": x, "one": one}, batch_size=8) as pipe:
        batch = next(iter(pipe))
    idx = batch.sample_indices["x"]
    for name, channels, data in (("t", slice(0, 3), ds.t.sel(level=500)),
                                 ("2t", slice(3, 5), ds["2t"].sel(member=[3, 1]))):  # fmt: skip
        want = (data.values[idx] - mean[name]) / std[name]
        np.testing.assert_allclose(batch["x"][:, :, channels], want, rtol=1e-4, atol=1e-4)
    # member 3 stays 200 K above member 1, in pooled units, as anemoi standardises them
    gap = batch["x"][:, :, 3].mean() - batch["x"][:, :, 4].mean()
    assert abs(gap - 200 / std["2t"]) < 0.2
    want = (ds["2t"].sel(member=3).values[batch.sample_indices["one"]] - mean["2t"]) / std["2t"]
    np.testing.assert_allclose(batch["one"][:, 0], want, rtol=1e-4, atol=1e-4)
    # (member, level) pooled over the members: one value per level, for every member
    both = {"2t": g["2t"], "t": g["t"]}
    norm = fit_statistics(root, _train(g), both, pool="member").normalizer(both)
    with insitu_pipeline(root, _train(g), both, batch_size=8, batch_transforms=[norm]) as pipe:
        batch = next(iter(pipe))
    want = (ds["2t"].values[batch.sample_indices["2t"]] - mean["2t"]) / std["2t"]
    np.testing.assert_allclose(batch["2t"], want, rtol=1e-4, atol=1e-4)
    t_mean, t_std = train.t.mean(every).values, train.t.std(every).values
    want = (ds.t.values[batch.sample_indices["t"]] - t_mean[:, None, None]) / t_std[:, None, None]
    np.testing.assert_allclose(batch["t"], want, rtol=1e-4, atol=1e-4)


def test_two_members_whose_channels_share_a_name_are_refused(ens: Any) -> None:
    root, _ = ens
    g = open_geometries(root)
    with pytest.raises(ValueError, match="'t@1'"):
        stack({"t": g["t"].sel(level=500), "t@1": g["2t"].sel(member=1)})


def test_channels_of_windows_along_the_members_are_named_by_their_place_in_the_window(
    ens: Any,
) -> None:
    """A member patched along its channel axis (windows of two of the three members, at random
    origins) holds other members in each row: its channels are the window's first and second,
    not members 1 and 2 (before: ``2t@1``, ``2t@2`` for every row, members 2 and 3 in rows at
    origin 1)."""
    root, ds = ens
    g = open_geometries(root)
    x = stack({"2t": g["2t"].patches({"member": 2, "lat": 2, "lon": 3}, origins="random")})
    assert x.channels == ("2t@member+0", "2t@member+1")
    with insitu_pipeline(root, _train(g), {"x": x}, batch_size=8, seed=1) as pipe:
        for batch in pipe:
            idx, origins = batch.sample_indices["x"], batch.patch_origins["x"]
            for row, i, (m, y, x0) in zip(batch["x"], idx, origins, strict=True):
                want = ds["2t"].values[i, m : m + 2, y : y + 2, x0 : x0 + 3]
                np.testing.assert_array_equal(row, want)
    assert stack({"2t": g["2t"].patches({"lat": 2, "lon": 3})}).channels == ("2t@1", "2t@2", "2t@3")


def _per_member(root: Path, g: dict[str, Any]) -> Statistics:
    members = {"t": g["t"].sel(level=500), "2t": g["2t"].sel(member=[3, 1]), "lsm": g["lsm"]}
    return fit_statistics(root, _train(g), members)


def _build(root: Path, g: dict[str, Any], stats: Statistics, **kw: Any) -> Any:
    return insitu_pipeline(root, _train(g), {"x": _x(g, normalize=stats)}, batch_size=3,
                           stride="6h", seed=5, **kw)  # fmt: skip


def _records(batches: list[Any]) -> list[Any]:
    return [(b.sample_indices["x"].tolist(), digest(b["x"])) for b in batches]


def test_a_standardised_stack_of_members_resumes_exactly_mid_epoch(ens: Any) -> None:
    root, _ = ens
    g = open_geometries(root)
    stats = _per_member(root, g)
    pipe = _build(root, g, stats)
    try:
        loader = Loader(pipe)
        ref = _records([b for _ in range(2) for b in loader])
    finally:
        pipe.close()
    assert_resumes_exactly(lambda: _build(root, g, stats), _records, ref, [2, 5])


def test_two_ranks_deal_each_anchor_once_in_equal_batch_counts(ens: Any) -> None:
    root, _ = ens
    g = open_geometries(root)
    stats = _per_member(root, g)
    got = []
    for rank in (0, 1):
        with _build(root, g, stats, rank=rank, world_size=2, remainder="drop") as pipe:
            got.append([b.sample_indices["x"][:, 1].tolist() for b in pipe])
    assert len(got[0]) == len(got[1])
    a, b = ([i for rows in ranks for i in rows] for ranks in got)
    assert not set(a) & set(b) and len(a) == len(b)
    time = open_coordinates(root, g["2t"])["time"].values
    assert all(time[i] - time[i - 1] == np.timedelta64(6, "h") for i in a + b)
