"""A trial of anemoi-datasets' ``missing_dates`` (2026-12-07): stores laid out as ``anemoi-datasets
create`` writes them (``data (time, variable, ensemble, cell)``, ``dates``, the names in the
group's ``variables``, dates without data listed in its ``missing_dates``), read alone, joined
by ``concat`` and as a collection's independent members; zarr's arrays are the oracle.

Found (fixed):

* the ``missing_dates`` of a collection's **independent members** (several converted stores
  opened as one stream, ``Collection.from_groups`` / ``from_arrays``) were not read: samples
  at a member's missing dates were delivered, NaN rows, without a word (``fit_statistics``
  counted them as NaNs). Each member's dates are now its own missing steps, matched among its
  own samples only (another member's sample at that date is kept);
* the ``missing_dates`` of the stores of a ``concat`` were pooled over the joined axis: where
  two stores overlap and ``overlap=`` keeps one store's copy of a time, the other store's
  listing that time (for its own, skipped copy) dropped the kept store's good sample (13 of
  14 samples delivered). Each store's dates are now matched among its own samples only;
* of stores joined by time (``Collection.join``) only the anchor array's store was read: a
  date another store lacks (read at the same index) was delivered, a NaN row. The dates of
  every sampled array's group now drop the samples;
* every build opened the anchor array's group and each parent (``zarr.open_group``: four GETs
  a level, ``zarr.json``, ``.zgroup``, ``.zattrs``, ``.zmetadata``) to look for
  ``missing_dates``, of every store, anemoi's or not; each store of a concatenation was opened
  in turn (and the routing root, no group, tried too). Now only where an array the build reads
  is in anemoi's layout (its dimensions name ``variable``: metadata read already), one
  attribute document a group (``.zattrs``; v3 ``zarr.json``), each group once a build, all at
  once; ``sel(variable=...)`` reads the ``variables`` the same way (one GET, not four);
* a loader state saved before the ``missing_dates`` were dropped (before 2026-12-07; of
  independent members, before this fix) was refused, rightly (its epoch held those samples),
  but the message blamed the user's ``missing=`` and ``missing_objects=`` and said to build
  with the saved run's: nothing the user could do. It now names the store's
  ``missing_dates`` and says to start the data order afresh;
* a group whose attribute document could not be read (a 403, a timeout) was taken as
  listing nothing, without a word (its missing dates then delivered as NaN rows). First the
  array's own group unread warned, naming the key; now (anemoi2, the same day) any group that
  could hold the dates and cannot be read after the store's retries fails the build with an
  ``OSError`` naming the key and saying what to do: one DDP rank refused that GET planned
  other anchors than the rest (a warning on one rank; a 503 burst past the deadline raised
  obstore's bare ``GenericError``). A parent above the group listing them is not read for it;
* ``sel(variable=...)`` read the group's ``variables`` (a GET) on every call: selecting
  variables in a loop cost a GET each. The geometries' reader keeps them (one GET per array);
* ``missing_dates`` that are not dates, of a member, were refused naming the routed path
  (``'s1/data'``); now the member and its collection.

Tried and found right: variables by name in the order asked (``sel(variable=["t_850",
"2t"])``, a scalar name, a name twice, a label slice, beside ``isel(ensemble=1)``; an unknown
name a ``KeyError`` listing the names), carried ``dates`` of each row, a time stride
(``"12h"``) past a missing date (an ensemble stack too), a window across the edge of two
concatenated stores next to a missing date, splits of a concatenation by dates
(``sample_range`` and ``coord=`` on ``dates``), ``missing=`` dates and ``{member: [indices]}``
beside the recorded ones (their union), ``split_by_member``, a v3 store whose ``data`` sits
in a subgroup below the group listing the dates (the nearest parent rule), a mid-epoch state
of independent members resuming bit-exact, states of a single store and of a concatenation
saved by the code before resuming into the same batches (by hand; their fingerprints pinned
here), ``fit_statistics`` on independent members (numpy's ``nanmean`` of the members' data,
no NaN counted) and its ``diff_std`` on a single store (numpy's over the pairs of present
steps). Outside this file (scripts): the counts above, measured with the counting store.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, plan_anchors, write_era5

from insitubatch_nodes import (
    Collection,
    Loader,
    RetryPolicy,
    concat,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
    split_by_member,
)
from insitubatch_nodes.testing import FaultProxy

pytestmark = pytest.mark.timeout(60)

NAMES = ["2t", "t_850", "10u"]
NV, NE, NC, NT = 3, 2, 4, 8
ROOT_DOCS = ("zarr.json", ".zgroup", ".zattrs", ".zmetadata")


def _write(
    root: Path,
    missing: Sequence[str] = (),
    start: str = "2020-01-01T00",
    zarr_format: int = 2,
    below: str = "",
    seed: int = 0,
    at_root: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """A converted anemoi store (zarr v2 as anemoi writes it, or v3): ``data`` 6-hourly from
    ``start``, one date a chunk, in group ``below`` (the root by default; another group of an
    existing store is added to it), ``dates`` beside it, ``variables`` and ``missing_dates``
    (``missing``, their slots left unwritten) on the root group (``at_root=False``: on
    ``below``). Returns ``(data, dates)``, NaN at the missing dates."""
    rng = np.random.default_rng(seed)
    data = (rng.normal(size=(NT, NV, NE, NC)) + 10 * np.arange(NV)[:, None, None]).astype("f4")
    dates = np.datetime64(start, "s") + np.arange(NT) * np.timedelta64(6, "h")
    top = zarr.open_group(root, mode="a" if below else "w", zarr_format=zarr_format)
    group = top.require_group(below) if below else top

    def array(name: str, values: np.ndarray, dims: list[str], chunks: tuple, **kw: Any) -> Any:
        if zarr_format == 3:
            kw["dimension_names"] = dims
        arr = group.create_array(name, shape=values.shape, chunks=chunks, dtype=values.dtype,
                                 **kw)  # fmt: skip
        if zarr_format == 2:
            arr.attrs["_ARRAY_DIMENSIONS"] = dims
        return arr

    arr = array("data", data, ["time", "variable", "ensemble", "cell"], (1, NV, NE, NC),
                fill_value=np.nan)  # fmt: skip
    for i, d in enumerate(dates):
        if str(d.astype("datetime64[h]")) in missing:
            data[i] = np.nan
        else:
            arr[i] = data[i]
    array("dates", dates, ["time"], (NT,))[:] = dates
    for name in ("latitudes", "longitudes"):
        array(name, np.zeros(NC), ["cell"], (NC,), fill_value=0.0)[:] = np.arange(NC) * 10.0 + 5
    attrs: dict[str, Any] = {"variables": NAMES, "frequency": "6h"}
    if missing:
        attrs["missing_dates"] = [f"{d}:00:00" for d in missing]
    (top if at_root else group).attrs.update(attrs)
    return data, dates


def _rows(pipe: Any, label: str = "x") -> list[tuple[int, int]]:
    """Every (member, index) the pipeline's epoch delivers, each row checked finite."""
    seen = []
    for batch in pipe:
        assert np.isfinite(batch[label]).all()
        members = batch.members[label] if batch.members else np.zeros(len(batch[label]), int)
        idx = batch.sample_indices[label]
        seen += zip(members.tolist(), (idx if idx.ndim == 1 else idx[:, -1]).tolist(), strict=True)
    return sorted(seen)


