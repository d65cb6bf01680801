"""A trial of what a user sees of an epoch — ``pipe.report()``, the Chrome-trace file and the
``torch.profiler`` ranges — on the newer workloads: channel stacks (windows, selected levels,
static members, forcings, ``normalize=``), window views, patches, collections (an HCS plate,
two stores concatenated) and the "small data kept" rule. The store's own counts
(``CountingStore``: GETs, and the sizes of the files it served), the batches (the sum of
their arrays' ``nbytes``) and ``json.load`` of the written trace are the oracles.

Found (each fixed; the test failed before the fix; a local read that raises ``OSError`` and a
decode that fails, left here, are counted and spanned since 2026-12-07: test_nanfail_trial):

- A stack with a static member or a forcing, or a static label, given no batch transform:
  an epoch limited by the gather was told "batch_transforms run there: lighten the transforms
  or move them to the consumer" (``report.batch_transforms`` counted the static fields and
  stack constants the pipeline writes itself). It now counts the transforms given.
- A store-limited epoch whose read-ahead a larger ``block_chunks`` cannot extend was told
  "the read-ahead (one block of chunks) bounds them; raise block_chunks": a split one block
  already holds (12 chunks under the default 16: 12 GETs in flight with 16 and 64 alike — every
  small validation split), and patched views over a field one region covers (a patched plan's
  block is one region of one sample-axis chunk: a one-tile field peaked at 2 GETs in flight
  with ``block_chunks`` 4 and 64 alike). The report now says why (``read_ahead_capped``:
  ``"epoch"`` or ``"patched"``) and what moves it instead.
- A GET that failed (its object filled under ``on_bad_chunk="nan"``) was in neither the
  report's GETs (70 against the store's 72 with two failing keys) nor its GET seconds, and had
  no span: the time it held the epoch (a timeout's whole deadline) was a gap on the IO loop's
  track. It now counts, with no bytes, and its span names the store's error.

Tried and found right (kept as claims where cheap): on every workload above the report's
GETs, bytes fetched and decodes equal the store's and the trace's (one ``GET`` span per store
GET, its key the key the store was asked for, its bytes the file's size), bytes delivered
equal the batches' ``nbytes``; every trace event is well formed (``ph``, ``ts``, ``dur`` or a
matching ``b``/``e`` pair, ``pid``, ``tid``, a thread name for every ``tid``, nothing before
the epoch's start or after its end), ``next`` and ``gather`` spans carry the delivered batch
indices, and every GET's and decode's ``batch`` is the first batch that reads its chunk
(stacks, windows, selected levels; by hand); a kept split reads nothing in epoch 1 and a
split that does not fit re-reads every chunk, is told a budget the pipeline accepts, and with
it reads nothing in epoch 1 (stack, patches); sharded stores (the shard is the GET; by hand);
``torch.profiler`` ranges ``insitu.*`` on four threads for a stack and a patched pipeline, one
``insitu.fill_run`` per ``fill run`` span, ``insitu.admit`` and ``insitu.wait_for_chunks``
inside ``insitu.gather`` (by hand); rows decoded straight into batches (a split that does not
fit): every ``decode`` span's ``batch`` and ``row`` are the batch row its sample landed in,
and a local store's ``bytes_fetched`` is the files' sizes (by hand); patches: every GET's
``tile`` is its key's and its ``batch`` the first whose windows touch the tile (by hand); a
mid-epoch state resumed into a fresh pipeline: the report counts the rest of the epoch, the
store's GETs, then the chunks read before the cut, then 0 (by hand); epochs through ``Loader``
and through torch's ``DataLoader(as_dataset(pipe), batch_size=None)``: one report per epoch,
numbered, 0 GETs once kept (by hand); chunk transforms on stack members: ``transforms`` =
``transform`` spans = the calls (by hand); ``stats()``'s ``static_gets`` are the static
members' objects the store served at build (by hand). A concatenation's GET spans name the key in
the routed store (``s0/t2m/c/...``: the first store given) — documented in docs/tracing.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import CountingStore, counting_store, write_era5

from insitubatch_nodes import (
    Forcings,
    concat,
    insitu_pipeline,
    open_geometries,
    open_plate,
    split_by_chunk,
    split_by_member,
    stack,
)
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.report import EpochReport, suggestion_for
from insitubatch_nodes.statistics import fit_statistics

# one worker runs the module: its module fixtures are built once, not once per worker
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("seeing_trial")]

TRACE = FetchOptions(trace=True)


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step per chunk (the split of 48 fits the pool), two levels of z, a static lsm."""
    root = write_era5(tmp_path_factory.mktemp("seeing") / "era5.zarr", n_time=64, n_lat=4,
                      n_lon=8, n_level=2, samples_per_chunk=1)  # fmt: skip
    lsm = zarr.create_array(root / "lsm", shape=(4, 8), chunks=(4, 8), dtype="float32",
                            dimension_names=("lat", "lon"))  # fmt: skip
    lsm[...] = np.arange(32, dtype="float32").reshape(4, 8) % 2
    return root


