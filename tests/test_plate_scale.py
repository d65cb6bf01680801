"""The issue's scale target for plates: a 1,536-well plate of 9 fields (13,824 fields, metadata
only, local) opens in at most 10 s, its metadata read concurrently.

``read_plate`` alone took 2.9-4.4 s here (2 shared cores, load average 5-10); the test holds
the issue's 10 s for it, and for ``open_plate`` (plate metadata and every field's array
metadata) where ``Collection`` is there (io/collection.py, branch coll32).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from insitubatch_nodes.io.ngff import open_plate, read_plate
from insitubatch_nodes.synthetic import make_plate_metadata_only

FIELDS = 1536 * 9
OPEN_S = 10.0  # the bound for opening the 13,824-field plate


@pytest.fixture(scope="module")
def big_plate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "plate.zarr"
    make_plate_metadata_only(path)  # 32 x 48 wells x 9 fields, NGFF 0.5, zarr v3
    return path


@pytest.mark.slow
def test_a_13824_field_plates_metadata_is_read_within_the_open_budget(big_plate: Path) -> None:
    t0 = time.perf_counter()
    plate = read_plate(big_plate)
    took = time.perf_counter() - t0
    assert len(plate.fields) == FIELDS and len(plate.wells) == 1536
    assert plate.fields[-1].path == "AF/48/8" and plate.fields[-1].image == "AF/48/8/0"
    assert took <= OPEN_S, f"read_plate took {took:.1f} s for {FIELDS} fields"


@pytest.mark.slow
def test_collection_a_13824_field_plate_opens_within_10_s(big_plate: Path) -> None:
    pytest.importorskip("insitubatch_nodes.io.collection", reason="needs Collection (coll32)")
    t0 = time.perf_counter()
    coll = open_plate(big_plate)
    took = time.perf_counter() - t0
    assert len(coll) == FIELDS
    assert took <= OPEN_S, f"open_plate took {took:.1f} s for {FIELDS} fields"
