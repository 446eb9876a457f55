"""The package's shape, checked: a tier's identity is resolved in one place (docs/architecture.md).

Only the adapter asks ``isinstance`` (or ``issubclass``, ``type(x) is``) of a concrete store or
resource class: ``tier.py``, which adapts a tier's resource once when the tier is built,
``stores/coretiers.py``, the thin stores over cuda-core's keyed tiers, and
``tiered.as_chain`` / ``tiered.require_chain``, which tell a chain from a bare resource at the
public entry points. Everything else reads what those resolved (``tier.entries``,
``tier.local``, ``chain.local_store``, ``chain.shared_store``, ...). Checks against the
abstract interfaces (``ProgramCacheResource``, ``EntryStore``, ``LeaseStore``) are argument
validation and allowed anywhere.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import tiered_progcache

PACKAGE = Path(tiered_progcache.__file__).parent

#: The declared interfaces: asking about these is asking a declared capability.
INTERFACES = frozenset({"ProgramCacheResource", "EntryStore", "LeaseStore"})
#: cuda-core's concrete tiers (defined outside the package).
CUDA_CORE_TIERS = frozenset({"FileStreamProgramCache", "InMemoryProgramCache"})
#: Where identity is resolved: module -> the functions in it that may ask (None: the whole module).
ADAPTER: dict[str, frozenset[str] | None] = {
    "chain/tier.py": None,
    "stores/coretiers.py": None,
    "chain/tiered.py": frozenset({"as_chain", "require_chain"}),
}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def concrete_classes(modules: dict[str, ast.Module]) -> frozenset[str]:
    """Every class of the package that is (by its bases, transitively) a store or resource, plus cuda-core's."""
    bases: dict[str, set[str]] = {}
    for tree in modules.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))}  # fmt: skip
                bases.setdefault(node.name, set()).update(names)
    found = set(CUDA_CORE_TIERS)
    changed = True
    while changed:
        changed = False
        for name, parents in bases.items():
            if name not in found and parents & (found | INTERFACES):
                found.add(name)
                changed = True
    return frozenset(found - INTERFACES)


def _class_names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _class_names(elt)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def identity_checks(module: str, tree: ast.Module, concrete: frozenset[str]) -> list[str]:
    """``module:line function: isinstance(..., Class)`` for each type check on a concrete class outside the adapter."""
    allowed = ADAPTER.get(module, frozenset())
    if allowed is None:
        return []
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        checked: list[str] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            if len(node.args) == 2:
                checked = _class_names(node.args[1])
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            left = node.left
            if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "type":
                checked = [n for c in node.comparators for n in _class_names(c)]
        hits = [n for n in checked if n in concrete]
        if hits and function not in allowed:
            found.append(f"{module}:{node.lineno} {function}: {ast.unparse(node)}")  # type: ignore[attr-defined]
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_no_module_outside_the_adapter_asks_a_concrete_store_class():
    modules = _modules()
    concrete = concrete_classes(modules)
    offenders = [line for module, tree in modules.items() for line in identity_checks(module, tree, concrete)]
    assert offenders == [], "resolve identity in tier.py / tiered.as_chain instead:\n" + "\n".join(offenders)


def test_the_scan_knows_every_store_class_and_catches_a_planted_check():
    """The control: the class list is not empty by accident, and each form of the check is caught."""
    modules = _modules()
    concrete = concrete_classes(modules)
    assert {"TieredProgramCache", "LocalDir", "TritonDir", "SharedEntryStore", "RemoteProgramCache",
            "RedisProgramCache", "RemoteLeases", "RedisLeases", *CUDA_CORE_TIERS} <= concrete  # fmt: skip
    assert not concrete & INTERFACES
    planted = ast.parse(
        "def f(cache):\n"
        "    if isinstance(cache, TieredProgramCache): pass\n"
        "    if isinstance(cache, (int, utils.FileStreamProgramCache)): pass\n"
        "    if type(cache) is LocalDir: pass\n"
        "    if issubclass(type(cache), RedisProgramCache): pass\n"
        "    if isinstance(cache, EntryStore) or isinstance(cache, ProgramCacheResource): pass\n"
    )
    assert [line.split(" ", 1)[0] for line in identity_checks("compiling/compile.py", planted, concrete)] == [
        "compiling/compile.py:2", "compiling/compile.py:3", "compiling/compile.py:4", "compiling/compile.py:5",
    ]
    assert identity_checks("chain/tier.py", planted, concrete) == []  # the adapter may
    assert len(identity_checks("chain/tiered.py", planted, concrete)) == 4  # but in chain/tiered.py only as_chain/require_chain
    planted_in_as_chain = ast.parse("def as_chain(cache):\n    return isinstance(cache, TieredProgramCache)\n")
    assert identity_checks("chain/tiered.py", planted_in_as_chain, concrete) == []


