"""Train a segmenter on every (t, z) plane of a time-lapse stack: product sample axes.

The store holds a time-lapse ``image (t, c, z, y, x)`` (two channels) and its mask ``labels
(t, 1, z, y, x)``, both stored in blocks of 2 time points x 3 planes (the views of one
pipeline share the product grid). ``open_geometries(store, sample_axis=("t", "z"))`` makes
each (t, z) pair one sample of shape ``(c, y, x)``, so planes from different time points and
depths are drawn as one block-shuffled stream; ``split_by_chunk`` keeps whole stored (t, z)
blocks in training or validation. ``geom.sample_coords(batch.sample_indices["image"])`` gives
each row's (t, z); the first batch is checked against zarr's own read (``image[t, :, z]``).

A two-layer convolutional network learns the mask (bright blobs) on the CPU; the recipe prints
the loss per epoch and the validation pixel accuracy against the all-background one.

    .venv/bin/python recipes/timelapse_planes.py
    .venv/bin/python recipes/timelapse_planes.py --time-points 6 --planes 10 --epochs 2
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
    ArrayGeometry,
    Batch,
    InSituPipeline,
    Loader,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    to_torch,
)

SIZE = 48


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
    p.add_argument("--path", type=Path, help="folder for the store (default: a temporary one)")
    p.add_argument("--time-points", type=int, default=5, help="length along t")
    p.add_argument("--planes", type=int, default=7, help="length along z")
    p.add_argument("--epochs", type=_epochs, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="planes per batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_stack(root: Path, args: argparse.Namespace) -> None:
    """``image (t, 2, z, y, x)`` and ``labels (t, 1, z, y, x)``, both stored in (2 t x 3 z)
    blocks (edge blocks where the lengths are not multiples)."""
    rng = np.random.default_rng(args.seed)
    n_t, n_z = args.time_points, args.planes
    yy, xx = np.mgrid[:SIZE, :SIZE]
    labels = np.zeros((n_t, 1, n_z, SIZE, SIZE), dtype="u1")
    for t in range(n_t):
        for z in range(n_z):
            for _ in range(2):
                cy, cx = rng.integers(8, SIZE - 8, size=2).tolist()
                r = int(rng.integers(4, 8))
                labels[t, 0, z][(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = 1
    image = rng.normal(100, 10, size=(n_t, 2, n_z, SIZE, SIZE)) + 60 * labels
    group = zarr.open_group(root, mode="w", zarr_format=3)
    dims = ("t", "c", "z", "y", "x")
    a = group.create_array(
        "image", shape=image.shape, chunks=(2, 2, 3, SIZE, SIZE), dtype="f4", dimension_names=dims
    )
    a[:] = image
    b = group.create_array(
        "labels", shape=labels.shape, chunks=(2, 1, 3, SIZE, SIZE), dtype="u1", dimension_names=dims
    )
    b[:] = labels
    print(f"wrote {n_t} time points x {n_z} planes to {root}")


def normalise(batch: Batch) -> Batch:
    """A batch transform: the image standardised (channels kept), labels as int64 (y, x)."""
    image = batch["image"].astype(np.float32)
    batch.arrays = {
        "image": (image - 100.0) / 40.0,
        "labels": batch["labels"][:, 0].astype(np.int64),
    }
    return batch


def check_first_batch(root: Path, image: ArrayGeometry, pipe: InSituPipeline) -> None:
    """Each row of one batch is ``image[t, :, z]`` as zarr reads it, for the row's (t, z)."""
    batch = next(iter(Loader(pipe)))
    array = zarr.open_array(root, path="image", mode="r")
    tz = image.sample_coords(batch.sample_indices["image"])
    for r, (t, z) in enumerate(tz):
        assert np.array_equal(batch["image"][r], array[t, :, z])
    print(
        f"first batch: {len(batch)} planes from {len(set(tz[:, 0].tolist()))} time points, "
        "equal to zarr's read"
    )


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
    root = folder / "timelapse.zarr"
    write_stack(root, args)
    geoms = open_geometries(root, sample_axis=("t", "z"))
    views = {"image": geoms["image"], "labels": geoms["labels"]}
    image = views["image"]
    print(f"{image.n_chunks} stored (t, z) blocks of up to {image.samples_per_chunk} planes")
    manifest = split_by_chunk(image, (0.75, 0.25, 0.0), contiguous=False, seed=args.seed)
    common: dict[str, Any] = {"batch_size": args.batch_size, "seed": args.seed}
    check = insitu_pipeline(root, manifest, views, **common)
    with check:
        check_first_batch(root, image, check)
    train = insitu_pipeline(root, manifest, views, batch_transforms=[normalise], **common)
    valid = insitu_pipeline(
        root, manifest, views, split="val", shuffle=False, batch_transforms=[normalise], **common
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 8, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 2, kernel_size=1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses: list[float] = []
    acc = baseline = 0.0
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
