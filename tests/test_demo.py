"""``make demo ARGS="--cache-dir DIR"``: the demo twice, in two fresh processes, over one
persistent chunk cache; run for real (two child processes training on a store on disk)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from insitubatch_nodes import demo
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = pytest.mark.timeout(300)

RUN_LINE = re.compile(
    r"^  run (?P<run>[12]) \(pid (?P<pid>\d+)\): first batch after (?P<first>[\d.]+) s; "
    r"epoch 0: (?P<gets>\d+) GETs, (?P<disk>\d+) chunks read from the cache; epochs: (?P<rest>.*)$",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "era5.zarr"
    make_era5_like(path, n_time=128, n_lat=16, n_lon=32, samples_per_chunk=8)
    return path


def test_with_a_cache_dir_the_second_fresh_process_reads_every_chunk_from_the_cache_run_one_fetched(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    # one epoch per run: the cache is written and read back in epoch 0 (a second epoch of each
    # run is served from its pool and only added a training epoch per process)
    args = ["--url", str(store), "--epochs", "1", "--batch-size", "16", "--no-progress"]
    rc = demo.main([*args, "--cache-dir", str(cache)])
    out = capsys.readouterr().out
    assert rc == 0, out
    runs = {int(m["run"]): m for m in RUN_LINE.finditer(out)}
    assert sorted(runs) == [1, 2], out
    first, second = runs[1], runs[2]
    # two fresh processes, neither of them this one
    assert len({first["pid"], second["pid"], str(os.getpid())}) == 3
    # run 1 warms the empty folder: it fetches every chunk and reads none from the cache
    assert int(first["gets"]) > 0 and int(first["disk"]) == 0, out
    # run 2 fetches nothing: each chunk run 1 fetched (one object per chunk) comes from disk
    assert int(second["gets"]) == 0 and int(second["disk"]) == int(first["gets"]), out
    # each run trained as the demo does: an epoch report per epoch, in each process
    assert out.count(" - limited by ") == 2, out
    assert "with the warm cache: the first batch after " in out
    assert any(cache.iterdir())  # the chunks stay on disk for the next run


def test_a_cache_dir_with_plan_only_is_refused_with_the_reason(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = demo.main(["--url", str(store), "--plan-only", "--cache-dir", str(tmp_path / "c")])
    assert rc == 2
    assert "cannot be combined with --plan-only" in capsys.readouterr().out
    assert not (tmp_path / "c").exists()
