"""A black-box fault trial of reading from object storage, zarr's own read the oracle.

A user trains for days on S3 or HTTP and meets faults. Each test injects them — through
:class:`FaultStore` (a zarr ``WrapperStore`` whose GETs follow a script per key) or, on the real
network path, through :class:`ScriptProxy` (an in-process HTTP proxy in front of the session's
moto S3 server) — and checks what the user gets against ``zarr.open_array`` of the store.

Found, each with its test below: under ``missing_objects="drop"`` a stored object the build's
listing found and that is gone when it is read (deleted mid-run) was delivered as rows of the
fill value, the very samples the option drops; a store whose ``get`` raised ``CancelledError``
itself (nothing had cancelled it) surfaced as the internal ``FillCancelled`` ("chunk ('t2m', 2)
was cancelled"), naming no store key, calling a failed read a cancellation, and escaping
``on_bad_chunk="nan"``; a ``ChunkReadError``'s message named array, chunk, key and store but
neither its cause nor what to do; an S3 403 on one chunk of an epoch said only to check the
credentials or to read the bucket anonymously, not that S3 answers 403 for an absent object to
credentials without ``s3:ListBucket``, nor that temporary credentials expire mid-run; with a
``cache_dir`` an error reached ``next()`` 2 s late and every ``close()`` while it (or a kept
log record of an ``on_bad_chunk="nan"`` warning) lived took 2 s more: they held the failed
batch's chunks, whose cache maps the close waited for; a failed read of the time coordinate
at a rebuild said to pass ``coords=()``, which does not skip the read ``missing=`` or a time
stride need (and said so with ``coords=()`` passed).

Right, kept as cheap checks (the tests under "Right" below; each docstring counts its cases): 9
transient S3 faults retried with exact data and right counts, a 404 read as the fill value,
permanent faults failing at the first batch that needs the chunk with one GET and resuming
exactly from the last state, a Ctrl-C mid-wait, faults while a persistent cache fills, and a
store rewritten mid-epoch, now documented (pipeline.md, "A store that changes during a run").
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage
from helpers import write_era5
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from insitubatch_nodes import (
    Loader,
    RetryPolicy,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError, FillCancelled
from insitubatch_nodes.testing import FaultProxy

pytestmark = pytest.mark.timeout(60)

Action = BaseException | Callable[[Store, str, BufferPrototype, ByteRequest | None], Awaitable[Any]]


class FaultStore(zarr.storage.WrapperStore[Store]):
    """Wraps a zarr store; the n-th GET of a key runs ``script[key][n]`` (an exception to
    raise, or ``async f(store, key, prototype, byte_range)`` answering in its place), the GETs
    beyond the script read the wrapped store. ``counts`` counts the GETs per key."""

    def __init__(self, store: Store, script: Mapping[str, list[Action]] | None = None) -> None:
        super().__init__(store)
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.counts: Counter[str] = Counter()

    def _with_store(self, store: Store) -> FaultStore:
        return type(self)(store, self.script)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        self.counts[key] += 1
        todo = self.script.get(key)
        action = todo.pop(0) if todo else None
        if action is None:
            return await self._store.get(key, prototype, byte_range)
        if isinstance(action, BaseException):
            raise action
        return await action(self._store, key, prototype, byte_range)


async def _absent(store: Store, key: str, prototype: BufferPrototype, br: Any) -> None:
    return None  # what a GET of a deleted object answers


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """t2m (64, 8, 16) at 8 samples per chunk and at 1 (each sample its own object)."""
    base = tmp_path_factory.mktemp("fault")
    return {
        spc: write_era5(base / f"spc{spc}.zarr", n_time=64, variables=("t2m",),
                        samples_per_chunk=spc)
        for spc in (8, 1)
    }  # fmt: skip


def _epoch(pipe: Any, oracle: np.ndarray) -> Iterator[np.ndarray]:
    """The sample indices of each batch, each batch checked against ``oracle`` first."""
    for batch in pipe:
        rows = batch.sample_indices["x"]
        np.testing.assert_array_equal(batch["x"], oracle[rows])
        yield rows.copy()


# ---------------------------------------------------------------------------------------------
# Found
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spc", [8, 1])
def test_an_object_listed_at_build_and_gone_at_its_read_fails_under_drop_not_fill_rows(
    stores: dict[int, Path], tmp_path: Path, spc: int
) -> None:
    """``missing_objects="drop"`` promises no fill-value rows: an object the build's listing
    found and the read finds absent (deleted mid-run) is a ``ChunkReadError`` naming the key
    and saying the store changed — on a local folder (read on the decode threads, a slot per
    chunk or a row per object) and through GETs. Before, its rows were the fill value."""
    import shutil

    root = Path(shutil.copytree(stores[spc], tmp_path / "s.zarr"))
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    key = "t2m/c/5/0/0"
    for via in ("folder", "get"):
        store: Any = (
            root
            if via == "folder"
            else FaultStore(zarr.storage.LocalStore(root, read_only=True), {key: [_absent]})
        )
        pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, shuffle=False,
                               missing_objects="drop")  # fmt: skip
        assert pipe.stages.plan.dropped.get("absent_object", 0) == 0  # listed: all present
        moved = root / key
        if via == "folder":
            moved.rename(tmp_path / "gone")  # deleted after the build
        oracle = zarr.open_array(root, path="t2m", mode="r")[...]  # (fill value at chunk 5)
        with pytest.raises(ChunkReadError) as caught:
            for batch in pipe:
                assert (batch.sample_indices["x"] // spc != 5).all(), f"{via}: fill-value rows"
                np.testing.assert_array_equal(batch["x"], oracle[batch.sample_indices["x"]])
        err = caught.value
        assert (err.array, err.chunk_index, err.key) == ("t2m", 5, key)
        assert "missing_objects='drop'" in str(err.__cause__), err.__cause__
        assert "changed" in str(err.__cause__)
        pipe.close()
        assert pipe.threads == []
        if via == "folder":
            (tmp_path / "gone").rename(moved)
    # the default, "read": an absent object is the fill value, as zarr reads the changed store
    store = FaultStore(zarr.storage.LocalStore(root, read_only=True), {key: [_absent]})
    pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, shuffle=False)
    array = zarr.open_array(root, path="t2m", mode="r")
    oracle = array[...]
    oracle[5 * spc : 6 * spc] = array.fill_value  # what zarr reads once the object is gone
    assert len(np.concatenate(list(_epoch(pipe, oracle)))) == 64


def test_a_cancelled_error_the_store_raises_itself_is_a_read_error_naming_the_key(
    stores: dict[int, Path],
) -> None:
    """A store whose ``get`` raises ``CancelledError`` without being cancelled (a client torn
    down under it) failed a read: a ``ChunkReadError`` naming array, chunk and key, its cause
    chained, and under ``on_bad_chunk="nan"`` a bad chunk. Before, it surfaced as the internal
    ``FillCancelled`` ("chunk ('t2m', 2) was cancelled"), naming no key, and ``"nan"`` did not
    apply."""
    root = stores[8]
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    oracle = zarr.open_array(root, path="t2m", mode="r")[...]
    key = "t2m/c/2/0/0"

    def faulty() -> FaultStore:
        return FaultStore(
            zarr.storage.LocalStore(root, read_only=True), {key: [asyncio.CancelledError()]}
        )

    store = faulty()
    pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, shuffle=False)
    with pytest.raises(ChunkReadError) as caught:
        list(_epoch(pipe, oracle))
    err = caught.value
    assert (err.array, err.chunk_index, err.key) == ("t2m", 2, key)
    assert isinstance(err.__cause__, asyncio.CancelledError)
    assert store.counts[key] == 1
    pipe.close()
    assert pipe.threads == []
    pipe = insitu_pipeline(faulty(), manifest, {"x": g}, batch_size=4, shuffle=False,
                           on_bad_chunk="nan")  # fmt: skip
    oracle[16:24] = np.nan
    assert len(np.concatenate(list(_epoch(pipe, oracle)))) == 64
    assert pipe.bad_chunks == [("t2m", 2, (0, 0))]


async def _cut_short(store: Store, key: str, prototype: BufferPrototype, br: Any) -> Buffer:
    whole = await store.get(key, prototype, br)
    assert whole is not None
    return prototype.buffer.from_bytes(whole.to_bytes()[: len(whole) // 2])  # a short body


def test_a_chunk_read_error_says_what_failed_and_what_to_do(stores: dict[int, Path]) -> None:
    """The message of a ``ChunkReadError`` names array, chunk, key and store, then the cause in
    one line and what to do: for a read, that the store's retries were spent (or the error is
    not transient), to resume from the last ``state_dict()`` once the store answers, or
    ``on_bad_chunk="nan"``; for bytes that do not decode, to write the object again, or
    ``"nan"``. Before, it stopped at the store (the cause only in the chained traceback, no
    advice). Under ``"nan"`` the warning logged names the object and the cause, not the advice
    to pass ``"nan"``."""
    root = stores[8]
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    key = "t2m/c/2/0/0"
    local = zarr.storage.LocalStore(root, read_only=True)
    cases: list[tuple[Action, list[str]]] = [
        (ConnectionResetError("connection reset by peer"),
         ["failed to read", "ConnectionResetError: connection reset by peer", "RetryPolicy",
          "state_dict()", "on_bad_chunk='nan'"]),
        (PermissionError("403 Forbidden"),
         ["failed to read", "PermissionError: 403 Forbidden", "state_dict()"]),
        (_cut_short,
         ["failed to decode", "DecodeError", "write the object again", "on_bad_chunk='nan'"]),
    ]  # fmt: skip
    for action, said in cases:
        pipe = insitu_pipeline(FaultStore(local, {key: [action]}), manifest, {"x": g},
                               batch_size=4, shuffle=False)  # fmt: skip
        with pytest.raises(ChunkReadError) as caught:
            list(pipe)
        text = str(caught.value)
        assert f"array 't2m' chunk 2 (store key {key!r} in store" in text
        for words in said:
            assert words in text, (words, text)
        pipe.close()


def test_a_failed_time_coordinate_read_for_missing_or_a_stride_says_what_needs_it(
    stores: dict[int, Path],
) -> None:
    """A restart after preemption builds the pipeline again; a read of the time coordinate
    that fails then (a reset the store does not retry), when ``missing=`` or a time stride
    needs the times, names what needs them and what to do — not "pass coords=() to carry no
    coordinate", which does not skip this read: before, that advice came with ``coords=()``
    already passed."""
    root = stores[8]
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    local = zarr.storage.LocalStore(root, read_only=True)
    for options in ({"missing": ()}, {"stride": "12h"}):
        store = FaultStore(local, {"time/c/0": [ConnectionResetError("connection reset")]})
        with pytest.raises(OSError) as caught:
            insitu_pipeline(store, manifest, {"x": g}, batch_size=4, coords=(), **options)
        text = str(caught.value)
        assert "'time'" in text and "connection reset" in text, text
        assert "coords=() to carry no coordinate" not in text, text
        assert "missing=" in text and "stride" in text and "build again" in text, text


# ---------------------------------------------------------------------------------------------
# The network path: moto S3 behind a proxy that follows a script
# ---------------------------------------------------------------------------------------------


class ScriptProxy(FaultProxy):
    """An HTTP proxy in front of ``target_port`` whose n-th GET of a path containing a key of
    ``script`` does ``script[key][n]``, one of ``FaultProxy``'s actions: an int answers that
    status itself (an S3 error body); ``"reset"`` forwards and resets the connection half-way
    through the body, ``"close"`` closes it there in order (FIN), ``"stall"`` never answers,
    ``"stall_body"`` sends half the body and then nothing. Other requests are forwarded;
    ``gets`` counts GETs per path."""

    name = "script-proxy"

    def __init__(self, target_port: int, script: Mapping[str, list[int | str]]) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        super().__init__(target_port, fail_first=0)

    def _action(self, method: str, target: str) -> int | str | None:
        if method != "GET":
            return None
        path = target.split("?", 1)[0]
        with self._lock:
            self.gets[path] += 1
            todo = next((v for k, v in self.script.items() if k in path and v), None)
            return None if todo is None else todo.pop(0)


# small deadlines: a stalled attempt is given up after 0.3 s, a read after 3 s
FAST = RetryPolicy(timeout_s=3, stall_timeout_s=0.3, connect_timeout_s=0.3,
                   initial_backoff_s=0.02, max_backoff_s=0.1)  # fmt: skip
# the same backoffs, and the default policy's connect and stall timeouts: an answer the proxy
# forwards is never given up, however long a loaded machine takes to relay it (0.3 s was not
# always enough: an extra GET of a healthy answer, seen once under load). For the faults that
# need no stall timeout to be noticed.
PATIENT = RetryPolicy(timeout_s=30, initial_backoff_s=0.02, max_backoff_s=0.1)


@pytest.fixture(scope="module")
def s3_case(
    stores: dict[int, Path], s3_upload: Callable[[Path, str], str], s3_server: str
) -> tuple[str, int]:
    """The 8-samples-per-chunk store uploaded to the session's moto server: (url, its port)."""
    return s3_upload(stores[8], "data/era5.zarr"), int(s3_server.rsplit(":", 1)[1])