def _served(stores: list[tuple[CountingStore, Path]], before: list[dict[str, int]]) -> Counter:
    """The chunk keys each store was asked for since ``before``, as ``(store, key)``."""
    out: Counter = Counter()
    for i, ((store, _), was) in enumerate(zip(stores, before, strict=True)):
        for key, n in store.chunk_counts().items():
            if n > was.get(key, 0):
                out[(i, key)] += n - was.get(key, 0)
    return out


def _file_size(root: Path, key: str) -> int:
    path = root / key
    return path.stat().st_size if path.exists() else 0  # (a missing object: fill value)


def _epoch_seen(
    pipe: Any, stores: list[tuple[CountingStore, Path]], tmp: Path
) -> tuple[EpochReport, Counter, int, list[int], dict[str, Any]]:
    """One epoch: its report, the store's GETs, the batches' bytes and indices, the trace
    as json.load reads the file ``write_trace`` wrote."""
    before = [dict(s.chunk_counts()) for s, _ in stores]
    delivered, indices = 0, []
    for batch in pipe:
        delivered += sum(int(a.nbytes) for a in batch.arrays.values())
        indices.append(batch.index)
    report = pipe.report()
    assert report is not None and report.complete
    path = report.write_trace(tmp / f"epoch{report.epoch}.json")
    with open(path) as f:
        trace = json.load(f)
    return report, _served(stores, before), delivered, indices, trace


def _check_epoch(
    report: EpochReport,
    served: Counter,
    delivered: int,
    indices: list[int],
    trace: dict[str, Any],
    stores: list[tuple[CountingStore, Path]],
    failed: frozenset[str] = frozenset(),
) -> None:
    """The report against the store and the batches, the trace against both (``failed``: keys
    whose GET raised, serving no bytes)."""
    events = trace["traceEvents"]
    assert report.gets == sum(served.values()), (report.gets, served)

    def _size(i: int, key: str) -> int:
        return 0 if key in failed else _file_size(stores[i][1], key)

    fetched = sum(n * _size(i, key) for (i, key), n in served.items())
    assert report.bytes_fetched == fetched
    assert report.bytes_delivered == delivered and report.batches == len(indices)
    # well formed
    end_us = report.wall_s * 1e6 + 1.0
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["ts"] + e["dur"] <= end_us, e
        if e["ph"] != "M":
            assert e["tid"] in named, e
    # one track per thread: its spans nest (a child within its parent), none half-overlaps
    tracks: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        open_: list[float] = []  # the ends of the spans enclosing the current one
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= start + 1e-3:
                open_.pop()
            assert not open_ or end <= open_[-1] + 1e-3, (start, end, open_[-1])
            open_.append(end)
    begins = Counter(e["id"] for e in events if e["ph"] == "b")
    assert begins == Counter(e["id"] for e in events if e["ph"] == "e")
    assert set(begins.values()) <= {1}
    # the GETs are the store's, key for key, with the bytes it served
    gets = [e["args"] for e in events if e["ph"] == "b" and e["name"] == "GET"]
    routed = len(stores) > 1  # a collection over several stores: keys routed as s<i>/<key>
    where = [
        (int(a["key"].split("/", 1)[0][1:]), a["key"].split("/", 1)[1]) if routed else (0, a["key"])
        for a in gets
    ]
    assert Counter(where) == served
    assert [a["bytes"] for a in gets] == [_size(i, k) for i, k in where]
    counts = Counter(e["name"] for e in events if e["ph"] == "X")
    assert counts["decode"] == report.decodes
    assert counts["read"] + len(gets) == report.gets
    # every stage has its spans, with the batches delivered
    delivered_ids = sorted(indices)
    for name in ("next", "gather", "wait for chunks", "admit", "consumer"):
        ids = sorted(e["args"]["batch"] for e in events if e.get("name") == name)
        ids = [i for i in ids if i >= 0]  # (the admission and next() that found the end)
        assert ids == delivered_ids, (name, ids)
    if report.gets:
        assert counts["fill run"] > 0


