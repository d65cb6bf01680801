"""An object store that fails: killed, frozen, or answering with transient errors.

A test that kills (SIGKILL) its endpoint runs a real moto S3 server of its own
(``insitubatch_nodes.testing.MotoServer``, the ``moto`` fixture); the others share one per
module and test process (``shared_moto``): a test that freezes it (SIGSTOP, ``frozen_moto``)
lets it run again (SIGCONT) when it ends, and the tests of transient errors reach it through a
``insitubatch_nodes.testing.FaultProxy`` that injects them. The training
process of a killed or frozen endpoint is a subprocess (forked by ``tests/forkserver.py``): the
test asserts what it reports (a ``ChunkReadError`` naming array, chunk and store), how long the
error took after the failure, and that the process then exits 0 or 1 within 10 s, without
SIGABRT or a segfault. zarr's read of the local copy is the oracle for the data.

The tests of the default policy (its 30 s deadline) and of 6 s bursts run the retry clock
faster (``retry_clock``: ``insitubatch_nodes.io.stores.retry_time_scale``): every wait the
policy sets, and the burst, last ``SCALE`` of their seconds (``DEADLINE_SCALE`` in the tests
of the default policy's deadline, ``deadline_clock``: its 30 s, 10 s stall and 5 s connect
timeouts last 3, 1 and 0.5 s, the waits of ``QUICK``). The claims keep the policy's numbers;
``on_clock(s)`` is how long ``s`` policy seconds last, and the slack for what the clock does
not govern (scheduling, a process's exit) stays in real seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest
import zarr
from helpers import CountingStore, Oracle, View, run_epoch, write_era5

import insitubatch_nodes
from insitubatch_nodes import (
    RetryPolicy,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.io.stores import RETRY_TIME_SCALE_ENV
from insitubatch_nodes.testing import FaultProxy, MotoServer, upload_folder

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("store_failures")]

BUCKET, PREFIX = "failures", "data/era5.zarr"
URL = f"s3://{BUCKET}/{PREFIX}"
# A policy small enough to keep the tests quick: the claims are about the mechanism.
QUICK = {"timeout_s": 3.0, "stall_timeout_s": 1.0, "connect_timeout_s": 1.0}
# The retry clock's speed in the tests that use ``retry_clock``, and in those that use
# ``deadline_clock`` (only the deadline is waited for there: 3 s for the default policy's 30 s,
# as ``QUICK``'s, where 0.15 waited 4.5 s for each of two tests).
SCALE = 0.15
DEADLINE_SCALE = 0.1


@pytest.fixture(scope="module")
def era5_local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m and z in 16 one-tile chunks of 4 samples each: 16 batches in the training
    subprocesses, which fail after their first or second (their reads ahead are bounded by
    ``max_inflight=4``), and every object read through a ``FaultProxy`` by the tests of
    transient errors, two or three times each (32 chunks: 5.7 CPU-s of the shared moto server's,
    3.3 with 16; 2026-12-07)."""
    root = tmp_path_factory.mktemp("failures") / "era5.zarr"
    return write_era5(root, n_time=64, samples_per_chunk=4)


def on_clock(policy_seconds: float, scale: float = SCALE) -> float:
    """How long ``policy_seconds`` of a policy last under ``retry_clock`` (under
    ``deadline_clock`` with ``scale=DEADLINE_SCALE``)."""
    return policy_seconds * scale


@pytest.fixture
def retry_clock(monkeypatch: pytest.MonkeyPatch) -> float:
    """Every wait a retry policy sets runs ``SCALE`` times as long, here and in the training
    subprocesses started after it (they inherit the environment)."""
    monkeypatch.setenv(RETRY_TIME_SCALE_ENV, str(SCALE))
    return SCALE


