"""Multiscale OME-NGFF images (pyramids written by ome-zarr-py 0.18: several levels, ``scale``
and ``translation`` coordinateTransformations, label images beside them) as a whole-slide /
microscopy ML user takes them (trial of 2026-12-07). The oracles are zarr's own read of the
array a row names, cut with numpy at the row's patch origin, and the coordinateTransformations
of the NGFF documents, read here with json.

Found (fixed):

- A whole slide at the root of a store that is not a local folder (a zarr ``MemoryStore``, as
  a test or a notebook holds one) could not be opened with its labels: ``open_images(store,
  labels=["cells"])`` raised ``field '' has no label image ['cells'] (its labels: [])``. The
  labels group was looked up at ``"/labels"`` (the root's empty path joined with a slash): a
  local folder's reader and obstore forgave the slash, a key-value store did not. The label
  paths a local slide gave began with the slash too (``PlateField.labels``: ``"/labels/..."``).

Tried and found right:

- ...
"""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_images, split_by_member
from insitubatch_nodes.io.ngff_images import read_images

pytest.importorskip("ome_zarr")
pytestmark = pytest.mark.timeout(60)

TILE = 16


def _format(version: str) -> Any:
    from ome_zarr.format import FormatV04, FormatV05

    return {"0.4": FormatV04, "0.5": FormatV05}[version]()


def _write_slide(
    group: zarr.Group, version: str, shape: tuple[int, ...], seed: int, **label_kw: Any
) -> None:
    """A ``czyx`` uint16 slide of three levels (y and x halved, then quartered), in 16 x 16
    tiles, pixel size 0.5 in y and x, and a one-channel label image ``cells`` beside it, as
    ome-zarr-py writes them (with the translations it computes for the coarser levels)."""
    from ome_zarr.writer import write_image, write_labels

    fmt = _format(version)
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 60_000, shape, dtype=np.uint16)
    scale = {"c": 1.0, "z": 2.0, "y": 0.5, "x": 0.5}
    factors = [{"y": 2, "x": 2}, {"y": 4, "x": 4}]
    chunks = {"chunks": (1, 1, TILE, TILE)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ome-zarr-py's notes on its defaults
        write_image(image, group, scale_factors=factors, fmt=fmt, axes="czyx", scale=scale,
                    storage_options=chunks)  # fmt: skip
        labels = (image[:1] % 5).astype(np.uint8)
        write_labels(labels, group, name="cells", scaler=None, scale_factors=factors, fmt=fmt,
                     axes="czyx", scale=scale, storage_options=chunks, **label_kw)  # fmt: skip


def _in_memory(folder: Path) -> zarr.storage.MemoryStore:
    """A zarr ``MemoryStore`` holding every file of ``folder`` under its relative key."""
    from zarr.core.buffer import default_buffer_prototype

    store = zarr.storage.MemoryStore()
    make = default_buffer_prototype().buffer.from_bytes
    for file in folder.rglob("*"):
        if file.is_file():
            key = file.relative_to(folder).as_posix()
            asyncio.run(store.set(key, make(file.read_bytes())))
    return store


@pytest.fixture(scope="module", params=["0.4", "0.5"])
def slide(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One whole slide at a store's root: ``(2, 3, 50, 45)``, so that ome-zarr-py's coarser
    levels are 25 x 22 and 12 x 11, with scales of 1.0 x 1.0227 and translations."""
    path = tmp_path_factory.mktemp("slide") / f"slide{request.param}.zarr"
    fmt = _format(request.param)
    _write_slide(zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format),
                 request.param, (2, 3, 50, 45), seed=1)  # fmt: skip
    return path


def _read(store: Any, array: str) -> np.ndarray:
    return np.asarray(zarr.open_array(store, path=array, mode="r")[...])


def test_a_slide_at_the_root_of_a_memory_store_opens_with_its_labels(slide: Path) -> None:
    # before: "field '' has no label image ['cells'] (its labels: [])": the root's labels
    # group was read at "/labels", a key a MemoryStore does not hold
    found = read_images(slide, level=1, labels=["cells"])
    assert dict(found.fields[0].labels) == {"cells": "labels/cells/s1"}  # before: "/labels/..."
    store = _in_memory(slide)
    coll = open_images(store, level=1, labels=["cells"], sample_axis=())
    assert coll.paths("labels/cells") == ("labels/cells/s1",)
    image, labels = _read(store, "s1"), _read(store, "labels/cells/s1")
    window = {"y": 8, "x": 8}
    views = {"x": coll["image"].patches(window), "y": coll["labels/cells"].patches(window)}
    origins = []
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), views, batch_size=5) as p:
        for batch in Loader(p):
            for r in range(len(batch)):
                y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                cut = (slice(None), slice(None), slice(y0, y0 + 8), slice(x0, x0 + 8))
                np.testing.assert_array_equal(batch["x"][r], image[cut])
                np.testing.assert_array_equal(batch["y"][r], labels[cut])
                origins.append((y0, x0))
    # 25 x 22: windows every 8, and one flush with the far edge (17, 14): no partial window
    assert sorted(origins) == [(y, x) for y in (0, 8, 16, 17) for x in (0, 8, 14)]
