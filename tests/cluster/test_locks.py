"""The in-host primitives on their own: the per-key file lock and thread flights (the lease: test_lease.py)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from tiered_progcache.cluster import locks
from tiered_progcache.cluster.locks import ThreadSingleFlight, node_lock

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
    try:
        assert taken.wait(JOIN_S)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # whether or not it took the lock in time
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


def test_thread_single_flight_shares_the_result_and_the_exception(cleanup):
    flights: ThreadSingleFlight[str] = ThreadSingleFlight()
    entered, go = threading.Event(), threading.Event()
    cleanup.gate(go)  # a failing assert still lets the leader finish
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

    t = cleanup.thread(leader)
    assert entered.wait(JOIN_S)
    followers = [cleanup.thread(follower) for _ in range(4)]
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
    cleanup.gate(go2)
    errors = []

    def waiter() -> None:
        try:
            with flights.lead("bad") as seat:
                assert not seat.leader
                go2.set()
                seat.wait(JOIN_S)
        except RuntimeError as exc:
            errors.append(str(exc))

    t = cleanup.thread(lambda: pytest.raises(RuntimeError, failing))
    assert entered2.wait(JOIN_S)
    w = cleanup.thread(waiter)
    t.join(JOIN_S)
    w.join(JOIN_S)
    assert errors == ["compile failed"]


# -- fork, and a hostile locks directory --------------------------------------------------------------


def _try_flock(path: str) -> bool:
    """From a separate open file description: could another process take the lock now?"""
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _fork_child_that_waits() -> tuple[int, int]:
    """A real forked child that stays alive until the returned pipe's write end is closed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: inherits every descriptor, then blocks
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    return pid, w


def _end_child(pid: int, w: int) -> None:
    os.close(w)
    os.waitpid(pid, 0)


def _lock_fds(path: str) -> list[int]:
    return [int(fd) for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == path]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _hold_then_fork_then_die(locks_dir: str, name: str, out) -> None:
    with node_lock(locks_dir, name, timeout=10) as held:
        assert held
        pid = os.fork()
        if pid == 0:  # the child outlives its parent, until the test kills it
            signal.pause()
            os._exit(0)
        out.put(pid)
        threading.Event().wait(JOIN_S)  # until SIGKILLed


def test_a_forked_child_does_not_keep_the_node_lock_after_its_parent_dies(tmp_path):
    """The parent is SIGKILLed while holding the lock; its forked child lives on: the lock is free at once."""
    out = SPAWN.Queue()
    parent = SPAWN.Process(target=_hold_then_fork_then_die, args=(str(tmp_path), "kf", out))
    parent.start()
    child_pid = out.get(timeout=JOIN_S)
    path = os.path.join(tmp_path, "kf.lock")
    try:
        assert not _try_flock(path)  # held by the parent
        os.kill(parent.pid, signal.SIGKILL)
        os.waitpid(parent.pid, 0)  # (not join: the child holds a copy of the process sentinel too)
        assert _alive(child_pid)  # the forked child is still alive ...
        assert _try_flock(path)  # ... and does not hold the lock
    finally:
        os.kill(child_pid, signal.SIGKILL)
        parent.join(JOIN_S)


