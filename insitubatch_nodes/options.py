"""The fetch side's and the cache side's settings, each one checked, immutable object.

Beside :class:`~insitubatch_nodes.plan.config.PlanConfig` (what a read plan draws) these are the
other two groups of settings a pipeline is built from:

* :class:`FetchOptions`: how stored objects are read and decoded (``max_inflight``,
  ``decode_threads``, ``retry``, ``on_bad_chunk``, ``report``, ``direct``, ``trace``) and how
  far the prefetch stage looks ahead (``prefetch_depth``);
* :class:`CacheOptions`: where decoded chunks live (``budget_bytes``, ``backing``) and the
  chunk cache on local disk (``cache_dir``, ``persist``, ``readonly``, ``reset_stale``,
  ``verify``, ``check_store``).

**Contract.** Each object is checked once, when it is made, with the package's shared checks
(``TypeError`` for the wrong kind of value, ``ValueError`` for a value out of range or a
combination that cannot work, each naming what to pass instead); values are normalised to plain
Python. Everything that receives one — the builder, the stages, the schedule, the pool, the
Lightning module — trusts it and checks nothing again. Both are frozen and hashable (apart from
a ``retry`` policy or ``backing`` that is not); :meth:`replace` returns a checked copy.

:func:`~insitubatch_nodes.insitu_pipeline` builds each object from its loose keywords, or takes
it whole (``config=``, ``fetch=``, ``cache=``): :func:`resolve_options` is that one rule.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from insitubatch_nodes._checks import (
    check_bool,
    check_int,
    check_on_bad_chunk,
    check_optional_int,
)
from insitubatch_nodes.io.stores import RetryPolicy
from insitubatch_nodes.slots import SlotBacking

__all__ = ["CacheOptions", "FetchOptions", "resolve_options"]

T = TypeVar("T")


@dataclass(frozen=True)
class FetchOptions:
    """How the fetch and prefetch stages read, decode and look ahead.

    * ``max_inflight`` (32): stored-object GETs in flight at once, a positive integer;
    * ``decode_threads`` (``None``: one per core): the shared decode pool's size;
    * ``retry`` (``None``: the policy the store was opened with): a
      :class:`~insitubatch_nodes.io.stores.RetryPolicy` whose ``timeout_s`` bounds each GET;
    * ``on_bad_chunk`` (``"raise"``): ``"raise"`` or ``"nan"`` (see ``insitu_pipeline``);
    * ``report`` (``True``): measure every epoch for the epoch report;
    * ``direct`` (``None``: decided from the budget): decode chunks read by one row straight
      into the batch (``True``/``False`` force it; ``False`` still keeps a split that fits, as
      ``None`` does, and ``True`` never keeps one);
    * ``prefetch_depth`` (2): finished batches the prefetch stage keeps ready, a positive
      integer;
    * ``trace`` (``False``): also record every epoch's spans, per thread, for
      ``pipe.report().write_trace(path)`` (a Chrome-trace JSON file; needs ``report``).
    """

    max_inflight: int = 32
    decode_threads: int | None = None
    retry: RetryPolicy | None = None
    on_bad_chunk: str = "raise"
    report: bool = True
    direct: bool | None = None
    prefetch_depth: int = 2
    trace: bool = False

    def __post_init__(self) -> None:
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise TypeError(
                f"retry must be a RetryPolicy (insitubatch_nodes.RetryPolicy) or None, got "
                f"{self.retry!r}"
            )
        checked: dict[str, Any] = {
            "max_inflight": check_int("max_inflight", self.max_inflight, minimum=1),
            "decode_threads": check_optional_int("decode_threads", self.decode_threads, minimum=1),
            "on_bad_chunk": check_on_bad_chunk(self.on_bad_chunk),
            "report": check_bool("report", self.report),
            "direct": None if self.direct is None else check_bool("direct", self.direct),
            "prefetch_depth": check_int("prefetch_depth", self.prefetch_depth, minimum=1),
            "trace": check_bool("trace", self.trace),
        }
        if checked["trace"] and not checked["report"]:
            raise ValueError(
                "trace=True records the spans of the epoch report: it needs report=True"
            )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> FetchOptions:
        """A copy with ``changes`` (field names as keywords), checked like a new object."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CacheOptions:
    """Where decoded chunks live: the pool's budget and backing, and the chunk cache on disk.

    * ``budget_bytes`` (``None``: automatic, each epoch's working set): the pool's byte budget,
      a positive integer (the builder's keyword is ``cache_budget_bytes``);
    * ``backing`` (``None``: RAM): a :class:`~insitubatch_nodes.slots.SlotBacking`; not with
      ``cache_dir``, which chooses the backing itself;
    * ``cache_dir`` (``None``): a local folder for slots on disk and the persistent cache;
    * ``persist`` (``False``): keep decoded chunks in ``cache_dir`` for later runs;
    * ``readonly`` (``False``): serve from a persistent cache another run wrote, write nothing
      (implies ``persist``);
    * ``reset_stale`` (``False``): delete a cache written for other arrays or transforms;
    * ``verify`` (``True``): check each revived chunk against its checksum;
    * ``check_store`` (``True``): check the cached chunks against the store's listing at start.

    ``persist``, ``readonly``, ``reset_stale``, ``verify=False`` and ``check_store=False`` need a
    ``cache_dir``; ``readonly`` and ``reset_stale`` exclude each other. :attr:`persistent` is
    whether a persistent cache is asked for.
    """

    budget_bytes: int | None = None
    backing: SlotBacking | None = None
    cache_dir: str | os.PathLike[str] | None = None
    persist: bool = False
    readonly: bool = False
    reset_stale: bool = False
    verify: bool = True
    check_store: bool = True

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "budget_bytes": check_optional_int("cache_budget_bytes", self.budget_bytes, minimum=1),
            "persist": check_bool("persist", self.persist),
            "readonly": check_bool("readonly_cache", self.readonly),
            "reset_stale": check_bool("reset_stale_cache", self.reset_stale),
            "verify": check_bool("verify_cache", self.verify),
            "check_store": check_bool("check_store", self.check_store),
        }
        if self.backing is not None and not all(
            callable(getattr(self.backing, m, None)) for m in ("allocate", "release")
        ):
            raise TypeError(
                "backing must be a SlotBacking (with allocate() and release()) or None, got "
                f"{self.backing!r}"
            )
        if self.cache_dir is None:
            named = [
                name
                for name, key in (
                    ("persist", "persist"),
                    ("readonly_cache", "readonly"),
                    ("reset_stale_cache", "reset_stale"),
                )
                if checked[key]
            ]
            if named:
                raise ValueError(f"{' and '.join(named)} need a cache_dir: pass cache_dir=PATH")
            if not checked["check_store"]:
                raise ValueError("check_store=False needs a persistent cache: pass cache_dir=PATH")
            if not checked["verify"]:
                raise ValueError("verify_cache=False needs a cache_dir: pass cache_dir=PATH")
        else:
            if not isinstance(self.cache_dir, (str, os.PathLike)) or not os.fspath(self.cache_dir):
                raise TypeError(
                    f"cache_dir must be a path (str or os.PathLike) or None, got {self.cache_dir!r}"
                )
            if self.backing is not None:
                raise ValueError(
                    "cache_dir chooses the slot backing itself: pass cache_dir or backing"
                )
            if checked["readonly"] and checked["reset_stale"]:
                raise ValueError(
                    "reset_stale_cache=True deletes files and readonly_cache=True writes "
                    "nothing: reset the cache with a writing run first"
                )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def persistent(self) -> bool:
        """Whether a persistent cache is asked for (``persist`` or ``readonly``)."""
        return self.cache_dir is not None and (self.persist or self.readonly)

    def replace(self, **changes: Any) -> CacheOptions:
        """A copy with ``changes`` (field names as keywords), checked like a new object."""
        return dataclasses.replace(self, **changes)


