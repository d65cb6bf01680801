"""Chunk transforms: run once per chunk on the decode threads, scoped by array path, sized by
their declared output; the shipped StandardScaler and Coarsen.

The oracle is zarr's own read of the store with the transform applied to it (the transform is
run on a ``DecodedChunk`` built from zarr's values, never on the package's buffers).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Oracle, write_era5

from insitubatch_nodes import (
    Coarsen,
    DecodedChunk,
    StandardScaler,
    applies,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkTransformError
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan.config import PlanConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (96, 8, 16) and z (96, 2, 8, 16), 8 samples per chunk (12 chunks), one tile each."""
    return write_era5(tmp_path_factory.mktemp("tf") / "era5.zarr")


class Recorder:
    """A thread-safe chunk transform that records what it saw (and changes nothing)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, tuple[int, int], tuple[int, ...]]] = []
        self._lock = threading.Lock()

    def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
        with self._lock:
            self.seen.append((chunk.array, chunk.chunk_index, chunk.sample_range, chunk.data.shape))
        return chunk

    def counts(self) -> Counter[tuple[str, int]]:
        return Counter((a, c) for a, c, _, _ in self.seen)


def add_one(chunk: DecodedChunk) -> DecodedChunk:
    chunk.data += 1
    return chunk


def transformed_oracle(
    oracle: Oracle, name: str, idx: np.ndarray, transform: Any, spc: int
) -> np.ndarray:
    """zarr's read of samples ``idx``, each put through ``transform`` inside its own chunk."""
    rows = []
    for i in np.asarray(idx).tolist():
        c = i // spc
        n = oracle.n_samples(name)
        rng = (c * spc, min((c + 1) * spc, n))
        chunk = DecodedChunk(name, c, rng, oracle(name, np.arange(*rng)).copy())
        rows.append(transform(chunk).data[i - rng[0]])
    return np.stack(rows)


def _epoch(pipe: Any) -> list[Any]:
    out = []
    for b in pipe:
        out.append(
            (
                {k: np.array(v) for k, v in b.arrays.items()},
                {k: np.array(v) for k, v in b.sample_indices.items()},
            )
        )
    return out


def test_a_chunk_transform_runs_once_per_chunk_per_epoch_however_many_batches_read_it(
    era5: Path,
) -> None:
    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    rec = Recorder()
    pipe = insitu_pipeline(
        era5,
        manifest,
        {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]},
        batch_size=2,  # every chunk of 8 samples feeds at least 4 batches
        block_chunks=3,
        chunk_transforms=[rec],
    )
    batches = _epoch(pipe)
    assert len(batches) >= 4 * 12
    counts = rec.counts()
    assert counts == Counter({(a, c): 1 for a in ("t2m", "z") for c in range(12)})
    for array, c, rng, shape in rec.seen:  # what the transform was handed, checked against zarr
        assert rng == (8 * c, 8 * c + 8)
        assert shape == ((8, 8, 16) if array == "t2m" else (8, 2, 8, 16))
    first = pipe.report()
    assert first is not None and first.transforms == 24
    # a second epoch: each chunk is a pool hit or transformed once more, never twice
    pipe.reset()
    rec.seen.clear()
    hits0 = pipe.stats()["hits"]
    _epoch(pipe)
    again = rec.counts()
    assert max(again.values(), default=0) <= 1
    assert sum(again.values()) + pipe.stats()["hits"] - hits0 == 24


def test_applies_restricts_a_transform_to_the_arrays_it_names(era5: Path) -> None:
    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    rec = Recorder()
    pipe = insitu_pipeline(
        era5,
        manifest,
        {"x": g["t2m"], "z": g["z"]},
        batch_size=16,
        chunk_transforms=[applies(["t2m"], add_one), applies(["z"], rec)],
    )
    oracle = Oracle(era5)
    for arrays, idx in _epoch(pipe):
        np.testing.assert_array_equal(arrays["x"], oracle("t2m", idx["x"]) + 1)
        np.testing.assert_array_equal(arrays["z"], oracle("z", idx["z"]))
    assert {a for a, _ in rec.counts()} == {"z"}


def test_applies_with_a_name_that_matches_no_array_raises_when_the_pipeline_is_built(
    era5: Path,
) -> None:
    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"t2mm.*'t2m', 'z'"):
        insitu_pipeline(
            era5,
            manifest,
            {"x": g["t2m"], "z": g["z"]},
            chunk_transforms=[applies(["t2mm"], add_one)],
        )
    # a batch label is not an array path
    with pytest.raises(ValueError, match="not batch labels"):
        insitu_pipeline(era5, manifest, {"x": g["t2m"]}, chunk_transforms=[applies(["x"], add_one)])
    with pytest.raises(TypeError, match="callables"):
        insitu_pipeline(era5, manifest, {"x": g["t2m"]}, chunk_transforms=[42])  # type: ignore[list-item]


