"""Python work per batch is O(chunks), never O(samples): measured, not read.

Each case is one pipeline over a store of tiny samples, built twice: at 64 samples per chunk
with batches of 64, then at 4,096 and 4,096. Both touch the same chunks per batch (blocks of
two chunks), so the second batch holds 64x the samples of the first and nothing else grows.
The Python lines and calls each batch costs are counted with ``sys.settrace`` on every thread
that does the pipeline's work: the pipeline's own (started after the count is set up), the IO
loop's and the decode pool's. A per-sample loop (a ``for`` over rows, a comprehension over
``.tolist()``, a dict per time) shows as thousands of lines at 4,096 samples; vectorised work
costs the same at both sizes.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import put_array

from insitubatch_nodes import (
    Collection,
    FetchOptions,
    Forcings,
    _runtime,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    split_by_member,
    stack,
)

N_CHUNKS = 6
SIZES = (64, 4096)  # samples per chunk = batch size
DECODE_THREADS = 2
TISR = "toa_incident_solar_radiation"


def _write(
    root: Path, spc: int, hours: int, calendar: str = "standard", north: float = 60.0
) -> Path:
    """An ERA5-like store of ``N_CHUNKS`` chunks of ``spc`` samples: ``t2m`` (time, 4, 8),
    ``tiled`` (the same in (2, 4) tiles), ``z`` (time, 3 levels, 4, 8) and ``ztiled`` (the
    same in (3, 2, 4) tiles), a static ``lsm`` (4, 8), CF time from ``hours`` in
    ``calendar``, latitudes from ``north - 120`` to ``north``."""
    n = N_CHUNKS * spc
    rng = np.random.default_rng(spc)
    group = zarr.open_group(root, mode="w")

    array = functools.partial(put_array, group)

    t = array("time", hours + np.arange(n, dtype=np.int64), ("time",))
    t.attrs.update(units="hours since 2000-01-01", calendar=calendar)
    array("lat", np.linspace(north - 120, north, 4), ("lat",))
    array("lon", np.arange(8) * 45.0, ("lon",))
    array("level", np.array([1000, 500, 250]), ("level",))
    array("t2m", rng.standard_normal((n, 4, 8), np.float32), ("time", "lat", "lon"), (spc, 4, 8))
    array("tiled", rng.standard_normal((n, 4, 8), np.float32), ("time", "lat", "lon"), (spc, 2, 4))
    z = rng.standard_normal((n, 3, 4, 8), np.float32)
    array("z", z, ("time", "level", "lat", "lon"), (spc, 3, 4, 8))
    array("ztiled", z, ("time", "level", "lat", "lon"), (spc, 3, 2, 4))
    array("lsm", rng.standard_normal((4, 8), np.float32), ("lat", "lon"))
    return root


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Path, Path]]:
    """Per size: a store, a second one with later times at other latitudes, one in the
    ``noleap`` calendar."""
    base = tmp_path_factory.mktemp("per_batch")
    return {
        spc: (
            _write(base / f"a{spc}.zarr", spc, 0),
            _write(base / f"b{spc}.zarr", spc, 10**6, north=80.0),
            _write(base / f"n{spc}.zarr", spc, 0, "noleap"),
        )
        for spc in SIZES
    }


class _Tally:
    """Python lines and calls, per code object, on the threads tracing it while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.counts: Counter[tuple[str, int, str]] = Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.on:
            return None
        code = frame.f_code
        self.counts[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.on and event == "line":
            code = frame.f_code
            self.counts[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
        return self._line


def _on_pool_threads(call: Callable[[threading.Thread], None]) -> None:
    """Run ``call(thread)`` on the IO loop's thread and on each decode thread: they exist before
    the pipeline, and ``threading.settrace`` reaches only threads started after it."""
    done = threading.Event()
    _runtime.io_loop().call_soon_threadsafe(lambda: (call(threading.current_thread()), done.set()))
    barrier = threading.Barrier(DECODE_THREADS)  # each thread takes exactly one job

    def job() -> None:
        call(threading.current_thread())
        barrier.wait(timeout=10)

    pool = _runtime.decode_pool(DECODE_THREADS)
    for f in [pool.submit(-1, job) for _ in range(DECODE_THREADS)]:
        f.result(timeout=10)
    assert done.wait(10)


@pytest.fixture
def tally() -> Iterator[_Tally]:
    """A tally tracing the pipeline's threads; each thread's tracer (coverage's, say) is put
    back after."""
    t = _Tally()
    before: dict[threading.Thread, Any] = {}

    def trace(thread: threading.Thread) -> None:
        before[thread] = sys.gettrace()
        sys.settrace(t)

    new_threads = threading.gettrace()
    threading.settrace(t)
    _on_pool_threads(trace)
    try:
        yield t
    finally:
        t.on = False
        threading.settrace(new_threads)  # type: ignore[arg-type]
        _on_pool_threads(lambda thread: sys.settrace(before.get(thread)))


Case = Callable[[Path, Path, Path], tuple[Any, Any, dict[str, Any], dict[str, Any]]]


def _main(root: Path, *_: Path) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    g = open_geometries(root)
    t2m, z, lsm = g["t2m"], g["z"], g["lsm"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {
        "x": t2m,  # batch.coords: the default coords=None carries time
        "shift": t2m.shift(1),
        "window": t2m.window([-1, 0]),
        "levels": z.isel(level=[0, 2]),
        "box": z.sel(lat=slice(-30, 60), level=[250, 1000]),
        "lsm": lsm,
        "stack": stack({"t2m": t2m, "z": z.isel(level=[0, 2]), "lsm": lsm}),
    }
    return root, manifest, views, {}


def _stacks(root: Path, *_: Path) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    g = open_geometries(root)
    t2m, z = g["t2m"], g["z"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    members = {"t2m": t2m, "z": z.isel(level=[0, 2])}
    spc = t2m.samples_per_chunk
    stats = fit_statistics(root, manifest, members, batch_size=spc, decode_threads=DECODE_THREADS)
    views = {
        "norm": stack(members, normalize=stats),
        "steps": stack({name: v.window([-1, 0]) for name, v in members.items()}),
        "forced": stack({"t2m": t2m, "f": Forcings("forced", view=t2m, names=[TISR])}),
    }
    forcings = Forcings("norm", view=t2m, names=["cos_solar_zenith", "year_progress_sin"])
    return root, manifest, views, {"batch_transforms": [forcings]}


def _patches(root: Path, *_: Path) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    g = open_geometries(root)
    t2m, z = g["t2m"], g["z"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    views = {
        "levels": z.isel(level=[2, 0]).patches({"lat": 2, "lon": 4}),
        "p": t2m.patches({"lat": 2, "lon": 4}),
        "pw": t2m.patches({"lat": 2, "lon": 4}).window([-1, 0]),
    }
    # each row's forcings cut to its own window, every row at once
    forcings = Forcings("pw", view=views["pw"], names=[TISR, "local_time_sin"])
    return root, manifest, views, {"batch_transforms": [forcings]}


def _tiles(root: Path, *_: Path) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    g = open_geometries(root)
    tiled, levels = g["tiled"], g["ztiled"].isel(level=[2, 0])  # (4, 8) fields in (2, 4) tiles
    manifest = split_by_chunk(tiled, (1.0, 0.0, 0.0))
    patches = {"extent": {"lat": 2, "lon": 3}, "origins": "random", "per_tile": 4}
    views = {"p": tiled.patches(**patches), "levels": levels.patches(**patches)}
    return root, manifest, views, {"coords": ()}


def _collection(
    root: Path, other: Path, _: Path
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    coll = Collection.from_arrays([(root, "t2m"), (other, "t2m")], sample_axis="time")
    manifest = split_by_member(coll, {"train": 1.0})
    views = {"x": coll["data"], "w": coll["data"].window([-1, 0])}
    # the members lie at other latitudes: each row's forcings on its member's grid
    forcings = Forcings("w", view=coll["data"], names=[TISR, "local_time_sin"])
    return coll, manifest, views, {"coords": ["time"], "batch_transforms": [forcings]}


def _calendar(*roots: Path) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    root = roots[2]
    t2m = open_geometries(root)["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    forcings = Forcings("x", view=t2m, names=["year_progress_sin", "local_time_cos"])
    return root, manifest, {"x": t2m.window([-1, 0])}, {"batch_transforms": [forcings]}


CASES: dict[str, Case] = {
    "views, selections, static fields, a stack, coordinates": _main,
    "stacks normalised, of windows, with forcings; forcings": _stacks,
    "patches (windows of a field), of windows, of selected levels; their forcings": _patches,
    "patches across tile edges, of selected levels": _tiles,
    "a collection with its members' times, forcings on each member's grid": _collection,
    "cftime dates (noleap): coordinates, calendar forcings": _calendar,
}


def _per_batch(tally: _Tally, case: Case, roots: tuple[Path, Path, Path], spc: int) -> Counter[Any]:
    """The Python lines and calls of one epoch (from its first ``next`` to its end) per batch,
    by code object, leaving out the waits (the standard library's threads, queues and event
    loop: their count follows time spent waiting, not work)."""
    src, manifest, views, kw = case(*roots)
    fetch = FetchOptions(decode_threads=DECODE_THREADS)
    pipe = insitu_pipeline(src, manifest, views, batch_size=spc, block_chunks=2, fetch=fetch,
                           **kw)  # fmt: skip
    with pipe:
        tally.counts.clear()
        tally.on = True
        try:
            lengths = [len(batch) for batch in pipe]
        finally:
            tally.on = False
    assert len(lengths) >= N_CHUNKS - 1 and lengths[0] == spc
    waits = ("threading.py", "queue.py", "selectors.py", "/asyncio/", "/concurrent/")
    return Counter(
        {k: v / len(lengths) for k, v in tally.counts.items() if not k[0].endswith(waits[:3])
         and not any(w in k[0] for w in waits[3:])}
    )  # fmt: skip


def test_python_work_per_batch_does_not_grow_with_the_samples_in_it(
    stores: dict[int, tuple[Path, Path, Path]], tally: _Tally
) -> None:
    grown = []
    for name, case in CASES.items():
        small, big = (_per_batch(tally, case, stores[spc], spc) for spc in SIZES)
        a, b = sum(small.values()), sum(big.values())
        assert a > 500, f"{name}: the tally saw {a:.0f} Python lines per batch: no tracing?"
        # a per-sample path costs thousands of lines at 4,096 samples; the same chunks cost
        # the same, give or take a few branches (measured: up to +10 %)
        if b > 1.25 * a + 150:
            worst = sorted(((big[k] - small[k], k) for k in big), reverse=True)[:3]
            where = "; ".join(f"{Path(f).name}:{line} {fn} +{d:.0f}" for d, (f, line, fn) in worst)
            grown.append(f"{name}: {a:.0f} -> {b:.0f} per batch ({where})")
    assert not grown, "Python work per batch grew with the samples:\n" + "\n".join(grown)
