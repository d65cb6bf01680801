"""Review of 2026-12-07's changes (memcheck, timeedges, statsload, collections2).

Found wrong, fixed:

* The build's memory check counted a level selection of an array stored all levels per object
  (ARCO-ERA5's chunks are ``(1, 37, 721, 1440)``) twice per decode thread: the
  ``KeepingDecoder``'s buffer of the whole object (``most_aside_bytes``), and a stored object
  of the inner decoder's scratch (``decode_scratch_bytes``), which the whole-object decode
  never takes (it decodes straight into that buffer). Here 262,144 bytes counted at 2 threads
  where 131,072 are held (the inner scratch stays 0); at ARCO-ERA5's 0.25 degrees, 307 MiB
  per thread and variable counted where 154 MiB are held, so a 13-level pipeline of 6
  variables at 16 decode threads was counted 14.7 GB of scratch it never takes, and refused
  on machines that hold it. ``ArrayFill.decodes_in_place`` (``stages/_jobs.py``) now says
  no scratch where every tile read goes through the whole-object buffer and a whole object
  decodes in place:
  ``test_a_level_selection_of_objects_holding_every_level_counts_its_decode_buffers_once``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk

pytestmark = pytest.mark.timeout(60)


def _levels_store(root: Path, n_time: int = 64) -> tuple[Path, np.ndarray]:
    """p (time, level, lat, lon), every level in each object, as ARCO-ERA5 stores them."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    values = np.random.default_rng(0).random((n_time, 8, 16, 32), dtype=np.float32)
    p = group.create_array("p", shape=values.shape, chunks=(4, 8, 16, 32), dtype="float32",
                           dimension_names=("time", "level", "lat", "lon"))  # fmt: skip
    p[:] = values
    level = group.create_array("level", shape=(8,), chunks=(8,), dtype="float64",
                               dimension_names=("level",))  # fmt: skip
    level[:] = np.arange(8) * 100.0
    return root, values


def test_a_level_selection_of_objects_holding_every_level_counts_its_decode_buffers_once(
    tmp_path: Path,
) -> None:
    root, values = _levels_store(tmp_path / "l.zarr")
    g = open_geometries(root, ["p"])
    manifest = split_by_chunk(g["p"], (1.0, 0.0, 0.0))
    obj = 4 * 8 * 16 * 32 * 4  # one stored object, decoded
    for threads in (2, 3):
        views = {"x": g["p"].isel(level=[0, 2, 5])}
        options = {"batch_size": 4, "coords": (), "decode_threads": threads}
        with insitu_pipeline(root, manifest, views, **options) as pipe:
            counted = pipe.stages.fetch.counted.scratch
            held = 0
            for _ in range(2):
                for b in Loader(pipe):
                    held = max(held, pipe.stats()["decode_scratch_bytes"])
                    rows = np.asarray(b.sample_indices["x"])
                    np.testing.assert_array_equal(b["x"], values[rows][:, [0, 2, 5]])
            assert pipe.stages.fetch._decoders["p"].scratch_bytes == 0  # never taken
            assert held <= counted == threads * obj  # the whole-object buffers, once
