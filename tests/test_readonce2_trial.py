"""Trial of read-once, each-sample-once, the epoch report's counts and the trace's spans where
tests/test_readonce_trial.py did not go: S3 (the session's moto server, behind a counting and
faulting ``FaultProxy``), HTTP (nginx), GETs retried and timed out, sharded stores, absent
objects, real gloo ranks over one persistent ``cache_dir``, and ``FetchOptions(trace=True)``.
No wrong answer was found: nothing in the package was changed; every test here is a claim that
held (2026-12-07).

Oracles: the proxy's count of GETs per object (every attempt: obstore's retries included),
nginx's access log (method, path, status), zarr's read of the local copy (every row), the
stores' object sizes, the decompressions counted in ``ChunkDecoder._decode_stored`` (the
readonce trial's ``DECODES``), the trace (``report.trace.spans`` and the file
``write_trace`` writes) and, for ranks, each rank's counting store.

Found right (the claims below): every first GET of every object faulted — a 503, a body cut
by a connection reset, an attempt that never answers, half a body and then nothing — and
retried by obstore: the proxy sees two GETs per object, the report one (``gets``,
``bytes_fetched`` the object's bytes once, ``decodes`` one per object, each decoded once), the
trace one ``GET`` span per object naming its array, chunk and tile (on a sharded store the
shard) and one ``decode`` per decode, ``gather`` spans the batches, the trace file the same
counts with one id per GET pair; ``hits + misses`` the (array, chunk) pairs the rows read and
``misses`` those fetched; each anchor once, each row zarr's; the next epoch reads nothing. A GET
that outlives ``RetryPolicy.timeout_s`` under ``on_bad_chunk="nan"``: counted once with no
bytes, its span naming ``TimeoutError``, its rectangle NaN, and the next epoch reads that
chunk's objects again and only those. With no retries an epoch fails with ``ChunkReadError``
naming the key, the failed GET counted; a fresh pipeline restored from the last
``state_dict()`` delivers the rest, every anchor once over the two (and the same loader
restored with ``load_state_dict`` too, by hand; iterated again without it, it starts the epoch
anew). Absent objects (404) over S3: asked once, counted with no bytes, a ``decode`` span
marked ``missing``, read as the fill value (``missing_objects="read"``); never asked for under
``"drop"``, the anchors dropped and counted. Over nginx each object (a whole shard) is one GET
answered 200 (no range request: a whole-object GET, as concepts.md says), a deleted one a 404
asked once, and a second run over a persistent cache sends no GET. Two gloo ranks over one
``cache_dir`` (processes at once): anchors disjoint, all but at most ``world - 1`` delivered,
equal batch counts, each rank's report its store's GETs, bytes and decodes (and its trace's),
two ranks getting one object only at a cut between their runs (at most the two chunks a
window and the lead reach across it), a second run getting nothing; the same two ranks over S3
(every first GET a 503): the reports' GETs the proxy's less the 503s.
The trace's ``GET`` and ``decode`` spans name the first batch (``batch.index``) whose rows read
their chunk, also in an epoch resumed mid-way (whose batches carry their indices on); an epoch
broken off with GETs stalled in flight: its report counts what its trace holds, and the next
whole epoch's the GETs the store saw. ``direct=True`` rows over S3 with retried GETs: each
object once, each in-place ``decode`` span naming its row and batch; a failed one NaN and
counted. ``concat`` over three buckets: per store the proxy's GETs are the trace's spans keyed
``s<i>/...``, each span's ``chunk`` the collection's, a filled object listed by the
collection's path and chunk. By hand (not kept): chunk transforms (``transform`` spans and
``report.transforms`` equal to the calls, ids right, sharded and not, ``direct`` on and off);
a static member whose GET is retried: ``static_gets`` 1 (the proxy saw 2).

What looked wrong and was the trial's own doing: with ``stall_timeout_s=0.3`` objects no fault
touched were GET 2-5 times — obstore retrying moto's late answers on the loaded machine (load
average 6 on 2 cores), each counted once in the report, as it should be; the claims use 0.5 s
and ask only for "at least two" where stalls are injected. And a pipeline's GETs cancelled at
``reset()``/``close()`` can reach the proxy's thread after the call returned (counted there as
the next epoch's): obstore does stop a cancelled GET (by hand: a cancelled ``get_async`` of an
object that never answers sent 1 request in 2 s, an uncancelled one 7), so ``_clear`` first
waits for the proxy to go quiet. A broken-off epoch's report ends at its last batch (as
documented), so the read-ahead's GETs after it are in neither epoch's report (one run: the
report 15, the proxy 20 by the ``reset()``, five of them stalled and then cancelled).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from test_readonce_trial import DECODES, N_TIME, object_of, whole, write_store

from insitubatch_nodes import (
    Loader,
    RetryPolicy,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
)
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.testing import FaultProxy
from insitubatch_nodes.trace import OBJECT_ARGS

pytestmark = [pytest.mark.xdist_group("s3"), pytest.mark.timeout(90)]

NEVER = "\x00no key has this"
FAST = RetryPolicy(timeout_s=10.0, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(autouse=True)
def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    DECODES.install(monkeypatch)


# ---------------------------------------------------------------------------------------------
# S3: the session's moto server behind a counting, faulting proxy
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("readonce2")
    return {
        "v3": write_store(base / "v3.zarr"),
        "sharded": write_store(base / "sh.zarr", sharded=True),
    }


class Proxy(FaultProxy):
    """A :class:`FaultProxy` whose faulted GETs may also stall (``how``: ``"stall"``, no
    answer; ``"stall_body"``, half the body and then nothing)."""

    how: str | None = None

    def _action(self, method: str, target: str) -> int | str | None:
        act = super()._action(method, target)
        return self.how if act is not None and self.how else act


@pytest.fixture(scope="module")
def proxy(s3_server: str) -> Iterator[Proxy]:
    port = urlsplit(s3_server).port
    assert port is not None
    with Proxy(port, fail_first=0, match=NEVER) as counting:
        yield counting


@pytest.fixture(scope="module")
def buckets(
    local: dict[str, Path], s3_upload: Any, s3_options: dict[str, Any], proxy: FaultProxy
) -> dict[str, Any]:
    urls = {name: s3_upload(path, f"arch/{name}.zarr") for name, path in local.items()}
    return {"urls": urls, "options": {**s3_options, "endpoint": f"http://127.0.0.1:{proxy.port}"}}


STALL = RetryPolicy(
    timeout_s=10.0, initial_backoff_s=0.01, max_backoff_s=0.05, stall_timeout_s=0.5
)  # (a stall timeout much shorter retries a GET that a loaded machine's moto answers late)


def _s3(buckets: dict[str, Any], name: str, **changes: Any) -> Any:
    return open_store(buckets["urls"][name], **{**buckets["options"], "retry": FAST, **changes})


def _proxy_gets(
    proxy: FaultProxy, name: str, arrays: tuple[str, ...] = ("t2m", "z")
) -> Counter[str]:
    """GETs the proxy saw per data object (of ``arrays``) of store ``name``, keyed as in it."""
    with proxy._lock:
        seen = dict(proxy.gets)
    out: Counter[str] = Counter()
    for path, n in seen.items():
        _, sep, key = path.partition(f"/{name}.zarr/")
        if sep and "/c/" in key and key.split("/")[0] in arrays:
            out[key] += n
    return out


def _settle(proxy: FaultProxy, quiet_s: float = 0.25) -> None:
    """Wait until the proxy has seen no request for ``quiet_s`` (at most 3 s): the GETs a
    pipeline started and then cancelled (``reset()``, ``close()``) may reach the proxy's
    thread after the call returned (their bytes dropped, counted in no report); counted after
    a :func:`_clear` they would read as the next epoch's."""
    import time

    deadline = time.monotonic() + 3.0
    last = -1
    while time.monotonic() < deadline:
        with proxy._lock:
            now = sum(proxy.gets.values())
        if now == last:
            return
        last = now
        time.sleep(quiet_s)


