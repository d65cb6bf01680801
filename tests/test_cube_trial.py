"""Radio-astronomy spectral cubes as an astronomer reads them, found wrong by a black-box trial
(2026-12-06).

The cubes are written with zarr as FITS-converted cubes are: ``(stokes, freq, dec, ra)``
float32, blosc, NaN-blanked outside a circular primary beam and in one flagged channel, the
frequency in Hz *descending*, ``dec`` / ``ra`` in degrees as 1-d coordinates, ``BUNIT`` in the
attributes; a second cube holds the same sky in another band. zarr's own read (and xarray's,
where coordinates matter) is the oracle. The trial's passing workloads (every channel's
128x128 sky patches, whole-spectrum sky patches, a band by value, resume, both cubes as one
collection) are what ``recipes/spectral_cube.py`` runs (tests/test_recipes.py runs it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec

from insitubatch_nodes import (
    Collection,
    Loader,
    concat,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.io import open_coordinates
from insitubatch_nodes.plan.config import PlanConfig

S, F, D, R = 1, 16, 32, 32
DIMS = ("stokes", "freq", "dec", "ra")
FLAGGED = 5  # a channel flagged whole (RFI): every value NaN


def write_cube(path: Path, zarr_format: int, f0: float, seed: int) -> np.ndarray:
    """A cube at ``path`` (a group: ``cube`` and its four coordinates); returns its values."""
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((S, F, D, R)) * 1e-3 + 2e-3).astype("f4")
    yy, xx = np.mgrid[0:D, 0:R]
    data[:, :, (yy - D / 2 + 0.5) ** 2 + (xx - R / 2 + 0.5) ** 2 > (0.45 * D) ** 2] = np.nan
    data[:, FLAGGED] = np.nan
    group = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    if zarr_format == 3:
        kw: dict = {"compressors": BloscCodec(cname="zstd"), "dimension_names": DIMS}
    else:
        kw = {"compressors": Blosc(cname="zstd")}
    cube = group.create_array("cube", shape=data.shape, chunks=(1, 4, 16, 16), dtype="f4",
                              fill_value=np.nan, **kw)  # fmt: skip
    cube[...] = data
    cube.attrs.update({"BUNIT": "Jy/beam"} | ({"_ARRAY_DIMENSIONS": DIMS} if zarr_format == 2
                                                else {}))  # fmt: skip
    axes = {
        "stokes": np.array([1.0]),
        "freq": f0 - np.arange(F) * 1e6,  # Hz, descending
        "dec": -30.0 + (np.arange(D) - D / 2) / 3600,
        "ra": 150.0 - (np.arange(R) - R / 2) / 3600,
    }
    for name, values in axes.items():
        extra = {"dimension_names": (name,)} if zarr_format == 3 else {}
        coord = group.create_array(name, shape=values.shape, dtype="f8", **extra)
        coord[...] = values
        coord.attrs["units"] = {"freq": "Hz", "stokes": ""}.get(name, "deg")
        if zarr_format == 2:
            coord.attrs["_ARRAY_DIMENSIONS"] = [name]
    return data


# one worker runs the module: its module fixtures are built once, not once per worker; the
# worker of the tests that import Lightning, which one of its tests does
pytestmark = pytest.mark.xdist_group("lightning")


@pytest.fixture(scope="module")
def cubes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    root = tmp_path_factory.mktemp("cubes")
    return {
        name: (root / f"{name}.zarr", write_cube(root / f"{name}.zarr", fmt, f0, seed))
        for name, fmt, f0, seed in (("lo", 3, 1.42e9, 0), ("lo_v2", 2, 1.42e9, 0),
                                    ("hi", 3, 1.70e9, 1))
    }  # fmt: skip


@pytest.mark.parametrize("name", ["lo", "lo_v2"])
def test_min_and_max_of_nan_blanked_channels_are_the_cubes_stored_extremes_exactly(
    cubes: dict[str, tuple[Path, np.ndarray]], name: str
) -> None:
    # with a NaN in a batch the moments were taken of x - mean + mean: min and max came back
    # a float64 rounding away from every stored value (-0.003770632436499 for the float32
    # -0.0037706324364989996), so none of them equalled a value of the cube
    path, data = cubes[name]
    per_channel = open_geometries(path, ["cube"], sample_axis="stokes")["cube"]
    per_cube = open_geometries(path, ["cube"], sample_axis="freq")["cube"]
    for view, axes in ((per_channel, (0, 2, 3)), (per_cube, None)):
        stats = fit_statistics(path, split_by_chunk(view, (1.0, 0.0, 0.0)), {"x": view})
        finite = np.where(np.isnan(data), np.inf, data).astype(np.float64)
        lo = finite.min(axis=axes)
        hi = np.where(np.isnan(data), -np.inf, data).astype(np.float64).max(axis=axes)
        empty = np.isinf(lo)  # the flagged channel: no value, NaN statistics
        np.testing.assert_array_equal(stats.min["x"], np.where(empty, np.nan, lo))
        np.testing.assert_array_equal(stats.max["x"], np.where(empty, np.nan, hi))
        assert np.isin(stats.min["x"][~empty], data).all()


def test_concatenating_cubes_along_frequency_says_concat_is_by_time_and_what_reads_them(
    cubes: dict[str, tuple[Path, np.ndarray]],
) -> None:
    # the cubes have a 'freq' coordinate beside 'cube', and were told they had none ("has no
    # time coordinate 'freq'"), with no word of what reads two bands as one stream
    paths = [cubes["hi"][0], cubes["lo"][0]]
    with pytest.raises(ValueError, match=r"'freq' .*units 'Hz'.* no CF time") as err:
        concat(paths, ["cube"], dim="freq")
    assert "Collection.from_arrays" in str(err.value)
    coll = Collection.from_arrays([(p, "cube") for p in paths], sample_axis="freq")
    assert coll["data"].n_samples == 2 * F  # what the message points to reads both


def test_a_flagged_channel_of_one_cube_of_a_frequency_collection_is_dropped_by_member_index(
    cubes: dict[str, tuple[Path, np.ndarray]],
) -> None:
    # before: missing= on a collection took dates only, and a frequency axis has none, so a
    # channel flagged in one cube could not be left out (an index was refused)
    coll = Collection.from_arrays([(cubes[b][0], "cube") for b in ("hi", "lo")], sample_axis="freq")
    view = coll["data"]
    manifest = split_by_chunk(view, (1.0, 0.0, 0.0))
    lo = view.members.names[1]  # type: ignore[union-attr]
    for missing in ({lo: [FLAGGED]}, {1: [FLAGGED - F]}):  # by name; by position, from the end
        with insitu_pipeline(coll, manifest, {"x": view}, batch_size=5, missing=missing) as pipe:
            got = {
                (int(m), int(i)): row
                for b in Loader(pipe)
                for m, i, row in zip(b.members["x"], b.sample_indices["x"], b["x"], strict=True)
            }
            assert pipe.stages.plan.dropped == {"missing": 1}
        assert set(got) == {(m, i) for m in (0, 1) for i in range(F)} - {(1, FLAGGED)}
        for (m, i), row in got.items():
            data = cubes[("hi", "lo")[m]][1]
            np.testing.assert_array_equal(row, data[:, i], strict=True)
    for bad, says in (({"nope": [1]}, KeyError), ({lo: [F]}, ValueError), ({lo: ["x"]}, TypeError)):
        with pytest.raises(says):
            insitu_pipeline(coll, manifest, {"x": view}, batch_size=5, missing=bad)
    with pytest.raises(ValueError, match=r"missing=\{'cube_lo': \[17\]\}"):
        insitu_pipeline(coll, manifest, {"x": view}, batch_size=5, missing=[FLAGGED])
    # the data module takes the mapping too (it made a tuple of its keys before)
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    dm = InSituDataModule(coll, {"x": view}, (1.0, 0.0, 0.0), config=PlanConfig(batch_size=5),
                          missing={lo: [FLAGGED]}, log_report=False)  # fmt: skip
    dm.setup("fit")
    try:
        assert sum(len(item["x"]) for item in dm.train_dataloader()) == 2 * F - 1
    finally:
        dm.teardown("fit")


def test_stores_whose_time_is_not_their_first_axis_concatenate_along_it(tmp_path: Path) -> None:
    # found beside the cubes: concat and join looked for the time coordinate of axis 0, so an
    # ensemble (member, time, lat, lon) was refused, "has no time coordinate 'time'", and its
    # chunk alignment was taken from the member axis
    data, paths = [], []
    for k, start in enumerate((0, 48)):
        group = zarr.open_group(tmp_path / f"ens{k}.zarr", mode="w")
        arr = group.create_array("t2m", shape=(2, 8, 2, 3), chunks=(1, 4, 2, 3), dtype="f4",
                                 dimension_names=("member", "time", "lat", "lon"))  # fmt: skip
        data.append(np.random.default_rng(k).standard_normal((2, 8, 2, 3)).astype("f4"))
        arr[...] = data[-1]
        time = group.create_array("time", shape=(8,), dtype="i8", dimension_names=("time",))
        time[...] = start + 6 * np.arange(8)
        time.attrs["units"] = "hours since 2000-01-01"
        paths.append(tmp_path / f"ens{k}.zarr")
    coll = concat(paths, ["t2m"], dim="time")
    assert coll["t2m"].shape == (2, 16, 2, 3) and coll["t2m"].sample_axis == 1
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    rows = 0
    with insitu_pipeline(coll, manifest, {"x": coll["t2m"]}, batch_size=4) as pipe:
        for batch in Loader(pipe):
            where = zip(batch.members["x"], batch.sample_indices["x"], strict=True)
            for (m, s), row in zip(where, batch["x"], strict=True):
                np.testing.assert_array_equal(row, data[m][:, s - 8 * m])
                rows += 1
    assert rows == 16


def test_a_band_given_high_to_low_on_a_descending_axis_says_to_give_the_low_end_first(
    cubes: dict[str, tuple[Path, np.ndarray]],
) -> None:
    # sel takes a descending axis's slice high to low (as xarray does), so the same band given
    # to split_by_chunk that way was refused with only "needs start < stop"
    path, _ = cubes["lo"]
    geom = open_geometries(path, ["cube"], sample_axis="freq")["cube"]
    freq = open_coordinates(path, geom)["freq"]
    with pytest.raises(ValueError, match=r"sample_range=\(1410000000\.0, 1415000000\.0\)"):
        split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=(1.415e9, 1.41e9), coord=freq)
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0), sample_range=(1.41e9, 1.415e9), coord=freq)
    assert manifest.sample_range == (6, 11)  # 1.414e9 .. 1.410e9, half-open at 1.415e9


def test_a_chunk_scaler_of_a_cube_with_a_flagged_channel_names_the_channel_and_the_way_out(
    cubes: dict[str, tuple[Path, np.ndarray]],
) -> None:
    # a channel flagged whole has NaN statistics; the scaler said only "std of 'cube' must be
    # finite and >= 0", naming neither the channel nor what to do
    path, _ = cubes["lo"]
    geom = open_geometries(path, ["cube"], sample_axis="stokes")["cube"]
    stats = fit_statistics(path, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"x": geom})
    with pytest.raises(ValueError, match=rf"channels \[{FLAGGED}\].*normalizer") as err:
        stats.scaler()
    assert "'x'" in str(err.value)
