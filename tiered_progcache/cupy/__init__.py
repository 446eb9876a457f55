"""CuPy's kernel cache on the program cache's shared tiers: CuPy's own directory first, the cluster behind it.

Install it once per process, before the first kernel compiles::

    import tiered_progcache.cupy
    tiered_progcache.cupy.install()

CuPy (14.2; experimental and private there, so checked before use) lets one
``KernelCacheBackend`` serve every compile. This one keeps CuPy's directory
(``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) exactly as CuPy writes it, and
stands the shared tiers ``TIERED_PROGCACHE_*`` configure behind it
(:meth:`~tiered_progcache.config.CacheConfig.build_shared`, namespace ``cupy``:
``<url>/cupy/<2 hex>/<62 hex>``, Redis ``<prefix>:cupy:<name>``), so the envelope,
signing, request door, deadline and breaker, background upload, fail-open and stats
are the program cache's own. Kernels whose options carry the user's ``-I`` directories
are kept under a second name that covers those headers
(:mod:`tiered_progcache.cupy.headerkeys`): a header edit is a miss.

CuPy names used (:mod:`tiered_progcache.cupy._cupyprivate`, pinned by a test):
``cupy.cuda._compiler_cache.KernelCacheBackend``, ``cupy.cuda.compiler._set_kernel_cache_backend``,
``cupy.cuda.compiler._kernel_cache_backend``, ``cupy.cuda.compiler._compile_with_cache_cuda``
(wrapped, to see the options a load belongs to) and ``cupy._core.core.assemble_cupy_compiler_options``.
Fail-open: without CuPy, or where the hook is missing or changed, :func:`install` changes
nothing, logs one warning and returns False; CuPy runs with its own cache.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..chain.stats import CacheStats, CompileTally, CompileTotals, TierCounters
from ..config import ProcessSharedChain
from .cupynames import FRAME_MAGIC, KEY_PREFIX, NAMESPACE, cache_key, describe, frame, header_name, name_of

__all__ = [
    "FRAME_MAGIC",
    "KEY_PREFIX",
    "NAMESPACE",
    "cache_key",
    "describe",
    "frame",
    "header_name",
    "install",
    "installed",
    "name_of",
    "report",
    "shared_cache",
    "stats",
    "uninstall",
    "use_shared_cache",
]

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_shared = ProcessSharedChain(NAMESPACE, log=logger, label="CuPy cache", alone="CuPy's directory")
_local = TierCounters()
_NO_TALLY = CompileTally()  # CuPy's compiles are its saves (``_local.writes``), not a tally's
_previous: Any = None  # CuPy's backend before install
_installed: Any = None  # ours, while installed
_warned = False
_exit_report: Any = None  # the installed backend's exitreport.Source (reports what is new since its last report)


def shared_cache() -> Any:
    """The chain of shared tiers CuPy's entries go to (a ``TieredProgramCache``), or None if no remote is set.

    Built once per process on first need from ``TIERED_PROGCACHE_*`` (a bad setting is
    logged and the backend runs on CuPy's directory alone: a cache never fails a compile).
    """
    return _shared.get()


def use_shared_cache(cache: Any) -> None:
    """Make ``cache`` (a ``TieredProgramCache`` of shared tiers, or None) the one CuPy's entries go to.

    >>> use_shared_cache(CacheConfig.from_env(remote="s3://kernels/cupy").build_shared(namespace="cupy"))

    For applications that build their chain in code, and for tests; the previous one is not closed.
    """
    _shared.use(cache)


def stats() -> CacheStats:
    """CuPy's counters: ``cupy-local`` (CuPy's directory), then each shared tier's.

    ``cupy-local``: ``hits``/``misses`` are loads the directory answered or not, ``writes``
    the payloads CuPy saved (its compiles), ``skipped`` the compiles not cached because
    their headers could not be keyed.
    """
    return _shared.stats("cupy-local", _local.snapshot())


def _counts() -> Any:
    """CuPy's counts as an exit report carries them: ``cupy-local`` and the shared tiers; its saves are its compiles."""
    from ..chain.exitreport import Counts, tier_counts

    chain = _shared.if_built()
    tiers = [("cupy-local", _local), *((t.name, t.counters) for t in (chain.tiers if chain is not None else ()))]
    counted = tier_counts(tiers, _NO_TALLY)
    backend = _installed
    seconds = backend.compile_seconds if backend is not None else 0.0
    return Counts(counted.tiers, CompileTotals(_local.writes, seconds), {})  # CuPy's entries carry no compile time


