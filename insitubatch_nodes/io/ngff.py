"""OME-NGFF high-content-screening plates: :func:`read_plate` reads a plate's metadata into a
:class:`Plate`, :func:`open_plate` opens its fields as one collection.

A plate (NGFF 0.4 on zarr v2: ``.zattrs``; NGFF 0.5 on zarr v3: ``zarr.json`` attributes under
``"ome"``) is a group whose ``plate`` metadata lists its rows, columns and wells; each well's
``well`` metadata lists its fields (images); each field is a multiscale image whose
``multiscales`` metadata names one array per resolution level, with its pixel sizes
(``coordinateTransformations``), and whose ``labels`` group names its label images, each a
multiscale image of its own. Every document is read by name (GETs, never a listing), all wells
at once, then all fields at once, on zarr's IO loop.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from insitubatch_nodes.io.cf import decoded_dtype_option
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.ngff_fields import (
    NGFF_VERSIONS,
    PlateField,
    check_labels,
    check_level,
    group_attributes,
    metadata_key,
    ngff_attributes,
    read_fields,
    read_json_documents,
)
from insitubatch_nodes.io.omero import (
    channel_coords,
)
from insitubatch_nodes.io.stores import StoreLike, as_store

__all__ = ["NGFF_VERSIONS", "Plate", "PlateField", "open_plate", "read_plate"]


@dataclass(frozen=True)
class Plate:
    """What :func:`read_plate` read: the plate's layout and each present field.

    ``rows``/``columns`` are the plate's names for them, ``wells`` the paths (``"A/1"``) of the
    wells whose group exists, in the plate's order. A sparse plate lists only some of its
    rows x columns; a well listed whose group is absent is skipped and named in
    ``absent_wells`` (a field listed by its well but absent: ``absent_fields``), with one
    ``UserWarning``. ``axes`` and ``units`` are the images' axes (every field has the same);
    ``label_names`` the label images read for every field, ``label_axes`` each one's axes.
    ``channels`` are the names of the channels along ``channel_axis`` (the axis of type
    ``"channel"``) that every field's ``omero`` metadata gives alike, none twice; ``None``
    where a field gives none or they differ (``PlateField.channels``: each field's own).
    """

    version: str
    zarr_format: int
    name: str | None
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    wells: tuple[str, ...]
    fields: tuple[PlateField, ...]
    axes: tuple[str, ...]
    units: Mapping[str, str | None]
    label_names: tuple[str, ...] = ()
    label_axes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    absent_wells: tuple[str, ...] = ()
    absent_fields: tuple[str, ...] = ()
    channels: tuple[str, ...] | None = None
    channel_axis: str | None = None

    def describe(self) -> str:
        """A few lines: version, wells and fields, the level chosen and its pixel sizes."""
        levels: dict[tuple[int, tuple[tuple[str, float], ...]], int] = {}
        for f in self.fields:
            key = (f.level, tuple(f.pixel_size.items()))
            levels[key] = levels.get(key, 0) + 1
        lines = [
            f"NGFF {self.version} plate {self.name or ''!r} (zarr v{self.zarr_format}): "
            f"{len(self.rows)} rows x {len(self.columns)} columns, {len(self.wells)} wells, "
            f"{len(self.fields)} fields, axes {''.join(self.axes)}"
        ]
        if not self.rows and not self.wells:  # read_images: multiscale images, not a plate
            groups = ", ".join(repr(f.path) for f in self.fields[:5])
            more = f", ... ({len(self.fields)})" if len(self.fields) > 5 else ""
            lines = [
                f"NGFF {self.version} multiscale images (zarr v{self.zarr_format}): "
                f"{groups}{more}, axes {''.join(self.axes)}"
            ]
        for (level, sizes), n in levels.items():
            shown = ", ".join(f"{a} {s:g} {self.units.get(a) or ''}".rstrip() for a, s in sizes)
            lines.append(f"level {level} in {n} field(s): pixel size {shown}")
        if self.channels:
            lines.append(f"channels ({self.channel_axis}): {', '.join(self.channels)}")
        if self.label_names:
            lines.append(f"labels: {', '.join(self.label_names)}")
        if self.absent_wells or self.absent_fields:
            lines.append(
                f"absent (listed, no group): wells {list(self.absent_wells)}, "
                f"fields {list(self.absent_fields)}"
            )
        return "\n".join(lines)


def _plate_metadata(store: Any) -> tuple[dict[str, Any], str, int]:
    v3, v2 = read_json_documents(store, ["zarr.json", ".zattrs"])
    zarr_format = 3 if v3 is not None else 2
    attrs = ngff_attributes(v3 if v3 is not None else v2, zarr_format)
    plate = (attrs or {}).get("plate")
    if not isinstance(plate, dict):
        raise ValueError(
            "the store's root group has no 'plate' metadata: it is not an OME-NGFF HCS plate "
            "(open multiscale images, or a bioformats2raw conversion's series, with open_images)"
        )
    version = str((attrs or {}).get("version") or plate.get("version") or "")
    if not version:
        version = "0.5" if zarr_format == 3 else "0.4"
    if version not in NGFF_VERSIONS:
        raise ValueError(
            f"the plate's NGFF version is {version}; read_plate reads {', '.join(NGFF_VERSIONS)}"
        )
    return plate, version, zarr_format


def _names(plate: Mapping[str, Any], key: str) -> tuple[str, ...]:
    return tuple(str(x["name"]) for x in plate.get(key, ()) if isinstance(x, dict))


def read_plate(
    store: StoreLike,
    *,
    level: int | float | Mapping[str, float] = 0,
    labels: str | Sequence[str] | None = None,
) -> Plate:
    """Read an OME-NGFF HCS plate's metadata (NGFF 0.4 or 0.5) at the root of ``store``.

    ``store`` is a URL, a path or a zarr ``Store``. The plate's wells are read all at once,
    then all their fields at once (then their label groups and label images), as concurrent
    GETs on zarr's IO loop; no array metadata and no chunk is read (:func:`open_plate` reads
    the arrays').

    ``level`` picks one resolution level per field: an index into its ``multiscales``
    datasets (``0``: full resolution, ``-1``: the coarsest), or a physical pixel size — a
    number is the size along ``y`` and ``x``, a mapping names axes (``{"x": 0.65}``,
    ``{"z": 2.0, "x": 1.3}``) — matched within a relative 1e-4 in the axes' own units; the
    finest matching level is taken and ``PlateField.level`` / :meth:`Plate.describe` say which.
    A size no level of a field has raises ``ValueError`` naming the field and its levels' sizes.

    ``labels``: ``None`` (no label images), ``"all"`` (every label the fields' ``labels``
    groups name: every field must name the same), or a list of label names (every field must
    have each). A label's level is the one whose pixel sizes equal the chosen image level's
    (label images may have other levels); none raises ``ValueError``. One whose translation
    puts its pixels half a pixel or more off the image level's is read with one
    ``UserWarning`` per label name (a patch of both takes one pixel origin: it pairs pixels
    of one index, not of one place).

    A well the plate lists but whose group is absent, and a field its well lists but absent,
    are skipped, named in ``Plate.absent_wells`` / ``absent_fields``, and warned about once
    (``UserWarning``). A plate with no field at all, metadata that is not NGFF, another NGFF
    version, or fields with different axes raise ``ValueError`` naming the group.
    """
    chosen = check_level(level)
    wanted_labels = check_labels(labels)
    store = as_store(store)
    plate, version, zarr_format = _plate_metadata(store)
    listed = [str(w["path"]) for w in plate.get("wells", ()) if isinstance(w, dict)]
    _refuse_twice(listed, "the plate's 'wells'")
    well_attrs = group_attributes(store, listed, zarr_format)
    wells: list[str] = []
    absent_wells: list[str] = []
    images: list[tuple[str, str, int | None]] = []  # (well, image path, acquisition)
    for path, attrs in zip(listed, well_attrs, strict=True):
        if attrs is None:
            absent_wells.append(path)
            continue
        well = attrs.get("well")
        if not isinstance(well, dict) or not isinstance(well.get("images"), list):
            raise ValueError(f"well group {path!r} has no 'well' metadata listing its images")
        wells.append(path)
        _refuse_twice([str(i["path"]) for i in well["images"]], f"well {path!r}'s 'images'")
        for image in well["images"]:
            acq = image.get("acquisition")
            name = str(image["path"])
            where = f"well {path!r}'s image {name!r}"
            images.append((path, name, None if acq is None else _acquisition_id(acq, where)))
    field_paths = [f"{w}/{p}" for w, p, _ in images]
    found = read_fields(store, field_paths, images, zarr_format, chosen, wanted_labels)
    absent_fields = list(found.absent)
    if not found.fields:
        raise ValueError(f"the plate lists {len(listed)} wells, but no field of them exists")
    if absent_wells or absent_fields:
        warnings.warn(
            f"the plate lists {len(absent_wells)} well(s) and {len(absent_fields)} field(s) "
            f"whose group is absent: skipped (Plate.absent_wells: {absent_wells[:5]}, "
            f"Plate.absent_fields: {absent_fields[:5]})",
            UserWarning,
            stacklevel=2,
        )
    return Plate(
        version=version, zarr_format=zarr_format,
        name=None if plate.get("name") is None else str(plate["name"]),
        rows=_names(plate, "rows"), columns=_names(plate, "columns"), wells=tuple(wells),
        fields=found.fields, axes=found.axes, units=found.units,
        label_names=found.label_names, label_axes=found.label_axes,
        absent_wells=tuple(absent_wells), absent_fields=tuple(absent_fields),
        channels=found.channels, channel_axis=found.channel_axis,
    )  # fmt: skip


def _acquisition_id(value: Any, where: str) -> int:
    """An image's ``acquisition`` (OME-NGFF: the integer id of one of the plate's
    acquisitions) as an int; ``ValueError`` naming the image for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        value = repr(value)
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{where} names acquisition {value!r}, not the integer id of one of the plate's "
            "acquisitions (OME-NGFF): correct the well's metadata, or rewrite the plate"
        ) from None


