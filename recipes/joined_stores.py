"""Several stores as one timeline: an archive split over stores, and a forcing store joined.

Two things weather archives need, on small synthetic stores (6-hourly, CF ``time`` in hours):

1. **An archive split over stores** — a back-extension, the main archive and a near-real-time
   tail that repeats the archive's last day — read with ``concat(..., overlap="first")`` as one
   timeline (the archive's steps win over the tail's repeat), with a ``12h`` stride, a window
   in time deltas and each row's time carried; the first batch is checked against zarr's reads
   of the stores joined with numpy.
2. **Variables of two stores at the same times** — ``t2m`` in an atmosphere store and ``sst``
   in a forcing store that starts earlier and is chunked differently — joined by their times
   with ``Collection.join``; a linear model learns ``t2m(t)`` from ``t2m(t - 6h)`` and
   ``sst(t)`` on the CPU, and the recipe prints the loss per epoch. With ``--atmos-stores N``
   the atmosphere is itself split over ``N`` stores (a back-extension and the main archive),
   concatenated with ``concat(...)`` and joined as one of the join's stores: the joined axis is
   cut where the atmosphere's stores meet (``batch.members`` names each row's piece), windows
   run across the cut, and every row is checked against the data written at its time.

    .venv/bin/python recipes/joined_stores.py
    .venv/bin/python recipes/joined_stores.py --steps 400 --epochs 3
    .venv/bin/python recipes/joined_stores.py --atmos-stores 2
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

from insitubatch_nodes import Collection, Loader, concat, insitu_pipeline, split_by_chunk, to_torch

EPOCH = np.datetime64("2000-01-01T00", "ns")
HOUR = np.timedelta64(1, "h")


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
    p.add_argument("--steps", type=int, default=240, help="6-hourly steps of the joined stores")
    p.add_argument("--epochs", type=_epochs, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--atmos-stores",
        type=int,
        default=1,
        help="write the atmosphere as this many stores, concatenated, then joined",
    )
    args = p.parse_args(argv)
    if args.atmos_stores < 1 or args.steps < 24 * args.atmos_stores:
        p.error("--atmos-stores needs >= 1 and --steps of 24 or more per atmosphere store")
    return args


def write(root: Path, name: str, data: np.ndarray, first_hour: int, chunk: int) -> None:
    """``name (time, lat, lon)`` chunked ``chunk`` along time, and its 6-hourly CF ``time``."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array(name, shape=data.shape, chunks=(chunk, *data.shape[1:]),
                               dtype="f4", dimension_names=("time", "lat", "lon"))  # fmt: skip
    array[:] = data
    time = group.create_array("time", shape=(len(data),), chunks=(len(data),), dtype="i8",
                              dimension_names=("time",))  # fmt: skip
    time[:] = first_hour + 6 * np.arange(len(data))
    time.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})