def _through(
    proxy: ScriptProxy, url: str, s3_options: dict[str, Any], retry: RetryPolicy = PATIENT
) -> Any:
    return open_store(url, retry=retry, **{**s3_options, "endpoint": proxy.endpoint})


@pytest.mark.xdist_group("s3")
def test_an_s3_403_on_one_chunk_says_it_may_be_an_absent_object_or_expired_credentials(
    stores: dict[int, Path], s3_case: tuple[str, int], s3_options: dict[str, Any]
) -> None:
    """A 403 on one chunk of an epoch whose other chunks read: one GET (no retry), at once, a
    ``ChunkReadError`` naming the key whose message says that S3 answers 403 for an absent
    object to credentials without ``s3:ListBucket``, and that temporary credentials can expire
    during a run. Before, it said to check the credentials or read the bucket anonymously."""
    url, port = s3_case
    root = stores[8]
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    oracle = zarr.open_array(root, path="t2m", mode="r")[...]
    key = "t2m/c/5/0/0"
    with ScriptProxy(port, {key: [403]}) as proxy:
        pipe = insitu_pipeline(_through(proxy, url, s3_options), manifest, {"x": g},
                               batch_size=4, shuffle=False)  # fmt: skip
        with pytest.raises(ChunkReadError) as caught:
            list(_epoch(pipe, oracle))
        assert [n for path, n in proxy.gets.items() if key in path] == [1]  # (no retry, no wait)
        pipe.close()
    text = str(caught.value)
    assert caught.value.key == key and isinstance(caught.value.__cause__, PermissionError)
    for words in ("s3:ListBucket", "absent", "expired", "state_dict()"):
        assert words in text, (words, text)
    assert pipe.threads == []


