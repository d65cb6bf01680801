"""A user's trial of resume and ranks with model-ready inputs (docs/training.md,
docs/model-inputs.md).

One ERA5-like store written by xarray (``to_zarr``, 46 six-hourly steps, chunks of 4 steps):
``t (time, level, latitude, longitude)`` with three levels, ``2t``, and static ``lsm`` and
``oro``. The labels are model inputs: ``x`` a stack of ``t`` at two levels by ``sel`` and ``2t``
(windows ``[-1, 0]``), the static ``lsm`` and a forcing, standardised with fitted statistics
(``normalize=``); ``y`` a stack of ``2t`` one and two steps ahead. xarray / numpy are the
oracles of the values, an uninterrupted run of the order.

What the trial found wrong (each now a test here):

1. A state saved mid-epoch restored into a pipeline whose stack reads *another array as a
   static member* under the same member name (``"lsm": g["oro"]``), or computes a forcing
   member otherwise (``toa_incident_solar_radiation`` over another ``period``), was accepted:
   the rest of the epoch came with other values in that channel. A static *label*'s array was
   recorded, a stack's static members' and forcings' were not. Now the state records them and
   the restore is refused naming the member.
2. ``Statistics.load(path, dataset=...)`` refused the store and the manifest in the forms a
   user holds them — the path or opened store given to ``fit_statistics``, the
   ``SplitManifest`` — with ``TypeError: PosixPath ... cannot be compared with a saved
   dataset``; a trailing ``/`` on a path was "another dataset". Now a store (anything
   ``insitu_pipeline`` takes) is compared by what it names, a manifest by its fingerprint, and a
   store the statistics were not fitted on is refused naming both. And statistics fitted on
   other samples of the split (``stride="12h"``, ``missing=``) recorded the same ``dataset`` as
   those of every sample, so no check could tell them apart; the stride and the missing steps
   are now recorded (as the pipeline's config names them) and checked.
3. A state restored into a pipeline with another batch size (seed, shuffle, ...) was refused
   with "its batch_size differs (saved 3, this pipeline 4)" and nothing on what to do — also
   one taken at an epoch's end, where nothing of its epoch is left and the next epoch is a
   pure function of the seed, the epoch and the configuration (the most common checkpoint,
   and ``InSituDataModule`` offered no way around it). Such a state now restores, the next
   epoch batched by the new settings, on any number of ranks; mid-epoch the error says to
   build the pipeline with the saved value to resume, or to go on without the state at the
   epoch it names (``set_epoch``), or to restore one taken where an epoch begins or ends.

Tried and found right (tests below, or probes not kept): the rest of an epoch resumed from a
state taken after any batch (mid-epoch, at an epoch's end) in a fresh pipeline, with statistics
loaded from JSON, is bit-identical to the uninterrupted run's — also with a persistent
``cache_dir`` (warm or cold), another ``prefetch_depth``, ``max_inflight``, cache budget or
``FetchOptions(direct=True)``, and rewound on the same ``Loader`` / ``StatefulDataLoader``;
the normalised stacks equal xarray's values standardised by numpy's moments of the training
split (any ``isel``/``sel``/mask/``nearest`` selection; JSON statistics accepted exactly where
the fitted ones are, and refused for other levels or their order); ranks 1-4 (``drop``,
``pad``, a ``"12h"`` stride, ``missing=()`` over a gap in the times, ``"uneven"`` for
validation) deliver disjoint samples in equal batch counts whose union is the one-process epoch,
valued as one rank values them; elastic resume 2/3/4 -> 1/2/3 and 2 -> 3 -> 1 with stacks
delivers every sample once, ``len()`` the interrupted epoch's, the next epoch a fresh run's;
two real gloo ranks, cut after two batches, resumed on three gloo ranks (every sample once, equal
batch counts, ``len()`` the interrupted epoch's); two ranks sharing one ``cache_dir`` and an
elastic resume reading it; a resume reading a persistent cache as a reader
(``readonly_cache``); a persistent cache written from another store (or the store rewritten)
is refetched; CF-packed ``int16`` members with fill values (zarr v2 and v3, consolidated,
``cf_dtype="float32"``): NaNs counted, standardised as xarray decodes them, resumed
bit-identically; statistics of a ``concat`` of stores loaded in a fresh process apply
unchanged; ``InSituDataModule`` over these stacks (``len()`` of train, val, test and predict
equal to the batches delivered at batch sizes 1-5; checkpoints after 1, 4, 8, 9 and 11 steps,
with mid-epoch validation, resume without skipping or repeating a batch).

Left as designed: ``stack(..., normalize=stats)`` does not compare the store the statistics
were fitted on with the pipeline's (statistics of a training store standardise another store's
views of the same arrays; ``Statistics.load(path, dataset={"store": ...})`` is the check).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from insitubatch_nodes import (
    Batch,
    Forcings,
    InSituPipeline,
    Loader,
    SplitManifest,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.statistics import Statistics

# one worker runs the module: the worker of the tests that import Lightning (one of its tests)
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("lightning")]

N, SPC = 46, 4
LEVELS = [850, 500]


def _write(root: Path, seed: int) -> xr.Dataset:
    times = pd.date_range("2020-01-01", periods=N, freq="6h")
    rng = np.random.default_rng(seed)
    ds = xr.Dataset(
        {
            "t": (("time", "level", "latitude", "longitude"), rng.normal(250, 5, (N, 3, 4, 6))),
            "2t": (("time", "latitude", "longitude"), rng.normal(280, 3, (N, 4, 6))),
            "lsm": (("latitude", "longitude"), (rng.random((4, 6)) > 0.5) * 1.0),
            "oro": (("latitude", "longitude"), rng.normal(500, 300, (4, 6))),
        },
        coords={
            "time": times,
            "level": [1000, 850, 500],
            "latitude": [60.0, 20.0, -20.0, -60.0],
            "longitude": np.arange(0.0, 360.0, 60.0),
        },
    ).astype("float32")
    chunks = {v: {"chunks": (SPC, *ds[v].shape[1:])} for v in ("t", "2t")}
    ds.to_zarr(root, encoding=chunks, zarr_format=3, consolidated=False)
    return ds


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    root = tmp_path_factory.mktemp("stackresume") / "era5.zarr"
    return root, _write(root, seed=0)


@pytest.fixture(scope="module")
def manifest(era5: tuple[Path, xr.Dataset]) -> SplitManifest:
    return split_by_chunk(open_geometries(era5[0])["t"], (0.8, 0.2, 0.0), seed=1)


@pytest.fixture(scope="module")
def stats_file(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    g = open_geometries(era5[0])
    members = {"t": g["t"].sel(level=LEVELS), "2t": g["2t"], "lsm": g["lsm"]}
    path = tmp_path_factory.mktemp("stats") / "stats.json"
    fit_statistics(era5[0], manifest, members).save(path)
    return path


def _views(root: Path, stats: Statistics, **swap: Any) -> dict[str, Any]:
    g = open_geometries(root)
    t, t2 = g["t"].sel(level=LEVELS), g["2t"]
    sun = Forcings("x", view=t2, names=["cos_solar_zenith"])
    members = {"t": t.window([-1, 0]), "2t": t2.window([-1, 0]), "lsm": g["lsm"], "sun": sun}
    x = stack(members | swap, normalize=stats)
    y = stack({"2t": t2.window([1, 2])}, normalize=stats)
    return {"x": x, "y": y}


def _build(
    root: Path, manifest: SplitManifest, stats: Statistics, **options: Any
) -> InSituPipeline:
    options = {"batch_size": 3, "block_chunks": 2, "seed": 7} | options
    return insitu_pipeline(root, manifest, _views(root, stats), **options)


def _record(batch: Batch) -> tuple[int, int, str]:
    h = hashlib.sha256()
    for label in sorted(batch.arrays):
        h.update(np.ascontiguousarray(batch.arrays[label]).tobytes())
        h.update(np.asarray(batch.sample_indices[label]).tobytes())
    return batch.epoch, batch.index, h.hexdigest()


def _keys(batch: Batch) -> list[int]:
    """A row's sample: its anchor (the window's last step of ``x``)."""
    return [int(i) for i in np.asarray(batch.sample_indices["x"])[:, -1]]


# ---------------------------------------------------------------------------------------------
# Found wrong, now fixed
# ---------------------------------------------------------------------------------------------


def _state_after(pipe: InSituPipeline, k: int) -> tuple[dict[str, Any], Batch]:
    """The loader's state after ``k`` batches, as JSON would give it back, and batch ``k``."""
    loader = Loader(pipe)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    return state, next(it)


