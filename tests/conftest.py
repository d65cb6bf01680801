"""Shared fixtures: small real zarr stores on disk, and a moto S3 server.

Every store is written with zarr itself (not with the package under test), so the tests can use
zarr as the oracle for shapes, chunk grids, chunk files and values. Data are seeded random values
that never equal the fill value, so every chunk is really stored on disk.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zarr

# One compute thread per process (torch's OpenMP pool, OpenBLAS), in the test processes and in
# every process they start (the fork server and subprocesses inherit the variable). The suite
# runs three xdist workers on CI's two cores, each with its own child processes: a pool of one
# thread per core in each of them oversubscribes the cores, and its threads spin waiting for
# work between small tensor operations (two recipe runs: 15.7 CPU-s with the default pools,
# 8.6 s with one thread). No test's claim is about intra-op parallelism. Set before torch is
# imported (at collection), where the pool size is read; OMP_NUM_THREADS set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (by a plugin): size the pool directly
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# ---------------------------------------------------------------------------------------------
# Order: the end-to-end tests first
# ---------------------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook, which names the group first
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests marked ``slow`` (the long end-to-end ones) first, each file's in their
    order, so that under ``-n 2`` the last minutes go to short tests that keep both workers
    busy to the end, instead of one worker finishing a long test alone.

    Under ``--dist loadgroup``, also put each ``xdist_group`` mark's name into the test's node
    id, as pytest-xdist does: pytest-xdist 3.8 writes ``item._nodeid``, which pytest 9 no
    longer reads (a node id is ``item._id`` there), so its groups were silently not formed and a
    group's tests ran on both workers, each paying the group's fixtures (a moto server, uploads,
    a Lightning reference run)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}
        )  # fmt: skip
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config: pytest.Config) -> None:
    """Give SIGINT Python's ``KeyboardInterrupt`` where the process started with it ignored:
    a run started in the background of a shell (``make test &``, ``nohup``; each xdist worker
    inherits it) ignores SIGINT from the start, in Python too, and ``_thread.interrupt_main()``
    then does nothing, so the Ctrl-C tests waited out their deadlines and failed (two of them
    in a background ``make test``, none in the foreground). Handled as a foreground run's, it
    also reaches the child processes the tests start as the default action, not ignored."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note this process's CPU at the end of collection (for the CPU log: see
    :func:`pytest_unconfigure`), then freeze what collection left in the heap (pytest's items,
    the test modules, torch, zarr, Lightning): every full garbage collection in a test
    process, automatic or explicit (tests call ``gc.collect()``; so does the package where a
    dropped pipeline may hold a cache lock), walked all of it again, 0.1-0.3 s each. Frozen
    objects are left out of collections (``gc.freeze``), as the fork server does with what it
    imported; everything a test makes, fixtures included, is made after this and is collected
    as before."""
    _process_cpu["collected"] = _cpu_now()
    _freeze_heap()


_process_cpu: dict[str, tuple[float, float]] = {}


def _cpu_now() -> tuple[float, float]:
    """This process's CPU seconds (user + system) and its reaped children's, so far."""
    import resource

    own, reaped = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


def pytest_unconfigure(config: pytest.Config) -> None:
    """Under ``INSITUBATCH_TESTS_CPU_LOG=FILE``, append this pytest process's CPU to FILE: the
    controller's (``-n``: it collects nothing, and its reaped children are the workers and all
    they reaped) or a worker's, with its CPU up to the end of collection. With the tests' own
    lines (which name their worker), ``tests/cpu_log.py`` tells what no test accounts for:
    start-up and collection, xdist's traffic, the session's teardown."""
    log = os.environ.get("INSITUBATCH_TESTS_CPU_LOG")
    if not log:
        return
    import json

    own, reaped = _cpu_now()
    record = {
        "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "pid": os.getpid(),
        "own": round(own, 3),
        "reaped": round(reaped, 3),
        "collected": [round(v, 3) for v in _process_cpu.get("collected", (0.0, 0.0))],
    }
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under ``INSITUBATCH_TESTS_CPU_LOG=FILE`` (see ``tests/forkserver.py``), append each
    test's CPU seconds to FILE: the test process's own and its children's that it reaped
    during the test (fresh interpreters, moto servers it stopped; not the fork server's
    children, which the server logs itself), and which process ran it (``gw0``..., ``main``).
    The teardown of the session's fixtures, which a process's last test ends, is a line of its
    own (``(session teardown)``), not that test's."""
    log = os.environ.get("INSITUBATCH_TESTS_CPU_LOG")
    if not log:
        yield
        return
    import json

    (own, reaped), start = _cpu_now(), time.time()
    _last_teardown.clear()
    yield
    (now_own, now_reaped), process = _cpu_now(), os.environ.get("PYTEST_XDIST_WORKER", "main")
    ended = {k: _last_teardown.get(k, 0.0) for k in ("own", "reaped")}
    records = [
        {
            "test": item.nodeid,
            "process": process,
            "own": round(now_own - own - ended["own"], 3),
            "reaped": round(now_reaped - reaped - ended["reaped"], 3),
            "wall": round(time.time() - start, 3),
        }
    ]
    if _last_teardown:
        records.append({"test": "(session teardown)", "process": process, **ended})
    with open(log, "a") as f:
        f.write("".join(json.dumps(record) + "\n" for record in records))


