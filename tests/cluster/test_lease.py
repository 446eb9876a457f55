"""The cluster lease on its own: over the real shared stores' leases(), and on a stepped clock.

Expiry and renewal are judged on a :class:`SteppedClock`: the waiter's pauses advance
both its monotonic clock and the lease's wall clock, so "broken after exactly one TTL"
is asserted to the hundredth of a second without racing real time.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from typing import Callable

import pytest

from tiered_progcache.cluster.lease import (
    LEASE_FORMAT,
    LEASE_RECHECK_S,
    FixedWait,
    LeaseInfo,
    LeaseWait,
    RemoteLease,
    WaitEnd,
    wait_for_lease,
)
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import LeaseStore, entry_name
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

SPAWN = mp.get_context("spawn")
JOIN_S = 30
NAME = entry_name(b"the kernel's key")
#: How far past the expiry a waiter may take the lease: its last pause overshoots by 0.01 s.
EXPIRY_SLACK_S = 0.02


class SteppedClock:
    """A wall clock and a monotonic clock that move only when the code under test sleeps."""

    def __init__(self, wall: float = 1_000_000.0) -> None:
        self.wall = wall
        self.mono = 0.0
        self.sleeps: list[float] = []
        self.on_sleep: list = []

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.wall += seconds
        self.mono += seconds
        for hook in self.on_sleep:
            hook()

    def wait(self, lease: RemoteLease, timeout: float, poll=lambda: None, plan=None) -> tuple[object, bool]:
        """``wait_for_lease`` on this clock as ``(found, held)`` (``lease`` must be built with ``clock=self.time``)."""
        waited = self.wait_for(lease, timeout, poll, plan)
        return waited.found, waited.held

    def wait_for(self, lease: RemoteLease, timeout: float, poll=lambda: None, plan=None) -> LeaseWait:
        """``wait_for_lease`` on this clock, all it reports."""
        return wait_for_lease(lease, poll, timeout, plan=plan, clock=self.monotonic, sleep=self.sleep)


class DictLeases(LeaseStore):
    """Leases in a dict: the lease logic alone, with a real atomic create (under a lock)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return "dict://leases"

    @property
    def atomic_create(self) -> bool:
        return True

    def create(self, name: str, document: bytes, ttl_s: float) -> bool:
        with self._lock:
            if name in self.objects:
                return False
            self.objects[name] = document
            return True

    def read(self, name: str) -> bytes | None:
        with self._lock:
            return self.objects.get(name)

    def replace(self, name: str, document: bytes, ttl_s: float) -> None:
        with self._lock:
            self.objects[name] = document

    def delete(self, name: str) -> None:
        with self._lock:
            self.objects.pop(name, None)


@pytest.fixture(params=["memory", "file", "s3"])
def leases(request, tmp_path) -> LeaseStore:
    """The leases() of an empty shared store with a real conditional create (S3: If-None-Match on moto)."""
    if request.param == "memory":
        remote = RemoteProgramCache.from_url(f"memory://leases-test-{uuid.uuid4().hex}")
    elif request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        remote = RemoteProgramCache.from_url(bucket.url, storage_options=bucket.storage_options)
    else:
        remote = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}")
    store = remote.leases()
    assert store is not None and store.atomic_create
    return store


def _stale_document(expires_at: float) -> bytes:
    return json.dumps({
        "format": LEASE_FORMAT, "version": 1, "holder": "gone:1", "token": "t",
        "acquired_at": expires_at - 60, "expires_at": expires_at,
    }).encode()


def _hold_lease(url: str, name: str, ttl: float, taken) -> None:
    lease = RemoteLease(RemoteProgramCache.from_url(url).leases(), name, ttl)
    assert lease.try_acquire()
    taken.set()
    threading.Event().wait(JOIN_S)  # until killed


# -- on the real stores ------------------------------------------------------------------------


def test_only_one_of_many_acquirers_gets_the_lease(leases):
    barrier = threading.Barrier(16)
    winners = []

    def attempt() -> None:
        lease = RemoteLease(leases, NAME, ttl_s=30)
        barrier.wait()
        if lease.try_acquire():
            winners.append(lease)

    threads = [threading.Thread(target=attempt) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert len(winners) == 1
    info = RemoteLease(leases, NAME, 30).read()
    assert isinstance(info, LeaseInfo) and info.token == winners[0].token and not info.expired()
    winners[0].release()
    assert RemoteLease(leases, NAME, 30).read() is None


def test_lease_of_a_crashed_holder_is_broken_at_once_once_expired(leases):
    clock = SteppedClock()
    assert leases.create(NAME, _stale_document(expires_at=clock.time() - 60), 30)  # plant the stale lease
    waiter = RemoteLease(leases, NAME, ttl_s=30, clock=clock.time)
    found, held = clock.wait(waiter, timeout=10)
    assert held and found is None
    assert clock.sleeps == []  # broken and retaken without a single pause
    info = waiter.read()
    assert isinstance(info, LeaseInfo) and info.token == waiter.token
    waiter.release()


def test_a_waiter_gets_the_holders_result_when_it_is_published(leases, cleanup):
    holder = RemoteLease(leases, NAME, ttl_s=30)
    assert holder.try_acquire()
    polled, finished = threading.Event(), threading.Event()
    out = []

    def poll():
        # The waiter's first look for the result: let the holder publish and release now.
        polled.set()
        assert finished.wait(JOIN_S)
        return "entry-bytes"

    def wait() -> None:
        waited = wait_for_lease(RemoteLease(leases, NAME, 30), poll, 20)
        out.append((waited.found, waited.held))

    cleanup.gate(finished)  # a failing assert still lets the waiter's poll return
    t = cleanup.thread(wait)
    assert polled.wait(JOIN_S)  # it polled only after finding the lease taken
    holder.release()
    finished.set()
    t.join(JOIN_S)
    assert out == [("entry-bytes", False)]
    assert RemoteLease(leases, NAME, 30).read() is None  # and took no lease for it


@pytest.mark.parametrize("ttl", [0.5, 3.0])  # 3 s: rereads a second apart, the last one at the TTL
def test_garbage_in_the_lease_slot_is_respected_for_exactly_one_ttl_then_broken(leases, ttl):
    clock = SteppedClock()
    assert leases.create(NAME, b"\x00not json", ttl)
    waiter = RemoteLease(leases, NAME, ttl_s=ttl, clock=clock.time)
    found, held = clock.wait(waiter, timeout=10)
    assert held
    assert ttl <= clock.mono < ttl + EXPIRY_SLACK_S
    waiter.release()


def test_a_lease_whose_stated_expiry_comes_before_the_waiters_ttl_is_reread_and_broken_at_it(leases):
    """A holder that wrote a 0.3 s lease and stopped renewing (its process lives: only the expiry tells):
    a waiter with a 5 s TTL rereads it at its stated expiry, not a second later."""
    clock = SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=0.3, clock=clock.time)
    assert leases.create(NAME, holder._document(), 0.3)  # taken, never renewed
    waiter = RemoteLease(leases, NAME, ttl_s=5, clock=clock.time)
    found, held = clock.wait(waiter, timeout=10)
    assert held and 0.3 <= clock.mono < 0.3 + EXPIRY_SLACK_S
    waiter.release()


