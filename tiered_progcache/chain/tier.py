"""One link of the chain: an entry store adapted once, with its policy, counters and the failure policy.

Two things live here and nowhere else:

* **What a tier is.** The chain runs over :class:`~tiered_progcache.stores.store.EntryStore`
  alone, read and written by cache key (``read_key``, ``write_key``, ...). :func:`store_of`
  turns what a user gives into one, once, when the tier is built: an entry store is
  itself, cuda-core's file tier its directory (:class:`~tiered_progcache.stores.localdir.LocalDir`),
  its memory tier and any other ``ProgramCacheResource`` a thin keyed store
  (:mod:`~tiered_progcache.stores.coretiers`). What the tier then is (:attr:`Tier.entries`,
  :attr:`Tier.local`, :attr:`Tier.location`, its default name) is read here, so no other
  module asks ``isinstance`` of a concrete store class (``tests/test_architecture.py`` checks).
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
from typing import Union

from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource

from ..errors import EntryRejected, TierUnavailable
from ..stores.coretiers import MemoryStore, ResourceStore
from ..stores.localdir import LocalDir
from .policy import TierPolicy
from ..stores.ratelimit import RateLimitedLogger
from ..settings import DEFAULT_MAX_PENDING_UPLOAD_BYTES, DEFAULT_MAX_PENDING_UPLOADS
from .stats import GIL_DISABLED, TierCounters, TierStats
from ..stores.store import EntryStore, companion_keys
from .writeback import WriteBackQueue

__all__ = ["CLEAR_WAIT_S", "DELETE_UPLOAD_WAIT_S", "FAILURE_POLICY", "FailureKind", "FailureResponse", "Fetched", "Tier",
           "TierSource", "bare_policy", "default_policy", "failure_kind", "store_of"]

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


# -- what a tier is ---------------------------------------------------------------------------

#: What ``tiers=[...]`` and ``compile(cache=...)`` accept as a tier.
TierSource = Union[ProgramCacheResource, EntryStore]


def store_of(source: TierSource) -> EntryStore:
    """The entry store the chain runs over for ``source``: itself if it is one, else cuda-core's tier adapted.

    Called once per tier, when it is built; ``TypeError`` for anything that is neither.
    """
    if isinstance(source, EntryStore):
        return source
    if isinstance(source, InMemoryProgramCache):
        return MemoryStore(source)
    if isinstance(source, FileStreamProgramCache):
        return LocalDir.of(source)
    if isinstance(source, ProgramCacheResource):
        return ResourceStore(source)
    raise TypeError(f"a tier must be a tiered_progcache EntryStore or a cuda.core ProgramCacheResource, "
                    f"got {type(source).__name__}")  # fmt: skip


def _kind(store: EntryStore) -> str:
    """``memory`` or ``local`` for cuda-core's two tiers, ``remote`` / ``read-only remote`` for a shared
    store, ``""`` for any other: what a tier's default name and policy follow."""
    if isinstance(store, MemoryStore):
        return "memory"
    if isinstance(store, LocalDir) and store.cache is not None:
        return "local"
    if store.shared:
        return "read-only remote" if store.read_only else "remote"
    return ""


def default_policy(source: TierSource, fallback_name: str) -> TierPolicy:
    """The policy of a tier given to ``tiers=[...]`` without one: cuda-core's two tiers are ``memory`` and
    ``local``, a shared entry store a shared ``remote`` written in the background, anything else ``fallback_name``."""
    kind = _kind(store_of(source))
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


def bare_policy(source: TierSource) -> TierPolicy:
    """The policy of a bare resource or store given to ``compile()``: named as :func:`default_policy` names it
    (``cache`` for one of no known kind), and written synchronously: the chain around it is built per call and
    starts no thread, so a write is in the resource when the call returns, with no queue left to flush."""
    return _BARE_POLICIES[_kind(store_of(source))]


# -- the tier ------------------------------------------------------------------------------------

#: Rejected keys a tier remembers for replacement at most (more are simply not replaced by this process).
_MAX_REJECTED = 4096



