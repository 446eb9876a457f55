"""One deadline for everything a process does at interpreter exit.

Exit work (the write-back flush of every queue, the release of a cluster lease whose
upload is in) shares one budget, the ``exit_timeout`` setting (10 s by default),
counted from the moment exit begins: the write-back's exit hook, the first of ours to
run, starts the clock, and the work stops :data:`TEARDOWN_RESERVE_S` before the budget
ends, leaving the interpreter's own teardown that much. So a hung remote costs exit that
budget once, not once per kind of work (a flush that used 10 s and a lease release that
took 5 s more were 15 s).
Node locks need no exit work: they are ``flock`` locks, which the kernel drops with the
process.

Process-wide: every :class:`~tiered_progcache.TieredProgramCache` hands its
``exit_timeout`` to :meth:`ExitBudget.allow` of :data:`PROCESS`; the process's budget
is the smallest value given (the default where none was). Thread-safe. A forked child
starts with no exit begun.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .. import forks
from ..settings import DEFAULT_EXIT_TIMEOUT_S

__all__ = ["POLL_S", "PROCESS", "TEARDOWN_RESERVE_S", "ExitBudget"]

#: How often :meth:`ExitBudget.join` looks whether exit has begun while the process runs.
POLL_S = 0.1
#: Seconds of the budget left to the interpreter's teardown after our exit work (at most half the budget).
TEARDOWN_RESERVE_S = 0.5


class ExitBudget:
    """The seconds exit work may take in all, and the deadline once exit has begun.

    >>> budget = ExitBudget(); budget.allow(5.0)
    >>> budget.begin(); worker.join(budget.remaining())

    ``clock`` is monotonic seconds (a test passes its own). Thread-safe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._budget_s: float | None = None  # None: no cache asked, the default holds
        self._deadline: float | None = None

    @property
    def budget_s(self) -> float:
        """The seconds exit may take: the smallest value :meth:`allow` was given, else the default."""
        with self._lock:
            return DEFAULT_EXIT_TIMEOUT_S if self._budget_s is None else self._budget_s

    def allow(self, seconds: float) -> None:
        """Let exit take at most ``seconds`` (the smallest value of every call wins; a bound never grows)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ValueError(f"exit_timeout must be a positive, finite number of seconds, got {seconds!r}")
        with self._lock:
            self._budget_s = float(seconds) if self._budget_s is None else min(self._budget_s, float(seconds))

    @property
    def began(self) -> bool:
        """True once :meth:`begin` ran: exit work is under way and bounded by the deadline."""
        with self._lock:
            return self._deadline is not None

    def begin(self) -> float:
        """Start the exit clock (the first call does; later ones leave it) and return the work's deadline.

        The deadline is the budget less the teardown reserve (:data:`TEARDOWN_RESERVE_S`,
        at most half the budget) after the first call.
        """
        with self._lock:
            if self._deadline is None:
                budget = DEFAULT_EXIT_TIMEOUT_S if self._budget_s is None else self._budget_s
                self._deadline = self._clock() + budget - min(TEARDOWN_RESERVE_S, budget / 2)
            return self._deadline

    def remaining(self) -> float:
        """Seconds of the budget left (0 once spent); starts the clock if exit had not begun."""
        return max(0.0, self.begin() - self._clock())

    def join(self, thread: threading.Thread) -> bool:
        """Wait for ``thread``: without limit while the process runs, once exit begins within what is left.

        For exit work on a thread of its own (a lease release whose requests may hang on a
        dead remote): the process never waits on it past the deadline. True if it ended.
        """
        while thread.is_alive():
            if not self.began and threading.main_thread().is_alive():
                thread.join(POLL_S)
                continue
            thread.join(self.remaining())
            break
        return not thread.is_alive()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._deadline = None


#: The process's exit budget: the write-back's exit flush and the lease release share it.
PROCESS = ExitBudget()

forks.register(PROCESS._after_fork_in_child)