def _clear(proxy: FaultProxy) -> None:
    _settle(proxy)
    with proxy._lock:
        proxy.gets.clear()
        proxy.injected = 0


@contextlib.contextmanager
def _faults(proxy: FaultProxy, match: str, n: int, status: int | str) -> Iterator[None]:
    """The first ``n`` GETs of each object whose path has ``match`` answered with ``status``
    (``"reset"``: cut half-way through the body)."""
    with proxy._lock:
        proxy.match, proxy.fail_first = match, n
        proxy.reset = status == "reset"
        proxy.status = status if isinstance(status, int) else 503
        proxy.how = status if status in ("stall", "stall_body") else None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with proxy._lock:
            proxy.match, proxy.fail_first, proxy.reset = NEVER, 0, False
            proxy.how = None  # type: ignore[attr-defined]


def _views(g: dict[str, Any], level: bool = True) -> dict[str, Any]:
    """A window of t2m, z (its level 850, or every level), t2m a step on."""
    return {
        "x": g["t2m"].window([-1, 0]),
        "z": g["z"].sel(level=[850]) if level else g["z"],
        "y": g["t2m"].shift(1),
    }


def _checker(root: Path) -> Any:
    t2m, z = whole(root, "t2m"), whole(root, "z")

    def check(batch: Any) -> None:
        idx = batch.sample_indices
        np.testing.assert_array_equal(batch["x"], t2m[idx["x"]])
        got = batch["z"]
        np.testing.assert_array_equal(got[:, 0] if got.shape[1] == 1 else got[:, 1], z[idx["z"], 1])
        if got.shape[1] > 1:
            np.testing.assert_array_equal(got, z[idx["z"]])
        np.testing.assert_array_equal(batch["y"], t2m[idx["y"]])
        np.testing.assert_array_equal(idx["y"], idx["x"][:, 1] + 1)

    return check


def _epoch(pipe: Any, check: Any) -> tuple[list[int], Any]:
    anchors: list[int] = []
    for batch in pipe:
        check(batch)
        anchors += batch.sample_indices["y"].tolist()
    return anchors, pipe.report()


def _needed(anchors: list[int], spc: int) -> set[tuple[str, int]]:
    """The (array, chunk) pairs the rows of :func:`_views` with these ``y`` anchors read."""
    t = np.asarray(anchors) - 1
    return {("t2m", int(c)) for c in np.concatenate([t - 1, t, t + 1]) // spc} | {
        ("z", int(c)) for c in t // spc
    }


def _file_counts(rep: Any, path: Path) -> Counter[str]:
    """Spans per name in the trace file ``report.write_trace(path)`` writes (an async GET
    pair counts once; each pair's ``b`` and ``e`` share an id no other pair has)."""
    import json

    events = json.loads(rep.write_trace(path).read_text())["traceEvents"]
    out: Counter[str] = Counter(e["name"] for e in events if e["ph"] in ("X", "b"))
    begins = Counter(e["id"] for e in events if e["ph"] == "b")
    ends = Counter(e["id"] for e in events if e["ph"] == "e")
    assert begins == ends and set(begins.values()) <= {1}
    return out


def _sizes(root: Path, keys: Any) -> int:
    return sum((root / k).stat().st_size for k in keys)


def _args(span: Any) -> dict[str, Any]:
    args = span[4]
    return dict(zip(OBJECT_ARGS, args, strict=False)) if isinstance(args, tuple) else args or {}


def _trace_objects(report: Any, name: str) -> Counter[tuple[str, int, tuple[int, ...]]]:
    """(array, chunk, tile) of each ``name`` span of the report's trace."""
    out: Counter[tuple[str, int, tuple[int, ...]]] = Counter()
    for span in report.trace.spans:
        if span[0] == name:
            args = _args(span)
            out[args["array"], int(args["chunk"]), tuple(args["tile"])] += 1
    return out