def _documented_modules() -> set[str]:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `((?:[a-z_]+/)?[a-z_]+\.py)` \|", section, re.M))


def _docstring_only(path: Path) -> bool:
    """Whether a module holds nothing but its docstring (and ``from __future__`` imports)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    rest = [node for node in body[1:] if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    return bool(body) and ast.get_docstring(ast.Module(body=body[:1], type_ignores=[])) is not None and not rest


def _tree_modules() -> set[str]:
    """Every module of the package but the packages' own ``__init__`` that hold a docstring only."""
    package = Path(tiered_progcache.__file__).resolve().parent
    found = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        if "__pycache__" in relative.parts:
            continue
        if path.name == "__init__.py" and len(relative.parts) > 1 and _docstring_only(path):
            continue  # the package's concern, said in its docstring (its section's heading says it too)
        found.add(relative.as_posix())
    return found


def test_the_module_map_in_docs_architecture_matches_the_tree():
    documented, tree = _documented_modules(), _tree_modules()
    assert sorted(tree - documented) == [], "modules docs/architecture.md does not list"
    assert sorted(documented - tree) == [], "docs/architecture.md lists modules that do not exist"


def test_each_package_is_a_concern_with_its_own_docstring():
    package = Path(tiered_progcache.__file__).resolve().parent
    subpackages = sorted(p.parent.name for p in package.glob("*/__init__.py"))
    assert subpackages == ["chain", "cluster", "compiling", "cupy", "ops", "stores", "testing", "triton"]
    for name in subpackages:
        assert ast.get_docstring(ast.parse((package / name / "__init__.py").read_text(encoding="utf-8"))), name


# -- no exception as a value -----------------------------------------------------------------------

#: Where a third-party API hands exceptions back among its results, and the one function in each module
#: that sorts them there into a declared type (``BatchOutcome``, ``FetchedEnvelopes``, a raise).
EXCEPTIONS_HANDED_BACK: dict[str, frozenset[str]] = {
    "stores/runner.py": frozenset({"_many_async"}),  # asyncio.gather(return_exceptions=True)
    "stores/redis_store.py": frozenset({"_read_values", "_inspect_value", "_scan_step"}),  # raise_on_error=False
    "testing/delayproxy.py": frozenset({"shutdown"}),  # gather only to wait for cancelled tasks: results dropped
}
#: The keyword arguments that ask a library to return exceptions rather than raise them.
_HANDS_BACK = {("return_exceptions", True), ("raise_on_error", False), ("on_error", "return")}


def exception_classes(modules: dict[str, ast.Module]) -> frozenset[str]:
    """The builtin exception names and every class of the package that derives from one (by its bases, transitively)."""
    found = {name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)}
    bases = {node.name: {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}
             for tree in modules.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}  # fmt: skip
    changed = True
    while changed:
        changed = False
        for name, parents in bases.items():
            if name not in found and parents & found:
                found.add(name)
                changed = True
    return frozenset(found)


def _names_an_exception(node: ast.AST, exceptions: frozenset[str]) -> bool:
    """Whether annotation ``node`` holds an exception *instance* somewhere (``type[KeyError]``, a class, does not)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "type":
        return False
    if isinstance(node, ast.Name):
        return node.id in exceptions
    if isinstance(node, ast.Attribute):
        return node.attr in exceptions
    return any(_names_an_exception(child, exceptions) for child in ast.iter_child_nodes(node))


def _union_members(node: ast.AST) -> list[ast.AST] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return [*(_union_members(node.left) or [node.left]), *(_union_members(node.right) or [node.right])]
    if isinstance(node, ast.Subscript) and (node.value.id if isinstance(node.value, ast.Name) else "") in ("Union", "Optional"):
        members = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        return members + ([ast.Constant(None)] if node.value.id == "Optional" else [])  # type: ignore[attr-defined]
    return None


def exception_values(annotation: ast.AST, exceptions: frozenset[str]) -> list[str]:
    """The unions in ``annotation`` that carry an exception as a value: beside a result (``bytes | Exception``,
    ``tuple[str, bytes] | tuple[str, Exception]``), or optional inside a container (``dict[str, Exception | None]``).
    An optional cause on its own (``BaseException | None``) and a field of errors (``dict[str, Exception]``) are fine."""
    found: list[str] = []

    def visit(node: ast.AST, nested: bool) -> None:
        members = _union_members(node)
        if members is not None:
            errors = [m for m in members if _names_an_exception(m, exceptions)]
            others = [m for m in members if m not in errors and not (isinstance(m, ast.Constant) and m.value is None)]
            if errors and (others or nested):
                found.append(ast.unparse(node))
                return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
            visit(ast.parse(node.value, mode="eval").body, nested)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, nested or isinstance(node, ast.Subscript))

    visit(annotation, False)
    return found


def annotated_exception_values(module: str, tree: ast.Module, exceptions: frozenset[str]) -> list[str]:
    """``module:line: annotation`` for each return or value annotation (not a parameter's) that carries an exception as a value."""
    found = []
    for node in ast.walk(tree):
        annotation = node.returns if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
            node.annotation if isinstance(node, ast.AnnAssign) else None)  # fmt: skip
        if annotation is not None:
            found += [f"{module}:{node.lineno}: {union}" for union in exception_values(annotation, exceptions)]
    return found