def _two_members(tmp_path: Path, routed: bool) -> tuple[Collection, list[np.ndarray]]:
    """Two converted stores as a collection of independent members ``a`` and ``b``, the same
    dates in both, each missing its own date: in two stores (routed), or two groups of one."""
    if routed:
        parts = [_write(tmp_path / "a.zarr", ["2020-01-01T12"]),
                 _write(tmp_path / "b.zarr", ["2020-01-02T06"], seed=1)]  # fmt: skip
        coll = Collection.from_groups(
            None, [(str(tmp_path / n), "") for n in ("a.zarr", "b.zarr")], {"data": "data"},
            names=["a", "b"],
        )  # fmt: skip
        return coll, [p[0] for p in parts]
    one = tmp_path / "one.zarr"
    parts = [_write(one, ["2020-01-01T12"], below="a", at_root=False),
             _write(one, ["2020-01-02T06"], below="b", at_root=False, seed=1)]  # fmt: skip
    coll = Collection.from_groups(str(one), ["a", "b"], {"data": "data"})
    return coll, [p[0] for p in parts]


@pytest.mark.parametrize("routed", [True, False], ids=["two-stores", "two-groups"])
def test_each_independent_anemoi_member_s_missing_dates_are_its_own_missing_steps(
    tmp_path: Path, routed: bool
) -> None:
    """Member ``a`` has no data at 12:00 on the 1st (sample 2), ``b`` at 06:00 on the 2nd
    (sample 5); the other member has data at each. Windows ``[-1, 0]`` stay within a member."""
    coll, data = _two_members(tmp_path, routed)
    view = coll["data"].sel(variable=["t_850", "2t"]).window([-1, 0])
    with insitu_pipeline(coll, split_by_chunk(coll["data"], (1.0, 0.0, 0.0)), {"x": view},
                         batch_size=4) as pipe:  # fmt: skip
        for batch in pipe:
            for m, idx, row in zip(batch.members["x"], batch.sample_indices["x"], batch["x"],
                                   strict=True):  # fmt: skip
                np.testing.assert_array_equal(row, data[int(m)][idx][:, [1, 0]])
        seen = _rows(pipe)
    gone = {0: 2, 1: 5}
    assert seen == [(m, i) for m in (0, 1) for i in range(1, NT) if gone[m] not in (i, i - 1)]


