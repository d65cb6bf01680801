"""The package's invariants driven through the features merged on 2026-12-07 (the invariants3
trial): each stored chunk fetched and decoded once per epoch where the schedule says so (the
counting store's GETs against ``pipe.report()``), each valid sample in exactly one batch per
epoch (over ranks: rank 0..W-1 pipelines unioned), a state taken after a batch resuming
exactly (also into another world size), every row equal to the store (xarray, zarr and numpy
are the oracles; which anchors are valid is worked out here from xarray's times).

Found (fixed; each test failed before the fix):

- **An automatic budget run at its floor lost rows of windows decoded in place** (a
  ``KeyError: ('sst', 26)`` out of the gather stage). At one sample per chunk, with a split
  over a sixteenth of the memory the process may use and a read-once floor over a quarter
  (the automatic budget then releases chunks idle for a block and re-reads them), a chunk
  read by one row of batch ``k`` is decoded straight into that row, never pinned; the same
  chunk read again later by batch ``k + 2`` (read ahead) was pinned for it, and the release
  of batch ``k`` dropped *that* pin, taking the chunk from batch ``k + 2`` before it was
  gathered. A release now skips the chunks its own batch decoded in place
  (``stages/_admit.py``).

Tried and found right (no change needed): see each test's docstring.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import counting_store

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.io import open_coordinates
from insitubatch_nodes.plan import memory_floor, schedule
from insitubatch_nodes.stages import buffers

xr = pytest.importorskip("xarray")  # the oracle (the dev extra installs it)
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(60)

H6 = np.timedelta64(6, "h")


def _fake_memory(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The process may use ``nbytes``: what the memory rule, the batch buffers and the
    automatic budget's caps ask (nothing of that size is allocated)."""
    for module in (memory_floor, buffers, schedule):
        monkeypatch.setattr(module, "usable_memory_bytes", lambda: nbytes)


def _write_back(root: Path, n: int, *, chunk: int, grid: tuple[int, int], drop: Any = ()) -> Path:
    """``sst (time, lat, lon)`` at 6-hourly times written newest first (``drop``: indices of
    the increasing times left out, gaps), ``chunk`` steps an object; every value tells its
    time step and point."""
    times = pd.date_range("2000-01-01", periods=n, freq="6h").delete(list(drop))[::-1]
    n = len(times)
    size = grid[0] * grid[1]
    data = (np.arange(n)[:, None] * 10_000 + np.arange(size)).reshape(n, *grid).astype("f4")
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), data)}, coords={"time": times})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        time = {"units": "hours since 2000-01-01", "dtype": "int64"}
        encoding = {"sst": {"chunks": (chunk, *grid)}, "time": time}
        ds.to_zarr(root, zarr_format=3, consolidated=False, encoding=encoding)
    return root


def _open(root: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.open_zarr(root, consolidated=False)


def _valid_anchors(times: np.ndarray, samples: Any, stride: np.timedelta64 | None) -> list[int]:
    """Anchors ``i`` of ``samples`` whose ``-6h`` step (``i + 1``, the store runs backwards)
    and ``+6h`` step (``i - 1``) are in ``samples`` at exactly those times (xarray's)."""
    inside = set(int(i) for i in samples)
    out = []
    for i in sorted(inside):
        if stride is not None and (times[i] - np.datetime64("1970-01-01")) % stride:
            continue
        if (
            {i - 1, i + 1} <= inside
            and times[i + 1] == times[i] - H6
            and (times[i - 1] == times[i] + H6)
        ):
            out.append(i)
    return out


# ---------------------------------------------------------------------------------------------
# The automatic budget under the memory rule: a split kept, a split run at its floor
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def back1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 times newest first, one step (16 KiB) an object."""
    return _write_back(tmp_path_factory.mktemp("inv3") / "b1.zarr", 40, chunk=1, grid=(64, 64))


@pytest.mark.parametrize(
    ("memory", "kept"),
    [(1 << 30, True), (2_000_000, False)],  # (2 MB: 1/16 is 125 KB, the split 512 KiB)
)
def test_an_automatic_budget_keeping_its_split_or_run_at_its_floor_delivers_every_window_once(
    back1: Path, monkeypatch: pytest.MonkeyPatch, memory: int, kept: bool
) -> None:
    """Windows in time deltas of a store written newest first, split in time order, one step
    an object. Kept (the split within a sixteenth of memory): every object once in the first
    epoch, none later. At its floor (the split over a quarter: chunks idle for a block are
    released and read again): every row still the store's, every valid anchor once an epoch,
    the report's GETs the store's and its re-reads every GET of a chunk fetched before."""
    _fake_memory(monkeypatch, memory)
    ds = _open(back1)
    times, values = ds.time.values, ds.sst.values
    g = open_geometries(back1)["sst"]
    manifest = split_by_chunk(g, (0.8, 0.1, 0.1), coord=open_coordinates(back1, g)["time"])
    want = _valid_anchors(times, manifest.samples("train"), None)
    store = counting_store(back1)
    views = {"x": g.window(["-6h", "0h"]), "y": g.window(["6h"])}
    seen_before: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the automatic budget's note that it re-reads)
        pipe = insitu_pipeline(store, manifest, views, batch_size=4, seed=2, block_chunks=2)
    with pipe:
        loader = Loader(pipe)
        for epoch in range(3):
            before = Counter(store.chunk_counts())
            anchors = []
            for batch in loader:
                for r, steps in enumerate(batch.sample_indices["x"]):
                    anchors.append(int(steps[-1]))
                    np.testing.assert_array_equal(batch["x"][r], values[steps])
                    t = batch.coords["x"]["time"][r]
                    np.testing.assert_array_equal(t, [times[steps[-1]] - H6, times[steps[-1]]])
                    np.testing.assert_array_equal(batch["y"][r], values[[steps[-1] - 1]])
            gets = Counter(store.chunk_counts())
            gets.subtract(before)
            gets = +gets
            rep = pipe.report()
            assert sorted(anchors) == want, epoch
            assert rep.gets == rep.misses == sum(gets.values()), (epoch, rep.gets, gets)
            assert rep.re_reads == sum(n if k in seen_before else n - 1 for k, n in gets.items())
            seen_before |= set(gets)
            if kept:
                assert max(gets.values(), default=0) <= 1 and (epoch == 0) == bool(gets)
