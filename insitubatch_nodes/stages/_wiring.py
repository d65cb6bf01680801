"""How a stage is built over its source: a graph wired wrong is refused where it is built.

A graph is ``ReadPlanNode → AsyncChunkFetchNode → ChunkPoolNode → GatherNode → PrefetcherNode``,
each stage built over the one before it with the graph's
:class:`~insitubatch_nodes.stages.context.StageContext`; plain torchdata nodes (a ``Mapper``, a
``Batcher``) may sit between two stages. Every stage above the read plan calls
:func:`check_wiring` first thing in its constructor, and :func:`claim` last (once it is built):

* the context is a :class:`StageContext` and the source a ``torchdata.nodes.BaseNode``
  (``TypeError``);
* the nearest stage of this package under the source — reached through the ``source`` of any
  torchdata nodes between — belongs to the same context (a read plan: the context's own), and
  is the one before it in :data:`ORDER`, else ``ValueError``. Only through a node between may
  it lie further down: that node may do the skipped stages' work (``Mapper(resident,
  my_gather)`` under a ``PrefetcherNode``; see ``FetchOptions.direct``); a stage at or above
  this one's place below it is always refused;
* that stage feeds no other stage yet (``ValueError``): a stage is read by one reader, and two
  graphs over one stage each get part of its batches, or release each other's chunks. A stage
  whose reader was dropped (garbage-collected) may be read again; a stage whose construction
  failed claims nothing.

Where no stage of this package lies under the source (a node of the user's own that yields the
items), nothing can be checked: the source is taken as given.
"""

from __future__ import annotations

import weakref
from typing import Any

from torchdata.nodes import BaseNode

from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.read_plan import ReadPlanNode

__all__ = ["ORDER", "check_wiring", "claim", "stage_below"]

ORDER = ("ReadPlanNode", "AsyncChunkFetchNode", "ChunkPoolNode", "GatherNode", "PrefetcherNode")
"""The stages of a graph, bottom-up; each stage class above the plan has its place here as
``STAGE``."""

_GRAPH = " → ".join(ORDER)

#: stage -> the stage built over it (weakly held both ways: a dropped reader frees its source)
_READERS: weakref.WeakKeyDictionary[BaseNode[Any], weakref.ref[BaseNode[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _place(node: object) -> int | None:
    if isinstance(node, ReadPlanNode):
        return 0
    place = getattr(type(node), "STAGE", None)  # (the stages above it: they import this module)
    return place if isinstance(place, int) else None


def stage_below(source: object) -> BaseNode[Any] | None:
    """The nearest stage of this package at or under ``source`` (following the ``source`` of
    plain torchdata nodes), or ``None``."""
    node, seen = source, set()
    while isinstance(node, BaseNode) and id(node) not in seen:
        if _place(node) is not None:
            return node
        seen.add(id(node))
        node = getattr(node, "source", None)
    return None


def check_wiring(place: int, source: object, context: object) -> StageContext:
    """Refuse building stage ``ORDER[place]`` over ``source`` with ``context`` when the graph
    would be wired wrong (module docstring); return the context."""
    name = ORDER[place]
    if not isinstance(context, StageContext):
        raise TypeError(
            f"{name}(context=...) takes the graph's StageContext, made once with "
            f"StageContext.create(plan, pool) and given to every stage of the graph; got "
            f"{context!r}"
        )
    if not isinstance(source, BaseNode):
        raise TypeError(
            f"{name}'s source must be a torchdata.nodes.BaseNode: the graph's "
            f"{ORDER[place - 1]} (or a torchdata node over it); got {source!r}"
        )
    below = stage_below(source)
    if below is None:
        return context
    at = _place(below) or 0
    found = ORDER[at]
    if at >= place or (at < place - 1 and below is source):
        raise ValueError(
            f"{name} is built over a {found}: a graph is {_GRAPH}, each stage built over the "
            f"one before it (plain torchdata nodes may sit between two stages); build the "
            f"{name} over the graph's {ORDER[place - 1]}"
        )
    ours = below is context.plan if at == 0 else getattr(below, "context", None) is context
    if not ours:
        raise ValueError(
            f"the {found} this {name} is built over belongs to another graph (another "
            "StageContext, or a context made for another ReadPlanNode): make one StageContext "
            "per graph with StageContext.create(plan, pool), from that graph's ReadPlanNode, "
            "and give it to every stage of that graph"
        )
    held = _READERS.get(below)
    reader = None if held is None else held()
    if reader is not None:
        raise ValueError(
            f"this {found} already feeds a {type(reader).__name__}: a stage is read by one "
            "stage (two readers would each get part of its batches, or release each other's "
            "chunks). For a second graph or a second loop build a second graph: a new "
            "ReadPlanNode, StageContext and stages (or insitu_pipeline again)"
        )
    return context


def claim(stage: BaseNode[Any], source: object) -> None:
    """Record ``stage`` (just built) as the reader of the stage under ``source``."""
    below = stage_below(source)
    if below is not None:
        _READERS[below] = weakref.ref(stage)
