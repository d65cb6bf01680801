"""Elastic resume: a state saved under ``W`` ranks restores under ``W' != W``.

The claims, for the interrupted epoch, over the old ranks' delivered batches and the new
ranks' remainder together: no sample is delivered twice (``remainder="drop"``), at most
``W' - 1`` valid samples sit out, the new ranks yield equal batch counts, and the epochs after
it are those of a run that started with ``W'``. Checked first on the read plan over every
cut point, then through ``Loader`` and ``StatefulDataLoader`` in fresh processes (arrays
against zarr's own read), then with a Lightning checkpoint saved on 2 gloo ranks and resumed
on 1 and on 3.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from helpers import plan_anchors
from resume_helpers import (
    comparable,
    digest,
    is_plain,
    lightning_request,
    pipe_config,
    read_records,
    reference_run,
    run_fresh,
    run_lightning,
    take_state,
    write_store,
)

from insitubatch_nodes import ArrayGeometry, SplitManifest, open_geometries, split_by_chunk
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.schedule import schedule_floors, working_set_bytes
from insitubatch_nodes.stages.read_plan import ReadPlanNode

N_TIME, SPC, SHIFT, BATCH, BLOCK = 203, 8, 2, 7, 3
VALID = set(range(N_TIME - SHIFT))
# (old world, new world): shrink, grow, to and from one rank, coprime sizes
WORLD_PAIRS = [(2, 1), (2, 3), (3, 2), (1, 4), (4, 3), (5, 2), (1, 2), (8, 3)]


@pytest.fixture(scope="module")
def geom(tmp_path_factory: pytest.TempPathFactory) -> ArrayGeometry:
    path = tmp_path_factory.mktemp("elastic") / "a.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t", shape=(N_TIME, 3), chunks=(SPC, 3), dtype="f8", fill_value=0)
    return open_geometries(path, ["t"])["t"]


@pytest.fixture(scope="module")
def manifest(geom: ArrayGeometry) -> SplitManifest:
    return split_by_chunk(geom, (1.0, 0.0, 0.0))


def _node(manifest: SplitManifest, geom: ArrayGeometry, rank: int, world: int, **kw: Any):
    views = {"x": geom, "y": geom.shift(SHIFT)}
    config = PlanConfig(
        batch_size=BATCH, block_chunks=BLOCK, seed=3, rank=rank, world_size=world, **kw
    )
    return ReadPlanNode(manifest, views, config=config)


def _deliver(node: ReadPlanNode, k: int | None = None) -> list[list[int]]:
    """Anchors of the next ``k`` batches (all the epoch's remaining ones when ``None``)."""
    return plan_anchors(node, k)


def _cut(manifest, geom, world: int, k: int, **kw: Any) -> tuple[list[int], dict[str, Any]]:
    """Every rank of ``world`` delivers ``k`` batches of epoch 0; rank 0's state is saved."""
    nodes = [_node(manifest, geom, r, world, **kw) for r in range(world)]
    got: list[int] = []
    for n in nodes:
        n.reset(None)
        got.extend(a for batch in _deliver(n, k) for a in batch)
    return got, nodes[0].get_state()


@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize(("old", "new"), WORLD_PAIRS, ids=[f"{a}to{b}" for a, b in WORLD_PAIRS])
def test_an_epoch_cut_on_w_ranks_ends_on_w_prime_ranks_with_no_sample_twice_and_few_left_out(
    manifest: SplitManifest, geom: ArrayGeometry, old: int, new: int, remainder: str
) -> None:
    n_old = len(_node(manifest, geom, 0, old, remainder=remainder))
    for k in sorted({1, 2, n_old // 2, n_old - 1}):
        before, state = _cut(manifest, geom, old, k, remainder=remainder)
        assert json.loads(json.dumps(state)) == state and is_plain(state)
        after: list[int] = []
        lengths, counts = set(), set()
        for r in range(new):
            node = _node(manifest, geom, r, new, remainder=remainder)
            told = node.resumed_len(state)
            node.reset(state)
            assert len(node) == told
            batches = _deliver(node)
            assert node.epoch == 0
            lengths.add(told)
            counts.add(len(batches))
            after.extend(a for b in batches for a in b)
        # equal batch counts, numbered on from the cut
        assert len(counts) == 1 and lengths == {k + counts.pop()}
        seen = before + after
        if remainder == "drop":
            assert len(seen) == len(set(seen)), f"k={k}: a sample was delivered twice"
            assert len(VALID - set(seen)) <= new - 1, f"k={k}"
        else:  # padding repeats at most W - 1 samples before the cut and W' - 1 after it
            assert set(seen) == VALID
            assert len(seen) - len(set(seen)) <= (old - 1) + (new - 1)
        assert set(seen) <= VALID


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2)])
def test_the_epochs_after_an_elastic_resume_are_those_of_a_run_started_on_the_new_world_size(
    manifest: SplitManifest, geom: ArrayGeometry, old: int, new: int
) -> None:
    _, state = _cut(manifest, geom, old, 3)
    for r in range(new):
        resumed = _node(manifest, geom, r, new)
        resumed.reset(state)
        _deliver(resumed)
        fresh = _node(manifest, geom, r, new)
        for epoch in (1, 2):
            resumed.reset(None)
            fresh.set_epoch(epoch)
            fresh.reset(None)
            assert resumed.epoch == epoch
            assert len(resumed) == len(fresh)
            assert _deliver(resumed) == _deliver(fresh)


