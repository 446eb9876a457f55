"""Hook lists: what ``on_compile``, ``on_hit`` and ``on_flight`` share (subscribe, unsubscribe, call each)."""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

__all__ = ["call_each", "subscribe"]

E = TypeVar("E")


def subscribe(hooks: list[Callable[[E], None]], lock: threading.Lock, hook: Callable[[E], None]) -> Callable[[], None]:
    """Add ``hook`` to ``hooks`` under ``lock``; the unsubscribe it returns removes it (idempotent)."""
    with lock:
        hooks.append(hook)

    def unsubscribe() -> None:
        with lock:
            if hook in hooks:
                hooks.remove(hook)

    return unsubscribe


def call_each(hooks: list[Callable[[E], None]], event: E, logger: logging.Logger, what: str) -> None:
    """Call every hook of a snapshot with ``event``; one that raises is logged as ``{what} hook ... failed``."""
    for hook in hooks:
        try:
            hook(event)
        except Exception:
            logger.exception("%s hook %r failed", what, hook)
