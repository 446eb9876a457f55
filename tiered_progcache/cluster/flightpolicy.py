"""The single-flight policy across nodes: when a compile races the lookup, when it takes a lease, how waiters wait.

A cluster lease saves compiles, not time: a node that waits for another's entry pays
round trips a node compiling alone does not. With ``R`` one round trip to the shared
store (observed: :class:`~tiered_progcache.stores.latency.LatencyTracker`) and ``C`` the compile
(predicted: :class:`CompileTimes`, from this node's own compiles and the size of what the
compile reads):

* ``C < lease_min_compile_rtts x R`` (short): the remote lookup and the compile start
  together, no lease; whichever answers first wins. Never slower than compiling alone.
* otherwise, or ``C`` unknown (nothing timed on this node yet): the lease, so the cluster
  compiles once. A waiter waits while the holder's lease is renewed (liveness, not an
  estimate) and compiles itself only once the holder is gone or failed; ``wait_patience``
  (default None) opts into giving up after ``wait_patience x C + 4R + P``, with ``C`` the
  estimate in the holder's lease (evidence about this kernel; never a prior).

The full arithmetic is in docs/cluster.md ("When nodes wait"). Every choice is reported
to hooks (:func:`on_flight`) and logged at DEBUG (a waiter that gave up: INFO).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
import threading
import time
from typing import Any, Callable

from .. import forks
from ..hooks import call_each, subscribe
from ..settings import DEFAULT_COMPILE_TIME_PRIOR_S, DEFAULT_LEASE_MIN_COMPILE_RTTS, DEFAULT_WAIT_PATIENCE
from ..stores.store import EntryStore

__all__ = [
    "COMPILE_TIME_WEIGHT",
    "COMPILE_TIMES_FILE",
    "HEADER_BYTES",
    "LANDING_RTTS",
    "LESSON_WAIT_RTTS",
    "MAX_LESSONS_IN_FLIGHT",
    "POLL_FLOOR_S",
    "POLL_GROWTH",
    "CompileTimes",
    "FlightDecision",
    "FlightPolicy",
    "FlightWait",
    "HitLessons",
    "UNTIMED_FIXED_S",
    "UNTIMED_SECONDS_PER_BYTE",
    "compile_size",
    "compile_times",
    "hit_lessons",
    "on_flight",
    "report",
    "untimed_estimate",
]

logger = logging.getLogger(__name__)

#: The shortest poll period: on a store that answers in microseconds (a local path) a waiter still pauses.
POLL_FLOOR_S = 0.01
#: Round trips between a waiter's first try and it holding the entry, besides the compile and
#: one poll period: the holder's create and look under the lease, its upload, the look that finds it.
LANDING_RTTS = 4
#: A waiter's poll period grows with its wait, to this fraction of the time waited so far: a long
#: compile is learned of at most 2% late, and seven waiters polling do not slow its holder down.
POLL_GROWTH = 0.02
#: Weight of the newest compile time in the running estimate (an exponentially weighted mean).
COMPILE_TIME_WEIGHT = 0.3
#: What one header a compile reads weighs in its size, in bytes of source: a header costs the
#: compiler about as much as that much source (the size is what predicts a compile never timed).
HEADER_BYTES = 8192
#: The file in a local cache directory where a node keeps what its compiles took, for its next process.
COMPILE_TIMES_FILE = "compile-times.json"
_TIMES_FORMAT = "tiered-progcache/compile-times"
#: The longest compile time or rate a persisted file may claim (anything above is ignored as corrupt).
_MAX_PERSISTED_S = 3600.0


#: A compile of a kind this node has timed none of (and no hit has taught) is predicted at
#: this much, plus :data:`UNTIMED_SECONDS_PER_BYTE` per byte of its size: NVRTC's fixed cost
#: for a small kernel on one core (the sample matmul, 1 KiB and no header: 25 ms on an H200
#: host's core), and each header weighing 16 ms. Only whether it is short against the round
#: trip is asked of it: a kernel that reads no headers races a store 30 ms away; one that
#: reads a library's headers (CCCL: hundreds) is long, so it takes the lease and compiles once.
UNTIMED_FIXED_S = 0.02
#: See :data:`UNTIMED_FIXED_S`: seconds per byte of :func:`compile_size` for a kind never timed.
UNTIMED_SECONDS_PER_BYTE = 2e-6


def compile_size(source_bytes: int, header_count: int) -> int:
    """A compile's size, in bytes of source: the source plus :data:`HEADER_BYTES` per header it reads."""
    return max(1, source_bytes) + HEADER_BYTES * max(0, header_count)


