"""A black-box trial of stores as they sit in object storage, zarr's own read the oracle.

Covered (generators of ~3,800 cheap checks, not kept, over one moto S3 server and one nginx):
every layout below through a local path (with and without a trailing slash), ``file://``,
``s3://`` at a prefix three levels deep (with and without a trailing slash), ``http://`` and
``memory://``, discovery and naming, then ``insitu_pipeline`` with shuffle off and on, every
delivered row compared with ``zarr.open_array`` of the local copy and every sample delivered
once: v2 with ``/`` and ``.`` chunk-key separators; v2 ``.zmetadata`` and v3 consolidated
metadata, at the root and in a sub-group only; consolidated metadata gone stale (an array or a
nested group added, an array or a group removed, an array resized, shrunk, re-chunked, re-typed
or given another fill value after consolidation); groups and arrays named with dots, dashes,
unicode, spaces, ``%``, ``+``, ``#``, ``=`` and ``&`` (URL-encoded on S3 and HTTP); sharded v3
with partial shards on every axis and fill-value inner chunks; chunk objects partly missing (fill
values 5, -1.5, NaN, -inf, ``True``, 255, ``1+2j``, v2 ``fill_value=None``), read and dropped
(``missing_objects="drop"``, refused over HTTP with what to do); empty arrays, one chunk, chunks
of one element, a chunk larger than the array, root arrays, a sample axis other than 0; a
persistent cache over S3, HTTP and local folders; v3 ``.``-separated and v2-encoded keys, shards
with the index at the start; hand-edited fill values (``"NaN"``, ``"-Infinity"``, NaN payloads
``0x7fc00001``, ``-0.0``, complex, bool, uint64 max); store URLs to a root array. All of that
was right.

Found, each with its test below: a store URL's query string or fragment was dropped silently
(``s3://b/p?versionId=3`` read the newest objects of ``p``); a persistent cache warmed from one
store served its values for another store of the same layout: always with
``check_store=False``, and over HTTP by default (nginx's ETag is a second and a size, so two
stores written alike look the same); a ``file://`` URL was not percent-decoded, so
``Path.as_uri()`` of a folder with a space, a non-ASCII letter or a ``%`` in its name was
"no zarr store" (obstore's own ``LocalStore.from_url`` decodes it); options errors that did not
say what to do: an ``http://`` S3 endpoint without ``allow_http`` failed at the first read with
obstore's "HTTP error: builder error", ``client_options=True`` with "'bool' object is not
iterable", and ``read_only="false"`` opened the store read-only without a word; a split whose
every anchor ``missing_objects="drop"`` dropped said to "use a smaller stride or check the
times", not to read absent objects as the fill value; consolidated metadata with an entry zarr
cannot parse made even arrays named one by one fail with zarr's "No group found in store"
(zarr's ``open_group`` turns the ``KeyError`` into that), where a ``CorruptMetadataError``
naming the document is the contract; S3 folder markers (0-byte ``prefix/`` objects, what the S3
console's "Create folder" writes) at the store's root, on a group or on an empty folder made
``open_geometries(store)`` fail (zarr's walk: "The first component of sub does not start with
sub", a ``RecursionError``), although every array reads; a URL to a store's ``zarr.json``
(or ``.zmetadata``, ``.zarray``) said "no zarr store" or "listing it failed", not which folder
to open; a cloud prefix with an empty path segment (legal in S3, not in obstore's paths) failed
with obstore's "Path "p//q" contained empty path segment", and ``s3://b//p`` (keys ``/p/...``)
read the objects of ``s3://b/p`` without a word, where the URL is now refused saying what reads
it (zarr's ``FsspecStore``, tested).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import zarr

from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.errors import CorruptMetadataError, StaleCacheError, short_cause
from insitubatch_nodes.io.arrays import check_arrays_in_store
from insitubatch_nodes.testing import NginxServer, nginx_executable

# zarr says so of every v3 consolidation; the claims here are about what we read back
pytestmark = pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part")


def _write(root: Path, seed: int) -> Path:
    """``x`` (12, 3) in chunks of 2, uncompressed: every object of every such store has one
    size."""
    values = np.random.default_rng(seed).random((12, 3)).astype("f4") + 1
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array("x", data=values, chunks=(2, 3), compressors=None, fill_value=0)
    return root


def _read(store: Any, **cache: Any) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, int]]:
    """One epoch of ``x``: (sample indices, rows) per batch, and the pipeline's counters."""
    g = open_geometries(store, ["x"])["x"]
    pipe = insitu_pipeline(store, split_by_chunk(g, (1, 0, 0)), {"x": g}, batch_size=4, **cache)
    with pipe:
        rows = [(np.array(b.sample_indices["x"]), np.array(b["x"])) for b in Loader(pipe)]
        return rows, pipe.stats()


