"""A tiered program cache for cuda.core: memory -> local disk -> S3/GCS/NFS, compile once per cluster."""

from __future__ import annotations

# ``compile`` the function shadows ``compile`` the module as a package attribute; import
# the module's other names with ``from tiered_progcache.compile import ...``.
from .compile import CompileEvent, compile, compile_count, on_compile
from .errors import EntryRejected, TierUnavailable
from .headers import header_digest
from .policy import TierPolicy
from .stats import CacheStats, TierStats
from .tier import Tier
from .tiered import DEFAULT_MAX_MEMORY_BYTES, TieredProgramCache

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "CacheConfig",
    "CacheStats",
    "CompileEvent",
    "EntryRejected",
    "RemoteProgramCache",
    "Tier",
    "TierPolicy",
    "TierStats",
    "TierUnavailable",
    "TieredProgramCache",
    "compile",
    "compile_count",
    "header_digest",
    "on_compile",
]


def __getattr__(name: str) -> object:
    """The remote tier and the configuration load fsspec: import them on first use only."""
    if name == "RemoteProgramCache":
        from .remote import RemoteProgramCache

        return RemoteProgramCache
    if name == "CacheConfig":
        from .config import CacheConfig

        return CacheConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
