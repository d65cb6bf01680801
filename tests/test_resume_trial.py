"""A user's trial of the resume and multi-rank contracts on the model-input features.

For each pipeline below — channel stacks (channels first and last, windows, static and
forcing members, fitted ``normalize=``), static fields and forcings as labels, ``isel`` /
``sel`` selections, CF-packed fields unpacked to float32, a concatenation of stores with a
12-hour stride, an OME-NGFF plate, missing steps, an integer stride and the persistent cache —
three claims of docs/training.md are checked:

* resumed from ``state_dict()`` taken mid-epoch, through ``Loader`` and through
  ``StatefulDataLoader(as_dataset(pipe), batch_size=None)``, the rest is bit-for-bit the
  uninterrupted run's (values, sample indices, coordinates, channel names, members, order);
* ranks (``rank=``, ``world_size=``) deliver disjoint samples in equal batch counts, and
  every valid sample but at most ``world_size - 1``, valued as one rank's run values them;
* a state saved on 2 ranks resumes on 3: over old and new ranks every valid sample is
  delivered once (at most 2 sit out), the new ranks yield equal batch counts, and
  ``len(loader)`` is the interrupted epoch's.

The valid samples are computed with numpy from what zarr reads (the time coordinate, the
array shapes); values are checked against zarr's read where a label is an array as stored.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.stateful_dataloader import StatefulDataLoader

from insitubatch_nodes import (
    Batch,
    Forcings,
    InSituPipeline,
    Loader,
    as_dataset,
    concat,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.forcings import FORCINGS
from insitubatch_nodes.synthetic import make_era5_like

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("resume_trial")

N, SPC = 30, 4  # the ERA5-like store: 30 six-hourly steps in chunks of 4


@dataclass
class Case:
    build: Callable[..., InSituPipeline]  # build(rank=..., world_size=...)
    valid: set[tuple[int, ...]]  # row keys (see _keys) of the valid samples
    oracle: Callable[[str, tuple[int, ...]], np.ndarray] | None = None  # zarr read of a row


def _digest(a: Any) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.kind == "M":
        a = a.astype("datetime64[ns]").view("i8")
    return hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()[:16]


def _keys(batch: Batch) -> list[tuple[int, ...]]:
    """One key per row: the row's member (collections) and the sample indices of the first
    label in name order (every step of a window)."""
    label = sorted(batch.sample_indices)[0]
    idx = np.asarray(batch.sample_indices[label])
    members = batch.members.get(label)
    out = []
    for i in range(len(idx)):
        key = tuple(np.atleast_1d(idx[i]).tolist())
        if members is not None:
            key = tuple(np.atleast_1d(np.asarray(members)[i]).tolist()) + key
        out.append(key)
    return out


def _record(batch: Batch) -> dict[str, Any]:
    """Everything a batch delivers, as plain values (taken while its pipeline is open)."""
    return {
        "epoch": int(batch.epoch),
        "index": int(batch.index),
        "rows": _keys(batch),
        "idx": {k: np.asarray(v).tolist() for k, v in sorted(batch.sample_indices.items())},
        "arrays": {k: _digest(v) for k, v in sorted(batch.arrays.items())},
        "coords": {k: {n: _digest(a) for n, a in c.items()} for k, c in batch.coords.items()},
        "channels": {k: list(v) for k, v in batch.channels.items()},
        "members": {k: np.asarray(v).tolist() for k, v in batch.members.items()},
    }


def _row_values(batch: Batch) -> dict[tuple[int, ...], dict[str, str]]:
    return {
        key: {label: _digest(np.asarray(a)[i]) for label, a in batch.arrays.items()}
        for i, key in enumerate(_keys(batch))
    }


@dataclass
class Run:
    records: list[dict[str, Any]]
    values: dict[tuple[int, ...], dict[str, str]]
    state: dict[str, Any]
    length_at_start: int  # len(loader) right after iter() of the first epoch


def _run(
    case: Case,
    *,
    epochs: int = 1,
    stop_after: int | None = None,
    state: dict[str, Any] | None = None,
    check_zarr: bool = False,
    **ranks: int,
) -> Run:
    pipe = case.build(**ranks)
    try:
        loader = Loader(pipe)
        if state is not None:
            loader.load_state_dict(state)
        records: list[dict[str, Any]] = []
        values: dict[tuple[int, ...], dict[str, str]] = {}
        length = -1
        for epoch in range(epochs):
            it = iter(loader)
            if epoch == 0:
                length = len(loader)
            for batch in it:
                records.append(_record(batch))
                values.update(_row_values(batch))
                if check_zarr and case.oracle is not None:
                    for label, arr in batch.arrays.items():
                        for i, key in enumerate(_keys(batch)):
                            want = case.oracle(label, key)
                            if want is not None:
                                np.testing.assert_array_equal(arr[i], want)
                if len(records) == stop_after:
                    return Run(records, values, loader.state_dict(), length)
        return Run(records, values, loader.state_dict(), length)
    finally:
        pipe.close()


def _sdl(
    case: Case, *, epochs: int, stop_after: int | None = None, state: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    pipe = case.build()
    try:
        dl = StatefulDataLoader(as_dataset(pipe, transform=_record), batch_size=None)
        if state is not None:
            dl.load_state_dict(state)
        out: list[dict[str, Any]] = []
        for _ in range(epochs):
            for item in dl:
                item["rows"] = [tuple(k) for k in item["rows"]]
                out.append(item)
                if len(out) == stop_after:
                    return out, dl.state_dict()
        return out, dl.state_dict()
    finally:
        pipe.close()


def _epoch_rows(run: Run, epoch: int) -> list[tuple[int, ...]]:
    return [key for r in run.records if r["epoch"] == epoch for key in r["rows"]]


# ---------------------------------------------------------------------------------------------
# The stores and the pipelines
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trial") / "era5.zarr"
    make_era5_like(root, n_time=N, n_lat=4, n_lon=8, n_level=3, samples_per_chunk=SPC)
    lsm = zarr.create_array(root / "lsm", shape=(4, 8), chunks=(4, 8), dtype="float32",
                            dimension_names=("lat", "lon"))  # fmt: skip
    lsm[...] = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    return root


def _times(path: Path) -> np.ndarray:
    """The store's time coordinate as numpy datetime64 (hours since 2000-01-01)."""
    hours = np.asarray(zarr.open_array(path / "time", mode="r")[...])
    return np.datetime64("2000-01-01T00", "h") + hours.astype("timedelta64[h]")