def test_an_epoch_cut_twice_on_three_world_sizes_still_delivers_each_sample_once(
    manifest: SplitManifest, geom: ArrayGeometry
) -> None:
    before, state = _cut(manifest, geom, 2, 4)
    middle: list[int] = []
    # three ranks carry on for two more batches each; rank 0's state is saved again
    nodes = [_node(manifest, geom, r, 3) for r in range(3)]
    for n in nodes:
        n.reset(state)
        middle.extend(a for b in _deliver(n, 2) for a in b)
    again = nodes[0].get_state()
    assert again["resumed"] == [[2, 4]] and again["batches_emitted"] == 6
    assert torch.load(_saved(again), weights_only=True) == again
    # a fresh 3-rank node restored from it continues exactly where rank 0 was
    same = _node(manifest, geom, 0, 3)
    same.reset(again)
    assert _deliver(same) == _deliver(nodes[0])
    # and one rank takes the rest of the epoch
    last = _node(manifest, geom, 0, 1)
    last.reset(again)
    after = [a for b in _deliver(last) for a in b]
    seen = before + middle + after
    assert len(seen) == len(set(seen)) and set(seen) == VALID  # one rank: nothing sits out


def _saved(state: dict[str, Any]) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_a_state_saved_at_an_epoch_end_or_before_any_batch_starts_a_plain_epoch_on_the_new_world(
    manifest: SplitManifest, geom: ArrayGeometry
) -> None:
    n_old = len(_node(manifest, geom, 0, 2))
    _, at_end = _cut(manifest, geom, 2, n_old)
    _, at_start = _cut(manifest, geom, 2, 0)
    for state, epoch in ((at_end, 1), (at_start, 0)):
        node = _node(manifest, geom, 1, 3)
        node.reset(state)
        fresh = _node(manifest, geom, 1, 3)
        fresh.set_epoch(epoch)
        fresh.reset(None)
        assert (node.epoch, len(node)) == (epoch, len(fresh))
        assert "resumed" not in node.get_state()
        assert _deliver(node) == _deliver(fresh)


