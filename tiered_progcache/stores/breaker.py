"""The remote tier's circuit breaker: after repeated failures, stop asking a dead remote for a while.

A dead or hanging remote must cost a bounded amount of time, once (sccache #2820: a
stalled remote stalled every build). After ``failure_threshold`` consecutive failures
the breaker *opens*: operations are refused at once
(:class:`~tiered_progcache.errors.TierUnavailable`) for ``cooldown_s`` seconds. After
the cooldown one operation is let through as a probe; its success closes the breaker,
its failure opens it for another cooldown. The deadline on each request and the
bookkeeping around it live in :mod:`tiered_progcache.stores.runner`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable

from .. import forks
from ..errors import TierUnavailable, one_line

__all__ = [
    "DEFAULT_COOLDOWN_S",
    "DEFAULT_FAILURE_THRESHOLD",
    "CircuitBreaker",
]

logger = logging.getLogger(__name__)

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
        #: What opened the breaker at construction (:meth:`trip`), for the chain to count; None if nothing did.
        self.tripped_by: BaseException | None = None
        _BREAKERS.add(self)

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

    @property
    def last_error(self) -> str:
        """The last failure, one line (``"TimeoutError: ..."``; ``""`` before any)."""
        return self._last_error

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
            self._last_error = one_line(exc)
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
            self.tripped_by = exc
            self._failures = max(self._failures, self.failure_threshold)
            self._last_error = one_line(exc)
            self._probing = False
            self._open_until = self._clock() + self.cooldown_s


_BREAKERS: weakref.WeakSet[CircuitBreaker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A lock held by a parent thread at the fork stays held in the child: give each breaker a new one."""
    for breaker in list(_BREAKERS):
        breaker._lock = threading.Lock()


forks.register(_after_fork_in_child)
