"""Product sample axes on a collection (issue 32): every (t, z) plane of every member is one
sample of one stream, zarr as the oracle.

Members are ``(t, c, z, y, x)`` fields whose t and z lengths are not multiples of their chunks
(edge blocks with padding), with a label image beside each. Every row equals
``member_array[t, :, z]`` of the member ``batch.members`` names, at the ``(t, z)`` that
``geom.sample_coords(batch.sample_indices[label])`` gives; each stored object is read once per
epoch; ``split_by_member`` keeps whole members; ranks deal disjoint planes in equal batch
counts; a resumed epoch continues exactly, also through ``InSituDataModule`` under a real
Lightning ``Trainer`` resumed from a mid-epoch checkpoint; a warm persistent cache reads no
object and gives zarr's planes; members of
other lengths along the axes, and variables on other grids, are refused by name; an
OME-NGFF plate opened with ``sample_axis=("t", "z")`` reads its fields' planes.
"""

from __future__ import annotations

import warnings
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store
from resume_helpers import assert_resumes_exactly, epochs_of

from insitubatch_nodes import (
    Collection,
    Loader,
    insitu_pipeline,
    open_plate,
    split_by_chunk,
    split_by_member,
)
from insitubatch_nodes.synthetic import make_hcs_plate

T, C, Z, Y, X = 3, 2, 5, 4, 6
CHUNKS = (2, 2, 2, 4, 3)  # t blocks 2+1, z blocks 2+2+1, two x tiles: 6 blocks of up to 4
GROUPS = ["A/1/0", "A/1/1", "A/2/0", "B/1/0"]
WELLS = ["A/1", "A/1", "A/2", "B/1"]


def _write(root: Path, groups: list[str] = GROUPS, t: int = T) -> None:
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for m, path in enumerate(groups):
        g = group.create_group(path)
        image = g.create_array(
            "0", shape=(t, C, Z, Y, X), chunks=CHUNKS, dtype="f4", dimension_names=tuple("tczyx")
        )
        image[:] = 10_000 * m + np.arange(t * C * Z * Y * X, dtype="f4").reshape(t, C, Z, Y, X)
        labels = g.create_array(
            "labels/0",
            shape=(t, 1, Z, Y, X),
            chunks=(2, 1, 2, 4, 6),
            dtype="u2",
            dimension_names=tuple("tczyx"),
        )
        tz = np.arange(t)[:, None, None, None, None] * 10 + np.arange(Z)[:, None, None]
        labels[:] = (1000 * (m + 1) + tz).astype("u2")


# one worker runs the module: its module fixtures are built once, not once per worker; the
# worker of the tests that import Lightning, which one of its tests does
pytestmark = pytest.mark.xdist_group("lightning")


@pytest.fixture(scope="module")
def plate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tz_plate") / "plate.zarr"
    _write(root)
    return root


def _collection(store: Any, **kw: Any) -> Collection:
    return Collection.from_groups(
        store,
        GROUPS,
        {"image": "0", "labels": "labels/0"},
        keys={"well": WELLS},
        sample_axis=kw.pop("sample_axis", ("t", "z")),
        **kw,
    )


def _oracle(root: Path, path: str) -> np.ndarray:
    return np.asarray(zarr.open_array(root, path=path, mode="r")[...])


def test_every_row_is_its_members_zarr_plane_at_its_t_and_z(plate: Path) -> None:
    coll = _collection(plate)
    image, labels = coll["image"], coll["labels"]
    assert image.product is not None and image.product.axes == (0, 2)
    assert image.inner_shape == (C, Y, X) and labels.inner_shape == (1, Y, X)
    assert image.samples_per_chunk == 4 and image.n_chunks == 6 * len(GROUPS)
    assert coll.lengths.tolist() == [T * Z] * len(GROUPS)  # each member's (t, z) pairs
    data = {g: (_oracle(plate, f"{g}/0"), _oracle(plate, f"{g}/labels/0")) for g in GROUPS}
    views = {"x": image, "y": labels}
    manifest = split_by_member(coll, {"train": 1.0})
    seen = []
    with insitu_pipeline(coll, manifest, views, batch_size=5, block_chunks=2, seed=3) as pipe:
        for batch in Loader(pipe):
            np.testing.assert_array_equal(batch.members["x"], batch.members["y"])
            np.testing.assert_array_equal(batch.sample_indices["x"], batch.sample_indices["y"])
            tz = image.sample_coords(batch.sample_indices["x"])
            assert tz.shape == (len(batch), 2)
            for r, (m, (t, z)) in enumerate(zip(batch.members["x"], tz, strict=True)):
                img, lab = data[coll.members[int(m)]]
                np.testing.assert_array_equal(batch["x"][r], img[t, :, z])
                np.testing.assert_array_equal(batch["y"][r], lab[t, :, z])
                seen.append((int(m), int(t), int(z)))
    every = [(m, t, z) for m in range(len(GROUPS)) for t in range(T) for z in range(Z)]
    assert sorted(seen) == every  # each (member, t, z) once
    # the shuffle mixes members within a batch stream (not member after member)
    assert [m for m, _, _ in seen] != sorted(m for m, _, _ in seen)