def _workloads(era5: Path, tmp: Path) -> dict[str, Any]:
    """name -> (store or collection, stores to count, manifest, views)."""
    store = counting_store(era5)
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))
    sun = Forcings("x", view=g["t2m"], names=["cos_solar_zenith"])
    stats = fit_statistics(store, manifest, {"t2m": g["t2m"], "z": g["z"]}, split="train")
    one = [(store, era5)]
    return {
        "window": (store, one, manifest, {"x": g["t2m"].window([0, 1, 2])}),
        "stack": (
            store,
            one,
            manifest,
            {
                "x": stack(
                    {"t2m": g["t2m"], "z": g["z"].isel(level=[1]), "lsm": g["lsm"], "sun": sun}
                )
            },
        ),
        "stack-window-normalize": (
            store,
            one,
            manifest,
            {
                "x": stack(
                    {"t2m": g["t2m"].window([0, 1]), "z": g["z"].window([0, 1])}, normalize=stats
                )
            },
        ),
        "patches": (
            store,
            one,
            manifest,
            {"p": g["t2m"].patches({"lat": 2, "lon": 4}), "lsm": g["lsm"]},
        ),
    }


@pytest.mark.parametrize("name", ["window", "stack", "stack-window-normalize", "patches"])
def test_the_report_and_trace_of_a_kept_split_agree_with_the_store_and_the_batches(
    era5: Path, tmp_path: Path, name: str
) -> None:
    zstore, stores, manifest, views = _workloads(era5, tmp_path)[name]
    with insitu_pipeline(zstore, manifest, views, batch_size=4, fetch=TRACE) as pipe:
        seen = [_epoch_seen(pipe, stores, tmp_path)]
        pipe.reset()
        seen.append(_epoch_seen(pipe, stores, tmp_path))
    for epoch in seen:
        _check_epoch(*epoch, stores)
    first, kept = seen[0][0], seen[1][0]
    assert first.gets > 0 and first.in_place == 0  # decoded into slots: kept
    assert (kept.gets, kept.decodes, kept.misses) == (0, 0, 0) and kept.hits == first.misses


def _plate_and_concat(tmp: Path) -> dict[str, Any]:
    from insitubatch_nodes.synthetic.plates import make_hcs_plate

    plate = Path(make_hcs_plate(tmp / "plate.zarr", rows=1, columns=2, fields=1,
                                shape=(1, 1, 4, 16, 16), levels=1))  # fmt: skip
    pstore = counting_store(plate)
    coll = open_plate(pstore, labels=["cells"])
    roots = [write_era5(tmp / f"part{k}.zarr", n_time=12, n_lat=2, n_lon=4, n_level=1,
                        samples_per_chunk=2) for k in range(2)]  # fmt: skip
    later = zarr.open_array(roots[1] / "time", mode="r+")
    later[...] = later[...] + 12 * 6  # the second store continues the first (6-hourly)
    parts = [counting_store(r) for r in roots]
    joined = concat(parts, ["t2m"])
    return {
        "plate": (
            coll,
            [(pstore, plate)],
            split_by_member(coll, {"train": 1.0}),
            {"img": coll["image"], "lab": coll["labels/cells"]},
        ),
        "concat": (
            joined,
            list(zip(parts, roots, strict=True)),
            split_by_chunk(joined["t2m"], (1.0, 0.0, 0.0)),
            {"x": joined["t2m"].window([0, 1])},
        ),
    }


