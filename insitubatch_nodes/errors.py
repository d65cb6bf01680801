"""Every exception the package raises on purpose, with one common base class.

Catch :class:`InSituError` to handle any of them. Each also derives from the builtin a caller
would have caught before this base existed (``RuntimeError``, ``ValueError``, ``OSError``), so
``except RuntimeError`` keeps working. What each error means and what to do about it is in its
docstring; the message of each instance names the array, chunk, store or directory concerned.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ArrayNotFoundError",
    "CacheBusyError",
    "CacheClosed",
    "CacheDiskFullError",
    "CacheMissError",
    "ChunkReadError",
    "ChunkTransformError",
    "CoordinateLengthError",
    "CorruptCacheError",
    "CorruptMetadataError",
    "DecodeError",
    "FillCancelled",
    "InSituError",
    "PipelineInterrupted",
    "RankFailedError",
    "StaleCacheError",
    "StateMismatchError",
    "TooFewSamplesError",
    "UnsupportedMetadataError",
]


class InSituError(Exception):
    """The base of every exception raised by ``insitubatch_nodes`` on purpose.

    Each pickles (an error crossing a process boundary: ``ddp_spawn``, a process pool) with
    its message, its attributes and, in brief, the cause chained to it (pickle drops
    ``__cause__`` itself), whatever arguments its constructor takes."""

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        if self.__cause__ is not None:
            state.setdefault("cause_text", short_cause(self.__cause__, 600))
        return (_unpickle, (type(self), self.args), state)


def _unpickle(cls: type[InSituError], args: tuple[Any, ...]) -> InSituError:
    """An instance of ``cls`` holding ``args``, its constructor not called (its arguments are
    not its ``args``); the attributes follow from the pickled state."""
    base = OSError if issubclass(cls, OSError) else BaseException  # (the layout's base)
    error = base.__new__(cls, *args)
    base.__init__(error, *args)
    return error


# -- reading the store ---------------------------------------------------------------------------


class CorruptMetadataError(InSituError, ValueError):
    """A zarr metadata document (``zarr.json``, ``.zarray``, ...) cannot be read.

    ``documents`` lists ``(store key, reason)`` for each unreadable document and ``store``
    names the store; zarr's own error is chained (``__cause__``).
    """

    def __init__(self, store: str, documents: Sequence[tuple[str, str]], detail: str = ""):
        self.store, self.documents = store, list(documents)
        if self.documents:
            what = "; ".join(
                f"{key!r} (the metadata of {_node_name(key)}) {reason}"
                for key, reason in self.documents
            )
        else:
            what = f"a metadata document is not valid JSON ({detail})"
        super().__init__(
            f"corrupt zarr metadata in store {store}: {what}. Restore or rewrite the "
            "document(s): zarr cannot open the array or group without them"
        )


class UnsupportedMetadataError(CorruptMetadataError):
    """A zarr metadata document names a codec or data type that nothing installed provides,
    or a chunk grid zarr opens only with an option (zarr 3.2 on: a rectilinear grid, with
    ``array.rectilinear_chunks``) or not at all (zarr 3.1).

    The document is valid; what decodes it is missing from this Python (a codec from
    ``imagecodecs`` or an optional ``numcodecs`` dependency, a data type of a newer zarr). A
    :class:`CorruptMetadataError`, so code that catches that catches this too; ``documents``
    lists ``(store key, reason)`` as there.
    """

    def __init__(self, store: str, documents: Sequence[tuple[str, str]]):
        self.store, self.documents = store, list(documents)
        what = "; ".join(
            f"{key!r} (the metadata of {_node_name(key)}) {reason}" for key, reason in documents
        )
        grid = any("chunk grid" in why for _, why in documents)
        advice = []
        if not grid or any("not installed" in why for _, why in documents):
            advice.append(
                "Install the package that provides it and import it before opening the store "
                "(imagecodecs' codecs: import imagecodecs.numcodecs; "
                "imagecodecs.numcodecs.register_codecs()); a data type zarr does not know needs "
                "a newer zarr-python"
            )
        if grid:
            advice.append(
                "insitubatch_nodes reads arrays with a regular chunk grid only: with the option "
                "set (zarr >= 3.2), zarr opens the store and its arrays with regular grids are "
                "read (an array with variable chunk sizes is refused by name); to train on such "
                "an array, rewrite it with one chunk shape (zarr.create_array(..., chunks=(...)))"
            )
        ValueError.__init__(
            self,
            f"zarr metadata in store {store} needs what is not "
            f"{'read' if grid else 'installed'} here: {what}. " + ". ".join(advice),
        )


class CoordinateLengthError(InSituError, ValueError):
    """An array's dimension coordinate holds another number of values than the array has
    samples along that dimension: a store read while it is appended to (the coordinate resized
    before or after the data), or one whose arrays were resized apart. xarray refuses to open
    such a store ("conflicting sizes for dimension"). ``coord`` and ``array`` are the two
    paths, ``length`` and ``n_samples`` their lengths along ``dim``; ``while_`` (``""`` or a
    clause ending in ": ") says what could not be done with it."""

    def __init__(
        self, coord: str, length: int, array: str, n_samples: int, dim: str, while_: str = ""
    ) -> None:
        self.coord, self.length, self.array = coord, length, array
        self.n_samples, self.dim, self.while_ = n_samples, dim, while_
        super().__init__(
            f"{while_}coordinate {coord!r} has {length} values but {array!r} has {n_samples} "
            f"samples along {dim!r}: it is not a coordinate of the sample axis, and xarray "
            f"refuses such a store too (conflicting sizes for dimension {dim!r}): one being "
            "appended to, or whose arrays were resized apart. Write the coordinate and the "
            "arrays at one length (or build the pipeline once the append is done); "
            "coords=() carries no coordinate in the batches (a time stride, window offsets "
            "in time deltas and missing= still need the times)"
        )

    def while_doing(self, what: str) -> CoordinateLengthError:
        """The same error, its message opened by ``what`` (ending in ": ")."""
        return CoordinateLengthError(
            self.coord, self.length, self.array, self.n_samples, self.dim, what
        )


def _node_name(key: str) -> str:
    node, _, name = key.rpartition("/")
    if node:
        return f"array/group {node!r}"
    return "the root array" if name == ".zarray" else "the root group"


class ArrayNotFoundError(InSituError, KeyError, FileNotFoundError):
    """An array named by the caller is not in the store (or the store holds no array at all).

    Raised alike by ``open_geometries`` and ``insitu_pipeline``; it is both a ``KeyError`` and
    a ``FileNotFoundError`` (as zarr's own ``ArrayNotFoundError`` is a ``FileNotFoundError``),
    so either ``except`` catches it. The message names what was looked for, in which store,
    and which arrays exist there.
    """

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class DecodeError(InSituError, ValueError):
    """A stored object could not be decoded (corrupt or truncated bytes, checksum mismatch, or a
    decoded size that does not match the chunk). The underlying error is the ``__cause__``."""


class ChunkReadError(InSituError, RuntimeError):
    """A stored object could not be read or decoded. The cause is chained (``__cause__``).

    The message names the array, the collection member (``member``), the chunk (and tile), the
    store key and the store (``store``; ``located``, where given, says where the key lives
    instead: a key of one of a collection's several stores) — :attr:`where` is that much —
    then the cause in one line and what to do: a read failed after the store's retries (or
    was refused), so resume from the last ``state_dict()`` once the store answers; bytes that
    do not decode need the object written again. Either way ``on_bad_chunk="nan"`` fills such
    objects and goes on.
    """

    def __init__(
        self,
        array: str,
        chunk_index: int,
        tile: tuple[int, ...],
        key: str,
        what: str,
        store: str = "",
        *,
        member: str = "",
        located: str = "",
    ):
        self.array, self.chunk_index, self.tile, self.key = array, chunk_index, tile, key
        self.store, self.member = store, member
        where = f"chunk {chunk_index}" + (f" tile {tile}" if any(tile) else "")
        if member:
            where = f"member {member!r} {where}"
        source = f": {located}" if located else (f" in store {store}" if store else "")
        self.what = what
        #: under ``on_bad_chunk="nan"``: the reads failed in a row, this one last, none served
        #: between them (a store that stopped answering is not filled; 0 otherwise)
        self.in_a_row = 0
        #: what failed, and where: the message without its cause and advice
        self.where = f"failed to {what} array {array!r} {where} (store key {key!r}{source})"
        super().__init__(self.where)

    def __str__(self) -> str:  # the cause is chained after construction: read it here
        text = self.__dict__.get("cause_text")  # (a pickled copy's: its __cause__ is gone)
        if self.__cause__ is not None:
            text = short_cause(self.__cause__, 600)
        cause = f": {text}" if text else ""
        if self.in_a_row:
            return f"{self.where}{cause}. " + _STOPPED_ADVICE.format(self.in_a_row)
        return f"{self.where}{cause}. {_DECODE_ADVICE if self.what == 'decode' else _READ_ADVICE}"


_READ_ADVICE = (
    "The store's retries (RetryPolicy) were spent, or the error is not one it retries: once "
    "the store answers, resume from the last state_dict() (no sample is lost or repeated), or "
    "pass on_bad_chunk='nan' to fill such objects and go on"
)
_STOPPED_ADVICE = (
    "The store has failed {} reads in a row, this one last, and served none between them: "
    "on_bad_chunk='nan' fills the occasional object a store will not return, not a store that "
    "returns none (credentials expired, the store or the network down). Once the store "
    "answers, resume from the last state_dict() (no sample is lost or repeated)"
)
_DECODE_ADVICE = (
    "Its bytes do not decode as the array's metadata says (corrupt, cut short, or rewritten "
    "since the pipeline was built): write the object again from its source, or pass "
    "on_bad_chunk='nan' to fill such objects and go on"
)


class ChunkTransformError(InSituError, RuntimeError):
    """A chunk transform raised, returned something else than a chunk, or produced data whose
    shape or dtype disagrees with what it declared (or, undeclared, with its input)."""


# -- the pipeline stopping -----------------------------------------------------------------------


class FillCancelled(InSituError, RuntimeError):
    """A chunk's fill was cancelled (its pipeline closed or reset) before the data landed."""


class PipelineInterrupted(InSituError, RuntimeError):
    """A wait was cut short because its pipeline is stopping (``close`` or ``reset``)."""


# -- dealing samples to ranks ---------------------------------------------------------------------


class TooFewSamplesError(InSituError, ValueError):
    """A split holds fewer samples than there are ranks, so some rank would get none: a rank
    without a batch leaves the others waiting at their first collective call (Lightning
    refuses such a rank), and repeating a sample to fill it would count that sample twice.
    ``split``, ``n_samples`` and ``world_size`` say which split and how many; the message says
    what to do (read it on at most ``n_samples`` ranks, or give the split more samples);
    ``counted`` says what was counted (``"1 valid anchors"``, and the anchors the missing-step
    checks dropped)."""

    def __init__(
        self, message: str, *, split: str, n_samples: int, world_size: int, counted: str = ""
    ) -> None:
        super().__init__(message)
        self.split, self.n_samples, self.world_size = split, n_samples, world_size
        self.counted = counted


class RankFailedError(InSituError, RuntimeError):
    """Another rank of the ``torch.distributed`` group failed where this one succeeded: a
    pipeline built over the group (or its ``set_views``) raised there. Every rank raises at
    the same point instead of training on without it, until its first collective call waits
    for the failed rank until the group's timeout. ``failed`` maps each failed rank to what
    it raised (``"TypeName: message"``, shortened), ``world_size`` is the group's; the failed
    rank itself raised its own error, whose traceback is in its log. Raised by ``set_views``,
    nothing of the call took effect on any rank: caught, every rank reads as before."""

    def __init__(self, message: str, *, failed: dict[int, str], world_size: int) -> None:
        super().__init__(message)
        self.failed, self.world_size = dict(failed), world_size


# -- resuming ------------------------------------------------------------------------------------


class StateMismatchError(InSituError, ValueError):
    """A saved loader state that this pipeline cannot restore: it was taken under other
    settings. The message says what differs, how to resume the state (build the pipeline as
    the run that saved it) and how to go on without it; ``epoch`` and ``batches`` say where it
    was taken (the epoch, and the batches of it delivered); ``also`` ends the message (what
    would restore here)."""

    def __init__(
        self, what: str, resume: str, go_on: str, *, epoch: int, batches: int, also: str = ""
    ) -> None:
        super().__init__(f"{what}. {resume}. {go_on}{also}")
        self.what, self.resume, self.go_on, self.also = what, resume, go_on, also
        self.epoch, self.batches = epoch, batches

    def told(self, go_on: str) -> StateMismatchError:
        """The same refusal, saying ``go_on`` as the way to go on without the state (where
        whoever drives the pipeline has another way than the pipeline's own)."""
        return StateMismatchError(
            self.what, self.resume, go_on, epoch=self.epoch, batches=self.batches, also=self.also
        )


# -- the cache directory -------------------------------------------------------------------------


class CacheBusyError(InSituError, RuntimeError):
    """Another process holds the cache directory in a conflicting mode (see
    :mod:`insitubatch_nodes.cache`)."""


class StaleCacheError(InSituError, RuntimeError):
    """The cache holds chunks of arrays whose geometry or chunk transforms have changed, or
    whose stored objects changed since they were cached (see
    :mod:`insitubatch_nodes.cache.identity`)."""


class CacheMissError(InSituError, RuntimeError):
    """``readonly_cache=True`` and a chunk the run reads is not in the cache."""


class CacheClosed(InSituError, RuntimeError):
    """The cache was closed (its pipeline closed) while a fill still wanted a file mapped."""


class CorruptCacheError(InSituError, RuntimeError):
    """The cache's log cannot be trusted (malformed line, or a file outside the directory), or
    a cached chunk's bytes no longer match the checksum logged with it (read-only readers)."""


class CacheDiskFullError(InSituError, OSError):
    """The file system of ``cache_dir`` has no room for the file slot memory needs (spill mode),
    or for the cache's own files at construction. ``errno`` is ENOSPC (EDQUOT for a quota);
    ``directory`` and ``nbytes`` say where and how much."""

    def __init__(self, message: str, *, code: int, directory: Path, nbytes: int) -> None:
        super().__init__(code, message)
        self.directory = directory
        self.nbytes = nbytes

    def __str__(self) -> str:
        return str(self.strerror)


def corrupt_metadata(
    store: Any, exc: BaseException, keys: Sequence[str] | None = None
) -> CorruptMetadataError | None:
    """The error to raise for zarr's ``exc`` when metadata in ``store`` is unreadable (``None``:
    the metadata reads, ``exc`` is about something else). Imports the store helpers when
    called: this module imports nothing of the package, so that every module can import it."""
    import json

    from insitubatch_nodes.io import metadata_docs
    from insitubatch_nodes.io.stores import describe_store

    try:
        bad = metadata_docs.unreadable_metadata(store, keys)
    except Exception:  # the diagnosis is best effort: the store may not list, or be gone
        bad = []
    if bad and all(why.startswith(metadata_docs.UNSUPPORTED) for _, why in bad):
        return UnsupportedMetadataError(describe_store(store), bad)
    if bad or isinstance(exc, json.JSONDecodeError):
        return CorruptMetadataError(describe_store(store), bad, str(exc))
    return None


def short_cause(exc: BaseException, limit: int = 200) -> str:
    """``"TypeName: what it says"`` in one line, for a message that quotes ``exc`` (chain
    ``exc`` to keep the whole of it): an obstore error runs to kilobytes, an HTTP server's
    error page and a debug dump of the request after its first line.

    The first line of ``exc``'s message, cut where an HTML page begins (the page's
    ``<title>``, e.g. ``403 Forbidden``, when nothing precedes it); longer than ``limit``
    characters, its middle is elided, so the kind of error at its start and the status at
    its end (obstore's "... status code: 403 Forbidden") both stay."""
    import re

    text = str(exc).strip()
    said = text.splitlines()[0] if text else ""
    page = [i for i in (said.lower().find("<html"), said.lower().find("<!doctype")) if i >= 0]
    if page:
        said = said[: min(page)].rstrip(": ")
        title = re.search(r"<title>\s*(.*?)\s*</title>", text, re.IGNORECASE | re.DOTALL)
        if not said:
            said = title.group(1) if title else "an HTML page"
    if len(said) > limit:
        half = max(1, (limit - 5) // 2)
        said = f"{said[:half]} ... {said[-half:]}"
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__
