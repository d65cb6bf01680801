"""OME-NGFF high-content-screening plates: written with ome-zarr-py, microscopy-like fields
with their labels (:func:`make_hcs_plate`), or the metadata of a large plate and no chunk
(:func:`make_plate_metadata_only`); :func:`plate_row_names` names a plate's rows."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from insitubatch_nodes.synthetic._common import (
    _STREAM_PLATE,
    _check_seed,
    _positive_int,
    _positive_tuple,
)
from insitubatch_nodes.synthetic.microscopy import _Blobs

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
    acquisitions: int | None = None,
    channel_names: Sequence[str] | None = None,
) -> str:
    """Write an OME-NGFF high-content-screening plate with ome-zarr-py's writer and return its
    path: plate, well and image metadata (NGFF 0.4 on zarr v2, or 0.5 on zarr v3) as
    ome-zarr-py writes them, every field a microscopy-like image with its label images.

    * Wells: every ``rows x columns`` well (rows ``A``, ``B``, ..., columns ``1``, ``2``, ...),
      or the ``"A/1"``-style paths in ``wells`` (a *sparse* plate). Each lists ``fields``
      images ``"0"``, ``"1"``, ...; field ``f`` of well ``R/C`` is the group ``R/C/f``.
    * ``absent_wells`` are listed in the plate metadata but never written (no group): a plate
      whose acquisition lost wells (the rest of ``wells``, or of the grid; a well named in both
      is a ``ValueError``).
    * ``acquisitions=n`` lists acquisitions ``0..n-1`` in the plate metadata and has field
      ``f`` of every well name acquisition ``f % n`` in its well's metadata (each acquisition
      imaged every well again); ``None`` (the default) lists none, as a plate of one
      acquisition may.
    * Each field is a ``(T, C, Z, Y, X)`` uint16 image of ``levels`` resolution levels (Y and X
      halved per level, pixel sizes ``pixel_size * 2**level`` micrometers in Y and X,
      ``z_spacing`` in Z), one Z plane per chunk. Each name in ``labels`` is a uint8 label
      image ``(T, 1, Z, Y, X)`` of ellipsoidal blobs (ids ``1..k``, 0 = background), exactly
      the voxels where the image carries blob signal (as in :func:`make_microscopy_like`).
    * ``channel_names`` (one per channel, ``C`` of them) are written as the images' ``omero``
      channel labels, as acquisition software names them (``"DAPI"``, ``"GFP"``); ``None``
      (the default) writes no ``omero`` metadata.

    Deterministic: a field's content depends only on ``seed``, its well's position in the
    rows x columns grid, its field index and ``shape``. Needs ome-zarr-py (``pip install
    ome-zarr``, in the ``dev`` extra). The folder must not exist or be empty.
    """
    fmt = _ngff_format(ngff_version)
    import dask  # (ome-zarr-py's own dependency)
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
    n_acq = None if acquisitions is None else _positive_int("acquisitions", acquisitions)
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{str(target)!r} already exists and is not an empty folder")
    row_names = plate_row_names(n_rows)
    col_names = [str(c + 1) for c in range(n_cols)]
    grid = [f"{r}/{c}" for r in row_names for c in col_names]
    absent = [str(w) for w in absent_wells]
    present = [w for w in grid if w not in absent] if wells is None else [str(w) for w in wells]
    both = sorted(set(present) & set(absent))
    if both:
        raise ValueError(f"wells {both} are both in wells and absent_wells: name each in one")
    unknown = [w for w in (*present, *absent) if w not in grid]
    if unknown:
        raise ValueError(f"wells {unknown} are not on the {n_rows} x {n_cols} plate")
    listed = [w for w in grid if w in set(present) | set(absent)]

    n_t, n_c, n_z, n_y, n_x = full
    if channel_names is not None and (isinstance(channel_names, str) or len(channel_names) != n_c):
        raise ValueError(f"channel_names must name the {n_c} channels, got {channel_names!r}")
    chunks = (1, n_c, 1, n_y, n_x)
    scale = {"z": float(z_spacing), "y": float(pixel_size), "x": float(pixel_size)}
    units = {a: "micrometer" for a in ("z", "y", "x")}
    factors = [{"y": 2**k, "x": 2**k} for k in range(1, n_levels)]
    root = zarr.open_group(str(target), mode="w", zarr_format=fmt.zarr_format)
    runs = None if n_acq is None else [{"id": a, "name": f"run {a}"} for a in range(n_acq)]
    write_plate_metadata(
        root, row_names, col_names, listed, fmt=fmt, field_count=n_fields, name="synthetic",
        acquisitions=runs,
    )  # fmt: skip
    images: list[str | dict[str, Any]] = [str(f) for f in range(n_fields)]
    if n_acq is not None:
        images = [{"path": str(f), "acquisition": f % n_acq} for f in range(n_fields)]
    # ome-zarr-py writes each field's levels as dask graphs: on images of a few MB dask's
    # thread pool costs more than it runs (a default plate: 2.7-3.3 -> 2.3-2.5 CPU-s written
    # synchronously, 2026-12-07); each field is one small graph, run on this thread
    with warnings.catch_warnings(), dask.config.set(scheduler="synchronous"):
        # ome-zarr-py warns that t and c get a scale of 1.0: that is what we mean
        warnings.simplefilter("ignore", UserWarning)
        for well in present:
            row, col = well.split("/")
            group = root.require_group(row).require_group(col)
            write_well_metadata(group, images, fmt=fmt)
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
                if channel_names is not None:
                    write_omero(field, channel_names)
                for name in labels:
                    write_labels(
                        label, field, name=name, scaler=None, scale_factors=factors, fmt=fmt,
                        axes="tczyx", storage_options={"chunks": (1, 1, 1, n_y, n_x)},
                        scale=scale, axes_units=units,
                    )  # fmt: skip
    return str(target)


def write_omero(
    image: zarr.Group, names: Sequence[str], window: tuple[int, int] = (0, 65535)
) -> None:
    """Add an ``omero`` block naming the channels ``names`` (``omero.channels[].label``, each
    with a display ``window`` of ``(start, end)``) to the NGFF attributes of the multiscale
    ``image`` group: under ``"ome"`` where the group keeps its NGFF metadata there (0.5), else
    beside ``multiscales`` (0.4), as acquisition software and bioformats2raw write it.
    (ome-zarr-py's ``write_image(..., omero=dict)`` does this up to 0.18; 0.21 takes only its
    own ``Omero`` objects there.)"""
    lo, hi = window
    omero: dict[str, Any] = {
        "channels": [
            {"label": str(n), "color": "FFFFFF", "active": True,
             "window": {"min": 0, "max": 65535, "start": lo, "end": hi}}
            for n in names
        ]
    }  # fmt: skip
    attrs: dict[str, Any] = dict(image.attrs.asdict())
    ome = attrs.get("ome")
    if isinstance(ome, dict):
        image.attrs.update({"ome": {**ome, "omero": omero}})
    else:
        image.attrs.update({"omero": omero})


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