def test_releasing_the_node_lock_frees_it_though_another_process_inherited_the_descriptor(tmp_path):
    """A process that got the descriptor without our fork handler (here: passed to a spawned program)."""
    import subprocess

    path = os.path.realpath(os.path.join(tmp_path, "kp.lock"))
    with node_lock(tmp_path, "kp", timeout=10) as held:
        assert held
        (fd,) = _lock_fds(path)
        os.set_inheritable(fd, True)
        inheritor = subprocess.Popen(["sleep", "600"], pass_fds=[fd])
        waiter_fd = os.open(path, os.O_RDWR)  # a waiter that opened the file before the release
    try:
        import fcntl

        fcntl.flock(waiter_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held
        assert inheritor.poll() is None  # while the inheritor still lives
    finally:
        os.close(waiter_fd)
        inheritor.kill()
        inheritor.wait()


def test_a_child_forked_while_the_lock_is_held_closes_its_copy_and_leaves_the_file_alone(tmp_path):
    path = os.path.realpath(os.path.join(tmp_path, "kc.lock"))
    with node_lock(tmp_path, "kc", timeout=10) as held:
        assert held
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # the child leaves the with-block too: it must neither unlink nor unlock the parent's file;
            # and it can take a node lock of its own at once
            code = 1
            with contextlib.suppress(BaseException):
                with node_lock(tmp_path, "kc-child", timeout=5) as child_held:
                    code = 0 if child_held and not _lock_fds(path) else 1
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"\0"  # no lock descriptor in the child
        os.waitpid(pid, 0)
        os.close(r)
        assert os.path.exists(path) and not _try_flock(path)  # still ours


def test_a_planted_symlink_in_the_locks_directory_is_not_written_through(tmp_path):
    """locks/ks.lock -> a path that does not exist yet: opening it with O_CREAT would create the target."""
    target = tmp_path / "created-through-the-link"
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "ks.lock").symlink_to(target)
    with node_lock(locks, "ks", timeout=5) as held:
        assert held  # on a lock file of its own
    assert not target.exists()
    assert os.listdir(locks) == []  # the planted link is gone with the lock file


def test_a_symlinked_locks_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "locks").symlink_to(elsewhere)
    with node_lock(tmp_path / "locks", "kd", timeout=5) as held:
        assert not held
    assert os.listdir(elsewhere) == []


def test_the_lock_file_is_private_to_its_owner(tmp_path):
    old = os.umask(0)
    try:
        with node_lock(tmp_path, "km", timeout=5) as held:
            assert held
            assert oct(os.stat(tmp_path / "km.lock").st_mode & 0o777) == "0o600"
    finally:
        os.umask(old)


def test_a_child_forked_after_the_release_keeps_a_descriptor_that_reused_the_number(tmp_path):
    """Only descriptors held now are dropped at fork: a number the lock used before is someone else's now."""
    with node_lock(tmp_path, "kr", timeout=5) as held:
        assert held
        (lock_fd,) = _lock_fds(os.path.realpath(os.path.join(tmp_path, "kr.lock")))
    opened = [os.open(os.devnull, os.O_RDONLY)]
    while opened[-1] < lock_fd:  # until one of them gets the lock's old number
        opened.append(os.open(os.devnull, os.O_RDONLY))
    other = opened[-1]
    try:
        assert other == lock_fd
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(other)
                os.write(w, b"\0")
            except OSError:
                os.write(w, b"\1")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"\0"
        os.waitpid(pid, 0)
        os.close(r)
    finally:
        for fd in opened:
            os.close(fd)


def test_followers_are_counted_exactly():
    flights = ThreadSingleFlight()
    assert flights.followers("k") == 0
    joined, release = threading.Barrier(3), threading.Event()

    def follow() -> None:
        with flights.lead("k") as seat:
            assert not seat.leader
            joined.wait(JOIN_S)
            release.wait(JOIN_S)

    with flights.lead("k") as seat:
        assert seat.leader and flights.followers("k") == 0
        threads = [threading.Thread(target=follow) for _ in range(2)]
        for t in threads:
            t.start()
        joined.wait(JOIN_S)
        assert flights.followers("k") == 2
        release.set()
        seat.result = "done"
    for t in threads:
        t.join(JOIN_S)
    assert flights.followers("k") == 0


# -- the waiter's pauses and starts-over, on a stepped clock; hostile and lock-less filesystems ----------


class _LockClock:
    """Stands in for ``locks.time``: time moves only when the waiter pauses, and each pause can run a step."""

    def __init__(self, steps=()) -> None:
        self.now = 1000.0  # large against every pause, so ``now + (deadline - now)`` lands on the deadline exactly
        self.sleeps: list[float] = []
        self.steps = list(steps)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if len(self.sleeps) > 500:
            raise AssertionError("the waiter never gave up")
        self.now += seconds
        if self.steps:
            self.steps.pop(0)()


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.cluster.locks"]


