"""Every CuPy name tiered_progcache.cupy relies on, pinned to the CuPy releases it was checked against.

CuPy calls its cache-backend interface experimental and private; this fails, naming the
symbol, when a CuPy release moves or changes one, and when CuPy's own disk format stops
being the one ``cupynames`` writes.
"""

from __future__ import annotations

import hashlib
import importlib
import os

import pytest

cupy = pytest.importorskip("cupy", exc_type=ImportError)

from tiered_progcache.cupy import _cupyprivate  # noqa: E402
from tiered_progcache.cupy.cupydir import DEFAULT_DIR, read_local, write_local  # noqa: E402
from tiered_progcache.cupy.cupynames import decode_local, encode_local  # noqa: E402


def test_the_installed_cupy_is_a_checked_release():
    assert cupy.__version__ in _cupyprivate.CHECKED_VERSIONS, (
        f"CuPy {cupy.__version__} is not among the releases tiered_progcache.cupy was checked against "
        f"{_cupyprivate.CHECKED_VERSIONS}: rerun tests/cupy and the GPU check, then add it"
    )


@pytest.mark.parametrize("module, name", _cupyprivate.PRIVATE_SYMBOLS, ids=[".".join(s) for s in _cupyprivate.PRIVATE_SYMBOLS])
def test_each_cupy_name_used_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


def test_the_hook_is_as_checked():
    assert _cupyprivate.check() is None
    assert _cupyprivate.check_compile() is None


def test_our_local_format_is_cupy_s_disk_backend_s_both_ways(tmp_path):
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend, _default_cache_dir

    assert os.path.expanduser(DEFAULT_DIR) == _default_cache_dir
    theirs = DiskKernelCacheBackend(str(tmp_path))
    payload = b"\x7fELF" + bytes(range(256))
    assert encode_local(payload) == theirs._encode_cubin(payload)
    assert decode_local(theirs._encode_cubin(payload)) == payload
    theirs.save("a" * 40 + ".cubin", payload, "src")
    assert read_local(tmp_path, "a" * 40 + ".cubin") == payload
    write_local(tmp_path, "b" * 40 + ".cubin", payload)
    assert theirs.load("b" * 40 + ".cubin") == payload


def test_cupy_names_its_entries_as_cupynames_expects():
    """CuPy's name is a SHA-1 hex and an extension (what ``cupynames.is_name`` accepts, and ``cupydir`` lists)."""
    import inspect

    from cupy.cuda import compiler

    source = inspect.getsource(compiler._compile_with_cache_cuda)
    assert "name = _hash_hexdigest(key_src) + ('.ltoir' if to_ltoir else '.cubin')" in source
    assert "_kernel_cache_backend.load(name)" in source and "_kernel_cache_backend.save(name, payload, source)" in source
    assert len(hashlib.sha1(b"").hexdigest()) == 40


def test_cupy_s_name_expressions_payload_is_opaque_to_us_and_tagged_by_cupy():
    from cupy.cuda import compiler

    assert compiler._cache_payload_magic == b"\x93CUPYNE\x00"  # the payload CuPy stores with name expressions
    payload = compiler._encode_cache_payload(["_Z1fv"], b"\x7fELF")
    assert compiler._decode_cache_payload(decode_local(encode_local(payload)), 1) == (["_Z1fv"], b"\x7fELF")
