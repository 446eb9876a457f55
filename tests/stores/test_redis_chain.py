"""Redis in the chain: the four-tier chain memory -> local -> Redis -> S3 with real NVRTC, warm/push and the command on Redis."""

from __future__ import annotations

import json

import pytest
from cuda.core import ProgramOptions

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import transfer
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.compiling.manifest import manifest_name
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.stores.store import BatchWrite, entry_name
from tiered_progcache.testing.redis_server import redis_server, redis_url  # noqa: F401
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401

from support import assert_one_line_error, run_cli

pytest.importorskip("redis")

from tiered_progcache.stores.redis_store import RedisProgramCache  # noqa: E402

OPTIONS = ProgramOptions(std="c++17", arch="sm_90")


def _compile(cache, tile=16, epilogue="identity") -> bytes:
    return bytes(tpc.compile(matmul_source(tile, epilogue), "c++", OPTIONS, cache=cache).code)


def _four_tiers(tmp_path, node, redis_url, bucket, **extra):
    return TieredProgramCache(
        tmp_path / node,
        remote=[redis_url, bucket.url],
        remote_options=bucket.storage_options,
        strict=True,
        **extra,
    )


def test_the_default_chain_has_one_shared_tier_per_url_in_order(tmp_path, redis_url, s3_bucket):
    with _four_tiers(tmp_path, "n", redis_url, s3_bucket, redis_expire_s=60) as cache:
        assert [t.name for t in cache.tiers] == ["memory", "local", "redis", "remote"]
        redis_tier, s3 = cache.shared_stores
        assert isinstance(redis_tier, RedisProgramCache) and isinstance(s3, RemoteProgramCache)
        assert redis_tier.expire_s == 60.0 and cache.shared_store is redis_tier
        assert all(t.policy.shared and t.policy.write == "background" for t in cache.tiers[2:])
    with TieredProgramCache(tmp_path / "m", remote=[redis_url, redis_url + "/other"], strict=True) as two:
        assert [t.name for t in two.tiers] == ["memory", "local", "redis", "redis2"]
    with TieredProgramCache.from_env({"TIERED_PROGCACHE_REMOTE": f"{redis_url},{s3_bucket.url}",
                                      "TIERED_PROGCACHE_REMOTE_OPTIONS": json.dumps(s3_bucket.storage_options),
                                      "TIERED_PROGCACHE_DIR": str(tmp_path / "e")}) as from_env:  # fmt: skip
        assert [t.name for t in from_env.tiers] == ["memory", "local", "redis", "remote"]


def test_four_tiers_a_write_goes_to_both_shared_tiers_and_an_s3_hit_lands_in_redis(tmp_path, redis_url, s3_bucket, redis_server):
    client = redis_server.client()
    # Node A compiles (real NVRTC): the cubin goes to Redis and S3 in the background.
    before = tpc.compile_count()
    with _four_tiers(tmp_path, "a", redis_url, s3_bucket) as node_a:
        cubin = _compile(node_a)
        assert cubin.startswith(b"\x7fELF") and tpc.compile_count() - before == 1
        assert node_a.flush(timeout=30)
        a = node_a.stats()
        assert (a["redis"].writes, a["remote"].writes) == (2, 2)  # the cubin and its manifest
    names = {e.name for e in LocalDir(tmp_path / "a").iter_entries()}
    (binary,) = [n for n in names if manifest_name(n) in names]
    assert names == {binary, manifest_name(binary)}
    assert [client.exists(f"tiered-progcache:entries:{n}") for n in sorted(names)] == [1, 1]
    assert len(s3_bucket.objects()) == 2

    # Node B: Redis answers; S3 is not asked; no compile.
    with _four_tiers(tmp_path, "b", redis_url, s3_bucket) as node_b:
        assert _compile(node_b) == cubin
        b = node_b.stats()
        assert (b["local"].misses, b["redis"].hits, b["remote"].lookups) == (1, 1, 0)
        assert (b["local"].promotions, b["memory"].promotions) == (1, 1)

    # Redis lost it (evicted, flushed): node C finds it in S3, and the hit is promoted into Redis and the local tiers.
    client.flushall()
    with _four_tiers(tmp_path, "c", redis_url, s3_bucket) as node_c:
        assert _compile(node_c) == cubin
        assert node_c.flush(timeout=30)
        c = node_c.stats()
        assert (c["redis"].misses, c["remote"].hits) == (1, 1)
        assert (c["redis"].promotions, c["local"].promotions, c["memory"].promotions) == (1, 1, 1)
        assert c["remote"].writes == 0  # nothing written back to where it came from
    assert client.exists(f"tiered-progcache:entries:{binary}") == 1
    assert LocalDir(tmp_path / "c").read_entry(binary) == cubin

    # ...so node D is served by Redis again.
    with _four_tiers(tmp_path, "d", redis_url, s3_bucket) as node_d:
        assert _compile(node_d) == cubin
        d = node_d.stats()
        assert (d["redis"].hits, d["remote"].lookups) == (1, 0)
    assert tpc.compile_count() - before == 1  # one NVRTC run for four nodes
    client.close()


