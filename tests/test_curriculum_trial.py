"""A user's trial of a rollout curriculum (GraphCast / anemoi fine-tuning): the target window
grows over training, 1 -> 2 -> 4 -> 12 steps, the batch size shrinks with it (8 -> 6 -> 4 -> 2),
and training is checkpointed and resumed across those changes (docs/concepts.md, *Other views
between epochs*; docs/model-inputs.md, *set_views with stacks*; docs/training.md).

One ERA5-like store written by xarray (80 six-hourly steps, chunks of 4 steps): ``t (time,
level, lat, lon)`` with three levels, ``2t`` and a static ``lsm``; training split 0.8 (16
chunks). ``x`` is a stack of ``t`` at two levels, ``2t`` (window ``[-1, 0]``) and ``lsm``, ``y``
a stack of ``t`` and ``2t`` over ``[1 .. R]``, both standardised by statistics fitted once.
Oracles: xarray's read of the store standardised by numpy with the fitted moments (rows), the
anchors worked out with numpy from the documented rule (every step inside the array and on a
training chunk), an uninterrupted run (order), a ``CountingStore`` (GETs).

Found wrong (fixed, each a test here):

1. ``InSituDataModule.batch_size = n`` set between epochs (with the rollout, from a callback's
   or the LightningModule's ``on_train_epoch_end``, as the batch-size schedule of a curriculum
   does) was ignored until the training loader's length happened to change: Lightning kept
   the loader it had, and epochs 2 and 3 of the 1/8 -> 2/6 -> 4/4 -> 12/2 schedule trained in
   batches of 8 (8 batches each, where 11 of 6 and 15 of 4 were asked). The module asked
   Lightning to reload only when the old pipeline's next length differed; now also when the
   pipeline would be built afresh (another batch size), from the setter and at the epoch's end.
2. A fit resumed from a checkpoint saved where an epoch ended (``on_train_epoch_end``) into a
   data module of the next epoch's views and batch size trained that next epoch with the
   ended epoch's length: Lightning was told it at the restore (the data module's answer while
   the trainer is still in the ended epoch) and kept it, so 8 of epoch 1's 11 batches, 11 of
   epoch 2's 15, 15 of epoch 3's 26 were trained and the rest skipped. The data module now has
   the trainer reload its loader before that epoch where its length differs.
3. recipes/forecast_rollout.py built a resumed run's data module with the rollout of the epochs
   the checkpoint had *completed* (Lightning's ``completed`` counter): a checkpoint saved at
   ``on_train_epoch_end`` (``ModelCheckpoint(save_on_train_epoch_end=True)``), or by
   ``every_n_train_steps`` on an epoch's last batch, resumes in the *next* epoch without running
   the epoch-end hooks again, so that epoch trained on the previous rollout. Its
   ``resume_epoch`` now reads the epoch Lightning trains first.

A checkpoint saved by ``every_n_train_steps`` on an epoch's last batch resumed the next epoch
with the ended epoch's length: a curriculum whose next epoch is longer lost its last batches (3
of 11 here), warned as a Lightning limitation. Fixed since (tests/test_laststep_trial.py says
how): that next epoch is trained whole, told its length.

Tried and found right (tests below): one pipeline given each step of the curriculum by
``set_views`` delivers, every epoch, each valid anchor exactly once (anchors whose targets leave
the training split drop out as the window grows: 62, 61, 59, 51), ``len(loader)`` before the
epoch is the batches it delivers, rows equal xarray's values standardised by the statistics
fitted once, ``batch.channels`` follow the stacks; a curriculum whose batch size changes too
(the pipeline rebuilt at each change, restored from the epoch's end state saved as JSON)
delivers each epoch exactly as a fresh pipeline of that epoch's views and batch size does, with
no chunk GET after the first epoch (the persistent cache serves every chunk across the
rebuilds); states saved at each change's epoch end, after ``set_views`` before the next epoch,
and mid-epoch after the change resume bit-exactly in fresh pipelines built with the new views
(``len()`` of the restored loader exact before ``iter()``); a mid-epoch state restored with the
old views, another window, or another batch size is refused with a ``StateMismatchError``
naming what differs and how to go on; through Lightning, the curriculum's fit (callback or
module hook) trains each epoch at its batch size and views, told its exact length, and resumed
from checkpoints at epoch ends and mid-epoch it trains the steps of a fit never stopped.
Probes not kept: ``StatefulDataLoader(as_dataset(pipe))`` through the rebuilt curriculum (each
epoch's length and batches those of a fresh pipeline); a bounded pool (``cache_budget_bytes``
at the 4-step views' floor, below the split's size, on a 240-step ``32 x 64`` store): every
valid anchor once per epoch through 1 -> 2 -> 4 steps, at most 2 GETs per object per epoch
without a persistent cache and none after the first epoch with one; a data module fit over a
persistent cache with validation on (its pipelines rebuilt per batch size read no object again).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from insitubatch_nodes import (
    Batch,
    InSituPipeline,
    Loader,
    SplitManifest,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.errors import StateMismatchError
from insitubatch_nodes.statistics import Statistics
from tests.helpers import counting_store

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

# one worker runs the module: the worker of the tests that import Lightning
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("lightning")]

N, SPC = 80, 4
LEVELS = [850, 500]
SEED = 3
# (target steps, batch size) by epoch: the curriculum
SCHEDULE = [(1, 8), (2, 6), (4, 4), (12, 2)]


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    root = tmp_path_factory.mktemp("curriculum") / "era5.zarr"
    rng = np.random.default_rng(0)
    ds = xr.Dataset(
        {
            "t": (("time", "level", "lat", "lon"), rng.normal(250, 5, (N, 3, 4, 6))),
            "2t": (("time", "lat", "lon"), rng.normal(280, 3, (N, 4, 6))),
            "lsm": (("lat", "lon"), (rng.random((4, 6)) > 0.5) * 1.0),
        },
        coords={
            "time": pd.date_range("2020-01-01", periods=N, freq="6h"),
            "level": [1000, 850, 500],
            "lat": [60.0, 20.0, -20.0, -60.0],
            "lon": np.arange(0.0, 360.0, 60.0),
        },
    ).astype("float32")
    chunks = {v: {"chunks": (SPC, *ds[v].shape[1:])} for v in ("t", "2t")}
    ds.to_zarr(root, encoding=chunks, zarr_format=3, consolidated=False)
    return root, xr.open_zarr(root, consolidated=False).load()


@pytest.fixture(scope="module")
def manifest(era5: tuple[Path, xr.Dataset]) -> SplitManifest:
    return split_by_chunk(open_geometries(era5[0])["t"], (0.8, 0.2, 0.0))


@pytest.fixture(scope="module")
def stats_file(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """Statistics fitted once, before the curriculum, and saved."""
    g = open_geometries(era5[0])
    members = {"t": g["t"].sel(level=LEVELS), "2t": g["2t"], "lsm": g["lsm"]}
    path = tmp_path_factory.mktemp("stats") / "stats.json"
    fit_statistics(era5[0], manifest, members).save(path)
    return path


def _views(root: Path, stats: Statistics, steps: int) -> dict[str, Any]:
    g = open_geometries(root)
    t, t2 = g["t"].sel(level=LEVELS), g["2t"]
    targets = list(range(1, steps + 1))
    x = stack({"t": t.window([-1, 0]), "2t": t2.window([-1, 0]), "lsm": g["lsm"]}, normalize=stats)
    y = stack({"t": t.window(targets), "2t": t2.window(targets)}, normalize=stats)
    return {"x": x, "y": y}


def _valid(manifest: SplitManifest, steps: int) -> list[int]:
    """The documented rule: an anchor is valid when every step of every view lies inside the
    array, on a chunk of the training split."""
    train = set(manifest.chunks("train"))
    offsets = [-1, 0, *range(1, steps + 1)]
    return [a for a in range(N) if all(0 <= a + o < N and (a + o) // SPC in train for o in offsets)]


def _anchors(batch: Batch) -> list[int]:
    return [int(a) for a in np.asarray(batch.sample_indices["x"])[:, -1]]


def _record(batch: Batch) -> tuple[int, int, str]:
    h = hashlib.sha256()
    for label in sorted(batch.arrays):
        h.update(np.ascontiguousarray(batch.arrays[label]).tobytes())
        h.update(np.asarray(batch.sample_indices[label]).tobytes())
    return batch.epoch, batch.index, h.hexdigest()


def _oracle_check(batch: Batch, ds: xr.Dataset, stats: Statistics, steps: int) -> None:
    """The batch's rows are xarray's values at its anchors, standardised by numpy with the
    fitted moments, in the stacks' channel order."""
    a = np.asarray(_anchors(batch))
    t = ds["t"].sel(level=LEVELS).values.astype(np.float64)
    t2 = ds["2t"].values.astype(np.float64)
    lsm = ds["lsm"].values.astype(np.float64)

    def std(name: str, v: np.ndarray, channels: bool) -> np.ndarray:
        m, s = np.asarray(stats.mean[name]), np.asarray(stats.std[name])
        shape = (-1, 1, 1) if channels else ()
        return (v - m.reshape(shape)) / s.reshape(shape)

    def rows(offsets: Sequence[int]) -> np.ndarray:
        idx = a[:, None] + np.asarray(offsets)  # (B, T)
        return np.concatenate([std("t", t[idx], True), std("2t", t2[idx], False)[:, :, None]], 2)

    x = np.concatenate(
        [rows([-1, 0]), np.broadcast_to(std("lsm", lsm, False), (len(a), 2, 1, 4, 6))], axis=2
    )
    np.testing.assert_allclose(batch["x"], x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch["y"], rows(range(1, steps + 1)), rtol=1e-5, atol=1e-5)
    assert batch.channels["x"] == ["t@850", "t@500", "2t", "lsm"]
    assert batch.channels["y"] == ["t@850", "t@500", "2t"]
    assert batch["y"].shape == (len(a), steps, 3, 4, 6)


