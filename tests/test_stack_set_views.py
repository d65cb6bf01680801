"""``set_views`` with channel stacks whose static and forcing members change (issue 31).

zarr and numpy are the oracle: after ``set_views`` every batch equals ``np.concatenate`` of the
new stack's members in their order (sampled members read by zarr, static members the stored
array, forcings computed from the rows' times), and ``batch.channels`` names them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import insitubatch_nodes.static as static_module
from insitubatch_nodes import (
    Forcings,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.synthetic import make_weatherbench_like

N = 12
LEVELS = [1000, 350]


def _store(root: Path) -> Path:
    make_weatherbench_like(
        root, n_time=N, n_lat=6, n_lon=8, n_level=5, surface=["2m_temperature"],
        levels=["temperature"], samples_per_chunk=1,
    )  # fmt: skip
    for i, name in enumerate(["land_sea_mask", "orography"]):
        a = zarr.create_array(
            root / name, shape=(6, 8), chunks=(3, 8), dtype="float32",
            dimension_names=("latitude", "longitude"),
        )  # fmt: skip
        a[...] = np.arange(48, dtype=np.float32).reshape(6, 8) * (i + 1) + 100 * i
    return root


def _read(root: Path, name: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root / name, mode="r")[...])


def _temperature(root: Path, samples: np.ndarray) -> np.ndarray:
    levels = [int(v) for v in _read(root, "level")]
    return _read(root, "temperature")[samples][:, [levels.index(v) for v in LEVELS]]


def _epoch(pipe: Any) -> list[Any]:
    pipe.reset()
    return list(pipe)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the static arrays read whole from the store, in order (the real reader,
    counted)."""
    seen: list[str] = []
    real: Callable[..., np.ndarray] = static_module._read_whole

    def counted(zstore: Any, base: Any, timeout_s: float) -> np.ndarray:
        seen.append(base.path)
        return real(zstore, base, timeout_s)

    monkeypatch.setattr(static_module, "_read_whole", counted)
    return seen


