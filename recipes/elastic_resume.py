"""Resume a run on a different number of ranks (elastic resume), and check what it delivered.

A preemptible job ran on ``--old-world`` ranks and saved rank 0's loader state after ``--cut``
batches of an epoch; it comes back on ``--new-world`` ranks. This recipe plays both halves in
one process (each "rank" is a pipeline built with an explicit ``rank``/``world_size``, exactly
what each process of a ``torch.distributed`` job builds), saves the state through
``torch.save``/``torch.load(weights_only=True)`` as a checkpoint would, and prints what the
interrupted epoch delivered over old and new ranks together: no sample twice, at most
``new_world - 1`` left out, equal batch counts on the new ranks. Every batch is checked against
zarr's own read of the same samples.

    .venv/bin/python recipes/elastic_resume.py --old-world 2 --new-world 3 --cut 2
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr

from insitubatch_nodes import (
    Batch,
    InSituPipeline,
    Loader,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.synthetic import make_era5_like


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", type=Path, help="store to write/read (default: a temporary folder)")
    p.add_argument("--n-time", type=int, default=200, help="time steps of the synthetic store")
    p.add_argument("--old-world", type=int, default=2, help="ranks before the preemption")
    p.add_argument("--new-world", type=int, default=3, help="ranks after it")
    p.add_argument("--cut", type=int, default=2, help="batches each old rank delivered")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--remainder", choices=("drop", "pad"), default="drop")
    return p.parse_args(argv)


def build(path: Path, rank: int, world: int, args: argparse.Namespace) -> InSituPipeline:
    t2m = open_geometries(path, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (0.8, 0.1, 0.1))
    return insitu_pipeline(
        path,
        manifest,
        {"x": t2m, "y": t2m.shift(1)},
        batch_size=args.batch_size,
        block_chunks=4,
        seed=7,
        rank=rank,
        world_size=world,
        remainder=args.remainder,
    )


def check(batch: Batch, full: np.ndarray) -> list[int]:
    for label, idx in batch.sample_indices.items():
        np.testing.assert_array_equal(batch.arrays[label], full[np.asarray(idx)])
    return [int(i) for i in batch.sample_indices["x"]]


def run(path: Path, args: argparse.Namespace) -> int:
    full = np.asarray(zarr.open_group(path, mode="r")["t2m"][...])
    delivered: list[int] = []
    # -- before the preemption: every old rank delivers --cut batches; rank 0's state is saved
    checkpoint = io.BytesIO()
    for rank in range(args.old_world):
        pipe = build(path, rank, args.old_world, args)
        loader = Loader(pipe)
        it = iter(loader)
        for _ in range(args.cut):
            delivered.extend(check(next(it), full))
        if rank == 0:
            n_old = len(loader)
            torch.save(loader.state_dict(), checkpoint)
        pipe.close()
    print(f"{args.old_world} ranks delivered {args.cut} of {n_old} batches each, then stopped")
    # -- after it: every new rank loads the same (rank 0's) state
    checkpoint.seek(0)
    state = torch.load(checkpoint, weights_only=True)
    counts = []
    for rank in range(args.new_world):
        pipe = build(path, rank, args.new_world, args)
        loader = Loader(pipe)
        loader.load_state_dict(state)
        told = len(loader)
        batches = [check(b, full) for b in loader]  # the rest of the interrupted epoch
        counts.append(len(batches))
        delivered.extend(i for b in batches for i in b)
        print(
            f"new rank {rank}: batches {args.cut}..{told - 1} of the interrupted epoch "
            f"({len(batches)} batches); a full epoch now has {pipe.stages.plan.epoch_len}"
        )
        pipe.close()
    t2m = open_geometries(path, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (0.8, 0.1, 0.1))
    train = manifest.chunks("train")
    spc = manifest.samples_per_chunk
    # an anchor is valid when y = x.shift(1) lies in the array and in a train chunk too
    in_train = set(train)
    valid = {
        a
        for c in train
        for a in range(c * spc, (c + 1) * spc)
        if a + 1 < t2m.shape[0] and (a + 1) // spc in in_train
    }
    n_valid = len(valid)
    seen = set(delivered)
    twice = len(delivered) - len(seen)
    left_out = len(valid - seen)
    print(
        f"interrupted epoch over old and new ranks: {len(delivered)} samples delivered, "
        f"{twice} twice, {left_out} of {n_valid} valid left out; "
        f"new ranks' batch counts {sorted(set(counts))}"
    )
    ok = len(set(counts)) == 1 and seen <= valid
    if args.remainder == "drop":
        ok = ok and twice == 0 and left_out <= args.new_world - 1
    else:
        ok = ok and left_out == 0 and twice <= args.old_world + args.new_world - 2
    print("every batch matches zarr's own read" if ok else "CHECK FAILED")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        if not args.path.exists():
            make_era5_like(args.path, n_time=args.n_time, n_lat=8, n_lon=16, samples_per_chunk=8)
        return run(args.path, args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "era5.zarr"
        make_era5_like(path, n_time=args.n_time, n_lat=8, n_lon=16, samples_per_chunk=8)
        return run(path, args)


if __name__ == "__main__":
    sys.exit(main())
