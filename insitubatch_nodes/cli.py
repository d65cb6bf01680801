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
4. unless ``--no-gil-probe``: a GIL probe (:mod:`insitubatch_nodes.gilprobe`). The transform
   runs over and over in a second thread while this thread runs Python and is kept waiting
   whenever the transform holds the GIL. The share that counts is of the transform thread's
   ready time (on a CPU or waiting for one, from Linux's per-thread schedstat), which a busy
   machine stretches as much as the waits: a vectorized transform spends its time in numpy,
   which releases the GIL (near 0 %); one that runs Python per element holds it (about 50-100 %);
   ``--gil-threshold`` of it or more fails the check. Such a transform would serialize every
   decode thread behind it. It wants a realistically sized chunk (on a toy chunk the Python
   call overhead dominates). A probe between the threshold and twice it is run again, up to
   three in all, and the lowest counts. A probe whose two threads spent most of it waiting for
   a CPU is no verdict: it is run again, and when none of three could judge the command says
   the machine was too busy and exits with status 3. Off Linux the share is of the wall time,
   which a busy machine moves either way.

``TARGET`` is ``module:attr`` (importable) or ``path/to/file.py:attr``; a class is instantiated
without arguments. The exit status is 0 when every check passed, 1 when one failed, 2 for a
usage error (unknown array, unloadable target), 3 when the machine was too busy for the GIL
probe to judge.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from insitubatch_nodes.gilprobe import GilProbe, gil_probe, gil_share

__all__ = ["gil_probe", "gil_share", "load_target", "main", "run"]

_OK, _FAILED, _USAGE, _TOO_BUSY = 0, 1, 2, 3


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
"""GIL probes at most, while they find the threshold reached but not twice it (the lowest
counts), or the machine too busy to judge."""


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

        # a transform that holds the GIL shows in every probe (well over twice the
        # threshold); a probe between the threshold and twice it, or one whose threads spent
        # most of it waiting for a CPU, is run again, up to PROBES; the lowest judged counts
        threshold = args.gil_threshold
        probes: list[GilProbe] = []
        judged: GilProbe | None = None
        while len(probes) < PROBES:
            try:
                found = gil_probe(call, seconds=args.probe_seconds)
            except Exception as exc:
                out(f"FAIL      gil probe: the transform raised {type(exc).__name__}: {exc}")
                return _FAILED
            probes.append(found)
            if found.too_busy:
                continue
            if judged is None or found.held < judged.held:
                judged = found
            if not threshold <= judged.held < 2 * threshold:
                break
        n = len(probes)
        if judged is None:
            least = min(p.cpu_wait or 0.0 for p in probes)
            out(
                f"gil       too busy to judge: the probe's two threads spent {100 * least:.0f}% "
                f"of the time waiting for a CPU{f' (the least of {n} probes)' if n > 1 else ''}; "
                "run the check again when the machine is quieter, or skip the probe "
                "(--no-gil-probe)"
            )
            out("UNDECIDED")
            return _TOO_BUSY
        held = judged.held
        of = "the wall time" if judged.measured == "wall" else "the time the transform ran"
        verdict = "holds the GIL" if held >= threshold else "releases the GIL"
        busy = sum(p.too_busy for p in probes)
        notes = [f"the lowest of {n - busy} probes"] if n - busy > 1 else []
        notes += [f"{busy} more too busy to judge"] if busy else []
        out(
            f"gil       {judged.calls} calls in {judged.wall:.2f} s; another thread waited for "
            f"the GIL {100 * held:.0f}% of {of} (fails at {100 * threshold:.0f}%"
            f"{''.join('; ' + note for note in notes)}): {verdict}"
        )
        if held >= threshold:
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
            "2: a usage error; 3: the machine was too busy for the GIL probe's verdict."
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
