"""Checkpoint and resume through ``torchdata.nodes.Loader(pipe)``.

A state is taken after ``k`` delivered batches, written as JSON, and restored into a pipeline
built afresh in a *new process*; what that process delivers must be batch ``k + 1`` of the same
epoch, the rest of that epoch and the whole next epoch, bit for bit (hashes of every array's
bytes) and sample for sample, as in an uninterrupted run. The uninterrupted run's arrays are
checked against zarr's own read.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_helpers import (
    build_pipeline,
    carried_chunks,
    is_plain,
    pipe_config,
    reference_run,
    run_fresh,
    take_state,
    write_store,
)
from torchdata.nodes import Loader

from insitubatch_nodes import InSituPipeline

N_BATCHES = 10  # batches per epoch with the default config (96 samples, batch_size 10)
SPC = 8

_REFERENCES: dict[str, list[dict]] = {}


# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = pytest.mark.xdist_group("resume")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("resume") / "era5.zarr")


def reference(cfg: dict[str, Any], epochs: int = 3) -> list[dict]:
    key = json.dumps([cfg, epochs], sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(cfg, epochs)
    return _REFERENCES[key]


def resume_elsewhere(cfg: dict[str, Any], state: dict[str, Any], tmp_path: Path) -> list[dict]:
    """Restore ``state`` into a pipeline built from ``cfg`` in a new process; two passes of
    the loader (the rest of the epoch, then the next one)."""
    wire = json.loads(json.dumps(state))  # what crosses the process boundary is plain JSON
    assert wire == state
    resp = run_fresh("loader-restore", {"config": cfg, "state": wire, "passes": 2}, tmp_path)
    return resp["records"]


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "state"} for r in records]


def assert_continues(
    before: list[dict], after: list[dict], ref: list[dict], k: int, n: int = N_BATCHES
) -> None:
    """``before`` is ``ref[:k]``; ``after`` is exactly the rest of batch ``k``'s epoch and the
    whole next epoch of ``ref`` (when ``k`` ends an epoch: the next two epochs), and the state
    after each resumed batch is the uninterrupted run's state after that batch (so a resumed
    run can be checkpointed and resumed again)."""
    assert _strip(before) == _strip(ref[:k])
    rest = n - k % n if k % n else 2 * n
    expected = ref[k : k + rest + (n if k % n else 0)]
    assert len(after) == len(expected), (len(after), len(expected))
    assert (after[0]["epoch"], after[0]["index"]) == divmod(k, n)
    for got, want in zip(after, expected, strict=True):
        assert (got["epoch"], got["index"]) == (want["epoch"], want["index"])
        assert got["idx"] == want["idx"], (got["epoch"], got["index"])
        assert got["hash"] == want["hash"], (got["epoch"], got["index"])
        assert got["state"] == want["state"], (got["epoch"], got["index"])


# -- mid-epoch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "no-shuffle"])
@pytest.mark.parametrize("k", [1, 4, 7, 9])
def test_a_state_taken_mid_epoch_resumes_in_a_new_process_with_the_next_batch_then_the_next_epoch(
    store: Path, tmp_path: Path, shuffle: bool, k: int
) -> None:
    cfg = pipe_config(store, shuffle=shuffle)
    ref = reference(cfg)
    before, state = take_state(cfg, k)
    assert_continues(before, resume_elsewhere(cfg, state, tmp_path), ref, k)


def test_a_state_taken_mid_way_through_the_second_epoch_resumes_there(
    store: Path, tmp_path: Path
) -> None:
    cfg = pipe_config(store)
    ref = reference(cfg)
    k = N_BATCHES + 3
    before, state = take_state(cfg, k)
    assert_continues(before, resume_elsewhere(cfg, state, tmp_path), ref, k)


def test_resuming_where_chunks_read_before_the_cut_are_read_again_after_it_refetches_them(
    store: Path, tmp_path: Path
) -> None:
    cfg = pipe_config(store, block_chunks=3, batch_size=10)
    ref = reference(cfg)
    ks = [k for k in range(1, N_BATCHES) if carried_chunks(ref, k, SPC)]
    assert ks, "the layout must make some chunk be read on both sides of a cut"
    k = max(ks, key=lambda k: len(carried_chunks(ref, k, SPC)))
    before, state = take_state(cfg, k)
    assert_continues(before, resume_elsewhere(cfg, state, tmp_path), ref, k)


def test_resuming_at_a_batch_that_straddles_a_block_boundary_delivers_it_whole(
    store: Path, tmp_path: Path
) -> None:
    cfg = pipe_config(store, block_chunks=3, batch_size=10)
    ref = reference(cfg)
    pipe = build_pipeline(cfg)
    try:
        plan = pipe.stages.plan.epoch_plan(0)
        straddling = [i for i in range(1, plan.n_batches) if len(plan.batch(i).blocks) > 1]
    finally:
        pipe.close()
    assert straddling, "batch_size 10 over 24-sample blocks must straddle a boundary"
    k = straddling[-1]
    before, state = take_state(cfg, k)
    assert_continues(before, resume_elsewhere(cfg, state, tmp_path), ref, k)


def test_windowed_labels_resume_with_both_views_bit_identical(store: Path, tmp_path: Path) -> None:
    cfg = pipe_config(store, windowed=True)
    ref = reference(cfg)
    assert all(r["idx"]["y"] == [i + 1 for i in r["idx"]["x"]] for r in ref)
    before, state = take_state(cfg, 5)
    after = resume_elsewhere(cfg, state, tmp_path)
    assert_continues(before, after, ref, 5)
    assert {"x", "y"} == set(after[0]["hash"])


def test_a_single_label_pipeline_resumes_too(store: Path, tmp_path: Path) -> None:
    cfg = pipe_config(store, windowed=False)
    ref = reference(cfg)
    n = len(ref) // 3
    before, state = take_state(cfg, 6)
    assert_continues(before, resume_elsewhere(cfg, state, tmp_path), ref, 6, n)


def test_batches_the_prefetcher_and_fetcher_read_ahead_do_not_count_as_delivered(
    store: Path, tmp_path: Path
) -> None:
    cfg = pipe_config(store, prefetch_depth=3)
    ref = reference(cfg)
    k = 3
    seen: dict[str, Any] = {}

    def probe(pipe: InSituPipeline) -> None:
        seen["planned"] = pipe.stages.plan.state_dict()["batches_emitted"]
        seen["gets"] = pipe.stats()["gets"]

    before, state = take_state(cfg, k, sleep_s=0.5, probe=probe)
    # the look-ahead really ran ahead: plans beyond batch k were pulled and their chunks read
    assert seen["planned"] >= k + 3, seen
    assert seen["gets"] > len({i // SPC for r in ref[:k] for v in r["idx"].values() for i in v})
    assert_continues(before, resume_elsewhere(cfg, state, tmp_path), ref, k)


def test_a_state_taken_before_the_first_batch_resumes_at_the_first_batch(
    store: Path, tmp_path: Path
) -> None:
    cfg = pipe_config(store)
    ref = reference(cfg)
    before, state = take_state(cfg, 0)
    assert before == []
    after = resume_elsewhere(cfg, state, tmp_path)
    assert (after[0]["epoch"], after[0]["index"]) == (0, 0)
    assert_continues(before, after, ref, 0)


def test_io_knobs_that_do_not_change_the_order_may_differ_when_restoring(
    store: Path, tmp_path: Path
) -> None:
    """prefetch depth, GETs in flight, decode threads and the cache budget are not part of
    what the order is a function of: a state restores across them."""
    cfg = pipe_config(store)
    ref = reference(cfg)
    before, state = take_state(cfg, 5)
    other = {
        **cfg,
        "prefetch_depth": 1,
        "max_inflight": 1,
        "decode_threads": 1,
        "cache_budget_bytes": 64 * 2**20,
    }
    assert_continues(before, resume_elsewhere(other, state, tmp_path), ref, 5)


# -- end of epoch ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["after-last-next", "after-for-loop-ended"])
def test_a_state_taken_at_the_end_of_an_epoch_resumes_at_the_start_of_the_next(
    store: Path, tmp_path: Path, how: str
) -> None:
    cfg = pipe_config(store)
    ref = reference(cfg)
    before, state = take_state(cfg, N_BATCHES, exhaust_epoch=how == "after-for-loop-ended")
    after = resume_elsewhere(cfg, state, tmp_path)
    assert (after[0]["epoch"], after[0]["index"]) == (1, 0)
    assert_continues(before, after, ref, N_BATCHES)


# -- the state itself --------------------------------------------------------------------------


def test_the_state_holds_plain_python_types_only_and_survives_torch_load_weights_only(
    store: Path,
) -> None:
    _, state = take_state(pipe_config(store), 4, sleep_s=0.2)
    assert is_plain(state), state
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["loader"] == state


def test_the_state_is_rank_independent_rank_0s_state_resumes_rank_1_at_its_own_place(
    store: Path, tmp_path: Path
) -> None:
    k = 2
    cfg0 = pipe_config(store, rank=0, world_size=2)
    cfg1 = pipe_config(store, rank=1, world_size=2)
    ref1 = reference(cfg1)
    n = len(ref1) // 3
    assert n > k + 1
    before0, state0 = take_state(cfg0, k)
    _, state1 = take_state(cfg1, k)
    assert state0 == state1, "the state after k batches must not depend on the rank"
    assert [r["idx"] for r in before0] != [r["idx"] for r in ref1[:k]], "ranks share samples"
    after = resume_elsewhere(cfg1, state0, tmp_path)
    assert_continues(ref1[:k], after, ref1, k, n)


# -- a state from another pipeline ----------------------------------------------------------------


@pytest.fixture(scope="module")
def other_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("resume-other") / "era5.zarr", n_time=192)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("dataset", {"store": "OTHER"}),
        ("dataset", {"array": "z"}),
        ("dataset", {"windowed": False}),
        ("split", {"split": "val"}),
        ("batch_size", {"batch_size": 12}),
        ("block_chunks", {"block_chunks": 4}),
        ("shuffle", {"shuffle": False}),
        ("seed", {"seed": 1}),
    ],
    ids=[
        "other-store",
        "other-array",
        "other-views",
        "split",
        "batch_size",
        "block_chunks",
        "shuffle",
        "seed",
    ],
)
def test_restoring_a_state_into_a_differently_configured_pipeline_raises_naming_the_field(
    store: Path, other_store: Path, field: str, change: dict[str, Any]
) -> None:
    _, state = take_state(pipe_config(store), 3)
    change = {k: str(other_store) if v == "OTHER" else v for k, v in change.items()}
    cfg = {**pipe_config(store), **change}
    pipe = build_pipeline(cfg)
    try:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        # (other views of the same arrays: "its dataset's views differ", naming both sets)
        with pytest.raises(ValueError, match=rf"its {field}\b.*differ"):
            next(iter(loader))
    finally:
        pipe.close()
