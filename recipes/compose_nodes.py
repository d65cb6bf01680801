"""Compose the five pipeline stages by hand and check every batch against zarr.

``insitu_pipeline()`` builds these same five nodes in one call; this recipe spells them out so
each stage, and what it is given, is visible:

    ReadPlanNode -> AsyncChunkFetchNode -> ChunkPoolNode -> GatherNode -> PrefetcherNode

The graph is the builder's, node for node: what the stages share (the read plan's views and
batch size, the pool, the chunk transforms, the fetch options, the epoch-report recorder, the
batch buffers) is made by one call, ``StageContext.create``, and handed to each stage; each
sizes and reserves its own memory, and ``close()`` on the root reaches every stage (and a cache
directory's lock) through the context, even with a plain torchdata node placed in between. The
test ``tests/test_compose.py`` holds that this graph and ``insitu_pipeline()``'s deliver
identical batches, reports and teardown.

It writes a small synthetic ERA5-like store to a temporary folder (or uses ``--path``), trains
nothing, iterates one epoch through ``Loader``, compares every label of every batch with zarr's
own read of the same samples, and prints the epoch report and the pool's counters.

    .venv/bin/python recipes/compose_nodes.py
    .venv/bin/python recipes/compose_nodes.py --shard-samples 32 --batch-size 24
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import Store

from insitubatch_nodes import (
    ArrayGeometry,
    Batch,
    Loader,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.io import open_coordinates
from insitubatch_nodes.io.coords import coordinate_reader
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.pipeline import PipelineStages
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.schedule import choose_schedule, working_set_bytes
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode,
    ChunkPoolNode,
    GatherNode,
    PrefetcherNode,
    ReadPlanNode,
    StageContext,
)
from insitubatch_nodes.synthetic import make_era5_like


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--path",
        type=Path,
        help="zarr store to read; written (ERA5-like) if it does not exist yet "
        "(default: a temporary folder, removed afterwards)",
    )
    p.add_argument("--n-time", type=int, default=256, help="time steps of the synthetic store")
    p.add_argument("--samples-per-chunk", type=int, default=8, help="chunk length along time")
    p.add_argument(
        "--shard-samples",
        type=int,
        default=None,
        help="write a sharded store with shards of this many time steps (a multiple of "
        "--samples-per-chunk); one stored object is then one shard",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-chunks", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache-budget-bytes",
        type=int,
        default=None,
        help="the pool's byte budget (default: automatic, grown to each epoch's working set)",
    )
    return p.parse_args(argv)


def ensure_store(path: Path, args: argparse.Namespace) -> None:
    """Write the synthetic ERA5-like store at ``path`` unless a zarr group is already there."""
    if (path / "zarr.json").exists() or (path / ".zgroup").exists():
        print(f"using the existing store at {path}")
        return
    t0 = time.perf_counter()
    make_era5_like(
        path,
        n_time=args.n_time,
        n_lat=16,
        n_lon=32,
        n_level=4,
        samples_per_chunk=args.samples_per_chunk,
        shard_samples=args.shard_samples,
    )
    print(f"wrote a synthetic ERA5-like store to {path} in {time.perf_counter() - t0:.2f} s")


def build_nodes(
    store: Store,
    views: Mapping[str, ArrayGeometry],
    args: argparse.Namespace,
    reader: Any = None,
) -> PipelineStages:
    """The five stages, top-down, sharing one ``StageContext`` (and through it one pool).

    ``reader`` (:func:`~insitubatch_nodes.io.coords.coordinate_reader` of ``store``, the one
    ``open_geometries(..., coords_reader=)`` opened ``views`` with) is what the fetch stage's
    store check and the rows' coordinates read through: each metadata document and coordinate
    read once in all, as ``insitu_pipeline(..., coords_reader=)`` reads them. Without one, a
    reader of this build's own: the coordinate is still read once for every label, and the
    store check reads the arrays' metadata again."""
    reader = coordinate_reader(store) if reader is None else reader
    # The anchor grid: whole chunks of the array the first view reads, 80/10/10 in time order.
    first = next(iter(views.values()))
    manifest = split_by_chunk(first.base, (0.8, 0.1, 0.1))

    # The residency schedule, from the budget: a pure function of the configuration, decided
    # before the read plan exists (it raises here, not in a later epoch, when the budget cannot
    # hold every epoch). insitu_pipeline() calls the same function with the same arguments.
    # One PlanConfig carries the plan's settings to both (checked once, here).
    budget = args.cache_budget_bytes  # None = the automatic budget
    config = PlanConfig(
        split="train", batch_size=args.batch_size, block_chunks=args.block_chunks, seed=args.seed
    )
    schedule = choose_schedule(manifest, views, budget, config)

    # 1. What to read and when: one BatchPlan per batch, epoch after epoch.
    plan = ReadPlanNode(manifest, views, schedule=schedule, config=config)

    # The stored arrays behind the views, by path (views of one array share its chunks).
    geoms = {view.path: view.base for view in views.values()}

    # The pool. The fetch stage sizes an automatic budget to epoch 0's working-set floor when
    # it is built (and grows it to each later epoch's when that epoch starts).
    pool = ChunkPool(budget_bytes=budget)
    floor, read_ahead = working_set_bytes(plan.epoch_plan(0), geoms)
    print(
        f"epoch 0 working set: floor {floor / 2**20:.2f} MiB "
        f"(read-ahead {read_ahead / 2**20:.2f} MiB), schedule {schedule}"
    )

    # What the stages share, made by one call: the plan's views (after any chunk transforms:
    # chunk_transforms=... here), batch size and rank, the pool, the fetch options (checked
    # once, when made), the epoch-report recorder and the reusable batch buffers.
    options = FetchOptions(max_inflight=args.max_inflight, prefetch_depth=args.prefetch_depth)
    context = StageContext.create(plan, pool, options=options)

    # 2. GETs on zarr's IO loop, decoded on the shared decode pool straight into pool slots.
    # Its store check compares the views with the metadata the reader read (nothing re-read).
    fetch = AsyncChunkFetchNode(plan, store, context=context, coords_reader=reader)
    # 3. Residency: waits until every chunk a batch reads is ready; releases drained chunks.
    resident = ChunkPoolNode(fetch, context=context)
    # 4. Gather: one vectorised copy per (label, chunk) into the context's batch buffers; each
    # row also carries its label's coordinate along time (what the builder carries by default),
    # read once through the reader, however many labels share it.
    coords = {
        label: {
            name: c.values for name, c in open_coordinates(store, view.base, reader=reader).items()
        }
        for label, view in views.items()
    }
    gather = GatherNode(resident, context=context, coords=coords)
    # 5. Look-ahead: a thread keeps up to prefetch_depth finished batches ready.
    prefetch: PrefetcherNode[Batch] = PrefetcherNode(gather, context=context)
    return PipelineStages(
        plan=plan, fetch=fetch, resident=resident, gather=gather, prefetch=prefetch, pool=pool
    )


