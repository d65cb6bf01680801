"""What every stage's state shares: the key a stage nests its source's state under, and the
read plan's state found inside a graph's.

Stages never search a graph for each other (they are handed a
:class:`~insitubatch_nodes.stages.context.StageContext`); only a *state* — a plain dict from a
checkpoint, nested once per node above the plan — is read through, to find the read plan's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SOURCE_KEY", "plan_state", "source_start_state", "source_state"]

SOURCE_KEY = "source"
"""Every stage above the read plan nests its source's state under this key (checkpoints carry
it: renaming it breaks every saved state)."""


def source_state(initial_state: Mapping[str, Any] | None) -> Any:
    """The source's part of a stage's ``initial_state`` (``None`` starts a fresh epoch);
    ``ValueError`` when it has none: a state saved by a graph of another shape."""
    if initial_state is None:
        return None
    if not isinstance(initial_state, Mapping) or SOURCE_KEY not in initial_state:
        keys = sorted(initial_state) if isinstance(initial_state, Mapping) else initial_state
        raise ValueError(
            f"this state does not fit this graph: a stage's state holds its source's under "
            f"{SOURCE_KEY!r}, and this one has {keys!r} (saved by a graph with other nodes "
            "between or above its stages?). Restore a state into a graph built as the one that "
            "saved it, with the same torchdata nodes in the same places"
        )
    return initial_state[SOURCE_KEY]


def source_start_state(source: Any, epoch: int) -> dict[str, Any] | None:
    """A stage's state before the first batch of ``epoch``: its source's, nested under
    :data:`SOURCE_KEY`; ``None`` when the source cannot say (a plain torchdata node, whose
    state cannot be made up)."""
    start = getattr(source, "start_state", None)
    if not callable(start):
        return None
    state = start(epoch)
    return None if state is None else {SOURCE_KEY: state}


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
