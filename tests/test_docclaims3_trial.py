"""The claims of docs/tracing.md, docs/transforms.md, docs/collections.md and docs/concepts.md,
each taken at its word and checked against the package on tiny stores, with zarr and numpy as
the oracles.

Found wrong (fixed):

- tracing.md: "a missing stored object, filled with the fill value, is a ``decode`` span with
  ``missing`` set". Only one fill path (a one-sample chunk decoded in place in its batch row)
  marked it, and that one wrote ``chunk: -1`` for the chunk; every other path (a slot, a tiled
  row, an object read through a GET) recorded a missing object as a plain decode. Every path
  now marks a missing object, with its chunk.
- concepts.md: an ``xr.open_zarr`` Dataset "stands for the store it was read from", and
  ``open_geometries(ds)`` is its data variables. xarray lists a 0-D grid mapping (``crs``, which
  the package's own ``make_era5_like`` writes) among them, so ``open_geometries(ds)`` raised
  "sample_axis=0 is out of range for array 'crs'" where ``open_geometries(store)`` skips it.
  A Dataset's 0-D data variables are now left out, as its store's are.

Found wrong in the docs (the code is right; the sentence now says what it does):

- tracing.md: for a collection over several stores "a stored object's ``array`` and ``key``
  are those of the store the pipeline reads through: ``s<i>/`` before the path". The ``key`` is
  (``s1/t2m/c/0/0/0``); ``array`` is the collection's virtual path (``coll["t2m"].path``), as in
  ``applies`` and ``DecodedChunk.array``, and ``chunk`` a chunk of the virtual axis.
- collections.md: ``missing={"cube_lo": [17], "cube_hi": [3, -1]}`` "drops ... the first and
  last of ``cube_hi``": it drops its index 3 and its last (the first is 0).
- concepts.md: the defaults of ``PlanConfig`` listed every field but ``stride=1``.
- transforms.md: check-transform "says so when the chunk is under 1 MB": only when the GIL
  probe fails on such a chunk (a passing transform's report says nothing of its size).

Checked and found right (kept as tests where cheap): ``read`` + ``GET`` spans equal
``report.gets`` and ``decode`` spans ``report.decodes`` (missing and undecodable objects
included, local reads and GETs, under ``"raise"`` too); the trace's times start at 0 at the
epoch's first ``next()``; ``next`` ends with ``batch -1, end``; a pipeline without
``trace=True`` has ``report.trace`` None and ``write_trace`` raises ``ValueError``; a trace
written mid-epoch holds the spans so far; ``s<i>/`` keys of a concatenation; a chunk transform
runs once per chunk per epoch, none for pool hits, once for two labels of one array, and its
exception is a ``ChunkTransformError`` under ``on_bad_chunk="nan"`` too;
``DecodedChunk.member``, ``chunk_index`` and ``sample_range`` count within the member, a
member's last chunk holding only its own samples (zarr's values), ``member`` None on a
concatenation and a join; ``applies`` with an unknown name or a static array, and a
``StandardScaler`` with statistics for a static array, raise ``ValueError`` at build;
``StandardScaler`` and ``Coarsen`` give float32 for integers of at most 16 bits and bool,
float64 for 32/64-bit integers, keep float dtypes (float16 near 60000 stays finite, ``x - mean``
past float16 computed right); ``Coarsen`` refuses indivisible axes and a wrong factor count at
build, a NaN makes its block NaN; ``on_bad_chunk="nan"`` fills an integer array's bad tile
with its fill value and a float's with NaN, lists ``(array, chunk, tile)``, re-reads only the
bad chunks next epoch and lists them again; ``to_torch`` on the CPU shares memory except a
flipped label; check-transform's exit codes (0, 1 for an undeclared reshape or float64 output
or a lying ``output_inner``, 2 for an unknown array, attribute or chunk); patched views
refuse chunk transforms, float ``within`` bounds are refused, grid windows every stride plus
one flush with the far edge (and with ``within``'s ``hi``), one 96² tile draws one 64² crop by
default; ``split_by_chunk`` and ``split_by_member`` round by largest remainders, ties to the
earlier split; ``split_by_member`` refuses a name in two splits (``ValueError``), an unknown
one (``KeyError``), a split of a reordered collection (``ValueError``), takes acquisition ids as
ints or strings; an int ``stride`` counts from each member's first sample; ``missing=`` by
member refuses an unknown member (``KeyError``) and an index outside it (``ValueError``);
``missing_objects="drop"`` on a collection drops the window reading another variable's absent
step; ``read_plate``'s levels by index, numpy scalars, pixel size (within 1e-4) and axis
mapping, absent wells and fields skipped with one warning, a well listed twice refused, a
partial ``acquisition`` key warned and left out; ``open_images`` on a plate and ``open_plate``
on a field refused naming the other; ``concat`` with ``overlap="first"``/``"last"`` (values
checked per time), overlaps off a chunk boundary and a store inside another refused; a join of
chunks of 4 and 3 steps starts where both are on a boundary (values checked per time); members
with another ``scale_factor`` refused decoded, read raw as xarray reads them; a v2 time of 0
with fill 0 refused as NaT (xarray reads NaT); ``sel`` on members with other coordinates
refused; ``from_groups``' ``dims=`` checks; ``subset`` of a timeline consecutive only; a join
refuses a concatenation made with other decoding options; a rewritten ``scale_factor`` refused
by the pipeline; scenes of one time each take no time-delta window, keep time strides and
``missing=`` dates; ``missing=`` dates between two times refused, outside or in a gap dropping
nothing; backwards times refused; ``set_views`` with time-delta windows on a pipeline built
without times refused; product-axis views refuse ``shift``, ``window``, ``stride``,
``missing=``, ``coords=`` and single-axis views beside them; the ramp's lead block of
``ceil(batch_size / samples_per_chunk)`` chunks; a ``"6h"`` stride on hourly one-step objects
reads 2 of every 6, times all off the grid refused; ``open_store``'s refusals and messages (19
spellings) and ``RetryPolicy``'s defaults; ``open_geometries`` skipping 0-D, dimension and CF
``coordinates`` arrays, finding arrays below folders without groups; zero-length field axes
refused, strings and records read and refused by ``to_torch``; the time units xarray reads and
refuses, ``months`` in ``360_day``, ``common_years`` in ``noleap``, a leap-day reference date in
``noleap`` refused (xarray as the oracle). Every printed value of the four pages' code blocks
equals what the page says, and the recipes the pages name (trace_epoch, fit_scaler,
hcs_segmentation with and without ``--t 3 --tz``, scenes_collection, joined_stores
``--atmos-stores 2``, time_features in four calendars, forecast_rollout with a growing
rollout) print what the pages say.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Collection,
    DecodedChunk,
    Loader,
    concat,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    split_by_member,
)
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan import PlanConfig
from insitubatch_nodes.synthetic import make_era5_like

pytestmark = pytest.mark.timeout(60)


def _decode_spans(pipe: Any, folder: Path) -> tuple[Any, list[dict[str, Any]]]:
    report = pipe.report()
    events = json.loads(Path(report.write_trace(folder / "epoch.json")).read_text())
    return report, [e["args"] for e in events["traceEvents"] if e.get("name") == "decode"]


@pytest.mark.parametrize(
    ("samples_per_chunk", "tile", "direct", "local"),
    [
        (1, 4, True, True),  # one-sample chunks decoded in place in their batch rows
        (1, 2, True, True),  # tiled rows decoded in place
        (2, 4, False, True),  # chunks kept in slots
        (2, 2, False, False),  # read through GETs
    ],
)
def test_a_missing_stored_object_is_a_decode_span_marked_missing_with_its_own_chunk(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    samples_per_chunk: int,
    tile: int,
    direct: bool,
    local: bool,
) -> None:
    monkeypatch.setenv("INSITUBATCH_NODES_LOCAL_READS", "1" if local else "0")
    root = tmp_path / "s.zarr"
    array = zarr.create_array(root, name="v", shape=(6, 4), chunks=(samples_per_chunk, tile),
                              dtype="f4", fill_value=-1, dimension_names=("t", "x"))  # fmt: skip
    array[...] = 1
    missing_tile = 1 if tile == 2 else 0  # of a tiled chunk, its second tile only
    (root / "v" / "c" / "2" / str(missing_tile)).unlink()
    geom = open_geometries(root)["v"]
    fetch = FetchOptions(trace=True, direct=direct)
    with insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"v": geom},
                         batch_size=6, shuffle=False, fetch=fetch) as pipe:  # fmt: skip
        batch = next(iter(Loader(pipe)))
        report, spans = _decode_spans(pipe, tmp_path)
    want = zarr.open_array(root, path="v", mode="r")[:]
    np.testing.assert_array_equal(batch["v"], want[batch.sample_indices["v"]])
    assert len(spans) == report.decodes
    marked = [(s["chunk"], s["tile"]) for s in spans if s.get("missing")]
    assert marked == [(2, [missing_tile])]
    assert all(s["chunk"] >= 0 for s in spans)


def _write_period(root: Path, start: int, n: int) -> None:
    """collections.md's ``write_period``: t2m (time, lat, lon) chunked 4, 6-hourly from
    ``start`` hours after 2000-01-01, values ``1000 * start + position``."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    t2m = group.create_array("t2m", shape=(n, 2, 3), chunks=(4, 2, 3), dtype="f4",
                             dimension_names=("time", "lat", "lon"))  # fmt: skip
    t2m[:] = np.arange(n * 6, dtype="f4").reshape(n, 2, 3) + 1000 * start
    time = group.create_array("time", shape=(n,), chunks=(n,), dtype="i8",
                              dimension_names=("time",))  # fmt: skip
    time[:] = start + 6 * np.arange(n)
    time.attrs.update({"units": "hours since 2000-01-01", "calendar": "standard"})