def test_set_views_changes_a_stacks_static_and_forcing_members_from_the_next_epoch(
    tmp_path: Path, reads: list[str]
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    t = g["temperature"].sel(level=LEVELS)
    lsm, oro = _read(root, "land_sea_mask"), _read(root, "orography")
    sun = Forcings("x", view=g["2m_temperature"], names=["cos_solar_zenith"])
    clock = Forcings("x", view=g["2m_temperature"], names=["local_time_sin", "year_progress_cos"])
    before = stack({"t": t, "lsm": g["land_sea_mask"], "sun": sun, "t2m": g["2m_temperature"]})
    # another static member added, other forcings, another order and layout
    after = stack(
        {"t": t, "oro": g["orography"], "clock": clock, "t2m": g["2m_temperature"],
         "lsm": g["land_sea_mask"]},
        layout="channels_last",
    )  # fmt: skip
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": before}, batch_size=4, shuffle=False)
    try:
        assert reads == ["land_sea_mask"]  # at build
        first = _epoch(pipe)
        pipe.set_views({"x": after})
        assert reads == ["land_sea_mask", "orography"]  # the new one only, once
        assert first[0].channels["x"] == ["t@1000", "t@350", "lsm", "cos_solar_zenith", "t2m"]
        second = _epoch(pipe)
        pipe.set_views({"x": stack({"t": t, "t2m": g["2m_temperature"]})})
        third = _epoch(pipe)
        pipe.set_views({"x": after})  # back: nothing read again
        fourth = _epoch(pipe)
    finally:
        pipe.close()
    assert reads == ["land_sea_mask", "orography"]
    for b in first:
        s, x = b.sample_indices["x"], b.arrays["x"]
        suns = sun.compute(b.coords["x"]["time"])["cos_solar_zenith"]
        want = np.concatenate(
            [_temperature(root, s), np.broadcast_to(lsm, (len(b), 1, 6, 8)), suns[:, None],
             _read(root, "2m_temperature")[s][:, None]],
            axis=1,
        )  # fmt: skip
        np.testing.assert_allclose(x, want, rtol=1e-6)
    for b in [*second, *fourth]:
        s, x = b.sample_indices["x"], b.arrays["x"]
        assert b.channels["x"] == ["t@1000", "t@350", "oro", "local_time_sin",
                                   "year_progress_cos", "t2m", "lsm"]  # fmt: skip
        f = clock.compute(b.coords["x"]["time"])
        want = np.concatenate(
            [_temperature(root, s), np.broadcast_to(oro, (len(b), 1, 6, 8)),
             f["local_time_sin"][:, None], f["year_progress_cos"][:, None],
             _read(root, "2m_temperature")[s][:, None], np.broadcast_to(lsm, (len(b), 1, 6, 8))],
            axis=1,
        )  # fmt: skip
        np.testing.assert_allclose(x, np.moveaxis(want, 1, -1), rtol=1e-6)
    for b in third:
        s = b.sample_indices["x"]
        assert b.channels["x"] == ["t@1000", "t@350", "t2m"]
        want = np.concatenate([_temperature(root, s), _read(root, "2m_temperature")[s][:, None]], 1)
        np.testing.assert_array_equal(b.arrays["x"], want)
    assert sum(map(len, second)) == sum(map(len, third)) == N


def test_set_views_gives_a_pipeline_without_stacks_one_with_static_and_forcing_members(
    tmp_path: Path, reads: list[str]
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    sun = Forcings("x", view=g["2m_temperature"], names=["toa_incident_solar_radiation"])
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": g["2m_temperature"]}, batch_size=5)
    try:
        assert reads == []
        pipe.set_views({"x": stack({"t2m": g["2m_temperature"], "oro": g["orography"],
                                    "sun": sun})})  # fmt: skip
        batches = _epoch(pipe)
    finally:
        pipe.close()
    assert reads == ["orography"]
    oro = _read(root, "orography")
    for b in batches:
        s = b.sample_indices["x"]
        tisr = sun.compute(b.coords["x"]["time"])["toa_incident_solar_radiation"]
        want = np.stack(
            [_read(root, "2m_temperature")[s], np.broadcast_to(oro, (len(b), 6, 8)), tisr], 1
        )
        np.testing.assert_allclose(b.arrays["x"], want, rtol=1e-6)
        assert b.channels["x"] == ["t2m", "oro", "toa_incident_solar_radiation"]
    assert sum(map(len, batches)) == N


def test_set_views_standardises_a_new_static_member_with_the_stacks_statistics(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    members = {"t2m": g["2m_temperature"], "oro": g["orography"]}
    stats = fit_statistics(root, manifest, members)
    pipe = insitu_pipeline(root, manifest, {"x": stack({"t2m": g["2m_temperature"]})},
                           batch_size=6)  # fmt: skip
    try:
        pipe.set_views({"x": stack(members, normalize=stats)})
        batches = _epoch(pipe)
    finally:
        pipe.close()
    oro = _read(root, "orography").astype(np.float64)
    want = (oro - float(stats.mean["oro"])) / float(stats.std["oro"])
    for b in batches:
        np.testing.assert_allclose(b.arrays["x"][:, 1], np.broadcast_to(want, (len(b), 6, 8)),
                                   rtol=1e-5)  # fmt: skip


def test_set_views_reads_a_new_static_member_from_the_persistent_cache_the_next_run(
    tmp_path: Path, reads: list[str]
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    cache = {"cache_dir": tmp_path / "cache", "persist": True}
    views = stack({"t2m": g["2m_temperature"], "oro": g["orography"]})
    pipe = insitu_pipeline(root, manifest, {"x": g["2m_temperature"]}, batch_size=6, **cache)
    try:
        pipe.set_views({"x": views})
        _epoch(pipe)
    finally:
        pipe.close()
    assert reads == ["orography"]  # read once, and kept in the cache
    again = insitu_pipeline(root, manifest, {"x": g["2m_temperature"]}, batch_size=6, **cache)
    try:
        again.set_views({"x": views})
        batches = _epoch(again)
    finally:
        again.close()
    assert reads == ["orography"]  # from the cache: not read again
    for b in batches:
        np.testing.assert_array_equal(
            b.arrays["x"][:, 1], np.broadcast_to(_read(root, "orography"), (len(b), 6, 8))
        )
    changed = zarr.open_array(root / "orography", mode="r+")
    changed[:3] = -np.arange(24, dtype=np.float32).reshape(3, 8)  # one stored object of two
    third = insitu_pipeline(root, manifest, {"x": g["2m_temperature"]}, batch_size=6, **cache)
    try:
        third.set_views({"x": views})
        batch = _epoch(third)[0]
    finally:
        third.close()
    assert reads == ["orography", "orography"]  # its cached copy is stale: read again
    np.testing.assert_array_equal(batch.arrays["x"][0, 1], _read(root, "orography"))


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_datamodules_set_views_gives_its_training_pipeline_other_static_members(
    tmp_path: Path, reads: list[str]
) -> None:
    from insitubatch_nodes import PlanConfig
    from insitubatch_nodes.lightning import InSituDataModule

    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    before = stack({"t2m": g["2m_temperature"], "lsm": g["land_sea_mask"]})
    after = stack({"oro": g["orography"], "t2m": g["2m_temperature"]})
    dm = InSituDataModule(root, {"x": before}, manifest, config=PlanConfig(batch_size=4),
                          transform=lambda b: b, log_report=False)  # fmt: skip
    try:
        loader = dm.train_dataloader()
        first = list(loader)
        dm.set_views({"x": after})
        second = list(loader)
    finally:
        dm.teardown("fit")
    assert reads == ["land_sea_mask", "orography"]
    t2m, lsm, oro = (_read(root, n) for n in ("2m_temperature", "land_sea_mask", "orography"))
    for b in first:
        want = np.stack([t2m[b.sample_indices["x"]], np.broadcast_to(lsm, (len(b), 6, 8))], 1)
        np.testing.assert_array_equal(b.arrays["x"], want)
    for b in second:
        assert b.channels["x"] == ["oro", "t2m"]
        want = np.stack([np.broadcast_to(oro, (len(b), 6, 8)), t2m[b.sample_indices["x"]]], 1)
        np.testing.assert_array_equal(b.arrays["x"], want)
    assert sum(map(len, second)) == N


def test_set_views_refuses_forcings_whose_times_the_batches_do_not_carry(tmp_path: Path) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    sun = Forcings("x", view=g["2m_temperature"], names=["cos_solar_zenith"])
    pipe = insitu_pipeline(root, manifest, {"x": g["temperature"], "y": g["2m_temperature"]},
                           batch_size=6, coords=[])  # fmt: skip
    try:
        with pytest.raises(ValueError, match="times"):
            pipe.set_views({"x": stack({"t2m": g["2m_temperature"], "sun": sun}),
                            "y": g["temperature"]})  # fmt: skip
    finally:
        pipe.close()


def test_set_views_mid_epoch_leaves_the_epoch_in_progress_its_stacks_constants(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr")
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    before = stack({"t2m": g["2m_temperature"], "lsm": g["land_sea_mask"]})
    after = stack({"oro": g["orography"], "t2m": g["2m_temperature"]})
    pipe = insitu_pipeline(root, manifest, {"x": before}, batch_size=2, prefetch_depth=4)
    try:
        it = iter(pipe)
        first = [next(it)]
        pipe.set_views({"x": after})  # the prefetcher has batches of this epoch queued
        first += list(it)
        second = _epoch(pipe)
    finally:
        pipe.close()
    lsm, oro = _read(root, "land_sea_mask"), _read(root, "orography")
    assert sum(map(len, first)) == sum(map(len, second)) == N
    for b in first:
        assert b.channels["x"] == ["t2m", "lsm"]
        np.testing.assert_array_equal(b.arrays["x"][:, 1], np.broadcast_to(lsm, (len(b), 6, 8)))
    for b in second:
        assert b.channels["x"] == ["oro", "t2m"]
        np.testing.assert_array_equal(b.arrays["x"][:, 0], np.broadcast_to(oro, (len(b), 6, 8)))
