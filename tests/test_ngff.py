"""OME-NGFF HCS plates: ``read_plate`` (metadata) and ``open_plate`` (a collection of fields).

The plates are written by ome-zarr-py's own writer (NGFF 0.4 on zarr v2, 0.5 on zarr v3);
what the metadata says is checked against ome-zarr-models' parse of the same documents and
against the arrays zarr opens at the paths read. The tests of ``open_plate`` that need the
real ``Collection`` (io/collection.py, built on another branch) are marked ``collection`` in
their name and skip, saying so, where it is absent.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage

from insitubatch_nodes.io.ngff import Plate, open_plate, read_plate
from insitubatch_nodes.synthetic import make_hcs_plate, make_plate_metadata_only

pytest.importorskip("ome_zarr")

# one worker runs the module: its plates (module fixtures, one per NGFF version) are written
# once, not once per worker and again at every switch between the versions
pytestmark = pytest.mark.xdist_group("ngff")

VERSIONS = ["0.4", "0.5"]
SHAPE = (1, 2, 4, 32, 32)  # (T, C, Z, Y, X): 4 Z planes, one per chunk
PIXEL = 0.65


@pytest.fixture(scope="module", params=VERSIONS)
def plate_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full 2 x 3 plate, 2 fields per well, 3 levels, one label image ``cells``."""
    path = tmp_path_factory.mktemp("plate") / "plate.zarr"
    make_hcs_plate(path, shape=SHAPE, levels=3, ngff_version=request.param, pixel_size=PIXEL)
    return path


