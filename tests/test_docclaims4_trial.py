"""The claims docs/training.md, concepts.md, model-inputs.md and pipeline.md made or changed on
2026-12-07, taken at their word by a new user on tiny stores (zarr, numpy, cftime and
GraphCast's published formulas as the oracles), every piece of advice an error gives followed.

Found wrong (fixed):

- **Gregorian dates outside ``datetime64[ns]``'s range were called "a non-standard
  calendar".** A store in the ``standard`` (or ``proleptic_gregorian``) calendar whose dates
  lie before 1677 or after 2262 (a reconstruction from 1600, a scenario run to 2300) is decoded
  to cftime dates; a ``Forcings`` with a solar forcing, or ``convention="graphcast"``, was then
  refused at the build saying the rows' times are "cftime dates (a non-standard calendar)" —
  they are not — with no way to the solar forcings that model-inputs.md says the functions
  compute for such times. The refusal now names the calendar and the range, and says how to
  compute them with the functions; the conversion it gives (``change_calendar`` to
  ``proleptic_gregorian``, ``datetime64[s]``) is followed here and gives the functions'
  values of the dates (Julian dates of the ``standard`` calendar before 1582 included).
  (Since the timeedges trial ``Forcings`` computes them itself, at the dates' instants.)

Found wrong in the docs (the code is right; the docs now say what it does):

- pipeline.md: an explicit budget is checked against the process's memory "when its slots are
  in RAM (no ``cache_dir``, no ``backing`` of files)". Only the default ``RamBacking`` is: a
  ``backing=`` of one's own is never checked, in RAM or not (the page's own
  ``CountingBacking``, ``np.empty`` slots, was built at a budget beyond the memory the default
  backing is refused at). The package cannot tell where a backing puts its slots, so the docs
  now say so (a ``SlotBacking`` attribute saying "RAM" would let it check: left undone).
- training.md: "Give an integer limit (the same batches on every rank)" against uneven
  validation shares. Lightning runs ``min(limit, batches)`` on each rank: never none, but the
  same number only where the limit is at most the smaller share's (``limit_val_batches=2`` on
  shares of 2 and 1 runs 2 and 1); the page now says so.
- concepts.md: with a repeated time, "a copy listed in ``missing=`` is none" (by index); a time
  listed as a date drops every copy of it, which the page did not say (now it does).

Tried and found right: ``Forcings(..., convention="graphcast")`` equals GraphCast's
``get_year_progress`` / ``get_day_progress`` (written out here from data_utils.py) to 4e-7 in
sine and cosine, ``local_time_*`` equal ``day_progress_*`` under it, ``day_progress_*`` is
refused without it naming the convention, ``GRAPHCAST_NAMES`` is GraphCast's order (the
stack's channels print as the page shows), a stack member's convention is part of a saved
state (refused mid-epoch); GraphCast's ERA5 TSI series interpolated over 1979–2024 spans
1360.83–1361.91 W m⁻², 6.7e-4 of 1361 at most (computed from solar_radiation.py, not kept:
its table stays out of this repository); the functions' year progress and local time of a
``datetime64[s]`` time of 1600 (60.25 / 366 of the year). ``TooFewSamplesError`` with
``"drop"``, ``"pad"`` and ``"uneven"``, its ``split`` / ``n_samples`` / ``world_size``, and
its advice (``world_size=n_samples``) reading each sample once; ``CoordinateLengthError`` from
``open_coordinates``; times that run backwards refused naming both ends, and the advice
(``ds.sortby("time")``) reading every time; a repeated time's later copy neither an anchor nor
a step, listing the older index keeps the newer; the explicit-budget check's advice (the
largest ``cache_budget_bytes``) builds (tests/test_budgetmem_trial.py). Not re-run here (their
trials run them with real Lightning and gloo ranks): training.md's Lightning claims.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.errors import TooFewSamplesError
from insitubatch_nodes.forcings import (
    GRAPHCAST_NAMES,
    Forcings,
    cos_solar_zenith,
    local_time,
    toa_incident_solar_radiation,
    year_progress,
)
from insitubatch_nodes.plan import memory_floor
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = pytest.mark.timeout(60)

LAT, LON = [10.0, 20.0], [0.0, 90.0, 200.0]


def _store(root: Path, hours: np.ndarray, units: str, calendar: str = "standard") -> Path:
    """``sst (time, lat, lon)`` float32 (each step's value its index), 4 steps a chunk, and an
    int64 ``time`` coordinate of ``hours`` in ``units`` and ``calendar``, written with zarr."""
    n = len(hours)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    sst = group.create_array("sst", shape=(n, 2, 3), chunks=(4, 2, 3), dtype="f4",
                             dimension_names=("time", "lat", "lon"))  # fmt: skip
    sst[:] = np.arange(n, dtype="f4")[:, None, None]
    time = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8",
                              dimension_names=("time",))  # fmt: skip
    time[:] = hours
    time.attrs.update({"units": units, "calendar": calendar})
    for name, values in (("lat", LAT), ("lon", LON)):
        axis = group.create_array(name, shape=(len(values),), dtype="f8", dimension_names=(name,))
        axis[:] = values
    return root


def _anchors(pipe: Any) -> list[int]:
    with pipe:
        return sorted(i for b in Loader(pipe) for i in np.asarray(b.sample_indices["x"]).tolist())


@pytest.mark.parametrize(
    ("units", "calendar", "first"),
    [
        ("hours since 1600-01-01", "standard", "1600-01-01T00"),
        ("hours since 1500-03-01", "standard", "1500-03-11T00"),  # Julian: 10 days behind
        ("hours since 2300-01-01", "proleptic_gregorian", "2300-01-01T00"),
    ],
)
def test_solar_forcings_of_gregorian_dates_outside_the_ns_range_are_the_functions_values(
    tmp_path: Path, units: str, calendar: str, first: str
) -> None:
    hours = np.arange(8) * 6
    root = _store(tmp_path / "old.zarr", hours, units, calendar)
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    # (refused before the timeedges trial; computed since, at the dates' instants: the oracle
    # is the stored hours from the first date, proleptic Gregorian, given to the functions)
    want = np.datetime64(first, "s") + hours.astype("timedelta64[h]")
    for convention, names in (("calendar", ["cos_solar_zenith"]), ("graphcast", GRAPHCAST_NAMES)):
        sun = Forcings("x", names=names, lat=LAT, lon=LON, convention=convention)
        pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=8, shuffle=False,
                               batch_transforms=[sun])  # fmt: skip
        with pipe:
            batch = next(iter(Loader(pipe)))
        assert np.asarray(batch.coords["x"]["time"]).dtype == object
        name = names[0]
        fn = cos_solar_zenith if name == "cos_solar_zenith" else toa_incident_solar_radiation
        np.testing.assert_allclose(batch[name], fn(want, LAT, LON), rtol=1e-6, atol=1e-5)
    # a non-standard calendar is still called one
    noleap = _store(tmp_path / "noleap.zarr", hours, "hours since 2000-01-01", "noleap")
    g = open_geometries(noleap)["sst"]
    with pytest.raises(TypeError, match=r"cftime dates \(a non-standard calendar\)"):
        insitu_pipeline(noleap, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g},
                        batch_transforms=[Forcings("x", names=["cos_solar_zenith"],
                                                   lat=LAT, lon=LON)])  # fmt: skip


def test_a_backing_of_your_own_is_not_held_to_the_memory_check_the_default_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pipeline.md's own ``CountingBacking`` (slots from ``np.empty``, in RAM) is built at a
    budget the default backing is refused at: the check asks the default backing only."""
    root = _store(tmp_path / "s.zarr", np.arange(16) * 6, "hours since 2000-01-01")
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))

    class CountingBacking:
        name = "counting"

        def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
            return np.empty(shape, dtype=dtype)

        def release(self, buffer: np.ndarray) -> None:
            pass

    def build(**kw: Any) -> Any:
        return insitu_pipeline(root, manifest, {"x": g}, batch_size=4, coords=(),
                               cache_budget_bytes=10**6, **kw)  # fmt: skip

    monkeypatch.setattr(memory_floor, "usable_memory_bytes", lambda: 100)
    with pytest.raises(ValueError, match="cannot be held here"):
        build()
    assert _anchors(build(backing=CountingBacking())) == list(range(16))