@pytest.fixture
def deadline_clock(monkeypatch: pytest.MonkeyPatch) -> float:
    """As ``retry_clock``, ``DEADLINE_SCALE`` times as long."""
    monkeypatch.setenv(RETRY_TIME_SCALE_ENV, str(DEADLINE_SCALE))
    return DEADLINE_SCALE


@pytest.fixture(scope="module")
def shared_moto(era5_local: Path) -> Iterator[MotoServer]:
    """One moto server for the tests that do not kill it, holding ``era5_local`` at ``URL``
    (the transient faults come from a ``FaultProxy`` in front of it)."""
    with MotoServer() as server:
        upload_folder(era5_local, BUCKET, PREFIX, **server.options())
        try:
            yield server
        finally:
            if server._proc.poll() is None:  # a frozen server must run again to be stopped
                os.kill(server.pid, signal.SIGCONT)


@pytest.fixture
def frozen_moto(shared_moto: MotoServer) -> Iterator[MotoServer]:
    """``shared_moto`` for a test that freezes it (SIGSTOP): it runs again (SIGCONT) when the
    test ends, so a freeze costs no server start and upload (about 2 s each)."""
    try:
        yield shared_moto
    finally:
        os.kill(shared_moto.pid, signal.SIGCONT)


@pytest.fixture
def moto(era5_local: Path) -> Iterator[MotoServer]:
    """A moto server of this test's own, holding ``era5_local`` at ``URL``: for the tests that
    kill it."""
    with MotoServer() as server:
        upload_folder(era5_local, BUCKET, PREFIX, **server.options())
        yield server


@pytest.fixture
def stopped_moto(request: pytest.FixtureRequest, how: str) -> MotoServer:
    """The server a test parametrized by ``how`` stops: its own when it is ``killed``, the
    shared one when it is ``frozen``."""
    server: MotoServer = request.getfixturevalue("moto" if how == "killed" else "frozen_moto")
    return server


