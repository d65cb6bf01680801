"""Real multi-process runs on the gloo backend.

1. 2 and 3 ranks (processes forked at once from the tests' fork server, as
   ``torch.multiprocessing.spawn`` would start them, without a new interpreter): each rank builds
   ``insitu_pipeline(..., rank=None, world_size=None)`` (rank and world size from
   ``torch.distributed``) and reads two epochs, with an ``all_reduce`` per batch. Per epoch the
   ranks' samples are disjoint, they yield the same number of batches, at most
   ``world - 1`` valid samples sit out, and only the tail chunks cut between ranks are fetched
   by two of them.
2. Lightning ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` (its launcher re-runs
   the script for rank 1): a run killed after a mid-epoch checkpoint and resumed trains, on
   both ranks, on exactly the batches an uninterrupted run trains on; the uninterrupted run's
   validation evaluates every val sample once, rank 0 running one batch more than rank 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from resume_helpers import (
    comparable,
    ddp_worker,
    lightning_request,
    pipe_config,
    read_records,
    run_lightning,
    run_lightnings_side_by_side,
    spawn_ranks,
    write_store,
)

pytestmark = pytest.mark.slow

WORLD = 2
SPC = 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("n_time", "windowed"),
    [(200, False), (196, False), (200, True)],
    ids=["25-full-chunks", "24-full-chunks-and-a-partial-one", "windowed-x-and-y=x.shift(1)"],
)
def test_gloo_ranks_deliver_all_but_world_minus_one_samples_in_equal_batch_counts(
    tmp_path: Path, n_time: int, windowed: bool, world: int
) -> None:
    store = write_store(tmp_path / "era5.zarr", n_time=n_time, variables=("t2m",))
    cfg = pipe_config(
        store, windowed=windowed, fractions=[1.0, 0.0, 0.0], batch_size=7, block_chunks=3
    )
    epochs = 2
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    spawn_ranks(
        ddp_worker,
        args=(world, str(tmp_path / "init"), cfg, epochs, str(tmp_path / "rank{}.json")),
        nprocs=world,
        workdir=tmp_path / "ranks",
    )
    results = [json.loads(Path(str(o)).read_text()) for o in outs]
    assert [r["rank"] for r in results] == list(range(world))
    assert {r["world_size"] for r in results} == {world}

    # what the manifest says (no package code): an anchor is valid when every view's sample
    # (anchor + offset) lies in the array; each rank emits floor(valid / world) of them
    n_valid = n_time - (1 if windowed else 0)
    n_emit = n_valid // world
    for e in range(epochs):
        per = [r["epochs"][e] for r in results]
        samples = [set(p["samples"]) for p in per]
        for p, s in zip(per, samples, strict=True):
            assert len(p["samples"]) == len(s) == n_emit, "a rank repeated or lost a sample"
        union = set().union(*samples)
        assert sum(len(s) for s in samples) == len(union), "ranks share samples"
        assert union <= set(range(n_valid))
        assert n_valid - len(union) <= world - 1
        # the all_reduce per batch never waited on a rank that ran out: equal batch counts
        assert {p["n_batches"] for p in per} == {-(-n_emit // cfg["batch_size"])}
        assert all(p["min_batches"] == p["max_batches"] == p["n_batches"] for p in per)
        gets = [set(p["gets"]) for p in per]
        readers: dict[str, int] = {}
        for g in gets:
            for k in g:
                readers[k] = readers.get(k, 0) + 1
        extra = sum(n - 1 for n in readers.values())
        if not windowed:
            # only the tail chunks cut between ranks are read twice: at most world - 1 more
            assert extra <= world - 1
        else:
            # y = x.shift(1): the last anchor of a chunk also reads the next chunk
            anchor_chunks = [{i // SPC for i in s} for s in samples]
            for rank in range(world):
                mine = {int(k.split("/")[2]) for k in gets[rank]}
                assert mine <= anchor_chunks[rank] | {c + 1 for c in anchor_chunks[rank]}


def _ddp_rows(out: Path) -> list[list[tuple]]:
    return [comparable(read_records(out, rank=r)) for r in range(WORLD)]


@pytest.mark.timeout(400)
def test_lightning_ddp_resumes_a_killed_run_exactly_on_both_ranks(tmp_path: Path) -> None:
    store = write_store(tmp_path / "era5.zarr")
    ddp = {"devices": WORLD, "strategy": "ddp"}
    n_batches = 5  # 12 train chunks -> 6 per rank -> 48 samples -> 5 batches of 10
    kill_at = 3

    # the reference also validates: 15 val anchors (96..110) as 8 + 7 in batches of 7, so rank
    # 0 runs 2 validation batches and rank 1 one (remainder="uneven")
    ref_req = lightning_request(
        store, tmp_path / "ref", tmp_path / "ref-ckpt", eval_batch_size=7, limit_val_batches=1.0,
        **ddp,
    )  # fmt: skip
    kill_req = lightning_request(
        store,
        tmp_path / "killed",
        tmp_path / "ckpt",
        every_n_train_steps=kill_at,
        kill_at_step=kill_at,
        **ddp,
    )
    # the reference and the run to be killed share nothing but the store: side by side
    (rc, log), (kill_rc, kill_log) = run_lightnings_side_by_side(
        [(ref_req, tmp_path / "ref-run"), (kill_req, tmp_path / "killed-run")]
    )
    assert rc == 0, log[-6000:]
    reference = _ddp_rows(tmp_path / "ref")
    for rows in reference:
        assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
            (e, i, e, i) for e in range(2) for i in range(n_batches)
        ]
    idx = [{i for row in rows[:n_batches] for i in row[5]} for rows in reference]
    assert not idx[0] & idx[1], "the two ranks trained on shared samples"
    val = [read_records(tmp_path / "ref", rank=r, kind="val") for r in range(WORLD)]
    assert [len(rows) for rows in val] == [2 * 2, 2 * 1]  # two epochs' validations
    for epoch in range(2):
        rows = [i for rank in val for r in rank if r["epoch"] == epoch for i in r["idx"]]
        assert sorted(rows) == list(range(96, 111)), "not every val sample evaluated once"

    assert kill_rc == -9, f"exit code {kill_rc}\n{kill_log[-6000:]}"
    ckpt = tmp_path / "ckpt" / f"step={kill_at}.ckpt"
    assert ckpt.exists(), kill_log[-6000:]

    resume_req = lightning_request(
        store, tmp_path / "resumed", tmp_path / "ckpt2", ckpt_path=str(ckpt), **ddp
    )
    rc, log = run_lightning(resume_req, tmp_path / "resumed-run")
    assert rc == 0, log[-6000:]
    before, after = _ddp_rows(tmp_path / "killed"), _ddp_rows(tmp_path / "resumed")
    for rank in range(WORLD):
        assert before[rank] == reference[rank][:kill_at], f"rank {rank}"
        assert after[rank] == reference[rank][kill_at:], f"rank {rank}"
    assert np.array_equal([len(r) for r in after], [2 * n_batches - kill_at] * WORLD), (
        "ranks resumed with different numbers of batches"
    )
