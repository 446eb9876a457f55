"""stats(): per-tier snapshots that subtract, serialise to JSON and stay exact under threads."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading

import pytest
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import CacheStats, TieredProgramCache, TierPolicy, TierStats
from tiered_progcache.chain.stats import COUNTER_FIELDS


@pytest.fixture
def cache(tmp_path):
    with TieredProgramCache(tmp_path / "cache") as c:
        yield c


def test_snapshot_is_immutable_and_keyed_by_tier(cache):
    snap = cache.stats()
    assert isinstance(snap, CacheStats)
    assert list(snap) == ["memory", "local"]
    assert isinstance(snap["local"], TierStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap["memory"].hits = 5
    with pytest.raises(KeyError):
        snap["remote"]


def test_counts_one_miss_write_hit_and_promotion(cache):
    before = cache.stats()
    assert cache.get(b"k") is None  # miss in both tiers
    cache[b"k"] = b"x" * 100  # written to both
    assert cache.get(b"k") == b"x" * 100  # memory hit
    delta = cache.stats() - before
    assert (delta["memory"].hits, delta["memory"].misses, delta["memory"].writes) == (1, 1, 1)
    assert (delta["local"].hits, delta["local"].misses, delta["local"].writes) == (0, 1, 1)
    assert delta["memory"].bytes_read == 100
    assert delta["local"].bytes_written == 100
    assert delta.hits == 1 and delta.misses == 1

    # A fresh chain on the same directory hits the local tier and promotes into memory.
    with TieredProgramCache(cache.local_store.root) as second:
        assert second.get(b"k") == b"x" * 100
        snap = second.stats()
    assert (snap["memory"].misses, snap["local"].hits, snap["memory"].promotions) == (1, 1, 1)


def test_subtraction_gives_one_runs_counters_and_keeps_gauges(cache):
    cache[b"a"] = b"1"
    cache.get(b"a")
    before = cache.stats()
    for _ in range(5):
        cache.get(b"a")
    cache.get(b"missing")
    after = cache.stats()
    delta = after - before
    assert delta["memory"].hits == 5
    assert delta["memory"].misses == 1
    assert delta["memory"].writes == 0
    assert after["memory"].hits == before["memory"].hits + 5
    # Gauges describe the state at ``after``; they do not subtract.
    assert delta["local"].entries == after["local"].entries == 1
    assert delta["memory"].get_p50_ms == after["memory"].get_p50_ms
    # Every counter field subtracts.
    for name in COUNTER_FIELDS:
        assert getattr(delta["memory"], name) == getattr(after["memory"], name) - getattr(before["memory"], name)


def test_subtracting_a_non_snapshot_is_a_typeerror(cache):
    with pytest.raises(TypeError):
        cache.stats() - 1
    with pytest.raises(TypeError):
        cache.stats()["memory"] - 1


def test_as_dict_is_json_ready(cache):
    cache[b"a"] = b"abc"
    cache.get(b"a")
    cache.get(b"b")
    as_dict = cache.stats().as_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert set(as_dict) == {"memory", "local"}
    expected = set(COUNTER_FIELDS) | {"entries", "bytes_held", "get_p50_ms", "get_p99_ms", "put_p50_ms", "put_p99_ms"}
    assert set(as_dict["memory"]) == expected
    assert as_dict["local"]["entries"] == 1
    assert as_dict["local"]["bytes_held"] == 3


def test_percentiles_absent_before_and_present_after_operations(cache):
    snap = cache.stats()["memory"]
    assert (snap.get_p50_ms, snap.get_p99_ms, snap.put_p50_ms, snap.put_p99_ms) == (None, None, None, None)
    cache[b"a"] = b"abc"
    cache.get(b"a")
    cache.get(b"missing")
    for tier in ("memory", "local"):
        s = cache.stats()[tier]
        assert s.get_p50_ms is not None and s.put_p50_ms is not None, tier
        assert 0 <= s.get_p50_ms <= s.get_p99_ms
        assert 0 <= s.put_p50_ms <= s.put_p99_ms


def test_entries_and_bytes_held_where_the_tier_can_tell(cache):
    cache[b"a"] = b"12345"
    cache[b"b"] = b"678"
    snap = cache.stats()
    assert (snap["memory"].entries, snap["memory"].bytes_held) == (2, 8)
    assert (snap["local"].entries, snap["local"].bytes_held) == (2, 8)


@pytest.fixture
def frequent_thread_switches():
    """Switch threads every microsecond so a counter update that is not atomic loses counts."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_counters_exact_under_threads(frequent_thread_switches):
    """8 threads hammering one chain: every hit, miss, write and byte is counted, none lost."""
    threads, rounds = 8, 4000
    fast = InMemoryProgramCache()
    slow = InMemoryProgramCache()
    chain = TieredProgramCache(tiers=[(fast, TierPolicy("fast", promote=False)), (slow, TierPolicy("slow"))])
    chain[b"hot"] = b"h" * 7  # in both tiers
    slow[b"cold"] = b"c" * 3  # only in the slow tier; never promoted
    before = chain.stats()
    barrier = threading.Barrier(threads)

    def work(i: int) -> None:
        barrier.wait()
        for n in range(rounds):
            chain.get(b"hot")  # fast hit
            chain.get(b"cold")  # fast miss, slow hit
            chain.get(b"nowhere")  # miss in both
            chain[f"w{i}-{n % 50}".encode()] = b"w"  # a write to each tier

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    delta = chain.stats() - before
    ops = threads * rounds
    assert delta["fast"].hits == ops
    assert delta["fast"].misses == 2 * ops
    assert delta["fast"].bytes_read == 7 * ops
    assert delta["slow"].hits == ops
    assert delta["slow"].misses == ops
    assert delta["slow"].bytes_read == 3 * ops
    assert delta["fast"].writes == delta["slow"].writes == ops
    assert delta["fast"].bytes_written == delta["slow"].bytes_written == ops
    assert delta["fast"].promotions == delta["slow"].promotions == 0


