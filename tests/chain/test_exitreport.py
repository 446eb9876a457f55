"""The one exit report (chain/exitreport.py): one atexit hook, one line format, two sinks, counts since the last report."""

from __future__ import annotations

import json
import logging
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

from support import child_pythonpath

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
    env = {**os.environ, STATS_FILE_ENV: str(stats_file), "PYTHONPATH": child_pythonpath()}
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


def test_a_closed_cache_reports_once_with_the_uploads_its_close_waited_for(tmp_path, monkeypatch, sources):
    """close() drains the upload, then reports: one line that counts it (`stats --run` counts a cache per line), and
    nothing again at exit. The upload is held until close() drains it."""
    from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

    from tiered_progcache.stores.remote import RemoteProgramCache
    from tiered_progcache.testing import WrapperEntryStore

    stats_file = tmp_path / "run.jsonl"
    monkeypatch.setenv(STATS_FILE_ENV, str(stats_file))
    (tmp_path / "remote").mkdir()
    remote = WrapperEntryStore(RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}"))
    upload = remote.hold("create_entry")
    cache = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"), remote])
    (writeback,) = [tier.writeback for tier in cache.tiers if tier.writeback is not None]
    drain = writeback.close
    monkeypatch.setattr(writeback, "close", lambda timeout=None: (upload.open(), drain(timeout))[1])
    cache[b"k"] = b"\x7fELF" + bytes(64)
    assert upload.wait_arrived()
    cache.close()
    (line,) = _lines(stats_file)
    assert (line["tiers"]["remote"]["writes"], line["tiers"]["local"]["writes"]) == (1, 1)
    exitreport._report_all()
    assert len(_lines(stats_file)) == 1


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


# -- the line, field by field ---------------------------------------------------------------------------------


def _tier(**counts: int) -> dict[str, int]:
    return {"hits": 0, "misses": 0, "errors": 0, "timeouts": 0} | counts


def test_a_line_is_each_counter_less_what_was_sent_rounded_as_documented(monkeypatch):
    """Lookups are the first tier's hits and misses, misses the last tier's, errors and timeouts summed over tiers."""
    monkeypatch.setattr(exitreport.time, "time", lambda: 1234.56789)
    now = exitreport.Counts(
        {"memory": _tier(hits=5, misses=4, errors=1), "local": _tier(hits=3, misses=2, timeouts=2, errors=2)},
        CompileTotals(3, 0.123456789, 2.2500004, (("too big", 2),), 6),
        {"held": 5, "waited": 2, "led": 3},
    )
    sent = exitreport.Counts({"memory": _tier(hits=1, misses=1)}, CompileTotals(1, 0.1, 1.0, (), 2),
                             {"held": 1, "led": 3})
    assert exitreport._line(7, now, sent) == {
        "pid": 7,
        "time": 1234.568,
        "lookups": 4 + 3,
        "hits": {"memory": 4, "local": 3},
        "misses": 2,
        "errors": 1 + 2,
        "timeouts": 2,
        "compiles": 2,
        "compile_seconds": 0.023457,
        "saved_seconds": 1.25,
        "hits_without_compile_time": 4,
        "uncacheable": {"too big": 2},
        "tiers": {"memory": _tier(hits=4, misses=3, errors=1), "local": _tier(hits=3, misses=2, timeouts=2, errors=2)},
        "flight": {"held": 4, "waited": 2},  # "led" did not move: left out
    }


