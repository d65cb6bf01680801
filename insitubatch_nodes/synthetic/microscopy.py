"""The light-microscopy-like store: a ``(T, C, Z, Y, X)`` image and the label mask of its
drifting ellipsoidal blobs (:func:`make_microscopy_like`); the blobs serve the HCS plates too."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import zarr

from insitubatch_nodes.synthetic._common import (
    _STREAM_IMAGE,
    StoreArg,
    _block_len,
    _check_format,
    _check_seed,
    _compressors,
    _create,
    _noise_rng,
    _open_new_group,
    _positive_tuple,
)


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
