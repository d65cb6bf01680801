"""split_by_chunk / SplitManifest: whole chunks per split, reproducible, persisted as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from insitubatch_nodes import ArrayGeometry, SplitManifest, open_geometries, split_by_chunk
from insitubatch_nodes.plan.splits import SPLITS


def _geom(n_samples: int, spc: int) -> ArrayGeometry:
    return ArrayGeometry(
        "x", shape=(n_samples, 3), chunks=(spc, 3), dtype=np.dtype("f4"), fill_value=0
    )


@pytest.fixture(scope="module")
def partial(layouts_path: Path) -> ArrayGeometry:
    """43 samples in chunks of 4: 11 chunks, the last one partial."""
    return open_geometries(layouts_path, ["partial"])["partial"]


@pytest.fixture(scope="module")
def big(layouts_path: Path) -> ArrayGeometry:
    return open_geometries(layouts_path, ["big"])["big"]


@pytest.mark.parametrize(
    "fractions", [(0.8, 0.1, 0.1), (0.6, 0.2, 0.2), (1 / 3, 1 / 3, 1 / 3), (0.5, 0.5, 0.0)]
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_splits_never_share_a_chunk_and_cover_every_chunk(
    partial: ArrayGeometry, fractions: tuple[float, float, float], contiguous: bool
) -> None:
    manifest = split_by_chunk(partial, fractions, contiguous=contiguous, seed=3)
    parts = [manifest.chunks(name) for name in SPLITS]
    flat = [c for part in parts for c in part]
    assert len(flat) == len(set(flat))
    assert sorted(flat) == list(range(partial.n_chunks))
    # sizes follow the fractions (largest remainders: each within one chunk of exact)
    for part, f in zip(parts, fractions, strict=True):
        assert abs(len(part) - f * partial.n_chunks) < 1
    # the samples of the splits partition the whole sample axis
    samples = np.concatenate([manifest.samples(name) for name in SPLITS])
    assert sorted(samples.tolist()) == list(range(partial.n_samples))


def test_contiguous_splits_are_runs_in_train_val_test_order(partial: ArrayGeometry) -> None:
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2))
    train, val, test = (manifest.chunks(name) for name in SPLITS)
    assert train == list(range(0, 7))
    assert val == list(range(7, 9))
    assert test == list(range(9, 11))
    assert manifest.contiguous
    assert manifest.array == "partial"
    assert manifest.n_samples == 43 and manifest.samples_per_chunk == 4
    # the test split holds the partial final chunk's 3 samples
    assert manifest.samples("test").tolist() == list(range(36, 43))


def test_default_fractions_are_80_10_10(big: ArrayGeometry) -> None:
    manifest = split_by_chunk(big)
    sizes = [len(manifest.chunks(name)) for name in SPLITS]
    assert sizes == [1638, 205, 205]
    assert manifest.chunks("train") == list(range(1638))


def test_non_contiguous_splits_are_shuffled_deterministically_by_seed(big: ArrayGeometry) -> None:
    a = split_by_chunk(big, contiguous=False, seed=5)
    b = split_by_chunk(big, contiguous=False, seed=5)
    c = split_by_chunk(big, contiguous=False, seed=6)
    assert a == b
    assert a.fingerprint() == b.fingerprint()
    assert a.chunks("val") != c.chunks("val")
    assert a.fingerprint() != c.fingerprint()
    # shuffled: the validation chunks are not one run, and are spread over the array
    val = np.asarray(a.chunks("val"))
    assert (np.diff(val) > 1).any()
    assert val.min() < big.n_chunks // 4 and val.max() > 3 * big.n_chunks // 4
    # and the seed does not matter for a contiguous split
    assert split_by_chunk(big, seed=1).splits == split_by_chunk(big, seed=2).splits


@pytest.mark.parametrize(
    ("sample_range", "chunks"),
    [
        ((5, 13), [1, 2, 3]),  # snaps outward on both sides
        ((4, 12), [1, 2]),  # already aligned: unchanged
        ((0, 1), [0]),
        ((42, 43), [10]),  # inside the partial final chunk
        ((3, 43), list(range(0, 11))),
    ],
)
def test_sample_range_snaps_outward_to_chunk_boundaries(
    partial: ArrayGeometry, sample_range: tuple[int, int], chunks: list[int]
) -> None:
    manifest = split_by_chunk(partial, (1.0, 0.0, 0.0), sample_range=sample_range)
    assert manifest.chunks("train") == chunks
    assert manifest.sample_range == sample_range
    covered = set(manifest.samples("train").tolist())
    assert set(range(*sample_range)) <= covered
    # the chunk grid still refers to the whole array
    assert manifest.n_samples == partial.n_samples
    assert manifest.n_chunks == partial.n_chunks


def test_sample_range_restricts_every_split(partial: ArrayGeometry) -> None:
    manifest = split_by_chunk(partial, (0.5, 0.25, 0.25), sample_range=(8, 40))
    flat = sorted(c for name in SPLITS for c in manifest.chunks(name))
    assert flat == list(range(2, 10))


@pytest.mark.parametrize("sample_range", [(5, 5), (-1, 4), (0, 44), (10, 3)])
def test_an_invalid_sample_range_raises_value_error(
    partial: ArrayGeometry, sample_range: tuple[int, int]
) -> None:
    with pytest.raises(ValueError, match="sample_range"):
        split_by_chunk(partial, sample_range=sample_range)


@pytest.mark.parametrize(
    ("fractions", "match"),
    [
        ((-0.1, 0.6, 0.5), "non-negative"),
        ((0.5, 0.2, 0.2), "sum to 1"),
        ((0.5, 0.5, 0.5), "sum to 1"),
        ((0.5, 0.5), "train, val, test"),
        ((0.7, 0.1, 0.1, 0.1), "train, val, test"),
        ((float("nan"), 0.5, 0.5), "finite"),
    ],
)
def test_bad_fractions_raise_value_error(
    partial: ArrayGeometry, fractions: tuple[float, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        split_by_chunk(partial, fractions)


def test_an_empty_split_is_legal_and_has_no_samples(partial: ArrayGeometry) -> None:
    manifest = split_by_chunk(partial, (1.0, 0.0, 0.0))
    assert manifest.chunks("train") == list(range(partial.n_chunks))
    assert manifest.chunks("val") == [] and manifest.chunks("test") == []
    for name in ("val", "test"):
        samples = manifest.samples(name)
        assert samples.shape == (0,) and samples.dtype == np.int64


def test_a_split_of_a_tiny_array_may_leave_splits_empty() -> None:
    manifest = split_by_chunk(_geom(3, 4))  # a single chunk
    assert [len(manifest.chunks(name)) for name in SPLITS] == [1, 0, 0]


def test_an_unknown_split_name_raises_key_error(partial: ArrayGeometry) -> None:
    with pytest.raises(KeyError, match="validation"):
        split_by_chunk(partial).chunks("validation")


def test_a_manifest_refuses_overlapping_or_out_of_range_chunks() -> None:
    with pytest.raises(ValueError, match="both"):
        SplitManifest("x", 40, 4, {"train": (0, 1, 2), "val": (2,)})
    with pytest.raises(ValueError, match="not in"):
        SplitManifest("x", 40, 4, {"train": (10,)})
    with pytest.raises(ValueError, match="unknown split"):
        SplitManifest("x", 40, 4, {"holdout": (1,)})
    with pytest.raises(ValueError, match="samples_per_chunk"):
        SplitManifest("x", 40, 0, {})


def test_a_manifest_sorts_its_chunks_and_fills_missing_splits() -> None:
    manifest = SplitManifest("x", 40, 4, {"train": (3, 1, 2)})
    assert manifest.chunks("train") == [1, 2, 3]
    assert manifest.chunks("test") == []
    assert manifest == SplitManifest("x", 40, 4, {"train": [1, 2, 3], "val": [], "test": []})


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_manifest_survives_a_json_round_trip(
    tmp_path: Path, partial: ArrayGeometry, contiguous: bool
) -> None:
    manifest = split_by_chunk(
        partial, (0.5, 0.3, 0.2), contiguous=contiguous, seed=9, sample_range=(2, 41)
    )
    path = tmp_path / "split.json"
    manifest.save(path)
    loaded = SplitManifest.load(path)
    assert loaded == manifest
    assert loaded.fingerprint() == manifest.fingerprint()
    assert SplitManifest.from_dict(json.loads(path.read_text())) == manifest
    assert [p.name for p in tmp_path.iterdir()] == ["split.json"]  # no temporary file left
    # the file is plain JSON with the documented fields
    data = json.loads(path.read_text())
    assert data["format_version"] == 1
    assert data["splits"]["train"] == manifest.chunks("train")


def test_an_unknown_format_version_raises_a_clear_value_error(
    tmp_path: Path, partial: ArrayGeometry
) -> None:
    data = split_by_chunk(partial).to_dict()
    data["format_version"] = 99
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"format_version 99") as info:
        SplitManifest.load(path)
    assert "future.json" in str(info.value)
    del data["format_version"]
    with pytest.raises(ValueError, match="format_version None"):
        SplitManifest.from_dict(data)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not a JSON split manifest"),
        ("", "not a JSON split manifest"),
        ("[1, 2, 3]", "JSON object"),
        ('{"format_version": 1}', "malformed split manifest"),
    ],
)
def test_a_malformed_json_manifest_raises_a_clear_value_error(
    tmp_path: Path, text: str, match: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        SplitManifest.load(path)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("fractions", [0.5, 0.5], "3 entries"),
        ("n_samples", "many", "malformed"),
        ("splits", {"train": [0], "val": [0]}, "both"),
        ("splits", {"train": [99]}, "not in"),
    ],
)
def test_a_manifest_with_bad_fields_raises_value_error(
    partial: ArrayGeometry, field: str, value: object, match: str
) -> None:
    data = split_by_chunk(partial).to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=match):
        SplitManifest.from_dict(data)
