"""Trial of the public API as a typed user sees it: ``mypy --strict`` over documented usage,
``help()``/docstrings against signatures, arguments checked where they are given, and ``repr``.

Found and fixed:

- ``Loader(pipe)`` was ``Loader[Any]`` under ``mypy --strict`` ("Need type annotation"), and
  ``for batch in Loader(pipe)`` / ``next(iter(pipe))`` gave ``Any``, not ``Batch``: torchdata
  ships no type information, so ``BaseNode[T]`` is ``Any`` and told mypy nothing. ``Loader`` and
  ``PrefetcherNode`` now take the item type from the pipeline (overloads), and
  ``PrefetcherNode`` declares ``__iter__``/``__next__`` for type checkers; ``state_dict()``
  of both was ``Any`` (``--strict``: "Returning Any" from a function typed ``dict[str, Any]``).
- ``with insitu_pipeline(...) as pipe`` typed ``pipe`` as ``PrefetcherNode``, not
  ``InSituPipeline`` (``__enter__`` now returns ``Self``).
- ``stack(members, normalize=stats)`` (model-inputs.md) was a mypy error: the protocol it
  declared for ``normalize`` had a mutable ``mean`` attribute, invariant, which the
  ``dict`` of arrays ``Statistics`` holds does not match (now a read-only property).
- ``g.patches(cut)`` with ``cut = {"lat": 4, "lon": 8}`` (model-inputs.md) was a mypy error:
  ``dict[str, int]`` is no ``Mapping[int | str, int]`` (keys are invariant); now
  ``io.patching.AxisMap`` (by name, by index, or both). ``split_by_member(runs, {"train": [0]},
  by="acquisition")`` (collections.md) likewise: split values typed ``Sequence[str]``; and
  ``Collection.from_groups(None, [(store, group), ...], ...)``: groups typed ``Sequence[str]``.
- ``Stack``, what ``stack()`` returns and a label's view may be, was not on the top level
  (``ArrayGeometry`` is), and ``import insitubatch_nodes.stack as m`` binds the function
  ``stack``, not the module (``m.Stack``: ``AttributeError`` at run time, fine to mypy): it is
  exported beside ``ArrayGeometry`` (the shadowing itself would take renaming the module).
- ``PlanConfig(stride="6h")`` (its docstring; recipes/forecast_rollout.py) and a
  ``datetime.timedelta`` were mypy errors: the dataclass field, and so its constructor, is
  typed as the checked value (``int | numpy.timedelta64``). The constructor is now declared
  for type checkers with the inputs it takes.
- A zarr root group and an xarray ``Dataset`` stand for their store (concepts.md), but
  ``StoreLike`` (``open_geometries``, ``open_coordinates``, ...) and ``insitu_pipeline`` typed
  the store without them; ``fit_statistics`` typed it ``Any``; ``InSituDataModule`` typed its
  views ``Mapping[str, ArrayGeometry]`` though stacks work there.
- ``InSituDataModule(store, {"x": stack(...)}, (0.8, 0.1, 0.1))`` failed in ``setup`` with
  ``AttributeError: 'Stack' object has no attribute 'base'`` (the fractions split the first
  label's array; a stack's is its first sampled member's).
- Arguments refused only deep inside (``AttributeError``) or at the first batch: a
  non-``SplitManifest`` manifest (``insitu_pipeline``, ``fit_statistics``), a non-geometry to
  ``split_by_chunk``, one batch transform not in a list (``'function' object is not
  iterable``), a ``Loader`` over something that is no node, ``as_dataset(transform=1)``,
  ``Forcings(names="cos_solar_zenith")`` (listed its letters as unknown forcings), a
  ``Forcings`` label that is no string or a view that is no geometry, ``Coarsen(1.5)``
  (``'float' object is not iterable``). Each is a ``TypeError``/``ValueError`` saying what to
  pass, when the object is made.
- ``InSituDataModule`` took ``{"x": "t2m"}``, ``variables=5``, ``splits=(0.5, 0.5)``,
  ``log_report="yes"`` and ``store_options`` beside an opened store, failing only in
  ``setup`` inside the Trainer; ``coords="time"`` became the coordinates ``t``, ``i``, ``m``,
  ``e``. ``Statistics.normalizer`` took a stack (then said it had no statistics), a list
  (``AttributeError``) and ``eps="x"`` (a numpy ufunc error) or ``eps=-1``;
  ``open_coordinates(store, geom, "time")`` looked for an array ``t``.
- Taken as something else: ``Forcings(bins=1.5)`` (``int()``: 1 bin), ``split_by_chunk(
  contiguous="no")`` (truthy), a string ``seed`` (numpy's error), ``sel(tolerance="x")`` on a
  numeric coordinate (a numpy ufunc error), ``Loader(restart_on_stop_iteration="no")``,
  ``InSituReportCallback(prefix=1)`` (at the first logged epoch).
- ``repr`` of a ``Batch`` printed every array (14 kB for an (4, 8, 16) pair), of
  ``Statistics`` all seven fields' arrays, of a ``SplitManifest`` every chunk index (2.7 MB
  for 40 years of hourly one-sample chunks), and a pipeline's was ``<... object at 0x...>``:
  now one line each, without values and without reading the store. A collection of members
  in many stores (and every error naming its store) listed every store path: now the first
  and last three.

Tried and found right: every ``__all__`` name exists (top level, stages, options, errors,
forcings, statistics, stack, lightning, testing, io, plan, transforms, batch, report); the
signatures of the top-level functions and classes against the ``name=value`` their docstrings
state (no parameter named that does not exist, no default stated wrong); about 110 wrong
arguments to ``insitu_pipeline``, the settings objects, ``RetryPolicy``, ``open_store``,
``open_geometries``, the view methods (``isel/sel/window/shift/patches``), ``stack``,
``StandardScaler``, ``applies`` and ``fit_statistics``: all but those above refused at
construction with a message saying what to pass; the reprs of views, stacks, manifests and the
settings objects (one line, no store access); every name the docs, recipes/ and benchmarks/
import resolves where they import it, and is in that module's ``__all__`` (but
``forcings.SOLAR_IRRADIANCE``, added); every exception of ``errors`` derives from
``InSituError`` and the builtin its docs name; a user's ``SlotBacking`` (pipeline.md's
``CountingBacking``), ``Batch -> Batch`` and ``DecodedChunk -> DecodedChunk`` functions,
``applies``/``StandardScaler``/``Coarsen`` as chunk transforms, ``Forcings`` and a
normalizer as batch transforms, ``as_dataset(transform=to_item)`` and a callable of views for
``InSituDataModule`` all type-check. The docs' snippets and recipes/ through mypy leave only
errors of their own code (a name reused for another type) and two ``Optional`` s below.

Left as they are: ``pipe.report()`` is ``EpochReport | None`` (``None`` before the first
batch or with ``report=False``), so ``pipe.report().write_trace(path)`` (tracing.md) needs a
check under mypy; likewise ``manifest.sample_range``. ``shift(True)`` is a shift of 1.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import write_era5

from insitubatch_nodes import (
    Coarsen,
    Collection,
    Forcings,
    Loader,
    PlanConfig,
    SplitManifest,
    as_dataset,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.io import open_coordinates

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]

# mypy as a user of the installed package runs it: --strict on the user's file, the package's
# own modules silent (as site-packages are); the big untyped or slow-to-read dependencies
# skipped so one cold run stays near 5 CPU-seconds
MYPY_INI = """\
[mypy]
strict = True
python_version = 3.11
[mypy-torch.*,lightning.*,torchmetrics.*,xarray.*,pandas.*,obstore.*,numcodecs.*,cftime.*]
follow_imports = skip
[mypy-insitubatch_nodes.*]
follow_imports = silent
"""

DOCUMENTED_USAGE = """\
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, assert_type

