"""The user docs' claims about model inputs and resuming (docs/model-inputs.md, the resume
sections of docs/training.md), each checked against the package, zarr and numpy on a tiny store.

Found wrong (fixed):

- A state saved by a pipeline of plain labels (``{"x": t2m, "y": t2m.shift(1)}``, or
  ``patches()`` views without windows or stacks) did not record its views, so a pipeline built
  with other views refused it even at an epoch's end (``StateMismatchError``: "its dataset
  (arrays, views or split chunks) differs", with two hashes), where training.md and concepts.md
  say a state taken where an epoch begins or ends restores and the next epoch runs with the
  pipeline's own views; and mid-epoch, other patches were refused with those two hashes, not
  naming the arrays and how they differ (``z: extent (2, 4) vs (4, 4)``), as training.md
  says. Only states of windows, stacks or after ``set_views`` recorded their views. Every
  state now records them (states saved before still restore as before).
- ``geom.as_static()`` (concepts.md) of a selected view dropped the selection without a word
  (``lsm.sel(lat=slice(-40, 40)).as_static()`` was the whole field): now refused, saying to
  select after it.
- ``sel(..., method="nearest", tolerance=t)`` with no value within ``t`` said only that the
  value "is not a value of coordinate": it now names the tolerance.
- A mid-epoch state refused for other views, patches or inputs (a stack's channels, a
  selection) was a plain ``ValueError`` with the pipeline's advice only, where training.md's
  refusals are ``StateMismatchError``s that a data module rewords (how to resume a checkpoint
  without its loader state); now they are too (``.epoch``, ``.batches``).

Docs corrected without a test: concepts.md's read-plan state (it lists the views it records;
a differing configuration is refused mid-epoch only), training.md's "plain Python values
(strings, ints, bools)" (dicts, lists, floats and ``None`` too: a forcing's period),
transforms.md's scaler fit now points to ``fit_statistics`` / ``stats.scaler()``.

Checked and found right:

- model-inputs.md: every printed output of its code blocks (shapes, channel names and
  order, ``strides[0] == 0`` of a static label, ``datetime64[ns]`` times, the anemoi
  walk-through's counts and ``dropped``); ``import insitubatch_nodes.stack as m`` binds the
  function; ``LAYOUTS``; ``Stack`` top-level; ``stack``'s and ``fit_statistics``' signatures
  (``split="train"`` default); ``ArrayGeometry.dim_names`` for ``dataclasses.replace``;
  ``StaticFields(arrays, views, patches=)`` and ``ReadPlanNode(..., statics=)`` exist.
- training.md: a state (stacks, forcings, patches, statics) survives JSON and
  ``torch.load(weights_only=True)``; another batch size mid-epoch is a ``StateMismatchError``
  with ``.epoch``/``.batches``, both values, ``set_epoch(e)`` and ``e + 1``; at an epoch's end
  it restores into the next epoch with the new batching (``len(loader)`` its length); a
  ``Loader`` state at step ``k`` continues with batch ``k + 1``; a ``Mapper``'s state restored
  without it is a ``ValueError`` saying so, the other way torchdata's ``KeyError: 'it_state'``;
  ``to_item``'s ``sample_indices`` (int64), ``members == {}``, ``patch_origins == {}``, and
  its refusal of a label named ``sample_indices``; ``num_workers=2`` refused at iteration;
  ``DataLoader(pipe)`` a ``TypeError`` saying to use ``as_dataset``;
  ``PlanConfig(remainder="uneven")`` refused naming ``'drop'`` and ``'pad'``; the quoted
  mid-epoch refusals of other stack channels (``'x' channels [...] saved, [...] now``), a
  dropped static label (``'lsm' static 'lsm' saved, None now``), a stack's static member of
  another array (``{'lsm': 'lsm'} saved, {'lsm': 'oro'} now``); a static label added to a
  pipeline resumes mid-epoch; the state is rank-independent (rank 1 resumes its own share
  from rank 0's state); a store copied elsewhere resumes; ``torchdata``'s save-then-load on one
  ``Loader`` object resumes; ``remainder`` and ``cross_split_windows`` are refused even at an
  epoch's end (not among the batching settings, as the page says); the data module's
  ``config=PlanConfig(split="val")``, ``eval_batch_size=0``, ``transform=3``, a bare
  ``batch_transforms`` callable, ``cf_dtype`` beside mapped views are refused as it says;
  ``dm.batch_size = n`` sets ``dm.plan_config``; ``plan_config_for("val")`` is unshuffled and
  ``"uneven"``.
- model-inputs.md behaviours: ``isel``/``sel`` of nothing is ``IndexError``; an int (numpy,
  0-d) drops the axis; an absent value ``KeyError``; a slice with ``method`` ``ValueError``;
  ``DataArray`` pointwise indexers ``TypeError``; ``slice(350, 10)`` on 0..360 ``IndexError``
  naming the two views; a north-to-south slice on an ascending latitude says so; nearest ties
  go to the larger value; float32 latitudes match Python floats; a slice on the unsorted
  levels takes pandas' positions, with a step; ``sample_axis="tme"`` ``KeyError`` listing the
  dimensions; ``isel(lat=slice(None))`` is no selection; a patched axis cannot be selected nor
  a selected one patched. Objects read: ``z500`` 1 of 4 per chunk (8, 16, 32 gets for 1, 2, 4
  levels). Values against numpy for ``isel`` of one axis, uneven lists on two and three axes,
  at one sample per chunk with levels whole in each object, ``direct=True`` and not, and a
  stack of selected levels, a field and a static member. ``set_views`` selecting more is
  refused naming ``['z']``; static labels added, dropped or selected otherwise refused; a
  pipeline of static views only refused; a static array read once for two labels and a stack
  member (``static_gets`` 1), ``set_views`` reading only a new static array (1 → 2, then 2);
  the persistent cache serves it (``static_disk_hits`` 1, ``static_gets`` 0), re-reads it when
  changed, and a read-only cache raises ``StaleCacheError``; a static label is stride 0 in
  numpy and in ``to_torch``, with no ``sample_indices`` or ``coords`` entry; a static on the
  grid under other names is refused giving ``dataclasses.replace(..., dim_names=("lat",
  "lon"))``, after which each row carries its window (checked against numpy); a static box
  beside patched labels refused. ``fit_statistics`` against numpy: mean, std (ddof 0), min,
  max per level, a selected box, ``stride="12h"``; ``diff_std`` NaN for a static label; its
  ``rank``/``coords`` keywords ``TypeError``; a split of no chunk ``ValueError`` naming each
  split's chunks; ``fetch=``/``cache_budget_bytes=`` accepted; ``Forcings`` skipped;
  ``Statistics.load`` accepts a ``Path``, a trailing ``/``, a shifted view, refuses another
  manifest's samples, split or array; ``scaler()`` refuses two labels of one array fitted on
  other points, and as a chunk transform standardises as numpy does; a label standardised
  twice refused; ``normalizer(same_as=)`` gives the target its input's statistics; stacks
  refuse statistics of other levels or another order. ``cf_dtype="float32"`` unpacks a
  packed ``int16`` to float32 (xarray: float64). ``Forcings``: ``period`` of 0 or negative
  ``ValueError``; batches without time ``KeyError`` naming ``time_name=``; a meshgrid and
  latitudes past 90 refused; windows give ``(batch, T, lat, lon)`` float32; a patched label
  with whole-grid forcings refused. Stacks: fields of another box, another ``T``, another
  patching refused naming the members; a static overflowing ``float16``, the radiation in
  ``float16``, any forcing in ``int16``, a float static in ``int16`` refused; cosines stack
  into ``float16``; a ``uint8`` mask is 0/1 in a float32 stack; ``v@0.1`` of a float32
  coordinate; the stack's ``sample_indices`` are its first sampled member's; ``set_views``
  with forcings and no times ``ValueError``. Grids of points: ``geom.points``, one statistic
  per level, ``t@850`` channels with a static ``(values,)`` member and forcings ``(batch, n)``
  equal to the batch transform's, the mask box, ``sel(latitude=...)`` ``KeyError`` saying to
  use a mask, ``patches({"values": 8})`` carrying the static's own points.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store of model-inputs.md: ``t2m``, ``z`` (4 levels), 64 steps of 8 × 16, 8 a chunk,
    and a static ``lsm``."""
    root = tmp_path_factory.mktemp("docclaims") / "era5.zarr"
    make_era5_like(root, n_time=64, n_lat=8, n_lon=16, n_level=4, samples_per_chunk=8)
    lsm = zarr.create_array(root / "lsm", shape=(8, 16), chunks=(8, 16), dtype="float32",
                            dimension_names=("lat", "lon"))  # fmt: skip
    lsm[...] = np.arange(128, dtype="float32").reshape(8, 16) % 3 == 0
    return root


