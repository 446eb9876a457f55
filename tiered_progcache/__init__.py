"""A tiered program cache for cuda.core: memory -> local disk -> S3/GCS/NFS, compile once per cluster."""

from __future__ import annotations

from .errors import EntryRejected, TierUnavailable
from .policy import TierPolicy
from .stats import CacheStats, TierStats
from .tier import Tier
from .tiered import DEFAULT_MAX_MEMORY_BYTES, TieredProgramCache

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "CacheStats",
    "EntryRejected",
    "Tier",
    "TierPolicy",
    "TierStats",
    "TierUnavailable",
    "TieredProgramCache",
]
