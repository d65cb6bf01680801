"""Forecast samples: the anchor stride and the anchors dropped for missing steps.

The oracles are xarray (the stores are written with ``Dataset.to_zarr``; which times lie on a
6-hourly grid comes from ``ds.time.dt.hour % 6 == 0``), zarr (the arrays a batch must hold, the
stored objects on disk) and hand-written lists of the anchors a missing step must drop. Nothing
here asks the package's plan what the right answer is.
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
from insitubatch_nodes.plan.anchors import SampleSteps
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.parts import resolve_windows
from insitubatch_nodes.plan.patches import unit_geometry
from insitubatch_nodes.plan.schedule import schedule_floors, working_set_bytes
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from tests.helpers import counting_store
from tests.resume_helpers import (
    build_pipeline,
    epochs_of,
    pipe_config,
    record,
    reference_run,
    take_state,
    write_store,
)

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

N_TIME = 96  # hourly steps, four days


def _hourly_store(
    path: Path,
    spc: int,
    *,
    times: Any = None,
    start: str = "2020-01-01T03:00",
    calendar: str | None = None,
) -> Path:
    """``t2m`` ``(time, lat, lon)`` written by xarray, ``spc`` steps per stored object; the
    time coordinate hourly from ``start`` (or ``times``), NaT written as NaN."""
    if times is None:
        if calendar is None:
            times = pd.date_range(start, periods=N_TIME, freq="h").values
        else:
            times = xr.date_range(
                start, periods=N_TIME, freq="h", calendar=calendar, use_cftime=True
            )
    n = len(times)
    data = np.random.default_rng(0).standard_normal((n, 3, 4)).astype(np.float32)
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), data)},
        coords={"time": times, "lat": [1.0, 2.0, 3.0], "lon": [0.0, 1.0, 2.0, 3.0]},
    )
    tenc: dict[str, Any] = {"units": "hours since 2000-01-01", "dtype": "float64"}
    if calendar is not None:
        tenc["calendar"] = calendar
    ds.to_zarr(path, mode="w", zarr_format=3, consolidated=False,
               encoding={"t2m": {"chunks": (spc, 3, 4)}, "time": tenc})  # fmt: skip
    return path


def _xr_times(path: Path) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with xr.open_zarr(path, consolidated=False) as ds:
            return np.asarray(ds.time.values)


def _run(pipe: Any) -> list[Any]:
    try:
        return list(pipe)
    finally:
        pipe.close()


def _key(ci: int) -> str:
    return f"t2m/c/{ci}/0/0"


@pytest.mark.parametrize("spc", [1, 4], ids=["one-step-per-chunk", "four-steps-per-chunk"])
def test_a_6h_stride_anchors_the_times_xarray_selects_and_reads_only_the_on_grid_objects(
    tmp_path: Path, spc: int
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc)
    with xr.open_zarr(root, consolidated=False) as ds:
        on_grid = ds.time.where(ds.time.dt.hour % 6 == 0, drop=True).values
        all_times = ds.time.values
    index = {t: i for i, t in enumerate(all_times.tolist())}
    want = [index[t] for t in on_grid.tolist() if index[t] + 1 < N_TIME]  # y reads anchor + 1
    assert want[0] == 3  # the store starts at 03 UTC: index 0 is not an anchor
    data = zarr.open_array(root / "t2m", mode="r")[...]
    store = counting_store(root)
    g = open_geometries(store)["t2m"]
    pipe = insitu_pipeline(store, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g, "y": g.shift(1)},
                           stride="6h", batch_size=5, block_chunks=2, seed=3)  # fmt: skip
    n_batches = len(pipe.stages.plan)
    try:
        batches = list(pipe)
        gets = pipe.stats()["gets"]
    finally:
        pipe.close()
    assert len(batches) == n_batches == -(-len(want) // 5)
    rows = np.concatenate([b.sample_indices["x"] for b in batches])
    assert sorted(rows.tolist()) == want
    for b in batches:
        np.testing.assert_array_equal(b["x"], data[b.sample_indices["x"]])
        np.testing.assert_array_equal(b["y"], data[b.sample_indices["x"] + 1])
        assert (pd.DatetimeIndex(b.coords["x"]["time"]).hour % 6 == 0).all()
    on_grid_objects = {_key(i // spc) for a in want for i in (a, a + 1)}
    data_gets = {k: n for k, n in store.chunk_counts().items() if k.startswith("t2m/")}
    assert data_gets == dict.fromkeys(on_grid_objects, 1)
    assert gets == len(on_grid_objects)
    if spc == 1:
        assert len(on_grid_objects) == 2 * len(want) < N_TIME // 2


def test_an_int_stride_keeps_every_kth_sample_from_index_0(tmp_path: Path) -> None:
    root = _hourly_store(tmp_path / "h.zarr", 4)
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g, "y": g.shift(1)}
    for k in (1, 2, 5, 7):
        plan = plan_epoch(manifest, views, PlanConfig(stride=k, batch_size=4), epoch=2)
        assert sorted(plan.anchors.tolist()) == list(range(0, N_TIME - 1, k))
    rows = np.concatenate([b.sample_indices["x"] for b in _run(
        insitu_pipeline(root, manifest, views, stride=5, batch_size=4))])  # fmt: skip
    assert sorted(rows.tolist()) == list(range(0, N_TIME - 1, 5))


def test_a_stride_that_is_not_a_multiple_of_the_data_step_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", 1)
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"stride 90 minutes is not a multiple of the data's "
                       r"step \(1h"):  # fmt: skip
        insitu_pipeline(root, manifest, {"x": g}, stride="90min")
    with pytest.raises(ValueError, match="time step"):  # no times given to a bare plan
        plan_epoch(manifest, {"x": g}, PlanConfig(stride="6h"))


@pytest.mark.parametrize("calendar", ["standard", "noleap"])
def test_times_off_the_whole_second_are_refused_saying_why_and_what_to_do(
    tmp_path: Path, calendar: str
) -> None:
    # hourly times stored as float32 days: xarray decodes 01:00 as 01:00:00.000107 (float32
    # cannot hold 1/24). A time stride compares whole seconds, and the user chose no unit: the
    # refusal names the coordinate, the time in full and the way out, not "count in '1s'".
    root = tmp_path / "f32.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array("t2m", shape=(48, 2), chunks=(8, 2), dtype="f4",
                       dimension_names=("time", "x"))  # fmt: skip
    time = group.create_array("time", shape=(48,), chunks=(48,), dtype="f4",
                              dimension_names=("time",))  # fmt: skip
    time[:] = (np.arange(48) / 24).astype(np.float32)
    time.attrs.update({"units": "days since 2001-01-01", "calendar": calendar})
    assert str(_xr_times(root)[1]).startswith("2001-01-01") and "01:00:00.0001" in str(
        _xr_times(root)[1]
    ).replace("T", " ")  # the oracle: off the whole second
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError) as info:
        insitu_pipeline(root, manifest, {"x": g}, stride="6h")
    message = str(info.value)
    assert "'time'" in message and "whole second" in message and "01:00:00.0001" in message
    assert "float32" in message and "int stride" in message
    assert "such as '1s'" not in message  # the stride counts in seconds already


def _broken_times() -> tuple[np.ndarray, dict[str, list[int]]]:
    """Hourly times with a NaT, a gap and a duplicate, and the anchors each must drop (views
    read ``a`` and ``a + 1``), written out by hand."""
    t = pd.date_range("2020-01-01", periods=48, freq="h").values.copy()
    t[10] = np.datetime64("NaT", "ns")  # anchors 9 (its a + 1) and 10 (its a)
    t[21:] += np.timedelta64(1, "h")  # a gap between 20 and 21: anchor 20
    t[30] = t[29]  # a duplicate: anchors 29 (0 h to 30) and 30 (2 h to 31)
    return t, {"nat": [9, 10], "gap": [20, 29, 30]}


def test_anchors_are_dropped_for_nat_gaps_duplicates_listed_steps_and_absent_objects(
    tmp_path: Path,
) -> None:
    times, oracle = _broken_times()
    root = _hourly_store(tmp_path / "m.zarr", 4, times=times)
    (root / "t2m" / "c" / "11" / "0" / "0").unlink()  # samples 44..47 have no stored object
    oracle["missing"] = [4, 5, 39, 40]  # listed: sample 5 and the time of sample 40
    oracle["absent_object"] = [43, 44, 45, 46]  # (47 + 1 lies outside the array)
    xr_times = _xr_times(root)
    assert np.isnat(xr_times[10])
    store = counting_store(root)
    g = open_geometries(store)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, {"x": g, "y": g.shift(1)}, batch_size=6,
                           missing=[5, xr_times[40]], missing_objects="drop")  # fmt: skip
    dropped = pipe.stages.plan.dropped
    rows = np.concatenate([b.sample_indices["x"] for b in _run(pipe)])
    assert dropped == {reason: len(a) for reason, a in oracle.items()}
    gone = {a for anchors in oracle.values() for a in anchors}
    assert sorted(rows.tolist()) == [a for a in range(47) if a not in gone]
    assert _key(11) not in store.chunk_counts()  # the absent object is never asked for
    assert pipe.stages.plan.epoch_plan().dropped == dropped
    # the same times as strings, and missing=() checks the times and lists nothing
    strings = insitu_pipeline(root, manifest, {"x": g, "y": g.shift(1)},
                              missing=[str(xr_times[40])])  # fmt: skip
    assert strings.stages.plan.dropped == {"nat": 2, "gap": 3, "missing": 2}
    strings.close()
    bare = insitu_pipeline(root, manifest, {"x": g, "y": g.shift(1)}, missing=())
    assert bare.stages.plan.dropped == {"nat": 2, "gap": 3, "missing": 0}
    bare.close()


def test_a_missing_date_between_two_steps_is_refused_naming_them_and_one_outside_or_in_a_gap_passes(
    tmp_path: Path,
) -> None:
    """A typo in missing= (a wrong hour) used to drop nothing, silently."""
    times, _ = _broken_times()  # hourly from 2020-01-01T00, a 2 h gap after 20:00
    root = _hourly_store(tmp_path / "m.zarr", 4, times=times)
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g, "y": g.shift(1)}
    said = (
        r"'2020-01-01T05:30'.*between two consecutive times of 'time' "
        r"\(2020-01-01T05:00.*and 2020-01-01T06:00.*no sample has it"
    )
    with pytest.raises(ValueError, match=said):
        insitu_pipeline(root, manifest, views, missing=[3, "2020-01-01T05:30"])
    # outside the times (a list kept for a whole archive), and on the hour inside the gap
    for date in ("2019-06-01T00:00", "2020-01-03T12:00", "2020-01-01T21:00"):
        pipe = insitu_pipeline(root, manifest, views, missing=[date])
        assert pipe.stages.plan.dropped == {"nat": 2, "gap": 3, "missing": 0}, date
        pipe.close()


def test_a_time_stride_counts_only_its_own_anchors_as_dropped(tmp_path: Path) -> None:
    times, _ = _broken_times()
    root = _hourly_store(tmp_path / "m.zarr", 4, times=times)
    g = open_geometries(root)["t2m"]
    pipe = insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g, "y": g.shift(1)},
                           stride="6h", batch_size=3)  # fmt: skip
    dropped = pipe.stages.plan.dropped
    rows = sorted(np.concatenate([b.sample_indices["x"] for b in _run(pipe)]).tolist())
    # on the 6-hourly grid (times as stored: after the gap, sample i holds hour i + 1, and
    # sample 30 hour 30, the duplicate of 29's): 0, 6, 12, 18 before the gap; 23, 29, 30, 35,
    # 41, 47 after it. 29 reads the duplicate (0 h on) and 30 the step 2 h on (gaps); 47 + 1
    # lies outside the array; no on-grid anchor reads the NaT
    assert rows == [0, 6, 12, 18, 23, 35, 41]
    assert dropped == {"nat": 0, "gap": 2}


def _steps_manifest(root: Path) -> tuple[Any, dict[str, Any]]:
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    ticks = np.arange(N_TIME, dtype=np.int64) + 3 + 24 * 18262  # hours since 1970 (03 UTC)
    steps = SampleSteps(N_TIME, ticks=ticks, unit=np.timedelta64(1, "h"))
    return manifest.with_steps(steps), {"x": g, "y": g.shift(2)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stride", [3, "6h"])
def test_ranks_deal_strided_anchors_disjointly_with_equal_batch_counts(
    tmp_path: Path, world: int, stride: Any
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", 4)
    manifest, views = _steps_manifest(root)
    valid = (
        list(range(0, N_TIME - 2, 3))
        if stride == 3
        else [a for a in range(N_TIME - 2) if (a + 3) % 6 == 0]
    )
    for epoch in (0, 1):
        plans = [
            plan_epoch(manifest, views, PlanConfig(stride=stride, batch_size=4, block_chunks=3,
                                                   rank=r, world_size=world), epoch=epoch)
            for r in range(world)
        ]  # fmt: skip
        anchors = [p.anchors.tolist() for p in plans]
        union = [a for share in anchors for a in share]
        assert len(union) == len(set(union))  # disjoint
        assert set(union) <= set(valid) and len(valid) - len(union) <= world - 1
        assert len({p.n_batches for p in plans}) == 1
        assert len({len(share) for share in anchors}) == 1
        nodes = [
            ReadPlanNode(manifest, views, config=PlanConfig(stride=stride, batch_size=4,
                                                            rank=r, world_size=world))
            for r in range(world)
        ]  # fmt: skip
        assert len({len(n) for n in nodes}) == 1


def test_a_strided_run_resumes_mid_epoch_exactly_and_refuses_another_stride(
    tmp_path: Path,
) -> None:
    store = write_store(tmp_path / "era5.zarr")
    cfg = pipe_config(store, stride=3)
    ref = reference_run(cfg, epochs=2)
    per_epoch = sum(1 for r in ref if r["epoch"] == ref[0]["epoch"])
    assert all(len(r["idx"]["x"]) and all(i % 3 == 0 for i in r["idx"]["x"]) for r in ref)
    k = per_epoch // 2 + 1
    _, state = take_state(cfg, k)
    pipe = build_pipeline(cfg)
    try:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        it = epochs_of(loader)
        got = [record(next(it)) for _ in range(len(ref) - k)]
    finally:
        pipe.close()
    assert got == [{key: v for key, v in r.items() if key != "state"} for r in ref[k:]]
    for other in (1, 2):
        pipe = build_pipeline(pipe_config(store, stride=other))
        try:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            with pytest.raises(ValueError, match=r"its stride differs"):
                next(iter(loader))
        finally:
            pipe.close()


def test_a_default_config_has_the_fingerprint_it_always_had(tmp_path: Path) -> None:
    root = _hourly_store(tmp_path / "h.zarr", 4)
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    keys = set(ReadPlanNode(manifest, {"x": g}).config())
    # (and its views, recorded by every state since 2026-12-07: states without them restore)
    assert keys == {"dataset", "split", "batch_size", "block_chunks", "shuffle", "ramp", "seed",
                    "world_size", "cross_split_windows", "remainder", "views"}  # fmt: skip
    assert ReadPlanNode(manifest, {"x": g}, config=PlanConfig(stride=6)).config()["stride"] == 6
    # a time step of one data step is a stride too (numpy finds timedelta64(1, "h") == 1)
    hourly = manifest.with_steps(_steps_manifest(root)[0].steps)
    node = ReadPlanNode(hourly, {"x": g}, config=PlanConfig(stride="1h"))
    assert node.config()["stride"] == "1 hours"


def test_a_6h_stride_in_a_noleap_calendar_anchors_its_own_00_06_12_18(tmp_path: Path) -> None:
    cftime = pytest.importorskip("cftime")
    root = _hourly_store(tmp_path / "n.zarr", 2, start="2001-02-27T01:00", calendar="noleap")
    times = _xr_times(root)
    assert isinstance(times[0], cftime.DatetimeNoLeap)
    want = [i for i, t in enumerate(times) if t.hour % 6 == 0 and i + 1 < N_TIME]
    assert any(t.month == 3 and t.day == 1 for t in times[want])  # across 28 Feb (no 29th)
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"x": g, "y": g.shift(1)}
    batches = _run(insitu_pipeline(root, manifest, views, stride="6h", batch_size=4))
    rows = np.concatenate([b.sample_indices["x"] for b in batches])
    assert sorted(rows.tolist()) == want
    for b in batches:
        assert list(b.coords["x"]["time"]) == list(times[b.sample_indices["x"]])


def test_an_elastic_remainder_deals_the_strided_anchors_no_old_rank_delivered(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", 4)
    manifest, views = _steps_manifest(root)
    for stride, valid in ((3, range(0, N_TIME - 2, 3)), ("6h", range(3, N_TIME - 2, 6))):
        for old, new in ((2, 3), (3, 2), (2, 1)):
            config = PlanConfig(stride=stride, batch_size=3, block_chunks=2)
            before = [plan_epoch(manifest, views, config.for_rank(r, old), epoch=1)
                      for r in range(old)]  # fmt: skip
            k = before[0].n_batches // 2
            delivered = [a for p in before for a in p.anchors[: k * 3].tolist()]
            after = [plan_epoch(manifest, views, config.for_rank(r, new), epoch=1,
                                resumed=[(old, k)]) for r in range(new)]  # fmt: skip
            rest = [a for p in after for a in p.anchors.tolist()]
            both = delivered + rest
            assert len(both) == len(set(both)) and set(both) <= set(valid)
            assert len(valid) - len(both) <= (old - 1) + (new - 1)
            assert len({p.n_batches for p in after}) == 1 and after[0].first_batch == k


def test_the_schedule_floors_bound_every_strided_epoch(tmp_path: Path) -> None:
    path = tmp_path / "b.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t", shape=(403, 3), chunks=(8, 3), dtype="f8", fill_value=0)
    g = open_geometries(path, ["t"])["t"]
    hours = np.arange(403, dtype=np.int64) + 5  # hourly, from 05 UTC
    hours[100] = np.iinfo(np.int64).min  # a NaT
    hours[200:] += 1  # a gap
    steps = SampleSteps(403, ticks=hours, unit=np.timedelta64(1, "h"))
    m = split_by_chunk(g, (1.0, 0.0, 0.0)).with_steps(steps)
    _assert_the_floors_bound_every_strided_epoch(m, g, {"t": g}, ((7, 3, 1), (4, 2, 2), (5, 8, 3)))


def test_the_schedule_floors_bound_every_strided_epoch_of_patched_views(tmp_path: Path) -> None:
    # as above, over windows of a field cut into 2 x 3 tiles (a patched plan's units are
    # tiles: its working set counts one tile's bytes a unit)
    path = tmp_path / "p.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t", shape=(203, 4, 6), chunks=(8, 2, 3), dtype="f4", fill_value=0)
    g = open_geometries(path, ["t"])["t"]
    hours = np.arange(203, dtype=np.int64) + 5  # hourly, from 05 UTC
    hours[100:] += 1  # a gap
    steps = SampleSteps(203, ticks=hours, unit=np.timedelta64(1, "h"))
    m = split_by_chunk(g, (1.0, 0.0, 0.0)).with_steps(steps)
    patched = g.patches({1: 2, 2: 3})
    _assert_the_floors_bound_every_strided_epoch(
        m, patched, {"t": unit_geometry(g)}, ((3, 3, 1), (2, 2, 2), (5, 8, 3))
    )


def _assert_the_floors_bound_every_strided_epoch(
    m: Any, view: Any, slot_geoms: dict[str, Any], shapes: tuple[tuple[int, int, int], ...]
) -> None:
    """Every epoch's working set (both schedules, every rank, strides in samples and in time,
    ``view`` beside a shift of it) within :func:`schedule_floors`' bound, for each
    ``(batch_size, block_chunks, world_size)`` of ``shapes``."""
    for stride in (3, 13, "6h"):
        for shift in (1, 9):
            views = {"x": view, "y": view.shift(shift)}
            for bs, bc, world in shapes:
                config = PlanConfig(stride=stride, batch_size=bs, block_chunks=bc,
                                    world_size=world)  # fmt: skip
                floors = schedule_floors(m, views, config)
                for epoch in (0, 1):
                    for rank in range(world):
                        cfg = config.for_rank(rank, world)
                        for gap, bound in ((None, floors.read_once),
                                           (floors.pin_gap, floors.bounded)):  # fmt: skip
                            plan = plan_epoch(m, views, cfg, epoch=epoch, pin_gap=gap)
                            got = working_set_bytes(plan, slot_geoms)[0]
                            assert got <= bound, (stride, shift, bs, bc, world, epoch, gap)


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_data_module_drops_the_missing_steps_in_every_split_deciding_them_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lightning")
    import insitubatch_nodes.anchor_steps as builder
    from insitubatch_nodes.lightning import InSituDataModule

    times, oracle = _broken_times()
    root = _hourly_store(tmp_path / "m.zarr", 4, times=times)
    (root / "t2m" / "c" / "11" / "0" / "0").unlink()  # samples 44..47 have no stored object
    oracle["missing"] = [4, 5, 39, 40]  # listed: sample 5 and the time of sample 40
    oracle["absent_object"] = [43, 44, 45, 46]
    gone = {a for anchors in oracle.values() for a in anchors}
    listings = []
    real = builder.absent_samples
    monkeypatch.setattr(
        builder, "absent_samples", lambda *a, **k: listings.append(1) or real(*a, **k)
    )
    g = open_geometries(root)["t2m"]
    dm = InSituDataModule(root, {"x": g, "y": g.shift(1)}, (0.5, 0.25, 0.25),
                          config=PlanConfig(batch_size=4), missing=[5, _xr_times(root)[40]],
                          missing_objects="drop", transform=lambda b: b.sample_indices["x"],
                          log_report=False)  # fmt: skip
    # chunks of 4: train holds samples 0..23, val 24..35, test 36..47; y = x + 1 stays inside
    splits = {"train": range(0, 23), "val": range(24, 35), "test": range(36, 47)}
    loaders = {"train": dm.train_dataloader, "val": dm.val_dataloader, "test": dm.test_dataloader}
    try:
        for split, anchors in splits.items():
            loader = loaders[split]()
            rows = sorted(int(i) for idx in loader for i in idx)
            assert rows == [a for a in anchors if a not in gone], split
            want = {reason: len([a for a in a_s if a in anchors]) for reason, a_s in oracle.items()}
            assert loader.pipeline.stages.plan.dropped == want, split
    finally:
        dm.teardown("fit")
    assert len(listings) == 1  # the store's objects were listed once, for all three splits
    with pytest.raises(ValueError, match="missing_objects"):
        InSituDataModule(root, ["t2m"], missing_objects="skip")
    with pytest.raises(TypeError, match="missing must be"):
        InSituDataModule(root, ["t2m"], missing="2020-01-01")  # type: ignore[arg-type]


@pytest.mark.parametrize("coords", [None, ["time"], ()], ids=["default", "named", "none"])
def test_a_time_stride_reads_and_decodes_the_time_coordinate_once_with_the_coords_carried(
    tmp_path: Path, coords: Any
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", 4)
    store = counting_store(root)
    g = open_geometries(store)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    store.reset_counts()
    pipe = insitu_pipeline(store, manifest, {"x": g, "y": g.shift(1)}, stride="6h",
                           missing=[5], coords=coords, batch_size=4)  # fmt: skip
    pipe.close()
    # what xarray wrote for the time coordinate: its chunk objects (not its metadata)
    objects = [str(p.relative_to(root)) for p in (root / "time").rglob("*") if p.is_file()]
    time_chunks = [k for k in objects if k.rsplit("/", 1)[-1] != "zarr.json"]
    assert time_chunks
    counts = store.chunk_counts()
    assert [counts.get(k, 0) for k in time_chunks] == [1] * len(time_chunks), counts


def test_the_data_step_of_runs_is_taken_within_each_run_and_absent_when_no_run_holds_two(
    tmp_path: Path,
) -> None:
    # runs [0, 4), [4], [5], [6], [7]: the first 6 ticks apart, the others 3 apart from each
    # other (the most common difference across runs, not a step of any)
    ticks = np.array([0, 6, 12, 18, 1000, 1003, 1006, 1009], dtype=np.int64)
    one = SampleSteps(8, ticks=ticks)
    runs = SampleSteps(8, ticks=ticks, runs=np.array([0, 4, 5, 6, 7]))
    assert one.data_step == 3 and runs.data_step == 6
    assert runs.fingerprint() != one.fingerprint()
    singles = SampleSteps(4, ticks=np.array([0, 6, 12, 18]), runs=np.arange(4))
    assert singles.data_step is None
    group = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=3)
    group.create_array("x", shape=(4, 2), chunks=(1, 2), dtype="f4")
    view = open_geometries(tmp_path / "s.zarr", ["x"])["x"].window(["-6h", "0h"])
    with pytest.raises(ValueError, match=r"no two consecutive times in one run .* in samples"):
        resolve_windows({"w": view}, singles)
    with pytest.raises(ValueError, match="must ascend from 0"):
        SampleSteps(4, ticks=np.arange(4), runs=np.array([1, 2]))
