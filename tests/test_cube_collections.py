"""Several whole arrays as one stream: a :class:`~insitubatch_nodes.io.collection.Collection`
with ``sample_axis=()`` reads each member (a survey's pointing, a band's cube ``(freq, dec,
ra)``) as one sample, and patched, the windows of every member are the samples of one
shuffled stream, ``batch.members`` naming each row's member.

zarr's read of each member cut at the window ``batch.patch_origins`` names is the oracle for
every row. Each (member, window) of an epoch comes exactly once, each stored object of each
member is read once per epoch, :func:`split_by_member` keeps pointings apart, a mid-epoch
state resumes bit-exactly, and two ranks deliver disjoint windows. Before,
``Collection.from_arrays(..., sample_axis=())`` was refused ("open_geometries' option").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, window_of
from resume_helpers import assert_resumes_exactly, epochs_of

from insitubatch_nodes import Loader, insitu_pipeline, split_by_chunk, split_by_member
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.geometry import ArrayGeometry

F, D, R = 12, 20, 26  # dec and ra not multiples of the tiles
CHUNKS = (8, 8, 16)  # 2 x 3 x 2 = 12 stored objects a pointing
FIELDS = ("f0", "f1", "f2", "f3")
SKY = {"dec": 8, "ra": 8}
DEC, RA = [0, 8, 12], [0, 8, 16, 18]  # each a grid, plus a window flush with the far edge
DIMS = ("freq", "dec", "ra")
FREQ = 1.42e9 - np.arange(F) * 1e6  # Hz, descending, as FITS-converted cubes run


# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = pytest.mark.xdist_group("cube_collections")


@pytest.fixture(scope="module")
def survey(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four pointings, each a group with a cube and its source mask (tiled otherwise)."""
    root = tmp_path_factory.mktemp("survey") / "survey.zarr"
    top = zarr.open_group(root, mode="w", zarr_format=3)
    rng = np.random.default_rng(0)
    for name in FIELDS:
        group = top.create_group(name)
        data = rng.standard_normal((F, D, R)).astype("f4")
        group.create_array("cube", shape=data.shape, chunks=CHUNKS, dtype="f4",
                           dimension_names=DIMS)[...] = data  # fmt: skip
        group.create_array("mask", shape=data.shape, chunks=(F, 4, R), dtype="u1",
                           dimension_names=DIMS)[...] = data > 1  # fmt: skip
        group.create_array("freq", shape=(F,), dtype="f8",
                           dimension_names=("freq",))[...] = FREQ  # fmt: skip
    return root


def _read(root: Any, path: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root, path=path, mode="r")[...])


def _deliver(
    root: Any, col: Collection, views: dict[str, ArrayGeometry], manifest: Any = None,
    split: str = "train", band: slice = slice(None), **kw: Any,
) -> list[tuple[int, ...]]:  # fmt: skip
    """``(member, *origin)`` of every row of one epoch of ``split``, each row checked against
    zarr's read of its own member (of the channels ``band``)."""
    manifest = manifest or split_by_chunk(next(iter(views.values())), (1.0, 0.0, 0.0))
    data = {
        label: [_read(root, p)[band] for p in col.paths(label)] for label in views
    }  # label names the variable
    seen = []
    opts = {"batch_size": 5, "seed": 1, "split": split, **kw}
    with insitu_pipeline(col, manifest, views, **opts) as pipe:
        for batch in Loader(pipe):
            first = next(iter(views))
            members, origins = batch.members[first], batch.patch_origins[first]
            for label, view in views.items():  # views patched alike: the same rows
                np.testing.assert_array_equal(batch.members[label], members)
                np.testing.assert_array_equal(batch.patch_origins[label], origins)
                np.testing.assert_array_equal(batch.sample_indices[label], 0)  # one sample
                assert view.patch is not None
                for r in range(len(batch)):
                    want = window_of(data[label][int(members[r])], view, origins[r])
                    assert np.array_equal(batch[label][r], want), (label, members[r], origins[r])
            seen += [(int(m), *map(int, o)) for m, o in zip(members, origins, strict=True)]
    return seen


