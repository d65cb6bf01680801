"""HTTP(S) stores and anonymous cloud reads, against a real nginx on loopback.

Small zarr stores are written locally and served by nginx (the Debian package, started as a
child process with its own config: ``insitubatch_nodes.testing.NginxServer``); the pipeline
reads them through ``open_store("http://127.0.0.1:PORT/NAME.zarr")`` and zarr's read of the
local copy (and of the HTTP store itself) is the oracle. nginx cannot list (PROPFIND is 405), so
arrays are found through consolidated metadata or by name. The same server doubles as a public
bucket: ``s3://`` (path-style ``endpoint=``) and ``gs://`` (``base_url=``) unsigned GETs are
plain GETs of ``/BUCKET/KEY``.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import Oracle, View, chunk_keys_on_disk, run_epoch, write_era5

from insitubatch_nodes import (
    RetryPolicy,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError, StaleCacheError
from insitubatch_nodes.io.objects import make_async_getter
from insitubatch_nodes.io.stores import (
    RETRY_TIME_SCALE_ENV,
    SUPPORTED_SCHEMES,
    describe_store,
    plain_object_store,
)
from insitubatch_nodes.testing import FaultProxy, NginxServer, free_port, nginx_executable

pytestmark = [
    pytest.mark.xdist_group("http"),
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part"),
]

# name -> make_era5_like options (small: a few chunks of t2m and z)
STORES: dict[str, dict[str, Any]] = {
    "v3": {"n_time": 48, "n_lat": 8, "n_lon": 12, "inner_chunks": (4, 6)},
    "v2": {"n_time": 48, "n_lat": 8, "n_lon": 12, "zarr_format": 2},
    "sharded": {"n_time": 64, "n_lat": 8, "n_lon": 12, "shard_samples": 16},
}


@dataclass
class Site:
    """nginx serving ``root``: consolidated copies of :data:`STORES` at ``/NAME.zarr``, the
    same stores as a bucket at ``/pub/NAME.zarr``, and ``/plain.zarr`` (v3, not consolidated)."""

    root: Path
    server: NginxServer

    def url(self, name: str) -> str:
        return f"{self.server.endpoint}/{name}.zarr"

    def local(self, name: str) -> Path:
        return self.root / f"{name}.zarr"


def _write(root: Path, name: str, consolidated: bool = True, **options: Any) -> Path:
    path = write_era5(root / f"{name}.zarr", **options)
    if consolidated:
        zarr.consolidate_metadata(path)
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if nginx_executable() is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it)")
    root = tmp_path_factory.mktemp("www")
    for name, options in STORES.items():
        _write(root, name, **options)
    _write(root, "plain", consolidated=False, **STORES["v3"])
    shutil.copytree(root / "v3.zarr", root / "pub" / "v3.zarr")
    shutil.copytree(root / "v3.zarr", root / "private" / "v3.zarr")
    shutil.copytree(root / "v3.zarr", root / "unavailable.zarr")
    statuses = {r"^/unavailable\.zarr/t2m/c/": 503, r"^/private/": 403}
    with NginxServer(root, statuses=statuses) as server:
        yield Site(root, server)


def _views(g: dict[str, Any]) -> tuple[dict[str, Any], dict[str, View]]:
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    return views, {"x": View("t2m"), "y": View("t2m", 0, 1), "z": View("z")}


def _read_all(store: Any, local: Path, geoms: dict[str, Any] | None = None) -> list[Any]:
    """One epoch of t2m (x, shifted y) and z from ``store``, each batch checked against zarr's
    read of the local copy; the records (with arrays)."""
    g = geoms if geoms is not None else open_geometries(store, ["t2m", "z"])
    views, oracle_views = _views(g)
    pipe = insitu_pipeline(store, split_by_chunk(g["t2m"]), views, batch_size=8, block_chunks=2)
    records = run_epoch(pipe, Oracle(local), oracle_views, keep_arrays=True)
    assert len(records) == len(pipe) > 1
    assert pipe.threads == []
    return records


def _no_cloud_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS_*/GOOGLE_*/AZURE_* variable reaches obstore (the CA bundle aside)."""
    import os

    for key in list(os.environ):
        if key.startswith(("AWS_", "GOOGLE_", "AZURE_")) and key != "AWS_CA_BUNDLE":
            monkeypatch.delenv(key)


