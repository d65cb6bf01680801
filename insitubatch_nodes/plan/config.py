"""``PlanConfig``: what a read plan draws, as one checked, immutable object.

The same ten settings — ``split, batch_size, block_chunks, shuffle, seed, rank, world_size,
ramp, cross_split_windows, remainder`` — describe a read plan wherever one is drawn or sized:
:class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`,
:func:`~insitubatch_nodes.plan.schedule.choose_schedule`,
:func:`~insitubatch_nodes.plan.schedule.schedule_floors` and
:func:`~insitubatch_nodes.insitu_pipeline` each take one as ``config=``, and still take the
settings as loose keywords (:func:`resolve_plan_config` turns either into a ``PlanConfig``).
Pure Python: no torchdata, no numpy arrays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from insitubatch_nodes._checks import check_bool, check_int, check_optional_int
from insitubatch_nodes.plan.ranks import check_remainder
from insitubatch_nodes.plan.splits import SPLITS

__all__ = ["SCHEDULE_FIELDS", "PlanConfig", "resolve_plan_config"]

# The settings the schedule functions (choose_schedule, schedule_floors) depend on: the bounds
# hold for every shuffle, seed, rank and ramp, so those four are not among them.
SCHEDULE_FIELDS = (
    "split",
    "batch_size",
    "block_chunks",
    "cross_split_windows",
    "remainder",
    "world_size",
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
    * ``cross_split_windows`` (``False``): let windows read samples of another split;
    * ``remainder`` (``"drop"``): ``"drop"`` or ``"pad"``, what several ranks do with the
      samples that do not divide evenly between them.

    **Contract.** Construction checks every field with the package's shared checks and raises
    what the loose keywords always raised: ``TypeError`` for the wrong kind of value (a float,
    a ``bool`` or a string where an integer belongs; anything but ``True``/``False`` for a
    flag; a non-string ``remainder``), ``ValueError`` for a value out of range (a count below
    1, a negative seed, an unknown ``split`` or ``remainder``, a ``world_size`` below 1 or a
    ``rank`` outside ``[0, world_size)`` when ``world_size`` is given). Accepted values are
    normalised to plain Python (``numpy`` integers and ``numpy.bool_`` become ``int`` and
    ``bool``), so two configs are equal exactly when they draw the same plans. The object is
    frozen and hashable; :meth:`replace` returns a checked copy.
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
        }
        world, rank = checked["world_size"], checked["rank"]
        if world is not None:
            # with world_size given, rank=None means 0 (as ReadPlanNode resolves it)
            rk = 0 if rank is None else rank
            if world < 1 or not 0 <= rk < world:
                raise ValueError(f"need 0 <= rank < world_size, got rank={rk}, world_size={world}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> PlanConfig:
        """A copy with ``changes`` (field names as keywords), checked like a new config; an
        unknown name raises ``TypeError``."""
        return dataclasses.replace(self, **changes)

    def schedule_kwargs(self) -> dict[str, Any]:
        """The keywords :func:`~insitubatch_nodes.plan.schedule.choose_schedule` and
        :func:`~insitubatch_nodes.plan.schedule.schedule_floors` take (:data:`SCHEDULE_FIELDS`),
        for a caller that passes them loose."""
        return {name: getattr(self, name) for name in SCHEDULE_FIELDS}


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlanConfig)}


def _is_default(name: str, value: Any) -> bool:
    default = _DEFAULTS[name]
    return value is default or (type(value) is type(default) and value == default)


def resolve_plan_config(config: PlanConfig | None, where: str, **keywords: Any) -> PlanConfig:
    """The one :class:`PlanConfig` a function with both ``config=`` and the loose plan
    keywords works from.

    ``keywords`` are the loose plan keywords ``where`` (the function's name, for messages) was
    called with, each a :class:`PlanConfig` field. Without ``config`` they build the config
    (and are checked there). With ``config`` every one of them must still be at its default:
    one that differs raises ``TypeError`` naming it — pass the settings one way, not both.
    """
    if config is None:
        return PlanConfig(**keywords)
    if not isinstance(config, PlanConfig):
        raise TypeError(f"{where}: config must be a PlanConfig or None, got {config!r}")
    given = [name for name, value in keywords.items() if not _is_default(name, value)]
    if given:
        raise TypeError(
            f"{where}: pass config=PlanConfig(...) or the plan keywords ({', '.join(given)}), "
            "not both (use config.replace(...) to change a setting of a config)"
        )
    return config
