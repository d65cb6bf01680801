"""The gather stage: build each batch from resident chunks with vectorised copies.

The read plan emits each batch's rows in sample order, so for every label the rows that come
from one chunk are one contiguous run of the batch: each distinct chunk contributes one
``np.take`` (or slice copy) straight into the batch — Python work is O(chunks in the batch),
never O(samples).

Batches are in native byte order whatever the slots hold: the buffers are allocated native and
the copy converts (a slot is native already unless a chunk transform declared otherwise: the
decoder swaps big-endian chunks as it writes them, see :mod:`insitubatch_nodes.io.geometry`).

Batch arrays are carved from the graph's reusable batch buffers
(:mod:`~insitubatch_nodes.stages.buffers`), which the stage context makes: a buffer is handed out
again only once everything made from the batch that borrowed it is gone. The stage gathers
each of the plan's views (a window's steps one by one) into its destination in the batch
(``buffer[:, t]`` for step ``t``), so a window ``(batch, T, *inner)`` is assembled in place.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from torchdata.nodes import BaseNode

from insitubatch_nodes import _runtime
from insitubatch_nodes._checks import check_batch_transforms
from insitubatch_nodes.batch import Batch, BatchTransform
from insitubatch_nodes.errors import InSituError, PipelineInterrupted
from insitubatch_nodes.forcing_grid import refuse_forcings_elsewhere
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.plan.patches import patch_spec
from insitubatch_nodes.slots import is_level_major
from insitubatch_nodes.stack import Stack
from insitubatch_nodes.stages._graph import SOURCE_KEY, source_start_state, source_state
from insitubatch_nodes.stages._memrule import most_transform_bytes
from insitubatch_nodes.stages._ranges import ranged
from insitubatch_nodes.stages._select import SelectedGather
from insitubatch_nodes.stages._windows import gather_windows
from insitubatch_nodes.stages._wiring import check_wiring, claim
from insitubatch_nodes.stages.buffers import batches_in_flight
from insitubatch_nodes.stages.context import StageContext
from insitubatch_nodes.stages.resident import ResidentBatch
from insitubatch_nodes.static import StaticFields
from insitubatch_nodes.transforms import ChunkTransforms, transform_name
from insitubatch_nodes.work_dtypes import standardise_in_place

__all__ = [
    "PARALLEL_GATHER_BYTES",
    "PARALLEL_PIECE_BYTES",
    "STRIDED_ROW_BYTES",
    "STRIDED_SCRATCH_BYTES",
    "GatherNode",
    "gather_label",
    "most_transform_bytes",
    "refuse_standardised_twice",
    "take_rows",
]

PARALLEL_GATHER_BYTES = 8 * 2**20
"""A batch at least this large (all labels) is copied by two threads, half the rows each
(with two or more usable cores), when its copies are large (:data:`PARALLEL_PIECE_BYTES`):
one thread copies memory at well under the machine's bandwidth, two ~1.5x faster (measured
on the project's VM)."""

PARALLEL_PIECE_BYTES = 2**20
"""...but only when one copy call moves this much on average (a run of a chunk's rows: a row
times the samples per chunk, up to the batch). Each copy releases and retakes the GIL, and
for small pieces two threads contend for it more than they gain: copying 64 MiB from
separate arrays into one took, one thread against two, 6.7 / 3.2 GB/s in pieces of 8 KiB,
10.4 / 9.7 at 106 KiB, 10.9 / 14.0 at 1 MiB, 11.9 / 20.9 at 4 MiB (this VM, 2026-12-04)."""


