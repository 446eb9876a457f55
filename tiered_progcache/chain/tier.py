"""One link of the chain: a resource adapted once, with its policy, counters and the failure policy.

Two things live here and nowhere else:

* **What a resource is.** A tier's resource is a ``ProgramCacheResource`` addressed by
  key; the rest of the package also needs it by entry name. :class:`Tier` works that out
  once, when it is built (:attr:`Tier.entries`, :attr:`Tier.local`, :attr:`Tier.location`,
  how it reads and measures itself), so no other module asks ``isinstance`` of a
  concrete store class (``tests/test_architecture.py`` checks).
* **The failure policy.** :func:`failure_kind` sorts any exception into a
  :class:`FailureKind`, and :data:`FAILURE_POLICY` says, per tier operation, which
  counter it bumps and what it logs. Whatever a tier raises on a read becomes a miss,
  on a write a dropped write; ``Program.compile`` loses the compiled object if the
  cache's ``__setitem__`` raises, so nothing a tier does may escape from here.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Mapping
from typing import Callable

from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource

from .._cudacore import memory_cache_bytes
from ..errors import EntryRejected, TierUnavailable
from ..stores.localdir import KEYED_READS, LocalDir
from .policy import TierPolicy
from ..stores.ratelimit import RateLimitedLogger
from ..settings import DEFAULT_MAX_PENDING_UPLOAD_BYTES, DEFAULT_MAX_PENDING_UPLOADS
from .stats import TierCounters, TierStats
from ..stores.store import EntryStore, entry_name
from .writeback import WriteBackQueue

__all__ = ["CLEAR_WAIT_S", "DELETE_UPLOAD_WAIT_S", "FAILURE_POLICY", "FailureKind", "FailureResponse", "Tier", "bare_policy",
           "default_policy", "failure_kind"]

logger = logging.getLogger(__name__)

#: Seconds a delete waits for an upload of the same entry that is already under way (then deletes and raises).
DELETE_UPLOAD_WAIT_S = 30.0
#: Seconds ``clear()`` waits for a background write already under way (queued ones are dropped at once).
CLEAR_WAIT_S = 30.0


# -- the failure policy ------------------------------------------------------------------------


class FailureKind(enum.Enum):
    """What an exception a tier raised means, whatever the operation."""

    MISS = "miss"  #: ``KeyError``: the tier does not hold the entry (an answer, not a failure)
    REJECTED = "rejected"  #: ``EntryRejected``: held, but corrupt, forged or over a bound: never returned
    SKIPPED = "skipped"  #: ``TierUnavailable``: the tier declined without trying (its breaker is open)
    TIMEOUT = "timeout"  #: ``TimeoutError``: the tier did not answer within its deadline
    ERROR = "error"  #: anything else: an outage, a refusal, or a bug in the tier


def failure_kind(exc: BaseException) -> FailureKind:
    """The :class:`FailureKind` of ``exc``; the one place an exception's type is read for its meaning."""
    if type(exc) is KeyError:
        return FailureKind.MISS
    if isinstance(exc, EntryRejected):
        return FailureKind.REJECTED
    if isinstance(exc, KeyError):
        return FailureKind.MISS
    if isinstance(exc, TierUnavailable):
        return FailureKind.SKIPPED
    if isinstance(exc, TimeoutError):
        return FailureKind.TIMEOUT
    return FailureKind.ERROR


@dataclasses.dataclass(frozen=True)
class FailureResponse:
    """What one kind of failure of one operation does: the counter it bumps and the line it logs (if any).

    ``message`` is formatted with the tier's name and the exception; ``topic`` groups it
    for rate limiting (one line per tier and topic per minute).
    """

    counter: str | None = None
    message: str | None = None
    topic: str = ""
    level: int = logging.WARNING


_READ_ERROR = FailureResponse("errors", "tier %s failed a read (counted as a miss): %r", "read")
_WRITE_ERROR = FailureResponse("errors", "tier %s failed a write (dropped): %r", "write")
_NOTHING = FailureResponse()

