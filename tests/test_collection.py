"""Collections: many arrays of one schema as one stream (issue 32), zarr as the oracle.

Every row of a batch is ``member_array[index]`` of the member ``batch.members`` names, for
members of different lengths with partial last chunks, in one store or several; a window never
crosses members; each member chunk is read once per epoch; splits by member (and by group key)
are disjoint; ranks deal disjoint samples in equal batch counts; a resumed epoch (same world
size or another) continues exactly; members that do not share the schema are refused by name;
10,000 metadata-only members open, build and reach their first batch fast.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store
from resume_helpers import assert_resumes_exactly

from insitubatch_nodes import (
    Collection,
    Loader,
    concat,
    insitu_pipeline,
    split_by_chunk,
    split_by_member,
)
from insitubatch_nodes.cache.fingerprint import array_fingerprint
from insitubatch_nodes.io.routing import RoutingStore

LENGTHS = [5, 3, 8, 1, 7, 4]  # samples per member: partial last chunks, one shorter than a chunk
SPC = 2
WELLS = ["A/1", "A/1", "A/2", "B/1", "B/1", "B/2"]


def _write_plate(root: Path, lengths: list[int] = LENGTHS, *, labels: bool = True) -> list[str]:
    """Fields ``{row}/{col}/{field}`` with an image ``0`` ``(n, 4, 6)`` chunked ``(2, 4, 3)``
    (two tiles) and a label image ``labels/0`` ``(n, 4, 6)`` chunked ``(1, 4, 6)``; values are
    distinct per member and sample."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    groups = []
    for m, n in enumerate(lengths):
        well = WELLS[m % len(WELLS)]
        path = f"{well}/{m}"
        g = group.create_group(path)
        image = g.create_array("0", shape=(n, 4, 6), chunks=(SPC, 4, 3), dtype="f4", fill_value=0)
        image[:] = 1000 * m + np.arange(n * 24, dtype="f4").reshape(n, 4, 6)
        if labels:
            lab = g.create_array("labels/0", shape=(n, 4, 6), chunks=(1, 4, 6), dtype="u2")
            lab[:] = (m + 1) * 100 + np.arange(n, dtype="u2")[:, None, None]
        groups.append(path)
    return groups


@pytest.fixture(scope="module")
def plate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("plate") / "plate.zarr"
    return root, _write_plate(root)


def _collection(plate: tuple[Path, list[str]], **kw: Any) -> Collection:
    root, groups = plate
    return Collection.from_groups(
        root,
        groups,
        {"image": "0", "labels": "labels/0"},
        keys={"well": [WELLS[m % len(WELLS)] for m in range(len(groups))]},
        **kw,
    )


def _oracle(root: Any, groups: list[str], path: str) -> list[np.ndarray]:
    return [np.asarray(zarr.open_array(root, path=f"{g}/{path}", mode="r")[...]) for g in groups]


def _batches(pipe: Any, epochs: int = 1) -> list[Any]:
    out = []
    loader = Loader(pipe)
    for _ in range(epochs):
        out.extend(loader)
    return out


def test_every_row_is_its_members_zarr_read_for_members_of_different_lengths(
    plate: tuple[Path, list[str]],
) -> None:
    root, groups = plate
    coll = _collection(plate)
    assert len(coll) == len(LENGTHS) and coll.variables == ("image", "labels")
    assert coll.members == tuple(groups)
    images, labels = _oracle(root, groups, "0"), _oracle(root, groups, "labels/0")
    manifest = split_by_member(coll, {"train": list(coll.members)})
    views = {"x": coll["image"], "y": coll["image"].shift(1), "seg": coll["labels"]}
    pipe = insitu_pipeline(coll, manifest, views, batch_size=4, block_chunks=2, seed=3)
    try:
        assert pipe.stages.fetch.gets is None, "one local store: files read on the decode threads"
        seen = []
        for batch in _batches(pipe):
            for r in range(len(batch)):
                m = int(batch.members["x"][r])
                i = int(batch.sample_indices["x"][r])
                assert batch.members["y"][r] == batch.members["seg"][r] == m
                np.testing.assert_array_equal(batch["x"][r], images[m][i])
                np.testing.assert_array_equal(batch["y"][r], images[m][i + 1])
                np.testing.assert_array_equal(batch["seg"][r], labels[m][i])
                assert batch.sample_indices["y"][r] == i + 1
                seen.append((m, i))
            assert batch.members["x"].dtype == np.int64 and batch.members["x"].shape == (
                len(batch),
            )
    finally:
        pipe.close()
    # every (member, index) whose shift stays inside the member, once; none in the padding
    want = {(m, i) for m, n in enumerate(LENGTHS) for i in range(n - 1)}
    assert sorted(seen) == sorted(want)


def test_a_window_never_crosses_members(plate: tuple[Path, list[str]]) -> None:
    root, groups = plate
    coll = _collection(plate)
    images = _oracle(root, groups, "0")
    manifest = split_by_chunk(coll["image"], (1.0, 0.0, 0.0))  # whole chunks of the grid
    pipe = insitu_pipeline(
        coll, manifest, {"w": coll["image"].window([-1, 0, 1])}, batch_size=3, seed=1
    )
    try:
        seen = []
        for batch in _batches(pipe):
            idx = batch.sample_indices["w"]
            assert idx.shape == (len(batch), 3)
            for r in range(len(batch)):
                m = int(batch.members["w"][r])
                np.testing.assert_array_equal(batch["w"][r], images[m][idx[r]])
                seen.append((m, int(idx[r, 1])))
    finally:
        pipe.close()
    want = {(m, i) for m, n in enumerate(LENGTHS) for i in range(1, n - 1)}
    assert sorted(seen) == sorted(want)


