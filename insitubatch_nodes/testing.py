"""Local stand-ins for object storage, for tests and benchmarks (loopback only).

* :class:`MotoServer` — a real S3 endpoint (``moto_server`` from ``moto[server]``) on
  ``127.0.0.1``, started in a subprocess and stopped on exit.
* :class:`LatencyProxy` — a TCP proxy on ``127.0.0.1`` that delays every chunk of bytes the
  client sends by ``delay_s`` (so each request pays roughly one extra round trip), to imitate a
  remote store. It runs its own event loop on a daemon thread.
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
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["LatencyProxy", "MotoServer", "free_port", "upload_folder"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``moto_server`` on loopback. Use as a context manager; ``endpoint`` is its URL."""

    def __init__(self, port: int | None = None, startup_timeout_s: float = 30.0) -> None:
        exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        if not Path(exe).exists():
            raise FileNotFoundError("moto_server not found: pip install 'moto[server]'")
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)],
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


def upload_folder(folder: str | os.PathLike[str], bucket: str, prefix: str, **options: Any) -> int:
    """Create ``bucket`` (if needed) and upload every file under ``folder`` to ``prefix/``.

    ``options`` are S3 options as for :class:`MotoServer.options`. Returns the object count.
    """
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint"],
        region_name=options.get("region", "us-east-1"),
        aws_access_key_id=options.get("access_key_id", "testing"),
        aws_secret_access_key=options.get("secret_access_key", "testing"),
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    root = Path(folder)
    count = 0
    for path in sorted(root.rglob("*")):
        if path.is_file():
            key = f"{prefix.strip('/')}/{path.relative_to(root).as_posix()}".lstrip("/")
            client.upload_file(str(path), bucket, key)
            count += 1
    return count


class LatencyProxy:
    """Forward ``127.0.0.1:port`` to ``target_port``, delaying each client→server chunk."""

    def __init__(self, target_port: int, delay_s: float = 0.010, port: int | None = None) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._main, name="latency-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("latency proxy did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()

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

    def stop(self) -> None:
        async def _close() -> None:
            if self._server is not None:
                self._server.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