def refuse_standardised_twice(
    transforms: ChunkTransforms, views: Mapping[str, Any], batch_transforms: Sequence[Any]
) -> None:
    """``ValueError`` where a label would be standardised twice: by a ``StandardScaler`` chunk
    transform on its array (``Statistics.scaler()``), then by ``Statistics.normalizer()`` or a
    stack's ``normalize=``, each of which takes the array's own values."""
    plain = {lb: v.path for lb, v in views.items() if isinstance(v, ArrayGeometry)}
    twice = [
        (label, plain[label])
        for t in batch_transforms
        for label in sorted(getattr(t, "normalized_labels", ()))
        if label in plain and transforms.standardises(plain[label])
    ]
    twice += [
        (f"{label}[{m.name!r}]", m.view.path)
        for label, view in views.items()
        if isinstance(view, Stack)
        for m in view.members
        if m.norm is not None and m.view is not None and transforms.standardises(m.view.path)
    ]
    if twice:
        raise ValueError(
            f"{', '.join(f'{lb} ({path!r})' for lb, path in twice)} would be standardised twice: "
            "a StandardScaler chunk transform (Statistics.scaler()) runs on the array, and "
            "Statistics.normalizer() or stack(..., normalize=) standardises the label again; "
            "keep one of them"
        )


