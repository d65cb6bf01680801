"""The member map of a collection variable: where each member's samples sit on one virtual
sample axis, and which stored object of which member a virtual chunk is.

A :class:`~insitubatch_nodes.io.collection.Collection` presents each of its variables as one
*virtual array* (an :class:`~insitubatch_nodes.io.geometry.ArrayGeometry` whose ``members`` is a
:class:`MemberMap`): member ``m``'s samples ``0 .. lengths[m] - 1`` are the virtual samples
``sample_base[m] ..``, and every member starts on a chunk boundary of the virtual axis (its
tail up to the next boundary is *padding*: no sample, never an anchor). So the plan, the pool,
the gather, resume and the persistent cache work on it unchanged; only the stored object's key
is the member's (:meth:`MemberMap.store_key`), worked out from a few numpy arrays — never a
Python object per member on the per-batch path. What the member arrays of a variable must
share (:data:`SCHEMA_FIELDS`: zarr format, dtype, field shape, chunks, codecs, ...) is read
from each one's metadata document by :func:`member_schema`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import posixpath
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from insitubatch_nodes.io import _zarr_compat
from insitubatch_nodes.io.calendars import (
    counts_us,
    month_step,
    one_calendar,
    refuse_missing_times,
)
from insitubatch_nodes.io.cf import fill_scalar

__all__ = [
    "MEMBER_READERS",
    "SCHEMA_FIELDS",
    "MemberMap",
    "check_cf_encoding",
    "collection_of",
    "member_schema",
]

#: Members whose coordinates :meth:`MemberMap.joined` (and a forcing's grid per member) reads at
#: once.
MEMBER_READERS = 16


class MemberMap:
    """Members ``paths`` (their arrays' keys in the collection's store) laid end to end along
    a virtual sample axis of ``samples_per_chunk`` samples a chunk, each starting at a multiple
    of ``align`` samples (a multiple of ``samples_per_chunk``).

    Immutable; compares (and hashes) by :attr:`fingerprint`: the collection's name, the member
    paths, their lengths and the grid.
    """

    def __init__(
        self,
        collection: str,
        names: Sequence[str],
        paths: Sequence[str],
        lengths: Sequence[int] | np.ndarray,
        samples_per_chunk: int,
        align: int,
        continuous: bool = False,
        starts: Sequence[int] | np.ndarray | None = None,
        product: bool = False,
    ) -> None:
        if align % samples_per_chunk:
            raise ValueError(f"align {align} is not a multiple of {samples_per_chunk}")
        #: the members are consecutive pieces of one sample axis (``Collection.concat``): no
        #: padding between them, and windows and strides run across their edges
        self.continuous = bool(continuous)
        #: the members are on product sample axes (:mod:`~insitubatch_nodes.io.product`): a
        #: virtual chunk is one block of its member's product grid, whose chunk-grid
        #: coordinates the grid gives (:meth:`store_key` takes them as they are)
        self.product = bool(product)
        if self.product and (self.continuous or starts is not None):
            raise ValueError(f"{collection}: product sample axes take independent members")
        self.collection = str(collection)
        self.names = tuple(str(n) for n in names)
        self.paths = tuple(str(p) for p in paths)
        n = np.asarray(lengths, dtype=np.int64)
        if n.shape != (len(self.paths),) or len(self.names) != len(self.paths):
            raise ValueError("a member map needs one name, path and length per member")
        ragged = np.flatnonzero(n[:-1] % align) if continuous else np.zeros(0, dtype=np.int64)
        if len(ragged):
            m = int(ragged[0])
            raise ValueError(
                f"{collection}: {self.names[m]!r} holds {int(n[m])} samples, not a whole number "
                f"of chunks of {align} (the objects stored along the axis: its shards, where "
                "sharded): only the last piece of a continuous axis may end in a partial chunk; "
                "trim that store to whole chunks, or list it last"
            )
        self.lengths = n
        #: the samples each member skips at its start, whole chunks (a concatenation whose
        #: later store overlaps an earlier one, ``overlap="first"``; stores joined by time):
        #: its samples are its stored ``starts[m] .. starts[m] + lengths[m] - 1``
        self.starts = (
            np.zeros_like(n) if starts is None else np.asarray(starts, dtype=np.int64).copy()
        )
        if (
            self.starts.shape != n.shape
            or np.any(self.starts % samples_per_chunk)
            or np.any(self.starts < 0)
        ):
            raise ValueError(
                f"{collection}: members may skip only whole chunks of {samples_per_chunk} at "
                "their start, "
                f"not {self.starts.tolist()}"
            )
        self.samples_per_chunk = int(samples_per_chunk)
        self.align = int(align)
        padded = -(-n // align) * align  # each member's span: its samples and their padding
        self.sample_base = np.cumsum(padded) - padded
        spc = self.samples_per_chunk
        self.chunk_base = self.sample_base // spc
        #: the member each virtual chunk belongs to
        self.chunk_member = np.repeat(np.arange(len(n), dtype=np.int64), padded // spc)
        self.chunk_skip = self.starts // spc  # the stored chunks each member skips
        for arr in (
            self.lengths,
            self.starts,
            self.sample_base,
            self.chunk_base,
            self.chunk_skip,
            self.chunk_member,
        ):
            arr.setflags(write=False)
        # a continuous axis ends where its last piece does (a partial last chunk, as an array's)
        self.n_samples = int(n.sum()) if self.continuous else int(padded.sum())

    def __len__(self) -> int:
        return len(self.paths)

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex digits of the collection's name, its member paths and lengths, and the grid."""
        h = hashlib.sha256(f"{self.collection}|{self.samples_per_chunk}|{self.align}|".encode())
        if self.continuous:
            h.update(b"continuous|")
        if self.product:
            h.update(b"product|")
        h.update("\x00".join(self.paths).encode())
        h.update(self.lengths.tobytes())
        if self.starts.any():  # (absent otherwise: the fingerprints of maps without stay)
            h.update(b"starts|" + self.starts.tobytes())
        return h.hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemberMap) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"MemberMap({self.collection!r}, {len(self)} members, {self.n_samples} samples)"

    @functools.cached_property
    def common_prefix(self) -> str:
        """The folder every member's objects are below (``""``: the store's root)."""
        return posixpath.commonpath(["/" + p for p in self.paths]).strip("/")

    @functools.cached_property
    def listing_prefixes(self) -> tuple[str, ...]:
        """Folders whose listings, together, name every member's objects: the members' common
        folder, or else each top-level folder a member is below (each store's, for members of
        several stores); ``("",)``: the whole store."""
        if self.common_prefix:
            return (self.common_prefix,)
        heads = sorted({p.strip("/").partition("/")[0] for p in self.paths})
        return ("",) if "" in heads else tuple(heads)

    # -- samples ---------------------------------------------------------------------------
    def member_of(self, samples: np.ndarray) -> np.ndarray:
        """The member of each virtual sample index (``int64``, same shape)."""
        s = np.asarray(samples, dtype=np.int64)
        return np.searchsorted(self.sample_base, s, side="right").astype(np.int64) - 1

    def within(self, samples: np.ndarray, members: np.ndarray) -> np.ndarray:
        """Each virtual sample's index within its member (``members``: :meth:`member_of`)."""
        return np.asarray(samples, dtype=np.int64) - self.sample_base[members]

    def sample_bounds(self, chunks: np.ndarray, samples_per_chunk: int) -> tuple[np.ndarray, ...]:
        """``(lo, hi)``: the virtual samples ``[lo, hi)`` of the member each of ``chunks`` (on a
        grid of ``samples_per_chunk``, which divides :attr:`align`) belongs to."""
        chunks = np.asarray(chunks, dtype=np.int64)
        if self.continuous:  # one axis: every sample of it
            return np.zeros_like(chunks), np.full_like(chunks, int(self.lengths.sum()))
        m = self.member_of(chunks * samples_per_chunk)
        lo = self.sample_base[np.maximum(m, 0)]
        return lo, lo + self.lengths[np.maximum(m, 0)]

    def joined(
        self, geom: Any, reader: Any, named: bool, read: Callable[[Any], Mapping[str, Any]]
    ) -> dict[str, tuple[np.ndarray, Mapping[str, Any]]]:
        """The coordinates of the collection view ``geom`` (of this map) along its virtual
        sample axis, as ``{name: (values, attrs)}``: each is its members' own,
        ``read(member_geometry)`` (coordinates by name); the members' arrays are opened
        through ``reader`` (a :func:`~insitubatch_nodes.io.coords.coordinate_reader` of the
        store: each member's metadata read once per reader, before 2026-12-07 once per call).
        On a continuous axis (stores concatenated or joined by time) the samples each member
        gives, joined in order; for independent members (scenes, slides) each member's values
        at its own virtual samples, its padding a missing value (``NaT``, or ``None`` for
        cftime dates), and a time coordinate must run at **one step**, the same in every
        member (``ValueError`` naming the member otherwise: a time stride and window offsets in
        time deltas count steps within each member). A name not every member has is left
        out. Product sample axes have none (``ValueError`` when coordinates are ``named``)."""
        if self.product:
            if named:
                raise ValueError(
                    f"{geom.path!r} is on product sample axes: it carries no coordinates (each "
                    "row's indices are geom.sample_coords(batch.sample_indices[label]))"
                )
            return {}
        members = []
        for path, array in zip(
            self.paths, reader.arrays_of(self.paths, geom.zarr_format), strict=True
        ):
            if array is None:
                raise FileNotFoundError(f"{path!r} of {geom.path!r} is not in {reader.store}")
            members.append(replace(geom, path=path, members=None, shape=tuple(array.shape)))
        # each member as stored (its coordinates cover all it holds), read by
        # MEMBER_READERS threads at once: a member's reads wait on the store one after the
        # other (find its coordinate, then read it), so one member at a time was one round
        # trip after another — 56 ms a member over S3 with 10 ms of latency
        if len(members) == 1:
            parts = [read(members[0])]
        else:
            with ThreadPoolExecutor(
                min(MEMBER_READERS, len(members)), thread_name_prefix="insitu-coords"
            ) as pool:
                parts = list(pool.map(read, members))  # the first member's error first
        out = {}
        for name, first in parts[0].items():
            if not all(name in p for p in parts):
                continue
            kept = [
                p[name].values[int(a) : int(a) + int(n)]
                for p, a, n in zip(parts, self.starts, self.lengths, strict=True)
            ]
            if self.continuous:
                out[name] = (np.concatenate(kept), first.attrs)
                continue
            if first.is_time:
                one_calendar(self.names, kept, self.collection)
                self._check_steps(name, kept)
            out[name] = (self._laid_out(kept), first.attrs)
        return out

    def _laid_out(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """Each member's ``values`` at its virtual samples, its padding a missing value."""
        dtype = values[0].dtype
        missing: Any = None
        if dtype.kind in "mM":
            missing = np.array("NaT", dtype=dtype)
        elif dtype.kind == "f":
            missing = np.nan
        elif dtype.kind != "O":
            dtype = np.dtype(object)
        out = np.full(self.n_samples, missing, dtype=dtype)
        for base, v in zip(self.sample_base.tolist(), values, strict=True):
            out[base : base + len(v)] = v
        return out

    def _check_steps(self, name: str, values: Sequence[np.ndarray]) -> None:
        """Every member's times of ``name`` at one step, the first member's: one length, or
        ``k`` calendar months (:func:`~insitubatch_nodes.io.calendars.month_step`), negative
        where the times run backwards (newest first): then every member's do (a member that
        runs the other way is refused, naming both)."""
        step, calendar = None, None
        for m, v in enumerate(values):
            refuse_missing_times(
                v,
                f"{self.collection}: member {self.names[m]!r}'s time {name!r}",
                "a time stride, window offsets in time deltas and missing= dates count steps "
                "within each member",
            )
            v = v[~_later_copies(v)]  # a time is one time: a later copy is a gap (the plan's)
            d = np.diff(v)
            if not len(d):
                continue
            months = month_step(v)  # (monthly dates: months of several lengths, one step)
            if step is None:
                step, first, calendar = d[0], m, months
            if (d[0] > d[0] * 0) != (step > step * 0):  # (one member newest first, one not)
                ways = {True: "forward (oldest first)", False: "backwards (newest first)"}
                raise ValueError(
                    f"{self.collection}: member {self.names[first]!r}'s {name!r} runs "
                    f"{ways[bool(step > step * 0)]} and member {self.names[m]!r}'s "
                    f"{ways[bool(d[0] > d[0] * 0)]}: a time stride, window offsets in time "
                    "deltas and missing= dates count every member's steps in one direction; "
                    "write the members in one order (xarray: ds.sortby('time'), or "
                    "ds.sortby('time', ascending=False)), or open them without reading their "
                    "times (no time stride, windows in samples, no missing=, no coords)"
                )
            if calendar is not None and months == calendar:
                continue
            bad = np.flatnonzero(d != step) if calendar is None else np.zeros(1, np.intp)
            if len(bad):
                i = int(bad[0])
                every = step if calendar is None else f"{calendar} calendar month(s)"
                raise ValueError(
                    f"{self.collection}: member {self.names[m]!r}'s {name!r} steps from "
                    f"{v[i]} to {v[i + 1]}, but member {self.names[first]!r} runs at one step of "
                    f"{every}: a time stride, "
                    "window offsets in time deltas and missing= dates "
                    "count steps within each member, so every member's times need one step, "
                    "the same in all (leave this member out, or open it on its own)"
                )

    # -- stored objects ----------------------------------------------------------------------
    def store_key(
        self, metadata: Any, coords: Sequence[int], sample_axis: int, chunk: int | None = None
    ) -> str:
        """The key of the stored object at virtual chunk-grid ``coords``: the member's own
        chunk ``coords[sample_axis] - chunk_base[member]``, below the member's path. On
        product axes (:attr:`product`) ``coords`` are the member's own already and virtual chunk
        ``chunk`` names the member."""
        local = list(coords)
        if self.product:
            assert chunk is not None, "a product grid's key needs its virtual chunk"
            m = int(self.chunk_member[int(chunk)])
        else:
            chunk = int(coords[sample_axis])
            m = int(self.chunk_member[chunk])
            local[sample_axis] = chunk - int(self.chunk_base[m]) + int(self.chunk_skip[m])
        template = self._template(metadata, len(local))
        key = (
            template.format(*local)
            if template is not None
            else _zarr_compat.encode_chunk_key(metadata, local)
        )
        path = self.paths[m]
        return f"{path}/{key}" if path else key

    def whole_chunk_key(self, metadata: Any, ndim: int, sample_axis: int) -> Any:
        """``key(chunk)``: the key of virtual chunk ``chunk`` of an array stored one object per
        chunk (no tiles), without zarr's encoder — or ``None`` when its keys need zarr's."""
        template = self._template(metadata, ndim)
        if template is None or self.product:  # (a block's key needs its product coordinates)
            return None
        coords: list[Any] = ["0"] * ndim
        coords[sample_axis] = "\x00"
        parts = template.format(*coords).split("\x00")
        if len(parts) != 2:
            return None
        before, after = parts
        prefixes = [f"{p}/{before}" if p else before for p in self.paths]
        member, base = self.chunk_member, self.chunk_base - self.chunk_skip

        def key(chunk: int) -> str:
            m = int(member[chunk])
            return prefixes[m] + str(chunk - int(base[m])) + after

        return key

    def _template(self, metadata: Any, ndim: int) -> str | None:
        cached = self.__dict__.get("_key_template", False)
        if cached is False:
            cached = _zarr_compat.chunk_key_format(metadata, ndim)
            self.__dict__["_key_template"] = cached
        return cached


#: what every member array of a variable must share, by its name in messages: the metadata
#: document's entries (v3 ``zarr.json``, v2 ``.zarray``) other than the sample-axis length
SCHEMA_FIELDS = {
    "zarr format": ("zarr_format",),
    "number of axes": (),
    "dimension names": ("dimension_names",),
    "dtype": ("data_type", "dtype"),
    "field shape": (),
    "chunk shape": ("chunk_grid", "chunks"),
    "codecs": ("codecs", "compressor", "filters", "order", "storage_transformers"),
    "fill value": ("fill_value",),
    "chunk key encoding": ("chunk_key_encoding", "dimension_separator"),
}


def _later_copies(times: np.ndarray) -> np.ndarray:
    """The later copies of a time ``times`` (a member's, none missing: ``datetime64`` or
    cftime dates) holds already (``bool``, pandas' ``duplicated()``): what the plan's
    missing-step checks count as gaps (``SampleSteps.repeated``). Vectorised; a pass in
    Python over cftime dates only where they do not increase throughout."""
    out = np.zeros(len(times), dtype=bool)
    if len(times) < 2 or bool((times[1:] > times[:-1]).all()):
        return out
    keys = times.view(np.int64) if times.dtype.kind == "M" else counts_us(times)
    out[:] = True
    out[np.unique(keys, return_index=True)[1]] = False
    return out


def member_schema(doc: Mapping[str, Any], axis: int) -> dict[str, Any]:
    """A member's metadata document as :data:`SCHEMA_FIELDS` (names -> values)."""
    shape = list(doc.get("shape") or ())
    out: dict[str, Any] = {}
    for name, entries in SCHEMA_FIELDS.items():
        values = [doc[k] for k in entries if doc.get(k) is not None]
        out[name] = values[0] if len(values) == 1 else tuple(values) or None
    out["number of axes"] = len(shape)
    out["field shape"] = tuple(shape[:axis] + shape[axis + 1 :])
    return out


#: the attributes that say how a data array's stored values decode (:mod:`~insitubatch_nodes.io.cf`)
CF_ATTRIBUTES = ("scale_factor", "add_offset", "_FillValue", "missing_value", "_Unsigned")


def check_cf_encoding(
    collection: str,
    variable: str,
    members: Sequence[str],
    attrs: Sequence[Mapping[str, Any] | None],
) -> None:
    """Refuse members of ``variable`` whose CF encoding attributes (:data:`CF_ATTRIBUTES`, from
    each member's ``attrs``) differ from the first member's: the collection decodes every
    member by the first one's rule, so a member packed with another ``scale_factor`` /
    ``add_offset`` (netCDF files written month by month are) would decode to wrong values.
    ``ValueError`` names the attribute, both members and their values."""
    want: dict[str, Any] | None = None
    for m, got_attrs in enumerate(attrs):
        got = {k: _encoding_value(k, (got_attrs or {}).get(k)) for k in CF_ATTRIBUTES}
        if want is None:
            want = got
            continue
        if got != want:
            what = next(k for k in CF_ATTRIBUTES if got[k] != want[k])
            raise ValueError(
                f"{collection}: member {members[m]!r}, variable {variable!r}: its {what} "
                f"{got[what]!r} differs from member {members[0]!r}'s {want[what]!r}; every "
                "member is decoded by one CF encoding (scale_factor, add_offset, _FillValue, "
                "missing_value, _Unsigned), the first member's: rewrite the members with one "
                "encoding (xarray: ds.to_zarr(..., encoding={var: {...}})), or read them in "
                "separate pipelines"
            )


def _encoding_value(name: str, value: Any) -> Any:
    """A CF attribute's value as compared and shown: a float ``_FillValue`` spelled as a
    string (xarray writes v3 ones as base64 of a double; ``"NaN"``) as the number it spells,
    NaN as the string ``nan`` (so that NaN equals NaN)."""
    if name == "_FillValue" and isinstance(value, str):
        number = fill_scalar(value, np.dtype("f8"))
        value = value if number is None else number
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def collection_of(maps: Sequence[MemberMap | None]) -> MemberMap | None:
    """The member map a plan over views with member maps ``maps`` follows: the first one
    (``None`` when there is none). Collections whose members do not sit at the same virtual
    samples cannot share a plan, nor can collections whose members there are others, by name
    (a split of one collection given with the views of the same fields in another order): both
    ``ValueError``. Members are compared by name, so the same fields opened again (another
    level, other variables) share a split; ``from_arrays``' default names are positions."""
    given = [m for m in maps if m is not None]
    if not given:
        return None
    first = given[0]
    for other in given[1:]:
        if not (
            np.array_equal(other.sample_base, first.sample_base)
            and np.array_equal(other.lengths, first.lengths)
        ):
            raise ValueError(
                f"{first.collection!r} and {other.collection!r} lay their members out "
                "differently: the labels (and the split) of one pipeline must come from one "
                "collection"
            )
        if other.names != first.names:
            pairs = zip(first.names, other.names, strict=True)
            m = next(i for i, (a, b) in enumerate(pairs) if a != b)
            raise ValueError(
                f"{first.collection!r}'s member {m} is {first.names[m]!r}, "
                f"{other.collection!r}'s {other.names[m]!r}: the split (and the labels) of one "
                "pipeline must name the same members in the same order; split the collection "
                "the views come from (split_by_member(collection, ...))"
            )
    return first
