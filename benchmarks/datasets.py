"""The benchmark datasets: ERA5-like zarr groups written once and reused.

Every dataset is :func:`insitubatch_nodes.synthetic.make_era5_like` (``t2m`` and ``z`` on 4
pressure levels, zstd) with one layout: samples per chunk, optional inner (lat, lon) tiles,
optional shards. A dataset is written into a temporary folder next to its final place and
renamed when complete; then a ``FOLDER.bench-spec.json`` marker holding its spec is written
next to it. A folder whose marker matches on every layout field is reused as it is (the spec's
``name`` is a label within a suite, not part of the data: a renamed spec reuses its folder).

The full suite's first dataset, ``reference``, is the design's reference shape (issue 13):
``t2m`` (2048, 181, 360) + ``z`` (2048, 4, 181, 360), float32, 16 samples per chunk, zstd —
about 2.1 GB stored, ~25 s to write and ~8 s to upload to moto on the project's machine. The
others are a reduced 91 x 180 grid on which the per-sample loaders finish in time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "REFERENCE",
    "SUITES",
    "DatasetSpec",
    "chunk_sizes",
    "ensure_dataset",
    "ensure_written",
    "needed_bytes",
]

MARKER = ".bench-spec.json"
DATA_ARRAYS = ("t2m", "z")


@dataclass(frozen=True)
class DatasetSpec:
    """One synthetic ERA5-like layout (arguments of ``make_era5_like``)."""

    name: str
    n_time: int
    n_lat: int
    n_lon: int
    n_level: int
    samples_per_chunk: int
    inner_chunks: tuple[int, int] | None = None
    shard_samples: int | None = None
    compressor: str = "zstd"

    @property
    def folder(self) -> str:
        """A folder name that changes whenever the layout does."""
        parts = [
            f"era5_t{self.n_time}_{self.n_lat}x{self.n_lon}_l{self.n_level}",
            f"spc{self.samples_per_chunk}",
        ]
        if self.inner_chunks:
            parts.append(f"tile{self.inner_chunks[0]}x{self.inner_chunks[1]}")
        if self.shard_samples:
            parts.append(f"shard{self.shard_samples}")
        parts.append(self.compressor)
        return "_".join(parts) + ".zarr"

    @property
    def anchor_spc(self) -> int:
        """Samples per *stored object* along time (the shard length when sharded)."""
        return self.shard_samples or self.samples_per_chunk

    @property
    def sample_nbytes(self) -> int:
        """Decoded bytes of one sample, both variables (float32)."""
        return 4 * self.n_lat * self.n_lon * (1 + self.n_level)

    @property
    def layout(self) -> str:
        """A short human description of the layout."""
        text = f"{self.samples_per_chunk} samples/chunk"
        if self.inner_chunks:
            text += f", {self.inner_chunks[0]}x{self.inner_chunks[1]} tiles"
        if self.shard_samples:
            text += f", shards of {self.shard_samples} samples"
        return text

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["inner_chunks"] = list(self.inner_chunks) if self.inner_chunks else None
        return out

    def layout_json(self) -> dict[str, Any]:
        """:meth:`to_json` without the name: what decides whether a written folder is reusable."""
        return {k: v for k, v in self.to_json().items() if k != "name"}


def _era5_grid(n_time: int, n_lat: int, n_lon: int) -> list[DatasetSpec]:
    tile = (math.ceil(n_lat / 2), math.ceil(n_lon / 2))

    def spec(
        name: str, spc: int, tiles: tuple[int, int] | None = None, shard: int | None = None
    ) -> DatasetSpec:
        return DatasetSpec(name, n_time, n_lat, n_lon, 4, spc, tiles, shard)

    return [
        spec("spc1", 1),
        spec("spc4", 4),
        spec("spc16", 16),
        spec("spc32", 32),
        spec("spc16-tiled", 16, tiles=tile),
        spec("sharded", 4, shard=32),
    ]


REFERENCE = DatasetSpec("reference", 2048, 181, 360, 4, samples_per_chunk=16)
"""The design's reference shape (issue 13): 4.2 MB (t2m) and 16.7 MB (z) decoded chunks."""

SUITES: dict[str, list[DatasetSpec]] = {
    "full": [REFERENCE, *_era5_grid(512, 91, 180)],
    "smoke": [DatasetSpec("smoke-spc8", 64, 16, 32, 4, samples_per_chunk=8)],
}
"""The datasets of each suite (names are unique within a suite)."""


def ensure_dataset(spec: DatasetSpec, root: Path) -> tuple[Path, bool]:
    """The dataset's folder under ``root``, written first if missing. Returns (path, written)."""
    from insitubatch_nodes.synthetic import make_era5_like

    def write(tmp: Path) -> None:
        make_era5_like(
            tmp,
            n_time=spec.n_time,
            n_lat=spec.n_lat,
            n_lon=spec.n_lon,
            n_level=spec.n_level,
            samples_per_chunk=spec.samples_per_chunk,
            inner_chunks=spec.inner_chunks,
            shard_samples=spec.shard_samples,
            compressor=spec.compressor,
        )

    return ensure_written(root, spec.folder, spec.to_json(), write)


def ensure_written(
    root: Path, folder: str, spec_json: dict[str, Any], write: Callable[[Path], None]
) -> tuple[Path, bool]:
    """``root / folder``, written by ``write(tmp_folder)`` first unless the marker next to it
    (``FOLDER.bench-spec.json``) holds ``spec_json`` (its ``name`` aside). The folder is written
    under a temporary name and renamed when complete; then the marker is written. Returns
    (path, written). Shared by every suite's datasets (``benchmarks/archive.py`` too)."""
    path = root / folder
    marker = root / (folder + MARKER)  # next to the group: zarr lists the group's keys
    layout = {k: v for k, v in spec_json.items() if k != "name"}
    if marker.is_file() and path.is_dir():
        written = {k: v for k, v in json.loads(marker.read_text()).items() if k != "name"}
        if written == layout:
            return path, False
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    marker.unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    marker.write_text(json.dumps(spec_json))
    return path, True


def chunk_sizes(path: Path) -> dict[str, dict[int, int]]:
    """Stored bytes per (data array, time index of the stored object), summed over tiles and
    levels, from the files zarr wrote (v3 default keys ``ARRAY/c/T/...``)."""
    out: dict[str, dict[int, int]] = {}
    for name in DATA_ARRAYS:
        sizes: dict[int, int] = {}
        base = path / name / "c"
        for file in base.rglob("*"):
            if file.is_file():
                t = int(file.relative_to(base).parts[0])
                sizes[t] = sizes.get(t, 0) + file.stat().st_size
        out[name] = sizes
    return out


def object_keys(path: Path) -> list[tuple[str, int]]:
    """Every stored chunk object of the data arrays: (key relative to the group, size)."""
    keys = []
    for name in DATA_ARRAYS:
        for file in sorted((path / name / "c").rglob("*")):
            if file.is_file():
                keys.append((file.relative_to(path).as_posix(), file.stat().st_size))
    return keys


def needed_bytes(sizes: dict[str, dict[int, int]], samples: Iterable[int], anchor_spc: int) -> int:
    """Stored bytes of the distinct objects that ``samples`` live in (both arrays)."""
    chunks = {int(s) // anchor_spc for s in samples}
    return sum(per.get(c, 0) for per in sizes.values() for c in chunks)
