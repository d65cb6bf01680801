"""How a read plan takes a saved state: whether it fits, and where it resumes.

:class:`SavedStateChecks` is a part of :class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`
(its only user; a mixin, not a node): :meth:`~SavedStateChecks.check_state` raises
``ValueError`` unless a state from ``get_state`` fits the node (the same dataset and
configuration; other views only where an epoch begins or ends; another world size resumes
elastically), and ``_resolve`` says the ``(epoch, batches emitted, elastic cuts, dealing)`` a
checked state resumes at. Both read the node's configuration (its fingerprint ``_config``, the
views it has known, the manifest and the plan config) and draw plans through its ``_draw``;
neither changes the node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.epoch import chunk_anchors, dealing_for, plan_epoch
from insitubatch_nodes.plan.fingerprint import (
    ORDER_KEYS,
    PlanAnchors,
    check_cuts,
    check_inputs,
    check_legacy,
    check_same_anchors,
    config_differs,
    dealt,
    other_order,
    other_views_error,
    saved_dealing,
    saved_views,
)
from insitubatch_nodes.plan.ledger import EpochPlan, Stage
from insitubatch_nodes.plan.splits import SplitManifest

__all__ = ["SavedStateChecks"]


class SavedStateChecks:
    """The saved-state checks of a read plan (see the module docstring); the attributes below
    are the node's, set by its ``__init__``."""

    manifest: SplitManifest
    views: Mapping[str, ArrayGeometry]
    plan_config: PlanConfig
    split: str
    world_size: int
    cross_split_windows: bool
    _config: dict[str, Any]
    _known: dict[str, dict[str, ArrayGeometry]]
    _anchors: PlanAnchors

    if TYPE_CHECKING:

        def _draw(
            self,
            epoch: int,
            pin_gap: int | None,
            resumed: Sequence[Stage] = (),
            world: tuple[int, int] | None = None,
            dealing: str | None = None,
        ) -> EpochPlan: ...

    def _resolve(self, state: Mapping[str, Any]) -> tuple[int, int, tuple[Stage, ...], str | None]:
        """``(epoch, batches emitted, elastic cuts, dealing)`` that a checked ``state`` resumes
        at; ``dealing`` is ``None`` (the views' own) unless the state resumes mid-epoch and
        was saved before windows were dealt in runs (its config has no ``"deal"``): that epoch
        then goes on dealt in chunks, as it began.

        A state taken under another world size adds a cut: every old rank delivered its first
        ``batches_emitted`` batches (all it had if fewer), and the rest of the epoch is dealt
        to this world size: over for every rank once the rank that saved it has no batch of
        it left (its ``"rank"``, in an ``"uneven"`` state; else rank 0, the largest share),
        as on its own world size (before 2026-12-07 a rank with none went on alone; and a
        short rank's own state after its last batch was read as rank 0's, its epoch going on
        with rank 0's batches where on its own world size it was over), and for each new
        rank once rank 0 of this world size has none.

        Of this world size, the epoch is over once the rank that saved the state has no batch
        of it left (its ``"rank"``, in an ``"uneven"`` state, whose ranks' shares differ):
        each rank restored from its own state, or every rank from rank 0's (DDP's rule), ends
        the epoch where the ranks that never stopped end it, one loop at a time (before
        2026-12-07 a rank with fewer batches than rank 0 given rank 0's state took its own
        share's end: an empty rank ran the ended epoch again, one loop behind rank 0, and a
        rank with a batch fewer ran the next epoch while rank 0 ended this one). A state
        without ``"rank"`` (saved before) is taken as the rank's own, unless it has delivered
        more than the rank's share: rank 0's then.
        """
        epoch, emitted = int(state["epoch"]), int(state["batches_emitted"])
        resumed = check_cuts(state.get("resumed", ()), emitted)
        saved_world = int(state["config"].get("world_size", self.world_size))
        if self._other_views(state["config"]) is not None:
            # saved with other views at an epoch boundary (check_state): the next epoch is ours
            over = emitted > 0 and emitted >= self._saved_len(state, resumed, saved_world)
            return epoch + int(over), 0, (), None
        if other_order(state["config"], self._config):  # where an epoch begins or ends
            return epoch + int(emitted > 0), 0, (), None
        dealing = saved_dealing(state["config"], self._config)
        if saved_world != self.world_size:
            if emitted == 0:  # nothing delivered yet: the epoch as this world size plans it
                return epoch, 0, (), None
            saver = (self._saving_rank(state, saved_world) or 0, saved_world)
            old = self._draw(epoch, None, resumed, world=saver, dealing=dealing)
            if emitted >= old.n_batches:
                return epoch + 1, 0, (), None  # the epoch was over (where its saver's was)
            if not resumed or resumed[-1][1] < emitted:  # (its ranks delivered nothing: no cut)
                resumed = (*resumed, (saved_world, emitted))
        if resumed or emitted:  # over once the rank that saved it has none left
            lead = self._saver(state, saved_world, resumed)
            n_batches = self._draw(epoch, None, resumed, lead, dealing).n_batches
            if lead is None and emitted > n_batches:  # not its own: rank 0's (DDP's rule)
                lead = (0, self.world_size)
                n_batches = self._draw(epoch, None, resumed, lead, dealing).n_batches
            if emitted >= n_batches:
                epoch, emitted, resumed = epoch + 1, 0, ()
        return epoch, emitted, resumed, dealing if (resumed or emitted) else None

    def _saver(
        self, state: Mapping[str, Any], saved_world: int, resumed: Sequence[Stage]
    ) -> tuple[int, int] | None:
        """``(rank, world size)`` of the rank whose batches say where ``state``'s epoch ends:
        the rank that saved it (``"rank"``, an ``"uneven"`` state of this world size's), else
        rank 0 of an elastic epoch (over for every rank once rank 0, the largest share, has
        none left), else ``None``: this rank's own."""
        rank = self._saving_rank(state, saved_world)
        if saved_world == self.world_size and rank is not None:
            return rank, saved_world
        return (0, self.world_size) if resumed else None

    @staticmethod
    def _saving_rank(state: Mapping[str, Any], saved_world: int) -> int | None:
        """The rank of ``saved_world`` ranks that saved ``state`` (its ``"rank"``, written
        where shares differ: ``"uneven"`` on several ranks); ``None`` without one."""
        rank = state.get("rank")
        return rank if type(rank) is int and 0 <= rank < saved_world else None

    def ended_len(self, state: Mapping[str, Any]) -> int:
        """This rank's batches of the epoch read-plan state ``state`` was taken in, counted
        from its start, where ``state`` ends it: its ``batches_emitted``, but at most this
        rank's own share of that epoch where another rank of this world size saved it (rank
        0's, restored on every rank: a rank with fewer batches, an empty rank none). Saved on
        another world size, or with other views or batching: its ``batches_emitted``."""
        emitted = int(state["batches_emitted"])
        saved = state["config"]
        if (
            int(saved.get("world_size", self.world_size)) != self.world_size
            or self._other_views(saved) is not None
            or other_order(saved, self._config)
        ):
            return emitted
        resumed = check_cuts(state.get("resumed", ()), emitted)
        dealing = saved_dealing(saved, self._config)
        own = self._draw(int(state["epoch"]), None, resumed, None, dealing).n_batches
        return min(emitted, own)

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` (from :meth:`get_state`) fits this node."""
        missing = {"epoch", "batches_emitted", "config"} - set(state)
        if missing:
            raise ValueError(f"not a read-plan state: missing {sorted(missing)}")
        other_views = self._check_views(state)
        self._check_config(state, other_views=other_views)
        mine = self._config.get("inputs", {})  # (none: plain views, in either config)
        if not other_views and state["config"].get("inputs", {}) != mine:
            check_inputs(state, self._config, self._mid_epoch(state))

    def _other_views(self, saved: Mapping[str, Any]) -> dict[str, ArrayGeometry] | None:
        """The plan's views a state's ``config`` was saved with, when they differ from this
        node's and all else the dataset fingerprint covers is the same (``None`` otherwise)."""
        return saved_views(saved, self._config["dataset"], self._known, self.manifest, self.views)

    def _saved_len(self, state: Mapping[str, Any], resumed: Sequence[Stage], world: int) -> int:
        """Batches of the state's epoch under the views it was saved with (of the rank that
        saved it, else rank 0, of its ``world`` ranks, after its cuts ``resumed``): where it
        ends, as :meth:`_resolve` reads it (before 2026-12-07 always rank 0's, so a shorter
        rank's state after its last batch was refused as mid-epoch under other views or
        batching, though it resumed at the next epoch)."""
        views = self._other_views(state["config"]) or self.views
        config = self.plan_config.replace(**other_order(state["config"], self._config))
        dealing = dealt(config.shuffle, dealing_for(views), config.remainder, self.world_size)
        epoch = int(state["epoch"])
        dealing_then = saved_dealing(state["config"], dealing)
        plan = plan_epoch(
            self.manifest,
            views,
            config.for_rank(self._saving_rank(state, world) or 0, world),
            epoch=epoch,
            resumed=resumed,
            dealing=dealing_then,
        )
        return plan.n_batches

    def _check_views(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` was saved with other views (at an epoch boundary: ``ValueError``
        naming both sets of views mid-epoch)."""
        theirs = self._other_views(state["config"])
        if theirs is None:
            return False
        where = self._mid_epoch(state)
        if where:
            raise other_views_error(theirs, self.views, state, where)
        return True

    def _mid_epoch(self, state: Mapping[str, Any]) -> str:
        """Where inside its epoch ``state`` was saved (``"epoch 0, after 2 batches"``), under
        the views it was saved with; empty where that epoch begins or ends."""
        emitted = int(state["batches_emitted"])
        resumed = check_cuts(state.get("resumed", ()), emitted)
        world = int(state["config"].get("world_size", self.world_size))
        if emitted == 0 or emitted >= self._saved_len(state, resumed, world):
            return ""
        return f"epoch {int(state['epoch'])}, after {emitted} batch{'' if emitted == 1 else 'es'}"

    def _check_config(self, state: Mapping[str, Any], other_views: bool = False) -> None:
        saved, mine = state["config"], self._config
        grown = state.get("anchors") == self._anchors.value  # (the archive grew outside it?)
        check_same_anchors(saved, mine, grown, self.manifest.steps)
        check_legacy(saved, self._rule_matters)
        # another batching (batch size, seed, ...) from where an epoch begins or ends: _resolve
        rebatched = bool(other_order(saved, mine)) and not self._mid_epoch(state)
        for key, value in mine.items():
            if key in ("world_size", "inputs", "sit_out"):
                continue  # another world size resumes elastically (see reset); check_state;
                # a sit-out rule of the saved epoch's, where it began (see saved_dealing)
            if other_views and key in ("dataset", "views"):
                continue  # the same manifest, other views: at an epoch boundary (see reset)
            if grown and key in ("dataset", "missing_steps"):
                continue  # the split's anchors as saved: an archive grown outside the split
            if key in saved and saved[key] != value and not (rebatched and key in ORDER_KEYS):
                raise config_differs(key, saved[key], value, state)

    def _rule_matters(self) -> bool:
        """Whether ``cross_split_windows`` changes this configuration's anchors."""
        if self.cross_split_windows:
            return False
        chunks = self.manifest.chunk_array(self.split)
        offsets = [g.offset for g in self.views.values()]
        inside = chunk_anchors(self.manifest, chunks, offsets, self.plan_config)[0]
        across = chunk_anchors(
            self.manifest, chunks, offsets, self.plan_config.replace(cross_split_windows=True)
        )[0]
        return not np.array_equal(inside, across)
