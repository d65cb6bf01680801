"""The docs' prose, taken at its word by a new user: found wrong by a trial of README.md, the
pages under docs/ and recipes/README.md.

The code blocks of the docs already run (tests/test_docs.py); this holds the sentences around
them: a behaviour a page promises that the code did not keep, and the defaults and thresholds a
page quotes, read from the page itself and compared with the code's, so that neither can drift
from the other again. The stores are tiny and written with zarr, which is also the oracle.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t2m (time, lat, lon)``, 8 steps in chunks of 4."""
    path = tmp_path_factory.mktemp("docs_trial") / "era5.zarr"
    group = zarr.open_group(path, mode="w")
    t2m = group.create_array("t2m", shape=(8, 4, 6), chunks=(4, 4, 6), dtype="f4")
    t2m[...] = np.arange(8 * 4 * 6, dtype="f4").reshape(8, 4, 6)
    return path


def check_transform(store: Path, target: str) -> tuple[int, str]:
    """``insitubatch-nodes check-transform`` in this process: its status and its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check-transform", str(store), "--var", "t2m", "--transform", target,
                   "--no-gil-probe"])  # fmt: skip
    return rc, out.getvalue()


def test_check_transform_exits_2_naming_a_module_target_that_cannot_be_imported(
    store: Path,
) -> None:
    # docs/transforms.md: "Exit status: ... 2 for a usage error (an unknown array, a target that
    # cannot be loaded)". A module:attr target whose module is not importable (a typo, or a
    # module in a folder that is not on the path: the console script does not put the working
    # directory there) raised ModuleNotFoundError out of main(): a traceback and status 1, the
    # status of a transform that failed its checks.
    rc, out = check_transform(store, "no_such_module_for_the_docs_trial:scale")
    assert rc == 2, out
    assert "no_such_module_for_the_docs_trial" in out and "path.py:attr" in out
    rc, out = check_transform(store, "insitubatch_nodes.no_such_submodule:scale")
    assert rc == 2 and "insitubatch_nodes.no_such_submodule" in out, out