def test_one_debug_line_per_lookup_names_the_tier(tmp_path, caplog):
    with TieredProgramCache(tmp_path / "c") as writer:
        writer[b"k"] = b"v"
    caplog.set_level(logging.DEBUG, logger="tiered_progcache")
    with TieredProgramCache(tmp_path / "c") as cache:
        cache.get(b"k")  # local hit, promoted
        for _ in range(100):  # memory hits: past the untimed fast path's 1-in-64 window
            cache.get(b"k")
        cache.get(b"nowhere")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "lookup" in r.getMessage()]
    assert len(lines) == 102
    assert "local hit" in lines[0]
    assert all("memory hit" in line for line in lines[1:101])
    assert "miss in every tier" in lines[101]


def test_no_debug_lines_when_debug_is_off(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiered_progcache")
    with TieredProgramCache(tmp_path / "c") as cache:
        cache[b"k"] = b"v"
        for _ in range(100):
            cache.get(b"k")
    assert not [r for r in caplog.records if r.levelno == logging.DEBUG]


def test_count_methods_are_the_one_place_for_the_frequent_counters(frequent_thread_switches):
    """hits/misses/writes/promotions and their bytes are exact through count_* alone, under threads."""
    from tiered_progcache.chain.stats import TierCounters

    counters = TierCounters()
    threads, rounds = 8, 5000
    barrier = threading.Barrier(threads)

    def work() -> None:
        barrier.wait()
        for _ in range(rounds):
            counters.count_hit(3)
            counters.count_miss()
            counters.count_write(5)
            counters.count_promotion()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    snap = counters.snapshot()
    ops = threads * rounds
    assert (snap.hits, snap.misses, snap.writes, snap.promotions) == (ops, ops, ops, ops)
    assert (snap.bytes_read, snap.bytes_written) == (3 * ops, 5 * ops)


def test_stats_count_each_flight_decision_and_a_difference_keeps_only_the_run():
    from tiered_progcache.chain.stats import FLIGHT_DECISIONS

    cache = TieredProgramCache(tiers=[InMemoryProgramCache()])
    assert cache.stats().flight == dict.fromkeys(FLIGHT_DECISIONS, 0)
    cache.flight_counts.count("held")
    before = cache.stats()
    for decision in FLIGHT_DECISIONS:
        cache.flight_counts.count(decision)
    run = cache.stats() - before
    assert run.flight == dict.fromkeys(FLIGHT_DECISIONS, 1) and cache.stats().flight["held"] == 2
    with pytest.raises(ValueError, match="unknown flight decision 'raced'"):
        cache.flight_counts.count("raced")


def test_an_uncacheable_key_is_logged_once_while_among_the_last_4096_logged():
    """The bound on the keys remembered as logged drops the least recently logged one, never all of them."""
    from tiered_progcache.chain import stats

    tally = stats.CompileTally()
    keys = [i.to_bytes(32, "big") for i in range(stats._MAX_LOGGED_KEYS + 1)]
    assert stats._MAX_LOGGED_KEYS == 4096
    assert [tally.count_uncacheable("computed #include", k) for k in keys] == [True] * len(keys)
    assert tally.count_uncacheable("computed #include", keys[-1]) is False  # the newest stays remembered
    assert tally.count_uncacheable("computed #include", keys[1]) is False  # and the oldest but one
    assert tally.count_uncacheable("computed #include", keys[0]) is True  # the oldest was dropped: a line again
    assert tally.snapshot().uncacheable == (("computed_include", len(keys) + 3),)


def test_a_hits_saved_seconds_are_read_once_per_key_when_the_tally_is_read_and_counted_per_hit():
    from tiered_progcache.chain import stats

    tally = stats.CompileTally()
    reads: list[bytes] = []

    def read_of(key: bytes, seconds: float | None):
        return lambda: reads.append(key) or seconds

    for key, seconds in ((b"a", 0.5), (b"b", None), (b"a", 0.5), (b"c", 0.25), (b"b", None), (b"z", 0.0)):
        tally.count_saved_later(key, read_of(key, seconds))
    assert reads == []  # the hits read nothing
    first = tally.snapshot()
    assert (first.saved_seconds, first.hits_without_compile_time) == (0.5 * 2 + 0.25, 2)  # b's two hits; z's is known
    assert reads == [b"a", b"b", b"c", b"z"]
    again = tally.snapshot()
    assert (again.saved_seconds, again.hits_without_compile_time) == (1.25, 2) and len(reads) == 4  # each read once
    tally.count_saved(None)
    tally.count_saved(2.0, 3)
    assert (tally.snapshot().saved_seconds, tally.snapshot().hits_without_compile_time) == (7.25, 3)
    assert (again - first).hits_without_compile_time == 0 and (tally.snapshot() - first).hits_without_compile_time == 1


def test_at_most_1024_keys_wait_for_their_saved_seconds():
    from tiered_progcache.chain import stats

    assert stats.MAX_PENDING_KEYS == 1024
    tally = stats.CompileTally()
    reads: list[int] = []
    for n in range(stats.MAX_PENDING_KEYS):
        tally.count_saved_later(n.to_bytes(4, "big"), lambda n=n: reads.append(n) or 1.0)
    assert reads == []
    tally.count_saved_later(b"last", lambda: reads.append(-1) or 1.0)  # one past the bound: all are read now
    assert reads == [*range(stats.MAX_PENDING_KEYS), -1]
    assert tally.snapshot().saved_seconds == stats.MAX_PENDING_KEYS + 1
