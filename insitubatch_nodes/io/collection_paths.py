"""A collection's arrays are named by virtual paths, ``"collection-<digest>:<variable>"``
(:attr:`~insitubatch_nodes.io.collection.Collection.name`, the digest naming the store and the
members): what names one variable of collections of other members (a split's ``subset``, a
copy in another store), so that statistics fitted on one standardise the others, as a plain
array's statistics take another store's array of the same path."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["renamed_variables", "same_variable"]


def same_variable(a: str, b: str) -> bool:
    """Whether array paths ``a`` and ``b`` are both a collection's and name one variable."""
    (name_a, sep_a, var_a), (name_b, sep_b, var_b) = a.rpartition(":"), b.rpartition(":")
    return (
        bool(sep_a and sep_b)
        and name_a.startswith("collection-")
        and name_b.startswith("collection-")
        and var_a == var_b
    )


def renamed_variables(paths: Iterable[str], keys: Iterable[str]) -> dict[str, str]:
    """``{path: key}`` for each of ``paths`` with exactly one of ``keys`` naming its variable
    (:func:`same_variable`); a path with none, or several (ambiguous), is left out."""
    keys = list(keys)
    out = {}
    for path in paths:
        found = [k for k in keys if same_variable(path, k)]
        if len(found) == 1:
            out[path] = found[0]
    return out
