"""Prometheus metrics: scraped text equals ``cache.stats()`` in every tier; compiler runs as a histogram."""

from __future__ import annotations

import gc

import pytest
from cuda.core import ProgramOptions

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import tiered_progcache  # noqa: E402
from tiered_progcache import TieredProgramCache, metrics  # noqa: E402
from tiered_progcache.compiling.compile import CompileEvent  # noqa: E402
from tiered_progcache.samples import matmul_source  # noqa: E402
from tiered_progcache.chain.stats import COUNTER_FIELDS  # noqa: E402

OPTS = ProgramOptions(arch="sm_90", std="c++17")
K_REMOTE, K_LOCAL, K_NEW = matmul_source(16), matmul_source(32), matmul_source(16, "relu")
#: stats field -> metric family name, as documented in docs/operations.md
FAMILY = {
    "hits": "hits", "misses": "misses", "writes": "writes", "promotions": "promotions", "errors": "errors",
    "timeouts": "timeouts", "skipped": "skipped", "dropped": "dropped_writes", "forgone": "forgone_writes",
    "rejected": "rejected",
    "bytes_read": "read_bytes", "bytes_written": "written_bytes",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _collectors_unsubscribe():
    """A collector a test leaves registered would keep its compile/hit hooks for the process's life,
    and the hit hook reads manifests: later tests that count requests would see those reads."""
    import importlib

    compile_module = importlib.import_module("tiered_progcache.compiling.compile")

    compile_hooks, hit_hooks = list(compile_module._hooks), list(compile_module._hit_hooks)
    yield
    compile_module._hooks[:] = compile_hooks
    compile_module._hit_hooks[:] = hit_hooks


def _scrape(registry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the text exposition, as Prometheus would parse it."""
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scraped_counters_equal_stats_with_hits_in_every_tier(tmp_path, events):
    remote = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    with TieredProgramCache(tmp_path / "a", remote=remote) as other_node:  # fills the remote
        tiered_progcache.compile(K_REMOTE, "c++", OPTS, cache=other_node)
        assert other_node.flush(30)
    with TieredProgramCache(tmp_path / "b") as same_node:  # fills this node's local directory only
        tiered_progcache.compile(K_LOCAL, "c++", OPTS, cache=same_node)

    registry = prometheus_client.CollectorRegistry()
    with TieredProgramCache(tmp_path / "b", remote=remote) as cache:
        metrics.register(cache, registry, name="node-b")
        ran_before = len(events)
        tiered_progcache.compile(K_REMOTE, "c++", OPTS, cache=cache)  # remote hit, promoted
        tiered_progcache.compile(K_LOCAL, "c++", OPTS, cache=cache)  # local hit, promoted
        for _ in range(3):
            tiered_progcache.compile(K_REMOTE, "c++", OPTS, cache=cache)  # memory hits
        tiered_progcache.compile(K_NEW, "c++", OPTS, cache=cache)  # a miss everywhere: NVRTC
        assert cache.flush(30)
        stats = cache.stats()
        scraped = _scrape(registry)

    assert stats["memory"].hits == 3 and stats["local"].hits == 1 and stats["remote"].hits == 1
    assert stats["remote"].writes == 2  # K_NEW's cubin and manifest
    # K_REMOTE's cubin, and its manifest: the registry's on_hit hook read it through the chain (seconds saved)
    assert stats["local"].promotions == 2
    for tier, tier_stats in stats.tiers:
        for field in COUNTER_FIELDS:
            sample = (f"tiered_progcache_{FAMILY[field]}_total", (("cache", "node-b"), ("tier", tier)))
            assert scraped[sample] == getattr(tier_stats, field), (tier, field)
        if tier_stats.entries is not None:
            labels = (("cache", "node-b"), ("tier", tier))
            assert scraped[("tiered_progcache_entries", labels)] == tier_stats.entries
            assert scraped[("tiered_progcache_held_bytes", labels)] == tier_stats.bytes_held
        for op, quantile, field in (("get", "0.5", "get_p50_ms"), ("get", "0.99", "get_p99_ms")):
            labels = (("cache", "node-b"), ("op", op), ("quantile", quantile), ("tier", tier))
            assert scraped[("tiered_progcache_latency_seconds", labels)] == pytest.approx(getattr(tier_stats, field) / 1e3)
    assert ("tiered_progcache_entries", (("cache", "node-b"), ("tier", "remote"))) not in scraped  # a bucket: unknown

    # the compiler ran exactly once since registration, and its seconds are the hook's
    assert len(events) - ran_before == 1
    seconds = events[-1].seconds
    assert scraped[("tiered_progcache_compile_seconds_count", (("outcome", "ok"),))] == 1
    assert scraped[("tiered_progcache_compile_seconds_sum", (("outcome", "ok"),))] == seconds
    for bound in metrics.COMPILE_BUCKETS:
        sample = ("tiered_progcache_compile_seconds_bucket", (("le", repr(bound)), ("outcome", "ok")))
        assert scraped[sample] == (1 if seconds <= bound else 0)
    assert scraped[("tiered_progcache_compile_seconds_count", (("outcome", "error"),))] == 0
    # each hit saved what its manifest records: 4 hits of K_REMOTE (remote, then memory), 1 of K_LOCAL
    saved = 4 * round(events[0].seconds, 6) + round(events[1].seconds, 6)
    assert scraped[("tiered_progcache_compile_seconds_saved_total", ())] == pytest.approx(saved, rel=1e-9)
    # the hook's figure alone (not the snapshot's too), and every hit priced: the hook read each manifest
    assert [k for k in scraped if k[0] == "tiered_progcache_compile_seconds_saved_total"] == [
        ("tiered_progcache_compile_seconds_saved_total", ())]
    assert scraped[("tiered_progcache_hits_without_compile_time_total", (("cache", "node-b"),))] == 0


def test_a_failed_compile_is_counted_as_an_error(tmp_path):
    registry = prometheus_client.CollectorRegistry()
    with TieredProgramCache(tmp_path) as cache:
        metrics.register(cache, registry)
        seen: list[CompileEvent] = []
        stop = tiered_progcache.on_compile(seen.append)
        for bad in ("this is not C++ {", "neither is this }"):
            with pytest.raises(Exception):
                tiered_progcache.compile(bad, "c++", OPTS, cache=cache)
        stop()
        scraped = _scrape(registry)
    assert [e.ok for e in seen] == [False, False]
    error, ok = (("outcome", "error"),), (("outcome", "ok"),)
    assert scraped[("tiered_progcache_compile_seconds_count", error)] == 2
    assert scraped[("tiered_progcache_compile_seconds_sum", error)] == seen[0].seconds + seen[1].seconds
    for bound in metrics.COMPILE_BUCKETS:
        inside = sum(e.seconds <= bound for e in seen)
        assert scraped[("tiered_progcache_compile_seconds_bucket", (("le", repr(bound)),) + error)] == inside
        assert scraped[("tiered_progcache_compile_seconds_bucket", (("le", repr(bound)),) + ok)] == 0
    assert scraped[("tiered_progcache_compile_seconds_bucket", (("le", "+Inf"),) + error)] == 2
    assert scraped[("tiered_progcache_compile_seconds_count", ok)] == 0
    assert scraped[("tiered_progcache_compile_seconds_sum", ok)] == 0


def test_register_defaults_to_the_global_registry_and_exposition_has_counters(tmp_path):
    with TieredProgramCache(tmp_path) as cache:
        unregister = metrics.register(cache, name="global-test")
        cache.get(b"absent")
        try:
            value = prometheus_client.REGISTRY.get_sample_value(
                "tiered_progcache_misses_total", {"cache": "global-test", "tier": "local"}
            )
            assert value == 1
        finally:
            unregister()
        assert prometheus_client.REGISTRY.get_sample_value(
            "tiered_progcache_misses_total", {"cache": "global-test", "tier": "local"}
        ) is None
        text = metrics.exposition(cache.stats())
    samples = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("tiered_progcache_misses_total", "local")] == 1 and samples[("tiered_progcache_misses_total", "memory")] == 1


def test_several_caches_share_a_registry_by_name_and_a_dropped_cache_goes(tmp_path):
    registry = prometheus_client.CollectorRegistry()
    first = TieredProgramCache(tmp_path / "1")
    second = TieredProgramCache(tmp_path / "2")
    metrics.register(first, registry, name="one")
    unregister = metrics.register(second, registry, name="two")
    with pytest.raises(ValueError, match="'one' is already registered"):
        metrics.register(second, registry, name="one")
    first.get(b"absent")
    scraped = _scrape(registry)
    assert scraped[("tiered_progcache_misses_total", (("cache", "one"), ("tier", "local")))] == 1
    assert scraped[("tiered_progcache_misses_total", (("cache", "two"), ("tier", "local")))] == 0
    unregister()
    assert ("tiered_progcache_misses_total", (("cache", "two"), ("tier", "local"))) not in _scrape(registry)
    first.close()
    del first
    gc.collect()
    assert not any(name == "tiered_progcache_misses_total" for name, _ in _scrape(registry))
    metrics.register(second, registry, name="one")  # the name is free again
    second.close()


def test_exposition_of_a_directory_has_gauges_only(tmp_path):
    with TieredProgramCache(tmp_path) as cache:
        tiered_progcache.compile(K_LOCAL, "c++", OPTS, cache=cache)
        stats = cache.stats()
    text = metrics.exposition(stats, name="node", counters=False)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"tiered_progcache_entries", "tiered_progcache_held_bytes"}
    local = [s for s in families["tiered_progcache_entries"].samples if s.labels["tier"] == "local"]
    assert [s.value for s in local] == [stats["local"].entries] == [2]  # the cubin and its manifest


def test_register_names_bad_arguments(tmp_path):
    registry = prometheus_client.CollectorRegistry()
    with pytest.raises(TypeError, match="TieredProgramCache"):
        metrics.register(object(), registry)
    with TieredProgramCache(tmp_path) as cache, pytest.raises(ValueError, match="non-empty str"):
        metrics.register(cache, registry, name="")


# -- tiered-progcache stats --prometheus ---------------------------------------------------------

_CHILD = r"""
import json, sys
import tiered_progcache
from cuda.core import ProgramOptions
from tiered_progcache import TieredProgramCache
from tiered_progcache.samples import matmul_source
cache = TieredProgramCache.from_env()
for src in (matmul_source(16), matmul_source(16), matmul_source(32)):
    tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_90"), cache=cache)
open(sys.argv[1], "w").write(json.dumps(cache.stats().as_dict()))
"""


def test_stats_run_prometheus_prints_the_runs_counters(tmp_path):
    import json
    import sys

    from support import run_cli

    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "c")}
    proc = run_cli("stats", "--run", "--prometheus", "--", sys.executable, "-c", _CHILD, str(tmp_path / "s.json"), env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((tmp_path / "s.json").read_text())
    assert seen["memory"]["hits"] == 1 and seen["local"]["writes"] == 4  # 2 cubins, 2 manifests
    samples = {
        (s.name, s.labels["tier"]): s.value
        for family in text_string_to_metric_families(proc.stdout)
        for s in family.samples
        if s.name.endswith("_total") and "tier" in s.labels  # (the flight decisions are per cache)
    }
    for tier, fields in seen.items():
        for field in COUNTER_FIELDS:
            assert samples[(f"tiered_progcache_{FAMILY[field]}_total", tier)] == fields[field], (tier, field)

    local = run_cli("stats", "--prometheus", env=env)
    assert local.returncode == 0, local.stderr
    scraped = [s for f in text_string_to_metric_families(local.stdout) for s in f.samples]
    gauges = {(s.name, s.labels["tier"]): s.value for s in scraped if not s.name.endswith(("_total", "_created"))}
    assert gauges == {("tiered_progcache_entries", "local"): 4, ("tiered_progcache_kernels", "local"): 2,
                      ("tiered_progcache_held_bytes", "local"): pytest.approx(
        sum(p.stat().st_size for p in (tmp_path / "c" / "entries").rglob("*") if p.is_file()))}
    # issue 28 item 6: plain `stats --prometheus` exports what `stats` prints, the directory's cumulative counters
    counted = {(s.name, s.labels.get("tier")): s.value for s in scraped if s.name.endswith("_total")}
    for tier, fields in seen.items():  # the same numbers the process's own stats() gave
        assert counted[("tiered_progcache_hits_total", tier)] == fields["hits"]
        assert counted[("tiered_progcache_misses_total", tier)] == fields["misses"]
    assert counted[("tiered_progcache_lookups_total", None)] == seen["memory"]["hits"] + seen["memory"]["misses"]
    assert counted[("tiered_progcache_nvrtc_runs_total", None)] == 2
    assert counted[("tiered_progcache_compile_seconds_saved_total", None)] > 0


def test_stats_prometheus_and_json_are_a_usage_error(tmp_path):
    from support import assert_one_line_error, run_cli

    line = assert_one_line_error(run_cli("stats", "--prometheus", "--json", "--dir", str(tmp_path)))
    assert "pick one" in line


def test_seconds_saved_add_what_each_hits_manifest_records_and_nothing_without_one(tmp_path, events):
    from cuda.core import Program

    from tiered_progcache.compiling.compile import on_hit

    bare = 'extern "C" __global__ void bare(float* x) { x[0] = 0.0f; }\n'
    with TieredProgramCache(tmp_path) as cache:
        tiered_progcache.compile(K_LOCAL, "c++", OPTS, cache=cache)
        Program(bare, "c++", OPTS).compile("cubin", cache=cache)  # an entry without a manifest
    registry = prometheus_client.CollectorRegistry()
    seen = []
    stop = on_hit(seen.append)
    with TieredProgramCache(tmp_path) as cache:  # a new process's view: nothing remembered in memory
        metrics.register(cache, registry)
        for _ in range(2):
            tiered_progcache.compile(K_LOCAL, "c++", OPTS, cache=cache)
            tiered_progcache.compile(bare, "c++", OPTS, cache=cache)
        stats = cache.stats()
    stop()
    assert [e.saved_seconds for e in seen] == [round(events[0].seconds, 6), None] * 2
    assert scraped_saved(registry) == pytest.approx(2 * round(events[0].seconds, 6), rel=1e-9)
    assert (stats["local"].hits, stats["memory"].hits) == (2, 2)  # the manifest reads are not lookups


def scraped_saved(registry) -> float:
    return _scrape(registry)[("tiered_progcache_compile_seconds_saved_total", ())]


def test_the_unregister_function_does_not_keep_the_cache_alive(tmp_path):
    """Issue 19 item 3: the docs say the cache is held weakly; a kept unregister used to hold it strongly."""
    import weakref

    registry = prometheus_client.CollectorRegistry()
    cache = TieredProgramCache(tmp_path)
    unregister = metrics.register(cache, registry, name="kept")
    cache.get(b"absent")
    assert _scrape(registry)[("tiered_progcache_misses_total", (("cache", "kept"), ("tier", "local")))] == 1
    gone = weakref.ref(cache)
    cache.close()
    del cache
    gc.collect()
    assert gone() is None  # freed although `unregister` is still held
    assert not any(labels and labels[0] == ("cache", "kept") for _, labels in _scrape(registry))
    unregister()  # still callable, and harmless, once the cache is gone
    later = TieredProgramCache(tmp_path / "later")
    metrics.register(later, registry, name="kept")
    unregister()  # an old unregister never drops a later cache registered under the same name
    assert ("tiered_progcache_misses_total", (("cache", "kept"), ("tier", "local"))) in _scrape(registry)
    later.close()


def test_a_registry_subscribes_its_hooks_only_while_a_cache_is_registered(tmp_path):
    """Its hit hook reads each hit's manifest (a request where that is remote): a registry with no cache
    left must not keep it, or every later hit of the process pays the read."""
    from tiered_progcache.compiling import compile as compile_module

    baseline = (len(compile_module._hooks), len(compile_module._hit_hooks))
    registry = prometheus_client.CollectorRegistry()
    with TieredProgramCache(tmp_path / "a") as first, TieredProgramCache(tmp_path / "b") as second:
        stop_first = metrics.register(first, registry, name="one")
        stop_second = metrics.register(second, registry, name="two")
        assert (len(compile_module._hooks), len(compile_module._hit_hooks)) == (baseline[0] + 1, baseline[1] + 1)
        stop_first()
        assert len(compile_module._hit_hooks) == baseline[1] + 1  # "two" is still registered
        tiered_progcache.compile(K_NEW, "c++", OPTS, cache=second)
        stop_second()
        assert (len(compile_module._hooks), len(compile_module._hit_hooks)) == baseline
        runs = _scrape(registry)[("tiered_progcache_compile_seconds_count", (("outcome", "ok"),))]
        tiered_progcache.compile(K_LOCAL, "c++", OPTS, cache=second)  # not counted: nothing registered
        again = metrics.register(second, registry, name="two")  # subscribed again, counters kept
        assert len(compile_module._hit_hooks) == baseline[1] + 1
        assert _scrape(registry)[("tiered_progcache_compile_seconds_count", (("outcome", "ok"),))] == runs == 1
        again()
    assert (len(compile_module._hooks), len(compile_module._hit_hooks)) == baseline
