"""The one fork registry: what each module resets in a forked child, run by one ``os.register_at_fork``.

A child of ``os.fork`` has only the forking thread. A lock another thread held at the
fork stays held forever, a thread pool's workers are gone, an event loop and its
sockets belong to the parent. Each module that keeps such state registers one reset
here (:func:`register`), at import; the child runs them all, in the order they were
registered, before anything else of ours runs there. One reset that fails is logged
and the rest still run. Where the platform cannot fork (no ``os.register_at_fork``),
registering is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

__all__ = ["register", "registered"]

logger = logging.getLogger(__name__)

_resets: list[Callable[[], None]] = []
_resets_lock = threading.Lock()


def register(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset()`` in every child forked from now on; returns ``reset`` (usable as a decorator).

    >>> forks.register(_new_lock_after_fork)
    """
    if not callable(reset):
        raise TypeError(f"a fork reset must be callable, got {type(reset).__name__}")
    with _resets_lock:
        _resets.append(reset)
    return reset


def registered() -> tuple[Callable[[], None], ...]:
    """The resets a forked child runs, in order."""
    with _resets_lock:
        return tuple(_resets)


def _run_resets_in_child() -> None:
    global _resets_lock
    _resets_lock = threading.Lock()  # the parent may have held it at the fork
    for reset in list(_resets):
        try:
            reset()
        except Exception:
            logger.exception("fork reset %s failed in the child", getattr(reset, "__qualname__", reset))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_run_resets_in_child)