def test_the_graphcast_convention_is_graphcasts_own_year_and_day_progress(tmp_path: Path) -> None:
    root = tmp_path / "era5.zarr"
    make_era5_like(root, n_time=16, n_lat=4, n_lon=8, n_level=2, samples_per_chunk=8)
    z500 = open_geometries(root)["z"].isel(level=0)
    with pytest.raises(ValueError, match=r"day_progress_\* take convention='graphcast'"):
        Forcings("x", view=z500, names=["day_progress_sin"])
    sun = Forcings("x", view=z500, names=GRAPHCAST_NAMES, convention="graphcast")
    s = stack({"z500": z500, "sun": sun})
    assert s.channels == ("z500", *GRAPHCAST_NAMES)
    both = Forcings("x", view=z500, names=["local_time_sin", "day_progress_sin"],
                    convention="graphcast")  # fmt: skip
    manifest = split_by_chunk(z500, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, {"x": s}, batch_size=16, shuffle=False,
                           batch_transforms=[both])  # fmt: skip
    with pipe:
        batch = next(iter(Loader(pipe)))
    t = np.asarray(batch.coords["x"]["time"])
    # GraphCast's data_utils.get_year_progress / get_day_progress, featurised by sin and cos
    sec = t.astype("datetime64[s]").astype(np.int64)
    year = np.mod(sec / 86400 / np.float64(365.24219), 1.0).astype(np.float32)
    lon = np.asarray(sun.lon)
    day = np.mod((np.mod(sec, 86400) / 86400)[:, None] + np.deg2rad(lon) / (2 * np.pi), 1.0)
    day = day.astype(np.float32)
    x = batch.arrays["x"]
    for k, want in ((2, np.sin(2 * np.pi * year)[:, None, None]),
                    (3, np.cos(2 * np.pi * year)[:, None, None]),
                    (4, np.sin(2 * np.pi * day)[:, None, :]),
                    (5, np.cos(2 * np.pi * day)[:, None, :])):  # fmt: skip
        np.testing.assert_allclose(x[:, k], np.broadcast_to(want, x[:, k].shape), atol=5e-7)
    np.testing.assert_array_equal(batch.arrays["local_time_sin"], batch.arrays["day_progress_sin"])
    # the functions outside datetime64[ns]'s range: 1600-03-01T06 is 60.25 days into a leap year
    t1600 = np.array(["1600-03-01T06"], "datetime64[s]")
    np.testing.assert_allclose(year_progress(t1600), [60.25 / 366], rtol=1e-12)
    np.testing.assert_allclose(local_time(t1600, [0.0, 90.0]).ravel(), [6.0, 12.0])