def test_a_waiter_backs_off_by_half_again_up_to_the_cap_and_gives_up_exactly_at_its_deadline(
        tmp_path, monkeypatch, caplog):
    clock = _LockClock()
    monkeypatch.setattr(locks, "time", clock)
    caplog.set_level(logging.INFO, logger="tiered_progcache.cluster.locks")
    with node_lock(tmp_path, "kb", timeout=5) as held:
        assert held
        with node_lock(tmp_path, "kb", timeout=0.1) as waited:
            assert not waited
    expected, delay, left = [], 0.001, 0.1  # NODE_POLL_S: from 1 ms, times 1.5 a pause, at most 20 ms
    while left > 1e-12:
        expected.append(min(delay, left))
        left -= expected[-1]
        delay = min(delay * 1.5, 0.02)
    assert clock.sleeps == pytest.approx(expected, abs=1e-9)
    assert clock.now == 1000.0 + 0.1  # not one pause past the deadline
    assert _messages(caplog) == [f"waited too long for {os.path.join(tmp_path, 'kb.lock')}; going ahead without it"]


def test_a_waiter_that_locked_a_file_its_holder_unlinked_starts_over_on_the_file_at_the_path(tmp_path, monkeypatch):
    """Two holders come and go while the waiter pauses: it ends up holding the file at the path, and only it."""
    first = node_lock(tmp_path, "ku", timeout=5)
    second = node_lock(tmp_path, "ku", timeout=5)

    def first_leaves_and_second_takes_a_fresh_file() -> None:  # the waiter's file is unlinked and replaced
        first.__exit__(None, None, None)
        assert second.__enter__()

    def second_leaves() -> None:  # the waiter's (second) file is unlinked and nothing replaces it
        second.__exit__(None, None, None)

    clock = _LockClock(steps=[first_leaves_and_second_takes_a_fresh_file, second_leaves])
    monkeypatch.setattr(locks, "time", clock)
    assert first.__enter__()
    path = os.path.join(tmp_path, "ku.lock")
    with node_lock(tmp_path, "ku", timeout=5) as held:
        assert held
        assert len(clock.sleeps) == 2
        assert os.listdir(tmp_path) == ["ku.lock"] and not _try_flock(path)  # the file at the path is ours
        (fd,) = _lock_fds(os.path.realpath(path))
        assert os.fstat(fd).st_ino == os.stat(path).st_ino
    assert os.listdir(tmp_path) == []


def test_a_symlink_replanted_as_fast_as_it_is_removed_is_removed_three_times_then_the_lock_is_given_up(
        tmp_path, monkeypatch, caplog):
    locks_dir, target = tmp_path / "locks", tmp_path / "target"
    locks_dir.mkdir()
    (locks_dir / "kz.lock").symlink_to(target)
    real_unlink, removed = os.unlink, []

    def unlink_and_replant(path, *, dir_fd=None):  # a hostile neighbour, until it tires after ten
        real_unlink(path, dir_fd=dir_fd)
        removed.append(path)
        if len(removed) < 10:
            os.symlink(target, path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink_and_replant)
    caplog.set_level(logging.WARNING, logger="tiered_progcache.cluster.locks")
    with node_lock(locks_dir, "kz", timeout=5) as held:
        assert not held
    monkeypatch.undo()
    assert removed == ["kz.lock"] * 3  # locks._MAX_PLANTED
    assert not target.exists()
    path = os.path.join(locks_dir, "kz.lock")
    loop = repr(OSError(errno.ELOOP, os.strerror(errno.ELOOP)))
    assert _messages(caplog) == [f"removing a symlink planted at lock file {path}"] * 3 + [
        f"cannot open lock file {path} ({loop}): no inter-process single-flight"]


