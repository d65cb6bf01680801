"""Several stores as one timeline: stores concatenated along time carry their joined times
(time strides, timed windows, ``missing=``, carried coordinates), and overlapping stores keep
the store ``overlap=`` names. zarr reads of each store, joined with numpy, are the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Collection,
    Loader,
    concat,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)

HOUR = np.timedelta64(1, "h")


def _period(
    root: Path, start: int, n: int, *, chunk: int = 4, step: int = 6, calendar: str = "standard"
) -> None:
    """A store of ``t2m (time, lat, lon)`` chunked ``chunk`` along time and a CF ``time`` in
    hours: ``n`` steps of ``step`` hours from hour ``start``. The values say the store and the
    step (``1000 * start + index``), so a row read from the wrong store shows."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = (1000 * start + np.arange(n, dtype="f4"))[:, None, None] + np.zeros((1, 2, 3), "f4")
    data += np.arange(6, dtype="f4").reshape(2, 3) / 10
    t2m = group.create_array(
        "t2m", shape=data.shape, chunks=(chunk, 2, 3), dtype="f4",
        dimension_names=("time", "lat", "lon"),
    )  # fmt: skip
    t2m[:] = data
    time_ = group.create_array(
        "time", shape=(n,), chunks=(n,), dtype="i8", dimension_names=("time",)
    )
    time_[:] = start + step * np.arange(n)
    time_.attrs.update({"units": "hours since 2000-01-01", "calendar": calendar})


def _read(root: Path, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The oracle: zarr's read of a store's ``t2m`` and its times (as datetime64), ``[lo, hi)``."""
    group = zarr.open_group(root, mode="r")
    hours = np.asarray(group["time"][:])[lo:hi]
    times = np.datetime64("2000-01-01T00", "ns") + hours * HOUR
    return np.asarray(group["t2m"][:])[lo:hi], times


def _rows(pipe: Any) -> list[Any]:
    try:
        return list(Loader(pipe))
    finally:
        pipe.close()


def _one_store(root: Path, data: np.ndarray, times: np.ndarray, chunk: int = 4) -> Path:
    """The joined axis written as one plain store: what a concat must behave like."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    t2m = group.create_array(
        "t2m", shape=data.shape, chunks=(chunk, 2, 3), dtype="f4",
        dimension_names=("time", "lat", "lon"),
    )  # fmt: skip
    t2m[:] = data
    hours = (times - np.datetime64("2000-01-01T00", "ns")) // HOUR
    time_ = group.create_array("time", shape=hours.shape, chunks=hours.shape, dtype="i8",
                               dimension_names=("time",))  # fmt: skip
    time_[:] = hours
    time_.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})
    return root


def test_a_concatenation_has_the_stores_times_joined_for_strides_windows_missing_and_coords(
    tmp_path: Path,
) -> None:
    parts = [(0, 8), (48, 8), (96, 5)]  # 6-hourly, continuing: 21 steps
    for k, (s, n) in enumerate(parts):
        _period(tmp_path / f"p{k}.zarr", s, n)
    stores = [tmp_path / f"p{k}.zarr" for k in range(3)]
    reads = [_read(s) for s in stores]
    data = np.concatenate([d for d, _ in reads])
    times = np.concatenate([t for _, t in reads])
    plain = _one_store(tmp_path / "one.zarr", data, times)
    coll = concat(stores, ["t2m"], dim="time")
    gone = times[9]  # a date in missing=: every window touching it is dropped
    options: dict[str, Any] = dict(
        stride="12h", missing=[gone], coords=["time"], batch_size=3, shuffle=False
    )
    got = {}
    plain_view = open_geometries(plain, ["t2m"], sample_axis="time")["t2m"]
    for name, source, view in [("concat", coll, coll["t2m"]), ("plain", plain, plain_view)]:
        window = view.window(["-6h", "0h"])
        manifest = split_by_chunk(view, (1.0, 0.0, 0.0))
        batches = _rows(insitu_pipeline(source, manifest, {"w": window}, **options))
        idx = np.concatenate([b.sample_indices["w"] for b in batches])
        rows = np.concatenate([np.asarray(b["w"]) for b in batches])
        carried = np.concatenate([b.coords["w"]["time"] for b in batches])
        np.testing.assert_array_equal(rows, data[idx])  # every row is zarr's read
        np.testing.assert_array_equal(carried, times[idx])  # each step's time
        got[name] = idx
    np.testing.assert_array_equal(got["concat"], got["plain"])  # the same anchors as one array
    anchors = times[got["concat"][:, 1]]
    assert len(anchors) and np.all((anchors - times[0]) % (12 * HOUR) == np.timedelta64(0))
    assert gone not in anchors and gone not in times[got["concat"][:, 0]]
    assert times[8] in anchors  # 2000-01-03T00: a window across the first stores' edge


