"""Single-flight across threads, processes and nodes: on a miss, one of them does the work per key.

Three scopes, each re-checking the cache once it gets its turn:

1. threads of a process share one flight per (cache, key) (:class:`~.locks.ThreadSingleFlight`);
2. processes of a node take the key's file lock in the local directory's ``locks_dir``
   (:func:`~.locks.node_lock`);
3. nodes of a cluster take the key's lease in the shared store (:mod:`.lease`), only
   where that store is up, writable, and declares an atomic create for its leases, and
   only where the compile is not predicted short (:mod:`.flightpolicy`; one of unknown
   length sends its shared lookup beside the lease create, and its look under the lease
   beside the compile, so its compile starts one round trip after the miss); a waiter polls
   for the entry while the holder's lease is renewed, raises the holder's failure if it
   publishes one (:mod:`.flightfailure`), and compiles itself once the holder is gone.

A compile predicted short against the round trip takes none of this: it races the
remote lookup (``race=True``), and whichever answers first is the result.

:func:`run_once` turns a bare ``ProgramCacheResource`` into a chain on entry
(:func:`~.tiered.as_chain`), and reads the chain's local directory, shared store and
flight policy; a cache without a local directory or a usable shared store simply skips
that scope. Every wait is bounded
(``wait_timeout``): whoever runs out of patience does the work itself, so a crashed
or stuck holder costs time, never a hang, and a race costs a duplicate compile at worst.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Generic, TypeVar

from cuda.core.utils import ProgramCacheResource

from ..chain import exitbudget
from .flightfailure import FailureRecord
from .flightpolicy import FlightDecision, FlightWait, report
from .lease import LeaseWait, RemoteLease, WaitOutcome, wait_for_lease
from .locks import ThreadSingleFlight, node_lock
from ..stores.ratelimit import log_once
from ..stores.store import EntryStore, LeaseStore, entry_name
from ..chain.tiered import TieredProgramCache, as_chain
from ..chain.writeback import submission_mark

if TYPE_CHECKING:
    from ..stores.localdir import LocalDir

__all__ = ["UPLOAD_FLUSH_TIMEOUT_S", "Work", "followers", "run_once", "takes_cluster_leases"]

logger = logging.getLogger(__name__)

#: How long the lease holder's background thread waits for the upload before releasing the lease.
UPLOAD_FLUSH_TIMEOUT_S = 30.0
#: How often that thread looks whether interpreter exit has begun while it waits.
EXIT_POLL_S = 0.1

R = TypeVar("R")  # what the caller gets back
T = TypeVar("T")
S = TypeVar("S")  # what the thread that did the work hands to the threads that waited for it


@dataclasses.dataclass(frozen=True)
class Work(Generic[R, S]):
    """The work to do once, as three callables (each called on the calling thread). Immutable.

    ``find()`` looks in the cache: ``(result, shared)`` on a hit, else None.
    ``produce()`` does the work and stores it: ``(result, shared)``; its exceptions propagate.
    ``adopt(shared)`` turns what another thread produced into this thread's result.
    ``produce_unless(dropped)`` (for a race; default: ``produce``) does the work on another
    thread and stores it only if ``dropped`` is not set by then (the lookup won).
    In a race ``find`` runs on a thread of its own too, and ``found()`` (default: nothing)
    is called on the calling thread when its hit is the answer: a lookup that answers after
    the work won is dropped, and is no hit. ``look()`` (default: none) is the shared tiers'
    lookup alone, for work of unknown length whose caller looked nearby already: it goes out
    beside the lease create, and again beside the work once the lease is ours.
    """

    find: Callable[[], tuple[R, S] | None]
    produce: Callable[[], tuple[R, S]]
    adopt: Callable[[S], R]
    produce_unless: Callable[[threading.Event], tuple[R, S]] | None = None
    found: Callable[[], None] | None = None
    look: Callable[[], tuple[R, S] | None] | None = None


_flights: ThreadSingleFlight[object] = ThreadSingleFlight()


def followers(cache: ProgramCacheResource, key: bytes) -> int:
    """Threads of this process waiting for another thread's work on ``key`` in ``cache`` now (0 if none).

    For observability and for tests that must know every waiter has joined. Thread-safe.
    """
    return _flights.followers((id(as_chain(cache).identity), key))


def takes_cluster_leases(cache: TieredProgramCache) -> bool:
    """True if a miss in chain ``cache`` can take cluster leases now (a writable, available shared store with an atomic create)."""
    return _lease_store(cache.shared_store) is not None


def run_once(
    cache: ProgramCacheResource,
    key: bytes,
    work: Work[R, S],
    *,
    wait_timeout: float,
    lease_ttl: float,
    compile_estimate_s: float | None = None,
    race: bool = False,
) -> R:
    """``work``'s result for ``key``, produced by at most one thread per process, process per node, node per cluster.

    >>> run_once(cache, key, Work(find, produce, adopt), wait_timeout=300, lease_ttl=60, compile_estimate_s=0.4)

    Call it after a miss. Waits at most ``wait_timeout`` seconds for others in all;
    ``lease_ttl`` bounds how long a crashed node holds the cluster up.
    ``compile_estimate_s`` is how long ``produce`` is expected to take (None: unknown);
    the cache's :class:`~.flightpolicy.FlightPolicy` decides from it whether the cluster
    lease is worth taking. ``race`` (the caller has looked only in the tiers in front of
    the shared one, because the policy predicts the work short): run ``find`` and the work
    side by side, no node lock or lease, and take whichever answers first. Exceptions of
    ``produce`` reach the caller and the threads waiting on it; a lease holder publishes
    its failure, so waiting nodes raise it too, and waiting processes of this node meet
    it when they get their turn. Safe from any number of threads.
    """
    deadline = time.monotonic() + wait_timeout
    chain = as_chain(cache)
    # Per cache: a thread compiling into another cache would not store into this one. By the
    # chain's identity: calls given one bare resource each get a chain around it, and share
    # its flights. (The leader's frame holds ``chain`` for the flight's life, so the id is not reused.)
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
            remaining = max(0.0, deadline - time.monotonic())
            if race:
                result, shared = _race(chain, key, work, compile_estimate_s)
            else:
                result, shared = _lead(chain, key, work, remaining, lease_ttl, compile_estimate_s)
            seat.result = shared
            return result


def _race(cache: TieredProgramCache, key: bytes, work: Work[R, S], estimate: float | None) -> tuple[R, S]:
    """The remote lookup and the work, each on a thread of its own; the first answer wins.

    A compile that wins is the answer at once (the lookup goes on and is dropped) and is
    stored and uploaded as usual; one that loses is dropped before it stores. A failed
    compile loses to a hit. Never slower than the faster of the two.
    """
    name = entry_name(key)
    shared = cache.shared_store
    round_trip = shared.round_trip_s if shared is not None else None
    dropped = threading.Event()
    produce_unless = work.produce_unless or (lambda _dropped: work.produce())
    outcome: concurrent.futures.Future[tuple[R, S]] = concurrent.futures.Future()
    looked: concurrent.futures.Future[tuple[R, S] | None] = concurrent.futures.Future()

    def produce() -> None:
        try:
            outcome.set_result(produce_unless(dropped))
        except BaseException as exc:  # handed to the caller
            outcome.set_exception(exc)

    def look() -> None:
        try:
            looked.set_result(work.find())
        except BaseException as exc:  # a lookup that fails is a miss, as a failing tier's read is
            looked.set_exception(exc)

    # Not a daemon: a compile that wins must finish storing even if the caller exits. The
    # lookup is: once the compile has answered, nothing waits for it.
    threading.Thread(target=produce, name=f"tiered-progcache-race-{name[:8]}").start()
    threading.Thread(target=look, name=f"tiered-progcache-look-{name[:8]}", daemon=True).start()
    concurrent.futures.wait((outcome, looked), return_when=concurrent.futures.FIRST_COMPLETED)
    if not (outcome.done() and outcome.exception() is None):  # the lookup answered first, or the compile failed
        found = looked.result() if looked.exception() is None else None
        if found is not None:
            dropped.set()
            if work.found is not None:
                work.found()
            report(FlightDecision(name, "raced, found", estimate, round_trip))
            return found
    result = outcome.result()  # the compiler's exception, if any, propagates
    report(FlightDecision(name, "raced", estimate, round_trip))
    return result


def _lead(
    cache: TieredProgramCache,
    key: bytes,
    work: Work[R, S],
    wait_s: float,
    lease_ttl: float,
    estimate: float | None,
) -> tuple[R, S]:
    """This process's one attempt at ``key``: node lock, then the cluster lease unless the policy predicts it short."""
    name = entry_name(key)
    deadline = time.monotonic() + wait_s
    policy = cache.flight_policy
    with _node_lock(cache.local_store, name, wait_s):
        shared = cache.shared_store
        leases = _lease_store(shared)
        if leases is None or shared is None:
            return _find_or_produce(work)
        round_trip = shared.round_trip_s
        if not policy.takes_lease(estimate, round_trip):
            found = work.find()  # another process of this node may have just finished it
            if found is not None:
                return found
            report(FlightDecision(name, "short", estimate, round_trip))
            return work.produce()
        lease = RemoteLease(leases, name, lease_ttl, compile_estimate_s=estimate)
        plan = policy.wait_plan(shared, lease_ttl)
        if estimate is None and work.look is not None:
            return _lead_unknown(cache, shared, key, work, work.look, lease, plan, deadline, round_trip)
        # The lease first, then the look: a holder pays one look, and a waiter's look right
        # after the taken lease also finds what another process of this node just stored.
        waited = wait_for_lease(lease, work.find, max(0.0, deadline - time.monotonic()), plan=plan,
                                open_failure=lambda sealed: FailureRecord.open(shared, name, sealed))
        return _after_wait(cache, shared, key, work, lease, waited, estimate, round_trip)


