"""Evaluation and inference over an archive, as a forecaster or a microscopist runs them after
training (the inference trial of 2026-12-07): validation/test splits and whole-archive
prediction passes in store order, on one rank and on several (in one process, and as real gloo
ranks), predictions written back into a new zarr array by ``batch.coords`` /
``batch.patch_origins`` and checked with xarray, windows at inference, Lightning's
validate/test/predict, and a prediction pass interrupted and resumed. Oracles: zarr, xarray and
numpy reading the same store.

Found (wrong answers, fixed):

1. An unshuffled plan of views at several offsets (``{"x": g, "y": g.shift(1)}``, a window),
   dealt between ranks in runs, did not go through a rank's run in store order: the piece of
   the chunk its run began in came last (rank 1 of 2 evaluated samples 12 … 21, then 11; of 3
   ranks, rank 2 went 16 … 20, 15, 21; 1123 of 8190 rank plans tried out of order).
   concepts.md says each rank visits its chunks in the epoch's order, which unshuffled is store
   order; a writer streaming a rank's outputs in time order saw time go backwards.
   ``deal_runs`` now keeps an unshuffled run in axis order (the schedule floors still bound
   every such plan: checked on 2–8 ranks, every remainder).
2. ``InSituDataModule``'s validation of random patches (``origins="random"``) evaluated other
   windows every validation run (the validation pipeline's epoch moved on with each run, and
   random origins are a function of the epoch), so the epochs' validation losses did not
   compare. Evaluation pipelines now draw epoch 0 every run.
3. ``pipe.stages.plan.resumed_epoch(loader.state_dict())`` — how a one-pass job reads whether
   its saved pass is over — raised ``ValueError: not a read-plan state``: it took only the read
   plan's own state. It (and ``resumed_len``) takes a ``Loader``'s too.

Documented (training.md, *Evaluation and prediction over an archive*): the whole archive as the
test split on any ranks; ranks writing rows of one zarr chunk at once lose rows (measured with
two processes, 84 of 400 rows lost in 100 tries: zarr writes a chunk as one object; the ranks'
shares meet inside a chunk); a prediction pass has no lockstep, so each rank resumes from its
own state; a state taken after the pass's last batch resumes into a second pass; Lightning's
prediction writer gets no ``batch_indices`` from an iterable dataset (use ``to_item``).

Tried and found right (claims below where cheap): every valid sample of a test split and of a
whole archive (``split_by_chunk(g, (0, 0, 1))``, ``split="test"``, ``remainder="uneven"``)
exactly once over 1, 2 and 3 ranks, the last partial batch kept; predictions written back by
``batch.coords["x"]["time"]`` land at their input's time (xarray ``sel``), and the anchors a
shift or window cannot serve at the array's ends are the ones left unwritten; a slide's grid
windows stitched back by ``patch_origins`` cover every pixel once on 1 and 3 ranks; an ensemble
on product axes ``(member, time)`` written back by ``geom.sample_coords``, and ``stride=`` /
``missing=`` at inference, each sample once on 1–3 ranks in store order (no claim kept);
Lightning's validate/test/predict through the data module on 1 rank and on 3 gloo ranks
(``strategy="ddp"``), each split once, rank 0 first; a collection's members written back by
``batch.members`` on 1–3 ranks (no claim kept).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

from insitubatch_nodes import Loader, PlanConfig, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.pipeline import InSituPipeline
from insitubatch_nodes.plan import plan_epoch
from insitubatch_nodes.plan.parts import expand_views
from insitubatch_nodes.plan.schedule import schedule_floors, working_set_bytes

pytestmark = pytest.mark.timeout(120)

T = 23  # 6-hourly steps, chunks of 4: the last chunk holds 3


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t2m (time 23, lat 3, lon 4)`` written by xarray, in chunks of 4 steps, with its time
    coordinate: the archive a forecaster predicts over."""
    root = tmp_path_factory.mktemp("inference") / "era5.zarr"
    times = pd.date_range("2000-01-01", periods=T, freq="6h")
    data = np.random.default_rng(0).random((T, 3, 4)).astype("f4")
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), data)},
        coords={"time": times, "lat": [10.0, 20.0, 30.0], "lon": [0.0, 1.0, 2.0, 3.0]},
    )
    ds.to_zarr(root, mode="w", encoding={"t2m": {"chunks": (4, 3, 4)}}, consolidated=False)
    return root


