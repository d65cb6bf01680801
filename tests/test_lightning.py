"""A real ``lightning.Trainer`` over ``InSituDataModule``: a run killed (SIGKILL) right after a
mid-epoch checkpoint and resumed with ``trainer.fit(..., ckpt_path=...)`` in a fresh process
trains on exactly the batches an uninterrupted run trains on — none skipped, none repeated.

Every run happens in its own process (``tests/resume_helpers.py lightning``); the tiny
LightningModule appends ``(epoch, batch_idx, batch position, hash of x and y, sample indices)``
to a file at every training (and validation) step.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from resume_helpers import comparable, lightning_request, read_records, run_lightning, write_store

N_BATCHES = 10  # per epoch: 12 train chunks of 8 samples, batch_size 10
RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "lightning_forecast.py"

# one worker runs the module: the reference and the killed runs are made once, not per worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lightning")]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_store(tmp_path_factory.mktemp("lightning") / "era5.zarr")


def train(store: Path, workdir: Path, name: str, **options: Any) -> tuple[int, str, Path]:
    out = workdir / name
    req = lightning_request(store, out, workdir / f"{name}-ckpt", **options)
    rc, log = run_lightning(req, workdir)
    return rc, log, out


def uninterrupted(store: Path, workdir: Path, **options: Any) -> list[tuple]:
    rc, log, out = train(store, workdir, "uninterrupted", **options)
    assert rc == 0, log[-5000:]
    rows = comparable(read_records(out))
    assert len(rows) == 2 * N_BATCHES, log[-5000:]
    return rows


@pytest.fixture(scope="module")
def reference(store: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    rows = uninterrupted(store, tmp_path_factory.mktemp("lightning-ref"))
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (e, i, e, i) for e in range(2) for i in range(N_BATCHES)
    ]
    return rows


def kill_and_resume(
    store: Path, workdir: Path, kill_at: int, **options: Any
) -> tuple[list[tuple], list[tuple], Path]:
    """Train with a checkpoint every 2 steps, SIGKILL the process when the batch after step
    ``kill_at``'s checkpoint starts, then resume from that checkpoint in a new process."""
    rc, log, killed = train(
        store, workdir, "killed", every_n_train_steps=2, kill_at_step=kill_at, **options
    )
    assert rc == -9, f"expected SIGKILL, got exit code {rc}\n{log[-5000:]}"
    ckpt = workdir / "killed-ckpt" / f"step={kill_at}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (workdir / "killed-ckpt").glob("*"))
    rc, log, resumed = train(store, workdir, "resumed", ckpt_path=str(ckpt), **options)
    assert rc == 0, log[-5000:]
    return comparable(read_records(killed)), comparable(read_records(resumed)), ckpt


Resumed = tuple[list[tuple], list[tuple], Path]


@pytest.fixture(scope="module")
def killed_and_resumed(
    store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int], Resumed]:
    """``kill_at -> kill_and_resume(store, ..., kill_at)``, each run at most once per module
    (the runs are read only afterwards): the weights-only test reads the checkpoint the
    mid-epoch-0 resume started from instead of killing a run of its own."""
    runs: dict[int, Resumed] = {}

    def get(kill_at: int) -> Resumed:
        if kill_at not in runs:
            workdir = tmp_path_factory.mktemp(f"kill{kill_at}")
            runs[kill_at] = kill_and_resume(store, workdir, kill_at)
        return runs[kill_at]

    return get


@pytest.mark.parametrize(
    "kill_at",
    [4, N_BATCHES, N_BATCHES + 4],
    ids=["mid-epoch-0", "end-of-epoch-0", "mid-epoch-1"],
)
def test_a_run_killed_after_a_checkpoint_resumes_with_no_batch_skipped_or_repeated(
    killed_and_resumed: Callable[[int], Resumed], reference: list[tuple], kill_at: int
) -> None:
    before, after, _ = killed_and_resumed(kill_at)
    assert before == reference[:kill_at]
    assert after == reference[kill_at:]


def test_resume_stays_exact_when_configure_optimizers_reads_estimated_stepping_batches(
    store: Path, reference: list[tuple], tmp_path: Path
) -> None:
    """Lightning issue #20550: reading ``trainer.estimated_stepping_batches`` in
    ``configure_optimizers`` makes Lightning drop the loader state it restored."""
    assert uninterrupted(store, tmp_path / "plain", estimated_stepping_batches=True) == reference
    before, after, _ = kill_and_resume(
        store, tmp_path / "resume", 6, estimated_stepping_batches=True
    )
    assert before + after == reference
    assert len(before) == 6


