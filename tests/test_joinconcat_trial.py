"""Trial: a join whose stores are concatenations reads nothing its concatenations read.

``concat`` reads each store's metadata documents and time coordinate once, through one
coordinate reader it keeps (``coll.reader``). A ``join`` given such concatenations builds a
collection of its own over a routing store of their stores; before, it did so with a fresh
reader, so every member's ``sst`` document was read again (the first store's 3 more times:
twice to open the first member, once for the member documents; once more for a store in two
pieces), and a pipeline built with ``coords_reader=joined.reader`` read every member's ``sst``
document and ``time`` coordinate (document and object) once or twice more. Now the join's
reader takes over what the concatenations' readers read, keyed by the join's routed paths, so
each document and coordinate object is GET once in all. xarray and zarr are the oracles of
every row and every array's values (tests/helpers.CountingStore counts GETs).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, is_metadata_key

from insitubatch_nodes import Loader, insitu_pipeline, split_by_chunk
from insitubatch_nodes.io import stores as stores_module
from insitubatch_nodes.io.collection import concat, join
from insitubatch_nodes.io.coords import coordinate_reader

xr = pytest.importorskip("xarray")  # (writes the stores, as users' are written; the oracle)

pytestmark = pytest.mark.timeout(60)

HOURS = np.datetime64("2000-01-01T00", "ns") + np.arange(24) * np.timedelta64(1, "h")
#: each store's first hour: "a" continues at 8, "b" (starting 4 hours later) at 12
STARTS = {"a0": 0, "a1": 8, "b0": 4, "b1": 12}


def _write(root: Path, lo: int, fmt: int, tag: int) -> Path:
    """``sst (time, lat, lon)`` at ``HOURS[lo:lo + 8]``, 4 steps a chunk, each value
    ``1000 * tag`` plus its hour and grid position (every store's values its own), written by
    xarray in zarr format ``fmt``."""
    hours = np.arange(lo, lo + 8)
    data = (1000 * tag + hours[:, None, None] * 10 + np.arange(6).reshape(2, 3)).astype("f4")
    grid = {"lat": [10.0, 60.0], "lon": [0.0, 90.0, 200.0]}
    ds = xr.Dataset({"sst": (("time", "lat", "lon"), data)}, coords={"time": HOURS[hours], **grid})
    enc = {"sst": {"chunks": (4, 2, 3)}, "time": {"units": "hours since 2000-01-01", "dtype": "i8"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's notes on consolidation and v2)
        ds.to_zarr(root, zarr_format=fmt, consolidated=False, encoding=enc)
    return root


@pytest.fixture(scope="module", params=[3, 2], ids=["v3", "v2"])
def roots(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Stores ``a0``, ``a1`` (hours 0-15) and ``b0``, ``b1`` (hours 4-19), in format 3 or 2."""
    tmp = tmp_path_factory.mktemp(f"joinconcat{request.param}")
    return {k: _write(tmp / f"{k}.zarr", lo, request.param, t) for t, (k, lo) in
            enumerate(STARTS.items(), start=1)}  # fmt: skip


def _oracle(roots: dict[str, Path], *names: str) -> Any:
    """xarray's concatenation of stores ``names`` along time: its ``sst``."""
    return xr.concat([xr.open_zarr(roots[n], consolidated=False) for n in names], dim="time").sst


def _again(stores: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per store, the metadata documents and time coordinate objects GET more than once."""
    out = {}
    for name, s in stores.items():
        twice = {
            k: n
            for k, n in s.counts.items()
            if (is_metadata_key(k) or k.startswith("time/")) and n > 1
        }
        if twice:
            out[name] = twice
    return out


def _epoch(coll: Any, reader: Any) -> list[Any]:
    """One epoch, in order, of ``coll``'s two variables as labels ``x`` and ``y`` (their
    times carried), built with ``coords_reader=reader``."""
    x, y = coll["a/sst"], coll["b/sst"]
    with insitu_pipeline(coll, split_by_chunk(x, (1.0, 0.0, 0.0)), {"x": x, "y": y},
                         batch_size=4, coords=["time"], shuffle=False, coords_reader=reader,
                         prefetch_depth=1) as pipe:  # fmt: skip
        return list(Loader(pipe))


def _check_rows(batches: list[Any], roots: dict[str, Path], hours: np.ndarray) -> None:
    """Every row is xarray's at its time, ``x`` of the ``a`` stores and ``y`` of the ``b``
    stores, at ``hours`` in order."""
    a, b = _oracle(roots, "a0", "a1"), _oracle(roots, "b0", "b1")
    times = np.concatenate([np.asarray(t.coords["x"]["time"]) for t in batches])
    np.testing.assert_array_equal(times, HOURS[hours])
    for t in batches:
        np.testing.assert_array_equal(t.coords["y"]["time"], t.coords["x"]["time"])
        at = np.asarray(t.coords["x"]["time"])
        np.testing.assert_array_equal(np.asarray(t["x"]), a.sel(time=at).values)
        np.testing.assert_array_equal(np.asarray(t["y"]), b.sel(time=at).values)


def test_a_join_of_two_concats_and_its_pipeline_read_each_document_and_coordinate_once(
    roots: dict[str, Path],
) -> None:
    """``join({"a": (concat_a, ["sst"]), "b": (concat_b, ["sst"])})`` (hours 4-15, cut into
    three pieces at hours 8 and 12, ``a1`` in two of them) and a pipeline over it built with
    ``coords_reader=joined.reader``: every metadata document and every object of the time
    coordinates is GET once in all, the concatenations' reads included, and every row is
    xarray's. Before (v3): ``sst/zarr.json`` of ``a0`` 5 times, of ``b0`` 6 and ``a1`` 4 (each
    in two pieces), of ``b1`` 3; each ``time`` document and object 2 or 3 times."""
    stores = {k: counting_store(r) for k, r in roots.items()}
    concat_a = concat([stores["a0"], stores["a1"]], ["sst"])
    concat_b = concat([stores["b0"], stores["b1"]], ["sst"])
    joined = join({"a": (concat_a, ["sst"]), "b": (concat_b, ["sst"])})
    assert joined.lengths.tolist() == [4, 4, 4]
    assert _again(stores) == {}
    batches = _epoch(joined, joined.reader)
    assert _again(stores) == {}
    doc = "zarr.json" if (roots["a0"] / "sst" / "zarr.json").exists() else ".zarray"
    assert all(s.counts[f"{k}/{doc}"] == 1 for s in stores.values() for k in ("sst", "time"))
    _check_rows(batches, roots, np.arange(4, 16))


def test_a_join_of_a_concat_and_a_store_given_by_path_reads_each_document_once(
    roots: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive-and-forcing join: a concatenation (``a0 + a1``) joined with a plain store
    given by its path (``b0``, hours 4-11). The plain store is opened once and its documents
    and times GET once in all, through the join and its pipeline, as the concatenation's are.
    Before: the join opened the path twice (its alignment check, then the collection's routing
    store), reading ``b0``'s ``sst`` and ``time`` documents twice and the pipeline a third
    time."""
    opened: list[Any] = []

    def counted(root: Any, **options: Any) -> Any:  # each opening of the path, counted
        opened.append(counting_store(Path(root)))
        return opened[-1]

    a = {k: counting_store(roots[k]) for k in ("a0", "a1")}
    concat_a = concat(list(a.values()), ["sst"])
    monkeypatch.setattr(stores_module, "open_store", counted)
    joined = join({"a": (concat_a, ["sst"]), "b": (str(roots["b0"]), ["sst"])})
    assert joined.lengths.tolist() == [4, 4]
    batches = _epoch(joined, joined.reader)
    assert len(opened) == 1, f"the path was opened {len(opened)} times"
    assert _again({**a, "b0": opened[0]}) == {}
    _check_rows(batches, roots, np.arange(4, 12))