def _xarray_times(root: Path) -> np.ndarray:
    """The oracle's times: xarray's decoding of a store's CF ``time``."""
    xr = pytest.importorskip("xarray")
    with xr.open_zarr(root, consolidated=False) as ds:
        return np.asarray(ds["time"].values)


def test_independent_members_stride_window_miss_and_carry_their_own_times(
    tmp_path: Path,
) -> None:
    # scenes, each its own 6-hourly timeline from its own start, of its own length
    spans = [(0, 9), (30, 6), (102, 11)]
    stores = [tmp_path / f"scene{k}.zarr" for k in range(len(spans))]
    for root, (s, n) in zip(stores, spans, strict=True):
        _period(root, s, n)
    times = [_xarray_times(root) for root in stores]
    data = [_read(root)[0] for root in stores]
    coll = Collection.from_arrays([(root, "t2m") for root in stores], sample_axis="time")
    gone = times[2][4]  # 2000-01-06T06 in scene 2: a date in missing=
    view = coll["data"].window(["-6h", "0h"])
    manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        coll, manifest, {"w": view}, stride="12h", missing=[gone], coords=["time"],
        batch_size=4, seed=2,
    )  # fmt: skip
    dropped = pipe.stages.plan.dropped
    batches = _rows(pipe)
    got = set()
    for b in batches:
        for r, (m, idx) in enumerate(zip(b.members["w"], b.sample_indices["w"], strict=True)):
            m = int(m)
            assert idx[1] == idx[0] + 1  # a window never leaves its member
            np.testing.assert_array_equal(np.asarray(b["w"][r]), data[m][idx])
            np.testing.assert_array_equal(b.coords["w"]["time"][r], times[m][idx])
            got.add((m, int(idx[1])))
    # the oracle: per member, the anchors whose own time is on a 12-hour multiple and whose
    # window (the step before and the anchor) is inside the member and misses no date
    want = {
        (m, i)
        for m, t in enumerate(times)
        for i in range(1, len(t))
        if (t[i] - np.datetime64("1970-01-01", "ns")) % (12 * HOUR) == np.timedelta64(0)
        and gone not in t[i - 1 : i + 1]
    }
    assert got == want and len(want) > 6
    # the windows reading scene 2's 2000-01-06T06 are anchored at 06 (off the stride) and 12:
    # one on-stride anchor dropped, counted
    assert dropped.get("missing") == 1 and (2, 5) not in got and (2, 7) in got


