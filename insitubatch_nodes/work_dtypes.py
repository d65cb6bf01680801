"""The dtypes chunk and batch arithmetic is computed in, and standardising in place.

Integers are computed as the float they promote to with float32 (:func:`float_dtype`); float16
in float32, rounded once into the result (:func:`work_dtype`: a sum, ``x - mean`` or ``1 /
std`` overflows float16's 65504 where the result does not); other floats in their own dtype.
:func:`standardise_in_place` standardises rows so (the stages' and statistics' normalisers, a
stack's members); :func:`float16_revision` is the ``cache_revision`` the shipped chunk
transforms (:mod:`~insitubatch_nodes.transforms`) give float16 arrays, whose results changed
when that began. Pure numpy: no state, no threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from insitubatch_nodes.io.geometry import ArrayGeometry

__all__ = ["float16_revision", "float_dtype", "standardise_in_place", "work_dtype"]


def float_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` when it is floating point, else the float it promotes to with float32."""
    return dtype if dtype.kind in "fc" else np.result_type(dtype, np.float32)


def work_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype to compute ``dtype`` results in: float32 for float16 (as numpy's own mean does:
    a sum, a difference or ``1 / std`` overflows float16's 65504 where the result does not),
    else ``dtype``."""
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def standardise_in_place(rows: np.ndarray, mean: np.ndarray, std: np.ndarray) -> None:
    """``rows = (rows - mean) / std`` in place, ``mean`` and ``std`` (broadcasting) given in
    the dtype to compute in (:func:`work_dtype` of the rows'): the rows' own, worked on in
    place; float32 for float16 rows, computed aside and rounded into the rows once."""
    if rows.dtype == mean.dtype:
        np.subtract(rows, mean, out=rows)
        np.divide(rows, std, out=rows)
    else:
        work = np.subtract(rows, mean, dtype=mean.dtype)
        np.divide(work, std, out=work)
        rows[...] = work


def float16_revision(geometry: ArrayGeometry) -> str | None:
    """The ``cache_revision`` of Coarsen and StandardScaler: float16 chunks have been computed
    in float32 since 6427f56 (before, in float16: inf where the result is finite), so chunks
    a persistent cache holds from before are not theirs; other dtypes' results are unchanged
    and keep their identity (``None``)."""
    return "float16-in-float32" if geometry.dtype == np.float16 else None
