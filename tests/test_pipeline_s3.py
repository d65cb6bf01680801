"""The same pipeline over a real S3 endpoint: moto_server on loopback (see ``conftest.py``).

A synthetic store is written locally, uploaded into a fresh bucket and read back through
``open_store("s3://bucket/prefix", endpoint=..., ...)``; zarr's read of the local copy (and of
the S3 store itself) is the oracle.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import forkserver
import numpy as np
import pytest
from helpers import (
    Oracle,
    View,
    assert_batch_matches,
    assert_same_records,
    chunk_keys_on_disk,
    expected_anchors,
    run_epoch,
    wait_until,
    write_era5,
    write_microscopy,
)

from insitubatch_nodes import (
    ArrayGeometry,
    SplitManifest,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError

pytestmark = [pytest.mark.xdist_group("s3"), pytest.mark.timeout(120)]

# The inner-chunked layout keeps its partial (lat, lon) tiles and 5 chunks along time (4 in the
# default train split): every object is one GET through moto, whose CPU was most of this file's
# (10.1 CPU-s with 8 chunks, 8.2 with 5; 2026-12-07).
LAYOUTS: dict[str, dict[str, Any]] = {
    "v3_inner_chunked": {"n_time": 40, "n_lat": 10, "n_lon": 13, "inner_chunks": (4, 5)},
    "v2": {"n_time": 64, "zarr_format": 2},
    "sharded_v3": {"n_time": 72, "shard_samples": 16},
}


@dataclass
class S3Case:
    local: Path
    url: str
    options: dict[str, Any]
    views: dict[str, ArrayGeometry]
    oracle_views: dict[str, View]
    manifest: SplitManifest

    def store(self) -> Any:
        return open_store(self.url, **self.options)

    def bucket_and_prefix(self) -> tuple[str, str]:
        parts = urlsplit(self.url)
        return parts.netloc, parts.path.strip("/")


def _boto(options: dict[str, Any]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options["endpoint"],
        region_name=options["region"],
        aws_access_key_id=options["access_key_id"],
        aws_secret_access_key=options["secret_access_key"],
    )


def _era5_case(
    local: Path,
    layout: str,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
) -> S3Case:
    write_era5(local, **LAYOUTS[layout])
    url = s3_upload(local, "data/era5.zarr")
    store = open_store(url, **s3_options)
    g = open_geometries(store, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "back": g["t2m"].shift(-2), "z": g["z"]}
    oviews = {
        "x": View("t2m"),
        "y": View("t2m", 0, 1),
        "back": View("t2m", 0, -2),
        "z": View("z"),
    }
    return S3Case(local, url, dict(s3_options), views, oviews, split_by_chunk(g["t2m"]))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def s3_case(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
) -> S3Case:
    local = tmp_path_factory.mktemp(f"s3_{request.param}") / "era5.zarr"
    return _era5_case(local, request.param, s3_upload, s3_options)


@pytest.fixture(scope="module")
def _damageable_case(
    tmp_path_factory: pytest.TempPathFactory,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
) -> S3Case:
    local = tmp_path_factory.mktemp("s3_damageable") / "era5.zarr"
    return _era5_case(local, "v3_inner_chunked", s3_upload, s3_options)


@pytest.fixture
def fresh_case(_damageable_case: S3Case) -> Iterator[S3Case]:
    """The bucket as uploaded, for a test that damages its stored objects: when the
    test ends, every object that no longer equals its local file (by MD5, the ETag of a
    single PUT) is put back and every object the test added is deleted. One upload of the
    147 objects for the module instead of one per test (about 1 CPU-second each, client and
    moto), and each test still starts from the bucket as uploaded."""
    case = _damageable_case
    yield case
    bucket, prefix = case.bucket_and_prefix()
    client = _boto(case.options)
    stored = {
        obj["Key"]: obj["ETag"].strip('"')
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for obj in page.get("Contents", [])
    }
    written = {
        f"{prefix}/{path.relative_to(case.local).as_posix()}": path
        for path in case.local.rglob("*")
        if path.is_file()
    }
    for key, path in written.items():
        body = path.read_bytes()
        if stored.get(key) != hashlib.md5(body).hexdigest():
            client.put_object(Bucket=bucket, Key=key, Body=body)
    for key in set(stored) - set(written):
        client.delete_object(Bucket=bucket, Key=key)


def test_a_full_epoch_from_s3_equals_zarrs_read_of_the_same_store(s3_case: S3Case) -> None:
    local = Oracle(s3_case.local)
    pipe = insitu_pipeline(
        s3_case.store(), s3_case.manifest, s3_case.views, batch_size=10, block_chunks=2
    )
    records = run_epoch(pipe, local, s3_case.oracle_views, keep_arrays=True)
    assert len(records) == len(pipe) > 1
    # every valid sample exactly once
    got = np.concatenate([r["sample_indices"]["x"] for r in records])
    want = expected_anchors(s3_case.manifest, "train", [0, 1, -2, 0])
    np.testing.assert_array_equal(np.sort(got), want)
    assert len(got) == len(want)
    # zarr reading the bucket itself agrees, for a couple of batches
    remote = Oracle(s3_case.store())
    for r in records[:2]:
        for label, view in s3_case.oracle_views.items():
            np.testing.assert_array_equal(
                r["arrays"][label], remote(view.name, r["sample_indices"][label])
            )
    stats = pipe.stats()
    assert stats["gets"] > 0 and stats["bytes_fetched"] > 0
    assert pipe.threads == []
    assert pipe.stages.pool.pinned_count() == 0


def test_microscopy_from_s3_along_z_equals_zarrs_read(
    tmp_path: Path, s3_upload: Callable[[Path, str], str], s3_options: dict[str, Any]
) -> None:
    local = write_microscopy(tmp_path / "micro.zarr")
    store = open_store(s3_upload(local, "micro.zarr"), **s3_options)
    g = open_geometries(store, sample_axis=2)
    pipe = insitu_pipeline(store, split_by_chunk(g["image"]), g, batch_size=5, block_chunks=2)
    run_epoch(pipe, Oracle(local), {"image": View("image", 2), "mask": View("mask", 2)})


def test_a_small_max_inflight_is_respected_against_s3(s3_case: S3Case) -> None:
    pipe = insitu_pipeline(
        s3_case.store(), s3_case.manifest, s3_case.views, batch_size=10, max_inflight=2
    )
    run_epoch(pipe, Oracle(s3_case.local), s3_case.oracle_views)
    assert 1 <= pipe.stats()["inflight_peak"] <= 2


def test_a_missing_object_on_s3_reads_as_the_fill_value_like_zarr(fresh_case: S3Case) -> None:
    bucket, prefix = fresh_case.bucket_and_prefix()
    keys = chunk_keys_on_disk(fresh_case.local, "t2m")
    chunk = fresh_case.manifest.chunks("train")[1]
    victim = sorted(k for k, c in keys.items() if c[0] == chunk)[0]
    _boto(fresh_case.options).delete_object(Bucket=bucket, Key=f"{prefix}/{victim}")
    remote = Oracle(fresh_case.store())  # zarr over the damaged bucket: NaN (the fill value)
    pipe = insitu_pipeline(fresh_case.store(), fresh_case.manifest, fresh_case.views, batch_size=10)
    records = run_epoch(pipe, remote, fresh_case.oracle_views, keep_arrays=True)
    assert any(np.isnan(r["arrays"]["x"]).any() for r in records)


def test_a_corrupt_object_on_s3_raises_chunk_read_error_naming_the_key(
    fresh_case: S3Case,
) -> None:
    bucket, prefix = fresh_case.bucket_and_prefix()
    keys = chunk_keys_on_disk(fresh_case.local, "t2m")
    chunk = fresh_case.manifest.chunks("train")[2]
    victim = sorted(k for k, c in keys.items() if c[0] == chunk)[-1]
    _boto(fresh_case.options).put_object(
        Bucket=bucket, Key=f"{prefix}/{victim}", Body=b"\x28\xb5\x2f\xfd garbage" * 10
    )
    pipe = insitu_pipeline(fresh_case.store(), fresh_case.manifest, fresh_case.views, batch_size=10)
    with pytest.raises(ChunkReadError) as info:
        run_epoch(pipe)
    message = str(info.value)
    assert "'t2m'" in message and f"chunk {chunk}" in message and victim in message
    assert info.value.__cause__ is not None
    assert pipe.threads == []
    assert pipe.stages.pool.pinned_count() == 0
    assert pipe.stages.fetch.pinned == 0


def test_closing_an_s3_pipeline_mid_epoch_unpins_and_resumes_where_it_left_off(
    s3_case: S3Case,
) -> None:
    def make() -> Any:
        return insitu_pipeline(
            s3_case.store(), s3_case.manifest, s3_case.views, batch_size=6, max_inflight=4
        )

    reference = run_epoch(make(), keep_arrays=True)
    pipe = make()
    first = run_epoch([next(pipe), next(pipe)])
    t0 = time.monotonic()
    pipe.close()
    assert time.monotonic() - t0 < 10
    assert pipe.threads == []
    assert pipe.stages.pool.pinned_count() == 0
    assert wait_until(lambda: pipe.stages.fetch.inflight == 0, timeout=10)
    rest = run_epoch(pipe, Oracle(s3_case.local), s3_case.oracle_views, keep_arrays=True)
    assert_same_records(first, reference[:2])
    assert_same_records(rest, reference[2:])


def test_train_and_val_from_s3_iterated_together_are_both_correct(s3_case: S3Case) -> None:
    import itertools

    oracle = Oracle(s3_case.local)
    manifest = split_by_chunk(s3_case.views["x"].base, (0.5, 0.5, 0.0))
    train, val = (
        insitu_pipeline(s3_case.store(), manifest, s3_case.views, split=s, batch_size=8)
        for s in ("train", "val")
    )
    n = {"train": 0, "val": 0}
    for bt, bv in itertools.zip_longest(train, val):
        for name, b in (("train", bt), ("val", bv)):
            if b is not None:
                assert_batch_matches(b, oracle, s3_case.oracle_views)
                n[name] += 1
    assert n == {"train": len(train), "val": len(val)}


# ---------------------------------------------------------------------------------------------
# The process exits cleanly (obstore has been seen to abort at interpreter exit)
# ---------------------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from insitubatch_nodes import insitu_pipeline, open_geometries, open_store, split_by_chunk

    url, options, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    store = open_store(url, **options)
    g = open_geometries(store, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    pipe = insitu_pipeline(
        store, split_by_chunk(g["t2m"]), views, batch_size=4, block_chunks=2, max_inflight=64
    )
    n = sum(1 for _ in pipe)                  # one full epoch
    pipe.reset()
    for i, _ in enumerate(pipe):              # a second epoch, left with GETs in flight
        if i == 1:
            break
    if mode == "running":                     # a third, still running at interpreter exit
        pipe.reset()
        next(pipe)
    print("ok", n, flush=True)
    """
)