def untimed_estimate(size: int) -> float:
    """What a compile of ``size`` (:func:`compile_size`) is predicted to take where nothing of its kind was timed.

    >>> untimed_estimate(compile_size(1143, 0)), untimed_estimate(compile_size(300, 400)) > 6
    (0.022286, True)

    From what the compile reads alone, never from another kernel's time; used only to let a
    small kernel race the shared lookup (:meth:`FlightPolicy.races`), never to stop waiting.
    """
    return UNTIMED_FIXED_S + UNTIMED_SECONDS_PER_BYTE * max(1, size)


class CompileTimes:
    """This node's running estimate of a compile's wall time, per (code type, target type).

    >>> times = CompileTimes(); times.record("c++", "cubin", 0.4, size=4000); times.predict("c++", "cubin", 8000)
    0.8

    Two exponentially weighted means (newest weight :data:`COMPILE_TIME_WEIGHT`), started at
    the first sample: the seconds of a compile, and its seconds per byte of size
    (:func:`compile_size`), which predicts a kernel never timed from what it reads. Wall
    time, so it includes the contention the process compiles under. :meth:`save` and
    :meth:`load` keep them in a local directory (:data:`COMPILE_TIMES_FILE`), so a fresh
    process on a node that compiled before does not start from nothing. Thread-safe.
    """

    def __init__(self, weight: float = COMPILE_TIME_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._weight = weight
        self._lock = threading.Lock()
        self._means: dict[tuple[str, str], float] = {}
        self._rates: dict[tuple[str, str], float] = {}
        self._learned: set[tuple[str, str]] = set()  # kinds whose estimate came from a hit, not a compile here

    def _fold(self, table: dict[tuple[str, str], float], kind: tuple[str, str], value: float) -> None:
        mean = table.get(kind)
        table[kind] = value if mean is None else mean + self._weight * (value - mean)

    def record(self, code_type: str, target_type: str, seconds: float, size: int | None = None) -> None:
        """Fold one compile's wall time (and its size, if known) in; negative or non-finite values are ignored."""
        if not 0.0 <= seconds < float("inf"):
            return
        kind = (code_type.lower(), target_type.lower())
        with self._lock:
            if kind in self._learned:  # this node's first compile of the kind replaces what a hit taught
                self._learned.discard(kind)
                self._means.pop(kind, None)
                self._rates.pop(kind, None)
            self._fold(self._means, kind, seconds)
            if size is not None and size > 0:
                self._fold(self._rates, kind, seconds / size)

    def learn(self, code_type: str, target_type: str, seconds: float, size: int) -> bool:
        """Take a compile time another node measured (an entry's manifest) as this node's first estimate of the kind.

        Only where this node predicts nothing of that kind yet (:meth:`predict` is None): a value read from a shared store
        (unsigned, or signed by any writer) seeds the estimate and never moves one this node
        timed itself, and this node's first compile of the kind replaces it (:meth:`record`). Values
        outside ``[0, 3600]`` s (:data:`_MAX_PERSISTED_S`), or without a positive size, are
        ignored. True if it was taken.
        """
        if not (0.0 <= seconds <= _MAX_PERSISTED_S) or size <= 0:
            return False
        kind = (code_type.lower(), target_type.lower())
        with self._lock:
            if kind in self._rates:
                return False
            if kind not in self._means:
                self._means[kind] = seconds
                self._learned.add(kind)
            self._rates[kind] = seconds / size
        return True

    def estimate(self, code_type: str, target_type: str) -> float | None:
        """The mean in seconds; None before the first compile of that kind on this node."""
        with self._lock:
            return self._means.get((code_type.lower(), target_type.lower()))

    def predict(self, code_type: str, target_type: str, size: int) -> float | None:
        """Seconds a compile of ``size`` (:func:`compile_size`) should take; None when nothing of that kind was timed."""
        with self._lock:
            rate = self._rates.get((code_type.lower(), target_type.lower()))
        return None if rate is None else rate * size

    def clear(self) -> None:
        """Forget every estimate (tests; a process whose workload changed completely)."""
        with self._lock:
            self._means.clear()
            self._rates.clear()
            self._learned.clear()

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the estimates to ``directory/compile-times.json`` (staged and renamed). Raises OSError."""
        with self._lock:
            kinds: dict[str, dict[str, object]] = {
                f"{c}/{t}": {"mean_s": self._means[(c, t)], "s_per_byte": self._rates.get((c, t))}
                for c, t in self._means}
            for c, t in self._learned:
                kinds[f"{c}/{t}"]["learned"] = True  # still only a hit's lesson: the next process knows it too
        doc = json.dumps({"format": _TIMES_FORMAT, "version": 1, "kinds": kinds}, sort_keys=True)
        fd, staged = tempfile.mkstemp(dir=directory, prefix=".compile-times-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(doc)
            os.replace(staged, os.path.join(directory, COMPILE_TIMES_FILE))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            raise

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Take the estimates ``save`` left in ``directory`` for kinds this process has not timed.

        Files that are not whole, plausible documents of under 64 KiB are ignored.
        """
        try:
            with open(os.path.join(directory, COMPILE_TIMES_FILE), encoding="utf-8") as fh:
                doc = json.loads(fh.read(65536))
            kinds = doc["kinds"] if isinstance(doc, dict) and doc.get("format") == _TIMES_FORMAT else {}
            if not isinstance(kinds, dict):
                return
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return
        with self._lock:
            for name, entry in kinds.items():
                code, sep, target = str(name).partition("/")
                if not sep or not isinstance(entry, dict):
                    continue
                kind = (code, target)
                mean, rate = _persisted(entry.get("mean_s")), _persisted(entry.get("s_per_byte"))
                if mean is not None and kind not in self._means:
                    self._means[kind] = mean
                    if rate is not None:
                        self._rates[kind] = rate
                    if entry.get("learned") is True:
                        self._learned.add(kind)


def _persisted(value: object) -> float | None:
    """A non-negative, finite, plausible number from a compile-times file; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value <= _MAX_PERSISTED_S and math.isfinite(value) else None


#: The process's compile times: ``compile()`` records every successful compiler run here (and in the local directory).
compile_times = CompileTimes()


class HitLessons:
    """Manifest reads in flight that may teach this node a kind's compile time from an entry it was served.

    >>> lessons = HitLessons(compile_times); lessons.start(("c++", "cubin"), key, read_seconds, size=4000)
    >>> lessons.wait(("c++", "cubin"), timeout=0.1)   # a compile of that kind, before it plans

    A node whose first kernel of a kind is a hit (a warm node, a waiter) has timed nothing
    of that kind; the entry's manifest holds what the node that compiled it measured.
    ``start`` reads it on a daemon thread (off the hit's path; every request has the
    store's own deadline) and hands it to :meth:`CompileTimes.learn` (a first estimate
    only). At most one read per key and :data:`MAX_LESSONS_IN_FLIGHT` in all; more are not
    started. ``wait`` lets the next compile of that kind plan with what the read brings,
    for at most ``timeout``. Thread-safe.
    """

    def __init__(self, times: CompileTimes) -> None:
        self._times = times
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[tuple[str, str], threading.Event]] = {}

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._pending = {}  # the parent's reading threads do not exist here

    def in_flight(self, kind: tuple[str, str] | None = None) -> int:
        """Reads under way (of ``kind``, or of any)."""
        with self._lock:
            return sum(1 for k, _ in self._pending.values() if kind is None or k == kind)

    def start(self, kind: tuple[str, str], key: bytes, read: Callable[[], float | None], size: int,
              on_learned: Callable[[], None] | None = None) -> bool:
        """Read ``key``'s compile seconds with ``read()`` on a thread and learn them; False if not started."""
        kind = (kind[0].lower(), kind[1].lower())
        done = threading.Event()
        with self._lock:
            if key in self._pending or len(self._pending) >= MAX_LESSONS_IN_FLIGHT:
                return False
            self._pending[key] = (kind, done)

        def lesson() -> None:
            try:
                seconds = read()
                if seconds is not None and self._times.learn(kind[0], kind[1], seconds, size):
                    logger.debug("learned %.3f s for a %s -> %s compile of %d bytes from a hit's manifest",
                                 seconds, kind[0], kind[1], size)
                    if on_learned is not None:
                        on_learned()
            except Exception as exc:  # a lesson is an optimisation: its failure costs only itself
                logger.debug("could not learn from the manifest of %s: %r", key[:8].hex(), exc)
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                done.set()

        threading.Thread(target=lesson, name=f"tiered-progcache-lesson-{key[:4].hex()}", daemon=True).start()
        return True

    def wait(self, kind: tuple[str, str], timeout: float) -> None:
        """Wait until no read of ``kind`` is under way, or ``timeout`` seconds (whichever is first)."""
        kind = (kind[0].lower(), kind[1].lower())
        deadline = time.monotonic() + timeout
        with self._lock:
            events = [done for k, done in self._pending.values() if k == kind]
        for done in events:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                return


#: Manifest reads :class:`HitLessons` runs at once, at most (a node served entries without manifests reads no more).
MAX_LESSONS_IN_FLIGHT = 4
#: A compile of a kind this node has no estimate for waits for a lesson under way of that kind at most this many
#: round trips (plus :data:`POLL_FLOOR_S`): the read was sent with the hit's lookup or right after it.
LESSON_WAIT_RTTS = 2
#: The process's lessons from hits, into :data:`compile_times`.
hit_lessons = HitLessons(compile_times)

forks.register(hit_lessons._after_fork_in_child)


@dataclasses.dataclass(frozen=True)
class FlightPolicy:
    """The knobs of cross-node single-flight (settings rows of the same names). Immutable.

    ``min_upload_compile_s`` is the chain's admission threshold: an entry that will not be
    uploaded is never worth a lease (nobody could get it from the holder).
    ``compile_time_prior_s`` is kept for old configurations: no decision uses a prior any more.
    """

    lease_min_compile_rtts: float = DEFAULT_LEASE_MIN_COMPILE_RTTS
    wait_patience: float | None = DEFAULT_WAIT_PATIENCE
    compile_time_prior_s: float = DEFAULT_COMPILE_TIME_PRIOR_S
    min_upload_compile_s: float | None = None
    poll_floor_s: float = POLL_FLOOR_S

    def takes_lease(self, estimate_s: float | None, round_trip_s: float | None) -> bool:
        """True if a compile predicted at ``estimate_s`` (None: unknown) should take the cluster lease.

        Unknown compiles and unknown round trips (no request timed yet) take it: compile-once
        protection where nothing says the compile is short. An entry under the upload
        threshold would not reach the others, so it takes none.
        """
        if estimate_s is None:
            return self.min_upload_compile_s is None
        if self.min_upload_compile_s is not None and estimate_s < self.min_upload_compile_s:
            return False
        if round_trip_s is None:
            return True
        return estimate_s >= self.lease_min_compile_rtts * round_trip_s

    def races(self, estimate_s: float | None, round_trip_s: float | None) -> bool:
        """True if the compile should start beside the remote lookup (no lease): the estimate is known and short."""
        return estimate_s is not None and not self.takes_lease(estimate_s, round_trip_s)

    def wait_plan(self, store: EntryStore, lease_ttl_s: float = math.inf,
                  clock: Callable[[], float] = time.monotonic) -> FlightWait:
        """How to wait, from now on ``clock``, for another node's compile; its estimate is clamped to ``lease_ttl_s``."""
        return FlightWait(self, store, lease_ttl_s, clock, clock())


@dataclasses.dataclass(frozen=True)
class FlightWait:
    """A waiter's plan (:class:`~tiered_progcache.cluster.lease.WaitPlan`), read live from the store's latency. Immutable.

    Poll period: ``max(floor, R, POLL_GROWTH x the time waited so far)``. Patience: None (wait while the holder's lease is renewed)
    unless ``wait_patience`` is set and the holder's lease carries its estimate for this
    kernel, then ``wait_patience x C + LANDING_RTTS x R + P`` with ``C`` that estimate,
    clamped to the lease TTL.
    """

    policy: FlightPolicy
    store: EntryStore
    lease_ttl_s: float = math.inf
    clock: Callable[[], float] = time.monotonic
    started: float = 0.0

    def _network_period(self) -> float:
        return max(self.policy.poll_floor_s, self.store.round_trip_s or 0.0)

    def poll_period(self) -> float:
        return max(self._network_period(), POLL_GROWTH * (self.clock() - self.started))

    def patience(self, holder_estimate_s: float | None) -> float | None:
        factor = self.policy.wait_patience
        if factor is None or holder_estimate_s is None:
            return None  # no evidence about this kernel: the holder's liveness decides
        compile_s = min(holder_estimate_s, self.lease_ttl_s)
        return factor * compile_s + LANDING_RTTS * (self.store.round_trip_s or 0.0) + self._network_period()


@dataclasses.dataclass(frozen=True)
class FlightDecision:
    """What this process did about one missed entry, across nodes. Immutable.

    ``choice`` is one of:

    * ``"raced"``: predicted short: compiled beside the remote lookup, no lease, and the compile answered first;
    * ``"raced, found"``: the same, and the lookup found the entry first (the compile's result is dropped);
    * ``"short"``: predicted short where nothing was left to race (the lookup already missed): compiled, no lease;
    * ``"held"``: took the lease and compiled (others may wait for it);
    * ``"found"``: the entry turned up right after the lease step (another node, or
      another process here, had just finished), or, for a compile of unknown length, the
      lookup sent beside the lease create found it: no compile;
    * ``"waited"``: got another node's entry while waiting for its lease;
    * ``"failed"``: the holder's compile failed and it published the failure: raised it, no compile;
    * ``"gave up"``: waited the patience (``wait_patience``, opt-in) and compiled itself;
    * ``"timeout"``: waited the caller's ``wait_timeout`` and compiled itself;
    * ``"no lease"``: the lease store failed, compiled without one.

    ``estimate_s`` is the predicted compile (None: unknown); ``waited_s`` the time spent
    waiting on another node's lease (0 unless waited); ``holder_estimate_s`` what that
    holder's lease said its compile would take.
    """

    name: str
    choice: str
    estimate_s: float | None
    round_trip_s: float | None
    waited_s: float = 0.0
    holder_estimate_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_hooks_lock = threading.Lock()
_hooks: list[Callable[[FlightDecision], None]] = []


def on_flight(hook: Callable[[FlightDecision], None]) -> Callable[[], None]:
    """Call ``hook(decision)`` for every cross-node single-flight choice in this process; returns an unsubscribe.

    >>> stop = on_flight(lambda d: log.write(json.dumps(d.as_dict()) + "\\n"))

    The hook runs on the compiling thread; exceptions it raises are logged and swallowed.
    Thread-safe.
    """
    return subscribe(_hooks, _hooks_lock, hook)


def report(decision: FlightDecision) -> None:
    """Log ``decision`` and hand it to every hook."""
    level = logging.INFO if decision.choice == "gave up" else logging.DEBUG
    if logger.isEnabledFor(level):
        logger.log(level, "entry %s: %s (estimate %s, round trip %s, waited %.3f s)", decision.name[:16],
                   decision.choice, "unknown" if decision.estimate_s is None else f"{decision.estimate_s:.3f} s",
                   "unknown" if decision.round_trip_s is None else f"{decision.round_trip_s * 1e3:.1f} ms",
                   decision.waited_s)
    with _hooks_lock:
        hooks = list(_hooks)
    call_each(hooks, decision, logger, "on_flight")