def _after_wait(
    cache: TieredProgramCache,
    shared: EntryStore,
    key: bytes,
    work: Work[R, S],
    lease: RemoteLease,
    waited: LeaseWait[tuple[R, S]],
    estimate: float | None,
    round_trip: float | None,
) -> tuple[R, S]:
    """What a wait on the lease ended in: another's entry or failure, no lease, or the lease (look, then compile)."""
    name = lease.name
    if not waited.held:
        decision = FlightDecision(name, _CHOICES[waited.outcome], estimate, round_trip, waited.waited_s,
                                  waited.holder_estimate_s)
        report(decision)
        if isinstance(waited.failure, FailureRecord):
            raise waited.failure.exception()
        return waited.found if waited.found is not None else work.produce()
    try:
        found = work.find()
        if found is None:
            report(FlightDecision(name, "held", estimate, round_trip, waited.waited_s, waited.holder_estimate_s))
            mark = submission_mark()
            found = work.produce()
            cache.expedite_uploads(mark)  # its waiters' entry goes up before anything queued earlier
        else:
            report(FlightDecision(name, "found", estimate, round_trip, waited.waited_s))
    except Exception as exc:
        _publish_failure(lease, shared, name, exc)  # at once: the waiters raise it too
        raise
    except BaseException:
        lease.release()  # interrupted, not failed: the waiters retry
        raise
    _release_after_upload(lease, cache, key, name)
    return found


