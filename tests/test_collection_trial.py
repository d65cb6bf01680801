"""Wrong answers a black-box trial of collections found (2026-12-06), each a claim checked
against zarr's own read of the member and index a batch names (the oracle).

The trial built thousands of small cases (plates written by ome-zarr-py, members in several
stores, concatenations and joins, zarr v2 and v3, sharded, ranks, resume) and compared every
delivered row with zarr; the cases kept here are the ones that delivered a wrong row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Collection,
    Loader,
    concat,
    insitu_pipeline,
    open_plate,
    split_by_chunk,
    split_by_member,
)
from insitubatch_nodes.synthetic import make_plate_metadata_only


def _members(root: Path, lengths: list[int], *, shards: int | None) -> list[str]:
    """Members ``m{i}`` of a v3 group: ``a`` ``(n, 1, 2)`` chunked 3 samples (in shards of
    ``shards`` samples, if given) and ``b`` like it, unsharded; values distinct per member,
    sample and position."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for m, n in enumerate(lengths):
        for var, base in (("a", 0), ("b", 500)):
            kw: dict[str, Any] = {"shards": (shards, 1, 2)} if shards and var == "a" else {}
            arr = group.create_array(
                f"m{m}/{var}", shape=(n, 1, 2), chunks=(3, 1, 2), dtype="f4",
                dimension_names=("z", "y", "x"), **kw,
            )  # fmt: skip
            arr[:] = np.arange(n * 2, dtype="f4").reshape(n, 1, 2) + 1000 * m + base
    return [f"m{m}" for m in range(len(lengths))]


def test_a_plain_label_beside_a_patched_one_holds_each_rows_own_sample(tmp_path: Path) -> None:
    # a patched view makes several rows of one sample (one per window), so a chunk's rows in a
    # batch may repeat a sample: within [0, 0, 1, 4, 4] spans 5 rows from 0 to 4, which the
    # gather took for 5 consecutive samples and copied samples 0..4 (rows 2-4 wrong, silently)
    root = tmp_path / "plate.zarr"
    lengths = [9, 5, 7]
    groups = _members(root, lengths, shards=6)
    oracle = [zarr.open_array(root, path=f"{g}/a", mode="r")[...] for g in groups]
    coll = Collection.from_groups(root, groups, {"a": "a", "b": "b"}, sample_axis="z")
    views = {"whole": coll["a"], "strip": coll["b"].patches({"x": 1})}
    manifest = split_by_member(coll, {"train": 1.0})
    for seed in range(4):
        seen = []
        with insitu_pipeline(coll, manifest, views, batch_size=5, block_chunks=2,
                             seed=seed) as pipe:  # fmt: skip
            for batch in Loader(pipe):
                for r in range(len(batch)):
                    m, i = int(batch.members["whole"][r]), int(batch.sample_indices["whole"][r])
                    assert int(batch.members["strip"][r]) == m
                    assert int(batch.sample_indices["strip"][r]) == i
                    np.testing.assert_array_equal(batch["whole"][r], oracle[m][i])
                    seen.append((m, i, int(batch.patch_origins["strip"][r][0])))
        want = {(m, i, x) for m, n in enumerate(lengths) for i in range(n) for x in (0, 1)}
        assert sorted(seen) == sorted(want)


def test_a_split_of_another_collection_is_refused_where_its_members_are_others(
    tmp_path: Path,
) -> None:
    # two collections of the same fields, listed in another order, lay their members out
    # alike; a split_by_member manifest of one, given with the other's views, made its
    # train split read the other's member 0 ('m2', in val): a silent leak across splits
    root = tmp_path / "plate.zarr"
    groups = _members(root, [6, 6, 6], shards=None)
    listed = Collection.from_groups(root, groups, {"a": "a"}, sample_axis="z")
    reversed_ = Collection.from_groups(root, groups[::-1], {"a": "a"}, sample_axis="z")
    manifest = split_by_member(listed, {"train": ["m0"], "val": ["m1", "m2"]})
    with pytest.raises(ValueError, match=r"member 0 is 'm0'.*'m2'.*split the collection"):
        insitu_pipeline(reversed_, manifest, {"x": reversed_["a"]}, batch_size=4)
    # the same fields opened again in the same order (another variable, another level: other
    # array paths) are the same members: the split holds there
    again = Collection.from_groups(root, groups, {"b": "b"}, sample_axis="z")
    with insitu_pipeline(again, manifest, {"x": again["b"]}, batch_size=4) as pipe:
        rows = [(int(m), int(i)) for b in Loader(pipe) for m, i in
                zip(b.members["x"], b.sample_indices["x"], strict=True)]  # fmt: skip
    assert sorted(rows) == [(0, i) for i in range(6)]