# ---------------------------------------------------------------------------------------------
# Right: the areas the trial found no fault in, kept as cheap checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.xdist_group("s3")
def test_transient_s3_faults_are_retried_and_every_sample_arrives_once_exact_and_counted(
    stores: dict[int, Path], s3_case: tuple[str, int], s3_options: dict[str, Any]
) -> None:
    """Right (9 faults): a reset and an orderly close half-way through the body, two 503
    ``SlowDown`` in a row, a 500, a 429, a GET that never answers and a body that stops
    half-way (each past ``stall_timeout_s``), on one chunk each, under a shuffled epoch: every
    sample once, every row zarr's, the faulted key GET once more per fault (no retry storm),
    ``stats()["gets"]`` and the report count stored objects (8), not attempts. A 404 on a
    stored chunk reads as the fill value, as zarr reads an absent object (documented).

    The count is exact where the store's stall timeout is the default's (10 s): the faults
    noticed without it. The stalls need a short one (0.3 s here), and a loaded machine can
    relay the healthy answer after them that late too, which the client rightly gives up and
    asks for again: there each fault is answered once (the script used up) and the extra GETs,
    if any, are of the forwarded answer."""
    url, port = s3_case
    root = stores[8]
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    oracle = zarr.open_array(root, path="t2m", mode="r")[...]
    key = "t2m/c/3/0/0"
    faults: list[list[int | str]] = [
        ["reset"], ["close"], [503, 503], [500], [429], ["stall"], ["stall_body"],
        ["reset", 503], ["close", "stall"],
    ]  # fmt: skip
    for fault in faults:
        stalls = any(f in ("stall", "stall_body") for f in fault)
        with ScriptProxy(port, {key: list(fault)}) as proxy:
            store = _through(proxy, url, s3_options, FAST if stalls else PATIENT)
            pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, seed=7)
            rows = np.concatenate(list(_epoch(pipe, oracle)))
            assert np.array_equal(np.sort(rows), np.arange(64)), fault
            (gets,) = [n for p, n in proxy.gets.items() if key in p]
            assert not proxy.script[key], fault  # every fault answered, once
            assert gets == 1 + len(fault) or (stalls and gets > 1 + len(fault)), (fault, gets)
            assert pipe.stats()["gets"] == 8 and pipe.report().gets == 8, fault
            pipe.close()
    with ScriptProxy(port, {key: [404]}) as proxy:
        pipe = insitu_pipeline(_through(proxy, url, s3_options), manifest, {"x": g},
                               batch_size=4, shuffle=False)  # fmt: skip
        absent = oracle.copy()
        absent[24:32] = zarr.open_array(root, path="t2m", mode="r").fill_value
        assert len(np.concatenate(list(_epoch(pipe, absent)))) == 64
        pipe.close()


