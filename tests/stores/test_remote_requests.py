"""Requests per remote operation, counted below the tier: a lookup is one request, hit or miss, on every store.

S3 is counted on the wire (moto behind ``DelayProxy(keep_alive=True)``, which counts HTTP
requests and TCP connections) and by botocore's ``before-send`` event (which request);
GCS by an aiohttp trace on gcsfs's session; Redis by the server's own ``INFO
commandstats``; memory:// by the filesystem's calls and file:// by Python's audit events.
A test gets a private filesystem instance (``skip_instance_cache``), so counts are its own.
Chains that count one lookup turn the boot fetch off (``boot_fetch_bytes=0``); the compile
test counts a fresh node with it.
The figures are the table in docs/performance.md.
"""

from __future__ import annotations

import collections
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache
from fsspec.implementations.memory import MemoryFileSystem

import tiered_progcache
from tiered_progcache import EntryRejected, TieredProgramCache
from tiered_progcache.stores.envelope import FIRST_READ_BYTES, HEADER_SIZE
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.delayproxy import DelayProxy
from tiered_progcache.testing.redis_server import redis_server, redis_url  # noqa: F401
from tiered_progcache.stores.gcsjson import GcsJsonCalls
from tiered_progcache.stores.objectstore import ObjectStoreCalls
from tiered_progcache.testing.servers import gcs_bucket, gcs_server, moto_server, s3_bucket  # noqa: F401

#: The largest unsigned, uncompressed payload whose envelope one first read takes whole.
ONE_READ_PAYLOAD = FIRST_READ_BYTES - HEADER_SIZE - 1


class S3Wire:
    """moto behind a keep-alive delay proxy: ``requests`` and ``connections`` as the wire sees them."""

    def __init__(self, proxy: DelayProxy, url: str, options: dict[str, Any]) -> None:
        self.proxy, self.url, self.options = proxy, url, options
        self._watched_from = 0

    def watch(self, remote: RemoteProgramCache) -> None:
        """Log what each request was, as the proxy saw it (every request of this wire is the watched client's)."""
        self._watched_from = len(self.proxy.sent)

    @property
    def sent(self) -> list[tuple[str, str]]:
        """(method, "entry" | "lease" | "bucket") per request since :meth:`watch`."""
        return [(sent.method, "entry" if "/entries/" in sent.path else "lease" if "/leases/" in sent.path else "bucket")
                for sent in self.proxy.sent[self._watched_from:]]

    def sent_during(self, action: Any) -> int:
        """Requests the watched client sent during ``action`` (this process's other caches excluded)."""
        before = len(self.sent)
        action()
        return len(self.sent) - before

    def requests_during(self, action: Any) -> int:
        before = self.proxy.requests
        action()
        return self.proxy.requests - before


@pytest.fixture
def s3_wire(s3_bucket, moto_server) -> Iterator[S3Wire]:  # noqa: F811
    upstream = urlsplit(moto_server.endpoint_url)
    with DelayProxy(upstream.hostname, upstream.port, keep_alive=True) as proxy:
        options = dict(s3_bucket.storage_options, endpoint_url=proxy.endpoint_url, skip_instance_cache=True)
        yield S3Wire(proxy, s3_bucket.url, options)


def _remote_of(cache: TieredProgramCache) -> RemoteProgramCache:
    remote = cache.shared_store
    assert isinstance(remote, RemoteProgramCache)
    return remote


def _miss(cache: TieredProgramCache, key: bytes) -> None:
    assert cache.get(key) is None


# -- S3 (moto) ------------------------------------------------------------------------------------


def test_s3_a_remote_miss_and_a_remote_hit_are_one_get_each_through_the_chain(s3_wire, tmp_path):
    writer = RemoteProgramCache.from_url(s3_wire.url, storage_options=s3_wire.options, strict=True)
    writer.write_key(b"present", b"a cubin" * 10_000)
    with TieredProgramCache(tmp_path / "node", remote=s3_wire.url, remote_options=s3_wire.options,
                            strict=True, boot_fetch_bytes=0) as cache:
        s3_wire.watch(_remote_of(cache))
        assert s3_wire.requests_during(lambda: _miss(cache, b"absent")) == 1
        assert s3_wire.requests_during(lambda: cache.get(b"present")) == 1
        assert s3_wire.requests_during(lambda: cache.get(b"present")) == 0  # now in memory
        assert s3_wire.sent == [("GET", "entry"), ("GET", "entry")]
        stats = cache.stats()["remote"]
        assert (stats.hits, stats.misses, stats.errors) == (1, 1, 0)


