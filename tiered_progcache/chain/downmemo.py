"""A shared tier's failed probe, remembered in the local directory so the next process skips the probe.

Without it every new process pays the probe of a dead bucket (a refused port's retries, a hanging
one's whole deadline: 4 to 6 s), so a fleet of short jobs pays that per start. When the probe at
construction fails, the chain writes ``<local dir>/remote-down/<digest of the URL>`` holding the
failure's masked message and the wall-clock time it stands until, :data:`DOWN_MEMO_S` later. A
process built within that time (not ``strict``) starts with the tier's breaker open instead of
probing: one warning, no network, and the tier is probed again one breaker cooldown later, as in the
process that saw the failure. A successful probe removes the file. A file that is unreadable or
claims more than :data:`DOWN_MEMO_S` is ignored, so no file can keep a remote off for longer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["DOWN_MEMO_DIR", "DOWN_MEMO_S", "DownMemo", "RemoteDown"]

logger = logging.getLogger(__name__)

#: How long a failed probe stands for the processes after it: one breaker cooldown.
DOWN_MEMO_S = 30.0
#: The directory under the local cache directory that holds the memos.
DOWN_MEMO_DIR = "remote-down"


class RemoteDown(OSError):
    """A shared tier another process on this node found down moments ago (what its breaker starts open with)."""


class DownMemo:
    """The failed probes remembered under one local directory, by URL (never stored: only its digest).

    >>> memo = DownMemo(local_root); memo.recall(url)   # None, or (message, seconds it still stands)
    """

    def __init__(self, local_root: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(local_root) / DOWN_MEMO_DIR
        self._clock = clock

    def path(self, url: str) -> Path:
        return self.directory / hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def recall(self, url: str) -> tuple[str, float] | None:
        """``(message, seconds left)`` while a failed probe of ``url`` stands, else None."""
        try:
            doc = json.loads(self.path(url).read_bytes())
            until, message = doc["until"], doc["message"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None
        if isinstance(until, bool) or not isinstance(until, (int, float)) or not isinstance(message, str):
            return None
        left = until - self._clock()
        if not (math.isfinite(left) and 0 < left <= DOWN_MEMO_S):
            return None  # over, or a file claiming more than a memo may
        return message[:1000], left

    def remember(self, url: str, message: str) -> None:
        """Record a failed probe of ``url`` (``message`` already masked) for :data:`DOWN_MEMO_S`; best effort."""
        body = json.dumps({"until": self._clock() + DOWN_MEMO_S, "message": message[:1000]}).encode()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, staged = tempfile.mkstemp(prefix=".tmp.", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(body)
                os.replace(staged, self.path(url))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(staged)
                raise
        except OSError as exc:  # a read-only local directory: the next process probes, as before
            logger.debug("could not remember the failed probe in %s: %s", self.directory, exc)

    def forget(self, url: str) -> None:
        """Drop ``url``'s memo (its probe succeeded); best effort."""
        with contextlib.suppress(OSError):
            self.path(url).unlink()