def _json(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))  # as a checkpoint gives it back
    return loaded


def _build(
    root: Any, manifest: SplitManifest, stats: Statistics, steps: int, batch_size: int, **kw: Any
) -> InSituPipeline:
    kw = {"block_chunks": 3, "seed": SEED} | kw
    return insitu_pipeline(root, manifest, _views(root, stats, steps), batch_size=batch_size, **kw)


def _epoch_reference(
    root: Path, manifest: SplitManifest, stats: Statistics, epoch: int
) -> list[tuple[int, int, str]]:
    """Epoch ``epoch`` of the curriculum as a fresh pipeline of its views and batch size
    delivers it (the data order is a function of the seed, the epoch and the configuration)."""
    steps, batch_size = SCHEDULE[epoch]
    with _build(root, manifest, stats, steps, batch_size) as pipe:
        pipe.stages.plan.set_epoch(epoch)
        return [_record(b) for b in Loader(pipe)]


@pytest.fixture(scope="module")
def reference(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path
) -> list[list[tuple[int, int, str]]]:
    stats = Statistics.load(stats_file)
    return [_epoch_reference(era5[0], manifest, stats, e) for e in range(len(SCHEDULE))]


# ---------------------------------------------------------------------------------------------
# Tried and found right: the raw pipeline
# ---------------------------------------------------------------------------------------------


