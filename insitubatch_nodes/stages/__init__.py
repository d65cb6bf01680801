"""The five stages as ``torchdata.nodes`` (the only folder that imports torchdata), top-down:

* :mod:`~insitubatch_nodes.stages.read_plan` — :class:`ReadPlanNode`, one plan per batch
  (how it takes a saved state: ``_resume``);
* :mod:`~insitubatch_nodes.stages.context` — :class:`StageContext`, what the stages of one
  graph share (made from the read plan by one call, handed to every stage below);
* :mod:`~insitubatch_nodes.stages.fetch` — :class:`AsyncChunkFetchNode`, the node; its
  admission is in ``_admit`` (plans pulled ahead, pins, read-ahead), its filling in ``_jobs``
  (what is filled), ``_fill`` (decode threads) and ``_get`` (GETs on the IO loop), and when
  rows decode straight into batches in ``_direct``;
* :mod:`~insitubatch_nodes.stages.resident` — :class:`ChunkPoolNode`, waits until a batch's
  chunks are resident;
* :mod:`~insitubatch_nodes.stages.gather` — :class:`GatherNode`, vectorised batch assembly
  (patched windows in ``_windows``) into the :mod:`~insitubatch_nodes.stages.buffers`;
* :mod:`~insitubatch_nodes.stages.prefetch` — :class:`PrefetcherNode`, bounded look-ahead;
* :mod:`~insitubatch_nodes.stages.loader` — :class:`Loader`, torchdata's with exact resume;
* :mod:`~insitubatch_nodes.stages._graph` — the state key every stage nests its source's
  state under, and the read plan's state found inside a graph's.

Compose them by hand (``recipes/compose_nodes.py``) or call
:func:`~insitubatch_nodes.insitu_pipeline`: both give the same graph.
"""

from insitubatch_nodes.stages._jobs import FetchedBatch
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.gather import GatherNode
from insitubatch_nodes.stages.loader import Loader
from insitubatch_nodes.stages.prefetch import PrefetcherNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ChunkPoolNode, ResidentBatch

__all__ = [
    "AsyncChunkFetchNode",
    "ChunkPoolNode",
    "FetchedBatch",
    "GatherNode",
    "Loader",
    "PrefetcherNode",
    "ReadPlanNode",
    "ResidentBatch",
    "StageContext",
]