def test_fit_statistics_on_independent_anemoi_members_skips_their_missing_dates(
    tmp_path: Path,
) -> None:
    coll, data = _two_members(tmp_path, routed=True)
    view = coll["data"].sel(variable=["2t"])
    stats = fit_statistics(coll, split_by_chunk(coll["data"], (1.0, 0.0, 0.0)), {"x": view})
    both = np.concatenate(data)[:, 0]
    assert stats.nan_count["x"].sum() == 0  # (42 NaNs counted, before)
    assert stats.count["x"].sum() == np.isfinite(both).sum()
    np.testing.assert_allclose(stats.mean["x"].ravel(), [np.nanmean(both)], rtol=1e-6)


def test_a_user_s_missing_dates_and_member_indices_add_to_the_recorded_ones(
    tmp_path: Path,
) -> None:
    coll, _ = _two_members(tmp_path, routed=True)
    manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
    view = {"x": coll["data"].sel(variable=["2t"])}
    with insitu_pipeline(coll, manifest, view, batch_size=8, missing={"b": [0]}) as pipe:
        assert _rows(pipe) == [(m, i) for m in (0, 1) for i in range(NT)
                               if (m, i) not in {(0, 2), (1, 5), (1, 0)}]  # fmt: skip
    day = [np.datetime64("2020-01-02T12")]  # (sample 6 of both)
    with insitu_pipeline(coll, manifest, view, batch_size=8, missing=day, stride="12h") as pipe:
        assert _rows(pipe) == [(0, 0), (0, 4), (1, 0), (1, 2), (1, 4)]
    by_member = split_by_member(coll, {"train": ["b"], "val": ["a"]})
    with insitu_pipeline(coll, by_member, view, batch_size=8, split="val") as pipe:
        assert _rows(pipe) == [(0, i) for i in range(NT) if i != 2]