def _windows(anchors: Any, offsets: tuple[int, ...] = (0,)) -> set[tuple[int, ...]]:
    return {tuple(int(a) + o for o in offsets) for a in anchors}


def _stack_case(era5: Path, layout: str) -> Case:
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    members = {"t2m": g["t2m"], "z": g["z"].isel(level=[0, 2]), "lsm": g["lsm"]}
    stats = fit_statistics(era5, manifest, members)
    sun = Forcings("x", view=g["t2m"], names=list(FORCINGS))
    x = stack(
        {"t2m": g["t2m"].window([-1, 0]), "z": g["z"].isel(level=[0, 2]).window([-1, 0]),
         "lsm": g["lsm"], "sun": sun},
        normalize=stats, layout=layout,
    )  # fmt: skip
    views = {"x": x, "y": g["t2m"].shift(1)}
    t2m = zarr.open_array(era5 / "t2m", mode="r")

    def build(**kw: Any) -> InSituPipeline:
        return insitu_pipeline(era5, manifest, views, batch_size=4, block_chunks=2, seed=3, **kw)

    def oracle(label: str, key: tuple[int, ...]) -> np.ndarray | None:
        return np.asarray(t2m[key[-1] + 1]) if label == "y" else None

    return Case(build, _windows(range(1, N - 1), (-1, 0)), oracle)


