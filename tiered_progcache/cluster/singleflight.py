"""Single-flight across threads, processes and nodes: on a miss, one of them does the work per key.

One strategy, three cases (:func:`plan`): ``short`` races the shared lookup, ``lease`` takes the
node lock then the cluster lease, ``node`` the node lock only. Threads of a process share one
flight per (cache, key); every wait is bounded by ``wait_timeout``, every lock and lease released
on every path. docs/cluster.md ("When nodes wait") has the cases, their costs and their timing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Callable, Protocol, TypeVar

from cuda.core.utils import ProgramCacheResource

from ..chain import exitbudget
from .flightfailure import FailureRecord
from . import flightpolicy
from .flightpolicy import (RACE_MIN_CPU_SHARE, UNMEASURED_ROUND_TRIP_S, FlightDecision, compile_times, report,
                           untimed_estimate)
from .lease import RemoteLease, wait_for_lease
from .locks import ThreadSingleFlight, node_lock
from ..stores.ratelimit import log_once
from ..stores.store import EntryStore, LeaseStore, entry_name
from ..chain.tiered import TieredProgramCache, as_chain
from ..chain.writeback import submission_mark

__all__ = ["LEASE", "NODE", "SHORT", "Flight", "describe", "followers", "plan", "predict", "round_trip", "run_once",
           "settle"]

logger = logging.getLogger(__name__)

R = TypeVar("R")  # what the caller gets back
T = TypeVar("T")  # what one call on a thread of its own returns
S = TypeVar("S")  # what the thread that did the work hands to the threads that waited for it

SHORT, LEASE, NODE = "short", "lease", "node"


class Flight(Protocol[R, S]):
    """The work to do once for a key, as three verbs, each called on the thread that calls it."""

    def find(self, shared_only: bool = False) -> tuple[R, S] | None:
        """The cached result, ``(result, shared)``, or None; ``shared_only``: the shared tiers alone."""

    def produce(self, dropped: threading.Event | None = None) -> tuple[R, S]:
        """Do the work and store it (not if ``dropped`` is set by then); its exceptions propagate."""

    def adopt(self, shared: S, found: bool = False) -> R:
        """What another thread produced (``found``: a race's lookup found), as this thread's result."""


_flights: ThreadSingleFlight[object] = ThreadSingleFlight()


def followers(cache: ProgramCacheResource, key: bytes) -> int:
    """Threads of this process waiting for another thread's work on ``key`` in ``cache`` now (0 if none)."""
    return _flights.followers((id(as_chain(cache).identity), key))


def round_trip(shared: EntryStore) -> float | None:
    """``R``: the store's median round trip lately (seeded with the one this node persisted), else what was persisted."""
    live = shared.round_trip_s
    return live if live is not None else compile_times.round_trip(shared.location)


#: Local directories whose persisted compile times this process has read, and (directory, store) pairs it seeded.
_loaded: set[str] = set()
_seeded: set[tuple[str, str]] = set()
_loaded_lock = threading.Lock()


def predict(cache: TieredProgramCache, code_type: str, target: str, size: int) -> float:
    """``C``: what this node predicts for a compile of ``size``, from its own compiles, else from the size alone.

    The first call per local directory loads what earlier processes measured there and seeds the
    store's round trip with the one persisted for it, so ``R`` is known before the first kernel.
    """
    local, shared = cache.local_store, cache.shared_store
    if local is not None:
        directory = str(local.root)
        pair = (directory, "" if shared is None else shared.location)
        with _loaded_lock:
            load, seed = directory not in _loaded, pair not in _seeded
            _loaded.add(directory)
            _seeded.add(pair)
        if load:
            compile_times.load(directory)
        if seed and shared is not None and (persisted := compile_times.round_trip(shared.location)) is not None:
            shared.seed_round_trip(persisted)
    estimate = compile_times.predict(code_type, target, size)
    return untimed_estimate(size) if estimate is None else estimate


def describe(cache: TieredProgramCache, estimate_s: float) -> str:
    """The case a miss predicted at ``estimate_s`` would take in ``cache``, and why, in one line (``explain``)."""
    case, rtt = plan(cache, estimate_s)
    policy = cache.flight_policy
    c = f"C {estimate_s * 1e3:.1f} ms"
    r = f"R unknown, {UNMEASURED_ROUND_TRIP_S * 1e3:g} ms assumed" if rtt is None else f"R {rtt * 1e3:.1f} ms"
    k = f"{policy.lease_min_compile_rtts:g} x {r}"
    if cache.shared_store is None:
        return f"node: no shared tier, the node lock only ({c})"
    if case == NODE:
        return f"node: the shared store takes no lease (no atomic create, read-only or down): node lock only ({c}, {r})"
    if case == LEASE:
        return f"lease: {c} >= {k}: one node compiles, the others wait for its entry"
    share = compile_times.cpu_share()  # read once: what cpu_bound() would say of it
    how = (f"CPUs busy (compiles got {share:.2f} of one): the node lock, one look, the compile on a miss, no lease"
           if share is not None and share < RACE_MIN_CPU_SHARE else "the compile races the shared lookup, no lease")
    if policy.min_upload_compile_s is not None and estimate_s < policy.min_upload_compile_s:
        return f"short: {c} < min_upload_compile_s (not uploaded): {how}"
    return f"short: {c} < {k}: {how}"


def plan(cache: TieredProgramCache, estimate_s: float) -> tuple[str, float | None]:
    """The case a miss predicted at ``estimate_s`` takes in chain ``cache`` (:data:`SHORT`, ...), and ``R``."""
    shared = cache.shared_store
    if shared is None:
        return NODE, None
    rtt, policy = round_trip(shared), cache.flight_policy
    if rtt is None and policy.short(estimate_s, rtt) and not policy.short(estimate_s, 0.0):
        # R unknown would race, and a store near enough for the lease (R under C / k) would not: its probe
        # answers within about that, so wait that long and no longer. A far store's wait is compile time lost.
        shared.wait_ready(estimate_s / policy.lease_min_compile_rtts)
        rtt = round_trip(shared)
    if policy.short(estimate_s, rtt):
        return SHORT, rtt
    return (NODE if _lease_store(shared) is None else LEASE), rtt


def run_once(cache: ProgramCacheResource, key: bytes, work: Flight[R, S], *, wait_timeout: float, lease_ttl: float,
             case: str = LEASE, estimate_s: float | None = None, inputs: Callable[[], str] | None = None) -> R:
    """``work``'s result for ``key``, produced by at most one thread per process, process per node, node per cluster.

    Call it after a miss, with the case :func:`plan` chose. Waits at most ``wait_timeout`` seconds in
    all; ``produce``'s exceptions reach the caller and everyone waiting on it. ``inputs``: what the
    work reads beyond ``key`` (a flight by direct key: the header digest); a holder seals its failure
    with its own, and a waiter raises it only where its own is the same (else it does the work). Thread-safe.
    """
    deadline = time.monotonic() + wait_timeout
    chain = as_chain(cache)
    # By the chain's identity: calls given one bare resource each get a chain around it, and share its flights.
    flight_key = (id(chain.identity), key)
    while True:
        with _flights.lead(flight_key) as seat:
            if not seat.leader:
                shared = seat.wait(timeout=max(0.0, deadline - time.monotonic()))
                if shared is not None:
                    return work.adopt(shared)  # type: ignore[arg-type]
                if time.monotonic() < deadline:
                    continue  # the leader was interrupted: take our own turn
                return work.produce()[0]
            name = entry_name(key)
            decide = _decider(chain, name, estimate_s)
            if case == SHORT and not compile_times.cpu_bound():
                result, shared = _race(work, decide, name)
            else:  # (a short compile where every CPU is busy: the node lock, one look, then the work; no lease)
                result, shared = _lead(chain, key, work, max(0.0, deadline - time.monotonic()), lease_ttl,
                                       case == LEASE, decide, inputs, short=case == SHORT)
            seat.result = shared
            return result


_Decide = Callable[..., None]  # decide(choice, waited_s=0.0): one flight's decision, counted and reported


def _decider(cache: TieredProgramCache, name: str, estimate_s: float | None) -> _Decide:
    """Reports one flight's decision with its ``C``, ``R`` and wait, counted on the chain (with a shared tier)."""
    shared = cache.shared_store
    rtt = None if shared is None else round_trip(shared)

    def decide(choice: str, waited_s: float = 0.0) -> None:
        if shared is not None:
            report(FlightDecision(name, choice, estimate_s, rtt, waited_s), cache.flight_counts.count)

    return decide


def _race(work: Flight[R, S], decide: _Decide, name: str) -> tuple[R, S]:
    """The shared lookup and the work, each on a thread of its own; the first answer wins.

    A compile that loses is dropped before it stores; a failed compile loses to a hit.
    """
    dropped = threading.Event()
    outcome: concurrent.futures.Future[tuple[R, S]] = concurrent.futures.Future()
    looked: concurrent.futures.Future[tuple[R, S] | None] = concurrent.futures.Future()
    # Not a daemon: a compile that wins must finish storing even if the caller exits. The lookup
    # is: once the compile has answered, nothing waits for it.
    threading.Thread(target=settle, args=(outcome, work.produce, dropped),
                     name=f"tiered-progcache-race-{name[:8]}").start()
    threading.Thread(target=settle, args=(looked, work.find, True), name=f"tiered-progcache-look-{name[:8]}",
                     daemon=True).start()
    concurrent.futures.wait((outcome, looked), return_when=concurrent.futures.FIRST_COMPLETED)
    if not (outcome.done() and outcome.exception() is None):  # the lookup answered first, or the compile failed
        found = looked.result() if looked.exception() is None else None
        if found is not None:
            dropped.set()
            decide("raced_found")
            return work.adopt(found[1], True), found[1]
    result = outcome.result()  # the compiler's exception, if any, propagates
    decide("raced_won")
    return result


def settle(future: concurrent.futures.Future[T], call: Callable[..., T], *args: object) -> None:
    """``call(*args)``'s result or exception into ``future``, for the thread that waits on it (run on another)."""
    try:
        future.set_result(call(*args))
    except BaseException as exc:  # handed to the waiting thread (a failed lookup is a miss there)
        future.set_exception(exc)


def _lead(cache: TieredProgramCache, key: bytes, work: Flight[R, S], wait_s: float, lease_ttl: float,
          take_lease: bool, decide: _Decide, inputs: Callable[[], str] | None = None, *,
          short: bool = False) -> tuple[R, S]:
    """This process's turn at ``key``: the node lock, then the cluster lease where the case takes one.

    ``short``: a short compile where every CPU is busy (:meth:`~.flightpolicy.CompileTimes.cpu_bound`): a
    compile the lookup would make needless takes a CPU from work that counts, so it looks first, and the
    node's other processes wait for its compile rather than run their own.
    """
    name, local = entry_name(key), cache.local_store
    deadline = time.monotonic() + wait_s
    with contextlib.nullcontext(False) if local is None else node_lock(local.locks_dir, name, wait_s):
        shared = cache.shared_store
        leases = _lease_store(shared) if take_lease else None
        if leases is None or shared is None:
            found = work.find()  # another thread or process may have just finished it
            if found is not None:
                if short:
                    decide("raced_found")
                return found
            decide("raced_won" if short else "no_lease")
            return work.produce()
        lease = RemoteLease(leases, name, lease_ttl)
        # The lease first, then the look: a holder pays one look, and a waiter's look right
        # after the taken lease also finds what another process of this node just stored.
        waited = wait_for_lease(lease, work.find, max(0.0, deadline - time.monotonic()),
                                plan=cache.flight_policy.wait_plan(shared),
                                open_failure=lambda sealed: FailureRecord.open(shared, name, sealed))
        if not waited.held:
            failure = waited.failure if isinstance(waited.failure, FailureRecord) else None
            if failure is not None and failure.inputs != ("" if inputs is None else inputs()):
                failure = None  # the holder read other headers: its failure is not this compile's
                decide("gave_up", waited.waited_s)
            else:
                decide(waited.end.value, waited.waited_s)
            if failure is not None:
                raise failure.exception()
            return waited.found if waited.found is not None else work.produce()
        try:
            found = work.find()
            if found is None:
                decide("held", waited.waited_s)
                mark = submission_mark()
                found = work.produce()
                cache.expedite_uploads(mark)  # its waiters' entry goes up before anything queued earlier
            else:
                decide("found_under_lease", waited.waited_s)
        except Exception as exc:
            _publish_failure(lease, shared, name, exc, inputs)  # at once: the waiters raise it too
            raise
        except BaseException:
            lease.release()  # interrupted, not failed: the waiters retry
            raise
        _release_after_upload(lease, cache, key, name)
        return found


def _publish_failure(lease: RemoteLease, shared: EntryStore, name: str, exc: Exception,
                     inputs: Callable[[], str] | None = None) -> None:
    """Put the failure in place of the lease for its waiters; release it instead where that cannot be done."""
    try:
        sealed = FailureRecord.of(exc, "" if inputs is None else inputs()).seal(shared, name)
    except Exception as seal_exc:  # a store without an envelope, or a bug: the waiters retry instead
        logger.warning("could not seal the failure of %s: %r", name[:16], seal_exc)
        lease.release()
        return
    lease.publish_failure(sealed)


def _lease_store(shared: EntryStore | None) -> LeaseStore | None:
    """Where this node can take cluster leases, or None for node-level single-flight only."""
    if shared is None or shared.read_only or not shared.available:
        return None  # nothing shared, this node will not upload, or the store is known to be down
    leases = shared.leases()
    if leases is None or not leases.atomic_create:
        location, lacks = ((shared.location, "holds no leases") if leases is None
                           else (leases.location, "has no atomic create-if-absent"))
        log_once(logger, f"{lacks}:{location}", logging.WARNING,
                 "shared store %s %s: node-level single-flight only", location, lacks)
        return None
    return leases


def _release_after_upload(lease: RemoteLease, cache: TieredProgramCache, key: bytes, name: str) -> None:
    """Hold the lease until the upload of ``key`` lands, on a thread, so the compile returns at once.

    Not a daemon, so a process that exits right after compiling still releases its lease; once
    interpreter exit has begun it stops waiting, and the release gets what is left of the exit budget.
    ``cache.close()`` waits for it, so the lease is released before the cache's tiers close.
    """

    def upload_then_release() -> None:
        deadline = time.monotonic() + flightpolicy.UPLOAD_FLUSH_TIMEOUT_S
        while not cache.wait_uploaded(key, flightpolicy.EXIT_POLL_S):
            if not threading.main_thread().is_alive():
                logger.info("interpreter exit: lease %s left to expire (its upload is not in)", name[:16])
                return
            if time.monotonic() >= deadline:
                logger.warning("upload of %s did not land within %.0f s of the compile", name[:16],
                               flightpolicy.UPLOAD_FLUSH_TIMEOUT_S)
                break
        releaser = threading.Thread(target=lease.release, name=f"tiered-progcache-release-{name[:8]}", daemon=True)
        releaser.start()
        exitbudget.PROCESS.join(releaser)

    thread = threading.Thread(target=upload_then_release, name=f"tiered-progcache-lease-{name[:8]}", daemon=False)
    thread.start()
    cache.keep_until_closed(thread)
