"""A brand-new user's trial: README.md, recipes/README.md and the demo followed literally.

Found (fixed):

- ``python -m insitubatch_nodes.demo --url s3://... --endpoint http://... --allow-http`` (the
  README's ``make demo ARGS=...``) against a server that wants credentials, or with
  ``--anonymous`` on a private bucket, or without ``--allow-http`` for an ``http://``
  endpoint, ended in a traceback whose advice named ``open_store``'s options
  (``anonymous=True``, ``client_options={'allow_http': True}``), not the demo's flags. The demo
  now prints the error with the flags that change it and exits 2; the README says where the
  demo's credentials come from.
- Six recipes (``hcs_segmentation``, ``joined_stores``, ``microscopy_segmentation``,
  ``scenes_collection``, ``spectral_cube``, ``timelapse_planes``) took ``--epochs 1`` and
  always exited 1 with "loss did NOT fall: x -> x" (their check compares the first epoch's
  loss with the last's). They now refuse it at the flag ("at least 2", exit 2).
- The demo took ``--epochs 0`` (trained nothing, printed "loss did NOT fall: nan -> nan" after
  numpy's empty-mean warnings) and ``--batch-size 0`` / ``--block-chunks 0`` /
  ``--max-inflight 0`` (tracebacks). They are refused at the flag.
- An ``http://`` endpoint from the environment (``AWS_ENDPOINT_URL``, as
  ``check-transform``'s docs say credentials and endpoint come) without ``AWS_ALLOW_HTTP``
  ended in obstore's raw "builder error" at the first read (exit 1 from check-transform);
  ``open_store`` refused only an ``endpoint=`` option so. It now names the variable and the
  fix when the store is opened, as for the option.
- recipes/README.md said ``whole_slide_segmentation.py --size 4096`` keeps "a pool budget far
  below one plane"; at that size the automatic budget is the whole 80 MiB plane (the run
  prints it). The README and docstring now say so, with the default size's 588 MiB.
- ``insitubatch-nodes check-transform`` on a store it could not open or read (an ``http://``
  endpoint without allow_http, no store at the path, no credentials) ended in a traceback,
  exit 1 (a "check failed"); it is now a usage error (exit 2) that prints the error.
- The epoch report of a run served wholly from a persistent cache (``make demo
  ARGS="--cache-dir ..."``'s second run) printed "0 decodes, ... 26873 us/object of it
  bookkeeping": the decode threads' time mapping cache files divided by ``max(1, 0)``. With
  no decode it now prints that time in ms "outside decodes (no object decoded)". (Not fixed:
  that mapping time still counts as bookkeeping, ``overhead_s``, in the limit rules.)

Tried and found right (by hand, see the report): the README's "In code" example on a local
store (batches ``(32, lat, lon)``, ``to_torch`` shares memory with the numpy batch, the report
printed), ``DataLoader(as_dataset(pipe), batch_size=None)`` delivering ``(32, lat, lon)``
tensors and torch's default ``batch_size=1`` refused with the advice, ``make demo``'s default
run and ``--cache-dir`` (the second process: 0 GETs), ``insitubatch-nodes check-transform``,
and every recipe's documented flags.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from insitubatch_nodes import demo
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny_era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("newuser") / "era5.zarr"
    make_era5_like(path, n_time=64, n_lat=4, n_lon=8, samples_per_chunk=8, variables=["t2m"])
    return path


def test_the_demo_without_allow_http_for_an_http_endpoint_names_the_flag_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--url", "s3://bucket/era5.zarr", "--endpoint", "http://127.0.0.1:9", "--plan-only"]
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert "plain HTTP" in err and "--allow-http" in err


def test_the_demo_on_a_missing_variable_names_the_arrays_and_the_flag(
    tiny_era5: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--url", str(tiny_era5), "--variable", "nope", "--plan-only"]) == 2
    err = capsys.readouterr().err
    assert "available arrays" in err and "--variable" in err


@pytest.mark.xdist_group("s3")
def test_the_readme_demo_args_read_a_moto_bucket_and_an_unsigned_request_names_the_key_flags(
    tiny_era5: Path,
    s3_upload: Any,
    s3_options: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = s3_upload(tiny_era5, "era5.zarr")
    base = ["--url", url, "--endpoint", s3_options["endpoint"], "--allow-http", "--plan-only"]
    keys = ["--access-key-id", s3_options["access_key_id"]]
    keys += ["--secret-access-key", s3_options["secret_access_key"]]
    assert demo.main([*base, *keys, "--region", s3_options["region"]]) == 0
    out = capsys.readouterr().out
    assert "t2m: shape (64, 4, 8)" in out and "read plan" in out
    assert demo.main([*base, "--anonymous"]) == 2
    err = capsys.readouterr().err
    assert "unsigned request" in err and "--access-key-id" in err and "Traceback" not in err


def _recipe(name: str) -> Any:
    path = Path(__file__).resolve().parents[1] / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"newuser_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name",
    [
        "hcs_segmentation",
        "joined_stores",
        "microscopy_segmentation",
        "scenes_collection",
        "spectral_cube",
        "timelapse_planes",
    ],
)
def test_a_recipe_that_checks_its_loss_fell_refuses_one_epoch_at_its_flag(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _recipe(name)
    assert recipe.parse_args(["--epochs", "2"]).epochs == 2
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args(["--epochs", "1"])
    assert exit_info.value.code == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--epochs", "--batch-size", "--block-chunks", "--max-inflight"])
def test_the_demo_refuses_a_count_flag_of_zero_at_the_flag(
    flag: str, tiny_era5: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--url", str(tiny_era5), flag, "0", "--no-progress"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: 0: a positive integer" in capsys.readouterr().err


def _slide_budget_mib(path: Path, size: int) -> float:
    """The automatic pool budget of whole_slide_segmentation.py's training pipeline on an
    (unwritten: fill-value) slide of ``size``^2, its tiles as the recipe writes them."""
    import zarr

    from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk

    for name, tile, dtype in (("image", 512, "f4"), ("mask", 1024, "u1")):
        zarr.create_array(
            str(path), name=name, shape=(2, size, size), chunks=(1, tile, tile), dtype=dtype,
            dimension_names=("plane", "y", "x"),
        )  # fmt: skip
    geoms = open_geometries(str(path), ["image", "mask"])
    manifest = split_by_chunk(geoms["image"], (0.5, 0.5, 0.0))
    window = {"y": 256, "x": 256}
    views = {
        k: geoms[a].patches(window, origins="random") for k, a in (("x", "image"), ("y", "mask"))
    }
    pipe = insitu_pipeline(str(path), manifest, views, batch_size=16, coords=())
    try:
        next(iter(Loader(pipe)))
        return pipe.report().budget_bytes / 2**20
    finally:
        pipe.close()


def test_the_whole_slide_recipe_readme_states_the_pool_budget_its_command_and_default_get(
    tmp_path: Path,
) -> None:
    readme = (Path(__file__).resolve().parents[1] / "recipes" / "README.md").read_text()
    paragraph = readme.split("**Segment a whole-slide-like plane")[1].split("\n- ")[0]
    small = _slide_budget_mib(tmp_path / "small.zarr", 4096)
    assert small == 4096**2 * 5 / 2**20  # the whole plane of image and mask
    assert "--size 4096" in paragraph and f"whole {small:.0f} MiB plane" in paragraph
    default = _slide_budget_mib(tmp_path / "default.zarr", 20_000)
    assert default < 20_000**2 * 5 / 2**20 / 3
    assert f"{default:.0f} MiB of a 1.9 GB plane" in " ".join(paragraph.split())


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"])
def test_an_http_endpoint_from_the_environment_without_allow_http_is_refused_at_open_store(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from insitubatch_nodes import open_store

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "http://127.0.0.1:9")
    keys = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
    with pytest.raises(
        ValueError, match=rf"\(from {variable}\) is plain HTTP.*AWS_ALLOW_HTTP=true"
    ):
        open_store("s3://bucket/era5.zarr", **keys)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    open_store("s3://bucket/era5.zarr", **keys)  # allowed: no error, no request yet


@pytest.mark.parametrize("where", ["http endpoint", "no store"])
def test_check_transform_on_a_store_it_cannot_open_is_a_usage_error_without_a_traceback(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from insitubatch_nodes.cli import main

    for name in ("AWS_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    url = "s3://bucket/era5.zarr" if where == "http endpoint" else str(tmp_path / "none.zarr")
    argv = ["check-transform", url, "--var", "t2m", "--transform", "json:dumps"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert ("AWS_ALLOW_HTTP=true" if where == "http endpoint" else "no zarr store at") in err


def test_an_epoch_with_no_decode_reports_no_per_object_bookkeeping() -> None:
    from insitubatch_nodes.report import EpochReport

    text = str(EpochReport(batches=4, wall_s=1.0, run_s=0.027, decodes=0, decode_threads=2))
    decode = next(line for line in text.splitlines() if line.lstrip().startswith("decode"))
    assert "us/object" not in decode, decode
    assert "27.0 ms of it outside decodes (no object decoded)" in decode
    text = str(EpochReport(batches=4, wall_s=1.0, run_s=0.027, decodes=9, decode_threads=2))
    assert "3000 us/object of it bookkeeping" in text
