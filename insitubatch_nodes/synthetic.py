"""Deterministic synthetic zarr datasets shared by the tests, the demo and the benchmarks.

Two generators are provided:

* :func:`make_era5_like` writes a small reanalysis-like group (``t2m`` and ``z`` on a regular
  lat/lon grid with CF-style coordinates) whose anomaly pattern advects eastward by
  :data:`ERA5_ADVECTION_CELLS` longitude cells per time step, so a forecaster can learn
  ``t -> t+1``.
* :func:`make_microscopy_like` writes a 5-D ``(T, C, Z, Y, X)`` image with a matching label
  mask of ellipsoidal blobs, chunked differently along Z, so a segmenter can learn the mask.

Both generators are vectorized numpy, write block by block (never the whole array at once),
and are byte-for-byte deterministic given their arguments. The content of each time step
(ERA5-like) or Z plane (microscopy-like) depends only on the seed and on the array extents, not
on the chunking, sharding or compressor, so stores written with different layouts hold the same
values.
"""

from __future__ import annotations

import importlib
import math
import operator
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numcodecs
import numpy as np
import numpy.typing as npt
import zarr
import zarr.codecs
from zarr.abc.store import Store
from zarr.storage import LocalStore

__all__ = [
    "COMPRESSORS",
    "ERA5_ADVECTION_CELLS",
    "ERA5_HOURS_PER_STEP",
    "ERA5_VARIABLES",
    "WEATHERBENCH_LEVEL_VARIABLES",
    "WEATHERBENCH_SURFACE_VARIABLES",
    "make_era5_like",
    "make_hcs_plate",
    "make_microscopy_like",
    "make_plate_metadata_only",
    "make_weatherbench_like",
    "plate_row_names",
]

ERA5_VARIABLES: tuple[str, ...] = ("t2m", "z")
"""Variables :func:`make_era5_like` knows how to write."""

ERA5_ADVECTION_CELLS: int = 2
"""Longitude grid cells the ERA5-like anomaly pattern moves eastward per time step.

``t2m[t + 1]`` equals ``np.roll(t2m[t], ERA5_ADVECTION_CELLS, axis=-1)`` up to the small
per-step noise (the same holds for every level of ``z``)."""

ERA5_HOURS_PER_STEP: int = 6
"""Spacing of the ERA5-like ``time`` coordinate, in hours."""

COMPRESSORS: tuple[str, ...] = ("zstd", "blosc", "lz4", "gzip", "none")
"""Compressor names accepted by the generators."""

WEATHERBENCH_SURFACE_VARIABLES: tuple[str, ...] = (
    "2m_temperature",
    "10m_u_component_of_wind",
    "10m_v_component_of_wind",
    "mean_sea_level_pressure",
    "surface_pressure",
    "total_precipitation_6hr",
    "total_column_water_vapour",
    "sea_surface_temperature",
    "2m_dewpoint_temperature",
    "toa_incident_solar_radiation",
)
"""Surface arrays :func:`make_weatherbench_like` writes by default (``(time, lat, lon)``)."""

WEATHERBENCH_LEVEL_VARIABLES: tuple[str, ...] = (
    "geopotential",
    "temperature",
    "u_component_of_wind",
    "v_component_of_wind",
    "specific_humidity",
    "vertical_velocity",
)
"""Pressure-level arrays it may write (``(time, level, lat, lon)``, every level in one chunk);
the default is the first three."""

_EPOCH_UNITS = "hours since 2000-01-01 00:00:00"
_CALENDAR = "proleptic_gregorian"
_T2M_NOISE_K = 0.25
_Z_NOISE = 5.0  # m**2 s**-2
_GRAVITY = 9.80665
# Pressure levels (hPa): the first few in the documented order, then ERA5's 37 levels.
_PREFERRED_LEVELS = (1000, 850, 500, 250)
_ERA5_LEVELS = (
    1, 2, 3, 5, 7, 10, 20, 30, 50, 70, 100, 125, 150, 175, 200, 225, 250, 300, 350,
    400, 450, 500, 550, 600, 650, 700, 750, 775, 800, 825, 850, 875, 900, 925, 950, 975, 1000,
)  # fmt: skip
# Target size of one in-memory block of generated data (several chunks are compressed in
# parallel by zarr's codec pipeline when a block covers several of them).
_BLOCK_BYTES = 64 * 1024 * 1024
# Distinct noise streams so that no two arrays share noise.
_STREAM_T2M = 1
_STREAM_Z = 2
_STREAM_IMAGE = 3
_STREAM_WEATHERBENCH = 4

StoreArg = str | os.PathLike[str] | Store


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# ERA5-like
# --------------------------------------------------------------------------------------------


def _pressure_levels(n_level: int) -> npt.NDArray[np.int32]:
    if n_level <= len(_PREFERRED_LEVELS):
        return np.asarray(_PREFERRED_LEVELS[:n_level], dtype=np.int32)
    if n_level > len(_ERA5_LEVELS):
        raise ValueError(f"n_level must be at most {len(_ERA5_LEVELS)}, got {n_level}")
    descending = np.asarray(_ERA5_LEVELS[::-1], dtype=np.int32)
    pick = np.round(np.linspace(0, len(descending) - 1, n_level)).astype(np.int64)
    return descending[pick]