def _assert_rows_of(rows: list[tuple[np.ndarray, np.ndarray]], local: Path) -> None:
    want = zarr.open_array(local / "x", mode="r")[...]
    assert sorted(i for idx, _ in rows for i in idx.tolist()) == list(range(len(want)))
    for idx, got in rows:
        np.testing.assert_array_equal(got, want[idx])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, NginxServer]]:
    if nginx_executable() is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it)")
    root = tmp_path_factory.mktemp("www")
    with NginxServer(root) as server:
        yield root, server


# ---------------------------------------------------------------------------------------------
# URL spellings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "dropped"),
    [
        ("s3://bucket/p/store.zarr?versionId=3", "?versionId=3"),
        ("s3://bucket/p/store.zarr#frag", "#frag"),
        ("gs://bucket/store.zarr?generation=7", "?generation=7"),
        ("az://container/store.zarr?sv=2024&sig=x", "?sv=2024&sig=x"),
        ("https://example.org/store.zarr?X-Amz-Signature=abc", "?X-Amz-Signature=abc"),
        ("http://127.0.0.1:9/store.zarr#part", "#part"),
        ("http://127.0.0.1:9/store.zarr?", "?"),
        ("memory://name?x=1", "?x=1"),
        ("file:///tmp/store.zarr?mode=r", "?mode=r"),
    ],
)
def test_a_store_url_with_a_query_or_fragment_is_refused_naming_what_would_be_dropped(
    url: str, dropped: str
) -> None:
    # before: the query or fragment was dropped without a word, and the prefix before it read
    # (an S3 object version asked for, the newest objects served)
    with pytest.raises(ValueError, match="no query string or fragment") as err:
        open_store(url)
    assert repr(dropped) in str(err.value) and repr(url) in str(err.value)


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/p/era5.zarr/zarr.json",
        "http://127.0.0.1:9/era5.zarr/.zmetadata",
        "/data/era5.zarr/t2m/.zarray",
        "file:///data/era5.zarr/.zgroup/",
    ],
)
def test_a_url_to_a_metadata_document_is_refused_naming_the_folder_to_open(url: str) -> None:
    # before: "no zarr store at ...", "no zarr array in store ...", or "listing it failed"
    folder = url.rstrip("/").rsplit("/", 1)[0]
    with pytest.raises(ValueError, match="names the zarr metadata document") as err:
        open_store(url)
    assert f"open the folder it is in, {folder!r}" in str(err.value)


def test_a_plain_http_endpoint_without_allow_http_is_refused_at_open_saying_what_to_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    without = {"endpoint": "http://127.0.0.1:9", "region": "us-east-1"}  # opening does no IO
    s3_options = {**without, "client_options": {"allow_http": True}}
    # before: opened, then the first read failed with "Generic S3 error: ... builder error"
    with pytest.raises(ValueError, match=r"plain HTTP.*client_options=\{'allow_http': True\}"):
        open_store("s3://bucket/prefix", **without)
    with pytest.raises(ValueError, match="AWS_ALLOW_HTTP=true"):
        open_store("s3://bucket/prefix", **without, client_options={"allow_http": False})
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # obstore's variable, read by open_store
    open_store("s3://bucket/prefix", **without)
    open_store("s3://bucket/prefix", **s3_options)  # what the fixtures pass
    with pytest.raises(ValueError, match="plain HTTP"):
        open_store("gs://bucket/prefix", base_url="http://127.0.0.1:9", anonymous=True)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"client_options": True}, r"client_options must be a dict.*got True"),
        ({"client_options": ["allow_http"]}, r"client_options must be a dict"),
        ({"read_only": "false"}, r"read_only must be True or False, got 'false'"),
        ({"read_only": 0}, r"read_only must be True or False, got 0"),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_naming_it(
    options: dict[str, Any], match: str, tmp_path: Path
) -> None:
    # before: "'bool' object is not iterable" / a store opened read-only for read_only="false"
    url = str(tmp_path) if "read_only" in options else "s3://bucket/prefix"
    with pytest.raises(TypeError, match=match):
        open_store(url, **options)


