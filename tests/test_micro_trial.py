"""Model-ready inputs of an HCS plate, tried as a user training a segmenter or a phenotyping
model would use them (2026-12-06): plates written by ome-zarr-py (NGFF 0.4 on zarr v2, 0.5 on
zarr v3), fields of uint16 ``(t, c, z, y, x)`` with a uint8 ``cells`` label image beside each,
opened with ``open_plate`` and split by well. The oracles are numpy over zarr's own read of
each field, found by the well / field / dataset path the NGFF documents name (read here from
the attributes, not from the package).

Found (fixed):

- ``fit_statistics`` of a view on product sample axes (``open_plate(..., sample_axis=("t",
  "z"))``, a timelapse plate's planes) fitted ``diff_std`` from rows that are consecutive on
  the *virtual* sample axis: ``(t, z=Z-1)`` paired with ``(t+1, z=0)``, and within a stored
  block of several steps pairs along whichever axis the chunking puts next. It was neither
  the tendency along t nor the step along z (measured: 211.4 where along t is 91.8, along z
  210.1). A step has no single meaning on product axes (``shift`` and ``window`` are refused
  there for that reason): ``diff_std`` is now NaN for them, as for a static label.
- ``fit_statistics`` paired rows of two fields in ``diff_std`` (docs: "no difference spans two
  members"): with a plate's chunks drawn into splits by ``split_by_chunk(contiguous=False)``,
  field A/1/1's plane 0 met A/2/0's plane 1 in the pass, and member-local sample indices one
  apart were taken for one step (26714 / 27037 where the steps within fields give 26779 /
  26958). The step now also needs the same member, on collections of separate members.
- ``make_hcs_plate(absent_wells=[...])`` without ``wells=`` wrote the absent wells all the
  same, so a plate meant to have lost wells had them (``open_plate`` read them, no warning).

Tried and found right:

- ``fit_statistics`` over the train (and the val) fields of a plate split by well: per-channel
  mean / std / min / max equal numpy float64 over exactly that split's fields, on fields of
  different Z lengths (no padding counted), ``count`` the pixels, ``nan_count`` 0; ``diff_std``
  over ``sample_axis="z"`` is that of the z-steps within each field, none across fields.
- ``stats.normalizer`` on a channel selection (``isel(c=[0, 2])``) gives float32
  ``(x - mean) / std`` per channel on every row of train and val.
- ``sel(c="GFP")`` (omero names) and ``isel(c=0)`` of the label image, patched ``{"y": 64,
  "x": 64}`` on a grid and at random origins: every image and mask window equals numpy's cut
  of the same field at the row's origin, the two labels share member, plane and origin, and
  a state taken after two batches resumes into exactly the rest of the epoch.
- ``sample_axis="t"`` with ``isel(z=[0, 2])``: each row is ``field[t, :, [0, 2]]``.
- ``batch.members`` / ``collection.keys``: each row's member is the well and field whose
  array holds its values, as the plate metadata lays them out.
- A ``stack`` of uint16 channels and a uint8 label image is refused saying to give them as
  labels of their own; ``normalize=`` on uint16 members is refused pointing to
  ``stats.normalizer``; a stack member with the plate's t axis left in is refused saying to
  select it away.

Tried by hand (not kept here) and found right: a StatefulDataLoader (``as_dataset``,
``to_item``) resumed after two batches of random image / mask patches with a normalizer
delivers the rest of the epoch, each window numpy's; ``Statistics.load`` refuses another
manifest; the normalizer refuses DAPI's statistics for GFP (``isel(c=0)`` against a fit of
``sel(c="GFP")``) and a fit of ``[DAPI, GFP]`` for ``[GFP, DAPI]``; ``within=`` statistics equal
numpy over the box; two ranks deal the train fields' planes disjointly, all of them.

Seen, not changed: statistics fitted on a plate's level 0 standardise a view of its level 1 (or
of another plate's ``image``) without a word: a collection's array path is
``collection-<hash>:<variable>`` and any two collections' views of one variable name pass as
one quantity (so that a ``subset``'s statistics serve the others). Telling a level or a plate
apart needs the collection's store and each variable's array path in what is compared: an
identity change of collection paths. (``patches(..., origins="random", per_tile=3)`` on a
field of one 96 x 96 tile with 64 x 64 windows drew 1 window per plane, not 3, its 33 x 33
start positions taken as an edge tile's share: fixed since, see tests/test_patches.py.)
"""