def test_a_build_reads_each_anemoi_group_s_attributes_once_and_another_store_s_not_at_all(
    tmp_path: Path,
) -> None:
    """Counted by a store wrapper: the root group's documents read while the pipeline is
    built (its views made before). Before: ``zarr.json``, ``.zgroup``, ``.zattrs`` and
    ``.zmetadata`` of the root, of every store, and of each store of a concatenation in turn."""
    _write(tmp_path / "a.zarr", ["2020-01-01T12"])
    store = counting_store(tmp_path / "a.zarr")
    g = open_geometries(store)["data"]
    views = {"x": g.sel(variable=["2t"]), "y": g.sel(variable=["2t"]).shift(1),
             "z": g.isel(variable=[1, 2])}  # fmt: skip
    store.reset_counts()
    with insitu_pipeline(store, split_by_chunk(g, (1.0, 0.0, 0.0)), views, batch_size=4) as pipe:
        assert {k: store.counts[k] for k in ROOT_DOCS} == dict.fromkeys(ROOT_DOCS, 0) | {
            ".zattrs": 1
        }
        assert len(_rows(pipe)) == NT - 3  # (2 and 3 dropped, and the first)
    write_era5(tmp_path / "era5.zarr")
    store = counting_store(tmp_path / "era5.zarr")
    t2m = open_geometries(store)["t2m"]
    store.reset_counts()
    with insitu_pipeline(store, split_by_chunk(t2m, (1.0, 0.0, 0.0)), {"x": t2m}, batch_size=4):
        assert {k: store.counts[k] for k in ROOT_DOCS} == dict.fromkeys(ROOT_DOCS, 0)
    for name in ("b", "c"):  # (three stores: equal stores are one, read once)
        shutil.copytree(tmp_path / "a.zarr", tmp_path / f"{name}.zarr")
    stores = [counting_store(tmp_path / f"{name}.zarr") for name in "abc"]
    members = Collection.from_groups(None, [(s, "") for s in stores], {"data": "data"},
                                     names=["p", "q", "r"])  # fmt: skip
    x = members["data"].sel(variable=["2t"])
    for s in stores:
        s.reset_counts()
    manifest = split_by_chunk(members["data"], (1.0, 0.0, 0.0))
    with insitu_pipeline(members, manifest, {"x": x, "y": x.shift(1)}, batch_size=8) as pipe:
        for s in stores:
            assert {k: s.counts[k] for k in ROOT_DOCS} == dict.fromkeys(ROOT_DOCS, 0) | {
                ".zattrs": 1
            }
        assert len(_rows(pipe)) == 3 * (NT - 3)


def test_a_member_s_missing_dates_that_are_no_dates_are_refused_naming_the_member(
    tmp_path: Path,
) -> None:
    coll, _ = _two_members(tmp_path, routed=True)
    zarr.open_group(tmp_path / "b.zarr", mode="r+").attrs["missing_dates"] = ["yesterday"]
    with pytest.raises(ValueError, match=r"member 'b' .* lists missing_dates \['yesterday'\]"):
        insitu_pipeline(coll, split_by_chunk(coll["data"], (1.0, 0.0, 0.0)), {"x": coll["data"]},
                        batch_size=8)  # fmt: skip


@pytest.mark.parametrize(
    ("at_root", "refused", "fails"),
    [(True, ".zattrs", True), (True, "era/.zattrs", True), (False, ".zattrs", False)],
    ids=["the-group-listing-them", "a-group-below-it", "a-parent-above-it"],
)
def test_an_anemoi_group_whose_attributes_cannot_be_read_fails_the_build_saying_what_to_do(
    tmp_path: Path, at_root: bool, refused: str, fails: bool
) -> None:
    """A store that refuses a group's ``.zattrs`` (an S3 403): where that group could hold the
    ``missing_dates`` (the array's, or one between it and the group that lists them) they
    cannot be known, and the build fails; a parent above the group that lists them is not
    needed. Before, the array's own group unread warned and read the samples at the dates (a
    parent's, without a word): one DDP rank refused it planned other samples than the rest."""
    _write(tmp_path / "s.zarr", ["2020-01-01T12"], below="era", at_root=at_root)
    store = counting_store(tmp_path / "s.zarr")
    g = open_geometries(store)["era/data"]
    store.fail[refused] = PermissionError("403 Forbidden")
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    if not fails:
        with insitu_pipeline(store, manifest, {"x": g}, batch_size=8) as pipe:
            assert _rows(pipe) == [(0, i) for i in range(NT) if i != 2]
        return
    with pytest.raises(PermissionError) as caught:
        insitu_pipeline(store, manifest, {"x": g}, batch_size=8)
    assert f"cannot read {refused!r} from store" in str(caught.value)
    assert "'era/data'" in str(caught.value) and "'missing_dates' attribute" in str(caught.value)
    assert "Grant read access to that object" in str(caught.value)
    assert isinstance(caught.value.__cause__, PermissionError)
    store.fail.clear()  # (the names sel() looks up: the same rule)
    g = open_geometries(store)["era/data"]
    store.fail[refused] = PermissionError("403 Forbidden")
    with pytest.raises(PermissionError, match="'variables' attribute decides the names sel"):
        g.sel(variable=["2t"])