async def _stalled(store: Store, key: str, prototype: BufferPrototype, br: Any) -> None:
    await asyncio.sleep(3600)  # an endpoint that froze (cancelled by the deadline)


def test_a_permanent_fault_fails_promptly_and_the_last_state_resumes_the_rest_exactly(
    stores: dict[int, Path],
) -> None:
    """Right (2 stores x 2 chunks x 2-3 faults, and a Ctrl-C): a 403, a connection reset (a
    store that retries nothing) and a GET past ``RetryPolicy.timeout_s`` (0.5 s here) fail the
    epoch with a ``ChunkReadError`` at the first batch that needs the chunk — the batches
    before it delivered, one GET of the key, within the deadline — the pipeline closes with no
    thread left, and the last ``state_dict()`` (taken before the error, or after it: the same)
    restores into a fresh pipeline that delivers the rest of the epoch: the whole sequence is
    an uninterrupted run's, every row zarr's. A Ctrl-C while ``next()`` waits on a stalled GET
    raises ``KeyboardInterrupt`` at once; ``close()`` then leaves nothing running and the same
    pipeline goes on exactly."""
    import _thread

    for spc, root in stores.items():
        g = open_geometries(root, ["t2m"])["t2m"]
        manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
        oracle = zarr.open_array(root, path="t2m", mode="r")[...]
        local = zarr.storage.LocalStore(root, read_only=True)

        def build(store: Store, g: Any = g, manifest: Any = manifest, deadline: float = 30) -> Any:
            return insitu_pipeline(store, manifest, {"x": g}, batch_size=4, seed=3,
                                   retry=RetryPolicy(timeout_s=deadline))  # fmt: skip

        whole = list(_epoch(build(local), oracle))
        for chunk in (2 * 8 // spc, 40 // spc):  # (the same samples at either layout)
            key = f"t2m/c/{chunk}/0/0"
            first = next(i for i, rows in enumerate(whole) if (rows // spc == chunk).any())
            faults: list[Action] = [PermissionError("403"), ConnectionResetError("reset")]
            for fault in faults + ([_stalled] if chunk == 40 // spc else []):
                store = FaultStore(local, {key: [fault]})
                deadline = 0.5 if fault is _stalled else 30.0
                loader = Loader(build(store, deadline=deadline))
                got, state = [], loader.state_dict()
                with pytest.raises(ChunkReadError) as caught:
                    for batch in loader:
                        np.testing.assert_array_equal(batch["x"], oracle[batch.sample_indices["x"]])
                        got.append(batch.sample_indices["x"].copy())
                        state = loader.state_dict()
                # one GET, no retry; the stalled one given up at its deadline (it never
                # answers: without the deadline the loop would not end)
                assert caught.value.key == key and store.counts[key] == 1, caught.value
                assert len(got) == first and loader.state_dict() == state
                loader.root.close()
                assert loader.root.threads == []
                again = Loader(build(local))
                again.load_state_dict(state)
                for batch in again:
                    np.testing.assert_array_equal(batch["x"], oracle[batch.sample_indices["x"]])
                    got.append(batch.sample_indices["x"].copy())
                assert len(got) == len(whole)
                assert all(np.array_equal(a, b) for a, b in zip(got, whole, strict=True))
    # Ctrl-C (SIGINT's KeyboardInterrupt, in the main thread) while next() waits
    store = FaultStore(local, {f"t2m/c/{c}/0/0": [_stalled] for c in range(64)})
    pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, seed=3)
    timer = threading.Timer(0.2, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        next(pipe)
    # at once: the stalled GETs would hold next() for the policy's 30 s deadline (a bound far
    # below it, not a measure of how fast: a loaded machine may take a second or more)
    assert time.monotonic() - start < 10
    pipe.close()
    assert pipe.threads == [] and pipe.stages.pool.pinned_count() == 0
    store.script.clear()  # the store answers again
    got = list(_epoch(pipe, oracle))
    assert all(np.array_equal(a, b) for a, b in zip(got, whole, strict=True))


def test_a_fault_while_the_persistent_cache_fills_leaves_no_bad_chunk_in_it(
    stores: dict[int, Path], tmp_path: Path
) -> None:
    """Right (2 stores x 2 policies): a chunk whose GET fails while a ``cache_dir`` fills —
    the epoch failing (``"raise"``) or the chunk filled with NaN (``"nan"``) — is not written
    to the cache: the next run, from the healthy store over the same directory, serves every
    row as zarr reads it, the cached chunks from disk and the faulted one fetched."""
    for spc, root in stores.items():
        g = open_geometries(root, ["t2m"])["t2m"]
        manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
        oracle = zarr.open_array(root, path="t2m", mode="r")[...]
        local = zarr.storage.LocalStore(root, read_only=True)
        key = "t2m/c/2/0/0"
        for policy in ("raise", "nan"):
            cache = tmp_path / f"cache-{spc}-{policy}"
            store = FaultStore(local, {key: [_cut_short]})
            pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, seed=3,
                                   on_bad_chunk=policy, cache_dir=cache, persist=True)  # fmt: skip
            with contextlib.suppress(ChunkReadError):
                for _ in pipe:
                    pass
            written = pipe.stats()["disk_writes"]
            pipe.close()
            del pipe
            pipe = insitu_pipeline(local, manifest, {"x": g}, batch_size=4, seed=3,
                                   cache_dir=cache, persist=True)  # fmt: skip
            assert len(np.concatenate(list(_epoch(pipe, oracle)))) == 64
            assert pipe.stats()["disk_hits"] == written, (spc, policy)
            assert pipe.stats()["gets"] == 64 // spc - written, (spc, policy)
            pipe.close()


def test_an_error_with_a_cache_dir_reaches_the_consumer_at_once_and_close_in_except_is_prompt(
    stores: dict[int, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a ``cache_dir``, a read or decode error reaches ``next()`` as soon as it happens,
    and ``close()`` inside the ``except`` block that holds it returns at once, its directory
    free for the next pipeline; under ``on_bad_chunk="nan"``, a logging handler that keeps
    the warning's record (pytest's here) does not hold the close either. Before, the error
    came 2 s late (``CLOSE_WAIT_S``: closing the graph waited for cache mappings that the
    error's own traceback held, through the frames it passed), each ``close()`` while the
    error lived took 2 s more, and so did a close while the warning's record lived (its
    arguments held the cause, and so the chunks). The wait is scaled up to 30 s here, so that
    a loaded machine's slower epoch is not mistaken for it."""
    import insitubatch_nodes.cache.directory as directory

    monkeypatch.setattr(directory, "CLOSE_WAIT_S", 30.0)
    caplog.set_level("WARNING", logger="insitubatch_nodes")
    for spc, root in stores.items():
        g = open_geometries(root, ["t2m"])["t2m"]
        manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
        local = zarr.storage.LocalStore(root, read_only=True)
        for fault in (PermissionError("403"), _cut_short):
            cache = tmp_path / f"c{spc}{type(fault).__name__}"
            store = FaultStore(local, {"t2m/c/2/0/0": [fault]})
            pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, seed=3,
                                   cache_dir=cache, persist=True)  # fmt: skip
            start = time.monotonic()
            try:
                for _ in pipe:
                    pass
            except ChunkReadError:
                took = time.monotonic() - start
                pipe.close()
                closed = time.monotonic() - start - took
            assert took < 10 and closed < 10, (spc, fault, took, closed)  # (was 30 s each)
            again = insitu_pipeline(local, manifest, {"x": g}, batch_size=4, seed=3,
                                    cache_dir=cache, persist=True)  # fmt: skip
            again.close()
        store = FaultStore(local, {"t2m/c/2/0/0": [_cut_short]})
        pipe = insitu_pipeline(store, manifest, {"x": g}, batch_size=4, seed=3,
                               cache_dir=tmp_path / f"nan{spc}", persist=True,
                               on_bad_chunk="nan")  # fmt: skip
        for _ in pipe:
            pass
        assert pipe.bad_chunks and caplog.records  # (the warning kept)
        start = time.monotonic()
        pipe.close()
        assert time.monotonic() - start < 10, spc  # (was CLOSE_WAIT_S: 30 s here)


def test_a_store_rewritten_mid_epoch_delivers_each_chunk_as_it_was_read_as_documented(
    tmp_path: Path,
) -> None:
    """Documented (pipeline.md, "A store that changes during a run"): each chunk is delivered
    as it was when its object was read — every row is the old or the new value of its
    sample, one version per chunk and epoch, never a mix or garbage — and a chunk kept
    resident keeps those values in later epochs, one read again has the new ones; a pipeline
    built afterwards reads the store as it is."""
    root = write_era5(tmp_path / "s.zarr", n_time=256, variables=("t2m",))
    old = zarr.open_array(root, path="t2m", mode="r")[...]
    g = open_geometries(root, ["t2m"])["t2m"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(
        root,
        manifest,
        {"x": g},
        batch_size=4,
        seed=1,
        prefetch_depth=1,
        max_inflight=1,
        block_chunks=2,
    )  # fmt: skip (little read-ahead)
    first = next(pipe)
    zarr.open_array(root, path="t2m", mode="r+")[...] = old + 1000
    new = old + 1000
    seen: list[dict[int, set[str]]] = [{}, {}]  # per epoch, per chunk: the versions seen
    for epoch in range(2):
        if epoch:
            pipe.reset()
        for batch in [first, *pipe] if epoch == 0 else pipe:
            for i, row in zip(batch.sample_indices["x"], batch["x"], strict=True):
                version = "old" if np.array_equal(row, old[i]) else "new"
                assert version == "old" or np.array_equal(row, new[i]), i
                seen[epoch].setdefault(int(i) // 8, set()).add(version)
    assert all(len(v) == 1 for e in seen for v in e.values()), seen  # one version per chunk
    assert set().union(*seen[0].values()) == {"old", "new"}  # (the rewrite fell mid-epoch)
    for chunk, versions in seen[1].items():  # kept resident: as before; read again: new
        assert versions in (seen[0][chunk], {"new"}), chunk
    pipe.close()
    fresh = insitu_pipeline(root, manifest, {"x": g}, batch_size=4, seed=1)
    assert len(np.concatenate(list(_epoch(fresh, new)))) == 256


_INTERRUPT_SCRIPT = r"""
import asyncio, sys, threading
from pathlib import Path
import numpy as np, zarr, zarr.storage
sys.path.insert(0, {tests!r})
from test_fault_trial import FaultStore
from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk

root = Path({root!r})
store = FaultStore(zarr.storage.LocalStore(root, read_only=True), {{"t2m/c/2/0/0": [{exc}()]}})
g = open_geometries(root, ["t2m"])["t2m"]
pipe = insitu_pipeline(store, split_by_chunk(g, (1.0, 0.0, 0.0)), {{"x": g}}, batch_size=8,
                       shuffle=False)
got = []
def consume():
    try:
        for _ in pipe:
            pass
        got.append("no error")
    except BaseException as exc:
        got.append(type(exc).__name__)
t = threading.Thread(target=consume, daemon=True)
t.start(); t.join(20)
print("consumer:", got[0] if got else "hung", flush=True)
pipe.close()
# the process's zarr reads go on (zarr's IO loop, which the GETs share, still runs)
def read():
    got.append(zarr.open_array(root, path="t2m", mode="r")[0].sum())
r = threading.Thread(target=read, daemon=True)
r.start(); r.join(20)
print("zarr read:", "ok" if len(got) == 2 else "hung", flush=True)
import os; os._exit(0)
"""


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit"])
def test_a_keyboard_interrupt_or_exit_a_store_raises_reaches_the_consumer_and_zarr_goes_on(
    stores: dict[int, Path], exc: str
) -> None:
    """A store's ``get`` raising ``KeyboardInterrupt`` or ``SystemExit`` (a store of the user's
    that ends the run from inside a read) ends the consumer's loop with it, and the process's
    zarr reads go on. Before, the GET also re-raised it on the IO loop the process's zarr reads
    share: the loop's thread died, and every later zarr read of the process (a new pipeline's
    too) waited forever (run in a forked child: a dead loop would hang this test's worker)."""
    import sys

    import forkserver

    script = _INTERRUPT_SCRIPT.format(tests=str(Path(__file__).parent), root=str(stores[8]),
                                      exc=exc)  # fmt: skip
    argv = [sys.executable, "-c", script]
    done = forkserver.run(argv, capture_output=True, text=True, timeout=60)
    assert f"consumer: {exc}" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "zarr read: ok" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_every_error_of_the_package_pickles_with_its_message_attributes_and_cause() -> None:
    """An error crossing a process boundary (``ddp_spawn`` hands a rank's error to the
    parent; a process pool) is pickled. ``ChunkReadError``, ``CorruptMetadataError``,
    ``UnsupportedMetadataError`` and ``CacheDiskFullError`` take other arguments than their
    ``args``: unpickling them raised ``TypeError`` (``__init__() missing ... arguments``).
    Now every error class of ``errors.__all__`` comes back with its message, its attributes,
    and the cause in brief (pickle drops ``__cause__``)."""
    import errno
    import pickle

    from insitubatch_nodes import errors

    read = ChunkReadError("t2m", 3, (0, 1), "t2m/c/3/0/1", "read", "s3://b/era5.zarr",
                          member="plate/A/1/0")  # fmt: skip
    read.__cause__ = PermissionError("403 Forbidden: the credentials expired")
    made: list[BaseException] = [
        read,
        ChunkReadError("t2m", 0, (0,), "t2m/c/0", "decode"),
        errors.CorruptMetadataError("/d.zarr", [("t2m/zarr.json", "is not JSON")]),
        errors.UnsupportedMetadataError("/d.zarr", [("t2m/zarr.json", "codec 'jpeg2k'")]),
        errors.CacheDiskFullError(
            "no room for 8 MiB in /cache",
            code=errno.ENOSPC,
            directory=Path("/cache"),
            nbytes=8 << 20,
        ),
        errors.ArrayNotFoundError("array 'q' is not in store /d.zarr (it holds: t2m)"),
        errors.CoordinateLengthError("time", 14, "sst", 12, "time", "the times cannot be read: "),
        errors.TooFewSamplesError(
            "split 'test' has 1 valid anchors but world_size is 2",
            split="test",
            n_samples=1,
            world_size=2,
            counted="1 valid anchors",
        ),
        errors.StateMismatchError(
            "its seed differs",
            "To resume it, ...",
            "To go on, ...",
            epoch=3,
            batches=2,
            also=". A state taken ...",
        ),
        errors.RankFailedError(
            "rank 1 of 2 raised during the pipeline's build, ...",
            failed={1: "PermissionError: 403 Forbidden"},
            world_size=2,
        ),
    ]
    made += [getattr(errors, name)("a message") for name in errors.__all__
             if name not in {type(e).__name__ for e in made}]  # fmt: skip
    for error in made:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error), (error, back)
        assert back.args == error.args and vars(back).items() >= vars(error).items(), error
    back = pickle.loads(pickle.dumps(read))
    assert "credentials expired" in str(back) and back.key == "t2m/c/3/0/1"
    disk = pickle.loads(pickle.dumps(made[4]))
    assert disk.errno == errno.ENOSPC and disk.nbytes == 8 << 20


def test_a_get_cancelled_before_its_first_step_lands_as_cancelled_and_gives_its_permit_back() -> (
    None
):
    """A GET task cancelled before the IO loop ran its first step (a close or reset right
    after the admission queued it: the cancel callback was ahead of the task in the loop's
    queue) never entered ``GetQueue._fetch``, which lands every outcome: its object was never
    handed to the decode threads, so its pool entry stayed pending (a close then waited 2 s
    for that slot's cache mapping: the fault trial's flaky close) and its in-flight permit was
    never given back — each such cancel took one of ``max_inflight`` for good. Now the task's
    done callback lands it as cancelled, with its permit. Driven on the IO loop in the order
    that showed it; ``pool`` and ``recorder`` are stand-ins (nothing here reaches them)."""
    from insitubatch_nodes import _runtime
    from insitubatch_nodes.stages._get import GetQueue
    from insitubatch_nodes.stages._jobs import FillJob, Unit

    landed: list[Any] = []
    io = _runtime.io_loop()

    class _Pool:
        def note_io(self, *args: Any, **kwargs: Any) -> None:
            pass

    async def _get(key: str) -> bytes:
        raise AssertionError("a cancelled GET must not be sent")

    gets = GetQueue(_get, io, 4, "stand-in", pool=_Pool(), recorder=None,  # type: ignore[arg-type]
                    land=lambda job, items: landed.extend(items))  # fmt: skip
    job = FillJob(ticket=0, generation=0)
    units = [Unit(None, c, (0,), np.zeros(1), None) for c in range(3)]  # type: ignore[arg-type]

    def queue_then_cancel() -> None:  # as a close lands between the queueing and the steps
        gets._enqueue(job, units, ())
        job.cancelled = True
        for task in list(gets.tasks):
            task.cancel()

    io.call_soon_threadsafe(queue_then_cancel)
    deadline = time.monotonic() + 5
    while len(landed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(item.work.chunk for item in landed) == [0, 1, 2], landed
    assert all(isinstance(item.error, FillCancelled) and item.permit for item in landed)
    assert not gets.tasks


def test_a_commit_racing_a_close_of_the_cache_never_writes_to_the_closed_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill committing its chunk to a persistent cache (a decode thread) while the graph's
    close closes the cache's log (the consumer's thread, after an error): the commit checked
    the log's descriptor, then wrote to it after the close had set it to ``None`` — a
    ``TypeError`` that failed the chunk and, held in a reference cycle with its slot, kept the
    directory's lock waiting 2 s; a descriptor closed and reused by another open file would
    have taken the log line. Now the close waits for the commit in progress (or the commit
    sees the cache closed). The close is started from inside the commit (between the rename
    and the log line), and given 0.3 s to get in."""
    import threading

    from insitubatch_nodes.cache import directory
    from insitubatch_nodes.cache.directory import ChunkCache

    cache = ChunkCache(tmp_path / "cache", {"t2m": "0123456789abcdef"}, persist=True)
    slot = cache.new_slot(("t2m", 0), (2, 2), np.dtype("f4"), 2)
    assert slot is not None
    slot.array[...] = 1
    replace = directory.os.replace
    closer = threading.Thread(target=cache.close, daemon=True)

    def replace_then_close(src: Any, dst: Any) -> None:
        replace(src, dst)
        closer.start()
        closer.join(0.3)  # (it finishes at once on the old code; waits for the commit now)

    monkeypatch.setattr(directory.os, "replace", replace_then_close)
    kept = cache.commit(slot, 2)  # raised TypeError: 'NoneType' ... as an integer
    monkeypatch.undo()
    del slot
    closer.join(5)
    assert kept and not closer.is_alive()
    again = ChunkCache(tmp_path / "cache", {"t2m": "0123456789abcdef"}, persist=True)
    assert ("t2m", 0) in again._index  # the line was written whole, before the log closed
    again.close()
