"""The ``insitubatch-nodes`` console script.

``insitubatch-nodes check-transform URL --var NAME --transform TARGET`` checks a chunk transform
against one real chunk of a store before a training run finds out the hard way:

1. it prints the array's geometry and the decoded size of one chunk (what a slot holds);
2. it builds the transform's scope and declaration exactly as :func:`insitu_pipeline` would
   (an ``applies`` scope that misses the array, a ``validate`` that refuses the array, a failing
   ``output_inner`` are all reported);
3. it runs the transform on the chunk as the pipeline decodes it (CF-encoded values decoded
   as ``open_geometries`` delivers them: ``--cf-dtype``, ``--no-mask-and-scale``) and checks
   the output against the declared ``output_inner`` — or, with no declaration, against the
   input's shape and dtype (an undeclared reshape);
4. unless ``--no-gil-probe``: a GIL probe. The transform runs over and over in a second thread
   while this thread runs Python code and measures how long it is kept waiting for the GIL.
   A vectorized transform spends its time in numpy, which releases the GIL, so the waits stay
   short; a transform that runs Python per element holds the GIL, and this thread waits for
   whole switch intervals (``--gil-threshold`` of the time or more fails the check). Such a
   transform would serialize every decode thread behind it. The probe measures contention
   directly rather than thread scaling, so its verdict does not depend on idle cores; it
   wants a realistically sized chunk (on a toy chunk the Python call overhead dominates).
   Other processes taking the cores keep this thread waiting for a CPU too: on Linux that
   wait is told apart (the kernel's per-thread schedstat) and not counted. What is left of a
   busy machine (the transform's thread descheduled while it holds the GIL for a moment),
   and elsewhere the whole of it, shows now and then, so a probe between the threshold and
   twice it is run again, up to three in all, and the lowest counts: a transform that holds
   the GIL keeps it waiting about half the time in every one. A machine busy enough moves the
   share either way (docs/transforms.md has the numbers): run the check on a quiet one.

``TARGET`` is ``module:attr`` (importable) or ``path/to/file.py:attr``; a class is instantiated
without arguments. The exit status is 0 when every check passed, 1 when one failed, 2 for a
usage error (unknown array, unloadable target).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

__all__ = ["gil_probe", "gil_share", "load_target", "main", "run"]

_OK, _FAILED, _USAGE = 0, 1, 2


class _UsageError(Exception):
    pass


def load_target(spec: str) -> Any:
    """The object ``module:attr`` or ``path.py:attr`` names (a class is instantiated)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise _UsageError(f"--transform takes module:attr or path.py:attr, got {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise _UsageError(f"--transform: no file {where!r}")
        name = (
            path.stem
            if path.stem.isidentifier() and path.stem not in sys.modules
            else (f"_insitubatch_check_{abs(hash(str(path.resolve())))}")
        )
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise _UsageError(f"--transform: cannot import {where!r}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except ImportError as exc:
            raise _UsageError(f"--transform: cannot import {where!r}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            hint = (
                " (a module is imported from the installed packages and PYTHONPATH, not the "
                "working directory: name a file as path.py:attr instead)"
                if isinstance(exc, ModuleNotFoundError)
                and exc.name is not None
                and (where == exc.name or where.startswith(f"{exc.name}."))
                else ""
            )
            raise _UsageError(f"--transform: cannot import {where!r}: {exc}{hint}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _UsageError(f"--transform: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        try:
            obj = obj()
        except TypeError as exc:
            raise _UsageError(
                f"--transform: class {attr} cannot be built without arguments ({exc}); point "
                "at an instance or a factory's result instead"
            ) from exc
    if not callable(obj):
        raise _UsageError(f"--transform: {spec} is not callable")
    return obj


PROBES = 3
"""GIL probes at most, while they find the threshold reached (the lowest counts)."""


_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _thread_sched() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and seconds waiting for one (runnable while
    other threads or processes ran), from Linux's per-thread schedstat; ``None`` elsewhere."""
    try:
        on_cpu, waiting, _ = _SCHEDSTAT.read_text().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def gil_probe(
    call: Callable[[], Any],
    seconds: float = 1.0,
    interval: float = 0.05,
    min_calls: int = 2,
    *,
    clock: Callable[[], float] = time.perf_counter,
    sched: Callable[[], tuple[float, float] | None] = _thread_sched,
) -> tuple[float, int, float]:
    """Run ``call`` repeatedly in a thread while this thread runs Python; returns ``(held,
    calls, wall)``: the share of the wall time this thread waited for the GIL, the calls
    completed and the probe's wall time in seconds.

    The switch interval is set to ``interval`` for the probe (and restored): a thread holding
    the GIL is made to give it up after that long, so a GIL-holding ``call`` shows as waits of
    one interval each, about half the time; a GIL-releasing one as waits near zero. Runs for at
    least ``seconds`` and ``min_calls`` calls. An exception in ``call`` is re-raised.

    This thread only runs Python or waits for the GIL, so on Linux its wait is the wall time
    less its time on a CPU and its time waiting for a CPU (:func:`_thread_sched`): other
    processes taking the cores do not count. Elsewhere the wait is the sum of the pauses of
    ``interval / 2`` or longer between two of its steps, a busy machine's included (see
    :func:`gil_share`). ``clock`` (seconds) and ``sched`` (this thread's schedstat, as
    :func:`_thread_sched` reads it) are what the probe reads, for tests to script.
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

    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        thread = threading.Thread(target=work, name="gil-probe", daemon=True)
        thread.start()
        start = last = clock()
        before = sched()
        paused = 0.0
        long_wait = interval / 2
        while True:
            now = clock()
            gap = now - last
            if gap >= long_wait:
                paused += gap
            last = now
            if errors or not thread.is_alive():
                break
            if now - start >= seconds and done[0] >= min_calls:
                break
        after = sched()
        stop.set()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]
    wall = last - start
    return gil_share(wall, paused, before, after), done[0], wall


def gil_share(
    wall: float,
    paused: float,
    before: tuple[float, float] | None,
    after: tuple[float, float] | None,
) -> float:
    """The share of a probe's ``wall`` seconds its thread waited for the GIL, in [0, 1].

    ``before`` and ``after`` are the thread's schedstat at the probe's start and end (seconds
    on a CPU, seconds waiting for one; ``None`` off Linux): the wait is the wall time less the
    time on a CPU and the time waiting for one, so other processes taking the cores do not
    count. Without them it is ``paused``, the sum of the thread's pauses of half a switch
    interval or more, which a busy machine's waits for a CPU are part of."""
    wall = max(wall, 1e-9)
    blocked = paused
    if before is not None and after is not None:
        on_cpu, waiting = (a - b for a, b in zip(after, before, strict=True))
        blocked = max(0.0, wall - on_cpu - waiting)
    return min(1.0, blocked / wall)


def _read_chunk(zstore: Any, geom: Any, chunk: int) -> np.ndarray:
    from insitubatch_nodes.io import _zarr_compat
    from insitubatch_nodes.io.geometry import in_native_byte_order

    array = _zarr_compat.open_array_readonly(zstore, geom.path, geom.zarr_format)
    start, stop = geom.chunk_range(chunk)
    sel: list[Any] = [slice(None)] * geom.ndim
    sel[geom.sample_axis] = slice(start, stop)
    data = np.asarray(array[tuple(sel)])
    # native byte order, as the pipeline hands chunks to transforms (a big-endian zarr v2 array
    # read as ">f4" would fail an in-place transform for a dtype change it does not make)
    data = data.astype(in_native_byte_order(data.dtype), copy=False)
    if geom.cf is not None:  # CF mask and scale: the values the pipeline's transforms see
        data = geom.cf.decode(data)
    return np.ascontiguousarray(np.moveaxis(data, geom.sample_axis, 0))


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.2f} MB"


def check_transform(args: argparse.Namespace) -> int:
    from insitubatch_nodes.errors import ChunkTransformError
    from insitubatch_nodes.io.arrays import open_geometries
    from insitubatch_nodes.io.stores import as_store
    from insitubatch_nodes.transforms import ChunkTransforms, transform_name

    out = print
    try:
        transform = load_target(args.transform)
    except _UsageError as exc:
        out(f"error: {exc}", file=sys.stderr)
        return _USAGE
    try:
        zstore = as_store(args.url)
        geom = open_geometries(
            zstore,
            [args.var],
            sample_axis=args.sample_axis,
            mask_and_scale=args.mask_and_scale,
            cf_dtype=args.cf_dtype,
        )[args.var.strip("/")]
    except KeyError as exc:
        out(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return _USAGE
    # a --cf-dtype or --sample-axis it cannot take; a store it cannot open (an http://
    # endpoint without allow_http, no credentials, no store at the path)
    except (ValueError, TypeError, PermissionError, FileNotFoundError) as exc:
        out(f"error: {exc}", file=sys.stderr)
        return _USAGE
    if not 0 <= args.chunk < geom.n_chunks:
        out(f"error: --chunk {args.chunk} is not in [0, {geom.n_chunks})", file=sys.stderr)
        return _USAGE
    start, stop = geom.chunk_range(args.chunk)
    out(f"array     {geom.path!r}: shape {geom.shape}, stored chunks {geom.chunks}, {geom.dtype}")
    out(
        f"chunk     {args.chunk} of {geom.n_chunks}: samples [{start}, {stop}), sample shape "
        f"{geom.inner_shape}, {geom.n_tiles} stored object(s); decoded {_mb(geom.chunk_nbytes)}"
    )
    name = transform_name(transform)
    out(f"transform {name}")
    failed = False
    # 1. scope, validation and declaration, as the pipeline builds them
    try:
        chain = ChunkTransforms([transform], {geom.path: geom})
    except (ValueError, TypeError) as exc:
        out(f"FAIL      construction: {exc}")
        return _FAILED
    expected = chain.outputs[geom.path]
    declared = callable(getattr(getattr(transform, "transform", transform), "output_inner", None))
    if declared:
        out(f"declared  output_inner -> {expected.inner_shape} {expected.dtype}")
    else:
        out("declared  no output_inner (the sample shape and dtype must not change)")
    # 2. the transform on the real chunk
    data = _read_chunk(zstore, geom, args.chunk)
    t0 = time.perf_counter()
    try:
        result = chain.apply(geom.path, args.chunk, (start, stop), data.copy())
    except ChunkTransformError as exc:
        out(f"FAIL      output: {exc}")
        if exc.__cause__ is not None:
            out(f"          caused by {type(exc.__cause__).__name__}: {exc.__cause__}")
        return _FAILED
    took = time.perf_counter() - t0
    out(
        f"output    {result.shape[1:]} {result.dtype} per sample ({_mb(expected.chunk_nbytes)} "
        f"per chunk), {1000 * took:.1f} ms on one chunk ({_mb(geom.chunk_nbytes / took)}/s): "
        "matches the declaration"
        if declared
        else f"output    {result.shape[1:]} {result.dtype} per sample, unchanged as required; "
        f"{1000 * took:.1f} ms on one chunk"
    )
    # 3. the GIL probe
    if args.no_gil_probe:
        out("gil       probe skipped (--no-gil-probe)")
    else:
        from insitubatch_nodes.transforms import DecodedChunk

        work = data.copy()

        def call() -> None:
            with np.errstate(all="ignore"):  # the same buffer over and over: values may overflow
                transform(DecodedChunk(geom.path, args.chunk, (start, stop), work))

        # a transform that holds the GIL shows in every probe (about half the time); other
        # processes taking the cores (a busy machine) show as waits too, now and then: a
        # probe between the threshold and twice it is run again, up to PROBES, the lowest
        # counting
        held = float("inf")
        threshold = args.gil_threshold
        probes = 0
        while probes < PROBES:
            probes += 1
            try:
                found = gil_probe(call, seconds=args.probe_seconds)
            except Exception as exc:
                out(f"FAIL      gil probe: the transform raised {type(exc).__name__}: {exc}")
                return _FAILED
            if found[0] < held:
                held, calls, wall = found
            if not threshold <= held < 2 * threshold:
                break
        verdict = "holds the GIL" if held >= args.gil_threshold else "releases the GIL"
        out(
            f"gil       {calls} calls in {wall:.2f} s; another thread waited for the GIL "
            f"{100 * held:.0f}% of the time (fails at {100 * args.gil_threshold:.0f}%"
            f"{f'; the lowest of {probes} probes' if probes > 1 else ''}): {verdict}"
        )
        if held >= args.gil_threshold:
            failed = True
            out(
                "FAIL      the transform runs Python while holding the GIL and would serialize "
                "the decode threads: vectorize it (whole-array numpy operations)"
                + (
                    "; the chunk is small, so Python call overhead may dominate: probe a "
                    "realistically sized chunk"
                    if geom.chunk_nbytes < 1_000_000
                    else ""
                )
            )
    out("FAILED" if failed else "OK")
    return _FAILED if failed else _OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="insitubatch-nodes", description="insitubatch_nodes command-line tools"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check-transform",
        help="check a chunk transform on one real chunk of a store",
        description=(
            "Run a chunk transform on one real chunk of a store: print the chunk's geometry, "
            "check its output against its declared output_inner (or its input), and probe "
            "whether it holds the GIL. Exit status 0: every check passed; 1: one failed; "
            "2: a usage error."
        ),
    )
    check.add_argument("url", help="the store: a path or URL (file://, s3://, gs://, ...)")
    check.add_argument("--var", required=True, help="zarr path of the array to check against")
    check.add_argument(
        "--transform", required=True, help="module:attr or path.py:attr (a class is instantiated)"
    )
    check.add_argument("--chunk", type=int, default=0, help="chunk index along the sample axis")
    check.add_argument("--sample-axis", type=int, default=0, help="the array's sample axis")
    check.add_argument(
        "--cf-dtype",
        default=None,
        help="the float dtype CF-decoded arrays are delivered in (open_geometries' cf_dtype)",
    )
    check.add_argument(
        "--no-mask-and-scale",
        dest="mask_and_scale",
        action="store_false",
        help="the stored values, not CF-decoded ones (open_geometries' mask_and_scale=False)",
    )
    check.add_argument(
        "--no-gil-probe", action="store_true", help="only the fast, deterministic checks"
    )
    check.add_argument(
        "--probe-seconds", type=float, default=1.0, help="minimum duration of the GIL probe"
    )
    check.add_argument(
        "--gil-threshold",
        type=float,
        default=0.2,
        help="fail when the probe thread waited for the GIL this share of the time or more",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (``None``: the process's own arguments) and return its exit
    status (argparse raises ``SystemExit`` for ``--help`` and malformed arguments). The process
    itself is run by :func:`run`."""
    args = _parser().parse_args(argv)
    if args.command != "check-transform":  # pragma: no cover - argparse requires a command
        return _USAGE
    return check_transform(args)


def run() -> NoReturn:
    """The console script and ``python -m insitubatch_nodes.cli``: run the process's command
    line, flush its output and end the process with the exit status, without finalizing the
    interpreter (``os._exit``).

    Stores are read through obstore, whose runtime threads hand each result to the IO loop by a
    Python call. Before Python 3.14 a thread still inside such a call when the interpreter
    finalizes is ended with ``pthread_exit`` on a Rust stack, which aborts the process (status
    -6 after its output was written: seen in CI, and reproduced in tests/test_cli.py). A tool
    that exits a moment after its last read meets that window; ending the process directly
    closes it. Nothing of the command is lost: it writes no files and its output is flushed.
    """
    status = _USAGE
    try:
        status = main()
    except SystemExit as exc:  # --help (0), a usage error (2), sys.exit("message")
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = _FAILED
    except KeyboardInterrupt:
        status = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        status = _FAILED
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


if __name__ == "__main__":  # pragma: no cover
    run()
