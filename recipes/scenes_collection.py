"""Train one segmenter on scenes kept in several stores, read as one shuffled stream.

Each of ``--stores`` zarr stores holds a few *scenes*: a stack ``image (n, 64, 64)`` (one plane
per chunk) with a label image ``labels (n, 64, 64)`` (two planes per chunk), ``n`` differing
from scene to scene. ``Collection.from_groups`` with ``(store, group)`` pairs makes all scenes
of all stores one collection: ``coll["image"]`` and ``coll["labels"]`` are views a pipeline
takes as labels, here cut into random ``32 x 32`` patches, drawn from every scene as one
block-shuffled stream. ``split_by_member`` keeps whole scenes in training or validation, never
both. Every row names its scene (``batch.members``) and its plane within it
(``batch.sample_indices``); the first batch is checked against zarr's own read.

A two-layer convolutional network learns the labels (bright blobs) on the CPU; the recipe
prints the loss per epoch and the validation pixel accuracy against the all-background one.

With ``--cache-dir``, two passes over the whole training planes (their mean and standard
deviation, what ``normalise`` assumes) go through a persistent cache there: the first keeps
every chunk it reads, the second reads them all back with no GET — each cached chunk checked
first against the store it came from (a changed object in any store would be read again).

    .venv/bin/python recipes/scenes_collection.py
    .venv/bin/python recipes/scenes_collection.py --stores 4 --scenes 5 --epochs 2
    .venv/bin/python recipes/scenes_collection.py --cache-dir /tmp/scenes-cache
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from insitubatch_nodes import (
    Batch,
    Collection,
    InSituPipeline,
    Loader,
    insitu_pipeline,
    split_by_member,
    to_torch,
)

SIZE = 64


def _epochs(text: str) -> int:
    """``--epochs``: at least 2, since the recipe's exit status says whether the loss fell
    from the first epoch to the last."""
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(
            f"{n}: at least 2 (the recipe checks that the loss fell from the first epoch to "
            "the last, which one epoch cannot show)"
        )
    return n


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", type=Path, help="folder for the stores (default: a temporary one)")
    p.add_argument("--stores", type=int, default=3, help="stores to spread the scenes over")
    p.add_argument("--scenes", type=int, default=4, help="scenes per store")
    p.add_argument("--epochs", type=_epochs, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="patches per batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, help="a persistent cache for two statistics passes")
    args = p.parse_args(argv)
    if args.stores < 1 or args.scenes < 1 or args.stores * args.scenes < 4:
        p.error(
            f"--stores {args.stores} x --scenes {args.scenes} makes fewer than 4 scenes: every "
            "4th scene is held out for validation, so give at least 4 (e.g. --stores 2 --scenes 2)"
        )
    return args


def write_scenes(folder: Path, args: argparse.Namespace) -> list[tuple[str, str]]:
    """``--stores`` stores of ``--scenes`` scenes each; returns the ``(store, group)`` pairs."""
    rng = np.random.default_rng(args.seed)
    pairs = []
    yy, xx = np.mgrid[:SIZE, :SIZE]
    for s in range(args.stores):
        root = folder / f"scenes{s}.zarr"
        group = zarr.open_group(root, mode="w", zarr_format=3)
        for k in range(args.scenes):
            n = int(rng.integers(3, 9))  # planes: every scene has its own
            labels = np.zeros((n, SIZE, SIZE), dtype="u1")
            for z in range(n):
                for _ in range(3):
                    cy, cx = rng.integers(8, SIZE - 8, size=2).tolist()
                    r = int(rng.integers(4, 9))
                    labels[z][(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = 1
            image = rng.normal(100, 10, size=labels.shape) + 60 * labels
            g = group.create_group(f"scene{k}")
            a = g.create_array("image", shape=image.shape, chunks=(1, SIZE, SIZE), dtype="f4")
            a[:] = image
            b = g.create_array("labels", shape=labels.shape, chunks=(2, SIZE, SIZE), dtype="u1")
            b[:] = labels
            pairs.append((str(root), f"scene{k}"))
    print(f"wrote {len(pairs)} scenes in {args.stores} stores under {folder}")
    return pairs


def normalise(batch: Batch) -> Batch:
    """A batch transform: the image standardised and given a channel axis, labels as int64."""
    image = batch["image"].astype(np.float32)
    batch.arrays = {
        "image": ((image - 100.0) / 40.0)[:, None],
        "labels": batch["labels"].astype(np.int64),
    }
    return batch


def check_first_batch(coll: Collection, pipe: InSituPipeline) -> None:
    """Each row of one batch is its scene's patch as zarr reads it."""
    batch = next(iter(Loader(pipe)))
    for r in range(len(batch)):
        m, z = int(batch.members["image"][r]), int(batch.sample_indices["image"][r])
        # the collection's store holds every member at its path (several stores: routed)
        array = zarr.open_array(coll.store, path=coll.paths("image")[m], mode="r")
        y0, x0 = (int(v) for v in batch.patch_origins["image"][r])
        assert np.array_equal(batch["image"][r], array[z, y0 : y0 + 32, x0 : x0 + 32])
    scenes = sorted({coll.members[m] for m in batch.members["image"].tolist()})
    print(f"first batch: {len(batch)} patches from {len(scenes)} scenes, equal to zarr's read")


