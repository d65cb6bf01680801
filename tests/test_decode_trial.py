"""A user's black-box trial of how stored chunks are decoded, with zarr as the oracle.

Each case writes a small zarr store with zarr's own API, reads it through ``insitu_pipeline``
(wrapped in torchdata's ``Loader``) and compares every delivered batch row with
``zarr.open_array(...)[sample]``.

The trial (about 2,400 stores: zarr v2 and v3; blosc lz4/zstd/zlib/blosclz with every shuffle,
zstd, gzip, lz4, zlib, bz2, lzma, none; v2 filters Delta, FixedScaleOffset, Quantize, AsType,
PackBits, BitRound, Shuffle, Categorize; v3 bytes little/big endian, transpose, crc32c,
sharding with the index at the start or end, little/big-endian and crc32c indexes, nested
sharding; every numeric dtype, bool, complex, big-endian v2 dtypes, datetime64, timedelta64,
fixed-width strings and structured records; fill values 0, NaN, ±inf, extremes, None; missing
objects and all-fill chunks; partial edge chunks; C and F order; tiled fields; sample axes by
index, by name, not first, and product sample axes; each read with ``direct`` forced on and
off, a small pool budget, zarr's ``LocalStore``, ``MemoryStore``, the obstore path, and a
persistent chunk cache written and then revived) found every delivered row equal to zarr's,
and every corrupt or truncated object raising ``ChunkReadError`` naming the array and chunk.

Findings held here:

* datetime64 / timedelta64 arrays revived from a persistent cache (``cache_dir``,
  ``persist=True``): the chunk checksum hashed the array's buffer, which numpy does not export
  for those dtypes; the second pipeline over the cache hung instead of delivering.
* a zstd-compressed object written as several concatenated zstd frames (which zarr reads):
  the first frame's header announces only that frame's size, and the object was refused as
  corrupt ("zstd stream announces 16 decoded bytes, the chunk holds 32").
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Literal

import numcodecs
import numpy as np
import pytest
import zarr
from torchdata.nodes import Loader
from zarr.codecs import ZstdCodec

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.options import FetchOptions

pytestmark = pytest.mark.filterwarnings("ignore::zarr.errors.ZarrUserWarning")


def _rows(root: Path, **options: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every ``(sample indices, values)`` batch of array ``a`` of ``root`` over two epochs,
    read through ``Loader`` on a helper thread that must finish within 20 s (a hang fails)."""
    geom = open_geometries(root, ["a"])["a"]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    out: list[tuple[np.ndarray, np.ndarray]] = []
    errors: list[BaseException] = []
    pipe = insitu_pipeline(root, manifest, {"x": geom}, batch_size=3, coords=(), **options)

    def read() -> None:
        try:
            loader = Loader(pipe)
            for _ in range(2):
                out.extend((b.sample_indices["x"], np.array(b.arrays["x"])) for b in loader)
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(20)
    try:
        assert not thread.is_alive(), "the pipeline hung: no batch for 20 s"
        if errors:
            raise errors[0]
    finally:
        if not thread.is_alive():
            pipe.close()
    return out


@pytest.mark.parametrize("dtype", ["M8[s]", "M8[ns]", "m8[ms]"])
def test_datetime_chunks_revived_from_a_persistent_cache_read_as_zarr_reads_them(
    tmp_path: Path, dtype: str
) -> None:
    root = tmp_path / "s.zarr"
    data = (np.datetime64("2020-01-01", "s") + np.arange(7 * 4).astype("m8[h]")).reshape(7, 4)
    data = data.astype(dtype) if dtype.startswith("M") else (data - data[0, 0]).astype(dtype)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_array("a", shape=data.shape, dtype=dtype, chunks=(2, 4), fill_value=0)
    array[...] = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.asarray(zarr.open_array(root / "a", mode="r")[...])
    cache = {"cache_dir": tmp_path / "cache", "persist": True}
    for run in range(2):  # the first run writes the cache, the second revives every chunk
        rows = _rows(root, **cache)
        assert sum(len(samples) for samples, _ in rows) == 2 * 7, run
        for samples, values in rows:
            assert values.dtype == want.dtype
            np.testing.assert_array_equal(values, want[samples], err_msg=f"run {run}")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_object_of_several_zstd_frames_reads_as_zarr_reads_it(
    tmp_path: Path, zarr_format: Literal[2, 3]
) -> None:
    root = tmp_path / "s.zarr"
    zstd = numcodecs.Zstd(level=1)
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    compressors: Any = zstd if zarr_format == 2 else (ZstdCodec(level=1),)
    array = group.create_array(
        "a", shape=(4, 8), chunks=(1, 8), dtype="f4", fill_value=0, compressors=compressors
    )
    data = np.arange(32, dtype="f4").reshape(4, 8) + 1
    array[...] = data
    # chunk 1 rewritten as two zstd frames, each announcing its own size (16 of 32 bytes)
    key = root / "a" / ("1.0" if zarr_format == 2 else "c/1/0")
    raw = data[1].tobytes()
    key.write_bytes(bytes(zstd.encode(raw[:16])) + bytes(zstd.encode(raw[16:])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.asarray(zarr.open_array(root / "a", mode="r")[...])
    np.testing.assert_array_equal(want, data)  # zarr reads the frames one after the other
    for direct in (True, False):
        rows = _rows(root, fetch=FetchOptions(direct=direct))
        assert sum(len(samples) for samples, _ in rows) == 2 * 4
        for samples, values in rows:
            np.testing.assert_array_equal(values, want[samples], err_msg=f"direct={direct}")
