"""A ``LightningDataModule`` over insitubatch_nodes pipelines (needs the ``lightning`` extra).

:class:`InSituDataModule` builds one pipeline per split, with the rank and world size taken from
the Trainer, and hands Lightning :class:`~insitubatch_nodes.torch_data.InSituIterableDataset` s:
exact lengths (so a mid-epoch checkpoint resumes without skipping a batch) and plain-Python
state. The training loader's state is also carried in the DataModule's own ``state_dict`` /
``load_state_dict`` and applied when the training loader is built, which keeps resume exact even
where Lightning itself drops the loader state (Lightning issue #20550: a LightningModule whose
``configure_optimizers`` reads ``trainer.estimated_stepping_batches``).

The training permutation follows ``trainer.current_epoch``; validation and test pipelines are
separate objects with their own state, so evaluating never moves the training position. They
are dealt with ``remainder="uneven"``: under DDP each sample of the split is evaluated exactly
once, and a rank may run one batch fewer than another (fine for epoch-end reductions through
torchmetrics or logged sums, not for a collective call in every ``validation_step``; a mean
logged with ``sync_dist=True`` comes out too large under Lightning 2.6 where the split's samples
are no multiple of the ranks: docs/training.md says why and what to log instead). After
Lightning resumed a run stopped by ``max_steps`` (it counts the stopped epoch as done, yet
resumes it at the next batch under the following epoch's number) the training plan's epochs run
behind the trainer's by that one, so the batches are the uninterrupted run's.

**Elastic resume.** A checkpoint saved on ``W`` ranks resumes on any other number: the
interrupted epoch's remaining samples are dealt to the new ranks (see
:meth:`~insitubatch_nodes.stages.read_plan.ReadPlanNode.reset`), so that epoch has another length
than the
following ones. Lightning reads a loader's length once per ``fit``; the DataModule adds a small
callback that, when the next epoch's length differs from the one Lightning was told, has
Lightning reload the training loader for that epoch (the DataModule hands back the same
pipeline, its cache intact), so epoch ends, validation and schedulers follow the true lengths.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

try:
    import lightning.pytorch as pl
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "InSituDataModule needs Lightning (the package's `lightning` extra): "
        "pip install 'insitubatch_nodes[lightning]' (or lightning>=2.4)"
    ) from exc
from zarr.abc.store import Store

from insitubatch_nodes._checks import (
    check_batch_transforms,
    check_bool,
    check_chunk_transforms,
    check_instance,
    check_optional_int,
)
from insitubatch_nodes.batch import Batch, BatchTransform, to_torch
from insitubatch_nodes.errors import TooFewSamplesError
from insitubatch_nodes.io.arrays import open_geometries
from insitubatch_nodes.io.cf import decoded_dtype_option
from insitubatch_nodes.io.collection import Collection
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.stores import StoreLike, as_store
from insitubatch_nodes.lightning_epochs import (
    EpochLengthSync,
    follow_ended_epoch,
    rebuild_training_loader,
    restoring_loops,
    resumed_at,
    trained_its_last_batch,
)
from insitubatch_nodes.lightning_splits import (
    CoordinateReaders,
    module_split,
    per_split,
    read_by,
    too_few_for_ranks,
)
from insitubatch_nodes.options import CacheOptions, FetchOptions
from insitubatch_nodes.pipeline import insitu_pipeline
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.report import EpochReport
from insitubatch_nodes.stack import Stack
from insitubatch_nodes.stages._graph import plan_state
from insitubatch_nodes.torch_data import InSituIterableDataset, as_dataset
from insitubatch_nodes.transforms import ChunkTransform

__all__ = ["InSituDataModule", "InSituReportCallback"]

T = TypeVar("T")


def _given(value: T | None, kind: type[T], argument: str) -> T:
    """``value``, or ``kind()`` for ``None``; anything else raises ``TypeError`` (the object
    itself was checked when it was made)."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(
            f"InSituDataModule: {argument} must be a {kind.__name__} or None, got {value!r}"
        )
    return value