def test_the_holder_renews_on_a_daemon_thread_until_released(leases):
    holder = RemoteLease(leases, NAME, ttl_s=0.3)
    assert holder.try_acquire()
    try:
        first = holder.read()
        assert isinstance(first, LeaseInfo)
        renewers = [t for t in threading.enumerate() if t.name == "tiered-progcache-lease"]
        assert renewers and all(t.daemon for t in renewers)
        deadline = time.monotonic() + JOIN_S
        while time.monotonic() < deadline:  # polling a condition, not timing a race
            info = holder.read()
            if isinstance(info, LeaseInfo) and info.expires_at > first.expires_at:
                break
            time.sleep(0.02)
        assert isinstance(info, LeaseInfo) and info.token == holder.token and info.expires_at > first.expires_at
    finally:
        holder.release()
    assert holder.read() is None


def _kill_a_holder(url: str, ttl: float):
    """A real process takes the lease and is SIGKILLed (and reaped); its lease as it left it."""
    taken = SPAWN.Event()
    child = SPAWN.Process(target=_hold_lease, args=(url, NAME, ttl, taken))
    child.start()
    try:
        assert taken.wait(JOIN_S)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # whether or not it took the lease in time
        child.join(JOIN_S)
    leases = RemoteProgramCache.from_url(url).leases()
    info = RemoteLease(leases, NAME, ttl).read()
    assert isinstance(info, LeaseInfo) and info.process is not None and info.process.pid == child.pid
    return leases, info


def test_a_killed_holder_on_this_host_is_broken_at_once_without_waiting(tmp_path):
    """Its PID is gone: the waiter breaks the lease on its first look; the stepped clock never moves."""
    leases, info = _kill_a_holder(f"file://{tmp_path / 'remote'}", 3600.0)
    clock = SteppedClock(wall=info.acquired_at)  # an hour before the lease expires
    waiter = RemoteLease(leases, NAME, 3600.0, clock=clock.time)
    found, held = clock.wait(waiter, timeout=7200)
    assert (found, held) == (None, True)
    assert clock.sleeps == [] and clock.mono == 0.0
    waiter.release()


def test_a_live_holder_on_this_host_is_waited_for(leases):
    """The control: a holder whose process runs (this one) is not broken before its expiry."""
    clock = SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    try:
        waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
        found, held = clock.wait(waiter, timeout=30)
        assert (found, held) == (None, False) and clock.mono >= 30
    finally:
        holder.release()


def _rewritten(raw: bytes, **process) -> bytes:
    doc = json.loads(raw)
    doc["process"].update(process)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("elsewhere", [{"host": "another-node"}, {"boot_id": "an-earlier-boot"},
                                       {"pid_ns": "pid:[1]"}, {"start": 1}])
def test_a_dead_pid_is_only_trusted_on_this_host_boot_and_namespace(tmp_path, elsewhere):
    """Another node's (or boot's, or container's) PID says nothing here: that lease stands for exactly its TTL.

    A different start time is the exception: the PID was reused, so the holder is gone at once.
    """
    leases, info = _kill_a_holder(f"file://{tmp_path / 'remote'}", 30.0)
    leases.replace(NAME, _rewritten(info.raw, **elsewhere), 30.0)
    clock = SteppedClock(wall=info.acquired_at)
    waiter = RemoteLease(leases, NAME, 30.0, clock=clock.time)
    found, held = clock.wait(waiter, timeout=120)
    assert held
    if "start" in elsewhere:
        assert clock.mono == 0.0
    else:
        assert info.expires_at <= clock.time() < info.expires_at + EXPIRY_SLACK_S
    waiter.release()


def test_a_reused_pid_of_a_live_process_is_not_taken_for_the_holder(tmp_path):
    """The lease names this very process's PID but another start time: the holder is gone."""
    leases = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}").leases()
    clock = SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    raw = holder.read().raw
    holder.release()  # stop its renewer; write its document back by hand with another start time
    leases.create(NAME, _rewritten(raw, start=(holder.process.start or 0) + 1), 60)
    waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert clock.wait(waiter, timeout=30) == (None, True) and clock.mono == 0.0
    waiter.release()