def statistics_twice(
    coll: Collection, manifest: Any, common: dict[str, Any], cache_dir: Path
) -> None:
    """Two passes over the whole training planes through a persistent cache at ``cache_dir``
    (a collection over several stores: each checked as it would be alone)."""
    for run in ("first", "second"):
        with insitu_pipeline(coll, manifest, {"image": coll["image"]}, cache_dir=cache_dir,
                             persist=True, **common) as pipe:  # fmt: skip
            total = squares = n = 0.0
            for batch in Loader(pipe):
                x = batch["image"].astype(np.float64)
                total, squares, n = total + x.sum(), squares + (x * x).sum(), n + x.size
            stats = pipe.stats()
        mean = total / n
        print(f"{run} pass over the training planes: mean {mean:.1f}, std "
              f"{np.sqrt(squares / n - mean * mean):.1f}; {stats['gets']} GETs, "
              f"{stats['disk_hits']} chunks read from the cache")  # fmt: skip


def pixel_accuracy(model: torch.nn.Module, pipe: InSituPipeline) -> tuple[float, float]:
    correct = total = background = 0
    with torch.no_grad():
        for batch in Loader(pipe):
            t = to_torch(batch)
            pred = model(t["image"]).argmax(dim=1)
            correct += int((pred == t["labels"]).sum())
            background += int((t["labels"] == 0).sum())
            total += t["labels"].numel()
    return correct / max(total, 1), background / max(total, 1)


def run(folder: Path, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    pairs = write_scenes(folder, args)
    names = [f"{Path(store).stem}/{group}" for store, group in pairs]
    coll = Collection.from_groups(None, pairs, {"image": "image", "labels": "labels"}, names=names)
    print(f"{coll}: {int(coll.lengths.sum())} planes in {len(coll)} scenes")
    val = [n for i, n in enumerate(names) if i % 4 == 3]
    manifest = split_by_member(coll, {"train": [n for n in names if n not in val], "val": val})
    views = {v: coll[v].patches({1: 32, 2: 32}, origins="random") for v in ("image", "labels")}
    common: dict[str, Any] = {"batch_size": args.batch_size, "seed": args.seed}
    check = insitu_pipeline(coll, manifest, views, **common)
    with check:
        check_first_batch(coll, check)
    if args.cache_dir is not None:
        statistics_twice(coll, manifest, common, args.cache_dir)
    train = insitu_pipeline(coll, manifest, views, batch_transforms=[normalise], **common)
    grid = {v: coll[v].patches({1: 32, 2: 32}) for v in ("image", "labels")}
    valid = insitu_pipeline(
        coll, manifest, grid, split="val", shuffle=False, batch_transforms=[normalise], **common
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 2, kernel_size=1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses: list[float] = []
    with train, valid:
        loader = Loader(train)
        for epoch in range(args.epochs):
            epoch_losses = []
            for batch in loader:
                t = to_torch(batch)
                loss = torch.nn.functional.cross_entropy(model(t["image"]), t["labels"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                epoch_losses.append(loss.item())
            losses.append(float(np.mean(epoch_losses)))
            acc, baseline = pixel_accuracy(model, valid)
            print(
                f"epoch {epoch}: {len(epoch_losses)} batches, mean loss {losses[-1]:.4f}, "
                f"val pixel accuracy {acc:.3f} (all-background {baseline:.3f})"
            )
    fell = len(losses) > 1 and losses[-1] < losses[0]
    print(f"loss {'fell' if fell else 'did NOT fall'}: {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"val pixel accuracy {acc:.3f}, {'above' if acc > baseline else 'NOT above'} the "
          f"all-background {baseline:.3f}")  # fmt: skip
    return 0 if fell and acc > baseline else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        args.path.mkdir(parents=True, exist_ok=True)
        return run(args.path, args)
    with tempfile.TemporaryDirectory() as tmp:
        return run(Path(tmp), args)


if __name__ == "__main__":
    sys.exit(main())
