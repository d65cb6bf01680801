"""``PlanConfig``: one object for the read-plan settings, checked once, where it is made.

The internal functions (``plan_epoch``, ``ReadPlanNode``, ``choose_schedule``,
``schedule_floors``) take the config only; the builder takes it or the same loose keywords and
builds the same plans (epochs, fetches, checkpoint config) from either; invalid values raise
what the keywords raise; a config beside a keyword off its default is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan import (
    PlanConfig,
    SplitManifest,
    choose_schedule,
    plan_epoch,
    schedule_floors,
)
from insitubatch_nodes.plan.config import SCHEDULE_FIELDS
from insitubatch_nodes.stages import ReadPlanNode
from insitubatch_nodes.synthetic import make_era5_like


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plan_config") / "era5.zarr"
    make_era5_like(root, n_time=128, n_lat=8, n_lon=16, samples_per_chunk=8, variables=["t2m"])
    return root


@pytest.fixture(scope="module")
def views(store_path: Path) -> dict[str, ArrayGeometry]:
    t2m = open_geometries(store_path, ["t2m"])["t2m"]
    return {"x": t2m, "y": t2m.shift(1)}


@pytest.fixture(scope="module")
def manifest(views: dict[str, ArrayGeometry]) -> SplitManifest:
    return split_by_chunk(views["x"].base, (0.75, 0.125, 0.125))  # 16 chunks: 12 / 2 / 2


SETTINGS: dict[str, Any] = {
    "batch_size": 6,
    "block_chunks": 3,
    "seed": 5,
    "rank": 1,
    "world_size": 2,
    "remainder": "pad",
}


def _epochs(node: ReadPlanNode, n: int = 2) -> list[list[tuple[Any, ...]]]:
    """``n`` epochs of ``node``: each batch's epoch, index, anchors, fetches and releases."""
    out = []
    for _ in range(n):
        node.reset(None)
        batches = []
        while True:
            try:
                b = node.next()
            except StopIteration:
                break
            batches.append((b.epoch, b.index, b.anchors.tolist(), b.fetches, b.releases))
        out.append(batches)
    return out


# -- the same plans --------------------------------------------------------------------------


