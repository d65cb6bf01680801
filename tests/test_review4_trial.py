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
"""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path

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
