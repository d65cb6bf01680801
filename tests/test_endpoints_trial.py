"""Trial of store identity (2026-12-07): a persistent cache's chunks, or saved statistics, of
one store must never be served for another store; the same store however it is opened shares.

Found (fixed; each test failed before):

* a cache warmed from ``s3://B/d.zarr`` at the endpoint ``AWS_ENDPOINT_URL`` named, opened with
  ``check_store=False`` over the same bucket at another endpoint, served the first server's
  values: obstore's ``config`` holds no endpoint taken from the environment, and the cache's
  store digest read only that (store names had their own rule, for ``open_store`` only);
* statistics fitted on a store made by hand (``ObjectStore(S3Store(...))``) with its endpoint in
  the environment were accepted for the same bucket at another endpoint (both named
  ``s3://B/d.zarr``), and likewise for an ``FsspecStore`` / ``xr.open_zarr(...,
  storage_options={"endpoint_url": ...})`` (its name was its repr: bucket and path only), for
  S3's ``aws_endpoint_url_s3`` option, GCS's ``base_url`` and an Azure container in two accounts
  (the cache's digest too);
* a store that cannot be listed (``FsspecStore``, zarr ``MemoryStore``) with ``check_store=False``
  was served the chunks of any other store: a cache warmed from folder ``a.zarr`` gave ``a``'s
  values as ``b.zarr``'s read through fsspec, and two fsspec folders each other's (its chunks
  recorded no store at all);
* a local read that raised anything but an ``OSError`` (a MemoryError: an object too large for
  memory, a sparse file here) was reported as a *decode* failure ("its bytes do not decode") and
  not counted in the epoch report's GETs.

Tried and found right: one folder opened by path, ``file://`` URL (with a trailing ``/``),
obstore ``LocalStore``, zarr ``LocalStore`` and (``check_store=False``) fsspec shares one cache;
two folders with the same layout never do; an endpoint's case and trailing ``/`` name one store;
one moto server reached as ``127.0.0.1`` and ``localhost`` counts as two stores (its chunks
fetched again: loud, never wrong); a store's endpoint given in the options wins over the
environment's, as obstore's does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.errors import StaleCacheError
from insitubatch_nodes.statistics import Statistics, fit_statistics
from insitubatch_nodes.testing import put_folder
from tests.conftest import S3_KEY, S3_REGION, S3_SECRET, moto_server

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part"),
]


def _write(root: Path, seed: int) -> Path:
    """``x`` (12, 3) in chunks of 2, uncompressed: every object of every such store has one
    size (so only the values tell two stores apart)."""
    values = np.random.default_rng(seed).random((12, 3)).astype("f4") + 1
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array(
        "x", data=values, chunks=(2, 3), compressors=None, fill_value=0, dimension_names=("t", "c")
    )
    return root


def _read(store: Any, **cache: Any) -> tuple[np.ndarray, dict[str, int]]:
    """One epoch of ``x``: its rows in sample order, and the pipeline's counters."""
    g = open_geometries(store, ["x"])["x"]
    pipe = insitu_pipeline(store, split_by_chunk(g, (1, 0, 0)), {"x": g}, batch_size=4, **cache)
    with pipe:
        got = {}
        for b in Loader(pipe):
            for i, row in zip(b.sample_indices["x"].tolist(), np.array(b["x"]), strict=True):
                got[i] = row
        return np.stack([got[i] for i in sorted(got)]), pipe.stats()


def _values(local: Path) -> np.ndarray:
    return np.asarray(zarr.open_array(local / "x", mode="r")[...])


def _fit(store: Any, path: Path) -> Path:
    g = open_geometries(store, ["x"])["x"]
    fit_statistics(store, split_by_chunk(g, (1, 0, 0)), {"x": g}, batch_size=4).save(path)
    return path