def _lead_unknown(
    cache: TieredProgramCache,
    shared: EntryStore,
    key: bytes,
    work: Work[R, S],
    look: Callable[[], tuple[R, S] | None],
    lease: RemoteLease,
    plan: FlightWait,
    deadline: float,
    round_trip: float | None,
) -> tuple[R, S]:
    """The lease path of a compile of unknown length, one round trip before its compile starts.

    The shared lookup and the lease create go out together. A hit is the answer (a lease
    this call created meanwhile is released behind it, off the path). A miss with the lease
    ours: the compile and the look under the lease start together (the look catches an
    entry that landed between the lookup and the create: then the compile is not stored and
    that entry is the answer). A miss with the lease taken: the wait, as any waiter's.
    """
    name = lease.name
    created: concurrent.futures.Future[bool] = concurrent.futures.Future()

    def create() -> None:
        try:
            created.set_result(lease.try_acquire())
        except BaseException as exc:  # handed to the caller
            created.set_exception(exc)

    threading.Thread(target=create, name=f"tiered-progcache-create-{name[:8]}", daemon=True).start()
    try:
        found = look()
    except BaseException:
        _release_when_created(created, lease)
        raise
    if found is not None:
        _release_when_created(created, lease)
        report(FlightDecision(name, "found", None, round_trip))
        return found
    try:
        held = created.result()  # bounded by the store's own deadline
    except Exception as exc:
        log_once(logger, f"lease-io:{type(exc).__name__}", logging.WARNING,
                 "lease store failed (%r): going ahead without a lease", exc)
        waited: LeaseWait[tuple[R, S]] = LeaseWait(None, False, WaitOutcome.STORE_FAILED, 0.0)
        return _after_wait(cache, shared, key, work, lease, waited, None, round_trip)
    if not held:
        waited = wait_for_lease(lease, work.find, max(0.0, deadline - time.monotonic()), plan=plan, taken=True,
                                open_failure=lambda sealed: FailureRecord.open(shared, name, sealed))
        return _after_wait(cache, shared, key, work, lease, waited, None, round_trip)
    report(FlightDecision(name, "held", None, round_trip))
    mark = submission_mark()
    # The look under the lease goes out as the compile starts (the compile stays on this
    # thread, as it does on every other path). If it finds the entry (it landed between the
    # lookup and the create), the compile is not stored, and the entry found is the answer.
    dropped = threading.Event()
    looked = _look_aside(name, look, dropped)
    produce_unless = work.produce_unless or (lambda _dropped: work.produce())
    try:
        result = produce_unless(dropped)
        if dropped.is_set():
            result = looked.result()  # type: ignore[assignment]  # set only with a hit
        cache.expedite_uploads(mark)  # its waiters' entry goes up before anything queued earlier
    except Exception as exc:
        found = _hit_or_none(looked)  # a failed compile loses to a hit
        if found is not None:
            lease.release()
            return found
        _publish_failure(lease, shared, name, exc)  # at once: the waiters raise it too
        raise
    except BaseException:
        lease.release()  # interrupted, not failed: the waiters retry
        raise
    _release_after_upload(lease, cache, key, name)
    return result


