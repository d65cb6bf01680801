"""The package's shape: which folder may import what, concrete imports, no cycles, small modules.

The rules are read from the source with :mod:`ast`, without importing the package (only the
tests of the top-level face import it). A dependency is a dependency wherever its import
statement sits: every rule counts every import, at module level, inside a function or under
``if TYPE_CHECKING:`` (an import moved into a function or under ``TYPE_CHECKING`` hides a cycle
from Python, not from a reader).

An import names the module it loads: ``from insitubatch_nodes.cache import lock`` names
``insitubatch_nodes.cache.lock``; ``from insitubatch_nodes.cache import ChunkCache`` names the
face ``insitubatch_nodes.cache``. The parent packages Python runs on the way to a module are
not counted as imports.

The scanner takes a root folder, so the last tests plant each kind of violation in a small
package under ``tmp_path`` and check that the rule finds it.
"""

from __future__ import annotations

import ast
import functools
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "insitubatch_nodes"

# one worker runs the module: the package is parsed once (scan's cache is per process)
pytestmark = pytest.mark.xdist_group("layout")

# The top-level face, as written in insitubatch_nodes/__init__.py.
FACE = [
    "ArrayGeometry",
    "Batch",
    "BatchTransform",
    "CacheOptions",
    "ChunkTransform",
    "Coarsen",
    "Collection",
    "DecodedChunk",
    "EpochReport",
    "FetchOptions",
    "Forcings",
    "InSituPipeline",
    "Loader",
    "PlanConfig",
    "RetryPolicy",
    "SplitManifest",
    "Stack",
    "StandardScaler",
    "Statistics",
    "__version__",
    "applies",
    "as_dataset",
    "concat",
    "fit_statistics",
    "insitu_pipeline",
    "open_geometries",
    "open_images",
    "open_plate",
    "open_store",
    "split_by_chunk",
    "split_by_member",
    "stack",
    "to_item",
    "to_torch",
]

MAX_LINES = 700  # the hard guard; the aim is about 600
NOT_RUNTIME = {"synthetic", "testing", "demo", "cli"}  # helpers and tools, not runtime modules

# a) Who may import torchdata.
TORCHDATA_ALLOWED = ["stages", "torch_data", "lightning", "pipeline"]
# b) What sits below the stages, and what it must not import.
BELOW_STAGES = [
    "plan",
    "cache",
    "io",
    "pool",
    "slots",
    "lending",
    "options",
    "errors",
    "report",
    "recorder",
    "trace",
    "batch",
    "transforms",
    "_checks",
    "_process",
    "_runtime",
    "_pages",
]
ABOVE = ["stages", "pipeline", "torch_data", "lightning"]
# g) The stages' order, top-down as a batch flows: a module of stages/ imports only modules of
# its own level or below (a stage never imports one above it). Private helpers sit at the level
# of the stage they serve; what every stage shares (the context, the batch buffers, the state
# key) sits with the read plan, which the context is made from.
STAGE_LEVELS = {
    "read_plan": 0,
    "context": 0,
    "buffers": 0,
    "_graph": 0,
    "_ranges": 0,
    "_wiring": 0,
    "_resume": 0,
    "_memrule": 0,
    "fetch": 1,
    "_admit": 1,
    "_jobs": 1,
    "_fill": 1,
    "_spares": 1,
    "_bad": 1,
    "_get": 1,
    "_direct": 1,
    "resident": 2,
    "gather": 3,
    "_select": 3,
    "_windows": 3,
    "prefetch": 4,
    "loader": 5,
}


# ---------------------------------------------------------------------------------------------
# The scanner
# ---------------------------------------------------------------------------------------------


MODULE_LEVEL, IN_FUNCTION, TYPE_ONLY = "module level", "in a function", "under TYPE_CHECKING"


@dataclass(frozen=True)
class Import:
    """One module named by one import statement."""

    target: str  # the module loaded, dotted ("torchdata.nodes", "insitubatch_nodes.pool")
    line: int
    where: str  # "module level", "in a function" or "under TYPE_CHECKING"
    name: str | None = None  # for `from target import name` where name is not a module


