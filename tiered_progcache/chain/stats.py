"""Per-tier counters and the immutable snapshots that ``stats()`` hands out.

Counters live on the hot path (a memory hit costs well under a microsecond), so
the frequent ones (hits, misses, writes, promotions and their bytes) are plain
``int`` attributes bumped without a lock by :class:`TierCounters`' ``count_*``
methods: under the GIL an ``obj.attr += n`` with no call inside it is not
interleaved with another thread's, because CPython only switches threads at calls
and backward jumps. The rest go through :meth:`TierCounters.add`, which locks (its
``getattr``/``setattr`` are calls). On a free-threaded build (no GIL) the ``count_*``
methods take the lock too, chosen once when the class is defined, so every counter
stays exact there as well.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import cachetools

__all__ = ["FLIGHT_DECISIONS", "GIL_DISABLED", "UNCACHEABLE_REASONS", "CacheStats", "CompileTally", "CompileTotals",
           "FlightCounts", "MetadataKey", "TierCounters", "TierStats", "uncacheable_reason"]

#: True on a free-threaded build running without the GIL: plain ``+=`` on a shared int loses counts there.
GIL_DISABLED = hasattr(sys, "_is_gil_enabled") and not sys._is_gil_enabled()
_LATENCY_WINDOW = 2048  # most recent samples kept per operation for percentiles

#: The decisions a missed compile's flight across nodes ends in (docs/cluster.md, "Every decision counted").
FLIGHT_DECISIONS = ("raced_won", "raced_found", "held", "waited", "found_under_lease", "failed", "gave_up", "no_lease")

#: Fields of :class:`TierStats` that count events and so subtract; the others are
#: gauges (entries held, latency percentiles) that a difference keeps from ``after``.
COUNTER_FIELDS = (
    "hits",
    "misses",
    "writes",
    "promotions",
    "errors",
    "timeouts",
    "skipped",
    "dropped",
    "forgone",
    "rejected",
    "bytes_read",
    "bytes_written",
)


@dataclasses.dataclass(frozen=True)
class TierStats:
    """What one tier did since the cache was built (or since ``before``, after a subtraction).

    ``rejected`` counts entries refused by integrity or signature checks, ``skipped``
    the operations not attempted while a failing remote cools down, ``dropped`` the
    background writes lost to a full queue, ``forgone`` the queued ones a lookup made needless
    (it found the entry there, so its upload, manifest and symbol map included, would write
    nothing). ``entries``/``bytes_held`` are ``None`` where the tier cannot tell cheaply (a
    remote bucket). Latencies are in milliseconds over the most recent operations.
    """

    hits: int = 0
    misses: int = 0
    writes: int = 0
    promotions: int = 0
    errors: int = 0
    timeouts: int = 0
    skipped: int = 0
    dropped: int = 0
    forgone: int = 0
    rejected: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    entries: int | None = None
    bytes_held: int | None = None
    get_p50_ms: float | None = None
    get_p99_ms: float | None = None
    put_p50_ms: float | None = None
    put_p99_ms: float | None = None

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    def __sub__(self, other: TierStats) -> TierStats:
        if not isinstance(other, TierStats):
            return NotImplemented
        delta = {name: getattr(self, name) - getattr(other, name) for name in COUNTER_FIELDS}
        return dataclasses.replace(self, **delta)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CacheStats(Mapping[str, TierStats]):
    """An immutable snapshot of every tier, fastest first, keyed by tier name.

    >>> before = cache.stats(); run(); print((cache.stats() - before)["local"].hits)
    """

    tiers: tuple[tuple[str, TierStats], ...]
    #: What ``compile()`` and ``Program.compile(cache=...)`` did through the chain: NVRTC runs, seconds, uncacheable.
    compiling: CompileTotals = dataclasses.field(default_factory=lambda: CompileTotals())
    #: Flight decisions across nodes, decision -> count (every one of :data:`FLIGHT_DECISIONS`).
    flight: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FLIGHT_DECISIONS, 0),
                                                  hash=False)

    def __getitem__(self, name: str) -> TierStats:
        for tier_name, tier_stats in self.tiers:
            if tier_name == name:
                return tier_stats
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def __sub__(self, other: CacheStats) -> CacheStats:
        if not isinstance(other, CacheStats):
            return NotImplemented
        earlier = dict(other.tiers)
        return CacheStats(
            tuple((name, now - earlier[name]) if name in earlier else (name, now) for name, now in self.tiers),
            self.compiling - other.compiling,
            {decision: n - other.flight.get(decision, 0) for decision, n in self.flight.items()},
        )

    @property
    def hits(self) -> int:
        """Lookups answered by some tier."""
        return sum(s.hits for _, s in self.tiers)

    @property
    def misses(self) -> int:
        """Lookups no tier could answer (the slowest tier's misses)."""
        return self.tiers[-1][1].misses if self.tiers else 0

    @property
    def compiles(self) -> int:
        """NVRTC runs through the chain: ``compile()``'s (uncacheable ones too) and ``Program.compile(cache=)``'s misses."""
        return self.compiling.compiles

    @property
    def uncacheable(self) -> dict[str, int]:
        """Compiles that could not be cached, by reason (:data:`UNCACHEABLE_REASONS`): compiled every time."""
        return dict(self.compiling.uncacheable)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """JSON-ready: ``{tier name: {field: value}}``."""
        return {name: s.as_dict() for name, s in self.tiers}


def _under_lock(count: Callable[..., None]) -> Callable[..., None]:
    """``count`` holding the counters' lock: the free-threaded form of a ``count_*`` method."""

    @functools.wraps(count)
    def locked(self: TierCounters, *args: int) -> None:
        with self._lock:
            count(self, *args)

    return locked


class TierCounters:
    """The mutable counters behind one tier's :class:`TierStats`."""

    __slots__ = (*COUNTER_FIELDS, "_get_ms", "_put_ms", "_lock")

    def __init__(self) -> None:
        for name in COUNTER_FIELDS:
            setattr(self, name, 0)
        self._get_ms: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self._put_ms: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self._lock = threading.Lock()

    # The frequent counts. Each body has no call in it, so under the GIL it is exact
    # without a lock; callers take ``len(data)`` before calling, for the same reason.

    def count_hit(self, size: int) -> None:
        self.hits += 1
        self.bytes_read += size

    def count_miss(self) -> None:
        self.misses += 1

    def count_write(self, size: int) -> None:
        self.writes += 1
        self.bytes_written += size

    def count_promotion(self) -> None:
        self.promotions += 1

    if GIL_DISABLED:  # pragma: no cover - free-threaded builds only
        count_hit = _under_lock(count_hit)
        count_miss = _under_lock(count_miss)
        count_write = _under_lock(count_write)
        count_promotion = _under_lock(count_promotion)

    def add(self, name: str, amount: int = 1) -> None:
        """Add under the lock: ``getattr`` and ``setattr`` are calls, and a thread switch between
        them loses counts even under the GIL. For the rare counters (errors, timeouts, ...)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def record_get(self, ms: float) -> None:
        self._get_ms.append(ms)  # deque.append is atomic

    def record_put(self, ms: float) -> None:
        self._put_ms.append(ms)

    def snapshot(self, *, entries: int | None = None, bytes_held: int | None = None) -> TierStats:
        get_p50, get_p99 = _percentiles(self._get_ms)
        put_p50, put_p99 = _percentiles(self._put_ms)
        return TierStats(
            **{name: getattr(self, name) for name in COUNTER_FIELDS},
            entries=entries,
            bytes_held=bytes_held,
            get_p50_ms=get_p50,
            get_p99_ms=get_p99,
            put_p50_ms=put_p50,
            put_p99_ms=put_p99,
        )


def _percentiles(samples: collections.deque[float]) -> tuple[float | None, float | None]:
    ordered = sorted(list(samples))
    if not ordered:
        return None, None
    last = len(ordered) - 1
    return ordered[round(0.50 * last)], ordered[round(0.99 * last)]


@dataclasses.dataclass(frozen=True)
class CompileTotals:
    """What :func:`tiered_progcache.compiling.compile` did through one cache: compiler runs and seconds. Immutable."""

    compiles: int = 0
    compile_seconds: float = 0.0
    saved_seconds: float = 0.0
    #: (reason, compiles) for the compiles that could not be cached, reasons as :func:`uncacheable_reason` names them.
    uncacheable: tuple[tuple[str, int], ...] = ()
    #: Hits whose entry's compile time this node could not tell (no manifest near it): not in ``saved_seconds``.
    hits_without_compile_time: int = 0

    @property
    def uncacheable_count(self) -> int:
        return sum(n for _, n in self.uncacheable)

    def __sub__(self, other: CompileTotals) -> CompileTotals:
        before = dict(other.uncacheable)
        left = tuple((reason, n - before.get(reason, 0)) for reason, n in self.uncacheable if n != before.get(reason, 0))
        return CompileTotals(
            self.compiles - other.compiles,
            self.compile_seconds - other.compile_seconds,
            self.saved_seconds - other.saved_seconds,
            left,
            self.hits_without_compile_time - other.hits_without_compile_time,
        )


class CompileTally:
    """The compiler runs and seconds ``compile()`` spent and saved through one cache (behind ``stats --run``,
    the directory's cumulative ``stats``). Counted once per compile or hit, never per lookup; thread-safe.

    ``saved_seconds`` sums the compile time each hit's manifest records; a hit whose entry has none near
    this node is counted in ``hits_without_compile_time`` instead. A hit may leave that read to the next
    snapshot (:meth:`count_saved_later`): the hit itself then reads nothing more.
    """

    __slots__ = ("_compiles", "_compile_seconds", "_saved_seconds", "_hits_without_compile_time", "_uncacheable",
                 "_logged", "_pending", "_lock")

    def __init__(self) -> None:
        self._compiles = 0
        self._compile_seconds = 0.0
        self._saved_seconds = 0.0
        self._hits_without_compile_time = 0
        self._uncacheable: dict[str, int] = {}
        self._logged: cachetools.LRUCache[bytes, bool] = cachetools.LRUCache(_MAX_LOGGED_KEYS)
        self._pending: dict[bytes, tuple[Callable[[], float | None], int]] = {}  # key -> (its read, hits)
        self._lock = threading.Lock()

    def count_compile(self, seconds: float | None) -> None:
        """One NVRTC run; ``seconds`` None where it ran out of sight (``Program.compile(cache=)``'s miss)."""
        with self._lock:
            self._compiles += 1
            if seconds:
                self._compile_seconds += seconds

    def count_uncacheable(self, reason: str, key: bytes) -> bool:
        """One compile that could not be cached, for ``reason``; True the first time for ``key`` (log it then)."""
        label = uncacheable_reason(reason)
        with self._lock:
            self._uncacheable[label] = self._uncacheable.get(label, 0) + 1
            if key in self._logged:
                return False
            self._logged[key] = True  # past the bound the least recently logged key goes (logged again if seen)
            return True

    def count_saved(self, seconds: float | None, hits: int = 1) -> None:
        """``hits`` hits of an entry that took ``seconds`` to compile; None: a time not known here."""
        with self._lock:
            if seconds is None:
                self._hits_without_compile_time += hits
            else:
                self._saved_seconds += seconds * hits

    def count_saved_later(self, key: bytes, read: Callable[[], float | None]) -> None:
        """One hit of ``key`` whose saved seconds ``read()`` gives when a snapshot asks (once per key and snapshot).

        Past :data:`MAX_PENDING_KEYS` keys waiting, they are read now: the wait is bounded.
        """
        with self._lock:
            hits = self._pending[key][1] if key in self._pending else 0
            self._pending[key] = (read, hits + 1)
            full = len(self._pending) > MAX_PENDING_KEYS
        if full:
            self._settle()

    def _settle(self) -> None:
        """Read the saved seconds of the hits waiting (outside the lock: each is a read from a tier)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for read, hits in pending.values():
            self.count_saved(read(), hits)

    def snapshot(self) -> CompileTotals:
        self._settle()
        with self._lock:
            return CompileTotals(self._compiles, self._compile_seconds, self._saved_seconds,
                                 tuple(sorted(self._uncacheable.items())), self._hits_without_compile_time)  # fmt: skip


#: The ``reason`` of an uncacheable compile (the Prometheus label; a few values, never a path).
UNCACHEABLE_REASONS = ("computed_include", "header_too_large", "other")
#: Keys whose uncacheable compile was logged, per tally (the least recently logged dropped past it: a line again).
_MAX_LOGGED_KEYS = 4096
#: Keys whose hits wait for their saved seconds, per tally; one more and they are all read.
MAX_PENDING_KEYS = 1024


def uncacheable_reason(declined: str) -> str:
    """The :data:`UNCACHEABLE_REASONS` entry for a ``CompileKey.declined`` text (the scanner's own words)."""
    if "computed #include" in declined:
        return "computed_include"
    if " bytes" in declined and " over " in declined:
        return "header_too_large"
    return "other"


class MetadataKey(bytes):
    """The key of an entry's metadata (a symbol map): the chain reads it without counting a lookup.

    ``hits`` and ``misses`` then count kernels looked up, one per ``compile()`` call, not the
    reads of what is stored beside them. Equal to, and hashed as, the plain bytes.
    """

    __slots__ = ()


class FlightCounts:
    """How many flights across nodes ended in each decision (:data:`FLIGHT_DECISIONS`) through one cache; thread-safe."""

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._counts = dict.fromkeys(FLIGHT_DECISIONS, 0)
        self._lock = threading.Lock()

    def count(self, decision: str) -> None:
        """One more flight that ended in ``decision``; ValueError for a name not in :data:`FLIGHT_DECISIONS`."""
        if decision not in FLIGHT_DECISIONS:
            raise ValueError(f"unknown flight decision {decision!r}; expected one of {', '.join(FLIGHT_DECISIONS)}")
        with self._lock:
            self._counts[decision] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