# ---------------------------------------------------------------------------------------------
# A store that stops answering mid-epoch
# ---------------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from insitubatch_nodes import RetryPolicy, insitu_pipeline, open_geometries, split_by_chunk
    from insitubatch_nodes.errors import ChunkReadError

    url, policy, max_inflight = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    retry = None if policy is None else RetryPolicy(**policy)
    g = open_geometries(url)  # the endpoint and credentials come from AWS_* variables
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        url, manifest, {"x": g["t2m"]}, batch_size=4, block_chunks=1, shuffle=False,
        max_inflight=max_inflight, retry=retry,
    )
    it = iter(pipe)
    next(it)
    print("first", flush=True)
    sys.stdin.readline()                      # the test kills or freezes the endpoint here
    t0 = time.monotonic()
    n = 1
    try:
        for _ in it:
            n += 1
    except ChunkReadError as exc:
        cause = exc.__cause__
        print(json.dumps({
            "outcome": "error", "message": str(exc), "elapsed": time.monotonic() - t0,
            "cause": f"{type(cause).__name__}: {cause}"[:300], "batches": n,
            "n_batches": len(pipe),
        }), flush=True)
        sys.exit(1)
    print(json.dumps({"outcome": "finished", "batches": n}), flush=True)
    """
)


def _child_env(moto: MotoServer) -> dict[str, str]:
    """The environment of a training subprocess: this package importable, the endpoint and its
    dummy credentials in ``AWS_*`` variables."""
    package_root = str(Path(insitubatch_nodes.__file__).resolve().parents[1])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
        "AWS_ENDPOINT_URL": moto.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }


def _start_child(
    tmp_path: Path, moto: MotoServer, source: str, *argv: str
) -> subprocess.Popen[str]:
    """Start ``source`` as a script against ``moto`` (pipes on all three streams) and wait for
    its first line, ``first``: its pipeline has delivered a batch."""
    script = tmp_path / "child.py"
    script.write_text(source)
    child = forkserver.popen(
        [sys.executable, str(script), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(moto),
        full_exit=True,  # some claims here are the exit's (close and exit with GETs stalled)
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    first = child.stdout.readline()
    if first.strip() != "first":
        child.kill()
        child.wait()
        raise AssertionError(f"the child did not start: {first!r}\n{child.stderr.read()[-3000:]}")
    return child


def _fail_mid_epoch(
    tmp_path: Path,
    moto: MotoServer,
    how: str,
    policy: dict[str, Any] | None,
    url: str = URL,
    max_inflight: int = 4,
) -> tuple[dict[str, Any], float, float, subprocess.CompletedProcess[str]]:
    """Run the child, fail the endpoint after its first batch; return (report, seconds from
    the failure to the report, seconds from the report to exit, the finished process)."""
    child = _start_child(tmp_path, moto, _CHILD, url, json.dumps(policy), str(max_inflight))
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    try:
        # stamped before the endpoint fails: waiting for a killed server to exit takes a while
        # on a busy machine, and stamped after it the child's deadline seemed to come early
        t_fail = time.monotonic()
        if how == "killed":
            moto._proc.kill()
            moto._proc.wait()
        else:
            os.kill(moto.pid, signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        t_report = time.monotonic()
        returncode = child.wait(timeout=10)  # raises TimeoutExpired: the process hangs
        t_exit = time.monotonic()
        stderr = child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    done = subprocess.CompletedProcess(child.args, returncode, line, stderr)
    assert line, f"no report from the child (exit {returncode}): {stderr[-3000:]}"
    return json.loads(line), t_report - t_fail, t_exit - t_report, done


def _assert_clean_failure(
    report: dict[str, Any], done: subprocess.CompletedProcess[str], url: str = URL
) -> None:
    assert report["outcome"] == "error", report
    assert report["batches"] < report["n_batches"]  # it failed mid-epoch
    message = report["message"]
    assert "'t2m'" in message and "chunk " in message  # the array and the chunk
    assert "t2m/c/" in message  # the store key
    assert url in message  # the store
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])  # not -6 / -11
    assert "panicked" not in done.stderr and "Abort" not in done.stderr, done.stderr[-3000:]
    assert "Segmentation" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_an_endpoint_that_stops_answering_mid_epoch_raises_naming_array_chunk_and_store(
    tmp_path: Path, stopped_moto: MotoServer, how: str
) -> None:
    report, to_error, to_exit, done = _fail_mid_epoch(tmp_path, stopped_moto, how, QUICK)
    _assert_clean_failure(report, done)
    # killed: connection refused, retried with backoff until the deadline (timeout_s = 3 s);
    # frozen: connections hang, so the read fails at the deadline too
    assert to_error < QUICK["timeout_s"] + 2.0, (to_error, report)
    if how == "frozen":
        assert to_error >= QUICK["timeout_s"] - 0.5, (to_error, report)
        assert "TimeoutError" in report["cause"] and "RetryPolicy.timeout_s" in report["cause"]
    assert to_exit < 10.0


def test_a_tiled_chunk_against_a_frozen_endpoint_fails_within_one_deadline(
    tmp_path: Path, era5_local: Path, frozen_moto: MotoServer
) -> None:
    moto = frozen_moto
    tiled = write_era5(tmp_path / "tiled.zarr", n_time=32, samples_per_chunk=4, inner_chunks=(4, 8))
    upload_folder(tiled, BUCKET, "tiled/era5.zarr", **moto.options())  # 4 tiles per chunk
    url = f"s3://{BUCKET}/tiled/era5.zarr"
    report, to_error, _, done = _fail_mid_epoch(tmp_path, moto, "frozen", QUICK, url, 1)
    _assert_clean_failure(report, done, url)
    assert to_error < QUICK["timeout_s"] + 2.0, (to_error, report)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_under_the_default_policy_a_dead_endpoint_fails_within_60_s(
    tmp_path: Path, stopped_moto: MotoServer, how: str, deadline_clock: float
) -> None:
    report, to_error, to_exit, done = _fail_mid_epoch(tmp_path, stopped_moto, how, None)
    _assert_clean_failure(report, done)
    assert to_error <= on_clock(60.0, deadline_clock), (to_error, report)
    # refused connections and stalled ones alike are retried until the 30 s deadline
    assert to_error >= on_clock(RetryPolicy().timeout_s - 1.0, deadline_clock), (to_error, report)
    assert to_exit < 10.0


def test_metadata_reads_against_a_frozen_endpoint_end_near_the_policy_deadline(
    frozen_moto: MotoServer,
) -> None:
    """zarr's own reads (opening the group) go through obstore's retry config and timeouts,
    not through the fetch stage's deadline: the policy reaches them too."""
    moto = frozen_moto
    store = open_store(URL, retry=RetryPolicy(**QUICK), **moto.options())
    os.kill(moto.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        open_geometries(store)
    elapsed = time.monotonic() - t0
    # timeout_s, plus at most one attempt started just before it (stall_timeout_s), plus slack
    assert elapsed < QUICK["timeout_s"] + QUICK["stall_timeout_s"] + 2.0, (elapsed, info.value)
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()


# ---------------------------------------------------------------------------------------------
# Transient errors that clear within the budget
# ---------------------------------------------------------------------------------------------


def _views(store: Any) -> tuple[dict[str, Any], dict[str, View], Any]:
    g = open_geometries(store, ["t2m", "z"])
    views = {"x": g["t2m"], "y": g["t2m"].shift(1), "z": g["z"]}
    oviews = {"x": View("t2m"), "y": View("t2m", 0, 1), "z": View("z")}
    return views, oviews, split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))


