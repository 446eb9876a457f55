"""The ProgramCacheResource, EntryStore and LeaseStore contracts, and the Redis tier's own promises, against a real redis-server."""

from __future__ import annotations

import logging

import pytest

from tiered_progcache.stores.envelope import EnvelopeCodec
from tiered_progcache.errors import EntryRejected
from tiered_progcache.stores.store import BatchWrite, entry_name
from tiered_progcache.testing import EntryStoreTests, LeaseStoreTests, ProgramCacheContract, keyed_chain
from tiered_progcache.testing.redis_server import RedisServer, redis_server, redis_url  # noqa: F401

from support import RedisBackDoor

pytest.importorskip("redis")

from tiered_progcache.stores.redis_store import RedisProgramCache, check_redis_url, is_redis_url  # noqa: E402

KEY = b"contract-signing-key-0123456789ab"


class TestRedisContract(ProgramCacheContract):
    @pytest.fixture
    def cache(self, redis_url):
        with keyed_chain(RedisProgramCache.from_url(redis_url, strict=True)) as c:
            yield c


class TestRedisSignedCompressedContract(ProgramCacheContract):
    """Signing and zstd change the bytes in Redis, never what the mapping API returns."""

    @pytest.fixture
    def cache(self, redis_url):
        pytest.importorskip("zstandard")
        with keyed_chain(RedisProgramCache.from_url(redis_url, signing_key=KEY, compression="zstd", strict=True)) as c:
            yield c


class _OnRedis:
    """The session's redis-server (flushed per test), seen through a raw redis-py client; ``prefix`` in the URL's path."""

    prefix = ""

    @pytest.fixture
    def url(self, redis_url):
        return redis_url + (f"/{self.prefix}" if self.prefix else "")

    @pytest.fixture
    def store(self, url):
        with RedisProgramCache.from_url(url, strict=True) as s:
            yield s

    @pytest.fixture
    def read_only_store(self, url, store):
        with RedisProgramCache.from_url(url, read_only=True, strict=True) as s:
            yield s

    @pytest.fixture
    def back_door(self, redis_server):  # noqa: F811
        client = redis_server.client()
        yield RedisBackDoor(client, self.prefix or "tiered-progcache")
        client.close()


class TestRedisStore(_OnRedis, EntryStoreTests):
    pass


class TestRedisStoreUnderPrefix(_OnRedis, EntryStoreTests):
    prefix = "team-a/cuda13"


class TestRedisLeases(_OnRedis, LeaseStoreTests):
    pass


class TestRedisLeasesUnderPrefix(_OnRedis, LeaseStoreTests):
    prefix = "team-a/cuda13"


@pytest.fixture
def client(redis_server):  # noqa: F811
    c = redis_server.client()
    yield c
    c.close()


NAME = entry_name(b"k")


def test_keys_are_namespaced_by_the_urls_prefix(redis_url, client):
    with RedisProgramCache.from_url(redis_url + "/ci", strict=True) as a, RedisProgramCache.from_url(
        redis_url.replace("/0", "/0?prefix=other"), strict=True
    ) as b:
        a.write_entry(NAME, b"one")
        assert sorted(client.keys("*")) == [f"ci:entries:{NAME}".encode()]
        with pytest.raises(KeyError):
            b.read_entry(NAME)  # another prefix is another cache
        assert [e.name for e in a.iter_entries()] == [NAME]
        assert list(b.iter_entries()) == []


def test_a_glob_in_the_prefix_lists_only_its_own_keys(redis_url, client):
    with RedisProgramCache.from_url(redis_url + "/a*", strict=True) as star:
        star.write_entry(NAME, b"x")
        client.set(f"ab:entries:{entry_name(b'other')}", b"y")
        assert [e.name for e in star.iter_entries()] == [NAME]


def test_default_prefix_and_url_checks():
    assert is_redis_url("redis://h:6379/0") and is_redis_url("rediss://h/0") and is_redis_url("unix:///tmp/r.sock")
    assert not is_redis_url("s3://bucket/k") and not is_redis_url("redis:/x") and not is_redis_url(None)
    with pytest.raises(ValueError, match="database number"):
        check_redis_url("redis://h:6379/notadb")
    with pytest.raises(ValueError, match="not a Redis URL"):
        check_redis_url("s3://b")


