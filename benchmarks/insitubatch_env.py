"""The predecessor's venv: ``benchmarks/.venv-insitubatch`` with ``insitubatch==0.2.0``.

insitubatch 0.2.0 needs Python >= 3.12 (this project's venv is 3.11), so the harness makes a
venv of its own with the first Python 3.12+ it finds — ``$BENCH_PYTHON312``, pyenv's
``versions/3.12.*`` (under ``~/.pyenv`` or ``pyenv root``), ``python3.12`` / ``python3.13`` on
PATH — installs the pinned version from PyPI into it and checks that it imports. The venv is
built in a temporary folder and renamed when it works, so an interrupted install never leaves a
half-made venv behind; a ready venv is reused (a marker file records the version).

:func:`ensure` returns ``(python, None)`` or ``(None, reason)``: the reason is what the harness
prints and records when it skips the engine (no Python 3.12, no network, a failed install).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["VERSION", "ensure", "find_python312"]

VERSION = "0.2.0"
VENV = Path(__file__).resolve().parent / ".venv-insitubatch"
MARKER = ".bench-insitubatch-ok"


def _version_ok(python: str) -> bool:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == "True"


def _candidates() -> list[str]:
    found: list[str] = []
    if os.environ.get("BENCH_PYTHON312"):
        found.append(os.environ["BENCH_PYTHON312"])
    roots = [Path.home() / ".pyenv"]
    if os.environ.get("PYENV_ROOT"):
        roots.append(Path(os.environ["PYENV_ROOT"]))
    pyenv = shutil.which("pyenv")
    if pyenv:
        try:
            out = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                roots.append(Path(out.stdout.strip()))
        except (OSError, subprocess.SubprocessError):
            pass
    for root in roots:
        found += sorted(glob.glob(str(root / "versions" / "3.12.*" / "bin" / "python3.12")))
    for name in ("python3.12", "python3.13"):
        path = shutil.which(name)
        if path:
            found.append(path)
    for root in roots:
        found += sorted(glob.glob(str(root / "versions" / "3.13.*" / "bin" / "python3.13")))
    return list(dict.fromkeys(found))


def find_python312() -> str | None:
    """The first interpreter >= 3.12 that actually runs (pyenv shims may not)."""
    for candidate in _candidates():
        if _version_ok(candidate):
            return candidate
    return None


def _check(python: Path) -> str | None:
    code = f"import insitubatch, zarr, obstore; assert insitubatch.__version__ == {VERSION!r}"
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"insitubatch venv does not run: {exc}"
    if out.returncode != 0:
        return f"insitubatch {VERSION} does not import: {out.stderr.strip()[-500:]}"
    return None


def ensure(venv: Path = VENV, log: bool = True) -> tuple[str | None, str | None]:
    """``(python, None)`` of a working venv with insitubatch, or ``(None, why not)``."""
    python = venv / "bin" / "python"
    marker = venv / MARKER
    if marker.is_file() and marker.read_text().strip() == VERSION and _check(python) is None:
        return str(python), None
    base = find_python312()
    if base is None:
        return None, (
            "no Python >= 3.12 found (tried $BENCH_PYTHON312, pyenv versions/3.12.*, "
            "python3.12/python3.13 on PATH); insitubatch 0.2.0 needs one"
        )
    tmp = venv.with_name(f"{venv.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if log:
        print(f"[bench] creating {venv.name} with {base} and pip install insitubatch=={VERSION}")
    steps = [
        [base, "-m", "venv", str(tmp)],
        [
            str(tmp / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"insitubatch=={VERSION}",
        ],
    ]
    for step in steps:
        try:
            out = subprocess.run(step, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"could not build the insitubatch venv ({' '.join(step[:3])}): {exc}"
        if out.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = "\n".join(
                line for line in out.stderr.splitlines() if not line.startswith("WARNING:")
            )[-800:]
            return None, f"could not install insitubatch=={VERSION} (network/PyPI?): {tail}"
    problem = _check(tmp / "bin" / "python")
    if problem:
        shutil.rmtree(tmp, ignore_errors=True)
        return None, problem
    (tmp / MARKER).write_text(VERSION)
    shutil.rmtree(venv, ignore_errors=True)
    os.replace(tmp, venv)
    return str(python), None
