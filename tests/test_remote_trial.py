"""The model-input features over remote stores, as a demanding forecaster uses them: what a
black-box trial against a moto S3 server (and nginx, by hand) found.

The store is ERA5-like and tiny, written with xarray: ``t (time, level, latitude, longitude)``
with its four levels whole in each stored object (one step per object), ``2t (time, latitude,
longitude)``, a static ``land_sea_mask (latitude, longitude)`` stored as two objects and a
static ``orography``, latitude north to south, 6-hourly times. It is uploaded once into a
bucket of the session's moto server and read through a :class:`FaultProxy` in front of it,
which counts every GET per object (and injects the faults); xarray's read of the local copy
is the oracle.

Found (now fixed), each with its test below:

- a static array whose object the bucket refused (403) raised a plain ``OSError`` — not the
  ``PermissionError`` a refused read raises everywhere else — whose message elided the middle
  of the advice (that S3 answers 403 for an absent object to credentials without
  ``s3:ListBucket``, what to do);
- a private bucket opened with ``anonymous=True`` (the docs' way to read a public one) raised
  obstore's raw ``PermissionDeniedError``, a 40-line debug dump with no advice, at the first
  read (``open_geometries``) and at a static field's read;
- a store opened with its endpoint under another of obstore's spellings (``endpoint_url=``,
  ``aws_endpoint=``, or ``AWS_ENDPOINT_URL`` in the environment) was named without it, so
  statistics fitted over one S3-compatible server were accepted by ``Statistics.load`` for the
  same bucket on another server, and refused for the very store they were fitted on opened with
  ``endpoint=``; an endpoint written with a trailing ``/`` was another store too, and a
  persistent cache warmed through ``endpoint=E`` was refused to a read-only reader at
  ``E + "/"`` (every chunk "cached from another store");
- an xarray ``Dataset`` opened with ``xr.open_zarr(url, storage_options={endpoint,
  credentials})`` and passed as the store was opened again from its URL alone, without them:
  "no credentials found" (suggesting ``anonymous=True``), or another server's bucket.

Tried and found right (kept as the claims below, or checked by hand and not kept):
``isel``/``sel`` of levels and a latitude/longitude box, stacks with static members and
forcings, windows and shifts, an anchor stride, every row equal to xarray's; each stored object
one GET in epoch 0 (the proxy's count, retries included only where faults were injected) and
none in epoch 1, the report's ``gets`` and the trace's ``GET`` spans equal to it; the pool
holding only the selection (levels and box) of each object, and ``bytes_delivered`` the bytes
of the batches; static fields read once per pipeline (``static_gets``, one GET per object),
served by the next pipeline and by a fresh process from the persistent cache with no GET;
transient 500/503s and a connection reset on a static object retried, the field exact; a 404
read as the fill value, as zarr does; a static object that keeps failing a ``TimeoutError``
naming the array and the store within ``RetryPolicy.timeout_s``; ``fit_statistics`` over S3
reading each object once, equal to numpy in float64 within 1e-6 (``diff_std`` included), and
``Statistics.load`` accepting the same store opened again, anonymously, or by hand as
``ObjectStore(S3Store(...))``; an anonymous store over a public bucket, with the report and
trace counts as above. Over nginx (by hand): stack, fit and a persistent cache read each object
once, the next run checks the cache with one HEAD per object and reads none.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from insitubatch_nodes import (
    Loader,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.statistics import Statistics, fit_statistics
from insitubatch_nodes.testing import FaultProxy

pytestmark = [pytest.mark.xdist_group("s3"), pytest.mark.timeout(90)]

N_TIME = 16
BOX = {"latitude": slice(40, -40), "longitude": slice(0, 180)}  # 3 x 5 points
NEVER = "\x00no key has this"


def _era5() -> xr.Dataset:
    rng = np.random.default_rng(0)
    lat = np.array([60.0, 30.0, 0.0, -30.0, -60.0, -75.0])
    shape = (N_TIME, 4, 6, 8)
    return xr.Dataset(
        {"t": (("time", "level", "latitude", "longitude"), rng.normal(250, 5, shape)),
         "2t": (("time", "latitude", "longitude"), rng.normal(280, 3, (N_TIME, 6, 8))),
         "land_sea_mask": (("latitude", "longitude"), (rng.random((6, 8)) > 0.5) * 1.0),
         "orography": (("latitude", "longitude"), rng.normal(500, 100, (6, 8)))},
        coords={"time": pd.date_range("2020-01-01", periods=N_TIME, freq="6h"),
                "level": [1000, 850, 500, 250], "latitude": lat,
                "longitude": np.arange(0.0, 360.0, 45.0)},
    ).astype("float32")  # fmt: skip


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, xr.Dataset]:
    ds = _era5()
    root = tmp_path_factory.mktemp("remote") / "era5.zarr"
    encoding = {"t": {"chunks": (1, 4, 6, 8)}, "2t": {"chunks": (1, 6, 8)},
                "land_sea_mask": {"chunks": (3, 8)}, "orography": {"chunks": (6, 8)}}  # fmt: skip
    ds.to_zarr(root, encoding=encoding, zarr_format=3, consolidated=False)
    return root, ds


@pytest.fixture(scope="module")
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    """A counting (and, when told, faulting) proxy in front of the session's moto server."""
    port = urlsplit(s3_server).port
    assert port is not None
    with FaultProxy(port, fail_first=0, match=NEVER) as counting:
        yield counting


