"""The GIL probe of ``insitubatch-nodes check-transform``: does a transform hold the GIL while
it runs?

The transform runs over and over in a worker thread while the calling (main) thread runs Python,
so it wants the GIL all the time. On Linux both threads' scheduler statistics are read at the
probe's start and end (:func:`thread_sched`: seconds on a CPU, seconds waiting for one). The
main thread's wait for the GIL is the wall time less its time on a CPU and its time waiting for
one. While it waits, the worker holds the GIL, and is then ready to run: on a CPU or waiting for
one. So the share of the worker's ready time (on a CPU plus waiting for one) that the main
thread spent waiting for the GIL is the share of that time the worker held it
(:func:`gil_share`). A busy machine stretches the worker's running and its waits for a CPU
alike, so the share stays put: measured on this project's 2-core machine with 0, 4 and 12
processes spinning, 48-100 % for a transform that runs Python per element and 0-15 % for a
vectorized one (docs/transforms.md has the runs). A share of the *wall* time (what the probe
judged by before) shrinks for the first as the machine gets busier (the main thread spends the
time waiting for a CPU instead).

Per-window attribution (only the main thread's waits during which the worker was on a CPU) is
what the scheduler cannot give: a thread's CPU time and its waits are brought up to date at a
tick or a switch (10 ms apart and later on this project's machine), not at each reading.

What no measure talks a busy machine out of is starvation: a probe whose threads spent most of
the wall time waiting for a CPU (:func:`cpu_wait_share` at :data:`TOO_BUSY` or more) saw too
little of them running to judge, and the CLI says so instead of giving a verdict. Off Linux
(no schedstat) the probe falls back to the main thread's pauses of half a switch interval or
more as a share of the wall time, which a busy machine moves either way.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GilProbe", "ProbeTimes", "cpu_wait_share", "gil_probe", "gil_share", "thread_sched"]

SchedStat = tuple[float, float]
"""A thread's seconds on a CPU and seconds waiting for one (ready while others ran)."""

TOO_BUSY = 0.5
"""The probe threads' share of the wall time spent waiting for a CPU from which a probe is no
verdict: they spent most of it waiting."""


def thread_sched(thread: threading.Thread) -> SchedStat | None:
    """``thread``'s (a started thread of this process) seconds on a CPU and seconds waiting for
    one, from Linux's per-thread schedstat; ``None`` where there is none (not Linux)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/schedstat", "rb") as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


@dataclass(frozen=True)
class ProbeTimes:
    """A probe's ``wall`` seconds and, in them, each thread's seconds on a CPU and waiting for
    one: the main thread's (``main_*``) and the transform's (``worker_*``)."""

    wall: float
    main_on: float
    main_waiting: float
    worker_on: float
    worker_waiting: float

    @property
    def main_gil_wait(self) -> float:
        """The main thread's seconds neither on a CPU nor waiting for one: waiting for the GIL
        (it does nothing else)."""
        return max(0.0, self.wall - self.main_on - self.main_waiting)


def gil_share(times: ProbeTimes) -> float:
    """The share of the transform's ready time (on a CPU or waiting for one) in which the main
    thread waited for the GIL, that is, in which the transform held it; in [0, 1]."""
    ready = times.worker_on + times.worker_waiting
    return min(1.0, times.main_gil_wait / max(ready, 1e-9))


def cpu_wait_share(times: ProbeTimes) -> float:
    """The probe threads' share of the wall time (each thread's) spent waiting for a CPU."""
    waiting = times.main_waiting + times.worker_waiting
    return min(1.0, max(0.0, waiting / max(2 * times.wall, 1e-9)))


@dataclass(frozen=True)
class GilProbe:
    """What one probe found: ``held``, the share of the transform's ready time it held the GIL
    (:func:`gil_share`; off Linux, ``measured == "wall"``: the share of the wall time the main
    thread paused); ``calls`` completed in ``wall`` seconds; ``cpu_wait``, the probe threads'
    share of the wall time spent waiting for a CPU (``None`` off Linux). ``too_busy``: they
    spent most of it waiting, and ``held`` is no verdict."""

    held: float
    calls: int
    wall: float
    cpu_wait: float | None = None
    measured: str = "ready"
    times: ProbeTimes | None = None

    @property
    def too_busy(self) -> bool:
        return self.cpu_wait is not None and self.cpu_wait >= TOO_BUSY


def gil_probe(
    call: Callable[[], Any],
    seconds: float = 1.0,
    interval: float = 0.05,
    min_calls: int = 2,
    *,
    clock: Callable[[], float] = time.perf_counter,
    sched: Callable[[threading.Thread], SchedStat | None] = thread_sched,
) -> GilProbe:
    """Run ``call`` repeatedly in a worker thread while this thread runs Python, for at least
    ``seconds`` and ``min_calls`` calls, and measure how much of the worker's time it held the
    GIL (module docstring). An exception in ``call`` is re-raised.

    The switch interval is set to ``interval`` for the probe (and restored): a thread holding
    the GIL is made to give it up after that long, so a GIL-holding ``call`` keeps this thread
    waiting up to one interval at a time. ``clock`` (seconds) and ``sched`` (a thread's
    schedstat, as :func:`thread_sched` reads it) are what the probe reads, for tests to script.
    """
    stop = threading.Event()
    done = [0]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while not stop.is_set():
                call()
                done[0] += 1
        except BaseException as exc:
            errors.append(exc)

    me = threading.current_thread()
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        thread = threading.Thread(target=work, name="gil-probe", daemon=True)
        thread.start()
        start = last = clock()
        before = sched(me), sched(thread)
        paused = 0.0
        while True:
            now = clock()
            gap = now - last
            if gap >= interval / 2:
                paused += gap
            last = now
            if errors or not thread.is_alive():
                break
            if now - start >= seconds and done[0] >= min_calls:
                break
        after = sched(me), sched(thread)
        stop.set()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]
    wall = last - start
    (m0, w0), (m1, w1) = before, after
    if m0 is None or w0 is None or m1 is None or w1 is None:
        return GilProbe(min(1.0, paused / max(wall, 1e-9)), done[0], wall, measured="wall")
    times = ProbeTimes(wall, m1[0] - m0[0], m1[1] - m0[1], w1[0] - w0[0], w1[1] - w0[1])
    return GilProbe(gil_share(times), done[0], wall, cpu_wait_share(times), "ready", times)
