"""What the pipeline delivers: a :class:`Batch` of numpy arrays, and its torch adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["ROW_KEYS", "Batch", "BatchTransform", "DeviceTransform", "to_item", "to_torch"]


@dataclass(repr=False)
class Batch:
    """One batch: per label, an array shaped ``(len(batch), *inner_shape)`` — or, for a window
    view (:meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.window`), ``(len(batch), T,
    *inner_shape)``.

    ``sample_indices[label][i]`` is the sample-axis index row ``i`` of ``arrays[label]`` was read
    from (the anchor plus that label's view offset); for a window it is ``(len(batch), T)``,
    one index per step, and so are the label's ``coords``. ``epoch`` and ``index`` locate the
    batch in the run. The arrays may be views of reused buffers: a batch (or a tensor made from
    it) that you keep stays valid — its buffer is not reused while anything references it.

    ``coords[label][name][i]`` is the value of coordinate ``name`` (e.g. ``"time"``) at row ``i``
    of ``arrays[label]``: the decoded coordinate indexed with ``sample_indices[label]``, so a
    shifted view has its own values (``numpy.datetime64``, or cftime dates in an ``object``
    array, for CF time; see :mod:`insitubatch_nodes.io.calendars`). Labels without coordinates
    are absent. Coordinates stay numpy: :func:`to_torch` converts ``arrays`` only. A batch
    transform that drops or reorders rows must do the same to ``sample_indices``, ``coords`` and
    ``patch_origins``.

    ``patch_origins[label]`` (patched views only: see
    :meth:`~insitubatch_nodes.io.geometry.ArrayGeometry.patches`) is an int array
    ``(len(batch), n_patch_axes)``: row ``i`` of ``arrays[label]`` is the window of the field
    starting at ``patch_origins[label][i]`` along the patched axes (in physical axis order).
    Views patched alike hold the same origins row for row.

    ``members[label]`` (labels read from a :class:`~insitubatch_nodes.io.collection.Collection`
    only) is each row's member index (``int64``, ``(len(batch),)``; a window never crosses
    members); for such a label ``sample_indices[label]`` is the index *within* that member, so
    row ``i`` is ``member_array[sample_indices[label][i]]`` of member ``members[label][i]``.
    Stores joined along one axis (``Collection.concat``) keep one continuous index instead:
    ``sample_indices`` count along the joined axis, and ``members[label]`` (shaped like them:
    a window may span two stores) names the store of each step.

    ``channels[label]`` (channel stacks only: :func:`~insitubatch_nodes.stack.stack`) names
    the channels of ``arrays[label]`` in order (``"temperature@500"``, ``"2m_temperature"``).
    """

    arrays: dict[str, np.ndarray]
    sample_indices: dict[str, np.ndarray]
    epoch: int
    index: int
    meta: dict[str, Any] = field(default_factory=dict)
    coords: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    patch_origins: dict[str, np.ndarray] = field(default_factory=dict)
    #: a channel stack's channel names in order (:func:`~insitubatch_nodes.stack.stack`)
    channels: dict[str, list[str]] = field(default_factory=dict)
    #: each row's member, for labels read from a collection
    members: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        for arr in self.arrays.values():
            return int(arr.shape[0])
        return 0

    def __getitem__(self, label: str) -> np.ndarray:
        return self.arrays[label]

    def __repr__(self) -> str:
        """One line, no values: each label's dtype and shape, and which labels carry
        coordinates, patch origins, channels and members (the dataclass's own repr printed
        every array, tens of kB for a small batch)."""

        def shapes(d: dict[str, Any]) -> str:  # (a batch transform may leave other things)
            return ", ".join(
                f"{k!r}: {a.dtype}{tuple(a.shape)}" if hasattr(a, "shape") else f"{k!r}: {a!r:.40}"
                for k, a in d.items()
            )

        extra = "".join(
            f", {name}={sorted(d)}"
            for name, d in (("coords", self.coords), ("patch_origins", self.patch_origins),
                            ("channels", self.channels), ("members", self.members))
            if d
        )  # fmt: skip
        arrays = shapes(self.arrays)
        return f"Batch(epoch={self.epoch}, index={self.index}, arrays={{{arrays}}}{extra})"


BatchTransform = Callable[[Batch], Batch]
"""A callable applied to every gathered batch, in order, before it is queued for the consumer."""


def _pinned_copy(arr: np.ndarray) -> torch.Tensor:
    import torch

    src = torch.from_numpy(np.ascontiguousarray(arr))
    staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    staging.copy_(src)
    return staging


def _torch_ready(label: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` as ``torch.from_numpy`` takes it: native byte order (one copy when it is not:
    pipeline batches always are), and a dtype torch has."""
    if arr.dtype.kind in "biufc":
        return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))
    hint = (
        f'e.g. batch.arrays[{label!r}].view("int64") in a batch transform'
        if arr.dtype.kind in "mM"
        else "convert it to numbers in a batch transform"
    )
    raise TypeError(
        f"to_torch: label {label!r} holds dtype {arr.dtype}, which torch has no tensor type "
        f"for (torch takes bool, integer, float and complex arrays): {hint}, or leave the "
        "label out of the dict passed to to_torch"
    )


DeviceTransform = Callable[[dict[str, "torch.Tensor"]], dict[str, "torch.Tensor"]]
"""A callable on the ``{label: tensor}`` dict after the copy to the device (:func:`to_torch`)."""


def to_torch(
    batch: Batch | Mapping[str, np.ndarray],
    device: str | torch.device | None = None,
    device_transforms: Sequence[DeviceTransform] = (),
) -> dict[str, torch.Tensor]:
    """Convert a batch's ``arrays`` to ``{label: torch.Tensor}`` (``batch.coords`` stay numpy:
    ``datetime64`` has no torch dtype; turn times into numeric features in a batch transform).

    On the CPU (``device=None`` or ``"cpu"``) the tensors share memory with the batch arrays (no
    copy), except an array with a negative stride (a flip, ``x[:, ::-1]``, in a batch
    transform), which torch cannot view: it is copied once. Every dtype a pipeline batch holds
    converts: bool, integers (unsigned too), floats and complex, always in native byte order
    (big-endian zarr v2 data is swapped as it is decoded).
    An array of your own in another byte order is converted with one copy; a dtype torch has no
    tensor type for (``datetime64``, strings, objects) raises ``TypeError`` naming the label.

    For a CUDA device each array is staged through page-locked host memory and copied
    with ``non_blocking=True`` on the current stream; use the tensors on that stream (or
    synchronise) before reading them on the host. Other devices get a plain ``.to(device)``.

    ``device_transforms`` run in order on the ``{label: tensor}`` dict once every tensor is on
    ``device``, each returning the dict to pass on (it may add, drop or replace labels). They
    run on the calling thread and, for CUDA, are queued on the current stream after the copies:
    the place for work that is cheap on the device (normalizing, interpolating, FFTs). On the
    CPU the tensors share memory with the batch: a transform that writes in place writes into
    the batch.
    """
    import torch

    if isinstance(device_transforms, (str, bytes)) or not isinstance(device_transforms, Sequence):
        raise TypeError(
            "device_transforms must be a list of callables {label: tensor} -> {label: tensor}, "
            f"got {device_transforms!r}"
        )
    for t in device_transforms:
        if not callable(t):
            raise TypeError(
                f"device_transforms must be callables {{label: tensor}} -> {{label: tensor}}, "
                f"got {t!r}"
            )

    arrays = batch.arrays if isinstance(batch, Batch) else batch
    dev = torch.device(device) if device is not None else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    for label, arr in arrays.items():
        arr = _torch_ready(label, np.asarray(arr))
        if dev.type == "cpu":
            if any(stride < 0 for stride in arr.strides):  # a flip: torch has no such strides
                arr = np.ascontiguousarray(arr)
            out[label] = torch.from_numpy(arr)
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"to_torch(device={str(dev)!r}) needs CUDA, but this torch build has none; "
                    "pass device=None for CPU tensors"
                )
            out[label] = _pinned_copy(arr).to(dev, non_blocking=True)
        else:
            out[label] = torch.from_numpy(arr).to(dev)
    for transform in device_transforms:
        result = transform(out)
        if not isinstance(result, dict):
            raise TypeError(
                f"device transform {transform!r} returned {type(result).__name__}; it must "
                "return the {label: tensor} dict"
            )
        out = result
    return out


ROW_KEYS = ("sample_indices", "members", "patch_origins")
"""The keys :func:`to_item` adds beside the labels: where each row came from, per label."""


def to_item(batch: Batch) -> dict[str, Any]:
    """An item for :func:`~insitubatch_nodes.as_dataset` and ``InSituDataModule``
    (``transform=to_item``; their default is :func:`to_torch`): :func:`to_torch` of ``batch``
    (``{label: tensor}``, zero-copy on the CPU) plus where each row came from, under the keys
    :data:`ROW_KEYS`:

    * ``item["sample_indices"][label]`` — ``batch.sample_indices[label]``;
    * ``item["members"][label]`` — ``batch.members[label]`` (labels read from a collection;
      ``{}`` otherwise);
    * ``item["patch_origins"][label]`` — ``batch.patch_origins[label]`` (patched views;
      ``{}`` otherwise).

    Each is a tensor of the batch's integers (a copy: a few per row; the plan's own arrays are
    read-only), row ``i`` describing row ``i`` of ``item[label]``. Every tensor in the item has
    the batch's length as its first dimension and nothing else is in it, so a DataLoader with
    ``batch_size=None`` passes the item on as it is, and Lightning moves it to the device and
    infers its batch size without ambiguity. Left out: ``epoch`` and ``index`` (plain ints,
    which Lightning's batch-size inference cannot read: the trainer's ``current_epoch`` and
    ``batch_idx`` are the same), ``coords`` (``datetime64`` and cftime dates have no torch
    dtype), ``channels`` (a stack's names, the same every batch) and ``meta``: a transform of
    your own adds what it needs, e.g. ``lambda b: {**to_item(b), "hour": ...}``.

    A label named like one of :data:`ROW_KEYS` would be overwritten: ``ValueError`` saying so.
    """
    import torch

    clash = [key for key in ROW_KEYS if key in batch.arrays]
    if clash:
        raise ValueError(
            f"label(s) {clash} of the batch are also keys to_item adds beside the labels "
            f"{list(ROW_KEYS)} (where each row came from): rename the label(s), or give "
            "as_dataset / InSituDataModule transform=to_torch (the arrays only) or a "
            "transform of your own"
        )
    item: dict[str, Any] = dict(to_torch(batch))
    for key in ROW_KEYS:
        rows: dict[str, np.ndarray] = getattr(batch, key)
        item[key] = {label: torch.from_numpy(np.array(a)) for label, a in rows.items()}
    return item
