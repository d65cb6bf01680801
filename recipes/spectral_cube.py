"""Train in place on radio-astronomy spectral cubes: every channel an image, and sky patches
that keep the whole spectrum.

Two cubes of the same sky in two bands are written as FITS-converted cubes usually are:
``cube (stokes, freq, dec, ra)`` float32, blosc, NaN-blanked outside a circular primary beam
and in one flagged channel, the frequency in Hz *descending*, ``dec`` / ``ra`` in degrees as
1-d coordinates, ``BUNIT`` in the attributes. The low band holds a spectral line: diffuse
emission over the beam in a few channels.

1. **Every channel an image** (``sample_axis="freq"``): both cubes are one collection
   (``Collection.from_arrays``, each cube a member), sky patches (``--patch``) of every
   channel one shuffled stream, each row's frequency carried in ``batch.coords``
   (``coords=["freq"]``). A tiny network learns whether a patch is in the line from pixels
   standardised by statistics fitted on the training split (NaNs skipped and counted); the
   label comes from each row's own frequency. A run stopped mid-epoch and resumed from its
   state delivers the batches of the run never stopped.
2. **Sky patches with the whole spectrum, and sub-cubes**, of the Stokes I cube as source
   finding challenges ship it, ``cube_i (freq, dec, ra)``: with no axis to sample along,
   ``sample_axis=()`` makes the whole cube one sample, and its windows are the samples. A
   ``patches({"dec": ..., "ra": ...})`` view keeps every channel of the line's band in each
   window, the band taken by value, high to low as the axis runs
   (``sel(freq=slice(hi, lo))``, as xarray takes it), and two boxes of the sky (``within=``)
   are a spatial train/validation split; ``patches({"freq": ..., "dec": ..., "ra": ...})``
   cuts random 3-D sub-cubes (a 3-D U-Net's inputs). Several such cubes (a survey's
   pointings, or both bands' ``cube_i``) are one stream as the members of
   ``Collection.from_arrays([...], sample_axis=())`` (docs/collections.md, "Survey pointings").

Every row is checked against zarr's read of the cube at the member, channel and window the
batch names (the band: at the channels whose stored frequency lies in it, both ends
included, as xarray's ``sel`` keeps them); every patch of an epoch is delivered exactly once.

    .venv/bin/python recipes/spectral_cube.py
    .venv/bin/python recipes/spectral_cube.py --channels 64 --size 128 --epochs 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec

from insitubatch_nodes import (
    Batch,
    Collection,
    InSituPipeline,
    Loader,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    split_by_member,
    to_torch,
)
from insitubatch_nodes.statistics import fit_statistics

BANDS = {"lo": 1.42e9, "hi": 1.70e9}  # first (highest) channel of each cube, Hz
LINE = (1.412e9, 1.406e9)  # the line's channels in the low band, high to low
FLAGGED = 3  # a channel of each cube flagged whole (RFI): every value NaN


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
    p.add_argument("--path", type=Path, help="folder for the two cubes (default: temporary)")
    p.add_argument("--channels", type=int, default=32, help="channels per cube (1 MHz apart)")
    p.add_argument("--size", type=int, default=64, help="dec and ra extent in pixels")
    p.add_argument("--patch", type=int, default=32, help="sky patch extent in pixels")
    p.add_argument("--epochs", type=_epochs, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_cube(path: Path, f0: float, args: argparse.Namespace, seed: int) -> None:
    n, size = args.channels, args.size
    freq = f0 - np.arange(n) * 1e6  # Hz, descending
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((1, n, size, size)) * 1e-3).astype("f4")
    in_line = (freq <= LINE[0]) & (freq >= LINE[1])
    data[:, in_line] += 5e-3  # diffuse line emission over the whole beam
    yy, xx = np.mgrid[0:size, 0:size] - (size - 1) / 2
    data[:, :, yy**2 + xx**2 > (0.48 * size) ** 2] = np.nan  # blanked outside the beam
    data[:, FLAGGED] = np.nan
    group = zarr.open_group(path, mode="w", zarr_format=3)
    cube = group.create_array(
        "cube", shape=data.shape, chunks=(1, 8, args.patch, args.patch), dtype="f4",
        compressors=BloscCodec(cname="zstd"), fill_value=np.nan,
        dimension_names=("stokes", "freq", "dec", "ra"),
    )  # fmt: skip
    cube[...] = data
    cube.attrs.update({"BUNIT": "Jy/beam", "BTYPE": "Intensity", "SPECSYS": "TOPOCENT"})
    stokes_i = group.create_array(  # the same plane without the Stokes axis
        "cube_i", shape=data.shape[1:], chunks=(8, args.patch, args.patch), dtype="f4",
        compressors=BloscCodec(cname="zstd"), fill_value=np.nan,
        dimension_names=("freq", "dec", "ra"),
    )  # fmt: skip
    stokes_i[...] = data[0]
    axes = {
        "stokes": (np.array([1.0]), ""),
        "freq": (freq, "Hz"),
        "dec": (-30.0 + (np.arange(size) - size / 2) / 3600, "deg"),
        "ra": (150.0 - (np.arange(size) - size / 2) / 3600, "deg"),  # east to the left
    }
    for name, (values, units) in axes.items():
        coord = group.create_array(name, shape=values.shape, dtype="f8", dimension_names=(name,))
        coord[...] = values
        coord.attrs["units"] = units


def channels_as_images(paths: dict[str, Path], args: argparse.Namespace) -> bool:
    """Workload 1: every channel of both cubes, patches of the sky, one stream; a line
    detector trained on them. Returns whether its loss fell."""
    coll = Collection.from_arrays(
        [(paths[band], "cube") for band in BANDS], names=list(BANDS), sample_axis="freq"
    )
    cubes = [np.asarray(zarr.open_array(paths[b], path="cube", mode="r")[...]) for b in BANDS]
    freqs = [np.asarray(zarr.open_array(paths[b], path="freq", mode="r")[...]) for b in BANDS]
    view = coll["data"].patches({"dec": args.patch, "ra": args.patch})
    manifest = split_by_member(coll, {"train": 1.0})  # both bands; the line is in "lo" only
    stats = fit_statistics(coll, manifest, {"x": coll["data"]})
    print(
        f"{coll.members}: {view.n_samples} channels, {view.inner_shape} per patch; fitted "
        f"mean {stats.mean['x'].item():.2e}, std {stats.std['x'].item():.2e} Jy/beam, "
        f"{int(stats.nan_count['x'].item()):,} NaNs skipped"
    )
    mean, std = stats.mean["x"].item(), stats.std["x"].item()  # per Stokes plane: one

    def to_inputs(batch: Batch) -> Batch:  # standardise, NaN (blanked, flagged) -> 0
        f = batch.coords["x"]["freq"]
        batch.arrays["line"] = ((f <= LINE[0]) & (f >= LINE[1])).astype(np.float32)
        batch.arrays["x"] = np.nan_to_num((batch.arrays["x"] - mean) / std).astype(np.float32)
        return batch

    def make(tail: bool) -> InSituPipeline:
        return insitu_pipeline(
            coll, manifest, {"x": view}, batch_size=args.batch_size, seed=args.seed,
            coords=["freq"], batch_transforms=[to_inputs] if tail else [],
        )  # fmt: skip

    # the oracle: every row equals zarr's read at its member, channel and window, once an epoch
    seen: Counter[tuple[int, ...]] = Counter()
    with make(False) as pipe:
        full = []
        for batch in Loader(pipe):
            full.append(batch.sample_indices["x"].tolist())
            where = zip(batch.members["x"], batch.sample_indices["x"], batch.patch_origins["x"],
                        batch.coords["x"]["freq"], strict=True)  # fmt: skip
            for row, (m, c, (y0, x0), f) in zip(batch["x"], where, strict=True):
                want = cubes[m][:, c, y0 : y0 + args.patch, x0 : x0 + args.patch]
                assert np.array_equal(row, want, equal_nan=True) and f == freqs[m][c]
                seen[(int(m), int(c), int(y0), int(x0))] += 1
    origins = len(range(0, args.size - args.patch + 1, args.patch))
    origins += (args.size - args.patch) % args.patch > 0  # the window flush with the far edge
    assert max(seen.values()) == 1 and len(seen) == len(BANDS) * args.channels * origins**2
    # a run stopped after 3 batches and resumed from its state delivers the rest of the epoch
    with make(False) as pipe:
        loader: Loader[Batch] = Loader(pipe)
        for step, _ in enumerate(loader):
            if step == 2:
                state = loader.state_dict()
                break
    with make(False) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        assert [b.sample_indices["x"].tolist() for b in loader] == full[3:]
    print(f"every channel: {len(seen)} patches an epoch, each once, equal to zarr; resume exact")

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(4, 1),
    )  # fmt: skip
    losses = []
    with make(True) as train:
        for epoch in range(args.epochs):
            total = []
            for batch in Loader(train):
                t = to_torch(batch)
                logits = model(t["x"]).squeeze(1)  # the one Stokes plane as the channel
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, t["line"])
                loss.backward()
                with torch.no_grad():  # plain SGD (torch.optim costs a second to import)
                    for w in model.parameters():
                        if w.grad is not None:
                            w.sub_(args.lr * w.grad)
                            w.grad = None
                total.append(loss.item())
            losses.append(float(np.mean(total)))
            print(f"epoch {epoch}: {len(total)} batches, mean loss {losses[-1]:.4f}")
    fell = losses[-1] < losses[0]
    print(f"line detector: loss {'fell' if fell else 'did NOT fall'}: {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}")  # fmt: skip
    return fell


def spectra_of_sky_patches(paths: dict[str, Path], args: argparse.Namespace) -> None:
    """Workload 2: sky patches of ``cube_i (freq, dec, ra)`` with the whole line band, in a
    spatial train/val split; random 3-D sub-cubes of it."""
    geom = open_geometries(paths["lo"], ["cube_i"], sample_axis=())["cube_i"]  # one sample
    band = geom.sel(freq=slice(*LINE))  # high to low, as the axis runs (xarray's sel)
    freq = np.asarray(zarr.open_array(paths["lo"], path="freq", mode="r")[...])
    in_band = np.flatnonzero((freq <= LINE[0]) & (freq >= LINE[1]))
    cube = np.asarray(zarr.open_array(paths["lo"], path="cube_i", mode="r")[...])
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))  # one sample: the sky is split below
    half = args.size // 2
    p = args.patch
    for split, box in (("train", (0, half)), ("val", (half, args.size))):
        view = band.patches({"dec": p, "ra": p}, within={"dec": box})
        with insitu_pipeline(paths["lo"], manifest, {"x": view}, batch_size=4) as pipe:
            n = 0
            for batch in Loader(pipe):
                for row, (y0, x0) in zip(batch["x"], batch.patch_origins["x"], strict=True):
                    assert box[0] <= y0 and y0 + p <= box[1]
                    assert np.array_equal(row, cube[in_band, y0 : y0 + p, x0 : x0 + p],
                                          equal_nan=True)  # fmt: skip
                    n += 1
        print(f"{split}: {n} sky patches of {view.inner_shape} (channels, dec, ra) in dec "
              f"{box}, equal to zarr's")  # fmt: skip
    fc = 8  # channels per sub-cube
    sub = geom.patches({"freq": fc, "dec": p, "ra": p}, origins="random")
    seen: Counter[tuple[int, ...]] = Counter()
    with insitu_pipeline(paths["lo"], manifest, {"x": sub}, batch_size=4, seed=1) as pipe:
        for batch in Loader(pipe):
            for row, (f0, y0, x0) in zip(batch["x"], batch.patch_origins["x"], strict=True):
                want = cube[f0 : f0 + fc, y0 : y0 + p, x0 : x0 + p]
                assert np.array_equal(row, want, equal_nan=True)
                seen[(int(f0) // fc, int(y0) // p, int(x0) // p)] += 1  # its home tile
    assert set(seen.values()) == {1}  # one random sub-cube starts in each stored tile
    print(f"sub-cubes: {sum(seen.values())} random {sub.inner_shape} (freq, dec, ra), one per "
          f"stored tile, equal to zarr's")  # fmt: skip


def run(folder: Path, args: argparse.Namespace) -> int:
    paths = {band: folder / f"cube_{band}.zarr" for band in BANDS}
    for k, (band, f0) in enumerate(BANDS.items()):
        write_cube(paths[band], f0, args, seed=args.seed + k)
    print(f"wrote two cubes {(1, args.channels, args.size, args.size)} to {folder}")
    learned = channels_as_images(paths, args)
    spectra_of_sky_patches(paths, args)
    return 0 if learned else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.path is not None:
        args.path.mkdir(parents=True, exist_ok=True)
        return run(args.path, args)
    with tempfile.TemporaryDirectory(prefix="insitu-cube-") as tmp:
        return run(Path(tmp), args)


if __name__ == "__main__":
    sys.exit(main())