def resolve_options(
    given: T | None,
    kind: type[T],
    keywords: Mapping[str, tuple[str, Any]],
    *,
    where: str,
    argument: str,
) -> T:
    """The one ``kind`` object a function that takes both ``argument=kind(...)`` and that
    object's settings as loose keywords works from.

    ``keywords`` maps each field of ``kind`` to ``(keyword, value)``: the loose keyword's name
    (for messages) and the value ``where`` (the function's name) was called with. Without
    ``given`` they build the object (checked there). With ``given`` (which must be a ``kind``:
    ``TypeError`` otherwise) every one of them must still be at the field's default: one that
    differs raises ``TypeError`` naming it — pass the settings one way, not both.
    """
    if given is None:
        return kind(**{field: value for field, (_, value) in keywords.items()})
    if not isinstance(given, kind):
        raise TypeError(f"{where}: {argument} must be a {kind.__name__} or None, got {given!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    differ = [
        keyword
        for field, (keyword, value) in keywords.items()
        if not _is_default(value, defaults[field])
    ]
    if differ:
        raise TypeError(
            f"{where}: pass {argument}={kind.__name__}(...) or the keywords it holds "
            f"({', '.join(differ)}), not both (use {argument}.replace(...) to change a setting "
            f"of a {kind.__name__})"
        )
    return given


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)