@pytest.mark.parametrize("name", ["plate", "concat"])
def test_the_report_and_trace_of_a_collection_agree_with_its_stores(
    tmp_path: Path, name: str
) -> None:
    zstore, stores, manifest, views = _plate_and_concat(tmp_path)[name]
    with insitu_pipeline(zstore, manifest, views, batch_size=3, fetch=TRACE) as pipe:
        seen = [_epoch_seen(pipe, stores, tmp_path)]
        pipe.reset()
        seen.append(_epoch_seen(pipe, stores, tmp_path))
    for epoch in seen:
        _check_epoch(*epoch, stores)
    assert seen[0][0].gets > 0 and seen[1][0].gets == 0  # small: kept


@pytest.mark.parametrize("name", ["stack", "patches"])
def test_a_split_that_does_not_fit_is_re_read_and_the_budget_suggested_keeps_it(
    era5: Path, tmp_path: Path, name: str
) -> None:
    zstore, stores, manifest, views = _workloads(era5, tmp_path)[name]
    with pytest.raises(ValueError, match="floor of") as refused:
        insitu_pipeline(zstore, manifest, views, batch_size=4, cache_budget_bytes=1)
    floor = int(str(refused.value).split("floor of ")[1].split(" bytes")[0].replace(",", ""))
    with insitu_pipeline(zstore, manifest, views, batch_size=4, fetch=TRACE,
                         cache_budget_bytes=floor) as pipe:  # fmt: skip
        seen = [_epoch_seen(pipe, stores, tmp_path)]
        pipe.reset()
        seen.append(_epoch_seen(pipe, stores, tmp_path))
    for epoch in seen:
        _check_epoch(*epoch, stores)
    first, again = seen[0][0], seen[1][0]
    assert again.gets == first.gets > 0 and again.re_reads == again.misses == first.misses
    assert again.split_bytes is not None and again.split_bytes > floor
    # as the store-limited epoch it would be on a slow store
    text = suggestion_for(dataclasses.replace(again, limiting="store"))
    budget = int(text.split("cache_budget_bytes=")[1].split(" ")[0])
    with insitu_pipeline(zstore, manifest, views, batch_size=4, fetch=TRACE,
                         cache_budget_bytes=budget) as pipe:  # fmt: skip
        seen = [_epoch_seen(pipe, stores, tmp_path)]
        pipe.reset()
        seen.append(_epoch_seen(pipe, stores, tmp_path))
    assert seen[0][0].gets == first.gets and seen[1][0].gets == 0


# ---------------------------------------------------------------------------------------------
# what the suggestion tells
# ---------------------------------------------------------------------------------------------


def _add_one(batch: Any) -> Any:
    batch.arrays["x"] += 0
    return batch


@pytest.mark.parametrize(
    "kind", ["stack with static and forcing", "static label", "given transform"]
)
def test_a_gather_limited_epoch_is_told_of_batch_transforms_only_when_it_was_given_some(
    era5: Path, kind: str
) -> None:
    # the static fields and stack constants the pipeline writes into each batch counted as
    # batch transforms: a stack given none was told "batch_transforms run there: lighten
    # the transforms or move them to the consumer"
    g = open_geometries(era5)
    manifest = split_by_chunk(g["t2m"], (0.75, 0.25, 0.0))
    sun = Forcings("x", view=g["t2m"], names=["cos_solar_zenith"])
    given: list[Any] = []
    if kind == "stack with static and forcing":
        views: dict[str, Any] = {"x": stack({"t2m": g["t2m"], "lsm": g["lsm"], "sun": sun})}
    elif kind == "static label":
        views = {"x": g["t2m"], "lsm": g["lsm"]}
    else:
        views, given = {"x": g["t2m"], "lsm": g["lsm"]}, [_add_one]
    with insitu_pipeline(era5, manifest, views, batch_size=4, batch_transforms=given) as pipe:
        for _ in pipe:
            pass
        report = pipe.report()
    assert report is not None
    assert report.batch_transforms == len(given)
    text = suggestion_for(dataclasses.replace(report, limiting="gather", cores=64))
    if given:
        assert "batch_transforms run there" in text, text
    else:
        assert "transforms" not in text, text


