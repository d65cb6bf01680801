"""What a stored object that cannot be read or decoded does to its batch: ``on_bad_chunk``.

``"raise"`` fails the batch that needs the object. ``"nan"`` fills the object's rectangle and
goes on: it is for the occasional object a store will not return (an upload cut short, an
object the credentials may not read) or whose bytes do not decode. A store that returns *none*
is not that — credentials that expired mid-run, a store or a network that is down — and
filling would turn the rest of the run into fill values, one logged warning per object. So
under ``"nan"`` too, a failed read fails its batch once :data:`READ_FAILURES_IN_A_ROW` reads
have failed with no stored object served between them (the pool's count of reads served is
the clock: nothing is added to the path of a read that succeeds; a collection's several stores
count each its own). Its
:class:`~insitubatch_nodes.errors.ChunkReadError` says so (``in_a_row``). Objects that do not
decode never count: a store that serves bytes is answering.
"""

from __future__ import annotations

import threading

from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.io.routing import split_routed
from insitubatch_nodes.pool import ChunkPool

__all__ = ["READ_FAILURES_IN_A_ROW", "BadChunks"]

#: failed reads in a row, none served between them, that ``on_bad_chunk="nan"`` still fills
READ_FAILURES_IN_A_ROW = 64


class BadChunks:
    """``on_bad_chunk`` (``"raise"`` or ``"nan"``) for one fetch stage's fills (any thread).

    ``served``: for a collection's several stores (a
    :class:`~insitubatch_nodes.io.objects.RoutedGetter`'s), the objects each store returned:
    the run of failed reads is then counted per store, so that the objects the other stores
    serve do not hide one that returns none."""

    def __init__(self, policy: str, pool: ChunkPool, served: list[int] | None = None) -> None:
        self.policy = policy
        self._pool = pool
        self._by_store = served
        self._lock = threading.Lock()
        self._failed: dict[int, int] = {}  # per store: reads failed since one was served
        self._served: dict[int, int] = {}  # per store: the count served when one last failed

    def fills(self, error: ChunkReadError) -> bool:
        """Whether ``error``'s object is filled (else it fails its batch); a read failing after
        :data:`READ_FAILURES_IN_A_ROW` others, none served between them, is not, and its
        error's ``in_a_row`` says how many failed."""
        if self.policy == "raise":
            return False
        if error.what != "read":
            return True
        store = 0
        if self._by_store is None:  # (read unlocked: a count from a moment ago will do)
            served = self._pool.stats.gets
        else:
            store = split_routed(error.key)[0]
            served = self._by_store[store]
        with self._lock:
            if served != self._served.get(store):
                self._served[store], self._failed[store] = served, 0
            failed = self._failed[store] = self._failed[store] + 1
            if failed <= READ_FAILURES_IN_A_ROW:
                return True
            error.in_a_row = failed
            return False
