"""TieredProgramCache: the chain of tiers, its read-through and promotion, and its write policy."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from cuda.core import ObjectCode, ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, ProgramCacheResource, make_program_cache_key

from . import exitbudget, exitreport
from .bootfetch import boot_fetch_for
from .readahead import ReadAhead
from .._cudacore import as_key_bytes, extract_bytes
from ..configvalues import ConfigValues
from ..errors import DeleteFailed, one_line
from ..stores.localdir import KEYED_READS, LocalDir, default_local_dir
from .policy import FlightPolicy, TierPolicy
from ..stores.redis_store import RedisProgramCache, is_redis_url
from ..settings import by_name, remote_urls
from .stats import CacheStats, CompileTally, FlightCounts, MetadataKey
from ..stores.ratelimit import RateLimitedLogger
from ..stores.store import EntryStore
from ..stores.breaker import CircuitBreaker
from ..stores.sharedstore import SharedEntryStore
from ..redact import mask_url
from .downmemo import DOWN_MEMO_S, DownMemo, RemoteDown
from .tier import Tier, TierSource, bare_policy, default_policy

if TYPE_CHECKING:
    from .transfer import TransferReport

__all__ = ["CacheStores", "TieredProgramCache", "as_chain", "default_chain", "require_chain", "shared_tier", "stores_of"]

logger = logging.getLogger(__name__)

#: At most this many of the memory tier's most recently used entries have their local file's atime refreshed at once.
RECENCY_BATCH = 128

TierSpec = Union[TierSource, "tuple[TierSource, TierPolicy]"]
#: Where :meth:`TieredProgramCache.get` looks: every tier, those in front of the first shared one, or the rest.
WHERE = ("all", "nearby", "shared")


class TieredProgramCache(ProgramCacheResource):
    """A ``ProgramCacheResource`` that chains tiers, fastest first.

    >>> with TieredProgramCache() as cache:          # memory LRU -> cuda-core's local dir
    ...     obj = Program(src, "c++", opts).compile("cubin", cache=cache)

    Settings are keyword arguments named as in :data:`tiered_progcache.settings.SETTINGS`
    (``max_memory_bytes``, ``remote``, ``signing_key``, ...; ``path`` is ``local_dir``),
    checked like ``from_env`` checks its variables: an unknown name is a ``TypeError``,
    a bad value a ``TypeError``/``ValueError`` naming it. ``tiers=[...]`` builds the
    chain from the given resources instead; settings that shape the default chain are
    then a ``ValueError``, chain-wide ones (those without ``builds_tiers`` in the table)
    still apply. :attr:`settings` holds every value, for the code that uses them.

    Reads try each tier in order; the first hit is returned and copied into every
    faster tier whose policy promotes. Writes go to every writable tier: ``"sync"``
    tiers before ``__setitem__`` returns, ``"background"`` tiers (the remote) through
    a bounded write-back queue. No tier failure ever raises out of ``get`` or
    ``__setitem__``: a failed read is a miss, a failed write is dropped, both
    counted in :meth:`stats` and logged (rate-limited). Bad key or value types
    raise ``TypeError``.

    ``len()`` is the entry count of the largest non-shared tier (what this node
    holds); shared tiers are not listed. ``clear()`` clears non-shared tiers only:
    one process never wipes a cluster's remote.

    Concurrency: every method is safe to call from many threads (the chain holds no
    lock of its own; each tier is thread-safe and the counters are exact). Across
    processes the local file tier is cuda-core's ``FileStreamProgramCache``:
    writers stage and rename, so readers on one directory see whole entries or none.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        tiers: Sequence[TierSpec] | None = None,
        **settings: Any,
    ) -> None:
        if path is not None:
            if "local_dir" in settings:
                raise TypeError("path and local_dir are one setting: give it once")
            settings["local_dir"] = path
        config = ConfigValues(**settings)
        if tiers is None:
            specs = default_chain(config)
        else:
            table = by_name()
            shaping = [name for name in settings if table[name].builds_tiers]
            if shaping:
                named = ", ".join("path" if name == "local_dir" and path is not None else name for name in shaping)
                raise ValueError(
                    f"pass either tiers=[...] or the settings that build the default chain ({named}), not both"
                )
            specs = list(tiers)
            if not specs:
                raise ValueError("tiers must name at least one tier")
        self._assemble(
            _build_tiers(specs, config.max_pending_uploads, config.max_pending_upload_bytes),
            min_upload_compile_s=config.min_upload_compile_s,
            explain_misses=config.explain_misses,
            flight_policy=FlightPolicy(
                lease_min_compile_rtts=config.lease_min_compile_rtts,
                wait_patience=config.wait_patience,
                compile_time_prior_s=config.compile_time_prior_s,
                min_upload_compile_s=config.min_upload_compile_s,
            ),
            identity=self,
            settings=config,
        )
        # `tiered-progcache stats` (the local directory's counters) and `stats --run`: reported once, at close() or exit
        self._exit_report = exitreport.register_cache(self)
        if config.exit_timeout is not None:
            exitbudget.PROCESS.allow(config.exit_timeout)  # one deadline for the process's exit work

    def _assemble(
        self,
        tiers: tuple[Tier, ...],
        *,
        min_upload_compile_s: float | None,
        explain_misses: bool,
        flight_policy: FlightPolicy,
        identity: object,
        settings: ConfigValues,
    ) -> None:
        """Set up the chain's state from its built tiers (the constructor's and :func:`as_chain`'s common part)."""
        self._tiers = tiers
        self._local_store = next((t.local for t in tiers if t.local is not None), None)
        self._first = tiers[0]
        self._first.sample_hits(logger)  # a memory hit is timed one in 64 and logged here at DEBUG
        self._first_lookup = self._first.lookup
        self._first_counters = self._first.counters
        #: Index of the first shared tier (len(tiers) if none): where ``get(where="nearby")`` stops.
        self._first_shared = next((i for i, t in enumerate(tiers) if t.policy.shared), len(tiers))
        self._spans = {"all": (0, len(tiers)), "nearby": (0, self._first_shared),
                       "shared": (self._first_shared, len(tiers))}  # fmt: skip
        self._closed = False
        self._kept: list[threading.Thread] = []  # work on the store that close() waits for (lease releases)
        self._kept_lock = threading.Lock()
        self._exit_report: exitreport.Source | None = None
        self._min_upload_compile_s = min_upload_compile_s
        self._explain_misses = explain_misses
        self._flight_policy = flight_policy
        self._compile_tally = CompileTally()
        # Read-recency for the local cap: memory hits touch no file; before the next local write
        # (what can evict) the entries memory used since are touched, at most RECENCY_BATCH of them.
        local_depth = next((i for i, t in enumerate(tiers) if t.local is not None), 0)
        self._recency_local = (tiers[local_depth].local if local_depth > 0 and KEYED_READS
                               and self._first.in_memory is not None else None)  # fmt: skip
        self._recency_depth = local_depth
        self._recency_hits = 0
        self._flight_counts = FlightCounts()
        self._identity = identity
        self._settings = settings
        local_depth = next((i for i, t in enumerate(tiers) if t.local is not None), len(tiers))
        shared = tiers[self._first_shared].entries if local_depth < self._first_shared < len(tiers) else None
        self._boot = boot_fetch_for(self._local_store, shared, settings.boot_fetch_bytes, settings.max_local_bytes,
                                    local_depth)  # a fresh node's first shared lookup also fetches the newest entries
        self._ahead = (ReadAhead(tiers[self._first_shared], tiers[:self._first_shared])
                       if self._first_shared < len(tiers) else None)  # fmt: skip

    @classmethod
    def _around(cls, resource: TierSource) -> TieredProgramCache:
        """A chain of one tier around a bare ``resource`` (see :func:`as_chain`); no setting, no registration."""
        chain = cls.__new__(cls)
        tier = Tier(resource, bare_policy(resource), warn=_BARE_WARNINGS)
        chain._assemble((tier,), min_upload_compile_s=None, explain_misses=False, flight_policy=_BARE_FLIGHT_POLICY,
                        identity=resource, settings=ConfigValues())  # fmt: skip
        return chain

    # -- introspection -----------------------------------------------------------

    @property
    def settings(self) -> ConfigValues:
        """Every setting's value for this chain (``compile()`` reads its defaults here): ``cache.settings.lease_ttl``."""
        return self._settings

    @property
    def identity(self) -> object:
        """What this chain stands for: itself, or the bare resource :func:`as_chain` wrapped it around.

        ``compile()``'s per-cache state (thread flights, the saved-seconds memo) is keyed by
        it, so every call given one bare resource shares that state, as calls on one chain do.
        """
        return self._identity

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The chain, fastest first."""
        return self._tiers

    def tier(self, name: str) -> Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self._tiers]}")

    @property
    def local_store(self) -> LocalDir | None:
        """The first local directory tier seen by entry name (where node locks and header scans live), or None."""
        return self._local_store

    @property
    def shared_stores(self) -> tuple[EntryStore, ...]:
        """Every shared tier that is an entry store, fastest first."""
        return tuple(t.entries for t in self._tiers if t.policy.shared and t.entries is not None)

    @property
    def shared_store(self) -> EntryStore | None:
        """The first shared entry store (the cluster's remote), or None for a local-only chain."""
        stores = self.shared_stores
        return stores[0] if stores else None

    @property
    def explain_misses(self) -> bool:
        """True if ``compile()`` logs why each of its misses on this cache missed (the ``explain_misses`` setting)."""
        return self._explain_misses

    @property
    def flight_policy(self) -> FlightPolicy:
        """When ``compile()`` takes a cluster lease and how long it waits for another node's (the settings)."""
        return self._flight_policy

    @property
    def compile_tally(self) -> CompileTally:
        """The compiler runs and seconds :func:`tiered_progcache.compiling.compile` spent and saved through this cache."""
        return self._compile_tally

    @property
    def flight_counts(self) -> FlightCounts:
        """The flight decisions across nodes :func:`tiered_progcache.compiling.compile` made through this cache."""
        return self._flight_counts

    def stats(self) -> CacheStats:
        """An immutable per-tier snapshot, the compiles and the flight decisions; ``after - before`` gives one run's."""
        compiling = self._compile_tally.snapshot()  # first: it may read hits' manifests, which the tiers count
        return CacheStats(tuple((t.name, t.snapshot()) for t in self._tiers), compiling, self._flight_counts.snapshot())

    def __repr__(self) -> str:
        chain = " -> ".join(f"{t.name}:{type(t.resource).__name__}" for t in self._tiers)
        return f"TieredProgramCache({chain})"

    # -- reads ---------------------------------------------------------------------

    def get(self, key: bytes | str, default: bytes | None = None, *, where: str = "all") -> bytes | None:
        """The entry of ``key`` from the first tier that holds it (copied into faster tiers), else ``default``.

        ``where`` (:data:`WHERE`): ``"nearby"`` reads only the tiers in front of the first
        shared one (memory, the local directory), ``"shared"`` only that one and those after.
        The two halves are one ``get``, counted and promoted the same way: ``compile()``
        looks nearby first, then races the shared lookup with a compile. A
        :class:`~tiered_progcache.chain.stats.MetadataKey` is read as metadata (promoted,
        not counted as a lookup).
        """
        if type(key) is bytes and where == "all":  # the fast path: the first tier's own lookup, then the rest
            data = self._first_lookup(key)
            if data is not None:
                return data
            return self._read(key, 1, len(self._tiers), default, looked_from=0)
        try:
            start, stop = self._spans[where]
        except (KeyError, TypeError):
            raise ValueError(f"where must be one of {', '.join(WHERE)}, got {where!r}") from None
        if isinstance(key, MetadataKey):
            return self._get_metadata(bytes(key), start, stop, default)
        return self._read(key if type(key) is bytes else as_key_bytes(key), start, stop, default)

    def _read(self, k: bytes, start: int, stop: int, default: bytes | None, *, looked_from: int | None = None
              ) -> bytes | None:
        """Tiers ``start:stop`` in order: the first hit, promoted into the faster tiers; else ``default``.

        ``looked_from``: where this lookup began, when tiers before ``start`` were read already (its DEBUG line).
        """
        for depth in range(start, stop):
            tier = self._tiers[depth]
            fetched = None
            if depth == self._first_shared:
                fetched = None if self._ahead is None else self._ahead.take(k)  # read already: not the batch's wait
                if fetched is not None and self._boot is not None:
                    self._boot.entry_asked(k)  # an entry read ahead: the batch may land; no wait for it
                elif self._boot is not None and self._boot.landed(k):
                    data = self._tiers[self._boot.local_depth].lookup(k)  # the boot fetch brought it
                    if data is not None:
                        self._promote(k, data, self._boot.local_depth)
                        tier.forgo_uploads(k)  # the batch read it from this tier
                        return data
            data = tier.lookup(k) if fetched is None else tier.lookup_fetched(k, fetched)
            if data is not None:
                self._promote(k, data, depth)
                if depth and logger.isEnabledFor(logging.DEBUG):  # the first tier logs its own hits
                    logger.debug("lookup %s: %s hit (%d bytes)", k[:8].hex(), tier.name, len(data))
                return data
        if logger.isEnabledFor(logging.DEBUG):
            first = start if looked_from is None else looked_from
            where = "every tier" if stop - first == len(self._tiers) else \
                ", ".join(t.name for t in self._tiers[first:stop]) or "no tier"
            logger.debug("lookup %s: miss in %s", k[:8].hex(), where)
        return default

    def _get_metadata(self, k: bytes, start: int, stop: int, default: bytes | None) -> bytes | None:
        """A :class:`MetadataKey`'s read: tiers ``start:stop`` in order, promoted, not counted as a lookup.

        At the shared tier it is a lookup for the boot fetch as an entry's is: a fresh node's first
        (direct mode's manifest) starts it, while the local directory is still empty; the batch lands
        after an entry's lookup (:meth:`.BootFetch.landed`)."""
        for depth in range(start, stop):
            if depth == self._first_shared and self._boot is not None and self._boot.landed(k, entry=False):
                data = self._tiers[self._boot.local_depth].lookup_metadata(k)  # the boot fetch brought it
                if data is not None:
                    self._promote(k, data, self._boot.local_depth)
                    return data
            data = self._tiers[depth].lookup_metadata(k)
            if data is not None:
                self._promote(k, data, depth)
                return data
        return default

    def _refresh_read_recency(self) -> None:
        """Touch the local files of the entries memory served since the last call (their share of its LRU order).

        cuda-core's local cap evicts the oldest atime first; without this a kernel served
        from memory all day would be the first evicted. Called before each local write and at close.
        """
        local = self._recency_local
        if local is None:
            return
        hits = self._first_counters.hits
        fresh = hits - self._recency_hits
        if fresh <= 0:
            return
        self._recency_hits = hits
        for key in self._first.in_memory.recent_keys(min(fresh, RECENCY_BATCH)):
            local.touch_key(key)

    def _promote(self, k: bytes, data: bytes, depth: int) -> None:
        if depth > self._recency_depth:  # the promotion writes the local directory: it may evict
            self._refresh_read_recency()
        for faster in self._tiers[:depth]:
            if faster.policy.promote:
                faster.store(k, data, promotion=True)

    def read_ahead(self, key: bytes) -> None:
        """Start reading entry ``key`` from the shared tier now, for a lookup about to ask for it.

        Unless a tier in front of it holds the entry. The next lookup of ``key`` that reaches the
        shared tier takes this read's answer and is counted as usual; one no lookup takes costs a
        request and is not counted (:mod:`.readahead`). No-op without a shared tier. Thread-safe.
        """
        if self._ahead is not None:
            if self._boot is not None:
                self._boot.asked(key)  # read once: a batch picked after this leaves it out
            self._ahead.start(key)

    def __getitem__(self, key: bytes | str) -> bytes:
        data = self.get(key)
        if data is None:
            raise KeyError(key)
        return data

    # -- writes --------------------------------------------------------------------

    def __setitem__(self, key: bytes | str, value: bytes | bytearray | memoryview | ObjectCode) -> None:
        k = as_key_bytes(key)
        data = extract_bytes(value)
        # What Program.compile(cache=...) does after its miss ran NVRTC: one NVRTC run, its seconds unseen.
        self._compile_tally.count_compile(None)
        self._refresh_read_recency()
        for tier in self._tiers:
            tier.store(k, data)

    def put(
        self,
        key: bytes | str,
        value: bytes | bytearray | memoryview | ObjectCode,
        *,
        compile_seconds: float | None = None,
    ) -> None:
        """``cache[key] = value``, with admission: ``compile()`` says how long the compile took.

        An entry whose ``compile_seconds`` is under the ``min_upload_compile_s`` setting
        is written to the non-shared tiers only (memory, local directory): cheaper to
        compile again elsewhere than to upload. ``None`` (not known) writes every tier.
        """
        if compile_seconds is not None and (
            isinstance(compile_seconds, bool) or not isinstance(compile_seconds, (int, float))
        ):
            raise TypeError(f"compile_seconds must be a number of seconds or None, got {type(compile_seconds).__name__}")
        if compile_seconds is not None and not 0 <= compile_seconds < float("inf"):
            raise ValueError(f"compile_seconds must be a non-negative, finite number, got {compile_seconds!r}")
        k = as_key_bytes(key)
        data = extract_bytes(value)
        threshold = self._min_upload_compile_s
        local_only = threshold is not None and compile_seconds is not None and compile_seconds < threshold
        self._refresh_read_recency()
        for tier in self._tiers:
            if not (local_only and tier.policy.shared):
                tier.store(k, data)

    def __delitem__(self, key: bytes | str) -> None:
        """Remove ``key`` from every writable tier (a writable remote too); KeyError if none held it.

        A queued upload of ``key`` is cancelled. If a tier fails to delete (a remote
        during an outage), every other tier still deletes and then
        :class:`~tiered_progcache.errors.DeleteFailed` names the failing tiers: a
        delete logged and forgotten would let the entry come back from the remote.
        """
        k = as_key_bytes(key)
        held = False
        failed: list[tuple[str, Exception]] = []
        for tier in self._tiers:
            try:
                held = tier.delete(k) or held
            except Exception as exc:
                failed.append((tier.name, exc))
        if failed:
            named = "; ".join(f"tier {name}: {one_line(exc)}" for name, exc in failed)
            raise DeleteFailed(
                f"the entry may still be served: {named}", tuple(name for name, _ in failed)
            ) from failed[0][1]
        if not held:
            raise KeyError(key)

    def update(
        self,
        items: Mapping[bytes | str, Any] | Iterable[tuple[bytes | str, Any]],
        /,
    ) -> None:
        if isinstance(items, Mapping):
            items = items.items()
        for key, value in items:
            self[key] = value

    def __len__(self) -> int:
        counts = [tier.count() for tier in self._tiers if not tier.policy.shared]
        return max((n for n in counts if n is not None), default=0)

    def clear(self) -> None:
        """Empty every non-shared, writable tier. A shared remote is never wiped from here."""
        for tier in self._tiers:
            if not (tier.policy.shared or tier.policy.read_only):
                tier.clear()

    # -- background writes -------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued background writes; False if ``timeout`` (seconds, all tiers) ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for tier in self._tiers:
            if tier.writeback is not None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                done = tier.writeback.flush(remaining) and done
        return done

    def wait_uploaded(self, key: bytes | str, timeout: float | None = None) -> bool:
        """Wait until no background write of ``key`` is queued or under way; False if ``timeout`` ran out.

        Writes queued after it do not hold it up (``flush`` waits for those too).
        """
        k = as_key_bytes(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for tier in self._tiers:
            if tier.writeback is not None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                done = tier.writeback.wait_for(k, remaining) and done
        return done

    def expedite_uploads(self, since: int) -> None:
        """Send the background writes submitted after ``since`` (``writeback.submission_mark()``) first."""
        for tier in self._tiers:
            if tier.writeback is not None:
                tier.writeback.expedite(since)

    def keep_until_closed(self, thread: threading.Thread) -> None:
        """Have :meth:`close` wait for ``thread`` (started; work on this cache's tiers, such as a lease's release
        after its upload) before it closes them: a cache closed right after a compile still releases its lease."""
        with self._kept_lock:
            self._kept = [t for t in self._kept if t.is_alive()]
            self._kept.append(thread)

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the boot fetch, drain background writes, then the work kept by :meth:`keep_until_closed` (all within
        ``timeout`` seconds), report the counters once (the uploads it waited for in them), and release every tier.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._refresh_read_recency()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._boot is not None:
            self._boot.close(timeout)  # before the tiers it reads and writes close
        for tier in self._tiers:
            if tier.writeback is not None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                tier.writeback.close(remaining)
        with self._kept_lock:
            kept, self._kept = self._kept, []
        for thread in kept:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._exit_report is not None:
            self._exit_report.close()  # the last report: one line per closed cache, none again at exit
        for tier in self._tiers:
            tier.close()

    def __enter__(self) -> TieredProgramCache:
        return self

    # -- bulk transfer with the remote ---------------------------------------------------

    def warm(
        self, names: Iterable[str] | None = None, *, max_bytes: int | None = None, progress: Any = None,
        landed: Callable[[bytes, str], object] | None = None,
    ) -> TransferReport:
        """Prefetch the nearest shared tier's entries into the local directory (see ``transfer.warm``).

        >>> cache.warm(max_bytes=20 << 30)  # at node start-up: the newest 20 GB, one listing, batched reads

        After it, ``compile()`` of anything it fetched asks the remote nothing, and NVRTC is
        loaded (:func:`_load_compiler`): a node's first hit pays neither at its first kernel.
        ``landed(payload, kind)``: called with each entry written, on a writer thread
        (``tiered_progcache.warm`` hashes the headers the direct manifests name).
        """
        from . import transfer

        remote, local = self._remote_and_local("warm")
        report = transfer.warm(remote, local, names, max_bytes=max_bytes, progress=progress, landed=landed)
        _load_compiler()
        return report

    def push(self, names: Iterable[str] | None = None, *, progress: Any = None) -> TransferReport:
        """Upload local entries the nearest shared tier lacks (see ``transfer.push``); e.g. at the end of a CI job.

        >>> cache.push().entries
        """
        from . import transfer

        remote, local = self._remote_and_local("push")
        return transfer.push(local, remote, names, progress=progress)

    def _remote_and_local(self, what: str) -> tuple[EntryStore, LocalDir]:
        """The nearest shared tier and the local directory (``warm``/``push`` of one chain)."""
        remote = self.shared_store
        local = self.local_store
        if remote is None or local is None:
            raise ValueError(f"{what} needs a remote (shared) tier and a local directory tier; the chain is {self!r}")
        return remote, local

    # -- construction from the environment ---------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TieredProgramCache:
        """Build the cache from ``TIERED_PROGCACHE_*`` variables (see docs/configuration.md)."""
        return cls.from_config(ConfigValues.from_env(environ, **overrides))

    @classmethod
    def from_config(cls, config: ConfigValues, *, tiers: Sequence[TierSpec] | None = None) -> TieredProgramCache:
        """The chain ``config`` describes (``tiers``: those, with ``config``'s chain-wide settings); ``settings`` is ``config``."""
        cache = cls(tiers=default_chain(config) if tiers is None else tiers, **config.chain_wide())
        cache._settings = config  # the same chain-wide values, and the rest with where each came from
        return cache


#: The flight policy of a bare resource's chain: the settings' defaults (a bare resource has no settings).
_BARE_FLIGHT_POLICY = FlightPolicy()
#: One rate limit for every bare resource's warnings: a chain around one is built per call.
_BARE_WARNINGS = RateLimitedLogger(logging.getLogger(Tier.__module__))


def _load_compiler() -> None:
    """Have cuda-core load NVRTC now: its key asks NVRTC's version on first use (10 ms on an idle host, far more
    on a busy one), so a node's boot-time ``warm()`` pays it rather than its first hit. Never raises: a
    missing NVRTC is the first compile's error to give."""
    try:
        make_program_cache_key(code="", code_type="c++", options=ProgramOptions(arch="sm_90"), target_type="cubin")
    except Exception as exc:
        logger.debug("could not load NVRTC at warm(): %r", exc)


def as_chain(cache: TierSource) -> TieredProgramCache:
    """``cache`` itself if it is a chain, else a chain of one tier around the bare resource.

    >>> chain = as_chain(InMemoryProgramCache())     # what compile(), explain() and single-flight work on

    The public entry points call it, so only chains travel inward. A bare resource's tier
    is named and shaped as in ``tiers=[...]`` (``memory``, ``local``, a shared ``remote``,
    else ``cache``) but written synchronously, with no admission threshold, no
    ``explain_misses`` and the default flight policy; its failures follow the chain's
    failure policy (docs/architecture.md, "A bare resource"). Cheap: no settings are read,
    nothing is registered, no thread is started.
    """
    if isinstance(cache, TieredProgramCache):
        return cache
    if not isinstance(cache, (ProgramCacheResource, EntryStore)):
        raise TypeError(f"cache must be a cuda.core ProgramCacheResource (a TieredProgramCache, say) or a "
                        f"tiered_progcache EntryStore, got {type(cache).__name__}")  # fmt: skip
    return TieredProgramCache._around(cache)


def require_chain(cache: object, what: str = "cache", *, none_ok: bool = False) -> None:
    """A ``TypeError`` saying ``what`` must be a :class:`TieredProgramCache` (or None, with ``none_ok``) unless it is.

    For the APIs that hold a chain beyond one call (``metrics.register``, ``triton.use_shared_cache``),
    where a chain built around a bare resource would be dropped with its counters.
    """
    if not (isinstance(cache, TieredProgramCache) or (none_ok and cache is None)):
        raise TypeError(f"{what} must be a TieredProgramCache{' or None' if none_ok else ''}, "
                        f"got {type(cache).__name__}")  # fmt: skip


def default_chain(config: ConfigValues) -> list[TierSpec]:
    """The chain ``config`` describes: memory -> the local directory -> each shared tier named, in order.

    ``redis://``, ``rediss://`` and ``unix://`` URLs are Redis tiers (named ``redis``),
    every other URL an fsspec remote (named ``remote``); a second of a kind gets ``2``.
    A local directory that cannot be created or opened is left out with a warning.
    """
    local_root = config.local_dir if config.local_dir is not None else default_local_dir()
    # first: a bad signing key file is raised before any directory is made
    shared = shared_chain(config, down_memo=DownMemo(local_root))
    specs: list[TierSpec] = [(InMemoryProgramCache(max_size_bytes=config.max_memory_bytes), TierPolicy("memory"))]
    try:
        local = FileStreamProgramCache(local_root, max_size_bytes=config.max_local_bytes)
    except OSError as exc:
        # A directory that cannot be made (read-only home, a path under a file) is an
        # outage of one tier, not a reason to fail every compile: the others still work.
        logger.warning(
            "local cache directory %s is unusable, running without the local tier: %s", local_root, one_line(exc)
        )
    else:
        specs.append((local, TierPolicy("local")))
    return specs + shared


def shared_chain(
    config: ConfigValues, *, namespace: str = "entries", down_memo: DownMemo | None = None
) -> list[TierSpec]:
    """The shared tiers ``config`` names, in order (the tail of :func:`default_chain`), on entries of ``namespace``.

    ``redis://``, ``rediss://`` and ``unix://`` URLs are Redis tiers (named ``redis``),
    every other URL an fsspec remote (named ``remote``); a second of a kind gets ``2``.
    Each is written in the background. :mod:`tiered_progcache.triton` builds its chain
    from this alone (``namespace="triton"``): the same tiers, settings and envelope, and
    no local directory. ``down_memo``: where failed probes are remembered for the next process
    (:mod:`~tiered_progcache.chain.downmemo`; the default chain's local directory).
    """
    signing_key = config.read_signing_key()  # read (and its problems raised) even without a remote
    specs: list[TierSpec] = []
    names: set[str] = set()
    for url in remote_urls(config.remote):
        shared, kind = shared_tier(config, url, signing_key=signing_key, namespace=namespace, down_memo=down_memo)
        name, n = kind, 2
        while name in names:
            name, n = f"{kind}{n}", n + 1
        names.add(name)
        policy = TierPolicy(name, read_only=config.remote_read_only, write="background", shared=True)
        specs.append((shared, policy))
    return specs


def shared_tier(
    config: ConfigValues,
    url: str,
    *,
    signing_key: bytes | str | None = None,
    create_root: bool | None = None,
    namespace: str = "entries",
    down_memo: DownMemo | None = None,
) -> tuple[SharedEntryStore, str]:
    """The shared tier ``url`` names, built as ``config`` says, and its kind (``"redis"`` or ``"remote"``).

    ``create_root`` overrides the ``create_remote_root`` setting (the command's reading
    commands pass False: they never create anything); ``namespace`` picks the entries it
    holds (``"triton"`` for Triton's files). With ``down_memo`` (and not ``strict``), a probe
    that failed in another process within :data:`~.downmemo.DOWN_MEMO_S` is not repeated: the
    tier starts with its breaker open; a probe made here is remembered there, failed or not.
    """
    common: dict[str, Any] = dict(
        read_only=config.remote_read_only,
        signing_key=signing_key,
        compression=config.compression,
        timeout=config.remote_timeout,
        strict=config.strict,
        transfer_concurrency=config.transfer_concurrency,
        namespace=namespace,
    )
    recalled = None if down_memo is None or config.strict else down_memo.recall(url)
    if recalled is not None:
        message, left = recalled
        breaker = CircuitBreaker(name=f"{'redis' if is_redis_url(url) else 'remote'} cache {mask_url(url)}")
        breaker.trip(RemoteDown(f"{message} (found down {DOWN_MEMO_S - left:.0f} s ago on this node; remove "
                                f"{down_memo.path(url)} to probe now)"))  # fmt: skip
        common["breaker"] = breaker
    if is_redis_url(url):
        shared: SharedEntryStore = RedisProgramCache.from_url(url, expire_s=config.redis_expire_s, **common)
        kind = "redis"
    else:
        from ..stores.remote import RemoteProgramCache

        create = config.create_remote_root if create_root is None else create_root
        shared = RemoteProgramCache.from_url(url, storage_options=config.remote_options, create_root=create, **common)
        kind = "remote"
    if down_memo is not None and recalled is None:
        memo = down_memo

        def remember_probe() -> None:
            if shared.breaker.state == "open":  # its probe failed: the next process need not pay it again
                memo.remember(url, mask_url(shared.breaker.last_error))
            else:
                memo.forget(url)

        shared.when_ready(remember_probe)
    return shared, kind


def _build_tiers(
    specs: Sequence[TierSpec], max_pending_uploads: int, max_pending_upload_bytes: int | None
) -> tuple[Tier, ...]:
    built: list[Tier] = []
    names: set[str] = set()
    for index, spec in enumerate(specs):
        if isinstance(spec, tuple):
            if len(spec) != 2 or not isinstance(spec[1], TierPolicy):
                raise TypeError("a tier given as a tuple must be (ProgramCacheResource or EntryStore, TierPolicy)")
            resource, policy = spec
        else:
            resource, policy = spec, None
        if not isinstance(resource, (ProgramCacheResource, EntryStore)):
            raise TypeError(f"tier {index} must be a cuda.core.utils.ProgramCacheResource or a tiered_progcache "
                            f"EntryStore, got {type(resource).__name__}")  # fmt: skip
        if policy is None:
            policy = default_policy(resource, f"tier{index}")
            base, n = policy.name, 2
            while policy.name in names:
                policy = TierPolicy(f"{base}{n}", policy.read_only, policy.promote, policy.write, policy.shared)
                n += 1
        if policy.name in names:
            raise ValueError(f"two tiers are named {policy.name!r}")
        names.add(policy.name)
        built.append(
            Tier(
                resource,
                policy,
                max_pending_writes=max_pending_uploads,
                max_pending_write_bytes=max_pending_upload_bytes,
            )
        )
    return tuple(built)


@dataclasses.dataclass(frozen=True)
class CacheStores:
    """The entry stores behind a cache: its local directory and its shared store, where it has them."""

    local: LocalDir | None
    shared: EntryStore | None


def stores_of(cache: TierSource) -> CacheStores:
    """The local directory and shared store of any cache ``compile()`` or the command is given.

    What :func:`as_chain` of it holds: a chain answers from its tiers; cuda-core's file
    tier is a local directory; a bare shared store (a remote) is the shared store;
    anything else has neither.
    """
    chain = as_chain(cache)
    return CacheStores(chain.local_store, chain.shared_store)