def _period(root: Path, start: int, n: int) -> str:
    """A v3 store of ``x`` ``(n, 2)`` chunked 2 steps, 6-hourly from hour ``start`` (CF time
    beside it); ``x[i] = [hour, hour + 0.5]``, so every row says its own time."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    hours = start + 6 * np.arange(n)
    x = group.create_array("x", shape=(n, 2), chunks=(2, 2), dtype="f8",
                           dimension_names=("time", "c"))  # fmt: skip
    x[:] = hours[:, None] + np.array([0.0, 0.5])
    time = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8", fill_value=-1,
                              dimension_names=("time",))  # fmt: skip
    time[:] = hours
    time.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})
    return str(root)


def test_a_subset_of_a_concatenation_keeps_one_timeline_or_is_refused(tmp_path: Path) -> None:
    # subset() of a concatenation kept it one continuous axis whatever the names: reversed,
    # the window [-1, 0] at the first step of the (earlier) second store read the last step
    # of the (later) first store as the step before, with its times going back a day, silently
    stores = [_period(tmp_path / f"p{k}.zarr", 24 * k, 4) for k in range(3)]
    coll = concat(stores, ["x"])
    for names in ([stores[1], stores[0]], [stores[0], stores[2]]):
        with pytest.raises(ValueError, match=r"consecutive members in order.*concat"):
            coll.subset(names)
    tail = coll.subset(stores[1:])  # consecutive, in order: still one timeline
    view = tail["x"].window([-1, 0])
    manifest = split_by_chunk(tail["x"], (1.0, 0.0, 0.0))
    with insitu_pipeline(tail, manifest, {"w": view}, coords=["time"], batch_size=3) as pipe:
        hours = sorted(tuple(float(v) for v in row[:, 0]) for b in Loader(pipe) for row in b["w"])
    assert hours == [(h - 6.0, float(h)) for h in range(30, 72, 6)]


def test_stores_given_out_of_time_order_are_refused_as_such(tmp_path: Path) -> None:
    # the refusal said the stores "overlap" and offered overlap="first" or "last", which
    # cannot help: the later store was listed first
    early, late = (_period(tmp_path / f"p{k}.zarr", 24 * k, 4) for k in range(2))
    with pytest.raises(ValueError, match=r"starts at .* before .*in time order"):
        concat([late, early], ["x"])
    for overlap in ("first", "last"):
        with pytest.raises(ValueError, match=r"in time order"):
            concat([late, early], ["x"], overlap=overlap)


def test_a_plate_listing_a_well_or_a_field_twice_is_refused_naming_it(tmp_path: Path) -> None:
    # open_plate said "member names must be unique ... give names=", a keyword it does not take
    plate = make_plate_metadata_only(tmp_path / "p.zarr", rows=1, columns=2, fields=2,
                                     shape=(1, 1, 2, 8, 8))  # fmt: skip
    root = zarr.open_group(plate, mode="r+")
    ome = root.attrs["ome"]
    wells = ome["plate"]["wells"]
    root.attrs["ome"] = {**ome, "plate": {**ome["plate"], "wells": [*wells, wells[0]]}}
    with pytest.raises(ValueError, match=r"the plate's 'wells' list \['A/1'\] more than once"):
        open_plate(plate)
    root.attrs["ome"] = ome
    well = root["A/2"]
    meta = well.attrs["ome"]
    images = meta["well"]["images"]
    well.attrs["ome"] = {**meta, "well": {**meta["well"], "images": [*images, images[0]]}}
    with pytest.raises(ValueError, match=r"well 'A/2''s 'images' list \['0'\] more than once"):
        open_plate(plate)


def _sharded_period(root: Path, start: int, n: int) -> str:
    """Like :func:`_period`, ``x`` chunked 2 steps in shards of 4."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    hours = start + 6 * np.arange(n)
    x = group.create_array("x", shape=(n, 2), chunks=(2, 2), shards=(4, 2), dtype="f8",
                           dimension_names=("time", "c"))  # fmt: skip
    x[:] = hours[:, None] + np.array([0.0, 0.5])
    time = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8", fill_value=-1,
                              dimension_names=("time",))  # fmt: skip
    time[:] = hours
    time.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})
    return str(root)


def test_a_sharded_store_of_part_of_a_shard_is_refused_naming_shards(tmp_path: Path) -> None:
    # the refusal said "not a whole number of chunks of 4" of stores chunked 2 steps: 4 is
    # their shard, which it did not say
    first, later = (
        _sharded_period(tmp_path / "a.zarr", 0, 2),
        _sharded_period(tmp_path / "b.zarr", 12, 4),
    )
    with pytest.raises(ValueError, match=r"holds 2 samples.* chunks of 4 \(.*shards.*list it last"):
        concat([first, later], ["x"])


def test_fields_of_different_pyramids_at_level_minus_one_are_refused_saying_what_to_pick(
    tmp_path: Path,
) -> None:
    # the refusal of level=-1 (the coarsest of each field, another path where the pyramids
    # differ) said "pick the level by index", which level=-1 is
    plate = make_plate_metadata_only(tmp_path / "p.zarr", rows=1, columns=2, fields=1,
                                     shape=(1, 1, 2, 16, 16), levels=3)  # fmt: skip
    field = zarr.open_group(plate, mode="r+")["A/2/0"]
    ome = field.attrs["ome"]
    (multiscale,) = ome["multiscales"]
    shorter = {**multiscale, "datasets": multiscale["datasets"][:2]}
    field.attrs["ome"] = {**ome, "multiscales": [shorter]}
    with pytest.raises(ValueError, match=r"level=-1: .*pyramids differ.*level=0, or a pixel"):
        open_plate(plate, level=-1)
    assert open_plate(plate, level=1).paths("image") == ("A/1/0/1", "A/2/0/1")
