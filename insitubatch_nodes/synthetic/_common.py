"""What the synthetic generators share: argument checks, compressors by name, creating a new
group and its arrays (dimension names as xarray reads them), block sizes and noise streams."""

from __future__ import annotations

import importlib
import operator
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import numcodecs
import numpy as np
import zarr
import zarr.codecs
from zarr.abc.store import Store
from zarr.storage import LocalStore

COMPRESSORS: tuple[str, ...] = ("zstd", "blosc", "lz4", "gzip", "none")
"""Compressor names accepted by the generators."""

# Target size of one in-memory block of generated data (several chunks are compressed in
# parallel by zarr's codec pipeline when a block covers several of them).
_BLOCK_BYTES = 64 * 1024 * 1024
# Distinct noise streams so that no two arrays share noise.
_STREAM_T2M = 1
_STREAM_Z = 2
_STREAM_IMAGE = 3
_STREAM_WEATHERBENCH = 4
_STREAM_PLATE = 5

StoreArg = str | os.PathLike[str] | Store


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if ivalue <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return ivalue


def _positive_tuple(name: str, value: Any, length: int) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(
            f"{name} must be a tuple of {length} positive integers, got {value!r}"
        ) from None
    if len(items) != length:
        raise ValueError(f"{name} must be a tuple of {length} positive integers, got {value!r}")
    return tuple(_positive_int(f"{name}[{i}]", v) for i, v in enumerate(items))


def _check_format(zarr_format: Any) -> Literal[2, 3]:
    if isinstance(zarr_format, bool) or zarr_format not in (2, 3):
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format!r}")
    return 2 if zarr_format == 2 else 3


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    try:
        iseed = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}") from None
    if iseed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return iseed


def _compressors(name: str, zarr_format: int) -> Any:
    """The ``compressors=`` argument for ``create_array`` (``None`` = uncompressed)."""
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; expected one of {', '.join(COMPRESSORS)}")
    if name == "none":
        return None
    if zarr_format == 2:
        v2: dict[str, Any] = {
            "zstd": numcodecs.Zstd(level=3),
            "blosc": numcodecs.Blosc(cname="zstd", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),
            "lz4": numcodecs.LZ4(),
            "gzip": numcodecs.GZip(level=5),
        }
        return v2[name]
    if name == "zstd":
        return zarr.codecs.ZstdCodec(level=3)
    if name == "blosc":
        return zarr.codecs.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle")
    if name == "gzip":
        return zarr.codecs.GzipCodec(level=5)
    return _lz4_v3()


def _lz4_v3() -> Any:
    lz4_cls: Any = None
    with warnings.catch_warnings():
        # numcodecs.zarr3 is deprecated in favour of zarr.codecs.numcodecs (zarr >= 3.1.3).
        warnings.simplefilter("ignore", DeprecationWarning)
        for module in ("zarr.codecs.numcodecs", "numcodecs.zarr3"):
            try:
                lz4_cls = getattr(importlib.import_module(module), "LZ4", None)
            except ImportError:
                continue
            if lz4_cls is not None:
                break
    if lz4_cls is None:  # pragma: no cover - depends on installed versions
        raise ValueError(
            "compressor='lz4' with zarr_format=3 needs zarr.codecs.numcodecs or "
            "numcodecs.zarr3, neither of which provides LZ4 here"
        )
    with warnings.catch_warnings():
        # "Numcodecs codecs are not in the Zarr version 3 specification": we know.
        warnings.simplefilter("ignore", UserWarning)
        return lz4_cls()


def _open_new_group(store: StoreArg, *, overwrite: bool, zarr_format: Literal[2, 3]) -> zarr.Group:
    target: Store
    if isinstance(store, (str, os.PathLike)):
        path = Path(store)
        if not overwrite and path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise FileExistsError(
                f"{str(path)!r} already exists; pass overwrite=True to replace it"
            )
        target = LocalStore(path)
    elif isinstance(store, Store):
        target = store
    else:
        raise ValueError(f"store must be a folder path or a zarr Store, got {type(store).__name__}")
    try:
        return zarr.open_group(target, mode="w" if overwrite else "w-", zarr_format=zarr_format)
    except FileExistsError as exc:
        raise FileExistsError(
            f"the store already holds zarr data; pass overwrite=True to replace it ({exc})"
        ) from exc


def _create(
    group: zarr.Group,
    name: str,
    *,
    shape: tuple[int, ...],
    dtype: Any,
    dims: tuple[str, ...],
    attrs: dict[str, Any],
    zarr_format: int,
    chunks: tuple[int, ...] | None = None,
    shards: tuple[int, ...] | None = None,
    compressors: Any = None,
    fill_value: Any = None,
) -> zarr.Array:
    """Create one array carrying its dimension names the way xarray reads them."""
    attributes = dict(attrs)
    kwargs: dict[str, Any] = {}
    if zarr_format == 2:
        attributes["_ARRAY_DIMENSIONS"] = list(dims)
    elif dims:
        kwargs["dimension_names"] = dims
    if shards is not None:
        kwargs["shards"] = shards
    if fill_value is not None or zarr_format == 2:
        kwargs["fill_value"] = fill_value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return group.create_array(
            name,
            shape=shape,
            dtype=dtype,
            chunks=chunks if chunks is not None else (shape if shape else ()),
            compressors=compressors,
            attributes=attributes,
            **kwargs,
        )


def _block_len(unit: int, bytes_per_step: int, total: int) -> int:
    """Steps per write: a multiple of ``unit`` near ``_BLOCK_BYTES``, at least one ``unit``."""
    units = max(1, _BLOCK_BYTES // max(1, unit * bytes_per_step))
    return min(unit * units, max(unit, total))


def _noise_rng(seed: int, stream: int, *index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream, *index)))
