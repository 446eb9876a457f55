"""A Redis connection costs one round trip: no ``HELLO``, no ``CLIENT SETINFO`` (a fresh node's first hit waits for one)."""

from __future__ import annotations

import logging
import threading

import pytest

from tiered_progcache.testing.redis_server import RedisServer

pytest.importorskip("redis")

from tiered_progcache.stores.redis_store import RedisProgramCache, _one_round_trip_handshake  # noqa: E402


def _commands_called(admin) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in admin.info("commandstats").items()}


def test_the_tier_connects_with_nothing_but_its_requests():
    with RedisServer() as server:
        admin = server.client()
        admin.ping()  # the admin connection's own handshake is done before the count starts
        admin.config_resetstat()
        tier = RedisProgramCache.from_url(server.url + "/0/handshake", strict=True)
        tier.write_entry("ab" * 32, b"payload")
        assert tier.read_entry("ab" * 32) == b"payload"
        tier.close()
        called = _commands_called(admin)
        admin.close()
    assert not any(name in ("hello", "client") or name.startswith("client|") for name in called), called
    assert called.get("ping") == 2  # the probe, on two connections at once


@pytest.mark.parametrize(("version", "options"), [
    ("8.2.0", {"protocol": 2, "driver_info": None}),
    ("7.2.0", {"protocol": 2, "driver_info": None}),
    ("7.1.1", {"protocol": 2, "lib_name": None, "lib_version": None}),
    ("5.0.8", {"protocol": 2, "lib_name": None, "lib_version": None}),
    ("10.0.0b1", {"protocol": 2, "driver_info": None}),
])
def test_the_options_that_skip_client_setinfo_follow_redis_pys_version(version, options):
    assert _one_round_trip_handshake(version) == options


class _SparePingSeen(RedisProgramCache):
    """The tier, recording the thread its spare ``PING`` runs on (the probe's second connection)."""

    seen: list[tuple[str, bool]] = []

    def _spare_ping(self) -> None:
        thread = threading.current_thread()
        self.seen.append((thread.name, thread.daemon))
        super()._spare_ping()


def test_the_spare_ping_runs_on_a_named_daemon_thread(monkeypatch):
    """A named thread (so a stack dump says what it is) that never holds up interpreter exit."""
    monkeypatch.setattr(_SparePingSeen, "seen", [])
    with RedisServer() as server:
        tier = _SparePingSeen.from_url(server.url + "/0/spare", strict=True)
        tier.close()
    assert _SparePingSeen.seen == [("tiered-progcache-redis-spare", True)]


def test_a_spare_ping_that_fails_raises_nothing_on_its_thread(monkeypatch, caplog):
    """The server is down: the probe's own ``PING`` says so (one WARNING, the breaker open); the spare one's
    failure ends its thread quietly, with no unhandled exception for ``threading.excepthook``."""
    from tiered_progcache.testing.redis_server import free_port

    unhandled: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    monkeypatch.setattr(_SparePingSeen, "seen", [])
    caplog.set_level(logging.WARNING, logger="tiered_progcache")
    tier = _SparePingSeen.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=5)
    try:
        assert tier.wait_ready(60)  # refused at once: the probe, its spare PING and the sample after it are over
        assert not tier.available
    finally:
        tier.close()
    assert [name for name, _ in _SparePingSeen.seen] == ["tiered-progcache-redis-spare"]
    assert unhandled == []
    assert len([r for r in caplog.records if "is unreachable" in r.getMessage()]) == 1


_IMPORTS_SEEN = """
import builtins, sys, threading
seen = {}
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    top = name.split(".")[0]
    if top in ("redis", "fsspec") and top not in sys.modules:  # the thread that imports it first
        seen.setdefault(top, threading.current_thread().name.split(" ")[0])
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
import tiered_progcache as tpc
with tpc.TieredProgramCache(sys.argv[1], remote=sys.argv[2]) as cache:
    cache[b"k" * 32] = b"payload"
    assert cache.flush(60) and cache.get(b"k" * 32, where="shared") == b"payload"
print(sorted(seen.items()))
"""


def test_a_node_on_redis_imports_neither_redis_py_nor_fsspec(tmp_path):
    """A fresh process's Redis tier on a redis:// URL builds the tier's own client (stores/resp.py): redis-py's
    import (100-170 ms of a core) is never paid, and nothing of fsspec is ever imported."""
    import subprocess
    import sys

    with RedisServer() as server:
        done = subprocess.run([sys.executable, "-c", _IMPORTS_SEEN, str(tmp_path / "node"), server.url + "/0/imports"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_client_is_built_with_the_tiers_deadline_as_its_socket_timeouts():
    """The tier's own client for a URL it serves, redis-py's for one it does not (TLS): each with the deadline."""
    from tiered_progcache.stores.redis_store import _RedisClients
    from tiered_progcache.stores.resp import RespClient

    served = _RedisClients("redis://127.0.0.1:1/0", 2.5).build()
    assert type(served) is RespClient and served.connection_pool.timeout == 2.5
    client = _RedisClients("rediss://127.0.0.1:1/0", 2.5).build()
    kwargs = client.connection_pool.connection_kwargs
    assert type(client).__module__ == "redis.client"
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (2.5, 2.5)
    assert kwargs["protocol"] == 2  # redis-py's connection costs one round trip too: no HELLO 3


def test_closing_disconnects_a_built_client_and_builds_none():
    """A built client's pooled connections are closed; a tier whose client was never built (its breaker open
    from the start: no probe) closes without building one."""
    from tiered_progcache.stores.breaker import CircuitBreaker

    with RedisServer() as server:
        tier = RedisProgramCache.from_url(server.url + "/0/close", strict=True)
        tier.write_entry("ab" * 32, b"payload")
        pool = tier._runner.built.connection_pool
        kept = list(pool._idle)
        assert kept and all(c.sock.fileno() != -1 for c in kept)
        tier.close()
        assert pool.idle() == 0 and all(c.sock.fileno() == -1 for c in kept)
    down = CircuitBreaker(name="down")
    down.trip(ConnectionError("down before the probe"))
    never = RedisProgramCache.from_url("redis://127.0.0.1:1/0", breaker=down)
    assert never.wait_ready(30) and never._runner.built is None
    never.close()
    assert never._runner.built is None


_HANDED_IN = """
import sys, redis
from tiered_progcache.stores.redis_store import RedisProgramCache
tier = RedisProgramCache(redis.Redis.from_url(sys.argv[1]), url=sys.argv[1] + "/handed", strict=True)
tier.write_entry("ab" * 32, b"payload")
assert tier.read_entry("ab" * 32) == b"payload"
tier.close()
print(tier._runner.is_async, "fsspec" in sys.modules)
"""


def test_a_client_handed_in_runs_as_a_blocking_one_in_a_process_that_never_imported_fsspec():
    import subprocess
    import sys

    with RedisServer() as server:
        done = subprocess.run([sys.executable, "-c", _HANDED_IN, server.url + "/0"], capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False False"  # run on threads (never an fsspec loop), fsspec never imported


def test_a_refused_connection_names_the_tier_and_what_redis_py_said():
    with pytest.raises(ConnectionError) as refused:
        RedisProgramCache.from_url("redis://127.0.0.1:1/0/refused", timeout=5, strict=True)
    assert str(refused.value).startswith("redis cache redis://127.0.0.1:1/0/refused is unreachable: ConnectionError: "
                                         "redis://127.0.0.1:1/0/refused: Error ")