@pytest.mark.parametrize("member", ["static", "forcing"])
def test_a_state_restored_mid_epoch_with_a_stack_member_computed_otherwise_is_refused(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, member: str
) -> None:
    root, _ = era5
    g = open_geometries(root)
    if member == "static":  # another array under the member's name: other values, same channel
        before, after = {"lsm": g["lsm"]}, {"lsm": g["oro"]}
    else:  # the radiation accumulated over another period
        names = ["toa_incident_solar_radiation"]
        before = {"sun": Forcings("x", view=g["2t"], names=names)}
        after = {"sun": Forcings("x", view=g["2t"], names=names, period="6h")}
    base = {"t": g["t"].sel(level=LEVELS).window([-1, 0])}
    with insitu_pipeline(root, manifest, {"x": stack(base | before)}, batch_size=3) as pipe:
        state, _ = _state_after(pipe, 2)
    with insitu_pipeline(root, manifest, {"x": stack(base | after)}, batch_size=3) as pipe:
        loader = Loader(pipe)
        with pytest.raises(
            ValueError, match=rf"'x' static members.*{'oro' if member == 'static' else '21600'}"
        ):
            loader.load_state_dict(state)
            next(iter(loader))
    # at an epoch's end the next epoch is the new pipeline's own, as for other views
    with insitu_pipeline(root, manifest, {"x": stack(base | before)}, batch_size=3) as pipe:
        loader = Loader(pipe)
        for _ in loader:
            pass
        state = loader.state_dict()
    with insitu_pipeline(root, manifest, {"x": stack(base | after)}, batch_size=3) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert next(iter(loader)).epoch == 1