def _refuse_twice(paths: Sequence[str], where: str) -> None:
    """Refuse metadata that lists a path twice (a field would be two members of one name)."""
    twice = sorted(p for p, n in Counter(paths).items() if n > 1)
    if twice:
        raise ValueError(
            f"{where} list {twice[:5]} more than once: each well (each field of a well) must be "
            "listed once; fix the plate's metadata"
        )


def open_plate(
    store: StoreLike,
    *,
    level: int | float | Mapping[str, float] = 0,
    labels: str | Sequence[str] | None = None,
    sample_axis: int | str | tuple[int | str, ...] = "z",
    mask_and_scale: bool = True,
    cf_dtype: Any = None,
) -> Collection:
    """An OME-NGFF HCS plate as one :class:`~insitubatch_nodes.io.collection.Collection`:
    one member per field (named by its group, ``"A/1/0"``), variables ``"image"`` and
    ``"labels/<name>"`` for each label read (``level`` and ``labels`` as in
    :func:`read_plate`), and the member keys ``row``, ``column``, ``well`` (``"A/1"``) and
    ``field`` (the image's path in its well, ``"0"``) that ``split_by_member(..., by="well")``
    splits on — and ``acquisition`` (the int id each field's well metadata names) where every
    field names one, for ``split_by_member(..., by="acquisition")`` (a plate where only some
    fields name one gets no such key, with a ``UserWarning``).

    The views' axes are named as the NGFF metadata names them (``plate.axes``, and
    ``plate.label_axes[name]`` for each label image), on NGFF 0.4 (zarr v2 arrays, which name
    none) as on 0.5: ``coll["image"].dims`` is ``("c", "z", "y", "x")``, so ``isel(c=0)``,
    ``sel`` and ``patches({"y": 256, "x": 256})`` take names. The NGFF metadata is the
    authority: where a 0.5 array's ``dimension_names`` differ from it, its names are taken.

    ``sample_axis`` is an axis name of the plate's images (``"z"``: one Z plane per sample) or
    an index, or a tuple of them: product sample axes (``("t", "z")``: every (t, z) plane of
    every field is a sample, :mod:`~insitubatch_nodes.io.product`). A name is found in each
    label image's own axes (a ``zyx`` label beside a ``czyx`` image), which must have it; an
    index must name the same axis in the images and the labels (``ValueError`` otherwise,
    naming both). Every field must keep its chosen level at the same path within its group
    (the collection names one path per variable); the arrays' own metadata is read by
    ``Collection.from_groups``, concurrently, which also checks that the fields share one
    schema (dtypes and field shapes).

    ``mask_and_scale`` and ``cf_dtype`` say how the images and labels decode, as
    :class:`~insitubatch_nodes.io.collection.Collection` takes them (checked here, before the
    plate is read): CF attributes (``scale_factor``, ``_FillValue``) of a converted plate
    decoded, in xarray's dtype or ``cf_dtype``, by default; ``mask_and_scale=False``: as
    stored. NGFF images without CF attributes are delivered as stored either way.
    """
    cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
    store = as_store(store)
    plate = read_plate(store, level=level, labels=labels)
    return fields_collection(store, plate, _member_keys(plate), level, sample_axis,
                             mask_and_scale=mask_and_scale, cf_dtype=cf_dtype)  # fmt: skip