@pytest.fixture(scope="module")
def remote(
    era5: tuple[Path, xr.Dataset], s3_upload: Any, s3_options: dict[str, Any], proxy: FaultProxy
) -> dict[str, Any]:
    """The store in a bucket: its URL and the options that read it through the proxy."""
    url = s3_upload(era5[0], "arch/era5.zarr")
    return {"url": url, "options": {**s3_options, "endpoint": f"http://127.0.0.1:{proxy.port}"}}


def _gets(proxy: FaultProxy, part: str = "/c/") -> dict[str, int]:
    """GETs the proxy saw per stored object of a data or static array (keys below
    ``era5.zarr/``; the coordinates left out) whose key has ``part``."""
    with proxy._lock:
        seen = dict(proxy.gets)
    keys = {k.split("era5.zarr/", 1)[1]: n for k, n in seen.items() if "era5.zarr/" in k}
    coords = ("time", "level", "latitude", "longitude")
    return {k: n for k, n in keys.items() if part in k and k.split("/")[0] not in coords}


def _clear(proxy: FaultProxy) -> None:
    with proxy._lock:
        proxy.gets.clear()
        proxy.injected = 0


@contextlib.contextmanager
def _faults(proxy: FaultProxy, match: str, n: int, status: int | str) -> Iterator[None]:
    """The first ``n`` GETs of each object whose key has ``match`` answered with ``status``
    (``"reset"``: a connection reset half-way through the body)."""
    with proxy._lock:
        proxy.match, proxy.fail_first = match, n
        proxy.reset = status == "reset"
        proxy.status = status if isinstance(status, int) else 503
    try:
        yield
    finally:
        with proxy._lock:
            proxy.match, proxy.fail_first, proxy.reset = NEVER, 0, False


def _store(remote: dict[str, Any], **changes: Any) -> Any:
    return open_store(remote["url"], **{**remote["options"], **changes})


# ---------------------------------------------------------------------------------------------
# Right: rows, GETs, bytes and counts
# ---------------------------------------------------------------------------------------------


