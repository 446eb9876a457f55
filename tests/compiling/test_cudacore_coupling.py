"""Every private cuda-core name we use still exists where we import it from.

When a cuda-core release moves one, this fails naming the symbol, instead of the
package failing somewhere far from the cause.
"""

from __future__ import annotations

import importlib
import os

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import _cudacore


@pytest.mark.parametrize(("module", "name"), _cudacore.PRIVATE_SYMBOLS, ids=lambda v: v)
def test_private_symbol_still_exists(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"cuda-core moved {module}.{name}: update tiered_progcache/_cudacore.py"


def test_file_cache_root_is_the_directory_it_was_opened_on(tmp_path) -> None:
    with FileStreamProgramCache(tmp_path / "c") as cache:
        assert _cudacore.file_cache_root(cache) == tmp_path / "c"


def test_memory_cache_bytes_is_the_payload_total() -> None:
    cache = InMemoryProgramCache()
    cache[b"a"] = b"123"
    cache[b"b"] = b"4567"
    assert _cudacore.memory_cache_bytes(cache) == 7
    del cache[b"a"]
    assert _cudacore.memory_cache_bytes(cache) == 4


def test_stat_identity_is_inode_size_mtime_ns(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"xy")
    st = os.stat(path)
    assert _cudacore.stat_identity(st) == (st.st_ino, 2, st.st_mtime_ns)


def test_key_and_value_normalisation_match_cuda_core() -> None:
    assert _cudacore.as_key_bytes("k") == b"k"
    assert _cudacore.extract_bytes(memoryview(b"v")) == b"v"
    with pytest.raises(TypeError):
        _cudacore.as_key_bytes(1)
    with pytest.raises(TypeError):
        _cudacore.extract_bytes(1)


def test_no_other_module_imports_cuda_core_privately() -> None:
    package = os.path.dirname(_cudacore.__file__)
    offenders = []
    for folder, _, files in os.walk(package):
        for file in files:
            if file.endswith(".py") and file != "_cudacore.py":
                text = open(os.path.join(folder, file), encoding="utf-8").read()
                if "cuda.core.utils._program_cache" in text or "cuda.core._" in text:
                    offenders.append(file)
    assert offenders == []


def test_key_schema_version_is_a_positive_int() -> None:
    version = _cudacore.key_schema_version()
    assert type(version) is int and version >= 1