def test_a_reshaping_transform_with_its_declaration_gathers_the_transformed_zarr_read(
    era5: Path, layouts_path: Path
) -> None:
    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (0.5, 0.5, 0.0))
    coarse, per_axis = Coarsen(2), Coarsen((1, 4, 4))
    pipe = insitu_pipeline(
        era5,
        manifest,
        {"x": g["t2m"], "y": g["t2m"].shift(3), "z": g["z"]},
        batch_size=5,
        chunk_transforms=[applies(["t2m"], coarse), applies(["z"], per_axis)],
    )
    oracle = Oracle(era5)
    batches = _epoch(pipe)
    assert batches
    for arrays, idx in batches:
        assert arrays["x"].shape[1:] == (4, 8) and arrays["z"].shape[1:] == (2, 2, 4)
        for label, name, t in (("x", "t2m", coarse), ("y", "t2m", coarse), ("z", "z", per_axis)):
            want = transformed_oracle(oracle, name, idx[label], t, 8)
            assert arrays[label].dtype == want.dtype == np.float32
            np.testing.assert_allclose(arrays[label], want, rtol=1e-6)
    # tiled with partial edge tiles, integer dtype (-> float32), the field halved on one axis
    lg = open_geometries(layouts_path, ["tiled"])["tiled"]
    lm = split_by_chunk(lg, (1.0, 0.0, 0.0))
    half = Coarsen((2, 1))
    lpipe = insitu_pipeline(layouts_path, lm, {"t": lg}, batch_size=4, chunk_transforms=[half])
    lor = Oracle(layouts_path)
    for arrays, idx in _epoch(lpipe):
        want = transformed_oracle(lor, "tiled", idx["t"], half, lg.samples_per_chunk)
        assert arrays["t"].shape[1:] == (5, 7) and arrays["t"].dtype == np.float32
        np.testing.assert_allclose(arrays["t"], want, rtol=1e-6)


class Lying:
    """Declares a (2, 3) sample but produces the decoded (4, 6) one halved only along lat."""

    def output_inner(self, geometry: Any) -> tuple[tuple[int, ...], Any]:
        return (4, 8), geometry.dtype

    def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
        chunk.data = np.ascontiguousarray(chunk.data[:, ::2, :])
        return chunk

    def __repr__(self) -> str:
        return "Lying()"


