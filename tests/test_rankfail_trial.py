"""Ranks that build together fail together (the rankfail trial of 2026-12-07).

Two gloo ranks in real processes (forked from the tests' fork server, ``spawn_ranks``) build
their pipelines over one store in anemoi-datasets' layout, where only rank 1 cannot read the
group's attribute document (``missing_dates`` decides which samples a build reads: a 403 for
that rank's credentials, monkeypatched in that rank). Before, rank 1 raised and rank 0 built
its pipeline and went on, unaware, to train until its first collective call waited for rank
1 (DDP's gradient sync: until the group's timeout, or until the launcher ended the job);
with ``missing_objects="drop"`` rank 0 waited in the build's own plan comparison for a rank
that never came, and what it raised there named neither rank 1 nor its reason. The same for a
``set_views`` whose static field only rank 1 cannot read. Now every rank raises at that
point, rank 0 a ``RankFailedError`` naming rank 1 and what it raised, well within the group's
timeout. The oracle is what each rank's build returned or raised, and when.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack

pytestmark = pytest.mark.timeout(180)  # (two gloo ranks forked once, for every test here)

NT, NV, NC = 8, 2, 3
PG_TIMEOUT_S = 60  # the group's timeout: what rank 0 would wait for rank 1 at most
DENIED = "403 Forbidden (this rank's credentials)"


def _write_anemoi(root: Path) -> Path:
    """A store as anemoi-datasets writes it (zarr v2): ``data (time, variable, cell)`` one
    date a chunk, the names in the group's ``variables``, no ``missing_dates``, and a static
    ``orog (cell)``."""
    group = zarr.open_group(root, mode="w", zarr_format=2)
    data = group.create_array("data", shape=(NT, NV, NC), chunks=(1, NV, NC), dtype="f4")
    data[...] = np.arange(NT * NV * NC, dtype="f4").reshape(NT, NV, NC) + 1
    data.attrs["_ARRAY_DIMENSIONS"] = ["time", "variable", "cell"]
    orog = group.create_array("orog", shape=(NC,), chunks=(NC,), dtype="f4")
    orog[...] = np.arange(NC, dtype="f4") + 5
    orog.attrs["_ARRAY_DIMENSIONS"] = ["cell"]
    group.attrs.update({"variables": ["a", "b"], "frequency": "6h"})
    return root


def _outcome(step: Any) -> dict[str, Any]:
    """What ``step()`` returned (``{"done": ...}``) or raised, and how long it took."""
    start = time.monotonic()
    try:
        said: dict[str, Any] = {"done": step()}
    except Exception as exc:
        said = {"raised": type(exc).__name__, "message": str(exc)}
    return {**said, "seconds": time.monotonic() - start}


def fail_on_rank_1(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    """One gloo rank (``spawn_ranks``): build over the group with ``missing_objects`` "read"
    then "drop", the group's attribute document unreadable on rank 1 only; then build on
    both and ``set_views`` to a stack with a static member that rank 1 cannot read; last,
    rank 0 alone builds the whole split (``world_size=1``). Each step's outcome goes to
    ``out.format(rank)``."""
    import torch.distributed as dist

    from insitubatch_nodes.io import anemoi

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))  # fmt: skip
    said: dict[str, Any] = {}
    try:
        geoms = open_geometries(root)
        manifest = split_by_chunk(geoms["data"], (1.0, 0.0, 0.0))
        data = geoms["data"].sel(variable="a")  # (a field of the stack, as orog is)
        real_read = anemoi.read_documents

        def denied(store: Any, keys: Any, *args: Any, errors: Any = None, **kw: Any) -> Any:
            texts = real_read(store, keys, *args, errors=errors, **kw)
            for key in keys:
                if key.endswith(".zattrs") and errors is not None:
                    errors[key] = PermissionError(DENIED)
            return texts

        def build(**kw: Any) -> Any:
            return insitu_pipeline(root, manifest, {"x": stack({"data": data})},
                                   batch_size=2, coords=(), **kw)  # fmt: skip

        def length(**kw: Any) -> int:
            with build(**kw) as pipe:
                return len(pipe)

        if rank == 1:
            anemoi.read_documents = denied
        for how in ("read", "drop"):
            said[how] = _outcome(lambda how=how: length(missing_objects=how))
            Path(out.format(rank)).write_text(json.dumps(said))
        anemoi.read_documents = real_read
        with build() as pipe:
            if rank == 1:  # the static field a new stack member needs: read in set_views
                import insitubatch_nodes.pipeline as built

                def unreadable(*args: Any, **kw: Any) -> Any:
                    raise PermissionError(f"cannot read 'orog/0': {DENIED}")

                built.read_static = unreadable  # type: ignore[assignment]
            views = {"x": stack({"data": data, "orog": geoms["orog"]})}
            said["set_views"] = _outcome(lambda: pipe.set_views(views))
        if rank == 0:  # the whole split, this process's own: built alone, meeting no rank
            said["alone"] = _outcome(lambda: length(rank=0, world_size=1))
        Path(out.format(rank)).write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's outcomes, by step: one run of two ranks for the tests below."""
    from resume_helpers import spawn_ranks

    tmp = tmp_path_factory.mktemp("rankfail")
    root = _write_anemoi(tmp / "anemoi.zarr")
    out = str(tmp / "rank{}.json")
    args = (2, str(tmp / "init"), str(root), out)
    try:
        spawn_ranks(fail_on_rank_1, args=args, nprocs=2, workdir=tmp / "ranks")
    except AssertionError as exc:  # (what each rank said before it failed: below)
        print(exc)
    return [json.loads(Path(out.format(r)).read_text()) for r in range(2)]