@pytest.mark.parametrize(
    ("url", "segment"),
    [
        ("s3://bucket/p//q", "'//'"),
        ("s3://bucket/p//q/", "'//'"),
        ("s3://bucket//p", "'//'"),  # keys '/p/...': obstore read 'p/...' without a word
        ("gs://bucket/a/./b", "'.'"),
        ("az://container/a/../b", "'..'"),
    ],
)
def test_a_cloud_prefix_obstore_cannot_address_is_refused_at_open_naming_what_reads_it(
    url: str, segment: str
) -> None:
    # before: s3://bucket/p//q raised obstore's "Could not parse path: Path "p//q" contained
    # empty path segment"; s3://bucket//p opened s3://bucket/p, other objects, silently
    with pytest.raises(ValueError, match=f"path segment {segment}") as err:
        open_store(url, anonymous=True)
    said = str(err.value)
    assert "obstore cannot address" in said and f"FsspecStore.from_url({url!r}" in said
    if url == "s3://bucket//p":
        assert "if you meant 's3://bucket/p', write that" in said
    # trailing slashes end the prefix, as zarr's FsspecStore reads them
    for sloppy in ("s3://bucket/p/", "s3://bucket/p//", "s3://bucket/"):
        inner = cast(Any, open_store(sloppy, anonymous=True)).store
        assert inner.prefix == (sloppy[len("s3://bucket/") :].strip("/") or None)


@pytest.mark.xdist_group("s3")
def test_a_store_below_an_empty_s3_path_segment_reads_like_zarr_through_the_store_suggested(
    tmp_path: Path, s3_options: dict[str, Any], s3_client: Any, s3_server: str
) -> None:
    pytest.importorskip("s3fs")  # what FsspecStore reads s3:// with
    bucket = f"slashes-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    mine, other = _write(tmp_path / "mine.zarr", 7), _write(tmp_path / "other.zarr", 8)
    for local, prefix in ((mine, "p//q"), (mine, "/lead"), (other, "lead")):
        for path in sorted(local.rglob("*")):
            if path.is_file():
                key = f"{prefix}/{path.relative_to(local).as_posix()}"
                s3_client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    fsspec_options = {
        "endpoint_url": s3_server,
        "key": s3_options["access_key_id"],
        "secret": s3_options["secret_access_key"],
    }
    for url in (f"s3://{bucket}/p//q", f"s3://{bucket}//lead"):
        # before: s3://BUCKET//lead read the objects at 'lead/' (other.zarr's values)
        with pytest.raises(ValueError, match="obstore cannot address"):
            _read(open_store(url, **s3_options))
        store = zarr.storage.FsspecStore.from_url(
            url, storage_options=fsspec_options, read_only=True
        )
        rows, _ = _read(store)  # what the message says to pass reads the objects of the URL
        _assert_rows_of(rows, mine)
        if url.endswith("p//q"):  # (s3fs lists '//lead' empty: zarr finds no array there)
            assert sorted(open_geometries(store)) == ["x"]


def test_a_file_url_is_percent_decoded_so_path_as_uri_opens_the_folder(tmp_path: Path) -> None:
    folder = _write(tmp_path / "a b ü%20 q#h?.zarr", 3)
    url = folder.as_uri()  # file:///.../a%20b%20%C3%BC%2520%20q%23h%3F.zarr
    # before: FileNotFoundError "no zarr store at '.../a%20b%20%C3%BC%2520%20q%23h%3F.zarr'"
    rows, _ = _read(open_store(url))
    _assert_rows_of(rows, folder)
    assert open_geometries(url) == open_geometries(folder)
    # a folder named with a literal escape is still found by its undecoded spelling
    literal = _write(tmp_path / "c%41d.zarr", 4)
    rows, _ = _read(open_store("file://" + str(literal)))
    _assert_rows_of(rows, literal)
    rows, _ = _read(open_store(literal.as_uri()))  # c%2541d.zarr, decoded: the same folder
    _assert_rows_of(rows, literal)