def _epochs(root: Path, views: dict[str, Any], state: Any = None, n: int = 1) -> Any:
    """``(records, state)``: ``n`` epochs (after ``state``) of a fresh pipeline over ``views``,
    each batch's ``(epoch, label, sample_indices, patch_origins)``, checked against zarr."""
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    z = np.asarray(zarr.open_array(root / "z")[...])
    records = []
    with insitu_pipeline(root, manifest, views, batch_size=32, coords=()) as pipe:
        loader = Loader(pipe)
        if state is not None:
            loader.load_state_dict(state)
        for _ in range(n):
            for batch in loader:
                for label, rows in batch.sample_indices.items():
                    origins = batch.patch_origins.get(label)
                    records.append((batch.epoch, label, rows.tolist(), None if origins is None
                                    else origins.tolist()))  # fmt: skip
                    if views[label].path == "z" and origins is None:
                        np.testing.assert_array_equal(batch.arrays[label], z[rows])
        return records, loader.state_dict()


def _mid_state(root: Path, views: dict[str, Any], k: int = 2) -> Any:
    g = open_geometries(root)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    with insitu_pipeline(root, manifest, views, batch_size=32, coords=()) as pipe:
        loader = Loader(pipe)
        it = iter(loader)
        for _ in range(k):
            next(it)
        return loader.state_dict()