def test_lease_support_is_declared_by_the_store(tmp_path):
    assert RemoteProgramCache.from_url(f"memory://decl-{uuid.uuid4().hex}").leases().atomic_create
    assert RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}").leases().atomic_create
    assert RemoteProgramCache.from_url(f"file://{tmp_path / 'ro'}", read_only=True).leases() is None


# -- the lease logic, on a stepped clock ------------------------------------------------------------


def test_an_unrenewed_lease_is_broken_after_exactly_its_ttl():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)  # its thread would renew in 20 real s
    assert holder.try_acquire()
    acquired_at = clock.time()
    waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    found, held = clock.wait(waiter, timeout=600)
    assert (found, held) == (None, True)
    assert acquired_at + 60 <= clock.time() < acquired_at + 60 + EXPIRY_SLACK_S
    info = waiter.read()
    assert isinstance(info, LeaseInfo) and info.token == waiter.token
    assert info.acquired_at == clock.time() and info.expires_at == clock.time() + 60
    holder.release()  # no longer ours: leaves the waiter's lease alone
    assert isinstance(waiter.read(), LeaseInfo)
    waiter.release()
    assert leases.objects == {}


def test_a_renewed_lease_outlives_its_ttl_and_the_waiter_times_out_without_breaking_it():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    next_renewal = [clock.time() + 20]

    def renew_every_third_of_the_ttl() -> None:  # what the holder's thread does, on this clock
        while clock.time() >= next_renewal[0]:
            assert holder.renew()
            next_renewal[0] += 20

    clock.on_sleep.append(renew_every_third_of_the_ttl)
    waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    found, held = clock.wait(waiter, timeout=180)  # three TTLs
    assert (found, held) == (None, False)
    assert 180 <= clock.mono < 180 + 1.0
    info = waiter.read()
    assert isinstance(info, LeaseInfo) and info.token == holder.token and info.expires_at > clock.time()
    holder.release()
    assert leases.objects == {}


def test_a_taken_over_lease_is_not_renewed_nor_deleted_by_its_old_holder():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    clock.sleep(61)
    other = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    found, held = clock.wait(other, timeout=10)
    assert held
    assert holder.renew() is False
    holder.release()
    info = other.read()
    assert isinstance(info, LeaseInfo) and info.token == other.token
    other.release()


def test_a_store_that_keeps_saying_taken_and_gone_is_retried_quickly_at_most_three_times():
    class Flapping(DictLeases):
        creates = 0

        def create(self, name, document, ttl_s):
            Flapping.creates += 1
            return False  # "taken" ...

        def read(self, name):
            return None  # ... and "gone"

    clock = SteppedClock()
    found, held = clock.wait(RemoteLease(Flapping(), NAME, ttl_s=60, clock=clock.time), timeout=5)
    assert (found, held) == (None, False)
    assert clock.sleeps and all(s > 0 for s in clock.sleeps)
    assert Flapping.creates <= 4 * (len(clock.sleeps) + 1)  # one try and three quick retries per pause


def test_a_failing_store_means_no_lease_and_no_wait():
    class Down(DictLeases):
        def create(self, name, document, ttl_s):
            raise TimeoutError("lease create took longer than 10 s")

    clock = SteppedClock()
    assert clock.wait(RemoteLease(Down(), NAME, ttl_s=60, clock=clock.time), timeout=300) == (None, False)
    assert clock.sleeps == []


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), 1e10, 1e300])
def test_ttl_must_be_positive_and_at_most_a_year(ttl):
    with pytest.raises(ValueError, match="ttl_s must be positive and at most 31536000 seconds"):
        RemoteLease(DictLeases(), NAME, ttl_s=ttl)


def test_the_longest_ttl_is_one_the_renewer_can_wait_a_third_of():
    """The renewer waits ``ttl_s / 3`` on an Event: past ``threading.TIMEOUT_MAX`` it would die at once."""
    lease = RemoteLease(DictLeases(), NAME, ttl_s=365 * 86400.0)
    assert lease.ttl_s / 3 <= threading.TIMEOUT_MAX
    assert lease.try_acquire() and lease.held
    lease.release()
    assert not lease.held and lease._renewer is not None and not lease._renewer.is_alive()


# -- the holder process, as a waiter on its host judges it ------------------------------------------


def test_the_holder_process_of_this_process_is_alive_and_round_trips():
    from tiered_progcache.cluster.lease import HolderProcess

    me = HolderProcess.current()
    assert me.pid == os.getpid() and me.host and me.boot_id and me.pid_ns and isinstance(me.start, int)
    assert HolderProcess.from_json(json.loads(json.dumps(me.as_json()))) == me
    assert not me.is_gone()


def test_an_unreaped_dead_holder_counts_as_gone():
    """A SIGKILLed holder whose parent has not reaped it yet still has a PID (a zombie): it is gone."""
    from tiered_progcache.cluster.lease import HolderProcess

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(HolderProcess.current().as_json()).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        child = HolderProcess.from_json(json.loads(fh.read()))
    try:
        assert child is not None and child.pid == pid
        waited = 0
        while not _zombie(pid):
            waited += 1
            assert waited < 100_000, "the child never exited"
            os.sched_yield()
        assert child.is_gone()  # a zombie, not yet reaped
    finally:
        os.waitpid(pid, 0)
    assert child.is_gone()  # reaped: no such PID


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("doc", [
    None, [], "x", {"host": 1, "boot_id": "b", "pid_ns": "n", "pid": 5, "start": 1},
    {"host": "h", "boot_id": None, "pid_ns": "n", "pid": 5, "start": 1},
    {"host": "h", "boot_id": "b", "pid_ns": 7, "pid": 5, "start": 1},
    {"host": "h", "boot_id": "b", "pid_ns": "n", "pid": "5", "start": 1},
    {"host": "h", "boot_id": "b", "pid_ns": "n", "pid": True, "start": 1},
    {"host": "h", "boot_id": "b", "pid_ns": "n", "pid": 0, "start": 1},
    {"host": "h", "boot_id": "b", "pid_ns": "n", "pid": 5, "start": "1"},
    {"host": "h", "boot_id": "b", "pid_ns": "n", "pid": 5, "start": False},
])
def test_a_malformed_holder_process_is_ignored_and_the_ttl_decides(doc):
    from tiered_progcache.cluster.lease import HolderProcess

    assert HolderProcess.from_json(doc) is None
    leases = DictLeases()
    leases.objects[NAME] = json.dumps({"format": LEASE_FORMAT, "version": 1, "holder": "h:5", "token": "t",
                                       "acquired_at": 1.0, "expires_at": 2.0, "process": doc}).encode()
    info = RemoteLease(leases, NAME, 60).read()
    assert isinstance(info, LeaseInfo) and info.process is None and not info.holder_gone()


