"""New Python processes without a new interpreter start: a fork server for the tests.

Many tests run a script in a process of its own (a training run killed and resumed, a reader
of a cache another process wrote, a process whose endpoint dies under it). Each such process
used to start a fresh interpreter and import torch, zarr, obstore and Lightning again: about
2 s, and 4.6 s with Lightning, per process. Here one helper process per test run (shared by
the run's xdist workers, which connect to it over a Unix socket named after the run's
``PYTEST_XDIST_TESTRUNUID``) imports them once and then forks on request: 4.9 CPU-s for a
run's server against 14.1 for one per worker under ``-n 3`` (2026-12-07); the first process
that needs it starts it, and it exits when its last client has gone. The forked process runs the
script as ``__main__`` and ends through the interpreter's normal exit (atexit hooks, thread
joins, the exit code of ``sys.exit`` or of an uncaught exception), exactly as
``python script.py`` would, except that the interpreter's module teardown and the C and C++
exit handlers of the libraries the server preloaded are skipped (:func:`_run_then_leave`: it
ends with ``os._exit`` once the threads are joined, the atexit hooks run and stdio flushed;
0.195 -> 0.058 CPU-s a forked process; an uncaught Ctrl-C's exit skips only the C and C++
handlers, :func:`_skip_static_destructors`) unless the request asks for ``full_exit=True`` (a
test whose claim is about the exit itself: the interpreter's whole exit).

What a forked process shares with a fresh interpreter: a new pid, nothing of the test
process's state (the server forks from its own clean state, never from the test process), its
own stdin/stdout/stderr (pipes or files, as asked), environment, working directory (the test
process's, where none is asked) and ``sys.argv``. What it does not: the modules the server
imported are already imported, and ``PYTHONHASHSEED`` and the other ``PYTHON*`` start-up
variables are the server's. So
:func:`popen` and :func:`run` fall back to a real interpreter (``subprocess``) whenever a
request changes a ``PYTHON*`` variable other than ``PYTHONPATH``/``PYTHONUNBUFFERED``, uses an
interpreter option other than ``-c``/``-m``/``-u``, or runs another executable; and a test
whose claim is about a fresh interpreter (its start-up time, its hash seed, what ``import``
loads) calls ``subprocess`` directly. ``INSITUBATCH_TESTS_NO_FORKSERVER=1`` sends every request
to a real interpreter (to rule the server out when a test fails).

``INSITUBATCH_TESTS_CPU_LOG=FILE`` measures what the processes cost: the server reaps each
forked process with ``os.wait4`` and appends a JSON line to FILE with its CPU seconds (user +
system, its own children included once it reaped them), its wall seconds, its argv and the test
that asked for it (the client's ``PYTEST_CURRENT_TEST``); at its exit, a line with its own CPU
(the imports above); the top-level packages each forked process imported that the server had
not; and the fresh interpreters :func:`popen` falls back to are logged with the
CPU the test process reaped while waiting for them. ``tests/cpu_log.py FILE`` sums them up.

Usage mirrors ``subprocess``: ``popen(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True,
env=..., cwd=...)`` returns an object with ``pid``, ``stdin``/``stdout``/``stderr``,
``poll()``, ``wait(timeout)``, ``kill()``, ``terminate()``, ``send_signal()``,
``returncode`` and ``with`` (closes the pipes and waits, as ``Popen``'s does);
``run(argv, capture_output=True, text=True, timeout=..., ...)`` returns a
``subprocess.CompletedProcess``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

# Imported once by the server, before it forks anything.
PRELOAD = (
    "numpy",
    "zarr",
    "obstore",
    "torch",
    "torch.distributed",
    "torchdata.nodes",
    "insitubatch_nodes",
    "insitubatch_nodes.pipeline",
    "insitubatch_nodes.torch_data",
    "insitubatch_nodes.testing",
    "lightning.pytorch",
    "insitubatch_nodes.lightning",
    # What the forked processes of a whole run imported again and again (the CPU log of
    # 2026-12-07, 207 forks): pytest (26 forks, 0.25 CPU-s each: the test modules that
    # ``resume_helpers``' "call" mode imports), s3fs (11, 0.42 s), xarray with pandas (8, 0.42 s)
    # and ome-zarr-py's writer with dask and scikit-image (4, 0.70 s: the docs' and the
    # recipes' plates); the server imports them once, for 1.0 CPU-s. None starts a thread.
    "pytest",
    "s3fs",
    "xarray",
    "ome_zarr.writer",
)

# PYTHON* variables a forked process can honour (the rest are read at interpreter start).
_HONOURED = {"PYTHONPATH", "PYTHONUNBUFFERED"}
_MAX_MESSAGE = 1 << 20
_CPU_LOG = os.environ.get("INSITUBATCH_TESTS_CPU_LOG")
_REAL_POPEN = subprocess.Popen  # what :func:`popen` falls back to (``fork_children`` replaces it)


def _log_cpu(record: dict[str, Any]) -> None:
    """Append one record to ``INSITUBATCH_TESTS_CPU_LOG`` (one ``write`` per line: whole lines
    from concurrent writers)."""
    if _CPU_LOG:
        fd = os.open(_CPU_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)


def _short_argv(argv: Sequence[str]) -> list[str]:
    return [a if len(a) <= 200 else a[:200] + "..." for a in argv]


# ---------------------------------------------------------------------------------------------
# The test-process side
# ---------------------------------------------------------------------------------------------


class _Server:
    """The connection to the fork server of this test run; a thread collects exit statuses.

    One server serves every process of a test run: the xdist workers of one run (the same
    ``PYTEST_XDIST_TESTRUNUID``) connect to one socket, so torch, zarr and Lightning are imported
    once per run, not once per worker (4.5-5.4 CPU-s per server). The first process that needs
    it starts it, under a lock file; the server exits when its last client has gone."""

    def __init__(self) -> None:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"forkserver-{run[:24]}.sock"
        if _FORKED_FROM is not None:  # a forked process asks the server it was forked from
            path = Path(_FORKED_FROM)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the server removes its socket under this lock
            try:
                self.sock = self._connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock = self._start(path)
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        ready = json.loads(self.sock.recv(_MAX_MESSAGE) or b"{}")
        if not ready.get("ready"):
            raise RuntimeError(f"the fork server did not start: {ready}; see {path}.log")
        self.env: dict[str, str] = ready["env"]  # the server's PYTHON* variables
        self.alive = True
        threading.Thread(target=self._collect, name="forkserver-exits", daemon=True).start()

    @staticmethod
    def _connect(path: Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        return sock

    def _start(self, path: Path) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a server that was killed left it
        self._log = open(f"{path}.log", "ab")  # noqa: SIM115 (kept open for the server's life)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(path)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:  # it listens before it imports: the connection waits in its backlog
            try:
                return self._connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the fork server did not start; see {path}.log") from None
                time.sleep(0.01)

    def _collect(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self.alive = False
                    self._replies.append({"error": "the fork server exited"})
                    self._cond.notify_all()
                    return
                msg = json.loads(data)
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["returncode"]
                else:
                    # a new process's pid may be an earlier one's (pids wrap at pid_max, 32,768
                    # here, and every thread of the run takes one): forget that one's exit, or
                    # the new process reads as ended with its status (a test's child "exited 0"
                    # while it ran). Its own exit comes after this reply, on this socket.
                    if "pid" in msg:
                        self._exits.pop(msg["pid"], None)
                    self._replies.append(msg)
                self._cond.notify_all()

    def fork(self, request: dict[str, Any], fds: Sequence[int]) -> int:
        with self._lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
            with self._cond:
                self._cond.wait_for(lambda: bool(self._replies), timeout=60)
                if not self._replies:
                    raise RuntimeError("the fork server did not answer within 60 s")
                reply = self._replies.pop(0)
        if "pid" not in reply:
            raise RuntimeError(f"the fork server failed: {reply}; see {self._log.name}")
        return int(reply["pid"])

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        # shut down before closing: the exits thread is blocked in recv() on this socket, and
        # a close() under a blocked recv() releases nothing until that call returns, so the
        # server saw no end of its requests and was killed after the 5 s below (each test
        # process paid them at exit once it had forked anything)
        try:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        finally:
            if self.proc is not None:
                # the server exits when its last client has gone: other workers of the run may
                # still use it, so it is waited for (its CPU counted with this process's
                # children), never killed; past 30 s it is left to exit alone
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=30)
                self._log.close()


_SERVER: _Server | None = None
_SERVER_LOCK = threading.Lock()
_FORKED_FROM: str | None = None  # in a forked process: the socket of its server


def _server() -> _Server:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive:
            _SERVER = _Server()
            atexit.register(_SERVER.close)
        return _SERVER


class ForkedProcess:
    """A process forked by the server: the parts of ``subprocess.Popen`` the tests use."""

    def __init__(
        self, server: _Server, pid: int, args: list[str], streams: list[Any | None]
    ) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.stdin, self.stdout, self.stderr = streams
        self.returncode: int | None = None

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        # as ``subprocess.Popen``'s: close the pipes, then wait for the process
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        out_box: list[Any] = [None, None]
        readers = []
        for i, stream in enumerate((self.stdout, self.stderr)):
            if stream is not None:

                def read(i: int = i, stream: Any = stream) -> None:
                    out_box[i] = stream.read()

                t = threading.Thread(target=read, daemon=True)
                t.start()
                readers.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return out_box[0], out_box[1]


def _forkable(argv: Sequence[str], env: Mapping[str, str] | None, server_env: dict) -> bool:
    if os.environ.get("INSITUBATCH_TESTS_NO_FORKSERVER") == "1" or sys.platform != "linux":
        return False
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return False
    rest = list(argv[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-c", "-m")):
        return False
    want = dict(os.environ if env is None else env)
    for key in set(want) | set(server_env):
        if (
            key.startswith("PYTHON")
            and key not in _HONOURED
            and want.get(key) != server_env.get(key)
        ):
            return False
    return True


def popen(
    argv: Sequence[str],
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    full_exit: bool = False,
    fork_children: bool = False,
) -> Any:
    """Like ``subprocess.Popen(argv, ...)``; a forked process where that is equivalent.

    ``full_exit=True`` for a test whose claim is about how the process exits (see
    :func:`_skip_static_destructors`): the forked process then also runs the C and C++ exit
    handlers of the libraries the server preloaded, as a fresh interpreter does.
    ``fork_children=True`` has the forked process fork the Python processes it starts with
    ``subprocess.Popen`` from this server too (see :func:`_fork_python_children`)."""
    argv = [os.fspath(a) for a in argv]
    server = _server() if os.environ.get("INSITUBATCH_TESTS_NO_FORKSERVER") != "1" else None
    if server is None or not _forkable(argv, env, server.env):
        proc = _REAL_POPEN(
            argv, stdin=stdin, stdout=stdout, stderr=stderr, text=text, env=env, cwd=cwd
        )
        if _CPU_LOG:
            _log_cpu(
                {"fresh": proc.pid, "argv": _short_argv(argv),
                 "test": os.environ.get("PYTEST_CURRENT_TEST")}
            )  # fmt: skip
        return proc
    child_fds: list[int] = []
    ours: list[Any | None] = [None, None, None]
    to_close: list[int] = []
    null = None
    for i, spec in enumerate((stdin, stdout, stderr)):
        if spec is PIPE:
            r, w = os.pipe()
            mine, theirs = (w, r) if i == 0 else (r, w)
            mode = "w" if i == 0 else "r"
            ours[i] = open(mine, mode if text else mode + "b", closefd=True)  # noqa: SIM115
            child_fds.append(theirs)
            to_close.append(theirs)
        elif spec is DEVNULL:
            if null is None:
                null = os.open(os.devnull, os.O_RDWR)
                to_close.append(null)
            child_fds.append(null)
        elif spec is STDOUT and i == 2:
            child_fds.append(child_fds[1])
        elif spec is None:
            child_fds.append(i)
        elif isinstance(spec, int):
            child_fds.append(spec)
        else:
            child_fds.append(spec.fileno())
    request = {
        "argv": argv[1:],
        "env": dict(os.environ if env is None else env),
        "cwd": os.getcwd() if cwd is None else os.fspath(cwd),  # the server's is another's
        "test": os.environ.get("PYTEST_CURRENT_TEST"),
        "full_exit": full_exit,
        "fork_children": fork_children,
    }
    try:
        pid = server.fork(request, child_fds)
    finally:
        for fd in to_close:
            os.close(fd)
    return ForkedProcess(server, pid, argv, ours)


def run(
    argv: Sequence[str],
    *,
    capture_output: bool = False,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    check: bool = False,
    full_exit: bool = False,
    fork_children: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """Like ``subprocess.run(argv, ...)`` (stdin is ``/dev/null``); ``full_exit`` and
    ``fork_children`` as :func:`popen`'s."""
    if capture_output:
        stdout = stderr = PIPE
    proc = popen(
        argv, stdin=DEVNULL, stdout=stdout, stderr=stderr, text=text, env=env, cwd=cwd,
        full_exit=full_exit, fork_children=fork_children,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ---------------------------------------------------------------------------------------------
# The server side (this file run as a script)
# ---------------------------------------------------------------------------------------------


def _serve(
    listener: socket.socket, path: str, env: dict[str, str]
) -> tuple[dict[str, Any], list[int]] | None:
    """Accept the test processes of the run and fork on every request; return (request, fds)
    in a forked process, None in the server once the last test process has gone."""
    clients: set[socket.socket] = set()
    children: dict[int, int] = {}  # pidfd -> pid
    asked: dict[int, tuple[float, dict[str, Any], socket.socket]] = {}  # pid -> (start, ...)
    hello = json.dumps({"ready": True, "env": env}).encode()
    served = False
    while True:
        if served and not clients and _leave(listener, path):
            return None
        ready, _, _ = select.select([listener, *clients, *children], [], [])
        if listener in ready:
            client, _ = listener.accept()
            client.send(hello)
            clients.add(client)
            served = True
        for pidfd in [fd for fd in ready if fd in children]:
            pid = children.pop(pidfd)
            os.close(pidfd)
            _, status, usage = os.wait4(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            started, req, owner = asked.pop(pid)
            if _CPU_LOG:
                _log_cpu(
                    {"forked": pid, "cpu": round(usage.ru_utime + usage.ru_stime, 3),
                     "wall": round(time.monotonic() - started, 3),
                     "argv": _short_argv(req["argv"]), "test": req.get("test"),
                     "returncode": code}
                )  # fmt: skip
            if owner in clients:
                try:
                    owner.send(json.dumps({"exit": pid, "returncode": code}).encode())
                except OSError:
                    clients.discard(owner)
                    owner.close()
        for client in [c for c in ready if c in clients]:
            try:
                data, fds, _, _ = socket.recv_fds(client, _MAX_MESSAGE, 3)
            except OSError:
                data, fds = b"", []
            if not data:
                clients.discard(client)
                client.close()
                continue
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                for pidfd in children:
                    os.close(pidfd)
                for other in (listener, *clients):
                    other.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            children[os.pidfd_open(pid)] = pid
            asked[pid] = (time.monotonic(), request, client)
            client.send(json.dumps({"pid": pid}).encode())


def _leave(listener: socket.socket, path: str) -> bool:
    """With no client left, remove the socket under the clients' lock and return True, unless a
    client connected meanwhile (False: serve it)."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # clients connect under it: none is half-way
        waiting, _, _ = select.select([listener], [], [], 0)
        if waiting:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.close()
        return True


def _become(request: dict[str, Any], fds: list[int]) -> list[str]:
    """Turn this forked process into ``python ARGV...``: its streams, environment, working
    directory and ``sys.path``; return the argv after the interpreter."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    argv = list(request["argv"])
    while argv and argv[0] == "-u":
        unbuffered = True
        argv.pop(0)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"
    )
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw),
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # sys.path as a fresh interpreter would have it: the script's folder (or the working
    # directory for -c/-m), then PYTHONPATH, then the rest of the server's path
    base = [p for p in sys.path[1:] if p not in _SERVER_PYTHONPATH]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = "" if argv[0] in ("-c", "-m") else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first if first else os.getcwd(), *extra, *base]
    return argv