@dataclasses.dataclass(frozen=True, slots=True)
class Fetched:
    """One read of a tier, not yet counted: its bytes, or what it raised (``KeyError``: absent), and its milliseconds.
    Exactly one of ``data`` and ``error`` is set."""

    data: bytes | None
    error: Exception | None
    ms: float


class Tier:
    """An entry store in the chain, adapted once. Thread-safe as far as its store is.

    ``resource`` is what was given (a cuda-core tier, a user's resource, an entry store), kept
    for inspection; ``backend`` the entry store the chain reads and writes by key
    (:func:`store_of`); ``entries`` that store where it is addressable by entry name
    (listed, warmed, pruned), else None; ``local`` the local directory where the tier is
    one; ``location`` where its entries live, for messages.
    """

    __slots__ = ("resource", "backend", "policy", "counters", "writeback", "entries", "local", "in_memory",
                 "location", "_read", "_warn", "_create", "_rejected", "_untimed_mask", "_hit_log")  # fmt: skip

    def __init__(
        self,
        resource: TierSource,
        policy: TierPolicy,
        *,
        max_pending_writes: int = DEFAULT_MAX_PENDING_UPLOADS,
        max_pending_write_bytes: int | None = DEFAULT_MAX_PENDING_UPLOAD_BYTES,
        warn: RateLimitedLogger | None = None,
    ) -> None:
        if not isinstance(resource, (ProgramCacheResource, EntryStore)):
            raise TypeError(f"tier {policy.name!r} must be a tiered_progcache EntryStore or a "
                            f"cuda.core.utils.ProgramCacheResource, got {type(resource).__name__}")  # fmt: skip
        self.resource = resource
        self.backend: EntryStore = store_of(resource)
        self.policy = policy
        backend = self.backend
        self.local: LocalDir | None = backend if isinstance(backend, LocalDir) else None
        self.entries: EntryStore | None = backend if backend.by_name else None
        #: The memory store where the tier is cuda-core's memory tier (the chain reads its LRU order), else None.
        self.in_memory: MemoryStore | None = backend if isinstance(backend, MemoryStore) else None
        self.location: str = backend.location
        self._read = backend.read_key
        #: Writes here are conditional creates (a shared store that has an atomic one): never a rewrite.
        self._create: EntryStore | None = backend if policy.shared and backend.atomic_create else None
        self._rejected: set[bytes] = set()  # keys this tier held corrupt or forged: the next write replaces them
        #: Hits timed one in 64 (the chain's first tier: see :meth:`sample_hits`); 0: every lookup timed.
        self._untimed_mask = 0
        self._hit_log: logging.Logger | None = None
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
        backend.when_ready(self._count_startup_failure)

    def _count_startup_failure(self) -> None:
        """The store's failed first probe as the tier's first error or timeout (the store logged it), so a dead
        remote shows in ``stats()``."""
        startup_failure = self.backend.startup_failure
        if startup_failure is not None:
            response = FAILURE_POLICY["read"].get(failure_kind(startup_failure), _NOTHING)
            if response.counter in ("errors", "timeouts"):
                self.counters.add(response.counter)

    def sample_hits(self, hit_log: logging.Logger) -> None:
        """Time this tier's hits one in 64 and count the rest inline (the chain's first tier, a memory hit
        under a microsecond: two clock reads and a call are a fifth of it); off without a GIL or while
        ``hit_log`` logs DEBUG, where every hit is timed and logged there ("lookup ...: memory hit")."""
        self._hit_log = hit_log
        self._untimed_mask = _untimed_mask(hit_log)

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
        """The tier's bytes for ``key``, or None on a miss or any failure (counted; timed, or one hit in 64)."""
        counters = self.counters
        if counters.hits & self._untimed_mask:  # the untimed fast path (sample_hits): counted as count_hit does
            try:
                data = self._read(key)
            except Exception as exc:
                self._read_failed(key, exc)
                return None
            size = len(data)  # before the +=, so no call splits its read and write
            counters.hits += 1
            counters.bytes_read += size
            if self.writeback is not None:
                self.forgo_uploads(key)
            return data
        return self.lookup_fetched(key, self.fetch(key))

    def fetch(self, key: bytes) -> Fetched:
        """Read ``key`` now, counting nothing: what :meth:`lookup_fetched` later counts as the lookup."""
        started = time.perf_counter()
        try:
            data = self._read(key)
        except Exception as exc:
            return Fetched(None, exc, (time.perf_counter() - started) * 1e3)
        return Fetched(data, None, (time.perf_counter() - started) * 1e3)

    def lookup_fetched(self, key: bytes, fetched: Fetched) -> bytes | None:
        """:meth:`lookup`'s answer from a read :meth:`fetch` made (here or ahead of time), counted as one lookup."""
        counters = self.counters
        counters.record_get(fetched.ms)
        if fetched.error is not None:
            self._read_failed(key, fetched.error)
            return None
        data = fetched.data
        assert data is not None  # a read that did not raise returned bytes
        counters.count_hit(len(data))
        if self.writeback is not None:
            self.forgo_uploads(key)
        hit_log = self._hit_log
        if hit_log is not None:
            self._untimed_mask = _untimed_mask(hit_log)  # re-read one hit in 64: DEBUG turns the fast path off
            if hit_log.isEnabledFor(logging.DEBUG):
                hit_log.debug("lookup %s: %s hit (%d bytes)", key[:8].hex(), self.name, len(data))
        return data

    def forgo_uploads(self, key: bytes) -> None:
        """This tier holds entry ``key`` (a read of it there just answered): drop a queued upload of the entry and, with
        it, of its manifest and symbol map (``forgone``): another writer's are there or follow its entry. An entry once
        written is never rewritten: each would cost a request. Where this node's own upload of the entry is under way
        or done, its manifest, queued after it, still goes up."""
        writeback = self.writeback
        if writeback is None or not writeback.cancel(key):
            return
        forgone = 1 + sum(writeback.cancel(k) for k in companion_keys(key))
        self.counters.add("forgone", forgone)

    def _read_failed(self, key: bytes, exc: Exception) -> None:
        self.record_read_failure(exc)
        if self._create is not None and isinstance(exc, EntryRejected) and len(self._rejected) < _MAX_REJECTED:
            self._rejected.add(key)

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
                written = self._create.create_key(key, data)
            else:
                self.backend.write_key(key, data)
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
            self.backend.delete_key(key)
        except KeyError:
            return cancelled
        except Exception as exc:
            self._failed("delete", exc)
            raise
        return True

    # -- housekeeping ----------------------------------------------------------

    def count(self) -> int | None:
        """Entries the tier holds, or None where it cannot say (logged)."""
        try:
            return self.backend.count()
        except Exception as exc:
            self._failed("count", exc)
            return None

    def clear(self) -> None:
        """Empty the store, its queued writes first (none lands after); a failure is counted and logged, never raised."""
        if self.writeback is not None and not self.writeback.discard(CLEAR_WAIT_S):
            logger.warning("tier %s: a background write still under way after %.0f s may land after clear()", self.name,
                           CLEAR_WAIT_S)
        try:
            self.backend.clear()
        except Exception as exc:
            self._failed("clear", exc)

    def close(self) -> None:
        """Release the store; a failure is logged, never raised."""
        try:
            self.backend.close()
        except Exception as exc:
            self._failed("close", exc)

    def snapshot(self) -> TierStats:
        entries = bytes_held = None
        if not self.policy.shared:
            try:
                entries, bytes_held = self.backend.measure()
            except Exception as exc:
                self._failed("measure", exc)
        return self.counters.snapshot(entries=entries, bytes_held=bytes_held)


#: Hits of a sampled tier between two timed ones, less one (a power of two, less one, as a mask).
_TIME_ONE_HIT_IN_MASK = 63


def _untimed_mask(hit_log: logging.Logger) -> int:
    """Mask for the untimed, unlogged fast path of a sampled tier's hits; 0 turns that path off.

    Off where plain int increments are not exact (no GIL) and while ``hit_log`` logs DEBUG,
    so that every lookup logs the tier that answered.
    """
    if GIL_DISABLED or hit_log.isEnabledFor(logging.DEBUG):
        return 0
    return _TIME_ONE_HIT_IN_MASK
