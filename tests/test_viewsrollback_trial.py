"""``set_views`` is all or nothing (the viewsrollback trial of 2026-12-07).

Since the rankfail trial, a ``set_views`` over a ``torch.distributed`` group that raised on one
rank raised on every rank (the others a ``RankFailedError``), but where it had succeeded it had
taken effect: the plan's pending views, the fetch stage's memory count, the new stacks'
constants among the gather stage's batch transforms. A user who caught the error and went on
(a notebook, a sweep) trained with rank 0 on the new views and rank 1 on the old ones: other
samples, other batch counts per rank, then a DDP hang or wrong data. Now nothing takes effect
on any rank unless every rank's ``set_views`` succeeded.

Two gloo ranks in real processes (forked from the tests' fork server, ``spawn_ranks``, once for
the module), one pipeline each, dealt over the group; rank 1 cannot read the static field a
new stack needs (monkeypatched, as in ``tests/test_rankfail_trial.py``). The oracle is what
each rank's next epoch reads, checked against the store read with zarr, and its batch count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack

pytestmark = pytest.mark.timeout(180)  # (two gloo ranks forked once, for the module)

NT, NC = 16, 3
PG_TIMEOUT_S = 60
DENIED = "403 Forbidden (this rank's credentials)"


def _write_store(root: Path) -> Path:
    """``data (time, cell)``, two times a chunk, and a static ``orog (cell)``."""
    group = zarr.open_group(root, mode="w")
    data = group.create_array(
        "data", shape=(NT, NC), chunks=(2, NC), dtype="f4", dimension_names=("time", "cell")
    )
    data[...] = np.arange(NT * NC, dtype="f4").reshape(NT, NC) + 1
    orog = group.create_array("orog", shape=(NC,), chunks=(NC,), dtype="f4",
                              dimension_names=("cell",))  # fmt: skip
    orog[...] = np.arange(NC, dtype="f4") + 100
    return root


def _views(root: str) -> dict[str, dict[str, Any]]:
    """The views of the trial, by name: as built (16 anchors: 4 batches a rank), a second
    label shifted by 4 (12 anchors: 3 batches) and a stack with the static ``orog`` and a
    label shifted by 8 (8 anchors: 2 batches)."""
    g = open_geometries(root)
    data = g["data"]
    return {
        "built": {"x": data},
        "shifted": {"x": data, "y": data.shift(4)},
        "stacked": {"x": stack({"data": data, "orog": g["orog"]}), "y": data.shift(8)},
    }


def _trial(root: str) -> tuple[dict[str, dict[str, Any]], np.ndarray, np.ndarray, Any]:
    """:func:`_views`, the store's ``data`` and ``orog`` (zarr's read: the oracle) and a
    manifest of every anchor in ``train``."""
    views = _views(root)
    store = zarr.open_group(root, mode="r")
    data, orog = np.asarray(store["data"][...]), np.asarray(store["orog"][...])
    return views, data, orog, split_by_chunk(views["built"]["x"], (1.0, 0.0, 0.0))


def _epoch(loader: Any, pipe: Any, data: np.ndarray, orog: np.ndarray) -> dict[str, Any]:
    """One epoch of ``loader``: ``len(pipe)`` before it, its batches, each label's rows
    (anchor indices) and shape, and whether every row is the store's (zarr's) data there."""
    told = len(pipe)
    rows: dict[str, list[int]] = {}
    shapes: set[str] = set()
    same = True
    for b in loader:
        for label, idx in b.sample_indices.items():
            rows.setdefault(label, []).extend(int(i) for i in idx)
            got = np.asarray(b[label])
            shapes.add(f"{label}{tuple(got.shape[1:])}")
            want = data[np.asarray(idx)]
            if got.ndim == 3:  # the stack: data, then orog on every row
                want = np.stack([want, np.broadcast_to(orog, want.shape)], axis=1)
            same = same and bool(np.array_equal(got, want))
    return {"len": told, "batches": len(rows["x"]) // 2, "rows": rows,
            "shapes": sorted(shapes), "same_as_zarr": same}  # fmt: skip


def set_views_on_two_ranks(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    """One gloo rank (``spawn_ranks``): build over the group; ``set_views`` to the stack,
    which only rank 1 cannot read (the read of ``orog`` denied), then one epoch; the same
    after ``set_views`` to the shifted views succeeded on both; then the stack again, readable
    on both, and one epoch. What each step did goes to ``out.format(rank)``."""
    import torch.distributed as dist

    import insitubatch_nodes.pipeline as built

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))  # fmt: skip
    said: dict[str, Any] = {}
    real_read = built.read_static

    def unreadable(*args: Any, **kw: Any) -> Any:
        raise PermissionError(f"cannot read 'orog/0': {DENIED}")

    def attempt(views: Mapping[str, Any], fails_on_rank_1: bool) -> str:
        built.read_static = unreadable if fails_on_rank_1 and rank == 1 else real_read
        try:
            pipe.set_views(views)
            return "done"
        except Exception as exc:
            said.setdefault("notes", getattr(exc, "__notes__", []))
            return type(exc).__name__
        finally:
            built.read_static = real_read

    try:
        views, data, orog, manifest = _trial(root)
        with insitu_pipeline(root, manifest, views["built"], batch_size=2, coords=(),
                             seed=0) as pipe:  # fmt: skip
            loader = Loader(pipe)
            before = {
                "counted": pipe.stages.fetch.counted.total,
                "transforms": len(pipe.stages.gather.batch_transforms),
            }
            said["built"] = _epoch(loader, pipe, data, orog)
            said["failed"] = attempt(views["stacked"], fails_on_rank_1=True)
            said["kept"] = {
                "counted": pipe.stages.fetch.counted.total,
                "transforms": len(pipe.stages.gather.batch_transforms),
            }
            said["after_failed"] = _epoch(loader, pipe, data, orog)
            said["pending"] = attempt(views["shifted"], fails_on_rank_1=False)
            said["failed_over_pending"] = attempt(views["stacked"], fails_on_rank_1=True)
            said["after_failed_over_pending"] = _epoch(loader, pipe, data, orog)
            said["taken"] = attempt(views["stacked"], fails_on_rank_1=False)
            said["after_taken"] = _epoch(loader, pipe, data, orog)
            said["before"] = before
        Path(out.format(rank)).write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank said, by step: one run of two ranks for the tests below."""
    from resume_helpers import spawn_ranks

    tmp = tmp_path_factory.mktemp("viewsrollback")
    root = _write_store(tmp / "s.zarr")
    out = str(tmp / "rank{}.json")
    args = (2, str(tmp / "init"), str(root), out)
    spawn_ranks(set_views_on_two_ranks, args=args, nprocs=2, workdir=tmp / "ranks")
    return [json.loads(Path(out.format(r)).read_text()) for r in range(2)]