def _labels_case(era5: Path, name: str) -> Case:
    """Static fields, forcings, selections, missing steps and strides as plain labels."""
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    steps = np.arange(N)
    options: dict[str, Any] = {}
    if name == "static_and_forcings":
        views = {"a": g["t2m"], "lsm": g["lsm"], "lsm_rows": g["lsm"].isel(lat=[1, 2])}
        options["batch_transforms"] = [Forcings("a", view=g["t2m"], names=list(FORCINGS))]
        valid = _windows(steps)
    elif name == "isel_sel":
        views = {"a": g["z"].sel(level=500), "b": g["z"].isel(level=[2, 0]).shift(2),
                 "c": g["t2m"].sel(lat=slice(-40, 40), lon=slice(0, 180))}  # fmt: skip
        valid = _windows(steps[: N - 2])
    elif name == "missing_steps":
        views = {"a": g["t2m"], "b": g["t2m"].shift(1)}
        options["missing"] = [5, 17]  # anchors 4, 5, 16 and 17 read one
        valid = _windows(a for a in steps[: N - 1] if not {a, a + 1} & {5, 17})
    else:  # "stride_12h_window": anchors at 00 and 12 UTC, windows of the step before
        views = {"a": g["t2m"].window(["-6h", "0h"]), "b": g["t2m"].shift(1)}
        options["stride"] = "12h"
        hours = _times(era5).astype("datetime64[h]").astype(np.int64)
        anchors = steps[(hours % 12 == 0) & (steps >= 1) & (steps + 1 < N)]
        valid = _windows(anchors, (-1, 0))
    z = zarr.open_array(era5 / "z", mode="r")
    t2m = zarr.open_array(era5 / "t2m", mode="r")
    lsm = np.asarray(zarr.open_array(era5 / "lsm", mode="r")[...])
    lat = np.asarray(zarr.open_array(era5 / "lat", mode="r")[...])
    lon = np.asarray(zarr.open_array(era5 / "lon", mode="r")[...])
    box = np.ix_((lat >= -40) & (lat <= 40), (lon >= 0) & (lon <= 180))
    level = np.asarray(zarr.open_array(era5 / "level", mode="r")[...])

    def oracle(label: str, key: tuple[int, ...]) -> np.ndarray | None:
        t = key[-1]
        if name == "isel_sel":
            return {"a": lambda: z[t, int(np.flatnonzero(level == 500)[0])],
                    "b": lambda: z[t + 2][[2, 0]],
                    "c": lambda: np.asarray(t2m[t])[box]}[label]()  # fmt: skip
        if label in ("lsm", "lsm_rows"):
            return lsm if label == "lsm" else lsm[[1, 2]]
        if label == "b":
            return np.asarray(t2m[t + 1])
        return np.asarray(t2m[list(key)] if len(key) > 1 else t2m[t]) if label == "a" else None

    def build(**kw: Any) -> InSituPipeline:
        return insitu_pipeline(
            era5, manifest, views, batch_size=4, block_chunks=2, seed=3, **options, **kw
        )

    return Case(build, valid, oracle)


def _cf_case(tmp: Path) -> Case:
    """A netCDF-style packed int16 field unpacked to float32, in a stack with a packed static
    field."""
    import xarray as xr

    T, Y, X = 26, 3, 4
    rng = np.random.default_rng(7)
    p = (273 + 3 * rng.standard_normal((T, Y, X))).astype(np.float32)
    p[1, 0, 0] = np.nan
    time = np.datetime64("2000-01-01") + np.arange(T) * np.timedelta64(6, "h")
    ds = xr.Dataset({"p": (("time", "y", "x"), p), "q": (("time", "y", "x"), p + 1),
                     "lsm": (("y", "x"), rng.random((Y, X)).astype(np.float32))},
                    coords={"time": time})  # fmt: skip
    packed = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}
    encoding = {"p": {**packed, "chunks": (3, Y, X)}, "q": {"chunks": (3, Y, X)},
                "lsm": {"dtype": "int16", "scale_factor": 0.001, "add_offset": 0.0,
                        "_FillValue": -1}}  # fmt: skip
    root = tmp / "cf.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=3, encoding=encoding, consolidated=False)
    g = open_geometries(root, cf_dtype="float32")
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))
    x = stack({"p": g["p"].window([-1, 0]), "q": g["q"].window([-1, 0]), "lsm": g["lsm"]})
    views = {"x": x, "y": g["p"].shift(1), "lsm": g["lsm"]}
    stored = np.asarray(zarr.open_array(root / "p", mode="r")[...])
    unpacked = np.where(stored == -32767, np.nan, stored * np.float32(0.01) + np.float32(273))

    def build(**kw: Any) -> InSituPipeline:
        return insitu_pipeline(root, manifest, views, batch_size=4, block_chunks=2, seed=1, **kw)

    def oracle(label: str, key: tuple[int, ...]) -> np.ndarray | None:
        return unpacked[key[-1] + 1].astype(np.float32) if label == "y" else None

    n = int(zarr.open_array(root / "p", mode="r").shape[0])
    return Case(build, _windows(range(1, n - 1), (-1, 0)), oracle)


