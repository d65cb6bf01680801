"""Files written whole or not at all: :func:`atomic_write`."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """A text file to write ``path`` through: it is written beside ``path`` under a temporary
    name of this process and thread and renamed over it (``os.replace``) when the block ends
    without an exception. So an interrupted write (Ctrl-C, a full disk, an error while
    serialising) leaves any earlier file at ``path`` as it was, and no partial one (the
    temporary file is removed); readers see the old file or the new one, never a mix. The file
    gets the permissions ``open(path, "w")`` gives a new file (the umask's)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with tmp.open("w") as f:
            yield f
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