@pytest.mark.xdist_group("s3")
@pytest.mark.parametrize(
    ("status", "fail_first"), [(503, 2), (403, 10**6), (503, 10**6)],
    ids=["503-retried", "403", "503-past-the-deadline"],
)  # fmt: skip
def test_a_rank_that_cannot_read_the_dates_fails_its_build_never_plans_other_anchors(
    tmp_path: Path,
    s3_upload: Any,
    s3_server: str,
    s3_options: dict[str, Any],
    status: int,
    fail_first: int,
) -> None:
    """Two ranks over one S3 store, rank 1 through a ``FaultProxy`` that answers its GETs of the
    root group's ``.zattrs`` with ``status`` (the first ``fail_first`` of them) while it
    builds (the geometries opened before: ``open_geometries`` reads that document too, and
    fails there, for every rank alike). A transient
    fault is retried by the store and both ranks plan the same anchors, without the missing
    date's; a lasting one fails rank 1's build once the store's retries are spent. Before,
    rank 1 warned and planned the samples at the missing date too (4 batches of 1 to rank 0's
    3; DDP then hangs, or trains on NaN rows)."""
    _write(tmp_path / "s.zarr", ["2020-01-01T12"])
    url = s3_upload(tmp_path / "s.zarr", "anemoi/s.zarr")
    policy = RetryPolicy(timeout_s=0.5, initial_backoff_s=0.02, max_backoff_s=0.05,
                         connect_timeout_s=0.5, stall_timeout_s=0.5)  # fmt: skip
    port = int(s3_server.rsplit(":", 1)[1])
    g = open_geometries(open_store(url, **s3_options))["data"]  # (the root read: not faulted)
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))

    def build(rank: int, endpoint: str) -> Any:
        store = open_store(url, retry=policy, **{**s3_options, "endpoint": endpoint})
        return insitu_pipeline(store, manifest, {"x": g}, batch_size=1, rank=rank,
                               world_size=2, coords=())  # fmt: skip

    plans = []
    with FaultProxy(port, fail_first=fail_first, status=status, match="s.zarr/.zattrs") as proxy:
        with build(0, s3_server) as pipe:
            plans.append(plan_anchors(pipe.stages.plan))
        if fail_first > 2:
            with pytest.raises(OSError, match=r"cannot read '\.zattrs' from store s3://"):
                build(1, proxy.endpoint)
            assert proxy.injected >= 1
            return
        with build(1, proxy.endpoint) as pipe:
            plans.append(plan_anchors(pipe.stages.plan))
        assert proxy.injected == 2
    dealt = [sorted(a for batch in plan for a in batch) for plan in plans]
    assert [len(d) for d in dealt] == [(NT - 1) // 2] * 2  # (7 anchors: one dropped, even)
    assert set(dealt[0]).isdisjoint(dealt[1]) and 2 not in dealt[0] + dealt[1]


@pytest.mark.parametrize("members", [False, True], ids=["one-store", "independent-members"])
def test_a_state_saved_before_the_missing_dates_were_dropped_is_refused_saying_why_and_what_to_do(
    tmp_path: Path, members: bool
) -> None:
    """A state of the old reading is a state of the store without the attribute: its epoch
    held the samples at those dates, so its position cannot be carried over; the message said
    to build with the saved run's ``missing=`` (the user gave none)."""
    store: Any
    if members:
        store, _ = _two_members(tmp_path, routed=True)
        root, g = tmp_path / "a.zarr", store["data"]
    else:
        root = tmp_path / "s.zarr"
        _write(root, ["2020-01-01T12"])
        store, g = str(root), open_geometries(root)["data"]
    manifest = split_by_chunk(g, (1.0, 0.0, 0.0))
    listed = zarr.open_group(root, mode="r+").attrs.pop("missing_dates")  # (read as before)
    with insitu_pipeline(store, manifest, {"x": g}, batch_size=2) as pipe:
        loader = Loader(pipe)
        next(iter(loader))
        state = loader.state_dict()
    zarr.open_group(root, mode="r+").attrs["missing_dates"] = listed
    with insitu_pipeline(store, manifest, {"x": g}, batch_size=2) as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match=r"missing_dates.*start this run's data order"):
            next(iter(loader))