def _advecting_pattern(
    rng: np.random.Generator, lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Anomaly field at t=0, shape (lat, lon), in kelvin: a sum of 3-5 waves and blobs."""
    lat_r = np.deg2rad(lat)[:, None]
    lon_r = np.deg2rad(lon)[None, :]
    field = np.zeros((lat.size, lon.size), dtype=np.float64)
    n_components = int(rng.integers(3, 6))
    for k in range(n_components):
        lat0 = np.deg2rad(rng.uniform(-60.0, 60.0))
        if k % 2 == 0:  # zonal wave packet
            wavenumber = int(rng.integers(2, 7))
            width = np.deg2rad(rng.uniform(15.0, 35.0))
            amp = rng.uniform(2.0, 6.0)
            phase = rng.uniform(0.0, 2.0 * np.pi)
            profile = np.cos(wavenumber * lon_r + phase)
        else:  # isolated blob, periodic in longitude (von Mises profile)
            width = np.deg2rad(rng.uniform(8.0, 20.0))
            amp = rng.uniform(3.0, 8.0) * rng.choice([-1.0, 1.0])
            lon0 = rng.uniform(0.0, 2.0 * np.pi)
            kappa = 1.0 / np.deg2rad(rng.uniform(10.0, 25.0)) ** 2
            profile = np.exp(kappa * (np.cos(lon_r - lon0) - 1.0))
        envelope = np.exp(-(((lat_r - lat0) / width) ** 2))
        field += amp * envelope * profile
    return field


def _write_time_blocks(
    arr: zarr.Array,
    n_time: int,
    block: int,
    make_step: Any,
    out_shape: tuple[int, ...],
) -> None:
    buf = np.empty((block, *out_shape), dtype=np.float32)
    for t0 in range(0, n_time, block):
        t1 = min(n_time, t0 + block)
        for i, t in enumerate(range(t0, t1)):
            make_step(t, buf[i])
        arr[t0:t1] = buf[: t1 - t0]


def make_era5_like(
    store: StoreArg,
    *,
    n_time: int = 512,
    n_lat: int = 32,
    n_lon: int = 64,
    n_level: int = 4,
    samples_per_chunk: int = 16,
    inner_chunks: tuple[int, int] | None = None,
    shard_samples: int | None = None,
    zarr_format: int = 3,
    compressor: str = "zstd",
    variables: Sequence[str] = ERA5_VARIABLES,
    seed: int = 0,
    overwrite: bool = False,
) -> zarr.Group:
    """Write a deterministic ERA5-like zarr group and return it (opened read/write).

    Arrays written (data arrays only if named in ``variables``):

    * ``t2m`` ``(time, lat, lon)`` float32, kelvin: a latitude-dependent mean (about 300 K at
      the equator, 240 K at the poles) plus an anomaly pattern of 3-5 smooth waves/blobs plus
      small noise (sigma 0.25 K).
    * ``z`` ``(time, level, lat, lon)`` float32, geopotential (m**2 s**-2): a per-level offset
      from the standard atmosphere (larger at lower pressure), a small latitude dependence, the
      same anomaly pattern scaled per level, and small noise.
    * coordinates ``time`` (int64, hours since 2000-01-01, every :data:`ERA5_HOURS_PER_STEP`
      hours), ``lat`` (float32 degrees, -90..90), ``lon`` (float32 degrees, 0..360 exclusive),
      ``level`` (int32 hPa, only with ``z``; 1000, 850, 500, 250, ... ) and a 0-D int32
      grid-mapping array ``crs``.

    The anomaly pattern moves eastward by :data:`ERA5_ADVECTION_CELLS` longitude cells per time
    step, wrapping periodically: ``t2m[t+1] ~= np.roll(t2m[t], ERA5_ADVECTION_CELLS, axis=-1)``.
    Values never contain NaN. Dimension names are stored as ``dimension_names`` (v3) or the
    ``_ARRAY_DIMENSIONS`` attribute (v2), so xarray can open the group.

    Layout: data arrays are chunked ``samples_per_chunk`` along time, 1 along level and
    ``inner_chunks`` (or the whole field) along (lat, lon). With ``shard_samples`` (zarr v3
    only; a multiple of ``samples_per_chunk``) the arrays are sharded with shards of
    ``(shard_samples, [n_level,] n_lat, n_lon)`` (lat/lon rounded up to a multiple of the tile
    when the tile does not divide the field).

    Determinism: the same arguments write byte-identical array contents; each time step's values
    depend only on ``seed``, its index and the grid sizes (not on chunking, sharding or the
    compressor). Data are generated and written a block of whole chunk rows (or shards) at a
    time, never holding a whole array in memory.

    Args:
        store: a local folder path (written with ``zarr.storage.LocalStore``) or a writable
            zarr ``Store``.
        n_time, n_lat, n_lon, n_level: array extents (positive; ``n_level`` <= 37).
        samples_per_chunk: chunk length along time (the sample axis).
        inner_chunks: ``(lat, lon)`` tile size; ``None`` = the whole field in one chunk.
        shard_samples: shard length along time (zarr v3 only); ``None`` = not sharded.
        zarr_format: 2 or 3.
        compressor: ``"zstd"``, ``"blosc"`` (blosc with zstd and byte shuffle), ``"lz4"``,
            ``"gzip"`` or ``"none"``.
        variables: which of :data:`ERA5_VARIABLES` to write.
        seed: non-negative seed of the pattern and noise.
        overwrite: replace existing data; otherwise existing data raise ``FileExistsError``
            (an existing but empty folder is fine).

    Raises:
        ValueError: invalid sizes, chunking, sharding, format, compressor or variable names.
        FileExistsError: the folder/store already holds data and ``overwrite`` is False.
    """
    n_time = _positive_int("n_time", n_time)
    n_lat = _positive_int("n_lat", n_lat)
    n_lon = _positive_int("n_lon", n_lon)
    n_level = _positive_int("n_level", n_level)
    spc = _positive_int("samples_per_chunk", samples_per_chunk)
    zarr_format = _check_format(zarr_format)
    seed = _check_seed(seed)
    tile = (
        (n_lat, n_lon)
        if inner_chunks is None
        else tuple(_positive_tuple("inner_chunks", inner_chunks, 2))
    )
    shard: int | None = None
    if shard_samples is not None:
        if zarr_format != 3:
            raise ValueError("shard_samples requires zarr_format=3 (zarr v2 has no sharding)")
        shard = _positive_int("shard_samples", shard_samples)
        if shard % spc:
            raise ValueError(
                f"shard_samples ({shard}) must be a multiple of samples_per_chunk ({spc})"
            )
    if isinstance(variables, str):
        variables = (variables,)
    wanted = list(dict.fromkeys(variables))
    unknown = [v for v in wanted if v not in ERA5_VARIABLES]
    if unknown:
        raise ValueError(
            f"unknown variable(s) {unknown}; known variables are {', '.join(ERA5_VARIABLES)}"
        )
    codec = _compressors(compressor, zarr_format)
    levels = _pressure_levels(n_level) if "z" in wanted else None

    group = _open_new_group(store, overwrite=overwrite, zarr_format=zarr_format)
    group.attrs.update(
        {
            "title": "insitubatch_nodes synthetic ERA5-like dataset",
            "Conventions": "CF-1.8",
            "source": "insitubatch_nodes.synthetic.make_era5_like",
            "seed": seed,
            "advection_cells_per_step": ERA5_ADVECTION_CELLS,
        }
    )

    # Coordinates.
    time = np.arange(n_time, dtype=np.int64) * ERA5_HOURS_PER_STEP
    lat64 = np.linspace(-90.0, 90.0, n_lat) if n_lat > 1 else np.zeros(1)
    lon64 = np.arange(n_lon, dtype=np.float64) * (360.0 / n_lon)
    coords: list[tuple[str, npt.NDArray[Any], dict[str, Any]]] = [
        (
            "time",
            time,
            {"units": _EPOCH_UNITS, "calendar": _CALENDAR, "standard_name": "time", "axis": "T"},
        ),
        (
            "lat",
            lat64.astype(np.float32),
            {"units": "degrees_north", "standard_name": "latitude", "axis": "Y"},
        ),
        (
            "lon",
            lon64.astype(np.float32),
            {"units": "degrees_east", "standard_name": "longitude", "axis": "X"},
        ),
    ]
    if levels is not None:
        coords.append(
            (
                "level",
                levels,
                {
                    "units": "hPa",
                    "standard_name": "air_pressure",
                    "long_name": "pressure level",
                    "positive": "down",
                    "axis": "Z",
                },
            )
        )
    for name, values, attrs in coords:
        arr = _create(
            group,
            name,
            shape=values.shape,
            dtype=values.dtype,
            dims=(name,),
            attrs=attrs,
            zarr_format=zarr_format,
        )
        arr[:] = values
    crs = _create(
        group,
        "crs",
        shape=(),
        dtype=np.int32,
        dims=(),
        attrs={
            "grid_mapping_name": "latitude_longitude",
            "longitude_of_prime_meridian": 0.0,
            "semi_major_axis": 6371229.0,
            "inverse_flattening": 0.0,
        },
        zarr_format=zarr_format,
    )
    crs[...] = np.int32(0)

    # Content shared by all variables: pattern at t=0, doubled along lon so that the field at
    # step t is the contiguous slice starting at (-ERA5_ADVECTION_CELLS * t) mod n_lon.
    pattern = _advecting_pattern(np.random.default_rng(seed), lat64, lon64)
    pattern_ext = np.concatenate([pattern, pattern], axis=1).astype(np.float32)

    def anomaly(t: int) -> npt.NDArray[np.float32]:
        off = (-ERA5_ADVECTION_CELLS * t) % n_lon
        return pattern_ext[:, off : off + n_lon]

    lat_r = np.deg2rad(lat64)
    field_shard = tuple(math.ceil(n / c) * c for n, c in zip((n_lat, n_lon), tile, strict=True))
    unit = shard if shard is not None else spc
    data_attrs = {"grid_mapping": "crs"}

    if "t2m" in wanted:
        t2m_mean = (240.0 + 60.0 * np.cos(lat_r) ** 2).astype(np.float32)[:, None]
        t2m = _create(
            group,
            "t2m",
            shape=(n_time, n_lat, n_lon),
            dtype=np.float32,
            dims=("time", "lat", "lon"),
            attrs={
                "units": "K",
                "long_name": "2 metre temperature",
                "standard_name": "air_temperature",
                **data_attrs,
            },
            zarr_format=zarr_format,
            chunks=(spc, *tile),
            shards=None if shard is None else (shard, *field_shard),
            compressors=codec,
            fill_value=np.float32(np.nan),
        )

        def t2m_step(t: int, out: npt.NDArray[np.float32]) -> None:
            noise = _noise_rng(seed, _STREAM_T2M, t).standard_normal(out.shape, np.float32)
            np.multiply(noise, np.float32(_T2M_NOISE_K), out=out)
            out += t2m_mean
            out += anomaly(t)

        block = _block_len(unit, 4 * n_lat * n_lon, n_time)
        _write_time_blocks(t2m, n_time, block, t2m_step, (n_lat, n_lon))

    if levels is not None:
        height = 44330.8 * (1.0 - (levels.astype(np.float64) / 1013.25) ** 0.190263)
        offset = _GRAVITY * height  # standard-atmosphere geopotential of each level
        # Lower geopotential towards the poles, more so aloft; anomaly amplitude grows aloft.
        z_mean = (
            offset[:, None] - (0.02 * offset + 500.0)[:, None] * np.sin(lat_r)[None, :] ** 2
        ).astype(np.float32)[:, :, None]
        z_scale = (60.0 + 0.01 * offset).astype(np.float32)[:, None, None]
        z = _create(
            group,
            "z",
            shape=(n_time, n_level, n_lat, n_lon),
            dtype=np.float32,
            dims=("time", "level", "lat", "lon"),
            attrs={
                "units": "m**2 s**-2",
                "long_name": "Geopotential",
                "standard_name": "geopotential",
                **data_attrs,
            },
            zarr_format=zarr_format,
            chunks=(spc, 1, *tile),
            shards=None if shard is None else (shard, n_level, *field_shard),
            compressors=codec,
            fill_value=np.float32(np.nan),
        )

        def z_step(t: int, out: npt.NDArray[np.float32]) -> None:
            noise = _noise_rng(seed, _STREAM_Z, t).standard_normal(out.shape, np.float32)
            np.multiply(noise, np.float32(_Z_NOISE), out=out)
            out += z_mean
            out += z_scale * anomaly(t)[None]

        block = _block_len(unit, 4 * n_level * n_lat * n_lon, n_time)
        _write_time_blocks(z, n_time, block, z_step, (n_level, n_lat, n_lon))

    return group


# --------------------------------------------------------------------------------------------
# WeatherBench2-like (the archive shape)
# --------------------------------------------------------------------------------------------


def make_weatherbench_like(
    store: StoreArg,
    *,
    n_time: int = 64,
    n_lat: int = 121,
    n_lon: int = 240,
    n_level: int = 13,
    surface: int | Sequence[str] = 10,
    levels: int | Sequence[str] = 3,
    samples_per_chunk: int = 1,
    compressor: str = "blosc",
    clevel: int = 3,
    write_chunks: bool = True,
    hours_per_step: int = ERA5_HOURS_PER_STEP,
    seed: int = 0,
    overwrite: bool = False,
) -> zarr.Group:
    """Write a deterministic WeatherBench2 / ARCO-ERA5-like zarr v3 group (the *archive shape*).

    Archives of this kind store **one time step per chunk** of each of many arrays: surface
    arrays ``(time, lat, lon)`` chunked ``(samples_per_chunk, lat, lon)`` and pressure-level
    arrays ``(time, level, lat, lon)`` chunked ``(samples_per_chunk, level, lat, lon)`` (every
    level in one stored object). With the defaults a sample is 13 stored objects and 5.7 MB
    decoded (121 x 240 grid, 10 surface arrays, 3 arrays on 13 levels), blosc-zstd at
    ``clevel`` 3 with byte shuffle, as WeatherBench2's stores are written.

    ``hours_per_step`` is the time step (6 by default, as WeatherBench2; 1 for an hourly store
    like ARCO-ERA5).

    ``surface`` and ``levels`` are a count (the first names of
    :data:`WEATHERBENCH_SURFACE_VARIABLES` / :data:`WEATHERBENCH_LEVEL_VARIABLES`, then
    ``surface_10``, ``level_3``... beyond those) or the names themselves. Coordinates ``time``
    (hours since 1959-01-01, every ``hours_per_step``), ``latitude``, ``longitude`` and
    ``level`` are written as xarray writes them. Each array holds a smooth pattern advecting
    eastward two cells per step, plus small noise, scaled per array (and per level); values
    never contain NaN.

    ``write_chunks=False`` writes the metadata and coordinates only: every data chunk is
    missing and reads as the fill value (a *metadata-only* store, for planning at 10^5-10^6
    steps without the bytes). ``compressor`` is ``"blosc"`` (blosc-zstd with shuffle),
    ``"zstd"``, ``"lz4"``, ``"gzip"`` or ``"none"``. Deterministic in its arguments; written a
    block of chunk rows at a time.
    """
    n_time = _positive_int("n_time", n_time)
    n_lat = _positive_int("n_lat", n_lat)
    n_lon = _positive_int("n_lon", n_lon)
    n_level = _positive_int("n_level", n_level)
    spc = _positive_int("samples_per_chunk", samples_per_chunk)
    clevel = _positive_int("clevel", clevel)
    hours_per_step = _positive_int("hours_per_step", hours_per_step)
    seed = _check_seed(seed)
    surface_names = _archive_names(surface, WEATHERBENCH_SURFACE_VARIABLES, "surface")
    level_names = _archive_names(levels, WEATHERBENCH_LEVEL_VARIABLES, "level")
    clash = set(surface_names) & set(level_names)
    if clash or not surface_names + level_names:
        raise ValueError(
            f"surface and levels must name distinct arrays, at least one in all (got {clash})"
            if clash
            else "surface and levels are both empty: write at least one array"
        )
    if compressor == "blosc":
        codec: Any = zarr.codecs.BloscCodec(cname="zstd", clevel=clevel, shuffle="shuffle")
    else:
        codec = _compressors(compressor, 3)
    group = _open_new_group(store, overwrite=overwrite, zarr_format=3)
    group.attrs.update(
        {
            "title": "insitubatch_nodes synthetic WeatherBench2-like dataset",
            "source": "insitubatch_nodes.synthetic.make_weatherbench_like",
            "seed": seed,
        }
    )
    lat64 = np.linspace(-90.0, 90.0, n_lat) if n_lat > 1 else np.zeros(1)
    lon64 = np.arange(n_lon, dtype=np.float64) * (360.0 / n_lon)
    level_values = _pressure_levels(n_level) if level_names else None
    coords: list[tuple[str, npt.NDArray[Any], dict[str, Any]]] = [
        (
            "time",
            np.arange(n_time, dtype=np.int64) * hours_per_step,
            {"units": "hours since 1959-01-01", "calendar": _CALENDAR, "standard_name": "time"},
        ),
        ("latitude", lat64.astype(np.float32), {"units": "degrees_north"}),
        ("longitude", lon64.astype(np.float32), {"units": "degrees_east"}),
    ]
    if level_values is not None:
        coords.append(("level", level_values, {"units": "hPa"}))
    for name, values, attrs in coords:
        arr = _create(
            group, name, shape=values.shape, dtype=values.dtype, dims=(name,), attrs=attrs,
            zarr_format=3,
        )  # fmt: skip
        arr[:] = values
    pattern = _advecting_pattern(np.random.default_rng(seed), lat64, lon64)
    pattern_ext = np.concatenate([pattern, pattern], axis=1).astype(np.float32)
    level_scale = np.linspace(1.0, 3.0, n_level, dtype=np.float32)[:, None, None]
    for k, name in enumerate(surface_names + level_names):
        leveled = name in level_names
        inner = (n_level, n_lat, n_lon) if leveled else (n_lat, n_lon)
        arr = _create(
            group,
            name,
            shape=(n_time, *inner),
            dtype=np.float32,
            dims=("time", "level", "latitude", "longitude") if leveled else
                 ("time", "latitude", "longitude"),
            attrs={"long_name": name.replace("_", " ")},
            zarr_format=3,
            chunks=(spc, *inner),
            compressors=codec,
            fill_value=np.float32(np.nan),
        )  # fmt: skip
        if not write_chunks:
            continue
        mean, scale = np.float32(100.0 * (k + 1)), np.float32(1.0 + 0.5 * k)

        def step(
            t: int,
            out: npt.NDArray[np.float32],
            k: int = k,
            mean: np.float32 = mean,
            scale: np.float32 = scale,
            leveled: bool = leveled,
        ) -> None:
            noise = _noise_rng(seed, _STREAM_WEATHERBENCH, k, t).standard_normal(
                out.shape, np.float32
            )
            np.multiply(noise, np.float32(0.05) * scale, out=out)
            off = (-ERA5_ADVECTION_CELLS * t) % n_lon
            field = scale * pattern_ext[:, off : off + n_lon] + mean
            out += field * level_scale if leveled else field

        block = _block_len(spc, 4 * math.prod(inner), n_time)
        _write_time_blocks(arr, n_time, block, step, inner)
    return group


def _archive_names(spec: int | Sequence[str], known: Sequence[str], kind: str) -> list[str]:
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, Sequence):
        return list(dict.fromkeys(str(s) for s in spec))
    if isinstance(spec, bool) or not isinstance(spec, int) or spec < 0:
        raise ValueError(f"{kind} must be a count >= 0 or a list of names, got {spec!r}")
    return [known[i] if i < len(known) else f"{kind}_{i}" for i in range(spec)]


# --------------------------------------------------------------------------------------------
# microscopy-like
# --------------------------------------------------------------------------------------------


class _Blobs:
    """Ellipsoidal blobs (label ids 1..k) drifting slowly over time, with per-channel signal."""

    def __init__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> None:
        _, n_c, n_z, n_y, n_x = shape
        dims = np.asarray([n_z, n_y, n_x], dtype=np.float64)
        self.k = int(rng.integers(3, 7))
        self.center = rng.uniform(0.2, 0.8, size=(self.k, 3)) * dims
        self.velocity = rng.uniform(-0.03, 0.03, size=(self.k, 3)) * dims
        frac = np.stack(
            [rng.uniform(0.12, 0.25, self.k), rng.uniform(0.08, 0.18, self.k),
             rng.uniform(0.08, 0.18, self.k)],
            axis=1,
        )  # fmt: skip
        self.radius = np.maximum(frac * dims, np.asarray([0.75, 1.5, 1.5]))
        self.background = rng.uniform(80.0, 200.0, size=n_c)
        # Row 0 = background label (no signal); every blob is bright in at least one channel.
        signal = rng.uniform(150.0, 1500.0, size=(self.k + 1, n_c))
        rows = np.arange(1, self.k + 1)
        bright = rng.integers(0, n_c, size=self.k)
        signal[rows, bright] = np.maximum(signal[rows, bright], 800.0)
        signal[0] = 0.0
        self.signal = signal
        self.noise_sigma = rng.uniform(10.0, 25.0, size=n_c)
        self.n_y, self.n_x = n_y, n_x

    def labels(
        self, t: int, z0: int, z1: int
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
        """Label ids and normalized squared radius of the winning blob for planes z0..z1-1."""
        zz = np.arange(z0, z1, dtype=np.float64)[:, None, None]
        yy = np.arange(self.n_y, dtype=np.float64)[None, :, None]
        xx = np.arange(self.n_x, dtype=np.float64)[None, None, :]
        label = np.zeros((z1 - z0, self.n_y, self.n_x), dtype=np.uint8)
        r2_win = np.ones(label.shape, dtype=np.float32)
        for i in range(self.k):
            cz, cy, cx = self.center[i] + t * self.velocity[i]
            rz, ry, rx = self.radius[i]
            r2 = ((zz - cz) / rz) ** 2 + ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
            inside = r2 <= 1.0
            label[inside] = i + 1
            r2_win[inside] = r2[inside]
        return label, r2_win


def _z_slab(chunk_z: int, bytes_per_plane: int, n_z: int) -> int:
    return _block_len(chunk_z, bytes_per_plane, n_z)


def make_microscopy_like(
    store: StoreArg,
    *,
    shape: tuple[int, int, int, int, int] = (2, 2, 64, 96, 96),
    image_chunks: tuple[int, int, int, int, int] = (1, 2, 1, 96, 96),
    mask_chunks: tuple[int, int, int, int, int] = (2, 1, 16, 48, 48),
    zarr_format: int = 3,
    compressor: str = "zstd",
    seed: int = 0,
    overwrite: bool = False,
) -> zarr.Group:
    """Write a deterministic light-microscopy-like zarr group and return it (opened read/write).

    Arrays written:

    * ``image`` ``(T, C, Z, Y, X)`` uint16, chunked ``image_chunks``: per-channel background plus
      per-blob, per-channel signal (brightest at a blob's center, at least 60% of it up to the
      edge) plus Gaussian noise; every blob is bright in at least one channel.
    * ``mask`` ``(T, 1, Z, Y, X)`` uint8, chunked ``mask_chunks``: label ids ``1..k`` of 3-6
      ellipsoidal blobs (0 = background) that drift slowly over T, exactly the voxels where the
      image carries blob signal, so the mask is learnable from the image.

    Dimension names ``("t", "c", "z", "y", "x")`` are stored as ``dimension_names`` (v3) or
    ``_ARRAY_DIMENSIONS`` (v2). The sample axis for users is Z (axis 2), along which the two
    arrays are chunked differently by default.

    Determinism: the same arguments write byte-identical contents; each Z plane depends only on
    ``seed``, its (t, c, z) index and ``shape`` (not on chunking or the compressor). Data are
    generated vectorized and written in Z slabs spanning whole chunks.

    Args:
        store: a local folder path (written with ``zarr.storage.LocalStore``) or a writable
            zarr ``Store``.
        shape: ``(T, C, Z, Y, X)`` of ``image``; ``mask`` is ``(T, 1, Z, Y, X)``.
        image_chunks, mask_chunks: chunk shapes (5 positive integers each).
        zarr_format: 2 or 3.
        compressor: ``"zstd"``, ``"blosc"``, ``"lz4"``, ``"gzip"`` or ``"none"``.
        seed: non-negative seed.
        overwrite: replace existing data; otherwise existing data raise ``FileExistsError``
            (an existing but empty folder is fine).

    Raises:
        ValueError: invalid shape, chunks, format or compressor.
        FileExistsError: the folder/store already holds data and ``overwrite`` is False.
    """
    full = _positive_tuple("shape", shape, 5)
    img_chunks = _positive_tuple("image_chunks", image_chunks, 5)
    msk_chunks = _positive_tuple("mask_chunks", mask_chunks, 5)
    zarr_format = _check_format(zarr_format)
    seed = _check_seed(seed)
    codec = _compressors(compressor, zarr_format)
    n_t, n_c, n_z, n_y, n_x = full
    dims = ("t", "c", "z", "y", "x")

    group = _open_new_group(store, overwrite=overwrite, zarr_format=zarr_format)
    group.attrs.update(
        {
            "title": "insitubatch_nodes synthetic microscopy-like dataset",
            "source": "insitubatch_nodes.synthetic.make_microscopy_like",
            "seed": seed,
        }
    )
    blobs = _Blobs(np.random.default_rng(seed), full)

    mask = _create(
        group,
        "mask",
        shape=(n_t, 1, n_z, n_y, n_x),
        dtype=np.uint8,
        dims=dims,
        attrs={"long_name": "instance labels", "units": "1"},
        zarr_format=zarr_format,
        chunks=msk_chunks,
        compressors=codec,
        fill_value=np.uint8(0),
    )
    slab = _z_slab(msk_chunks[2], n_t * n_y * n_x, n_z)
    for z0 in range(0, n_z, slab):
        z1 = min(n_z, z0 + slab)
        block = np.stack([blobs.labels(t, z0, z1)[0] for t in range(n_t)])[:, None]
        mask[:, :, z0:z1] = block

    image = _create(
        group,
        "image",
        shape=full,
        dtype=np.uint16,
        dims=dims,
        attrs={"long_name": "fluorescence intensity", "units": "counts"},
        zarr_format=zarr_format,
        chunks=img_chunks,
        compressors=codec,
        fill_value=np.uint16(0),
    )
    slab = _z_slab(img_chunks[2], 2 * n_t * n_c * n_y * n_x, n_z)
    for z0 in range(0, n_z, slab):
        z1 = min(n_z, z0 + slab)
        out = np.empty((n_t, n_c, z1 - z0, n_y, n_x), dtype=np.uint16)
        for t in range(n_t):
            label, r2 = blobs.labels(t, z0, z1)
            profile = np.where(label > 0, 0.6 + 0.4 * np.sqrt(np.clip(1.0 - r2, 0.0, 1.0)), 0.0)
            for c in range(n_c):
                value = blobs.background[c] + blobs.signal[label, c] * profile
                noise = np.stack(
                    [
                        _noise_rng(seed, _STREAM_IMAGE, t, c, z).standard_normal((n_y, n_x))
                        for z in range(z0, z1)
                    ]
                )
                value += blobs.noise_sigma[c] * noise
                np.clip(np.rint(value), 0, np.iinfo(np.uint16).max, out=value)
                out[t, c] = value.astype(np.uint16)
        image[:, :, z0:z1] = out

    return group


# --------------------------------------------------------------------------------------------
# OME-NGFF HCS plates
# --------------------------------------------------------------------------------------------

_STREAM_PLATE = 5
_PLATE_AXES: tuple[str, ...] = ("t", "c", "z", "y", "x")


def plate_row_names(n_rows: int) -> list[str]:
    """Row names of a plate with ``n_rows`` rows, as plate readers name them: ``A``..``Z``,
    then ``AA``, ``AB``, ... (a 1,536-well plate's 32 rows end at ``AF``)."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = list(letters) + [a + b for a in letters for b in letters]
    if not 0 < n_rows <= len(names):
        raise ValueError(f"n_rows must be in [1, {len(names)}], got {n_rows}")
    return names[:n_rows]


def _ngff_format(ngff_version: str) -> Any:
    try:
        from ome_zarr.format import FormatV04, FormatV05
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError(
            "make_hcs_plate writes with ome-zarr-py: pip install ome-zarr "
            "(it comes with insitubatch_nodes[dev])"
        ) from exc
    formats = {"0.4": FormatV04, "0.5": FormatV05}
    if ngff_version not in formats:
        raise ValueError(f"ngff_version must be '0.4' or '0.5', got {ngff_version!r}")
    return formats[ngff_version]()


def make_hcs_plate(
    path: str | os.PathLike[str],
    *,
    rows: int = 2,
    columns: int = 3,
    fields: int = 2,
    wells: Sequence[str] | None = None,
    absent_wells: Sequence[str] = (),
    shape: tuple[int, int, int, int, int] = (1, 2, 8, 64, 64),
    levels: int = 2,
    labels: Sequence[str] = ("cells",),
    pixel_size: float = 0.65,
    z_spacing: float = 2.0,
    ngff_version: str = "0.4",
    seed: int = 0,
) -> str:
    """Write an OME-NGFF high-content-screening plate with ome-zarr-py's writer and return its
    path: plate, well and image metadata (NGFF 0.4 on zarr v2, or 0.5 on zarr v3) as
    ome-zarr-py writes them, every field a microscopy-like image with its label images.

    * Wells: every ``rows x columns`` well (rows ``A``, ``B``, ..., columns ``1``, ``2``, ...),
      or the ``"A/1"``-style paths in ``wells`` (a *sparse* plate). Each lists ``fields``
      images ``"0"``, ``"1"``, ...; field ``f`` of well ``R/C`` is the group ``R/C/f``.
    * ``absent_wells`` are listed in the plate metadata but never written (no group): a plate
      whose acquisition lost wells.
    * Each field is a ``(T, C, Z, Y, X)`` uint16 image of ``levels`` resolution levels (Y and X
      halved per level, pixel sizes ``pixel_size * 2**level`` micrometers in Y and X,
      ``z_spacing`` in Z), one Z plane per chunk. Each name in ``labels`` is a uint8 label
      image ``(T, 1, Z, Y, X)`` of ellipsoidal blobs (ids ``1..k``, 0 = background), exactly
      the voxels where the image carries blob signal (as in :func:`make_microscopy_like`).

    Deterministic: a field's content depends only on ``seed``, its well's position in the
    rows x columns grid, its field index and ``shape``. Needs ome-zarr-py (``pip install
    ome-zarr``, in the ``dev`` extra). The folder must not exist or be empty.
    """
    fmt = _ngff_format(ngff_version)
    from ome_zarr.writer import (
        write_image,
        write_labels,
        write_plate_metadata,
        write_well_metadata,
    )

    full = _positive_tuple("shape", shape, 5)
    n_rows, n_cols, n_fields = (
        _positive_int(n, v) for n, v in (("rows", rows), ("columns", columns), ("fields", fields))
    )
    n_levels = _positive_int("levels", levels)
    seed = _check_seed(seed)
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{str(target)!r} already exists and is not an empty folder")
    row_names = plate_row_names(n_rows)
    col_names = [str(c + 1) for c in range(n_cols)]
    grid = [f"{r}/{c}" for r in row_names for c in col_names]
    present = list(grid) if wells is None else [str(w) for w in wells]
    absent = [str(w) for w in absent_wells]
    unknown = [w for w in (*present, *absent) if w not in grid]
    if unknown:
        raise ValueError(f"wells {unknown} are not on the {n_rows} x {n_cols} plate")
    listed = [w for w in grid if w in set(present) | set(absent)]

    n_t, n_c, n_z, n_y, n_x = full
    chunks = (1, n_c, 1, n_y, n_x)
    scale = {"z": float(z_spacing), "y": float(pixel_size), "x": float(pixel_size)}
    units = {a: "micrometer" for a in ("z", "y", "x")}
    factors = [{"y": 2**k, "x": 2**k} for k in range(1, n_levels)]
    root = zarr.open_group(str(target), mode="w", zarr_format=fmt.zarr_format)
    write_plate_metadata(
        root, row_names, col_names, listed, fmt=fmt, field_count=n_fields, name="synthetic"
    )
    with warnings.catch_warnings():
        # ome-zarr-py warns that t and c get a scale of 1.0: that is what we mean
        warnings.simplefilter("ignore", UserWarning)
        for well in present:
            row, col = well.split("/")
            group = root.require_group(row).require_group(col)
            write_well_metadata(group, [str(f) for f in range(n_fields)], fmt=fmt)
            position = grid.index(well)
            for f in range(n_fields):
                field = group.require_group(str(f))
                rng = np.random.default_rng(
                    np.random.SeedSequence(seed, spawn_key=(_STREAM_PLATE, position, f))
                )
                blobs = _Blobs(rng, full)
                label = np.stack([blobs.labels(t, 0, n_z)[0] for t in range(n_t)])[:, None]
                image = np.empty(full, dtype=np.uint16)
                for t in range(n_t):
                    ids, r2 = blobs.labels(t, 0, n_z)
                    profile = np.where(ids > 0, 0.6 + 0.4 * np.sqrt(np.clip(1 - r2, 0, 1)), 0.0)
                    for c in range(n_c):
                        value = blobs.background[c] + blobs.signal[ids, c] * profile
                        value += blobs.noise_sigma[c] * rng.standard_normal(value.shape)
                        np.clip(np.rint(value), 0, np.iinfo(np.uint16).max, out=value)
                        image[t, c] = value.astype(np.uint16)
                write_image(
                    image, field, scale_factors=factors, fmt=fmt, axes="tczyx",
                    storage_options={"chunks": chunks}, scale=scale, axes_units=units,
                )  # fmt: skip
                for name in labels:
                    write_labels(
                        label, field, name=name, scaler=None, scale_factors=factors, fmt=fmt,
                        axes="tczyx", storage_options={"chunks": (1, 1, 1, n_y, n_x)},
                        scale=scale, axes_units=units,
                    )  # fmt: skip
    return str(target)


def make_plate_metadata_only(
    path: str | os.PathLike[str],
    *,
    rows: int = 32,
    columns: int = 48,
    fields: int = 9,
    shape: tuple[int, int, int, int, int] = (1, 2, 16, 2048, 2048),
    levels: int = 1,
    labels: Sequence[str] = (),
    pixel_size: float = 0.65,
    ngff_version: str = "0.5",
) -> str:
    """Write the metadata of an OME-NGFF plate and no chunk at all; return its path.

    The defaults are a 1,536-well plate (32 rows ``A``..``AF`` x 48 columns) of 9 fields per
    well: 13,824 fields, each a ``(T, C, Z, Y, X)`` uint16 image of ``levels`` levels chunked
    one Z plane per chunk, with the label images named in ``labels``. Every group and array
    document is written as a file directly (``zarr.json`` for NGFF 0.5 on zarr v3;
    ``.zgroup``, ``.zattrs`` and ``.zarray`` for 0.4 on zarr v2), the array documents made by
    zarr once and copied, so a 13,824-field plate takes seconds to write. Reading any pixel
    gives the fill value (0). For the scale tests and benchmarks of ``open_plate``: local
    folders only; the folder must not exist or be empty.
    """
    import json

    if ngff_version not in ("0.4", "0.5"):
        raise ValueError(f"ngff_version must be '0.4' or '0.5', got {ngff_version!r}")
    full = _positive_tuple("shape", shape, 5)
    n_levels = _positive_int("levels", levels)
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{str(target)!r} already exists and is not an empty folder")
    v3 = ngff_version == "0.5"
    row_names = plate_row_names(_positive_int("rows", rows))
    col_names = [str(c + 1) for c in range(_positive_int("columns", columns))]
    n_fields = _positive_int("fields", fields)
    axes = [{"name": a, "type": t} for a, t in zip(_PLATE_AXES, ("time", "channel"), strict=False)]
    axes += [{"name": a, "type": "space", "unit": "micrometer"} for a in _PLATE_AXES[2:]]

    def level_shape(k: int, channels: int) -> tuple[int, ...]:
        n_t, _, n_z, n_y, n_x = full
        return (n_t, channels, n_z, max(1, n_y >> k), max(1, n_x >> k))

    def multiscales(name: str) -> list[dict[str, Any]]:
        scales = [[1.0, 1.0, 1.0, pixel_size * 2**k, pixel_size * 2**k] for k in range(n_levels)]
        datasets = [
            {"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": scale}]}
            for k, scale in enumerate(scales)
        ]
        ms: dict[str, Any] = {"axes": axes, "datasets": datasets, "name": name}
        if not v3:
            ms["version"] = "0.4"
        return [ms]

    def array_docs(channels: int) -> list[dict[str, bytes]]:
        docs = []
        for k in range(n_levels):
            shp = level_shape(k, channels)
            written: dict[str, Any] = {}
            store = zarr.storage.MemoryStore(written)
            zarr.create_array(
                store, shape=shp, chunks=(1, channels, 1, shp[3], shp[4]), dtype="uint16",
                fill_value=0, zarr_format=3 if v3 else 2,
                dimension_names=_PLATE_AXES if v3 else None,
            )  # fmt: skip
            docs.append({key: buf.to_bytes() for key, buf in written.items()})
        return docs

    def write_group(folder: Path, attrs: dict[str, Any]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if v3:
            doc = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
            (folder / "zarr.json").write_text(json.dumps(doc))
        else:
            (folder / ".zgroup").write_text('{"zarr_format": 2}')
            (folder / ".zattrs").write_text(json.dumps(attrs))

    def ome(attrs: dict[str, Any]) -> dict[str, Any]:
        return {"ome": {"version": "0.5", **attrs}} if v3 else attrs

    def write_image_group(folder: Path, name: str, docs: list[dict[str, bytes]], more: Any) -> None:
        write_group(folder, ome({"multiscales": multiscales(name), **more}))
        for k, level_docs in enumerate(docs):
            (folder / str(k)).mkdir()
            for key, raw in level_docs.items():
                (folder / str(k) / key).write_bytes(raw)

    image_docs, label_docs = array_docs(full[1]), array_docs(1)
    wells = [
        {"path": f"{r}/{c}", "rowIndex": i, "columnIndex": j}
        for i, r in enumerate(row_names)
        for j, c in enumerate(col_names)
    ]
    plate: dict[str, Any] = {
        "name": "metadata-only", "field_count": n_fields, "wells": wells,
        "rows": [{"name": r} for r in row_names], "columns": [{"name": c} for c in col_names],
        "version": ngff_version,
    }  # fmt: skip
    write_group(target, ome({"plate": plate}))
    label_extra = {"image-label": {"version": "0.4"} if not v3 else {}}
    for r in row_names:
        write_group(target / r, {})
        for c in col_names:
            well: dict[str, Any] = {"images": [{"path": str(f)} for f in range(n_fields)]}
            if not v3:
                well["version"] = "0.4"
            write_group(target / r / c, ome({"well": well}))
            for f in range(n_fields):
                field = target / r / c / str(f)
                write_image_group(field, "image", image_docs, {})
                if labels:
                    write_group(field / "labels", ome({"labels": list(labels)}))
                    for name in labels:
                        write_image_group(field / "labels" / name, name, label_docs, label_extra)
    return str(target)
