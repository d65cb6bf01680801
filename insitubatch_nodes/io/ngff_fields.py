"""What OME-NGFF multiscale images share, whether a plate's fields (:mod:`.ngff`) or other
images (:mod:`.ngff_images`): their metadata documents read by name, all at once
(:func:`read_json_documents`, :func:`group_attributes`), each image's ``multiscales`` and the
level a ``level=`` picks (:func:`check_level`), its label images at the level of the same pixel
sizes (:func:`check_labels`), and the images read together (:func:`read_fields`, one
:class:`PlateField` each).
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from insitubatch_nodes.io.objects import read_documents
from insitubatch_nodes.io.omero import channel_axis, channel_names, common_channels

__all__ = [
    "NGFF_VERSIONS",
    "ImageFields",
    "PlateField",
    "check_labels",
    "check_level",
    "group_attributes",
    "metadata_key",
    "ngff_attributes",
    "read_fields",
    "read_json_documents",
]

NGFF_VERSIONS: tuple[str, ...] = ("0.4", "0.5")
"""The NGFF metadata versions :func:`~insitubatch_nodes.io.ngff.read_plate` reads (0.4: zarr
v2, 0.5: zarr v3)."""

_SIZE_RTOL = 1e-4  # a pixel size asked for matches a level's within this relative tolerance
_IN_FLIGHT = 64  # metadata documents read at once
_PLANE_AXES = ("y", "x")  # what a pixel size given as one number applies to


@dataclass(frozen=True)
class PlateField:
    """One field (one multiscale image) of a plate, at the level
    :func:`~insitubatch_nodes.io.ngff.read_plate` chose (or one image :mod:`.ngff_images`
    reads).

    ``path`` is its group (``"A/1/0"``: well ``"A/1"``, image ``"0"`` of that well);
    ``image`` the array path of the chosen level (``"A/1/0/s0"``) and ``level`` its index in
    the field's ``multiscales`` datasets; ``labels`` maps each label name read to the array
    path of the label level with the same pixel sizes; ``pixel_size`` is the chosen level's
    size along every axis, in the axis' unit (the dataset's ``scale`` times the multiscale's
    own, if any); ``acquisition`` the well metadata's acquisition id, if any; ``channels`` the
    names its ``omero`` metadata gives the channels (``None``: none). ``translation`` is where
    the chosen level's index 0 lies along every axis, in the axis' unit (the dataset's
    ``translation`` and the multiscale's, composed with the scales as NGFF composes them):
    index ``i`` of axis ``a`` (a patch origin, ``batch.patch_origins``) lies at
    ``translation[a] + i * pixel_size[a]``. A label image whose translation puts it off
    these pixels is read with a ``UserWarning`` (see :func:`~insitubatch_nodes.io.ngff.read_plate`).
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
    translation: Mapping[str, float] = field(default_factory=dict)


# -- reading documents ---


def read_json_documents(store: Any, keys: Sequence[str]) -> list[Any]:
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


def metadata_key(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def ngff_attributes(doc: Any, zarr_format: int) -> dict[str, Any] | None:
    """A node's NGFF attributes: ``attributes["ome"]`` of a ``zarr.json`` (0.5), the
    ``.zattrs`` document itself (0.4), or ``None`` when the document is absent."""
    if doc is None:
        return None
    attrs = doc.get("attributes", {}) if zarr_format == 3 else doc
    if not isinstance(attrs, dict):
        return {}
    ome = attrs.get("ome")
    return ome if isinstance(ome, dict) else attrs


def group_attributes(store: Any, paths: Sequence[str], zarr_format: int) -> list[Any]:
    name = "zarr.json" if zarr_format == 3 else ".zattrs"
    docs = read_json_documents(store, [metadata_key(p, name) for p in paths])
    attrs = [ngff_attributes(d, zarr_format) for d in docs]
    if zarr_format == 2:  # a group without .zattrs is there, without metadata: say so below
        missing = [i for i, a in enumerate(attrs) if a is None]
        groups = read_json_documents(store, [metadata_key(paths[i], ".zgroup") for i in missing])
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
    sizes: tuple[tuple[float, ...], ...]  # per level, per axis: the scale
    offsets: tuple[tuple[float, ...], ...]  # per level, per axis: where index 0 lies


_Affine = tuple[tuple[float, ...], tuple[float, ...]]  # per axis: (scale, translation)


def _transform(transforms: Any, ndim: int, where: str, start: _Affine | None = None) -> _Affine:
    """``start`` (default: the identity) followed by the ``scale`` and ``translation``
    coordinateTransformations ``transforms``, in their order: per axis, physical position =
    ``scale * index + translation``."""
    scale, offset = [1.0] * ndim, [0.0] * ndim
    if start is not None:
        scale, offset = list(start[0]), list(start[1])
    for t in transforms or ():
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in ("scale", "translation"):
            continue
        if kind not in t:
            raise ValueError(f"{where}: a {kind} given by 'path' is not read; inline it")
        values = [float(v) for v in t[kind]]
        if len(values) != ndim:
            raise ValueError(f"{where}: {kind} {values} has not one value per axis ({ndim})")
        if kind == "scale":
            scale = [a * b for a, b in zip(scale, values, strict=True)]
            offset = [a * b for a, b in zip(offset, values, strict=True)]
        else:
            offset = [a + b for a, b in zip(offset, values, strict=True)]
    return tuple(scale), tuple(offset)


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
    top = ms.get("coordinateTransformations")  # applied after each dataset's own
    levels = [
        _transform(top, len(names), where, _transform(d.get("coordinateTransformations"),
                                                      len(names), where))
        for d in datasets
    ]  # fmt: skip
    return _Multiscale(
        axes=names,
        types=tuple(a.get("type") for a in axes),
        units=tuple(a.get("unit") for a in axes),
        paths=tuple(str(d["path"]) for d in datasets),
        sizes=tuple(scale for scale, _ in levels),
        offsets=tuple(offset for _, offset in levels),
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


def check_level(level: Any) -> int | float | dict[str, float]:
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


def check_labels(labels: Any) -> str | tuple[str, ...] | None:
    if labels is None or labels == "all":
        return labels
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise TypeError(f"labels must be None, 'all' or a list of label names, got {labels!r}")
    return tuple(str(n) for n in labels)


# -- the plate ---


@dataclass(frozen=True)
class ImageFields:
    """What :func:`read_fields` read of some multiscale images: those present, at a level."""

    fields: tuple[PlateField, ...]
    absent: tuple[str, ...]
    axes: tuple[str, ...]
    units: dict[str, str | None]
    label_names: tuple[str, ...]
    label_axes: dict[str, tuple[str, ...]]
    channels: tuple[str, ...] | None
    channel_axis: str | None


def read_fields(
    store: Any,
    paths: Sequence[str],
    about: Sequence[tuple[str, str, int | None]],
    zarr_format: int,
    chosen: int | float | dict[str, float],
    wanted_labels: str | tuple[str, ...] | None,
    what: str = "field",
) -> ImageFields:
    """The multiscale images at ``paths`` (``about[i]``: image ``i``'s well, its name in the
    well and its acquisition) read at once, each at the level ``chosen`` picks, with the
    labels ``wanted_labels``; absent groups skipped. ``what`` names an image in errors."""
    attrs = group_attributes(store, paths, zarr_format)
    present = [i for i, a in enumerate(attrs) if a is not None]
    absent = tuple(paths[i] for i, a in enumerate(attrs) if a is None)
    if not present:
        return ImageFields((), absent, (), {}, (), {}, None, None)
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
        offsets = dict(zip(ms.axes, ms.offsets[k], strict=True))
        fields.append(
            PlateField(
                paths[i], well, row, column, name, image, k, sizes, label_paths[j], acq,
                named[j], offsets,
            )
        )  # fmt: skip
    units = dict(zip(axes, multiscales[0].units, strict=True))
    c_axis = channel_axis(axes, multiscales[0].types)
    return ImageFields(
        tuple(fields), absent, axes, units, label_names, label_axes, channels, c_axis
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
    # (an image at the store's root has path "": its labels are "labels", never "/labels")
    groups = group_attributes(store, [metadata_key(f, "labels") for f in fields], zarr_format)
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
    keys = [metadata_key(f, f"labels/{n}") for f in fields for n in names]
    off: dict[str, list[str]] = {}  # each label's images off their image's pixels
    attrs = group_attributes(store, keys, zarr_format)
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
        shift = _offset(ms, k, image, levels[f], shared, key)
        if shift is not None:
            off.setdefault(name, []).append(shift)
        paths[f][name] = metadata_key(key, ms.paths[k])
    for name, shifts in off.items():
        warnings.warn(
            f"{len(shifts)} of {len(fields)} {name!r} label image(s) lie off their image's "
            f"pixels by their translation (first: {shifts[0]}): a patch of the image and of its "
            "labels take the same pixel origin, so each window pairs the pixels of one index, "
            "not of one place. Where the label image really lies there, write it on the "
            "image's pixel grid; where its translation is wrong (a writer that dropped the "
            "image's), correct it",
            UserWarning,
            stacklevel=4,
        )
    return paths, axes, tuple(names)


def _offset(
    label: _Multiscale, k: int, image: _Multiscale, level: int, axes: Sequence[str], key: str
) -> str | None:
    """Where label level ``k`` of ``label`` (at ``key``) lies off image level ``level``'s
    pixels along ``axes``, said in a few words; ``None`` where every translation differs by
    less than half a pixel (the same pixels)."""
    off: dict[str, float] = {}
    for a in axes:
        size = image.sizes[level][image.axes.index(a)]
        mine = label.offsets[k][label.axes.index(a)]
        theirs = image.offsets[level][image.axes.index(a)]
        if abs(mine - theirs) >= 0.5 * abs(size):
            off[a] = (mine - theirs) / size
    if not off:
        return None
    where = ", ".join(f"{a} {label.offsets[k][label.axes.index(a)]:g}" for a in axes)
    own = ", ".join(f"{a} {image.offsets[level][image.axes.index(a)]:g}" for a in axes)
    shift = ", ".join(f"{a} {v:+g}" for a, v in off.items())
    return (
        f"{key!r} level {label.paths[k]!r} starts at {where}, the image's level "
        f"{image.paths[level]!r} at {own}: {shift} pixels"
    )
