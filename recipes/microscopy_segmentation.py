"""Train a tiny per-pixel segmenter in place on a synthetic microscopy stack, sampled along Z.

The store holds a 5-D ``image (T, C, Z, Y, X)`` and a label ``mask (T, 1, Z, Y, X)`` chunked
differently along Z (1 plane per image chunk, Z/4 per mask chunk, the mask also tiled in Y/X).
With ``open_geometries(store, sample_axis=2)`` one sample is one Z plane of both arrays:
``image`` gives ``(T, C, Y, X)`` and ``mask`` gives ``(T, 1, Y, X)`` per sample. The split is
drawn on the mask's (coarser) Z grid so no mask chunk straddles train and validation.

A ``batch_transform`` (run on the pipeline's thread, off the training loop) folds T into the
batch, normalises the image per channel and turns the label ids into foreground/background.
A two-layer convolutional network (3x3 then 1x1) is trained on the CPU for a few epochs through
``to_torch`` (zero-copy), printing the loss per epoch and the validation pixel accuracy.

    .venv/bin/python recipes/microscopy_segmentation.py
    .venv/bin/python recipes/microscopy_segmentation.py --epochs 2 --z 32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.abc.store import Store

from insitubatch_nodes import (
    ArrayGeometry,
    Batch,
    BatchTransform,
    InSituPipeline,
    Loader,
    SplitManifest,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
    to_torch,
)
from insitubatch_nodes.synthetic import make_microscopy_like


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
    p.add_argument(
        "--path",
        type=Path,
        help="microscopy-like zarr store; written if it does not exist yet "
        "(default: a temporary folder, removed afterwards)",
    )
    p.add_argument("--z", type=int, default=64, help="Z planes of the synthetic stack")
    p.add_argument("--yx", type=int, default=96, help="Y and X extent of the synthetic stack")
    p.add_argument("--epochs", type=_epochs, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="Z planes per batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def ensure_store(path: Path, args: argparse.Namespace) -> None:
    if (path / "zarr.json").exists() or (path / ".zgroup").exists():
        print(f"using the existing store at {path}")
        return
    yx = args.yx
    make_microscopy_like(
        path,
        shape=(2, 2, args.z, yx, yx),
        image_chunks=(1, 2, 1, yx, yx),  # one Z plane per chunk, one object per T
        # Z/4 planes per mask chunk (16 by default), 2 x 2 tiles in Y/X
        mask_chunks=(2, 1, max(1, args.z // 4), max(1, yx // 2), max(1, yx // 2)),
        seed=args.seed,
    )
    print(f"wrote a synthetic microscopy-like store to {path}")


def channel_stats(
    store: Store, image: ArrayGeometry, manifest: SplitManifest
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of the training planes, read with zarr (for normalisation)."""
    arr = zarr.open_array(store=store, path=image.path, mode="r")
    planes = manifest.samples("train")
    data = np.asarray(arr.get_orthogonal_selection((slice(None), slice(None), planes)))
    data = data.astype(np.float32)  # (T, C, Z, Y, X)
    mean = data.mean(axis=(0, 2, 3, 4))
    std = data.std(axis=(0, 2, 3, 4))
    return mean.astype(np.float32), np.maximum(std, 1.0).astype(np.float32)


def make_transform(mean: np.ndarray, std: np.ndarray) -> BatchTransform:
    """A batch transform: (B, T, C, Y, X) uint16 -> (B*T, C, Y, X) float32, mask -> 0/1."""
    m = mean[None, :, None, None]
    s = std[None, :, None, None]

    def transform(batch: Batch) -> Batch:
        image, mask = batch["image"], batch["mask"]
        b, t, c, y, x = image.shape
        planes = image.reshape(b * t, c, y, x).astype(np.float32)
        planes -= m
        planes /= s
        labels = (mask.reshape(b * t, y, x) > 0).astype(np.int64)
        batch.arrays = {"image": planes, "mask": labels}
        return batch

    return transform


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 8, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 2, kernel_size=1),
    )