def _concat_case(tmp: Path) -> Case:
    """Three stores continuing one another, a 12-hour stride, windows across their edges."""

    def period(name: str, start: int, n: int) -> Path:
        group = zarr.open_group(tmp / name, mode="w", zarr_format=3)
        t2m = group.create_array("t2m", shape=(n, 2, 3), chunks=(4, 2, 3), dtype="f4",
                                 dimension_names=("time", "lat", "lon"))  # fmt: skip
        t2m[:] = np.arange(n * 6, dtype="f4").reshape(n, 2, 3) + 1000 * start
        time = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8",
                                  dimension_names=("time",))  # fmt: skip
        time[:] = start + 6 * np.arange(n)
        time.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})
        return tmp / name

    roots = [period("a.zarr", 6, 8), period("b.zarr", 54, 8), period("c.zarr", 102, 7)]
    coll = concat(roots, ["t2m"], dim="time")
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    views = {"a": coll["t2m"].window(["-6h", "0h"]), "b": coll["t2m"].shift(1)}
    hours = np.concatenate([np.asarray(zarr.open_array(r / "time", mode="r")[...]) for r in roots])
    data = np.concatenate([np.asarray(zarr.open_array(r / "t2m", mode="r")[...]) for r in roots])
    steps = np.arange(len(hours))
    anchors = steps[(hours % 12 == 0) & (steps >= 1) & (steps + 1 < len(hours))]
    member = np.concatenate([np.full(8, 0), np.full(8, 1), np.full(7, 2)])
    valid = {(int(member[a - 1]), int(member[a]), int(a - 1), int(a)) for a in anchors}

    def build(**kw: Any) -> InSituPipeline:
        return insitu_pipeline(
            coll, manifest, views, stride="12h", batch_size=3, block_chunks=2, seed=2, **kw
        )

    def oracle(label: str, key: tuple[int, ...]) -> np.ndarray:
        return data[list(key[2:])] if label == "a" else data[key[3] + 1]

    return Case(build, valid, oracle)


def _plate_case(tmp: Path) -> Case:
    pytest.importorskip("ome_zarr")
    from insitubatch_nodes import open_plate, split_by_member
    from insitubatch_nodes.synthetic import make_hcs_plate

    path = tmp / "plate.zarr"
    make_hcs_plate(path, shape=(1, 1, 6, 8, 8), levels=1, labels=(), ngff_version="0.5")
    coll = open_plate(path, sample_axis="z")
    manifest = split_by_member(coll, {"train": 1.0})
    group = zarr.open_group(path, mode="r")
    fields = [np.asarray(group[f"{m}/s0"][...]) for m in coll.members]

    def build(**kw: Any) -> InSituPipeline:
        return insitu_pipeline(
            coll, manifest, {"x": coll["image"]}, batch_size=5, block_chunks=2, **kw
        )

    def oracle(label: str, key: tuple[int, ...]) -> np.ndarray:
        return fields[key[0]][:, :, key[1]]

    valid = {(m, z) for m, f in enumerate(fields) for z in range(f.shape[2])}
    return Case(build, valid, oracle)