def test_independent_members_whose_times_are_not_one_step_are_refused_by_name(
    tmp_path: Path,
) -> None:
    _period(tmp_path / "a.zarr", 0, 8)
    _period(tmp_path / "b.zarr", 0, 8, step=3)  # 3-hourly: another step
    g = zarr.open_group(tmp_path / "c.zarr", mode="w", zarr_format=3)
    _period(tmp_path / "c.zarr", 0, 8)
    g = zarr.open_group(tmp_path / "c.zarr", mode="a")
    hours = np.asarray(g["time"][:])
    hours[5:] += 6  # a gap of 12 hours after 2000-01-02T00
    g["time"][:] = hours
    for other, why in (("b", "steps from"), ("c", "steps from 2000-01-02")):
        coll = Collection.from_arrays(
            [(tmp_path / "a.zarr", "t2m"), (tmp_path / f"{other}.zarr", "t2m")],
            names=["a", other],
        )
        manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
        with pytest.raises(ValueError, match=f"member '{other}''s 'time' {why}"):
            insitu_pipeline(coll, manifest, {"x": coll["data"]}, stride="12h")
    coll = Collection.from_arrays([(tmp_path / "a.zarr", "t2m"), (tmp_path / "b.zarr", "t2m")])
    manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"takes dates .* not sample indices"):
        insitu_pipeline(coll, manifest, {"x": coll["data"]}, missing=[0])


def _mostly_single(tmp_path: Path) -> tuple[Collection, list[np.ndarray], list[np.ndarray]]:
    """Scene ``a``: four 6-hourly samples; scenes ``s0`` .. ``s4``: one sample each, 3 hours
    apart (hours 1000, 1003, ...). Between consecutive present times, 3 hours is the most
    common difference: only scene ``a`` can tell the step (6 hours)."""
    _period(tmp_path / "a.zarr", 0, 4)
    for k in range(5):
        _period(tmp_path / f"s{k}.zarr", 1000 + 3 * k, 1)
    roots = [tmp_path / "a.zarr"] + [tmp_path / f"s{k}.zarr" for k in range(5)]
    coll = Collection.from_arrays(
        [(root, "t2m") for root in roots], names=["a"] + [f"s{k}" for k in range(5)]
    )
    return coll, [_read(r)[0] for r in roots], [_read(r)[1] for r in roots]


@pytest.mark.parametrize("asked", ["timed window", "missing date"])
def test_members_mostly_one_sample_long_take_the_step_of_those_holding_two(
    tmp_path: Path, asked: str
) -> None:
    coll, data, times = _mostly_single(tmp_path)
    manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
    if asked == "timed window":  # "-6h": one step back in scene a
        view, options = coll["data"].window(["-6h", "0h"]), {}
    else:  # a window in samples, its steps checked against the data's step (no gap)
        view, options = coll["data"].window([-1, 0]), {"missing": [times[3][0]]}
    pipe = insitu_pipeline(coll, manifest, {"w": view}, batch_size=2, coords=["time"], **options)
    dropped = pipe.stages.plan.dropped
    got = set()
    for b in _rows(pipe):
        for r, (m, idx) in enumerate(zip(b.members["w"], b.sample_indices["w"], strict=True)):
            np.testing.assert_array_equal(np.asarray(b["w"][r]), data[int(m)][idx])
            np.testing.assert_array_equal(b.coords["w"]["time"][r], times[int(m)][idx])
            got.add((int(m), *map(int, idx)))
    # the oracle: scene a's windows (i - 1, i); a one-sample scene has no step before its own
    assert got == {(0, 0, 1), (0, 1, 2), (0, 2, 3)}
    assert not dropped.get("gap")


def test_members_none_of_which_holds_two_times_refuse_a_timed_window_and_keep_a_time_stride(
    tmp_path: Path,
) -> None:
    for k in range(4):
        _period(tmp_path / f"s{k}.zarr", 6 * k, 1)  # hours 0, 6, 12, 18: one each
    roots = [tmp_path / f"s{k}.zarr" for k in range(4)]
    coll = Collection.from_arrays([(r, "t2m") for r in roots], names=[f"s{k}" for k in range(4)])
    manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"no member .* holds two times.* offsets in samples"):
        insitu_pipeline(coll, manifest, {"w": coll["data"].window(["-6h", "0h"])})
    # a time stride keeps the samples on its multiples: no step needed
    pipe = insitu_pipeline(coll, manifest, {"x": coll["data"]}, stride="12h", batch_size=4)
    kept = {int(m) for b in _rows(pipe) for m in b.members["x"]}
    assert kept == {0, 2}


