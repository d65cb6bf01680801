"""fit_statistics: per-channel statistics over a split, against numpy in float64."""

from __future__ import annotations

import builtins
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes._moments import BLOCK as _BLOCK
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.fetch import AsyncChunkFetchNode
from insitubatch_nodes.stages.gather import GatherNode
from insitubatch_nodes.stages.read_plan import ReadPlanNode
from insitubatch_nodes.stages.resident import ChunkPoolNode
from insitubatch_nodes.statistics import Statistics, fit_statistics
from insitubatch_nodes.transforms import applies

T, L, Y, X = 40, 3, 6, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stats") / "s.zarr"
    group = zarr.open_group(root, mode="w")
    rng = np.random.default_rng(3)
    t = (rng.standard_normal((T, L, Y, X)) * [[[[1.0]], [[10.0]], [[100.0]]]] + 250).astype("f4")
    t[5, 1, 2, 3] = np.nan
    t[17, 0, :, :] = np.nan
    t2 = (rng.standard_normal((T, Y, X)) + 280).astype("f4")
    for name, data, chunks, dims in (
        ("t", t, (4, 1, Y, 4), ("time", "level", "lat", "lon")),
        ("t2", t2, (4, Y, X), ("time", "lat", "lon")),
        ("lsm", rng.random((Y, X)).astype("f4"), (Y, X), ("lat", "lon")),
    ):
        arr = group.create_array(name, shape=data.shape, chunks=chunks, dtype="f4",
                                 dimension_names=dims, fill_value=np.nan)  # fmt: skip
        arr[...] = data
    level = group.create_array("level", shape=(L,), dtype="i4", dimension_names=("level",))
    level[...] = [850, 500, 250]
    return root


def _oracle(data: np.ndarray, samples: np.ndarray, channel_axes: int) -> dict[str, np.ndarray]:
    x = data[samples].astype(np.float64)
    axes = (0, *range(1 + channel_axes, x.ndim))
    pairs = samples[:-1][np.diff(samples) == 1]
    d = data[pairs + 1].astype(np.float64) - data[pairs].astype(np.float64)
    return {
        "mean": np.nanmean(x, axis=axes),
        "std": np.nanstd(x, axis=axes),
        "min": np.nanmin(x, axis=axes),
        "max": np.nanmax(x, axis=axes),
        "diff_std": np.nanstd(d, axis=axes),
        "nan_count": np.isnan(x).sum(axis=axes),
    }


def test_statistics_equal_numpy_in_float64_over_the_split_with_nans_skipped_and_counted(
    store: Path,
) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (0.6, 0.2, 0.2), contiguous=False, seed=1)
    views = {"t": geoms["t"], "t2": geoms["t2"], "t_hi": geoms["t"].sel(level=[250, 850])}
    stats = fit_statistics(store, manifest, views, split="train", batch_size=5)
    samples = manifest.samples("train")
    assert np.any(np.diff(samples) != 1), "the split is not one run: differences skip its gaps"
    t, t2 = zarr.open_array(store / "t")[...], zarr.open_array(store / "t2")[...]
    for label, data, channel_axes in (("t", t, 1), ("t2", t2, 0), ("t_hi", t[:, [2, 0]], 1)):
        want = _oracle(data, samples, channel_axes)
        for name, expected in want.items():
            got = getattr(stats, name)[label]
            assert got.shape == expected.shape, (label, name)
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"{label} {name}")
    assert stats.nan_count["t"].tolist() == [Y * X * (17 in samples), 1 * (5 in samples), 0]


def test_statistics_over_a_window_count_only_its_samples_not_its_edge_chunks_others(
    store: Path,
) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (1.0, 0.0, 0.0), sample_range=(3, 14))
    assert manifest.samples("train").tolist() == list(range(3, 14))
    stats = fit_statistics(store, manifest, {"t2": geoms["t2"]}, split="train", batch_size=4)
    want = _oracle(zarr.open_array(store / "t2")[...], np.arange(3, 14), 0)
    for name, expected in want.items():
        np.testing.assert_allclose(getattr(stats, name)["t2"], expected, rtol=1e-6, err_msg=name)