def test_a_state_saved_with_a_stacks_static_member_restores_into_the_same_stack(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path
) -> None:
    root, _ = era5
    stats = Statistics.load(stats_file)
    with _build(root, manifest, stats) as pipe:
        state, want = _state_after(pipe, 4)
    with _build(root, manifest, Statistics.load(stats_file)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert _record(next(iter(loader))) == _record(want)


def test_statistics_are_checked_against_the_store_and_manifest_as_the_user_holds_them(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    stats_file: Path,
    tmp_path: Path,
) -> None:
    root, _ = era5
    for store in (root, str(root), f"{root}/", open_store(str(root))):
        Statistics.load(stats_file, dataset={"store": store, "manifest": manifest})
    other = tmp_path / "other.zarr"
    _write(other, seed=1)
    with pytest.raises(ValueError, match=r"another dataset: store .*era5\.zarr.*other\.zarr"):
        Statistics.load(stats_file, dataset={"store": other})
    g = open_geometries(root)
    resplit = split_by_chunk(g["t"], (0.6, 0.4, 0.0), seed=1)
    with pytest.raises(ValueError, match="another dataset: manifest"):
        Statistics.load(stats_file, dataset={"store": root, "manifest": resplit})
    # the views as the pipeline takes them (a window is no other selection); other levels not
    sun = Forcings("x", view=g["2t"], names=["cos_solar_zenith"])  # (never fitted)
    same = {"t": g["t"].sel(level=LEVELS).window([-1, 0]), "lsm": g["lsm"], "sun": sun}
    Statistics.load(stats_file, dataset={"views": same})
    for other_levels in ([500, 850], [1000, 850]):
        with pytest.raises(ValueError, match=r"another dataset: views .*\[\[1, 2\]"):
            Statistics.load(stats_file, dataset={"views": {"t": g["t"].sel(level=other_levels)}})


def test_statistics_fitted_on_other_samples_of_the_split_record_which(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path, tmp_path: Path
) -> None:
    root, ds = era5
    t2 = open_geometries(root)["2t"]
    every = fit_statistics(root, manifest, {"2t": t2})
    strided = fit_statistics(root, manifest, {"2t": t2}, stride="12h")
    train = np.sort(np.asarray(manifest.samples("train")))
    noon = train[ds.time.values[train].astype("datetime64[h]").astype(int) % 12 == 0]
    np.testing.assert_allclose(strided.mean["2t"], ds["2t"].values[noon].mean(dtype="f8"))
    assert strided.mean["2t"] != every.mean["2t"]  # other statistics ...
    assert strided.dataset != every.dataset  # ... said to be of other samples
    strided.save(tmp_path / "strided.json")
    with pytest.raises(
        ValueError, match="another dataset: stride '12 hours' in the file, 1 expected"
    ):
        Statistics.load(tmp_path / "strided.json", dataset=every.dataset | {"stride": 1})
    with pytest.raises(ValueError, match="stride 1 in the file, '12 hours' expected"):
        Statistics.load(stats_file, dataset={"stride": "12h"})
    Statistics.load(tmp_path / "strided.json", dataset=strided.dataset)
    Statistics.load(tmp_path / "strided.json", dataset={"stride": np.timedelta64(720, "m")})
    Statistics.load(stats_file, dataset={"store": root, "stride": 1})
    gaps = fit_statistics(root, manifest, {"2t": t2}, missing=[4, 5])
    assert gaps.dataset != every.dataset and gaps.count["2t"] == every.count["2t"] - 2 * 24


def test_a_state_refused_for_another_batch_size_says_how_to_resume_or_start_afresh(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path
) -> None:
    root, _ = era5
    stats = Statistics.load(stats_file)
    with _build(root, manifest, stats) as pipe:
        state, _ = _state_after(pipe, 2)
    for option, now in (("batch_size", 4), ("seed", 8), ("shuffle", False)):
        with _build(root, manifest, stats, **{option: now}) as pipe:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            with pytest.raises(ValueError, match=option) as info:
                next(iter(loader))
        said = str(info.value)
        saved = {"batch_size": 3, "seed": 7, "shuffle": True}[option]
        assert f"{option}={saved!r}" in said, said  # how to resume it
        assert "set_epoch(0)" in said, said  # how to go on without it: the epoch it was in
    with _build(root, manifest, stats, stride=2) as pipe:  # another choice of anchors
        loader = Loader(pipe)
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match=r"stride differs.*build the pipeline with the saved"):
            next(iter(loader))
    # the advice, followed: the next epoch of the new order, in batches of the new size
    with _build(root, manifest, stats, batch_size=4) as pipe:
        pipe.stages.plan.set_epoch(1)
        batches = list(Loader(pipe))
    assert {b.epoch for b in batches} == {1} and len(batches[0]["x"]) == 4