def zarr_read(array: zarr.Array, geom: ArrayGeometry, samples: np.ndarray) -> np.ndarray:
    """zarr's own read of ``samples`` along the sample axis, sample axis moved first."""
    selection: list[Any] = [slice(None)] * geom.ndim
    selection[geom.sample_axis] = samples
    data = np.asarray(array.get_orthogonal_selection(tuple(selection)))
    return np.moveaxis(data, geom.sample_axis, 0)


def run(path: Path, args: argparse.Namespace) -> int:
    ensure_store(path, args)
    store = open_store(path)
    # One reader for the whole build: each metadata document and coordinate is read once.
    reader = coordinate_reader(store)
    geoms = open_geometries(store, ["t2m", "z"], coords_reader=reader)
    t2m, z = geoms["t2m"], geoms["z"]
    for g in (t2m, z):
        print(
            f"{g.path}: shape {g.shape}, stored object {g.chunks}"
            + (f" (shard of inner chunks {g.read_chunks})" if g.sharded else "")
            + f", {g.n_chunks} chunks x {g.n_tiles} object(s)"
        )
    # Input at t, target at t+1, and the pressure-level field at t (tiled along level).
    views = {"x": t2m, "y": t2m.shift(1), "z": z}

    stages = build_nodes(store, views, args, reader)
    prefetch, plan, pool, gather = stages.prefetch, stages.plan, stages.pool, stages.gather
    arrays = {g.path: zarr.open_array(store=store, path=g.path, mode="r") for g in geoms.values()}

    t0 = time.perf_counter()
    n_batches = n_samples = 0
    epochs: set[int] = set()
    try:
        for batch in Loader(prefetch):  # Loader resets the root node: one epoch per iteration
            for label, view in views.items():
                expected = zarr_read(arrays[view.path], view, batch.sample_indices[label])
                if not np.array_equal(batch[label], expected):
                    print(f"MISMATCH in batch {batch.index}, label {label!r}")
                    return 1
            n_batches += 1
            n_samples += len(batch)
            epochs.add(batch.epoch)
    finally:
        prefetch.close()  # stops the thread, cancels fetches, unpins chunks
    dt = time.perf_counter() - t0

    expected_batches = len(plan)
    if n_batches != expected_batches:
        print(f"expected {expected_batches} batches, got {n_batches}")
        return 1
    print(
        f"epoch {sorted(epochs)}: all {n_batches} batches ({n_samples} samples, labels "
        f"{', '.join(views)}) match zarr's own read [{dt:.2f} s]"
    )
    stats = pool.stats.as_dict()
    print(prefetch.report())
    print("pool stats: " + ", ".join(f"{k}={v:,}" for k, v in stats.items()))
    print(
        f"pool budget {pool.budget_bytes:,} bytes, slot memory allocated "
        f"{pool.allocated_bytes:,} bytes, batch buffers allocated {gather.buffer_allocations}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        return run(args.path, args)
    with tempfile.TemporaryDirectory(prefix="insitu-compose-") as tmp:
        return run(Path(tmp) / "era5.zarr", args)


if __name__ == "__main__":
    sys.exit(main())