def fields_collection(
    store: Any,
    plate: Plate,
    keys: Mapping[str, Sequence[Any]],
    level: Any,
    sample_axis: int | str | tuple[int | str, ...],
    *,
    mask_and_scale: bool,
    cf_dtype: Any,
) -> Collection:
    """``plate.fields`` (multiscale images read at ``level``) as one collection, each named by
    its group, with member keys ``keys``: variables ``"image"`` and ``"labels/<name>"``, named
    by the NGFF axes, the channel names as the image's channel coordinate (:func:`open_plate`
    says the rest)."""
    if isinstance(sample_axis, tuple | list):
        axis: int | str | tuple[int | str, ...] = tuple(_sample_axis(plate, a) for a in sample_axis)
    else:
        axis = _sample_axis(plate, sample_axis)
    first = plate.fields[0]
    head = len(first.path) + 1 if first.path else 0  # (an image at the store's root: "")
    variables = {"image": first.image[head:]}
    dims = {"image": plate.axes}  # the NGFF axes name the views' dimensions (0.4 arrays: none)
    for name in plate.label_names:
        variables[f"labels/{name}"] = first.labels[name][head:]
        dims[f"labels/{name}"] = plate.label_axes[name]
    for f in plate.fields:
        own = {"image": f.image, **{f"labels/{n}": p for n, p in f.labels.items()}}
        for var, rel in variables.items():
            if own[var] != metadata_key(f.path, rel):
                raise ValueError(
                    f"level={level!r}: {f.path!r} keeps {var!r} at {own[var]!r}, "
                    f"{first.path!r} at {metadata_key(first.path, rel)!r} (their pyramids differ): "
                    "a collection needs one path per variable within each image's group; pick "
                    "a level every image keeps at the same path (an index below the fewest "
                    "levels, such as level=0, or a pixel size), or open the images with "
                    "Collection.from_groups"
                )
    return Collection.from_groups(
        store,
        [f.path for f in plate.fields],
        variables,
        names=[f.path for f in plate.fields],
        keys=keys,
        sample_axis=axis,
        mask_and_scale=mask_and_scale,
        cf_dtype=cf_dtype,
        dims=dims,
        coords=channel_coords(plate.channels, plate.channel_axis),
    )