def test_statistics_of_fields_far_from_zero_and_of_constant_fields_equal_numpy(
    tmp_path: Path,
) -> None:
    # a mean 3e6 standard deviations from zero (the squares cancel in float64 sums: the
    # deviations from a reference are summed instead), a constant channel and an integer array
    root = tmp_path / "far.zarr"
    group = zarr.open_group(root, mode="w")
    rng = np.random.default_rng(5)
    far = np.empty((T, 3, Y, X), "f4")
    far[:, 0] = 3e6 + rng.standard_normal((T, Y, X))
    far[:, 1] = 7.5
    far[:, 2] = rng.standard_normal((T, Y, X)) * 1e-3 - 40.0
    counts = rng.integers(0, 1000, (T, Y, X)).astype("i4")
    for name, data in (("far", far), ("counts", counts)):
        dims = ("time", "level", "lat", "lon") if data.ndim == 4 else ("time", "lat", "lon")
        arr = group.create_array(name, shape=data.shape, chunks=(4, *data.shape[1:]),
                                 dtype=data.dtype, dimension_names=dims)  # fmt: skip
        arr[...] = data
    geoms = open_geometries(root)
    manifest = split_by_chunk(geoms["far"], (0.75, 0.25, 0.0))
    stats = fit_statistics(root, manifest, ["far", "counts"], batch_size=7)
    samples = manifest.samples("train")
    for label, data, channel_axes in (("far", far, 1), ("counts", counts, 0)):
        for name, expected in _oracle(data, samples, channel_axes).items():
            got = getattr(stats, name)[label]
            np.testing.assert_allclose(
                got, expected, rtol=1e-6, atol=1e-12, err_msg=f"{label} {name}"
            )
    assert stats.std["far"][1] == 0.0 and stats.diff_std["far"][1] == 0.0


