"""``ReadPlanNode``: the first stage; one :class:`~insitubatch_nodes.plan.ledger.BatchPlan`
per batch.

It draws each epoch's plan (:mod:`insitubatch_nodes.plan`), keeps what a resume needs (epoch,
batches delivered, the elastic cuts) and checks that a saved state was made by the same
configuration.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from torchdata.nodes import BaseNode

from insitubatch_nodes._checks import check_int
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.selection import Held, covers
from insitubatch_nodes.plan.anchors import describe_stride, every_sample
from insitubatch_nodes.plan.config import PlanConfig, plan_config
from insitubatch_nodes.plan.epoch import (
    check_plan_inputs,
    check_ranks,
    dealing_for,
    dropped_anchors,
    patch_layout,
    plan_epoch,
)
from insitubatch_nodes.plan.fingerprint import (
    PlanAnchors,
    dataset_hash,
    dealt,
    inputs_of,
    stratifying_tiles,
    views_list,
    without_dealing,
)
from insitubatch_nodes.plan.ledger import BatchPlan, EpochPlan, Stage
from insitubatch_nodes.plan.parts import BatchLayout, Stack, expand_views, resolve_windows
from insitubatch_nodes.plan.ranks import alone_before_group, check_still_alone, resolve_rank_world
from insitubatch_nodes.plan.schedule import PinSchedule, ScheduleFloors, block_batches
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.plan.working_set import slot_geometries, working_set_bytes
from insitubatch_nodes.stages._graph import STOP_OWED, plan_state
from insitubatch_nodes.stages._resume import SavedStateChecks

__all__ = ["ReadPlanNode", "ViewsCheck"]

_DRAWN_KEPT = 3  # epoch plans a ReadPlanNode keeps (the current one, the next, len()'s)

# views set_views gave, until an epoch takes them: parts, layout, schedule, the plans drawn
_Pending = tuple[
    dict[str, ArrayGeometry], BatchLayout, PinSchedule, dict[tuple[Any, ...], EpochPlan]
]

_CONFIG_ATTRS = frozenset(
    {
        "manifest",
        "variables",
        "split",
        "batch_size",
        "block_chunks",
        "shuffle",
        "ramp",
        "seed",
        "rank",
        "world_size",
        "cross_split_windows",
        "schedule",
        "remainder",
        "plan_config",
        "stride",
    }
)


class ViewsCheck(Protocol):
    """A check of the views :meth:`ReadPlanNode.set_views` is given (:meth:`ReadPlanNode.
    check_views_with`): ``views`` as given, ``schedule`` theirs, ``plan`` a node reading them
    (its first epoch's plan drawn: :meth:`ReadPlanNode.epoch_plan` of ``next_epoch`` returns
    it), ``extra`` the batch transforms that come with them and ``floors`` their schedule's
    floors where the caller had them (else ``None``). A ``ValueError`` refuses them. It keeps
    nothing itself: it returns what keeps what it counted, called once the views are taken
    (:meth:`ReadPlanNode.prepare_views`), or ``None``."""

    def __call__(
        self,
        views: Mapping[str, Any],
        schedule: PinSchedule,
        *,
        plan: ReadPlanNode,
        extra: Sequence[Any],
        floors: ScheduleFloors | None,
    ) -> Callable[[], None] | None: ...


class ReadPlanNode(BaseNode[BatchPlan], SavedStateChecks):
    """A torchdata node whose items are :class:`BatchPlan` s, one per batch, epoch after epoch.

    ``views`` maps each label to an :class:`ArrayGeometry` view; every view must have the
    manifest's sample-axis length (labels may chunk the sample axis differently and carry
    ``shift`` offsets). An anchor is emitted only if every view's ``anchor + offset`` lies in the
    array and — unless ``cross_split_windows=True`` — on an anchor-grid chunk of ``split``, so no
    window reads another split's samples. A split that has chunks but no such anchor is refused.

    **Ranks.** ``rank``/``world_size`` default to ``torch.distributed``'s when it is initialised,
    else 0/1. Every rank emits the same number of samples, a constant across epochs — with ``V``
    valid anchors, ``V // world_size`` (``remainder="drop"``, the default) or ``ceil(V /
    world_size)`` (``"pad"``) — so all ranks yield the same number of batches (``"uneven"``,
    val/test only: one more on the first ``V % world_size`` ranks, every sample once). Each
    epoch :func:`deal` hands the permuted chunks out round-robin as whole chunks while every
    rank stays within its share, then cuts the remaining chunks' samples into consecutive
    pieces. ``"drop"``: ``V % world_size`` samples (at most ``world_size - 1``) sit out this
    epoch: drawn from all ``V`` by the epoch's seed and taken out first when shuffling (each
    sits out about equally often), else the last ones. ``"pad"``: ``(-V) % world_size`` samples
    drawn by the epoch's seed are delivered twice. A rank reads each chunk it holds once per epoch;
    a tail chunk cut between ranks is read by each of them (at most ``world_size - 1`` extra
    chunk reads per epoch, plus one per padded sample), and a shifted view's neighbour chunk —
    ``c + 1`` for the last anchors of ``c`` — may also be read by the rank that holds ``c``.
    **Windows** (views at several offsets) are dealt in runs instead (:func:`deal_runs`): each
    rank one contiguous run of the valid anchors dealt, along the sample axis (a short run's
    padded sample drawn from the other runs each epoch; unshuffled, the sit-out run last),
    which rank gets which run drawn each epoch, its chunks visited in the epoch's permuted
    order. Ranks then share only the chunks a window span reaches across the ``world_size - 1``
    cuts: summed over the ranks at most ``world_size - 1`` times
    ``ceil((s - 1) / samples_per_chunk) + 1`` chunks of each array beyond one rank's reads of
    the whole split (``s`` the span of the offsets), plus, per padded sample, the chunks its
    window reads. The state's
    configuration says ``"deal": "runs"`` (unshuffled, also ``"run_order": "store"``; shuffled
    with ``"drop"``, ``"sit_out": "drawn"``; with ``"pad"``, ``"pad": "drawn"``); a state saved
    without one (before its rule) finishes its epoch dealt as it began, the next by today's.
    With one rank nothing is dropped or repeated. A split with fewer samples than ranks (valid
    anchors, or with patched views their windows) is refused.

    **Ramp.** With ``ramp=True`` (the default; only when shuffling) the epoch's first block is
    split into a lead block of just enough chunks for one batch and the rest, so the first batch
    waits for a few chunks rather than a whole block; memory and every later block are
    unchanged, and the epoch's :func:`shuffle_quality` moves by about one epoch-to-epoch
    standard deviation.

    **Residency schedule.** ``schedule`` (a :class:`PinSchedule`; default read-once every epoch)
    decides each epoch's ``fetches``/``releases``; it never changes which samples a batch holds.
    :func:`~insitubatch_nodes.plan.schedule.choose_schedule` computes it from a budget.

    **Epochs and state.** ``reset(None)`` starts an epoch: the next one if the previous epoch
    yielded a batch or reached its end, else the same one again (so the extra ``iter()`` calls
    Lightning makes do not skip epochs); :meth:`set_epoch` pins the epoch the next
    ``reset(None)`` starts. A rank with no batch of an epoch (``empty_ranks=True``), or none
    of an elastic ``"uneven"`` rest, ends it at its ``StopIteration``: its state is then the
    next epoch's start, and it goes on at the same epoch as the other ranks (before
    2026-12-07 the first stayed at epoch 0, the other ranks' next epochs drawn for other
    epochs than its own, and the state of either resumed that epoch again, an empty loop).
    The state is O(1) plain Python — the epoch, the batches emitted, and the configuration the
    plan is a function of (computed once, at construction: the configuration is fixed, and
    assigning to it raises ``AttributeError``; with ``"uneven"`` on several ranks, also the
    rank that saved it) — and ``reset(state)`` resumes at exactly the next batch. A state
    taken after the last batch of an epoch resumes at the start of the next epoch; an
    ``"uneven"`` state restored on another rank (rank 0's on every rank, DDP's rule) ends
    its epoch where the rank that saved it does, so a rank with fewer batches (none) resumes
    that epoch's loop, empty, while rank 0 has a batch of it left, and the next epoch once
    rank 0 has none —
    except one marked ``"stop_owed"`` (``Loader`` marks a mixing sampler's unexhausted sources):
    it raises that epoch's ``StopIteration`` first, its state meanwhile the one restored.
    Restoring a state whose configuration differs raises ``ValueError`` naming the field —
    except the world size, and the batching (:data:`ORDER_KEYS`) of a state taken where an
    epoch begins or ends: the next epoch is batched by this node's.

    **Elastic resume.** A state saved under another world size ``W`` restores too: every old
    rank is taken to have delivered its first ``k`` batches, the state's (all it had if fewer;
    ranks move in lockstep, the state is rank 0's), and the rest — the samples none delivered —
    is dealt to this world size by :func:`deal` (``resumed`` of :func:`plan_epoch`); batches
    go on from ``k``, so that epoch's ``len()`` differs; the next epochs are this world size's
    own. The state then carries the epoch's cuts (``"resumed"``), so it restores again, on any
    world size.

    **One config.** ``config`` (a :class:`~insitubatch_nodes.plan.config.PlanConfig`; ``None``:
    the defaults), checked when it was made, is kept as :attr:`plan_config` and as attributes
    (``split``, ..., ``rank`` and ``world_size`` resolved). ``statics``: the static labels a
    ``StaticFields`` puts beside, in the state (saved mid-epoch, it restores where they come alike).

    **Windows.** A window view (:meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.window`)
    is planned as its parts, one plain shifted view per step (:mod:`~insitubatch_nodes.plan.parts`;
    time deltas resolved through ``manifest.steps``): :attr:`views` holds the parts the plan
    reads (part label -> view), :attr:`layout` how each batch label is assembled from them, and
    :attr:`batch_views` the views as given.

    **Other views between epochs.** :meth:`set_views` gives views of the same arrays (other
    windows or shifts: a rollout that grows); they take effect at the next start of an epoch.
    A state restores when it was saved with the views this node reads (mid-epoch, with views
    pending from :meth:`set_views`, it ends its epoch under its own views), and a state saved
    with other views restores at an epoch boundary only (its epoch not begun, or over):
    mid-epoch it is refused with a ``ValueError`` naming both sets of views.
    """

    def __init__(
        self,
        manifest: SplitManifest,
        views: Mapping[str, ArrayGeometry],
        *,
        schedule: PinSchedule | None = None,
        config: PlanConfig | None = None,
        statics: Mapping[str, ArrayGeometry] | None = None,
    ) -> None:
        super().__init__()
        given = plan_config(config, "ReadPlanNode")
        views, layout = self._plan_views(manifest, views, given)
        if schedule is None:
            schedule = PinSchedule()
        if not isinstance(schedule, PinSchedule):
            raise TypeError(f"schedule must be a PinSchedule or None, got {schedule!r}")
        rk, world = resolve_rank_world(given.rank, given.world_size)
        self._alone = alone_before_group(given.world_size)  # (checked where an epoch starts)
        cfg = given.for_rank(rk, world)  # resolved: this node's rank and world
        check_ranks(manifest, views, cfg)
        self.manifest = manifest
        self.views: Mapping[str, ArrayGeometry] = MappingProxyType(views)
        self.layout: BatchLayout = layout
        self._pending: _Pending | None = None  # views set_views gave
        self._pending_len = 0  # batches of an epoch of the pending views
        self.plan_config = cfg
        self.split = cfg.split
        self.batch_size = cfg.batch_size
        self.block_chunks = cfg.block_chunks
        self.shuffle = cfg.shuffle
        self.ramp = cfg.ramp
        self.seed = cfg.seed
        self.rank: int = rk
        self.world_size: int = world
        self.cross_split_windows = cfg.cross_split_windows
        self.remainder = cfg.remainder
        self.stride = cfg.stride
        self.schedule = schedule
        self._epoch = 0
        self.pinned_epoch: int | None = None  # set_epoch's, for the next reset(None)
        self._emitted = 0
        # its end reached (StopIteration raised): what ends an epoch with no batch for this
        # rank, which moves on as the other ranks' do (see reset)
        self._over = False
        self._resumed: tuple[Stage, ...] = ()  # the current epoch's elastic cuts
        self._dealing: str | None = None  # the current epoch's, when not the views' (legacy)
        self._epoch_len: int | None = None
        self._plan: EpochPlan | None = None
        self._owed: dict[str, Any] | None = None  # the state it owes a StopIteration at
        # plans drawn lately (pure: the build, the first reset and len() share one draw)
        self._drawn: dict[tuple[Any, ...], EpochPlan] = {}
        # the plan's views by dataset fingerprint: those it had, and set_views gave
        self._known: dict[str, dict[str, ArrayGeometry]] = {}
        self._held: dict[str, Held] = {}  # what the slots hold (hold)
        self._statics = dict(statics or {})
        self._views_check: ViewsCheck | None = None
        self._config = self._fingerprint()  # the configuration is fixed from here on

    @staticmethod
    def _plan_views(
        manifest: SplitManifest, views: Mapping[str, ArrayGeometry], config: PlanConfig
    ) -> tuple[dict[str, ArrayGeometry], BatchLayout]:
        """``(parts, layout)`` of ``views`` (windows resolved and expanded), checked."""
        if (
            isinstance(manifest, SplitManifest)
            and isinstance(views, Mapping)
            and all(isinstance(v, ArrayGeometry | Stack) for v in views.values())
        ):
            parts, layout = expand_views(resolve_windows(views, manifest.steps))
            return check_plan_inputs(manifest, parts, config), layout
        # (check_plan_inputs says what is wrong)
        return check_plan_inputs(manifest, views, config), BatchLayout({}, {})

    @property
    def batch_views(self) -> Mapping[str, ArrayGeometry | Stack]:
        """The views as given (batch label -> view; a window view for a window), of the views
        in effect."""
        return self.layout.views

    def set_views(
        self,
        views: Mapping[str, ArrayGeometry],
        *,
        schedule: PinSchedule | None = None,
        floors: ScheduleFloors | None = None,
        extra: Sequence[Any] = (),
    ) -> None:
        """:meth:`prepare_views`, then take them: checked as it says, and read from the next
        start of an epoch on. Nothing changes where they are refused."""
        self.prepare_views(views, schedule=schedule, floors=floors, extra=extra)()

    def prepare_views(
        self,
        views: Mapping[str, ArrayGeometry],
        *,
        schedule: PinSchedule | None = None,
        floors: ScheduleFloors | None = None,
        extra: Sequence[Any] = (),
    ) -> Callable[[], None]:
        """What takes ``views`` (a callable of no arguments, which cannot fail), checked and
        planned now without changing this node, nor what the check counts: nothing changes
        until it is called, and nothing where it is not (``InSituPipeline.set_views`` calls it
        once every rank of its group prepared its views). Taken, this node reads ``views``
        (label -> view of the same arrays: other windows, shifts, labels) from the next start
        of an epoch on: the next ``reset(None)``, or a ``reset(state)``
        (which then restores under these views, see the class docstring) — except a state
        saved mid-epoch with the views in effect (a pipeline closed and resumed): its epoch
        ends under its own views, and these start with the next. ``schedule`` is
        the residency schedule for them (default: the current one). Checked here:
        ``ValueError`` when they read other arrays, patch an array otherwise, select what the
        pool's slots do not hold (:meth:`hold`), or leave the split no anchor; then by the
        check the fetch stage gave (:meth:`check_views_with`), once: ``ValueError`` where the
        pipeline could not hold them in memory. It counts on the plan of their first epoch,
        drawn here once (that epoch starts on it), beside the batch transforms ``extra`` that
        come with them (``InSituPipeline.set_views`` gives the constants of new stacks), and
        takes ``floors`` — :func:`~insitubatch_nodes.plan.schedule.schedule_floors` of them, as
        ``schedule`` was chosen with — where given (else it computes them where it needs
        them). Before 2026-12-07 ``InSituPipeline.set_views`` counted the rule, then this
        check counted it again (without the constants): three plans drawn per call."""
        parts, layout = self._plan_views(self.manifest, views, self.plan_config)
        mine = {g.path: g.patch for g in self.views.values()}
        theirs = {g.path: g.patch for g in parts.values()}
        if set(mine) != set(theirs):
            raise ValueError(
                f"set_views takes views of the same arrays: these read {sorted(theirs)}, the "
                f"pipeline reads {sorted(mine)}; build a new pipeline for other arrays"
            )
        changed = sorted(p for p in mine if mine[p] != theirs[p])
        if changed:
            raise ValueError(
                f"set_views keeps how each array is patched: {changed} would be patched "
                "otherwise; build a new pipeline for that"
            )
        beyond = sorted(
            {g.path for g in parts.values() if not covers(self._held.get(g.path), g.select)}
        )
        if beyond:
            raise ValueError(
                f"set_views selects parts of {beyond} that the pool's slots do not hold: they "
                "hold what the views the pipeline was built with select (their union), fixed "
                "at build; build it with views that select everything each set of views needs"
            )
        check_ranks(self.manifest, parts, self.plan_config)
        if schedule is not None and not isinstance(schedule, PinSchedule):
            raise TypeError(f"schedule must be a PinSchedule or None, got {schedule!r}")
        if floors is not None and not isinstance(floors, ScheduleFloors):
            raise TypeError(f"floors must be ScheduleFloors or None, got {floors!r}")
        if isinstance(extra, str | bytes) or not isinstance(extra, Sequence):
            raise TypeError(f"extra must be a sequence of batch transforms, got {extra!r}")
        schedule = self.schedule if schedule is None else schedule
        node = self._reading((parts, layout, schedule, {}))
        first = node.epoch_plan(self.next_epoch)  # (drawn once: the check's, the length's)
        keep = None
        if self._views_check is not None:  # (the fetch stage's memory check)
            keep = self._views_check(views, schedule, plan=node, extra=tuple(extra), floors=floors)
        pending: _Pending = (parts, layout, schedule, dict(node._drawn))

        def take() -> None:
            if keep is not None:
                keep()  # (the check's count, kept)
            self._pending = pending
            self._pending_len = first.n_batches  # (the same every epoch)
            self._known[node._config["dataset"]] = parts

        return take

    def check_views_with(self, check: ViewsCheck) -> None:
        """Call ``check(views, schedule, plan=..., extra=..., floors=...)`` (a
        :class:`ViewsCheck`) in :meth:`prepare_views`, once, on the views given, their schedule
        and a node reading them, after its own checks and before they are taken (a
        ``ValueError`` refuses them): the fetch stage's memory check, which counts the
        build's memory rule again for them."""
        self._views_check = check

    def hold(self, held: Mapping[str, Held]) -> None:
        """What the pool's slots hold of each array read through selected views (the stage
        context says, see :mod:`~insitubatch_nodes.io.selection`): ``set_views`` then takes
        only views that select within it, and each epoch's choice of schedule sizes those
        slots as they are."""
        self._held = dict(held)

    @property
    def held(self) -> Mapping[str, Held]:
        """What :meth:`hold` was told (empty before)."""
        return MappingProxyType(self._held)

    def _resumes_mid_epoch(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` was saved with the views in effect and resumes inside its epoch
        (a pipeline closed and resumed mid-epoch): views :meth:`set_views` gave then wait for
        the next epoch."""
        saved = state.get("config")
        if self._pending is None or not isinstance(saved, Mapping):
            return False
        if saved.get("dataset") != self._config["dataset"]:
            return False
        try:
            self.check_state(state)
            return self._resolve(state)[1] > 0
        except (KeyError, TypeError, ValueError):
            return False  # (reset says what is wrong with it)

    def _apply_pending(self) -> None:
        """Take the views :meth:`set_views` gave (at the start of an epoch)."""
        if self._pending is None:
            return
        parts, layout, schedule, drawn = self._pending
        self._pending = None
        object.__setattr__(self, "schedule", schedule)  # (fixed otherwise: see __setattr__)
        self.views = MappingProxyType(parts)
        self.layout = layout
        self._drawn = dict(drawn)  # (set_views drew the first epoch's plan: it starts on it)
        self._epoch_len = None
        self._config = self._fingerprint()

    def _reading(self, pending: _Pending) -> ReadPlanNode:
        """A copy of this node that took ``pending`` (views as :meth:`set_views` keeps them,
        with the plans it drew for them): it draws their plans; this node is unchanged."""
        node = copy.copy(self)
        node._drawn, node._known = {}, dict(self._known)
        node._pending = pending
        node._apply_pending()
        return node

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONFIG_ATTRS and "_config" in self.__dict__:
            raise AttributeError(
                f"ReadPlanNode.{name} is fixed at construction (the plan, its state and its "
                "fingerprint depend on it); build a new node instead"
            )
        super().__setattr__(name, value)

    # -- configuration identity -----------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        views = views_list(self.views)
        dataset = dataset_hash(self.manifest, views)
        self._anchors = PlanAnchors(self.manifest, dict(self.views), self.plan_config)
        self._known[dataset] = dict(self.views)
        return {
            "dataset": dataset,
            # the views, readable (every state's, so that a pipeline built with other views
            # knows them: restored at an epoch's end, or refused mid-epoch naming what differs;
            # states saved before 2026-12-07 recorded them only with windows, stacks or after
            # set_views); what the labels hold beyond (stacks' channels, selections, static
            # labels: a mid-epoch resume's, see check_state)
            "views": views,
            **({"inputs": i} if (i := inputs_of(self.layout.views, self._statics)) else {}),
            "split": self.split,
            "batch_size": self.batch_size,
            "block_chunks": self.block_chunks,
            "shuffle": self.shuffle,
            "ramp": self.ramp,
            "seed": self.seed,
            "world_size": self.world_size,
            "cross_split_windows": self.cross_split_windows,
            "remainder": self.remainder,
            # only when set, so a default config's fingerprint is what it always was
            **({"patch_tiles": t} if (t := stratifying_tiles(self.views)) else {}),
            **({} if every_sample(self.stride) else {"stride": describe_stride(self.stride)}),
            **(
                {}
                if self.manifest.steps is None
                else {"missing_steps": self.manifest.steps.fingerprint()}
            ),
            # windows deal contiguous runs (unshuffled: in store order); see saved_dealing
            **dealt(self.shuffle, dealing_for(self.views), self.remainder, self.world_size),
        }

    def config(self) -> dict[str, Any]:
        """What the plan is a function of, besides the epoch (plain, rank-independent; computed
        once at construction — a copy is returned)."""
        return dict(self._config)

    @property
    def dropped(self) -> dict[str, int]:
        """Anchors of the split the missing-step checks dropped, per reason (``{"nat": 3,
        "gap": 2, ...}``; ``{}`` without the checks): see :mod:`~insitubatch_nodes.plan.anchors`."""
        return dropped_anchors(self.manifest, self.views, self.plan_config)

    @property
    def pin_gap(self) -> int | None:
        """The schedule's ``pin_gap`` (``None``: read-once every epoch)."""
        return self.schedule.pin_gap

    def _draw(
        self,
        epoch: int,
        pin_gap: int | None,
        resumed: Sequence[Stage] = (),
        world: tuple[int, int] | None = None,
        dealing: str | None = None,
    ) -> EpochPlan:
        rank, world_size = (self.rank, self.world_size) if world is None else world
        key = (epoch, pin_gap, tuple(resumed), rank, world_size, dealing)
        plan = self._drawn.get(key)
        if plan is None:
            plan = self._drawn[key] = self._draw_new(
                epoch, pin_gap, resumed, rank, world_size, dealing
            )
            while len(self._drawn) > _DRAWN_KEPT:
                del self._drawn[next(iter(self._drawn))]
        return plan

    def _draw_new(
        self,
        epoch: int,
        pin_gap: int | None,
        resumed: Sequence[Stage],
        rank: int,
        world_size: int,
        dealing: str | None,
    ) -> EpochPlan:
        config = self.plan_config
        if (rank, world_size) != (config.rank, config.world_size):  # another world's share
            config = config.for_rank(rank, world_size)
        return plan_epoch(
            self.manifest,
            self.views,
            config,
            epoch=epoch,
            pin_gap=pin_gap,
            resumed=resumed,
            dealing=dealing,
        )

    def epoch_plan(self, epoch: int | None = None) -> EpochPlan:
        """This rank's plan for ``epoch`` under the schedule; by default the current one (an
        elastic remainder after a resume on another world size, see :meth:`reset`)."""
        if epoch is None and self._plan is not None:
            return self._plan
        if epoch is None:
            return self._scheduled(self._epoch, self._resumed, self._dealing)
        return self._scheduled(int(epoch))

    def _scheduled(
        self, epoch: int, resumed: Sequence[Stage] = (), dealing: str | None = None
    ) -> EpochPlan:
        gap, within = self.schedule.pin_gap, self.schedule.read_once_bytes
        if gap is None:
            return self._draw(epoch, None, resumed, dealing=dealing)
        if within is not None:
            once = self._draw(epoch, None, resumed, dealing=dealing)
            if working_set_bytes(once, slot_geometries(self.views, self._held))[0] <= within:
                return once
        return self._draw(epoch, gap, resumed, dealing=dealing)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def next_epoch(self) -> int:
        """The epoch the next ``reset(None)`` starts."""
        if self.pinned_epoch is not None:
            return self.pinned_epoch
        if self._plan is not None and (self._emitted > 0 or self._over):
            return self._epoch + 1
        return self._epoch

    def __len__(self) -> int:
        """Batches in the epoch in progress (once it is over: in the next, under the views
        :meth:`set_views` gave), counted from its start. The same every epoch, except an epoch
        resumed on another world size (see :meth:`reset`) or after :meth:`set_views`."""
        if self._plan is not None and self._emitted < self._plan.n_batches:
            return self._plan.n_batches
        return self.epoch_len

    @property
    def current_len(self) -> int:
        """Batches in the epoch this node is in (its current plan, however far the stages
        below have read it), or in a whole epoch before the first ``reset``."""
        return self.epoch_len if self._plan is None else self._plan.n_batches

    @property
    def epoch_len(self) -> int:
        """Batches this rank yields in a whole epoch (the same every epoch); once
        :meth:`set_views` gave views, in a whole epoch of those (the next one's)."""
        if self._pending is not None:
            return self._pending_len
        if self._epoch_len is None:
            self._epoch_len = self._draw(0, None).n_batches
        return self._epoch_len

    def resumed_epoch(self, state: Mapping[str, Any]) -> int:
        """The epoch ``reset(state)`` (or a ``Loader``'s state) continues: the next at an end."""
        node = self._as_reset(state := plan_state(state))
        node.check_state(state)
        return node._resolve(state)[0]

    def ends_epoch(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` (this node's or a ``Loader``'s) was taken at its epoch's end, so
        that ``reset(state)`` goes on with the next epoch; ``False`` inside an epoch, also where
        this rank has no batch of it left (an elastic rank with no share of the rest)."""
        state = plan_state(state)
        return self.resumed_epoch(state) > int(state["epoch"])

    def resumed_len(self, state: Mapping[str, Any]) -> int:
        """:meth:`__len__` once ``reset(state)`` has run (nothing changes; any state)."""
        node = self._as_reset(state := plan_state(state))
        node.check_state(state)
        epoch, _, resumed, dealing = node._resolve(state)
        return node._draw(epoch, None, resumed, dealing=dealing).n_batches

    def _as_reset(self, state: Mapping[str, Any]) -> ReadPlanNode:
        """This node with the views ``reset(state)`` reads: itself, or a copy that took the
        views :meth:`set_views` gave, where ``reset`` takes them first (here they stay)."""
        if self._pending is None or self._resumes_mid_epoch(state):
            return self
        return self._reading(self._pending)

    @property
    def block_batches(self) -> int:
        """Batches one full block takes: the ``pin_gap`` of the bounded-memory schedule."""
        layout = patch_layout(self.views, self.block_chunks)
        if layout is not None:  # a block is one patch chunk
            return layout.block_batches(self.manifest.samples_per_chunk, self.batch_size)
        return block_batches(self.manifest.samples_per_chunk, self.block_chunks, self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``reset(None)`` start ``epoch`` (e.g. from a trainer's epoch counter)."""
        epoch = check_int("epoch", epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.pinned_epoch = epoch

    # -- BaseNode ----------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        check_still_alone(self._alone)
        super().reset(initial_state)
        if initial_state is None or not self._resumes_mid_epoch(initial_state):
            self._apply_pending()  # views given by set_views start here
        self._owed = None
        over, self._over = self._over, False
        if initial_state is not None:
            self.check_state(initial_state)
            epoch, emitted, resumed, dealing = self._resolve(initial_state)
            self._epoch, self._emitted, self._resumed = epoch, emitted, resumed
            self._dealing = dealing
            self._plan = self._scheduled(epoch, resumed, dealing)
            self.pinned_epoch = None
            if initial_state.get(STOP_OWED) is True and epoch > int(initial_state["epoch"]):
                # its epoch is over and its consumer not yet told: the StopIteration first
                self._owed = {k: v for k, v in initial_state.items() if k != STOP_OWED}
            return
        if self.pinned_epoch is not None:
            self._epoch, self.pinned_epoch = self.pinned_epoch, None
        elif self._plan is not None and (self._emitted > 0 or over):
            self._epoch += 1
        self._emitted, self._resumed, self._dealing = 0, (), None
        self._plan = self._scheduled(self._epoch)

    @property
    def owes_stop(self) -> bool:
        """Whether this node, restored at its epoch's end by a consumer that had not yet been
        told that epoch was over (a sampler mixing pipelines), raises ``StopIteration`` before
        its next epoch (see the class docstring)."""
        return self._owed is not None

    def next(self) -> BatchPlan:
        if self._plan is None:
            self.reset(None)
        assert self._plan is not None
        if self._owed is not None:
            raise StopIteration
        if self._emitted >= self._plan.n_batches:
            self._over = True
            raise StopIteration
        batch = self._plan.batch(self._emitted)
        self._emitted += 1
        return batch

    def start_state(self, epoch: int) -> dict[str, Any]:
        """This node's state before the first batch of ``epoch`` (nothing is drawn)."""
        return {"epoch": int(epoch), "batches_emitted": 0, "config": self.config()}

    def get_state(self) -> dict[str, Any]:
        if self._owed is not None:  # where it was restored, until the StopIteration is taken
            return copy.deepcopy(self._owed)
        config = without_dealing(self._config, self._dealing)  # (a legacy epoch goes on as one)
        state = {
            "epoch": self._epoch,
            "batches_emitted": self._emitted,
            "config": config,
            "anchors": self._anchors.value,
        }
        if self._resumed:  # plain lists: checkpoints load with weights_only=True
            state["resumed"] = [[w, k] for w, k in self._resumed]
        if self.remainder == "uneven" and self.world_size > 1:
            state["rank"] = self.rank  # (shares differ: whose batches end its epoch, _resolve)
        unsigned = {k: v for k, v in state.items() if k != "rank"}
        if self._over and self._resolve(unsigned)[0] == self._epoch:
            # over here, though restored it would resume this epoch read as one of its own
            # batches (no batch of it: with none, and the elastic rule, rank 0's, with fewer
            # of an elastic rest than rank 0): the next epoch's start, alike on every rank
            return {**self.start_state(self._epoch + 1), "anchors": self._anchors.value}
        return state