import zarr

from insitubatch_nodes import (
    ArrayGeometry, Batch, Collection, Forcings, InSituPipeline, Loader, SplitManifest, Stack,
    Statistics, fit_statistics, insitu_pipeline, open_geometries, split_by_chunk,
    split_by_member, stack,
)
from insitubatch_nodes.lightning import InSituDataModule
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan import PlanConfig, choose_schedule
from insitubatch_nodes.pool import ChunkPool
from insitubatch_nodes.stages import (
    AsyncChunkFetchNode, ChunkPoolNode, GatherNode, PrefetcherNode, ReadPlanNode, StageContext,
)


def documented(root: Path, group: zarr.Group) -> None:
    geoms = open_geometries(group)  # a zarr root group stands for its store
    t2m = open_geometries(root)["t2m"]
    manifest = split_by_chunk(t2m, (0.8, 0.1, 0.1))
    pipe = insitu_pipeline(group, manifest, {"x": t2m, "y": t2m.shift(1)}, batch_size=8)
    loader = Loader(pipe)
    assert_type(loader, Loader[Batch])
    for batch in loader:
        assert_type(batch, Batch)
    assert_type(next(iter(pipe)), Batch)
    with insitu_pipeline(root, manifest, {"x": t2m}) as same:
        assert_type(same, InSituPipeline)
    stats = fit_statistics(group, manifest, {"t2m": t2m, "z": geoms["z"]})
    x = stack({"t2m": t2m, "z": geoms["z"]}, normalize=stats)
    labels: dict[str, ArrayGeometry | Stack] = {"x": x, "y": t2m.shift(1)}
    insitu_pipeline(root, manifest, labels).close()
    sun = Forcings("x", view=t2m, names=["cos_solar_zenith"])
    InSituDataModule(root, {"x": x, "y": stack({"t2m": t2m, "sun": sun})}, (0.8, 0.1, 0.1))
    assert_type(Statistics.load(root / "stats.json"), Statistics)
    cut = {"lat": 4, "lon": 8}  # a dict[str, int], as model-inputs.md builds it
    t2m.patches(cut, stride=cut, within={"lat": (0, 4)})
    t2m.sel(lat=10.0, method="nearest", tolerance="2h")  # (model-inputs.md: "2h" for dates)

    views = {"x": t2m, "y": t2m.shift(1)}
    config = PlanConfig(batch_size=32, stride="6h")  # any time step, as its docstring says
    PlanConfig(stride=datetime.timedelta(hours=6))
    plan = ReadPlanNode(manifest, views, schedule=choose_schedule(manifest, views, None, config))
    ctx = StageContext.create(plan, ChunkPool(None), options=FetchOptions(prefetch_depth=2))
    fetch = AsyncChunkFetchNode(plan, root, context=ctx)
    graph = PrefetcherNode(GatherNode(ChunkPoolNode(fetch, context=ctx), context=ctx), context=ctx)
    with graph as g:
        assert_type(g, PrefetcherNode[Batch])
        for b in Loader(graph):
            assert_type(b, Batch)