def _rows(root: Path, views_of: object, world: int, rank: int, **kw: object) -> list[list[int]]:
    g = open_geometries(root, ["t2m"])["t2m"]
    views = views_of(g)  # type: ignore[operator]
    pipe = insitu_pipeline(
        root, split_by_chunk(g, (0.0, 0.0, 1.0)), views, split="test", shuffle=False,
        remainder="uneven", batch_size=5, rank=rank, world_size=world, **kw,
    )  # fmt: skip
    try:
        return [b.sample_indices["x"].tolist() for b in Loader(pipe)]
    finally:
        pipe.close()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["shift", "window"])
def test_an_unshuffled_evaluation_on_several_ranks_goes_through_each_ranks_share_in_store_order(
    archive: Path, world: int, kind: str
) -> None:
    def views_of(g: ArrayGeometry) -> dict[str, ArrayGeometry]:
        if kind == "shift":
            return {"x": g, "y": g.shift(1)}
        return {"x": g, "y": g.window([1, 2])}

    valid = T - (1 if kind == "shift" else 2)
    shares = []
    for rank in range(world):
        rows = _rows(archive, views_of, world, rank)
        flat = [i for b in rows for i in b]
        assert flat == sorted(flat), f"rank {rank} of {world} went back in time: {flat}"
        assert [len(b) for b in rows[:-1]] == [5] * (len(rows) - 1)  # only the last is short
        shares.append(flat)
    # the ranks' shares, one after the other, are the whole split in store order, each once
    assert [i for s in shares for i in s] == list(range(valid))


def test_the_schedule_floors_bound_unshuffled_runs_on_two_to_eight_ranks() -> None:
    """The residency bounds were proved for runs whose partial pieces come last; unshuffled
    runs now begin with one. Every rank's plan stays within the floors the pipeline sizes its
    pool by, and sweeps its share in order (metadata only: no store)."""
    g = ArrayGeometry("t", (203, 3), (8, 3), np.dtype("f4"), 0.0)
    for fractions, split in (((1.0, 0.0, 0.0), "train"), ((0.5, 0.25, 0.25), "val")):
        manifest = split_by_chunk(g, fractions)
        for given in ({"x": g, "y": g.shift(2)}, {"x": g.window([-3, -1, 0]), "y": g.shift(1)}):
            views = expand_views(given)[0]
            arrays = {v.path: v.base for v in views.values()}
            for remainder in ("drop", "pad", "uneven"):
                if remainder == "uneven" and split == "train":
                    continue
                for world in range(2, 9):
                    config = PlanConfig(split=split, batch_size=3, block_chunks=2,
                                        remainder=remainder, world_size=world)  # fmt: skip
                    floors = schedule_floors(manifest, views, config)
                    for rank in range(world):
                        cfg = config.replace(rank=rank, shuffle=False)
                        once = plan_epoch(manifest, views, cfg)
                        assert working_set_bytes(once, arrays)[0] <= floors.read_once
                        bounded = plan_epoch(manifest, views, cfg, pin_gap=floors.pin_gap)
                        assert working_set_bytes(bounded, arrays)[0] <= floors.bounded
                        if remainder != "pad":  # (a padded sample is appended)
                            assert np.all(np.diff(once.anchors) > 0)


# -- predictions written back where their inputs came from ------------------------------------