def test_an_int_stride_counts_from_each_members_first_sample(
    plate: tuple[Path, list[str]],
) -> None:
    coll = _collection(plate)
    pipe = insitu_pipeline(
        coll, split_by_member(coll, {"train": 1.0}), {"x": coll["image"]}, batch_size=4, stride=3
    )
    try:
        seen = [
            (int(m), int(i))
            for b in _batches(pipe)
            for m, i in zip(b.members["x"], b.sample_indices["x"], strict=True)
        ]
    finally:
        pipe.close()
    assert sorted(seen) == [(m, i) for m, n in enumerate(LENGTHS) for i in range(0, n, 3)]


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "warm-persistent-cache"])
def test_patches_of_a_collection_view_read_their_members(
    plate: tuple[Path, list[str]], tmp_path: Path, cached: bool
) -> None:
    root, groups = plate
    store = counting_store(root)
    coll = _collection((store, groups))  # type: ignore[arg-type]
    images = _oracle(root, groups, "0")
    manifest = split_by_member(coll, {"train": 1.0})
    view = coll["image"].patches({1: 2, 2: 3})
    options: dict[str, Any] = {"cache_dir": tmp_path / "cache", "persist": True} if cached else {}
    runs = []
    for _ in range(2 if cached else 1):  # with a cache: warm it, then read from it
        store.reset_counts()
        pipe = insitu_pipeline(coll, manifest, {"p": view}, batch_size=5, seed=2, **options)
        try:
            seen = []
            for batch in _batches(pipe):
                for r in range(len(batch)):
                    m, i = int(batch.members["p"][r]), int(batch.sample_indices["p"][r])
                    y0, x0 = (int(v) for v in batch.patch_origins["p"][r])
                    want = images[m][i, y0 : y0 + 2, x0 : x0 + 3]
                    np.testing.assert_array_equal(batch["p"][r], want)
                    seen.append((m, i, y0, x0))
        finally:
            pipe.close()
        runs.append((seen, store.chunk_counts()))
    # every window of every member's every sample, once (a 2 x 2 grid of windows per field)
    want_rows = {(m, i, y, x) for m, n in enumerate(LENGTHS) for i in range(n)
                 for y in (0, 2) for x in (0, 3)}  # fmt: skip
    assert sorted(runs[0][0]) == sorted(want_rows)
    assert set(runs[0][1].values()) == {1}  # each member's stored tile once
    if cached:  # the warm cache: the same windows, no object read
        assert runs[1] == (runs[0][0], {}), runs[1][1]


@pytest.fixture(scope="module")
def named_plate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("named") / "plate.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    groups = []
    for m, n in enumerate(LENGTHS):
        g = group.create_group(f"f{m}")
        a = g.create_array(
            "0",
            shape=(n, 4, 6),
            chunks=(SPC, 4, 3),
            dtype="f4",
            dimension_names=("z", "y", "x"),
        )
        a[:] = 1000 * m + np.arange(n * 24, dtype="f4").reshape(n, 4, 6)
        x = g.create_array("x", shape=(6,), chunks=(6,), dtype="f8", dimension_names=("x",))
        x[:] = np.arange(6) * 0.5
        groups.append(f"f{m}")
    return root, groups


@pytest.mark.parametrize("select", ["isel", "sel"])
def test_a_sample_axis_named_and_a_selection_by_name_read_their_members(
    named_plate: tuple[Path, list[str]], select: str
) -> None:
    root, groups = named_plate
    coll = Collection.from_groups(root, groups, {"image": "0"}, sample_axis="z")
    images = _oracle(root, groups, "0")
    view = coll["image"].isel(x=[0, 4]) if select == "isel" else coll["image"].sel(x=[0.0, 2.0])
    pipe = insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"s": view}, batch_size=4)
    try:
        n = 0
        for batch in _batches(pipe):
            for r in range(len(batch)):
                m, i = int(batch.members["s"][r]), int(batch.sample_indices["s"][r])
                np.testing.assert_array_equal(batch["s"][r], images[m][i][:, [0, 4]])
                n += 1
        assert n == sum(LENGTHS)
    finally:
        pipe.close()


def test_members_in_several_stores_are_one_stream(tmp_path: Path) -> None:
    items: list[Any] = []
    oracles = []
    for s, n in enumerate([3, 6, 2]):
        root = tmp_path / f"slide{s}.zarr"
        data = (s + 1) * 100 + np.arange(n * 8, dtype="i4").reshape(n, 2, 4)
        if s == 0:  # the array at a store's root, given by its path
            a = zarr.create_array(root, shape=data.shape, chunks=(2, 2, 4), dtype="i4")
            a[:] = data
            items.append(str(root))
        elif s == 1:  # a zarr.Array
            a = zarr.open_group(root, mode="w").create_array(
                "scene", shape=data.shape, chunks=(2, 2, 4), dtype="i4"
            )
            a[:] = data
            items.append(zarr.open_array(root, path="scene", mode="r"))
        else:  # a (store, path) pair
            a = zarr.open_group(root, mode="w").create_array(
                "img/0", shape=data.shape, chunks=(2, 2, 4), dtype="i4"
            )
            a[:] = data
            items.append((str(root), "img/0"))
        oracles.append(data)
    coll = Collection.from_arrays(items, names=["a", "b", "c"])
    assert isinstance(coll.store, RoutingStore) and coll.members == ("a", "b", "c")
    pipe = insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": coll["data"]})
    try:
        assert pipe.stages.fetch.gets is not None  # each GET routed to its member's store
        seen = []
        for batch in _batches(pipe, epochs=2):
            for r in range(len(batch)):
                m, i = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                np.testing.assert_array_equal(batch["x"][r], oracles[m][i])
                seen.append((m, i))
    finally:
        pipe.close()
    assert sorted(seen) == sorted(2 * [(m, i) for m, n in enumerate([3, 6, 2]) for i in range(n)])