def test_a_single_store_s_and_a_concatenation_s_missing_steps_are_hashed_as_before(
    tmp_path: Path,
) -> None:
    """Their ``missing_dates`` were dropped before this change (earlier on 2026-12-07): the
    fingerprints are those the code before computed (measured on it), so their states still
    resume (a state saved by it resumed into the same batches, tried by hand)."""
    _write(tmp_path / "y0.zarr", ["2020-01-01T06"])
    _write(tmp_path / "y1.zarr", ["2020-01-03T00"], start="2020-01-03T00", seed=1)
    _write(tmp_path / "s.zarr", ["2020-01-01T12"])
    archive = concat([str(tmp_path / "y0.zarr"), str(tmp_path / "y1.zarr")], ["data"])
    single = open_geometries(tmp_path / "s.zarr")["data"]
    for store, g, before in ((archive, archive["data"], "c3e8bef9ce10d9e9"),
                             (str(tmp_path / "s.zarr"), single, "280bb10687b16a68")):  # fmt: skip
        with insitu_pipeline(store, split_by_chunk(g, (1.0, 0.0, 0.0)),
                             {"x": g.sel(variable=["2t"])}, batch_size=3) as pipe:  # fmt: skip
            assert pipe.stages.plan.config()["missing_steps"] == before


def test_independent_anemoi_members_resume_bit_exact_mid_epoch(tmp_path: Path) -> None:
    coll, _ = _two_members(tmp_path, routed=True)
    manifest = split_by_chunk(coll["data"], (1.0, 0.0, 0.0))
    view = {"x": coll["data"].sel(variable=["2t", "10u"]).window([-1, 0])}

    def records(state: object = None, stop: int | None = None) -> tuple[list, object]:
        out: list = []
        with insitu_pipeline(coll, manifest, view, batch_size=3, seed=2) as pipe:
            loader = Loader(pipe)
            if state is not None:
                loader.load_state_dict(state)
            for batch in loader:
                out.append(batch["x"].tobytes())
                if len(out) == stop:
                    return out, loader.state_dict()
        return out, None

    ref, _ = records()
    head, state = records(stop=2)
    assert head + records(state)[0] == ref


def test_concatenated_anemoi_stores_by_name_with_dates_across_their_edge(tmp_path: Path) -> None:
    """The second store misses its first date (2020-01-03T00, joined sample 8): the windows
    that reach it from either side are dropped, the one across the edge before it kept."""
    a, ta = _write(tmp_path / "y0.zarr", ["2020-01-01T06"])
    b, tb = _write(tmp_path / "y1.zarr", ["2020-01-03T00"], start="2020-01-03T00", seed=1)
    data, dates = np.concatenate([a, b]), np.concatenate([ta, tb])
    archive = concat([str(tmp_path / "y0.zarr"), str(tmp_path / "y1.zarr")], ["data"])
    view = archive["data"].sel(variable=["10u", "2t"]).window([-1, 0])
    seen = []
    with insitu_pipeline(archive, split_by_chunk(archive["data"], (1.0, 0.0, 0.0)),
                         {"x": view}, batch_size=5, coords=["dates"]) as pipe:  # fmt: skip
        for batch in pipe:
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"], data[idx][:, :, [2, 0]])
            np.testing.assert_array_equal(batch.coords["x"]["dates"], dates[idx])
            seen += idx[:, 1].tolist()
    assert sorted(seen) == [i for i in range(1, 2 * NT) if {i, i - 1}.isdisjoint({1, 8})]


@pytest.mark.parametrize("overlap", ["first", "last"])
def test_a_concatenated_store_s_missing_date_in_the_overlap_it_loses_drops_nothing(
    tmp_path: Path, overlap: str
) -> None:
    """Two stores overlap by two dates (2020-01-02T12 and T18); the store whose copy
    ``overlap=`` skips lists 2020-01-02T12 as missing, the other holds it: it is read, from
    the store kept. Before, every store's dates were pooled over the joined axis, and that
    sample was dropped."""
    gap = {"first": ([], ["2020-01-02T12"]), "last": (["2020-01-02T12"], [])}[overlap]
    a, ta = _write(tmp_path / "y0.zarr", gap[0])
    b, tb = _write(tmp_path / "y1.zarr", gap[1], start="2020-01-02T12", seed=1)
    data, dates = (np.concatenate([a, b[2:]]), np.concatenate([ta, tb[2:]]))
    if overlap == "last":
        data, dates = np.concatenate([a[:-2], b]), np.concatenate([ta[:-2], tb])
    archive = concat([str(tmp_path / "y0.zarr"), str(tmp_path / "y1.zarr")], ["data"],
                     overlap=overlap)  # fmt: skip
    view = {"x": archive["data"].sel(variable=["2t"])}
    with insitu_pipeline(archive, split_by_chunk(archive["data"], (1.0, 0.0, 0.0)), view,
                         batch_size=5, coords=["dates"]) as pipe:  # fmt: skip
        for batch in pipe:
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"], data[idx][:, [0]])
            np.testing.assert_array_equal(batch.coords["x"]["dates"], dates[idx])
        assert [i for _, i in _rows(pipe)] == list(range(14))  # (13 before: one dropped)


