"""A Redis server that dies (SIGKILL) or hangs (SIGSTOP): compiles go on, the breaker opens, reads resume when it is back."""

from __future__ import annotations

import signal
import time

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.redis_server import RedisServer

pytest.importorskip("redis")

from tiered_progcache.stores.redis_store import RedisProgramCache  # noqa: E402
from support import FakeClock  # noqa: E402
from support import compile_matmul as _compile  # noqa: E402


def _chain(tmp_path, tier):
    return TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "node"), tier])


def test_a_killed_server_compiles_go_on_the_breaker_opens_and_reads_resume(tmp_path):
    clock = FakeClock()
    with RedisServer() as server:
        breaker = CircuitBreaker(3, 30.0, name="redis", clock=clock)
        tier = RedisProgramCache.from_url(server.url, timeout=2, strict=True, breaker=breaker)
        chain = _chain(tmp_path, tier)
        first = _compile(chain, 16)
        assert chain.flush(timeout=30) and chain.stats()["remote"].writes == 1

        server.kill()  # SIGKILL: connections reset, the port refuses
        compiled = []
        for tile, epilogue in ((32, "identity"), (16, "relu"), (32, "relu")):
            compiled.append(_compile(chain, tile, epilogue))
            assert chain.flush(timeout=30)  # one request at a time: the counts below are exact
        assert all(c.startswith(b"\x7fELF") for c in compiled)  # NVRTC ran; the dead tier cost misses
        redis_stats = chain.stats()["remote"]
        assert redis_stats.timeouts == 0, redis_stats  # refused connections fail at once: no deadline waited
        assert redis_stats.hits == 0 and redis_stats.writes == 1
        assert redis_stats.errors == 3, redis_stats  # three failures open the breaker...
        assert redis_stats.skipped == 3, redis_stats  # ...and the rest are skipped without a request
        assert breaker.state == "open" and tier.available is False
        assert chain.get(b"never written") is None  # a lookup while it is down: skipped, no error
        assert chain.stats()["remote"].skipped == 4

        server.start()  # back on the same port, empty (no persistence)
        RedisProgramCache.from_url(server.url, strict=True).write_entry(entry_name(b"seeded"), b"from CI")
        assert chain.get(b"seeded") is None  # still cooling down: not asked
        clock.now += 30.0
        assert breaker.state == "half-open"
        assert chain.get(b"seeded") == b"from CI"  # the probe reads, the breaker closes
        assert breaker.state == "closed" and tier.available is True
        assert chain.stats()["remote"].hits == 1
        _compile(chain, 16, "relu")  # in memory already
        chain[b"after"] = b"written again"
        assert chain.flush(timeout=30)
        assert tier.read_entry(entry_name(b"after")) == b"written again"
        chain.close()
        assert first.startswith(b"\x7fELF")


def test_a_hung_server_costs_one_deadline_per_request_until_the_breaker_opens(tmp_path):
    clock = FakeClock()
    with RedisServer() as server:
        breaker = CircuitBreaker(3, 30.0, name="redis", clock=clock)
        # 1 s: the write before the stop and the read after it must not run out of time on a loaded machine.
        tier = RedisProgramCache.from_url(server.url, timeout=1.0, strict=True, breaker=breaker)
        tier.write_entry(entry_name(b"k"), b"v")
        # The boot fetch off: its listing would be one more of the three failures that open the breaker.
        chain = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "node"), tier],
                                   boot_fetch_bytes=0)
        server.process.send_signal(signal.SIGSTOP)  # alive, accepting, never answering
        try:
            started = time.monotonic()
            for n in range(5):
                assert chain.get(b"k%d" % n) is None
            elapsed = time.monotonic() - started
            stats = chain.stats()["remote"]
            assert (stats.timeouts, stats.skipped) == (3, 2), stats
            assert elapsed >= 3 * 1.0, elapsed  # three deadlines waited; the two skipped waited for nothing
        finally:
            server.process.send_signal(signal.SIGCONT)
        clock.now += 30.0
        assert chain.get(b"k") == b"v"  # the probe finds the server answering again
        assert breaker.state == "closed"
        chain.close()