def test_groups_of_several_stores_with_two_variables_are_one_stream(tmp_path: Path) -> None:
    groups: list[Any] = []
    for s in range(2):
        root = tmp_path / f"plate{s}.zarr"
        groups += [(str(root), g) for g in _write_plate(root, [4 - s, 2 + 3 * s])]
    coll = Collection.from_groups(
        None, groups, {"image": "0", "labels": "labels/0"}, names=["a", "b", "c", "d"]
    )
    assert isinstance(coll.store, RoutingStore) and len(coll.store.stores) == 2
    oracles = {
        v: [np.asarray(zarr.open_array(r, path=f"{g}/{p}", mode="r")[...]) for r, g in groups]
        for v, p in (("image", "0"), ("labels", "labels/0"))
    }
    views = {"x": coll["image"], "seg": coll["labels"]}
    pipe = insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), views, batch_size=3)
    try:
        seen = []
        for batch in _batches(pipe):
            for r in range(len(batch)):
                m, i = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                np.testing.assert_array_equal(batch["x"][r], oracles["image"][m][i])
                np.testing.assert_array_equal(batch["seg"][r], oracles["labels"][m][i])
                seen.append((m, i))
    finally:
        pipe.close()
    assert sorted(seen) == [(m, i) for m, n in enumerate([4, 2, 3, 5]) for i in range(n)]


def test_each_member_chunk_is_read_once_per_epoch(plate: tuple[Path, list[str]]) -> None:
    root, groups = plate
    store = counting_store(root)
    coll = Collection.from_groups(store, groups, {"image": "0"})
    train = [g for m, g in enumerate(groups) if m % 2 == 0]
    manifest = split_by_member(coll, {"train": train, "val": [g for g in groups if g not in train]})
    pipe = insitu_pipeline(
        store,
        manifest,
        {"x": coll["image"]},
        batch_size=3,
        block_chunks=2,
        cache_budget_bytes=1 << 20,
    )
    try:
        loader = Loader(pipe)
        for epoch in range(2):
            store.reset_counts()
            rows = sum(len(b) for b in loader)
            counts = store.chunk_counts()
            want = {
                f"{groups[m]}/0/c/{c}/0/{t}"
                for m in range(0, len(groups), 2)
                for c in range(math.ceil(LENGTHS[m] / SPC))
                for t in range(2)
            }
            assert rows == sum(LENGTHS[m] for m in range(0, len(groups), 2))
            assert set(counts) <= want, f"epoch {epoch}: read {sorted(set(counts) - want)}"
            assert set(counts.values()) <= {1}, f"epoch {epoch}: a chunk read twice"
            if epoch == 0:  # the first epoch reads every chunk of the split (later: what the
                assert set(counts) == want  # pool did not keep)
    finally:
        pipe.close()


def test_splits_by_member_and_by_well_are_disjoint(plate: tuple[Path, list[str]]) -> None:
    coll = _collection(plate)
    members = coll["image"].members
    assert members is not None

    def owners(manifest: Any) -> dict[str, set[int]]:
        out = {}
        for split in ("train", "val", "test"):
            samples = (
                np.asarray(manifest.chunks(split), dtype=np.int64) * manifest.samples_per_chunk
            )
            out[split] = set(members.member_of(samples).tolist())
        return out

    listed = split_by_member(coll, {"train": list(coll.members[:4]), "val": [coll.members[4]]})
    got = owners(listed)
    assert got == {"train": {0, 1, 2, 3}, "val": {4}, "test": set()}
    for seed in range(5):
        by_member = owners(split_by_member(coll, {"train": 0.5, "val": 0.5}, seed=seed))
        assert not by_member["train"] & by_member["val"]
        assert by_member["train"] | by_member["val"] == set(range(len(coll)))
        by_well = owners(split_by_member(coll, {"train": 0.5, "val": 0.5}, by="well", seed=seed))
        wells = {s: {coll.keys["well"][m] for m in ms} for s, ms in by_well.items()}
        assert not wells["train"] & wells["val"], f"seed {seed}: a well in two splits"
        assert by_well["train"] | by_well["val"] == set(range(len(coll)))
    # a split's chunks are whole members: every chunk of the member, none of another
    wells = owners(split_by_member(coll, {"val": ["A/1"], "train": ["A/2", "B/1"]}, by="well"))
    assert wells["val"] == {0, 1} and wells["train"] == {2, 3, 4}


