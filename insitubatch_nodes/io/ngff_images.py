"""OME-NGFF multiscale images that are not a plate's fields — the series of a bioformats2raw
conversion (``0/``, ``1/``, ... beside ``OME/METADATA.ome.xml``), one image at a store's root
(a whole slide), or image groups named by hand — read as one collection: :func:`open_images`.

Each image is read as :func:`~insitubatch_nodes.io.ngff.read_plate` reads a field (its
``multiscales`` and a level by index or pixel size, its labels at the level of the same pixel
sizes, its ``omero`` channel names), by name and all at once, never by listing the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from insitubatch_nodes.io.cf import decoded_dtype_option
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.ngff import Plate, fields_collection
from insitubatch_nodes.io.ngff_fields import (
    check_labels,
    check_level,
    group_attributes,
    ngff_attributes,
    read_fields,
    read_json_documents,
)
from insitubatch_nodes.io.stores import StoreLike, as_store

__all__ = ["image_groups", "open_images", "read_images"]

_PROBE = 64  # series groups looked for at once where the layout does not list them


def image_groups(store: StoreLike) -> tuple[list[str], int]:
    """The multiscale image groups of ``store`` and its zarr format: ``[""]`` where the root is
    an image; the series of a bioformats2raw conversion (the root's ``bioformats2raw.layout``)
    as ``OME``'s ``series`` lists them, or else ``0``, ``1``, ... up to the first absent one.
    ``ValueError`` saying what to open otherwise (a plate: ``open_plate``)."""
    store = as_store(store)
    v3, v2 = read_json_documents(store, ["zarr.json", ".zattrs"])
    zarr_format = 3 if v3 is not None else 2
    attrs = ngff_attributes(v3 if v3 is not None else v2, zarr_format) or {}
    if "multiscales" in attrs:
        return [""], zarr_format
    if "plate" in attrs:
        raise ValueError("the store is an OME-NGFF HCS plate: open its fields with open_plate")
    if "bioformats2raw.layout" not in attrs:
        raise ValueError(
            "the store's root group is neither a multiscale image nor a bioformats2raw "
            "conversion (no 'multiscales', no 'bioformats2raw.layout'): name the image groups, "
            "open_images(store, ['image_a', 'image_b'])"
        )
    (ome,) = group_attributes(store, ["OME"], zarr_format)
    listed = (ome or {}).get("series")
    if isinstance(listed, list) and listed:
        return [str(s) for s in listed], zarr_format
    found: list[str] = []
    while True:  # series 0, 1, ... until one is absent (the layout's rule without a list)
        batch = [str(len(found) + k) for k in range(_PROBE)]
        present = group_attributes(store, batch, zarr_format)
        for name, a in zip(batch, present, strict=True):
            if a is None:
                return found, zarr_format
            found.append(name)


def read_images(
    store: StoreLike,
    groups: Sequence[str] | None = None,
    *,
    level: int | float | Mapping[str, float] = 0,
    labels: str | Sequence[str] | None = None,
) -> Plate:
    """The metadata of the multiscale images ``groups`` of ``store`` (default:
    :func:`image_groups`), as a :class:`~insitubatch_nodes.io.ngff.Plate` without wells:
    ``fields`` holds one :class:`~insitubatch_nodes.io.ngff.PlateField` per image (its
    ``path`` the group, ``well``/``row``/``column`` empty), each at the level ``level`` picks,
    with the labels ``labels`` (both as :func:`~insitubatch_nodes.io.ngff.read_plate` takes
    them). An image group that is absent, or named twice, raises ``ValueError`` naming it;
    images with other axes too."""
    chosen, wanted = check_level(level), check_labels(labels)
    store = as_store(store)
    if groups is None:
        paths, zarr_format = image_groups(store)
    else:
        if isinstance(groups, str) or not groups:
            raise TypeError(f"groups must be a non-empty list of group paths, got {groups!r}")
        paths = [str(g).strip("/") for g in groups]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise ValueError(
                f"groups name {twice[:5]} more than once: name each image group once (the "
                "collection's members are named by their groups)"
            )
        zarr_format = 3 if read_json_documents(store, ["zarr.json"])[0] is not None else 2
    if not paths:
        raise ValueError("the bioformats2raw conversion holds no series (no group '0')")
    about = [("", p, None) for p in paths]
    found = read_fields(store, paths, about, zarr_format, chosen, wanted, what="image")
    if found.absent:
        raise ValueError(f"image groups {list(found.absent)[:5]} are absent from the store")
    return Plate(
        version="0.5" if zarr_format == 3 else "0.4", zarr_format=zarr_format, name=None,
        rows=(), columns=(), wells=(), fields=found.fields, axes=found.axes, units=found.units,
        label_names=found.label_names, label_axes=found.label_axes, channels=found.channels,
        channel_axis=found.channel_axis,
    )  # fmt: skip


def open_images(
    store: StoreLike,
    groups: Sequence[str] | None = None,
    *,
    level: int | float | Mapping[str, float] = 0,
    labels: str | Sequence[str] | None = None,
    sample_axis: int | str | tuple[int | str, ...] = "z",
    mask_and_scale: bool = True,
    cf_dtype: Any = None,
) -> Collection:
    """OME-NGFF multiscale images as one :class:`~insitubatch_nodes.io.collection.Collection`:
    one member per image (named by its group: ``"0"``, ``"1"`` for a bioformats2raw
    conversion's series, ``""`` for an image at the root), variables ``"image"`` and
    ``"labels/<name>"``, views named by the NGFF axes and the channels by their ``omero`` names
    (``sel(c="GFP")``), exactly as :func:`~insitubatch_nodes.io.ngff.open_plate` makes a
    plate's fields (``level``, ``labels``, ``sample_axis``, ``mask_and_scale`` and
    ``cf_dtype`` as it takes them; ``sample_axis=()``: each whole image one sample, to patch).
    ``groups`` as :func:`read_images` takes them. The images must share one schema (dtype,
    shape apart from the sample axis, chunks): ``ValueError`` naming the image otherwise — a
    conversion whose series differ (a slide's macro image beside its scan) is opened with the
    ``groups`` that match. ``split_by_member`` splits by image (by name)."""
    cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
    store = as_store(store)
    images = read_images(store, groups, level=level, labels=labels)
    return fields_collection(store, images, {}, level, sample_axis,
                             mask_and_scale=mask_and_scale, cf_dtype=cf_dtype)  # fmt: skip
