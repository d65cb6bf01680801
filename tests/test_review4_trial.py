"""A maintainer's review of the merges of 2026-12-07 (lightning4, predictuneven, anemoiens,
invariants3, the fork server's quick exit): the review4 trial. Oracles: the fitted file's own
record, numpy, zarr.

Found (fixed):

1. ``Statistics.load(path, dataset={"views": ...})`` flattened a stack's members into the
   labels by name (``_fitted_on._recorded``), so a member named like a label of other levels
   silently replaced it (or the label the member, by dict order): the label ``z`` (level 1000)
   beside a stack whose member ``z`` is level 850 was accepted against a file fitted on level
   850 alone, and the label's view never checked — yet both take the file's one ``z`` entry.
   Now two other views under one name are refused, naming both.
2. ``stats.scaler()``'s check of the array's levels (invariants3) was dropped by
   ``StandardScaler.__getstate__``, so a copied or pickled scaler (``copy.deepcopy``, a data
   module sent to spawned ranks) took a store whose levels run 500, 850, 1000 and
   standardised level 500 with level 1000's statistics, as before invariants3. The check now
   travels with a copy or pickle; the cache identity leaves it out by the class's
   ``identity_excludes`` (``cache.fingerprint``), so it is the digest it was on main.
3. (documented, not ours to fix) An elastic ``"uneven"`` resume on more ranks than its rest:
   predictuneven's fix holds through ``insitubatch_nodes.Loader``, ``as_dataset`` and a
   ``StatefulDataLoader``; torchdata's own ``Loader`` restarts a restored loop without a batch,
   so there the rank with no share still runs the next epoch (docs/training.md now says so).

Tried and found right (probes not kept): Lightning fits of 3 epochs calling
``dm.teardown("validate")`` in a training batch, in a validation batch and at each
validation's end validate the same rows as a fit without it (at the validation's end the val
pool is cleared: 30 chunk GETs where 18); anemoi stacks ``ensemble="ensemble"`` of one and two
variables, windowed or not, in both layouts, equal numpy's transposes; anemoi's
``missing_dates`` with ``missing=`` as indices or dates (list or array) drop the union, and
``fit_statistics`` drops them too (finite statistics, ``missing_steps`` recorded); the fork
server's quick exit: the forkserver-run tests make no claim of the module teardown (the exit
claims run fresh interpreters or ``full_exit=True``), and the package's finalizers at exit are
atexit ones (``weakref.finalize``, ``_runtime``'s hook); file writes are ``os.write``.

Left as it is: an empty rank's read plan stays at epoch 0 (``resumed_epoch`` 0) while its
peers count epochs: a state saved on it and loaded elsewhere restarts their count, but it
delivers no sample in any epoch; advancing it needs a state for "a zero-batch epoch was
iterated" (a ``ReadPlanNode`` change). ``len(Loader)`` of such a resumed rank says the resumed
epoch's ``k`` before ``iter()`` and the next epoch's right after it (its epoch is over once
the producer finds no batch).
"""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import write_era5

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.cache.fingerprint import transform_identity
from insitubatch_nodes.statistics import Statistics, fit_statistics
from insitubatch_nodes.transforms import StandardScaler

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning"),  # (torch's)
]


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_era5(tmp_path_factory.mktemp("review4") / "e.zarr", n_time=32)


def test_a_stack_member_named_like_a_label_of_other_levels_is_refused_not_swapped_in(
    era5: Path, tmp_path: Path
) -> None:
    g = open_geometries(era5)
    z1000, z850 = g["z"].isel(level=[0]), g["z"].isel(level=[1])
    manifest = split_by_chunk(g["t2m"], (0.5, 0.5, 0.0))
    fit_statistics(era5, manifest, {"z": z850, "t2m": g["t2m"]}, batch_size=4).save(
        tmp_path / "s.json"
    )
    members = stack({"z": z850, "t2m": g["t2m"]})
    for views in ({"z": z1000, "s": members}, {"s": members, "z": z1000}):
        with pytest.raises(ValueError, match=r"label 'z' .*member 'z' of stack 's'|member 'z' "
                           r"of stack 's' and label 'z'"):  # fmt: skip
            Statistics.load(tmp_path / "s.json", dataset={"views": views})
    # the same view under both names is one view: accepted
    Statistics.load(tmp_path / "s.json", dataset={"views": {"z": z850, "s": members}})
    with pytest.raises(ValueError, match="fitted on another dataset"):  # (the label alone)
        Statistics.load(tmp_path / "s.json", dataset={"views": {"z": z1000}})