def test_each_stored_object_of_every_member_is_read_once_per_epoch(plate: Path) -> None:
    store = counting_store(plate)
    coll = _collection(store)
    manifest = split_by_member(coll, {"train": 1.0})
    store.reset_counts()
    pipe = insitu_pipeline(
        coll, manifest, {"x": coll["image"], "y": coll["labels"]}, batch_size=5, block_chunks=2
    )
    loader = Loader(pipe)
    try:
        rows = sum(len(b) for b in loader)
        first = store.chunk_counts()
    finally:
        pipe.close()
    assert rows == len(GROUPS) * T * Z
    # per member: image 2 t blocks x 3 z blocks x 2 x tiles, labels 2 x 3 blocks of one tile
    expected = {
        *(f"{g}/0/c/{t}/0/{z}/0/{x}" for g in GROUPS for t in range(2) for z in range(3)
          for x in range(2)),
        *(f"{g}/labels/0/c/{t}/0/{z}/0/0" for g in GROUPS for t in range(2) for z in range(3)),
    }  # fmt: skip
    assert set(first) == expected, sorted(set(first) ^ expected)
    assert set(first.values()) == {1}, first


def test_split_by_member_keeps_every_plane_of_a_member_in_its_split(plate: Path) -> None:
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": ["A/1", "B/1"], "val": ["A/2"]}, by="well")
    image = coll["image"]
    got: dict[str, set[tuple[int, int, int]]] = {}
    for split in ("train", "val"):
        with insitu_pipeline(coll, manifest, {"x": image}, split=split, batch_size=4) as pipe:
            for batch in Loader(pipe):
                tz = image.sample_coords(batch.sample_indices["x"])
                pairs = zip(batch.members["x"], tz, strict=True)
                got.setdefault(split, set()).update((int(m), int(t), int(z)) for m, (t, z) in pairs)
    wells = {s: {WELLS[m] for m, _, _ in rows} for s, rows in got.items()}
    assert wells == {"train": {"A/1", "B/1"}, "val": {"A/2"}}
    for split, rows in got.items():  # whole members: every (t, z) of each
        members = {m for m, _, _ in rows}
        assert rows == {(m, t, z) for m in members for t in range(T) for z in range(Z)}, split


def _records(batches: list[Any]) -> list[tuple]:
    return [
        (b.epoch, b.index, b.members["x"].tolist(), b.sample_indices["x"].tolist(), b["x"].sum())
        for b in batches
    ]


