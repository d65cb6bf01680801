"""OME-NGFF ``omero`` metadata: the channel names of an image (``omero.channels[].label``).

NGFF images written by ome-zarr-py, bioformats2raw or OMERO carry beside their
``multiscales`` an ``omero`` block (transitional in the specification, and what viewers and
users go by) naming each channel of the channel axis. :func:`channel_names` reads them from an
image's attributes; :func:`common_channels` says the names every field of a plate shares, so
that ``open_plate`` can give them to ``sel`` (``coll["image"].sel(c="GFP")``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["channel_axis", "channel_coords", "channel_names", "common_channels"]


def channel_names(attrs: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``label`` of each channel in ``attrs["omero"]["channels"]`` (an image's NGFF
    attributes), in order; ``None`` where there is no such block, or a channel has no label."""
    omero = attrs.get("omero")
    channels = omero.get("channels") if isinstance(omero, Mapping) else None
    if not isinstance(channels, list) or not channels:
        return None
    labels = [c.get("label") if isinstance(c, Mapping) else None for c in channels]
    if not all(isinstance(label, str) and label for label in labels):
        return None
    return tuple(str(label) for label in labels)


def channel_axis(axes: Sequence[str], types: Sequence[str | None]) -> str | None:
    """The name of the channel axis: the first of ``type`` ``"channel"``, else one named
    ``"c"``, else ``None``."""
    for name, kind in zip(axes, types, strict=True):
        if kind == "channel":
            return name
    return "c" if "c" in axes else None


def common_channels(
    fields: Sequence[str], names: Sequence[tuple[str, ...] | None], what: str = "field"
) -> tuple[str, ...] | None:
    """The channel names every one of ``fields`` gives (``names[i]``: field ``i``'s), none
    twice, or ``None``: a field without names, fields naming them otherwise, or a name given
    twice (a value of ``sel`` must find one channel). Fields that name their channels otherwise
    (another order, other channels) raise a ``UserWarning`` naming two: an index (``isel``)
    selects other channels in them, and ``sel`` by name is not offered."""
    given = [(path, own) for path, own in zip(fields, names, strict=True) if own is not None]
    for path, own in given[1:]:
        if own != given[0][1]:
            warnings.warn(
                f"the {what}s name their channels differently ({what} {given[0][0]!r}: "
                f"{list(given[0][1])}, {what} {path!r}: {list(own)}): an index (isel(c=...)) "
                f"selects other channels in them, and no sel by name is offered; open the "
                f"{what}s that name them alike together",
                UserWarning,
                stacklevel=4,
            )
            return None
    if len(given) < len(fields) or not given or len(set(given[0][1])) != len(given[0][1]):
        return None
    return given[0][1]


def channel_coords(
    channels: tuple[str, ...] | None, axis: str | None
) -> dict[str, dict[str, tuple[str, ...]]] | None:
    """``{"image": {axis: channels}}`` where the images name their channels alike: the
    collection's ``coords=``, what ``coll["image"].sel(c="GFP")`` looks names up in."""
    if channels is None or axis is None:
        return None
    return {"image": {axis: channels}}