def test_iter_entries_scans_many_keys_with_sizes(redis_url):
    with RedisProgramCache.from_url(redis_url, strict=True) as s:
        names = {entry_name(str(n)): bytes(n % 7) for n in range(2500)}  # more than one SCAN step and one DEL
        assert s.write_many(names) == BatchWrite(frozenset(names))
        listed = {e.name: e.size for e in s.iter_entries()}
        assert set(listed) == set(names)
        assert listed[entry_name("6")] == len(s._codec.seal(entry_name("6"), bytes(6)))
        assert s.delete_entries([e for e in s.iter_entries()]) == 2500
        assert list(s.iter_entries()) == []


def test_read_many_and_write_many(redis_url, client):
    with RedisProgramCache.from_url(redis_url, strict=True) as s:
        a, b, c = (entry_name(x) for x in ("a", "b", "c"))
        assert s.write_many({a: b"A", b: b"B"}) == BatchWrite(frozenset({a, b}))
        client.set(f"tiered-progcache:entries:{b}", b"garbage")
        got = s.read_many([a, b, c])
        assert got.hits == {a: b"A"} and got.missing == {c} and set(got.errors) == {b}
        assert isinstance(got.errors[b], EntryRejected)


def test_corrupt_and_forged_values_are_rejected_and_counted(redis_url, client):
    from tiered_progcache import TieredProgramCache

    key = b"k" * 32
    name = entry_name(key)
    redis_key = f"tiered-progcache:entries:{name}"
    with RedisProgramCache.from_url(redis_url, signing_key=KEY, strict=True) as tier:
        cache = TieredProgramCache(tiers=[tier])
        tier.write_key(key, b"the real cubin")
        # corrupt: one byte of the body flipped
        good = client.get(redis_key)
        client.set(redis_key, good[:-1] + bytes([good[-1] ^ 1]))
        assert cache.get(key) is None
        # forged: a well-formed envelope signed with another key
        client.set(redis_key, EnvelopeCodec(b"attacker-key").seal(name, b"evil"))
        assert cache.get(key) is None
        # forged: unsigned, right digest
        client.set(redis_key, EnvelopeCodec().seal(name, b"evil"))
        assert cache.get(key) is None
        # replayed: a good envelope of another entry
        client.set(redis_key, EnvelopeCodec(KEY).seal(entry_name(b"other"), b"evil"))
        assert cache.get(key) is None
        # not a string at all
        client.delete(redis_key)
        client.hset(redis_key, "f", "v")
        assert cache.get(key) is None
        stats = cache.stats()["remote"]
        assert (stats.rejected, stats.hits, stats.errors) == (5, 0, 0)
        assert tier.breaker.state == "closed"  # a bad value is an answer, not an outage


def _sent_bytes_of(client, action) -> int:
    """Bytes the server sent while ``action()`` ran (its own counter, reset first; the reset's ``+OK`` included)."""
    client.config_resetstat()
    action()
    return int(client.info("stats")["total_net_output_bytes"])


@pytest.mark.parametrize(
    "planted",
    [
        b"x" * 10_000_000,  # no envelope at all
        EnvelopeCodec(max_entry_bytes=10_000_000).seal(NAME, bytes(10_000_000)),  # an honest header over the cap
        EnvelopeCodec().seal(NAME, b"y" * 1000) + bytes(10_000_000),  # a header within the cap, then junk
    ],
    ids=["garbage", "header-over-cap", "cap-header-then-junk"],
)
def test_a_value_over_the_cap_is_refused_unread(redis_url, client, planted):
    with RedisProgramCache.from_url(redis_url, max_entry_bytes=1000, strict=True) as tier:
        client.set(f"tiered-progcache:entries:{NAME}", planted)

        def lookup() -> None:
            with pytest.raises(EntryRejected):
                tier.read_entry(NAME)

        # header + signature + the 1000-byte cap + one byte, and the reply's framing: never the 10 MB
        assert _sent_bytes_of(client, lookup) < 1121 + 32
        assert tier.verify_entry(NAME).startswith(f"{len(planted)} bytes stored, more than the 1120-byte cap")
        tier.write_entry(NAME, b"y" * 1000)  # exactly the cap reads back
        assert tier.read_entry(NAME) == b"y" * 1000
        assert tier.breaker.consecutive_failures == 0


