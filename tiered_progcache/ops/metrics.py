"""Prometheus metrics: a cache's per-tier counters and the compiler's runs, read at scrape time.

>>> from tiered_progcache import metrics
>>> metrics.register(cache)                      # the default prometheus_client registry
>>> prometheus_client.start_http_server(9400)    # or write_to_textfile(...) for node_exporter

Nothing here runs on the lookup path. A scrape calls ``cache.stats()`` and turns the
snapshot into metric families (a custom collector), so the counters cost what they
already cost. Latency is exported as the p50/p99 the tiers already record (gauges
with a ``quantile`` label, in seconds, over the last 2048 operations of each kind),
not as histograms: a histogram needs a bucket increment per lookup, and a memory hit
is timed only one time in 64 to stay under a microsecond.

Compiler runs come from :func:`tiered_progcache.compiling.compile.on_compile` (the hook runs
once per compile, never per lookup), so they are a true histogram of seconds of
:func:`tiered_progcache.compiling.compile`'s runs. ``tiered_progcache_nvrtc_runs_total`` counts,
per cache, those and ``Program.compile(cache=...)``'s misses (each stores what NVRTC made),
whose seconds this package cannot see; ``tiered_progcache_uncacheable_total`` the compiles
that could not be cached, by ``reason``.

``tiered_progcache_compile_seconds_saved_total`` sums, over every hit of
:func:`tiered_progcache.compiling.compile` since registration, the compile time the entry's
manifest records (:func:`tiered_progcache.compiling.compile.on_hit`); an entry without a readable
manifest adds 0, and ``tiered_progcache_hits_without_compile_time_total`` counts such hits per cache.
Needs ``prometheus_client`` (``pip install 'tiered-progcache[metrics]'``).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable

from ..compiling.compile import CompileEvent, HitEvent, on_compile, on_hit
from ..chain.stats import CacheStats

if TYPE_CHECKING:
    from ..chain.tiered import TieredProgramCache

__all__ = ["COMPILE_BUCKETS", "PREFIX", "exposition", "register", "stats_families"]

PREFIX = "tiered_progcache"

#: Histogram buckets (seconds) for one compiler run: a small kernel takes ~0.1 s, a CCCL one tens.
COMPILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: (stats field, metric name without prefix, help) for each counter of a tier.
_COUNTERS = (
    ("hits", "hits", "lookups this tier answered"),
    ("misses", "misses", "lookups this tier could not answer (failures included)"),
    ("writes", "writes", "entries written into this tier (promotions included)"),
    ("promotions", "promotions", "entries copied into this tier from a slower one"),
    ("errors", "errors", "operations that failed (counted as a miss or a dropped write)"),
    ("timeouts", "timeouts", "operations that ran past the tier's deadline"),
    ("skipped", "skipped", "operations not attempted while the tier's circuit breaker was open"),
    ("dropped", "dropped_writes", "background writes dropped by a full queue"),
    ("forgone", "forgone_writes", "queued background writes dropped because a lookup found the entry on the tier"),
    ("rejected", "rejected", "entries refused by their digest or signature check"),
    ("bytes_read", "read_bytes", "payload bytes returned by hits"),
    ("bytes_written", "written_bytes", "payload bytes written"),
)
_LATENCY = (
    ("get", "get_p50_ms", "0.5"),
    ("get", "get_p99_ms", "0.99"),
    ("put", "put_p50_ms", "0.5"),
    ("put", "put_p99_ms", "0.99"),
)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(
            "Prometheus metrics need the prometheus_client package: pip install 'tiered-progcache[metrics]'"
        ) from None
    return prometheus_client


def stats_families(stats: Iterable[tuple[str, CacheStats]], *, counters: bool = True, saved: bool = False) -> list[Any]:
    """Metric families for ``(cache name, stats)`` pairs: counters (unless ``counters=False``) and gauges.

    Every tier sample is labelled ``cache`` and ``tier``; the chain's own counters (lookups,
    NVRTC runs, uncacheable compiles by ``reason``) ``cache``. ``saved``: also the snapshot's
    compile seconds saved (a registry has them from the ``on_hit`` hook instead). Gauges are
    emitted only where the tier knows the value (entries and bytes held locally; latency
    once it has samples).
    """
    _client()  # the install hint, where the package is missing
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    pairs = list(stats)
    labels = ["cache", "tier"]
    families: list[Any] = []
    if counters:
        for field, name, help_text in _COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)
            for cache_name, snapshot in pairs:
                for tier, tier_stats in snapshot.tiers:
                    family.add_metric([cache_name, tier], getattr(tier_stats, field))
            families.append(family)
        families += _chain_families(pairs, saved=saved)
    entries = GaugeMetricFamily(f"{PREFIX}_entries", "entries the tier holds (where it can tell cheaply)", labels=labels)
    held = GaugeMetricFamily(f"{PREFIX}_held_bytes", "bytes the tier holds (where it can tell cheaply)", labels=labels)
    latency = GaugeMetricFamily(
        f"{PREFIX}_latency_seconds",
        "recorded latency quantile of one get or put, over the last 2048 of each (not a histogram: "
        "that would cost the lookup path)",
        labels=[*labels, "op", "quantile"],
    )
    for cache_name, snapshot in pairs:
        for tier, tier_stats in snapshot.tiers:
            if tier_stats.entries is not None:
                entries.add_metric([cache_name, tier], tier_stats.entries)
            if tier_stats.bytes_held is not None:
                held.add_metric([cache_name, tier], tier_stats.bytes_held)
            if counters:
                for op, field, quantile in _LATENCY:
                    ms = getattr(tier_stats, field)
                    if ms is not None:
                        latency.add_metric([cache_name, tier, op, quantile], ms / 1e3)
    families += [entries, held]
    if counters:
        families.append(latency)
        flight = CounterMetricFamily(f"{PREFIX}_flight_decisions", "missed compiles by the flight decision across "
                                     "nodes they ended in (docs/cluster.md)", labels=["cache", "decision"])
        for cache_name, snapshot in pairs:
            for decision, n in snapshot.flight.items():
                flight.add_metric([cache_name, decision], n)
        families.append(flight)
    return families


def _chain_families(pairs: list[tuple[str, CacheStats]], *, saved: bool) -> list[Any]:
    """The counters of a chain as a whole, labelled ``cache``: lookups, NVRTC runs, uncacheable (by ``reason``)."""
    from prometheus_client.core import CounterMetricFamily

    lookups = CounterMetricFamily(f"{PREFIX}_lookups", "lookups of the chain (its first tier's hits and misses)",
                                  labels=["cache"])  # fmt: skip
    runs = CounterMetricFamily(f"{PREFIX}_nvrtc_runs", "compiler runs through the chain: compile()'s, uncacheable ones "
                               "and Program.compile(cache=...)'s misses", labels=["cache"])  # fmt: skip
    uncacheable = CounterMetricFamily(f"{PREFIX}_uncacheable", "compiles that could not be cached (compiled every "
                                      "time), by reason", labels=["cache", "reason"])  # fmt: skip
    seconds = CounterMetricFamily(f"{PREFIX}_compile_seconds_saved", "compile seconds the cache saved: per compile() "
                                  "hit, the compile time its entry's manifest records", labels=["cache"])  # fmt: skip
    unpriced = CounterMetricFamily(f"{PREFIX}_hits_without_compile_time", "compile() hits left out of the seconds "
                                   "saved: no manifest near the node told their compile time",
                                   labels=["cache"])  # fmt: skip
    for cache_name, snapshot in pairs:
        lookups.add_metric([cache_name], snapshot.tiers[0][1].lookups if snapshot.tiers else 0)
        runs.add_metric([cache_name], snapshot.compiles)
        for reason, n in snapshot.compiling.uncacheable:
            uncacheable.add_metric([cache_name, reason], n)
        seconds.add_metric([cache_name], snapshot.compiling.saved_seconds)
        unpriced.add_metric([cache_name], snapshot.compiling.hits_without_compile_time)
    return [lookups, runs, uncacheable, unpriced, *([seconds] if saved else [])]


class _CompileCounts:
    """Compiler runs seen by the ``on_compile`` hook since it was installed: a histogram of seconds, by outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = {True: [0] * len(COMPILE_BUCKETS), False: [0] * len(COMPILE_BUCKETS)}
        self._count = {True: 0, False: 0}
        self._sum = {True: 0.0, False: 0.0}
        self._saved = 0.0

    def saved(self, event: HitEvent) -> None:
        if event.saved_seconds is not None:
            with self._lock:
                self._saved += event.saved_seconds

    def __call__(self, event: CompileEvent) -> None:
        at = bisect.bisect_left(COMPILE_BUCKETS, event.seconds)
        with self._lock:
            self._count[event.ok] += 1
            self._sum[event.ok] += event.seconds
            if at < len(COMPILE_BUCKETS):
                self._buckets[event.ok][at] += 1

    def families(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        runs = HistogramMetricFamily(
            f"{PREFIX}_compile_seconds",
            "wall time of each compiler run by tiered_progcache.compile() (a miss in every tier)",
            labels=["outcome"],
        )
        with self._lock:
            snapshot = {ok: (list(self._buckets[ok]), self._count[ok], self._sum[ok]) for ok in (True, False)}
            saved_total = self._saved
        for ok, (buckets, count, total) in snapshot.items():
            cumulative, rows = 0, []
            for bound, n in zip(COMPILE_BUCKETS, buckets):
                cumulative += n
                rows.append((repr(bound), cumulative))
            rows.append(("+Inf", count))
            runs.add_metric(["ok" if ok else "error"], rows, total)
        saved = CounterMetricFamily(
            f"{PREFIX}_compile_seconds_saved",
            "compile seconds the cache saved: per compile() hit, the compile time its entry's manifest records",
        )
        saved.add_metric([], saved_total)
        return [runs, saved]


class _Collector:
    """One per registry: every cache registered with it (held weakly) and the process's compiler runs.

    Its compile and hit hooks are subscribed while a cache is registered with it: the hit hook reads
    each hit's manifest, so a registry whose caches were all unregistered costs no hit a request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, weakref.ref[TieredProgramCache]] = {}
        self.compiles = _CompileCounts()
        self._unsubscribe: Callable[[], None] | None = None

    def _hooks_follow_caches(self) -> None:
        """Subscribe the hooks if a registered cache is alive, else unsubscribe them (``self._lock`` held)."""
        alive = any(ref() is not None for ref in self._caches.values())
        if alive and self._unsubscribe is None:
            stop_compiles = on_compile(self.compiles)
            stop_hits = on_hit(self.compiles.saved)

            def unsubscribe() -> None:
                stop_compiles()
                stop_hits()

            self._unsubscribe = unsubscribe
        elif not alive and self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def add(self, name: str, cache: TieredProgramCache) -> weakref.ref[TieredProgramCache]:
        """Hold ``cache`` weakly under ``name``; the reference returned is what :meth:`remove` takes."""
        with self._lock:
            live = self._caches.get(name)
            if live is not None and live() is not None:
                raise ValueError(f"a cache named {name!r} is already registered with this registry")
            held = self._caches[name] = weakref.ref(cache)
            self._hooks_follow_caches()
        return held

    def remove(self, name: str, held: weakref.ref[TieredProgramCache]) -> None:
        """Forget ``name`` if it still holds this registration (not a later cache registered under the name)."""
        with self._lock:
            if self._caches.get(name) is held:
                del self._caches[name]
            self._hooks_follow_caches()

    def _live(self) -> Iterator[tuple[str, TieredProgramCache]]:
        with self._lock:
            items = list(self._caches.items())
        for name, ref in items:
            cache = ref()
            if cache is not None:
                yield name, cache

    def collect(self) -> Iterator[Any]:
        yield from stats_families((name, cache.stats()) for name, cache in self._live())
        yield from self.compiles.families()


_collectors: dict[int, tuple[Any, _Collector]] = {}
_collectors_lock = threading.Lock()


def register(cache: TieredProgramCache, registry: Any = None, *, name: str = "default") -> Callable[[], None]:
    """Expose ``cache``'s per-tier counters (and this process's compiler runs) in ``registry``; returns an unregister.

    ``registry`` defaults to prometheus_client's ``REGISTRY``. ``name`` is the ``cache``
    label, so several caches can share one registry (a second cache under a name in use
    is a ``ValueError``). The cache is held weakly, by the registry and by the function
    returned alike: a cache that is gone stops being reported, whoever keeps the unregister.
    While a cache is registered, the registry counts the process's compiler runs and each
    hit's saved seconds (read from its manifest, once per key); once the last is unregistered
    it stops (its counters keep their values).
    """
    from ..chain.tiered import require_chain

    require_chain(cache)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    client = _client()
    if registry is None:
        registry = client.REGISTRY
    with _collectors_lock:
        held = _collectors.get(id(registry))
        if held is None or held[0] is not registry:
            collector = _Collector()
            registry.register(collector)
            _collectors[id(registry)] = (registry, collector)
        else:
            collector = held[1]
        held = collector.add(name, cache)

    def unregister() -> None:  # holds the weak reference only: keeping this function keeps no cache alive
        collector.remove(name, held)

    return unregister


def exposition(stats: CacheStats, *, name: str = "default", counters: bool = True,
               kernels: Mapping[str, int] | None = None) -> str:
    """``stats`` in Prometheus' text format (for node_exporter's textfile collector), with no compile metrics.

    ``tiered-progcache stats --prometheus`` prints this for a directory (its cumulative
    counters and what it holds) or for one ``stats --run`` (the run's summed counters);
    ``counters=False`` gives the gauges alone. ``kernels``: per tier, the kernels it holds
    (``tiered_progcache_kernels``: its entries less manifests and symbol maps, as ``stats`` counts them).
    """
    client = _client()
    registry = client.CollectorRegistry(auto_describe=False)

    class _Static:
        def collect(self) -> list[Any]:
            families = stats_families([(name, stats)], counters=counters, saved=True)
            if kernels:
                from prometheus_client.core import GaugeMetricFamily

                held = GaugeMetricFamily(f"{PREFIX}_kernels", "kernels the tier holds (entries less manifests and "
                                         "symbol maps, as `stats` counts them)", labels=["cache", "tier"])  # fmt: skip
                for tier, n in kernels.items():
                    held.add_metric([name, tier], n)
                families.append(held)
            return families

    registry.register(_Static())
    return client.generate_latest(registry).decode("utf-8")
