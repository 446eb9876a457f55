"""In-host single-flight: one thread of a process, one process of a node, does the work per key.

* :class:`ThreadSingleFlight` -- one thread per key does the work; the others wait on
  an event and get its result (or its exception).
* :func:`node_lock` -- an exclusive ``flock`` on ``<locks dir>/<name>.lock``.
  The kernel drops it when the holder dies, so a crash never leaves it stuck; the
  holder unlinks the file before unlocking, and a waiter that locked an unlinked
  file starts over, so lock files do not pile up.

Every wait here is bounded: whoever runs out of patience does the work itself. The
cluster scope (a lease in the shared store) is :mod:`tiered_progcache.lease`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from .ratelimit import log_once

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

    Thread-safe. Not shared across processes (each process has its own flights;
    a forked child starts with none).
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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_flights_after_fork)


@dataclasses.dataclass
class _Seat(Generic[T]):
    leader: bool
    flight: _Flight[T]
    result: T | None = None

    def wait(self, timeout: float | None) -> T | None:
        return self.flight.wait(timeout)


# -- processes of one node ---------------------------------------------------------------------


@contextlib.contextmanager
def node_lock(locks_dir: str | os.PathLike[str], name: str, timeout: float) -> Iterator[bool]:
    """Hold ``<locks_dir>/<name>.lock`` exclusively; yields False if not held (timeout, no flock).

    >>> with node_lock(local.locks_dir, entry_name(key), timeout=300) as held:
    ...     compile_unless_someone_did()

    Safe across threads and processes of one host (and NFS clients with working
    locks). A holder that dies releases the lock with its file descriptors.
    """
    if fcntl is None:  # pragma: no cover - Windows
        log_once(logger, "no-flock", logging.INFO, "no flock on this platform: no inter-process single-flight")
        yield False
        return
    try:
        os.makedirs(locks_dir, exist_ok=True)
    except OSError as exc:
        log_once(logger, f"locks-dir:{locks_dir}", logging.WARNING,
                 "cannot create lock directory %s (%r): no inter-process single-flight", locks_dir, exc)
        yield False
        return
    path = os.path.join(os.fspath(locks_dir), name + ".lock")
    fd = _acquire_file_lock(path, time.monotonic() + timeout)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        # Unlink first, while we hold it: a waiter that then locks the old file sees it
        # is no longer the one at ``path`` and starts over on a fresh one.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _acquire_file_lock(path: str, deadline: float) -> int | None:
    delay, limit = NODE_POLL_S
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
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
                    os.close(fd)
                    logger.info("waited too long for %s; going ahead without it", path)
                    return None
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 1.5, limit)
            except OSError as exc:  # e.g. ENOLCK on a filesystem without locks
                os.close(fd)
                log_once(logger, f"flock:{os.path.dirname(path)}", logging.WARNING,
                         "flock failed on %s (%r): no inter-process single-flight", path, exc)
                return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            os.close(fd)
            continue
        fst = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
            os.close(fd)  # locked a file its holder already unlinked
            continue
        return fd