def test_an_unreachable_server_at_start_runs_the_chain_without_it(tmp_path):
    from tiered_progcache.testing.redis_server import free_port

    tier = RedisProgramCache.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=1)
    assert tier.wait_ready(60) and tier.available is False
    chain = _chain(tmp_path, tier)
    cubin = _compile(chain, 16)
    assert cubin.startswith(b"\x7fELF")
    assert chain.flush(timeout=30)
    stats = chain.stats()["remote"]
    assert (stats.skipped, stats.errors, stats.hits) == (2, 1, 0)  # the read and the write skipped; the probe at start an error
    chain.close()


def test_a_lookup_that_waits_for_the_probe_is_the_first_round_trip_on_a_connection_it_opened():
    """A fresh node's first lookup arrives while the probe runs: it goes out on a connection the probe opened
    once the probe has answered, and it is R's first sample. The probe PINGs on two connections at once (the
    two a fresh node's first hit uses side by side); no third PING."""
    import threading

    import redis

    from test_background_probe import _watch_waits_for

    entered, gate = threading.Event(), threading.Event()

    class GatedPing(redis.Redis):  # the real client; the first PING (the probe's) waits for the test's word
        def ping(self, **kwargs):
            if not entered.is_set():
                entered.set()
                gate.wait(60)
            return super().ping(**kwargs)

    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)

        def counts() -> tuple[int, int, int]:
            stats, commands = admin.info("stats"), admin.info("commandstats")
            return (stats["total_connections_received"], commands.get("cmdstat_ping", {}).get("calls", 0),
                    commands.get("cmdstat_getrange", {}).get("calls", 0))

        before = counts()
        client = GatedPing.from_url(server.url, socket_timeout=30, socket_connect_timeout=30)
        tier = RedisProgramCache(client, url=server.url, timeout=30)
        reader = threading.Thread(target=tier.verify_entry, args=(entry_name(b"k"),))
        try:
            done = _watch_waits_for(tier.runner)  # the probe's PING is held: it has not ended
            reader.start()
            assert entered.wait(60)
            assert done.waited_on_by(reader), "the lookup never waited for the probe"
        finally:
            gate.set()
        reader.join(60)
        try:
            assert tier.wait_ready(60)
            _, pings, reads = (now - then for now, then in zip(counts(), before))
            # The connections are not counted: whether the two PINGs overlap on loopback is the scheduler's call.
            assert (pings, reads, tier.runner.latency.recorded) == (2, 1, 1)
        finally:
            tier.close()


def test_the_probes_ping_opens_the_connection_and_the_next_ping_is_the_first_round_trip():
    """Of the PINGs a new store sends (the probe's two at once, then one on a connection they opened), only the
    last is a sample of ``R``: the probe's carry the connections' setup."""
    import redis

    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)

        def pings() -> int:
            return admin.info("commandstats").get("cmdstat_ping", {}).get("calls", 0)

        before = pings()  # the server's own start checks it answers
        tier = RedisProgramCache.from_url(server.url, timeout=30)
        try:
            assert tier.wait_ready(60)
            assert (pings() - before, tier.runner.latency.recorded) == (3, 1)
        finally:
            tier.close()


@pytest.mark.parametrize("query", ["", "?socket_keepalive=true"], ids=["own client", "redis-py"])
def test_a_dead_server_is_a_connection_error_naming_the_tier_from_either_client(query):
    """The tier's own client and redis-py (a URL with query options) fail alike: a refused connection is
    ``ConnectionError`` naming the tier's location, whichever client's own exception it was."""
    with RedisServer() as server:
        tier = RedisProgramCache.from_url(server.url + "/0" + query, timeout=2, strict=True)
        tier.write_entry("ab" * 32, b"payload")
        server.kill()  # SIGKILL: connections reset, the port refuses
        with pytest.raises(ConnectionError) as raised:
            tier.read_entry("ab" * 32)  # the pooled connection reset or replaced: the reconnect is refused
        assert type(raised.value) is ConnectionError and str(raised.value).startswith(f"{server.url}/0")
        tier.close()


def test_without_redis_py_a_redis_url_is_served_by_the_tiers_own_client(monkeypatch):
    """redis-py is needed only for the URLs it alone serves: a plain redis:// tier builds and answers without it."""
    import sys

    with RedisServer() as server:  # (the server's own start-up check uses redis-py)
        monkeypatch.setitem(sys.modules, "redis", None)  # what both the import and find_spec see as not installed
        tier = RedisProgramCache.from_url(server.url + "/0", timeout=5, strict=True)
        tier.write_entry("cd" * 32, b"payload")
        assert tier.read_entry("cd" * 32) == b"payload"
        tier.close()