# ---------------------------------------------------------------------------------------------
# Two S3 endpoints holding one bucket name
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory, s3_server: str) -> Iterator[dict[str, Any]]:
    """Two moto servers, each with bucket ``B`` holding ``d.zarr``: other values on each. The
    first is the run's shared server (the bucket's name is this module's own), the second one
    of the module's own (a moto server's start is 0.9 CPU-s)."""
    import boto3
    from obstore.store import S3Store

    logs = tmp_path_factory.mktemp("moto2")
    bucket = f"twin-{uuid.uuid4().hex[:8]}"
    with moto_server(logs) as b:
        a = s3_server
        locals_ = {}
        for endpoint, seed in ((a, 1), (b, 2)):
            local = _write(tmp_path_factory.mktemp("src") / "d.zarr", seed)
            boto3.client(
                "s3", endpoint_url=endpoint, region_name=S3_REGION,
                aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
            ).create_bucket(Bucket=bucket)  # fmt: skip
            put_folder(S3Store(bucket, **_options(endpoint)), local, "d.zarr")
            locals_[endpoint] = local
        yield {"a": a, "b": b, "bucket": bucket, "local": locals_}


def _options(endpoint: str) -> dict[str, Any]:
    return {"endpoint": endpoint, "region": S3_REGION, "access_key_id": S3_KEY,
            "secret_access_key": S3_SECRET, "client_options": {"allow_http": True}}  # fmt: skip


def _env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """The endpoint and credentials through the environment only (no options)."""
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
                 "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_REGION": S3_REGION,
                 "AWS_ALLOW_HTTP": "true"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)