@pytest.fixture(scope="module")
def tiled_case(
    tmp_path_factory: pytest.TempPathFactory,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
) -> S3Case:
    """Many small objects (4 x 4 tiles of a 16 x 32 field): many GETs in flight at once.

    24 steps (3 chunks of 8) hold as many GETs in flight as 48 did (the peak is
    ``max_inflight``, 64, in every run) with half the objects: the four exit tests asked moto
    1,530 requests instead of 3,194 (about 2 ms of its CPU each, 2026-12-07)."""
    local = tmp_path_factory.mktemp("s3_tiled") / "era5.zarr"
    write_era5(local, n_time=24, n_lat=16, n_lon=32, inner_chunks=(4, 8))
    url = s3_upload(local, "tiled/era5.zarr")
    store = open_store(url, **s3_options)
    g = open_geometries(store, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    oviews = {"x": View("t2m"), "y": View("t2m", 0, 1), "z": View("z")}
    return S3Case(local, url, dict(s3_options), views, oviews, split_by_chunk(g["t2m"]))


def _run_child(script: Path, url: str, options: dict[str, Any], mode: str, attempts: int) -> None:
    """Run ``attempts`` processes side by side (each is its own trial of the exit; an abort at
    exit is intermittent, so try more than once) and check every one exited cleanly. Each is
    forked from the tests' fork server (``tests/forkserver.py``: the script runs as
    ``__main__`` and ends through the interpreter's normal exit, as ``python script.py``
    would; obstore's runtime starts in the process itself), not a new interpreter that
    imports torch again: 2-3 s of CPU per attempt."""
    import json

    argv = [sys.executable, str(script), url, json.dumps(options), mode]
    procs = [
        forkserver.popen(  # the claim is the exit: every exit handler runs, as in `python`
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, full_exit=True
        )
        for _ in range(attempts)
    ]
    try:
        outputs = [proc.communicate(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for attempt, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        assert stdout.startswith("ok"), (attempt, proc.returncode, stderr[-3000:])
        assert proc.returncode == 0, (
            f"attempt {attempt}: exit code {proc.returncode} after a clean run "
            f"(-6 is SIGABRT); stderr: {stderr[-3000:]}"
        )
        assert "panicked" not in stderr and "Abort" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("mode", ["closed", "running"])
def test_a_process_that_trained_from_s3_exits_cleanly(
    tiled_case: S3Case, tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "train_from_s3.py"
    script.write_text(_SCRIPT)
    _run_child(script, tiled_case.url, tiled_case.options, mode, attempts=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["closed", "running"])
def test_a_process_that_trained_from_a_slow_s3_endpoint_exits_cleanly(
    tiled_case: S3Case, tmp_path: Path, mode: str
) -> None:
    testing = pytest.importorskip("insitubatch_nodes.testing")
    port = urlsplit(tiled_case.options["endpoint"]).port
    script = tmp_path / "train_from_s3.py"
    script.write_text(_SCRIPT)
    with testing.LatencyProxy(port, delay_s=0.02) as proxy:
        options = {**tiled_case.options, "endpoint": proxy.endpoint}
        # one trial, not six: the abort these runs caught now and then (an obstore thread
        # inside its call into the IO loop as the interpreter finalizes) is held across the
        # exit on purpose, every run, by tests/test_exit.py
        _run_child(script, tiled_case.url, options, mode, attempts=1)