@pytest.mark.parametrize("block", [5, 24, 7 * 8])
def test_moments_taken_a_block_at_a_time_equal_numpy_whatever_the_blocks_split(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # blocks of a part of a row's values (5), of a few channels of a row (24 = 3 x 8) and of
    # whole rows (56): the sums, the far-from-zero fallback and the one-step differences
    # (float32, float64, uint8: an unsigned difference below 0) equal numpy's in float64
    from insitubatch_nodes import _moments

    monkeypatch.setattr(_moments, "BLOCK", block)
    rng = np.random.default_rng(3)
    for data in (
        (rng.standard_normal((6, 4, 8)) * 2 + 280).astype("f4"),
        rng.standard_normal((6, 4, 8)) * 1e-3 + 3e6,
        rng.integers(0, 255, (6, 4, 8)).astype("u1"),
    ):
        moments, diffs = _moments._Moments(), _moments._Moments()
        for r0 in (0, 2, 5):  # batches of 2, 3 and 1 rows, each joined to the one before
            rows = data[r0 : {0: 2, 2: 5, 5: 6}[r0]]
            moments.add(rows)
            if r0:
                diffs.add_difference(rows[:1], data[r0 - 1 : r0])
            diffs.add_difference(rows[1:], rows[:-1])
        x, d = data.astype("f8"), np.diff(data.astype("f8"), axis=0)
        got, step = moments.result((4,)), diffs.result((4,))
        for name, expected in (("mean", x.mean((0, 2))), ("std", x.std((0, 2))),
                               ("min", x.min((0, 2))), ("max", x.max((0, 2)))):  # fmt: skip
            np.testing.assert_allclose(got[name], expected, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(step["mean"], d.mean((0, 2)), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(step["std"], d.std((0, 2)), rtol=1e-6)
        assert (got["count"] == 6 * 8).all() and (step["count"] == 5 * 8).all()


@pytest.mark.parametrize("block", [_BLOCK, 5, 24, 7 * 8])
def test_moments_and_steps_taken_in_one_pass_equal_numpy_whatever_the_blocks_and_pairs(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # add_steps: a batch's moments and its one-step differences' from one widening of each
    # block (rows' sums, squares and dot products with the next row, carried across blocks of
    # rows); every pair subset, a channel whose steps are tiny beside its values (formed
    # instead), a NaN, and float64 data (both formed) equal numpy in float64
    from insitubatch_nodes import _moments

    monkeypatch.setattr(_moments, "BLOCK", block)
    rng = np.random.default_rng(4)
    data = (rng.standard_normal((7, 4, 8)) * 2 + 280).astype("f4")
    data[:, 2] = 2e4 + np.arange(7)[:, None] * 0.5 + rng.standard_normal((7, 8)) * 1e-3
    with_nan = data.copy()
    with_nan[3, 1, 5] = np.nan
    for x in (data, with_nan, data.astype("f8")):
        for pairs in ([0, 1, 2, 3, 4, 5], [1, 4, 5], []):
            moments, steps = _moments._Moments(), _moments._Moments()
            moments.add_steps(x, steps, np.array(pairs, np.intp))
            x64 = x.astype("f8")
            got = moments.result((4,))
            for name, of in (("mean", np.nanmean), ("std", np.nanstd), ("min", np.nanmin),
                             ("max", np.nanmax)):  # fmt: skip
                np.testing.assert_allclose(got[name], of(x64, (0, 2)), rtol=1e-9, err_msg=name)
            if not pairs:
                assert not steps.started
                continue
            d = x64[np.array(pairs) + 1] - x64[pairs]
            step = steps.result((4,))
            np.testing.assert_allclose(step["mean"], np.nanmean(d, (0, 2)), rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(step["std"], np.nanstd(d, (0, 2)), rtol=1e-6)
            assert step["count"].tolist() == (~np.isnan(d)).sum((0, 2)).tolist()


def test_steps_of_float32_rows_without_nan_form_no_difference_unless_a_channel_would_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the one-pass route: no difference formed for channels whose steps are large enough
    # beside their values, only the cancelling channel's (its rows alone)
    from insitubatch_nodes import _moments

    formed: list[tuple[int, ...]] = []
    plain = _moments._Moments.add_difference

    def spy(self: _moments._Moments, later: np.ndarray, earlier: np.ndarray) -> None:
        formed.append(later.shape)
        plain(self, later, earlier)

    monkeypatch.setattr(_moments._Moments, "add_difference", spy)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((8, 3, 64)) * 2 + 280).astype("f4")
    _moments._Moments().add_steps(x, _moments._Moments(), np.arange(7))
    assert formed == []
    x[:, 1] = 3e4 + np.arange(8)[:, None] * 2.0**-7  # equal steps, tiny beside 3e4: cancel
    _moments._Moments().add_steps(x, _moments._Moments(), np.arange(7))
    assert formed == [(7, 1, 64)]


def test_statistics_at_one_sample_per_chunk_equal_numpy_with_fetch_options_either_way(
    tmp_path: Path,
) -> None:
    # one sample per chunk: the fit decodes rows straight into its batches and keeps nothing
    # for a next epoch; fetch settings as keywords or as one FetchOptions (the fit sets its
    # own report, trace and direct on it) give the same statistics
    root = tmp_path / "one.zarr"
    group = zarr.open_group(root, mode="w")
    rng = np.random.default_rng(7)
    t = (rng.standard_normal((T, L, Y, X)) * 3 + 250).astype("f4")
    t[9, 2, 1, 1] = np.nan
    t2 = (rng.standard_normal((T, Y, X)) + 280).astype("f4")
    for name, data in (("t", t), ("t2", t2)):
        dims = ("time", "level", "lat", "lon") if data.ndim == 4 else ("time", "lat", "lon")
        arr = group.create_array(name, shape=data.shape, chunks=(1, *data.shape[1:]),
                                 dtype="f4", dimension_names=dims)  # fmt: skip
        arr[...] = data
    geoms = open_geometries(root)
    manifest = split_by_chunk(geoms["t"], (0.5, 0.25, 0.25), contiguous=False, seed=2)
    views = {"t": geoms["t"], "t2": geoms["t2"], "t_pair": geoms["t"].isel(level=[2, 0])}
    samples = manifest.samples("train")
    as_keywords = fit_statistics(root, manifest, views, batch_size=6, decode_threads=1)
    as_object = fit_statistics(root, manifest, views, batch_size=6,
                               fetch=FetchOptions(decode_threads=1, trace=True))  # fmt: skip
    for stats in (as_keywords, as_object):
        for label, data, channel_axes in (("t", t, 1), ("t2", t2, 0), ("t_pair", t[:, [2, 0]], 1)):
            for name, expected in _oracle(data, samples, channel_axes).items():
                got = getattr(stats, name)[label]
                np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"{label} {name}")
    with pytest.raises(TypeError, match="FetchOptions"):
        fit_statistics(root, manifest, views, fetch={"decode_threads": 1})


def test_statistics_of_a_static_field_are_of_the_field_and_have_no_differences(
    store: Path,
) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (0.5, 0.5, 0.0))
    stats = fit_statistics(store, manifest, {"t2": geoms["t2"], "lsm": geoms["lsm"]})
    lsm = zarr.open_array(store / "lsm")[...].astype(np.float64)
    np.testing.assert_allclose(stats.mean["lsm"], lsm.mean(), rtol=1e-6)
    np.testing.assert_allclose(stats.std["lsm"], lsm.std(), rtol=1e-6)
    assert np.isnan(stats.diff_std["lsm"])


@pytest.mark.parametrize("dtype", ["f8", "f4", "f2"])
def test_a_static_label_normalised_keeps_its_float_dtype_and_equals_numpy(
    tmp_path: Path, dtype: str
) -> None:
    # the normalizer made float32 of a static field's broadcast rows, whatever its dtype (a
    # float64 field beside float64 data came out float32, the data float64)
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w")
    rng = np.random.default_rng(5)
    for name, shape, dims in (
        ("t", (8, 3, 4), ("time", "lat", "lon")),
        ("z0", (3, 4), ("lat", "lon")),
    ):
        arr = group.create_array(name, shape=shape, chunks=shape, dtype=dtype, dimension_names=dims)
        arr[...] = (rng.standard_normal(shape) * 50 + 100).astype(dtype)
    geoms = open_geometries(root)
    manifest = split_by_chunk(geoms["t"], (1.0, 0.0, 0.0))
    views = {"t": geoms["t"], "z0": geoms["z0"]}
    stats = fit_statistics(root, manifest, views)
    pipe = insitu_pipeline(root, manifest, views, batch_size=4, coords=(),
                           batch_transforms=[stats.normalizer(views)])  # fmt: skip
    with pipe:
        batch = next(iter(pipe))
    z0 = zarr.open_array(root / "z0")[...].astype(np.float64)
    want = ((z0 - stats.mean["z0"]) / (stats.std["z0"] + 1e-8)).astype(dtype)
    assert batch["z0"].dtype == batch["t"].dtype == np.dtype(dtype)
    np.testing.assert_allclose(batch["z0"], np.broadcast_to(want, (4, 3, 4)), rtol=1e-3)


def test_statistics_of_a_window_or_shifted_view_are_those_of_its_array(store: Path) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (0.5, 0.5, 0.0))
    plain = fit_statistics(store, manifest, {"t2": geoms["t2"]})
    moved = fit_statistics(store, manifest, {"t2": geoms["t2"].shift(1).window([-1, 0])})
    for name in ("mean", "std", "min", "max", "diff_std"):
        np.testing.assert_array_equal(getattr(moved, name)["t2"], getattr(plain, name)["t2"])


def test_statistics_of_a_patched_view_are_those_of_its_field_within_its_windows_box(
    store: Path,
) -> None:
    # windows overlap (4 of 6 rows: origins 0 and 2), or are drawn at random, and consecutive
    # rows are other windows: the statistics and the differences are still the field's, of the
    # same point at consecutive samples, within the box ``within`` keeps the windows in
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (0.5, 0.5, 0.0))
    views = {
        "grid": geoms["t"].sel(level=[500, 850]).patches({"lat": 4, "lon": 4}),
        "random": geoms["t2"].patches({"lat": 3, "lon": 4}, origins="random"),
        "within": geoms["t2"].patches({"lat": 2}, within={"lat": (1, 5)}),
    }
    samples = manifest.samples("train")
    t, t2 = zarr.open_array(store / "t")[...], zarr.open_array(store / "t2")[...]
    for label, data, channel_axes in (
        ("grid", t[:, [1, 0]], 1), ("random", t2, 0), ("within", t2[:, 1:5], 0),
    ):  # fmt: skip
        stats = fit_statistics(store, manifest, {label: views[label]}, batch_size=4)
        for name, expected in _oracle(data, samples, channel_axes).items():
            got = getattr(stats, name)[label]
            np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"{label} {name}")
    with pytest.raises(ValueError, match="patched along a channel axis"):
        fit_statistics(store, manifest, {"t": geoms["t"].patches({"level": 2, "lat": 3})})
    # a box on the grid keeps every channel: the chunk transform takes its statistics
    assert stats.scaler().mean["t2"].shape == ()  # one value: a scalar, broadcasting to any field
    with pytest.raises(ValueError, match="reads a selection"):
        fit_statistics(store, manifest, {"t": geoms["t"].sel(level=[500])}).scaler()