@pytest.mark.parametrize("winner", ["first", "last"])
def test_overlapping_stores_are_read_from_the_store_overlap_names(
    tmp_path: Path, winner: str
) -> None:
    _period(tmp_path / "a.zarr", 0, 8)  # hours 0 .. 42
    _period(tmp_path / "b.zarr", 24, 10)  # hours 24 .. 78: a's last chunk (24 .. 42) again
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    coll = concat([a, b], ["t2m"], dim="time", overlap=winner)
    kept = [_read(a), _read(b, 4)] if winner == "first" else [_read(a, 0, 4), _read(b)]
    data = np.concatenate([d for d, _ in kept])
    times = np.concatenate([t for _, t in kept])
    assert coll["t2m"].shape == (14, 2, 3)
    np.testing.assert_array_equal(np.diff(times), np.full(13, 6 * HOUR))  # one timeline
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    batches = _rows(insitu_pipeline(coll, manifest, {"x": coll["t2m"]}, coords=["time"],
                                    batch_size=4))  # fmt: skip
    idx = np.concatenate([bt.sample_indices["x"] for bt in batches])
    assert sorted(idx.tolist()) == list(range(14))
    for bt in batches:
        rows = bt.sample_indices["x"]
        np.testing.assert_array_equal(np.asarray(bt["x"]), data[rows])  # zarr's read
        np.testing.assert_array_equal(bt.coords["x"]["time"], times[rows])
        np.testing.assert_array_equal(bt.members["x"], (rows >= len(kept[0][0])).astype(int))
    other = concat([a, b], ["t2m"], dim="time", overlap="last" if winner == "first" else "first")
    assert other.name != coll.name  # another winner: another fingerprint, no shared cache


def test_overlaps_without_a_winner_or_not_on_chunk_boundaries_are_refused_naming_the_times(
    tmp_path: Path,
) -> None:
    _period(tmp_path / "a.zarr", 0, 8)  # hours 0 .. 42, chunks of 4 steps
    _period(tmp_path / "b.zarr", 30, 8)  # from hour 30: overlaps a's last 3 steps
    _period(tmp_path / "inside.zarr", 6, 4)  # all of it inside a
    _period(tmp_path / "off.zarr", 45, 4)  # 3 h off the 6-hourly grid
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    with pytest.raises(ValueError, match=r"starts at 2000-01-02T06:00.*overlap.*overlap=.first"):
        concat([a, b], ["t2m"])
    with pytest.raises(
        ValueError,
        match=r"overlap from 2000-01-02T06:00.* to 2000-01-02T18:00.*overlap='first' would cut "
        r".*b.zarr.* at its step 3 \(2000-01-03T00:00:00.000000000\), inside a chunk of 4",
    ):  # (b's step 3: hour 48)
        concat([a, b], ["t2m"], overlap="first")
    with pytest.raises(ValueError, match=r"overlap='last' would cut .*a.zarr.* at its step 5"):
        concat([a, b], ["t2m"], overlap="last")
    with pytest.raises(ValueError, match="holds all of the other's times"):
        concat([a, tmp_path / "inside.zarr"], ["t2m"], overlap="first")
    with pytest.raises(ValueError, match=r"starts at 2000-01-02T21:00.*leave a gap"):
        concat([a, tmp_path / "off.zarr"], ["t2m"], overlap="first")
    with pytest.raises(ValueError, match="overlap must be 'error', 'first' or 'last'"):
        concat([a, b], ["t2m"], overlap="both")


