"""The ERA5-like store: ``t2m`` and ``z`` on a regular lat/lon grid with CF-style
coordinates, an anomaly pattern advecting eastward (:func:`make_era5_like`); its pressure
levels, pattern and time-block writer serve the WeatherBench-like store too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zarr

from insitubatch_nodes.synthetic._common import (
    _STREAM_T2M,
    _STREAM_Z,
    StoreArg,
    _block_len,
    _check_format,
    _check_seed,
    _compressors,
    _create,
    _noise_rng,
    _open_new_group,
    _positive_int,
    _positive_tuple,
)

ERA5_VARIABLES: tuple[str, ...] = ("t2m", "z")
"""Variables :func:`make_era5_like` knows how to write."""

ERA5_ADVECTION_CELLS: int = 2
"""Longitude grid cells the ERA5-like anomaly pattern moves eastward per time step.

``t2m[t + 1]`` equals ``np.roll(t2m[t], ERA5_ADVECTION_CELLS, axis=-1)`` up to the small
per-step noise (the same holds for every level of ``z``)."""

ERA5_HOURS_PER_STEP: int = 6
"""Spacing of the ERA5-like ``time`` coordinate, in hours."""

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
