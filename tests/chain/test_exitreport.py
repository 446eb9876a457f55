"""The one exit report (chain/exitreport.py): one atexit hook, one line format, two sinks, counts since the last report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import exitreport, ledger
from tiered_progcache.chain.stats import CompileTotals
from tiered_progcache.ops import runstats
from tiered_progcache.settings import STATS_FILE_ENV

# Hooks are recorded from before the package is imported. Cache "a" is closed (it reports then), "b" is left to exit.
_TWO_CACHES = """
import atexit, json, sys
hooks = []
_register = atexit.register
def recording(fn, *args, **kwargs):
    hooks.append(f"{fn.__module__}.{fn.__qualname__}")
    return _register(fn, *args, **kwargs)
atexit.register = recording
from tiered_progcache import TieredProgramCache
with TieredProgramCache(sys.argv[1]) as a:
    a[b"k"] = b"payload"
    a.get(b"k"); a.get(b"absent")
b = TieredProgramCache(sys.argv[2])
b.get(b"absent")
c = TieredProgramCache(sys.argv[1])  # a second cache on a's directory: its own line there
c.get(b"k")
print(json.dumps(hooks))
"""


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_process_with_both_sinks_has_one_hook_and_writes_one_line_per_cache_to_each(tmp_path):
    stats_file = tmp_path / "run.jsonl"
    env = {**os.environ, STATS_FILE_ENV: str(stats_file), "PYTHONPATH": str(Path(__file__).parents[2])}
    for name in ("TIERED_PROGCACHE_REMOTE", "TIERED_PROGCACHE_CONFIG"):
        env.pop(name, None)
    child = subprocess.run([sys.executable, "-c", _TWO_CACHES, str(tmp_path / "a"), str(tmp_path / "b")],
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr
    hooks = json.loads(child.stdout.splitlines()[-1])
    assert hooks.count("tiered_progcache.chain.exitreport._report_all") == 1
    assert not [h for h in hooks if h != "tiered_progcache.chain.exitreport._report_all" and "report" in h], hooks

    in_a, in_b, in_run = _lines(tmp_path / "a" / "stats.jsonl"), _lines(tmp_path / "b" / "stats.jsonl"), _lines(stats_file)
    assert len(in_a) == 2 and len(in_b) == 1 and len(in_run) == 3  # a and c in a's directory; close() then exit: once
    assert in_run == [in_a[0], in_b[0], in_a[1]]  # the same lines: a's at close(), then b's and c's at exit
    assert {line["pid"] for line in in_run} == {in_run[0]["pid"]} != {os.getpid()}
    assert all(line.keys() == in_run[0].keys() for line in in_run)  # one format for both sinks
    first = in_a[0]
    assert (first["lookups"], first["hits"], first["misses"]) == (2, {"memory": 1, "local": 0}, 1)
    assert first["tiers"]["local"]["writes"] == 1 and first["tiers"]["memory"]["hits"] == 1
    assert ledger.read_totals(tmp_path / "a").lookups == 3 and ledger.read_totals(tmp_path / "b").misses == 1
    total = runstats.sum_reports(runstats.read_reports(stats_file))
    assert (total["memory"].hits, total["local"].hits, total["local"].misses, total["local"].writes) == (1, 1, 2, 1)


@pytest.fixture
def sources(monkeypatch):
    monkeypatch.setattr(exitreport, "_sources", [])
    return exitreport._sources


def test_an_idle_cache_skips_the_directory_but_tells_the_run_once(tmp_path, monkeypatch, sources):
    """The stats file gets every cache's first report (supervise counts the processes); the directory none empty."""
    stats_file = tmp_path / "run.jsonl"
    monkeypatch.setenv(STATS_FILE_ENV, str(stats_file))
    TieredProgramCache(tmp_path / "c").close()
    exitreport._report_all()
    assert not (tmp_path / "c" / "stats.jsonl").exists()
    (report,) = runstats.read_reports(stats_file)
    assert report["lookups"] == 0 and report["tiers"]["local"]["hits"] == 0 and report["flight"] == {}
    assert list(runstats.pids([report])) == [os.getpid()]


def test_each_report_counts_only_what_is_new(tmp_path, sources):
    cache = TieredProgramCache(tmp_path / "c")
    cache.get(b"x")
    (source,) = sources
    source.report()
    source.report()  # nothing new: no line
    cache.get(b"y")
    cache.close()
    exitreport._report_all()
    assert [line["lookups"] for line in _lines(tmp_path / "c" / "stats.jsonl")] == [1, 1]


def test_a_closed_source_reports_no_more(tmp_path, sources):
    """CuPy's uninstall(): its last report, then a later install() reports from its own start."""
    counts = {"n": 0}

    def read() -> exitreport.Counts:
        tiers = {"t": dict.fromkeys(("hits", "misses", "errors", "timeouts"), 0) | {"hits": counts["n"]}}
        return exitreport.Counts(tiers, CompileTotals(), {})

    source = exitreport.register(read, local_root=tmp_path, stats_path=None, baseline=read())
    counts["n"] = 2
    source.close()
    counts["n"] = 5
    exitreport._report_all()
    assert [line["hits"] for line in _lines(tmp_path / "stats.jsonl")] == [{"t": 2}]


def test_stats_reads_the_older_line_format_beside_the_new(tmp_path, sources):
    """Lines already on disk from before the exit report (a ``hits`` dict, no ``tiers``, no ``flight``) still sum."""
    root = tmp_path / "c"
    root.mkdir()
    old = {"pid": 1, "time": 1.0, "lookups": 3, "hits": {"memory": 1, "local": 1}, "misses": 1, "errors": 0,
           "compiles": 1, "compile_seconds": 0.5, "saved_seconds": 0.25}  # fmt: skip
    (root / "stats.jsonl").write_text(json.dumps(old) + "\n")
    with TieredProgramCache(root) as cache:
        cache.get(b"absent")
    totals = ledger.read_totals(root)
    assert (totals.reports, totals.lookups, totals.misses, totals.compiles) == (2, 4, 2, 1)
    assert dict(totals.hits) == {"memory": 1, "local": 1}
    assert (totals.compile_seconds, totals.saved_seconds) == (0.5, 0.25)
    assert dict(totals.tiers)["local"] == (("hits", 0), ("misses", 1), ("errors", 0), ("timeouts", 0))
