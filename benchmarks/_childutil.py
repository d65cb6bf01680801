"""What every measurement child process shares (stdlib only, plus obstore/zarr when asked).

This module is imported by the engines in this project's venv (as ``benchmarks._childutil``)
*and* by the insitubatch runner in its own Python 3.12 venv (as ``_childutil``, by path), so it
must not import torch, insitubatch_nodes or anything outside the standard library at module
level.

A child reads one JSON config, runs its epochs, and writes one JSON result holding, per epoch,
its wall-clock window on ``time.monotonic()`` (CLOCK_MONOTONIC, shared by every process on the
machine, so the parent can cut its RSS samples to the window), samples, time to first batch,
CPU seconds of its process tree, GET counters and the emitted sample order.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EpochRecord",
    "counting_store",
    "finish",
    "load_config",
    "make_zarr_store",
    "proc_status_bytes",
    "proxy_snapshot",
    "timed_epoch",
    "tree_cpu_seconds",
]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_status_bytes(field: str) -> int | None:
    """A memory figure of this process from ``/proc/self/status`` in bytes (``"VmHWM"``: its own
    peak RSS since its ``exec``; ``"VmRSS"``: now), or None where there is none (off Linux).

    ``ru_maxrss`` is not the peak on Linux: ``exec`` keeps the high-water mark of the memory it
    replaces, which after ``fork``/``vfork`` is the *parent's* (the harness, with torch
    imported), so a small child would report at least its parent's RSS."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_config(argv: list[str]) -> tuple[dict[str, Any], Path]:
    """``CHILD CONFIG_JSON RESULT_JSON`` -> (config, result path)."""
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} CONFIG_JSON RESULT_JSON")
    return json.loads(Path(argv[1]).read_text()), Path(argv[2])


def finish(result_path: Path, result: dict[str, Any]) -> None:
    """Write the result atomically, flush, and leave without interpreter teardown.

    ``os._exit`` skips atexit handlers and finalizers: obstore/tokio runtimes sometimes abort
    the interpreter at exit after heavy async use through a slow endpoint (a known, harmless
    SIGABRT after all work is done), and a worker pool's teardown is not what we measure.
    """
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# CPU seconds of this process and its descendants
# --------------------------------------------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its live descendants, from ``/proc`` (just ``[pid]`` without it)."""
    if not os.path.isdir("/proc"):
        return [pid]
    kids = _children_map()
    out, todo = [pid], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _descendants(pid: int) -> list[int]:
    return tree_pids(pid)[1:]


def proc_cpu_seconds(pid: int) -> float:
    """user+sys seconds of a live process from /proc (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def tree_cpu_seconds() -> float:
    """user+sys CPU seconds of this process, its reaped children and its live descendants."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = sum(proc_cpu_seconds(p) for p in _descendants(os.getpid()))
    return me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime + live


# --------------------------------------------------------------------------------------------
# The counting proxy's stats port (see benchmarks/proxy.py)
# --------------------------------------------------------------------------------------------


def proxy_snapshot(port: int | None) -> dict[str, int] | None:
    """The S3 proxy's cumulative counters, or None when there is no proxy."""
    if not port:
        return None
    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as sock:
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return {k: int(v) for k, v in json.loads(b"".join(chunks)).items()}


def _delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if after is None or before is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in after}


# --------------------------------------------------------------------------------------------
# Epoch timing
# --------------------------------------------------------------------------------------------


@dataclass
class EpochRecord:
    """One epoch as the child saw it."""

    kind: str
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    samples: int = 0
    batches: int = 0
    cpu_s: float = 0.0
    proxy: dict[str, int] | None = None
    engine_io: dict[str, int] | None = None
    order: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "wall_s": self.t_end - self.t_start,
            "ttfb_s": (self.t_first - self.t_start) if self.batches else None,
            "samples": self.samples,
            "batches": self.batches,
            "cpu_s": self.cpu_s,
            "proxy": self.proxy,
            "engine_io": self.engine_io,
            "order": self.order,
            "extra": self.extra,
        }