@pytest.mark.xdist_group("s3")
def test_a_cache_warmed_through_an_endpoint_in_the_environment_never_serves_another_endpoint(
    twins: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, cache = f"s3://{twins['bucket']}/d.zarr", tmp_path / "cache"
    a, b = twins["a"], twins["b"]
    _env(monkeypatch, a)
    rows, _ = _read(open_store(url), cache_dir=cache, persist=True, check_store=False)
    np.testing.assert_array_equal(rows, _values(twins["local"][a]))
    _env(monkeypatch, b)
    # before: every chunk a hit, the first server's values delivered as the second's
    with pytest.raises(StaleCacheError, match="cached from another store"):
        _read(open_store(url), cache_dir=cache, readonly_cache=True, check_store=False)
    rows, stats = _read(open_store(url), cache_dir=cache, persist=True, check_store=False)
    np.testing.assert_array_equal(rows, _values(twins["local"][b]))
    assert (stats["hits"], stats["gets"]) == (0, 6)
    # the endpoint given as an option wins over the environment's, in obstore and here
    monkeypatch.setenv("AWS_ENDPOINT_URL", a)
    store = open_store(url, endpoint=b + "/", client_options={"allow_http": True})
    rows, stats = _read(store, cache_dir=cache, readonly_cache=True)
    np.testing.assert_array_equal(rows, _values(twins["local"][b]))
    assert (stats["hits"], stats["gets"]) == (6, 0)
    # one server under another host name is another store to the cache: fetched, never wrong
    rows, stats = _read(
        open_store(url, endpoint=b.replace("127.0.0.1", "localhost"),
                   client_options={"allow_http": True}),
        cache_dir=cache, persist=True,
    )  # fmt: skip
    np.testing.assert_array_equal(rows, _values(twins["local"][b]))
    assert (stats["hits"], stats["gets"]) == (0, 6)


@pytest.mark.xdist_group("s3")
def test_statistics_fitted_on_a_store_made_by_hand_are_refused_for_the_bucket_at_another_endpoint(
    twins: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    def made() -> ObjectStore:  # the endpoint from the environment: obstore's config lacks it
        return ObjectStore(S3Store(twins["bucket"], prefix="d.zarr"), read_only=True)

    _env(monkeypatch, twins["a"])
    path = _fit(made(), tmp_path / "stats.json")
    _env(monkeypatch, twins["b"])
    with pytest.raises(ValueError, match="fitted on another dataset: store"):
        Statistics.load(path, dataset={"store": made()})  # before: accepted
    _env(monkeypatch, twins["a"])
    fitted_on = Statistics.load(path, dataset={"store": made()}).dataset["store"]
    assert fitted_on.endswith(f"(endpoint {twins['a']})")


@pytest.mark.xdist_group("s3")
def test_an_fsspec_store_or_xarray_dataset_at_another_endpoint_is_another_store(
    twins: dict[str, Any], tmp_path: Path
) -> None:
    import xarray as xr
    from zarr.storage import FsspecStore

    url, a, b = f"s3://{twins['bucket']}/d.zarr", twins["a"], twins["b"]
    options = {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"region_name": S3_REGION}}

    def fs(endpoint: str) -> FsspecStore:
        return FsspecStore.from_url(
            url, read_only=True, storage_options={**options, "endpoint_url": endpoint}
        )

    cache = tmp_path / "cache"
    rows, _ = _read(fs(a), cache_dir=cache, persist=True, check_store=False)
    np.testing.assert_array_equal(rows, _values(twins["local"][a]))
    rows, stats = _read(fs(b), cache_dir=cache, persist=True, check_store=False)
    np.testing.assert_array_equal(rows, _values(twins["local"][b]))  # before: a's, 6 hits
    assert (stats["hits"], stats["gets"]) == (0, 6)
    rows, stats = _read(fs(b), cache_dir=cache, readonly_cache=True, check_store=False)
    assert (stats["hits"], stats["gets"]) == (6, 0)  # the same store opened again: shared
    # statistics: fitted through xarray at one endpoint, refused at the other
    opened = {
        e: xr.open_zarr(url, storage_options={**options, "endpoint_url": e}, consolidated=False)
        for e in (a, b)
    }
    path = _fit(opened[a], tmp_path / "stats.json")
    Statistics.load(path, dataset={"store": fs(a + "/")})  # (the endpoint's spelling: one store)
    for other in (opened[b], fs(b)):
        with pytest.raises(ValueError, match="fitted on another dataset: store"):
            Statistics.load(path, dataset={"store": other})  # before: accepted


def test_a_cache_of_one_folder_is_never_served_through_a_store_that_cannot_be_listed(
    tmp_path: Path,
) -> None:
    from zarr.storage import FsspecStore

    a, b = _write(tmp_path / "a.zarr", 1), _write(tmp_path / "b.zarr", 2)
    cache = tmp_path / "cache"
    _read(str(a), cache_dir=cache, persist=True)
    for store, want in ((b, b), (a, a)):  # fsspec over b: a's chunks; over a: the same folder
        fsspec = FsspecStore.from_url(str(store), read_only=True)
        rows, stats = _read(fsspec, cache_dir=cache, persist=True, check_store=False)
        np.testing.assert_array_equal(rows, _values(want))  # before: a's values as b's
    assert (stats["hits"], stats["gets"]) == (0, 6)  # a again: b's chunks were fetched last
    rows, stats = _read(FsspecStore.from_url(str(a), read_only=True), cache_dir=cache,
                        readonly_cache=True, check_store=False)  # fmt: skip
    assert (stats["hits"], stats["gets"]) == (6, 0)  # one folder through fsspec: shared
    # two stores that cannot be listed at all: one MemoryStore's chunks are not another's
    memory = {}
    for name in (a, b):
        memory[name] = zarr.storage.MemoryStore()
        zarr.create_array(memory[name], name="x", data=_values(name), chunks=(2, 3))
    rows, _ = _read(memory[a], cache_dir=tmp_path / "m", persist=True, check_store=False)
    with pytest.raises(StaleCacheError, match="cached from another store"):
        _read(memory[b], cache_dir=tmp_path / "m", readonly_cache=True, check_store=False)
    rows, stats = _read(memory[a], cache_dir=tmp_path / "m", readonly_cache=True, check_store=False)
    assert (stats["hits"], stats["gets"]) == (6, 0)


def test_one_folder_however_it_is_opened_shares_a_cache_and_a_twin_folder_never_does(
    tmp_path: Path,
) -> None:
    from obstore.store import LocalStore

    a = _write(tmp_path / "a.zarr", 1)
    twin = _write(tmp_path / "twin" / "a.zarr", 2)  # the same layout, other values
    cache = tmp_path / "cache"
    _read(a, cache_dir=cache, persist=True)
    for spelling in (
        str(a), a.as_uri() + "/", str(tmp_path / "." / "a.zarr"),
        zarr.storage.ObjectStore(LocalStore(a), read_only=True),
        zarr.storage.LocalStore(a, read_only=True),
    ):  # fmt: skip
        rows, stats = _read(spelling, cache_dir=cache, readonly_cache=True)
        assert (stats["hits"], stats["gets"]) == (6, 0), spelling
        np.testing.assert_array_equal(rows, _values(a))
    with pytest.raises(StaleCacheError, match="cached from another store"):
        _read(twin, cache_dir=cache, readonly_cache=True, check_store=False)


_PLACE_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "AWS_ENDPOINT_URL_S3",
    "GOOGLE_BASE_URL",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_ENDPOINT",
    "AZURE_STORAGE_ENDPOINT",
)