def _template(archive: Path, out: Path, chunks: tuple[int, ...]) -> zarr.Array:
    """A new store shaped like the archive (its coordinates, NaN everywhere) with ``pred``
    chunked ``chunks``, as ``xr.full_like(...).to_zarr(compute=False)`` makes it."""
    src = xr.open_zarr(archive, consolidated=False)
    empty = xr.full_like(src[["t2m"]], np.nan).rename(t2m="pred")
    encoding = {"pred": {"chunks": chunks}}
    empty.to_zarr(out, mode="w", compute=False, consolidated=False, encoding=encoding)
    return zarr.open_array(out / "pred", mode="r+")


def predict_into(
    pipe: InSituPipeline, out: Path, times: np.ndarray, order: list[int] | None = None
) -> np.ndarray:
    """Write ``x[last step] + 1`` of every row at its own time (``batch.coords``), located on
    the output's time axis; the writes per index (and their order appended to ``order``)."""
    arr = zarr.open_array(out / "pred", mode="r+")
    writes = np.zeros(len(times), dtype=np.int64)
    for batch in Loader(pipe):
        t, x = batch.coords["x"]["time"], batch["x"]
        if t.ndim == 2:  # a window: the row's time is its last input step's
            t, x = t[:, -1], x[:, -1]
        at = np.searchsorted(times, t)
        assert np.array_equal(times[at], t), "a row's time is not on the archive's axis"
        for i, row in zip(at, x + 1, strict=True):
            arr[int(i)] = row
        np.add.at(writes, at, 1)
        if order is not None:
            order.extend(at.tolist())
    return writes