def _peak(root: Path, block_chunks: int, origins: str) -> tuple[int, EpochReport]:
    store = counting_store(root, delay=0.002)  # GETs that overlap
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    view = g["t2m"].patches({"lat": 2, "lon": 4}, origins=origins)
    with insitu_pipeline(store, manifest, {"p": view}, batch_size=4,
                         block_chunks=block_chunks, coords=()) as pipe:  # fmt: skip
        for _ in pipe:
            pass
        report = pipe.report()
    assert report is not None
    return store.peak, report


def test_patched_views_whose_region_holds_the_field_are_not_told_to_raise_block_chunks(
    tmp_path: Path,
) -> None:
    # a patched plan's block is one region of one sample-axis chunk: here one tile holds the
    # field, the region is that tile whatever block_chunks is, and the GETs in flight peaked
    # at the same count with block_chunks=4 and =64 - "raise block_chunks" could not help
    root = write_era5(tmp_path / "one_tile.zarr", n_time=16, n_lat=4, n_lon=8, n_level=1,
                      samples_per_chunk=1)  # fmt: skip
    (peak4, r4), (peak64, r64) = (_peak(root, b, "grid") for b in (4, 64))
    assert max(peak4, peak64) <= 2
    for r in (r4, r64):
        assert r.read_ahead_capped == "patched"
        store_bound = dataclasses.replace(r, limiting="store", inflight_peak=peak4)
        text = suggestion_for(store_bound)
        assert "raise block_chunks" not in text, text
        assert "samples per chunk" in text, text
    # a field of 8 tiles: a block of 4 is a region of 2 x 2 tiles, and a larger one reads
    # further ahead - there the advice stands
    tiled = write_era5(tmp_path / "tiled.zarr", n_time=8, n_lat=8, n_lon=16, n_level=1,
                       samples_per_chunk=1, inner_chunks=(4, 4))  # fmt: skip
    peak, r = _peak(tiled, 4, "grid")
    assert not r.read_ahead_capped
    text = suggestion_for(dataclasses.replace(r, limiting="store", inflight_peak=peak))
    assert "raise block_chunks" in text, text


def test_a_split_one_block_holds_is_not_told_to_raise_block_chunks(tmp_path: Path) -> None:
    # 12 chunks and the default block_chunks=16: one block holds the whole epoch, all of its
    # GETs may be in flight at once (they peaked at 12 with block_chunks 16 and 64 alike), and
    # the store-limited epoch was told "the read-ahead (one block of chunks) bounds them;
    # raise block_chunks" - a small validation split always was
    root = write_era5(tmp_path / "small.zarr", n_time=48, n_lat=2, n_lon=4, n_level=1,
                      samples_per_chunk=4)  # fmt: skip
    for block_chunks in (16, 64):
        store = counting_store(root, delay=0.002)
        g = open_geometries(store)
        manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
        with insitu_pipeline(store, manifest, {"x": g["t2m"]}, batch_size=4, coords=(),
                             block_chunks=block_chunks) as pipe:  # fmt: skip
            for _ in pipe:
                pass
            r = pipe.report()
        assert r is not None and r.gets == 12 and store.peak <= 12
        assert r.read_ahead_capped == "epoch"
        text = suggestion_for(dataclasses.replace(r, limiting="store", inflight_peak=store.peak))
        assert "raise block_chunks" not in text and "every chunk of the epoch" in text, text
    # 12 chunks in blocks of 4: a larger block reads further ahead, and the advice stands
    store = counting_store(root)
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    with insitu_pipeline(store, manifest, {"x": g["t2m"]}, batch_size=4, coords=(),
                         block_chunks=4) as pipe:  # fmt: skip
        for _ in pipe:
            pass
        r = pipe.report()
    assert r is not None and not r.read_ahead_capped
    text = suggestion_for(dataclasses.replace(r, limiting="store", inflight_peak=4))
    assert "raise block_chunks" in text, text


