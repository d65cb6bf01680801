"""Cache identity: what a persisted chunk must have been made by for a later run to reuse it.

A persistent cache (:mod:`~insitubatch_nodes.cache`) keeps chunks *after* their chunk transforms,
so a cached chunk is valid for a later run only if that run would produce the same bytes: same
decoded geometry (dtype, stored chunking, fill value, inner shape) and the same chunk transforms,
in the same order, on that array. :func:`array_fingerprint` hashes exactly that, per array — a
transform scoped to ``t2m`` with :func:`~insitubatch_nodes.transforms.applies` is part of
``t2m``'s identity only, so editing it leaves ``z``'s cached chunks valid.

The array's *length* along the sample axis is deliberately not part of it: appending samples does
not change the chunks already stored (each cached chunk records how many valid samples it holds,
and a chunk whose count changed is a miss). Nor is the data's content: that is the store
identity's part (:mod:`~insitubatch_nodes.cache.identity`: what identifies each stored object a
cached chunk was made from, checked against one listing of the store at open).

Each transform is identified, in order of preference, by

1. its ``cache_key`` attribute, when it is a string — authoritative: bump it whenever the
   transform's behaviour or its parameters change (e.g. a scaler's statistics version);
2. a hash of its ``cloudpickle`` serialisation — captures the code (of ``__main__``, lambdas
   and nested functions: see below), the closed-over values and referenced globals, and an
   instance's state including array values (an instance may exclude derived state with
   ``__getstate__``; the attributes its class names in ``identity_excludes``, checks that refuse
   arrays and change no byte, count as unset). The function's source position is part of it,
   so moving a function inside its file makes the cache stale — loudly, never wrongly;
3. when it cannot be pickled: a hash of its source and ``repr`` — weaker (closed-over values,
   globals and large arrays, which numpy's ``repr`` summarises, are invisible to it), so it warns
   once per transform type. Give such a transform a ``cache_key``. Memory addresses in the
   ``repr`` (``<... object at 0x...>``) are left out: the identity is the same for every
   instance alike and in every process.

A function or class importable from a module is pickled by reference (its name, not its
code), so neither 1. nor 2. changes when its code does. A transform whose results changed from
one version of its code to the next says so with a method ``cache_revision(geometry) -> str |
None``, given the geometry the transform is given on that array: a string is added to its
identity there, ``None`` adds nothing. :class:`~insitubatch_nodes.transforms.Coarsen` and
:class:`~insitubatch_nodes.transforms.StandardScaler` return ``"float16-in-float32"`` on
float16 arrays, whose chunks they compute in float32 since 6427f56 (in float16 before: inf
where the result is finite), and ``None`` on every other dtype, whose results did not change:
a cache of float16 chunks they made before is stale (``StaleCacheError``, or rebuilt with
``reset_stale_cache=True``), every other cache of theirs stays warm.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import re
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.transforms import Scoped, transform_name

__all__ = ["FINGERPRINT_FORMAT", "array_fingerprint", "transform_identity"]

FINGERPRINT_FORMAT = 1
"""Bumped when what a fingerprint covers changes: every cached array is then stale."""

_warned: set[str] = set()
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_warned_lock = threading.Lock()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def transform_identity(transform: Any, given: ArrayGeometry | None = None) -> str:
    """A string that changes when ``transform`` would produce different bytes (module doc) on
    an array it is given as ``given`` (``None``: its identity on any, no ``cache_revision``)."""
    if isinstance(transform, Scoped):  # the scope decides which arrays it runs on, not what
        transform = transform.transform
    identity = _identity(transform)
    revision = getattr(transform, "cache_revision", None)
    token = revision(given) if given is not None and callable(revision) else None
    return identity if token is None else f"{identity}+{token}"


def _identity(transform: Any) -> str:
    key = getattr(transform, "cache_key", None)
    if isinstance(key, str):
        return f"key:{type(transform).__module__}.{type(transform).__qualname__}:{key}"
    excluded = [n for n in getattr(type(transform), "identity_excludes", ()) if n in
                getattr(transform, "__dict__", {})]  # fmt: skip
    if excluded:  # (attributes that refuse arrays, changing no byte made: as if unset)
        transform = copy.copy(transform)
        for name in excluded:
            setattr(transform, name, None)
    try:
        import cloudpickle

        return f"pickle:{_digest(cloudpickle.dumps(transform, protocol=5))}"
    except Exception as exc:  # unpicklable (a lock, an open file, ...): the weaker fallback
        reason = f"{type(exc).__name__}: {exc}"
    return f"source:{_source_digest(transform, reason)}"


def _source_digest(transform: Any, reason: str) -> str:
    target = transform if inspect.isroutine(transform) else type(transform)
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = getattr(target, "__qualname__", type(transform).__qualname__)
    name = transform_name(transform)
    with _warned_lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        warnings.warn(
            f"insitubatch_nodes: chunk transform {name} cannot be serialised ({reason}), so "
            "the persistent cache identifies it by its source and repr only: a change in the "
            "values it closes over, the globals it reads or large arrays it holds goes "
            "unnoticed and the cache would serve chunks made by the old transform. Give it a "
            "cache_key string attribute that you change whenever its behaviour changes.",
            UserWarning,
            stacklevel=3,
        )
    # a default repr (``<... object at 0x7f...>``, also inside a custom one) names where the
    # object lies in memory: another in every process and for every instance, which would make
    # every fresh run's cache stale
    shown = _ADDRESS.sub(" at 0x", repr(transform))
    return _digest(f"{source}\n{shown}".encode())


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def array_fingerprint(
    source: ArrayGeometry,
    output: ArrayGeometry,
    transforms: Sequence[Any],
    inputs: Sequence[ArrayGeometry] | None = None,
) -> str:
    """16 hex digits identifying the chunks a pipeline keeps for one array: ``source`` is the
    decoded array's geometry, ``output`` what the slots hold, ``transforms`` the chunk transforms
    that run on it, in order, and ``inputs`` the geometry each is given
    (:meth:`~insitubatch_nodes.transforms.ChunkTransforms.inputs`; ``None``: ``source``, right
    where no transform casts or reshapes). See the module docstring for what is and is not
    covered."""
    if inputs is None:
        inputs = [source] * len(transforms)
    if len(inputs) != len(transforms):
        raise ValueError(
            f"array_fingerprint: {len(inputs)} inputs for {len(transforms)} transforms: give "
            "the geometry each transform is given (ChunkTransforms.inputs(path))"
        )
    identity = {
        "format": FINGERPRINT_FORMAT,
        "array": source.path,
        "dtype": source.dtype.str,
        "chunks": list(source.chunks),
        "read_chunks": list(source.read_chunks),
        "sample_axis": source.sample_axis,
        "inner_shape": list(source.inner_shape),
        "fill_value": _jsonable(source.fill_value),
        "output": [list(output.inner_shape), output.dtype.str],
        "transforms": [transform_identity(t, g) for t, g in zip(transforms, inputs, strict=True)],
    }
    if source.cf is not None:  # stored values decoded (CF mask and scale): by which rule
        identity["cf"] = source.cf.fingerprint
    if source.members is not None:  # a collection: which members, of which lengths
        identity["members"] = source.members.fingerprint
    if source.product is not None:  # product sample axes: the blocks' order and slot layout
        identity["product"] = source.product.fingerprint
    return _digest(json.dumps(identity, sort_keys=True).encode())