def test_with_a_stride_the_differences_are_between_anchors_one_stride_apart(
    store: Path,
) -> None:
    # anchors every 3rd sample: no two are consecutive samples, so the differences were NaN;
    # they are the step the pass takes (GraphCast's 6 h on hourly data)
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (0.6, 0.4, 0.0), contiguous=False, seed=3)
    stats = fit_statistics(store, manifest, {"t2": geoms["t2"]}, stride=3, batch_size=4)
    anchors = manifest.samples("train")
    anchors = anchors[anchors % 3 == 0]
    assert np.any(np.diff(anchors) != 3), "the split has gaps: no difference across them"
    t2 = zarr.open_array(store / "t2")[...].astype(np.float64)
    pairs = anchors[:-1][np.diff(anchors) == 3]
    diff_std = np.std(t2[pairs + 3] - t2[pairs])
    np.testing.assert_allclose(stats.mean["t2"], t2[anchors].mean(), rtol=1e-6)
    np.testing.assert_allclose(stats.diff_std["t2"], diff_std, rtol=1e-6)


def test_statistics_saved_as_json_load_equal_and_check_their_dataset(
    store: Path, tmp_path: Path
) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (0.5, 0.5, 0.0))
    stats = fit_statistics(store, manifest, ["t", "t2"])
    stats.save(tmp_path / "stats.json")
    back = Statistics.load(tmp_path / "stats.json", dataset=stats.dataset)
    for name in ("mean", "std", "min", "max", "diff_std", "count", "nan_count"):
        for label in ("t", "t2"):
            np.testing.assert_array_equal(getattr(back, name)[label], getattr(stats, name)[label])
    other = fit_statistics(store, manifest, ["t2"], split="val")
    with pytest.raises(ValueError, match="another dataset"):
        Statistics.load(tmp_path / "stats.json", dataset=other.dataset)
    # the part to check built with numpy values (chunks from the manifest): they raised
    # TypeError (not JSON serializable) instead of being compared
    chunks = np.asarray(manifest.chunks("train"))
    Statistics.load(tmp_path / "stats.json", dataset={"chunks": chunks, "split": "train"})
    with pytest.raises(ValueError, match="another dataset"):
        Statistics.load(tmp_path / "stats.json", dataset={"chunks": chunks[:1]})