def test_s3_an_envelope_past_the_first_read_takes_exactly_one_more_get(s3_wire):
    remote = RemoteProgramCache.from_url(s3_wire.url, storage_options=s3_wire.options, strict=True)
    remote.write_entry("ab" * 32, bytes(ONE_READ_PAYLOAD))  # an envelope of FIRST_READ_BYTES - 1
    remote.write_entry("cd" * 32, bytes(ONE_READ_PAYLOAD + 1))  # one byte more
    assert s3_wire.requests_during(lambda: remote.read_entry("ab" * 32)) == 1
    assert s3_wire.requests_during(lambda: remote.read_entry("cd" * 32)) == 2
    assert remote.read_entry("cd" * 32) == bytes(ONE_READ_PAYLOAD + 1)


def test_s3_an_empty_object_is_rejected_in_one_get_and_is_not_a_failure(s3_wire, s3_bucket):  # noqa: F811
    remote = RemoteProgramCache.from_url(s3_wire.url, storage_options=s3_wire.options, strict=True)
    name = entry_name(b"empty")
    s3_bucket.fs.pipe_file(s3_bucket.entry_path(name), b"")  # S3 answers a range of it with 416
    for _ in range(4):  # more than the breaker's threshold: an answer, never a failure
        with pytest.raises(EntryRejected, match="truncated: 0 bytes"):
            assert s3_wire.requests_during(lambda: remote.read_entry(name)) == 1
    assert remote.read_envelopes([name]).envelopes == {name: b""}  # the batched path: b"", the codec rejects it
    assert remote.breaker.consecutive_failures == 0


def test_s3_lookups_reuse_one_connection(s3_wire, tmp_path):
    writer = RemoteProgramCache.from_url(s3_wire.url, storage_options=s3_wire.options, strict=True)
    keys = [b"reuse-%d" % n for n in range(100)]
    for key in keys:
        writer.write_key(key, key * 100)
    with TieredProgramCache(tmp_path / "node", remote=s3_wire.url, remote_options=s3_wire.options,
                            strict=True, boot_fetch_bytes=0) as cache:
        assert _remote_of(cache).wait_ready(60)  # the probe and its round-trip sample opened what it keeps
        connections = s3_wire.proxy.connections
        requests = s3_wire.requests_during(lambda: [cache.get(key) for key in keys])
        requests += s3_wire.requests_during(lambda: [_miss(cache, b"missing-%d" % n) for n in range(100)])
        assert requests == 200
        # 200 lookups over the connections kept (obstore's pool may find one still settling after its last
        # answer and open another: a few at most, never one per lookup).
        assert s3_wire.proxy.connections - connections <= 2


def test_s3_warm_is_one_get_per_entry_over_a_bounded_pool(s3_wire, tmp_path):
    writer = RemoteProgramCache.from_url(s3_wire.url, storage_options=s3_wire.options, strict=True)
    names = []
    for n in range(100):
        key = b"warm-%d" % n
        writer.write_key(key, b"\x7fELF\x02\x01" + bytes(46) + b"\x40\x00" + bytes(10) + key * 50)
        names.append(entry_name(key))
    with TieredProgramCache(tmp_path / "node", remote=s3_wire.url, remote_options=s3_wire.options,
                            strict=True) as cache:
        connections = s3_wire.proxy.connections
        report = {}
        assert s3_wire.requests_during(lambda: report.setdefault("r", cache.warm(names))) == 100
        assert (report["r"].entries, report["r"].failures) == (100, 0)
        # At most a batch's requests at once (transfer_concurrency, 64: obstore runs one per runner thread), not
        # one connection per entry.
        assert s3_wire.proxy.connections - connections <= 64


