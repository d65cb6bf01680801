"""DDP edges and elastic resume (the ranksedge trial of 2026-12-07): ranks simulated in one
process (``rank=``, ``world_size=``), zarr's store as the oracle for which samples exist.

Found (fixed):

1. A rank with no batch of an epoch (``PlanConfig(empty_ranks=True)``: 3 test samples on 4
   ranks) kept its epoch counter at 0: the read plan moved on after an epoch that delivered a
   batch, and its state after any number of loops said epoch 0, batch 0. Where the next
   epochs give it samples (views given by ``set_views`` that hold more anchors) it drew them
   from epoch 0's permutation while the others drew from theirs: 8 ranks, a window grown from
   7 to 11 anchors, delivered sample 18 twice and 16 never. Now an epoch's end reached with no
   batch moves it on as the other ranks move (``ReadPlanNode.reset``), and its state there is
   the next epoch's start (``ReadPlanNode.get_state``; the prefetch stage's delivered
   position, ``PrefetcherNode``), so a resumed empty rank goes on at the others' epoch.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    ArrayGeometry,
    Loader,
    PlanConfig,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.stages._graph import plan_state
from insitubatch_nodes.stages.read_plan import ReadPlanNode

pytestmark = pytest.mark.timeout(60)

T, C = 24, 3  # 8 chunks of 3 steps


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ranksedge") / "s.zarr"
    group = zarr.open_group(root, mode="w")
    data = np.random.default_rng(5).random((T, 2)).astype("f4")
    group.create_array("t2m", data=data, chunks=(C, 2), dimension_names=("time", "lat"))
    return root


@pytest.fixture(scope="module")
def geom(store: Path) -> ArrayGeometry:
    return open_geometries(store, ["t2m"])["t2m"]


def _eval(rank: int, world: int, **kw: Any) -> PlanConfig:
    return PlanConfig(split="test", remainder="uneven", empty_ranks=True, rank=rank,
                      world_size=world, **{"batch_size": 1, **kw})  # fmt: skip


def _loop(node: Any) -> list[int]:
    return [int(a) for batch in node for a in batch.anchors]


# -- 1. an empty rank's epoch -------------------------------------------------------------------


def test_an_empty_rank_ends_each_epoch_at_the_same_epoch_as_the_other_ranks(
    geom: ArrayGeometry,
) -> None:
    few = split_by_chunk(geom, (0.75, 0.125, 0.125))  # the test split: samples 21 22 23
    nodes = [ReadPlanNode(few, {"x": geom}, config=_eval(r, 4, shuffle=True)) for r in range(4)]
    for epoch in range(3):
        shares = []
        for node in nodes:
            node.reset(None)
            shares.append(_loop(node))
            assert node.epoch == epoch and node.next_epoch == epoch + 1
            assert node.resumed_epoch(node.get_state()) == epoch + 1
        assert sorted(a for s in shares for a in s) == [21, 22, 23] and shares[3] == []


def test_views_that_give_a_formerly_empty_rank_samples_deal_each_sample_once_over_the_ranks(
    geom: ArrayGeometry,
) -> None:
    half = split_by_chunk(geom, (0.5, 0.0, 0.5))  # the test split: samples 12..23
    world = 8
    nodes = [
        ReadPlanNode(half, {"x": geom.window([-5, 0])}, config=_eval(r, world, shuffle=True))
        for r in range(world)
    ]
    for _ in range(3):  # 7 anchors (17..23) on 8 ranks: rank 7 has none
        shares = [(node.reset(None), _loop(node))[1] for node in nodes]
        assert sorted(a for s in shares for a in s) == list(range(17, 24)) and shares[7] == []
    for node in nodes:  # a shorter window: 11 anchors (13..23), every rank some
        node.set_views({"x": geom.window([-1, 0])})
    for epoch in (3, 4):
        shares = [(node.reset(None), _loop(node))[1] for node in nodes]
        seen = collections.Counter(a for s in shares for a in s)
        assert sorted(seen.elements()) == list(range(13, 24)), seen  # (main: 18 twice, 16 never)
        assert [node.epoch for node in nodes] == [epoch] * world


def test_an_empty_ranks_state_after_its_loop_resumes_at_the_next_epoch_as_the_others_do(
    store: Path, geom: ArrayGeometry
) -> None:
    few = split_by_chunk(geom, (0.75, 0.125, 0.125))
    states = []
    for rank in (0, 3):
        with insitu_pipeline(store, few, {"x": geom}, config=_eval(rank, 4)) as pipe:
            loader = Loader(pipe)
            rows = [[b.sample_indices["x"].tolist() for b in loader] for _ in range(2)]
            assert rows == ([[[21]], [[21]]] if rank == 0 else [[], []])
            states.append(loader.state_dict())
            assert pipe.stages.plan.epoch == 1
            # each rank's own state (a prediction loop's rule): the next epoch, 2
            assert pipe.stages.plan.resumed_epoch(states[-1]) == 2
    with insitu_pipeline(store, few, {"x": geom}, config=_eval(3, 4)) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(states[1])
        assert [list(loader), list(loader)] == [[], []]
        assert plan_state(loader.state_dict())["epoch"] == 4  # (after epochs 2 and 3)
