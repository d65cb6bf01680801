"""Trial (twice): one copy from the pool slot into the batch, on combinations not yet covered.

Each case runs a pipeline over a small store and checks every batch of an epoch against numpy's
slicing of zarr's read of the store (the oracle: ``np.concatenate`` of the members' windows,
standardised, moved to channels last where asked), then replays the gather of one batch, part
by part, under ``tracemalloc`` against copies of its slots: a copy made through a temporary
shows as traced memory the size of the rows it moved, a straight copy as next to none (numpy
traces its arrays' memory).

Found (fixed):

* The lead, measured: a patched stack member with levels selected went through more than one
  copy, and not only when selected. A group of rows read alike (``_windows._gather_alike``) is
  one index of the slot's sliding windows — a temporary — then an assignment into the batch:
  two copies for every patched member. With a list of levels it was three, and the first of
  every level the slot holds (the union of the array's views), not only the selected ones:
  an index of all held levels, ``np.take`` of the selected, the assignment. Measured (4, 8)
  windows, batches of 256, y reading all 13 levels: the group's temporaries were 7.1x and 5.1x
  the bytes a 2- and 3-level member delivers; (32, 64) windows each a tile, batches of 64:
  2,264,445 traced bytes for 2,097,152 written (4 levels), 3,442,177 for 6,815,744 (13).
  Now a list evenly spaced in the slot is a slice (a view), an uneven one is indexed together
  with the rows (the temporary holds only what the batch does: 0.7x and 1.1x), a group goes
  at most 1 MiB at a time, and a window's part in a tile of 32 KiB or more is not grouped:
  each is one slice assignment straight from the slot (an uneven list one per evenly spaced
  run of it): 48,688 and 46,716 traced bytes, one copy. Per row of 55 KiB that is faster too
  (64 / 256 rows: 1,260 / 6,718 us before, 705 / 3,326 now; 106 KiB unselected, 64 rows:
  2,219 -> 935 us). Under 32 KiB a group still takes two copies (numpy has no gather of many
  windows into a strided destination in one call; one call per row is slower there).
* An unpatched stack member (or a window's step) selecting levels unevenly spaced in its
  slots (y selects other levels of the array, so the slots hold the union) was copied by
  ``np.take(..., out=)`` into its strided channel slice: numpy takes into a strided ``out``
  through a temporary as large as the rows, copied in and back (``_select``): 393,728 traced
  bytes for 393,216 written; now one slice assignment per evenly spaced run of the list
  (levels at places 0 2 3: two), straight into the slice: 6,464.

Tried and found right: every batch equal to the oracle, bit for bit, for patched views of
levels selected evenly, unevenly, by value, by one index, out of order, two lists of one
array, a list beside a whole axis and a list across objects of two levels (an open mesh),
copied a group at a time (eight rows per index), pair by pair, and as built, on grid and
random origins; for stacks of two-step windows, shifted stacks, ``normalize=stats``,
``channels_last``, a member whose sample axis is its second, whole and patched. Whole rows
of 8 KiB or more go straight into the batch in every combination (a few KiB traced, the same
at 16 rows and at 64); standardising in place adds numpy's ufunc buffers, fixed (66,896 to
99,864 bytes at 16 rows as at 64), not a copy of the rows.
"""

from __future__ import annotations

import functools
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import put_array
from torchdata.nodes import Loader

from insitubatch_nodes import (
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.stages import _windows

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("twice_trial")]

N, SPC, LAT, LON, TILE = 64, 16, 32, 64, (16, 32)
LEVELS = [1000, 925, 850, 700, 600, 500, 400, 300, 250, 200, 150, 100, 50]


