"""Time axes at their edges: stores written newest first, repeated times in cftime calendars and
in a collection's members, forcings of Gregorian dates outside 1677-2262 (the timeedges trial
of 2026-12-07).

The stores are written by xarray (``Dataset.to_zarr``, CF times in a calendar); which samples a
split or an epoch holds, each row's time and value, which times repeat and the forcings are
worked out here with xarray, pandas, cftime and numpy (the USNO formula written again below),
never asked of the package's plan.

Found (fixed; each test failed before the fix):

- **``split_by_chunk`` on times written newest first trained on the newest data.** Contiguous
  splits took the chunks in index order, so ``train`` held the latest times and ``test`` the
  earliest: a split a forecaster validating on the future would not expect, and which leaks
  the future into training. ``coord=`` (the time coordinate) now orders the splits by its
  values, lowest first (``train`` the earliest times), whatever the direction of the samples
  (``Coordinate.decreasing``); ``coord=`` no longer needs ``sample_range``. Without ``coord``
  the index order stays (reproducible manifests), and ``insitu_pipeline`` warns, from the
  times its batches carry, where the times run backwards and a contiguous ``train`` lies
  after ``val``/``test`` in time, saying to pass ``coord=``. ``InSituDataModule`` given
  ``(train, val, test)`` fractions made the same index-order split; it now splits in time
  order where the first label's array has a time coordinate.
- **On times written newest first, the time checks were refused** (a time stride, windows
  in time deltas, ``missing=``: "write the store sorted, or give an int stride, offsets in
  samples and no missing="), so such a store's windows could only pair samples by index,
  across its gaps. Now the checks count the steps back in time (``SampleSteps.backwards``,
  ticks negated: one sample on is one step earlier; a window's deltas resolve the other
  way round, ``"-6h"`` a sample on); each row's steps are the times its window names and
  none crosses a gap, as xarray's times say. A collection's independent members whose times
  run backwards are still refused (each would need its own direction).
- **The repeated-times warning skipped cftime dates.** A ``noleap``, ``360_day`` or
  pre-1582 ``standard`` store with a time written twice built silently and read both copies;
  a ``datetime64`` store warned. Now cftime dates are compared as exact microseconds in their
  calendar (passes in Python at the build: measured 0.19-0.29 s for 200,000 ``noleap``
  dates, whose decoding took 1.16 s).
- **A collection member with a repeated time was refused** ("steps from T to T", even under
  ``missing=()``, which takes a single store's repeated time). Now a member's later copy of a
  time is a gap, as in a single store (the plan already counted copies run by run): under the
  checks the first copy is the time's; without them every copy is read and the build warns
  naming the member (before, the default coordinates were left out with a log line).
- **``Forcings`` refused Gregorian dates outside 1677-2262.** A paleoclimate store in 1500
  (``standard``, Julian there) or 2300 (``proleptic_gregorian``) decodes to cftime dates, and
  the solar forcings and every ``convention="graphcast"`` forcing were refused at the build;
  ``datetime64[s]`` times outside that range were refused by ``Forcings.compute``. Such dates
  name instants (unlike a ``noleap`` date), so they are now computed there (the functions
  take them too, ``forcing_calendar.instants``), outside the nanosecond-keyed memory.

Tried and found right (no change needed): on times written newest first, windows and shifts in
samples read by index as asked (``shift(-1)`` is the next time), and with the time-ordered
split no row of ``train`` reads a ``val`` time (the split-edge rule); a value window
(``sample_range`` of dates with ``coord=``) takes the right samples and now splits in time
order; ``fit_statistics``' ``diff_std`` over the time-ordered ``train`` equals numpy's over
its one-step pairs (1.5418 both; checked by hand, ``tests/test_coordlen_trial.py`` keeps the
claim); monthly dates written newest first with a month absent pair across no gap, and a
``missing=`` date between two months is refused, one inside the gap taken; a ``noleap``
collection member with a time re-sent out of place takes its first copy under ``missing=()``,
a ``"12h"`` stride and a listed date (every copy dropped). Increasing times split as before
with or without ``coord``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import open_with_xarray, write_sst
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.forcings import (
    FORCINGS,
    GRAPHCAST_NAMES,
    Forcings,
    cos_solar_zenith,
    toa_incident_solar_radiation,
)
from insitubatch_nodes.io import open_coordinates
from insitubatch_nodes.io.collection import Collection, concat

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")
cftime = pytest.importorskip("cftime")

pytestmark = pytest.mark.timeout(60)

LAT, LON = [10.0, 60.0], [0.0, 90.0, 200.0]


def _write(root: Path, times: Any, *, chunk: int = 2, **kw: Any) -> Path:
    return write_sst(root, times, chunk=chunk, **kw)


def _oracle(root: Path) -> Any:
    return open_with_xarray(root)


def _epoch(pipe: Any) -> list[Any]:
    with pipe:
        return list(Loader(pipe))


# ---------------------------------------------------------------------------------------------
# Stores written newest first
# ---------------------------------------------------------------------------------------------

N_BACK = 16  # 8 objects of 2 steps: 4 train, 2 val, 2 test


@pytest.fixture
def backwards(tmp_path: Path) -> Path:
    """Sixteen 6-hourly times, newest first (2000-01-04T18 .. 2000-01-01T00)."""
    times = pd.date_range("2000-01-01", periods=N_BACK, freq="6h")[::-1]
    return _write(tmp_path / "back.zarr", times)


@pytest.mark.parametrize("window", [None, ("2000-01-01T06", "2000-01-03T00")])
def test_a_split_by_time_of_a_store_written_newest_first_trains_on_the_earliest_times(
    backwards: Path, window: Any
) -> None:
    ds = _oracle(backwards)
    times = ds.time.values
    g = open_geometries(backwards)["sst"]
    time = open_coordinates(backwards, g)["time"]
    manifest = split_by_chunk(g, (0.5, 0.25, 0.25), sample_range=window, coord=time)
    inside = np.ones(N_BACK, bool)
    if window is not None:
        lo, hi = (np.datetime64(w) for w in window)
        inside = (times >= lo) & (times < hi)
    # the oracle: whole objects of 2 steps in time order, earliest first (by xarray's times)
    objects = sorted({i // 2 for i in np.flatnonzero(inside)}, key=lambda c: times[2 * c])
    counts = [len(objects) // 2, len(objects) // 4]  # (8 and 4 objects: no remainder)
    want = {"train": objects[: counts[0]], "val": objects[counts[0] : counts[0] + counts[1]],
            "test": objects[counts[0] + counts[1] :]}  # fmt: skip
    for name in ("train", "val", "test"):
        assert manifest.chunks(name) == sorted(want[name]), name
    last = {name: times[manifest.samples(name)] for name in ("train", "val", "test")}
    assert last["train"].max() < last["val"].min() <= last["val"].max() < last["test"].min()
    # the epoch: each row's time and values are xarray's, and train's are its earliest times
    pipe = insitu_pipeline(backwards, manifest, {"x": g}, batch_size=3, shuffle=False)
    rows = [
        (t, x) for b in _epoch(pipe) for t, x in zip(b.coords["x"]["time"], b["x"], strict=True)
    ]
    got = np.array(sorted(t for t, _ in rows))
    np.testing.assert_array_equal(got, np.sort(times[inside])[: len(got)])
    for t, x in rows:
        np.testing.assert_array_equal(x, ds.sst.sel(time=t).values)


def test_a_store_written_oldest_first_splits_alike_with_or_without_its_time(
    tmp_path: Path,
) -> None:
    root = _write(tmp_path / "fwd.zarr", pd.date_range("2000-01-01", periods=11, freq="6h"))
    g = open_geometries(root)["sst"]
    time = open_coordinates(root, g)["time"]
    assert not time.decreasing
    assert split_by_chunk(g, (0.6, 0.2, 0.2), coord=time) == split_by_chunk(g, (0.6, 0.2, 0.2))
    assert split_by_chunk(g, (0.6, 0.2, 0.2), contiguous=False, seed=4, coord=time) == (
        split_by_chunk(g, (0.6, 0.2, 0.2), contiguous=False, seed=4)
    )


def test_a_pipeline_warns_where_a_store_written_newest_first_was_split_in_sample_order(
    backwards: Path,
) -> None:
    g = open_geometries(backwards)["sst"]
    by_index = split_by_chunk(g, (0.5, 0.25, 0.25))
    by_time = split_by_chunk(g, (0.5, 0.25, 0.25), coord=open_coordinates(backwards, g)["time"])
    with pytest.warns(UserWarning, match=r"run backwards .*'train' holds the times after those of "
                      r"'test'.*coord=open_coordinates\(store, geom\)\['time'\]"):  # fmt: skip
        insitu_pipeline(backwards, by_index, {"x": g}, batch_size=4).close()
    with pytest.warns(UserWarning, match=r"run backwards .*'train' holds the times after"):
        insitu_pipeline(backwards, by_index, {"x": g}, batch_size=4, coords=(), missing=()).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        insitu_pipeline(backwards, by_time, {"x": g}, batch_size=4).close()
        insitu_pipeline(backwards, by_time, {"x": g}, batch_size=4, stride="12h").close()
        insitu_pipeline(
            backwards, by_index, {"x": g}, batch_size=4, coords=()
        ).close()  # (none read)


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_data_module_given_fractions_splits_a_store_written_newest_first_in_time_order(
    backwards: Path,
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    times = _oracle(backwards).time.values
    dm = InSituDataModule(backwards, ["sst"], (0.5, 0.25, 0.25), log_report=False)
    dm.setup("fit")
    manifest = dm.manifest
    assert manifest is not None
    train, val, test = (times[manifest.samples(s)] for s in ("train", "val", "test"))
    np.testing.assert_array_equal(np.sort(train), np.sort(times)[:8])  # the earliest half
    assert train.max() < val.min() <= val.max() < test.min()


def test_on_a_store_written_newest_first_no_train_row_reads_a_val_time(backwards: Path) -> None:
    """``shift(-1)`` is the next time of a store written newest first (by index, as asked);
    with the time-ordered split, the anchor whose next time is val's first is dropped, as at
    any split edge: no training target is a validation time."""
    ds = _oracle(backwards)
    times = ds.time.values
    g = open_geometries(backwards)["sst"]
    manifest = split_by_chunk(g, (0.5, 0.25, 0.25), coord=open_coordinates(backwards, g)["time"])
    first_val = times[manifest.samples("val")].min()
    pipe = insitu_pipeline(backwards, manifest, {"x": g, "y": g.shift(-1)}, batch_size=4)
    batches = _epoch(pipe)
    x = np.concatenate([b.coords["x"]["time"] for b in batches])
    y = np.concatenate([b.coords["y"]["time"] for b in batches])
    np.testing.assert_array_equal(y - x, np.timedelta64(6, "h"))
    assert y.max() < first_val
    assert len(x) == len(manifest.samples("train")) - 1  # only the edge's anchor left out
    for b in batches:
        for t, v in zip(b.coords["y"]["time"], b["y"], strict=True):
            np.testing.assert_array_equal(v, ds.sst.sel(time=t).values)


@pytest.fixture
def backwards_gap(tmp_path: Path) -> Path:
    """Twenty 6-hourly times from 2000-01-01T00 less the tenth (a gap), newest first."""
    times = pd.date_range("2000-01-01", periods=20, freq="6h").delete(9)[::-1]
    return _write(tmp_path / "back_gap.zarr", times, chunk=3)


@pytest.mark.parametrize(
    ("views", "asked"),
    [
        ({"w": ["-6h", "0h"]}, {"stride": "12h"}),
        ({"w": ["-12h", "-6h", "0h"], "y": ["6h"]}, {"missing": ["2000-01-02T00"]}),
        ({"x": 0, "y": 1}, {"missing": ()}),  # shift(1): the sample on, 6 h back in time
    ],
)
def test_the_time_checks_of_a_store_written_newest_first_pair_the_times_they_name(
    backwards_gap: Path, views: dict[str, Any], asked: dict[str, Any]
) -> None:
    """Before, a time stride, windows in time deltas and ``missing=`` were refused on times
    that run backwards (write the store sorted, or give up the checks); now the checks count
    the steps back in time: every row's steps are the times its window names, none across the
    gap, and the anchors are every time whose steps are all there (xarray's times)."""
    ds = _oracle(backwards_gap)
    times = ds.time.values
    hour = np.timedelta64(1, "h")
    g = open_geometries(backwards_gap)["sst"]
    plan = {k: g.shift(v) if isinstance(v, int) else g.window(v) for k, v in views.items()}
    deltas = {k: [np.timedelta64(-6 * v, "h")] if isinstance(v, int) else
              [np.timedelta64(int(d[:-1]), "h") for d in v] for k, v in views.items()}  # fmt: skip
    stride = asked.get("stride")
    listed = [np.datetime64(d) for d in asked.get("missing", ())]
    have = set(times)
    want = set()
    for t in times:
        on = stride is None or (t - np.datetime64("1970-01-01")) % (12 * hour) == np.timedelta64(0)
        steps = [t + d for ds_ in deltas.values() for d in ds_] + [t]
        if on and all(u in have and u not in listed for u in steps):
            want.add(t)
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(backwards_gap, manifest, plan, batch_size=4, **asked)
    got = set()
    for b in _epoch(pipe):
        for label, d in deltas.items():
            rows = np.asarray(b.coords[label]["time"]).reshape(len(b), -1)
            values = np.asarray(b[label]).reshape(len(b), len(d), 2, 3)
            for r, v in zip(rows, values, strict=True):
                anchor = r[0] - d[0]
                np.testing.assert_array_equal(r, [anchor + x for x in d])
                for step, x in zip(r, v, strict=True):
                    np.testing.assert_array_equal(x, ds.sst.sel(time=step).values)
                got.add(anchor)
    assert got == want and len(want) >= 5


# ---------------------------------------------------------------------------------------------
# Repeated times: cftime dates, a collection's members
# ---------------------------------------------------------------------------------------------


def _with_copy(times: list[Any], at: int, of: int) -> list[Any]:
    """``times`` with a copy of ``times[of]`` put at ``at``."""
    return [*times[:at], times[of], *times[at:]]


@pytest.mark.parametrize(
    ("calendar", "start"),
    [("noleap", "2001-02-27"), ("360_day", "2001-02-29"), ("standard", "1500-03-01")],
)
def test_a_repeated_cftime_date_warns_at_the_build_as_a_repeated_datetime64_one_does(
    tmp_path: Path, calendar: str, start: str
) -> None:
    dates = list(xr.date_range(start, periods=9, freq="6h", calendar=calendar, use_cftime=True))
    root = _write(tmp_path / "rep.zarr", _with_copy(dates, 7, 4),  # re-sent later, out of place
                  units="hours since 1500-01-01", calendar=calendar)  # fmt: skip
    decoded = _oracle(root).time.values
    assert decoded.dtype == object  # cftime dates, as xarray decodes them
    again = np.flatnonzero(xr.CFTimeIndex(decoded).duplicated())
    assert again.tolist() == [7]
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.warns(UserWarning, match=rf"repeat \(sample {again[0]} has {decoded[4]} as "
                      r"sample 4 does; 1 repeated in all\).*missing=\(\)"):  # fmt: skip
        pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=5, shuffle=False)
    rows = [i for b in _epoch(pipe) for i in b.sample_indices["x"].tolist()]
    assert rows == list(range(10))  # every copy read by index, as the warning says
    pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=5, missing=(), shuffle=False)
    rows = [i for b in _epoch(pipe) for i in b.sample_indices["x"].tolist()]
    assert rows == [i for i in range(10) if i not in again]  # the first copy is the time's