@pytest.mark.parametrize(
    ("name", "fault"), [("v3", 503), ("sharded", "reset"), ("v3", "stall_body"), ("sharded", None)]
)
def test_gets_retried_over_s3_count_once_in_the_report_and_trace_and_deliver_each_row_once(
    local: dict[str, Path],
    buckets: dict[str, Any],
    proxy: FaultProxy,
    name: str,
    fault: Any,
    tmp_path: Path,
) -> None:
    """Every data object's first GET fails (a 503, or a body cut off by a reset) and obstore
    retries it: the proxy sees two GETs per object, the report one (its bytes once), the trace
    one ``GET`` span per object naming its array, chunk and tile, one ``decode`` per object and
    one ``gather`` per batch; every row is zarr's and every anchor comes once."""
    root = local[name]
    store = _s3(buckets, name, retry=STALL if fault in ("stall", "stall_body") else FAST)
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    pipe = insitu_pipeline(store, manifest, _views(g), batch_size=5, block_chunks=2, seed=3,
                           fetch=FetchOptions(trace=True))  # fmt: skip
    check = _checker(root)
    try:
        for epoch in range(2):
            _clear(proxy)
            dec0 = DECODES.snapshot()
            with _faults(proxy, "/c/", 1 if fault else 0, fault or 503):
                anchors, rep = _epoch(pipe, check)
            seen = _proxy_gets(proxy, name)
            dec = DECODES.snapshot()
            dec.subtract(dec0)
            dec = +dec
            assert sorted(anchors) == list(range(2, N_TIME)), "an anchor lost or repeated"
            assert rep.samples == len(anchors) and rep.batches == len(pipe)
            counts = rep.trace.counts()
            assert counts.get("gather", 0) == rep.batches
            assert _file_counts(rep, tmp_path / f"e{epoch}.json") == Counter(counts)
            needed = _needed(anchors, g["t2m"].chunks[0])
            fetched = {(k.split("/")[0], object_of(k)[1]) for k in seen}
            assert (rep.hits + rep.misses, rep.misses) == (len(needed), len(fetched))
            if epoch == 1:  # the split is kept: nothing read
                assert not seen and rep.gets == 0 and rep.decodes == 0
                assert counts.get("GET", 0) == 0 and counts.get("decode", 0) == 0
                continue
            if fault in ("stall", "stall_body"):  # a loaded machine's late answers retried too
                assert min(seen.values()) >= 2, seen
            else:
                assert set(seen.values()) == {2 if fault else 1}, seen
            objects = {object_of(k) for k in seen}
            assert rep.gets == len(seen) == counts["GET"]
            assert rep.bytes_fetched == _sizes(root, seen)
            assert _trace_objects(rep, "GET") == Counter(objects)
            assert rep.decodes == counts["decode"] == sum(dec.values())
            assert max(dec.values()) == 1
            assert {(p, c) for p, c, _ in _trace_objects(rep, "decode")} == {
                (p, c) for p, c, _ in dec
            }
            batches = {_args(s)["batch"] for s in rep.trace.spans if s[0] == "GET"}
            assert batches <= set(range(rep.batches)), batches
    finally:
        pipe.close()


@pytest.mark.parametrize("name", ["sharded"])
def test_a_get_that_outlives_its_deadline_is_counted_once_filled_and_read_again_next_epoch(
    local: dict[str, Path], buckets: dict[str, Any], proxy: FaultProxy, name: str
) -> None:
    """Under ``on_bad_chunk="nan"`` one object's GETs stall past ``RetryPolicy.timeout_s``:
    its rectangle is NaN in epoch 0 (every other row zarr's), the report counts the failed
    GET once with no bytes, as the trace does (its span naming the error); epoch 1 reads that
    chunk's objects again (the store answers now) and only those, every row zarr's."""
    root = local[name]
    policy = RetryPolicy(timeout_s=2.0, initial_backoff_s=0.01, max_backoff_s=0.05,
                         stall_timeout_s=0.5, connect_timeout_s=0.5)  # fmt: skip
    store = _s3(buckets, name, retry=policy)
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    views = {"x": g["t2m"].window([-1, 0]), "y": g["t2m"].shift(1)}
    bad_key = "t2m/c/1/0/1" if name == "v3" else "t2m/c/1/0/0"
    bad_chunk = object_of(bad_key)[1]
    spc = g["t2m"].chunks[0]
    t2m = whole(root, "t2m")
    pipe = insitu_pipeline(store, manifest, views, batch_size=5, block_chunks=2, seed=3,
                           fetch=FetchOptions(trace=True, on_bad_chunk="nan"))  # fmt: skip
    try:
        for epoch in range(2):
            _clear(proxy)
            anchors: list[int] = []
            with _faults(proxy, f"/{name}.zarr/{bad_key}", 100 if epoch == 0 else 0, "stall"):
                for batch in pipe:
                    for label in ("x", "y"):
                        idx = batch.sample_indices[label]
                        want = t2m[idx].copy()
                        if epoch == 0:
                            hit = idx // spc == bad_chunk
                            rows = want[hit]
                            if name == "v3":
                                rows[..., :4, 8:] = np.nan
                            else:
                                rows[...] = np.nan
                            want[hit] = rows
                        np.testing.assert_array_equal(batch[label], want)
                    anchors += batch.sample_indices["y"].tolist()
            rep = pipe.report()
            seen = _proxy_gets(proxy, name)
            assert sorted(anchors) == list(range(2, N_TIME))
            counts = rep.trace.counts()
            assert rep.gets == counts["GET"] == len(seen)
            served = [k for k in seen if k != bad_key or epoch == 1]
            assert rep.bytes_fetched == _sizes(root, served)
            failed = [_args(s) for s in rep.trace.spans if s[0] == "GET" and _args(s).get("error")]
            if epoch == 0:
                assert rep.bad_chunks == 1 and pipe.bad_chunks == [object_of(bad_key)]
                assert [(a["key"], a["error"], a["bytes"]) for a in failed] == [
                    (bad_key, "TimeoutError", 0)
                ]
                assert rep.decodes == counts["decode"] == len(seen) - 1
            else:
                assert rep.bad_chunks == 0 and not failed
                assert set(seen.values()) == {1}
                assert {object_of(k)[1] for k in seen} == {bad_chunk}, seen
                assert rep.decodes == counts["decode"] == len(seen)
    finally:
        pipe.close()