@pytest.mark.parametrize(
    "before, after",
    [
        ({"x": ("z", 0, None), "y": ("z", 1, None)}, {"x": ("z", 0, None), "y": ("z", 2, None)}),
        ({"x": ("z", 0, (2, 4))}, {"x": ("z", 0, (4, 4))}),
        ({"x": ("z", 0, None)}, {"x": ("z", 0, (4, 4))}),
    ],
    ids=["other-shift", "other-patches", "patched-now"],
)
def test_a_state_of_plain_labels_saved_at_an_epochs_end_restores_into_other_views_next_epoch(
    root: Path, before: dict[str, Any], after: dict[str, Any]
) -> None:
    """training.md: a state taken where an epoch ends restores under other views (other
    patches, "of however many windows") and the next epoch is the new pipeline's own. Before,
    a state of labels without windows or stacks recorded no views and was refused."""

    def views(spec: dict[str, Any]) -> dict[str, Any]:
        g = open_geometries(root)
        out = {}
        for label, (path, shift, cut) in spec.items():
            view = g[path].shift(shift)
            out[label] = view if cut is None else view.patches({"lat": cut[0], "lon": cut[1]})
        return out

    _, end = _epochs(root, views(before))
    got, _ = _epochs(root, views(after), state=end)
    fresh, _ = _epochs(root, views(after), n=2)
    assert got and got == [r for r in fresh if r[0] == 1]