@contextlib.contextmanager
def timed_epoch(
    kind: str, proxy_port: int | None, engine_io: Callable[[], dict[str, int]] | None = None
) -> Iterator[EpochRecord]:
    """Time one epoch: ``rec.t_start`` is taken right before the body runs; the body calls
    :func:`count_batch` per batch. CPU, proxy and engine counters are differenced around it."""
    rec = EpochRecord(kind)
    px0 = proxy_snapshot(proxy_port)
    io0 = engine_io() if engine_io else None
    cpu0 = tree_cpu_seconds()
    rec.t_start = time.monotonic()
    yield rec
    rec.t_end = time.monotonic()
    rec.cpu_s = tree_cpu_seconds() - cpu0
    rec.proxy = _delta(proxy_snapshot(proxy_port), px0)
    rec.engine_io = _delta(engine_io(), io0) if engine_io and io0 is not None else None


def count_batch(rec: EpochRecord, n: int, indices: Iterable[int] | None) -> None:
    """Account one delivered batch of ``n`` samples (and its sample indices, if known)."""
    if rec.batches == 0:
        rec.t_first = time.monotonic()
    rec.batches += 1
    rec.samples += n
    if indices is not None:
        rec.order.extend(int(i) for i in indices)


# --------------------------------------------------------------------------------------------
# Stores (obstore-backed zarr stores, the same I/O layer for every engine)
# --------------------------------------------------------------------------------------------


def make_obstore(cfg: dict[str, Any]) -> Any:
    """An obstore store from a store config: ``{"kind": "local", "path": ...}`` or
    ``{"kind": "s3", "bucket", "prefix", "endpoint"}`` (dummy credentials, plain HTTP)."""
    from obstore.store import LocalStore, S3Store

    if cfg["kind"] == "local":
        return LocalStore(cfg["path"])
    if cfg["kind"] == "s3":
        return S3Store(
            cfg["bucket"],
            prefix=cfg["prefix"],
            endpoint=cfg["endpoint"],
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            client_options={"allow_http": True},
        )
    raise ValueError(f"unknown store kind {cfg['kind']!r}")


def make_zarr_store(cfg: dict[str, Any]) -> Any:
    """A read-only ``zarr.storage.ObjectStore`` over :func:`make_obstore`."""
    import zarr.storage

    return zarr.storage.ObjectStore(make_obstore(cfg), read_only=True)


def counting_store(inner: Any, gets: Any, nbytes: Any) -> Any:
    """Wrap a zarr store so every ``get``/``get_partial_values`` adds to two counters.

    ``gets``/``nbytes`` are objects with ``.value`` and ``.get_lock()`` (e.g.
    ``multiprocessing`` ``Value`` s, shared with spawned workers) or anything with a ``value``.
    Metadata reads are counted too (they are GETs the engine makes).
    """
    from zarr.storage import WrapperStore

    def add(n_gets: int, n_bytes: int) -> None:
        lock = gets.get_lock() if hasattr(gets, "get_lock") else contextlib.nullcontext()
        with lock:
            gets.value += n_gets
            nbytes.value += n_bytes

    class CountingStore(WrapperStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            buf = await self._store.get(key, prototype, byte_range)
            add(1, len(buf) if buf is not None else 0)
            return buf

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
            key_ranges = list(key_ranges)
            out = await self._store.get_partial_values(prototype, key_ranges)
            add(len(key_ranges), sum(len(b) for b in out if b is not None))
            return out

        def _with_store(self, store: Any) -> Any:
            return counting_store(store, gets, nbytes)

    return CountingStore(inner)


class LocalCounter:
    """A plain counter with the ``Value`` interface (for single-process engines)."""

    def __init__(self) -> None:
        self.value = 0
