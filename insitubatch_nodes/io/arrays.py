"""Finding arrays in a store and reading their geometry: :func:`open_geometries`."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from insitubatch_nodes.errors import ArrayNotFoundError, corrupt_metadata, short_cause
from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io import cf as cf_attrs
from insitubatch_nodes.io.axes import AxisNames, axis_of, check_sample_axis
from insitubatch_nodes.io.cf import CFValues, cf_values, decoded_dtype_option, listed_coordinates
from insitubatch_nodes.io.coords import FieldCoordinates, candidate_paths, same_store_reader
from insitubatch_nodes.io.datasets import dataset_variables
from insitubatch_nodes.io.geometry import ArrayGeometry, in_native_byte_order
from insitubatch_nodes.io.points import lat_lon_arrays, points_of
from insitubatch_nodes.io.product import product_view
from insitubatch_nodes.io.stores import StoreLike, as_store, cannot_list, describe_store

__all__ = ["absent_samples", "check_arrays_in_store", "open_geometries"]

#: one ``sample_axis`` value, resolved: an index, a dimension name, or product axes
AxisArg = int | str | tuple[int | str, ...]


def _is_coordinate(path: str, array: Any) -> bool:
    if array.ndim == 0:
        return True  # a grid mapping / scalar: nothing to draw samples along
    dims = _zarr_compat.array_dimension_names(array)
    if array.ndim == 1 and dims is not None:
        return dims[0] == path.rsplit("/", 1)[-1]
    return False


def _axis(path: str, array: Any, sample_axis: int | str) -> int | None:
    """The physical sample axis ``sample_axis`` names in ``array`` (``None``: a dimension name
    the array does not have: it is static)."""
    ndim, dims = array.ndim, _zarr_compat.array_dimension_names(array)
    if isinstance(sample_axis, str):
        if dims is None:
            raise ValueError(
                f"sample_axis={sample_axis!r} names a dimension, but array {path!r} has no "
                "dimension names; give its sample axis as an index"
            )
        if sample_axis not in dims:
            return None
    return axis_of(
        AxisNames(path, dims, ndim),
        sample_axis,
        out_of_range=lambda k: (
            f"sample_axis={k} is out of range for array {path!r} of shape "
            f"{tuple(array.shape)} ({ndim} axes); pick an axis in [0, {ndim})"
        ),
    )


def _sample_dimension(zstore: Any, arrays: Mapping[str, Any], axis: int) -> str | None:
    """The dimension most arrays name at ``axis``, among arrays of more than one axis with
    dimension names, preferring dimensions no such array names at another index (``None``
    when none has any). A WeatherBench2-like store whose static fields
    ``(latitude, longitude)`` outnumber its ``(time, latitude, longitude)`` arrays samples
    along ``time``: ``latitude`` is a field axis of those arrays, so it cannot be the sample
    dimension, whichever arrays are named and in whatever order.

    A dimension whose coordinate holds times (CF ``units`` "... since ...", or datetimes)
    wins over those that hold none, however many arrays name them: one ``(time, lat, lon)``
    array beside ``(level, lat, lon)`` statics samples along ``time``, in any order and number;
    a tie then goes to the first path's dimension."""
    counts: dict[str, int] = {}
    elsewhere: set[str] = set()
    first_path: dict[str, str] = {}
    for path, array in arrays.items():
        dims = _zarr_compat.array_dimension_names(array)
        if dims is not None and array.ndim > 1 and -len(dims) <= axis < len(dims):
            at = axis % len(dims)
            counts[dims[at]] = counts.get(dims[at], 0) + 1
            first_path.setdefault(dims[at], path)
            elsewhere.update(d for i, d in enumerate(dims) if i != at)
    alone = {d: n for d, n in counts.items() if d not in elsewhere} or counts
    if not alone:
        return None
    timed = [d for d in alone if len(alone) > 1 and _holds_times(zstore, first_path[d], d)]
    votes = {d: alone[d] for d in timed} or alone
    return max(votes, key=votes.__getitem__)  # (the first of the most, in the arrays' order)