def test_a_holder_process_without_proc_information_is_never_judged():
    from tiered_progcache.cluster.lease import HolderProcess

    me = HolderProcess.current()
    for blank in ({"boot_id": ""}, {"pid_ns": ""}):
        doc = {**me.as_json(), **blank, "pid": 2**22 + 12345}  # no such PID, but no way to be sure here
        assert not HolderProcess.from_json(doc).is_gone()


# -- the waiter's loop, step by step on the stepped clock -------------------------------------------


class CountingLeases(DictLeases):
    """DictLeases that count reads of the lease itself (not of break markers)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def read(self, name: str) -> bytes | None:
        if name == NAME:
            self.reads += 1
        return super().read(name)


def test_the_waiter_looks_at_once_then_every_poll_period_and_reads_the_lease_only_every_recheck():
    """The holder keeps its lease; its result appears on the waiter's 80th look (at 2.37 s).

    Looks: one right after the taken lease, then one every poll period, start to start,
    never a backoff. The lease is read once at the start, then once per LEASE_RECHECK_S.
    """
    leases, clock = CountingLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    looks = []

    def poll():
        looks.append(clock.mono)
        return "entry" if len(looks) == 80 else None

    try:
        waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
        waited = clock.wait_for(waiter, 30, poll, plan=FixedWait(poll_s=0.03))
        reads = leases.reads
    finally:
        holder.release()
    assert (waited.found, waited.held, waited.end) == ("entry", False, WaitEnd.FOUND)
    assert looks == pytest.approx([0.03 * n for n in range(80)])
    assert waited.waited_s == pytest.approx(0.03 * 79)
    assert max(clock.sleeps) <= 0.03 + 1e-9  # no pause ever longer than the poll period
    assert reads == 3  # at 0, LEASE_RECHECK_S and 2 x LEASE_RECHECK_S


def test_the_first_look_and_the_first_lease_read_run_side_by_side():
    """The first look only returns once the lease is being read: were they one after the other, it would not."""

    class SignallingLeases(DictLeases):
        def __init__(self) -> None:
            super().__init__()
            self.reading = threading.Event()

        def read(self, name):
            self.reading.set()
            return super().read(name)

    leases, clock = SignallingLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    try:
        first_look = []

        def poll():
            if not first_look:
                first_look.append(leases.reading.wait(JOIN_S))
            return "entry" if clock.mono >= 0.5 else None

        waited = clock.wait_for(RemoteLease(leases, NAME, 60, clock=clock.time), 30, poll)
    finally:
        holder.release()
    assert first_look == [True]
    assert waited.found == "entry"


def test_a_waiter_holds_the_entry_within_one_poll_period_of_its_landing():
    """Whenever the entry lands, the waiter's next look (at most one period later) returns it."""
    for landed_at in (0.0001, 0.437, 1.0, 3.21):
        leases, clock = DictLeases(), SteppedClock()
        holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
        assert holder.try_acquire()
        waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
        waited = clock.wait_for(waiter, 30, lambda: "entry" if clock.mono >= landed_at else None,
                                plan=FixedWait(poll_s=0.05))
        holder.release()
        assert waited.found == "entry"
        assert landed_at <= waited.waited_s < landed_at + 0.05 + 1e-9, (landed_at, waited.waited_s)


def test_a_failed_holders_release_is_seen_at_the_next_lease_reread_and_the_waiter_takes_it():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    clock.on_sleep.append(lambda: holder.release() if clock.mono >= 0.2 else None)
    waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    waited = clock.wait_for(waiter, 300, plan=FixedWait(poll_s=0.05))
    assert (waited.held, waited.end) == (True, WaitEnd.HELD)
    assert waited.waited_s == pytest.approx(LEASE_RECHECK_S)
    waiter.release()


def test_an_estimate_in_a_lease_written_by_an_older_holder_is_ignored():
    leases = DictLeases()
    doc = json.loads(_stale_document(expires_at=time.time() + 60))
    doc["compile_estimate_s"] = 1e6  # older holders wrote one for waiters' patience: no reader uses it now
    leases.objects[NAME] = json.dumps(doc).encode()
    info = RemoteLease(leases, NAME, 60).read()
    assert isinstance(info, LeaseInfo) and info.holder == "gone:1"
    holder = RemoteLease(leases, "other", ttl_s=60)
    assert holder.try_acquire()
    assert "compile_estimate_s" not in json.loads(leases.objects["other"])
    holder.release()


def test_a_free_lease_is_taken_without_looking_for_a_result_or_pausing():
    clock = SteppedClock()
    polls = []
    waiter = RemoteLease(DictLeases(), NAME, ttl_s=60, clock=clock.time)
    assert clock.wait(waiter, 30, lambda: polls.append(1)) == (None, True)
    assert polls == [] and clock.sleeps == []
    waiter.release()