def test_two_processes_share_one_redis(tmp_path, redis_url):
    """Node A (a subprocess) compiles; node B (another subprocess, its own local dir) reads it from Redis."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import json, sys
        from cuda.core import ProgramOptions
        import tiered_progcache as tpc
        from tiered_progcache.samples import matmul_source
        with tpc.TieredProgramCache(sys.argv[1], remote=sys.argv[2], strict=True) as cache:
            code = bytes(tpc.compile(matmul_source(32), "c++", ProgramOptions(arch="sm_90"), cache=cache).code)
            cache.flush(30)
            s = cache.stats()
            print(json.dumps({"compiles": tpc.compile_count(), "redis_hits": s["redis"].hits,
                              "redis_writes": s["redis"].writes, "size": len(code)}))
        """
    )
    runs = []
    for node in ("a", "b"):
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / node), redis_url],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    a, b = runs
    assert (a["compiles"], a["redis_hits"], a["redis_writes"]) == (1, 0, 2)  # the cubin and its manifest
    assert (b["compiles"], b["redis_hits"], b["redis_writes"]) == (0, 1, 0)
    assert a["size"] == b["size"]


def test_warm_and_push_on_redis(tmp_path, redis_url):
    ci = LocalDir(tmp_path / "ci")
    payloads = {entry_name(str(n)): bytes([n]) * (100 + n) for n in range(150)}  # more than one batch
    for name, data in payloads.items():
        ci.write_entry(name, data)
    with RedisProgramCache.from_url(redis_url, strict=True, transfer_concurrency=64) as redis_tier:
        pushed = transfer.push(ci, redis_tier)
        assert (pushed.entries, pushed.failures, pushed.skipped) == (150, 0, 0)
        assert pushed.bytes == sum(map(len, payloads.values()))
        again = transfer.push(ci, redis_tier)
        assert (again.entries, again.skipped) == (0, 150)
        node = LocalDir(tmp_path / "node")
        warmed = transfer.warm(redis_tier, node)
        assert (warmed.entries, warmed.failures) == (150, 0)
        assert {e.name: node.read_entry(e.name) for e in node.iter_entries()} == payloads


def test_the_chain_warms_from_its_nearest_shared_tier(tmp_path, redis_url, s3_bucket):
    with RedisProgramCache.from_url(redis_url, strict=True) as redis_tier:
        redis_tier.write_entry(entry_name(b"k"), b"cubin")
    with _four_tiers(tmp_path, "n", redis_url, s3_bucket) as cache:
        assert cache.warm().entries == 1
        assert cache.get(b"k") == b"cubin"
        assert cache.stats()["local"].hits == 1


# -- the command ----------------------------------------------------------------------------------