def test_s3_writes_and_lease_operations_are_one_request_each(s3_wire):
    remote = RemoteProgramCache.from_url(s3_wire.url, storage_options=s3_wire.options, strict=True)
    s3_wire.watch(remote)
    leases = remote.leases()
    assert s3_wire.requests_during(lambda: remote.write_entry("ab" * 32, b"cubin")) == 1
    assert s3_wire.requests_during(lambda: leases.create("k", b"{}", 60)) == 1  # PUT If-None-Match: *
    assert s3_wire.requests_during(lambda: leases.create("k", b"{}", 60)) == 1  # 412: taken, False
    assert s3_wire.requests_during(lambda: leases.read("k")) == 1
    assert s3_wire.requests_during(lambda: leases.replace("k", b"{}", 60)) == 1
    assert s3_wire.requests_during(lambda: leases.delete("k")) == 1
    # obstore deletes through S3's DeleteObjects (a POST to the bucket) even for one key; s3fs sends a DELETE.
    deleted = ("POST", "bucket") if isinstance(remote.fs, ObjectStoreCalls) else ("DELETE", "lease")
    assert s3_wire.sent == [("PUT", "entry"), ("PUT", "lease"), ("PUT", "lease"), ("GET", "lease"),
                            ("PUT", "lease"), deleted]


_HELPERS = ("tiered-progcache-boot-fetch", "tiered-progcache-lease-", "tiered-progcache-release-",
            "tiered-progcache-look-", "tiered-progcache-race-")


@pytest.fixture
def others() -> frozenset[threading.Thread]:
    """The threads alive before the test: other modules' leftovers, never waited for here (one stuck on a
    dead endpoint would hold the test for its whole timeout)."""
    return frozenset(threading.enumerate())


@pytest.fixture
def no_hit_hooks(monkeypatch) -> None:
    """No ``on_hit`` hook subscribed. A Prometheus registry made earlier in the process keeps one for good,
    and with one a remote hit also reads its manifest (once per key: the test below pins that request)."""
    from tiered_progcache.compiling import compile as compile_module

    monkeypatch.setattr(compile_module, "_hit_hooks", [])


def _join_boot_fetch(others: frozenset[threading.Thread]) -> None:
    """Wait for this test's background work of caches already closed (a boot fetch, a raced lookup, a
    lease's release), whose requests would count against the next node's (joined, not slept on)."""
    for _ in range(8):  # a lease's thread starts its release's: look again until none is left
        live = [t for t in threading.enumerate() if t.name.startswith(_HELPERS) and t not in others]
        if not live:
            return
        for helper in live:
            helper.join(60)


def test_compile_on_a_warm_remote_is_one_get_per_kernel_and_one_more_for_symbols(s3_wire, tmp_path, events, others,
                                                                                   no_hit_hooks):
    """Plus, for a node's first kernel of a kind it never timed, four requests (docs/cluster.md, "When nodes wait")."""
    options = ProgramOptions(arch="sm_90", std="c++17")
    plain, templated = matmul_source(16), "template <typename T> __global__ void fill(T* o, T v) { *o = v; }"
    with TieredProgramCache(tmp_path / "writer", remote=s3_wire.url, remote_options=s3_wire.options) as writer:
        tiered_progcache.compile(plain, "c++", options, cache=writer)
        tiered_progcache.compile(templated, "c++", options, cache=writer, name_expressions=["fill<float>"])
        assert writer.flush(60)
    _join_boot_fetch(others)  # the writer's lease releases and boot fetch: their requests are not the node's
    compiled = len(events)
    # A fresh node has timed no compile (the writer's times are this process's).
    from tiered_progcache.cluster.flightpolicy import compile_times

    compile_times.clear()
    # lease_min_compile_rtts=0: no compile is short, so each looks before compiling (the lease case).
    with TieredProgramCache(tmp_path / "fresh", remote=s3_wire.url, remote_options=s3_wire.options,
                            strict=True, lease_min_compile_rtts=0.0, boot_fetch_bytes=0) as fresh:
        s3_wire.watch(_remote_of(fresh))
        before = s3_wire.proxy.requests
        run = fresh.stats()
        tiered_progcache.compile(plain, "c++", options, cache=fresh)
        # The lease case looks before anything else: a hit costs the entry's read alone (one lookup of the
        # remote tier; no lease, listing or probe sent).
        remote = (fresh.stats() - run)["remote"]
        assert (remote.hits, remote.misses, remote.errors) == (1, 0, 0)
        assert s3_wire.sent == [("GET", "entry")]
        # (Counted by the client: a cache another module left open may re-probe a dead endpoint at the port
        # this proxy now has, and the proxy would count that request too.)
        s3_wire.watch(remote)
        # name_expressions: the symbol mapping is a second entry by design (docs/remote-format.md)
        assert s3_wire.sent_during(lambda: tiered_progcache.compile(
            templated, "c++", options, cache=fresh, name_expressions=["fill<float>"])) == 2
        assert s3_wire.sent == [("GET", "entry")] * 2  # a kind it knows: no lease, no probe, no listing on a hit
    assert len(events) == compiled  # every kernel came from the remote


