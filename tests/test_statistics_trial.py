"""Fitted statistics and their normalisation as a demanding forecaster or microscopist uses
them: cases found by the statistics trial of 2026-12-06 (small stores crossing zarr v2 and v3,
sharded, float16/32/64 and CF-packed int16 with ``scale_factor``, ``add_offset`` and
``_FillValue``, NaN-blanked regions and all-NaN channels; plain views, ``isel``/``sel`` of
levels and boxes on a latitude stored north to south, ``patches()``, windows and shifts,
static fields and forcings in stacks, ``concat``, ``join``, ``from_arrays`` and plate
collections, a sample axis named ``z``; splits of one sample, ``sample_range`` windows,
``missing=``, int and time strides, one and several samples per chunk, a persistent cache;
numpy in float64 over zarr's or xarray's values as the oracle), each kept as a claim.

Found (now fixed): a constant channel with NaNs in it (a mask with missing points) was fitted a
``std`` of rounding residue (1e-17 of a float64 0.1) instead of 0, so the stack's guard for
constant channels missed it and a value off the constant standardised to 1e15 (on the fitted
split, to ±1 instead of 0); a field far from zero (3e6) whose first batches were all NaN was
fitted a ``std`` 4e-4 off (its later batches' deviations taken from the empty running mean, 0,
whose squares cancelled); ``stats.normalizer`` and ``stats.scaler()`` divided a constant
channel by ``0 + eps``: a value off the constant (a land point in a box that was all sea in
training) became 1e8 times its difference, inf in float16, where a stack's ``normalize=`` gives
the difference; statistics fitted on one array standardised a view of another array given
under their label, silently; ``fit_statistics(..., rank=1, world_size=2)`` (or ``shuffle=``,
``coords=``) failed with Python's "got multiple values for keyword argument".

Needed no claim (matched the oracle in every case tried, about 9,000 checks): every statistic,
the NaN counts, ``diff_std`` over consecutive samples only (none across a split's gap, a
``missing=`` step or an absent time), the JSON round trip and its ``dataset`` check (another
store, split, levels or box refused), and ``stack(..., normalize=stats)`` against ``(x - mean) /
std`` for every member order, both layouts, windows, static and forcing members, rows decoded
in place or gathered (within half an ulp of the float32 mean over ``std``: the float32 data's
own resolution).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.statistics import Statistics, fit_statistics

pytestmark = pytest.mark.timeout(60)

T, Y, X = 12, 3, 4
TRAIN = 8  # samples 0..7 train, 8..11 validation (chunks of 2)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``f (time, level, y, x)`` float64: level 0 noise, level 1 the constant 0.1 with missing
    points (NaN) and 0.2 in the validation samples; ``mask (y, x)`` static, 0.1 with missing
    points; ``h (time, y, x)`` float16, 1.0 in training and 2.0 in validation; ``r (time, y,
    x)`` noise; ``far (time, y, x)`` 3e6 plus noise, its first 4 samples all NaN."""
    root = tmp_path_factory.mktemp("stattrial") / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    rng = np.random.default_rng(0)
    f = np.empty((T, 2, Y, X))
    f[:, 0] = rng.standard_normal((T, Y, X))
    f[:, 1] = 0.1
    f[:, 1, 0, :3] = np.nan
    f[TRAIN:, 1] = 0.2
    mask = np.full((Y, X), 0.1)
    mask[0, :3] = np.nan
    h = np.ones((T, Y, X), np.float16)
    h[TRAIN:] = 2.0
    far = 3e6 + rng.standard_normal((T, Y, X))
    far[:4] = np.nan
    arrays = {
        "f": (f, ("time", "level", "y", "x")),
        "mask": (mask, ("y", "x")),
        "h": (h, ("time", "y", "x")),
        "r": (rng.standard_normal((T, Y, X)), ("time", "y", "x")),
        "far": (far, ("time", "y", "x")),
    }
    for name, (data, dims) in arrays.items():
        chunks = (2, *data.shape[1:])[-data.ndim :]
        arr = group.create_array(name, shape=data.shape, chunks=chunks, dtype=data.dtype,
                                 dimension_names=dims, fill_value=np.nan)  # fmt: skip
        arr[...] = data
    return root


def _batches(store: Path, views: dict, split: str, **options: object) -> list:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["f"], (TRAIN / T, 1 - TRAIN / T, 0.0))
    with insitu_pipeline(store, manifest, views, split=split, batch_size=4, coords=(),
                         shuffle=False, **options) as pipe:  # fmt: skip
        return list(pipe)