@pytest.mark.parametrize("name", ["v3"])
def test_an_epoch_failed_by_a_get_resumes_from_its_state_with_each_sample_once(
    local: dict[str, Path], buckets: dict[str, Any], proxy: FaultProxy, name: str
) -> None:
    """With no retries (``max_retries=0``) one object's first GET answers 503: the epoch
    raises ``ChunkReadError`` naming its key, after counting that GET (the report and the trace,
    no bytes). A fresh pipeline restored from the loader's last ``state_dict()`` delivers the
    rest: every anchor of the epoch once over the two, every row zarr's, and the rest's report
    counts the GETs the store saw (the failed object's now served)."""
    from insitubatch_nodes.errors import ChunkReadError

    root = local[name]
    store = _s3(buckets, name, retry=RetryPolicy(timeout_s=5.0, max_retries=0))
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    bad_key = "t2m/c/6/1/0" if name == "v3" else "t2m/c/3/0/0"
    check = _checker(root)

    def build() -> Any:
        return insitu_pipeline(store, manifest, _views(g), batch_size=3, block_chunks=1,
                               seed=5, fetch=FetchOptions(trace=True))  # fmt: skip

    _clear(proxy)
    head: list[int] = []
    state = None
    with build() as pipe, _faults(proxy, f"/{name}.zarr/{bad_key}", 1, 503):
        loader = Loader(pipe)
        with pytest.raises(ChunkReadError) as err:
            for batch in loader:
                check(batch)
                head += batch.sample_indices["y"].tolist()
                state = loader.state_dict()
        assert err.value.key == bad_key
        rep = pipe.report()
        assert rep is not None
        seen = _proxy_gets(proxy, name)
        failed = [_args(s) for s in rep.trace.spans if s[0] == "GET" and _args(s).get("error")]
        assert [a["key"] for a in failed] == [bad_key]
        assert rep.gets == rep.trace.counts()["GET"] <= sum(seen.values())
    assert state is not None and head, "the failure came before the first batch"
    _clear(proxy)
    with build() as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        rest: list[int] = []
        for batch in loader:
            check(batch)
            rest += batch.sample_indices["y"].tolist()
        rep = pipe.report()
    seen = _proxy_gets(proxy, name)
    assert sorted(head + rest) == list(range(2, N_TIME)), "a sample lost or repeated"
    assert rep is not None and rep.samples == len(rest)
    assert set(seen.values()) == {1} and bad_key in seen
    assert rep.gets == len(seen) == rep.trace.counts()["GET"]
    assert rep.bytes_fetched == _sizes(root, seen)


HOLES = {"v3": ["t2m/c/2/1/0", "z/c/5/1/0/0"], "sharded": ["t2m/c/1/0/0", "z/c/3/0/0/0"]}


@pytest.fixture(scope="module")
def holes(
    local: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, s3_upload: Any
) -> dict[str, Any]:
    """Copies of the stores with :data:`HOLES` deleted (a tile of t2m, a level of z; on the
    sharded store a whole shard of each), locally and in buckets."""
    import shutil

    base = tmp_path_factory.mktemp("holes")
    out: dict[str, Any] = {}
    for name, keys in HOLES.items():
        root = base / f"{name}.zarr"
        shutil.copytree(local[name], root)
        for key in keys:
            (root / key).unlink()
        out[name] = (root, s3_upload(root, f"holes/{name}.zarr"))
    return out


@pytest.mark.parametrize(("name", "policy"), [("v3", "drop"), ("sharded", "read")])
def test_absent_objects_over_s3_are_asked_for_once_and_counted_or_never_asked_for(
    holes: dict[str, Any], buckets: dict[str, Any], proxy: FaultProxy, name: str, policy: str
) -> None:
    """Deleted objects (404s): under ``missing_objects="read"`` each is asked for once and
    read as zarr reads it (the fill value), counted in the report's GETs with no bytes and as a
    ``decode`` span marked ``missing`` (the trace's counts the report's); under ``"drop"`` never
    asked for, the anchors that would read them dropped and counted in ``report.dropped``."""
    root, url = holes[name]
    store = open_store(url, **{**buckets["options"], "retry": FAST})
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    _clear(proxy)
    pipe = insitu_pipeline(store, manifest, _views(g), batch_size=4, block_chunks=2, seed=1,
                           missing_objects=policy, fetch=FetchOptions(trace=True))  # fmt: skip
    check = _checker(root)
    with pipe:
        _clear(proxy)
        anchors, rep = _epoch(pipe, check)
    seen = _proxy_gets(proxy, name)
    absent = set(HOLES[name])
    assert set(seen.values()) == {1}, seen
    counts = rep.trace.counts()
    assert rep.gets == len(seen) == counts["GET"]
    assert rep.bytes_fetched == _sizes(root, set(seen) - absent)
    assert rep.decodes == counts["decode"] == len(seen)
    decoded = [_args(s) for s in rep.trace.spans if s[0] == "decode"]
    missing = {(a["array"], a["chunk"], tuple(a["tile"])) for a in decoded if a.get("missing")}
    assert len(Counter(anchors)) == len(anchors), "an anchor twice"
    if policy == "read":
        assert absent <= set(seen)
        assert missing == {object_of(k) for k in absent}
        assert sorted(anchors) == list(range(2, N_TIME))
    else:
        assert not absent & set(seen) and not missing
        assert rep.dropped.get("absent_object", 0) == N_TIME - 2 - len(anchors) > 0


