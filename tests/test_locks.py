"""The lock primitives on their own: the per-key file lock and the remote lease."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import fsspec
import pytest

from tiered_progcache.locks import (
    LEASE_FORMAT,
    LeaseInfo,
    RemoteLease,
    ThreadSingleFlight,
    lease_supported,
    node_lock,
    wait_for_lease,
)
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

SPAWN = mp.get_context("spawn")
JOIN_S = 30


def _hold_node_lock(locks_dir: str, name: str, taken, release) -> None:
    with node_lock(locks_dir, name, timeout=10) as held:
        assert held
        taken.set()
        release.wait(JOIN_S)


def _hold_lease(root: str, name: str, ttl: float, taken) -> None:
    fs = fsspec.filesystem("file")
    lease = RemoteLease(fs, root, name, ttl)
    assert lease.try_acquire()
    taken.set()
    threading.Event().wait(JOIN_S)  # until killed


# -- node lock -------------------------------------------------------------------------------------


def test_node_lock_excludes_another_process_and_a_waiter_gives_up_in_time(tmp_path):
    taken, release = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=_hold_node_lock, args=(str(tmp_path), "k1", taken, release))
    child.start()
    try:
        assert taken.wait(JOIN_S)
        started = time.monotonic()
        with node_lock(tmp_path, "k1", timeout=0.3) as held:
            assert not held
        assert 0.3 <= time.monotonic() - started < 5
        with node_lock(tmp_path, "other-key", timeout=0.3) as held:
            assert held  # per key: another key is free
    finally:
        release.set()
        child.join(JOIN_S)
    assert child.exitcode == 0
    with node_lock(tmp_path, "k1", timeout=5) as held:
        assert held


def test_node_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    taken, release = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=_hold_node_lock, args=(str(tmp_path), "k2", taken, release))
    child.start()
    assert taken.wait(JOIN_S)
    os.kill(child.pid, signal.SIGKILL)
    child.join(JOIN_S)
    started = time.monotonic()
    with node_lock(tmp_path, "k2", timeout=10) as held:
        assert held
    assert time.monotonic() - started < 2


def test_node_lock_is_mutually_exclusive_between_threads_and_leaves_no_files(tmp_path):
    inside = 0
    most = 0
    guard = threading.Lock()
    barrier = threading.Barrier(8)

    def work() -> None:
        nonlocal inside, most
        barrier.wait()
        for _ in range(20):
            with node_lock(tmp_path, "shared", timeout=30) as held:
                assert held
                with guard:
                    inside += 1
                    most = max(most, inside)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive()
    assert most == 1
    assert os.listdir(tmp_path) == []  # each holder unlinks its file before unlocking


# -- thread flights ----------------------------------------------------------------------------------


def test_thread_single_flight_shares_the_result_and_the_exception():
    flights: ThreadSingleFlight[str] = ThreadSingleFlight()
    entered, go = threading.Event(), threading.Event()
    runs = []
    results = []

    def leader() -> None:
        with flights.lead("k") as seat:
            assert seat.leader
            entered.set()
            go.wait(JOIN_S)
            runs.append(1)
            seat.result = "value"

    def follower() -> None:
        with flights.lead("k") as seat:
            results.append(seat.leader or seat.wait(JOIN_S))

    t = threading.Thread(target=leader)
    t.start()
    assert entered.wait(JOIN_S)
    followers = [threading.Thread(target=follower) for _ in range(4)]
    for f in followers:
        f.start()
    deadline = time.monotonic() + JOIN_S
    while flights.followers("k") < 4 and time.monotonic() < deadline:
        threading.Event().wait(0.001)  # polling a condition, not timing a race
    go.set()
    for th in [t, *followers]:
        th.join(JOIN_S)
    assert runs == [1] and results == ["value"] * 4
    assert flights.in_flight() == 0

    def failing() -> None:
        with flights.lead("bad") as seat:
            assert seat.leader
            entered2.set()
            go2.wait(JOIN_S)
            raise RuntimeError("compile failed")

    entered2, go2 = threading.Event(), threading.Event()
    errors = []

    def waiter() -> None:
        try:
            with flights.lead("bad") as seat:
                assert not seat.leader
                go2.set()
                seat.wait(JOIN_S)
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=lambda: pytest.raises(RuntimeError, failing))
    t.start()
    assert entered2.wait(JOIN_S)
    w = threading.Thread(target=waiter)
    w.start()
    t.join(JOIN_S)
    w.join(JOIN_S)
    assert errors == ["compile failed"]


# -- remote lease ------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "file", "s3"])
def store(request, tmp_path):
    """(fs, root) of an empty store with a real conditional create (S3: If-None-Match on moto)."""
    if request.param == "memory":
        return fsspec.filesystem("memory"), f"/leases-test-{uuid.uuid4().hex}"
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        return bucket.fs, f"{bucket.bucket}/{bucket.prefix}"
    return fsspec.filesystem("file"), str(tmp_path / "remote")


def test_only_one_of_many_acquirers_gets_the_lease(store):
    fs, root = store
    barrier = threading.Barrier(16)
    winners = []

    def attempt() -> None:
        lease = RemoteLease(fs, root, "entry", ttl_s=30)
        barrier.wait()
        if lease.try_acquire():
            winners.append(lease)

    threads = [threading.Thread(target=attempt) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert len(winners) == 1
    info = RemoteLease(fs, root, "entry", 30).read()
    assert isinstance(info, LeaseInfo) and info.token == winners[0].token and not info.expired()
    winners[0].release()
    assert RemoteLease(fs, root, "entry", 30).read() is None


def test_lease_of_a_crashed_holder_is_broken_once_expired(store):
    fs, root = store
    crashed = {
        "format": LEASE_FORMAT, "version": 1, "holder": "gone:1", "token": "t",
        "acquired_at": time.time() - 120, "expires_at": time.time() - 60,
    }
    waiter = RemoteLease(fs, root, "entry", ttl_s=30)
    assert waiter._create(json.dumps(crashed).encode())  # plant the stale lease
    started = time.monotonic()
    found, held = wait_for_lease(waiter, lambda: None, timeout=10)
    assert held and found is None
    assert time.monotonic() - started < 1
    waiter.release()


def test_a_live_holder_renews_so_a_waiter_times_out_without_breaking_it(store):
    fs, root = store
    holder = RemoteLease(fs, root, "entry", ttl_s=0.4)
    assert holder.try_acquire()
    try:
        waiter = RemoteLease(fs, root, "entry", ttl_s=0.4)
        found, held = wait_for_lease(waiter, lambda: None, timeout=1.5)  # > 3 TTLs
        assert (found, held) == (None, False)
        info = waiter.read()
        assert isinstance(info, LeaseInfo) and info.token == holder.token
    finally:
        holder.release()


def test_a_waiter_gets_the_holders_result_when_it_is_published(store):
    fs, root = store
    holder = RemoteLease(fs, root, "entry", ttl_s=30)
    assert holder.try_acquire()
    polled, finished = threading.Event(), threading.Event()
    out = []

    def poll():
        # The waiter's first look for the result: let the holder publish and release now.
        polled.set()
        assert finished.wait(JOIN_S)
        return "entry-bytes"

    t = threading.Thread(target=lambda: out.append(wait_for_lease(RemoteLease(fs, root, "entry", 30), poll, 20)))
    t.start()
    assert polled.wait(JOIN_S)  # it polled only after finding the lease taken
    holder.release()
    finished.set()
    t.join(JOIN_S)
    assert out == [("entry-bytes", False)]
    assert RemoteLease(fs, root, "entry", 30).read() is None  # and took no lease for it


def test_garbage_in_the_lease_slot_is_respected_for_one_ttl_then_broken(store):
    fs, root = store
    waiter = RemoteLease(fs, root, "entry", ttl_s=0.5)
    assert waiter._create(b"\x00not json")
    started = time.monotonic()
    found, held = wait_for_lease(waiter, lambda: None, timeout=10)
    elapsed = time.monotonic() - started
    assert held and 0.5 <= elapsed < 3
    waiter.release()


def test_killed_holder_process_blocks_file_waiters_for_at_most_the_ttl(tmp_path):
    root = str(tmp_path / "remote")
    taken = SPAWN.Event()
    child = SPAWN.Process(target=_hold_lease, args=(root, "entry", 1.0, taken))
    child.start()
    assert taken.wait(JOIN_S)
    os.kill(child.pid, signal.SIGKILL)
    child.join(JOIN_S)
    fs = fsspec.filesystem("file")
    info = RemoteLease(fs, root, "entry", 1.0).read()
    assert isinstance(info, LeaseInfo)
    waiter = RemoteLease(fs, root, "entry", 1.0)
    found, held = wait_for_lease(waiter, lambda: None, timeout=20)
    assert held
    assert info.expires_at <= time.time() < info.expires_at + 1.5
    waiter.release()


def test_lease_support_is_known_per_protocol():
    assert lease_supported(fsspec.filesystem("memory"))
    assert lease_supported(fsspec.filesystem("file"))

    class Plain:
        protocol = ("http", "https")

    assert not lease_supported(Plain())