@pytest.mark.parametrize(
    "fault", [{"status": 503}, {"status": 429}, {"status": 500}, {"reset": True}]
)
def test_transient_errors_on_the_first_two_gets_of_every_object_still_yield_exact_data(
    era5_local: Path, shared_moto: MotoServer, fault: dict[str, Any]
) -> None:
    moto = shared_moto
    with FaultProxy(moto.port, fail_first=2, match="/c/", **fault) as proxy:
        store = open_store(URL, **moto.options(endpoint=proxy.endpoint))
        views, oviews, manifest = _views(store)
        pipe = insitu_pipeline(store, manifest, views, batch_size=16, block_chunks=8)
        records = run_epoch(pipe, Oracle(era5_local), oviews)  # zarr's read is the oracle
        assert len(records) == len(pipe)
        chunk_gets = {p: n for p, n in proxy.gets.items() if "/c/" in p}
        n_objects = sum(1 for p in (era5_local / "t2m").rglob("*") if p.is_file()) - 1
        n_objects += sum(1 for p in (era5_local / "z").rglob("*") if p.is_file()) - 1
        n_coords = sum(1 for p in (era5_local / "time").rglob("*") if p.is_file()) - 1
        # every stored object was read (the time coordinate's too, read once at build) ...
        assert len(chunk_gets) == n_objects + n_coords
        assert all(n == 3 for n in chunk_gets.values()), chunk_gets  # ... after two faults
        assert pipe.stats()["gets"] == n_objects


def test_a_transient_error_that_outlasts_max_retries_raises_naming_the_store(
    era5_local: Path, shared_moto: MotoServer
) -> None:
    moto = shared_moto
    with FaultProxy(moto.port, fail_first=2, status=503, match="/c/") as proxy:
        setup = open_store(URL, **moto.options())
        views, _, manifest = _views(setup)
        store = open_store(
            URL, retry=RetryPolicy(max_retries=1), **moto.options(endpoint=proxy.endpoint)
        )
        pipe = insitu_pipeline(store, manifest, views, batch_size=16, coords=())
        with pytest.raises(ChunkReadError) as info:
            run_epoch(pipe)
        assert f"{URL} (endpoint {proxy.endpoint})" in str(info.value)
        assert "503" in str(info.value.__cause__)
        assert pipe.stages.pool.pinned_count() == 0


