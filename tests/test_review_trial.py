"""Review trial of the package changes merged on 2026-12-07 (a654182..main).

Found (proved here):

* The time checks' coordinate name: ``anchor_steps`` names its ``SampleSteps`` ``"time"``
  whatever the anchor array's time coordinate is called, unless only sample indices are in
  ``missing=``: a time stride (or dates in ``missing=``) over ``valid_time`` refuses "no time
  of 'time' lies on stride" and today's calendar-month refusals say "the times of 'time'
  step by calendar months" - naming a coordinate the store does not have. Fixed with the
  saved states' ``missing_steps`` fingerprints unchanged (``SampleSteps.hashed_coord``).

* A collection of independent members with monthly dates was refused by
  ``MemberMap._check_steps`` (one fixed step per member, shown in nanoseconds, the advice
  "leave this member out" wrong when every member is monthly), even with ``missing=()``,
  where a single monthly store is counted in calendar months since today's change. Members
  stepping by the same ``k`` calendar months now pass (``io.calendars.month_step``, the rule
  of ``anchor_steps.calendar_ticks``), and the checks count them in months.

Tried and found right (no test kept): forcings NaN at NaT / ``None`` (datetime64 and cftime,
all missing, 0-D), the solar forcings' NaN rows; ``calendar_ticks`` for monthly, seasonal,
half-yearly and yearly steps (every k-month spread is within its 3 days); ``deal_runs``
unshuffled store order (each rank's run ascending, its padded sample last as documented);
a NaT in monthly times (2 anchors dropped as nat, none as gap); a batch transform's exception
note (the batch is tried again by next(), then the epoch completes); Forcings' solar
refusal of a noleap store at build (local_time_* kept).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

pytestmark = pytest.mark.timeout(60)


def _store(root: Path, times: np.ndarray, name: str) -> Path:
    """A (name, x) store whose dimension coordinate ``name`` holds ``times`` (hours since
    2001-01-01)."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    n = len(times)
    data = group.create_array("t2m", shape=(n, 2), chunks=(8, 2), dtype="f4",
                              dimension_names=(name, "x"))  # fmt: skip
    data[:] = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    coord = group.create_array(name, shape=(n,), chunks=(n,), dtype="i8",
                               dimension_names=(name,))  # fmt: skip
    coord[:] = times
    coord.attrs.update({"units": "hours since 2001-01-01", "calendar": "standard"})
    return root


def test_a_time_stride_off_the_times_names_the_stores_own_time_coordinate(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "vt.zarr", np.arange(32) * 6 + 3, "valid_time")  # 03, 09, ...
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError) as info:
        insitu_pipeline(root, manifest, {"x": g}, stride="6h")
    assert "'valid_time'" in str(info.value), str(info.value)


def test_a_time_stride_over_monthly_times_names_the_stores_own_time_coordinate(
    tmp_path: Path,
) -> None:
    months = np.arange("2001-01", "2004-01", dtype="datetime64[M]").astype("datetime64[h]")
    hours = (months - np.datetime64("2001-01-01T00", "h")).astype(np.int64)
    root = _store(tmp_path / "m.zarr", hours, "valid_time")
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="calendar months") as info:
        insitu_pipeline(root, manifest, {"x": g}, stride="31D", missing=())
    assert "'valid_time'" in str(info.value), str(info.value)


def test_the_read_plan_state_of_a_time_stride_over_another_coordinate_name_keeps_its_hash(
    tmp_path: Path,
) -> None:
    # states saved before the fix hashed "time" for such a coordinate: they still restore
    from dataclasses import replace

    root = _store(tmp_path / "vt.zarr", np.arange(32) * 6, "valid_time")
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": g}, stride="12h", batch_size=4)
    try:
        steps = pipe.stages.plan.manifest.steps
        assert steps is not None and steps.coord == "valid_time"
        legacy = replace(steps, coord="time", hashed_coord=None).fingerprint()
        assert pipe.stages.plan.config()["missing_steps"] == legacy
    finally:
        pipe.close()


def test_a_collection_of_monthly_members_is_checked_in_calendar_months_as_one_store_is(
    tmp_path: Path,
) -> None:
    from insitubatch_nodes import Collection, split_by_member

    root = tmp_path / "c.zarr"
    top = zarr.open_group(root, mode="w", zarr_format=3)
    for name, start, stop in (("a", "2001-01", "2001-07"), ("b", "2002-01", "2002-07")):
        months = np.arange(start, stop, dtype="datetime64[M]").astype("datetime64[h]")
        hours = (months - np.datetime64("2001-01-01T00", "h")).astype(np.int64)
        _store_in(top.create_group(name), hours)
    coll = Collection.from_groups(root, ["a", "b"], {"t2m": "t2m"})
    v = coll["t2m"]
    pipe = insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": v, "y": v.shift(1)},
                           batch_size=2, missing=())  # fmt: skip
    try:
        assert pipe.stages.plan.dropped.get("gap", 0) == 0  # (each member: 5 windows kept)
        steps = pipe.stages.plan.manifest.steps
        assert steps is not None and np.datetime_data(steps.unit)[0] == "M"
        rows = sorted(int(i) for b in pipe for i in b.sample_indices["x"])
        assert len(rows) == 10, rows
    finally:
        pipe.close()


def _store_in(group: zarr.Group, hours: np.ndarray) -> None:
    n = len(hours)
    data = group.create_array("t2m", shape=(n, 2), chunks=(4, 2), dtype="f4",
                              dimension_names=("time", "x"))  # fmt: skip
    data[:] = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    coord = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8",
                               dimension_names=("time",))  # fmt: skip
    coord[:] = hours
    coord.attrs.update({"units": "hours since 2001-01-01", "calendar": "standard"})
