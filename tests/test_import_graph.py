"""No import cycles in tiered_progcache, and imports that point down the layers only, function-level imports included.

Every module under ``tiered_progcache/`` (subpackages too) is parsed with ``ast``; each
``import`` and ``from ... import`` anywhere in it (module level, in a function, in a
``try``) is an edge, except under ``if TYPE_CHECKING:``, which never runs. Relative
imports are resolved the way Python resolves them (``from ..stores import remote`` is
the submodule ``stores.remote``; ``from . import x`` is the submodule ``x`` where there is
one, else a name of the package), and importing ``a.b.c`` also imports the packages
``a.b`` on the way that the importer is not inside already. A lazy import of another
module of the package is allowed only where it breaks no cycle (it defers import cost);
a cycle fails the test, naming each import in it by file and line.

The packages are layers (:data:`LAYERS`, low to high: the top-level helpers, ``stores/``,
``chain/``, ``config``, ``cluster/``, ``compiling/``, ``triton/`` and ``cupy/``, ``ops/``,
then what users import); a module imports only its own layer and those below, so a low
module can be read, tested and moved without the ones above it.
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


def imports(package_dir: Path, *, lazy_only: bool = False, root_names: bool = False) -> list[Import]:
    """Every import of one module of the package by another (see the module docstring for what counts).

    ``lazy_only``: only those inside functions, and without the packages on the way.
    ``root_names``: also a name taken from the top package's ``__init__`` (``from .. import compile``) by a module
    below it: never a cycle (the top package is being imported already), but a use of the facade, for the layer rule.
    """
    known = modules(package_dir)
    root = package_dir.name
    edges = []
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        inside = {name, *_ancestors(name)}  # already being imported whenever this module runs
        for node, in_function in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            if lazy_only and not in_function:
                continue
            for target in _targets(node, package, known):
                for imported in [target] if lazy_only else [*_ancestors(target), target]:
                    if imported not in inside or (root_names and imported == target == root != name):
                        edges.append(Import(name, imported, path, node.lineno))
    return edges


@functools.cache
def _package_imports(lazy_only: bool = False, root_names: bool = False) -> tuple[Import, ...]:
    """The package's own graph, parsed once per test run."""
    return tuple(imports(PACKAGE_DIR, lazy_only=lazy_only, root_names=root_names))


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
    assert ("tiered_progcache.cupy", "tiered_progcache.config") in edges  # inside a function of cupy/__init__.py
    assert ("tiered_progcache.chain.exitreport", "tiered_progcache.chain.tiered") not in edges  # only under TYPE_CHECKING
    assert ("tiered_progcache", "tiered_progcache.compiling.compile") in edges
    assert any(source.startswith("tiered_progcache.testing.") for source, _ in edges)  # subpackages are read
    assert len({source for source, _ in edges}) >= 40


#: The layers, low to high: a module imports only modules of its own layer or a lower one (function-level imports
#: too; TYPE_CHECKING ones never run). A module's layer is its own entry, else its subpackage's; a module in none
#: fails the test (a new module is placed here). Within a layer, the cycle test above is the rule.
LAYERS: tuple[tuple[str, frozenset[str], str], ...] = tuple((name, frozenset(f"tiered_progcache{m}" for m in members), why)
                                                            for name, members, why in [  # fmt: skip
    ("helpers", {"._cudacore", ".settings", ".settingsdoc", ".errors", ".forks", ".hooks", ".redact", ".units", ".urls",
                 ".configfile", ".configvalues", ".samples", ".version"},
     "what every package may import: the settings table, cuda-core's calls and small helpers"),
    ("stores", {".stores"}, "where entries live, and how a stored entry is framed, named and told apart"),
    ("chain", {".chain"}, "the tiers in order over the stores, their policies (the flight policy's too), bulk transfer"),
    ("config", {".config"}, "CacheConfig: the settings resolved, and build(), which makes the chain"),
    ("cluster", {".cluster"}, "compile once per cluster, on a chain"),
    ("compiling", {".compiling"}, "one compile: its key, headers, manifests, through the chain and the cluster"),
    ("backends", {".triton", ".cupy"}, "Triton's and CuPy's caches on the same tiers (nothing of ops/)"),
    ("ops", {".ops"}, "what operators run, over all of the above (the CLI also lists Triton's and CuPy's directories)"),
    ("faces", {"", ".__main__", ".metrics", ".testing"},
     "what users import or run: the package's names, python -m, tiered_progcache.metrics, the test kit; none imported"),
])

#: Imports known to point up, each a (importer, imported) pair: none left. Listed here, one would not fail the test.
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()