# The CPU of the last test's teardown, which ends the session's fixtures (a moto server it
# reaps, 19 CPU-s in a whole run's), kept out of that test's line in the CPU log.
_last_teardown: dict[str, float] = {}


_frozen_at = {"modules": 0, "thawed": False}


def _freeze_heap() -> None:
    import gc

    gc.collect()
    gc.freeze()
    _frozen_at.update(modules=len(sys.modules), thawed=False)


def _note_thaws() -> None:
    """Have ``gc.unfreeze`` note that it thawed the heap (mypy's API calls it), so that the
    teardown hook below need not ask ``gc.get_freeze_count()``: Python 3.11 counts the frozen
    objects one by one, 40 ms for the 0.44 million of torch, zarr, Lightning and xarray (cache
    misses on each), and it was asked wherever a worker's next test is in another module or not
    yet sent: 169 times, 7.0 CPU-s, in the suite's 40 cheapest files under ``-n 3``, which took
    41.9 CPU-s without it against 46.6 and 51.5 (2026-12-07)."""
    import gc

    unfreeze = gc.unfreeze
    if getattr(unfreeze, "notes_thaws", False):
        return

    def noting_unfreeze() -> None:
        _frozen_at["thawed"] = True
        unfreeze()

    noting_unfreeze.notes_thaws = True  # type: ignore[attr-defined]
    gc.unfreeze = noting_unfreeze


