"""Arrays stored one level per object are decoded in place into level-major slots.

The claims: which geometries qualify; such an array's stored objects are decompressed straight
into the slot (no decode scratch) and every batch equals zarr's read, a partial last chunk
included; the gather takes the same rows from a level-major slot as from a C-ordered one, in
any row order; the pool never lends a slot of one layout for the other and its reserve makes
the layout asked for; chunk transforms and the persistent cache see C-ordered chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Oracle, View, run_epoch, write_era5

from insitubatch_nodes import (
    ArrayGeometry,
    DecodedChunk,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.slots import is_level_major
from insitubatch_nodes.stages.gather import gather_label, take_rows

VIEWS = {"t2m": View("t2m"), "z": View("z")}


def pipeline(root: Path, **kwargs: Any) -> Any:
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))  # every chunk in train
    return insitu_pipeline(root, manifest, list(VIEWS), batch_size=8, seed=3, **kwargs)


def resident_slots(pipe: Any, path: str) -> list[np.ndarray]:
    pool = pipe.stages.pool
    return [pool.lookup(k).slot for k in pool.resident_keys() if k[0] == path]


@pytest.mark.parametrize(
    ("shape", "chunks", "sample_axis", "qualifies"),
    [
        ((64, 4, 9, 10), (16, 1, 9, 10), 0, True),  # ERA5 z: one level per object
        ((64, 4, 9), (16, 1, 9), 0, True),  # the same with one more field axis fewer
        ((64, 4, 9, 10), (16, 4, 9, 10), 0, False),  # every level in one object
        ((64, 4, 9, 10), (16, 2, 9, 10), 0, False),  # two levels per object
        ((64, 4, 9, 10), (16, 1, 3, 10), 0, False),  # tiled along lat as well
        ((64, 9, 10), (16, 9, 10), 0, False),  # no level axis
        ((64, 1, 9, 10), (16, 1, 9, 10), 0, False),  # a single level: nothing to reorder
        ((64, 4, 9, 10), (1, 1, 9, 10), 0, False),  # one sample per chunk: same memory
        ((4, 64, 9, 10), (1, 16, 9, 10), 1, False),  # the sample axis is not first
    ],
)
def test_only_arrays_stored_one_level_per_object_with_the_sample_axis_first_qualify(
    shape: tuple[int, ...], chunks: tuple[int, ...], sample_axis: int, qualifies: bool
) -> None:
    geom = ArrayGeometry("a", shape, chunks, np.dtype("f4"), 0.0, sample_axis=sample_axis)
    assert geom.one_level_per_object is qualifies


@pytest.mark.parametrize("n_time", [96, 100])  # 100: the last chunk holds 4 of 8 samples
def test_an_array_stored_one_level_per_object_is_decoded_in_place_and_matches_zarr(
    tmp_path: Path, n_time: int
) -> None:
    root = write_era5(tmp_path / "s.zarr", n_time=n_time, n_level=3)
    assert open_geometries(root, ["z"])["z"].one_level_per_object
    pipe = pipeline(root, cache_budget_bytes=2**30)  # every chunk stays resident
    try:
        records = run_epoch(pipe, Oracle(root), VIEWS)
        assert sum(r["len"] for r in records) == n_time
        z_slots, t2m_slots = resident_slots(pipe, "z"), resident_slots(pipe, "t2m")
        assert z_slots and all(is_level_major(s) for s in z_slots)
        assert t2m_slots and not any(is_level_major(s) for s in t2m_slots)
        scratch = pipe.stats()["decode_scratch_bytes"]
        if n_time % 8 == 0:
            assert scratch == 0  # every object was decompressed straight into its slot
        else:
            assert scratch > 0  # a partial chunk's objects are stored full size: cropped
        # a second epoch gathers from the resident level-major slots, still exact
        run_epoch(pipe, Oracle(root), VIEWS)
    finally:
        pipe.close()


def _level_major_copy(c_ordered: np.ndarray) -> np.ndarray:
    memory = np.ascontiguousarray(c_ordered.swapaxes(0, 1))
    slot = memory.swapaxes(0, 1)
    assert is_level_major(slot) and np.array_equal(slot, c_ordered)
    return slot


@pytest.mark.parametrize(
    "rows",
    [[3, 0, 5, 5, 1], [7], [0, 1, 2, 3, 4, 5, 6, 7], [6, 2]],
)
def test_a_level_major_slot_gives_the_rows_a_c_ordered_one_gives(rows: list[int]) -> None:
    rng = np.random.default_rng(0)
    c_ordered = rng.standard_normal((8, 3, 5, 7)).astype(np.float32)
    slot = _level_major_copy(c_ordered)
    index = np.asarray(rows)
    out = np.empty((len(rows), 3, 5, 7), np.float32)
    take_rows(slot, index, out)
    np.testing.assert_array_equal(out, c_ordered[index])


@pytest.mark.parametrize("in_order", [True, False])
def test_the_gather_from_level_major_slots_equals_the_gather_from_c_ordered_ones(
    in_order: bool,
) -> None:
    rng = np.random.default_rng(1)
    spc, chunks = 8, 4
    c_slots = {("z", c): rng.standard_normal((spc, 3, 5, 7)).astype(np.float32) for c in range(4)}
    lm_slots = {k: _level_major_copy(v) for k, v in c_slots.items()}
    samples = rng.choice(spc * chunks, size=12, replace=False)
    if in_order:  # the read plan's order: each chunk's rows are one run
        samples = samples[np.argsort(samples // spc, kind="stable")]
    want = np.stack([c_slots[("z", int(s) // spc)][int(s) % spc] for s in samples])
    for slots in (c_slots, lm_slots):
        out = np.empty_like(want)
        scratch = np.empty((spc, 3, 5, 7), np.float32)
        gather_label(out, samples, spc, "z", slots, scratch)
        np.testing.assert_array_equal(out, want)


def test_the_pool_keeps_one_free_list_per_layout_and_reserves_the_layout_asked_for() -> None:
    shape, dtype = (4, 3, 8), np.dtype("f8")  # 768 bytes
    pool = ChunkPool(budget_bytes=768)  # one slot
    got = pool.acquire(("a", 0), shape, dtype, level_major=True)
    assert got is not None
    first = got[0]
    assert is_level_major(first.slot) and first.slot.shape == shape
    pool.mark_ready(first)
    pool.unpin([first])
    # the same shape in the usual layout: the level-major slot is dropped, not lent
    got = pool.acquire(("a", 1), shape, dtype)
    assert got is not None
    second = got[0]
    assert second.slot.flags.c_contiguous and not is_level_major(second.slot)
    assert pool.stats.allocations == 2 and pool.allocated_bytes == 768
    pool.mark_ready(second)
    pool.unpin([second])
    pool.clear()
    # the reserve makes what it is asked for, and acquire takes it without allocating
    pool.reserve([(shape, dtype, True)])
    deadline = 50
    while pool._reserver is not None and pool._reserver.is_alive() and deadline:
        pool._reserver.join(0.1)
        deadline -= 1
    allocations = pool.stats.allocations
    got = pool.acquire(("a", 2), shape, dtype, level_major=True)
    assert got is not None and is_level_major(got[0].slot)
    assert pool.stats.allocations == allocations


def test_chunk_transforms_of_an_array_stored_one_level_per_object_see_c_ordered_chunks(
    tmp_path: Path,
) -> None:
    root = write_era5(tmp_path / "s.zarr", n_time=32, n_level=3)
    seen: list[bool] = []

    def double(chunk: DecodedChunk) -> DecodedChunk:
        seen.append(bool(chunk.data.flags.c_contiguous))
        # written for C-ordered data: on a level-major view this reshape would be a copy
        flat = chunk.data.reshape(chunk.n_samples, -1)
        flat *= 2
        return chunk

    from insitubatch_nodes import applies

    pipe = pipeline(root, chunk_transforms=[applies("z", double)])
    oracle = Oracle(root)
    try:
        for batch in pipe:
            idx = np.asarray(batch.sample_indices["z"])
            np.testing.assert_array_equal(batch.arrays["z"], 2 * oracle("z", idx))
            np.testing.assert_array_equal(batch.arrays["t2m"], oracle("t2m", idx))
    finally:
        pipe.close()
    assert seen and all(seen)


def test_a_persistent_cache_of_an_array_stored_one_level_per_object_reads_back_as_zarr(
    tmp_path: Path,
) -> None:
    root = write_era5(tmp_path / "s.zarr", n_time=48, n_level=3)
    cache = tmp_path / "cache"
    for run in range(2):  # the first run writes the cache, the second reads every chunk from it
        pipe = pipeline(root, cache_dir=cache, persist=True)
        try:
            run_epoch(pipe, Oracle(root), VIEWS)
            stats = pipe.stats()
        finally:
            pipe.close()
        if run == 1:
            assert stats["gets"] == 0 and stats["disk_hits"] > 0