def _holds_times(zstore: Any, path: str, dim: str) -> bool:
    """Whether the coordinate ``dim`` of the array at ``path`` (found as
    :func:`~insitubatch_nodes.io.coords.candidate_paths` looks for it) holds times."""
    for coord in _zarr_compat.open_arrays_by_name(zstore, candidate_paths(path, dim)):
        if coord is not None and coord.ndim == 1:
            return np.dtype(coord.dtype).kind == "M" or cf_attrs.is_cf_time(dict(coord.attrs))
    return False


def _geometry(
    path: str,
    array: Any,
    sample_axis: AxisArg,
    coordinates: Any,
    sample_dim: str | None,
    mask_and_scale: bool = True,
    cf_dtype: np.dtype[Any] | None = None,
) -> ArrayGeometry:
    if sample_axis == ():  # no sample axis: the whole array is one sample (never static)
        geom = _geometry(path, array, 0, coordinates, None, mask_and_scale, cf_dtype)
        return product_view(geom, ())
    if isinstance(sample_axis, tuple):  # product sample axes: static without the first one
        geom = _geometry(
            path, array, sample_axis[0], coordinates, sample_dim, mask_and_scale, cf_dtype
        )
        return geom if geom.static else product_view(geom, sample_axis)
    axis = _axis(path, array, sample_axis)
    static = axis is None
    if not static and sample_dim is not None and isinstance(sample_axis, int):
        dims = _zarr_compat.array_dimension_names(array)
        static = dims is not None and sample_dim not in dims
    cf = array_cf(array, cf_dtype) if mask_and_scale else None
    return ArrayGeometry(
        path=path,
        shape=tuple(int(s) for s in array.shape),
        chunks=_zarr_compat.stored_chunk_shape(array),
        dtype=in_native_byte_order(array.dtype) if cf is None else cf.dtype,
        fill_value=array.fill_value,
        sample_axis=0 if axis is None else axis,
        read_chunks=_zarr_compat.read_chunk_shape(array),
        zarr_format=int(array.metadata.zarr_format),
        metadata=array.metadata,
        static=static,
        coordinates=coordinates,
        cf=cf,
    )


def array_cf(array: Any, dtype: np.dtype[Any] | None = None) -> CFValues | None:
    """How the values of the zarr ``array`` decode (:func:`~insitubatch_nodes.io.cf.cf_values`
    of its attributes, dtype and fill value); ``dtype``, a float dtype, replaces the float
    dtype xarray would decode them to (the arithmetic is then done in it)."""
    try:
        cf = cf_values(
            dict(array.attrs),
            in_native_byte_order(array.dtype),
            array.fill_value,
            int(array.metadata.zarr_format),
        )
        if cf is not None and dtype is not None and cf.dtype.kind == "f":
            cf = cf.in_dtype(dtype)
    except ValueError as exc:
        raise ValueError(f"array {array.path!r}: {exc}") from None
    return cf