def test_split_by_member_refuses_a_member_in_two_splits_and_unknown_names(
    plate: tuple[Path, list[str]],
) -> None:
    coll = _collection(plate)
    first = coll.members[0]
    with pytest.raises(ValueError, match=f"{first!r} is in both 'train' and 'val'"):
        split_by_member(coll, {"train": [first], "val": [first]})
    with pytest.raises(KeyError, match="'Z/9', which is no member"):
        split_by_member(coll, {"train": ["Z/9"]})
    with pytest.raises(KeyError, match="no member key 'plate'"):
        split_by_member(coll, {"train": 1.0}, by="plate")
    with pytest.raises(ValueError, match="sum to at most 1"):
        split_by_member(coll, {"train": 0.8, "val": 0.5})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_deal_disjoint_samples_in_equal_batch_counts(
    plate: tuple[Path, list[str]], world: int
) -> None:
    root, groups = plate
    coll = _collection(plate)
    images = _oracle(root, groups, "0")
    manifest = split_by_member(coll, {"train": 1.0})
    views = {"x": coll["image"], "y": coll["image"].shift(1)}
    valid = {(m, i) for m, n in enumerate(LENGTHS) for i in range(n - 1)}
    per_rank, counts = [], []
    for rank in range(world):
        pipe = insitu_pipeline(
            coll, manifest, views, batch_size=3, seed=5, rank=rank, world_size=world
        )
        try:
            mine, batches = [], 0
            for batch in _batches(pipe):
                batches += 1
                for r in range(len(batch)):
                    m, i = int(batch.members["x"][r]), int(batch.sample_indices["x"][r])
                    np.testing.assert_array_equal(batch["y"][r], images[m][i + 1])
                    mine.append((m, i))
            assert batches == len(pipe)
            per_rank.append(mine)
            counts.append(batches)
        finally:
            pipe.close()
    flat = [s for mine in per_rank for s in mine]
    assert len(flat) == len(set(flat)), "ranks share a sample"
    assert set(flat) <= valid and len(valid) - len(flat) <= world - 1
    assert len(set(counts)) == 1, f"unequal batch counts {counts}"


def _records(batches: list[Any]) -> list[tuple]:
    return [
        (b.epoch, b.index, b.members["x"].tolist(), b.sample_indices["x"].tolist()) for b in batches
    ]


def test_a_resumed_epoch_continues_exactly(plate: tuple[Path, list[str]]) -> None:
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": 1.0})
    views = {"x": coll["image"], "y": coll["image"].shift(1)}

    def build() -> Any:
        return insitu_pipeline(coll, manifest, views, batch_size=3, block_chunks=2, seed=9)

    pipe = build()
    try:
        ref = _records(_batches(pipe, epochs=2))
    finally:
        pipe.close()
    per_epoch = len(ref) // 2
    assert_resumes_exactly(build, _records, ref, (1, per_epoch - 1, per_epoch + 2))


def test_an_epoch_resumed_on_another_world_size_delivers_each_sample_once(
    plate: tuple[Path, list[str]],
) -> None:
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": 1.0})
    views = {"x": coll["image"]}
    valid = {(m, i) for m, n in enumerate(LENGTHS) for i in range(n)}

    def build(rank: int, world: int) -> Any:
        return insitu_pipeline(
            coll, manifest, views, batch_size=2, seed=4, rank=rank, world_size=world
        )

    k, delivered, state = 2, [], None
    for rank in range(2):  # two ranks deliver k batches each; rank 0's state is the checkpoint
        pipe = build(rank, 2)
        try:
            loader = Loader(pipe)
            it = iter(loader)
            for _ in range(k):
                b = next(it)
                delivered += list(
                    zip(b.members["x"].tolist(), b.sample_indices["x"].tolist(), strict=True)
                )
            if rank == 0:
                state = loader.state_dict()
        finally:
            pipe.close()
    counts = []
    for rank in range(3):
        pipe = build(rank, 3)
        try:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            batches = list(loader)
            counts.append(len(batches))
            for b in batches:
                delivered += list(
                    zip(b.members["x"].tolist(), b.sample_indices["x"].tolist(), strict=True)
                )
        finally:
            pipe.close()
    assert len(delivered) == len(set(delivered)), "a sample delivered twice"
    assert set(delivered) <= valid and len(valid) - len(delivered) <= 3 - 1
    assert len(set(counts)) == 1, f"unequal batch counts {counts}"


def test_members_that_do_not_share_the_schema_are_refused_by_name(tmp_path: Path) -> None:
    def plate_with(**odd: Any) -> tuple[Path, list[str]]:
        root = tmp_path / f"odd-{len(list(tmp_path.iterdir()))}.zarr"
        group = zarr.open_group(root, mode="w", zarr_format=3)
        for m in range(3):
            kw: dict[str, Any] = {"shape": (4, 4, 6), "chunks": (2, 4, 3), "dtype": "f4"}
            if m == 2:
                kw.update(odd)
            group.create_array(f"f{m}/0", **kw)
        return root, ["f0", "f1", "f2"]

    for odd, field in [
        ({"dtype": "f8"}, "dtype"),
        ({"shape": (4, 4, 7)}, "field shape"),
        ({"chunks": (1, 4, 3)}, "chunk shape"),
        ({"compressors": None}, "codecs"),
    ]:
        root, groups = plate_with(**odd)
        with pytest.raises(ValueError, match=f"member 'f2', variable 'image': its {field} "):
            Collection.from_groups(root, groups, {"image": "0"})
    root, groups = plate_with()
    with pytest.raises(FileNotFoundError, match="member 'f9' has no array for variable 'image'"):
        Collection.from_groups(root, [*groups, "f9"], {"image": "0"})
    # every variable of a member has the same length
    zarr.open_group(root, mode="a").create_array("f1/labels", shape=(3, 4, 6), chunks=(1, 4, 6),
                                                 dtype="u1")  # fmt: skip
    for m in (0, 2):
        zarr.open_group(root, mode="a").create_array(
            f"f{m}/labels", shape=(4, 4, 6), chunks=(1, 4, 6), dtype="u1"
        )
    with pytest.raises(ValueError, match="member 'f1' has 4 samples in variable 'image' but 3"):
        Collection.from_groups(root, groups, {"image": "0", "labels": "labels"})


