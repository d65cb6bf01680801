"""``remainder="uneven"``: every valid sample of a val/test epoch delivered exactly once over the
ranks, the first ``V % W`` ranks one sample more (their batch counts may differ by one).

Found by a Lightning trial: ``InSituDataModule``'s validation under DDP inherited training's
``"drop"``, so up to ``world_size - 1`` samples were never evaluated (2 ranks, 15 samples: 14
evaluated, the same one missing every time). The oracles: zarr's read of the store, and
arithmetic on which anchors of the split are valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import ArrayGeometry, Loader, open_geometries, split_by_chunk
from insitubatch_nodes.pipeline import insitu_pipeline
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import dealing_for, plan_epoch
from insitubatch_nodes.plan.ranks import deal, deal_runs
from insitubatch_nodes.plan.schedule import schedule_floors, working_set_bytes
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.stages.read_plan import ReadPlanNode

N_TIME = 61


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t (61, 2)`` in chunks of 4 steps and ``u``, the same values in chunks of one."""
    path = tmp_path_factory.mktemp("uneven") / "a.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    values = np.random.default_rng(0).standard_normal((N_TIME, 2))
    for name, spc in (("t", 4), ("u", 1)):
        arr = group.create_array(name, shape=(N_TIME, 2), chunks=(spc, 2), dtype="f8")
        arr[...] = values
    return path


@pytest.fixture(scope="module")
def geoms(store: Path) -> dict[str, ArrayGeometry]:
    return open_geometries(store, ["t", "u"])


def _valid(
    manifest: SplitManifest,
    offsets: tuple[int, ...],
    stride: int = 1,
    missing: tuple[int, ...] = (),
    split: str = "val",
) -> list[int]:
    """The split's valid anchors by arithmetic: every step in the split's chunks, on the
    stride, none missing."""
    spc = manifest.samples_per_chunk
    inside = {s for c in manifest.chunk_array(split) for s in range(c * spc, (c + 1) * spc)}
    inside &= set(range(N_TIME))
    return sorted(
        a for a in inside
        if a % stride == 0 and all(a + k in inside and a + k not in missing for k in offsets)
    )  # fmt: skip


def _config(**kw: Any) -> PlanConfig:
    settings = {"split": "val", "batch_size": 3, "block_chunks": 2, "seed": 5}
    return PlanConfig(**{**settings, "remainder": "uneven", **kw})


def test_an_uneven_plan_delivers_every_valid_sample_once_over_the_ranks_as_zarr_reads_it(
    store: Path, geoms: dict[str, ArrayGeometry]
) -> None:
    """Chunks of 4 steps and of one, a plain view (dealt in chunks) and a window (dealt in
    runs), a stride, missing steps; shuffled or not; 2 and 3 ranks. Each rank delivers its
    ``V // W`` samples, one more on the first ``V % W`` ranks, each row as zarr reads it; its
    ``len()`` is its batches; the ranks' rows together are the split's valid anchors, each
    once."""
    oracle = np.asarray(zarr.open_array(store / "t", mode="r")[...])
    cases: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
        ("t", (0,), {}),
        ("u", (0,), {}),
        ("t", (0, 1), {}),
        ("u", (-1, 0, 1), {}),
        ("t", (0, 1), {"stride": 2, "missing": [14, 27]}),
        ("u", (0,), {"missing": [20, 21, 22]}),
    ]
    for i, (name, offsets, extra) in enumerate(cases):
        g = geoms[name]
        manifest = split_by_chunk(g, (0.2, 0.6, 0.2))
        views = {f"v{k:+d}": g.shift(k) for k in offsets}
        valid = _valid(manifest, offsets, extra.get("stride", 1), tuple(extra.get("missing", ())))
        for shuffle in (False, True):
            world = 2 + (i + shuffle) % 2
            base = _config(shuffle=shuffle, stride=extra.get("stride", 1), world_size=world)
            seen: list[int] = []
            for rank in range(world):
                with insitu_pipeline(
                    store, manifest, views, config=base.replace(rank=rank),
                    missing=extra.get("missing"), prefetch_depth=1,
                ) as pipe:  # fmt: skip
                    want = "runs" if len(offsets) > 1 else "chunks"
                    assert dealing_for(pipe.stages.plan.views) == want
                    loader = Loader(pipe)
                    n_batches = len(loader)
                    batches = list(loader)
                rows = [int(a) for b in batches for a in b.sample_indices["v+0"]]
                share = len(valid) // world + (rank < len(valid) % world)
                where = (name, offsets, extra, shuffle, world, rank)
                assert len(rows) == share and n_batches == len(batches), where
                for b in batches:
                    for k in offsets:
                        idx = np.asarray(b.sample_indices["v+0"]) + k
                        np.testing.assert_array_equal(b[f"v{k:+d}"], oracle[idx], str(where))
                seen.extend(rows)
            assert sorted(seen) == valid, (name, offsets, extra, shuffle, world)


