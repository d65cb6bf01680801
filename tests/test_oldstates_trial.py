"""Trial: checkpoints written by the previous release (a654182) restored on today's main.

A script (kept out of the suite: it needs the old worktree) saved ``Loader.state_dict()`` and
the batches after it with a654182, for 7 view sets — a shift, a 3-step window beside a shift
of another array, a ``stack`` of windows, patches, a window with ``stride=2`` and
``missing=[5, 17]``, monthly dates (a window, ``missing=`` a date; a stride of 2 with a
3-month shift) — each shuffled (train, ``remainder="drop"``) and unshuffled (test,
``"uneven"``), on 1 rank and on each of 3 ranks, at an epoch's start, after one batch and at
its end (162 states); and for a ``concat`` of two stores (a window and a shift, 8 rank
set-ups, 12 positions over 4 epochs: 96) and two pipelines mixed by torchdata's
``MultiNodeWeightedSampler`` under its 3 stop criteria (14 positions each: 42). Each was
restored on today's main and the following batches (sample indices, members and a hash of
every array) compared with the old run's, into the next epochs.

Found (fixed):

* An unshuffled state of windows (any views at several offsets: a shift too) on several
  ranks, saved mid-epoch, resumed silently into other rows: today's ``deal_runs`` puts each
  rank's run in store order, where a654182 put the first partial chunk's piece last, and the
  state did not say which rule dealt it (rank 2 of 3 had delivered 16, 17, 18 and owed 19,
  20, 21, 15; restored, it delivered 18, 19, 20, 21: sample 18 twice, 15 never). 8 of the
  162 states, 14 of the 96 ``concat`` ones, and 9 of 18 unshuffled *training* states
  (``remainder="pad"``/``"drop"``, 3 ranks, after 1-3 batches: rank 2 went 36 … 41, then 31,
  32, 33, 42 by the old rule, 33 … 44 restored) went wrong inside their epoch. Now today's
  config says ``"run_order": "store"`` for such plans, and a state without it finishes its
  epoch by the old rule (``deal_runs(store_order=False)``, the dealing
  ``"runs-partial-last"``), as a state saved before windows were dealt in runs finishes its
  epoch in chunks; a state saved during that epoch keeps the old rule too. All 31 now
  continue exactly to their epoch's end.
* A state of monthly means with ``missing=`` saved by a654182 was refused with a message
  naming only the user's changes (the missing= list, the store's gaps): the cause is the
  release (monthly, seasonal and yearly steps now counted in calendar months: a654182 took a
  30-day month after a 31-day one for a gap, dropping 9 of 10 anchors of 12 monthly means).
  The message now also says so, where the plan's steps are counted in months.

Tried and found right: every shuffled state, every state on one rank and of patches (dealt
in chunks) continues exactly; mid-epoch ones through their epoch's end and into the next.
Unshuffled states of windows on several ranks saved at an epoch's start or end go on with
today's rule from that epoch: each rank the same rows as before, in store order (nothing
delivered is lost or repeated: the package's rule for what changes at an epoch boundary).
States with ``missing=`` over monthly dates (whose steps are now counted in calendar months:
the steps fingerprint changed) are refused at every position; without ``missing=`` (a
stride, a shift) monthly states continue exactly. Mixed pipelines (whose restore changed:
``owe_stops``) continue as the old run did at every position, except that a state saved
after the sampler's own last item starts its next epoch at once (any ``Loader`` restored at
an epoch's end does), with the same items.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.pipeline import InSituPipeline
from insitubatch_nodes.stages.loader import Loader

pytestmark = pytest.mark.timeout(60)

# Written by a654182 (before each rank's run went in store order): for rank r of 3, an
# unshuffled shift's Loader state after one batch, and sample_indices["x"] of the batches
# before ("delivered") and after ("rest") it. The store is the one _store writes.
DATA = Path(__file__).parent / "data"
OLD = json.loads((DATA / "oldstates_unshuffled_runs.json").read_text())
# Written by a654182: a Loader state of a window and a shift over 12 monthly means with
# missing= a date, after its one batch (that release counted the steps in seconds, and
# dropped 9 of the 10 anchors as gaps, where today's counts months and drops the 3 the
# missing date holds).
MONTHLY = json.loads((DATA / "oldstates_monthly_missing.json").read_text())


def _store(root: Path) -> Path:
    g = zarr.open_group(root, mode="w")
    a = g.create_array("t", shape=(23, 2), chunks=(4, 2), dtype="f4", compressors=None,
                       dimension_names=("time", "x"))  # fmt: skip
    a[...] = np.arange(46, dtype="f4").reshape(23, 2)
    return root


def _pipe(root: Path, rank: int) -> InSituPipeline:
    geom = open_geometries(root)["t"]
    return insitu_pipeline(
        root, split_by_chunk(geom, (0.0, 0.0, 1.0)), {"x": geom, "y": geom.shift(1)},
        split="test", shuffle=False, remainder="uneven", batch_size=3, rank=rank, world_size=3,
    )  # fmt: skip


def _rest(root: Path, rank: int, state: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The batches after ``state`` (restored on ``rank``), and the epoch after."""
    pipe = _pipe(root, rank)
    try:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        rest = [b.sample_indices["x"].tolist() for b in loader]
        return rest, [b.sample_indices["x"].tolist() for b in loader]
    finally:
        pipe.close()


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_an_unshuffled_runs_state_saved_mid_epoch_by_the_previous_release_finishes_its_epoch_as_it_began(  # noqa: E501
    tmp_path: Path, rank: int
) -> None:
    root = _store(tmp_path / "s.zarr")
    old = OLD["ranks"][str(rank)]
    rest, _ = _rest(root, rank, old["state"])
    assert rest == old["rest"]


