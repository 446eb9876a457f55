"""How the chain treats one tier: the write, promotion and sharing policy, in one place; and the flight policy it holds.

The default chain is ``memory`` (promote, write at once) -> ``local`` (promote, write
at once) -> ``remote`` (shared, written in the background, optionally read-only).
A user tier (Redis, NFS, ...) takes any :class:`TierPolicy`.

:class:`FlightPolicy` is the cross-node single-flight's knobs, made from the settings with
the chain (``cache.flight_policy``) and read by :mod:`tiered_progcache.cluster.singleflight`;
it lives here, below ``cluster/``, so the chain holds it without importing the cluster
(:mod:`tiered_progcache.cluster.flightpolicy` re-exports it with the rest of the policy).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Literal

from ..settings import DEFAULT_COMPILE_TIME_PRIOR_S, DEFAULT_LEASE_MIN_COMPILE_RTTS, DEFAULT_WAIT_PATIENCE

if TYPE_CHECKING:
    from ..stores.store import EntryStore

__all__ = ["POLL_FLOOR_S", "POLL_GROWTH", "UNMEASURED_ROUND_TRIP_S", "FlightPolicy", "FlightWait", "TierPolicy",
           "WriteMode"]

#: The shortest poll period: on a store that answers in microseconds (a local path) a waiter still pauses.
POLL_FLOOR_S = 0.01
#: A waiter's poll period grows to this fraction of the time waited so far: a long compile is
#: learned of at most 2% late, and seven waiters polling do not slow its holder down.
POLL_GROWTH = 0.02

#: ``R`` until the store has answered once (its probe runs beside the first compile): the far end of the
#: round trips within a region. A compile predicted shorter races the lookup (never slower than
#: compiling alone); one that reads a library's headers is predicted longer and takes the lease.
UNMEASURED_ROUND_TRIP_S = 0.05

WriteMode = Literal["sync", "background"]


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """The chain's rules for one tier.

    name:
        How ``stats()`` and the logs call the tier; unique within a chain.
    read_only:
        Never written, promoted into or deleted from (a fleet reading what CI wrote).
    promote:
        A hit in a slower tier is copied into this one.
    write:
        ``"sync"``: ``cache[key] = value`` writes it before returning. ``"background"``:
        the write is queued for a worker thread (bounded queue; a full queue drops and
        counts), so a slow network never holds up a compile.
    shared:
        The tier is shared beyond this node: ``clear()`` leaves it alone and ``len()``
        does not count it (listing a bucket is slow and not this node's business).
    """

    name: str
    read_only: bool = False
    promote: bool = True
    write: WriteMode = "sync"
    shared: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tier name must be a non-empty str, got {self.name!r}")
        if self.write not in ("sync", "background"):
            raise ValueError(f"tier write mode must be 'sync' or 'background', got {self.write!r}")


@dataclasses.dataclass(frozen=True)
class FlightPolicy:
    """The knobs of cross-node single-flight (settings rows of the same names). Immutable.

    ``min_upload_compile_s`` is the chain's admission threshold: an entry that will not be
    uploaded is never worth a lease (nobody could get it from the holder).
    ``wait_patience`` and ``compile_time_prior_s`` are kept so old configurations parse: no decision uses them
    (a waiter waits while the holder's lease is renewed, up to ``wait_timeout``).
    """

    lease_min_compile_rtts: float = DEFAULT_LEASE_MIN_COMPILE_RTTS
    wait_patience: float | None = DEFAULT_WAIT_PATIENCE
    compile_time_prior_s: float = DEFAULT_COMPILE_TIME_PRIOR_S
    min_upload_compile_s: float | None = None
    poll_floor_s: float = POLL_FLOOR_S

    def short(self, estimate_s: float, round_trip_s: float | None) -> bool:
        """True if a compile predicted at ``estimate_s`` should race the lookup rather than take the lease.

        Short: under ``lease_min_compile_rtts`` round trips, or under the upload threshold (its
        entry would not reach the others). An unknown round trip (nothing timed yet) counts as
        :data:`UNMEASURED_ROUND_TRIP_S`.
        """
        if self.min_upload_compile_s is not None and estimate_s < self.min_upload_compile_s:
            return True
        rtt = UNMEASURED_ROUND_TRIP_S if round_trip_s is None else round_trip_s
        return estimate_s < self.lease_min_compile_rtts * rtt

    def wait_plan(self, store: EntryStore, clock: Callable[[], float] = time.monotonic) -> FlightWait:
        """How to wait, from now on ``clock``, for another node's compile."""
        return FlightWait(self, store, clock, clock())


@dataclasses.dataclass(frozen=True)
class FlightWait:
    """A waiter's plan (:class:`~tiered_progcache.cluster.lease.WaitPlan`), read live from the store's latency. Immutable.

    Poll period: ``max(floor, R, POLL_GROWTH x the time waited so far)``.
    """

    policy: FlightPolicy
    store: EntryStore
    clock: Callable[[], float] = time.monotonic
    started: float = 0.0

    def poll_period(self) -> float:
        network = max(self.policy.poll_floor_s, self.store.round_trip_s or 0.0)
        return max(network, POLL_GROWTH * (self.clock() - self.started))