@pytest.fixture(scope="module", params=VERSIONS)
def sparse_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sparse 2 x 3 plate: wells A/1, A/3, B/2 written, B/3 listed but never written."""
    path = tmp_path_factory.mktemp("sparse") / "plate.zarr"
    make_hcs_plate(
        path, shape=SHAPE, levels=1, labels=(), ngff_version=request.param,
        wells=["A/1", "A/3", "B/2"], absent_wells=["B/3"],
    )  # fmt: skip
    return path


def _ome(attrs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = attrs.get("ome", attrs)
    return out


def _models_view(path: Path) -> dict[str, list[tuple[str, list[float]]]]:
    """``{field path: [(dataset path, scale), ...]}`` of every field that exists, as
    ome-zarr-models parses the documents zarr reads (the oracle for the metadata)."""
    root = zarr.open_group(path, mode="r")
    attrs = _ome(root.attrs.asdict())
    v05 = "version" in attrs and attrs["version"] == "0.5"
    if v05:
        from ome_zarr_models.v05.hcs import HCSAttrs
        from ome_zarr_models.v05.image import ImageAttrs
        from ome_zarr_models.v05.well import WellAttrs
    else:
        from ome_zarr_models.v04.hcs import HCSAttrs
        from ome_zarr_models.v04.image import ImageAttrs
        from ome_zarr_models.v04.well import WellAttrs
    out: dict[str, list[tuple[str, list[float]]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plate = HCSAttrs.model_validate(attrs).plate
        for well in plate.wells:
            if well.path not in root:
                continue
            images = WellAttrs.model_validate(_ome(root[well.path].attrs.asdict())).well.images
            for image in images:
                group = f"{well.path}/{image.path}"
                ms = ImageAttrs.model_validate(_ome(root[group].attrs.asdict())).multiscales[0]
                out[group] = [
                    (d.path, list(d.coordinateTransformations[0].scale)) for d in ms.datasets
                ]
    return out


# -- what read_plate reads ---


def test_read_plate_finds_every_field_ome_zarr_models_finds_with_its_levels(
    plate_path: Path,
) -> None:
    plate = read_plate(plate_path)
    expected = _models_view(plate_path)
    assert [f.path for f in plate.fields] == list(expected)
    assert plate.rows == ("A", "B") and plate.columns == ("1", "2", "3")
    assert plate.wells == ("A/1", "A/2", "A/3", "B/1", "B/2", "B/3")
    assert plate.axes == ("t", "c", "z", "y", "x")
    assert plate.units["x"] == "micrometer" and plate.units["t"] is None
    root = zarr.open_group(plate_path, mode="r")
    for f in plate.fields:
        path0, scale0 = expected[f.path][0]
        assert f.image == f"{f.path}/{path0}" and f.level == 0
        assert list(f.pixel_size.values()) == pytest.approx(scale0)
        assert f.well == f"{f.row}/{f.column}" and f.path == f"{f.well}/{f.name}"
        assert root[f.image].shape == SHAPE  # an array zarr opens at the path read
        assert f.labels == {}  # labels=None reads none


def test_the_version_and_zarr_format_are_those_written(plate_path: Path) -> None:
    plate = read_plate(plate_path)
    written = zarr.open_group(plate_path, mode="r").metadata.zarr_format
    assert plate.zarr_format == written
    assert plate.version == {2: "0.4", 3: "0.5"}[written]


def test_a_level_by_index_is_that_dataset_and_minus_one_the_coarsest(plate_path: Path) -> None:
    expected = _models_view(plate_path)
    root = zarr.open_group(plate_path, mode="r")
    for level, index in ((1, 1), (-1, 2)):
        for f in read_plate(plate_path, level=level).fields:
            path, scale = expected[f.path][index]
            assert f.level == index and f.image == f"{f.path}/{path}"
            assert list(f.pixel_size.values()) == pytest.approx(scale)
            assert root[f.image].shape[-2:] == (SHAPE[3] >> index, SHAPE[4] >> index)


@pytest.mark.parametrize(
    ("level", "index"),
    [(PIXEL, 0), (PIXEL * 2, 1), ({"x": PIXEL * 4}, 2), ({"z": 2.0, "y": PIXEL * 2}, 1)],
)
def test_a_level_by_pixel_size_is_the_level_of_that_size(
    plate_path: Path, level: Any, index: int
) -> None:
    plate = read_plate(plate_path, level=level)
    assert {f.level for f in plate.fields} == {index}
    assert f"level {index} in {len(plate.fields)} field(s)" in plate.describe()


def test_a_pixel_size_no_level_has_is_refused_naming_the_levels_sizes(plate_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no level has pixel size y 0\.5, x 0\.5") as info:
        read_plate(plate_path, level=0.5)
    assert "level 0 (s0): y 0.65, x 0.65" in str(info.value)
    assert "level 2 (s2): y 2.6, x 2.6" in str(info.value)
    with pytest.raises(ValueError, match=r"names axes \['w'\]"):
        read_plate(plate_path, level={"w": 1.0})
    with pytest.raises(ValueError, match="level=3 is out of range; it has 3 level"):
        read_plate(plate_path, level=3)
    with pytest.raises(TypeError, match="level must be"):
        read_plate(plate_path, level=True)


def test_label_images_are_read_at_the_level_with_the_images_pixel_size(plate_path: Path) -> None:
    root = zarr.open_group(plate_path, mode="r")
    for level in (0, 1, 2):
        plate = read_plate(plate_path, level=level, labels="all")
        assert plate.label_names == ("cells",)
        assert plate.label_axes == {"cells": ("t", "c", "z", "y", "x")}
        for f in plate.fields:
            label = root[f.labels["cells"]]
            assert f.labels["cells"].startswith(f"{f.path}/labels/cells/")
            assert label.shape == (*SHAPE[:1], 1, *root[f.image].shape[2:])
            # the oracle: the label level's own scale equals the image level's
            attrs = _ome(root[f"{f.path}/labels/cells"].attrs.asdict())
            datasets = attrs["multiscales"][0]["datasets"]
            own = next(d for d in datasets if f.labels["cells"].endswith("/" + d["path"]))
            assert own["coordinateTransformations"][0]["scale"][2:] == pytest.approx(
                list(f.pixel_size.values())[2:]
            )


def test_labels_by_name_none_and_a_missing_name(plate_path: Path) -> None:
    assert read_plate(plate_path, labels=["cells"]).label_names == ("cells",)
    assert read_plate(plate_path, labels=[]).label_names == ()
    assert read_plate(plate_path).label_names == ()
    with pytest.raises(ValueError, match=r"field 'A/1/0' has no label image \['nuclei'\]"):
        read_plate(plate_path, labels=["cells", "nuclei"])
    with pytest.raises(TypeError, match="labels must be None, 'all' or a list"):
        read_plate(plate_path, labels="cells")


def test_a_sparse_plate_reads_its_wells_and_skips_a_listed_absent_one_with_a_warning(
    sparse_path: Path,
) -> None:
    with pytest.warns(UserWarning, match=r"1 well\(s\) and 0 field\(s\) whose group is absent"):
        plate = read_plate(sparse_path)
    assert plate.wells == ("A/1", "A/3", "B/2")
    assert plate.absent_wells == ("B/3",) and plate.absent_fields == ()
    assert [f.path for f in plate.fields] == list(_models_view(sparse_path))
    assert [f.path for f in plate.fields] == ["A/1/0", "A/1/1", "A/3/0", "A/3/1", "B/2/0", "B/2/1"]
    assert "wells ['B/3']" in plate.describe()


def test_a_field_its_well_lists_but_absent_is_skipped_and_named(
    plate_path: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "plate.zarr"
    shutil.copytree(plate_path, copy)
    shutil.rmtree(copy / "B" / "2" / "1")
    with pytest.warns(UserWarning, match=r"0 well\(s\) and 1 field\(s\)"):
        plate = read_plate(copy)
    assert plate.absent_fields == ("B/2/1",)
    assert "B/2/1" not in [f.path for f in plate.fields] and len(plate.fields) == 11


def test_a_well_group_without_well_metadata_is_refused_by_name(
    plate_path: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "plate.zarr"
    shutil.copytree(plate_path, copy)
    well = copy / "A" / "2"
    if (well / "zarr.json").exists():
        (well / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    else:
        (well / ".zattrs").unlink()  # the group (.zgroup) stays: there, without metadata
    with pytest.raises(ValueError, match="well group 'A/2' has no 'well' metadata"):
        read_plate(copy)


def test_what_is_not_a_plate_or_another_ngff_version_is_refused(
    plate_path: Path, tmp_path: Path
) -> None:
    image = tmp_path / "image.zarr"
    zarr.open_group(image, mode="w").create_array("0", shape=(4, 4), dtype="u1")
    with pytest.raises(ValueError, match="no 'plate' metadata: it is not an OME-NGFF HCS plate"):
        read_plate(image)
    copy = tmp_path / "plate.zarr"
    shutil.copytree(plate_path, copy)
    doc = copy / ("zarr.json" if (copy / "zarr.json").exists() else ".zattrs")
    text = doc.read_text().replace('"0.5"', '"0.6"').replace('"0.4"', '"0.3"')
    doc.write_text(text)
    with pytest.raises(ValueError, match=r"NGFF version is 0\.[36]; read_plate reads 0\.4, 0\.5"):
        read_plate(copy)


def test_fields_with_other_axes_are_refused_naming_both(plate_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "plate.zarr"
    shutil.copytree(plate_path, copy)
    doc = copy / "B" / "1" / "0" / ("zarr.json" if (copy / "zarr.json").exists() else ".zattrs")
    doc.write_text(doc.read_text().replace('"name": "z"', '"name": "q"'))
    with pytest.raises(ValueError, match=r"field 'B/1/0' has axes \['t', 'c', 'q', 'y', 'x'\]"):
        read_plate(copy)


class _CountingStore(zarr.storage.WrapperStore[Any]):
    """Counts GETs per key and the most in flight at once (no clock: one loop turn each)."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.gets: dict[str, int] = {}
        self.in_flight = 0
        self.most = 0

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        self.gets[key] = self.gets.get(key, 0) + 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0)  # let every other reader start its GET
        try:
            return await self._store.get(key, prototype, byte_range)
        finally:
            self.in_flight -= 1