def test_a_fresh_node_with_the_boot_fetch_asks_one_listing_and_one_batch_beside_its_first_kernel(
        s3_wire, tmp_path, events, others, no_hit_hooks):
    """The first kernel's GET, plus one listing and one batch of the rest (an entry and its symbol map;
    manifests stay behind); the second kernel then asks nothing."""
    options = ProgramOptions(arch="sm_90", std="c++17")
    plain, templated = matmul_source(16), "template <typename T> __global__ void fill(T* o, T v) { *o = v; }"
    with TieredProgramCache(tmp_path / "writer", remote=s3_wire.url, remote_options=s3_wire.options) as writer:
        tiered_progcache.compile(plain, "c++", options, cache=writer)
        tiered_progcache.compile(templated, "c++", options, cache=writer, name_expressions=["fill<float>"])
        assert writer.flush(60)
    _join_boot_fetch(others)  # the writer's own boot fetch: its requests are not the node's
    compiled = len(events)
    from tiered_progcache.cluster.flightpolicy import compile_times

    compile_times.clear()
    with TieredProgramCache(tmp_path / "fresh", remote=s3_wire.url, remote_options=s3_wire.options,
                            strict=True, lease_min_compile_rtts=0.0) as fresh:
        s3_wire.watch(_remote_of(fresh))
        before = s3_wire.proxy.requests
        tiered_progcache.compile(plain, "c++", options, cache=fresh)
        _join_boot_fetch(others)
        # One listing and the entries' GETs (the trigger's, then the batch's two), as the client sent them;
        # the client sent nothing else.
        assert collections.Counter(s3_wire.sent) == {("GET", "entry"): 3, ("GET", "bucket"): 1}
        assert (fresh.stats()["remote"].hits, fresh.stats()["remote"].misses) == (1, 0)  # the trigger's read alone
        # (Counted by the client, as above.)
        assert s3_wire.sent_during(lambda: tiered_progcache.compile(
            templated, "c++", options, cache=fresh, name_expressions=["fill<float>"])) == 0
    assert len(events) == compiled


def test_with_an_on_hit_hook_a_remote_hit_also_reads_its_manifest_once(s3_wire, tmp_path, events, others,
                                                                       no_hit_hooks):
    """What ``on_hit`` documents (a Prometheus registry subscribes one): the hook gets the seconds the entry's
    manifest records, so a remote hit reads the manifest too, one GET more, once per key and process."""
    options = ProgramOptions(arch="sm_90", std="c++17")
    with TieredProgramCache(tmp_path / "writer", remote=s3_wire.url, remote_options=s3_wire.options) as writer:
        tiered_progcache.compile(matmul_source(16), "c++", options, cache=writer)
        assert writer.flush(60)
    _join_boot_fetch(others)
    from tiered_progcache.compiling.compile import HitEvent, on_hit

    seen: list[HitEvent] = []
    stop = on_hit(seen.append)
    try:
        with TieredProgramCache(tmp_path / "fresh", remote=s3_wire.url, remote_options=s3_wire.options,
                                strict=True, lease_min_compile_rtts=0.0, boot_fetch_bytes=0) as fresh:
            s3_wire.watch(_remote_of(fresh))
            tiered_progcache.compile(matmul_source(16), "c++", options, cache=fresh)
            assert s3_wire.sent == [("GET", "entry"), ("GET", "entry")]  # the kernel, then its manifest
            assert len(seen) == 1 and seen[0].saved_seconds == pytest.approx(events[0].seconds, abs=1e-6)
            assert s3_wire.sent_during(lambda: tiered_progcache.compile(
                matmul_source(16), "c++", options, cache=fresh)) == 0  # a memory hit; the seconds are memoized
            assert len(seen) == 2 and seen[1].saved_seconds == seen[0].saved_seconds
    finally:
        stop()


# -- GCS (fake-gcs-server) --------------------------------------------------------------------------