@pytest.mark.parametrize(
    "option", [{"batch_size": 4}, {"seed": 8}, {"shuffle": False}, {"block_chunks": 1}]
)
def test_a_state_taken_where_an_epoch_ends_restores_with_another_batching(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    stats_file: Path,
    option: dict[str, Any],
) -> None:
    root, _ = era5
    stats = Statistics.load(stats_file)
    for world, new_world in ((1, 1), (2, 3)):  # on another number of ranks too
        with _build(root, manifest, stats, rank=0, world_size=world) as pipe:
            loader = Loader(pipe)
            for _ in loader:
                pass
            ended = json.loads(json.dumps(loader.state_dict()))
        for rank in range(new_world):
            ranks = {"rank": rank, "world_size": new_world}
            with _build(root, manifest, stats, **option, **ranks) as pipe:
                fresh = Loader(pipe)
                want = [[_record(b) for b in fresh] for _ in range(2)][1]  # its epoch 1
            with _build(root, manifest, stats, **option, **ranks) as pipe:
                loader = Loader(pipe)
                loader.load_state_dict(ended)
                assert len(loader) == len(want)
                assert [_record(b) for b in loader] == want, (world, new_world, rank)


# ---------------------------------------------------------------------------------------------
# Found right
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path
) -> list[tuple[int, int, str]]:
    """Two uninterrupted epochs, every row of ``x`` checked against xarray standardised by
    numpy's moments of the training split."""
    root, ds = era5
    stats = Statistics.load(stats_file)
    train = ds.isel(time=np.sort(np.asarray(manifest.samples("train")))).astype("f8")
    moments = {
        "t": (train.t.sel(level=LEVELS).mean(("time", "latitude", "longitude")).values,
              train.t.sel(level=LEVELS).std(("time", "latitude", "longitude")).values),
        "2t": (train["2t"].mean().values, train["2t"].std().values),
        "lsm": (ds.lsm.mean().values, ds.lsm.std().values),
    }  # fmt: skip
    np.testing.assert_allclose(stats.mean["t"], moments["t"][0], rtol=1e-12)
    np.testing.assert_allclose(stats.std["t"], moments["t"][1], rtol=1e-9)

    def standardised(name: str, values: Any) -> np.ndarray:
        mean, std = moments[name]
        values = np.asarray(values, dtype=np.float64)
        shape = (-1, 1, 1) if np.ndim(mean) else ()
        return (values - np.reshape(mean, shape)) / np.reshape(std, shape)

    out = []
    with _build(root, manifest, stats) as pipe:
        loader = Loader(pipe)
        for _ in range(2):
            for batch in loader:
                assert list(batch.channels["x"]) == [
                    "t@850",
                    "t@500",
                    "2t",
                    "lsm",
                    "cos_solar_zenith",
                ]
                for row, steps in enumerate(np.asarray(batch.sample_indices["x"])):
                    for s, step in enumerate(steps):
                        want = np.concatenate([
                            standardised("t", ds.t.isel(time=int(step)).sel(level=LEVELS)),
                            standardised("2t", ds["2t"].isel(time=int(step)))[None],
                            standardised("lsm", ds.lsm)[None],
                        ])  # fmt: skip
                        got = batch["x"][row, s, :4]
                        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
                    anchor = int(steps[-1])
                    ahead = standardised("2t", ds["2t"].isel(time=[anchor + 1, anchor + 2]))
                    np.testing.assert_allclose(batch["y"][row, :, 0], ahead, rtol=0, atol=1e-5)
                out.append(_record(batch))
    return out