def _scenes(tmp_path: Path) -> tuple[Collection, list[Any]]:
    """Scenes ``a`` (9 six-hourly times, the 4th written twice: 10 samples) and ``b`` (8
    times, another start), and each as xarray reads it."""
    hours = pd.date_range("2000-01-01", periods=9, freq="6h")
    roots = [_write(tmp_path / "a.zarr", _with_copy(list(hours), 4, 3), chunk=4),
             _write(tmp_path / "b.zarr", pd.date_range("2000-03-01", periods=8, freq="6h"),
                    chunk=4)]  # fmt: skip
    coll = Collection.from_arrays([(r, "sst") for r in roots], names=["a", "b"],
                                  sample_axis="time")  # fmt: skip
    return coll, [_oracle(r) for r in roots]


def _member_rows(batches: list[Any], label: str) -> set[tuple[int, tuple[int, ...]]]:
    """``(member, its samples)`` of every row (a window's steps as a tuple)."""
    out = set()
    for b in batches:
        local = np.asarray(b.sample_indices[label]).reshape(len(b.members[label]), -1)
        out |= {(int(m), tuple(s.tolist())) for m, s in zip(b.members[label], local, strict=True)}
    return out


def test_a_collection_member_with_a_repeated_time_takes_its_first_copy_as_a_single_store_does(
    tmp_path: Path,
) -> None:
    coll, scenes = _scenes(tmp_path)
    times = [ds.time.values for ds in scenes]
    v = coll["data"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    twice = [pd.Index(t).duplicated() for t in times]  # pandas' rule: the later copies
    assert [np.flatnonzero(d).tolist() for d in twice] == [[4], []]
    # under the checks: every time once, the first copy its; a window of the step before
    # reads no copy and crosses no gap (each member its own timeline)
    views = {"x": v, "w": v.window([-1, 0])}
    pipe = insitu_pipeline(coll, manifest, views, missing=(), batch_size=4)
    batches = _epoch(pipe)
    want = {
        (m, (i - 1, i))
        for m, t in enumerate(times)
        for i in range(1, len(t))
        if not twice[m][i - 1] and not twice[m][i] and t[i] - t[i - 1] == np.timedelta64(6, "h")
    }
    assert _member_rows(batches, "w") == want and len(want) == 14
    assert pipe.stages.plan.dropped["gap"] == 2  # the copy, and the window reading it after
    for b in batches:
        for m, i, x in zip(b.members["w"], b.sample_indices["w"], b["w"], strict=True):
            np.testing.assert_array_equal(x, scenes[int(m)].sst.values[i])
    # without the checks every copy is read, and where the batches carry the times (named:
    # a collection of scenes carries none by default) the build says so, naming the member
    with pytest.warns(UserWarning, match=r"'time' in member 'a' of .* repeat \(its sample 4 "
                      r"has 2000-01-01T18.* as its sample 3 does"):  # fmt: skip
        pipe = insitu_pipeline(coll, manifest, {"x": v}, batch_size=4, coords=["time"])
    assert len(_member_rows(_epoch(pipe), "x")) == 18
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        insitu_pipeline(coll, manifest, {"x": v}, batch_size=4).close()  # (nothing read)


# ---------------------------------------------------------------------------------------------
# Forcings of Gregorian dates outside datetime64[ns]'s range (1677-2262)
# ---------------------------------------------------------------------------------------------


def _usno_cos_zenith(t: np.datetime64, lat: float, lon: float) -> float:
    """USNO's *Approximate Solar Coordinates*, written again: cos of the solar zenith angle."""
    days = (t - np.datetime64("2000-01-01T12:00:00", "s")) / np.timedelta64(1, "D")
    rad = math.pi / 180
    g = (357.529 + 0.98560028 * days) * rad
    q = 280.459 + 0.98564736 * days
    ecliptic = (q + 1.915 * math.sin(g) + 0.020 * math.sin(2 * g)) * rad
    obliquity = (23.439 - 0.00000036 * days) * rad
    ascension = math.atan2(math.cos(obliquity) * math.sin(ecliptic), math.cos(ecliptic))
    declination = math.asin(math.sin(obliquity) * math.sin(ecliptic))
    gmst = (18.697374558 + 24.06570982441908 * days) % 24
    hour = gmst * 15 * rad + lon * rad - ascension
    return math.sin(lat * rad) * math.sin(declination) + math.cos(lat * rad) * math.cos(
        declination
    ) * math.cos(hour)


@pytest.mark.parametrize(
    ("units", "calendar", "first"),
    [
        ("hours since 1500-03-01", "standard", "1500-03-11T00"),  # Julian: 10 days behind
        ("hours since 2300-06-20", "proleptic_gregorian", "2300-06-20T00"),
    ],
)
def test_forcings_of_gregorian_dates_outside_1677_2262_are_those_of_their_instants(
    tmp_path: Path, units: str, calendar: str, first: str
) -> None:
    hours = np.arange(6) * 5
    root = tmp_path / "far.zarr"
    _write(root, cftime.num2date(hours, units, calendar), units=units, calendar=calendar, chunk=3)
    instants = np.datetime64(first, "s") + hours.astype("timedelta64[h]")  # the oracle's
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    sun = Forcings("x", names=FORCINGS[:2], lat=LAT, lon=LON)
    gc = Forcings("x", names=GRAPHCAST_NAMES, lat=LAT, lon=LON, convention="graphcast",
                  prefix="gc_")  # fmt: skip
    pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=6, shuffle=False,
                           batch_transforms=[sun, gc])  # fmt: skip
    (batch,) = _epoch(pipe)
    assert batch.coords["x"]["time"].dtype == object  # cftime dates, as xarray decodes them
    cos = batch["cos_solar_zenith"]
    want = [[[_usno_cos_zenith(t, la, lo) for lo in LON] for la in LAT] for t in instants]
    np.testing.assert_allclose(cos, want, atol=2e-6)
    np.testing.assert_allclose(cos, cos_solar_zenith(instants, LAT, LON), atol=2e-6)
    tisr = toa_incident_solar_radiation(instants, LAT, LON)
    np.testing.assert_allclose(batch["toa_incident_solar_radiation"], tisr, rtol=1e-6, atol=1e-2)
    # GraphCast's: whole seconds since 1970 over years of 365.24219 days, the day's fraction
    seconds = (instants - np.datetime64("1970-01-01", "s")).astype(np.int64).astype(float)
    year = np.mod(seconds / 86_400 / 365.24219, 1.0)
    np.testing.assert_allclose(batch["gc_year_progress_sin"][:, 0, 0], np.sin(2 * np.pi * year),
                               atol=2e-6)  # fmt: skip
    day = np.mod(np.mod(seconds, 86_400)[:, None] / 86_400 + np.array(LON) / 360, 1.0)
    np.testing.assert_allclose(batch["gc_day_progress_cos"][:, 0, :], np.cos(2 * np.pi * day),
                               atol=2e-6)  # fmt: skip
    np.testing.assert_allclose(batch["gc_toa_incident_solar_radiation"], tisr, rtol=1e-6,
                               atol=1e-2)  # fmt: skip


