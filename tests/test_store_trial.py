"""A black-box trial of stores as they sit in object storage, zarr's own read the oracle.

Covered (a generator of ~2,600 cheap cases, not kept, over one moto S3 server and one nginx):
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
persistent cache over S3. All of that was right.

Found, each with its test below: a store URL's query string or fragment was dropped silently
(``s3://b/p?versionId=3`` read the newest objects of ``p``).
"""

from __future__ import annotations

import pytest

from insitubatch_nodes import open_store

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