def _skip_static_destructors() -> None:
    """Have this forked process end at ``exit()`` once the interpreter has finalized: its C
    stdio streams flushed (``fcloseall``), then ``_exit`` with the exit status, instead of
    running the C and C++ exit handlers of the libraries the server preloaded. Everything
    Python does at exit is done as before (thread joins, atexit hooks, module teardown and
    its finalizers, the flush of ``sys.stdout``/``sys.stderr``, the exit status; an unhandled
    Ctrl-C still ends the process by SIGINT): what is left out is torch's static destructors,
    which free its operator registry and wrote about 40 MB of the server's pages copied on
    write: 0.11 of a forked process's 0.21 CPU-s at exit (numpy, zarr and torch preloaded;
    2026-12-07). A test whose claim is about the exit itself (threads still running in a
    library, a clean status) asks for ``full_exit=True`` or starts a fresh interpreter.

    Registered with glibc's ``on_exit``, whose handlers run last-registered first with the
    status: these run before any handler registered at the server's start. Elsewhere (no
    glibc), nothing is changed."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        on_exit, end, flush = libc.on_exit, libc._exit, libc.fcloseall
    except (OSError, AttributeError):
        return
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit(ctypes.cast(end, ctypes.c_void_p), None)  # called as _exit(status, NULL)
    on_exit(ctypes.cast(flush, ctypes.c_void_p), None)  # first: fcloseall() (args unused)


def _fork_lightnings_ranks() -> None:
    """Have Lightning's DDP launcher (``strategy="ddp"``), in this forked process, fork the
    ranks it starts from this server too: it starts rank 1 and up with ``subprocess.Popen``
    on ``[sys.executable, script, *args]`` (the script run again, with ``LOCAL_RANK`` and the
    rendezvous in the environment), a new interpreter that imported torch and Lightning again:
    about 4.6 CPU-s and, on a loaded 2-core machine, 10 s of wall per rank. :func:`popen`
    runs the same argv with the same environment, working directory and streams (and falls
    back to that interpreter where it must); the launcher polls, signals and kills it through
    the same calls. Only this module's attribute is changed, not ``subprocess`` itself."""
    import types

    launcher = sys.modules.get("lightning.pytorch.strategies.launchers.subprocess_script")
    if launcher is not None and hasattr(launcher, "subprocess"):
        launcher.subprocess = types.SimpleNamespace(  # type: ignore[attr-defined]
            Popen=lambda argv, **kw: popen(argv, **kw)
        )