def _cache_case(era5: Path, tmp: Path) -> Case:
    """A persistent cache on a budget below the split: chunks evicted and read back from it."""
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"a": g["t2m"], "z": g["z"].shift(1)}

    def build(**kw: Any) -> InSituPipeline:
        folder = tmp / f"cache-{kw.get('rank')}-of-{kw.get('world_size')}"  # one writer each
        return insitu_pipeline(era5, manifest, views, batch_size=4, block_chunks=2, seed=5,
                               cache_dir=folder, persist=True, cache_budget_bytes=48_000,
                               **kw)  # fmt: skip

    t2m = zarr.open_array(era5 / "t2m", mode="r")
    z = zarr.open_array(era5 / "z", mode="r")

    def oracle(label: str, key: tuple[int, ...]) -> np.ndarray:
        return np.asarray(t2m[key[0]] if label == "a" else z[key[0] + 1])

    return Case(build, _windows(range(N - 1)), oracle)


CASES = [
    "stack_channels_first",
    "stack_channels_last",
    "static_and_forcings",
    "isel_sel",
    "missing_steps",
    "stride_12h_window",
    "cf_float32",
    "concat",
    "plate",
    "persistent_cache",
]


@pytest.fixture(scope="module", params=CASES)
def case(
    request: pytest.FixtureRequest, era5: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Case, Run]]:
    """A case and its uninterrupted two-epoch run on one rank, rows checked against zarr."""
    name, tmp = request.param, tmp_path_factory.mktemp(request.param)
    if name.startswith("stack"):
        built = _stack_case(era5, "channels_first" if name.endswith("first") else "channels_last")
    elif name == "cf_float32":
        built = _cf_case(tmp)
    elif name == "concat":
        built = _concat_case(tmp)
    elif name == "plate":
        built = _plate_case(tmp)
    elif name == "persistent_cache":
        built = _cache_case(era5, tmp)
    else:
        built = _labels_case(era5, name)
    yield built, _run(built, epochs=2, check_zarr=True)


# ---------------------------------------------------------------------------------------------
# The claims
# ---------------------------------------------------------------------------------------------


def test_one_rank_delivers_every_valid_sample_once_per_epoch_in_len_batches(
    case: tuple[Case, Run],
) -> None:
    built, ref = case
    for epoch in (0, 1):
        rows = _epoch_rows(ref, epoch)
        assert sorted(rows) == sorted(built.valid), f"epoch {epoch}"
    assert ref.length_at_start == len(ref.records) // 2


