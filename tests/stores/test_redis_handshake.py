"""A Redis connection costs one round trip: no ``HELLO``, no ``CLIENT SETINFO`` (a fresh node's first hit waits for one)."""

from __future__ import annotations

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