def test_cli_push_ls_verify_warm_prune_clear_on_redis(tmp_path, redis_url, redis_server):
    ci = LocalDir(tmp_path / "ci")
    payloads = {entry_name(str(n)): bytes([n]) * 500 for n in range(3)}
    for name, data in payloads.items():
        ci.write_entry(name, data)
    flags = ["--remote", redis_url]
    pushed = run_cli("push", "--dir", str(ci.root), *flags)
    assert pushed.returncode == 0 and "pushed 3 kernels (+0 metadata" in pushed.stdout, pushed.stderr

    listed = run_cli("ls", *flags)
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()} == set(payloads)

    client = redis_server.client()
    bad = sorted(payloads)[0]
    client.set(f"tiered-progcache:entries:{bad}", b"planted garbage")
    verified = run_cli("verify", *flags)
    assert verified.returncode == 1 and bad[:12] in verified.stdout + verified.stderr

    warmed = run_cli("warm", "--dir", str(tmp_path / "node"), *flags)
    assert warmed.returncode == 1 and "warmed 2 kernels" in warmed.stdout  # the planted one fails, counted
    assert {e.name for e in LocalDir(tmp_path / "node").iter_entries()} == set(payloads) - {bad}

    pruned = run_cli("prune", "--max-bytes", "1", "--yes", *flags)
    assert pruned.returncode == 0, pruned.stderr
    assert client.keys("tiered-progcache:entries:*") == []

    client.set(f"tiered-progcache:entries:{bad}", b"x")
    cleared = run_cli("clear", "--yes", *flags)
    assert cleared.returncode == 0, cleared.stderr
    assert client.keys("tiered-progcache:entries:*") == []
    client.close()


def test_cli_redis_password_is_masked_and_a_bare_remote_with_two_tiers_is_a_usage_error(tmp_path):
    env = {"TIERED_PROGCACHE_REMOTE": "rediss://:hunter2pw@cache.example:6380/0,s3://bucket/k"}
    shown = run_cli("config", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "hunter2pw" not in shown.stdout
    assert json.loads(shown.stdout)["remote"]["value"] == ["rediss://:***@cache.example:6380/0", "s3://bucket/k"]
    line = assert_one_line_error(run_cli("ls", "--remote", env=env))
    assert "2 shared tiers are configured" in line and "pick one with --remote URL" in line and "hunter2pw" not in line


def test_a_fleet_chain_fills_redis_from_a_read_only_bucket(tmp_path, redis_url, s3_bucket):
    """docs/cluster.md: nodes write Redis while only reading the bucket, with tiers=[...] and a read-only policy."""
    from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

    from tiered_progcache import TierPolicy

    with RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, strict=True) as ci:
        ci.write_key(b"k", b"cubin from CI")
    bucket = RemoteProgramCache.from_url(s3_bucket.url, storage_options=s3_bucket.storage_options, read_only=True)
    redis_tier = RedisProgramCache.from_url(redis_url, strict=True)
    with TieredProgramCache(tiers=[
        InMemoryProgramCache(),
        FileStreamProgramCache(tmp_path / "node"),
        (redis_tier, TierPolicy("redis", write="background", shared=True)),
        (bucket, TierPolicy("remote", read_only=True, shared=True)),
    ]) as fleet:  # fmt: skip
        assert fleet.get(b"k") == b"cubin from CI"
        fleet[b"new"] = b"compiled here"
        assert fleet.flush(timeout=30)
        stats = fleet.stats()
        assert (stats["remote"].hits, stats["remote"].writes, stats["redis"].promotions, stats["redis"].writes) == (1, 0, 1, 2)
    assert redis_tier.read_entry(entry_name(b"k")) == b"cubin from CI"
    assert len(s3_bucket.objects()) == 1  # the bucket was never written


def test_the_default_bulk_methods_loop_over_single_calls(tmp_path):
    """EntryStore.read_many/write_many's defaults (the local directory uses them): one result per name, never raising."""
    local = LocalDir(tmp_path / "d")
    a, b, bad = entry_name(b"a"), entry_name(b"b"), "not-a-name"
    assert local.transfer_batch == 64
    assert local.write_many({a: b"A", b: b"B"}) == BatchWrite(frozenset({a, b}))
    got = local.read_many([a, entry_name(b"absent"), bad])
    assert got.hits == {a: b"A"} and got.missing == {entry_name(b"absent")} and got.failed == {bad}
    assert isinstance(got.errors[bad], ValueError)
    refused = local.write_many({bad: b"x"})
    assert not refused.written and isinstance(refused.errors[bad], ValueError)