def _store_at(root: Path, name: str, start: int, n: int, chunk: int, step: int = 6) -> None:
    """A store with one array ``name (time, lat, lon)`` chunked ``chunk`` along time, and its
    CF ``time`` in hours: ``n`` steps of ``step`` hours from hour ``start``."""
    _period(root, start, n, chunk=chunk, step=step)
    group = zarr.open_group(root, mode="a")
    if name != "t2m":
        group.create_array(name, data=np.asarray(group["t2m"][:]) * -1, chunks=(chunk, 2, 3),
                           dimension_names=("time", "lat", "lon"))  # fmt: skip
        del group["t2m"]


def _at(root: Path, name: str, times: np.ndarray) -> np.ndarray:
    """The oracle: zarr's read of ``name`` of ``root`` at ``times`` (found by value)."""
    group = zarr.open_group(root, mode="r")
    own = np.datetime64("2000-01-01T00", "ns") + np.asarray(group["time"][:]) * HOUR
    index = np.searchsorted(own, times)
    assert np.array_equal(own[index], times)
    return np.asarray(group[name][:])[index]


def test_arrays_of_stores_chunked_differently_are_joined_by_their_times(tmp_path: Path) -> None:
    atmos, forcing = tmp_path / "atmos.zarr", tmp_path / "forcing.zarr"
    _store_at(atmos, "t2m", 0, 20, chunk=4)  # hours 0 .. 114
    _store_at(forcing, "sst", -24, 18, chunk=2)  # hours -24 .. 78: 4 steps (2 chunks) earlier
    coll = Collection.join({"atmos": (atmos, ["t2m"]), "forcing": (forcing, ["sst"])})
    assert coll.variables == ("atmos/t2m", "forcing/sst")
    assert coll["atmos/t2m"].n_samples == coll["forcing/sst"].n_samples == 14  # hours 0 .. 78
    views = {"t2m": coll["atmos/t2m"].window(["-6h", "0h"]), "sst": coll["forcing/sst"]}
    manifest = split_by_chunk(coll["atmos/t2m"], (1.0, 0.0, 0.0))
    batches = _rows(insitu_pipeline(coll, manifest, views, coords=["time"], stride="12h",
                                    batch_size=3))  # fmt: skip
    seen = []
    for b in batches:
        t2m_times, sst_times = b.coords["t2m"]["time"], b.coords["sst"]["time"]
        np.testing.assert_array_equal(t2m_times[:, 1], sst_times)  # one time per row
        np.testing.assert_array_equal(np.asarray(b["t2m"]), _at(atmos, "t2m", t2m_times))
        np.testing.assert_array_equal(np.asarray(b["sst"]), _at(forcing, "sst", sst_times))
        seen += sst_times.tolist()
    hours = (np.array(sorted(seen), dtype="M8[ns]") - np.datetime64("2000-01-01", "ns")) // HOUR
    assert hours.tolist() == list(range(12, 79, 12))  # every 12 h, windows inside 0 .. 78


def test_a_join_starts_where_every_store_is_at_a_chunk_boundary(tmp_path: Path) -> None:
    atmos, forcing = tmp_path / "atmos.zarr", tmp_path / "forcing.zarr"
    _store_at(atmos, "t2m", 0, 20, chunk=4)
    _store_at(forcing, "sst", -6, 20, chunk=3)  # hour 0 is its step 1: mid-chunk
    coll = Collection.join({"atmos": (atmos, ["t2m"]), "forcing": (forcing, ["sst"])})
    # hour 48 is atmos's step 8 and forcing's step 9: the first shared chunk boundary
    manifest = split_by_chunk(coll["atmos/t2m"], (1.0, 0.0, 0.0))
    views = {"t2m": coll["atmos/t2m"], "sst": coll["forcing/sst"]}
    batches = _rows(insitu_pipeline(coll, manifest, views, coords=["time"], batch_size=4))
    times = np.sort(np.concatenate([b.coords["sst"]["time"] for b in batches]))
    hours = (times - np.datetime64("2000-01-01", "ns")) // HOUR
    assert hours.tolist() == list(range(48, 109, 6))  # to forcing's last, hour 108
    for b in batches:
        np.testing.assert_array_equal(
            np.asarray(b["t2m"]), _at(atmos, "t2m", b.coords["t2m"]["time"])
        )
        np.testing.assert_array_equal(
            np.asarray(b["sst"]), _at(forcing, "sst", b.coords["sst"]["time"])
        )


