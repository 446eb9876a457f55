"""In-host single-flight: one thread of a process (:class:`ThreadSingleFlight`), one process of a node
(:func:`node_lock`, an ``flock`` the kernel drops when its holder dies), does the work per key.

Every wait here is bounded: whoever runs out of patience does the work itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from .. import forks
from ..stores.fsutil import make_dirs
from ..stores.ratelimit import log_once

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["NODE_POLL_S", "ThreadSingleFlight", "node_lock"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: First and largest pause between tries of a node lock, in seconds.
NODE_POLL_S = (0.001, 0.02)


# -- threads -----------------------------------------------------------------------------


class _Flight(Generic[T]):
    __slots__ = ("_done", "_result", "_error", "followers")

    def __init__(self) -> None:
        self.followers = 0
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    def wait(self, timeout: float | None) -> T | None:
        """The leader's result; raises its exception; None if it gave up or ``timeout`` ran out."""
        if not self._done.wait(timeout):
            return None
        if self._error is not None:
            raise self._error
        return self._result


class ThreadSingleFlight(Generic[T]):
    """At most one thread per key runs the work; the others share its outcome.

    >>> flights = ThreadSingleFlight()
    >>> with flights.lead(key) as flight:
    ...     if flight.leader: flight.result = work()
    ...     else: value = flight.wait(timeout=60)

    Thread-safe. Per process: a forked child starts with no flights.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Any, _Flight[T]] = {}
        _all_flights.add(self)

    def _forget_after_fork(self) -> None:
        # The child has none of the parent's threads: their flights would never finish.
        self._lock = threading.Lock()
        self._flights = {}

    def in_flight(self) -> int:
        """Keys being worked on now."""
        with self._lock:
            return len(self._flights)

    def followers(self, key: Any) -> int:
        """Threads that joined the flight for ``key`` as followers (0 if none is under way)."""
        with self._lock:
            flight = self._flights.get(key)
            return flight.followers if flight is not None else 0

    @contextlib.contextmanager
    def lead(self, key: Any) -> Iterator[_Seat[T]]:
        """Join the flight for ``key``: leader if none is under way, else follower."""
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
            else:
                flight.followers += 1
        assert flight is not None
        seat: _Seat[T] = _Seat(leader, flight)
        if not leader:
            yield seat
            return
        try:
            yield seat
        except Exception as exc:
            flight._error = exc  # followers raise what the leader raised
            raise
        finally:
            # A BaseException (KeyboardInterrupt, SystemExit) or a leader that set no
            # result leaves _result None: followers see None and do the work themselves.
            if flight._error is None:
                flight._result = seat.result
            with self._lock:
                if self._flights.get(key) is flight:
                    del self._flights[key]
            flight._done.set()


_all_flights: weakref.WeakSet[ThreadSingleFlight[Any]] = weakref.WeakSet()


def _forget_flights_after_fork() -> None:
    for flights in list(_all_flights):
        flights._forget_after_fork()


forks.register(_forget_flights_after_fork)


@dataclasses.dataclass
class _Seat(Generic[T]):
    leader: bool
    flight: _Flight[T]
    result: T | None = None

    def wait(self, timeout: float | None) -> T | None:
        return self.flight.wait(timeout)


# -- processes of one node ---------------------------------------------------------------------

# Lock descriptors this process holds (opened, locked or waiting), so a forked child can
# drop its copies: an flock belongs to the open file description, which fork shares, so
# a child keeping its copy would keep the lock after the parent lets go.
_held_fds: set[int] = set()
_held_lock = threading.Lock()
#: Planted entries at a lock file's name (a symlink) removed before giving up on the lock.
_MAX_PLANTED = 3


def _drop_lock_fds_after_fork() -> None:
    # The child closes its copies without unlocking (LOCK_UN would free the parent's lock too).
    global _held_lock
    _held_lock = threading.Lock()
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()


forks.register(_drop_lock_fds_after_fork)


@contextlib.contextmanager
def node_lock(locks_dir: str | os.PathLike[str], name: str, timeout: float) -> Iterator[bool]:
    """Hold ``<locks_dir>/<name>.lock`` exclusively; yields False if not held (timeout, no flock).

    Safe across threads and processes of one host (and NFS clients with working locks). A dead
    holder's lock goes with its descriptors; a forked child drops its copies, and the release
    unlocks explicitly, so no inherited descriptor keeps it. The holder unlinks the file before
    unlocking and a waiter that locked an unlinked file starts over, so lock files do not pile up.
    ``locks_dir`` must not be a symlink; a symlink at the lock file's name is removed, never followed.
    """
    if fcntl is None:  # pragma: no cover - Windows
        log_once(logger, "no-flock", logging.INFO, "no flock on this platform: no inter-process single-flight")
        yield False
        return
    locks_dir = os.fspath(locks_dir)
    try:
        make_dirs(locks_dir)  # never world-writable, whatever the umask
        dir_fd = os.open(locks_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        log_once(logger, f"locks-dir:{locks_dir}", logging.WARNING,
                 "cannot use lock directory %s (%r; a symlink is refused): no inter-process single-flight",
                 locks_dir, exc)
        yield False
        return
    try:
        filename = name + ".lock"
        path = os.path.join(locks_dir, filename)
        fd = _acquire_file_lock(dir_fd, filename, path, time.monotonic() + timeout)
        if fd is None:
            yield False
            return
        owner = os.getpid()
        try:
            yield True
        finally:
            if os.getpid() == owner:  # a forked child that left the block already dropped its copy
                # Unlink first, while we hold it: a waiter that then locks the old file sees it
                # is no longer the one at ``path`` and starts over on a fresh one.
                with contextlib.suppress(OSError):
                    os.unlink(filename, dir_fd=dir_fd)
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                _close_lock_fd(fd)
    finally:
        os.close(dir_fd)


def _open_lock_fd(dir_fd: int, filename: str) -> int:
    with _held_lock:
        fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        _held_fds.add(fd)
        return fd


def _close_lock_fd(fd: int) -> None:
    with _held_lock:
        _held_fds.discard(fd)
        os.close(fd)


def _acquire_file_lock(dir_fd: int, filename: str, path: str, deadline: float) -> int | None:
    delay, limit = NODE_POLL_S
    planted = 0
    while True:
        try:
            fd = _open_lock_fd(dir_fd, filename)
        except OSError as exc:
            if exc.errno == errno.ELOOP and planted < _MAX_PLANTED:
                planted += 1  # a symlink at our lock's name: remove the link itself, never follow it
                logger.warning("removing a symlink planted at lock file %s", path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(filename, dir_fd=dir_fd)
                continue
            log_once(logger, f"lockfile:{os.path.dirname(path)}", logging.WARNING,
                     "cannot open lock file %s (%r): no inter-process single-flight", path, exc)
            return None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    _close_lock_fd(fd)
                    logger.info("waited too long for %s; going ahead without it", path)
                    return None
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 1.5, limit)
            except OSError as exc:  # e.g. ENOLCK on a filesystem without locks
                _close_lock_fd(fd)
                log_once(logger, f"flock:{os.path.dirname(path)}", logging.WARNING,
                         "flock failed on %s (%r): no inter-process single-flight", path, exc)
                return None
        try:
            st = os.stat(filename, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            _close_lock_fd(fd)
            continue
        fst = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
            _close_lock_fd(fd)  # locked a file its holder already unlinked
            continue
        return fd