def test_a_lease_released_between_the_create_and_the_read_is_retried_without_a_pause():
    class JustReleased(DictLeases):
        creates = 0

        def create(self, name, document, ttl_s):
            JustReleased.creates += 1
            return JustReleased.creates > 1 and super().create(name, document, ttl_s)  # taken, then free

    clock = SteppedClock()
    waiter = RemoteLease(JustReleased(), NAME, ttl_s=60, clock=clock.time)
    assert clock.wait(waiter, timeout=30) == (None, True)
    assert clock.sleeps == [] and JustReleased.creates == 2
    waiter.release()


class _Undeletable(DictLeases):
    """A store that keeps refusing to delete: a waiter's break fails every time."""

    def delete(self, name):
        raise PermissionError("delete refused")


@pytest.mark.parametrize("slot", ["expired", "garbage"])
def test_a_failing_break_is_not_an_error_and_the_wait_still_ends_on_time(slot):
    leases, clock = _Undeletable(), SteppedClock()
    leases.objects[NAME] = _stale_document(clock.time() - 1) if slot == "expired" else b"\x00garbage"
    waiter = RemoteLease(leases, NAME, ttl_s=1, clock=clock.time)
    assert clock.wait(waiter, timeout=5) == (None, False)  # no exception; the slot was never freed
    assert 5 <= clock.mono < 5 + 1.0


def test_renewal_passes_the_ttl_to_the_store():
    class Recording(DictLeases):
        ttls: list = []

        def replace(self, name, document, ttl_s):
            Recording.ttls.append(ttl_s)
            super().replace(name, document, ttl_s)

    holder = RemoteLease(Recording(), NAME, ttl_s=42, clock=SteppedClock().time)
    assert holder.try_acquire()
    try:
        assert holder.renew()
    finally:
        holder.release()
    assert Recording.ttls == [42.0]  # a store that expires objects by itself (Redis PX) needs it


def test_a_store_that_keeps_saying_taken_and_gone_pauses_after_exactly_three_quick_retries():
    class Flapping(DictLeases):
        creates = 0

        def create(self, name, document, ttl_s):
            Flapping.creates += 1
            return False

        def read(self, name):
            return None

    clock = SteppedClock()
    assert clock.wait(RemoteLease(Flapping(), NAME, ttl_s=60, clock=clock.time), timeout=1) == (None, False)
    assert Flapping.creates == 4 * len(clock.sleeps) + 1  # four tries per pause, and the last look


class _InterleavingLeases(DictLeases):
    """Runs ``between`` once, just before the first delete of the lease itself goes through."""

    def __init__(self) -> None:
        super().__init__()
        self.between: Callable[[], None] | None = None

    def delete(self, name: str) -> None:
        if name == NAME and self.between is not None:
            between, self.between = self.between, None
            between()
        super().delete(name)


def test_two_waiters_breaking_one_expired_lease_leave_exactly_one_holder():
    """Both saw the same expired lease. One waiter's break runs whole (break, take a new lease)
    between the other's check and its delete. Check-then-delete alone would delete the new
    lease, and both would then hold one; the break marker lets exactly one break it."""
    clock = SteppedClock()
    store = _InterleavingLeases()
    stale = _stale_document(expires_at=clock.time() - 60)
    assert store.create(NAME, stale, 30)
    first = RemoteLease(store, NAME, ttl_s=30, clock=clock.time)
    second = RemoteLease(store, NAME, ttl_s=30, clock=clock.time)
    outcomes: list[tuple[str, bool]] = []

    def first_breaks_and_takes_it() -> None:
        outcomes.append(("first broke", first.break_if_unchanged(stale)))
        outcomes.append(("first took", first.try_acquire()))

    store.between = first_breaks_and_takes_it
    outcomes.append(("second broke", second.break_if_unchanged(stale)))
    outcomes.append(("second took", second.try_acquire()))
    holders = [lease for lease in (first, second) if lease.held]
    assert len(holders) == 1, outcomes
    assert [name for name, done in outcomes if name.endswith("broke") and done] == ["second broke"]
    assert sorted(store.objects) == [NAME]  # no break marker left behind
    holders[0].release()


def test_a_break_marker_left_by_a_waiter_that_died_mid_break_goes_after_one_ttl():
    """A breaker SIGKILLed between creating its marker and removing it leaves the marker behind."""
    clock = SteppedClock()
    store = DictLeases()
    stale = _stale_document(expires_at=clock.time() - 60)
    assert store.create(NAME, stale, 30)
    marker = f"{NAME}.break-{hashlib.sha256(stale).hexdigest()[:32]}"
    left = json.dumps({"format": LEASE_FORMAT + "/break", "expires_at": clock.time() + 30}).encode()
    assert store.create(marker, left, 30)
    waiter = RemoteLease(store, NAME, ttl_s=30, clock=clock.time)
    assert waiter.break_if_unchanged(stale) is False  # the marker still stands: not this waiter's break
    assert store.read(NAME) == stale and store.read(marker) == left
    clock.wall += 30
    assert waiter.break_if_unchanged(stale) is False  # its time is up: removed, nothing broken yet
    assert marker not in store.objects and store.read(NAME) == stale
    assert waiter.break_if_unchanged(stale) is True and store.objects == {}


# -- liveness from renewals, clamps, and a holder's published failure (issue 17) -------------------


def _planted(leases: LeaseStore, clock: SteppedClock, **fields: object) -> bytes:
    """A lease document nobody renews, as anyone who can write the bucket could plant one."""
    doc = {"format": LEASE_FORMAT, "version": 1, "holder": "elsewhere:1", "token": "planted",
           "acquired_at": clock.time(), "expires_at": clock.time() + 60, **fields}
    raw = json.dumps(doc).encode()
    assert leases.create(NAME, raw, 60)
    return raw


