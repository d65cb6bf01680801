"""open_store / as_store: every spelling of a store opens the same zarr data."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr
import zarr.storage
from zarr.abc.store import Store
from zarr.core.buffer import cpu

from insitubatch_nodes import RetryPolicy, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.io.objects import make_async_getter
from insitubatch_nodes.io.stores import (
    RETRY_TIME_SCALE_ENV,
    SUPPORTED_SCHEMES,
    as_store,
    describe_store,
    retry_policy,
    retry_time_scale,
)
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.stages.read_plan import ReadPlanNode


def _assert_same_group(store: Store, local: Path) -> None:
    """The group read through ``store`` equals the group zarr reads from ``local``."""
    got = zarr.open_group(store=store, mode="r")
    want = zarr.open_group(local, mode="r")
    assert sorted(name for name, _ in got.arrays()) == sorted(name for name, _ in want.arrays())
    for name in ("t2m", "z", "time"):
        np.testing.assert_array_equal(got[name][...], want[name][...])


def test_a_plain_path_opens_a_read_only_obstore_backed_store(era5_v3_path: Path) -> None:
    store = open_store(era5_v3_path)
    assert isinstance(store, zarr.storage.ObjectStore)
    assert store.read_only
    _assert_same_group(store, era5_v3_path)
    # str paths are the same as PathLike ones
    _assert_same_group(open_store(str(era5_v3_path)), era5_v3_path)


def test_a_file_url_opens_the_same_folder_as_its_path(era5_v3_path: Path) -> None:
    store = open_store(era5_v3_path.absolute().as_uri())
    _assert_same_group(store, era5_v3_path)
    assert open_geometries(era5_v3_path.as_uri()) == open_geometries(era5_v3_path)


def test_a_read_only_store_refuses_writes(era5_v3_path: Path) -> None:
    store = open_store(era5_v3_path)
    with pytest.raises(ValueError, match="read-only"):
        zarr.open_array(store=store, path="t2m", mode="r+")
    with pytest.raises(ValueError, match="read-only"):
        asyncio.run(store.set("t2m/c/0/0/0", cpu.Buffer.from_bytes(b"garbage")))
    assert (era5_v3_path / "t2m" / "c" / "0" / "0" / "0").read_bytes() != b"garbage"


def test_two_opens_of_the_same_memory_url_see_the_same_objects() -> None:
    url = f"memory://test-{uuid.uuid4().hex}"
    writable = open_store(url, read_only=False)
    data = np.arange(30, dtype="f4").reshape(10, 3)
    group = zarr.open_group(store=writable, mode="w", zarr_format=3)
    arr = group.create_array("x", shape=data.shape, chunks=(4, 3), dtype="f4")
    arr[...] = data

    reader = open_store(url)
    assert reader.read_only
    np.testing.assert_array_equal(zarr.open_group(store=reader, mode="r")["x"][...], data)
    geoms = open_geometries(url)
    assert geoms["x"].shape == (10, 3)
    assert geoms["x"].n_chunks == 3


def test_different_memory_names_are_different_stores() -> None:
    a = f"memory://test-{uuid.uuid4().hex}"
    b = f"memory://test-{uuid.uuid4().hex}"
    zarr.open_group(store=open_store(a, read_only=False), mode="w").create_array(
        "only_in_a", shape=(2,), dtype="i4"
    )
    group_b = zarr.open_group(store=open_store(b, read_only=False), mode="a")
    assert "only_in_a" not in group_b


def test_memory_urls_take_no_options() -> None:
    with pytest.raises(ValueError, match="no options"):
        open_store(f"memory://test-{uuid.uuid4().hex}", region="us-east-1")


@pytest.fixture(scope="module")
def era5_v3_s3_url(era5_v3_path: Path, s3_upload) -> str:
    """The v3 ERA5-like group uploaded once to a fresh bucket of the moto server."""
    return s3_upload(era5_v3_path, "datasets/era5.zarr")


@pytest.mark.xdist_group("s3")
def test_an_s3_url_reads_the_uploaded_group_with_passed_through_options(
    era5_v3_path: Path, era5_v3_s3_url: str, s3_options
) -> None:
    url = era5_v3_s3_url
    store = open_store(url, **s3_options)
    assert isinstance(store, zarr.storage.ObjectStore)
    _assert_same_group(store, era5_v3_path)


@pytest.mark.xdist_group("s3")
def test_open_geometries_over_s3_equals_the_local_geometry(
    era5_v3_path: Path, era5_v2_path: Path, era5_v3_s3_url: str, s3_upload, s3_options
) -> None:
    v2_url = s3_upload(era5_v2_path, "era5.zarr")
    for local, url in ((era5_v3_path, era5_v3_s3_url), (era5_v2_path, v2_url)):
        remote = open_geometries(open_store(url, **s3_options))
        assert remote == open_geometries(local)
        # the geometry's store keys name objects that exist in the bucket
        store = open_store(url, **s3_options)
        for geom in remote.values():
            for chunk in (0, geom.n_chunks - 1):
                for tile in geom.tiles():
                    key = geom.store_key(chunk, tile)
                    assert store.store.head(key)["size"] > 0


@pytest.mark.xdist_group("s3")
def test_an_s3_url_of_a_missing_bucket_or_prefix_fails_to_open(
    era5_v3_s3_url: str, s3_options
) -> None:
    url = era5_v3_s3_url
    wrong_bucket = url.replace("s3://", "s3://missing-", 1)
    with pytest.raises(FileNotFoundError):  # zarr's GroupNotFoundError is a FileNotFoundError
        open_geometries(open_store(wrong_bucket, **s3_options))
    with pytest.raises(FileNotFoundError):
        open_geometries(open_store(url + "-missing-prefix", **s3_options))


def test_an_s3_url_needs_a_bucket() -> None:
    with pytest.raises(ValueError, match="bucket"):
        open_store("s3:///prefix-only")


@pytest.mark.parametrize("url", ["ftp://host/data.zarr", "dav://example.com/x.zarr", "hdfs://n/x"])
def test_an_unsupported_scheme_raises_value_error_naming_the_supported_ones(url: str) -> None:
    with pytest.raises(ValueError) as info:
        open_store(url)
    message = str(info.value)
    assert url.split(":", 1)[0] in message
    for scheme in SUPPORTED_SCHEMES:
        assert f"{scheme}://" in message


def test_supported_schemes_are_the_documented_ones() -> None:
    assert set(SUPPORTED_SCHEMES) == {"file", "memory", "s3", "gs", "az", "http", "https"}


def test_a_missing_local_folder_raises_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist.zarr"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        open_store(missing)
    with pytest.raises(FileNotFoundError):
        open_store(missing.as_uri())
    with pytest.raises(FileNotFoundError):
        open_geometries(missing)
    assert not missing.exists()


def test_a_writable_local_store_creates_its_folder(tmp_path: Path) -> None:
    target = tmp_path / "new.zarr"
    store = open_store(target, read_only=False)
    group = zarr.open_group(store=store, mode="w", zarr_format=3)
    group.create_array("x", shape=(4,), dtype="i4")[...] = np.arange(4)
    assert target.is_dir()
    np.testing.assert_array_equal(zarr.open_group(target, mode="r")["x"][...], np.arange(4))


def test_a_remote_file_url_is_refused() -> None:
    with pytest.raises(ValueError, match="local"):
        open_store("file://otherhost/data.zarr")


def test_an_empty_string_is_refused() -> None:
    with pytest.raises(ValueError):
        open_store("")


def test_open_store_refuses_an_already_opened_store(era5_v3_path: Path) -> None:
    with pytest.raises(TypeError):
        open_store(zarr.storage.LocalStore(era5_v3_path))  # type: ignore[arg-type]


def test_every_api_accepts_a_plain_zarr_local_store(era5_v3_path: Path) -> None:
    local = zarr.storage.LocalStore(era5_v3_path, read_only=True)
    assert as_store(local) is local
    with pytest.raises(ValueError):
        as_store(local, region="us-east-1")

    geoms = open_geometries(local)
    assert geoms == open_geometries(era5_v3_path)
    assert geoms == open_geometries(str(era5_v3_path))

    # downstream APIs take the geometries read through the zarr store as they are
    manifest = split_by_chunk(geoms["t2m"])
    config = PlanConfig(batch_size=5, rank=0, world_size=1)
    node = ReadPlanNode(manifest, {"x": geoms["t2m"]}, config=config)
    assert sum(len(batch) for batch in node) == len(manifest.samples("train"))


# ---------------------------------------------------------------------------------------------
# The retry policy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"timeout_s": 0},
        {"timeout_s": float("inf")},
        {"stall_timeout_s": -1.0},
        {"max_retries": -1},
        {"max_retries": 1.5},
        {"connect_timeout_s": True},
        {"backoff_base": 0.5},
        {"initial_backoff_s": 10.0, "max_backoff_s": 1.0},
    ],
)
def test_a_retry_policy_refuses_values_that_cannot_bound_a_read(bad: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError), match="RetryPolicy"):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_open_store_takes_retries_and_timeouts_only_from_the_retry_policy() -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        open_store("s3://bucket/x", retry_config={"max_retries": 3})
    with pytest.raises(ValueError, match="RetryPolicy"):
        open_store("s3://bucket/x", client_options={"timeout": "5s"})
    with pytest.raises(TypeError, match="RetryPolicy"):
        open_store("s3://bucket/x", retry={"timeout_s": 5})  # type: ignore[arg-type]


def test_an_s3_store_is_configured_with_its_retry_policy() -> None:
    policy = RetryPolicy(timeout_s=12.0, max_retries=4, stall_timeout_s=3.0, connect_timeout_s=2)
    store = open_store("s3://bucket/x", retry=policy, client_options={"allow_http": True})
    inner = store.store  # type: ignore[attr-defined]
    assert inner.retry_config["max_retries"] == 4
    assert inner.retry_config["retry_timeout"].total_seconds() == 12.0
    assert inner.client_options["read_timeout"] == "3s"
    assert inner.client_options["connect_timeout"] == "2s"
    assert inner.client_options["timeout"] == "12s"
    assert inner.client_options["allow_http"] in (True, "true")  # the user's options stay
    assert retry_policy(store) == policy
    assert retry_policy(open_store("s3://bucket/x")) == RetryPolicy()


def test_by_default_obstore_gets_more_retries_than_fit_in_the_deadline() -> None:
    """max_retries=None: the deadline, not a count, ends the retries (every backoff is at
    least initial_backoff_s, so more than timeout_s / initial_backoff_s retries never run)."""
    policy = RetryPolicy(timeout_s=12.0, initial_backoff_s=0.5)
    assert policy.max_retries is None
    inner = open_store("s3://bucket/x", retry=policy).store  # type: ignore[attr-defined]
    assert inner.retry_config["max_retries"] > 12.0 / 0.5
    assert RetryPolicy(max_retries=3).obstore_retry_config()["max_retries"] == 3


def test_the_test_only_retry_clock_scales_every_wait_and_leaves_the_policy_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """INSITUBATCH_NODES_RETRY_TIME_SCALE (tests/test_store_failures.py runs its deadlines
    on it): obstore's deadline, backoffs and timeouts, and the deadline of every read, shrink by
    the scale; the policy, its retry count and the messages keep the policy's seconds."""
    policy = RetryPolicy(timeout_s=12.0, stall_timeout_s=3.0, connect_timeout_s=2)
    assert retry_time_scale() == 1.0
    monkeypatch.setenv(RETRY_TIME_SCALE_ENV, "0.25")
    assert retry_time_scale() == 0.25
    inner = open_store("s3://bucket/x", retry=policy).store  # type: ignore[attr-defined]
    assert inner.retry_config["retry_timeout"].total_seconds() == 3.0
    assert inner.retry_config["backoff"]["init_backoff"].total_seconds() == 0.025
    assert inner.retry_config["backoff"]["max_backoff"].total_seconds() == 1.25
    assert inner.retry_config["max_retries"] == RetryPolicy(timeout_s=12.0).retry_count_limit
    assert inner.client_options["read_timeout"] == "750ms"
    assert inner.client_options["connect_timeout"] == "500ms"
    assert inner.client_options["timeout"] == "3s"
    assert policy.timeout_s == 12.0
    assert retry_policy(open_store("s3://bucket/x")).timeout_s == 30.0  # the default, unscaled

    class Never(zarr.storage.MemoryStore):
        async def get(self, *args: object, **kwargs: object) -> None:
            await asyncio.sleep(3600)

    get = make_async_getter(Never(), timeout_s=4.0)  # 1 s on the scaled clock
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 4 s \(RetryPolicy.timeout_s\)"):
        asyncio.run(get("k"))
    assert 0.9 <= time.monotonic() - t0 < 3.0
    for bad in ("0", "2", "-1", "fast"):
        monkeypatch.setenv(RETRY_TIME_SCALE_ENV, bad)
        with pytest.raises(ValueError, match=RETRY_TIME_SCALE_ENV):
            retry_time_scale()


@pytest.mark.xdist_group("s3")
def test_client_options_from_the_environment_still_apply_next_to_the_policy(
    era5_v3_path: Path, era5_v3_s3_url: str, s3_options, monkeypatch: pytest.MonkeyPatch
) -> None:
    """obstore drops AWS_ALLOW_HTTP & co. once client_options is passed; open_store keeps them."""
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    options = {k: v for k, v in s3_options.items() if k != "client_options"}
    _assert_same_group(open_store(era5_v3_s3_url, **options), era5_v3_path)


def test_describe_store_names_what_open_store_was_given(era5_v3_path: Path) -> None:
    assert describe_store(open_store(era5_v3_path)) == str(era5_v3_path.absolute())
    plain = {"endpoint": "http://127.0.0.1:9", "client_options": {"allow_http": True}}
    s3 = open_store("s3://bucket/some/prefix", **plain)
    assert describe_store(s3) == "s3://bucket/some/prefix (endpoint http://127.0.0.1:9)"
    assert str(era5_v3_path) in describe_store(zarr.storage.LocalStore(era5_v3_path))