class GcsTrace:
    """Every HTTP request and new connection gcsfs's aiohttp session makes (an ``aiohttp.TraceConfig``)."""

    def __init__(self) -> None:
        import aiohttp

        self.requests: list[tuple[str, str]] = []
        self.connections = 0
        self.config = aiohttp.TraceConfig()
        self.config.on_request_start.append(self._on_request)
        self.config.on_connection_create_end.append(self._on_connection)

    async def _on_request(self, session: Any, context: Any, params: Any) -> None:
        self.requests.append((params.method, "entry" if "entries" in str(params.url) else "other"))

    async def _on_connection(self, session: Any, context: Any, params: Any) -> None:
        self.connections += 1

    def requests_during(self, action: Any) -> int:
        before = len(self.requests)
        action()
        return len(self.requests) - before


def test_gcs_json_api_a_miss_a_hit_and_a_put_are_one_request_each_over_the_connections_kept(gcs_bucket, gcs_server,
                                                                                            tmp_path):  # noqa: F811
    """The client a tier on GCS builds (:class:`~tiered_progcache.stores.gcsjson.GcsJsonCalls`), counted on the wire."""
    writer = RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True)
    writer.write_key(b"present", b"a cubin" * 10_000)
    upstream = urlsplit(gcs_server.endpoint_url)
    with DelayProxy(upstream.hostname, upstream.port, keep_alive=True) as proxy:
        options = dict(gcs_bucket.storage_options, endpoint_url=proxy.endpoint_url)
        with TieredProgramCache(tmp_path, remote=gcs_bucket.url, remote_options=options, strict=True,
                                boot_fetch_bytes=0) as cache:
            remote = _remote_of(cache)
            assert isinstance(remote.fs, GcsJsonCalls) and remote.wait_ready(60)
            connections, before = proxy.connections, proxy.requests
            _miss(cache, b"absent")
            cache.get(b"present")
            cache.get(b"present")  # now in memory
            assert [(sent.method, "entries/" in unquote(sent.path), sent.status) for sent in proxy.sent[before:]] == [
                ("GET", True, 404), ("GET", True, 206)]  # the first read of an envelope: a range
            assert "%2Fentries%2F" in proxy.sent[-1].path  # the object's name encoded whole, as the JSON API asks
            before = proxy.requests
            [_miss(cache, b"m-%d" % n) for n in range(100)]
            assert remote.create_entry(entry_name(b"new"), b"payload") is True
            assert remote.create_entry(entry_name(b"new"), b"payload") is False
            assert [(sent.method, sent.status) for sent in proxy.sent[before + 100:]] == [("POST", 200), ("POST", 412)]
            assert proxy.requests - before == 102
            assert proxy.connections - connections <= 2  # the connections kept: a few at most, never one a lookup


def test_gcs_a_remote_miss_and_a_remote_hit_are_one_get_each_over_one_connection(gcs_bucket, tmp_path):  # noqa: F811
    """Through gcsfs (the client where the options ask for what only gcsfs does: here aiohttp's session)."""
    trace = GcsTrace()
    options = dict(gcs_bucket.storage_options, session_kwargs={"trace_configs": [trace.config]},
                   skip_instance_cache=True)
    writer = RemoteProgramCache.from_url(gcs_bucket.url, storage_options=gcs_bucket.storage_options, strict=True)
    writer.write_key(b"present", b"a cubin" * 10_000)
    with TieredProgramCache(tmp_path, remote=gcs_bucket.url, remote_options=options, strict=True, boot_fetch_bytes=0) as cache:
        trace.requests.clear()
        assert trace.requests_during(lambda: _miss(cache, b"absent")) == 1
        assert trace.requests_during(lambda: cache.get(b"present")) == 1
        assert trace.requests == [("GET", "entry"), ("GET", "entry")]
        assert trace.requests_during(lambda: [_miss(cache, b"m-%d" % n) for n in range(100)]) == 100
        assert trace.connections == 2  # the bucket probe's two connections, kept for every lookup


def test_gcs_an_empty_object_is_rejected_in_one_get_and_is_not_a_failure(gcs_bucket):  # noqa: F811
    trace = GcsTrace()
    options = dict(gcs_bucket.storage_options, session_kwargs={"trace_configs": [trace.config]},
                   skip_instance_cache=True)
    remote = RemoteProgramCache.from_url(gcs_bucket.url, storage_options=options, strict=True)
    name = entry_name(b"empty")
    gcs_bucket.fs.pipe_file(gcs_bucket.entry_path(name), b"")
    for _ in range(4):
        with pytest.raises(EntryRejected, match="truncated: 0 bytes"):
            assert trace.requests_during(lambda: remote.read_entry(name)) == 1
    assert remote.breaker.consecutive_failures == 0


