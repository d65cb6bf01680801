"""A stored object that cannot be read or decoded, under ``on_bad_chunk="nan"`` and ``"raise"``:
counted in the epoch report and shown in the trace as a failed remote GET is.

The store's files (every stored object of the split is read once in the epoch: the split is
kept, or decoded straight into rows), ``json.load`` of the written trace and zarr's read of
the undamaged store are the oracles. Each test damages its own copy of a tiny store: a chunk
file replaced by garbage bytes (read, then its decode fails) or by a FIFO (its read fails:
``LocalReader`` refuses what is not a regular file, as it would a file it may not open).

Found (each fixed; the test failed before the fix):

- A local read that failed was in neither the report's GETs (its read seconds neither) nor
  the trace: the report said the epoch asked for one object fewer than it did, and the time
  the decode thread spent on it was a gap in its fill run. A failed remote GET has counted
  (with no bytes) and had its span, naming the store's error, since 2026-12-06. A failed local
  read now counts the same way, in the report's ``gets``, ``get_s`` and ``local_read_s``, and
  its ``read`` span names the error; as for a GET, it is not a read *served* (``stats()``'s
  ``gets``, the clock ``on_bad_chunk="nan"`` counts reads failing in a row by). On all three
  local paths: into a slot, straight into rows of an array stored whole, of a tiled one.
- A decode that failed (the bytes read, or the GET served, but not a stored chunk) was in
  neither the report's decodes nor the trace, local and remote alike: ``report.decodes`` fell
  one short of the objects the decoders handled (47 of 48), and the time spent on it was a gap.
  It now counts as a decode (``decodes``, ``decode_s``, ``decode_queued_s``), and its
  ``decode`` span names the decoder's error.
- Both also under ``on_bad_chunk="raise"``: the report of the epoch that raised had neither;
  now it has both, recorded as the object fails, before its batch raises.

Tried and found right: the filled rectangle is the fill value and every other row equals
zarr's read (nan, every path above); ``bad_chunks`` counts each filled object once; the trace's
``read`` + ``GET`` spans equal ``report.gets`` and its ``decode`` spans ``report.decodes``.
Measured (warm epochs of a 1,024-step local store, one sample per chunk, 5,120 stored objects
an epoch; 7 alternated runs each on the shared 2-core machine): the success path is unchanged
within noise (rows: CPU-s per epoch median 0.196 before, 0.184 after; slots: 0.233, 0.220).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage
from helpers import CountingStore, Oracle, chunk_keys_on_disk, wait_until, write_era5

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import ChunkReadError
from insitubatch_nodes.options import FetchOptions

pytestmark = pytest.mark.timeout(60)

N_TIME = 16
T2M_BAD = ("t2m", 5, (0, 0))  # (array, chunk, tile) of the damaged t2m object
Z_BAD = ("z", 6, (1, 0, 0))  # level 1 of chunk 6: one of z's two objects of that chunk


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2m (16, 2, 4) and z (16, 2, 2, 4), one sample per chunk; z stored one object per level."""
    root = tmp_path_factory.mktemp("nanfail") / "e.zarr"
    return write_era5(root, n_time=N_TIME, n_lat=2, n_lon=4, n_level=2, samples_per_chunk=1)


def _key(bad: tuple[str, int, tuple[int, ...]]) -> str:
    name, chunk, tile = bad
    return "/".join((name, "c", str(chunk), *map(str, tile)))


def _damaged(pristine: Path, tmp: Path, damage: str, bad: tuple[str, int, tuple[int, ...]]) -> Path:
    root = Path(shutil.copytree(pristine, tmp / "damaged.zarr"))
    path = root / _key(bad)
    path.unlink()
    if damage == "garbage":  # read, then its decode fails
        path.write_bytes(b"not a zstd frame at all")
    else:  # "unreadable": the read fails (not a regular file)
        os.mkfifo(path)
    return root


def _objects(root: Path) -> int:
    return len(chunk_keys_on_disk(root, "t2m")) + len(chunk_keys_on_disk(root, "z"))


def _pipe(store: Any, direct: bool, policy: str = "nan", batch_size: int = 4) -> Any:
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    fetch = FetchOptions(trace=True, on_bad_chunk=policy, direct=direct)
    views = {"x": g["t2m"], "z": g["z"]}
    return insitu_pipeline(store, manifest, views, batch_size=batch_size, shuffle=False,
                           fetch=fetch)  # fmt: skip


def _epoch(pipe: Any, tmp: Path) -> tuple[Any, list[dict[str, Any]], list[Any]]:
    batches = [
        ({k: np.array(v) for k, v in b.arrays.items()}, dict(b.sample_indices)) for b in pipe
    ]
    report = pipe.report()
    assert report is not None and report.complete
    with open(report.write_trace(tmp / "epoch.json")) as f:
        events = json.load(f)["traceEvents"]
    return report, events, batches


def _failed_spans(events: list[dict[str, Any]]) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """``(name, array, chunk, tile)`` of every span that names an error."""
    return sorted(
        (e["name"], e["args"]["array"], e["args"]["chunk"], tuple(e["args"]["tile"]))
        for e in events
        if e["ph"] in ("X", "b") and "error" in e.get("args", {})
    )


