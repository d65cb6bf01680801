"""Chunk-aligned train/val/test splits along the sample axis.

A split assigns *whole chunks* of a reference array (its sample-axis chunk grid is the *anchor
grid*) to ``train``, ``val`` and ``test``. Samples never straddle two splits, reads stay
chunk-aligned, and with ``contiguous=True`` (the default, right for time series) each split is one
contiguous run of chunks so autocorrelated neighbours do not leak across the boundary.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes._atomic import atomic_write
from insitubatch_nodes._checks import check_bool, check_instance, check_int
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.coords import Coordinate
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.members import MemberMap
from insitubatch_nodes.io.product import ProductGrid
from insitubatch_nodes.plan.anchors import SampleSteps

__all__ = ["SPLITS", "SplitManifest", "split_by_chunk", "split_by_member"]

SPLITS: tuple[str, ...] = ("train", "val", "test")
FORMAT_VERSION = 1


@dataclass(frozen=True, repr=False)
class SplitManifest:
    """Which anchor-grid chunks belong to each split (JSON-serialisable, immutable).

    ``array``, ``n_samples`` and ``samples_per_chunk`` describe the anchor grid the chunk indices
    refer to. The remaining fields record how the split was drawn, for reproducibility.

    ``steps`` (a :class:`~insitubatch_nodes.plan.anchors.SampleSteps`, ``None`` by default) is
    what the plan knows about each sample's time and missing objects, attached by the builder
    (:meth:`with_steps`) for a time stride and the missing-step checks; it is neither saved
    (:meth:`to_dict`) nor compared, and :meth:`fingerprint` covers it only when present.
    """

    array: str
    n_samples: int
    samples_per_chunk: int
    splits: Mapping[str, tuple[int, ...]]
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    contiguous: bool = True
    seed: int = 0
    sample_range: tuple[int, int] | None = None
    steps: SampleSteps | None = field(default=None, compare=False, repr=False)
    #: a collection's member map (:mod:`~insitubatch_nodes.io.members`): no anchor, and no
    #: step of a view, falls outside its own member; attached like ``steps``, never saved
    members: MemberMap | None = field(default=None, compare=False, repr=False)
    #: product sample axes (:mod:`~insitubatch_nodes.io.product`): no anchor in the padding of
    #: an edge block; attached like ``members``, never saved
    product: ProductGrid | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_samples < 0 or self.samples_per_chunk <= 0:
            raise ValueError(
                f"a manifest needs n_samples >= 0 and samples_per_chunk > 0, got "
                f"{self.n_samples} and {self.samples_per_chunk}"
            )
        unknown = set(self.splits) - set(SPLITS)
        if unknown:
            raise ValueError(f"unknown split names {sorted(unknown)}; expected {SPLITS}")
        # vectorised: a manifest of an hourly archive lists ~10^6 chunks
        arrays = {name: _sorted_chunks(self.splits.get(name, ())) for name in SPLITS}
        n_chunks = self.n_chunks
        owner = np.full(n_chunks, -1, dtype=np.int64)  # which split holds each chunk
        for k, (name, chunks) in enumerate(arrays.items()):
            outside = chunks[(chunks < 0) | (chunks >= n_chunks)]
            if len(outside):
                raise ValueError(f"split {name!r}: chunk {outside[0]} not in [0, {n_chunks})")
            twice = chunks[1:][chunks[1:] == chunks[:-1]]
            if len(twice):
                raise ValueError(f"chunk {twice[0]} is in both {name!r} and {name!r}")
            taken = chunks[owner[chunks] >= 0]
            if len(taken):
                c = int(taken[0])
                raise ValueError(f"chunk {c} is in both {SPLITS[owner[c]]!r} and {name!r}")
            owner[chunks] = k
        if self.sample_range is not None:
            lo, hi = (int(x) for x in self.sample_range)
            if not 0 <= lo < hi <= self.n_samples:
                raise ValueError(
                    f"sample_range must satisfy 0 <= start < stop <= {self.n_samples}, got "
                    f"{tuple(self.sample_range)}"
                )
            object.__setattr__(self, "sample_range", (lo, hi))
        normalized = {name: tuple(chunks.tolist()) for name, chunks in arrays.items()}
        object.__setattr__(self, "splits", normalized)
        if self.steps is not None and self.steps.n_samples != self.n_samples:
            raise ValueError(
                f"steps cover {self.steps.n_samples} samples but the anchor grid has "
                f"{self.n_samples}"
            )

    def __repr__(self) -> str:
        """One line whatever the archive: a long split as its count and range (the dataclass's
        repr listed every chunk, 2.7 MB for 40 years of hourly one-sample chunks)."""

        def chunks(c: tuple[int, ...]) -> str:
            if len(c) <= 8:
                return repr(c)
            run = "" if c[-1] - c[0] + 1 == len(c) else " within"
            return f"<{len(c)} chunks{run} {c[0]}..{c[-1]}>"

        splits = ", ".join(f"{name!r}: {chunks(c)}" for name, c in self.splits.items())
        return (
            f"SplitManifest(array={self.array!r}, n_samples={self.n_samples}, "
            f"samples_per_chunk={self.samples_per_chunk}, splits={{{splits}}}, "
            f"fractions={self.fractions}, contiguous={self.contiguous}, seed={self.seed}, "
            f"sample_range={self.sample_range})"
        )

    def with_steps(self, steps: SampleSteps | None) -> SplitManifest:
        """This manifest carrying ``steps`` (its samples' times and missing objects)."""
        if steps is not None and steps.n_samples != self.n_samples:
            raise ValueError(
                f"steps cover {steps.n_samples} samples but the anchor grid has {self.n_samples}"
            )
        out = copy.copy(self)  # the splits were checked when this manifest was made
        object.__setattr__(out, "steps", steps)
        return out

    def with_members(self, members: MemberMap | None) -> SplitManifest:
        """This manifest following ``members`` (a collection's member map, whose virtual
        sample axis is this manifest's anchor grid)."""
        if members is not None and (
            members.n_samples != self.n_samples or members.align % self.samples_per_chunk
        ):
            raise ValueError(
                f"the manifest's anchor grid ({self.n_samples} samples, "
                f"{self.samples_per_chunk} a chunk) is not that of {members.collection!r} "
                f"({members.n_samples} samples, members every {members.align}): split the "
                "collection's own view (split_by_member, or split_by_chunk(collection[v]))"
            )
        out = copy.copy(self)
        object.__setattr__(out, "members", members)
        return out

    def with_product(self, product: ProductGrid | None) -> SplitManifest:
        """This manifest following ``product`` (product sample axes whose virtual sample axis
        is this manifest's anchor grid)."""
        if product is not None and (
            product.n_samples != self.n_samples
            or product.samples_per_chunk != self.samples_per_chunk
        ):
            raise ValueError(
                f"the manifest's anchor grid ({self.n_samples} samples, "
                f"{self.samples_per_chunk} a chunk) is not that of the product sample axes "
                f"{product.axes} ({product.n_samples} samples, {product.samples_per_chunk} a "
                "chunk): split the product view itself (split_by_chunk(geom))"
            )
        out = copy.copy(self)
        object.__setattr__(out, "product", product)
        return out

    @property
    def n_chunks(self) -> int:
        """Chunks on the anchor grid (the whole array, not only the splits)."""
        return math.ceil(self.n_samples / self.samples_per_chunk)

    def chunks(self, split: str) -> list[int]:
        """Sorted global anchor-grid chunk indices of ``"train"``, ``"val"`` or ``"test"``."""
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {SPLITS}")
        return list(self.splits[split])

    def chunk_array(self, split: str) -> np.ndarray:
        """:meth:`chunks` as a read-only int64 array, made once per manifest (plans ask for
        it every epoch)."""
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; expected one of {SPLITS}")
        return self._chunk_arrays[split]

    @functools.cached_property
    def _chunk_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name, chunks in self.splits.items():
            arr = np.asarray(chunks, dtype=np.int64)
            arr.setflags(write=False)
            out[name] = arr
        return out

    def samples(self, split: str) -> np.ndarray:
        """Sorted sample-axis indices of ``split``: those its chunks hold, within
        ``sample_range`` where the manifest has one (the anchors a plan may draw from, before
        the views' offsets, the stride and the missing steps narrow them)."""
        spc = self.samples_per_chunk
        chunks = self.chunk_array(split)
        start = chunks * spc
        stop = np.minimum(start + spc, self.n_samples)
        if self.sample_range is not None:
            start = np.maximum(start, self.sample_range[0])
            stop = np.minimum(stop, self.sample_range[1])
        count = np.maximum(stop - start, 0)
        first = np.cumsum(count) - count
        step = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
        return np.repeat(start, count) + step

    def fingerprint(self) -> str:
        """A short stable hash of the anchor grid and the split contents (its window too)."""
        body = json.dumps(
            [
                self.array,
                self.n_samples,
                self.samples_per_chunk,
                {k: list(v) for k, v in self.splits.items()},
            ],
            sort_keys=True,
        )
        if self.sample_range is not None:  # (absent otherwise: fingerprints without it stay)
            body += "|window:{}-{}".format(*self.sample_range)
        if self.steps is not None:
            body += "|steps:" + self.steps.fingerprint()
        if self.members is not None:
            body += "|members:" + self.members.fingerprint
        if self.product is not None:
            body += "|product:" + self.product.fingerprint
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def samples_fingerprint(self, split: str) -> str:
        """A short stable hash of the samples of ``split`` alone (:meth:`samples`, on this
        anchor grid: its array and chunking, a collection's members, product axes): unlike
        :meth:`fingerprint`, the same for a manifest of an archive grown since, drawn again
        over the same dates, whose ``split`` holds the same samples."""
        digest = hashlib.sha256(json.dumps([self.array, self.samples_per_chunk]).encode())
        digest.update(np.ascontiguousarray(self.samples(split), dtype="<i8").tobytes())
        for part in (self.members, self.product):
            digest.update(b"|" + (b"" if part is None else part.fingerprint.encode()))
        return digest.hexdigest()[:16]

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """This manifest as plain JSON types (``json.dumps``); :meth:`from_dict` reads it."""
        return {
            "format_version": FORMAT_VERSION,
            "array": self.array,
            "n_samples": self.n_samples,
            "samples_per_chunk": self.samples_per_chunk,
            "fractions": list(self.fractions),
            "contiguous": self.contiguous,
            "seed": self.seed,
            "sample_range": list(self.sample_range) if self.sample_range else None,
            "splits": {k: list(v) for k, v in self.splits.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitManifest:
        """The manifest :meth:`to_dict` wrote (``ValueError`` for another format version)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a split manifest is a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"unsupported split manifest format_version {version!r}; this version of "
                f"insitubatch_nodes reads format {FORMAT_VERSION} "
                "(re-create the manifest with split_by_chunk)"
            )
        try:
            rng = data.get("sample_range")
            fr = tuple(float(f) for f in data["fractions"])
            if len(fr) != 3:
                raise ValueError(f"fractions must have 3 entries, got {len(fr)}")
            return cls(
                array=str(data["array"]),
                n_samples=int(data["n_samples"]),
                samples_per_chunk=int(data["samples_per_chunk"]),
                splits={str(k): tuple(int(c) for c in v) for k, v in dict(data["splits"]).items()},
                fractions=(fr[0], fr[1], fr[2]),
                contiguous=bool(data["contiguous"]),
                seed=int(data["seed"]),
                sample_range=(int(rng[0]), int(rng[1])) if rng else None,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed split manifest: {exc!r}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the manifest as JSON, whole or not at all: an interrupted write leaves an
        earlier file at ``path`` as it was, and no temporary file (written beside it under a
        temporary name, then renamed over it)."""
        with atomic_write(path) as f:
            f.write(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SplitManifest:
        """Read a manifest written by :meth:`save`; a malformed file raises ``ValueError``."""
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)!r} is not a JSON split manifest: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)!r}: {exc}") from exc


