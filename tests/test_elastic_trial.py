"""A user's trial of exact and elastic resume on model-ready samples (docs/training.md).

Two pipelines, each at one and at four samples per stored chunk, shuffled:

* ``single``: one ERA5-like store; ``x`` a stack of a two-level ``isel`` of ``z`` and ``t2m``
  (windows ``[-1, 0]``, random ``patches()`` of the grid), a static land-sea mask and two
  forcings, standardised by fitted statistics (``normalize=``); ``y`` a stack of ``z`` by
  ``sel`` and ``t2m`` two steps ahead (``[1, 2]``), patched alike;
* ``concat``: two stores continuing one another (``concat``), ``x`` a stack of ``z`` by ``sel``
  (levels out of order), ``t2m`` and a forcing, normalised, ``y`` two steps ahead; grid patches.

The claims checked, with zarr (through numpy) as the oracle of every row the uninterrupted
run delivers:

1. a ``Loader`` or ``StatefulDataLoader`` state taken mid-epoch, restored in a fresh pipeline,
   continues with exactly the uninterrupted run's batches (values, indices, coordinates,
   channels, members, patch origins);
2. a state saved on two ranks and restored on one and on three: the new ranks deliver, between
   them, the rest of the epoch — every valid sample not delivered before the cut once, at most
   ``W' - 1`` left out — in equal batch counts, each row valued as the one-rank run values it,
   and the next epoch is a fresh ``W'`` run's;
3. a state restored into a pipeline built otherwise (another level selection, another stack
   order, other patches) is refused, saying what differs.

Ranks are simulated in one process (``insitu_pipeline(..., rank=, world_size=)``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forkserver
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
from insitubatch_nodes.synthetic import make_era5_like

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("elastic_trial")

LENGTHS = (12, 8)  # steps of the two stores (the second continues the first)
CUT = {"lat": 2, "lon": 4}  # windows of the 4 x 8 grid


@dataclass
class Case:
    build: Callable[..., InSituPipeline]  # build(views=None, rank=..., world_size=...)
    views: Callable[..., dict[str, Any]]  # views(levels=..., order=..., cut=...)
    oracle: Callable[[Batch], None]  # asserts a batch's rows against zarr
    remake: list[str]  # what a fresh process builds it from: its kind, then the store paths


def _digest(a: Any) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.kind == "M":
        a = a.astype("datetime64[ns]").view("i8")
    return hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()[:16]


def _keys(batch: Batch) -> list[tuple[int, ...]]:
    """A row's sample: its steps of ``x`` (and their stores), and its window's origin."""
    idx = np.asarray(batch.sample_indices["x"])
    origins = np.asarray(batch.patch_origins["x"])
    members = batch.members.get("x")
    out = []
    for i in range(len(idx)):
        key = tuple(idx[i].tolist()) + tuple(origins[i].tolist())
        if members is not None:
            key += tuple(np.asarray(members)[i].tolist())
        out.append(key)
    return out


def _record(batch: Batch) -> dict[str, Any]:
    """Everything a batch delivers, as plain values (taken while its pipeline is open)."""
    return {
        "epoch": int(batch.epoch),
        "index": int(batch.index),
        "rows": _keys(batch),
        "arrays": {k: _digest(v) for k, v in sorted(batch.arrays.items())},
        "idx": {k: np.asarray(v).tolist() for k, v in sorted(batch.sample_indices.items())},
        "coords": {k: {n: _digest(a) for n, a in c.items()} for k, c in batch.coords.items()},
        "channels": {k: list(v) for k, v in batch.channels.items()},
        "members": {k: np.asarray(v).tolist() for k, v in batch.members.items()},
        "origins": {k: np.asarray(v).tolist() for k, v in batch.patch_origins.items()},
    }


def _row_values(batch: Batch) -> dict[tuple[int, ...], str]:
    return {
        key: "".join(_digest(np.asarray(a)[i]) for _, a in sorted(batch.arrays.items()))
        for i, key in enumerate(_keys(batch))
    }


@dataclass
class Run:
    records: list[dict[str, Any]]
    values: dict[tuple[int, ...], str]
    state: dict[str, Any]
    length: int  # len(loader) right after the first iter()


def _run(
    case: Case,
    *,
    epochs: int = 1,
    stop_after: int | None = None,
    state: dict[str, Any] | None = None,
    oracle: bool = False,
    **ranks: int,
) -> Run:
    with case.build(**ranks) as pipe:
        loader = Loader(pipe)
        if state is not None:
            loader.load_state_dict(state)
        records: list[dict[str, Any]] = []
        values: dict[tuple[int, ...], str] = {}
        length = -1
        for epoch in range(epochs):
            it = iter(loader)
            if epoch == 0:
                length = len(loader)
            for batch in it:
                if oracle:
                    case.oracle(batch)
                records.append(_record(batch))
                values.update(_row_values(batch))
                if len(records) == stop_after:
                    return Run(records, values, loader.state_dict(), length)
        return Run(records, values, loader.state_dict(), length)


def _sdl(
    case: Case, *, stop_after: int | None = None, state: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with case.build() as pipe:
        dl = StatefulDataLoader(as_dataset(pipe, transform=_record), batch_size=None)
        if state is not None:
            dl.load_state_dict(state)
        out: list[dict[str, Any]] = []
        for _ in range(2):
            for item in dl:
                item["rows"] = [tuple(k) for k in item["rows"]]
                out.append(item)
                if len(out) == stop_after:
                    return out, dl.state_dict()
        return out, dl.state_dict()


def _rows(records: list[dict[str, Any]], epoch: int) -> list[tuple[int, ...]]:
    return [key for r in records if r["epoch"] == epoch for key in r["rows"]]


# ---------------------------------------------------------------------------------------------
# The stores and the pipelines
# ---------------------------------------------------------------------------------------------


def _stores(tmp: Path, spc: int) -> list[Path]:
    """Two ERA5-like stores (3 levels, a 4 x 8 grid), the second's times after the first's,
    each with a static ``lsm``."""
    roots, start = [], 0
    for i, n in enumerate(LENGTHS):
        root = tmp / f"part{i}.zarr"
        make_era5_like(root, n_time=n, n_lat=4, n_lon=8, n_level=3, samples_per_chunk=spc, seed=i)
        time = zarr.open_array(root / "time", mode="r+")
        time[:] = np.asarray(time[...]) + 6 * start
        lsm = zarr.create_array(root / "lsm", shape=(4, 8), chunks=(4, 8), dtype="float32",
                                dimension_names=("lat", "lon"))  # fmt: skip
        lsm[...] = np.arange(32, dtype=np.float32).reshape(4, 8) % 3
        roots.append(root)
        start += n
    return roots


def _standardised(values: np.ndarray, stats: Any, name: str, channel: int | None) -> np.ndarray:
    mean, std = np.asarray(stats.mean[name]), np.asarray(stats.std[name])
    if channel is not None:
        mean, std = mean[channel], std[channel]
    return (values - mean) / std


def _single_case(root: Path) -> Case:
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    stats = fit_statistics(
        root, manifest, {"z": g["z"].isel(level=[0, 2]), "t2m": g["t2m"], "lsm": g["lsm"]}
    )

    def views(
        levels: list[int] | None = None, order: bool = False, cut: dict[str, int] | None = None
    ) -> dict[str, Any]:
        levels = [0, 2] if levels is None else levels
        cut = CUT if cut is None else cut
        sun = Forcings("x", view=g["t2m"], names=["cos_solar_zenith", "year_progress_sin"])
        z = g["z"].isel(level=levels).window([-1, 0]).patches(cut, origins="random")
        t2m = g["t2m"].window([-1, 0]).patches(cut, origins="random")
        members = {"t2m": t2m, "z": z} if order else {"z": z, "t2m": t2m}
        x = stack({**members, "lsm": g["lsm"], "sun": sun},
                  normalize=stats if levels == [0, 2] else None)  # fmt: skip
        y = stack({"z": g["z"].sel(level=[1000, 500]).window([1, 2]).patches(cut, origins="random"),
                   "t2m": g["t2m"].window([1, 2]).patches(cut, origins="random")})  # fmt: skip
        return {"x": x, "y": y}

    z = np.asarray(zarr.open_array(root / "z", mode="r")[...])
    t2m = np.asarray(zarr.open_array(root / "t2m", mode="r")[...])
    lsm = np.asarray(zarr.open_array(root / "lsm", mode="r")[...])

    def oracle(batch: Batch) -> None:
        assert batch.channels["x"] == ["z@1000", "z@500", "t2m", "lsm", "cos_solar_zenith",
                                       "year_progress_sin"]  # fmt: skip
        assert batch.channels["y"] == ["z@1000", "z@500", "t2m"]
        for i, ((a, b), (la, lo)) in enumerate(
            zip(batch.sample_indices["x"], batch.patch_origins["x"], strict=True)
        ):
            assert (b, *batch.sample_indices["y"][i]) == (a + 1, a + 2, a + 3)
            box = (slice(la, la + 2), slice(lo, lo + 4))
            want_y = np.concatenate([z[[a + 2, a + 3]][:, [0, 2]], t2m[[a + 2, a + 3], None]], 1)
            np.testing.assert_array_equal(batch.arrays["y"][i], want_y[(..., *box)])
            x = batch.arrays["x"][i]
            for c, level in enumerate((0, 2)):
                want = _standardised(z[[a, b], level], stats, "z", c)[(..., *box)]
                np.testing.assert_allclose(x[:, c], want, rtol=1e-5, atol=1e-5)
            want = _standardised(t2m[[a, b]], stats, "t2m", None)[(..., *box)]
            np.testing.assert_allclose(x[:, 2], want, rtol=1e-5, atol=1e-5)
            want = _standardised(lsm[box], stats, "lsm", None)
            np.testing.assert_allclose(x[:, 3], np.broadcast_to(want, (2, 2, 4)), rtol=1e-5)

    def build(views: dict[str, Any] | None = None, **ranks: int) -> InSituPipeline:
        return insitu_pipeline(root, manifest, views or default, batch_size=4, block_chunks=2,
                               seed=3, **ranks)  # fmt: skip

    default = views()
    return Case(build, views, oracle, ["single", str(root)])


def _concat_case(roots: list[Path]) -> Case:
    coll = concat(roots, ["t2m", "z"], dim="time")
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    stats = fit_statistics(coll, manifest, {"z": coll["z"].sel(level=[500, 1000]),
                                            "t2m": coll["t2m"]})  # fmt: skip

    def views(
        levels: list[int] | None = None, order: bool = False, cut: dict[str, int] | None = None
    ) -> dict[str, Any]:
        levels = [500, 1000] if levels is None else levels
        cut = CUT if cut is None else cut
        sun = Forcings("x", view=coll["t2m"], names=["cos_solar_zenith"])
        z = coll["z"].sel(level=levels).window([-1, 0]).patches(cut)
        t2m = coll["t2m"].window([-1, 0]).patches(cut)
        members = {"t2m": t2m, "z": z} if order else {"z": z, "t2m": t2m}
        x = stack({**members, "sun": sun}, normalize=stats if levels == [500, 1000] else None)
        y = stack({"t2m": coll["t2m"].window([1, 2]).patches(cut),
                   "z": coll["z"].isel(level=[1]).window([1, 2]).patches(cut)})  # fmt: skip
        return {"x": x, "y": y}

    z = np.concatenate([np.asarray(zarr.open_array(r / "z", mode="r")[...]) for r in roots])
    t2m = np.concatenate([np.asarray(zarr.open_array(r / "t2m", mode="r")[...]) for r in roots])
    store = np.repeat(np.arange(len(roots)), LENGTHS)

    def oracle(batch: Batch) -> None:
        assert batch.channels["x"] == ["z@500", "z@1000", "t2m", "cos_solar_zenith"]
        assert batch.channels["y"] == ["t2m", "z@850"]
        for i, ((a, b), (la, lo)) in enumerate(
            zip(batch.sample_indices["x"], batch.patch_origins["x"], strict=True)
        ):
            assert (b, *batch.sample_indices["y"][i]) == (a + 1, a + 2, a + 3)
            assert np.array_equal(batch.members["x"][i], store[[a, b]])
            assert np.array_equal(batch.members["y"][i], store[[a + 2, a + 3]])
            box = (slice(la, la + 2), slice(lo, lo + 4))
            want_y = np.concatenate([t2m[[a + 2, a + 3], None], z[[a + 2, a + 3]][:, [1]]], 1)
            np.testing.assert_array_equal(batch.arrays["y"][i], want_y[(..., *box)])
            x = batch.arrays["x"][i]
            for c, level in enumerate((2, 0)):
                want = _standardised(z[[a, b], level], stats, "z", c)[(..., *box)]
                np.testing.assert_allclose(x[:, c], want, rtol=1e-5, atol=1e-5)
            want = _standardised(t2m[[a, b]], stats, "t2m", None)[(..., *box)]
            np.testing.assert_allclose(x[:, 2], want, rtol=1e-5, atol=1e-5)

    def build(views: dict[str, Any] | None = None, **ranks: int) -> InSituPipeline:
        return insitu_pipeline(coll, manifest, views or default, batch_size=8, block_chunks=2,
                               seed=5, **ranks)  # fmt: skip

    default = views()
    return Case(build, views, oracle, ["concat", *map(str, roots)])


@pytest.fixture(scope="module", params=["single-spc1", "single-spc4", "concat-spc1", "concat-spc4"])
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Case, Run]:
    """A case and its uninterrupted two-epoch run on one rank, every row checked against zarr."""
    name, spc = request.param.split("-spc")
    roots = _stores(tmp_path_factory.mktemp(request.param), int(spc))
    built = _single_case(roots[0]) if name == "single" else _concat_case(roots)
    ref = _run(built, epochs=2, oracle=True)
    assert ref.length == len(ref.records) // 2
    return built, ref


# ---------------------------------------------------------------------------------------------
# The claims
# ---------------------------------------------------------------------------------------------


def test_a_loader_or_stateful_dataloader_resumed_mid_epoch_continues_bit_exactly(
    case: tuple[Case, Run],
) -> None:
    built, ref = case
    n = ref.length
    for k in (n // 2, n + 2):
        head = _run(built, epochs=2, stop_after=k)
        assert head.records == ref.records[:k]
        rest = _run(built, epochs=2 - k // n, state=head.state)
        assert head.records + rest.records == ref.records, f"Loader, cut after {k}"
    head_items, state = _sdl(built, stop_after=n // 2)
    rest_items, _ = _sdl(built, state=state)
    assert head_items + rest_items == ref.records, "StatefulDataLoader"


def test_a_state_saved_on_two_ranks_resumes_on_one_and_on_three_with_every_sample_once(
    case: tuple[Case, Run],
) -> None:
    built, ref = case
    valid = Counter(_rows(ref.records, 0))  # random windows: a row's origin may repeat
    with built.build(rank=0, world_size=2) as pipe:
        k = len(Loader(pipe)) // 2  # mid-epoch, with samples left for three ranks
    old = [_run(built, stop_after=k, rank=r, world_size=2) for r in range(2)]
    before = Counter(key for run in old for key in _rows(run.records, 0))
    assert before <= valid and before.total() == 2 * k * len(ref.records[0]["rows"])
    for new in (1, 3):
        runs = [
            _run(built, epochs=2, state=old[0].state, rank=r, world_size=new) for r in range(new)
        ]
        counts = [sum(r["epoch"] == 0 for r in run.records) for run in runs]
        assert len(set(counts)) == 1 and counts[0] > 0, (new, counts)
        assert [run.length for run in runs] == [k + counts[0]] * new
        after = Counter(key for run in runs for key in _rows(run.records, 0))
        extra = after - (valid - before)
        assert not extra, f"W'={new}: delivered twice, or not in the epoch: {dict(extra)}"
        assert (valid - before - after).total() <= new - 1, f"W'={new}: samples left out"
        for run in runs:
            for key, value in run.values.items():
                if key in valid:
                    assert value == ref.values[key], (new, key)
        for r, run in enumerate(runs):  # the next epoch: a fresh W' run's
            fresh = _run(built, epochs=2, rank=r, world_size=new)
            want = [x for x in fresh.records if x["epoch"] == 1]
            assert [x for x in run.records if x["epoch"] == 1] == want, (new, r)


@pytest.mark.parametrize("case", ["single-spc1", "concat-spc4"], indirect=True)
def test_a_state_restored_with_other_levels_stack_order_or_patches_is_refused_saying_what_differs(
    case: tuple[Case, Run],
) -> None:
    """Mid-epoch, a pipeline built with other inputs refuses the state, naming the change; at
    an epoch's end the state restores and the next epoch runs with the new inputs. Before, a
    level selection or a stack order that differed was taken silently (the rest of the epoch
    came with other channels), and other patches were refused with two identical lists of
    views (the saved run's were shown with this pipeline's patches), advising ``set_views``,
    which refuses other patches; a state taken at the end of an epoch of fewer windows was
    refused as mid-epoch."""
    built, ref = case
    single = built.views()["x"].channels[0] == "z@1000"
    changes = [
        ({"levels": [1] if single else [850]}, r"'x'.*z@850"),
        ({"order": True}, r"'x'.*\['t2m', 'z@"),
        ({"cut": {"lat": 4, "lon": 4}}, r"patche.*extent \(2, 4\) vs \(4, 4\)"),
    ]
    # after 2 batches, and after all but one: more than an epoch of fewer windows holds
    mids = {k: _run(built, stop_after=k).state for k in (2, ref.length - 1)}
    for change, says in changes:
        for k, state in mids.items() if "cut" in change else [(2, mids[2])]:
            ranks = {"rank": 1, "world_size": 3} if "order" in change else {}  # elastic too
            with built.build(built.views(**change), **ranks) as pipe:
                loader = Loader(pipe)
                loader.load_state_dict(state)
                with pytest.raises(ValueError, match=says) as refused:
                    next(iter(loader))
            assert "set_views" not in str(refused.value) or "cut" not in change, (change, k)
    # at an epoch's end (one of fewer windows, too): the next epoch with the pipeline's own
    fewer: dict[str, Any] = {"cut": {"lat": 4, "lon": 4}}
    for saved, restored in ((fewer, {}), ({}, {"order": True})):
        with built.build(built.views(**saved)) as pipe:
            loader = Loader(pipe)
            n = len(list(loader))
            end = loader.state_dict()
        with built.build(built.views(**restored)) as pipe:
            loader = Loader(pipe)
            fresh = [_record(b) for epoch in range(2) for b in loader if epoch == 1]
        with built.build(built.views(**restored)) as pipe:
            loader = Loader(pipe)
            loader.load_state_dict(end)
            got = [_record(b) for b in loader]
        assert n > 0 and got == fresh, (saved, restored)


@pytest.mark.parametrize("case", ["single-spc1"], indirect=True)
def test_a_state_saved_after_set_views_changed_a_stacks_levels_resumes_with_the_new_levels(
    case: tuple[Case, Run],
) -> None:
    """``set_views`` that changes only what the batches hold (a level selection within what
    the pool holds, a stack's member order) reads the same plan. A state saved mid-epoch after
    it, restored into a pipeline built with the old views and given the new ones (as
    docs/concepts.md says), finished the epoch with the old channels: the state could not
    tell them apart."""
    built, _ = case
    new = built.views(levels=[0])
    with built.build() as pipe:
        loader = Loader(pipe)
        for _ in loader:
            pass
        pipe.set_views(new)
        it = iter(loader)
        head = [_record(next(it)) for _ in range(2)]
        state = loader.state_dict()
        rest = [_record(b) for b in it]
    assert head[0]["channels"]["x"][:2] == ["z@1000", "t2m"] and rest
    with built.build() as pipe:
        pipe.set_views(new)
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert [_record(b) for b in loader] == rest


@pytest.mark.parametrize("case", ["single-spc1"], indirect=True)
def test_set_views_refusing_a_stack_whose_forcings_lack_times_says_which_arrays_carry_them(
    case: tuple[Case, Run],
) -> None:
    """Reordering a stack with forcings so that another array comes first is refused: the
    batches carry the times of the arrays the pipeline was built with (here ``z``, the
    stack's first member). The message advised ``coords=None`` — what the pipeline was
    built with; it now names the arrays that carry times."""
    built, _ = case
    pattern = r"put first a member of \['z'\]"
    with built.build() as pipe, pytest.raises(ValueError, match=pattern) as refused:
        pipe.set_views(built.views(order=True))
    assert "coords=None" not in str(refused.value)


@pytest.mark.parametrize("case", ["concat-spc4"], indirect=True)
def test_a_state_restored_in_a_fresh_process_continues_bit_exactly(
    case: tuple[Case, Run], tmp_path: Path
) -> None:
    """The states are plain JSON, and a new process (forked from the tests' fork server: a
    hash seed of its own, nothing of this one's state) rebuilds the pipeline and continues
    as the uninterrupted run: ``Loader`` and ``StatefulDataLoader`` alike."""
    built, ref = case
    k = ref.length // 2
    head = _run(built, epochs=2, stop_after=k)
    _, sdl_state = _sdl(built, stop_after=k)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"remake": built.remake, "loader": head.state,
                                   "sdl": sdl_state}))  # fmt: skip
    proc = forkserver.run([sys.executable, __file__, str(request)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "response.json").read_text())
    want = json.loads(json.dumps(ref.records[k:]))  # (tuples as lists, as the response's)
    assert got["loader"] == want and got["sdl"] == want


def _fresh_process(request: Path) -> None:
    """What the fresh process runs: rebuild the case, resume both states, write the batches."""
    req = json.loads(request.read_text())
    kind, *paths = req["remake"]
    roots = [Path(p) for p in paths]
    built = _single_case(roots[0]) if kind == "single" else _concat_case(roots)
    loader = _run(built, epochs=2, state=req["loader"]).records
    sdl, _ = _sdl(built, state=req["sdl"])
    out = {"loader": loader, "sdl": sdl}
    (request.parent / "response.json").write_text(json.dumps(out))


if __name__ == "__main__":
    _fresh_process(Path(sys.argv[1]))
