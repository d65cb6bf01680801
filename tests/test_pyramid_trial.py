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
- Physical coordinates of a patch could not be had: ``read_plate`` / ``read_images`` kept each
  level's scale (``pixel_size``) and dropped its ``translation``, which ome-zarr-py 0.18
  writes for every coarser level (0.25 and 0.79 um at levels 1 and 2 of a 50 x 45 slide of
  0.5 um pixels), so ``origin * pixel_size`` was that far off. ``PlateField.translation`` now
  holds it (the dataset's and the multiscale's transformations composed in the NGFF order):
  ``translation + origin * pixel_size`` is where the metadata puts the window.
- A label image whose translation puts it off the image's pixels (4 um below: 4 pixels of
  level 1) was read without a word: its level is picked by pixel size alone, and the image
  and label windows of a row take one pixel origin, so every mask is cut at the same index,
  4 pixels from the same place. It is now read with a ``UserWarning`` naming both positions
  and the offset in pixels (not refused: a writer that dropped the image's stage translation
  leaves labels right by index); an offset under half a pixel (a label written at a coarse
  level without ome-zarr-py's half-pixel translation) says nothing.
- Slides of another size in one ``open_images`` were refused with "rewrite that member like the
  first (its chunks, dtype, codecs), or read it apart": no slide can be rewritten to another's
  size. A member of another field shape now hears the route the docs give: a collection per
  size, a pipeline each, mixed with ``torchdata.nodes.MultiNodeWeightedSampler``.
- ``open_images(store, ["0", "2", "0"])`` said "member names must be unique; ['0'] appear
  more than once (members of several stores at the same path: give names=)": open_images
  takes no ``names=``. A group named twice is now refused as such, naming it. And
  ``read_images(...).describe()`` called the images a plate of "0 rows x 0 columns, 0 wells,
  3 fields": it now names them as multiscale images.

- Such a mix did not resume exactly from a state taken after one pipeline delivered its epoch's
  last batch, before the sampler asked it again: the pipeline, restored, started its next epoch
  at once (``ReadPlanNode._resolve`` rolls an end-of-epoch state into the next epoch) where the
  run that saved the state would have raised ``StopIteration`` and the sampler would have
  marked it exhausted. The resumed mixed epoch held 3 more batches (another epoch of the two
  40 x 48 slides). Fixed by the package's ``Loader`` marking the sampler's unexhausted sources
  in a copy of the state (tests/test_mixresume_trial.py says how, and what torchdata's own
  ``Loader`` still does).

Tried and found right (by hand, against zarr and numpy; the last one kept as a test):

- A bioformats2raw conversion of three 50 x 45 slides (``czyx``, 3 z planes, NGFF 0.4 and
  0.5) at level 1 (25 x 22, tiles of 16 not dividing it) with its labels: grid and random
  origins, ``order="shuffled"`` and ``"sweep"``, batches of 7, ``block_chunks=2``: every
  image row ``image[[1, 0], z, y0:y0+8, x0:x0+8]`` of its member (``isel(c=[1, 0])``), every
  label row the same window of the label image, member, plane and origin alike; grid windows
  each once an epoch (108 = 3 slides x 3 planes x 4 x 3), ``len(pipe)`` batches delivered;
  a persistent cache's second run made no GET; resumed after 1, n - 1, n and n + 2 batches of
  n-batch epochs (grid n = 16, random n = 7: mid
  epoch, at its end, in the next) exactly as the uninterrupted run.
- The edge rule: a grid ends with a window flush with the far edge (origins 0, 8, 16, 17 along
  25), never a partial or padded window; random origins stay inside the field.
- Slides of different Z lengths (3 and 5) in one collection, ``sample_axis="z"``: 32 windows,
  each once, each equal to numpy's; ``isel(z=[0, 2])`` with ``sample_axis=()``.
- Three ranks over that collection's random windows: disjoint up to the documented
  repeats of a random draw, their union the one-rank epoch (90 rows, two epochs).
- An image at level 0 and its label at level 1 in one pipeline, patched 16 / 8 or 8 / 8:
  refused, naming extent and field; a state saved at level 1 restores into level 0 refused
  (``StateMismatchError``); different channel counts with ``sample_axis=()`` refused; product
  axes ``("c", "z")`` over a 2-channel image and a 1-channel label refused.
- One persistent cache over levels 1, 0, 2, 1 of a slide: each level's rows right, its own
  tiles read once, the last run none (the test below).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store
from torchdata.nodes import Mapper

from insitubatch_nodes import Loader, insitu_pipeline, open_images, split_by_member
from insitubatch_nodes.io.ngff_images import read_images

pytest.importorskip("ome_zarr")
# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("pyramid_trial")]

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


def _multiscales(group: Path) -> list[dict[str, Any]]:
    """The ``multiscales`` of the group at ``group`` read with json (``.zattrs`` or
    ``zarr.json``'s ``attributes.ome``): the oracle's own read of the NGFF document."""
    if (group / "zarr.json").exists():
        return json.loads((group / "zarr.json").read_text())["attributes"]["ome"]["multiscales"]
    return json.loads((group / ".zattrs").read_text())["multiscales"]


def _edit_multiscales(group: Path, edit: Any) -> None:
    node = zarr.open_group(group, mode="r+")
    attrs = node.attrs.asdict()
    edit((attrs.get("ome") or attrs)["multiscales"][0])
    node.attrs.put(attrs)


def _physical(ms: dict[str, Any], level: int, index: np.ndarray) -> np.ndarray:
    """Where ``index`` (per axis) of dataset ``level`` lies, by the NGFF rule: the dataset's
    transformations in their order, then the multiscale's."""
    x = np.asarray(index, dtype=float)
    for t in (*ms["datasets"][level]["coordinateTransformations"],
              *ms.get("coordinateTransformations", ())):  # fmt: skip
        x = x * np.asarray(t["scale"]) if t["type"] == "scale" else x + np.asarray(t["translation"])
    return x


def test_a_patch_origin_lies_where_the_levels_coordinate_transformations_put_it(
    slide: Path, tmp_path: Path
) -> None:
    # before: read_images / read_plate gave each level's pixel_size but dropped its
    # translation (ome-zarr-py writes 0.25, 0.79 for these levels): origin * pixel_size was a
    # fraction of a pixel to several pixels off, and nothing gave the rest
    moved = tmp_path / slide.name  # also a multiscale-level scale and translation
    shutil.copytree(slide, moved)
    _edit_multiscales(moved, lambda ms: ms.update(coordinateTransformations=[
        {"type": "scale", "scale": [1.0, 1.0, 2.0, 2.0]},
        {"type": "translation", "translation": [0.0, 0.0, 100.0, -50.0]},
    ]))  # fmt: skip
    for path in (slide, moved):
        ms = _multiscales(path)[0]
        axes = [a["name"] for a in ms["axes"]]
        for level in range(3):
            field = read_images(path, level=level).fields[0]
            coll = open_images(path, level=level, sample_axis=())
            view = coll["image"].patches({"y": 4, "x": 4}, origins="random")
            with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": view},
                                 batch_size=64) as p:  # fmt: skip
                origins = next(iter(Loader(p))).patch_origins["x"]
            for y0, x0 in origins[:5]:
                index = np.array([0, 0, y0, x0])
                want = _physical(ms, level, index)
                got = [
                    field.translation[a] + i * field.pixel_size[a]
                    for a, i in zip(axes, index, strict=True)
                ]
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert read_images(moved, level=1).fields[0].translation["y"] == 100.0 + 2 * 0.25


