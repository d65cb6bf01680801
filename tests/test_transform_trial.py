"""Chunk, batch and device transforms deliver what numpy computes from zarr's read: cases found
by the transform trial of 2026-12-06 (random stores, dtypes, sample axes, field tilings,
transform chains, views, ranks, resume, persistent caches; numpy on zarr's values as the
oracle), each kept as a claim.

Found (wrong refusals and wrong judgements, now fixed): ``Statistics.scaler()`` refused a label
whose field has one axis (stations), its one value shaped ``(1, 1)``; ``check-transform`` failed
a correct in-place transform on a big-endian zarr v2 array (it handed over the chunk as ``>f4``,
where the pipeline hands it native).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import DecodedChunk, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.cli import main
from insitubatch_nodes.statistics import fit_statistics

pytestmark = pytest.mark.timeout(60)


def _stations(root: Path) -> np.ndarray:
    """``p (time, station)``: 24 samples of 7 stations, 4 samples a chunk."""
    rng = np.random.default_rng(3)
    p = (rng.standard_normal((24, 7)) * 2 + 1).astype(np.float32)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    arr = group.create_array(
        "p", shape=p.shape, chunks=(4, 7), dtype="float32", dimension_names=["time", "station"]
    )
    arr[...] = p
    return p


def test_the_scaler_of_statistics_standardises_a_field_of_one_axis(tmp_path: Path) -> None:
    root = tmp_path / "stations.zarr"
    p = _stations(root)
    g = open_geometries(root, ["p"])
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))
    stats = fit_statistics(root, manifest, {"p": g["p"]})
    pipe = insitu_pipeline(root, manifest, {"p": g["p"]}, batch_size=6, coords=(),
                           chunk_transforms=[stats.scaler(["p"])])  # fmt: skip
    with pipe:
        for batch in pipe:
            rows = p[batch.sample_indices["p"]].astype(np.float64)
            want = (rows - p.astype(np.float64).mean()) / (p.astype(np.float64).std() + 1e-8)
            np.testing.assert_allclose(batch["p"], want, rtol=1e-5, atol=1e-5)


def double(chunk: DecodedChunk) -> DecodedChunk:
    """In place: the dtype is kept (check-transform loads it as ``test_transform_trial:double``)."""
    chunk.data *= 2
    return chunk


def test_check_transform_passes_an_in_place_transform_on_a_big_endian_array(
    tmp_path: Path,
) -> None:
    """The pipeline hands transforms native-endian chunks, so ``chunk.data *= 2`` keeps the dtype
    there; check-transform must judge the chunk it hands over the same way."""
    root = tmp_path / "be.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=2)
    t = np.arange(16 * 4 * 6, dtype=np.float32).reshape(16, 4, 6)
    group.create_array("t", shape=t.shape, chunks=(4, 4, 6), dtype=">f4")[...] = t
    g = open_geometries(root, ["t"])
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    with insitu_pipeline(root, manifest, {"t": g["t"]}, batch_size=4, coords=(),
                         chunk_transforms=[double]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
        np.testing.assert_array_equal(batch["t"], 2 * t[batch.sample_indices["t"]])
    out = io.StringIO()
    argv = ["check-transform", str(root), "--var", "t", "--no-gil-probe",
            "--transform", f"{__file__}:double"]  # fmt: skip
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    assert rc == 0, out.getvalue()
    assert "unchanged as required" in out.getvalue()
