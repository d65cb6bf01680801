"""The tests' fork server (``tests/forkserver.py``) tells each forked process's exit apart from an
earlier one's with the same pid.

Pids wrap at ``pid_max`` (32,768 on the project's VM), and every thread of a test run takes one,
so a suite that forks hundreds of processes beside thousands of threads meets a reused pid. The
client kept every exit it was told, by pid: a new process with an earlier one's pid read as
already ended with that one's status (the newest-zarr leg saw a store-failure test's child
"exit 0" while it was still running; it had exited 1).
"""

from __future__ import annotations

import json
import socket
import threading

import forkserver


def _client(sock: socket.socket) -> forkserver._Server:
    """A client of the fork server on ``sock`` (its reader thread started), without a server."""
    server = object.__new__(forkserver._Server)
    server.sock = sock
    server._lock = threading.Lock()
    server._cond = threading.Condition()
    server._exits = {}
    server._replies = []
    server.alive = True
    threading.Thread(target=server._collect, daemon=True).start()
    return server


def test_a_new_process_with_an_earlier_ones_pid_is_not_read_as_ended_with_its_status() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        client = _client(ours)
        theirs.send(json.dumps({"pid": 4242}).encode())  # an earlier process...
        assert client.fork({"argv": ["-c", "pass"]}, []) == 4242
        theirs.send(json.dumps({"exit": 4242, "returncode": 0}).encode())  # ...ended with 0
        assert client.returncode(4242, timeout=5) == 0
        theirs.send(json.dumps({"pid": 4242}).encode())  # a new process, the pid reused
        assert client.fork({"argv": ["-c", "pass"]}, []) == 4242
        assert client.returncode(4242, timeout=0) is None  # still running
        theirs.send(json.dumps({"exit": 4242, "returncode": 1}).encode())
        assert client.returncode(4242, timeout=5) == 1
    finally:
        ours.close()
        theirs.close()
