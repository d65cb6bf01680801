"""``make demo ARGS="--cache-dir DIR"``: the demo twice, in two fresh processes, over one
persistent chunk cache; run for real (two child processes training on a store on disk).

The demo starts its two runs with ``subprocess.Popen``; here they are forked from
``tests/forkserver.py`` instead (the same ``python -m insitubatch_nodes.demo ...`` command, a
new process with nothing of this one's state, its output passed through the demo's own
``_run_child``): two fresh interpreters cost 6.6 CPU-s, each importing torch and zarr again,
against about 1.5 s for the two forked runs. No claim here is about an interpreter's start."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import forkserver
import pytest

from insitubatch_nodes import demo
from insitubatch_nodes.synthetic import make_era5_like

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("demo")]

RUN_LINE = re.compile(
    r"^  run (?P<run>[12]) \(pid (?P<pid>\d+)\): first batch after (?P<first>[\d.]+) s; "
    r"epoch 0: (?P<gets>\d+) GETs, (?P<disk>\d+) chunks read from the cache; epochs: (?P<rest>.*)$",
    re.MULTILINE,
)


@pytest.fixture(autouse=True)
def _runs_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's child processes forked from the fork server (see the module docstring)."""
    monkeypatch.setattr(
        demo, "subprocess", SimpleNamespace(Popen=forkserver.popen, PIPE=forkserver.PIPE)
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


def test_the_demo_trains_from_a_packed_int16_store_normalised_by_its_decoded_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``make demo ARGS="--url ..."`` on a netCDF-converted archive: t2m packed as int16 decodes
    # to float64 (xarray's rule), which the float32 model refused ("Input type (double) and
    # bias type (float)"); its normalisation came from the stored integers
    import warnings

    import numpy as np
    import xarray as xr
    import zarr

    from insitubatch_nodes import open_geometries, split_by_chunk

    rng = np.random.default_rng(0)
    field = (273 + 10 * rng.standard_normal((48, 8, 16))).astype("f4")
    masked = field.copy()
    masked[::8, 0, 0] = np.nan  # a masked point in every chunk: the normalisation skips it
    root = tmp_path / "packed.zarr"
    encoding = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0,
                "_FillValue": -32767, "chunks": (8, 8, 16)}  # fmt: skip
    dims = ("time", "lat", "lon")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xr.Dataset({"t2m": (dims, field), "masked": (dims, masked)}).to_zarr(
            root, zarr_format=3, consolidated=False, encoding={"t2m": encoding, "masked": encoding}
        )
        decoded = xr.open_zarr(root, consolidated=False).load()
    for name in ("t2m", "masked"):
        geom = open_geometries(root, cf_dtype="float32")[name]
        manifest = split_by_chunk(geom, (0.8, 0.1, 0.1))
        start, stop = geom.chunk_range(manifest.chunks("train")[0])
        first = decoded[name].values[start:stop]  # (float32 unpacking: within 1e-6)
        mean, std = demo._stats(zarr.open_array(root, path=name, mode="r"), geom, manifest)
        assert np.isclose(mean, np.nanmean(first), rtol=1e-6), (name, mean, np.nanmean(first))
        assert np.isclose(std, np.nanstd(first), rtol=1e-6), (name, std, np.nanstd(first))
    argv = ["--url", str(root), "--epochs", "2", "--batch-size", "4", "--no-progress"]
    rc = demo.main(argv)
    out = capsys.readouterr().out
    assert rc == 0 and "loss fell" in out, out
