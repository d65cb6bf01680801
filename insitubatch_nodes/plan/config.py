"""``PlanConfig``: what a read plan draws, as one checked, immutable object.

The same twelve settings — ``split, batch_size, block_chunks, shuffle, seed, rank,
world_size, ramp, cross_split_windows, remainder, stride, empty_ranks`` —
describe a read plan wherever one is drawn or sized:
:func:`~insitubatch_nodes.plan.epoch.plan_epoch`,
:class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`,
:func:`~insitubatch_nodes.plan.schedule.choose_schedule` and
:func:`~insitubatch_nodes.plan.schedule.schedule_floors` each take one as ``config`` and trust
it (it was checked when it was made); only the builder,
:func:`~insitubatch_nodes.insitu_pipeline`, also takes the settings as loose keywords.
Pure Python: no torchdata, no numpy arrays (a time ``stride`` is a ``numpy.timedelta64``).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from insitubatch_nodes._checks import check_bool, check_int, check_optional_int
from insitubatch_nodes.io.timeunits import as_timedelta
from insitubatch_nodes.plan.ranks import check_remainder
from insitubatch_nodes.plan.splits import SPLITS

__all__ = ["SCHEDULE_FIELDS", "PlanConfig", "plan_config"]

# The settings the schedule functions (choose_schedule, schedule_floors) depend on: the bounds
# hold for every shuffle, seed, rank and ramp, so those four are not among them.
SCHEDULE_FIELDS = (
    "split",
    "batch_size",
    "block_chunks",
    "cross_split_windows",
    "remainder",
    "world_size",
    "stride",
)


@dataclass(frozen=True)
class PlanConfig:
    """What a read plan draws: the settings of
    :class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode` besides the data (manifest,
    views) and the residency schedule.

    Fields and defaults:

    * ``split`` (``"train"``): one of ``"train"``, ``"val"``, ``"test"``;
    * ``batch_size`` (32), ``block_chunks`` (16): positive integers;
    * ``shuffle`` (``True``): permute the chunks and the samples within each block;
    * ``seed`` (0): an integer ``>= 0``; with the epoch, it fixes the permutation;
    * ``rank``, ``world_size`` (``None``): this rank and the number of ranks; ``None`` takes
      ``torch.distributed``'s when the plan is built (see ``ReadPlanNode``);
    * ``ramp`` (``True``): a small lead block first, so the first batch waits for few chunks;
    * ``cross_split_windows`` (``False``): let windows read samples of another split (and
      outside the manifest's ``sample_range`` window);
    * ``remainder`` (``"drop"``): ``"drop"``, ``"pad"`` or ``"uneven"``, what several ranks do
      with the samples that do not divide evenly between them
      (:mod:`~insitubatch_nodes.plan.ranks`).
      ``"uneven"`` delivers every sample exactly once, the ranks' batch counts differing by at
      most one: for evaluation (``split="val"``/``"test"``) only — with ``split="train"`` it
      is refused, since DDP's gradient sync in the backward pass of the rank with one batch
      more would wait forever for the others;
    * ``stride`` (1): which samples are anchors — an ``int`` ``k`` (every ``k``-th sample,
      counted from index 0 of the array) or a time step (``"6h"``, ``numpy.timedelta64``,
      ``datetime.timedelta``; kept as a ``numpy.timedelta64``): the samples whose time is a
      whole multiple of the step since ``1970-01-01T00:00``, in the time coordinate's own
      calendar (since 0 for a coordinate of durations, a lead time; see
      :mod:`~insitubatch_nodes.plan.anchors`). 1 keeps every sample;
    * ``empty_ranks`` (``False``): with ``remainder="uneven"`` only, let a split with fewer
      samples than ranks be read, the ranks beyond its samples getting none (zero batches,
      ``len()`` 0) — for a plain evaluation or prediction loop, whose empty ranks run no
      batch and still take part in the collective calls made after the loop (an
      ``all_gather_object`` of the predictions). Left ``False``, such a split is refused
      (:class:`~insitubatch_nodes.errors.TooFewSamplesError`): Lightning refuses a rank
      without a batch, and ``InSituDataModule`` never sets it. It changes no plan (not part
      of a state's configuration or fingerprint).

    **Contract.** Construction checks every field with the package's shared checks and raises
    what the loose keywords always raised: ``TypeError`` for the wrong kind of value (a float,
    a ``bool`` or a string where an integer belongs; anything but ``True``/``False`` for a
    flag; a non-string ``remainder``), ``ValueError`` for a value out of range (a count below
    1, a negative seed, an unknown ``split`` or ``remainder``, ``remainder="uneven"`` with
    ``split="train"``, ``empty_ranks=True`` with another ``remainder``, a ``world_size``
    below 1 or a ``rank`` outside ``[0, world_size)`` when ``world_size`` is given).
    Accepted values are normalised to plain Python (``numpy`` integers and ``numpy.bool_``
    become ``int`` and ``bool``), so two configs are equal exactly when they draw the same
    plans and agree on ``empty_ranks``. The object is frozen and hashable; :meth:`replace`
    returns a checked copy.
    """

    split: str = "train"
    batch_size: int = 32
    block_chunks: int = 16
    shuffle: bool = True
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    ramp: bool = True
    cross_split_windows: bool = False
    remainder: str = "drop"
    stride: int | np.timedelta64 = 1
    empty_ranks: bool = False

    if TYPE_CHECKING:  # the constructor dataclass makes, but taking a stride as any time step
        # ("6h", a timedelta): the field holds it checked (int | numpy.timedelta64)

        def __init__(
            self,
            split: str = "train",
            batch_size: int = 32,
            block_chunks: int = 16,
            shuffle: bool = True,
            seed: int = 0,
            rank: int | None = None,
            world_size: int | None = None,
            ramp: bool = True,
            cross_split_windows: bool = False,
            remainder: str = "drop",
            stride: int | np.timedelta64 | str | datetime.timedelta = 1,
            empty_ranks: bool = False,
        ) -> None: ...

    def __post_init__(self) -> None:
        if not isinstance(self.split, str) or self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        checked: dict[str, Any] = {
            "batch_size": check_int("batch_size", self.batch_size, minimum=1),
            "block_chunks": check_int("block_chunks", self.block_chunks, minimum=1),
            "shuffle": check_bool("shuffle", self.shuffle),
            "seed": check_int("seed", self.seed, minimum=0),
            "rank": check_optional_int("rank", self.rank),
            "world_size": check_optional_int("world_size", self.world_size),
            "ramp": check_bool("ramp", self.ramp),
            "cross_split_windows": check_bool("cross_split_windows", self.cross_split_windows),
            "remainder": check_remainder(self.remainder),
            "stride": check_stride(self.stride),
            "empty_ranks": check_bool("empty_ranks", self.empty_ranks),
        }
        if checked["remainder"] == "uneven" and self.split == "train":
            raise ValueError(
                "remainder='uneven' is for evaluation (split='val' or 'test'): its ranks' batch "
                "counts differ by one, and in training the rank with one batch more would wait "
                "forever in DDP's gradient sync; train with remainder='drop' (at most "
                "world_size - 1 samples sit out each epoch) or 'pad' (at most world_size - 1 "
                "repeat)"
            )
        if checked["empty_ranks"] and checked["remainder"] != "uneven":
            raise ValueError(
                "empty_ranks=True is for remainder='uneven' (evaluation: every sample once, a "
                f"rank with none running zero batches), got remainder={checked['remainder']!r}; "
                "pass remainder='uneven' with split='val' or 'test'"
            )
        world, rank = checked["world_size"], checked["rank"]
        if world is not None:
            # rank=None is checked as 0 here; the read plan resolves it (resolve_rank_world)
            rk = 0 if rank is None else rank
            if world < 1 or not 0 <= rk < world:
                raise ValueError(f"need 0 <= rank < world_size, got rank={rk}, world_size={world}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> PlanConfig:
        """A copy with ``changes`` (field names as keywords), checked like a new config; an
        unknown name raises ``TypeError``."""
        return dataclasses.replace(self, **changes)

    def for_rank(self, rank: int, world_size: int) -> PlanConfig:
        """A copy for ``rank`` of ``world_size`` ranks, as a read plan resolves them (from
        ``torch.distributed``, or another world's share on elastic resume). Only those two are
        checked (``ValueError`` unless ``0 <= rank < world_size``): the other fields were checked
        when this config was made."""
        rank, world_size = int(rank), int(world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        out = copy.copy(self)
        object.__setattr__(out, "rank", rank)
        object.__setattr__(out, "world_size", world_size)
        return out


def check_stride(stride: Any) -> int | np.timedelta64:
    """``stride`` as an ``int >= 1`` or a positive ``numpy.timedelta64`` (``"6h"``, a
    ``datetime.timedelta``); ``TypeError``/``ValueError`` otherwise."""
    timed = isinstance(stride, np.timedelta64)  # (a numpy integer subclass)
    if not timed and isinstance(stride, int | np.integer) and not isinstance(stride, bool):
        return check_int("stride", int(stride), minimum=1)
    if isinstance(stride, bool | float | np.floating | np.bool_):
        raise TypeError(
            f"stride must be an int (every k-th sample) or a time step such as '6h', got {stride!r}"
        )
    step = as_timedelta(stride, "stride")
    if step <= np.timedelta64(0, "s"):
        raise ValueError(f"stride must be a positive time step, got {stride!r}")
    for unit in ("D", "h", "m", "s", "ms", "us"):  # one spelling per length (equal, same hash)
        coarse = step.astype(f"m8[{unit}]")
        if coarse == step:
            return coarse
    return step.astype("m8[ns]")


def plan_config(config: PlanConfig | None, where: str) -> PlanConfig:
    """``config``, or the default :class:`PlanConfig` for ``None``; anything else raises
    ``TypeError`` naming ``where`` (the function it was passed to). Nothing is checked again:
    a ``PlanConfig`` was checked when it was made."""
    if config is None:
        return PlanConfig()
    if not isinstance(config, PlanConfig):
        raise TypeError(f"{where}: config must be a PlanConfig or None, got {config!r}")
    return config