def layer_of(module: str, layers: tuple[tuple[str, frozenset[str], str], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of ``module``'s layer: its own entry, else its nearest subpackage's (not the top one's)."""
    for name in [module, *_ancestors(module)[:0:-1]]:
        for index, (_, members, _) in enumerate(layers):
            if name in members:
                return index
    return None


def upward_imports(edges: list[Import], layers: tuple[tuple[str, frozenset[str], str], ...] = LAYERS) -> list[Import]:
    """Imports of a module of a higher layer than the importer's."""
    return [e for e in edges if (layer_of(e.source, layers) or 0) < (layer_of(e.target, layers) or 0)]


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in modules(PACKAGE_DIR) if layer_of(name) is None)
    assert not unplaced, "modules LAYERS does not place: " + ", ".join(unplaced)


def test_imports_point_down_only():
    """No module imports one of a higher layer (LAYERS), at the top or inside a function."""
    edges = list(_package_imports(root_names=True))
    upward = [e for e in upward_imports(edges) if (e.source, e.target) not in KNOWN_UPWARD]
    assert not upward, "imports of a higher layer:\n  " + "\n  ".join(
        f"{e}  [{LAYERS[layer_of(e.source) or 0][0]} -> {LAYERS[layer_of(e.target) or 0][0]}]" for e in upward)
    pairs = {(e.source, e.target) for e in edges}
    gone = sorted(KNOWN_UPWARD - pairs)
    assert not gone, f"KNOWN_UPWARD lists imports that are gone: {gone}"
    assert ("tiered_progcache.ops.runstats", "tiered_progcache.chain.stats") in pairs  # ops/ reads down
    assert ("tiered_progcache.cluster.flightpolicy", "tiered_progcache.chain.policy") in pairs  # the re-export
    assert ("tiered_progcache.compiling.manifest", "tiered_progcache.stores.kinds") in pairs  # formats live low


def test_the_checker_finds_a_function_level_import_of_ops_from_chain(tmp_path):
    root = _package(tmp_path, {
        "chain/tiered.py": "def __init__(self):\n    if True:\n        from ..ops.runstats import register\n",
        "chain/bootfetch.py": "def f():\n    from . import transfer\n",
        "chain/transfer.py": "from ..stores.store import entry_name\n", "stores/store.py": "",
        "ops/runstats.py": "from ..chain.stats import Stats\n", "chain/stats.py": "",
    })  # fmt: skip
    found = upward_imports(imports(root, root_names=True))
    assert [(e.source, e.target, e.line) for e in found] == [
        ("tiered_progcache.chain.tiered", "tiered_progcache.ops", 3),
        ("tiered_progcache.chain.tiered", "tiered_progcache.ops.runstats", 3)]


@pytest.mark.parametrize(
    "files, found",
    [
        pytest.param({"stores/kinds.py": "from ..compiling.manifest import MANIFEST_FORMAT\n", "compiling/manifest.py": ""},
                     [("stores.kinds", "compiling"), ("stores.kinds", "compiling.manifest")], id="top-level-absolute-up"),
        pytest.param({"chain/tiered.py": "import tiered_progcache.cluster.flightpolicy\n", "cluster/flightpolicy.py": ""},
                     [("chain.tiered", "cluster"), ("chain.tiered", "cluster.flightpolicy")], id="import-statement"),
        pytest.param({"settings.py": "def f():\n    from .chain import tiered\n", "chain/tiered.py": ""},
                     [("settings", "chain"), ("settings", "chain.tiered")], id="a-helper-reaching-up"),
        pytest.param({"compiling/compile.py": "def f():\n    from .. import TieredProgramCache\n"},
                     [("compiling.compile", "")], id="a-name-of-the-facade"),
        pytest.param({"configfile.py": "", "config.py": "from .chain.tiered import T\n", "chain/tiered.py": "",
                      "ops/cli.py": "from ..config import C\nfrom ..cupy import cupydir\n", "cupy/cupydir.py": ""},
                     [], id="config-above-chain-and-backends-below-ops"),
        pytest.param({"stores/kinds.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..ops import cli\n",
                      "ops/cli.py": ""}, [], id="type-checking-only"),
    ],
)
def test_the_checker_finds_each_kind_of_upward_import(tmp_path, files, found):
    edges = upward_imports(imports(_package(tmp_path, files), root_names=True))
    assert sorted((e.source, e.target) for e in edges) == sorted(
        (f"tiered_progcache.{a}".rstrip("."), f"tiered_progcache.{b}".rstrip(".")) for a, b in found)


def test_the_layer_of_a_module_is_its_own_else_its_subpackages():
    assert LAYERS[layer_of("tiered_progcache.stores.kinds") or 0][0] == "stores"
    assert LAYERS[layer_of("tiered_progcache.config") or 0][0] == "config"
    assert LAYERS[layer_of("tiered_progcache.configvalues") or 0][0] == "helpers"  # not config's: its own entry
    assert LAYERS[layer_of("tiered_progcache") or 0][0] == "faces"
    assert layer_of("tiered_progcache.newhelper") is None  # the top package's layer is not inherited
    assert layer_of("tiered_progcache.newpackage.module") is None


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