def test_a_stack_of_levels_a_box_static_members_and_forcings_over_s3_is_xarrays_rows_with_one_get_per_object(  # noqa: E501
    era5: tuple[Path, xr.Dataset], remote: dict[str, Any], proxy: FaultProxy
) -> None:
    """Windows of ``t`` (two levels, a box) and ``2t`` (the box), the box of the land-sea
    mask, the whole orography and a solar forcing in one stack, a target two steps on, anchors
    every 2nd step: every row is xarray's; epoch 0 GETs each object once (as the report and the
    trace count them), epoch 1 none; the pool holds only the selection of each object."""
    _, ds = era5
    store = _store(remote)
    g = open_geometries(store)
    t, t2 = g["t"].sel(level=[850, 500], **BOX), g["2t"].sel(**BOX)
    x = stack({"t": t.window([-1, 0]), "2t": t2.window([-1, 0]),
               "lsm": g["land_sea_mask"].sel(**BOX), "oro": g["orography"].sel(**BOX),
               "sun": Forcings("x", view=t2, names=["cos_solar_zenith"])})  # fmt: skip
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    _clear(proxy)
    pipe = insitu_pipeline(store, manifest, {"x": x, "y": t2.shift(2)}, batch_size=3, stride=2,
                           fetch=FetchOptions(trace=True))  # fmt: skip
    static = _gets(proxy)
    assert static == {"land_sea_mask/c/0/0": 1, "land_sea_mask/c/1/0": 1, "orography/c/0/0": 1}
    assert pipe.stats()["static_gets"] == 3
    want_t = ds.t.sel(level=[850, 500], **BOX).values
    want_2t, box_of = ds["2t"].sel(**BOX).values, ds.sel(**BOX)
    try:
        for epoch in range(2):
            _clear(proxy)
            anchors, delivered = [], 0
            for batch in Loader(pipe):
                rows = batch.sample_indices["x"]
                anchors += rows[:, 1].tolist()
                got = batch["x"]  # (B, 2, C, 3, 5): t@850, t@500, 2t, lsm, oro, sun
                np.testing.assert_array_equal(got[:, :, :2], want_t[rows])
                np.testing.assert_array_equal(got[:, :, 2], want_2t[rows])
                np.testing.assert_array_equal(got[:, :, 3], np.broadcast_to(
                    box_of.land_sea_mask.values, got[:, :, 3].shape))  # fmt: skip
                np.testing.assert_array_equal(got[:, :, 4], np.broadcast_to(
                    box_of.orography.values, got[:, :, 4].shape))  # fmt: skip
                assert np.all(np.abs(got[:, :, 5]) <= 1.0)
                np.testing.assert_array_equal(batch["y"], want_2t[batch.sample_indices["y"]])
                np.testing.assert_array_equal(batch.sample_indices["y"], rows[:, 1] + 2)
                delivered += batch["x"].nbytes + batch["y"].nbytes
            assert sorted(anchors) == list(range(2, N_TIME - 2, 2))  # each once
            report = pipe.report()
            assert report is not None and report.bytes_delivered == delivered
            seen = _gets(proxy)
            if epoch == 0:  # each object of the steps the anchors read, once
                steps = {a + d for a in anchors for d in (-1, 0)}
                want = {f"t/c/{i}/0/0/0": 1 for i in steps}
                want |= {f"2t/c/{i}/0/0": 1 for i in steps | {a + 2 for a in anchors}}
                assert seen == want
                assert report.gets == len(want) == report.trace.counts()["GET"]
                n_t, n_2t = len(steps), len(want) - len(steps)  # the selections only:
                held = n_t * 2 * 15 * 4 + n_2t * 15 * 4  # two levels of 3 x 5, one of 3 x 5
                assert pipe.stats()["resident_bytes"] == held
            else:
                assert seen == {} and report.gets == 0
        assert pipe.stats()["static_gets"] == 3  # read once per pipeline, not per epoch
    finally:
        pipe.close()