@pytest.mark.parametrize("claims", [{"expires_at": 1e12}, {"expires_at": 1e12, "compile_estimate_s": 1e6},
                                    {"expires_at": float("inf")}])
def test_a_lease_nobody_renews_is_broken_one_ttl_after_it_was_first_seen_whatever_it_claims(claims):
    """A hostile or corrupt lease (an expiry in 33658 AD, a 1e6 s estimate of old) costs a waiter one TTL, not its timeout."""
    leases, clock = DictLeases(), SteppedClock()
    _planted(leases, clock, **claims)
    waiter = RemoteLease(leases, NAME, ttl_s=5, clock=clock.time)
    waited = clock.wait_for(waiter, 300, plan=FixedWait(poll_s=0.05))
    waiter.release()
    assert (waited.held, waited.end) == (True, WaitEnd.HELD)
    assert 5.0 <= waited.waited_s <= 5.0 + EXPIRY_SLACK_S


def test_a_holder_that_keeps_renewing_is_waited_for_past_its_ttl():
    """Liveness is the renewals: a holder that renews every second is waited for 20 s (its TTL is 3 s)."""
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=3, clock=clock.time)
    assert holder.try_acquire()
    renewed = [0.0]

    def renew() -> None:
        if clock.mono - renewed[0] >= 1.0:
            renewed[0] = clock.mono
            assert holder.renew()

    clock.on_sleep.append(renew)
    waiter = RemoteLease(leases, NAME, ttl_s=3, clock=clock.time)
    try:
        waited = clock.wait_for(waiter, 300, lambda: "entry" if clock.mono >= 20 else None, FixedWait(poll_s=0.05))
    finally:
        holder.release()
    assert (waited.found, waited.end) == ("entry", WaitEnd.FOUND)
    assert 20 <= waited.waited_s < 20.05 + 1e-9


def test_a_published_failure_reaches_the_waiter_within_one_poll_and_stands_only_its_ttl():
    """The holder fails at 0.5 s: the waiter (lease read beside every look) has it by 0.55 s. A second
    caller after the record's TTL takes the lease: a retry after a fix compiles."""
    leases, clock = CountingLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    clock.on_sleep.append(lambda: holder.publish_failure(b"sealed record", ttl_s=4) if clock.mono >= 0.5 else None)
    opened: list[bytes] = []

    def open_failure(sealed: bytes) -> str | None:
        opened.append(sealed)
        return "the holder's error" if sealed == b"sealed record" else None

    waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    waited = wait_for_lease(waiter, lambda: None, 300, plan=FixedWait(poll_s=0.05), clock=clock.monotonic,
                            sleep=clock.sleep, open_failure=open_failure)
    assert (waited.end, waited.failure, waited.held) == (WaitEnd.FAILED, "the holder's error", False)
    assert 0.5 <= waited.waited_s <= 0.55 + 1e-9 and opened == [b"sealed record"]
    assert not holder.held
    clock.on_sleep.clear()
    later = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    retry = wait_for_lease(later, lambda: None, 300, plan=FixedWait(poll_s=0.05), clock=clock.monotonic,
                           sleep=clock.sleep, open_failure=open_failure)
    later.release()
    assert retry.end is WaitEnd.FAILED  # within its 4 s, a new caller raises it too
    clock.sleep(4.0)
    again = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    after = wait_for_lease(again, lambda: None, 300, plan=FixedWait(poll_s=0.05), clock=clock.monotonic,
                           sleep=clock.sleep, open_failure=open_failure)
    again.release()
    assert after.end is WaitEnd.HELD  # expired: the next caller compiles


def test_a_failure_record_that_does_not_open_is_not_trusted_and_costs_at_most_its_ttl():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    assert holder.publish_failure(b"forged", ttl_s=2)
    waiter = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    waited = wait_for_lease(waiter, lambda: None, 300, plan=FixedWait(poll_s=0.05), clock=clock.monotonic,
                            sleep=clock.sleep, open_failure=lambda sealed: None)
    waiter.release()
    assert (waited.end, waited.failure) == (WaitEnd.HELD, None)
    assert 2.0 <= waited.waited_s <= 2.0 + EXPIRY_SLACK_S


def test_a_failure_is_published_for_no_longer_than_the_lease_ttl_and_only_by_its_holder():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=3, clock=clock.time)
    assert not holder.publish_failure(b"x")  # not held: nothing published
    assert leases.read(NAME) is None
    assert holder.try_acquire()
    assert holder.publish_failure(b"x", ttl_s=10)
    info = holder.read()
    assert isinstance(info, LeaseInfo) and info.failure == b"x"
    assert info.expires_at == pytest.approx(clock.time() + 3)  # min(the record's 10 s, the lease's 3 s)
    thief = RemoteLease(leases, NAME, ttl_s=3, clock=clock.time)
    leases.replace(NAME, thief._document(), 3)  # taken over meanwhile: the old holder publishes nothing
    other = RemoteLease(leases, NAME, ttl_s=3, clock=clock.time)
    leases.delete(NAME)
    assert other.try_acquire()
    leases.replace(NAME, thief._document(), 3)
    assert not other.publish_failure(b"y")
    info = other.read()
    assert isinstance(info, LeaseInfo) and info.failure is None and info.token == thief.token