def test_a_label_image_off_the_images_pixel_grid_is_warned_of_not_read_without_a_word(
    slide: Path, tmp_path: Path
) -> None:
    # before: the label level was picked by its pixel size alone, so a label image whose
    # translation put it 4 um (4 pixels of level 1) lower was opened without a word, and
    # every label window was cut 4 pixels away from its image window
    def shift(by: float) -> Any:
        def edit(ms: dict[str, Any]) -> None:
            for d in ms["datasets"]:
                for t in d["coordinateTransformations"]:
                    if t["type"] == "translation":
                        t["translation"][2] += by

        return edit

    off = tmp_path / "off" / slide.name
    shutil.copytree(slide, off)
    _edit_multiscales(off / "labels" / "cells", shift(4.0))
    said = r"1 of 1 'cells' label image\(s\) lie off .*'s1'.*: y \+4 pixels.*pixels of one index"
    with pytest.warns(UserWarning, match=said):
        open_images(off, level=1, labels=["cells"], sample_axis=())
    with pytest.warns(UserWarning, match=r"y \+8 pixels"):
        read_images(off, level=0, labels="all")
    # a quarter of a pixel (a label written at the coarse level without ome-zarr-py's
    # half-pixel translation) lies on the same pixels: read without a word
    near = tmp_path / "near" / slide.name
    shutil.copytree(slide, near)
    _edit_multiscales(near / "labels" / "cells", shift(-0.25))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_images(near, level=1, labels=["cells"]).fields[0].labels["cells"][-2:] == "s1"


