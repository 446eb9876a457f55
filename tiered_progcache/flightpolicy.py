"""The single-flight policy across nodes: when a compile is worth a cluster lease, and how long others wait for it.

A cluster lease saves compiles, not time: a node that waits for another's entry pays
round trips a node compiling alone does not. With ``R`` one round trip to the shared
store (observed: :class:`~tiered_progcache.latency.LatencyTracker`), ``C`` the compile
(estimated: :class:`CompileTimes`) and ``P`` the poll period (``max(floor, R)``), after
the first miss that every path pays:

* alone: ``R + C`` (one more look, under the node lock);
* the lease holder: ``2R + C`` (the create, one look under the lease); its upload and
  release run in the background;
* a waiter: the holder created its lease before the waiter tried, then looked, compiled
  and uploaded; the waiter's next look starts within ``P``: at most ``C + 4R + P``.

So the lease is taken only when ``C >= lease_min_compile_rtts x R``, and a waiter
compiles itself once it has waited ``wait_patience x C + 4R + P``: what the holder needs
at most. The full arithmetic and the defaults' figures are in docs/cluster.md ("When
nodes wait").

Every choice is reported to hooks (:func:`on_flight`) and logged at DEBUG (a waiter
that gave up: INFO), so a run can show where the policy compiled instead of waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from .hooks import call_each, subscribe
from .settings import DEFAULT_COMPILE_TIME_PRIOR_S, DEFAULT_LEASE_MIN_COMPILE_RTTS, DEFAULT_WAIT_PATIENCE
from .store import EntryStore

__all__ = [
    "COMPILE_TIME_WEIGHT",
    "LANDING_RTTS",
    "POLL_FLOOR_S",
    "CompileTimes",
    "FlightDecision",
    "FlightPolicy",
    "FlightWait",
    "compile_times",
    "on_flight",
    "report",
]

logger = logging.getLogger(__name__)

#: The shortest poll period: on a store that answers in microseconds (a local path) a waiter still pauses.
POLL_FLOOR_S = 0.01
#: Round trips between a waiter's first try and it holding the entry, besides the compile and
#: one poll period: the holder's create and look under the lease, its upload, the look that finds it.
LANDING_RTTS = 4
#: Weight of the newest compile time in the running estimate (an exponentially weighted mean).
COMPILE_TIME_WEIGHT = 0.3


class CompileTimes:
    """This process's running estimate of a compile's wall time, per (code type, target type).

    >>> times = CompileTimes(); times.record("c++", "cubin", 0.4); times.estimate("c++", "cubin")
    0.4

    An exponentially weighted mean (newest weight :data:`COMPILE_TIME_WEIGHT`), started at
    the first sample. Wall time, so it includes the contention the process compiles
    under, which is what compiling alone would cost now. Thread-safe.
    """

    def __init__(self, weight: float = COMPILE_TIME_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._weight = weight
        self._lock = threading.Lock()
        self._means: dict[tuple[str, str], float] = {}

    def record(self, code_type: str, target_type: str, seconds: float) -> None:
        """Fold one compile's wall time in; negative or non-finite values are ignored."""
        if not 0.0 <= seconds < float("inf"):
            return
        kind = (code_type.lower(), target_type.lower())
        with self._lock:
            mean = self._means.get(kind)
            self._means[kind] = seconds if mean is None else mean + self._weight * (seconds - mean)

    def estimate(self, code_type: str, target_type: str) -> float | None:
        """The estimate in seconds; None before the first compile of that kind in this process."""
        with self._lock:
            return self._means.get((code_type.lower(), target_type.lower()))

    def clear(self) -> None:
        """Forget every estimate (tests; a process whose workload changed completely)."""
        with self._lock:
            self._means.clear()


#: The process's compile times: ``compile()`` records every successful compiler run here.
compile_times = CompileTimes()


@dataclasses.dataclass(frozen=True)
class FlightPolicy:
    """The knobs of cross-node single-flight (settings rows of the same names). Immutable.

    ``min_upload_compile_s`` is the chain's admission threshold: an entry that will not be
    uploaded is never worth a lease (nobody could get it from the holder).
    """

    lease_min_compile_rtts: float = DEFAULT_LEASE_MIN_COMPILE_RTTS
    wait_patience: float | None = DEFAULT_WAIT_PATIENCE
    compile_time_prior_s: float = DEFAULT_COMPILE_TIME_PRIOR_S
    min_upload_compile_s: float | None = None
    poll_floor_s: float = POLL_FLOOR_S

    def estimate(self, measured_s: float | None) -> float:
        """The compile time to plan with: the process's measurement, else the prior."""
        return self.compile_time_prior_s if measured_s is None else measured_s

    def takes_lease(self, estimate_s: float, round_trip_s: float | None) -> bool:
        """True if a compile estimated at ``estimate_s`` is worth a cluster lease at this round trip.

        An unknown round trip (no request timed yet) counts as free. An entry under the
        upload threshold would not reach the others, so it takes none.
        """
        if self.min_upload_compile_s is not None and estimate_s < self.min_upload_compile_s:
            return False
        return estimate_s >= self.lease_min_compile_rtts * (round_trip_s or 0.0)

    def wait_plan(self, estimate_s: float, store: EntryStore) -> FlightWait:
        """How to wait for another node's compile of a kernel this process estimates at ``estimate_s``."""
        return FlightWait(self, estimate_s, store)


@dataclasses.dataclass(frozen=True)
class FlightWait:
    """A waiter's plan (:class:`~tiered_progcache.lease.WaitPlan`), read live from the store's latency. Immutable.

    Poll period: ``max(floor, R)``. Patience: ``wait_patience x C + LANDING_RTTS x R + P``,
    with ``C`` the holder's estimate where its lease carries one, else this process's.
    """

    policy: FlightPolicy
    own_estimate_s: float
    store: EntryStore

    def poll_period(self) -> float:
        return max(self.policy.poll_floor_s, self.store.round_trip_s or 0.0)

    def patience(self, holder_estimate_s: float | None) -> float | None:
        factor = self.policy.wait_patience
        if factor is None:
            return None
        compile_s = self.own_estimate_s if holder_estimate_s is None else holder_estimate_s
        return factor * compile_s + LANDING_RTTS * (self.store.round_trip_s or 0.0) + self.poll_period()


@dataclasses.dataclass(frozen=True)
class FlightDecision:
    """What this process did about one missed entry, across nodes. Immutable.

    ``choice`` is one of:

    * ``"short"``: estimated under the lease threshold, compiled without a lease;
    * ``"held"``: took the lease and compiled (others may wait for it);
    * ``"found"``: the entry turned up right after the lease step (another node, or
      another process here, had just finished): no compile;
    * ``"waited"``: got another node's entry while waiting for its lease;
    * ``"gave up"``: waited the patience and compiled itself;
    * ``"timeout"``: waited the caller's ``wait_timeout`` and compiled itself;
    * ``"no lease"``: the lease store failed, compiled without one.

    ``waited_s`` is the time spent waiting on another node's lease (0 unless waited);
    ``holder_estimate_s`` what that holder's lease said its compile would take.
    """

    name: str
    choice: str
    estimate_s: float
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
        logger.log(level, "entry %s: %s (estimate %.3f s, round trip %s, waited %.3f s)", decision.name[:16],
                   decision.choice, decision.estimate_s,
                   "unknown" if decision.round_trip_s is None else f"{decision.round_trip_s * 1e3:.1f} ms",
                   decision.waited_s)
    with _hooks_lock:
        hooks = list(_hooks)
    call_each(hooks, decision, logger, "on_flight")
