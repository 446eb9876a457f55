"""The flight policy across nodes: what a missed compile is predicted to take (``C``), and its decisions counted.

The case a miss takes, from ``C`` and the store's round trip ``R``, is :func:`~.singleflight.plan`'s.
Every constant is in the table below with its reason (the two poll constants are defined with
:class:`FlightPolicy` in :mod:`tiered_progcache.chain.policy` and re-exported); docs/cluster.md
("When nodes wait") has the arithmetic. Every decision is counted on the chain, reported to
hooks (:func:`on_flight`) and logged at DEBUG.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
from typing import Any, Callable

from ..chain.policy import POLL_FLOOR_S, POLL_GROWTH, UNMEASURED_ROUND_TRIP_S, FlightPolicy, FlightWait
from ..hooks import call_each, subscribe
from ..stores import fsutil

__all__ = ["COMPILE_TIME_WEIGHT", "COMPILE_TIMES_FILE", "DECISIONS", "DEFER_PAST_FILES", "EXIT_POLL_S", "HEADER_BYTES",
           "MAX_PERSISTED_S", "POLL_FLOOR_S", "POLL_GROWTH", "RACE_MIN_CPU_SHARE", "UNMEASURED_ROUND_TRIP_S",
           "UNTIMED_FIXED_S", "UNTIMED_SECONDS_PER_BYTE", "UPLOAD_FLUSH_TIMEOUT_S", "CompileTimes", "FlightDecision",
           "FlightPolicy", "FlightWait", "compile_size", "compile_times", "on_flight", "report", "untimed_estimate"]

logger = logging.getLogger(__name__)

# -- the constants, each with its reason (tests/cluster/test_flightpolicy.py pins every one) ----------------

#: Weight of the newest compile in the running rate: a few compiles follow a change of load.
COMPILE_TIME_WEIGHT = 0.3
#: What one header weighs in a compile's size, in bytes of source (a header costs NVRTC about that much).
HEADER_BYTES = 8192
#: A kind never timed here is predicted at this plus :data:`UNTIMED_SECONDS_PER_BYTE` per byte of size:
#: NVRTC's fixed cost for a small kernel on one core (1 KiB, no header: 25 ms on an H200 host's core).
#: A header-less kernel races a store 10 ms away; one reading a library's headers takes the lease.
UNTIMED_FIXED_S = 0.02
#: See :data:`UNTIMED_FIXED_S` (16 ms a header, with :data:`HEADER_BYTES`).
UNTIMED_SECONDS_PER_BYTE = 2e-6
#: Headers past which a compile no node recorded is flown by its direct key, its scan beside its compile:
#: that many put the untimed estimate over 1 s (long at any round trip under a quarter second), and
#: scanning them (a CCCL kernel reads about 600) is time a cold compile need not wait for.
DEFER_PAST_FILES = 64
#: A running mean of compiles' share of a CPU (each one's CPU time over its wall time) under this says every CPU
#: is busy: a short compile then asks the lookup before it compiles, since a compile the lookup makes needless
#: takes a CPU from work that counts (8 nodes on 2 cores: about 0.25; one node a core: about 1).
RACE_MIN_CPU_SHARE = 0.5
#: The longest compile rate times size, or round trip, a persisted file may claim (above: corrupt, ignored).
MAX_PERSISTED_S = 3600.0
#: How long the lease holder's background thread waits for its upload before releasing the lease anyway.
UPLOAD_FLUSH_TIMEOUT_S = 30.0
#: How often that thread looks whether interpreter exit has begun while it waits.
EXIT_POLL_S = 0.1

#: The file in a local cache directory where a node keeps its compile rates and round trips for its next process.
COMPILE_TIMES_FILE = "compile-times.json"
_TIMES_FORMAT = "tiered-progcache/compile-times"

#: Every decision a flight can end in, as counted in ``cache.stats().flight`` (docs/cluster.md says each).
DECISIONS = ("raced_won", "raced_found", "held", "waited", "found_under_lease", "failed", "gave_up", "no_lease")


def compile_size(source_bytes: int, header_count: int) -> int:
    """A compile's size, in bytes of source: the source plus :data:`HEADER_BYTES` per header it reads."""
    return max(1, source_bytes) + HEADER_BYTES * max(0, header_count)


