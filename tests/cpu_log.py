"""Sum up an ``INSITUBATCH_TESTS_CPU_LOG`` file: ``python tests/cpu_log.py FILE [N]``.

Prints the N costliest forked processes (CPU seconds, wall seconds, the test, the script), the
fork servers' own CPU (their imports), the fresh interpreters started through
``tests/forkserver.py``, per test file: the test processes' own CPU, the children they reaped
and the CPU of the forked processes their tests asked for; and per pytest process (the
controller ``main`` and each xdist worker) what no test accounts for: its start-up and
collection, the rest of its own CPU outside its tests (xdist's traffic; all of the controller's),
and the teardown of the session's fixtures (a moto server it reaps).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _file(test: str | None) -> str:
    return (test or "?").split("::")[0]


def main(path: str, top: int = 30) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    forked = [r for r in rows if "forked" in r]
    imports = {r["imports"]: r["new"] for r in rows if "imports" in r}
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in rows:
        if "test" in r and "own" in r:
            per_file[_file(r["test"])][0] += r["own"]
            per_file[_file(r["test"])][1] += r["reaped"]
        elif "forked" in r:
            per_file[_file(r["test"])][2] += r["cpu"]
            per_file[_file(r["test"])][3] += 1
    print(f"{'cpu':>7} {'wall':>6}  test / argv")
    for r in sorted(forked, key=lambda r: -r["cpu"])[:top]:
        script = " ".join(a if "\n" not in a else "<code>" for a in r["argv"])[:100]
        print(f"{r['cpu']:7.2f} {r['wall']:6.2f}  {r['test']}\n{'':16}{script}")
        if imports.get(r["forked"]):
            print(f"{'':16}imported: {' '.join(imports[r['forked']])}")
    servers = [r["cpu"] for r in rows if "server" in r]
    print(f"\nfork servers: {len(servers)}, their own CPU {sum(servers):.1f} s")
    for r in rows:
        if "fresh" in r:
            print(f"fresh interpreter: {r['test']}: {' '.join(r['argv'])[:120]}")
    print(f"\n{'own':>7} {'reaped':>7} {'forked':>7} {'n':>4}  file")
    for name, (own, reaped, fk, n) in sorted(per_file.items(), key=lambda kv: -sum(kv[1][:3])):
        print(f"{own:7.1f} {reaped:7.1f} {fk:7.1f} {int(n):4d}  {name}")
    _outside_tests(rows, sum(servers))


def _outside_tests(rows: list[dict], servers: float) -> None:
    """Per pytest process: own CPU to the end of collection, in its tests, in the session's
    teardown and the rest (the controller's is all rest: it runs no test under ``-n``)."""
    processes = [r for r in rows if "collected" in r]
    if not processes:
        return
    in_tests: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        if "test" in r and "own" in r:
            k = 1 if r["test"] == "(session teardown)" else 0
            in_tests[r.get("process", "main")][k] += r["own"]
            in_tests[r.get("process", "main")][2] += r["reaped"] if k else 0.0
    print(f"\n{'own':>7} {'collect':>7} {'tests':>7} {'teardn':>7} {'rest':>7}  process")
    outside = servers
    for r in sorted(processes, key=lambda r: r["process"]):
        tests, teardown, teardown_reaped = in_tests[r["process"]]
        rest = r["own"] - r["collected"][0] - tests - teardown
        outside += r["collected"][0] + rest + teardown + teardown_reaped
        print(f"{r['own']:7.1f} {r['collected'][0]:7.1f} {tests:7.1f} {teardown:7.1f} {rest:7.1f}"
              f"  {r['process']} (session teardown reaped {teardown_reaped:.1f})")  # fmt: skip
    print(f"outside any test: {outside:.1f} CPU-s (the fork servers' own CPU included)")
    whole = [r for r in processes if r["process"] == "main"]
    if whole and len(processes) > 1:
        total = whole[0]["own"] + whole[0]["reaped"]
        print(f"the whole run (the controller and all it reaped): {total:.1f} CPU-s")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
