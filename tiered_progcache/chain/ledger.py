"""The cumulative counters of one local directory (what ``tiered-progcache stats`` shows, like ``ccache -s``).

Every :class:`~tiered_progcache.TieredProgramCache` with a local directory registers
here; at interpreter exit (and at ``close()``) it appends what it did since its last
report, one JSON line, to ``<local dir>/stats.jsonl``: lookups, hits per tier, misses,
errors and timeouts (every tier's, and each tier's own), the uncacheable compiles by
reason, and the compiler runs and seconds :func:`tiered_progcache.compiling.compile` spent and
saved. Nothing runs on a lookup: the counters are the tiers' own. Each report is one
``write`` on an ``O_APPEND`` descriptor, so concurrent processes never lose or mix
lines. ``stats`` sums the lines; ``stats --zero`` replaces the file (stage and rename)
with one holding only the time it was zeroed.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..stores import fsutil
from .stats import FLIGHT_DECISIONS, CacheStats, CompileTally, CompileTotals, FlightCounts, TierCounters, TierStats

if TYPE_CHECKING:
    from .tiered import TieredProgramCache

__all__ = ["LEDGER_FILE", "Totals", "append_line", "read_totals", "register", "register_counters", "report", "zero"]

logger = logging.getLogger(__name__)

#: The file in the local directory's root that holds the reports (never listed as an entry).
LEDGER_FILE = "stats.jsonl"
#: The per-tier counters each report carries (its ``tiers``), as :class:`TierStats` names them.
_TIER_FIELDS = ("hits", "misses", "errors", "timeouts")
#: Reports larger than this are not read back (a file that is not ours).
_MAX_LINE = 1 << 16


@dataclasses.dataclass(frozen=True)
class Totals:
    """The sums of a directory's reports since ``zeroed_at`` (seconds since the epoch; None: never zeroed)."""

    lookups: int = 0
    hits: tuple[tuple[str, int], ...] = ()
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    saved_seconds: float = 0.0
    reports: int = 0
    zeroed_at: float | None = None
    #: (reason, compiles) that could not be cached (``CacheStats.uncacheable``, summed).
    uncacheable: tuple[tuple[str, int], ...] = ()
    #: (tier, {"hits", "misses", "errors", "timeouts"}) per tier, in first-seen order (reports that carry them).
    tiers: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    flight: tuple[tuple[str, int], ...] = ()  # flight decisions across nodes (docs/cluster.md), decision -> count

    def cache_stats(self) -> CacheStats:
        """The totals as a :class:`CacheStats` (counters only): what ``stats --prometheus`` exports."""
        tiers = tuple((name, TierStats(**dict(counts))) for name, counts in self.tiers)
        compiling = CompileTotals(self.compiles, self.compile_seconds, self.saved_seconds, self.uncacheable)
        return CacheStats(tiers, compiling, {**dict.fromkeys(FLIGHT_DECISIONS, 0), **dict(self.flight)})

    @property
    def hit_count(self) -> int:
        return sum(n for _, n in self.hits)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["hits"] = dict(self.hits)
        out["uncacheable"] = dict(self.uncacheable)
        out["tiers"] = {name: dict(counts) for name, counts in self.tiers}
        out["flight"] = dict(self.flight)
        return out


class _Book:
    """One cache's counters and what it reported last (so each report adds only what is new)."""

    def __init__(self, path: Path, tiers: list[tuple[str, Any]], tally: CompileTally,
                 flight: FlightCounts | None = None) -> None:
        self.path = path
        self.tiers = tiers
        self.tally = tally
        self.flight = flight
        self.pid = os.getpid()
        self._lock = threading.Lock()
        # From zero, not from the counters now: a remote's failed probe at construction is counted before this.
        self._sent: tuple[dict[str, tuple[int, int, int, int]], CompileTotals] = (
            {name: (0, 0, 0, 0) for name, _ in tiers}, CompileTotals())
        self._sent_flight: dict[str, int] = {}

    def _now(self) -> tuple[dict[str, tuple[int, int, int, int]], CompileTotals]:
        return {name: (c.hits, c.misses, c.errors, c.timeouts) for name, c in self.tiers}, self.tally.snapshot()

    def report(self) -> None:
        with self._lock:
            if self.pid != os.getpid():  # a forked child inherited it: the parent reports its own
                return
            tiers, totals = self._now()
            sent_tiers, sent_totals = self._sent
            self._sent = (tiers, totals)
            flight = self.flight.snapshot() if self.flight is not None else {}
            flown = {k: n - self._sent_flight.get(k, 0) for k, n in flight.items() if n != self._sent_flight.get(k, 0)}
            self._sent_flight = flight
        delta = {name: tuple(a - b for a, b in zip(now, sent_tiers[name])) for name, now in tiers.items()}
        done = totals - sent_totals
        if not tiers:
            return
        first = next(iter(delta.values()))
        lookups = first[0] + first[1]
        errors = sum(d[2] for d in delta.values())
        timeouts = sum(d[3] for d in delta.values())
        if not lookups and not done.compiles and not errors and not timeouts:
            return
        line = {
            "pid": self.pid,
            "time": round(time.time(), 3),
            "lookups": lookups,
            "hits": {name: d[0] for name, d in delta.items()},
            "misses": list(delta.values())[-1][1],
            "errors": errors,
            "timeouts": timeouts,
            "compiles": done.compiles,
            "compile_seconds": round(done.compile_seconds, 6),
            "saved_seconds": round(done.saved_seconds, 6),
            "uncacheable": dict(done.uncacheable),
            "tiers": {name: dict(zip(_TIER_FIELDS, d)) for name, d in delta.items()},
        }
        if flown:
            line["flight"] = flown
        append_line(self.path, json.dumps(line, separators=(",", ":")) + "\n")