def test_a_copied_or_pickled_chunk_scaler_still_refuses_a_store_of_other_levels(
    tmp_path: Path,
) -> None:
    xr, pd = pytest.importorskip("xarray"), pytest.importorskip("pandas")
    z = np.random.default_rng(0).normal(size=(8, 3, 3, 4)).astype("f4")
    ds = xr.Dataset(
        {"z": (("time", "level", "lat", "lon"), z)},
        coords={"time": pd.date_range("2020-01-01", periods=8, freq="6h"),
                "level": [1000, 850, 500]},
    )  # fmt: skip
    enc = {"z": {"chunks": (4, 3, 3, 4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(tmp_path / "a.zarr", zarr_format=3, consolidated=False, encoding=enc)
        ds.isel(level=[2, 1, 0]).to_zarr(
            tmp_path / "rev.zarr", zarr_format=3, consolidated=False, encoding=enc
        )
    g, gr = open_geometries(tmp_path / "a.zarr"), open_geometries(tmp_path / "rev.zarr")
    stats = fit_statistics(tmp_path / "a.zarr", split_by_chunk(g["z"], (0.5, 0.5, 0.0)),
                           {"z": g["z"]}, batch_size=4)  # fmt: skip
    scaler = stats.scaler()
    for made in (scaler, copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        manifest = split_by_chunk(gr["z"], (0.5, 0.5, 0.0))
        with pytest.raises(ValueError, match=r"level \['1000', '850', '500'\] fitted"):
            insitu_pipeline(tmp_path / "rev.zarr", manifest, {"z": gr["z"]}, batch_size=4,
                            chunk_transforms=[made]).close()  # fmt: skip
    # the persistent cache's identity is the scaler's numbers', check or none (main's digest)
    bare = StandardScaler(scaler.mean, scaler.std)
    assert transform_identity(scaler) == transform_identity(bare)
    assert transform_identity(copy.deepcopy(scaler)) == transform_identity(bare)


def test_only_torchdatas_own_loader_runs_the_next_epoch_on_an_elastic_rank_with_no_share(
    tmp_path: Path,
) -> None:
    """docs/training.md (Elastic resume): 4 ranks delivered 2 of their 3 batches of a 12-sample
    ``"uneven"`` split, resumed on 8: new rank 4 has no share of the rest. Through ours (and a
    ``StatefulDataLoader`` over ``as_dataset``) its loop is empty; torchdata's own ``Loader``
    restarts a restored loop without a batch and delivers the next epoch's sample there."""
    import zarr
    from torchdata.nodes import Loader as TorchdataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes import Loader, PlanConfig, as_dataset

    root = tmp_path / "s.zarr"
    data = np.random.default_rng(3).random((24, 2)).astype("f4")
    zarr.open_group(root, mode="w").create_array(
        "t2m", data=data, chunks=(3, 2), dimension_names=("time", "lat")
    )
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (0.5, 0.0, 0.5))  # the test split: samples 12..23

    def pipe(rank: int, world: int) -> Any:
        config = PlanConfig(split="test", shuffle=False, remainder="uneven", batch_size=1,
                            rank=rank, world_size=world)  # fmt: skip
        return insitu_pipeline(root, manifest, {"x": g}, config=config)

    def rows(loop: Any) -> list[int]:
        return [int(np.asarray(b.sample_indices["x"])[0]) for b in loop]

    wrappers = {
        "ours": Loader,
        "torchdata": TorchdataLoader,
        "sdl": lambda p: StatefulDataLoader(
            as_dataset(p, transform=lambda b: b), batch_size=None, num_workers=0
        ),
    }
    got = {}
    for name, wrap in wrappers.items():
        with pipe(0, 4) as old_pipe:
            old = wrap(old_pipe)
            it = iter(old)
            next(it), next(it)
            state = old.state_dict()
        with pipe(4, 8) as new_pipe:
            new = wrap(new_pipe)
            new.load_state_dict(state)
            got[name] = rows(new)
    assert got == {"ours": [], "sdl": [], "torchdata": [20]}
