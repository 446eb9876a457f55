"""The boot fetch: a fresh node's first shared lookup also brings the store's newest entries in one batch.

A node whose local directory holds no entry (a new machine, a new container) would pay one
round trip per kernel. On the chain's first lookup that reaches the shared tier, with the
local directory empty, one background thread lists the store beside the store's first probe
and the triggering lookup's own request, not after them (at most :data:`MAX_LISTED`
entries), and picks the newest entries within the byte budget (manifests of listed entries
left behind, as ``warm`` does). It reads them in one concurrent batch into the local
directory through :func:`tiered_progcache.chain.transfer.warm`, verified, once a lookup of
an entry has reached the shared tier: a metadata read (direct mode's manifest, a fresh
node's first) starts the listing, and the batch's verifying and writing, most of the fetch's
CPU, waits until that kernel has its key and asks for its entry (or any later lookup reaches the
store: a flight reads its entry as metadata), so its header hashing does not share the
interpreter with them (at most the store's request deadline). The triggering
lookup goes on as before, and an entry a lookup reads ahead for itself before the pick is
left out of the batch (read once, not twice); a later lookup of a name in the batch waits
for the batch (at most the store's request deadline) and reads it locally; any other is looked up
as before. A failing fetch costs only itself: it is logged once and changes no answer.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from ..errors import one_line
from ..settings import DEFAULT_REMOTE_TIMEOUT_S
from ..stores.localdir import LocalDir
from ..stores.store import EntryStore, StoredEntry, entry_name, manifest_name

if TYPE_CHECKING:
    from .transfer import TransferReport

__all__ = ["MAX_LISTED", "BootFetch", "boot_fetch_for", "newest_within"]

logger = logging.getLogger(__name__)

#: The most listed entries one boot fetch considers (10 pages of an S3 listing; a Redis ``SCAN`` stops there).
MAX_LISTED = 10_000


class BootFetch:
    """One chain's boot fetch from ``shared`` into ``local``, started at most once. Thread-safe.

    ``max_bytes`` caps the stored sizes fetched; ``local_depth`` is the chain's index of
    the local directory's tier (where a caller reads what :meth:`landed` says is there).
    """

    def __init__(self, local: LocalDir, shared: EntryStore, max_bytes: int, local_depth: int) -> None:
        self.local_depth = local_depth
        self._local = local
        self._shared = shared
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._started = False
        self._given_up = False  # a lookup waited the deadline out: the others no longer wait
        self._pid = os.getpid()
        self._listed = threading.Event()  # the batch's names are known
        self._done = threading.Event()  # the batch landed, or the fetch failed or was not needed
        self._go = threading.Event()  # an entry's lookup reached the shared tier: the batch may land
        self._stop = threading.Event()  # the chain closes: no batch begins, one under way reads no more
        self._thread: threading.Thread | None = None
        self._batch: frozenset[str] = frozenset()
        self._asked: set[str] = set()  # entries lookups read for themselves: the trigger's, those read ahead
        #: What the fetch did: ``(listed, TransferReport)``, None until it finished (or if it failed).
        self.report: tuple[int, TransferReport | None] | None = None

    def landed(self, key: bytes, *, entry: bool = True) -> bool:
        """Called on each lookup that reaches the shared tier: True if the batch brought ``key``'s entry.

        The first call starts the fetch (when the local directory is empty) and returns
        False at once; one with ``entry`` (an entry's lookup, not metadata's) lets the batch
        land, as every later call does. Later calls for a name in the batch wait for it, at most
        the store's request deadline; once one waited that out, none waits any more (a hung
        store costs one deadline, not one per lookup). False means "look it up as before".
        """
        if entry and not self._go.is_set():
            self._go.set()
        if not self._started:
            self._start(entry_name(key))
            return False
        if self._pid != os.getpid():  # a forked child: the fetching thread is the parent's
            return False
        name = entry_name(key)
        if self._done.is_set():
            return name in self._batch
        if self._given_up:
            return False
        # A lookup that waits for the batch lets it land: its kernel has its key (a metadata read of an entry,
        # as a flight's look under the lease and a waiter's polls are, may be all that comes).
        self._go.set()
        limit = self._request_deadline()
        deadline = time.monotonic() + limit
        if not self._listed.wait(limit):
            self._given_up = True
            return False
        if name not in self._batch:
            return False
        if self._done.wait(max(0.0, deadline - time.monotonic())):
            return True
        self._given_up = True
        return False

    def entry_asked(self, key: bytes) -> None:
        """An entry's lookup reached the shared tier (or took an entry read ahead): the node's first kernel has
        its key, so the batch may land now; the first such call starts the fetch if nothing did. Never waits."""
        if not self._go.is_set():
            self._go.set()
        if not self._started:
            self._start(entry_name(key))

    def asked(self, key: bytes) -> None:
        """A lookup reads ``key``'s entry from the shared tier itself (read ahead): a batch not yet picked
        leaves it out."""
        if self._listed.is_set():  # picked already, or no fetch: nothing to keep (no lock on the hot path)
            return
        with self._lock:
            if not self._listed.is_set():  # the pick clears the names and sets it under this lock
                self._asked.add(entry_name(key))

    def close(self, timeout: float | None) -> None:
        """Stop the fetch and wait for it at most ``timeout`` seconds (the chain closes its tiers next): a batch
        not begun never begins, one under way lands what it read and reads no more."""
        self._stop.set()
        self._go.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the fetch finished (or was not needed); False if ``timeout`` ran out. For tests and benchmarks."""
        return self._done.wait(timeout)

    def _request_deadline(self) -> float:
        """The store's deadline for one request; a store that states none: the setting's default."""
        limit = self._shared.request_timeout_s
        return DEFAULT_REMOTE_TIMEOUT_S if limit is None else limit

    def _start(self, trigger: str) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            self._asked.add(trigger)
            self._pid = os.getpid()  # the process whose thread fetches (a child forked later does not wait for it)
        if not self._shared.available:  # its breaker is open: the fault is reported already, and a fetch cannot help
            self._listed.set()
            self._done.set()
            return
        try:
            empty = next(iter(self._local.iter_entries()), None) is None
        except OSError as exc:
            logger.warning("boot fetch into %s skipped: %s", self._local.location, one_line(exc))
            empty = False
        if not empty:
            self._listed.set()
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, name="tiered-progcache-boot-fetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from . import transfer

        started = time.perf_counter()
        try:
            with self._shared.beside_probe():  # a round trip sooner than after it; the client is the probe's
                listed = list(itertools.islice(self._shared.iter_entries(), MAX_LISTED))
            if listed:  # after the first kernel's key: its hashing does not share the GIL with the landing
                self._go.wait(self._request_deadline())
            with self._lock:  # a name read ahead is in this pick or kept nowhere
                self._batch = frozenset(() if self._stop.is_set() else
                                        newest_within(listed, self._max_bytes, leave_out=self._asked))
                self._asked.clear()  # needed for this pick only
                self._listed.set()
            report = (transfer.warm(self._shared, self._local, sorted(self._batch), stop=self._stop)
                      if self._batch else None)
            self.report = (len(listed), report)
            logger.info("boot fetch from %s: %d of %d listed entries in %.3f s", self._shared.location,
                        len(self._batch), len(listed), time.perf_counter() - started)  # fmt: skip
        except Exception as exc:  # a failing store, a full disk: the lookups go on as before
            self._batch = frozenset()
            if self._stop.is_set() or not threading.main_thread().is_alive():  # closed, or the interpreter exits
                logger.debug("boot fetch from %s stopped: %s", self._shared.location, one_line(exc))
                return
            # A store the probe (beside the listing) found down is reported by the probe: one warning, not two.
            self._shared.wait_ready(self._request_deadline())
            logger.log(logging.WARNING if self._shared.available else logging.INFO,
                       "boot fetch from %s failed (lookups go to the store as before): %s",
                       self._shared.location, one_line(exc))  # fmt: skip
        finally:
            self._listed.set()
            self._done.set()


