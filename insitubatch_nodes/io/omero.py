"""OME-NGFF ``omero`` metadata: the channel names of an image (``omero.channels[].label``).

NGFF images written by ome-zarr-py, bioformats2raw or OMERO carry beside their
``multiscales`` an ``omero`` block (transitional in the specification, and what viewers and
users go by) naming each channel of the channel axis. :func:`channel_names` reads them from an
image's attributes; :func:`common_channels` says the names every field of a plate shares, so
that ``open_plate`` can give them to ``sel`` (``coll["image"].sel(c="GFP")``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["channel_axis", "channel_names", "common_channels"]


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
    fields: Sequence[str], names: Sequence[tuple[str, ...] | None]
) -> tuple[tuple[str, ...] | None, str]:
    """The channel names every one of ``fields`` gives (``names[i]``: field ``i``'s), unique,
    or ``None`` and why not: a field without names, fields naming them otherwise, or a name
    given twice (a value of ``sel`` must find one channel)."""
    if not names or names[0] is None:
        return None, f"field {fields[0]!r} names no channels (no omero labels)" if fields else ""
    first = names[0]
    for path, own in zip(fields, names, strict=True):
        if own != first:
            return None, (
                f"field {path!r} names its channels {list(own or ())}, field {fields[0]!r} "
                f"{list(first)}"
            )
    if len(set(first)) != len(first):
        return None, f"the fields name a channel twice: {list(first)}"
    return first, ""
