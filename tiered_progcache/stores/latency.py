"""What one request to a shared store costs, as observed: the median of the most recent round trips.

The request runner (:mod:`.runner`) records every single request it runs under the
per-request deadline (a read, a write, a lease operation; not a listing or a bulk batch,
whose durations are not one round trip). :mod:`.flightpolicy` reads the median to decide
whether a cluster lease can pay off and how often a waiter looks for the entry.
"""

from __future__ import annotations

import collections
import statistics
import threading

__all__ = ["LATENCY_WINDOW", "LatencyTracker"]

#: Round trips kept: enough for a stable median, few enough to follow a change within seconds.
LATENCY_WINDOW = 64


class LatencyTracker:
    """The last ``window`` request durations (seconds) and their median.

    >>> tracker = LatencyTracker()
    >>> tracker.record(0.031); tracker.record(0.029); tracker.median()
    0.03

    Thread-safe (one lock around a bounded deque). Per process: a forked child keeps the
    parent's samples, which still describe the same network.
    """

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self._lock = threading.Lock()
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._recorded = 0

    def record(self, seconds: float) -> None:
        """Add one request's duration; negative or non-finite values are ignored."""
        if not 0.0 <= seconds < float("inf"):
            return
        with self._lock:
            self._samples.append(seconds)
            self._recorded += 1

    @property
    def recorded(self) -> int:
        """Requests recorded since this tracker was made (not capped by the window)."""
        with self._lock:
            return self._recorded

    def median(self) -> float | None:
        """The median of the kept durations in seconds; None before the first request."""
        with self._lock:
            samples = list(self._samples)
        return statistics.median(samples) if samples else None
