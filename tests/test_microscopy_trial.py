"""Wrong answers a black-box trial as a microscopist found (2026-12-06), each a claim checked
against zarr's own read of the field a batch names, cut with numpy at the row's patch origin
(the oracle).

The trial wrote OME-NGFF with ome-zarr-py (0.4 on zarr v2, 0.5 on zarr v3): plates of
``(t, c, z, y, x)`` fields with t > 1 and z > 1, anisotropic z, levels chunked differently,
``omero`` channel metadata, labels at the same and at a coarser level, ``(y, x)`` and
``(c, y, x)`` fields in uint8 / uint16 / float32, a 5-level whole-slide pyramid and
bioformats2raw output; it opened them by level index and pixel size, selected z and c, drew
random (y, x) patches with their label patches, time-lapse windows along t, splits by well
and field, ranks, a mid-epoch resume and a persistent cache, and compared every delivered row
with zarr. The cases kept here are the ones that gave a wrong answer or a misleading error.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_images, open_plate, split_by_member
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.ngff import read_plate
from insitubatch_nodes.synthetic import write_omero

pytest.importorskip("ome_zarr")

# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("microscopy_trial")

CHANNELS = ("DAPI", "GFP", "RFP")
YX = 32
TILE = 16


def _format(version: str) -> Any:
    from ome_zarr.format import FormatV04, FormatV05

    return {"0.4": FormatV04, "0.5": FormatV05}[version]()


def _write_plate(path: Path, version: str) -> None:
    """A 1 x 2 plate of one field per well: a ``cyx`` uint16 image of three named channels
    (``omero``), two levels, in 16 x 16 tiles, and a ``cyx`` label image ``cells`` of one
    channel, as ome-zarr-py writes labels beside a ``cyx`` image."""
    from ome_zarr.writer import write_image, write_labels, write_plate_metadata, write_well_metadata

    fmt = _format(version)
    root = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    write_plate_metadata(root, ["A"], ["1", "2"], ["A/1", "A/2"], fmt=fmt, field_count=1)
    rng = np.random.default_rng(11)
    scale = {"c": 1.0, "y": 0.5, "x": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ome-zarr-py's notes on its defaults
        for column in ("1", "2"):
            well = root.require_group("A").require_group(column)
            write_well_metadata(well, ["0"], fmt=fmt)
            field = well.require_group("0")
            image = rng.integers(0, 60_000, (len(CHANNELS), YX, YX), dtype=np.uint16)
            write_image(
                image, field, scale_factors=[{"y": 2, "x": 2}], fmt=fmt, axes="cyx",
                scale=scale, storage_options={"chunks": (1, TILE, TILE)},
            )  # fmt: skip
            write_omero(field, CHANNELS, window=(100, 4000))
            write_labels(
                rng.integers(0, 5, (1, YX, YX), dtype=np.uint8), field, name="cells",
                scaler=None, scale_factors=[{"y": 2, "x": 2}], fmt=fmt, axes="cyx",
                scale=scale, storage_options={"chunks": (1, TILE, TILE)},
            )  # fmt: skip


@pytest.fixture(scope="module", params=["0.4", "0.5"])
def plate(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plate") / f"plate{request.param}.zarr"
    _write_plate(path, request.param)
    return path


def _read(path: Path, array: str) -> np.ndarray:
    return np.asarray(zarr.open_array(path, path=array, mode="r")[...])


def test_whole_images_beside_labels_of_one_channel_are_one_sample_each_patched_alike(
    plate: Path,
) -> None:
    # before: "member 'A/1/0' has 3 samples in variable 'image' but 1 in 'labels/cells'" -
    # with sample_axis=() the length along axis 0 (here c) was compared between variables,
    # though each member's whole array is its one sample
    coll = open_plate(plate, labels=["cells"], sample_axis=())
    images = [_read(plate, p) for p in coll.paths("image")]
    labels = [_read(plate, p) for p in coll.paths("labels/cells")]
    window = {"y": 8, "x": 8}
    views = {
        "x": coll["image"].patches(window),
        "y": coll["labels/cells"].patches(window),
    }
    seen = []
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), views, batch_size=8) as p:
        for batch in Loader(p):
            for r in range(len(batch)):
                m = int(batch.members["x"][r])
                y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                cut = (slice(None), slice(y0, y0 + 8), slice(x0, x0 + 8))
                np.testing.assert_array_equal(batch["x"][r], images[m][cut])
                np.testing.assert_array_equal(batch["y"][r], labels[m][cut])
                seen.append(m)
    assert sorted(seen) == [0] * 16 + [1] * 16  # each field's 4 x 4 windows, once

    # the same holds for any collection of whole arrays (a slide and its tissue mask)
    level1 = open_plate(plate, level=1, labels=["cells"], sample_axis=())
    image, mask = (level1.paths(v)[0].removeprefix("A/1/0/") for v in ("image", "labels/cells"))
    slide = Collection.from_groups(
        str(plate), ["A/1/0"], {"image": image, "mask": mask}, sample_axis=(),
        dims={"image": ["c", "y", "x"], "mask": ["c", "y", "x"]},
    )  # fmt: skip
    assert slide["image"].inner_shape == (3, YX // 2, YX // 2)
    assert slide["mask"].inner_shape == (1, YX // 2, YX // 2)


def test_a_channel_is_selected_by_its_omero_name_on_every_field(plate: Path) -> None:
    # before: no way to name a channel: sel(c="GFP") raised "no coordinate array 'c' ...
    # select by index with isel()", and read_plate did not say which index GFP is
    assert read_plate(plate).channels == CHANNELS
    assert "channels (c): DAPI, GFP, RFP" in read_plate(plate).describe()
    coll = open_plate(plate, labels=["cells"], sample_axis=())
    images = [_read(plate, p) for p in coll.paths("image")]
    views = {
        "gfp": coll["image"].sel(c="GFP"),  # the axis dropped, as xarray's sel of one value
        "pair": coll["image"].sel(c=["RFP", "DAPI"]),  # in that order
    }
    assert views["gfp"].inner_shape == (YX, YX) and views["pair"].inner_shape == (2, YX, YX)
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), views, batch_size=2) as p:
        batch = next(iter(Loader(p)))
    for r, m in enumerate(batch.members["gfp"]):
        np.testing.assert_array_equal(batch["gfp"][r], images[m][1])
        np.testing.assert_array_equal(batch["pair"][r], images[m][[2, 0]])
    with pytest.raises(KeyError, match="YFP"):
        coll["image"].sel(c="YFP")
    assert coll.subset(["A/2/0"])["image"].sel(c="RFP").inner_shape == (YX, YX)  # kept
    # any collection takes coordinates given: one value per index, none twice
    given = Collection.from_groups(
        str(plate), ["A/1/0", "A/2/0"], {"image": coll.paths("image")[0].removeprefix("A/1/0/")},
        sample_axis=(), dims={"image": ["c", "y", "x"]}, coords={"image": {"c": ["a", "b", "c"]}},
    )  # fmt: skip
    assert given["image"].sel(c=["c", "a"]).inner_shape == (2, YX, YX)
    with pytest.raises(ValueError, match="none twice"):
        Collection.from_groups(
            str(plate), ["A/1/0"], {"image": "0"}, coords={"image": {"c": ["a", "a", "b"]}}
        )


def _write_bioformats2raw(path: Path, version: str, *, list_series: bool) -> list[np.ndarray]:
    """bioformats2raw's layout: a root group marked ``bioformats2raw.layout: 3``, ``OME/``
    with ``METADATA.ome.xml`` (and the ``series`` list, if ``list_series``), and series
    ``0/``, ``1/``, each a ``czyx`` multiscale image of two levels."""
    from ome_zarr.writer import write_image

    fmt = _format(version)
    root = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    layout = {"bioformats2raw.layout": 3}
    root.attrs.update(layout if version == "0.4" else {"ome": {"version": "0.5", **layout}})
    ome = root.require_group("OME")
    if list_series:
        series = {"series": ["0", "1"]}
        ome.attrs.update(series if version == "0.4" else {"ome": {"version": "0.5", **series}})
    (path / "OME" / "METADATA.ome.xml").write_text("<OME/>")
    rng = np.random.default_rng(5)
    images = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for s in ("0", "1"):
            image = rng.integers(0, 4000, (2, 3, YX, YX), dtype=np.uint16)
            write_image(
                image, root.require_group(s), scale_factors=[{"y": 2, "x": 2}], fmt=fmt,
                axes="czyx", scale={"c": 1.0, "z": 2.0, "y": 0.3, "x": 0.3},
                storage_options={"chunks": (1, 1, TILE, TILE)},
            )  # fmt: skip
            images.append(image)
    return images


def test_a_bioformats2raw_conversions_series_are_one_collection(
    tmp_path: Path, plate: Path
) -> None:
    # before: open_plate said "not an OME-NGFF HCS plate (open a single image's arrays with
    # open_geometries)", and nothing read the series (nor an image at a store's root) as NGFF
    version = plate.name.removeprefix("plate").removesuffix(".zarr")  # as the plate's
    listed = _write_bioformats2raw(tmp_path / "listed.zarr", version, list_series=True)
    _write_bioformats2raw(tmp_path / "probed.zarr", version, list_series=False)
    with pytest.raises(ValueError, match=r"not an OME-NGFF HCS plate.*open_images"):
        open_plate(tmp_path / "listed.zarr")
    for name in ("listed.zarr", "probed.zarr"):
        coll = open_images(tmp_path / name, level=0.6, sample_axis="z")  # level 1, by size
        assert coll.members == ("0", "1") and coll["image"].dims == ("c", "z", "y", "x")
    by_series = split_by_member(coll, {"train": ["1"], "val": ["0"]})
    views = {"x": coll["image"].isel(c=1).patches({"y": 8, "x": 8})}
    level1 = [_read(tmp_path / "probed.zarr", p) for p in coll.paths("image")]
    with insitu_pipeline(coll, by_series, views, split="train", batch_size=4) as p:
        rows = 0
        for batch in Loader(p):
            for r in range(len(batch)):
                m, z = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                y0, x0 = (int(v) for v in batch.patch_origins["x"][r])
                assert m == 1
                np.testing.assert_array_equal(
                    batch["x"][r], level1[m][1, z, y0 : y0 + 8, x0 : x0 + 8]
                )
                rows += 1
    assert rows == 3 * 4  # series 1's three planes, 2 x 2 windows of 8 in its 16 x 16 level 1
    assert level1[1].shape == (2, 3, YX // 2, YX // 2) and listed[1].shape == (2, 3, YX, YX)

    # one image at a store's root (a whole slide), with its labels, its channels by name
    slide = open_images(plate / "A/2/0", level=1, labels=["cells"], sample_axis=())
    assert slide.members == ("",) and slide.paths("image") == (
        open_plate(plate, level=1, sample_axis=()).paths("image")[1].removeprefix("A/2/0/"),
    )
    assert slide["image"].sel(c="GFP").inner_shape == (YX // 2, YX // 2)


def test_fields_without_z_are_refused_at_the_default_sample_axis_saying_what_to_pass(
    plate: Path,
) -> None:
    # before: "sample_axis='z' is not an axis of the plate's images ['c', 'y', 'x']", and no
    # word of sample_axis=(), the way to open 2-D fields
    with pytest.raises(ValueError, match=r"\['c', 'y', 'x'\]: .*sample_axis=\(\) for each whole"):
        open_plate(plate)


def test_fields_naming_their_channels_otherwise_are_warned_of_and_offer_no_sel(
    plate: Path, tmp_path: Path
) -> None:
    # the same index is another channel in such fields: isel(c=1) reads GFP in one and RFP in
    # the other, without a word; before, nothing read the names, so nothing could say so
    other = tmp_path / plate.name
    shutil.copytree(plate, other)
    field = zarr.open_group(other / "A/2/0", mode="r+")
    attrs = field.attrs.asdict()
    ome = attrs.get("ome", attrs)
    ome["omero"]["channels"] = ome["omero"]["channels"][::-1]  # RFP, GFP, DAPI
    field.attrs.put(attrs)
    with pytest.warns(UserWarning, match=r"field 'A/2/0': \['RFP', 'GFP', 'DAPI'\].*isel"):
        coll = open_plate(other, sample_axis=())
    with pytest.warns(UserWarning, match="name their channels differently"):
        found = read_plate(other)
    assert found.channels is None and found.fields[1].channels == CHANNELS[::-1]
    with pytest.raises(KeyError, match="select by index with isel"):
        coll["image"].sel(c="GFP")


def test_a_level_given_as_a_numpy_number_is_that_index_or_pixel_size(plate: Path) -> None:
    # before: level=np.int64(1) (an index computed with numpy) was refused with "level must be
    # an index (0: full resolution), a pixel size (0.65) or {axis: size} ..., got np.int64(1)"
    want = open_plate(plate, level=1, sample_axis=()).paths("image")
    for level in (np.int64(1), np.float32(1.0), {"x": np.float64(1.0)}):
        assert open_plate(plate, level=level, sample_axis=()).paths("image") == want
    with pytest.raises(TypeError, match="level must be"):
        open_plate(plate, level=np.bool_(True), sample_axis=())