# ---------------------------------------------------------------------------------------------
# Opening (no IO)
# ---------------------------------------------------------------------------------------------


def test_https_and_http_urls_open_an_http_store_named_by_its_url() -> None:
    from obstore.store import HTTPStore
    from zarr.storage import ObjectStore

    assert {"http", "https"} <= set(SUPPORTED_SCHEMES)
    url = "https://data.example.org/archive/era5.zarr"
    store = open_store(url + "/")
    assert isinstance(store, ObjectStore) and isinstance(store.store, HTTPStore)
    assert store.read_only
    assert describe_store(store) == url
    # http:// is allowed without asking; the policy's timeouts are the client's
    plain = open_store("http://127.0.0.1:9/era5.zarr", retry=RetryPolicy(timeout_s=7))
    options = plain.store.client_options or {}
    assert str(options.get("allow_http")).lower() == "true"
    assert "timeout" in options and "connect_timeout" in options
    # a password in the URL is not repeated in error messages
    secret = open_store("https://user:hunter2@data.example.org/era5.zarr")
    assert "hunter2" not in describe_store(secret)


def test_an_http_store_refuses_options_it_has_no_use_for() -> None:
    with pytest.raises(ValueError, match="client_options"):
        open_store("https://data.example.org/era5.zarr", region="us-east-1")
    with pytest.raises(ValueError, match="RetryPolicy"):
        open_store("https://data.example.org/e.zarr", client_options={"timeout": "3s"})
    with pytest.raises(ValueError, match="host"):
        open_store("https:///era5.zarr")


def test_anonymous_true_signs_nothing_and_refuses_credentials() -> None:
    for url, config_key in (("s3://pub/era5.zarr", "skip_signature"), ("gs://pub/e.zarr", None)):
        store = open_store(url, anonymous=True)
        if config_key is not None:
            assert str(store.store.config.get(config_key)).lower() == "true"
        # zarr's ObjectStore, read as such, whose refusals say the bucket is not public
        assert plain_object_store(store) and type(store).__name__ == "_CloudObjectStore"
    with pytest.raises(ValueError, match="access_key_id"):
        open_store("s3://pub/era5.zarr", anonymous=True, access_key_id="a", secret_access_key="b")
    with pytest.raises(ValueError, match="local or in-memory"):
        open_store("memory://anon", anonymous=True)
    with pytest.raises(TypeError, match="anonymous"):
        open_store("s3://pub/era5.zarr", anonymous="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Reading through nginx
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(STORES))
def test_a_store_served_by_nginx_reads_like_zarr_end_to_end(site: Site, name: str) -> None:
    store = open_store(site.url(name))
    assert describe_store(store) == site.url(name)
    # consolidated metadata finds the arrays: nothing is listed (nginx cannot)
    assert set(open_geometries(store)) == {"t2m", "z"}
    records = _read_all(store, site.local(name))
    # zarr reading the HTTP store itself agrees (for a sharded array: by range requests)
    remote = Oracle(open_store(site.url(name)))
    for record in records[:2]:
        np.testing.assert_array_equal(
            record["arrays"]["x"], remote("t2m", record["sample_indices"]["x"])
        )
    log = site.server.access_log()
    assert not [line for line in log if line.startswith("PROPFIND")]
    if name == "sharded":  # zarr's partial reads of shards were answered with ranges
        assert [line for line in log if f"/{name}.zarr/t2m/c/" in line and " 206 " in line]


def test_an_https_store_reads_like_zarr_and_checks_the_certificate(site: Site) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the server's self-signed certificate)")
    with NginxServer(site.root, tls=True) as server:
        url = f"{server.endpoint}/v3.zarr"
        assert url.startswith("https://")
        # the certificate is self-signed: verified by default, so refused
        with pytest.raises(Exception, match="InvalidCertificate"):
            open_geometries(open_store(url, retry=RetryPolicy(timeout_s=3.0, max_retries=1)))
        store = open_store(url, client_options={"allow_invalid_certificates": True})
        assert describe_store(store) == url
        _read_all(store, site.local("v3"))
        assert [line for line in server.access_log() if "/v3.zarr/t2m/c/" in line]


