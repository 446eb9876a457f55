"""runstats: the exit report behind `stats --run` (chain/exitreport.py), read back in process (the subprocess path is in
test_cli.py; one hook and one line per sink in test_exitreport.py)."""

from __future__ import annotations

import json
import os

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import exitreport
from tiered_progcache.ops import runstats
from tiered_progcache.ops.runstats import STATS_FILE_ENV


@pytest.fixture
def stats_file(tmp_path, monkeypatch):
    path = tmp_path / "stats.jsonl"
    monkeypatch.setenv(STATS_FILE_ENV, str(path))
    monkeypatch.setattr(exitreport, "_sources", [])
    return path


def test_each_cache_reports_one_line_with_its_counters(tmp_path, stats_file):
    with TieredProgramCache(tmp_path / "a") as first:
        first[b"k"] = b"12345"
        first.get(b"k")
    second = TieredProgramCache(tmp_path / "a")
    second.get(b"k")
    del second  # a cache dropped before exit still reports
    exitreport._report_all()

    reports = runstats.read_reports(stats_file)
    assert len(reports) == 2
    assert all(r["pid"] == os.getpid() for r in reports)
    assert reports[0]["tiers"]["memory"]["hits"] == 1 and reports[0]["tiers"]["local"]["writes"] == 1
    assert reports[1]["tiers"]["local"]["hits"] == 1 and reports[1]["tiers"]["memory"]["promotions"] == 1

    total = runstats.sum_reports(reports)
    assert (total["memory"].hits, total["memory"].misses, total["local"].hits) == (1, 1, 1)
    assert total["memory"].get_p50_ms is None  # gauges do not add up across processes

    exitreport._report_all()  # reported once: a second exit hook call adds nothing
    assert len(runstats.read_reports(stats_file)) == 2


def test_no_variable_no_registration(tmp_path, monkeypatch):
    monkeypatch.delenv(STATS_FILE_ENV, raising=False)
    monkeypatch.setattr(exitreport, "_sources", [])
    TieredProgramCache(tmp_path / "a")
    assert [s.stats_path for s in exitreport._sources] == [None]  # the directory's counters only


def test_records_of_another_process_are_not_reported(tmp_path, stats_file):
    """A forked child inherits its parent's records; only the process that registered them reports."""
    cache = TieredProgramCache(tmp_path / "a")
    cache.get(b"x")
    exitreport._sources[0].pid += 1
    exitreport._report_all()
    assert not stats_file.exists() and not (tmp_path / "a" / "stats.jsonl").exists()


def test_reading_skips_lines_that_are_not_reports(tmp_path):
    path = tmp_path / "stats.jsonl"
    good = {"pid": 7, "tiers": {"memory": {"hits": 2, "misses": 1}}}
    path.write_text("not json\n" + json.dumps([1]) + "\n" + json.dumps(good) + "\n" + '{"pid": 8, "tiers": {"mem')
    reports = runstats.read_reports(path)
    assert reports == [good]
    assert runstats.sum_reports(reports)["memory"].hits == 2
    assert runstats.read_reports(tmp_path / "missing") == []


def test_each_report_carries_the_flight_decisions_and_they_sum_into_stats_and_prometheus(tmp_path, stats_file):
    pytest.importorskip("prometheus_client")
    from tiered_progcache.ops.metrics import exposition

    with TieredProgramCache(tmp_path / "a") as first:
        first.flight_counts.count("held")
        first.flight_counts.count("raced_won")
    with TieredProgramCache(tmp_path / "b") as second:
        second.flight_counts.count("held")
    exitreport._report_all()
    reports = runstats.read_reports(stats_file)
    assert [r["flight"]["held"] for r in reports] == [1, 1] and reports[0]["flight"]["raced_won"] == 1
    total = runstats.sum_reports(reports + [{"tiers": {}, "flight": {"held": True, "waited": "2"}}, {"tiers": {}}])
    assert total.flight == {**dict.fromkeys(total.flight, 0), "held": 2, "raced_won": 1}  # bad values count 0
    text = exposition(total)
    assert 'tiered_progcache_flight_decisions_total{cache="default",decision="held"} 2.0' in text
    assert 'tiered_progcache_flight_decisions_total{cache="default",decision="gave_up"} 0.0' in text


_FLIGHT_CHILD = """
import sys
from cuda.core import ProgramOptions
import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
with TieredProgramCache(sys.argv[1], remote=sys.argv[2], lease_min_compile_rtts=0.0) as cache:  # never short
    tpc.compile('extern "C" __global__ void k(float* x) { x[0] = 7.0f; }', "c++", ProgramOptions(arch="sm_90"),
                cache=cache)
"""


def test_stats_and_stats_run_show_each_flight_decision_in_text_and_json(tmp_path):
    """A child that takes the lease and compiles: ``held 1`` in ``stats --run`` (text, JSON) and in the directory's
    cumulative ``stats`` (text, JSON)."""
    import sys

    from support import run_cli

    (tmp_path / "remote").mkdir()
    local, remote = str(tmp_path / "cache"), f"file://{tmp_path / 'remote'}"
    env = {"TIERED_PROGCACHE_DIR": local}
    run = run_cli("stats", "--json", "--run", "--", sys.executable, "-c", _FLIGHT_CHILD, local, remote, env=env)
    assert run.returncode == 0, run.stderr
    flight = json.loads(run.stdout)["flight"]
    assert flight == {**dict.fromkeys(flight, 0), "held": 1} and len(flight) == 8
    again = run_cli("stats", "--run", "--", sys.executable, "-c", _FLIGHT_CHILD, local, remote, env=env)
    assert "flight       none" in again.stdout.splitlines()  # a local hit: no flight
    cumulative = json.loads(run_cli("stats", "--json", env=env).stdout)["local"]["cumulative"]["flight"]
    assert cumulative == {"held": 1}
    assert "flight decisions        held 1" in run_cli("stats", env=env).stdout.splitlines()
