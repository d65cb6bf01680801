"""``set_views``: one count of the memory rule per call (``InSituPipeline.set_views``,
``ReadPlanNode.set_views``, ``stages/fetch.py``'s ``count_views``).

Found wrong, fixed:

* ``InSituPipeline.set_views`` counted the build's memory rule for the new views (with the new
  stacks' constants), then the plan's own ``set_views`` ran the fetch stage's check again
  (without them) and the pipeline kept the first count: the rule was counted twice, three
  epoch plans were drawn and the schedule's floors computed three times per call (the second
  count could not refuse what the first had passed). The plan's ``set_views`` now takes the
  constants (``extra=``) and the floors the schedule was chosen with (``floors=``) and hands
  them to the one check, which counts on the plan it draws for the views' first epoch (the
  plan then takes that draw, at the next epoch's start too):
  ``test_set_views_counts_the_memory_rule_once_on_one_drawn_plan``.
* An automatic budget keeps a small split whole only within the room the memory rule leaves
  the slots. The fetch stage decided that when it was built, before the ``GatherNode``, so in
  a graph composed by hand (no ``transform_bytes=``) the room left out the batch transforms:
  in the band of memory where the split fits beside everything but them, the hand-built graph
  kept it, and the ``GatherNode`` then counted the transforms beside the whole split and
  refused the graph the builder builds (it leaves the split to its epochs' floor there). The
  ``GatherNode``'s count now makes the fetch stage decide again with the transforms' bytes
  (``MemoryRule.recount``), and a fetch stage not told them grows the pool at its build only
  to the first epoch's floor without keeping (the first epoch's start grows it to keep the
  split where the decision stands):
  ``test_a_graph_composed_by_hand_keeps_its_split_where_the_builder_does``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import write_era5

import insitubatch_nodes.pipeline as pipeline_module
import insitubatch_nodes.plan.schedule as schedule_module
import insitubatch_nodes.stages._memrule as memrule_module
import insitubatch_nodes.stages.context as context_module
import insitubatch_nodes.stages.fetch as fetch_module
import insitubatch_nodes.stages.read_plan as read_plan_module
from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.plan import PlanConfig, choose_schedule, memory_floor
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode,
    ChunkPoolNode,
    GatherNode,
    PrefetcherNode,
    ReadPlanNode,
    StageContext,
)

pytestmark = pytest.mark.timeout(60)


class _Calls:
    """How often the memory rule is checked, an epoch plan drawn and the schedule's floors
    computed (spies on the functions every path calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts = {"rule": 0, "drawn": 0, "floors": 0}
        self._spy(monkeypatch, memrule_module.MemoryRule, "check", "rule")
        self._spy(monkeypatch, read_plan_module, "plan_epoch", "drawn")
        for module in (schedule_module, fetch_module, pipeline_module, context_module):
            self._spy(monkeypatch, module, "schedule_floors", "floors")

    def _spy(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, key: str) -> None:
        real = getattr(owner, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)

    def take(self) -> dict[str, int]:
        """The counts since the last take."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return out


@pytest.fixture
def era5(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    root = write_era5(tmp_path / "e.zarr", n_time=96)
    yield root, open_geometries(root, ["t2m"])["t2m"]


def _anchors(pipe: Any) -> list[list[int]]:
    return [np.asarray(b.sample_indices["x"]).tolist() for b in Loader(pipe)]


def test_set_views_counts_the_memory_rule_once_on_one_drawn_plan(
    era5: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, t2m = era5
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    after = {"x": t2m.window([0, 1, 2])}
    with insitu_pipeline(root, manifest, {"x": t2m}, batch_size=4, seed=0) as pipe:
        calls = _Calls(monkeypatch)
        pipe.set_views(after)
        # on main: {"rule": 2, "drawn": 3, "floors": 3}
        assert calls.take() == {"rule": 1, "drawn": 1, "floors": 1}
        got = _anchors(pipe)  # the epoch starts on the plan set_views drew
        assert calls.take()["drawn"] == 0
    with insitu_pipeline(root, manifest, after, batch_size=4, seed=0) as built:
        assert got == _anchors(built)  # the same batches as a pipeline built with them

    # a graph composed by hand: the plan's own set_views counts the rule once too
    config = PlanConfig(batch_size=4, seed=0)
    views = {"x": t2m}
    plan = ReadPlanNode(
        manifest, views, schedule=choose_schedule(manifest, views, None, config), config=config
    )
    ctx = StageContext.create(plan, ChunkPool(None))
    fetch = AsyncChunkFetchNode(plan, root, context=ctx)
    graph = PrefetcherNode(GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx), context=ctx)
    with graph:
        calls.take()
        plan.set_views(after)
        # on main: {"rule": 1, "drawn": 2, "floors": 1}
        assert calls.take() == {"rule": 1, "drawn": 1, "floors": 1}
        assert fetch.counted.in_flight > 0


class _Holding:
    """A batch transform that says it holds ``nbytes`` at most (and changes nothing)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def most_held_bytes(self, views: Any, rows: int, batches: int) -> int:
        return self.nbytes

    def __call__(self, batch: Any) -> Any:
        return batch


def _fake_memory(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The process may use ``nbytes`` (the rule, the batch buffers and the automatic budget's
    caps ask these functions; nothing is allocated)."""
    from insitubatch_nodes.stages import buffers

    for module in (memory_floor, buffers, schedule_module):
        monkeypatch.setattr(module, "usable_memory_bytes", lambda: nbytes)


def test_a_graph_composed_by_hand_keeps_its_split_where_the_builder_does(
    era5: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, t2m = era5
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {"x": t2m}
    config = PlanConfig(batch_size=4, seed=0, block_chunks=2)
    split = 96 * 8 * 16 * 4  # every chunk the split reads (49,152 bytes)
    in_flight = 4 * 8 * 16 * 4 * 4  # prefetch_depth + 2 batches of 4 rows (8,192 bytes)
    memory = 16 * split  # an automatic budget keeps a split of up to a sixteenth of it
    # the batch transforms leave the split no room beside them; the epochs' floor they do
    holding = memory - in_flight - split + 1
    _fake_memory(monkeypatch, memory)

    options: dict[str, Any] = {"batch_size": 4, "seed": 0, "block_chunks": 2}
    with insitu_pipeline(
        root, manifest, views, batch_transforms=[_Holding(holding)], **options
    ) as pipe:
        built = pipe.stages.fetch.counted
        assert built.transforms == holding and built.budget < split  # not kept
        assert built.total <= memory
        want = _anchors(pipe)

    plan = ReadPlanNode(
        manifest, views, schedule=choose_schedule(manifest, views, None, config), config=config
    )
    ctx = StageContext.create(plan, ChunkPool(None))
    fetch = AsyncChunkFetchNode(plan, root, context=ctx)
    # on main: ValueError, the automatic budget cannot hold this pipeline (the split kept)
    gather = GatherNode(
        ChunkPoolNode(fetch, context=ctx), context=ctx, batch_transforms=[_Holding(holding)]
    )
    with PrefetcherNode(gather, context=ctx) as graph:
        assert fetch.counted == built
        assert _anchors(graph) == want
        assert ctx.pool.budget_bytes <= built.budget  # (the pool never took the split)
