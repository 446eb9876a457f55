"""The one exit report: every cache's counters, one JSON line, to the sinks it was registered with.

A source (a :class:`~tiered_progcache.TieredProgramCache`, Triton's manager, CuPy's backend)
registers once; at interpreter exit, and where its owner asks, it reports what it counted since
its last report (a chain's ``close()`` is its last), so nothing is counted twice. There are two sinks:
the local directory's ``stats.jsonl`` (summed by ``tiered-progcache stats``, like ``ccache -s``;
an empty report is skipped) and the file ``$TIERED_PROGCACHE_STATS_FILE`` names (set by
``stats --run -- CMD``; every source's first report is written even when empty, so the run
counts each process that had a cache). One line format for both, one ``atexit`` hook for the
process, one ``write`` per line on an ``O_APPEND`` descriptor (concurrent processes never mix
lines). Nothing runs on a lookup: the counters are the tiers' own.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..settings import STATS_FILE_ENV
from .stats import COUNTER_FIELDS, CompileTally, CompileTotals, FlightCounts

if TYPE_CHECKING:
    from .tiered import TieredProgramCache

__all__ = ["LEDGER_FILE", "Counts", "Source", "append_line", "register", "register_cache", "register_counters",
           "stats_file", "tier_counts"]

logger = logging.getLogger(__name__)

#: The file in the local directory's root that holds the reports (never listed as an entry).
LEDGER_FILE = "stats.jsonl"


class Counts(NamedTuple):
    """What a source has counted so far: ``{tier: {counter: n}}`` (:data:`COUNTER_FIELDS`), compiles, flights."""

    tiers: dict[str, dict[str, int]]
    compiling: CompileTotals
    flight: dict[str, int]


def tier_counts(tiers: list[tuple[str, Any]], tally: CompileTally, flight: FlightCounts | None = None) -> Counts:
    """``Counts`` of tiers' counters (each with a ``snapshot()`` that is a ``TierStats``), a tally and flights."""
    compiling = tally.snapshot()  # first: it may read hits' manifests, which the tiers count
    now = {}
    for name, counters in tiers:
        snap = counters.snapshot()
        now[name] = {field: getattr(snap, field) for field in COUNTER_FIELDS}
    return Counts(now, compiling, flight.snapshot() if flight is not None else {})


class Source:
    """One registered source: how to read its counts, its sinks, and what it reported last."""

    def __init__(self, read: Callable[[], Counts], *, local_root: str | os.PathLike[str] | None,
                 stats_path: str | None, baseline: Counts | None = None) -> None:
        self._read = read
        self.local_path = Path(local_root) / LEDGER_FILE if local_root is not None else None
        self.stats_path = stats_path
        self.pid = os.getpid()
        self._lock = threading.Lock()
        # From zero by default, not from the counters now: a remote's failed probe at construction counts.
        self._sent = baseline if baseline is not None else Counts({}, CompileTotals(), {})
        self._stats_file_told = False
        self.active = True

    def report(self) -> None:
        """Append what was counted since the last report to each sink (never raises for a sink it cannot write)."""
        with self._lock:
            if self.pid != os.getpid() or not self.active:  # a forked child inherited it: the parent reports its own
                return
            now = self._read()
            sent, self._sent = self._sent, now
            first_to_stats_file = self.stats_path is not None and not self._stats_file_told
            self._stats_file_told = True
        line = _line(self.pid, now, sent)
        moved = _moved(line)
        if not moved and not first_to_stats_file:
            return
        text = json.dumps(line, separators=(",", ":")) + "\n"
        if moved and self.local_path is not None:
            append_line(self.local_path, text)
        if self.stats_path is not None:
            append_line(self.stats_path, text, quiet=False)

    def close(self) -> None:
        """Report a last time, then never again (its counters are about to mean something else)."""
        self.report()
        with self._lock:
            self.active = False