def test_members_in_two_zarr_formats_are_refused_naming_the_formats_not_as_absent(
    tmp_path: Path,
) -> None:
    # slides from two sources, one written as zarr v3 and one as v2: the v2 array is there
    # (zarr opens it), so "has no array" would send the user looking for a missing file
    for name, fmt in (("v3.zarr", 3), ("v2.zarr", 2)):
        group = zarr.open_group(tmp_path / name, mode="w", zarr_format=fmt)
        group.create_array("scene/image", shape=(4, 4, 6), chunks=(2, 4, 3), dtype="f4")
    assert zarr.open_array(tmp_path / "v2.zarr", path="scene/image").metadata.zarr_format == 2
    groups = [(tmp_path / "v3.zarr", "scene"), (tmp_path / "v2.zarr", "scene")]
    with pytest.raises(ValueError, match=r"member 'b'.* zarr v2 array.*member 'a'.* v3"):
        Collection.from_groups(None, groups, {"image": "image"}, names=["a", "b"])


def test_time_options_on_members_without_times_and_what_is_not_supported_are_refused(
    plate: tuple[Path, list[str]],
) -> None:
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": 1.0})
    with pytest.raises(ValueError, match=r"need the time coordinate of .* it has none"):
        insitu_pipeline(coll, manifest, {"x": coll["image"]}, stride=np.timedelta64(6, "h"))
    with pytest.raises(KeyError, match="no coordinate array 'time'"):
        insitu_pipeline(coll, manifest, {"x": coll["image"]}, coords=["time"])
    with pytest.raises(FileNotFoundError, match="pass the collection itself"):
        insitu_pipeline(plate[0].parent, manifest, {"x": coll["image"]})


def test_absent_objects_of_any_member_are_skipped_and_counted_with_drop(tmp_path: Path) -> None:
    root = tmp_path / "holes.zarr"
    groups = _write_plate(root)
    # member 0 loses its image chunk 1 (samples 2, 3), tile 1 only; member 2 its label of
    # sample 5 (labels are chunked one sample per object)
    (root / groups[0] / "0" / "c" / "1" / "0" / "1").unlink()
    (root / groups[2] / "labels" / "0" / "c" / "5" / "0" / "0").unlink()
    absent = {(0, 2), (0, 3), (2, 5)}
    store = counting_store(root)
    coll = Collection.from_groups(store, groups, {"image": "0", "labels": "labels/0"})
    manifest = split_by_member(coll, {"train": 1.0})
    views = {"x": coll["image"], "y": coll["labels"], "next": coll["image"].shift(1)}
    images, labels = _oracle(root, groups, "0"), _oracle(root, groups, "labels/0")
    pipe = insitu_pipeline(coll, manifest, views, missing_objects="drop", batch_size=4, seed=1)
    dropped = pipe.stages.plan.dropped
    store.reset_counts()
    got = []
    for batch in _batches(pipe):
        for r, (m, i) in enumerate(zip(batch.members["x"], batch.sample_indices["x"], strict=True)):
            m, i = int(m), int(i)
            np.testing.assert_array_equal(batch["x"][r], images[m][i])
            np.testing.assert_array_equal(batch["y"][r], labels[m][i])
            np.testing.assert_array_equal(batch["next"][r], images[m][i + 1])
            got.append((m, i))
    pipe.close()
    # every anchor but those reading an absent object (itself or its next step), once
    want = [
        (m, i)
        for m, n in enumerate(LENGTHS)
        for i in range(n - 1)
        if (m, i) not in absent and (m, i + 1) not in absent
    ]
    assert sorted(got) == want
    assert dropped["absent_object"] == 5  # (0, 1), (0, 2), (0, 3), (2, 4), (2, 5)
    assert not any(key.startswith(f"{groups[0]}/0/c/1/") for key in store.chunk_counts())