def newest_within(listed: list[StoredEntry], max_bytes: int, *, leave_out: Collection[str] = ()) -> list[str]:
    """The newest listed entries (unknown times last, then by name) whose stored sizes add up to at most ``max_bytes``.

    Manifests of listed entries and ``leave_out`` (entries lookups read for themselves) are
    not taken; the first entry that does not fit ends the pick.
    """
    manifests = {manifest_name(entry.name) for entry in listed}
    ordered = sorted(listed, key=lambda e: (e.mtime is None, -(e.mtime or 0.0), e.name))
    picked: list[str] = []
    total = 0
    for entry in ordered:
        if entry.name in manifests or entry.name in leave_out:
            continue
        if total + entry.size > max_bytes:
            break
        picked.append(entry.name)
        total += entry.size
    return picked


def boot_fetch_for(local: LocalDir | None, shared: EntryStore | None, max_bytes: int, max_local_bytes: int | None,
                   local_depth: int) -> BootFetch | None:
    """The chain's boot fetch, or None where it has nothing to fetch between (no local directory or shared store)
    or the budget is 0. The budget is at most the local directory's cap, so what lands is not evicted at once."""
    if local is None or shared is None or max_bytes <= 0:
        return None
    if max_local_bytes is not None:
        max_bytes = min(max_bytes, max_local_bytes)
    return BootFetch(local, shared, max_bytes, local_depth)
