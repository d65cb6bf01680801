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

import json
import math
import numbers
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from insitubatch_nodes.io.cf import decoded_dtype_option
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.objects import read_documents
from insitubatch_nodes.io.omero import (
    channel_axis,
    channel_coords,
    channel_names,
    common_channels,
)
from insitubatch_nodes.io.stores import StoreLike, as_store

__all__ = ["NGFF_VERSIONS", "Plate", "PlateField", "open_plate", "read_plate"]

NGFF_VERSIONS: tuple[str, ...] = ("0.4", "0.5")
"""The NGFF metadata versions :func:`read_plate` reads (0.4: zarr v2, 0.5: zarr v3)."""

_SIZE_RTOL = 1e-4  # a pixel size asked for matches a level's within this relative tolerance
_IN_FLIGHT = 64  # metadata documents read at once
_PLANE_AXES = ("y", "x")  # what a pixel size given as one number applies to


@dataclass(frozen=True)
class PlateField:
    """One field (one multiscale image) of a plate, at the level :func:`read_plate` chose.

    ``path`` is its group (``"A/1/0"``: well ``"A/1"``, image ``"0"`` of that well);
    ``image`` the array path of the chosen level (``"A/1/0/s0"``) and ``level`` its index in
    the field's ``multiscales`` datasets; ``labels`` maps each label name read to the array
    path of the label level with the same pixel sizes; ``pixel_size`` is the chosen level's
    size along every axis, in the axis' unit (the dataset's ``scale`` times the multiscale's
    own, if any); ``acquisition`` the well metadata's acquisition id, if any; ``channels`` the
    names its ``omero`` metadata gives the channels (``None``: none).
    """

    path: str
    well: str
    row: str
    column: str
    name: str
    image: str
    level: int
    pixel_size: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)
    acquisition: int | None = None
    channels: tuple[str, ...] | None = None


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


# -- reading documents ---


def _read_documents(store: Any, keys: Sequence[str]) -> list[Any]:
    """The JSON document at each of ``keys`` (``None`` where there is none), read at once by
    :func:`~insitubatch_nodes.io.objects.read_documents` (concurrently, or straight from the
    files of a local folder)."""
    docs: list[Any] = []
    for key, raw in zip(keys, read_documents(store, keys, _IN_FLIGHT), strict=True):
        try:
            docs.append(None if raw is None else json.loads(raw))
        except ValueError as exc:
            raise ValueError(f"{key!r} is not valid JSON ({exc})") from None
    return docs


