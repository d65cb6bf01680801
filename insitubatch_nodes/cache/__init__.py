"""The persistent chunk cache: decoded (and chunk-transformed) chunks kept on local disk.

* :mod:`~insitubatch_nodes.cache.directory` — :class:`ChunkCache`: one cache directory, its
  writers and readers, hits, misses and what is persisted;
* :mod:`~insitubatch_nodes.cache.lock` — one writer per directory, shared readers;
* :mod:`~insitubatch_nodes.cache.log` — the log line of each persisted chunk;
* :mod:`~insitubatch_nodes.cache.files` — file names, the ``.npy`` layout, mapped slots, spill;
* :mod:`~insitubatch_nodes.cache.fingerprint` — what a cached chunk must have been made by;
* :mod:`~insitubatch_nodes.cache.identity` — what each stored object was when it was cached;
* :mod:`~insitubatch_nodes.cache.stale` — what stale chunks do: a writer refetches them, a
  reader is refused for those it would serve;
* :mod:`~insitubatch_nodes.cache._filemap` — files mapped without keeping a descriptor.

Its errors are in :mod:`insitubatch_nodes.errors`.
"""

from insitubatch_nodes.cache.directory import ChunkCache
from insitubatch_nodes.cache.fingerprint import array_fingerprint

__all__ = ["ChunkCache", "array_fingerprint"]