def _assert_reads(epochs: list[dict[str, Any]], shapes: list[str], batches: int, n: int) -> None:
    """Both ranks' epochs read ``shapes`` in ``batches`` batches (as ``len`` said before),
    the rows the store's, the ``n`` anchors ``0 .. n - 1`` dealt between them, each once."""
    for e in epochs:
        assert e["shapes"] == shapes, epochs
        assert e["batches"] == e["len"] == batches, epochs
        assert e["same_as_zarr"], epochs
    anchors = sorted(a for e in epochs for a in e["rows"]["x"])
    assert anchors == list(range(n)), epochs


def test_a_set_views_that_failed_on_rank_1_leaves_both_ranks_reading_the_views_in_effect(
    ranks: list[dict[str, Any]],
) -> None:
    """Before: rank 0 read the stack (2 batches), rank 1 the views as built (4 batches)."""
    assert [r["failed"] for r in ranks] == ["RankFailedError", "PermissionError"]
    _assert_reads([r["built"] for r in ranks], ["x(3,)"], 4, NT)
    _assert_reads([r["after_failed"] for r in ranks], ["x(3,)"], 4, NT)


def test_a_set_views_that_failed_on_rank_1_changed_nothing_on_rank_0(
    ranks: list[dict[str, Any]],
) -> None:
    """Before: rank 0's memory count was the stack's, and the stack's constants ran first
    among its batch transforms. Its ``RankFailedError`` says so."""
    for r in ranks:
        assert r["kept"] == r["before"], r
    assert any("nothing of set_views took effect on this rank" in n for n in ranks[0]["notes"])


def test_a_set_views_that_failed_on_rank_1_keeps_the_views_an_earlier_one_gave(
    ranks: list[dict[str, Any]],
) -> None:
    """Before: rank 0 read the stack (2 batches), rank 1 the shifted views (3 batches)."""
    assert [r["pending"] for r in ranks] == ["done", "done"]
    assert [r["failed_over_pending"] for r in ranks] == ["RankFailedError", "PermissionError"]
    _assert_reads([r["after_failed_over_pending"] for r in ranks], ["x(3,)", "y(3,)"], 3, 12)


def test_views_every_rank_can_read_are_taken_on_every_rank_after_a_failure(
    ranks: list[dict[str, Any]],
) -> None:
    assert [r["taken"] for r in ranks] == ["done", "done"]
    _assert_reads([r["after_taken"] for r in ranks], ["x(2, 3)", "y(3,)"], 2, 8)


# -- one process: a set_views refused here leaves the pipeline as it was -----------------------


@pytest.mark.parametrize("refused_by", ["memory", "read"])
def test_a_set_views_refused_here_leaves_the_pipeline_reading_the_views_it_had_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_by: str
) -> None:
    """A ``set_views`` whose memory check refuses it (a window of 4 steps on a memory that
    holds the shifted views, no more), or whose static field cannot be read, after one that
    was taken: the next epoch reads the shifted views (6 batches), counted as before. (So on
    main too: a rank's own failure changed nothing; the trial keeps it so.)"""
    import insitubatch_nodes.pipeline as built
    from insitubatch_nodes.plan import memory_floor
    from insitubatch_nodes.stages import buffers

    root = str(_write_store(tmp_path / "s.zarr"))
    views, data, orog, manifest = _trial(root)
    with insitu_pipeline(root, manifest, views["built"], batch_size=2, coords=(),
                         seed=0) as pipe:  # fmt: skip
        pipe.set_views(views["shifted"])
        counted = pipe.stages.fetch.counted
        transforms = list(pipe.stages.gather.batch_transforms)
        if refused_by == "memory":
            for module in (memory_floor, buffers):
                monkeypatch.setattr(module, "usable_memory_bytes", lambda: counted.total)
            wider = {"x": views["built"]["x"].window([0, 1, 2, 3]), "y": views["shifted"]["y"]}
            with pytest.raises(ValueError, match="set_views: the pipeline cannot hold these"):
                pipe.set_views(wider)
        else:

            def unreadable(*args: Any, **kw: Any) -> Any:
                raise PermissionError(f"cannot read 'orog/0': {DENIED}")

            monkeypatch.setattr(built, "read_static", unreadable)
            with pytest.raises(PermissionError, match="orog/0"):
                pipe.set_views(views["stacked"])
        monkeypatch.undo()
        assert pipe.stages.fetch.counted == counted
        assert list(pipe.stages.gather.batch_transforms) == transforms
        _assert_reads([_epoch(Loader(pipe), pipe, data, orog)], ["x(3,)", "y(3,)"], 6, 12)