#: Per tier operation, what each :class:`FailureKind` does. A read that fails is a miss
#: (``misses`` +1 besides), a write is dropped, a delete is counted and raised to the chain
#: (which raises ``DeleteFailed``); counting, clearing, closing and measuring are logged.
FAILURE_POLICY: Mapping[str, Mapping[FailureKind, FailureResponse]] = {
    "read": {
        FailureKind.MISS: _NOTHING,
        FailureKind.REJECTED: FailureResponse("rejected", "tier %s rejected an entry: %s", "rejected"),
        FailureKind.SKIPPED: FailureResponse("skipped"),
        FailureKind.TIMEOUT: FailureResponse("timeouts", "tier %s timed out on a read (counted as a miss): %s", "read"),
        FailureKind.ERROR: _READ_ERROR,
    },
    "write": {
        FailureKind.MISS: _WRITE_ERROR,
        FailureKind.REJECTED: _WRITE_ERROR,
        FailureKind.SKIPPED: FailureResponse("skipped"),
        FailureKind.TIMEOUT: FailureResponse("timeouts", "tier %s timed out on a write (dropped): %s", "write"),
        FailureKind.ERROR: _WRITE_ERROR,
    },
    "delete": {  # a KeyError (MISS, REJECTED) is "not held here", never a failure
        FailureKind.SKIPPED: FailureResponse("skipped"),
        FailureKind.TIMEOUT: FailureResponse("timeouts"),
        FailureKind.ERROR: FailureResponse("errors"),
    },
    "clear": dict.fromkeys(FailureKind, FailureResponse("errors", "tier %s failed to clear: %r", "clear")),
    "count": dict.fromkeys(FailureKind, FailureResponse(None, "tier %s could not count its entries: %r", "count")),
    "close": dict.fromkeys(FailureKind, FailureResponse(None, "tier %s failed to close: %r", "close")),
    "measure": dict.fromkeys(
        FailureKind, FailureResponse(None, "tier %s could not measure its size: %r", "measure", logging.DEBUG)
    ),
}


# -- what a resource is ----------------------------------------------------------------------------


def _kind(resource: ProgramCacheResource) -> str:
    """``memory`` or ``local`` for cuda-core's two tiers, ``remote`` / ``read-only remote`` for a shared
    entry store, ``""`` for any other resource: what a tier's default name and policy follow."""
    if isinstance(resource, InMemoryProgramCache):
        return "memory"
    if isinstance(resource, FileStreamProgramCache):
        return "local"
    if isinstance(resource, EntryStore) and resource.shared:
        return "read-only remote" if resource.read_only else "remote"
    return ""


def default_policy(resource: ProgramCacheResource, fallback_name: str) -> TierPolicy:
    """The policy of a tier given to ``tiers=[...]`` without one: cuda-core's two tiers are ``memory`` and
    ``local``, a shared entry store a shared ``remote`` written in the background, anything else ``fallback_name``."""
    kind = _kind(resource)
    if kind.endswith("remote"):
        return TierPolicy("remote", read_only=kind != "remote", write="background", shared=True)
    return TierPolicy(kind or fallback_name)


#: The policies :func:`bare_policy` hands out (built once: a bare resource's chain is built per call).
_BARE_POLICIES = {
    "memory": TierPolicy("memory"),
    "local": TierPolicy("local"),
    "remote": TierPolicy("remote", shared=True),
    "read-only remote": TierPolicy("remote", read_only=True, shared=True),
    "": TierPolicy("cache"),
}


def bare_policy(resource: ProgramCacheResource) -> TierPolicy:
    """The policy of a bare resource given to ``compile()``: named as :func:`default_policy` names it
    (``cache`` for one of no known kind), written synchronously, as a bare resource always was."""
    return _BARE_POLICIES[_kind(resource)]


def _local_dir(resource: ProgramCacheResource) -> LocalDir | None:
    return LocalDir.of(resource) if isinstance(resource, FileStreamProgramCache) else None


def _entries(resource: ProgramCacheResource, local: LocalDir | None) -> EntryStore | None:
    if local is not None:
        return local
    return resource if isinstance(resource, EntryStore) else None