def test_static_fields_are_read_once_and_the_next_pipeline_takes_them_from_the_persistent_cache(
    era5: tuple[Path, xr.Dataset], remote: dict[str, Any], proxy: FaultProxy, tmp_path: Path
) -> None:
    """With ``cache_dir=..., persist=True`` the first pipeline reads each static object once,
    over two epochs; the next one (the store opened again) reads none of them, nor a chunk."""
    _, ds = era5
    box = {"latitude": BOX["latitude"]}
    for run in range(2):
        store = _store(remote)
        g = open_geometries(store)
        x = stack({"t": g["t"].sel(level=[500], **box), "lsm": g["land_sea_mask"].sel(**box)})
        views = {"x": x, "oro": g["orography"]}
        _clear(proxy)
        pipe = insitu_pipeline(store, split_by_chunk(g["t"], (1.0, 0.0, 0.0)), views,
                               batch_size=4, cache_dir=tmp_path, persist=True)  # fmt: skip
        try:
            for _ in range(2):
                for batch in Loader(pipe):
                    np.testing.assert_array_equal(batch["x"][:, 1], np.broadcast_to(
                        ds.land_sea_mask.sel(**box).values, batch["x"][:, 1].shape))  # fmt: skip
                    np.testing.assert_array_equal(batch["oro"][0], ds.orography.values)
            statics = {k: n for k, n in _gets(proxy).items() if "t/" not in k}
            stats = pipe.stats()
        finally:
            pipe.close()
        if run == 0:
            assert statics == {"land_sea_mask/c/0/0": 1, "land_sea_mask/c/1/0": 1,
                               "orography/c/0/0": 1}  # fmt: skip
            assert (stats["static_gets"], stats["static_disk_hits"]) == (3, 0)
        else:
            assert statics == {}
            assert not any(k.startswith(("t/", "2t/")) for k in _gets(proxy))
            assert (stats["static_gets"], stats["static_disk_hits"]) == (0, 2)


@pytest.mark.parametrize("fault", [503, 500, "reset"])
def test_a_static_object_that_fails_transiently_is_retried_and_read_exactly(
    era5: tuple[Path, xr.Dataset], remote: dict[str, Any], proxy: FaultProxy, fault: int | str
) -> None:
    _, ds = era5
    store = _store(remote)
    g = open_geometries(store)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    _clear(proxy)
    with _faults(proxy, "land_sea_mask/c/1/0", 1 if fault == "reset" else 2, fault):
        pipe = insitu_pipeline(store, manifest, {"x": g["2t"], "lsm": g["land_sea_mask"]},
                               batch_size=4)  # fmt: skip
    try:
        batch = next(iter(pipe))
        np.testing.assert_array_equal(batch["lsm"][0], ds.land_sea_mask.values)
        assert pipe.stats()["static_gets"] == 2
        assert _gets(proxy, "land_sea_mask/c/") == {
            "land_sea_mask/c/0/0": 1,
            "land_sea_mask/c/1/0": 2 if fault == "reset" else 3,
        }
    finally:
        pipe.close()


def test_fit_statistics_over_s3_reads_each_object_once_and_equals_numpy_in_float64(
    era5: tuple[Path, xr.Dataset], remote: dict[str, Any], proxy: FaultProxy, tmp_path: Path
) -> None:
    """The stack's members as anemoi selects them (two levels, a box, the mask's box): each
    object of the split read once; mean, std, min, max and diff_std equal numpy's float64
    within 1e-6; saved, then loaded against the store opened again or anonymously."""
    _, ds = era5
    store = _store(remote)
    g = open_geometries(store)
    manifest = split_by_chunk(g["t"], (0.5, 0.5, 0.0), seed=3)
    members = {"t": g["t"].sel(level=[850, 500], **BOX), "2t": g["2t"].sel(**BOX),
               "lsm": g["land_sea_mask"].sel(**BOX)}  # fmt: skip
    _clear(proxy)
    stats = fit_statistics(store, manifest, members, batch_size=3)
    samples = np.asarray(manifest.samples("train"))
    want_gets = {f"t/c/{i}/0/0/0": 1 for i in samples} | {f"2t/c/{i}/0/0": 1 for i in samples}
    want_gets |= {"land_sea_mask/c/0/0": 1, "land_sea_mask/c/1/0": 1}
    assert _gets(proxy) == want_gets
    box = ds.sel(**BOX).astype("float64")
    t = box.t.sel(level=[850, 500]).values[samples]
    t2 = box["2t"].values[samples]
    for got, want in ((stats.mean["t"], t.mean(axis=(0, 2, 3))), (stats.std["t"],
                      t.std(axis=(0, 2, 3))), (stats.mean["2t"], t2.mean()),
                      (stats.std["2t"], t2.std()), (stats.min["t"], t.min(axis=(0, 2, 3))),
                      (stats.max["2t"], t2.max()), (stats.mean["lsm"],
                      box.land_sea_mask.values.mean()), (stats.std["lsm"],
                      box.land_sea_mask.values.std())):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-6)
    after = [i for i in samples if i + 1 in set(samples.tolist())]
    steps = np.stack([box["2t"].values[i + 1] - box["2t"].values[i] for i in after])
    np.testing.assert_allclose(stats.diff_std["2t"], steps.std(), rtol=1e-6)
    path = tmp_path / "stats.json"
    stats.save(path)
    anonymous = {k: v for k, v in remote["options"].items()
                 if k not in ("access_key_id", "secret_access_key")}  # fmt: skip
    for same in (_store(remote), open_store(remote["url"], anonymous=True, **anonymous)):
        Statistics.load(path, dataset={"store": same, "manifest": manifest, "views": members})