# ---------------------------------------------------------------------------------------------
# HTTP: nginx (whole objects, ranges, a persistent cache checked by HEAD)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(local: dict[str, Path], holes: dict[str, Any]) -> Iterator[Any]:
    """nginx serving the stores (and the ones with holes, at ``/holes-NAME.zarr``)."""
    from insitubatch_nodes.testing import NginxServer, nginx_executable

    if nginx_executable() is None:
        pytest.skip("nginx is not installed (apt-get install nginx)")
    root = local["v3"].parent
    for name, (path, _) in holes.items():
        link = root / f"holes-{name}.zarr"
        if not link.exists():
            link.symlink_to(path)
    with NginxServer(root) as server:
        yield server


def _http_requests(server: Any, start: int, name: str) -> Counter[tuple[str, str, str]]:
    """(method, key, status) of the requests for data objects of ``name`` logged after the
    ``start``-th line."""
    out: Counter[tuple[str, str, str]] = Counter()
    for line in server.access_log()[start:]:
        method, path, _, status, _ = line.split(" ")
        _, sep, key = path.partition(f"/{name}.zarr/")
        if sep and "/c/" in key and key.split("/")[0] in ("t2m", "z"):
            out[method, key, status] += 1
    return out


@pytest.mark.parametrize("name", ["v3", "holes-sharded"])
def test_over_http_each_object_is_one_whole_get_counted_and_a_cached_run_gets_none(
    local: dict[str, Path], holes: dict[str, Any], site: Any, tmp_path: Path, name: str
) -> None:
    """Over nginx every data object (a whole shard on the sharded store) is one GET answered
    whole (200, no range: nginx logs 206 for a range), a deleted one a 404 asked once: the
    report's and the trace's GETs are the requests logged, its bytes their bytes. A second
    run over the same persistent ``cache_dir`` sends no GET for data (a HEAD per object checks
    the cache) and delivers the same rows."""
    root = holes[name.split("-")[1]][0] if name.startswith("holes") else local[name]
    folder = root.name if name == "sharded" else name  # (sh.zarr)
    store = open_store(f"{site.endpoint}/{folder.removesuffix('.zarr')}.zarr", retry=FAST)
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    check = _checker(root)
    for run in range(2):
        start = len(site.access_log())
        with insitu_pipeline(store, manifest, _views(g, False), batch_size=4, block_chunks=2,
                             seed=2, cache_dir=tmp_path / "cache", persist=True,
                             fetch=FetchOptions(trace=True)) as pipe:  # fmt: skip
            anchors, rep = _epoch(pipe, check)
        logged = _http_requests(site, start, folder.removesuffix(".zarr"))
        assert sorted(anchors) == list(range(2, N_TIME))
        gets = {key: n for (method, key, _), n in logged.items() if method == "GET"}
        statuses = {status for (method, _, status) in logged if method == "GET"}
        if run == 0:
            assert set(gets.values()) == {1}, gets
            assert statuses <= {"200", "404"}, logged
            assert rep.gets == len(gets) == rep.trace.counts()["GET"]
            assert rep.bytes_fetched == _sizes(root, [k for k in gets if (root / k).exists()])
            assert rep.decodes == rep.trace.counts()["decode"] == len(gets)
        else:
            assert not gets and rep.gets == 0 and rep.decodes == 0, logged


# ---------------------------------------------------------------------------------------------
# real gloo ranks over one persistent cache_dir
# ---------------------------------------------------------------------------------------------