def _reader(resource: ProgramCacheResource, local: LocalDir | None) -> Callable[[bytes], bytes]:
    """How :meth:`Tier.lookup` reads ``resource``: ``resource[key]``, or for cuda-core's own file tier
    (not a subclass that reads differently) :meth:`LocalDir.read_key`, the same read in half the system calls."""
    if (KEYED_READS and local is not None
            and type(resource).__getitem__ is FileStreamProgramCache.__getitem__):  # fmt: skip
        return local.read_key
    return resource.__getitem__


def _measurer(resource: ProgramCacheResource, local: LocalDir | None) -> Callable[[], tuple[int, int | None]]:
    """Entries and bytes a tier holds; a local directory is walked once for both."""
    if local is not None:

        def walk() -> tuple[int, int | None]:
            sizes = [entry.size for entry in local.iter_entries()]
            return len(sizes), sum(sizes)

        return walk
    if isinstance(resource, InMemoryProgramCache):
        return lambda: (len(resource), memory_cache_bytes(resource))
    return lambda: (len(resource), None)


# -- the tier ------------------------------------------------------------------------------------

#: Rejected keys a tier remembers for replacement at most (more are simply not replaced by this process).
_MAX_REJECTED = 4096



class Tier:
    """A resource in the chain, adapted once. Thread-safe as far as its resource is.

    ``entries`` is the resource seen by entry name (the resource itself where it is an
    :class:`~tiered_progcache.stores.store.EntryStore`, the directory of cuda-core's file tier),
    or None; ``local`` the local directory where the tier is one; ``location`` where its
    entries live, for messages.
    """

    __slots__ = ("resource", "policy", "counters", "writeback", "entries", "local", "in_memory", "location",
                 "_read", "_measure", "_warn", "_create", "_rejected")  # fmt: skip

    def __init__(
        self,
        resource: ProgramCacheResource,
        policy: TierPolicy,
        *,
        max_pending_writes: int = DEFAULT_MAX_PENDING_UPLOADS,
        max_pending_write_bytes: int | None = DEFAULT_MAX_PENDING_UPLOAD_BYTES,
        warn: RateLimitedLogger | None = None,
    ) -> None:
        if not isinstance(resource, ProgramCacheResource):
            raise TypeError(
                f"tier {policy.name!r} must be a cuda.core.utils.ProgramCacheResource, got {type(resource).__name__}"
            )
        self.resource = resource
        self.policy = policy
        self.local: LocalDir | None = _local_dir(resource)
        self.entries: EntryStore | None = _entries(resource, self.local)
        #: The resource where it is cuda-core's memory tier (the chain reads its LRU order), else None.
        self.in_memory: InMemoryProgramCache | None = resource if isinstance(resource, InMemoryProgramCache) else None
        self.location: str = (self.entries.location if self.entries is not None
                              else f"{type(resource).__name__}, this process")  # fmt: skip
        self._read = _reader(resource, self.local)
        #: Writes here are conditional creates (a shared store that has an atomic one): never a rewrite.
        self._create: EntryStore | None = (self.entries if policy.shared and self.entries is not None
                                           and self.entries.atomic_create else None)  # fmt: skip
        self._rejected: set[bytes] = set()  # keys this tier held corrupt or forged: the next write replaces them
        self._measure = _measurer(resource, self.local)
        self.counters = TierCounters()
        self.writeback: WriteBackQueue | None = None
        self._warn = warn if warn is not None else RateLimitedLogger(logger)
        if policy.write == "background" and not policy.read_only:
            self.writeback = WriteBackQueue(
                self._write_now,
                max_pending=max_pending_writes,
                max_pending_bytes=max_pending_write_bytes,
                name=policy.name,
            )
        startup_failure = self.entries.startup_failure if self.entries is not None else None
        if startup_failure is not None:  # the store logged it; counted here, so a dead remote shows in stats()
            response = FAILURE_POLICY["read"].get(failure_kind(startup_failure), _NOTHING)
            if response.counter in ("errors", "timeouts"):
                self.counters.add(response.counter)

    @property
    def name(self) -> str:
        return self.policy.name

    def _failed(self, operation: str, exc: Exception) -> FailureKind:
        """Apply :data:`FAILURE_POLICY` to ``exc`` raised by ``operation``: count it, log it; its kind."""
        kind = failure_kind(exc)
        response = FAILURE_POLICY[operation].get(kind, _NOTHING)
        if response.counter is not None:
            self.counters.add(response.counter)
        if response.message is not None:
            if response.level >= logging.WARNING:
                self._warn.log(response.level, f"{self.name}:{response.topic}", response.message, self.name, exc)
            else:
                logger.log(response.level, response.message, self.name, exc)
        return kind

    # -- reads ---------------------------------------------------------------

    def lookup(self, key: bytes) -> bytes | None:
        """The tier's bytes for ``key``, or None on a miss or any failure (counted, timed)."""
        started = time.perf_counter()
        try:
            data = self._read(key)
        except Exception as exc:
            self.counters.record_get((time.perf_counter() - started) * 1e3)
            self.record_read_failure(exc)
            if self._create is not None and isinstance(exc, EntryRejected) and len(self._rejected) < _MAX_REJECTED:
                self._rejected.add(key)
            return None
        counters = self.counters
        counters.record_get((time.perf_counter() - started) * 1e3)
        counters.count_hit(len(data))
        return data

    def lookup_metadata(self, key: bytes) -> bytes | None:
        """Like :meth:`lookup` for an entry's metadata (a symbol map): not a lookup in ``hits``/``misses``,
        so those count kernels; its bytes count in ``bytes_read`` and a failure is still counted (errors,
        timeouts) and logged."""
        try:
            data = self._read(key)
        except Exception as exc:
            if type(exc) is not KeyError:
                self._failed("read", exc)
            return None
        self.counters.add("bytes_read", len(data))
        return data

    def record_read_failure(self, exc: Exception) -> None:
        """Count a read that raised as a miss, with its reason; log what is not a plain miss."""
        self.counters.count_miss()
        if type(exc) is not KeyError:  # a plain miss, the common case, costs no table lookup
            self._failed("read", exc)

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
        """Write ``key``; False if it failed or, on a tier of conditional creates, the entry was there already.

        An entry on such a tier, once written, is never rewritten (its MODIFIED time is its birth), unless
        this tier rejected what it held under that key (corrupt or forged): that one is replaced.
        """
        started = time.perf_counter()
        try:
            if self._create is not None and key not in self._rejected:
                written = self._create.create_entry(entry_name(key), data)
            else:
                self.resource[key] = data
                self._rejected.discard(key)
                written = True
        except Exception as exc:
            self._failed("write", exc)
            return False
        counters = self.counters
        counters.record_put((time.perf_counter() - started) * 1e3)
        if written:
            counters.count_write(len(data))
        return written

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
        except Exception as exc:
            self._failed("delete", exc)
            raise
        return True

    # -- housekeeping ----------------------------------------------------------

    def count(self) -> int | None:
        """Entries the tier holds (``len``), or None where it cannot say (logged)."""
        try:
            return len(self.resource)
        except Exception as exc:
            self._failed("count", exc)
            return None

    def clear(self) -> None:
        """Empty the resource, its queued writes first (none lands after); a failure is counted and logged, never raised."""
        if self.writeback is not None and not self.writeback.discard(CLEAR_WAIT_S):
            logger.warning("tier %s: a background write still under way after %.0f s may land after clear()", self.name,
                           CLEAR_WAIT_S)
        try:
            self.resource.clear()
        except Exception as exc:
            self._failed("clear", exc)

    def close(self) -> None:
        """Release the resource; a failure is logged, never raised."""
        try:
            self.resource.close()
        except Exception as exc:
            self._failed("close", exc)

    def snapshot(self) -> TierStats:
        entries = bytes_held = None
        if not self.policy.shared:
            try:
                entries, bytes_held = self._measure()
            except Exception as exc:
                self._failed("measure", exc)
        return self.counters.snapshot(entries=entries, bytes_held=bytes_held)
