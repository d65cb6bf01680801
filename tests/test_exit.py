"""A process that reads through the package exits with its own status, even when one of obstore's
runtime threads is still inside its call into the IO loop as the interpreter exits.

That thread hands each finished request to the loop with ``call_soon_threadsafe``, which releases
the GIL for a socket write. Before Python 3.14 a thread that takes the GIL back once the
interpreter finalizes is ended with ``pthread_exit``, which aborts the process on a Rust stack
(CI saw a command-line process die with -6 after its output was written). The package's exit
hook waits for such calls to end before finalization begins (``_process.drain_wakeups``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import zarr

ROOT = Path(__file__).resolve().parents[1]

# The wakeup of one GET nobody waits for is held inside the loop's call (the GIL released, as in
# the socket write) until the exit hooks run, then for 50 ms: on the old code it woke while the
# finalizing garbage collection walked the garbage below, and the process aborted.
_HELD_AT_EXIT = """
import asyncio, atexit, sys, threading, time

called, armed, exiting = threading.Event(), threading.Event(), threading.Event()
unheld = asyncio.BaseEventLoop.call_soon_threadsafe

def held(self, callback, *args, context=None):
    if armed.is_set() and threading.current_thread().name.startswith("Dummy"):
        armed.clear()
        called.set()
        exiting.wait()
        time.sleep(0.05)
    return unheld(self, callback, *args, context=context)

asyncio.BaseEventLoop.call_soon_threadsafe = held

import obstore
from insitubatch_nodes import _runtime, open_geometries
from insitubatch_nodes.io.stores import as_store

store = as_store(sys.argv[1])
assert open_geometries(store, ["t2m"])["t2m"].shape == (4, 8)

async def get():
    return await obstore.get_async(store.store, "t2m/zarr.json")

armed.set()
asyncio.run_coroutine_threadsafe(get(), _runtime.io_loop())
assert called.wait(30)

class Node:
    pass

garbage = []
for _ in range(300_000):
    a, b = Node(), Node()
    a.b, b.a = b, a
    garbage.append(a)
atexit.register(exiting.set)  # runs before the package's exit hook
sys.exit(3)
"""


def test_a_process_exits_with_its_status_while_an_obstore_thread_is_inside_the_loops_wakeup(
    tmp_path: Path,
) -> None:
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array("t2m", shape=(4, 8), chunks=(2, 8), dtype="f4")[...] = np.ones((4, 8))
    done = subprocess.run(
        [sys.executable, "-c", _HELD_AT_EXIT, str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 3, done.stderr[-3000:]


# zarr's exit hook asks its IO loop to stop, joins the loop's thread for 0.2 s and closes the
# loop whether the thread has left run_forever or not. Here the loop's thread is inside a
# callback that lasts until the close has begun: the join times out, as it does when a loaded
# machine does not schedule the thread in time, and the old close raised "Cannot close a
# running event loop" (printed at a recipe's exit).
_CLOSED_WHILE_RUNNING = """
import threading
from insitubatch_nodes import _runtime

loop = _runtime.io_loop()
inside, release = threading.Event(), threading.Event()

def busy():
    inside.set()
    release.wait(30)

loop.call_soon_threadsafe(busy)
assert inside.wait(30)
guarded = loop.close

def close():
    release.set()  # the loop's thread leaves its callback only once the close has begun
    guarded()
    print("closed", loop.is_closed(), flush=True)

loop.close = close
"""


def test_zarrs_exit_hook_closing_the_io_loop_while_its_thread_runs_a_callback_closes_it() -> None:
    import forkserver

    done = forkserver.run(
        [sys.executable, "-c", _CLOSED_WHILE_RUNNING],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Cannot close a running event loop" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip() == "closed True", (done.stdout, done.stderr[-3000:])


def test_a_guarded_loop_closes_from_any_thread_once_and_refuses_its_own_thread() -> None:
    """Two threads close a loop whose thread is inside a callback: both return, the loop closed
    once its thread left ``run_forever``; a third close returns at once. A callback closing its
    own loop gets asyncio's error."""
    import asyncio
    import threading

    from insitubatch_nodes import _process

    loop = asyncio.new_event_loop()
    _process.guard_close(loop)
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        inside.set()
        release.wait(30)
        try:
            loop.close()  # from the loop's own thread
        except RuntimeError as exc:
            errors.append(exc)

    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    loop.call_soon_threadsafe(busy)
    assert inside.wait(30)
    closers = [threading.Thread(target=loop.close) for _ in range(2)]
    for closer in closers:
        closer.start()
    assert not loop.is_closed()  # (both wait for the loop to stop)
    release.set()
    for closer in closers:
        closer.join(30)
    runner.join(30)
    assert not runner.is_alive() and not any(c.is_alive() for c in closers)
    assert loop.is_closed()
    loop.close()
    assert [str(e) for e in errors] == ["Cannot close a running event loop"]