def _fork_python_children() -> None:
    """Have ``subprocess.Popen``, in this forked process, fork the Python processes it is asked
    for from this server too, as :func:`_fork_lightnings_ranks` does for Lightning's ranks: a
    recipe that starts workers with ``subprocess.Popen([sys.executable, __file__, ...])`` (the
    warm-then-score recipe's scorers) started a new interpreter that imported torch, zarr and
    the package again, about 2 CPU-s each. A call with arguments :func:`popen` takes
    (``stdin``, ``stdout``, ``stderr``, ``text``, ``env``, ``cwd``) whose argv it may fork gets a
    forked process; any other (another executable, another option, a ``PYTHON*`` variable
    changed) gets ``subprocess.Popen``'s own. Asked for with ``fork_children=True``."""

    class ForkingPopen(_REAL_POPEN):  # type: ignore[misc,valid-type]
        def __new__(cls, args: Any, *rest: Any, **kwargs: Any) -> Any:
            taken = {"stdin", "stdout", "stderr", "text", "env", "cwd"}
            if not rest and set(kwargs) <= taken and isinstance(args, (list, tuple)):
                argv = [os.fspath(a) for a in args]
                server = _server()
                if os.environ.get("INSITUBATCH_TESTS_NO_FORKSERVER") != "1" and _forkable(
                    argv, kwargs.get("env"), server.env
                ):
                    return popen(argv, **kwargs)
            return super().__new__(cls)

    subprocess.Popen = ForkingPopen  # type: ignore[misc]


