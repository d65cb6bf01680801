"""The local variables of the package's finished frames that an error's traceback keeps.

An error that stops an epoch passed through frames whose locals held the failed batch's chunks
(pool slots, maps of ``cache_dir`` files); kept by the error (a caller's ``except`` block, a
notebook's last error), they kept those alive, and a close waited for the maps. Both the
consumer (before it raises the error) and the decode thread that recorded it (when its run
ends: frames still running at the consumer's clearing have finished by then) clear them.
"""

from __future__ import annotations

import contextlib
import os
from types import FrameType

__all__ = ["drop_frame_locals"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def drop_frame_locals(error: BaseException) -> None:
    """Clear the local variables of this package's frames that ``error``, and the exceptions
    it chains (``__cause__``, ``__context__``), passed through on the pipeline's threads, and of
    their callers (a finished frame keeps its caller): they held the failed batch's chunks
    (pool slots, maps of ``cache_dir`` files), which the error kept alive as long as it lived —
    in a caller's ``except`` block, as a notebook's last error — and the graph's close, before
    the error was raised, waited ``CLOSE_WAIT_S`` (2 s) for those maps (so did every close
    while the error lived). The traceback still says where each error passed. Frames still
    running are left alone (``RuntimeError``), and so is other code's (a chunk transform's
    locals stay for a debugger); the package's coroutines in a chain have all returned."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame: FrameType | None = tb.tb_frame
            while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
                if id(frame) not in seen:
                    seen.add(id(frame))
                    with contextlib.suppress(RuntimeError):
                        frame.clear()
                frame = frame.f_back
            tb = tb.tb_next
        todo += [exc.__cause__, exc.__context__]