def _check_landed(archive: Path, out: Path, writes: np.ndarray, unwritten: list[int]) -> None:
    """xarray's reading of both stores: every written time holds its input's value + 1, the
    others NaN."""
    src = xr.open_zarr(archive, consolidated=False).t2m.load()
    pred = xr.open_zarr(out, consolidated=False).pred.load()
    assert np.flatnonzero(writes == 0).tolist() == unwritten
    assert writes.max() == 1, "an output written twice"
    for t in pred.time.values[writes == 1]:
        np.testing.assert_array_equal(pred.sel(time=t).values, src.sel(time=t).values + 1)
    assert np.isnan(pred.isel(time=unwritten).values).all()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(
    ("kind", "unwritten"),
    [("shift", [T - 1]), ("window", [0, 1, T - 2, T - 1])],
    ids=["y-is-x-shifted-by-1", "x-window-of-3-y-window-of-2"],
)
def test_a_whole_archive_prediction_on_any_ranks_writes_each_output_once_at_its_inputs_time(
    archive: Path, tmp_path: Path, world: int, kind: str, unwritten: list[int]
) -> None:
    """A whole archive as the test split (``(0, 0, 1)``; ``"uneven"`` is for val/test only),
    unshuffled: over the ranks every anchor once, the last partial batch kept, and the anchors
    a view cannot serve at the array's ends (a target past the last step, an input window
    before the first) are exactly the times left unwritten."""
    g = open_geometries(archive, ["t2m"])["t2m"]
    views = (
        {"x": g, "y": g.shift(1)}
        if kind == "shift"
        else {"x": g.window([-2, -1, 0]), "y": g.window([1, 2])}
    )
    out = tmp_path / "pred.zarr"
    _template(archive, out, (1, 3, 4))  # a row per object: ranks never write one object both
    times = xr.open_zarr(out, consolidated=False).time.values
    writes = np.zeros(T, dtype=np.int64)
    manifest = split_by_chunk(g, (0.0, 0.0, 1.0))
    for rank in range(world):
        pipe = insitu_pipeline(
            archive, manifest, views, split="test", shuffle=False, remainder="uneven",
            batch_size=5, rank=rank, world_size=world,
        )  # fmt: skip
        n_valid = T - len(unwritten)
        share = n_valid // world + (rank < n_valid % world)
        assert len(pipe) == -(-share // 5)  # the last partial batch kept, none added
        writes += predict_into(pipe, out, times)
        pipe.close()
    _check_landed(archive, out, writes, unwritten)


@pytest.mark.parametrize("world", [1, 3])
def test_a_slide_swept_in_grid_windows_on_any_ranks_is_stitched_back_pixel_for_pixel(
    tmp_path: Path, world: int
) -> None:
    """A microscopist's inference: a (z, y, x) stack in 32² tiles, 16² grid windows (the last
    flush with the edge), every window once over the ranks; each output written back at its
    plane and ``patch_origins`` covers every pixel and equals the input's + 1."""
    root = tmp_path / "stack.zarr"
    data = np.random.default_rng(1).random((3, 50, 50)).astype("f4")
    ds = xr.Dataset({"image": (("z", "y", "x"), data)}, coords={"z": [0.5, 1.5, 2.5]})
    ds.to_zarr(root, mode="w", encoding={"image": {"chunks": (1, 32, 32)}}, consolidated=False)
    g = open_geometries(root, ["image"])["image"]
    view = g.patches({"y": 16, "x": 16}, origins="grid", order="sweep")
    out = np.full(data.shape, np.nan, dtype="f4")
    seen: list[tuple[int, int, int]] = []
    for rank in range(world):
        pipe = insitu_pipeline(
            root, split_by_chunk(g, (0.0, 0.0, 1.0)), {"x": view}, split="test",
            shuffle=False, remainder="uneven", batch_size=7, rank=rank, world_size=world,
        )  # fmt: skip
        for batch in Loader(pipe):
            z, origins = batch.sample_indices["x"], batch.patch_origins["x"]
            np.testing.assert_array_equal(batch.coords["x"]["z"], ds.z.values[z])
            for zi, (y0, x0), row in zip(z, origins, batch["x"], strict=True):
                out[zi, y0 : y0 + 16, x0 : x0 + 16] = row + 1
                seen.append((int(zi), int(y0), int(x0)))
        pipe.close()
    starts = [0, 16, 32, 34]  # every 16, then one flush with the far edge (50 - 16)
    assert sorted(seen) == [(z, y, x) for z in range(3) for y in starts for x in starts]
    np.testing.assert_array_equal(out, data + 1)


# -- a prediction pass interrupted and resumed -------------------------------------------------


def test_a_prediction_pass_resumed_from_each_ranks_own_state_writes_every_output_once(
    archive: Path, tmp_path: Path
) -> None:
    """Prediction has no collective per batch, so its ranks do not move in lockstep: here rank
    1 is one batch behind rank 0 when the job stops. Each rank saves its own state (the state
    does not depend on the rank, but its position does) and resumes from it: every output once.
    Rank 0's state restored on rank 1 would skip rank 1's unpredicted batch (what training's
    "rank 0's state for every rank" rule assumes away: lockstep)."""
    g = open_geometries(archive, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (0.0, 0.0, 1.0))
    out = tmp_path / "pred.zarr"
    _template(archive, out, (1, 3, 4))
    times = xr.open_zarr(out, consolidated=False).time.values

    def build(rank: int) -> InSituPipeline:
        return insitu_pipeline(
            archive, manifest, {"x": g, "y": g.shift(1)}, split="test", shuffle=False,
            remainder="uneven", batch_size=5, rank=rank, world_size=2,
        )  # fmt: skip

    arr = zarr.open_array(out / "pred", mode="r+")
    writes = np.zeros(T, dtype=np.int64)
    states = {}
    for rank, done in ((0, 2), (1, 1)):  # rank 1 one batch behind
        pipe = build(rank)
        loader = Loader(pipe)
        for _, batch in zip(range(done), loader, strict=False):  # (range first: no extra pull)
            at = np.searchsorted(times, batch.coords["x"]["time"])
            arr[int(at[0]) : int(at[-1]) + 1] = batch["x"] + 1  # rows in order: one slice
            np.add.at(writes, at, 1)
        states[rank] = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint keeps it
        pipe.close()
    for rank in (0, 1):  # a new job: each rank loads its own state
        pipe = build(rank)
        assert pipe.stages.plan.resumed_epoch(states[rank]) == 0  # mid-pass
        writes += predict_into_with_state(pipe, out, times, states[rank])
        pipe.close()
    _check_landed(archive, out, writes, [T - 1])


def predict_into_with_state(
    pipe: InSituPipeline, out: Path, times: np.ndarray, state: dict
) -> np.ndarray:
    loader = Loader(pipe)
    loader.load_state_dict(state)
    arr = zarr.open_array(out / "pred", mode="r+")
    writes = np.zeros(len(times), dtype=np.int64)
    for batch in loader:
        at = np.searchsorted(times, batch.coords["x"]["time"])
        for i, row in zip(at, batch["x"] + 1, strict=True):
            arr[int(i)] = row
        np.add.at(writes, at, 1)
    return writes


def test_a_state_taken_after_the_passs_last_batch_resumes_into_a_second_pass_as_documented(
    archive: Path,
) -> None:
    """A state saved after the pass's last batch is an epoch's end: ``Loader`` goes on with
    the next epoch, the whole pass again. A one-pass job reads that from the state before it
    iterates (training.md, *Evaluation and prediction*)."""
    g = open_geometries(archive, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (0.0, 0.0, 1.0))
    kw = {"split": "test", "shuffle": False, "remainder": "uneven", "batch_size": 5}
    pipe = insitu_pipeline(archive, manifest, {"x": g}, **kw)  # type: ignore[arg-type]
    loader = Loader(pipe)
    first = [b.sample_indices["x"].tolist() for b in loader]
    state = loader.state_dict()
    pipe.close()
    again = insitu_pipeline(archive, manifest, {"x": g}, **kw)  # type: ignore[arg-type]
    assert again.stages.plan.resumed_epoch(state) == 1  # the pass (epoch 0) is over
    resumed = Loader(again)
    resumed.load_state_dict(state)
    assert [b.sample_indices["x"].tolist() for b in resumed] == first  # all of it again
    again.close()


# -- Lightning's validate / test / predict through the data module ------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_lightnings_validate_test_and_predict_go_through_their_splits_once_in_store_order(
    archive: Path,
) -> None:
    """``trainer.validate`` / ``test`` / ``predict`` with ``InSituDataModule`` (``transform=
    to_item``, so each row says its sample): the val and test splits, every anchor once in
    store order, the last partial batch kept; ``predict`` returns one prediction per test
    batch (Lightning cannot infer a prediction writer's ``batch_indices`` from an iterable
    dataset: it passes ``[]`` and warns; the rows' ``sample_indices`` are what align)."""
    import lightning as L
    import torch

    from insitubatch_nodes.batch import to_item
    from insitubatch_nodes.lightning import InSituDataModule

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, list[list[int]]] = {"val": [], "test": []}

        def validation_step(self, batch: dict, i: int) -> None:
            self.seen["val"].append(batch["sample_indices"]["x"].tolist())

        def test_step(self, batch: dict, i: int) -> None:
            self.seen["test"].append(batch["sample_indices"]["x"].tolist())

        def predict_step(self, batch: dict, i: int) -> dict:
            return {"at": batch["sample_indices"]["x"], "pred": batch["x"] + 1}

    g = open_geometries(archive, ["t2m"])["t2m"]
    config = PlanConfig(batch_size=4)
    dm = InSituDataModule(archive, {"x": g, "y": g.shift(1)}, (0.34, 0.33, 0.33),
                          config=config, eval_batch_size=3, transform=to_item)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = Model()
    trainer.validate(model, datamodule=dm, verbose=False)
    trainer.test(model, datamodule=dm, verbose=False)
    preds = trainer.predict(model, datamodule=dm)
    assert dm.manifest is not None
    src = xr.open_zarr(archive, consolidated=False).t2m.values
    for split, batches in (*model.seen.items(), ("test", [p["at"].tolist() for p in preds])):
        samples = dm.manifest.samples(split)
        want = [s for s in samples.tolist() if s + 1 in set(samples.tolist())]  # y in split
        assert [i for b in batches for i in b] == want, split
        assert [len(b) for b in batches[:-1]] == [3] * (len(batches) - 1)
    for p in preds:  # each prediction is its own row's input + 1
        np.testing.assert_array_equal(p["pred"].numpy(), src[p["at"].numpy()] + 1)
    dm.teardown()
    assert torch.is_tensor(preds[0]["at"])


