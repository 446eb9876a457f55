"""The process-wide cache ``compile(cache=None)`` and ``explain(cache=None)`` use, built on first use."""

from __future__ import annotations

import threading

from cuda.core.utils import ProgramCacheResource

from .. import forks
from .tiered import TieredProgramCache

__all__ = ["default_cache"]

_default_lock = threading.Lock()
_default: ProgramCacheResource | None = None


def default_cache() -> ProgramCacheResource:
    """The process-wide cache ``compile(cache=None)`` uses, built on first use.

    From the ``TIERED_PROGCACHE_*`` environment; the local-only default chain (memory ->
    cuda-core's user cache directory) if the configured remote's filesystem package
    is not installed. Thread-safe; a forked child builds its own.
    """
    global _default
    with _default_lock:
        if _default is None:
            try:
                _default = TieredProgramCache.from_env()
            except ImportError:
                _default = TieredProgramCache()
        return _default


def _forget_default_after_fork() -> None:
    global _default, _default_lock
    _default_lock = threading.Lock()
    _default = None  # the parent's write-back threads do not exist here


forks.register(_forget_default_after_fork)