# ---------------------------------------------------------------------------------------------
# A persistent cache and the store it was warmed from
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("check_store", [True, False])
def test_a_cache_warmed_from_one_folder_never_serves_another_folders_values(
    tmp_path: Path, check_store: bool
) -> None:
    a, b = _write(tmp_path / "a.zarr", 1), _write(tmp_path / "b.zarr", 2)
    cache = tmp_path / "cache"
    rows, _ = _read(str(a), cache_dir=cache, persist=True, check_store=check_store)
    _assert_rows_of(rows, a)
    # before (check_store=False): every chunk a hit, a's values delivered as b's
    with pytest.raises(StaleCacheError, match="cached from another store") as err:
        _read(str(b), cache_dir=cache, readonly_cache=True, check_store=check_store)
    assert "warmed from" in str(err.value) and str(b) in str(err.value)
    rows, stats = _read(str(b), cache_dir=cache, persist=True, check_store=check_store)
    _assert_rows_of(rows, b)
    assert (stats["hits"], stats["gets"]) == (0, 6)
    rows, stats = _read(str(b), cache_dir=cache, persist=True, check_store=check_store)
    _assert_rows_of(rows, b)  # now warmed from b: every chunk a hit
    assert (stats["hits"], stats["gets"]) == (6, 0)
    # the same folder however it is spelled is the same store
    rows, stats = _read(b.as_uri() + "/", cache_dir=cache, readonly_cache=True)
    assert (stats["hits"], stats["gets"]) == (6, 0)


def test_a_cache_warmed_over_http_never_serves_another_urls_values(
    site: tuple[Path, NginxServer], tmp_path: Path
) -> None:
    root, server = site
    a, b = _write(root / "a.zarr", 1), _write(root / "b.zarr", 2)
    for file in b.rglob("*"):  # written in the same second as a's: the same ETag and size
        twin = a / file.relative_to(b)
        os.utime(file, ns=(twin.stat().st_atime_ns, twin.stat().st_mtime_ns))
    cache = tmp_path / "cache"
    rows, _ = _read(open_store(f"{server.endpoint}/a.zarr"), cache_dir=cache, persist=True)
    _assert_rows_of(rows, a)
    # before: every HEAD matched the recorded ETag, and a's values were delivered as b's
    rows, stats = _read(open_store(f"{server.endpoint}/b.zarr"), cache_dir=cache, persist=True)
    _assert_rows_of(rows, b)
    assert (stats["hits"], stats["gets"]) == (0, 6)


# ---------------------------------------------------------------------------------------------
# Absent objects
# ---------------------------------------------------------------------------------------------


def test_a_split_left_without_anchors_by_absent_objects_says_to_read_them_as_fill(
    tmp_path: Path,
) -> None:
    root = tmp_path / "holes.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    values = np.arange(1, 9 * 4 + 1, dtype="f4").reshape(9, 4)
    group.create_array("x", data=values, chunks=(3, 2), fill_value=np.nan)
    for chunk in range(3):  # one tile of every chunk gone
        (root / "x" / "c" / str(chunk) / str(chunk % 2)).unlink()
    g = open_geometries(root, ["x"])["x"]
    manifest = split_by_chunk(g, (1, 0, 0))
    # before: "... (dropped per reason: {'absent_object': 9}); use a smaller stride or check
    # the times and missing steps"
    with pytest.raises(ValueError, match=r"\{'absent_object': 9\}.*missing_objects='read'"):
        insitu_pipeline(root, manifest, {"x": g}, missing_objects="drop", batch_size=2)
    pipe = insitu_pipeline(root, manifest, {"x": g}, batch_size=2)  # what it says to do
    want = zarr.open_array(root / "x", mode="r")[...]
    with pipe:
        for batch in Loader(pipe):
            np.testing.assert_array_equal(batch["x"], want[batch.sample_indices["x"]])