def _check_counts(report: Any, events: list[dict[str, Any]], objects: int) -> None:
    """Every stored object read once, and decoded once: the report's counts are the store's
    objects, and the trace's spans are the report's."""
    counts = Counter(e["name"] for e in events if e["ph"] in ("X", "b"))
    assert report.gets == objects, (report.gets, objects)
    assert counts["read"] + counts["GET"] == report.gets
    assert report.decodes == counts["decode"]
    assert report.bad_chunks == 1


def _check_rows(batches: list[Any], pristine: Path, bad: tuple[str, int, tuple[int, ...]]) -> None:
    oracle = Oracle(pristine)
    name, chunk, tile = bad
    label = {"t2m": "x", "z": "z"}[name]
    seen = 0
    for arrays, idx in batches:
        for lab, arr_name in (("x", "t2m"), ("z", "z")):
            want = oracle(arr_name, idx[lab])
            got = arrays[lab]
            if lab == label:
                rows = np.flatnonzero(idx[lab] == chunk)
                for r in rows:
                    seen += 1
                    rect = got[r] if name == "t2m" else got[r, tile[0]]
                    assert np.isnan(rect).all()
                    if name == "t2m":
                        want[r] = got[r]
                    else:
                        want[r, tile[0]] = got[r, tile[0]]
            np.testing.assert_array_equal(got, want)
    assert seen == 1


PATHS = [
    pytest.param(False, T2M_BAD, id="slot"),
    pytest.param(True, T2M_BAD, id="whole-rows"),
    pytest.param(True, Z_BAD, id="tiled-rows"),
]


@pytest.mark.parametrize(("direct", "bad"), PATHS)
def test_a_local_read_that_failed_under_nan_is_a_get_of_the_report_and_a_read_span_naming_its_error(
    pristine: Path, tmp_path: Path, direct: bool, bad: tuple[str, int, tuple[int, ...]]
) -> None:
    root = _damaged(pristine, tmp_path, "unreadable", bad)
    objects = _objects(pristine)
    with _pipe(str(root), direct) as pipe:
        report, events, batches = _epoch(pipe, tmp_path)
        served = pipe.stats()["gets"]
    assert report.local_read_s > 0  # read on the decode threads, not GETs
    _check_counts(report, events, objects)
    assert served == objects - 1  # the failed read is asked for, not served
    assert report.decodes == objects - 1
    assert _failed_spans(events) == [("read", *bad)]
    (error,) = [e["args"]["error"] for e in events if "error" in e.get("args", {})]
    assert error == "OSError"
    _check_rows(batches, pristine, bad)


@pytest.mark.parametrize(("direct", "bad"), PATHS)
def test_a_local_object_that_failed_to_decode_is_a_decode_of_the_report_its_span_naming_the_error(
    pristine: Path, tmp_path: Path, direct: bool, bad: tuple[str, int, tuple[int, ...]]
) -> None:
    root = _damaged(pristine, tmp_path, "garbage", bad)
    objects = _objects(pristine)
    with _pipe(str(root), direct) as pipe:
        report, events, batches = _epoch(pipe, tmp_path)
    assert report.local_read_s > 0
    _check_counts(report, events, objects)
    assert report.decodes == objects
    assert _failed_spans(events) == [("decode", *bad)]
    _check_rows(batches, pristine, bad)


@pytest.mark.parametrize("direct", [False, True], ids=["slot", "rows"])
def test_a_remote_object_that_failed_to_decode_is_a_decode_of_the_report_its_span_naming_the_error(
    pristine: Path, tmp_path: Path, direct: bool
) -> None:
    root = _damaged(pristine, tmp_path, "garbage", Z_BAD)
    store = CountingStore(zarr.storage.LocalStore(root, read_only=True))
    objects = _objects(pristine)
    with _pipe(store, direct) as pipe:
        report, events, batches = _epoch(pipe, tmp_path)
    assert report.local_read_s == 0  # GETs, through the store
    _check_counts(report, events, objects)
    assert report.decodes == objects
    assert _failed_spans(events) == [("decode", *Z_BAD)]
    _check_rows(batches, pristine, Z_BAD)


@pytest.mark.parametrize("damage", ["unreadable", "garbage"])
def test_under_raise_the_object_that_failed_the_epoch_is_counted_and_in_its_trace(
    pristine: Path, tmp_path: Path, damage: str
) -> None:
    root = _damaged(pristine, tmp_path, damage, T2M_BAD)
    name = "read" if damage == "unreadable" else "decode"
    with _pipe(str(root), direct=False, policy="raise", batch_size=2) as pipe:
        seen = 0
        with pytest.raises(ChunkReadError):
            for _ in pipe:
                seen += 1
        assert seen == 2  # chunk 5 is in batch 2

        def failed(report: Any) -> list[Any]:
            assert report is not None and report.trace is not None
            return [
                s
                for s in report.trace.spans
                if s[0] in ("read", "decode") and isinstance(s[4], dict) and "error" in s[4]
            ]

        # the failed object is recorded before its batch raises; the runs still going hand
        # theirs over as they end: then every read asked for is counted, the failed one unserved
        unserved = 1 if damage == "unreadable" else 0
        assert wait_until(
            lambda: (
                bool(failed(pipe.report()))
                and pipe.report().gets == pipe.stats()["gets"] + unserved
            ),
            timeout=5.0,
        )
        report = pipe.report()
    (span,) = failed(report)
    assert (span[0], span[4]["array"], span[4]["chunk"], tuple(span[4]["tile"])) == (
        name,
        *T2M_BAD,
    )
    counts = report.trace.counts()
    assert report.gets == counts["read"] and report.decodes == counts["decode"]