def test_a_line_of_tiers_that_count_no_hits_or_misses_and_of_no_tiers_at_all():
    """A source's tiers need not count every field (a missing one is 0), and a source may have no tiers."""
    sparse = exitreport.Counts({"t": {"errors": 1, "timeouts": 0, "hits": 0}}, CompileTotals(), {})
    line = exitreport._line(1, sparse, exitreport.Counts({}, CompileTotals(), {}))
    assert (line["lookups"], line["misses"], line["errors"]) == (0, 0, 1)
    only_misses = exitreport.Counts({"t": {"misses": 2, "errors": 0, "timeouts": 0, "hits": 0}}, CompileTotals(), {})
    assert exitreport._line(1, only_misses, exitreport.Counts({}, CompileTotals(), {}))["lookups"] == 2
    no_hits_key = exitreport.Counts({"t": {"misses": 2, "errors": 0, "timeouts": 0}}, CompileTotals(), {})
    with pytest.raises(KeyError):  # the per-tier hits are read as given: a tier without them is a caller's bug
        exitreport._line(1, no_hits_key, exitreport.Counts({}, CompileTotals(), {}))
    first_without_hits = exitreport.Counts({"t": {"misses": 2}, "u": {"hits": 0, "errors": 0, "timeouts": 0}},
                                           CompileTotals(), {})  # fmt: skip
    with pytest.raises(KeyError):
        exitreport._line(1, first_without_hits, exitreport.Counts({}, CompileTotals(), {}))
    empty = exitreport._line(1, exitreport.Counts({}, CompileTotals(), {}), exitreport.Counts({}, CompileTotals(), {}))
    assert (empty["lookups"], empty["misses"], empty["errors"], empty["timeouts"], empty["hits"]) == (0, 0, 0, 0, {})


def _lookups_of(first: dict[str, int]) -> int:
    counts = exitreport.Counts({"first": first | {"errors": 0, "timeouts": 0}, "last": _tier()}, CompileTotals(), {})
    return exitreport._line(1, counts, exitreport.Counts({}, CompileTotals(), {}))["lookups"]


def test_lookups_count_a_missing_hits_or_misses_of_the_first_tier_as_zero():
    assert _lookups_of({"hits": 3}) == 3
    assert _lookups_of({"hits": 0, "misses": 4}) == 4
    last_without_misses = exitreport.Counts({"t": {"hits": 1, "errors": 0, "timeouts": 0}}, CompileTotals(), {})
    assert exitreport._line(1, last_without_misses, exitreport.Counts({}, CompileTotals(), {}))["misses"] == 0


@pytest.mark.parametrize("field", ["tier", "compiles", "uncacheable", "flight", "compile_seconds", "saved_seconds"])
def test_any_one_field_that_moved_makes_a_line_worth_writing(field):
    line = {"tiers": {"t": {"hits": 0}}, "compiles": 0, "uncacheable": {}, "flight": {},
            "compile_seconds": 0.0, "saved_seconds": 0.0}  # fmt: skip
    assert exitreport._moved(line) is False
    if field == "tier":
        line["tiers"]["t"]["hits"] = 1
    else:
        line[field] = {"x": 1} if field in ("uncacheable", "flight") else 1
    assert exitreport._moved(line) is True


# -- sources, sinks and the one hook --------------------------------------------------------------------------


def test_a_source_with_only_the_run_file_writes_there_in_compact_json_and_from_its_baseline(tmp_path, sources):
    hits = {"n": 1}

    def read() -> exitreport.Counts:
        return exitreport.Counts({"t": _tier(hits=hits["n"])}, CompileTotals(), {})

    run = tmp_path / "run.jsonl"
    source = exitreport.register(read, local_root=None, stats_path=str(run), baseline=read())
    assert source is not None and source.local_path is None and sources == [source]
    hits["n"] = 4
    source.report()
    (text,) = run.read_text().splitlines()
    assert json.loads(text)["hits"] == {"t": 3}  # since the baseline, not since zero
    assert text == json.dumps(json.loads(text), separators=(",", ":"))  # no spaces: one compact line
    assert exitreport.register(read, local_root=None, stats_path=None) is None and sources == [source]


def test_a_run_file_that_cannot_be_written_is_a_warning_and_a_directory_one_is_debug(tmp_path, sources, caplog):
    gone = tmp_path / "gone"
    source = exitreport.register(lambda: exitreport.Counts({"t": _tier(hits=1)}, CompileTotals(), {}),
                                 local_root=gone, stats_path=str(gone / "run.jsonl"))  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.exitreport"):
        source.report()
    local, run = gone / "stats.jsonl", gone / "run.jsonl"
    errno_text = "[Errno 2] No such file or directory"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, f"could not write cache stats to {local}: {errno_text}: '{local}'"),
        (logging.WARNING, f"could not write cache stats to {run}: {errno_text}: '{run}'"),
    ]


