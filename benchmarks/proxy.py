"""A latency proxy that also counts HTTP requests and response bytes (loopback only).

:class:`CountingLatencyProxy` is :class:`insitubatch_nodes.testing.LatencyProxy` (every
client→server chunk of bytes is delayed by ``delay_s``, so each request pays about one extra
round trip) plus a small HTTP/1.1 parser on both directions of every connection. It counts
requests by method and the body bytes of the responses, and serves its cumulative counters as
one JSON object to anyone who connects to ``stats_port`` (see
``benchmarks._childutil.proxy_snapshot``), so a measurement child can difference them around
each epoch whatever engine it runs. The object also carries the CPU the S3 stand-in spends on
this machine, in ms: ``proxy_cpu_ms`` (the proxy's own thread) and ``server_cpu_ms`` (the
server process ``server_pid`` and its descendants, when given) — on a small machine the
engines share the cores with both.

The bytes are forwarded unchanged; the parser only looks at them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Callable

from benchmarks._childutil import proc_cpu_seconds, tree_pids
from insitubatch_nodes.testing import LatencyProxy, free_port

__all__ = ["CountingLatencyProxy"]

_COUNTERS = (
    "connections",
    "requests",
    "gets",
    "heads",
    "lists",
    "other_requests",
    "get_body_bytes",
    "body_bytes",
    "wire_up_bytes",
    "wire_down_bytes",
    "status_4xx",
    "status_5xx",
)


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


class _HttpConn:
    """Request/response framing of one keep-alive connection (requests answered in order)."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.c = counters
        self.methods: deque[tuple[str, bool]] = deque()  # (method, is_list)
        self.req_buf = b""
        self.req_body_left = 0
        self.resp_buf = b""
        self.resp_state = "head"  # head|body|chunk-*|eof
        self.resp_left = 0
        self.resp_method = ""

    # -- client -> server ---------------------------------------------------------------------
    def feed_request(self, data: bytes) -> None:
        self.c["wire_up_bytes"] += len(data)
        buf = self.req_buf + data
        while buf:
            if self.req_body_left:
                take = min(self.req_body_left, len(buf))
                self.req_body_left -= take
                buf = buf[take:]
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head, buf = buf[:end], buf[end + 4 :]
            request_line = head.split(b"\r\n", 1)[0].split(b" ")
            method = request_line[0].decode("latin-1").upper()
            target = request_line[1] if len(request_line) > 1 else b""
            is_list = method == "GET" and (b"list-type=" in target or target.endswith(b"?"))
            self.c["requests"] += 1
            if is_list:
                self.c["lists"] += 1
            elif method == "GET":
                self.c["gets"] += 1
            elif method == "HEAD":
                self.c["heads"] += 1
            else:
                self.c["other_requests"] += 1
            self.methods.append((method, is_list))
            length = _header(head, b"content-length")
            self.req_body_left = int(length) if length else 0
        self.req_buf = buf

    # -- server -> client ---------------------------------------------------------------------
    def _body(self, n: int) -> None:
        self.c["body_bytes"] += n
        if self.resp_method == "GET":
            self.c["get_body_bytes"] += n

    def feed_response(self, data: bytes) -> None:
        self.c["wire_down_bytes"] += len(data)
        buf = self.resp_buf + data
        while buf:
            state = self.resp_state
            if state == "eof":  # body delimited by connection close
                self._body(len(buf))
                buf = b""
            elif state in ("body", "chunk-data", "chunk-crlf"):
                take = min(self.resp_left, len(buf))
                if state != "chunk-crlf":
                    self._body(take)
                self.resp_left -= take
                buf = buf[take:]
                if self.resp_left == 0:
                    if state == "body":
                        self.resp_state = "head"
                    elif state == "chunk-data":  # the payload is followed by CRLF
                        self.resp_state, self.resp_left = "chunk-crlf", 2
                    else:
                        self.resp_state = "chunk-size"
            elif state == "chunk-size":
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(buf[:end].split(b";")[0].strip() or b"0", 16)
                buf = buf[end + 2 :]
                if size == 0:
                    self.resp_state = "chunk-trailer"
                else:
                    self.resp_state, self.resp_left = "chunk-data", size
            elif state == "chunk-trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                buf = buf[end + 2 :]
                if end == 0:  # the empty line that ends the trailers
                    self.resp_state = "head"
            else:  # head
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head, buf = buf[:end], buf[end + 4 :]
                parts = head.split(b"\r\n", 1)[0].split(b" ")
                status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
                if 100 <= status < 200:
                    continue  # an interim response: the real one follows
                method, _ = self.methods.popleft() if self.methods else ("", False)
                self.resp_method = method
                if status >= 500:
                    self.c["status_5xx"] += 1
                elif status >= 400:
                    self.c["status_4xx"] += 1
                length = _header(head, b"content-length")
                chunked = (_header(head, b"transfer-encoding") or b"").lower() == b"chunked"
                if method == "HEAD" or status in (204, 304):
                    self.resp_state = "head"
                elif chunked:
                    self.resp_state = "chunk-size"
                elif length is not None:
                    self.resp_left = int(length)
                    self.resp_state = "body" if self.resp_left else "head"
                else:
                    self.resp_state = "eof"
        self.resp_buf = buf


class CountingLatencyProxy(LatencyProxy):
    """``LatencyProxy`` that counts requests/bytes and serves the counters on ``stats_port``."""

    def __init__(
        self,
        target_port: int,
        delay_s: float = 0.015,
        port: int | None = None,
        server_pid: int | None = None,
    ) -> None:
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.server_pid = server_pid
        self.stats_port = free_port()
        self._stats_server: asyncio.base_events.Server | None = None
        super().__init__(target_port, delay_s=delay_s, port=port)

    def _main(self) -> None:
        async def start_stats() -> None:
            self._stats_server = await asyncio.start_server(
                self._serve_stats, "127.0.0.1", self.stats_port
            )

        self._loop.run_until_complete(start_stats())
        super()._main()

    async def _serve_stats(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(json.dumps(self._with_cpu(dict(self.counters))).encode())
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def _with_cpu(self, counters: dict[str, int]) -> dict[str, int]:
        """``counters`` plus the CPU ms of the proxy's thread (call on the proxy's loop) and of
        the server's process tree."""
        counters["proxy_cpu_ms"] = round(1000 * time.thread_time())
        if self.server_pid is not None:
            cpu = sum(proc_cpu_seconds(p) for p in tree_pids(self.server_pid))
            counters["server_cpu_ms"] = round(1000 * cpu)
        return counters

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters (CPU included), taken on the proxy's loop."""

        async def copy() -> dict[str, int]:
            return self._with_cpu(dict(self.counters))

        return asyncio.run_coroutine_threadsafe(copy(), self._loop).result(5)

    def _observers(self) -> tuple[Callable[[bytes], None], Callable[[bytes], None]]:
        self.counters["connections"] += 1
        conn = _HttpConn(self.counters)
        return conn.feed_request, conn.feed_response

    def stop(self) -> None:
        async def close_stats() -> None:
            if self._stats_server is not None:
                self._stats_server.close()

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_stats(), self._loop).result(5)
        super().stop()
