"""CuPy's own compile path (``compiler._compile_module_with_cache``) through the installed backend, NVRTC real.

Without a driver, CuPy's compile stops at two calls only: ``_get_arch_for_options_for_nvrtc``
(it asks the device for its compute capability) and ``function.Module`` (it loads the cubin
into a context). Both are replaced here by what they do for an sm_90 device that NVRTC
supports (``('-arch=sm_90', 'cubin')``) and by a recorder of the cubin CuPy would load;
everything else is CuPy's: its names, its empty-file preprocess, its NVRTC compile, its
name-expressions payload and its calls to ``load``/``save``. The real launch is the GPU
host's (tests/gpu/test_cupy_gpu.py).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

pytest.importorskip("cupy", exc_type=ImportError)

from cupy.cuda import compiler  # noqa: E402
from cupy._core import core  # noqa: E402
from cupy_backends.cuda.libs import nvrtc  # noqa: E402

from tiered_progcache import cupy as tpc  # noqa: E402
from tiered_progcache.config import CacheConfig  # noqa: E402

SOURCE = '#include "scale.h"\ntemplate<typename T> __global__ void scale(T* x) { x[0] = SCALE_BY(x[0]); }\n'
NAME_EXPRESSIONS = ["scale<float>", "scale<double>"]


class LoadedModule:
    """What CuPy's ``function.Module`` is to the compile path: ``load(cubin)`` and ``_set_mapping``."""

    def __init__(self) -> None:
        self.cubin: bytes | None = None
        self.mapping: dict[str, str] | None = None

    def load(self, cubin: bytes) -> None:
        self.cubin = bytes(cubin)

    def _set_mapping(self, mapping: dict[str, str]) -> None:
        self.mapping = dict(mapping)


@pytest.fixture
def cupy_without_a_driver(monkeypatch):
    """CuPy's compile path with its two driver calls stood in for; counts NVRTC compiles (CuPy's preprocess apart)."""
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    monkeypatch.setattr(compiler, "function", types.SimpleNamespace(Module=LoadedModule))
    counts = {"nvrtc": 0, "preprocess": 0}
    compile_program, preprocess = nvrtc.compileProgram, compiler._preprocess

    def counted_compile(*args, **kwargs):
        counts["nvrtc"] += 1
        return compile_program(*args, **kwargs)

    def counted_preprocess(*args, **kwargs):
        counts["preprocess"] += 1
        return preprocess(*args, **kwargs)

    monkeypatch.setattr(nvrtc, "compileProgram", counted_compile)
    monkeypatch.setattr(compiler, "_preprocess", counted_preprocess)
    tpc.uninstall()
    tpc._reset_for_tests()
    yield counts
    chain = tpc._shared.if_built()
    tpc.uninstall()
    tpc._reset_for_tests()
    if chain is not None:
        chain.close()


def _compile(include: Path) -> LoadedModule:
    options = core.assemble_cupy_compiler_options(("-I" + str(include),))
    return compiler._compile_module_with_cache(SOURCE, options, arch="90", name_expressions=NAME_EXPRESSIONS)


def test_node_b_gets_node_a_s_module_with_no_nvrtc_kernel_compile_and_a_header_edit_is_a_miss(
    cupy_without_a_driver, tmp_path
):
    counts = cupy_without_a_driver
    include = tmp_path / "include"
    include.mkdir()
    (include / "scale.h").write_text("#define SCALE_BY(x) ((x) * 3)\n")
    remote = tmp_path / "remote"
    remote.mkdir()
    chain = CacheConfig(remote=f"file://{remote}", strict=True).build_shared(namespace=tpc.NAMESPACE)
    tpc.use_shared_cache(chain)

    assert tpc.install(tmp_path / "node-a")
    a = _compile(include)
    assert chain.flush(timeout=30)
    kernel_compiles = counts["nvrtc"] - counts["preprocess"]
    assert kernel_compiles == 1 and a.cubin is not None and a.cubin.startswith(b"\x7fELF")
    assert a.mapping == {"scale<float>": "_Z5scaleIfEvPT_", "scale<double>": "_Z5scaleIdEvPT_"}
    (name,) = os.listdir(tmp_path / "node-a")
    assert "-h" in name  # kept under its header-keyed name

    tpc.uninstall()
    assert tpc.install(tmp_path / "node-b")
    before = counts["nvrtc"] - counts["preprocess"]
    b = _compile(include)
    assert counts["nvrtc"] - counts["preprocess"] == before  # no NVRTC kernel compile on node B
    assert (b.cubin, b.mapping) == (a.cubin, a.mapping)
    assert os.listdir(tmp_path / "node-b") == [name]
    assert chain.stats()["remote"].hits == 1 and tpc.stats()["cupy-local"].writes == 1  # node A's save only

    (include / "scale.h").write_text("#define SCALE_BY(x) ((x) * 5)\n")
    edited = _compile(include)
    assert counts["nvrtc"] - counts["preprocess"] == before + 1  # the edit is a miss: compiled again
    assert edited.cubin != a.cubin and len(os.listdir(tmp_path / "node-b")) == 2