# ---------------------------------------------------------------------------------------------
# Retries spend the deadline: a burst that clears within timeout_s costs time, not the read
# ---------------------------------------------------------------------------------------------

BURST_S = 6.0  # longer than obstore's 10 jittered retries last (1.4-5.5 s)


@pytest.mark.parametrize("status", [503, 500])
def test_a_6_s_burst_of_server_errors_on_every_object_is_absorbed_with_exact_data(
    era5_local: Path, shared_moto: MotoServer, status: int, retry_clock: float
) -> None:
    moto = shared_moto
    with FaultProxy(moto.port, burst_s=on_clock(BURST_S), status=status, match="/c/") as proxy:
        views, oviews, manifest = _views(open_store(URL, **moto.options()))
        store = open_store(URL, **moto.options(endpoint=proxy.endpoint))  # the default policy
        # coords=(): the time coordinate read at build would meet the burst before any chunk
        pipe = insitu_pipeline(store, manifest, views, batch_size=16, block_chunks=8, coords=())
        with pipe:
            records = run_epoch(pipe, Oracle(era5_local), oviews)  # zarr's read is the oracle
        assert len(records) == len(pipe)
        assert proxy.burst_started is not None
        assert time.monotonic() - proxy.burst_started >= on_clock(BURST_S)  # the epoch outlasted it
        chunk_gets = [n for p, n in proxy.gets.items() if "/c/" in p]
        assert max(chunk_gets) > 11  # more than obstore's old 10 retries on some object
        assert proxy.injected > len(chunk_gets)


def test_an_endpoint_that_refuses_connections_for_6_s_is_waited_for_within_the_deadline(
    era5_local: Path, shared_moto: MotoServer, retry_clock: float
) -> None:
    """Connection refused is transient too: the proxy is down for 6 s, then back on its port.
    The epoch runs on a thread from before its first read, so every chunk read meets the
    outage (before 2026-12-08 the outage began after the first batch, and a read-ahead that
    had read every object by then met none of it: a flaky test on a loaded machine)."""
    moto = shared_moto
    views, oviews, manifest = _views(open_store(URL, **moto.options()))
    proxy = FaultProxy(moto.port, fail_first=0)
    port, endpoint = proxy.port, proxy.endpoint
    store = open_store(URL, **moto.options(endpoint=endpoint))
    pipe = insitu_pipeline(store, manifest, views, batch_size=16, block_chunks=1, shuffle=False)
    oracle = Oracle(era5_local)
    done: list[list[Any]] = []
    with pipe:
        it = iter(pipe)
        proxy.stop()  # from here every connection is refused
        t_down = time.monotonic()
        epoch = threading.Thread(target=lambda: done.append(run_epoch(it, oracle, oviews)))
        epoch.start()
        time.sleep(on_clock(BURST_S))
        with FaultProxy(moto.port, fail_first=0, port=port) as back:
            epoch.join(timeout=60)
    assert done and len(done[0]) == len(pipe)  # (an error on the thread: printed above)
    assert time.monotonic() - t_down >= on_clock(BURST_S)
    assert sum(back.gets.values()) > 0  # reads were still to come when the endpoint went away


def test_a_dead_endpoint_fails_at_the_deadline_not_at_a_retry_count(
    tmp_path: Path, moto: MotoServer, retry_clock: float
) -> None:
    policy = {**QUICK, "timeout_s": 5.0}
    report, to_error, to_exit, done = _fail_mid_epoch(tmp_path, moto, "killed", policy)
    _assert_clean_failure(report, done)
    # refused connections are retried until the deadline, then the read fails naming the store
    deadline = policy["timeout_s"]
    assert on_clock(deadline - 0.5) <= to_error < on_clock(deadline) + 2.0, (to_error, report)
    assert to_exit < 10.0


