"""Decode throughput of ChunkDecoder (a measurement, not a test).

Writes one 8 MiB float32 chunk with zarr (bytes + zstd), then decodes it repeatedly through
``ChunkDecoder.decode_into`` into a preallocated slot with 1 thread and with 2 threads, and prints
MB/s of *decoded* (output) bytes. Run: ``.venv/bin/python benchmarks/decode_speed.py``.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from insitubatch_nodes import open_geometries
from insitubatch_nodes.io.decode import ChunkDecoder

SHAPE = (2048, 1024)  # float32: 8 MiB, one chunk
REPEATS = 40


def _field() -> np.ndarray:
    """A smooth field plus noise, rounded: compresses roughly like reanalysis data."""
    rng = np.random.default_rng(0)
    y, x = np.meshgrid(np.linspace(0, 6, SHAPE[0]), np.linspace(0, 6, SHAPE[1]), indexing="ij")
    data = 280 + 20 * np.sin(y) * np.cos(x) + rng.normal(0, 0.5, SHAPE)
    return np.round(data, 2).astype("f4")


def _run(decoder: ChunkDecoder, raw: bytes, n_threads: int) -> float:
    """Seconds for ``n_threads`` threads to each decode the chunk ``REPEATS`` times."""
    slots = [np.empty(SHAPE, dtype="f4") for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads + 1)

    def work(slot: np.ndarray) -> None:
        decoder.decode_into(raw, slot, 0, (0,))  # warm up (per-thread codec, scratch)
        barrier.wait()
        for _ in range(REPEATS):
            decoder.decode_into(raw, slot, 0, (0,))

    threads = [threading.Thread(target=work, args=(slot,)) for slot in slots]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "bench.zarr"
        group = zarr.open_group(root, mode="w", zarr_format=3)
        data = _field()
        array = group.create_array(
            "a", shape=SHAPE, chunks=SHAPE, dtype="f4", fill_value=0, compressors=[ZstdCodec()]
        )
        array[...] = data
        geom = open_geometries(root, ["a"])["a"]
        raw = (root / geom.store_key(0, (0,))).read_bytes()
        decoder = ChunkDecoder(geom)
        check = np.empty(SHAPE, dtype="f4")
        decoder.decode_into(raw, check, 0, (0,))
        assert np.array_equal(check, data)
        out_mb = data.nbytes / 1e6
        print(
            f"chunk: {SHAPE} float32 = {out_mb:.1f} MB decoded, {len(raw) / 1e6:.2f} MB stored "
            f"(ratio {data.nbytes / len(raw):.2f}), strategy={decoder.strategy}, "
            f"in-place={decoder.inplace_capable}"
        )
        for n_threads in (1, 2):
            seconds = _run(decoder, raw, n_threads)
            rate = n_threads * REPEATS * out_mb / seconds
            print(f"{n_threads} thread(s): {rate:8.0f} MB/s decoded")
        print(f"decoded in place: {decoder._stats.inplace}, via scratch: {decoder._stats.scratch}")


if __name__ == "__main__":
    main()