@dataclass
class Module:
    name: str  # dotted
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int
    imports: list[Import] = field(default_factory=list)


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement in ``node``, with where it sits."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, where
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for stmt in node.body:
            yield from _imports(stmt, TYPE_ONLY)
        for stmt in node.orelse:
            yield from _imports(stmt, where)
    else:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            where = where if where == TYPE_ONLY else IN_FUNCTION
        for child in ast.iter_child_nodes(node):
            yield from _imports(child, where)


def _resolve_from(node: ast.ImportFrom, module: Module) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


@functools.cache  # read-only to every rule: the package is parsed once per process, not per rule
def scan(root: Path) -> dict[str, Module]:
    """Every module of the package in ``root``, with the imports it makes."""
    modules: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        name, is_package = _module_name(path, root)
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        modules[name] = Module(name, path, is_package, tree, len(text.splitlines()))
    for module in modules.values():
        for node, where in _imports(module.tree, MODULE_LEVEL):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module.imports.append(Import(alias.name, node.lineno, where))
                continue
            source = _resolve_from(node, module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    module.imports.append(Import(submodule, node.lineno, where))
                else:
                    module.imports.append(Import(source, node.lineno, where, alias.name))
    return modules


def _under(dotted: str, prefix: str) -> bool:
    return dotted == prefix or dotted.startswith(prefix + ".")


def _in(dotted: str, package: str, members: list[str]) -> bool:
    return any(_under(dotted, f"{package}.{member}") for member in members)


def _say(module: Module, imp: Import, root: Path) -> str:
    what = imp.target if imp.name is None else f"{imp.name} from {imp.target}"
    return f"{module.path.relative_to(root.parent)}:{imp.line} imports {what} ({imp.where})"


# ---------------------------------------------------------------------------------------------
# The rules: each returns its violations, one sentence each
# ---------------------------------------------------------------------------------------------


def torchdata_outside_stages(root: Path) -> list[str]:
    """a) torchdata only under stages/, and in torch_data, lightning and the builder."""
    modules = scan(root)
    return [
        _say(module, imp, root)
        for module in modules.values()
        if not _in(module.name, root.name, TORCHDATA_ALLOWED)
        for imp in module.imports
        if _under(imp.target, "torchdata")
    ]


def lower_layers_importing_the_stages(root: Path) -> list[str]:
    """b) plan/, cache/, io/ and the support modules never import the stages or what uses them
    (nor the top-level face, which imports the builder)."""
    modules = scan(root)
    return [
        _say(module, imp, root)
        for module in modules.values()
        if _in(module.name, root.name, BELOW_STAGES)
        for imp in module.imports
        if _in(imp.target, root.name, ABOVE) or imp.target == root.name
    ]


def plan_and_io_reaching_up(root: Path) -> list[str]:
    """c) plan/ is pure: no pool, slots, cache, threads or event loop; io/ knows nothing of
    plan/, cache/ or the pool."""
    forbidden = {
        "plan": lambda t: (
            _in(t, root.name, ["pool", "slots", "cache"])
            or any(_under(t, m) for m in ("threading", "concurrent", "asyncio"))
        ),
        "io": lambda t: _in(t, root.name, ["plan", "cache", "pool", "slots"]),
    }
    modules = scan(root)
    return [
        _say(module, imp, root)
        for folder, bad in forbidden.items()
        for module in modules.values()
        if _in(module.name, root.name, [folder])
        for imp in module.imports
        if bad(imp.target)
    ]


def imports_from_a_face(root: Path) -> list[str]:
    """d) a name is imported from the module that defines it, never through a package's face."""
    modules = scan(root)
    return [
        _say(module, imp, root) + ": import it from its module"
        for module in modules.values()
        for imp in module.imports
        if imp.name is not None and imp.target in modules and modules[imp.target].is_package
    ]


def _assigns_all(stmt: ast.stmt) -> ast.expr | None:
    """The value of ``__all__ = [...]`` (or ``__all__: list[str] = [...]``), else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0], stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        target, value = stmt.target, stmt.value
    else:
        return None
    return value if isinstance(target, ast.Name) and target.id == "__all__" else None


def faces_doing_more_than_reexport(root: Path) -> list[str]:
    """d) a folder's __init__.py holds a docstring, `from ... import ...` and `__all__` only,
    and every name it imports is in its `__all__`."""
    problems = []
    for module in scan(root).values():
        if not module.is_package or module.name == root.name:
            continue
        where = module.path.relative_to(root.parent)
        listed: set[str] = set()
        imported: dict[str, int] = {}
        body = module.tree.body
        if ast.get_docstring(module.tree, clean=False) is not None:
            body = body[1:]
        for stmt in body:
            if isinstance(stmt, ast.ImportFrom) and all(a.name != "*" for a in stmt.names):
                if stmt.module != "__future__":
                    imported.update({a.asname or a.name: stmt.lineno for a in stmt.names})
            elif (value := _assigns_all(stmt)) is not None:
                listed = set(ast.literal_eval(value))
            else:
                problems.append(
                    f"{where}:{stmt.lineno} holds a {type(stmt).__name__} statement: a face "
                    "holds only its docstring, from-imports and __all__"
                )
        problems += [
            f"{where}:{line} imports {name} but does not list it in __all__"
            for name, line in imported.items()
            if name not in listed
        ]
    return problems


def import_cycles(root: Path) -> list[str]:
    """e) the cycles among the package's modules, through every import (at module level, in a
    function or under ``if TYPE_CHECKING:``); each as ``a:12 -> b:30 -> a``, where ``a:12`` is
    the line of ``a`` that imports ``b``."""
    modules = scan(root)
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}
    for module in modules.values():
        for imp in module.imports:
            if imp.target in modules:
                edges[module.name].setdefault(imp.target, imp.line)
    cycles = []
    for component in _strongly_connected(edges):
        start = min(component)
        if len(component) == 1 and start not in edges[start]:
            continue
        path = _cycle_through(start, component, edges)
        steps = [f"{a}:{edges[a][b]}" for a, b in itertools.pairwise(path)]
        cycles.append(" -> ".join([*steps, path[-1]]))
    return cycles


def _strongly_connected(edges: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _cycle_through(start: str, component: set[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in component and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a cycle without a path back to itself")


def stages_importing_upward(root: Path) -> list[str]:
    """g) a module of stages/ imports one above it in the stages' order (:data:`STAGE_LEVELS`:
    read_plan -> fetch -> resident -> gather -> prefetch), or has no place in that order."""
    folder = f"{root.name}.stages"
    modules = scan(root)

    def level(name: str) -> int | None:
        return STAGE_LEVELS.get(name.rpartition(".")[2])

    problems = []
    for module in modules.values():
        if not _under(module.name, folder) or module.is_package:
            continue
        mine = level(module.name)
        if mine is None:
            problems.append(
                f"{module.path.relative_to(root.parent)} has no place in the stages' order: "
                "add it to STAGE_LEVELS"
            )
            continue
        for imp in module.imports:
            theirs = level(imp.target) if _under(imp.target, folder) else None
            if theirs is not None and theirs > mine:
                problems.append(_say(module, imp, root) + ", a stage above it")
    return problems


def long_modules(root: Path) -> list[str]:
    """f) runtime modules over MAX_LINES lines."""
    return [
        f"{module.path.relative_to(root.parent)}: {module.lines} lines"
        for module in scan(root).values()
        if not _in(module.name, root.name, sorted(NOT_RUNTIME)) and module.lines > MAX_LINES
    ]


# ---------------------------------------------------------------------------------------------
# The package holds them
# ---------------------------------------------------------------------------------------------


def _listed(problems: list[str]) -> str:
    return "\n  " + "\n  ".join(problems)


def test_only_the_stages_the_builder_and_the_adapters_import_torchdata() -> None:
    problems = torchdata_outside_stages(ROOT)
    assert not problems, "torchdata imported outside stages/:" + _listed(problems)


def test_plan_cache_io_and_the_support_modules_never_import_the_stages() -> None:
    problems = lower_layers_importing_the_stages(ROOT)
    assert not problems, "a lower layer imports the stages or above:" + _listed(problems)


def test_plan_is_pure_numpy_and_io_knows_nothing_of_plan_cache_or_pool() -> None:
    problems = plan_and_io_reaching_up(ROOT)
    assert not problems, "plan/ or io/ imports above itself:" + _listed(problems)


def test_modules_import_names_from_the_module_that_defines_them_not_from_a_face() -> None:
    problems = imports_from_a_face(ROOT)
    assert not problems, "imports through a package face:" + _listed(problems)


def test_a_folder_face_holds_only_a_docstring_reexports_and_all() -> None:
    problems = faces_doing_more_than_reexport(ROOT)
    assert not problems, "a folder's __init__.py does more than re-export:" + _listed(problems)


def test_no_two_modules_import_each_other_even_through_others() -> None:
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles (any import, wherever it sits):" + _listed(cycles)


def test_no_stage_imports_a_stage_above_it() -> None:
    problems = stages_importing_upward(ROOT)
    assert not problems, "stages/ imports against the flow of a batch:" + _listed(problems)


def test_no_runtime_module_is_over_700_lines() -> None:
    problems = long_modules(ROOT)
    assert not problems, f"modules over {MAX_LINES} lines (aim for ~600):" + _listed(problems)


# ---------------------------------------------------------------------------------------------
# The top-level face (imports the package)
# ---------------------------------------------------------------------------------------------


def test_the_top_level_face_is_the_sorted_list_of_twenty_names() -> None:
    import insitubatch_nodes

    assert list(insitubatch_nodes.__all__) == FACE, "the face changed: update FACE on purpose"
    assert sorted(FACE) == FACE, "__all__ is kept sorted"


def test_every_name_on_the_face_imports_without_a_warning() -> None:
    import insitubatch_nodes

    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in insitubatch_nodes.__all__:
            try:
                getattr(insitubatch_nodes, name)
            except (AttributeError, Warning) as err:
                missing.append(f"{name}: {err!r}")
    assert not missing, "names on the face that do not import cleanly:" + _listed(missing)


# ---------------------------------------------------------------------------------------------
# Each rule finds a planted violation
# ---------------------------------------------------------------------------------------------

GOOD = {
    "__init__.py": '"""A face."""\nfrom pkg.stages.prefetch import Node\n__all__ = ["Node"]\n',
    "stages/__init__.py": (
        '"""Nodes."""\nfrom pkg.stages.prefetch import Node\n__all__ = ["Node"]\n'
    ),
    "stages/prefetch.py": "import torchdata.nodes\nfrom pkg.plan import epoch\n",
    "plan/__init__.py": '"""Plans."""\n',
    "plan/epoch.py": "import numpy as np\nfrom pkg.io.geometry import Geometry\n",
    "io/__init__.py": '"""IO."""\n',
    "io/geometry.py": "class Geometry:\n    pass\n",
    "pool.py": "import threading\nfrom pkg.plan.epoch import np\nfrom pkg import batch\n",
    "batch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n",
    "stages/read_plan.py": "from pkg.plan import epoch\n",
    "stages/fetch.py": "from pkg.stages.read_plan import x\n",
    "stages/gather.py": "from typing import TYPE_CHECKING\nfrom pkg.stages import fetch\n",
}

PLANTED: list[tuple[Callable[[Path], list[str]], dict[str, str], str]] = [
    (
        torchdata_outside_stages,
        {"pool.py": "def f():\n    import torchdata\n"},
        "pool.py:2 imports torchdata",
    ),
    (
        torchdata_outside_stages,
        {"plan/epoch.py": "from torchdata.nodes import X\n"},
        "X from torchdata.nodes",
    ),
    (
        lower_layers_importing_the_stages,
        {
            "io/geometry.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg.stages.prefetch import Node\n"
        },
        "geometry.py:3 imports Node from pkg.stages.prefetch (under TYPE_CHECKING)",
    ),
    (lower_layers_importing_the_stages, {"pool.py": "from pkg import pipeline\n"}, "pipeline"),
    (plan_and_io_reaching_up, {"plan/epoch.py": "import concurrent.futures\n"}, "concurrent"),
    (plan_and_io_reaching_up, {"plan/epoch.py": "from .. import pool\n"}, "pkg.pool"),
    (plan_and_io_reaching_up, {"io/geometry.py": "from pkg.plan import epoch\n"}, "pkg.plan"),
    (imports_from_a_face, {"pool.py": "from pkg.stages import Node\n"}, "Node from pkg.stages"),
    (imports_from_a_face, {"plan/epoch.py": "from pkg import Node\n"}, "Node from pkg "),
    (faces_doing_more_than_reexport, {"io/__init__.py": '"""IO."""\nX = 1\n'}, "Assign"),
    (
        faces_doing_more_than_reexport,
        {"io/__init__.py": "from pkg.io.geometry import Geometry\n__all__ = []\n"},
        "Geometry",
    ),
    (
        import_cycles,
        {"io/geometry.py": "from pkg.pool import x\n"},
        "pkg.io.geometry:1 -> pkg.pool:2 -> pkg.plan.epoch:2 -> pkg.io.geometry",
    ),
    (  # a cycle hidden under TYPE_CHECKING still counts
        import_cycles,
        {"batch.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.pool import X\n"},
        "pkg.batch:3 -> pkg.pool:3 -> pkg.batch",
    ),
    (  # and so does one hidden inside a function
        import_cycles,
        {"batch.py": "def f():\n    from pkg.pool import Y\n"},
        "pkg.batch:2 -> pkg.pool:3 -> pkg.batch",
    ),
    (
        stages_importing_upward,
        {"stages/fetch.py": "def f():\n    from pkg.stages.gather import G\n"},
        "fetch.py:2 imports G from pkg.stages.gather (in a function), a stage above it",
    ),
    (
        stages_importing_upward,
        {"stages/read_plan.py": "from pkg.stages import fetch\n"},
        "read_plan.py:1 imports pkg.stages.fetch (module level), a stage above it",
    ),
    (stages_importing_upward, {"stages/helper.py": "x = 1\n"}, "helper.py has no place"),
    (long_modules, {"plan/epoch.py": "x = 1\n" * (MAX_LINES + 1)}, "epoch.py: 701 lines"),
]


def _plant(tmp_path: Path, changes: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {**GOOD, **changes}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("rule", sorted({r for r, _, _ in PLANTED}, key=lambda r: r.__name__))
def test_each_rule_passes_a_package_that_keeps_it(
    rule: Callable[[Path], list[str]], tmp_path: Path
) -> None:
    assert rule(_plant(tmp_path, {})) == []


@pytest.mark.parametrize(
    ("rule", "changes", "expected"),
    PLANTED,
    ids=[f"{r.__name__}-{i}" for i, (r, _, _) in enumerate(PLANTED)],
)
def test_each_rule_finds_a_planted_violation(
    rule: Callable[[Path], list[str]], changes: dict[str, str], expected: str, tmp_path: Path
) -> None:
    problems = rule(_plant(tmp_path, changes))
    assert any(expected in p for p in problems), problems


def test_no_script_folder_holds_a_module_named_like_the_standard_librarys() -> None:
    # a script run from benchmarks/ or recipes/ has its own folder first on sys.path: a
    # benchmarks/collections.py once shadowed the stdlib's `collections` and broke every
    # benchmark engine run as a script
    for folder in ("benchmarks", "recipes"):
        names = {p.stem for p in (ROOT.parent / folder).glob("*.py")}
        assert not names & sys.stdlib_module_names, (folder, names & sys.stdlib_module_names)
