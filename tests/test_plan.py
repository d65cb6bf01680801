"""ReadPlanNode / plan_epoch against real geometries of the fixture stores.

The plan reads no data, but what it claims about chunks is checked against zarr: the chunk a
sample lives in is the zarr block that holds its values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import ArrayGeometry, SplitManifest, open_geometries, split_by_chunk
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import plan_epoch
from insitubatch_nodes.plan.ledger import BatchPlan
from insitubatch_nodes.plan.quality import shuffle_quality
from insitubatch_nodes.plan.schedule import PinSchedule, schedule_floors
from insitubatch_nodes.plan.splits import SPLITS
from insitubatch_nodes.stages.read_plan import ReadPlanNode

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def partial(layouts_path: Path) -> ArrayGeometry:
    """43 samples in chunks of 4: 11 chunks, the last one holds 3 samples."""
    return open_geometries(layouts_path, ["partial"])["partial"]


@pytest.fixture(scope="module")
def all_train(partial: ArrayGeometry) -> SplitManifest:
    return split_by_chunk(partial, (1.0, 0.0, 0.0))


@pytest.fixture(scope="module")
def big(layouts_path: Path) -> ArrayGeometry:
    """32768 samples in 2048 chunks of 16 (metadata only)."""
    return open_geometries(layouts_path, ["big"])["big"]


@pytest.fixture(scope="module")
def micro(microscopy_path: Path) -> dict[str, ArrayGeometry]:
    """image chunked 2 along Z, mask chunked 6 along Z (and tiled 2 x 2 in Y, X)."""
    return open_geometries(microscopy_path, sample_axis=2)


# -- helpers -------------------------------------------------------------------------------------


def _node(
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
    schedule: PinSchedule | None = None,
    **kw,
) -> ReadPlanNode:
    kw.setdefault("batch_size", 5)
    kw.setdefault("block_chunks", 3)
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return ReadPlanNode(manifest, views, schedule=schedule, config=PlanConfig(**kw))


def _epoch(node: ReadPlanNode) -> list[BatchPlan]:
    """Start the next epoch (reset(None)) and consume it."""
    node.reset(None)
    return list(node)


def _anchors(batches: list[BatchPlan]) -> np.ndarray:
    return np.concatenate([b.anchors for b in batches]) if batches else np.zeros(0, np.int64)


def _same_batch(a: BatchPlan, b: BatchPlan) -> bool:
    return (
        a.epoch == b.epoch
        and a.index == b.index
        and np.array_equal(a.rows, b.rows)
        and np.array_equal(a.anchors, b.anchors)
        and a.sample_indices.keys() == b.sample_indices.keys()
        and all(np.array_equal(a.sample_indices[k], b.sample_indices[k]) for k in a.sample_indices)
        and a.reads == b.reads
        and a.fetches == b.fetches
        and a.releases == b.releases
    )


def _chunk_samples(manifest: SplitManifest, chunks: list[int] | np.ndarray) -> set[int]:
    spc, n = manifest.samples_per_chunk, manifest.n_samples
    return {s for c in chunks for s in range(c * spc, min((c + 1) * spc, n))}


# -- coverage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_valid_anchor_appears_once_per_epoch(partial: ArrayGeometry, shuffle: bool) -> None:
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2))
    seen: list[int] = []
    for split in SPLITS:
        node = _node(manifest, {"x": partial}, split=split, shuffle=shuffle)
        for _ in range(3):  # three epochs, each complete on its own
            anchors = _anchors(_epoch(node))
            assert sorted(anchors.tolist()) == manifest.samples(split).tolist()
        seen.extend(anchors.tolist())
    assert sorted(seen) == list(range(partial.n_samples))


def test_rows_are_chunk_and_within_of_their_anchor(partial: ArrayGeometry, all_train) -> None:
    for batch in _epoch(_node(all_train, {"x": partial})):
        chunk, within = batch.rows[:, 0], batch.rows[:, 1]
        assert np.array_equal(batch.anchors, chunk * partial.samples_per_chunk + within)
        assert np.array_equal(batch.sample_indices["x"], batch.anchors)
        for c, w in zip(chunk.tolist(), within.tolist(), strict=True):
            start, stop = partial.chunk_range(c)
            assert 0 <= w < stop - start


def test_the_partial_final_chunk_contributes_only_its_real_samples(
    partial: ArrayGeometry, all_train: SplitManifest, layouts_path: Path
) -> None:
    arr = zarr.open_array(layouts_path / "partial", mode="r")
    last = partial.n_chunks - 1
    assert arr.cdata_shape[0] == partial.n_chunks
    last_block = arr.blocks[last]
    assert last_block.shape[0] == 3
    rows = np.concatenate([b.rows for b in _epoch(_node(all_train, {"x": partial}))])
    assert sorted(rows[rows[:, 0] == last, 1].tolist()) == [0, 1, 2]
    # the sample (last, w) is row w of zarr's last block
    for w in range(3):
        np.testing.assert_array_equal(last_block[w], arr[last * partial.samples_per_chunk + w])


# -- ranks ---------------------------------------------------------------------------------------


def test_rank_and_world_size_default_to_a_single_process(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    node = ReadPlanNode(all_train, {"x": partial})
    assert (node.rank, node.world_size) == (0, 1)
    node = ReadPlanNode(all_train, {"x": partial}, config=PlanConfig(world_size=3))
    assert (node.rank, node.world_size) == (0, 3)


def test_a_split_with_fewer_valid_anchors_than_ranks_is_refused(partial: ArrayGeometry) -> None:
    manifest = split_by_chunk(partial, (0.8, 0.1, 0.1))
    assert len(manifest.chunks("val")) == 1  # 4 samples: two ranks share the one chunk
    assert [
        len(_node(manifest, {"x": partial}, split="val", rank=r, world_size=2)) for r in (0, 1)
    ] == [1, 1]
    with pytest.raises(ValueError, match="world_size is 5"):
        _node(manifest, {"x": partial}, split="val", rank=0, world_size=5)


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_an_invalid_rank_is_refused(
    partial: ArrayGeometry, all_train: SplitManifest, rank: int, world_size: int
) -> None:
    with pytest.raises(ValueError, match="rank"):
        _node(all_train, {"x": partial}, rank=rank, world_size=world_size)


# -- views and labels ----------------------------------------------------------------------------


def test_windowed_views_drop_exactly_the_anchors_whose_window_falls_off_the_array(
    partial: ArrayGeometry, all_train: SplitManifest, layouts_path: Path
) -> None:
    views = {"x": partial, "y": partial.shift(1), "y_prev": partial.shift(-2)}
    n = partial.n_samples
    batches = _epoch(_node(all_train, views))
    anchors = _anchors(batches)
    assert sorted(anchors.tolist()) == list(range(2, n - 1))
    arr = zarr.open_array(layouts_path / "partial", mode="r")
    data = arr[...]
    spc = partial.samples_per_chunk
    for batch in batches:
        assert np.array_equal(batch.sample_indices["y"], batch.anchors + 1)
        assert np.array_equal(batch.sample_indices["y_prev"], batch.anchors - 2)
        # one path, several views: each chunk is read once, whichever view needs it
        assert all(path == "partial" for path, _ in batch.reads)
        needed = {int(s) // spc for idx in batch.sample_indices.values() for s in idx}
        assert {c for _, c in batch.reads} == needed
        # zarr's block c holds every sample the plan attributes to chunk c
        for label, idx in batch.sample_indices.items():
            for s in idx.tolist():
                c, w = divmod(s, spc)
                np.testing.assert_array_equal(arr.blocks[c][w], data[s], err_msg=label)


def test_views_whose_offsets_leave_no_anchor_are_refused(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    n = partial.n_samples
    with pytest.raises(ValueError, match="no valid anchor"):
        _node(all_train, {"x": partial.shift(-n // 2), "y": partial.shift(n // 2 + 1)})


@pytest.mark.parametrize("grid", ["image", "mask"])
def test_labels_chunked_differently_along_the_sample_axis_read_their_own_chunks(
    micro: dict[str, ArrayGeometry], microscopy_path: Path, grid: str
) -> None:
    image, mask = micro["image"], micro["mask"]
    assert (image.samples_per_chunk, mask.samples_per_chunk) == (2, 6)
    manifest = split_by_chunk(micro[grid], (1.0, 0.0, 0.0))  # either array is the anchor grid
    batches = _epoch(_node(manifest, {"image": image, "mask": mask}, batch_size=4))
    assert sorted(_anchors(batches).tolist()) == list(range(image.n_samples))
    group = zarr.open_group(microscopy_path, mode="r")
    mask_arr = group["mask"]
    mask_data = mask_arr[...]
    for batch in batches:
        z = batch.anchors.tolist()
        want = {("image", s // 2) for s in z} | {("mask", s // 6) for s in z}
        assert set(batch.reads) == want
        for s in z:
            c = s // 6
            # zarr's Z-block c of the mask holds plane s at position s - 6c
            block = mask_arr.blocks[:, :, c]
            np.testing.assert_array_equal(block[:, :, s - 6 * c], mask_data[:, :, s])
        # and every tile object of every read chunk exists in the store
        for path, c in batch.reads:
            geom = micro[path]
            for tile in geom.tiles():
                assert (microscopy_path / geom.store_key(c, tile)).is_file()


def test_a_label_with_a_different_sample_axis_length_is_refused(
    micro: dict[str, ArrayGeometry], microscopy_path: Path, partial: ArrayGeometry
) -> None:
    image = micro["image"]
    manifest = split_by_chunk(image)
    mask_along_t = open_geometries(microscopy_path, ["mask"])["mask"]  # sample axis T (2)
    with pytest.raises(ValueError, match=r"views\['mask'\] \(mask\) has 2 samples"):
        ReadPlanNode(manifest, {"image": image, "mask": mask_along_t})
    with pytest.raises(ValueError, match="share the sample-axis length"):
        ReadPlanNode(manifest, {"image": image, "other": partial})


def test_bad_node_arguments_are_refused(partial: ArrayGeometry, all_train: SplitManifest) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ReadPlanNode(all_train, {})
    with pytest.raises(TypeError):
        ReadPlanNode(all_train.to_dict(), {"x": partial})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        ReadPlanNode(all_train, {"x": partial}, config=PlanConfig(split="validation"))
    with pytest.raises(ValueError, match="batch_size"):
        ReadPlanNode(all_train, {"x": partial}, config=PlanConfig(batch_size=0))
    with pytest.raises(ValueError, match="block_chunks"):
        ReadPlanNode(all_train, {"x": partial}, config=PlanConfig(block_chunks=0))
    with pytest.raises(TypeError, match="config must be a PlanConfig"):
        ReadPlanNode(all_train, {"x": partial}, config={"batch_size": 5})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ReadPlanNode(all_train, {"x": "partial"})  # type: ignore[dict-item]


# -- batches -------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 4, 5, 43, 50])
def test_an_epoch_has_ceil_n_over_batch_size_batches_and_only_the_last_is_short(
    partial: ArrayGeometry, all_train: SplitManifest, batch_size: int
) -> None:
    node = _node(all_train, {"x": partial}, batch_size=batch_size)
    batches = _epoch(node)
    n = partial.n_samples
    assert len(batches) == len(node) == math.ceil(n / batch_size)
    sizes = [len(b) for b in batches]
    assert all(s == batch_size for s in sizes[:-1])
    assert sizes[-1] == n - batch_size * (len(batches) - 1)
    assert [b.index for b in batches] == list(range(len(batches)))
    assert all(b.n_batches == len(batches) and b.epoch == 0 for b in batches)


def test_an_empty_split_yields_no_batches(partial: ArrayGeometry) -> None:
    manifest = split_by_chunk(partial, (1.0, 0.0, 0.0))
    for world_size in (1, 2):
        node = _node(manifest, {"x": partial}, split="val", world_size=world_size)
        assert len(node) == 0
        assert _epoch(node) == []
        assert _epoch(node) == []


def test_the_same_seed_and_epoch_give_the_identical_plan(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    a = _epoch(_node(all_train, {"x": partial}, seed=7))
    b = _epoch(_node(all_train, {"x": partial}, seed=7))
    assert len(a) == len(b)
    assert all(_same_batch(x, y) for x, y in zip(a, b, strict=True))
    # the pure function gives the same rows as the node
    plan = plan_epoch(all_train, {"x": partial}, PlanConfig(seed=7, batch_size=5, block_chunks=3))
    assert np.array_equal(plan.anchors, _anchors(a))
    # another seed gives another order
    c = _epoch(_node(all_train, {"x": partial}, seed=8))
    assert not np.array_equal(_anchors(a), _anchors(c))


def test_the_next_epoch_is_a_different_permutation(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    node = _node(all_train, {"x": partial}, seed=7)
    orders = [_anchors(_epoch(node)) for _ in range(3)]
    assert node.epoch_plan(2).batch(0).epoch == 2
    for i in range(3):
        assert sorted(orders[i].tolist()) == list(range(partial.n_samples))
        for j in range(i):
            assert not np.array_equal(orders[i], orders[j])


def test_without_shuffle_the_order_is_sequential_every_epoch(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    node = _node(all_train, {"x": partial}, shuffle=False)
    for _ in range(2):
        assert _anchors(_epoch(node)).tolist() == list(range(partial.n_samples))
        assert node.epoch_plan().chunks.tolist() == all_train.chunks("train")
    manifest = split_by_chunk(partial, (0.5, 0.5, 0.0), contiguous=False, seed=1)
    node = _node(manifest, {"x": partial}, split="val", shuffle=False)
    assert _anchors(_epoch(node)).tolist() == manifest.samples("val").tolist()


def _documented_block_sizes(n_chunks: int, block_chunks: int, ramp_unit: int) -> list[int]:
    """Blocks as the docs describe them: with a ramp the first block is split into a lead block
    of r chunks (when 0 < r < block_chunks) and the rest, then blocks of block_chunks chunks."""
    sizes: list[int] = []
    if 0 < ramp_unit < block_chunks:
        sizes = [ramp_unit, block_chunks - ramp_unit]
    while sum(sizes) < n_chunks:
        sizes.append(block_chunks)
    return sizes


@pytest.mark.parametrize("ramp", [False, True])
def test_within_a_block_all_rows_come_from_that_blocks_chunks(
    big: ArrayGeometry, ramp: bool
) -> None:
    manifest = split_by_chunk(big, (0.1, 0.0, 0.9), contiguous=False, seed=2)
    block_chunks, batch_size = 8, 24
    node = _node(
        manifest, {"x": big}, batch_size=batch_size, block_chunks=block_chunks, seed=4, ramp=ramp
    )
    batches = _epoch(node)
    plan = node.epoch_plan()
    n_chunks = len(plan.chunks)
    assert sorted(plan.chunks.tolist()) == manifest.chunks("train")
    ramp_unit = math.ceil(batch_size / big.samples_per_chunk) if ramp else 0  # 2 chunks
    sizes = _documented_block_sizes(n_chunks, block_chunks, ramp_unit)
    assert sizes[:4] == ([2, 6, 8, 8] if ramp else [8, 8, 8, 8])
    block_of_position = np.repeat(np.arange(len(sizes)), sizes)[:n_chunks]
    assert plan.n_blocks == len(sizes)
    position = {int(c): i for i, c in enumerate(plan.chunks.tolist())}
    row_block = np.array([block_of_position[position[int(c)]] for c in plan.order[:, 0]])
    # blocks are visited one after the other: no batch returns to a block an earlier batch left
    # (rows inside a batch are in sample order, so a batch straddling two blocks mixes them)
    per_batch = [row_block[i : i + batch_size] for i in range(0, len(row_block), batch_size)]
    for before, after in itertools.pairwise(per_batch):
        assert after.min() >= before.max()
    assert sorted(set(row_block.tolist())) == list(range(plan.n_blocks))
    for batch in batches:
        blocks_of_rows = {int(block_of_position[position[int(c)]]) for c in batch.rows[:, 0]}
        assert set(batch.blocks) == blocks_of_rows
        allowed = {
            int(c) for i, c in enumerate(plan.chunks) if block_of_position[i] in blocks_of_rows
        }
        assert set(batch.rows[:, 0].tolist()) <= allowed
    # rows are shuffled within a block: a batch draws from many of its block's chunks
    inner = [b for b in batches if len(b.blocks) == 1 and b.blocks[0] >= 2 and len(b) == 24]
    assert inner
    assert np.mean([len(set(b.rows[:, 0].tolist())) for b in inner]) > block_chunks / 2
    if ramp:
        # the first batch needs only the first ramp_unit chunks, not a whole block
        assert set(batches[0].rows[:, 0].tolist()) <= set(plan.chunks[:ramp_unit].tolist())
        assert len(batches[0].fetches) <= ramp_unit


def test_the_ramp_changes_only_the_first_block(big: ArrayGeometry) -> None:
    manifest = split_by_chunk(big, (1.0, 0.0, 0.0))
    kw = {"batch_size": 24, "block_chunks": 8, "seed": 4}
    with_ramp = _node(manifest, {"x": big}, ramp=True, **kw).epoch_plan(0)
    without = _node(manifest, {"x": big}, ramp=False, **kw).epoch_plan(0)
    assert np.array_equal(with_ramp.chunks, without.chunks)
    first_block = 8 * big.samples_per_chunk
    # up to the first batch that starts after the first block: the same samples, regrouped;
    # from there on, the batches are identical
    first_clean = -(-first_block // 24) * 24
    assert set(with_ramp.anchors[:first_clean].tolist()) == set(
        without.anchors[:first_clean].tolist()
    )
    assert np.array_equal(with_ramp.anchors[first_clean:], without.anchors[first_clean:])
    assert with_ramp.live_peak() <= without.live_peak()
    # without shuffling there is nothing to ramp
    plain = _node(manifest, {"x": big}, shuffle=False, **kw).epoch_plan(0)
    assert plain.n_blocks == math.ceil(len(plain.chunks) / 8)


# -- reads, fetches, releases --------------------------------------------------------------------


def _case_views(
    case: str, partial: ArrayGeometry, micro: dict[str, ArrayGeometry]
) -> tuple[dict[str, ArrayGeometry], SplitManifest]:
    """The views and manifest of a reads case: a microscopy pair, or ``partial`` alone (with
    two shifted views when ``windowed``)."""
    if case == "microscopy":
        return {"image": micro["image"], "mask": micro["mask"]}, split_by_chunk(
            micro["image"], (1.0, 0.0, 0.0)
        )
    views = {"x": partial}
    if case == "windowed":
        views |= {"y": partial.shift(1), "y2": partial.shift(-2)}
    return views, split_by_chunk(partial, (1.0, 0.0, 0.0))


@pytest.mark.parametrize("case", ["single", "windowed", "microscopy", "ranks"])
def test_each_chunk_is_fetched_once_at_its_first_read_and_released_at_its_last(
    case: str, partial: ArrayGeometry, micro: dict[str, ArrayGeometry]
) -> None:
    variables, manifest = _case_views(case, partial, micro)
    world_size = 2 if case == "ranks" else 1
    node = _node(manifest, variables, batch_size=3, rank=world_size - 1, world_size=world_size)
    for _ in range(2):
        batches = _epoch(node)
        first_read: dict[tuple[str, int], int] = {}
        last_read: dict[tuple[str, int], int] = {}
        fetched: dict[tuple[str, int], int] = {}
        released: dict[tuple[str, int], int] = {}
        so_far: set[tuple[str, int]] = set()
        for batch in batches:
            assert len(set(batch.reads)) == len(batch.reads)
            for key in batch.fetches:
                assert key not in fetched, f"{key} fetched twice"
                fetched[key] = batch.index
            so_far |= set(batch.fetches)
            assert set(batch.reads) <= so_far
            for key in batch.releases:
                assert key not in released, f"{key} released twice"
                released[key] = batch.index
            for key in batch.reads:
                first_read.setdefault(key, batch.index)
                last_read[key] = batch.index
            # what a batch reads is exactly the chunks its samples live in
            want = {
                (g.path, int(s) // g.samples_per_chunk)
                for label, g in variables.items()
                for s in batch.sample_indices[label]
            }
            assert set(batch.reads) == want
        assert fetched == first_read
        assert released == last_read
        plan = node.epoch_plan()
        assert plan.distinct_chunks() == [k for b in batches for k in b.fetches]
        assert 0 < plan.live_peak() <= len(fetched)


@pytest.mark.parametrize("case", ["single", "windowed", "microscopy", "ranks"])
def test_the_bytes_an_epoch_reads_count_every_distinct_chunk_it_fetches_once(
    case: str, partial: ArrayGeometry, micro: dict[str, ArrayGeometry]
) -> None:
    # the oracle: the set of every batch's fetches (a chunk re-fetched after a release, or read
    # by two views, counts once), each at its path's size
    views, manifest = _case_views(case, partial, micro)
    world = 2 if case == "ranks" else 1
    sizes = {g.path: 1000 + 7 * i for i, g in enumerate(views.values())}
    config = PlanConfig(batch_size=3, block_chunks=2, world_size=world)
    gaps = {None, schedule_floors(manifest, views, config).pin_gap}
    checked = 0
    for gap, epoch, rank, resumed in itertools.product(gaps, (0, 1), range(world), ((), ((2, 1),))):
        plan = plan_epoch(manifest, views, config.for_rank(rank, world), epoch=epoch,
                          pin_gap=gap, resumed=resumed)  # fmt: skip
        keys = {k for b in plan.batch_indices for k in plan.batch_fetches(b)}
        assert plan.read_bytes(sizes) == sum(sizes[path] for path, _ in keys)
        checked += len(keys) > 0
    assert checked


# -- state ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["get_state", "state_dict"])
@pytest.mark.parametrize("epoch", [0, 1])
def test_a_restored_plan_continues_with_the_identical_next_batch(
    partial: ArrayGeometry, all_train: SplitManifest, how: str, epoch: int
) -> None:
    views = {"x": partial, "y": partial.shift(1)}
    a = _node(all_train, views, seed=3)
    for _ in range(epoch):
        _epoch(a)
    a.reset(None)
    for _ in range(3):
        next(a)
    state = getattr(a, how)()
    assert state["epoch"] == epoch and state["batches_emitted"] == 3
    b = _node(all_train, views, seed=3)
    b.reset(state)
    rest_a, rest_b = list(a), list(b)
    assert len(rest_a) == len(rest_b) == len(a) - 3
    assert all(_same_batch(x, y) for x, y in zip(rest_a, rest_b, strict=True))
    assert rest_b[0].index == 3 and rest_b[0].epoch == epoch
    # both go on to the same next epoch
    assert all(_same_batch(x, y) for x, y in zip(_epoch(a), _epoch(b), strict=True))


def test_a_state_taken_after_the_last_batch_resumes_at_the_next_epoch(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    a = _node(all_train, {"x": partial}, seed=3)
    _epoch(a)
    state = a.state_dict()
    assert state["epoch"] == 0 and state["batches_emitted"] == len(a)
    b = _node(all_train, {"x": partial}, seed=3)
    b.reset(state)
    assert b.epoch == 1
    resumed = list(b)
    expected = _epoch(a)
    assert a.epoch == 1
    assert len(resumed) == len(expected)
    assert all(_same_batch(x, y) for x, y in zip(resumed, expected, strict=True))
    assert resumed[0].epoch == 1 and resumed[0].index == 0


def test_a_state_is_plain_python(partial: ArrayGeometry, all_train: SplitManifest) -> None:
    import json

    node = _node(all_train, {"x": partial})
    next(node)
    state = node.state_dict()
    assert json.loads(json.dumps(state)) == state


@pytest.mark.parametrize(
    ("field", "changed"),
    [
        ("seed", {"seed": 1}),
        ("batch_size", {"batch_size": 7}),
        ("split", {"split": "val"}),
        ("remainder", {"remainder": "pad"}),
        ("block_chunks", {"block_chunks": 5}),
        ("shuffle", {"shuffle": False}),
        ("ramp", {"ramp": False}),
    ],
)
def test_a_state_with_a_different_configuration_raises_value_error_naming_the_field(
    partial: ArrayGeometry, field: str, changed: dict[str, object]
) -> None:
    # (another world size resumes elastically: tests/test_elastic.py)
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2))
    a = _node(manifest, {"x": partial})
    next(a)
    state = a.get_state()
    b = _node(manifest, {"x": partial}, **changed)
    with pytest.raises(ValueError, match=rf"its {field} differs"):
        b.reset(state)


def test_a_state_from_different_arrays_or_views_is_refused(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    a = _node(all_train, {"x": partial})
    next(a)
    state = a.get_state()
    with pytest.raises(ValueError, match="dataset"):
        _node(all_train, {"x": partial, "y": partial.shift(1)}).reset(state)
    other_split = split_by_chunk(partial, (0.9, 0.1, 0.0))
    with pytest.raises(ValueError, match="dataset"):
        _node(other_split, {"x": partial}).reset(state)


def test_reset_none_advances_the_epoch_only_after_a_batch_was_consumed(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    node = _node(all_train, {"x": partial})
    node.reset(None)
    assert node.epoch == 0
    node.reset(None)  # nothing consumed: still epoch 0
    assert node.epoch == 0
    first = next(node)
    assert first.epoch == 0
    node.reset(None)  # epoch 0 was (partly) consumed
    assert node.epoch == 1
    node.reset(None)
    node.reset(None)
    assert node.epoch == 1
    assert next(node).epoch == 1
    list(node)
    node.reset(None)
    assert node.epoch == 2


def test_set_epoch_pins_the_epoch_the_next_reset_starts(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    node = _node(all_train, {"x": partial}, seed=5)
    node.set_epoch(4)
    node.reset(None)
    assert node.epoch == 4
    batches = list(node)
    config = PlanConfig(seed=5, batch_size=5, block_chunks=3)
    plan = plan_epoch(all_train, {"x": partial}, config, epoch=4)
    assert np.array_equal(_anchors(batches), plan.anchors)
    assert all(b.epoch == 4 for b in batches)
    node.reset(None)  # the pin is used once; after a consumed epoch the count goes on
    assert node.epoch == 5
    node.set_epoch(2)  # pinning back is allowed (e.g. a trainer restarting an epoch)
    node.reset(None)
    assert node.epoch == 2
    with pytest.raises(ValueError, match="epoch"):
        node.set_epoch(-1)


# -- shuffle quality -----------------------------------------------------------------------------


def test_shuffle_quality_is_zero_for_sorted_order_and_high_for_a_global_permutation() -> None:
    order = np.arange(20000)
    assert shuffle_quality(order, 32) < 0.01
    assert shuffle_quality(np.random.default_rng(0).permutation(order), 32) > 0.9
    # a chunk-local shuffle (chunks in order, samples shuffled inside each) scores low
    rng = np.random.default_rng(1)
    local = np.concatenate([rng.permutation(np.arange(s, s + 16)) for s in range(0, 20000, 16)])
    assert shuffle_quality(local, 32) < 0.2
    # batches can be passed as delivered; the order of rows inside a batch does not matter
    batches = list(np.random.default_rng(2).permutation(order).reshape(-1, 40))
    assert shuffle_quality(batches) == pytest.approx(shuffle_quality([np.sort(b) for b in batches]))
    with pytest.raises(ValueError, match="batch_size"):
        shuffle_quality(order)


def test_the_block_shuffled_plan_of_a_large_dataset_scores_like_a_global_shuffle(
    big: ArrayGeometry,
) -> None:
    manifest = split_by_chunk(big, (1.0, 0.0, 0.0))
    node = _node(manifest, {"x": big}, batch_size=64, block_chunks=16, seed=0)
    batches = _epoch(node)
    emitted = [b.sample_indices["x"] for b in batches]
    assert sum(len(b) for b in emitted) == big.n_samples
    assert shuffle_quality(emitted) > 0.9
    assert node.epoch_plan().shuffle_quality() > 0.9
    sequential = _node(manifest, {"x": big}, batch_size=64, shuffle=False)
    assert sequential.epoch_plan(0).shuffle_quality() < 0.01


# -- torchdata Loader ----------------------------------------------------------------------------


def test_a_loader_iterates_epochs_and_its_state_dict_round_trips(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    views = {"x": partial, "y": partial.shift(1)}
    loader = Loader(_node(all_train, views, seed=11))
    epoch0 = list(loader)
    assert [b.index for b in epoch0] == list(range(len(epoch0)))
    assert all(b.epoch == 0 for b in epoch0)
    assert sorted(_anchors(epoch0).tolist()) == list(range(partial.n_samples - 1))

    it = iter(loader)  # epoch 1
    head = [next(it), next(it)]
    assert all(b.epoch == 1 for b in head)
    state = loader.state_dict()

    restored = Loader(_node(all_train, views, seed=11))
    restored.load_state_dict(state)
    tail_restored = list(restored)
    tail = list(it)
    assert len(tail_restored) == len(tail) == len(epoch0) - 2
    assert all(_same_batch(x, y) for x, y in zip(tail, tail_restored, strict=True))

    # a state saved at the end of an epoch resumes with the next epoch in full
    end_state = loader.state_dict()
    again = Loader(_node(all_train, views, seed=11))
    again.load_state_dict(end_state)
    epoch2 = list(again)
    assert len(epoch2) == len(epoch0)
    assert all(b.epoch == 2 for b in epoch2)
    assert all(_same_batch(x, y) for x, y in zip(list(loader), epoch2, strict=True))


def test_rows_inside_a_batch_are_in_sample_order_so_each_chunk_is_one_run(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    views = {"x": partial, "y": partial.shift(1)}
    for batch in _epoch(_node(all_train, views, batch_size=7, block_chunks=3)):
        for label, geom in views.items():
            samples = batch.sample_indices[label]
            assert (np.diff(samples) > 0).all()
            chunks = samples // geom.samples_per_chunk
            runs = 1 + int((np.diff(chunks) != 0).sum())
            assert runs == len(set(chunks.tolist()))


def test_a_plan_resumed_mid_epoch_lists_the_chunks_earlier_batches_first_read(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    plan = _node(all_train, {"x": partial}, batch_size=5, block_chunks=4).epoch_plan(0)
    for k in range(plan.n_batches):
        carried = set(plan.carried_into(k))
        before = {key for b in range(k) for key in plan.batch_fetches(b)}
        from_k = {key for b in range(k, plan.n_batches) for key in plan.batch(b).reads}
        assert carried == before & from_k
    assert plan.carried_into(0) == ()


# -- windows and split edges ---------------------------------------------------------------------


def _split_of_chunk(manifest: SplitManifest) -> dict[int, str]:
    return {c: name for name in SPLITS for c in manifest.chunks(name)}


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_no_batch_reads_a_sample_outside_its_splits_chunks_by_default(
    partial: ArrayGeometry, contiguous: bool, shuffle: bool
) -> None:
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2), contiguous=contiguous, seed=4)
    views = {"x": partial, "y": partial.shift(1), "y_prev": partial.shift(-2)}
    owner = _split_of_chunk(manifest)
    spc = manifest.samples_per_chunk
    for split in SPLITS:
        node = _node(manifest, views, split=split, shuffle=shuffle)
        for _ in range(2):
            batches = _epoch(node)
            assert len(batches) == len(node)
            for batch in batches:
                for label, samples in batch.sample_indices.items():
                    outside = [int(s) for s in samples if owner[int(s) // spc] != split]
                    assert not outside, f"{split}/{label} reads samples {outside} of other splits"
            got = np.sort(_anchors(batches))
            # exactly the anchors whose every view stays in the split: nothing more is dropped
            want = [
                a
                for a in manifest.samples(split).tolist()
                if all(0 <= a + g.offset < partial.n_samples for g in views.values())
                and all(owner[(a + g.offset) // spc] == split for g in views.values())
            ]
            assert got.tolist() == want
            assert len(node) == math.ceil(len(want) / node.batch_size)


def test_a_forecasting_pair_on_a_contiguous_split_stops_one_sample_before_the_edge(
    partial: ArrayGeometry,
) -> None:
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2))  # train = chunks 0..6 = samples 0..27
    views = {"x": partial, "y": partial.shift(1)}
    last_train = manifest.samples("train")[-1]
    inside = _anchors(_epoch(_node(manifest, views)))
    assert last_train not in inside.tolist() and last_train - 1 in inside.tolist()
    across = _node(manifest, views, cross_split_windows=True)
    batches = _epoch(across)
    # the old behaviour: the edge anchor is there, and its target is val's first sample
    assert last_train in _anchors(batches).tolist()
    first_val = manifest.samples("val")[0]
    assert any(first_val in b.sample_indices["y"].tolist() for b in batches)
    assert sorted(_anchors(batches).tolist()) == manifest.samples("train").tolist()


@pytest.mark.parametrize("grid", ["image", "mask"])
def test_the_split_rule_uses_the_anchor_grid_whatever_a_labels_own_chunking(
    micro: dict[str, ArrayGeometry], grid: str
) -> None:
    image, mask = micro["image"], micro["mask"]
    manifest = split_by_chunk(micro[grid], (0.5, 0.25, 0.25))
    owner = _split_of_chunk(manifest)
    spc = manifest.samples_per_chunk
    views = {"image": image, "mask_next": mask.shift(1)}
    for split in SPLITS:
        if not manifest.chunks(split):
            continue
        for batch in _epoch(_node(manifest, views, split=split, batch_size=3)):
            for samples in batch.sample_indices.values():
                assert {owner[int(s) // spc] for s in samples} == {split}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("cross", [False, True])
def test_ranks_stay_disjoint_and_equal_under_either_window_rule(
    big: ArrayGeometry, world_size: int, cross: bool
) -> None:
    manifest = split_by_chunk(big, (0.05, 0.9, 0.05))
    views = {"x": big, "y": big.shift(3), "prev": big.shift(-17)}
    owner = _split_of_chunk(manifest)
    spc = manifest.samples_per_chunk
    for epoch in range(2):
        seen: list[set[int]] = []
        counts = []
        for rank in range(world_size):
            node = _node(
                manifest, views, rank=rank, world_size=world_size, cross_split_windows=cross
            )
            node.set_epoch(epoch)
            batches = _epoch(node)
            counts.append(len(batches))
            assert len(batches) == len(node)
            seen.append(set(_anchors(batches).tolist()))
            if not cross:
                for b in batches:
                    for samples in b.sample_indices.values():
                        assert {owner[int(s) // spc] for s in samples} == {"train"}
        assert len(set(counts)) == 1
        assert sum(len(s) for s in seen) == len(set().union(*seen))


@pytest.mark.parametrize("cross", [False, True])
def test_a_plan_resumed_mid_epoch_is_exact_under_either_window_rule(
    partial: ArrayGeometry, cross: bool
) -> None:
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2))
    views = {"x": partial, "y": partial.shift(1), "y2": partial.shift(-2)}
    a = _node(manifest, views, seed=9, cross_split_windows=cross)
    _epoch(a)
    a.reset(None)
    next(a)
    next(a)
    state = a.get_state()
    assert state["config"]["cross_split_windows"] is cross
    b = _node(manifest, views, seed=9, cross_split_windows=cross)
    b.reset(state)
    rest_a, rest_b = list(a), list(b)
    assert rest_b and len(rest_a) == len(rest_b) == len(a) - 2
    assert all(_same_batch(x, y) for x, y in zip(rest_a, rest_b, strict=True))
    # the other rule is another plan: its state is refused, naming the field
    other = _node(manifest, views, seed=9, cross_split_windows=not cross)
    with pytest.raises(ValueError, match="cross_split_windows differs"):
        other.reset(state)


def test_a_state_saved_before_the_split_rule_existed_is_refused_when_the_rule_matters(
    partial: ArrayGeometry,
) -> None:
    manifest = split_by_chunk(partial, (0.6, 0.2, 0.2))
    shifted = {"x": partial, "y": partial.shift(1)}
    a = _node(manifest, shifted)
    next(a)
    old = a.get_state()
    del old["config"]["cross_split_windows"]
    with pytest.raises(ValueError, match="predates cross_split_windows"):
        _node(manifest, shifted).reset(old)
    _node(manifest, shifted, cross_split_windows=True).reset(old)  # its own behaviour: fine
    plain = _node(manifest, {"x": partial})
    next(plain)
    old = plain.get_state()
    del old["config"]["cross_split_windows"]
    _node(manifest, {"x": partial}).reset(old)  # no window: both rules agree


def test_a_split_whose_windows_leave_no_anchor_inside_it_is_refused(
    partial: ArrayGeometry,
) -> None:
    manifest = split_by_chunk(partial, (0.8, 0.1, 0.1))
    assert len(manifest.chunks("val")) == 1  # 4 samples
    views = {"x": partial, "y": partial.shift(4)}
    with pytest.raises(ValueError, match="cross_split_windows=True"):
        _node(manifest, views, split="val")
    assert len(_node(manifest, views, split="val", cross_split_windows=True)) == 1


# -- the configuration fingerprint ---------------------------------------------------------------


def test_get_state_does_not_recompute_the_manifest_fingerprint(
    big: ArrayGeometry, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = split_by_chunk(big, (1.0, 0.0, 0.0))
    assert len(manifest.chunks("train")) == 2048
    calls = []
    real = SplitManifest.fingerprint

    def counted(self: SplitManifest) -> str:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(SplitManifest, "fingerprint", counted)
    node = _node(manifest, {"x": big, "y": big.shift(1)}, batch_size=64)
    assert len(calls) == 1  # once, at construction
    first = node.get_state()
    for _ in range(5):
        next(node)
        assert node.get_state()["config"] == first["config"]
        node.state_dict()
        node.config()["seed"] = 99  # a copy: the node's own fingerprint cannot be changed
    node.reset(node.get_state())
    assert len(calls) == 1
    assert node.config() == first["config"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 3),
        ("batch_size", 7),
        ("shuffle", False),
        ("cross_split_windows", True),
        ("variables", {}),
        ("schedule", None),
    ],
)
def test_the_configuration_is_fixed_after_construction(
    partial: ArrayGeometry, all_train: SplitManifest, field: str, value: object
) -> None:
    node = _node(all_train, {"x": partial})
    with pytest.raises(AttributeError, match="fixed at construction"):
        setattr(node, field, value)
    with pytest.raises(TypeError):
        node.views["y"] = partial  # type: ignore[index]


# -- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": 1.5}, TypeError, "seed must be an integer"),
        ({"seed": 2.0}, TypeError, "seed must be an integer"),
        ({"seed": True}, TypeError, "seed must be an integer"),
        ({"seed": "0"}, TypeError, "seed must be an integer"),
        ({"seed": -1}, ValueError, "seed must be an integer >= 0"),
        ({"batch_size": True}, TypeError, "batch_size must be an integer"),
        ({"batch_size": 4.0}, TypeError, "batch_size must be an integer"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
        ({"block_chunks": False}, TypeError, "block_chunks must be an integer"),
        ({"block_chunks": -2}, ValueError, "block_chunks must be a positive integer"),
        ({"shuffle": "no"}, TypeError, "shuffle must be True or False"),
        ({"shuffle": 0}, TypeError, "shuffle must be True or False"),
        ({"shuffle": None}, TypeError, "shuffle must be True or False"),
        ({"ramp": "yes"}, TypeError, "ramp must be True or False"),
        ({"ramp": 1}, TypeError, "ramp must be True or False"),
        ({"cross_split_windows": "False"}, TypeError, "cross_split_windows must be True or"),
        ({"rank": 0.0}, TypeError, "rank must be an integer"),
        ({"rank": True, "world_size": 2}, TypeError, "rank must be an integer"),
        ({"world_size": 2.0}, TypeError, "world_size must be an integer"),
        ({"world_size": True}, TypeError, "world_size must be an integer"),
        ({"split": 0}, ValueError, "split must be one of"),
        ({"schedule": 3}, TypeError, "schedule must be a PinSchedule"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__,
)
def test_bad_node_arguments_raise_with_a_sentence(
    partial: ArrayGeometry,
    all_train: SplitManifest,
    kwargs: dict[str, object],
    error: type[Exception],
    match: str,
) -> None:
    settings = dict(kwargs)
    schedule = settings.pop("schedule", None)
    with pytest.raises(error, match=match):  # where the config is made, or by the node
        ReadPlanNode(
            all_train,
            {"x": partial},
            schedule=schedule,  # type: ignore[arg-type]
            config=PlanConfig(**settings),  # type: ignore[arg-type]
        )


def test_numpy_integers_and_bools_are_accepted(
    partial: ArrayGeometry, all_train: SplitManifest
) -> None:
    config = PlanConfig(
        seed=np.int64(3),  # type: ignore[arg-type]
        batch_size=np.int32(5),  # type: ignore[arg-type]
        shuffle=np.bool_(True),  # type: ignore[arg-type]
        rank=np.int64(0),  # type: ignore[arg-type]
        world_size=np.int64(1),  # type: ignore[arg-type]
    )
    node = ReadPlanNode(all_train, {"x": partial}, config=config)
    assert type(node.seed) is int and type(node.batch_size) is int and node.shuffle is True
    assert json_round_trips(node.get_state())


def json_round_trips(state: dict[str, object]) -> bool:
    import json

    return json.loads(json.dumps(state)) == state


# -- residency bounds ----------------------------------------------------------------------------


def _floor(plan: object, variables: Mapping[str, ArrayGeometry]) -> int:
    from insitubatch_nodes.plan.schedule import working_set_bytes

    return working_set_bytes(plan, {g.path: g.base for g in variables.values()})[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "shift",
        "windows",
        "long_window_ranks",
        "tails",
        "tails_pad",
        "interleaved",
        "batch_over_blocks",
        "mixed_grids",
        "unshuffled",
    ],
)
def test_schedule_floors_bound_every_epochs_floor_under_either_schedule(
    partial: ArrayGeometry, micro: dict[str, ArrayGeometry], big: ArrayGeometry, case: str
) -> None:
    from insitubatch_nodes.plan.schedule import schedule_floors

    kw: dict[str, object] = {"batch_size": 5, "block_chunks": 3}
    node_kw: dict[str, object] = {}
    g = partial
    variables: dict[str, ArrayGeometry] = {"x": g}
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    worlds = [1]
    if case == "shift":
        variables = {"x": g, "y": g.shift(1)}
    elif case == "windows":
        variables = {"x": g, "y": g.shift(2), "prev": g.shift(-3)}
    elif case == "long_window_ranks":
        variables, worlds = {"x": g, "y": g.shift(9)}, [1, 2, 3]
    elif case in ("tails", "tails_pad"):
        # every world size from 2 to 8: the tail's chunks are split between ranks, and a
        # rank's ledger ends with pieces of them (203 samples in chunks of 8: metadata only)
        g = ArrayGeometry("t", (203, 3), (8, 3), np.dtype("f4"), 0.0)
        manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
        worlds = list(range(2, 9))
        if case == "tails":
            variables, kw = {"x": g}, {"batch_size": 16, "block_chunks": 1}
        else:
            variables, kw = {"x": g, "y": g.shift(2)}, {"batch_size": 3, "block_chunks": 2}
    elif case == "interleaved":
        g = big
        manifest = split_by_chunk(g, (0.02, 0.49, 0.49), contiguous=False, seed=3)
        variables, kw = {"x": g, "y": g.shift(1)}, {"batch_size": 24, "block_chunks": 4}
    elif case == "batch_over_blocks":
        variables, kw = {"x": g, "y": g.shift(1)}, {"batch_size": 23, "block_chunks": 2}
    elif case == "mixed_grids":
        variables = {"image": micro["image"], "mask": micro["mask"]}
        manifest = split_by_chunk(micro["image"], (1.0, 0.0, 0.0))
        kw = {"batch_size": 3, "block_chunks": 2}
    elif case == "unshuffled":
        variables, node_kw = {"x": g, "y": g.shift(1)}, {"shuffle": False}
    remainder = "pad" if case == "tails_pad" else "drop"
    for world in worlds:
        floors = schedule_floors(
            manifest,
            variables,
            PlanConfig(remainder=remainder, world_size=world, **kw),  # type: ignore[arg-type]
        )
        for rank in range(world):
            for ramp in (True, False):
                for epoch in range(12):
                    config = PlanConfig(
                        **kw,  # type: ignore[arg-type]
                        **node_kw,  # type: ignore[arg-type]
                        rank=rank,
                        world_size=world,
                        remainder=remainder,
                        ramp=ramp,
                    )
                    once = plan_epoch(manifest, variables, config, epoch=epoch)
                    assert _floor(once, variables) <= floors.read_once
                    bounded = plan_epoch(
                        manifest, variables, config, epoch=epoch, pin_gap=floors.pin_gap
                    )
                    assert _floor(bounded, variables) <= floors.bounded
