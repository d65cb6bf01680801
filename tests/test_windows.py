"""Forecast samples: multi-step windows, their coordinates, and other views between epochs.

The oracles are zarr (a window of anchor ``a`` must equal ``array[a + offsets]`` as zarr reads
it; the stored objects a 6-hourly epoch must read are the files zarr wrote for those steps) and
xarray (which steps lie on a 6-hourly grid comes from ``ds.time.dt.hour % 6 == 0``; the times a
batch's coordinates must hold are ``ds.time`` at the window's steps). Nothing here asks the
package's plan what the right answer is.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import FetchOptions, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.schedule import schedule_floors
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from tests.helpers import counting_store
from tests.resume_helpers import assert_resumes_exactly

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

N = 48  # samples along the sample axis (hourly steps: two days)
FIELD = (3, 4)


def _zarr_store(
    root: Path, *, sample_axis: int = 0, spc: int = 1, zarr_format: int = 3, shard: int = 0
) -> Path:
    """``a``: ``N`` samples of ``FIELD`` along ``sample_axis``, written by zarr, ``spc``
    samples per chunk (inside shards of ``shard`` samples when given); no value equals the fill
    value, so every object exists."""
    shape = list(FIELD)
    shape.insert(sample_axis, N)
    chunks = list(FIELD)
    chunks.insert(sample_axis, spc)
    data = np.random.default_rng(7).uniform(1.0, 2.0, shape).astype(np.float32)
    kw: dict[str, Any] = {}
    if shard:
        shards = list(FIELD)
        shards.insert(sample_axis, shard)
        kw["shards"] = tuple(shards)
    arr = zarr.create_array(
        zarr.storage.LocalStore(root), name="a", shape=tuple(shape), chunks=tuple(chunks),
        dtype="float32", zarr_format=zarr_format, fill_value=0.0, **kw,
    )  # fmt: skip
    arr[...] = data
    return root


def _hourly_store(root: Path, spc: int = 1, start: str = "2020-01-01T03:00", n: int = N) -> Path:
    """``t2m`` ``(time, lat, lon)`` written by xarray, ``spc`` steps per object, hourly times
    from ``start`` (03 UTC: index 0 is not on the 6-hourly grid)."""
    times = pd.date_range(start, periods=n, freq="h").values
    data = np.random.default_rng(0).standard_normal((n, *FIELD)).astype(np.float32)
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), data)},
        coords={"time": times, "lat": [1.0, 2.0, 3.0], "lon": [0.0, 1.0, 2.0, 3.0]},
    )
    time = {"units": "hours since 2000-01-01", "dtype": "float64"}
    encoding = {"t2m": {"chunks": (spc, *FIELD)}, "time": time}
    ds.to_zarr(root, mode="w", zarr_format=3, consolidated=False, encoding=encoding)
    return root


def _xr_times(root: Path) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with xr.open_zarr(root, consolidated=False) as ds:
            return np.asarray(ds.time.values)


def _epoch(pipe: Any) -> list[Any]:
    return list(pipe)


def _steps(data: np.ndarray, samples: np.ndarray, axis: int) -> np.ndarray:
    """``data`` at ``samples`` (any shape) along ``axis``, those axes first: the oracle."""
    return np.moveaxis(np.take(data, samples, axis=axis), list(range(axis, axis + samples.ndim)),
                       list(range(samples.ndim)))  # fmt: skip


@pytest.mark.parametrize(
    ("sample_axis", "spc", "zarr_format", "shard"),
    [(0, 1, 3, 0), (0, 4, 3, 0), (1, 1, 3, 0), (1, 4, 3, 0), (0, 2, 3, 8), (0, 4, 2, 0),
     (1, 1, 2, 0)],
    ids=["axis0-spc1", "axis0-spc4", "axis1-spc1", "axis1-spc4", "sharded", "v2-spc4",
         "v2-axis1-spc1"],
)  # fmt: skip
def test_a_window_holds_the_array_at_the_anchor_plus_each_offset_for_any_layout(
    tmp_path: Path, sample_axis: int, spc: int, zarr_format: int, shard: int
) -> None:
    root = _zarr_store(
        tmp_path / "w.zarr", sample_axis=sample_axis, spc=spc, zarr_format=zarr_format, shard=shard
    )
    data = zarr.open_array(root / "a", mode="r")[...]
    g = open_geometries(root, sample_axis=sample_axis)["a"]
    views = {"x": g.window([-2, 0]), "y": g.window([1, 2, 3]), "z": g.shift(1)}
    pipe = insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), views, batch_size=5,
                           block_chunks=2, seed=1)  # fmt: skip
    try:
        batches = _epoch(pipe)
    finally:
        pipe.close()
    anchors = np.concatenate([b.sample_indices["z"] - 1 for b in batches])
    assert sorted(anchors.tolist()) == list(range(2, N - 3))  # every step inside the array
    for b in batches:
        a = b.sample_indices["z"] - 1
        assert b["x"].shape == (len(b), 2, *FIELD) and b["y"].shape == (len(b), 3, *FIELD)
        np.testing.assert_array_equal(b.sample_indices["x"], a[:, None] + [-2, 0])
        np.testing.assert_array_equal(b.sample_indices["y"], a[:, None] + [1, 2, 3])
        for label in ("x", "y", "z"):
            want = _steps(data, b.sample_indices[label], sample_axis)
            np.testing.assert_array_equal(b[label], want)


def test_a_shifted_patched_window_moves_every_step_and_cuts_each_at_the_rows_origin(
    tmp_path: Path,
) -> None:
    root = _zarr_store(tmp_path / "p.zarr", spc=2)
    data = zarr.open_array(root / "a", mode="r")[...]
    g = open_geometries(root)["a"]
    patched = g.patches({1: 2, 2: 2})
    views = {"x": patched.shift(2).window([-1, 0]), "p": patched.window([0, 1])}
    pipe = insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), views, batch_size=4)
    try:
        batches = _epoch(pipe)
    finally:
        pipe.close()
    for b in batches:
        np.testing.assert_array_equal(b.sample_indices["x"], b.sample_indices["p"] + 1)
        assert b["p"].shape == b["x"].shape == (len(b), 2, 2, 2)
        np.testing.assert_array_equal(b.patch_origins["x"], b.patch_origins["p"])
        for i, (y0, x0) in enumerate(b.patch_origins["p"].tolist()):
            for label in ("x", "p"):
                want = data[b.sample_indices[label][i], y0 : y0 + 2, x0 : x0 + 2]
                np.testing.assert_array_equal(b[label][i], want)


def test_window_offsets_are_checked_where_the_window_is_made(tmp_path: Path) -> None:
    g = open_geometries(_zarr_store(tmp_path / "c.zarr"))["a"]
    with pytest.raises(ValueError, match="repeat a step"):
        g.window([0, 1, 0])
    with pytest.raises(TypeError, match="mix samples and time deltas"):
        g.window([0, "6h"])
    with pytest.raises(ValueError, match="at least one offset"):
        g.window([])
    with pytest.raises(ValueError, match="a window already"):
        g.window([0, 1]).window([2])
    assert g.window([-1, 0]).sample_shape == (2, *FIELD)
    assert g.window([-1, 0]).base == g
    with pytest.raises(ValueError, match="resolved through the time coordinate"):
        g.window(["-6h", "0h"]).parts()
    # the plan's own functions take a window's steps, never the window whole
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="is a window: a plan reads its steps as plain views"):
        plan_epoch(manifest, {"x": g.window([-1, 0])})
    with pytest.raises(ValueError, match="is a window"):
        schedule_floors(manifest, {"x": g.window([-1, 0])})


def test_time_delta_windows_on_6h_anchors_hold_the_steps_xarray_selects_read_once(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with xr.open_zarr(root, consolidated=False) as ds:
            times = ds.time.values
            on_grid = ds.time.where(ds.time.dt.hour % 6 == 0, drop=True).values
    index = {t: i for i, t in enumerate(times.tolist())}
    # inputs t - 6h, t; targets t + 6h, t + 12h: anchors whose every step lies in the array
    want = [index[t] for t in on_grid.tolist() if index[t] >= 6 and index[t] + 12 < N]
    assert want[0] == 9  # 12 UTC: 06 UTC (index 3) has no step 6 h before it
    data = zarr.open_array(root / "t2m", mode="r")[...]
    store = counting_store(root)
    g = open_geometries(store)["t2m"]
    views = {"x": g.window(["-6h", "0h"]), "y": g.window([np.timedelta64(6, "h"), "12h"])}
    pipe = insitu_pipeline(store, split_by_chunk(g, (1.0, 0.0, 0.0)), views, stride="6h",
                           batch_size=3, block_chunks=4, seed=2)  # fmt: skip
    try:
        batches = _epoch(pipe)
        stats = pipe.stats()
    finally:
        pipe.close()
    anchors = np.concatenate([b.sample_indices["x"][:, 1] for b in batches])
    assert sorted(anchors.tolist()) == want
    for b in batches:
        a = b.sample_indices["x"][:, 1]
        np.testing.assert_array_equal(b.sample_indices["y"], a[:, None] + [6, 12])
        np.testing.assert_array_equal(b["x"], data[a[:, None] + [-6, 0]])
        np.testing.assert_array_equal(b["y"], data[a[:, None] + [6, 12]])
        assert b.coords["x"]["time"].shape == (len(b), 2)
        np.testing.assert_array_equal(b.coords["x"]["time"], times[a[:, None] + [-6, 0]])
        np.testing.assert_array_equal(b.coords["y"]["time"], times[a[:, None] + [6, 12]])
    on_grid_objects = {f"t2m/c/{a + k}/0/0" for a in want for k in (-6, 0, 6, 12)}
    data_gets = {k: n for k, n in store.chunk_counts().items() if k.startswith("t2m/")}
    assert data_gets == dict.fromkeys(on_grid_objects, 1)  # each on-grid step once
    assert stats["gets"] == len(on_grid_objects) < N // 4 + 2


def test_patched_time_delta_windows_on_a_6h_stride_hold_xarrays_steps_cut_at_each_origin(
    tmp_path: Path,
) -> None:
    # the docs compose windows in time deltas with a time stride and with patches: a regional
    # forecaster on 2 x 2 windows of the field, anchors at 00/06/12/18 UTC, inputs (t - 6h, t),
    # target t + 6h; a listed date and an absent object drop the anchors that read them
    root = _hourly_store(tmp_path / "h.zarr", spc=2)
    (root / "t2m" / "c" / "22" / "0" / "0").unlink()  # steps 44, 45 lose their object
    times = _xr_times(root)
    data = zarr.open_array(root / "t2m", mode="r")[...]
    g = open_geometries(root)["t2m"]
    patched = g.patches({"lat": 2, "lon": 2})
    views = {"x": patched.window(["-6h", "0h"]), "y": patched.window(["6h"])}
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    listed = times[9]  # read by anchors 9 (at 0h) and 15 (at -6h); 3 reads before the start
    pipe = insitu_pipeline(root, manifest, views, stride="6h", missing=[listed],
                           missing_objects="drop", batch_size=5, coords=["time"])  # fmt: skip
    try:
        batches = _epoch(pipe)
        dropped = dict(pipe.stages.plan.dropped)
    finally:
        pipe.close()
    on_grid = [a for a in range(N) if pd.Timestamp(times[a]).hour % 6 == 0]
    steps = {a: (a - 6, a, a + 6) for a in on_grid}
    gone = {9, 44, 45}  # 44 and 45: read by anchor 39 (at +6h)
    want = sorted(a for a, s in steps.items() if s[0] >= 0 and s[-1] < N and not set(s) & gone)
    got: list[tuple[int, tuple[int, ...]]] = []
    for b in batches:
        np.testing.assert_array_equal(b.patch_origins["x"], b.patch_origins["y"])
        for i, (y0, x0) in enumerate(b.patch_origins["x"].tolist()):
            for label in ("x", "y"):
                rows = b.sample_indices[label][i]
                np.testing.assert_array_equal(b[label][i], data[rows, y0 : y0 + 2, x0 : x0 + 2])
                np.testing.assert_array_equal(b.coords[label]["time"][i], times[rows])
            got.append((int(b.sample_indices["x"][i, 1]), (y0, x0)))
    # every window of every kept anchor once: the origins of the plain (unstrided) plan's rows
    plain = {"x": patched.window([-6, 0]), "y": patched.window([6])}
    pipe = insitu_pipeline(root, manifest, plain, batch_size=5, coords=())
    try:
        origins = {tuple(o) for b in _epoch(pipe) for o in b.patch_origins["x"].tolist()}
    finally:
        pipe.close()
    assert len(got) == len(set(got)) == len(want) * len(origins)
    assert {a for a, _ in got} == set(want) and {o for _, o in got} == origins
    assert want == [21, 27, 33]
    assert dropped == {"nat": 0, "gap": 0, "missing": 2, "absent_object": 1}


def test_a_time_delta_that_is_not_a_multiple_of_the_data_step_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr")
    g = open_geometries(root)["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"window offset -90 minutes is not a whole multiple "
                       r"of the data's step \(1h between samples of 'time'\)"):  # fmt: skip
        insitu_pipeline(root, manifest, {"x": g.window(["-90min", "0h"])})
    with pytest.raises(ValueError, match="in time deltas"):  # a bare plan has no times
        ReadPlanNode(manifest, {"x": g.window(["-1h", "0h"])})


def test_single_use_steps_decode_straight_into_their_row_and_step_with_no_other_batch_memory(
    tmp_path: Path,
) -> None:
    # every anchor 2 apart and a window [0, 1]: each one-step chunk is read by one (row, step)
    root = _zarr_store(tmp_path / "d.zarr", spc=1)
    data = zarr.open_array(root / "a", mode="r")[...]
    g = open_geometries(root)["a"]
    # the straight path asked for: a split this small is otherwise kept in the pool for the
    # next epoch (kept_bytes), a store's larger than a 16th of RAM is not
    fetch = FetchOptions(direct=True, prefetch_depth=1)
    pipe = insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g.window([0, 1])},
                           stride=2, batch_size=4, fetch=fetch)  # fmt: skip
    try:
        loader = Loader(pipe)
        rows, batch_bytes, allocations = 0, 0, []
        for _ in range(2):  # two epochs, each batch let go once checked: buffers are reused
            for b in loader:
                np.testing.assert_array_equal(b["x"], data[b.sample_indices["x"]])
                rows, batch_bytes = rows + len(b), b["x"].nbytes
                del b
            allocations.append(pipe.stages.gather.buffer_allocations)
        stats = pipe.stats()
    finally:
        pipe.close()
    assert rows == 2 * (N // 2)
    # every object (one per step of the epoch) was decoded into its (row, t) slice: no pool
    # slot held it and the gather copied nothing
    assert stats["misses_in_place"] == 2 * N  # every object of both epochs, once each
    assert stats["misses"] == stats["hits"] == 0
    # the batch memory is the delivered batches' buffers: one (batch, T, *inner) buffer per
    # batch in flight, nothing per step, and no copy into the batch after
    # (how many buffers are in flight depends on the read-ahead; each is one batch's tensor)
    assert stats["batch_buffer_bytes"] <= 1.1 * allocations[-1] * batch_bytes


def test_rows_gathered_into_a_windows_step_take_no_temporary_copy() -> None:
    import tracemalloc

    from insitubatch_nodes.stages.gather import take_rows

    batch = np.zeros((8, 3, 64, 64), np.float32)  # (batch, T, *inner): step 1 is strided
    slot = np.random.default_rng(0).standard_normal((8, 64, 64)).astype(np.float32)
    rows = np.array([0, 1, 3, 6])  # not evenly spaced: no slice copy
    tracemalloc.start()
    try:
        take_rows(slot, rows, batch[:4, 1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(batch[:4, 1], slot[rows])
    assert not batch[:4, 0].any() and not batch[:4, 2].any()
    assert peak < slot[0].nbytes  # not even one row's worth (np.take would buffer all four)


def _records(batches: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (b.epoch, b.index, *(b.sample_indices[k].tolist() for k in sorted(b.arrays)),
         *(float(b[k].sum()) for k in sorted(b.arrays)))
        for b in batches
    ]  # fmt: skip


def _windowed(root: Path, **kw: Any) -> Any:
    g = open_geometries(root)["t2m"]
    views = kw.pop("views", None) or {"x": g.window(["-6h", "0h"]), "y": g.window(["6h"])}
    kw.setdefault("stride", "6h")
    return insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), views, batch_size=2,
                           block_chunks=3, seed=5, **kw)  # fmt: skip


def test_a_mid_epoch_state_with_windows_and_a_time_stride_resumes_at_exactly_the_next_batch(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc=2)
    with _windowed(root) as pipe:
        loader = Loader(pipe)
        reference = [b for _ in range(2) for b in loader]
    want = _records(reference)
    n = len(want) // 2
    # in the first epoch, and in the second
    assert_resumes_exactly(lambda: _windowed(root), _records, want, (1, n + 2))


def test_ranks_cut_mid_epoch_with_windows_and_a_time_stride_resume_on_another_world_size(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc=2, n=10 * 24)
    with _windowed(root) as pipe:  # the builder resolves the windows and attaches the times
        manifest, views = pipe.stages.plan.manifest, pipe.stages.plan.batch_views
        valid = sorted(pipe.stages.plan.epoch_plan(0).anchors.tolist())

    def node(rank: int, world: int) -> ReadPlanNode:
        config = PlanConfig(stride="6h", batch_size=2, block_chunks=3, seed=5, rank=rank,
                            world_size=world)  # fmt: skip
        return ReadPlanNode(manifest, views, config=config)

    delivered: list[int] = []
    state = None
    for r in range(2):  # two ranks deliver 2 batches each
        old = node(r, 2)
        old.reset(None)
        for _ in range(2):
            plan = next(old)
            delivered += plan.anchors.tolist()
            np.testing.assert_array_equal(plan.sample_indices["x[0]"], plan.anchors - 6)
        if r == 0:
            state = old.get_state()
    assert state is not None
    for r in range(3):  # the rest of the epoch on three
        new = node(r, 3)
        new.reset(state)
        delivered += [a for p in new for a in p.anchors.tolist()]
    assert valid == list(range(9, 240 - 6, 6)) and len(delivered) > 8  # 03 UTC start
    assert len(delivered) == len(set(delivered))  # no anchor twice
    assert set(delivered) <= set(valid)
    assert len(valid) - len(delivered) < 3  # only the documented remainder sits out


def test_set_views_takes_effect_at_the_next_epoch_and_a_later_state_resumes_exactly(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc=2, n=96)
    data = zarr.open_array(root / "t2m", mode="r")[...]
    g = open_geometries(root)["t2m"]
    short = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h"])}
    long = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h", "12h", "18h"])}
    with _windowed(root, views=short) as pipe:
        loader = Loader(pipe)
        first = list(loader)
        allocations = pipe.stages.gather.buffer_allocations
        pipe.set_views(long)
        assert pipe.stages.plan.batch_views["y"] == short["y"].in_samples(np.timedelta64(1, "h"))
        second = list(loader)
        assert pipe.stages.gather.buffer_allocations > allocations  # resized for (B, 3, ...)
    for b in first:
        assert b["y"].shape == (len(b), 1, *FIELD)
    for b in second:
        a = b.sample_indices["x"][:, 1]
        assert b["y"].shape == (len(b), 3, *FIELD) and b.epoch == 1
        np.testing.assert_array_equal(b["y"], data[a[:, None] + [6, 12, 18]])
        assert b.coords["y"]["time"].shape == (len(b), 3)
    anchors = sorted(np.concatenate([b.sample_indices["x"][:, 1] for b in second]).tolist())
    assert anchors[-1] + 18 < 96 <= anchors[-1] + 24  # the longer rollout drops the last anchors
    # a state taken after the change, mid-epoch, resumes exactly in a pipeline given the views
    with _windowed(root, views=short) as pipe:
        loader = Loader(pipe)
        list(loader)
        pipe.set_views(long)
        it = iter(loader)
        got = [next(it), next(it)]
        state = loader.state_dict()
    with _windowed(root, views=long) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert _records(got) + _records(list(loader)) == _records(second)


def test_set_views_mid_epoch_leaves_the_epoch_its_views_even_across_a_close(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc=2, n=96)
    g = open_geometries(root)["t2m"]
    short = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h"])}
    long = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h", "12h", "18h"])}
    with _windowed(root, views=short) as pipe:  # the reference: the change between epochs
        loader = Loader(pipe)
        want = _records(list(loader))
        pipe.set_views(long)
        want += _records(list(loader))
    with _windowed(root, views=short) as pipe:
        loader = Loader(pipe)
        it = iter(loader)
        got = [next(it), next(it)]
        pipe.set_views(long)
        got.append(next(it))
        pipe.close()  # releases everything; the next batch resumes where the consumer was
        got += list(it)
        got += list(loader)
    assert _records(got) == want


def test_a_state_from_before_set_views_restores_at_an_epoch_boundary_and_not_mid_epoch(
    tmp_path: Path,
) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc=2, n=96)
    g = open_geometries(root)["t2m"]
    short = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h"])}
    long = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h", "12h", "18h"])}
    with _windowed(root, views=short) as pipe:
        loader = Loader(pipe)
        it = iter(loader)
        next(it)
        mid = loader.state_dict()
        for _ in it:
            pass
        end = loader.state_dict()  # epoch 0 over
    with _windowed(root, views=short) as pipe:  # the reference: epoch 1 under the long views
        loader = Loader(pipe)
        first = _records(list(loader))
        pipe.set_views(long)
        want = _records(list(loader))
    for build in ("built with them", "given by set_views"):
        views = long if build == "built with them" else short
        with _windowed(root, views=views) as pipe:
            if views is short:
                pipe.set_views(long)
            loader = Loader(pipe)
            loader.load_state_dict(end)
            assert _records(list(loader)) == want, build
    # mid-epoch, a pipeline reading the new views refuses it, naming both sets of views
    with _windowed(root, views=long) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(mid)
        with pytest.raises(ValueError, match=r"saved mid-epoch .* with views \[x\[0\]: t2m "
                           r"-6.* y\[0\]: t2m \+6\], and this pipeline reads .*y\[2\]: t2m "
                           r"\+18"):  # fmt: skip
            next(iter(loader))
    # one still reading the old views (the new ones given for the next epoch) ends the epoch
    # under them, as the run that saved the state would have
    with _windowed(root, views=short) as pipe:
        pipe.set_views(long)
        loader = Loader(pipe)
        loader.load_state_dict(mid)
        assert _records(list(loader)) == first[1:]
        assert _records(list(loader)) == want


def test_set_views_refuses_other_arrays_and_a_budget_below_the_new_floor(tmp_path: Path) -> None:
    root = _hourly_store(tmp_path / "h.zarr", spc=2)
    other = open_geometries(_zarr_store(tmp_path / "o.zarr"))["a"]
    g = open_geometries(root)["t2m"]
    with _windowed(root) as pipe:
        with pytest.raises(ValueError, match="set_views takes views of the arrays"):
            pipe.set_views({"x": other})
        with pytest.raises(TypeError, match="must be an ArrayGeometry"):
            pipe.set_views({"x": "t2m"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match=r"not a whole multiple"):
            pipe.set_views({"x": g.window(["-30min", "0h"])})
    # a budget with room for a short window's chunks, not for a window 20 chunks long (under
    # every chunk of the split, which holds any window of it)
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    config = PlanConfig(batch_size=2, block_chunks=3, seed=5)
    budget = schedule_floors(manifest, {"a": g, "b": g.shift(1)}, config).guaranteed
    assert budget < g.n_chunks * g.chunk_nbytes
    views = {"x": g.window([0, 1])}
    pipe = _windowed(root, views=views, stride=1, cache_budget_bytes=budget)
    try:
        with pytest.raises(ValueError, match="budget"):
            pipe.set_views({"x": g.window(list(range(0, 40, 2)))})
    finally:
        pipe.close()


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_data_module_forwards_set_views_to_its_training_pipeline_and_keeps_them(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    root = _hourly_store(tmp_path / "h.zarr", spc=2)
    g = open_geometries(root)["t2m"]
    dm = InSituDataModule(root, {"x": g.window([-1, 0]), "y": g.window([1])}, (1.0, 0.0, 0.0),
                          config=PlanConfig(batch_size=4), transform=lambda b: b,
                          log_report=False)  # fmt: skip
    dm.setup("fit")
    try:
        loader = dm.train_dataloader()
        first = [b["y"].shape[1] for b in loader]
        dm.set_views({"x": g.window([-1, 0]), "y": g.window([1, 2, 3, 4, 5])})
        told = len(loader)  # what a trainer is told before the next epoch
        second = [b["y"].shape[1] for b in loader]
        assert dm.train_dataloader() is loader  # the same pipeline, its views changed
    finally:
        dm.teardown("fit")
    # anchors 1 .. 46, then 1 .. 42, in batches of 4
    assert (first, second) == ([1] * 12, [5] * 11)
    assert told == 11


@pytest.mark.slow
@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_lightning_rollout_that_grows_each_epoch_gets_each_epochs_own_windows_and_length(
    tmp_path: Path,
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from insitubatch_nodes.lightning import InSituDataModule

    root = _hourly_store(tmp_path / "h.zarr", spc=2)
    data = zarr.open_array(root / "t2m", mode="r")[...]
    g = open_geometries(root)["t2m"]

    def views(epoch: int) -> dict[str, Any]:  # the target window grows by a step each epoch
        return {"x": g.window([-1, 0]), "y": g.window(list(range(1, epoch + 2)))}

    seen: list[tuple[int, int]] = []

    class Model(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, index: int) -> Any:
            a = batch.sample_indices["x"][:, 1]
            steps = batch["y"].shape[1]
            np.testing.assert_array_equal(batch["y"], data[a[:, None] + np.arange(1, steps + 1)])
            seen.append((self.current_epoch, steps))
            return (self.w * 0.0).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Grow(pl.Callback):  # type: ignore[misc]
        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            trainer.datamodule.set_views(views(trainer.current_epoch + 1))

    dm = InSituDataModule(root, views(0), (1.0, 0.0, 0.0), config=PlanConfig(batch_size=4),
                          transform=lambda b: b, log_report=False)  # fmt: skip
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, callbacks=[Grow()],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Model(), datamodule=dm)
    # anchors 1 .. N - 2 - epoch: 46, 45 and 44 of them, in batches of 4
    per_epoch = [[s for e, s in seen if e == epoch] for epoch in range(3)]
    assert [len(p) for p in per_epoch] == [12, 12, 11]
    assert [set(p) for p in per_epoch] == [{1}, {2}, {3}]


@pytest.mark.parametrize("layout", ["plain", "level_major", "big_endian"])
def test_small_rows_gathered_into_a_strided_step_equal_numpys_take_a_block_at_a_time(
    layout: str,
) -> None:
    from insitubatch_nodes.stages import gather

    rng = np.random.default_rng(1)
    data = rng.standard_normal((4096, 3, 2, 4)).astype(np.float32)  # 96-byte rows
    slot = data
    if layout == "level_major":  # memory (level, sample, ...) seen as (sample, level, ...)
        slot = np.ascontiguousarray(data.swapaxes(0, 1)).swapaxes(0, 1)
    elif layout == "big_endian":
        slot = data.astype(">f4")
    rows = np.sort(rng.choice(4096, 3000, replace=False))  # more rows than one block holds
    assert gather.STRIDED_SCRATCH_BYTES < 3000 * 96
    batch = np.zeros((3000, 2, 3, 2, 4), np.float32)  # (batch, T, *inner): step 1 is strided
    gather.take_rows(slot, rows, batch[:, 1])
    np.testing.assert_array_equal(batch[:, 1], data[rows])
    assert not batch[:, 0].any()