def test_a_planted_symlink_someone_else_removed_first_is_no_error(tmp_path, monkeypatch):
    (tmp_path / "kg.lock").symlink_to(tmp_path / "target")
    real_unlink = os.unlink

    def removed_just_before(path, *, dir_fd=None):  # another waiter removed the link a moment before us
        monkeypatch.undo()
        real_unlink(path, dir_fd=dir_fd)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

    monkeypatch.setattr(os, "unlink", removed_just_before)
    with node_lock(tmp_path, "kg", timeout=5) as held:
        assert held
    assert os.listdir(tmp_path) == []


def test_a_lock_file_that_cannot_be_opened_means_no_lock_and_one_warning_per_directory(tmp_path, caplog):
    """A directory squats the lock file's name (EISDIR): no lock, nothing removed, said once per directory."""
    caplog.set_level(logging.WARNING, logger="tiered_progcache.cluster.locks")
    paths = []
    for d in ("a", "b", "a"):
        (tmp_path / d / "kd.lock").mkdir(parents=True, exist_ok=True)
        with node_lock(tmp_path / d, "kd", timeout=5) as held:
            assert not held
        assert (tmp_path / d / "kd.lock").is_dir()
        paths.append(os.path.join(tmp_path / d, "kd.lock"))
    isdir = repr(IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
    assert _messages(caplog) == [f"cannot open lock file {p} ({isdir}): no inter-process single-flight"
                                 for p in paths[:2]]


class _NoLocksFcntl:
    """``fcntl`` on a filesystem without locks (NFS without lockd): every flock fails with ENOLCK."""

    LOCK_EX, LOCK_NB, LOCK_UN = fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_UN

    @staticmethod
    def flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_a_filesystem_without_flock_means_no_lock_no_leaked_descriptor_and_one_warning_per_directory(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(locks, "fcntl", _NoLocksFcntl)
    caplog.set_level(logging.WARNING, logger="tiered_progcache.cluster.locks")
    before = len(os.listdir("/proc/self/fd"))
    paths = []
    for d in ("a", "b", "a"):
        with node_lock(tmp_path / d, "kn", timeout=5) as held:
            assert not held
        paths.append(os.path.join(tmp_path / d, "kn.lock"))
    assert len(os.listdir("/proc/self/fd")) == before and not locks._held_fds
    nolck = repr(OSError(errno.ENOLCK, os.strerror(errno.ENOLCK)))
    assert _messages(caplog) == [f"flock failed on {p} ({nolck}): no inter-process single-flight" for p in paths[:2]]


def test_a_follower_waits_no_longer_than_its_timeout():
    flights: ThreadSingleFlight[str] = ThreadSingleFlight()
    got = []

    def follow() -> None:
        with flights.lead("k") as seat:
            assert not seat.leader
            got.append(seat.wait(timeout=0.01))

    with flights.lead("k") as seat:
        assert seat.leader
        follower = threading.Thread(target=follow)
        follower.start()
        follower.join(10)  # the leader is still at work: the follower's wait ends by its own timeout
        assert not follower.is_alive()
        seat.result = "late"
    assert got == [None]


def test_a_child_forked_while_a_flight_is_under_way_starts_with_none_and_leads_at_once():
    """The parent's leader thread does not exist in the child: its flight would never finish there."""
    flights: ThreadSingleFlight[str] = ThreadSingleFlight()
    entered, release = threading.Event(), threading.Event()

    def lead() -> None:
        with flights.lead("k") as seat:
            assert seat.leader
            entered.set()
            release.wait(JOIN_S)

    leader = threading.Thread(target=lead)
    leader.start()
    try:
        assert entered.wait(JOIN_S) and flights.in_flight() == 1
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                with flights.lead("k") as seat:
                    code = 0 if seat.leader and flights.in_flight() == 1 else 1
            finally:
                os.write(w, bytes([code]))
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"\0"
        os.waitpid(pid, 0)
        os.close(r)
        assert flights.in_flight() == 1  # the parent's flight goes on
    finally:
        release.set()
        leader.join(JOIN_S)
