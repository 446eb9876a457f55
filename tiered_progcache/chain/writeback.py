"""The background uploader: a bounded, coalescing queue drained by one worker thread.

A compile must never wait on the network, so ``submit`` only ever appends to a
dict and returns. The queue is bounded by count and by bytes (queued and under way
together), so a slow remote cannot grow the process without limit. When it is full
the write is dropped (and counted by the caller): losing a remote copy costs one compile elsewhere, blocking costs every
compile here. Pending writes are flushed at interpreter exit within what is left of the
process's one exit budget (:mod:`.exitbudget`, the ``exit_timeout`` setting).

Fork: a child process inherits the queue's state but not its worker thread. After a
``fork()`` every live queue starts empty in the child with no worker (one starts at the
child's first write): writes queued in the parent are the parent's to upload, so the
child neither uploads them twice nor waits on them in ``flush``/``close``.
"""

from __future__ import annotations

import atexit
import collections
import enum
import concurrent.futures.thread  # noqa: F401  (registers its exit hook first; ours must run before it)
import itertools
import logging
import threading
import time
import weakref
from typing import Callable

from . import exitbudget
from .. import forks
from ..settings import DEFAULT_EXIT_TIMEOUT_S, DEFAULT_MAX_PENDING_UPLOADS

__all__ = ["Refused", "WriteBackQueue", "submission_mark"]

logger = logging.getLogger(__name__)

#: The default exit budget, under its old name; the process's own is ``exitbudget.PROCESS.budget_s``.
EXIT_FLUSH_TIMEOUT_S = DEFAULT_EXIT_TIMEOUT_S

_live_queues: weakref.WeakSet[WriteBackQueue] = weakref.WeakSet()

# One sequence over every queue of the process, so one mark covers all of a chain's tiers.
_sequence = itertools.count(1)
_sequence_lock = threading.Lock()


def _next_sequence() -> int:
    with _sequence_lock:
        return next(_sequence)


def submission_mark() -> int:
    """A mark for :meth:`WriteBackQueue.expedite`: every write submitted after this call has a later sequence."""
    return _next_sequence()


class Refused(str, enum.Enum):
    """Why ``submit`` did not queue a write (the caller counts it as dropped and logs this)."""

    CLOSED = "closed"
    FULL = "queue full"
    TOO_MANY_BYTES = "queued bytes at their limit"


