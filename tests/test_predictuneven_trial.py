"""Prediction over DDP ranks with ``remainder="uneven"`` when a split has fewer samples than
ranks (the predictuneven trial of 2026-12-07): 4 real gloo ranks, forked from the tests' fork
server, build their pipelines inside the group (rank and world size from it) and predict a
3-sample test split, then a windowed one. Oracles: zarr's read of the store for every row, the
manifest's samples for which rows a split holds.

Found (fixed):

1. A split with fewer samples than ranks was refused (``TooFewSamplesError``) even for a plain
   prediction loop, where a rank without samples is harmless: its loop runs zero batches and
   it still reaches the collective calls made after the loop. ``PlanConfig(empty_ranks=True)``
   (with ``remainder="uneven"`` only; any other remainder is a ``ValueError``) now lets such a
   split be read on every rank: the ranks beyond its samples yield zero batches, ``len()`` 0.
   It is off by default, and ``InSituDataModule`` never sets it (its config is training's, and
   ``"uneven"`` is refused there): Lightning refuses a rank without a batch, and with
   ``allow_zero_length_dataloader_with_multiple_devices`` the other ranks would wait for it
   (tests/test_splitinfer_trial.py). The data module's refusal, and the plain pipeline's, now
   name the option for plain loops. It changes no plan, so it is no part of a state's
   configuration: states resume across it.
2. An ``"uneven"`` epoch resumed on more ranks than samples were left of it (4 ranks, 12
   samples, 2 batches of 1 each delivered, resumed on 8): the rest (4 samples) went to new
   ranks 0-3, and ranks 4-7, with no share of it, ran the next epoch in that loop (samples
   20-23 predicted again: 21 and 22 a second time, 20 and 23 twice in the loop), their epochs
   one ahead of ranks 0-3 from then on. Two causes: the read plan took the epoch as over for
   a rank whose own share of the rest was empty (now: once rank 0, the largest share, has
   none left), and torchdata's ``Loader`` restarts a restored loop that has no batch left
   (ours now restarts only a state taken at its epoch's end, ``PrefetcherNode.ends_epoch``).
   Not only with ``empty_ranks``: any elastic ``"uneven"`` resume whose rest is smaller than
   the new world size.

Tried and found right (claims below): on 4 gloo ranks, a 3-sample split is predicted exactly
once, rank ``r`` the ``r``-th sample, rank 3 none; each rank's ``len()`` is its batch count;
``all_gather_object`` of the per-rank predictions completes on every rank and gives the split
in store order; the empty rank's states (before its epoch, after it) restore into a fresh
loader that goes on as the uninterrupted one (zero batches, then the next epoch's zero). A
batch size larger than every rank's share gives one short batch per rank. Windows (runs dealt
contiguously): 11 anchors of a ``[-1, 0]`` window on 4 ranks give contiguous runs of 3, 3, 3
and 2 in store order, rank 0 first; 2 windowed anchors on 4 ranks give ranks 2 and 3 none.
Through ``StatefulDataLoader(as_dataset(...))`` an empty rank has length 0, yields nothing and
resumes so; its ``report()`` is ``None``, as before any batch. Through ``InSituDataModule``
(built on the 4 gloo ranks, no trainer) the split is refused on every rank, the message naming
``empty_ranks`` for plain loops.

Left as it was then (fixed since, tests/test_ranksedge_trial.py): an empty rank's epoch did
not advance, its state saying epoch 0, batch 0 after any number of loops.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import PlanConfig, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import TooFewSamplesError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning"),  # (torch's)
]

T, C = 24, 3  # 8 chunks of 3 steps
WORLD = 4
FEW = (0.75, 0.125, 0.125)  # the test split: 1 chunk, samples 21 22 23
MORE = (0.5, 0.0, 0.5)  # the test split: 4 chunks, samples 12..23


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("predictuneven") / "s.zarr"
    group = zarr.open_group(root, mode="w")
    data = np.random.default_rng(3).random((T, 2)).astype("f4")
    group.create_array("t2m", data=data, chunks=(C, 2), dimension_names=("time", "lat"))
    return root


def _config(batch_size: int, **kw: Any) -> PlanConfig:
    return PlanConfig(split="test", shuffle=False, remainder="uneven", empty_ranks=True,
                      batch_size=batch_size, **kw)  # fmt: skip


def _rows(loader: Any) -> list[list[int]]:
    return [b.sample_indices["x"].tolist() for b in loader]


def predict_rank(rank: int, init_file: str, root: str, out: str) -> None:
    """One of 4 gloo ranks: predicts the few-sample split (a prediction: ``x`` summed over the
    last axis), gathers the predictions, resumes its states; then the windowed splits."""
    import torch.distributed as dist

    from insitubatch_nodes import Loader
    from insitubatch_nodes.lightning import InSituDataModule

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=30))  # fmt: skip
    try:
        g = open_geometries(root, ["t2m"])["t2m"]
        few = split_by_chunk(g, FEW)
        result: dict[str, Any] = {}
        pipe = insitu_pipeline(root, few, {"x": g}, config=_config(2))
        loader = Loader(pipe)
        before = loader.state_dict()
        preds: list[list[Any]] = []
        for b in loader:  # epoch 0
            rows, sums = b.sample_indices["x"].tolist(), b["x"].sum(-1).tolist()
            preds.extend(zip(rows, sums, strict=True))
        after = loader.state_dict()
        result["len"], result["preds"] = len(loader), preds
        result["epoch1"] = _rows(loader)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, preds)  # every rank reaches it, the empty one too
        result["gathered"] = gathered
        result["resumed"] = {}
        for name, state in (("before", before), ("after", after)):
            fresh = insitu_pipeline(root, few, {"x": g}, config=_config(2))
            again = Loader(fresh)  # (a new Loader: torchdata's ignores a second load)
            again.load_state_dict(state)
            result["resumed"][name] = [_rows(again), _rows(again)]
            fresh.close()
        pipe.close()
        # windows, dealt in contiguous runs: 11 anchors (MORE), 2 anchors (FEW)
        result["windows"] = {}
        for name, fractions in (("more", MORE), ("few", FEW)):
            manifest = split_by_chunk(g, fractions)
            wpipe = insitu_pipeline(root, manifest, {"x": g.window([-1, 0])}, config=_config(5))
            result["windows"][name] = [len(wpipe), [[r[-1] for r in b] for b in _rows(wpipe)]]
            wpipe.close()
        # the data module: refused on every rank (Lightning would hang), naming the option
        dm = InSituDataModule(root, ["t2m"], FEW, config=PlanConfig(batch_size=2),
                              log_report=False)  # fmt: skip
        try:
            dm.test_dataloader()
            result["dm"] = None
        except TooFewSamplesError as refused:
            result["dm"] = str(refused)
        dm.teardown()
        Path(out.format(rank)).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(store: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from resume_helpers import spawn_ranks

    out = tmp_path_factory.mktemp("predictuneven-ranks")
    spawn_ranks(predict_rank, args=(str(out / "init"), str(store), str(out / "rank{}.json")),
                nprocs=WORLD, workdir=out / "ranks")  # fmt: skip
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_four_ranks_predict_a_three_sample_split_exactly_once_the_fourth_running_no_batch(
    store: Path, ranks: list[dict[str, Any]]
) -> None:
    src = np.asarray(zarr.open_array(store / "t2m", mode="r")[...])
    assert [[i for i, _ in r["preds"]] for r in ranks] == [[21], [22], [23], []]
    for r in ranks:
        for i, pred in r["preds"]:
            assert pred == pytest.approx(float(src[i].sum()))
    assert [r["len"] for r in ranks] == [1, 1, 1, 0]
    assert [r["epoch1"] for r in ranks] == [[[21]], [[22]], [[23]], []]


def test_all_gather_object_of_the_ranks_predictions_completes_with_the_split_in_order(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert [i for share in r["gathered"] for i, _ in share] == [21, 22, 23]
        assert r["gathered"] == [q["preds"] for q in ranks]


def test_a_rank_with_no_samples_resumes_its_states_exactly_before_and_after_its_epoch(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:  # before epoch 0: epochs 0 and 1 again; after it: epoch 1, then epoch 2
        before, after = r["resumed"]["before"], r["resumed"]["after"]
        assert before == [[[i for i, _ in r["preds"]]] if r["preds"] else []] * 2
        assert after == [r["epoch1"]] * 2
    assert ranks[3]["resumed"] == {"before": [[], []], "after": [[], []]}


def test_windows_are_dealt_in_contiguous_runs_a_batch_larger_than_a_share_one_short_batch(
    ranks: list[dict[str, Any]],
) -> None:
    more = [r["windows"]["more"] for r in ranks]
    assert [n for n, _ in more] == [1, 1, 1, 1]  # batch_size 5 > every share (3, 3, 3, 2)
    assert [rows for _, rows in more] == [
        [[13, 14, 15]], [[16, 17, 18]], [[19, 20, 21]], [[22, 23]]
    ]  # fmt: skip
    few = [r["windows"]["few"] for r in ranks]
    assert few == [[1, [[22]]], [1, [[23]]], [0, []], [0, []]]


def test_the_data_module_still_refuses_on_every_rank_naming_the_plain_loop_option(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["dm"] is not None and "the 'test' split has 3 sample(s)" in r["dm"]
        assert "empty_ranks=True" in r["dm"] and "the data module never sets it" in r["dm"]


def test_empty_ranks_is_for_uneven_only_and_off_by_default(store: Path) -> None:
    with pytest.raises(ValueError, match="empty_ranks=True is for remainder='uneven'"):
        PlanConfig(split="test", remainder="drop", empty_ranks=True)
    with pytest.raises(ValueError, match="remainder='uneven' is for evaluation"):
        PlanConfig(remainder="uneven", empty_ranks=True)  # (split="train")
    with pytest.raises(TypeError):
        PlanConfig(split="test", remainder="uneven", empty_ranks=1)  # type: ignore[arg-type]
    g = open_geometries(store, ["t2m"])["t2m"]
    plain = PlanConfig(split="test", shuffle=False, remainder="uneven", rank=3, world_size=4)
    with pytest.raises(TooFewSamplesError, match=r"empty_ranks=True\) \(the ranks beyond"):
        insitu_pipeline(store, split_by_chunk(g, FEW), {"x": g}, config=plain)


def test_an_uneven_epoch_resumed_on_more_ranks_than_its_rest_leaves_ranks_without_a_share_empty(
    store: Path,
) -> None:
    """4 ranks delivered 2 of their 3 samples (12 in the split, batches of 1) and the job comes
    back on 8: the rest (4 samples) goes to ranks 0-3, and ranks 4-7, with no share of it, ran
    the next epoch in that loop instead (torchdata's ``Loader`` restarts a restored loop that
    has no batch left): samples 20-23 predicted again, ranks 0-3 and 4-7 an epoch apart."""
    from insitubatch_nodes import Loader

    g = open_geometries(store, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, MORE)

    def loader(rank: int, world: int) -> tuple[Any, Loader[Any]]:
        config = PlanConfig(split="test", shuffle=False, remainder="uneven", batch_size=1,
                            rank=rank, world_size=world)  # fmt: skip
        pipe = insitu_pipeline(store, manifest, {"x": g}, config=config)
        return pipe, Loader(pipe)

    delivered: list[int] = []
    for rank in range(4):
        pipe, old = loader(rank, 4)
        it = iter(old)
        delivered += [int(next(it).sample_indices["x"][0]) for _ in range(2)]
        if rank == 0:
            state = old.state_dict()  # (the elastic rule: rank 0's state for every new rank)
        pipe.close()
    first, second, fresh = [], [], []
    for rank in range(8):
        pipe, new = loader(rank, 8)
        new.load_state_dict(state)
        first.append([i for rows in _rows(new) for i in rows])
        second.append(_rows(new))
        pipe.close()
        pipe, again = loader(rank, 8)
        fresh.append(_rows(again) and _rows(again))  # a fresh run's epoch 1
        pipe.close()
    assert first == [[14], [17], [20], [23], [], [], [], []]
    assert sorted(delivered + [i for f in first for i in f]) == list(range(12, 24))
    assert second == fresh  # then every new rank's epoch 1


def test_an_empty_rank_through_stateful_dataloader_has_length_0_and_resumes_empty(
    store: Path,
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes import as_dataset

    g = open_geometries(store, ["t2m"])["t2m"]
    manifest, config = split_by_chunk(g, FEW), _config(2, rank=3, world_size=WORLD)
    pipes = [insitu_pipeline(store, manifest, {"x": g}, config=config) for _ in range(2)]
    try:
        dl = StatefulDataLoader(as_dataset(pipes[0]), batch_size=None, num_workers=0)
        assert (len(dl), list(dl), list(dl)) == (0, [], [])
        assert pipes[0].report() is None  # (no batch delivered: no epoch measured)
        again = StatefulDataLoader(as_dataset(pipes[1]), batch_size=None, num_workers=0)
        again.load_state_dict(dl.state_dict())
        assert (len(again), list(again)) == (0, [])
    finally:
        for pipe in pipes:
            pipe.close()