def test_append_line_creates_a_private_file_appends_and_says_whether_it_wrote(tmp_path, caplog):
    path = tmp_path / "stats.jsonl"
    old = os.umask(0)
    try:
        assert exitreport.append_line(path, "one\n") is True
    finally:
        os.umask(old)
    assert exitreport.append_line(path, "two\n") is True
    assert path.read_text() == "one\ntwo\n" and path.stat().st_mode & 0o777 == 0o600
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.exitreport"):
        assert exitreport.append_line(tmp_path / "gone" / "x", "three\n") is False  # quiet by default
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_the_exit_hook_is_registered_once_for_every_source(tmp_path, sources, monkeypatch):
    hooks = []
    monkeypatch.setattr(exitreport, "_hooked", False)
    monkeypatch.setattr(exitreport.atexit, "register", hooks.append)
    for n in range(3):
        exitreport.register(lambda: exitreport.Counts({}, CompileTotals(), {}), local_root=tmp_path / str(n),
                            stats_path=None)  # fmt: skip
    assert hooks == [exitreport._report_all] and len(sources) == 3


def test_a_source_that_fails_to_report_is_logged_and_the_others_still_report(tmp_path, sources, caplog):
    def broken() -> exitreport.Counts:
        raise RuntimeError("counters gone")

    exitreport.register(broken, local_root=tmp_path / "a", stats_path=None)
    exitreport.register(broken, local_root=None, stats_path=str(tmp_path / "run.jsonl"))
    exitreport.register(lambda: exitreport.Counts({"t": _tier(hits=1)}, CompileTotals(), {}), local_root=tmp_path,
                        stats_path=None)  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.exitreport"):
        exitreport._report_all()
    assert [r.getMessage() for r in caplog.records] == [
        f"could not report cache stats to {tmp_path / 'a' / 'stats.jsonl'}: RuntimeError('counters gone')",
        f"could not report cache stats to {tmp_path / 'run.jsonl'}: RuntimeError('counters gone')",
    ]
    assert [line["hits"] for line in _lines(tmp_path / "stats.jsonl")] == [{"t": 1}]


def test_a_chain_without_a_local_directory_reports_to_the_run_file_only(tmp_path, monkeypatch, sources):
    from cuda.core.utils import InMemoryProgramCache

    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path / "run.jsonl"))
    cache = TieredProgramCache(tiers=[InMemoryProgramCache()])
    cache.get(b"absent")
    (source,) = sources
    assert (source.local_path, source.stats_path) == (None, str(tmp_path / "run.jsonl"))
    cache.close()
    assert [r["misses"] for r in runstats.read_reports(tmp_path / "run.jsonl")] == [1]


def test_a_triton_chain_leaves_the_run_file_to_tritons_manager(tmp_path, monkeypatch, sources):
    """Triton's chain is reported by its manager (register_counters), so it is not counted twice in the run."""
    from tiered_progcache import CacheConfig

    (tmp_path / "remote").mkdir()
    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path / "run.jsonl"))
    config = CacheConfig(remote=f"file://{tmp_path / 'remote'}", strict=True)
    triton = config.build_shared(namespace="triton")
    entries = config.build_shared(namespace="entries")
    assert triton._exit_report is None  # no directory, no run file: nothing registered for it
    assert [(s.local_path, s.stats_path) for s in sources] == [(None, str(tmp_path / "run.jsonl"))]  # the entries' chain
    triton.close()
    entries.close()


def test_counters_of_no_chain_report_to_the_directory_and_the_run_file(tmp_path, monkeypatch, sources):
    from tiered_progcache.chain.stats import CompileTally, TierCounters

    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path / "run.jsonl"))
    counters, tally = TierCounters(), CompileTally()
    source = exitreport.register_counters(tmp_path, [("triton-remote", counters)], tally)
    assert (source.local_path, source.stats_path) == (tmp_path / "stats.jsonl", str(tmp_path / "run.jsonl"))
    counters.count_hit(10)
    tally.count_compile(0.5)
    exitreport._report_all()
    (line,) = _lines(tmp_path / "stats.jsonl")
    assert line == runstats.read_reports(tmp_path / "run.jsonl")[0]
    assert (line["hits"], line["compiles"], line["compile_seconds"]) == ({"triton-remote": 1}, 1, 0.5)
    assert exitreport.register_counters(None, [], tally) is not None  # the run file alone is a sink
    monkeypatch.delenv(STATS_FILE_ENV)
    assert exitreport.register_counters(None, [], tally) is None