def _write(root: Path) -> Path:
    """Hourly, 16 steps per chunk, a (32, 64) grid in (16, 32) tiles: ``t2m`` (time, lat,
    lon); ``z`` (time, 13 levels, lat, lon), levels whole in each object; ``z2``, the same in
    objects of two levels; ``e`` (time, 4 members, 5 levels, lat, lon); ``zt`` (3 levels,
    time, lat, lon), untiled: its sample axis is not the first."""
    rng = np.random.default_rng(0)
    group = zarr.open_group(root, mode="w")
    array = functools.partial(put_array, group)
    t = array("time", np.arange(N, dtype=np.int64), ("time",))
    t.attrs.update(units="hours since 2000-01-01", calendar="standard")
    array("lat", np.linspace(-80.0, 80.0, LAT), ("lat",))
    array("lon", np.arange(LON) * 360.0 / LON, ("lon",))
    array("level", np.array(LEVELS), ("level",))
    grid = ("lat", "lon")
    for name, lead, dims, chunks in [
        ("t2m", (), ("time", *grid), (SPC, *TILE)),
        ("z", (13,), ("time", "level", *grid), (SPC, 13, *TILE)),
        ("z2", (13,), ("time", "level", *grid), (SPC, 2, *TILE)),
        ("e", (4, 5), ("time", "member", "level", *grid), (SPC, 4, 5, *TILE)),
    ]:
        array(name, rng.standard_normal((N, *lead, LAT, LON), np.float32), dims, chunks)
    zt = rng.standard_normal((3, N, LAT, LON), np.float32)
    array("zt", zt, ("level", "time", *grid), (3, SPC, LAT, LON))
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("twice") / "s.zarr")


@pytest.fixture(scope="module")
def data(root: Path) -> dict[str, np.ndarray]:
    """The oracle's arrays: zarr's read of the store, sample axis first."""
    group = zarr.open_group(root, mode="r")
    out = {name: group[name][...] for name in ("t2m", "z", "z2", "e")}
    out["zt"] = np.moveaxis(group["zt"][...], 1, 0)
    return out


