"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

The conventions (also in docs/development.md, *Code blocks in the docs are tests*):

* The blocks of one file run in order, in one namespace, in a new process (forked from the
  tests' fork server, ``tests/forkserver.py``: nothing of the test process's state) whose working
  directory is an empty temporary folder: a block may use what an earlier block of its file
  defined (``docs/pipeline.md`` builds its store in its first block and uses it after).
* ``<!-- doctest-setup ... -->`` — an HTML comment (invisible on the rendered page) holding
  Python that runs before the file's first block: it defines the names the prose takes as given
  (``store``, ``manifest``, ``model``, ...). It may use ``DOC_STORE``, the path of a small
  ERA5-like store written by :func:`insitubatch_nodes.synthetic.make_era5_like` (``t2m`` and
  ``z``) for the file, and ``DOC_DIR``, the working directory.
* :data:`STAND_INS` replaces, in every block, a literal that names a resource a test machine
  lacks (a bucket, a GPU, an NVMe mount) with what stands in for it. Each stand-in must still
  occur in the docs (a test checks), so a rewritten example does not leave a dead one behind.
* ``<!-- doctest: skip REASON -->`` on the line before a block leaves that block out, for the
  few blocks that are illustrative only; the reason is required, and :data:`SKIPPED_AT_MOST`
  bounds how many there are.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import forkserver
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# literal in a block -> what runs instead (resources a test machine lacks)
STAND_INS: dict[str, str] = {
    'open_store("s3://bucket/era5.zarr", region="us-east-1")': "open_store(DOC_STORE)",
    '"s3://bucket/era5.zarr"': "DOC_STORE",
    'store_options={"region": "us-east-1"}': "store_options=None",
    '"/mnt/nvme/era5/v3"': 'str(DOC_DIR / "cache-v3")',
}
SKIPPED_AT_MOST = 3

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_SETUP = re.compile(r"<!--\s*doctest-setup\s*\n(.*?)-->", re.S)
_SKIP = re.compile(r"<!--\s*doctest:\s*skip\b(.*?)-->")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the block's first line of code
    code: str
    skip: str | None  # the reason, when marked


def blocks_of(doc: Path) -> list[Block]:
    text = doc.read_text()
    out = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start(1)) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        reason = skip.group(1).strip() if skip else None
        out.append(Block(doc, line, match.group(1), reason))
    return out


def setup_of(doc: Path) -> str:
    return "\n".join(textwrap.dedent(m.group(1)) for m in _SETUP.finditer(doc.read_text()))


def stand_in(code: str) -> str:
    for literal, replacement in STAND_INS.items():
        code = code.replace(literal, replacement)
    return code


# runs in the child: setup, then each block compiled under its doc's name and line numbers
_RUNNER = """
import json, sys
from pathlib import Path
spec = json.loads(Path(sys.argv[1]).read_text())
ns = {"__name__": "__doc_example__", "DOC_STORE": spec["store"], "DOC_DIR": Path(spec["dir"])}
exec(compile(spec["setup"], spec["doc"] + " (doctest-setup)", "exec"), ns)
for line, code in spec["blocks"]:
    exec(compile("\\n" * (line - 1) + code, spec["doc"], "exec"), ns)
    print(f"ran {spec['doc']}:{line}", flush=True)
"""


# one worker runs the module: the docs' store (4,096 steps, 1.6 CPU-s to write) is written
# once, not once per worker
pytestmark = pytest.mark.xdist_group("docs")


@pytest.fixture(scope="module")
def doc_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from insitubatch_nodes.synthetic import make_era5_like

    root = tmp_path_factory.mktemp("docs") / "era5.zarr"
    make_era5_like(root, n_time=4096, n_lat=8, n_lon=16, n_level=2, samples_per_chunk=16)
    return root


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_python_block_of_the_doc_runs(doc: Path, doc_store: Path, tmp_path: Path) -> None:
    blocks = [b for b in blocks_of(doc) if b.skip is None]
    if not blocks:
        pytest.skip(f"{doc.name} has no python block to run")
    spec = {
        "doc": str(doc.relative_to(ROOT)),
        "store": str(doc_store),
        "dir": str(tmp_path),
        "setup": setup_of(doc),
        "blocks": [(b.line, stand_in(b.code)) for b in blocks],
    }
    spec_file = tmp_path.parent / f"{tmp_path.name}.doc-spec.json"  # not in the doc's folder
    spec_file.write_text(json.dumps(spec))
    run = forkserver.run(
        [sys.executable, "-c", _RUNNER, str(spec_file)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=540,
    )
    assert run.returncode == 0, (
        f"a python block of {spec['doc']} failed (its line is in the traceback):\n"
        + run.stdout[-2000:]
        + run.stderr[-6000:]
    )
    assert run.stdout.count("\nran ") + run.stdout.startswith("ran ") == len(blocks)


def test_skipped_blocks_are_few_and_say_why() -> None:
    skipped = [b for doc in DOCS for b in blocks_of(doc) if b.skip is not None]
    for block in skipped:
        assert len(block.skip or "") >= 10, f"{block.doc.name}:{block.line}: say why it is skipped"
    assert len(skipped) <= SKIPPED_AT_MOST, [f"{b.doc.name}:{b.line}" for b in skipped]


def test_every_stand_in_still_occurs_in_the_docs() -> None:
    code = "\n".join(b.code for doc in DOCS for b in blocks_of(doc))
    unused = [literal for literal in STAND_INS if literal not in code]
    assert not unused, f"stand-ins no doc uses any more (remove them): {unused}"


def test_the_block_extraction_finds_setup_skips_and_line_numbers(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# t\n<!-- doctest-setup\nx = 1\n-->\n```python\nprint(x)\n```\n"
        "<!-- doctest: skip needs a GPU, none here -->\n```python\nimport cupy\n```\n"
    )
    first, second = blocks_of(doc)
    assert (first.line, first.code, first.skip) == (6, "print(x)\n", None)
    assert second.skip == "needs a GPU, none here"
    assert setup_of(doc).strip() == "x = 1"