@pytest.mark.parametrize(
    "options",
    [{}, {"prefetch_depth": 5, "max_inflight": 2, "cache_budget_bytes": 30_000}, {"cache": True}],
    ids=["same", "other-prefetch-and-budget", "persistent-cache"],
)
def test_a_stack_pipeline_resumed_after_any_batch_goes_on_bit_identically(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    stats_file: Path,
    reference: list[tuple[int, int, str]],
    tmp_path: Path,
    options: dict[str, Any],
) -> None:
    root, _ = era5
    per_epoch = len(reference) // 2
    g = open_geometries(root)  # statistics fitted here, and read back from JSON to resume
    fitted = fit_statistics(root, manifest, {"t": g["t"].sel(level=LEVELS), "2t": g["2t"],
                                             "lsm": g["lsm"]})  # fmt: skip
    if options.pop("cache", False):
        options = {"cache_dir": tmp_path / "cache", "persist": True}
    for k in (1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 2):
        with _build(root, manifest, fitted, **options) as pipe:  # the run that saves
            loader = Loader(pipe)
            got: list[tuple[int, int, str]] = []
            it = iter(loader)
            while len(got) < k:
                try:
                    got.append(_record(next(it)))
                except StopIteration:
                    it = iter(loader)
            state = json.loads(json.dumps(loader.state_dict()))
        assert got == reference[:k]
        # a fresh pipeline, statistics read back from JSON: the rest of the two epochs
        with _build(root, manifest, Statistics.load(stats_file), **options) as pipe:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            rest = [_record(b) for _ in range(2) for b in loader]
        assert rest[: len(reference) - k] == reference[k:], k


def _run(
    root: Path,
    manifest: SplitManifest,
    stats: Statistics,
    world: int,
    rank: int,
    *,
    state: dict[str, Any] | None = None,
    stop: int | None = None,
) -> tuple[list[list[int]], dict[str, str], dict[str, Any], int]:
    """Rank ``rank`` of ``world`` for one epoch (or ``stop`` batches): the rows of each batch,
    a digest of each row's values, the state at the end and ``len()`` at the start."""
    with _build(root, manifest, stats, rank=rank, world_size=world) as pipe:
        loader = Loader(pipe)
        if state is not None:
            loader.load_state_dict(state)
        rows: list[list[int]] = []
        values: dict[str, str] = {}
        it = iter(loader)
        length = len(loader)
        for batch in it:
            rows.append(_keys(batch))
            for i, key in enumerate(rows[-1]):
                values[str(key)] = hashlib.sha256(
                    batch["x"][i].tobytes() + batch["y"][i].tobytes()
                ).hexdigest()
            if len(rows) == stop:
                break
        return rows, values, json.loads(json.dumps(loader.state_dict())), length


