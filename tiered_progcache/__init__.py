"""A tiered program cache for cuda.core: memory -> local disk -> S3/GCS/NFS, compile once per cluster."""

from __future__ import annotations

# ``compile`` and ``explain`` the functions shadow the modules of those names as package
# attributes; import their other names with ``from tiered_progcache.compiling.compile import ...``.
from .compiling.compile import CompileEvent, compile, compile_count, on_compile
from .errors import DeleteFailed, EntryRejected, TierUnavailable
from .compiling.explain import Explanation, explain
from .compiling.headerscan import header_digest
from .compiling.warmup import warm
from .stores.localdir import LocalDir
from .chain.policy import TierPolicy
from .settings import DEFAULT_MAX_MEMORY_BYTES
from .chain.stats import CacheStats, TierStats
from .stores.store import BatchRead, BatchWrite, EntryStore, LeaseStore, StoredEntry
from .chain.tier import Tier
from .chain.tiered import CacheStores, TieredProgramCache, stores_of
from .version import VERSION as __version__

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "BatchRead",
    "BatchWrite",
    "CacheConfig",
    "CacheStats",
    "CacheStores",
    "CompileEvent",
    "DeleteFailed",
    "EntryRejected",
    "EntryStore",
    "Explanation",
    "LeaseStore",
    "LocalDir",
    "RedisProgramCache",
    "RemoteProgramCache",
    "StoredEntry",
    "Tier",
    "TierPolicy",
    "TierStats",
    "TierUnavailable",
    "TieredProgramCache",
    "TransferReport",
    "compile",
    "compile_count",
    "explain",
    "header_digest",
    "on_compile",
    "stores_of",
    "warm",
]


def __getattr__(name: str) -> object:
    """The shared tiers and bulk transfer load fsspec or redis-py; the configuration is imported on first use too."""
    if name == "RemoteProgramCache":
        from .stores.remote import RemoteProgramCache

        return RemoteProgramCache
    if name == "RedisProgramCache":
        from .stores.redis_store import RedisProgramCache

        return RedisProgramCache
    if name == "TransferReport":
        from .chain.transfer import TransferReport

        return TransferReport
    if name == "CacheConfig":
        from .config import CacheConfig

        return CacheConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