# -- memory:// and file:// ------------------------------------------------------------------------------


class CountingMemoryFS(MemoryFileSystem):
    """memory:// with its own store that logs every call that could be a request."""

    cachable = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store, self.pseudo_dirs, self.calls = {}, [""], []

    def _log(name: str):  # noqa: N805 - a decorator factory in the class body
        def wrap(method: Any) -> Any:
            def logged(self: CountingMemoryFS, *args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return method(self, *args, **kwargs)
            return logged
        return wrap

    cat_file = _log("cat_file")(MemoryFileSystem.cat_file)
    _open = _log("open")(MemoryFileSystem._open)
    info = _log("info")(MemoryFileSystem.info)
    exists = _log("exists")(MemoryFileSystem.exists)
    ls = _log("ls")(MemoryFileSystem.ls)


def test_memory_lookups_make_one_call_each(tmp_path):
    fs = CountingMemoryFS()
    remote = RemoteProgramCache(fs, f"/count-{uuid.uuid4().hex}")
    remote.write_key(b"present", b"cubin")
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path), remote], boot_fetch_bytes=0) as cache:
        fs.calls.clear()
        _miss(cache, b"absent")
        assert fs.calls == ["cat_file"]
        fs.calls.clear()
        assert cache.get(b"present") == b"cubin"
        assert fs.calls == ["cat_file"]


_AUDIT_LOCK = threading.Lock()
_audited: list[tuple[str, str]] | None = None
_audit_root = ""


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Record file system events under the watched root (a hook cannot be removed: it is cheap when idle)."""
    if _audited is not None and args and isinstance(args[0], (str, bytes)):
        path = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if path.startswith(_audit_root):
            _audited.append((event, path[len(_audit_root):]))


def test_file_lookups_are_one_open_each_and_nothing_else(tmp_path):
    global _audited, _audit_root
    root = tmp_path / "remote"
    remote = RemoteProgramCache.from_url(root.as_uri(), strict=True)
    remote.write_key(b"present", b"cubin")
    with _AUDIT_LOCK:
        if not getattr(sys, "_tpc_audit_hooked", False):
            sys.addaudithook(_audit)
            sys._tpc_audit_hooked = True  # type: ignore[attr-defined]
        with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"),
                                       remote], boot_fetch_bytes=0) as cache:
            absent, present = entry_name(b"absent"), entry_name(b"present")
            _audit_root, _audited = str(root), []
            try:
                _miss(cache, b"absent")
                assert cache.get(b"present") == b"cubin"
                seen = _audited
            finally:
                _audited = None
    assert seen == [("open", f"/entries/{absent[:2]}/{absent[2:]}"), ("open", f"/entries/{present[:2]}/{present[2:]}")]


# -- Redis ----------------------------------------------------------------------------------------------


def _commands_during(client: Any, action: Any) -> dict[str, int]:
    """Commands the server ran while ``action()`` ran, by name, from its own ``INFO commandstats``."""
    client.config_resetstat()
    action()
    stats = client.info("commandstats")
    return {name[len("cmdstat_"):]: row["calls"] for name, row in stats.items()
            if name not in ("cmdstat_config", "cmdstat_info")}


def test_redis_a_hit_and_a_miss_are_one_getrange_each(redis_url, redis_server, tmp_path):  # noqa: F811
    pytest.importorskip("redis")
    from tiered_progcache.stores.redis_store import RedisProgramCache

    client = redis_server.client()
    with RedisProgramCache.from_url(redis_url, strict=True) as tier:
        tier.write_key(b"present", b"a cubin" * 10_000)
        tier.write_entry("ab" * 32, bytes(ONE_READ_PAYLOAD + 1))
        with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path), tier], boot_fetch_bytes=0) as cache:
            assert _commands_during(client, lambda: _miss(cache, b"absent")) == {"getrange": 1}
            assert _commands_during(client, lambda: cache.get(b"present")) == {"getrange": 1}
            assert _commands_during(client, lambda: tier.read_entry("ab" * 32)) == {"getrange": 2}
            names = [entry_name(b"present"), entry_name(b"absent"), "ab" * 32]
            assert _commands_during(client, lambda: tier.read_many(names)) == {"getrange": 4}  # one pipeline, then the rest
    client.close()
