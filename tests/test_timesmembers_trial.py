"""Times of a collection's members, forcings of far dates, the demo's split (the timesmembers
trial of 2026-12-07).

Stores are written by xarray (``Dataset.to_zarr``, CF times); which anchors an epoch holds,
each row's times and values are worked out here from each member's own store with xarray and
numpy, never asked of the package's plan.

Found (fixed; each test failed before the fix):

- **A collection's members written newest first were refused** under a time stride, windows
  in time deltas and ``missing=`` ("write the members with increasing times"), though a
  single store's are counted back in time (``SampleSteps.backwards``). Members that all run
  newest first are now counted so too (``anchor_steps``): each row's steps are the times its
  window names in its own member, on 6-hourly ``datetime64`` and ``noleap`` dates beside a
  member of one time, and a state saved mid-epoch resumes exactly. Members running in
  different directions stay refused, now saying so and naming a member of each
  (``MemberMap._check_steps``; before "runs at one step of -21600000000000 nanoseconds").
- **Monthly members written newest first were refused** ("steps from 2000-11-01 to
  2000-10-01, but ... runs at one step of -2592000000000000 nanoseconds"): ``month_step``
  took only increasing months; it now gives ``-k`` for months newest first.
- **Forcings computed cftime dates and ``datetime64`` times outside 1677-2262 again in every
  batch** (the memory was keyed in nanoseconds): 5 distinct times in two batches of 8 cost 16
  computations. ``forcing_memo.memo_keys`` now keys them (microseconds; cftime dates exactly
  in their calendar), so each is computed once (5), with or without patches (``cut=``), and
  the fields equal those computed directly. Measured on the shared 2-core machine: 512 rows
  of two steps of ``standard`` dates of 1500 on a 32 x 64 grid took 125-134 ms of CPU every
  batch, now 26-27 ms once held (``noleap``: 22-25 -> 18-19 ms; the first batch of new times
  costs the keys and the copy into the memory, 24 -> 38-41 ms for ``noleap``).
- **The demo split in index order** (``split_by_chunk(geom, fractions)``) and forecast
  ``shift(1)``: on a store written newest first it trained on the newest times (the pipeline
  warned of it) and its target was the time before its input. It now splits in time order
  as the data module does (``lightning_splits.sample_times``) and its target is the next
  time; the synthetic store's plan (``--plan-only``) prints the same as before.
- **``concat``/``join`` of a store written newest first was refused with a wrong step**:
  "follows ... after -21600 s, where the store steps 0 s (a gap, or an out-of-order time:
  fill or trim the times there ...)". It then said the times run backwards and to sort the
  store or read it on its own; since the timesconcat trial such stores are concatenated and
  joined (``tests/test_timesconcat_trial.py``, which holds the claims now).

Tried and found right (no change needed): ``fit_statistics``' ``diff_std`` on a collection of
two members sharing their times, oldest or newest first, equals numpy's over each member's
one-step differences (0.38903 both; no warning of repeated times across members); a time
stride, ``missing=`` dates and windows on the members' padding and edges (no window leaves
its member).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import open_with_xarray, write_sst
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, split_by_chunk
from insitubatch_nodes.io.collection import Collection

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")
cftime = pytest.importorskip("cftime")

pytestmark = pytest.mark.timeout(60)

HOUR = np.timedelta64(1, "h")


def _write(root: Path, times: Any, *, chunk: int = 3, **kw: Any) -> Path:
    return write_sst(root, times, chunk=chunk, **kw)


def _oracle(root: Path) -> Any:
    return open_with_xarray(root)


def _epoch(pipe: Any) -> list[Any]:
    with pipe:
        return list(Loader(pipe))


# ---------------------------------------------------------------------------------------------
# A collection's members written newest first
# ---------------------------------------------------------------------------------------------


def _scenes(tmp_path: Path, *, newest_first: tuple[bool, bool] = (True, True)) -> Collection:
    """Scenes ``a`` (10 six-hourly times from 2000-01-01) and ``b`` (7 from 2000-03-01T06),
    each written newest first where ``newest_first`` says."""
    spans = [pd.date_range("2000-01-01", periods=10, freq="6h"),
             pd.date_range("2000-03-01T06", periods=7, freq="6h")]  # fmt: skip
    roots = [
        _write(tmp_path / f"{name}.zarr", times[::-1] if back else times)
        for name, times, back in zip("ab", spans, newest_first, strict=True)
    ]
    return Collection.from_arrays([(r, "sst") for r in roots], names=["a", "b"],
                                  sample_axis="time")  # fmt: skip


@pytest.mark.parametrize(
    ("windows", "asked"),
    [
        ({"w": ["-6h", "0h"]}, {}),
        ({"w": ["-12h", "-6h", "0h"], "y": ["6h"]}, {"stride": "12h"}),
        ({"w": ["-6h", "0h"], "y": ["6h"]},
         {"missing": [np.datetime64("2000-01-02T00"), np.datetime64("2000-03-02T00")]}),
    ],
)  # fmt: skip
def test_windows_strides_and_missing_dates_of_members_written_newest_first_read_their_times(
    tmp_path: Path, windows: dict[str, list[str]], asked: dict[str, Any]
) -> None:
    """Before, a collection whose members' times run backwards was refused under a time
    stride, windows in time deltas and ``missing=`` ("write the members with increasing
    times"); a single store's were counted back in time. Now the members' are too: each row's
    steps are the times its window names in its own member, the anchors every time of a member
    whose steps are all there and on the stride (xarray's times of each member)."""
    coll = _scenes(tmp_path)
    scenes = [_oracle(tmp_path / f"{name}.zarr") for name in "ab"]
    v = coll["data"]
    deltas = {k: [np.timedelta64(int(d[:-1]), "h") for d in w] for k, w in windows.items()}
    stride, listed = asked.get("stride"), set(asked.get("missing", ()))
    want = set()
    for m, ds in enumerate(scenes):
        have = set(ds.time.values)
        for t in ds.time.values:
            on = stride is None or (t - np.datetime64("1970-01-01")) % (12 * HOUR) == 0 * HOUR
            steps = [t + d for ds_ in deltas.values() for d in ds_] + [t]
            if on and all(u in have and u not in listed for u in steps):
                want.add((m, t))
    views = {k: v.window(w) for k, w in windows.items()}
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(coll, manifest, views, batch_size=4, coords=["time"], **asked)
    got = set()
    for b in _epoch(pipe):
        for label, d in deltas.items():
            rows = np.asarray(b.coords[label]["time"]).reshape(len(b), -1)
            values = np.asarray(b[label]).reshape(len(b), len(d), 2, 3)
            for m, r, x in zip(b.members[label], rows, values, strict=True):
                anchor = r[0] - d[0]
                np.testing.assert_array_equal(r, [anchor + k for k in d])
                for step, xs in zip(r, x, strict=True):
                    np.testing.assert_array_equal(xs, scenes[int(m)].sst.sel(time=step).values)
                got.add((int(m), anchor))
    assert got == want and len(want) >= 4
    assert {m for m, _ in want} == {0, 1}


def test_members_whose_times_run_in_different_directions_are_refused_naming_both(
    tmp_path: Path,
) -> None:
    coll = _scenes(tmp_path, newest_first=(False, True))
    v = coll["data"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"member 'a'.* forward .*member 'b'.* backwards"):
        insitu_pipeline(coll, manifest, {"w": v.window(["-6h", "0h"])}, batch_size=4)


def test_monthly_members_written_newest_first_drop_the_windows_of_a_missing_month(
    tmp_path: Path,
) -> None:
    """Monthly means (months of 28 to 31 days: one step of a calendar month) written newest
    first: before, such a member was refused ("steps from 2000-12-01 to 2000-11-01, but ...
    runs at one step of -30 days"); a single store's were read. Now each member's months
    are one step back, and a ``missing=`` date drops the windows that read it in its member."""
    spans = [pd.date_range("2000-01-01", periods=12, freq="MS")[::-1],
             pd.date_range("2001-03-01", periods=8, freq="MS")[::-1]]  # fmt: skip
    roots = [_write(tmp_path / f"{n}.zarr", t) for n, t in zip("ab", spans, strict=True)]
    coll = Collection.from_arrays([(r, "sst") for r in roots], names=["a", "b"],
                                  sample_axis="time")  # fmt: skip
    scenes = [_oracle(r) for r in roots]
    listed = [np.datetime64("2000-06-01"), np.datetime64("2001-05-01")]
    v = coll["data"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(coll, manifest, {"w": v.window([-1, 0])}, missing=listed,
                           batch_size=4, coords=["time"])  # fmt: skip
    want = {
        (m, (i - 1, i))
        for m, ds in enumerate(scenes)
        for i in range(1, ds.sizes["time"])
        if not set(ds.time.values[i - 1 : i + 1]) & set(listed)
    }
    got = set()
    for b in _epoch(pipe):
        for m, i, t, x in zip(b.members["w"], b.sample_indices["w"], b.coords["w"]["time"],
                              b["w"], strict=True):  # fmt: skip
            ds = scenes[int(m)]
            np.testing.assert_array_equal(t, ds.time.values[i])
            np.testing.assert_array_equal(x, ds.sst.values[i])
            got.add((int(m), tuple(i.tolist())))
    assert got == want and len(want) == 11 + 7 - 4
    assert pipe.stages.plan.dropped["missing"] == 4


# ---------------------------------------------------------------------------------------------
# Forcings of times outside datetime64[ns]: remembered, as those inside are
# ---------------------------------------------------------------------------------------------


def _far_times(kind: str) -> np.ndarray:
    """(4 rows, 2 steps) of times one hour apart (windows overlapping by a step: 5 distinct),
    each row's its own object where they are cftime dates (equal dates, distinct objects)."""
    hours = np.arange(4)[:, None] + np.arange(2)[None, :]
    if kind == "datetime64[s]":
        return np.datetime64("2300-06-21T00", "s") + hours.astype("timedelta64[h]")
    calendar, units = {"standard": ("standard", "hours since 1500-03-01"),
                       "proleptic": ("proleptic_gregorian", "hours since 2300-06-20"),
                       "noleap": ("noleap", "hours since 2001-02-27")}[kind]  # fmt: skip
    return np.array(cftime.num2date(hours, units, calendar), dtype=object)


@pytest.mark.parametrize("kind", ["standard", "proleptic", "noleap", "datetime64[s]"])
def test_forcings_of_times_outside_1677_2262_compute_each_distinct_time_once(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Before, a time the memory could not key in nanoseconds — cftime dates (a ``standard``
    date of 1500, a ``proleptic_gregorian`` one of 2300, any ``noleap`` date) and
    ``datetime64`` times outside 1677-2262 — was computed again in every batch: the first
    and a later batch of the same 5 times computed 16 times (8 and 8). Now each distinct
    time is computed once, as inside the range, and its fields are exactly those computed
    directly."""
    import insitubatch_nodes.forcings as forcings
    from insitubatch_nodes.io.patching import cut_windows

    lat, lon = np.linspace(-80, 80, 5), np.linspace(0, 350, 8)
    names = forcings.FORCINGS if kind != "noleap" else forcings.FORCINGS[2:]  # (no instant)
    times = _far_times(kind)
    computed: list[int] = []
    real = forcings.Forcings._compute

    def counting(self: Any, t: np.ndarray, g: int = 0) -> dict[str, np.ndarray]:
        computed.append(t.size)
        return real(self, t, g)

    monkeypatch.setattr(forcings.Forcings, "_compute", counting)
    f = forcings.Forcings("x", names=names, lat=lat, lon=lon)
    first = f.compute(times)
    again = f.compute(times[::-1].copy())  # a later batch (or epoch) of the same times
    assert computed == [5], "each distinct time once, none again"
    fresh = real(f, times)
    for name in names:
        np.testing.assert_array_equal(first[name], fresh[name])
        np.testing.assert_array_equal(again[name], fresh[name][::-1])
    # each row's window cut from the remembered fields (a patched label's forcings)
    computed.clear()
    cut = (np.array([[0, 0], [1, 2], [3, 4], [2, 1]]), (0, 1), (2, 4))
    patched = forcings.Forcings("x", names=names, lat=lat, lon=lon)
    for _ in range(2):
        got = patched.compute(times, cut=cut)
        for name in names:
            np.testing.assert_array_equal(got[name], cut_windows(fresh[name], *cut[:1], (1, 2),
                                                                 (2, 4)))  # fmt: skip
    assert computed == [5]


# ---------------------------------------------------------------------------------------------
# The demo on a store written newest first
# ---------------------------------------------------------------------------------------------


def test_the_demo_splits_a_store_written_newest_first_in_time_order_and_forecasts_the_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the demo split in index order: on a store written newest first its ``train``
    held the newest times (the pipeline warned that it trained on its evaluation's future)
    and its target (``shift(1)``) was the time before the input. Now it splits in time order,
    as the data module does, and its target is the next time, whichever way the store runs."""
    from insitubatch_nodes import demo

    times = pd.date_range("2000-01-01", periods=40, freq="6h")[::-1]
    root = _write(tmp_path / "back.zarr", times, chunk=4)
    decoded = _oracle(root).time.values
    got: dict[str, Any] = {}

    def train(args: Any, store: Any, geom: Any, manifest: Any, views: Any, reader: Any) -> int:
        got.update(store=store, manifest=manifest, views=views)
        return 0

    monkeypatch.setattr(demo, "_train", train)
    assert demo.main(["--url", str(root), "--variable", "sst", "--no-progress"]) == 0
    assert "train: 8 chunks / 32 samples, val: 1 chunks / 4 samples" in capsys.readouterr().out
    manifest, views = got["manifest"], got["views"]
    by_split = {s: decoded[manifest.samples(s)] for s in ("train", "val", "test")}
    np.testing.assert_array_equal(np.sort(by_split["train"]), np.sort(decoded)[:32])
    assert by_split["train"].max() < by_split["val"].min() < by_split["test"].min()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (before: "'train' holds the times after those of ...")
        pipe = insitu_pipeline(got["store"], manifest, views, batch_size=8, coords=["time"])
    for b in _epoch(pipe):
        np.testing.assert_array_equal(b.coords["y"]["time"] - b.coords["x"]["time"], 6 * HOUR)


def test_noleap_members_written_newest_first_beside_a_member_of_one_time_read_their_times(
    tmp_path: Path,
) -> None:
    """The same on cftime dates (a ``noleap`` calendar, across 28 February) beside a member
    of a single time, which has no direction and holds no anchor of a two-step window."""
    spans = (("2001-02-27", 10), ("2003-02-28", 7), ("2005-01-01", 1))
    noleap = [xr.date_range(start, periods=n, freq="6h", calendar="noleap", use_cftime=True)
              for start, n in spans]  # fmt: skip
    roots = [_write(tmp_path / f"{name}.zarr", list(t)[::-1], calendar="noleap")
             for name, t in zip("abc", noleap, strict=True)]  # fmt: skip
    coll = Collection.from_arrays([(r, "sst") for r in roots], names=list("abc"),
                                  sample_axis="time")  # fmt: skip
    scenes = [_oracle(r) for r in roots]
    listed = [cftime.DatetimeNoLeap(2001, 3, 1, 6)]
    v = coll["data"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(coll, manifest, {"w": v.window(["-12h", "0h"])}, stride="12h",
                           missing=listed, batch_size=4, coords=["time"])  # fmt: skip
    twelve = pd.Timedelta(hours=12)
    want = {
        (m, t)
        for m, ds in enumerate(scenes)
        for t in ds.time.values
        if t.hour % 12 == 0
        and t - twelve in set(ds.time.values)
        and not {t, t - twelve} & set(listed)
    }
    got = set()
    for b in _epoch(pipe):
        for m, r, x in zip(b.members["w"], b.coords["w"]["time"], b["w"], strict=True):
            assert r[1] - r[0] == twelve
            for step, xs in zip(r, x, strict=True):
                np.testing.assert_array_equal(xs, scenes[int(m)].sst.sel(time=step).values)
            got.add((int(m), r[1]))
    assert got == want and len(want) == 7


def test_a_state_saved_mid_epoch_on_members_written_newest_first_resumes_exactly(
    tmp_path: Path,
) -> None:
    from resume_helpers import assert_resumes_exactly, epochs_of

    coll = _scenes(tmp_path)
    v = coll["data"]
    manifest = split_by_chunk(v, (1.0, 0.0, 0.0))

    def build() -> Any:
        return insitu_pipeline(coll, manifest, {"w": v.window(["-6h", "0h"])}, stride="12h",
                               batch_size=2, seed=3)  # fmt: skip

    def records(batches: list[Any]) -> list[Any]:
        return [(b.members["w"].tolist(), b.sample_indices["w"].tolist()) for b in batches]

    pipe = build()
    with pipe:
        it = epochs_of(Loader(pipe))
        per_epoch = len(pipe)
        ref = records([next(it) for _ in range(2 * per_epoch)])
    assert per_epoch >= 3
    assert_resumes_exactly(build, records, ref, [1, per_epoch, per_epoch + 1])