def _assert_rank_0_names_rank_1(rank0: dict[str, Any], reason: str) -> None:
    assert rank0.get("raised") == "RankFailedError", (
        f"rank 0 did not raise RankFailedError while rank 1 failed: {rank0}"
    )
    message = rank0["message"]
    assert message.startswith("rank 1 of 2 raised during"), message
    assert "PermissionError" in message and reason in message, message
    assert "start every rank again" in message, message
    assert rank0["seconds"] < PG_TIMEOUT_S / 2, rank0  # an answer, not the group's timeout


@pytest.mark.parametrize("missing_objects", ["read", "drop"])
def test_a_build_only_rank_1_cannot_read_raises_on_rank_0_naming_rank_1_and_its_reason(
    outcomes: list[dict[str, Any]], missing_objects: str
) -> None:
    """Before: with "read" rank 0 built its pipeline (4 batches) and went on alone; with
    "drop" it waited in the plan comparison for rank 1, which never came, and raised gloo's
    error naming neither rank 1 nor its reason."""
    rank0, rank1 = (o[missing_objects] for o in outcomes)
    assert rank1.get("raised") == "PermissionError", rank1  # rank 1's own error, as before
    assert "'.zattrs'" in rank1["message"] and DENIED in rank1["message"], rank1
    _assert_rank_0_names_rank_1(rank0, DENIED)
    assert "'.zattrs'" in rank0["message"]  # which document, as rank 1 said


def test_set_views_only_rank_1_cannot_read_raises_on_rank_0_naming_rank_1_and_its_reason(
    outcomes: list[dict[str, Any]],
) -> None:
    """Before: rank 0 took the new views and went on; rank 1 raised."""
    rank0, rank1 = (o["set_views"] for o in outcomes)
    assert rank1.get("raised") == "PermissionError" and "'orog/0'" in rank1["message"], rank1
    _assert_rank_0_names_rank_1(rank0, "'orog/0'")
    assert "during set_views" in rank0["message"]


def test_a_pipeline_of_the_whole_split_built_on_one_rank_alone_waits_for_no_other(
    outcomes: list[dict[str, Any]],
) -> None:
    """``world_size=1`` inside a group of two (rank 1 builds nothing): no exchange, no wait."""
    assert outcomes[0]["alone"] == {"done": NT // 2, "seconds": outcomes[0]["alone"]["seconds"]}
    assert outcomes[0]["alone"]["seconds"] < PG_TIMEOUT_S / 2