def test_stores_that_do_not_align_are_refused_naming_their_times(tmp_path: Path) -> None:
    atmos = tmp_path / "atmos.zarr"
    _store_at(atmos, "t2m", 0, 8, chunk=4)
    _store_at(tmp_path / "hourly.zarr", "sst", 0, 8, chunk=4, step=1)
    _store_at(tmp_path / "offgrid.zarr", "sst", 3, 8, chunk=4)
    _store_at(tmp_path / "later.zarr", "sst", 60, 8, chunk=4)
    _store_at(tmp_path / "odd.zarr", "sst", -6, 8, chunk=2)  # its chunks start on odd steps

    def join_with(other: str) -> Any:
        return Collection.join({"a": (atmos, ["t2m"]), "b": (tmp_path / other, ["sst"])})

    with pytest.raises(ValueError, match=r"'b' steps 3600 s, 'a' 21600 s"):
        join_with("hourly.zarr")
    with pytest.raises(ValueError, match=r"'b' starts at 2000-01-01T03:00.*not on one grid"):
        join_with("offgrid.zarr")
    with pytest.raises(ValueError, match=r"share no time .*'a' 2000-01-01T00:00.* \.\. "
                                         r"2000-01-02T18:00"):  # fmt: skip
        join_with("later.zarr")
    with pytest.raises(ValueError, match=r"no shared time in it is at a chunk boundary"):
        join_with("odd.zarr")
    with pytest.raises(TypeError, match=r"\(store, \[array paths\]\)"):
        Collection.join({"a": (atmos, "t2m")})