def _epoch_and_replay(
    root: Path, views: dict[str, Any], batch_size: int, manifest: Any = None, **kw: Any
) -> tuple[list[Any], dict[str, tuple[int, int]]]:
    """Every batch of one epoch, and the gather of its first batch replayed part by part (a
    stack member's step) against copies of its slots after the pipeline closed: per part, the
    traced memory the copy took at its peak and the bytes it wrote."""
    if manifest is None:
        manifest = split_by_chunk(open_geometries(root)["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(root, manifest, views, batch_size=batch_size, block_chunks=2, **kw)
    node = pipe.stages.gather
    gather = node._gather_rows
    first: list[Any] = []

    def spy(dest: Any, resident: Any, labels: Any, lo: int, hi: int) -> dict[str, int]:
        if not first:
            slots = {k: v.copy(order="K") for k, v in resident.slots.items()}
            kept = SimpleNamespace(plan=resident.plan, slots=slots, direct=resident.direct,
                                   arrays=resident.arrays)  # fmt: skip
            first.append((dest, kept, list(labels), lo, hi))
        return gather(dest, resident, labels, lo, hi)

    node._gather_rows = spy
    with pipe:
        batches = list(Loader(pipe))
    dest, resident, labels, lo, hi = first[0]
    assert not any(resident.direct.values()), "rows decoded in place: nothing to replay"
    out = {}
    for label in labels:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            gather(dest, resident, [label], lo, hi)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        out[label] = (peak, dest[label].nbytes)
    return batches, out


def _cut(a: np.ndarray, origins: np.ndarray, extent: tuple[int, int]) -> np.ndarray:
    """Each row's window at its origin (lat, lon) of the last two axes."""
    return np.stack([r[..., o0 : o0 + extent[0], o1 : o1 + extent[1]]
                     for r, (o0, o1) in zip(a, origins.tolist(), strict=True)])  # fmt: skip


def _rows_cut(
    a: np.ndarray, samples: np.ndarray, origins: np.ndarray, extent: tuple[int, int]
) -> np.ndarray:
    """``_cut(a[samples], origins, extent)``, each row's window sliced from its sample in place:
    without first copying every row's whole field (13 levels of a (32, 64) grid a row: the
    copies were most of the oracle's time)."""
    rows = zip(samples.tolist(), origins.tolist(), strict=True)
    return np.stack([a[i, ..., o0 : o0 + extent[0], o1 : o1 + extent[1]] for i, (o0, o1) in rows])


def _pick(a: np.ndarray, *keys: Any) -> np.ndarray:
    """``a`` (rows, [T,] *lead, lat, lon) with ``keys`` taken along the lead axes in turn
    (``None``: all; a list: those, in order; an int: that one, the axis dropped), and a
    channel axis added where none is left."""
    lead = a.ndim - 2 - len(keys)
    for k, key in enumerate(keys):
        if key is not None:
            a = np.take(a, key, axis=lead + k - (sum(isinstance(x, int) for x in keys[:k])))
    return a if a.ndim > lead + 2 else np.expand_dims(a, lead)


def _selected(g: dict[str, Any]) -> dict[str, tuple[Any, str, tuple[Any, ...]]]:
    """Views selecting levels every way, beside y's ``z`` levels 1 and 12 (so ``z``'s slots
    hold levels 0 1 2 4 5 8 11 12): evenly spaced in the slot (8 11 12: its places 5 6 7),
    unevenly (0 5 12: 0 4 7), by value, one index (the axis dropped), out of order; two
    uneven lists of one array, and one beside a whole axis; a list across ``z2``'s objects
    of two levels, out of order (an open mesh in the window, levels 1 and 0 of one object
    taken out of order). Per view: the array and the keys the oracle takes."""
    z, e = g["z"], g["e"]
    return {
        "ze": (z.isel(level=[8, 11, 12]), "z", ([8, 11, 12],)),
        "zi": (z.isel(level=[0, 5, 12]), "z", ([0, 5, 12],)),
        "zs": (z.sel(level=[850, 500, 250, 100]), "z", ([2, 5, 8, 11],)),
        "z4": (z.isel(level=4), "z", (4,)),
        "zu": (z.isel(level=[5, 0]), "z", ([5, 0],)),
        "e": (e.isel(member=[3, 1], level=[0, 3, 4]), "e", ([3, 1], [0, 3, 4])),
        "e2": (e.isel(member=[0, 1, 2], level=2), "e", ([0, 1, 2], 2)),
        "e3": (e.isel(member=[2, 0]), "e", ([2, 0], None)),
        "m": (g["z2"].isel(level=[1, 12, 0, 3]), "z2", ([1, 12, 0, 3],)),
    }


PATHS = {
    "as built": {},
    # every group indexed (a window of any size), eight rows at a time
    "groups": {"WINDOW_ROW_BYTES": 2**62, "WINDOW_SCRATCH_BYTES": 1},
    "pairs": {"ALIKE_ROWS": 2**62},  # every (row, tile) pair copied on its own
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("extent", "origins"), [((4, 8), "grid"), ((24, 48), "random")])
def test_patched_views_selecting_levels_every_way_equal_numpys_windows_of_the_store(
    root: Path, data: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch, path: str,
    extent: tuple[int, int], origins: str,
) -> None:  # fmt: skip
    """A patched stack of a surface field and ``z``'s levels selected five ways, patched
    views of two uneven lists and of a list across objects, and y (levels 1 and 12 of ``z``,
    a step later), copied by either way of the patch gather (a group at a time, pair by pair)
    and as built: every batch equals numpy's cut of the store's windows, concatenated."""
    for name, value in PATHS[path].items():
        monkeypatch.setattr(_windows, name, value, raising=False)
    g = open_geometries(root)
    ext = {"lat": extent[0], "lon": extent[1]}
    kw = {} if origins == "grid" else {"origins": "random", "per_tile": 2}
    sel = _selected(g)
    members = {"t2m": g["t2m"].patches(ext, **kw)}
    members.update({k: sel[k][0].patches(ext, **kw) for k in ("ze", "zi", "zs", "z4", "zu")})
    views = {"x": stack(members), "y": g["z"].isel(level=[1, 12]).shift(1).patches(ext, **kw)}
    views.update({k: sel[k][0].patches(ext, **kw) for k in ("e", "e2", "e3", "m")})
    batches, _ = _epoch_and_replay(root, views, batch_size=128)
    rows = 0
    for batch in batches:
        s, o = batch.sample_indices["x"], batch.patch_origins["x"]
        # each array's windows of the batch's rows, every level (the cut and the picks of
        # levels commute: one acts on the grid axes, the other on the axes before them)
        cut = {name: _rows_cut(data[name], s, o, extent) for name in ("t2m", "z", "z2", "e")}
        parts = [_pick(cut["t2m"])]
        parts += [_pick(cut[sel[k][1]], *sel[k][2]) for k in ("ze", "zi", "zs", "z4", "zu")]
        np.testing.assert_array_equal(batch.arrays["x"], np.concatenate(parts, 1))
        for k in ("e", "e2", "e3", "m"):
            want = _pick(cut[sel[k][1]], *sel[k][2])
            np.testing.assert_array_equal(batch.arrays[k], want)
        y = _rows_cut(data["z"], batch.sample_indices["y"], o, extent)[:, [1, 12]]
        np.testing.assert_array_equal(batch.arrays["y"], y)
        rows += len(s)
    assert rows == sum(len(b.sample_indices["y"]) for b in batches) > 0


def _x_and_y(g: dict[str, Any], zt: Any, stats: Any, layout: str, patched: bool) -> dict[str, Any]:
    """x: a stack of two-step windows (``t2m``, three levels of ``z`` uneven in its slots,
    two evenly spaced, ``zt``'s levels) in ``layout``, ``normalize=stats``; y: ``t2m`` and
    two levels of ``z`` two steps later. ``patched``: every view in (16, 32) windows."""

    def p(v: Any) -> Any:
        return v.patches({"lat": 16, "lon": 32}) if patched else v

    members = _members(g, zt)
    x = stack({k: p(v.window([-1, 0])) for k, v in members.items()}, layout=layout,
              normalize=stats)  # fmt: skip
    y = stack({"t2m": p(g["t2m"].shift(2)), "z": p(g["z"].isel(level=[1, 12]).shift(2))})
    return {"x": x, "y": y}


def _members(g: dict[str, Any], zt: Any) -> dict[str, Any]:
    z = g["z"]
    return {
        "t2m": g["t2m"],
        "zi": z.isel(level=[0, 5, 12]),
        "zs": z.sel(level=[850, 500]),
        "zt": zt,
    }


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_patched_windows_of_32_kib_or_more_are_copied_straight_from_their_tiles(
    tmp_path: Path, layout: str
) -> None:
    """Windows that are each a (32, 64) tile, of 4 levels (32 KiB,
    :data:`~insitubatch_nodes.stages._windows.WINDOW_ROW_BYTES`) selected evenly and unevenly
    in the slots and of all 13 levels, as a stack's members: each window is copied once,
    straight from its slot into its channel slice (the replayed gather traces under a tenth
    of the bytes it writes: per-row lists and indices, no rows). Before, each group of rows
    read alike went through an index of the sliding windows of every held level, a take of
    the selected ones, then the assignment: 2,264,445 bytes traced for 2,097,152 written (4
    levels), 3,442,177 for 6,815,744 (13); now 48,688 and 46,716."""
    assert getattr(_windows, "WINDOW_ROW_BYTES", 0) <= 32 * 2**10  # (main: none)
    root = tmp_path / "big.zarr"
    group = zarr.open_group(root, mode="w")
    t = put_array(group, "time", np.arange(32, dtype=np.int64), ("time",))
    t.attrs.update(units="hours since 2000-01-01", calendar="standard")
    z = np.random.default_rng(1).standard_normal((32, 13, 64, 128), np.float32)
    put_array(group, "z", z, ("time", "level", "lat", "lon"), (SPC, 13, 32, 64))
    g = open_geometries(root)
    members = {
        "z4": (g["z"].isel(level=[0, 1, 2, 3]), [0, 1, 2, 3]),
        "zu": (g["z"].isel(level=[0, 2, 3, 9]), [0, 2, 3, 9]),  # places 0 2 3 9 of 13
        "z13": (g["z"], None),
    }
    ext = {"lat": 32, "lon": 64}
    x = stack({k: v.patches(ext) for k, (v, _) in members.items()}, layout=layout)
    manifest = split_by_chunk(g["z"], (1.0, 0.0, 0.0))
    batches, parts = _epoch_and_replay(root, {"x": x}, 64, manifest=manifest)
    assert all(peak <= 0.1 * nbytes for peak, nbytes in parts.values()), parts
    rows = 0
    for batch in batches:
        s, o = batch.sample_indices["x"], batch.patch_origins["x"]
        cut = _rows_cut(z, s, o, (32, 64))  # (then the levels: the two commute)
        want = np.concatenate([_pick(cut, lv) for _, lv in members.values()], 1)
        if layout == "channels_last":
            want = np.moveaxis(want, 1, -1)
        np.testing.assert_array_equal(batch.arrays["x"], want)
        rows += len(s)
    assert rows == 32 * 4


def test_a_group_of_patched_rows_takes_only_the_selected_levels_into_its_temporary(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(4, 8) windows, batches of 256, y reading every level of ``z`` (its slots hold all 13):
    a stack member of two levels, and one of three out of order, gathered a group of alike
    rows at a time, take a temporary of at most what they deliver (the traced peak above the
    same gather done pair by pair, no group). Before, the group's index copied every held
    level, then a take copied the selected ones: 7.1x and 5.1x the bytes delivered; now 0.7x
    and 1.1x (one index of just the selected levels, then the assignment)."""
    g = open_geometries(root)
    ext = {"lat": 4, "lon": 8}
    z = g["z"]
    members = {"z2": z.isel(level=[0, 5]), "zu": z.isel(level=[7, 3, 4])}
    x = stack({"t2m": g["t2m"].patches(ext), **{k: v.patches(ext) for k, v in members.items()}})
    views = {"x": x, "y": z.shift(1).patches(ext)}
    _, grouped = _epoch_and_replay(root, views, batch_size=256)
    monkeypatch.setattr(_windows, "ALIKE_ROWS", 2**62)
    _, paired = _epoch_and_replay(root, views, batch_size=256)
    for part in ("x[z2]", "x[zu]"):
        (peak, nbytes), (alone, _) = grouped[part], paired[part]
        assert peak - alone <= 1.25 * nbytes, (part, peak, alone, nbytes)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_a_stacked_window_of_levels_uneven_in_the_slot_is_copied_once(
    root: Path, data: dict[str, np.ndarray], layout: str
) -> None:
    """A stack's member selecting levels 0 5 12 of ``z`` while y selects 1 and 12 (the slots
    hold 0 1 5 12: the member's places 0 2 3, uneven), in two-step windows: its destination,
    a channel slice of a window's step, is strided, where ``np.take(..., out=)`` copies
    through a temporary as large as the rows (393,728 traced bytes for 393,216 written, each
    step); now the list's evenly spaced runs are one slice assignment each: 6,464 bytes."""
    g = open_geometries(root)
    steps = [-1, 0]
    x = stack({"t2m": g["t2m"].window(steps), "zi": g["z"].isel(level=[0, 5, 12]).window(steps)},
              layout=layout)  # fmt: skip
    views = {"x": x, "y": g["z"].isel(level=[1, 12]).shift(2)}
    batches, parts = _epoch_and_replay(root, views, batch_size=16)
    assert all(peak <= 0.1 * nbytes for peak, nbytes in parts.values()), parts
    for batch in batches:
        s = batch.sample_indices["x"]
        want = np.concatenate([_pick(data["t2m"][s]), _pick(data["z"][s], [0, 5, 12])], 2)
        if layout == "channels_last":
            want = np.moveaxis(want, 2, -1)
        np.testing.assert_array_equal(batch.arrays["x"], want)
        np.testing.assert_array_equal(batch.arrays["y"], data["z"][s[:, 1] + 2][:, [1, 12]])


def _members(g: dict[str, Any], zt: Any) -> dict[str, Any]:
    """``t2m``, levels 0 5 12 of ``z`` (uneven in its slots beside y's), 850 and 500 hPa
    (evenly spaced there), and ``zt``'s three levels (its sample axis second)."""
    z = g["z"]
    return {"t2m": g["t2m"], "zi": z.isel(level=[0, 5, 12]), "zs": z.sel(level=[850, 500]),
            "zt": zt}  # fmt: skip


@pytest.mark.parametrize("patched", [False, True], ids=["whole", "patched"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_windows_shifts_statistics_layouts_and_a_later_sample_axis_equal_the_members_concatenated(
    root: Path, data: dict[str, np.ndarray], patched: bool, normalize: bool, layout: str
) -> None:
    """x: a stack of two-step windows (``t2m``, levels of ``z`` uneven and even in its slots,
    ``zt`` sampled along its second axis), channels first or last, raw or
    ``normalize=stats``; y: ``t2m`` and two levels of ``z`` two steps later; whole fields or
    (16, 32) windows. Every batch equals numpy's concatenation of the members read by zarr
    (cut, standardised with the fitted statistics, moved to channels last), and the copies:
    whole rows (8 KiB or more) go straight from their slots into the batch (the replay traces
    under a tenth of the bytes written, and standardising in place adds numpy's bounded
    buffers: 66,896-99,864 bytes at 16 rows as at 64); patched windows under 32 KiB go a
    group at a time through a temporary of at most what they deliver."""
    g = open_geometries(root)
    zt = open_geometries(root, ["zt"], sample_axis="time")["zt"]
    members = _members(g, zt)
    stats = None
    if normalize:
        manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
        stats = fit_statistics(root, manifest, members, batch_size=16)

    def cut(v: Any) -> Any:
        return v.patches({"lat": 16, "lon": 32}) if patched else v

    x = stack({k: cut(v.window([-1, 0])) for k, v in members.items()}, layout=layout,
              normalize=stats)  # fmt: skip
    y = stack({"t2m": cut(g["t2m"].shift(2)), "z": cut(g["z"].isel(level=[1, 12]).shift(2))})
    batches, parts = _epoch_and_replay(root, {"x": x, "y": y}, batch_size=64)
    keys = {"t2m": ("t2m", ()), "zi": ("z", ([0, 5, 12],)), "zs": ("z", ([2, 5],)),
            "zt": ("zt", (None,))}  # fmt: skip
    rows = 0
    for batch in batches:
        s = batch.sample_indices["x"]
        want = []
        for name, (array, key) in keys.items():
            a = _pick(data[array][s], *key)
            if stats is not None:
                mean = np.asarray(stats.mean[name], np.float32).reshape(-1, 1, 1)
                std = np.asarray(stats.std[name], np.float32).reshape(-1, 1, 1)
                a = (a - mean) / std
            want.append(a)
        wx = np.concatenate(want, 2)
        wy = np.concatenate([_pick(data["t2m"][s[:, 1] + 2]),
                             _pick(data["z"][s[:, 1] + 2], [1, 12])], 1)  # fmt: skip
        if patched:
            o = batch.patch_origins["x"]
            wx, wy = _cut(wx, o, (16, 32)), _cut(wy, o, (16, 32))
        if layout == "channels_last":
            wx = np.moveaxis(wx, 2, -1)
        np.testing.assert_array_equal(batch.arrays["x"], wx)
        np.testing.assert_array_equal(batch.arrays["y"], wy)
        rows += len(s)
    assert rows == (N - 3) * (4 if patched else 1)  # anchors 1 .. N - 3, four windows each
    for part, (peak, nbytes) in parts.items():
        if patched:
            assert peak <= 1.1 * nbytes + 64 * 2**10, (part, peak, nbytes)
        else:
            norm = 2**17 if normalize and part.startswith("x") else 0
            assert peak <= 0.1 * nbytes + norm, (part, peak, nbytes)