def test_a_state_from_another_seed_batch_size_or_dataset_still_raises_naming_the_field(
    manifest: SplitManifest, geom: ArrayGeometry
) -> None:
    _, state = _cut(manifest, geom, 2, 3)
    node = _node(manifest, geom, 0, 3)
    for key, value, field in (
        ("seed", 4, "seed"),
        ("batch_size", 8, "batch_size"),
        ("dataset", "0" * 16, "dataset"),
        ("remainder", "pad", "remainder"),
    ):
        bad = {**state, "config": {**state["config"], key: value}}
        if key == "dataset":  # another dataset draws other anchors too (the same: it resumes)
            bad["anchors"] = "1" * 16
        with pytest.raises(ValueError, match=rf"its {field}\b.*differs"):
            node.reset(bad)
    for cuts in ([[2, 9]], [[0, 1]], [[2, 2], [3, 2]], "x"):
        with pytest.raises(ValueError, match="resumed"):
            node.reset({**state, "resumed": cuts})


def test_an_elastic_remainder_stays_within_the_schedule_bounds_of_a_fresh_epoch(
    tmp_path: Path,
) -> None:
    # 150 chunks, windows reaching 2 and 9 samples on: the remainder of an epoch (chunks with
    # a few samples left) must fit the memory the pipeline budgets for every epoch
    path = tmp_path / "b.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t", shape=(1203, 3), chunks=(SPC, 3), dtype="f8", fill_value=0)
    g = open_geometries(path, ["t"])["t"]
    m = split_by_chunk(g, (1.0, 0.0, 0.0))
    for shift in (2, 9):
        views = {"x": g, "y": g.shift(shift)}
        for bs, bc in ((7, 3), (16, 4), (5, 8)):
            for old, new in ((2, 1), (2, 3), (8, 3), (1, 4)):
                config = PlanConfig(batch_size=bs, block_chunks=bc, world_size=new)
                floors = schedule_floors(m, views, config)
                n = plan_epoch(m, views, config.replace(world_size=old)).n_batches
                for k in (1, n // 3, n - 1):
                    for gap, bound in ((None, floors.read_once), (floors.pin_gap, floors.bounded)):
                        plan = plan_epoch(m, views, config, pin_gap=gap, resumed=[(old, k)])
                        assert working_set_bytes(plan, {"t": g})[0] <= bound, (shift, bs, old, k)


# -- through the loaders, in fresh processes, arrays against zarr's own read ---------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("elastic-store") / "era5.zarr")


def _check_against_zarr(store: Path, records: list[dict]) -> None:
    full = np.asarray(zarr.open_group(store, mode="r")["t2m"][...])
    for rec in records:
        for label, idx in rec["idx"].items():
            assert rec["hash"][label] == digest(full[np.asarray(idx)])


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("mode", ["loader-restore", "sdl-restore"])
def test_a_loader_state_saved_on_two_ranks_resumes_on_another_number_of_ranks_in_a_fresh_process(
    store: Path, tmp_path: Path, new: int, mode: str
) -> None:
    k = 2
    before: list[dict] = []
    state: dict[str, Any] = {}
    for r in range(2):
        got, st = take_state(pipe_config(store, rank=r, world_size=2), k)
        before.extend(got)
        if r == 0:
            state = json.loads(json.dumps(st))
    if mode == "sdl-restore":
        state = _sdl_state(store, k)
    valid = set(range(96 - 1))  # 12 train chunks of 8, windows reach one sample on
    after: list[dict] = []
    later: dict[int, list[dict]] = {}
    counts = set()
    for r in range(new):
        cfg = pipe_config(store, rank=r, world_size=new)
        resp = run_fresh(mode, {"config": cfg, "state": state, "passes": 2}, tmp_path / f"r{r}")
        recs = resp["records"]
        first = [x for x in recs if x["epoch"] == 0]
        assert [x["index"] for x in first] == list(range(k, k + len(first)))
        if mode == "sdl-restore":
            assert resp["len_restored"] == k + len(first)
        counts.add(len(first))
        after.extend(first)
        later[r] = [x for x in recs if x["epoch"] == 1]
        _check_against_zarr(store, recs)
    assert len(counts) == 1, "the new ranks yield different batch counts"
    seen = [i for rec in before + after for i in rec["idx"]["x"]]
    assert len(seen) == len(set(seen)), "a sample was delivered twice in the interrupted epoch"
    assert set(seen) <= valid and len(valid - set(seen)) <= new - 1
    for r in range(new):  # the next epoch: exactly a fresh W' run's
        ref = reference_run(pipe_config(store, rank=r, world_size=new), 2, check_zarr=False)
        want = [{k2: v for k2, v in x.items() if k2 != "state"} for x in ref if x["epoch"] == 1]
        got = [{k2: v for k2, v in x.items() if k2 != "state"} for x in later[r]]
        if mode == "sdl-restore":
            want = [{**w, "idx": {"x": w["idx"]["x"]}} for w in want]
        assert got == want


def _sdl_state(store: Path, k: int) -> dict[str, Any]:
    """A StatefulDataLoader state after ``k`` batches on rank 0 of 2."""
    from resume_helpers import build_pipeline
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes import as_dataset

    pipe = build_pipeline(pipe_config(store, rank=0, world_size=2))
    try:
        dl = StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0)
        it = iter(dl)
        for _ in range(k):
            next(it)
        return json.loads(json.dumps(dl.state_dict()))
    finally:
        pipe.close()


