"""The remote tier's failure policy: a deadline on every operation and a circuit breaker over them.

A dead or hanging remote must cost a bounded amount of time, once (sccache #2820: a
stalled remote stalled every build). So each operation runs against a deadline, and
after ``failure_threshold`` consecutive failures the breaker *opens*: operations are
refused at once (:class:`~tiered_progcache.errors.TierUnavailable`) for ``cooldown_s``
seconds. After the cooldown one operation is let through as a probe; its success
closes the breaker, its failure opens it for another cooldown.

Deadlines are enforced two ways, picked per filesystem:

- async filesystems (s3fs, gcsfs, adlfs): the coroutine runs on the filesystem's own
  event loop under ``asyncio.wait_for`` (``fsspec.asyn.sync(..., timeout=)``), so a
  request that runs out of time is *cancelled*, not abandoned;
- blocking filesystems (local/NFS paths, memory://, sftp): the call runs on a small pool
  of daemon threads and the caller waits on its future with a timeout. A call that
  never returns keeps its thread (Python cannot cancel a blocked thread) but not its
  caller; the pool is bounded, so a remote that hangs every call fills it, the next
  calls time out waiting for a thread, and the breaker opens. Daemon threads never
  hold up interpreter exit.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Awaitable
from typing import Any, Callable, TypeVar

from .errors import TierUnavailable

__all__ = [
    "DEFAULT_COOLDOWN_S",
    "DEFAULT_FAILURE_THRESHOLD",
    "CircuitBreaker",
    "DeadlineRunner",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Consecutive failures that open the breaker.
DEFAULT_FAILURE_THRESHOLD = 3
#: Seconds an open breaker refuses operations before it lets a probe through.
DEFAULT_COOLDOWN_S = 30.0


class CircuitBreaker:
    """Counts consecutive failures of one remote and refuses calls while it cools down.

    >>> breaker.before_call()        # raises TierUnavailable while open
    >>> ...; breaker.record_success()  # or breaker.record_failure(exc)

    Thread-safe (one lock). Per process: each process learns on its own that a remote
    is down, which costs at most ``failure_threshold`` deadlines per cooldown.
    ``clock`` is injectable so tests can step time instead of sleeping.
    """

    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        *,
        name: str = "remote",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(failure_threshold, int) or isinstance(failure_threshold, bool) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, got {failure_threshold!r}")
        if not isinstance(cooldown_s, (int, float)) or isinstance(cooldown_s, bool) or not 0 <= cooldown_s < float("inf"):
            raise ValueError(f"cooldown_s must be a finite number >= 0, got {cooldown_s!r}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = float(cooldown_s)
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self._last_error = ""

    @property
    def state(self) -> str:
        """``"closed"`` (calls go through), ``"open"`` (refused) or ``"half-open"`` (a probe may go)."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if self._probing or self._clock() < self._open_until else "half-open"

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def before_call(self) -> None:
        """Return if a call may go ahead; raise ``TierUnavailable`` while the breaker is open."""
        if self._open_until is None:  # closed: the common case, no lock
            return
        with self._lock:
            if self._open_until is None:
                return
            now = self._clock()
            if self._probing or now < self._open_until:
                wait = max(0.0, self._open_until - now)
                raise TierUnavailable(
                    f"{self.name} skipped after {self._failures} consecutive failures "
                    f"(last: {self._last_error}); next probe in {wait:.0f} s"
                )
            self._probing = True  # this caller is the probe; the others keep waiting

    def record_success(self) -> None:
        if self._failures == 0 and self._open_until is None:
            return
        with self._lock:
            reopened = self._open_until is not None
            self._failures = 0
            self._open_until = None
            self._probing = False
        if reopened:
            logger.warning("%s is reachable again; using it", self.name)

    def record_failure(self, exc: BaseException) -> None:
        with self._lock:
            self._failures += 1
            self._last_error = _one_line(exc)
            was_probe = self._probing
            self._probing = False
            if not was_probe and (self._failures < self.failure_threshold or self._open_until is not None):
                return  # below the threshold, or a call from before the breaker opened
            self._open_until = self._clock() + self.cooldown_s
        logger.warning(
            "%s failed %d times in a row (last: %s); skipping it for %.0f s, then probing again",
            self.name, self._failures, self._last_error, self.cooldown_s,
        )

    def trip(self, exc: BaseException) -> None:
        """Open at once (a remote found unusable at construction), for one cooldown."""
        with self._lock:
            self._failures = max(self._failures, self.failure_threshold)
            self._last_error = _one_line(exc)
            self._probing = False
            self._open_until = self._clock() + self.cooldown_s


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


class DeadlineRunner:
    """Runs a filesystem call against a deadline and raises the builtin ``TimeoutError`` when it runs out.

    Thread-safe. Blocking calls go to at most ``max_threads`` daemon threads, started on
    demand and reused; coroutines go to the filesystem's own loop (see module docstring).
    """

    def __init__(self, max_threads: int = 8, *, name: str = "remote") -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads!r}")
        self._max_threads = max_threads
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def run_async(
        self, loop: Any, coro_fn: Callable[..., Awaitable[T]], *args: Any, timeout: float, what: str = "operation"
    ) -> T:
        """``await coro_fn(*args)`` on ``loop`` (a running loop in another thread), cancelled at ``timeout``."""
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        try:
            return sync(loop, coro_fn, *args, timeout=timeout)
        except FSTimeoutError:  # an asyncio.TimeoutError, not the builtin one before Python 3.11
            raise TimeoutError(f"{what} took longer than {timeout:g} s") from None

    def run_sync(self, fn: Callable[..., T], *args: Any, timeout: float, what: str = "operation") -> T:
        """``fn(*args)`` on a pool thread; the caller waits at most ``timeout`` seconds."""
        future = self.submit(fn, *args)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            if future.done() and not future.cancelled():
                raise  # fn's own TimeoutError (a socket timeout), not our deadline
            future.cancel()  # still queued: never runs. Running: its thread finishes on its own.
            raise TimeoutError(f"{what} took longer than {timeout:g} s") from None

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._jobs.put((future, fn, args))
            if self._idle == 0 and self._threads < self._max_threads:
                self._threads += 1
                threading.Thread(
                    target=self._work,
                    args=(self._jobs,),
                    name=f"tiered-progcache-{self._name}-{self._threads}",
                    daemon=True,
                ).start()
            elif self._idle:
                self._idle -= 1
        return future

    def close(self) -> None:
        """Let the threads go; a thread stuck in a call exits when the call returns.

        A later call starts fresh threads, so a closed runner still works (as cuda-core's
        tiers do after ``close()``).
        """
        with self._lock:
            jobs, threads = self._jobs, self._threads
            self._jobs = queue.SimpleQueue()
            self._threads = self._idle = 0
        for _ in range(threads):
            jobs.put(None)

    def _work(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the waiting caller
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                if jobs is self._jobs:
                    self._idle += 1