def open_geometries(
    store: StoreLike,
    variables: Sequence[str] | None = None,
    *,
    sample_axis: int | str | Sequence[int | str] | Mapping[str, Any] = 0,
    mask_and_scale: bool = True,
    cf_dtype: Any = None,
    coords_reader: Any = None,
) -> dict[str, ArrayGeometry]:
    """Read the geometry of the arrays in a zarr v2 or v3 store: every array zarr-python opens
    there, keyed by its path.

    ``store`` is a URL, a path, any ``zarr.abc.store.Store`` or an ``xr.open_zarr`` Dataset (its
    store; with ``variables=None``, its data variables). The arrays are those of the root group
    (nested groups included), arrays below folders without group metadata (``"a/b/t2m"``:
    tensorstore writes no groups), or a root array, under its path ``""``.

    With ``variables=None`` every data array is returned and coordinates are skipped: a 1-D
    array whose only dimension is named like the array itself (``time``, ``lat``), any 0-D
    array (a grid mapping) and any array another's CF ``coordinates`` attribute names (a
    rotated grid's 2-D ``lat``). Finding them lists the store, unless its root group has
    consolidated metadata and the store cannot list (HTTP): then the arrays the
    consolidated metadata names are returned. Naming arrays in ``variables`` (``"t2m"``,
    ``"group/z"``, ``""`` or ``"/"`` for a root array) reads each one's own metadata by name and
    never lists the store; it bypasses the coordinate test (a 0-D array still has no sample axis,
    so naming one raises ``ValueError``).

    Every geometry is built from the array's own metadata. Where the store's consolidated
    metadata (``.zmetadata``, or the root ``zarr.json``) describes an array otherwise (it was
    appended to or resized after consolidation), the array's own metadata wins and a
    ``UserWarning`` says the consolidated copy is stale. An array written after consolidation
    (xarray's ``to_zarr(mode="a", consolidated=False)``) is found by name, and by the listing.

    ``sample_axis`` is one physical axis or dimension name (``"time"``, ``"z"``) for every
    array, or a ``{path: axis or name}`` mapping (arrays it does not name use axis 0).

    **Product sample axes.** A tuple of axes (``sample_axis=("t", "z")``, names or indices)
    makes every combination of indices along them one sample, the remaining axes its payload
    (:mod:`~insitubatch_nodes.io.product`); an array without the first named dimension is
    static, as below. The empty tuple, ``sample_axis=()``, makes each whole array *one*
    sample (a spectral cube ``(freq, dec, ra)`` without a Stokes axis to sample along), never
    static: patch it (``geom.patches({"dec": 64, "ra": 64})``) and its windows are the
    samples.

    **Static arrays.** An array without the sample dimension (WeatherBench2's
    ``land_sea_mask (latitude, longitude)`` beside ``(time, latitude, longitude)`` data) is
    *static* (``geom.static``): it has no sample axis and every batch carries it whole (see
    ``insitu_pipeline``). The sample dimension is the one ``sample_axis`` names, or, for an
    index, the dimension most of the multi-axis arrays name at that index, of those no array
    names at another index, one whose coordinate holds times first (static fields never
    outvote the arrays they sit beside); an array is static when it has dimension names and
    that dimension is not among them (arrays without dimension names are never static); beside
    patched labels it is cut to each row's window. Geometries look up field coordinates for
    ``sel``. An array whose last dimension is a grid of points (1-D ``latitude`` and
    ``longitude`` along it) names them in ``geom.points`` (:mod:`~insitubatch_nodes.io.points`).

    **CF decoding.** With ``mask_and_scale=True`` (the default, as ``xr.open_zarr``) a data
    array's values are delivered as xarray decodes them: ``_FillValue`` / ``missing_value``
    masked to NaN, ``scale_factor`` / ``add_offset`` unpacked, in xarray's dtype (``geom.dtype``:
    ``float64`` for ``int16`` packed with JSON attributes; :mod:`~insitubatch_nodes.io.cf` states
    the rules, and where v2 integer arrays differ). ``mask_and_scale=False`` delivers the stored
    values (the raw integers, the fill values) for every array it opens. ``cf_dtype`` (a float
    dtype such as ``"float32"``) delivers the arrays that decode to floats in that dtype
    instead of xarray's, the unpacking done in it: ``raw.astype(cf_dtype) * scale_factor +
    add_offset``, as xarray computes for ``float32`` attributes (within one unit in the last
    place of xarray's ``float64`` values cast to it); arrays delivered as stored keep their
    dtype.

    ``coords_reader`` (a :func:`~insitubatch_nodes.io.coords.coordinate_reader` of the opened
    store passed here; another store's is a ``ValueError``) takes the arrays it read already
    and keeps those read here, with the coordinates ``sel`` looks up: pass the same one to
    the pipelines built on these geometries and their store check reads nothing again.

    Raises :class:`~insitubatch_nodes.errors.ArrayNotFoundError`
    (a ``KeyError`` and a ``FileNotFoundError``) for a name that is no array (saying what was
    looked for, in which store, and which arrays exist) and naming the store when it holds no
    array at all (wrong path or prefix, missing bucket), ``ValueError`` for a sample axis out
    of range and :class:`CorruptMetadataError` naming the document(s) when a
    metadata document cannot be read.
    """
    if isinstance(variables, Mapping):
        raise TypeError(
            f"variables names arrays (a list such as ['t2m', 'z'] or None), got a mapping "
            f"{dict(variables)!r}: to give arrays their sample axes pass it by keyword, "
            f"open_geometries(store, sample_axis={dict(variables)!r})"
        )
    if isinstance(variables, str):
        variables = [variables]
    cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
    zstore = as_store(store)
    kept = same_store_reader(coords_reader, zstore).arrays if coords_reader is not None else {}
    if variables is None:  # a Dataset's own data variables (None for any other store)
        variables = dataset_variables(store)
    axes: dict[str, AxisArg]
    default_axis: AxisArg
    if isinstance(sample_axis, Mapping):
        axes, default_axis = {str(p).strip("/"): _axis_arg(a) for p, a in sample_axis.items()}, 0
    else:
        axes, default_axis = {}, _axis_arg(sample_axis)
    missing: list[str] = []
    try:
        root = _open_root(zstore)
        if variables is None:
            found = _find_arrays(zstore, root)
            aux = listed_coordinates(found)  # (a 2-D lat of a rotated grid: xarray's coordinate)
            arrays = {p: a for p, a in found.items() if not _is_coordinate(p, a) and p not in aux}
        else:
            found = {}
            arrays, missing = _named_arrays(zstore, [v.strip("/") for v in variables], kept)
        arrays = _fresh(zstore, root[1], arrays, read_by_name=variables is not None)
        kept.update(arrays)  # (the reader's: a later store check or sel reads nothing again)
    except ArrayNotFoundError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        error = corrupt_metadata(zstore, exc)
        if error is None:
            raise
        raise error from exc
    if missing:
        _raise_not_found(zstore, missing)
    first_axis: int | str | None = None  # (): no sample axis, no array static
    if not isinstance(default_axis, tuple):
        first_axis = default_axis
    elif default_axis:  # product axes: the first names the sample dimension
        first_axis = default_axis[0]
    check_sample_axis(zstore, describe_store(zstore), axes, {**found, **arrays}, first_axis)
    coordinates = FieldCoordinates(zstore, coords_reader)
    sample_dim = (
        _sample_dimension(zstore, arrays, first_axis) if isinstance(first_axis, int) else first_axis
    )
    listed = lat_lon_arrays(found) if variables is None else None  # (else: CF ``coordinates``)
    geoms = {}
    for path, array in arrays.items():
        axis, points = axes.get(path, default_axis), points_of(zstore, path, array, listed)
        geom = _geometry(path, array, axis, coordinates, sample_dim, mask_and_scale, cf_dtype)
        geoms[path] = replace(geom, points=points)
    return geoms