def drop_on_each_rank(rank: int, world: int, init_file: str, stores: list[str], out: str) -> None:
    """One gloo rank (``spawn_ranks``): build with ``missing_objects="drop"`` over
    ``stores[0]`` (what every rank lists alike), then over ``stores[rank]`` (the store as this
    rank listed it, changed between two ranks' builds); write each build's batch count or its
    refusal to ``out.format(rank)``."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        said: list[Any] = []
        for store in (stores[0], stores[rank]):
            g = open_geometries(store, ["x"])["x"]
            try:
                pipe = insitu_pipeline(store, split_by_chunk(g, (1, 0, 0)), {"x": g},
                                       batch_size=2, missing_objects="drop")  # fmt: skip
            except ValueError as exc:
                said.append(str(exc))
                continue
            with pipe:
                said.append(len(pipe))
        Path(out.format(rank)).write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # (two gloo ranks forked: about 5 s)
@pytest.mark.timeout(120)
def test_ranks_whose_listings_of_a_changing_store_differ_refuse_to_build_naming_the_ranks(
    tmp_path: Path,
) -> None:
    from resume_helpers import spawn_ranks

    before, after = _write(tmp_path / "before.zarr", 6), _write(tmp_path / "after.zarr", 6)
    for chunk in (2, 3):  # deleted between rank 0's build and rank 1's
        (after / "x" / "c" / str(chunk) / "0").unlink()
    out = str(tmp_path / "rank{}.json")
    args = (2, str(tmp_path / "init"), [str(before), str(after)], out)
    spawn_ranks(drop_on_each_rank, args=args, nprocs=2, workdir=tmp_path / "ranks")
    said = [json.loads(Path(out.format(r)).read_text()) for r in range(2)]
    assert [s[0] for s in said] == [3, 3]  # one store listed alike: 12 samples, 6 per rank
    # before: rank 0 built 3 batches, rank 1 (4 samples dropped) 2: DDP hung at rank 0's third
    for _, refused in said:
        assert isinstance(refused, str), said
        assert "rank 1 differs from rank 0 in" in refused and "rank 0 differs" not in refused
        assert "the steps dropped as missing" in refused, refused
        assert "rank 0 none, rank 1 {'absent_object': 4}" in refused, refused
        assert "missing_objects='read'" in refused


# ---------------------------------------------------------------------------------------------
# Consolidated metadata zarr cannot parse
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_consolidated_metadata_zarr_cannot_parse_is_corrupt_metadata_naming_the_document(
    site: tuple[Path, NginxServer], zarr_format: int
) -> None:
    root, server = site
    name = f"badconsolidated{zarr_format}.zarr"
    group = zarr.open_group(root / name, mode="w", zarr_format=zarr_format)
    group.create_array("a", data=np.ones((4, 2), dtype="f4"), chunks=(2, 2))
    zarr.consolidate_metadata(root / name)
    doc = root / name / ("zarr.json" if zarr_format == 3 else ".zmetadata")
    meta = json.loads(doc.read_text())
    if zarr_format == 3:
        meta["consolidated_metadata"]["metadata"]["a"] = {"node_type": "array"}  # a bad entry
    else:
        meta["metadata"]["a/.zarray"] = {"shape": [4, 2]}
    doc.write_text(json.dumps(meta))
    for store in (root / name, open_store(f"{server.endpoint}/{name}")):  # listed, not listed
        for variables in (None, ["a"]):
            # before (v3): GroupNotFoundError "No group found in store ... at path ''"
            with pytest.raises(CorruptMetadataError, match="consolidated metadata") as err:
                open_geometries(store, variables)
            assert [key for key, _ in err.value.documents] == [doc.name]
            assert "zarr.consolidate_metadata(store)" in str(err.value)


# ---------------------------------------------------------------------------------------------
# S3 folder markers
# ---------------------------------------------------------------------------------------------


@pytest.mark.xdist_group("s3")
@pytest.mark.filterwarnings("ignore:Object at empty is not recognized")  # zarr's, on the marker
def test_s3_folder_markers_do_not_stop_the_arrays_being_found(
    tmp_path: Path,
    s3_upload: Callable[[Path, str], str],
    s3_options: dict[str, Any],
    s3_client: Any,
) -> None:
    local = _write(tmp_path / "v.zarr", 5)
    group = zarr.open_group(local, mode="r+")
    group.create_group("sub").create_array("u", data=np.arange(8, dtype="i4"), chunks=(3,))
    url = s3_upload(local, "p/v.zarr")
    bucket, prefix = url[len("s3://") :].split("/", 1)
    client = s3_client
    for marker in ("", "sub/", "empty/"):  # the S3 console's "Create folder"
        client.put_object(Bucket=bucket, Key=f"{prefix}/{marker}", Body=b"")
    store = open_store(url, **s3_options)
    # before: ValueError "The first component of sub does not start with sub." (or, for the
    # root's marker alone, a RecursionError in zarr's walk)
    geoms = open_geometries(store)
    assert sorted(geoms) == ["sub/u", "x"]
    rows, _ = _read(store)
    _assert_rows_of(rows, local)
    u = geoms["sub/u"]
    pipe = insitu_pipeline(store, split_by_chunk(u, (1, 0, 0)), {"u": u}, batch_size=3)
    with pipe:
        got = sorted(int(v) for b in Loader(pipe) for v in np.asarray(b["u"]))
    assert got == zarr.open_array(local / "sub" / "u", mode="r")[...].tolist()


# ---------------------------------------------------------------------------------------------
# A server's error page in a message
# ---------------------------------------------------------------------------------------------


def test_a_listing_refused_with_an_error_page_is_quoted_in_one_short_line_naming_the_status(
    site: tuple[Path, NginxServer], tmp_path: Path
) -> None:
    root, server = site
    _write(root / "bkt" / "paged.zarr", 9)  # no consolidated metadata: finding arrays lists
    # nginx as a public bucket answers S3's LIST with its 403 page, and WebDAV's with a 405 page
    s3 = open_store("s3://bkt/paged.zarr", anonymous=True, endpoint=server.endpoint,
                    region="us-east-1", client_options={"allow_http": True})  # fmt: skip
    http = open_store(f"{server.endpoint}/bkt/paged.zarr")
    g = open_geometries(s3, ["x"])["x"]
    nowhere = {"nope": replace(g, path="nope")}
    said: list[tuple[str, str]] = []  # (message, the status it must name)
    errors: list[BaseException] = []
    for store, status in ((s3, "403 Forbidden"), (http, "405 Method Not Allowed")):
        for refused, args in (
            (open_geometries, (store,)),  # "listing it failed (...)"
            (open_geometries, (store, ["nope"])),  # "which arrays it holds could not be found"
            (check_arrays_in_store, (store, nowhere)),  # the same, for geometries given
        ):
            with pytest.raises(FileNotFoundError) as err:
                refused(*args)
            said.append((str(err.value), status))
            errors.append(err.value)
    with pytest.warns(UserWarning, match="trusted without checking") as warned:  # the cache's
        for _ in range(2):  # a writing run, then one that checks its chunks: a LIST
            _read(s3, cache_dir=tmp_path / "cache", persist=True)
    said.append((str(warned[0].message), "403 Forbidden"))
    for message, status in said:
        # before: obstore's whole error, its debug dump and nginx's page, up to 1,800 characters
        assert status in message and "\n" not in message and "\r" not in message, message
        assert "<html" not in message.lower() and "Debug source" not in message, message
        assert len(message) < 650, (len(message), message)
    cause: BaseException | None = errors[0]  # the whole of obstore's error stays chained
    while cause is not None and "<html>" not in str(cause):
        cause = cause.__cause__
    assert cause is not None and "403 Forbidden" in str(cause)


def test_a_cause_in_brief_keeps_its_kind_its_first_line_and_the_status_at_its_end() -> None:
    page = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>...</body></html>"
    assert short_cause(OSError(page)) == "OSError: 502 Bad Gateway"  # nothing but the page
    assert short_cause(ValueError("bad\nDebug source:\n{...}")) == "ValueError: bad"
    long = "GenericError: " + "x" * 300 + " status code: 503 Service Unavailable"
    said = short_cause(RuntimeError(long), limit=120)
    assert said.startswith("RuntimeError: GenericError: xxx") and " ... " in said
    assert said.endswith("503 Service Unavailable") and len(said) < 140
    assert short_cause(KeyError()) == "KeyError"


def test_a_static_array_the_server_refuses_is_named_in_one_short_line_with_the_status(
    tmp_path: Path,
) -> None:
    if nginx_executable() is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it)")
    group = zarr.open_group(tmp_path / "www" / "st.zarr", mode="w", zarr_format=3)
    group.create_array("x", data=np.ones((8, 3), dtype="f4"), chunks=(2, 3),
                       dimension_names=["time", "lat"])  # fmt: skip
    group.create_array("mask", data=np.ones(3, dtype="u1"), dimension_names=["lat"])
    with NginxServer(tmp_path / "www", statuses={r"^/st\.zarr/mask/c/": 403}) as server:
        store = open_store(f"{server.endpoint}/st.zarr")
        g = open_geometries(store, ["x", "mask"])
        assert g["mask"].static
        with pytest.raises(OSError, match="cannot read static array 'mask'") as err:
            insitu_pipeline(store, split_by_chunk(g["x"]), g, batch_size=2)
    said = str(err.value)
    # before: obstore's whole error, nginx's 403 page and the debug dump, over many lines
    assert "403 Forbidden" in said and "\n" not in said and "<html" not in said.lower(), said
    assert len(said) < 400, (len(said), said)
