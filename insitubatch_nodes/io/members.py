"""The member map of a collection variable: where each member's samples sit on one virtual
sample axis, and which stored object of which member a virtual chunk is.

A :class:`~insitubatch_nodes.io.collection.Collection` presents each of its variables as one
*virtual array* (an :class:`~insitubatch_nodes.io.geometry.ArrayGeometry` whose ``members`` is a
:class:`MemberMap`): member ``m``'s samples ``0 .. lengths[m] - 1`` are the virtual samples
``sample_base[m] ..``, and every member starts on a chunk boundary of the virtual axis (its
tail up to the next boundary is *padding*: no sample, never an anchor). So the plan, the pool,
the gather, resume and the persistent cache work on it unchanged; only the stored object's key
is the member's (:meth:`MemberMap.store_key`), worked out from a few numpy arrays — never a
Python object per member on the per-batch path.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from insitubatch_nodes.io import _zarr_compat

__all__ = ["MemberMap"]


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
    ) -> None:
        if align % samples_per_chunk:
            raise ValueError(f"align {align} is not a multiple of {samples_per_chunk}")
        #: the members are consecutive pieces of one sample axis (``Collection.concat``): no
        #: padding between them, and windows and strides run across their edges
        self.continuous = bool(continuous)
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
                f"of chunks of {align}: only the last piece of a continuous axis may end in a "
                "partial chunk"
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
        self, geom: Any, store: Any, named: bool, read: Callable[[Any], Mapping[str, Any]]
    ) -> dict[str, tuple[np.ndarray, Mapping[str, Any]]]:
        """The coordinates of the collection view ``geom`` (of this map), as ``{name: (values,
        attrs)}``: on a continuous axis (stores concatenated or joined by time) each is its
        members' own, ``read(member_geometry)`` (coordinates by name), the samples each member
        gives, joined in order; a name not every member has is left out. Members of other
        collections are independent: none (``ValueError`` when coordinates are ``named``)."""
        if not self.continuous:
            if named:
                raise ValueError(
                    f"{geom.path!r} is a collection of independent members: it carries no "
                    "coordinates (each row's member and index are in batch.members and "
                    "batch.sample_indices)"
                )
            return {}
        parts = []
        for path in self.paths:  # each member as stored: its coordinates cover all it holds
            stored = _zarr_compat.open_arrays_by_name(store, [path], geom.zarr_format)[0]
            if stored is None:
                raise FileNotFoundError(f"{path!r} of {geom.path!r} is not in {store}")
            parts.append(read(replace(geom, path=path, members=None, shape=tuple(stored.shape))))
        out = {}
        for name, first in parts[0].items():
            if all(name in p for p in parts):
                kept = [
                    p[name].values[int(a) : int(a) + int(n)]
                    for p, a, n in zip(parts, self.starts, self.lengths, strict=True)
                ]
                out[name] = (np.concatenate(kept), first.attrs)
        return out

    # -- stored objects ----------------------------------------------------------------------
    def store_key(self, metadata: Any, coords: Sequence[int], sample_axis: int) -> str:
        """The key of the stored object at virtual chunk-grid ``coords``: the member's own
        chunk ``coords[sample_axis] - chunk_base[member]``, below the member's path."""
        chunk = int(coords[sample_axis])
        m = int(self.chunk_member[chunk])
        local = list(coords)
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
        if template is None:
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