def read(root: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    group = zarr.open_group(root, mode="r")
    return np.asarray(group[name][:]), EPOCH + np.asarray(group["time"][:]) * HOUR


def archive_in_three_stores(folder: Path, rng: np.random.Generator) -> None:
    """Back-extension (32 steps), main (32), near-real-time tail repeating main's last 8."""
    data = rng.normal(size=(88, 4, 8)).astype("f4")
    parts = [("back", 0, 32), ("main", 32, 64), ("nrt", 56, 88)]  # (name, first step, end)
    for name, lo, hi in parts:
        write(folder / f"{name}.zarr", "t2m", data[lo:hi], 6 * lo, chunk=8)
    stores = [folder / f"{name}.zarr" for name, _, _ in parts]
    coll = concat(stores, ["t2m"], dim="time", overlap="first")  # main's steps win
    kept = [read(stores[0], "t2m"), read(stores[1], "t2m")]
    nrt, nrt_times = read(stores[2], "t2m")
    kept.append((nrt[8:], nrt_times[8:]))  # the tail's first chunk: main's last day again
    joined = np.concatenate([d for d, _ in kept])
    times = np.concatenate([t for _, t in kept])
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    view = coll["t2m"].window(["-6h", "0h"])
    with insitu_pipeline(coll, manifest, {"t2m": view}, stride="12h", coords=["time"],
                         batch_size=8) as pipe:  # fmt: skip
        batch = next(iter(Loader(pipe)))
    rows = batch.sample_indices["t2m"]
    assert np.array_equal(batch["t2m"], joined[rows])
    assert np.array_equal(batch.coords["t2m"]["time"], times[rows])
    print(f"archive: {coll['t2m'].n_samples} steps from 3 stores ({times[0]} .. {times[-1]}), "
          "first batch equal to zarr's read")  # fmt: skip


def forcing_joined(folder: Path, args: argparse.Namespace, rng: np.random.Generator) -> int:
    """t2m(t) = 0.8 t2m(t - 6h) + 0.5 sst(t) + noise; sst from a store 24 steps earlier."""
    n, lead = args.steps, 24
    sst = rng.normal(size=(n + lead, 4, 8)).astype("f4")
    t2m = np.zeros((n, 4, 8), dtype="f4")
    for t in range(1, n):
        t2m[t] = 0.8 * t2m[t - 1] + 0.5 * sst[lead + t] + 0.1 * rng.normal(size=(4, 8))
    write(folder / "forcing.zarr", "sst", sst, -6 * lead, chunk=12)
    # the atmosphere in --atmos-stores pieces: each cut on a chunk of both stores (every 24
    # steps: 8-step chunks of t2m, 12-step chunks of sst from 24 steps earlier)
    k = args.atmos_stores
    cuts = [0, *(i * n // k // 24 * 24 for i in range(1, k)), n]
    atmos: Any = folder / "atmos.zarr"
    if k == 1:
        write(atmos, "t2m", t2m, 0, chunk=8)
    else:
        parts = [folder / f"atmos{i}.zarr" for i in range(k)]
        for part, lo, hi in zip(parts, cuts, cuts[1:], strict=False):
            write(part, "t2m", t2m[lo:hi], 6 * lo, chunk=8)
        atmos = concat(parts, ["t2m"], dim="time")  # one of the join's stores
    coll = Collection.join(
        {"atmos": (atmos, ["t2m"]), "forcing": (folder / "forcing.zarr", ["sst"])}
    )
    print(f"joined: {coll['atmos/t2m'].n_samples} shared steps of atmos ({k} store(s)) and "
          f"forcing, members {[Path(m).name for m in coll.members]}")  # fmt: skip
    views = {"t2m": coll["atmos/t2m"].window(["-6h", "0h"]), "sst": coll["forcing/sst"]}
    manifest = split_by_chunk(coll["atmos/t2m"], (1.0, 0.0, 0.0))
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses: list[float] = []
    pieces: set[int] = set()
    across = 0  # windows whose two steps come from two atmosphere stores
    with insitu_pipeline(coll, manifest, views, coords=["time"], batch_size=args.batch_size,
                         seed=args.seed) as pipe:  # fmt: skip
        loader = Loader(pipe)
        for epoch in range(args.epochs):
            epoch_losses = []
            for batch in loader:
                times = batch.coords["t2m"]["time"][:, 1]
                assert np.array_equal(times, batch.coords["sst"]["time"])  # one time per row
                at = (times - EPOCH) // (6 * HOUR)  # each row's step, as written
                assert np.array_equal(batch["t2m"], np.stack([t2m[at - 1], t2m[at]], axis=1))
                assert np.array_equal(batch["sst"], sst[lead + at])
                steps_of = batch.members["t2m"]  # each window step's piece
                pieces.update(steps_of.ravel().tolist())
                across += int((steps_of[:, 0] != steps_of[:, 1]).sum())
                t = to_torch(batch)
                x = torch.stack([t["t2m"][:, 0], t["sst"]], dim=-1).reshape(-1, 2)
                loss = torch.nn.functional.mse_loss(model(x)[:, 0], t["t2m"][:, 1].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                epoch_losses.append(loss.item())
            losses.append(float(np.mean(epoch_losses)))
            print(f"epoch {epoch}: {len(epoch_losses)} batches, mean loss {losses[-1]:.4f}")
    print(f"every row equal to the data written at its time, from {len(pieces)} piece(s); "
          f"{across} windows across a cut")  # fmt: skip
    weights = [round(float(w), 2) for w in model.weight[0].detach()]
    fell = len(losses) > 1 and losses[-1] < losses[0]
    print(f"loss {'fell' if fell else 'did NOT fall'}: {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"weights {weights} (truth [0.8, 0.5])")  # fmt: skip
    return 0 if fell else 1


def run(folder: Path, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    archive_in_three_stores(folder, rng)
    return forcing_joined(folder, args, rng)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        args.path.mkdir(parents=True, exist_ok=True)
        return run(args.path, args)
    with tempfile.TemporaryDirectory() as tmp:
        return run(Path(tmp), args)


if __name__ == "__main__":
    sys.exit(main())
