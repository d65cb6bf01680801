"""The recipes under ``recipes/`` run end to end (each in a subprocess, with small arguments;
forked by ``tests/forkserver.py``, which runs the script as ``__main__`` as ``python`` would)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _run_recipe(
    name: str, *args: str, cwd: Path, fork_children: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run a recipe; ``fork_children=True`` for one that starts Python processes of its own
    (``forkserver.popen``'s: they are forked too, not new interpreters)."""
    return forkserver.run(
        [sys.executable, str(RECIPES / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        fork_children=fork_children,
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
def test_the_whole_slide_segmenter_learns_the_mask_from_random_patches(tmp_path: Path) -> None:
    proc = _run_recipe(
        "whole_slide_segmentation.py", "--size", "1024", "--tile", "256", "--patch", "64",
        "--steps", "20", "--epochs", "3", "--batch-size", "16", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)
    assert "above the all-background" in proc.stdout, _explain(proc)


def test_the_microscopy_segmenter_learns_the_mask_from_z_planes(tmp_path: Path) -> None:
    proc = _run_recipe(
        "microscopy_segmentation.py", "--z", "32", "--yx", "48", "--epochs", "2",
        "--batch-size", "4", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)
    assert "above the all-background" in proc.stdout, _explain(proc)


def test_the_spectral_cube_recipe_reads_both_bands_as_zarr_holds_them_and_learns_the_line(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "spectral_cube.py", "--channels", "16", "--size", "32", "--patch", "16",
        "--epochs", "2", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "each once, equal to zarr; resume exact" in proc.stdout, _explain(proc)
    assert "(channels, dec, ra) in dec (16, 32), equal to zarr's" in proc.stdout, _explain(proc)
    assert "sub-cubes: 8 random (8, 16, 16)" in proc.stdout, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)


JOINED_ARGS = ("--steps", "160", "--epochs", "3")


@pytest.fixture(scope="module")
def joined_one_store(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """The joined-stores recipe run once over one atmosphere store: both of its tests read this
    run's output (the second beside a run over two stores), which they ran each once before."""
    return _run_recipe("joined_stores.py", *JOINED_ARGS, cwd=tmp_path_factory.mktemp("joined"))


@pytest.mark.xdist_group("recipes_joined")  # one worker, one run of joined_one_store
def test_the_joined_stores_recipe_reads_an_archive_over_stores_and_learns_from_a_joined_forcing(
    joined_one_store: subprocess.CompletedProcess[str],
) -> None:
    proc = joined_one_store
    assert proc.returncode == 0, _explain(proc)
    assert "first batch equal to zarr's read" in proc.stdout, _explain(proc)
    assert "160 shared steps" in proc.stdout, _explain(proc)
    assert "every row equal to the data written at its time" in proc.stdout, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)


@pytest.mark.xdist_group("recipes_joined")
def test_the_joined_stores_recipe_joins_an_atmosphere_concatenated_from_two_stores(
    tmp_path: Path, joined_one_store: subprocess.CompletedProcess[str]
) -> None:
    one = joined_one_store
    two = _run_recipe("joined_stores.py", *JOINED_ARGS, "--atmos-stores", "2", cwd=tmp_path)
    assert one.returncode == 0 and two.returncode == 0, _explain(one) + _explain(two)
    out = two.stdout
    assert "160 shared steps of atmos (2 store(s))" in out, _explain(two)
    assert "['atmos0.zarr', 'atmos1.zarr']" in out, _explain(two)
    assert re.search(r"from 2 piece\(s\); [1-9]\d* windows across a cut", out), _explain(two)
    # the same samples in the same order as from one store: the same losses, epoch by epoch
    epochs = [re.findall(r"epoch \d+: .*", p.stdout) for p in (one, two)]
    assert len(epochs[0]) == 3 and epochs[0] == epochs[1], epochs


def test_the_scenes_recipe_trains_on_one_stream_over_scenes_in_several_stores(
    tmp_path: Path,
) -> None:
    proc = _run_recipe("scenes_collection.py", "--stores", "2", "--scenes", "3", "--epochs", "2",
                       "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "equal to zarr's read" in proc.stdout, _explain(proc)
    second = r"second pass over the training planes: .*; 0 GETs, [1-9]\d* chunks read from the"
    assert re.search(second, proc.stdout), _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)
    assert "above the all-background" in proc.stdout, _explain(proc)


def test_the_scenes_recipe_refuses_too_few_scenes_to_hold_one_out_for_validation(
    tmp_path: Path,
) -> None:
    # one scene used to train, validate on no scene and print "val pixel accuracy 0.000"
    proc = _run_recipe("scenes_collection.py", "--stores", "1", "--scenes", "1", cwd=tmp_path)
    assert proc.returncode == 2, _explain(proc)
    assert "fewer than 4 scenes" in proc.stderr, _explain(proc)


@pytest.mark.slow
def test_the_timelapse_recipe_trains_on_every_t_z_plane_checked_against_zarr(
    tmp_path: Path,
) -> None:
    proc = _run_recipe("timelapse_planes.py", "--epochs", "2", cwd=tmp_path)
    assert proc.returncode == 0, _explain(proc)
    assert "equal to zarr's read" in proc.stdout, _explain(proc)
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


@pytest.mark.slow
def test_the_scaler_fitted_over_the_loader_standardizes_what_the_model_sees(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "fit_scaler.py", "--n-time", "96", "--epochs", "2", "--fit-with", "numpy", cwd=tmp_path
    )
    assert proc.returncode == 0, _explain(proc)
    assert "fit (numpy) over" in proc.stdout, _explain(proc)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2, _explain(proc)
    for line in lines:  # standardized per array: mean ~0, std ~1
        assert "t2m mean +0.000 std 1.000" in line or "t2m mean -0.000 std 1.000" in line, line
        assert "std 1.000; the scaler ran on" in line, line
    assert "the scaler ran on 10 chunks" in lines[0], _explain(proc)  # 5 chunks x 2 arrays


def _recipe_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("oracle", ["numpy", "sklearn"])
def test_the_recipes_running_moments_equal_the_statistics_of_all_the_data(oracle: str) -> None:
    moments = _recipe_module("fit_scaler").RunningMoments
    rng = np.random.default_rng(4)
    data = rng.normal(5.0, 3.0, size=(1000, 3))
    fit = moments()
    for lo, hi in ((0, 7), (7, 400), (400, 401), (401, 1000)):  # uneven batches
        fit.partial_fit(data[lo:hi])
    if oracle == "sklearn":
        sk = pytest.importorskip("sklearn.preprocessing").StandardScaler()
        for lo in range(0, 1000, 100):
            sk.partial_fit(data[lo : lo + 100])
        want_mean, want_std = sk.mean_, sk.scale_
    else:
        want_mean, want_std = data.mean(axis=0), data.std(axis=0)
    np.testing.assert_allclose(fit.mean_, want_mean, rtol=1e-12)
    np.testing.assert_allclose(fit.scale_, want_std, rtol=1e-12)


@pytest.mark.slow
def test_the_warm_then_score_recipe_scores_from_the_cache_in_parallel_without_a_get(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "warm_then_score.py", "--scorers", "2", "--n-time", "128", cwd=tmp_path, fork_children=True
    )
    assert proc.returncode == 0, _explain(proc)
    assert "a second writer is refused while they read" in proc.stdout, _explain(proc)
    assert proc.stdout.count(", 0 GETs,") == 2, _explain(proc)
    assert "every batch matches zarr's own read" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_the_time_features_recipe_picks_its_window_by_date_and_trains_on_each_rows_time(
    tmp_path: Path,
) -> None:
    proc = _run_recipe("time_features.py", "--n-time", "400", "--stop", "2000-03-20", cwd=tmp_path)
    assert proc.returncode == 0, _explain(proc)
    # 2000-02-01 is step 31 * 4 = 124; 2000-03-20 is step 79 * 4 = 316 (excluded)
    assert "[2000-02-01, 2000-03-20) is samples [124, 316)" in proc.stdout, _explain(proc)
    assert "read in whole chunks 5..13 (samples [120, 336))" in proc.stdout, _explain(proc)
    assert "every row carried its own time" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_the_time_features_recipe_runs_in_a_360_day_calendar_with_a_window_to_february_30th(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "time_features.py", "--n-time", "400", "--calendar", "360_day", "--stop", "2000-02-30",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "time: cftime dates in the 360_day calendar" in proc.stdout, _explain(proc)
    # 30-day months: 2000-02-01 is step 30 * 4 = 120; 2000-02-30 is step 59 * 4 = 236 (excluded)
    assert "[2000-02-01, 2000-02-30) is samples [120, 236)" in proc.stdout, _explain(proc)
    assert "every row carried its own time" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_the_archive_recipe_trains_on_one_sample_per_chunk_with_rows_decoded_into_batches(
    tmp_path: Path,
) -> None:
    # a budget short of the split (1,254,912 bytes) and over its floor (1,049,600 bytes at 8
    # samples a batch): rows go straight into batches. 64 steps, not 128 (with 16 a batch and
    # 1.5 MiB): the store's 832 chunk files, each in three folders of its own, were most of the
    # recipe's cost, written and then removed
    proc = _run_recipe(
        "archive_forecast.py", "--n-time", "64", "--n-lat", "8", "--n-lon", "16", "--epochs", "2",
        "--batch-size", "8", "--budget-mib", "1.1", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "13 arrays, one time step per chunk: 13 stored objects" in proc.stdout, _explain(proc)
    assert proc.stdout.count(" - limited by ") == 2, _explain(proc)
    assert "every first batch matched zarr's own read" in proc.stdout, _explain(proc)
    # only the target array (two views) used slots: one 8 x 16 float32 field per chunk
    peaks = [line for line in proc.stdout.splitlines() if line.startswith("  pool peak ")]
    assert len(peaks) == 2 and all("2m_temperature" in p for p in peaks), _explain(proc)


@pytest.mark.slow
def test_the_forecast_inputs_recipe_selects_levels_carries_static_fields_and_forcings(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "forecast_inputs.py", "--n-time", "48", "--n-lat", "8", "--n-lon", "16", "--steps", "6",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "static arrays: ['land_sea_mask']" in proc.stdout, _explain(proc)
    assert "the first batch matched zarr's own read of the 13 levels" in proc.stdout, _explain(proc)
    # 2 x 13 levels + 2m temperature + the land-sea mask + GraphCast's 5 forcings; 27 targets
    assert "inputs (8, 33, 8, 16) targets (8, 27, 8, 16)" in proc.stdout, _explain(proc)
    assert "('day_progress_sin', 'day_progress_cos')" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_the_rollout_recipe_grows_its_target_window_and_a_resumed_run_matches_one_never_stopped(
    tmp_path: Path,
) -> None:
    common = [
        "--days", "8", "--n-lat", "8", "--n-lon", "16", "--n-level", "5",
        "--rollout-schedule", "1:0", "2:1", "3:2", "--path", str(tmp_path / "arco.zarr"),
    ]  # fmt: skip

    def losses(proc: subprocess.CompletedProcess[str]) -> list[str]:
        assert proc.returncode == 0, _explain(proc)
        return [line for line in proc.stdout.splitlines() if "val loss" in line]

    whole = _run_recipe(
        "forecast_rollout.py", *common, "--max-epochs", "3", "--ckpt-dir", "whole", cwd=tmp_path
    )
    assert "epoch 1 trains on 2 target steps" in whole.stdout, _explain(whole)
    assert "epoch 2 trains on 3 target steps" in whole.stdout, _explain(whole)
    first = _run_recipe(
        "forecast_rollout.py", *common, "--max-epochs", "2", "--ckpt-dir", "cut", cwd=tmp_path
    )
    rest = _run_recipe(
        "forecast_rollout.py", *common, "--max-epochs", "3", "--ckpt-dir", "cut", "--resume",
        cwd=tmp_path,
    )  # fmt: skip
    assert len(losses(whole)) == 3, _explain(whole)
    # the resumed run trains epoch 2 on the grown window, batch for batch as the whole run did
    assert losses(first) + losses(rest) == losses(whole), _explain(rest)


@pytest.mark.slow
def test_the_archive_recipe_keeps_a_split_that_fits_the_automatic_budget_and_reads_it_once(
    tmp_path: Path,
) -> None:
    proc = _run_recipe(
        "archive_forecast.py", "--n-time", "32", "--n-lat", "8", "--n-lon", "16", "--epochs", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "every first batch matched zarr's own read" in proc.stdout, _explain(proc)
    kept = [line for line in proc.stdout.splitlines() if "the split is kept in the pool" in line]
    assert len(kept) == 2 and kept[1].endswith("this epoch made 0 GETs"), _explain(proc)
    assert not kept[0].endswith(" 0 GETs"), _explain(proc)


@pytest.mark.slow
def test_the_trace_recipe_writes_an_epoch_trace_and_a_profile_with_the_loaders_ranges(
    tmp_path: Path,
) -> None:
    out = tmp_path / "traces"
    proc = _run_recipe(
        "trace_epoch.py", "--n-time", "256", "--steps", "4", "--out", str(out), cwd=tmp_path
    )
    assert proc.returncode == 0, _explain(proc)
    epoch = json.loads((out / "epoch0.trace.json").read_text())
    names = {e["name"] for e in epoch["traceEvents"]}
    assert {"read", "decode", "fill run", "admit", "wait for chunks", "gather", "next"} <= names
    profile = json.loads((out / "profile.trace.json").read_text())
    ranges = {e.get("name") for e in profile["traceEvents"]}
    assert {"insitu.next", "insitu.gather", "insitu.fill_run"} <= ranges, _explain(proc)


@pytest.mark.slow
@pytest.mark.parametrize("ngff", ["0.4", "0.5"])
def test_the_hcs_segmenter_trains_on_every_field_of_a_plate_split_by_well(
    tmp_path: Path, ngff: str
) -> None:
    pytest.importorskip("ome_zarr")
    proc = _run_recipe(
        "hcs_segmentation.py", "--ngff", ngff, "--z", "4", "--yx", "48", "--epochs", "2",
        "--level", "0.65", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "level 0 in 12 field(s)" in proc.stdout, _explain(proc)
    assert "equal to zarr's read" in proc.stdout, _explain(proc)
    assert "; disjoint)" in proc.stdout, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)
    assert "above the all-background" in proc.stdout, _explain(proc)


@pytest.mark.slow
def test_the_hcs_segmenter_trains_on_the_t_z_planes_of_a_timelapse_plate(tmp_path: Path) -> None:
    pytest.importorskip("ome_zarr")
    proc = _run_recipe(
        "hcs_segmentation.py", "--t", "2", "--tz", "--z", "3", "--yx", "48", "--epochs", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert "72 (t, z) planes (2 x 3) in 12 fields" in proc.stdout, _explain(proc)
    assert "equal to zarr's read" in proc.stdout, _explain(proc)
    assert "; disjoint)" in proc.stdout, _explain(proc)
    assert "loss fell" in proc.stdout, _explain(proc)