def test_every_sample_of_an_old_unshuffled_epoch_resumed_on_three_ranks_is_delivered_once(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr")
    seen, next_epoch = [], []
    for rank in range(3):
        old = OLD["ranks"][str(rank)]
        rest, after = _rest(root, rank, old["state"])
        seen += [i for b in old["delivered"] + rest for i in b]
        next_epoch.append([i for b in after for i in b])
    assert sorted(seen) == list(range(22))
    # the next epoch is today's: each rank's share in store order, the shares end to end
    assert [i for share in next_epoch for i in share] == list(range(22))


def test_a_state_saved_within_an_epoch_resumed_by_the_old_rule_keeps_that_rule(
    tmp_path: Path,
) -> None:
    root = _store(tmp_path / "s.zarr")
    old = OLD["ranks"]["2"]
    pipe = _pipe(root, 2)
    try:
        loader = Loader(pipe)
        loader.load_state_dict(old["state"])
        it = iter(loader)
        assert next(it).sample_indices["x"].tolist() == old["rest"][0]
        again = json.loads(json.dumps(loader.state_dict()))
    finally:
        pipe.close()
    rest, _ = _rest(root, 2, again)
    assert rest == old["rest"][1:]


def test_an_old_state_of_monthly_means_with_missing_dates_is_refused_saying_the_rule_changed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "m.zarr"
    t = pd.date_range("2000-01-01", periods=12, freq="MS")
    data = np.arange(24, dtype="f4").reshape(12, 2)
    xr.Dataset({"t": (("time", "x"), data)}, coords={"time": t}).to_zarr(
        root, mode="w", consolidated=False, encoding={"t": {"chunks": (3, 2)}}
    )
    g = open_geometries(root)["t"]
    pipe = insitu_pipeline(
        root, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": g.window([-1, 0]), "y": g.shift(1)},
        batch_size=1, seed=1, missing=[np.datetime64("2000-06-01")],
    )  # fmt: skip
    try:
        assert pipe.stages.plan.dropped["missing"] == 3  # today's rule: the missing month's
        loader = Loader(pipe)
        loader.load_state_dict(MONTHLY["state"])
        with pytest.raises(ValueError, match=r"saved before 2026-12-07.*counted in seconds"):
            next(iter(loader))
    finally:
        pipe.close()
