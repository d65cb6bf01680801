"""Local stand-ins for object storage, for tests and benchmarks (loopback only).

* :class:`MotoServer` — a real S3 endpoint (``moto_server`` from ``moto[server]``) on
  ``127.0.0.1``, started in a subprocess and stopped on exit.
* :class:`LatencyProxy` — a TCP proxy on ``127.0.0.1`` that delays every chunk of bytes the
  client sends by ``delay_s`` (so each request pays roughly one extra round trip), to imitate a
  remote store. It runs its own event loop on a daemon thread.
* :class:`FaultProxy` — an HTTP/1.1 proxy on ``127.0.0.1`` that answers the first few GETs of
  every object (or every GET for ``burst_s`` seconds) with an error status (503 by default)
  and forwards the rest, to check that transient errors are retried and the data still
  arrive exact.
* :class:`NginxServer` — nginx (the Debian package, run as a child process with a config of
  its own) serving a local folder over HTTP on ``127.0.0.1``, byte ranges included, with chosen
  paths answered by a fixed status (404, 503, ...): a plain web server for ``http://`` stores
  (``https://`` with a self-signed certificate, ``tls=True``).
* :func:`upload_folder` — copy a local zarr folder into a bucket.

Nothing here talks to anything but the loopback interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "FaultProxy",
    "LatencyProxy",
    "MotoServer",
    "NginxServer",
    "free_port",
    "moto_server_argv",
    "nginx_executable",
    "put_folder",
    "upload_folder",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# moto_server's own entry point, except that moto's list of its service folders is read once:
# moto 5.2 lists its package folder (a listdir and ~180 stats) twice a request to route it,
# 1.1 of the 2.0 CPU-ms a request cost in the server (300 PUTs, GETs and ranged GETs of 1 kB
# from obstore: 2.35 -> 1.35 CPU-s, 2026-12-07); the folder does not change while it runs.
_MOTO_MAIN = """
import sys
import moto.backends
if hasattr(moto.backends, "list_of_moto_modules"):  # (another moto: its own routing)
    _modules = tuple(moto.backends.list_of_moto_modules())
    moto.backends.list_of_moto_modules = lambda: _modules