def gloo_rank(
    rank: int,
    world: int,
    init_file: str,
    root: str,
    cache: str,
    out: str,
    remote: dict[str, Any] | None = None,
) -> None:
    """One gloo rank (forked from the tests' fork server): two runs over ``cache`` (two
    epochs, then a fresh pipeline's one), an ``all_reduce`` per batch; per epoch its anchors,
    the store's GETs and bytes per key, the decodes, and the report's and trace's counts, as
    JSON in ``out.format(rank)``. With ``remote`` (``{"url", "options"}``) the store is that
    bucket (its GETs are counted by the test's proxy: ``gets`` and ``bytes`` left empty)."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from test_readonce_trial import bytes_store

    DECODES.install(pytest.MonkeyPatch())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    epochs: list[dict[str, Any]] = []
    try:
        check = _checker(Path(root))
        for epochs_of_run in (2, 1):
            store: Any = bytes_store(Path(root))
            if remote is not None:
                store = open_store(remote["url"], **remote["options"])
            g = open_geometries(store, ["t2m", "z"])
            manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
            pipe = insitu_pipeline(store, manifest, _views(g, False), batch_size=3, seed=4,
                                   block_chunks=1, cache_dir=cache, persist=True, coords=(),
                                   rank=None, world_size=None,
                                   fetch=FetchOptions(trace=True))  # fmt: skip
            with pipe:
                for _ in range(epochs_of_run):
                    local_store = remote is None
                    gets0 = Counter(store.chunk_counts() if local_store else {})
                    if local_store:
                        store.mark()
                    dec0 = DECODES.snapshot()
                    anchors: list[int] = []
                    for batch in pipe:
                        check(batch)
                        anchors += batch.sample_indices["y"].tolist()
                        t = torch.ones(1)
                        dist.all_reduce(t)
                        assert int(t.item()) == world
                    gets = Counter(store.chunk_counts() if local_store else {})
                    gets.subtract(gets0)
                    dec = DECODES.snapshot()
                    dec.subtract(dec0)
                    rep = pipe.report()
                    counts = rep.trace.counts()
                    epochs.append({
                        "anchors": anchors, "gets": dict(+gets),
                        "bytes": dict(store.since_mark) if local_store else {},
                        "decodes": sum((+dec).values()),
                        "max_decodes": max(dec.values(), default=0),
                        "report": [rep.gets, rep.bytes_fetched, rep.decodes, rep.samples,
                                   rep.hits, rep.misses, rep.re_reads, rep.batches],
                        "trace": [counts.get("GET", 0) + counts.get("read", 0),
                                  counts.get("decode", 0), counts.get("gather", 0)],
                    })  # fmt: skip
        Path(out.format(rank)).write_text(json.dumps(epochs))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_gloo_ranks_over_one_persistent_cache_read_disjointly_and_deliver_each_sample_once(
    local: dict[str, Path], tmp_path: Path, world: int
) -> None:
    """Real gloo ranks (processes started at once) over one ``cache_dir``: per epoch the ranks'
    anchors are disjoint and all but at most ``world - 1`` valid ones come (``"drop"``), every
    row zarr's; each rank's report counts its store's GETs, bytes and its decodes (each object
    decoded at most once), as its trace does; two ranks get one object only at a cut between
    their runs (the chunks a window or the lead reaches across it), over every epoch and run
    at most twice; a later run over the cache gets nothing."""
    import json

    from resume_helpers import spawn_ranks

    root = local["v3"]
    spawn_ranks(gloo_rank, args=(world, str(tmp_path / "init"), str(root),
                                 str(tmp_path / "cache"), str(tmp_path / "rank{}.json")),
                nprocs=world, workdir=tmp_path / "ranks")  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    total: Counter[str] = Counter()
    for e in range(3):
        per = [r[e] for r in ranks]
        anchors = Counter(a for p in per for a in p["anchors"])
        assert max(anchors.values()) == 1, "an anchor on two ranks"
        assert len(set(range(2, N_TIME)) - set(anchors)) <= world - 1
        assert set(anchors) <= set(range(2, N_TIME))
        assert len({len(p["anchors"]) for p in per}) == 1
        for p in per:
            gets, nbytes = p["gets"], p["bytes"]
            assert not gets or max(gets.values()) == 1, gets
            rep = p["report"]
            assert rep[:3] == [len(gets), sum(nbytes.values()), p["decodes"]], (rep, gets)
            assert p["max_decodes"] <= 1
            assert rep[3] == len(p["anchors"])
            assert p["trace"] == [rep[0], rep[2], rep[7]]
            total.update(gets)
        if e == 2:
            assert sum(sum(p["gets"].values()) for p in per) == 0
    shared = {object_of(k)[1] for k, n in total.items() if n > 1}
    # the chunks a window (a step back) or the lead (a step on) reaches across a cut: two
    assert len(shared) <= 2 * (world - 1), shared
    assert max(total.values()) <= 2, total


# ---------------------------------------------------------------------------------------------
# the trace's ids: chunks and batches
# ---------------------------------------------------------------------------------------------


ARRAY_OF = {"x": "t2m", "y": "t2m", "z": "z"}


def _first_readers(
    batches: list[tuple[int, dict[str, np.ndarray]]], spc: int
) -> dict[tuple[str, int], int]:
    """The first batch (its ``index``) whose rows read each (array, sample-axis chunk)."""
    first: dict[tuple[str, int], int] = {}
    for index, idx in batches:
        for label, rows in idx.items():
            for c in set((np.asarray(rows).ravel() // spc).tolist()):
                key = (ARRAY_OF[label], c)
                first[key] = min(first.get(key, index), index)
    return first


def _check_trace_ids(rep: Any, batches: list[tuple[int, dict[str, np.ndarray]]], spc: int) -> None:
    indices = [i for i, _ in batches]
    spans = rep.trace.spans
    names = Counter(s[0] for s in spans)
    assert names["gather"] == rep.batches == len(batches)
    assert sorted(_args(s)["batch"] for s in spans if s[0] == "gather") == sorted(indices)
    nexts = [_args(s)["batch"] for s in spans if s[0] == "next"]
    assert sorted(b for b in nexts if b >= 0) == sorted(indices), nexts
    first = _first_readers(batches, spc)
    for name in ("GET", "decode"):
        for s in spans:
            if s[0] == name:
                a = _args(s)
                want = first[a["array"], a["chunk"]]
                assert a["batch"] == want, (name, a, want)


@pytest.mark.parametrize("name", ["sharded"])
def test_trace_spans_name_the_chunk_and_the_first_batch_that_reads_it_also_after_a_resume(
    local: dict[str, Path], buckets: dict[str, Any], name: str
) -> None:
    """Each ``GET`` and ``decode`` span names the first batch (``batch.index``) whose rows read
    its chunk, ``gather`` and ``next`` spans each delivered batch once; in an epoch resumed from
    a mid-epoch state the same, with the indices the resumed batches carry."""
    store = _s3(buckets, name)
    g = open_geometries(store, ["t2m", "z"])
    spc = g["t2m"].chunks[0]
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))

    def build() -> Any:
        return insitu_pipeline(store, manifest, _views(g), batch_size=3, block_chunks=2,
                               seed=8, fetch=FetchOptions(trace=True))  # fmt: skip

    with build() as pipe:
        loader = Loader(pipe)
        batches = []
        for batch in loader:
            batches.append((batch.index, dict(batch.sample_indices)))
            if len(batches) == 4:
                state = loader.state_dict()
        _check_trace_ids(pipe.report(), batches, spc)
        assert [i for i, _ in batches] == list(range(len(batches)))
    with build() as pipe:
        loader = Loader(pipe)
        loader.load_state_dict(state)
        rest = [(batch.index, dict(batch.sample_indices)) for batch in loader]
        assert [i for i, _ in rest] == list(range(4, len(batches)))
        _check_trace_ids(pipe.report(), rest, spc)


@pytest.mark.parametrize("name", ["v3"])
def test_an_epoch_broken_off_with_gets_in_flight_counts_in_its_trace_what_its_report_counts(
    local: dict[str, Path], buckets: dict[str, Any], proxy: FaultProxy, name: str
) -> None:
    """Objects of later chunks stall, so GETs are in flight when the consumer stops after two
    batches (``reset()``): the broken-off epoch's report counts as many GETs and decodes as its
    trace has spans, and the next (whole) epoch's report and trace count the GETs the store
    saw in it, every row zarr's and every anchor once."""
    policy = RetryPolicy(
        timeout_s=2.0, stall_timeout_s=0.5, initial_backoff_s=0.01, max_backoff_s=0.05
    )
    store = _s3(buckets, name, retry=policy)
    g = open_geometries(store, ["t2m", "z"])
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    check = _checker(local[name])
    with insitu_pipeline(store, manifest, _views(g), batch_size=3, block_chunks=1, seed=8,
                         shuffle=False, fetch=FetchOptions(trace=True)) as pipe:  # fmt: skip
        _clear(proxy)
        with _faults(proxy, "/c/4/", 1, "stall"):
            for i, batch in enumerate(pipe):
                check(batch)
                if i == 1:
                    break
            rep = pipe.report()
            counts = rep.trace.counts()
            assert rep.gets == counts.get("GET", 0) and rep.decodes == counts.get("decode", 0)
            pipe.reset()
        _clear(proxy)
        anchors, rep = _epoch(pipe, check)
        seen = _proxy_gets(proxy, name)
        counts = rep.trace.counts()
        assert sorted(anchors) == list(range(2, N_TIME))
        assert rep.gets == counts.get("GET", 0) == sum(seen.values()), (rep.gets, seen)
        assert rep.decodes == counts.get("decode", 0)