def test_a_resumed_epoch_continues_exactly(plate: Path) -> None:
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": 1.0})
    views = {"x": coll["image"], "y": coll["labels"]}

    def build() -> Any:
        return insitu_pipeline(coll, manifest, views, batch_size=7, block_chunks=2, seed=9)

    per_epoch = -(-len(GROUPS) * T * Z // 7)
    pipe = build()
    try:
        ref = _records(list(islice(epochs_of(Loader(pipe)), 2 * per_epoch)))
    finally:
        pipe.close()
    assert_resumes_exactly(build, _records, ref, (1, per_epoch - 1, per_epoch + 2))


def test_from_arrays_takes_product_axes_by_index_and_split_by_chunk(plate: Path) -> None:
    coll = Collection.from_arrays(
        [(str(plate), f"{g}/0") for g in GROUPS], names=GROUPS, sample_axis=(0, 2)
    )
    image = coll["data"]
    assert image.product == _collection(plate)["image"].product
    data = [_oracle(plate, f"{g}/0") for g in GROUPS]
    manifest = split_by_chunk(image, (1.0, 0.0, 0.0))
    n = 0
    with insitu_pipeline(coll, manifest, {"x": image}, batch_size=8) as pipe:
        for batch in Loader(pipe):
            tz = image.sample_coords(batch.sample_indices["x"])
            for r, (m, (t, z)) in enumerate(zip(batch.members["x"], tz, strict=True)):
                np.testing.assert_array_equal(batch["x"][r], data[int(m)][t, :, z])
            n += len(batch)
    assert n == len(GROUPS) * T * Z


def test_members_of_other_lengths_along_the_axes_and_variables_on_other_grids_are_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ragged.zarr"
    _write(root, ["f0", "f1"])
    zarr.open_group(root, mode="a")["f1/0"].resize((T + 1, C, Z, Y, X))
    with pytest.raises(ValueError, match="member 'f1' has 4 steps along axis 0 of 'image'"):
        Collection.from_groups(root, ["f0", "f1"], {"image": "0"}, sample_axis=("t", "z"))
    # labels chunked (1, 1, 2, 4, 6) along t: another grid than the image's
    root = tmp_path / "grids.zarr"
    _write(root, ["f0"])
    g = zarr.open_group(root, mode="a")
    other = g.create_array("f0/lab", shape=(T, 1, Z, Y, X), chunks=(1, 1, 2, 4, 6), dtype="u1")
    other[:] = 1
    with pytest.raises(ValueError, match="variable 'labels' is on ProductGrid"):
        Collection.from_groups(root, ["f0"], {"image": "0", "labels": "lab"}, sample_axis=(0, 2))
    with pytest.raises(ValueError, match="two or more distinct axes"):
        Collection.from_groups(root, ["f0"], {"image": "0"}, sample_axis=("t", "t"))


def test_open_plate_on_t_and_z_reads_every_fields_planes(tmp_path: Path) -> None:
    path = make_hcs_plate(
        tmp_path / "timelapse.zarr", rows=1, columns=2, fields=2, shape=(2, 2, 3, 16, 16),
        levels=1, ngff_version="0.4",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        coll = open_plate(path, labels=["cells"], sample_axis=("t", "z"))
    image, cells = coll["image"], coll["labels/cells"]
    assert image.product is not None and image.product.axes == (0, 2)
    root = zarr.open_group(path, mode="r")
    manifest = split_by_member(coll, {"train": 1.0})
    seen = set()
    views = {"x": image, "y": cells}
    with insitu_pipeline(coll, manifest, views, batch_size=3) as pipe:
        for batch in Loader(pipe):
            tz = image.sample_coords(batch.sample_indices["x"])
            for r, (m, (t, z)) in enumerate(zip(batch.members["x"], tz, strict=True)):
                member = coll.members[int(m)]
                want = np.asarray(root[coll.paths("image")[int(m)]][t, :, z])
                np.testing.assert_array_equal(batch["x"][r], want)
                lab = np.asarray(root[coll.paths("labels/cells")[int(m)]][t, :, z])
                np.testing.assert_array_equal(batch["y"][r], lab)
                seen.add((member, int(t), int(z)))
    assert seen == {(f, t, z) for f in coll.members for t in range(2) for z in range(3)}


def test_absent_objects_of_a_member_drop_their_planes_with_drop(tmp_path: Path) -> None:
    root = tmp_path / "holes.zarr"
    _write(root)
    # member 1's image object at t block 0, z block 1, x tile 1: its planes t 0-1, z 2-3
    (root / GROUPS[1] / "0" / "c" / "0" / "0" / "1" / "0" / "1").unlink()
    coll = _collection(root)
    image = coll["image"]
    manifest = split_by_member(coll, {"train": 1.0})
    pipe = insitu_pipeline(coll, manifest, {"x": image}, missing_objects="drop", batch_size=6)
    dropped = pipe.stages.plan.dropped
    data = [_oracle(root, f"{g}/0") for g in GROUPS]
    seen = set()
    with pipe:
        for batch in Loader(pipe):
            tz = image.sample_coords(batch.sample_indices["x"])
            for r, (m, (t, z)) in enumerate(zip(batch.members["x"], tz, strict=True)):
                np.testing.assert_array_equal(batch["x"][r], data[int(m)][t, :, z])
                seen.add((int(m), int(t), int(z)))
    gone = {(1, t, z) for t in (0, 1) for z in (2, 3)}
    every = {(m, t, z) for m in range(len(GROUPS)) for t in range(T) for z in range(Z)}
    assert seen == every - gone
    assert dropped["absent_object"] == len(gone)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_deal_disjoint_planes_of_all_members_in_equal_batch_counts(
    plate: Path, world: int
) -> None:
    coll = _collection(plate)
    image = coll["image"]
    data = [_oracle(plate, f"{g}/0") for g in GROUPS]
    manifest = split_by_member(coll, {"train": 1.0})
    per_rank, counts = [], []
    for rank in range(world):
        pipe = insitu_pipeline(
            coll, manifest, {"x": image}, batch_size=4, seed=5, rank=rank, world_size=world
        )
        with pipe:
            mine, batches = [], 0
            for batch in Loader(pipe):
                batches += 1
                tz = image.sample_coords(batch.sample_indices["x"])
                for r, (m, (t, z)) in enumerate(zip(batch.members["x"], tz, strict=True)):
                    np.testing.assert_array_equal(batch["x"][r], data[int(m)][t, :, z])
                    mine.append((int(m), int(t), int(z)))
            assert batches == len(pipe)
        per_rank.append(mine)
        counts.append(batches)
    flat = [p for mine in per_rank for p in mine]
    assert len(flat) == len(set(flat)), "ranks share a plane"
    assert len(GROUPS) * T * Z - len(flat) <= world - 1
    assert len(set(counts)) == 1, f"unequal batch counts {counts}"


def _planes(batch: Any, image: Any, data: dict[str, np.ndarray], coll: Collection) -> list[tuple]:
    """Each row checked against zarr's plane of its member at its (t, z); their keys."""
    tz = image.sample_coords(batch.sample_indices["x"])
    out = []
    for r, (m, (t, z)) in enumerate(zip(batch.members["x"], tz, strict=True)):
        np.testing.assert_array_equal(batch["x"][r], data[coll.members[int(m)]][t, :, z])
        out.append((int(m), int(t), int(z)))
    return out


def test_a_warm_persistent_cache_of_product_axes_reads_nothing_and_gives_zarrs_planes(
    plate: Path, tmp_path: Path
) -> None:
    store = counting_store(plate)
    coll = _collection(store)
    image, labels = coll["image"], coll["labels"]
    data = {g: _oracle(plate, f"{g}/0") for g in GROUPS}
    lab = {g: _oracle(plate, f"{g}/labels/0") for g in GROUPS}
    manifest = split_by_member(coll, {"train": 1.0})
    every = sorted((m, t, z) for m in range(len(GROUPS)) for t in range(T) for z in range(Z))
    for run in range(2):
        store.reset_counts()
        pipe = insitu_pipeline(
            coll, manifest, {"x": image, "y": labels}, batch_size=5, block_chunks=2, seed=4,
            cache_dir=tmp_path / "cache", persist=True,
        )  # fmt: skip
        seen = []
        with pipe:
            for batch in Loader(pipe):
                planes = _planes(batch, image, data, coll)
                for r, (m, t, z) in enumerate(planes):
                    np.testing.assert_array_equal(batch["y"][r], lab[GROUPS[m]][t, :, z])
                seen.extend(planes)
        assert sorted(seen) == every
        gets = store.chunk_counts()
        if run == 0:  # per member 2 x 3 image blocks of 2 tiles, 2 x 3 label blocks
            assert len(gets) == len(GROUPS) * 18 and set(gets.values()) == {1}
        else:
            assert gets == {}, "a warm cache read the store"


def test_the_lightning_module_resumes_a_product_axes_collection_mid_epoch_exactly(
    plate: Path, tmp_path: Path
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    from insitubatch_nodes.lightning import InSituDataModule
    from insitubatch_nodes.plan.config import PlanConfig

    coll = _collection(plate)
    image = coll["image"]
    data = {g: _oracle(plate, f"{g}/0") for g in GROUPS}

    def item(batch: Any) -> dict[str, Any]:
        _planes(batch, image, data, coll)  # every row is zarr's plane
        return {
            "x": torch.from_numpy(np.asarray(batch["x"])),
            "m": torch.as_tensor(batch.members["x"]),
            "i": torch.as_tensor(batch.sample_indices["x"]),
            "at": torch.tensor([batch.epoch, batch.index]),
        }

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen: list[tuple] = []

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            x = batch["x"]
            self.seen.append((*batch["at"].tolist(), batch["m"].tolist(), batch["i"].tolist(),
                              float(x.sum())))  # fmt: skip
            return (self.w * x.mean()) ** 2

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(ckpt: Path | None, save: bool) -> list[tuple]:
        dm = InSituDataModule(
            coll, {"x": image}, split_by_member(coll, {"train": 1.0}), coords=(),
            config=PlanConfig(batch_size=7, block_chunks=2, seed=9), transform=item,
            log_report=False,
        )  # fmt: skip
        model = Recorder()
        callbacks = [
            pl.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=1,
                save_top_k=-1,
            )
        ] if save else []  # fmt: skip
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=2, logger=False, callbacks=callbacks,
            enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, num_sanity_val_steps=0,
        )  # fmt: skip
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (few batches, no val loader, no workers)
                trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        finally:
            dm.teardown()
        return model.seen

    per_epoch = -(-len(GROUPS) * T * Z // 7)
    ref = fit(None, save=True)
    assert len(ref) == 2 * per_epoch and [r[:2] for r in ref[:per_epoch]] == [
        (0, k) for k in range(per_epoch)
    ]
    for step in (3, per_epoch + 2):  # mid-epoch in the first and in the second epoch
        assert fit(tmp_path / "ckpt" / f"step={step}.ckpt", save=False) == ref[step:], step
