"""The WeatherBench2 / ARCO-ERA5-like store, the *archive shape*: one time step per chunk of
each of many surface and pressure-level arrays, with data or metadata only
(:func:`make_weatherbench_like`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zarr
import zarr.codecs

from insitubatch_nodes.synthetic._common import (
    _STREAM_WEATHERBENCH,
    StoreArg,
    _block_len,
    _check_seed,
    _compressors,
    _create,
    _noise_rng,
    _open_new_group,
    _positive_int,
)
from insitubatch_nodes.synthetic.era5 import (
    _CALENDAR,
    ERA5_ADVECTION_CELLS,
    ERA5_HOURS_PER_STEP,
    _advecting_pattern,
    _pressure_levels,
    _write_time_blocks,
)

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