def test_expiry_is_set_on_each_write(redis_url, client):
    with RedisProgramCache.from_url(redis_url, expire_s=3600, strict=True) as tier:
        tier.write_entry(NAME, b"x")
        assert 3_599_000 < client.pttl(f"tiered-progcache:entries:{NAME}") <= 3_600_000
        other = entry_name(b"o")
        assert tier.create_entry(other, b"y") is True
        assert 3_599_000 < client.pttl(f"tiered-progcache:entries:{other}") <= 3_600_000
        assert tier.write_many({other: b"z"}) == BatchWrite(frozenset({other}))
        assert 3_599_000 < client.pttl(f"tiered-progcache:entries:{other}") <= 3_600_000
    with RedisProgramCache.from_url(redis_url, strict=True) as forever:
        forever.write_entry(NAME, b"x")
        assert client.pttl(f"tiered-progcache:entries:{NAME}") == -1  # no expiry unless asked


def test_a_tiny_expiry_makes_the_entry_go(redis_url, client):
    with RedisProgramCache.from_url(redis_url, expire_s=0.001, strict=True) as tier:
        tier.write_entry(NAME, b"x")
        # Redis's own clock: the key's TTL was 1 ms; once it reports the key gone (-2), reads miss.
        ttl = client.pttl(f"tiered-progcache:entries:{NAME}")
        assert ttl in (-2, 0, 1)
        polls = 0
        while client.pttl(f"tiered-progcache:entries:{NAME}") != -2:  # Redis's clock, not ours: -2 once expired
            polls += 1
            assert polls < 100_000, "Redis never expired a 1 ms key"
        with pytest.raises(KeyError):
            tier.read_entry(NAME)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_bad_expiry_is_a_valueerror(redis_url, bad):
    with pytest.raises(ValueError, match="expire_s"):
        RedisProgramCache.from_url(redis_url, expire_s=bad)
    with pytest.raises(TypeError, match="expire_s"):
        RedisProgramCache.from_url(redis_url, expire_s="60")


def test_read_only_refuses_writes(redis_url, client):
    with RedisProgramCache.from_url(redis_url, strict=True) as writer:
        writer.write_entry(NAME, b"x")
    with RedisProgramCache.from_url(redis_url, read_only=True, strict=True) as tier:
        assert tier.read_entry(NAME) == b"x"
        for attempt in (
            lambda: tier.write_entry(NAME, b"y"),
            lambda: tier.create_entry(NAME, b"y"),
            lambda: tier.delete_entry(NAME),
            lambda: tier.write_many({NAME: b"y"}),
            lambda: tier.clear(),
        ):
            with pytest.raises(PermissionError, match="read-only"):
                attempt()
        assert tier.leases() is None
        assert client.get(f"tiered-progcache:entries:{NAME}") is not None
        assert tier.read_entry(NAME) == b"x"


def test_password_never_shows(caplog):
    with RedisServer(requirepass="s3cr3t-pw") as server:
        url = server.url
        assert "s3cr3t-pw" in url
        with RedisProgramCache.from_url(url, strict=True) as tier:
            tier.write_entry(NAME, b"x")
            assert tier.read_entry(NAME) == b"x"
            assert "s3cr3t-pw" not in repr(tier) + tier.location + tier.leases().location
            assert tier.location == f"redis://:***@127.0.0.1:{server.port}/0"  # a password is set, not shown
        wrong = url.replace("s3cr3t-pw", "wrong-pw")
        with caplog.at_level(logging.WARNING):
            tier = RedisProgramCache.from_url(wrong)
            assert tier.wait_ready(60)  # the probe runs beside the constructor
        assert tier.available is False
        with pytest.raises(PermissionError, match="access denied, check the password") as info:
            RedisProgramCache.from_url(wrong, strict=True)
        assert "wrong-pw" not in str(info.value) + caplog.text + repr(tier)


def test_unreachable_at_construction_warns_and_opens_the_breaker(caplog):
    from tiered_progcache.testing.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING):
        tier = RedisProgramCache.from_url(url, timeout=1)
        assert tier.wait_ready(60)  # the probe runs beside the constructor
    assert tier.available is False and "unreachable" in caplog.text
    with pytest.raises(ConnectionError, match="unreachable"):
        RedisProgramCache.from_url(url, timeout=1, strict=True)