def test_a_constant_channel_with_missing_points_has_a_std_of_exactly_zero(store: Path) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["f"], (TRAIN / T, 1 - TRAIN / T, 0.0))
    members = {"f": geoms["f"], "mask": geoms["mask"]}
    stats = fit_statistics(store, manifest, members, batch_size=3)
    assert stats.mean["f"][1] == 0.1 and stats.std["f"][1] == 0.0, stats.std["f"]
    assert stats.mean["mask"] == 0.1 and stats.std["mask"] == 0.0, stats.std["mask"]
    # so a stack standardises the constant to 0 and a value off it to its difference, finite
    x = stack(members, normalize=stats)
    for split, value in (("train", 0.0), ("val", 0.1)):
        for batch in _batches(store, {"x": x}, split):
            level1, mask = batch["x"][:, 1], batch["x"][:, 2]
            np.testing.assert_allclose(level1[~np.isnan(level1)], value, atol=1e-12)
            np.testing.assert_array_equal(mask[~np.isnan(mask)], 0.0)


def test_a_field_far_from_zero_after_samples_all_nan_has_numpys_std(store: Path) -> None:
    """The first batches held no value (their running mean was 0): the later batches' deviations
    were taken from 0, and their squares of 9e12 cancelled to a std 1e-4 off."""
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["far"], (1.0, 0.0, 0.0))
    stats = fit_statistics(store, manifest, {"far": geoms["far"]}, batch_size=2)
    far = zarr.open_array(store / "far")[...]
    np.testing.assert_allclose(stats.mean["far"], np.nanmean(far), rtol=1e-12)
    np.testing.assert_allclose(stats.std["far"], np.nanstd(far), rtol=1e-6)
    np.testing.assert_allclose(stats.diff_std["far"], np.nanstd(np.diff(far, axis=0)), rtol=1e-6)


def test_a_constant_channel_is_standardised_to_its_difference_by_normalizer_and_scaler(
    store: Path,
) -> None:
    """A value off a constant channel (``std`` 0) is ``x - mean`` through ``normalizer``,
    ``scaler()`` and a stack alike: dividing by ``0 + eps`` gave 1e8 times it, inf in
    float16."""
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["f"], (TRAIN / T, 1 - TRAIN / T, 0.0))
    views = {"h": geoms["h"]}
    stats = fit_statistics(store, manifest, views)
    assert stats.std["h"] == 0.0
    routes = {
        "normalizer": {"batch_transforms": [stats.normalizer(views)]},
        "scaler": {"chunk_transforms": [stats.scaler()]},
    }
    for name, options in routes.items():
        for batch in _batches(store, views, "val", **options):
            assert batch["h"].dtype == np.float16, name
            np.testing.assert_array_equal(batch["h"], 1.0, err_msg=name)
    for batch in _batches(store, {"x": stack(views, normalize=stats)}, "val"):
        np.testing.assert_array_equal(batch["x"], 1.0)


def test_statistics_of_one_array_are_refused_for_a_view_of_another_under_their_label(
    store: Path,
) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["f"], (TRAIN / T, 1 - TRAIN / T, 0.0))
    stats = fit_statistics(store, manifest, {"r": geoms["r"], "f": geoms["f"]})
    for use in (
        lambda: stack({"r": geoms["h"]}, normalize=stats),
        lambda: stats.normalizer({"r": geoms["h"]}),
        lambda: stats.normalizer({"h": geoms["h"]}, same_as={"h": "r"}),
    ):
        with pytest.raises(ValueError, match=r"fitted on array 'r'.*'h'.*stats\.paths"):
            use()
    # the same quantity under another name (another store's) is taken over by saying so
    stats.paths["r"] = "h"
    stats.normalizer({"r": geoms["h"]})
    # a shifted or windowed view of the fitted array is its array
    stack({"f": geoms["f"].window([-1, 0])}, normalize=stats)


def test_fit_statistics_given_options_it_sets_itself_names_them(store: Path) -> None:
    geoms = open_geometries(store)
    manifest = split_by_chunk(geoms["f"], (TRAIN / T, 1 - TRAIN / T, 0.0))
    for options in ({"rank": 1, "world_size": 2}, {"shuffle": True}, {"coords": None}):
        with pytest.raises(TypeError, match=rf"{next(iter(options))}.*whole split.*rank"):
            fit_statistics(store, manifest, {"r": geoms["r"]}, **options)
    assert isinstance(fit_statistics(store, manifest, ["r"], seed=3), Statistics)
