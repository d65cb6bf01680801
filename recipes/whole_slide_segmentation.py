"""Segment a whole-slide-like plane from random 256 x 256 patches, reading only their tiles.

The store holds ``image (2, N, N)`` float32 in 512 x 512 tiles and a ``mask (2, N, N)`` uint8
in 1024 x 1024 tiles (two planes: plane 0 trains, plane 1 validates; N = 20,000 by default, a
1.6 GB plane). ``image.patches({"y": 256, "x": 256}, origins="random")`` makes a sample a
256 x 256 window; the mask is patched alike, so both take the same windows row for row. The
pool holds the stored tiles the windows touch (a budget of ``--budget-mib``; by default the
automatic one: 588 MiB at the default size, far below the plane; on a small plane such as
``--size 4096`` one block of random windows touches every tile and the budget is the whole
80 MiB plane, as the run prints). Validation reads plane 1 on a grid of windows that covers it.

A two-layer convolutional network learns the mask on the CPU; the loss per epoch and the
validation pixel accuracy (against predicting background everywhere) are printed.

    .venv/bin/python recipes/whole_slide_segmentation.py                 # 20,000 x 20,000
    .venv/bin/python recipes/whole_slide_segmentation.py --size 4096 --steps 20
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

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk, to_torch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--path", type=Path, help="store to write (or reuse); default: a temp folder")
    p.add_argument("--size", type=int, default=20_000, help="Y and X extent of each plane")
    p.add_argument("--tile", type=int, default=512, help="image tile side (the mask's is 2x)")
    p.add_argument("--patch", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="batches per epoch (at most)")
    p.add_argument("--budget-mib", type=int, default=None, help="pool budget (default: floor)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _field(y: np.ndarray, x: np.ndarray, plane: int) -> np.ndarray:
    """A smooth synthetic 'tissue' intensity; its mask is where it is bright."""
    return (np.sin(y / 37.0 + plane) + np.cos(x / 53.0) + np.sin((x + y) / 71.0 - plane)).astype(
        "f4"
    )


def write_slide(path: Path, size: int, tile: int) -> None:
    """Write both planes tile by tile (the plane never exists whole in memory)."""
    image = zarr.create_array(
        str(path), name="image", shape=(2, size, size), chunks=(1, tile, tile), dtype="f4",
        dimension_names=("z", "y", "x"),
    )  # fmt: skip
    mask = zarr.create_array(
        str(path), name="mask", shape=(2, size, size), chunks=(1, 2 * tile, 2 * tile),
        dtype="u1", dimension_names=("z", "y", "x"),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    step = 2 * tile
    for plane in range(2):
        for y0 in range(0, size, step):
            for x0 in range(0, size, step):
                y = np.arange(y0, min(y0 + step, size))[:, None]
                x = np.arange(x0, min(x0 + step, size))[None, :]
                clean = _field(y, x, plane)
                noisy = clean + rng.normal(0, 0.3, clean.shape).astype("f4")
                image[plane, y0 : y0 + len(y), x0 : x0 + x.shape[1]] = noisy
                mask[plane, y0 : y0 + len(y), x0 : x0 + x.shape[1]] = clean > 1.0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or Path(tmp) / "slide.zarr"
        if not (path / "zarr.json").exists():
            t0 = time.perf_counter()
            write_slide(path, args.size, args.tile)
            print(f"wrote a {args.size:,}^2 two-plane slide in {time.perf_counter() - t0:.1f} s")
        geoms = open_geometries(str(path), ["image", "mask"])
        manifest = split_by_chunk(geoms["image"], (0.5, 0.5, 0.0))  # plane 0 / plane 1
        window = {"y": args.patch, "x": args.patch}
        train = {
            "x": geoms["image"].patches(window, origins="random"),
            "y": geoms["mask"].patches(window, origins="random"),
        }
        budget = None if args.budget_mib is None else args.budget_mib * 2**20
        pipe = insitu_pipeline(
            str(path), manifest, train, batch_size=args.batch_size, seed=args.seed,
            cache_budget_bytes=budget, coords=(),
        )  # fmt: skip
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 1, 1)
        )
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        losses = []
        for epoch in range(args.epochs):
            total, n, t0 = 0.0, 0, time.perf_counter()
            for step, batch in enumerate(Loader(pipe)):
                if step == args.steps:
                    break
                t = to_torch(batch)
                x = t["x"].unsqueeze(1)
                y = t["y"].unsqueeze(1).float()
                loss = loss_fn(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, n = total + loss.item(), n + 1
            losses.append(total / max(n, 1))
            stats = pipe.stats()
            plane = (geoms["image"].chunk_nbytes + geoms["mask"].chunk_nbytes) / 2**20
            print(
                f"epoch {epoch}: loss {losses[-1]:.4f} over {n} batches in "
                f"{time.perf_counter() - t0:.1f} s; pool peak "
                f"{stats['resident_peak_bytes'] / 2**20:.1f} MiB of tiles (a plane of image "
                f"and mask: {plane:.1f} MiB), {stats['gets']} tile GETs so far"
            )
        pipe.close()
        if losses[-1] < losses[0]:
            print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
        val = {
            "x": geoms["image"].patches(window),  # a grid of windows covering plane 1
            "y": geoms["mask"].patches(window),
        }
        check = insitu_pipeline(
            str(path), manifest, val, split="val", batch_size=args.batch_size, shuffle=False,
            coords=(),
        )  # fmt: skip
        right = pixels = fg = 0
        with torch.no_grad():
            for step, batch in enumerate(Loader(check)):
                if step == args.steps:
                    break
                t = to_torch(batch)
                pred = model(t["x"].unsqueeze(1)).squeeze(1) > 0
                truth = t["y"].bool()
                right += int((pred == truth).sum())
                fg += int(truth.sum())
                pixels += truth.numel()
        check.close()
        acc, base = right / pixels, 1 - fg / pixels
        verdict = "above" if acc > base else "not above"
        print(f"validation pixel accuracy {acc:.3f}, {verdict} the all-background {base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