def test_both_dealings_give_the_first_ranks_one_sample_more_whole_chunks_first() -> None:
    """``deal`` and ``deal_runs`` with ``"uneven"``: every sample of every group once, rank
    ``r`` ``V // W + (r < V % W)`` of them, whole groups then at most two partial pieces (the
    ledger shape the schedule bounds rely on)."""
    rng = np.random.default_rng(1)
    for trial in range(60):
        counts = rng.integers(0, 7, size=int(rng.integers(1, 25)))
        total = int(counts.sum())
        for world in range(2, 6):
            if total < world:
                continue
            draw = np.random.default_rng(trial) if trial % 2 else None
            axis = rng.permutation(len(counts))
            for runs, pieces in enumerate(
                (
                    deal(counts, world, remainder="uneven"),
                    deal_runs(counts, axis, world, remainder="uneven", rng=draw),
                )
            ):
                seen = []
                for rank, (group, lo, n) in enumerate(pieces):
                    assert int(n.sum()) == total // world + (rank < total % world)
                    partial = (n < counts[group]).tolist()
                    if runs and draw is None and np.all(np.diff(axis[group]) > 0):
                        assert not any(partial[1:-1])  # unshuffled: the run in axis order
                    else:
                        first = partial.index(True) if True in partial else len(partial)
                        assert all(partial[first:]) and len(partial) - first <= 2
                    seen.extend((int(g), j) for g, a, k in zip(group, lo, n, strict=True)
                                for j in range(a, a + k))  # fmt: skip
                assert sorted(seen) == [(g, j) for g in range(len(counts))
                                        for j in range(counts[g])]  # fmt: skip


def _deliver(node: ReadPlanNode, k: int | None = None) -> list[int]:
    out: list[int] = []
    for _ in range(len(node)) if k is None else range(k):
        try:
            out.extend(int(a) for a in node.next().anchors)
        except StopIteration:
            break
    return out


def test_an_uneven_epoch_resumed_mid_epoch_on_the_same_or_another_world_size_is_exact(
    geoms: dict[str, ArrayGeometry],
) -> None:
    """3 ranks deliver ``k`` batches each (all their own where they have fewer); rank 0's
    state resumes on 3 ranks (the same world) and on 2 (elastic): every valid sample of the
    epoch is delivered exactly once in all, for a plain view and a window, ``k`` inside
    every rank's epoch and at the last batch of rank 0's (one more than the others')."""
    for name, offsets, batch_size in (("t", (0,), 2), ("u", (-1, 0, 1), 3)):
        g = geoms[name]
        manifest = split_by_chunk(g, (0.3, 0.5, 0.2))
        views = {f"v{k:+d}": g.shift(k) for k in offsets}
        valid = _valid(manifest, offsets)

        def node(rank: int, world: int) -> ReadPlanNode:
            config = _config(batch_size=batch_size, rank=rank, world_size=world)  # noqa: B023
            return ReadPlanNode(manifest, views, config=config)  # noqa: B023

        longest = len(node(0, 3))  # 32 samples, 11 11 10 in batches of 2; 29: 10 10 9 in 3
        assert [len(node(r, 3)) for r in range(3)] == [longest, longest, longest - 1]
        for k in (2, longest - 1, longest):
            for world in (3, 2):
                first = [node(r, 3) for r in range(3)]
                seen = []
                for n in first:
                    n.reset(None)
                    seen.extend(_deliver(n, k))
                state = first[0].get_state()
                for rank in range(world):
                    again = node(rank, world)
                    again.reset(state)
                    if again.epoch == 0:  # (a rank whose epoch was over starts the next)
                        seen.extend(_deliver(again))
                    else:
                        done = k >= len(node(rank, 3)) if world == 3 else k == longest
                        assert done, (name, k, world, rank)
                assert sorted(seen) == valid, (name, k, world)


