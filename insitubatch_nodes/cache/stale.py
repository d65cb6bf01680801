"""What the chunks a store check finds stale do to a cache (:meth:`StoreCheck.stale`, at open).

A **writer** drops them from its index: each is fetched again when a batch needs it, its file
and identity rewritten; a warning in the ``insitubatch_nodes.cache`` log counts them and names
the first few objects.

A **read-only reader** drops them too, and is refused only for what it would serve
(:class:`~insitubatch_nodes.errors.StaleCacheError`, naming the objects): when it is opened,
for the stale chunks its split reads (``serves``: the pipeline's
:func:`~insitubatch_nodes.stages.context.chunks_served`, the same on every rank, so several
ranks start or are refused alike), and for any other the moment a read needs it (a view
``set_views`` adds, a static array): a stale chunk is never served, and one it never reads (of
another split, the old last chunk after an append) does not stop it. Without ``serves`` (a
cache composed by hand) every stale chunk of its arrays refuses it when opened.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from insitubatch_nodes.cache.identity import StaleReport
from insitubatch_nodes.cache.lock import WARNED_UNCHECKED
from insitubatch_nodes.errors import StaleCacheError

__all__ = ["StaleChunks"]

_log = logging.getLogger("insitubatch_nodes.cache")

Serves = Callable[[], Iterable[tuple[str, int]]]


class StaleChunks:
    """The stale chunks of one cache at ``root`` over the store named ``store`` (see the
    module docstring). ``serves`` gives the chunk keys a read-only reader's plan reads (asked
    only when a chunk is stale), ``None`` for every chunk of its arrays."""

    def __init__(self, root: Path, store: str, serves: Serves | None = None) -> None:
        self.root, self.store, self.serves = root, store, serves
        self.held = StaleReport()  # a read-only reader's stale chunks, dropped from its index

    def found(self, report: StaleReport, readonly: bool) -> None:
        """Act on the stale chunks of ``report`` (the caller drops them from its index): a
        writer warns; a reader keeps them, and raises ``StaleCacheError`` for those it serves."""
        if report.unchecked is not None and (str(self.root), self.store) not in WARNED_UNCHECKED:
            WARNED_UNCHECKED.add((str(self.root), self.store))
            warnings.warn(
                f"insitubatch_nodes: cache_dir {self.root} is trusted without checking store "
                f"{self.store}: {report.unchecked}. A chunk whose stored objects changed since "
                "it was cached would be served as cached. Pass check_store=False if the store "
                "is known not to change (this warning goes), or give the changed data a new "
                "cache_dir.",
                UserWarning,
                stacklevel=6,
            )
        if not report.chunks:  # (a failed listing leaves only the chunks of another store)
            return
        if readonly:
            self.held.merge(report)
            served = report.chunks if self.serves is None else report.chunks.intersection(
                self.serves()
            )  # fmt: skip
            if served:
                raise StaleCacheError(stale_message(self.root, self.store, report.only(served)))
            return
        _log.warning(
            "insitubatch_nodes: %d cached chunk(s) in %s are stale (their stored objects in %s "
            "changed, or they were cached from another store): they are fetched again and "
            "rewritten: %s",
            len(report.chunks),
            self.root,
            self.store,
            report.describe(),
        )

    def refuse(self, key: tuple[str, int]) -> None:
        """``StaleCacheError`` when ``key`` is a stale chunk a read-only reader holds: a read
        needs it now, and it is never served."""
        if key in self.held.chunks:
            raise StaleCacheError(stale_message(self.root, self.store, self.held.only([key])))


def stale_message(root: Path, store: str, report: StaleReport) -> str:
    """The :class:`~insitubatch_nodes.cache.StaleCacheError` message of a read-only cache."""
    if report.elsewhere:
        return (
            f"cache_dir {root} holds {len(report.chunks)} chunk(s) that store {store} cannot "
            f"vouch for: {report.describe()}. A cache serves the store it was warmed from: "
            "read that store, give this one another cache_dir, or warm it again with a writing "
            "run (readonly_cache=False), which refetches just those chunks."
        )
    return (
        f"cache_dir {root} holds {len(report.chunks)} chunk(s) whose stored objects in store "
        f"{store} changed since they were cached, or cannot be vouched for: "
        f"{report.describe()}, and this reader reads them. Warm the cache again with a writing "
        "run (readonly_cache=False) whose split reads those chunks, which refetches just them "
        "(a writer whose split does not read them leaves them stale); or pass "
        "check_store=False if the store is known not to change."
    )