def test_a_changed_member_list_changes_the_cache_fingerprint_and_a_warm_cache_reads_nothing(
    plate: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, groups = plate
    coll = _collection(plate)
    fewer = Collection.from_groups(root, groups[:-1], {"image": "0", "labels": "labels/0"})
    g, h = coll["image"], fewer["image"]
    assert g.path != h.path
    same_path = Collection.from_groups(root, groups, {"image": "0", "labels": "labels/0"})
    assert array_fingerprint(g, g, []) == array_fingerprint(same_path["image"], g, [])
    assert array_fingerprint(h, h, []) != array_fingerprint(g, g, [])
    # a persistent cache: the second pipeline over the same collection fetches nothing
    store = counting_store(root)
    coll = Collection.from_groups(store, groups, {"image": "0"})
    manifest = split_by_member(coll, {"train": 1.0})
    for run in range(2):
        store.reset_counts()
        pipe = insitu_pipeline(
            store,
            manifest,
            {"x": coll["image"]},
            batch_size=4,
            cache_dir=tmp_path / "cache",
            persist=True,
        )
        try:
            rows = sum(len(b) for b in Loader(pipe))
        finally:
            pipe.close()
        assert rows == sum(LENGTHS)
        if run == 0:
            assert store.chunk_counts()
        else:
            assert store.chunk_counts() == {}, "a warm cache read the store"


def _metadata_only_members(root: Path, n: int) -> list[str]:
    """``n`` tiny arrays (metadata only, no chunk written): one written by zarr, its metadata
    document copied to the others (writing 10,000 arrays through zarr takes ~20 s here)."""
    zarr.open_group(root, mode="w", zarr_format=3)
    zarr.open_group(root, mode="a").create_array(
        "f0", shape=(4, 16, 16), chunks=(1, 16, 16), dtype="u2", fill_value=7
    )
    doc = (root / "f0" / "zarr.json").read_bytes()
    for i in range(1, n):
        (root / f"f{i}").mkdir()
        (root / f"f{i}" / "zarr.json").write_bytes(doc)
    return [f"f{i}" for i in range(n)]


def test_ten_thousand_metadata_only_members_open_build_and_reach_a_first_batch_fast(
    tmp_path: Path,
) -> None:
    n = 10_000
    groups = _metadata_only_members(tmp_path / "many.zarr", n)
    t0 = time.perf_counter()
    coll = Collection.from_groups(tmp_path / "many.zarr", groups, {"image": ""})
    t1 = time.perf_counter()
    pipe = insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": coll["image"]})
    t2 = time.perf_counter()
    try:
        batch = next(iter(Loader(pipe)))
        t3 = time.perf_counter()
        assert len(pipe) == math.ceil(4 * n / 32)
    finally:
        pipe.close()
    assert np.all(batch["x"] == 7) and len(set(batch.members["x"].tolist())) > 1
    print(f"\n{n} members: open {t1 - t0:.2f} s, build {t2 - t1:.2f} s, first {t3 - t2:.3f} s")
    # generous bounds for a shared 2-core machine (issue 32's targets at 13,824: 10 s, 2 s, 1 s)
    assert t1 - t0 < 30 and t2 - t1 < 6 and t3 - t2 < 3


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_lightning_module_trains_and_validates_on_disjoint_members(
    plate: tuple[Path, list[str]],
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": 0.5, "val": 0.5}, by="well", seed=1)
    for splits in (manifest, (0.5, 0.5, 0.0)):
        dm = InSituDataModule(coll, {"x": coll["image"]}, splits, coords=(), transform=lambda b: b)
        try:
            dm.setup()
            seen = {}
            for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
                seen[split] = {int(m) for b in loader for m in b.members["x"]}
            assert seen["train"] and seen["val"] and not seen["train"] & seen["val"]
        finally:
            dm.teardown()


def test_a_collection_view_lays_members_end_to_end_on_chunk_boundaries_and_names_their_keys(
    plate: tuple[Path, list[str]],
) -> None:
    coll = _collection(plate)
    g = coll["image"]
    assert g.members is not None and g.key_template is None
    padded = sum(math.ceil(n / SPC) * SPC for n in LENGTHS)
    assert g.shape == (padded, 4, 6) and g.chunks == (SPC, 4, 3)
    # every stored key the virtual array names is its member's own
    for c in range(g.n_chunks):
        m = int(g.members.chunk_member[c])
        local = c - int(g.members.chunk_base[m])
        assert g.store_key(c, (0, 1)) == f"{coll.paths('image')[m]}/c/{local}/0/1"
    # the labels (1 sample a chunk) share the image's member starts (2 a chunk)
    lab = coll["labels"]
    labels = lab.members
    assert labels is not None and np.array_equal(labels.sample_base, g.members.sample_base)
    # an untiled variable's keys as the decode threads' lean loop writes them: the same keys
    whole = labels.whole_chunk_key(lab.metadata, lab.ndim, lab.sample_axis)
    assert [whole(c) for c in range(lab.n_chunks)] == [
        lab.store_key(c) for c in range(lab.n_chunks)
    ]


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_lightning_module_takes_one_collection_per_split_and_refuses_a_shared_member(
    plate: tuple[Path, list[str]],
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    coll = _collection(plate)
    train, val = coll.subset(list(coll.members[:4])), coll.subset(list(coll.members[4:]))
    assert train.members == coll.members[:4] and list(val.keys["well"]) == ["B/1", "B/2"]
    dm = InSituDataModule(
        None, ["image"], {"train": train, "val": val}, coords=(), transform=lambda b: b
    )
    try:
        dm.setup()
        got = {}
        for split, loader, source in (
            ("train", dm.train_dataloader(), train),
            ("val", dm.val_dataloader(), val),
        ):
            got[split] = sorted(
                (source.members[int(m)], int(i))
                for b in loader
                for m, i in zip(b.members["image"], b.sample_indices["image"], strict=True)
            )
        for split, source in (("train", train), ("val", val)):
            want = [(n, i) for n, k in zip(source.members, source.lengths, strict=True)
                    for i in range(k)]  # fmt: skip
            assert got[split] == sorted(want)
    finally:
        dm.teardown()
    shared = InSituDataModule(
        None, ["image"], {"train": train, "val": coll.subset([coll.members[3]])}
    )
    with pytest.raises(ValueError, match="is in both the 'train' and the 'val' collection"):
        shared.setup()


def _period(root: Path, start: int, n: int, step: int = 6) -> np.ndarray:
    """A store of ``t2m (time, lat, lon)`` chunked 4 along time, with CF ``time`` in hours:
    ``n`` steps of ``step`` hours from hour ``start``; returns the data."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    data = start + np.arange(n * 6, dtype="f4").reshape(n, 2, 3) / 10
    t2m = group.create_array(
        "t2m", shape=data.shape, chunks=(4, 2, 3), dtype="f4",
        dimension_names=("time", "lat", "lon"),
    )  # fmt: skip
    t2m[:] = data
    time_ = group.create_array(
        "time", shape=(n,), chunks=(n,), dtype="i8", dimension_names=("time",)
    )
    time_[:] = start + step * np.arange(n)
    time_.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})
    return data


def test_stores_concatenated_along_time_are_one_continuous_axis(tmp_path: Path) -> None:
    parts = [(0, 8), (48, 4), (72, 5)]  # hours from, steps: 6-hourly, continuing
    data = np.concatenate(
        [_period(tmp_path / f"p{k}.zarr", s, n) for k, (s, n) in enumerate(parts)]
    )
    stores = [tmp_path / f"p{k}.zarr" for k in range(3)]
    coll = Collection.concat(stores, ["t2m"], dim="time", names=["early", "main", "recent"])
    assert coll["t2m"].shape == (17, 2, 3)  # no padding: every store but the last whole chunks
    view = coll["t2m"].window([-1, 0])
    pipe = insitu_pipeline(coll, split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0)), {"w": view})
    try:
        anchors = []
        starts = np.cumsum([0] + [n for _, n in parts])
        for batch in _batches(pipe):
            idx = batch.sample_indices["w"]  # one index along the joined axis
            np.testing.assert_array_equal(batch["w"], data[idx])
            assert batch.members["w"].shape == idx.shape
            np.testing.assert_array_equal(
                batch.members["w"], np.searchsorted(starts, idx, "right") - 1
            )
            anchors += idx[:, 1].tolist()
    finally:
        pipe.close()
    assert sorted(anchors) == list(range(1, 17))  # windows run across the stores' edges


def test_concatenated_stores_that_leave_a_gap_or_overlap_or_end_mid_chunk_are_refused(
    tmp_path: Path,
) -> None:
    _period(tmp_path / "a.zarr", 0, 8)
    _period(tmp_path / "gap.zarr", 54, 4)  # 48 is next: 54 leaves a gap
    _period(tmp_path / "overlap.zarr", 42, 4)
    _period(tmp_path / "ragged.zarr", 0, 6)  # 6 steps: not whole chunks of 4
    _period(tmp_path / "after.zarr", 36, 4)
    _period(tmp_path / "hourly.zarr", 48, 4, step=1)
    a = tmp_path / "a.zarr"
    with pytest.raises(
        ValueError, match=r"ends at 2000-01-02T18:00.* starts at 2000-01-03T06:00.*gap"
    ):
        concat([a, tmp_path / "gap.zarr"], ["t2m"], dim="time")  # the top-level name
    with pytest.raises(ValueError, match=r"starts at 2000-01-02T18:00.*overlap"):
        Collection.concat([a, tmp_path / "overlap.zarr"], ["t2m"])
    with pytest.raises(
        ValueError, match=r"ragged.zarr. holds 6 samples, not a whole number of chunks"
    ):
        Collection.concat([tmp_path / "ragged.zarr", tmp_path / "after.zarr"], ["t2m"])
    with pytest.raises(ValueError, match=r"steps 3600 s, .* 21600 s"):
        Collection.concat([a, tmp_path / "hourly.zarr"], ["t2m"])


def test_a_split_whose_members_are_shorter_than_the_window_says_so_not_to_cross_the_split(
    plate: tuple[Path, list[str]],
) -> None:
    # member "B/1/3" holds one sample: a shifted view has no anchor in it. The error used to
    # suggest cross_split_windows=True, which cannot help: a window never leaves its member
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": ["B/1/3"], "val": ["A/1/0"]})
    views = {"x": coll["image"], "y": coll["image"].shift(1)}
    for cross in (False, True):
        with pytest.raises(ValueError, match=r"never leaves its member.*at most 1 sample") as e:
            insitu_pipeline(coll, manifest, views, cross_split_windows=cross)
        assert "cross_split_windows=True to" not in str(e.value)


def test_an_unreadable_object_of_a_member_in_another_store_is_named_by_member_and_store(
    tmp_path: Path,
) -> None:
    # the error used to say only "store key 's1/img/c/1/0/0' in store RoutingStore(...)":
    # which member, and which of the stores is s1, was left to the user
    from insitubatch_nodes.errors import ChunkReadError

    for m in range(3):
        image = zarr.create_array(
            tmp_path / f"m{m}.zarr", name="img", shape=(5, 2, 3), chunks=(2, 2, 3), dtype="f4"
        )
        image[:] = m
    (tmp_path / "m1.zarr" / "img" / "c" / "1" / "0" / "0").write_bytes(b"not zstd")
    coll = Collection.from_arrays(
        [(tmp_path / f"m{m}.zarr", "img") for m in range(3)], names=["a", "b", "c"]
    )
    manifest = split_by_member(coll, {"train": ["a", "b", "c"]})
    pipe = insitu_pipeline(coll, manifest, {"x": coll["data"]}, batch_size=4)
    with pipe, pytest.raises(ChunkReadError) as caught:
        list(Loader(pipe))
    message = str(caught.value)
    assert "member 'b'" in message
    assert f"key 'img/c/1/0/0' of routed store s1 ({tmp_path / 'm1.zarr'})" in message


def test_a_stack_of_a_collections_variables_names_each_rows_member_and_index_within_it(
    tmp_path: Path,
) -> None:
    # a stack label used to carry no batch.members entry and virtual sample indices (member
    # "q" starting at 6, past member "p"'s padding), unlike the collection's plain labels
    from insitubatch_nodes import stack

    groups, images, levels = [], [], []
    for m, n in enumerate((5, 2, 6)):
        group = zarr.open_group(tmp_path / f"g{m}.zarr", mode="w")
        image = np.random.default_rng(m).random((n, 4, 5)).astype("f4")
        level = np.random.default_rng(m + 9).random((n, 3, 4, 5)).astype("f4")
        group.create_array("s/a", shape=image.shape, chunks=(2, 4, 5), dtype="f4")[:] = image
        group.create_array("s/b", shape=level.shape, chunks=(3, 3, 2, 5), dtype="f4")[:] = level
        groups.append((tmp_path / f"g{m}.zarr", "s"))
        images.append(image)
        levels.append(level)
    coll = Collection.from_groups(None, groups, {"a": "a", "b": "b"}, names=["p", "q", "r"])
    manifest = split_by_member(coll, {"train": ["p", "q", "r"]})
    views = {"s": stack({"a": coll["a"], "b": coll["b"]}), "x": coll["a"]}
    seen = []
    with insitu_pipeline(coll, manifest, views, batch_size=3) as pipe:
        for batch in Loader(pipe):
            np.testing.assert_array_equal(batch.members["s"], batch.members["x"])
            np.testing.assert_array_equal(batch.sample_indices["s"], batch.sample_indices["x"])
            for row, (m, i) in enumerate(
                zip(batch.members["s"], batch.sample_indices["s"], strict=True)
            ):
                want = np.concatenate([images[m][i][None], levels[m][i]])
                np.testing.assert_array_equal(batch["s"][row], want)
                seen.append((int(m), int(i)))
    assert sorted(seen) == [(m, i) for m, n in enumerate((5, 2, 6)) for i in range(n)]


def test_a_collections_variables_given_by_name_are_its_views(
    plate: tuple[Path, list[str]],
) -> None:
    # insitu_pipeline(coll, manifest, ["image"]) used to look for an array "image" in the
    # collection's store ("no array named ['image'] ..."), though the DataModule takes names
    coll = _collection(plate)
    manifest = split_by_member(coll, {"train": list(coll.members)})
    root, groups = plate
    images = _oracle(root, groups, "0")
    with insitu_pipeline(coll, manifest, ["image", "labels"], batch_size=4) as pipe:
        batch = next(iter(Loader(pipe)))
    for row, (m, i) in enumerate(
        zip(batch.members["image"], batch.sample_indices["image"], strict=True)
    ):
        np.testing.assert_array_equal(batch["image"][row], images[m][i])
    assert set(batch.arrays) == {"image", "labels"}
    with pytest.raises(KeyError, match="no variable 'nope'; the variables are"):
        insitu_pipeline(coll, manifest, ["nope"])


def test_a_member_path_that_names_a_group_says_it_is_a_group_not_that_it_is_absent(
    tmp_path: Path,
) -> None:
    group = zarr.open_group(tmp_path / "a.zarr", mode="w")
    group.create_array("scene/image", shape=(4, 2, 3), chunks=(2, 2, 3), dtype="f4")
    with pytest.raises(ValueError, match=r"'scene' .* is a group, not an array.*scene/image"):
        Collection.from_arrays([(tmp_path / "a.zarr", "scene")])


def test_a_view_of_another_collection_is_refused_not_read_from_the_pipelines_collection(
    tmp_path: Path,
) -> None:
    # two collections laid out alike (members s0/img, s1/img of their routing stores): a view
    # of the second in a pipeline over the first used to deliver the FIRST one's data
    for prefix, scale in (("x", 1), ("y", 10)):
        for m in range(2):
            array = zarr.create_array(
                tmp_path / f"{prefix}{m}.zarr", name="img", shape=(4, 2, 3), chunks=(2, 2, 3),
                dtype="f4",
            )  # fmt: skip
            array[:] = scale * (m + 1)
    first = Collection.from_arrays([(tmp_path / f"x{m}.zarr", "img") for m in range(2)])
    second = Collection.from_arrays([(tmp_path / f"y{m}.zarr", "img") for m in range(2)])
    manifest = split_by_member(first, {"train": list(first.members)})
    views = {"a": first["data"], "b": second["data"]}
    for store in (first, first.store):
        with pytest.raises(ValueError, match=r"views of .*collection-\w+.* and .*collection-"):
            insitu_pipeline(store, manifest, views)
    with pytest.raises(ValueError, match=rf"are of {second.name}, but the pipeline reads"):
        insitu_pipeline(first, manifest, {"b": second["data"]})


def test_the_members_coordinates_are_read_many_at_a_time_and_each_is_the_members_own(
    tmp_path: Path,
) -> None:
    # One member after another, each member's coordinate read was a round trip after a round
    # trip: 56 ms a member over S3 with 10 ms of latency, minutes for a plate of 10,000 fields
    root, n = tmp_path / "scenes.zarr", 24
    group = zarr.open_group(str(root), mode="w", zarr_format=3)
    for i in range(n):
        scene = group.create_group(f"s{i}")
        x = scene.create_array(
            "x", shape=(8, 4, 4), chunks=(4, 4, 4), dtype="f4", dimension_names=("time", "y", "x")
        )
        x[...] = i
        t = scene.create_array("time", shape=(8,), dtype="i8", dimension_names=("time",))
        t[...] = np.arange(8) * 6 + i * 1000
        t.attrs["units"] = "hours since 2000-01-01"
    store = counting_store(root, delay=0.05)  # every chunk GET waits 50 ms, as on a far store
    coll = Collection.from_groups(store, [f"s{i}" for i in range(n)], {"x": "x"})
    store.reset_counts()
    pipe = insitu_pipeline(
        coll, split_by_member(coll, {"train": 1.0}), {"x": coll["x"]}, batch_size=8,
        coords=["time"], shuffle=False,
    )  # fmt: skip
    # each member's time coordinate as zarr reads it, read once (not once a row)
    stored: dict[int, np.ndarray] = {}
    try:
        assert store.peak > 1, "the members' coordinates were read one at a time"
        for batch in Loader(pipe):
            rows = zip(batch.members["x"].tolist(), batch.sample_indices["x"].tolist(), strict=True)
            for m in set(batch.members["x"].tolist()) - set(stored):
                stored[m] = zarr.open_array(str(root / f"s{m}" / "time"))[...]
            want = [stored[m][i] for m, i in rows]
            got = (batch.coords["x"]["time"] - np.datetime64("2000-01-01")) // np.timedelta64(
                1, "h"
            )
            assert got.tolist() == want
    finally:
        pipe.close()