def test_fitted_statistics_normalise_batches_to_zero_mean_and_unit_std(store: Path) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (1.0, 0.0, 0.0))
    views = {"t": geoms["t"], "t2": geoms["t2"]}
    stats = fit_statistics(store, manifest, views)
    for transform in ("batch", "chunk"):
        kwargs: dict = (
            {"batch_transforms": [stats.normalizer(views)]}
            if transform == "batch"
            else {"chunk_transforms": [stats.scaler()]}
        )
        pipe = insitu_pipeline(store, manifest, views, batch_size=T, shuffle=False, **kwargs)
        batch = next(iter(pipe))
        pipe.close()
        t = batch.arrays["t"].astype(np.float64)
        np.testing.assert_allclose(np.nanmean(t, axis=(0, 2, 3)), 0.0, atol=1e-4)
        np.testing.assert_allclose(np.nanstd(t, axis=(0, 2, 3)), 1.0, rtol=1e-4)


def test_a_label_standardised_by_a_chunk_scaler_and_again_by_its_batch_is_refused(
    store: Path,
) -> None:
    # each takes the array's own values: both together gave (z - mean) / std of z, silently
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["t"], (1.0, 0.0, 0.0))
    views = {"t": geoms["t"], "t2": geoms["t2"]}
    stats = fit_statistics(store, manifest, views)
    both = [
        ({"t2": geoms["t2"]}, {"batch_transforms": [stats.normalizer({"t2": geoms["t2"]})]}),
        ({"x": stack({"t2": geoms["t2"]}, normalize=stats)}, {}),
    ]
    for labels, normalised in both:
        with pytest.raises(ValueError, match=r"'t2'\)? would be standardised twice"):
            insitu_pipeline(store, manifest, labels, batch_size=4,
                            chunk_transforms=[stats.scaler(["t2"])], **normalised)  # fmt: skip
    # a graph composed by hand is refused alike, by its gather stage
    plan = ReadPlanNode(manifest, {"t2": geoms["t2"]}, config=PlanConfig(batch_size=4))
    context = StageContext.create(plan, ChunkPool(1 << 24), chunk_transforms=[stats.scaler(["t2"])])
    resident = ChunkPoolNode(
        AsyncChunkFetchNode(plan, str(store), context=context), context=context
    )
    with pytest.raises(ValueError, match="would be standardised twice"):
        GatherNode(
            resident, context=context, batch_transforms=[stats.normalizer({"t2": geoms["t2"]})]
        )
    # a scaler on one array and the batch normaliser on another are one standardisation each
    pipe = insitu_pipeline(
        store, manifest, views, batch_size=4,
        chunk_transforms=[applies(["t2"], stats.scaler(["t2"]))],
        batch_transforms=[stats.normalizer({"t": geoms["t"]})],
    )  # fmt: skip
    pipe.close()