def saved(loader: Loader[Batch], pipe: InSituPipeline) -> list[dict[str, Any]]:
    return [loader.state_dict(), pipe.state_dict()]  # training.md: "plain Python"


def by_acquisition(runs: Collection) -> SplitManifest:  # collections.md: values of a key
    return split_by_member(runs, {"train": [0], "val": [1]}, by="acquisition")


def scenes(root: Path) -> Collection:  # members in several stores: (store, group) pairs
    return Collection.from_groups(None, [(str(root), "a"), (root, "b")], {"image": "image"})
"""


def test_documented_usage_type_checks_under_mypy_strict_with_batches_typed_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = pytest.importorskip("mypy.api")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    snippet = tmp_path / "user_script.py"
    snippet.write_text(DOCUMENTED_USAGE)
    monkeypatch.chdir(REPO)  # this checkout's package, as the tests import it
    out, err, rc = api.run(
        ["--config-file", str(tmp_path / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"),
         str(snippet)]
    )  # fmt: skip
    assert rc == 0, out + err


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_era5(tmp_path_factory.mktemp("api") / "era5.zarr", n_time=32)


def test_a_manifest_that_is_not_a_split_manifest_is_refused_when_the_pipeline_is_built(
    era5: Path,
) -> None:
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    with pytest.raises(TypeError, match="manifest must be a SplitManifest"):
        insitu_pipeline(era5, None, {"x": t2m})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="manifest must be a SplitManifest"):
        fit_statistics(era5, {"train": [0]}, {"t2m": t2m})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="geom must be an ArrayGeometry"):
        split_by_chunk("t2m")  # type: ignore[arg-type]


def test_one_batch_transform_not_in_a_list_is_refused_saying_to_wrap_it(era5: Path) -> None:
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    sun = Forcings("x", view=t2m, names=["cos_solar_zenith"])
    manifest = split_by_chunk(t2m)
    with pytest.raises(TypeError, match=r"one transform: \[transform\]"):
        insitu_pipeline(era5, manifest, {"x": t2m}, batch_transforms=sun)  # type: ignore[arg-type]


def test_a_loader_or_dataset_over_the_wrong_things_is_refused_when_made(era5: Path) -> None:
    with pytest.raises(TypeError, match="Loader takes the pipeline"):
        Loader([1, 2])  # type: ignore[call-overload]
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    pipe = insitu_pipeline(era5, split_by_chunk(t2m), {"x": t2m})
    with pipe, pytest.raises(TypeError, match="must be a callable Batch -> item"):
        as_dataset(pipe, transform=1)  # type: ignore[arg-type]


def test_forcings_and_coarsen_refuse_wrong_arguments_saying_what_to_pass(era5: Path) -> None:
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    with pytest.raises(TypeError, match=r"names=\['cos_solar_zenith'\]"):
        Forcings("x", view=t2m, names="cos_solar_zenith")
    with pytest.raises(TypeError, match="time_label must be the label"):
        Forcings(1, view=t2m)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="view must be an ArrayGeometry"):
        Forcings("x", view="t2m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Coarsen factor must be a positive integer"):
        Coarsen(1.5)  # type: ignore[arg-type]
    assert Coarsen((2, 2))._factors == (2, 2) and Coarsen(np.int64(3))._factors == (3,)


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_data_module_splits_fractions_over_a_stack_given_as_the_first_label(
    era5: Path,
) -> None:
    lightning = pytest.importorskip("insitubatch_nodes.lightning")
    g = open_geometries(era5)
    x = stack({"t2m": g["t2m"], "z": g["z"]})
    dm = lightning.InSituDataModule(era5, {"x": x, "y": g["t2m"].shift(1)}, (0.75, 0.25, 0.0))
    dm.setup("fit")
    assert dm.manifest == split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))


def test_reprs_of_batch_pipeline_and_statistics_are_one_short_line_without_values(
    era5: Path,
) -> None:
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))
    stats = fit_statistics(era5, manifest, {"t2m": g["t2m"], "z": g["z"]})
    with insitu_pipeline(
        era5, manifest, {"x": g["t2m"], "y": g["t2m"].shift(1)}, batch_size=4
    ) as pipe:
        batch = next(iter(pipe))
        text: dict[str, Any] = {"pipe": repr(pipe), "batch": repr(batch), "stats": repr(stats)}
    assert text["batch"] == (
        "Batch(epoch=0, index=0, arrays={'x': float32(4, 8, 16), 'y': float32(4, 8, 16)}, "
        "coords=['x', 'y'])"
    )
    assert text["pipe"].startswith("InSituPipeline(split='train', batch_size=4, views={'x': ")
    assert "offset=1" in text["pipe"] and text["pipe"].endswith("epoch=0)")
    assert text["stats"] == (
        f"Statistics({{'t2m': (), 'z': (2,)}}, fitted on {{'store': '{era5}', 'split': 'train'}})"
    )
    assert all("\n" not in t and len(t) < 400 for t in text.values())
    # 40 years of hourly one-sample chunks (ARCO-ERA5's layout): the dataclass printed 2.7 MB
    hourly = SplitManifest("t2m", 350_640, 1, {"train": tuple(range(280_512)), "test": (350_639,)})
    assert repr(hourly) == (
        "SplitManifest(array='t2m', n_samples=350640, samples_per_chunk=1, splits={'train': "
        "<280512 chunks 0..280511>, 'val': (), 'test': (350639,)}, fractions=(0.8, 0.1, 0.1), "
        "contiguous=True, seed=0, sample_range=None)"
    )
    batch.arrays["x"] = batch["x"].tolist()  # what a batch transform may leave: still one line
    assert repr(batch).startswith("Batch(epoch=0, index=0, arrays={'x': [[[")


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_a_data_module_refuses_views_splits_and_flags_of_the_wrong_kind_when_made(
    era5: Path,
) -> None:
    lightning = pytest.importorskip("insitubatch_nodes.lightning")
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    make = lightning.InSituDataModule
    with pytest.raises(TypeError, match=r"variables\['x'\] must be an ArrayGeometry view"):
        make(era5, {"x": "t2m"})
    with pytest.raises(TypeError, match="variables are array names"):
        make(era5, 5)
    with pytest.raises(TypeError, match=r"\(train, val, test\) chunk fractions"):
        make(era5, ["t2m"], (0.5, 0.5))
    with pytest.raises(TypeError, match="log_report must be True or False"):
        make(era5, ["t2m"], log_report="yes")
    with pytest.raises(ValueError, match="store_options apply to a URL or path"):
        make(open_store(era5), ["t2m"], store_options={"region": "eu-west-1"})
    # one coordinate name is that name, as insitu_pipeline takes it (not its four letters)
    assert make(era5, {"x": t2m}, np.array([0.5, 0.25, 0.25]), coords="time").coords == ("time",)


def test_a_normalizer_refuses_what_is_not_a_view_and_a_bad_eps_and_one_coordinate_name_is_one(
    era5: Path,
) -> None:
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))
    stats = fit_statistics(era5, manifest, {"t2m": g["t2m"]})
    with pytest.raises(TypeError, match=r"stack\(members, normalize=stats\)"):
        stats.normalizer({"x": stack({"t2m": g["t2m"]})})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="normalizer takes"):
        stats.normalizer(["t2m"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        stats.normalizer({"t2m": g["t2m"]}, eps=-1.0)
    assert list(open_coordinates(era5, g["t2m"], "time")) == ["time"]  # was: no array 't'


def test_the_plan_config_constructor_declared_for_type_checkers_lists_every_field() -> None:
    """``PlanConfig.__init__`` under ``TYPE_CHECKING`` must follow the dataclass's fields."""
    tree = ast.parse((REPO / "insitubatch_nodes" / "plan" / "config.py").read_text())
    declared = next(
        [a.arg for a in node.args.args[1:]]
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    assert declared == [f.name for f in dataclasses.fields(PlanConfig)]


@pytest.mark.xdist_group("lightning")  # imports Lightning: on the worker that has it
def test_flags_counts_and_tolerances_of_the_wrong_kind_are_refused_not_truncated(
    era5: Path,
) -> None:
    t2m = open_geometries(era5, ["t2m"])["t2m"]
    with pytest.raises(TypeError, match=r"bins must be an integer, got 1\.5"):  # int() made it 1
        Forcings("x", view=t2m, names=["toa_incident_solar_radiation"], bins=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="contiguous must be True or False"):  # was truthy
        split_by_chunk(t2m, contiguous="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an integer"):  # numpy's SeedSequence
        split_by_chunk(t2m, contiguous=False, seed="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sel\(tolerance=...\) is a number for 'lat'"):
        t2m.sel(lat=1.0, method="nearest", tolerance="x")  # (was a numpy ufunc error)
    with (
        insitu_pipeline(era5, split_by_chunk(t2m), {"x": t2m}) as pipe,
        pytest.raises(TypeError, match="restart_on_stop_iteration must be True or False"),
    ):
        Loader(pipe, restart_on_stop_iteration="no")  # type: ignore[call-overload]
    lightning = pytest.importorskip("insitubatch_nodes.lightning")
    with pytest.raises(TypeError, match="prefix must be a str"):
        lightning.InSituReportCallback(prefix=1)


def test_a_collection_of_many_stores_names_the_first_and_last_three_in_its_repr(
    tmp_path: Path,
) -> None:
    paths = [str(write_era5(tmp_path / f"s{k}.zarr", n_time=8, n_level=1)) for k in range(8)]
    few = repr(Collection.from_arrays([(p, "t2m") for p in paths[:3]]))
    assert few.endswith(f"store=RoutingStore({', '.join(paths[:3])}))")
    many = repr(Collection.from_arrays([(p, "t2m") for p in paths]))  # was every path
    shown = ", ".join([*paths[:3], "...", *paths[-3:]])
    assert many.endswith(f"store=RoutingStore(8 stores: {shown}))")