def test_a_failure_that_cannot_be_published_releases_the_lease_and_says_why(caplog):
    """The store refuses the replace: the holder deletes its lease instead (its waiters retry and compile),
    returns False and logs where and why. Published, the record's TTL reaches the store too."""

    class RefusingLeases(DictLeases):
        def __init__(self) -> None:
            super().__init__()
            self.replaced_ttls: list[float] = []
            self.refuse = True

        def replace(self, name: str, document: bytes, ttl_s: float) -> None:
            self.replaced_ttls.append(ttl_s)
            if self.refuse:
                raise OSError("bucket says no")
            super().replace(name, document, ttl_s)

    leases, clock = RefusingLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=30, clock=clock.time)
    assert holder.try_acquire()
    caplog.set_level("WARNING", logger="tiered_progcache.cluster.lease")
    assert holder.publish_failure(b"record", ttl_s=4) is False
    assert leases.read(NAME) is None and not holder.held  # released, not left to expire
    assert [r.getMessage() for r in caplog.records] == [
        f"could not publish the failure on lease dict://leases/{NAME}: OSError('bucket says no')"]
    leases.refuse = False
    again = RemoteLease(leases, NAME, ttl_s=30, clock=clock.time)
    assert again.try_acquire() and again.publish_failure(b"record", ttl_s=4)
    assert leases.replaced_ttls == [4, 4]


def test_a_store_that_fails_the_first_create_ends_the_wait_at_once_as_store_failed(caplog):
    class FailingLeases(DictLeases):
        def create(self, name: str, document: bytes, ttl_s: float) -> bool:
            raise OSError("down")

    clock = SteppedClock()
    waited = clock.wait_for(RemoteLease(FailingLeases(), NAME, ttl_s=30, clock=clock.time), 300)
    assert (waited.end, waited.held, waited.found, waited.waited_s) == (WaitEnd.STORE_FAILED, False, None, 0)
    assert clock.sleeps == []


def test_a_failing_lease_store_is_said_once_per_kind_of_failure(caplog, monkeypatch):
    """Every wait against a dead store fails the same way: one warning per exception type, naming it."""
    from tiered_progcache.stores import ratelimit

    monkeypatch.setattr(ratelimit, "_logged_once", set())  # as in a fresh process, whatever ran before here

    class LeaseStoreDown(OSError):
        pass

    class LeaseStoreSlow(TimeoutError):
        pass

    class Failing(DictLeases):
        def __init__(self, error: BaseException) -> None:
            super().__init__()
            self.error = error

        def create(self, name: str, document: bytes, ttl_s: float) -> bool:
            raise self.error

    caplog.set_level("WARNING", logger="tiered_progcache.cluster.lease")
    clock = SteppedClock()
    for error in (LeaseStoreDown("down"), LeaseStoreDown("still down"), LeaseStoreSlow("took 10 s")):
        waited = clock.wait_for(RemoteLease(Failing(error), NAME, ttl_s=30, clock=clock.time), 300)
        assert waited.end is WaitEnd.STORE_FAILED
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "lease store failed (LeaseStoreDown('down')): going ahead without a lease"),
        ("WARNING", "lease store failed (LeaseStoreSlow('took 10 s')): going ahead without a lease"),
    ]


def test_a_break_writes_its_marker_word_for_word_and_removes_it():
    """The marker a breaker creates: named from the bytes it saw, marked as a break, valid one TTL."""

    class Recording(DictLeases):
        def __init__(self) -> None:
            super().__init__()
            self.created: list[tuple[str, bytes, float]] = []

        def create(self, name: str, document: bytes, ttl_s: float) -> bool:
            self.created.append((name, document, ttl_s))
            return super().create(name, document, ttl_s)

    clock, store = SteppedClock(), Recording()
    stale = _stale_document(expires_at=clock.time() - 60)
    assert store.create(NAME, stale, 30)
    waiter = RemoteLease(store, NAME, ttl_s=30, clock=clock.time)
    assert waiter.break_if_unchanged(stale) is True
    marker = f"{NAME}.break-{hashlib.sha256(stale).hexdigest()[:32]}"
    (name, document, ttl), = store.created[1:]
    assert (name, ttl) == (marker, 30)
    assert document == json.dumps({"format": "tiered-progcache/lease/break", "expires_at": clock.time() + 30}).encode()
    assert store.objects == {}


class _FailingReadsAfter(DictLeases):
    """Reads of the lease itself fail once ``ok_reads`` of them went through; records which thread read."""

    def __init__(self, ok_reads: int) -> None:
        super().__init__()
        self.ok_reads = ok_reads
        self.readers: list[str] = []

    def read(self, name: str) -> bytes | None:
        if name == NAME:
            self.readers.append(threading.current_thread().name)
            if len(self.readers) > self.ok_reads:
                raise OSError("read failed")
        return super().read(name)


@pytest.mark.parametrize("ok_reads, waited_s", [(0, 0.0), (1, LEASE_RECHECK_S)])
def test_a_lease_read_that_fails_ends_the_wait_as_store_failed(ok_reads, waited_s):
    """The first read runs beside the first look, on a thread of its own; a failing read ends the wait at once."""
    leases, clock = _FailingReadsAfter(ok_reads), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    try:
        waited = clock.wait_for(RemoteLease(leases, NAME, ttl_s=60, clock=clock.time), 30)
    finally:
        holder.release()
    assert (waited.end, waited.held, waited.found) == (WaitEnd.STORE_FAILED, False, None)
    assert waited.waited_s == pytest.approx(waited_s)
    assert leases.readers[0] == "tiered-progcache-lease-read"


def test_a_break_of_a_lease_that_changed_since_it_was_seen_leaves_it_alone():
    clock, store = SteppedClock(), DictLeases()
    stale = _stale_document(expires_at=clock.time() - 60)
    renewed = _stale_document(expires_at=clock.time() + 60)
    assert store.create(NAME, renewed, 30)
    waiter = RemoteLease(store, NAME, ttl_s=30, clock=clock.time)
    assert waiter.break_if_unchanged(stale) is False
    assert store.objects == {NAME: renewed}  # the new lease stands, and the marker is gone