def test_a_mid_epoch_state_restored_with_other_patches_names_the_array_and_how(
    root: Path,
) -> None:
    """training.md quotes ``z: extent (2, 4) vs (4, 4)``; before, a patched label without
    windows was refused with two dataset hashes."""
    z = open_geometries(root)["z"]
    state = _mid_state(root, {"x": z.patches({"lat": 2, "lon": 4})})
    with pytest.raises(ValueError, match=r"z: extent \(2, 4\) vs \(4, 4\)"):
        _epochs(root, {"x": z.patches({"lat": 4, "lon": 4})}, state=state)


def test_as_static_refuses_a_selected_view_rather_than_dropping_its_selection(root: Path) -> None:
    """concepts.md names ``geom.as_static()``; before, ``lsm.sel(lat=slice(-40, 40))
    .as_static()`` returned the whole field (its selection dropped without a word), and so did
    a selected sampled view. Selecting after ``as_static()`` keeps the selection."""
    g = open_geometries(root)
    for view in (g["lsm"].sel(lat=slice(-40, 40)), g["z"].isel(level=0)):
        with pytest.raises(ValueError, match="select after as_static"):
            view.as_static()
    assert g["lsm"].as_static().sel(lat=slice(-40, 40)).inner_shape == (4, 16)
    assert g["z"].as_static().isel(level=0).inner_shape == (64, 8, 16)


def test_a_nearest_value_outside_the_tolerance_is_refused_naming_the_tolerance(root: Path) -> None:
    """model-inputs.md: ``tolerance=`` bounds the distance, else ``KeyError``. Before, the
    error said only that 300 "is not a value of coordinate 'level'", which the user who asked
    for the nearest one knew."""
    z = open_geometries(root)["z"]
    with pytest.raises(KeyError, match=r"300 .*not .*within tolerance=10 .*widen the tolerance"):
        z.sel(level=300, method="nearest", tolerance=10)
    assert z.sel(level=300, method="nearest").select == z.sel(level=250).select  # (no bound)
    with pytest.raises(KeyError, match="not a value of coordinate 'level' \\("):
        z.sel(level=300)  # (no method: as before)


def test_a_mid_epoch_state_of_other_views_is_a_state_mismatch_that_a_data_module_rewords(
    root: Path,
) -> None:
    """training.md: the refusal is a ``StateMismatchError`` (``.epoch``, ``.batches``), and a
    data module's user is told how to go on without the loader state. A state of other views
    (another shift; other patches) or of other inputs (levels in another order, a stack's
    channels) was a plain ``ValueError`` that kept the pipeline's advice (``set_views``, which
    the data module's user does not call where a checkpoint is loaded)."""
    from insitubatch_nodes import as_dataset
    from insitubatch_nodes.errors import StateMismatchError

    g = open_geometries(root)
    z = g["z"]
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    cases = [
        ({"x": z, "y": z.shift(1)}, {"x": z, "y": z.shift(2)}, "views"),
        ({"x": z.patches({"lat": 2, "lon": 4})}, {"x": z.patches({"lat": 4, "lon": 4})}, "extent"),
        ({"x": z.isel(level=[0, 1])}, {"x": z.isel(level=[1, 0])}, "'x' select"),  # (inputs)
    ]
    for saved, now, says in cases:
        with insitu_pipeline(root, manifest, saved, batch_size=32, coords=()) as pipe:
            dataset = as_dataset(pipe)
            items = iter(dataset)
            next(items)
            state = dataset.state_dict()
        with insitu_pipeline(root, manifest, now, batch_size=32, coords=()) as pipe:
            dataset = as_dataset(pipe)
            dataset.without_state = "GO ON THUS (epoch {epoch})"  # (as InSituDataModule sets it)
            with pytest.raises(StateMismatchError, match=says) as refused:
                dataset.load_state_dict(state)
            assert (refused.value.epoch, refused.value.batches) == (0, 1)
            assert str(refused.value).endswith("GO ON THUS (epoch 0)")
