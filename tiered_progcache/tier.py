"""One link of the chain: a ``ProgramCacheResource`` with its policy, counters and failure handling.

This is where the failure policy lives: whatever a tier raises on a read becomes a
miss, and whatever it raises on a write becomes a counter and a rate-limited log
line. ``Program.compile`` loses the compiled object if the cache's ``__setitem__``
raises, so nothing a tier does may escape from here.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource

from ._cudacore import memory_cache_bytes
from .errors import EntryRejected, TierUnavailable
from .localdir import KEYED_READS, LocalDir
from .policy import TierPolicy
from .ratelimit import RateLimitedLogger
from .settings import DEFAULT_MAX_PENDING_UPLOAD_BYTES, DEFAULT_MAX_PENDING_UPLOADS
from .stats import TierCounters, TierStats
from .writeback import WriteBackQueue

__all__ = ["DELETE_UPLOAD_WAIT_S", "Tier"]

logger = logging.getLogger(__name__)

#: Seconds a delete waits for an upload of the same entry that is already under way (then deletes and raises).
DELETE_UPLOAD_WAIT_S = 30.0


class Tier:
    """A resource in the chain. Thread-safe as far as its resource is."""

    __slots__ = ("resource", "policy", "counters", "writeback", "_read", "_warn")

    def __init__(
        self,
        resource: ProgramCacheResource,
        policy: TierPolicy,
        *,
        max_pending_writes: int = DEFAULT_MAX_PENDING_UPLOADS,
        max_pending_write_bytes: int | None = DEFAULT_MAX_PENDING_UPLOAD_BYTES,
    ) -> None:
        if not isinstance(resource, ProgramCacheResource):
            raise TypeError(
                f"tier {policy.name!r} must be a cuda.core.utils.ProgramCacheResource, got {type(resource).__name__}"
            )
        self.resource = resource
        self.policy = policy
        self._read = _reader(resource)
        self.counters = TierCounters()
        self.writeback: WriteBackQueue | None = None
        self._warn = RateLimitedLogger(logger)
        if policy.write == "background" and not policy.read_only:
            self.writeback = WriteBackQueue(
                self._write_now,
                max_pending=max_pending_writes,
                max_pending_bytes=max_pending_write_bytes,
                name=policy.name,
            )

    @property
    def name(self) -> str:
        return self.policy.name

    # -- reads ---------------------------------------------------------------

    def lookup(self, key: bytes) -> bytes | None:
        """The tier's bytes for ``key``, or None on a miss or any failure (counted, timed)."""
        started = time.perf_counter()
        try:
            data = self._read(key)
        except Exception as exc:
            self.counters.record_get((time.perf_counter() - started) * 1e3)
            self.record_read_failure(exc)
            return None
        counters = self.counters
        counters.record_get((time.perf_counter() - started) * 1e3)
        counters.count_hit(len(data))
        return data

    def record_read_failure(self, exc: Exception) -> None:
        """Count a read that raised as a miss, with its reason; log what is not a plain miss."""
        counters = self.counters
        counters.count_miss()
        if type(exc) is KeyError:
            return
        if isinstance(exc, EntryRejected):
            counters.add("rejected")
            self._warn.warning(f"{self.name}:rejected", "tier %s rejected an entry: %s", self.name, exc)
        elif isinstance(exc, KeyError):
            return
        elif isinstance(exc, TierUnavailable):
            counters.add("skipped")
        elif isinstance(exc, TimeoutError):
            counters.add("timeouts")
            self._warn.warning(f"{self.name}:read", "tier %s timed out on a read (counted as a miss): %s", self.name, exc)
        else:
            counters.add("errors")
            self._warn.warning(f"{self.name}:read", "tier %s failed a read (counted as a miss): %r", self.name, exc)

    # -- writes --------------------------------------------------------------

    def store(self, key: bytes, data: bytes, *, promotion: bool = False) -> None:
        """Write per policy (at once or queued); never raises."""
        if self.policy.read_only:
            return
        if self.writeback is not None:
            refused = self.writeback.submit(key, data)
            if refused is not None:
                self.counters.add("dropped")
                self._warn.warning(
                    f"{self.name}:dropped:{refused.name}",
                    "tier %s: background write dropped (%s)",
                    self.name,
                    refused.value,
                )
            elif promotion:
                self.counters.add("promotions")
            return
        if self._write_now(key, data) and promotion:
            self.counters.count_promotion()

    def _write_now(self, key: bytes, data: bytes) -> bool:
        started = time.perf_counter()
        try:
            self.resource[key] = data
        except TierUnavailable:
            self.counters.add("skipped")
            return False
        except TimeoutError as exc:
            self.counters.add("timeouts")
            self._warn.warning(f"{self.name}:write", "tier %s timed out on a write (dropped): %s", self.name, exc)
            return False
        except Exception as exc:
            self.counters.add("errors")
            self._warn.warning(f"{self.name}:write", "tier %s failed a write (dropped): %r", self.name, exc)
            return False
        counters = self.counters
        counters.record_put((time.perf_counter() - started) * 1e3)
        counters.count_write(len(data))
        return True

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (and cancel its queued upload); True if this tier held it.

        An upload of ``key`` already under way is waited for (at most
        :data:`DELETE_UPLOAD_WAIT_S`) and deleted after it lands: deleting first would let
        it land after the delete, and other nodes would be served the entry. A failure
        is counted and raised, an upload still under way after the wait too (as a
        ``TimeoutError``): the caller must not believe an entry gone that this tier may
        still serve.
        """
        if self.policy.read_only:
            return False
        cancelled = False
        upload_landed = True
        if self.writeback is not None:
            cancelled = self.writeback.cancel(key)
            if not self.writeback.wait_for(key, 0):
                logger.info("tier %s: a delete waits for the upload of the same entry under way", self.name)
                upload_landed = self.writeback.wait_for(key, DELETE_UPLOAD_WAIT_S)
        held = self._delete_now(key, cancelled)
        if not upload_landed:
            self.counters.add("timeouts")
            raise TimeoutError(
                f"tier {self.name}: an upload of the entry was still under way {DELETE_UPLOAD_WAIT_S:g} s "
                "after the delete began; it may land after the delete"
            )
        return held

    def _delete_now(self, key: bytes, cancelled: bool) -> bool:
        try:
            del self.resource[key]
        except KeyError:
            return cancelled
        except TierUnavailable:
            self.counters.add("skipped")
            raise
        except TimeoutError:
            self.counters.add("timeouts")
            raise
        except Exception:
            self.counters.add("errors")
            raise
        return True

    # -- housekeeping ----------------------------------------------------------

    def snapshot(self) -> TierStats:
        entries = bytes_held = None
        if not self.policy.shared:
            try:
                entries, bytes_held = _size_of(self.resource)
            except Exception as exc:
                logger.debug("tier %s could not measure its size: %r", self.name, exc)
        return self.counters.snapshot(entries=entries, bytes_held=bytes_held)


def _reader(resource: ProgramCacheResource) -> Callable[[bytes], bytes]:
    """How :meth:`Tier.lookup` reads ``resource``: ``resource[key]``, or for cuda-core's own file tier
    (not a subclass that reads differently) :meth:`LocalDir.read_key`, the same read in half the system calls."""
    if (KEYED_READS and isinstance(resource, FileStreamProgramCache)
            and type(resource).__getitem__ is FileStreamProgramCache.__getitem__):
        return LocalDir.of(resource).read_key
    return resource.__getitem__


def _size_of(resource: ProgramCacheResource) -> tuple[int, int | None]:
    """Entries and bytes a tier holds; a local directory is walked once for both."""
    if isinstance(resource, FileStreamProgramCache):
        sizes = [entry.size for entry in LocalDir.of(resource).iter_entries()]
        return len(sizes), sum(sizes)
    if isinstance(resource, InMemoryProgramCache):
        return len(resource), memory_cache_bytes(resource)
    return len(resource), None
