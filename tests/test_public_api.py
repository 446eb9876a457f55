"""The public names are the documented ones (docs/architecture.md, "Public names"), each the object of the module
the table names; the lazy ones load on first use, and the package imports without the remote stack until asked."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiered_progcache
from tiered_progcache.settings import DEFAULT_MAX_MEMORY_BYTES


def _documented() -> dict[str, tuple[str, str]]:
    """``{name: (module, loaded)}`` from the table of docs/architecture.md's "Public names" section."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("\n## Public names\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([\w/]+)\.py` \| (at import|lazy) \|$", section, re.M)
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), "a name listed twice"
    return {name: ("tiered_progcache." + path.replace("/", "."), loaded) for name, path, loaded in rows}


def test_all_is_exactly_the_documented_list():
    assert len(tiered_progcache.__all__) == len(set(tiered_progcache.__all__))
    assert sorted(tiered_progcache.__all__) == sorted(_documented())


@pytest.mark.parametrize("name", sorted(_documented()))
def test_each_public_name_is_the_object_its_documented_module_defines(name):
    module, _ = _documented()[name]
    value = getattr(tiered_progcache, name)
    assert value is getattr(importlib.import_module(module), name)
    if name == "DEFAULT_MAX_MEMORY_BYTES":
        assert value == DEFAULT_MAX_MEMORY_BYTES == 256 << 20
    else:
        assert (value.__module__, value.__name__) == (module, name)  # defined there, not re-exported from elsewhere


def test_star_import_gives_the_documented_names_and_an_unknown_one_is_an_attribute_error():
    namespace: dict[str, object] = {}
    exec("from tiered_progcache import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(_documented())
    with pytest.raises(AttributeError, match="^module 'tiered_progcache' has no attribute 'NoSuchName'$"):
        tiered_progcache.NoSuchName  # noqa: B018


def test_lazy_names_resolve_on_first_use_to_their_class_and_the_import_loads_no_remote_stack():
    """In a fresh interpreter: a lazy name is not bound by the import (``__getattr__`` resolves it on first use, to
    the class its row names), and neither fsspec nor redis-py is loaded until a lazy name is used."""
    lazy = {name: module for name, (module, loaded) in _documented().items() if loaded == "lazy"}
    assert sorted(lazy) == ["CacheConfig", "RedisProgramCache", "RemoteProgramCache", "TransferReport"]
    code = (
        "import json, sys, tiered_progcache as t\n"
        "lazy = json.loads(sys.argv[1])\n"
        "bound = sorted(n for n in lazy if n in vars(t))\n"
        "stack = sorted(m for m in ('fsspec', 'redis') if m in sys.modules)\n"
        "got = {n: [getattr(t, n).__module__, getattr(t, n).__name__] for n in lazy}\n"
        "print(json.dumps([bound, stack, got]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(lazy)], check=True, capture_output=True, text=True)
    bound, stack, got = json.loads(out.stdout)
    assert (bound, stack) == ([], [])
    assert got == {name: [module, name] for name, module in lazy.items()}


def test_plain_import_leaves_fsspec_unloaded():
    code = "import sys, tiered_progcache; print('fsspec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_a_local_only_chain_and_its_config_leave_fsspec_unloaded(tmp_path):
    """Checking the settings of a chain without a remote never reaches for the remote stack."""
    code = (
        "import sys, tiered_progcache as t\n"
        "cache = t.TieredProgramCache(sys.argv[1]); t.CacheConfig.from_env({})\n"
        "print('fsspec' in sys.modules, t.stores_of(cache).shared)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False None"
