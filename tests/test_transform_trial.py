"""Chunk, batch and device transforms deliver what numpy computes from zarr's read: cases found
by the transform trial of 2026-12-06 (random stores, dtypes, sample axes, field tilings,
transform chains, views, ranks, resume, persistent caches; numpy on zarr's values as the
oracle), each kept as a claim.

Found (wrong refusals and wrong judgements, now fixed): ``Statistics.scaler()`` refused a label
whose field has one axis (stations), its one value shaped ``(1, 1)``; ``check-transform`` failed
a correct in-place transform on a big-endian zarr v2 array (it handed over the chunk as ``>f4``,
where the pipeline hands it native); ``Coarsen`` and ``StandardScaler`` on float16 arrays gave
inf (and NaN) where the result is a plain float16: the block sum, ``x - mean`` or ``1 / std``
overflowed 65504 in float16 arithmetic; ``Statistics.scaler()`` of two labels of one array fitted
on other points (the field, a box of it) standardised the array with the last one's, silently.
``to_torch`` on the CPU refused a batch a flip transform had reversed (a negative stride);
a scaler with statistics for a static array left that label unscaled without a word, and
``applies`` naming a static array said the pipeline does not read it.

Needed no claim (matched the oracle in every case tried): chains of Coarsen, StandardScaler
(scalar and per-level), level selection, cropping and casts on float16/32/64 and integer
arrays, sample axis first or last, tiled fields, partial chunks, shifted and windowed views
(one transform per chunk, seen by every view), direct decoding, small budgets, ranks, resume
mid-epoch, two epochs, set_views, selections on transformed slots, collections, stacks and
their normalisation, normalizer(), persistent caches written with another chain (refused, or
rebuilt with reset_stale_cache), batch transforms that reorder rows, device transforms, and
check-transform against the pipeline's own verdict (CF-packed arrays included).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Coarsen,
    DecodedChunk,
    StandardScaler,
    applies,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    to_torch,
    transforms,
)
from insitubatch_nodes.batch import Batch
from insitubatch_nodes.cli import main
from insitubatch_nodes.errors import StaleCacheError
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.splits import SplitManifest
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


def _half_store(root: Path, values: np.ndarray) -> dict[str, ArrayGeometry]:
    """``h (time, lat, lon)`` float16 ``values``, 2 samples a chunk."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    arr = group.create_array("h", shape=values.shape, chunks=(2, *values.shape[1:]),
                             dtype="float16", dimension_names=["time", "lat", "lon"])  # fmt: skip
    arr[...] = values
    return open_geometries(root, ["h"])


# results past 65504 are inf, as they must be: numpy warns of the cast
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_coarsen_and_scaler_give_the_float16_of_the_exact_result_not_inf(
    tmp_path: Path,
) -> None:
    """float16 stays float16, but the arithmetic must not overflow where the result does not:
    a block mean of values near 20000 (their sum is past float16's 65504), a standardised
    value of 60000 with a spread of 30000, a std so small its inverse is past 65504."""
    rng = np.random.default_rng(7)
    h = rng.uniform(15000, 60000, (8, 4, 4)).astype(np.float16)
    h[:, 0, 0] = -60000
    h[:, 1, 1] = 1.0  # the mean of the tiny-std scaler: standardises to 0, not NaN
    g = _half_store(tmp_path / "half.zarr", h)
    manifest = split_by_chunk(g["h"], (1.0, 0.0, 0.0))
    exact = h.astype(np.float64)
    cases = [
        (Coarsen(2), exact.reshape(8, 2, 2, 2, 2).mean(axis=(2, 4))),
        (StandardScaler({"h": -10000.0}, {"h": 30000.0}), (exact + 10000) / (30000 + 1e-8)),
        (StandardScaler({"h": 1.0}, {"h": 1e-6}), (exact - 1) / (1e-6 + 1e-8)),
    ]
    for transform, want in cases:
        with insitu_pipeline(tmp_path / "half.zarr", manifest, {"h": g["h"]}, batch_size=4,
                             coords=(), chunk_transforms=[transform]) as pipe:  # fmt: skip
            for batch in pipe:
                got = batch["h"]
                assert got.dtype == np.float16, transform
                with np.errstate(over="ignore"):  # past 65504 the float16 is inf, as it must be
                    expected = want[batch.sample_indices["h"]].astype(np.float16)
                np.testing.assert_allclose(
                    got.astype(np.float64), expected.astype(np.float64), rtol=2e-3,
                    err_msg=repr(transform),
                )  # fmt: skip