def test_a_transform_whose_output_disagrees_with_its_declaration_raises_naming_it_and_both_shapes(
    era5: Path,
) -> None:
    g = open_geometries(era5, ["t2m"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(era5, manifest, {"x": g["t2m"]}, chunk_transforms=[Lying()])
    with pytest.raises(ChunkTransformError) as info:
        _epoch(pipe)
    msg = str(info.value)
    assert "Lying()" in msg and "(8, 4, 16)" in msg and "(8, 4, 8)" in msg, msg
    assert "output_inner" in msg and "'t2m'" in msg


def test_an_undeclared_reshape_or_dtype_change_raises_instead_of_truncating(era5: Path) -> None:
    g = open_geometries(era5, ["t2m"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))

    def every_other_lon(chunk: DecodedChunk) -> DecodedChunk:
        chunk.data = chunk.data[:, :, ::2]
        return chunk

    def to_float64(chunk: DecodedChunk) -> DecodedChunk:
        chunk.data = chunk.data.astype("f8")
        return chunk

    def drop_a_sample(chunk: DecodedChunk) -> DecodedChunk:
        chunk.data = chunk.data[1:]
        return chunk

    for t, shown in (
        (every_other_lon, "(8, 8, 8)"),
        (to_float64, "float64"),
        (drop_a_sample, "sample axis"),
    ):
        pipe = insitu_pipeline(era5, manifest, {"x": g["t2m"]}, chunk_transforms=[t])
        with pytest.raises(ChunkTransformError) as info:
            _epoch(pipe)
        msg = str(info.value)
        assert t.__name__ in msg and shown in msg and "declares no output_inner" in msg, msg


def test_a_transform_that_raises_reaches_the_consumer_with_its_error_chained(era5: Path) -> None:
    g = open_geometries(era5, ["t2m"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))

    def broken(chunk: DecodedChunk) -> DecodedChunk:
        raise ZeroDivisionError("a bug in the transform")

    for policy in ("raise", "nan"):  # a transform bug is never a bad chunk
        pipe = insitu_pipeline(
            era5, manifest, {"x": g["t2m"]}, chunk_transforms=[broken], on_bad_chunk=policy
        )
        with pytest.raises(ChunkTransformError, match="broken raised on array 't2m'") as info:
            _epoch(pipe)
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        assert pipe.bad_chunks == []


def test_a_partial_last_chunk_is_handed_to_the_transform_with_its_own_sample_count(
    layouts_path: Path,
) -> None:
    g = open_geometries(layouts_path, ["partial"])["partial"]  # 43 samples, chunks of 4
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    rec = Recorder()
    pipe = insitu_pipeline(
        layouts_path, manifest, {"p": g}, batch_size=8, chunk_transforms=[rec, add_one]
    )
    oracle = Oracle(layouts_path)
    for arrays, idx in _epoch(pipe):
        np.testing.assert_array_equal(arrays["p"], oracle("partial", idx["p"]) + 1)
    last = [s for s in rec.seen if s[1] == 10]
    assert last == [("partial", 10, (40, 43), (3, 3))]


# ---------------------------------------------------------------------------------------------
# StandardScaler
# ---------------------------------------------------------------------------------------------


def test_standard_scaler_output_has_mean_zero_and_std_one_per_variable_and_level(
    era5: Path,
) -> None:
    oracle = Oracle(era5)
    t2m, z = oracle("t2m", np.arange(96)), oracle("z", np.arange(96))
    mean = {"t2m": t2m.mean(), "z": z.mean(axis=(0, 2, 3)).reshape(2, 1, 1)}
    std = {"t2m": t2m.std(), "z": z.std(axis=(0, 2, 3)).reshape(2, 1, 1)}
    scaler = StandardScaler(mean, std, cache_key="v1")
    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        era5, manifest, {"x": g["t2m"], "z": g["z"]}, batch_size=12, chunk_transforms=[scaler]
    )
    batches = _epoch(pipe)
    x = np.concatenate([a["x"] for a, _ in batches])
    zz = np.concatenate([a["z"] for a, _ in batches])
    assert x.dtype == zz.dtype == np.float32 and len(x) == 96
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-4
    np.testing.assert_allclose(zz.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(zz.std(axis=(0, 2, 3)), 1, atol=1e-4)
    # and row by row it is the scaler applied to zarr's read
    for arrays, idx in batches[:2]:
        want = (oracle("z", idx["z"]) - mean["z"]) / (std["z"] + 1e-8)
        np.testing.assert_allclose(arrays["z"], want, rtol=1e-5, atol=1e-5)


def test_standard_scaler_is_checked_against_its_scope_when_the_pipeline_is_built(
    era5: Path, layouts_path: Path
) -> None:
    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"x": g["t2m"], "z": g["z"]}
    only_t2m = StandardScaler({"t2m": 280.0}, {"t2m": 10.0})
    with pytest.raises(ValueError, match=r"runs on \['z'\] but has no statistics"):
        insitu_pipeline(era5, manifest, views, chunk_transforms=[only_t2m])
    insitu_pipeline(era5, manifest, views, chunk_transforms=[applies(["t2m"], only_t2m)])
    per_level_wrong = StandardScaler({"z": np.zeros(2)}, {"z": np.ones(2)})  # (2,) vs (2, 8, 16)
    with pytest.raises(ValueError, match=r"shape \(2,\).*\(2, 8, 16\).*\(n_level, 1, 1\)"):
        insitu_pipeline(era5, manifest, views, chunk_transforms=[applies(["z"], per_level_wrong)])
    with pytest.raises(ValueError, match="same arrays"):
        StandardScaler({"t2m": 1.0}, {"z": 1.0})
    # an integer array is scaled into float32, declared through output_inner
    lg = open_geometries(layouts_path, ["tiled"])["tiled"]
    scaler = StandardScaler({"tiled": 100.0}, {"tiled": 50.0})
    pipe = insitu_pipeline(
        layouts_path, split_by_chunk(lg, (1.0, 0.0, 0.0)), {"t": lg}, chunk_transforms=[scaler]
    )
    oracle = Oracle(layouts_path)
    for arrays, idx in _epoch(pipe):
        assert arrays["t"].dtype == np.float32
        np.testing.assert_allclose(
            arrays["t"], (oracle("tiled", idx["t"]) - 100.0) / 50.0, rtol=1e-6
        )


def test_coarsen_refuses_a_field_its_factor_does_not_divide(era5: Path) -> None:
    g = open_geometries(era5, ["t2m"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"Coarsen\(3\).*\(8, 16\).*not divisible"):
        insitu_pipeline(era5, manifest, {"x": g["t2m"]}, chunk_transforms=[Coarsen(3)])
    with pytest.raises(ValueError, match="positive integer"):
        Coarsen(0)


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_lightning_data_module_passes_chunk_transforms_and_on_bad_chunk_to_every_split(
    era5: Path,
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    dm = InSituDataModule(
        era5,
        ["t2m"],
        (0.5, 0.5, 0.0),
        config=PlanConfig(batch_size=8),
        fetch=FetchOptions(on_bad_chunk="nan"),
        chunk_transforms=[applies(["t2m"], Coarsen(2))],
        transform=lambda b: b,
    )
    oracle = Oracle(era5)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batch = next(iter(loader))
        want = transformed_oracle(oracle, "t2m", batch.sample_indices["t2m"], Coarsen(2), 8)
        np.testing.assert_allclose(batch.arrays["t2m"], want, rtol=1e-6)
        assert loader.pipeline.stages.fetch.on_bad_chunk == "nan"
    dm.teardown()


# ---------------------------------------------------------------------------------------------
# Device transforms (to_torch)
# ---------------------------------------------------------------------------------------------


def _device_transform_check(era5: Path, device: str) -> None:
    import torch

    from insitubatch_nodes import to_torch

    g = open_geometries(era5, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(era5, manifest, {"x": g["t2m"], "z": g["z"]}, batch_size=8)
    batch = next(pipe)
    pipe.close()
    want_x = np.array(batch["x"])
    seen: list[tuple[str, str]] = []

    def standardize(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.append(("standardize", t["x"].device.type))
        return {**t, "x": (t["x"] - 1.5) * 2}

    def stack(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.append(("stack", t["x"].device.type))
        return {"xz": torch.cat([t["x"][:, None], t["z"]], dim=1)}

    out = to_torch(batch, device=device, device_transforms=[standardize, stack])
    assert seen == [("standardize", device), ("stack", device)]  # in order, after the copy
    assert list(out) == ["xz"] and out["xz"].device.type == device
    got = out["xz"].cpu().numpy()
    np.testing.assert_allclose(got[:, 0], (want_x - 1.5) * 2, rtol=1e-6)
    np.testing.assert_array_equal(got[:, 1:], batch["z"])
    np.testing.assert_array_equal(batch["x"], want_x)  # the batch itself is untouched
    with pytest.raises(TypeError, match="must return the"):
        to_torch(batch, device=device, device_transforms=[lambda t: list(t.values())])
    with pytest.raises(TypeError, match="device_transforms must be callables"):
        to_torch(batch, device=device, device_transforms=["x"])  # type: ignore[list-item]


def test_device_transforms_run_in_order_on_the_tensors_after_the_copy(era5: Path) -> None:
    _device_transform_check(era5, "cpu")


def test_device_transforms_run_on_the_cuda_tensors(era5: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _device_transform_check(era5, "cuda")


def test_a_reshaping_transform_on_an_array_sampled_along_z_sees_samples_first(
    microscopy_path: Path, layout: Any
) -> None:
    g = open_geometries(microscopy_path, ["image", "mask"], sample_axis=2)
    manifest = split_by_chunk(g["mask"], (1.0, 0.0, 0.0))
    rec = Recorder()
    pool_xy = Coarsen((1, 1, 2, 2))  # (t, c, y, x): halve y and x
    pipe = insitu_pipeline(
        microscopy_path,
        manifest,
        {"image": g["image"], "mask": g["mask"]},
        batch_size=5,
        chunk_transforms=[rec, pool_xy],
    )
    oracle = Oracle(microscopy_path)
    t, c, z, y, x = layout.MICRO_SHAPE
    for arrays, idx in _epoch(pipe):
        assert arrays["image"].shape[1:] == (t, c, y // 2, x // 2)
        assert arrays["mask"].shape[1:] == (t, 1, y // 2, x // 2)
        for label in ("image", "mask"):
            want = np.stack(
                [
                    pool_xy(DecodedChunk(label, 0, (0, 1), oracle(label, [i], 2).copy())).data[0]
                    for i in idx[label].tolist()
                ]
            )
            np.testing.assert_allclose(arrays[label], want, rtol=1e-6)
    image_chunks = [s for s in rec.seen if s[0] == "image"]
    assert len(image_chunks) == z // layout.MICRO_IMAGE_CHUNKS[2]
    assert all(shape == (2, t, c, y, x) for _, _, _, shape in image_chunks)


def test_buffers_for_reshaped_chunks_are_reused_not_allocated_per_chunk(era5: Path) -> None:
    g = open_geometries(era5, ["t2m"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        era5, manifest, {"x": g["t2m"]}, batch_size=8, chunk_transforms=[Coarsen(2)]
    )
    fetch = pipe.stages.fetch
    _epoch(pipe)
    kept = fetch.scratch_bytes - sum(d.scratch_bytes for d in fetch._decoders.values())
    chunk = g["t2m"].chunk_nbytes
    assert 0 < kept <= fetch._runner.spares.max_idle * chunk  # bounded, whatever the chunks (12)


@pytest.mark.parametrize("reshaping", [False, True], ids=["in-place", "declared-reshape"])
def test_a_chunk_transform_on_a_collection_sees_its_members_samples_as_the_batch_numbers_them(
    tmp_path: Path, reshaping: bool
) -> None:
    # members of 5, 2 and 7 samples in chunks of 2: a member's last chunk is followed by
    # padding on the collection's virtual axis. The transform used to see that padding as
    # rows of the chunk and virtual sample indices (member 2's first chunk as (8, 10)), while
    # batch.sample_indices count within each member: a transform writing each row's index,
    # or normalising by the chunk's own rows, gave other numbers than the batch's
    import zarr

    from insitubatch_nodes import Collection, Loader, split_by_member

    lengths = (5, 2, 7)
    arrays = []
    for m, n in enumerate(lengths):
        root = tmp_path / f"m{m}.zarr"
        data = zarr.create_array(root, name="img", shape=(n, 3, 4), chunks=(2, 3, 4), dtype="f4")
        data[:] = np.full((n, 3, 4), 100.0 * m, "f4")
        arrays.append((root, "img"))
    coll = Collection.from_arrays(arrays, names=["a", "b", "c"])
    seen: list[tuple[int | None, int, tuple[int, int], int]] = []
    lock = threading.Lock()

    class Index:
        """Each row becomes its member's value plus its sample index; optionally float64."""

        def output_inner(self, geometry: Any) -> tuple[tuple[int, ...], Any]:
            return geometry.inner_shape, np.dtype("f8" if reshaping else "f4")

        def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
            with lock:
                seen.append((chunk.member, chunk.chunk_index, chunk.sample_range, len(chunk.data)))
            rows = np.arange(*chunk.sample_range)[:, None, None]
            chunk.data = (chunk.data + rows).astype(self.output_inner(coll["data"])[1])
            return chunk

    manifest = split_by_member(coll, {"train": ["a", "b", "c"]})
    with insitu_pipeline(
        coll, manifest, {"x": coll["data"]}, batch_size=3, chunk_transforms=[Index()]
    ) as pipe:
        rows = 0
        for batch in Loader(pipe):
            m, i = batch.members["x"], batch.sample_indices["x"]
            want = 100.0 * m[:, None, None] + i[:, None, None] + np.zeros((1, 3, 4))
            np.testing.assert_array_equal(batch["x"], want)
            rows += len(batch)
    assert rows == sum(lengths)
    want_chunks = {
        (m, c, (2 * c, min(2 * c + 2, n)), min(2, n - 2 * c))
        for m, n in enumerate(lengths)
        for c in range(-(-n // 2))
    }
    assert sorted(seen) == sorted(want_chunks)


def test_applies_or_a_scaler_with_a_collections_variable_name_says_to_name_its_path(
    tmp_path: Path,
) -> None:
    import zarr

    from insitubatch_nodes import Collection, split_by_member

    for m in range(2):
        zarr.create_array(tmp_path / f"m{m}.zarr", name="img", shape=(2, 3), dtype="f4")
    coll = Collection.from_arrays([(tmp_path / f"m{m}.zarr", "img") for m in range(2)])
    manifest = split_by_member(coll, {"train": list(coll.members)})
    path = coll["data"].path
    with pytest.raises(ValueError, match=rf"a collection's variable.*: applies\(\[{path!r}\]"):
        insitu_pipeline(
            coll,
            manifest,
            {"x": coll["data"]},
            chunk_transforms=[applies(["data"], lambda chunk: chunk)],
        )
    scaler = StandardScaler({"data": 0.0}, {"data": 1.0})
    with pytest.raises(ValueError, match=rf"a collection's variable.*: key {path!r}"):
        insitu_pipeline(coll, manifest, {"x": coll["data"]}, chunk_transforms=[scaler])
