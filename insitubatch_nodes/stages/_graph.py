"""What every stage's state shares: the key a stage nests its source's state under, and the
read plan's state found inside a graph's.

Stages never search a graph for each other (they are handed a
:class:`~insitubatch_nodes.stages.context.StageContext`); only a *state* — a plain dict from a
checkpoint, nested once per node above the plan — is read through, to find the read plan's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

__all__ = [
    "SOURCE_KEY",
    "STOP_OWED",
    "owe_stops",
    "plan_state",
    "source_start_state",
    "source_state",
]

SOURCE_KEY = "source"
"""Every stage above the read plan nests its source's state under this key (checkpoints carry
it: renaming it breaks every saved state)."""


STOP_OWED = "stop_owed"
"""Set (``True``) in a read plan's state by :func:`owe_stops`, never saved: restored at its
epoch's end, the plan owes its consumer that epoch's ``StopIteration`` (see ``ReadPlanNode``)."""

# torchdata's MultiNodeWeightedSampler keeps its sources' states and which of them it found
# exhausted under these keys (its class attributes, spelled here: read from states, not nodes)
_SAMPLER_STATES, _SAMPLER_EXHAUSTED = "dataset_node_states", "datasets_exhausted"


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
    for node in _plan_states(state.get("root", state)):
        return node
    raise ValueError("not an insitubatch_nodes pipeline state (no read-plan state inside)")


def owe_stops(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` (a ``Loader``'s) with :data:`STOP_OWED` set in the plan state of every source
    of a torchdata ``MultiNodeWeightedSampler`` that the sampler had not found exhausted: such
    a source, saved after its epoch's last batch, had not yet raised that epoch's
    ``StopIteration``, and the sampler asks it for one more item (marking it exhausted on the
    ``StopIteration``) - a source restored into its next epoch at once would hand it that
    epoch's first batch instead. Only a source whose state holds one plan (a pipeline, under
    any nodes of its own) is marked. ``state`` itself is never changed: where it holds a
    sampler's state a copy is returned (torchdata 0.11's sampler also keeps the dict of
    exhausted sources it is restored from, and changes it as it goes), else ``state``."""
    found = False

    def walk(node: Any) -> Any:
        nonlocal found
        if not isinstance(node, Mapping):
            return node
        out = {k: walk(v) for k, v in node.items()}
        sources, exhausted = out.get(_SAMPLER_STATES), node.get(_SAMPLER_EXHAUSTED)
        if isinstance(sources, Mapping) and isinstance(exhausted, Mapping):
            found = True
            for key, source in sources.items():
                plans = list(_plan_states(source))  # (dicts: copies made by this walk)
                if exhausted.get(key) is False and len(plans) == 1:
                    cast(dict[str, Any], plans[0])[STOP_OWED] = True
        return out

    copied = walk(state)
    return copied if found else state


def _plan_states(state: Any) -> Iterator[Mapping[str, Any]]:
    """Every read plan's state inside ``state``, depth first in the order of its keys: each
    mapping that holds ``"config"`` and ``"batches_emitted"`` (not looked into further)."""
    stack: list[Any] = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            if "config" in node and "batches_emitted" in node:
                yield node
            else:
                stack.extend(reversed(list(node.values())))
