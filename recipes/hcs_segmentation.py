"""Train a tiny Z-plane segmenter on every field of an OME-NGFF HCS plate as one stream, split
by well.

The plate is written with ome-zarr-py's writer (``insitubatch_nodes.synthetic.make_hcs_plate``:
NGFF 0.5 on zarr v3 by default, ``--ngff 0.4`` for zarr v2): ``--rows x --columns`` wells of
``--fields`` fields, each a multiscale image ``(T, C, Z, Y, X)`` (one Z plane per chunk) with a
label image ``cells``. ``read_plate`` reads its metadata (all wells, then all fields,
concurrently) and says which level it chose; ``open_plate(..., labels=["cells"],
sample_axis="z")`` makes the fields one collection whose variables are ``image`` and
``labels/cells``: one sample is one Z plane of one field, drawn from all fields as one
block-shuffled stream. ``split_by_member(..., by="well")`` puts whole wells in training or
validation, never both; every row names its field (``batch.members``) and its plane
(``batch.sample_indices``), and the first batch is checked against zarr's own read.

A batch transform folds T into the batch and standardises each plane per channel; a two-layer
convolutional network learns the labels on the CPU, printing the loss per epoch and the
validation pixel accuracy against the all-background one.

A timelapse plate (``--t 3``) can be drawn as (t, z) planes instead, with ``--tz``: product
sample axes on the collection, ``open_plate(..., sample_axis=("t", "z"))``, every (t, z) plane
of every field one sample of the same stream (``coll["image"].sample_coords(...)`` gives each
row's (t, z) within its field).

    .venv/bin/python recipes/hcs_segmentation.py
    .venv/bin/python recipes/hcs_segmentation.py --rows 3 --columns 4 --fields 3 --level 1.3
    .venv/bin/python recipes/hcs_segmentation.py --t 3 --tz
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
    open_plate,
    split_by_member,
    to_torch,
)
from insitubatch_nodes.io.ngff import read_plate
from insitubatch_nodes.synthetic import make_hcs_plate


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
        help="plate folder; written if it does not exist yet (default: a temporary folder)",
    )
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--columns", type=int, default=3)
    p.add_argument("--fields", type=int, default=2, help="fields (images) per well")
    p.add_argument("--t", type=int, default=1, help="time points per field")
    p.add_argument("--z", type=int, default=8, help="Z planes per field")
    p.add_argument("--tz", action="store_true", help="draw (t, z) planes: product sample axes")
    p.add_argument("--yx", type=int, default=64, help="Y and X extent of each field")
    p.add_argument("--ngff", choices=("0.4", "0.5"), default="0.5", help="NGFF version to write")
    p.add_argument(
        "--level",
        type=float,
        default=0,
        help="resolution level: an index (0, 1) or, with a fraction, a pixel size in "
        "micrometers (0.65 is level 0, 1.3 level 1)",
    )
    p.add_argument("--val-wells", type=float, default=0.34, help="fraction of wells to validate")
    p.add_argument("--epochs", type=_epochs, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="Z planes per batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def ensure_plate(path: Path, args: argparse.Namespace) -> None:
    if (path / "zarr.json").exists() or (path / ".zattrs").exists():
        print(f"using the existing plate at {path}")
        return
    make_hcs_plate(
        path, rows=args.rows, columns=args.columns, fields=args.fields,
        shape=(args.t, 2, args.z, args.yx, args.yx), levels=2, labels=("cells",),
        ngff_version=args.ngff, seed=args.seed,
    )  # fmt: skip
    print(f"wrote a synthetic NGFF {args.ngff} plate with ome-zarr-py to {path}")


def standardise(batch: Batch) -> Batch:
    """(B, T, C, Y, X) uint16 -> (B*T, C, Y, X) float32, each plane and channel standardised;
    the label ids (B, T, 1, Y, X) -> (B*T, Y, X) foreground 1 / background 0. (t, z) planes
    come as (B, C, Y, X): one time point each."""
    image, labels = batch["image"], batch["labels/cells"]
    if image.ndim == 4:  # (t, z) planes
        image, labels = image[:, None], labels[:, None]
    b, t, c, y, x = image.shape
    planes = image.reshape(b * t, c, y, x).astype(np.float32)
    planes -= planes.mean(axis=(2, 3), keepdims=True)
    planes /= np.maximum(planes.std(axis=(2, 3), keepdims=True), 1.0)
    foreground = (labels.reshape(b * t, y, x) > 0).astype(np.int64)
    batch.arrays = {"image": planes, "labels/cells": foreground}
    return batch


def check_first_batch(coll: Collection, pipe: InSituPipeline, path: Path) -> None:
    """Each row of one batch is its field's Z plane (or (t, z) plane) as zarr reads it."""
    batch = next(iter(Loader(pipe)))
    for variable in ("image", "labels/cells"):
        where = coll[variable].sample_coords(batch.sample_indices[variable])  # (z) or (t, z)
        for r in range(len(batch)):
            m = int(batch.members[variable][r])
            array = zarr.open_array(str(path), path=coll.paths(variable)[m], mode="r")
            if where.shape[1] == 2:
                expected = array[int(where[r, 0]), :, int(where[r, 1])]
            else:
                expected = array[:, :, int(where[r, 0])]
            assert np.array_equal(batch[variable][r], expected), (variable, r)
    fields = sorted({coll.members[m] for m in batch.members["image"].tolist()})
    print(f"first batch: {len(batch)} planes from {len(fields)} fields, equal to zarr's read")