def _axis_arg(value: Any) -> AxisArg:
    """A ``sample_axis`` value: an index or a dimension name, or a tuple of them (product
    sample axes; ``()``: none, each whole array one sample)."""
    if isinstance(value, str):
        return value
    if isinstance(value, tuple | list):
        if len(value) == 1:
            raise ValueError(
                f"product sample axes are two or more axes, got {value!r}: give one axis as "
                "sample_axis=axis (or sample_axis=() to make each whole array one sample)"
            )
        return tuple(_one_axis(v) for v in value)
    return _one_axis(value)


def _one_axis(value: Any) -> int | str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"sample_axis is an axis index or a dimension name, got {value!r}")
    return int(value)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _open_root(zstore: Any) -> tuple[Any, Any]:
    """``(root array, root group)`` of ``zstore``: at most one of them, or neither."""
    found = _zarr_compat.open_node(zstore, "")  # (each document one GET)
    if found is None:
        return None, None
    return (found[1], None) if found[0] == "array" else (None, found[1])


def _find_arrays(zstore: Any, root: tuple[Any, Any]) -> dict[str, Any]:
    """Every array in ``zstore`` (path -> zarr array), for ``open_geometries(store)``.

    A root array is the only array. Else zarr finds the members of the root group (from its
    consolidated metadata, or listing each group once), and the root and every group are listed
    once more for what zarr does not report: a folder without group metadata, listed in turn
    down to the arrays in it (arrays are not looked into). When the store cannot list, a root
    group's consolidated metadata gives the arrays.
    """
    root_array, group = root
    if root_array is not None:
        return {"": root_array}
    consolidated = group is not None and _zarr_compat.consolidated_arrays(group) is not None
    known: dict[str, Any] = {}
    groups = [""]
    try:
        if group is not None:
            try:
                arrays, subgroups = _zarr_compat.walk_nodes(group)
            except Exception as exc:  # zarr lists each group (without consolidated metadata)
                try:  # its walk fails on an S3 folder marker: list by name from the root
                    arrays, subgroups = list(_listed_arrays(zstore, set(), [""]).items()), []
                except _ListingError:
                    if isinstance(exc, ValueError | TypeError | KeyError):
                        raise exc from None  # unreadable metadata: diagnosed by the caller
                    raise _ListingError(short_cause(exc)) from exc
            known.update(arrays)
            groups += subgroups
        if consolidated and cannot_list(zstore):  # HTTP: the consolidated metadata is all
            raise _ListingError("an HTTP server cannot list a folder")
        known.update(_listed_arrays(zstore, set(known), groups))
    except _ListingError as exc:
        if not consolidated:
            raise FileNotFoundError(
                f"cannot find the arrays of store {describe_store(zstore)}: it has "
                + ("no consolidated metadata" if group is not None else "no group at its root")
                + f", and listing it failed ({exc}). Check the path, or the URL's bucket "
                "and prefix (and the endpoint and credentials); a store that cannot list (HTTP) "
                "needs the arrays named: open_geometries(store, ['t2m', 'group/z'])"
            ) from exc
    if not known:
        what = "an empty group" if group is not None else "no zarr array or group"
        raise _NoArrays(
            f"no zarr array in store {describe_store(zstore)}: it holds {what} (no zarr.json, "
            ".zarray or .zgroup at its root or below). Check the path, or the URL's bucket and "
            "prefix (and the endpoint and credentials)"
        )
    return dict(sorted(known.items()))