def test_geometries_read_elsewhere_find_the_arrays_of_an_http_store_without_listing(
    site: Site,
) -> None:
    # /plain.zarr has no consolidated metadata: the pipeline checks each array by name
    geoms = open_geometries(site.local("plain"), ["t2m", "z"])
    _read_all(open_store(site.url("plain")), site.local("plain"), geoms)


def test_open_geometries_finds_named_arrays_of_an_http_store_without_consolidated_metadata(
    site: Site,
) -> None:
    store = open_store(site.url("plain"))
    g = open_geometries(store, ["t2m", "z"])
    assert g == open_geometries(site.local("plain"), ["t2m", "z"])


def test_a_chunk_the_server_answers_404_reads_as_the_fill_value_like_zarr(
    site: Site, tmp_path: Path
) -> None:
    www = tmp_path / "www"
    local = _write(www, "holes", **STORES["v3"])
    keys = chunk_keys_on_disk(local, "t2m")
    victim = sorted(k for k, c in keys.items() if c[0] == 2)[0]
    (local / victim).unlink()
    with NginxServer(www) as server:
        url = f"{server.endpoint}/holes.zarr"
        records = _read_all(open_store(url), local)  # zarr's local read: the fill value there
        assert any(f"/holes.zarr/{victim} HTTP/1.1 404" in line for line in server.access_log())
    assert any(np.isnan(r["arrays"]["x"]).any() for r in records)


def test_missing_objects_drop_over_http_is_refused_in_a_few_lines_saying_what_to_pass(
    site: Site,
) -> None:
    # nginx cannot list: the refusal named the fix, but carried the server's HTML error page
    # and obstore's debug dump (kilobytes); the whole cause stays chained
    store = open_store(site.url("v3"))
    g = open_geometries(store, ["t2m"])
    with pytest.raises(OSError, match="missing_objects='read'") as info:
        insitu_pipeline(store, split_by_chunk(g["t2m"]), {"x": g["t2m"]}, batch_size=4,
                        missing_objects="drop")  # fmt: skip
    said = str(info.value)
    assert len(said) < 600 and "<html" not in said.lower() and "\n" not in said, said
    assert info.value.__cause__ is not None


def test_a_short_burst_of_503s_from_the_server_is_retried_and_the_data_arrive_exact(
    site: Site,
) -> None:
    with FaultProxy(site.server.port, fail_first=2, match="/c/") as proxy:
        store = open_store(f"{proxy.endpoint}/v3.zarr")
        _read_all(store, site.local("v3"))
    assert proxy.injected > 0


def test_a_server_that_answers_503_for_good_fails_with_chunk_read_error_naming_the_url(
    site: Site,
) -> None:
    policy = RetryPolicy(timeout_s=2.0, connect_timeout_s=1.0, stall_timeout_s=1.0)
    url = site.url("unavailable")
    store = open_store(url, retry=policy)
    g = open_geometries(store, ["t2m"])  # the metadata are served; every t2m chunk is a 503
    pipe = insitu_pipeline(store, split_by_chunk(g["t2m"]), {"x": g["t2m"]}, batch_size=8)
    start = time.monotonic()
    with pytest.raises(ChunkReadError) as info:
        next(pipe)
    elapsed = time.monotonic() - start
    assert url in str(info.value) and "'t2m'" in str(info.value)
    assert elapsed < policy.timeout_s + 3.0, elapsed
    pipe.close()
    assert pipe.threads == []


# ---------------------------------------------------------------------------------------------
# Public buckets: anonymous=True, and the error that suggests it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_public_bucket_opened_with_anonymous_true_is_read_without_credentials(
    site: Site, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_cloud_credentials(monkeypatch)
    where = {"endpoint": site.server.endpoint, "region": "us-east-1"}
    if scheme == "gs":
        where = {"base_url": site.server.endpoint}
    url = f"{scheme}://pub/v3.zarr"
    store = open_store(url, anonymous=True, client_options={"allow_http": True}, **where)
    before = len(site.server.access_log())
    _read_all(store, site.local("v3"))
    requests = site.server.access_log()[before:]
    assert requests and all(line.endswith(" unsigned") for line in requests)
    assert all(line.startswith("GET /pub/") for line in requests)


