"""``StatefulDataLoader(as_dataset(pipe), batch_size=None, num_workers=0)``: exact length,
checkpoint/resume across processes, a clear refusal of worker processes, and items that name
each row's member and sample as the pipeline's own batches do."""

from __future__ import annotations

import gc
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from resume_helpers import (
    build_pipeline,
    epochs_of,
    indexed_transform,
    is_plain,
    pipe_config,
    record_item,
    reference_run,
    run_fresh,
    write_store,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from insitubatch_nodes import (
    Collection,
    InSituPipeline,
    Loader,
    insitu_pipeline,
    split_by_member,
    to_item,
)
from insitubatch_nodes.torch_data import as_dataset

N_BATCHES = 10

# one worker runs the module: its module fixtures are built once, not once per worker; the
# worker of the tests that import Lightning, which one of its tests does
pytestmark = [
    pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning"),
    pytest.mark.xdist_group("lightning"),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("sdl") / "era5.zarr")


@pytest.fixture(scope="module")
def reference(store: Path) -> list[dict]:
    return reference_run(pipe_config(store), 3)


def as_items(records: list[dict]) -> list[dict]:
    """Reference records as :func:`record_item` sees them (x's sample indices, no state)."""
    return [
        {"epoch": r["epoch"], "index": r["index"], "idx": {"x": r["idx"]["x"]}, "hash": r["hash"]}
        for r in records
    ]


def sdl(cfg: dict, num_workers: int = 0) -> tuple[StatefulDataLoader, InSituPipeline]:
    pipe = build_pipeline(cfg)
    loader = StatefulDataLoader(
        as_dataset(pipe, transform=indexed_transform), batch_size=None, num_workers=num_workers
    )
    return loader, pipe


def test_len_is_the_number_of_batches_an_epoch_delivers(store: Path, reference: list[dict]) -> None:
    loader, pipe = sdl(pipe_config(store))
    try:
        assert len(loader) == N_BATCHES
        for epoch in range(2):
            items = [record_item(item) for item in loader]
            assert len(items) == len(loader)
            assert [(r["epoch"], r["index"]) for r in items] == [
                (epoch, i) for i in range(N_BATCHES)
            ]
            assert items == as_items(reference[epoch * N_BATCHES : (epoch + 1) * N_BATCHES])
    finally:
        pipe.close()


@pytest.mark.parametrize("k", [3, 7, N_BATCHES, N_BATCHES + 4])
def test_a_state_after_k_batches_resumes_in_a_new_process_with_batch_k_plus_1_then_next_epoch(
    store: Path, reference: list[dict], tmp_path: Path, k: int
) -> None:
    cfg = pipe_config(store)
    loader, pipe = sdl(cfg)
    try:
        it = epochs_of(loader)
        before = [record_item(next(it)) for _ in range(k)]
        state = loader.state_dict()
    finally:
        pipe.close()
    want = as_items(reference)
    assert before == want[:k]
    assert is_plain(state), state
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == state
    wire = json.loads(json.dumps(state))
    resp = run_fresh("sdl-restore", {"config": cfg, "state": wire, "passes": 2}, tmp_path)
    assert resp["len"] == N_BATCHES
    after = resp["records"]
    # the rest of this epoch (at an epoch end: the whole next one), then the following epoch
    n_after = N_BATCHES - k % N_BATCHES + N_BATCHES
    assert [(r["epoch"], r["index"]) for r in after] == [
        (r["epoch"], r["index"]) for r in want[k : k + n_after]
    ]
    assert after == want[k : k + n_after]
    assert (after[0]["epoch"], after[0]["index"]) == divmod(k, N_BATCHES)


def test_restoring_a_state_from_another_configuration_raises_naming_the_field(
    store: Path,
) -> None:
    loader, pipe = sdl(pipe_config(store))
    try:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    finally:
        pipe.close()
    other, pipe2 = sdl(pipe_config(store, batch_size=12))
    try:
        with pytest.raises(ValueError, match=r"batch_size\b.*differs"):
            other.load_state_dict(state)
            next(iter(other))
    finally:
        pipe2.close()


def test_taking_a_state_before_the_first_batch_does_not_change_the_epoch_epoch_fn_asks_for(
    store: Path,
) -> None:
    pipe = build_pipeline(pipe_config(store))
    try:
        dataset = as_dataset(pipe, transform=indexed_transform, epoch_fn=lambda: 2)
        state = dataset.state_dict()  # e.g. a checkpoint written before training starts
        assert pipe.stats()["gets"] == 0  # reporting the state started nothing
        first = next(iter(dataset))
    finally:
        pipe.close()
    assert (first["epoch"], first["index"]) == (2, 0)
    # and that state, restored into a fresh pipeline, starts at the same place
    again = build_pipeline(pipe_config(store))
    try:
        restored = as_dataset(again, transform=indexed_transform)
        restored.load_state_dict(state)
        assert next(iter(restored))["index"] == 0
    finally:
        again.close()


def test_without_an_early_state_dict_the_first_batch_follows_epoch_fn(store: Path) -> None:
    pipe = build_pipeline(pipe_config(store))
    try:
        first = next(iter(as_dataset(pipe, transform=indexed_transform, epoch_fn=lambda: 2)))
    finally:
        pipe.close()
    assert (first["epoch"], first["index"]) == (2, 0)


@pytest.mark.timeout(60)
def test_num_workers_2_raises_an_error_that_says_why_instead_of_hanging(store: Path) -> None:
    loader, pipe = sdl(pipe_config(store), num_workers=2)
    try:
        it = iter(loader)
        with pytest.raises(RuntimeError) as info:
            next(it)
        message = str(info.value)
        # The failed iterator (its traceback holds it too) stops its two workers here, while
        # the pipeline is open. Collected after pipe.close(), its shutdown waited torch's 5 s
        # join timeout per worker, in whichever later test the garbage collector ran (10 s of
        # a suite run, measured).
        del info, it
        gc.collect()
    finally:
        pipe.close()
    assert "num_workers=0" in message, message
    assert "fork" in message, message
    assert "event loop" in message, message


def test_a_dataloader_that_would_batch_the_batches_again_says_to_pass_batch_size_none(
    store: Path,
) -> None:
    """torch's default batch_size=1 used to turn each batch into (1, B, ...) silently."""
    from torch.utils.data import DataLoader

    pipe = build_pipeline(pipe_config(store))
    try:
        for batching in (DataLoader, StatefulDataLoader):
            with pytest.raises(ValueError, match=r"\(1, batch_size, \.\.\.\).*batch_size=None"):
                next(iter(batching(as_dataset(pipe))))
            with pytest.raises(ValueError, match="batch_size=None"):
                next(iter(batching(as_dataset(pipe), batch_size=4)))
            item = next(iter(batching(as_dataset(pipe), batch_size=None)))  # as it says
            assert item["x"].shape[0] == pipe_config(store)["batch_size"]
        assert next(iter(as_dataset(pipe)))["x"].shape[0] == pipe_config(store)["batch_size"]
    finally:
        pipe.close()


@pytest.mark.parametrize("iterated", [False, True], ids=["fresh", "iterated"])
def test_a_state_whose_epoch_epoch_fn_has_moved_past_starts_that_later_epoch_whole(
    store: Path, reference: list[dict], iterated: bool
) -> None:
    """A trainer that counts a stopped epoch as done (Lightning's ``should_stop``) asks for the
    next one: the loaded state's tail is not replayed under the later epoch's number."""
    cfg = pipe_config(store)
    pipe = build_pipeline(cfg)
    trainer_epoch = 0
    dataset = as_dataset(pipe, transform=indexed_transform, epoch_fn=lambda: trainer_epoch)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()  # epoch 0, after 4 batches
    if not iterated:
        pipe.close()
        pipe = build_pipeline(cfg)
        dataset = as_dataset(pipe, transform=indexed_transform, epoch_fn=lambda: trainer_epoch)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    trainer_epoch = 1
    loader.load_state_dict(state)
    assert len(loader) == N_BATCHES
    assert [record_item(i) for i in loader] == as_items(reference[N_BATCHES : 2 * N_BATCHES])
    pipe.close()


def _three_members(root: Path) -> Collection:
    """Members ``m0..m2`` of 5, 3 and 7 samples, each an image ``(n, 4, 6)`` chunked
    ``(2, 4, 3)``, whose values name member and sample."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    for m, n in enumerate((5, 3, 7)):
        a = group.create_array(f"m{m}/0", shape=(n, 4, 6), chunks=(2, 4, 3), dtype="f4")
        a[:] = 1000 * m + np.arange(n * 24, dtype="f4").reshape(n, 4, 6)
    return Collection.from_groups(root, ["m0", "m1", "m2"], {"image": "0"})


def test_as_dataset_items_by_to_item_name_each_rows_member_and_sample_as_the_pipeline_does(
    tmp_path: Path,
) -> None:
    """Items of ``to_torch(batch)`` (the default) hold the arrays only: a collection's rows
    could not be told apart by member or sample through ``as_dataset``. Two pipelines of one
    shuffled configuration, one iterated directly and one through ``StatefulDataLoader``, two
    epochs: the items carry the batches' ``members``, ``sample_indices`` and ``patch_origins``,
    in order, exactly; each row is zarr's read of the member and sample it names."""
    coll = _three_members(tmp_path / "three.zarr")
    images = [zarr.open_array(tmp_path / "three.zarr", path=f"m{m}/0")[...] for m in range(3)]
    manifest = split_by_member(coll, {"train": 1.0})
    image = coll["image"]
    for views in ({"x": image, "y": image.shift(1)}, {"p": image.patches({1: 2, 2: 3})}):
        pipes = [insitu_pipeline(coll, manifest, views, batch_size=4, seed=5) for _ in range(2)]
        try:
            loader = Loader(pipes[0])
            batches = [b for _ in range(2) for b in loader]
            dataset = as_dataset(pipes[1], transform=to_item)
            dl = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
            items = [item for _ in range(2) for item in dl]
        finally:
            for pipe in pipes:
                pipe.close()
        assert len(items) == len(batches) == 2 * len(pipes[0])
        rows = [int(m) for b in batches[: len(batches) // 2] for m in b.members[next(iter(views))]]
        assert rows != sorted(rows), "shuffled: the members interleave"
        for batch, item in zip(batches, items, strict=True):
            assert set(item) == {*views, "sample_indices", "members", "patch_origins"}
            for key in ("sample_indices", "members", "patch_origins"):
                want = getattr(batch, key)
                assert set(item[key]) == set(want) and (key != "members" or set(want) == set(views))
                for label, tensor in item[key].items():
                    assert tensor.dtype == torch.int64
                    np.testing.assert_array_equal(tensor.numpy(), want[label], strict=True)
            for label in views:
                assert torch.equal(item[label], torch.from_numpy(batch[label]))
                for r in range(len(batch)):  # zarr: the member and sample the item names
                    m, i = int(item["members"][label][r]), int(item["sample_indices"][label][r])
                    want_row = images[m][i]
                    if "p" in views:
                        y, x = (int(v) for v in item["patch_origins"][label][r])
                        want_row = want_row[y : y + 2, x : x + 3]
                    np.testing.assert_array_equal(item[label][r].numpy(), want_row)
        # what Lightning does with an item: infer its batch size (one, unambiguous) and move it
        lightning = pytest.importorskip("lightning")
        import warnings

        from lightning.pytorch.utilities.data import extract_batch_size

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert extract_batch_size(items[0]) == len(batches[0])
        moved = lightning.fabric.utilities.apply_func.move_data_to_device(items[0], "cpu")
        assert torch.equal(moved["members"][label], items[0]["members"][label])


def test_a_label_named_like_a_key_to_item_adds_is_refused_naming_the_fix() -> None:
    from insitubatch_nodes.batch import Batch

    batch = Batch({"members": np.zeros((2, 3))}, {"members": np.arange(2)}, epoch=0, index=0)
    with pytest.raises(ValueError, match=r"\['members'\].*rename.*transform=to_torch"):
        to_item(batch)