def untimed_estimate(size: int) -> float:
    """What a compile of ``size`` is predicted to take where nothing of its kind was timed on this node.

    >>> round(untimed_estimate(compile_size(1143, 0)), 6), untimed_estimate(compile_size(300, 400)) > 6
    (0.022286, True)
    """
    return UNTIMED_FIXED_S + UNTIMED_SECONDS_PER_BYTE * max(1, size)


class CompileTimes:
    """This node's compile rate per (code type, target type), the round trips it measured per store, and
    the share of a CPU its compiles got.

    >>> times = CompileTimes(); times.record("c++", "cubin", 9.9, 4000); times.record("c++", "cubin", 0.4, 4000)
    >>> times.predict("c++", "cubin", 8000)
    0.8

    A running mean of seconds per byte of :func:`compile_size`; a code type's first compile in a
    process is not recorded (it carries the compiler's first use: docs/cluster.md). Thread-safe.
    """

    def __init__(self, weight: float = COMPILE_TIME_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._weight = weight
        self._lock = threading.Lock()
        self._rates: dict[tuple[str, str], float] = {}
        self._round_trips: dict[str, float] = {}
        self._used: set[str] = set()  # code types compiled in this process (their first use is behind them)
        self._cpu_share: float | None = None  # running mean of a compile's CPU time over its wall time

    def record(self, code_type: str, target_type: str, seconds: float, size: int) -> bool:
        """Fold one compile in; False (not folded) for a code type's first compile here, or a bad value."""
        code = code_type.lower()
        with self._lock:
            first = code not in self._used
            self._used.add(code)
            if first or not 0.0 <= seconds < math.inf or size <= 0:
                return False
            kind = (code, target_type.lower())
            rate, mean = seconds / size, self._rates.get(kind)
            self._rates[kind] = rate if mean is None else mean + self._weight * (rate - mean)
        return True

    def note_cpu(self, code_type: str, seconds: float, cpu_seconds: float) -> bool:
        """Fold one compile's share of a CPU in (its thread's CPU time over its wall time); False (not folded) for
        a code type's first compile here (its first use reads files: :meth:`record` has not seen it) or a bad value."""
        with self._lock:
            if code_type.lower() not in self._used or not (0.0 < seconds < math.inf and 0.0 <= cpu_seconds < math.inf):
                return False
            share, mean = cpu_seconds / seconds, self._cpu_share
            now = self._cpu_share = share if mean is None else mean + self._weight * (share - mean)
        busy, was_busy = now < RACE_MIN_CPU_SHARE, mean is not None and mean < RACE_MIN_CPU_SHARE
        if busy != was_busy:  # the short case changes its order: say so once, not per compile
            logger.info("compiles here got %.2f of a CPU lately: %s", now,
                        "every CPU is busy, a short compile looks up before it compiles" if busy
                        else "a short compile races its lookup again")
        return True

    def cpu_share(self) -> float | None:
        """The share of a CPU this process's compiles got lately; None before one was measured."""
        with self._lock:
            return self._cpu_share

    def cpu_bound(self) -> bool:
        """True where this process's compiles got under :data:`RACE_MIN_CPU_SHARE` of a CPU lately."""
        share = self.cpu_share()
        return share is not None and share < RACE_MIN_CPU_SHARE

    def predict(self, code_type: str, target_type: str, size: int) -> float | None:
        """Seconds a compile of ``size`` should take; None when nothing of that kind was timed."""
        with self._lock:
            rate = self._rates.get((code_type.lower(), target_type.lower()))
        return None if rate is None else rate * size

    def note_round_trip(self, location: str, seconds: float | None) -> None:
        """Keep ``seconds`` as the round trip this node measured to the store at ``location`` (for :meth:`save`)."""
        if seconds is not None and 0.0 <= seconds <= MAX_PERSISTED_S:
            with self._lock:
                self._round_trips[location] = seconds

    def round_trip(self, location: str) -> float | None:
        """The round trip to ``location`` this node measured last (this process, or one before it); None if never."""
        with self._lock:
            return self._round_trips.get(location)

    def clear(self) -> None:
        """Forget rates, round trips and the CPU share (tests; a changed workload).

        A compiler's first use stays behind it."""
        with self._lock:
            self._rates.clear()
            self._round_trips.clear()
            self._cpu_share = None

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write rates and round trips to ``directory/compile-times.json`` (staged and renamed). Raises OSError."""
        with self._lock:
            kinds = {f"{c}/{t}": {"s_per_byte": rate} for (c, t), rate in self._rates.items()}
            doc = json.dumps({"format": _TIMES_FORMAT, "version": 2, "kinds": kinds,
                              "round_trips": dict(self._round_trips)}, sort_keys=True)
        fsutil.write_atomic(os.path.join(directory, COMPILE_TIMES_FILE), doc.encode(), staging_dir=directory,
                            fsync=False)

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Take what :meth:`save` left in ``directory`` for kinds and stores this process has not measured.

        Anything but a whole document under 64 KiB, or a value outside ``[0, MAX_PERSISTED_S]``, is ignored.
        """
        try:
            with open(os.path.join(directory, COMPILE_TIMES_FILE), encoding="utf-8") as fh:
                doc = json.loads(fh.read(65536))
            if not isinstance(doc, dict) or doc.get("format") != _TIMES_FORMAT:
                return
            kinds, trips = doc.get("kinds"), doc.get("round_trips")
        except (OSError, ValueError, RecursionError):
            return
        with self._lock:
            for name, entry in (kinds.items() if isinstance(kinds, dict) else ()):
                code, sep, target = str(name).partition("/")
                rate = _persisted(entry.get("s_per_byte")) if isinstance(entry, dict) else None
                if sep and rate is not None:
                    self._rates.setdefault((code, target), rate)
            for location, seconds in (trips.items() if isinstance(trips, dict) else ()):
                if _persisted(seconds) is not None:
                    self._round_trips.setdefault(str(location), float(seconds))


def _persisted(value: object) -> float | None:
    """A non-negative, finite, plausible number from a compile-times file; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value <= MAX_PERSISTED_S else None


#: The process's compile times: ``compile()`` records every successful compiler run here (and in the local directory).
compile_times = CompileTimes()


@dataclasses.dataclass(frozen=True)
class FlightDecision:
    """What this process did about one missed entry across nodes: ``choice`` is one of :data:`DECISIONS`. Immutable.

    ``estimate_s`` is ``C``, ``round_trip_s`` the store's ``R`` (None: unknown), ``waited_s`` the wait on a lease.
    """

    name: str
    choice: str
    estimate_s: float | None
    round_trip_s: float | None
    waited_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_hooks_lock = threading.Lock()
_hooks: list[Callable[[FlightDecision], None]] = []


def on_flight(hook: Callable[[FlightDecision], None]) -> Callable[[], None]:
    """Call ``hook(decision)`` for every cross-node single-flight decision in this process; returns an unsubscribe.

    The hook runs on the compiling thread; exceptions it raises are logged and swallowed. Thread-safe.
    """
    return subscribe(_hooks, _hooks_lock, hook)


def report(decision: FlightDecision, count: Callable[[str], None] | None = None) -> None:
    """Count ``decision`` (``count``: the chain's), log it, and hand it to every hook."""
    if count is not None:
        count(decision.choice)
    level = logging.INFO if decision.choice == "gave_up" else logging.DEBUG
    if logger.isEnabledFor(level):
        logger.log(level, "entry %s: %s (C %s, R %s, waited %.3f s)", decision.name[:16], decision.choice,
                   "unknown" if decision.estimate_s is None else f"{decision.estimate_s:.3f} s",
                   "unknown" if decision.round_trip_s is None else f"{decision.round_trip_s * 1e3:.1f} ms",
                   decision.waited_s)
    with _hooks_lock:
        hooks = list(_hooks)
    call_each(hooks, decision, logger, "on_flight")