def wells_in(coll: Collection, pipe: InSituPipeline) -> set[str]:
    """The wells one pass of ``pipe`` delivers rows from."""
    wells: set[str] = set()
    for batch in Loader(pipe):
        wells.update(str(coll.keys["well"][m]) for m in batch.members["image"].tolist())
    return wells


def pixel_accuracy(model: torch.nn.Module, pipe: InSituPipeline) -> tuple[float, float]:
    correct = total = background = 0
    model.eval()
    with torch.no_grad():
        for batch in Loader(pipe):
            t = to_torch(batch)
            pred = model(t["image"]).argmax(dim=1)
            correct += int((pred == t["labels/cells"]).sum())
            background += int((t["labels/cells"] == 0).sum())
            total += t["labels/cells"].numel()
    model.train()
    return correct / max(total, 1), background / max(total, 1)


def run(path: Path, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    ensure_plate(path, args)
    level: Any = int(args.level) if float(args.level).is_integer() else args.level
    print(read_plate(path, level=level, labels=["cells"]).describe())
    axes: Any = ("t", "z") if args.tz else "z"
    coll = open_plate(path, level=level, labels=["cells"], sample_axis=axes)
    product = coll["image"].product
    if product is None:
        print(f"{coll}: {int(coll.lengths.sum())} Z planes in {len(coll)} fields")
    else:
        n_t, n_z = product.lengths
        planes = len(coll) * n_t * n_z
        print(f"{coll}: {planes} (t, z) planes ({n_t} x {n_z}) in {len(coll)} fields")
    n_wells = len(set(coll.keys["well"].tolist()))
    split = split_by_member(
        coll, {"train": 1.0 - args.val_wells, "val": args.val_wells}, by="well", seed=args.seed
    )
    views = {"image": coll["image"], "labels/cells": coll["labels/cells"]}
    common: dict[str, Any] = {"batch_size": args.batch_size, "seed": args.seed}
    with insitu_pipeline(coll, split, views, **common) as check:
        check_first_batch(coll, check, path)
    train = insitu_pipeline(coll, split, views, batch_transforms=[standardise], **common)
    val = insitu_pipeline(
        coll, split, views, split="val", shuffle=False, batch_transforms=[standardise], **common
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 8, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 2, kernel_size=1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses: list[float] = []
    with train, val:
        train_wells, val_wells = wells_in(coll, train), wells_in(coll, val)
        print(
            f"split by well: train {sorted(train_wells)}, val {sorted(val_wells)} "
            f"({n_wells} wells; {'disjoint' if not train_wells & val_wells else 'OVERLAPPING'})"
        )
        loader = Loader(train)
        for epoch in range(args.epochs):
            epoch_losses = []
            for batch in loader:  # each iter() of the Loader starts the next epoch
                t = to_torch(batch)
                loss = torch.nn.functional.cross_entropy(model(t["image"]), t["labels/cells"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                epoch_losses.append(loss.item())
            losses.append(float(np.mean(epoch_losses)))
            acc, baseline = pixel_accuracy(model, val)
            print(
                f"epoch {epoch}: {len(epoch_losses)} batches, mean loss {losses[-1]:.4f}, "
                f"val pixel accuracy {acc:.3f} (all-background {baseline:.3f})"
            )
    fell = len(losses) > 1 and losses[-1] < losses[0]
    disjoint = bool(train_wells) and bool(val_wells) and not train_wells & val_wells
    print(f"loss {'fell' if fell else 'did NOT fall'}: {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"val pixel accuracy {acc:.3f}, {'above' if acc > baseline else 'NOT above'} the "
          f"all-background {baseline:.3f}")  # fmt: skip
    return 0 if fell and acc > baseline and disjoint else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        return run(args.path, args)
    with tempfile.TemporaryDirectory(prefix="insitu-hcs-") as tmp:
        return run(Path(tmp) / "plate.zarr", args)


if __name__ == "__main__":
    sys.exit(main())