def test_the_schedule_floors_bound_every_rank_of_an_uneven_plan(
    geoms: dict[str, ArrayGeometry],
) -> None:
    for name, offsets in (("t", (0,)), ("u", (-1, 0, 1))):
        g = geoms[name]
        manifest = split_by_chunk(g, (0.2, 0.6, 0.2))
        views = {f"v{k:+d}": g.shift(k) for k in offsets}
        for world in (2, 3, 4):
            config = _config(batch_size=3, block_chunks=2, world_size=world)
            floors = schedule_floors(manifest, views, config)
            for rank in range(world):
                for gap, bound in ((None, floors.read_once), (floors.pin_gap, floors.bounded)):
                    cfg = config.for_rank(rank, world)
                    plan = plan_epoch(manifest, views, cfg, epoch=1, pin_gap=gap)
                    assert working_set_bytes(plan, {g.path: g})[0] <= bound


def test_uneven_is_refused_for_the_training_split_naming_drop_and_pad(
    store: Path, geoms: dict[str, ArrayGeometry]
) -> None:
    """The rank with one batch more would wait forever in DDP's gradient sync."""
    manifest = split_by_chunk(geoms["t"], (0.5, 0.5, 0.0))
    refused = r"remainder='uneven' is for evaluation.*'drop'.*'pad'"
    with pytest.raises(ValueError, match=refused):
        PlanConfig(remainder="uneven")
    with pytest.raises(ValueError, match=refused):
        _config().replace(split="train")
    with pytest.raises(ValueError, match=refused):
        insitu_pipeline(store, manifest, ["t"], remainder="uneven", world_size=2, rank=0)
    with insitu_pipeline(store, manifest, ["t"], split="test", remainder="uneven") as pipe:
        assert pipe.stages.plan.remainder == "uneven"
    # a state of another remainder policy is another plan
    drop = ReadPlanNode(manifest, {"t": geoms["t"]}, config=_config(remainder="drop"))
    uneven = ReadPlanNode(manifest, {"t": geoms["t"]}, config=_config())
    drop.reset(None)
    drop.next()
    with pytest.raises(ValueError, match="remainder differs"):
        uneven.reset(drop.get_state())


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_data_modules_validation_on_two_ranks_evaluates_every_sample_exactly_once(
    store: Path, geoms: dict[str, ArrayGeometry]
) -> None:
    """Its validation and test pipelines inherited training's ``"drop"``: on 2 ranks, one of
    the split's odd number of samples was never evaluated. Training keeps its policy (equal
    batch counts, for the gradient sync)."""
    L = pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    oracle = np.asarray(zarr.open_array(store / "t", mode="r")[...])
    g = geoms["t"]
    manifest = split_by_chunk(g, (0.5, 0.25, 0.25))
    valid = {s: _valid(manifest, (0, 1), split=s) for s in ("val", "test")}
    assert len(valid["val"]) == 15  # as in the trial: 14 evaluated under "drop"
    seen: dict[str, list[int]] = {"val": [], "test": []}
    for rank in range(2):
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.strategy.cluster_environment.set_global_rank(rank)  # (as DDP's launch does)
        dm = InSituDataModule(
            str(store), {"x": g, "y": g.shift(1)}, manifest, log_report=False,
            config=PlanConfig(batch_size=4, block_chunks=2, seed=3), transform=lambda b: b,
        )  # fmt: skip
        dm.trainer = trainer
        try:
            assert dm.train_dataloader().pipeline.stages.plan.remainder == "drop"
            for split, loader in (("val", dm.val_dataloader()), ("test", dm.test_dataloader())):
                batches = list(loader)
                assert len(loader) == len(batches)
                for b in batches:
                    idx = np.asarray(b.sample_indices["x"])
                    np.testing.assert_array_equal(b["x"], oracle[idx])
                    np.testing.assert_array_equal(b["y"], oracle[idx + 1])
                    seen[split].extend(idx.tolist())
        finally:
            dm.teardown()
    for split, rows in seen.items():
        assert sorted(rows) == valid[split], split