class _NoArrays(ArrayNotFoundError):
    """The store holds no zarr array at all (as opposed to: its arrays could not be listed)."""


class _ListingError(Exception):
    """A store could not be listed; the message says why, in one line."""


def _listed_arrays(zstore: Any, known: set[str], groups: Sequence[str]) -> dict[str, Any]:
    """The arrays below ``groups`` (their paths; ``""`` the root) that are not in ``known``.

    Each group is listed once. The names in it that are neither a known array nor a known group
    are probed by name, concurrently: an array is opened (never listed: a v2 array's folder
    holds every chunk key), anything else — a group, a folder without group metadata, a plain
    key (which lists empty) — is listed in turn.
    """
    found: dict[str, Any] = {}
    skip = set(known) | set(groups)
    todo = list(groups)
    while todo:
        prefix = todo.pop()
        try:
            names = _zarr_compat.list_dir(zstore, prefix)
        except Exception as exc:  # the store cannot list (HTTP), or the listing failed
            raise _ListingError(short_cause(exc)) from exc
        paths = [
            _join(prefix, n)
            for n in names
            if n not in _zarr_compat.METADATA_DOCUMENTS and _join(prefix, n) not in skip
        ]
        kinds = _zarr_compat.node_kinds(zstore, paths) if paths else []
        by_format: dict[int, list[str]] = {}
        for path, kind in zip(paths, kinds, strict=True):
            if kind is not None and kind[0] == "array":
                by_format.setdefault(kind[1], []).append(path)
            else:
                todo.append(path)
        for fmt, array_paths in by_format.items():
            opened = _zarr_compat.open_arrays_by_name(zstore, array_paths, fmt)
            found.update((p, a) for p, a in zip(array_paths, opened, strict=True) if a is not None)
    return found


