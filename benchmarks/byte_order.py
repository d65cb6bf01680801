"""Where the byte swap of a big-endian zarr v2 array costs least (a measurement, not a test).

Writes one 8 MiB ``">f4"`` chunk with zarr (v2, zstd), then, side by side in one run:

* decodes it with ``ChunkDecoder.decode_into`` into a native ``float32`` slot (what the pipeline
  does: the decoder swaps as it copies from its scratch buffer) and into a big-endian slot (the
  decompressor writes straight into it, no swap);
* gathers 256 rows drawn from the chunk (8 MiB) with ``gather.take_rows`` into a native batch
  from a native slot and from a big-endian one (the swap left to the gather).

Prints the best time of each. Run: ``.venv/bin/python benchmarks/byte_order.py``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numcodecs
import numpy as np
import zarr

from insitubatch_nodes import open_geometries
from insitubatch_nodes.io.decode import ChunkDecoder
from insitubatch_nodes.stages.gather import take_rows

SHAPE = (256, 8192)  # float32: 8 MiB, one chunk of 256 samples
REPEATS = 40


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    data = np.round(280 + rng.normal(0, 5, SHAPE), 2).astype(">f4")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "be.zarr"
        group = zarr.open_group(root, mode="w", zarr_format=2)
        arr = group.create_array(
            "a", shape=SHAPE, chunks=SHAPE, dtype=">f4", compressors=numcodecs.Zstd(level=1)
        )
        arr[...] = data
        geom = open_geometries(root, ["a"])["a"]
        raw = (root / geom.store_key(0)).read_bytes()
        decoder = ChunkDecoder(geom)
        native, big = np.empty(SHAPE, "=f4"), np.empty(SHAPE, ">f4")
        t_native = _best(lambda: decoder.decode_into(raw, native, 0, (0,)), REPEATS)
        t_big = _best(lambda: decoder.decode_into(raw, big, 0, (0,)), REPEATS)
        assert np.array_equal(native, data) and np.array_equal(big, data)
        rows = np.sort(rng.integers(0, SHAPE[0], SHAPE[0]))
        out = np.empty(SHAPE, "=f4")
        g_native = _best(lambda: take_rows(native, rows, out), REPEATS)
        g_big = _best(lambda: take_rows(big, rows, out), REPEATS)
    mb = data.nbytes / 1e6
    print(f"decode {mb:.1f} MB (zstd, v2 '>f4'), best of {REPEATS}:")
    print(f"  into a native slot (swap while copying): {t_native * 1e3:7.2f} ms")
    print(f"  into a big-endian slot (in place):       {t_big * 1e3:7.2f} ms")
    print(
        f"gather {len(rows)} rows ({out.nbytes / 1e6:.1f} MB) into a native batch, "
        f"best of {REPEATS}:"
    )
    print(f"  from a native slot:                      {g_native * 1e3:7.2f} ms")
    print(f"  from a big-endian slot (swap in gather): {g_big * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