def test_a_read_plan_node_draws_the_plans_plan_epoch_draws_from_its_config(
    manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    config = PlanConfig(**SETTINGS)
    boxed = ReadPlanNode(manifest, views, config=config)
    assert boxed.plan_config == config
    assert boxed.config() == ReadPlanNode(manifest, views, config=config).config()
    epochs = _epochs(boxed)
    for e, batches in enumerate(epochs):
        plan = plan_epoch(manifest, views, config, epoch=e)
        anchors = [a for batch in batches for a in batch[2]]
        assert anchors == plan.anchors.tolist()
        assert [b[4] for b in batches] == [plan.batch_releases(i) for i in range(len(batches))]
    for name in ("split", "batch_size", "block_chunks", "shuffle", "seed", "rank", "ramp"):
        assert getattr(boxed, name) == getattr(config, name)
    assert (boxed.rank, boxed.world_size, boxed.remainder) == (1, 2, "pad")


def test_a_read_plan_node_keeps_its_config_with_rank_and_world_size_resolved(
    manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    node = ReadPlanNode(manifest, views, config=PlanConfig(world_size=3))
    assert (node.plan_config.rank, node.plan_config.world_size) == (0, 3)
    single = ReadPlanNode(manifest, views)  # no torch.distributed: rank 0 of 1
    assert single.plan_config == PlanConfig(rank=0, world_size=1)
    with pytest.raises(AttributeError, match="fixed at construction"):
        node.plan_config = PlanConfig()


def test_the_schedule_functions_depend_only_on_the_schedule_fields_of_a_config(
    manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    config = PlanConfig(**SETTINGS)
    assert set(SCHEDULE_FIELDS) <= {f.name for f in dataclasses.fields(PlanConfig)}
    floors = schedule_floors(manifest, views, config)
    # shuffle, seed, rank and ramp are not schedule fields: the bounds hold for all of them
    other = config.replace(shuffle=False, seed=9, rank=0, ramp=False)
    assert schedule_floors(manifest, views, other) == floors
    for budget in (None, floors.bounded, floors.read_once):
        assert choose_schedule(manifest, views, budget, config) == choose_schedule(
            manifest, views, budget, other
        )
    assert schedule_floors(manifest, views, config.replace(batch_size=3)) != floors
    with pytest.raises(ValueError, match="floor"):
        choose_schedule(manifest, views, 1, config)


def _run(pipe: Any) -> tuple[dict[str, Any], list[list[int]]]:
    with pipe:
        anchors = [batch.sample_indices["x"].tolist() for batch in Loader(pipe)]
    return pipe.stages.plan.config(), anchors


def test_a_pipeline_built_from_a_config_delivers_the_same_batches(
    store_path: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    settings = {**SETTINGS, "shuffle": True, "cross_split_windows": False}
    loose = insitu_pipeline(store_path, manifest, views, report=False, **settings)
    config = PlanConfig(**settings)
    boxed = insitu_pipeline(store_path, manifest, views, report=False, config=config)
    assert boxed.stages.plan.plan_config == loose.stages.plan.plan_config == config
    assert boxed.stages.gather.batch_size == loose.stages.gather.batch_size == 6
    got, want = _run(boxed), _run(loose)
    assert got == want
    assert len(got[1]) > 1


def test_a_pipeline_config_carries_ramp_which_has_no_keyword(
    store_path: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    pipe = insitu_pipeline(
        store_path, manifest, views, report=False, config=PlanConfig(batch_size=4, ramp=False)
    )
    with pipe:
        assert pipe.stages.plan.ramp is False


# -- checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"split": "validation"}, ValueError, "split must be one of"),
        ({"split": 0}, ValueError, "split must be one of"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
        ({"batch_size": 8.0}, TypeError, "batch_size must be an integer"),
        ({"block_chunks": True}, TypeError, "block_chunks must be an integer"),
        ({"shuffle": 1}, TypeError, "shuffle must be True or False"),
        ({"seed": -1}, ValueError, "seed must be an integer >= 0"),
        ({"seed": 1.5}, TypeError, "seed must be an integer"),
        ({"rank": 0.0}, TypeError, "rank must be an integer"),
        ({"world_size": True}, TypeError, "world_size must be an integer"),
        ({"rank": 2, "world_size": 2}, ValueError, "need 0 <= rank < world_size"),
        ({"world_size": 0}, ValueError, "need 0 <= rank < world_size"),
        ({"ramp": "yes"}, TypeError, "ramp must be True or False"),
        ({"cross_split_windows": "no"}, TypeError, "cross_split_windows must be True or"),
        ({"remainder": "keep"}, ValueError, "remainder must be"),
        ({"remainder": None}, TypeError, "remainder must be"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__,
)
def test_an_invalid_setting_raises_what_the_loose_keyword_raises(
    store_path: Path,
    manifest: SplitManifest,
    views: dict[str, ArrayGeometry],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        PlanConfig(**kwargs)
    if "ramp" not in kwargs:  # (ramp has no builder keyword)
        with pytest.raises(error, match=match):
            insitu_pipeline(store_path, manifest, views, **kwargs)
    with pytest.raises(error, match=match):
        PlanConfig().replace(**kwargs)


def test_a_config_normalises_numpy_values_to_plain_python() -> None:
    config = PlanConfig(batch_size=np.int64(8), shuffle=np.bool_(False), world_size=np.int32(2))
    assert type(config.batch_size) is int and type(config.world_size) is int
    assert config.shuffle is False
    assert config == PlanConfig(batch_size=8, shuffle=False, world_size=2)
    assert hash(config) == hash(PlanConfig(batch_size=8, shuffle=False, world_size=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3  # type: ignore[misc]


def test_replace_checks_the_copy_and_leaves_the_original() -> None:
    config = PlanConfig(batch_size=8)
    val = config.replace(split="val", shuffle=False)
    assert (val.split, val.shuffle, val.batch_size) == ("val", False, 8)
    assert (config.split, config.shuffle) == ("train", True)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        config.replace(batch_size=0)
    with pytest.raises(TypeError):
        config.replace(nonsense=1)


def test_a_config_beside_a_plan_keyword_is_refused_by_the_builder(
    store_path: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    config = PlanConfig(batch_size=8)
    with pytest.raises(TypeError, match=r"insitu_pipeline: pass config=.*\(shuffle\)"):
        insitu_pipeline(store_path, manifest, views, config=config, shuffle=False)
    with pytest.raises(TypeError, match=r"insitu_pipeline: pass config=.*\(batch_size\)"):
        insitu_pipeline(store_path, manifest, views, config=config, batch_size=8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="insitu_pipeline: config must be a PlanConfig"):
        insitu_pipeline(store_path, manifest, views, config={"batch_size": 8})  # type: ignore[arg-type]
    # keywords left at their defaults are no conflict
    pipe = insitu_pipeline(
        store_path, manifest, views, report=False, config=config, split="train", batch_size=32
    )
    with pipe:
        assert pipe.stages.plan.batch_size == 8


def test_the_internal_functions_take_a_config_and_no_loose_plan_keywords(
    manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    """The new contract (issue 29): only the builder takes loose keywords; ``plan_epoch``,
    ``ReadPlanNode``, ``choose_schedule`` and ``schedule_floors`` take a ``PlanConfig``
    (``None``: the defaults), refuse anything else, and have no plan keywords to mix in."""
    config = PlanConfig(batch_size=8)
    loose: dict[str, Any] = {"seed": 3}
    with pytest.raises(TypeError, match="unexpected keyword"):
        ReadPlanNode(manifest, views, config=config, **loose)
    with pytest.raises(TypeError, match="unexpected keyword"):
        schedule_floors(manifest, views, config, **loose)
    with pytest.raises(TypeError, match="unexpected keyword"):
        choose_schedule(manifest, views, None, config, **loose)
    with pytest.raises(TypeError, match="unexpected keyword"):
        plan_epoch(manifest, views, config, **loose)
    not_a_config: Any = {"batch_size": 8}
    for where, call in (
        ("ReadPlanNode", lambda: ReadPlanNode(manifest, views, config=not_a_config)),
        ("schedule_floors", lambda: schedule_floors(manifest, views, not_a_config)),
        ("choose_schedule", lambda: choose_schedule(manifest, views, None, not_a_config)),
        ("plan_epoch", lambda: plan_epoch(manifest, views, not_a_config)),
    ):
        with pytest.raises(TypeError, match=f"{where}: config must be a PlanConfig"):
            call()
    # None is the default config
    assert ReadPlanNode(manifest, views).plan_config == PlanConfig(rank=0, world_size=1)
    assert schedule_floors(manifest, views) == schedule_floors(manifest, views, PlanConfig())
    assert plan_epoch(manifest, views).anchors.tolist() == (
        plan_epoch(manifest, views, PlanConfig(rank=0, world_size=1)).anchors.tolist()
    )


# -- the DataModule --------------------------------------------------------------------------


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_the_data_module_derives_val_and_test_from_its_training_config(
    store_path: Path, manifest: SplitManifest
) -> None:
    pytest.importorskip("lightning")
    from insitubatch_nodes.lightning import InSituDataModule

    dm = InSituDataModule(
        store_path,
        ["t2m"],
        manifest,
        config=PlanConfig(batch_size=6, block_chunks=3, seed=7, remainder="pad"),
        eval_batch_size=4,
    )
    assert dm.plan_config == PlanConfig(batch_size=6, block_chunks=3, seed=7, remainder="pad")
    assert dm.plan_config_for("val") == dm.plan_config.replace(
        split="val", batch_size=4, shuffle=False, remainder="uneven"
    )
    dm.batch_size = 10  # as Lightning's batch-size finder does
    assert dm.plan_config.batch_size == 10 and dm.batch_size == 10
    try:
        train = dm.train_dataloader().pipeline.stages.plan
        val = dm.val_dataloader().pipeline.stages.plan
        test = dm.test_dataloader().pipeline.stages.plan
        assert train.plan_config == dm.plan_config.replace(rank=0, world_size=1)
        assert (val.split, val.batch_size, val.shuffle, val.seed) == ("val", 4, False, 7)
        assert (test.split, test.batch_size, test.shuffle) == ("test", 4, False)
    finally:
        dm.teardown()
    with pytest.raises(ValueError, match="block_chunks must be a positive integer"):
        InSituDataModule(store_path, ["t2m"], manifest, config=PlanConfig(block_chunks=0))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        InSituDataModule(store_path, ["t2m"], manifest, eval_batch_size=-1)
    with pytest.raises(TypeError, match="config must be a PlanConfig"):
        InSituDataModule(store_path, ["t2m"], manifest, config={"block_chunks": 3})  # type: ignore[arg-type]