@pytest.mark.parametrize("where", ["first", "middle", "last", "next_epoch"])
def test_a_loader_resumed_mid_epoch_continues_bit_exactly(
    case: tuple[Case, Run], where: str
) -> None:
    built, ref = case
    n = len(ref.records) // 2
    k = {"first": 1, "middle": n // 2, "last": n - 1, "next_epoch": n + 1}[where]
    head = _run(built, epochs=2, stop_after=k)
    assert head.records == ref.records[:k]
    rest = _run(built, epochs=2 - k // n, state=head.state)
    assert head.records + rest.records == ref.records


def test_a_stateful_dataloader_resumed_mid_epoch_continues_bit_exactly(
    case: tuple[Case, Run],
) -> None:
    built, ref = case
    k = len(ref.records) // 4 or 1
    head, state = _sdl(built, epochs=2, stop_after=k)
    rest, _ = _sdl(built, epochs=2, state=state)
    assert head + rest == ref.records


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_read_disjoint_samples_in_equal_batch_counts_valued_as_on_one_rank(
    case: tuple[Case, Run], world: int
) -> None:
    built, ref = case
    runs = [_run(built, epochs=2, rank=r, world_size=world) for r in range(world)]
    for epoch in (0, 1):
        counts = [sum(r["epoch"] == epoch for r in run.records) for run in runs]
        assert len(set(counts)) == 1 and counts[0] == runs[0].length_at_start, counts
        rows = [key for run in runs for key in _epoch_rows(run, epoch)]
        assert len(rows) == len(set(rows)), "a sample on two ranks"
        assert set(rows) <= built.valid
        assert len(built.valid - set(rows)) <= world - 1
    for run in runs:
        for key, values in run.values.items():
            assert values == ref.values[key], key


@pytest.mark.parametrize("k", [1, 2])
def test_a_state_saved_on_two_ranks_resumes_on_three_with_every_sample_once(
    case: tuple[Case, Run], k: int
) -> None:
    built, ref = case
    old = [_run(built, stop_after=k, rank=r, world_size=2) for r in range(2)]
    if any(len(run.records) < k for run in old) or old[0].length_at_start <= k:
        pytest.skip(f"two ranks deliver fewer than {k + 1} batches an epoch")
    new = [_run(built, epochs=2, state=old[0].state, rank=r, world_size=3) for r in range(3)]
    counts = [sum(r["epoch"] == 0 for r in run.records) for run in new]
    assert len(set(counts)) == 1 and counts[0] > 0, counts
    assert [run.length_at_start for run in new] == [k + counts[0]] * 3
    assert {r["index"] for run in new for r in run.records[:1]} == {k}
    rows = [key for run in old + new for key in _epoch_rows(run, 0)]
    assert len(rows) == len(set(rows)), "a sample delivered twice in the interrupted epoch"
    assert set(rows) <= built.valid and len(built.valid - set(rows)) <= 2
    for run in new:
        for key, values in run.values.items():
            assert values == ref.values[key], key


@pytest.mark.parametrize(("window", "world"), [([-1, 0], 2), ([-1, 0], 3), ([-2, -1, 0], 3)])
def test_ranks_of_a_windowed_stack_read_a_chunk_twice_only_where_windows_cross_their_cuts(
    tmp_path: Path, window: list[int], world: int
) -> None:
    """One step per stored object: the ranks' GETs of each array, together, exceed one read
    of each object the epoch needs by at most ``(W - 1) x (T - 1)`` per object of a step
    (docs/training.md, DDP)."""
    from helpers import counting_store

    root = tmp_path / "era5.zarr"
    make_era5_like(root, n_time=24, n_lat=2, n_lon=4, n_level=2, samples_per_chunk=1)
    lsm = zarr.create_array(root / "lsm", shape=(2, 4), chunks=(2, 4), dtype="float32",
                            dimension_names=("lat", "lon"))  # fmt: skip
    lsm[...] = 1
    gets: dict[str, int] = {}
    for rank in range(world):
        store = counting_store(root)
        g = open_geometries(store)
        sun = Forcings("x", view=g["t2m"], names=["cos_solar_zenith"])
        x = stack({"t2m": g["t2m"].window(window), "z": g["z"].window(window), "lsm": g["lsm"],
                   "sun": sun})  # fmt: skip
        manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
        with insitu_pipeline(
            store, manifest, {"x": x}, batch_size=4, rank=rank, world_size=world
        ) as pipe:
            store.reset_counts()
            for _ in Loader(pipe):
                pass
            for key, n in store.chunk_counts().items():
                gets[key] = gets.get(key, 0) + n
    for array, per_step in (("t2m", 1), ("z", 2)):  # z: two levels, one object each
        keys = [k for k in gets if k.startswith(f"{array}/")]
        extra = sum(gets[k] for k in keys) - len(keys)
        assert extra <= (world - 1) * (len(window) - 1) * per_step, (array, extra)


# ---------------------------------------------------------------------------------------------
# What the trial found
# ---------------------------------------------------------------------------------------------


def test_len_of_a_loader_resumed_on_three_ranks_is_the_interrupted_epochs_after_iter(
    era5: Path,
) -> None:
    """29 valid anchors, batches of 4: two ranks deliver 4 batches each an epoch. After 3 of
    them (24 samples) 5 are left, one batch on each of three ranks: that epoch has 3 + 1
    batches. ``iter()`` of a ``Loader`` looks one batch ahead when it applies a state; with one
    batch left, that look-ahead ended the epoch for the pipeline and ``len(loader)`` gave the
    next epoch's 3 (a fresh epoch on three ranks: 29 // 3 = 9 samples) instead of 4."""
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"a": g["t2m"], "b": g["t2m"].shift(1)}

    def build(rank: int, world: int) -> InSituPipeline:
        return insitu_pipeline(
            era5, manifest, views, batch_size=4, block_chunks=2, rank=rank, world_size=world
        )

    with build(0, 2) as pipe:
        loader = Loader(pipe)
        assert len(loader) == 4
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
    for rank in range(3):
        with build(rank, 3) as pipe:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            assert len(loader) == 4
            it = iter(loader)
            assert len(loader) == 4  # was 3
            batches = list(it)
            assert [b.index for b in batches] == [3]
            assert len(loader) == 3  # the epoch is over: the next one's, as a fresh run's


def test_a_persistent_cache_refusing_a_partial_selection_names_the_persist_keyword(
    era5: Path, tmp_path: Path
) -> None:
    """The refusal said ``persistent=False``, a keyword ``insitu_pipeline`` does not take; what
    it names now builds."""
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"z": g["z"].isel(level=[1])}  # one of three levels, stored one per object
    with pytest.raises(ValueError, match=r"persist=False") as refused:
        insitu_pipeline(era5, manifest, views, cache_dir=tmp_path / "c", persist=True)
    assert "persistent=" not in str(refused.value)
    z = zarr.open_array(era5 / "z", mode="r")
    with insitu_pipeline(
        era5, manifest, views, batch_size=8, cache_dir=tmp_path / "c", persist=False
    ) as pipe:
        batch = next(iter(Loader(pipe)))
        np.testing.assert_array_equal(batch["z"], z[batch.sample_indices["z"]][:, [1]])