# ---------------------------------------------------------------------------------------------
# Found: errors of refused reads
# ---------------------------------------------------------------------------------------------


def test_a_static_object_the_bucket_refuses_is_a_permission_error_naming_the_array_store_and_fix(
    remote: dict[str, Any], proxy: FaultProxy
) -> None:
    """A 403 on one of the land-sea mask's objects (credentials that may not read it, or an
    absent object to credentials without ``s3:ListBucket``) raises, when the pipeline is
    built, a ``PermissionError`` as a refused chunk's read does, naming the static array and
    the store and giving the whole advice (before: a plain ``OSError``, its advice cut in the
    middle, the ``s3:ListBucket`` part gone)."""
    store = _store(remote)
    g = open_geometries(store)
    manifest = split_by_chunk(g["t"], (1.0, 0.0, 0.0))
    with _faults(proxy, "land_sea_mask/c/1/0", 10**6, 403), pytest.raises(PermissionError) as err:
        insitu_pipeline(store, manifest, {"x": g["2t"], "lsm": g["land_sea_mask"]}, batch_size=4)
    text = str(err.value)
    assert "static array 'land_sea_mask'" in text and remote["url"] in text, text
    assert "s3:ListBucket" in text and "anonymous=True" in text and " ... " not in text, text


def test_a_private_bucket_opened_anonymously_says_it_is_not_public_and_to_give_credentials(
    remote: dict[str, Any],
) -> None:
    """``anonymous=True`` over a bucket that is not public: the first read (finding the
    arrays) and a static field's read raise a ``PermissionError`` that says the unsigned
    request was refused and to pass credentials, naming the store (before: obstore's
    ``PermissionDeniedError`` with its debug dump, no advice)."""
    options = {k: v for k, v in remote["options"].items()
               if k not in ("access_key_id", "secret_access_key")}  # fmt: skip
    store = open_store(remote["url"], anonymous=True, **options)
    with pytest.raises(PermissionError) as err:
        open_geometries(store)
    text = str(err.value)
    assert remote["url"] in text and "anonymous=True" in text and "credentials" in text, text
    assert "not public" in text and "Debug source" not in text, text
    signed = open_geometries(_store(remote))  # the geometries, read with credentials
    manifest = split_by_chunk(signed["t"], (1.0, 0.0, 0.0))
    with pytest.raises(PermissionError, match="not public"):
        insitu_pipeline(store, manifest, {"x": signed["2t"], "lsm": signed["land_sea_mask"]},
                        batch_size=4)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Found: the store a fit names
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["endpoint_url", "aws_endpoint", "trailing slash", "env"])
def test_statistics_name_the_endpoint_however_it_was_given_and_refuse_another_server(
    remote: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """Statistics fitted over a store whose endpoint was given another way than ``endpoint=``
    (another of obstore's names for it, a trailing ``/``, the environment) are accepted for the
    store opened with ``endpoint=`` and refused for the same bucket and prefix on another
    server (before: the endpoint was left out of the store's name, so the reverse held)."""
    options = dict(remote["options"])
    endpoint = options.pop("endpoint")
    if spelling == "env":
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        fitted_on = open_store(remote["url"], **options)
    elif spelling == "trailing slash":
        fitted_on = open_store(remote["url"], endpoint=endpoint + "/", **options)
    else:
        fitted_on = open_store(remote["url"], **{spelling: endpoint}, **options)
    g = open_geometries(fitted_on, ["2t"])
    manifest = split_by_chunk(g["2t"], (0.25, 0.75, 0.0))
    stats = fit_statistics(fitted_on, manifest, {"2t": g["2t"]})
    assert endpoint in stats.dataset["store"], stats.dataset["store"]
    path = tmp_path / "stats.json"
    stats.save(path)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    Statistics.load(
        path, dataset={"store": open_store(remote["url"], endpoint=endpoint, **options)}
    )
    elsewhere = open_store(remote["url"], endpoint="http://127.0.0.1:9", **options)
    with pytest.raises(ValueError, match="another dataset"):
        Statistics.load(path, dataset={"store": elsewhere})
    assert os.environ.get("AWS_ENDPOINT_URL") is None


def test_a_persistent_cache_serves_its_store_opened_with_the_endpoint_spelled_with_a_slash(
    era5: tuple[Path, xr.Dataset], remote: dict[str, Any], proxy: FaultProxy, tmp_path: Path
) -> None:
    """A cache warmed through ``endpoint=E`` serves, read-only, the store opened with
    ``endpoint=E + "/"`` (the same server) with no GET (before: ``StaleCacheError``, every
    chunk "cached from another store", naming the store as opened at ``E``)."""
    _, ds = era5
    endpoint = remote["options"]["endpoint"]
    for run, spelled in enumerate((endpoint, endpoint + "/")):
        store = _store(remote, endpoint=spelled)
        g = open_geometries(store, ["2t"])
        _clear(proxy)
        pipe = insitu_pipeline(store, split_by_chunk(g["2t"], (0.5, 0.5, 0.0)), {"x": g["2t"]},
                               batch_size=4, cache_dir=tmp_path, persist=run == 0,
                               readonly_cache=run == 1)  # fmt: skip
        try:
            for batch in Loader(pipe):
                np.testing.assert_array_equal(
                    batch["x"], ds["2t"].values[batch.sample_indices["x"]]
                )
            hits = pipe.stats()["disk_hits"]
        finally:
            pipe.close()
    assert _gets(proxy) == {} and hits == N_TIME // 2


# ---------------------------------------------------------------------------------------------
# Found: a Dataset opened with storage_options
# ---------------------------------------------------------------------------------------------


def test_a_dataset_opened_from_s3_with_storage_options_is_read_from_its_own_store(
    era5: tuple[Path, xr.Dataset], remote: dict[str, Any], proxy: FaultProxy
) -> None:
    """``xr.open_zarr(url, storage_options={endpoint, credentials})`` passed as the store stands
    for the store it reads, the endpoint and credentials included: the arrays are found and the
    rows are xarray's, read through the proxy (before: the URL alone was opened again, without
    the options, and failed with "no credentials found", suggesting ``anonymous=True``; with
    credentials in the environment it would have read AWS's bucket of that name)."""
    pytest.importorskip("s3fs")
    _, ds = era5
    options = remote["options"]
    client = {"endpoint_url": options["endpoint"], "region_name": options["region"]}
    storage = {"key": options["access_key_id"], "secret": options["secret_access_key"],
               "client_kwargs": client}  # fmt: skip
    opened = xr.open_zarr(remote["url"], storage_options=storage, consolidated=False)
    g = open_geometries(opened)
    assert {"t", "2t", "land_sea_mask"} <= set(g)
    _clear(proxy)
    views = {"x": g["t"].sel(level=500), "lsm": g["land_sea_mask"]}
    pipe = insitu_pipeline(opened, split_by_chunk(g["t"], (0.25, 0.75, 0.0)), views, batch_size=2)
    try:
        for batch in Loader(pipe):
            want = ds.t.sel(level=500).values[batch.sample_indices["x"]]
            np.testing.assert_array_equal(batch["x"], want)
            np.testing.assert_array_equal(batch["lsm"][0], ds.land_sea_mask.values)
    finally:
        pipe.close()
    assert _gets(proxy, "t/c/")  # through the endpoint the Dataset was opened with