_books: weakref.WeakKeyDictionary[Any, _Book] = weakref.WeakKeyDictionary()
_all: list[_Book] = []  # the books of caches already gone still report at exit
_lock = threading.Lock()
_hooked = False


def register(cache: TieredProgramCache, local_root: str | os.PathLike[str]) -> None:
    """Report ``cache``'s counters to ``<local_root>/stats.jsonl`` at exit and at ``close()``."""
    global _hooked
    book = _Book(Path(local_root) / LEDGER_FILE, [(t.name, t.counters) for t in cache.tiers], cache.compile_tally,
                 cache.flight_counts)
    with _lock:
        _books[cache] = book
        _all.append(book)
        if not _hooked:
            atexit.register(_report_all)
            _hooked = True


def register_counters(local_root: str | os.PathLike[str], tiers: list[tuple[str, Any]], tally: CompileTally) -> None:
    """Report counters that belong to no chain (Triton's manager's) to ``<local_root>/stats.jsonl`` at exit.

    Each of ``tiers`` is a name and an object with ``hits``, ``misses``, ``errors`` and ``timeouts``.
    """
    global _hooked
    book = _Book(Path(local_root) / LEDGER_FILE, tiers, tally)
    with _lock:
        _all.append(book)
        if not _hooked:
            atexit.register(_report_all)
            _hooked = True


def report(cache: TieredProgramCache) -> None:
    """Append what ``cache`` did since its last report (a no-op for a cache never registered)."""
    with _lock:
        book = _books.get(cache)
    if book is not None:
        book.report()


def _report_all() -> None:
    with _lock:
        books = list(_all)
    for book in books:
        try:
            book.report()
        except Exception as exc:  # never fail an interpreter's exit
            logger.debug("could not report cache stats to %s: %r", book.path, exc)


def append_line(path: str | os.PathLike[str], text: str) -> bool:
    """One ``write`` of ``text`` on an ``O_APPEND`` descriptor (lines of concurrent processes never interleave).

    Never creates a directory. False, with a DEBUG line, where it cannot (a read-only or gone directory).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        logger.debug("could not write cache stats to %s: %s", path, exc)
        return False
    return True


def read_totals(local_root: str | os.PathLike[str]) -> Totals:
    """The sums of every report in ``<local_root>/stats.jsonl`` (lines that do not parse are skipped)."""
    hits: dict[str, int] = {}
    tiers: dict[str, dict[str, int]] = {}
    uncacheable: dict[str, int] = {}
    flight: dict[str, int] = {}
    sums = dict.fromkeys(("lookups", "misses", "errors", "timeouts", "compiles"), 0)
    seconds = dict.fromkeys(("compile_seconds", "saved_seconds"), 0.0)
    reports, zeroed_at = 0, None
    try:
        with open(Path(local_root) / LEDGER_FILE, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if len(line) > _MAX_LINE:
                    continue
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(doc, dict):
                    continue
                if isinstance(doc.get("zeroed_at"), (int, float)):
                    zeroed_at = float(doc["zeroed_at"])
                    continue
                if not isinstance(doc.get("hits"), dict):
                    continue
                reports += 1
                for name, n in doc["hits"].items():
                    if isinstance(n, int):
                        hits[name] = hits.get(name, 0) + n
                for name, counts in doc["tiers"].items() if isinstance(doc.get("tiers"), dict) else ():
                    summed = tiers.setdefault(name, dict.fromkeys(_TIER_FIELDS, 0))
                    for field in _TIER_FIELDS:
                        n = counts.get(field) if isinstance(counts, dict) else None
                        if isinstance(n, int) and not isinstance(n, bool):
                            summed[field] += n
                given = doc.get("uncacheable")
                for reason, n in given.items() if isinstance(given, dict) else ():
                    if isinstance(n, int) and not isinstance(n, bool):
                        uncacheable[reason] = uncacheable.get(reason, 0) + n
                for decision, n in (doc["flight"].items() if isinstance(doc.get("flight"), dict) else ()):
                    if isinstance(n, int) and not isinstance(n, bool):
                        flight[str(decision)] = flight.get(str(decision), 0) + n
                for field in sums:
                    if isinstance(doc.get(field), int):
                        sums[field] += doc[field]
                for field in seconds:
                    if isinstance(doc.get(field), (int, float)):
                        seconds[field] += float(doc[field])
    except FileNotFoundError:
        pass
    return Totals(hits=tuple(hits.items()), reports=reports, zeroed_at=zeroed_at,
                  uncacheable=tuple(sorted(uncacheable.items())),
                  tiers=tuple((name, tuple(counts.items())) for name, counts in tiers.items()),
                  flight=tuple(flight.items()), **sums, **seconds)  # fmt: skip


def zero(local_root: str | os.PathLike[str], *, now: float | None = None) -> None:
    """Start the counters over: the file replaced whole by one line saying when (reports racing it may go either way)."""
    stamp = time.time() if now is None else now
    root = Path(local_root)
    fsutil.write_atomic(root / LEDGER_FILE, (json.dumps({"zeroed_at": stamp}) + "\n").encode(), staging_dir=root)