# ---------------------------------------------------------------------------------------------
# rows decoded straight into batches over S3
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory, s3_upload: Any) -> tuple[Path, str]:
    """a (24, 4, 6) one sample per object and b (24, 2, 4, 6) one level per object, locally
    and in a bucket."""
    import zarr

    root = tmp_path_factory.mktemp("one") / "one.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    rng = np.random.default_rng(3)
    a = group.create_array("a", shape=(24, 4, 6), chunks=(1, 4, 6), dtype="f4",
                           dimension_names=("time", "lat", "lon"))  # fmt: skip
    a[...] = rng.standard_normal(a.shape).astype("f4")
    b = group.create_array("b", shape=(24, 2, 4, 6), chunks=(1, 1, 4, 6), dtype="f4",
                           dimension_names=("time", "level", "lat", "lon"))  # fmt: skip
    b[...] = rng.standard_normal(b.shape).astype("f4")
    return root, s3_upload(root, "one/one.zarr")


@pytest.mark.parametrize("fault", ["reset", "fail"])
def test_rows_decoded_into_batches_over_s3_are_got_decoded_and_counted_once_when_retried(
    one: tuple[Path, str], buckets: dict[str, Any], proxy: FaultProxy, fault: Any
) -> None:
    """``FetchOptions(direct=True)``: b's objects are decoded straight into batch rows, a's
    (read by two labels) through slots. Every first GET faulted and retried: each object is
    one GET in the report and the trace, one decode, each row zarr's, each anchor once; the
    in-place decode spans name the row and the batch holding it. With no retries (``"fail"``)
    under ``on_bad_chunk="nan"`` the faulted objects of b are NaN rows, each counted once."""
    from insitubatch_nodes import stack

    root, url = one
    retry = RetryPolicy(timeout_s=5.0, max_retries=0) if fault == "fail" else FAST
    store = open_store(url, **{**buckets["options"], "retry": retry})
    g = open_geometries(store, ["a", "b"])
    manifest = split_by_chunk(g["a"], (1.0, 0.0, 0.0))
    views = {"x": stack({"a": g["a"], "b1": g["b"].isel(level=[1])}), "y": g["a"]}
    a, bb = whole(root, "a"), whole(root, "b")
    bad_key = "b/c/5/1/0/0"  # under "fail": sample 5's level 1 of b
    opts = FetchOptions(direct=True, trace=True, on_bad_chunk="nan")
    match = f"/one.zarr/{bad_key}" if fault == "fail" else "/one.zarr/"
    rows: dict[int, tuple[int, int]] = {}  # sample -> (batch, row)
    with insitu_pipeline(store, manifest, views, batch_size=4, coords=(), seed=2,
                         fetch=opts) as pipe:  # fmt: skip
        _clear(proxy)
        with _faults(proxy, match, 1, 503 if fault == "fail" else fault):
            for batch in pipe:
                i = batch.sample_indices["x"]
                want_b = bb[i, 1].copy()
                if fault == "fail":
                    want_b[i == 5] = np.nan
                np.testing.assert_array_equal(batch["x"][:, 0], a[i])
                np.testing.assert_array_equal(batch["x"][:, 1], want_b)
                np.testing.assert_array_equal(batch["y"], a[batch.sample_indices["y"]])
                rows.update({int(s): (batch.index, r) for r, s in enumerate(i)})
        rep = pipe.report()
    seen = _proxy_gets(proxy, "one", ("a", "b"))
    assert sorted(rows) == list(range(24))
    assert set(seen.values()) == ({1} if fault == "fail" else {2}), seen
    counts = rep.trace.counts()
    assert rep.gets == counts["GET"] == len(seen) == 24 * 2
    assert rep.decodes == counts["decode"] == 48 - (fault == "fail")
    assert rep.bad_chunks == (fault == "fail") and rep.in_place == 24
    in_place = Counter()
    for s in rep.trace.spans:
        a_ = _args(s)
        if s[0] == "decode" and a_["array"] == "b":
            in_place[a_["chunk"]] += 1
            assert (a_["batch"], a_["row"]) == rows[a_["chunk"]], a_
    assert sorted(in_place) == sorted(set(range(24)) - ({5} if fault == "fail" else set()))
    assert set(in_place.values()) == {1}


# ---------------------------------------------------------------------------------------------
# a collection over several buckets
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def periods(tmp_path_factory: pytest.TempPathFactory, s3_upload: Any) -> list[tuple[Path, str]]:
    """Three periods of t2m (8, 8 and 6 steps, chunks of 4), each in a bucket of its own."""
    from test_readonce_trial import write_period

    base = tmp_path_factory.mktemp("periods")
    out = []
    for i, (start, n) in enumerate([(0, 8), (48, 8), (96, 6)]):
        root = write_period(base / f"p{i}.zarr", start, n, 3)
        out.append((root, s3_upload(root, f"p/p{i}.zarr")))
    return out


