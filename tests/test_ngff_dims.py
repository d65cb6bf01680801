"""Dimension names of a collection's views: an OME-NGFF plate's views are named by its NGFF
axes (``plate.axes``, ``plate.label_axes``) on NGFF 0.4, whose zarr v2 arrays name none, as on
0.5; ``Collection.from_groups(..., dims=)`` names the axes of any arrays that name none.

The plates are written by ome-zarr-py's own writer (``fmt=FormatV04()`` / ``FormatV05()``): a
``czyx`` image and a ``zyx`` label image per field. Every row a pipeline delivers is checked
against zarr's read of its field, sliced with numpy (the oracle).
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store
from resume_helpers import assert_resumes_exactly
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, split_by_member, stack
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.ngff import open_plate

pytest.importorskip("ome_zarr")

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("ngff_dims")

IMAGE = (2, 3, 32, 32)  # (c, z, y, x): 2 channels, 3 Z planes
TILE = 16  # the stored tile along y and x


def _write_plate(path: Path, version: str) -> None:
    """A 1 x 2 plate of 2 fields per well: a ``czyx`` uint16 image (one plane of one channel
    per chunk, 16 x 16 tiles) and a ``zyx`` uint16 label image ``nuclei`` per field, one level."""
    from ome_zarr.format import FormatV04, FormatV05
    from ome_zarr.writer import write_image, write_labels, write_plate_metadata, write_well_metadata

    fmt = {"0.4": FormatV04, "0.5": FormatV05}[version]()
    root = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    write_plate_metadata(root, ["A"], ["1", "2"], ["A/1", "A/2"], fmt=fmt, field_count=2)
    rng = np.random.default_rng(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ome-zarr: scales of 1.0 assumed
        for column in ("1", "2"):
            well = root.require_group("A").require_group(column)
            write_well_metadata(well, ["0", "1"], fmt=fmt)
            for name in ("0", "1"):
                field = well.require_group(name)
                image = rng.integers(0, 60_000, IMAGE, dtype=np.uint16)
                labels = rng.integers(0, 9, IMAGE[1:], dtype=np.uint16)  # stacks with the image
                write_image(
                    image, field, scale_factors=[], fmt=fmt, axes="czyx",
                    storage_options={"chunks": (1, 1, TILE, TILE)},
                )  # fmt: skip
                write_labels(
                    labels, field, name="nuclei", scaler=None, scale_factors=[], fmt=fmt,
                    axes="zyx", storage_options={"chunks": (1, TILE, TILE)},
                )  # fmt: skip


@pytest.fixture(scope="module", params=["0.4", "0.5"])
def plate(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plate") / f"plate{request.param}.zarr"
    _write_plate(path, request.param)
    return path


def _oracle(path: Path, coll: Collection, variable: str) -> list[np.ndarray]:
    """Each member's array of ``variable``, as zarr reads it."""
    return [np.asarray(zarr.open_array(path, path=p, mode="r")[...]) for p in coll.paths(variable)]


def _rows(pipe: Any, epochs: int = 1) -> list[Any]:
    loader, out = Loader(pipe), []
    for _ in range(epochs):
        out.extend(loader)
    return out


# -- what the views are named ---


def test_a_plates_views_are_named_by_its_ngff_axes_whatever_the_arrays_carry(plate: Path) -> None:
    coll = open_plate(plate, labels="all", sample_axis="z")
    assert coll["image"].dims == ("c", "z", "y", "x")
    assert coll["labels/nuclei"].dims == ("z", "y", "x")  # a label image of its own axes
    assert coll.dims == {"image": ("c", "z", "y", "x"), "labels/nuclei": ("z", "y", "x")}
    assert coll["image"].sample_axis == 1 and coll["labels/nuclei"].sample_axis == 0
    stored = zarr.open_array(plate, path=coll.paths("image")[0], mode="r")
    own = getattr(stored.metadata, "dimension_names", None) or stored.attrs.get("_ARRAY_DIMENSIONS")
    if stored.metadata.zarr_format == 2:  # NGFF 0.4: the array itself names no axis
        assert own is None
    else:  # NGFF 0.5: ome-zarr writes dimension_names, the same names as before
        assert tuple(own) == coll["image"].dims