def _key(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _attributes(doc: Any, zarr_format: int) -> dict[str, Any] | None:
    """A node's NGFF attributes: ``attributes["ome"]`` of a ``zarr.json`` (0.5), the
    ``.zattrs`` document itself (0.4), or ``None`` when the document is absent."""
    if doc is None:
        return None
    attrs = doc.get("attributes", {}) if zarr_format == 3 else doc
    if not isinstance(attrs, dict):
        return {}
    ome = attrs.get("ome")
    return ome if isinstance(ome, dict) else attrs


def _group_attributes(store: Any, paths: Sequence[str], zarr_format: int) -> list[Any]:
    name = "zarr.json" if zarr_format == 3 else ".zattrs"
    docs = _read_documents(store, [_key(p, name) for p in paths])
    attrs = [_attributes(d, zarr_format) for d in docs]
    if zarr_format == 2:  # a group without .zattrs is there, without metadata: say so below
        missing = [i for i, a in enumerate(attrs) if a is None]
        groups = _read_documents(store, [_key(paths[i], ".zgroup") for i in missing])
        for i, g in zip(missing, groups, strict=True):
            attrs[i] = {} if g is not None else None
    return attrs


# -- multiscales and levels ---


@dataclass(frozen=True)
class _Multiscale:
    axes: tuple[str, ...]
    types: tuple[str | None, ...]
    units: tuple[str | None, ...]
    paths: tuple[str, ...]
    sizes: tuple[tuple[float, ...], ...]  # per level, per axis


def _scale(transforms: Any, ndim: int, where: str) -> tuple[float, ...]:
    scale = [1.0] * ndim
    for t in transforms or ():
        if isinstance(t, dict) and t.get("type") == "scale":
            if "scale" not in t:
                raise ValueError(f"{where}: a scale given by 'path' is not read; inline it")
            values = [float(v) for v in t["scale"]]
            if len(values) != ndim:
                raise ValueError(f"{where}: scale {values} has not one value per axis ({ndim})")
            scale = [a * b for a, b in zip(scale, values, strict=True)]
    return tuple(scale)


def _multiscale(attrs: Mapping[str, Any], where: str) -> _Multiscale:
    found = attrs.get("multiscales")
    if not isinstance(found, list) or not found or not isinstance(found[0], dict):
        raise ValueError(f"{where} has no 'multiscales' metadata: it is not an NGFF image")
    ms = found[0]  # the first multiscale is the image (NGFF: readers take the first)
    axes = ms.get("axes")
    if not isinstance(axes, list) or not all(isinstance(a, dict) and "name" in a for a in axes):
        raise ValueError(
            f"{where}: multiscales axes {axes!r} are not a list of {{'name': ...}} objects "
            f"(NGFF 0.4 or later); NGFF versions read: {', '.join(NGFF_VERSIONS)}"
        )
    names = tuple(str(a["name"]) for a in axes)
    datasets = ms.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ValueError(f"{where}: multiscales has no datasets")
    top = _scale(ms.get("coordinateTransformations"), len(names), where)
    sizes = []
    for d in datasets:
        own = _scale(d.get("coordinateTransformations"), len(names), where)
        sizes.append(tuple(a * b for a, b in zip(own, top, strict=True)))
    return _Multiscale(
        axes=names,
        types=tuple(a.get("type") for a in axes),
        units=tuple(a.get("unit") for a in axes),
        paths=tuple(str(d["path"]) for d in datasets),
        sizes=tuple(sizes),
    )


def _wanted_sizes(level: float | Mapping[str, float], axes: Sequence[str]) -> dict[str, float]:
    if isinstance(level, Mapping):
        unknown = sorted(set(level) - set(axes))
        if unknown or not level:
            raise ValueError(
                f"level={dict(level)!r} names axes {unknown or '(none)'} the images do not "
                f"have; their axes are {list(axes)}"
            )
        return {str(a): float(s) for a, s in level.items()}
    return {a: float(level) for a in _PLANE_AXES if a in axes}


def _sizes_text(ms: _Multiscale, axes: Sequence[str]) -> str:
    idx = [ms.axes.index(a) for a in axes]
    return "; ".join(
        f"level {k} ({p}): " + ", ".join(f"{ms.axes[i]} {s[i]:g}" for i in idx)
        for k, (p, s) in enumerate(zip(ms.paths, ms.sizes, strict=True))
    )


def _level_by_size(ms: _Multiscale, wanted: Mapping[str, float], where: str) -> int:
    for k, sizes in enumerate(ms.sizes):
        if all(
            math.isclose(sizes[ms.axes.index(a)], s, rel_tol=_SIZE_RTOL) for a, s in wanted.items()
        ):
            return k
    asked = ", ".join(f"{a} {s:g}" for a, s in wanted.items())
    raise ValueError(
        f"{where}: no level has pixel size {asked}; its levels: {_sizes_text(ms, list(wanted))}"
    )


def _level_index(ms: _Multiscale, level: int, where: str) -> int:
    n = len(ms.paths)
    if not -n <= level < n:
        raise ValueError(f"{where}: level={level} is out of range; it has {n} level(s)")
    return level % n


def _check_level(level: Any) -> int | float | dict[str, float]:
    if isinstance(level, bool):
        raise TypeError(f"level must be an index, a pixel size or {{axis: size}}, got {level!r}")
    if isinstance(level, numbers.Integral):  # numpy's integers too (np.argmin of sizes)
        return int(level)
    if isinstance(level, numbers.Real):
        return float(level)
    if isinstance(level, Mapping) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in level.values()
    ):
        return {str(a): float(v) for a, v in level.items()}
    raise TypeError(
        f"level must be an index (0: full resolution), a pixel size (0.65) or "
        f"{{axis: size}} ({{'x': 0.65}}), got {level!r}"
    )


