"""No import cycles in tiered_progcache, function-level imports included.

Every module under ``tiered_progcache/`` (subpackages too) is parsed with ``ast``; each
``import`` and ``from ... import`` anywhere in it (module level, in a function, in a
``try``) is an edge, except under ``if TYPE_CHECKING:``, which never runs. Relative
imports are resolved the way Python resolves them (``from ..stores import remote`` is
the submodule ``stores.remote``; ``from . import x`` is the submodule ``x`` where there is
one, else a name of the package), and importing ``a.b.c`` also imports the packages
``a.b`` on the way that the importer is not inside already. A lazy import of another
module of the package is allowed only where it breaks no cycle (it defers import cost);
a cycle fails the test, naming each import in it by file and line.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import graphlib
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tiered_progcache"


@dataclasses.dataclass(frozen=True)
class Import:
    """One edge: module ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path.name}:{self.line})"


def modules(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``), for every ``.py`` under ``package_dir``."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, *, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that can run, and whether it is inside a function; ``if TYPE_CHECKING:`` bodies left out."""
    stack = [(tree, in_function)]
    while stack:
        node, inside = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, inside
            continue
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        inside = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inside) for child in children)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node: ast.Import | ast.ImportFrom, package: str, known: Mapping[str, object]) -> list[str]:
    """The package's modules one import statement names (a name of a module: that module)."""
    root = next(iter(known)).split(".")[0]
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        if node.level:
            base = package.split(".")
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        named = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
    targets = []
    for target in named:
        if target.split(".")[0] != root:
            continue  # the standard library or a third-party package
        while target not in known:  # ``import tiered_progcache.x.y`` names modules; a name in one names it
            target = target.rpartition(".")[0]
        targets.append(target)
    return targets


def imports(package_dir: Path, *, lazy_only: bool = False) -> list[Import]:
    """Every import of one module of the package by another (see the module docstring for what counts).

    ``lazy_only``: only those inside functions, and without the packages on the way.
    """
    known = modules(package_dir)
    edges = []
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        inside = {name, *_ancestors(name)}  # already being imported whenever this module runs
        for node, in_function in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            if lazy_only and not in_function:
                continue
            for target in _targets(node, package, known):
                for imported in [target] if lazy_only else [*_ancestors(target), target]:
                    if imported not in inside:
                        edges.append(Import(name, imported, path, node.lineno))
    return edges


@functools.cache
def _package_imports(lazy_only: bool = False) -> tuple[Import, ...]:
    """The package's own graph, parsed once per test run."""
    return tuple(imports(PACKAGE_DIR, lazy_only=lazy_only))