def _named_arrays(
    zstore: Any, paths: Sequence[str], kept: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The arrays at ``paths``, opened by name (concurrently, no listing) or taken from
    ``kept`` (path -> an array read already, ``None``: none there), and the paths that hold
    none."""
    paths = list(dict.fromkeys(paths))
    read = [p for p in paths if p not in kept]
    got = dict(
        zip(read, _zarr_compat.open_arrays_by_name(zstore, read) if read else [], strict=True)
    )
    opened = [kept[p] if p in kept else got[p] for p in paths]
    arrays = {p: a for p, a in zip(paths, opened, strict=True) if a is not None}
    return arrays, [p for p, a in zip(paths, opened, strict=True) if a is None]


def _raise_not_found(zstore: Any, missing: Sequence[str]) -> None:
    """Raise for names that are no array: what was looked for, where, and what exists.

    :class:`ArrayNotFoundError` (a ``KeyError`` and a ``FileNotFoundError``) either way.
    """
    name = describe_store(zstore)
    looked = "; ".join(
        f"{p!r}: "
        + (
            "a group, not an array"
            if _is_group_at(zstore, p)
            else "no " + " or ".join(repr(k) for k in _metadata_keys(p))
        )
        for p in missing
    )
    try:
        listed = _find_arrays(zstore, _open_root(zstore))
    except _NoArrays as exc:
        raise ArrayNotFoundError(
            f"no array named {list(missing)} in store {name} ({looked}), and {exc}"
        ) from None
    except Exception as exc:  # the listing is best effort here
        raise ArrayNotFoundError(
            f"no array named {list(missing)} in store {name} ({looked}); which arrays it holds "
            f"could not be found ({_unlisted(exc)})"
        ) from None
    raise ArrayNotFoundError(
        f"no array named {list(missing)} in store {name} ({looked}); available arrays: "
        f"{sorted(set(listed) - set(missing))} (a root array is named '')" + _stale(listed, missing)
    )


def _stale(listed: Mapping[str, Any], missing: Sequence[str]) -> str:
    """A clause naming the missing arrays that the consolidated metadata still lists."""
    stale = sorted(set(listed) & set(missing))
    if not stale:
        return ""
    return (
        f"; the store's consolidated metadata still names {stale}, deleted since it was "
        "written (re-run zarr.consolidate_metadata(store) to bring it up to date)"
    )


def _what_exists(zstore: Any, missing: str) -> str:
    """Which arrays ``zstore`` holds, ``missing`` aside, as a phrase for an error message (best
    effort)."""
    try:
        listed = _find_arrays(zstore, _open_root(zstore))
    except _NoArrays:
        return "the store holds no zarr array at all"
    except Exception as exc:
        return f"which arrays it holds could not be found ({_unlisted(exc)})"
    return f"arrays there: {sorted(set(listed) - {missing})}" + _stale(listed, [missing])


def _unlisted(exc: Exception) -> str:
    """Why a store's arrays could not be found, in brief (a failed listing: its reason)."""
    why = exc.__cause__
    return f"listing it failed: {why}" if isinstance(why, _ListingError) else short_cause(exc)


def _is_group_at(zstore: Any, path: str) -> bool:
    try:
        kind = _zarr_compat.node_kind(zstore, path)
    except ValueError:
        return False
    return kind is not None and kind[0] == "group"


def _metadata_keys(path: str) -> tuple[str, ...]:
    return (
        *_zarr_compat.array_metadata_keys(path, 3),
        _zarr_compat.array_metadata_keys(path, 2)[0],
    )


def _fresh(
    zstore: Any, group: Any, arrays: Mapping[str, Any], *, read_by_name: bool
) -> dict[str, Any]:
    """``arrays`` with each one described by its own metadata, where the root group's
    consolidated metadata has a stale copy of it (a ``UserWarning`` says which, and how).

    With ``read_by_name=False`` the arrays the consolidated metadata lists were taken from it
    (:func:`_find_arrays`): each is read again by name. Arrays read by name are only compared.
    """
    consolidated = None if group is None else _zarr_compat.consolidated_arrays(group)
    if not consolidated:
        return dict(arrays)
    fmt = int(group.metadata.zarr_format)
    reread = [] if read_by_name else [p for p in arrays if p in consolidated]
    owns = dict(zip(reread, _zarr_compat.open_arrays_by_name(zstore, reread, fmt), strict=True))
    out: dict[str, Any] = {}
    for path, array in arrays.items():
        copy = consolidated.get(path)
        if copy is None:
            out[path] = array
            continue
        own = owns.get(path, array)  # the consolidated copy itself: the array's own, re-read
        if own is None:
            keys = _zarr_compat.array_metadata_keys(path, fmt)
            warnings.warn(
                f"the consolidated metadata of store {describe_store(zstore)} lists array "
                f"{path!r}, which has no metadata of its own ({keys[0]!r} is missing): it is "
                "skipped. Re-consolidate with zarr.consolidate_metadata(store)",
                UserWarning,
                stacklevel=4,
            )
            continue
        diffs = _layout_differences(
            _geometry(path, own, 0, None, None), _geometry(path, copy, 0, None, None)
        )
        if diffs:
            warnings.warn(
                f"the consolidated metadata of store {describe_store(zstore)} is stale for "
                f"array {path!r}: "
                + "; ".join(f"{d} in the consolidated copy" for d in diffs)
                + ". The array's own metadata is used. Re-consolidate with "
                "zarr.consolidate_metadata(store) so that other readers see it too",
                UserWarning,
                stacklevel=4,
            )
        out[path] = own
    return out


def _layout_differences(own: ArrayGeometry, other: ArrayGeometry) -> list[str]:
    """What differs between two geometries of one array, as ``"FIELD A, B"`` phrases."""
    diffs = [
        f"{name} {getattr(own, name)} in the array's own metadata, {getattr(other, name)}"
        for name in ("shape", "chunks", "read_chunks", "dtype")
        if getattr(own, name) != getattr(other, name)
    ]
    if not diffs and own.store_key(0) != other.store_key(0):
        diffs.append(f"chunk keys like {own.store_key(0)!r} in its own, {other.store_key(0)!r}")
    return diffs


def check_batchable(geoms: Mapping[str, ArrayGeometry]) -> None:
    """Raise ``ValueError`` for an array a batch cannot hold, naming the array and the fix.

    A batch is one fixed-size numpy array per label, ``(batch, *inner_shape)``: an array of
    variable-length values (zarr's ``str`` or ``bytes`` dtypes: numpy's ``StringDType`` or
    ``object``) has no fixed size per sample, and an array with a zero-length field axis has
    no values in a sample (and no stored object to read). Fixed-width strings (``'<U8'``,
    ``'S8'``) and structured records are fixed-size and read like any other array.
    """
    for path, geom in geoms.items():
        dtype = geom.dtype
        if dtype.kind in "OT" or dtype.hasobject:
            raise ValueError(
                f"array {path!r} holds variable-length values (dtype {dtype}), and a batch "
                "holds a fixed number of bytes per sample: store fixed-width strings instead "
                "(a dtype such as '<U8' or 'S8', as wide as the longest value) or integer "
                "codes, or leave the array out of the views"
            )
        if 0 in geom.field_shape:
            raise ValueError(
                f"array {path!r} has shape {geom.shape}: a field axis of length 0, so its "
                "samples hold no values; drop it from the views"
            )


def check_arrays_in_store(
    store: StoreLike, geoms: Mapping[str, ArrayGeometry], reader: Any = None
) -> None:
    """Check that ``store`` holds every array ``geoms`` describes, with that layout.

    One metadata read per array (two for zarr v2); none for an array ``reader`` (a
    :func:`~insitubatch_nodes.io.coords.coordinate_reader` of ``store``) read already, which
    keeps those read here. Raises
    :class:`~insitubatch_nodes.errors.ArrayNotFoundError` (a ``FileNotFoundError``) naming the
    array and the store when there is no such array there (a wrong path or prefix, a missing
    bucket, geometries read from another store), ``ValueError`` when the array there has
    another shape, chunking, dtype or chunk key encoding, and :class:`CorruptMetadataError`
    when its metadata cannot be read. Without this check a pipeline over a store that holds
    nothing would read every chunk as missing, i.e. as the fill value.
    """
    zstore = as_store(store)
    name = describe_store(zstore)
    for path, geom in geoms.items():
        geom = geom.base
        try:
            if reader is None:
                array = _zarr_compat.open_array_readonly(zstore, path, geom.zarr_format)
            elif (array := reader.array(path, geom.zarr_format)) is None:
                raise FileNotFoundError(path)
        except FileNotFoundError as exc:
            keys = _zarr_compat.array_metadata_keys(path, geom.zarr_format)
            raise ArrayNotFoundError(
                f"array {path!r} is not in store {name}: no zarr v{geom.zarr_format} array "
                f"metadata at {keys[0]!r}; {_what_exists(zstore, path)}. Check the path, or "
                "the URL's bucket and prefix (and the endpoint), and that the geometries were "
                "read from this store"
            ) from exc
        except (ValueError, TypeError, KeyError) as exc:
            keys = _zarr_compat.array_metadata_keys(path, geom.zarr_format)
            error = corrupt_metadata(zstore, exc, keys)
            if error is None:
                raise
            raise error from exc
        cf = geom.cf
        found = _geometry(path, array, geom.sample_axis, None, None, cf is not None,
                          None if cf is None else cf.dtype)  # fmt: skip
        diffs = [
            f"{field} {getattr(found, field)} in the store, {getattr(geom, field)} in the geometry"
            for field in ("shape", "chunks", "read_chunks", "dtype")
            if getattr(found, field) != getattr(geom, field)
        ]
        if not diffs and geom.metadata is not None and found.store_key(0) != geom.store_key(0):
            diffs.append(
                f"chunk keys like {found.store_key(0)!r} in the store, "
                f"{geom.store_key(0)!r} in the geometry"
            )
        if diffs:
            raise ValueError(
                f"array {path!r} in store {name} does not match the geometry passed for it: "
                + "; ".join(diffs)
                + ". Were the geometries read from another store? Read them from this one "
                "with open_geometries(store)"
            )


def absent_samples(store: StoreLike, geoms: Mapping[str, ArrayGeometry]) -> np.ndarray:
    """The samples (``bool``, one per sample of the arrays' common sample axis) one of whose
    stored objects — in any of ``geoms`` (path -> geometry), any tile — is absent from
    ``store``: one listing of each array's prefix (zarr's ``list_prefix``), compared with the
    keys the geometry names. An absent object reads as the fill value; a plan can drop the
    anchors that would read one (``missing_objects="drop"``). An inner chunk missing from a
    shard that exists is not seen here (the shard is present). A store that cannot list raises
    ``OSError`` naming it."""
    zstore = as_store(store)
    sizes = {g.n_samples for g in geoms.values()}
    if len(sizes) != 1:
        raise ValueError(f"arrays {sorted(geoms)} do not share one sample-axis length")
    out = np.zeros(sizes.pop(), dtype=bool)
    for path, geom in geoms.items():
        try:  # (a collection's members: their folders)
            heads = [path] if geom.members is None else geom.members.listing_prefixes
            listed = set().union(
                *(_zarr_compat.list_keys(zstore, f"{p}/" if p else "") for p in heads)
            )
        except Exception as exc:  # (the cause in brief: the whole of it stays chained)
            raise OSError(
                f"cannot list {path!r} in {describe_store(zstore)} to find absent objects "
                f"({short_cause(exc)}); pass missing_objects='read' to read absent "
                "objects as the fill value"
            ) from exc
        spc, tiles = geom.samples_per_chunk, list(geom.tiles())
        for chunk in range(geom.n_chunks):
            if any(geom.store_key(chunk, tile) not in listed for tile in tiles):
                out[chunk * spc : (chunk + 1) * spc] = True
    return out
