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
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_era5

from insitubatch_nodes import open_geometries, split_by_chunk, stack
from insitubatch_nodes.statistics import Statistics, fit_statistics

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