def _cached_epoch(
    root: Path,
    manifest: SplitManifest,
    views: dict[str, ArrayGeometry],
    cache: Path,
    transform: Any,
    inner: tuple[int, ...],
    **kw: Any,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """One epoch of ``views`` (8 samples of ``inner`` after ``transform``) over the persistent
    cache ``cache``: every array in sample order, and the pipeline's stats."""
    with insitu_pipeline(root, manifest, views, batch_size=4, coords=(), cache_dir=cache,
                         persist=True, chunk_transforms=[transform], **kw) as pipe:  # fmt: skip
        got = {name: np.zeros((8, *inner), view.dtype) for name, view in views.items()}
        for batch in pipe:
            for name in got:
                got[name][batch.sample_indices[name]] = batch[name]
        return got, pipe.stats()


# the old arithmetic's inf, and results past 65504: numpy warns of the overflow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_persistent_cache_of_float16_chunks_made_by_the_float16_arithmetic_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the float16 fix of Coarsen and StandardScaler (6427f56) left their identity in a
    persistent cache as it was (a scaler's by its cache_key, Coarsen's by its pickle, which names
    the class and holds its factor only), so a cache warmed by the old code served its inf
    chunks for ever. After: their float16 chunks are stale (StaleCacheError naming the array;
    reset_stale_cache=True fetches them again), while a float32 array's, whose results did not
    change, stay warm."""
    h = np.random.default_rng(7).uniform(15000, 60000, (8, 4, 4)).astype(np.float16)
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for name, data in (("h", h), ("f", h.astype(np.float32))):
        group.create_array(name, shape=data.shape, chunks=(2, 4, 4), dtype=data.dtype,
                           dimension_names=["time", "lat", "lon"])[...] = data  # fmt: skip
    g = open_geometries(root, ["h", "f"])
    manifest = split_by_chunk(g["h"], (1.0, 0.0, 0.0))
    exact = h.astype(np.float64)
    both = {"h": -10000.0, "f": -10000.0}, {"h": 30000.0, "f": 30000.0}
    cases = [
        (StandardScaler(*both, cache_key="fit-1"), (exact + 10000) / (30000 + 1e-8)),
        (Coarsen(2), exact.reshape(8, 2, 2, 2, 2).mean(axis=(2, 4))),
    ]
    for i, (transform, want) in enumerate(cases):
        run = (root, manifest, g, tmp_path / f"cache{i}", transform, want.shape[1:])
        with monkeypatch.context() as old:  # the code before 6427f56
            old.setattr(transforms, "work_dtype", lambda dtype: dtype)
            for cls in (Coarsen, StandardScaler):
                old.delattr(cls, "cache_revision", raising=False)
            warm, _ = _cached_epoch(*run)
        assert np.isinf(warm["h"]).any() and np.isfinite(want).all()  # the old code's inf
        with pytest.raises(StaleCacheError, match="'h'") as refused:
            _cached_epoch(*run)
        assert "'f'" not in str(refused.value), refused.value
        got, stats = _cached_epoch(*run, reset_stale_cache=True)
        assert (stats["gets"], stats["disk_hits"]) == (4, 4), stats  # h fetched, f kept
        for name, array in got.items():
            np.testing.assert_allclose(array, want.astype(array.dtype), rtol=2e-3, err_msg=name)


def test_the_scaler_of_statistics_refuses_two_labels_of_one_array_with_other_statistics(
    tmp_path: Path,
) -> None:
    """A chunk transform standardises an array once, for every label reading it: of two labels
    of one array fitted on other points (the whole field, a box of it), the scaler cannot take
    both - it took the last one's silently, and the whole field came out with mean -2, not 0.
    Labels whose statistics agree (a shifted view's are its array's) share them."""
    root = tmp_path / "t.zarr"
    rng = np.random.default_rng(0)
    t = (rng.standard_normal((16, 4, 4)) + 10 * np.arange(4)[None, :, None]).astype(np.float32)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array("t", shape=t.shape, chunks=(4, 4, 4), dtype="float32",
                       dimension_names=["time", "lat", "lon"])[...] = t  # fmt: skip
    g = open_geometries(root, ["t"])["t"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    views = {"t": g, "t_next": g.shift(1), "north": g.isel(lat=slice(2, 4))}
    stats = fit_statistics(root, manifest, views)
    with pytest.raises(ValueError, match=r"'t'.*'north'.*scaler\(\['t'\]\)"):
        stats.scaler()
    scaler = stats.scaler(["t", "t_next"])
    with insitu_pipeline(root, manifest, {"t": g}, batch_size=16, coords=(),
                         chunk_transforms=[scaler]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
    exact = t.astype(np.float64)
    want = (exact[batch.sample_indices["t"]] - exact.mean()) / (exact.std() + 1e-8)
    np.testing.assert_allclose(batch["t"], want, rtol=1e-5, atol=1e-5)


def test_to_torch_on_the_cpu_takes_a_batch_a_flip_transform_reversed(tmp_path: Path) -> None:
    """A random flip is a batch transform (docs/transforms.md); numpy's flip is a view with a
    negative stride, which torch.from_numpy refuses. The CPU tensors hold the flipped rows, as
    the CUDA path (which stages a contiguous copy) does."""
    root = tmp_path / "stations.zarr"
    p = _stations(root)
    g = open_geometries(root, ["p"])
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))

    def flip(batch: Batch) -> Batch:
        batch.arrays["p"] = batch.arrays["p"][:, ::-1]
        return batch

    with insitu_pipeline(root, manifest, {"p": g["p"]}, batch_size=6, coords=(),
                         batch_transforms=[flip]) as pipe:  # fmt: skip
        for batch in pipe:
            tensors = to_torch(batch, device="cpu")
            np.testing.assert_array_equal(
                tensors["p"].numpy(), p[batch.sample_indices["p"]][:, ::-1]
            )


def test_a_static_array_that_chunk_transforms_would_skip_is_refused_saying_why(
    tmp_path: Path,
) -> None:
    """A static array (no sample axis) is read once whole, never as chunks, so no chunk
    transform runs on it. Statistics.scaler() of a pipeline's labels, a static one among
    them, delivered that label with its raw values, not standardised, without a word; and
    applies() naming it said the pipeline 'does not read' an array it reads."""
    root = tmp_path / "s.zarr"
    rng = np.random.default_rng(0)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    t = rng.standard_normal((16, 4, 4)).astype(np.float32)
    group.create_array("t", shape=t.shape, chunks=(4, 4, 4), dtype="float32",
                       dimension_names=["time", "lat", "lon"])[...] = t  # fmt: skip
    group.create_array("lsm", shape=(4, 4), chunks=(4, 4), dtype="float32",
                       dimension_names=["lat", "lon"])[...] = rng.random((4, 4))  # fmt: skip
    g = open_geometries(root, ["t", "lsm"])
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    views = {"t": g["t"], "lsm": g["lsm"]}
    stats = fit_statistics(root, manifest, views)
    with pytest.raises(ValueError, match=r"static array.*'lsm'.*normalizer"):
        insitu_pipeline(root, manifest, views, batch_size=4, coords=(),
                        chunk_transforms=[stats.scaler()])  # fmt: skip
    with pytest.raises(ValueError, match=r"'lsm'.*static.*batch transform"):
        insitu_pipeline(root, manifest, views, batch_size=4, coords=(),
                        chunk_transforms=[applies(["lsm"], Coarsen(2))])  # fmt: skip
    # the sampled array's scaler, with the static label normalised per label, is what works
    per_label = stats.normalizer({"lsm": g["lsm"]})
    with insitu_pipeline(root, manifest, views, batch_size=4, coords=(),
                         chunk_transforms=[stats.scaler(["t"])],
                         batch_transforms=[per_label]) as pipe:  # fmt: skip
        batch = next(iter(pipe))
    assert abs(float(batch["lsm"][0].mean())) < 1e-5