def test_too_few_samples_says_the_world_size_that_reads_the_split_and_that_one_does(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr", np.arange(24) * 6, "hours since 2000-01-01")
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (0.5, 0.25, 0.25))  # test: the last chunk, 4 samples
    for remainder in ("drop", "pad", "uneven"):
        with pytest.raises(TooFewSamplesError, match=r"world_size=4 on ranks r < 4") as refused:
            insitu_pipeline(root, manifest, {"x": g}, split="test", rank=0, world_size=16,
                            remainder=remainder)  # fmt: skip
        err = refused.value
        assert (err.split, err.n_samples, err.world_size) == ("test", 4, 16)
    got = [
        _anchors(
            insitu_pipeline(
                root, manifest, {"x": g}, split="test", rank=r, world_size=4, remainder="uneven"
            )
        )
        for r in range(4)
    ]
    assert sorted(i for share in got for i in share) == [20, 21, 22, 23]


def test_repeated_and_backward_times_as_concepts_md_says_and_its_advice_reads_every_time(
    tmp_path: Path,
) -> None:
    hours = np.arange(12) * 6
    rep = _store(tmp_path / "rep.zarr", np.insert(hours, 5, hours[4]), "hours since 2000-01-01")
    g = open_geometries(rep)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))

    def anchors(**kw: Any) -> list[int]:
        return _anchors(insitu_pipeline(rep, manifest, {"x": g}, batch_size=4, **kw))

    assert anchors(missing=()) == [0, 1, 2, 3, 4, *range(6, 13)]  # the later copy: no anchor
    assert anchors(missing=[4]) == [0, 1, 2, 3, *range(5, 13)]  # the older listed: the newer
    day2 = np.datetime64("2000-01-02T00")
    assert anchors(missing=[day2]) == [0, 1, 2, 3, *range(6, 13)]  # the time: every copy
    # times that run backwards: refused where checked until the timeedges trial, which
    # checks them back in time (every time once here); the old advice still reads all
    back = _store(tmp_path / "back.zarr", hours[::-1].copy(), "hours since 2000-01-01")
    g = open_geometries(back)["sst"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(back, manifest, {"x": g}, batch_size=4, missing=())
    assert _anchors(pipe) == list(range(12))
    xr = pytest.importorskip("xarray")
    with xr.open_zarr(back, consolidated=False) as ds:
        ordered = ds.sortby("time").load()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ordered.to_zarr(tmp_path / "sorted.zarr", zarr_format=3, consolidated=False)
    g = open_geometries(tmp_path / "sorted.zarr")["sst"]
    pipe = insitu_pipeline(tmp_path / "sorted.zarr", split_by_chunk(g, (1.0, 0.0, 0.0)),
                           {"x": g}, batch_size=4, missing=())  # fmt: skip
    assert _anchors(pipe) == list(range(12))


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_limit_on_uneven_validation_shares_fractional_leaves_a_rank_none_integer_never(
    tmp_path: Path,
) -> None:
    """training.md: with shares of 2 and 1 batches a fractional limit gives 1 and 0; an integer
    limit gives ``min(limit, batches)`` on each rank — the same number only where the limit is
    at most the smaller share's (it said "the same batches on every rank")."""
    data_connector = pytest.importorskip("lightning.pytorch.trainer.connectors.data_connector")
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    root = _store(tmp_path / "s.zarr", np.arange(12) * 6, "hours since 2000-01-01")
    g = open_geometries(root)["sst"]
    manifest = split_by_chunk(g, (2 / 3, 1 / 3, 0.0))  # val: 4 samples
    shares = []
    for rank in (0, 1):
        pipe = insitu_pipeline(root, manifest, {"x": g}, split="val", batch_size=1, rank=rank,
                               world_size=3, remainder="uneven")  # fmt: skip
        with pipe:
            shares.append(len(pipe))
    assert shares == [2, 1]  # 4 samples on 3 ranks: 2, 1, 1

    def limited(n: int, limit: float) -> float:
        return data_connector._parse_num_batches(RunningStage.VALIDATING, n, limit)

    assert limited(2, 0.5) == 1
    with pytest.raises(MisconfigurationException):  # the rank of one batch: 0.5 of it is none
        limited(1, 0.5)
    assert [limited(n, 2) for n in shares] == [2, 1]
    assert [limited(n, 1) for n in shares] == [1, 1]