VAL = {"limit_val_batches": 2, "val_check_interval": 0.5, "num_sanity_val_steps": 2}


def test_validation_mid_epoch_does_not_disturb_the_training_order_nor_the_resume(
    store: Path, reference: list[tuple], tmp_path: Path
) -> None:
    rc, log, out = train(store, tmp_path / "plain", "with-val", **VAL)
    assert rc == 0, log[-5000:]
    assert comparable(read_records(out)) == reference
    val = read_records(out, kind="val")
    # sanity check (2 batches) + 2 epochs x 2 checks x 2 batches, always the same val batches
    assert len(val) == 2 + 2 * 2 * 2, len(val)
    assert {tuple(r["idx"]) for r in val} == {tuple(r["idx"]) for r in val[:2]}
    before, after, _ = kill_and_resume(store, tmp_path / "resume", 6, **VAL)
    assert before + after == reference


def _plan_states(obj: Any) -> list[dict]:
    if isinstance(obj, dict):
        found = [obj] if "batches_emitted" in obj and "config" in obj else []
        for v in obj.values():
            found.extend(_plan_states(v))
        return found
    if isinstance(obj, list | tuple):
        return [s for v in obj for s in _plan_states(v)]
    return []


def test_the_checkpoint_loads_with_weights_only_and_holds_the_exact_loader_position(
    killed_and_resumed: Callable[[int], Resumed],
) -> None:
    kill_at = 4  # the run killed after its step-4 checkpoint (checked by kill_and_resume)
    ckpt = torch.load(killed_and_resumed(kill_at)[2], weights_only=True)
    assert ckpt["global_step"] == kill_at
    states = _plan_states(ckpt)
    assert states, "the checkpoint holds no loader state"
    assert {(s["epoch"], s["batches_emitted"]) for s in states} == {(0, kill_at)}
    assert ckpt["InSituDataModule"]["train_loader"]


# -- the recipe ----------------------------------------------------------------------------------


def _run_recipe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # the recipe runs as ``__main__`` of a forked process (tests/forkserver.py), as ``python
    # recipes/lightning_forecast.py`` would: its claim is the run, not the interpreter start
    return forkserver.run(
        [sys.executable, str(RECIPE), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_lightning_forecast_recipe_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    common = [
        "--path", str(tmp_path / "era5.zarr"), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--n-time", "96", "--n-lat", "8", "--n-lon", "16", "--samples-per-chunk", "8",
        "--batch-size", "8", "--block-chunks", "2", "--ckpt-every", "3",
    ]  # fmt: skip
    first = _run_recipe(*common, "--max-epochs", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "trained 1 epoch(s)" in first.stdout, first.stdout
    assert list((tmp_path / "ckpt").glob("*.ckpt")), first.stdout
    second = _run_recipe(*common, "--max-epochs", "2", "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from" in second.stdout, second.stdout
    assert "trained 2 epoch(s)" in second.stdout, second.stdout


def test_the_lightning_forecast_recipe_trains_from_a_packed_int16_store(tmp_path: Path) -> None:
    # a netCDF-converted archive (t2m packed as int16 with scale_factor / add_offset) decodes
    # to float64 by xarray's rule: the recipe's float32 model took it as it came and failed
    # ("expected scalar type Double but found Float"), normalised by the stored integers
    import warnings

    import numpy as np
    import xarray as xr

    rng = np.random.default_rng(0)
    field = (273 + 10 * rng.standard_normal((48, 8, 16))).astype("f4")
    root = tmp_path / "packed.zarr"
    encoding = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0,
                "_FillValue": -32767, "chunks": (8, 8, 16)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xr.Dataset({"t2m": (("time", "lat", "lon"), field)}).to_zarr(
            root, zarr_format=3, consolidated=False, encoding={"t2m": encoding}
        )
    run = _run_recipe("--url", str(root), "--ckpt-dir", str(tmp_path / "ckpt"),
                      "--max-epochs", "1", "--batch-size", "4", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "trained 1 epoch(s)" in run.stdout, run.stdout
