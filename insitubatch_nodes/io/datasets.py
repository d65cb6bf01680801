"""An xarray ``Dataset`` passed where a store is expected: the store it was opened from.

``xr.open_zarr(path_or_store)`` (or ``xr.open_dataset(..., engine="zarr")``) stands for its
store (:func:`dataset_store`), read as stored: a Dataset selected, transposed or otherwise
changed after opening is refused (:func:`refuse_changed`), since the pipeline would read the
stored arrays, not what the Dataset shows. xarray is never imported here; its objects are
recognised by their types' names and read defensively.
"""

from __future__ import annotations

import os
from typing import Any

from zarr.abc.store import Store

from insitubatch_nodes.io import _zarr_compat

__all__ = ["dataset_store", "dataset_variables", "is_xarray_dataset", "refuse_changed"]


def is_xarray_dataset(obj: Any) -> bool:
    return type(obj).__name__ == "Dataset" and type(obj).__module__.startswith("xarray")


def dataset_variables(obj: Any) -> list[str] | None:
    """The data variables of an xarray ``Dataset`` (those it kept: ``ds[["t2m"]]`` keeps one),
    ``None`` for anything else. A 0-D one is left out: xarray keeps a grid mapping (``crs``)
    among the data variables, and the store the Dataset stands for has no samples there
    (``open_geometries(store)`` skips it as a coordinate)."""
    if not is_xarray_dataset(obj):
        return None
    return [str(name) for name, array in obj.data_vars.items() if getattr(array, "ndim", 1)]


def refuse_changed(ds: Any, store: Any, where: str) -> None:
    """``ValueError`` when a data variable of ``ds`` is not its stored array as stored (in
    ``store``, described as ``where``): the Dataset was selected (``isel``/``sel``),
    transposed, reordered (``roll``, ``sortby``) or computed on (``ds * 2``, ``assign``,
    ``load``) after it was opened, or a stored coordinate was assigned anew
    (``assign_coords``: it has no encoding). Rechunking (``ds.chunk(...)``) changes nothing
    read."""
    names = dataset_variables(ds) or []
    for name, array in zip(names, _zarr_compat.open_arrays_by_name(store, names), strict=True):
        shown = tuple(ds[name].shape)
        if array is not None and tuple(array.shape) != shown:
            raise ValueError(
                f"this xarray Dataset is a selection of its store: {name!r} is "
                f"{dict(ds[name].sizes)} here but {tuple(array.shape)} in "
                f"{where}, and the pipeline reads the stored arrays, not the "
                "selection. Pass the Dataset as opened (or its store), and select there: "
                "ArrayGeometry.isel/sel for field axes (levels, an area), "
                "split_by_chunk(..., sample_range=(start, stop), coord=time) or missing= "
                "for the sample axis"
            )
    # a coordinate assigned after opening (assign_coords, arithmetic on it) has no encoding:
    # xarray keeps a stored variable's; the stored one is what sel and coords= would read
    assigned = [str(c) for c in getattr(ds, "coords", {}) if not ds.coords[c].encoding]
    stored = _zarr_compat.open_arrays_by_name(store, assigned)
    for name, array in zip(assigned, stored, strict=True):
        if array is not None:
            raise ValueError(
                f"this xarray Dataset's coordinate {name!r} was assigned after it was opened "
                "(assign_coords, or a computation on it; drop_encoding too), and the pipeline "
                f"reads the stored {name!r} of {where} (for sel by value and the batches' "
                "coordinates), not the Dataset's. Pass the Dataset as opened or its store, and "
                "select in stored values (a longitude box in 0..360 where the store keeps "
                "0..360); or write the changed Dataset to a store with to_zarr"
            )
    for name in names:
        change = _changed_after_opening(ds[name].variable)
        if change is not None:
            raise ValueError(
                f"this xarray Dataset was changed after it was opened: {name!r} holds {change}, "
                f"and the pipeline reads the stored arrays of {where}, not the "
                "Dataset's values. Pass the Dataset as opened (rechunked or not) or its store; "
                "select with ArrayGeometry.isel/sel, change values with chunk_transforms= or "
                "batch_transforms= (or write the changed Dataset to a store with to_zarr)"
            )


def _changed_after_opening(variable: Any) -> str | None:
    """What an operation after opening left in an xarray variable (dask layers other than
    opening and rechunking, values computed into memory, a lazy selection other than the whole
    array), or ``None`` where it is its stored array as opened (xarray internals, read
    defensively: a wrapper not recognised counts as unchanged)."""
    data = variable._data
    if hasattr(data, "dask"):  # opening is "original-..." and "open_dataset-..." layers
        done = {str(k).split("-")[0] for k in data.dask.layers}
        done -= {"original", "open_dataset", "rechunk"}
        return f"the dask operations {sorted(done)}" if done else None
    if type(data).__name__ == "ndarray":
        return "values in memory, computed or loaded (ds.load(), arithmetic, roll)"
    while data is not None and type(data).__name__ != "LazilyIndexedArray":
        data = getattr(data, "array", None)
    key = getattr(getattr(data, "key", None), "tuple", ())
    return (
        f"the selection {key}"
        if any(not (isinstance(k, slice) and k == slice(None)) for k in key)
        else None
    )


def dataset_store(ds: Any) -> Any:
    """The store an xarray ``Dataset`` was opened from (see :func:`as_store`): the path or URL
    xarray recorded, or the zarr store it read through where that URL alone would open another
    store (:func:`_opened_with_options`)."""
    source = getattr(ds, "encoding", {}).get("source")
    # xarray's zarr backend keeps its ZarrStore as the dataset's closer; its group is the
    # zarr group opened (xarray internals, read defensively: a missing name means "unknown")
    backend = getattr(getattr(ds, "_close", None), "__self__", None)
    group = getattr(backend, "zarr_group", None)
    path = str(getattr(group, "path", "") or "")
    if path:
        raise TypeError(
            f"this xarray Dataset was opened from group {path!r} of a zarr store: pass the "
            f"store itself (its path or URL, or the zarr Store) and name the arrays with their "
            f"group, e.g. open_geometries(store, ['{path}/t2m'])"
        )
    store = getattr(group, "store", None)
    if isinstance(source, str | os.PathLike) and str(source):
        return store if isinstance(store, Store) and _opened_with_options(source, store) else source
    if isinstance(store, Store):
        return store
    raise TypeError(
        "an xarray Dataset is not a zarr store, and this one does not say which store it was "
        "read from (it was not opened with xr.open_zarr / engine='zarr'): pass the store "
        "itself, its path or URL (e.g. open_geometries('/data/era5.zarr')) or a zarr Store "
        "(zarr.storage.LocalStore(path, read_only=True), open_store(url))"
    )


def _opened_with_options(source: Any, store: Store) -> bool:
    """Whether xarray read the remote URL ``source`` through ``store`` (zarr's ``FsspecStore``)
    opened with fsspec ``storage_options`` (an endpoint, credentials, ``anon``) that the URL
    alone does not carry: opened again without them, it would be another store, or none."""
    if "://" not in str(source) or str(source).lower().startswith("file://"):
        return False
    return bool(getattr(getattr(store, "fs", None), "storage_options", None))