def test_each_epoch_of_a_growing_rollout_delivers_every_valid_anchor_once_in_len_batches(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path
) -> None:
    root, ds = era5
    stats = Statistics.load(stats_file)
    counts = []
    with _build(root, manifest, stats, 1, 4) as pipe:
        loader = Loader(pipe)
        for epoch, (steps, _) in enumerate(SCHEDULE):
            if epoch:
                pipe.set_views(_views(root, stats, steps))
            told = len(loader)  # what a trainer is told before the epoch
            batches = list(loader)
            assert told == len(batches)
            anchors = sorted(a for b in batches for a in _anchors(b))
            assert anchors == _valid(manifest, steps), steps  # each exactly once
            assert {b.epoch for b in batches} == {epoch}
            for b in batches:
                _oracle_check(b, ds, stats, steps)
            counts.append(len(anchors))
    assert counts == [62, 61, 59, 51]  # the last anchors drop out as the window grows


def test_a_curriculum_that_changes_the_batch_size_goes_on_from_each_epochs_end_state(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    stats_file: Path,
    reference: list[list[tuple[int, int, str]]],
    tmp_path: Path,
) -> None:
    """At each change the user saves the loader state (JSON), builds the pipeline afresh with
    the new views and batch size over the same persistent cache, and restores the state: each
    epoch is what a fresh pipeline of its settings delivers, and no chunk is fetched again."""
    root, ds = era5
    stats = Statistics.load(stats_file)
    store = counting_store(root)
    cache = {"cache_dir": str(tmp_path / "cache"), "persist": True}
    steps, batch_size = SCHEDULE[0]
    pipe = _build(store, manifest, stats, steps, batch_size, **cache)
    try:
        loader = Loader(pipe)
        gets = []
        for epoch, (steps, batch_size) in enumerate(SCHEDULE):
            if epoch:
                state = _json(loader.state_dict())
                pipe.close()
                pipe = _build(store, manifest, Statistics.load(stats_file), steps, batch_size,
                              **cache)  # fmt: skip
                loader = Loader(pipe)
                loader.load_state_dict(state)
            store.reset_counts()
            told = len(loader)
            batches = list(loader)
            gets.append(sum(store.chunk_counts().values()))
            assert told == len(batches) == len(reference[epoch])
            assert [_record(b) for b in batches] == reference[epoch], epoch
            assert max(len(b) for b in batches) == batch_size
            assert sorted(a for b in batches for a in _anchors(b)) == _valid(manifest, steps)
            _oracle_check(batches[0], ds, stats, steps)
    finally:
        pipe.close()
    assert gets[0] > 0 and gets[1:] == [0, 0, 0], gets  # the persistent cache serves the rest


