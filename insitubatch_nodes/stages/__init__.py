"""The five stages as ``torchdata.nodes`` (the only folder that imports torchdata), top-down:

* :mod:`~insitubatch_nodes.stages.read_plan` — :class:`ReadPlanNode`, one plan per batch;
* :mod:`~insitubatch_nodes.stages.fetch` — :class:`AsyncChunkFetchNode`, admission and
  bookkeeping; its fill machinery is in ``_jobs`` (what is filled), ``_fill`` (decode threads)
  and ``_get`` (GETs on the IO loop);
* :mod:`~insitubatch_nodes.stages.resident` — :class:`ChunkPoolNode`, waits until a batch's
  chunks are resident;
* :mod:`~insitubatch_nodes.stages.gather` — :class:`GatherNode`, vectorised batch assembly;
* :mod:`~insitubatch_nodes.stages.prefetch` — :class:`PrefetcherNode`, bounded look-ahead;
* :mod:`~insitubatch_nodes.stages.loader` — :class:`Loader`, torchdata's with exact resume;
* :mod:`~insitubatch_nodes.stages._graph` — what every stage shares: the state key, and finding
  stages, the recorder and the pool down a chain.

Compose them by hand (``recipes/compose_nodes.py``) or call
:func:`~insitubatch_nodes.insitu_pipeline`: both give the same graph.
"""

from insitubatch_nodes.stages._jobs import FetchedBatch
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
]