# -- real ranks: gloo ---------------------------------------------------------------------------


def predict_rank(rank: int, world: int, init_file: str, archive: str, out: str) -> None:
    """One rank of a gloo prediction job: rank and world size from ``torch.distributed``, the
    whole archive as the test split, each output written into the shared store at its time."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        g = open_geometries(archive, ["t2m"])["t2m"]
        pipe = insitu_pipeline(
            archive, split_by_chunk(g, (0.0, 0.0, 1.0)), {"x": g, "y": g.shift(1)},
            split="test", shuffle=False, remainder="uneven", batch_size=5,
        )  # fmt: skip
        plan = pipe.stages.plan
        times = xr.open_zarr(out, consolidated=False).time.values
        n_batches = len(pipe)
        written: list[int] = []
        predict_into(pipe, Path(out), times, written)
        pipe.close()
        result = {"rank": plan.rank, "world": plan.world_size, "batches": n_batches,
                  "written": written}  # fmt: skip
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # (a rank with one batch fewer waits here, not in a step)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_gloo_prediction_job_writes_every_output_once_each_rank_its_share_in_order(
    archive: Path, tmp_path: Path, world: int
) -> None:
    from resume_helpers import spawn_ranks

    out = tmp_path / "pred.zarr"
    _template(archive, out, (1, 3, 4))
    spawn_ranks(predict_rank, args=(world, str(tmp_path / "init"), str(archive), str(out)),
                nprocs=world, workdir=tmp_path / "ranks")  # fmt: skip
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [(r["rank"], r["world"]) for r in results] == [(r, world) for r in range(world)]
    writes = np.zeros(T, dtype=np.int64)
    for r in results:
        np.add.at(writes, r["written"], 1)
    _check_landed(archive, out, writes, [T - 1])
    # the ranks' shares one after another: the archive in store order (rank 0 first)
    assert [i for r in results for i in r["written"]] == list(range(T - 1))
    assert max(r["batches"] for r in results) - min(r["batches"] for r in results) <= 1


@pytest.mark.slow
@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_each_validation_run_evaluates_the_same_random_windows(tmp_path: Path) -> None:
    """Validation of random patches (``origins="random"``: origins a function of the epoch)
    through the data module: every validation run, the sanity check's included, evaluates the
    windows of the first, so the epochs' validation losses compare. Before, the validation
    pipeline's epoch moved on at each run: other windows every epoch."""
    import lightning as L
    import torch

    from insitubatch_nodes.batch import to_item
    from insitubatch_nodes.lightning import InSituDataModule

    root = tmp_path / "stack.zarr"
    data = np.random.default_rng(1).random((3, 50, 50)).astype("f4")
    xr.Dataset({"image": (("z", "y", "x"), data)}).to_zarr(
        root, mode="w", encoding={"image": {"chunks": (1, 32, 32)}}, consolidated=False
    )
    g = open_geometries(root, ["image"])["image"]

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.runs: dict[tuple[bool, int], list[tuple[int, ...]]] = {}

        def training_step(self, batch: dict, i: int) -> torch.Tensor:
            return self.lin(torch.ones(1, 1)).sum()

        def validation_step(self, batch: dict, i: int) -> None:
            key = (self.trainer.sanity_checking, self.current_epoch)
            z, o = batch["sample_indices"]["x"].tolist(), batch["patch_origins"]["x"].tolist()
            self.runs.setdefault(key, []).extend((a, *b) for a, b in zip(z, o, strict=True))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    view = g.patches({"y": 16, "x": 16}, origins="random")
    dm = InSituDataModule(root, {"x": view}, (0.34, 0.33, 0.33), config=PlanConfig(batch_size=4),
                          eval_batch_size=4, transform=to_item)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=1)  # fmt: skip
    model = Model()
    trainer.fit(model, datamodule=dm)
    sanity, *epochs = (model.runs[k] for k in sorted(model.runs, key=lambda k: (not k[0], k[1])))
    assert len(epochs) == 3
    assert epochs[1] == epochs[0] and epochs[2] == epochs[0], "other windows each epoch"
    assert sanity == epochs[0][: len(sanity)]
    dm.teardown()


