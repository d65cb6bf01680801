"""The build's memory check: one rule for both budgets, and what it counts.

Found wrong, fixed:

* The automatic budget and an explicit ``cache_budget_bytes`` were held to two rules: the
  automatic one to its first epoch's floor plus the batches in flight, an explicit one to
  ``min(budget, split)`` plus those plus the decode scratch. On the same memory, a pipeline
  whose automatic budget was built was refused an explicit budget of exactly the bytes the
  automatic one grew to (the decode scratch of edge chunks, 2 threads x 2 arrays, made the
  difference). Now one rule (``plan/memory_floor.py``: ``HeldMemory``, ``refuse_beyond_memory``)
  counts the same parts for both, and the automatic budget counts as what its first epoch grows
  it to:
  ``test_the_automatic_and_an_explicit_budget_of_the_same_slot_bytes_are_held_to_one_rule``.
* A backing of the user's own could not say its slots are in RAM, so a pipeline on it was
  never checked. ``SlotBacking`` now takes an optional ``in_ram`` (``RamBacking``'s is True,
  ``SpillBacking``'s False; absent: not checked, as before):
  ``test_a_custom_backing_that_says_its_slots_are_in_ram_is_checked_and_one_that_does_not_is_not``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import write_era5

from insitubatch_nodes import (
    InSituPipeline,
    Loader,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.plan import memory_floor
from insitubatch_nodes.stages import buffers

pytestmark = pytest.mark.timeout(60)


def _fake_memory(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The process may use ``nbytes`` (nothing is allocated: the checks ask this function)."""
    monkeypatch.setattr(memory_floor, "usable_memory_bytes", lambda: nbytes)
    monkeypatch.setattr(buffers, "usable_memory_bytes", lambda: nbytes)


@pytest.fixture(scope="module")
def edged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 times in chunks of 8: the last chunk is an edge, decoded aside (scratch)."""
    return write_era5(tmp_path_factory.mktemp("memcheck") / "e.zarr", n_time=60)


_OPTIONS: dict[str, Any] = {"batch_size": 4, "coords": (), "decode_threads": 2, "block_chunks": 2}


def _build(root: Path, **kw: Any) -> InSituPipeline:
    g = open_geometries(root, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    return insitu_pipeline(root, manifest, {"x": g["t2m"], "y": g["z"]}, **{**_OPTIONS, **kw})


def test_the_automatic_and_an_explicit_budget_of_the_same_slot_bytes_are_held_to_one_rule(
    edged: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _build(edged) as pipe:  # the machine's memory: built
        auto = pipe.stages.pool.budget_bytes  # what the first epoch grew it to
        in_flight = 4 * pipe.context.buffers.batch_nbytes  # prefetch_depth=2: 4 batches
    g = open_geometries(edged, ["t2m", "z"])
    scratch = memory_floor.decode_scratch_bytes(g, 2)  # edge chunks: both arrays, 2 threads
    assert scratch > 0
    need = auto + in_flight + scratch  # the same slot bytes, the same batches and scratch
    for memory, built in ((need - 1, False), (need, True)):
        _fake_memory(monkeypatch, memory)
        for budget in (None, auto):  # the automatic budget, and an explicit one as large
            if built:
                with _build(edged, cache_budget_bytes=budget) as pipe:
                    assert sum(len(b["x"]) for b in Loader(pipe)) == 60
                    assert pipe.stages.pool.budget_bytes == auto
                continue
            what = "automatic budget cannot hold" if budget is None else "cannot be held here"
            with pytest.raises(ValueError, match=(
                rf"{what}.*{auto:,} bytes .*of slots in RAM.*{in_flight:,} bytes .*batches in "
                rf"flight.*{scratch:,} bytes .*decode scratch.*{need:,} bytes .*in all.*"
                rf"{memory:,} bytes .*this process may use; .*lower.*decode_threads"
            )):  # fmt: skip
                _build(edged, cache_budget_bytes=budget)


class _Heap:
    """A backing of the user's own: slots from ``np.empty`` (in RAM, whether it says so or not)."""

    name = "heap"

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def release(self, buffer: np.ndarray) -> None:
        pass


class _SaysRam(_Heap):
    in_ram = True


def test_a_custom_backing_that_says_its_slots_are_in_ram_is_checked_and_one_that_does_not_is_not(
    edged: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _build(edged) as pipe:
        in_flight = 4 * pipe.context.buffers.batch_nbytes
    _fake_memory(monkeypatch, in_flight + 1000)  # the batches fit, the slots do not
    with pytest.raises(ValueError, match=r"cache_budget_bytes=1,000,000 cannot be held here"):
        _build(edged, cache_budget_bytes=10**6, backing=_SaysRam())
    with pytest.raises(ValueError, match="automatic budget cannot hold this pipeline"):
        _build(edged, backing=_SaysRam())
    with _build(edged, cache_budget_bytes=10**6, backing=_Heap()) as pipe:  # not said: unchecked
        assert not pipe.stages.pool.slots_in_ram
        assert sum(len(b["x"]) for b in Loader(pipe)) == 60
