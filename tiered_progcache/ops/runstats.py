"""The stats of one run of a command, read back: the reports its processes' caches left in one file.

``tiered-progcache stats --run -- CMD`` sets :data:`STATS_FILE_ENV` to a fresh file for CMD;
every cache in a process that sees the variable (its children and theirs inherit it) reports
its counters there once, at ``close()`` or else at exit (:mod:`tiered_progcache.chain.exitreport`, the
same lines a local directory's ``stats.jsonl`` holds). This module reads and sums them.
It imports only down (the chain's counters, the settings): nothing in the chain imports it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..settings import STATS_FILE_ENV  # the file caches append their exit report to; unset: none
from ..chain.stats import COUNTER_FIELDS, FLIGHT_DECISIONS, CacheStats, CompileTotals, TierStats

__all__ = ["STATS_FILE_ENV", "compile_totals", "flight_totals", "pids", "read_reports", "sum_reports"]

logger = logging.getLogger(__name__)


def read_reports(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The reports in ``path`` (at least one per cache); lines that do not parse are skipped."""
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
                         float(summed("saved_seconds", (int, float))), tuple(sorted(uncacheable.items())),
                         summed("hits_without_compile_time", (int,)))  # fmt: skip


def pids(reports: Iterable[Mapping[str, Any]]) -> Iterator[int]:
    """Distinct process ids that reported, in order."""
    seen: set[int] = set()
    for report in reports:
        pid = report.get("pid")
        if isinstance(pid, int) and pid not in seen:
            seen.add(pid)
            yield pid