def _run_from(
    pipe: InSituPipeline, state: dict[str, Any] | None, epochs: Sequence[int], root: Path,
    stats: Statistics,
) -> Iterator[tuple[int, int, str]]:  # fmt: skip
    """Records of ``pipe`` restored from ``state`` through the given epochs, set_views'ing each
    epoch's views before it (as a curriculum does), its length before each checked."""
    loader = Loader(pipe)
    if state is not None:
        loader.load_state_dict(state)
    for i, epoch in enumerate(epochs):
        if i:
            pipe.set_views(_views(root, stats, SCHEDULE[epoch][0]))
        told = len(loader)
        batches = [_record(b) for b in loader]
        assert told == len(batches) + (batches[0][1] if batches else 0)  # counted from its start
        yield from batches


@pytest.mark.parametrize("change", [1, 2, 3])
def test_states_saved_before_at_and_after_a_rollout_change_resume_bit_exactly(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path, change: int
) -> None:
    """Batch size fixed (one pipeline, ``set_views`` only): a state taken mid-epoch before the
    change, at the epoch's end, after ``set_views`` (pending), and mid-epoch after it, each
    restored in a fresh pipeline built with the views of the epoch it resumes in."""
    root, _ = era5
    stats = Statistics.load(stats_file)
    before, after = SCHEDULE[change - 1][0], SCHEDULE[change][0]
    with _build(root, manifest, stats, before, 4) as pipe:
        pipe.stages.plan.set_epoch(change - 1)
        loader = Loader(pipe)
        it = iter(loader)
        want = [_record(next(it)) for _ in range(2)]
        states = {"mid, before": (_json(loader.state_dict()), 2, before)}
        want += [_record(b) for b in it]
        states["epoch's end"] = (_json(loader.state_dict()), len(want), after)
        pipe.set_views(_views(root, stats, after))
        states["after set_views"] = (_json(loader.state_dict()), len(want), after)
        it = iter(loader)
        want += [_record(next(it)) for _ in range(3)]
        states["mid, after"] = (_json(loader.state_dict()), len(want), after)
        want += [_record(b) for b in it]
    for name, (state, done, steps) in states.items():
        epochs = [change - 1, change] if steps == before else [change]
        with _build(root, manifest, stats, steps, 4) as fresh:
            got = list(_run_from(fresh, state, epochs, root, stats))
        assert got == want[done:], name


@pytest.mark.parametrize(
    "wrong", [{"steps": 2}, {"steps": 3}, {"batch_size": 2}], ids=["old views", "other", "batch"]
)
def test_a_mid_epoch_state_after_a_change_restored_with_the_wrong_settings_is_refused(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path, wrong: dict
) -> None:
    """Saved 3 batches into the 4-step epoch (batches of 4); restored into a pipeline of the
    2-step views (those before the change), of 3 steps, or batching by 2: a clear refusal
    naming what differs, before any batch of the wrong kind is delivered."""
    root, _ = era5
    stats = Statistics.load(stats_file)
    with _build(root, manifest, stats, 2, 4) as pipe:
        loader = Loader(pipe)
        list(loader)
        pipe.set_views(_views(root, stats, 4))
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = _json(loader.state_dict())
    settings = {"steps": 4, "batch_size": 4} | wrong
    with _build(root, manifest, stats, settings["steps"], settings["batch_size"]) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        with pytest.raises(StateMismatchError) as info:
            next(iter(loader))
    said = str(info.value)
    if "batch_size" in wrong:
        assert "batch_size differs (saved 4, this pipeline 2)" in said, said
    else:
        saved, now = said.split("this pipeline reads")  # both sets of views, named
        last = wrong["steps"]
        assert "y[t,3]: t +4" in saved and f"y[t,{last - 1}]: t +{last}]" in now, said
    assert "set_epoch(1)" in said, said  # how to go on without it