def test_zarr_metadata_reads_absorb_a_6_s_burst_of_503s_too(
    era5_local: Path, shared_moto: MotoServer, retry_clock: float
) -> None:
    moto = shared_moto
    with FaultProxy(moto.port, burst_s=on_clock(BURST_S), match="zarr.json") as proxy:
        store = open_store(URL, **moto.options(endpoint=proxy.endpoint))
        geoms = open_geometries(store, ["t2m", "z"])
        assert proxy.burst_started is not None
        assert time.monotonic() - proxy.burst_started >= on_clock(BURST_S)
    local = open_geometries(era5_local, ["t2m", "z"])
    assert {k: repr(g) for k, g in geoms.items()} == {k: repr(g) for k, g in local.items()}


# ---------------------------------------------------------------------------------------------
# Any zarr store: the deadline applies to every GET
# ---------------------------------------------------------------------------------------------


def test_a_zarr_store_that_never_answers_fails_at_the_deadline_of_retry(era5_local: Path) -> None:
    views, _, manifest = _views(zarr.storage.LocalStore(era5_local, read_only=True))
    hanging = CountingStore(zarr.storage.LocalStore(era5_local, read_only=True), delay=3600.0)
    pipe = insitu_pipeline(
        hanging, manifest, views, batch_size=16, retry=RetryPolicy(timeout_s=1.0), coords=()
    )
    t0 = time.monotonic()
    with pytest.raises(ChunkReadError) as info:
        next(pipe)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 5.0, elapsed
    assert isinstance(info.value.__cause__, TimeoutError)
    assert info.value.array in {v.path for v in views.values()}
    assert f"'{info.value.array}'" in str(info.value) and str(era5_local) in str(info.value)
    pipe.close()


def test_a_coordinate_read_that_never_answers_fails_the_build_at_the_deadline(
    era5_local: Path,
) -> None:
    views, _, manifest = _views(zarr.storage.LocalStore(era5_local, read_only=True))
    hanging = CountingStore(zarr.storage.LocalStore(era5_local, read_only=True), delay=3600.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"coordinate 'time' from store .*coords=\(\)"):
        insitu_pipeline(hanging, manifest, views, batch_size=16, retry=RetryPolicy(timeout_s=1.0))
    assert 0.9 <= time.monotonic() - t0 < 5.0
    assert hanging.counts["time/c/0"] == 1 and hanging.active == 0  # the GET was cancelled


def test_a_coordinate_read_that_outlasts_max_retries_fails_the_build_naming_it(
    era5_local: Path, shared_moto: MotoServer
) -> None:
    moto = shared_moto
    views, _, manifest = _views(open_store(URL, **moto.options()))
    with FaultProxy(moto.port, fail_first=2, status=503, match="time/c/") as proxy:
        store = open_store(
            URL, retry=RetryPolicy(max_retries=1), **moto.options(endpoint=proxy.endpoint)
        )
        with pytest.raises(OSError, match=r"cannot read coordinate 'time' from store") as info:
            insitu_pipeline(store, manifest, views, batch_size=16)
        assert "503" in str(info.value.__cause__)
        insitu_pipeline(store, manifest, views, batch_size=16, coords=()).close()  # builds


# ---------------------------------------------------------------------------------------------
# Stopping while an endpoint is frozen: close, break and exit never wait for a GET
# ---------------------------------------------------------------------------------------------