def find_cycle(edges: list[Import]) -> list[Import] | None:
    """One import cycle as its edges in order (``a -> b``, ``b -> a``), or None if the graph has none."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())  # node -> what it needs first: its imports
    except graphlib.CycleError as exc:
        nodes = exc.args[1][::-1]  # graphlib lists each node before the one that needs it; we want importer first
        first = {}
        for edge in edges:
            first.setdefault((edge.source, edge.target), edge)
        return [first[(a, b)] for a, b in zip(nodes, nodes[1:])]
    return None


def find_cycles(edges: list[Import]) -> list[list[Import]]:
    """Cycles until none is left, each found after cutting one import of those before (so each one is reported)."""
    cycles = []
    while (cycle := find_cycle(edges)) is not None:
        cycles.append(cycle)
        cut = (cycle[0].source, cycle[0].target)
        edges = [edge for edge in edges if (edge.source, edge.target) != cut]
    return cycles


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(list(_package_imports()))
    if cycles:
        pytest.fail("import cycles:\n" + "\n".join("  cycle:\n" + "".join(f"    {edge}\n" for edge in cycle)
                                                  for cycle in cycles), pytrace=False)  # fmt: skip


def test_the_graph_sees_lazy_imports_and_leaves_out_type_checking_ones():
    """Not vacuous: a function-level import is an edge, a TYPE_CHECKING one is not, and the graph is the whole package."""
    edges = {(e.source, e.target) for e in _package_imports()}
    assert ("tiered_progcache.chain.tiered", "tiered_progcache.chain.transfer") in edges  # inside TieredProgramCache.warm
    assert ("tiered_progcache.chain.exitreport", "tiered_progcache.chain.tiered") not in edges  # only under TYPE_CHECKING
    assert ("tiered_progcache", "tiered_progcache.compiling.compile") in edges
    assert any(source.startswith("tiered_progcache.testing.") for source, _ in edges)  # subpackages are read
    assert len({source for source, _ in edges}) >= 40


#: The ops/ modules chain/ may import: none. ops/transfer.py (warm, push, the boot fetch's batch) is chain/transfer.py;
#: the exit report (chain/exitreport.py), once chain/tiered.py -> ops/runstats.py -> chain/, is no longer one.
CHAIN_MAY_IMPORT_FROM_OPS: frozenset[str] = frozenset()


def chain_imports_of_ops(edges: list[Import], allowed: frozenset[str] = CHAIN_MAY_IMPORT_FROM_OPS) -> list[Import]:
    """Imports by a chain/ module of an ops/ module (function-level ones included) not in ``allowed``."""
    chain, ops = "tiered_progcache.chain", "tiered_progcache.ops"
    return [e for e in edges if (e.source == chain or e.source.startswith(chain + "."))
            and e.target.startswith(ops + ".") and e.target not in allowed]  # fmt: skip


def test_chain_imports_nothing_from_ops_and_the_allowed_modules_import_nothing_from_chain():
    """chain/ is below ops/: the exit report lives in chain/, and ops/runstats.py only reads what it wrote."""
    edges = list(_package_imports())
    offenders = chain_imports_of_ops(edges)
    assert not offenders, "chain/ imports ops/:\n  " + "\n  ".join(map(str, offenders))
    for allowed in sorted(CHAIN_MAY_IMPORT_FROM_OPS | {"tiered_progcache.ops"}):
        back = [str(e) for e in edges if e.source == allowed and e.target.startswith("tiered_progcache.chain")]
        assert not back, f"{allowed} is imported by chain/ and imports it: " + ", ".join(back)
    pairs = {(e.source, e.target) for e in edges}
    assert ("tiered_progcache.ops.runstats", "tiered_progcache.chain.stats") in pairs  # ops/ reads down
    assert ("tiered_progcache.chain.tiered", "tiered_progcache.chain.exitreport") in pairs


def test_the_checker_finds_a_function_level_import_of_ops_from_chain(tmp_path):
    root = _package(tmp_path, {
        "chain/tiered.py": "def __init__(self):\n    if True:\n        from ..ops.runstats import register\n",
        "chain/bootfetch.py": "def f():\n    from . import transfer\n",
        "chain/transfer.py": "", "ops/runstats.py": "",
    })  # fmt: skip
    found = chain_imports_of_ops(imports(root))
    assert [(e.source, e.target, e.line) for e in found] == [
        ("tiered_progcache.chain.tiered", "tiered_progcache.ops.runstats", 3)]


def test_the_former_cycles_stay_broken():
    """config <-> tiered, compile <-> explain, settings -> the backends it configures: each edge of the old cycles."""
    edges = {(e.source, e.target) for e in _package_imports()}
    pkg = "tiered_progcache."
    assert (pkg + "tiered", pkg + "config") not in edges
    assert (pkg + "explain", pkg + "compile") not in edges
    for backend in ("remote", "redis_store", "localdir", "tiered"):
        assert (pkg + "settings", pkg + backend) not in edges


# -- the checker itself, on packages laid out as the lead's move will lay them out ---------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "tiered_progcache"
    for relative, text in {"__init__.py": "", **files}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    return root


@pytest.mark.parametrize(
    "files, cycle",
    [
        pytest.param(
            {"chain/__init__.py": "", "chain/tiered.py": "def build():\n    from ..stores import remote\n",
             "stores/__init__.py": "", "stores/remote.py": "from ..chain.tiered import X\n"},
            ["chain.tiered", "stores.remote"], id="function-level-parent-relative",
        ),
        pytest.param(
            {"compile/__init__.py": "", "compile/compile.py": "from . import explain\n",
             "compile/explain.py": "def f():\n    from .compile import check\n"},
            ["compile.compile", "compile.explain"], id="from-dot-import-submodule",
        ),
        pytest.param(
            {"a.py": "import tiered_progcache.b\n", "b.py": "from tiered_progcache import a\n"},
            ["a", "b"], id="absolute",
        ),
        pytest.param(
            {"stores/__init__.py": "from .remote import Remote\n", "stores/remote.py": "class Remote: ...\n",
             "chain/__init__.py": "", "chain/tiered.py": "from ..stores.remote import Remote\n",
             "stores/localdir.py": "from ..chain.tiered import T\n",
             "stores/remote_more.py": ""},
            None, id="a-package-init-re-export-is-no-cycle",
        ),
        pytest.param(
            {"stores/__init__.py": "from .localdir import LocalDir\n", "stores/localdir.py": "LocalDir = 1\n",
             "chain/__init__.py": "", "chain/tiered.py": "from ..stores.localdir import LocalDir\n",
             "stores/remote.py": "from ..chain import tiered\n", "stores/extra.py": "from . import remote\n"},
            None, id="siblings-through-a-package",
        ),
        pytest.param(
            {"stores/__init__.py": "from .remote import Remote\n",
             "stores/remote.py": "from ..chain.tiered import T\nclass Remote: ...\n",
             "chain/__init__.py": "", "chain/tiered.py": "from ..stores.localdir import L\nT = 1\n",
             "stores/localdir.py": "L = 1\n"},
            ["chain.tiered", "stores", "stores.remote"], id="through-a-package-init",
        ),
        pytest.param(
            {"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nelse:\n    B = None\n",
             "b.py": "import typing\nfrom .a import A\nif typing.TYPE_CHECKING:\n    from . import a\n"},
            None, id="type-checking-only",
        ),
        pytest.param(
            {"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n    from .b import B\n",
             "b.py": "from .a import A\n"},
            ["a", "b"], id="the-else-of-type-checking-runs",
        ),
    ],
)
def test_the_checker_finds_each_kind_of_cycle(tmp_path, files, cycle):
    found = find_cycle(imports(_package(tmp_path, files)))
    if cycle is None:
        assert found is None, found
    else:
        assert found is not None
        assert sorted({edge.source.removeprefix("tiered_progcache.") for edge in found}) == cycle
        assert found[0].source == found[-1].target  # a closed loop, each edge an import that is there
        assert all(a.target == b.source for a, b in zip(found, found[1:]))



def pointless_lazy_imports(package_dir: Path) -> list[Import]:
    """Imports inside functions of a module the same file imports at module level anyway."""
    real = package_dir == PACKAGE_DIR
    lazy = _package_imports(True) if real else imports(package_dir, lazy_only=True)
    every = _package_imports() if real else imports(package_dir)
    lazy_lines = {(e.source, e.target, e.line) for e in lazy}
    at_top = {(e.source, e.target) for e in every if (e.source, e.target, e.line) not in lazy_lines}
    return [edge for edge in lazy if (edge.source, edge.target) in at_top]


def test_no_function_level_import_of_what_the_module_imports_at_the_top():
    """A lazy import of a module the file imports at module level anyway defers nothing: it only hides the edge."""
    pointless = pointless_lazy_imports(PACKAGE_DIR)
    assert not pointless, "lazy imports of modules imported at the top already:\n  " + "\n  ".join(map(str, pointless))


def test_the_checker_finds_a_pointless_lazy_import(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from .b import one\n\ndef f():\n    from .b import two\n    from .c import three\n",
        "b.py": "one = two = 1\n", "c.py": "three = 3\n",
    })  # fmt: skip
    assert [(e.target, e.line) for e in pointless_lazy_imports(root)] == [("tiered_progcache.b", 4)]