def _allocate(n: int, fractions: Sequence[float]) -> list[int]:
    """Split ``n`` items by ``fractions`` with largest remainders (ties go to the earlier split)."""
    exact = [f * n for f in fractions]
    counts = [math.floor(x + 1e-9) for x in exact]
    rest = n - sum(counts)
    order = sorted(range(len(fractions)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def split_by_chunk(
    geom: ArrayGeometry,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    *,
    contiguous: bool = True,
    seed: int = 0,
    sample_range: tuple[Any, Any] | None = None,
    coord: Coordinate | None = None,
) -> SplitManifest:
    """Assign whole chunks of ``geom``'s sample axis to train/val/test.

    ``fractions`` are fractions of chunks (train, val, test): non-negative, summing to 1. With
    ``contiguous=True`` the splits are consecutive runs in that order; with ``contiguous=False``
    chunks are shuffled by ``seed`` first (for exchangeable samples). ``sample_range=(start,
    stop)`` is a window of the half-open sample range: the splits hold the chunks overlapping
    it (snapped outward to chunk boundaries: whole chunks are read), but their samples are the
    window's alone — no anchor outside it is delivered, and by default no step a view reads
    lies outside it either, as no window reads across a split's edge
    (``PlanConfig.cross_split_windows=True`` lets the steps leave it). Two manifests of
    adjacent windows whose boundary falls inside a chunk share that chunk, never a sample.
    A split with no chunks is legal and yields nothing.

    With ``coord`` (a :class:`~insitubatch_nodes.io.coords.Coordinate` of ``geom``'s sample axis,
    e.g. ``open_coordinates(store, geom)["time"]``) the contiguous splits follow the
    coordinate's *values*, lowest first: ``train`` holds the earliest times, ``test`` the
    latest, also where the times run backwards along the samples (newest first:
    :attr:`~insitubatch_nodes.io.coords.Coordinate.decreasing`), whose index order would give
    ``train`` the newest chunks (the index order, as without ``coord``, where they increase).
    ``sample_range`` is then a window of coordinate values: the samples with ``start <= value
    < stop`` (half-open; dates as numpy datetime64, datetime or ISO strings for a time
    coordinate, read in its calendar), found by
    :meth:`~insitubatch_nodes.io.coords.Coordinate.index_range`, then taken like an index
    range. The manifest records that index range as its ``sample_range``. (Before
    2026-12-07 ``coord`` needed ``sample_range``, and the splits followed the index order
    whatever the times' direction.)
    """
    check_instance("geom", geom, ArrayGeometry, "an ArrayGeometry (open_geometries(store)[name])")
    contiguous, seed = check_bool("contiguous", contiguous), check_int("seed", seed, minimum=0)
    fr = tuple(float(f) for f in fractions)
    if len(fr) != 3:
        raise ValueError(f"fractions must be (train, val, test), got {len(fr)} values: {fr}")
    if any(f < 0 or not math.isfinite(f) for f in fr):
        raise ValueError(f"fractions must be finite and non-negative, got {fr}")
    if abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"fractions must sum to 1, got {fr} (sum {sum(fr):g})")
    spc, n = geom.samples_per_chunk, geom.n_samples
    first, stop_chunk = 0, geom.n_chunks
    if coord is not None:
        if not isinstance(coord, Coordinate):
            raise TypeError(
                f"coord must be a Coordinate (see open_coordinates), got {type(coord).__name__}"
            )
        if len(coord) != n:
            raise ValueError(
                f"coordinate {coord.name!r} has {len(coord)} values but {geom.path!r} has {n} "
                "samples: pass a coordinate of this array's sample axis"
            )
    if sample_range is not None:
        if isinstance(sample_range, (str, bytes)) or len(sample_range) != 2:
            raise ValueError(f"sample_range must be a pair (start, stop), got {sample_range!r}")
        if coord is not None:
            sample_range = coord.index_range(*sample_range)
        elif not all(
            isinstance(x, int | np.integer) and not isinstance(x, bool) for x in sample_range
        ):
            raise TypeError(
                f"sample_range {tuple(sample_range)!r} is not a pair of sample indices; for a "
                "window of coordinate values (dates, heights) pass the coordinate too: "
                "split_by_chunk(geom, ..., sample_range=(start, stop), "
                "coord=open_coordinates(store, geom)['time'])"
            )
        start, stop = (int(x) for x in sample_range)
        if not 0 <= start < stop <= n:
            raise ValueError(
                f"sample_range must satisfy 0 <= start < stop <= {n}, got ({start}, {stop})"
            )
        first, stop_chunk = start // spc, (stop - 1) // spc + 1
        sample_range = (start, stop)
    eligible = np.arange(first, stop_chunk, dtype=np.int64)
    if not contiguous:
        eligible = np.random.default_rng(seed).permutation(eligible)
    elif coord is not None and coord.decreasing:  # in the values' order: earliest first
        eligible = eligible[::-1]
    counts = _allocate(len(eligible), fr)
    bounds = np.cumsum([0, *counts])
    splits = {
        name: tuple(np.sort(eligible[bounds[i] : bounds[i + 1]]).tolist())
        for i, name in enumerate(SPLITS)
    }
    return SplitManifest(
        array=geom.path,
        n_samples=n,
        samples_per_chunk=spc,
        splits=splits,
        fractions=(fr[0], fr[1], fr[2]),
        contiguous=contiguous,
        seed=int(seed),
        sample_range=sample_range,
        members=geom.members,
        product=geom.product,
    )


def _sorted_chunks(chunks: Any) -> np.ndarray:
    """Chunk indices as a sorted int64 array."""
    arr = np.asarray(list(chunks) if not isinstance(chunks, np.ndarray) else chunks)
    return np.sort(arr.astype(np.int64, copy=False).ravel())


def split_by_member(
    collection: Collection,
    splits: Mapping[str, Sequence[object] | float],
    *,
    by: str | None = None,
    seed: int = 0,
) -> SplitManifest:
    """Split ``collection`` by member: every member (with ``by``, every group of members
    sharing ``collection.keys[by]``, e.g. ``by="well"``) lies wholly in one split, so no member
    (nor group) is in two. ``splits`` maps ``"train"``, ``"val"`` and ``"test"`` either to
    lists of member names (group values with ``by``), or to fractions of the members (groups),
    drawn by ``seed`` and allocated by largest remainders (fractions summing to at most 1; what
    is left over is in no split). A name listed in two splits raises ``ValueError``, an unknown
    one ``KeyError``.

    Returns a :class:`SplitManifest` over the collection's virtual sample axis (its first
    variable's chunk grid; every variable shares it): a member's chunks are one contiguous
    run of it, so each split is whole chunks, as for :func:`split_by_chunk`.
    """
    if not isinstance(collection, Collection):
        raise TypeError(f"split_by_member takes a Collection, got {type(collection).__name__}")
    if not isinstance(splits, Mapping) or not splits:
        raise TypeError("splits maps 'train', 'val', 'test' to member names or fractions")
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split names {sorted(unknown)}; expected {SPLITS}")
    if by is None:
        unit_of = np.arange(len(collection), dtype=np.int64)
        units = list(collection.members)
    else:
        if by not in collection.keys:
            raise KeyError(f"no member key {by!r}; the collection has {sorted(collection.keys)}")
        values, unit_of = np.unique(collection.keys[by], return_inverse=True)
        units = [str(v) for v in values.tolist()]
    kinds = {isinstance(v, int | float) and not isinstance(v, bool) for v in splits.values()}
    if len(kinds) != 1:
        raise TypeError("give every split either a list of names or a fraction, not both")
    owner = np.full(len(units), -1, dtype=np.int64)  # which split holds each unit
    order = [name for name in SPLITS if name in splits]
    if kinds == {True}:
        fr = [float(splits[name]) for name in order]  # type: ignore[arg-type]
        if any(f < 0 or not math.isfinite(f) for f in fr) or sum(fr) > 1 + 1e-6:
            raise ValueError(f"fractions must be non-negative and sum to at most 1, got {fr}")
        perm = np.random.default_rng(seed).permutation(len(units))
        counts = _allocate(len(units), [*fr, max(0.0, 1 - sum(fr))])
        bounds = np.cumsum([0, *counts])
        for k in range(len(order)):
            owner[perm[bounds[k] : bounds[k + 1]]] = k
    else:
        index = {u: i for i, u in enumerate(units)}
        for k, name in enumerate(order):
            given = splits[name]
            if isinstance(given, str):
                raise TypeError(f"splits[{name!r}] is a string: give a list of names")
            for u in given:  # type: ignore[union-attr]
                i = index.get(str(u))
                if i is None:
                    what = "member" if by is None else f"{by!r} value"
                    raise KeyError(f"splits[{name!r}] names {u!r}, which is no {what}")
                if owner[i] >= 0 and owner[i] != k:
                    raise ValueError(f"{u!r} is in both {order[owner[i]]!r} and {name!r}")
                owner[i] = k
    geom = collection[collection.variables[0]]
    members = geom.members
    assert members is not None
    spc = geom.samples_per_chunk
    first = members.chunk_base
    count = -(-members.lengths // spc)  # the chunks holding a member's samples
    member_owner = owner[unit_of]
    out: dict[str, tuple[int, ...]] = {}
    for k, name in enumerate(order):
        mine = np.flatnonzero(member_owner == k)
        start, n = first[mine], count[mine]
        offsets = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        out[name] = tuple((np.repeat(start, n) + offsets).tolist())
    shares = [len(np.flatnonzero(owner == k)) / max(len(units), 1) for k in range(len(order))]
    fractions = dict(zip(order, shares, strict=True))
    return SplitManifest(
        array=geom.path,
        n_samples=geom.n_samples,
        samples_per_chunk=spc,
        splits=out,
        fractions=(
            fractions.get("train", 0.0),
            fractions.get("val", 0.0),
            fractions.get("test", 0.0),
        ),
        contiguous=False,
        seed=int(seed),
        members=members,
    )