def exceptions_asked_back(module: str, tree: ast.Module) -> list[str]:
    """``module:line function`` for each call asking a library to hand exceptions back, outside the named boundaries."""
    allowed = EXCEPTIONS_HANDED_BACK.get(module, frozenset())
    found: list[str] = []

    def visit(node: ast.AST, within: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            within = (*within, node.name)
        if isinstance(node, ast.Call) and not allowed & set(within):  # a function nested in a boundary is in it
            for keyword in node.keywords:
                if isinstance(keyword.value, ast.Constant) and (keyword.arg, keyword.value.value) in _HANDS_BACK:
                    found.append(f"{module}:{node.lineno} {'.'.join(within) or '<module>'}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, within)

    visit(tree, ())
    return found


def test_no_function_returns_or_holds_an_exception_as_a_value():
    """Results and failures are separate fields (``BatchRead``, ``BatchWrite``, ``BatchOutcome``, ``FetchedEnvelopes``),
    so no caller sorts values by type. The check reads annotations: a value typed ``Any`` is not seen, which is why
    the places a library hands exceptions back are named too (the next test)."""
    modules = _modules()
    exceptions = exception_classes(modules)
    offenders = [line for module, tree in modules.items() for line in annotated_exception_values(module, tree, exceptions)]
    assert offenders == [], "give results and failures separate fields:\n" + "\n".join(offenders)


def test_exceptions_handed_back_by_a_library_are_sorted_only_at_the_named_boundaries():
    modules = _modules()
    offenders = [line for module, tree in modules.items() for line in exceptions_asked_back(module, tree)]
    assert offenders == [], "sort them where they arrive, in one named function:\n" + "\n".join(offenders)
    for module, functions in EXCEPTIONS_HANDED_BACK.items():  # the list names what exists, and each still asks
        defined = {n.name for n in ast.walk(modules[module]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert functions <= defined, (module, functions - defined)
        assert len(exceptions_asked_back(module, modules[module])) == 0
        assert exceptions_asked_back("elsewhere.py", modules[module]), module


def test_the_exception_value_scans_catch_planted_ones():
    """The control: each form is caught, the allowed forms are not, and a package exception class counts."""
    exceptions = exception_classes(_modules())
    assert {"KeyError", "BaseException", "EntryRejected", "InvalidEnvelope", "TierUnavailable"} <= exceptions
    planted = ast.parse(
        "def a() -> bytes | Exception: ...\n"
        "def b() -> dict[str, bytes | memoryview | BaseException | None]: ...\n"
        "def c() -> dict[str, Exception | None]: ...\n"
        "def d() -> Iterator[tuple[int, bytes, None] | tuple[int, None, KeyError]]: ...\n"
        "x: list[Optional[InvalidEnvelope]] = []\n"
        "def e() -> 'Union[str, TierUnavailable]': ...\n"
        "def ok1() -> BaseException | None: ...\n"
        "def ok2() -> dict[str, Exception]: ...\n"
        "def ok3(failure: bytes | Exception) -> None: ...\n"
        "def ok4() -> type[Exception] | None: ...\n"
        "errors: dict[str, EntryRejected] = {}\n"
    )
    assert [line.split(":")[1] for line in annotated_exception_values("m.py", planted, exceptions)] == [
        "1", "2", "3", "4", "5", "6",
    ]
    asking = ast.parse(
        "async def f(x):\n"
        "    await asyncio.gather(*x, return_exceptions=True)\n"
        "    pipe.execute(raise_on_error=False)\n"
        "    fs.cat(paths, on_error='return')\n"
        "    await asyncio.gather(*x, return_exceptions=False)\n"
    )
    assert len(exceptions_asked_back("m.py", asking)) == 3