def test_a_signed_bucket_read_without_credentials_says_to_pass_anonymous_true(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_cloud_credentials(monkeypatch)
    # the claim is the message, not the retry window: the policy's 3 s run on a 4x clock
    monkeypatch.setenv(RETRY_TIME_SCALE_ENV, "0.25")

    def store() -> Any:  # a fresh one each time: obstore waits longer once a lookup has failed
        # No credentials anywhere: obstore asks the instance metadata service (a closed port).
        return open_store(
            "s3://pub/v3.zarr",
            endpoint=site.server.endpoint,
            region="us-east-1",
            metadata_endpoint=f"http://127.0.0.1:{free_port()}",
            client_options={"allow_http": True},
            retry=RetryPolicy(timeout_s=3.0, connect_timeout_s=1.0, stall_timeout_s=1.0),
        )

    with pytest.raises(PermissionError, match="anonymous=True") as info:
        open_geometries(store())
    assert "s3://pub/v3.zarr" in str(info.value) and "no credentials" in str(info.value)
    # the fetch stage's GETs say the same (obstore gives up after the policy's 3 s of retries)
    get = make_async_getter(store(), timeout_s=30.0)
    with pytest.raises(PermissionError, match="anonymous=True"):
        asyncio.run(get("t2m/c/0/0/0"))


def test_a_bucket_that_refuses_signed_requests_suggests_anonymous_true(site: Site) -> None:
    store = open_store(
        "s3://private/v3.zarr",
        endpoint=site.server.endpoint,
        region="us-east-1",
        access_key_id="not-a-key",
        secret_access_key="not-a-secret",
        client_options={"allow_http": True},
    )
    with pytest.raises(PermissionError, match="refused the request") as info:
        open_geometries(store)
    assert "anonymous=True" in str(info.value) and "s3://private/v3.zarr" in str(info.value)


# ---------------------------------------------------------------------------------------------
# A persistent cache over a store that cannot list
# ---------------------------------------------------------------------------------------------


def _cached_run(url: str, local: Path, cache: Path, **kw: Any) -> tuple[dict[str, int], Any]:
    store = open_store(url)
    g = open_geometries(store, ["t2m", "z"])
    views, oracle_views = _views(g)
    pipe = insitu_pipeline(
        store, split_by_chunk(g["t2m"]), views, batch_size=8, block_chunks=2, cache_dir=cache,
        persist=not kw.get("readonly_cache", False), **kw,
    )  # fmt: skip
    try:
        run_epoch(pipe, Oracle(local), oracle_views)
        return pipe.stats(), pipe.stages.pool.cache
    finally:
        pipe.close()


def test_an_object_rewritten_on_an_http_server_between_runs_is_refetched_or_named(
    site: Site, tmp_path: Path
) -> None:
    """nginx cannot list: each cached object is checked with a HEAD (ETag, Last-Modified, size)
    when the cache opens. Before, the cache was trusted with a warning and served old values."""
    import os

    local = site.root / "rewritten.zarr"
    shutil.copytree(site.local("v3"), local)
    url = site.url("rewritten")
    cache = tmp_path / "cache"
    first, _ = _cached_run(url, local, cache)
    assert first["gets"] > 0
    array = zarr.open_array(local / "t2m", mode="r+")
    spc = array.chunks[0]
    array[spc : 2 * spc] = array[spc : 2 * spc] + 100.0  # chunk 1 of t2m, same shape
    later = time.time() + 5  # a rewrite between runs lands in a later second than the first write
    rewritten = [k for k, c in chunk_keys_on_disk(local, "t2m").items() if c[0] == 1]
    for key in rewritten:
        os.utime(local / key, (later, later))
    with pytest.raises(StaleCacheError, match=r"'t2m/c/1/"):
        _cached_run(url, local, cache, readonly_cache=True)
    stats, used = _cached_run(url, local, cache)  # zarr's read of the rewritten copy
    assert stats["gets"] == len(rewritten) and used.stats["stale_chunks"] == 1
    assert _cached_run(url, local, cache)[0]["gets"] == 0  # recorded anew: trusted again