from __future__ import annotations

import json
import warnings
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Loader,
    insitu_pipeline,
    open_plate,
    split_by_chunk,
    split_by_member,
    stack,
)
from insitubatch_nodes.statistics import fit_statistics
from insitubatch_nodes.synthetic import make_hcs_plate

pytest.importorskip("ome_zarr")
# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("micro_trial")]

YX = 32


def _format(version: str) -> Any:
    from ome_zarr.format import FormatV04, FormatV05

    return {"0.4": FormatV04, "0.5": FormatV05}[version]()


def _write_plate(path: Path, version: str, zs: list[int]) -> None:
    """One row of wells ``A/1..``, two fields each; well ``i``'s fields have ``zs[i]`` planes
    of two uint16 channels, ``(1, 2, z, 32, 32)`` in 16 x 16 tiles, and a ``cells`` label."""
    from ome_zarr.writer import write_image, write_labels, write_plate_metadata, write_well_metadata

    fmt = _format(version)
    root = zarr.open_group(path, mode="w", zarr_format=fmt.zarr_format)
    columns = [str(i + 1) for i in range(len(zs))]
    wells = [f"A/{c}" for c in columns]
    write_plate_metadata(root, ["A"], columns, wells, fmt=fmt, field_count=2)
    rng = np.random.default_rng(5)
    chunks = {"chunks": (1, 1, 1, 16, 16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ome-zarr-py's notes on its defaults
        for w, nz in zip(wells, zs, strict=True):
            well = root.require_group(w)
            write_well_metadata(well, ["0", "1"], fmt=fmt)
            for f in ("0", "1"):
                field = well.require_group(f)
                image = rng.integers(0, 65535, (1, 2, nz, YX, YX), dtype=np.uint16)
                write_image(image, field, scale_factors=[], fmt=fmt, axes="tczyx",
                            storage_options=chunks)  # fmt: skip
                mask = rng.integers(0, 4, (1, 1, nz, YX, YX), dtype=np.uint8)
                write_labels(mask, field, name="cells", scaler=None, scale_factors=[], fmt=fmt,
                             axes="tczyx", storage_options=chunks)  # fmt: skip


def _attrs(path: Path, group: str) -> dict[str, Any]:
    """A group's NGFF attributes, read from its document (0.4 ``.zattrs``, 0.5 ``zarr.json``)."""
    zattrs = path / group / ".zattrs"
    if zattrs.exists():
        return dict(json.loads(zattrs.read_text()))
    return dict(json.loads((path / group / "zarr.json").read_text())["attributes"]["ome"])


def _field(path: Path, member: str, label: str | None = None) -> np.ndarray:
    """Level 0 of field ``member`` (``"A/1/0"``), or of its label image ``label``."""
    group = member if label is None else f"{member}/labels/{label}"
    level0 = _attrs(path, group)["multiscales"][0]["datasets"][0]["path"]
    return np.asarray(zarr.open_array(str(path), path=f"{group}/{level0}", mode="r")[...])


def _members_of(pipe: Any, label: str, names: tuple[str, ...]) -> list[str]:
    return sorted({names[int(m)] for batch in Loader(pipe) for m in batch.members[label]})


@pytest.fixture(scope="module", params=["0.4", "0.5"])
def plate(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plate") / f"plate{request.param}.zarr"
    _write_plate(path, request.param, [3, 5, 2, 4])
    return path


def test_statistics_of_a_split_by_well_are_numpy_float64_over_exactly_its_fields(
    plate: Path,
) -> None:
    coll = open_plate(plate, labels=["cells"], sample_axis="z")
    manifest = split_by_member(coll, {"train": 0.5, "val": 0.25, "test": 0.25}, by="well")
    views = {"image": coll["image"]}
    for split in ("train", "val"):
        stats = fit_statistics(coll, manifest, views, split=split)
        with insitu_pipeline(coll, manifest, views, split=split, batch_size=4) as pipe:
            members = _members_of(pipe, "image", coll.members)
        wells = {m.rsplit("/", 1)[0] for m in members}
        assert members == sorted(f"{w}/{f}" for w in wells for f in "01")  # whole wells
        fields = [_field(plate, m).astype(np.float64) for m in members]  # (1, 2, z, y, x)
        x = np.concatenate([f.transpose(0, 1, 3, 4, 2).reshape(1, 2, -1) for f in fields], -1)
        np.testing.assert_allclose(stats.mean["image"], x.mean(-1), rtol=1e-12)
        np.testing.assert_allclose(stats.std["image"], x.std(-1), rtol=1e-12)
        np.testing.assert_array_equal(stats.min["image"], x.min(-1))
        np.testing.assert_array_equal(stats.max["image"], x.max(-1))
        np.testing.assert_array_equal(stats.count["image"], np.full((1, 2), x.shape[-1]))
        np.testing.assert_array_equal(stats.nan_count["image"], 0)
        # steps along z within each field; none from one field's last plane to the next's first
        steps = np.concatenate(
            [np.diff(f, axis=2).transpose(0, 1, 3, 4, 2).reshape(1, 2, -1) for f in fields], -1
        )
        np.testing.assert_allclose(stats.diff_std["image"], steps.std(-1), rtol=1e-12)


def test_the_normalizer_standardises_a_channel_selection_row_for_row_as_numpy(
    plate: Path,
) -> None:
    coll = open_plate(plate, sample_axis="z")
    manifest = split_by_member(coll, {"train": 0.5, "val": 0.5}, by="well", seed=2)
    views = {"img": coll["image"].isel(c=[1, 0])}
    stats = fit_statistics(coll, manifest, views)
    mean, std = (s["img"].reshape(1, 2, 1, 1) for s in (stats.mean, stats.std))
    fields = {m: _field(plate, m) for m in coll.members}
    rows = 0
    for split in ("train", "val"):
        transforms = [stats.normalizer(views)]
        with insitu_pipeline(coll, manifest, views, split=split, batch_size=4,
                             batch_transforms=transforms) as pipe:  # fmt: skip
            for batch in Loader(pipe):
                x = np.asarray(batch["img"])
                assert x.dtype == np.float32
                for r in range(len(x)):
                    m, z = int(batch.members["img"][r]), int(batch.sample_indices["img"][r])
                    plane = fields[coll.members[m]][:, [1, 0], z].astype(np.float64)
                    np.testing.assert_allclose(x[r], (plane - mean) / std, rtol=0, atol=2e-6)
                    rows += 1
    assert rows == 2 * (3 + 5 + 2 + 4)  # every plane of every field, once


def _windows(pipe: Any, names: tuple[str, ...], fields: dict[str, Any]) -> list[tuple]:
    rows = []
    for batch in pipe:
        for r in range(len(batch.members["gfp"])):
            m, z = int(batch.members["gfp"][r]), int(batch.sample_indices["gfp"][r])
            y0, x0 = (int(v) for v in batch.patch_origins["gfp"][r])
            assert int(batch.members["mask"][r]) == m
            assert int(batch.sample_indices["mask"][r]) == z
            assert tuple(int(v) for v in batch.patch_origins["mask"][r]) == (y0, x0)
            image, mask = fields[names[m]]
            cut = (slice(None), slice(y0, y0 + 64), slice(x0, x0 + 64))
            np.testing.assert_array_equal(batch["gfp"][r], image[:, 1, z][cut])
            np.testing.assert_array_equal(batch["mask"][r], mask[:, 0, z][cut])
            rows.append((names[m], z, y0, x0))
    return rows


@pytest.mark.parametrize("origins", ["grid", "random"])
def test_image_and_mask_patches_are_the_same_pixels_of_the_field_also_after_a_resume(
    tmp_path: Path, origins: str
) -> None:
    path = make_hcs_plate(tmp_path / "p.zarr", rows=1, columns=2, fields=2, levels=1,
                          shape=(1, 2, 3, 96, 96), ngff_version="0.5",
                          channel_names=("DAPI", "GFP"))  # fmt: skip
    coll = open_plate(path, labels=["cells"], sample_axis="z")
    manifest = split_by_member(coll, {"train": 1.0})
    window = {"y": 64, "x": 64}
    views = {
        "gfp": coll["image"].sel(c="GFP").patches(window, origins=origins),
        "mask": coll["labels/cells"].isel(c=0).patches(window, origins=origins),
    }
    fields = {m: (_field(Path(path), m), _field(Path(path), m, "cells")) for m in coll.members}

    def run(state: dict[str, Any] | None = None, take: int = 0) -> Any:
        pipe = insitu_pipeline(coll, manifest, views, batch_size=5, seed=3)
        try:
            pipe.reset(state)
            for _ in range(take):
                next(pipe)
            return pipe.state_dict() if take else _windows(pipe, coll.members, fields)
        finally:
            pipe.close()

    full = run()
    per_field = 4 if origins == "grid" else 1  # origins 0, 32 of 96 per axis; one per tile
    assert len(full) == len(set(full)) == 4 * 3 * per_field
    assert run(run(take=2)) == full[10:]


def test_sample_axis_t_with_a_z_selection_is_those_planes_of_each_time(tmp_path: Path) -> None:
    path = make_hcs_plate(tmp_path / "t.zarr", rows=1, columns=2, fields=1, levels=1,
                          shape=(3, 2, 3, 16, 16), labels=())  # fmt: skip
    coll = open_plate(path, sample_axis="t")
    view = coll["image"].isel(z=[0, 2])
    seen = []
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": view}) as pipe:
        for batch in Loader(pipe):
            for r in range(len(batch)):
                m, t = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                expected = _field(Path(path), coll.members[m])[t][:, [0, 2]]
                np.testing.assert_array_equal(batch["x"][r], expected)
                seen.append((m, t))
    assert sorted(seen) == [(m, t) for m in range(2) for t in range(3)]


def test_each_row_names_the_well_and_field_whose_array_holds_it(plate: Path) -> None:
    coll = open_plate(plate, sample_axis="z")
    layout = _attrs(plate, "")["plate"]
    wells = [w["path"] for w in layout["wells"]]
    images = {w: [i["path"] for i in _attrs(plate, w)["well"]["images"]] for w in wells}
    assert list(coll.members) == [f"{w}/{f}" for w in wells for f in images[w]]
    fields = {m: _field(plate, m) for m in coll.members}
    planes = {m: {f[0, :, z].tobytes() for z in range(f.shape[2])} for m, f in fields.items()}
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": coll["image"]},
                         batch_size=6) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            for r, m in enumerate(np.asarray(batch.members["x"])):
                name = coll.members[int(m)]
                well, field = coll.keys["well"][int(m)], coll.keys["field"][int(m)]
                assert name == f"{well}/{field}"
                assert np.asarray(batch["x"][r])[0].tobytes() in planes[name]


def test_a_stack_of_channels_and_a_label_image_is_refused_saying_what_to_do(plate: Path) -> None:
    coll = open_plate(plate, labels=["cells"], sample_axis="z")
    image, cells = coll["image"], coll["labels/cells"]
    with pytest.raises(ValueError, match="labels of their own"):
        stack({"img": image.isel(t=0, c=[0, 1]), "cells": cells.isel(t=0)})
    with pytest.raises(ValueError, match="select one axis away"):
        stack({"img": image})  # (t, c, y, x): the plate's t left in
    manifest = split_by_member(coll, {"train": 1.0})
    members = {"img": image.isel(t=0, c=[0, 1])}
    stats = fit_statistics(coll, manifest, members)
    with pytest.raises(ValueError, match=r"stats\.normalizer"):
        stack(members, normalize=stats)


def test_one_step_differences_on_product_sample_axes_are_nan_not_pairs_across_a_wrap(
    tmp_path: Path,
) -> None:
    # before: diff_std 211.4 here, the std of x[(t, 0)] - x[(t-1, Z-1)] mixed with z-steps,
    # where the steps along t have 91.8 and along z 210.1: rows consecutive on the virtual
    # axis are no one step of anything on (t, z)
    path = make_hcs_plate(tmp_path / "tl.zarr", rows=1, columns=2, fields=1, levels=1,
                          shape=(3, 1, 4, 16, 16), labels=())  # fmt: skip
    coll = open_plate(path, sample_axis=("t", "z"))
    stats = fit_statistics(coll, split_by_member(coll, {"train": 1.0}), {"img": coll["image"]})
    assert np.isnan(stats.diff_std["img"]).all()
    planes = np.concatenate([_field(Path(path), m)[:, 0].astype(np.float64)
                             for m in coll.members])  # fmt: skip
    np.testing.assert_allclose(stats.mean["img"], [planes.mean()], rtol=1e-12)
    np.testing.assert_allclose(stats.std["img"], [planes.std()], rtol=1e-12)


def test_a_plate_made_with_absent_wells_lacks_them_and_the_rows_name_the_rest(
    tmp_path: Path,
) -> None:
    # before: make_hcs_plate(absent_wells=["A/2"]) without wells= wrote A/2 all the same, so a
    # user testing how the loader meets a lost well trained on it without a warning
    path = make_hcs_plate(tmp_path / "a.zarr", rows=2, columns=2, fields=1, levels=1,
                          shape=(1, 1, 2, 16, 16), labels=(), absent_wells=["A/2"])  # fmt: skip
    assert not (Path(path) / "A" / "2").exists()
    with pytest.warns(UserWarning, match="A/2"):
        coll = open_plate(path, sample_axis="z")
    assert list(coll.members) == ["A/1/0", "B/1/0", "B/2/0"]
    seen = set()
    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": coll["image"]},
                         batch_size=4) as pipe:  # fmt: skip
        for batch in Loader(pipe):
            for r, m in enumerate(np.asarray(batch.members["x"])):
                name, z = coll.members[int(m)], int(batch.sample_indices["x"][r])
                assert coll.keys["well"][int(m)] == name.rsplit("/", 1)[0]
                np.testing.assert_array_equal(batch["x"][r], _field(Path(path), name)[:, :, z])
                seen.add((name, z))
    assert len(seen) == 3 * 2
    with pytest.raises(ValueError, match="both"):
        make_hcs_plate(tmp_path / "b.zarr", wells=["A/1"], absent_wells=["A/1"])


def test_one_step_differences_never_pair_two_fields_of_a_plate_split_by_chunk(
    plate: Path,
) -> None:
    # before: with the chunks of a plate drawn into splits (split_by_chunk, contiguous=False),
    # field A/1/1's plane 0 was paired with A/2/0's plane 1 where they met in the pass (its
    # plane 0 in the other split): 26714 / 27037 where the z-steps within fields give
    # 26779 / 26958
    coll = open_plate(plate, sample_axis="z")
    view = coll["image"]
    manifest = split_by_chunk(view, (0.5, 0.5, 0.0), contiguous=False, seed=1)
    stats = fit_statistics(coll, manifest, {"x": view})
    rows = []
    with insitu_pipeline(coll, manifest, {"x": view}, shuffle=False, batch_size=4) as pipe:
        for batch in Loader(pipe):
            members, planes = batch.members["x"], batch.sample_indices["x"]
            rows += [(coll.members[int(m)], int(z)) for m, z in zip(members, planes, strict=True)]
    assert any(a[0] != b[0] and b[1] == a[1] + 1 for a, b in pairwise(rows))  # the trap
    fields = {m: _field(plate, m).astype(np.float64) for m in coll.members}
    steps = [fields[m][:, :, z + 1] - fields[m][:, :, z]
             for (m, z), after in pairwise(rows) if after == (m, z + 1)]  # fmt: skip
    within = np.stack(steps, axis=2).reshape(1, 2, -1)
    np.testing.assert_allclose(stats.diff_std["x"], within.std(-1), rtol=1e-12)