# ---------------------------------------------------------------------------------------------
# The Lightning data module with the curriculum (docs/training.md)
# ---------------------------------------------------------------------------------------------


def _fit(
    root: Path,
    manifest: SplitManifest,
    stats: Statistics,
    workdir: Path,
    *,
    start: int = 0,
    ckpt: Path | None = None,
    every: int | None = None,
    in_module: bool = False,
    cache: Path | None = None,
    gets: dict[int, int] | None = None,
) -> list[tuple[int, int, int, tuple[int, ...], str, int]]:
    """``trainer.fit`` over the curriculum: the data module built with the views and batch
    size of epoch ``start`` (as the rollout recipe builds it to resume), and the next epoch's
    set from ``on_train_epoch_end`` (a callback's, or the LightningModule's own with
    ``in_module``). Returns ``(trainer epoch, batch epoch, index, anchors, digest, the
    trainer's num_training_batches)`` per step. With ``cache``, the module reads through a
    persistent cache there, and ``gets`` receives the chunk GETs of each training epoch."""
    import lightning.pytorch as pl
    import torch

    from insitubatch_nodes import CacheOptions, PlanConfig
    from insitubatch_nodes.lightning import InSituDataModule

    seen: list[tuple[int, int, int, tuple[int, ...], str, int]] = []

    def curriculum(trainer: Any) -> None:
        dm = trainer.datamodule
        now, nxt = trainer.current_epoch, min(trainer.current_epoch + 1, len(SCHEDULE) - 1)
        if SCHEDULE[nxt][1] != SCHEDULE[now][1]:
            dm.batch_size = SCHEDULE[nxt][1]
        if SCHEDULE[nxt][0] != SCHEDULE[now][0]:
            dm.set_views(_views(root, stats, SCHEDULE[nxt][0]))

    class Model(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Batch, index: int) -> Any:
            epoch, at, digest = _record(batch)
            told = int(self.trainer.num_training_batches)  # the length Lightning was told
            seen.append((self.current_epoch, epoch, at, tuple(_anchors(batch)), digest, told))
            return (self.w * 0.0).sum()

        def on_train_epoch_end(self) -> None:
            if in_module:
                curriculum(self.trainer)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    store = counting_store(root)

    class Curriculum(pl.Callback):  # type: ignore[misc]
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            store.reset_counts()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            if gets is not None:
                gets[trainer.current_epoch] = sum(store.chunk_counts().values())
            if not in_module:
                curriculum(trainer)

    steps, batch_size = SCHEDULE[start]
    options = {} if cache is None else {"cache": CacheOptions(cache_dir=cache, persist=True)}
    dm = InSituDataModule(store, _views(root, stats, steps), manifest, transform=lambda b: b,
                          config=PlanConfig(batch_size=batch_size, block_chunks=3, seed=SEED),
                          log_report=False, **options)  # fmt: skip
    callbacks: list[Any] = [Curriculum()]
    if every is not None:  # every `every` steps, and where each epoch ends
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=workdir, every_n_train_steps=every, save_top_k=-1,
            filename="{epoch}-{step}"))  # fmt: skip
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=workdir, save_on_train_epoch_end=True, save_top_k=-1,
            filename="end-{epoch}-{step}"))  # fmt: skip
    trainer = pl.Trainer(max_epochs=len(SCHEDULE), accelerator="cpu", logger=False,
                         callbacks=callbacks, enable_checkpointing=every is not None,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=workdir)  # fmt: skip
    trainer.fit(Model(), datamodule=dm, ckpt_path=ckpt)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("where", ["callback", "module"])