def test_whole_array_members_were_refused_and_now_stream_their_windows(survey: Path) -> None:
    arrays = [(survey, f"{f}/cube") for f in FIELDS]
    col = Collection.from_arrays(arrays, names=list(FIELDS), sample_axis=())  # before: refused
    geom = col["data"]
    assert geom.product is not None and geom.product.axes == () and geom.product.members == 4
    assert (geom.n_samples, geom.n_chunks, geom.inner_shape) == (4, 4, (F, D, R))
    assert col.lengths.tolist() == [1, 1, 1, 1]
    short = zarr.create_array(survey.parent / "short.zarr", shape=(F - 1, D, R), chunks=CHUNKS,
                              dtype="f4", dimension_names=DIMS)  # fmt: skip
    with pytest.raises(ValueError, match=r"'1' has 11 steps along axis 0 .* needs one shape"):
        Collection.from_arrays([arrays[0], short], sample_axis=())
    assert geom.store_key(2, (1, 2, 1)) == "f2/cube/c/1/2/1"  # block 0 of member 2
    view = geom.patches(SKY)
    seen = _deliver(survey, col, {"data": view}, block_chunks=2)
    every = [(m, d, r) for m in range(4) for d in DEC for r in RA]
    assert sorted(seen) == every and seen != every  # each (member, window) once, shuffled
    # a box of the sky of every pointing, and a band of channels of the collection's view
    boxed = geom.patches(SKY, within={"ra": (0, 16)})
    assert sorted(_deliver(survey, col, {"data": boxed})) == [
        (m, d, r) for m in range(4) for d in DEC for r in (0, 8)
    ]
    band = geom.isel(freq=slice(2, 10)).patches(SKY)
    assert band.inner_shape == (8, 8, 8)
    assert sorted(_deliver(survey, col, {"data": band}, band=slice(2, 10))) == every
    # 3-D sub-cubes of a two-variable collection of groups: cube and mask cut alike
    groups = Collection.from_groups(survey, list(FIELDS), {"cube": "cube", "mask": "mask"},
                                    sample_axis=())  # fmt: skip
    sub = {"freq": 8, "dec": 8, "ra": 8}
    views = {v: groups[v].patches(sub) for v in ("cube", "mask")}
    seen = _deliver(survey, groups, views, block_chunks=3)
    assert sorted(seen) == [(m, f, d, r) for m in range(4) for f in (0, 4) for d in DEC for r in RA]
    # a band by value (high to low, as the axis runs; both ends kept), both variables alike
    views = {v: groups[v].sel(freq=slice(1.418e9, 1.411e9)).patches(SKY) for v in views}
    assert views["cube"].inner_shape == (8, 8, 8)
    assert sorted(_deliver(survey, groups, views, band=slice(2, 10))) == every


def test_a_split_by_member_keeps_pointings_apart(survey: Path) -> None:
    col = Collection.from_arrays([(survey, f"{f}/cube") for f in FIELDS], names=list(FIELDS),
                                 sample_axis=())  # fmt: skip
    manifest = split_by_member(col, {"train": ["f0", "f2", "f3"], "val": ["f1"]})
    view = col["data"].patches(SKY)
    train = _deliver(survey, col, {"data": view}, manifest)
    val = _deliver(survey, col, {"data": view}, manifest, split="val")
    assert sorted(train) == [(m, d, r) for m in (0, 2, 3) for d in DEC for r in RA]
    assert sorted(val) == [(1, d, r) for d in DEC for r in RA]


def test_each_stored_object_of_each_member_is_read_once_per_epoch(survey: Path) -> None:
    store = counting_store(survey)
    col = Collection.from_arrays([(store, f"{f}/cube") for f in FIELDS], sample_axis=())
    view = col["data"].patches(SKY, within={"ra": (0, 16)})  # one column of tiles
    manifest = split_by_chunk(col["data"], (1.0, 0.0, 0.0))
    store.reset_counts()
    with insitu_pipeline(col, manifest, {"x": view}, batch_size=4, block_chunks=1) as pipe:
        loader = Loader(pipe)
        counts = []
        for _ in range(2):
            assert sum(len(b) for b in loader) == 4 * len(DEC) * 2
            counts.append(store.chunk_counts())
            store.reset_counts()
    first, second = counts
    # the tiles the box overlaps (ra tile 0) of every pointing, every one once
    tiles = [(f, d) for f in range(2) for d in range(3)]
    assert first == {f"{p}/cube/c/{f}/{d}/0": 1 for p in FIELDS for f, d in tiles}, first
    assert set(second.values()) <= {1}, second  # (what stayed resident is not read again)


def test_a_resumed_epoch_continues_bit_exactly_and_ranks_are_disjoint(survey: Path) -> None:
    col = Collection.from_arrays([(survey, f"{f}/cube") for f in FIELDS], sample_axis=())
    geom = col["data"]
    view = geom.patches(SKY, origins="random")
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))

    def build() -> Any:
        return insitu_pipeline(col, manifest, {"x": view}, batch_size=4, block_chunks=2,
                               seed=7)  # fmt: skip

    def records(batches: list[Any]) -> list[tuple]:
        return [(b.epoch, b.index, b.members["x"].tolist(), b.patch_origins["x"].tolist(),
                 b["x"].tobytes()) for b in batches]  # fmt: skip

    pipe = build()
    try:
        n = len(pipe)
        ref = records([next(it) for it in [epochs_of(Loader(pipe))] for _ in range(2 * n)])
    finally:
        pipe.close()
    assert n > 2 and ref[:n] != ref[n:]  # random windows: another epoch, other windows
    assert_resumes_exactly(build, records, ref, (1, n - 1, n + 1))
    grid = geom.patches(SKY)
    ranks = [{"rank": r, "world_size": 2, "batch_size": 3, "block_chunks": 1} for r in range(2)]
    per_rank = [_deliver(survey, col, {"data": grid}, manifest, **kw) for kw in ranks]
    a, b = (set(w) for w in per_rank)
    assert not a & b and len(a) == len(per_rank[0]) and len(b) == len(per_rank[1])
    assert len(a) == len(b) and 4 * 12 - len(a | b) <= 1  # 48 windows, one may sit out