def _check_sources(variables: Any, splits: Any, store: Any, store_options: Any) -> None:
    """``TypeError``/``ValueError`` when the data module is made, not in :meth:`setup` (where
    the store is first read) or inside the Trainer: views that are not views, splits that are
    neither a manifest, collections nor three fractions, options for an opened store."""
    if isinstance(variables, Mapping):
        for label, view in variables.items():
            if not isinstance(view, ArrayGeometry | Stack):
                raise TypeError(
                    f"variables[{label!r}] must be an ArrayGeometry view or a stack(), got "
                    f"{view!r:.80} (array names: pass a list of names)"
                )
    elif not callable(variables) and (
        not isinstance(variables, Sequence) or not all(isinstance(v, str) for v in variables)
    ):
        raise TypeError(
            "variables are array names, {label: view}, or a callable geometries -> {label: "
            f"view}}, got {variables!r:.80}"
        )
    if not isinstance(splits, SplitManifest | Mapping):
        try:  # (a numpy array of fractions too)
            fractions = () if isinstance(splits, str) else tuple(splits)
        except TypeError:
            fractions = ()
        if len(fractions) != 3 or not all(isinstance(f, numbers.Real) for f in fractions):
            raise TypeError(
                "splits is a SplitManifest, {split: Collection}, or (train, val, test) chunk "
                f"fractions such as (0.8, 0.1, 0.1), got {splits!r:.80}"
            )
    if store_options and isinstance(store, Store):
        raise ValueError("store_options apply to a URL or path, not to an opened Store")


class InSituReportCallback(pl.Callback):
    """Logs the training pipeline's epoch report through ``LightningModule.log`` at the end of
    every training epoch, so its headline numbers reach whatever logger the Trainer has.

    Metrics are ``{prefix}{name}`` for each entry of
    :meth:`~insitubatch_nodes.report.EpochReport.metrics` (throughput, time to first batch, the
    consumer's wait fraction, per-stage seconds, pool counts, and ``limited_by_<stage>``).
    :class:`InSituDataModule` adds one to its Trainer by itself (``log_report=True``); add it
    yourself only for a DataModule built otherwise, passing ``report`` (a callable returning the
    report, or ``None``).

    For an :class:`InSituDataModule` the epoch's report is finished (``complete``) when the
    trainer's epoch ends: Lightning stops after ``len(loader)`` batches, without the call that
    would end the pipeline's epoch. Metrics are logged with ``sync_dist=True``: under DDP each
    is the mean over the ranks of their own pipelines' numbers.
    """

    def __init__(
        self,
        prefix: str = "insitu/",
        report: Callable[[pl.Trainer], EpochReport | None] | None = None,
    ) -> None:
        check_instance("InSituReportCallback's prefix", prefix, str, "a str such as 'insitu/'")
        if report is not None and not callable(report):
            raise TypeError(f"report must be a callable Trainer -> EpochReport | None: {report!r}")
        self.prefix = prefix
        self._report = report

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = self._find(trainer)
        if report is None:
            return
        metrics = {self.prefix + k: v for k, v in report.metrics().items()}
        # each rank's numbers are its own pipeline's: averaged over the ranks (a no-op on one
        # process), which also keeps Lightning from warning once per metric under DDP
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True)

    def _find(self, trainer: pl.Trainer) -> EpochReport | None:
        if self._report is not None:
            return self._report(trainer)
        dm = getattr(trainer, "datamodule", None)
        if not isinstance(dm, InSituDataModule):
            return None
        # Lightning stops after len(loader) batches, without the next() that would end the
        # epoch: the epoch is over for the trainer, so its report is finished here
        train = dm._loaders.get("train")
        recorder = getattr(getattr(train, "pipeline", None), "recorder", None)
        if recorder is not None:
            recorder.finalize()
        return dm.train_report()


