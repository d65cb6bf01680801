"""The data module's splits, as Lightning's stages read them (used by
:mod:`insitubatch_nodes.lightning`, and by the demo for its time-ordered split; imports nothing
of Lightning): splits given as one collection each, fractions split in time order, what to
do when a split holds fewer samples than the trainer has ranks, and the coordinate readers the
split and every pipeline the module builds share (:class:`CoordinateReaders`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from insitubatch_nodes.errors import TooFewSamplesError
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.coords import Coordinate, coordinate_reader, open_coordinates
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import RetryPolicy, retry_policy
from insitubatch_nodes.plan.splits import SplitManifest, split_by_chunk, split_by_member
from insitubatch_nodes.stack import Stack

__all__ = [
    "CoordinateReaders",
    "chunk_split",
    "module_split",
    "per_split",
    "read_by",
    "sample_times",
    "too_few_for_ranks",
]

#: the Trainer call that reads each split's loader, by the Trainer's ``state.fn``
_CALLS = {"fit": "validate", "validate": "validate", "test": "test", "predict": "predict"}
#: the splits whose loaders each Trainer call reads, by its ``state.fn`` (predict: the test split)
_READ = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}


def read_by(stage: str | None) -> tuple[str, ...]:
    """The splits whose loaders the Trainer call ``stage`` reads (the ``stage`` Lightning
    passes to ``setup`` and ``teardown``: ``"fit"`` reads training's and validation's,
    ``"validate"`` validation's, ``"test"`` and ``"predict"`` the test split's); ``None`` (or
    a stage Lightning does not name): every split."""
    return _READ.get(stage or "", ("train", "val", "test"))


def too_few_for_ranks(few: TooFewSamplesError, stage: str | None) -> TooFewSamplesError:
    """The refusal of a val/test split with fewer samples than the trainer's ranks, saying what
    to do in Lightning's terms; ``stage`` is the Trainer's ``state.fn`` (``"fit"``,
    ``"validate"``, ``"test"``, ``"predict"``). Padding the short ranks with repeated samples
    would count them twice in every metric; a rank without a batch is refused by Lightning,
    and with ``allow_zero_length_dataloader_with_multiple_devices`` skips the loop while the
    other ranks wait for it at the epoch's end. The message names the plain loop's way
    (``PlanConfig.empty_ranks``), which the data module never takes."""
    n, world = few.n_samples, few.world_size
    call = _CALLS.get(str(stage)) or ("validate" if few.split == "val" else "test")
    during_fit = (
        " Or leave validation out of the fit (Trainer(limit_val_batches=0)) and validate as "
        "above after it."
        if stage == "fit"
        else ""
    )
    return TooFewSamplesError(
        f"InSituDataModule: the {few.split!r} split has {n} sample(s) for the trainer's {world} "
        "ranks, and under DDP every rank needs a batch of it: Lightning refuses a rank without "
        "one (with allow_zero_length_dataloader_with_multiple_devices that rank skips the loop "
        "and the others wait for it at the epoch's end), and a sample repeated to fill a rank "
        f"would count twice. Run trainer.{call} on at most {n} device(s): after a DDP fit, "
        "torch.distributed.destroy_process_group(), then on global rank 0 only (if "
        f"trainer.is_global_zero:) L.Trainer(devices=1).{call}(model, datamodule=dm); or give "
        f"the split more chunks (splits=...).{during_fit} Outside Lightning, a plain loop "
        "(no collective call per batch) reads it on every rank with insitu_pipeline(..., "
        "config=PlanConfig(split=..., remainder='uneven', empty_ranks=True)): the ranks beyond "
        f"its samples run zero batches; the data module never sets it. (Counted: {few.counted})",
        split=few.split, n_samples=n, world_size=world, counted=few.counted,
    )  # fmt: skip


def per_split(
    splits: Mapping[str, Any], variables: Any
) -> dict[str, tuple[Any, dict[str, Any], SplitManifest]]:
    """``{split: (store, views, manifest)}`` of splits given as one collection each, checked to
    share no member; ``variables`` are variable names, or a callable ``{variable: view} ->
    {label: view}`` called with each split's collection's variables."""
    out: dict[str, tuple[Any, dict[str, Any], SplitManifest]] = {}
    owner: dict[str, str] = {}
    for split, coll in splits.items():
        if split not in ("train", "val", "test") or not isinstance(coll, Collection):
            raise TypeError(
                "splits given as a mapping take 'train', 'val' and 'test' to a Collection "
                f"each; got {split!r}: {type(coll).__name__}"
            )
        for source in coll.sources():
            if owner.setdefault(source, split) != split:
                raise ValueError(
                    f"member {source!r} is in both the {owner[source]!r} and the {split!r} "
                    "collection: a member belongs to one split"
                )
        geometries = {v: coll[v] for v in coll.variables}
        if callable(variables):
            views = dict(variables(geometries))
        elif isinstance(variables, Mapping | str):
            raise TypeError(
                "with one collection per split, variables are variable names (['image']) or "
                "a callable {variable: view} -> {label: view}: each split has its own views"
            )
        else:
            views = {v: geometries[v] for v in variables}
        manifest = split_by_member(coll, {split: 1.0})
        out[split] = (coll.store, views, manifest)
    return out


class CoordinateReaders:
    """One coordinate reader (:func:`~insitubatch_nodes.io.coords.coordinate_reader`) per
    store a data module reads, made when first asked for: ``readers(store)``. The module's
    split and every pipeline it builds (training's, validation's, a rebuild) take the same one,
    so a coordinate (the time of each row) is read once per store per process, not once per
    build. Its reads end within ``retry``'s ``timeout_s`` (``None``: the store's policy), as
    the builder's own. Pickled empty: the stores' arrays stay in their process."""

    def __init__(self, retry: RetryPolicy | None) -> None:
        self.retry = retry
        self._readers: dict[int, tuple[Any, Any]] = {}  # id(store) -> (store, its reader)

    def __call__(self, store: Any) -> Any:
        held = self._readers.get(id(store))
        if held is None or held[0] is not store:
            timeout = (self.retry or retry_policy(store)).timeout_s
            held = self._readers[id(store)] = (store, coordinate_reader(store, timeout))
        return held[1]

    def __getstate__(self) -> dict[str, Any]:
        return {"retry": self.retry, "_readers": {}}


def module_split(
    splits: Any, given: Any, store: Any, views: Mapping[str, Any], seed: int, reader: Any = None
) -> SplitManifest:
    """The data module's manifest of ``splits`` (a manifest as it is; ``(train, val, test)``
    fractions of whole members of the collection ``given``, drawn with ``seed``; else
    :func:`chunk_split` of the first view's array, a stack's first sampled member's, in time
    order, its times read by ``reader``)."""
    if isinstance(splits, SplitManifest):
        return splits
    if isinstance(given, Collection):  # fractions of whole members: nothing leaks
        fractions = dict(zip(("train", "val", "test"), map(float, splits), strict=True))
        return split_by_member(given, fractions, seed=seed)
    lead = next(iter(views.values()))  # a stack: its first sampled member's array
    geom = lead.sampled[0].geometry if isinstance(lead, Stack) else lead
    return chunk_split(store, geom.base, tuple(splits), reader)  # (in time order)


def chunk_split(
    store: Any, geom: ArrayGeometry, fractions: tuple[float, ...], reader: Any = None
) -> SplitManifest:
    """The data module's (and the demo's) ``(train, val, test)`` chunk fractions of ``geom``:
    a contiguous :func:`split_by_chunk` in time order where ``geom``'s sample axis has a time
    coordinate (:func:`sample_times`; ``train`` the earliest times, also in a store written
    newest first; before 2026-12-07 the index order, which trained such a store on its
    newest times), in index order otherwise."""
    return split_by_chunk(geom, fractions, coord=sample_times(store, geom, reader))


def sample_times(store: Any, geom: ArrayGeometry, reader: Any = None) -> Coordinate | None:
    """The time coordinate along ``geom``'s sample axis, ``None`` where it has none. A
    coordinate that cannot be read here is ``None`` too, left to the pipeline's build, which
    reads it for the batches and says what is wrong with it. ``reader`` (a
    :func:`~insitubatch_nodes.io.coords.coordinate_reader` of ``store``) keeps what it read
    for later reads (the pipelines' builds)."""
    try:
        coords = open_coordinates(store, geom, reader=reader)
    except (ValueError, OSError, ModuleNotFoundError):
        coords = {}
    return next((c for c in coords.values() if c.is_time), None)
