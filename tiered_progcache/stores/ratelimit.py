"""Warnings that cannot flood a log: a dead remote fails every lookup, so say it once a minute (or once)."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedLogger", "log_once"]

_logged_once: set[tuple[str, str]] = set()
_logged_once_lock = threading.Lock()


def log_once(logger: logging.Logger, tag: str, level: int, msg: str, *args: object) -> None:
    """Log ``msg`` the first time ``tag`` is seen by ``logger`` in this process; thread-safe."""
    with _logged_once_lock:
        if (logger.name, tag) in _logged_once:
            return
        _logged_once.add((logger.name, tag))
    logger.log(level, msg, *args)


class RateLimitedLogger:
    """Logs one record per ``topic`` per ``interval_s``; the rest are counted and summarised."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(topic)
            if last is not None and now - last < self._interval_s:
                self._suppressed[topic] = self._suppressed.get(topic, 0) + 1
                return
            self._last[topic] = now
            suppressed = self._suppressed.pop(topic, 0)
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, msg, *args)

    def warning(self, topic: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, topic, msg, *args)