def _member_keys(plate: Plate) -> dict[str, list[Any]]:
    """The collection's member keys of ``plate``'s fields: ``row``, ``column``, ``well``,
    ``field``, and ``acquisition`` where every field's well metadata names one (one that names
    it for some fields only gets none, with a ``UserWarning`` naming a field without one)."""
    keys: dict[str, list[Any]] = {
        "row": [f.row for f in plate.fields],
        "column": [f.column for f in plate.fields],
        "well": [f.well for f in plate.fields],
        "field": [f.name for f in plate.fields],
    }
    unnamed = [f.path for f in plate.fields if f.acquisition is None]
    if not unnamed:
        keys["acquisition"] = [f.acquisition for f in plate.fields]
    elif len(unnamed) < len(plate.fields):
        warnings.warn(
            f"{len(unnamed)} of the plate's {len(plate.fields)} fields (first {unnamed[0]!r}) "
            "have no acquisition id in their well's metadata, the others have one: the "
            "collection gets no 'acquisition' key, so split_by_member(..., by='acquisition') "
            "is refused; name every field's acquisition (the well metadata's images[].acquisition)",
            UserWarning,
            stacklevel=3,
        )
    return keys


def _sample_axis(plate: Plate, sample_axis: int | str) -> int | str:
    """``sample_axis`` checked: a name of the images' axes that every label image has too
    (each finds it among its own axes), or an index naming the same axis in every label."""
    if isinstance(sample_axis, bool) or not isinstance(sample_axis, (int, str)):
        raise TypeError(f"sample_axis must be an axis name or an index, got {sample_axis!r}")
    n = len(plate.axes)
    if isinstance(sample_axis, str):
        if sample_axis not in plate.axes:
            raise ValueError(
                f"sample_axis={sample_axis!r} is not an axis of the plate's images "
                f"{list(plate.axes)}: name one, or sample_axis=() for each whole image one sample"
            )
        for name, axes in plate.label_axes.items():
            if sample_axis not in axes:
                raise ValueError(
                    f"label {name!r} has axes {list(axes)}, without the sample axis "
                    f"{sample_axis!r} of the images {list(plate.axes)}: read the labels "
                    "that have it (labels=[...])"
                )
        return sample_axis
    if not -n <= sample_axis < n:
        raise ValueError(f"sample_axis={sample_axis} is out of range for axes {list(plate.axes)}")
    axis = sample_axis % n
    for name, axes in plate.label_axes.items():
        if len(axes) <= axis or axes[axis] != plate.axes[axis]:
            raise ValueError(
                f"label {name!r} has axes {list(axes)}, the images {list(plate.axes)}: the "
                f"sample axis {plate.axes[axis]!r} must sit at the same index in both (or "
                f"name it: sample_axis={plate.axes[axis]!r})"
            )
    return axis
