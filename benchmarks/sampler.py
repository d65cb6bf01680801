"""Peak memory of a child's whole process tree, sampled from the outside.

:class:`TreeSampler` runs in the harness (not in the measured process) and polls the resident
set size of a pid and all its descendants every ``period_s``, with ``time.monotonic()`` stamps,
so the peak of any window the child reports (an epoch) can be cut out afterwards. It uses
psutil when installed (the ``bench`` extra) and reads ``/proc`` otherwise; either way it reads
only ``/proc/PID/stat`` and ``/proc/PID/statm``, which do not lock the target's memory map.
(PSS from ``/proc/PID/smaps_rollup`` was tried and dropped: walking the page tables of the
measured process every 100 ms delayed its page faults by ~15 ms per walk, enough to distort a
cold in-memory epoch.)

RSS is summed over the tree: pages shared between processes (a spawned worker's copy of the
torch libraries, for instance) count once per process, as ``ps``/``top`` would show them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from benchmarks._childutil import tree_pids

__all__ = ["TreeSampler", "rss_source", "tree_rss"]

try:  # pragma: no cover - depends on the environment
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_source() -> str:
    return "psutil" if psutil is not None else "procfs"


def _rss_proc(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(pid: int) -> int:
    """RSS bytes summed over ``pid`` and its descendants (0 once it is gone)."""
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        rss = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                rss += int(proc.memory_info().rss)
        return rss
    return sum(_rss_proc(p) for p in tree_pids(pid))


class TreeSampler:
    """Sample the RSS of ``pid``'s tree on a daemon thread until :meth:`stop`."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int]] = []  # (monotonic, rss)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss(self.pid)
            if rss:
                self.samples.append((time.monotonic(), rss))
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def at(self, t: float) -> int | None:
        """RSS of the last sample taken at or before ``t`` (the first one if none was)."""
        before = [s for s in self.samples if s[0] <= t]
        if before:
            return before[-1][1]
        return self.samples[0][1] if self.samples else None

    def peak(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Peak RSS within ``[t0, t1]`` (the whole run when not given). A window shorter than
        the sampling period takes the nearest sample."""
        window = [
            s for s in self.samples if (t0 is None or s[0] >= t0) and (t1 is None or s[0] <= t1)
        ]
        if not window and self.samples and t0 is not None:
            mid = (t0 + (t1 if t1 is not None else t0)) / 2
            window = [min(self.samples, key=lambda s: abs(s[0] - mid))]
        if not window:
            return {"rss_peak_bytes": None, "memory_samples": 0}
        return {"rss_peak_bytes": max(s[1] for s in window), "memory_samples": len(window)}