def test_wells_and_fields_are_read_concurrently_each_document_once(plate_path: Path) -> None:
    store = _CountingStore(zarr.storage.LocalStore(plate_path, read_only=True))
    plate = read_plate(store, labels="all")
    assert len(plate.fields) == 12
    assert store.most >= 12  # all 12 fields' documents were in flight at once
    assert max(store.gets.values()) == 1
    # no array metadata is read (open_plate's collection reads that)
    assert not any(k.endswith((".zarray", "s0/zarr.json")) for k in store.gets)


def test_a_local_plate_is_read_from_its_files_with_what_the_store_itself_reads(
    plate_path: Path,
) -> None:
    from insitubatch_nodes.io.objects import read_documents

    local = zarr.storage.LocalStore(plate_path, read_only=True)
    counting = _CountingStore(local)  # a wrapper: always read through its own get
    keys = ["zarr.json", ".zattrs", "B/1/0/zarr.json", "B/1/0/.zattrs", "nope/zarr.json", "B"]
    direct = read_documents(local, keys)
    assert direct == read_documents(counting, keys)  # missing and a folder: None alike
    assert any(d is not None for d in direct) and direct[-2:] == [None, None]
    assert counting.gets and read_plate(local) == read_plate(counting)


# -- the metadata-only plate (the scale tests' plate) ---


