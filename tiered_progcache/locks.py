"""Single-flight at three scopes: threads of a process, processes of a node, nodes of a cluster.

* :class:`ThreadSingleFlight` -- one thread per key does the work; the others wait on
  an event and get its result (or its exception).
* :func:`node_lock` -- an exclusive ``flock`` on ``<cache dir>/locks/<name>.lock``.
  The kernel drops it when the holder dies, so a crash never leaves it stuck; the
  holder unlinks the file before unlocking, and a waiter that locked an unlinked
  file starts over, so lock files do not pile up.
* :class:`RemoteLease` -- an object ``<root>/leases/<name>`` created only if absent
  (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, ``link(2)`` on a local or
  NFS path), holding its expiry. The holder renews it while it works; a waiter that
  finds it expired breaks it. fsspec's generic ``mode="create"`` is check-then-write,
  so filesystems not known to do a real conditional create get no lease at all
  (:func:`lease_supported`): the caller falls back to node-level single-flight.

Every wait here is bounded: whoever runs out of patience does the work itself. A
duplicate compile is the worst outcome of any race, never a wrong entry or a hang.
Lease expiry compares wall clocks of different hosts: keep them within a few
seconds of each other (NTP), or make the lease TTL comfortably larger than the skew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Generic, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LEASE_FORMAT",
    "LeaseInfo",
    "RemoteLease",
    "ThreadSingleFlight",
    "lease_supported",
    "node_lock",
    "wait_for_lease",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_FORMAT = "tiered-progcache/lease"

#: First and largest pause between polls of a lock or lease, in seconds.
NODE_POLL_S = (0.001, 0.02)
LEASE_POLL_S = (0.05, 1.0)

# Object stores and local paths where a create-if-absent is one atomic request.
_CONDITIONAL_CREATE_PROTOCOLS = frozenset({"memory", "s3", "s3a", "gs", "gcs"})
_LOCAL_PROTOCOLS = frozenset({"file", "local"})

_logged_once: set[str] = set()
_logged_once_lock = threading.Lock()


def _log_once(tag: str, level: int, msg: str, *args: object) -> None:
    with _logged_once_lock:
        if tag in _logged_once:
            return
        _logged_once.add(tag)
    logger.log(level, msg, *args)


def _backoff(delay: float, limit: float) -> float:
    return min(delay * 1.5, limit)


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

    >>> with node_lock(cache.local_dir / "locks", entry_name(key), timeout=300) as held:
    ...     compile_unless_someone_did()

    Safe across threads and processes of one host (and NFS clients with working
    locks). A holder that dies releases the lock with its file descriptors.
    """
    if fcntl is None:  # pragma: no cover - Windows
        _log_once("no-flock", logging.INFO, "no flock on this platform: no inter-process single-flight")
        yield False
        return
    try:
        os.makedirs(locks_dir, exist_ok=True)
    except OSError as exc:
        _log_once(f"locks-dir:{locks_dir}", logging.WARNING,
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
            _log_once(f"lockfile:{os.path.dirname(path)}", logging.WARNING,
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
                delay = _backoff(delay, limit)
            except OSError as exc:  # e.g. ENOLCK on a filesystem without locks
                os.close(fd)
                _log_once(f"flock:{os.path.dirname(path)}", logging.WARNING,
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


# -- nodes of a cluster ---------------------------------------------------------------------


def _protocols(fs: Any) -> set[str]:
    proto = getattr(fs, "protocol", ())
    return {proto} if isinstance(proto, str) else set(proto)


def lease_supported(fs: Any) -> bool:
    """True if ``fs`` can create an object only when absent, atomically (by protocol; pure, thread-safe).

    >>> lease_supported(fsspec.filesystem("s3"))      # If-None-Match: *
    True
    """
    return bool(_protocols(fs) & (_CONDITIONAL_CREATE_PROTOCOLS | _LOCAL_PROTOCOLS))


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    """What a lease object says: who holds it and until when (holder's wall clock). Immutable."""

    holder: str
    token: str
    acquired_at: float
    expires_at: float
    raw: bytes

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


class RemoteLease:
    """The lease on one cache entry in a shared filesystem: ``<root>/leases/<name>``.

    >>> lease = RemoteLease(remote.fs, remote.root, entry_name(key), ttl_s=60)
    >>> if lease.try_acquire():
    ...     try: compile_and_upload()
    ...     finally: lease.release()

    Safe across threads, processes and hosts on stores with a conditional create
    (see :func:`lease_supported`); one instance is one attempt by one holder.
    """

    def __init__(self, fs: Any, root: str, name: str, ttl_s: float, *, op_timeout_s: float | None = 10.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.fs = fs
        self.ttl_s = float(ttl_s)
        self.op_timeout_s = op_timeout_s
        base = str(root).rstrip("/")
        self.path = f"{base}/leases/{name}" if base else f"leases/{name}"
        self._local = bool(_protocols(fs) & _LOCAL_PROTOCOLS)
        if self._local:
            strip = getattr(fs, "_strip_protocol", None)
            self._local_path = os.path.normpath(strip(self.path) if strip is not None else self.path)
        self.token = uuid.uuid4().hex
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.held = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- the object itself ----------------------------------------------------------

    def _document(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "format": LEASE_FORMAT,
                "version": 1,
                "holder": self.holder,
                "token": self.token,
                "acquired_at": now,
                "expires_at": now + self.ttl_s,
            },
            sort_keys=True,
        ).encode()

    def _io(self, fn: Callable[[], T], what: str) -> T:
        """Run one store request, bounded by ``op_timeout_s`` (a hung mount or endpoint raises TimeoutError)."""
        if self.op_timeout_s is None:
            return fn()
        return _call_with_deadline(fn, self.op_timeout_s, f"lease {what} on {self.path}")

    def _create(self, data: bytes) -> bool:
        def create() -> bool:
            if self._local:
                return _local_create(self._local_path, data)
            try:
                self.fs.pipe_file(self.path, data, mode="create")
            except FileExistsError:
                return False
            return True

        return self._io(create, "create")

    def _overwrite(self, data: bytes) -> None:
        def overwrite() -> None:
            if self._local:
                _local_replace(self._local_path, data)
            else:
                self.fs.pipe_file(self.path, data)

        self._io(overwrite, "renew")

    def _read_raw(self) -> bytes | None:
        def read() -> bytes | None:
            try:
                if self._local:
                    with open(self._local_path, "rb") as fh:
                        return fh.read()
                return bytes(self.fs.cat_file(self.path))
            except FileNotFoundError:
                return None

        return self._io(read, "read")

    def _delete(self) -> None:
        def delete() -> None:
            try:
                if self._local:
                    os.unlink(self._local_path)
                else:
                    self.fs.rm_file(self.path)
            except FileNotFoundError:
                pass

        self._io(delete, "delete")

    # -- protocol -------------------------------------------------------------------

    def read(self) -> LeaseInfo | None | bytes:
        """The current lease; None if there is none; the raw bytes if they are not a lease."""
        raw = self._read_raw()
        if raw is None:
            return None
        return _parse_lease(raw) or raw

    def try_acquire(self) -> bool:
        """Create the lease if absent; True if this instance now holds it. Raises on I/O errors."""
        if self.held:
            return True
        if not self._create(self._document()):
            return False
        self.held = True
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="tiered-progcache-lease", daemon=True)
        self._renewer.start()
        return True

    def break_if_unchanged(self, seen: bytes) -> None:
        """Delete an expired lease, unless it changed since it was read as ``seen``.

        Check-then-delete is not atomic: two waiters breaking the same lease can both
        end up compiling. That costs one duplicate compile, nothing else.
        """
        if self._read_raw() == seen:
            self._delete()

    def _renew_loop(self) -> None:
        interval = self.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                info = self.read()
                if not isinstance(info, LeaseInfo) or info.token != self.token:
                    logger.warning("lease %s was taken over while held; carrying on without it", self.path)
                    return
                self._overwrite(self._document())
            except Exception as exc:
                logger.warning("could not renew lease %s: %r", self.path, exc)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours. Never raises."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        try:
            info = self.read()
            if isinstance(info, LeaseInfo) and info.token == self.token:
                self._delete()
        except Exception as exc:
            logger.warning("could not release lease %s (it expires by itself): %r", self.path, exc)


def _call_with_deadline(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``fn()`` on a daemon thread; TimeoutError if it takes longer than ``timeout`` (it is abandoned)."""
    done = threading.Event()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller below
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="tiered-progcache-lease-io", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"{what} took longer than {timeout:g} s")
    ok, value = box[0]
    if ok:
        return value
    raise value


def _parse_lease(raw: bytes) -> LeaseInfo | None:
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT:
            return None
        holder, token = doc["holder"], doc["token"]
        acquired_at, expires_at = float(doc["acquired_at"]), float(doc["expires_at"])
        if not isinstance(holder, str) or not isinstance(token, str):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    return LeaseInfo(holder, token, acquired_at, expires_at, raw)


def _local_create(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if absent: stage, then ``link(2)`` (atomic, NFS-safe)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lease-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            # A filesystem without hard links: O_EXCL, then write. A reader may briefly
            # see an empty file; it treats unreadable bytes as a lease of unknown age.
            try:
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(out, "wb") as fh:
                fh.write(data)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _local_replace(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".lease-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def wait_for_lease(
    lease: RemoteLease,
    poll: Callable[[], T | None],
    timeout: float,
) -> tuple[T | None, bool]:
    """Take ``lease``, or wait for whoever holds it to produce the result.

    >>> found, held = wait_for_lease(lease, lambda: cache.get(key), timeout=300)

    Returns ``(None, True)`` when this caller now holds the lease (do the work, then
    ``lease.release()``); ``(result, False)`` when ``poll()`` found the holder's
    result; ``(None, False)`` when the wait ran out or the store failed (do the
    work without a lease). An expired lease (a crashed holder) is broken and
    retaken, so a crash costs the others at most the lease TTL.

    Any number of threads, processes and hosts may wait on one lease at once, each
    with its own :class:`RemoteLease`; ``poll`` is called from the calling thread only.
    """
    deadline = time.monotonic() + timeout
    delay, limit = LEASE_POLL_S
    unreadable_since: float | None = None
    quick_retries = 0  # retries without a pause (lease just released or broken); capped
    first = True
    while True:
        if not first:
            # Look for the holder's result before trying the lease again: once it is
            # published there is no point taking (and releasing) a lease for it.
            found = poll()
            if found is not None:
                return found, False
        first = False
        try:
            if lease.try_acquire():
                return None, True
            info = lease.read()
        except Exception as exc:
            _log_once(f"lease-io:{type(exc).__name__}", logging.WARNING,
                      "lease store failed (%r): going ahead without a lease", exc)
            return None, False
        now = time.time()
        if info is None:
            pause = 0.0  # released between our create and our read: try to take it
        elif isinstance(info, LeaseInfo):
            unreadable_since = None
            if info.expired(now):
                logger.info("lease %s held by %s expired; breaking it", lease.path, info.holder)
                with contextlib.suppress(Exception):
                    lease.break_if_unchanged(info.raw)
                pause = 0.0
            else:
                pause = min(delay, info.expires_at - now + 0.01)
        else:
            # Not a lease document (a partial write, or garbage): give it one TTL.
            if unreadable_since is None:
                unreadable_since = now
            until_expiry = unreadable_since + lease.ttl_s - now
            if until_expiry <= 0:
                with contextlib.suppress(Exception):
                    lease.break_if_unchanged(info)
                unreadable_since = None
                pause = 0.0
            else:
                pause = min(delay, until_expiry + 0.01)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            logger.info("waited %.1f s for lease %s; going ahead without it", timeout, lease.path)
            return None, False
        if pause <= 0.0:
            quick_retries += 1
            if quick_retries <= 3:
                continue
            pause = delay  # a store that keeps answering "taken" and "gone": slow down
        quick_retries = 0
        time.sleep(max(0.0, min(pause, remaining)))
        delay = _backoff(delay, limit)