def test_statistics_of_a_collection_given_as_the_store_are_numpys_over_its_members_samples(
    tmp_path: Path,
) -> None:
    # insitu_pipeline takes the collection itself as its store; fit_statistics used to fail
    # with "TypeError: expected str, bytes or os.PathLike object, not Collection". The
    # members' padding chunks must not count, nor differences across two members
    from insitubatch_nodes import Collection, split_by_member

    members = []
    for m, n in enumerate((5, 3, 1)):
        data = (np.random.default_rng(m).random((n, 2, 3)) * 10 + 100 * m).astype("f4")
        array = zarr.create_array(
            tmp_path / f"m{m}.zarr", name="img", shape=data.shape, chunks=(2, 2, 3),
            dtype="f4", fill_value=-1000.0,
        )  # fmt: skip
        array[:] = data
        members.append(data.astype("f8"))
    coll = Collection.from_arrays([(tmp_path / f"m{m}.zarr", "img") for m in range(3)])
    manifest = split_by_member(coll, {"train": list(coll.members)})
    stats = fit_statistics(coll, manifest, {"x": coll["data"]})
    values = np.concatenate([d.ravel() for d in members])
    steps = np.concatenate([np.diff(d, axis=0).ravel() for d in members])
    np.testing.assert_allclose(stats.mean["x"], values.mean(), rtol=1e-9)
    np.testing.assert_allclose(stats.std["x"], values.std(), rtol=1e-9)
    assert stats.min["x"] == values.min() and stats.max["x"] == values.max()
    assert stats.count["x"] == values.size
    np.testing.assert_allclose(stats.diff_std["x"], steps.std(), rtol=1e-6)


def _given(mean: float, std: float, labels: Sequence[str]) -> Statistics:
    """Statistics of the labels (each one array of its name, one channel): ``mean``, ``std``."""
    one = {label: np.array(np.nan) for label in labels}
    return Statistics(mean={label: np.array(mean) for label in labels},
                      std={label: np.array(std) for label in labels}, min=one, max=one,
                      diff_std=one, count=one, nan_count=one,
                      paths={label: label for label in labels})  # fmt: skip