def test_two_anemoi_stores_joined_by_time_drop_the_dates_either_lacks(tmp_path: Path) -> None:
    """``Collection.join``: the anchor is ``era``'s; ``reg`` lacks another date, read at the
    same index. Before, only the anchor array's store was read: ``reg``'s missing date was
    delivered, a NaN row of ``y``."""
    era, _ = _write(tmp_path / "era.zarr", ["2020-01-01T12"])
    reg, _ = _write(tmp_path / "reg.zarr", ["2020-01-02T06"], seed=1)
    joined = Collection.join({"era": (str(tmp_path / "era.zarr"), ["data"]),
                              "reg": (str(tmp_path / "reg.zarr"), ["data"])})  # fmt: skip
    views = {"x": joined["era/data"].sel(variable=["2t"]), "y": joined["reg/data"]}
    with insitu_pipeline(joined, split_by_chunk(joined["era/data"], (1.0, 0.0, 0.0)), views,
                         batch_size=3) as pipe:  # fmt: skip
        for batch in pipe:
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"], era[idx][:, [0]])
            np.testing.assert_array_equal(batch["y"], reg[idx])
        assert _rows(pipe, "y") == [(0, i) for i in range(NT) if i not in (2, 5)]


def test_a_v3_store_s_data_in_a_subgroup_takes_the_missing_dates_of_its_nearest_parent(
    tmp_path: Path,
) -> None:
    data, _ = _write(tmp_path / "v3.zarr", ["2020-01-02T00"], zarr_format=3, below="era")
    g = open_geometries(tmp_path / "v3.zarr")["era/data"]
    view = {"x": g.sel(variable=["t_850"])}
    with insitu_pipeline(str(tmp_path / "v3.zarr"), split_by_chunk(g, (1.0, 0.0, 0.0)), view,
                         batch_size=3) as pipe:  # fmt: skip
        for batch in pipe:
            np.testing.assert_array_equal(batch["x"], data[batch.sample_indices["x"]][:, [1]])
        assert _rows(pipe) == [(0, i) for i in range(NT) if i != 4]


def test_selecting_variables_by_name_in_a_loop_reads_the_variables_attribute_once(
    tmp_path: Path,
) -> None:
    """``sel(variable=...)`` looks names up in the group's ``variables``: read once for the
    geometries opened together (and a collection's members), not a GET per call (before: one
    ``.zattrs`` per ``sel``, five here)."""
    data, _ = _write(tmp_path / "s.zarr")
    store = counting_store(tmp_path / "s.zarr")
    g = open_geometries(store)["data"]
    store.reset_counts()
    views = [g.sel(variable=[name]) for name in NAMES] + [g.sel(variable="2t"), g.window([0])]
    views.append(views[-1].sel(variable=["10u", "t_850"]))
    assert store.counts[".zattrs"] == 1
    assert [v.inner_shape for v in views[:3]] == [(1, NE, NC)] * 3
    with insitu_pipeline(store, split_by_chunk(g, (1.0, 0.0, 0.0)), {"x": views[-1]},
                         batch_size=4) as pipe:  # fmt: skip
        for batch in pipe:
            np.testing.assert_array_equal(batch["x"], data[batch.sample_indices["x"]][:, :, [2, 1]])
    _two_members(tmp_path, routed=True)
    stores = [counting_store(tmp_path / n) for n in ("a.zarr", "b.zarr")]
    coll = Collection.from_groups(None, [(s, "") for s in stores], {"data": "data"},
                                  names=["a", "b"])  # fmt: skip
    member = coll["data"]
    for s in stores:
        s.reset_counts()
    for name in NAMES:
        member.sel(variable=[name])
    assert [s.counts[".zattrs"] for s in stores] == [1, 1]