def pixel_accuracy(model: torch.nn.Module, pipe: InSituPipeline) -> tuple[float, float]:
    """(accuracy, all-background baseline) over one pass of ``pipe``."""
    correct = total = background = 0
    model.eval()
    with torch.no_grad():
        for batch in Loader(pipe):
            t = to_torch(batch)
            pred = model(t["image"]).argmax(dim=1)
            correct += int((pred == t["mask"]).sum())
            background += int((t["mask"] == 0).sum())
            total += t["mask"].numel()
    model.train()
    return correct / max(total, 1), background / max(total, 1)


def run(path: Path, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    ensure_store(path, args)
    store = open_store(path)
    geoms = open_geometries(store, sample_axis=2)  # every data array, sampled along Z
    image, mask = geoms["image"], geoms["mask"]
    for g in (image, mask):
        print(
            f"{g.path}: shape {g.shape}, chunks {g.chunks}, {g.n_chunks} chunks of "
            f"{g.samples_per_chunk} Z plane(s), {g.n_tiles} object(s) each; "
            f"sample payload {g.inner_shape}"
        )
    # Whole mask chunks (16 planes) per split; the image's 1-plane chunks nest inside them.
    manifest = split_by_chunk(mask, (0.75, 0.25, 0.0))
    if not manifest.chunks("train") or not manifest.chunks("val"):
        print(f"the mask has {mask.n_chunks} Z chunk(s): too few for a train/val split")
        return 2
    print(
        f"split on the mask's Z grid: train planes {len(manifest.samples('train'))}, "
        f"val planes {len(manifest.samples('val'))}"
    )
    mean, std = channel_stats(store, image, manifest)
    transform = make_transform(mean, std)
    labels = {"image": image, "mask": mask}
    common = {"batch_size": args.batch_size, "batch_transforms": [transform], "seed": args.seed}
    train = insitu_pipeline(store, manifest, labels, split="train", **common)
    val = insitu_pipeline(store, manifest, labels, split="val", shuffle=False, **common)

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    acc0, baseline = pixel_accuracy(model, val)
    print(f"before training: val pixel accuracy {acc0:.3f} (all-background {baseline:.3f})")

    epoch_losses: list[float] = []
    acc = acc0
    t0 = time.perf_counter()
    with train, val:  # close() on exit: stops the threads, cancels fetches, unpins chunks
        loader = Loader(train)
        for epoch in range(args.epochs):
            losses: list[float] = []
            for batch in loader:  # each iter() of the Loader starts the next epoch
                t = to_torch(batch)  # zero-copy CPU tensors
                loss = torch.nn.functional.cross_entropy(model(t["image"]), t["mask"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            epoch_losses.append(float(np.mean(losses)))
            acc, _ = pixel_accuracy(model, val)
            print(
                f"epoch {epoch}: {len(losses)} batches, mean loss {epoch_losses[-1]:.4f} "
                f"(first {losses[0]:.4f}, last {losses[-1]:.4f}), val pixel accuracy {acc:.3f}"
            )
    dt = time.perf_counter() - t0
    stats = train.stats()
    print(
        f"trained {args.epochs} epochs in {dt:.1f} s; train pool: {stats['misses']} chunk "
        f"misses, {stats['hits']} hits, {stats['gets']} GETs"
    )
    fell = len(epoch_losses) > 1 and epoch_losses[-1] < epoch_losses[0]
    learned = acc > baseline
    print(
        f"loss {'fell' if fell else 'did NOT fall'}: {epoch_losses[0]:.4f} -> "
        f"{epoch_losses[-1]:.4f}; val pixel accuracy {acc:.3f} "
        f"({'above' if learned else 'NOT above'} the all-background {baseline:.3f})"
    )
    return 0 if (fell and learned) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        return run(args.path, args)
    with tempfile.TemporaryDirectory(prefix="insitu-micro-") as tmp:
        return run(Path(tmp) / "micro.zarr", args)


if __name__ == "__main__":
    sys.exit(main())
