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
credentials without ``s3:ListBucket``, nor that temporary credentials expire mid-run.
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
    RetryPolicy,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.testing import FaultProxy
from insitubatch_nodes.testing import _parse_headers as parse_headers
from insitubatch_nodes.testing import _relay_response as relay_response

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


def _pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("insitu-prefetch")]


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
        assert _pipeline_threads() == []
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
    assert _pipeline_threads() == []
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


# ---------------------------------------------------------------------------------------------
# The network path: moto S3 behind a proxy that follows a script
# ---------------------------------------------------------------------------------------------


class ScriptProxy(FaultProxy):
    """An HTTP proxy in front of ``target_port`` whose n-th GET of a path containing a key of
    ``script`` does ``script[key][n]``: an int answers that status itself (an S3 error body);
    ``"reset"`` forwards and resets the connection half-way through the body, ``"close"``
    closes it there in order (FIN), ``"stall"`` never answers, ``"stall_body"`` sends half the
    body and then nothing. Other requests are forwarded; ``gets`` counts GETs per path."""

    name = "script-proxy"

    def __init__(self, target_port: int, script: Mapping[str, list[int | str]]) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        super().__init__(target_port, fail_first=0)

    def _action(self, method: bytes, target: bytes) -> int | str | None:
        if method != b"GET":
            return None
        path = target.decode().split("?", 1)[0]
        with self._lock:
            self.gets[path] += 1
            todo = next((v for k, v in self.script.items() if k in path and v), None)
            return None if todo is None else todo.pop(0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target = head.split(b" ", 2)[:2]
                body = await reader.readexactly(int(parse_headers(head).get("content-length", 0)))
                act = self._action(method, target)
                if isinstance(act, int):
                    self.status = act
                    writer.write(self._error_response())
                    await writer.drain()
                    continue
                if act == "stall":
                    await asyncio.sleep(3600)
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
                try:
                    up_w.write(head + body)
                    await up_w.drain()
                    if act in ("close", "stall_body"):
                        answer = await up_r.readuntil(b"\r\n\r\n")
                        n = int(parse_headers(answer)["content-length"])
                        writer.write(answer + (await up_r.readexactly(n))[: n // 2])
                        await writer.drain()
                        if act == "stall_body":
                            await asyncio.sleep(3600)
                        return  # (the finally closes the connection in order)
                    keep = await relay_response(
                        up_r, writer, head_only=method == b"HEAD", cut=act == "reset"
                    )
                finally:
                    with contextlib.suppress(Exception):
                        up_w.close()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, OSError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()


# small deadlines: a stalled attempt is given up after 0.3 s, a read after 3 s
FAST = RetryPolicy(timeout_s=3, stall_timeout_s=0.3, connect_timeout_s=0.3,
                   initial_backoff_s=0.02, max_backoff_s=0.1)  # fmt: skip


@pytest.fixture(scope="module")
def s3_case(
    stores: dict[int, Path], s3_upload: Callable[[Path, str], str], s3_server: str
) -> tuple[str, int]:
    """The 8-samples-per-chunk store uploaded to the session's moto server: (url, its port)."""
    return s3_upload(stores[8], "data/era5.zarr"), int(s3_server.rsplit(":", 1)[1])


def _through(proxy: ScriptProxy, url: str, s3_options: dict[str, Any]) -> Any:
    return open_store(url, retry=FAST, **{**s3_options, "endpoint": proxy.endpoint})


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
        start = time.monotonic()
        with pytest.raises(ChunkReadError) as caught:
            list(_epoch(pipe, oracle))
        assert time.monotonic() - start < 2.0
        assert [n for path, n in proxy.gets.items() if key in path] == [1]
        pipe.close()
    text = str(caught.value)
    assert caught.value.key == key and isinstance(caught.value.__cause__, PermissionError)
    for words in ("s3:ListBucket", "absent", "expired", "state_dict()"):
        assert words in text, (words, text)
    assert _pipeline_threads() == []