@pytest.mark.parametrize("url", ["rediss://127.0.0.1:1/0", "redis://127.0.0.1:1/0?ssl_cert_reqs=none"])
def test_missing_redis_py_names_the_extra_where_only_it_serves_the_url(monkeypatch, url):
    """At construction, though the client is built (and redis-py imported) only on first use."""
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)  # what both the import and find_spec see as not installed
    with pytest.raises(ImportError, match=r"tiered-progcache\[redis\]") as raised:
        RedisProgramCache.from_url(url)
    assert str(raised.value) == ("a rediss:// URL, a Redis URL with query options, or a client handed in needs "
                                 "redis-py: pip install 'tiered-progcache[redis]'")


@pytest.mark.parametrize("bad", [0, -2, float("inf"), "5"])
def test_bad_timeout(bad):
    with pytest.raises((TypeError, ValueError), match="timeout"):
        RedisProgramCache.from_url("redis://127.0.0.1:1/0", timeout=bad)


def test_lease_store_is_set_nx_px(redis_url, client):
    with RedisProgramCache.from_url(redis_url, strict=True) as tier:
        leases = tier.leases()
        assert leases.atomic_create is True
        assert leases.create("L", b"doc1", ttl_s=60) is True
        assert leases.create("L", b"doc2", ttl_s=60) is False
        assert leases.read("L") == b"doc1"
        assert 59_000 < client.pttl("tiered-progcache:leases:L") <= 60_000
        leases.replace("L", b"doc3", ttl_s=120)
        assert leases.read("L") == b"doc3"
        assert 119_000 < client.pttl("tiered-progcache:leases:L") <= 120_000
        leases.delete("L")
        leases.delete("L")  # no error when gone
        assert leases.read("L") is None
        with pytest.raises(ValueError, match="lease name"):
            leases.create("", b"x", ttl_s=1)
        with pytest.raises(ValueError, match="ttl_s"):
            leases.create("M", b"x", ttl_s=0)


@pytest.fixture(scope="module")
def unix_server():
    with RedisServer(unix_socket=True) as server:
        yield server


class TestRedisOnUnixSocket(EntryStoreTests):
    @pytest.fixture
    def store(self, unix_server):
        server = unix_server
        client = server.client()
        client.flushall()
        client.close()
        assert server.url.startswith("unix://") and server.url.endswith("?db=0")
        with RedisProgramCache.from_url(server.url.replace("?db=0", "?db=0&prefix=sock"), strict=True) as s:
            yield s

    @pytest.fixture
    def read_only_store(self, unix_server, store):
        url = unix_server.url.replace("?db=0", "?db=0&prefix=sock")
        with RedisProgramCache.from_url(url, read_only=True, strict=True) as s:
            yield s

    @pytest.fixture
    def back_door(self, unix_server):
        client = unix_server.client()
        yield RedisBackDoor(client, "sock")
        client.close()


def test_an_empty_or_bad_value_is_listed_and_verify_names_it(redis_url, client):
    with RedisProgramCache.from_url(redis_url, strict=True) as tier:
        tier.write_entry(NAME, b"good")
        empty = entry_name(b"empty")
        client.set(f"tiered-progcache:entries:{empty}", b"")
        client.set("tiered-progcache:entries:not-an-entry-name", b"x")  # never listed
        assert {e.name: e.size for e in tier.iter_entries()} == {NAME: len(client.get(f"tiered-progcache:entries:{NAME}")), empty: 0}
        assert tier.verify_entry(NAME) is None
        assert tier.verify_entry(empty).startswith("truncated: 0 bytes")
        with pytest.raises(KeyError):  # a lookup's one GETRANGE cannot tell it from an absent key: a miss
            tier.read_entry(empty)


def test_close_leaves_a_request_in_flight_on_its_connection(redis_url):
    """A lease release can still be running on another thread when its cache closes."""
    store = RedisProgramCache.from_url(redis_url)
    store.write_entry("ab" * 32, b"x")  # a pooled connection exists now
    pool = store.client.connection_pool
    in_flight = pool._take()  # taken by a request under way
    socket_before = in_flight.sock  # closing it under a reader is the failure
    store.close()
    assert in_flight.sock is socket_before and socket_before.fileno() != -1
    assert in_flight.request([("PING",)]) == [b"PONG"]
    in_flight.close()
    assert store.read_entry("ab" * 32) == b"x"  # and a later call reconnects
    store.close()