def test_ranks_over_stacks_share_the_one_process_epoch_and_resume_on_other_rank_counts(
    era5: tuple[Path, xr.Dataset], manifest: SplitManifest, stats_file: Path
) -> None:
    root, _ = era5
    stats = Statistics.load(stats_file)
    one, values, _, _ = _run(root, manifest, stats, 1, 0)
    epoch = [k for batch in one for k in batch]
    for world in (2, 3):
        ranks = [_run(root, manifest, stats, world, r) for r in range(world)]
        assert len({len(rows) for rows, *_ in ranks}) == 1  # equal batch counts
        seen = Counter(k for rows, *_ in ranks for batch in rows for k in batch)
        assert max(seen.values()) == 1 and set(seen) <= set(epoch)
        assert len(set(epoch) - set(seen)) < world
        for _, v, *_ in ranks:  # each row valued as one rank values it
            assert all(values[k] == digest for k, digest in v.items())
        # cut after one batch, resumed on another number of ranks
        cut = [_run(root, manifest, stats, world, r, stop=1) for r in range(world)]
        before = [k for rows, *_ in cut for batch in rows for k in batch]
        for new in {1, 2, 3} - {world}:
            rest = [_run(root, manifest, stats, new, r, state=cut[0][2]) for r in range(new)]
            assert len({len(rows) for rows, *_ in rest}) == 1
            assert {length for *_, length in rest} == {1 + len(rest[0][0])}
            after = [k for rows, *_ in rest for batch in rows for k in batch]
            both = Counter(before + after)
            assert max(both.values()) == 1, (world, new)
            assert set(both) <= set(epoch) and len(set(epoch) - set(both)) < world + new
            for _, v, *_ in rest:
                assert all(values[k] == digest for k, digest in v.items())


def _item(batch: Batch) -> dict[str, Any]:
    """A training step's input: the stacks as tensors, where the batch sits in the epoch, and a
    digest of everything it delivers (what the uninterrupted run is compared on)."""
    import torch

    return {
        "x": torch.from_numpy(np.ascontiguousarray(batch["x"])),
        "at": (batch.epoch, batch.index),
        "digest": _record(batch)[2],
    }


@pytest.mark.slow
def test_a_data_module_over_stacks_has_exact_lengths_and_resumes_without_skipping_a_batch(
    era5: tuple[Path, xr.Dataset],
    manifest: SplitManifest,
    stats_file: Path,
    reference: list[tuple[int, int, str]],
    tmp_path: Path,
) -> None:
    import lightning as L
    import torch
    from lightning_parts import SaveAt, trainer

    from insitubatch_nodes import PlanConfig
    from insitubatch_nodes.lightning import InSituDataModule

    root, _ = era5

    class Steps(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.steps: list[tuple[int, int, str]] = []

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            self.steps.append((*batch["at"], batch["digest"]))
            return self.layer(batch["x"].mean().reshape(1, 1)).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def module(batch_size: int = 3) -> InSituDataModule:
        config = PlanConfig(batch_size=batch_size, block_chunks=2, seed=7)
        views = _views(root, Statistics.load(stats_file))
        return InSituDataModule(
            str(root), views, manifest, config=config, transform=_item, log_report=False
        )

    per_epoch = len(reference) // 2
    dm = module()
    assert len(dm.train_dataloader()) == per_epoch
    stop, ckpt, end = per_epoch // 2, tmp_path / "mid.ckpt", tmp_path / "end.ckpt"
    first = Steps()
    saves = [SaveAt(stop, ckpt), SaveAt(per_epoch, end)]
    trainer(tmp_path, max_epochs=1, callbacks=saves).fit(first, datamodule=dm)
    assert first.steps == reference[:per_epoch]
    resumed = Steps()
    trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=module(), ckpt_path=ckpt)
    assert resumed.steps == reference[stop:]
    # from the checkpoint at the epoch's end, with a larger batch size: the next epoch as a
    # run with that batch size trains it
    with _build(root, manifest, Statistics.load(stats_file), batch_size=4) as pipe:
        loader = Loader(pipe)
        want = [[_record(b) for b in loader] for _ in range(2)][1]
    larger = Steps()
    trainer(tmp_path, max_epochs=2).fit(larger, datamodule=module(4), ckpt_path=end)
    assert larger.steps == want