def test_a_join_reads_each_kept_chunk_once_resumes_exactly_and_its_warm_cache_reads_nothing(
    tmp_path: Path,
) -> None:
    from helpers import counting_store
    from resume_helpers import assert_resumes_exactly

    _store_at(tmp_path / "atmos.zarr", "t2m", 0, 20, chunk=4)  # hours 0 .. 114
    _store_at(tmp_path / "forcing.zarr", "sst", -24, 18, chunk=2)  # shared: hours 0 .. 78
    atmos, forcing = (
        counting_store(tmp_path / "atmos.zarr"),
        counting_store(tmp_path / "forcing.zarr"),
    )
    coll = Collection.join({"atmos": (atmos, ["t2m"]), "forcing": (forcing, ["sst"])})
    manifest = split_by_chunk(coll["atmos/t2m"], (1.0, 0.0, 0.0))
    views = {"t2m": coll["atmos/t2m"].window([-1, 0]), "sst": coll["forcing/sst"]}

    def build(**cache: Any) -> Any:
        return insitu_pipeline(coll, manifest, views, batch_size=3, block_chunks=2, seed=4,
                               **cache)  # fmt: skip

    def data_gets(store: Any) -> dict[str, int]:  # (the time coordinates' reads left out)
        return {k: n for k, n in store.chunk_counts().items() if not k.startswith("time/")}

    def records(batches: list[Any]) -> list[Any]:
        return [(b.epoch, b.index, b.sample_indices["sst"].tolist()) for b in batches]

    pipe = build()
    try:
        loader = Loader(pipe)
        ref = records(list(loader))
        # read-once: the chunks over the shared steps, each once; none before or after them
        assert data_gets(atmos) == {f"t2m/c/{c}/0/0": 1 for c in range(4)}  # steps 0 .. 15
        assert data_gets(forcing) == {f"sst/c/{c}/0/0": 1 for c in range(2, 9)}  # 4 .. 17
        ref += records(list(loader))
    finally:
        pipe.close()
    assert_resumes_exactly(build, records, ref, (1, len(ref) // 2 + 1))
    for run in range(2):
        atmos.reset_counts()
        forcing.reset_counts()
        # (each store behind the routing store checked as it would be alone)
        pipe = build(cache_dir=tmp_path / "cache", persist=True)
        try:
            assert records(list(Loader(pipe)))  # (its epoch 0)
        finally:
            pipe.close()
        if run:
            assert data_gets(atmos) == data_gets(forcing) == {}, "a warm cache read the stores"
        else:
            assert data_gets(atmos) and data_gets(forcing)


def test_a_join_takes_a_concatenation_cut_where_its_stores_meet(tmp_path: Path) -> None:
    back, main, forcing = (tmp_path / n for n in ("back.zarr", "main.zarr", "forcing.zarr"))
    _period(back, 0, 8)  # 2000-01-01T00 .. 01-02T18
    _period(main, 48, 10)  # 2000-01-03T00 .. 01-05T06
    _period(forcing, -24, 30)  # 1999-12-31T00 ..: its index 4 is 2000-01-01T00
    archive = concat([back, main], ["t2m"], dim="time")
    joined = Collection.join(
        {"atmos": (archive, ["t2m"]), "forcing": (forcing, ["t2m"])}, dim="time"
    )
    assert [Path(m).name for m in joined.members] == ["back.zarr", "main.zarr"]  # two pieces
    atmos = np.concatenate([_read(back)[0], _read(main)[0]])
    atmos_times = np.concatenate([_read(back)[1], _read(main)[1]])
    sst, sst_times = _read(forcing)
    n = joined["atmos/t2m"].n_samples
    assert n == 18  # every archive step: the forcing covers them all
    views = {"x": joined["atmos/t2m"].window(["-6h", "0h"]), "f": joined["forcing/t2m"]}
    manifest = split_by_chunk(joined["atmos/t2m"], (1.0, 0.0, 0.0))
    batches = _rows(insitu_pipeline(joined, manifest, views, coords=["time"], batch_size=4))
    seen = []
    for b in batches:
        idx, f_idx = b.sample_indices["x"], b.sample_indices["f"]
        np.testing.assert_array_equal(np.asarray(b["x"]), atmos[idx])  # across the seam too
        np.testing.assert_array_equal(np.asarray(b["f"]), sst[f_idx + 4])
        np.testing.assert_array_equal(b.coords["x"]["time"], atmos_times[idx])
        np.testing.assert_array_equal(b.coords["f"]["time"], sst_times[f_idx + 4])
        np.testing.assert_array_equal(idx[:, 1], f_idx)
        seen.extend(f_idx.tolist())
    assert sorted(seen) == list(range(1, n))  # every anchor whose window fits, once
    # a forcing chunked by 8 from 1999-12-31T00: the seam (2000-01-03T00) falls mid-chunk
    other = tmp_path / "forcing8.zarr"
    _period(other, -24, 30, chunk=8)
    with pytest.raises(ValueError, match=r"stores meet at 2000-01-03T00.* inside a chunk of 8"):
        Collection.join({"atmos": (archive, ["t2m"]), "forcing": (other, ["t2m"])}, dim="time")


def test_stores_or_members_whose_times_are_in_other_calendars_are_refused_naming_them(
    tmp_path: Path,
) -> None:
    # 2000-01-01 in noleap is 7 days (1972..1996's leap days) fewer seconds after 1970 than in
    # the standard calendar: a noleap store from hour 216 "continues" a standard one ending at
    # hour 42 second for second, though its dates are 2000-01-10 on. Seconds of two calendars
    # are not one timeline: concat and join must refuse, not jump 7 days (or align them).
    _period(tmp_path / "std.zarr", 0, 8)
    _period(tmp_path / "nl.zarr", 48 + 168, 8, calendar="noleap")
    _period(tmp_path / "nl0.zarr", 0, 8, calendar="noleap")
    std, nl = str(tmp_path / "std.zarr"), str(tmp_path / "nl.zarr")
    with pytest.raises(ValueError, match=r"calendar") as info:
        concat([std, nl], ["t2m"], dim="time")
    assert "std.zarr" in str(info.value) and "nl.zarr" in str(info.value)
    assert "noleap" in str(info.value)
    _period(tmp_path / "nl_join.zarr", 168, 8, calendar="noleap")  # the same seconds as std
    with pytest.raises(ValueError, match=r"calendar.*noleap|noleap.*calendar"):
        Collection.join(
            {"a": (std, ["t2m"]), "b": (str(tmp_path / "nl_join.zarr"), ["t2m"])}, dim="time"
        )
    scenes = Collection.from_arrays(
        [(std, "t2m"), (str(tmp_path / "nl0.zarr"), "t2m")], names=["s", "n"], sample_axis="time"
    )
    view = scenes["data"]
    with pytest.raises(ValueError, match=r"calendar") as info:
        insitu_pipeline(scenes, split_by_chunk(view, (1.0, 0.0, 0.0)), {"w": view},
                        stride="6h", coords=["time"])  # fmt: skip
    assert "'n'" in str(info.value) and "noleap" in str(info.value)


def test_a_missing_time_is_refused_naming_its_store_and_index_not_as_an_irregular_step(
    tmp_path: Path,
) -> None:
    # a zarr v2 store whose CF time starts at 0 and whose time array has zarr's default
    # fill_value 0: xarray (and the package) read that first time as missing (NaT). concat,
    # join and scenes used to refuse it as "not at one step ([-9223372035908069408 21600] s)"
    for name, start in (("a.zarr", 0), ("b.zarr", 48)):
        group = zarr.open_group(tmp_path / name, mode="w", zarr_format=2)
        t2m = group.create_array("t2m", shape=(8, 2, 3), chunks=(4, 2, 3), dtype="f4")
        t2m[:] = 1.0
        t2m.attrs["_ARRAY_DIMENSIONS"] = ["time", "lat", "lon"]
        time_ = group.create_array("time", shape=(8,), chunks=(8,), dtype="i8")
        time_[:] = start + 6 * np.arange(8)
        time_.attrs.update({"units": "hours since 2000-01-01", "_ARRAY_DIMENSIONS": ["time"]})
    assert zarr.open_array(tmp_path / "a.zarr", path="time").fill_value == 0
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    why = r"at index 0 is missing .*fill_value"
    with pytest.raises(ValueError, match=f"concat: {a!r}'s time {why}"):
        concat([a, b], ["t2m"], dim="time")
    with pytest.raises(ValueError, match=f"join: 'x''s time {why}"):
        Collection.join({"x": (a, ["t2m"]), "y": (b, ["t2m"])}, dim="time")
    scenes = Collection.from_arrays([(a, "t2m"), (b, "t2m")], names=["x", "y"])
    manifest = split_by_chunk(scenes["data"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=f"member 'x''s time 'time' {why}"):
        insitu_pipeline(scenes, manifest, {"w": scenes["data"].window(["-6h", "0h"])})


def test_open_coordinates_takes_a_concatenation_as_its_store_and_gives_the_joined_times(
    tmp_path: Path,
) -> None:
    # insitu_pipeline and fit_statistics take a collection as their store; open_coordinates
    # used to fail with "expected str, bytes or os.PathLike object, not Collection"
    from insitubatch_nodes.io.coords import open_coordinates

    _period(tmp_path / "a.zarr", 0, 8)
    _period(tmp_path / "b.zarr", 48, 4)
    coll = concat([tmp_path / "a.zarr", tmp_path / "b.zarr"], ["t2m"], dim="time")
    times = open_coordinates(coll, coll["t2m"])["time"].values
    want = np.concatenate([_read(tmp_path / "a.zarr")[1], _read(tmp_path / "b.zarr")[1]])
    np.testing.assert_array_equal(times, want)