def _check_labels(labels: Any) -> str | tuple[str, ...] | None:
    if labels is None or labels == "all":
        return labels
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise TypeError(f"labels must be None, 'all' or a list of label names, got {labels!r}")
    return tuple(str(n) for n in labels)


# -- the plate ---


def _plate_metadata(store: Any) -> tuple[dict[str, Any], str, int]:
    v3, v2 = _read_documents(store, ["zarr.json", ".zattrs"])
    zarr_format = 3 if v3 is not None else 2
    attrs = _attributes(v3 if v3 is not None else v2, zarr_format)
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
    (label images may have other levels); none raises ``ValueError``.

    A well the plate lists but whose group is absent, and a field its well lists but absent,
    are skipped, named in ``Plate.absent_wells`` / ``absent_fields``, and warned about once
    (``UserWarning``). A plate with no field at all, metadata that is not NGFF, another NGFF
    version, or fields with different axes raise ``ValueError`` naming the group.
    """
    chosen = _check_level(level)
    wanted_labels = _check_labels(labels)
    store = as_store(store)
    plate, version, zarr_format = _plate_metadata(store)
    listed = [str(w["path"]) for w in plate.get("wells", ()) if isinstance(w, dict)]
    _refuse_twice(listed, "the plate's 'wells'")
    well_attrs = _group_attributes(store, listed, zarr_format)
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
    found = _read_fields(store, field_paths, images, zarr_format, chosen, wanted_labels)
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


@dataclass(frozen=True)
class _Fields:
    """What :func:`_read_fields` read of some multiscale images: those present, at a level."""

    fields: tuple[PlateField, ...]
    absent: tuple[str, ...]
    axes: tuple[str, ...]
    units: dict[str, str | None]
    label_names: tuple[str, ...]
    label_axes: dict[str, tuple[str, ...]]
    channels: tuple[str, ...] | None
    channel_axis: str | None


def _read_fields(
    store: Any,
    paths: Sequence[str],
    about: Sequence[tuple[str, str, int | None]],
    zarr_format: int,
    chosen: int | float | dict[str, float],
    wanted_labels: str | tuple[str, ...] | None,
    what: str = "field",
) -> _Fields:
    """The multiscale images at ``paths`` (``about[i]``: image ``i``'s well, its name in the
    well and its acquisition) read at once, each at the level ``chosen`` picks, with the
    labels ``wanted_labels``; absent groups skipped. ``what`` names an image in errors."""
    attrs = _group_attributes(store, paths, zarr_format)
    present = [i for i, a in enumerate(attrs) if a is not None]
    absent = tuple(paths[i] for i, a in enumerate(attrs) if a is None)
    if not present:
        return _Fields((), absent, (), {}, (), {}, None, None)
    multiscales = [_multiscale(attrs[i], f"{what} {paths[i]!r}") for i in present]
    axes = multiscales[0].axes
    for i, ms in zip(present, multiscales, strict=True):
        if ms.axes != axes:
            raise ValueError(
                f"{what} {paths[i]!r} has axes {list(ms.axes)}, {what} {paths[present[0]]!r} "
                f"{list(axes)}: the {what}s read together must share axes"
            )
    wanted = None if isinstance(chosen, int) else _wanted_sizes(chosen, axes)
    levels = [
        _level_index(ms, chosen, f"{what} {paths[i]!r}")
        if isinstance(chosen, int)
        else _level_by_size(ms, wanted or {}, f"{what} {paths[i]!r}")
        for i, ms in zip(present, multiscales, strict=True)
    ]
    named = [channel_names(attrs[i]) for i in present]
    channels = common_channels([paths[i] for i in present], named, what)
    label_paths, label_axes, label_names = _read_labels(
        store, [paths[i] for i in present], multiscales, levels, wanted_labels, zarr_format
    )
    fields = []
    for j, i in enumerate(present):
        well, name, acq = about[i]
        ms, k = multiscales[j], levels[j]
        row, _, column = well.partition("/")
        image = f"{paths[i]}/{ms.paths[k]}" if paths[i] else ms.paths[k]
        sizes = dict(zip(ms.axes, ms.sizes[k], strict=True))
        fields.append(
            PlateField(
                paths[i], well, row, column, name, image, k, sizes, label_paths[j], acq, named[j]
            )
        )
    units = dict(zip(axes, multiscales[0].units, strict=True))
    c_axis = channel_axis(axes, multiscales[0].types)
    return _Fields(tuple(fields), absent, axes, units, label_names, label_axes, channels, c_axis)


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


def _read_labels(
    store: Any,
    fields: Sequence[str],
    multiscales: Sequence[_Multiscale],
    levels: Sequence[int],
    wanted: str | tuple[str, ...] | None,
    zarr_format: int,
) -> tuple[list[dict[str, str]], dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Each field's ``{label name: array path}``, each label's axes, the label names read."""
    if wanted is None:
        return [{} for _ in fields], {}, ()
    groups = _group_attributes(store, [f"{f}/labels" for f in fields], zarr_format)
    named = [tuple(str(n) for n in (g or {}).get("labels", ())) for g in groups]
    if wanted == "all":
        names = named[0]
        for path, own in zip(fields, named, strict=True):
            if set(own) != set(names):
                common = sorted(set.intersection(*(set(n) for n in named)))
                raise ValueError(
                    f"labels='all': field {path!r} has labels {list(own)}, field {fields[0]!r} "
                    f"{list(names)}; name the labels to read, e.g. labels={common}"
                )
    else:
        names = tuple(wanted)
        for path, own in zip(fields, named, strict=True):
            missing = [n for n in names if n not in own]
            if missing:
                raise ValueError(
                    f"field {path!r} has no label image {missing} (its labels: {list(own)})"
                )
    if not names:
        return [{} for _ in fields], {}, ()
    keys = [f"{f}/labels/{n}" for f in fields for n in names]
    attrs = _group_attributes(store, keys, zarr_format)
    paths: list[dict[str, str]] = [{} for _ in fields]
    axes: dict[str, tuple[str, ...]] = {}
    for j, (key, a) in enumerate(zip(keys, attrs, strict=True)):
        f, n = divmod(j, len(names))
        name = names[n]
        if a is None:
            raise ValueError(f"label image {key!r} is listed by its labels group but absent")
        ms = _multiscale(a, f"label image {key!r}")
        if axes.setdefault(name, ms.axes) != ms.axes:
            raise ValueError(
                f"label image {key!r} has axes {list(ms.axes)}, other fields' {name!r} "
                f"{list(axes[name])}: a plate's label images of one name must share axes"
            )
        image = multiscales[f]
        shared = [
            a for a, t in zip(ms.axes, ms.types, strict=True) if t == "space" and a in image.axes
        ]
        want = {a: image.sizes[levels[f]][image.axes.index(a)] for a in shared}
        k = _level_by_size(ms, want, f"label image {key!r} (for image level {levels[f]})")
        paths[f][name] = f"{key}/{ms.paths[k]}"
    return paths, axes, tuple(names)


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
            if own[var] != _key(f.path, rel):
                raise ValueError(
                    f"level={level!r}: {f.path!r} keeps {var!r} at {own[var]!r}, "
                    f"{first.path!r} at {_key(first.path, rel)!r} (their pyramids differ): "
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
