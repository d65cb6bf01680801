"""insitubatch_nodes: train PyTorch models in place on chunked zarr arrays, as torchdata.nodes.

The names here are what a training script needs: :func:`insitu_pipeline` builds the graph,
:class:`Loader` or :func:`as_dataset` iterates it; :class:`PlanConfig`, :class:`FetchOptions`
and :class:`CacheOptions` carry its settings as three checked objects (what ``InSituDataModule``
takes). The composition kit is one dotted name away,
in folders that follow a batch top-down:

* :mod:`insitubatch_nodes.io` — stores, array geometry, collections, coordinates, decoding
  (knows zarr);
* :mod:`insitubatch_nodes.plan` — splits, each epoch's order and chunk reads, the residency
  schedule (pure numpy);
* :mod:`insitubatch_nodes.pool` — ``ChunkPool``: byte budget, pins, LRU, slot memory;
* :mod:`insitubatch_nodes.cache` — the persistent chunk cache on local disk;
* :mod:`insitubatch_nodes.stages` — the five ``torchdata.nodes`` (the only folder importing
  torchdata) and ``Loader``;
* :mod:`insitubatch_nodes.errors` — every exception, with one base class ``InSituError``.

Beside them: :mod:`~insitubatch_nodes.pipeline` (the builder), :mod:`~insitubatch_nodes.batch`,
:mod:`~insitubatch_nodes.transforms`, the model inputs (:mod:`~insitubatch_nodes.static`
static fields, :mod:`~insitubatch_nodes.statistics` normalisation statistics,
:mod:`~insitubatch_nodes.forcings` solar and calendar forcings),
:mod:`~insitubatch_nodes.report` and :mod:`~insitubatch_nodes.recorder` (what an epoch
measured), :mod:`~insitubatch_nodes.torch_data` (``StatefulDataLoader``),
:mod:`~insitubatch_nodes.lightning` (the ``lightning`` extra) and
:mod:`~insitubatch_nodes.synthetic` (deterministic test stores).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from insitubatch_nodes.batch import Batch, BatchTransform, to_item, to_torch
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.collection import Collection, concat
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.ngff import open_plate
from insitubatch_nodes.io.ngff_images import open_images
from insitubatch_nodes.io.stores import RetryPolicy, open_store
from insitubatch_nodes.options import CacheOptions, FetchOptions
from insitubatch_nodes.pipeline import InSituPipeline, insitu_pipeline
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.splits import SplitManifest, split_by_chunk, split_by_member
from insitubatch_nodes.report import EpochReport
from insitubatch_nodes.stack import Stack, stack
from insitubatch_nodes.stages.loader import Loader
from insitubatch_nodes.statistics import Statistics, fit_statistics
from insitubatch_nodes.torch_data import as_dataset
from insitubatch_nodes.transforms import (
    ChunkTransform,
    Coarsen,
    DecodedChunk,
    StandardScaler,
    applies,
)

if TYPE_CHECKING:
    from insitubatch_nodes.lightning import InSituDataModule as InSituDataModule

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> Any:
    """``InSituDataModule``, imported when first asked for: Lightning is an extra, and
    importing the package never imports it (``from insitubatch_nodes.lightning import
    InSituDataModule`` is the same class)."""
    if name == "InSituDataModule":
        from insitubatch_nodes.lightning import InSituDataModule

        return InSituDataModule
    raise AttributeError(f"module 'insitubatch_nodes' has no attribute {name!r}")


__all__ = [
    "ArrayGeometry",
    "Batch",
    "BatchTransform",
    "CacheOptions",
    "ChunkTransform",
    "Coarsen",
    "Collection",
    "DecodedChunk",
    "EpochReport",
    "FetchOptions",
    "Forcings",
    "InSituPipeline",
    "Loader",
    "PlanConfig",
    "RetryPolicy",
    "SplitManifest",
    "Stack",
    "StandardScaler",
    "Statistics",
    "__version__",
    "applies",
    "as_dataset",
    "concat",
    "fit_statistics",
    "insitu_pipeline",
    "open_geometries",
    "open_images",
    "open_plate",
    "open_store",
    "split_by_chunk",
    "split_by_member",
    "stack",
    "to_item",
    "to_torch",
]