# results past 65504 are inf, as they must be: numpy warns of the cast
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_batches_normalised_by_statistics_or_a_stack_are_the_float16_of_the_exact_result(
    tmp_path: Path,
) -> None:
    """float16 stays float16, but ``(x - mean) / std`` must not overflow where the result does
    not: 60000 with a mean of -10000 and a spread of 30000 (``x - mean`` is past float16's
    65504), and a value at the mean of a std of 1e-8 (float16 rounds it to 0: 0 / 0). Through
    normalizer() and a stack's normalize= (gathered rows, rows decoded in place, a static
    member)."""
    rng = np.random.default_rng(7)
    h = rng.uniform(15000, 60000, (8, 4, 4)).astype(np.float16)
    h[:, 0, 0] = -60000
    h[:, 1, 1] = 1.0  # the mean of the tiny std: standardises to 0, not NaN
    root = tmp_path / "half.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for name, data in (("h", h), ("s", h[3])):
        dims = ["time", "y", "x"][-data.ndim :]
        arr = group.create_array(name, shape=data.shape, chunks=(2, 4, 4)[-data.ndim :],
                                 dtype="float16", dimension_names=dims)  # fmt: skip
        arr[...] = data
    g = open_geometries(root, ["h", "s"])
    manifest = split_by_chunk(g["h"], (1.0, 0.0, 0.0))
    exact = h.astype(np.float64)
    wrong: list[str] = []
    for mean, std in ((-10000.0, 30000.0), (1.0, 1e-8)):
        stats = _given(mean, std, ["h", "s"])
        runs = [  # (what, views, pipeline options, the exact result)
            ("normalizer()", {"h": g["h"]}, {"batch_transforms": [stats.normalizer({"h": g["h"]})]},
             (exact - mean) / (std + 1e-8)),
            *((f"stack direct={d}", {"x": stack(g, normalize=stats)},
               {"fetch": FetchOptions(direct=d)}, (exact - mean) / std) for d in (False, True)),
        ]  # fmt: skip
        for what, views, options, want in runs:
            label = next(iter(views))
            with insitu_pipeline(root, manifest, views, batch_size=4, coords=(),
                                 **options) as pipe:  # fmt: skip
                for batch in pipe:
                    got = batch[label].reshape(4, -1, 4, 4)  # a stack: (h, s) channels
                    assert got.dtype == np.float16
                    rows = want[batch.sample_indices[label]]
                    expected = np.stack([rows, np.broadcast_to(want[3], rows.shape)], axis=1)
                    with np.errstate(over="ignore"):  # past 65504 it is inf, as it must be
                        expected = expected[:, : got.shape[1]].astype(np.float16)
                    close = np.isclose(got.astype(np.float64), expected, rtol=2e-3)
                    if not close.all():  # (every run is tried: each path is its own claim)
                        wrong.append(f"{what}, mean {mean} std {std}, channels "
                                     f"{sorted({int(c) for c in np.nonzero(~close)[1]})}: "
                                     f"{got[~close][:3]}, not {expected[~close][:3]}")  # fmt: skip
    assert not wrong, "\n".join(wrong)


class _CutShort:
    """A file open for writing that takes half of its first write and raises KeyboardInterrupt
    (Ctrl-C mid-write; a full disk likewise raises after part of the bytes)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, text: str) -> int:
        self.f.write(text[: len(text) // 2])
        raise KeyboardInterrupt

    def __enter__(self) -> _CutShort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def test_statistics_and_split_manifests_saved_over_a_write_cut_short_keep_the_earlier_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics.save wrote its JSON in place: a write cut short left a truncated file over the
    earlier one (which Statistics.load then refused). SplitManifest.save wrote ``<name>.tmp``
    and renamed it, but left the partial ``.tmp`` behind. Both now appear whole or not at all,
    as a trace does, and leave no temporary file."""
    stats = _given(250.0, 3.5, ["h"])
    manifest = SplitManifest("h", 40, 4, {"train": (0, 1, 2), "val": (3,)})
    saves = {"stats.json": stats.save, "split.json": manifest.save}
    for name, save in saves.items():
        save(tmp_path / name)
    whole = {name: (tmp_path / name).read_bytes() for name in saves}
    real = io.open

    def cut_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real(file, mode, *args, **kwargs)
        writes = "w" in mode and not isinstance(file, int) and Path(file).parent == tmp_path
        return _CutShort(f) if writes else f

    with monkeypatch.context() as cut:
        cut.setattr(io, "open", cut_open)
        cut.setattr(builtins, "open", cut_open)
        for name, save in saves.items():
            with pytest.raises(KeyboardInterrupt):
                save(tmp_path / name)
    now = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {n: len(b) for n, b in now.items()} == {n: len(b) for n, b in whole.items()}
    assert now == whole
    assert Statistics.load(tmp_path / "stats.json").mean["h"] == 250.0
    assert SplitManifest.load(tmp_path / "split.json") == manifest