def _look_aside(name: str, look: Callable[[], T | None], found: threading.Event) -> concurrent.futures.Future[T | None]:
    """``look()`` on a daemon thread; ``found`` is set when it returns a hit. A failing look is a miss."""
    looked: concurrent.futures.Future[T | None] = concurrent.futures.Future()

    def run() -> None:
        try:
            hit = look()
        except BaseException as exc:  # a lookup that fails is a miss, as a failing tier's read is
            looked.set_exception(exc)
            return
        if hit is not None:
            found.set()
        looked.set_result(hit)

    threading.Thread(target=run, name=f"tiered-progcache-look-{name[:8]}", daemon=True).start()
    return looked


def _hit_or_none(looked: concurrent.futures.Future[T | None]) -> T | None:
    try:
        return looked.result()  # bounded by the store's own deadline
    except Exception:
        return None


def _release_when_created(created: concurrent.futures.Future[bool], lease: RemoteLease) -> None:
    """Release ``lease`` once its create (under way) answers, if it made the lease ours; off the caller's path.

    The create was sent beside a lookup that found the entry, so nobody needs the lease.
    Its requests run on a daemon thread that exit waits for only within the process's one
    exit budget (:mod:`.exitbudget`), as for any release (a lease left behind is harmless
    here: whoever finds it taken looks and finds the entry, and it expires by itself).
    """

    def release() -> None:
        try:
            held = created.result()
        except Exception:
            return  # no lease was made, or the store failed: nothing to release
        if held:
            lease.release()

    releaser = threading.Thread(target=release, name=f"tiered-progcache-unlease-{lease.name[:8]}", daemon=True)
    releaser.start()
    threading.Thread(target=exitbudget.PROCESS.join, args=(releaser,), name="tiered-progcache-unlease-wait",
                     daemon=False).start()