def gather_label(
    out: np.ndarray,
    samples: np.ndarray,
    samples_per_chunk: int,
    path: str,
    slots: Mapping[tuple[str, int], np.ndarray],
    scratch: np.ndarray | None = None,
    skip_missing: bool = False,
) -> int:
    """Fill ``out[i] = slot_of(samples[i])[samples[i] % spc]`` with one copy per chunk; the
    number of rows copied.

    The read plan emits each batch's rows in sample order, so every chunk's rows form one
    contiguous run of ``out``: a single ``np.take`` (or slice copy) per chunk writes them in
    place. Rows in any other order still work, through ``scratch`` (a gather, then a scatter;
    made here, of one chunk's rows at most, where it is ``None`` or too short: the pipeline's
    plans never take that path, so nothing is held for it).
    With ``skip_missing`` the rows of chunks that have no slot are left as they are (the fetch
    stage decoded them in place).
    """
    n = len(samples)
    if samples_per_chunk == 1 and not skip_missing and n > 1:
        # a chunk per row: every row's slot is one sample, laid end to end by one call
        np.concatenate([slots[(path, s)] for s in samples.tolist()], axis=0, out=out)
        return n
    chunk = samples // samples_per_chunk
    within = samples - chunk * samples_per_chunk
    copied = 0
    if n > 1 and bool(np.all(chunk[1:] >= chunk[:-1])):
        cuts = (np.flatnonzero(chunk[1:] != chunk[:-1]) + 1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            slot = slots.get((path, int(chunk[lo]))) if skip_missing else None
            if slot is None:
                if skip_missing:
                    continue
                slot = slots[(path, int(chunk[lo]))]
            w0, w1 = int(within[lo]), int(within[hi - 1])
            step = int(within[lo + 1] - w0) if hi - lo > 1 else 1
            # the span alone does not say the rows are consecutive: a sample may repeat (the
            # windows of a patched view beside this one: within [0, 0, 1, 4, 4])
            if w1 - w0 == hi - lo - 1 and (hi - lo < 3 or _evenly(within[lo:hi], 1)):
                out[lo:hi] = slot[w0 : w1 + 1]  # consecutive samples: a plain slice copy
            elif step > 1 and w1 - w0 == step * (hi - lo - 1) and _evenly(within[lo:hi], step):
                # every step-th sample (an anchor stride): a strided slice, no temporary even
                # into a window's strided destination (np.take buffers one)
                out[lo:hi] = slot[w0 : w1 + 1 : step]
            else:
                take_rows(slot, within[lo:hi], out[lo:hi])
            copied += hi - lo
        return copied
    order = np.argsort(chunk, kind="stable")
    sorted_chunks = chunk[order]
    cuts = (np.flatnonzero(sorted_chunks[1:] != sorted_chunks[:-1]) + 1).tolist()
    longest = int(np.diff([0, *cuts, n]).max()) if n else 0
    if scratch is None or len(scratch) < longest:
        scratch = np.empty((longest, *out.shape[1:]), out.dtype)
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        key = (path, int(sorted_chunks[lo]))
        if skip_missing and key not in slots:
            continue
        rows = order[lo:hi]
        block = scratch[: hi - lo]
        take_rows(slots[key], within[rows], block)
        out[rows] = block
        copied += hi - lo
    return copied


def _path(view: Any) -> str:
    """The path of the array whose coordinates a label's rows carry (a stack's: its first
    sampled member's)."""
    return str(view.sampled[0].geometry.path if isinstance(view, Stack) else view.path)


def _evenly(within: np.ndarray, step: int) -> bool:
    """Whether ``within`` rises by exactly ``step`` from one value to the next."""
    return bool(np.all(np.diff(within) == step))


STRIDED_ROW_BYTES = 8 * 2**10
"""Rows at least this large are copied one by one into a strided destination (a window's step,
a stack's channels), straight into the batch; smaller rows go through a scratch of at most
:data:`STRIDED_SCRATCH_BYTES`, a block of rows per ``np.take``. One Python copy per row costs
about as much as copying 8 KiB (0.3-0.4 µs): below that the loop, not the copy, was the
gather's time (a (4, 8) float32 window step: 16,000 Python lines per batch of 4,096 rows);
above it a row's copy outweighs its Python, and no row goes through a temporary."""

STRIDED_SCRATCH_BYTES = 64 * 2**10
"""The scratch one ``np.take`` of small rows fills before they are copied into a strided
destination (it stays in cache for the second copy)."""


def take_rows(slot: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = slot[rows]`` with one ``np.take`` into the C-contiguous ``out``.

    ``np.take`` copies a non-contiguous source whole before it gathers, so a level-major slot
    (see :mod:`insitubatch_nodes.pool`) is gathered from its memory instead: seen as rows
    ``(level, sample)``, every sample's level is one contiguous run, and row ``r`` of ``out``
    is the runs ``level * spc + rows[r]`` for every level, in order. A strided ``out`` (a
    window's step or a stack's channels in its batch buffer) takes rows of
    :data:`STRIDED_ROW_BYTES` or more one by one, with no temporary, and smaller rows a block
    at a time through a scratch of at most :data:`STRIDED_SCRATCH_BYTES`: the Python work is
    one call per block, not per row.
    """
    if not out.flags.c_contiguous:
        # np.take would gather through a temporary as large as ``out`` and copy that
        row_bytes = max(1, out[0].nbytes) if len(out) else 1
        if row_bytes >= STRIDED_ROW_BYTES:  # each row straight into the batch
            for i, w in enumerate(rows.tolist()):
                out[i] = slot[w]
            return
        block = min(len(rows), max(1, STRIDED_SCRATCH_BYTES // row_bytes))
        scratch = np.empty((block, *out.shape[1:]), out.dtype)
        for lo in range(0, len(rows), block):
            hi = min(lo + block, len(rows))
            take_rows(slot, rows[lo:hi], scratch[: hi - lo])
            out[lo:hi] = scratch[: hi - lo]
    elif is_level_major(slot):
        spc, levels = slot.shape[0], slot.shape[1]
        memory = slot.swapaxes(0, 1).reshape(levels * spc, -1)  # a view: it is C-contiguous
        index = (rows[:, None] + spc * np.arange(levels)).ravel()
        np.take(memory, index, axis=0, out=out.reshape(len(rows) * levels, -1), mode="clip")
    else:
        np.take(slot, rows, axis=0, out=out, mode="clip")


def _note_batch_transform(exc: Exception, transform: Any, index: int, epoch: int) -> None:
    """Say on ``exc`` (a note: its type, message and traceback stay the user's) which batch
    transform raised it, on which batch, and what to do. The package's own errors (a
    ``Forcings`` interrupted by a close, ...) carry their own messages."""
    if isinstance(exc, InSituError):
        return
    exc.add_note(
        f"raised by batch transform {transform_name(transform)} on batch {index} of epoch "
        f"{epoch}: the batches before it were delivered; next() tries this batch again, and "
        "a state_dict() taken before it resumes from there"
    )


class GatherNode(BaseNode[Batch]):
    """Gather stage: :class:`ResidentBatch` in, :class:`~insitubatch_nodes.batch.Batch` out.

    The views (label -> view, as batches carry them), the batch size and the batch buffers are
    the ``context``'s (:class:`~insitubatch_nodes.stages.context.StageContext`). The buffers
    hold ``min(batch_size, samples the rank delivers per epoch)`` rows; a batch with more rows
    (an epoch resumed on another world size) grows them. ``batch_transforms`` run in order on
    every gathered batch (on the pipeline's thread, so they overlap the consumer).

    A window label's rows are ``(T, *inner)``: its ``sample_indices`` are ``(batch, T)`` (row
    ``i``, step ``t``: the anchor plus the view's offset plus the step's), and so are its
    coordinates.

    ``coords`` maps a batch label to ``{name: values}`` (1-D, one value per sample of its
    array): each batch's ``coords[label][name]`` is ``values[sample_indices[label]]``, one
    vectorised take. Coordinates belong to the array, so labels that
    :meth:`~insitubatch_nodes.stages.read_plan.ReadPlanNode.set_views` adds carry those of
    their array.
    """

    STAGE: ClassVar[int] = 3  # its place in a graph (stages/_wiring.py)

    def __init__(
        self,
        source: BaseNode[ResidentBatch],
        *,
        context: StageContext,
        batch_transforms: Sequence[BatchTransform] = (),
        coords: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    ) -> None:
        context = check_wiring(self.STAGE, source, context)
        super().__init__()
        self.source = source
        self.context = context
        self.buffers = context.buffers
        self.batch_size = context.batch_size
        self.batch_transforms = tuple(check_batch_transforms(batch_transforms))
        batch_views = self.buffers.layout.views
        refuse_standardised_twice(context.transforms, batch_views, self.batch_transforms)
        unknown = set(coords or {}) - set(batch_views)
        if unknown:
            raise ValueError(f"coords name labels {sorted(unknown)} that are not in the views")
        # coordinates are the array's: kept by path, so other views of it carry them too
        self._array_coords = {
            _path(batch_views[label]): {name: np.asarray(v) for name, v in named.items()}
            for label, named in (coords or {}).items()
            if named
        }
        self.check_constants(batch_views)
        self._size(self.buffers.rows)
        self._count_memory(batch_views)
        self.recorder = context.recorder
        self._count_transforms()
        claim(self, source)

    def _size(self, rows: int) -> None:
        """Batch buffers of ``rows`` rows, and coordinates to match the views."""
        self.rows = rows
        if self.buffers.rows < rows:
            self.buffers.resize(rows)
        self.views = self.buffers.views
        self.layout = self.buffers.layout
        self._selected = {
            label: SelectedGather(g, self.context.held.get(g.path))
            for label, g in self.views.items()
            if g.select is not None and g.patch is None  # (patched: gather_windows selects)
        }
        self.coords = {
            label: self._array_coords[_path(v)]
            for label, v in self.layout.views.items()
            if _path(v) in self._array_coords
        }
        # stack members standardised during the copy: part -> (mean, std)
        self._norm = self.layout.normalized()
        # a collection's labels: rows name their member, indices are within it
        # (a stack's rows are its sampled members', which share one sample axis: the first's)
        self._members = {
            label: view.members
            for label, v in self.layout.views.items()
            for view in ([v] if isinstance(v, ArrayGeometry) else [m.view for m in v.sampled][:1])
            if view is not None and view.members is not None
        }
        self.channels = {
            label: list(v.channels)
            for label, v in self.layout.views.items()
            if isinstance(v, Stack)
        }
        # per label: (bytes of one row, rows one copy moves at most: a chunk's run of rows)
        self._piece = {
            label: (g.sample_nbytes, 1 if g.patch is not None else g.samples_per_chunk)
            for label, g in self.views.items()
        }

    def _count_memory(self, views: Mapping[str, Any]) -> None:
        """Count what the batch transforms hold at most in the build's memory check
        (``context.memory``, :meth:`MemoryRule.count_transforms <insitubatch_nodes.stages.
        _memrule.MemoryRule.count_transforms>`): where the fetch stage was not told (a graph
        composed by hand passes no ``transform_bytes=``), the builder's count for the same
        transforms. A graph that memory cannot then hold is refused here, its stages released
        first. The rule asks again for other views (``set_views``): the transforms then in
        place, on those views."""
        batches = batches_in_flight(self.context.options.prefetch_depth)
        me = weakref.ref(self)  # (the rule keeps no stage alive: a graph may drop this one)

        def most(views: Mapping[str, Any]) -> int:
            gather = me()
            if gather is None:
                return 0
            rows = gather.buffers.rows
            return most_transform_bytes(gather.batch_transforms, views, rows, batches)

        try:
            self.context.memory.count_transforms(most, views)
        except ValueError:
            self.context.close()  # (the fetch stage's pins and slot reserve)
            raise

    def check_constants(self, views: Mapping[str, Any]) -> None:
        """The builder's check of the :class:`~insitubatch_nodes.forcings.Forcings` and
        :class:`~insitubatch_nodes.static.StaticFields` among the batch transforms against the
        labels' views (a stack's by its first sampled member), here too so that a graph
        composed by hand refuses them as ``insitu_pipeline`` does
        (:func:`~insitubatch_nodes.forcing_grid.refuse_forcings_elsewhere`,
        :meth:`StaticFields.check_patches <insitubatch_nodes.static.StaticFields.check_patches>`):
        a collection's rows on one grid where its members lie elsewhere, a patched label's
        forcings or static fields on the whole grid; and solar forcings (batch transforms and
        stack members) of rows whose times are cftime dates (:meth:`Forcings.refuse_times
        <insitubatch_nodes.forcings.Forcings.refuse_times>`)."""
        forcings = [t for t in self.batch_transforms if isinstance(t, Forcings)]
        fields = [t for t in self.batch_transforms if isinstance(t, StaticFields)]
        members = [(label, m.forcing) for label, v in views.items() if isinstance(v, Stack)
                   for m in v.forcings if m.forcing is not None]  # fmt: skip
        for label, forcing in [*((f.time_label, f) for f in forcings), *members]:
            if label in views:  # (the times the label's rows carry, where they are known)
                carried = self._array_coords.get(_path(views[label]), {})
                forcing.refuse_times(carried.get(forcing.time_name))
        if not (forcings or fields):
            return
        geoms = {
            label: v.sampled[0].geometry if isinstance(v, Stack) else v
            for label, v in views.items()
        }
        if forcings:
            refuse_forcings_elsewhere(forcings, geoms)
        for f in fields:
            f.check_patches(patch_spec(geoms))

    def carries(self, path: str, name: str) -> bool:
        """Whether batches carry coordinate ``name`` of array ``path`` (for any label of it)."""
        return name in self._array_coords.get(path, {})

    def carried_coordinates(self) -> dict[str, list[str]]:
        """``{array path: [coordinate names]}`` of the coordinates batches carry."""
        return {path: sorted(named) for path, named in self._array_coords.items()}

    def run_first(self, transform: BatchTransform) -> None:
        """Run ``transform`` first on every batch gathered from now on (``InSituPipeline.
        set_views`` puts there the constants of channel stacks a pipeline built without any
        is given)."""
        self.batch_transforms = (*check_batch_transforms([transform]), *self.batch_transforms)
        self._count_transforms()

    def _count_transforms(self) -> None:
        """Tell the report how many batch transforms were given: not the static fields and
        stack constants the pipeline writes into each batch itself (its gather-limited advice,
        to lighten them or move them to the consumer, is for transforms the user can touch)."""
        if self.recorder.enabled:
            self.recorder.batch_transforms = sum(
                not getattr(t, "pipeline_constants", False) for t in self.batch_transforms
            )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(source_state(initial_state))
        if self.context.sync_views():  # the plan took views given by set_views
            self._size(self.buffers.rows)
            self.check_constants(self.layout.views)

    def get_state(self) -> dict[str, Any]:
        return {SOURCE_KEY: self.source.state_dict()}

    def start_state(self, epoch: int) -> dict[str, Any] | None:
        """This stage's state before the first batch of ``epoch`` (see ``_graph``)."""
        return source_start_state(self.source, epoch)

    @ranged("insitu.gather")
    def next(self) -> Batch:
        resident: ResidentBatch = next(self.source)
        t0 = time.perf_counter()
        plan = resident.plan
        n = len(plan)
        if n > self.rows:  # batches of more rows than sized for (elastic resume): resize
            self._size(min(n, self.batch_size))
        given = resident.arrays
        arrays = self.buffers.take(n) if given is None else dict(given)
        dest = self.buffers.parts(arrays)  # each view's rows in the batch (a window's step)
        # labels whose every row the fetch stage decoded in place need no copy at all
        labels = [lb for lb in self.views if resident.direct.get(lb, 0) < n]
        nbytes = sum(dest[lb].nbytes for lb in labels)
        helper = None
        if n > 1 and nbytes >= PARALLEL_GATHER_BYTES:
            piece = self._piece
            mean = sum(dest[lb].nbytes * min(piece[lb][1], n) * piece[lb][0] for lb in labels)
            if mean >= PARALLEL_PIECE_BYTES * nbytes:
                helper = _runtime.gather_helper()
        if helper is None:
            copied = self._gather_rows(dest, resident, labels, 0, n)
        else:  # two threads copy half the rows each: copies from memory go ~1.5x as fast
            half = n // 2
            other = helper.submit(-1, self._gather_rows, dest, resident, labels, half, n)
            try:
                copied = self._gather_rows(dest, resident, labels, 0, half)
            finally:
                more = other.result()  # also when ours raised: nothing writes into the batch
            copied = {lb: copied[lb] + more[lb] for lb in labels}
        for label in self._norm.keys() - set(labels):  # decoded in place, every row
            standardise_in_place(dest[label], *self._norm[label])
        for label in labels:
            if copied[label] + resident.direct.get(label, 0) != n:
                raise RuntimeError(
                    f"batch {plan.index} of label {label!r}: {copied[label]} rows gathered and "
                    f"{resident.direct.get(label, 0)} decoded in place, of {n}; this is a bug "
                    "in insitubatch_nodes, please report it"
                )
        if resident.lease.closed:  # the graph was closed while this batch was gathered
            raise PipelineInterrupted("the pipeline is stopping; this batch was abandoned")
        if resident.lease.over:  # its slots were released (and may hold others) while copied
            raise RuntimeError(
                f"batch {plan.index}'s chunks were released before the GatherNode had gathered "
                "it: a node between the ChunkPoolNode and the GatherNode pulled the next batch "
                "ahead (a torchdata Batcher, Prefetcher or ParallelMapper with workers). Only "
                "nodes that pass one item at a time (a Mapper) may sit there: place the others "
                "above the GatherNode (between it and the PrefetcherNode)"
            )
        samples = self._per_label(plan.sample_indices, stack=True)
        virtual = dict(samples)  # (a collection's coordinates lie along its virtual axis)
        origins = self._per_label(plan.patch_origins, stack=False)
        members = {}
        for label, member_map in self._members.items():
            m = member_map.member_of(samples[label])
            if member_map.continuous:  # stores joined along one axis: the index runs on
                members[label] = m
                continue
            samples[label] = member_map.within(samples[label], m)
            members[label] = m if m.ndim == 1 else m[:, 0]  # a window never crosses members
        batch = Batch(
            arrays=arrays,
            sample_indices=samples,
            patch_origins={label: origins[label] for label in origins},
            epoch=plan.epoch,
            index=plan.index,
            channels={label: list(names) for label, names in self.channels.items()},
            members=members,
            coords={
                label: {name: values.take(virtual[label]) for name, values in named.items()}
                for label, named in self.coords.items()
            },
        )
        for transform in self.batch_transforms:
            try:
                batch = transform(batch)
            except Exception as exc:
                _note_batch_transform(exc, transform, plan.index, plan.epoch)
                raise
            if not isinstance(batch, Batch):
                raise TypeError(
                    f"batch transform {transform_name(transform)} returned "
                    f"{type(batch).__name__}, not a Batch: a batch transform changes the batch "
                    "it is given (or builds a new one) and must return the Batch (did it "
                    "forget `return batch`?)"
                )
        self.recorder.add("gather_s", time.perf_counter() - t0, start=t0, batch=plan.index)
        return batch

    def _per_label(self, by_part: Mapping[str, np.ndarray], stack: bool) -> dict[str, np.ndarray]:
        """The plan's per-view values as the batch's per label: a window's steps side by side
        (``sample_indices`` ``(batch, T)``); a window's patch origins are its first step's
        (every step takes the same window of the field)."""
        if self.layout.is_plain():
            return dict(by_part)
        out: dict[str, np.ndarray] = {}
        for label, lp in self.layout.labels.items():
            if lp.parts[0][0] not in by_part:
                continue
            if stack:  # sample indices: one column per step (a stack's: its first member's)
                out[label] = lp.indices(by_part)
            else:  # patch origins: the same for every step
                out[label] = by_part[lp.parts[0][0]]
        return out

    def _gather_rows(
        self,
        arrays: Mapping[str, np.ndarray],
        resident: ResidentBatch,
        labels: Sequence[str],
        lo: int,
        hi: int,
    ) -> dict[str, int]:
        """Rows ``lo:hi`` of ``labels`` (on the producer thread or the gather helper); the
        rows copied per label (rows decoded in place are left as they are)."""
        partial = resident.arrays is not None
        out = {}
        for label in labels:
            out[label] = self._gather_part(arrays, resident, label, lo, hi, partial)
            norm = self._norm.get(label)
            if norm is not None:  # standardised in place while its rows are hot in cache
                standardise_in_place(arrays[label][lo:hi], *norm)
        return out

    def _gather_part(
        self,
        arrays: Mapping[str, np.ndarray],
        resident: ResidentBatch,
        label: str,
        lo: int,
        hi: int,
        partial: bool,
    ) -> int:
        """Rows ``lo:hi`` of the part ``label``; the rows copied."""
        geom = self.views[label]
        if geom.select is not None and geom.patch is None:  # a selected view (see _select)
            return int(
                self._selected[label](
                    arrays[label][lo:hi],
                    resident.plan.sample_indices[label][lo:hi],
                    resident.slots,
                    skip_missing=partial and resident.direct.get(label, 0) > 0,
                )
            )
        if geom.patch is not None:
            origins = resident.plan.origins
            assert origins is not None, "a patched view needs a patched read plan"
            return gather_windows(
                arrays[label][lo:hi],
                resident.plan.sample_indices[label][lo:hi],
                origins[lo:hi],
                geom,
                resident.slots,
                self.context.held.get(geom.path),
            )
        return gather_label(
            arrays[label][lo:hi],
            resident.plan.sample_indices[label][lo:hi],
            geom.samples_per_chunk,
            geom.path,
            resident.slots,
            skip_missing=partial and resident.direct.get(label, 0) > 0,
        )

    def close(self) -> None:
        """Close the graph, as ``close()`` on its root does (:meth:`StageContext.close_graph`)."""
        self.context.close_graph()

    def release_idle(self) -> None:
        """Drop the idle batch buffers and the idle buffers of the batch transforms that lend
        their own (``release_idle``: static cuts, forcings); those lent out stay."""
        self.buffers.release_idle()
        for transform in self.batch_transforms:
            release = getattr(transform, "release_idle", None)
            if release is not None:
                release()

    @property
    def buffer_allocations(self) -> int:
        """Batch buffers allocated so far (stays flat in steady state)."""
        return self.buffers.allocations

    @property
    def transform_bytes(self) -> int:
        """Bytes the batch transforms hold now, those that say (``held_bytes``): static fields
        and their cuts' buffers, stacks' constant channels, the forcings' remembered fields."""
        return sum(int(getattr(t, "held_bytes", 0)) for t in self.batch_transforms)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of batch-buffer memory held now, lent out or idle."""
        return self.buffers.held_bytes
