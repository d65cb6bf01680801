"""``torch.profiler`` ranges of the stages, paid for only while a profiler runs.

Each stage wraps its step in :func:`profile_range` (``insitu.next``, the consumer's wait for a
batch; ``insitu.admit``, ``insitu.wait_for_chunks``, ``insitu.gather`` on the producer thread;
``insitu.fill_run`` on the decode threads; ``insitu.gather`` is the gather stage's whole
``next()``, with its source's ranges nested inside), so the loader shows inside a PyTorch profiler
trace next to the model's work. Outside a profiler the range is a shared ``nullcontext``: one
module-attribute test per step, nothing recorded. The test is torch's own process-wide flag
(``torch.autograd.profiler._is_profiler_enabled``, set while any ``torch.profiler.profile``
runs): a profiler records other threads' ranges only with
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``; the
consumer's own range is recorded either way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from torch.autograd import profiler as _profiler
from torch.profiler import record_function

__all__ = ["RANGE_NAMES", "profile_range", "profiling", "ranged"]

F = TypeVar("F", bound=Callable[..., Any])

#: Every range a stage emits.
RANGE_NAMES = (
    "insitu.next",
    "insitu.admit",
    "insitu.wait_for_chunks",
    "insitu.gather",
    "insitu.fill_run",
)

_OFF: AbstractContextManager[Any] = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a ``torch.profiler`` profile runs now (any thread); False on a torch without the
    flag."""
    return bool(getattr(_profiler, "_is_profiler_enabled", False))


def profile_range(name: str) -> AbstractContextManager[Any]:
    """``record_function(name)`` while a profiler runs, else a no-op context."""
    if getattr(_profiler, "_is_profiler_enabled", False):
        return record_function(name)
    return _OFF


def ranged(name: str) -> Callable[[F], F]:
    """Decorate a method to run inside :func:`profile_range` ``(name)``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if getattr(_profiler, "_is_profiler_enabled", False):
                with record_function(name):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