def test_the_arrays_a_join_takes_over_are_opened_over_its_own_store_at_its_own_paths(
    roots: dict[str, Path],
) -> None:
    """Each array the join's reader took over from a concatenation's reader is the array a
    fresh reader of the join's store opens at that path: its store is the join's, its path the
    routed one, its metadata the same; the coordinates it took over are keyed and named by the
    join's paths, with the values a fresh read decodes. The concatenations' readers gain
    nothing from reads through the join's."""
    concat_a = concat([roots["a0"], roots["a1"]], ["sst"])
    concat_b = concat([roots["b0"], roots["b1"]], ["sst"])
    kept = [dict(concat_a.reader.arrays), dict(concat_b.reader.arrays)]
    joined = join({"a": (concat_a, ["sst"]), "b": (concat_b, ["sst"])})
    held = {p: arr for p, arr in joined.reader.arrays.items() if arr is not None}
    assert {"s0/sst", "s1/sst", "s2/sst", "s3/sst", "s2/time"} <= set(held)
    fresh = coordinate_reader(joined.store)
    for path, array in held.items():
        assert array.store_path.store is joined.store and array.path == path
        assert repr(array.metadata) == repr(fresh.array(path).metadata)  # (NaN fill: repr)
    beneath = {"s0": "a0", "s1": "a1", "s2": "b0", "s3": "b1"}  # (the join's routed stores)
    for head, name in beneath.items():  # its chunks: the store's own, read by zarr
        want = zarr.open_array(roots[name] / "sst", mode="r")[:]
        np.testing.assert_array_equal(held[f"{head}/sst"][:], want)
    assert joined.reader.loaded  # (the times the concatenations read)
    for path, coord in joined.reader.loaded.items():
        assert coord.path == path
        np.testing.assert_array_equal(coord.values, fresh.load(path, fresh.array(path)).values)
    _epoch(joined, joined.reader)
    assert [dict(concat_a.reader.arrays), dict(concat_b.reader.arrays)] == kept