@pytest.fixture(scope="module")
def scans(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bioformats2raw conversion of three scans of two sizes: series 0 and 2 are 40 x 48,
    series 1 is 64 x 32 (level 1: 20 x 24 and 32 x 16)."""
    path = tmp_path_factory.mktemp("scans") / "scans.zarr"
    root = zarr.open_group(path, mode="w", zarr_format=3)
    root.attrs.update({"ome": {"version": "0.5", "bioformats2raw.layout": 3}})
    for s, yx in enumerate([(40, 48), (64, 32), (40, 48)]):
        _write_slide(root.require_group(str(s)), "0.5", (2, 1, *yx), seed=s)
    return path


def test_slides_of_other_sizes_are_refused_saying_to_mix_a_pipeline_per_size(
    scans: Path,
) -> None:
    # before: "... its field shape (1, 32, 16) differs ...: rewrite that member like the first
    # (its chunks, dtype, codecs), or read it apart" - no slide can be rewritten to another's
    # size; the route the docs give (a collection per size, pipelines mixed) was not named
    with pytest.raises(ValueError, match=r"field shape .*MultiNodeWeightedSampler"):
        open_images(scans, level=1, labels=["cells"], sample_axis=())


def test_pipelines_of_slides_of_two_sizes_mixed_by_torchdata_resume_exactly(scans: Path) -> None:
    # a state taken after the last batch of one pipeline's epoch (the sampler not yet told it
    # was exhausted) restores that pipeline into its next epoch at once: the resumed mixed
    # epoch holds 3 more batches (a second epoch of the 40 x 48 slides' windows), and every
    # epoch after it is one ahead for those slides
    from torchdata.nodes import MultiNodeWeightedSampler

    path = scans
    by_size = {
        "wide": open_images(path, ["0", "2"], level=1, labels=["cells"], sample_axis=()),
        "tall": open_images(path, ["1"], level=1, labels=["cells"], sample_axis=()),
    }
    arrays = {
        (k, m): (_read(path, c.paths("image")[m]), _read(path, c.paths("labels/cells")[m]))
        for k, c in by_size.items()
        for m in range(len(c))
    }
    window = {"y": 8, "x": 8}

    def checked(k: str, b: Any) -> list[tuple[Any, ...]]:
        """The rows of batch ``b`` of the pipeline of size ``k``, each checked against zarr."""
        out = []
        for r in range(len(b)):
            m = int(b.members["x"][r])
            y0, x0 = (int(v) for v in b.patch_origins["x"][r])
            image, labels = arrays[k, m]
            cut = (slice(None), slice(None), slice(y0, y0 + 8), slice(x0, x0 + 8))
            np.testing.assert_array_equal(b["x"][r], image[cut])
            np.testing.assert_array_equal(b["y"][r], labels[cut])
            out.append((k, b.epoch, m, y0, x0))
        return out

    def pipeline(c: Any) -> Any:
        views = {
            "x": c["image"].patches(window, origins="random"),
            "y": c["labels/cells"].patches(window, origins="random"),
        }
        return insitu_pipeline(c, split_by_member(c, {"train": 1.0}), views, batch_size=4, seed=5)

    def mixed() -> tuple[Any, list[Any]]:
        pipes = {k: pipeline(c) for k, c in by_size.items()}
        sources = {k: Mapper(p, lambda b, k=k: checked(k, b)) for k, p in pipes.items()}
        sampler = MultiNodeWeightedSampler(
            sources, {"wide": 2.0, "tall": 1.0}, stop_criteria="ALL_DATASETS_EXHAUSTED", seed=2
        )
        return Loader(sampler), list(pipes.values())

    loader, pipes = mixed()
    try:
        ref = [list(loader) for _ in range(2)]
    finally:
        for p in pipes:
            p.close()
    for epoch in ref:  # every slide's random windows, stratified by its 16 x 16 tiles
        assert sorted(Counter((k, m) for b in epoch for k, _, m, *_ in b).items()) == [
            (("tall", 0), 6), (("wide", 0), 5), (("wide", 1), 5)]  # fmt: skip
    flat, per = ref[0] + ref[1], len(ref[0])
    assert [b[0][0] for b in ref[0][:4]] == ["wide"] * 3 + ["tall"]  # (seed 2's draw)
    # after batch 3, 'wide' delivered its last batch of epoch 0 and the sampler has not yet
    # seen its StopIteration; after batch per + 1, mid-epoch 1
    for k in (3, per + 1):
        loader, pipes = mixed()
        try:
            head = list(loader) if k > per else []
            it = iter(loader)
            head += [next(it) for _ in range(k - len(head))]
            state = loader.state_dict()
        finally:
            for p in pipes:
                p.close()
        loader, pipes = mixed()
        try:
            loader.load_state_dict(state)
            rest = list(loader) + (list(loader) if k < per else [])
        finally:
            for p in pipes:
                p.close()
        assert head + rest == flat, k


def test_one_persistent_cache_over_the_levels_of_a_slide_serves_each_level_its_own_tiles(
    slide: Path, tmp_path: Path
) -> None:
    # tried, found right: a cache warmed at level 1 serves a later level-1 run without a GET,
    # and never serves level 0's or level 2's windows from level 1's tiles (the levels are
    # other arrays, 's0' / 's1' / 's2', in the collection's name and the cache's keys)
    store = counting_store(slide)
    window = {"y": 8, "x": 8}
    gets = []
    for level in (1, 0, 2, 1):
        coll = open_images(store, level=level, labels=["cells"], sample_axis="z")
        image, labels = (_read(slide, coll.paths(v)[0]) for v in ("image", "labels/cells"))
        views = {"x": coll["image"].patches(window), "y": coll["labels/cells"].patches(window)}
        store.reset_counts()
        rows = 0
        with insitu_pipeline(
            coll, split_by_member(coll, {"train": 1.0}), views, batch_size=8,
            cache_dir=tmp_path / "cache", persist=True,
        ) as p:  # fmt: skip
            for batch in Loader(p):
                for r in range(len(batch)):
                    z = int(batch.sample_indices["x"][r])
                    y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                    cut = (slice(None), z, slice(y0, y0 + 8), slice(x0, x0 + 8))
                    np.testing.assert_array_equal(batch["x"][r], image[cut])
                    np.testing.assert_array_equal(batch["y"][r], labels[cut])
                    rows += 1
        gets.append((level, rows, sum(store.chunk_counts().values())))
    # windows per plane: level 1 (25 x 22) 4 x 3, level 0 (50 x 45) 7 x 6, level 2 (12 x 11)
    # 2 x 2, on 3 planes; GETs: each 16 x 16 tile (2 x 2, 4 x 3 and 1 a plane) of the 3
    # planes of the 2 image channels and the 1 label channel, once; the last run none
    tiles = {1: 2 * 2, 0: 4 * 3, 2: 1}
    assert gets == [(k, 3 * n, 3 * 3 * tiles[k]) for k, n in ((1, 12), (0, 42), (2, 4))] + [
        (1, 36, 0)
    ]


def test_an_image_group_named_twice_is_refused_naming_it_not_told_to_give_names(
    scans: Path,
) -> None:
    # before: "member names must be unique; ['0'] appear more than once (members of several
    # stores at the same path: give names=)" - open_images takes no names=
    with pytest.raises(ValueError, match=r"groups name \['0'\] more than once"):
        open_images(scans, ["0", "2", "0"], level=1, sample_axis=())
    # and describe() of images no longer calls them a plate of "0 rows x 0 columns, 0 wells"
    said = read_images(scans, ["0", "2"], level=1).describe().splitlines()
    assert said[0] == "NGFF 0.5 multiscale images (zarr v3): '0', '2', axes czyx"
    assert said[1] == "level 1 in 2 field(s): pixel size c 1, z 2, y 1, x 1"