@pytest.mark.parametrize("fault", ["fail"])
def test_a_concatenation_over_three_buckets_counts_each_stores_gets_in_the_report_and_trace(
    periods: list[tuple[Path, str]], buckets: dict[str, Any], proxy: FaultProxy, fault: Any
) -> None:
    """``concat`` of three buckets read by windows across their edges, each first GET of the
    middle bucket's objects faulted (a 503 retried; or, with no retries under
    ``on_bad_chunk="nan"``, failed and filled): per store the GETs the proxy saw are the
    trace's ``GET`` spans keyed ``s<i>/...`` (each object once), the report's GETs their sum,
    each span's ``chunk`` the collection's chunk; a filled object is listed by the
    collection's path and chunk, its rows NaN, every other row the stores' own."""
    from insitubatch_nodes import concat

    retry = RetryPolicy(timeout_s=5.0, max_retries=0) if fault == "fail" else FAST
    stores = [open_store(url, **{**buckets["options"], "retry": retry}) for _, url in periods]
    want = np.concatenate([whole(root, "t2m") for root, _ in periods])
    coll = concat(stores, ["t2m"], dim="time")
    manifest = split_by_chunk(coll["t2m"], (1.0, 0.0, 0.0))
    views = {"x": coll["t2m"].window(["-6h", "0h"]), "y": coll["t2m"].shift(1)}
    bad = "/p/p1.zarr/t2m/c/1/" if fault == "fail" else "/p/p1.zarr/"  # chunk 3: samples 12..15
    if fault == "fail":
        want = want.copy()
        want[12:16] = np.nan
    _clear(proxy)
    with insitu_pipeline(coll, manifest, views, batch_size=3, block_chunks=1, coords=(),
                         fetch=FetchOptions(trace=True, on_bad_chunk="nan")) as pipe:  # fmt: skip
        _clear(proxy)
        anchors = []
        with _faults(proxy, bad, 1, 503):
            for batch in pipe:
                np.testing.assert_array_equal(batch["x"], want[batch.sample_indices["x"]])
                np.testing.assert_array_equal(batch["y"], want[batch.sample_indices["y"]])
                anchors += batch.sample_indices["y"].tolist()
        rep = pipe.report()
        listed = pipe.bad_chunks
    assert sorted(anchors) == list(range(2, 22))
    with proxy._lock:
        seen = {p: n for p, n in proxy.gets.items() if "/p/p" in p and "/t2m/c/" in p}
    by_span: Counter[str] = Counter()
    chunks: dict[str, int] = {}
    for s in rep.trace.spans:
        if s[0] == "GET":
            a = _args(s)
            by_span[a["key"]] += 1
            chunks[a["key"]] = a["chunk"]
    from_proxy: Counter[str] = Counter()
    for path, n in seen.items():
        i = int(path.split("/p/p", 1)[1][0])
        key = f"s{i}/{path.split(f'/p/p{i}.zarr/', 1)[1]}"
        from_proxy[key] += n if fault == "fail" or i != 1 else n - 1  # the 503s retried
    assert by_span == from_proxy and set(by_span.values()) == {1}, (by_span, from_proxy)
    assert rep.gets == sum(by_span.values()) == 6
    offsets = {0: 0, 1: 2, 2: 4}  # each store's first chunk in the collection
    for key, chunk in chunks.items():
        i, local_chunk = int(key[1]), int(key.split("/c/")[1].split("/")[0])
        assert chunk == offsets[i] + local_chunk, (key, chunk)
    if fault == "fail":
        assert listed == [(coll["t2m"].path, 3, (0, 0))] and rep.bad_chunks == 1
    else:
        assert not listed and rep.bad_chunks == 0


def test_gloo_ranks_over_s3_and_one_persistent_cache_get_each_object_at_most_once_between_them(
    local: dict[str, Path], buckets: dict[str, Any], proxy: FaultProxy, tmp_path: Path
) -> None:
    """Two gloo ranks reading the S3 bucket (through the proxy, every first GET a 503 retried)
    over one ``cache_dir``: anchors disjoint, rows zarr's; the ranks' reports' GETs are the
    objects the proxy saw (two attempts each), an object got by both only at the cut between
    their runs, and a second run gets nothing."""
    import json

    from resume_helpers import spawn_ranks

    world = 2
    remote = {"url": buckets["urls"]["v3"], "options": buckets["options"]}
    _clear(proxy)
    with _faults(proxy, "/v3.zarr/", 1, 503):
        spawn_ranks(gloo_rank, args=(world, str(tmp_path / "init"), str(local["v3"]),
                                     str(tmp_path / "cache"), str(tmp_path / "rank{}.json"),
                                     remote),
                    nprocs=world, workdir=tmp_path / "ranks")  # fmt: skip
    seen = _proxy_gets(proxy, "v3")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for e in range(3):
        per = [r[e] for r in ranks]
        anchors = Counter(a for p in per for a in p["anchors"])
        assert max(anchors.values()) == 1 and len(set(range(2, N_TIME)) - set(anchors)) <= 1
        for p in per:
            assert p["trace"] == [p["report"][0], p["report"][2], p["report"][7]]
            assert p["report"][2] == p["decodes"] and p["max_decodes"] <= 1
        if e == 2:
            assert all(p["report"][0] == 0 for p in per)
    got = sum(p["report"][0] for r in ranks for p in r)
    # once (a 503, then the bytes), or by both ranks at a cut (the second GET not faulted)
    assert set(seen.values()) <= {2, 3}, seen
    assert got == sum(n - 1 for n in seen.values())
    shared = {object_of(k)[1] for k, n in seen.items() if n == 3}
    assert len(shared) <= 2 * (world - 1), shared  # a step back and one on: two per cut