from moto.server import main
sys.exit(main(sys.argv[1:]))
"""


def moto_server_argv(port: int) -> list[str]:
    """The command that serves S3 with moto on ``127.0.0.1:port``: this interpreter running
    moto's server (the ``moto[server]`` installed beside the package, not whichever
    ``moto_server`` comes first on ``PATH``: a pyenv shim there started another Python's moto
    through two bash scripts, 1.0-1.1 CPU-s a start), else ``moto_server`` from ``PATH``.
    Raises ``FileNotFoundError`` saying what to install where there is neither."""
    import importlib.util

    args = ["-H", "127.0.0.1", "-p", str(port)]
    if all(importlib.util.find_spec(name) is not None for name in ("moto", "flask", "werkzeug")):
        return [sys.executable, "-c", _MOTO_MAIN, *args]
    exe = shutil.which("moto_server")
    if exe is None:
        raise FileNotFoundError("moto_server not found: pip install 'moto[server]'")
    return [exe, *args]


class MotoServer:
    """``moto_server`` on loopback (see :func:`moto_server_argv`). Use as a context manager;
    ``endpoint`` is its URL."""

    def __init__(self, port: int | None = None, startup_timeout_s: float = 30.0) -> None:
        self.port = port or free_port()
        argv = moto_server_argv(self.port)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        """The server process's id (to account its CPU, say)."""
        return self._proc.pid

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)

    def options(self, **extra: Any) -> dict[str, Any]:
        """``open_store`` options for this endpoint (dummy credentials, plain HTTP)."""
        return {
            "endpoint": self.endpoint,
            "region": "us-east-1",
            "access_key_id": "testing",
            "secret_access_key": "testing",
            "client_options": {"allow_http": True},
            **extra,
        }

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def nginx_executable() -> str | None:
    """The nginx binary (``PATH``, then ``/usr/sbin/nginx``, which a non-root ``PATH`` may
    lack), or ``None`` when nginx is not installed (``apt-get install nginx``)."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


class NginxServer:
    r"""nginx on ``127.0.0.1:port`` serving the folder ``root`` read-only (a plain web server).

    ``endpoint`` is its URL: a file ``root/a/b`` is at ``endpoint + "/a/b"``; nginx answers
    ``Range`` requests with 206 and a missing file with 404, and cannot list (``PROPFIND`` is
    405). ``statuses`` maps nginx location regexes (matched against the URL path, e.g.
    ``r"^/broken\.zarr/t2m/c/"``) to a status nginx returns for them instead of the file.
    With ``tls=True`` it serves HTTPS (``endpoint`` is ``https://127.0.0.1:port``) with a
    self-signed certificate made by the ``openssl`` command for this server alone: clients
    must skip verification (obstore: ``client_options={"allow_invalid_certificates": True}``).

    nginx runs as a child process in the foreground, single-process (``daemon off;
    master_process off;``), with its config, pid file, logs and temporary folders in a
    temporary directory of its own; :meth:`stop` (or leaving the ``with`` block) ends it and
    removes that directory. ``access_log()`` returns the requests logged so far. Raises
    ``FileNotFoundError`` when nginx is not installed and ``RuntimeError`` (with nginx's error
    log) when it does not start.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        statuses: Mapping[str, int] | None = None,
        tls: bool = False,
        port: int | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        exe = nginx_executable()
        if exe is None:
            raise FileNotFoundError("nginx not found: apt-get install nginx")
        openssl = shutil.which("openssl") if tls else None
        if tls and openssl is None:
            raise FileNotFoundError("openssl not found (tls=True makes a certificate with it)")
        self.root = Path(root).absolute()
        self.port = port or free_port()
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="insitubatch-nginx-")
        work = Path(self._dir.name)
        listen = f"127.0.0.1:{self.port}"
        if openssl is not None:
            cert, key = work / "cert.pem", work / "key.pem"
            request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
            subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
            files = ["-keyout", str(key), "-out", str(cert)]
            subprocess.run([openssl, *request, *subject, *files], check=True, capture_output=True)
            listen += f' ssl;\n        ssl_certificate "{cert}";\n'
            listen += f'        ssl_certificate_key "{key}"'

        self._access_log = work / "access.log"
        self._error_log = work / "error.log"
        specials = "".join(
            f'        location ~ "{pattern}" {{ return {int(status)}; }}\n'
            for pattern, status in (statuses or {}).items()
        )
        temps = "".join(
            f"    {name}_temp_path {work / name};\n"
            for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        config = work / "nginx.conf"
        config.write_text(
            "daemon off;\nmaster_process off;\nworker_processes 1;\n"
            f"pid {work / 'nginx.pid'};\nerror_log {self._error_log} warn;\n"
            "events { worker_connections 256; }\n"
            "http {\n"
            '    map $http_authorization $signed { "" "unsigned"; default "signed"; }\n'
            "    log_format plain '$request $status $signed';\n"
            f"    access_log {self._access_log} plain;\n"
            f"{temps}"
            "    default_type application/octet-stream;\n"
            "    keepalive_requests 100000;\n"
            "    server {\n"
            f"        listen {listen};\n"
            f'        root "{self.root}";\n'
            f"{specials}"
            "        location / { }\n"
            "    }\n"
            "}\n"
        )
        self._proc = subprocess.Popen(
            [exe, "-p", str(work), "-e", str(self._error_log), "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + startup_timeout_s
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                log = self._error_log.read_text() if self._error_log.exists() else ""
                self.stop()
                raise RuntimeError(f"nginx did not start on port {self.port}: {log.strip()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    @property
    def pid(self) -> int:
        """The nginx process's id."""
        return self._proc.pid

    def access_log(self) -> list[str]:
        """The requests logged so far, one line each: ``"GET /path HTTP/1.1 206 unsigned"``
        (request line, status, and whether it carried an ``Authorization`` header)."""
        if not self._access_log.exists():
            return []
        return self._access_log.read_text().splitlines()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._dir.cleanup()

    def __enter__(self) -> NginxServer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def upload_folder(folder: str | os.PathLike[str], bucket: str, prefix: str, **options: Any) -> int:
    """Create ``bucket`` (if needed) and upload every file under ``folder`` to ``prefix/``.

    ``options`` are S3 options as for :class:`MotoServer.options`. Returns the object count.
    Each file is one plain PUT of its bytes (obstore's; the bucket is made with boto3): boto3's
    ``upload_file`` spent 4.6 ms of CPU a file in the client (a transfer manager per file).
    """
    import boto3
    from obstore.store import S3Store

    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint"],
        region_name=options.get("region", "us-east-1"),
        aws_access_key_id=options.get("access_key_id", "testing"),
        aws_secret_access_key=options.get("secret_access_key", "testing"),
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    client_options: Any = dict(options.get("client_options") or {})  # obstore's ClientConfig
    if str(options["endpoint"]).startswith("http://"):
        client_options.setdefault("allow_http", True)
    store = S3Store(
        bucket,
        endpoint=options["endpoint"],
        region=options.get("region", "us-east-1"),
        access_key_id=options.get("access_key_id", "testing"),
        secret_access_key=options.get("secret_access_key", "testing"),
        client_options=client_options,
    )
    return put_folder(store, folder, prefix)


def put_folder(store: Any, folder: str | os.PathLike[str], prefix: str) -> int:
    """Put every file under ``folder`` into the obstore ``store`` at ``prefix/<relative
    path>``, one plain PUT of its bytes each; return the object count."""
    import obstore

    root = Path(folder)
    count = 0
    for path in sorted(root.rglob("*")):
        if path.is_file():
            key = f"{prefix.strip('/')}/{path.relative_to(root).as_posix()}".lstrip("/")
            obstore.put(store, key, path.read_bytes())
            count += 1
    return count


class _LoopbackServer:
    """A TCP server on ``127.0.0.1:port`` with its own event loop on a daemon thread.

    Subclasses implement ``_handle(reader, writer)``. Use as a context manager or call
    :meth:`stop`, which closes the server and cancels the connections it is handling.
    """

    name = "loopback-server"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{self.name} did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        async def _close() -> None:
            if self._server is not None:
                self._server.close()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class LatencyProxy(_LoopbackServer):
    """Forward ``127.0.0.1:port`` to ``target_port``, delaying each client→server chunk."""

    name = "latency-proxy"

    def __init__(self, target_port: int, delay_s: float = 0.010, port: int | None = None) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        super().__init__(port)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        delay: float,
        observe: Callable[[bytes], None] | None = None,
    ) -> None:
        try:
            while data := await reader.read(1 << 16):
                if observe is not None:
                    with contextlib.suppress(ValueError, IndexError):  # never break the transfer
                        observe(data)
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        up, down = self._observers()
        await asyncio.gather(
            self._pipe(reader, up_w, self.delay_s, up), self._pipe(up_r, writer, 0.0, down)
        )

    def _observers(
        self,
    ) -> tuple[Callable[[bytes], None] | None, Callable[[bytes], None] | None]:
        """Per connection: callbacks that see the client's and the server's bytes (none here;
        a subclass can count requests)."""
        return None, None


_REASONS = {429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}


class FaultProxy(_LoopbackServer):
    """An HTTP/1.1 proxy ``127.0.0.1:port`` → ``127.0.0.1:target_port`` that injects errors.

    The first ``fail_first`` GETs of each path (the object's URL path; the query string and
    byte range do not matter) are answered by the proxy itself with ``status`` (503 by default,
    an S3 ``SlowDown`` body) on the same keep-alive connection — or, with ``reset=True``,
    forwarded and cut off half-way through the body (of a 200/206 answer) by a connection
    reset. With ``match``, only paths that contain it are faulted. Every other request is
    forwarded to the target unchanged.
    With ``burst_s``, every matching GET is faulted for ``burst_s`` seconds from the first
    matching GET on (a burst: what an overloaded S3 prefix answers), whatever ``fail_first``
    says; the ones after it are forwarded. ``burst_started`` is that first GET's
    ``time.monotonic()`` (None before it).
    ``gets`` counts the GETs seen per path and ``injected`` the faults injected. Requests with
    a body must carry a ``Content-Length`` (what S3 clients send); responses are relayed by
    ``Content-Length``, chunked encoding or connection close. It runs its own event loop on a
    daemon thread; use it
    as a context manager or call :meth:`stop`.

    A subclass scripts other faults by overriding :meth:`_action`, which says what to do with
    each request: ``None`` forwards it, an int answers that status itself, ``"reset"``
    forwards and resets the connection half-way through the body, ``"close"`` closes it there
    in order (FIN), ``"stall"`` never answers, ``"stall_body"`` sends half the body and then
    nothing.
    """

    name = "fault-proxy"

    def __init__(
        self,
        target_port: int,
        *,
        fail_first: int = 2,
        status: int = 503,
        reset: bool = False,
        match: str = "",
        burst_s: float | None = None,
        port: int | None = None,
    ) -> None:
        if fail_first < 0:
            raise ValueError(f"fail_first must be >= 0, got {fail_first}")
        if burst_s is not None and not burst_s > 0:
            raise ValueError(f"burst_s must be positive seconds, got {burst_s}")
        self.target_port, self.fail_first, self.status = target_port, fail_first, status
        self.reset, self.match, self.burst_s = reset, match, burst_s
        self.burst_started: float | None = None
        self.gets: Counter[str] = Counter()
        self.injected = 0
        self._lock = threading.Lock()
        super().__init__(port)

    def _should_fail(self, method: str, target: str) -> bool:
        if method != "GET":
            return False
        path = target.split("?", 1)[0]
        with self._lock:
            self.gets[path] += 1
            if self.match not in path:
                return False
            if self.burst_s is None:
                fail = self.gets[path] <= self.fail_first
            else:
                now = time.monotonic()
                if self.burst_started is None:
                    self.burst_started = now
                fail = now - self.burst_started < self.burst_s
            self.injected += fail
        return fail

    def _action(self, method: str, target: str) -> int | str | None:
        """What to do with this request (see the class docstring): ``fail_first``, ``burst_s``
        and ``match`` decide whether it is faulted, ``reset`` how."""
        if not self._should_fail(method, target):
            return None
        return "reset" if self.reset else self.status

    def _error_response(self, status: int) -> bytes:
        body = (
            b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
            b"<Message>injected by FaultProxy</Message></Error>"
        )
        reason = _REASONS.get(status, "Error")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, target = head.split(b" ", 2)[:2]
                headers = _parse_headers(head)
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                act = self._action(method.decode(), target.decode())
                if isinstance(act, int):
                    writer.write(self._error_response(act))
                    await writer.drain()
                    continue
                if act == "stall":
                    await asyncio.sleep(3600)
                # One upstream connection per request: the target may close after each answer.
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
                try:
                    up_w.write(head + body)
                    await up_w.drain()
                    if act in ("close", "stall_body"):  # half the body, then FIN or nothing
                        answer = await up_r.readuntil(b"\r\n\r\n")
                        n = int(_parse_headers(answer)["content-length"])
                        writer.write(answer + (await up_r.readexactly(n))[: n // 2])
                        await writer.drain()
                        if act == "stall_body":
                            await asyncio.sleep(3600)
                        return  # (the finally closes the connection in order)
                    keep = await _relay_response(
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


def _parse_headers(head: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            out[name.strip().lower().decode()] = value.strip().decode()
    return out


async def _relay_response(
    up: asyncio.StreamReader, client: asyncio.StreamWriter, *, head_only: bool, cut: bool = False
) -> bool:
    """Copy one HTTP response from ``up`` to ``client``; False when the connection must close.

    With ``cut`` only the head and half the body (by ``Content-Length``) are sent, then the
    client connection is reset.
    """
    head = await up.readuntil(b"\r\n\r\n")
    client.write(head)
    status = int(head.split(b" ", 2)[1])
    headers = _parse_headers(head)
    if cut and status in (200, 206):
        half = int(headers.get("content-length", "0")) // 2
        client.write(await up.readexactly(half))
        await client.drain()
        client.transport.abort()  # an RST, not an orderly close
        return False
    if head_only or status in (204, 304) or 100 <= status < 200:
        pass
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left:
            data = await up.read(min(left, 1 << 16))
            if not data:
                raise ConnectionResetError("upstream closed mid-body")
            client.write(data)
            left -= len(data)
            await client.drain()
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await up.readuntil(b"\r\n")
            client.write(size_line)
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while (trailer := await up.readuntil(b"\r\n")) != b"\r\n":
                    client.write(trailer)
                client.write(b"\r\n")
                break
            client.write(await up.readexactly(size + 2))
            await client.drain()
    else:  # delimited by the connection closing
        while data := await up.read(1 << 16):
            client.write(data)
            await client.drain()
        await client.drain()
        return False
    await client.drain()
    return headers.get("connection", "").lower() != "close"