class _SlowFailure(CountingStore):
    """A CountingStore whose GET of ``bad`` takes 0.1 s and then raises ``OSError`` (an
    endpoint that answers one object late with an error)."""

    bad = "t2m/c/5/0/0"

    def _with_store(self, store: Any) -> _SlowFailure:
        return type(self)(store)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if key == self.bad:
            with self._lock:
                self.counts[key] += 1
            await asyncio.sleep(0.1)
            raise OSError("503 Slow Down")
        return await super().get(key, prototype, byte_range)


def test_a_failed_get_filled_under_on_bad_chunk_is_counted_and_in_the_trace(
    tmp_path: Path,
) -> None:
    # a GET that failed (its object filled with NaN under on_bad_chunk="nan") was in neither
    # the report's GETs (70 against the store's 72) nor its GET seconds, and had no span: the
    # 0.1 s (a timeout's whole deadline) it held the epoch was a gap on the IO loop's track
    root = write_era5(tmp_path / "e.zarr", n_time=16, n_lat=2, n_lon=4, n_level=1,
                      samples_per_chunk=1)  # fmt: skip
    store = _SlowFailure(zarr.storage.LocalStore(root, read_only=True))
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    fetch = FetchOptions(trace=True, on_bad_chunk="nan")
    with insitu_pipeline(store, manifest, {"x": g["t2m"]}, batch_size=4, fetch=fetch) as pipe:
        report, served, delivered, indices, trace = _epoch_seen(pipe, [(store, root)], tmp_path)
    assert report.bad_chunks == 1 and sum(served.values()) == 16
    _check_epoch(
        report, served, delivered, indices, trace, [(store, root)], frozenset({_SlowFailure.bad})
    )
    failed = [e for e in trace["traceEvents"] if e["ph"] == "b" and "error" in e["args"]]
    assert [(e["args"]["key"], e["args"]["bytes"], e["args"]["error"]) for e in failed] == [
        (_SlowFailure.bad, 0, "OSError")
    ]
    end = next(e for e in trace["traceEvents"] if e["ph"] == "e" and e["id"] == failed[0]["id"])
    assert end["ts"] - failed[0]["ts"] >= 0.1e6
    assert report.get_s >= 0.1 and report.decodes == 15


def test_a_read_that_failed_before_its_get_leaves_no_get_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the GET was counted as started before its key was made; a key that raised (a bug path:
    # it fails the batch) never ended it, and the report's GETs in flight stayed one up for the
    # rest of the pipeline's life
    from insitubatch_nodes.stages import _jobs

    root = write_era5(tmp_path / "e.zarr", n_time=8, n_lat=2, n_lon=4, n_level=1,
                      samples_per_chunk=1)  # fmt: skip
    store = counting_store(root)
    g = open_geometries(store)
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    key = _jobs.ArrayFill.key

    def broken(self: Any, chunk: int, tile: tuple[int, ...]) -> str:
        if chunk == 3:
            raise RuntimeError("no key")
        return key(self, chunk, tile)

    monkeypatch.setattr(_jobs.ArrayFill, "key", broken)
    pipe = insitu_pipeline(store, manifest, {"x": g["t2m"]}, batch_size=2, shuffle=False)
    with pipe, pytest.raises(RuntimeError, match="no key"):
        for _ in pipe:
            pass
    # closed: every GET it started has ended (read, failed or cancelled)
    assert pipe.recorder._inflight.value == 0
