"""Every name of CuPy this package relies on, imported in one place (CuPy's cache backend is private and experimental).

Pinned by ``tests/cupy/test_cupy_coupling.py`` against :data:`CHECKED_VERSIONS`; it fails
naming the symbol when a CuPy release moves one. :func:`check` says, before anything is
installed, whether this CuPy has the hook as we know it; where it does not, nothing is
touched. Importing this module imports CuPy (no GPU needed).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import cupy
from cupy.cuda import compiler
from cupy.cuda._compiler_cache import DiskKernelCacheBackend, KernelCacheBackend

__all__ = [
    "CHECKED_VERSIONS",
    "PRIVATE_SYMBOLS",
    "DiskKernelCacheBackend",
    "KernelCacheBackend",
    "check",
    "cupy_include_dirs",
    "current_backend",
    "set_backend",
    "unwrap_compile",
    "wrap_compile",
]

#: CuPy releases this package was checked against (the coupling test fails on any other).
CHECKED_VERSIONS = ("14.2.0",)

#: (module, name) of each CuPy symbol used, for the coupling test and :func:`check`.
PRIVATE_SYMBOLS = (
    ("cupy.cuda._compiler_cache", "KernelCacheBackend"),  # the ABC: load(name), save(name, cubin, source)
    ("cupy.cuda._compiler_cache", "DiskKernelCacheBackend"),  # CuPy's own, for a name we do not recognise
    ("cupy.cuda.compiler", "_set_kernel_cache_backend"),  # installs a backend
    ("cupy.cuda.compiler", "_kernel_cache_backend"),  # the one in use (what install replaces and uninstall restores)
    ("cupy.cuda.compiler", "_compile_with_cache_cuda"),  # wrapped: (source, options) of the compile a load belongs to
    ("cupy._core.core", "assemble_cupy_compiler_options"),  # the -I directories CuPy adds itself
)

_LOAD = ["self", "name"]
_SAVE = ["self", "name", "cubin", "source"]
_COMPILE_HEAD = ["source", "options"]


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def check() -> str | None:
    """None if this CuPy has the backend hook as checked; else what differs (then nothing may be installed)."""
    if not inspect.isabstract(KernelCacheBackend) or KernelCacheBackend.__abstractmethods__ != {"load", "save"}:
        return "cupy.cuda._compiler_cache.KernelCacheBackend is not the ABC of load and save"
    if _parameters(KernelCacheBackend.load) != _LOAD or _parameters(KernelCacheBackend.save) != _SAVE:
        return "KernelCacheBackend.load/save changed their parameters"
    for attr in ("_set_kernel_cache_backend", "_kernel_cache_backend"):
        if not hasattr(compiler, attr):
            return f"cupy.cuda.compiler has no {attr}"
    return None


def check_compile() -> str | None:
    """None if ``_compile_with_cache_cuda`` can be wrapped (header keys); else why not."""
    function = getattr(compiler, "_compile_with_cache_cuda", None)
    if function is None:
        return "cupy.cuda.compiler has no _compile_with_cache_cuda"
    if _parameters(getattr(function, "__wrapped__", function))[:2] != _COMPILE_HEAD:
        return "_compile_with_cache_cuda no longer takes (source, options, ...)"
    return None


def version() -> str:
    return str(cupy.__version__)


def current_backend() -> Any:
    """``cupy.cuda.compiler._kernel_cache_backend``."""
    return compiler._kernel_cache_backend


def set_backend(backend: Any) -> None:
    """``cupy.cuda.compiler._set_kernel_cache_backend(backend)``."""
    compiler._set_kernel_cache_backend(backend)


def wrap_compile(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``_compile_with_cache_cuda`` by ``make(original)`` (which sets ``__wrapped__``); once."""
    current = compiler._compile_with_cache_cuda
    if getattr(current, "__wrapped__", None) is None:
        compiler._compile_with_cache_cuda = make(current)


def unwrap_compile() -> None:
    """Put CuPy's ``_compile_with_cache_cuda`` back."""
    original = getattr(getattr(compiler, "_compile_with_cache_cuda", None), "__wrapped__", None)
    if original is not None:
        compiler._compile_with_cache_cuda = original


def cupy_include_dirs() -> tuple[str, ...]:
    """The ``-I`` directories CuPy adds to every compile (its bundled headers and CCCL, the toolkit's)."""
    from cupy._core import core

    options = core.assemble_cupy_compiler_options(())
    return tuple(opt[2:] for opt in options if isinstance(opt, str) and opt.startswith("-I") and len(opt) > 2)
