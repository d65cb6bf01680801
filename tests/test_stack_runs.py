"""Channel stacks in the runs around them (issue 31): resume, ranks and the persistent cache
behave as for any label.

The stack exercised holds every kind of member: a window of two steps of a level selection, a
shifted surface field, a static field and a forcing, standardised by fitted statistics.
zarr is the oracle for the rows; an uninterrupted run (or one rank) for the order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

import insitubatch_nodes.static as static_module
from insitubatch_nodes import (
    Forcings,
    InSituPipeline,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.synthetic import make_weatherbench_like
from tests.resume_helpers import assert_resumes_exactly, epochs_of

N = 20
LEVELS = [1000, 1]


def _store(root: Path, spc: int) -> Path:
    make_weatherbench_like(
        root, n_time=N, n_lat=6, n_lon=8, n_level=5, surface=["2m_temperature"],
        levels=["temperature"], samples_per_chunk=spc,
    )  # fmt: skip
    lsm = zarr.create_array(
        root / "land_sea_mask", shape=(6, 8), chunks=(6, 8), dtype="float32",
        dimension_names=("latitude", "longitude"),
    )  # fmt: skip
    lsm[...] = np.arange(48, dtype=np.float32).reshape(6, 8) / 48
    return root


def _build(root: Path, **options: Any) -> Callable[[], InSituPipeline]:
    g = open_geometries(root)
    manifest = split_by_chunk(g["temperature"], (1.0, 0.0, 0.0))
    members = {
        "t": g["temperature"].sel(level=LEVELS).window([-1, 0]),
        "t2m": g["2m_temperature"].shift(1).window([-1, 0]),
        "lsm": g["land_sea_mask"],
    }
    plain = {"t": g["temperature"].sel(level=LEVELS), "t2m": g["2m_temperature"]}
    stats = fit_statistics(root, manifest, {**plain, "lsm": g["land_sea_mask"]})
    sun = Forcings("x", view=g["2m_temperature"], names=["cos_solar_zenith"])
    x = stack({**members, "sun": sun}, normalize=stats)
    config = {"batch_size": 3, "shuffle": True, "seed": 4, **options}
    return lambda: insitu_pipeline(root, manifest, {"x": x}, **config)


def _rows(batches: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (b.epoch, b.index, b.sample_indices["x"].tolist(), b.channels["x"], b["x"].tobytes())
        for b in batches
    ]


def _by_sample(batches: list[Any]) -> dict[int, bytes]:
    """Each row's bytes by its anchor (the sample of its first member's last step)."""
    return {
        int(s[-1]): row.tobytes()
        for b in batches
        for s, row in zip(b.sample_indices["x"], b["x"], strict=True)
    }


def test_a_stack_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    build = _build(_store(tmp_path / "s.zarr", spc=2))
    pipe = build()
    try:
        ref = _rows(list(itertools.islice(epochs_of(Loader(pipe)), 2 * len(pipe))))
    finally:
        pipe.close()
    n = len(ref) // 2
    assert n > 3 and ref[0][3] == ["t@1000", "t@1", "t2m", "lsm", "cos_solar_zenith"]
    assert_resumes_exactly(build, _rows, ref, (1, n - 1, n, n + 2))


@pytest.mark.parametrize("world", [2, 3])
def test_a_stack_under_ranks_is_disjoint_with_equal_batch_counts(
    tmp_path: Path, world: int
) -> None:
    root = _store(tmp_path / "s.zarr", spc=2)
    pipe = _build(root)()
    try:
        whole = _by_sample(list(pipe))
    finally:
        pipe.close()
    counts, delivered = [], []
    for rank in range(world):
        pipe = _build(root, rank=rank, world_size=world)()
        try:
            batches = list(Loader(pipe))
            counts.append((len(batches), len(pipe)))
        finally:
            pipe.close()
        mine = _by_sample(batches)
        assert all(whole[s] == row for s, row in mine.items()), f"rank {rank}'s rows"
        assert sum(map(len, batches)) == len(mine)
        delivered.append(set(mine))
    assert len({c for c, _ in counts}) == 1 and all(c == n for c, n in counts)
    assert all(not (a & b) for i, a in enumerate(delivered) for b in delivered[i + 1 :])
    assert len(whole) - sum(map(len, delivered)) <= world - 1  # remainder="drop"


def test_a_stack_with_the_persistent_cache_reads_nothing_the_second_pass_with_identical_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _store(tmp_path / "s.zarr", spc=1)
    reads: list[str] = []
    real = static_module._read_whole
    monkeypatch.setattr(
        static_module, "_read_whole", lambda *a: reads.append(a[1].path) or real(*a)
    )
    build = _build(root, cache_dir=tmp_path / "cache", persist=True, seed=9)
    passes, gets, static_reads = [], [], []
    for _ in range(2):  # two pipelines, one after the other, over one cache directory
        reads.clear()
        pipe = build()
        try:
            static_reads.append(list(reads))
            passes.append(_rows(list(pipe)))
            gets.append(pipe.stats()["gets"])
        finally:
            pipe.close()
    assert gets[0] > 0 and gets[1] == 0
    # the static field too: read by the first pipeline, taken from the cache by the second
    assert static_reads == [["land_sea_mask"], []]
    assert passes[0] == passes[1]
