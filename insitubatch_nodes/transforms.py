"""Chunk transforms: per-chunk work that runs once, on the decode threads, before any gather.

A chunk transform is a callable ``DecodedChunk -> DecodedChunk``. The fetch stage runs the
transforms of an array on every chunk it decodes, after all of the chunk's stored objects have
landed and before the chunk becomes ready: its output is what the pool holds and what every
batch that reads the chunk gathers from. A chunk already resident (a pool hit) is not decoded or
transformed again, so a transform runs at most once per chunk per epoch — the cost is shared by
every sample the chunk holds. That makes it the place for elementwise, order-independent work
(scaling, unit conversion, dtype casts, chunk-local regridding); work that needs the assembled
batch or per-sample randomness is a ``batch_transform``.

Contracts (checked; a violation raises :class:`ChunkTransformError` naming the transform):

* **Scope.** ``chunk_transforms`` is one ordered list. A bare transform runs on every array;
  :func:`applies` restricts one to arrays by zarr path, and a path that names no array of the
  pipeline raises ``ValueError`` at construction. Decide *where* a transform runs with
  :func:`applies`, never with a test on ``chunk.array`` inside it: the engine sizes slots and
  batches from the declared scope.
* **Shape.** ``chunk.data`` is ``(n_samples, *inner_shape)`` with the sample axis first (``n``
  is the chunk's sample count, smaller for a partial last chunk). A transform may change it in
  place or assign a new array. Without a declaration the output must keep the input's shape
  and dtype. A transform that changes the inner shape or the dtype declares a method
  ``output_inner(geometry) -> (inner_shape, dtype)``; slots and batch buffers are then sized at
  the declared output, and an output that disagrees with the declaration raises — it is never
  truncated or padded. The sample axis is the engine's: its length cannot change.
* **Threads.** Transforms run concurrently on several decode threads and must be thread-safe.
  They should be vectorized (numpy releases the GIL for whole-array work): a per-element Python
  loop holds the GIL and serializes decoding. ``insitubatch-nodes check-transform`` tests both
  contracts on one real chunk.
* **Errors.** An exception inside a transform is a bug, not a bad chunk: it reaches the
  consumer (as :class:`ChunkTransformError`, the original chained) whatever ``on_bad_chunk`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from insitubatch_nodes._checks import check_chunk_transforms
from insitubatch_nodes.errors import ChunkTransformError
from insitubatch_nodes.io.collection_paths import renamed_variables
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.work_dtypes import (
    float16_revision,
    float_dtype,
    standardise_in_place,
    work_dtype,
)

__all__ = [
    "ChunkTransform",
    "ChunkTransforms",
    "Coarsen",
    "DecodedChunk",
    "Scoped",
    "StandardScaler",
    "applies",
    "standardise_in_place",  # (defined in work_dtypes, importable from here as before)
    "transform_name",
    "work_dtype",  # (likewise)
]


@dataclass
class DecodedChunk:
    """One decoded chunk of one array, as a chunk transform sees it.

    ``array`` is the zarr path, ``chunk_index`` the chunk's index along the sample axis,
    ``sample_range`` the half-open range of sample indices it holds and ``data`` its values,
    sample axis first: ``(sample_range[1] - sample_range[0], *inner_shape)``. A transform may
    write into ``data`` or assign a new array to it, and returns the chunk.

    On a collection of independent members (slides, scenes, a plate's fields), ``member`` is
    the index of the member the chunk belongs to (``None`` elsewhere), and ``chunk_index`` and
    ``sample_range`` count within that member, as ``batch.sample_indices`` do: a member's last
    chunk holds only its own samples, never the padding that follows it on the collection's
    virtual axis. (Stores concatenated or joined along time are one axis: ``member`` is
    ``None`` and the indices run along it.)
    """

    array: str
    chunk_index: int
    sample_range: tuple[int, int]
    data: np.ndarray
    member: int | None = None

    @property
    def n_samples(self) -> int:
        return self.sample_range[1] - self.sample_range[0]


ChunkTransform = Callable[[DecodedChunk], DecodedChunk]
"""A callable run on every decoded chunk of the arrays in its scope (see the module doc)."""


def transform_name(transform: Any) -> str:
    """How messages name a transform: its repr for objects, the qualified name for functions."""
    inner = transform.transform if isinstance(transform, Scoped) else transform
    name = getattr(inner, "__qualname__", None)
    if name is not None and not isinstance(inner, type):
        module = getattr(inner, "__module__", None)
        return f"{module}.{name}" if module and module != "__main__" else str(name)
    if type(inner).__repr__ is object.__repr__:  # the default repr only shows an address
        return f"{type(inner).__qualname__} instance"
    return repr(inner)


@dataclass(frozen=True)
class Scoped:
    """A chunk transform restricted to the arrays in ``names`` (build it with :func:`applies`)."""

    names: tuple[str, ...]
    transform: ChunkTransform

    def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
        return self.transform(chunk)

    def __repr__(self) -> str:
        return f"applies({list(self.names)!r}, {transform_name(self.transform)})"


def applies(names: Sequence[str] | str, transform: ChunkTransform) -> Scoped:
    """Run ``transform`` only on the arrays whose zarr paths are in ``names``.

    The names are array paths (``"t2m"``, ``"group/z"``; ``""`` or ``"/"`` for an array at the
    store root), not batch labels: two labels that
    read one array share its chunks, so they share its chunk transforms too (per-label work
    belongs in a ``batch_transform``). A name that matches no array of the pipeline raises
    ``ValueError`` when the pipeline is built. Wrapping a scoped transform again keeps only
    the arrays both scopes name.
    """
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Sequence) or not names:
        raise TypeError(f"applies() takes a non-empty list of array paths, got {names!r}")
    cleaned: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"applies(): array paths must be strings, got {name!r}")
        cleaned.append(name.strip("/"))
    if not callable(transform):
        raise TypeError(
            f"applies() takes a chunk transform (DecodedChunk -> DecodedChunk), got {transform!r}"
        )
    if isinstance(transform, Scoped):
        inner = set(transform.names)
        unknown = [n for n in cleaned if n not in inner]
        if unknown:
            raise ValueError(
                f"applies({cleaned!r}, ...) wraps {transform!r}, which never runs on {unknown}"
            )
        return Scoped(tuple(dict.fromkeys(cleaned)), transform.transform)
    return Scoped(tuple(dict.fromkeys(cleaned)), transform)


def _unwrap(transform: Any) -> Any:
    return transform.transform if isinstance(transform, Scoped) else transform


# ---------------------------------------------------------------------------------------------
# The resolved chain: which transforms run on which array, and what they produce
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    transform: ChunkTransform
    name: str
    declared: bool  # it declares output_inner
    inner_shape: tuple[int, ...]  # what it must produce (per sample)
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class _ArrayChain:
    steps: tuple[_Step, ...]
    source: ArrayGeometry  # the decoded array
    output: ArrayGeometry  # what the slots hold

    @property
    def reshapes(self) -> bool:
        """True when the output differs from the decoded chunk in inner shape or dtype."""
        return (self.output.inner_shape, self.output.dtype) != (
            self.source.inner_shape,
            self.source.dtype,
        )


@dataclass
class ChunkTransforms:
    """``chunk_transforms`` resolved against a pipeline's arrays (``geoms``: path -> geometry).

    Construction checks the scopes (an unknown path raises ``ValueError``), asks every
    reshaping transform for its ``output_inner`` and every transform with a
    ``validate(geometries)`` method to check the arrays it will see (e.g. a scaler that has
    statistics for each). :attr:`outputs` maps each path to the geometry of its transformed
    chunks (the input geometry when nothing reshapes it).
    """

    transforms: Sequence[ChunkTransform]
    geoms: Mapping[str, ArrayGeometry]
    #: paths of the static arrays the pipeline reads besides ``geoms``: read once whole, they
    #: take no chunk transforms, and a transform that names one (``applies``, a scaler's
    #: statistics) raises ``ValueError`` rather than leave it untransformed without a word
    static: Collection[str] = ()
    _chains: dict[str, _ArrayChain] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.transforms = check_chunk_transforms(self.transforms)
        bases = {path: g.base for path, g in self.geoms.items()}
        for t in self.transforms:
            _refuse_static(t, [n for n in self.static if n not in bases])
            if isinstance(t, Scoped):
                unknown = [n for n in t.names if n not in bases]
                if unknown:
                    raise ValueError(
                        f"{t!r} names {unknown}, which the pipeline does not read; its arrays "
                        f"are {sorted(bases)} (names are zarr array paths, not batch labels)"
                        + collection_hint(unknown, self.geoms, "applies([{path!r}], ...)")
                    )
        chains: dict[str, _ArrayChain] = {}
        for path, source in bases.items():
            current = source
            steps: list[_Step] = []
            for t in self.transforms:
                if isinstance(t, Scoped) and path not in t.names:
                    continue
                inner = _unwrap(t)
                declare = getattr(inner, "output_inner", None)
                if declare is not None:
                    shape, dtype = _declaration(t, declare, current)
                    current = current.with_inner(shape, dtype)
                steps.append(
                    _Step(
                        t,
                        transform_name(t),
                        declare is not None,
                        current.inner_shape,
                        current.dtype,
                    )
                )
            chains[path] = _ArrayChain(tuple(steps), source, current)
        self._chains = chains
        for t in self.transforms:
            validate = getattr(_unwrap(t), "validate", None)
            if validate is None:
                continue
            scope = {
                path: self._input_of(path, t)
                for path in bases
                if not isinstance(t, Scoped) or path in t.names
            }
            validate(scope)

    def _input_of(self, path: str, transform: ChunkTransform) -> ArrayGeometry:
        """The geometry ``transform`` sees on ``path`` (after the transforms before it)."""
        for t, given in zip(self.chain(path), self.inputs(path), strict=True):
            if t is transform:
                return given
        return self._chains[path].output

    def inputs(self, path: str) -> tuple[ArrayGeometry, ...]:
        """The geometry each transform of ``path`` is given, in the order of :meth:`chain`."""
        current = self._chains[path].source
        given = []
        for step in self._chains[path].steps:
            given.append(current)
            current = current.with_inner(step.inner_shape, step.dtype)
        return tuple(given)

    @property
    def outputs(self) -> dict[str, ArrayGeometry]:
        """Path -> the geometry of the chunks the pool holds (after every transform)."""
        return {path: c.output for path, c in self._chains.items()}

    def output_view(self, view: ArrayGeometry) -> ArrayGeometry:
        """A label's view as batches carry it (the output geometry, at the view's offset and
        with its window; a patched view, which takes no chunk transforms, as it is)."""
        if view.patch is not None:
            self.refuse_patched(view.path)
            return view
        if view.select is not None:  # the selection is taken from the (transformed) slot
            if self.reshapes(view.path):
                raise ValueError(
                    f"array {view.path!r} is read through a selected view, and its chunk "
                    "transforms change its shape or dtype: select from what they make in a "
                    "batch transform instead, or keep transforms that preserve the shape"
                )
            return view
        out = self._chains[view.path].output
        out = out.shift(view.offset) if view.offset else out
        return out if view.window_offsets is None else out.window(view.window_offsets)

    def refuse_patched(self, path: str) -> None:
        """Raise ``ValueError`` when transforms run on ``path``, an array read through patched
        views (its slots hold one stored tile, not a chunk)."""
        if self.active(path):
            raise ValueError(
                f"array {path!r} is read through patched views, which take no chunk "
                "transforms (a slot holds one stored tile, not a chunk); transform the "
                "patches in a batch transform instead"
            )

    def chain(self, path: str) -> tuple[ChunkTransform, ...]:
        """The transforms that run on ``path``, in order (what its cached chunks depend on)."""
        return tuple(step.transform for step in self._chains[path].steps)

    def source(self, path: str) -> ArrayGeometry:
        """The geometry of ``path`` as decoded, before any transform."""
        return self._chains[path].source

    def active(self, path: str) -> bool:
        """Whether any transform runs on ``path``."""
        return bool(self._chains[path].steps)

    def reshapes(self, path: str) -> bool:
        """Whether the transforms of ``path`` change its inner shape or dtype."""
        return self._chains[path].reshapes

    def standardises(self, path: str) -> bool:
        """Whether a :class:`StandardScaler` runs on ``path`` (an array this pipeline reads)."""
        chain = self._chains.get(path)
        return chain is not None and any(
            isinstance(_unwrap(step.transform), StandardScaler) for step in chain.steps
        )

    def __len__(self) -> int:
        return len(self.transforms)

    def apply(
        self,
        path: str,
        chunk_index: int,
        sample_range: tuple[int, int],
        data: np.ndarray,
        member: tuple[int, str] | None = None,
    ) -> np.ndarray:
        """Run the transforms of ``path`` on one decoded chunk; the checked output. ``member``
        (index, name): a collection member's chunk, ``chunk_index`` and ``sample_range``
        counted within it."""
        chain = self._chains[path]
        n = sample_range[1] - sample_range[0]
        index = None if member is None else member[0]
        chunk = DecodedChunk(path, chunk_index, sample_range, data, index)
        where = f"array {path!r} chunk {chunk_index}"
        if member is not None:
            where = f"array {path!r} member {member[1]!r} chunk {chunk_index}"
        for step in chain.steps:
            try:
                out = step.transform(chunk)
            except Exception as exc:
                raise ChunkTransformError(
                    f"chunk transform {step.name} raised on {where}: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(out, DecodedChunk):
                raise ChunkTransformError(
                    f"chunk transform {step.name} returned {type(out).__name__} on {where}; a "
                    "chunk transform returns the DecodedChunk it was given (or a new one)"
                )
            got = out.data
            if not isinstance(got, np.ndarray):
                raise ChunkTransformError(
                    f"chunk transform {step.name} set data to a {type(got).__name__} on "
                    f"{where}; chunk data must be a numpy array"
                )
            want = (n, *step.inner_shape)
            if got.shape != want or got.dtype != step.dtype:
                raise ChunkTransformError(_mismatch(step, where, want, got, chain.source))
            chunk = out
        return chunk.data


def _refuse_static(transform: ChunkTransform, static: Sequence[str]) -> None:
    """``ValueError`` when ``transform`` names one of the ``static`` arrays (by ``applies``, or
    as a scaler with statistics for it): chunk transforms never run on a static array."""
    inner = _unwrap(transform)
    named = set(transform.names) if isinstance(transform, Scoped) else set(static)
    if isinstance(inner, StandardScaler):
        named &= set(inner.mean)
    elif not isinstance(transform, Scoped):
        return  # a bare transform runs on the arrays with samples, as documented
    hit = sorted(named & set(static))
    if hit:
        how = (
            "standardise it per label with Statistics.normalizer (a batch transform), and "
            "leave its statistics out of the scaler (Statistics.scaler([labels with samples]))"
            if isinstance(inner, StandardScaler)
            else "transform it in a batch transform instead"
        )
        raise ValueError(
            f"{transform_name(transform)} names the static array(s) {hit} (no sample axis): a "
            f"static array is read once whole and takes no chunk transforms, so its values "
            f"would reach the batch untransformed; {how}"
        )


def collection_hint(names: Sequence[str], geoms: Mapping[str, ArrayGeometry], how: str) -> str:
    """``"; 'data' is a collection's variable: ..."`` for each of ``names`` that is the variable
    name of a collection view among ``geoms`` (whose path is ``"<collection>:<variable>"``):
    transforms name a collection's arrays by that path, ``how`` (formatted with ``path``) says
    how to write it; ``""`` when none is."""
    virtual = {p.rpartition(":")[2]: p for p, g in geoms.items() if g.members is not None}
    return "".join(
        f"; {n!r} is a collection's variable, named by its view's path (coll[{n!r}].path): "
        + how.format(path=virtual[n])
        for n in names
        if n in virtual
    )


def _declaration(
    transform: Any, declare: Callable[[ArrayGeometry], Any], geom: ArrayGeometry
) -> tuple[tuple[int, ...], np.dtype[Any]]:
    name = transform_name(transform)
    try:
        declared = declare(geom)
    except Exception as exc:  # the transform refuses this array (or its declaration is broken)
        raise ValueError(f"{name} cannot run on array {geom.path!r}: {exc}") from exc
    try:
        shape_, dtype_ = declared
        shape = tuple(int(s) for s in shape_)
        dtype = np.dtype(dtype_)
    except Exception as exc:
        raise ValueError(
            f"{name}.output_inner({geom!r}) returned {declared!r}; it must return "
            "(inner_shape, dtype) for one sample of the array (sample axis excluded)"
        ) from exc
    if len(shape) != len(geom.inner_shape) or any(s <= 0 for s in shape):
        raise ValueError(
            f"{name}.output_inner declares inner shape {shape} for {geom.path!r}, whose "
            f"samples have {len(geom.inner_shape)} field axes {geom.inner_shape}: a chunk "
            "transform may resize the field axes (to a positive length) but not add or drop one"
        )
    return shape, dtype


def _mismatch(
    step: _Step, where: str, want: tuple[int, ...], got: np.ndarray, source: ArrayGeometry
) -> str:
    have = f"shape {got.shape} dtype {got.dtype}"
    expected = f"shape {want} dtype {step.dtype}"
    if step.declared:
        head = (
            f"chunk transform {step.name} produced {have} on {where}, but its output_inner "
            f"declares {expected}"
        )
        fix = "make output_inner return what the transform really produces"
    else:
        head = (
            f"chunk transform {step.name} produced {have} on {where}, but its input was "
            f"{expected} and it declares no output_inner"
        )
        fix = (
            "a transform that changes the shape or dtype must declare "
            "output_inner(geometry) -> (inner_shape, dtype) (or cast back, e.g. "
            f"data.astype({str(step.dtype)!r}))"
        )
    if got.ndim and got.shape[0] != want[0]:
        fix += "; the sample axis (first) is the engine's and must keep its length"
    return f"{head}: {fix}. Nothing was truncated or padded (array {source.path!r})"


# ---------------------------------------------------------------------------------------------
# Shipped transforms
# ---------------------------------------------------------------------------------------------


#: StandardScaler works on a chunk in pieces of about this size (a fraction of a core's L2).
_BLOCK_BYTES = 1 << 20


class StandardScaler:
    """``(x - mean) / (std + eps)`` with fixed, pre-fitted statistics per array.

    ``mean`` and ``std`` map zarr array paths to statistics shaped to broadcast against one
    sample's inner shape: a scalar (one value per array) or e.g. ``(n_level, 1, 1)`` for
    per-level statistics of a ``(level, lat, lon)`` sample. They are applied unchanged to every
    chunk (never re-estimated per chunk). Every array the scaler runs on (its scope: every array,
    or those named with :func:`applies`) must have statistics; that, their shapes and ``std >=
    0`` are checked when the pipeline is built. Floating-point arrays keep their dtype (the
    work is in place; float16 is computed in float32 and rounded back, so neither ``x - mean``
    nor ``1 / std`` overflows where the result does not); integer arrays become float32
    (float64 for 32/64-bit integers), which the scaler declares through ``output_inner``.

    ``cache_key`` identifies the fitted statistics (e.g. a version you bump on every re-fit); a
    persistent chunk cache keys transformed chunks on it; part of the repr. ``check`` checks the
    arrays at the build (``Statistics.scaler()``: their levels' values; kept by copies, pickles).
    """

    identity_excludes = ("_check",)  # (cache.fingerprint: a refusal, not the bytes made)

    def __init__(
        self,
        mean: Mapping[str, Any],
        std: Mapping[str, Any],
        *,
        eps: float = 1e-8,
        cache_key: str | None = None,
        check: Callable[[Mapping[str, ArrayGeometry]], None] | None = None,
    ) -> None:
        if not isinstance(mean, Mapping) or not isinstance(std, Mapping):
            raise TypeError("StandardScaler takes mean and std as {array path: statistics} dicts")
        if set(mean) != set(std):
            raise ValueError(
                f"StandardScaler: mean has statistics for {sorted(mean)}, std for {sorted(std)}; "
                "give both for the same arrays"
            )
        if cache_key is not None and not isinstance(cache_key, str):
            raise TypeError(f"cache_key must be a string or None, got {cache_key!r}")
        self.mean = {str(k).strip("/"): np.asarray(v, dtype=np.float64) for k, v in mean.items()}
        self.std = {str(k).strip("/"): np.asarray(v, dtype=np.float64) for k, v in std.items()}
        for path, s in self.std.items():
            if not bool(np.all(np.isfinite(s))) or bool(np.any(s < 0)):
                raise ValueError(f"StandardScaler: std of {path!r} must be finite and >= 0")
            if not bool(np.all(np.isfinite(self.mean[path]))):
                raise ValueError(f"StandardScaler: mean of {path!r} must be finite")
        self.eps = float(eps)
        self.cache_key = cache_key
        self._cast: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
        self._alias: dict[str, str] = {}  # another collection's variable -> its key (validate)
        self._check = check

    def __repr__(self) -> str:
        key = f", cache_key={self.cache_key!r}" if self.cache_key is not None else ""
        return f"StandardScaler(arrays={sorted(self.mean)}{key})"

    def __getstate__(self) -> dict[str, Any]:
        # the per-dtype casts are derived on use: leaving them out keeps a pickle (and the cache's
        # fingerprint) the same before and after use; no check: pickled as before checks were
        state = dict(self.__dict__)
        state["_cast"], state["_alias"] = {}, {}
        return {k: v for k, v in state.items() if k != "_check" or v is not None}

    def output_inner(self, geometry: ArrayGeometry) -> tuple[tuple[int, ...], np.dtype[Any]]:
        """The field as stored, in the float dtype the scaler computes in."""
        return geometry.inner_shape, float_dtype(geometry.dtype)

    def cache_revision(self, geometry: ArrayGeometry) -> str | None:
        """What a persistent cache adds to this scaler's identity (its ``cache_key`` names the
        statistics, not the code) on an array given as ``geometry``: see
        :mod:`~insitubatch_nodes.cache.fingerprint`."""
        return float16_revision(geometry)

    def validate(self, geometries: Mapping[str, ArrayGeometry]) -> None:
        """Check that every array in scope has statistics that broadcast to its sample (those
        of a collection's variable are those of its key naming that variable of other members)."""
        self._alias.update(renamed_variables(set(geometries) - set(self.mean), self.mean))
        missing = sorted(set(geometries) - set(self.mean) - set(self._alias))
        if missing:
            raise ValueError(
                f"{self!r} runs on {missing} but has no statistics for them; add them, or "
                "restrict the scaler with applies([...], scaler)"
                + collection_hint(
                    sorted(set(self.mean) - set(geometries)), geometries, "key {path!r}"
                )
            )
        for path, geom in geometries.items():
            key = self._alias.get(path, path)
            for what, stat in (("mean", self.mean[key]), ("std", self.std[key])):
                try:
                    shape = np.broadcast_shapes(stat.shape, geom.inner_shape)
                except ValueError:
                    shape = None
                if shape != geom.inner_shape:
                    raise ValueError(
                        f"StandardScaler: the {what} of {path!r} has shape {stat.shape}, which "
                        f"does not broadcast to its sample shape {geom.inner_shape}; shape "
                        "per-level statistics like (n_level, 1, 1)"
                    )
        if (check := getattr(self, "_check", None)) is not None:  # (pickled before: none)
            check({self._alias.get(p, p): g for p, g in geometries.items()})

    def _stats(self, path: str, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
        key = (path, dtype.str)
        got = self._cast.get(key)
        if got is None:  # a benign race: two threads may compute the same small arrays
            path = self._alias.get(path, path)
            mean = self.mean[path].astype(dtype)
            scale = (1.0 / (self.std[path] + self.eps)).astype(dtype)
            got = self._cast[key] = (mean, scale)
        return got

    def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
        data = chunk.data
        out_dtype = float_dtype(data.dtype)
        work = work_dtype(out_dtype)
        mean, scale = self._stats(chunk.array, work)
        if data.dtype == work and data.flags.writeable:
            # In blocks of about _BLOCK_BYTES along the sample axis, so the second operation
            # reads what the first just wrote from cache, not from memory (measured: 3.5 ->
            # 5.3 GB/s on a chunk of 16 (4, 181, 360) float32 samples).
            step = max(1, _BLOCK_BYTES // max(1, data[:1].nbytes))
            for lo in range(0, data.shape[0], step):
                block = data[lo : lo + step]
                np.subtract(block, mean, out=block)
                np.multiply(block, scale, out=block)
        else:
            out = np.subtract(data, mean, dtype=work)
            np.multiply(out, scale, out=out)
            chunk.data = out if work == out_dtype else out.astype(out_dtype)
        return chunk


class Coarsen:
    """Block mean over the field axes: each ``factor`` × … block of a sample becomes one value.

    ``factor`` is one integer for every field axis or a tuple with one per field axis (1 leaves
    an axis alone). Each field axis must be divisible by its factor (checked when the pipeline is
    built). Floating-point arrays keep their dtype (a float16 block is summed in float32, as
    numpy's own mean does: its sum may pass float16's 65504 where its mean does not); integer
    ones become float32 (float64 for 32/64-bit integers). A NaN in a block makes its mean NaN
    (numpy's mean; xarray's ``coarsen(...).mean()`` skips NaNs unless ``skipna=False``). The
    reference example of a reshaping transform: it declares its output through
    ``output_inner``.
    """

    def __init__(self, factor: int | Sequence[int]) -> None:
        given: Any = factor  # a float (1.5) is no sequence: refused below, as a str is
        factors = (given,) if not isinstance(given, Sequence) else tuple(given)
        if not factors or any(
            isinstance(f, bool) or not isinstance(f, int | np.integer) or f < 1 for f in factors
        ):
            raise ValueError(
                f"Coarsen factor must be a positive integer (or a tuple), got {factor!r}"
            )
        self.factor = factor if isinstance(factor, int | np.integer) else factors
        self._factors = tuple(int(f) for f in factors)

    def __repr__(self) -> str:
        return f"Coarsen({self.factor!r})"

    def _per_axis(self, inner: tuple[int, ...], path: str) -> tuple[int, ...]:
        if len(self._factors) == 1:
            return self._factors * len(inner)
        if len(self._factors) != len(inner):
            raise ValueError(
                f"Coarsen{self._factors} has {len(self._factors)} factors but {path!r} has "
                f"{len(inner)} field axes {inner}"
            )
        return self._factors

    def output_inner(self, geometry: ArrayGeometry) -> tuple[tuple[int, ...], np.dtype[Any]]:
        """Each field axis divided by its factor (``ValueError`` where one does not divide)."""
        inner = geometry.inner_shape
        factors = self._per_axis(inner, geometry.path)
        bad = [(n, f) for n, f in zip(inner, factors, strict=True) if n % f]
        if bad:
            raise ValueError(
                f"Coarsen({self.factor!r}): the field axes {inner} of {geometry.path!r} are not "
                f"divisible by the factors {factors}"
            )
        out = tuple(n // f for n, f in zip(inner, factors, strict=True))
        return out, float_dtype(geometry.dtype)

    def cache_revision(self, geometry: ArrayGeometry) -> str | None:
        """What a persistent cache adds to this transform's identity on an array given as
        ``geometry``: see :mod:`~insitubatch_nodes.cache.fingerprint`."""
        return float16_revision(geometry)

    def __call__(self, chunk: DecodedChunk) -> DecodedChunk:
        data = chunk.data
        inner = data.shape[1:]
        factors = self._per_axis(inner, chunk.array)
        split: list[int] = [data.shape[0]]
        for n, f in zip(inner, factors, strict=True):
            split += [n // f, f]
        blocks = data.reshape(split)
        axes = tuple(range(2, 2 * len(inner) + 1, 2))
        out_dtype = float_dtype(data.dtype)
        mean = blocks.mean(axis=axes, dtype=work_dtype(out_dtype))
        chunk.data = mean.astype(out_dtype, copy=False)
        return chunk