def report() -> None:
    """Append what CuPy's cache did since the last report to ``<CuPy's directory>/stats.jsonl``.

    The exit report (:mod:`tiered_progcache.chain.exitreport`), so ``tiered-progcache
    stats --cupy`` shows CuPy's hits per tier, misses and compiles. Run at exit and by
    :func:`uninstall`; never raises.
    """
    source = _exit_report
    if source is None:
        return
    try:
        source.report()
    except Exception as exc:  # never fail an interpreter's exit
        logger.debug("could not report CuPy cache stats: %r", exc)


def _warn_once(message: str, *args: object) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(message, *args)


def install(cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Make CuPy's compiles use the tiered backend; True if installed (or already), False if CuPy runs untouched.

    ``cache_dir``: CuPy's directory (default ``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``).
    No remote is contacted here. Idempotent; thread-safe.
    """
    global _previous, _installed, _exit_report
    with _lock:
        if _installed is not None:
            return True
        try:
            from . import _cupyprivate as private
        except Exception as exc:  # no CuPy, or one that moved the hook's module
            _warn_once("CuPy cache: not installed (CuPy runs with its own cache): %s", exc)
            return False
        problem = private.check()
        if problem is not None:
            _warn_once("CuPy cache: not installed on CuPy %s (CuPy runs with its own cache): %s", private.version(), problem)
            return False
        from .backend import TieredKernelCacheBackend, compile_context
        from .cupydir import default_cupy_dir

        compile_problem = private.check_compile()
        try:
            cupy_dirs = private.cupy_include_dirs() if compile_problem is None else ()
        except Exception as exc:
            compile_problem = f"CuPy's own include directories unknown: {exc}"
            cupy_dirs = ()
        try:
            backend = TieredKernelCacheBackend(
                cache_dir if cache_dir is not None else default_cupy_dir(),
                shared=shared_cache,
                local=_local,
                cupy_dirs=cupy_dirs,
                save_source=bool(os.environ.get("CUPY_CACHE_SAVE_CUDA_SOURCE")),
            )
        except OSError as exc:
            _warn_once("CuPy cache: not installed (CuPy runs with its own cache): %s", exc)
            return False
        _previous = private.current_backend()
        private.set_backend(backend)
        _installed = backend
        from ..chain import exitreport

        # Its directory's `stats.jsonl` only: the shared chain reports itself to a `stats --run` file.
        _exit_report = exitreport.register(_counts, local_root=backend.cache_dir, stats_path=None, baseline=_counts())
        if compile_problem is None:
            private.wrap_compile(compile_context)
        else:
            _warn_once("CuPy cache: installed without header keys (-I headers are not keyed, as in CuPy): %s",
                       compile_problem)  # fmt: skip
        return True


def installed() -> Any:
    """The backend :func:`install` put in place, or None."""
    return _installed


def uninstall() -> None:
    """Put back the backend CuPy had before :func:`install` and CuPy's own ``_compile_with_cache_cuda``."""
    global _previous, _installed, _exit_report
    with _lock:
        if _installed is None:
            return
        from . import _cupyprivate as private

        if _exit_report is not None:
            _exit_report.close()  # its last report: a later install() reports from its own start
        private.unwrap_compile()
        private.set_backend(_previous)
        _previous = _installed = _exit_report = None


def _reset_for_tests() -> None:
    """Forget the process's chain (it is not closed), zero the local counters, re-arm the warning."""
    global _local, _warned
    with _lock:
        _shared.forget()
        _warned = False
        _local = TierCounters()
        if _installed is not None:
            _installed._local = _local