def test_a_release_the_store_refuses_is_logged_with_where_and_why(caplog):
    leases = _FailingReadsAfter(ok_reads=0)
    holder = RemoteLease(leases, NAME, ttl_s=30)
    assert holder.try_acquire()
    caplog.set_level("WARNING", logger="tiered_progcache.cluster.lease")
    holder.release()
    assert not holder.held
    assert [r.getMessage() for r in caplog.records] == [
        f"could not release lease dict://leases/{NAME} (it expires by itself): OSError('read failed')"]


def _breaks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.cluster.lease" and "breaking it" in r.getMessage()]


def test_each_break_says_whose_lease_and_why(caplog):
    """Expired, not renewed for a TTL, or its holder's process gone from this host: the log says which."""
    caplog.set_level("INFO", logger="tiered_progcache.cluster.lease")
    where = f"dict://leases/{NAME}"

    leases, clock = DictLeases(), SteppedClock()
    assert leases.create(NAME, _stale_document(expires_at=clock.time() - 60), 30)
    assert clock.wait(RemoteLease(leases, NAME, ttl_s=30, clock=clock.time), 300)[1]
    assert _breaks(caplog) == [f"lease {where} held by gone:1 expired; breaking it"]

    caplog.clear()
    leases, clock = DictLeases(), SteppedClock()
    _planted(leases, clock, expires_at=1e12)
    assert clock.wait(RemoteLease(leases, NAME, ttl_s=5, clock=clock.time), 300)[1]
    assert _breaks(caplog) == [f"lease {where} held by elsewhere:1 not renewed for 5.01 s; breaking it"]

    caplog.clear()
    leases, clock = DictLeases(), SteppedClock()
    me = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    doc = json.loads(me._document())
    doc["process"]["start"] = (me.process.start or 0) + 1  # this PID, another start time: that holder is gone
    assert leases.create(NAME, json.dumps(doc).encode(), 60)
    assert clock.wait(RemoteLease(leases, NAME, ttl_s=60, clock=clock.time), 300)[1]
    assert _breaks(caplog) == [f"lease {where} held by {me.holder} is gone (its process died on this host); breaking it"]


def test_a_holder_that_releases_between_rereads_is_looked_behind_once():
    """The holder releases; the waiter's next lease read finds none and looks once more: the entry is up."""
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    clock.on_sleep.append(holder.release)  # during the waiter's first pause, before any poll
    waited = clock.wait_for(RemoteLease(leases, NAME, ttl_s=60, clock=clock.time), 30,
                            poll=lambda: "entry" if leases.read(NAME) is None else None,
                            plan=FixedWait(poll_s=10.0))
    assert (waited.end, waited.found) == (WaitEnd.FOUND, "entry")
    assert clock.sleeps == [LEASE_RECHECK_S]


def test_a_waiter_that_runs_out_of_time_says_timeout():
    leases, clock = DictLeases(), SteppedClock()
    holder = RemoteLease(leases, NAME, ttl_s=60, clock=clock.time)
    assert holder.try_acquire()
    try:
        waited = clock.wait_for(RemoteLease(leases, NAME, ttl_s=60, clock=clock.time), 2.0, plan=FixedWait(poll_s=0.5))
    finally:
        holder.release()
    assert (waited.end, waited.held, waited.found) == (WaitEnd.TIMEOUT, False, None)
    assert waited.waited_s == pytest.approx(2.0)


def test_a_holder_whose_name_has_a_parenthesis_and_non_ascii_letters_is_judged_by_its_own_start_time(tmp_path):
    """/proc/<pid>/stat carries the program's name: ``)`` and UTF-8 in it move no field and raise nothing."""
    import subprocess

    from tiered_progcache.cluster import lease as lease_module

    program = tmp_path / "sl) ëp"
    program.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(program), "600"])
    try:
        with open(f"/proc/{child.pid}/stat", "rb") as fh:
            start = int(fh.read().rsplit(b")", 1)[1].split()[19])
        assert lease_module._start_ticks(child.pid) == start
        process = lease_module.HolderProcess(*lease_module._this_host(), child.pid, start)
        assert not process.is_gone()
    finally:
        child.kill()
        child.wait()
    assert process.is_gone()


def test_a_holder_whose_lease_is_taken_over_stops_renewing_and_says_so(caplog):
    caplog.set_level("WARNING", logger="tiered_progcache.cluster.lease")
    leases = DictLeases()
    holder = RemoteLease(leases, NAME, ttl_s=0.3)
    assert holder.try_acquire()
    thief = RemoteLease(leases, NAME, ttl_s=60)
    leases.replace(NAME, thief._document(), 60)
    holder._renewer.join(JOIN_S)  # its next renewal (a tenth of a second on) sees another token and stops
    assert not holder._renewer.is_alive() and leases.read(NAME) == leases.objects[NAME]
    assert json.loads(leases.read(NAME))["token"] == thief.token
    assert [r.getMessage() for r in caplog.records] == [
        f"lease dict://leases/{NAME} was taken over while held; carrying on without it"]


def test_a_renewal_the_store_refuses_is_logged_and_the_holder_keeps_trying(caplog):
    class RefusingReplace(DictLeases):
        def __init__(self) -> None:
            super().__init__()
            self.refused = threading.Event()

        def replace(self, name: str, document: bytes, ttl_s: float) -> None:
            self.refused.set()
            raise OSError("bucket says no")

    caplog.set_level("WARNING", logger="tiered_progcache.cluster.lease")
    leases = RefusingReplace()
    holder = RemoteLease(leases, NAME, ttl_s=0.3)
    assert holder.try_acquire()
    assert leases.refused.wait(JOIN_S)
    holder.release()  # joins the renewer
    messages = [r.getMessage() for r in caplog.records]
    assert messages and set(messages) == {f"could not renew lease dict://leases/{NAME}: OSError('bucket says no')"}
    assert leases.read(NAME) is None  # released
