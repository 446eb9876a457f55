"""The cumulative counters of one local directory, read back (what ``tiered-progcache stats`` shows, like ``ccache -s``).

Every cache with a local directory appends its reports to ``<local dir>/stats.jsonl`` at exit
and at ``close()`` (:mod:`tiered_progcache.chain.exitreport` writes them). This module sums
them (lines of the older format, without ``tiers``, too) and starts them over: ``stats --zero``
replaces the file (stage and rename) with one holding only the time it was zeroed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..stores import fsutil
from .exitreport import LEDGER_FILE
from .stats import FLIGHT_DECISIONS, CacheStats, CompileTotals, TierStats

__all__ = ["LEDGER_FILE", "Totals", "read_totals", "zero"]

logger = logging.getLogger(__name__)

#: The per-tier counters ``stats`` sums from each report's ``tiers`` (which carries every counter).
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
    hits_without_compile_time: int = 0  # compile() hits whose compile time no manifest near the node told
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
        compiling = CompileTotals(self.compiles, self.compile_seconds, self.saved_seconds, self.uncacheable,
                                  self.hits_without_compile_time)
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


def read_totals(local_root: str | os.PathLike[str]) -> Totals:
    """The sums of every report in ``<local_root>/stats.jsonl`` (lines that do not parse are skipped)."""
    hits: dict[str, int] = {}
    tiers: dict[str, dict[str, int]] = {}
    uncacheable: dict[str, int] = {}
    flight: dict[str, int] = {}
    sums = dict.fromkeys(("lookups", "misses", "errors", "timeouts", "compiles", "hits_without_compile_time"), 0)
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