class InSituDataModule(pl.LightningDataModule):
    """Train/val/test loaders from one zarr store.

    The pipelines are built from the same three settings objects as
    :func:`~insitubatch_nodes.insitu_pipeline` takes, each checked once, when it was made:

    * ``config`` (a :class:`~insitubatch_nodes.plan.config.PlanConfig`, kept as
      :attr:`plan_config`): training's read plan; the val/test pipelines use
      :meth:`plan_config_for` — the same config, unshuffled, with ``eval_batch_size`` and
      ``remainder="uneven"`` (every sample once) — and
      every split takes the rank and world size from the Trainer (the config's own ``rank``
      and ``world_size`` are replaced);
    * ``fetch`` (a :class:`~insitubatch_nodes.options.FetchOptions`): every split's;
    * ``cache`` (a :class:`~insitubatch_nodes.options.CacheOptions`): every split's chunk cache
      on disk (the pipelines of one process share the directory, and each DDP rank writes its
      own part of it — see docs/caching.md); its ``budget_bytes`` is training's, the val/test
      pipelines size their pools automatically (:meth:`cache_options_for`).

    The other arguments are checked here too, not in :meth:`setup` (inside the Trainer):
    views that are not views or stacks, ``splits`` that are neither a manifest, collections
    nor three fractions, a ``log_report`` that is no bool, ``store_options`` beside an opened
    store raise ``TypeError`` or ``ValueError`` saying what to pass.

    Args:
        store: a zarr Store, a path, or a URL (with ``store_options`` for ``open_store``);
            or a :class:`~insitubatch_nodes.Collection`, whose views (``{"x":
            collection["image"]}``) are then the variables and
            :func:`~insitubatch_nodes.split_by_member` the splits: each split holds whole
            members (or groups of them), none in two splits.
        variables: array names (one name: a string), or ``{label: ArrayGeometry view or
            stack}`` (e.g. ``{"x": g, "y": g.shift(1)}``); a callable ``geometries -> {label:
            view}`` is resolved in :meth:`setup` (useful when the store is only reachable at
            training time).
        splits: a :class:`SplitManifest` (of a collection: :func:`split_by_member`), a
            mapping of ``"train"``, ``"val"`` and ``"test"`` to one
            :class:`~insitubatch_nodes.Collection` each (none sharing a member; ``store`` is
            then unused, ``variables`` names or a callable on each collection's variables), or
            ``(train, val, test)`` chunk fractions for a contiguous :func:`split_by_chunk` over
            the first label's array (a :func:`~insitubatch_nodes.stack`: its first sampled
            member's), in time order where it has a time coordinate (``train`` the earliest
            times, also in a store written newest first) (for a collection: fractions of its
            members, drawn with
            the config's seed by :func:`split_by_member`).
        config, fetch, cache: the settings objects above (``None``: their defaults);
            ``config`` is training's: one of another ``split`` is a ``ValueError``.
        eval_batch_size: batch size of the val/test loaders, an integer ``>= 1`` (default:
            training's).
        batch_transforms: as for :func:`insitu_pipeline` (training).
        chunk_transforms: as for :func:`insitu_pipeline` (every split).
        coords: as for :func:`insitu_pipeline` (every split): the coordinates each batch
            carries in ``batch.coords`` for ``batch_transforms`` and ``transform`` (``to_torch``
            drops them); ``()`` reads none.
        transform: ``Batch -> item`` applied to every batch (default: ``to_torch``,
            ``{label: tensor}``; :func:`~insitubatch_nodes.batch.to_item` adds each row's
            ``"sample_indices"``, ``"members"`` and ``"patch_origins"``).
        missing, missing_objects: as for :func:`insitu_pipeline` (every split): the steps
            listed as missing (indices or times, or on a collection member names mapped to
            indices within each member; ``None``: no check) and whether an absent
            stored object drops the anchors that read it (``"drop"``) or reads as the fill
            value (``"read"``). Decided once, when the first pipeline is built (one read of the
            time coordinate, one listing of each array for ``"drop"``); every split drops the
            same steps, and each pipeline's ``stages.plan.dropped`` counts its split's anchors
            dropped per reason.
        log_report: add an :class:`InSituReportCallback` to the Trainer (when it has none), so
            every training epoch's report is logged through ``self.log`` (``insitu/...``).
        mask_and_scale, cf_dtype: as for :func:`~insitubatch_nodes.open_geometries`, where
            the data module opens the arrays (``variables`` as names or a callable): CF-encoded
            values decoded as xarray decodes them, or stored (``mask_and_scale=False``), or in
            ``cf_dtype`` (``"float32"``: a packed ``int16`` field for a ``float32`` model).
            ``ValueError`` beside views given as a mapping or collections (decoded where
            they were opened: give the options there).
    """

    def __init__(
        self,
        store: StoreLike | Collection | None,
        variables: Sequence[str]
        | Mapping[str, ArrayGeometry | Stack]
        | Callable[[dict[str, ArrayGeometry]], Mapping[str, ArrayGeometry | Stack]],
        splits: SplitManifest | Sequence[float] | Mapping[str, Collection] = (0.8, 0.1, 0.1),
        *,
        config: PlanConfig | None = None,
        fetch: FetchOptions | None = None,
        cache: CacheOptions | None = None,
        eval_batch_size: int | None = None,
        batch_transforms: Sequence[BatchTransform] = (),
        chunk_transforms: Sequence[ChunkTransform] = (),
        coords: Sequence[str] | None = None,
        transform: Callable[[Batch], Any] = to_torch,
        store_options: Mapping[str, Any] | None = None,
        missing: Sequence[Any] | Mapping[str, Sequence[int]] | None = None,
        missing_objects: str = "read",
        log_report: bool = True,
        mask_and_scale: bool = True,
        cf_dtype: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(variables, str):  # one name, as open_geometries and insitu_pipeline take it
            variables = [variables]
        self.cf_dtype = decoded_dtype_option(cf_dtype, mask_and_scale)
        self.mask_and_scale = mask_and_scale
        opened = not isinstance(store, Collection) and not isinstance(splits, Mapping)
        if (self.cf_dtype is not None or not mask_and_scale) and (
            isinstance(variables, Mapping) or not opened
        ):
            raise ValueError(
                "mask_and_scale and cf_dtype apply to the arrays the data module opens (variables "
                "given as names, or as a callable, on a store): views given as a mapping, and a "
                "collection's, were decoded where they were opened: give the options there "
                "(open_geometries(store, cf_dtype=...), Collection.concat(..., cf_dtype=...))"
            )
        if missing_objects not in ("read", "drop"):  # checked here, as the builder checks it
            raise ValueError(f"missing_objects must be 'read' or 'drop', got {missing_objects!r}")
        if isinstance(missing, str | bytes) or (
            missing is not None and not isinstance(missing, Sequence | Mapping)
        ):
            raise TypeError(
                f"missing must be None, a sequence of indices or times, or (on a collection) "
                f"member names mapped to indices, got {missing!r}"
            )
        self.missing: Any = (
            None
            if missing is None
            else {k: tuple(v) for k, v in missing.items()}
            if isinstance(missing, Mapping)
            else tuple(missing)
        )
        self.missing_objects = missing_objects
        self.log_report = check_bool("log_report", log_report)
        _check_sources(variables, splits, store, store_options)
        self._store_arg = store
        self._store_options = dict(store_options or {})
        self._variables_arg = variables
        self._splits_arg = splits
        # the training plan; val/test derive theirs from it (see plan_config_for)
        self.plan_config = _given(config, PlanConfig, "config")
        self.fetch_options = _given(fetch, FetchOptions, "fetch")
        self.cache_options = _given(cache, CacheOptions, "cache")
        if self.plan_config.split != "train":
            raise ValueError(
                f"InSituDataModule: config is training's read plan (split='train'), got "
                f"split={self.plan_config.split!r}: the data module derives the val and test "
                "plans from it itself (dm.plan_config_for(split)); pass the config without split"
            )
        self.eval_batch_size = check_optional_int("eval_batch_size", eval_batch_size, minimum=1)
        self.chunk_transforms = check_chunk_transforms(chunk_transforms)
        # one name as insitu_pipeline takes it (tuple("time") would be its letters)
        self.coords = (
            None if coords is None else (coords,) if isinstance(coords, str) else tuple(coords)
        )
        self.batch_transforms = check_batch_transforms(batch_transforms)
        if not callable(transform):
            raise TypeError(f"transform must be a callable Batch -> item, got {transform!r}")
        self.transform = transform
        self.store: Store | None = None
        self.views: dict[str, ArrayGeometry | Stack] = {}
        self.manifest: SplitManifest | None = None
        self._loaders: dict[str, InSituIterableDataset] = {}
        # the manifest with the missing steps attached, once the first pipeline decided them
        self._checked_manifest: SplitManifest | None = None
        self._pending_train_state: dict[str, Any] | None = None
        self._train_key: tuple[int, int | None, int | None, PlanConfig] | None = None
        self._train_views: dict[str, ArrayGeometry | Stack] | None = None
        # (trainer id, offset): the training plan's epoch is the trainer's less the offset, 1
        # after Lightning resumed a max_steps stop mid-epoch under the next epoch's number
        self._epoch_offset: tuple[int, int] = (0, 0)
        # (trainer id, epoch, batches) of a loaded state, until the trainer's resume is seen
        self._resume_check: tuple[int, int, int] | None = None
        # splits given as one collection each: split -> (store, views, manifest)
        self._split_sources: dict[str, tuple[Any, dict[str, Any], SplitManifest]] = {}
        self.coords_readers = CoordinateReaders(self.fetch_options.retry)  # (one time read)

    @property
    def batch_size(self) -> int:
        """The training batch size (``plan_config.batch_size``); assigning it (as Lightning's
        batch-size finder does, or a curriculum from ``on_train_epoch_end``) replaces
        ``plan_config`` with a checked copy, and the training pipeline is built afresh at it
        for the trainer's next epoch (the trainer is asked to reload its loader)."""
        return self.plan_config.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.plan_config = self.plan_config.replace(batch_size=value)
        self._next_epoch_changed()

    def plan_config_for(self, split: str) -> PlanConfig:
        """The plan settings of ``split``'s pipeline, before the Trainer's rank and world size:
        :attr:`plan_config` for ``"train"``; for ``"val"``/``"test"`` the same settings, in
        order (no shuffle), with ``eval_batch_size`` (default: training's batch size) and
        ``remainder="uneven"``: under DDP every sample of the split is evaluated exactly once,
        and a rank may run one batch fewer than another (see docs/training.md)."""
        if split == "train":
            return self.plan_config
        batch_size = self.eval_batch_size or self.plan_config.batch_size
        return self.plan_config.replace(
            split=split, batch_size=batch_size, shuffle=False, remainder="uneven"
        )

    def cache_options_for(self, split: str) -> CacheOptions:
        """The cache settings of ``split``'s pipeline: :attr:`cache_options` for ``"train"``;
        for ``"val"``/``"test"`` the same with an automatic pool budget."""
        if split == "train" or self.cache_options.budget_bytes is None:
            return self.cache_options
        return self.cache_options.replace(budget_bytes=None)

    def __str__(self) -> str:
        """What the module holds, without setting it up or building a loader (Lightning's
        ``LightningDataModule.__str__`` builds every split's loader and iterates it)."""
        store = self._store_arg if self.store is None else self.store
        labels = list(self.views) if self.views else self._variables_arg
        text = (
            f"InSituDataModule(store={store!r}, variables={labels!r}, "
            f"batch_size={self.batch_size}, "
            f"eval_batch_size={self.plan_config_for('val').batch_size})"
        )
        if self.store is None:
            return text + ": not set up"
        built = [f"{split}: {ds.next_len()} batches" for split, ds in self._loaders.items()]
        return text + (": " + "; ".join(built) if built else ": no loader built")

    __repr__ = __str__

    # -- setup ------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.store is not None:
            return
        if isinstance(self._splits_arg, Mapping):  # one collection per split
            self._split_sources = per_split(self._splits_arg, self._variables_arg)
            first = self._split_sources.get("train") or next(iter(self._split_sources.values()))
            self.store, self.views, self.manifest = first
            return
        given = self._store_arg
        if given is None:
            raise TypeError("InSituDataModule needs a store (or splits of one collection each)")
        # a collection is read from its store (one, or its members' stores routed)
        store = (
            given.store if isinstance(given, Collection) else as_store(given, **self._store_options)
        )
        variables, reader = self._variables_arg, self.coords_readers(store)  # (one read each)
        opts: dict[str, Any] = {"mask_and_scale": self.mask_and_scale, "cf_dtype": self.cf_dtype}
        if callable(variables):
            views = dict(variables(open_geometries(store, **opts, coords_reader=reader)))
        elif isinstance(variables, Mapping):
            views = dict(variables)
        else:
            views = dict(open_geometries(store, list(variables), **opts, coords_reader=reader))
        if not views:
            raise ValueError("InSituDataModule needs at least one variable")
        seed = self.plan_config.seed
        manifest = module_split(self._splits_arg, given, store, views, seed, reader)
        self.store, self.views, self.manifest = store, views, manifest

    def _rank_world(self) -> tuple[int | None, int | None]:
        trainer = self.trainer
        if trainer is None:
            return None, None
        return int(trainer.global_rank), int(trainer.world_size)

    def _key(self) -> tuple[int, int | None, int | None, PlanConfig]:
        """Whose training pipeline is built now, and how: the trainer, rank and world size,
        and the plan config (a batch size set since, as Lightning's batch-size finder sets it
        between its trials, builds the pipeline afresh)."""
        return (id(self.trainer), *self._rank_world(), self.plan_config)

    @property
    def train_epoch(self) -> int:
        """The epoch of the training data (``batch.epoch``, its permutation): the trainer's
        ``current_epoch``, less the one Lightning spends where it resumes a run ``max_steps``
        stopped (docs/training.md). Key a per-epoch schedule of the data (``dm.batch_size``,
        :meth:`set_views`) on it: keyed on ``current_epoch``, epochs after such a resume take
        the settings of the epoch after them. ``0`` before a trainer is attached."""
        return 0 if self.trainer is None else self._train_epoch(self.trainer)

    def _train_epoch(self, trainer: Any) -> int:
        """The epoch the training plan draws for ``trainer.current_epoch``: the same, except
        after Lightning resumed a run stopped by ``max_steps`` (it counts the stopped epoch as
        done, then resumes its next batch under the following epoch's number). A loaded state
        taken ``k`` batches into epoch ``e``, resumed by the trainer at batch ``k`` of a later
        epoch ``E``, continues: the plan's epochs run ``E - e`` behind the trainer's from then
        on (kept in :meth:`state_dict`), so the batches are those of the uninterrupted run."""
        epoch = int(trainer.current_epoch)
        check = self._resume_check
        if check is not None and check[0] == id(trainer):
            _, saved, done = check
            if epoch > saved and done > 0 and resumed_at(trainer) == done:
                self._epoch_offset = (id(trainer), epoch - saved)
                self._resume_check = None
        owner, offset = self._epoch_offset
        return epoch - offset if owner == id(trainer) else epoch

    def _built_config(self, split: str, rank: int | None, world: int | None) -> PlanConfig:
        """:meth:`plan_config_for` ``split`` with the trainer's rank and world size, unshuffled
        for a trainer that overfits (``overfit_batches``): Lightning turns a DataLoader's
        shuffling off for it, so that every epoch trains on the same batches."""
        config = self.plan_config_for(split).replace(rank=rank, world_size=world)
        if config.shuffle and self.trainer is not None and self.trainer.overfit_batches:
            warnings.warn(
                "overfit_batches: the training pipeline is built unshuffled (as Lightning does "
                "for a DataLoader), so every epoch trains on the same first batches",
                UserWarning,
                stacklevel=2,
            )
            config = config.replace(shuffle=False)
        return config

    def _build(self, split: str) -> InSituIterableDataset:
        self.setup()
        assert self.store is not None and self.manifest is not None
        rank, world = self._rank_world()
        key = self._key()
        old = self._loaders.get(split)
        if split == "train" and old is not None and self._train_key == key:
            return old  # a reload by the same trainer, same plan: keep the pipeline (and cache)
        old = self._loaders.pop(split, None)
        if old is not None:
            old.close()
        checked = self._checked_manifest
        store, views, manifest = self._split_sources.get(
            split, (self.store, self.views, self.manifest)
        )
        try:
            pipe = insitu_pipeline(
                store,
                manifest if checked is None else checked,
                self._train_views if split == "train" and self._train_views else views,
                batch_transforms=self.batch_transforms,
                chunk_transforms=self.chunk_transforms,
                coords=self.coords,
                coords_reader=self.coords_readers(store),
                config=self._built_config(split, rank, world),
                fetch=self.fetch_options,
                cache=self.cache_options_for(split),
                # decided by the first build; the others take its manifest, which carries them
                missing=self.missing if checked is None else None,
                missing_objects=self.missing_objects if checked is None else "read",
            )
        except TooFewSamplesError as few:  # (every rank raises it: the same split, world)
            if split == "train":
                raise
            fn = getattr(getattr(self.trainer, "state", None), "fn", None)
            raise too_few_for_ranks(few, getattr(fn, "value", fn)) from None
        if checked is None and (self.missing is not None or self.missing_objects == "drop"):
            self._checked_manifest = pipe.stages.plan.manifest
        trainer = self.trainer
        # evaluation draws its epoch 0 every run: the same windows of random patches each time
        epoch_fn = _first_epoch if split != "train" else None
        if split == "train" and trainer:
            epoch_fn = lambda: self._train_epoch(trainer)  # noqa: E731
        dataset = as_dataset(pipe, transform=self.transform, epoch_fn=epoch_fn)
        dataset.without_state = _without_state(type(self).__qualname__)
        self._loaders[split] = dataset
        if split == "train":
            self._train_key = key
        return dataset

    def set_views(self, views: Mapping[str, ArrayGeometry | Stack]) -> None:
        """Train on ``views`` (of the same arrays: other windows or shifts, a rollout that
        grows; stacks with other static or forcing members) from the next epoch on: forwarded
        to the training pipeline's
        :meth:`~insitubatch_nodes.pipeline.InSituPipeline.set_views` (checked there), and
        kept for a training pipeline built later. Validation and testing keep the views the
        module was made with. Call it between epochs, e.g. from a callback's
        ``on_train_epoch_end``."""
        train = self._loaders.get("train")
        if train is not None:
            train.pipeline.set_views(views)
        self._train_views = dict(views)
        self._next_epoch_changed()

    def _next_epoch_changed(self) -> None:
        """Have the trainer reload the training loader before its next epoch where that epoch
        differs from what it was told: another length (other views), or a pipeline to build
        afresh (another batch size). Without the reload Lightning keeps the loader it has."""
        trainer = self.trainer
        for callback in getattr(trainer, "callbacks", None) or []:
            if isinstance(callback, EpochLengthSync):
                callback.on_train_epoch_end(trainer, trainer.lightning_module)

    def _next_epoch_differs(self) -> bool:
        """Whether the training loader's next epoch differs from what the trainer was told
        (asked by :class:`~insitubatch_nodes.lightning_epochs.EpochLengthSync` where an epoch
        ends, and by :meth:`set_views` and the batch size): another length, or a pipeline to
        build afresh (another batch size). A resumed epoch is over by then; one whose loaded
        state ended it (a checkpoint of the validation on its last batch, whose end hooks
        Lightning runs again) is compared by the next epoch's length, not its own."""
        self._resume_check = None  # the resumed epoch is over: its state was consumed
        train = self._loaders.get("train")
        if train is None or train.told_len is None:
            return False
        ended = train.ended_epoch_lens()  # (the trainer still in the ended epoch: its batches)
        nxt = train.next_len() if ended is None else ended[1]
        return nxt != train.told_len or self._train_key != self._key()

    # -- loaders ------------------------------------------------------------------------------
    def train_report(self) -> EpochReport | None:
        """The training pipeline's epoch report (see
        :meth:`~insitubatch_nodes.pipeline.InSituPipeline.report`), or ``None`` before any."""
        train = self._loaders.get("train")
        return None if train is None else train.pipeline.report()

    def _attach(self, kind: type[pl.Callback]) -> None:
        """Add a ``kind()`` callback to the trainer unless it has one: before its checkpoint
        callbacks (which Lightning keeps last), so a ``ModelCheckpoint`` can monitor the
        metrics it logs, and not first, where Lightning's learning-rate finder keeps its own
        (it reads ``trainer.callbacks[0]``)."""
        callbacks: list[Any] | None = getattr(self.trainer, "callbacks", None)
        if callbacks is None or any(isinstance(c, kind) for c in callbacks):
            return
        at = next(
            (i for i, c in enumerate(callbacks) if isinstance(c, pl.callbacks.Checkpoint)),
            len(callbacks),
        )
        callbacks.insert(at, kind())

    def train_dataloader(self) -> InSituIterableDataset:
        if self.log_report:
            self._attach(InSituReportCallback)
        self._attach(EpochLengthSync)
        dataset = self._build("train")
        if restoring_loops(self.trainer):  # (#20550) its counts are not the checkpoint's yet:
            return dataset  # the state waits; EpochLengthSync has the loader built again then
        if self._pending_train_state is not None:
            if trained_its_last_batch(self.trainer):  # (limit_train_batches: a mid-epoch state)
                dataset.end_loaded_epoch()  # (and Lightning's copy of the state, loaded next)
            dataset.load_state_dict(self._pending_train_state)
            self._pending_train_state = None
        self._reload_after_an_ended_epoch(dataset)
        return dataset

    def _reload_after_an_ended_epoch(self, dataset: InSituIterableDataset) -> None:
        """A state loaded where the trainer's epoch ended: have the trainer reload the loader
        before the next epoch where it differs, Lightning counting the ended one as over
        (:func:`~insitubatch_nodes.lightning_epochs.follow_ended_epoch`)."""
        if follow_ended_epoch(self.trainer, dataset.ended_epoch_lens()):
            self._resume_check = None  # (the epoch ended: no batch of it is resumed)

    def val_dataloader(self) -> InSituIterableDataset:
        return self._build("val")

    def test_dataloader(self) -> InSituIterableDataset:
        return self._build("test")

    def predict_dataloader(self) -> InSituIterableDataset:
        return self._build("test")

    # -- checkpoint state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The training loader's state (plain Python), as of the last batch delivered, and
        ``"epoch_offset"``, how many epochs the training plan runs behind the trainer's epoch
        (see :meth:`_train_epoch`) where it does."""
        train = self._loaders.get("train")
        if train is None:
            return {}
        out: dict[str, Any] = {"train_loader": train.state_dict()}
        owner, offset = self._epoch_offset
        if offset and owner == id(self.trainer):
            out["epoch_offset"] = offset
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remember a training loader state: applied to the training loader of this trainer
        (rank, world size), built now or later. A loader built for another trainer (a data
        module reused for a resumed run) is replaced when the new trainer asks for one, and the
        state goes to the new loader. Where a trainer restores it, the loader it has (if any)
        is built again once the trainer's counts are the checkpoint's (``restoring_loops``)."""
        self._epoch_offset = (id(self.trainer), int(state_dict.get("epoch_offset", 0)))
        state = state_dict.get("train_loader")
        if not state:
            return
        plan = plan_state(state)
        self._resume_check = (id(self.trainer), int(plan["epoch"]), int(plan["batches_emitted"]))
        train = self._loaders.get("train")
        if restoring_loops(self.trainer):  # applied where the loader is built after the restore
            self._pending_train_state = state
            rebuild_training_loader(self.trainer)  # (one built before it: the state lacks)
        elif train is not None and self._train_key == self._key():
            train.load_state_dict(state)
        else:
            self._pending_train_state = state

    def teardown(self, stage: str | None = None) -> None:
        """Close the loaders the Trainer call ``stage`` read (``"fit"``: training's and
        validation's; ``"validate"``: validation's; ``"test"``, ``"predict"``: the test
        split's), so that one call's end leaves another's loader running (a validate or test
        teardown amid a fit cleared the training pipeline's pool: its chunks were read
        again); ``None``: every loader. A closed loader is kept: asked for again by the same
        trainer, it resumes where it was (see ``InSituPipeline.close``)."""
        for split in read_by(stage):
            dataset = self._loaders.get(split)
            if dataset is not None:
                dataset.close()


def _first_epoch() -> int:
    """The epoch an evaluation pipeline draws every run (random patch origins are a function
    of it, so each validation run evaluates the same windows)."""
    return 0


def _without_state(key: str) -> str:
    """How a data module's user goes on without a loader state its pipeline refuses: the
    checkpoint holds it twice (the data module's entry ``key`` and the fit loop's loader
    state), and a trainer resumed without either starts the data order afresh."""
    return (
        "To go on with this data module instead, resume from a checkpoint without its loader "
        "state: ckpt = torch.load(path, weights_only=False); del ckpt[" + repr(key) + "]; "
        "del ckpt['loops']['fit_loop']['state_dict']['combined_loader']; torch.save(ckpt, "
        "new_path); trainer.fit(..., ckpt_path=new_path). The rest of the trainer's epoch "
        "({epoch}) is then batches of a fresh order of it"
    )
