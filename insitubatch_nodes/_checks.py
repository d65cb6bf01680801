"""Argument checks at the public boundary: one sentence that says what to pass instead.

The settings objects (``PlanConfig``, ``FetchOptions``, ``CacheOptions``: checked once, where
they are made) and the stages' own arguments use these, so a float seed, a string flag or a
``bool`` where a count belongs is refused the same way everywhere, rather than being truncated
by ``int()`` or taken as truthy.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "BAD_CHUNK_POLICIES",
    "check_batch_transforms",
    "check_bool",
    "check_chunk_transforms",
    "check_instance",
    "check_int",
    "check_number",
    "check_on_bad_chunk",
    "check_optional_int",
]


def _name_of(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a ``bool`` (``numpy.bool_`` included), else ``TypeError``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {_name_of(value)}")


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as a Python ``int`` if it is an integer (not a ``bool``) ``>= minimum``.

    A ``bool``, a float (even ``3.0``) or a string raises ``TypeError``; an integer below
    ``minimum`` raises ``ValueError``. NumPy integers are accepted.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {_name_of(value)}")
    out = int(value)
    if minimum is not None and out < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {out}")
    return out


def check_instance(name: str, value: Any, cls: type | tuple[type, ...], what: str) -> None:
    """``TypeError`` saying that ``name`` must be ``what`` (e.g. ``"a SplitManifest (from
    split_by_chunk)"``) and what it got, unless ``value`` is an instance of ``cls``: checked
    where the object is made, not deep inside the first epoch as an ``AttributeError``."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {value!r:.100} ({type(value).__name__})")


def check_number(name: str, value: Any, *, minimum: float | None = None) -> float:
    """``value`` as a ``float`` if it is a real number (not a ``bool``; else ``TypeError``),
    finite and ``>= minimum`` (else ``ValueError``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_name_of(value)}")
    out = float(value)
    if not math.isfinite(out) or (minimum is not None and out < minimum):
        at_least = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{name} must be a finite number{at_least}, got {out}")
    return out


def check_optional_int(name: str, value: Any, *, minimum: int | None = None) -> int | None:
    """``None``, or :func:`check_int` of ``value``."""
    if value is None:
        return None
    return check_int(name, value, minimum=minimum)


#: What ``on_bad_chunk`` accepts: fail the epoch, or fill the bad stored chunk and go on.
BAD_CHUNK_POLICIES = ("raise", "nan")


def check_on_bad_chunk(value: Any) -> str:
    """``value`` if it is one of :data:`BAD_CHUNK_POLICIES`, else ``ValueError``/``TypeError``."""
    if not isinstance(value, str):
        raise TypeError(f"on_bad_chunk must be 'raise' or 'nan', got {value!r}")
    if value not in BAD_CHUNK_POLICIES:
        raise ValueError(
            "on_bad_chunk must be 'raise' (a stored chunk that cannot be read or decoded fails "
            "the epoch) or 'nan' (it is filled with NaN, or the fill value for non-float "
            f"arrays, and listed in bad_chunks), got {value!r}"
        )
    return value


def check_chunk_transforms(value: Any) -> tuple[Any, ...]:
    """``value`` as a tuple if it is a sequence (not a string) of callables ``DecodedChunk ->
    DecodedChunk``, else ``TypeError`` naming what was given."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            "chunk_transforms must be a list of callables DecodedChunk -> DecodedChunk, "
            f"got {value!r}"
        )
    for t in value:
        if not callable(t):
            raise TypeError(
                f"chunk_transforms must be callables DecodedChunk -> DecodedChunk, got {t!r}"
            )
    return tuple(value)


def check_batch_transforms(value: Any) -> tuple[Any, ...]:
    """``value`` as a tuple if it is a sequence (not a string) of callables ``Batch -> Batch``,
    else ``TypeError`` naming what was given."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            "batch_transforms must be a sequence of callables Batch -> Batch (one transform: "
            f"[transform]), got {value!r}"
        )
    for t in value:
        if not callable(t):
            raise TypeError(f"batch_transforms must be callables Batch -> Batch, got {t!r}")
    return tuple(value)