def test_pickled_views_and_a_subset_keep_their_dimension_names(plate: Path) -> None:
    coll = open_plate(plate, labels="all")
    view = coll["image"].isel(c=1)
    again = pickle.loads(pickle.dumps(view))
    assert again == view and again.dims == ("c", "z", "y", "x") and again.inner_shape == (32, 32)
    sub = coll.subset(list(coll.members[1:3]))
    assert sub["image"].dims == coll["image"].dims
    assert sub["labels/nuclei"].dims == ("z", "y", "x")
    assert pickle.loads(pickle.dumps(coll))["labels/nuclei"].dims == ("z", "y", "x")


# -- isel, sel and patches by name, through the pipeline ---


def test_isel_of_a_channel_by_name_reads_that_channel_of_every_fields_planes(plate: Path) -> None:
    coll = open_plate(plate, sample_axis="z")
    images = _oracle(plate, coll, "image")
    views = {"c1": coll["image"].isel(c=1), "c0": coll["image"].isel(c=[0])}
    manifest = split_by_member(coll, {"train": 1.0})
    seen = []
    with insitu_pipeline(coll, manifest, views, batch_size=5, seed=1) as pipe:
        for batch in _rows(pipe):
            for r in range(len(batch)):
                m, z = int(batch.members["c1"][r]), int(batch.sample_indices["c1"][r])
                np.testing.assert_array_equal(batch["c1"][r], images[m][1, z])
                np.testing.assert_array_equal(batch["c0"][r], images[m][[0], z])
                seen.append((m, z))
    assert sorted(seen) == [(m, z) for m in range(len(coll)) for z in range(IMAGE[1])]


def test_a_label_image_of_fewer_axes_is_sampled_along_its_own_z(plate: Path) -> None:
    coll = open_plate(plate, labels=["nuclei"], sample_axis="z")
    images, labels = _oracle(plate, coll, "image"), _oracle(plate, coll, "labels/nuclei")
    views = {"image": coll["image"], "nuclei": coll["labels/nuclei"]}
    manifest = split_by_member(coll, {"train": 1.0})
    rows = 0
    with insitu_pipeline(coll, manifest, views, batch_size=5, seed=3) as pipe:
        for batch in _rows(pipe):
            np.testing.assert_array_equal(batch.members["image"], batch.members["nuclei"])
            for r in range(len(batch)):
                m, z = int(batch.members["image"][r]), int(batch.sample_indices["image"][r])
                assert int(batch.sample_indices["nuclei"][r]) == z
                np.testing.assert_array_equal(batch["image"][r], images[m][:, z])
                np.testing.assert_array_equal(batch["nuclei"][r], labels[m][z])
                rows += 1
    assert rows == len(coll) * IMAGE[1]


def test_sel_by_axis_name_looks_for_the_axis_coordinate_which_a_plate_has_not(
    plate: Path,
) -> None:
    coll = open_plate(plate)
    # NGFF stores no coordinate arrays: the name is known, the values are not
    with pytest.raises(KeyError, match=r"no coordinate array 'c' .*select by index with isel"):
        coll["image"].sel(c=0)


def test_patches_by_axis_name_cut_the_image_and_its_labels_alike(plate: Path) -> None:
    coll = open_plate(plate, labels="all")
    images, labels = _oracle(plate, coll, "image"), _oracle(plate, coll, "labels/nuclei")
    window = {"y": 8, "x": 8}
    views = {
        "image": coll["image"].isel(c=0).patches(window, origins="random"),
        "nuclei": coll["labels/nuclei"].patches(window, origins="random"),
    }
    assert views["image"].patch is not None and views["image"].patch.axes == (2, 3)
    assert views["nuclei"].patch is not None and views["nuclei"].patch.axes == (1, 2)
    manifest = split_by_member(coll, {"train": 1.0})
    rows = 0
    with insitu_pipeline(coll, manifest, views, batch_size=6, seed=4) as pipe:
        for batch in _rows(pipe):
            origins = batch.patch_origins["image"]
            np.testing.assert_array_equal(origins, batch.patch_origins["nuclei"])  # one window
            for r in range(len(batch)):
                m, z = int(batch.members["image"][r]), int(batch.sample_indices["image"][r])
                y0, x0 = (int(v) for v in origins[r])
                np.testing.assert_array_equal(
                    batch["image"][r], images[m][0, z, y0 : y0 + 8, x0 : x0 + 8]
                )
                np.testing.assert_array_equal(
                    batch["nuclei"][r], labels[m][z, y0 : y0 + 8, x0 : x0 + 8]
                )
                rows += 1
    assert rows >= len(coll) * IMAGE[1]