def test_a_concatenations_trace_names_the_virtual_array_and_the_routed_key_and_counts_as_the_report(
    tmp_path: Path,
) -> None:
    _write_period(tmp_path / "a.zarr", 0, 8)
    _write_period(tmp_path / "b.zarr", 48, 8)
    coll = concat([str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")], ["t2m"])
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    views = {"x": coll["t2m"], "y": coll["t2m"].shift(1)}
    with insitu_pipeline(coll, manifest, views, batch_size=3,
                         fetch=FetchOptions(trace=True)) as pipe:  # fmt: skip
        n = sum(1 for _ in pipe)
        report = pipe.report()
        events = json.loads(Path(report.write_trace(tmp_path / "t.json")).read_text())
    spans = [e for e in events["traceEvents"] if e.get("ph") == "X" or e.get("ph") == "b"]
    objects = [e["args"] for e in spans if e["name"] in ("GET", "read")]
    assert len(objects) == report.gets == 4
    assert len([e for e in spans if e["name"] == "decode"]) == report.decodes == 4
    assert {o["array"] for o in objects} == {coll["t2m"].path}
    assert sorted(o["key"] for o in objects if "key" in o) == [
        "s0/t2m/c/0/0/0", "s0/t2m/c/1/0/0", "s1/t2m/c/0/0/0", "s1/t2m/c/1/0/0",
    ]  # fmt: skip
    nexts = sorted(e["args"]["batch"] for e in spans if e["name"] == "next")
    assert nexts == [-1, *range(n)]
    assert min(e["ts"] for e in spans) >= 0


def test_missing_by_member_drops_the_indices_named_within_each_member_negative_from_its_end(
    tmp_path: Path,
) -> None:
    sizes = {"cube_lo": 20, "cube_hi": 6}
    for name, n in sizes.items():
        zarr.create_array(tmp_path / "s.zarr", name=name, shape=(n, 2), chunks=(2, 2),
                          dtype="f4", dimension_names=("freq", "x"))[...] = 0  # fmt: skip
    store = str(tmp_path / "s.zarr")
    coll = Collection.from_arrays([(store, n) for n in sizes], names=list(sizes),
                                  sample_axis="freq")  # fmt: skip
    manifest = split_by_member(coll, {"train": 1.0})
    missing = {"cube_lo": [17], "cube_hi": [3, -1]}
    with insitu_pipeline(coll, manifest, {"x": coll["data"]}, batch_size=4,
                         missing=missing) as pipe:  # fmt: skip
        got = [(coll.members[int(m)], int(i)) for b in Loader(pipe)
               for m, i in zip(b.members["x"], b.sample_indices["x"], strict=True)]  # fmt: skip
    every = {(name, i) for name, n in sizes.items() for i in range(n)}
    assert len(got) == len(set(got))
    assert every - set(got) == {("cube_lo", 17), ("cube_hi", 3), ("cube_hi", 5)}
    with pytest.raises(KeyError, match="no member"):
        insitu_pipeline(coll, manifest, {"x": coll["data"]}, batch_size=4, missing={"nope": [1]})
    with pytest.raises(ValueError, match="holds 6 samples"):
        insitu_pipeline(coll, manifest, {"x": coll["data"]}, batch_size=4,
                        missing={"cube_hi": [-7]})  # fmt: skip


def test_concepts_md_lists_every_plan_config_field_with_its_default() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "concepts.md").read_text()
    listed = re.search(r"`PlanConfig`.*?holding `([^`]*)`", text, re.S)
    assert listed is not None
    said = dict(item.split("=") for item in re.split(r",\s*", listed.group(1)))
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    assert {k: ast.literal_eval(v) for k, v in said.items()} == defaults


def test_a_collections_trace_counts_chunks_on_its_virtual_axis_and_transforms_within_members(
    tmp_path: Path,
) -> None:
    for name, n in (("a", 5), ("b", 3)):
        zarr.create_array(tmp_path / f"{name}.zarr", shape=(n, 4, 4), chunks=(2, 2, 4),
                          dtype="f4", dimension_names=("z", "y", "x"))[...] = 1  # fmt: skip
    coll = Collection.from_arrays([str(tmp_path / f"{n}.zarr") for n in "ab"], names=["a", "b"],
                                  sample_axis="z")  # fmt: skip
    seen: list[tuple[Any, int, tuple[int, int]]] = []

    def record(chunk: DecodedChunk) -> DecodedChunk:
        seen.append((chunk.member, chunk.chunk_index, chunk.sample_range))  # (list.append: atomic)
        return chunk

    with insitu_pipeline(coll, split_by_member(coll, {"train": 1.0}), {"x": coll["data"]},
                         batch_size=2, chunk_transforms=[record],
                         fetch=FetchOptions(trace=True)) as pipe:  # fmt: skip
        for _ in pipe:
            pass
        report = pipe.report()
        events = json.loads(Path(report.write_trace(tmp_path / "t.json")).read_text())
    spans = [e for e in events["traceEvents"] if e.get("ph") in ("X", "b")]
    objects = sorted((e["args"]["chunk"], *e["args"]["tile"]) for e in spans
                     if e["name"] in ("GET", "read"))  # fmt: skip
    # a: chunks 0-2 of the virtual axis (its last holds 1 sample), b: chunks 3-4; two tiles each
    assert objects == [(c, t, 0) for c in range(5) for t in (0, 1)]
    assert len(objects) == report.gets
    assert sorted(e["args"]["chunk"] for e in spans if e["name"] == "transform") == [0, 1, 2, 3, 4]
    assert sorted(seen) == [(0, 0, (0, 2)), (0, 1, (2, 4)), (0, 2, (4, 5)), (1, 0, (0, 2)),
                            (1, 1, (2, 3))]  # fmt: skip


def test_open_geometries_of_a_dataset_as_opened_skips_its_grid_mapping_as_of_its_store(
    tmp_path: Path,
) -> None:
    """xarray keeps a 0-D grid mapping (``crs``) among a Dataset's data variables; the Dataset
    stands for its store, whose geometries skip it."""
    import xarray as xr

    root = tmp_path / "era5.zarr"
    make_era5_like(root, n_time=16, n_lat=4, n_lon=8, n_level=2, samples_per_chunk=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's note on consolidated metadata)
        ds = xr.open_zarr(root)
    assert "crs" in ds.data_vars and ds["crs"].ndim == 0
    geoms = open_geometries(ds)
    assert sorted(geoms) == sorted(open_geometries(root)) == ["t2m", "z"]
    manifest = split_by_chunk(geoms["z"], (1.0, 0.0, 0.0))
    with insitu_pipeline(ds, manifest, {"z": geoms["z"]}, batch_size=4) as pipe:
        batch = next(iter(Loader(pipe)))
    np.testing.assert_array_equal(batch["z"], ds["z"].values[batch.sample_indices["z"]])
    assert sorted(open_geometries(ds[["t2m"]])) == ["t2m"]  # fewer variables: those kept
