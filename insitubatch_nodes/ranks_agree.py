"""Ranks that build together fail together: each rank's outcome told to every rank.

Every rank of an initialised ``torch.distributed`` group builds its own pipeline over the
group (its share of the split), and every rank reaches the same point. A build can fail on
one rank alone: a store path, an attribute document (anemoi-datasets' ``missing_dates``) or a
cache directory that only that rank cannot read. Before 2026-12-07 that rank raised and the
others went on unaware: they trained until their first collective call (DDP's gradient sync)
waited for it until the group's timeout or the launcher ended the job, and what they said then
(a timeout, ``Connection closed by peer``) named neither the rank nor its reason.

Now a build over the group, and :meth:`~insitubatch_nodes.pipeline.InSituPipeline.set_views`
of a pipeline built so, end with one ``all_gather_object`` of every rank's outcome (a few
hundred bytes: done, or the error's type and message). The rank that failed raises its own
error; every other rank raises a :class:`~insitubatch_nodes.errors.RankFailedError` naming
each failed rank and what it raised — at the same point, as soon as the slowest rank is done.
``set_views`` is all or nothing (:func:`together`): it changes nothing until every rank's
outcome is heard, and nothing on any rank where one failed (until late on 2026-12-07 the ranks
where it succeeded had taken the new views: caught and gone on from, rank 0 read them and
rank 1 the old ones, ``tests/test_viewsrollback_trial.py``).
The same exchange carries what the ranks must agree on (their read plans, where each listed
the store: :func:`~insitubatch_nodes.plan.ranks.check_same_plans`). A rank that never reaches
it (its process killed, or stuck) leaves the others waiting there until the group's timeout;
that error then says it came from this exchange.

The exchange runs only where the plan is dealt over the group (:func:`group_share`): a
pipeline given ``world_size=1`` (the whole split on one rank) or another group's share is this
process's own, and meets no one. A NCCL group exchanges on ``torch.cuda.current_device()``:
set each rank's device before it builds, as DDP itself needs (Lightning does).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from insitubatch_nodes.errors import RankFailedError, short_cause
from insitubatch_nodes.plan.ranks import default_rank_world

__all__ = ["fail_together", "group_share", "succeed_together", "together"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: the longest reason a rank tells the others (its whole error is in its own log)
REASON_CHARS = 1000


def group_share(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` of the initialised ``torch.distributed`` group where a plan
    given ``rank`` and ``world_size`` (``None``: the group's) is dealt over it, with two ranks
    or more: every rank of the group then builds its own, and takes part in the exchange.
    ``None`` otherwise (no group, a group of one, ``world_size=1``, or a rank or world size
    that is not the group's: read by this process alone). Never raises: a rank or world size
    that cannot be is refused where the plan is built."""
    group_rank, world = default_rank_world()
    if world < 2 or world_size not in (None, world) or rank not in (None, group_rank):
        return None
    return group_rank, world


def fail_together(share: tuple[int, int] | None, error: BaseException, what: str) -> None:
    """Tell every rank of the group (:func:`group_share`; nothing when ``None``) that this
    rank's ``what`` raised ``error``; the caller then raises ``error`` itself. An exchange that
    fails too (another rank's process died) is logged, not raised: ``error`` is what this rank
    has to say."""
    if share is None:
        return
    try:
        _exchange(share, {"failed": short_cause(error, REASON_CHARS)}, what)
    except Exception as exc:  # (this rank's own error is the one to raise)
        log.warning("rank %d could not tell the other ranks that %s failed: %s",
                    share[0], what, short_cause(exc, REASON_CHARS))  # fmt: skip


def succeed_together(share: tuple[int, int] | None, what: str, told: Any = None) -> list[Any]:
    """Tell every rank of the group (:func:`group_share`) that this rank's ``what`` is done,
    with ``told`` (JSON values), and hear theirs: every rank's ``told`` in rank order
    (``[told]`` when ``share`` is ``None``). :class:`RankFailedError` naming the ranks whose
    ``what`` raised, and what each raised, when any did (they raise their own errors)."""
    if share is None:
        return [told]
    outcomes = _exchange(share, {"told": told}, what)
    failed = {r: str(o["failed"]) for r, o in enumerate(outcomes) if "failed" in o}
    if failed:
        raise RankFailedError(_said(failed, share, what), failed=failed, world_size=share[1])
    return [o["told"] for o in outcomes]


def together(
    what: str, share_of: Callable[[Any], tuple[int, int] | None]
) -> Callable[[Callable[Concatenate[Any, P], Callable[[], R]]], Callable[Concatenate[Any, P], R]]:
    """A method that every rank of the group calls alike, made all or nothing over the group:
    the method decorated prepares its change without making it (it checks, reads, counts;
    nothing is changed) and returns what makes it, a callable of no arguments that cannot
    fail. Its outcome is exchanged (:func:`fail_together`, :func:`succeed_together`) over
    ``share_of(self)``, and the change is made (the callable called, its result returned)
    only once every rank prepared it: where one rank failed, nothing of it takes effect on
    any rank — the rank that failed raises its own error, the others
    :class:`RankFailedError` — so every rank goes on as it was, alike. (Until late on
    2026-12-07 a rank where it succeeded had made its change before it heard: a caller who
    caught the error went on with that rank changed and the failed one not.)"""

    def wrap(
        prepare: Callable[Concatenate[Any, P], Callable[[], R]],
    ) -> Callable[Concatenate[Any, P], R]:
        @functools.wraps(prepare)
        def run(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
            share = share_of(self)
            try:
                take = prepare(self, *args, **kwargs)
            except Exception as exc:
                fail_together(share, exc, what)
                raise
            try:
                succeed_together(share, what)
            except RankFailedError as exc:
                exc.add_note(
                    f"insitubatch_nodes: nothing of {what} took effect on this rank, nor on "
                    "any other: caught, every rank goes on as it was before the call (no need "
                    "to start again for it)"
                )
                raise
            return take()

        return run

    return wrap


def _exchange(share: tuple[int, int], mine: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """Every rank's ``mine``, in rank order: one ``all_gather_object`` of a JSON string."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * share[1]
    try:
        dist.all_gather_object(gathered, json.dumps(mine, sort_keys=True, default=str))
    except Exception as exc:
        exc.add_note(
            f"insitubatch_nodes: raised on rank {share[0]} of {share[1]} while the ranks told "
            f"each other how {what} went (one all_gather_object, which every rank reaches "
            "whether it succeeded or not): a rank that did not reach it died or is still at "
            "work (see its log), or built fewer pipelines over the group than this one"
        )
        raise
    return [json.loads(g) for g in gathered]


def _said(failed: dict[int, str], share: tuple[int, int], what: str) -> str:
    """The message of the :class:`RankFailedError` raised on rank ``share[0]``."""
    ranks = sorted(failed)
    if len(ranks) == 1:
        who, them, its = f"rank {ranks[0]}", "it", "its"
        reasons = failed[ranks[0]]
    else:
        names = ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
        who, them, its = f"ranks {names}", "them", "their"
        reasons = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
    return (
        f"{who} of {share[1]} raised during {what}, which succeeded on this rank "
        f"({share[0]}): {reasons}. Every rank raises here rather than go on without {them} "
        f"(the first collective call, DDP's gradient sync, would wait for {them} until the "
        f"group's timeout). Mend what {who} said ({its} traceback is in {its} own log) and "
        "start every rank again"
    )