def test_a_state_saved_before_an_absent_object_was_backfilled_is_refused_saying_what_changed(
    tmp_path: Path,
) -> None:
    """With ``missing_objects="drop"`` a chunk absent from the store drops the anchors that
    read it. Written back before the resume, the plan's anchors change: the state is refused.
    The refusal said ``its missing_steps differs (saved '3bcd...', this pipeline '7e03...')``:
    an option the user never passed, and two hashes."""
    root = tmp_path / "era5.zarr"
    make_era5_like(root, n_time=24, n_lat=2, n_lon=4, n_level=1, samples_per_chunk=4,
                   variables=("t2m",))  # fmt: skip
    key = root / "t2m" / "c" / "3" / "0" / "0"
    stored = key.read_bytes()
    key.unlink()
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"a": g["t2m"], "b": g["t2m"].shift(1)}

    def build() -> InSituPipeline:
        return insitu_pipeline(root, manifest, views, batch_size=4, missing_objects="drop")

    with build() as pipe:
        assert pipe.stages.plan.dropped["absent_object"] == 5  # anchors 11 to 15
        loader = Loader(pipe)
        next(iter(loader))
        state = loader.state_dict()
    key.write_bytes(stored)
    with build() as pipe, pytest.raises(ValueError, match="steps dropped as missing") as refused:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        next(iter(loader))
    assert "missing_objects='drop'" in str(refused.value)
    assert "missing_steps" not in str(refused.value)


def test_len_of_a_loader_restoring_a_state_of_the_views_set_views_gave_is_their_epochs(
    era5: Path,
) -> None:
    """A run that changed its views (``set_views``) and saved mid-epoch resumes in a pipeline
    built with the old views and given the new ones by ``set_views`` before the restore
    (docs/concepts.md, "Checkpoints follow the views"). Iterating did; ``len(loader)`` before
    ``iter()`` raised ``ValueError`` "... give the pipeline the state's views (set_views) to
    resume it mid-epoch" — what the user had done."""
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    before = {"x": g["t2m"].window([-1, 0]), "y": g["t2m"].shift(1)}
    after = {"x": stack({"t2m": g["t2m"].window([-2, -1, 0]), "lsm": g["lsm"]}),
             "y": g["t2m"].shift(2)}  # fmt: skip

    def build() -> InSituPipeline:
        return insitu_pipeline(era5, manifest, before, batch_size=4, block_chunks=2, seed=3)

    with build() as pipe:
        loader = Loader(pipe)
        for _ in loader:
            pass
        pipe.set_views(after)
        it = iter(loader)
        n_after = len(loader)
        head = [_record(next(it)) for _ in range(2)]
        state = loader.state_dict()
        rest = [_record(b) for b in it]
    assert n_after == len(head) + len(rest) == 7  # 26 anchors (2 to 27), batches of 4
    with build() as pipe:
        pipe.set_views(after)
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert len(loader) == n_after  # raised ValueError
        assert [_record(b) for b in loader] == rest