def test_a_stack_of_a_plates_patched_image_and_labels_is_its_fields_channels(plate: Path) -> None:
    coll = open_plate(plate, labels="all")
    images, labels = _oracle(plate, coll, "image"), _oracle(plate, coll, "labels/nuclei")
    window = {"y": TILE, "x": TILE}
    both = stack(
        {
            "img": coll["image"].patches(window),
            "nuclei": coll["labels/nuclei"].patches(window),
        }
    )
    manifest = split_by_member(coll, {"train": 1.0})
    with insitu_pipeline(coll, manifest, {"s": both}, batch_size=4, seed=2) as pipe:
        for batch in _rows(pipe):
            assert list(batch.channels["s"]) == ["img@0", "img@1", "nuclei"]
            for r in range(len(batch)):
                m, z = int(batch.members["s"][r]), int(batch.sample_indices["s"][r])
                y0, x0 = (int(v) for v in batch.patch_origins["s"][r])
                cut = (slice(y0, y0 + TILE), slice(x0, x0 + TILE))
                np.testing.assert_array_equal(
                    batch["s"][r][:2], images[m][:, z][(slice(None), *cut)]
                )
                np.testing.assert_array_equal(batch["s"][r][2], labels[m][z][cut])


# -- resume and the persistent cache over named views ---


def test_a_resumed_epoch_over_views_selected_and_patched_by_name_continues_exactly(
    plate: Path,
) -> None:
    coll = open_plate(plate, labels="all")
    manifest = split_by_member(coll, {"train": 1.0})
    views = {
        "x": coll["image"].isel(c=1).patches({"y": TILE, "x": TILE}),
        "y": coll["labels/nuclei"].patches({"y": TILE, "x": TILE}),
    }

    def build() -> Any:
        return insitu_pipeline(coll, manifest, views, batch_size=5, block_chunks=2, seed=9)

    def records(batches: list[Any]) -> list[tuple[Any, ...]]:
        return [
            (b.epoch, b.index, b.members["x"].tolist(), b.sample_indices["x"].tolist(),
             b.patch_origins["y"].tolist(), b["x"].sum().item(), b["y"].sum().item())
            for b in batches
        ]  # fmt: skip

    pipe = build()
    try:
        ref = records(_rows(pipe, epochs=2))
    finally:
        pipe.close()
    per_epoch = len(ref) // 2
    assert_resumes_exactly(build, records, ref, (1, per_epoch + 1))


def test_a_warm_persistent_cache_of_views_patched_by_name_reads_no_object(
    plate: Path, tmp_path: Path
) -> None:
    store = counting_store(plate)
    coll = open_plate(store, labels="all")
    images, labels = _oracle(plate, coll, "image"), _oracle(plate, coll, "labels/nuclei")
    manifest = split_by_member(coll, {"train": 1.0})
    window = {"y": TILE, "x": TILE}
    views = {"x": coll["image"].patches(window), "y": coll["labels/nuclei"].patches(window)}
    runs = []
    for _ in range(2):
        store.reset_counts()
        with insitu_pipeline(
            coll, manifest, views, batch_size=4, cache_dir=tmp_path / "cache", persist=True
        ) as pipe:
            rows = []
            for batch in _rows(pipe):
                for r in range(len(batch)):
                    m, z = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                    y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                    cut = (slice(y0, y0 + TILE), slice(x0, x0 + TILE))
                    np.testing.assert_array_equal(
                        batch["x"][r], images[m][:, z][(slice(None), *cut)]
                    )
                    np.testing.assert_array_equal(batch["y"][r], labels[m][z][cut])
                    rows.append((m, z, y0, x0))
        runs.append((sorted(rows), store.chunk_counts()))
    assert len(runs[0][0]) == len(coll) * IMAGE[1] * 4  # every plane's 2 x 2 windows, once
    assert runs[0][1] and runs[1] == (runs[0][0], {}), runs[1][1]


# -- open_plate's sample axis ---


def test_a_sample_axis_by_index_must_name_the_same_axis_in_the_labels(plate: Path) -> None:
    with pytest.raises(ValueError, match=r"label 'nuclei' has axes \['z', 'y', 'x'\].*name it"):
        open_plate(plate, labels="all", sample_axis=1)
    with pytest.raises(ValueError, match=r"label 'nuclei' .* without the sample axis 'c'"):
        open_plate(plate, labels="all", sample_axis="c")
    assert open_plate(plate, sample_axis=1)["image"].dims == ("c", "z", "y", "x")