_note_thaws()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Freeze the heap again where a test module's last test is torn down (its module's
    fixtures finalized: only session-long objects are alive) if tests grew it with imports
    (Lightning, xarray, ome-zarr, mypy: imported by the tests that use them, not at
    collection) or thawed it (mypy's API calls ``gc.unfreeze()``). Unfrozen, each full
    collection of the worker walked them: 0.6 s each on a heap of 0.67 and 1.6 million
    objects (one worker thawed by mypy), 21-24 s of collections in each of two workers in one
    run of the suite against 8 s in the third (2026-12-07).

    Also if the module left many objects alive without importing anything (more than
    ``UNFROZEN_MAX`` outside the frozen heap; counting them costs a fraction of a millisecond
    where few are): a cache of session lifetime (test_layout's parse of the package, 0.19
    million objects) was walked by every later full collection of the process, and the
    package collects garbage where a cache lock may be held by a dropped pipeline: in a serial
    run, test_lifecycle_trial took 11.2 CPU-s after test_layout against 2.9 s alone, 5.3 s of
    it in 60 collections of one test (2026-12-07)."""
    import gc

    if nextitem is None and os.environ.get("INSITUBATCH_TESTS_CPU_LOG"):
        own, reaped = _cpu_now()
        yield
        now_own, now_reaped = _cpu_now()
        _last_teardown.update(own=now_own - own, reaped=now_reaped - reaped)
    else:
        yield
    if nextitem is not None and getattr(nextitem, "module", None) is getattr(item, "module", 0):
        return
    imported = len(sys.modules) >= _frozen_at["modules"] + 20
    if imported or _frozen_at["thawed"] or len(gc.get_objects()) > UNFROZEN_MAX:
        _freeze_heap()


UNFROZEN_MAX = 50_000  # objects a module may leave outside the frozen heap (see above)


@pytest.fixture(autouse=True)
def _sigint_handler_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """Give SIGINT's handler back as each test found it, and say which test changed it.

    A handler left behind leaks into every later test of the worker, and a ``SIG_IGN`` into
    every child process it starts: a child that inherits an ignored SIGINT never installs
    Python's ``KeyboardInterrupt``, so a Ctrl-C test's child sleeps through its Ctrl-C
    (Lightning, for one, sets ``SIG_IGN`` for good when a fit is interrupted)."""
    import signal
    import warnings

    # Ignored at the C level while Python holds a handler: a library's thread did it outside
    # any test. (A run started in the background of a shell ignores SIGINT from the start, in
    # Python too: pytest_configure gives it Python's handler.)
    if _sigint_ignored_in_c() and signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, None):
        signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))
        warnings.warn(
            f"SIGINT was ignored at the C level before {request.node.nodeid}: handler reinstalled",
            stacklevel=1,
        )
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if (after is not before and after != before) or (
        _sigint_ignored_in_c() and after not in (signal.SIG_IGN, None)
    ):
        # (a C library's sigaction is not seen by getsignal, only in /proc)
        signal.signal(signal.SIGINT, before)
        warnings.warn(
            f"{request.node.nodeid} left SIGINT's handler as {after!r}"
            f"{' (ignored at the C level)' if after == before else ''}: restored to {before!r}",
            stacklevel=1,
        )


def _sigint_ignored_in_c() -> bool:
    """Whether this process ignores SIGINT (``SIG_IGN`` in its ``/proc`` status; False where
    there is none), whatever Python's ``signal.getsignal`` says."""
    try:
        with open("/proc/self/status") as f:
            ignored = next(line for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(ignored.split()[1], 16) & 0x2)  # SIGINT is signal 2: bit 1


# ---------------------------------------------------------------------------------------------
# Layout constants the tests refer to (the one place the fixture shapes are written down).
# ---------------------------------------------------------------------------------------------

ERA5_TIME, ERA5_LAT, ERA5_LON, ERA5_LEVEL = 40, 4, 6, 3
ERA5_T2M_CHUNKS = (4, ERA5_LAT, ERA5_LON)  # 10 chunks along time, one tile
ERA5_Z_CHUNKS = (4, 1, 2, 3)  # inner-chunked: 3 x 2 x 2 tiles per time chunk

SHARDED_SHAPE, SHARDED_CHUNKS, SHARDED_SHARDS = (24, 8, 6), (2, 4, 3), (8, 8, 6)

TILED_SHAPE, TILED_CHUNKS = (12, 10, 7), (3, 4, 3)  # partial tiles on both field axes

PARTIAL_SHAPE, PARTIAL_CHUNKS = (43, 3), (4, 3)  # 11 chunks, the last one holds 3 samples

BIG_SHAPE, BIG_CHUNKS = (32768, 2), (16, 2)  # metadata only: a large anchor grid for plans

MICRO_SHAPE = (2, 2, 24, 8, 8)  # (T, C, Z, Y, X); the sample axis is Z (axis 2)
MICRO_IMAGE_CHUNKS = (1, 2, 2, 8, 8)  # 12 chunks along Z
MICRO_MASK_CHUNKS = (2, 1, 6, 4, 4)  # 4 chunks along Z, 2 x 2 tiles in (Y, X)


@pytest.fixture(scope="session")
def layout() -> SimpleNamespace:
    """The layout constants above, for tests (import-free: ``layout.ERA5_TIME``)."""
    return SimpleNamespace(
        **{k: v for k, v in globals().items() if k.isupper() and not k.startswith("S3_")}
    )


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Seeded values that are never 0 (the fill value), so every chunk is written."""
    if np.dtype(dtype).kind == "f":
        return (rng.random(shape) + 1.0).astype(dtype)
    return rng.integers(1, 200, size=shape).astype(dtype)


def _write_era5(root: Path, zarr_format: int) -> Path:
    """An ERA5-like group with coordinates, a grid mapping and data arrays."""
    rng = np.random.default_rng(1000 + zarr_format)
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)

    def create(name: str, data: np.ndarray, chunks: tuple[int, ...], dims: list[str]) -> None:
        kwargs: dict[str, object] = {}
        if zarr_format == 3:
            kwargs["dimension_names"] = dims
        else:
            kwargs["attributes"] = {"_ARRAY_DIMENSIONS": dims}
        arr = group.create_array(
            name, shape=data.shape, chunks=chunks, dtype=data.dtype, fill_value=0, **kwargs
        )
        arr[...] = data

    create("time", np.arange(ERA5_TIME, dtype="i8") * 6 + 1, (ERA5_TIME,), ["time"])
    create("lat", np.linspace(-80, 80, ERA5_LAT).astype("f4"), (ERA5_LAT,), ["lat"])
    create("lon", np.arange(1, ERA5_LON + 1, dtype="f4") * 60, (ERA5_LON,), ["lon"])
    create("level", np.array([1000, 850, 500], dtype="i4"), (ERA5_LEVEL,), ["level"])
    create(
        "t2m",
        _random(rng, (ERA5_TIME, ERA5_LAT, ERA5_LON), "f4"),
        ERA5_T2M_CHUNKS,
        ["time", "lat", "lon"],
    )
    create(
        "z",
        _random(rng, (ERA5_TIME, ERA5_LEVEL, ERA5_LAT, ERA5_LON), "f4"),
        ERA5_Z_CHUNKS,
        ["time", "level", "lat", "lon"],
    )
    # A 1-D series along time that is *not* a coordinate (its name is not its dimension's).
    create("station_t2m", _random(rng, (ERA5_TIME,), "f4"), (8,), ["time"])
    # A 0-D grid mapping.
    crs = group.create_array("crs", shape=(), dtype="i4", fill_value=0)
    crs[()] = 4326
    crs.attrs["grid_mapping_name"] = "latitude_longitude"
    return root


@pytest.fixture(scope="session")
def era5_v3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zarr v3 group: coordinates ``time``/``lat``/``lon``/``level`` (self-named, with
    ``dimension_names``), a 0-D ``crs``, data ``t2m (time, lat, lon)``, an inner-chunked
    ``z (time, level, lat, lon)`` and a non-coordinate 1-D series ``station_t2m (time)``."""
    return _write_era5(tmp_path_factory.mktemp("era5_v3") / "era5.zarr", 3)


@pytest.fixture(scope="session")
def era5_v2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same group as :func:`era5_v3_path` in zarr v2, dimension names in xarray's
    ``_ARRAY_DIMENSIONS`` attribute."""
    return _write_era5(tmp_path_factory.mktemp("era5_v2") / "era5.zarr", 2)


@pytest.fixture(scope="session")
def layouts_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zarr v3 group of single-array layouts:

    * ``sharded`` — sharded (stored object = shard ``SHARDED_SHARDS``, inner chunk
      ``SHARDED_CHUNKS``);
    * ``tiled`` — chunked along the field axes too, with partial tiles;
    * ``partial`` — a partial final chunk along the sample axis;
    * ``nested/inner`` — an array in a sub-group;
    * ``big`` — a large array with only metadata written (for plans over many chunks).
    """
    root = tmp_path_factory.mktemp("layouts") / "layouts.zarr"
    rng = np.random.default_rng(7)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    sharded = group.create_array(
        "sharded",
        shape=SHARDED_SHAPE,
        chunks=SHARDED_CHUNKS,
        shards=SHARDED_SHARDS,
        dtype="f4",
        fill_value=0,
    )
    sharded[...] = _random(rng, SHARDED_SHAPE, "f4")
    tiled = group.create_array(
        "tiled", shape=TILED_SHAPE, chunks=TILED_CHUNKS, dtype="i2", fill_value=0
    )
    tiled[...] = _random(rng, TILED_SHAPE, "i2")
    partial = group.create_array(
        "partial", shape=PARTIAL_SHAPE, chunks=PARTIAL_CHUNKS, dtype="f8", fill_value=0
    )
    partial[...] = _random(rng, PARTIAL_SHAPE, "f8")
    nested = group.create_group("nested").create_array(
        "inner", shape=(10, 2), chunks=(5, 2), dtype="u1", fill_value=0
    )
    nested[...] = _random(rng, (10, 2), "u1")
    group.create_array("big", shape=BIG_SHAPE, chunks=BIG_CHUNKS, dtype="f4", fill_value=0)
    return root


@pytest.fixture(scope="session")
def microscopy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zarr v3 microscopy-like group: ``image (t, c, z, y, x)`` chunked 2 along Z and a label
    ``mask (t, c, z, y, x)`` (one channel) chunked 6 along Z and tiled in (Y, X)."""
    root = tmp_path_factory.mktemp("microscopy") / "micro.zarr"
    rng = np.random.default_rng(11)
    group = zarr.open_group(root, mode="w", zarr_format=3)
    dims = ["t", "c", "z", "y", "x"]
    image = group.create_array(
        "image",
        shape=MICRO_SHAPE,
        chunks=MICRO_IMAGE_CHUNKS,
        dtype="u2",
        fill_value=0,
        dimension_names=dims,
    )
    image[...] = _random(rng, MICRO_SHAPE, "u2")
    mask_shape = (MICRO_SHAPE[0], 1, *MICRO_SHAPE[2:])
    mask = group.create_array(
        "mask",
        shape=mask_shape,
        chunks=MICRO_MASK_CHUNKS,
        dtype="u1",
        fill_value=0,
        dimension_names=dims,
    )
    mask[...] = _random(rng, mask_shape, "u1")
    return root


# ---------------------------------------------------------------------------------------------
# S3 (moto server)
# ---------------------------------------------------------------------------------------------

S3_REGION = "us-east-1"
S3_KEY = "testing"
S3_SECRET = "testing"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """A moto S3 server on a free local port, its log in ``log_dir``; yields its endpoint URL
    (skips the test where moto's server is not installed). Each is a store of its own: two
    servers hold buckets of the same name apart."""
    from insitubatch_nodes.testing import moto_server_argv

    port = _free_port()
    try:
        argv = moto_server_argv(port)
    except FileNotFoundError as err:
        pytest.skip(f"{err}")
    endpoint = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"moto_server_{port}.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 30.0
        while not _answers_http(endpoint):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with code {proc.returncode}: {log_path.read_text()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer at {endpoint} within 30 s")
            time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on a free local port; yields its endpoint URL.

    Tests using it should be marked ``@pytest.mark.xdist_group("s3")`` so that under
    ``pytest -n N --dist loadgroup`` they share one worker (and one server).
    """
    with moto_server(tmp_path_factory.mktemp("moto")) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def s3_options(s3_server: str) -> dict[str, object]:
    """Options for ``open_store("s3://...", **s3_options)`` against the moto server."""
    return {
        "endpoint": s3_server,
        "region": S3_REGION,
        "access_key_id": S3_KEY,
        "secret_access_key": S3_SECRET,
        "client_options": {"allow_http": True},
    }


@pytest.fixture(scope="session")
def s3_client(s3_server: str) -> Any:
    """A boto3 S3 client of the moto server: to put or change objects behind a store's back."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name=S3_REGION,
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
    )


@pytest.fixture(scope="session")
def s3_upload(s3_client: Any, s3_options: dict[str, Any]) -> Callable[[Path, str], str]:
    """``upload(local_folder, prefix) -> "s3://bucket/prefix"``: creates a fresh bucket and puts
    every file under ``local_folder`` at ``prefix/<relative path>``.

    The objects are put with obstore (``testing.put_folder``: a plain PUT of the file's bytes,
    the same key, bytes and ETag as boto3's ``put_object``): 228 objects took 1.1 CPU-seconds
    with boto3 (0.43 s in the client, which also signs and checksums each body, 0.70 s in moto)
    and 0.6 s with obstore (0.07 s and 0.51 s), and the tests upload thousands."""
    from obstore.store import S3Store

    from insitubatch_nodes.testing import put_folder

    def upload(local: Path, prefix: str) -> str:
        bucket = f"test-{uuid.uuid4().hex[:12]}"
        s3_client.create_bucket(Bucket=bucket)
        put_folder(S3Store(bucket, **s3_options), local, prefix)
        return f"s3://{bucket}/{prefix.strip('/')}"

    return upload
