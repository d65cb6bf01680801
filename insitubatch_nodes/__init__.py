"""insitubatch_nodes: train PyTorch models in place on chunked zarr arrays, as torchdata.nodes.

Follow a batch top-down through the modules:

* :mod:`~insitubatch_nodes.stores` — open a store by URL or path (obstore-backed);
* :mod:`~insitubatch_nodes.geometry` — what a sample is, and which stored objects hold it;
* :mod:`~insitubatch_nodes.coords` — coordinates along the sample axis (CF time), per row;
* :mod:`~insitubatch_nodes.splits` — chunk-aligned train/val/test manifests;
* :mod:`~insitubatch_nodes.plan` — ``ReadPlanNode``: per-epoch order, batches, chunk reads;
* :mod:`~insitubatch_nodes.fetch` — ``AsyncChunkFetchNode``: GETs on one loop, decode off the GIL;
* :mod:`~insitubatch_nodes.localfiles` — a local store's objects read on the decode threads;
* :mod:`~insitubatch_nodes.decode` — one stored object into its slot memory;
* :mod:`~insitubatch_nodes.transforms` — chunk transforms (``applies``, ``StandardScaler``, ...);
* :mod:`~insitubatch_nodes.residency` — ``ChunkPool``: budget, pins, LRU, slot memory;
* :mod:`~insitubatch_nodes.pool` — ``ChunkPoolNode``: waits until a batch's chunks are resident;
* :mod:`~insitubatch_nodes.gather` — ``GatherNode``: vectorised batch assembly;
* :mod:`~insitubatch_nodes.prefetch` — ``PrefetcherNode``: bounded look-ahead thread;
* :mod:`~insitubatch_nodes.pipeline` — ``insitu_pipeline``: the five stages in one call;
* :mod:`~insitubatch_nodes.report` — ``EpochReport``: which stage limits an epoch, and why;
* :mod:`~insitubatch_nodes.loader` — ``Loader``: torchdata's, with resume in any call order;
* :mod:`~insitubatch_nodes.batch` — ``Batch`` and ``to_torch``;
* :mod:`~insitubatch_nodes.torch_data` — ``as_dataset`` for ``StatefulDataLoader``;
* :mod:`~insitubatch_nodes.lightning` — ``InSituDataModule`` (the ``lightning`` extra);
* :mod:`~insitubatch_nodes.synthetic` — deterministic ERA5-like and microscopy-like stores.
"""

from insitubatch_nodes.batch import Batch, BatchTransform, DeviceTransform, to_torch
from insitubatch_nodes.cache import (
    CacheBusyError,
    CacheDiskFullError,
    CacheMissError,
    CorruptCacheError,
    StaleCacheError,
)
from insitubatch_nodes.coords import Coordinate, open_coordinates
from insitubatch_nodes.decode import ChunkDecoder, DecodeError
from insitubatch_nodes.fetch import AsyncChunkFetchNode, ChunkReadError, FetchedBatch
from insitubatch_nodes.gather import GatherNode
from insitubatch_nodes.geometry import ArrayGeometry, CorruptMetadataError, open_geometries
from insitubatch_nodes.loader import Loader
from insitubatch_nodes.pipeline import (
    InSituPipeline,
    PipelineStages,
    choose_schedule,
    insitu_pipeline,
)
from insitubatch_nodes.plan import (
    BatchPlan,
    ChunkKey,
    EpochPlan,
    PinSchedule,
    ReadPlanNode,
    ScheduleFloors,
    plan_epoch,
    schedule_floors,
    shuffle_quality,
)
from insitubatch_nodes.pool import ChunkPoolNode, ResidentBatch
from insitubatch_nodes.prefetch import PrefetcherNode
from insitubatch_nodes.report import EpochReport
from insitubatch_nodes.residency import (
    ChunkPool,
    FillCancelled,
    PipelineInterrupted,
    PoolStats,
    RamBacking,
    SlotBacking,
    working_set_bytes,
)
from insitubatch_nodes.splits import SplitManifest, split_by_chunk
from insitubatch_nodes.stores import SUPPORTED_SCHEMES, RetryPolicy, open_store
from insitubatch_nodes.torch_data import InSituIterableDataset, as_dataset
from insitubatch_nodes.transforms import (
    ChunkTransform,
    ChunkTransformError,
    Coarsen,
    DecodedChunk,
    StandardScaler,
    applies,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "SUPPORTED_SCHEMES",
    "ArrayGeometry",
    "AsyncChunkFetchNode",
    "Batch",
    "BatchPlan",
    "BatchTransform",
    "CacheBusyError",
    "CacheDiskFullError",
    "CacheMissError",
    "ChunkDecoder",
    "ChunkKey",
    "ChunkPool",
    "ChunkPoolNode",
    "ChunkReadError",
    "ChunkTransform",
    "ChunkTransformError",
    "Coarsen",
    "Coordinate",
    "CorruptCacheError",
    "CorruptMetadataError",
    "DecodeError",
    "DecodedChunk",
    "DeviceTransform",
    "EpochPlan",
    "EpochReport",
    "FetchedBatch",
    "FillCancelled",
    "GatherNode",
    "InSituIterableDataset",
    "InSituPipeline",
    "Loader",
    "PinSchedule",
    "PipelineInterrupted",
    "PipelineStages",
    "PoolStats",
    "PrefetcherNode",
    "RamBacking",
    "ReadPlanNode",
    "ResidentBatch",
    "RetryPolicy",
    "ScheduleFloors",
    "SlotBacking",
    "SplitManifest",
    "StaleCacheError",
    "StandardScaler",
    "__version__",
    "applies",
    "as_dataset",
    "choose_schedule",
    "insitu_pipeline",
    "open_coordinates",
    "open_geometries",
    "open_store",
    "plan_epoch",
    "schedule_floors",
    "shuffle_quality",
    "split_by_chunk",
    "to_torch",
    "working_set_bytes",
]