def test_a_batch_size_set_between_epochs_with_the_rollout_batches_the_next_epoch(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    stats_file: Path,
    reference: list[list[tuple[int, int, str]]],
    tmp_path: Path,
    where: str,
) -> None:
    """Each epoch of the fit is the curriculum's: its batch size, its views, every valid anchor
    once, Lightning told its exact length, and no chunk fetched again after the first epoch
    (before the fix, epochs 2 and 3 came in batches of 8: the batch size was taken only once
    the loader's length changed)."""
    root, _ = era5
    stats = Statistics.load(stats_file)
    gets: dict[int, int] = {}
    seen = _fit(root, manifest, stats, tmp_path, in_module=where == "module",
                cache=tmp_path / "cache", gets=gets)  # fmt: skip
    # each new batch size builds the pipeline afresh: the persistent cache serves its chunks
    assert gets[0] > 0 and [gets[e] for e in (1, 2, 3)] == [0, 0, 0], gets
    for epoch, (steps, batch_size) in enumerate(SCHEDULE):
        steps_of = [s for s in seen if s[0] == epoch]
        assert sorted(a for s in steps_of for a in s[3]) == _valid(manifest, steps), epoch
        assert max(len(s[3]) for s in steps_of) == batch_size, epoch
        assert [s[1:3] + s[4:5] for s in steps_of] == reference[epoch], epoch
        assert {s[5] for s in steps_of} == {len(steps_of)}, epoch  # Lightning told the length


def _resumes_in(ckpt: Path) -> int:
    """The epoch a Lightning checkpoint resumes in, as recipes/forecast_rollout.py reads it
    (to build its data module with that epoch's rollout)."""
    import importlib.util

    path = Path(__file__).parents[1] / "recipes" / "forecast_rollout.py"
    spec = importlib.util.spec_from_file_location("recipe_forecast_rollout", path)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return int(recipe.resume_epoch(ckpt))


@pytest.fixture(scope="module")
def fitted(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[tuple[int, int, int, tuple[int, ...], str, int]]]:  # fmt: skip
    """The curriculum's fit, uninterrupted, with checkpoints every 4 steps and at every
    epoch's end: ``(their folder, its steps)``."""
    ckpts = tmp_path_factory.mktemp("fitted")
    steps = _fit(era5[0], manifest, Statistics.load(stats_file), ckpts, every=4)
    ends = np.cumsum([sum(1 for s in steps if s[0] == e) for e in range(len(SCHEDULE))])
    assert list(ends) == [8, 19, 34, 60]
    return ckpts, steps


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "end-epoch=0-step=8",
        "epoch=1-step=12",
        "end-epoch=1-step=19",
        "end-epoch=2-step=34",
        "epoch=3-step=40",
    ],
)
def test_a_fit_resumed_across_the_curriculum_trains_the_batches_of_a_fit_never_stopped(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path, tmp_path: Path,
    fitted: tuple[Path, list], name: str,
) -> None:  # fmt: skip
    """Resumed from a checkpoint saved where an epoch ends (``on_train_epoch_end``: the batch
    size and the views change with the next epoch) or mid-epoch, in a data module made with
    the views and batch size of the epoch the recipe's ``resume_epoch`` says the checkpoint
    resumes in: the steps after it are the uninterrupted fit's, each epoch told its length.
    (Before, from an epoch's end: the next epoch was told the ended epoch's length, 8 batches of
    its 11, and the recipe's rule built it with the ended epoch's rollout.)"""
    ckpts, want = fitted
    step = int(name.rsplit("=", 1)[1])
    ckpt = ckpts / f"{name}.ckpt"
    start = _resumes_in(ckpt)
    assert start == want[step][0]  # the epoch the fit never stopped trains next
    got = _fit(era5[0], manifest, Statistics.load(stats_file), tmp_path, start=start, ckpt=ckpt)
    assert got == want[step:]


@pytest.mark.slow
def test_a_checkpoint_saved_after_an_epochs_last_batch_resumes_the_longer_next_epoch_whole(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path, tmp_path: Path,
    fitted: tuple[Path, list],
) -> None:  # fmt: skip
    """Saved by ``every_n_train_steps`` on epoch 0's last batch: Lightning counts the epoch as
    done, and epoch 1 (11 batches of 6, where epoch 0 had 8 of 8) is trained whole, told its
    length, then the rest as the fit never stopped, with no warning (before: 8 of its 11
    batches, told 8, and a ``UserWarning`` that its last 3 would not be trained)."""
    ckpts, want = fitted
    ckpt = ckpts / "epoch=0-step=8.ckpt"
    assert _resumes_in(ckpt) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _fit(era5[0], manifest, Statistics.load(stats_file), tmp_path, start=1, ckpt=ckpt)
    assert got == want[8:]
    assert not [w for w in caught if "insitubatch_nodes" in w.filename], caught