def test_forcings_compute_datetime64_times_outside_1677_2262_as_the_functions_do() -> None:
    far = np.array(["1600-06-01T06", "2300-06-21T12", "NaT"], dtype="datetime64[s]")
    sun = Forcings("x", lat=LAT, lon=LON)
    got = sun.compute(far)
    np.testing.assert_allclose(got["cos_solar_zenith"], cos_solar_zenith(far, LAT, LON),
                               atol=2e-6)  # fmt: skip
    want = [[[_usno_cos_zenith(t, la, lo) for lo in LON] for la in LAT] for t in far[:2]]
    np.testing.assert_allclose(got["cos_solar_zenith"][:2], want, atol=2e-6)
    assert np.isnan(got["toa_incident_solar_radiation"][2]).all()
    # within the range, the remembered fields are unchanged
    near = np.array(["1979-02-28T18", "2024-12-31T23"], dtype="datetime64[s]")
    for name, values in sun.compute(near).items():
        np.testing.assert_array_equal(values, sun.compute(near.astype("datetime64[ns]"))[name])


def test_a_store_of_a_concat_with_a_repeated_time_is_refused_naming_the_copy_and_what_to_do(
    tmp_path: Path,
) -> None:
    """Stores that continue one another must each be at one step (a window runs across their
    edges); a time written twice in one is refused, as before, now naming it as a copy of
    its earlier index (the message called it "a gap, a repeated or an out-of-order time")."""
    hours = list(pd.date_range("2000-01-01", periods=12, freq="6h"))
    first = _write(tmp_path / "a.zarr", hours[:6])
    again = _write(tmp_path / "b.zarr", _with_copy(hours[6:], 4, 2))
    assert np.flatnonzero(pd.Index(_oracle(again).time.values).duplicated()).tolist() == [4]
    with pytest.raises(ValueError, match=r"\(index 4\) follows .* \(a copy of index 2's: a "
                       r"repeated time; .*drop_duplicates"):  # fmt: skip
        concat([first, again], ["sst"])