def _run(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-c":
        import types

        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _run_then_leave(argv: list[str]) -> None:
    """:func:`_run` ``argv``, then end as the interpreter's exit does up to its module teardown:
    the exit status of ``sys.exit`` (its message on stderr) or of an uncaught exception (its
    traceback by ``sys.excepthook``), the non-daemon threads joined, the atexit hooks run,
    ``sys.stdout``/``sys.stderr`` and C stdio flushed, then ``os._exit``. What is left out is
    the teardown of the modules and the last collection, which in a forked process decref
    every object of the modules the server preloaded and so copy their pages: 0.13 of a forked
    ``python -c pass``'s 0.19-0.21 CPU-s (2026-12-07). An uncaught ``KeyboardInterrupt`` ends
    the process by SIGINT through the interpreter's own exit, as before."""
    try:
        _run(argv)
        code = 0
    except SystemExit as exc:
        code = _status(exc.code)
    except KeyboardInterrupt:
        raise
    except BaseException:  # (as the interpreter does with an uncaught exception)
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)
    os._exit(code)


def _status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: 0 for ``None``, an int as given, else the
    value printed on stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


_SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

if __name__ == "__main__":
    _path = sys.argv[1]
    _listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    _listener.bind(_path)
    _listener.listen(64)  # before the imports: the clients' connections wait in the backlog
    import warnings

    for _name in PRELOAD:
        # an extra that is not installed: the scripts that need it import it themselves; an
        # import-time warning (ome-zarr-py's deprecated Scaler) is the server's, not a script's
        with contextlib.suppress(ImportError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            __import__(_name)
    # What the server imported is never collected in the forked processes: keep it out of
    # their garbage collections (interpreter exit collects, and would walk all of torch).
    import gc

    gc.collect()
    gc.freeze()
    _env = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}
    _got = _serve(_listener, _path, _env)
    if _got is None:
        if _CPU_LOG:
            import resource

            _self = resource.getrusage(resource.RUSAGE_SELF)
            _log_cpu({"server": os.getpid(), "cpu": round(_self.ru_utime + _self.ru_stime, 3)})
        sys.exit(0)
    _argv = _become(*_got)
    if _CPU_LOG:  # which packages the forked process imported that the server had not

        def _log_imports(before: frozenset[str] = frozenset(sys.modules)) -> None:
            new = {name.partition(".")[0] for name in set(sys.modules) - before}
            _log_cpu({"imports": os.getpid(), "new": sorted(new)})

        atexit.register(_log_imports)
    if not _got[0].get("full_exit"):
        _skip_static_destructors()
    _FORKED_FROM = _path
    _fork_lightnings_ranks()
    if _got[0].get("fork_children"):
        _fork_python_children()
    _full = bool(_got[0].get("full_exit"))
    del _got, _listener
    if _full:
        _run(_argv)
        sys.exit(0)
    _run_then_leave(_argv)
