"""The recipes under ``recipes/`` run end to end (each in a subprocess, with small arguments)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _run_recipe(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RECIPES / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


@pytest.mark.slow
def test_composing_the_five_nodes_by_hand_yields_batches_equal_to_zarrs_read(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "compose_nodes.py", "--n-time", "96", "--batch-size", "12", "--block-chunks", "3",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "match zarr's own read" in proc.stdout, _explain(proc)
    assert "pool stats: hits=" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_composing_the_nodes_over_a_sharded_store_given_by_path_also_matches_zarr(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sharded.zarr"
    args = ["--path", str(path), "--n-time", "96", "--shard-samples", "16", "--batch-size", "10"]
    proc = _run_recipe("compose_nodes.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, _explain(proc)
    assert "(shard of inner chunks" in proc.stdout, _explain(proc)
    assert "match zarr's own read" in proc.stdout, _explain(proc)
    assert (path / "zarr.json").exists()
    # a second run reads the store it finds there instead of writing it again
    again = _run_recipe("compose_nodes.py", *args, cwd=tmp_path)
    assert again.returncode == 0, _explain(again)
    assert "using the existing store" in again.stdout, _explain(again)


@pytest.mark.slow
def test_the_microscopy_segmenter_learns_the_mask_from_z_planes(tmp_path: Path) -> None:
    proc = _run_recipe(
        "microscopy_segmentation.py", "--z", "32", "--yx", "48", "--epochs", "2",
        "--batch-size", "4", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)
    assert "above the all-background" in proc.stdout, _explain(proc)


@pytest.mark.slow
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_the_elastic_resume_recipe_finishes_an_epoch_cut_on_two_ranks_on_three(
    tmp_path: Path, remainder: str
) -> None:
    proc = _run_recipe(
        "elastic_resume.py", "--old-world", "2", "--new-world", "3", "--cut", "2",
        "--remainder", remainder, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "every batch matches zarr's own read" in proc.stdout, _explain(proc)
    if remainder == "drop":
        assert ", 0 twice," in proc.stdout, _explain(proc)
