"""What every stage shares: the state key, and walking a graph of nodes.

A graph is the chain of ``torchdata.nodes`` from its root down to a
:class:`~insitubatch_nodes.stages.read_plan.ReadPlanNode`. The stages of this package keep their
source as ``source``; a plain torchdata node placed between two stages (a ``Mapper``, a
``Batcher``) keeps its own the same way or under another attribute. So a walk follows every
attribute that holds a node, and finds what a stage needs below it (the fetch stage's recorder
and batch-buffer hand-off, the read plan) whatever sits in between. ``close`` and ``interrupt``
reach every stage of ours the same way: a node without them is walked through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from torchdata.nodes import BaseNode

__all__ = [
    "SOURCE_KEY",
    "close_node",
    "find_attr",
    "find_node",
    "interrupt_below",
    "nests_source_state",
    "nodes_below",
    "plan_state",
]

SOURCE_KEY = "source"
"""Every stage above the read plan nests its source's state under this key (checkpoints carry
it: renaming it breaks every saved state)."""

N = TypeVar("N")


def _children(node: Any) -> list[Any]:
    """The nodes ``node`` holds, its ``source`` first."""
    first = getattr(node, "source", None)
    out = [first] if isinstance(first, BaseNode) else []
    attrs = vars(node) if hasattr(node, "__dict__") else {}
    out += [v for v in attrs.values() if isinstance(v, BaseNode) and v is not first]
    return out


def nodes_below(node: Any) -> Iterator[Any]:
    """Every node under ``node`` (not ``node`` itself), depth first, each once."""
    seen = {id(node)}
    stack = list(reversed(_children(node)))
    while stack:
        child = stack.pop()
        if id(child) in seen:
            continue
        seen.add(id(child))
        yield child
        stack.extend(reversed(_children(child)))


def find_node(node: Any, kind: type[N]) -> N | None:
    """``node`` itself or the first node under it that is a ``kind``; ``None`` if none is."""
    if isinstance(node, kind):
        return node
    return next((n for n in nodes_below(node) if isinstance(n, kind)), None)


def find_attr(node: Any, name: str) -> Any:
    """The first non-``None`` attribute ``name`` of ``node`` or a node under it; else ``None``."""
    for below in (node, *nodes_below(node)):
        value = getattr(below, name, None)
        if value is not None:
            return value
    return None


def close_node(node: Any) -> None:
    """``node.close()`` when it has one (our stages close their own sources); else close each
    node it holds, so a plain torchdata node between two stages does not cut the chain."""
    closer: Callable[[], None] | None = getattr(node, "close", None)
    if callable(closer):
        closer()
        return
    for child in _children(node):
        close_node(child)


def interrupt_below(node: Any) -> None:
    """``interrupt()`` on ``node`` and on every node under it that has one (thread-safe): a
    stage blocked waiting on a chunk wakes at once."""
    for n in (node, *nodes_below(node)):
        interrupt = getattr(n, "interrupt", None)
        if callable(interrupt):
            interrupt()


def plan_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The read plan's state inside a graph's (or a ``Loader``'s) state, however the nodes above
    it nest their sources' states (ours under :data:`SOURCE_KEY`; torchdata's own nodes under
    keys of theirs): the first mapping, depth first, that holds ``"config"`` and
    ``"batches_emitted"``. ``ValueError`` when there is none."""
    stack: list[Any] = [state.get("root", state)]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            if "config" in node and "batches_emitted" in node:
                return node
            stack.extend(reversed(list(node.values())))
    raise ValueError("not an insitubatch_nodes pipeline state (no read-plan state inside)")


def nests_source_state(node: Any) -> bool:
    """Whether ``node`` is a stage of this package above the plan (its state is its source's
    state under :data:`SOURCE_KEY`, and nothing else that a fresh start would need)."""
    return bool(getattr(node, "NESTS_SOURCE_STATE", False))