def _publish_failure(lease: RemoteLease, shared: EntryStore, name: str, exc: Exception) -> None:
    """Put the failure in place of the lease for its waiters; release it instead where that cannot be done."""
    try:
        sealed = FailureRecord.of(exc).seal(shared, name)
    except Exception as seal_exc:  # a store without an envelope, or a bug: the waiters retry instead
        logger.warning("could not seal the failure of %s: %r", name[:16], seal_exc)
        lease.release()
        return
    lease.publish_failure(sealed)


#: The decision each way of ending a wait without the lease is reported as.
_CHOICES = {
    WaitOutcome.FOUND: "waited",
    WaitOutcome.FAILED: "failed",
    WaitOutcome.PATIENCE: "gave up",
    WaitOutcome.TIMEOUT: "timeout",
    WaitOutcome.STORE_FAILED: "no lease",
}


def _find_or_produce(work: Work[R, S]) -> tuple[R, S]:
    found = work.find()  # another thread or process may have just finished it
    return found if found is not None else work.produce()


def _node_lock(local: LocalDir | None, name: str, wait_s: float) -> ContextManager[bool]:
    if local is None:
        return contextlib.nullcontext(False)
    return node_lock(local.locks_dir, name, wait_s)


def _lease_store(shared: EntryStore | None) -> LeaseStore | None:
    """Where this node can take cluster leases, or None for node-level single-flight only."""
    if shared is None or shared.read_only:
        return None  # no shared store, or this node will not upload, so nobody could wait for it
    if not shared.available:
        return None  # the store is known to be down: do not wait on it for a lease
    leases = shared.leases()
    if leases is None:
        log_once(logger, f"no-leases:{shared.location}", logging.WARNING,
                 "shared store %s holds no leases: node-level single-flight only", shared.location)
        return None
    if not leases.atomic_create:
        log_once(logger, f"no-create:{leases.location}", logging.WARNING,
                 "shared store %s has no atomic create-if-absent: node-level single-flight only", leases.location)
        return None
    return leases


def _release_after_upload(lease: RemoteLease, cache: TieredProgramCache, key: bytes, name: str) -> None:
    """Hold the lease until the upload of ``key`` lands, on a thread, so the compile returns at once.

    Nodes waiting on the lease look for the entry itself and find it once it is up; a node
    that comes later and finds the lease still held looks for the entry first too. If the
    upload is slow or lost, waiters run out of patience and compile: slower, never wrong.
    Uploads queued after this one do not hold the release up.

    The thread is not a daemon, so a process that exits right after compiling still
    releases its lease (``multiprocessing`` children run no atexit handlers, but do join
    such threads). Once interpreter exit has begun it gives up rather than wait: a release
    whose upload is not in is dropped (the lease expires by itself), and the release
    itself runs on a daemon thread that exit waits for only within what is left of the
    process's one exit budget (:mod:`.exitbudget`), shared with the write-back's flush.
    So a hung remote costs exit that budget, once.
    """

    def upload_then_release() -> None:
        deadline = time.monotonic() + UPLOAD_FLUSH_TIMEOUT_S
        while not cache.wait_uploaded(key, EXIT_POLL_S):
            if not threading.main_thread().is_alive():
                logger.info("interpreter exit: lease %s left to expire (its upload is not in)", name[:16])
                return
            if time.monotonic() >= deadline:
                logger.warning("upload of %s did not land within %.0f s of the compile", name[:16],
                               UPLOAD_FLUSH_TIMEOUT_S)
                break
        # The release's requests may hang on a dead remote: exit waits for them only within its budget.
        releaser = threading.Thread(target=lease.release, name=f"tiered-progcache-release-{name[:8]}", daemon=True)
        releaser.start()
        exitbudget.PROCESS.join(releaser)

    threading.Thread(target=upload_then_release, name=f"tiered-progcache-lease-{name[:8]}", daemon=False).start()
