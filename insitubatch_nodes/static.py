"""Static fields: arrays without a sample axis, read once per pipeline and carried by every batch.

A static array (WeatherBench2's ``land_sea_mask (latitude, longitude)`` beside ``(time,
latitude, longitude)`` data) has no sample dimension: ``open_geometries`` recognises it
(``geom.static``) and the pipeline does not plan, fetch or pool it. It is read whole once, when
the pipeline is built (its selection, if any, taken then), and :class:`StaticFields` — the
first batch transform of the pipeline — puts it into every batch.

**The contract:** ``batch.arrays[label]`` of a static label is ``(len(batch), *inner_shape)``,
like every other label, but its rows are one array broadcast along the batch axis (stride 0):
no copy per row or per batch, and every row is the same memory. Treat it as read-only (a write
into one row writes every row, and every later batch). ``to_torch`` shares that memory too (a
tensor with stride 0 along the batch); ``.to(device)`` makes a dense copy on the device.
``batch.sample_indices`` and ``batch.coords`` have no entry for a static label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from insitubatch_nodes.batch import Batch
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import StoreLike, as_store, describe_store

__all__ = ["StaticFields", "read_static", "select_static"]


def select_static(view: ArrayGeometry, data: np.ndarray) -> np.ndarray:
    """``data`` (the whole static array) as ``view`` selects it (a C-contiguous copy)."""
    if view.select is not None:
        for axis in reversed(range(len(view.select.keys))):
            key = view.select.keys[axis]
            if key is not None:
                data = np.take(data, key if isinstance(key, int) else list(key), axis=axis)
    return np.ascontiguousarray(data)


def read_static(
    store: StoreLike, views: Mapping[str, ArrayGeometry], timeout_s: float
) -> dict[str, np.ndarray]:
    """``{label: array}`` for the static ``views``: each array read whole once (however many
    views share it) within ``timeout_s``, then selected per view."""
    zstore = as_store(store)
    whole: dict[str, np.ndarray] = {}
    out = {}
    for label, view in views.items():
        if not view.static:
            raise ValueError(f"views[{label!r}] ({view.path!r}) is not a static array")
        if view.path not in whole:
            array = _zarr_compat.open_array_readonly(zstore, view.path, view.zarr_format)
            try:
                whole[view.path] = _zarr_compat.read_whole_array(array, timeout_s)
            except Exception as exc:
                error = TimeoutError if isinstance(exc, TimeoutError) else OSError
                raise error(
                    f"cannot read static array {view.path!r} from store "
                    f"{describe_store(zstore)}: {exc}"
                ) from exc
        out[label] = select_static(view, whole[view.path]).astype(view.dtype, copy=False)
    return out


class StaticFields:
    """A batch transform that puts the static ``arrays`` (``{label: array}``) into every batch,
    broadcast to ``(len(batch), *array.shape)`` without a copy (see the module docstring)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = {label: np.asarray(a) for label, a in arrays.items()}

    def __call__(self, batch: Batch) -> Batch:
        n = len(batch)
        for label, data in self.arrays.items():
            if label in batch.arrays:
                raise ValueError(f"label {label!r} is both a static field and a sampled view")
            batch.arrays[label] = _broadcast(data, n)
        return batch

    def __repr__(self) -> str:
        return f"StaticFields({sorted(self.arrays)})"


def _broadcast(data: np.ndarray, n: int) -> Any:
    """``data`` seen ``n`` times along a new first axis (stride 0). Marked writeable so that
    ``torch.from_numpy`` takes it without a warning; the module docstring says not to write."""
    return np.lib.stride_tricks.as_strided(
        data, shape=(n, *data.shape), strides=(0, *data.strides), writeable=True
    )