@pytest.mark.parametrize("version", VERSIONS)
def test_the_metadata_only_plate_is_valid_ngff_with_arrays_zarr_opens(
    version: str, tmp_path: Path
) -> None:
    path = tmp_path / "plate.zarr"
    make_plate_metadata_only(
        path, rows=2, columns=3, fields=2, levels=2, shape=(1, 2, 5, 64, 64),
        labels=("cells",), ngff_version=version,
    )  # fmt: skip
    models = _models_view(path)
    plate = read_plate(path, level={"x": 1.3}, labels="all")
    assert plate.version == version and len(plate.fields) == 12 == len(models)
    assert [f.path for f in plate.fields] == list(models)
    root = zarr.open_group(path, mode="r")
    for f in plate.fields:
        assert f.level == 1 and root[f.image].shape == (1, 2, 5, 32, 32)
        assert root[f.labels["cells"]].shape == (1, 1, 5, 32, 32)
        assert not np.asarray(root[f.image][0, 0, 0, :2, :2]).any()  # no chunk: the fill value
    names = {p.name for p in path.rglob("*") if p.is_file()}
    assert names <= {"zarr.json", ".zgroup", ".zattrs", ".zarray"}  # metadata only


# -- open_plate: a thin call of Collection.from_groups ---


def _stand_in(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace ``Collection.from_groups`` by a recorder of its arguments (the real class when
    it is there, a stand-in module otherwise)."""
    calls: list[dict[str, Any]] = []

    def from_groups(store: Any, groups: Any, variables: Any, **kwargs: Any) -> str:
        calls.append({"store": store, "groups": groups, "variables": variables, **kwargs})
        return "collection"

    try:
        from insitubatch_nodes.io.collection import Collection

        monkeypatch.setattr(Collection, "from_groups", staticmethod(from_groups))
    except ImportError:
        module = types.ModuleType("insitubatch_nodes.io.collection")
        module.Collection = types.SimpleNamespace(from_groups=from_groups)  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "insitubatch_nodes.io.collection", module)
    return calls


def test_open_plate_makes_one_member_per_field_with_its_keys_and_variables(
    plate_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _stand_in(monkeypatch)
    assert open_plate(plate_path, level=1, labels="all") == "collection"
    (call,) = calls
    plate = read_plate(plate_path, level=1, labels="all")
    fields = [f.path for f in plate.fields]
    assert call["groups"] == fields and call["names"] == fields
    assert call["variables"] == {"image": "s1", "labels/cells": "labels/cells/s1"}
    assert call["keys"] == {
        "row": [f.row for f in plate.fields],
        "column": [f.column for f in plate.fields],
        "well": [f.well for f in plate.fields],
        "field": [f.name for f in plate.fields],
    }
    assert call["sample_axis"] == "z"  # a name: each variable finds it among its own axes
    axes = ("t", "c", "z", "y", "x")
    assert call["dims"] == {"image": axes, "labels/cells": axes}  # named by the NGFF axes
    root = zarr.open_group(plate_path, mode="r")
    for group in call["groups"]:  # every member's variable is an array zarr opens
        for rel in call["variables"].values():
            assert root[f"{group}/{rel}"].shape[2] == SHAPE[2]


def test_open_plate_refuses_a_sample_axis_the_images_do_not_have(
    plate_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in(monkeypatch)
    with pytest.raises(ValueError, match=r"sample_axis='w' is not an axis of the plate's images"):
        open_plate(plate_path, sample_axis="w")
    assert open_plate(plate_path, sample_axis=-3) == "collection"


def _plate_of(**fields: Any) -> Plate:
    return Plate(
        version="0.4", zarr_format=2, name=None, rows=(), columns=(), wells=(), fields=(),
        axes=("t", "c", "z", "y", "x"), units={}, **fields,
    )  # fmt: skip


def test_a_named_sample_axis_is_found_in_each_labels_axes_an_index_must_sit_alike() -> None:
    from insitubatch_nodes.io import ngff

    plate = _plate_of(label_axes={"cells": ("z", "y", "x")})
    assert ngff._sample_axis(plate, "z") == "z"  # the label's own z, at index 0
    with pytest.raises(ValueError, match=r"label 'cells' has axes \['z', 'y', 'x'\]"):
        ngff._sample_axis(plate, 2)
    with pytest.raises(ValueError, match=r"label 'cells' .* without the sample axis 't'"):
        ngff._sample_axis(plate, "t")


# -- open_plate end to end ---


def test_collection_open_plate_rows_equal_their_fields_zarr_read_and_wells_split_apart(
    sparse_path: Path,
) -> None:
    from insitubatch_nodes import Loader, insitu_pipeline, split_by_member

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the absent well B/3
        coll = open_plate(sparse_path, sample_axis="z")
    assert list(coll.members) == ["A/1/0", "A/1/1", "A/3/0", "A/3/1", "B/2/0", "B/2/1"]
    assert list(coll.keys["well"]) == ["A/1", "A/1", "A/3", "A/3", "B/2", "B/2"]
    split = split_by_member(coll, {"train": ["A/1", "B/2"], "val": ["A/3"]}, by="well")
    root = zarr.open_group(sparse_path, mode="r")
    seen: dict[str, set[str]] = {}
    for name in ("train", "val"):
        with insitu_pipeline(coll, split, {"x": coll["image"]}, split=name, batch_size=3) as pipe:
            for batch in Loader(pipe):
                for row, (m, z) in enumerate(
                    zip(batch.members["x"], batch.sample_indices["x"], strict=True)
                ):
                    member = coll.members[int(m)]
                    seen.setdefault(name, set()).add(member.rsplit("/", 1)[0])
                    expected = np.asarray(root[f"{member}/s0"][:, :, int(z)])
                    np.testing.assert_array_equal(batch["x"][row], expected)
    assert seen == {"train": {"A/1", "B/2"}, "val": {"A/3"}}


def test_collection_open_plate_splits_by_acquisition_with_no_field_in_two_splits(
    tmp_path: Path,
) -> None:
    """A plate whose wells hold fields of two acquisitions (ome-zarr-py's metadata) splits by
    acquisition id: every row of a split is its field's zarr read and a field of that
    acquisition; the leakage checks hold for acquisitions as for wells. On the old code the
    collection had no ``acquisition`` key: ``split_by_member(by="acquisition")`` raised
    ``KeyError``."""
    from insitubatch_nodes import Loader, insitu_pipeline, split_by_member

    for version in VERSIONS:
        path = tmp_path / f"acq{version}.zarr"
        make_hcs_plate(path, shape=(1, 1, 2, 8, 8), levels=1, labels=(), ngff_version=version,
                       fields=3, acquisitions=2)  # fmt: skip
        root = zarr.open_group(path, mode="r")
        named = {  # zarr's read of each well's metadata: the oracle of each field's acquisition
            f"{w}/{image['path']}": image["acquisition"]
            for w in ("A/1", "A/2", "A/3", "B/1", "B/2", "B/3")
            for image in _ome(root[w].attrs.asdict())["well"]["images"]
        }
        coll = open_plate(path, sample_axis="z")
        assert [int(a) for a in coll.keys["acquisition"]] == [named[m] for m in coll.members]
        assert sorted(set(named.values())) == [0, 1]
        split = split_by_member(coll, {"train": [0], "val": [1]}, by="acquisition")
        seen: dict[str, set[str]] = {}
        for name in ("train", "val"):
            with insitu_pipeline(coll, split, {"x": coll["image"]}, split=name,
                                 batch_size=4) as pipe:  # fmt: skip
                for batch in Loader(pipe):
                    for row, (m, z) in enumerate(
                        zip(batch.members["x"], batch.sample_indices["x"], strict=True)
                    ):
                        member = coll.members[int(m)]
                        seen.setdefault(name, set()).add(member)
                        expected = np.asarray(root[f"{member}/s0"][:, :, int(z)])
                        np.testing.assert_array_equal(batch["x"][row], expected)
        assert seen == {
            name: {m for m, a in named.items() if a == k} for k, name in enumerate(("train", "val"))
        }
        # a well's fields lie in both splits (the point), a field in one only (the check)
        assert {m.rsplit("/", 1)[0] for m in seen["train"]} == {
            m.rsplit("/", 1)[0] for m in seen["val"]
        }
        drawn = split_by_member(coll, {"train": 0.5, "val": 0.5}, by="acquisition", seed=1)
        per_split = [
            {named[coll.members[int(coll["image"].members.chunk_member[c])]]
             for c in drawn.splits[name]}
            for name in ("train", "val")
        ]  # fmt: skip
        assert sorted(per_split, key=sorted) == [{0}, {1}]
        with pytest.raises(ValueError, match="1 is in both 'train' and 'val'"):
            split_by_member(coll, {"train": [0, 1], "val": [1]}, by="acquisition")
        with pytest.raises(KeyError, match="names 7, which is no 'acquisition' value"):
            split_by_member(coll, {"train": [7]}, by="acquisition")
    # a plate where one field names no acquisition: no key, a warning saying so
    well = zarr.open_group(path / "B" / "2", mode="r+")
    attrs = well.attrs.asdict()
    _ome(attrs)["well"]["images"][0].pop("acquisition")
    well.attrs.put(attrs)
    with pytest.warns(UserWarning, match=r"1 of the plate's 18 fields \(first 'B/2/0'\)"):
        mixed = open_plate(path, sample_axis="z")
    assert "acquisition" not in mixed.keys
    # an id that is no integer: refused naming the image (it was int()'s bare "invalid literal")
    for bad in ("run1", True, 1.5):
        _ome(attrs)["well"]["images"][0]["acquisition"] = bad
        well.attrs.put(attrs)
        with pytest.raises(ValueError, match=r"well 'B/2'.s image '0' names acquisition .*OME"):
            open_plate(path, sample_axis="z")