@pytest.mark.parametrize(
    ("scheme", "one", "other"),
    [
        ("s3", {"aws_endpoint_url_s3": "https://one.example"},
               {"aws_endpoint_url_s3": "https://two.example"}),
        ("gs", {"base_url": "https://one.example"}, {"base_url": "https://two.example"}),
        ("az", {"account_name": "one"}, {"account_name": "two"}),
    ],
)  # fmt: skip
def test_a_bucket_in_another_account_or_at_another_endpoint_given_any_way_is_another_store(
    scheme: str, one: dict[str, str], other: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from insitubatch_nodes.cache.identity import StoreCheck
    from insitubatch_nodes.io.stores import describe_store

    for var in _PLACE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    stores = [open_store(f"{scheme}://bucket/d.zarr", anonymous=True, **o) for o in (one, other)]
    names = [describe_store(s) for s in stores]
    assert names[0] != names[1], names  # before: one name
    assert StoreCheck(stores[0], {}).kind != StoreCheck(stores[1], {}).kind  # the cache's too
    # the same given through the environment (opened by hand: nothing passed)
    env = {"s3": "AWS_ENDPOINT_URL_S3", "gs": "GOOGLE_BASE_URL", "az": "AZURE_STORAGE_ACCOUNT_NAME"}
    monkeypatch.setenv(env[scheme], next(iter(other.values())))
    again = open_store(f"{scheme}://bucket/d.zarr", anonymous=True)
    assert describe_store(again) == names[1]
    assert StoreCheck(again, {}).kind == StoreCheck(stores[1], {}).kind


def test_a_local_read_failing_otherwise_than_with_an_oserror_is_a_counted_read_failure(
    tmp_path: Path,
) -> None:
    import os

    from insitubatch_nodes.errors import ChunkReadError

    a = _write(tmp_path / "a.zarr", 1)
    os.truncate(a / "x" / "c" / "1" / "0", 8 << 40)  # sparse: 8 TiB that no buffer can hold
    g = open_geometries(str(a), ["x"])["x"]
    manifest = split_by_chunk(g, (1, 0, 0))
    pipe = insitu_pipeline(str(a), manifest, {"x": g}, batch_size=4, on_bad_chunk="nan")
    with pipe:
        rows = np.concatenate([np.array(b["x"]) for b in Loader(pipe)])
        report = pipe.report()
    assert report is not None
    assert (report.gets, report.bad_chunks) == (6, 1)  # before: 5 GETs (the failed one lost)
    assert np.isnan(rows).sum() == 2 * 3
    pipe = insitu_pipeline(str(a), manifest, {"x": g}, batch_size=4)
    with pipe, pytest.raises(ChunkReadError, match=r"failed to read .* MemoryError") as err:
        list(Loader(pipe))
    assert "do not decode" not in str(err.value)  # before: "failed to decode", "do not decode"