_LIGHTNING_DDP = """
import json, sys
from pathlib import Path

import lightning as L
import torch

from insitubatch_nodes import PlanConfig
from insitubatch_nodes.batch import to_item
from insitubatch_nodes.lightning import InSituDataModule

archive, out = sys.argv[1], Path(sys.argv[2])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen = {"val": [], "test": []}

    def validation_step(self, batch, i):
        self.seen["val"].append(batch["sample_indices"]["x"].tolist())

    def test_step(self, batch, i):
        self.seen["test"].append(batch["sample_indices"]["x"].tolist())

    def predict_step(self, batch, i):
        return batch["sample_indices"]["x"].tolist()


class Writer(L.pytorch.callbacks.BasePredictionWriter):
    def __init__(self):
        super().__init__("epoch")

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        record = {**module.seen, "predict": predictions}
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


dm = InSituDataModule(archive, lambda g: {"x": g["t2m"], "y": g["t2m"].shift(1)},
                      (0.34, 0.33, 0.33), config=PlanConfig(batch_size=4), eval_batch_size=2,
                      transform=to_item)
trainer = L.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[Writer()])
model = Model()
trainer.validate(model, datamodule=dm, verbose=False)
trainer.test(model, datamodule=dm, verbose=False)
trainer.predict(model, datamodule=dm, return_predictions=False)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lightnings_validate_test_and_predict_on_three_gloo_ranks_see_each_sample_once(
    archive: Path, tmp_path: Path
) -> None:
    """``Trainer(devices=3, strategy="ddp")`` (gloo on CPU; Lightning's launcher starts ranks 1
    and 2 by re-running the script, forked by the tests' fork server as rank 0 is) through
    ``InSituDataModule``: validate, test and predict each see every sample of their split once
    over the ranks, each rank's share in store order, rank 0 first (7 validation anchors: 3, 2
    and 2)."""
    import subprocess
    import sys

    import forkserver

    script = tmp_path / "ddp_eval.py"
    script.write_text(_LIGHTNING_DDP)
    launcher = ("LOCAL_RANK", "NODE_RANK", "MASTER_PORT", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    with open(tmp_path / "log.txt", "w") as log:
        proc = forkserver.run([sys.executable, str(script), str(archive), str(tmp_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                              timeout=200, check=False)  # fmt: skip
    assert proc.returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    g = open_geometries(archive, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (0.34, 0.33, 0.33))
    for split, kind in (("val", "val"), ("test", "test"), ("test", "predict")):
        samples = manifest.samples(split).tolist()
        want = [s for s in samples if s + 1 in set(samples)]  # y = x + 1 in the split
        got = [i for r in ranks for b in r[kind] for i in b]
        assert got == want, (kind, [r[kind] for r in ranks])
    assert [len(r["val"]) for r in ranks] == [2, 1, 1]  # 3, 2, 2 anchors in batches of 2
