"""Deterministic synthetic zarr datasets shared by the tests, the demo and the benchmarks.

One module per kind of store, each generator re-exported here
(``from insitubatch_nodes.synthetic import make_era5_like``):

* :mod:`~insitubatch_nodes.synthetic.era5`: :func:`make_era5_like` writes a small
  reanalysis-like group (``t2m`` and ``z`` on a regular lat/lon grid with CF-style coordinates)
  whose anomaly pattern advects eastward by :data:`ERA5_ADVECTION_CELLS` longitude cells per
  time step, so a forecaster can learn ``t -> t+1``.
* :mod:`~insitubatch_nodes.synthetic.weatherbench`: :func:`make_weatherbench_like` writes the
  *archive shape* of WeatherBench2 / ARCO-ERA5 (one time step per chunk of each of many arrays),
  with data or metadata only.
* :mod:`~insitubatch_nodes.synthetic.microscopy`: :func:`make_microscopy_like` writes a 5-D
  ``(T, C, Z, Y, X)`` image with a matching label mask of ellipsoidal blobs, chunked differently
  along Z, so a segmenter can learn the mask.
* :mod:`~insitubatch_nodes.synthetic.plates`: :func:`make_hcs_plate` writes an OME-NGFF
  high-content-screening plate with ome-zarr-py, :func:`make_plate_metadata_only` the metadata
  of one (no chunk), :func:`plate_row_names` names its rows.

What they share (argument checks, compressors, creating groups and arrays, block sizes, noise
streams) is in the private ``_common``.

:func:`make_era5_like` and :func:`make_microscopy_like` are vectorized numpy, write block by
block (never the whole array at once), and are byte-for-byte deterministic given their
arguments. The content of each time step (ERA5-like) or Z plane (microscopy-like) depends only
on the seed and on the array extents, not on the chunking, sharding or compressor, so stores
written with different layouts hold the same values.
"""

from insitubatch_nodes.synthetic._common import COMPRESSORS
from insitubatch_nodes.synthetic.era5 import (
    ERA5_ADVECTION_CELLS,
    ERA5_HOURS_PER_STEP,
    ERA5_VARIABLES,
    make_era5_like,
)
from insitubatch_nodes.synthetic.microscopy import make_microscopy_like
from insitubatch_nodes.synthetic.plates import (
    make_hcs_plate,
    make_plate_metadata_only,
    plate_row_names,
    write_omero,
)
from insitubatch_nodes.synthetic.weatherbench import (
    WEATHERBENCH_LEVEL_VARIABLES,
    WEATHERBENCH_SURFACE_VARIABLES,
    make_weatherbench_like,
)

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
    "write_omero",
]
