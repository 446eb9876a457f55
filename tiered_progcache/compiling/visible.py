"""Log lines the user asked for by a setting, shown on stderr when the application set up no logging.

``TIERED_PROGCACHE_EXPLAIN=1`` asks for one INFO line per miss, but an application that
never configured :mod:`logging` drops INFO: Python's ``logging.lastResort`` prints only
WARNING and above. :func:`log_requested` sends the record through the logger as usual
when a handler up the logger's hierarchy will see it at that level (the application's
handlers and format then hold, and the line appears once); when there is none, or the
application's level would drop it (``logging.basicConfig()`` keeps WARNING and up, and the
setting asked for the line), it writes the line to ``sys.stderr`` itself, as
``logging.lastResort`` would at WARNING (and as :mod:`warnings` shows its messages).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

__all__ = ["FALLBACK_FORMAT", "log_requested"]

#: How the fallback writes a line: ``tiered_progcache.compiling.compile INFO: miss 8783e52a7e10: ...``.
FALLBACK_FORMAT = "%(name)s %(levelname)s: %(message)s"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time (pytest's capture, a redirected stream), like lastResort."""

    def __init__(self) -> None:
        logging.Handler.__init__(self, logging.INFO)
        self.setFormatter(logging.Formatter(FALLBACK_FORMAT))

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr


_fallback = _StderrHandler()


def log_requested(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    """``logger.log(level, msg, *args)``; to stderr instead when no handler up ``logger``'s hierarchy would see it
    (none there, or the logger's level is above ``level``)."""
    if logger.hasHandlers() and logger.isEnabledFor(level):
        logger.log(level, msg, *args)
        return
    if logger.disabled or logging.root.manager.disable >= level:
        return
    _fallback.handle(logger.makeRecord(logger.name, level, "(unknown file)", 0, msg, args, None))
