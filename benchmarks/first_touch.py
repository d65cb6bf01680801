"""How fast this machine hands a fresh process memory: ``python -m benchmarks.first_touch``.

A fresh process pays for every page of memory it touches the first time (the kernel clears it;
on a VM the host may have to back it too). Everything a cold epoch allocates — pool slots, batch
buffers — is paid at this rate, so the archive suite measures it in every round, in a fresh
process of its own, next to the epochs it explains. Four rates over ``--mib`` MiB, in GB/s:

* ``populate``: one anonymous ``mmap`` with ``MAP_POPULATE`` (the kernel maps every page in one
  pass: what the pool's slot reserve and the batch-buffer reserve use);
* ``first_write_small``: memory that asks for no huge pages (``insitubatch_nodes._pages.
  plain_pages``: how slots and batch buffers are made on demand) written once (pages fault in
  one by one, on the writing thread: what a decode into a fresh slot pays);
* ``first_write``: ``np.empty`` then a write of every byte — numpy asks for huge pages on
  arrays of 4 MiB or more, so this is the rate of huge pages (what slots paid before
  2026-12-07);
* ``rewrite``: the same array written again (memory the process already holds).

Each is taken once per process, on memory no earlier step touched, so the first two are cold.
Prints one JSON object; ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import mmap
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from insitubatch_nodes._pages import plain_pages


def first_touch_rates(nbytes: int) -> dict[str, Any]:
    """The three rates (GB/s) over ``nbytes`` of fresh memory each, measured in this process."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    populate = getattr(mmap, "MAP_POPULATE", 0)
    out: dict[str, Any] = {"nbytes": nbytes, "populate_GBps": None}
    if populate and sys.platform.startswith("linux"):
        t = time.perf_counter()
        region = mmap.mmap(-1, nbytes, flags=flags | populate)
        out["populate_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
        region.close()
    small = plain_pages((nbytes,), np.uint8)
    t = time.perf_counter()
    small.fill(1)
    out["first_write_small_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
    del small
    arr = np.empty(nbytes, dtype=np.uint8)
    t = time.perf_counter()
    arr.fill(1)
    out["first_write_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    arr.fill(2)
    out["rewrite_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
    return out


def in_child(mib: int) -> dict[str, Any]:
    """:func:`first_touch_rates` over ``mib`` MiB, measured in a fresh interpreter (a child)."""
    cmd = [sys.executable, "-m", "benchmarks.first_touch", "--mib", str(mib)]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(cmd, check=True, cwd=root, capture_output=True, text=True).stdout
    rates: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="MiB per measurement (default 512)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    result = first_touch_rates(args.mib << 20)
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
