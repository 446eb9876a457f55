"""The cluster lease on one cache entry: a small object in a shared store that one node holds while it compiles.

Created only if absent (a :class:`~tiered_progcache.stores.store.LeaseStore` with ``atomic_create``),
renewed every third of its TTL, broken by a waiter once it expired; every request is bounded by the
store's deadline and breaker. The worst outcome of any race here is a duplicate compile, never a
wrong entry or a hang. docs/cluster.md ("When nodes wait") has the timing and the clock-skew caveat.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable, Generic, Protocol, TypeVar

from ..settings import MAX_SECONDS
from ..stores.ratelimit import log_once
from ..stores.store import LeaseStore

__all__ = ["DEFAULT_POLL_S", "FAILURE_TTL_S", "LEASE_FORMAT", "LEASE_RECHECK_S", "FixedWait", "HolderProcess",
           "LeaseInfo", "LeaseWait", "RemoteLease", "WaitEnd", "WaitPlan", "wait_for_lease"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_FORMAT = "tiered-progcache/lease"
#: Seconds between a waiter's looks for the holder's result when no plan says otherwise.
DEFAULT_POLL_S = 0.05
#: A waiter re-reads a taken lease this often (and at its expiry): it matters only for a crashed or failed holder.
LEASE_RECHECK_S = 1.0
#: How long after a lease's stated expiry a waiter looks again (so the lease has expired when it looks).
EXPIRY_MARGIN_S = 0.01
#: Retries without a pause (the lease was just released or broken) before pausing anyway.
QUICK_RETRIES = 3
#: How long a failed holder's failure record stands in place of its lease (waiters raise it meanwhile).
FAILURE_TTL_S = 10.0


@dataclasses.dataclass(frozen=True)
class HolderProcess:
    """The process that wrote a lease, precisely enough for a waiter on its host to see it died. Immutable.

    ``boot_id`` and ``pid_ns`` rule out a PID of another boot or PID namespace; ``start``
    (``/proc/<pid>/stat`` field 22) tells a reused PID from the holder.
    """

    host: str
    boot_id: str
    pid_ns: str
    pid: int
    start: int | None

    @classmethod
    def current(cls) -> HolderProcess:
        """This process."""
        pid = os.getpid()
        return cls(*_this_host(), pid, _start_ticks(pid))

    def as_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: object) -> HolderProcess | None:
        if not isinstance(doc, dict):
            return None
        host, boot_id, pid_ns, pid, start = (doc.get(k) for k in ("host", "boot_id", "pid_ns", "pid", "start"))
        if not (isinstance(host, str) and isinstance(boot_id, str) and isinstance(pid_ns, str)):
            return None
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            return None
        return cls(host, boot_id, pid_ns, pid, start)

    def is_gone(self) -> bool:
        """True only when this host can tell for sure that the process no longer runs (elsewhere the TTL decides)."""
        if not (self.boot_id and self.pid_ns) or (self.host, self.boot_id, self.pid_ns) != _this_host():
            return False  # another host, or no /proc: cannot tell a PID of this namespace from another's
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[-1].split()
        except FileNotFoundError:
            return True  # no such process
        except OSError:
            return False
        if fields and fields[0] in ("Z", "X"):
            return True  # dead, not yet reaped
        if self.start is not None and len(fields) > 19 and fields[19] != str(self.start):
            return True  # the PID now belongs to another process
        return False


def _this_host() -> tuple[str, str, str]:
    """(host name, boot id, PID namespace) of this process."""
    return socket.gethostname(), _read_text("/proc/sys/kernel/random/boot_id"), _pid_namespace()


def _read_text(path: str) -> str:
    """The file's text, stripped; "" where it cannot be read (without /proc nothing is judged)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    fields = _read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    """What a lease object says: who holds it and until when (holder's wall clock). Immutable.

    ``failure``: the sealed record of a holder whose work failed (None while it works), still to be opened.
    """

    holder: str
    token: str
    acquired_at: float
    expires_at: float
    raw: bytes
    process: HolderProcess | None = None
    failure: bytes | None = None

    def expired(self, now: float | None = None) -> bool:
        """True once ``now`` (seconds since the epoch; default: this host's clock) reaches the expiry."""
        return (time.time() if now is None else now) >= self.expires_at

    def holder_gone(self) -> bool:
        """True when the holder ran on this host and its process is known to be dead."""
        return self.process is not None and self.process.is_gone()


def _parse_lease(raw: bytes) -> LeaseInfo | None:
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT:
            return None
        holder, token = doc["holder"], doc["token"]
        acquired_at, expires_at = float(doc["acquired_at"]), float(doc["expires_at"])
        if not isinstance(holder, str) or not isinstance(token, str):
            return None
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return LeaseInfo(holder, token, acquired_at, expires_at, raw, HolderProcess.from_json(doc.get("process")),
                     _failure_or_none(doc.get("failure")))


def _failure_or_none(value: object) -> bytes | None:
    """The sealed failure record a lease document carries (base64), or None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, binascii.Error):
        return None


class RemoteLease:
    """One holder's attempt at the lease ``name`` in ``leases``.

    >>> lease = RemoteLease(shared.leases(), entry_name(key), ttl_s=60)
    >>> if lease.try_acquire():
    ...     try: compile_and_upload()
    ...     finally: lease.release()

    Safe across threads, processes and hosts when ``leases.atomic_create`` is True; one instance
    is one attempt by one holder. ``clock``: the wall clock the expiry is written and judged by.
    """

    def __init__(self, leases: LeaseStore, name: str, ttl_s: float, *, clock: Callable[[], float] = time.time) -> None:
        if not 0 < ttl_s <= MAX_SECONDS:  # NaN fails both; the renewer waits a third of it
            raise ValueError(f"ttl_s must be positive and at most {MAX_SECONDS:.0f} seconds (a year, the longest "
                             f"wait the library schedules), got {ttl_s!r}")
        self.leases = leases
        self.name = name
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.process = HolderProcess.current()
        self.held = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def location(self) -> str:
        """Where the lease object lives, for messages."""
        return f"{self.leases.location.rstrip('/')}/{self.name}"

    def _document(self, ttl_s: float | None = None, failure: bytes | None = None) -> bytes:
        now = self.clock()
        doc: dict[str, object] = {
            "format": LEASE_FORMAT,
            "version": 1,
            "holder": self.holder,
            "token": self.token,
            "acquired_at": now,
            "expires_at": now + (self.ttl_s if ttl_s is None else ttl_s),
            "process": self.process.as_json(),
        }
        if failure is not None:
            doc["failure"] = base64.b64encode(failure).decode("ascii")
        return json.dumps(doc, sort_keys=True).encode()

    def read(self) -> LeaseInfo | None | bytes:
        """The current lease; None if there is none; the raw bytes if they are not a lease."""
        raw = self.leases.read(self.name)
        if raw is None:
            return None
        return _parse_lease(raw) or raw

    def try_acquire(self) -> bool:
        """Create the lease if absent; True if this instance now holds it. Raises on store errors."""
        if self.held:
            return True
        if not self.leases.create(self.name, self._document(), self.ttl_s):
            return False
        self.held = True
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="tiered-progcache-lease", daemon=True)
        self._renewer.start()
        return True

    def renew(self) -> bool:
        """Push the expiry a TTL past now if the lease is ours; False if another took it; raises on store errors."""
        info = self.read()
        if not isinstance(info, LeaseInfo) or info.token != self.token:
            return False
        self.leases.replace(self.name, self._document(), self.ttl_s)
        return True

    def break_if_unchanged(self, seen: bytes) -> bool:
        """Delete an expired lease, unless it changed since it was read as ``seen``; True if this call did.

        Exactly one waiter breaks a given lease: the one that creates the marker
        ``<name>.break-<digest of seen>`` (otherwise two could delete, one of them a new holder's
        lease). A marker left by a waiter that died mid-break is removed after one TTL.
        """
        marker = f"{self.name}.break-{hashlib.sha256(seen, usedforsecurity=False).hexdigest()[:32]}"
        now = self.clock()
        doc = json.dumps({"format": LEASE_FORMAT + "/break", "expires_at": now + self.ttl_s}).encode()
        if not self.leases.create(marker, doc, self.ttl_s):
            left = self.leases.read(marker)
            if left is not None and _break_marker_expired(left, now):
                self.leases.delete(marker)  # its breaker died mid-break: the next waiter may try
            return False
        try:
            if self.leases.read(self.name) != seen:
                return False
            self.leases.delete(self.name)
            return True
        finally:
            self.leases.delete(marker)

    def _renew_loop(self) -> None:
        interval = self.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                if not self.renew():
                    logger.warning("lease %s was taken over while held; carrying on without it", self.location)
                    return
            except Exception as exc:
                logger.warning("could not renew lease %s: %r", self.location, exc)

    def _stop_renewing(self) -> None:
        self.held = False
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)

    def publish_failure(self, record: bytes, ttl_s: float = FAILURE_TTL_S) -> bool:
        """Replace the held lease by ``record`` (sealed) for ``ttl_s``, so its waiters raise it; stop holding it.

        False (and the lease released instead) if the lease is no longer ours or the store failed. Never raises.
        """
        if not self.held:
            return False
        self._stop_renewing()
        try:
            info = self.read()
            if isinstance(info, LeaseInfo) and info.token == self.token:
                self.leases.replace(self.name, self._document(min(ttl_s, self.ttl_s), record), min(ttl_s, self.ttl_s))
                return True
        except Exception as exc:
            logger.warning("could not publish the failure on lease %s: %r", self.location, exc)
        self.held = True
        self.release()
        return False

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours. Never raises."""
        if not self.held:
            return
        self._stop_renewing()
        try:
            info = self.read()
            if isinstance(info, LeaseInfo) and info.token == self.token:
                self.leases.delete(self.name)
        except Exception as exc:
            logger.warning("could not release lease %s (it expires by itself): %r", self.location, exc)


class WaitPlan(Protocol):
    """How often a waiter looks (:mod:`.flightpolicy` makes the real one from the remote's latency)."""

    def poll_period(self) -> float:
        """Seconds from the start of one look for the holder's result to the start of the next."""


@dataclasses.dataclass(frozen=True)
class FixedWait:
    """A plan with a fixed poll period. Immutable."""

    poll_s: float = DEFAULT_POLL_S

    def poll_period(self) -> float:
        return self.poll_s


class WaitEnd(str, enum.Enum):
    """How :func:`wait_for_lease` ended; each value is the flight decision it is counted as (``stats().flight``)."""

    HELD = "held"  # the caller holds the lease: do the work, then release it
    FOUND = "waited"  # poll() returned the holder's result
    FAILED = "failed"  # the holder published its failure: raise it (``LeaseWait.failure``)
    TIMEOUT = "gave_up"  # the caller's timeout ran out: do the work without the lease
    STORE_FAILED = "no_lease"  # the lease store raised: do the work without the lease


@dataclasses.dataclass(frozen=True)
class LeaseWait(Generic[T]):
    """What :func:`wait_for_lease` found: the holder's result, the lease, its failure, or none of them. Immutable.

    ``waited_s``: on the wait's clock; ``failure``: what ``open_failure`` made of the holder's record (FAILED).
    """

    found: T | None
    held: bool
    end: WaitEnd
    waited_s: float
    failure: object | None = None


def wait_for_lease(lease: RemoteLease, poll: Callable[[], T | None], timeout: float, *, plan: WaitPlan | None = None,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep,
                   open_failure: Callable[[bytes], object | None] | None = None) -> LeaseWait[T]:
    """Take ``lease``, or wait for whoever holds it to produce the result (``poll()`` not None).

    >>> waited = wait_for_lease(lease, lambda: cache.get(key), timeout=300, plan=policy_plan)
    >>> waited.held, waited.found, waited.end

    ``held``: do the work, then ``lease.release()``; FAILED: raise ``failure``; TIMEOUT or
    STORE_FAILED: do the work without a lease. A live holder is waited for; a lease past its
    expiry, unchanged for ``lease.ttl_s``, or whose process died on this host is broken and
    retaken, so no lease can make a wait longer than one TTL past its last renewal, nor ``timeout``.
    ``clock`` (monotonic) and ``sleep`` let tests step time; ``poll`` runs on the calling thread only.
    """
    plan = plan if plan is not None else FixedWait()
    started = clock()
    deadline = started + timeout

    def ended(end: WaitEnd, found: T | None = None, failure: object | None = None) -> LeaseWait[T]:
        return LeaseWait(found, end is WaitEnd.HELD, end, clock() - started, failure)

    def take() -> LeaseWait[T] | None:
        """HELD if the lease is now ours, STORE_FAILED if the store raised (go ahead without it), None if taken."""
        try:
            return ended(WaitEnd.HELD) if lease.try_acquire() else None
        except Exception as exc:  # whatever the store raised: bounded by its deadline, then no lease
            _log_store_failure(exc)
            return ended(WaitEnd.STORE_FAILED)

    if (took := take()) is not None:
        return took
    # Taken. Look for the holder's result and read its lease side by side: one round trip for both.
    pending_read: concurrent.futures.Future[LeaseInfo | None | bytes] | None = _read_aside(lease)
    found = poll()
    if found is not None:
        return ended(WaitEnd.FOUND, found)
    seen_raw: bytes | None = None  # the lease's bytes as last read, and when they last changed
    seen_since = started
    quick_retries = 0  # retries without a pause (the lease was just released or broken); capped
    recheck_at = clock()
    next_poll = started + plan.poll_period()
    while True:
        now = clock()
        if now >= recheck_at:
            try:
                info = lease.read() if pending_read is None else pending_read.result()  # bounded by the store
            except Exception as exc:
                _log_store_failure(exc)
                return ended(WaitEnd.STORE_FAILED)
            pending_read = None
            wall = lease.clock()
            raw = info.raw if isinstance(info, LeaseInfo) else info
            if raw != seen_raw:
                seen_raw, seen_since = raw, now  # renewed, replaced, or new: the holder is alive
            unrenewed_for = now - seen_since
            stale = unrenewed_for >= lease.ttl_s + EXPIRY_MARGIN_S / 2  # an honest expiry comes first
            retake = False
            if info is None:
                # Released: the holder is done (its result is up: look once more) or failed.
                found = poll()
                if found is not None:
                    return ended(WaitEnd.FOUND, found)
                retake = True
            elif isinstance(info, LeaseInfo):
                live = not (info.expired(wall) or stale)
                if live and info.failure is not None and open_failure is not None:
                    failure = open_failure(info.failure)  # its holder is done (and may be gone): it failed
                    if failure is not None:
                        return ended(WaitEnd.FAILED, failure=failure)
                if not live or info.holder_gone():
                    reason = ("expired" if info.expired(wall) else
                              f"not renewed for {unrenewed_for:.3g} s" if stale else
                              "is gone (its process died on this host)")
                    logger.info("lease %s held by %s %s; breaking it", lease.location, info.holder, reason)
                    with contextlib.suppress(Exception):
                        lease.break_if_unchanged(info.raw)
                    retake = True
                else:
                    recheck_at = now + min(LEASE_RECHECK_S, max(0.0, info.expires_at - wall) + EXPIRY_MARGIN_S,
                                           lease.ttl_s - unrenewed_for + EXPIRY_MARGIN_S)
            elif stale:  # not a lease document (a partial write, or garbage), unchanged for one TTL
                with contextlib.suppress(Exception):
                    lease.break_if_unchanged(info)
                retake = True
            else:
                recheck_at = now + min(LEASE_RECHECK_S, lease.ttl_s - unrenewed_for + EXPIRY_MARGIN_S)
            if retake:
                if (took := take()) is not None:
                    return took
                quick_retries += 1  # someone else took it: read it again to learn the new holder
                if quick_retries <= QUICK_RETRIES:
                    recheck_at = now
                else:  # a store that keeps answering "taken" and "gone": slow down
                    quick_retries = 0
                    recheck_at = now + plan.poll_period()
            else:
                quick_retries = 0
        if now >= deadline:
            logger.info("waited %.3g s for lease %s; going ahead without it", timeout, lease.location)
            return ended(WaitEnd.TIMEOUT)
        if recheck_at <= now:
            continue
        if now >= next_poll:
            next_poll = now + plan.poll_period()
            if open_failure is not None:
                pending_read = _read_aside(lease)  # the lease beside the look: a failure is seen as soon
            found = poll()
            if found is not None:
                return ended(WaitEnd.FOUND, found)
            if pending_read is not None:
                recheck_at = now
            continue
        sleep(max(0.0, min(next_poll, recheck_at, deadline) - now))


def _read_aside(lease: RemoteLease) -> concurrent.futures.Future[LeaseInfo | None | bytes]:
    """``lease.read()`` on a daemon thread; every request it makes has the store's own deadline."""
    future: concurrent.futures.Future[LeaseInfo | None | bytes] = concurrent.futures.Future()

    def read() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(lease.read())
            except BaseException as exc:  # handed to the waiter
                future.set_exception(exc)

    threading.Thread(target=read, name="tiered-progcache-lease-read", daemon=True).start()
    return future


def _log_store_failure(exc: BaseException) -> None:
    log_once(logger, f"lease-io:{type(exc).__name__}", logging.WARNING,
             "lease store failed (%r): going ahead without a lease", exc)


def _break_marker_expired(raw: bytes, now: float) -> bool:
    """True if a break marker's time is up; unreadable bytes count as expired (they are not ours)."""
    try:
        return float(json.loads(raw)["expires_at"]) <= now
    except (ValueError, KeyError, TypeError):
        return True
