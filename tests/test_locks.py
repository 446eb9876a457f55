"""The in-host primitives on their own: the per-key file lock and thread flights (the lease: test_lease.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from tiered_progcache.locks import ThreadSingleFlight, node_lock

SPAWN = mp.get_context("spawn")
JOIN_S = 30


def _hold_node_lock(locks_dir: str, name: str, taken, release) -> None:
    with node_lock(locks_dir, name, timeout=10) as held:
        assert held
        taken.set()
        release.wait(JOIN_S)


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
