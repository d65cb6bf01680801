"""insitubatch_nodes: train PyTorch models in place on chunked zarr arrays, as torchdata.nodes.

The names here are what a training script needs: :func:`insitu_pipeline` builds the graph,
:class:`Loader` or :func:`as_dataset` iterates it. The composition kit is one dotted name away,
in folders that follow a batch top-down:

* :mod:`insitubatch_nodes.io` — stores, array geometry, coordinates, decoding (knows zarr);
* :mod:`insitubatch_nodes.plan` — splits, each epoch's order and chunk reads, the residency
  schedule (pure numpy);
* :mod:`insitubatch_nodes.pool` — ``ChunkPool``: byte budget, pins, LRU, slot memory;
* :mod:`insitubatch_nodes.cache` — the persistent chunk cache on local disk;
* :mod:`insitubatch_nodes.stages` — the five ``torchdata.nodes`` (the only folder importing
  torchdata) and ``Loader``;
* :mod:`insitubatch_nodes.errors` — every exception, with one base class ``InSituError``.

Beside them: :mod:`~insitubatch_nodes.pipeline` (the builder), :mod:`~insitubatch_nodes.batch`,
:mod:`~insitubatch_nodes.transforms`, :mod:`~insitubatch_nodes.report` and
:mod:`~insitubatch_nodes.recorder` (what an epoch measured), :mod:`~insitubatch_nodes.torch_data`
(``StatefulDataLoader``), :mod:`~insitubatch_nodes.lightning` (the ``lightning`` extra) and
:mod:`~insitubatch_nodes.synthetic` (deterministic test stores).

Names that were importable from here before the package was arranged in folders still are, with
a ``DeprecationWarning`` that names their module.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from insitubatch_nodes.batch import Batch, BatchTransform, to_torch
from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import RetryPolicy, open_store
from insitubatch_nodes.pipeline import InSituPipeline, insitu_pipeline
from insitubatch_nodes.plan.splits import SplitManifest, split_by_chunk
from insitubatch_nodes.report import EpochReport
from insitubatch_nodes.stages.loader import Loader
from insitubatch_nodes.torch_data import as_dataset
from insitubatch_nodes.transforms import (
    ChunkTransform,
    Coarsen,
    DecodedChunk,
    StandardScaler,
    applies,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "ArrayGeometry",
    "Batch",
    "BatchTransform",
    "ChunkTransform",
    "Coarsen",
    "DecodedChunk",
    "EpochReport",
    "InSituPipeline",
    "Loader",
    "RetryPolicy",
    "SplitManifest",
    "StandardScaler",
    "__version__",
    "applies",
    "as_dataset",
    "insitu_pipeline",
    "open_geometries",
    "open_store",
    "split_by_chunk",
    "to_torch",
]

# The names this face held before the folders (module where each lives now).
_MOVED = {
    "SUPPORTED_SCHEMES": "insitubatch_nodes.io.stores",
    "AsyncChunkFetchNode": "insitubatch_nodes.stages",
    "BatchPlan": "insitubatch_nodes.plan",
    "CacheBusyError": "insitubatch_nodes.errors",
    "CacheDiskFullError": "insitubatch_nodes.errors",
    "CacheMissError": "insitubatch_nodes.errors",
    "ChunkDecoder": "insitubatch_nodes.io",
    "ChunkKey": "insitubatch_nodes.plan",
    "ChunkPool": "insitubatch_nodes.pool",
    "ChunkPoolNode": "insitubatch_nodes.stages",
    "ChunkReadError": "insitubatch_nodes.errors",
    "ChunkTransformError": "insitubatch_nodes.errors",
    "Coordinate": "insitubatch_nodes.io",
    "CorruptCacheError": "insitubatch_nodes.errors",
    "CorruptMetadataError": "insitubatch_nodes.errors",
    "DecodeError": "insitubatch_nodes.errors",
    "DeviceTransform": "insitubatch_nodes.batch",
    "EpochPlan": "insitubatch_nodes.plan",
    "FetchedBatch": "insitubatch_nodes.stages",
    "FillCancelled": "insitubatch_nodes.errors",
    "GatherNode": "insitubatch_nodes.stages",
    "InSituIterableDataset": "insitubatch_nodes.torch_data",
    "PinSchedule": "insitubatch_nodes.plan",
    "PipelineInterrupted": "insitubatch_nodes.errors",
    "PipelineStages": "insitubatch_nodes.pipeline",
    "PoolStats": "insitubatch_nodes.pool",
    "PrefetcherNode": "insitubatch_nodes.stages",
    "RamBacking": "insitubatch_nodes.pool",
    "ReadPlanNode": "insitubatch_nodes.stages",
    "ResidentBatch": "insitubatch_nodes.stages",
    "ScheduleFloors": "insitubatch_nodes.plan",
    "SlotBacking": "insitubatch_nodes.pool",
    "StaleCacheError": "insitubatch_nodes.errors",
    "choose_schedule": "insitubatch_nodes.plan",
    "open_coordinates": "insitubatch_nodes.io",
    "plan_epoch": "insitubatch_nodes.plan",
    "schedule_floors": "insitubatch_nodes.plan",
    "shuffle_quality": "insitubatch_nodes.plan",
    "working_set_bytes": "insitubatch_nodes.plan",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'insitubatch_nodes' has no attribute {name!r}")
    warnings.warn(
        f"insitubatch_nodes.{name} moved: import it from {module} (this alias will be removed)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
