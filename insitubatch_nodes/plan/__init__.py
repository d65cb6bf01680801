"""What to read and when, as pure numpy: no torchdata, no pool, no threads.

* :mod:`~insitubatch_nodes.plan.splits` — chunk-aligned train/val/test manifests (by chunk, or by a
  collection's member);
* :mod:`~insitubatch_nodes.plan.config` — what a plan draws, as one :class:`PlanConfig`;
* :mod:`~insitubatch_nodes.plan.anchors` — which samples are anchors: the stride, the anchors
  dropped for missing steps (:class:`SampleSteps`);
* :mod:`~insitubatch_nodes.plan.parts` — a batch label's parts: a window's steps as the plain
  views the plan reads (:class:`BatchLayout`);
* :mod:`~insitubatch_nodes.plan.epoch` — drawing one epoch: permutation, blocks, batches;
* :mod:`~insitubatch_nodes.plan.patches` — patched views: window origins, the regions of
  tiles they are grouped in, the stored tiles each window touches;
* :mod:`~insitubatch_nodes.plan.ranks` — dealing an epoch's samples between ranks;
* :mod:`~insitubatch_nodes.plan.ledger` — what a drawn epoch is (:class:`EpochPlan`, its
  ledgers and :class:`BatchPlan` s);
* :mod:`~insitubatch_nodes.plan.schedule` — the residency schedule and its memory bounds;
* :mod:`~insitubatch_nodes.plan.working_set` — what one drawn epoch holds in slot bytes;
* :mod:`~insitubatch_nodes.plan.quality` — how well an order mixes the data.

The node that serves these plans to a graph is
:class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`.
"""

from insitubatch_nodes.plan.anchors import SampleSteps
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.ledger import BatchPlan, ChunkKey, ChunkLedger, EpochPlan
from insitubatch_nodes.plan.parts import BatchLayout
from insitubatch_nodes.plan.quality import shuffle_quality
from insitubatch_nodes.plan.ranks import REMAINDERS, deal, deal_runs, samples_per_rank
from insitubatch_nodes.plan.schedule import (
    PinSchedule,
    ScheduleFloors,
    choose_schedule,
    schedule_floors,
)
from insitubatch_nodes.plan.splits import SplitManifest, split_by_chunk, split_by_member
from insitubatch_nodes.plan.working_set import working_set_bytes

__all__ = [
    "REMAINDERS",
    "BatchLayout",
    "BatchPlan",
    "ChunkKey",
    "ChunkLedger",
    "EpochPlan",
    "PinSchedule",
    "PlanConfig",
    "SampleSteps",
    "ScheduleFloors",
    "SplitManifest",
    "choose_schedule",
    "deal",
    "deal_runs",
    "plan_epoch",
    "samples_per_rank",
    "schedule_floors",
    "shuffle_quality",
    "split_by_chunk",
    "split_by_member",
    "working_set_bytes",
]
