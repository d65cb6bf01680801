"""What the store-identity check costs a warm start (docs/caching.md, *Store identity*).

For ``N`` stored objects of one array (``shape (N,)``, one sample per chunk, one byte per
object: the check reads no data, so the objects' size does not matter), on a local folder and
in a bucket of a moto S3 server on loopback, this records every object's identity as a warming
run does (:class:`~insitubatch_nodes.cache.identity.IdentityRecorder`, one committed chunk at a
time: locally from each file's ``stat``, as the decode thread's ``fstat`` gives it; on S3 from
one listing's ``ObjectMeta``, the fields a GET's ``meta`` carries), then times
:meth:`StoreCheck.stale` — the listing of the array's prefix, reading the recorded rows, and
the vectorised comparison — over every cached chunk, ``--repeats`` times, and once more after
``--change`` objects were rewritten (which must all be found).

Over HTTP (nginx on loopback, which cannot list) the check is a HEAD request per recorded
object, 64 in flight (:class:`~insitubatch_nodes.cache.identity.HeadLister`); the identities are
recorded from one HEAD each (the fields a GET's ``meta`` carries). ``--epoch`` also times a warm
epoch of an ERA5-like store served by nginx through a persistent cache: building the pipeline
(which runs the check) and the epoch, with ``check_store=True`` and ``False``.

    python -m benchmarks.store_identity_check --objects 10000 100000 --stores local s3 http
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from insitubatch_nodes import open_store
from insitubatch_nodes.cache.identity import (
    IdentityRecorder,
    StoreCheck,
    meta_identity,
    read_identities,
    stat_identity,
)
from insitubatch_nodes.io.objects import head_objects
from insitubatch_nodes.testing import MotoServer, NginxServer


def _array(root: Path, n: int) -> None:
    zarr.create_array(root, name="a", shape=(n,), chunks=(1,), dtype="u1", fill_value=0)


def _record(cache: Path, kind: str, idents: dict[int, tuple[str, tuple[int, str, int]]]) -> None:
    rec = IdentityRecorder(cache, kind)
    for chunk, (key, ident) in idents.items():
        rec.expect(("a", chunk))
        rec.note("a", chunk, key, ident)
        rec.commit(("a", chunk))
    rec.close()


def _time_check(
    store: Any, cache: Path, n: int, repeats: int, keys: list[str] | None = None
) -> tuple[list[float], list[float], list[float]]:
    check = StoreCheck(store, {"a": 1}, name="bench")
    cached = {"a": {cache: np.arange(n)}}
    total, listing, rows = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = check.stale(cached)
        total.append(time.perf_counter() - t0)
        assert not report.chunks and report.unchecked is None, report.describe()
        assert not isinstance(check.lister, str)
        t0 = time.perf_counter()
        check.lister.list("a", keys or ())
        listing.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        read_identities(cache)
        rows.append(time.perf_counter() - t0)
    return total, listing, rows


def _stale_found(store: Any, cache: Path, n: int, changed: int) -> float:
    check = StoreCheck(store, {"a": 1}, name="bench")
    t0 = time.perf_counter()
    report = check.stale({"a": {cache: np.arange(n)}})
    elapsed = time.perf_counter() - t0
    assert len(report.chunks) == changed, (len(report.chunks), changed)
    return elapsed


def bench_local(n: int, repeats: int, change: int, work: Path) -> dict[str, Any]:
    root, cache = work / f"local-{n}.zarr", work / f"cache-local-{n}"
    cache.mkdir()
    _array(root, n)
    t0 = time.perf_counter()
    folder = root / "a" / "c"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        fd = os.open(folder / str(i), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"\x01")
        os.close(fd)
    made = time.perf_counter() - t0
    _record(
        cache, "local", {i: (f"a/c/{i}", stat_identity(os.stat(folder / str(i)))) for i in range(n)}
    )
    store = open_store(root)
    total, listing, rows = _time_check(store, cache, n, repeats)
    for i in range(0, n, max(1, n // change))[:change]:
        (folder / str(i)).write_bytes(b"\x02\x02")
    stale = _stale_found(store, cache, n, change)
    return _row("local", n, made, total, listing, rows, stale)


async def _put_all(inner: Any, n: int, concurrency: int = 64) -> None:
    import obstore

    sem = asyncio.Semaphore(concurrency)

    async def put(i: int) -> None:
        async with sem:
            await obstore.put_async(inner, f"a/c/{i}", b"\x01")

    await asyncio.gather(*(put(i) for i in range(n)))


def bench_s3(n: int, repeats: int, change: int, work: Path, moto: MotoServer) -> dict[str, Any]:
    import boto3
    import obstore

    bucket = f"identity-{n}"
    boto3.client(
        "s3",
        endpoint_url=moto.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=bucket)
    local = work / f"meta-{n}.zarr"
    _array(local, n)
    store = open_store(f"s3://{bucket}/data.zarr", read_only=False, **moto.options())
    inner = store.store  # type: ignore[attr-defined]
    obstore.put(inner, "zarr.json", (local / "zarr.json").read_bytes())
    obstore.put(inner, "a/zarr.json", (local / "a" / "zarr.json").read_bytes())
    t0 = time.perf_counter()
    asyncio.run(_put_all(inner, n))
    made = time.perf_counter() - t0
    cache = work / f"cache-s3-{n}"
    cache.mkdir()
    metas = [m for batch in obstore.list(inner, prefix="a/c/", chunk_size=1000) for m in batch]
    _record(
        cache,
        "obstore",
        {int(m["path"].rsplit("/", 1)[1]): (m["path"], meta_identity(m)) for m in metas},
    )
    total, listing, rows = _time_check(store, cache, n, repeats)
    for i in range(0, n, max(1, n // change))[:change]:
        obstore.put(inner, f"a/c/{i}", b"\x02\x02")
    stale = _stale_found(store, cache, n, change)
    return _row("s3 (moto)", n, made, total, listing, rows, stale)


def bench_http(n: int, repeats: int, change: int, work: Path) -> dict[str, Any]:
    www = work / f"www-{n}"
    root = www / "data.zarr"
    _array(root, n)
    folder = root / "a" / "c"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        (folder / str(i)).write_bytes(b"\x01")
    made = time.perf_counter() - t0
    with NginxServer(www) as server:
        store = open_store(f"{server.endpoint}/data.zarr")
        keys = [f"a/c/{i}" for i in range(n)]
        metas = head_objects(store, keys)
        cache = work / f"cache-http-{n}"
        cache.mkdir()
        _record(cache, "obstore", {i: (keys[i], meta_identity(metas[i])) for i in range(n)})
        total, listing, rows = _time_check(store, cache, n, repeats, keys)
        later = time.time() + 5  # a rewrite in a later second than the first write
        for i in range(0, n, max(1, n // change))[:change]:
            (folder / str(i)).write_bytes(b"\x02\x02")
            os.utime(folder / str(i), (later, later))
        stale = _stale_found(store, cache, n, change)
    return _row("http (nginx)", n, made, total, listing, rows, stale)


def bench_http_epoch(work: Path, repeats: int) -> list[dict[str, Any]]:
    """A warm epoch over nginx through a persistent cache, with and without the check."""
    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
    from insitubatch_nodes.synthetic import make_era5_like

    www = work / "www-epoch"
    make_era5_like(www / "era5.zarr", n_time=2048, samples_per_chunk=1)
    zarr.consolidate_metadata(www / "era5.zarr")
    out = []
    with NginxServer(www) as server:
        url = f"{server.endpoint}/era5.zarr"
        cache = work / "cache-epoch"

        def epoch(check: bool) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            store = open_store(url)
            geoms = open_geometries(store, ["t2m", "z"])
            pipe = insitu_pipeline(
                store, split_by_chunk(geoms["t2m"], (1.0, 0.0, 0.0)), ["t2m", "z"],
                batch_size=32, cache_dir=cache, persist=True, check_store=check,
            )  # fmt: skip
            built = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in pipe:
                pass
            gets = pipe.stats()["gets"]
            pipe.close()
            return built, time.perf_counter() - t0, gets

        epoch(True)  # the warming run
        for check in [True, False] * repeats:
            built, ran, gets = epoch(check)
            assert gets == 0, gets  # warm: every chunk from the cache
            out.append(
                {
                    "store": "http (nginx) warm epoch",
                    "objects": 2 * 2048,
                    "check_store": check,
                    "build_s": round(built, 3),
                    "epoch_s": round(ran, 3),
                }
            )
    return out


def _row(
    where: str,
    n: int,
    made: float,
    total: list[float],
    listing: list[float],
    rows: list[float],
    stale: float,
) -> dict[str, Any]:
    return {
        "store": where,
        "objects": n,
        "write_s": round(made, 2),
        "check_s_median": round(statistics.median(total), 3),
        "check_s_min": round(min(total), 3),
        "check_s_max": round(max(total), 3),
        "list_s_median": round(statistics.median(listing), 3),
        "read_rows_s_median": round(statistics.median(rows), 3),
        "check_with_changes_s": round(stale, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument(
        "--stores", nargs="+", default=["local", "s3"], choices=["local", "s3", "http"]
    )
    parser.add_argument("--epoch", action="store_true", help="time a warm epoch over nginx")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--change", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="identity-bench-") as tmp:
        work = Path(tmp)
        moto = MotoServer() if "s3" in args.stores else None
        try:
            for n in args.objects:
                if "local" in args.stores:
                    print(json.dumps(bench_local(n, args.repeats, args.change, work)), flush=True)
                if moto is not None:
                    print(
                        json.dumps(bench_s3(n, args.repeats, args.change, work, moto)), flush=True
                    )
                if "http" in args.stores:
                    print(json.dumps(bench_http(n, args.repeats, args.change, work)), flush=True)
            if args.epoch:
                for row in bench_http_epoch(work, args.repeats):
                    print(json.dumps(row), flush=True)
        finally:
            if moto is not None:
                moto.stop()


if __name__ == "__main__":
    main()