# -- the generic hook: from_groups(..., dims=) ---


@pytest.fixture()
def unnamed(tmp_path: Path) -> tuple[Path, list[str], list[np.ndarray]]:
    """Two groups with a zarr v2 array ``a`` of ``(t, y, x)`` that names no dimension."""
    root = zarr.open_group(tmp_path / "v2.zarr", mode="w", zarr_format=2)
    rng = np.random.default_rng(3)
    data = []
    for g, n in (("g0", 4), ("g1", 6)):
        values = rng.standard_normal((n, 5, 6)).astype("f4")
        root.require_group(g).create_array("a", data=values, chunks=(2, 5, 6))
        data.append(values)
    return tmp_path / "v2.zarr", ["g0", "g1"], data


def test_from_groups_dims_name_the_axes_of_v2_arrays_without_dimension_names(
    unnamed: tuple[Path, list[str], list[np.ndarray]],
) -> None:
    path, groups, data = unnamed
    assert Collection.from_groups(path, groups, {"a": "a"})["a"].dims is None
    coll = Collection.from_groups(
        path, groups, {"a": "a"}, sample_axis="t", dims={"a": ["t", "y", "x"]}
    )
    view = coll["a"].isel(y=slice(1, 4), x=[0, 5])
    assert view.dims == ("t", "y", "x") and view.inner_shape == (3, 2)
    seen = []
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"v": view}) as pipe:
        for batch in _rows(pipe):
            for r in range(len(batch)):
                m, t = int(batch.members["v"][r]), int(batch.sample_indices["v"][r])
                np.testing.assert_array_equal(batch["v"][r], data[m][t, 1:4][:, [0, 5]])
                seen.append((m, t))
    assert sorted(seen) == [(m, t) for m, d in enumerate(data) for t in range(len(d))]


@pytest.mark.parametrize(
    ("dims", "match"),
    [
        ({"a": ["t", "y"]}, r"dims names 2 axes \['t', 'y'\], but the array has 3"),
        ({"a": ["t", "t", "x"]}, r"dims\['a'\] must be one unique name"),
        ({"a": "tyx"}, r"dims\['a'\] must be one unique name"),
        ({"a": ["t", 1, "x"]}, r"dims\['a'\] must be one unique name"),
        ({"b": ["t", "y", "x"]}, r"dims names 'b', which is not a variable"),
        (["t", "y", "x"], r"dims maps variables to dimension names"),
    ],
)
def test_dims_not_one_unique_name_per_axis_of_a_variable_are_refused_saying_what_to_pass(
    unnamed: tuple[Path, list[str], list[np.ndarray]], dims: Any, match: str
) -> None:
    path, groups, _ = unnamed
    with pytest.raises(ValueError, match=match):
        Collection.from_groups(path, groups, {"a": "a"}, dims=dims)


def test_dims_given_win_over_the_names_the_arrays_carry(tmp_path: Path) -> None:
    root = zarr.open_group(tmp_path / "v3.zarr", mode="w", zarr_format=3)
    values = np.arange(4 * 3 * 2, dtype="i4").reshape(4, 3, 2)
    root.require_group("g").create_array(
        "a", data=values, chunks=(1, 3, 2), dimension_names=("time", "lat", "lon")
    )
    own = Collection.from_groups(tmp_path / "v3.zarr", ["g"], {"a": "a"})
    assert own["a"].dims == ("time", "lat", "lon")
    coll = Collection.from_groups(
        tmp_path / "v3.zarr", ["g"], {"a": "a"}, dims={"a": ["t", "y", "x"]}
    )
    assert coll["a"].dims == ("t", "y", "x")
    assert coll["a"].isel(y=2).inner_shape == (2,)
    with pytest.raises(KeyError, match=r"no dimension named 'lat'"):
        coll["a"].isel(lat=2)


def test_a_geometry_refuses_dim_names_that_are_not_one_per_axis() -> None:
    from insitubatch_nodes import ArrayGeometry

    geom = ArrayGeometry("a", (4, 5, 6), (2, 5, 6), np.dtype("f4"), None, dim_names=("t", "y", "x"))
    assert geom.dims == ("t", "y", "x") and geom.isel(y=1).inner_shape == (6,)
    with pytest.raises(ValueError, match=r"dim_names \('t', 'y'\) do not match \(4, 5, 6\)"):
        ArrayGeometry("a", (4, 5, 6), (2, 5, 6), np.dtype("f4"), None, dim_names=("t", "y"))
