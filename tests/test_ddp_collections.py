"""A collection of two stores dealt between real gloo ranks (processes forked from the tests'
fork server, rank and world size from ``torch.distributed``): per epoch the ranks' samples —
``(member, index)`` pairs — are disjoint and cover the split, every rank yields the same number
of batches (an ``all_reduce`` per batch), each row equals zarr's read of its member, and each
stored object is read once across the ranks.

Members of 32 and 16 samples in chunks of 8: six whole chunks, which two or three ranks deal
whole (round-robin), so no chunk is cut between ranks and none is read twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_era5
from resume_helpers import run_ranks

pytestmark = pytest.mark.timeout(120)

LENGTHS = (32, 16)
SPC = 8
BATCH = 5


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_deal_a_two_store_collection_disjointly_reading_each_object_once(
    tmp_path: Path, world: int
) -> None:
    roots = [write_era5(tmp_path / f"s{m}.zarr", n_time=n) for m, n in enumerate(LENGTHS)]
    request = {"world": world, "init_file": str(tmp_path / "init"), "batch_size": BATCH,
               "roots": [str(r) for r in roots], "seed": 7, "epochs": 2}  # fmt: skip
    results = run_ranks("collection-ddp", [{**request, "rank": r} for r in range(world)],
                        tmp_path / "ranks")  # fmt: skip
    assert [r["rank"] for r in results] == list(range(world))
    assert {r["world_size"] for r in results} == {world}
    everything = {(m, i) for m, n in enumerate(LENGTHS) for i in range(n)}
    objects = {f"{m}:t2m/c/{c}/0/0" for m, n in enumerate(LENGTHS) for c in range(n // SPC)}
    per_rank = sum(LENGTHS) // world  # 48 samples: no remainder for 2 or 3 ranks
    orders = []
    for e in range(2):
        per = [r["epochs"][e] for r in results]
        samples = [[tuple(s) for s in p["samples"]] for p in per]
        for mine in samples:
            assert len(mine) == len(set(mine)) == per_rank, "a rank repeated or lost a sample"
        union = set().union(*map(set, samples))
        assert sum(map(len, samples)) == len(union) and union == everything, "ranks share samples"
        assert {p["n_batches"] for p in per} == {-(-per_rank // BATCH)}
        assert all(p["min_batches"] == p["max_batches"] == p["n_batches"] for p in per)
        readers: dict[str, int] = {}
        for p in per:
            for key, n in p["gets"].items():
                readers[key] = readers.get(key, 0) + n
        assert readers == dict.fromkeys(objects, 1), "an object read twice, or not at all"
        orders.append(samples)
    assert orders[0] != orders[1], "the second epoch repeated the first one's order"