def _line(pid: int, now: Counts, sent: Counts) -> dict[str, Any]:
    """The report of ``now - sent``: per tier, summed over tiers, compiles and flight decisions."""
    tiers = {name: {f: n - sent.tiers.get(name, {}).get(f, 0) for f, n in counts.items()}
             for name, counts in now.tiers.items()}  # fmt: skip
    done = now.compiling - sent.compiling
    deltas = list(tiers.values())
    first, last = (deltas[0], deltas[-1]) if deltas else ({}, {})
    return {
        "pid": pid,
        "time": round(time.time(), 3),
        "lookups": first.get("hits", 0) + first.get("misses", 0),
        "hits": {name: d["hits"] for name, d in tiers.items()},
        "misses": last.get("misses", 0),
        "errors": sum(d["errors"] for d in deltas),
        "timeouts": sum(d["timeouts"] for d in deltas),
        "compiles": done.compiles,
        "compile_seconds": round(done.compile_seconds, 6),
        "saved_seconds": round(done.saved_seconds, 6),
        "hits_without_compile_time": done.hits_without_compile_time,
        "uncacheable": dict(done.uncacheable),
        "tiers": tiers,
        "flight": {k: n - sent.flight.get(k, 0) for k, n in now.flight.items() if n != sent.flight.get(k, 0)},
    }


def _moved(line: Mapping[str, Any]) -> bool:
    """Whether a report counts anything (an empty one is skipped in the directory's file)."""
    return bool(any(any(d.values()) for d in line["tiers"].values()) or line["compiles"] or line["uncacheable"]
                or line["flight"] or line["compile_seconds"] or line["saved_seconds"])


_sources: list[Source] = []  # the sources of caches already gone still report at exit
_lock = threading.Lock()
_hooked = False


def stats_file() -> str | None:
    """The ``stats --run`` file this process reports to, or None (``$TIERED_PROGCACHE_STATS_FILE`` unset)."""
    return os.environ.get(STATS_FILE_ENV) or None


def register(read: Callable[[], Counts], *, local_root: str | os.PathLike[str] | None, stats_path: str | None,
             baseline: Counts | None = None) -> Source | None:
    """Report ``read()``'s counts at exit to ``<local_root>/stats.jsonl`` and/or ``stats_path``; None without a sink."""
    global _hooked
    if local_root is None and stats_path is None:
        return None
    source = Source(read, local_root=local_root, stats_path=stats_path, baseline=baseline)
    with _lock:
        _sources.append(source)
        if not _hooked:
            # atexit handlers run after threading's exit hooks, where writeback's exit
            # flush runs (its bound, exitbudget's, covers every queue): by now the uploads it
            # could finish are counted. Flushing again here would double the bound.
            atexit.register(_report_all)
            _hooked = True
    return source


def register_cache(cache: TieredProgramCache) -> Source | None:
    """Register a chain: its local directory (if any) and the ``stats --run`` file (if set) are its sinks."""
    local = cache.local_store
    path = stats_file()
    if path is not None and any(t.entries is not None and t.entries.namespace == "triton" for t in cache.tiers):
        path = None  # Triton's chain: its manager reports it as the ``triton-remote`` tier (register_counters)
    tiers = [(t.name, t.counters) for t in cache.tiers]
    tally, flight = cache.compile_tally, cache.flight_counts
    return register(lambda: tier_counts(tiers, tally, flight), local_root=local.root if local is not None else None,
                    stats_path=path)


def register_counters(local_root: str | os.PathLike[str] | None, tiers: list[tuple[str, Any]],
                      tally: CompileTally) -> Source | None:
    """Report counters that belong to no chain (Triton's manager's) at exit, to the directory and the run's file.

    Each of ``tiers`` is a name and an object whose ``snapshot()`` is a :class:`~.stats.TierStats`.
    """
    return register(lambda: tier_counts(tiers, tally), local_root=local_root, stats_path=stats_file())


def _report_all() -> None:
    with _lock:
        sources = list(_sources)
    for source in sources:
        try:
            source.report()
        except Exception as exc:  # never fail an interpreter's exit
            logger.debug("could not report cache stats to %s: %r", source.local_path or source.stats_path, exc)


def append_line(path: str | os.PathLike[str], text: str, *, quiet: bool = True) -> bool:
    """One ``write`` of ``text`` on an ``O_APPEND`` descriptor (lines of concurrent processes never interleave).

    Never creates a directory. False where it cannot (a read-only or gone directory), logged at DEBUG
    (``quiet``: the directory's counters) or WARNING (the ``stats --run`` file someone asked for).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        logger.log(logging.DEBUG if quiet else logging.WARNING, "could not write cache stats to %s: %s", path, exc)
        return False
    return True

