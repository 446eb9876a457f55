"""The stats of one run of a command: each cache in it reports its counters to a file at exit.

``tiered-progcache stats --run -- CMD`` sets :data:`STATS_FILE_ENV` to a fresh file for
CMD. Every :class:`~tiered_progcache.TieredProgramCache` built in a process that sees the
variable calls :func:`register` once; at interpreter exit each registered cache appends
one JSON line with its counters to the file. The command then sums the lines of every
process CMD started (its children and their children inherit the variable).

Nothing here runs on a lookup: registration happens in ``__init__`` and the report at
exit. A process without the variable never imports this module.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..settings import STATS_FILE_ENV  # the file caches append their exit report to; unset: none
from ..chain.stats import (COUNTER_FIELDS, FLIGHT_DECISIONS, CacheStats, CompileTally, CompileTotals, FlightCounts,
                           TierCounters, TierStats)

if TYPE_CHECKING:
    from ..chain.tiered import TieredProgramCache

__all__ = ["STATS_FILE_ENV", "compile_totals", "flight_totals", "pids", "read_reports", "register", "register_counters",
           "sum_reports"]

logger = logging.getLogger(__name__)


# One record per registered cache: (pid at registration, [(tier name, counters)], its compile tally).
# It holds the counters, not the cache, so a cache dropped early frees its memory tier.
_Record = tuple[int, list[tuple[str, Any]], CompileTally, FlightCounts | None]
_records: list[_Record] = []
_lock = threading.Lock()
_hooked = False


def register(cache: TieredProgramCache) -> None:
    """Report ``cache``'s counters to ``$TIERED_PROGCACHE_STATS_FILE`` at exit (no-op when unset)."""
    global _hooked
    if not os.environ.get(STATS_FILE_ENV):
        return
    if any(t.entries is not None and t.entries.namespace == "triton" for t in cache.tiers):
        return  # Triton's chain: its manager reports it as the ``triton-remote`` tier (register_counters)
    record = (os.getpid(), [(t.name, t.counters) for t in cache.tiers], cache.compile_tally, cache.flight_counts)
    with _lock:
        _records.append(record)
        if not _hooked:
            # atexit handlers run after threading's exit hooks, where writeback's exit
            # flush runs (its bound, 10 s, covers every queue): by now the uploads it
            # could finish are counted. Flushing again here would double the bound.
            atexit.register(_report_at_exit)
            _hooked = True


def register_counters(tiers: list[tuple[str, Any]], tally: CompileTally) -> None:
    """Report counters that belong to no chain (Triton's manager's) at exit, as :func:`register` does a cache's.

    Each of ``tiers`` is a name and an object whose ``snapshot()`` is a :class:`TierStats`.
    """
    global _hooked
    if not os.environ.get(STATS_FILE_ENV):
        return
    with _lock:
        _records.append((os.getpid(), tiers, tally, None))
        if not _hooked:
            atexit.register(_report_at_exit)
            _hooked = True


def _report_at_exit() -> None:
    path = os.environ.get(STATS_FILE_ENV)
    with _lock:
        # A forked child inherits the parent's records; only the registering process reports them.
        records = [(tiers, tally, flight) for pid, tiers, tally, flight in _records if pid == os.getpid()]
        _records.clear()
    if not path or not records:
        return
    lines = []
    for tiers, tally, flight in records:
        snapshot = CacheStats(tuple((name, counters.snapshot()) for name, counters in tiers))
        done = tally.snapshot()
        report = {"pid": os.getpid(), "tiers": snapshot.as_dict(), "compiles": done.compiles,
                  "compile_seconds": round(done.compile_seconds, 6), "saved_seconds": round(done.saved_seconds, 6),
                  "uncacheable": dict(done.uncacheable),
                  "flight": flight.snapshot() if flight is not None else dict.fromkeys(FLIGHT_DECISIONS, 0)}  # fmt: skip
        lines.append(json.dumps(report, separators=(",", ":")) + "\n")
    _append(path, "".join(lines).encode())


def _append(path: str, data: bytes) -> None:
    """One ``write`` on an ``O_APPEND`` descriptor, so lines of concurrent processes never interleave."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("could not write cache stats to %s: %s", path, exc)


def read_reports(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The reports in ``path``, one per cache; lines that do not parse are skipped."""
    reports = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    report = json.loads(line)
                except ValueError:
                    continue
                if isinstance(report, dict) and isinstance(report.get("tiers"), dict):
                    reports.append(report)
    except FileNotFoundError:
        pass
    return reports


def sum_reports(reports: Iterable[Mapping[str, Any]]) -> CacheStats:
    """Counters summed per tier name over every report, tiers in first-seen order.

    Gauges (entries held, latency percentiles) do not add up across processes, so
    the result leaves them ``None``; its ``compiling`` is :func:`compile_totals` of the reports.
    """
    reports = list(reports)
    totals: dict[str, dict[str, int]] = {}
    for report in reports:
        for name, fields in report["tiers"].items():
            tier = totals.setdefault(name, dict.fromkeys(COUNTER_FIELDS, 0))
            for field in COUNTER_FIELDS:
                value = fields.get(field)
                if isinstance(value, int):
                    tier[field] += value
    return CacheStats(tuple((name, TierStats(**counts)) for name, counts in totals.items()), compile_totals(reports),
                      flight_totals(reports))


def flight_totals(reports: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The flight decisions of every report, each of ``FLIGHT_DECISIONS`` (reports from before them count 0)."""
    totals = dict.fromkeys(FLIGHT_DECISIONS, 0)
    for report in reports:
        counts = report.get("flight")
        for decision in totals:
            n = counts.get(decision) if isinstance(counts, dict) else None
            if isinstance(n, int) and not isinstance(n, bool):
                totals[decision] += n
    return totals


def compile_totals(reports: Iterable[Mapping[str, Any]]) -> CompileTotals:
    """The compiler runs and seconds of every report (reports from before these fields count 0)."""

    def summed(field: str, kinds: tuple[type, ...]) -> Any:
        return sum(r[field] for r in reports if isinstance(r.get(field), kinds) and not isinstance(r.get(field), bool))

    reports = list(reports)
    uncacheable: dict[str, int] = {}
    for report in reports:
        given = report.get("uncacheable")
        for reason, n in given.items() if isinstance(given, dict) else ():
            if isinstance(n, int) and not isinstance(n, bool):
                uncacheable[reason] = uncacheable.get(reason, 0) + n
    return CompileTotals(summed("compiles", (int,)), float(summed("compile_seconds", (int, float))),
                         float(summed("saved_seconds", (int, float))), tuple(sorted(uncacheable.items())))  # fmt: skip


def pids(reports: Iterable[Mapping[str, Any]]) -> Iterator[int]:
    """Distinct process ids that reported, in order."""
    seen: set[int] = set()
    for report in reports:
        pid = report.get("pid")
        if isinstance(pid, int) and pid not in seen:
            seen.add(pid)
            yield pid