_STOPPER = textwrap.dedent(
    """
    import sys, threading, time
    from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

    url = sys.argv[1]
    g = open_geometries(url)
    pipe = insitu_pipeline(
        url, split_by_chunk(g["t2m"], (1.0, 0.0, 0.0)), {"x": g["t2m"]}, batch_size=4,
        block_chunks=1, shuffle=False, max_inflight=4,
    )                                         # the default RetryPolicy: a 30 s deadline
    next(pipe)
    print("first", flush=True)
    sys.stdin.readline()                      # the test freezes the endpoint here

    def consume():                            # drains what is resident, then waits on GETs
        try:
            for _ in pipe:
                pass
        except Exception as exc:
            print("consumer", type(exc).__name__, flush=True)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(2.0)
    t0 = time.monotonic()
    pipe.close()
    took = time.monotonic() - t0
    consumer.join(2.0)
    print("closed", took, consumer.is_alive(), time.monotonic(), flush=True)
    """
)


def test_close_and_exit_do_not_wait_out_the_retry_deadline_while_an_obstore_endpoint_is_frozen(
    tmp_path: Path, frozen_moto: MotoServer
) -> None:
    moto = frozen_moto
    child = _start_child(tmp_path, moto, _STOPPER, URL)
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    try:
        os.kill(moto.pid, signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        said = [child.stdout.readline(), child.stdout.readline()]
        returncode = child.wait(timeout=10)
        t_exit = time.monotonic()
        stderr = child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert said[0].strip() == "consumer PipelineInterrupted", (said, stderr[-3000:])
    _, took, consumer_alive, t_closed = said[1].split()
    # The frozen GETs would hold on for the 30 s retry deadline. close() joins for at most 2 s
    # and the at-exit cancel waits at most 2 s; the margins cover a loaded 2-core machine
    # (interpreter exit alone, with torch imported, took 5.6 s once under 3x oversubscription).
    assert float(took) < 4.0  # close() did not wait for the frozen GETs
    assert consumer_alive == "False"  # the consumer blocked in next() was woken
    assert t_exit - float(t_closed) < 12.0  # nor did interpreter exit
    assert returncode == 0, stderr[-3000:]  # no SIGABRT, no segfault


# ---------------------------------------------------------------------------------------------
# on_bad_chunk="nan": only what still fails after the retries is a bad chunk
# ---------------------------------------------------------------------------------------------


def test_under_on_bad_chunk_nan_transient_errors_are_retried_first_and_not_listed_as_bad(
    era5_local: Path, shared_moto: MotoServer
) -> None:
    moto = shared_moto
    with FaultProxy(moto.port, fail_first=2, status=503, match="/c/") as proxy:
        store = open_store(URL, **moto.options(endpoint=proxy.endpoint))
        views, oviews, manifest = _views(store)
        pipe = insitu_pipeline(store, manifest, views, batch_size=16, on_bad_chunk="nan")
        run_epoch(pipe, Oracle(era5_local), oviews)  # exact data: nothing was filled
        assert pipe.bad_chunks == []
        assert proxy.injected > 0


def test_under_on_bad_chunk_nan_an_error_that_outlasts_the_retries_fills_and_lists_the_chunk(
    era5_local: Path, shared_moto: MotoServer
) -> None:
    moto = shared_moto
    with FaultProxy(moto.port, fail_first=2, status=503, match="t2m/c/3/") as proxy:
        setup = open_store(URL, **moto.options())
        views, _, manifest = _views(setup)
        store = open_store(
            URL, retry=RetryPolicy(max_retries=1), **moto.options(endpoint=proxy.endpoint)
        )
        pipe = insitu_pipeline(store, manifest, views, batch_size=16, on_bad_chunk="nan")
        oracle = Oracle(era5_local)
        seen = 0
        for batch in pipe:
            for label in ("x", "y"):
                idx = batch.sample_indices[label]
                bad = idx // 4 == 3
                seen += int(bad.sum())
                assert np.isnan(batch.arrays[label][bad]).all()
                np.testing.assert_array_equal(batch.arrays[label][~bad], oracle("t2m", idx[~bad]))
        assert seen > 0
        assert pipe.bad_chunks == [("t2m", 3, (0, 0))]
        assert proxy.gets[f"/{BUCKET}/{PREFIX}/t2m/c/3/0/0"] == 2  # the first try and one retry
