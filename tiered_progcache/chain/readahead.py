"""Reads started before the lookup that wants them: a direct hit's entry is read beside its header check.

A fresh node's direct-mode hit reads the direct manifest, checks the header set it names by
hashing the headers, then looks the entry up: two round trips with the hashing between them.
The set names the entry it gives, so that entry's read can start as soon as the manifest is
read. :class:`ReadAhead` makes the shared tier's read on a thread, unless a tier in front of
it holds the entry; the chain's next lookup of that key at the shared tier takes the answer
instead of asking again, and only then is it counted, as that lookup (one per ``compile()``).
A read no lookup takes (the set did not hold on this node) is dropped uncounted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence

import cachetools

from .tier import Fetched, Tier

__all__ = ["MAX_PENDING", "ReadAhead"]

logger = logging.getLogger(__name__)

#: Reads kept for a lookup at once; the oldest untaken one is dropped past this.
MAX_PENDING = 64


class ReadAhead:
    """Reads of ``shared`` started ahead of their lookups, skipped where a tier of ``nearby`` holds the key.

    Thread-safe. Each read runs on a daemon thread and ends within the shared store's request deadline.
    """

    def __init__(self, shared: Tier, nearby: Sequence[Tier]) -> None:
        self._shared = shared
        self._nearby = tuple(nearby)
        self._lock = threading.Lock()
        self._pending: cachetools.LRUCache[bytes, concurrent.futures.Future[Fetched | None]] = cachetools.LRUCache(
            MAX_PENDING)

    def start(self, key: bytes) -> None:
        """Begin reading ``key`` from the shared tier (once: a read already pending for it stands)."""
        future: concurrent.futures.Future[Fetched | None] = concurrent.futures.Future()
        with self._lock:
            if key in self._pending:
                return
            self._pending[key] = future
        threading.Thread(target=self._read, args=(key, future), name=f"tiered-progcache-ahead-{key[:4].hex()}",
                         daemon=True).start()

    def take(self, key: bytes) -> Fetched | None:
        """The read started for ``key``, waited for (None: none was started, or a nearer tier held it); taken once."""
        with self._lock:
            future = self._pending.pop(key, None)
        return None if future is None else future.result()

    def _read(self, key: bytes, future: concurrent.futures.Future[Fetched | None]) -> None:
        try:
            held = any(tier.lookup_metadata(key) is not None for tier in self._nearby)
            future.set_result(None if held else self._shared.fetch(key))
        except BaseException as exc:  # a bug here costs the read ahead, never the lookup: it reads again
            try:
                logger.debug("read ahead of %s failed: %r", key[:8].hex(), exc)
            finally:  # whatever the log line does, the lookup is not left waiting
                future.set_result(None)