class WriteBackQueue:
    """Calls ``store(key, data)`` for each submitted pair on a worker thread.

    Thread-safe: any thread may ``submit``, ``cancel``, ``flush``, ``wait_for``,
    ``expedite`` or ``close``. Writes go out in the order submitted (one worker, no
    batching: a write starts as soon as the ones before it are done), except that
    ``expedite`` moves chosen ones to the front. A key submitted again while still queued
    replaces the queued bytes (one upload, the newest value). ``store`` must not raise;
    if it does, the error is logged and the worker carries on.
    """

    def __init__(
        self,
        store: Callable[[bytes, bytes], None],
        *,
        max_pending: int = DEFAULT_MAX_PENDING_UPLOADS,
        max_pending_bytes: int | None = None,
        name: str = "",
    ) -> None:
        if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending <= 0:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        if max_pending_bytes is not None and (
            not isinstance(max_pending_bytes, int) or isinstance(max_pending_bytes, bool) or max_pending_bytes <= 0
        ):
            raise ValueError(f"max_pending_bytes must be a positive int or None, got {max_pending_bytes!r}")
        self._store = store
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._name = name
        self._pending: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._submitted_at: dict[bytes, int] = {}  # each queued key's submission sequence
        self._in_flight_keys: set[bytes] = set()
        self._in_flight = 0
        self._bytes = 0  # queued and under way
        self._closed = False
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        _live_queues.add(self)

    @property
    def pending(self) -> int:
        """Writes queued or under way."""
        with self._cond:
            return len(self._pending) + self._in_flight

    @property
    def pending_bytes(self) -> int:
        """Bytes of the writes queued or under way."""
        with self._cond:
            return self._bytes

    def submit(self, key: bytes, data: bytes) -> Refused | None:
        """Queue a write; None if queued, else why it was dropped. Never blocks on I/O."""
        with self._cond:
            if self._closed:
                return Refused.CLOSED
            replaced = self._pending.get(key)
            if replaced is None and len(self._pending) >= self._max_pending:
                return Refused.FULL
            grown = self._bytes + len(data) - (0 if replaced is None else len(replaced))
            if self._max_pending_bytes is not None and grown > self._max_pending_bytes:
                return Refused.TOO_MANY_BYTES
            self._bytes = grown
            self._pending[key] = data
            self._submitted_at[key] = _next_sequence()
            if replaced is not None:
                return None
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name=f"tiered-progcache-writeback-{self._name}", daemon=True
                )
                self._worker.start()
            self._cond.notify_all()
            return None

    def cancel(self, key: bytes) -> bool:
        """Drop a queued write of ``key``; True if one was queued."""
        with self._cond:
            data = self._pending.pop(key, None)
            if data is None:
                return False
            self._submitted_at.pop(key, None)
            self._bytes -= len(data)
            self._cond.notify_all()
            return True

    def expedite(self, since: int) -> int:
        """Move the queued writes submitted after ``since`` (a :func:`submission_mark`) to the front, in order.

        For a write others are waiting for (a lease holder's entry): it goes next, not
        after whatever was queued before it. Returns how many moved.
        """
        with self._cond:
            chosen = [key for key in self._pending if self._submitted_at.get(key, 0) > since]
            for key in reversed(chosen):
                self._pending.move_to_end(key, last=False)
            return len(chosen)

    def wait_for(self, key: bytes, timeout: float | None = None) -> bool:
        """Wait until no write of ``key`` is queued or under way; False if ``timeout`` ran out first.

        True at once for a key never submitted (or already written). Unlike :meth:`flush`,
        writes submitted after it do not hold it up.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key in self._pending or key in self._in_flight_keys:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write submitted so far is done; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def discard(self, timeout: float | None = None) -> bool:
        """Drop every queued write and wait for those under way, so none lands after a ``clear()`` that follows;
        False if ``timeout`` ran out with one still under way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._bytes -= sum(len(data) for data in self._pending.values())
            self._pending.clear()
            self._submitted_at.clear()
            self._cond.notify_all()
            while self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new writes, drain the queue within ``timeout``, stop the worker.

        Returns False if writes were still pending when the time ran out; those are dropped.
        """
        with self._cond:
            self._closed = True
        drained = self.flush(timeout)
        with self._cond:
            left = len(self._pending)
            self._bytes -= sum(len(data) for data in self._pending.values())
            self._pending.clear()
            self._submitted_at.clear()
            self._cond.notify_all()
        if left:
            logger.warning("write-back %s closed with %d writes not done", self._name, left)
        _live_queues.discard(self)
        return drained

    def _forget_after_fork(self) -> None:
        """In a forked child: drop the parent's pending writes and its (absent) worker; keep closed-ness."""
        self._cond = threading.Condition()  # the parent's lock may have been held by a thread the child lacks
        self._pending = collections.OrderedDict()
        self._submitted_at = {}
        self._in_flight_keys = set()
        self._in_flight = 0
        self._bytes = 0
        self._worker = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                key, data = self._pending.popitem(last=False)
                self._submitted_at.pop(key, None)
                self._in_flight_keys.add(key)
                self._in_flight += 1
            try:
                self._store(key, data)
            except Exception:
                logger.exception("write-back %s: store raised", self._name)
            finally:
                with self._cond:
                    self._in_flight_keys.discard(key)
                    self._in_flight -= 1
                    self._bytes -= len(data)
                    self._cond.notify_all()


def _flush_at_exit() -> None:
    """Start the exit budget and give pending writes what is left of it; what is not done is dropped with a warning."""
    exitbudget.PROCESS.begin()
    for queue in list(_live_queues):
        if not queue.flush(exitbudget.PROCESS.remaining()):
            logger.warning("interpreter exit: %d background writes not flushed in time", queue.pending)


def _after_fork_in_child() -> None:
    for queue in list(_live_queues):
        queue._forget_after_fork()


forks.register(_after_fork_in_child)


def _register_exit_flush() -> None:
    """Run the exit flush before Python stops its thread pools.

    An upload through s3fs/aiohttp needs ``concurrent.futures`` threads (DNS lookups run
    in the event loop's default executor). ``concurrent.futures`` stops its pools from
    ``threading``'s exit hooks, which run before ``atexit`` handlers, so an ``atexit``
    flush fails every upload with "cannot schedule new futures after shutdown".
    ``threading._register_atexit`` is the hook ``concurrent.futures`` itself uses; its
    callbacks run last-registered first, and ``concurrent.futures.thread`` is imported
    above, so this flush runs before the pools stop. It is a private name (there is no
    public hook that runs early enough): where it is missing, ``atexit`` is used.
    """
    register_early = getattr(threading, "_register_atexit", None)
    if register_early is None:
        atexit.register(_flush_at_exit)
    else:
        register_early(_flush_at_exit)


_register_exit_flush()