# -- Lightning: a checkpoint of a 2-rank DDP run resumed on 1 and on 3 ranks ------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lightning_checkpoint_saved_on_two_ranks_resumes_on_one_and_on_three(
    store: Path, tmp_path: Path
) -> None:
    kill_at = 2
    kill_req = lightning_request(
        store,
        tmp_path / "killed",
        tmp_path / "ckpt",
        devices=2,
        strategy="ddp",
        every_n_train_steps=kill_at,
        kill_at_step=kill_at,
    )
    rc, log = run_lightning(kill_req, tmp_path / "killed-run")
    assert rc == -9, f"exit code {rc}\n{log[-6000:]}"
    ckpt = tmp_path / "ckpt" / f"step={kill_at}.ckpt"
    assert ckpt.exists(), log[-6000:]
    before = [row for r in range(2) for row in comparable(read_records(tmp_path / "killed", r))]
    assert [row[:2] for row in before] == [(0, 0), (0, 1)] * 2
    valid = set(range(96 - 1))
    for new in (1, 3):
        out = tmp_path / f"resumed{new}"
        req = lightning_request(
            store,
            out,
            tmp_path / f"ckpt{new}",
            ckpt_path=str(ckpt),
            devices=new,
            strategy="ddp" if new > 1 else "auto",
            limit_val_batches=2,
        )
        rc, log = run_lightning(req, tmp_path / f"run{new}")
        assert rc == 0, log[-6000:]
        rows = [comparable(read_records(out, r)) for r in range(new)]
        epoch0 = [[row for row in rr if row[0] == 0] for rr in rows]
        # every new rank trains the same number of batches, numbered on from the cut
        assert len({len(e) for e in epoch0}) == 1, [len(e) for e in epoch0]
        for e in epoch0:
            assert [row[1] for row in e] == list(range(kill_at, kill_at + len(e)))
        seen = [i for row in before + [x for e in epoch0 for x in e] for i in row[5]]
        assert len(seen) == len(set(seen)), f"W'={new}: a sample trained twice in epoch 0"
        assert set(seen) <= valid and len(valid - set(seen)) <= new - 1
        # validation ran at the end of both epochs: Lightning followed each epoch's length
        val = [row[0] for row in comparable(read_records(out, 0, kind="val"))]
        assert sorted(set(val)) == [0, 1], val
        # epoch 1 (a full epoch on W' ranks) is a fresh W' run's epoch 1, with the full length
        for r in range(new):
            got = [row[4:] for row in rows[r] if row[0] == 1]
            ref = reference_run(pipe_config(store, rank=r, world_size=new), 2, check_zarr=False)
            want = [(x["hash"]["x"] + x["hash"]["y"], tuple(x["idx"]["x"])) for x in ref]
            assert got == [w for w, x in zip(want, ref, strict=True) if x["epoch"] == 1]
