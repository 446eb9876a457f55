"""Header keys CuPy lacks: the name of a kernel that reads headers through the user's ``-I`` directories.

CuPy's name covers the source, the options (so the directories' names), the NVRTC
version and CuPy's own bundled headers (``CUPY_CACHE_KEY``), never the files under a
``-I`` directory the user passed, so an edited header is served stale (CuPy #1785).
Here such a kernel's name becomes :func:`~tiered_progcache.cupy.cupynames.header_name`
of CuPy's name and the digest :func:`tiered_progcache.compiling.headerscan.header_scan`
gives (the resolution and digests ``compile()`` uses: every header the compile could
read under those directories, ``#if`` ignored, computed includes resolved through the
``-D`` macros). The directories CuPy adds itself (its bundled CCCL and headers, the
toolkit's ``include``) are CuPy's to key and are not scanned; an include found only
there counts by its spelling. Pure and thread-safe; the scan is memoized by headerscan
(a warm call costs a stat per header).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

from .cupynames import header_name

__all__ = ["KeyedName", "keyed_name", "user_header_options"]

_INCLUDE = ("-I", "--include-path")
_DEFINE = ("-D", "--define-macro")
_PRE_INCLUDE = ("-include", "--pre-include")
_ARCH_FOR_OPTIONS = "sm_80"  # ProgramOptions needs an arch (else it asks the driver); the scan ignores it


class KeyedName(str):
    """The name an entry is kept under: CuPy's, or its header-keyed second name; ``declined`` says why none."""

    declined: str | None = None


def _values(options: Sequence[str], flags: tuple[str, str]) -> list[str]:
    """Every value of ``flags`` (short, long) in NVRTC options: ``-Ix``, ``-I x``, ``-I=x``, ``--long=x``, ``--long x``."""
    short, long = flags
    out: list[str] = []
    it = iter(options)
    for opt in it:
        if not isinstance(opt, str):
            continue
        for flag in (long, short):
            if opt == flag:
                out.append(next(it, ""))
                break
            if opt.startswith(flag + "="):
                out.append(opt[len(flag) + 1 :])
                break
            if flag == short and short != "-include" and opt.startswith(short) and not opt.startswith("--"):
                out.append(opt[len(short) :])
                break
    return [v for v in out if v]


def user_header_options(
    options: Sequence[str], cupy_dirs: Collection[str]
) -> tuple[list[str], list[str], list[str | tuple[str, str]]]:
    """(include dirs, pre-includes, macros) of ``options`` that are the user's: CuPy's own ``-I`` directories left out."""
    own = {os.path.normpath(d) for d in cupy_dirs}
    dirs = [d for d in _values(options, _INCLUDE) if os.path.normpath(d) not in own]
    macros: list[str | tuple[str, str]] = []
    for d in _values(options, _DEFINE):
        name, eq, value = d.partition("=")
        macros.append((name, value) if eq else name)
    return dirs, _values(options, _PRE_INCLUDE), macros


def keyed_name(name: str, source: str, options: Sequence[str], cupy_dirs: Collection[str]) -> KeyedName:
    """The name CuPy entry ``name`` (compiled from ``source`` with ``options``) is kept under.

    CuPy's own where the options name no directory or pre-include of the user's; else
    its header-keyed second name; a :class:`KeyedName` with ``declined`` set where the
    scan cannot bound what the compile reads (such a kernel is never cached).
    """
    dirs, pre_includes, macros = user_header_options(options, cupy_dirs)
    if not dirs and not pre_includes:
        return KeyedName(name)
    from cuda.core import ProgramOptions

    from ..compiling.headerscan import header_scan

    scan_options = ProgramOptions(
        arch=_ARCH_FOR_OPTIONS, include_path=dirs or None, pre_include=pre_includes or None, define_macro=macros or None
    )
    scan = header_scan(source, scan_options)
    if scan.declined is not None:
        declined = KeyedName(name)
        declined.declined = scan.declined
        return declined
    return KeyedName(header_name(name, scan.digest or b""))
